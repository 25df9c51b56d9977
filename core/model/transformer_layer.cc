// Transformer layer (see transformer_layer.h).
#include "core/model/transformer_layer.h"

#include <fmt/format.h>

#include <optional>

namespace mpusim {
namespace {

Norm MakeNorm(const GptConfig& gpt, const std::string& prefix, ParameterSet& params) {
  return Norm(gpt.normalization, gpt.layernorm_epsilon, &params.Get(prefix + ".weight"),
              params.Find(prefix + ".bias"));
}

}  // namespace

TransformerLayer::TransformerLayer(const GptConfig& gpt, int64_t layer, ParameterSet& params,
                                   int64_t t, const RunConfig& run,
                                   const ExpertPlacement& experts)
    : prefix_(fmt::format("decoder.layers.{}", layer)),
      hidden_dropout_(gpt.hidden_dropout),
      recompute_(run.recompute),
      input_norm_(MakeNorm(gpt, prefix_ + ".input_layernorm", params)),
      attention_(gpt, prefix_ + ".self_attention", params, t),
      pre_mlp_norm_(MakeNorm(gpt, prefix_ + ".pre_mlp_layernorm", params)) {
  if (gpt.moe.enabled() && gpt.moe.layers.at(static_cast<size_t>(layer))) {
    moe_.emplace(gpt, prefix_ + ".mlp", params, run.num_microbatches, experts);
  } else {
    mlp_.emplace(gpt, prefix_ + ".mlp", params);
  }
}

void TransformerLayer::RecordStream(const ModuleContext& ctx, const std::string& name,
                                    const Tensor& t) const {
  const StreamShape& sh = ctx.shape;
  ctx.Record(prefix_ + name, t, {sh.s, sh.B, t.cols()}, sh.StreamSpec(ctx.dp_size));
}

Tensor TransformerLayer::BiasDropoutAdd(const ModuleContext& ctx, const std::string& site,
                                        const Tensor& x, const Parameter* bias,
                                        const Tensor& residual) const {
  Kernels& k = ctx.k;
  Tensor biased = x;
  if (bias != nullptr) {
    biased = k.Empty(x.shape(), x.dtype());
    k.Copy(x, biased);
    k.AddRowVector(bias->value, biased);
  }
  const Tensor dropped =
      hidden_dropout_ > 0
          ? DropoutAtSite(ctx, prefix_ + site, hidden_dropout_, ctx.shape.StreamMap(x.cols()), biased)
          : biased;
  Tensor out = k.Empty(residual.shape(), residual.dtype());
  k.Copy(residual, out);
  k.Axpy(1.0, dropped, out);
  return out;
}

Tensor TransformerLayer::BiasDropoutAddBackward(const ModuleContext& ctx, const std::string& site,
                                                const Tensor& dy, Parameter* bias) const {
  Kernels& k = ctx.k;
  const Tensor dx =
      hidden_dropout_ > 0
          ? DropoutAtSite(ctx, prefix_ + site, hidden_dropout_, ctx.shape.StreamMap(dy.cols()), dy)
          : dy;
  if (bias != nullptr) {
    AccumulateGrad(k, *bias, false, [&](Tensor& g, double beta) { k.SumRows(dx, beta, g); });
  }
  return dx;
}

Tensor TransformerLayer::ForwardInner(const ModuleContext& ctx, const Tensor& x, Inner* in) const {
  const Tensor ln1 = input_norm_.Forward(ctx, x, &in->norm1);
  RecordStream(ctx, ".input_layernorm.output", ln1);
  const bool keep_core = recompute_ != RunConfig::Recompute::kSelective;
  const Tensor attn = attention_.Forward(ctx, ln1, keep_core, &in->attention);
  const Tensor x1 = BiasDropoutAdd(ctx, ".self_attn_bda", attn, attention_.proj_bias(), x);
  RecordStream(ctx, ".self_attn_bda.output", x1);
  const Tensor ln2 = pre_mlp_norm_.Forward(ctx, x1, &in->norm2);
  RecordStream(ctx, ".pre_mlp_layernorm.output", ln2);
  const Tensor mlp = mlp_ ? mlp_->Forward(ctx, ln2, &in->mlp) : moe_->Forward(ctx, ln2, &in->moe);
  const Tensor y = BiasDropoutAdd(ctx, ".mlp_bda", mlp, mlp_ ? mlp_->fc2_bias() : nullptr, x1);
  RecordStream(ctx, ".mlp_bda.output", y);
  return y;
}

Tensor TransformerLayer::Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const {
  stash->input = x;
  Inner inner;
  const Tensor y = ForwardInner(ctx, x, &inner);
  if (recompute_ != RunConfig::Recompute::kFull) stash->inner = std::move(inner);
  return y;
}

StashPlan TransformerLayer::PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                                      RunConfig::Recompute recompute, const StashPlan* moe) {
  const double Rs = static_cast<double>(shape.stream_rows());
  const double h = static_cast<double>(gpt.hidden_size);
  StashPlan plan;
  plan.Add("input", {Rs, h}, dtype);
  if (recompute == RunConfig::Recompute::kFull) return plan;  // Inner: rebuilt in backward
  // norm1.input is the layer's input; norm2.input is x1, kept here alone.
  plan.Add("inner.norm1", Norm::PlanStash(gpt.normalization, Rs, dtype));
  const bool keep_core = recompute != RunConfig::Recompute::kSelective;
  plan.Add("inner.attention", SelfAttention::PlanStash(gpt, shape, dtype, keep_core));
  plan.Add("inner.norm2.input", {Rs, h}, dtype);
  plan.Add("inner.norm2", Norm::PlanStash(gpt.normalization, Rs, dtype));
  if (moe != nullptr) {
    plan.Add("inner.moe", *moe);
  } else {
    plan.Add("inner.mlp", Mlp::PlanStash(gpt, shape, dtype));
  }
  return plan;
}

Tensor TransformerLayer::Backward(const ModuleContext& ctx, const Tensor& dy, Stash& stash) const {
  Kernels& k = ctx.k;
  if (!stash.inner) {
    // Full recomputation: the layer's forward again, recording nothing; its collectives
    // are real and stay in the trace.
    ModuleContext quiet = ctx;
    quiet.records = nullptr;
    std::optional<SpanRecorder> span;
    if (ctx.recompute_spans != nullptr) {
      span.emplace(*ctx.recompute_spans, ctx.chunk, ctx.draw.microbatch, true, true);
    }
    Inner inner;
    ForwardInner(quiet, stash.input, &inner);
    stash.inner = std::move(inner);
  }
  Inner& in = *stash.inner;
  RecordStream(ctx, ".mlp_bda.output_grad", dy);
  const Tensor dmlp =
      BiasDropoutAddBackward(ctx, ".mlp_bda", dy, mlp_ ? mlp_->fc2_bias() : nullptr);
  const Tensor dln2 = mlp_ ? mlp_->Backward(ctx, dmlp, in.mlp) : moe_->Backward(ctx, dmlp, in.moe);
  RecordStream(ctx, ".pre_mlp_layernorm.output_grad", dln2);
  // x1 feeds both the MLP branch and the residual.
  Tensor dx1 = pre_mlp_norm_.Backward(ctx, dln2, in.norm2);
  k.Axpy(1.0, dy, dx1);
  RecordStream(ctx, ".self_attn_bda.output_grad", dx1);
  const Tensor dattn = BiasDropoutAddBackward(ctx, ".self_attn_bda", dx1, attention_.proj_bias());
  const Tensor dln1 = attention_.Backward(ctx, dattn, in.attention);
  RecordStream(ctx, ".input_layernorm.output_grad", dln1);
  Tensor dx = input_norm_.Backward(ctx, dln1, in.norm1);
  k.Axpy(1.0, dx1, dx);
  stash.inner.reset();
  return dx;
}

}  // namespace mpusim
