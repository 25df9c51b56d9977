// Megatron's ColumnParallelLinear and RowParallelLinear as modules over the residual stream,
// with Megatron-Core's sequence-parallel handling.
//
// Shape legend (module.h): stream rows R_l = s_l * b, full rows R = s * b; W_col [out/t, in]
// (Megatron's stride decides which rows), W_row [out, in/t].
//
//   ColumnParallelLinear   forward  x [R_l, in] --all-gather(SP) / identity--> [R, in]
//                                   y = x W_col^T (+ bias)                     [R, out/t]
//                          backward dx = dy W_col                               [R, in]
//                                   --reduce-scatter(SP) / all-reduce-->        [R_l, in]
//                                   dW += dy^T x  (under SP x is gathered again, as
//                                   Megatron-Core re-gathers the saved shard instead of
//                                   keeping the gathered input)
//   RowParallelLinear      forward  y = x W_row^T [R, out] partial sums
//                                   --reduce-scatter(SP) / all-reduce-->        [R_l, out]
//                                   the bias is not added (skip_bias_add: the caller's
//                                   bias-dropout-add adds it on the stream)
//                          backward dy --all-gather(SP) / identity--> [R, out]
//                                   dx = dy W_row, dW += dy^T x
#pragma once

#include "core/model/module.h"
#include "core/model/parameter.h"

namespace mpusim {

class ColumnParallelLinear {
 public:
  // `bias` may be null. A tied output layer passes the word embedding as `weight`.
  ColumnParallelLinear(Parameter* weight, Parameter* bias) : weight_(weight), bias_(bias) {}
  struct Stash {
    Tensor input;  // [R_l, in] as given (the sequence shard under SP)
  };
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const;

 private:
  Parameter* weight_;
  Parameter* bias_;
};

class RowParallelLinear {
 public:
  explicit RowParallelLinear(Parameter* weight) : weight_(weight) {}
  struct Stash {
    Tensor input;  // [R, in/t]
  };
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const;

 private:
  Parameter* weight_;
};

}  // namespace mpusim
