// `mpusim schedule`: the 1F1B / interleaved 1F1B pipeline schedule of a config, as
// per-pipeline-rank tables of forward and backward steps.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/config_options.h"
#include "cli/layout_report.h"
#include "core/pipeline/pipeline_plan.h"
#include "core/schedule.h"
#include "core/topology.h"

namespace mpusim::cli {
namespace {

// The idealised step costs of the timing picture: a backward twice a forward, as usual.
constexpr double kForward = 1, kBackward = 2;

class ScheduleCommand : public Command {
 public:
  explicit ScheduleCommand(CLI::App* parent) {
    app_ = parent->add_subcommand(
        "schedule", "Print Megatron-Core's pipeline schedule (1F1B or interleaved 1F1B)");
    app_->footer(
        "Interleaved 1F1B is used when virtual_pipeline_model_parallel_size is set.\n"
        "Examples:\n"
        "  mpusim schedule sample_configs/interleaved_schedule_p2_v2_n2.json --microbatches 4\n"
        "  mpusim schedule sample_configs/gpt_pipeline_p4_v2_n4.json   (run.num_microbatches)\n"
        "  mpusim schedule --world-size 4 --pp 4 --microbatches 8 --format json");
    config_.Register(app_);
    app_->add_option("--microbatches,-m", microbatches_,
                     "number of microbatches (default: the config's run.num_microbatches)");
    app_->add_option("--format", format_,
                     "text, json or svg (a picture: a row per pipeline rank, time to the right, "
                     "forward 1 and backward 2 time units; default text)")
        ->check(CLI::IsMember({"text", "json", "svg"}));
    app_->add_flag("--transfers", transfers_,
                   "also list each step's receive and sends, as the executor posts them "
                   "(text and json; the svg shows them as lines and in each step's tooltip)");
  }

  CLI::App* app() override { return app_; }

  int Run(std::ostream& out, std::ostream& err) override {
    std::optional<ConfigOptions::Layout> layout = config_.ResolveLayout(err);
    if (!layout) return kExitUsage;
    std::string source = config_.path().empty() ? "command line" : config_.path();
    const ParallelConfig& c = layout->config.parallel;
    if (!microbatches_) {
      if (!layout->config.run) {
        return ReportError(err, "command line",
                           "--microbatches: is required (or a config with a run section's "
                           "num_microbatches)");
      }
      microbatches_ = layout->config.run->num_microbatches;
    }
    StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(
        c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size, *microbatches_,
        c.microbatch_group_size_per_vp_stage, c.overlap_moe_expert_parallel_comm);
    if (!schedule.ok()) {
      Status status = schedule.status();
      if (status.where() == "num_microbatches") {
        return ReportError(err, "command line", "--microbatches: " + status.what());
      }
      status = Status::Error("parallel." + status.where(), status.what());
      return ReportError(err, source, config_.Attribute(status, &source).Message());
    }
    if (format_ == "json") {
      PrintJson(*schedule, transfers_, out);
    } else if (format_ == "svg") {
      PrintScheduleSvg(*schedule, kForward, kBackward, /*standalone=*/true, out);
    } else {
      PrintText(*schedule, transfers_, out);
    }
    return kExitOk;
  }

 private:
  // An action of the executor's plan as its step ("F1.0", or "end" for the final wait) and
  // its transfers ("recv activation c1.m0 from 0", ...).
  static std::pair<std::string, std::vector<std::string>> DescribeAction(const PlanAction& action) {
    std::vector<std::string> batch;
    for (const Transfer& transfer : action.batch) batch.push_back(FormatTransfer(transfer));
    return {action.step ? FormatStep(*action.step) : "end", std::move(batch)};
  }

  static void PrintText(const PipelineSchedule& s, bool transfers, std::ostream& out) {
    const int64_t p = s.pipeline_model_parallel_size;
    if (s.interleaved) {
      out << fmt::format("interleaved 1F1B: pipeline_model_parallel_size {}, "
                         "virtual_pipeline_model_parallel_size {}, num_microbatches {}, "
                         "microbatch_group_size_per_vp_stage {}\n",
                         p, s.num_model_chunks, s.num_microbatches,
                         s.microbatch_group_size_per_vp_stage);
    } else {
      out << fmt::format("1F1B: pipeline_model_parallel_size {}, num_microbatches {}\n", p,
                         s.num_microbatches);
    }
    if (s.combined_1f1b) {
      out << "combined 1F1B (overlap_moe_expert_parallel_comm): one more warmup forward per "
             "rank; each steady forward runs beside the backward after it\n";
    }
    std::vector<int64_t> microbatches;
    std::vector<int64_t> chunks;
    for (const auto& [microbatch, chunk] : s.forward_table) {
      microbatches.push_back(microbatch);
      chunks.push_back(chunk);
    }
    out << "\nmicrobatch of each forward step (the same on every pipeline rank):\n";
    for (int64_t r = 0; r < p; ++r) {
      out << fmt::format("rank {} | {}\n", r, fmt::join(microbatches, " "));
    }
    if (s.interleaved) {
      out << "\nmodel chunk of each forward step:\n";
      for (int64_t r = 0; r < p; ++r) {
        out << fmt::format("rank {} | {}\n", r, fmt::join(chunks, " "));
      }
    }
    out << "\nexecution order (F<chunk>.<microbatch> forward, B<chunk>.<microbatch> backward):\n";
    for (int64_t r = 0; r < p; ++r) {
      out << fmt::format("rank {} | {}\n", r, FormatRank(s, r));
    }
    out << "\nwarmup forwards per rank (before the steady 1F1B phase):";
    for (int64_t r = 0; r < p; ++r) out << fmt::format(" {}", s.NumWarmup(r));
    out << "\nmost micro-batches in flight per rank (activation stashes):";
    for (int64_t r = 0; r < p; ++r) out << fmt::format(" {}", ScheduleTiming::PeakInFlight(s, r));
    const ScheduleTiming t = TimeSchedule(s, kForward, kBackward);
    out << fmt::format(
        "\nwith forward {:g} and backward {:g} time units and free communication: {:g} units, "
        "bubble {:.3f} of the ranks' time ((p - 1) / ({}M + p - 1) = {:.3f}; `--format svg` "
        "draws it)\n",
        kForward, kBackward, t.makespan, t.BubbleFraction(), s.interleaved ? "v " : "",
        static_cast<double>(p - 1) /
            static_cast<double>(s.num_model_chunks * s.num_microbatches + p - 1));
    if (!transfers) return;
    out << "\nsends and receives around each step, as the executor posts them: before a step, "
           "its receive (waited for) and the previous step's send (async: waited for after "
           "the last step)\n";
    const PipelinePlan plan = PlanPipelineTransfers(s);
    for (int64_t r = 0; r < p; ++r) {
      out << fmt::format("rank {}\n", r);
      for (const PlanAction& action : plan[static_cast<size_t>(r)]) {
        const auto [step, batch] = DescribeAction(action);
        out << fmt::format(
            "  {:<5} {}\n", step,
            batch.empty() ? std::string("-") : fmt::format("{}", fmt::join(batch, "; ")));
      }
    }
  }

  static void PrintJson(const PipelineSchedule& s, bool transfers, std::ostream& out) {
    nlohmann::ordered_json j;
    j["schema_version"] = 1;
    j["schedule"] = s.interleaved ? "interleaved_1f1b" : "1f1b";
    j["combined_1f1b"] = s.combined_1f1b;
    j["pipeline_model_parallel_size"] = s.pipeline_model_parallel_size;
    j["virtual_pipeline_model_parallel_size"] =
        s.interleaved ? nlohmann::ordered_json(s.num_model_chunks) : nlohmann::ordered_json();
    j["num_microbatches"] = s.num_microbatches;
    j["microbatch_group_size_per_vp_stage"] = s.microbatch_group_size_per_vp_stage;
    std::vector<int64_t> microbatches;
    std::vector<int64_t> chunks;
    for (const auto& [microbatch, chunk] : s.forward_table) {
      microbatches.push_back(microbatch);
      chunks.push_back(chunk);
    }
    j["microbatch_id_sequence"] = microbatches;
    j["model_chunk_id_sequence"] = chunks;
    nlohmann::ordered_json ranks = nlohmann::ordered_json::object();
    nlohmann::ordered_json warmup = nlohmann::ordered_json::object();
    for (int64_t r = 0; r < s.pipeline_model_parallel_size; ++r) {
      ranks[std::to_string(r)] = FormatRank(s, r);
      warmup[std::to_string(r)] = s.NumWarmup(r);
    }
    j["ranks"] = ranks;
    j["num_warmup_microbatches"] = warmup;
    if (transfers) {
      // Per rank, per action (one per step, then the final wait): its step and batch.
      nlohmann::ordered_json plan_json = nlohmann::ordered_json::object();
      const PipelinePlan plan = PlanPipelineTransfers(s);
      for (int64_t r = 0; r < s.pipeline_model_parallel_size; ++r) {
        nlohmann::ordered_json actions = nlohmann::ordered_json::array();
        for (const PlanAction& action : plan[static_cast<size_t>(r)]) {
          const auto [step, batch] = DescribeAction(action);
          actions.push_back({{"step", step}, {"transfers", batch}});
        }
        plan_json[std::to_string(r)] = actions;
      }
      j["transfers"] = plan_json;
    }
    out << j.dump(1) << '\n';
  }

  CLI::App* app_ = nullptr;
  ConfigOptions config_;
  std::optional<int64_t> microbatches_;
  std::string format_ = "text";
  bool transfers_ = false;
};

}  // namespace

std::unique_ptr<Command> MakeScheduleCommand(CLI::App* parent) {
  return std::make_unique<ScheduleCommand>(parent);
}

}  // namespace mpusim::cli
