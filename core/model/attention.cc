// Self-attention (see attention.h).
#include "core/model/attention.h"

#include <fmt/format.h>

#include <cmath>
#include <optional>

#include "core/context_parallel/a2a.h"
#include "core/context_parallel/all_gather.h"
#include "core/context_parallel/hierarchical.h"
#include "core/context_parallel/ring.h"

namespace mpusim {

SelfAttention::SelfAttention(const GptConfig& gpt, int64_t layer, std::string prefix,
                             ParameterSet& params, int64_t t)
    : prefix_(std::move(prefix)),
      a_(gpt.num_attention_heads),
      g_(gpt.num_query_groups),
      r_(gpt.num_attention_heads / gpt.num_query_groups),
      dk_(gpt.kv_channels),
      a_l_(gpt.num_attention_heads / t),
      g_l_(gpt.num_query_groups / t),
      rope_(gpt.position_embedding_type == PositionEmbedding::kRope),
      ring_(gpt.cp_comm_type == CpCommType::kP2p),
      cp_heads_(gpt.cp_comm_type == CpCommType::kA2a),
      hier_(gpt.cp_comm_type == CpCommType::kA2aP2p),
      rotary_base_(gpt.rotary_base),
      rotary_dim_(gpt.RotaryDim()),
      window_(gpt.AttentionWindow(layer)),
      softmax_type_(gpt.softmax_type),
      sink_(params.Find(prefix_ + ".core_attention.softmax_offset")),
      dropout_(gpt.attention_dropout),
      qkv_(&params.Get(prefix_ + ".linear_qkv.weight"), params.Find(prefix_ + ".linear_qkv.bias")),
      proj_(&params.Get(prefix_ + ".linear_proj.weight")),
      proj_bias_(params.Find(prefix_ + ".linear_proj.bias")) {
  if (gpt.qk_layernorm) {
    const auto norm = [&](const std::string& name) {
      return Norm(gpt.normalization, gpt.layernorm_epsilon, &params.Get(name + ".weight"),
                  params.Find(name + ".bias"));
    };
    q_norm_ = norm(prefix_ + ".q_layernorm");
    k_norm_ = norm(prefix_ + ".k_layernorm");
  }
}

// Where this rank's probabilities [b, a_l, s_cp, s] sit in the full [B, a, s, s]: one piece
// without context parallelism or under "a2a" ([b, a_l / cp, s, s]), else one per sample, its
// query rows in the rank's two chunks.
IndexPieces SelfAttention::ProbsMap(const StreamShape& sh) const {
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


Tensor SelfAttention::Forward(const ModuleContext& ctx, const Tensor& x, bool keep_core,
                              Stash* stash) const {
  const StreamShape& sh = ctx.shape;
  stash->qkv = qkv_.Forward(ctx, x, &stash->qkv_in);
  ctx.Record(prefix_ + ".linear_qkv.output", stash->qkv, {sh.s, sh.B, (a_ + 2 * g_) * dk_},
             sh.ColumnSpec(ctx.dp_size, 1));
  CoreStash core;
  const Tensor context = CoreForward(ctx, stash->qkv, &core);
  if (keep_core) stash->core = std::move(core);
  const Tensor out = proj_.Forward(ctx, context, &stash->proj_in);
  ctx.Record(prefix_ + ".linear_proj.output", out, {sh.s, sh.B, out.cols()},
             sh.StreamSpec(ctx.dp_size));
  return out;
}

// What Forward and CoreForward leave in the stash (q, k, v, probs are this rank's: with
// context parallelism its s_cp query rows, "a2a" 1/cp of its heads at every position, as many
// elements).
StashPlan SelfAttention::PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                                   bool keep_core) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  const double t = d(shape.t), dk = d(gpt.kv_channels), h = d(gpt.hidden_size);
  const double R = d(shape.s_cp() * shape.b);  // this rank's query rows (tokens)
  const double al = d(gpt.num_attention_heads) / t, gl = d(gpt.num_query_groups) / t;
  const bool cp = shape.cp > 1;
  const bool ring = cp && (gpt.cp_comm_type == CpCommType::kP2p ||
                           gpt.cp_comm_type == CpCommType::kA2aP2p);
  const bool gathered = cp && gpt.cp_comm_type == CpCommType::kAllGather;
  StashPlan plan;
  plan.Add("qkv_in.input", {d(shape.stream_rows()), h}, dtype);  // the input norm's output
  plan.Add("qkv", {R, (al + 2 * gl) * dk}, dtype);
  if (keep_core) {
    StashPlan core;
    core.Add("q", {R * al, dk}, dtype);
    // "all_gather": the keys and values of every position.
    const double kv_rows = gathered ? d(shape.b) * gl * d(shape.s) : R * gl;
    core.Add("k", {kv_rows, dk}, dtype);
    core.Add("v", {kv_rows, dk}, dtype);
    if (gpt.qk_layernorm) {
      // The norms' inputs, q and k before them (q and k above are their outputs).
      core.Add("q_norm.input", {R * al, dk}, dtype);
      core.Add("q_norm", Norm::PlanStash(gpt.normalization, R * al, dtype));
      core.Add("k_norm.input", {R * gl, dk}, dtype);
      core.Add("k_norm", Norm::PlanStash(gpt.normalization, R * gl, dtype));
    }
    if (gpt.softmax_type == SoftmaxType::kLearnable) {
      // Each row's log-sum-exp with the sink, for the sink's gradient.
      core.Add("lse", {R * al}, ComputeDType(dtype));
    }
    if (ring) {
      // RingStash: both query halves, their merged output and log-sum-exp, and this rank's
      // keys and values in the chunks the ring passes.
      core.Add("ring.q", {R * al, dk}, dtype);
      core.Add("ring.out", {R * al, dk}, dtype);
      core.Add("ring.lse", {R * al}, ComputeDType(dtype));
      core.Add("ring.kv", {2 * R * gl, dk}, dtype);
    } else {
      core.Add("probs", {R * al, d(shape.s)}, dtype);
      // Without attention dropout probs_dropped is probs itself.
      if (gpt.attention_dropout > 0) core.Add("probs_dropped", {R * al, d(shape.s)}, dtype);
    }
    plan.Add("core", core);
  }
  plan.Add("proj_in.input", {R, al * dk}, dtype);  // the context, core attention's output
  return plan;
}

Tensor SelfAttention::Backward(const ModuleContext& ctx, const Tensor& dy, Stash& stash) const {
  const StreamShape& sh = ctx.shape;
  ctx.Record(prefix_ + ".linear_proj.output_grad", dy, {sh.s, sh.B, dy.cols()},
             sh.StreamSpec(ctx.dp_size));
  const Tensor dcontext = proj_.Backward(ctx, dy, stash.proj_in);
  if (!stash.core) {
    // Selective recomputation: core attention again from the kept qkv; the masks are a pure
    // function of their global indices, so the recomputed probabilities are bit-identical.
    const RecomputeScope scope(ctx);
    CoreStash core;
    CoreForward(scope.quiet, stash.qkv, &core);
    stash.core = std::move(core);
  }
  const Tensor dqkv = CoreBackward(ctx, dcontext, *stash.core);
  ctx.Record(prefix_ + ".linear_qkv.output_grad", dqkv, {sh.s, sh.B, (a_ + 2 * g_) * dk_},
             sh.ColumnSpec(ctx.dp_size, 1));
  return qkv_.Backward(ctx, dqkv, stash.qkv_in);
}

Tensor SelfAttention::CoreForward(const ModuleContext& ctx, const Tensor& qkv,
                                  CoreStash* core) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t b = sh.b, dk = dk_, r = r_, w = (a_l_ + 2 * g_l_) * dk;  // qkv row width
  // This rank's tokens and heads: the projection's, until "a2a" exchanges them.
  int64_t s = sh.s_cp(), gl = g_l_, al = a_l_;
  const DType dtype = qkv.dtype();
  // Split the fused projection into contiguous per-head tensors.
  core->q = k.Empty({b * gl * r * s, dk}, dtype);
  k.StridedCopy(qkv, 0, {b, gl, r, s, dk}, {w, (r + 2) * dk, dk, b * w, 1}, core->q, 0,
                {gl * r * s * dk, r * s * dk, s * dk, dk, 1});
  core->k = k.Empty({b * gl * s, dk}, dtype);
  core->v = k.Empty({b * gl * s, dk}, dtype);
  k.StridedCopy(qkv, r * dk, {b, gl, s, dk}, {w, (r + 2) * dk, b * w, 1}, core->k, 0,
                {gl * s * dk, s * dk, dk, 1});
  k.StridedCopy(qkv, (r + 1) * dk, {b, gl, s, dk}, {w, (r + 2) * dk, b * w, 1}, core->v, 0,
                {gl * s * dk, s * dk, dk, 1});
  if (q_norm_) {
    // Megatron's get_query_key_value_tensors: the norms before RoPE, over each head's dk.
    core->q = q_norm_->Forward(ctx, core->q, &core->q_norm);
    core->k = k_norm_->Forward(ctx, core->k, &core->k_norm);
  }
  if (rope_) {
    k.Rope(core->q, ctx.positions, rotary_base_, rotary_dim_, false, core->q);
    k.Rope(core->k, ctx.positions, rotary_base_, rotary_dim_, false, core->k);
  }
  if (sh.cp > 1 && (ring_ || hier_)) {
    const Tensor context = RingForward(ctx, core);
    if (ctx.recording()) RecordRingProbs(ctx, *core, nullptr);
    return ContextToColumns(ctx, context, al, dk);
  }
  // s: the queries; sk: the keys attention sees.
  const int64_t sk = sh.s;
  const bool heads = sh.cp > 1 && cp_heads_;
  if (heads) {
    // Ulysses: every position of 1/cp of the heads; the queries in sequence order too.
    core->q = HeadsForSequence(k, *ctx.cp, sh.s, core->q, b, al, dk);
    core->k = HeadsForSequence(k, *ctx.cp, sh.s, core->k, b, gl, dk);
    core->v = HeadsForSequence(k, *ctx.cp, sh.s, core->v, b, gl, dk);
    s = sk, gl /= sh.cp, al /= sh.cp;
  } else if (sh.cp > 1) {
    core->k = GatherSequence(k, *ctx.cp, sh.s, core->k, b * gl, dk);
    core->v = GatherSequence(k, *ctx.cp, sh.s, core->v, b * gl, dk);
  }
  const Tensor& q_pos = heads ? ctx.key_positions : ctx.positions;
  // scores = q k^T / sqrt(dk): one GEMM per (sample, group) over its r*s query rows.
  Tensor scores = k.Empty({b * gl, r * s, sk}, dtype);
  k.BatchedGemm(false, true, 1.0 / std::sqrt(static_cast<double>(dk)),
                core->q.Reshaped({b * gl, r * s, dk}), core->k.Reshaped({b * gl, sk, dk}), 0.0,
                scores);
  core->probs = k.Empty({b * al * s, sk}, dtype);
  // An attention sink: the logits of this rank's al heads (row r's head is (r / s) % al);
  // "learnable" keeps each row's log-sum-exp for the sink's gradient.
  if (sink_ != nullptr) core->lse = k.Empty({b * al * s}, ComputeDType(dtype));
  {
    const std::optional<Tensor> sink = Sink(ctx, dtype);  // "off-by-one": freed right after
    k.CausalSoftmaxForward(scores.Reshaped({b * al * s, sk}), q_pos, ctx.key_positions, 1.0,
                           core->probs, sink_ != nullptr ? &core->lse : nullptr, window_,
                           sink ? &*sink : nullptr);
  }
  ctx.Record(prefix_ + ".core_attention.probs", core->probs.Reshaped({b, al, s, sk}),
             {sh.B, a_, sk, sk}, ProbsSpec(ctx));
  core->probs_dropped =
      dropout_ > 0 ? DropoutAtSite(ctx, prefix_ + ".core_attention.attention_dropout", dropout_,
                                   ProbsMap(sh), core->probs)
                   : core->probs;
  Tensor context = k.Empty({b * gl, r * s, dk}, dtype);
  k.BatchedGemm(false, false, 1.0, core->probs_dropped.Reshaped({b * gl, r * s, sk}),
                core->v.Reshaped({b * gl, sk, dk}), 0.0, context);
  if (heads) context = SequenceForHeads(k, *ctx.cp, sh.s, context, b, a_l_, dk);
  return ContextToColumns(ctx, context, a_l_, dk);
}

// The sink logits of the heads this rank's softmax rows hold ("a2a": its 1/cp of its tp
// rank's), in `dtype`: the parameter's ("learnable"), zeros ("off-by-one"), or none.
std::optional<Tensor> SelfAttention::Sink(const ModuleContext& ctx, DType dtype) const {
  const StreamShape& sh = ctx.shape;
  const bool heads = sh.cp > 1 && cp_heads_;
  const int64_t al = heads ? a_l_ / sh.cp : a_l_;
  if (sink_ != nullptr) return sink_->value.FlatSlice(heads ? sh.cp_rank * al : 0, al);
  if (softmax_type_ == SoftmaxType::kOffByOne) return ctx.k.Zeros({al}, dtype);
  return std::nullopt;
}

ShardSpec SelfAttention::ProbsSpec(const ModuleContext& ctx) const {
  return cp_heads_ ? ctx.shape.CpHeadSpec(ctx.dp_size) : ctx.shape.HeadSpec(ctx.dp_size);
}

// The context [b, a_l, s_cp, dk] as core attention's output [s_cp * b, a_l * dk], recorded.
Tensor SelfAttention::ContextToColumns(const ModuleContext& ctx, const Tensor& context,
                                       int64_t al, int64_t dk) const {
  const StreamShape& sh = ctx.shape;
  const int64_t s = sh.s_cp(), b = sh.b;
  Tensor out = ctx.k.Empty({s * b, al * dk}, context.dtype());
  ctx.k.StridedCopy(context, 0, {b, al, s, dk}, {al * s * dk, s * dk, dk, 1}, out, 0,
                    {al * dk, dk, b * al * dk, 1});
  ctx.Record(prefix_ + ".core_attention.output", out, {sh.s, sh.B, a_ * dk},
             sh.ColumnSpec(ctx.dp_size, 1));
  return out;
}

Tensor SelfAttention::CoreBackward(const ModuleContext& ctx, const Tensor& dout,
                                   const CoreStash& core) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t sk = sh.s, b = sh.b, dk = dk_, r = r_;
  int64_t s = sh.s_cp(), gl = g_l_, al = a_l_;
  const DType dtype = dout.dtype();
  ctx.Record(prefix_ + ".core_attention.output_grad", dout, {sk, sh.B, a_ * dk},
             sh.ColumnSpec(ctx.dp_size, 1));
  Tensor dcontext = k.Empty({b * gl, r * s, dk}, dtype);
  k.StridedCopy(dout, 0, {b, al, s, dk}, {al * dk, dk, b * al * dk, 1}, dcontext, 0,
                {al * s * dk, s * dk, dk, 1});
  if (core.ring) {
    if (ctx.recording()) RecordRingProbs(ctx, core, &dcontext);
    Tensor dq, dkey, dv;
    RingBackward(ctx, dcontext, core, &dq, &dkey, &dv);
    return QkvGrad(ctx, core, dq.Reshaped({b * gl * r * s, dk}), dkey, dv);
  }
  const bool heads = sh.cp > 1 && cp_heads_;
  if (heads) {
    s = sk, gl /= sh.cp, al /= sh.cp;
    dcontext =
        HeadsForSequence(k, *ctx.cp, sh.s, dcontext, b, a_l_, dk).Reshaped({b * gl, r * s, dk});
  }
  const Tensor& q_pos = heads ? ctx.key_positions : ctx.positions;
  // context = P_d v:  dP_d = dcontext v^T,  dv = P_d^T dcontext (summed over the group's heads)
  Tensor dprobs = k.Empty({b * gl, r * s, sk}, dtype);
  k.BatchedGemm(false, true, 1.0, dcontext, core.v.Reshaped({b * gl, sk, dk}), 0.0, dprobs);
  Tensor dv = k.Empty({b * gl, sk, dk}, dtype);
  k.BatchedGemm(true, false, 1.0, core.probs_dropped.Reshaped({b * gl, r * s, sk}), dcontext,
                0.0, dv);
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
    k.RowDot(core.probs, dprobs_flat, row_dot);
    const int64_t head0 = heads ? sh.cp_rank * al : 0;
    Tensor dsink = sink_->grad.FlatSlice(head0, al);
    k.SoftmaxSinkGrad(sink_->value.FlatSlice(head0, al), core.lse, row_dot, s, dsink);
  }
  Tensor dscores = k.Empty({b * al * s, sk}, dtype);
  k.CausalSoftmaxBackward(core.probs, dprobs_flat, q_pos, ctx.key_positions, 1.0, dscores, nullptr,
                          window_);
  // scores = c q k^T:  dq = c dscores k,  dk = c dscores^T q
  const double c = 1.0 / std::sqrt(static_cast<double>(dk));
  const Tensor ds = dscores.Reshaped({b * gl, r * s, sk});
  Tensor dq = k.Empty({b * gl, r * s, dk}, dtype);
  k.BatchedGemm(false, false, c, ds, core.k.Reshaped({b * gl, sk, dk}), 0.0, dq);
  Tensor dkey = k.Empty({b * gl, sk, dk}, dtype);
  k.BatchedGemm(true, false, c, ds, core.q.Reshaped({b * gl, r * s, dk}), 0.0, dkey);
  Tensor dk2 = dkey.Reshaped({b * gl * sk, dk});
  if (heads) {
    dq = SequenceForHeads(k, *ctx.cp, sh.s, dq, b, a_l_, dk);
    dk2 = SequenceForHeads(k, *ctx.cp, sh.s, dk2, b, g_l_, dk);
    dv = SequenceForHeads(k, *ctx.cp, sh.s, dv, b, g_l_, dk);
  } else if (sh.cp > 1) {
    dk2 = ReduceScatterSequence(k, *ctx.cp, sh.s, dk2, b * gl, dk);
    dv = ReduceScatterSequence(k, *ctx.cp, sh.s, dv.Reshaped({b * gl * sk, dk}), b * gl, dk);
  }
  const int64_t tokens = sh.s_cp();
  return QkvGrad(ctx, core, dq.Reshaped({b * g_l_ * r * tokens, dk}), dk2,
                 dv.Reshaped({b * g_l_ * tokens, dk}));
}

// The gradients of this rank's q [b*g_l*r*s_cp, dk], k and v [b*g_l*s_cp, dk] after RoPE and
// the q/k norms, back through them into the fused projection's gradient [s_cp*b, w].
Tensor SelfAttention::QkvGrad(const ModuleContext& ctx, const CoreStash& core, Tensor dq2,
                              Tensor dk2, const Tensor& dv) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t s = sh.s_cp(), b = sh.b, dk = dk_, r = r_, gl = g_l_, al = a_l_;
  const int64_t w = (al + 2 * gl) * dk;
  const DType dtype = dq2.dtype();
  if (rope_) {
    k.Rope(dq2, ctx.positions, rotary_base_, rotary_dim_, true, dq2);
    k.Rope(dk2, ctx.positions, rotary_base_, rotary_dim_, true, dk2);
  }
  if (q_norm_) {
    dq2 = q_norm_->Backward(ctx, dq2, core.q_norm);
    dk2 = k_norm_->Backward(ctx, dk2, core.k_norm);
  }
  Tensor dqkv = k.Empty({s * b, w}, dtype);
  k.StridedCopy(dq2, 0, {b, gl, r, s, dk}, {gl * r * s * dk, r * s * dk, s * dk, dk, 1}, dqkv, 0,
                {w, (r + 2) * dk, dk, b * w, 1});
  k.StridedCopy(dk2, 0, {b, gl, s, dk}, {gl * s * dk, s * dk, dk, 1}, dqkv, r * dk,
                {w, (r + 2) * dk, b * w, 1});
  k.StridedCopy(dv.Reshaped({b * gl * s, dk}), 0, {b, gl, s, dk}, {gl * s * dk, s * dk, dk, 1},
                dqkv, (r + 1) * dk, {w, (r + 2) * dk, b * w, 1});
  return dqkv;
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
  return hier ? FromRingHeads(ctx.k, *ctx.hcp_a2a, ctx.shape.s_cp(), y, ctx.shape.b, heads, w)
              : y;
}

}  // namespace

// The same block's place in the [b, a_l, s_cp, s] probabilities the rank would hold with
// its keys gathered (query half q_half of its tokens, keys of chunk k_chunk): the local
// indices of dropout_mode "rng_tracker", so a ring run draws the all_gather run's masks.
IndexPieces SelfAttention::LocalBlockMap(const StreamShape& sh, const RingLayout& ring,
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

IndexPieces SelfAttention::BlockMap(const StreamShape& sh, const RingLayout& ring,
                                    int64_t q_chunk, int64_t k_chunk) const {
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

SelfAttention::RingLayout SelfAttention::Ring(const ModuleContext& ctx) const {
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

Tensor SelfAttention::RingForward(const ModuleContext& ctx, CoreStash* core) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const RingLayout L = Ring(ctx);
  const int64_t c = L.c, s_ring = 2 * c;
  const int64_t dk = dk_, r = r_, bg = sh.b * L.gl, rows = bg * r * c;
  const DType dtype = core->q.dtype(), ct = ComputeDType(dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  const std::string site = prefix_ + ".core_attention.attention_dropout";
  // "a2a+p2p": the level-0 group's positions of 1/a of the heads; "p2p": this rank's own.
  const Tensor q = ToRing(ctx, hier_, core->q, a_l_, dk);
  const Tensor key = ToRing(ctx, hier_, core->k, g_l_, dk);
  const Tensor value = ToRing(ctx, hier_, core->v, g_l_, dk);
  RingStash ring;
  Tensor none = Tensor::HostEmpty({rows}, ct);  // a running log-sum-exp before any key
  for (int64_t i = 0; i < rows; ++i) SetHostValue(none, i, -INFINITY);
  for (int64_t h = 0; h < 2; ++h) {
    // Query chunk h of every (sample, group, head): rows [h c, (h + 1) c) of its s_ring.
    ring.q[h] = k.Empty({bg, r * c, dk}, dtype);
    k.StridedCopy(q, h * c * dk, {bg * r, c * dk}, {s_ring * dk, 1}, ring.q[h], 0, {c * dk, 1});
    ring.out[h] = k.Zeros({rows, dk}, dtype);
    ring.lse[h] = k.ToDevice(none);
  }
  ring.kv = k.Empty({4 * bg * c, dk}, dtype);
  for (int64_t which = 0; which < 2; ++which) {
    for (int64_t h = 0; h < 2; ++h) {
      Tensor part = BlockPart(ring.kv, which, h, bg, c, dk);
      k.StridedCopy(which == 0 ? key : value, h * c * dk, {bg, c * dk}, {s_ring * dk, 1}, part,
                    0, {c * dk, 1});
    }
  }
  RunRing(k, *L.group, L.size, L.rank, ring.kv, 0, [&](int64_t src, const Tensor& block) {
    ForEachVisibleBlock(L.size, L.rank, src,
                        [&](int64_t qh, int64_t kh, int64_t q_chunk, int64_t k_chunk) {
      Tensor scores = k.Empty({bg, r * c, c}, dtype);
      k.BatchedGemm(false, true, scale, ring.q[qh], BlockPart(block, 0, kh, bg, c, dk), 0.0,
                    scores);
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
      Tensor part = k.Empty({bg, r * c, dk}, dtype);
      k.BatchedGemm(false, false, 1.0, dropped.Reshaped({bg, r * c, c}),
                    BlockPart(block, 1, kh, bg, c, dk), 0.0, part);
      k.LseMerge(ring.out[qh], ring.lse[qh], part.Reshaped({rows, dk}), lse);
    });
  });
  // The context [bg, r * s_ring, dk]: each query chunk's output back at its rows, then (a2a+p2p)
  // to this rank's tokens of all its heads.
  Tensor context = k.Empty({bg * r * s_ring, dk}, dtype);
  for (int64_t h = 0; h < 2; ++h) {
    k.StridedCopy(ring.out[h], 0, {bg * r, c * dk}, {c * dk, 1}, context, h * c * dk,
                  {s_ring * dk, 1});
  }
  context = FromRing(ctx, hier_, context, a_l_, dk);
  core->ring = std::move(ring);
  return context.Reshaped({sh.b * g_l_, r * sh.s_cp(), dk});
}

void SelfAttention::RingBackward(const ModuleContext& ctx, const Tensor& dcontext_in,
                                 const CoreStash& core, Tensor* dq_out, Tensor* dk_out,
                                 Tensor* dv_out) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const RingStash& ring = *core.ring;
  const RingLayout L = Ring(ctx);
  const int64_t cp = L.size, me = L.rank, c = L.c, s_ring = 2 * c;
  const int64_t dk = dk_, r = r_, bg = sh.b * L.gl, rows = bg * r * c;
  const DType dtype = dcontext_in.dtype(), ct = ComputeDType(dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  const std::string site = prefix_ + ".core_attention.attention_dropout";
  const Tensor dcontext = ToRing(ctx, hier_, dcontext_in, a_l_, dk);
  Tensor dout[2], dq[2], row_dot[2];
  for (int64_t h = 0; h < 2; ++h) {
    dout[h] = k.Empty({bg, r * c, dk}, dtype);
    k.StridedCopy(dcontext, h * c * dk, {bg * r, c * dk}, {s_ring * dk, 1}, dout[h], 0,
                  {c * dk, 1});
    // rowsum(dO * O): the softmax backward's row term over all of a row's keys.
    row_dot[h] = k.Empty({rows}, ct);
    k.RowDot(dout[h].Reshaped({rows, dk}), ring.out[h], row_dot[h]);
    dq[h] = k.Zeros({bg, r * c, dk}, dtype);
  }
  Tensor dblock = k.Zeros(ring.kv.shape(), dtype);  // the gradients travelling with the block
  RunRing(k, *L.group, cp, me, ring.kv, 1, [&](int64_t src, const Tensor& block) {
    ForEachVisibleBlock(cp, me, src, [&](int64_t qh, int64_t kh, int64_t q_chunk, int64_t k_chunk) {
      const Tensor key = BlockPart(block, 0, kh, bg, c, dk);
      const Tensor value = BlockPart(block, 1, kh, bg, c, dk);
      Tensor dkey = BlockPart(dblock, 0, kh, bg, c, dk);
      Tensor dvalue = BlockPart(dblock, 1, kh, bg, c, dk);
      const Tensor q_pos = ctx.key_positions.FlatSlice(q_chunk * c, c);
      const Tensor k_pos = ctx.key_positions.FlatSlice(k_chunk * c, c);
      Tensor probs = k.Empty({bg, r * c, c}, dtype);
      k.BatchedGemm(false, true, scale, ring.q[qh], key, 0.0, probs);
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
      k.BatchedGemm(false, false, scale, ds, key, 1.0, dq[qh]);
      k.BatchedGemm(true, false, scale, ds, ring.q[qh], 1.0, dkey);
    });
    // The block's gradients go on with it; after the last step they reach its owner.
    dblock = PassOn(k, *L.group, cp, me, dblock, 2);
  });
  // dblock now holds this rank's own keys' and values' gradients, in chunks; "a2a+p2p" sends
  // each rank of the level-0 group its tokens' back.
  Tensor dq_ring = k.Empty({bg * r * s_ring, dk}, dtype);
  Tensor dk_ring = k.Empty({bg * s_ring, dk}, dtype);
  Tensor dv_ring = k.Empty({bg * s_ring, dk}, dtype);
  for (int64_t h = 0; h < 2; ++h) {
    k.StridedCopy(dq[h], 0, {bg * r, c * dk}, {c * dk, 1}, dq_ring, h * c * dk,
                  {s_ring * dk, 1});
    k.StridedCopy(BlockPart(dblock, 0, h, bg, c, dk), 0, {bg, c * dk}, {c * dk, 1}, dk_ring,
                  h * c * dk, {s_ring * dk, 1});
    k.StridedCopy(BlockPart(dblock, 1, h, bg, c, dk), 0, {bg, c * dk}, {c * dk, 1}, dv_ring,
                  h * c * dk, {s_ring * dk, 1});
  }
  *dq_out = FromRing(ctx, hier_, dq_ring, a_l_, dk);
  *dk_out = FromRing(ctx, hier_, dk_ring, g_l_, dk);
  *dv_out = FromRing(ctx, hier_, dv_ring, g_l_, dk);
}

// The records of a ring run: its probabilities [b, a_l, s_cp, s] from each row's final
// log-sum-exp on the keys of every position, and (with `dcontext`, in the backward) their
// gradient, the keys and values gathered over cp for the records only (named so in the trace).
void SelfAttention::RecordRingProbs(const ModuleContext& ctx, const CoreStash& core,
                                    const Tensor* dcontext) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const RingStash& ring = *core.ring;
  const int64_t s = sh.s, s_cp = sh.s_cp(), b = sh.b;
  const int64_t dk = dk_, r = r_, gl = g_l_, al = a_l_, bg = b * gl;
  const DType dtype = core.q.dtype();
  const std::string layer_site = ctx.trace.site();
  ctx.trace.SetSite(layer_site + " (gathered for records)");
  const Tensor& local = dcontext == nullptr ? core.k : core.v;
  const Tensor gathered = GatherSequence(k, *ctx.cp, sh.s, local, bg, dk);
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
    k.BatchedGemm(false, true, 1.0 / std::sqrt(static_cast<double>(dk)),
                  core.q.Reshaped({bg, r * s_cp, dk}), gathered.Reshaped({bg, s, dk}), 0.0, probs);
    Tensor p2 = probs.Reshaped({b * al * s_cp, s});
    k.CausalSoftmaxFromLse(p2, lse, ctx.positions, ctx.key_positions, 1.0, p2, window_);
    ctx.Record(prefix_ + ".core_attention.probs", p2.Reshaped({b, al, s_cp, s}), {sh.B, a_, s, s},
               sh.HeadSpec(ctx.dp_size));
    return;
  }
  // dP = dropout(dout v^T) over every key.
  Tensor dprobs = k.Empty({bg, r * s_cp, s}, dtype);
  k.BatchedGemm(false, true, 1.0, *dcontext, gathered.Reshaped({bg, s, dk}), 0.0, dprobs);
  Tensor dp2 = dprobs.Reshaped({b * al * s_cp, s});
  if (dropout_ > 0) {
    dp2 = DropoutAtSite(ctx, prefix_ + ".core_attention.attention_dropout", dropout_,
                        ProbsMap(sh), dp2);
  }
  ctx.Record(prefix_ + ".core_attention.probs_grad", dp2.Reshaped({b, al, s_cp, s}),
             {sh.B, a_, s, s}, sh.HeadSpec(ctx.dp_size));
}

}  // namespace mpusim
