// Core attention (see core_attention.h).
#include "core/model/core_attention.h"

#include <cmath>
#include <utility>

#include "core/context_parallel/a2a.h"
#include "core/context_parallel/all_gather.h"
#include "core/context_parallel/hierarchical.h"
#include "core/context_parallel/ring.h"

namespace mpusim {

CoreAttention::CoreAttention(const GptConfig& gpt, std::string prefix, Dims dims, int64_t window,
                             Parameter* sink, int64_t t)
    : prefix_(std::move(prefix)),
      a_(dims.a),
      r_(dims.a / dims.g),
      dq_(dims.dq),
      dv_(dims.dv),
      a_l_(dims.a / t),
      g_l_(dims.g / t),
      scale_(dims.scale),
      ring_(gpt.cp_comm_type == CpCommType::kP2p),
      cp_heads_(gpt.cp_comm_type == CpCommType::kA2a),
      hier_(gpt.cp_comm_type == CpCommType::kA2aP2p),
      window_(window),
      softmax_type_(gpt.softmax_type),
      sink_(sink),
      dropout_(gpt.attention_dropout) {}

// What Forward leaves in the stash (q, k, v, probs are this rank's: with context parallelism
// its s_cp query rows, "a2a" 1/cp of its heads at every position, as many elements).
StashPlan CoreAttention::PlanStash(const GptConfig& gpt, const Dims& dims, const StreamShape& shape,
                                   DType dtype, bool inputs_declared) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  const double t = d(shape.t), dq = d(dims.dq), dv = d(dims.dv);
  const double R = d(shape.s_cp() * shape.b);  // this rank's query rows (tokens)
  const double al = d(dims.a) / t, gl = d(dims.g) / t;
  const bool cp = shape.cp > 1;
  const bool ring =
      cp && (gpt.cp_comm_type == CpCommType::kP2p || gpt.cp_comm_type == CpCommType::kA2aP2p);
  const bool gathered = cp && gpt.cp_comm_type == CpCommType::kAllGather;
  const bool heads = cp && gpt.cp_comm_type == CpCommType::kA2a;
  StashPlan plan;
  if (!inputs_declared || heads) plan.Add("q", {R * al, dq}, dtype);
  if (!inputs_declared || heads || gathered) {
    // "all_gather": the keys and values of every position.
    const double kv_rows = gathered ? d(shape.b) * gl * d(shape.s) : R * gl;
    plan.Add("k", {kv_rows, dq}, dtype);
    plan.Add("v", {kv_rows, dv}, dtype);
  }
  if (gpt.softmax_type == SoftmaxType::kLearnable) {
    // Each row's log-sum-exp with the sink, for the sink's gradient.
    plan.Add("lse", {R * al}, ComputeDType(dtype));
  }
  if (ring) {
    // RingStash: both query halves, their merged output and log-sum-exp, and this rank's
    // keys and values in the chunks the ring passes.
    plan.Add("ring.q", {R * al, dq}, dtype);
    plan.Add("ring.out", {R * al, dv}, dtype);
    plan.Add("ring.lse", {R * al}, ComputeDType(dtype));
    plan.Add("ring.kv", {R * gl, dq + dv}, dtype);
  } else {
    plan.Add("probs", {R * al, d(shape.s)}, dtype);
    // Without attention dropout probs_dropped is probs itself.
    if (gpt.attention_dropout > 0) plan.Add("probs_dropped", {R * al, d(shape.s)}, dtype);
  }
  return plan;
}

// Where this rank's probabilities [b, a_l, s_cp, s] sit in the full [B, a, s, s]: one piece
// without context parallelism or under "a2a" ([b, a_l / cp, s, s]), else one per sample, its
// query rows in the rank's two chunks.
IndexPieces CoreAttention::ProbsMap(const StreamShape& sh) const {
  const int64_t s = sh.s;
  if (sh.cp == 1 || cp_heads_) {
    const int64_t heads = a_l_ / sh.cp;
    GlobalIndexMap map;
    map.base = (sh.dp_rank * sh.b * a_ + sh.tp_rank * a_l_ + sh.cp_rank * heads) * s * s;
    map.dims = {sh.b, heads, s * s};
    map.strides = {a_ * s * s, s * s, 1};
    return {{0, map}};
  }
  const int64_t c = s / (2 * sh.cp);
  IndexPieces pieces;
  for (int64_t j = 0; j < sh.b; ++j) {
    GlobalIndexMap map;
    map.base = (((sh.dp_rank * sh.b + j) * a_ + sh.tp_rank * a_l_) * s + sh.Position(0)) * s;
    map.dims = {a_l_, 2, c * s};
    map.strides = {s * s, (sh.Position(c) - sh.Position(0)) * s, 1};
    pieces.push_back({j * a_l_ * sh.s_cp() * s, map});
  }
  return pieces;
}

Tensor CoreAttention::Forward(const ModuleContext& ctx, Tensor q, Tensor k, Tensor v,
                              Stash* stash) const {
  Kernels& kern = ctx.k;
  const StreamShape& sh = ctx.shape;
  stash->q = std::move(q);
  stash->k = std::move(k);
  stash->v = std::move(v);
  if (OnRing(sh)) {
    const Tensor context = RingForward(ctx, stash);
    if (ctx.recording()) RecordRingProbs(ctx, *stash, nullptr);
    return ContextToColumns(ctx, context);
  }
  Exchange(ctx, stash);
  Probs(ctx, stash);
  const bool heads = Heads(sh);
  const int64_t b = sh.b, r = r_, sk = sh.s, s = heads ? sh.s : sh.s_cp();
  const int64_t gl = heads ? g_l_ / sh.cp : g_l_;
  Tensor context = kern.Empty({b * gl, r * s, dv_}, stash->q.dtype());
  kern.BatchedGemm(false, false, 1.0, stash->probs_dropped.Reshaped({b * gl, r * s, sk}),
                   stash->v.Reshaped({b * gl, sk, dv_}), 0.0, context);
  if (heads) context = SequenceForHeads(kern, *ctx.cp, sh.s, context, b, a_l_, dv_);
  return ContextToColumns(ctx, context);
}

void CoreAttention::Recompute(const ModuleContext& ctx, Tensor q, Tensor k, Tensor v,
                              Stash* stash) const {
  stash->q = std::move(q);
  stash->k = std::move(k);
  stash->v = std::move(v);
  if (OnRing(ctx.shape)) {
    RingForward(ctx, stash);
    return;
  }
  Exchange(ctx, stash);
  Probs(ctx, stash);
}

void CoreAttention::Exchange(const ModuleContext& ctx, Stash* stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  if (Heads(sh)) {
    // Ulysses: every position of 1/cp of the heads; the queries in sequence order too.
    stash->q = HeadsForSequence(k, *ctx.cp, sh.s, stash->q, sh.b, a_l_, dq_);
    stash->k = HeadsForSequence(k, *ctx.cp, sh.s, stash->k, sh.b, g_l_, dq_);
    stash->v = HeadsForSequence(k, *ctx.cp, sh.s, stash->v, sh.b, g_l_, dv_);
  } else if (sh.cp > 1) {
    stash->k = GatherSequence(k, *ctx.cp, sh.s, stash->k, sh.b * g_l_, dq_);
    stash->v = GatherSequence(k, *ctx.cp, sh.s, stash->v, sh.b * g_l_, dv_);
  }
}

void CoreAttention::Probs(const ModuleContext& ctx, Stash* stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const bool heads = Heads(sh);
  // s: the queries; sk: the keys attention sees.
  const int64_t b = sh.b, r = r_, sk = sh.s, s = heads ? sh.s : sh.s_cp();
  const int64_t gl = heads ? g_l_ / sh.cp : g_l_, al = heads ? a_l_ / sh.cp : a_l_;
  const DType dtype = stash->q.dtype();
  const Tensor& q_pos = heads ? ctx.key_positions : ctx.positions;
  // scores = q k^T * scale: one GEMM per (sample, group) over its r*s query rows.
  Tensor scores = k.Empty({b * gl, r * s, sk}, dtype);
  k.BatchedGemm(false, true, scale_, stash->q.Reshaped({b * gl, r * s, dq_}),
                stash->k.Reshaped({b * gl, sk, dq_}), 0.0, scores);
  stash->probs = k.Empty({b * al * s, sk}, dtype);
  // An attention sink: the logits of this rank's al heads (row r's head is (r / s) % al);
  // "learnable" keeps each row's log-sum-exp for the sink's gradient.
  if (sink_ != nullptr) stash->lse = k.Empty({b * al * s}, ComputeDType(dtype));
  {
    const std::optional<Tensor> sink = Sink(ctx, dtype);  // "off-by-one": freed right after
    k.CausalSoftmaxForward(scores.Reshaped({b * al * s, sk}), q_pos, ctx.key_positions, 1.0,
                           stash->probs, sink_ != nullptr ? &stash->lse : nullptr, window_,
                           sink ? &*sink : nullptr);
  }
  ctx.Record(prefix_ + ".core_attention.probs", stash->probs.Reshaped({b, al, s, sk}),
             {sh.B, a_, sk, sk}, ProbsSpec(ctx));
  stash->probs_dropped = dropout_ > 0
                             ? DropoutAtSite(ctx, prefix_ + ".core_attention.attention_dropout",
                                             dropout_, ProbsMap(sh), stash->probs)
                             : stash->probs;
}

// The sink logits of the heads this rank's softmax rows hold ("a2a": its 1/cp of its tp
// rank's), in `dtype`: the parameter's ("learnable"), zeros ("off-by-one"), or none.
std::optional<Tensor> CoreAttention::Sink(const ModuleContext& ctx, DType dtype) const {
  const StreamShape& sh = ctx.shape;
  const bool heads = Heads(sh);
  const int64_t al = heads ? a_l_ / sh.cp : a_l_;
  if (sink_ != nullptr) return sink_->value.FlatSlice(heads ? sh.cp_rank * al : 0, al);
  if (softmax_type_ == SoftmaxType::kOffByOne) return ctx.k.Zeros({al}, dtype);
  return std::nullopt;
}

ShardSpec CoreAttention::ProbsSpec(const ModuleContext& ctx) const {
  return cp_heads_ ? ctx.shape.CpHeadSpec(ctx.dp_size) : ctx.shape.HeadSpec(ctx.dp_size);
}

Tensor CoreAttention::ContextToColumns(const ModuleContext& ctx, const Tensor& context) const {
  const StreamShape& sh = ctx.shape;
  const int64_t s = sh.s_cp(), b = sh.b, al = a_l_, dv = dv_;
  Tensor out = ctx.k.Empty({s * b, al * dv}, context.dtype());
  ctx.k.StridedCopy(context, 0, {b, al, s, dv}, {al * s * dv, s * dv, dv, 1}, out, 0,
                    {al * dv, dv, b * al * dv, 1});
  ctx.Record(prefix_ + ".core_attention.output", out, {sh.s, sh.B, a_ * dv},
             sh.ColumnSpec(ctx.dp_size, 1));
  return out;
}

CoreAttention::Grads CoreAttention::Backward(const ModuleContext& ctx, const Tensor& dcolumns,
                                             const Stash& stash) const {
  Grads grads;
  Backward(ctx, dcolumns, stash, [&](Grads g) {
    grads = std::move(g);
    return Tensor();
  });
  return grads;
}

Tensor CoreAttention::Backward(const ModuleContext& ctx, const Tensor& dout, const Stash& stash,
                               const std::function<Tensor(Grads)>& then) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t sk = sh.s, b = sh.b, r = r_, dq = dq_, dv = dv_;
  int64_t s = sh.s_cp(), gl = g_l_, al = a_l_;
  const DType dtype = dout.dtype();
  ctx.Record(prefix_ + ".core_attention.output_grad", dout, {sk, sh.B, a_ * dv},
             sh.ColumnSpec(ctx.dp_size, 1));
  Tensor dcontext = k.Empty({b * gl, r * s, dv}, dtype);
  k.StridedCopy(dout, 0, {b, al, s, dv}, {al * dv, dv, b * al * dv, 1}, dcontext, 0,
                {al * s * dv, s * dv, dv, 1});
  if (stash.ring) {
    if (ctx.recording()) RecordRingProbs(ctx, stash, &dcontext);
    return then(RingBackward(ctx, dcontext, stash));
  }
  const bool heads = Heads(sh);
  if (heads) {
    s = sk, gl /= sh.cp, al /= sh.cp;
    dcontext =
        HeadsForSequence(k, *ctx.cp, sh.s, dcontext, b, a_l_, dv).Reshaped({b * gl, r * s, dv});
  }
  const Tensor& q_pos = heads ? ctx.key_positions : ctx.positions;
  // context = P_d v:  dP_d = dcontext v^T,  dv = P_d^T dcontext (summed over the group's heads)
  Tensor dprobs = k.Empty({b * gl, r * s, sk}, dtype);
  k.BatchedGemm(false, true, 1.0, dcontext, stash.v.Reshaped({b * gl, sk, dv}), 0.0, dprobs);
  Tensor dvalue = k.Empty({b * gl, sk, dv}, dtype);
  k.BatchedGemm(true, false, 1.0, stash.probs_dropped.Reshaped({b * gl, r * s, sk}), dcontext, 0.0,
                dvalue);
  Tensor dprobs_flat = dprobs.Reshaped({b * al * s, sk});
  if (dropout_ > 0) {
    dprobs_flat = DropoutAtSite(ctx, prefix_ + ".core_attention.attention_dropout", dropout_,
                                ProbsMap(sh), dprobs_flat);
  }
  ctx.Record(prefix_ + ".core_attention.probs_grad", dprobs_flat.Reshaped({b, al, s, sk}),
             {sh.B, a_, sk, sk}, ProbsSpec(ctx));
  if (sink_ != nullptr) {
    // d sink[h] = -sum over h's rows of exp(sink - lse) sum_V probs dprobs (core/ops/softmax.h
    // SinkGradTerm), into this rank's heads of main_grad ("a2a": its 1/cp of them; the dp_cp
    // all-reduce sums the cp ranks' slices).
    Tensor row_dot = k.Empty({b * al * s}, ComputeDType(dtype));
    k.RowDot(stash.probs, dprobs_flat, row_dot);
    const int64_t head0 = heads ? sh.cp_rank * al : 0;
    Tensor dsink = sink_->grad.FlatSlice(head0, al);
    k.SoftmaxSinkGrad(sink_->value.FlatSlice(head0, al), stash.lse, row_dot, s, dsink);
  }
  Tensor dscores = k.Empty({b * al * s, sk}, dtype);
  k.CausalSoftmaxBackward(stash.probs, dprobs_flat, q_pos, ctx.key_positions, 1.0, dscores, nullptr,
                          window_);
  // scores = c q k^T:  dq = c dscores k,  dk = c dscores^T q
  const Tensor ds = dscores.Reshaped({b * gl, r * s, sk});
  Tensor dquery = k.Empty({b * gl, r * s, dq}, dtype);
  k.BatchedGemm(false, false, scale_, ds, stash.k.Reshaped({b * gl, sk, dq}), 0.0, dquery);
  Tensor dkey = k.Empty({b * gl, sk, dq}, dtype);
  k.BatchedGemm(true, false, scale_, ds, stash.q.Reshaped({b * gl, r * s, dq}), 0.0, dkey);
  Tensor dk2 = dkey.Reshaped({b * gl * sk, dq});
  if (heads) {
    dquery = SequenceForHeads(k, *ctx.cp, sh.s, dquery, b, a_l_, dq);
    dk2 = SequenceForHeads(k, *ctx.cp, sh.s, dk2, b, g_l_, dq);
    dvalue = SequenceForHeads(k, *ctx.cp, sh.s, dvalue, b, g_l_, dv);
  } else if (sh.cp > 1) {
    dk2 = ReduceScatterSequence(k, *ctx.cp, sh.s, dk2, b * gl, dq);
    dvalue =
        ReduceScatterSequence(k, *ctx.cp, sh.s, dvalue.Reshaped({b * gl * sk, dv}), b * gl, dv);
  }
  const int64_t tokens = sh.s_cp();
  return then({dquery.Reshaped({b * g_l_ * r * tokens, dq}), dk2,
               dvalue.Reshaped({b * g_l_ * tokens, dv})});
}

// --- cp_comm_type "p2p": attention on the ring ------------------------------------------
//
// The ring (core/context_parallel/ring.h, Megatron's AttnFuncWithCPAndKVP2P) passes the keys
// and values around; in a step, each c x c block of a query chunk and a key chunk that some
// query sees is its softmax over its keys, with its log-sum-exp, times its values, merged into
// the query chunk's running output (LseMerge). Attention dropout is drawn per global element
// of [B, a, s, s] (BlockMap), on the block's own probabilities: the merge scales them to the
// row's, so the masks are the all_gather run's. The backward runs the ring again from each
// row's final log-sum-exp; the gradients of a block's keys and values travel with it and reach
// their owner after cp steps.

namespace {

// "a2a+p2p" (hier): this rank's tokens of `heads` heads to the ring's rows over hcp level 0
// (core/context_parallel/hierarchical.h), and back; "p2p": x itself.
Tensor ToRing(const ModuleContext& ctx, bool hier, const Tensor& x, int64_t heads, int64_t w) {
  return hier ? ToRingHeads(ctx.k, *ctx.hcp_a2a, ctx.shape.s_cp(), x, ctx.shape.b, heads, w) : x;
}
Tensor FromRing(const ModuleContext& ctx, bool hier, const Tensor& y, int64_t heads, int64_t w) {
  return hier ? FromRingHeads(ctx.k, *ctx.hcp_a2a, ctx.shape.s_cp(), y, ctx.shape.b, heads, w) : y;
}

}  // namespace

IndexPieces CoreAttention::LocalBlockMap(const StreamShape& sh, const RingLayout& ring,
                                         int64_t q_half, int64_t k_chunk) const {
  const int64_t s = sh.s, c = ring.c, s_ring = 2 * c, al = ring.al;
  IndexPieces pieces;
  for (int64_t j = 0; j < sh.b; ++j) {
    GlobalIndexMap map;
    map.base = ((j * al) * s_ring + q_half * c) * s + k_chunk * c;
    map.dims = {al, c, c};
    map.strides = {s_ring * s, s, 1};
    pieces.push_back({j * al * c * c, map});
  }
  return pieces;
}

IndexPieces CoreAttention::BlockMap(const StreamShape& sh, const RingLayout& ring, int64_t q_chunk,
                                    int64_t k_chunk) const {
  const int64_t s = sh.s, c = ring.c, al = ring.al;
  IndexPieces pieces;
  for (int64_t j = 0; j < sh.b; ++j) {
    GlobalIndexMap map;
    map.base = (((sh.dp_rank * sh.b + j) * a_ + ring.head0) * s + q_chunk * c) * s + k_chunk * c;
    map.dims = {al, c, c};
    map.strides = {s * s, s, 1};
    pieces.push_back({j * al * c * c, map});
  }
  return pieces;
}

CoreAttention::RingLayout CoreAttention::Ring(const ModuleContext& ctx) const {
  const StreamShape& sh = ctx.shape;
  RingLayout ring;
  if (hier_) {
    const int64_t a = ctx.hcp_a2a->Size();
    ring.group = ctx.hcp_p2p;
    ring.size = ctx.hcp_p2p->Size();
    ring.rank = ctx.hcp_p2p->Rank();
    ring.al = a_l_ / a;
    ring.gl = g_l_ / a;
    ring.head0 = sh.tp_rank * a_l_ + ctx.hcp_a2a->Rank() * ring.al;
  } else {
    ring.group = ctx.cp;
    ring.size = sh.cp;
    ring.rank = sh.cp_rank;
    ring.al = a_l_;
    ring.gl = g_l_;
    ring.head0 = sh.tp_rank * a_l_;
  }
  ring.c = sh.s / (2 * ring.size);
  return ring;
}

Tensor CoreAttention::RingForward(const ModuleContext& ctx, Stash* stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const RingLayout L = Ring(ctx);
  const int64_t c = L.c, s_ring = 2 * c;
  const int64_t dq = dq_, dv = dv_, r = r_, bg = sh.b * L.gl, rows = bg * r * c;
  const DType dtype = stash->q.dtype(), ct = ComputeDType(dtype);
  const std::string site = prefix_ + ".core_attention.attention_dropout";
  // "a2a+p2p": the level-0 group's positions of 1/a of the heads; "p2p": this rank's own.
  const Tensor q = ToRing(ctx, hier_, stash->q, a_l_, dq);
  const Tensor key = ToRing(ctx, hier_, stash->k, g_l_, dq);
  const Tensor value = ToRing(ctx, hier_, stash->v, g_l_, dv);
  RingStash ring;
  Tensor none = Tensor::HostEmpty({rows}, ct);  // a running log-sum-exp before any key
  for (int64_t i = 0; i < rows; ++i) SetHostValue(none, i, -INFINITY);
  for (int64_t h = 0; h < 2; ++h) {
    // Query chunk h of every (sample, group, head): rows [h c, (h + 1) c) of its s_ring.
    ring.q[h] = k.Empty({bg, r * c, dq}, dtype);
    k.StridedCopy(q, h * c * dq, {bg * r, c * dq}, {s_ring * dq, 1}, ring.q[h], 0, {c * dq, 1});
    ring.out[h] = k.Zeros({rows, dv}, dtype);
    ring.lse[h] = k.ToDevice(none);
  }
  ring.kv = k.Empty({2 * bg * c * (dq + dv)}, dtype);
  for (int64_t which = 0; which < 2; ++which) {
    const int64_t w = which == 0 ? dq : dv;
    for (int64_t h = 0; h < 2; ++h) {
      Tensor part = BlockPart(ring.kv, which, h, bg, c, dq, dv);
      k.StridedCopy(which == 0 ? key : value, h * c * w, {bg, c * w}, {s_ring * w, 1}, part, 0,
                    {c * w, 1});
    }
  }
  RunRing(k, *L.group, L.size, L.rank, ring.kv, 0, [&](int64_t src, const Tensor& block) {
    ForEachVisibleBlock(
        L.size, L.rank, src, [&](int64_t qh, int64_t kh, int64_t q_chunk, int64_t k_chunk) {
          Tensor scores = k.Empty({bg, r * c, c}, dtype);
          k.BatchedGemm(false, true, scale_, ring.q[qh], BlockPart(block, 0, kh, bg, c, dq, dv),
                        0.0, scores);
          Tensor probs = k.Empty({rows, c}, dtype);
          Tensor lse = k.Empty({rows}, ct);
          k.CausalSoftmaxForward(
              scores.Reshaped({rows, c}), ctx.key_positions.FlatSlice(q_chunk * c, c),
              ctx.key_positions.FlatSlice(k_chunk * c, c), 1.0, probs, &lse, window_);
          const IndexPieces local = LocalBlockMap(sh, L, qh, k_chunk);
          const Tensor dropped =
              dropout_ > 0 ? DropoutAtSite(ctx, site, dropout_, BlockMap(sh, L, q_chunk, k_chunk),
                                           probs, &local)
                           : probs;
          Tensor part = k.Empty({bg, r * c, dv}, dtype);
          k.BatchedGemm(false, false, 1.0, dropped.Reshaped({bg, r * c, c}),
                        BlockPart(block, 1, kh, bg, c, dq, dv), 0.0, part);
          k.LseMerge(ring.out[qh], ring.lse[qh], part.Reshaped({rows, dv}), lse);
        });
  });
  // The context [bg, r * s_ring, dv]: each query chunk's output back at its rows, then
  // (a2a+p2p) to this rank's tokens of all its heads.
  Tensor context = k.Empty({bg * r * s_ring, dv}, dtype);
  for (int64_t h = 0; h < 2; ++h) {
    k.StridedCopy(ring.out[h], 0, {bg * r, c * dv}, {c * dv, 1}, context, h * c * dv,
                  {s_ring * dv, 1});
  }
  context = FromRing(ctx, hier_, context, a_l_, dv);
  stash->ring = std::move(ring);
  return context.Reshaped({sh.b * g_l_, r * sh.s_cp(), dv});
}

CoreAttention::Grads CoreAttention::RingBackward(const ModuleContext& ctx,
                                                 const Tensor& dcontext_in,
                                                 const Stash& stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const RingStash& ring = *stash.ring;
  const RingLayout L = Ring(ctx);
  const int64_t cp = L.size, me = L.rank, c = L.c, s_ring = 2 * c;
  const int64_t dqw = dq_, dvw = dv_, r = r_, bg = sh.b * L.gl, rows = bg * r * c;
  const DType dtype = dcontext_in.dtype(), ct = ComputeDType(dtype);
  const std::string site = prefix_ + ".core_attention.attention_dropout";
  const Tensor dcontext = ToRing(ctx, hier_, dcontext_in, a_l_, dvw);
  Tensor dout[2], dq[2], row_dot[2];
  for (int64_t h = 0; h < 2; ++h) {
    dout[h] = k.Empty({bg, r * c, dvw}, dtype);
    k.StridedCopy(dcontext, h * c * dvw, {bg * r, c * dvw}, {s_ring * dvw, 1}, dout[h], 0,
                  {c * dvw, 1});
    // rowsum(dO * O): the softmax backward's row term over all of a row's keys.
    row_dot[h] = k.Empty({rows}, ct);
    k.RowDot(dout[h].Reshaped({rows, dvw}), ring.out[h], row_dot[h]);
    dq[h] = k.Zeros({bg, r * c, dqw}, dtype);
  }
  Tensor dblock = k.Zeros(ring.kv.shape(), dtype);  // the gradients travelling with the block
  RunRing(k, *L.group, cp, me, ring.kv, 1, [&](int64_t src, const Tensor& block) {
    ForEachVisibleBlock(cp, me, src, [&](int64_t qh, int64_t kh, int64_t q_chunk, int64_t k_chunk) {
      const Tensor key = BlockPart(block, 0, kh, bg, c, dqw, dvw);
      const Tensor value = BlockPart(block, 1, kh, bg, c, dqw, dvw);
      Tensor dkey = BlockPart(dblock, 0, kh, bg, c, dqw, dvw);
      Tensor dvalue = BlockPart(dblock, 1, kh, bg, c, dqw, dvw);
      const Tensor q_pos = ctx.key_positions.FlatSlice(q_chunk * c, c);
      const Tensor k_pos = ctx.key_positions.FlatSlice(k_chunk * c, c);
      Tensor probs = k.Empty({bg, r * c, c}, dtype);
      k.BatchedGemm(false, true, scale_, ring.q[qh], key, 0.0, probs);
      Tensor probs2 = probs.Reshaped({rows, c});
      k.CausalSoftmaxFromLse(probs2, ring.lse[qh], q_pos, k_pos, 1.0, probs2, window_);
      const IndexPieces map = BlockMap(sh, L, q_chunk, k_chunk);
      const IndexPieces local = LocalBlockMap(sh, L, qh, k_chunk);
      const Tensor dropped =
          dropout_ > 0 ? DropoutAtSite(ctx, site, dropout_, map, probs2, &local) : probs2;
      // out = P_d v:  dv += P_d^T dout,  dP_d = dout v^T
      k.BatchedGemm(true, false, 1.0, dropped.Reshaped({bg, r * c, c}), dout[qh], 1.0, dvalue);
      Tensor dprobs = k.Empty({bg, r * c, c}, dtype);
      k.BatchedGemm(false, true, 1.0, dout[qh], value, 0.0, dprobs);
      Tensor dprobs2 = dprobs.Reshaped({rows, c});
      if (dropout_ > 0) dprobs2 = DropoutAtSite(ctx, site, dropout_, map, dprobs2, &local);
      Tensor dscores = k.Empty({rows, c}, dtype);
      k.CausalSoftmaxBackward(probs2, dprobs2, q_pos, k_pos, 1.0, dscores, &row_dot[qh], window_);
      // scores = c q k^T:  dq += c dscores k,  dk += c dscores^T q
      const Tensor ds = dscores.Reshaped({bg, r * c, c});
      k.BatchedGemm(false, false, scale_, ds, key, 1.0, dq[qh]);
      k.BatchedGemm(true, false, scale_, ds, ring.q[qh], 1.0, dkey);
    });
    // The block's gradients go on with it; after the last step they reach its owner.
    dblock = PassOn(k, *L.group, cp, me, dblock, 2);
  });
  // dblock now holds this rank's own keys' and values' gradients, in chunks; "a2a+p2p" sends
  // each rank of the level-0 group its tokens' back.
  Tensor dq_ring = k.Empty({bg * r * s_ring, dqw}, dtype);
  Tensor dk_ring = k.Empty({bg * s_ring, dqw}, dtype);
  Tensor dv_ring = k.Empty({bg * s_ring, dvw}, dtype);
  for (int64_t h = 0; h < 2; ++h) {
    k.StridedCopy(dq[h], 0, {bg * r, c * dqw}, {c * dqw, 1}, dq_ring, h * c * dqw,
                  {s_ring * dqw, 1});
    k.StridedCopy(BlockPart(dblock, 0, h, bg, c, dqw, dvw), 0, {bg, c * dqw}, {c * dqw, 1}, dk_ring,
                  h * c * dqw, {s_ring * dqw, 1});
    k.StridedCopy(BlockPart(dblock, 1, h, bg, c, dqw, dvw), 0, {bg, c * dvw}, {c * dvw, 1}, dv_ring,
                  h * c * dvw, {s_ring * dvw, 1});
  }
  Grads grads;
  grads.dq = FromRing(ctx, hier_, dq_ring, a_l_, dqw);
  grads.dk = FromRing(ctx, hier_, dk_ring, g_l_, dqw);
  grads.dv = FromRing(ctx, hier_, dv_ring, g_l_, dvw);
  grads.dq = grads.dq.Reshaped({sh.b * g_l_ * r * sh.s_cp(), dqw});
  return grads;
}

// The records of a ring run: its probabilities [b, a_l, s_cp, s] from each row's final
// log-sum-exp on the keys of every position, and (with `dcontext`, in the backward) their
// gradient, the keys and values gathered over cp for the records only (named so in the trace).
void CoreAttention::RecordRingProbs(const ModuleContext& ctx, const Stash& stash,
                                    const Tensor* dcontext) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const RingStash& ring = *stash.ring;
  const int64_t s = sh.s, s_cp = sh.s_cp(), b = sh.b;
  const int64_t r = r_, gl = g_l_, al = a_l_, bg = b * gl;
  const DType dtype = stash.q.dtype();
  const std::string layer_site = ctx.trace.site();
  ctx.trace.SetSite(layer_site + " (gathered for records)");
  const int64_t w = dcontext == nullptr ? dq_ : dv_;
  const Tensor gathered =
      GatherSequence(k, *ctx.cp, sh.s, dcontext == nullptr ? stash.k : stash.v, bg, w);
  // Each row's log-sum-exp in the row order of [b, a_l, s_cp]: the halves interleaved (for
  // "a2a+p2p" in the ring's rows, then back to this rank's tokens of all its heads).
  const RingLayout L = Ring(ctx);
  const int64_t s_ring = 2 * L.c, ring_bg = b * L.gl;
  Tensor lse = k.Empty({ring_bg * r * s_ring}, ring.lse[0].dtype());
  for (int64_t h = 0; h < 2; ++h) {
    k.StridedCopy(ring.lse[h], 0, {ring_bg * r, L.c}, {L.c, 1}, lse, h * L.c, {s_ring, 1});
  }
  lse = FromRing(ctx, hier_, lse.Reshaped({ring_bg * r * s_ring, 1}), al, 1);
  lse = lse.Reshaped({bg * r * s_cp});
  ctx.trace.SetSite(layer_site);
  if (dcontext == nullptr) {
    Tensor probs = k.Empty({bg, r * s_cp, s}, dtype);
    k.BatchedGemm(false, true, scale_, stash.q.Reshaped({bg, r * s_cp, dq_}),
                  gathered.Reshaped({bg, s, dq_}), 0.0, probs);
    Tensor p2 = probs.Reshaped({b * al * s_cp, s});
    k.CausalSoftmaxFromLse(p2, lse, ctx.positions, ctx.key_positions, 1.0, p2, window_);
    ctx.Record(prefix_ + ".core_attention.probs", p2.Reshaped({b, al, s_cp, s}), {sh.B, a_, s, s},
               sh.HeadSpec(ctx.dp_size));
    return;
  }
  // dP = dropout(dout v^T) over every key.
  Tensor dprobs = k.Empty({bg, r * s_cp, s}, dtype);
  k.BatchedGemm(false, true, 1.0, *dcontext, gathered.Reshaped({bg, s, dv_}), 0.0, dprobs);
  Tensor dp2 = dprobs.Reshaped({b * al * s_cp, s});
  if (dropout_ > 0) {
    dp2 = DropoutAtSite(ctx, prefix_ + ".core_attention.attention_dropout", dropout_, ProbsMap(sh),
                        dp2);
  }
  ctx.Record(prefix_ + ".core_attention.probs_grad", dp2.Reshaped({b, al, s_cp, s}),
             {sh.B, a_, s, s}, sh.HeadSpec(ctx.dp_size));
}

}  // namespace mpusim
