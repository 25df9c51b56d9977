// `mpusim explain`: how every weight of the model is sliced across the tensor-parallel ranks:
// a layer chain in the MPU lab's notation (Y = X A + b, A = W^T), a GPT model parameter by
// parameter in Megatron's state-dict names; then the sharding map: for every parameter, the
// index ranges of the master tensor each tp rank holds (stride-aware) and the global ranks
// that hold them (its pipeline stage's). `--rank R` shows what one rank holds; `--format
// json` gives the map as JSON.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/config_options.h"
#include "core/model/gpt_model.h"
#include "core/model/graph.h"
#include "core/topology.h"

namespace mpusim::cli {
namespace {

// One parameter of the sharding map: where it lives (pp rank, chunk) and how it is split.
struct MappedParameter {
  std::string name;
  Shape full_shape;
  int tp_dim = -1;  // -1: replicated
  int64_t tp_stride = 1;
  int64_t pp_rank = 0;
  int64_t chunk = 0;
  std::string note;  // e.g. a tied copy
};

// The index ranges [begin, end) along `dim` of the master tensor that tp rank `tp_rank` holds.
std::vector<std::pair<int64_t, int64_t>> HeldRanges(const MappedParameter& p, int64_t t,
                                                    int64_t tp_rank) {
  const int64_t full =
      p.tp_dim < 0 ? p.full_shape.front() : p.full_shape[static_cast<size_t>(p.tp_dim)];
  if (p.tp_dim < 0) return {{0, full}};
  ShardSpec spec;
  spec.Split(ShardAxis::kTp, p.tp_dim, t, tp_rank, p.tp_stride);
  return HeldRuns(spec, p.tp_dim, full);
}

// The global ranks with these tp and pp coordinates.
std::vector<int64_t> RanksAt(const Topology& topology, int64_t tp, int64_t pp) {
  std::vector<int64_t> out;
  for (int64_t r = 0; r < topology.world_size(); ++r) {
    const RankCoordinates c = topology.Coordinates(r);
    if (c.tp == tp && c.pp == pp) out.push_back(r);
  }
  return out;
}

// "0, 2, 4-7": runs of consecutive ranks joined; past 12 entries, "... (N ranks)".
std::string RankList(const std::vector<int64_t>& ranks) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j == i ? fmt::format("{}", ranks[i])
                           : fmt::format("{}{}{}", ranks[i], j == i + 1 ? ", " : "-", ranks[j]));
    i = j + 1;
  }
  if (parts.size() > 12) {
    parts.resize(12);
    return fmt::format("{}, ... ({} ranks)", fmt::join(parts, ", "), ranks.size());
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

std::string DimName(const MappedParameter& p) {
  if (p.tp_dim < 0) return "";
  if (p.full_shape.size() == 1) return "elements";
  return p.tp_dim == 0 ? "rows" : "columns";
}

std::string RangesText(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  std::vector<std::string> parts;
  for (const auto& [b, e] : ranges) parts.push_back(fmt::format("[{}, {})", b, e));
  return fmt::format("{}", fmt::join(parts, " "));
}

// The map as text (every parameter, or what `rank` holds) or JSON.
// `rank` -1: every rank.
void PrintShardingMap(const std::vector<MappedParameter>& params, const Topology& topology,
                      int64_t rank, bool json_format, std::ostream& out) {
  const int64_t t = topology.sizes().tp;
  const int64_t pp = topology.sizes().pp;
  std::optional<RankCoordinates> only;
  if (rank >= 0) only = topology.Coordinates(rank);
  nlohmann::ordered_json doc = {{"schema_version", 1},
                                {"world_size", topology.world_size()},
                                {"tensor_model_parallel_size", t},
                                {"pipeline_model_parallel_size", pp}};
  if (only) {
    doc["rank"] = rank;
    doc["coordinates"] = {{"tp", only->tp}, {"pp", only->pp}, {"dp", only->dp}, {"cp", only->cp}};
  }
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  if (!json_format) {
    out << (only ? fmt::format("\nsharding map of rank {} (tp rank {}, pp rank {}, dp rank {}): "
                               "the index ranges of each master tensor it holds\n",
                               rank, only->tp, only->pp, only->dp)
                 : std::string("\nsharding map: the index ranges of each master tensor that each "
                               "tp rank holds, and the global ranks holding them\n"));
  }
  for (const MappedParameter& p : params) {
    if (only && p.pp_rank != only->pp) continue;
    nlohmann::ordered_json shards = nlohmann::ordered_json::array();
    const std::string where =
        pp > 1 ? fmt::format(", pp rank {} chunk {}", p.pp_rank, p.chunk) : std::string();
    if (!json_format) {
      out << fmt::format(
          "  {} {} {}{}{}\n", p.name, ShapeString(p.full_shape),
          p.tp_dim < 0
              ? std::string("replicated")
              : fmt::format("{} split over tp{}", DimName(p),
                            p.tp_stride > 1 ? fmt::format(" with stride {}", p.tp_stride) : ""),
          where, p.note.empty() ? "" : "; " + p.note);
    }
    for (int64_t r = 0; r < (p.tp_dim < 0 ? 1 : t); ++r) {
      if (only && p.tp_dim >= 0 && r != only->tp) continue;
      const auto ranges = HeldRanges(p, t, r);
      std::vector<int64_t> ranks;
      if (p.tp_dim < 0) {
        for (int64_t tp = 0; tp < t; ++tp) {
          for (int64_t g : RanksAt(topology, tp, p.pp_rank)) ranks.push_back(g);
        }
        std::sort(ranks.begin(), ranks.end());
      } else {
        ranks = RanksAt(topology, r, p.pp_rank);
      }
      const std::string held_by =
          fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", RankList(ranks));
      if (!json_format && p.tp_dim >= 0) {
        out << fmt::format("    tp {}: {} {}{}\n", r, DimName(p), RangesText(ranges),
                           only ? std::string() : "  " + held_by);
      } else if (!json_format) {
        out << (only ? std::string("    whole\n") : fmt::format("    whole on {}\n", held_by));
      }
      nlohmann::ordered_json ranges_json = nlohmann::ordered_json::array();
      for (const auto& [b, e] : ranges) ranges_json.push_back({b, e});
      nlohmann::ordered_json shard = {
          {"tp_rank", p.tp_dim < 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(r)},
          {"ranges", ranges_json}};
      if (!only) shard["ranks"] = ranks;
      shards.push_back(shard);
    }
    nlohmann::ordered_json entry = {
        {"name", p.name},
        {"shape", p.full_shape},
        {"split", p.tp_dim < 0
                      ? nlohmann::ordered_json(nullptr)
                      : nlohmann::ordered_json{{"dim", p.tp_dim}, {"stride", p.tp_stride}}},
        {"pp_rank", p.pp_rank},
        {"chunk", p.chunk},
        {"shards", shards}};
    if (!p.note.empty()) entry["note"] = p.note;
    list.push_back(entry);
  }
  doc["parameters"] = list;
  if (json_format) out << doc.dump(1) << '\n';
}

class ExplainCommand : public Command {
 public:
  explicit ExplainCommand(CLI::App* parent) {
    app_ = parent->add_subcommand(
        "explain", "Show how each weight of the model is sliced across tensor-parallel ranks");
    app_->footer(
        "Examples:\n  mpusim explain sample_configs/lab_column_parallel_t16_n16.json\n"
        "  mpusim explain sample_configs/gpt_pipeline_p4_v2_n4.json --rank 3\n"
        "  mpusim explain sample_configs/lab_mlp_lm_t4_dp2_n8.json --format json");
    config_.Register(app_);
    app_->add_option("--format", format_, "text or json (the sharding map; default text)")
        ->check(CLI::IsMember({"text", "json"}));
    rank_option_ =
        app_->add_option("--rank", rank_, "show what one global rank holds")->type_name("INT");
  }
  CLI::App* app() override { return app_; }

  int Run(std::ostream& out, std::ostream& err) override {
    std::optional<ConfigOptions::Layout> layout = config_.ResolveLayout(err);
    if (!layout) return kExitUsage;
    const Topology* topology = &layout->topology;
    // How weights are sliced does not depend on the data: without a run section, explain
    // uses the shortest sequence and the fewest micro-batches every split and schedule accept.
    Config with_run = layout->config;
    if (!with_run.run) {
      RunConfig run;
      run.seq_length = topology->sizes().tp * topology->sizes().cp;
      run.num_microbatches =
          with_run.parallel.microbatch_group_size_per_vp_stage.value_or(topology->sizes().pp);
      with_run.run = run;
    }
    const Config* config = &with_run;
    std::string source;
    if (rank_option_->count() > 0 && !topology->HasRank(rank_)) {
      return ReportError(err, "command line",
                         fmt::format("--rank: {} is not in this layout; ranks are 0..{}", rank_,
                                     topology->world_size() - 1));
    }
    const int64_t rank = rank_option_->count() > 0 ? rank_ : -1;
    json_ = format_ == "json";
    // The text goes to `out` unless only the JSON map is wanted.
    std::ostringstream discard;
    std::ostream& text = json_ ? discard : out;
    if (config->gpt) return ExplainGpt(*config, *topology, rank, text, out, err);
    StatusOr<std::unique_ptr<Graph>> graph = Graph::Build(*config, *topology);
    if (!graph.ok()) {
      return ReportError(err, source, config_.Attribute(graph.status(), &source).Message());
    }
    return ExplainChain(**graph, *topology, rank, text, out);
  }

 private:
  // A layer chain in the lab's notation, then its sharding map.
  int ExplainChain(const Graph& graph, const Topology& topology, int64_t rank, std::ostream& out,
                   std::ostream& map_out) {
    std::vector<MappedParameter> mapped;
    for (const Graph::PlannedLayer& layer : graph.Plan(RankCoordinates{})) {
      for (const Graph::PlannedParameter& p : layer.parameters) {
        mapped.push_back(
            {p.name, p.full_shape, p.tp_dim, p.tp_stride, layer.pp_rank, layer.chunk, ""});
      }
      if (layer.tied_weight.empty()) continue;
      // weight_from: on its owner's pp rank the layer uses the owner's tensor; on another
      // (the last stage, with the owner on the first) that rank holds a copy.
      const auto owner = std::find_if(mapped.begin(), mapped.end(), [&](const MappedParameter& m) {
        return m.name == layer.tied_weight;
      });
      if (owner == mapped.end()) continue;
      if (owner->pp_rank == layer.pp_rank) {
        owner->note += fmt::format("{}also the weight of {} (weight_from)",
                                   owner->note.empty() ? "" : "; ", layer.name);
      } else {
        MappedParameter copy = *owner;
        copy.pp_rank = layer.pp_rank;
        copy.chunk = layer.chunk;
        copy.note = fmt::format(
            "tied: the copy {} uses (weight_from), its gradient all-reduced over embd with pp "
            "rank {}'s",
            layer.name, owner->pp_rank);
        owner->note += fmt::format("{}tied: pp rank {} holds a copy for {} (weight_from)",
                                   owner->note.empty() ? "" : "; ", layer.pp_rank, layer.name);
        mapped.push_back(std::move(copy));
      }
    }
    ExplainChainSlices(graph, topology, out);
    PrintShardingMap(mapped, topology, rank, json_, json_ ? map_out : out);
    return kExitOk;
  }

  // Each layer's weights in the lab's notation, then Graph's plan-time warnings.
  void ExplainChainSlices(const Graph& graph, const Topology& topology, std::ostream& out) {
    const int64_t t = topology.sizes().tp;
    out << fmt::format("tensor_model_parallel_size {}: each weight below is cut into {} slices; "
                       "rank r of a tp group holds slice r\n",
                       t, t);
    // Shapes on every tp rank (equal, but listed as the lab does).
    std::vector<std::vector<Graph::PlannedLayer>> per_rank;
    for (int64_t r = 0; r < t; ++r) {
      RankCoordinates coords;
      coords.tp = r;
      per_rank.push_back(graph.Plan(coords));
    }
    for (size_t i = 0; i < per_rank[0].size(); ++i) {
      const Graph::PlannedLayer& layer = per_rank[0][i];
      out << fmt::format(
          "\n{} {}: input {} -> output {}{}\n", layer.type, layer.name,
          layer.input_width == 0
              ? std::string("tokens")
              : fmt::format("{} ({})", layer.input_width, SplitName(layer.input.split)),
          layer.output_width == 0
              ? std::string("loss")
              : fmt::format("{} ({})", layer.output_width, SplitName(layer.output.split)),
          topology.sizes().pp > 1
              ? fmt::format("; pipeline rank {}, chunk {}", layer.pp_rank, layer.chunk)
              : std::string());
      if (!layer.tied_weight.empty()) {
        out << fmt::format("  weight: {} (weight_from), sliced as there\n", layer.tied_weight);
      }
      for (size_t p = 0; p < layer.parameters.size(); ++p) {
        const Graph::PlannedParameter& param = layer.parameters[p];
        const bool linear = layer.type == "ColumnParallelLinear" ||
                            layer.type == "RowParallelLinear";
        const bool matrix = param.full_shape.size() == 2;
        std::string how =
            param.tp_dim < 0
                ? "replicated on every rank"
                : fmt::format(
                      "split on dim {} into {} slices{}", param.tp_dim, t,
                      param.tp_stride > 1 ? fmt::format(" (stride {})", param.tp_stride) : "");
        out << fmt::format("  {} {} {}\n", param.name, ShapeString(param.full_shape), how);
        if (param.tp_dim < 0) continue;
        if (!(linear && matrix)) {
          std::vector<std::string> slices;
          for (int64_t r = 0; r < t; ++r) {
            slices.push_back(fmt::format("{}{}= {}", param.name.substr(param.name.find('.') + 1),
                                         r, ShapeString(per_rank[static_cast<size_t>(r)][i]
                                                            .parameters[p]
                                                            .local_shape)));
          }
          out << fmt::format("    {}\n", fmt::join(slices, ", "));
          continue;
        }
        // The lab writes Y = X A with A = W^T ([in, out]); a column-parallel layer cuts A's
        // columns, a row-parallel layer A's rows.
        out << fmt::format("    Y = X A + b with A = weight^T {}, sliced {}:\n",
                           ShapeString({param.full_shape[1], param.full_shape[0]}),
                           param.tp_dim == 0 ? "column-wise" : "row-wise");
        std::vector<std::string> slices;
        for (int64_t r = 0; r < t; ++r) {
          const Shape& local = per_rank[static_cast<size_t>(r)][i].parameters[p].local_shape;
          slices.push_back(fmt::format("A{}= {}", r, ShapeString({local[1], local[0]})));
        }
        out << fmt::format("    A = [\n    {}\n    ]\n", fmt::join(slices, ", "));
      }
    }
    // Region mappings that give t-fold gradients as Megatron's code does (docs/simulator.md,
    // "Warnings"); the layout stays valid, so the exit code does too.
    if (!graph.warnings().empty()) out << '\n';
    for (const std::string& warning : graph.warnings()) {
      out << "warning: " << EscapeControl(warning) << '\n';
    }
  }

  // The GPT model: every parameter, its split and this rank's piece, in state-dict order; then
  // the sharding map.
  int ExplainGpt(const Config& config, const Topology& topology, int64_t rank, std::ostream& out,
                 std::ostream& map_out, std::ostream& err) {
    const int64_t pp = topology.sizes().pp;
    std::vector<MappedParameter> mapped;
    for (int64_t stage = 0; stage < pp; ++stage) {
      RankCoordinates coords;
      coords.pp = stage;
      std::string source;
      StatusOr<std::unique_ptr<GptModel>> model = GptModel::Build(config, topology, coords);
      if (!model.ok()) {
        return ReportError(err, source, config_.Attribute(model.status(), &source).Message());
      }
      ExplainGptStage(config, topology, **model, stage, out);
      const std::vector<GptChunk>& chunks = (*model)->chunks();
      for (const auto& p : (*model)->parameters().all()) {
        // The chunk holding it: its layer's, the embedding's first, the head's last.
        int64_t chunk = 0;
        constexpr std::string_view kLayers = "decoder.layers.";
        if (p->name.starts_with(kLayers)) {
          const int64_t layer = std::stoll(p->name.substr(kLayers.size()));
          for (size_t c = 0; c < chunks.size(); ++c) {
            if (std::find(chunks[c].layers.begin(), chunks[c].layers.end(), layer) !=
                chunks[c].layers.end()) {
              chunk = static_cast<int64_t>(c);
            }
          }
        } else if (!p->name.starts_with("embedding.") || p->shared) {
          chunk = static_cast<int64_t>(chunks.size()) - 1;
        }
        const Placement* split = p->shard.Find(ShardAxis::kTp);
        mapped.push_back({p->name, p->full_shape, split != nullptr ? split->dim : -1,
                          split != nullptr ? split->stride : 1, stage, chunk,
                          p->shared ? "the last stage's copy of the tied word embeddings, "
                                      "gradient all-reduced over embd"
                                    : ""});
      }
    }
    PrintShardingMap(mapped, topology, rank, json_, json_ ? map_out : out);
    return kExitOk;
  }

  // One pipeline stage's parameters (the whole model when pp = 1).
  void ExplainGptStage(const Config& config, const Topology& topology, GptModel& model,
                       int64_t stage, std::ostream& out) {
    const GptConfig& gpt = model.gpt();
    const int64_t t = topology.sizes().tp;
    const int64_t pp = topology.sizes().pp;
    const bool sp = config.parallel.sequence_parallel && t > 1;
    if (stage == 0) {
      out << fmt::format(
          "GPT model (Megatron-Core GPTModel, local layer spec), "
          "tensor_model_parallel_size {}, sequence_parallel {}: a split parameter "
          "is cut into {} slices and rank r of a tp group holds slice r\n",
          t, sp, t);
    }
    if (pp > 1) {
      std::vector<std::string> chunks;
      for (const GptChunk& chunk : model.chunks()) {
        std::vector<std::string> parts;
        if (chunk.pre_process) parts.push_back("embedding");
        if (!chunk.layers.empty()) {
          parts.push_back(
              chunk.layers.size() == 1
                  ? fmt::format("layer {}", chunk.layers.front())
                  : fmt::format("layers {}-{}", chunk.layers.front(), chunk.layers.back()));
        }
        if (chunk.post_process) parts.push_back("final norm, output layer, loss");
        chunks.push_back(fmt::format("[{}]", fmt::join(parts, ", ")));
      }
      out << fmt::format("pipeline stage {} of {}: chunks {}\n", stage, pp, fmt::join(chunks, " "));
    }
    const int64_t groups_local = gpt.num_query_groups / t;
    const int64_t per_group = gpt.num_attention_heads / gpt.num_query_groups;
    for (const auto& p : model.parameters().all()) {
      const Shape local = LocalShape(p->shard, p->full_shape);
      std::string how = "replicated";
      const Placement* split = p->shard.Find(ShardAxis::kTp);
      if (split != nullptr) {
        how = fmt::format("split on dim {}{}: {} per rank", split->dim,
                          split->stride > 1 ? fmt::format(" with stride {}", split->stride) : "",
                          ShapeString(local));
      }
      std::string note;
      if (p->name.find("linear_qkv") != std::string::npos) {
        note = fmt::format("; per rank {} query group{} of ({} query head{}, 1 key, 1 value) x {} "
                           "channels",
                           groups_local, groups_local == 1 ? "" : "s", per_group,
                           per_group == 1 ? "" : "s", gpt.kv_channels);
      } else if (split != nullptr && split->stride == 2) {
        note = "; per rank its gate rows, then the same up rows (SwiGLU)";
      } else if (p->name == "embedding.word_embeddings.weight" && t > 1) {
        note = fmt::format("; rank r holds vocabulary rows [{} r, {} (r + 1))", local[0], local[0]);
      }
      if (p->sequence_parallel) note += "; gradient all-reduced over tp (sequence parallel)";
      if (p->embedding_group) {
        note +=
            "; tied: the first and the last stage each hold it, gradient all-reduced over "
            "embd";
      }
      out << fmt::format("  {} {} {}{}\n", p->name, ShapeString(p->full_shape), how, note);
    }
    if (gpt.share_embeddings_and_output_weights && stage == pp - 1) {
      out << "  output_layer uses embedding.word_embeddings.weight (shared)\n";
    }
  }

  CLI::App* app_ = nullptr;
  ConfigOptions config_;
  std::string format_ = "text";
  CLI::Option* rank_option_ = nullptr;
  int64_t rank_ = 0;
  bool json_ = false;
};

}  // namespace

std::unique_ptr<Command> MakeExplainCommand(CLI::App* parent) {
  return std::make_unique<ExplainCommand>(parent);
}

}  // namespace mpusim::cli
