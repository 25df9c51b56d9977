#include "core/estimate/activation_estimate.h"

#include <algorithm>
#include <cmath>

#include "core/estimate/estimable.h"
#include "core/schedule.h"
#include "core/tensor.h"

namespace mpusim {
namespace {

PlanBytes ToBytes(double bytes) { return static_cast<PlanBytes>(std::llround(bytes)); }

// Bytes per element of a linear layer's saved input: the run's dtype, or with fp8 one byte
// plus the recipe's scales (blockwise: a float32 per 1 x 128 block; mxfp8: an E8M0 byte per
// 32 elements; delayed and tensorwise: one scale per tensor).
double Fp8SavedBytes(const GptConfig& g, double e) {
  if (!g.fp8) return e;
  if (g.fp8_recipe == Fp8Recipe::kBlockwise) return 1 + 4.0 / 128;
  if (g.fp8_recipe == Fp8Recipe::kMxfp8) return 1 + 1.0 / 32;
  return 1;
}

}  // namespace

StatusOr<std::vector<StageActivations>> EstimateStageActivations(
    const Config& config, const Topology& topology, const ResolvedAttention& attention,
    const PipelineSchedule* schedule_given) {
  const StatusOr<const GptConfig*> model = EstimableModel(config, "the activation count");
  if (!model.ok()) return model.status();
  const GptConfig& g = **model;
  const RunConfig& run = *config.run;
  const DerivedSizes& sz = topology.sizes();
  const bool sp = topology.config().sequence_parallel;
  const double e = static_cast<double>(DTypeSize(run.dtype));
  const double t = static_cast<double>(sz.tp);
  const double b = static_cast<double>(run.micro_batch_size);
  const double s = static_cast<double>(run.seq_length);
  const double cp = static_cast<double>(sz.cp);
  const double T = s * b / cp, h = static_cast<double>(g.hidden_size);  // this rank's tokens
  const double split_sp = sp ? t : 1;  // what sequence parallelism divides the whole parts by
  const double m_h = g.hidden_dropout > 0 ? 1 : 0, m_a = g.attention_dropout > 0 ? 1 : 0;
  const double d = static_cast<double>(g.kv_channels);
  const double a = static_cast<double>(g.num_attention_heads);
  const double f1 = static_cast<double>(g.Fc1Rows()), f = static_cast<double>(g.ffn_hidden_size);
  // fp8 (model.fp8): Transformer Engine's linears save their inputs quantized (header): the
  // QKV and fc1 inputs, the projection's and fc2's, x one byte and the recipe's scales.
  const double x = Fp8SavedBytes(g, e);
  // The core attention's query, key and value widths (all heads) and the projection's input.
  // Multi-latent attention: the up-projected queries and keys of qk + pe channels a head (the
  // rope key, shared by the heads, expanded to each), the values of v, the projection's input
  // a v per head; and the latents (header).
  double q_in = a * d, k_in = static_cast<double>(g.num_query_groups) * d, v_in = k_in;
  double latents = 0;
  if (g.mla.enabled) {
    const MlaConfig& mla = g.mla;
    q_in = k_in = a * static_cast<double>(mla.QHeadDim());
    v_in = a * static_cast<double>(mla.v_head_dim);
    const double q_lora = static_cast<double>(mla.q_lora_rank.value_or(0));
    const double kv_lora = static_cast<double>(mla.kv_lora_rank);
    // The q and kv latents (their norms' inputs) and the norms' outputs (the up projections'
    // inputs), sequence-split under sp as Megatron's duplicated down projections leave them,
    // and the decoupled rope key's input (gathered over the sequence: every position).
    latents = T * (q_lora + kv_lora) * (e + x) / split_sp +
              T * static_cast<double>(mla.qk_pos_emb_head_dim) * e;
  }
  const double proj_in = g.mla.enabled ? v_in : q_in;
  const double whole = T * h * (2 * e + 2 * x + 2 * m_h) / split_sp + latents;
  const double split = T * (e * (q_in + k_in + v_in + f1) + x * (proj_in + f)) / t;
  // Materialised attention: the probabilities of this rank's queries against every key
  // (all_gather; a2a: every query of 1/cp of the heads: as many); the ring (p2p, a2a+p2p)
  // keeps none, but the log-sum-exp of each query row, in float32. Flash / fused attention
  // keeps that log-sum-exp whatever the cp_comm_type.
  const bool ring = sz.cp > 1 && (g.cp_comm_type == CpCommType::kP2p ||
                                  g.cp_comm_type == CpCommType::kA2aP2p);
  const double scores = ring || attention.fused() ? 4 * b * a * (s / cp) / t
                                                  : b * a * (s / cp) * s * (e + m_a * (e + 1)) / t;
  // all_gather also keeps the keys and values of every position.
  const double gathered =
      sz.cp > 1 && g.cp_comm_type == CpCommType::kAllGather ? b * s * (k_in + v_in) * e / t : 0;
  double layer = whole + split + scores + gathered;
  const bool selective_core = run.Recomputes(RunConfig::RecomputeModule::kCoreAttn);
  if (selective_core) layer = whole + split;
  // Full recomputation: the first layer of a recomputed group keeps its input alone, the
  // group's others nothing (per chunk below).
  const double layer_input = T * h * e / split_sp;
  // A mixture-of-experts layer: the attention's part, and in place of the MLP's activation
  // input and output the router's, the permutation's and the experts' tensors (header).
  double moe_layer = layer;
  if (g.moe.enabled()) {
    const MoeConfig& moe = g.moe;
    const double Tn = T / split_sp;  // this rank's tokens (sp: required with tp > 1)
    const double E = static_cast<double>(moe.num_experts);
    const double k = static_cast<double>(moe.router_topk);
    const double fm = static_cast<double>(moe.ffn_hidden_size);
    const double fm1 = IsGated(g.activation) ? 2 * fm : fm;
    const double etp = static_cast<double>(sz.etp);
    double kept = 1;
    if (moe.expert_capacity_factor) {
      kept = moe.pad_expert_input_to_capacity ? *moe.expert_capacity_factor
                                              : std::min(1.0, *moe.expert_capacity_factor);
    }
    const double rows = Tn * k * kept;  // this rank's tokens' rows, sent and returned
    const double n = rows * etp;        // the rows this rank's experts compute
    const double router = Tn * E * (4 + 1) + Tn * k * 4;
    const double experts = n * h * x + n * (fm1 * e + fm * x) / etp;
    // The combine's probabilities in the router's dtype (probs.type_as(logits)).
    const double p = static_cast<double>(DTypeSize(RouterDTypesOf(moe, run.dtype).logits));
    const double combine = rows * (8 + h * e + p);
    double shared = 0;
    if (moe.shared_expert_intermediate_size) {
      const double fs = static_cast<double>(*moe.shared_expert_intermediate_size);
      shared = T * ((IsGated(g.activation) ? 2 * fs : fs) * e + fs * x) / t;
    }
    const double attention_split = T * e * (q_in + k_in + v_in + proj_in) / t;
    moe_layer = whole + attention_split + scores + gathered + router + experts + combine + shared;
    if (selective_core) moe_layer -= scores + gathered;
    // Selective "moe": the layer keeps its input alone (in `whole`); "moe_act": not the
    // activation's output; "shared_experts": not the shared expert's tensors.
    if (run.Recomputes(RunConfig::RecomputeModule::kMoe)) {
      moe_layer -= router + experts + combine + shared;
    } else {
      if (run.Recomputes(RunConfig::RecomputeModule::kMoeAct)) moe_layer -= n * fm * x / etp;
      if (run.Recomputes(RunConfig::RecomputeModule::kSharedExperts)) moe_layer -= shared;
    }
  }
  // Selective "layernorm": neither norm's output is kept (QKV's and fc1's or the MoE layer's
  // input); "mlp": a dense layer's MLP keeps its input alone (not fc1's output, fc2's input).
  if (run.Recomputes(RunConfig::RecomputeModule::kLayernorm)) {
    layer -= 2 * T * h * x / split_sp;
    moe_layer -= 2 * T * h * x / split_sp;
  }
  if (run.Recomputes(RunConfig::RecomputeModule::kMlp)) layer -= T * (e * f1 + x * f) / t;

  const int64_t p = sz.pp, v = sz.vp.value_or(1), stages = p * v;
  const bool last_is_moe = g.moe.enabled() && g.moe.layers.back();
  const std::vector<StageLayers> stage_layers =
      CheckedStages(topology.config().Split(), g.num_layers);
  const double vocab = static_cast<double>(g.PaddedVocabSize(sz.tp));
  std::optional<PipelineSchedule> built;
  StatusOr<const PipelineSchedule*> found = RunSchedule(topology, run, schedule_given, &built);
  if (!found.ok()) return found.status();
  const PipelineSchedule* schedule = *found;
  std::vector<StageActivations> out;
  for (int64_t r = 0; r < p; ++r) {
    // Each chunk's stash of one micro-batch.
    std::vector<double> stash(static_cast<size_t>(v));
    for (int64_t c = 0; c < v; ++c) {
      const int64_t u = c * p + r;
      const StageLayers& held = stage_layers[static_cast<size_t>(u)];
      double bytes = 0;
      for (int64_t k = 0; k < held.count; ++k) {
        const RunConfig::RecomputeGroup group = run.GroupOf(k, held.count);
        const bool is_moe =
            g.moe.enabled() && g.moe.layers[static_cast<size_t>(held.first + k)];
        bytes += group.recomputed ? (group.first == k ? layer_input : 0)
                 : is_moe         ? moe_layer
                                  : layer;
      }
      if (u == 0) bytes += m_h * T * h / split_sp;  // the embedding dropout's mask
      if (u == stages - 1) {
        bytes += T * h * e / split_sp + 4 * T * vocab / t;
        // Multi-token prediction's depths on the last stage: each its embedding's dropout
        // mask, enorm's and hnorm's inputs, eh_proj's input (the two norms' outputs), a
        // transformer layer like the last decoder layer, its final norm's input and float32
        // logits of one micro-batch; under full recomputation by "uniform" the checkpoint's
        // two inputs (enorm's and hnorm's) alone besides the mask and the logits.
        const double depth =
            run.CheckpointsMtpDepths()
                ? T * h * (m_h + 2 * e) / split_sp
                : T * h * (m_h + 2 * e + 2 * x + e) / split_sp + (last_is_moe ? moe_layer : layer);
        bytes += static_cast<double>(g.mtp_num_layers) * (depth + 4 * T * vocab / t);
      }
      stash[static_cast<size_t>(c)] = bytes;
    }
    double live = 0, peak = 0;
    int64_t alive = 0, peak_alive = 0;
    const auto& steps = schedule->per_rank[static_cast<size_t>(r)];
    for (size_t i = 0; i < steps.size(); ++i) {
      const double bytes = stash[static_cast<size_t>(steps[i].model_chunk)];
      if (schedule->CombinedPairAt(r, i)) {
        // A combined 1F1B pair (overlap_moe_expert_parallel_comm) runs the forward's layer j
        // beside the backward's layer n - 1 - j, so the forward's stash grows a layer at a
        // time as the backward's is freed a layer at a time (PyTorch frees a node's saved
        // tensors when its backward has run): with per-layer stashes lf and lb over n layers,
        // the most held is live + max(n lf - (n - 1) lb, lf). Both micro-batches are partly
        // alive then.
        const double freed = stash[static_cast<size_t>(steps[i + 1].model_chunk)];
        const StageLayers& paired = stage_layers[static_cast<size_t>(steps[i].model_chunk * p + r)];
        const double n = static_cast<double>(std::max<int64_t>(paired.count, 1));
        const double during = live + std::max(bytes - freed + freed / n, bytes / n);
        if (during > peak) {
          peak = during;
          peak_alive = alive + 1;
        }
        live += bytes - freed;
        ++i;
        continue;
      }
      const bool forward = steps[i].pass == Pass::kForward;
      live += forward ? bytes : -bytes;
      alive += forward ? 1 : -1;
      if (live > peak) {
        peak = live;
        peak_alive = alive;
      }
    }
    StageActivations act;
    act.stage = r;
    act.peak_stashes = peak_alive;
    act.activations = ToBytes(peak);
    double buffers = p > 1 ? 4 * T * h * e / split_sp : 0;
    if (sp && sz.tp > 1) buffers += T * h * e;
    act.buffers = ToBytes(buffers);
    out.push_back(act);
  }
  return out;
}

}  // namespace mpusim
