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
  const double h = static_cast<double>(g.hidden_size), s = static_cast<double>(seq_length);
  const double d = static_cast<double>(g.kv_channels);
  const double heads = static_cast<double>(g.num_attention_heads);
  const double groups = static_cast<double>(g.num_query_groups);
  // Forward GEMM FLOPs per token of one layer: QKV, projection, scores and context, and the
  // MLP; an MoE layer's MLP is its top-k experts' and the shared expert's (the router's
  // logits are not counted, as Megatron's count leaves them out). The scores and context
  // count half of s x s: "causal mask (only half of the mask is non-zero)", as
  // num_floating_point_operations (megatron/training/training.py) has since 2025-03-06
  // (commit 8873b55d6a); before, it counted the full s x s, as Narayanan et al. 2021 do.
  const double attention =
      2 * h * (heads + 2 * groups) * d + 2 * heads * d * h + 2 * 2 * s * heads * d / 2;
  const auto mlp = [&](double ffn) {
    return 2 * h * (IsGated(g.activation) ? 2 : 1) * ffn + 2 * ffn * h;
  };
  double per_token = 2 * h * static_cast<double>(padded_vocab);
  for (int64_t i = 0; i < g.num_layers; ++i) {
    per_token += attention;
    if (g.moe.enabled() && g.moe.layers[static_cast<size_t>(i)]) {
      per_token += static_cast<double>(g.moe.router_topk) *
                   mlp(static_cast<double>(g.moe.ffn_hidden_size));
      if (g.moe.shared_expert_intermediate_size) {
        per_token += mlp(static_cast<double>(*g.moe.shared_expert_intermediate_size));
      }
    } else {
      per_token += mlp(static_cast<double>(g.ffn_hidden_size));
    }
  }
  return 3 * per_token * s * static_cast<double>(samples);
}

}  // namespace mpusim
