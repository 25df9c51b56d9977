// Kernels::TopK's order and selection, defined once and shared by every backend so that the
// router picks the same experts on any of them: a higher score first, equal scores by the
// lower column, and NaN above every number (as torch.topk ranks it). The CPU backend's row
// loop and the CUDA backend's kernel (one thread per row) both run TopKRow; the argument
// rules are once in core/kernels.cc.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/ops/element.h"  // Load, MPUSIM_HD

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

// The first k (1 <= k <= n) of a row's n scores in RanksBefore's order: values[j] the stored
// element (its bits) and indices[j] its column. Pass j picks the best column that ranks
// after pass j - 1's pick; the order is strict and total, so k passes give the first k
// columns in order (any correct selection gives the same result).
template <typename T>
MPUSIM_HD void TopKRow(const T* row, int64_t n, int64_t k, T* values, int64_t* indices) {
  int64_t prev = -1;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t c = 0; c < n; ++c) {
      const auto sc = Load(row[c]);
      // c must rank after the previous pick, and before the best so far.
      if (prev >= 0 && !RanksBefore(Load(row[prev]), prev, sc, c)) continue;
      if (best < 0 || RanksBefore(sc, c, Load(row[best]), best)) best = c;
    }
    indices[j] = best;
    values[j] = row[best];
    prev = best;
  }
}

}  // namespace mpusim::ops
