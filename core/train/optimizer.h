// The optimizer step of a training iteration: Megatron's gradient clipping by the global
// norm, then AdamW or momentum SGD with the iteration's learning rate (core/optimizer_config.h).
//
// Gradient norm (Megatron's get_grad_norm_fp32): sqrt of the sum of squares of every
// parameter's main_grad, counting each parameter once: a replicated parameter (not split over
// tp) only on tp rank 0 (param_is_not_tensor_parallel_duplicate), and the tied word
// embedding only on the first stage (the last stage's copy is `shared`); the sum is
// all-reduced over tp and pp (the model-parallel group). Every dp rank holds the same
// finalized gradients, so it computes the same norm. With clip_grad > 0 and
// c = clip_grad / (norm + 1e-6) < 1, every gradient is scaled by c.
//
// Update of parameter w with gradient g at step t (1-based), learning rate lr, weight decay
// wd (0 for biases and 1-D parameters):
//   adam (AdamW, as Megatron's fused Adam):  m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2,
//        w -= lr * ((m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd w)
//   sgd (torch.optim.SGD with momentum mu):  d = g + wd w,  buf = d at t = 1, else mu buf + d,
//        w -= lr * buf
// Master weights and states: the math runs in float64 on the host; the master weights and
// the states are kept in the run's compute dtype (float32, float64 for a float64 run), as
// Megatron keeps float32 main params; the parameter's storage gets the master rounded to it.
// What it is not: the distributed optimizer (states sharded over dp), or a device kernel:
// each step copies gradients and weights to the host and back.
#pragma once

#include <cstdint>
#include <vector>

#include "core/communicator.h"
#include "core/kernels.h"
#include "core/model/parameter.h"
#include "core/optimizer_config.h"

namespace mpusim {

class Optimizer {
 public:
  Optimizer(const OptimizerConfig& config, ParameterSet& params, Kernels& k);

  // The global gradient norm over tp and pp (see above), before clipping.
  double GradNorm(Kernels& k, Communicator& tp, Communicator* pp, int64_t tp_rank,
                  CommTrace& trace) const;
  // Clips to clip_grad (when set) given the norm, then updates every parameter with `lr`.
  void Step(Kernels& k, double grad_norm, double lr);
  int64_t steps() const { return steps_; }

 private:
  struct State {
    Parameter* param = nullptr;
    double weight_decay = 0;
    std::vector<double> master, m, v;  // float64 host copies of the compute-dtype values
  };
  OptimizerConfig config_;
  DType master_dtype_;
  std::vector<State> states_;
  int64_t steps_ = 0;
};

}  // namespace mpusim
