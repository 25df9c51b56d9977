// Element-wise comparison of an actual tensor with an expected one: error statistics and a
// tolerance policy. Used by `mpusim run` (parallel result vs the float64 reference).
//
// An element passes when |a - e| <= atol + rtol * |e| (llm.c's t_eff rule) and is finite.
// Relative error is |a - e| / |e|, reported only where |e| > atol (elsewhere it is
// meaningless noise around zero).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/tensor.h"

namespace mpusim {

struct Tolerance {
  double atol;
  double rtol;
  // An absolute allowance proportional to the tensor's scale: an element passes when
  // |a - e| <= atol + ntol * max|e| + rtol * |e| (max over the whole expected tensor).
  // 0 for float32/float64; 16-bit storage needs it (see DefaultTolerance).
  double ntol = 0;
  // The tolerance for one tensor whose largest |expected| is `scale`, with ntol folded into
  // atol (what ErrorStats::Add applies).
  Tolerance ForScale(double scale) const { return {atol + ntol * scale, rtol, 0}; }
};

// Default tolerances per storage dtype of the run under test, against a float64 reference.
// float64: only summation order differs (GEMM blocking, reduction trees): ~1e-15 relative
// per operation, so 1e-9 leaves room for long reductions and cancellation.
// float32: unit roundoff 6e-8; a GEMM of inner size K accumulates ~sqrt(K)*6e-8 relative
// error and losses/gradients chain a few of them, so rtol 1e-4 with atol 1e-5 (activations
// and gradients here are O(1e-3 .. 1)) separates rounding from real bugs, which give O(1)
// relative errors.
// bfloat16 / float16 (unit roundoff u = 2^-8 / 2^-11): every stored activation and
// parameter carries up to u of relative error, and a GEMM output is a sum of rounded terms
// whose error is relative to the terms, not to the (possibly cancelling) sum. So the
// allowance is relative to the tensor's scale: ntol = 8u plus rtol = 8u, i.e. 3.1e-2 for
// bfloat16 and 3.9e-3 for float16. The largest errors measured on the sample labs are
// 1.1u..2.1u of max|e| (bench/precision_errors.py, README "Mixed precision"), so there is a
// 4x margin; a planted bug (copy_to's backward all-reduce skipped) gives 0.55..1.0 of
// max|e| in bfloat16, 18x above the bound.
inline Tolerance DefaultTolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return {1e-12, 1e-9, 0};
    case DType::kFloat32: return {1e-5, 1e-4, 0};
    case DType::kBFloat16: return {0, 0x1p-5, 0x1p-5};
    case DType::kFloat16: return {0, 0x1p-8, 0x1p-8};
  }
  return {0, 0, 0};
}

struct ErrorStats {
  int64_t count = 0;
  int64_t mismatches = 0;  // elements failing the tolerance (NaN/Inf included)
  int64_t non_finite = 0;
  double max_abs = 0;
  double max_rel = 0;
  int64_t worst_index = -1;  // flat index (full tensor) of the largest excess over tolerance
  double worst_actual = 0;
  double worst_expected = 0;
  double worst_excess = -std::numeric_limits<double>::infinity();

  void Add(int64_t index, double actual, double expected, const Tolerance& tol) {
    ++count;
    const double diff = std::fabs(actual - expected);
    const bool finite = std::isfinite(actual);
    if (!finite) ++non_finite;
    const double allowed = tol.atol + tol.rtol * std::fabs(expected);
    if (!finite || diff > allowed) ++mismatches;
    if (finite) {
      max_abs = std::fmax(max_abs, diff);
      if (std::fabs(expected) > tol.atol) max_rel = std::fmax(max_rel, diff / std::fabs(expected));
    }
    const double excess = finite ? diff - allowed : std::numeric_limits<double>::infinity();
    if (excess > worst_excess) {
      worst_excess = excess;
      worst_index = index;
      worst_actual = actual;
      worst_expected = expected;
    }
  }
  bool ok() const { return mismatches == 0; }
};

}  // namespace mpusim
