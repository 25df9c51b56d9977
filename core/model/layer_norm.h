// LayerNorm and RMSNorm over the residual stream (Megatron-Core's local-spec norms, with the
// `sequence_parallel` attribute on their parameters under sequence parallelism).
//
// Shape legend (module.h): x, y [R_l, h] stream rows; weight, bias [h] replicated.
//   LayerNorm  y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var + eps) (biased variance)
//   RMSNorm    y = x * rstd * w,               rstd = 1 / sqrt(mean(x^2) + eps)
// Backward accumulates dw (and db) straight into main_grad (the kernels' accumulator rule);
// under sequence parallelism each rank holds the sum over its rows only, and the tp
// all-reduce in core/train FinalizeModelGrads completes it.
#pragma once

#include "core/config/gpt_config.h"
#include "core/model/module.h"
#include "core/model/parameter.h"
#include "core/model/stash_plan.h"

namespace mpusim {

class Norm {
 public:
  // `bias` is null for a norm that is not centered (core/ops/norm.h).
  Norm(Normalization kind, double eps, Parameter* weight, Parameter* bias)
      : kind_(kind), eps_(eps), weight_(weight), bias_(bias) {}
  struct Stash {
    Tensor input;  // [R_l, h]
    Tensor mean;   // [R_l] compute dtype (a centered norm)
    Tensor rstd;   // [R_l] compute dtype
  };
  // The declared stash (stash_plan.h) of a norm over `rows` rows of `dtype` storage: mean (a
  // centered norm) and rstd. The input is the caller's tensor, counted where it is made.
  static StashPlan PlanStash(Normalization kind, double rows, DType dtype);
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const;

 private:
  Normalization kind_;
  double eps_;
  Parameter* weight_;
  Parameter* bias_;
};

}  // namespace mpusim
