// The float64 reference's optimizer: trains the reference models (the GPT model and the layer
// chain) from the contract alone (core/config/optimizer_config.h for the learning rate and which
// parameters take weight decay).
//
// What it is: float64 copies of every parameter of the whole model, updated from the full
// gradients of an iteration (summed over every sample): the global gradient norm (each
// parameter once, the tied word embedding once), clipping to clip_grad, then AdamW or
// momentum SGD in float64, with the learning rate of the iteration. The states are float64
// too, with no rounding anywhere.
//
// Error bounds. A run's gradients carry rounding errors up to the check's gradient tolerance
// d_i = atol + ntol * max|g| + rtol * |g_i| (SetGradientTolerance); the trainer carries them
// through the updates to an absolute bound B_i on each parameter element, which the check
// adds to that element's allowance. SGD is linear: the momentum buffer's error is
// d + mu * (its previous error), and B grows by lr times it. Adam is not: an element whose
// exact gradient is 0 (the key bias: softmax ignores it) moves by lr * g / (sqrt(v) + eps)
// with g pure rounding noise, which eps turns into an O(lr) step in float32. The bound per
// step is lr * min(first-order error of m_hat / (sqrt(v_hat) + eps), 2 K_t), K_t the
// largest |update| Adam can make at step t ((1 - b1) / sqrt(1 - b2) * sum (b1/sqrt(b2))^j *
// sqrt(1 - b2^t) / (1 - b1^t), 1 at t = 1).
// Drift. From the second iteration on, a run's gradients are computed from parameters that
// already differ from the reference's, so each also carries the error those parameters pass
// on. The check measures that error only after the last step (the parameters' largest
// relative error summed over the parameters, times the safety factor: rho, run/check.h
// TrainingDrift) and, to first order, a gradient computed from parameters off by rho is off
// by rho times its scale (every product adds its factors' relative errors); clipping adds
// rho * |g_i| through its coefficient. Parameter errors only accumulate over the steps (an
// error in w reaches later updates only through that second-order gradient change), so the
// last rho bounds every earlier iteration's. The trainer therefore carries, per state element,
// the gains of rho alongside the rounding bounds: m's error grows by rho * G_m, v's by
// rho * G_v1 + rho^2 * G_v2 (d(g^2) = 2 g dg + dg^2), with G summed like m and v themselves
// over the iterations after the first (StateTensor::drift_gain, drift_gain2); the check adds
// them once rho is known (StateTensor::BoundsAt).
// Stored states. The executor rounds each state to its dtype after every step; float32 and
// float64 ones (the compute dtype) add nothing the bounds above count. The precision-aware
// optimizer's (optimizer.use_precision_aware_optimizer, SetPrecision) add, per step, to the
// bound of each stored element x of a tensor whose largest |x| is A:
//   bfloat16:  (u_bf16 + u_32) |x|     (the float64 value rounded to float32, then to bf16)
//   float16:   (u_16 + 4 u_32) |x| + 2^-25 s,  s = A (1 + u_32) / 32752
//              (stored scaled, core/optimizer_update.h ScaledFloat16: the float32 value,
//              its product with r = 1 / s and the rounding of r, each u_32; float16's
//              rounding, u_16 relative or half its subnormal spacing 2^-24 times s; the
//              read-back product q * s, u_32)
// m's and v's go into dm and dv, whence into the parameter's bound as the gradient's do; a
// float16 master's go into the parameter's bound directly, its initial scaling's too.
// What it is not: the executor's optimizer (core/train): it shares no code with it; its
// target cannot link executor code.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/config/optimizer_config.h"
#include "core/tensor.h"

namespace mpusim {

class ReferenceTrainer {
 public:
  ReferenceTrainer(const OptimizerConfig& config, int64_t train_iters);

  // Copies the initial parameters (full host float64 tensors, by name) at the first step; the
  // trainer then updates its copies, never the caller's tensors.
  bool has_parameters() const { return !parameters_.empty(); }
  void SetParameters(const std::map<std::string, Tensor>& parameters);
  // The current parameters, for the references' parameter overrides.
  const std::map<std::string, Tensor>& parameters() const { return parameters_; }

  // One step of 0-based iteration k with the full gradients `grads` (by parameter name,
  // float64 host, clipped in place). Parameters without a gradient (frozen) stay as they are.
  // Returns the gradient norm before clipping.
  double Step(std::map<std::string, Tensor*>& grads, int64_t k);
  double last_lr() const { return last_lr_; }
  // The dtypes the run stores the master weights and the states in (see "Stored states");
  // by default the compute dtype's, which add nothing.
  void SetPrecision(const OptimizerPrecision& precision) { precision_ = precision; }
  // The run's gradient tolerance (see above); 0 (the default) carries no error.
  void SetGradientTolerance(double atol, double ntol, double rtol) {
    atol_ = atol;
    ntol_ = ntol;
    rtol_ = rtol;
  }
  // Per parameter, per element (row-major): the absolute error bound B_i after the steps.
  const std::map<std::string, std::vector<double>>& error_bounds() const { return bounds_; }

  // The optimizer state after the steps, per parameter, row-major, with each element's error
  // bound (the propagated errors of m and v above), named as the executor records it:
  // "<parameter>.exp_avg" (m) and "<parameter>.exp_avg_sq" (v) for adam,
  // "<parameter>.momentum_buffer" for sgd.
  struct StateTensor {
    std::string name;
    std::string parameter;
    std::vector<double> values, bounds;
    // The error a drift rho of the parameters adds: rho * drift_gain + rho^2 * drift_gain2.
    std::vector<double> drift_gain, drift_gain2;
    // Each element's bound for a measured drift rho (>= 0).
    std::vector<double> BoundsAt(double rho) const;
  };
  std::vector<StateTensor> State() const;

 private:
  OptimizerConfig config_;
  int64_t train_iters_;
  OptimizerPrecision precision_{DType::kFloat64, DType::kFloat64, DType::kFloat64, DType::kFloat64,
                                false, false};
  std::map<std::string, Tensor> parameters_;
  std::map<std::string, std::vector<double>> m_, v_;
  // Error propagation: of m (or the SGD buffer), of v, and the bound on each element.
  std::map<std::string, std::vector<double>> dm_, dv_, bounds_;
  // The drift gains of m (or the SGD buffer) and of v (linear and quadratic); see above.
  std::map<std::string, std::vector<double>> gm_, gv1_, gv2_;
  double atol_ = 0, ntol_ = 0, rtol_ = 0;
  int64_t steps_ = 0;
  double last_lr_ = 0;
};

}  // namespace mpusim
