// The estimate's report (see estimate_report.h): what core/estimate counts for a config on a
// layout (MakeEstimateReport), the attention flag's helpers, and the words and sums the
// renderings share (estimate_parts.h). The renderings are estimate_text.cc, estimate_json.cc
// and estimate_html.cc; the page kit the HTML ones use is report_page.cc.
#include "cli/estimate_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "cli/estimate_parts.h"
#include "core/estimate/estimable.h"
#include "run/preflight.h"

namespace mpusim::cli {
namespace {

// The estimate with the optimizer the other way (plain <-> distributed), for the comparison.
Config WithDistributedOptimizer(Config config, bool distributed) {
  config.optimizer->use_distributed_optimizer = distributed;
  // Megatron's overlap_param_gather exists only with the distributed optimizer.
  if (!distributed) config.optimizer->overlap_param_gather = false;
  return config;
}

}  // namespace

bool TpOverlap(const Config& config) { return config.parallel.tp_comm_overlap; }
bool GradOverlap(const Config& config) {
  return config.optimizer && config.optimizer->overlap_grad_reduce;
}
bool EpOverlap(const Config& config) { return config.parallel.overlap_moe_expert_parallel_comm; }
bool AnyOverlap(const Config& config) {
  return TpOverlap(config) || GradOverlap(config) || EpOverlap(config);
}
// "12.3 ms exposed (45.6 ms hidden)" for a part that overlap hides, else "12.3 ms".
std::string ExposedText(double exposed, double hidden, bool overlapped) {
  return overlapped ? fmt::format("{} exposed ({} hidden)", SecondsText(exposed),
                                  SecondsText(hidden))
                    : SecondsText(exposed);
}
// The model line's words on overlap: what runs beside compute.
std::string OverlapText(const Config& config, const TimeEstimate& t, bool ring) {
  std::vector<std::string> parts;
  if (TpOverlap(config)) {
    parts.push_back("tp collectives with their GEMMs (tp_comm_overlap, TE's userbuffers)");
  }
  if (GradOverlap(config)) {
    parts.push_back(fmt::format("the gradient reduction with the last backward ({} bucket{} on "
                                "pipeline rank 0's first chunk)",
                                t.dp_buckets, t.dp_buckets == 1 ? "" : "s"));
  }
  if (config.optimizer && config.optimizer->overlap_param_gather) {
    parts.push_back("the parameter all-gather with the next forward");
  }
  if (EpOverlap(config)) {
    parts.push_back(fmt::format("the experts' all-to-alls with another micro-batch's compute "
                                "(overlap_moe_expert_parallel_comm: Megatron's combined 1F1B, "
                                "one more warmup forward{})",
                                config.parallel.delay_wgrad_compute
                                    ? "; delay_wgrad_compute: the experts' weight gradients "
                                      "after their backward all-to-all starts"
                                    : ""));
  }
  if (ring) parts.push_back("the cp ring's sends with its attention");
  if (parts.empty()) return "no overlap of communication with compute";
  if (parts.size() == 1 && ring) {
    return "no overlap of communication with compute but the cp ring's sends with its attention";
  }
  return fmt::format("overlapped: {}; the slowdown of the GEMMs they share the GPU with is not "
                     "modelled",
                     fmt::join(parts, ", "));
}

PlanBytes StagePeak(const EstimateReport& r, size_t i) {
  const StageActivations& a = (*r.activations)[i];
  return r.stages[i].held.PeakWith(SaturatingAdd(a.activations, a.buffers));
}

std::string FitsText(PlanBytes peak, PlanBytes hbm) {
  return peak <= hbm ? fmt::format("yes, {} free", run::FormatBytes(hbm - peak))
                     : fmt::format("no, {} over", run::FormatBytes(peak - hbm));
}

std::string OptimizerText(const Config& config, const Topology& topology) {
  const OptimizerPrecision precision = PrecisionOf(config);
  if (!config.optimizer) {
    return fmt::format("no optimizer section: main_grad ({}) only, no optimizer state",
                       DTypeName(precision.main_grad));
  }
  const bool adam = config.optimizer->kind == OptimizerConfig::Kind::kAdam;
  const int64_t instances = topology.sizes().num_distributed_optimizer_instances;
  const bool one_dtype = !precision.param_remainders && precision.exp_avg == precision.master &&
                         (!adam || precision.exp_avg_sq == precision.master);
  const std::string master = MasterStorageName(precision);
  const std::string states = one_dtype ? master
                             : adam
                                 ? fmt::format("{}, {}, {}", master, DTypeName(precision.exp_avg),
                                               DTypeName(precision.exp_avg_sq))
                                 : fmt::format("{}, {}", master, DTypeName(precision.exp_avg));
  return fmt::format(
      "main_grad in {}{}, {} ({}) in {}, {}", DTypeName(precision.main_grad),
      precision.grads_copied_for_step ? " (copied to float32 for the step)" : "",
      adam ? "Adam" : "SGD",
      adam ? "master weights, exp_avg, exp_avg_sq" : "master weights, momentum", states,
      config.optimizer->use_distributed_optimizer
          ? fmt::format("distributed optimizer ({} instance{})", instances,
                        instances == 1 ? "" : "s")
      : config.optimizer->use_torch_fsdp2
          ? std::string("FSDP2 (each dp x cp rank keeps its rows of every parameter, gradient "
                        "and optimizer state)")
          : std::string("plain optimizer (every dp rank keeps all of it)"));
}

// A stage's peak and the reserve on top: what must fit the GPU's memory.
PlanBytes StageNeeds(const EstimateReport& r, size_t i) {
  return SaturatingAdd(StagePeak(r, i), r.reserves[i].total);
}

std::string AttentionTimeText(const TimeEstimate& t) {
  if (!t.attention.fused()) {
    return fmt::format(
        "\"{}\", the full s x s scores at the GEMMs' efficiency and softmax "
        "and dropout through memory",
        AttentionBackendName(t.attention.backend));
  }
  return fmt::format(
      "\"{}\", one kernel at up to {:.0f}% of peak forward and {:.0f}% "
      "backward (less on short blocks), the causal mask's blocks skipped, the "
      "probabilities recomputed in the backward",
      AttentionBackendName(t.attention.backend), 100 * t.gpu.attention_efficiency_forward,
      100 * t.gpu.attention_efficiency_backward);
}

std::string AttentionText(const ResolvedAttention& a) {
  return fmt::format("attention_backend \"{}\" ({}): {}", AttentionBackendName(a.backend), a.reason,
                     a.fused() ? "keeps each query row's float32 log-sum-exp, not the s x s "
                                 "probabilities"
                               : "keeps the s x s probabilities (softmax output; with "
                                 "attention dropout its mask and output)");
}

void SetAttentionBackend(const std::string& name, Config* config) {
  GptConfig* const model = EstimatedModel(config);
  if (name.empty() || model == nullptr) return;
  const std::vector<std::string_view>& names = AttentionBackendNames();
  const auto it = std::find(names.begin(), names.end(), name);
  if (it != names.end()) {
    model->attention_backend = static_cast<AttentionBackend>(it - names.begin());
  }
}

bool FromAttentionFlag(const std::string& name, const Status& status) {
  return !name.empty() && !status.ok() && status.where() == "model.attention_backend";
}

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

std::string SecondsText(double s) {
  if (s >= 1) return fmt::format("{:.3g} s", s);
  if (s >= 1e-3) return fmt::format("{:.3g} ms", s * 1e3);
  return fmt::format("{:.3g} us", s * 1e6);
}

nlohmann::ordered_json JsonBytes(PlanBytes bytes) {
  if (bytes < (PlanBytes{1} << 64)) return static_cast<uint64_t>(bytes);
  return static_cast<double>(bytes);
}

StatusOr<EstimateReport> MakeEstimateReport(Config config, const Topology& topology,
                                            const GpuSpec& gpu, bool run_given, bool time_asked,
                                            std::optional<PlanBytes> reserve_bytes) {
  EstimateReport r;
  r.run_given = run_given;
  r.gpu = gpu;
  r.time_missing =
      "the config has no run section: give --global-batch-size (and --micro-batch-size, "
      "--seq-length, --recompute)";
  r.activations_missing = "the config has no run section";
  StatusOr<std::vector<StageHeldMemory>> stages = EstimateStageHeldMemory(config, topology);
  if (!stages.ok()) return stages.status();
  r.stages = *stages;
  if (const GptConfig* model = EstimatedModel(config); time_asked && model != nullptr) {
    // Which attention runs is the config's, the dtype's and the GPU's: a backend that cannot
    // run there ("flash" in float32) is the config's error, not a missing estimate.
    StatusOr<ResolvedAttention> attention = ResolveAttentionBackend(
        *model, config.run->dtype, gpu.compute_capability, topology.sizes().cp);
    if (!attention.ok()) return attention.status();
    r.attention = *attention;
  }
  if (time_asked) {
    StatusOr<std::vector<StageActivations>> a =
        EstimateStageActivations(config, topology, r.attention.value_or(ResolvedAttention{}));
    if (a.ok()) {
      r.activations = *a;
    } else {
      r.activations_missing = a.status().Message();
    }
    for (size_t i = 0; r.activations && i < r.stages.size(); ++i) {
      const StageActivations& stage = (*r.activations)[i];
      r.reserves.push_back(reserve_bytes ? GivenReserve(*reserve_bytes)
                                         : EstimateMemoryReserve(
                                               config, topology, gpu, r.stages[i].rank,
                                               SaturatingAdd(stage.activations, stage.buffers)));
    }
    // `mpusim run` refuses the combined 1F1B schedule: no executor to mirror. A model the
    // executor does not build (a part Megatron runs and mpusim run refuses) has no executor
    // count either: the note says why.
    const Status builds = ExecutorBuildsParts(config, topology);
    if (!builds.ok()) r.executor_missing = builds.Message();
    if (!config.parallel.overlap_moe_expert_parallel_comm && builds.ok()) {
      StatusOr<std::vector<ExecutorActivations>> e =
          EstimateExecutorActivations(config, topology, r.stages);
      if (e.ok()) r.executor = *e;
    }
    StatusOr<TimeEstimate> t = EstimateStepTime(config, topology, gpu);
    if (t.ok()) {
      r.time = *t;
    } else {
      r.time_missing = t.status().Message();
    }
  }
  // The optimizer the other way (plain <-> distributed); not for FSDP2, which shards the
  // parameters and gradients too, so that only its own count is meaningful.
  if (config.optimizer && !config.optimizer->use_torch_fsdp2) {
    StatusOr<std::vector<StageHeldMemory>> other = EstimateStageHeldMemory(
        WithDistributedOptimizer(config, !config.optimizer->use_distributed_optimizer),
        topology);
    if (!other.ok()) return other.status();
    for (const StageHeldMemory& s : *other) r.other_optimizer.push_back(s.held.optimizer);
  }
  r.config = std::move(config);
  return r;
}

}  // namespace mpusim::cli
