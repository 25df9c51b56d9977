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
//                          gather_output: y --all-gather last dim--> [R, out]; dy split
//   RowParallelLinear      forward  y = x W_row^T [R, out] partial sums
//                                   --reduce-scatter(SP) / all-reduce-->        [R_l, out]
//                                   (+ bias, when one is given: the GPT passes none, its
//                                   bias-dropout-add adds fc2's and proj's bias on the stream)
//                          backward dy --all-gather(SP) / identity--> [R, out]
//                                   dx = dy W_row, dW += dy^T x, dbias += sum of dy's rows
//                          input_is_parallel false: x [R, in] is split to [R, in/t] first,
//                                   and dx all-gathered back
//
// A parameter without a main_grad (a frozen one: its `grad` is undefined) gets no gradient;
// the input gradient is computed all the same. The GPT model and the layer chain both build
// their linear layers from these two modules.
#pragma once

#include "core/model/module.h"
#include "core/model/parameter.h"

namespace mpusim {

class ColumnParallelLinear {
 public:
  // `bias` may be null. A tied output layer passes the word embedding as `weight`.
  // `gather_output` (Megatron's option; not under sequence parallelism) all-gathers the
  // output's columns.
  ColumnParallelLinear(Parameter* weight, Parameter* bias, bool gather_output = false)
      : weight_(weight), bias_(bias), gather_output_(gather_output) {}
  // Its input is the caller's tensor: the caller's declared stash counts it (stash_plan.h).
  struct Stash {
    Tensor input;  // [R_l, in] as given (the sequence shard under SP)
  };
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const;

 private:
  Parameter* weight_;
  Parameter* bias_;
  bool gather_output_;
};

class RowParallelLinear {
 public:
  // `bias` may be null (the GPT's: skip_bias_add). `input_is_parallel` false: the input
  // arrives whole and is split over the tp ranks first (Megatron's scatter_to).
  explicit RowParallelLinear(Parameter* weight, Parameter* bias = nullptr,
                             bool input_is_parallel = true)
      : weight_(weight), bias_(bias), input_is_parallel_(input_is_parallel) {}
  // Its input is the caller's tensor: the caller's declared stash counts it (stash_plan.h).
  struct Stash {
    Tensor input;  // [R, in/t]
  };
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const;

 private:
  Parameter* weight_;
  Parameter* bias_;
  bool input_is_parallel_;
};

}  // namespace mpusim
