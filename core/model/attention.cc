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
// without context parallelism, else one per sample, its query rows in the rank's two chunks.
IndexPieces SelfAttention::ProbsMap(const StreamShape& sh) const {
  const int64_t s = sh.s;
  if (sh.cp == 1) {
    GlobalIndexMap map;
    map.base = (sh.dp_rank * sh.b * a_ + sh.tp_rank * a_l_) * s * s;
    map.dims = {sh.b, a_l_, s * s};
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

// Context parallelism: every cp rank's x [bg * s_cp, dk] (bg rows of its s_cp tokens each),
// gathered over cp and put in sequence order: [bg * s, dk].
Tensor GatherSequence(const ModuleContext& ctx, const Tensor& x, int64_t bg, int64_t dk) {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t cp = sh.cp, s_cp = sh.s_cp(), c = s_cp / 2, s = sh.s;
  Tensor gathered = k.Empty({cp * bg * s_cp, dk}, x.dtype());
  ctx.cp->AllGather(x, gathered);
  Tensor out = k.Empty({bg * s, dk}, x.dtype());
  for (int64_t r = 0; r < cp; ++r) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t chunk = half == 0 ? r : 2 * cp - 1 - r;
      k.StridedCopy(gathered, (r * bg * s_cp + half * c) * dk, {bg, c * dk}, {s_cp * dk, 1}, out,
                    chunk * c * dk, {s * dk, 1});
    }
  }
  return out;
}

// GatherSequence's backward: the gradient of every position [bg * s, dk] back to each cp
// rank's tokens, summed over the ranks: [bg * s_cp, dk].
Tensor ReduceScatterSequence(const ModuleContext& ctx, const Tensor& dy, int64_t bg, int64_t dk) {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t cp = sh.cp, s_cp = sh.s_cp(), c = s_cp / 2, s = sh.s;
  Tensor by_rank = k.Empty({cp * bg * s_cp, dk}, dy.dtype());
  for (int64_t r = 0; r < cp; ++r) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t chunk = half == 0 ? r : 2 * cp - 1 - r;
      k.StridedCopy(dy, chunk * c * dk, {bg, c * dk}, {s * dk, 1}, by_rank,
                    (r * bg * s_cp + half * c) * dk, {s_cp * dk, 1});
    }
  }
  Tensor out = k.Empty({bg * s_cp, dk}, dy.dtype());
  ctx.cp->ReduceScatter(by_rank, out);
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
  // s: this rank's tokens (queries); sk: the keys attention sees.
  const int64_t s = sh.s_cp(), sk = sh.s, b = sh.b, dk = dk_, r = r_, gl = g_l_, al = a_l_;
  const int64_t w = (al + 2 * gl) * dk;  // qkv row width
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
  if (sh.cp > 1) {
    core->k = GatherSequence(ctx, core->k, b * gl, dk);
    core->v = GatherSequence(ctx, core->v, b * gl, dk);
  }
  // scores = q k^T / sqrt(dk): one GEMM per (sample, group) over its r*s query rows.
  Tensor scores = k.Empty({b * gl, r * s, sk}, dtype);
  k.BatchedGemm(false, true, 1.0 / std::sqrt(static_cast<double>(dk)),
                core->q.Reshaped({b * gl, r * s, dk}), core->k.Reshaped({b * gl, sk, dk}), 0.0,
                scores);
  core->probs = k.Empty({b * al * s, sk}, dtype);
  k.CausalSoftmaxForward(scores.Reshaped({b * al * s, sk}), ctx.positions, ctx.key_positions,
                         1.0, core->probs);
  ctx.Record(prefix_ + ".core_attention.probs", core->probs.Reshaped({b, al, s, sk}),
             {sh.B, a_, sk, sk}, sh.HeadSpec(ctx.dp_size));
  core->probs_dropped =
      dropout_ > 0 ? DropoutAtSite(ctx, prefix_ + ".core_attention.attention_dropout", dropout_,
                                   ProbsMap(sh), core->probs)
                   : core->probs;
  Tensor context = k.Empty({b * gl, r * s, dk}, dtype);
  k.BatchedGemm(false, false, 1.0, core->probs_dropped.Reshaped({b * gl, r * s, sk}),
                core->v.Reshaped({b * gl, sk, dk}), 0.0, context);
  // [b, a_l, s, dk] -> [s, b, a_l * dk]
  Tensor out = k.Empty({s * b, al * dk}, dtype);
  k.StridedCopy(context, 0, {b, al, s, dk}, {al * s * dk, s * dk, dk, 1}, out, 0,
                {al * dk, dk, b * al * dk, 1});
  ctx.Record(prefix_ + ".core_attention.output", out, {sk, sh.B, a_ * dk},
             sh.ColumnSpec(ctx.dp_size, 1));
  return out;
}

Tensor SelfAttention::CoreBackward(const ModuleContext& ctx, const Tensor& dout,
                                   const CoreStash& core) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t s = sh.s_cp(), sk = sh.s, b = sh.b, dk = dk_, r = r_, gl = g_l_, al = a_l_;
  const int64_t w = (al + 2 * gl) * dk;
  const DType dtype = dout.dtype();
  ctx.Record(prefix_ + ".core_attention.output_grad", dout, {sk, sh.B, a_ * dk},
             sh.ColumnSpec(ctx.dp_size, 1));
  Tensor dcontext = k.Empty({b * gl, r * s, dk}, dtype);
  k.StridedCopy(dout, 0, {b, al, s, dk}, {al * dk, dk, b * al * dk, 1}, dcontext, 0,
                {al * s * dk, s * dk, dk, 1});
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
             {sh.B, a_, sk, sk}, sh.HeadSpec(ctx.dp_size));
  Tensor dscores = k.Empty({b * al * s, sk}, dtype);
  k.CausalSoftmaxBackward(core.probs, dprobs_flat, ctx.positions, ctx.key_positions, 1.0,
                          dscores);
  // scores = c q k^T:  dq = c dscores k,  dk = c dscores^T q
  const double c = 1.0 / std::sqrt(static_cast<double>(dk));
  const Tensor ds = dscores.Reshaped({b * gl, r * s, sk});
  Tensor dq = k.Empty({b * gl, r * s, dk}, dtype);
  k.BatchedGemm(false, false, c, ds, core.k.Reshaped({b * gl, sk, dk}), 0.0, dq);
  Tensor dkey = k.Empty({b * gl, sk, dk}, dtype);
  k.BatchedGemm(true, false, c, ds, core.q.Reshaped({b * gl, r * s, dk}), 0.0, dkey);
  Tensor dq2 = dq.Reshaped({b * gl * r * s, dk});
  Tensor dk2 = dkey.Reshaped({b * gl * sk, dk});
  if (sh.cp > 1) {
    dk2 = ReduceScatterSequence(ctx, dk2, b * gl, dk);
    dv = ReduceScatterSequence(ctx, dv.Reshaped({b * gl * sk, dk}), b * gl, dk);
  }
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

}  // namespace mpusim
