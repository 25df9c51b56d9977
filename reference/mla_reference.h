// The float64 reference of multi-latent attention (DeepSeek-V2/V3), as Megatron-Core's
// MLASelfAttention computes it with the local layer spec
// (megatron/core/transformer/multi_latent_attention.py), on one slice of the samples: the
// GPT reference's attention when multi_latent_attention is set (gpt_reference.cc calls it
// with the input norm's output and takes the context for linear_proj).
//
// Shape legend: as gpt_reference.cc's, and a = heads, qk = qk_head_dim, pe =
// qk_pos_emb_head_dim, dq = qk + pe, dv = v_head_dim, ql = q_lora_rank, kl = kv_lora_rank.
//
//   q   = up_q(norm_q(down_q(x)))              [s*n, a*dq]  (q_lora_rank null: linear_q_proj(x))
//   c   = down_kv(x)                           [s*n, kl + pe]: the latent, then k_pe
//   kv  = up_kv(norm_kv(c[:, :kl]))            [s*n, a*(qk + dv)]: per head k_nope, then v
//   query = [q_nope, R(q_pe)], key = [k_nope, R(k_pe)] (k_pe shared by the heads), value = v
//   context = dropout(softmax(query key^T * softmax_scale, causal)) value   [s*n, a*dv]
// R is Megatron's MLA rope: the pe channels de-interleaved (even ones, then odd ones), then
// turned as rotate_half does, cos and sin scaled by YaRN's mscale; the result stays
// de-interleaved (query and key alike, so the scores are those of the interleaved pairs).
#pragma once

#include <string>
#include <vector>

#include "core/config/gpt_config.h"
#include "reference/gpt_reference_ops.h"

namespace mpusim::gpt_reference {

// A layer's MLA parameters; undefined (kv_down) without multi_latent_attention.
struct MlaParams {
  Param q_down, q_up;  // [ql, h], [a*dq, ql]: q_lora_rank set
  Param q_proj;        // [a*dq, h]: q_lora_rank null
  NormParams q_norm;   // [ql]: qk_layernorm with q_lora_rank
  Param kv_down;       // [kl + pe, h]
  NormParams kv_norm;  // [kl]: qk_layernorm
  Param kv_up;         // [a*(qk + dv), kl]
  bool defined() const { return kv_down.defined(); }
};

// What MlaForward keeps for MlaBackward.
struct MlaStash {
  Mat q_in;                // [s*n, ql or h]: linear_q_up_proj's (linear_q_proj's) input
  NormStash q_norm;        // q_layernorm's
  Mat kv_in;               // [s*n, kl]: linear_kv_up_proj's input
  NormStash kv_norm;       // kv_layernorm's
  std::vector<Mat> query;  // [n*a] (index j*a + hd): [s, dq], rope applied
  std::vector<Mat> key;    // [n*a]: [s, dq]
  std::vector<Mat> value;  // [n*a]: [s, dv]
  std::vector<Mat> probs;  // [n*a]: softmax [s, s], exactly 0 above the diagonal
  std::vector<Mat> keep;   // [n*a]: attention dropout scales [s, s]
};

// The YaRN (or plain) rope frequencies of MLA's pe channels, [pe/2], and the factor its cos
// and sin are scaled by (YarnRotaryEmbedding.get_emb; 1 for rope_type "rope").
struct MlaRopeTable {
  std::vector<double> inv_freq;
  double mscale = 1.0;
};
MlaRopeTable MlaRope(const GptConfig& gpt);
// MultiLatentAttention's softmax_scale: yarn_get_mscale(rotary_scaling_factor,
// mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim).
double MlaSoftmaxScale(const GptConfig& gpt);

// Returns the context [s*n, a*dv] of the input norm's output x [s*n, h]; attention dropout
// from `site` in micro-batch m.
Mat MlaForward(const Dims& d, const GptConfig& gpt, const Mat& x, const MlaParams& p,
               const std::string& site, int64_t m, MlaStash* st);
// Returns d x [s*n, h]; `dprobs` gets the [n*a] matrices d loss / d probs; the parameters'
// gradients add into their accumulators.
Mat MlaBackward(const Dims& d, const GptConfig& gpt, const Mat& x, const Mat& dcontext,
                const MlaStash& st, MlaParams& p, std::vector<Mat>* dprobs);

}  // namespace mpusim::gpt_reference
