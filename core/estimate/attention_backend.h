// Which attention kernel a GPU run of Megatron-Core uses, from the config's
// model.attention_backend, the run's dtype and the GPU's compute capability: what the
// activation count (activation_estimate.h) and the step-time model (time_estimate.h) count.
//
// Megatron-Core (megatron/core/models/common/language_module/language_module.py,
// _set_attention_backend) turns TransformerConfig.attention_backend into TransformerEngine's
// switches: "flash" sets NVTE_FLASH_ATTN=1 and the others 0, "fused" NVTE_FUSED_ATTN=1,
// "unfused" NVTE_UNFUSED_ATTN=1, "auto" all three 1 (TransformerEngine chooses), and "local"
// all three 0 (Megatron's own DotProductAttention, megatron/core/transformer/
// dot_product_attention.py, which needs context_parallel_size 1). TransformerEngine then
// picks in get_attention_backend (transformer_engine/pytorch/attention/dot_product_attention/
// utils.py): FlashAttention and FusedAttention (cuDNN) need compute capability 8.0 or newer
// ("Disabling FlashAttention 2 / FusedAttention for compute capability < sm80") and a
// bfloat16 or float16 qkv_dtype ("Disabling ... for unsupported qkv_dtype"); with both
// available it prefers FusedAttention on 9.0 and newer ("Disabling FlashAttention to give
// FusedAttention preference on Hopper+ for performance reasons") and FlashAttention below;
// UnfusedDotProductAttention is the fallback (float32). So "auto" resolves here to
//   bfloat16 / float16, compute capability >= 9.0   "fused"   (cuDNN, H100, H200)
//   bfloat16 / float16, compute capability 8.x      "flash"   (FlashAttention 2, A100)
//   float32 / float64, or compute capability < 8.0  "unfused"
// and "flash" or "fused" given where neither runs is refused, naming the field. Two of
// get_attention_backend's model filters are followed: attention sinks (softmax_type
// "off-by-one" / "learnable": "Disabling FlashAttention for softmax_type"; FusedAttention and
// UnfusedDotProductAttention run them) and multi-latent attention's query/key head dim
// (qk_head_dim + qk_pos_emb_head_dim) unlike its value head dim ("Disabling FlashAttention 2
// as it does not support MLA"; FlashAttention 3, compute capability 9.0 only, and
// FusedAttention run it): "auto" resolves to "fused" for them where it would pick "flash",
// and "flash" is refused, naming the field. Sliding windows run on both. What this leaves
// out: TransformerEngine's finer conditions (head dims above 256, FP8 attention, the
// installed flash-attn and cuDNN versions). TransformerEngine runs no
// unfused attention under context parallelism ("Disabling UnfusedDotProductAttention as it
// does not support context parallelism") and "local" asserts cp 1; for "unfused"/"local" with
// cp > 1 the estimate counts mpusim's own context-parallel attention (its CPU executor's) and
// says so.
//
// What the two kinds keep (activation_estimate.h) and cost (time_estimate.h):
//   materialised ("unfused", "local")  the s x s probabilities (softmax output, dropout mask
//                                       and output) in memory; scores, softmax, dropout and
//                                       context as separate kernels (Korthikanti et al.'s
//                                       count);
//   fused ("flash", "fused")            q, k, v, the output and each query row's float32
//                                       log-sum-exp (4 bytes per row and head); one kernel
//                                       that skips the blocks a causal mask hides, and whose
//                                       backward recomputes the probabilities (one more
//                                       QK^T GEMM).
#pragma once

#include <string>

#include "core/config/gpt_config.h"
#include "core/status.h"
#include "core/tensor.h"

namespace mpusim {

struct ResolvedAttention {
  AttentionBackend requested = AttentionBackend::kAuto;   // the config's
  AttentionBackend backend = AttentionBackend::kUnfused;  // what runs: never kAuto
  // Why, one phrase: "auto, bfloat16 on compute capability 9.0: TransformerEngine prefers
  // cuDNN's fused attention on Hopper and newer", or "as asked" (config or flag).
  std::string reason;
  // True for "flash" and "fused": no s x s tensor is kept or written.
  bool fused() const {
    return backend == AttentionBackend::kFlash || backend == AttentionBackend::kFused;
  }
};

// `compute_capability`: the GPU's, major * 10 + minor (80 for A100, 90 for H100). `cp`: the
// context-parallel size (for the note on materialised attention under cp). Errors name
// "model.attention_backend".
StatusOr<ResolvedAttention> ResolveAttentionBackend(const GptConfig& gpt, DType dtype,
                                                    int compute_capability, int64_t cp);

}  // namespace mpusim
