// The optimizer's update of one element, the one definition that the CPU backend's loop and
// the GPU backend's kernel both call (Kernels::OptimizerStep), so that a training step gives
// the same bits on either.
//
// What it is: AdamW as Megatron's fused Adam computes it, and momentum SGD as torch.optim.SGD
// does (core/train/optimizer.h has the formulas and where clipping and the learning rate
// come from). Every operation is float64; the master weight and the states are rounded to
// the master dtype (float32, or float64 for a float64 run) after each update, and the update
// reads those rounded values, as Transformer Engine's FusedAdam holds them in float32
// registers (transformer_engine/common/multi_tensor/adam.cu, MATH_T = float). The bias
// corrections 1 - beta^t are computed once per step on the host (std::pow), never per
// element.
// The precision-aware optimizer (optimizer.use_precision_aware_optimizer) stores states in
// lower precision, as FusedAdam does:
//   a bfloat16 moment is read widened and stored as its float32 value rounded to nearest
//     (FusedAdam's fused path when both moments are bf16, `fuse_unscale`, and its
//     _apply_scale `unscaled.bfloat16()` otherwise: the same rounding);
//   a float16 state (moment or master weight) is stored scaled, one float32 scale s per
//     tensor (ScaledFloat16 below): the step reads q.float() * s into a float32 tensor,
//     updates that, then rescales it (FusedAdam.get_unscaled_state, _apply_scale);
//   with store_param_remainders (bf16 parameters, float32 master: OptimizerPrecision::
//     param_remainders) the float32 master is not stored: the bf16 parameter holds its high
//     16 bits, rounded, and a 16-bit remainder its low 16 (ParamRemainder below); the step
//     rebuilds the float32 master from both, updates it as above and splits it again
//     (ApplyWithRemainder).
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
  // store_param_remainders (OptimizerPrecision::param_remainders): the float32 master kept as
  // the bf16 parameter and a 16-bit remainder (ApplyWithRemainder).
  bool param_remainders = false;

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

  // Element e of flat arrays, loads and stores included: the gradient (main_grad, any float
  // type G) widened exactly, the update above in float64, the master stored back in M (float
  // or double, already rounded to it), each state in its own type (Moment), the parameter as
  // the master rounded to its storage type P; state2's data is null for sgd. The CPU's loop
  // and the CUDA kernel both run exactly this.
  template <typename M>
  struct Moment {
    void* data = nullptr;   // M[], or BFloat16[] when `bfloat16`
    bool bfloat16 = false;  // only with a float32 master (the precision-aware optimizer)
    MPUSIM_HD double Load(int64_t e) const {
      return bfloat16 ? Widen(static_cast<const BFloat16*>(data)[e])
                      : static_cast<double>(static_cast<const M*>(data)[e]);
    }
    // v is already rounded to M: bfloat16 rounds that float32 value once more, to nearest.
    MPUSIM_HD void Store(int64_t e, double v) const {
      if (bfloat16) {
        static_cast<BFloat16*>(data)[e] = RoundTo<BFloat16>(v);
      } else {
        static_cast<M*>(data)[e] = static_cast<M>(v);
      }
    }
  };
  template <typename G, typename M, typename P>
  MPUSIM_HD void Apply(const G* grad, M* master, Moment<M> state1, Moment<M> state2, P* param,
                       int64_t e) const {
    double w = master[e];
    Update(Widen(grad[e]), w, state1, state2, e);
    master[e] = static_cast<M>(w);
    param[e] = RoundTo<P>(w);
  }
  // The same with store_param_remainders (float32 master; ParamRemainder below): the master
  // read from the bf16 parameter and the remainder, both written back from the updated one.
  // `remainder` is a 2-byte tensor's storage whose bits are the int16 remainder.
  template <typename G>
  MPUSIM_HD void ApplyWithRemainder(const G* grad, BFloat16* remainder, Moment<float> state1,
                                    Moment<float> state2, BFloat16* param, int64_t e) const;

 private:
  // The states' loads, the update and the states' stores.
  template <typename M>
  MPUSIM_HD void Update(double g, double& w, Moment<M> state1, Moment<M> state2, int64_t e) const {
    double m = state1.Load(e);
    double v = state2.data != nullptr ? state2.Load(e) : 0.0;
    (*this)(g, w, m, v);
    state1.Store(e, m);
    if (state2.data != nullptr) state2.Store(e, v);
  }
};

// Transformer Engine's store_param_remainders (transformer_engine/common/multi_tensor/adam.cu
// AdamFunctorMasterParamRemainder; fused_adam.py keeps it for bf16 parameters with a float32
// master): a float32 master of bits (h << 16) | r is stored as the bf16 parameter's bits p
// and the int16 remainder r, where p is h rounded to nearest in magnitude, ties away from
// zero: p = h + 1 when r < 0 as an int16 (bit 15 of the low half set: at least half a bf16
// ulp), else h. Join undoes that (h = p - 1 when r < 0) and gives the master exactly;
// Split is its inverse. The parameter thus differs from round-to-nearest-even only at ties
// (r = 0x8000 with h even: RNE keeps h). A remainder of 0 joins to the parameter widened,
// the initial master (fused_adam.py _initialize_state: torch.zeros_like(param, int16)).
// Bits are integers here (an int16's bits in uint16_t), so h - 1 and h + 1 wrap as TE's
// int16 arithmetic does.
struct ParamRemainder {
  MPUSIM_HD static bool RoundedUp(uint16_t remainder) { return (remainder & 0x8000u) != 0; }
  MPUSIM_HD static float Join(BFloat16 param, BFloat16 remainder) {
    const uint16_t high = static_cast<uint16_t>(param.bits - (RoundedUp(remainder.bits) ? 1u : 0u));
    return BitsFloat((static_cast<uint32_t>(high) << 16) | remainder.bits);
  }
  MPUSIM_HD static void Split(float master, BFloat16& param, BFloat16& remainder) {
    const uint32_t bits = FloatBits(master);
    remainder.bits = static_cast<uint16_t>(bits & 0xffffu);
    param.bits = static_cast<uint16_t>((bits >> 16) + (RoundedUp(remainder.bits) ? 1u : 0u));
  }
};

template <typename G>
MPUSIM_HD void OptimizerUpdate::ApplyWithRemainder(const G* grad, BFloat16* remainder,
                                                   Moment<float> state1, Moment<float> state2,
                                                   BFloat16* param, int64_t e) const {
  double w = ParamRemainder::Join(param[e], remainder[e]);
  Update(Widen(grad[e]), w, state1, state2, e);
  ParamRemainder::Split(static_cast<float>(w), param[e], remainder[e]);
}

// A float16 optimizer state as Transformer Engine's FusedAdam stores it (fused_adam.py, for
// exp_avg, exp_avg_sq and master_param of dtype torch.float16): q = fp16(x * (1 / s)) with
// one float32 scale s per tensor, s = absmax(x) / (65504 / 2) (`dtype_to_range_map`: half
// of float16's largest value), so that the tensor's largest element lands on 32752. Every
// operation is float32, as torch performs it on the float32 tensors: x = q.float() * s
// (get_unscaled_state), s = absmax / 32752 (torch.div), r = 1 / s or 0 when s is 0
// (`torch.where(scale > 0, scale.reciprocal(), 0.0)`), then x * r rounded to float16.
struct ScaledFloat16 {
  static constexpr float kRange = 65504.0f / 2.0f;
  MPUSIM_HD static float Unscale(Float16 q, float scale) { return ToFloat(q) * scale; }
  MPUSIM_HD static float ScaleOf(float absmax) { return absmax / kRange; }
  MPUSIM_HD static float ReciprocalOf(float scale) { return scale > 0 ? 1.0f / scale : 0.0f; }
  MPUSIM_HD static Float16 Quantize(float x, float reciprocal) { return ToFloat16(x * reciprocal); }
};

}  // namespace mpusim
