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
  return gather_output_ ? AllGatherLastDim(k, ctx.tp, y) : y;
}

Tensor ColumnParallelLinear::Backward(const ModuleContext& ctx, const Tensor& dy,
                                      const Stash& stash) const {
  Kernels& k = ctx.k;
  const Tensor d_local = gather_output_ ? SplitLastDim(k, ctx.tp, dy) : dy;
  const Tensor& w = weight_->value;
  Tensor dx = k.Empty({d_local.rows(), w.cols()}, w.dtype());
  k.Gemm(false, false, 1.0, d_local, w, 0.0, dx);  // [R, out/t] @ [out/t, in]
  if (weight_->grad.defined()) {
    const Tensor full =
        ctx.shape.sequence_parallel ? AllGatherFirstDim(k, ctx.tp, stash.input) : stash.input;
    AccumulateGrad(k, *weight_, ctx.fuse_wgrad, [&](Tensor& g, double beta) {
      k.Gemm(true, false, 1.0, d_local, full, beta, g);
    });
  }
  if (bias_ != nullptr && bias_->grad.defined()) {
    AccumulateGrad(k, *bias_, false, [&](Tensor& g, double beta) { k.SumRows(d_local, beta, g); });
  }
  // The input mapping's backward: reduce-scatter under SP, else copy_to's all-reduce.
  return ctx.shape.sequence_parallel ? ReduceScatterFirstDim(k, ctx.tp, dx)
                                     : MappingBackward(k, ctx.tp, Mapping::kCopyToTp, dx);
}

Tensor RowParallelLinear::Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const {
  Kernels& k = ctx.k;
  stash->input = input_is_parallel_ ? x : SplitLastDim(k, ctx.tp, x);
  const Tensor& w = weight_->value;
  Tensor partial = k.Empty({stash->input.rows(), w.rows()}, w.dtype());
  k.Gemm(false, true, 1.0, stash->input, w, 0.0, partial);  // [R, in/t] @ [out, in/t]^T
  Tensor y = ctx.shape.sequence_parallel
                 ? ReduceScatterFirstDim(k, ctx.tp, partial)
                 : MappingForward(k, ctx.tp, Mapping::kReduceFromTp, partial);
  if (bias_ != nullptr) k.AddRowVector(bias_->value, y);
  return y;
}

Tensor RowParallelLinear::Backward(const ModuleContext& ctx, const Tensor& dy,
                                   const Stash& stash) const {
  Kernels& k = ctx.k;
  const Tensor full = ctx.shape.sequence_parallel ? AllGatherFirstDim(k, ctx.tp, dy) : dy;
  const Tensor& w = weight_->value;
  Tensor dx = k.Empty({full.rows(), w.cols()}, w.dtype());
  k.Gemm(false, false, 1.0, full, w, 0.0, dx);  // [R, out] @ [out, in/t]
  if (weight_->grad.defined()) {
    AccumulateGrad(k, *weight_, ctx.fuse_wgrad, [&](Tensor& g, double beta) {
      k.Gemm(true, false, 1.0, full, stash.input, beta, g);
    });
  }
  // The bias is added after the reduction: each rank's rows (its sequence shard under SP)
  // give its part of the bias gradient, summed over tp with the sequence-parallel parameters.
  if (bias_ != nullptr && bias_->grad.defined()) {
    AccumulateGrad(k, *bias_, false, [&](Tensor& g, double beta) { k.SumRows(dy, beta, g); });
  }
  return input_is_parallel_ ? dx : AllGatherLastDim(k, ctx.tp, dx);
}

}  // namespace mpusim
