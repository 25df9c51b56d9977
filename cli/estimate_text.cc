// The estimate's text rendering (`mpusim estimate`'s default): what each stage holds, the
// peak with the reserve, what the CPU executor keeps, the step time's parts and the
// communication table. Not the JSON (estimate_json.cc) nor the HTML (estimate_html.cc).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <ostream>
#include <string>

#include "cli/estimate_parts.h"
#include "cli/estimate_report.h"
#include "core/config/model_facts.h"
#include "core/estimate/not_modelled.h"
#include "run/preflight.h"

namespace mpusim::cli {
namespace {

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
      "Reserve (docs/estimate.md, \"The memory reserve\"): CUDA context {}, cuBLAS workspaces {}, "
      "NCCL "
      "buffers {} per communicator the rank uses, allocator fragmentation {:.0f}% of the "
      "activations and buffers\n",
      run::FormatBytes(kCudaContextBytes),
      run::FormatBytes(r.reserves.empty() ? 0 : r.reserves.front().cublas_workspaces),
      run::FormatBytes(kNcclBytesPerCommunicator), 100 * kFragmentation);
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
  if (FactsOf(r.config).moe.enabled()) out << kMoeRoutingNote << '\n';
}

void PrintTimeText(const Config& config, const Topology& topology, const TimeEstimate& t,
                   std::ostream& out) {
  const RunConfig& run = *config.run;
  const ModelFacts facts = FactsOf(config);
  out << fmt::format(
      "Step time on {}: global batch {} ({} micro-batches of {} x dp {}), sequence {}, "
      "recompute {}\n",
      t.gpu.name, t.global_batch_size, t.num_microbatches, run.micro_batch_size,
      topology.sizes().dp, run.seq_length, RecomputeSummary(run));
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
      facts.moe.enabled()
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
  out << "  communication per iteration (busiest stage's rank): calls x bytes per call = bytes "
         "sent\n";
  for (const CommTime& c : t.communication) {
    // With overlap, each row's exposed seconds and its hidden ones.
    // Each call's size beside the total (the kind's column as wide as "expt_dp").
    const double per_call = c.count > 0 ? c.bytes / static_cast<double>(c.count) : 0.0;
    out << fmt::format(
        "    {:<7} {:<28} {:>7} x {:>10} = {:>10} sent  {:>10}  {}{}\n", c.kind, c.operation,
        c.count, run::FormatBytes(static_cast<PlanBytes>(per_call)),
        run::FormatBytes(static_cast<PlanBytes>(c.bytes)), SecondsText(c.seconds),
        AnyOverlap(config)
            ? fmt::format("exposed {:>10} hidden  ", c.hidden_s > 0 ? SecondsText(c.hidden_s) : "-")
            : "",
        c.inter_node ? "across nodes" : "in a node");
  }
  const bool ring = topology.sizes().cp > 1 && facts.cp_comm_type == CpCommType::kP2p;
  out << fmt::format(
      "  model: GEMMs by their shapes at {:.1f}% of peak (ceiling {:.0f}%), memory-bound "
      "kernels at {:.0f}% of HBM bandwidth, collectives at {:.0f}% of link bandwidth; {}\n",
      100 * t.gemm_efficiency_achieved, 100 * t.gpu.gemm_efficiency,
      100 * t.gpu.memory_efficiency, 100 * t.gpu.collective_efficiency,
      OverlapText(config, t, ring));
  out << "  attention: " << AttentionTimeText(t) << '\n';
  if (facts.fp8) {
    out << fmt::format(
        "  fp8 ({}, recipe {}): the linear layers' GEMMs at the fp8 peak (ceiling {:.0f}%) with "
        "their cast-transposes; router, logits and core attention at the 16-bit peak; MFU "
        "against the 16-bit peak\n",
        Fp8FormatName(*facts.fp8), Fp8RecipeName(facts.fp8_recipe),
        100 * t.gpu.gemm_efficiency_8bit);
  }
}

}  // namespace

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
  if (!r.executor_missing.empty()) {
    out << "CPU executor's activations: not counted: " << r.executor_missing << '\n';
  }
  if (r.time) {
    PrintTimeText(config, topology, *r.time, out);
  } else {
    out << "Step time: not estimated: " << r.time_missing << '\n';
  }
  for (const std::string& part : ModelParts(config)) out << "Model part: " << part << ".\n";
  out << fmt::format("Not modelled: {}.\n", fmt::join(NotModelled(config), "; "));
}

}  // namespace mpusim::cli
