// The MLP's activations, each defined once: its JSON name, whether it is gated, and its
// function and derivative as host/device functors that the CPU backend's loop and the CUDA
// backend's kernel both call (Kernels::ActivationForward / ActivationBackward), with the
// argument rules once in core/kernels.cc.
//
// What they are (Megatron's activation_func, with gated_linear_unit for the gated ones):
//   gelu          f(x) = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))      (exact, not tanh)
//   swiglu        gated silu: x = [a | b], y = silu(a) * b, silu(a) = a sigmoid(a)
//   squared_relu  f(x) = relu(x)^2, f'(x) = 2 relu(x)                (Primer, So et al. 2021)
//   relu          f(x) = max(x, 0), f'(x) = 1 for x > 0, else 0     (torch's ReLU: f'(0) = 0)
//   quick_geglu   gated quick_gelu: y = quick_gelu(a) * b, quick_gelu(a) = a sigmoid(1.702 a)
//                 (Megatron's activation_func quick_gelu with gated_linear_unit: gpt-oss)
// A plain activation maps x [n, w] to y [n, w]: y = f(x), dx = dy f'(x). A gated one maps
// x = [a | b] [n, 2f] to y [n, f]: y = f(a) b, and back da = dy b f'(a), db = dy f(a); fc1 then
// has 2 * ffn_hidden_size rows, interleaved per tensor-parallel rank (stride 2).
//
// A gated one also takes Megatron's glu (megatron/core/transformer/mlp.py, GluOptions below):
// with activation_func_clamp_value c, a = min(a, c) and b = clamp(b, -c, c) first; with
// glu_linear_offset o, y = f(a) (b + o). Back, the clamps pass the gradient where torch's
// clamp does (a <= c; -c <= b <= c, the boundary included) and zero it elsewhere.
//
// Arithmetic is in the compute type C (float for float32, bfloat16 and float16 storage;
// double for float64): a load widens exactly, one rounding stores (core/half.h).
//
// Adding an activation: its enum value (and the count), a functor below (in the math M, so
// that it runs on an element and on a block) and a row in
// VisitActivation; then its float64 reference (reference/ops.cc) and a row in
// the op test table (tests/ops/activation_ops.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/ops/element.h"  // ComputeOf, Load, Store, ScalarMath, MPUSIM_HD

namespace mpusim {

enum class Activation : uint8_t { kGelu, kSwiglu, kSquaredRelu, kQuickGeglu, kRelu };
inline constexpr int kActivationCount = 5;  // the values above

// A gated activation's glu (Megatron's TransformerConfig): glu_linear_offset added to b, and
// activation_func_clamp_value (clamped when `clamped`) bounding a above and b on both sides.
// The default leaves y = f(a) b. Plain activations ignore it.
struct GluOptions {
  double linear_offset = 0.0;
  bool clamped = false;
  double clamp_value = 0.0;
};

namespace ops {

// An activation is f and f' of (C, M, V): MPUSIM_HD static V F(const V& x), Grad likewise.
#define MPUSIM_OP_VALUE \
  typename C, typename M = ScalarMath, typename V = typename M::template Value<C>

struct Gelu {
  static constexpr std::string_view kName = "gelu";
  static constexpr bool kGated = false;
  static constexpr double kInvSqrt2 = 0.70710678118654752440;    // 1 / sqrt(2)
  static constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1 / sqrt(2 pi)
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V F(const V& x) {
    return (C(0.5) * x) * (C(1) + M::Erf(x * C(kInvSqrt2)));
  }
  // Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V Grad(const V& x) {
    const V cdf = C(0.5) * (C(1) + M::Erf(x * C(kInvSqrt2)));
    return cdf + (x * M::Exp(C(-0.5) * (x * x))) * C(kInvSqrt2Pi);
  }
};

struct Swiglu {
  static constexpr std::string_view kName = "swiglu";
  static constexpr bool kGated = true;
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V Sigmoid(const V& x) {
    return C(1) / (C(1) + M::Exp(-x));
  }
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V F(const V& x) {  // silu
    return x * Sigmoid<C, M, V>(x);
  }
  // silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x))).
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V Grad(const V& x) {
    const V s = Sigmoid<C, M, V>(x);
    return s * (C(1) + x * (C(1) - s));
  }
};

struct SquaredRelu {
  static constexpr std::string_view kName = "squared_relu";
  static constexpr bool kGated = false;
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V F(const V& x) {
    return M::Select(x > C(0), x * x, C(0));
  }
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V Grad(const V& x) {
    return M::Select(x > C(0), C(2) * x, C(0));
  }
};

struct Relu {
  static constexpr std::string_view kName = "relu";
  static constexpr bool kGated = false;
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V F(const V& x) {
    return M::Select(x > C(0), x, C(0));
  }
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V Grad(const V& x) {
    return M::Select(x > C(0), C(1), C(0));
  }
};

// Megatron's quick_gelu (megatron/core/fusions/fused_bias_geglu.py), gated (quick_geglu):
// quick_gelu(x) = x sigmoid(1.702 x), quick_gelu'(x) = s (1 + 1.702 x (1 - s)), s the sigmoid
// (quick_geglu_back's formula).
struct QuickGeglu {
  static constexpr std::string_view kName = "quick_geglu";
  static constexpr bool kGated = true;
  static constexpr double kAlpha = 1.702;
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V Sigmoid(const V& x) {
    return C(1) / (C(1) + M::Exp(-(C(kAlpha) * x)));
  }
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V F(const V& x) {
    return x * Sigmoid<C, M, V>(x);
  }
  template <MPUSIM_OP_VALUE>
  MPUSIM_HD static V Grad(const V& x) {
    const V s = Sigmoid<C, M, V>(x);
    return s * (C(1) + (C(kAlpha) * x) * (C(1) - s));
  }
};

// Runs visitor.template operator()<Functor>() for `a`: the one place that maps an Activation
// to its functor (the backends instantiate their loops and kernels through it).
template <typename Visitor>
decltype(auto) VisitActivation(Activation a, Visitor&& visitor) {
  switch (a) {
    case Activation::kSwiglu:
      return visitor.template operator()<Swiglu>();
    case Activation::kSquaredRelu:
      return visitor.template operator()<SquaredRelu>();
    case Activation::kQuickGeglu:
      return visitor.template operator()<QuickGeglu>();
    case Activation::kRelu:
      return visitor.template operator()<Relu>();
    case Activation::kGelu:
      break;
  }
  return visitor.template operator()<Gelu>();
}

// The op on values (an element, or a block on the CPU): y = f(x); gated, y = f(a') (b' + o)
// with a' = min(a, c), b' = clamp(b, -c, c) when clamped (a' = a, b' = b otherwise); back,
// dx = dy f'(x); gated, da = dy (b' + o) f'(a') where a <= c (else 0) and db = dy f(a') where
// -c <= b <= c (else 0).
template <typename A, MPUSIM_OP_VALUE>
MPUSIM_HD V Forward(const V& x) {
  return A::template F<C, M, V>(x);
}
template <typename A, MPUSIM_OP_VALUE>
MPUSIM_HD V GatedForward(const V& a, const V& b, const GluOptions& glu = {}) {
  const C o = C(glu.linear_offset);
  if (!glu.clamped) return A::template F<C, M, V>(a) * (b + o);
  const C c = C(glu.clamp_value);
  const V ac = M::Select(a > c, c, a);
  const V bc = M::Select(b > c, c, M::Select(b < -c, -c, b));
  return A::template F<C, M, V>(ac) * (bc + o);
}
template <typename A, MPUSIM_OP_VALUE>
MPUSIM_HD V Backward(const V& x, const V& dy) {
  return dy * A::template Grad<C, M, V>(x);
}
template <typename A, MPUSIM_OP_VALUE>
MPUSIM_HD void GatedBackward(const V& a, const V& b, const V& dy, V& da, V& db,
                             const GluOptions& glu = {}) {
  const C o = C(glu.linear_offset);
  if (!glu.clamped) {
    da = (dy * (b + o)) * A::template Grad<C, M, V>(a);
    db = dy * A::template F<C, M, V>(a);
    return;
  }
  const C c = C(glu.clamp_value);
  const V ac = M::Select(a > c, c, a);
  const V bc = M::Select(b > c, c, M::Select(b < -c, -c, b));
  const V da_in = (dy * (bc + o)) * A::template Grad<C, M, V>(ac);
  const V db_in = dy * A::template F<C, M, V>(ac);
  da = M::Select(a > c, C(0), da_in);
  db = M::Select(b > c, C(0), M::Select(b < -c, C(0), db_in));
}

// Element e of y (f = y's columns): y[e] = f(x[e]), or f(a) b for a gated A.
template <typename A, typename T>
MPUSIM_HD void ActivationForwardAt(const T* x, T* y, int64_t e, int64_t f,
                                   const GluOptions& glu = {}) {
  using C = ComputeOf<T>;
  if constexpr (A::kGated) {
    const int64_t i = e / f, j = e % f;
    const C a = Load(x[i * 2 * f + j]);
    const C b = Load(x[i * 2 * f + f + j]);
    y[e] = Store<T>(GatedForward<A, C>(a, b, glu));
  } else {
    y[e] = Store<T>(Forward<A, C>(Load(x[e])));
  }
}

// Element e of dy (f = dy's columns): dx[e] = dy[e] f'(x[e]); for a gated A the pair
// (i, j), (i, f + j) of dx. Reads x before writing dx, so dx may be x.
template <typename A, typename T>
MPUSIM_HD void ActivationBackwardAt(const T* x, const T* dy, T* dx, int64_t e, int64_t f,
                                    const GluOptions& glu = {}) {
  using C = ComputeOf<T>;
  const C g = Load(dy[e]);
  if constexpr (A::kGated) {
    const int64_t i = e / f, j = e % f;
    const C a = Load(x[i * 2 * f + j]);
    const C b = Load(x[i * 2 * f + f + j]);
    C da, db;
    GatedBackward<A, C>(a, b, g, da, db, glu);
    dx[i * 2 * f + j] = Store<T>(da);
    dx[i * 2 * f + f + j] = Store<T>(db);
  } else {
    dx[e] = Store<T>(Backward<A, C>(Load(x[e]), g));
  }
}

}  // namespace ops

namespace ops {
// Visitors are structs, not template lambdas, so that the CUDA code (C++17) compiles them.
struct NameOf {
  template <typename A>
  std::string_view operator()() const {
    return A::kName;
  }
};
struct GatedOf {
  template <typename A>
  bool operator()() const {
    return A::kGated;
  }
};
}  // namespace ops

#undef MPUSIM_OP_VALUE

// The JSON name ("gelu", "swiglu", "squared_relu", "quick_geglu") and whether x = [a | b] is gated.
inline std::string_view ActivationName(Activation a) {
  return ops::VisitActivation(a, ops::NameOf{});
}
inline bool IsGated(Activation a) { return ops::VisitActivation(a, ops::GatedOf{}); }
// Every name, in enum order (a config's "activation" is one of them).
inline const std::vector<std::string_view>& ActivationNames() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> v;
    for (int i = 0; i < kActivationCount; ++i) {
      v.push_back(ActivationName(static_cast<Activation>(i)));
    }
    return v;
  }();
  return names;
}

}  // namespace mpusim
