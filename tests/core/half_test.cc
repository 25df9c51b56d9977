// core/half.h against an independent oracle: every 16-bit pattern decoded by the IEEE
// formula, and float -> 16-bit rounding checked by searching the sorted table of all
// representable values for the nearest one (ties to the even pattern), over every tie
// point, its neighbours and a million random float bit patterns.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/half.h"
#include "core/tensor.h"

namespace mpusim {
namespace {

struct Format {
  int exponent_bits;
  int mantissa_bits;
};
constexpr Format kBf16{8, 7};
constexpr Format kFp16{5, 10};

// (-1)^s * 2^(e - bias) * (1 + m / 2^M), subnormals 2^(1 - bias) * m / 2^M.
double Decode(Format f, uint16_t bits) {
  const int m_bits = f.mantissa_bits;
  const int bias = (1 << (f.exponent_bits - 1)) - 1;
  const int max_exponent = (1 << f.exponent_bits) - 1;
  const bool negative = (bits >> 15) != 0;
  const int exponent = (bits >> m_bits) & max_exponent;
  const int mantissa = bits & ((1 << m_bits) - 1);
  double magnitude;
  if (exponent == max_exponent) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<double>(mantissa), 1 - bias - m_bits);
  } else {
    magnitude = std::ldexp(1.0 + std::ldexp(static_cast<double>(mantissa), -m_bits), exponent - bias);
  }
  return negative ? -magnitude : magnitude;
}

uint16_t Bits(BFloat16 h) { return h.bits; }
uint16_t Bits(Float16 h) { return h.bits; }

// Non-negative finite patterns in increasing order, then +inf (whose pattern is even, so it
// wins the tie with the largest finite value, as IEEE overflow rounding says).
std::vector<uint16_t> Ladder(Format f) {
  const uint16_t inf = static_cast<uint16_t>(((1 << f.exponent_bits) - 1) << f.mantissa_bits);
  std::vector<uint16_t> out;
  for (uint32_t b = 0; b <= inf; ++b) out.push_back(static_cast<uint16_t>(b));
  return out;
}

// The oracle: nearest ladder value to |x| (ties to an even pattern), sign copied.
uint16_t NearestPattern(Format f, const std::vector<uint16_t>& ladder, float x) {
  const double a = std::fabs(static_cast<double>(x));
  const auto above = std::lower_bound(ladder.begin(), ladder.end(), a, [&](uint16_t b, double v) {
    return Decode(f, b) < v;
  });
  uint16_t pick;
  if (above == ladder.end()) {
    pick = ladder.back();  // beyond the largest finite value: inf
  } else if (above == ladder.begin() || Decode(f, *above) == a) {
    pick = *above;
  } else {
    const uint16_t lo = *(above - 1), hi = *above;
    // Beyond the largest finite value, the "next" value is 2^(emax+1) for the tie rule.
    double hi_value = Decode(f, hi);
    if (std::isinf(hi_value)) {
      hi_value = 2 * Decode(f, lo) - Decode(f, static_cast<uint16_t>(lo - 1));
    }
    const double dlo = a - Decode(f, lo), dhi = hi_value - a;
    pick = dlo < dhi ? lo : (dhi < dlo ? hi : ((lo & 1) == 0 ? lo : hi));
  }
  return static_cast<uint16_t>(pick | (std::signbit(x) ? 0x8000 : 0));
}

template <typename H>
void CheckRounding(Format f, H (*round)(float)) {
  const std::vector<uint16_t> ladder = Ladder(f);
  std::vector<float> inputs = {0.0f, -0.0f, 1.0f, -1.0f, 3.0e38f, -3.4e38f, 1e-45f, -1e-45f,
                               65504.0f, 65519.99f, 65520.0f, 65536.0f, 5.9604645e-8f,
                               2.9802322e-8f, 2.9802326e-8f, INFINITY, -INFINITY};
  // Every midpoint between neighbours, and one float ulp either side.
  for (size_t i = 0; i + 1 < ladder.size(); ++i) {
    const double lo = Decode(f, ladder[i]);
    double hi = Decode(f, ladder[i + 1]);
    if (std::isinf(hi)) hi = 2 * lo - Decode(f, ladder[i - 1]);
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: fewer bits than float
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      inputs.push_back(x);
      inputs.push_back(-x);
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) inputs.push_back(BitsFloat(static_cast<uint32_t>(rng())));
  int64_t wrong = 0;
  for (float x : inputs) {
    const uint16_t got = Bits(round(x));
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(Decode(f, got))) << x;
      EXPECT_EQ(got >> 15, FloatBits(x) >> 31) << "NaN keeps its sign";
      continue;
    }
    const uint16_t want = NearestPattern(f, ladder, x);
    if (got != want && ++wrong <= 5) {
      ADD_FAILURE() << "x = " << x << " (bits " << std::hex << FloatBits(x) << "): got " << got
                    << ", want " << want;
    }
  }
  EXPECT_EQ(wrong, 0);
}

TEST(Half, EveryPatternWidensExactly) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const double bf = Decode(kBf16, bits), fp = Decode(kFp16, bits);
    const float got_bf = ToFloat(BFloat16{bits}), got_fp = ToFloat(Float16{bits});
    if (std::isnan(bf)) {
      EXPECT_TRUE(std::isnan(got_bf)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(got_bf), bf) << b;
      // Widening then rounding gives the pattern back.
      EXPECT_EQ(ToBFloat16(got_bf).bits, bits) << b;
    }
    if (std::isnan(fp)) {
      EXPECT_TRUE(std::isnan(got_fp)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(got_fp), fp) << b;
      EXPECT_EQ(ToFloat16(got_fp).bits, bits) << b;
    }
  }
}

TEST(Half, BFloat16RoundsToNearestEven) { CheckRounding(kBf16, &ToBFloat16); }
TEST(Half, Float16RoundsToNearestEven) { CheckRounding(kFp16, &ToFloat16); }

TEST(Half, KnownValues) {
  EXPECT_EQ(ToBFloat16(1.0f).bits, 0x3f80);
  EXPECT_EQ(ToBFloat16(1.00390625f).bits, 0x3f80);  // 1 + 2^-8: tie, to even
  EXPECT_EQ(ToBFloat16(1.01171875f).bits, 0x3f82);  // 1 + 3*2^-8: tie, to even (up)
  EXPECT_EQ(ToFloat16(1.0f).bits, 0x3c00);
  EXPECT_EQ(ToFloat16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(ToFloat16(65520.0f).bits, 0x7c00);        // overflow by rounding
  EXPECT_EQ(ToFloat16(5.9604645e-8f).bits, 0x0001);   // 2^-24, the smallest subnormal
  EXPECT_EQ(ToFloat16(2.98023224e-8f).bits, 0x0000);  // 2^-25: tie, to even (zero)
  EXPECT_EQ(RoundTo<BFloat16>(0.1).bits, 0x3dcd);
  EXPECT_EQ(Widen(Float16{0xc000}), -2.0);
}

TEST(Half, HostValueAccessorsRoundOnceThroughFloat) {
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16}) {
    Tensor t = Tensor::HostZeros({3}, d);
    SetHostValue(t, 0, 0.1);
    SetHostValue(t, 1, -3.0);
    SetHostValue(t, 2, 1e6);
    const double tenth = d == DType::kFloat64   ? 0.1
                         : d == DType::kFloat32 ? static_cast<double>(0.1f)
                         : d == DType::kBFloat16 ? Widen(RoundTo<BFloat16>(0.1))
                                                 : Widen(RoundTo<Float16>(0.1));
    EXPECT_EQ(HostValue(t, 0), tenth) << DTypeName(d);
    EXPECT_EQ(HostValue(t, 1), -3.0) << DTypeName(d);
    if (d == DType::kFloat16) {
      EXPECT_TRUE(std::isinf(HostValue(t, 2)));  // beyond 65504
    } else {
      EXPECT_NEAR(HostValue(t, 2), 1e6, 1e6 * 0x1p-8) << DTypeName(d);
    }
    const Tensor wide = HostToFloat64(t);
    EXPECT_EQ(wide.data_as<double>()[1], -3.0);
  }
  EXPECT_EQ(DTypeFromName("bfloat16"), DType::kBFloat16);
  EXPECT_FALSE(DTypeFromName("bf16").has_value());
  EXPECT_EQ(LessPrecise(DType::kFloat32, DType::kBFloat16), DType::kBFloat16);
  EXPECT_EQ(LessPrecise(DType::kFloat16, DType::kBFloat16), DType::kBFloat16);
  EXPECT_EQ(LessPrecise(DType::kFloat64, DType::kFloat16), DType::kFloat16);
  EXPECT_EQ(ComputeDType(DType::kFloat16), DType::kFloat32);
  EXPECT_EQ(ComputeDType(DType::kFloat64), DType::kFloat64);
}

}  // namespace
}  // namespace mpusim
