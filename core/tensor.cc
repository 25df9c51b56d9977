// Tensor helpers (see tensor.h).
#include "core/tensor.h"

#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/half.h"

namespace mpusim {

std::string ShapeString(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

size_t CheckedTensorBytes(const Shape& shape, DType dtype, size_t pad) {
  int64_t elements = 1;
  size_t bytes = 0;
  bool ok = true;
  for (const int64_t d : shape) ok = ok && d >= 0 && !__builtin_mul_overflow(elements, d, &elements);
  ok = ok && !__builtin_mul_overflow(static_cast<size_t>(elements), DTypeSize(dtype), &bytes) &&
       !__builtin_add_overflow(bytes, pad, &bytes);
  if (!ok) {
    throw std::length_error(fmt::format("a tensor of shape {} and dtype {} has too many elements "
                                        "to allocate",
                                        ShapeString(shape), DTypeName(dtype)));
  }
  return bytes;
}

Tensor Tensor::HostEmpty(Shape shape, DType dtype) {
  // 64-byte alignment suits every SIMD width the CPU kernels use; the spare line lets a
  // vectorised loop read past the last element.
  const size_t bytes = CheckedTensorBytes(shape, dtype, 128);
  void* raw = std::aligned_alloc(64, (bytes - 128 + 63) / 64 * 64 + 64);
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
    case DType::kInt64: return static_cast<double>(host.data_as<int64_t>()[i]);
  }
  return 0;
}

void SetHostValue(Tensor& host, int64_t i, double v) {
  switch (host.dtype()) {
    case DType::kFloat32: host.data_as<float>()[i] = RoundTo<float>(v); break;
    case DType::kFloat64: host.data_as<double>()[i] = v; break;
    case DType::kBFloat16: host.data_as<BFloat16>()[i] = RoundTo<BFloat16>(v); break;
    case DType::kFloat16: host.data_as<Float16>()[i] = RoundTo<Float16>(v); break;
    case DType::kInt64:
      // [-2^63, 2^63) as doubles; the comparisons are false for NaN.
      if (!(v >= -0x1p63 && v < 0x1p63) || std::trunc(v) != v) {
        throw std::invalid_argument(
            fmt::format("SetHostValue: {} is not an integer an int64 element can hold", v));
      }
      host.data_as<int64_t>()[i] = static_cast<int64_t>(v);
      break;
  }
}

Tensor HostToFloat64(const Tensor& host) {
  Tensor out = Tensor::HostEmpty(host.shape(), DType::kFloat64);
  double* o = out.data_as<double>();
  const int64_t n = host.numel();
  for (int64_t i = 0; i < n; ++i) o[i] = HostValue(host, i);
  return out;
}

Tensor Tensor::FlatSlice(int64_t offset, int64_t count) const {
  if (offset < 0 || count < 0 || offset > numel() || count > numel() - offset) {
    throw std::out_of_range(fmt::format("Tensor::FlatSlice: elements [{}, {} + {}) of a {} tensor",
                                        offset, offset, count, ShapeString(shape_)));
  }
  auto* first = static_cast<std::byte*>(storage_.get()) +
                static_cast<size_t>(offset) * DTypeSize(dtype_);
  return Tensor({count}, dtype_, device_, std::shared_ptr<void>(storage_, first));
}

}  // namespace mpusim

