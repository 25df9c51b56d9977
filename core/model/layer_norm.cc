// LayerNorm / RMSNorm (see layer_norm.h).
#include "core/model/layer_norm.h"

namespace mpusim {

Tensor Norm::Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const {
  Kernels& k = ctx.k;
  const DType stats = ComputeDType(x.dtype());
  stash->input = x;
  stash->rstd = k.Empty({x.rows()}, stats);
  Tensor y = k.Empty(x.shape(), x.dtype());
  if (kind_ == Normalization::kLayerNorm) {
    stash->mean = k.Empty({x.rows()}, stats);
    k.LayerNormForward(x, weight_->value, bias_->value, eps_, y, stash->mean, stash->rstd);
  } else {
    k.RMSNormForward(x, weight_->value, eps_, y, stash->rstd);
  }
  return y;
}

Tensor Norm::Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const {
  Kernels& k = ctx.k;
  Tensor dx = k.Empty(dy.shape(), dy.dtype());
  if (kind_ == Normalization::kLayerNorm) {
    k.LayerNormBackward(stash.input, weight_->value, stash.mean, stash.rstd, dy, dx, weight_->grad,
                        bias_->grad);
  } else {
    k.RMSNormBackward(stash.input, weight_->value, stash.rstd, dy, dx, weight_->grad);
  }
  return dx;
}

}  // namespace mpusim
