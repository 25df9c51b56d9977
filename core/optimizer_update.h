// The optimizer's update of one element, the one definition that the CPU backend's loop and
// the GPU backend's kernel both call (Kernels::OptimizerStep), so that a training step gives
// the same bits on either.
//
// What it is: AdamW as Megatron's fused Adam computes it, and momentum SGD as torch.optim.SGD
// does (core/train/optimizer.h has the formulas and where clipping and the learning rate
// come from). Every operation is float64; the master weight and the states are rounded to
// the master dtype (float32, or float64 for a float64 run) after each update, as they are
// stored. The bias corrections 1 - beta^t are computed once per step on the host
// (std::pow), never per element.
// What it is not: the gradient clipping (a Scale of the gradient before the step).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/half.h"    // RoundTo
#include "core/philox.h"  // MPUSIM_HD

namespace mpusim {

struct OptimizerUpdate {
  enum class Kind : uint8_t { kAdam, kSgd };
  Kind kind = Kind::kAdam;
  double lr = 0;
  double weight_decay = 0;  // 0 for biases and 1-D parameters
  // adam
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta1^t, 1 - beta2^t
  // sgd
  double momentum = 0;
  bool first_step = true;  // the momentum buffer starts as the first step's direction
  // The master dtype: float64, else float32 (what the master and the states are rounded to).
  bool master_float64 = false;

  MPUSIM_HD double Round(double v) const {
    return master_float64 ? v : static_cast<double>(static_cast<float>(v));
  }

  // One element: g its (clipped) gradient, w its master weight, m and v the states (adam's
  // exp_avg and exp_avg_sq; sgd's momentum buffer and nothing).
  MPUSIM_HD void operator()(double g, double& w, double& m, double& v) const {
    if (kind == Kind::kAdam) {
      m = Round(beta1 * m + (1 - beta1) * g);
      v = Round(beta2 * v + (1 - beta2) * g * g);
      const double m_hat = m / bias_correction1;
      const double v_hat = v / bias_correction2;
      w -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w);
    } else {
      const double d = g + weight_decay * w;
      m = Round(first_step ? d : momentum * m + d);
      w -= lr * m;
    }
    w = Round(w);
  }

  // Element e of flat arrays, loads and stores included: the update above in float64, the
  // master and the states stored back in M (float or double, already rounded to it), the
  // parameter as the master rounded to its storage type P; state2 is null for sgd. The
  // CPU's loop and the CUDA kernel both run exactly this.
  template <typename G, typename M, typename P>
  MPUSIM_HD void Apply(const G* grad, M* master, M* state1, M* state2, P* param,
                       int64_t e) const {
    double w = master[e], m = state1[e], v = state2 != nullptr ? state2[e] : 0.0;
    (*this)(static_cast<double>(grad[e]), w, m, v);
    master[e] = static_cast<M>(w);
    state1[e] = static_cast<M>(m);
    if (state2 != nullptr) state2[e] = static_cast<M>(v);
    param[e] = RoundTo<P>(w);
  }
};

}  // namespace mpusim
