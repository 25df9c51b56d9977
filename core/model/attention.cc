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

// Where this rank's probabilities [b, a_l, s, s] sit in the full [B, a, s, s].
GlobalIndexMap SelfAttention::ProbsMap(const StreamShape& sh) const {
  GlobalIndexMap map;
  map.base = (sh.dp_rank * sh.b * a_ + sh.tp_rank * a_l_) * sh.s * sh.s;
  map.dims = {sh.b, a_l_, sh.s * sh.s};
  map.strides = {a_ * sh.s * sh.s, sh.s * sh.s, 1};
  return map;
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
  const int64_t s = sh.s, b = sh.b, dk = dk_, r = r_, gl = g_l_, al = a_l_;
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
  // scores = q k^T / sqrt(dk): one GEMM per (sample, group) over its r*s query rows.
  Tensor scores = k.Empty({b * gl, r * s, s}, dtype);
  k.BatchedGemm(false, true, 1.0 / std::sqrt(static_cast<double>(dk)),
                core->q.Reshaped({b * gl, r * s, dk}), core->k.Reshaped({b * gl, s, dk}), 0.0,
                scores);
  core->probs = k.Empty({b * al * s, s}, dtype);
  k.CausalSoftmaxForward(scores.Reshaped({b * al * s, s}), ctx.positions, ctx.positions, 1.0,
                         core->probs);
  ctx.Record(prefix_ + ".core_attention.probs", core->probs.Reshaped({b, al, s, s}),
             {sh.B, a_, s, s}, sh.HeadSpec(ctx.dp_size));
  core->probs_dropped =
      dropout_ > 0 ? DropoutAtSite(ctx, prefix_ + ".core_attention.attention_dropout", dropout_,
                                   ProbsMap(sh), core->probs)
                   : core->probs;
  Tensor context = k.Empty({b * gl, r * s, dk}, dtype);
  k.BatchedGemm(false, false, 1.0, core->probs_dropped.Reshaped({b * gl, r * s, s}),
                core->v.Reshaped({b * gl, s, dk}), 0.0, context);
  // [b, a_l, s, dk] -> [s, b, a_l * dk]
  Tensor out = k.Empty({s * b, al * dk}, dtype);
  k.StridedCopy(context, 0, {b, al, s, dk}, {al * s * dk, s * dk, dk, 1}, out, 0,
                {al * dk, dk, b * al * dk, 1});
  ctx.Record(prefix_ + ".core_attention.output", out, {s, sh.B, a_ * dk},
             sh.ColumnSpec(ctx.dp_size, 1));
  return out;
}

Tensor SelfAttention::CoreBackward(const ModuleContext& ctx, const Tensor& dout,
                                   const CoreStash& core) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t s = sh.s, b = sh.b, dk = dk_, r = r_, gl = g_l_, al = a_l_;
  const int64_t w = (al + 2 * gl) * dk;
  const DType dtype = dout.dtype();
  ctx.Record(prefix_ + ".core_attention.output_grad", dout, {s, sh.B, a_ * dk},
             sh.ColumnSpec(ctx.dp_size, 1));
  Tensor dcontext = k.Empty({b * gl, r * s, dk}, dtype);
  k.StridedCopy(dout, 0, {b, al, s, dk}, {al * dk, dk, b * al * dk, 1}, dcontext, 0,
                {al * s * dk, s * dk, dk, 1});
  // context = P_d v:  dP_d = dcontext v^T,  dv = P_d^T dcontext (summed over the group's heads)
  Tensor dprobs = k.Empty({b * gl, r * s, s}, dtype);
  k.BatchedGemm(false, true, 1.0, dcontext, core.v.Reshaped({b * gl, s, dk}), 0.0, dprobs);
  Tensor dv = k.Empty({b * gl, s, dk}, dtype);
  k.BatchedGemm(true, false, 1.0, core.probs_dropped.Reshaped({b * gl, r * s, s}), dcontext, 0.0,
                dv);
  Tensor dprobs_flat = dprobs.Reshaped({b * al * s, s});
  if (dropout_ > 0) {
    dprobs_flat = DropoutAtSite(ctx, prefix_ + ".core_attention.attention_dropout", dropout_,
                                ProbsMap(sh), dprobs_flat);
  }
  ctx.Record(prefix_ + ".core_attention.probs_grad", dprobs_flat.Reshaped({b, al, s, s}),
             {sh.B, a_, s, s}, sh.HeadSpec(ctx.dp_size));
  Tensor dscores = k.Empty({b * al * s, s}, dtype);
  k.CausalSoftmaxBackward(core.probs, dprobs_flat, ctx.positions, ctx.positions, 1.0, dscores);
  // scores = c q k^T:  dq = c dscores k,  dk = c dscores^T q
  const double c = 1.0 / std::sqrt(static_cast<double>(dk));
  const Tensor ds = dscores.Reshaped({b * gl, r * s, s});
  Tensor dq = k.Empty({b * gl, r * s, dk}, dtype);
  k.BatchedGemm(false, false, c, ds, core.k.Reshaped({b * gl, s, dk}), 0.0, dq);
  Tensor dkey = k.Empty({b * gl, s, dk}, dtype);
  k.BatchedGemm(true, false, c, ds, core.q.Reshaped({b * gl, r * s, dk}), 0.0, dkey);
  Tensor dq2 = dq.Reshaped({b * gl * r * s, dk});
  Tensor dk2 = dkey.Reshaped({b * gl * s, dk});
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
