// The layout's text renderings (see layout_report.h): the MPU lab's listing of every group
// kind with the node map and the layer assignment, the node-by-GPU picture, one rank's
// coordinates and groups, and the node warnings. Not the JSON (layout_json.cc), the HTML page
// (layout_html.cc) nor the schedule's SVG (schedule_svg.cc).
#include "cli/layout_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "core/schedule.h"

namespace mpusim::cli {
namespace {

constexpr size_t kLineWidth = 100;

// "<count> <kind> groups (<title>):", in the MPU lab's wording for its three kinds.
std::string KindHeading(const Topology& topology, size_t kind) {
  const GroupKind& info = topology.kinds()[kind];
  const int64_t count = topology.NumGroups(kind);
  if (info.name == "dp") return fmt::format("{} data_parallel groups:", count);
  if (info.name == "tp") return fmt::format("{} tensor model-parallel groups:", count);
  if (info.name == "pp") return fmt::format("{} pipeline model-parallel groups:", count);
  return fmt::format("{} {} groups ({}):", count, info.name, info.title);
}

// "[g0, g2], [g1, g3], ..." wrapped at kLineWidth, each line indented by 4.
void PrintGroupList(const Topology& topology, size_t kind, int64_t max_groups,
                    std::ostream& out) {
  const int64_t groups = topology.NumGroups(kind);
  const int64_t shown = max_groups > 0 ? std::min(groups, max_groups) : groups;
  std::string line = "   ";
  for (int64_t g = 0; g < shown; ++g) {
    std::string item = "[";
    const std::vector<int64_t> ranks = topology.Group(kind, g);
    for (size_t k = 0; k < ranks.size(); ++k) {
      item += fmt::format("{}g{}", k == 0 ? "" : ", ", ranks[k]);
    }
    item += g + 1 < groups ? "]," : "]";
    if (line.size() + 1 + item.size() > kLineWidth && line.size() > 3) {
      out << line << '\n';
      line = "   ";
    }
    line += " " + item;
  }
  if (shown < groups) {
    line += fmt::format(" ... {} more (--max-groups 0 shows all)", groups - shown);
  }
  out << line << '\n';
}

std::string OptionalText(const std::optional<int64_t>& v) {
  return v ? std::to_string(*v) : "-";
}

}  // namespace

int64_t NumNodes(const Topology& topology) {
  const int64_t first = topology.NodeOf(topology.first_rank());
  const int64_t last = topology.NodeOf(topology.first_rank() + topology.world_size() - 1);
  return last - first + 1;
}

std::vector<size_t> DefaultTextKindOrder(const Topology& topology) {
  std::vector<size_t> order;
  for (const char* name : {"dp", "tp", "pp"}) order.push_back(*topology.FindKind(name));
  for (size_t i = 0; i < topology.kinds().size(); ++i) {
    if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
  }
  return order;
}

// The kinds whose groups leaving a node are worth a warning: tp, expt_tp and ep, less
// expt_tp when its groups are tp's (the dense expert layout, ep = 1 and etp = tp: one
// warning for the same groups is enough).
// A direct kind's groups are fixed by its size and its generator's stride (the group of rank
// r is r's run of `size` ranks `stride` apart), so the comparison is O(1) at any world size.
std::vector<const char*> NodeWarningKinds(const Topology& topology) {
  const DerivedSizes& s = topology.sizes();
  const bool same =
      s.etp == s.tp && topology.dense().Stride(Axis::kTp) == topology.expert().Stride(Axis::kTp);
  if (same) return {"tp", "ep"};
  return {"tp", "expt_tp", "ep"};
}

std::vector<std::string> NodeWarnings(const Topology& topology) {
  std::vector<std::string> warnings;
  const int64_t gpus = topology.config().gpus_per_node;
  for (const char* name : NodeWarningKinds(topology)) {
    const size_t kind = *topology.FindKind(name);
    const int64_t spanning = topology.NumGroupsSpanningNodes(kind);
    if (spanning == 0) continue;
    warnings.push_back(fmt::format(
        "{} of {} {} groups (size {}) span nodes with gpus_per_node {}: their collectives "
        "would cross the inter-node network; keep {} groups inside a node",
        spanning, topology.NumGroups(kind), name, topology.GroupSize(kind), gpus, name));
  }
  return warnings;
}

std::vector<std::string> RankNodeWarnings(const Topology& topology, int64_t rank) {
  std::vector<std::string> warnings;
  const int64_t gpus = topology.config().gpus_per_node;
  for (const char* name : NodeWarningKinds(topology)) {
    const size_t kind = *topology.FindKind(name);
    const std::optional<GroupSlot> slot = topology.Locate(kind, rank);
    if (!slot || !topology.GroupSpansNodes(kind, slot->group_index)) continue;
    warnings.push_back(fmt::format(
        "rank {}'s {} group (size {}) spans nodes with gpus_per_node {}: its collectives would "
        "cross the inter-node network; keep {} groups inside a node",
        rank, name, topology.GroupSize(kind), gpus, name));
  }
  return warnings;
}

void PrintLayoutText(const Topology& topology, const LayoutReportOptions& options,
                     std::ostream& out) {
  const ParallelConfig& c = topology.config();
  const DerivedSizes& s = topology.sizes();
  const int64_t n = topology.world_size();
  out << fmt::format("layout of {}: world_size {}, order {}", options.source, n, c.order);
  if (c.rank_offset != 0) {
    out << fmt::format(", ranks {}..{}", c.rank_offset, c.rank_offset + n - 1);
  }
  out << '\n';
  const auto row = [&out](std::string_view key, const std::string& value,
                          const std::string& note = "") {
    out << fmt::format("  {:<38}{:>6}{}\n", key, value, note.empty() ? "" : "   " + note);
  };
  row(ParallelKey(&ParallelConfig::tensor_model_parallel_size), std::to_string(s.tp));
  row("pipeline_model_parallel_size", std::to_string(s.pp));
  row("virtual_pipeline_model_parallel_size", OptionalText(s.vp));
  row(ParallelKey(&ParallelConfig::context_parallel_size), std::to_string(s.cp));
  row("data_parallel_size", std::to_string(s.dp),
      fmt::format("derived: {} / (tp {} * pp {} * cp {})", n, s.tp, s.pp, s.cp));
  row("expert_model_parallel_size", std::to_string(s.ep));
  row("expert_tensor_parallel_size", std::to_string(s.etp),
      c.expert_tensor_parallel_size ? "" : "default: tensor_model_parallel_size");
  row("expert_data_parallel_size", std::to_string(s.edp),
      fmt::format("derived: {} / (etp {} * ep {} * pp {})", n, s.etp, s.ep, s.pp));
  row("num_distributed_optimizer_instances", std::to_string(s.num_distributed_optimizer_instances));
  if (!c.hierarchical_context_parallel_sizes.empty()) {
    row("hierarchical_context_parallel_sizes",
        fmt::format("[{}]", fmt::join(c.hierarchical_context_parallel_sizes, ", ")));
  }
  row("gpus_per_node", std::to_string(c.gpus_per_node), fmt::format("{} node{}", NumNodes(topology), NumNodes(topology) == 1 ? "" : "s"));

  const size_t mp = *topology.FindKind("mp");
  for (size_t kind : options.kinds) {
    out << '\n';
    if (kind == mp) {
      // The MPU lab's wording: one line per model-parallel group.
      const int64_t groups = topology.NumGroups(mp);
      out << fmt::format("Total :{} full models being partitioned into :{} GPUs  (mp groups: "
                         "tensor x pipeline)\n",
                         groups, n);
      const int64_t shown =
          options.max_groups > 0 ? std::min(groups, options.max_groups) : groups;
      for (int64_t g = 0; g < shown; ++g) {
        out << fmt::format("model {} : is partitioned into gpus :{}\n", g,
                           fmt::join(topology.Group(mp, g), ","));
      }
      if (shown < groups) {
        out << fmt::format("... {} more (--max-groups 0 shows all)\n", groups - shown);
      }
      continue;
    }
    out << KindHeading(topology, kind) << '\n';
    PrintGroupList(topology, kind, options.max_groups, out);
  }

  out << fmt::format("\nnode map: {} node{} of {} GPUs; rank r is on node r / {}\n",
                     NumNodes(topology), NumNodes(topology) == 1 ? "" : "s", c.gpus_per_node,
                     c.gpus_per_node);
  std::vector<std::string> spanning;
  std::vector<std::string> local;
  for (size_t kind : options.kinds) {
    const int64_t count = topology.NumGroupsSpanningNodes(kind);
    const std::string& name = topology.kinds()[kind].name;
    if (count > 0) {
      spanning.push_back(fmt::format("{} {}/{}", name, count, topology.NumGroups(kind)));
    } else {
      local.push_back(name);
    }
  }
  out << fmt::format("  groups that span nodes:   {}\n",
                     spanning.empty() ? "none" : fmt::format("{}", fmt::join(spanning, ", ")));
  out << fmt::format("  groups inside one node:   {}\n",
                     local.empty() ? "none" : fmt::format("{}", fmt::join(local, ", ")));

  if (c.num_layers) {
    auto layers = AssignLayers(c.Split(), *c.num_layers);
    out << fmt::format("\nlayer assignment ({} layers", *c.num_layers);
    if (!c.Split().Even()) out << ", " << DescribeSplit(c.Split());
    if (!layers.ok()) {
      out << fmt::format("): not possible: {}\n", layers.status().Message());
    } else {
      out << (s.vp ? fmt::format(", {} model chunks per pipeline rank", *s.vp) : "")
          << "; numbered from 1 as Megatron's layer_number: layer n is decoder.layers.<n-1> "
             "in the state dict and in mpusim explain):\n";
      for (size_t r = 0; r < layers->size(); ++r) {
        out << fmt::format("  pp rank {}:", r);
        for (const auto& chunk : (*layers)[r]) out << fmt::format(" [{}]", fmt::join(chunk, ", "));
        out << '\n';
      }
    }
  }
}

void PrintLayoutPicture(const Topology& topology, std::ostream& out) {
  const ParallelConfig& c = topology.config();
  const DerivedSizes& s = topology.sizes();
  struct Column {
    const char* label;
    int64_t size;
    int64_t RankCoordinates::*coord;
  };
  // Expert coordinates are shown only when the expert layout differs from the dense one.
  const bool expert_differs = s.ep > 1 || s.etp != s.tp;
  std::vector<Column> columns;
  for (const Column& col : {Column{"tp", s.tp, &RankCoordinates::tp},
                            Column{"cp", s.cp, &RankCoordinates::cp},
                            Column{"dp", s.dp, &RankCoordinates::dp},
                            Column{"pp", s.pp, &RankCoordinates::pp}}) {
    if (col.size > 1) columns.push_back(col);
  }
  if (expert_differs) {
    for (const Column& col : {Column{"ep", s.ep, &RankCoordinates::ep},
                              Column{"etp", s.etp, &RankCoordinates::etp},
                              Column{"edp", s.edp, &RankCoordinates::edp}}) {
      if (col.size > 1) columns.push_back(col);
    }
  }
  std::vector<std::string> labels;
  for (const Column& col : columns) labels.push_back(col.label);
  out << fmt::format("picture: one row per node, one cell per GPU: g<rank> then {}\n",
                     columns.empty() ? std::string("(every axis has size 1)")
                                     : fmt::format("{}", fmt::join(labels, " ")));
  const int64_t first = topology.first_rank();
  const int64_t last = first + topology.world_size() - 1;
  std::vector<std::string> cells;
  size_t width = 0;
  for (int64_t rank = first; rank <= last; ++rank) {
    const RankCoordinates coords = topology.Coordinates(rank);
    std::string cell = fmt::format("g{}", rank);
    for (const Column& col : columns) cell += fmt::format(" {}{}", col.label, coords.*col.coord);
    width = std::max(width, cell.size());
    cells.push_back(std::move(cell));
  }
  const int64_t gpus = c.gpus_per_node;
  for (int64_t node = topology.NodeOf(first); node <= topology.NodeOf(last); ++node) {
    std::string line = fmt::format("node {:>3} |", node);
    for (int64_t local = 0; local < gpus; ++local) {
      const int64_t rank = node * gpus + local;
      const std::string cell =
          rank < first || rank > last ? std::string() : cells[static_cast<size_t>(rank - first)];
      line += fmt::format(" {:<{}} |", cell, width);
    }
    out << line << '\n';
  }
}

void PrintRankText(const Topology& topology, int64_t rank, const LayoutReportOptions& options,
                   std::ostream& out) {
  const RankCoordinates coords = topology.Coordinates(rank);
  const DerivedSizes& s = topology.sizes();
  out << fmt::format("rank {}: node {}, local GPU {}\n", rank, coords.node, coords.local_rank);
  out << fmt::format("  coordinates:        tp {}/{}  cp {}/{}  dp {}/{}  pp {}/{}\n", coords.tp,
                     s.tp, coords.cp, s.cp, coords.dp, s.dp, coords.pp, s.pp);
  out << fmt::format("  expert coordinates: etp {}/{}  ep {}/{}  edp {}/{}  pp {}/{}\n",
                     coords.etp, s.etp, coords.ep, s.ep, coords.edp, s.edp, coords.pp, s.pp);
  const ParallelConfig& c = topology.config();
  if (c.num_layers) {
    auto layers = AssignLayers(c.Split(), *c.num_layers);
    if (layers.ok()) {
      out << "  layers:            ";
      for (const auto& chunk : (*layers)[static_cast<size_t>(coords.pp)]) {
        out << fmt::format(" [{}]", fmt::join(chunk, ", "));
      }
      out << '\n';
    }
  }
  out << "  groups (index of the group among its kind, position of this rank in it):\n";
  constexpr size_t kMaxMembersShown = 32;
  for (size_t kind : options.kinds) {
    const GroupKind& info = topology.kinds()[kind];
    const std::optional<GroupSlot> slot = topology.Locate(kind, rank);
    if (!slot) {
      out << fmt::format("    {:<16} -  (this rank has no {} group)\n", info.name, info.name);
      continue;
    }
    const int64_t size = topology.GroupSize(kind);
    std::vector<int64_t> members;
    for (int64_t k = 0; k < size && members.size() < kMaxMembersShown; ++k) {
      members.push_back(topology.Member(kind, slot->group_index, k));
    }
    out << fmt::format("    {:<16} group {} of {}, position {} of {}: [{}{}]\n", info.name,
                       slot->group_index, topology.NumGroups(kind), slot->rank_in_group, size,
                       fmt::join(members, ", "),
                       static_cast<size_t>(size) > members.size() ? ", ..." : "");
  }
}

}  // namespace mpusim::cli
