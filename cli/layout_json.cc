// The layout as JSON (layout_report.h: `mpusim layout --format json`, schema_version 1, with
// the groups streamed so that 2^20-rank layouts build no JSON tree, and one rank's `--rank R
// --format json`), which the HTML page embeds. Not the text (layout_report.cc).
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "cli/layout_report.h"
#include "core/schedule.h"

namespace mpusim::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

ordered_json SizesJson(const Topology& topology) {
  const DerivedSizes& s = topology.sizes();
  ordered_json j;
  j["tp"] = s.tp;
  j["pp"] = s.pp;
  j["cp"] = s.cp;
  j["dp"] = s.dp;
  j["vp"] = s.vp ? ordered_json(*s.vp) : ordered_json(nullptr);
  j["ep"] = s.ep;
  j["etp"] = s.etp;
  j["edp"] = s.edp;
  j["num_distributed_optimizer_instances"] = s.num_distributed_optimizer_instances;
  return j;
}

// The layer assignment, when the config sets num_layers; null otherwise.
ordered_json LayersJson(const Topology& topology) {
  const ParallelConfig& c = topology.config();
  if (!c.num_layers) return nullptr;
  auto layers = AssignLayers(c.Split(), *c.num_layers);
  if (!layers.ok()) return nullptr;
  ordered_json j;
  j["num_layers"] = *c.num_layers;
  j["per_pp_rank"] = *layers;
  return j;
}

}  // namespace

void PrintLayoutJson(const Topology& topology, const LayoutReportOptions& options,
                     std::ostream& out) {
  const ParallelConfig& c = topology.config();
  ordered_json head;
  head["schema_version"] = 1;
  head["source"] = options.source;
  head["world_size"] = topology.world_size();
  head["rank_offset"] = c.rank_offset;
  head["order"] = c.order;
  head["sizes"] = SizesJson(topology);
  nlohmann::json config;
  ToJson(c, &config);
  head["config"] = config;
  ordered_json nodes;
  nodes["gpus_per_node"] = c.gpus_per_node;
  nodes["num_nodes"] = NumNodes(topology);
  ordered_json spanning = ordered_json::object();
  for (size_t kind : options.kinds) {
    spanning[topology.kinds()[kind].name] = topology.NumGroupsSpanningNodes(kind);
  }
  nodes["groups_spanning_nodes"] = spanning;
  head["nodes"] = nodes;
  head["layers"] = LayersJson(topology);
  head["warnings"] = NodeWarnings(topology);

  // Write the small fields through nlohmann, then stream the groups.
  std::string text = head.dump(1);
  text.pop_back();  // the closing '}'
  while (!text.empty() && text.back() == '\n') text.pop_back();
  out << text << ",\n \"groups\": {";
  std::vector<int32_t> flat;
  std::string buffer;
  for (size_t i = 0; i < options.kinds.size(); ++i) {
    const size_t kind = options.kinds[i];
    topology.Enumerate(kind, &flat);
    const size_t size = static_cast<size_t>(topology.GroupSize(kind));
    buffer.clear();
    buffer += fmt::format("{}\n  \"{}\": [", i == 0 ? "" : ",", topology.kinds()[kind].name);
    for (size_t start = 0; start < flat.size(); start += size) {
      buffer += start == 0 ? "[" : ", [";
      for (size_t k = 0; k < size; ++k) {
        if (k > 0) buffer += ", ";
        buffer += std::to_string(flat[start + k]);
      }
      buffer += ']';
      if (buffer.size() > (1u << 20)) {
        out << buffer;
        buffer.clear();
      }
    }
    buffer += ']';
    out << buffer;
  }
  out << "\n }\n}\n";
}

void PrintRankJson(const Topology& topology, int64_t rank, const LayoutReportOptions& options,
                   std::ostream& out) {
  const RankCoordinates coords = topology.Coordinates(rank);
  ordered_json j;
  j["schema_version"] = 1;
  j["source"] = options.source;
  j["world_size"] = topology.world_size();
  j["rank"] = rank;
  j["node"] = coords.node;
  j["local_rank"] = coords.local_rank;
  j["sizes"] = SizesJson(topology);
  j["coordinates"] = {{"tp", coords.tp}, {"cp", coords.cp},   {"dp", coords.dp},
                      {"pp", coords.pp}, {"etp", coords.etp}, {"ep", coords.ep},
                      {"edp", coords.edp}};
  ordered_json groups = ordered_json::object();
  for (size_t kind : options.kinds) {
    const std::optional<GroupSlot> slot = topology.Locate(kind, rank);
    if (!slot) {
      groups[topology.kinds()[kind].name] = nullptr;
      continue;
    }
    // Groups larger than a whole listing would cover keep their size but not their members.
    const int64_t size = topology.GroupSize(kind);
    groups[topology.kinds()[kind].name] = {
        {"group_index", slot->group_index},
        {"rank_in_group", slot->rank_in_group},
        {"group_size", size},
        {"ranks", size <= kMaxListedRanks ? ordered_json(topology.Group(kind, slot->group_index))
                                          : ordered_json(nullptr)}};
  }
  j["groups"] = groups;
  out << j.dump(1) << '\n';
}

}  // namespace mpusim::cli
