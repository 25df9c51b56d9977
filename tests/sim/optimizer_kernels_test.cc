// The optimizer kernels of the CPU backend (Kernels::OptimizerStep, SumOfSquares) against
// AdamW and momentum SGD written out here, element by element, from their definitions
// (torch.optim.AdamW / Megatron's fused Adam, torch.optim.SGD), with the master and the
// states rounded to the master dtype after each update as the optimizer stores them.
// The same float64 operations in the same order: every result must be bit-identical.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/half.h"
#include "core/optimizer_update.h"
#include "core/philox.h"
#include "sim/eigen_kernels.h"
#include "tests/kernel_test_util.h"

namespace mpusim {
namespace {

std::vector<double> Reals(uint64_t key, int64_t n, double scale = 1.0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) {
    v[static_cast<size_t>(e)] = scale * (2 * UniformAt(key, 3, static_cast<uint64_t>(e)) - 1);
  }
  return v;
}

double RoundToMaster(double v, bool float64) {
  return float64 ? v : static_cast<double>(static_cast<float>(v));
}

struct Expected {
  std::vector<double> master, m, v;
};

// Three steps of AdamW (adam = true) or momentum SGD on `master` with the gradients
// grads[step], as written in the optimizers' documentation.
Expected Reference(bool adam, bool float64, std::vector<double> w,
                   const std::vector<std::vector<double>>& grads, double lr, double wd) {
  const double b1 = 0.9, b2 = 0.95, eps = 1e-8, mu = 0.8;
  std::vector<double> m(w.size(), 0.0), v(w.size(), 0.0);
  for (size_t step = 1; step <= grads.size(); ++step) {
    for (size_t e = 0; e < w.size(); ++e) {
      const double g = grads[step - 1][e];
      if (adam) {
        m[e] = RoundToMaster(b1 * m[e] + (1 - b1) * g, float64);
        v[e] = RoundToMaster(b2 * v[e] + (1 - b2) * g * g, float64);
        const double m_hat = m[e] / (1 - std::pow(b1, static_cast<double>(step)));
        const double v_hat = v[e] / (1 - std::pow(b2, static_cast<double>(step)));
        w[e] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + wd * w[e]);
      } else {
        const double d = g + wd * w[e];
        m[e] = RoundToMaster(step == 1 ? d : mu * m[e] + d, float64);
        w[e] -= lr * m[e];
      }
      w[e] = RoundToMaster(w[e], float64);
    }
  }
  return {w, m, v};
}

OptimizerUpdate Update(bool adam, bool float64, int step, double lr, double wd) {
  OptimizerUpdate u;
  u.kind = adam ? OptimizerUpdate::Kind::kAdam : OptimizerUpdate::Kind::kSgd;
  u.lr = lr;
  u.weight_decay = wd;
  u.beta1 = 0.9;
  u.beta2 = 0.95;
  u.eps = 1e-8;
  u.bias_correction1 = 1 - std::pow(0.9, step);
  u.bias_correction2 = 1 - std::pow(0.95, step);
  u.momentum = 0.8;
  u.first_step = step == 1;
  u.master_float64 = float64;
  return u;
}

// Every gradient dtype, master dtype and parameter dtype, both optimizers.
TEST(OptimizerKernels, StepMatchesTheDefinitionsBitForBit) {
  EigenKernels k;
  const int64_t n = 257;
  for (const bool adam : {true, false}) {
    for (const DType grad_dtype : {DType::kFloat32, DType::kFloat64}) {
      for (const DType master_dtype : {DType::kFloat32, DType::kFloat64}) {
        for (const DType param_dtype :
             {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
          SCOPED_TRACE(::testing::Message()
                       << (adam ? "adam" : "sgd") << " grad " << DTypeName(grad_dtype)
                       << " master " << DTypeName(master_dtype) << " param "
                       << DTypeName(param_dtype));
          const bool float64 = master_dtype == DType::kFloat64;
          // The master starts as the parameter's values widened.
          const std::vector<double> start =
              ValuesOf(MakeOf(param_dtype, {n}, Reals(11, n)));
          std::vector<std::vector<double>> grads;
          for (uint64_t step = 0; step < 3; ++step) {
            grads.push_back(ValuesOf(MakeOf(grad_dtype, {n}, Reals(20 + step, n, 0.1))));
          }
          ASSERT_GT(Norm(grads[0]), 0);
          const double lr = 0.01, wd = 0.1;
          Tensor master = MakeOf(master_dtype, {n}, start);
          const std::vector<double> master_start = ValuesOf(master);
          Tensor m = k.Zeros({n}, master_dtype);
          Tensor v = adam ? k.Zeros({n}, master_dtype) : Tensor();
          Tensor param = k.Zeros({n}, param_dtype);
          for (int step = 1; step <= 3; ++step) {
            const Tensor grad = MakeOf(grad_dtype, {n}, grads[static_cast<size_t>(step - 1)]);
            k.OptimizerStep(Update(adam, float64, step, lr, wd), grad, master, m, v, param);
          }
          const Expected want = Reference(adam, float64, master_start, grads, lr, wd);
          EXPECT_TRUE(TensorsNear("master", ValuesOf(master), want.master));
          EXPECT_TRUE(TensorsNear("state1", ValuesOf(m), want.m));
          if (adam) {
            EXPECT_TRUE(TensorsNear("state2", ValuesOf(v), want.v));
          }
          // The parameter is the master rounded once more, to its storage dtype.
          EXPECT_TRUE(TensorsNear("param", ValuesOf(param),
                                  ValuesOf(MakeOf(param_dtype, {n}, want.master))));
          // Something moved: the test would pass on an identity otherwise.
          EXPECT_NE(ValuesOf(master), master_start);
        }
      }
    }
  }
}

TEST(OptimizerKernels, SumOfSquaresAccumulatesInFloat64) {
  EigenKernels k;
  Tensor out = k.Zeros({1}, DType::kFloat64);
  // Integer-valued data: every partial sum is exact.
  const Tensor a = Make<float>({2, 3}, {1, -2, 3, 4, 0, -5});   // 55
  const Tensor b = Make<double>({4}, {6, 7, -8, 1e8});          // 149 + 1e16
  k.SumOfSquares(a, out);
  EXPECT_EQ(ValuesOf(out)[0], 55.0);
  k.SumOfSquares(b, out);
  EXPECT_EQ(ValuesOf(out)[0], 55.0 + 149.0 + 1e16);
  // Float32 squares are formed in float64: 16777217^2 has no float32 representation.
  Tensor exact = k.Zeros({1}, DType::kFloat64);
  k.SumOfSquares(Make<float>({1}, {4097}), exact);
  EXPECT_EQ(ValuesOf(exact)[0], 4097.0 * 4097.0);
}

TEST(OptimizerKernels, RefuseBadArguments) {
  EigenKernels k;
  const OptimizerUpdate adam = Update(true, false, 1, 0.1, 0.0);
  const OptimizerUpdate sgd = Update(false, false, 1, 0.1, 0.0);
  Tensor grad = k.Zeros({4}, DType::kFloat32), master = k.Zeros({4}, DType::kFloat32);
  Tensor m = k.Zeros({4}, DType::kFloat32), v = k.Zeros({4}, DType::kFloat32);
  Tensor param = k.Zeros({4}, DType::kBFloat16), none;
  EXPECT_NO_THROW(k.OptimizerStep(adam, grad, master, m, v, param));
  EXPECT_NO_THROW(k.OptimizerStep(sgd, grad, master, m, none, param));
  EXPECT_THROW(k.OptimizerStep(adam, grad, master, m, none, param), std::invalid_argument);
  EXPECT_THROW(k.OptimizerStep(sgd, grad, master, m, v, param), std::invalid_argument);
  Tensor short_param = k.Zeros({3}, DType::kFloat32);
  EXPECT_THROW(k.OptimizerStep(adam, grad, master, m, v, short_param), std::invalid_argument);
  // A 16-bit main_grad and bfloat16 moments beside a float32 master (the precision-aware
  // optimizer), nothing 16-bit beside a float64 one, no float16 state (it is scaled first).
  Tensor bf16_grad = k.Zeros({4}, DType::kBFloat16);
  Tensor bf16_m = k.Zeros({4}, DType::kBFloat16), bf16_v = k.Zeros({4}, DType::kBFloat16);
  EXPECT_NO_THROW(k.OptimizerStep(adam, bf16_grad, master, bf16_m, bf16_v, param));
  EXPECT_NO_THROW(k.OptimizerStep(adam, grad, master, bf16_m, v, param));
  Tensor fp16_v = k.Zeros({4}, DType::kFloat16);
  EXPECT_THROW(k.OptimizerStep(adam, grad, master, m, fp16_v, param), std::invalid_argument);
  Tensor bf16_master = k.Zeros({4}, DType::kBFloat16);
  EXPECT_THROW(k.OptimizerStep(adam, grad, bf16_master, m, v, param), std::invalid_argument);
  const OptimizerUpdate adam64 = Update(true, true, 1, 0.1, 0.0);
  EXPECT_THROW(k.OptimizerStep(adam64, grad, master, m, v, param), std::invalid_argument);
  Tensor master64 = k.Zeros({4}, DType::kFloat64), m64 = k.Zeros({4}, DType::kFloat64);
  Tensor v64 = k.Zeros({4}, DType::kFloat64);
  EXPECT_NO_THROW(k.OptimizerStep(adam64, grad, master64, m64, v64, param));
  EXPECT_THROW(k.OptimizerStep(adam64, bf16_grad, master64, m64, v64, param),
               std::invalid_argument);
  EXPECT_THROW(k.OptimizerStep(adam64, grad, master64, bf16_m, v64, param), std::invalid_argument);
  Tensor aliased = master;  // the parameter written over its own master
  EXPECT_THROW(k.OptimizerStep(adam, grad, master, m, v, aliased), std::invalid_argument);
  Tensor out32 = k.Zeros({1}, DType::kFloat32), out2 = k.Zeros({2}, DType::kFloat64);
  EXPECT_THROW(k.SumOfSquares(grad, out32), std::invalid_argument);
  EXPECT_THROW(k.SumOfSquares(grad, out2), std::invalid_argument);
  EXPECT_THROW(k.SumOfSquares(param, out2), std::invalid_argument);
  // The float16 states' scaling: float16 values, a float32 scale of one element.
  Tensor q = k.Zeros({4}, DType::kFloat16), scale = k.Zeros({1}, DType::kFloat32);
  EXPECT_NO_THROW(k.UnscaleState(q, scale, grad));
  EXPECT_NO_THROW(k.ScaleState(grad, scale, q));
  EXPECT_THROW(k.UnscaleState(bf16_m, scale, grad), std::invalid_argument);
  EXPECT_THROW(k.ScaleState(grad, out32, param), std::invalid_argument);
  Tensor scale2 = k.Zeros({2}, DType::kFloat32);
  EXPECT_THROW(k.ScaleState(grad, scale2, q), std::invalid_argument);
}

TEST(OptimizerKernels, FlatSliceSharesStorage) {
  EigenKernels k;
  Tensor flat = Make<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor middle = flat.FlatSlice(2, 3);
  EXPECT_EQ(middle.shape(), (Shape{3}));
  EXPECT_EQ(ValuesOf(middle), (std::vector<double>{3, 4, 5}));
  k.Scale(10, middle);
  EXPECT_EQ(ValuesOf(flat), (std::vector<double>{1, 2, 30, 40, 50, 6}));
  EXPECT_EQ(flat.FlatSlice(6, 0).numel(), 0);
  EXPECT_THROW(flat.FlatSlice(4, 3), std::out_of_range);
  EXPECT_THROW(flat.FlatSlice(-1, 1), std::out_of_range);
  EXPECT_THROW(flat.FlatSlice(7, 0), std::out_of_range);
}

// The precision-aware optimizer's states against values worked out by hand from Transformer
// Engine's formulas (transformer_engine/pytorch/optimizers/fused_adam.py, common/
// multi_tensor/adam.cu), each operation rounded as torch and the kernel round it (float32,
// then bfloat16 or float16 to nearest even).
TEST(OptimizerKernels, PrecisionAwareStatesFollowTransformerEngine) {
  EigenKernels k;
  // bfloat16 moments, a bfloat16 main_grad of 0.5, master 1, lr 0.01, no weight decay, betas
  // 0.9 and 0.95. Step 1: m = 0.1 * 0.5 is 0.05f in the kernel's float32 register, stored
  // as bf16 205 * 2^-12; v = 0.05 * 0.25 is 0.0125f, stored as 205 * 2^-14. The update reads
  // the float32 values (m_hat 0.5, sqrt(v_hat) 0.5): master 1 - 0.01 = 0.99f, the parameter
  // its bf16 253 / 256. Step 2 reads the stored moments: m = 0.9 * 205 * 2^-12 + 0.05 =
  // 0.0950439...f, stored as 195 * 2^-11; v = 0.95 * 205 * 2^-14 + 0.0125 = 0.0243865...f,
  // stored as 2^-12 * 100.
  Tensor grad = MakeOf(DType::kBFloat16, {1}, {0.5});
  Tensor master = MakeOf(DType::kFloat32, {1}, {1.0});
  Tensor m = k.Zeros({1}, DType::kBFloat16), v = k.Zeros({1}, DType::kBFloat16);
  Tensor param = k.Zeros({1}, DType::kBFloat16);
  k.OptimizerStep(Update(true, false, 1, 0.01, 0.0), grad, master, m, v, param);
  EXPECT_EQ(ValuesOf(m)[0], 205 * 0x1p-12);
  EXPECT_EQ(ValuesOf(v)[0], 205 * 0x1p-14);
  EXPECT_EQ(ValuesOf(master)[0], static_cast<double>(0.99f));
  EXPECT_EQ(ValuesOf(param)[0], 253.0 / 256.0);
  k.OptimizerStep(Update(true, false, 2, 0.01, 0.0), grad, master, m, v, param);
  EXPECT_EQ(ValuesOf(m)[0], 195 * 0x1p-11);
  EXPECT_EQ(ValuesOf(v)[0], 100 * 0x1p-12);

  // A float16 state (_apply_scale): absmax 0.03f, s = 0.03f / 32752 (float32: bits
  // 0x3575e14b), r = 1 / s; q = fp16(x * r): 32752, -1637.6 -> -1638, 0, and 1e-9 -> 1145 *
  // 2^-20. Read back (get_unscaled_state) as q * s in float32.
  Tensor x = MakeOf(DType::kFloat32, {4}, {0.03f, -0.0015f, 0.0f, 1e-9f});
  Tensor scale = k.Zeros({1}, DType::kFloat32), q = k.Zeros({4}, DType::kFloat16);
  k.ScaleState(x, scale, q);
  EXPECT_EQ(std::bit_cast<uint32_t>(scale.data_as<float>()[0]), 0x3575e14bu);
  EXPECT_EQ(ValuesOf(q), (std::vector<double>{32752, -1638, 0, 1145 * 0x1p-20}));
  Tensor back = k.Zeros({4}, DType::kFloat32);
  k.UnscaleState(q, scale, back);
  const float s = scale.data_as<float>()[0];
  EXPECT_EQ(ValuesOf(back), (std::vector<double>{32752.0f * s, -1638.0f * s, 0.0f,
                                                 static_cast<float>(1145 * 0x1p-20) * s}));
  EXPECT_EQ(ValuesOf(back)[0], static_cast<double>(0.029999999329447746f));
  // All zeros (a moment before its first step): scale 0, and r = 0 rather than 1 / 0.
  Tensor zeros = k.Zeros({4}, DType::kFloat32);
  k.ScaleState(zeros, scale, q);
  EXPECT_EQ(ValuesOf(scale)[0], 0.0);
  EXPECT_EQ(ValuesOf(q), std::vector<double>(4, 0.0));
}

// Transformer Engine's store_param_remainders (common/multi_tensor/adam.cu
// AdamFunctorMasterParamRemainder), by hand. A float32 master of bits (h << 16) | r: the
// parameter is h, plus 1 when r as an int16 is negative (the low half at least 0x8000), the
// remainder r; reading back subtracts that 1 again.
TEST(OptimizerKernels, ParamRemainderSplitsAsTransformerEngine) {
  struct Case {
    uint32_t master;
    uint16_t param, remainder;
  };
  const Case cases[] = {
      // 1 + 2^-8, a tie between bf16 1 (0x3f80, even) and 1 + 2^-7: TE rounds away from
      // zero to 0x3f81, round-to-nearest-even keeps 0x3f80.
      {0x3f808000u, 0x3f81, 0x8000},
      // -(1 + 2^-8), the same tie negative: to -(1 + 2^-7), away from zero.
      {0xbf808000u, 0xbf81, 0x8000},
      // -(1 + 2^-8 + 2^-9): above the half (r = 0xc000 < 0), to 0xbf81 as RNE does.
      {0xbf80c000u, 0xbf81, 0xc000},
      // Below the half (r = 0x3000 >= 0): the high half as is.
      {0xbf803000u, 0xbf80, 0x3000},
      // A bf16 value (r = 0): the initial master, the parameter widened.
      {0x3f000000u, 0x3f00, 0x0000},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << std::hex << "master 0x" << c.master);
    BFloat16 param, remainder;
    ParamRemainder::Split(BitsFloat(c.master), param, remainder);
    EXPECT_EQ(param.bits, c.param);
    EXPECT_EQ(remainder.bits, c.remainder);
    // "if rem < 0: p--": 0x3f81 with 0x8000 reads 1 + 2^-8, not 1 + 2^-7 + 2^-8.
    EXPECT_EQ(FloatBits(ParamRemainder::Join(BFloat16{c.param}, BFloat16{c.remainder})), c.master);
  }
  // Ties aside, the parameter is the master rounded to nearest even (ToBFloat16); the split
  // loses nothing.
  int ties = 0;
  for (uint64_t e = 0; e < 4096; ++e) {
    const float x = static_cast<float>(4 * (2 * UniformAt(31, 3, e) - 1));
    const uint32_t bits =
        (FloatBits(x) & 0xffff0000u) | (e % 7 == 0 ? 0x8000u : FloatBits(x) & 0xffffu);
    BFloat16 param, remainder;
    ParamRemainder::Split(BitsFloat(bits), param, remainder);
    EXPECT_EQ(FloatBits(ParamRemainder::Join(param, remainder)), bits);
    const uint16_t rne = ToBFloat16(BitsFloat(bits)).bits;
    const bool away_from_even = (bits & 0xffffu) == 0x8000u && ((bits >> 16) & 1u) == 0;
    ties += away_from_even;
    EXPECT_EQ(param.bits, away_from_even ? rne + 1 : rne) << std::hex << bits;
  }
  EXPECT_GT(ties, 0);
}

// The kernel with param_remainders: its master, read from the parameter and the remainder,
// is bit for bit the float32 master of the same steps without remainders; its parameter
// differs from that run's (rounded to nearest even) only at ties. Step 1, lr 2^-8, eps 1e-8,
// no weight decay, |g| = 0.5: the update is lr * g / (|g| + eps), so w - sign(g) 2^-8
// (within 1e-10, under half a float32 ulp): 1 + 2^-7 -> 1 + 2^-8 and -(1 + 2^-7) -> -(1 +
// 2^-8), both ties (parameter 1 + 2^-7, remainder 0x8000, where RNE gives 1); 0.5 -> 0.5 -
// 2^-8, a bf16 value (remainder 0). Step 2 rebuilds 1 + 2^-8 from 0x3f81 and 0x8000.
TEST(OptimizerKernels, ParamRemaindersKeepTheFloat32Master) {
  EigenKernels k;
  const std::vector<double> start = {1 + 0x1p-7, -(1 + 0x1p-7), 0.5};
  const std::vector<double> g = {0.5, -0.5, 0.5};
  Tensor remainder = k.Zeros({3}, DType::kBFloat16);  // Optimizer::kRemainderDType
  Tensor param = MakeOf(DType::kBFloat16, {3}, start);
  Tensor master = MakeOf(DType::kFloat32, {3}, start), plain_param = k.Zeros({3}, DType::kBFloat16);
  Tensor m = k.Zeros({3}, DType::kBFloat16), v = k.Zeros({3}, DType::kFloat32);
  Tensor plain_m = k.Zeros({3}, DType::kBFloat16), plain_v = k.Zeros({3}, DType::kFloat32);
  for (int step = 1; step <= 3; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const Tensor grad = MakeOf(DType::kBFloat16, {3}, g);
    OptimizerUpdate u = Update(true, false, step, 0x1p-8, 0.0);
    k.OptimizerStep(u, grad, master, plain_m, plain_v, plain_param);
    u.param_remainders = true;
    k.OptimizerStep(u, grad, remainder, m, v, param);
    const BFloat16* p = param.data_as<BFloat16>();
    const BFloat16* r = remainder.data_as<BFloat16>();
    for (int64_t e = 0; e < 3; ++e) {
      EXPECT_EQ(FloatBits(ParamRemainder::Join(p[e], r[e])), FloatBits(master.data_as<float>()[e]))
          << "element " << e;
    }
    EXPECT_EQ(ValuesOf(m), ValuesOf(plain_m));
    EXPECT_EQ(ValuesOf(v), ValuesOf(plain_v));
    if (step == 1) {
      EXPECT_EQ(ValuesOf(master), (std::vector<double>{1 + 0x1p-8, -(1 + 0x1p-8), 0.5 - 0x1p-8}));
      EXPECT_EQ(ValuesOf(param), (std::vector<double>{1 + 0x1p-7, -(1 + 0x1p-7), 0.5 - 0x1p-8}));
      EXPECT_EQ(ValuesOf(plain_param), (std::vector<double>{1, -1, 0.5 - 0x1p-8}));
      EXPECT_EQ(r[0].bits, 0x8000);
      EXPECT_EQ(r[1].bits, 0x8000);
      EXPECT_EQ(r[2].bits, 0x0000);
    }
  }
  // Refused: a remainder that is not 2 bytes of bfloat16, a parameter that is not bfloat16.
  OptimizerUpdate u = Update(true, false, 1, 0.01, 0.0);
  u.param_remainders = true;
  const Tensor grad = k.Zeros({3}, DType::kFloat32);
  Tensor fp32_param = k.Zeros({3}, DType::kFloat32);
  EXPECT_THROW(k.OptimizerStep(u, grad, master, m, v, param), std::invalid_argument);
  EXPECT_THROW(k.OptimizerStep(u, grad, remainder, m, v, fp32_param), std::invalid_argument);
  EXPECT_NO_THROW(k.OptimizerStep(u, grad, remainder, m, v, param));
}

}  // namespace
}  // namespace mpusim
