// Tensor helpers (see tensor.h).
#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include <fmt/format.h>
#include <fmt/ranges.h>

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

}  // namespace mpusim
