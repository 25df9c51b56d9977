// The norms, each defined once: its JSON name and whether it is centered (VisitNorm), and the
// pointwise math that the CPU backend's row loop and the CUDA backend's row and column
// kernels both call (Kernels::NormForward / NormBackward), with the argument rules once in
// core/kernels.cc. The reductions over a row and over the rows
// stay backend code (Eigen's sums, a block tree per row on the GPU); the functors get their
// results as means (a row's sum divided by h).
//
// What they are, for a row x [h] with weight w [h] and, for a centered norm, bias b [h]
// (Megatron's normalization "LayerNorm" | "RMSNorm"; RMSNorm is LayerNorm with m = 0 and no
// bias, Zhang and Sennrich 2019):
//   forward   m = mean(x)                  (centered; otherwise m = 0)
//             r = 1 / sqrt(mean((x - m)^2) + eps)              NormRstd
//             xhat = (x - m) r                                 Normalize
//             y = xhat w + b                (uncentered y = xhat w)   NormOutput
//   backward  g = dy w                      (d loss / d xhat)  NormXhatGrad
//             dx = r (g - mean(g) - xhat mean(g xhat))          NormInputGrad
//                                          (uncentered mean(g) = 0)
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
//
// Adding a norm: its enum value (and the count), a struct below and a row in VisitNorm; then
// its float64 reference (reference/gpt_reference_ops.cc) and a row in the op test table
// (tests/ops/norm_ops.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/ops/element.h"  // MPUSIM_HD

namespace mpusim {

enum class Normalization : uint8_t { kLayerNorm, kRMSNorm };
inline constexpr int kNormalizationCount = 2;  // the values above

namespace ops {

// A norm is its name and whether it is centered: m = mean(x) is subtracted and a bias added
// (its statistics are mean and rstd), or m = 0 and no bias (rstd alone).
struct LayerNorm {
  static constexpr std::string_view kName = "LayerNorm";
  static constexpr bool kCentered = true;
};
struct RMSNorm {
  static constexpr std::string_view kName = "RMSNorm";
  static constexpr bool kCentered = false;
};

// Runs visitor.template operator()<Norm>() for `n`: the one place that maps a Normalization
// to its struct.
template <typename Visitor>
decltype(auto) VisitNorm(Normalization n, Visitor&& visitor) {
  switch (n) {
    case Normalization::kRMSNorm:
      return visitor.template operator()<RMSNorm>();
    case Normalization::kLayerNorm:
      break;
  }
  return visitor.template operator()<LayerNorm>();
}

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

// Visitors are structs, not template lambdas, so that the CUDA code (C++17) compiles them.
struct NormNameOf {
  template <typename N>
  std::string_view operator()() const {
    return N::kName;
  }
};
struct CenteredOf {
  template <typename N>
  bool operator()() const {
    return N::kCentered;
  }
};

}  // namespace ops

// The JSON name ("LayerNorm", "RMSNorm") and whether the norm is centered (has a mean and a
// bias).
inline std::string_view NormalizationName(Normalization n) {
  return ops::VisitNorm(n, ops::NormNameOf{});
}
inline bool IsCentered(Normalization n) { return ops::VisitNorm(n, ops::CenteredOf{}); }
// Every name, in enum order (a config's "normalization" is one of them).
inline const std::vector<std::string_view>& NormalizationNames() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> v;
    for (int i = 0; i < kNormalizationCount; ++i) {
      v.push_back(NormalizationName(static_cast<Normalization>(i)));
    }
    return v;
  }();
  return names;
}

}  // namespace mpusim
