// Element-wise comparison of an actual tensor with an expected one: error statistics and a
// tolerance policy.
//
// An element passes when it is finite and |a - e| <= atol + ntol * max|e| + rtol * |e|
// (max over the whole expected tensor). Relative error |a - e| / |e| is reported only where
// |e| exceeds the absolute allowance (elsewhere it is noise around zero).
//
// Two policies use it:
//   `mpusim run` checks every tensor against the float64 reference with a tolerance that
//     grows with the work that produced the tensor (ErrorBudget, ToleranceFor below);
//   `mpusim diff` compares two dumps, which carry no budgets, with a fixed tolerance per
//     dtype (DefaultTolerance).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/tensor.h"

namespace mpusim {

struct Tolerance {
  double atol;
  double rtol;
  // The allowance proportional to the tensor's scale max|e|.
  double ntol = 0;
  // The tolerance for one tensor whose largest |expected| is `scale`, with ntol folded into
  // atol (what ErrorStats::Add applies).
  Tolerance ForScale(double scale) const { return {atol + ntol * scale, rtol, 0}; }
};

// ---- the run's tolerance model ------------------------------------------------------------
//
// How far a correct implementation may land from the exact (float64) value depends on how
// much rounding went into the tensor. The reference counts it per tensor from the ops that
// produce it, their inputs included (docs/simulator.md, "Tolerances"):
//   roundings  values stored in the storage dtype, and inexact elementwise functions (exp,
//              erf, log), on the tensor's path: each adds a relative error up to u_storage
//              (u_compute for functions evaluated in the compute dtype; counted the same);
//   terms      summands of the sums on the path: the inner dimension of every GEMM, the rows
//              of every row sum, the tokens a weight gradient sums over (all micro-batches and
//              data-parallel ranks), the ranks of every all-reduce. A float sum of n terms
//              carries rounding error ~ u_compute * sqrt(n) relative to the scale of its
//              result: each partial sum is rounded once and, with round-to-nearest, those
//              errors behave like independent zero-mean variables that add in quadrature
//              (the probabilistic analysis of Higham and Mary, SIAM J. Sci. Comput. 2019:
//              sqrt(n) u instead of the worst case n u).
// Independent sources add in quadrature too, so a tensor's predicted relative error is
//   sigma = sqrt(roundings * u_storage^2 + terms * u_compute^2)
// relative to the tensor's scale max|e|; errors of upstream tensors propagate through
// GEMMs, sums and smooth elementwise functions with O(1) gain, which is why the counts of a
// tensor's inputs are added to its own. The check allows
//   |a - e| <= lambda * sigma * (max|e| + |e|),   lambda = kToleranceSafety,
// which grows with the reduction length (sqrt(n)), so it holds for a 2048-token weight
// gradient as for an 8-token one, while a real bug (a skipped all-reduce, a wrong shard)
// gives errors of the order of max|e| itself. lambda is calibrated, not derived: on every
// sample and benchmark config, in every dtype, the largest error is 0.10 of its allowance,
// i.e. 0.8 sigma (bench/tolerance_margins.py; README "Checks and tolerances").
struct ErrorBudget {
  double roundings = 0;
  double terms = 0;

  ErrorBudget& operator+=(const ErrorBudget& other) {
    roundings += other.roundings;
    terms += other.terms;
    return *this;
  }
  friend ErrorBudget operator+(ErrorBudget a, const ErrorBudget& b) { return a += b; }
};

// Unit roundoff u = 2^-p of round-to-nearest with a p-bit significand (implicit bit included).
inline double UnitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return 0x1p-53;
    case DType::kFloat32: return 0x1p-24;
    case DType::kBFloat16: return 0x1p-8;
    case DType::kFloat16: return 0x1p-11;
    case DType::kInt64: RequireFloat(dtype, "UnitRoundoff"); break;  // ids are not rounded
  }
  return 1.0;
}

inline constexpr double kToleranceSafety = 8.0;

// lambda * sigma for a tensor with `budget` in a run that stores in `storage` (arithmetic in
// ComputeDType(storage)).
inline double PredictedError(const ErrorBudget& budget, DType storage) {
  const double us = UnitRoundoff(storage);
  const double uc = UnitRoundoff(ComputeDType(storage));
  return kToleranceSafety * std::sqrt(budget.roundings * us * us + budget.terms * uc * uc);
}

// float16's smallest exponent is -14: below 2^-14 its values are subnormal, spaced 2^-24
// apart, so rounding one carries up to 2^-25 of absolute error whatever its size (gradients
// of small losses live there). Added in quadrature over the budget's roundings, as the
// relative errors are; bfloat16 and float32 have float32's range, where this is nil.
inline double UnderflowError(const ErrorBudget& budget, DType storage) {
  if (storage != DType::kFloat16) return 0.0;
  return kToleranceSafety * std::sqrt(budget.roundings) * 0x1p-25;
}

inline Tolerance ToleranceFor(const ErrorBudget& budget, DType storage) {
  const double eps = PredictedError(budget, storage);
  return {UnderflowError(budget, storage), eps, eps};
}

// ---- the diff's fixed tolerances ----------------------------------------------------------
//
// Default tolerances per storage dtype for comparing two dumps, which carry no budgets.
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
// bfloat16 and 3.9e-3 for float16.
inline Tolerance DefaultTolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return {1e-12, 1e-9, 0};
    case DType::kFloat32: return {1e-5, 1e-4, 0};
    case DType::kBFloat16: return {0, 0x1p-5, 0x1p-5};
    case DType::kFloat16: return {0, 0x1p-8, 0x1p-8};
    case DType::kInt64: RequireFloat(dtype, "DefaultTolerance"); break;  // dumps hold floats
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
  // The largest share of its own allowance an element's error uses (pass: <= 1; infinite for
  // a non-finite value or an error where nothing is allowed).
  double max_used = 0;

  // Runs once per compared element, so it stays branch-light (no libm fmax, no division unless
  // the relative maximum grows).
  void Add(int64_t index, double actual, double expected, const Tolerance& tol) {
    AddAt([index] { return index; }, actual, expected, tol);
  }
  // Add, the element's flat index given by index_of(), called only when the element becomes
  // the worst (where an element sits in the full tensor can cost more than comparing it).
  template <typename IndexOf>
  void AddAt(IndexOf&& index_of, double actual, double expected, const Tolerance& tol) {
    ++count;
    const double diff = std::fabs(actual - expected);
    const double magnitude = std::fabs(expected);
    const double allowed = tol.atol + tol.rtol * magnitude;
    const bool finite = std::isfinite(actual);
    // !(diff <= allowed) also fails a NaN on either side.
    if (!finite || !(diff <= allowed)) {
      ++mismatches;
      if (!finite) ++non_finite;
    }
    if (finite) {
      if (diff > max_used * allowed) {
        max_used = allowed > 0 ? diff / allowed : std::numeric_limits<double>::infinity();
      }
      if (diff > max_abs) max_abs = diff;
      if (magnitude > tol.atol && diff > max_rel * magnitude) max_rel = diff / magnitude;
    }
    if (!finite) max_used = std::numeric_limits<double>::infinity();
    const double excess = finite ? diff - allowed : std::numeric_limits<double>::infinity();
    if (excess > worst_excess) {
      worst_excess = excess;
      worst_index = index_of();
      worst_actual = actual;
      worst_expected = expected;
    }
  }
  bool ok() const { return mismatches == 0; }
};

}  // namespace mpusim
