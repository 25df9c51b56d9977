// MLP (see mlp.h).
#include "core/model/mlp.h"

namespace mpusim {

Mlp::Mlp(const GptConfig& gpt, std::string prefix, ParameterSet& params)
    : prefix_(std::move(prefix)),
      activation_(gpt.activation),
      fc1_rows_(gpt.Fc1Rows()),
      fc1_(&params.Get(prefix_ + ".linear_fc1.weight"), params.Find(prefix_ + ".linear_fc1.bias")),
      fc2_(&params.Get(prefix_ + ".linear_fc2.weight")),
      fc2_bias_(params.Find(prefix_ + ".linear_fc2.bias")) {}

Tensor Mlp::Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t stride = activation_ == Activation::kSwiglu ? 2 : 1;
  stash->fc1_out = fc1_.Forward(ctx, x, &stash->fc1_in);
  ctx.Record(prefix_ + ".linear_fc1.output", stash->fc1_out, {sh.s, sh.B, fc1_rows_},
             sh.ColumnSpec(ctx.dp_size, stride));
  const Tensor& h = stash->fc1_out;
  Tensor act;
  if (activation_ == Activation::kSwiglu) {
    act = k.Empty({h.rows(), h.cols() / 2}, h.dtype());
    k.SwigluForward(h, act);
  } else {
    act = k.Empty(h.shape(), h.dtype());
    k.GeluForward(h, act);
  }
  const Tensor out = fc2_.Forward(ctx, act, &stash->fc2_in);
  ctx.Record(prefix_ + ".linear_fc2.output", out, {sh.s, sh.B, out.cols()},
             sh.StreamSpec(ctx.dp_size));
  return out;
}

Tensor Mlp::Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  ctx.Record(prefix_ + ".linear_fc2.output_grad", dy, {sh.s, sh.B, dy.cols()},
             sh.StreamSpec(ctx.dp_size));
  const Tensor dact = fc2_.Backward(ctx, dy, stash.fc2_in);
  const Tensor& h = stash.fc1_out;
  Tensor dh = k.Empty(h.shape(), h.dtype());
  if (activation_ == Activation::kSwiglu) {
    k.SwigluBackward(h, dact, dh);
  } else {
    k.GeluBackward(h, dact, dh);
  }
  ctx.Record(prefix_ + ".linear_fc1.output_grad", dh, {sh.s, sh.B, fc1_rows_},
             sh.ColumnSpec(ctx.dp_size, activation_ == Activation::kSwiglu ? 2 : 1));
  return fc1_.Backward(ctx, dh, stash.fc1_in);
}

}  // namespace mpusim
