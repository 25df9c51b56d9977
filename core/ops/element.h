// What every op functor of core/ops does with an element: its compute type, its exact load
// and its one rounding store. A kernel computes in C = ComputeOf<T> (double for float64
// storage, float for float32, bfloat16 and float16; core/kernels.h), so the 16-bit dtypes
// round once, where the value is stored, on either backend.
#pragma once

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

}  // namespace mpusim::ops
