// The step time of a layout (time_estimate.h): prices each virtual stage's pieces of work
// (layer_cost.h, moe_cost.h) and communication (comm_cost.h, comm_overlap.h) per micro-batch,
// replays Megatron's schedule with them (core/schedule.h, TimeSchedule), adds the gradient
// reduction and parameter gather (overlapped or not) and the optimizer step, and reports the
// parts, the communication rows and MFU. Not here: the GEMM curve (gemm_curve.cc), Megatron's
// model FLOPs (model_flops.cc), the GPU presets (gpu_spec.cc).
#include "core/estimate/time_estimate.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/config/config.h"
#include "core/config/parallel_config.h"
#include "core/estimate/comm_cost.h"
#include "core/estimate/comm_overlap.h"
#include "core/estimate/estimable.h"
#include "core/estimate/layer_cost.h"
#include "core/estimate/memory_estimate.h"
#include "core/estimate/moe_cost.h"
#include "core/model/optimizer_plan.h"
#include "core/schedule.h"
#include "core/tensor.h"

namespace mpusim {

// The step-time model's pieces (layer_cost.h, moe_cost.h, comm_cost.h, comm_overlap.h).
using namespace step_time;  // NOLINT(google-build-using-namespace)

namespace {

constexpr double kTera = 1e12;

double PeakFlops(const GpuSpec& gpu, DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return gpu.peak_flops_64bit;
    case DType::kFloat32:
      return gpu.peak_flops_32bit;
    default:
      return gpu.peak_flops_16bit;
  }
}

}  // namespace

StatusOr<TimeEstimate> EstimateStepTime(const Config& config, const Topology& topology,
                                        const GpuSpec& gpu,
                                        const std::vector<StageHeldMemory>* held_given,
                                        const PipelineSchedule* schedule_given) {
  const StatusOr<const GptConfig*> model = EstimableModel(config, "the step-time estimate");
  if (!model.ok()) return model.status();
  const GptConfig& g = **model;
  const RunConfig& run = *config.run;
  const DerivedSizes& sz = topology.sizes();
  if (sz.cp > 1 && g.cp_comm_type == CpCommType::kA2aP2p) {
    return Status::Error("model.cp_comm_type",
                         "the step-time estimate does not model \"a2a+p2p\" (hierarchical "
                         "context parallelism) yet; p2p, all_gather and a2a it does");
  }
  const DType dtype = run.dtype;
  MPUSIM_RETURN_IF_ERROR(CheckFp8OnGpu(g, dtype, gpu));
  StatusOr<ResolvedAttention> attention =
      ResolveAttentionBackend(g, dtype, gpu.compute_capability, sz.cp);
  if (!attention.ok()) return attention.status();
  const AttentionKernels kernels{attention->fused(), PeakFlops(gpu, dtype),
                                 gpu.attention_efficiency_forward,
                                 gpu.attention_efficiency_backward,
                                 gpu.hbm_bandwidth * gpu.memory_efficiency};
  const double dense_peak = PeakFlops(gpu, dtype);
  const double peak = dense_peak * gpu.gemm_efficiency;
  const double hbm = gpu.hbm_bandwidth * gpu.memory_efficiency;
  const Sizes x{static_cast<double>(run.micro_batch_size), static_cast<double>(run.seq_length),
                static_cast<double>(g.hidden_size), static_cast<double>(sz.tp),
                static_cast<double>(DTypeSize(dtype)), topology.config().sequence_parallel,
                static_cast<double>(sz.cp), g.fp8.has_value()};
  const Link tp_link = LinkOf(topology, "tp", gpu, true);
  const Link pp_link = LinkOf(topology, "pp", gpu, false);
  const Link dp_link = LinkOf(topology, "dp_cp", gpu, true);
  // The ring's sends go to one neighbour; the collectives share the node's adapters.
  const Link cp_link = LinkOf(topology, "cp", gpu, g.cp_comm_type != CpCommType::kP2p);
  // `peak_s`: adds each shaped GEMM's seconds x its own peak (the achieved fraction's
  // denominator), when given.
  const auto seconds = [&](const Cost& c, double* peak_s = nullptr) {
    const double comm = static_cast<double>(c.collectives) *
                        RingSeconds(c.collective_bytes, sz.tp, 2, tp_link.bandwidth,
                                    tp_link.latency);
    double gemm = 0;
    for (const Gemm& m : c.gemms) {
      const double one = m.times * GemmSeconds(gpu, m.shape, x.e, dense_peak);
      gemm += one;
      if (peak_s) *peak_s += one * (m.shape.fp8 ? gpu.peak_flops_8bit : dense_peak);
    }
    return std::pair<double, double>{gemm + c.flops / peak + (c.bytes + c.quantize_bytes) / hbm + c.fused_s,
                                     comm};
  };

  // Each virtual stage's forward and backward (recomputation included) per micro-batch.
  const int64_t p = sz.pp, v = sz.vp.value_or(1), stages = p * v;
  // Each virtual stage's layers: the planner's split, so uneven stages cost unevenly.
  const std::vector<StageLayers> split = CheckedStages(topology.config().Split(), g.num_layers);
  const double vocab = static_cast<double>(g.PaddedVocabSize(sz.tp));
  const LayerCost layer = LayerForward(g, x, kernels);
  // The layers with a sliding window (window_size, window_attn_skip_freq): their attention
  // skips what lies left of the window (flash / fused).
  int64_t window = -1;
  for (int64_t i = 0; i < g.num_layers && window < 0; ++i) window = g.AttentionWindow(i);
  const LayerCost windowed = window >= 0 ? LayerForward(g, x, kernels, window) : layer;
  const auto slides = [&](int64_t i) { return g.AttentionWindow(i) >= 0; };
  // A dense layer's forward, and an MoE layer's (its exchange over ep apart); each also with
  // the sliding window's attention.
  const Cost mlp =
      MlpForward(x, static_cast<double>(g.Fc1Rows()), static_cast<double>(g.ffn_hidden_size));
  Cost dense = layer.total(), dense_windowed = windowed.total();
  dense += mlp;
  dense_windowed += mlp;
  MoeCost moe;
  Cost sparse = layer.total(), sparse_windowed = windowed.total();
  if (g.moe.enabled()) {
    const std::optional<size_t> ep_kind = topology.FindKind("ep");
    const Link ep_link = LinkOf(topology, "ep", gpu, false);
    moe = MoeForward(
        g, x, sz,
        {ep_link, LinkOf(topology, "expt_tp", gpu, true), LinkOf(topology, "tp_ep", gpu, true),
         {gpu.intra_node_bandwidth * gpu.collective_efficiency, gpu.intra_node_latency_s, false},
         ep_link.inter_node && ep_kind
             ? static_cast<double>(topology.FewestGroupMembersOnANode(*ep_kind))
             : static_cast<double>(sz.ep)});
    sparse += moe.compute;
    sparse_windowed += moe.compute;
  }
  const bool last_is_moe = g.moe.enabled() && g.moe.layers.back();
  // Layers `counts` of a stage: {dense, dense windowed, MoE, MoE windowed}.
  const auto layers_cost = [&](const std::array<int64_t, 4>& counts) {
    Cost c = Times(dense, counts[0]);
    c += Times(dense_windowed, counts[1]);
    c += Times(sparse, counts[2]);
    c += Times(sparse_windowed, counts[3]);
    return c;
  };
  const auto kind_of = [&](int64_t i) {
    const bool is_moe = g.moe.enabled() && g.moe.layers[static_cast<size_t>(i)];
    return static_cast<size_t>((is_moe ? 2 : 0) + (slides(i) ? 1 : 0));
  };
  // Multi-token prediction on the last stage, per micro-batch: each depth embeds the shifted
  // tokens, runs enorm and hnorm, eh_proj (column-parallel [2h -> h / t]), a layer like the
  // last decoder layer (full attention), its final norm and one more output layer and cross
  // entropy.
  // `mtp_checkpoint`: what full recomputation by "uniform" reruns of them (the norms,
  // eh_proj and the layer: RunConfig::CheckpointsMtpDepths).
  Cost mtp, mtp_checkpoint;
  for (int64_t k = 0; k < g.mtp_num_layers; ++k) {
    mtp += EmbeddingForward(g, x);
    Cost norms;
    norms.bytes = 3 * (2 * x.region_tokens() * x.h * x.e);
    mtp_checkpoint += norms;
    Cost eh_proj;
    eh_proj.Linear(x.tokens(), x.h / x.t, 2 * x.h, x.fp8);
    mtp_checkpoint += eh_proj;
    mtp_checkpoint += last_is_moe ? sparse : dense;
    mtp += OutputForward(x, vocab);
  }
  mtp += mtp_checkpoint;
  // A ring step's attention: the fused kernel's block, or 1/cp of the materialised attention
  // (its backward twice that).
  const auto [core_compute, core_comm] = seconds(layer.core_attention);
  const double step_forward =
      kernels.fused ? layer.ring_step_forward_s : (core_compute + core_comm) / x.cp;
  const double step_backward = kernels.fused ? layer.ring_step_backward_s : 2 * step_forward;
  const CpExchange cp = CpExchangeOf(g, x, sz.cp, cp_link, step_forward, step_backward);
  // Recomputation (a fully recomputed layer, or selective's core attention) repeats the
  // forward's exchange; per stage below, as full recomputation may leave layers out (block).
  const bool selective_core = run.Recomputes(RunConfig::RecomputeModule::kCoreAttn);
  const double cp_forward = cp.forward_s;
  const double cp_backward = cp.backward_s;
  // The MoE exchanges: the backward mirrors the forward's, full recomputation repeats them.
  const bool full = run.recompute == RunConfig::Recompute::kFull;
  const double ep_forward = moe.exchange_s;
  const double ep_backward = moe.exchange_s;
  // tp_comm_overlap: what TE's userbuffers hide of each layer's tp collectives.
  const bool tp_overlap = config.parallel.tp_comm_overlap && sz.tp > 1 && x.sp;
  const TpOverlap tpo = tp_overlap ? TpOverlapOf(g, x, tp_link, gpu, dense_peak) : TpOverlap{};
  // overlap_moe_expert_parallel_comm: what an MoE layer saves when its forward runs beside
  // another micro-batch's backward (CombinedSeconds), split as the stage's costs count it.
  const bool combined = config.parallel.overlap_moe_expert_parallel_comm && g.moe.enabled() &&
                        sz.ep > 1 && !full;
  double combined_saving = 0;
  if (combined) {
    Cost attention_side = layer.total();
    attention_side += moe.router;
    Cost attention_backward = Backward(attention_side);
    if (selective_core) attention_backward += Recomputed(layer.core_attention);
    const auto [dgrad, wgrad] = BackwardSplit(moe.experts);
    const auto total = [&](const Cost& c) {
      const auto [compute, comm] = seconds(c);
      return compute + comm;
    };
    CombinedLayer l;
    l.attn_fwd = std::max(0.0, total(attention_side) - tpo.moe_forward);
    l.attn_bwd = std::max(0.0, total(attention_backward) - tpo.moe_backward);
    l.mlp_fwd = total(moe.experts);
    l.mlp_dgrad = total(dgrad);
    l.mlp_wgrad = total(wgrad);
    l.dispatch_fwd = l.combine_fwd = ep_forward / 2;
    l.dispatch_bwd = l.combine_bwd = ep_backward / 2;
    combined_saving = std::max(0.0, l.Forward() + l.Backward() -
                                        CombinedSeconds(l, config.parallel.delay_wgrad_compute));
  }
  StageCosts costs;
  std::vector<double> compute_of(static_cast<size_t>(stages)), comm_of(compute_of);
  std::vector<double> flops_of(compute_of), cp_of(compute_of), ep_of(compute_of);
  std::vector<double> recompute_s_of(compute_of);  // the recomputed forwards' compute
  std::vector<double> tp_hidden_of(compute_of);
  std::vector<double> gemm_flops_of(compute_of), gemm_peak_s_of(compute_of);
  std::vector<Cost> forward_of(static_cast<size_t>(stages)), recompute_of(forward_of);
  std::vector<int64_t> moe_layers_of(static_cast<size_t>(stages));
  // The layers whose forward runs again in the backward (cp's exchanges), and the MoE ones.
  std::vector<int64_t> cp_again_of(moe_layers_of), ep_again_of(moe_layers_of);
  for (int64_t u = 0; u < stages; ++u) {
    // Virtual stage u holds its split's layers, each dense or MoE.
    const StageLayers& held = split[static_cast<size_t>(u)];
    const int64_t decoder_layers = held.count;
    // The stage's layers of each kind, and of those full recomputation reruns the forward of
    // once (a uniform group's layers together; block: the chunk's first
    // recompute_num_layers).
    std::array<int64_t, 4> kinds{}, recomputed_kinds{};
    for (int64_t k = 0; k < decoder_layers; ++k) {
      const size_t kind = kind_of(held.first + k);
      ++kinds[kind];
      if (run.GroupOf(k, decoder_layers).recomputed) ++recomputed_kinds[kind];
    }
    const int64_t windowed_layers = kinds[1] + kinds[3];
    // The last stage's MTP depths count as its layers for the exchanges (cp's in attention,
    // ep's in an MoE layer); full recomputation by "uniform" reruns their checkpoint.
    const int64_t mtp_layers = u == stages - 1 ? g.mtp_num_layers : 0;
    const int64_t layers = decoder_layers + mtp_layers;
    const int64_t decoder_moe = kinds[2] + kinds[3];
    const int64_t n_moe = decoder_moe + (last_is_moe ? mtp_layers : 0);
    Cost forward = layers_cost(kinds);
    if (mtp_layers > 0) forward += mtp;
    const int64_t mtp_again = run.CheckpointsMtpDepths() ? mtp_layers : 0;
    const int64_t r_all = recomputed_kinds[0] + recomputed_kinds[1] + recomputed_kinds[2] +
                          recomputed_kinds[3] + mtp_again;
    const int64_t r_moe = recomputed_kinds[2] + recomputed_kinds[3] + (last_is_moe ? mtp_again : 0);
    Cost recompute;
    if (full) recompute = Recomputed(layers_cost(recomputed_kinds));
    if (mtp_again > 0) recompute += Recomputed(mtp_checkpoint);
    if (selective_core) {
      recompute = Times(Recomputed(layer.core_attention), decoder_layers - windowed_layers);
      recompute += Times(Recomputed(windowed.core_attention), windowed_layers);
    }
    if (run.Recomputes(RunConfig::RecomputeModule::kLayernorm)) {
      // Both norms again: each reads and writes the layer's activation (as LayerForward).
      Cost norms;
      norms.bytes = 2 * (2 * x.region_tokens() * x.h * x.e);
      recompute += Times(Recomputed(norms), decoder_layers);
    }
    if (run.Recomputes(RunConfig::RecomputeModule::kMoe)) {
      // The whole MoE layer again ("moe"; its exchanges below); or its parts.
      recompute += Times(Recomputed(moe.compute), decoder_moe);
    } else {
      if (run.Recomputes(RunConfig::RecomputeModule::kMoeAct)) {
        recompute += Times(Recomputed(moe.activation), decoder_moe);
      }
      if (run.Recomputes(RunConfig::RecomputeModule::kSharedExperts)) {
        recompute += Times(Recomputed(moe.shared), decoder_moe);
      }
    }
    if (run.Recomputes(RunConfig::RecomputeModule::kMlp)) {
      // A dense layer's MLP again (Megatron recomputes no MoE layer's under "mlp").
      recompute += Times(Recomputed(MlpForward(x, static_cast<double>(g.Fc1Rows()),
                                               static_cast<double>(g.ffn_hidden_size))),
                         decoder_layers - decoder_moe);
    }
    if (u == 0) forward += EmbeddingForward(g, x);
    if (u == stages - 1) forward += OutputForward(x, vocab);
    Cost backward = Backward(forward);
    backward += recompute;
    const auto at = static_cast<size_t>(u);
    const auto [fc, fm] = seconds(forward, &gemm_peak_s_of[at]);
    const auto [bc, bm] = seconds(backward, &gemm_peak_s_of[at]);
    const auto n = static_cast<double>(layers), n_ep = static_cast<double>(n_moe);
    const auto r_n = static_cast<double>(r_all), r_ep = static_cast<double>(r_moe);
    // The MoE layers whose exchanges run again: recomputed whole (full), or selective "moe".
    const int64_t ep_reruns = full                                               ? r_moe
                              : run.Recomputes(RunConfig::RecomputeModule::kMoe) ? decoder_moe
                                                                                 : 0;
    const auto e_ep = static_cast<double>(ep_reruns);
    // The hidden tp seconds: every layer's forward, backward and (full) recomputed forward.
    const double hidden_forward = (n - n_ep) * tpo.dense_forward + n_ep * tpo.moe_forward;
    const double hidden_backward = (n - n_ep) * tpo.dense_backward + n_ep * tpo.moe_backward +
                                   (r_n - r_ep) * tpo.dense_forward + r_ep * tpo.moe_forward;
    // The exchanges each recomputed forward repeats: cp's in core attention, ep's in an MoE
    // layer.
    const double cp_again = (full             ? r_n
                             : selective_core ? static_cast<double>(decoder_layers)
                                              : 0) *
                            cp_forward;
    costs.forward.push_back(fc + fm - hidden_forward + n * cp_forward + n_ep * ep_forward);
    costs.backward.push_back(bc + bm - hidden_backward + n * cp_backward + cp_again +
                             n_ep * ep_backward + e_ep * ep_forward);
    recompute_s_of[at] = seconds(recompute).first;
    compute_of[at] = fc + bc - recompute_s_of[at];
    comm_of[at] = fm + bm - hidden_forward - hidden_backward;
    tp_hidden_of[at] = hidden_forward + hidden_backward;
    cp_of[at] = n * (cp_forward + cp_backward) + cp_again;
    ep_of[at] = n_ep * (ep_forward + ep_backward) + e_ep * ep_forward;
    flops_of[at] = forward.TotalFlops() + backward.TotalFlops();
    for (const Cost* c : {&forward, &backward}) {
      for (const Gemm& m : c->gemms) gemm_flops_of[at] += m.times * m.shape.Flops();
    }
    forward_of[at] = forward;
    recompute_of[at] = recompute;
    moe_layers_of[at] = n_moe;
    cp_again_of[at] = full ? r_all : selective_core ? decoder_layers : 0;
    ep_again_of[at] = ep_reruns;
  }
  // The activation (or its gradient) a stage sends: [s, b, h], a tp rank's 1/t of it with
  // sequence parallelism.
  const double p2p_bytes = x.tokens() * x.h * x.e / (x.sp ? x.t : 1);
  costs.transfer = p > 1 ? p2p_bytes / pp_link.bandwidth + pp_link.latency : 0;
  costs.blocking_sends = true;

  std::optional<PipelineSchedule> built;
  StatusOr<const PipelineSchedule*> schedule = RunSchedule(topology, run, schedule_given, &built);
  if (!schedule.ok()) return schedule.status();
  // The combined 1F1B schedule's pairs: a forward's MoE layers beside the backward's, layer
  // by layer (Megatron pairs layer i of the forward chunk with layer n - 1 - i of the
  // backward one; a pair of an MoE and a dense layer is counted as saving nothing).
  if (combined && (*schedule)->combined_1f1b) {
    costs.combined_saving.assign(static_cast<size_t>(stages * stages), 0.0);
    for (int64_t f = 0; f < stages; ++f) {
      for (int64_t b = 0; b < stages; ++b) {
        costs.combined_saving[static_cast<size_t>(f * stages + b)] =
            static_cast<double>(std::min(moe_layers_of[static_cast<size_t>(f)],
                                         moe_layers_of[static_cast<size_t>(b)])) *
            combined_saving;
      }
    }
  }
  // The replay without parameter gathers in it: the pipeline span the parts below add up to.
  const ScheduleTiming timing = TimeSchedule(**schedule, costs);

  // Each stage's gradient reduction and parameter gather: the dense parameters' over dp x cp,
  // the experts' over expt_dp (one after the other).
  std::vector<StageHeldMemory> counted;
  if (held_given == nullptr) {
    StatusOr<std::vector<StageHeldMemory>> held = EstimateStageHeldMemory(config, topology);
    if (!held.ok()) return held.status();
    counted = *std::move(held);
    held_given = &counted;
  }
  const bool distributed = config.optimizer && config.optimizer->use_distributed_optimizer;
  const Link expt_dp_link = LinkOf(topology, "expt_dp", gpu, true);
  const auto total = [](const std::vector<DpPart>& parts, double DpPart::*member) {
    double sum = 0;
    for (const DpPart& part : parts) sum += part.*member;
    return sum;
  };
  std::vector<std::vector<DpPart>> dp_of;
  for (const StageHeldMemory& stage : *held_given) {
    dp_of.push_back(DpPartsOf(stage.held, topology, dp_link, expt_dp_link,
                              PrecisionOf(config).main_grad, x.e, distributed));
  }
  // overlap_grad_reduce / overlap_param_gather (Megatron's DDP, megatron/core/distributed/):
  // buckets of bucket_size parameters (default max(40M, 1M x dp_cp)) on the first model chunk
  // of pipeline rank 0 only, one bucket per other chunk (training.py get_model: "Bucketing is
  // disabled for non-first chunks ... or for non-zero pipeline-parallel ranks"). A stage's
  // parameters are split evenly over its chunks.
  const bool overlap_reduce = config.optimizer && config.optimizer->overlap_grad_reduce;
  const bool overlap_gather = overlap_reduce && distributed &&
                              config.optimizer->overlap_param_gather;
  const auto buckets_of = [&](int64_t pp_rank, int64_t chunk) -> int64_t {
    if (!overlap_reduce || pp_rank != 0 || chunk != 0) return 1;
    // The trainable elements (Megatron buckets those with a gradient), the experts' with them.
    const HeldMemory& first = (*held_given)[0].held;
    const double elements = static_cast<double>(first.dense_elements + first.expert_elements) /
                            static_cast<double>(v);
    const auto size = static_cast<double>(config.optimizer->BucketSize(sz.dp * sz.cp));
    return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(elements / size)));
  };
  // Each pipeline rank's gather and reduction seconds, its group kinds one after the other;
  // with overlap_param_gather / overlap_grad_reduce, what of them the step waits for, replayed
  // on the schedule (comm_overlap.h).
  std::vector<double> gather_s_of, reduce_s_of;
  for (const std::vector<DpPart>& parts : dp_of) {
    gather_s_of.push_back(total(parts, &DpPart::gather_s));
    reduce_s_of.push_back(total(parts, &DpPart::reduce_s));
  }
  const DpOverlap dp_overlap = DpOverlapOf(**schedule, costs, timing, gather_s_of, reduce_s_of,
                                           buckets_of(0, 0), overlap_reduce, overlap_gather, p, v);
  const double gather_exposed = dp_overlap.gather_exposed;
  const double reduce_exposed = dp_overlap.reduce_exposed;

  TimeEstimate out;
  out.gpu = gpu;
  out.attention = *attention;
  out.num_microbatches = run.num_microbatches;
  out.global_batch_size = run.micro_batch_size * run.num_microbatches * sz.dp;
  const auto m = static_cast<double>(run.num_microbatches);
  for (int64_t r = 0; r < p; ++r) {
    StageTime st;
    st.stage = r;
    for (int64_t c = 0; c < v; ++c) {
      const auto u = static_cast<size_t>(c * p + r);
      st.forward_s += costs.forward[u];
      st.backward_s += costs.backward[u];
      st.flops += flops_of[u];
    }
    out.stages.push_back(st);
  }
  // The busiest stage: the most work per micro-batch.
  const auto busiest = static_cast<size_t>(
      std::max_element(out.stages.begin(), out.stages.end(),
                       [](const StageTime& a, const StageTime& b) {
                         return a.forward_s + a.backward_s < b.forward_s + b.backward_s;
                       }) -
      out.stages.begin());
  double compute = 0, recomputed = 0, tp = 0, tp_hidden = 0, cp_s = 0, ep_s = 0;
  double gemm_flops = 0, gemm_peak_s = 0;
  int64_t tp_count = 0, moe_layers = 0, cp_again = 0, ep_again = 0, busiest_layers = 0;
  double tp_bytes = 0;
  for (int64_t c = 0; c < v; ++c) {
    const auto u = static_cast<size_t>(c * p) + busiest;
    busiest_layers +=
        split[u].count + (u + 1 == static_cast<size_t>(stages) ? g.mtp_num_layers : 0);
    compute += compute_of[u];
    recomputed += recompute_s_of[u];
    gemm_flops += gemm_flops_of[u];
    gemm_peak_s += gemm_peak_s_of[u];
    tp += comm_of[u];
    tp_hidden += tp_hidden_of[u];
    cp_s += cp_of[u];
    ep_s += ep_of[u];
    moe_layers += moe_layers_of[u];
    cp_again += cp_again_of[u];
    ep_again += ep_again_of[u];
    // The busiest stage's tp collectives, as seconds() counted them: the forward's and the
    // backward's answers, and the recomputed ones.
    if (sz.tp > 1) {
      const int64_t n = 2 * forward_of[u].collectives + recompute_of[u].collectives;
      tp_count += n;
      tp_bytes += static_cast<double>(n) * x.tokens() * x.h * x.e;
    }
  }
  // The busiest stage's sends per micro-batch: each chunk's activation onward (but the
  // last virtual stage's) and its gradient back (but the first's).
  int64_t sends = 0;
  for (int64_t c = 0; c < v; ++c) {
    const int64_t u = c * p + static_cast<int64_t>(busiest);
    sends += (u + 1 < stages ? 1 : 0) + (u > 0 ? 1 : 0);
  }
  out.compute_s = m * compute;
  out.recompute_s = m * recomputed;
  out.gemm_efficiency_achieved = gemm_peak_s > 0 ? gemm_flops / gemm_peak_s : 0;
  out.tp_comm_s = m * tp;
  out.tp_comm_hidden_s = m * tp_hidden;
  out.cp_comm_s = m * cp_s;
  out.ep_comm_s = m * ep_s;
  // What the combined pairs hid of the busiest rank's exchanges: each pair's saving.
  if (!costs.combined_saving.empty()) {
    const auto& steps = (*schedule)->per_rank[busiest];
    for (size_t i = 0; i + 1 < steps.size(); ++i) {
      if (!(*schedule)->CombinedPairAt(static_cast<int64_t>(busiest), i)) continue;
      const int64_t f = steps[i].model_chunk * p + static_cast<int64_t>(busiest);
      const int64_t b = steps[i + 1].model_chunk * p + static_cast<int64_t>(busiest);
      out.ep_comm_hidden_s += costs.combined_saving[static_cast<size_t>(f * stages + b)];
      ++i;
    }
    out.ep_comm_s -= out.ep_comm_hidden_s;
  }
  out.pp_comm_s = p > 1 ? m * static_cast<double>(sends) * costs.transfer : 0;
  out.bubble_s = std::max(0.0, timing.makespan - out.compute_s - out.recompute_s -
                                   out.tp_comm_s - out.cp_comm_s - out.ep_comm_s - out.pp_comm_s);
  out.flops_per_rank = m * out.stages[busiest].flops;
  if (sz.tp > 1) {
    out.communication.push_back({"tp", sz.tp > 1 && x.sp ? "reduce-scatter + all-gather"
                                                         : "all-reduce",
                                 static_cast<int64_t>(m) * tp_count,
                                 m * tp_bytes * 2 * static_cast<double>(sz.tp - 1) /
                                     static_cast<double>(sz.tp),
                                 out.tp_comm_s, tp_link.inter_node});
    out.communication.back().hidden_s = out.tp_comm_hidden_s;
  }
  if (sz.cp > 1) {
    // Every layer of the busiest stage's chunks, each micro-batch: forward, backward and,
    // for the layers recomputed, the recomputed forward.
    const int64_t n = busiest_layers * run.num_microbatches;
    const int64_t again = cp_again * run.num_microbatches;
    out.communication.push_back(
        {"cp", cp.operation, n * (cp.forward_count + cp.backward_count) + again * cp.forward_count,
         static_cast<double>(n) * (cp.forward_bytes + cp.backward_bytes) +
             static_cast<double>(again) * cp.forward_bytes,
         out.cp_comm_s, cp_link.inter_node});
  }
  if (moe_layers > 0 && moe.exchanges > 0) {
    // Every MoE layer of the busiest stage's chunks, each micro-batch: forward, backward and,
    // for the layers recomputed, the recomputed forward.
    const int64_t n = (2 * moe_layers + ep_again) * run.num_microbatches;
    out.communication.push_back({"ep", moe.operation, n * moe.exchanges,
                                 static_cast<double>(n) * moe.exchange_bytes, out.ep_comm_s,
                                 moe.inter_node});
    out.communication.back().hidden_s = out.ep_comm_hidden_s;
  }
  if (p > 1) {
    // The busiest stage's own sends (each a blocking wait), per micro-batch as counted above.
    const int64_t sent = sends * run.num_microbatches;
    out.communication.push_back({"pp", "send/recv", sent, static_cast<double>(sent) * p2p_bytes,
                                 out.pp_comm_s, pp_link.inter_node});
  }

  // Gradients over dp x cp after the last backward (or overlapped with it), the parameters'
  // all-gather after the step (or overlapped with the next forward); the optimizer step over
  // the owned part. The busiest stage's communication rows; what adds to the step: without
  // overlap all of its gradient reduction and gather, with it the exposed parts found above.
  const HeldMemory& mem = (*held_given)[busiest].held;
  const double elements = static_cast<double>(mem.parameter_elements);
  const std::vector<DpPart>& busiest_dp = dp_of[busiest];
  const double reduce_s = total(busiest_dp, &DpPart::reduce_s);
  const double gather_s = total(busiest_dp, &DpPart::gather_s);
  const double reduce_shown = overlap_reduce ? reduce_exposed : reduce_s;
  const double gather_shown = overlap_gather ? gather_exposed : gather_s;
  out.dp_buckets = buckets_of(0, 0);
  for (const DpPart& part : busiest_dp) {
    // A kind's share of the exposed seconds: its share of the busiest stage's seconds.
    const double reduce_exposed_part = reduce_s > 0 ? reduce_shown * part.reduce_s / reduce_s : 0;
    const double gather_exposed_part = gather_s > 0 ? gather_shown * part.gather_s / gather_s : 0;
    if (!overlap_reduce) {
      out.communication.push_back(
          {part.kind, distributed ? "reduce-scatter + all-gather" : "all-reduce",
           distributed ? 2 : 1, part.reduce_bytes + part.gather_bytes,
           part.reduce_s + part.gather_s, part.inter_node});
      continue;
    }
    // With overlap the reduction and the gather are shown apart: they hide behind different
    // work.
    CommTime reduce_row{part.kind, distributed ? "reduce-scatter" : "all-reduce", 1,
                        part.reduce_bytes, reduce_exposed_part, part.inter_node};
    reduce_row.hidden_s = std::max(0.0, part.reduce_s - reduce_exposed_part);
    out.communication.push_back(reduce_row);
    if (distributed) {
      CommTime gather_row{part.kind, "all-gather", 1, part.gather_bytes, gather_exposed_part,
                          part.inter_node};
      gather_row.hidden_s = std::max(0.0, part.gather_s - gather_exposed_part);
      out.communication.push_back(gather_row);
    }
  }
  out.dp_comm_s = reduce_shown + gather_shown;
  out.dp_comm_hidden_s = std::max(0.0, reduce_s + gather_s - out.dp_comm_s);
  // Per owned element: read main_grad, master and states, write master, states and the
  // parameter (and a 16-bit main_grad's float32 copy written and read; with
  // store_param_remainders the parameter read too, the master's high half); per held
  // element: zero main_grad.
  const OptimizerPrecision precision = PrecisionOf(config);
  const double grad_bytes = static_cast<double>(DTypeSize(precision.main_grad));
  if (config.optimizer) {
    const double state_bytes =
        static_cast<double>(OptimizerStateBytes(*config.optimizer, precision));
    const double copy = precision.grads_copied_for_step ? 8.0 : 0.0;
    out.optimizer_s =
        (static_cast<double>(mem.optimizer_elements) *
             (grad_bytes + copy + 2 * state_bytes + (precision.param_remainders ? 2 : 1) * x.e) +
         elements * grad_bytes) /
        hbm;
  }
  // fp8: each weight's cast-transpose once per iteration (Transformer Engine caches the fp8
  // weights over the micro-batches after the first: Megatron's is_first_microbatch), an
  // upper bound that counts every held element as a linear weight.
  if (g.fp8) out.optimizer_s += elements * 4 / hbm;
  out.step_time_s = timing.makespan + out.dp_comm_s + out.optimizer_s;
  out.model_flops = ModelFlopsPerIteration(g, g.PaddedVocabSize(sz.tp), run.seq_length,
                                           out.global_batch_size);
  const double world = static_cast<double>(topology.world_size());
  out.model_tflops_per_gpu = out.model_flops / out.step_time_s / world / kTera;
  out.mfu = out.model_flops / out.step_time_s / world / PeakFlops(gpu, dtype);
  return out;
}

}  // namespace mpusim
