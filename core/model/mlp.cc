// MLP (see mlp.h).
#include "core/model/mlp.h"

namespace mpusim {

Mlp::Mlp(const GptConfig& gpt, std::string prefix, ParameterSet& params)
    : prefix_(std::move(prefix)),
      activation_(gpt.activation),
      glu_(gpt.Glu()),
      fc1_rows_(gpt.Fc1Rows()),
      fc1_(&params.Get(prefix_ + ".linear_fc1.weight"), params.Find(prefix_ + ".linear_fc1.bias")),
      fc2_(&params.Get(prefix_ + ".linear_fc2.weight")),
      fc2_bias_(params.Find(prefix_ + ".linear_fc2.bias")) {}

Tensor Mlp::Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t stride = IsGated(activation_) ? 2 : 1;
  stash->fc1_out = fc1_.Forward(ctx, x, &stash->fc1_in);
  ctx.Record(prefix_ + ".linear_fc1.output", stash->fc1_out, {sh.s, sh.B, fc1_rows_},
             sh.ColumnSpec(ctx.dp_size, stride));
  const Tensor& h = stash->fc1_out;
  Tensor act = k.Empty({h.rows(), IsGated(activation_) ? h.cols() / 2 : h.cols()}, h.dtype());
  k.ActivationForward(activation_, h, act, glu_);
  const Tensor out = fc2_.Forward(ctx, act, &stash->fc2_in);
  ctx.Record(prefix_ + ".linear_fc2.output", out, {sh.s, sh.B, out.cols()},
             sh.StreamSpec(ctx.dp_size));
  return out;
}

StashPlan Mlp::PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  const double R = d(shape.s_cp() * shape.b), t = d(shape.t);
  StashPlan plan;
  plan.Add("fc1_in.input", {d(shape.stream_rows()), d(gpt.hidden_size)}, dtype);  // the norm's
  plan.Add("fc1_out", {R, d(gpt.Fc1Rows()) / t}, dtype);
  plan.Add("fc2_in.input", {R, d(gpt.ffn_hidden_size) / t}, dtype);  // the activation
  return plan;
}

Tensor Mlp::Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  ctx.Record(prefix_ + ".linear_fc2.output_grad", dy, {sh.s, sh.B, dy.cols()},
             sh.StreamSpec(ctx.dp_size));
  const Tensor dact = fc2_.Backward(ctx, dy, stash.fc2_in);
  const Tensor& h = stash.fc1_out;
  Tensor dh = k.Empty(h.shape(), h.dtype());
  k.ActivationBackward(activation_, h, dact, dh, glu_);
  ctx.Record(prefix_ + ".linear_fc1.output_grad", dh, {sh.s, sh.B, fc1_rows_},
             sh.ColumnSpec(ctx.dp_size, IsGated(activation_) ? 2 : 1));
  return fc1_.Backward(ctx, dh, stash.fc1_in);
}

}  // namespace mpusim
