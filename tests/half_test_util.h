// Helpers the 16-bit kernel and collective tests share (tests/sim, tests/cuda).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/half.h"
#include "core/tensor.h"

namespace mpusim {

// The DType of a 16-bit storage type.
template <typename H>
constexpr DType kHalfDType = std::is_same_v<H, BFloat16> ? DType::kBFloat16 : DType::kFloat16;

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

}  // namespace mpusim
