// Tensor helpers (see tensor.h).
#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/half.h"

namespace mpusim {

std::string ShapeString(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Tensor Tensor::HostEmpty(Shape shape, DType dtype) {
  const size_t bytes = static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype);
  // 64-byte alignment suits every SIMD width the CPU kernels use.
  void* raw = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
  if (raw == nullptr) throw std::bad_alloc();
  return Tensor(std::move(shape), dtype, Device::kHost, std::shared_ptr<void>(raw, std::free));
}

Tensor Tensor::HostZeros(Shape shape, DType dtype) {
  Tensor t = HostEmpty(std::move(shape), dtype);
  std::memset(t.data(), 0, t.bytes());
  return t;
}

double HostValue(const Tensor& host, int64_t i) {
  switch (host.dtype()) {
    case DType::kFloat32: return Widen(host.data_as<float>()[i]);
    case DType::kFloat64: return host.data_as<double>()[i];
    case DType::kBFloat16: return Widen(host.data_as<BFloat16>()[i]);
    case DType::kFloat16: return Widen(host.data_as<Float16>()[i]);
  }
  return 0;
}

void SetHostValue(Tensor& host, int64_t i, double v) {
  switch (host.dtype()) {
    case DType::kFloat32: host.data_as<float>()[i] = RoundTo<float>(v); break;
    case DType::kFloat64: host.data_as<double>()[i] = v; break;
    case DType::kBFloat16: host.data_as<BFloat16>()[i] = RoundTo<BFloat16>(v); break;
    case DType::kFloat16: host.data_as<Float16>()[i] = RoundTo<Float16>(v); break;
  }
}

Tensor HostToFloat64(const Tensor& host) {
  Tensor out = Tensor::HostEmpty(host.shape(), DType::kFloat64);
  double* o = out.data_as<double>();
  const int64_t n = host.numel();
  for (int64_t i = 0; i < n; ++i) o[i] = HostValue(host, i);
  return out;
}

}  // namespace mpusim
