// The norms of the residual stream (see layer_norm.h).
#include "core/model/layer_norm.h"

namespace mpusim {

Tensor Norm::Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const {
  Kernels& k = ctx.k;
  const DType stats = ComputeDType(x.dtype());
  stash->input = x;
  stash->rstd = k.Empty({x.rows()}, stats);
  Tensor y = k.Empty(x.shape(), x.dtype());
  const bool centered = IsCentered(kind_);
  if (centered) stash->mean = k.Empty({x.rows()}, stats);
  k.NormForward(kind_, x, weight_->value, centered ? &bias_->value : nullptr, eps_, y,
                centered ? &stash->mean : nullptr, stash->rstd);
  return y;
}

StashPlan Norm::PlanStash(Normalization kind, double rows, DType dtype) {
  StashPlan plan;
  if (IsCentered(kind)) plan.Add("mean", {rows}, ComputeDType(dtype));
  plan.Add("rstd", {rows}, ComputeDType(dtype));
  return plan;
}

Tensor Norm::Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const {
  Kernels& k = ctx.k;
  Tensor dx = k.Empty(dy.shape(), dy.dtype());
  const bool centered = IsCentered(kind_);
  k.NormBackward(kind_, stash.input, weight_->value, centered ? &stash.mean : nullptr,
                 stash.rstd, dy, dx, weight_->grad, centered ? &bias_->grad : nullptr);
  return dx;
}

}  // namespace mpusim
