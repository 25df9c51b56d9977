// The op test table of the norms (core/ops/norm.h), run by every backend's test binary
// (tests/sim on the CPU, tests/cuda where a device is visible): LayerNorm and RMSNorm, forward
// and backward, in every float dtype and every accumulator dtype, against float64 formulas
// written here independently of the functors; in place (y = x, dx = dy) to the bit; and the
// argument rules. It replaces the per-backend norm cases of tests/sim (against float64) and
// tests/cuda (against the CPU). The backward's formulas themselves are checked against finite
// differences in tests/sim (NormBackwardsMatchFiniteDifferences).
//
// Shapes: an odd row length (no vector width divides it), rows wider than a CUDA block (256
// threads), and more rows than a CUDA grid has blocks (65535), so that every block-stride
// loop wraps. Inputs are Philox reals stored in the dtype, x with its mean far from zero;
// the reference computes on the stored values, and the backward on the statistics that the
// backend's forward stored (as a model's backward does).
//
// Bounds: |actual - expected| <= store(dtype) |expected| + u err + abs(dtype), where u is the
// compute type's unit roundoff (2^-53 for float64, 2^-24 otherwise) and err bounds, in units
// of u, the rounding errors of the computed value to first order:
//   mean, rstd, y, dx  (2h + 16) times the magnitude of the formula's terms: a row's sums of
//                      h terms, in any order (Eigen's packets, a block's tree), plus a few
//                      roundings per element; the analysis gives about h + 8 (y: 1.5h + 9);
//   dweight, dbias     twice the sum of the magnitudes of the running column sums and of the
//                      terms' own errors: both backends add the rows in row order;
// store(dtype) is half an ulp of a 16-bit result (2^-8 bfloat16, 2^-11 float16; 0 when the
// result is in the compute type, its rounding is in u), abs(dtype) float16's subnormal
// spacing 2^-24 (0 otherwise).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/kernels.h"
#include "core/ops/norm.h"  // Normalization, NormalizationName, IsCentered
#include "core/philox.h"
#include "core/tensor.h"
#include "tests/kernel_test_util.h"

namespace mpusim::norm_ops {

struct Row {
  Normalization kind;
  bool centered;  // LayerNorm: the mean is subtracted and the bias added
};

inline const std::vector<Row>& Rows() {
  static const std::vector<Row> rows = {{Normalization::kLayerNorm, true},
                                        {Normalization::kRMSNorm, false}};
  return rows;
}

// [n, h]: see the file comment.
inline constexpr std::pair<int64_t, int64_t> kShapes[] = {{6, 37}, {3, 3000}, {70000, 4}};

// n reals uniform in [lo, hi) (Philox stream `key`).
inline std::vector<double> Uniform(uint64_t key, int64_t n, double lo, double hi) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) {
    v[static_cast<size_t>(e)] = lo + (hi - lo) * UniformAt(key, 9, static_cast<uint64_t>(e));
  }
  return v;
}

// Expected values and err, the bound on their computed rounding errors in units of u.
struct Expected {
  std::vector<double> value, err;
};

inline double UnitRoundoff(DType compute) {
  return compute == DType::kFloat64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
}
inline double StoreTol(DType stored) {
  return stored == DType::kBFloat16 ? std::ldexp(1.0, -8)
         : stored == DType::kFloat16 ? std::ldexp(1.0, -11)
                                     : 0.0;
}

// Results stored in `stored`, computed in `compute`.
inline ::testing::AssertionResult Near(const std::string& name, DType stored, DType compute,
                                       const std::vector<double>& actual,
                                       const Expected& expected) {
  std::vector<double> bound(expected.value.size());
  for (size_t e = 0; e < bound.size(); ++e) {
    bound[e] = StoreTol(stored) * std::fabs(expected.value[e]) +
               UnitRoundoff(compute) * expected.err[e] +
               (stored == DType::kFloat16 ? std::ldexp(1.0, -24) : 0.0);
  }
  return WithinBounds(name, actual, expected.value, bound);
}

// The forward of x [n, h] in float64: LayerNorm when centered (b [h] added), else RMSNorm.
struct Forward {
  Expected y, mean, rstd;
};
inline Forward ReferenceForward(bool centered, const std::vector<double>& x,
                                const std::vector<double>& w, const std::vector<double>& b,
                                int64_t n, int64_t h, double eps) {
  Forward ref;
  const double count = static_cast<double>(h);
  const double k = 2 * count + 16;
  for (int64_t i = 0; i < n; ++i) {
    const double* row = x.data() + i * h;
    double mean = 0, abs_mean = 0;
    if (centered) {
      for (int64_t j = 0; j < h; ++j) {
        mean += row[j];
        abs_mean += std::fabs(row[j]);
      }
      mean /= count;
      abs_mean /= count;
    }
    double var = 0;
    for (int64_t j = 0; j < h; ++j) var += (row[j] - mean) * (row[j] - mean);
    const double rstd = 1 / std::sqrt(var / count + eps);
    ref.mean.value.push_back(mean);
    ref.mean.err.push_back(k * abs_mean);
    ref.rstd.value.push_back(rstd);
    ref.rstd.err.push_back(k * rstd);
    for (int64_t j = 0; j < h; ++j) {
      const size_t c = static_cast<size_t>(j);
      const double bias = centered ? b[c] : 0.0;
      ref.y.value.push_back((row[j] - mean) * rstd * w[c] + bias);
      ref.y.err.push_back(
          k * ((std::fabs(row[j]) + abs_mean) * rstd * std::fabs(w[c]) + std::fabs(bias)));
    }
  }
  return ref;
}

// The backward with the statistics as given (mean empty: RMSNorm); dw0 and db0 are the
// accumulators' values before the call.
struct Backward {
  Expected dx, dw, db;
};
inline Backward ReferenceBackward(const std::vector<double>& x, const std::vector<double>& w,
                                  const std::vector<double>& mean,
                                  const std::vector<double>& rstd, const std::vector<double>& dy,
                                  const std::vector<double>& dw0,
                                  const std::vector<double>& db0, int64_t n, int64_t h) {
  Backward ref;
  const bool centered = !mean.empty();
  const double count = static_cast<double>(h);
  const double k = 2 * count + 16;
  std::vector<double> dw_sum(static_cast<size_t>(h), 0.0), db_sum = dw_sum;
  ref.dw.err = ref.db.err = dw_sum;
  for (int64_t i = 0; i < n; ++i) {
    const double* x_row = x.data() + i * h;
    const double* dy_row = dy.data() + i * h;
    const double m = centered ? mean[static_cast<size_t>(i)] : 0.0;
    const double r = rstd[static_cast<size_t>(i)];
    // g = dy w; the means of g and g xhat, and of their terms' magnitudes.
    double mean_g = 0, mean_gx = 0, abs_g = 0, abs_gx = 0;
    for (int64_t j = 0; j < h; ++j) {
      const double g = dy_row[j] * w[static_cast<size_t>(j)];
      mean_g += g / count;
      mean_gx += g * (x_row[j] - m) * r / count;
      abs_g += std::fabs(g) / count;
      abs_gx += std::fabs(g) * (std::fabs(x_row[j]) + std::fabs(m)) * r / count;
    }
    if (!centered) mean_g = abs_g = 0;
    for (int64_t j = 0; j < h; ++j) {
      const size_t c = static_cast<size_t>(j);
      const double xhat = (x_row[j] - m) * r;
      const double g = dy_row[j] * w[c];
      const double x_scale = (std::fabs(x_row[j]) + std::fabs(m)) * r;  // bounds |xhat|
      ref.dx.value.push_back(r * (g - mean_g - xhat * mean_gx));
      ref.dx.err.push_back(k * r * (std::fabs(g) + abs_g + x_scale * abs_gx));
      dw_sum[c] += dy_row[j] * xhat;
      db_sum[c] += dy_row[j];
      ref.dw.err[c] += 2 * (std::fabs(dw_sum[c]) + 3 * std::fabs(dy_row[j]) * x_scale);
      ref.db.err[c] += 2 * std::fabs(db_sum[c]);
    }
  }
  for (size_t c = 0; c < dw_sum.size(); ++c) {
    ref.dw.value.push_back(dw0[c] + dw_sum[c]);
    ref.db.value.push_back(db0[c] + db_sum[c]);
    ref.dw.err[c] += 2 * std::fabs(ref.dw.value[c]);  // the addition to the accumulator
    ref.db.err[c] += 2 * std::fabs(ref.db.value[c]);
  }
  return ref;
}

// Every norm of core/ops/norm.h has a row, which says the same of its centering.
inline void CheckEveryNormHasARow() {
  for (int i = 0; i < kNormalizationCount; ++i) {
    const auto kind = static_cast<Normalization>(i);
    int found = 0;
    for (const Row& row : Rows()) {
      if (row.kind != kind) continue;
      ++found;
      EXPECT_EQ(row.centered, IsCentered(kind)) << NormalizationName(kind);
    }
    EXPECT_EQ(found, 1) << NormalizationName(kind) << " needs one row in tests/ops/norm_ops.h";
  }
}

// The row's forward and backward on a backend (b, mean and db unused when not centered).
inline void RunForward(Kernels& k, const Row& row, const Tensor& x, const Tensor& w,
                       const Tensor& b, double eps, Tensor& y, Tensor& mean, Tensor& rstd) {
  k.NormForward(row.kind, x, w, row.centered ? &b : nullptr, eps, y,
                row.centered ? &mean : nullptr, rstd);
}
inline void RunBackward(Kernels& k, const Row& row, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dw, Tensor& db) {
  k.NormBackward(row.kind, x, w, row.centered ? &mean : nullptr, rstd, dy, dx, dw,
                 row.centered ? &db : nullptr);
}

// The accumulator dtypes of a dtype's dweight and dbias: its own, and float32 for 16-bit.
inline std::vector<DType> AccumulatorDTypes(DType dt) {
  if (IsHalf(dt)) return {dt, DType::kFloat32};
  return {dt};
}

// One row of the table in dtype `dt` on shape [n, h]: forward, backward for every
// accumulator dtype, and both in place.
inline void CheckRow(Kernels& k, DType dt, const Row& row, int64_t n, int64_t h) {
  const std::string name =
      fmt::format("{} {} [{}, {}]", NormalizationName(row.kind), DTypeName(dt), n, h);
  const DType stats = ComputeDType(dt);
  const double eps = 1e-5;
  const Tensor x_host = MakeOf(dt, {n, h}, Uniform(100, n * h, -3, 5));
  const Tensor w_host = MakeOf(dt, {h}, Uniform(101, h, 0.5, 1.5));
  const Tensor b_host = MakeOf(dt, {h}, Uniform(102, h, -1, 1));
  const Tensor dy_host = MakeOf(dt, {n, h}, Uniform(103, n * h, -2, 2));
  const std::vector<double> xv = ValuesOf(x_host), wv = ValuesOf(w_host),
                            bv = ValuesOf(b_host), dyv = ValuesOf(dy_host);
  const Tensor x = k.ToDevice(x_host), w = k.ToDevice(w_host), b = k.ToDevice(b_host);
  const Tensor dy = k.ToDevice(dy_host);

  Tensor y = k.Zeros({n, h}, dt);
  Tensor mean = k.Zeros({n}, stats), rstd = k.Zeros({n}, stats);
  RunForward(k, row, x, w, b, eps, y, mean, rstd);
  const Forward fwd = ReferenceForward(row.centered, xv, wv, bv, n, h, eps);
  ASSERT_GT(Norm(fwd.y.value), 0) << name;
  EXPECT_TRUE(Near(name + " y", dt, stats, ValuesOf(k.ToHost(y)), fwd.y));
  if (row.centered) {
    EXPECT_TRUE(Near(name + " mean", stats, stats, ValuesOf(k.ToHost(mean)), fwd.mean));
  }
  EXPECT_TRUE(Near(name + " rstd", stats, stats, ValuesOf(k.ToHost(rstd)), fwd.rstd));
  Tensor y_in_place = k.ToDevice(x_host);
  Tensor mean2 = k.Zeros({n}, stats), rstd2 = k.Zeros({n}, stats);
  RunForward(k, row, y_in_place, w, b, eps, y_in_place, mean2, rstd2);
  EXPECT_TRUE(TensorsNear(name + " y = x", ValuesOf(k.ToHost(y_in_place)), ValuesOf(k.ToHost(y))));

  // The backward from the statistics the forward stored.
  const std::vector<double> mean_v =
      row.centered ? ValuesOf(k.ToHost(mean)) : std::vector<double>{};
  const std::vector<double> rstd_v = ValuesOf(k.ToHost(rstd));
  for (DType acc : AccumulatorDTypes(dt)) {
    const std::string acc_name = fmt::format("{} (accumulators {})", name, DTypeName(acc));
    const Tensor dw_host = MakeOf(acc, {h}, Uniform(104, h, -1, 1));
    const Tensor db_host = MakeOf(acc, {h}, Uniform(105, h, -1, 1));
    const Backward ref = ReferenceBackward(xv, wv, mean_v, rstd_v, dyv, ValuesOf(dw_host),
                                           ValuesOf(db_host), n, h);
    ASSERT_GT(Norm(ref.dx.value), 0) << acc_name;
    Tensor dx = k.Zeros({n, h}, dt);
    Tensor dw = k.ToDevice(dw_host), db = k.ToDevice(db_host);
    RunBackward(k, row, x, w, mean, rstd, dy, dx, dw, db);
    EXPECT_TRUE(Near(acc_name + " dx", dt, stats, ValuesOf(k.ToHost(dx)), ref.dx));
    EXPECT_TRUE(Near(acc_name + " dweight", acc, stats, ValuesOf(k.ToHost(dw)), ref.dw));
    if (row.centered) {
      EXPECT_TRUE(Near(acc_name + " dbias", acc, stats, ValuesOf(k.ToHost(db)), ref.db));
    }
    // dx = dy: the same dx, and the accumulators still see the original dy.
    Tensor dx_in_place = k.ToDevice(dy_host);
    Tensor dw2 = k.ToDevice(dw_host), db2 = k.ToDevice(db_host);
    RunBackward(k, row, x, w, mean, rstd, dx_in_place, dx_in_place, dw2, db2);
    const std::string in_place = acc_name + " with dx = dy:";
    EXPECT_TRUE(TensorsNear(in_place + " dx", ValuesOf(k.ToHost(dx_in_place)),
                            ValuesOf(k.ToHost(dx))));
    EXPECT_TRUE(TensorsNear(in_place + " dweight", ValuesOf(k.ToHost(dw2)),
                            ValuesOf(k.ToHost(dw))));
    EXPECT_TRUE(TensorsNear(in_place + " dbias", ValuesOf(k.ToHost(db2)),
                            ValuesOf(k.ToHost(db))));
  }
}

// The argument rules (core/kernels.cc), the same on every backend.
inline void CheckArgumentRules(Kernels& k, DType dt) {
  const int64_t n = 3, h = 5;
  const double eps = 1e-5;
  const DType stats = ComputeDType(dt);
  const DType other = dt == DType::kFloat64 ? DType::kFloat32 : DType::kFloat64;  // neither
  const Tensor x = k.ToDevice(MakeOf(dt, {n, h}, Uniform(110, n * h, -3, 5)));
  const Tensor w = k.ToDevice(MakeOf(dt, {h}, Uniform(111, h, 0.5, 1.5)));
  const Tensor b = k.ToDevice(MakeOf(dt, {h}, Uniform(112, h, -1, 1)));
  const std::string name(DTypeName(dt));
  Tensor y = k.Zeros({n, h}, dt);
  Tensor mean = k.Zeros({n}, stats), rstd = k.Zeros({n}, stats);
  constexpr Normalization kCentered = Normalization::kLayerNorm;
  constexpr Normalization kUncentered = Normalization::kRMSNorm;
  Tensor wrong_stats = k.Zeros({n}, other);
  EXPECT_THROW(k.NormForward(kCentered, x, w, &b, eps, y, &wrong_stats, rstd),
               std::invalid_argument)
      << name << ": statistics not in the compute dtype";
  EXPECT_THROW(k.NormForward(kCentered, x, k.Zeros({h - 1}, dt), &b, eps, y, &mean, rstd),
               std::invalid_argument)
      << name << ": a weight of h - 1";
  EXPECT_THROW(k.NormForward(kCentered, x, w, &b, -1.0, y, &mean, rstd), std::invalid_argument)
      << name << ": eps < 0";
  EXPECT_THROW(k.NormForward(kCentered, x, w, nullptr, eps, y, &mean, rstd),
               std::invalid_argument)
      << name << ": a centered norm without a bias";
  EXPECT_THROW(k.NormForward(kUncentered, x, w, nullptr, eps, y, &mean, rstd),
               std::invalid_argument)
      << name << ": an uncentered norm with a mean";
  Tensor short_rstd = k.Zeros({n - 1}, stats);
  EXPECT_THROW(k.NormForward(kUncentered, x, w, nullptr, eps, y, nullptr, short_rstd),
               std::invalid_argument)
      << name << ": rstd of n - 1";
  Tensor no_cols = k.Zeros({n, 0}, dt);
  EXPECT_THROW(
      k.NormForward(kUncentered, no_cols, k.Zeros({0}, dt), nullptr, eps, no_cols, nullptr, rstd),
      std::invalid_argument)
      << name << ": no columns";

  k.NormForward(kCentered, x, w, &b, eps, y, &mean, rstd);
  Tensor dx = k.Zeros({n, h}, dt), dw = k.Zeros({h}, dt), db = k.Zeros({h}, dt);
  Tensor dw_other = k.Zeros({h}, other);
  EXPECT_THROW(k.NormBackward(kCentered, x, w, &mean, rstd, y, dx, dw_other, &db),
               std::invalid_argument)
      << name << ": an accumulator in neither dtype";
  EXPECT_THROW(k.NormBackward(kCentered, x, w, &mean, rstd, y, dx, dw, &dw),
               std::invalid_argument)
      << name << ": dweight and dbias share storage";
  Tensor wide = k.Zeros({n, h}, dt);
  EXPECT_THROW(k.NormBackward(kCentered, x, w, &mean, rstd, y, dx, dw, &wide),
               std::invalid_argument)
      << name << ": dbias [n, h]";
  EXPECT_THROW(k.NormBackward(kCentered, x, w, &mean, rstd, y, dx, dw, nullptr),
               std::invalid_argument)
      << name << ": a centered norm without a dbias";
  EXPECT_THROW(k.NormBackward(kUncentered, x, w, nullptr, rstd, y, dx, dw, &db),
               std::invalid_argument)
      << name << ": an uncentered norm with a dbias";
  EXPECT_THROW(k.NormBackward(kUncentered, x, w, nullptr, rstd, y, dx, dw_other, nullptr),
               std::invalid_argument)
      << name << ": an accumulator in neither dtype";
}

// Every row on every shape in dtype `dt`, then the argument rules.
inline void CheckAll(Kernels& k, DType dt) {
  for (const Row& row : Rows()) {
    for (const auto& [n, h] : kShapes) CheckRow(k, dt, row, n, h);
  }
  CheckArgumentRules(k, dt);
}

}  // namespace mpusim::norm_ops
