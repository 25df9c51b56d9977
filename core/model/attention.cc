// Self-attention (see attention.h).
#include "core/model/attention.h"

#include <fmt/format.h>

#include <cmath>
#include <optional>
#include <utility>

namespace mpusim {

CoreAttention::Dims SelfAttention::CoreDims(const GptConfig& gpt) {
  CoreAttention::Dims dims;
  dims.a = gpt.num_attention_heads;
  dims.g = gpt.num_query_groups;
  dims.dq = gpt.QueryKeyHeadDim();
  dims.dv = gpt.ValueHeadDim();
  dims.scale = 1.0 / std::sqrt(static_cast<double>(gpt.kv_channels));
  return dims;
}

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
      rotary_base_(gpt.rotary_base),
      rotary_dim_(gpt.RotaryDim()),
      core_(gpt, prefix_, CoreDims(gpt), gpt.AttentionWindow(layer),
            params.Find(prefix_ + ".core_attention.softmax_offset"), t),
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

// What Forward and CoreForward leave in the stash: CoreAttention's (its q, k, v are the
// split's copies, after the norms and RoPE) and the q/k norms'.
StashPlan SelfAttention::PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                                   bool keep_core) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  const double t = d(shape.t), dk = d(gpt.kv_channels), h = d(gpt.hidden_size);
  const double R = d(shape.s_cp() * shape.b);  // this rank's query rows (tokens)
  const double al = d(gpt.num_attention_heads) / t, gl = d(gpt.num_query_groups) / t;
  StashPlan plan;
  plan.Add("qkv_in.input", {d(shape.stream_rows()), h}, dtype);  // the input norm's output
  plan.Add("qkv", {R, (al + 2 * gl) * dk}, dtype);
  if (keep_core) {
    StashPlan core = CoreAttention::PlanStash(gpt, CoreDims(gpt), shape, dtype, false);
    if (gpt.qk_layernorm) {
      // The norms' inputs, q and k before them (q and k are their outputs).
      core.Add("q_norm.input", {R * al, dk}, dtype);
      core.Add("q_norm", Norm::PlanStash(gpt.normalization, R * al, dtype));
      core.Add("k_norm.input", {R * gl, dk}, dtype);
      core.Add("k_norm", Norm::PlanStash(gpt.normalization, R * gl, dtype));
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
  const int64_t s = sh.s_cp(), b = sh.b, dk = dk_, r = r_, gl = g_l_;
  const int64_t w = (a_l_ + 2 * gl) * dk;  // qkv row width
  const DType dtype = qkv.dtype();
  // Split the fused projection into contiguous per-head tensors.
  Tensor q = k.Empty({b * gl * r * s, dk}, dtype);
  k.StridedCopy(qkv, 0, {b, gl, r, s, dk}, {w, (r + 2) * dk, dk, b * w, 1}, q, 0,
                {gl * r * s * dk, r * s * dk, s * dk, dk, 1});
  Tensor key = k.Empty({b * gl * s, dk}, dtype);
  Tensor value = k.Empty({b * gl * s, dk}, dtype);
  k.StridedCopy(qkv, r * dk, {b, gl, s, dk}, {w, (r + 2) * dk, b * w, 1}, key, 0,
                {gl * s * dk, s * dk, dk, 1});
  k.StridedCopy(qkv, (r + 1) * dk, {b, gl, s, dk}, {w, (r + 2) * dk, b * w, 1}, value, 0,
                {gl * s * dk, s * dk, dk, 1});
  if (q_norm_) {
    // Megatron's get_query_key_value_tensors: the norms before RoPE, over each head's dk.
    q = q_norm_->Forward(ctx, q, &core->q_norm);
    key = k_norm_->Forward(ctx, key, &core->k_norm);
  }
  if (rope_) {
    k.Rope(q, ctx.positions, rotary_base_, rotary_dim_, false, q);
    k.Rope(key, ctx.positions, rotary_base_, rotary_dim_, false, key);
  }
  return core_.Forward(ctx, std::move(q), std::move(key), std::move(value), &core->attn);
}

Tensor SelfAttention::CoreBackward(const ModuleContext& ctx, const Tensor& dout,
                                   const CoreStash& core) const {
  return core_.Backward(ctx, dout, core.attn, [&](CoreAttention::Grads g) {
    return QkvGrad(ctx, core, std::move(g.dq), std::move(g.dk), g.dv);
  });
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

}  // namespace mpusim
