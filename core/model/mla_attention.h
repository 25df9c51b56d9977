// Megatron-Core's MLASelfAttention (multi-latent attention, DeepSeek-V2/V3) with the local
// layer spec (get_gpt_layer_local_spec with multi_latent_attention): every projection a
// ColumnParallelLinear, the down projections' outputs gathered over tp, core attention
// (DotProductAttention) on this rank's heads, a row-parallel output projection.
//
// Shape legend (module.h; a heads, a_l = a / t on this rank, qk = qk_head_dim, pe =
// qk_pos_emb_head_dim, dq = qk + pe, dv = v_head_dim, ql = q_lora_rank, kl = kv_lora_rank;
// s_cp = s / cp this rank's tokens, R = s_cp*b their rows, R_l = s_l*b stream rows):
//   x          [R_l, h]            the input norm's output
//   q_down     [R, ql/t] --all-gather last dim--> [R, ql] (--split dim 0 under SP--> [R_l, ql])
//   q_norm     q_layernorm over ql (qk_layernorm only)
//   q          linear_q_up_proj: [R, a_l*dq]   (q_lora_rank null: linear_q_proj(x))
//   kv_down    [R, (kl+pe)/t] --all-gather last dim--> [R, kl + pe]: the latent [R, kl]
//              (--split dim 0 under SP--> [R_l, kl]), then k_pe [R, pe] (every position on
//              every rank, shared by the heads)
//   kv_norm    kv_layernorm over kl (qk_layernorm only)
//   kv         linear_kv_up_proj: [R, a_l*(qk + dv)], per head k_nope then v
//   query      [b, a_l, s_cp, dq]  q_nope, then R(q_pe)
//   key        [b, a_l, s_cp, dq]  k_nope, then R(k_pe) (the same for every head)
//   value      [b, a_l, s_cp, dv]
//   context    CoreAttention (core_attention.h) with one key and value head per query head
//              and softmax_scale -> [R, a_l*dv]; linear_proj -> [R_l, h] (bias to the caller)
// R is Megatron's MLA rope (apply_rotary_pos_emb with mla_rotary_interleaved): a pe-channel
// vector de-interleaved (even channels, then odd), then turned as rotate_half does with
// inv_freq (YaRN's for rope_type "yarn") and cos, sin times mscale. It runs as a batched GEMM
// over the positions with each position's [pe, pe] matrix (the de-interleave folded in), and
// its backward as the transposed GEMM, so no kernel of its own. Under context parallelism
// each token turns at its global position (the load-balanced split's: Megatron's rope
// embedding takes get_pos_emb_on_this_cp_rank), and CoreAttention does Transformer Engine's
// exchange for every cp_comm_type, which runs dq != dv.
// softmax_scale = mscale(f, mscale_all_dim)^2 / sqrt(dq) (MultiLatentAttention.__init__).
//
// k_pe's gradient: each tp rank forms it from its own heads only. Megatron-Core's local spec
// takes it through gather_from_tensor_model_parallel_region's backward (a split) without
// summing it over tp (Megatron-LM issue 1699, a bug at tp > 1); mpusim all-reduces it over
// tp first (the fix of Megatron-LM pull request 6839), so every layout trains the tp = 1
// model. Not built here: attention sinks and sliding windows (the config refuses them with
// multi_latent_attention).
// Selective recomputation ("core_attn") keeps query, key and value (the checkpoint's inputs,
// as Megatron's _checkpointed_attention_forward does) and reruns the probabilities.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/config/gpt_config.h"
#include "core/model/core_attention.h"
#include "core/model/layer_norm.h"
#include "core/model/linear.h"
#include "core/model/stash_plan.h"

namespace mpusim {

// MLA rope's inverse frequencies [pe/2] (RotaryEmbedding's, or YarnRotaryEmbedding's for
// rope_type "yarn") and the factor its cos and sin are scaled by.
struct MlaRopeFrequencies {
  std::vector<double> inv_freq;
  double mscale = 1.0;
};
MlaRopeFrequencies MlaRopeOf(const GptConfig& gpt);
// MultiLatentAttention's softmax_scale.
double MlaSoftmaxScaleOf(const GptConfig& gpt);

class MlaSelfAttention {
 public:
  // `prefix` is "decoder.layers.<i>.self_attention".
  MlaSelfAttention(const GptConfig& gpt, std::string prefix, ParameterSet& params, int64_t t);

  struct Stash {
    Tensor x;  // [R_l, h] the down projections' (q_proj's) input
    // [R_l, ql] the gathered query latent on this rank's rows (q_lora_rank): q_layernorm's
    // input, or without qk_layernorm linear_q_up_proj's (q_up_in is then the same tensor)
    Tensor q_latent;
    Norm::Stash q_norm;                   // its statistics (qk_layernorm)
    ColumnParallelLinear::Stash q_up_in;  // [R_l, ql] linear_q_up_proj's input
    Tensor kv_latent;  // [R_l, kl] the key latent, as q_latent (kv_layernorm's input)
    Norm::Stash kv_norm;
    ColumnParallelLinear::Stash kv_up_in;  // [R_l, kl] linear_kv_up_proj's input
    Tensor query, key;                     // [b*a_l*s, dq] after rope: core attention's q and k
    Tensor value;                          // [b*a_l*s, dv]
    std::optional<CoreAttention::Stash> core;  // empty while recomputation has dropped it
    RowParallelLinear::Stash proj_in;      // [R, a_l*dv]
  };
  static StashPlan PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                             bool keep_core);
  // x: the normalised stream [R_l, h] -> linear_proj output [R_l, h] (no bias).
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, bool keep_core, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, Stash& stash) const;

  Parameter* proj_bias() const { return proj_bias_; }

 private:
  // Each position's [pe, pe] rope matrix (de-interleave folded in), [s_cp, pe, pe] in `dtype`:
  // this rank's tokens at their global positions.
  Tensor RopeMatrices(const ModuleContext& ctx, DType dtype) const;
  static CoreAttention::Dims CoreDims(const GptConfig& gpt);

  std::string prefix_;
  int64_t a_l_, qk_, pe_, dv_, ql_, kl_;
  MlaRopeFrequencies rope_;
  CoreAttention core_;
  std::optional<ColumnParallelLinear> q_down_, q_up_, q_proj_;
  std::optional<Norm> q_norm_, kv_norm_;
  ColumnParallelLinear kv_down_, kv_up_;
  RowParallelLinear proj_;
  Parameter* proj_bias_;
};

}  // namespace mpusim
