// The op table: one case per Kernels method (core/kernels.h), run by every backend's test
// binary (tests/sim on the CPU, tests/cuda where a device is visible) in every float dtype,
// and compared with the same case in float64 on the CPU backend, as ggml's
// test-backend-ops compares each backend with its CPU one. A method without a row fails
// tests/sim's EveryKernelsMethodHasARow, which reads the Do* methods of core/kernels.h.
//
// Inputs are multiples of 1/8 in [-2, 2] (or small integers), exact in every dtype, so the
// float64 run sees the same inputs and the difference is the dtype's own arithmetic. An
// output passes when
//   max_e |actual_e - expected_e| <= factor * eps(dtype) * max_e |expected_e|
// (eps: 2^-52 float64, 2^-23 float32, 2^-8 bfloat16, 2^-11 float16: half an ulp of the
// stored 16-bit result plus the float32 work), factor being the row's bound: a few for one
// rounding, more where a row sums many terms or takes exp or log (within a few ulp, and
// the backends' math libraries differ in the last bits). Outputs that move or select stored
// elements (copies, the embedding lookup, TopK, RowMax) must be equal. The deeper checks
// of single ops (the activations' and the norms' own tables, tests/ops/activation_ops.h and
// norm_ops.h, against float64 formulas; the argument rules) stay in their own tables.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/dropout.h"
#include "core/kernels.h"
#include "core/ops/activation.h"
#include "core/ops/norm.h"
#include "core/optimizer_update.h"
#include "core/tensor.h"
#include "tests/kernel_test_util.h"

namespace mpusim::op_table {

// One output of a case, on the host, widened to double; `exact` when it must be equal.
struct Output {
  std::string name;
  std::vector<double> values;
  bool exact = false;
};
using Outputs = std::vector<Output>;

// A row: the Kernels method it runs (its name without Do), the bound factor, and the case.
struct OpCase {
  std::string_view method;
  double factor;
  Outputs (*run)(Kernels& k, DType dt);
};

// --- inputs ---------------------------------------------------------------------------

// n multiples of 1/8 in [-2, 2], a fixed pattern per seed.
inline std::vector<double> Grid(int64_t n, int seed) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) {
    v[static_cast<size_t>(e)] = static_cast<double>((e * 7 + seed * 13) % 33 - 16) / 8.0;
  }
  return v;
}
// The same, on the device in dtype dt.
inline Tensor In(Kernels& k, DType dt, const Shape& shape, int seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return k.ToDevice(MakeOf(dt, shape, Grid(n, seed)));
}
inline Tensor IdsIn(Kernels& k, const std::vector<int64_t>& ids) { return k.ToDevice(Ids(ids)); }
inline std::vector<int64_t> Iota(int64_t n, int64_t from = 0) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) v[static_cast<size_t>(e)] = from + e;
  return v;
}
inline Output Out(Kernels& k, std::string name, const Tensor& t, bool exact = false) {
  return {std::move(name), ValuesOf(k.ToHost(t)), exact};
}

// --- the cases, in kernels.h's order ----------------------------------------------------

inline Outputs Zeros(Kernels& k, DType dt) {
  return {Out(k, "zeros", k.Zeros({3, 5}, dt), true)};
}
inline Outputs Empty(Kernels& k, DType dt) {
  const Tensor t = k.Empty({4, 6}, dt);
  return {{"shape", {static_cast<double>(t.shape()[0]), static_cast<double>(t.shape()[1])}, true}};
}
inline Outputs ToDevice(Kernels& k, DType dt) { return {Out(k, "x", In(k, dt, {7, 3}, 1), true)}; }
inline Outputs ToHost(Kernels& k, DType dt) {
  return {{"x", ValuesOf(k.ToHost(In(k, dt, {2, 9}, 2))), true}};
}
inline Outputs Copy(Kernels& k, DType dt) {
  Tensor dst = k.Zeros({3, 4}, dt);
  k.Copy(In(k, dt, {12}, 3), dst);
  return {Out(k, "dst", dst, true)};
}
inline Outputs Convert(Kernels& k, DType dt) {
  // Grid values are exact in every dtype, so every conversion is.
  Outputs out;
  for (DType to : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    Tensor dst = k.Zeros({3, 4}, to);
    k.Convert(In(k, dt, {12}, 8), dst);
    out.push_back(Out(k, fmt::format("to {}", DTypeName(to)), dst, true));
  }
  return out;
}
inline Outputs SetZero(Kernels& k, DType dt) {
  Tensor x = In(k, dt, {4, 4}, 4);
  k.SetZero(x);
  return {Out(k, "x", x, true)};
}
inline Outputs CopyBlock(Kernels& k, DType dt) {
  Tensor dst = In(k, dt, {5, 6}, 5);
  k.CopyBlock(In(k, dt, {4, 7}, 6), 1, 2, dst, 2, 1, 3, 4);
  return {Out(k, "dst", dst, true)};
}
inline Outputs StridedCopy(Kernels& k, DType dt) {
  // [2, 3, 4] -> its transpose [4, 3, 2].
  Tensor dst = k.Zeros({4, 3, 2}, dt);
  k.StridedCopy(In(k, dt, {2, 3, 4}, 7), 0, {2, 3, 4}, {12, 4, 1}, dst, 0, {1, 2, 6});
  return {Out(k, "dst", dst, true)};
}
inline Outputs Gemm(Kernels& k, DType dt) {
  Outputs out;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const Tensor a = In(k, dt, ta ? Shape{9, 5} : Shape{5, 9}, 8);
      const Tensor b = In(k, dt, tb ? Shape{6, 9} : Shape{9, 6}, 9);
      Tensor c = In(k, dt, {5, 6}, 10);
      k.Gemm(ta, tb, 0.5, a, b, 2.0, c);
      out.push_back(Out(k, fmt::format("c (trans {} {})", ta, tb), c));
    }
  }
  return out;
}
inline Outputs BatchedGemm(Kernels& k, DType dt) {
  Tensor c = In(k, dt, {3, 4, 5}, 11);
  k.BatchedGemm(false, true, 1.0, In(k, dt, {3, 4, 7}, 12), In(k, dt, {3, 5, 7}, 13), 1.0, c);
  return {Out(k, "c", c)};
}
inline Outputs AddRowVector(Kernels& k, DType dt) {
  Tensor y = In(k, dt, {4, 6}, 14);
  k.AddRowVector(In(k, dt, {6}, 15), y);
  return {Out(k, "y", y)};
}
inline Outputs SumRows(Kernels& k, DType dt) {
  Tensor out = In(k, dt, {6}, 16);
  k.SumRows(In(k, dt, {9, 6}, 17), 0.5, out);
  return {Out(k, "out", out)};
}
inline Outputs Axpy(Kernels& k, DType dt) {
  Tensor y = In(k, dt, {17}, 18);
  k.Axpy(-1.5, In(k, dt, {17}, 19), y);
  return {Out(k, "y", y)};
}
inline Outputs Scale(Kernels& k, DType dt) {
  Tensor x = In(k, dt, {3, 7}, 20);
  k.Scale(0.75, x);
  return {Out(k, "x", x)};
}
// A gated activation's glu: offset 0.5, the clamp at 1 (a multiple of 1/8, so that inputs
// equal to the bound and beyond it both occur).
inline constexpr GluOptions kGlu{.linear_offset = 0.5, .clamped = true, .clamp_value = 1.0};
inline Outputs ActivationForward(Kernels& k, DType dt) {
  Outputs out;
  for (int i = 0; i < kActivationCount; ++i) {
    const auto act = static_cast<Activation>(i);
    const int64_t f = 6, w = IsGated(act) ? 2 * f : f;
    Tensor y = k.Zeros({4, f}, dt);
    k.ActivationForward(act, In(k, dt, {4, w}, 21), y);
    out.push_back(Out(k, std::string(ActivationName(act)), y));
    if (IsGated(act)) {  // Megatron's glu: the clamp at 1 (on the grid: the boundary too)
      k.ActivationForward(act, In(k, dt, {4, w}, 21), y, kGlu);
      out.push_back(Out(k, std::string(ActivationName(act)) + " glu", y));
    }
  }
  return out;
}
inline Outputs ActivationBackward(Kernels& k, DType dt) {
  Outputs out;
  for (int i = 0; i < kActivationCount; ++i) {
    const auto act = static_cast<Activation>(i);
    const int64_t f = 6, w = IsGated(act) ? 2 * f : f;
    Tensor dx = k.Zeros({4, w}, dt);
    k.ActivationBackward(act, In(k, dt, {4, w}, 22), In(k, dt, {4, f}, 23), dx);
    out.push_back(Out(k, std::string(ActivationName(act)), dx));
    if (IsGated(act)) {
      k.ActivationBackward(act, In(k, dt, {4, w}, 22), In(k, dt, {4, f}, 23), dx, kGlu);
      out.push_back(Out(k, std::string(ActivationName(act)) + " glu", dx));
    }
  }
  return out;
}
inline Outputs Dropout(Kernels& k, DType dt) {
  Tensor y = k.Zeros({5, 8}, dt);
  k.Dropout(In(k, dt, {5, 8}, 24), 0.25, 7, 3, 100, y);
  return {Out(k, "y", y)};
}
inline Outputs DropoutAt(Kernels& k, DType dt) {
  GlobalIndexMap map;
  map.base = 5;
  map.dims = {2, 3, 4};
  map.strides = {40, 8, 1};
  Tensor y = k.Zeros({6, 4}, dt);
  k.DropoutAt(In(k, dt, {6, 4}, 25), 0.5, 11, 2, map, y);
  return {Out(k, "y", y)};
}
inline Outputs NormForward(Kernels& k, DType dt) {
  Outputs out;
  const DType stats = ComputeDType(dt);
  for (int i = 0; i < kNormalizationCount; ++i) {
    const auto norm = static_cast<Normalization>(i);
    const bool centered = IsCentered(norm);
    const Tensor b = In(k, dt, {9}, 28);
    Tensor y = k.Zeros({5, 9}, dt), mean = k.Zeros({5}, stats), rstd = k.Zeros({5}, stats);
    k.NormForward(norm, In(k, dt, {5, 9}, 26), In(k, dt, {9}, 27), centered ? &b : nullptr,
                  1e-5, y, centered ? &mean : nullptr, rstd);
    const std::string name(NormalizationName(norm));
    out.push_back(Out(k, name + " y", y));
    if (centered) out.push_back(Out(k, name + " mean", mean));
    out.push_back(Out(k, name + " rstd", rstd));
  }
  return out;
}
inline Outputs NormBackward(Kernels& k, DType dt) {
  Outputs out;
  const DType stats = ComputeDType(dt);
  for (int i = 0; i < kNormalizationCount; ++i) {
    const auto norm = static_cast<Normalization>(i);
    const bool centered = IsCentered(norm);
    // The statistics are given (in the compute dtype), as a forward stored them.
    const Tensor mean = In(k, stats, {5}, 29);
    const Tensor rstd = k.ToDevice(MakeOf(stats, {5}, {0.5, 0.75, 1.0, 1.25, 1.5}));
    Tensor dx = k.Zeros({5, 9}, dt), dw = In(k, dt, {9}, 30), db = In(k, dt, {9}, 31);
    k.NormBackward(norm, In(k, dt, {5, 9}, 32), In(k, dt, {9}, 33), centered ? &mean : nullptr,
                   rstd, In(k, dt, {5, 9}, 34), dx, dw, centered ? &db : nullptr);
    const std::string name(NormalizationName(norm));
    out.push_back(Out(k, name + " dx", dx));
    out.push_back(Out(k, name + " dweight", dw));
    if (centered) out.push_back(Out(k, name + " dbias", db));
  }
  return out;
}

// Key positions in order (a prefix of visible keys per row), and out of order (context
// parallelism's load-balanced chunks: a mask).
inline const std::vector<std::vector<int64_t>>& KeyOrders() {
  static const std::vector<std::vector<int64_t>> orders = {Iota(8),
                                                           {0, 1, 6, 7, 2, 3, 4, 5}};
  return orders;
}
inline Outputs CausalSoftmaxForward(Kernels& k, DType dt) {
  Outputs out;
  for (const auto& k_order : KeyOrders()) {
    // Query positions 3..6 (row 0 sees 4 keys), two batch rows of them; then a sliding
    // window of 2 (a row sees itself and the 2 keys before it) with a sink per batch row
    // (two heads of 4 query rows).
    for (bool gpt_oss : {false, true}) {
      Tensor probs = k.Zeros({8, 8}, dt), lse = k.Zeros({8}, ComputeDType(dt));
      const Tensor sink = k.ToDevice(MakeOf(dt, {2}, {0.75, -1.5}));
      k.CausalSoftmaxForward(In(k, dt, {8, 8}, 35), IdsIn(k, Iota(4, 3)), IdsIn(k, k_order), 0.5,
                             probs, &lse, gpt_oss ? 2 : -1, gpt_oss ? &sink : nullptr);
      const std::string what =
          fmt::format("keys {}{}", k_order[2], gpt_oss ? ", window, sink" : "");
      out.push_back(Out(k, fmt::format("probs ({})", what), probs));
      out.push_back(Out(k, fmt::format("lse ({})", what), lse));
    }
  }
  return out;
}
inline Outputs CausalSoftmaxFromLse(Kernels& k, DType dt) {
  Outputs out;
  for (const auto& k_order : KeyOrders()) {
    const Tensor lse = k.ToDevice(
        MakeOf(ComputeDType(dt), {8}, {1.5, 2.0, 2.5, 3.0, 1.0, 0.5, 4.0, 2.25}));
    for (int64_t window : {-1, 1}) {
      Tensor probs = k.Zeros({8, 8}, dt);
      k.CausalSoftmaxFromLse(In(k, dt, {8, 8}, 36), lse, IdsIn(k, Iota(4, 3)), IdsIn(k, k_order),
                             0.5, probs, window);
      out.push_back(Out(k, fmt::format("probs (keys {}, window {})", k_order[2], window), probs));
    }
  }
  return out;
}
inline Outputs CausalSoftmaxBackward(Kernels& k, DType dt) {
  Outputs out;
  for (const auto& k_order : KeyOrders()) {
    for (bool given : {false, true}) {
      for (int64_t window : {-1, 2}) {
        const Tensor row_dot = In(k, ComputeDType(dt), {8}, 37);
        Tensor ds = k.Zeros({8, 8}, dt);
        k.CausalSoftmaxBackward(In(k, dt, {8, 8}, 38), In(k, dt, {8, 8}, 39), IdsIn(k, Iota(4, 3)),
                                IdsIn(k, k_order), 0.5, ds, given ? &row_dot : nullptr, window);
        out.push_back(Out(
            k, fmt::format("dscores (keys {}, row_dot {}, window {})", k_order[2], given, window),
            ds));
      }
    }
  }
  return out;
}
inline Outputs SoftmaxSinkGrad(Kernels& k, DType dt) {
  // 12 rows: 3 query rows per head, two heads, two samples; main_grad accumulates on 1/2.
  const Tensor sink = k.ToDevice(MakeOf(dt, {2}, {0.5, -1.25}));
  const Tensor lse = k.ToDevice(MakeOf(
      ComputeDType(dt), {12}, {1.5, 0.25, 2.0, -0.5, 1.0, 0.75, 2.5, 0.5, 1.25, 0.0, -0.25, 3.0}));
  const Tensor row_dot = In(k, ComputeDType(dt), {12}, 42);
  Tensor dsink = k.ToDevice(MakeOf(ComputeDType(dt), {2}, {0.5, 0.5}));
  k.SoftmaxSinkGrad(sink, lse, row_dot, 3, dsink);
  return {Out(k, "dsink", dsink)};
}
inline Outputs RowDot(Kernels& k, DType dt) {
  Tensor out = k.Zeros({6}, ComputeDType(dt));
  k.RowDot(In(k, dt, {6, 11}, 40), In(k, dt, {6, 11}, 41), out);
  return {Out(k, "out", out)};
}
inline Outputs LseMerge(Kernels& k, DType dt) {
  const DType c = ComputeDType(dt);
  const double inf = std::numeric_limits<double>::infinity();
  Tensor out = In(k, dt, {4, 5}, 42);
  Tensor lse = k.ToDevice(MakeOf(c, {4}, {1.0, -inf, 2.5, 0.5}));
  k.LseMerge(out, lse, In(k, dt, {4, 5}, 43), k.ToDevice(MakeOf(c, {4}, {1.5, 0.25, -inf, 0.5})));
  return {Out(k, "out", out), Out(k, "lse", lse)};
}
inline Outputs Rope(Kernels& k, DType dt) {
  Outputs out;
  for (bool inverse : {false, true}) {
    // dim 6 of 8 columns (rotary_percent < 1), positions 0..3 for 8 rows.
    Tensor y = k.Zeros({8, 8}, dt);
    k.Rope(In(k, dt, {8, 8}, 44), IdsIn(k, {0, 1, 5, 1000}), 10000.0, 6, inverse, y);
    out.push_back(Out(k, fmt::format("y (inverse {})", inverse), y));
  }
  return out;
}
inline Outputs TopK(Kernels& k, DType dt) {
  // Distinct scores per row, and a tie between columns 1 and 4 of row 2.
  std::vector<double> s;
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t j = 0; j < 6; ++j) s.push_back(static_cast<double>((j * 5 + r * 2) % 6) / 4.0);
  }
  s[2 * 6 + 4] = s[2 * 6 + 1];
  Tensor values = k.Zeros({3, 3}, dt), indices = k.Zeros({3, 3}, DType::kInt64);
  k.TopK(k.ToDevice(MakeOf(dt, {3, 6}, s)), 3, values, indices);
  return {Out(k, "values", values, true), Out(k, "indices", indices, true)};
}
inline Outputs EmbeddingForward(Kernels& k, DType dt) {
  Tensor out = k.Zeros({5, 4}, dt);
  k.EmbeddingForward(In(k, dt, {6, 4}, 45), IdsIn(k, {3, 9, 4, 8, 3}), 3, 9, out);
  return {Out(k, "out", out, true)};
}
inline Outputs EmbeddingBackward(Kernels& k, DType dt) {
  Tensor dw = In(k, dt, {6, 4}, 46);
  k.EmbeddingBackward(In(k, dt, {5, 4}, 47), IdsIn(k, {3, 9, 4, 8, 3}), 3, 9, dw);
  return {Out(k, "dweight", dw)};
}
inline Outputs RowMax(Kernels& k, DType dt) {
  Tensor m = k.Zeros({4}, ComputeDType(dt));
  k.RowMax(In(k, dt, {4, 9}, 48), m);
  return {Out(k, "row_max", m, true)};
}
inline Outputs CrossEntropyPartials(Kernels& k, DType dt) {
  const DType c = ComputeDType(dt);
  Tensor se = k.Zeros({4}, c), sz = k.Zeros({4}, c), tz = k.Zeros({4}, c);
  k.CrossEntropyPartials(In(k, dt, {4, 9}, 49), k.ToDevice(MakeOf(c, {4}, {2, 2, 1.5, 2})),
                         IdsIn(k, {10, 3, 20, 18}), 10, se, sz, tz);
  return {Out(k, "sum_exp", se), Out(k, "sum_z", sz), Out(k, "target_z", tz)};
}
inline Outputs CrossEntropyBackward(Kernels& k, DType dt) {
  const DType c = ComputeDType(dt);
  Tensor grad = k.Zeros({4, 9}, dt);
  k.CrossEntropyBackward(In(k, dt, {4, 9}, 50), k.ToDevice(MakeOf(c, {4}, {2, 2, 1.5, 2})),
                         k.ToDevice(MakeOf(c, {4}, {9.5, 7.25, 11.0, 8.5})),
                         IdsIn(k, {10, 3, 20, 18}), 10, 0.9, 0.0125,
                         k.ToDevice(MakeOf(c, {4}, {0.25, 0.25, 0.5, 0.125})), grad);
  return {Out(k, "grad", grad)};
}
inline Outputs OptimizerStep(Kernels& k, DType dt) {
  // Master in the compute dtype; the gradient and the parameter in dt (the precision-aware
  // optimizer reads a 16-bit main_grad as it is); the states in the compute dtype, or in
  // bfloat16 for a bfloat16 dt (its bf16 moments).
  const DType m = ComputeDType(dt);
  const DType state = dt == DType::kBFloat16 ? dt : m;
  Outputs out;
  for (auto kind : {OptimizerUpdate::Kind::kAdam, OptimizerUpdate::Kind::kSgd}) {
    OptimizerUpdate u;
    u.kind = kind;
    u.lr = 0.125;
    u.weight_decay = 0.5;
    u.bias_correction1 = 0.25;
    u.bias_correction2 = 0.5;
    u.momentum = 0.5;
    u.first_step = false;
    u.master_float64 = m == DType::kFloat64;
    const bool adam = kind == OptimizerUpdate::Kind::kAdam;
    Tensor master = In(k, m, {10}, 51), s1 = In(k, state, {10}, 52);
    Tensor s2 = adam ? k.ToDevice(MakeOf(state, {10}, std::vector<double>(10, 0.25))) : Tensor();
    Tensor param = k.Zeros({10}, dt);
    k.OptimizerStep(u, In(k, dt, {10}, 53), master, s1, s2, param);
    const std::string name = adam ? "adam" : "sgd";
    out.push_back(Out(k, name + " master", master));
    out.push_back(Out(k, name + " state1", s1));
    if (adam) out.push_back(Out(k, name + " state2", s2));
    out.push_back(Out(k, name + " param", param));
  }
  return out;
}
// A float16 state's scaling (whatever dt: the states are float32 and float16 here): its
// scale and quantized values, then those read back.
inline Outputs UnscaleState(Kernels& k, DType) {
  Tensor q = k.ToDevice(MakeOf(DType::kFloat16, {10}, Grid(10, 55)));
  Tensor scale = k.ToDevice(MakeOf(DType::kFloat32, {1}, {0.375}));
  Tensor out = k.Zeros({10}, DType::kFloat32);
  k.UnscaleState(q, scale, out);
  return {Out(k, "out", out)};
}
inline Outputs ScaleState(Kernels& k, DType) {
  Tensor x = In(k, DType::kFloat32, {10}, 56);
  Tensor scale = k.Zeros({1}, DType::kFloat32);
  Tensor q = k.Zeros({10}, DType::kFloat16);
  k.ScaleState(x, scale, q);
  return {Out(k, "scale", scale), Out(k, "q", q)};
}
inline Outputs SumOfSquares(Kernels& k, DType dt) {
  Tensor out = k.ToDevice(MakeOf(DType::kFloat64, {1}, {0.5}));
  k.SumOfSquares(In(k, dt, {40}, 54), out);
  return {Out(k, "out", out)};
}

// The table: every Kernels method, in kernels.h's order.
inline const std::vector<OpCase>& AllOps() {
  static const std::vector<OpCase> ops = {
      {"Zeros", 0, Zeros},
      {"Empty", 0, Empty},
      {"ToDevice", 0, ToDevice},
      {"ToHost", 0, ToHost},
      {"Copy", 0, Copy},
      {"Convert", 0, Convert},
      {"SetZero", 0, SetZero},
      {"CopyBlock", 0, CopyBlock},
      {"StridedCopy", 0, StridedCopy},
      {"Gemm", 16, Gemm},  // sums of 9 products
      {"BatchedGemm", 16, BatchedGemm},
      {"AddRowVector", 2, AddRowVector},
      {"SumRows", 16, SumRows},
      {"Axpy", 4, Axpy},
      {"Scale", 2, Scale},
      {"ActivationForward", 16, ActivationForward},  // erf, exp: a few ulp
      {"ActivationBackward", 16, ActivationBackward},
      {"Dropout", 2, Dropout},
      {"DropoutAt", 2, DropoutAt},
      {"NormForward", 32, NormForward},                    // row sums of 9, a sqrt
      {"NormBackward", 64, NormBackward},                  // row and column sums that cancel
      {"CausalSoftmaxForward", 32, CausalSoftmaxForward},  // exp, sums, log
      {"CausalSoftmaxFromLse", 16, CausalSoftmaxFromLse},
      {"CausalSoftmaxBackward", 32, CausalSoftmaxBackward},
      {"SoftmaxSinkGrad", 16, SoftmaxSinkGrad},  // exp, sums of 6
      {"RowDot", 16, RowDot},
      {"LseMerge", 16, LseMerge},
      {"Rope", 8, Rope},  // cos and sin rounded to the compute type
      {"TopK", 0, TopK},
      {"EmbeddingForward", 0, EmbeddingForward},
      {"EmbeddingBackward", 4, EmbeddingBackward},
      {"RowMax", 0, RowMax},
      {"CrossEntropyPartials", 32, CrossEntropyPartials},
      {"CrossEntropyBackward", 16, CrossEntropyBackward},
      {"OptimizerStep", 4, OptimizerStep},
      {"UnscaleState", 2, UnscaleState},  // float32 products of float16 values
      {"ScaleState", 4, ScaleState},      // float32 scale, float16 rounding
      {"SumOfSquares", 4, SumOfSquares},
  };
  return ops;
}

// Half an ulp of a 16-bit result plus the float32 work; the compute type's epsilon else.
inline double Eps(DType dt) {
  switch (dt) {
    case DType::kFloat64: return std::ldexp(1.0, -52);
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -23);
  }
}

// Every output of `actual` against `expected` (the float64 CPU run) under the row's bound.
inline ::testing::AssertionResult Matches(const OpCase& op, DType dt, const Outputs& actual,
                                          const Outputs& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << op.method << " (" << DTypeName(dt) << "): " << actual.size() << " outputs, "
           << expected.size() << " expected";
  }
  for (size_t o = 0; o < actual.size(); ++o) {
    const std::vector<double>& a = actual[o].values;
    const std::vector<double>& e = expected[o].values;
    const std::string name =
        fmt::format("{} {} ({})", op.method, expected[o].name, DTypeName(dt));
    if (a.size() != e.size()) {
      return ::testing::AssertionFailure() << name << ": " << a.size() << " elements, "
                                           << e.size() << " expected";
    }
    double scale = 0;
    for (double v : e) {
      if (std::isfinite(v)) scale = std::max(scale, std::fabs(v));
    }
    const double bound = expected[o].exact ? 0 : op.factor * Eps(dt) * scale;
    for (size_t i = 0; i < a.size(); ++i) {
      const bool same = a[i] == e[i] || (std::isnan(a[i]) && std::isnan(e[i]));
      if (!same && !(std::fabs(a[i] - e[i]) <= bound)) {
        return ::testing::AssertionFailure()
               << name << ": element " << i << " is " << a[i] << ", expected " << e[i]
               << " (bound " << bound << " = " << op.factor << " eps * " << scale << ")";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Every row in every float dtype on `k`, against the rows' float64 run on `cpu`.
inline void CheckAll(Kernels& k, Kernels& cpu) {
  for (const OpCase& op : AllOps()) {
    SCOPED_TRACE(std::string(op.method));
    const Outputs expected = op.run(cpu, DType::kFloat64);
    for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      EXPECT_TRUE(Matches(op, dt, op.run(k, dt), expected));
    }
  }
}

}  // namespace mpusim::op_table
