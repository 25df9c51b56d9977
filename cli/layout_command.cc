// `mpusim layout`: Megatron-Core's process groups for a config, as text, JSON or a picture,
// or one rank's coordinates and groups.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>
#include <algorithm>
#include <ostream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/config_options.h"
#include "cli/estimate_report.h"
#include "cli/layout_report.h"
#include "core/estimate/time_estimate.h"
#include "core/html.h"
#include "core/layout_space.h"
#include "core/topology.h"

namespace mpusim::cli {
namespace {

class LayoutCommand : public Command {
 public:
  explicit LayoutCommand(CLI::App* parent) {
    app_ = parent->add_subcommand(
        "layout", "Print the process groups Megatron-Core's initialize_model_parallel builds");
    app_->footer(
        "Examples:\n"
        "  mpusim layout sample_configs/lab_t2_p4_n16.json\n"
        "  mpusim layout --world-size 16 --tp 2 --pp 4 --format json\n"
        "  mpusim layout sample_configs/lab_t2_p4_n16.json --format html > layout.html\n"
        "  mpusim layout CONFIG --rank 5 --kinds tp,pp,dp\n"
        "  mpusim layout --sweep --world-size 16\n"
        "Kinds: tp pp dp dp_cp dp_cp_partial cp hcp_L<k> mp embd pos_embd tp_dp tp_dp_cp tp_cp\n"
        "       ep expt_tp tp_ep tp_ep_pp expt_dp expt_dp_partial intra_dist_opt inter_dist_opt");
    config_.Register(app_);
    app_->add_option("--format", format_,
                     "text, json, picture or html (a self-contained page; default text)")
        ->check(CLI::IsMember({"text", "json", "picture", "html"}));
    rank_option_ =
        app_->add_option("--rank", rank_, "show one global rank's coordinates and groups");
    app_->add_option("--kinds", kinds_,
                     "comma-separated group kinds to show (default all), e.g. tp,dp,pp");
    app_->add_option("--max-groups", max_groups_,
                     "text only: groups listed per kind (default 32, 0 = all)");
    app_->add_flag("--sweep", sweep_,
                   "list every valid tp x pp x cp x dp of the world size (the config's other "
                   "keys kept), with group counts");
  }

  CLI::App* app() override { return app_; }

  int Run(std::ostream& out, std::ostream& err) override {
    if (sweep_) return Sweep(out, err);
    std::optional<ConfigOptions::Layout> layout = config_.ResolveLayout(err);
    if (!layout) return kExitUsage;
    const Topology* topology = &layout->topology;
    if (max_groups_ < 0) {
      return ReportError(err, "command line",
                         fmt::format("--max-groups: must be >= 0, got {}", max_groups_));
    }
    LayoutReportOptions options;
    options.source = config_.path().empty() ? "command line" : config_.path();
    options.max_groups = max_groups_;
    const Status kinds = SelectKinds(*topology, &options.kinds);
    if (!kinds.ok()) return ReportError(err, "command line", kinds.Message());
    const bool one_rank = rank_option_->count() > 0;
    if (one_rank && !topology->HasRank(rank_)) {
      return ReportError(err, "command line",
                         fmt::format("--rank: {} is not in this layout; ranks are {}..{}", rank_,
                                     topology->first_rank(),
                                     topology->first_rank() + topology->world_size() - 1));
    }
    const bool huge = topology->world_size() > kMaxListedRanks;
    if (huge && !one_rank) {
      return ReportError(err, options.source,
                         fmt::format("parallel.world_size: {} ranks is more than the {} a whole "
                                     "layout listing covers; query one rank with --rank R, which "
                                     "works at any size",
                                     topology->world_size(), kMaxListedRanks));
    }
    // Warnings go to stderr so that stdout stays machine-readable. Past kMaxListedRanks
    // only the queried rank's groups are looked at.
    for (const std::string& warning :
         huge ? RankNodeWarnings(*topology, rank_) : NodeWarnings(*topology)) {
      err << "warning: " << warning << '\n';
    }
    if (one_rank && format_ == "html") {
      return ReportError(err, "command line",
                         "--format html: draws the whole layout (click a GPU in it for one "
                         "rank); drop --rank");
    }
    if (one_rank) {
      if (format_ == "json") {
        PrintRankJson(*topology, rank_, options, out);
      } else {
        PrintRankText(*topology, rank_, options, out);
      }
      return kExitOk;
    }
    if (format_ == "json") {
      PrintLayoutJson(*topology, options, out);
    } else if (format_ == "picture") {
      PrintLayoutPicture(*topology, out);
    } else if (format_ == "html") {
      // With pipeline stages the page shows the schedule too: the run section's micro-batches,
      // else 2 per stage.
      std::optional<PipelineSchedule> schedule;
      const ParallelConfig& pc = topology->config();
      if (pc.pipeline_model_parallel_size > 1) {
        const Config& full = layout->config;
        StatusOr<PipelineSchedule> built = BuildPipelineSchedule(
            pc.pipeline_model_parallel_size, pc.virtual_pipeline_model_parallel_size,
            full.run ? full.run->num_microbatches : 2 * pc.pipeline_model_parallel_size,
            pc.microbatch_group_size_per_vp_stage, pc.overlap_moe_expert_parallel_comm);
        if (built.ok()) schedule = std::move(built).value();
      }
      // With a model, the page also shows `mpusim estimate`'s section: the memory of each
      // stage and, with a run section, its peak and the step time on the default GPU.
      std::string estimate;
      if (layout->config.has_model()) {
        Config config = layout->config;
        const bool run_given = FillMissingRun(&config);
        StatusOr<EstimateReport> report = MakeEstimateReport(
            config, *topology, FindGpuPreset(kDefaultGpu).value(), run_given, run_given);
        std::ostringstream section;
        if (report.ok()) {
          PrintEstimateHtmlSection(*report, *topology, section);
        } else {
          section << "<h2>memory and step time estimate</h2>\n<p class=\"note\">not estimated: "
                  << HtmlEscape(report.status().Message()) << "</p>\n";
        }
        estimate = section.str();
      }
      PrintLayoutHtml(*topology, options, schedule ? &*schedule : nullptr, estimate, out);
    } else {
      PrintLayoutText(*topology, options, out);
    }
    return kExitOk;
  }

 private:
  // --sweep: every factorisation n = tp * pp * cp * dp that Topology accepts with the config's
  // other keys, in order of tp, pp, cp.
  int Sweep(std::ostream& out, std::ostream& err) {
    if (rank_option_->count() > 0 || !kinds_.empty() || format_ == "picture" || format_ == "html") {
      return ReportError(err, "command line",
                         "--sweep: lists layouts; it takes --format text or json, not --rank, "
                         "--kinds or --format picture or html");
    }
    std::optional<ConfigOptions::Layout> base = config_.ResolveLayout(err);
    if (!base) return kExitUsage;
    const int64_t n = base->topology.world_size();
    // Each row counts the tp groups that leave a node, O(n / tp) for some orders and node
    // sizes: past kMaxListedRanks, as the whole listings, the sweep is refused up front.
    if (n > kMaxListedRanks) {
      return ReportError(err, config_.path().empty() ? "command line" : config_.path(),
                         fmt::format("parallel.world_size: {} ranks is more than the {} --sweep "
                                     "covers; sweep a smaller world (--world-size N)",
                                     n, kMaxListedRanks));
    }
    struct Row {
      int64_t tp, pp, cp, dp, tp_spanning;
    };
    std::vector<Row> rows;
    int64_t refused = 0;
    // The layout space's tp x cp x pp points (core/layout_space.h; no sequence parallelism,
    // distributed optimizer, experts or interleaving: the planner's view), each judged by
    // Topology with the config's other keys, in order of tp, pp, cp.
    LayoutSpace space;
    space.world_size = n;
    space.sequence_parallel = {false};
    space.distributed_optimizer = {false};
    std::vector<mpusim::Layout> layouts = EnumerateLayouts(space);
    std::sort(layouts.begin(), layouts.end(),
              [](const mpusim::Layout& a, const mpusim::Layout& b) {
                return std::tie(a.tp, a.pp, a.cp) < std::tie(b.tp, b.pp, b.cp);
              });
    for (const mpusim::Layout& l : layouts) {
      ParallelConfig c = base->config.parallel;
      c.tensor_model_parallel_size = l.tp;
      c.pipeline_model_parallel_size = l.pp;
      c.context_parallel_size = l.cp;
      c.expert_tensor_parallel_size = std::nullopt;
      c.virtual_pipeline_model_parallel_size = std::nullopt;
      c.microbatch_group_size_per_vp_stage = std::nullopt;
      c.hierarchical_context_parallel_sizes.clear();
      StatusOr<Topology> t = Topology::Create(c);
      if (!t.ok()) {
        ++refused;
        continue;
      }
      // AnyGroupSpansNodes is O(axes): most rows (every one whose tp groups fit their nodes)
      // skip the count.
      const size_t tp_kind = *t->FindKind("tp");
      rows.push_back({l.tp, l.pp, l.cp, l.dp,
                      t->AnyGroupSpansNodes(tp_kind) ? t->NumGroupsSpanningNodes(tp_kind) : 0});
    }
    if (format_ == "json") {
      nlohmann::ordered_json j = {
          {"schema_version", 1}, {"world_size", n}, {"layouts", nlohmann::ordered_json::array()}};
      for (const Row& r : rows) {
        j["layouts"].push_back({{"tp", r.tp},
                                {"pp", r.pp},
                                {"cp", r.cp},
                                {"dp", r.dp},
                                {"tp_groups", n / r.tp},
                                {"pp_groups", n / r.pp},
                                {"dp_groups", n / r.dp},
                                {"tp_groups_spanning_nodes", r.tp_spanning}});
      }
      out << j.dump(1) << '\n';
      return kExitOk;
    }
    out << fmt::format(
        "layouts of {} ranks (order {}, gpus_per_node {}): {} valid{}\n", n,
        base->config.parallel.order, base->config.parallel.gpus_per_node, rows.size(),
        refused > 0 ? fmt::format(", {} refused by the config's other keys", refused) : "");
    out << fmt::format("  {:>4} {:>4} {:>4} {:>4}  {:>9} {:>9} {:>9}  {}\n", "tp", "pp", "cp", "dp",
                       "tp groups", "pp groups", "dp groups", "tp groups leaving a node");
    for (const Row& r : rows) {
      out << fmt::format(
          "  {:>4} {:>4} {:>4} {:>4}  {:>9} {:>9} {:>9}  {}\n", r.tp, r.pp, r.cp, r.dp, n / r.tp,
          n / r.pp, n / r.dp,
          r.tp_spanning > 0 ? fmt::format("{} of {}", r.tp_spanning, n / r.tp) : std::string("-"));
    }
    out << fmt::format("(a row's groups: mpusim layout --world-size {} --tp T --pp P --cp C)\n", n);
    return kExitOk;
  }

  // --kinds, validated against this layout; the default order depends on the format.
  Status SelectKinds(const Topology& topology, std::vector<size_t>* selected) const {
    selected->clear();
    if (kinds_.empty()) {
      if (format_ == "json" || rank_option_->count() > 0) {
        for (size_t i = 0; i < topology.kinds().size(); ++i) selected->push_back(i);
      } else {
        *selected = DefaultTextKindOrder(topology);
      }
      return {};
    }
    std::vector<std::string_view> names;
    for (const GroupKind& kind : topology.kinds()) names.push_back(kind.name);
    size_t start = 0;
    while (true) {
      const size_t comma = kinds_.find(',', start);
      const std::string name = kinds_.substr(start, comma - start);
      if (const auto index = topology.FindKind(name)) {
        selected->push_back(*index);
      } else if (name.rfind("hcp_L", 0) == 0) {
        return Status::Error("--kinds", fmt::format("'{}' is not built for this layout: "
                                                    "hierarchical context-parallel levels come "
                                                    "from hierarchical_context_parallel_sizes",
                                                    name));
      } else if (name == "inter_dist_opt") {
        return Status::Error("--kinds", "'inter_dist_opt' is not built for this layout: it needs "
                                        "num_distributed_optimizer_instances > 1");
      } else {
        const std::string suggestion = SuggestKey(name, names);
        return Status::Error(
            "--kinds", fmt::format("unknown kind '{}'{}; kinds of this layout: {}", name,
                                   suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)",
                                                                         suggestion),
                                   fmt::join(names, ", ")));
      }
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    return {};
  }

  CLI::App* app_ = nullptr;
  ConfigOptions config_;
  std::string format_ = "text";
  CLI::Option* rank_option_ = nullptr;
  int64_t rank_ = 0;
  bool sweep_ = false;
  std::string kinds_;
  int64_t max_groups_ = 32;
};

}  // namespace

std::unique_ptr<Command> MakeLayoutCommand(CLI::App* parent) {
  return std::make_unique<LayoutCommand>(parent);
}

}  // namespace mpusim::cli
