// The order of Kernels::TopK (core/kernels.h), shared by every backend so that the router
// picks the same experts on any of them: a higher score first, equal scores by the lower
// column, and NaN above every number (as torch.topk ranks it).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/philox.h"  // MPUSIM_HD

namespace mpusim::ops {

// Whether score a at column ia ranks before score b at column ib (a strict total order on
// distinct columns; a and b are widened from the stored dtype, exactly).
template <typename C>
MPUSIM_HD inline bool RanksBefore(C a, int64_t ia, C b, int64_t ib) {
  const bool nan_a = a != a, nan_b = b != b;
  if (nan_a != nan_b) return nan_a;
  if (!nan_a && a != b) return a > b;
  return ia < ib;
}

}  // namespace mpusim::ops
