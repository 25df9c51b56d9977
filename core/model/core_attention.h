// Core attention: Megatron-Core's DotProductAttention on this rank's heads, and under context
// parallelism Transformer Engine's (attn_forward_func_with_cp) with each cp_comm_type. One
// module for both attentions of the GPT: SelfAttention (attention.h: grouped-query heads of
// kv_channels) and MlaSelfAttention (mla_attention.h: one key and value per query head, the
// query and key head dim qk + pe apart from the value's dv). They prepare the queries, keys
// and values (projections, norms, rope) and take their gradients back; this module computes
// softmax(q k^T * scale) v and its backward, with the exchanges cp needs.
//
// Shape legend (module.h; a heads, g key/value heads (query groups), r = a / g, a_l = a / t
// and g_l = g / t on this rank, dq the query and key head dim, dv the value's, s_cp = s / cp
// this rank's tokens):
//   q          [b, g_l, r, s_cp, dq]   after the caller's rope, contiguous per head
//   k          [b, g_l, s_cp, dq]      one key head per group (grouped-query attention is a
//   v          [b, g_l, s_cp, dv]      batched GEMM per (sample, group) over r*s rows)
//   scores     [b, a_l, s_cp, s] = q k^T * scale
//   probs      causal softmax (query i sees keys <= i; with a sliding window w only keys
//              i - w .. i), then attention dropout at <prefix>.core_attention.attention_dropout
//   context    probs v -> [b, a_l, s_cp, dv] -> core_attention.output [s_cp*b, a_l*dv]
// Context parallelism: "all_gather" all-gathers the keys and values of all s positions over
// cp (each rank turned its own at their global positions) in sequence order, and
// reduce-scatters their gradients; query row i sees key j when position(j) <= position(i).
// "p2p" passes the keys and values around the cp ring and merges blocks by log-sum-exp
// (RingForward); the probabilities are never whole. "a2a" (Ulysses) exchanges heads for
// sequence: an all-to-all over cp gives each cp rank every position of 1/cp of its heads
// (probabilities [b, a_l/cp, s, s]), and a second one gives the context back. "a2a+p2p"
// (hierarchical_context_parallel_sizes [a, c]) does both: an all-to-all over the a ranks of
// hcp_L0 gives each the group's positions (two super-chunks of s / (2c)) of 1/a of the heads,
// and the "p2p" ring runs over the c ranks of hcp_L1. Transformer Engine runs each with
// dq != dv (its ring passes keys and values as separate parts for MLA). The exchanges
// themselves are core/context_parallel/'s (all_gather.h, a2a.h, ring.h, hierarchical.h, on
// the load-balanced split of sequence_order.h).
// Attention sinks (softmax_type "off-by-one", "learnable"; Megatron's SoftmaxOne): each row's
// softmax has one more logit, 0 or its head's core_attention.softmax_offset, in its
// denominator only; the probabilities stay [.., s] (the sink's is dropped).
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "core/config/gpt_config.h"
#include "core/model/module.h"
#include "core/model/parameter.h"
#include "core/model/stash_plan.h"

namespace mpusim {

class CoreAttention {
 public:
  struct Dims {
    int64_t a = 0, g = 0;    // heads and key/value heads of the layer
    int64_t dq = 0, dv = 0;  // the query and key head dim, the value's
    double scale = 0;        // the softmax scale
  };
  // `prefix` is "decoder.layers.<i>.self_attention"; `window` the layer's window_size[0] or
  // -1 (GptConfig::AttentionWindow); `sink` core_attention.softmax_offset (softmax_type
  // "learnable") or null.
  CoreAttention(const GptConfig& gpt, std::string prefix, Dims dims, int64_t window,
                Parameter* sink, int64_t t);

  // cp_comm_type "p2p": what the backward ring needs. Per query half h (this rank's chunk h,
  // c = s / (2 cp) positions): the queries [b*g_l, r*c, dq], the merged output [b*g_l*r*c,
  // dv] and its log-sum-exp over every key [b*g_l*r*c] (compute dtype); this rank's keys and
  // values in chunks, what the ring passes (BlockPart's layout).
  struct RingStash {
    Tensor q[2], out[2], lse[2];
    Tensor kv;
  };
  // The ring's geometry: "p2p" runs it over cp on this rank's two chunks and its heads;
  // "a2a+p2p" over hcp level 1 on two super-chunks (its level-0 group's chunks, after the
  // level-0 all-to-all of heads for positions) and 1/a of the heads (a: level 0's size).
  struct RingLayout {
    Communicator* group = nullptr;  // the ring
    int64_t size = 1, rank = 0;     // its ranks and this one's place
    int64_t c = 0;                  // positions per chunk, s / (2 size); a rank holds two
    int64_t al = 0, gl = 0;         // heads and key/value heads of the ring's tensors
    int64_t head0 = 0;              // the first of those heads among the layer's a
  };
  struct Stash {
    Tensor q;              // as attention sees them: the caller's ("a2a": 1/cp of the heads
    Tensor k, v;           // at every position; "all_gather": the keys and values of every
                           // position)
    Tensor probs;          // [b*a_l*s_cp, s] before dropout (not kept by the ring)
    Tensor probs_dropped;  // after dropout (probs itself when attention_dropout is 0)
    Tensor lse;            // [b*a_l*s_cp] compute dtype: each row's log-sum-exp with the
                           // sink (softmax_type "learnable" only, for the sink's gradient)
    std::optional<RingStash> ring;  // cp_comm_type "p2p", "a2a+p2p"
  };
  // The declared stash (stash_plan.h) of a rank of `shape` in `dtype` storage.
  // `inputs_declared`: the caller keeps q, k and v itself, so only the tensors the exchange
  // makes ("all_gather": k and v; "a2a": all three) are declared here.
  static StashPlan PlanStash(const GptConfig& gpt, const Dims& dims, const StreamShape& shape,
                             DType dtype, bool inputs_declared);

  // q, k, v of this rank's tokens (legend) -> core_attention.output [s_cp*b, a_l*dv], recorded.
  Tensor Forward(const ModuleContext& ctx, Tensor q, Tensor k, Tensor v, Stash* stash) const;
  // Selective recomputation from the caller's q, k, v: the stash again without the context
  // (the ring's needs its merged outputs, so it reruns the ring). No records.
  void Recompute(const ModuleContext& ctx, Tensor q, Tensor k, Tensor v, Stash* stash) const;
  // core_attention.output's gradient [s_cp*b, a_l*dv] -> dq, dk, dv of this rank's tokens,
  // shaped as Forward's q [b*g_l*r*s_cp, dq], k [b*g_l*s_cp, dq], v [b*g_l*s_cp, dv].
  struct Grads {
    Tensor dq, dk, dv;
  };
  Grads Backward(const ModuleContext& ctx, const Tensor& dcolumns, const Stash& stash) const;
  // The same, handing the gradients to `then` while the backward's temporaries are still
  // alive (SelfAttention forms its fused projection's gradient there: the working set the
  // activation count declares), and returning what it returns.
  Tensor Backward(const ModuleContext& ctx, const Tensor& dcolumns, const Stash& stash,
                  const std::function<Tensor(Grads)>& then) const;

 private:
  bool Heads(const StreamShape& sh) const { return sh.cp > 1 && cp_heads_; }
  bool OnRing(const StreamShape& sh) const { return sh.cp > 1 && (ring_ || hier_); }
  // The exchange before attention: "a2a" all three, "all_gather" k and v.
  void Exchange(const ModuleContext& ctx, Stash* stash) const;
  // q k^T -> the probabilities (and their dropout, the sink's log-sum-exp), recorded.
  void Probs(const ModuleContext& ctx, Stash* stash) const;
  IndexPieces ProbsMap(const StreamShape& sh) const;
  ShardSpec ProbsSpec(const ModuleContext& ctx) const;  // of the probabilities [B, a, s, s]
  std::optional<Tensor> Sink(const ModuleContext& ctx, DType dtype) const;
  // The context [b, a_l, s_cp, dv] as core attention's output [s_cp*b, a_l*dv], recorded.
  Tensor ContextToColumns(const ModuleContext& ctx, const Tensor& context) const;
  // The ring: the context [b*g_l, r*s_cp, dv]; its backward's dq (same rows, dq wide) and
  // this rank's dk [b*g_l*s_cp, dq], dv [b*g_l*s_cp, dv].
  Tensor RingForward(const ModuleContext& ctx, Stash* stash) const;
  Grads RingBackward(const ModuleContext& ctx, const Tensor& dcontext, const Stash& stash) const;
  // Where the probabilities of the ring's query chunk and key chunk ([b, ring.al, c, c]) sit
  // in the full [B, a, s, s]; LocalBlockMap: in the [b, a_l, s_cp, s] the rank would hold
  // with its keys gathered (dropout_mode "rng_tracker"'s local indices).
  IndexPieces BlockMap(const StreamShape& sh, const RingLayout& ring, int64_t q_chunk,
                       int64_t k_chunk) const;
  IndexPieces LocalBlockMap(const StreamShape& sh, const RingLayout& ring, int64_t q_half,
                            int64_t k_chunk) const;
  RingLayout Ring(const ModuleContext& ctx) const;
  // The probabilities and their gradient of every key, for the records of a ring run
  // (computed only when the pass records, on keys and values gathered for it).
  void RecordRingProbs(const ModuleContext& ctx, const Stash& stash, const Tensor* dcontext) const;

  std::string prefix_;
  int64_t a_, r_, dq_, dv_, a_l_, g_l_;
  double scale_;
  bool ring_;      // cp_comm_type "p2p" (with context_parallel_size > 1)
  bool cp_heads_;  // cp_comm_type "a2a"
  bool hier_;      // cp_comm_type "a2a+p2p"
  // window_size[0] when this layer slides, else -1: the causal mask of every cp split is the
  // kernels' q - window <= k <= q on global positions.
  int64_t window_;
  // softmax_type: "off-by-one" adds a logit 0 to every row's denominator, "learnable" the
  // per-head parameter ([a], split over tp by heads: sink_). Transformer Engine builds either
  // under context parallelism only with "a2a", which keeps whole rows on one rank, so the
  // sink enters each row's softmax once.
  SoftmaxType softmax_type_;
  Parameter* sink_;
  double dropout_;
};

}  // namespace mpusim
