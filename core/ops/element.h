// What every op functor of core/ops does with an element: its compute type, its exact load,
// its one rounding store, and the math functions it calls on one element. A kernel computes in C = ComputeOf<T> (double for float64
// storage, float for float32, bfloat16 and float16; core/kernels.h), so the 16-bit dtypes
// round once, where the value is stored, on either backend.
#pragma once

#include <cmath>
#include <type_traits>

#include "core/half.h"    // ToFloat, FromFloat
#include "core/philox.h"  // MPUSIM_HD

namespace mpusim::ops {

template <typename T>
using ComputeOf = std::conditional_t<std::is_same_v<T, double>, double, float>;

MPUSIM_HD inline double Load(double v) { return v; }
MPUSIM_HD inline float Load(float v) { return v; }
MPUSIM_HD inline float Load(BFloat16 v) { return ToFloat(v); }
MPUSIM_HD inline float Load(Float16 v) { return ToFloat(v); }

template <typename S>
MPUSIM_HD inline S Store(ComputeOf<S> v) {
  if constexpr (std::is_same_v<S, ComputeOf<S>>) {
    return v;
  } else {
    return FromFloat<S>(v);
  }
}

// The math the functors are written in, for a value V of compute type C: here one element,
// with libm on the host and CUDA's math library on the device (both within an ulp or two;
// the backends may differ in the last bits). The CPU backend passes a math whose V is a
// block of elements and whose functions are Eigen's vectorised array functions
// (BlockMath, sim/eigen_views.h), so that one formula serves an element and a block.
struct ScalarMath {
  template <typename C>
  using Value = C;
  MPUSIM_HD static float Exp(float x) { return expf(x); }
  MPUSIM_HD static double Exp(double x) { return exp(x); }
  MPUSIM_HD static float Log(float x) { return logf(x); }
  MPUSIM_HD static double Log(double x) { return log(x); }
  MPUSIM_HD static float Erf(float x) { return erff(x); }
  MPUSIM_HD static double Erf(double x) { return erf(x); }
  // where ? a : b
  template <typename C>
  MPUSIM_HD static C Select(bool where, C a, C b) {
    return where ? a : b;
  }
};

}  // namespace mpusim::ops
