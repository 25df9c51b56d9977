// `mpusim estimate`: what each pipeline stage's busiest rank holds before its first step,
// from the config alone (core/estimate/memory_estimate.h): its parameters, main_grad and
// optimizer state, the last both with the plain and with the distributed optimizer. Nothing
// is allocated, so a model of any size on any layout answers at once; `mpusim run --summary`
// measures the same bytes, and the MemoryEstimate tests require them equal on every rank.
// With a run section (or --global-batch-size), also the activations and buffers at the
// schedule's peak and whether the peak fits the GPU (core/estimate/activation_estimate.h),
// and the step time on a GPU (--gpu), its parts, the communication per group kind, model
// TFLOP/s per GPU and MFU (core/estimate/time_estimate.h). `--format json` gives the numbers for scripts.
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
#include "core/estimate/activation_estimate.h"
#include "core/estimate/memory_estimate.h"
#include "core/estimate/time_estimate.h"
#include "core/topology.h"
#include "run/preflight.h"

namespace mpusim::cli {
namespace {

// A byte count for JSON: exact below 2^64 (every count here is far below; the counts saturate
// at 2^100, core/memory_plan.h).
nlohmann::ordered_json Bytes(PlanBytes bytes) {
  if (bytes < (PlanBytes{1} << 64)) return static_cast<uint64_t>(bytes);
  return static_cast<double>(bytes);
}

// "tp 2 · pp 2 · dp 2": the axes of the layout larger than 1 (all 1: "one rank").
std::string LayoutText(const DerivedSizes& s) {
  std::vector<std::string> parts;
  const auto add = [&](const char* name, int64_t size) {
    if (size > 1) parts.push_back(fmt::format("{} {}", name, size));
  };
  add("tp", s.tp);
  add("pp", s.pp);
  if (s.vp) add("vp", *s.vp);
  add("cp", s.cp);
  add("dp", s.dp);
  add("ep", s.ep);
  if (s.etp != s.tp) parts.push_back(fmt::format("etp {}", s.etp));
  return parts.empty() ? "one rank" : fmt::format("{}", fmt::join(parts, " · "));
}

// "1.23 s", "45.6 ms", "789 us".
std::string Seconds(double s) {
  if (s >= 1) return fmt::format("{:.3g} s", s);
  if (s >= 1e-3) return fmt::format("{:.3g} ms", s * 1e3);
  return fmt::format("{:.3g} us", s * 1e6);
}

// The estimate with the optimizer the other way (plain <-> distributed), for the comparison.
Config WithDistributedOptimizer(Config config, bool distributed) {
  config.optimizer->use_distributed_optimizer = distributed;
  return config;
}

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
        "  mpusim estimate sample_configs/gpt3_175b_t8_p16_n1024.json --global-batch-size 1536 \\\n"
        "      --recompute full --gpu a100-80gb\n"
        "Counts parameters (storage dtype), main_grad and optimizer state (compute dtype) per\n"
        "rank, exactly as `mpusim run` allocates them. With a run section or\n"
        "--global-batch-size, also the step time on --gpu (a100-80gb, h100-80gb, h200, or a\n"
        "JSON file of GPU fields), model TFLOP/s per GPU and MFU, and the activations and\n"
        "buffers at the schedule's peak as Korthikanti et al. 2022 count a GPU run's.");
    config_.Register(app_);
    app_->add_option("--format", format_, "text or json (default text)")
        ->check(CLI::IsMember({"text", "json"}));
    app_->add_option("--gpu", gpu_,
                     "a100-80gb, h100-80gb (default), h200, or a JSON file of GPU fields");
    app_->add_option("--global-batch-size", global_batch_,
                     "samples per iteration (sets the run section; needs no run section then)");
    app_->add_option("--micro-batch-size", micro_batch_, "samples per micro-batch (default 1)");
    app_->add_option("--seq-length", seq_length_,
                     "tokens per sample (default the run's, else max_position_embeddings)");
    app_->add_option("--recompute", recompute_, "none, full or selective")
        ->check(CLI::IsMember({"none", "full", "selective"}));
  }
  CLI::App* app() override { return app_; }

  int Run(std::ostream& out, std::ostream& err) override {
    std::optional<ConfigOptions::Layout> layout =
        config_.ResolveModelLayout(err, "estimate", "it counts the model's parameters");
    if (!layout) return kExitUsage;
    std::string source;
    Config config = layout->config;
    const Topology& topology = layout->topology;
    StatusOr<GpuSpec> gpu = ResolveGpuSpec(gpu_);
    if (!gpu.ok()) return ReportError(err, "command line", gpu.status().Message());
    // The batch flags make (or change) the run section the step time needs.
    const bool time_asked = config.run.has_value() || global_batch_;
    if (Status s = ApplyRunFlags(&config, topology); !s.ok()) {
      return ReportError(err, "command line", s.Message());
    }
    // What a rank holds before its first step does not depend on the data.
    const bool run_given = FillMissingRun(&config, topology);
    std::optional<std::vector<StageActivations>> activations;
    std::optional<TimeEstimate> time;
    std::string time_missing =
        "the config has no run section: give --global-batch-size (and --micro-batch-size, "
        "--seq-length, --recompute)";
    std::string activations_missing = "the config has no run section";
    if (time_asked) {
      StatusOr<std::vector<StageActivations>> a = EstimateStageActivations(config, topology);
      if (a.ok()) {
        activations = *a;
      } else {
        activations_missing = a.status().Message();
      }
      StatusOr<TimeEstimate> t = EstimateStepTime(config, topology, *gpu);
      if (t.ok()) {
        time = *t;
      } else {
        time_missing = t.status().Message();
      }
    }
    StatusOr<std::vector<StageHeldMemory>> stages = EstimateStageHeldMemory(config, topology);
    if (!stages.ok()) {
      return ReportError(err, source, config_.Attribute(stages.status(), &source).Message());
    }
    // The optimizer state the other way, stage by stage.
    std::vector<PlanBytes> other_optimizer;
    if (config.optimizer) {
      StatusOr<std::vector<StageHeldMemory>> other = EstimateStageHeldMemory(
          WithDistributedOptimizer(config, !config.optimizer->use_distributed_optimizer),
          topology);
      if (!other.ok()) {
        return ReportError(err, source, config_.Attribute(other.status(), &source).Message());
      }
      for (const StageHeldMemory& s : *other) other_optimizer.push_back(s.held.optimizer);
    }
    if (format_ == "json") {
      PrintJson(config, topology, *stages, other_optimizer, activations, activations_missing,
                *gpu, time, time_missing, out);
    } else {
      PrintText(config, topology, run_given, *stages, other_optimizer, out);
      if (activations) {
        PrintPeak(*stages, *activations, *gpu, out);
      } else {
        out << "Activations: not estimated: " << activations_missing << '\n';
      }
      if (time) {
        PrintTime(config, topology, *time, out);
      } else {
        out << "Step time: not estimated: " << time_missing << '\n';
      }
    }
    return kExitOk;
  }

 private:
  // --global-batch-size and friends: the run section the step time reads.
  Status ApplyRunFlags(Config* config, const Topology& topology) const {
    if (!global_batch_ && !micro_batch_ && !seq_length_ && recompute_.empty()) return {};
    if (!config->run && !global_batch_) {
      return Status::Error("--global-batch-size",
                           "is needed with --micro-batch-size, --seq-length or --recompute when "
                           "the config has no run section");
    }
    RunConfig run;
    if (config->run) {
      run = *config->run;
    } else {
      run.dtype = MegatronStorageDType(config->parallel).value_or(DType::kFloat32);
      run.seq_length = config->gpt ? config->gpt->max_position_embeddings : 0;
    }
    if (micro_batch_) run.micro_batch_size = *micro_batch_;
    if (seq_length_) run.seq_length = *seq_length_;
    if (run.seq_length < 1) return Status::Error("--seq-length", "is needed (>= 1)");
    if (config->gpt && config->gpt->has_position_embeddings() &&
        run.seq_length > config->gpt->max_position_embeddings) {
      return Status::Error("--seq-length",
                           fmt::format("{} is above the model's max_position_embeddings {}",
                                       run.seq_length, config->gpt->max_position_embeddings));
    }
    if (run.micro_batch_size < 1) return Status::Error("--micro-batch-size", "must be >= 1");
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
    if (recompute_ == "none") run.recompute = RunConfig::Recompute::kNone;
    if (recompute_ == "full") run.recompute = RunConfig::Recompute::kFull;
    if (recompute_ == "selective") run.recompute = RunConfig::Recompute::kSelective;
    config->run = run;
    return {};
  }

  static void PrintPeak(const std::vector<StageHeldMemory>& stages,
                        const std::vector<StageActivations>& activations, const GpuSpec& gpu,
                        std::ostream& out) {
    out << fmt::format("At the schedule's peak, by each stage's busiest rank, on {} ({}): "
                       "Megatron's activations as Korthikanti et al. 2022 count them\n",
                       gpu.name, run::FormatBytes(static_cast<PlanBytes>(gpu.hbm_bytes)));
    out << fmt::format("  {:>5}  {:>7}  {:>12}  {:>12}  {:>12}  {}\n", "stage", "stashes",
                       "activations", "buffers", "peak", "| fits");
    for (size_t i = 0; i < stages.size(); ++i) {
      const StageActivations& a = activations[i];
      const PlanBytes peak =
          SaturatingAdd(stages[i].held.total(), SaturatingAdd(a.activations, a.buffers));
      const auto hbm = static_cast<PlanBytes>(gpu.hbm_bytes);
      out << fmt::format("  {:>5}  {:>7}  {:>12}  {:>12}  {:>12}  | {}\n", a.stage,
                         a.peak_stashes, run::FormatBytes(a.activations),
                         run::FormatBytes(a.buffers), run::FormatBytes(peak),
                         peak <= hbm ? fmt::format("yes, {} free", run::FormatBytes(hbm - peak))
                                     : fmt::format("no, {} over", run::FormatBytes(peak - hbm)));
    }
  }

  static void PrintTime(const Config& config, const Topology& topology, const TimeEstimate& t,
                        std::ostream& out) {
    const RunConfig& run = *config.run;
    const char* recompute = run.recompute == RunConfig::Recompute::kFull        ? "full"
                            : run.recompute == RunConfig::Recompute::kSelective ? "selective"
                                                                                : "none";
    out << fmt::format(
        "Step time on {}: global batch {} ({} micro-batches of {} x dp {}), sequence {}, "
        "recompute {}\n",
        t.gpu.name, t.global_batch_size, t.num_microbatches, run.micro_batch_size,
        topology.sizes().dp, run.seq_length, recompute);
    const double pipeline = t.compute_s + t.tp_comm_s + t.bubble_s;
    out << fmt::format("  step time   {:>10}  = pipeline {} + dp {} + optimizer {}\n",
                       Seconds(t.step_time_s), Seconds(pipeline), Seconds(t.dp_comm_s),
                       Seconds(t.optimizer_s));
    out << fmt::format("  pipeline    {:>10}  = compute {} + tp {} + bubble {} (busiest stage)\n",
                       Seconds(pipeline), Seconds(t.compute_s), Seconds(t.tp_comm_s),
                       Seconds(t.bubble_s));
    out << fmt::format("  throughput  {:>10.1f}  model TFLOP/s per GPU, MFU {:.1f}% (model FLOPs "
                       "{:.3g} per iteration, as Megatron counts them)\n",
                       t.model_tflops_per_gpu, 100 * t.mfu, t.model_flops);
    out << "  per micro-batch:";
    for (const StageTime& s : t.stages) {
      if (t.stages.size() > 4 && s.stage == 2) {
        out << " ...";
        continue;
      }
      if (t.stages.size() > 4 && s.stage > 2 && s.stage + 1 < static_cast<int64_t>(t.stages.size()))
        continue;
      out << fmt::format(" stage {} F {} B {};", s.stage, Seconds(s.forward_s),
                         Seconds(s.backward_s));
    }
    out << '\n';
    out << "  communication per iteration (busiest stage's rank):\n";
    for (const CommTime& c : t.communication) {
      out << fmt::format("    {:<3} {:<28} {:>7} x  {:>10} sent  {:>10}  {}\n", c.kind,
                         c.operation, c.count,
                         run::FormatBytes(static_cast<PlanBytes>(c.bytes)), Seconds(c.seconds),
                         c.inter_node ? "across nodes" : "in a node");
    }
    out << fmt::format(
        "  model: GEMMs at {:.0f}% of peak, memory-bound kernels at {:.0f}% of HBM bandwidth, "
        "collectives at {:.0f}% of link bandwidth; no overlap of communication with compute\n",
        100 * t.gpu.gemm_efficiency, 100 * t.gpu.memory_efficiency,
        100 * t.gpu.collective_efficiency);
  }
  void PrintText(const Config& config, const Topology& topology, bool run_given,
                 const std::vector<StageHeldMemory>& stages,
                 const std::vector<PlanBytes>& other_optimizer, std::ostream& out) const {
    const DType storage = config.run->dtype;
    const DType compute = ComputeDType(storage);
    out << fmt::format("Memory estimate: {} ranks ({}), parameters in {}{}\n",
                       topology.world_size(), LayoutText(topology.sizes()), DTypeName(storage),
                       run_given ? "" : " (no run section)");
    std::string optimizer_text = "no optimizer section: main_grad only, no optimizer state";
    if (config.optimizer) {
      const bool adam = config.optimizer->kind == OptimizerConfig::Kind::kAdam;
      optimizer_text = fmt::format(
          "main_grad and {} ({}) in {}, {}", adam ? "Adam" : "SGD",
          adam ? "master weights, exp_avg, exp_avg_sq" : "master weights, momentum",
          DTypeName(compute),
          config.optimizer->use_distributed_optimizer
              ? fmt::format("distributed optimizer ({} instance{})",
                            topology.sizes().num_distributed_optimizer_instances,
                            topology.sizes().num_distributed_optimizer_instances == 1 ? ""
                                                                                      : "s")
              : std::string("plain optimizer (every dp rank keeps all of it)"));
    }
    out << optimizer_text << '\n';
    out << "Held before the first step, by each pipeline stage's busiest rank:\n";
    const bool compare = !other_optimizer.empty();
    const std::string other_name = config.optimizer && config.optimizer->use_distributed_optimizer
                                       ? "plain optimizer"
                                       : "distributed optimizer";
    out << fmt::format("  {:>5}  {:>5}  {:>12}  {:>12}  {:>12}  {:>12}", "stage", "rank",
                       "parameters", "gradients", "optimizer", "held");
    if (compare) out << fmt::format("  | {} held", other_name);
    out << '\n';
    for (size_t i = 0; i < stages.size(); ++i) {
      const StageHeldMemory& s = stages[i];
      out << fmt::format("  {:>5}  {:>5}  {:>12}  {:>12}  {:>12}  {:>12}", s.stage, s.rank,
                         run::FormatBytes(s.held.parameters), run::FormatBytes(s.held.gradients),
                         run::FormatBytes(s.held.optimizer), run::FormatBytes(s.held.total()));
      if (compare) {
        const PlanBytes other_total =
            SaturatingAdd(SaturatingAdd(s.held.parameters, s.held.gradients), other_optimizer[i]);
        out << fmt::format("  | {} (optimizer {})", run::FormatBytes(other_total),
                           run::FormatBytes(other_optimizer[i]));
      }
      out << '\n';
    }
    out << "Not counted: what a GPU run adds (cuBLAS workspaces, NCCL's own buffers, the "
           "caching allocator's slack).\n";
  }

  static void PrintJson(const Config& config, const Topology& topology,
                        const std::vector<StageHeldMemory>& stages,
                        const std::vector<PlanBytes>& other_optimizer,
                        const std::optional<std::vector<StageActivations>>& activations,
                        const std::string& activations_missing, const GpuSpec& gpu,
                        const std::optional<TimeEstimate>& time, const std::string& time_missing,
                        std::ostream& out) {
    nlohmann::ordered_json doc;
    doc["world_size"] = topology.world_size();
    doc["dtype"] = std::string(DTypeName(config.run->dtype));
    doc["main_grad_dtype"] = std::string(DTypeName(ComputeDType(config.run->dtype)));
    const bool distributed = config.optimizer && config.optimizer->use_distributed_optimizer;
    doc["optimizer"] = !config.optimizer ? nlohmann::ordered_json(nullptr)
                       : config.optimizer->kind == OptimizerConfig::Kind::kAdam
                           ? nlohmann::ordered_json("adam")
                           : nlohmann::ordered_json("sgd");
    doc["use_distributed_optimizer"] = distributed;
    const auto number = [&](double v) {
      return time ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
    };
    doc["step_time_s"] = number(time ? time->step_time_s : 0);
    doc["model_tflops_per_gpu"] = number(time ? time->model_tflops_per_gpu : 0);
    doc["mfu"] = number(time ? time->mfu : 0);
    if (time) {
      const TimeEstimate& t = *time;
      doc["gpu"] = {{"name", t.gpu.name},
                    {"peak_tflops_16bit", t.gpu.peak_flops_16bit / 1e12},
                    {"gemm_efficiency", t.gpu.gemm_efficiency},
                    {"memory_efficiency", t.gpu.memory_efficiency},
                    {"collective_efficiency", t.gpu.collective_efficiency}};
      doc["global_batch_size"] = t.global_batch_size;
      doc["num_microbatches"] = t.num_microbatches;
      doc["time"] = {{"compute_s", t.compute_s},     {"tp_comm_s", t.tp_comm_s},
                     {"bubble_s", t.bubble_s},       {"dp_comm_s", t.dp_comm_s},
                     {"optimizer_s", t.optimizer_s}};
      doc["model_flops_per_iteration"] = t.model_flops;
      doc["flops_per_rank"] = t.flops_per_rank;
      nlohmann::ordered_json comm = nlohmann::ordered_json::array();
      for (const CommTime& c : t.communication) {
        comm.push_back({{"kind", c.kind},
                        {"operation", c.operation},
                        {"count", c.count},
                        {"bytes", c.bytes},
                        {"seconds", c.seconds},
                        {"inter_node", c.inter_node}});
      }
      doc["communication"] = comm;
    } else {
      doc["step_time_not_estimated"] = time_missing;
    }
    doc["hbm_bytes"] = Bytes(static_cast<PlanBytes>(gpu.hbm_bytes));
    if (!activations) doc["activations_not_estimated"] = activations_missing;
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (size_t i = 0; i < stages.size(); ++i) {
      const StageHeldMemory& s = stages[i];
      nlohmann::ordered_json stage;
      stage["stage"] = s.stage;
      stage["rank"] = s.rank;
      stage["memory"] = {{"parameters", Bytes(s.held.parameters)},
                         {"gradients", Bytes(s.held.gradients)},
                         {"optimizer", Bytes(s.held.optimizer)},
                         {"held", Bytes(s.held.total())}};
      if (activations) {
        const StageActivations& a = (*activations)[i];
        stage["memory"]["activations"] = Bytes(a.activations);
        stage["memory"]["buffers"] = Bytes(a.buffers);
        stage["memory"]["peak"] =
            Bytes(SaturatingAdd(s.held.total(), SaturatingAdd(a.activations, a.buffers)));
        stage["peak_stashes"] = a.peak_stashes;
      } else {
        stage["memory"]["activations"] = nullptr;
        stage["memory"]["buffers"] = nullptr;
        stage["memory"]["peak"] = nullptr;
      }
      stage["parameter_elements"] = Bytes(s.held.parameter_elements);
      if (time) {
        const StageTime& st = time->stages[i];
        stage["time"] = {{"forward_s", st.forward_s},
                         {"backward_s", st.backward_s},
                         {"flops", st.flops}};
      }
      if (!other_optimizer.empty()) {
        stage[distributed ? "optimizer_if_plain" : "optimizer_if_distributed"] =
            Bytes(other_optimizer[i]);
      }
      list.push_back(stage);
    }
    doc["stages"] = list;
    doc["not_counted"] = {"cublas_workspaces", "nccl_buffers", "allocator_slack"};
    out << doc.dump(1) << '\n';
  }

  CLI::App* app_ = nullptr;
  ConfigOptions config_;
  std::string format_ = "text";
  std::string gpu_ = "h100-80gb";
  std::optional<int64_t> global_batch_, micro_batch_, seq_length_;
  std::string recompute_;
};

}  // namespace

std::unique_ptr<Command> MakeEstimateCommand(CLI::App* parent) {
  return std::make_unique<EstimateCommand>(parent);
}

}  // namespace mpusim::cli
