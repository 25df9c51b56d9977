// 16-bit floating-point storage: bfloat16 (1 sign, 8 exponent, 7 mantissa bits) and IEEE
// binary16 "float16" (1, 5, 10), converted to and from float32.
//
// What it is: the one definition of how mpusim rounds to 16 bits, usable from host and CUDA
// device code (MPUSIM_HD), so the CPU and GPU backends store bit-identical values.
// float32 -> 16 bits rounds to nearest, ties to even (what torch's .to(bfloat16/float16),
// cuBLAS epilogues and CUDA's __float2bfloat16_rn / __float2half_rn do); float16 overflows
// to +-inf and keeps subnormals; NaN stays a quiet NaN with its sign. 16 bits -> float32 is
// exact.
// What it is not: arithmetic. Kernels widen 16-bit values to float32, compute in float32,
// and round once per stored element (core/kernels.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/philox.h"  // MPUSIM_HD

namespace mpusim {

// Storage types: a Tensor of dtype kBFloat16 / kFloat16 holds these (data_as<BFloat16>()).
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};
static_assert(sizeof(BFloat16) == 2 && sizeof(Float16) == 2);

MPUSIM_HD inline uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
MPUSIM_HD inline float BitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

MPUSIM_HD inline BFloat16 ToBFloat16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return BFloat16{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN
  }
  // Round to nearest even on the 16 discarded bits (carries into the exponent, up to inf).
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(rounded >> 16)};
}

MPUSIM_HD inline float ToFloat(BFloat16 h) { return BitsFloat(static_cast<uint32_t>(h.bits) << 16); }

MPUSIM_HD inline Float16 ToFloat16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return Float16{static_cast<uint16_t>(sign | 0x7e00u)};  // quiet NaN
  // 65520 = 0x477ff000 is halfway between the largest float16 (65504, odd mantissa) and
  // 2^16: it and everything above round to inf.
  if (a >= 0x477ff000u) return Float16{static_cast<uint16_t>(sign | 0x7c00u)};
  if (a < 0x38800000u) {
    // Below 2^-14: a float16 subnormal (units of 2^-24) or zero. 2^-25 exactly ties to 0.
    if (a <= 0x33000000u) return Float16{static_cast<uint16_t>(sign)};
    const uint32_t exponent = a >> 23;                       // 102 .. 112
    const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;   // with the implicit bit
    const uint32_t shift = 126u - exponent;                  // 14 .. 24
    uint32_t r = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (r & 1u))) ++r;     // may become 0x400, the smallest normal
    return Float16{static_cast<uint16_t>(sign | r)};
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 discarded bits to even.
  const uint32_t rebiased = a - 0x38000000u;
  const uint32_t r = (rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13;
  return Float16{static_cast<uint16_t>(sign | r)};
}

MPUSIM_HD inline float ToFloat(Float16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1fu;
  const uint32_t mantissa = h.bits & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24
    return sign != 0 ? -magnitude : magnitude;
  }
  if (exponent == 31) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Round a float to the storage type T (float, double, BFloat16 or Float16) and back, for
// code that is generic over the storage type.
template <typename T>
MPUSIM_HD inline T FromFloat(float f);
template <>
MPUSIM_HD inline float FromFloat<float>(float f) { return f; }
template <>
MPUSIM_HD inline BFloat16 FromFloat<BFloat16>(float f) { return ToBFloat16(f); }
template <>
MPUSIM_HD inline Float16 FromFloat<Float16>(float f) { return ToFloat16(f); }
MPUSIM_HD inline float ToFloat(float f) { return f; }

// A double rounded to the storage type T: float64 as is, float32 to nearest, 16-bit via
// float32 (two roundings; this is the definition every backend shares).
template <typename T>
MPUSIM_HD inline T RoundTo(double v) {
  if constexpr (sizeof(T) >= 4) {
    return static_cast<T>(v);
  } else {
    return FromFloat<T>(static_cast<float>(v));
  }
}
// Any storage type widened exactly to double.
template <typename T>
MPUSIM_HD inline double Widen(T v) {
  if constexpr (sizeof(T) >= 4) {
    return static_cast<double>(v);
  } else {
    return static_cast<double>(ToFloat(v));
  }
}

}  // namespace mpusim
