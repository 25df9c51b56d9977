// The norms' pointwise math, each part defined once: the host/device functors that the CPU
// backend's row loop and the CUDA backend's row and column kernels both call
// (Kernels::LayerNormForward / LayerNormBackward / RMSNormForward / RMSNormBackward), with
// the argument rules once in core/kernels.cc. The reductions over a row and over the rows
// stay backend code (Eigen's sums, a block tree per row on the GPU); the functors get their
// results as means (a row's sum divided by h).
//
// What they are, for a row x [h] with weight w [h] and, for LayerNorm, bias b [h]
// (Megatron's normalization "LayerNorm" | "RMSNorm"; RMSNorm is LayerNorm with m = 0 and no
// bias, Zhang and Sennrich 2019):
//   forward   m = mean(x)                  (LayerNorm; RMSNorm m = 0)
//             r = 1 / sqrt(mean((x - m)^2) + eps)              NormRstd
//             xhat = (x - m) r                                 Normalize
//             y = xhat w + b                (RMSNorm y = xhat w)   NormOutput
//   backward  g = dy w                      (d loss / d xhat)  NormXhatGrad
//             dx = r (g - mean(g) - xhat mean(g xhat))          NormInputGrad
//                                          (RMSNorm mean(g) = 0)
//             dw += sum over rows of dy xhat                    NormWeightGrad
//             db += sum over rows of dy                         NormBiasGrad
// The backward takes m and r as the forward stored them (it does not recompute them).
//
// Arithmetic is in the compute type C (float for float32, bfloat16 and float16 storage;
// double for float64; core/ops/element.h), each formula in the order written above, so
// that the CPU's and the GPU's elements round alike (the .cu is built with --fmad=false).
// Each functor is a template on its value X: one element of type C on either backend, or
// a row of elements on the CPU (an Eigen array expression: the formula then builds the
// expression, evaluated where the backend assigns it, element by element in the same
// order); mean and rstd are always scalars of C.
#pragma once

#include <cmath>

#include "core/ops/element.h"  // MPUSIM_HD

namespace mpusim::ops {

// r = 1 / sqrt(var + eps), var = mean((x - m)^2) over the row; one correctly rounded sqrt
// (libm on the host, CUDA's IEEE sqrt on the device: the same bits).
MPUSIM_HD inline float NormRstd(float var, float eps) { return 1.0f / sqrtf(var + eps); }
MPUSIM_HD inline double NormRstd(double var, double eps) { return 1.0 / sqrt(var + eps); }

// xhat = (x - m) r.
template <typename X, typename C>
MPUSIM_HD auto Normalize(const X& x, C mean, C rstd) {
  return (x - mean) * rstd;
}

// y = xhat w + b (LayerNorm), y = xhat w (RMSNorm).
template <typename X, typename W>
MPUSIM_HD auto NormOutput(const X& xhat, const W& weight, const W& bias) {
  return xhat * weight + bias;
}
template <typename X, typename W>
MPUSIM_HD auto NormOutput(const X& xhat, const W& weight) {
  return xhat * weight;
}

// g = dy w, the gradient of xhat.
template <typename X, typename W>
MPUSIM_HD auto NormXhatGrad(const X& dy, const W& weight) {
  return dy * weight;
}

// dx = r (g - mean(g) - xhat mean(g xhat)); mean_g = 0 for RMSNorm.
template <typename X, typename Y, typename C>
MPUSIM_HD auto NormInputGrad(const X& g, const Y& xhat, C rstd, C mean_g, C mean_gx) {
  return rstd * (g - mean_g - xhat * mean_gx);
}

// One row's terms of dweight and dbias: dy xhat and dy.
template <typename X, typename Y>
MPUSIM_HD auto NormWeightGrad(const X& dy, const Y& xhat) {
  return dy * xhat;
}
template <typename X>
MPUSIM_HD X NormBiasGrad(const X& dy) {
  return dy;
}

}  // namespace mpusim::ops
