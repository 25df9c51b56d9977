// `mpusim estimate`: what each pipeline stage's busiest rank holds before its first step,
// from the config alone (core/estimate/memory_estimate.h): its parameters, main_grad and
// optimizer state, the last both with the plain and with the distributed optimizer. Nothing
// is allocated, so a model of any size on any layout answers at once; `mpusim run --summary`
// measures the same bytes, and the MemoryEstimate tests require them equal on every rank.
// With a run section (or --global-batch-size), also the activations and buffers at the
// schedule's peak (core/estimate/activation_estimate.h) and whether it fits the GPU with the
// memory reserve a GPU run adds (core/estimate/memory_reserve.h; --reserve-gib replaces it),
// and the step time on a GPU (--gpu), its parts, the communication per group kind, model
// TFLOP/s per GPU and MFU (core/estimate/time_estimate.h). `--format json` gives the numbers
// for scripts, `--format html` a page of bars and tables (cli/estimate_report.h renders all
// three).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/config_options.h"
#include "cli/estimate_report.h"
#include "core/estimate/estimable.h"
#include "core/estimate/memory_reserve.h"
#include "core/estimate/time_estimate.h"
#include "core/topology.h"
#include "run/preflight.h"

namespace mpusim::cli {
namespace {

class EstimateCommand : public Command {
 public:
  explicit EstimateCommand(CLI::App* parent) {
    app_ = parent->add_subcommand(
        "estimate", "Estimate the memory each pipeline stage's busiest rank holds, from the "
                    "config alone");
    app_->footer(
        "Examples:\n"
        "  mpusim estimate sample_configs/gpt_train_adam_p2_t2_n4.json\n"
        "  mpusim estimate sample_configs/gpt3_175b_t8_p16_n1024.json --tp 4 --pp 32\n"
        "  mpusim estimate CONFIG --format json\n"
        "  mpusim estimate CONFIG --global-batch-size 512 --format html > estimate.html\n"
        "  mpusim estimate sample_configs/gpt3_175b_t8_p16_n1024.json --global-batch-size 1536 \\\n"
        "      --recompute full --gpu a100-80gb\n"
        "Counts parameters (storage dtype), main_grad (the dtype Megatron gives it) and optimizer\n"
        "state per rank, exactly as `mpusim run` allocates them. With a run section or\n"
        "--global-batch-size, also the step time on --gpu (a100-80gb, h100-80gb, h200, h800,\n"
        "b200, or a JSON file of GPU fields), model TFLOP/s per GPU and MFU, and the\n"
        "activations and buffers at the schedule's peak as Korthikanti et al. 2022 count a\n"
        "GPU run's (with model.attention_backend, \"auto\" resolved for the dtype and the GPU),\n"
        "and the activations `mpusim run --no-check` keeps on the CPU executor.");
    config_.Register(app_);
    app_->add_option("--format", format_,
                     "text, json or html (a self-contained page; default text)")
        ->check(CLI::IsMember({"text", "json", "html"}));
    app_->add_option("--gpu", gpu_,
                     "a100-80gb, h100-80gb (default), h200, h800, b200, or a JSON file of GPU fields");
    app_->add_option("--global-batch-size", global_batch_,
                     "samples per iteration (sets the run section; needs no run section then)");
    app_->add_option("--micro-batch-size", micro_batch_, "samples per micro-batch (default 1)");
    app_->add_option("--seq-length", seq_length_,
                     "tokens per sample (default the run's, else max_position_embeddings)");
    app_->add_option("--recompute", recompute_,
                     "none, full (recompute_method uniform, recompute_num_layers 1 unless the "
                     "run gives them) or selective (core_attn unless the run gives "
                     "recompute_modules)")
        ->check(CLI::IsMember({"none", "full", "selective"}));
    app_->add_option("--attention-backend", attention_backend_,
                     "override model.attention_backend: flash, fused, unfused, local or auto")
        ->check(CLI::IsMember(std::vector<std::string>(AttentionBackendNames().begin(),
                                                       AttentionBackendNames().end())));
    app_->add_option("--train-iters", train_iters_,
                     "training iterations of the run the executor count is for (from the "
                     "second on, the distributed optimizer's gradient piece stays)");
    app_->add_option("--reserve-gib", reserve_gib_,
                     "GiB each rank keeps beyond the count, in place of the computed reserve "
                     "(CUDA context, cuBLAS workspaces, NCCL buffers, fragmentation)");
  }
  CLI::App* app() override { return app_; }

  int Run(std::ostream& out, std::ostream& err) override {
    std::optional<ConfigOptions::Layout> layout =
        config_.ResolveModelLayout(err, "estimate", "it counts the model's parameters");
    if (!layout) return kExitUsage;
    std::string source;
    Config config = layout->config;
    const Topology& topology = layout->topology;
    SetAttentionBackend(attention_backend_, &config);
    StatusOr<GpuSpec> gpu = ResolveGpuSpec(gpu_);
    if (!gpu.ok()) return ReportError(err, "command line", gpu.status().Message());
    // The batch flags make (or change) the run section the step time needs.
    const bool time_asked = config.run.has_value() || global_batch_;
    if (Status s = ApplyRunFlags(&config, topology); !s.ok()) {
      return ReportError(err, "command line", s.Message());
    }
    // What a rank holds before its first step does not depend on the data.
    const bool run_given = FillMissingRun(&config);
    std::optional<PlanBytes> reserve;
    if (reserve_gib_) {
      StatusOr<PlanBytes> bytes = ReserveGibToBytes(*reserve_gib_);
      if (!bytes.ok()) return ReportError(err, "command line", bytes.status().Message());
      reserve = *bytes;
    }
    StatusOr<EstimateReport> report =
        MakeEstimateReport(config, topology, *gpu, run_given, time_asked, reserve);
    if (FromAttentionFlag(attention_backend_, report.status())) {
      return ReportError(
          err, "command line",
          "--attention-backend " + attention_backend_ + ": " + report.status().what());
    }
    if (!report.ok()) {
      return ReportError(err, source, config_.Attribute(report.status(), &source).Message());
    }
    if (format_ == "json") {
      out << EstimateJson(*report, topology).dump(1) << '\n';
    } else if (format_ == "html") {
      PrintEstimateHtml(*report, topology, config_.path().empty() ? "command line" : config_.path(),
                        out);
    } else {
      PrintEstimateText(*report, topology, out);
    }
    return kExitOk;
  }

 private:
  // --global-batch-size and friends: the run section the step time reads.
  Status ApplyRunFlags(Config* config, const Topology& topology) const {
    if (!global_batch_ && !micro_batch_ && !seq_length_ && recompute_.empty() && !train_iters_) {
      return {};
    }
    if (!config->run && !global_batch_) {
      return Status::Error("--global-batch-size",
                           "is needed with --micro-batch-size, --seq-length, --recompute or "
                           "--train-iters when the config has no run section");
    }
    // The GPT model's position table gives the default sequence and bounds it (a chain: none).
    const GptConfig* const model = EstimatedModel(*config);
    // Timing needs the real sequence: without a run section, the one the model's positions
    // are sized for (DefaultRun).
    if (!config->run && !seq_length_ && (model == nullptr || model->max_position_embeddings < 1)) {
      return Status::Error("--seq-length", "is needed: the config has no run section and the "
                                           "model no max_position_embeddings");
    }
    RunConfig run = config->run ? *config->run : DefaultRun(*config);
    if (micro_batch_) run.micro_batch_size = *micro_batch_;
    if (seq_length_) run.seq_length = *seq_length_;
    if (run.seq_length < 1) return Status::Error("--seq-length", "is needed (>= 1)");
    if (model != nullptr && model->has_position_embeddings() &&
        run.seq_length > model->max_position_embeddings) {
      return Status::Error("--seq-length",
                           fmt::format("{} is above the model's max_position_embeddings {}",
                                       run.seq_length, model->max_position_embeddings));
    }
    if (run.micro_batch_size < 1) return Status::Error("--micro-batch-size", "must be >= 1");
    if (train_iters_) {
      if (*train_iters_ < 1) return Status::Error("--train-iters", "must be >= 1");
      run.train_iters = *train_iters_;
    }
    if (global_batch_) {
      const int64_t per = run.micro_batch_size * topology.sizes().dp;
      if (*global_batch_ < 1 || *global_batch_ % per != 0) {
        return Status::Error(
            "--global-batch-size",
            fmt::format("{} is not a positive multiple of micro_batch_size {} x "
                        "data_parallel_size {} = {}",
                        *global_batch_, run.micro_batch_size, topology.sizes().dp, per));
      }
      run.num_microbatches = *global_batch_ / per;
      run.global_batch_size = *global_batch_;
    }
    if (!recompute_.empty()) {
      const RunConfig::Recompute was = run.recompute;
      run.recompute = recompute_ == "full"        ? RunConfig::Recompute::kFull
                      : recompute_ == "selective" ? RunConfig::Recompute::kSelective
                                                  : RunConfig::Recompute::kNone;
      // The run's other recompute keys belong to its own granularity.
      if (run.recompute != was || run.recompute != RunConfig::Recompute::kFull) {
        run.recompute_method = RunConfig::RecomputeMethod::kNone;
        run.recompute_num_layers.reset();
      }
      if (run.recompute != was) run.recompute_modules.reset();
      if (run.recompute == RunConfig::Recompute::kFull && !run.recompute_num_layers) {
        // Every layer recomputed alone (Megatron has no default; the flag's help says so).
        run.recompute_method = RunConfig::RecomputeMethod::kUniform;
        run.recompute_num_layers = 1;
      }
    }
    config->run = run;
    return {};
  }

  CLI::App* app_ = nullptr;
  ConfigOptions config_;
  std::string format_ = "text";
  std::string gpu_ = kDefaultGpu;
  std::string attention_backend_;  // empty: the config's
  std::optional<int64_t> global_batch_, micro_batch_, seq_length_, train_iters_;
  std::optional<double> reserve_gib_;
  std::string recompute_;
};

}  // namespace

std::unique_ptr<Command> MakeEstimateCommand(CLI::App* parent) {
  return std::make_unique<EstimateCommand>(parent);
}

}  // namespace mpusim::cli
