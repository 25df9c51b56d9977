// Self-attention (see attention.h).
#include "core/model/attention.h"

#include <fmt/format.h>

#include <cmath>
#include <optional>

namespace mpusim {

SelfAttention::SelfAttention(const GptConfig& gpt, std::string prefix, ParameterSet& params,
                             int64_t t)
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

namespace {

// Context parallelism moves tensors between rank order, [cp, rows, s_cp, dk] (for each cp
// rank its rows of its s_cp tokens: chunks r and 2 cp - 1 - r), and sequence order
// [rows, s, dk]. ToSequence copies the first into the second, FromSequence back.
void ReorderSequence(Kernels& k, const StreamShape& sh, const Tensor& from, Tensor& to,
                     int64_t rows, int64_t dk, bool to_sequence) {
  const int64_t cp = sh.cp, s_cp = sh.s_cp(), c = s_cp / 2, s = sh.s;
  for (int64_t r = 0; r < cp; ++r) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t ranked = (r * rows * s_cp + half * c) * dk;
      const int64_t ordered = (half == 0 ? r : 2 * cp - 1 - r) * c * dk;
      if (to_sequence) {
        k.StridedCopy(from, ranked, {rows, c * dk}, {s_cp * dk, 1}, to, ordered, {s * dk, 1});
      } else {
        k.StridedCopy(from, ordered, {rows, c * dk}, {s * dk, 1}, to, ranked, {s_cp * dk, 1});
      }
    }
  }
}

// cp_comm_type "all_gather": every cp rank's x [bg * s_cp, dk] (bg rows of its s_cp tokens
// each), gathered over cp and put in sequence order: [bg * s, dk].
Tensor GatherSequence(const ModuleContext& ctx, const Tensor& x, int64_t bg, int64_t dk) {
  const StreamShape& sh = ctx.shape;
  Tensor gathered = ctx.k.Empty({sh.cp * bg * sh.s_cp(), dk}, x.dtype());
  ctx.cp->AllGather(x, gathered);
  Tensor out = ctx.k.Empty({bg * sh.s, dk}, x.dtype());
  ReorderSequence(ctx.k, sh, gathered, out, bg, dk, true);
  return out;
}

// GatherSequence's backward: the gradient of every position [bg * s, dk] back to each cp
// rank's tokens, summed over the ranks: [bg * s_cp, dk].
Tensor ReduceScatterSequence(const ModuleContext& ctx, const Tensor& dy, int64_t bg, int64_t dk) {
  const StreamShape& sh = ctx.shape;
  Tensor by_rank = ctx.k.Empty({sh.cp * bg * sh.s_cp(), dk}, dy.dtype());
  ReorderSequence(ctx.k, sh, dy, by_rank, bg, dk, false);
  Tensor out = ctx.k.Empty({bg * sh.s_cp(), dk}, dy.dtype());
  ctx.cp->ReduceScatter(by_rank, out);
  return out;
}

// cp_comm_type "a2a" (Ulysses): this rank's tokens of `heads` heads, x [b, heads, s_cp, dk],
// become every position of 1/cp of the heads, [b, heads / cp, s, dk] in sequence order: cp
// rank j is sent heads [j hc, (j + 1) hc) (hc = heads / cp) of this rank's tokens.
Tensor HeadsForSequence(const ModuleContext& ctx, const Tensor& x, int64_t b, int64_t heads,
                        int64_t dk) {
  const StreamShape& sh = ctx.shape;
  const int64_t cp = sh.cp, hc = heads / cp, piece = hc * sh.s_cp() * dk;
  Tensor send = ctx.k.Empty({cp * b * piece}, x.dtype());  // [cp, b, hc, s_cp, dk]
  ctx.k.StridedCopy(x, 0, {cp, b, piece}, {piece, cp * piece, 1}, send, 0,
                    {b * piece, piece, 1});
  Tensor received = ctx.k.Empty({cp * b * piece}, x.dtype());  // [cp, b, hc, s_cp, dk]
  ctx.cp->AllToAll(send, received);
  Tensor out = ctx.k.Empty({b * hc * sh.s, dk}, x.dtype());
  ReorderSequence(ctx.k, sh, received, out, b * hc, dk, true);
  return out;
}

// HeadsForSequence's inverse (and its backward): y [b, heads / cp, s, dk] -> [b, heads,
// s_cp, dk], each cp rank's tokens back to it.
Tensor SequenceForHeads(const ModuleContext& ctx, const Tensor& y, int64_t b, int64_t heads,
                        int64_t dk) {
  const StreamShape& sh = ctx.shape;
  const int64_t cp = sh.cp, hc = heads / cp, piece = hc * sh.s_cp() * dk;
  Tensor send = ctx.k.Empty({cp * b * piece}, y.dtype());  // [cp, b, hc, s_cp, dk]
  ReorderSequence(ctx.k, sh, y, send, b * hc, dk, false);
  Tensor received = ctx.k.Empty({cp * b * piece}, y.dtype());
  ctx.cp->AllToAll(send, received);
  Tensor out = ctx.k.Empty({b * heads * sh.s_cp(), dk}, y.dtype());
  ctx.k.StridedCopy(received, 0, {cp, b, piece}, {b * piece, piece, 1}, out, 0,
                    {piece, cp * piece, 1});
  return out;
}

// cp_comm_type "a2a+p2p": this rank's tokens of `heads` heads, x [b, heads, s_cp, w], become
// the tokens of its level-0 group (hcp_L0: a ranks, cp ranks a l .. a l + a - 1) for 1/a of
// the heads, [b, heads / a, 2 a c, w] (c = s / (2 cp)); level-0 rank j is sent heads
// [j heads / a, (j + 1) heads / a). The rows are ring rank l's two super-chunks of a c
// positions, l and 2 (cp / a) - 1 - l: the group's first chunks (rank j's at j c), then its
// second chunks in the opposite rank order (rank j's at (2a - 1 - j) c), positions
// ascending in both.
Tensor ToRingHeads(const ModuleContext& ctx, const Tensor& x, int64_t b, int64_t heads,
                   int64_t w) {
  Communicator& group = *ctx.hcp_a2a;
  const int64_t a = group.Size();
  if (a == 1) return x;
  Kernels& k = ctx.k;
  const int64_t s_cp = ctx.shape.s_cp(), c = s_cp / 2, s_ring = a * s_cp, ha = heads / a;
  const int64_t piece = ha * s_cp * w;
  Tensor send = k.Empty({a * b * piece}, x.dtype());  // [a, b, ha, s_cp, w]
  k.StridedCopy(x, 0, {a, b, piece}, {piece, a * piece, 1}, send, 0, {b * piece, piece, 1});
  Tensor received = k.Empty({a * b * piece}, x.dtype());  // [a (from j), b, ha, s_cp, w]
  group.AllToAll(send, received);
  Tensor out = k.Empty({b * ha * s_ring, w}, x.dtype());
  for (int64_t j = 0; j < a; ++j) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t from = (j * b * ha * s_cp + half * c) * w;
      const int64_t to = (half == 0 ? j * c : (2 * a - 1 - j) * c) * w;
      k.StridedCopy(received, from, {b * ha, c * w}, {s_cp * w, 1}, out, to, {s_ring * w, 1});
    }
  }
  return out;
}

// ToRingHeads' inverse (and its backward): y [b, heads / a, 2 a c, w] -> [b, heads, s_cp, w].
Tensor FromRingHeads(const ModuleContext& ctx, const Tensor& y, int64_t b, int64_t heads,
                     int64_t w) {
  Communicator& group = *ctx.hcp_a2a;
  const int64_t a = group.Size();
  if (a == 1) return y;
  Kernels& k = ctx.k;
  const int64_t s_cp = ctx.shape.s_cp(), c = s_cp / 2, s_ring = a * s_cp, ha = heads / a;
  const int64_t piece = ha * s_cp * w;
  Tensor send = k.Empty({a * b * piece}, y.dtype());  // [a (to j), b, ha, s_cp, w]
  for (int64_t j = 0; j < a; ++j) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t to = (j * b * ha * s_cp + half * c) * w;
      const int64_t from = (half == 0 ? j * c : (2 * a - 1 - j) * c) * w;
      k.StridedCopy(y, from, {b * ha, c * w}, {s_ring * w, 1}, send, to, {s_cp * w, 1});
    }
  }
  Tensor received = k.Empty({a * b * piece}, y.dtype());  // [a (from j), b, ha, s_cp, w]
  group.AllToAll(send, received);
  Tensor out = k.Empty({b * heads * s_cp, w}, y.dtype());
  k.StridedCopy(received, 0, {a, b, piece}, {b * piece, piece, 1}, out, 0,
                {piece, a * piece, 1});
  return out;
}

}  // namespace

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

Tensor SelfAttention::Backward(const ModuleContext& ctx, const Tensor& dy, Stash& stash) const {
  const StreamShape& sh = ctx.shape;
  ctx.Record(prefix_ + ".linear_proj.output_grad", dy, {sh.s, sh.B, dy.cols()},
             sh.StreamSpec(ctx.dp_size));
  const Tensor dcontext = proj_.Backward(ctx, dy, stash.proj_in);
  if (!stash.core) {
    // Selective recomputation: core attention again from the kept qkv; the masks are a pure
    // function of their global indices, so the recomputed probabilities are bit-identical.
    ModuleContext quiet = ctx;
    quiet.records = nullptr;
    std::optional<SpanRecorder> span;
    if (ctx.recompute_spans != nullptr) {
      span.emplace(*ctx.recompute_spans, ctx.chunk, ctx.draw.microbatch, true, true);
    }
    CoreStash core;
    CoreForward(quiet, stash.qkv, &core);
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
    core->q = HeadsForSequence(ctx, core->q, b, al, dk);
    core->k = HeadsForSequence(ctx, core->k, b, gl, dk);
    core->v = HeadsForSequence(ctx, core->v, b, gl, dk);
    s = sk, gl /= sh.cp, al /= sh.cp;
  } else if (sh.cp > 1) {
    core->k = GatherSequence(ctx, core->k, b * gl, dk);
    core->v = GatherSequence(ctx, core->v, b * gl, dk);
  }
  const Tensor& q_pos = heads ? ctx.key_positions : ctx.positions;
  // scores = q k^T / sqrt(dk): one GEMM per (sample, group) over its r*s query rows.
  Tensor scores = k.Empty({b * gl, r * s, sk}, dtype);
  k.BatchedGemm(false, true, 1.0 / std::sqrt(static_cast<double>(dk)),
                core->q.Reshaped({b * gl, r * s, dk}), core->k.Reshaped({b * gl, sk, dk}), 0.0,
                scores);
  core->probs = k.Empty({b * al * s, sk}, dtype);
  k.CausalSoftmaxForward(scores.Reshaped({b * al * s, sk}), q_pos, ctx.key_positions, 1.0,
                         core->probs);
  ctx.Record(prefix_ + ".core_attention.probs", core->probs.Reshaped({b, al, s, sk}),
             {sh.B, a_, sk, sk}, ProbsSpec(ctx));
  core->probs_dropped =
      dropout_ > 0 ? DropoutAtSite(ctx, prefix_ + ".core_attention.attention_dropout", dropout_,
                                   ProbsMap(sh), core->probs)
                   : core->probs;
  Tensor context = k.Empty({b * gl, r * s, dk}, dtype);
  k.BatchedGemm(false, false, 1.0, core->probs_dropped.Reshaped({b * gl, r * s, sk}),
                core->v.Reshaped({b * gl, sk, dk}), 0.0, context);
  if (heads) context = SequenceForHeads(ctx, context, b, a_l_, dk);
  return ContextToColumns(ctx, context, a_l_, dk);
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
    dcontext = HeadsForSequence(ctx, dcontext, b, a_l_, dk).Reshaped({b * gl, r * s, dk});
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
  Tensor dscores = k.Empty({b * al * s, sk}, dtype);
  k.CausalSoftmaxBackward(core.probs, dprobs_flat, q_pos, ctx.key_positions, 1.0, dscores);
  // scores = c q k^T:  dq = c dscores k,  dk = c dscores^T q
  const double c = 1.0 / std::sqrt(static_cast<double>(dk));
  const Tensor ds = dscores.Reshaped({b * gl, r * s, sk});
  Tensor dq = k.Empty({b * gl, r * s, dk}, dtype);
  k.BatchedGemm(false, false, c, ds, core.k.Reshaped({b * gl, sk, dk}), 0.0, dq);
  Tensor dkey = k.Empty({b * gl, sk, dk}, dtype);
  k.BatchedGemm(true, false, c, ds, core.q.Reshaped({b * gl, r * s, dk}), 0.0, dkey);
  Tensor dk2 = dkey.Reshaped({b * gl * sk, dk});
  if (heads) {
    dq = SequenceForHeads(ctx, dq, b, a_l_, dk);
    dk2 = SequenceForHeads(ctx, dk2, b, g_l_, dk);
    dv = SequenceForHeads(ctx, dv, b, g_l_, dk);
  } else if (sh.cp > 1) {
    dk2 = ReduceScatterSequence(ctx, dk2, b * gl, dk);
    dv = ReduceScatterSequence(ctx, dv.Reshaped({b * gl * sk, dk}), b * gl, dk);
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


// --- cp_comm_type "p2p": the ring ------------------------------------------------------
//
// Rank me of the cp ring holds chunks Chunk(me, 0) = me and Chunk(me, 1) = 2 cp - 1 - me of
// c positions. Step i (0 <= i < cp) computes with the keys and values of rank (me - i) mod cp
// while passing them on to me + 1 and receiving the next block from me - 1 (Megatron's
// AttnFuncWithCPAndKVP2P). In a step, each pair of a query chunk and a key chunk is one
// c x c block: skipped when every key comes after every query, else its softmax over its
// keys, with its log-sum-exp, times its values, merged into the query chunk's running output
// (LseMerge). Attention dropout is drawn per global element of [B, a, s, s] (BlockMap), on
// the block's own probabilities: the merge scales them to the row's, so the masks are the
// all_gather run's. The backward runs the ring again from each row's final log-sum-exp; the
// gradients of a block's keys and values travel with it and reach their owner after cp steps.

namespace {

int64_t Chunk(int64_t cp, int64_t rank, int64_t half) {
  return half == 0 ? rank : 2 * cp - 1 - rank;
}

// The ring's cp steps on this rank (cp, me: the ring's size and this rank's place): step i
// computes `body(src, block)` with the block of rank src = (me - i) mod cp while that block
// is passed on to me + 1 and the next one received from me - 1 (messages tagged `tag`); the
// last step passes nothing on.
template <typename Body>
void RunRing(Kernels& k, Communicator& ring, int64_t cp, int64_t me, Tensor block, int tag,
             Body&& body) {
  const int next = static_cast<int>((me + 1) % cp), prev = static_cast<int>((me + cp - 1) % cp);
  for (int64_t step = 0; step < cp; ++step) {
    std::unique_ptr<PendingP2P> pending;
    Tensor incoming;
    if (step + 1 < cp) {  // pass the block on while computing with it
      incoming = k.Empty(block.shape(), block.dtype());
      pending = ring.PostSendRecv({{P2POp::Kind::kSend, block, next, tag},
                                   {P2POp::Kind::kRecv, incoming, prev, tag}});
    }
    body((me - step + cp) % cp, block);
    if (pending) {
      pending->Wait();
      block = incoming;
    }
  }
}

// The c x c blocks of a step with rank src's keys that some query of this rank sees: each of
// this rank's query halves qh against each of src's key halves kh, skipped when every key
// comes after every query. `fn(qh, kh, q_chunk, k_chunk)`.
template <typename Fn>
void ForEachVisibleBlock(int64_t cp, int64_t me, int64_t src, Fn&& fn) {
  for (int64_t qh = 0; qh < 2; ++qh) {
    for (int64_t kh = 0; kh < 2; ++kh) {
      const int64_t q_chunk = Chunk(cp, me, qh), k_chunk = Chunk(cp, src, kh);
      if (k_chunk <= q_chunk) fn(qh, kh, q_chunk, k_chunk);
    }
  }
}

// A [bg * c, dk] chunk (k or v: which = 0 or 1; chunk half h) of a ring block laid out as
// [2 (k, v), 2 (chunk), bg, c, dk], as a view [bg, c, dk].
Tensor BlockPart(const Tensor& block, int64_t which, int64_t half, int64_t bg, int64_t c,
                 int64_t dk) {
  const int64_t n = bg * c * dk;
  return block.FlatSlice((which * 2 + half) * n, n).Reshaped({bg, c, dk});
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
  const Tensor q = hier_ ? ToRingHeads(ctx, core->q, sh.b, a_l_, dk) : core->q;
  const Tensor key = hier_ ? ToRingHeads(ctx, core->k, sh.b, g_l_, dk) : core->k;
  const Tensor value = hier_ ? ToRingHeads(ctx, core->v, sh.b, g_l_, dk) : core->v;
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
      k.CausalSoftmaxForward(scores.Reshaped({rows, c}),
                             ctx.key_positions.FlatSlice(q_chunk * c, c),
                             ctx.key_positions.FlatSlice(k_chunk * c, c), 1.0, probs, &lse);
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
  if (hier_) context = FromRingHeads(ctx, context, sh.b, a_l_, dk);
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
  const Tensor dcontext = hier_ ? ToRingHeads(ctx, dcontext_in, sh.b, a_l_, dk) : dcontext_in;
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
  const int next = static_cast<int>((me + 1) % cp), prev = static_cast<int>((me + cp - 1) % cp);
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
      k.CausalSoftmaxFromLse(probs2, ring.lse[qh], q_pos, k_pos, 1.0, probs2);
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
      k.CausalSoftmaxBackward(probs2, dprobs2, q_pos, k_pos, 1.0, dscores, &row_dot[qh]);
      // scores = c q k^T:  dq += c dscores k,  dk += c dscores^T q
      const Tensor ds = dscores.Reshaped({bg, r * c, c});
      k.BatchedGemm(false, false, scale, ds, key, 1.0, dq[qh]);
      k.BatchedGemm(true, false, scale, ds, ring.q[qh], 1.0, dkey);
    });
    // The block's gradients go on with it; after the last step they reach its owner (a ring
    // of one rank keeps them).
    if (cp == 1) return;
    Tensor dincoming = k.Empty(block.shape(), dtype);
    L.group->BatchSendRecv(
        {{P2POp::Kind::kSend, dblock, next, 2}, {P2POp::Kind::kRecv, dincoming, prev, 2}});
    dblock = dincoming;
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
  *dq_out = hier_ ? FromRingHeads(ctx, dq_ring, sh.b, a_l_, dk) : dq_ring;
  *dk_out = hier_ ? FromRingHeads(ctx, dk_ring, sh.b, g_l_, dk) : dk_ring;
  *dv_out = hier_ ? FromRingHeads(ctx, dv_ring, sh.b, g_l_, dk) : dv_ring;
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
  const Tensor gathered = GatherSequence(ctx, local, bg, dk);
  // Each row's log-sum-exp in the row order of [b, a_l, s_cp]: the halves interleaved (for
  // "a2a+p2p" in the ring's rows, then back to this rank's tokens of all its heads).
  const RingLayout L = Ring(ctx);
  const int64_t s_ring = 2 * L.c, ring_bg = b * L.gl;
  Tensor lse = k.Empty({ring_bg * r * s_ring}, ring.lse[0].dtype());
  for (int64_t h = 0; h < 2; ++h) {
    k.StridedCopy(ring.lse[h], 0, {ring_bg * r, L.c}, {L.c, 1}, lse, h * L.c, {s_ring, 1});
  }
  if (hier_) lse = FromRingHeads(ctx, lse.Reshaped({ring_bg * r * s_ring, 1}), b, al, 1);
  lse = lse.Reshaped({bg * r * s_cp});
  ctx.trace.SetSite(layer_site);
  if (dcontext == nullptr) {
    Tensor probs = k.Empty({bg, r * s_cp, s}, dtype);
    k.BatchedGemm(false, true, 1.0 / std::sqrt(static_cast<double>(dk)),
                  core.q.Reshaped({bg, r * s_cp, dk}), gathered.Reshaped({bg, s, dk}), 0.0, probs);
    Tensor p2 = probs.Reshaped({b * al * s_cp, s});
    k.CausalSoftmaxFromLse(p2, lse, ctx.positions, ctx.key_positions, 1.0, p2);
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
