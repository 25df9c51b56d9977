// The pieces of work of the step-time model (layer_cost.h): a piece's backward and
// recomputation, and the forward of a layer's attention (materialised, or flash / fused with
// its efficiency curve and causal tile share), a dense MLP, the embedding and the output layer.
// Not here: what those cost in seconds (time_estimate.cc, gemm_curve.cc).
#include "core/estimate/layer_cost.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "core/config/gpt_config.h"

namespace mpusim::step_time {
namespace {

// A flash kernel's efficiency over `keys` keys per query tile: the plateau times
// keys / (keys + L_half), the curve through cuDNN's measured 512- and 16k-position points
// in FlashAttention-3's Figures 5 and 6 (forward 497 and 595 TFLOP/s: L_half 105 keys;
// backward 305 and 516: L_half 374). Small blocks (a cp rank's) run below the plateau.
constexpr double kAttentionHalfKeysForward = 105;
constexpr double kAttentionHalfKeysBackward = 374;
double AttentionEfficiency(double plateau, double half_keys, double keys) {
  return plateau * keys / (keys + half_keys);
}
// Flash kernels tile the s x s scores in 128 x 128 blocks (FlashAttention 2 and 3, cuDNN:
// 128-row query tiles for head dims up to 128) and under a causal mask skip the blocks above
// the diagonal: of n x n blocks they compute n (n + 1) / 2.
constexpr double kAttentionTile = 128;
double CausalShare(double positions) {
  const double n = std::max(1.0, std::ceil(positions / kAttentionTile));
  return (n + 1) / (2 * n);
}
// Under a sliding window of `window` keys left of the diagonal (window_size [w, 0]) a query
// tile also skips the blocks wholly left of its window: query tile i computes key blocks
// max(0, i - wb) .. i, wb = ceil(w / 128) (the partial one included). The share of the
// n x n blocks computed; CausalShare when the window covers the sequence.
double WindowShare(double positions, double window) {
  const double n = std::max(1.0, std::ceil(positions / kAttentionTile));
  const double wb = std::ceil(window / kAttentionTile);
  if (window < 0 || wb + 1 >= n) return CausalShare(positions);
  // Tiles 0 .. wb compute i + 1 blocks, the other n - wb - 1 compute wb + 1 each.
  const double blocks = (wb + 1) * (wb + 2) / 2 + (n - wb - 1) * (wb + 1);
  return blocks / (n * n);
}
// The backward recomputes the probabilities (QK^T) and runs four GEMMs (dV, dP, dQ, dK):
// 5 GEMMs of the forward's 2, FlashAttention's own count.
constexpr double kFusedBackwardFlops = 2.5;

}  // namespace

Cost Times(Cost c, int64_t n) {
  for (Gemm& g : c.gemms) g.times *= static_cast<double>(n);
  c.flops *= static_cast<double>(n);
  c.bytes *= static_cast<double>(n);
  c.quantize_bytes *= static_cast<double>(n);
  c.collectives *= n;
  c.fused_s *= static_cast<double>(n);
  c.fused_flops *= static_cast<double>(n);
  c.fused_backward_s *= static_cast<double>(n);
  c.fused_backward_flops *= static_cast<double>(n);
  return c;
}
Cost Backward(Cost c) {
  std::vector<Gemm> backward;
  c.quantize_bytes = 0;
  for (const Gemm& g : c.gemms) {
    const GemmShape& s = g.shape;
    backward.push_back({{s.m, s.k, s.n, s.count, s.fp8}, g.times});
    backward.push_back({{s.k, s.n, s.m, s.count, s.fp8}, g.times});
    if (s.fp8) c.quantize_bytes += 4 * s.m * s.n * s.count * g.times;
  }
  c.gemms = std::move(backward);
  c.flops *= 2;
  c.bytes *= 2;
  c.fused_s = c.fused_backward_s;
  c.fused_flops = c.fused_backward_flops;
  c.fused_backward_s = c.fused_backward_flops = 0;
  return c;
}
std::pair<Cost, Cost> BackwardSplit(const Cost& c) {
  Cost dgrad = Backward(c), wgrad;
  std::vector<Gemm> both = std::move(dgrad.gemms);
  dgrad.gemms.clear();
  for (size_t i = 0; i < both.size(); ++i) (i % 2 == 0 ? dgrad : wgrad).gemms.push_back(both[i]);
  return {dgrad, wgrad};
}
Cost Recomputed(Cost c) {
  c.fused_backward_s = c.fused_backward_flops = 0;
  return c;
}

Cost MlpForward(const Sizes& x, double fc1_rows, double ffn) {
  const double T = x.tokens();
  const double fc1 = fc1_rows / x.t, f = ffn / x.t;
  Cost c;
  c.Linear(T, fc1, x.h, x.fp8);  // fc1: [T, h] x [h, fc1 / t]
  c.Linear(T, x.h, f, x.fp8);    // fc2: [T, f / t] x [f / t, h]
  c.bytes = T * (fc1 + f) * x.e;
  if (x.t > 1) {
    c.collectives = 1;
    c.collective_bytes = T * x.h * x.e;
  }
  return c;
}

LayerCost LayerForward(const GptConfig& g, const Sizes& x, const AttentionKernels& kernels,
                       int64_t window) {
  const double T = x.tokens(), Tn = x.region_tokens(), h = x.h, t = x.t, e = x.e;
  const double heads = static_cast<double>(g.num_attention_heads) / t;
  const double groups = static_cast<double>(g.num_query_groups) / t;
  const double d = static_cast<double>(g.kv_channels);
  // The head dims of the scores (query . key) and of the context (probabilities . value).
  double d_qk = d, d_v = d;
  const double mask_byte = 1;  // a dropout mask element
  LayerCost c;
  Cost& r = c.rest;
  // norm 1 and 2: read and write the layer's activation.
  r.bytes += 2 * (2 * Tn * h * e);
  if (g.mla.enabled) {
    // Multi-latent attention (multi_latent_attention.py): the down projections duplicated
    // on every tp rank over its sequence-split tokens (TELinear "duplicated"), the latents'
    // norms, the column-parallel up projections to this rank's heads, rope on the pe
    // channels (the queries' and the shared key's), the row-parallel linear_proj.
    const MlaConfig& m = g.mla;
    d_qk = static_cast<double>(m.QHeadDim());
    d_v = static_cast<double>(m.v_head_dim);
    const double kv_lora = static_cast<double>(m.kv_lora_rank);
    const double pe = static_cast<double>(m.qk_pos_emb_head_dim);
    if (m.q_lora_rank) {
      const double q_lora = static_cast<double>(*m.q_lora_rank);
      r.Linear(Tn, q_lora, h, x.fp8);            // linear_q_down_proj
      r.bytes += 2 * Tn * q_lora * e;            // q_layernorm
      r.Linear(T, heads * d_qk, q_lora, x.fp8);  // linear_q_up_proj
    } else {
      r.Linear(T, heads * d_qk, h, x.fp8);  // linear_q_proj
    }
    r.Linear(Tn, kv_lora + pe, h, x.fp8);  // linear_kv_down_proj
    r.bytes += 2 * Tn * kv_lora * e;       // kv_layernorm
    r.Linear(T, heads * (static_cast<double>(m.qk_head_dim) + d_v), kv_lora, x.fp8);
    r.bytes += 2 * T * (heads + 1) * pe * e;  // rope
    r.Linear(T, h, heads * d_v, x.fp8);       // linear_proj
  } else {
    // QKV and projection.
    r.Linear(T, (heads + 2 * groups) * d, h, x.fp8);
    r.Linear(T, h, heads * d, x.fp8);
    if (g.position_embedding_type == PositionEmbedding::kRope) {
      r.bytes += 2 * T * (heads + groups) * static_cast<double>(g.RotaryDim()) * e;
    }
    if (g.qk_layernorm) r.bytes += 2 * T * (heads + groups) * d * e;
  }
  // two bias-dropout-adds: read the branch and the residual, write the sum (and a mask).
  const double dropout_mask = g.hidden_dropout > 0 ? mask_byte : 0;
  r.bytes += 2 * Tn * h * (3 * e + dropout_mask);
  // the attention's tp collective of the layer's activation (all-reduce, or reduce-scatter
  // and all-gather with sequence parallelism).
  if (x.t > 1) {
    r.collectives = 1;
    r.collective_bytes = T * h * e;
  }
  // core attention; under context parallelism this rank's queries against every key (a2a:
  // every query of 1/cp of the heads, as many).
  Cost& a = c.core_attention;
  const double scores = x.b * heads * (x.s / x.cp) * x.s;
  if (!kernels.fused) {
    // Materialised ("unfused", "local"): the full s x s scores whatever the mask (a sliding
    // window's included), then scale-mask-softmax and dropout over them in memory.
    a.flops += 2 * scores * (d_qk + d_v);
    a.bytes += 2 * scores * e;  // fused scale-mask-softmax
    if (g.attention_dropout > 0) a.bytes += scores * (2 * e + mask_byte);
    return c;
  }
  // Flash / fused: one kernel, nothing s x s in memory, the blocks above the causal diagonal
  // skipped. A kernel's efficiency follows the keys each query tile visits.
  const auto seconds_at = [&](double flops, double keys) {
    return std::pair<double, double>{
        flops / (kernels.peak *
                 AttentionEfficiency(kernels.forward_efficiency, kAttentionHalfKeysForward, keys)),
        kFusedBackwardFlops * flops /
            (kernels.peak *
             AttentionEfficiency(kernels.backward_efficiency, kAttentionHalfKeysBackward, keys))};
  };
  // FLOPs of one query-key pair, QK^T and PV.
  const double per_score = 2 * x.b * heads * (d_qk + d_v);
  double forward_flops = 0, forward_s = 0, backward_s = 0;
  if (x.cp > 1 && g.cp_comm_type == CpCommType::kP2p) {
    // The ring (Megatron's load-balanced chunks: a rank's s / cp queries are chunks r and
    // 2 cp - 1 - r of c = s / (2 cp) positions): step 0 its own keys, causal over 2c x 2c;
    // each of the cp - 1 other steps a half block, 2c x c (the half a causal mask keeps),
    // with c keys per query tile on the ranks that get the first half of the keys.
    const double chunk = x.s / (2 * x.cp);
    const double diagonal = per_score * 4 * chunk * chunk * CausalShare(2 * chunk);
    const double step = per_score * 2 * chunk * chunk;
    const auto [diagonal_f, diagonal_b] = seconds_at(diagonal, 2 * chunk * CausalShare(2 * chunk));
    const auto [step_f, step_b] = seconds_at(step, chunk);
    forward_flops = diagonal + (x.cp - 1) * step;
    // Merging the steps' partial results (TransformerEngine's AttnFuncWithCPAndKVP2P,
    // context_parallel.py) is memory-bound, after the ring or on a side stream: forward, each
    // of the cp steps' outputs read and folded into a float32 output by its log-sum-exp
    // ("fwd output correction: out in torch.float32"), then cast back; backward, each step's
    // dq added into dq and the received key and value gradients into dk, dv (read, read,
    // write). On the rank whose every step is full (cp rank cp - 1).
    const double q_elements = x.tokens() * heads * d_v;  // the output's (and its gradient's)
    const double kv_elements =
        g.mla.enabled ? x.tokens() * heads * (d_qk + d_v)
                      : 2 * x.tokens() * static_cast<double>(g.num_query_groups) / x.t * d;
    const double merge_forward = x.cp * q_elements * (x.e + 8) + q_elements * (4 + x.e);
    const double merge_backward = x.cp * 3 * (q_elements + kv_elements) * x.e;
    forward_s = diagonal_f + (x.cp - 1) * step_f + merge_forward / kernels.hbm;
    backward_s = diagonal_b + (x.cp - 1) * step_b + merge_backward / kernels.hbm;
    c.ring_step_forward_s = step_f;
    c.ring_step_backward_s = step_b;
  } else {
    // One kernel over this rank's queries and every key (all_gather), or every query of 1/cp
    // of the heads (a2a): each query tile visits on average a causal share of the s keys, or
    // under a sliding window the share of its window's blocks (WindowShare).
    const double share = WindowShare(x.s, static_cast<double>(window));
    forward_flops = per_score * (x.s / x.cp) * x.s * share;
    std::tie(forward_s, backward_s) = seconds_at(forward_flops, x.s * share);
  }
  a.fused_flops = forward_flops;
  a.fused_s = forward_s;
  a.fused_backward_flops = kFusedBackwardFlops * forward_flops;
  a.fused_backward_s = backward_s;
  return c;
}

Cost EmbeddingForward(const GptConfig& g, const Sizes& x) {
  Cost c;
  const double T = x.tokens();
  c.bytes += T * x.h * x.e * (g.has_position_embeddings() ? 4 : 2);
  if (g.hidden_dropout > 0) c.bytes += T * x.h * (2 * x.e + 1);
  if (x.t > 1) {  // the vocab-parallel lookup's all-reduce (reduce-scatter with sp)
    c.collectives = 1;
    c.collective_bytes = T * x.h * x.e;
  }
  return c;
}
Cost OutputForward(const Sizes& x, double padded_vocab) {
  Cost c;
  const double T = x.tokens(), v = padded_vocab / x.t;
  c.bytes += 2 * x.region_tokens() * x.h * x.e;  // final norm
  c.Linear(T, v, x.h, false);  // logits: tensor_parallel.ColumnParallelLinear, never fp8
  c.bytes += T * v * (x.e + 4 + 4);               // cross entropy: read logits, float32 softmax
  if (x.t > 1 && x.sp) {                          // all-gather of the final norm's output
    c.collectives = 1;
    c.collective_bytes = T * x.h * x.e;
  }
  return c;
}

}  // namespace mpusim::step_time
