// Column- and row-parallel linear layers (see linear.h).
#include "core/model/linear.h"

#include "core/tensor_parallel/mappings.h"

namespace mpusim {

Tensor ColumnParallelLinear::Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const {
  Kernels& k = ctx.k;
  stash->input = x;
  const Tensor full = ctx.shape.sequence_parallel ? AllGatherFirstDim(k, ctx.tp, x) : x;
  const Tensor& w = weight_->value;
  Tensor y = k.Empty({full.rows(), w.rows()}, w.dtype());
  k.Gemm(false, true, 1.0, full, w, 0.0, y);  // [R, in] @ [out/t, in]^T
  if (bias_ != nullptr) k.AddRowVector(bias_->value, y);
  return y;
}

Tensor ColumnParallelLinear::Backward(const ModuleContext& ctx, const Tensor& dy,
                                      const Stash& stash) const {
  Kernels& k = ctx.k;
  const Tensor& w = weight_->value;
  Tensor dx = k.Empty({dy.rows(), w.cols()}, w.dtype());
  k.Gemm(false, false, 1.0, dy, w, 0.0, dx);  // [R, out/t] @ [out/t, in]
  const Tensor full =
      ctx.shape.sequence_parallel ? AllGatherFirstDim(k, ctx.tp, stash.input) : stash.input;
  AccumulateGrad(k, *weight_, ctx.fuse_wgrad,
                 [&](Tensor& g, double beta) { k.Gemm(true, false, 1.0, dy, full, beta, g); });
  if (bias_ != nullptr) {
    AccumulateGrad(k, *bias_, false, [&](Tensor& g, double beta) { k.SumRows(dy, beta, g); });
  }
  // The input mapping's backward: reduce-scatter under SP, else copy_to's all-reduce.
  return ctx.shape.sequence_parallel ? ReduceScatterFirstDim(k, ctx.tp, dx)
                                     : MappingBackward(k, ctx.tp, Mapping::kCopyToTp, dx);
}

Tensor RowParallelLinear::Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const {
  Kernels& k = ctx.k;
  stash->input = x;
  const Tensor& w = weight_->value;
  Tensor partial = k.Empty({x.rows(), w.rows()}, w.dtype());
  k.Gemm(false, true, 1.0, x, w, 0.0, partial);  // [R, in/t] @ [out, in/t]^T
  return ctx.shape.sequence_parallel ? ReduceScatterFirstDim(k, ctx.tp, partial)
                                     : MappingForward(k, ctx.tp, Mapping::kReduceFromTp, partial);
}

Tensor RowParallelLinear::Backward(const ModuleContext& ctx, const Tensor& dy,
                                   const Stash& stash) const {
  Kernels& k = ctx.k;
  const Tensor full = ctx.shape.sequence_parallel ? AllGatherFirstDim(k, ctx.tp, dy) : dy;
  const Tensor& w = weight_->value;
  Tensor dx = k.Empty({full.rows(), w.cols()}, w.dtype());
  k.Gemm(false, false, 1.0, full, w, 0.0, dx);  // [R, out] @ [out, in/t]
  AccumulateGrad(k, *weight_, ctx.fuse_wgrad, [&](Tensor& g, double beta) {
    k.Gemm(true, false, 1.0, full, stash.input, beta, g);
  });
  return dx;
}

}  // namespace mpusim
