// Megatron's model FLOPs of one iteration (time_estimate.h's ModelFlopsPerIteration), the
// numerator of model TFLOP/s and MFU. Not what a rank executes (TimeEstimate::flops_per_rank:
// recomputation and flash attention's recomputed QK^T counted there).
#include <cstddef>
#include <cstdint>

#include "core/config/gpt_config.h"
#include "core/estimate/time_estimate.h"

namespace mpusim {

double ModelFlopsPerIteration(const GptConfig& g, int64_t padded_vocab, int64_t seq_length,
                              int64_t samples) {
  // num_floating_point_operations' transformer_flops (megatron/training/training.py), per
  // token and forward (its 3x for the backward's two GEMMs per forward GEMM applied at the
  // end), term by term.
  const double h = static_cast<double>(g.hidden_size), s = static_cast<double>(seq_length);
  const double heads = static_cast<double>(g.num_attention_heads);
  // Self attention's token-linear part and its core (scores and context: half of s x s, the
  // causal mask, "only half of the mask is non-zero", as Megatron counts since 2025-03-06,
  // commit 8873b55d6a; before, the full s x s, as Narayanan et al. 2021 do). Megatron counts
  // every layer's core over the whole causal s x s: a sliding window (window_size) does not
  // lower it, nor do the sinks (softmax_type) add to it.
  double attention = 0;
  if (g.mla.enabled) {
    // Multi-latent attention: Megatron's q_term (linear_q_proj, or the q down and up
    // projections with the q norm, its "+ 1"), the kv down projection of the latent with
    // its norm and up projection to the heads' keys and values, the decoupled rope key's
    // projection, linear_proj; the core over q/k head dims qk + pe and value head dim v.
    const MlaConfig& m = g.mla;
    const double qk = static_cast<double>(m.qk_head_dim);
    const double pe = static_cast<double>(m.qk_pos_emb_head_dim);
    const double v = static_cast<double>(m.v_head_dim);
    const double kv_lora = static_cast<double>(m.kv_lora_rank);
    const double q_term = m.q_lora_rank
                              ? static_cast<double>(*m.q_lora_rank) * (h + heads * (qk + pe) + 1)
                              : h * heads * (qk + pe);
    attention = 2 * (q_term + kv_lora * (h + heads * (qk + v) + 1) + h * pe + heads * v * h) +
                2 * (heads * (qk + pe) / 2 + heads * v / 2) * s;
  } else {
    const double d = static_cast<double>(g.kv_channels);
    const double groups = static_cast<double>(g.num_query_groups);
    attention = 2 * h * (heads + 2 * groups) * d + 2 * heads * d * h + 2 * 2 * s * heads * d / 2;
  }
  // Megatron's ffn_expansion_factor: 3 with --swiglu (fc1's two halves and fc2), else 2.
  // Megatron's count knows swiglu alone: any other gated activation (quick_geglu, gpt-oss's)
  // is counted as a plain MLP's 2, as Megatron reports it, though its fc1 has the two halves.
  const double ffn_factor = g.activation == Activation::kSwiglu ? 3 : 2;
  const auto mlp = [&](double ffn) { return 2 * h * ffn * ffn_factor; };
  // An MoE layer's MLP is its top-k experts' and the shared expert's (the router's logits
  // are not counted, as Megatron's count leaves them out, whatever the score function).
  const auto layer_mlp = [&](bool moe_layer) {
    if (!moe_layer) return mlp(static_cast<double>(g.ffn_hidden_size));
    double f =
        static_cast<double>(g.moe.router_topk) * mlp(static_cast<double>(g.moe.ffn_hidden_size));
    if (g.moe.shared_expert_intermediate_size) {
      f += mlp(static_cast<double>(*g.moe.shared_expert_intermediate_size));
    }
    return f;
  };
  const auto is_moe = [&](int64_t i) {
    return g.moe.enabled() && g.moe.layers[static_cast<size_t>(i)];
  };
  double per_token = 0;
  for (int64_t i = 0; i < g.num_layers; ++i) per_token += attention + layer_mlp(is_moe(i));
  // Multi-token prediction: each depth a layer like the last decoder layer (an MoE layer when
  // that is), its norms (enorm, hnorm, final: Megatron's 3h) and eh_proj [2h -> h], and one
  // more output layer's logits per depth.
  const auto mtp = static_cast<double>(g.mtp_num_layers);
  if (g.mtp_num_layers > 0) {
    per_token += mtp * (attention + layer_mlp(is_moe(g.num_layers - 1)));
    per_token += 2 * mtp * (3 * h + 2 * h * h);
  }
  per_token += 2 * h * static_cast<double>(padded_vocab) * (mtp + 1);
  return 3 * per_token * s * static_cast<double>(samples);
}

}  // namespace mpusim
