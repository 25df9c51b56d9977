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
//   probs    causal softmax (query i sees keys <= i; with a sliding window w, window_size
//            [w, 0] on this layer, only keys i - w .. i), in float32 for 16-bit storage, then
//            attention dropout at site <layer>.self_attention.core_attention.attention_dropout
//   context  probs v -> [b, a_l, s, dk] -> [s*b, a_l dk]
//   output   linear_proj: [s_l*b, h] (bias left to the caller's bias-dropout-add)
// Context parallelism (cp_comm_type "all_gather"): s above is this cp rank's s_cp = s / cp
// tokens for the queries, and the keys and values of all s positions are all-gathered over cp
// after RoPE (each rank turns its own at their global positions) and put in sequence order;
// query row i sees key j when position(j) <= position(i). Their gradients go back by
// reduce-scatter. Probabilities are [b, a_l, s_cp, s]. cp_comm_type "p2p" passes the keys
// and values around the cp ring instead and merges blocks by log-sum-exp (attention.cc,
// RingForward); the probabilities are never whole. cp_comm_type "a2a" (Ulysses) exchanges
// heads for sequence: after RoPE an all-to-all over cp gives each cp rank every position of
// 1/cp of its heads (q [b, g_l/cp, r, s, dk], k and v [b, g_l/cp, s, dk], probabilities
// [b, a_l/cp, s, s]), and a second one gives the context back to the tokens' ranks.
// cp_comm_type "a2a+p2p" (hierarchical_context_parallel_sizes [a, c]) does both: an
// all-to-all over the a ranks of hcp_L0 gives each the group's positions (two super-chunks
// of s / (2c)) of 1/a of the heads, and the "p2p" ring runs over the c ranks of hcp_L1.
// The exchanges themselves are core/context_parallel/'s (all_gather.h, a2a.h, ring.h,
// hierarchical.h, on the load-balanced split of sequence_order.h); this module keeps the
// attention math around them.
// Attention sinks (softmax_type "off-by-one", "learnable"; Megatron's SoftmaxOne): each row's
// softmax has one more logit, 0 or its head's core_attention.softmax_offset, in its
// denominator only; the probabilities stay [.., s] (the sink's is dropped).
// Selective recomputation keeps only qkv and reruns core attention in backward.
#pragma once

#include <optional>
#include <string>

#include "core/config/gpt_config.h"
#include "core/model/layer_norm.h"
#include "core/model/linear.h"
#include "core/model/stash_plan.h"

namespace mpusim {

class SelfAttention {
 public:
  // `prefix` is "decoder.layers.<i>.self_attention" of layer i = `layer`.
  SelfAttention(const GptConfig& gpt, int64_t layer, std::string prefix, ParameterSet& params,
                int64_t t);

  // cp_comm_type "p2p": what the backward ring needs (attention.cc RingForward). Per query
  // half h (this rank's chunk h, c = s / (2 cp) positions): the queries [b*g_l, r*c, dk],
  // the merged output [b*g_l*r*c, dk] and its log-sum-exp over every key [b*g_l*r*c]
  // (compute dtype); this rank's keys and values in chunks, [2 (k, v), 2 (chunk), b*g_l, c,
  // dk], what the ring passes.
  struct RingStash {
    Tensor q[2], out[2], lse[2];
    Tensor kv;
  };
  // The ring's geometry: "p2p" runs it over cp on this rank's two chunks and its heads;
  // "a2a+p2p" over hcp level 1 on two super-chunks (its level-0 group's chunks, after the
  // level-0 all-to-all of heads for positions) and 1/a of the heads (a: level 0's size).
  // RingStash's c and b*g_l are then the ring's c and b*gl.
  struct RingLayout {
    Communicator* group = nullptr;  // the ring
    int64_t size = 1, rank = 0;     // its ranks and this one's place
    int64_t c = 0;                  // positions per chunk, s / (2 size); a rank holds two
    int64_t al = 0, gl = 0;         // heads and query groups of the ring's tensors
    int64_t head0 = 0;              // the first of those heads among the layer's a
  };
  struct CoreStash {
    Tensor q;              // after the q/k norms and RoPE (1/cp of the heads: "a2a")
    Tensor k, v;           // the same, of every position: gathered over cp ("all_gather");
                           // this rank's ("p2p"); 1/cp of the heads ("a2a")
    Norm::Stash q_norm, k_norm;  // qk_layernorm only
    Tensor probs;          // [b*a_l*s, s] before dropout (not kept by the ring)
    Tensor probs_dropped;  // after dropout (probs itself when attention_dropout is 0)
    Tensor lse;            // [b*a_l*s] compute dtype: each row's log-sum-exp with the sink
                           // (softmax_type "learnable" only, for the sink's gradient)
    std::optional<RingStash> ring;  // cp_comm_type "p2p"
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
  Tensor CoreForward(const ModuleContext& ctx, const Tensor& qkv, CoreStash* core) const;
  Tensor CoreBackward(const ModuleContext& ctx, const Tensor& dcontext, const CoreStash& core) const;
  IndexPieces ProbsMap(const StreamShape& sh) const;
  ShardSpec ProbsSpec(const ModuleContext& ctx) const;  // of the probabilities [B, a, s, s]
  std::optional<Tensor> Sink(const ModuleContext& ctx, DType dtype) const;
  // cp_comm_type "p2p": core attention with the keys and values passed around the cp ring,
  // a block of c queries by c keys at a time, merged by log-sum-exp. RingForward returns
  // the context [b*g_l, r*s_cp, dk]; RingBackward takes its gradient and returns dq (same
  // shape) and this rank's dk, dv [b*g_l*s_cp, dk].
  Tensor RingForward(const ModuleContext& ctx, CoreStash* core) const;
  void RingBackward(const ModuleContext& ctx, const Tensor& dcontext, const CoreStash& core,
                    Tensor* dq, Tensor* dk, Tensor* dv) const;
  // Where the probabilities of the ring's query chunk `q_chunk` and key chunk `k_chunk`
  // ([b, ring.al, c, c]) sit in the full [B, a, s, s]: one piece per sample.
  IndexPieces BlockMap(const StreamShape& sh, const RingLayout& ring, int64_t q_chunk,
                       int64_t k_chunk) const;
  IndexPieces LocalBlockMap(const StreamShape& sh, const RingLayout& ring, int64_t q_half,
                            int64_t k_chunk) const;
  RingLayout Ring(const ModuleContext& ctx) const;
  // The context [b, a_l, s_cp, dk] as core attention's output [s_cp*b, a_l*dk], recorded.
  Tensor ContextToColumns(const ModuleContext& ctx, const Tensor& context, int64_t al,
                          int64_t dk) const;
  // dq [b*g_l*r*s_cp, dk], dk and dv [b*g_l*s_cp, dk] of this rank's tokens (after RoPE and
  // the q/k norms) back through them into the fused projection's gradient [s_cp*b, w].
  Tensor QkvGrad(const ModuleContext& ctx, const CoreStash& core, Tensor dq, Tensor dk,
                 const Tensor& dv) const;
  // The probabilities and their gradient of every key, for the records of a ring run
  // (computed only when the pass records, on keys and values gathered for it).
  void RecordRingProbs(const ModuleContext& ctx, const CoreStash& core, const Tensor* dcontext) const;

  std::string prefix_;
  int64_t a_, g_, r_, dk_, a_l_, g_l_;
  bool rope_;
  bool ring_;      // cp_comm_type "p2p" (with context_parallel_size > 1)
  bool cp_heads_;  // cp_comm_type "a2a" (with context_parallel_size > 1)
  bool hier_;      // cp_comm_type "a2a+p2p" (with context_parallel_size > 1)
  double rotary_base_;
  int64_t rotary_dim_;
  // window_size[0] when this layer slides (GptConfig::AttentionWindow), else -1: the causal
  // mask of every cp split is the kernels' q - window <= k <= q on global positions.
  int64_t window_;
  // softmax_type: "off-by-one" adds a logit 0 to every row's denominator, "learnable" the
  // per-head parameter core_attention.softmax_offset ([a], split over tp by heads: sink_).
  // Transformer Engine builds either under context parallelism only with "a2a", which keeps
  // whole rows on one rank, so the sink enters each row's softmax once.
  SoftmaxType softmax_type_;
  Parameter* sink_;
  std::optional<Norm> q_norm_, k_norm_;  // qk_layernorm
  double dropout_;
  ColumnParallelLinear qkv_;
  RowParallelLinear proj_;
  Parameter* proj_bias_;
};

}  // namespace mpusim
