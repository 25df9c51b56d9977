// The op test table of the activations (core/ops/activation.h), run by every backend's test
// binary (tests/sim on the CPU, tests/cuda where a device is visible): every activation,
// forward and backward, in every float dtype, against float64 formulas written here
// independently of the functors, in place where allowed, and the argument rules. It replaces
// the per-backend GELU and SwiGLU cases of tests/sim and tests/cuda. A new activation without
// a row here fails EveryActivationHasARow.
//
// Bounds: |actual - expected| <= rtol(dtype) * (|expected| + scale) + atol(dtype), where
// scale is the size of the terms that cancel in the formula (gelu's x Phi(x) near x = -6,
// silu'(a) = sigmoid(a) (1 + a (1 - sigmoid(a))) near a = -1.28): an error of the inputs'
// magnitude times the compute type's epsilon is allowed there, not one relative to a result
// near zero. Inputs are compared after their rounding to the dtype (the kernels see those).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/kernels.h"
#include "core/ops/activation.h"
#include "core/tensor.h"
#include "tests/kernel_test_util.h"

namespace mpusim::activation_ops {

// f, f' and the magnitudes of their terms, in float64.
struct Row {
  Activation act;
  double (*f)(double);
  double (*grad)(double);
  double (*f_scale)(double);
  double (*grad_scale)(double);
};

inline double Phi(double x) { return 0.5 * std::erfc(-x / std::numbers::sqrt2); }
inline double PhiDensity(double x) {
  return std::exp(-0.5 * x * x) / std::sqrt(2 * std::numbers::pi);
}
inline double Sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

inline const std::vector<Row>& Rows() {
  static const std::vector<Row> rows = {
      {Activation::kGelu, [](double x) { return x * Phi(x); },
       [](double x) { return Phi(x) + x * PhiDensity(x); },
       [](double x) { return std::fabs(x); },  // 0.5 x (1 + erf): 1 + erf cancels for x < 0
       [](double x) { return 1 + std::fabs(x) * PhiDensity(x); }},
      {Activation::kSwiglu, [](double a) { return a * Sigmoid(a); },
       [](double a) { return Sigmoid(a) * (1 + a * (1 - Sigmoid(a))); },
       [](double a) { return std::fabs(a) * Sigmoid(a); },
       [](double a) { return Sigmoid(a) * (1 + std::fabs(a) * (1 - Sigmoid(a))); }},
      {Activation::kSquaredRelu, [](double x) { return x > 0 ? x * x : 0.0; },
       [](double x) { return x > 0 ? 2 * x : 0.0; }, [](double x) { return x * x; },
       [](double x) { return 2 * std::fabs(x); }},
      // relu (torch's ReLU: zero gradient at 0); exact in every dtype
      {Activation::kRelu, [](double x) { return x > 0 ? x : 0.0; },
       [](double x) { return x > 0 ? 1.0 : 0.0; }, [](double x) { return std::fabs(x); },
       [](double /*x*/) { return 1.0; }},
      // quick_gelu(a) = a sigmoid(1.702 a) (Megatron's fused_bias_geglu.py)
      {Activation::kQuickGeglu, [](double a) { return a * Sigmoid(1.702 * a); },
       [](double a) {
         const double s = Sigmoid(1.702 * a);
         return s * (1 + 1.702 * a * (1 - s));
       },
       [](double a) { return std::fabs(a) * Sigmoid(1.702 * a); },
       [](double a) {
         const double s = Sigmoid(1.702 * a);
         return s * (1 + 1.702 * std::fabs(a) * (1 - s));
       }},
  };
  return rows;
}

inline const Row* Find(Activation act) {
  for (const Row& row : Rows()) {
    if (row.act == act) return &row;
  }
  return nullptr;
}

// A few epsilons of the compute type, plus the storage rounding for the 16-bit dtypes.
inline double RelTol(DType dt) {
  const double float_part = 16 * std::ldexp(1.0, -23);
  switch (dt) {
    case DType::kFloat64: return 16 * std::ldexp(1.0, -52);
    case DType::kBFloat16: return std::ldexp(1.0, -8) + float_part;
    case DType::kFloat16: return std::ldexp(1.0, -11) + float_part;
    default: return float_part;
  }
}
// float16's subnormals are spaced 2^-24 (gelu(-6) is one of them).
inline double AbsTol(DType dt) { return dt == DType::kFloat16 ? std::ldexp(1.0, -24) : 0.0; }

inline ::testing::AssertionResult Near(const std::string& name, DType dt,
                                       const std::vector<double>& actual,
                                       const std::vector<double>& expected,
                                       const std::vector<double>& scale) {
  std::vector<double> bound(expected.size());
  for (size_t e = 0; e < expected.size() && e < scale.size(); ++e) {
    bound[e] = RelTol(dt) * (std::fabs(expected[e]) + scale[e]) + AbsTol(dt);
  }
  return WithinBounds(fmt::format("{} ({})", name, DTypeName(dt)), actual, expected, bound);
}

// Runs every row's forward and backward on `k` in dtype `dt` (inputs from -6 to 6, zero and
// both signs of every gradient included) and checks them; dx = x in place too. A gated row
// runs again with Megatron's glu (offset 1, clamp 2.5: a above it and b outside [-2.5, 2.5]
// are clamped, their gradients zero, as torch's clamp gives).
inline void CheckAll(Kernels& k, DType dt) {
  const int64_t n = 7, f = 9;  // [n, f] plain inputs; [n, 2f] gated ones
  struct Case {
    const Row* row;
    GluOptions glu;
  };
  std::vector<Case> cases;
  for (const Row& row : Rows()) {
    cases.push_back({&row, {}});
    if (IsGated(row.act)) {
      cases.push_back({&row, {.linear_offset = 1.0, .clamped = true, .clamp_value = 2.5}});
    }
  }
  for (const auto& [row_ptr, glu] : cases) {
    const Row& row = *row_ptr;
    const bool gated = IsGated(row.act);
    const int64_t w = gated ? 2 * f : f;
    std::vector<double> xv(static_cast<size_t>(n * w)), dyv(static_cast<size_t>(n * f));
    for (size_t e = 0; e < xv.size(); ++e) {
      xv[e] = -6.0 + 12.0 * static_cast<double>((e * 37) % xv.size()) /
                         static_cast<double>(xv.size() - 1);
    }
    xv[xv.size() / 2] = 0.0;
    for (size_t e = 0; e < dyv.size(); ++e) {
      dyv[e] = 0.25 + 0.5 * static_cast<double>((e * 5) % 7) - 1.5;
    }
    const Tensor x_host = MakeOf(dt, {n, w}, xv);
    const Tensor dy_host = MakeOf(dt, {n, f}, dyv);
    xv = ValuesOf(x_host);  // as rounded to dt
    dyv = ValuesOf(dy_host);

    std::vector<double> y(static_cast<size_t>(n * f)), y_scale(y.size());
    std::vector<double> dx(xv.size()), dx_scale(xv.size());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < f; ++j) {
        const size_t o = static_cast<size_t>(i * f + j);
        const double g = dyv[o];
        if (gated) {
          const size_t ia = static_cast<size_t>(i * w + j), ib = ia + static_cast<size_t>(f);
          const double c = glu.clamp_value, off = glu.linear_offset;
          const double a = glu.clamped ? std::min(xv[ia], c) : xv[ia];
          const double b = glu.clamped ? std::clamp(xv[ib], -c, c) : xv[ib];
          const bool a_passes = !glu.clamped || xv[ia] <= c;
          const bool b_passes = !glu.clamped || std::fabs(xv[ib]) <= c;
          y[o] = row.f(a) * (b + off);
          y_scale[o] = row.f_scale(a) * (std::fabs(b) + std::fabs(off));
          dx[ia] = a_passes ? g * (b + off) * row.grad(a) : 0.0;
          dx_scale[ia] = std::fabs(g) * (std::fabs(b) + std::fabs(off)) * row.grad_scale(a);
          dx[ib] = b_passes ? g * row.f(a) : 0.0;
          dx_scale[ib] = std::fabs(g) * row.f_scale(a);
        } else {
          y[o] = row.f(xv[o]);
          y_scale[o] = row.f_scale(xv[o]);
          dx[o] = g * row.grad(xv[o]);
          dx_scale[o] = std::fabs(g) * row.grad_scale(xv[o]);
        }
      }
    }
    const std::string name =
        fmt::format("{}{} {}", ActivationName(row.act), glu.clamped ? " glu" : "", DTypeName(dt));
    const Tensor x = k.ToDevice(x_host);
    const Tensor dy = k.ToDevice(dy_host);
    Tensor out = k.Zeros({n, f}, dt);
    k.ActivationForward(row.act, x, out, glu);
    EXPECT_TRUE(Near(name, dt, ValuesOf(k.ToHost(out)), y, y_scale));
    Tensor grad = k.Zeros({n, w}, dt);
    k.ActivationBackward(row.act, x, dy, grad, glu);
    EXPECT_TRUE(Near(name + " backward", dt, ValuesOf(k.ToHost(grad)), dx, dx_scale));
    Tensor in_place = k.ToDevice(x_host);
    k.ActivationBackward(row.act, in_place, dy, in_place, glu);
    EXPECT_EQ(ValuesOf(k.ToHost(in_place)), ValuesOf(k.ToHost(grad))) << name << " dx = x";
    if (!gated) {  // a plain activation also runs with y = x, and with dx = dy
      Tensor y_in_place = k.ToDevice(x_host);
      k.ActivationForward(row.act, y_in_place, y_in_place);
      EXPECT_EQ(ValuesOf(k.ToHost(y_in_place)), ValuesOf(k.ToHost(out))) << name << " y = x";
      Tensor dy_in_place = k.ToDevice(dy_host);
      k.ActivationBackward(row.act, x, dy_in_place, dy_in_place);
      EXPECT_EQ(ValuesOf(k.ToHost(dy_in_place)), ValuesOf(k.ToHost(grad))) << name << " dx = dy";
    }
    // The argument rules (core/kernels.cc), the same on every backend.
    Tensor short_y = k.Zeros({n, f - 1}, dt);
    EXPECT_THROW(k.ActivationForward(row.act, x, short_y), std::invalid_argument) << name;
    EXPECT_THROW(k.ActivationBackward(row.act, x, dy, short_y), std::invalid_argument) << name;
    if (gated) {
      const Tensor odd = k.Zeros({n, w - 1}, dt);
      EXPECT_THROW(k.ActivationForward(row.act, odd, out), std::invalid_argument) << name;
      Tensor wide = k.Zeros({n, w}, dt);
      EXPECT_THROW(k.ActivationForward(row.act, x, wide), std::invalid_argument) << name;
      const GluOptions no_bound{.clamped = true, .clamp_value = 0.0};
      EXPECT_THROW(k.ActivationForward(row.act, x, out, no_bound), std::invalid_argument) << name;
      EXPECT_THROW(k.ActivationBackward(row.act, x, dy, grad, no_bound), std::invalid_argument)
          << name;
    }
  }
}

// quick_geglu with gpt-oss's glu shape worked by hand: offset 1, clamp 2, one row
// a = [0, 2, 3, -5], b = [2, -2, 2.5, -3], dy = [1, 0.5, -2, 4]. With q(a) = a sigmoid(1.702 a),
// q(2) = 1.9356586231442083, q'(2) = 1.0738153543085418, q(-5) = -0.0010070162673523693,
// q'(-5) = -0.001512193240131231, q(0) = 0, q'(0) = 1/2:
//   y  = [q(0) (2 + 1), q(2) (-2 + 1), q(min(3, 2)) (min(2.5, 2) + 1), q(-5) (-2 + 1)]
//   da = [1 * 3 * 1/2, 0.5 * (-1) q'(2) (a = c passes), 0 (a > c), 4 * (-1) q'(-5)]
//   db = [1 * q(0) = 0, 0.5 q(2) (b = -c passes), 0 (b > c), 0 (b < -c)]
// The clamped gradients must be exactly zero.
inline void CheckGluByHand(Kernels& k, DType dt) {
  const GluOptions glu{.linear_offset = 1.0, .clamped = true, .clamp_value = 2.0};
  const Tensor x = k.ToDevice(MakeOf(dt, {1, 8}, {0, 2, 3, -5, 2, -2, 2.5, -3}));
  const Tensor dy = k.ToDevice(MakeOf(dt, {1, 4}, {1, 0.5, -2, 4}));
  const std::vector<double> y = {0, -1.9356586231442083, 5.806975869432625, 0.0010070162673523693};
  const std::vector<double> dx = {1.5, -0.5369076771542709, 0, 0.006048772960524924,
                                  0,   0.9678293115721042,  0, 0};
  Tensor out = k.Zeros({1, 4}, dt);
  k.ActivationForward(Activation::kQuickGeglu, x, out, glu);
  Tensor grad = k.Zeros({1, 8}, dt);
  k.ActivationBackward(Activation::kQuickGeglu, x, dy, grad, glu);
  const std::string name = fmt::format("quick_geglu by hand ({})", DTypeName(dt));
  // The terms are at most 3 * q(2) ~ 6 in size.
  EXPECT_TRUE(Near(name, dt, ValuesOf(k.ToHost(out)), y, std::vector<double>(4, 6.0)));
  const std::vector<double> got = ValuesOf(k.ToHost(grad));
  EXPECT_TRUE(Near(name + " backward", dt, got, dx, std::vector<double>(8, 2.0)));
  for (size_t e : {2u, 4u, 6u, 7u}) EXPECT_EQ(got[e], 0.0) << name << " dx[" << e << "]";
}

inline void CheckEveryActivationHasARow() {
  for (int i = 0; i < kActivationCount; ++i) {
    const auto act = static_cast<Activation>(i);
    EXPECT_NE(Find(act), nullptr) << ActivationName(act)
                                  << " has no row in tests/ops/activation_ops.h";
  }
}

}  // namespace mpusim::activation_ops
