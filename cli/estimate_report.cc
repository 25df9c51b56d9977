// The estimate's report (see estimate_report.h).
#include "cli/estimate_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>

#include "core/estimate/not_modelled.h"
#include "core/html.h"
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

// Which of Megatron's overlap options the estimate ran with.
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
  return SaturatingAdd(r.stages[i].held.total(), SaturatingAdd(a.activations, a.buffers));
}

std::string FitsText(PlanBytes peak, PlanBytes hbm) {
  return peak <= hbm ? fmt::format("yes, {} free", run::FormatBytes(hbm - peak))
                     : fmt::format("no, {} over", run::FormatBytes(peak - hbm));
}

const char* RecomputeText(RunConfig::Recompute r) {
  return r == RunConfig::Recompute::kFull        ? "full"
         : r == RunConfig::Recompute::kSelective ? "selective"
                                                 : "none";
}

std::string OptimizerText(const Config& config, const Topology& topology) {
  if (!config.optimizer) return "no optimizer section: main_grad only, no optimizer state";
  const bool adam = config.optimizer->kind == OptimizerConfig::Kind::kAdam;
  const int64_t instances = topology.sizes().num_distributed_optimizer_instances;
  return fmt::format(
      "main_grad and {} ({}) in {}, {}", adam ? "Adam" : "SGD",
      adam ? "master weights, exp_avg, exp_avg_sq" : "master weights, momentum",
      DTypeName(ComputeDType(config.run->dtype)),
      config.optimizer->use_distributed_optimizer
          ? fmt::format("distributed optimizer ({} instance{})", instances,
                        instances == 1 ? "" : "s")
          : std::string("plain optimizer (every dp rank keeps all of it)"));
}

// A stage's peak and the reserve on top: what must fit the GPU's memory.
PlanBytes StageNeeds(const EstimateReport& r, size_t i) {
  return SaturatingAdd(StagePeak(r, i), r.reserves[i].total);
}

void PrintPeakText(const EstimateReport& r, std::ostream& out) {
  const auto hbm = static_cast<PlanBytes>(r.gpu.hbm_bytes);
  out << fmt::format("At the schedule's peak, by each stage's busiest rank, on {} ({}): "
                     "Megatron's activations as Korthikanti et al. 2022 count them, and the "
                     "reserve for what a GPU run adds\n",
                     r.gpu.name, run::FormatBytes(hbm));
  if (r.attention) out << "  with " << AttentionText(*r.attention) << '\n';
  out << fmt::format("  {:>5}  {:>7}  {:>12}  {:>12}  {:>12}  {:>12}  {}\n", "stage", "stashes",
                     "activations", "buffers", "peak", "reserve", "| fits (peak + reserve)");
  for (size_t i = 0; i < r.stages.size(); ++i) {
    const StageActivations& a = (*r.activations)[i];
    out << fmt::format("  {:>5}  {:>7}  {:>12}  {:>12}  {:>12}  {:>12}  | {}\n", a.stage,
                       a.peak_stashes, run::FormatBytes(a.activations),
                       run::FormatBytes(a.buffers), run::FormatBytes(StagePeak(r, i)),
                       run::FormatBytes(r.reserves[i].total), FitsText(StageNeeds(r, i), hbm));
  }
  if (!r.reserves.empty() && r.reserves.front().given) {
    out << fmt::format("Reserve: {} on every rank, given by --reserve-gib in place of the "
                       "computed one\n",
                       run::FormatBytes(r.reserves.front().total));
    return;
  }
  out << fmt::format(
      "Reserve (README \"The memory reserve\"): CUDA context {}, cuBLAS workspaces {}, NCCL "
      "buffers {} per communicator the rank uses, allocator fragmentation {:.0f}% of the "
      "activations and buffers\n",
      run::FormatBytes(kCudaContextBytes),
      run::FormatBytes(r.reserves.empty() ? 0 : r.reserves.front().cublas_workspaces),
      run::FormatBytes(kNcclBytesPerCommunicator),
      100 * kFragmentation);
  out << fmt::format("  {:>5}  {:>12}  {:>13}  {:>12}  {}\n", "stage", "NCCL buffers",
                     "fragmentation", "reserve", "NCCL communicators");
  for (size_t i = 0; i < r.stages.size(); ++i) {
    const MemoryReserve& m = r.reserves[i];
    out << fmt::format("  {:>5}  {:>12}  {:>13}  {:>12}  {}\n", r.stages[i].stage,
                       run::FormatBytes(m.nccl_buffers), run::FormatBytes(m.fragmentation),
                       run::FormatBytes(m.total),
                       m.communicators.empty() ? std::string("none")
                                               : fmt::format("{}", fmt::join(m.communicators,
                                                                             ", ")));
  }
}

// The executor count's assumption for mixture-of-experts layers, whose stash follows the
// router (core/estimate/executor_activations.h).
constexpr const char* kMoeRoutingNote =
    "MoE layers are counted for balanced routing: each expert gets T k / E of each rank's "
    "T tokens (at most its capacity); exact with expert_model_parallel_size 1 and no "
    "capacity factor, where every rank gets every choice of its dispatch group.";

void PrintExecutorText(const EstimateReport& r, std::ostream& out) {
  out << fmt::format(
      "What `mpusim run --no-check` keeps on the CPU executor, in {}: its "
      "activations as `--summary` measures them (peak - held); its attention "
      "keeps the probabilities whatever attention_backend says\n",
      DTypeName(r.config.run->dtype));
  out << fmt::format("  {:>5}  {:>7}  {:>12}  {:>12}  {:>12}  {:>12}  {:>14}  {:>12}\n",
                     "stage", "stashes", "stash bytes", "working", "transfers", "carried",
                     "optimizer step", "activations");
  for (const ExecutorActivations& a : *r.executor) {
    out << fmt::format("  {:>5}  {:>7}  {:>12}  {:>12}  {:>12}  {:>12}  {:>14}  {:>12}\n",
                       a.stage, a.peak_stashes, run::FormatBytes(a.stashes),
                       run::FormatBytes(a.working), run::FormatBytes(a.transfers),
                       run::FormatBytes(a.carried), run::FormatBytes(a.optimizer_step),
                       run::FormatBytes(a.peak()));
  }
  if (r.config.gpt && r.config.gpt->moe.enabled()) out << kMoeRoutingNote << '\n';
}

std::string AttentionTimeText(const TimeEstimate& t);

void PrintTimeText(const Config& config, const Topology& topology, const TimeEstimate& t,
                   std::ostream& out) {
  const RunConfig& run = *config.run;
  out << fmt::format(
      "Step time on {}: global batch {} ({} micro-batches of {} x dp {}), sequence {}, "
      "recompute {}\n",
      t.gpu.name, t.global_batch_size, t.num_microbatches, run.micro_batch_size,
      topology.sizes().dp, run.seq_length, RecomputeText(run.recompute));
  const double pipeline = t.compute_s + t.recompute_s + t.tp_comm_s + t.cp_comm_s +
                          t.ep_comm_s + t.pp_comm_s + t.bubble_s;
  out << fmt::format("  step time   {:>10}  = pipeline {} + dp {} + optimizer {}\n",
                     SecondsText(t.step_time_s), SecondsText(pipeline),
                     ExposedText(t.dp_comm_s, t.dp_comm_hidden_s, GradOverlap(config)),
                     SecondsText(t.optimizer_s));
  out << fmt::format(
      "  pipeline    {:>10}  = compute {}{} + tp {}{}{}{} + bubble {} (busiest stage)\n",
      SecondsText(pipeline), SecondsText(t.compute_s),
      run.recompute != RunConfig::Recompute::kNone ? " + recompute " + SecondsText(t.recompute_s)
                                                   : "",
      ExposedText(t.tp_comm_s, t.tp_comm_hidden_s, TpOverlap(config)),
      topology.sizes().cp > 1 ? " + cp " + SecondsText(t.cp_comm_s) : "",
      config.gpt && config.gpt->moe.enabled()
          ? " + ep " + ExposedText(t.ep_comm_s, t.ep_comm_hidden_s, EpOverlap(config))
          : "",
      topology.sizes().pp > 1 ? " + pp sends " + SecondsText(t.pp_comm_s) : "",
      SecondsText(t.bubble_s));
  out << fmt::format("  throughput  {:>10.1f}  model TFLOP/s per GPU, MFU {:.1f}% (model FLOPs "
                     "{:.3g} per iteration, as Megatron counts them)\n",
                     t.model_tflops_per_gpu, 100 * t.mfu, t.model_flops);
  out << "  per micro-batch:";
  for (const StageTime& s : t.stages) {
    if (t.stages.size() > 4 && s.stage == 2) {
      out << " ...";
      continue;
    }
    if (t.stages.size() > 4 && s.stage > 2 && s.stage + 1 < static_cast<int64_t>(t.stages.size())) {
      continue;
    }
    out << fmt::format(" stage {} F {} B {};", s.stage, SecondsText(s.forward_s),
                       SecondsText(s.backward_s));
  }
  out << '\n';
  out << "  communication per iteration (busiest stage's rank):\n";
  for (const CommTime& c : t.communication) {
    // With overlap, each row's exposed seconds and its hidden ones.
    out << fmt::format("    {:<3} {:<28} {:>7} x  {:>10} sent  {:>10}  {}{}\n", c.kind,
                       c.operation, c.count, run::FormatBytes(static_cast<PlanBytes>(c.bytes)),
                       SecondsText(c.seconds),
                       AnyOverlap(config)
                           ? fmt::format("exposed {:>10} hidden  ",
                                         c.hidden_s > 0 ? SecondsText(c.hidden_s) : "-")
                           : "",
                       c.inter_node ? "across nodes" : "in a node");
  }
  const bool ring = topology.sizes().cp > 1 && config.gpt &&
                    config.gpt->cp_comm_type == CpCommType::kP2p;
  out << fmt::format(
      "  model: GEMMs by their shapes at {:.1f}% of peak (ceiling {:.0f}%), memory-bound "
      "kernels at {:.0f}% of HBM bandwidth, collectives at {:.0f}% of link bandwidth; {}\n",
      100 * t.gemm_efficiency_achieved, 100 * t.gpu.gemm_efficiency,
      100 * t.gpu.memory_efficiency, 100 * t.gpu.collective_efficiency,
      OverlapText(config, t, ring));
  out << "  attention: " << AttentionTimeText(t) << '\n';
  if (config.gpt && config.gpt->fp8) {
    out << fmt::format(
        "  fp8 ({}, recipe {}): the linear layers' GEMMs at the fp8 peak (ceiling {:.0f}%) with "
        "their cast-transposes; router, logits and core attention at the 16-bit peak; MFU "
        "against the 16-bit peak\n",
        Fp8FormatName(*config.gpt->fp8), Fp8RecipeName(config.gpt->fp8_recipe),
        100 * t.gpu.gemm_efficiency_8bit);
  }
}

// How the step time counts the core attention.
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

// The palette of the bars' parts, in turn: as many as a bar has parts (the step time's nine
// with cp and ep), so that no two parts of one bar share a colour.
constexpr std::array<const char*, 9> kColours = {"#4e79a7", "#f28e2b", "#76b7b2",
                                                 "#e15759", "#59a14f", "#b07aa1",
                                                 "#edc948", "#ff9da7", "#9c755f"};

std::string Td(const std::string& text) { return "<td>" + HtmlEscape(text) + "</td>"; }

}  // namespace

std::string AttentionText(const ResolvedAttention& a) {
  return fmt::format("attention_backend \"{}\" ({}): {}", AttentionBackendName(a.backend), a.reason,
                     a.fused() ? "keeps each query row's float32 log-sum-exp, not the s x s "
                                 "probabilities"
                               : "keeps the s x s probabilities (softmax output; with "
                                 "attention dropout its mask and output)");
}

void SetAttentionBackend(const std::string& name, Config* config) {
  if (name.empty() || !config->gpt) return;
  const std::vector<std::string_view>& names = AttentionBackendNames();
  const auto it = std::find(names.begin(), names.end(), name);
  if (it != names.end()) {
    config->gpt->attention_backend = static_cast<AttentionBackend>(it - names.begin());
  }
}

bool FromAttentionFlag(const std::string& name, const Status& status) {
  return !name.empty() && !status.ok() && status.where() == "model.attention_backend";
}

const char* const kReportStyle = R"CSS(
table.report { border-collapse: collapse; margin: 6px 0 12px; font: 12px monospace; }
table.report th, table.report td { border: 1px solid #ccc; padding: 2px 8px; text-align: right;
                                   white-space: nowrap; }
table.report th { background: #f0f0f0; }
table.report td.name { text-align: left; }
.over { color: #c00; font-weight: bold; }
.legend span { display: inline-block; margin-right: 12px; font-size: 12px; }
.legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
.note { color: #555; font-size: 12px; }
)CSS";

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
  if (time_asked && config.gpt) {
    // Which attention runs is the config's, the dtype's and the GPU's: a backend that cannot
    // run there ("flash" in float32) is the config's error, not a missing estimate.
    StatusOr<ResolvedAttention> attention = ResolveAttentionBackend(
        *config.gpt, config.run->dtype, gpu.compute_capability, topology.sizes().cp);
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
    // `mpusim run` refuses the combined 1F1B schedule: no executor to mirror.
    if (!config.parallel.overlap_moe_expert_parallel_comm) {
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
  if (config.optimizer) {
    StatusOr<std::vector<StageHeldMemory>> other = EstimateStageHeldMemory(
        WithDistributedOptimizer(config, !config.optimizer->use_distributed_optimizer),
        topology);
    if (!other.ok()) return other.status();
    for (const StageHeldMemory& s : *other) r.other_optimizer.push_back(s.held.optimizer);
  }
  r.config = std::move(config);
  return r;
}

void PrintEstimateText(const EstimateReport& r, const Topology& topology, std::ostream& out) {
  const Config& config = r.config;
  out << fmt::format("Memory estimate: {} ranks ({}), parameters in {}{}\n",
                     topology.world_size(), LayoutText(topology.sizes()),
                     DTypeName(config.run->dtype), r.run_given ? "" : " (no run section)");
  out << OptimizerText(config, topology) << '\n';
  out << "Held before the first step, by each pipeline stage's busiest rank:\n";
  const bool compare = !r.other_optimizer.empty();
  const std::string other_name = config.optimizer && config.optimizer->use_distributed_optimizer
                                     ? "plain optimizer"
                                     : "distributed optimizer";
  out << fmt::format("  {:>5}  {:>5}  {:>12}  {:>12}  {:>12}  {:>12}", "stage", "rank",
                     "parameters", "gradients", "optimizer", "held");
  if (compare) out << fmt::format("  | {} held", other_name);
  out << '\n';
  for (size_t i = 0; i < r.stages.size(); ++i) {
    const StageHeldMemory& s = r.stages[i];
    out << fmt::format("  {:>5}  {:>5}  {:>12}  {:>12}  {:>12}  {:>12}", s.stage, s.rank,
                       run::FormatBytes(s.held.parameters), run::FormatBytes(s.held.gradients),
                       run::FormatBytes(s.held.optimizer), run::FormatBytes(s.held.total()));
    if (compare) {
      const PlanBytes other_total =
          SaturatingAdd(SaturatingAdd(s.held.parameters, s.held.gradients), r.other_optimizer[i]);
      out << fmt::format("  | {} (optimizer {})", run::FormatBytes(other_total),
                         run::FormatBytes(r.other_optimizer[i]));
    }
    out << '\n';
  }
  if (!r.activations) {
    out << "Not counted: what a GPU run adds (the reserve: the CUDA context, cuBLAS "
           "workspaces, NCCL's buffers, the caching allocator's fragmentation), counted with "
           "the activations.\n";
  }
  if (r.activations) {
    PrintPeakText(r, out);
  } else {
    out << "Activations: not estimated: " << r.activations_missing << '\n';
  }
  if (r.executor) PrintExecutorText(r, out);
  if (r.time) {
    PrintTimeText(config, topology, *r.time, out);
  } else {
    out << "Step time: not estimated: " << r.time_missing << '\n';
  }
  out << fmt::format("Not modelled: {}.\n", fmt::join(NotModelled(config), "; "));
}

nlohmann::ordered_json EstimateJson(const EstimateReport& r, const Topology& topology) {
  const Config& config = r.config;
  const std::optional<TimeEstimate>& time = r.time;
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
                  {"peak_tflops_8bit", t.gpu.peak_flops_8bit / 1e12},
                  {"sm_count", t.gpu.sm_count},
                  {"compute_capability", t.gpu.compute_capability},
                  {"gemm_efficiency", t.gpu.gemm_efficiency},
                  {"gemm_efficiency_8bit", t.gpu.gemm_efficiency_8bit},
                  {"gemm_efficiency_achieved", t.gemm_efficiency_achieved},
                  {"memory_efficiency", t.gpu.memory_efficiency},
                  {"collective_efficiency", t.gpu.collective_efficiency},
                  {"attention_efficiency_forward", t.gpu.attention_efficiency_forward},
                  {"attention_efficiency_backward", t.gpu.attention_efficiency_backward}};
    doc["global_batch_size"] = t.global_batch_size;
    doc["num_microbatches"] = t.num_microbatches;
    doc["time"] = {{"compute_s", t.compute_s},
                   {"recompute_s", t.recompute_s},
                   {"tp_comm_s", t.tp_comm_s},
                   {"tp_comm_hidden_s", t.tp_comm_hidden_s},
                   {"cp_comm_s", t.cp_comm_s},
                   {"ep_comm_s", t.ep_comm_s},
                   {"ep_comm_hidden_s", t.ep_comm_hidden_s},
                   {"pp_comm_s", t.pp_comm_s},
                   {"bubble_s", t.bubble_s},
                   {"dp_comm_s", t.dp_comm_s},
                   {"dp_comm_hidden_s", t.dp_comm_hidden_s},
                   {"optimizer_s", t.optimizer_s}};
    doc["overlap"] = {{"tp_comm_overlap", TpOverlap(config)},
                      {"overlap_grad_reduce", GradOverlap(config)},
                      {"overlap_param_gather",
                       config.optimizer && config.optimizer->overlap_param_gather},
                      {"overlap_moe_expert_parallel_comm", EpOverlap(config)},
                      {"delay_wgrad_compute", config.parallel.delay_wgrad_compute},
                      {"grad_buckets", t.dp_buckets}};
    doc["model_flops_per_iteration"] = t.model_flops;
    doc["flops_per_rank"] = t.flops_per_rank;
    nlohmann::ordered_json comm = nlohmann::ordered_json::array();
    for (const CommTime& c : t.communication) {
      comm.push_back({{"kind", c.kind},
                      {"operation", c.operation},
                      {"count", c.count},
                      {"bytes", c.bytes},
                      {"seconds", c.seconds},
                      {"hidden_seconds", c.hidden_s},
                      {"inter_node", c.inter_node}});
    }
    doc["communication"] = comm;
  } else {
    doc["step_time_not_estimated"] = r.time_missing;
  }
  doc["hbm_bytes"] = JsonBytes(static_cast<PlanBytes>(r.gpu.hbm_bytes));
  if (r.attention) {
    doc["attention_backend"] = AttentionBackendName(r.attention->backend);
    doc["attention_backend_requested"] = AttentionBackendName(r.attention->requested);
    doc["attention_backend_reason"] = r.attention->reason;
  }
  if (!r.activations) doc["activations_not_estimated"] = r.activations_missing;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (size_t i = 0; i < r.stages.size(); ++i) {
    const StageHeldMemory& s = r.stages[i];
    nlohmann::ordered_json stage;
    stage["stage"] = s.stage;
    stage["rank"] = s.rank;
    stage["memory"] = {{"parameters", JsonBytes(s.held.parameters)},
                       {"gradients", JsonBytes(s.held.gradients)},
                       {"optimizer", JsonBytes(s.held.optimizer)},
                       {"held", JsonBytes(s.held.total())}};
    if (r.activations) {
      const StageActivations& a = (*r.activations)[i];
      stage["memory"]["activations"] = JsonBytes(a.activations);
      stage["memory"]["buffers"] = JsonBytes(a.buffers);
      stage["memory"]["peak"] = JsonBytes(StagePeak(r, i));
      stage["peak_stashes"] = a.peak_stashes;
      const MemoryReserve& m = r.reserves[i];
      stage["reserved_bytes"] = JsonBytes(m.total);
      if (m.given) {
        stage["reserve"] = {{"given", true}};
      } else {
        stage["reserve"] = {{"given", false},
                            {"cuda_context_bytes", JsonBytes(m.cuda_context)},
                            {"cublas_workspaces_bytes", JsonBytes(m.cublas_workspaces)},
                            {"nccl_buffers_bytes", JsonBytes(m.nccl_buffers)},
                            {"nccl_communicators", m.communicators},
                            {"fragmentation_bytes", JsonBytes(m.fragmentation)}};
      }
      stage["fits"] = StageNeeds(r, i) <= static_cast<PlanBytes>(r.gpu.hbm_bytes);
    } else {
      stage["memory"]["activations"] = nullptr;
      stage["memory"]["buffers"] = nullptr;
      stage["memory"]["peak"] = nullptr;
      stage["reserved_bytes"] = nullptr;
    }
    if (r.executor) {
      const ExecutorActivations& a = (*r.executor)[i];
      stage["executor"] = {{"peak_stashes", a.peak_stashes},
                           {"stashes", JsonBytes(a.stashes)},
                           {"working", JsonBytes(a.working)},
                           {"transfers", JsonBytes(a.transfers)},
                           {"carried", JsonBytes(a.carried)},
                           {"optimizer_step", JsonBytes(a.optimizer_step)},
                           {"activations", JsonBytes(a.peak())}};
    } else {
      stage["executor"] = nullptr;
    }
    stage["parameter_elements"] = JsonBytes(s.held.parameter_elements);
    stage["expert_elements"] = JsonBytes(s.held.expert_elements);
    if (time) {
      const StageTime& st = time->stages[i];
      stage["time"] = {
          {"forward_s", st.forward_s}, {"backward_s", st.backward_s}, {"flops", st.flops}};
    }
    if (!r.other_optimizer.empty()) {
      stage[distributed ? "optimizer_if_plain" : "optimizer_if_distributed"] =
          JsonBytes(r.other_optimizer[i]);
    }
    list.push_back(stage);
  }
  doc["stages"] = list;
  doc["not_modelled"] = NotModelled(config);
  return doc;
}

void PrintBarsSvg(const std::vector<std::string>& names, const std::vector<Bar>& bars,
                  double limit, const std::string& limit_name, std::ostream& out) {
  out << "<div class=\"legend\">";
  for (size_t i = 0; i < names.size(); ++i) {
    out << fmt::format("<span><i style=\"background:{}\"></i>{}</span>",
                       kColours[i % kColours.size()], HtmlEscape(names[i]));
  }
  double largest = 0;
  for (const Bar& bar : bars) {
    double total = 0;
    for (const BarPart& p : bar.parts) total += p.value;
    largest = std::max(largest, total);
  }
  // A limit far beyond the bars would squeeze them to nothing: it is then named, not drawn.
  const bool draw_limit = limit > 0 && limit <= 2 * largest;
  if (draw_limit) {
    out << fmt::format("<span><i style=\"background:#c00\"></i>{}</span>", HtmlEscape(limit_name));
  } else if (limit > 0) {
    out << fmt::format("<span>{} (off the scale: the largest bar is {:.2g}% of it)</span>",
                       HtmlEscape(limit_name), 100 * largest / limit);
  }
  out << "</div>\n";
  const double scale = std::max(draw_limit ? limit : 0, largest);
  // Labels in 11 px monospace take about 7 px a character.
  size_t label_chars = 20;
  for (const Bar& bar : bars) label_chars = std::max(label_chars, bar.label.size());
  const double kLabel = 7 * static_cast<double>(label_chars) + 10;
  constexpr double kWidth = 600, kRow = 22;
  const double height = kRow * static_cast<double>(bars.size()) + 6;
  out << fmt::format("<svg viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\" "
                     "font-family=\"monospace\" font-size=\"11\">\n",
                     kLabel + kWidth + 10, height, kLabel + kWidth + 10, height);
  for (size_t row = 0; row < bars.size(); ++row) {
    const Bar& bar = bars[row];
    const double y = kRow * static_cast<double>(row) + 3;
    out << fmt::format("<text x=\"0\" y=\"{}\">{}</text>\n", y + 14, HtmlEscape(bar.label));
    double x = kLabel;
    for (size_t i = 0; i < bar.parts.size(); ++i) {
      const double w = scale > 0 ? kWidth * bar.parts[i].value / scale : 0;
      if (w > 0) {
        out << fmt::format("<rect x=\"{:.2f}\" y=\"{}\" width=\"{:.2f}\" height=\"{}\" "
                           "fill=\"{}\"><title>{}</title></rect>\n",
                           x, y, w, kRow - 6, kColours[i % kColours.size()],
                           HtmlEscape(bar.parts[i].tooltip));
      }
      x += w;
    }
  }
  if (draw_limit) {
    const double x = kLabel + kWidth * limit / scale;
    out << fmt::format("<line x1=\"{:.2f}\" y1=\"0\" x2=\"{:.2f}\" y2=\"{}\" stroke=\"#c00\" "
                       "stroke-width=\"2\"><title>{}</title></line>\n",
                       x, x, height, HtmlEscape(limit_name));
  }
  out << "</svg>\n";
}

void PrintEstimateHtmlSection(const EstimateReport& r, const Topology& topology,
                              std::ostream& out) {
  const Config& config = r.config;
  const auto hbm = static_cast<PlanBytes>(r.gpu.hbm_bytes);
  out << fmt::format("<h2>memory and step time estimate on {} (mpusim estimate)</h2>\n",
                     HtmlEscape(r.gpu.name));
  out << fmt::format("<p>{} ranks ({}), parameters in {}{}; {}.</p>\n", topology.world_size(),
                     HtmlEscape(LayoutText(topology.sizes())), DTypeName(config.run->dtype),
                     r.run_given ? "" : " (no run section)",
                     HtmlEscape(OptimizerText(config, topology)));
  // Memory: a bar per stage, what its busiest rank holds at the peak.
  const std::vector<std::string> memory_names = {"parameters", "gradients", "optimizer",
                                                 "activations", "buffers", "reserve"};
  std::vector<Bar> bars;
  for (size_t i = 0; i < r.stages.size(); ++i) {
    const HeldMemory& h = r.stages[i].held;
    std::vector<PlanBytes> parts = {h.parameters, h.gradients, h.optimizer};
    if (r.activations) {
      parts.push_back((*r.activations)[i].activations);
      parts.push_back((*r.activations)[i].buffers);
      parts.push_back(r.reserves[i].total);
    }
    Bar bar{fmt::format("stage {} (rank {})", r.stages[i].stage, r.stages[i].rank), {}};
    for (size_t p = 0; p < parts.size(); ++p) {
      bar.parts.push_back({static_cast<double>(parts[p]),
                           fmt::format("stage {} {}: {}", r.stages[i].stage, memory_names[p],
                                       run::FormatBytes(parts[p]))});
    }
    bars.push_back(std::move(bar));
  }
  out << (r.activations ? "<h3>memory at the schedule's peak, by each stage's busiest rank</h3>\n"
                        : "<h3>memory held before the first step, by each stage's busiest "
                          "rank</h3>\n");
  PrintBarsSvg(memory_names, bars, static_cast<double>(hbm),
               fmt::format("{} of HBM", run::FormatBytes(hbm)), out);
  out << "<table class=\"report\"><tr><th>stage</th><th>rank</th><th>parameters</th>"
         "<th>gradients</th><th>optimizer</th><th>held</th>";
  if (r.activations) {
    out << "<th>stashes</th><th>activations</th><th>buffers</th><th>peak</th><th>reserve</th>"
           "<th>NCCL communicators</th><th>fits (peak + reserve)</th>";
  }
  out << "</tr>\n";
  for (size_t i = 0; i < r.stages.size(); ++i) {
    const StageHeldMemory& s = r.stages[i];
    out << "<tr>" << Td(std::to_string(s.stage)) << Td(std::to_string(s.rank))
        << Td(run::FormatBytes(s.held.parameters)) << Td(run::FormatBytes(s.held.gradients))
        << Td(run::FormatBytes(s.held.optimizer)) << Td(run::FormatBytes(s.held.total()));
    if (r.activations) {
      const StageActivations& a = (*r.activations)[i];
      const MemoryReserve& m = r.reserves[i];
      const PlanBytes needs = StageNeeds(r, i);
      out << Td(std::to_string(a.peak_stashes)) << Td(run::FormatBytes(a.activations))
          << Td(run::FormatBytes(a.buffers)) << Td(run::FormatBytes(StagePeak(r, i)))
          << Td(run::FormatBytes(m.total))
          << Td(m.given ? std::string("(--reserve-gib)")
                        : fmt::format("{}", fmt::join(m.communicators, ", ")))
          << (needs <= hbm ? "<td>" : "<td class=\"over\">")
          << HtmlEscape(FitsText(needs, hbm)) << "</td>";
    }
    out << "</tr>\n";
  }
  out << "</table>\n";
  if (!r.activations) {
    out << "<p class=\"note\">activations: not estimated: " << HtmlEscape(r.activations_missing)
        << "</p>\n";
  }
  out << "<p class=\"note\">Activations are Megatron's on a GPU as Korthikanti et al. 2022 "
         "count them, walked through the pipeline schedule. The reserve is what a GPU run adds "
         "(README \"The memory reserve\"): the CUDA context, cuBLAS workspaces, NCCL's buffers "
         "per communicator and the caching allocator's fragmentation, or --reserve-gib.</p>\n";
  if (!r.reserves.empty() && !r.reserves.front().given) {
    out << fmt::format(
        "<p class=\"note\">Reserve per rank: CUDA context {}, cuBLAS workspaces {}, NCCL "
        "buffers {} per communicator, allocator fragmentation {:.0f}% of the activations and "
        "buffers.</p>\n",
        run::FormatBytes(kCudaContextBytes), run::FormatBytes(r.reserves.front().cublas_workspaces),
        run::FormatBytes(kNcclBytesPerCommunicator),
        100 * kFragmentation);
  }
  if (r.attention) {
    out << "<p class=\"note\">Counted with " << HtmlEscape(AttentionText(*r.attention))
        << ".</p>\n";
  }
  if (r.executor) {
    out << fmt::format("<h3>what <code>mpusim run</code> keeps on the CPU executor, in {}</h3>\n",
                       DTypeName(config.run->dtype));
    out << "<table class=\"report\"><tr><th>stage</th><th>stashes</th><th>stash bytes</th>"
           "<th>working</th><th>transfers</th><th>carried</th><th>optimizer step</th>"
           "<th>activations</th></tr>\n";
    for (const ExecutorActivations& a : *r.executor) {
      out << "<tr>" << Td(std::to_string(a.stage)) << Td(std::to_string(a.peak_stashes))
          << Td(run::FormatBytes(a.stashes)) << Td(run::FormatBytes(a.working))
          << Td(run::FormatBytes(a.transfers)) << Td(run::FormatBytes(a.carried))
          << Td(run::FormatBytes(a.optimizer_step))
          << Td(run::FormatBytes(a.peak())) << "</tr>\n";
    }
    out << "</table>\n<p class=\"note\">The executor's own stash (norm statistics in the "
           "compute dtype, per-head copies, no dropout masks) walked through the same "
           "schedule, with the backward's working set, the pipeline's received and in-flight "
           "tensors, the distributed optimizer's gradient piece kept between iterations, or "
           "the optimizer step if larger: what <code>mpusim run --no-check --summary</code> "
           "measures as activations (peak - held).</p>\n";
    if (config.gpt && config.gpt->moe.enabled()) {
      out << "<p class=\"note\">" << HtmlEscape(kMoeRoutingNote) << "</p>\n";
    }
  }
  if (r.time) {
    const TimeEstimate& t = *r.time;
    const RunConfig& run = *config.run;
    out << fmt::format(
        "<h3>step time {}: {:.1f} model TFLOP/s per GPU, MFU {:.1f}%</h3>\n<p>global batch {} "
        "({} micro-batches of {} x dp {}), sequence {}, recompute {}; the busiest stage's "
        "rank.</p>\n",
        SecondsText(t.step_time_s), t.model_tflops_per_gpu, 100 * t.mfu, t.global_batch_size,
        t.num_microbatches, run.micro_batch_size, topology.sizes().dp, run.seq_length,
        RecomputeText(run.recompute));
    const bool cp = topology.sizes().cp > 1;
    const bool ep = config.gpt && config.gpt->moe.enabled();
    PrintBarsSvg(TimePartNames(cp, ep), {TimeBar("one iteration", t, cp, ep)}, 0, "", out);
    out << "<table class=\"report\"><tr><th>group</th><th>operation</th><th>count</th>"
           "<th>sent</th><th>time (exposed)</th><th>hidden</th><th>link</th></tr>\n";
    for (const CommTime& c : t.communication) {
      out << "<tr>" << Td(c.kind) << "<td class=\"name\">" << HtmlEscape(c.operation) << "</td>"
          << Td(std::to_string(c.count)) << Td(run::FormatBytes(static_cast<PlanBytes>(c.bytes)))
          << Td(SecondsText(c.seconds)) << Td(SecondsText(c.hidden_s))
          << Td(c.inter_node ? "across nodes" : "in a node") << "</tr>\n";
    }
    out << "</table>\n";
    out << fmt::format(
        "<p class=\"note\">GEMMs by their shapes at {:.1f}% of peak (ceiling {:.0f}%), "
        "memory-bound kernels at {:.0f}% of HBM bandwidth, collectives at {:.0f}% of link "
        "bandwidth; {}; attention: {}.</p>\n",
        100 * t.gemm_efficiency_achieved, 100 * t.gpu.gemm_efficiency,
        100 * t.gpu.memory_efficiency, 100 * t.gpu.collective_efficiency,
        HtmlEscape(OverlapText(config, t,
                               topology.sizes().cp > 1 && config.gpt &&
                                   config.gpt->cp_comm_type == CpCommType::kP2p)),
        HtmlEscape(AttentionTimeText(t)));
  } else {
    out << "<p class=\"note\">step time: not estimated: " << HtmlEscape(r.time_missing)
        << "</p>\n";
  }
  out << "<p class=\"note\">Not modelled: "
      << HtmlEscape(fmt::format("{}", fmt::join(NotModelled(config), "; "))) << ".</p>\n";
  out << "<script id=\"estimate\" type=\"application/json\">"
      << JsonForScript(EstimateJson(r, topology).dump()) << "</script>\n";
}

std::vector<std::string> TimePartNames(bool cp, bool ep) {
  std::vector<std::string> names = {"compute", "recompute", "tp collectives", "pp sends",
                                    "bubble", "dp gradient reduction", "optimizer"};
  if (cp) names.push_back("cp exchanges");
  if (ep) names.push_back("ep token exchanges");
  return names;
}

Bar TimeBar(const std::string& label, const TimeEstimate& t, bool cp, bool ep) {
  std::vector<double> parts = {t.compute_s, t.recompute_s, t.tp_comm_s, t.pp_comm_s,
                               t.bubble_s,  t.dp_comm_s,   t.optimizer_s};
  if (cp) parts.push_back(t.cp_comm_s);
  if (ep) parts.push_back(t.ep_comm_s);
  const std::vector<std::string> names = TimePartNames(cp, ep);
  Bar bar{label, {}};
  for (size_t p = 0; p < parts.size(); ++p) {
    // The bar draws what adds to the step; the tooltip names what overlap hides beside it.
    const double hidden = names[p] == "tp collectives"          ? t.tp_comm_hidden_s
                          : names[p] == "dp gradient reduction"   ? t.dp_comm_hidden_s
                          : names[p] == "ep token exchanges"      ? t.ep_comm_hidden_s
                                                                  : 0;
    const std::string note =
        hidden > 0 ? fmt::format(" exposed, {} hidden", SecondsText(hidden)) : "";
    bar.parts.push_back(
        {parts[p], fmt::format("{} {}: {}{}", label, names[p], SecondsText(parts[p]), note)});
  }
  return bar;
}

void PrintReportPageStart(const std::string& title, std::ostream& out) {
  out << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>"
      << HtmlEscape(title) << "</title>\n<style>\n"
      << "body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }\n"
      << "h1 { font-size: 18px; margin: 0 0 8px; }\n"
      << kReportStyle << "</style>\n</head>\n<body>\n<h1>" << HtmlEscape(title) << "</h1>\n";
}

void PrintReportPageEnd(std::ostream& out) { out << "</body>\n</html>\n"; }

void PrintEstimateHtml(const EstimateReport& r, const Topology& topology,
                       const std::string& source, std::ostream& out) {
  PrintReportPageStart("mpusim estimate of " + source, out);
  PrintEstimateHtmlSection(r, topology, out);
  PrintReportPageEnd(out);
}

}  // namespace mpusim::cli
