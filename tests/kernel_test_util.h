// Helpers the kernel and collective tests share (tests/sim, tests/cuda): dtype of a storage
// type, host tensors from values and back, bit patterns, and an element-wise comparison.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "core/half.h"
#include "core/tensor.h"

namespace mpusim {

// The DType of a storage type: float, double, BFloat16 or Float16.
template <typename T>
constexpr DType kDType = std::is_same_v<T, float>      ? DType::kFloat32
                         : std::is_same_v<T, double>   ? DType::kFloat64
                         : std::is_same_v<T, BFloat16> ? DType::kBFloat16
                                                       : DType::kFloat16;

// A host tensor of `dtype` holding `values`, each rounded once to the dtype (SetHostValue).
inline Tensor MakeOf(DType dtype, const Shape& shape, const std::vector<double>& values) {
  Tensor t = Tensor::HostZeros(shape, dtype);
  EXPECT_EQ(static_cast<size_t>(t.numel()), values.size())
      << "test bug: MakeOf " << ShapeString(shape);
  for (size_t e = 0; e < values.size() && e < static_cast<size_t>(t.numel()); ++e) {
    SetHostValue(t, static_cast<int64_t>(e), values[e]);
  }
  return t;
}
template <typename T>
Tensor Make(const Shape& shape, const std::vector<double>& values) {
  return MakeOf(kDType<T>, shape, values);
}

// A host int64 tensor [ids.size()] of token ids or labels, for the embedding and
// cross-entropy kernels (device backends copy it over with ToDevice).
inline Tensor Ids(const std::vector<int64_t>& ids) {
  Tensor t = Tensor::HostEmpty({static_cast<int64_t>(ids.size())}, DType::kInt64);
  if (!ids.empty()) std::memcpy(t.data(), ids.data(), ids.size() * sizeof(int64_t));
  return t;
}

// Every element of a host tensor of any dtype, widened exactly to double.
inline std::vector<double> ValuesOf(const Tensor& host) {
  std::vector<double> v(static_cast<size_t>(host.numel()));
  for (size_t e = 0; e < v.size(); ++e) v[e] = HostValue(host, static_cast<int64_t>(e));
  return v;
}

// The raw 16-bit patterns of a 16-bit host tensor.
inline std::vector<uint16_t> Bits(const Tensor& host) {
  std::vector<uint16_t> v(static_cast<size_t>(host.numel()));
  if (!v.empty()) std::memcpy(v.data(), host.data(), v.size() * sizeof(uint16_t));
  return v;
}

inline double Norm(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

// |a - e| <= atol + rtol * |e| for every element (atol = rtol = 0: exact); NaN/Inf in the
// actual values fail unless the expected value is the same non-finite value.
inline ::testing::AssertionResult TensorsNear(const std::string& name,
                                              const std::vector<double>& actual,
                                              const std::vector<double>& expected,
                                              double atol = 0, double rtol = 0) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << name << ": " << actual.size() << " elements, expected " << expected.size();
  }
  int64_t bad = 0;
  double max_abs = 0;
  std::string first;
  for (size_t e = 0; e < actual.size(); ++e) {
    const double a = actual[e];
    const double x = expected[e];
    bool ok;
    if (!std::isfinite(a) || !std::isfinite(x)) {
      ok = (a == x) || (std::isnan(a) && std::isnan(x));
    } else {
      ok = std::fabs(a - x) <= atol + rtol * std::fabs(x);
      max_abs = std::max(max_abs, std::fabs(a - x));
    }
    if (!ok && bad++ < 10) first += fmt::format("\n  [{}] {} vs {}", e, a, x);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << name << ": " << bad << " of " << actual.size()
                                       << " mismatch (max abs " << max_abs << "):" << first;
}

// |actual[e] - expected[e]| <= bound[e] for every element (NaN never passes). On failure the
// first 8 elements out of bounds; on success the worst error in units of its bound.
inline ::testing::AssertionResult WithinBounds(const std::string& name,
                                               const std::vector<double>& actual,
                                               const std::vector<double>& expected,
                                               const std::vector<double>& bound) {
  if (actual.size() != expected.size() || bound.size() != expected.size()) {
    return ::testing::AssertionFailure() << name << ": " << actual.size() << " elements, expected "
                                         << expected.size() << " (" << bound.size() << " bounds)";
  }
  int64_t bad = 0;
  double worst = 0;  // the largest error in units of its bound
  std::string first;
  for (size_t e = 0; e < actual.size(); ++e) {
    const double error = std::fabs(actual[e] - expected[e]);
    if (!(error <= bound[e]) && bad++ < 8) {
      first += fmt::format("\n  [{}] {} vs {} (error {:.3g}, bound {:.3g})", e, actual[e],
                           expected[e], error, bound[e]);
    }
    if (bound[e] > 0) worst = std::max(worst, error / bound[e]);
  }
  if (bad == 0) return ::testing::AssertionSuccess() << name << ": worst " << worst << " of bound";
  return ::testing::AssertionFailure() << name << ": " << bad << " of " << actual.size()
                                       << " out of bounds:" << first;
}

}  // namespace mpusim
