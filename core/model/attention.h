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
//   context  core attention's output [s*b, a_l dk] (CoreAttention)
//   output   linear_proj: [s_l*b, h] (bias left to the caller's bias-dropout-add)
// Core attention (scores, softmax, dropout, context) and its context-parallel exchanges
// ("all_gather", "p2p", "a2a", "a2a+p2p") and attention sinks are CoreAttention's
// (core_attention.h), with dq = dv = dk and softmax scale 1 / sqrt(dk); this module prepares
// its queries, keys and values and takes their gradients back into the fused projection's.
// Selective recomputation keeps only qkv and reruns core attention in backward.
#pragma once

#include <optional>
#include <string>

#include "core/config/gpt_config.h"
#include "core/model/core_attention.h"
#include "core/model/layer_norm.h"
#include "core/model/linear.h"
#include "core/model/stash_plan.h"

namespace mpusim {

class SelfAttention {
 public:
  // `prefix` is "decoder.layers.<i>.self_attention" of layer i = `layer`.
  SelfAttention(const GptConfig& gpt, int64_t layer, std::string prefix, ParameterSet& params,
                int64_t t);

  struct CoreStash {
    Norm::Stash q_norm, k_norm;  // qk_layernorm only
    CoreAttention::Stash attn;   // q, k after the q/k norms and RoPE; v
  };
  struct Stash {
    ColumnParallelLinear::Stash qkv_in;
    Tensor qkv;                     // kept for selective recomputation
    std::optional<CoreStash> core;  // empty while recomputation has dropped it
    RowParallelLinear::Stash proj_in;
  };
  // The declared stash (stash_plan.h) on a rank of `shape`, in `dtype` storage; `keep_core`
  // false: selective recomputation (no CoreStash until the backward).
  static StashPlan PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                             bool keep_core);
  // x: the normalised stream [s_l*b, h] -> linear_proj output [s_l*b, h] (no bias).
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, bool keep_core, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, Stash& stash) const;

  Parameter* proj_bias() const { return proj_bias_; }

 private:
  // qkv -> core attention's output [s_cp*b, a_l*dk] (the split, the q/k norms, RoPE, then
  // CoreAttention).
  Tensor CoreForward(const ModuleContext& ctx, const Tensor& qkv, CoreStash* core) const;
  Tensor CoreBackward(const ModuleContext& ctx, const Tensor& dcontext,
                      const CoreStash& core) const;
  // dq [b*g_l*r*s_cp, dk], dk and dv [b*g_l*s_cp, dk] of this rank's tokens (after RoPE and
  // the q/k norms) back through them into the fused projection's gradient [s_cp*b, w].
  Tensor QkvGrad(const ModuleContext& ctx, const CoreStash& core, Tensor dq, Tensor dk,
                 const Tensor& dv) const;
  static CoreAttention::Dims CoreDims(const GptConfig& gpt);

  std::string prefix_;
  int64_t a_, g_, r_, dk_, a_l_, g_l_;
  bool rope_;
  double rotary_base_;
  int64_t rotary_dim_;
  CoreAttention core_;
  std::optional<Norm> q_norm_, k_norm_;  // qk_layernorm
  ColumnParallelLinear qkv_;
  RowParallelLinear proj_;
  Parameter* proj_bias_;
};

}  // namespace mpusim
