// Megatron-Core's SelfAttention (local spec): a column-parallel fused QKV projection, core
// attention (DotProductAttention) on this rank's heads, and a row-parallel output projection.
//
// Shape legend (module.h; a heads, g query groups, r = a / g heads per group, dk =
// kv_channels, a_l = a / t and g_l = g / t on this rank):
//   qkv      [s*b, (a_l + 2 g_l) dk]   per query group: its r query heads, then its key head,
//                                      then its value head (Megatron's row order)
//   q        [b, g_l, r, s, dk]        contiguous copies; with qk_layernorm each head row
//                                      normalised over dk (q_layernorm, k_layernorm), then
//                                      RoPE on its first RotaryDim() channels
//   k, v     [b, g_l, s, dk]           one key/value head per group: grouped-query attention
//                                      is a batched GEMM per (sample, group) over r*s rows,
//                                      so no head is repeated in memory
//   scores   [b, g_l, r*s, s] = [b, a_l, s, s]   q k^T / sqrt(dk)
//   probs    causal softmax (query i sees keys <= i), in float32 for 16-bit storage, then
//            attention dropout at site <layer>.self_attention.core_attention.attention_dropout
//   context  probs v -> [b, a_l, s, dk] -> [s*b, a_l dk]
//   output   linear_proj: [s_l*b, h] (bias left to the caller's bias-dropout-add)
// Context parallelism (cp_comm_type "all_gather"): s above is this cp rank's s_cp = s / cp
// tokens for the queries, and the keys and values of all s positions are all-gathered over cp
// after RoPE (each rank turns its own at their global positions) and put in sequence order;
// query row i sees key j when position(j) <= position(i). Their gradients go back by
// reduce-scatter. Probabilities are [b, a_l, s_cp, s].
// Selective recomputation keeps only qkv and reruns core attention in backward.
#pragma once

#include <optional>
#include <string>

#include "core/config/gpt_config.h"
#include "core/model/layer_norm.h"
#include "core/model/linear.h"

namespace mpusim {

class SelfAttention {
 public:
  // `prefix` is "decoder.layers.<i>.self_attention".
  SelfAttention(const GptConfig& gpt, std::string prefix, ParameterSet& params, int64_t t);

  struct CoreStash {
    Tensor q;              // after the q/k norms and RoPE
    Tensor k, v;           // the same, of every position: gathered over cp when cp > 1
    Norm::Stash q_norm, k_norm;  // qk_layernorm only
    Tensor probs;          // [b*a_l*s, s] before dropout
    Tensor probs_dropped;  // after dropout (probs itself when attention_dropout is 0)
  };
  struct Stash {
    ColumnParallelLinear::Stash qkv_in;
    Tensor qkv;                     // kept for selective recomputation
    std::optional<CoreStash> core;  // empty while recomputation has dropped it
    RowParallelLinear::Stash proj_in;
  };
  // x: the normalised stream [s_l*b, h] -> linear_proj output [s_l*b, h] (no bias).
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, bool keep_core, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, Stash& stash) const;

  Parameter* proj_bias() const { return proj_bias_; }

 private:
  Tensor CoreForward(const ModuleContext& ctx, const Tensor& qkv, CoreStash* core) const;
  Tensor CoreBackward(const ModuleContext& ctx, const Tensor& dcontext, const CoreStash& core) const;
  IndexPieces ProbsMap(const StreamShape& sh) const;

  std::string prefix_;
  int64_t a_, g_, r_, dk_, a_l_, g_l_;
  bool rope_;
  double rotary_base_;
  int64_t rotary_dim_;
  std::optional<Norm> q_norm_, k_norm_;  // qk_layernorm
  double dropout_;
  ColumnParallelLinear qkv_;
  RowParallelLinear proj_;
  Parameter* proj_bias_;
};

}  // namespace mpusim
