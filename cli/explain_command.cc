// `mpusim explain`: how every weight of the model is sliced across the tensor-parallel ranks:
// a layer chain in the MPU lab's notation (Y = X A + b, A = W^T), a GPT model parameter by
// parameter in Megatron's state-dict names; then the sharding map: for every parameter, the
// index ranges of the master tensor each tp rank holds (stride-aware) and the global ranks
// that hold them (its pipeline stage's). `--rank R` shows what one rank holds; `--format
// json` gives the map as JSON.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
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
#include "cli/layout_report.h"
#include "core/config/model_facts.h"
#include "core/model/model.h"
#include "core/topology.h"

namespace mpusim::cli {
namespace {

// One parameter of the sharding map: where it lives (pp rank, chunk) and how it is split.
using MappedParameter = ParameterPlacement;

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

// The global ranks holding piece `piece` of `p` (-1: any), in increasing order, found from
// the rank formula instead of a scan of the world: those at its stage with that tp
// coordinate (etp for an expert weight split over expt_tp) and, for an expert's weight under
// expert parallelism, its ep rank; every other axis is free. An expert weight is split over
// etp whenever it has an ep rank (experts laid out apart), so one generator holds every
// fixed coordinate. O(1) to count, O(axes) per rank to walk.
class RanksAt {
 public:
  RanksAt(const Topology& topology, const MappedParameter& p, int64_t piece) {
    const bool expert = p.over_etp || p.ep_rank >= 0;
    const RankGenerator& gen = expert ? topology.expert() : topology.dense();
    base_ = gen.rank_offset() + p.pp_rank * gen.Stride(Axis::kPp);
    if (piece >= 0) base_ += piece * gen.Stride(Axis::kTp);
    if (p.ep_rank >= 0) base_ += p.ep_rank * gen.Stride(Axis::kEp);
    for (Axis axis : gen.order()) {  // fastest first: ascending strides
      const bool fixed = axis == Axis::kPp || (axis == Axis::kTp && piece >= 0) ||
                         (axis == Axis::kEp && p.ep_rank >= 0);
      if (!fixed && gen.Size(axis) > 1) free_.push_back({gen.Stride(axis), gen.Size(axis)});
    }
  }
  int64_t count() const {
    int64_t n = 1;
    for (const Free& f : free_) n *= f.size;
    return n;
  }
  // Calls visit(rank) in increasing order until it returns false.
  template <typename Visit>
  void ForEach(Visit visit) const {
    std::vector<int64_t> digit(free_.size(), 0);
    for (int64_t rank = base_;;) {
      if (!visit(rank)) return;
      size_t i = 0;  // the mixed-radix increment: carry into slower axes
      for (; i < free_.size() && ++digit[i] == free_[i].size; ++i) {
        rank -= (free_[i].size - 1) * free_[i].stride;
        digit[i] = 0;
      }
      if (i == free_.size()) return;
      rank += free_[i].stride;
    }
  }
  std::vector<int64_t> All() const {
    std::vector<int64_t> out;
    ForEach([&](int64_t r) {
      out.push_back(r);
      return true;
    });
    return out;
  }

 private:
  struct Free {
    int64_t stride, size;
  };
  int64_t base_ = 0;
  std::vector<Free> free_;
};

// "0, 2, 4-7": runs of consecutive ranks joined; past 12 entries, "... (N ranks)". Walks no
// further than the 13th run.
std::string RankList(const RanksAt& ranks) {
  std::vector<std::string> parts;
  int64_t first = -1, last = -1;
  const auto close_run = [&] {
    parts.push_back(first == last ? fmt::format("{}", first)
                                  : fmt::format("{}{}{}", first, last == first + 1 ? ", " : "-",
                                                last));
  };
  ranks.ForEach([&](int64_t r) {
    if (first >= 0 && r == last + 1) {
      last = r;
      return true;
    }
    if (first >= 0) close_run();
    first = last = r;
    return parts.size() <= 12;
  });
  if (parts.size() <= 12) close_run();
  if (parts.size() > 12) {
    parts.resize(12);
    return fmt::format("{}, ... ({} ranks)", fmt::join(parts, ", "), ranks.count());
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

// The most shards (a parameter's piece on one tp or etp rank) the whole map's JSON lists.
constexpr int64_t kMaxJsonShards = int64_t{1} << 16;

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
                      int64_t rank, bool json_format, std::ostream& out, int64_t seq_length) {
  const int64_t t = topology.sizes().tp;
  const int64_t pp = topology.sizes().pp;
  std::optional<RankCoordinates> only;
  if (rank >= 0) only = topology.Coordinates(rank);
  nlohmann::ordered_json doc = {{"schema_version", 1},
                                {"world_size", topology.world_size()},
                                {ParallelKey(&ParallelConfig::tensor_model_parallel_size), t},
                                {"pipeline_model_parallel_size", pp}};
  const int64_t cp = topology.sizes().cp;
  doc[std::string(ParallelKey(&ParallelConfig::context_parallel_size))] = cp;
  const bool experts_apart = topology.sizes().experts_apart();
  if (experts_apart) {
    doc["expert_model_parallel_size"] = topology.sizes().ep;
    doc["expert_tensor_parallel_size"] = topology.sizes().etp;
  }
  if (cp > 1) {
    // Megatron's load-balanced split: cp rank r holds chunks r and 2 cp - 1 - r of 2 cp.
    const int64_t c = seq_length / (2 * cp);
    // One rank's map holds its own cp rank's positions only (O(1) at any cp).
    nlohmann::ordered_json held = nlohmann::ordered_json::array();
    for (int64_t r = only ? only->cp : 0; r < (only ? only->cp + 1 : cp); ++r) {
      const int64_t second = 2 * cp - 1 - r;
      held.push_back({{"cp_rank", r},
                      {"ranges", {{r * c, r * c + c}, {second * c, second * c + c}}}});
    }
    doc["seq_length"] = seq_length;
    doc["sequence_positions"] = held;
  }
  if (only) {
    doc["rank"] = rank;
    doc["coordinates"] = {{"tp", only->tp}, {"pp", only->pp}, {"dp", only->dp}, {"cp", only->cp}};
    if (experts_apart) {
      doc["coordinates"]["ep"] = only->ep;
      doc["coordinates"]["etp"] = only->etp;
    }
  }
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  if (!json_format) {
    out << (only ? fmt::format("\nsharding map of rank {} (tp rank {}, pp rank {}, dp rank {}{}): "
                               "the index ranges of each master tensor it holds\n",
                               rank, only->tp, only->pp, only->dp,
                               experts_apart ? fmt::format(", ep rank {}, etp rank {}", only->ep,
                                                           only->etp)
                                             : std::string())
                 : std::string("\nsharding map: the index ranges of each master tensor that each "
                               "tp rank holds, and the global ranks holding them\n"));
  }
  for (const MappedParameter& p : params) {
    if (only && (p.pp_rank != only->pp || (p.ep_rank >= 0 && p.ep_rank != only->ep))) continue;
    // The group splitting it: tp, or expt_tp for an expert weight split over etp ranks.
    const int64_t pieces = p.over_etp ? topology.sizes().etp : t;
    const char* over = p.over_etp ? "expt_tp" : "tp";
    const char* piece_name = p.over_etp ? "etp" : "tp";
    nlohmann::ordered_json shards = nlohmann::ordered_json::array();
    const std::string where =
        pp > 1 ? fmt::format(", pp rank {} chunk {}", p.pp_rank, p.chunk) : std::string();
    if (!json_format) {
      out << fmt::format(
          "  {} {} {}{}{}{}\n", p.name, ShapeString(p.full_shape),
          p.tp_dim < 0 && p.ep_rank >= 0 ? std::string("whole")
          : p.tp_dim < 0                  ? std::string("replicated")
              : fmt::format("{} split over {}{}", DimName(p), over,
                            p.tp_stride > 1 ? fmt::format(" with stride {}", p.tp_stride) : ""),
          where,
          p.ep_rank >= 0 ? fmt::format(", ep rank {}", p.ep_rank) : std::string(),
          p.note.empty() ? "" : "; " + p.note);
    }
    // One rank's query visits its own piece only, so it costs O(1) per parameter at any tp.
    const int64_t own = only && p.tp_dim >= 0 ? (p.over_etp ? only->etp : only->tp) : 0;
    const int64_t end = p.tp_dim < 0 ? 1 : only ? own + 1 : pieces;
    for (int64_t r = own; r < end; ++r) {
      const auto ranges = HeldRanges(p, pieces, r);
      const RanksAt ranks(topology, p, p.tp_dim < 0 ? -1 : r);
      const std::string held_by =
          only ? std::string()
               : fmt::format("{} {}", ranks.count() == 1 ? "rank" : "ranks", RankList(ranks));
      if (!json_format && p.tp_dim >= 0) {
        out << fmt::format("    {} {}: {} {}{}\n", piece_name, r, DimName(p), RangesText(ranges),
                           only ? std::string() : "  " + held_by);
      } else if (!json_format) {
        out << (only ? std::string("    whole\n") : fmt::format("    whole on {}\n", held_by));
      }
      if (!json_format) continue;  // the text needs no tree (2^20 pieces would take a GiB)
      nlohmann::ordered_json ranges_json = nlohmann::ordered_json::array();
      for (const auto& [b, e] : ranges) ranges_json.push_back({b, e});
      nlohmann::ordered_json shard = {
          {p.over_etp ? "etp_rank" : "tp_rank",
           p.tp_dim < 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(r)},
          {"ranges", ranges_json}};
      if (!only) shard["ranks"] = ranks.All();
      shards.push_back(shard);
    }
    nlohmann::ordered_json entry = {
        {"name", p.name},
        {"shape", p.full_shape},
        {"split", p.tp_dim < 0 ? nlohmann::ordered_json(nullptr)
                               : nlohmann::ordered_json{{"dim", p.tp_dim},
                                                        {"stride", p.tp_stride},
                                                        {"group", over}}},
        {"pp_rank", p.pp_rank},
        {"chunk", p.chunk},
        {"shards", std::move(shards)}};
    if (p.ep_rank >= 0) entry["ep_rank"] = p.ep_rank;
    if (!p.note.empty()) entry["note"] = p.note;
    if (json_format) list.push_back(std::move(entry));
  }
  doc["parameters"] = list;
  if (json_format) out << doc.dump(1) << '\n';
}

// The dtypes of the parameters, the gradient buffer and the optimizer state, and why
// (core/config/optimizer_config.h PrecisionOf: Megatron's rules).
std::string PrecisionText(const Config& config) {
  const OptimizerPrecision p = PrecisionOf(config);
  const DType storage = config.run ? config.run->dtype
                                   : MegatronStorageDType(config.parallel).value_or(
                                         DType::kFloat32);
  std::string why;
  if (storage == DType::kFloat16) {
    why = p.main_grad == DType::kFloat16
              ? " (fp16 without accumulate_allreduce_grads_in_fp32, as Megatron)"
              : " (accumulate_allreduce_grads_in_fp32)";
  } else if (storage == DType::kBFloat16) {
    why = p.main_grad == DType::kBFloat16 ? " (grad_reduce_in_bf16)"
                                           : " (Megatron forces float32 for bf16)";
  }
  std::string text = fmt::format(
      "precision: parameters in {}; main_grad in {}{}, accumulated over the micro-batches and "
      "reduced over data parallelism in it",
      DTypeName(storage), DTypeName(p.main_grad), why);
  if (p.grads_copied_for_step && config.optimizer) text += ", copied to float32 for the step";
  if (config.optimizer) {
    text += fmt::format("; master weights in {}, optimizer state in {}", MasterStorageName(p),
                        p.exp_avg == p.exp_avg_sq ? std::string(DTypeName(p.exp_avg))
                                                  : fmt::format("{} and {}", DTypeName(p.exp_avg),
                                                                DTypeName(p.exp_avg_sq)));
  }
  const MoeConfig moe = FactsOf(config).moe;
  if (moe.enabled()) {
    const RouterDTypes router = RouterDTypesOf(moe, storage);
    text += fmt::format("; the MoE router's logits and probabilities in {}{}, its softmaxes in {}",
                        DTypeName(router.logits), moe.router_dtype ? " (moe_router_dtype)" : "",
                        DTypeName(router.scores));
  }
  return text;
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
    std::optional<ConfigOptions::Layout> layout =
        config_.ResolveModelLayout(err, "explain", "the sharding map is a model's");
    if (!layout) return kExitUsage;
    const Topology* topology = &layout->topology;
    // How weights are sliced does not depend on the data: without a run section, explain
    // uses the shortest sequence and the fewest micro-batches every split and schedule accept.
    Config with_run = layout->config;
    const bool run_given = FillMissingRun(&with_run);
    const Config* config = &with_run;
    if (rank_option_->count() > 0 && !topology->HasRank(rank_)) {
      return ReportError(err, "command line",
                         fmt::format("--rank: {} is not in this layout; ranks are 0..{}", rank_,
                                     topology->world_size() - 1));
    }
    const int64_t rank = rank_option_->count() > 0 ? rank_ : -1;
    // The whole map lists every piece of every weight with its ranks: time and output in
    // proportion to the world, so it stops where layout's listings do; one rank's map visits
    // its own pieces only and works at any size.
    if (rank < 0 && topology->world_size() > kMaxListedRanks) {
      return ReportError(err, config_.path().empty() ? "command line" : config_.path(),
                         fmt::format("parallel.world_size: {} ranks is more than the {} a whole "
                                     "sharding map covers; query one rank with --rank R, which "
                                     "works at any size",
                                     topology->world_size(), kMaxListedRanks));
    }
    json_ = format_ == "json";
    // The text goes to `out` unless only the JSON map is wanted.
    std::ostringstream discard;
    std::ostream& text = json_ ? discard : out;
    std::string source;
    StatusOr<std::unique_ptr<Model>> model = BuildModel(*config, *topology, RankCoordinates{});
    if (!model.ok()) {
      return ReportError(err, source, config_.Attribute(model.status(), &source).Message());
    }
    // The JSON map is one tree, about 1 KB of memory per shard while it is built: its
    // whole-world form stops at kMaxJsonShards pieces (2^20 ranks at tp 2^20 would be 2^21
    // shards, over 2 GiB); the text streams and covers every world up to kMaxListedRanks.
    const std::vector<MappedParameter> sharding_map = (*model)->ShardingMap();
    if (json_ && rank < 0) {
      int64_t shards = 0;
      for (const MappedParameter& p : sharding_map) {
        shards += p.tp_dim < 0 ? 1 : p.over_etp ? topology->sizes().etp : topology->sizes().tp;
      }
      if (shards > kMaxJsonShards) {
        return ReportError(err, config_.path().empty() ? "command line" : config_.path(),
                           fmt::format("--format json: the sharding map has {} shards, more than "
                                       "the {} its JSON lists; use the text format, or query one "
                                       "rank with --rank R",
                                       shards, kMaxJsonShards));
      }
    }
    if (!run_given && topology->sizes().cp > 1) {
      text << fmt::format("(no run section: the positions below are those of a sequence of {} "
                          "tokens, the shortest this layout splits)\n",
                          with_run.run->seq_length);
    }
    (*model)->Explain(text);
    if (config->optimizer && config->optimizer->use_torch_fsdp2) {
      std::map<std::string, Shape> local_shapes;
      for (const HeldParameterShape& p : (*model)->HeldParameterShapes()) {
        local_shapes[p.name] = p.local_shape;
      }
      ExplainFullyShard((*model)->FullyShardUnits(), local_shapes,
                        topology->sizes().dp * topology->sizes().cp,
                        config->optimizer->torch_fsdp2_reshard_after_forward, text);
    }
    // Only where there is a choice to show: 16-bit storage, an optimizer, or a router dtype.
    const DType storage = config->run ? config->run->dtype
                                      : MegatronStorageDType(config->parallel).value_or(
                                            DType::kFloat32);
    const bool router_dtype = FactsOf(*config).moe.router_dtype.has_value();
    if (DTypeSize(storage) == 2 || config->optimizer || router_dtype) {
      text << PrecisionText(*config) << '\n';
    }
    PrintShardingMap(sharding_map, *topology, rank, json_, json_ ? out : text,
                     with_run.run->seq_length);
    return kExitOk;
  }

 private:
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
