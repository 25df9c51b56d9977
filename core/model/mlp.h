// Megatron-Core's MLP: column-parallel fc1, GeLU or SwiGLU, row-parallel fc2.
//
// Shape legend (module.h; F = ffn_hidden_size):
//   fc1 out  [s*b, F/t] (gelu) or [s*b, 2F/t] (swiglu: this rank's gate columns, then its up
//            columns -- Megatron's stride-2 split of the [gate; up] weight)
//   act      [s*b, F/t]   gelu(fc1) (exact, erf) or silu(gate) * up
//   output   linear_fc2: [s_l*b, h] (bias left to the caller's bias-dropout-add)
#pragma once

#include <string>

#include "core/config/gpt_config.h"
#include "core/model/linear.h"
#include "core/model/stash_plan.h"

namespace mpusim {

class Mlp {
 public:
  // `prefix` is "decoder.layers.<i>.mlp".
  Mlp(const GptConfig& gpt, std::string prefix, ParameterSet& params);
  struct Stash {
    ColumnParallelLinear::Stash fc1_in;
    Tensor fc1_out;  // pre-activation
    RowParallelLinear::Stash fc2_in;
  };
  // The declared stash (stash_plan.h) on a rank of `shape`, in `dtype` storage.
  static StashPlan PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype);
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const;
  Parameter* fc2_bias() const { return fc2_bias_; }

 private:
  std::string prefix_;
  Activation activation_;
  GluOptions glu_;  // the gated activation's offset and clamp
  int64_t fc1_rows_;
  ColumnParallelLinear fc1_;
  RowParallelLinear fc2_;
  Parameter* fc2_bias_;
};

}  // namespace mpusim
