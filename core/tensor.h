// Tensor: a dense, row-major, contiguous array with a shape, a dtype and a device.
//
// What it is: the handle that core/model/graph passes to a backend's Kernels and Communicator.
// Storage is allocated by the backend (host memory for sim/, device memory for cuda/) and
// freed with it, so core never touches a device pointer itself.
// What it is not: an autograd tensor or a view system. Activations are [sequence, batch,
// hidden] like Megatron and are stored as 2-D [sequence*batch, hidden]; weights are stored
// like torch.nn.Linear, [out, in].
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace mpusim {

// Storage dtypes. bfloat16 and float16 are storage only: kernels compute on them in
// float32 (ComputeDType) and round each stored element once (core/half.h). int64 holds
// token ids and labels: kernels index with it and copies move it, but nothing computes on
// it, so the float-only helpers below (LessPrecise, ComputeDType) refuse it.
enum class DType : uint8_t { kFloat32, kFloat64, kBFloat16, kFloat16, kInt64 };
enum class Device : uint8_t { kHost, kCuda };

inline size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kFloat32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
  }
  return 0;
}
// torch's names: "float32", "float64", "bfloat16", "float16", "int64".
inline std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt64: return "int64";
  }
  return "?";
}
// The dtype named by DTypeName, or nullopt. Callers that need a float dtype (a run's dtype,
// a dump's tensors) check IsFloat as well.
inline std::optional<DType> DTypeFromName(std::string_view name) {
  for (DType d :
       {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16, DType::kInt64}) {
    if (DTypeName(d) == name) return d;
  }
  return std::nullopt;
}
// The four floating-point dtypes, the ones kernels compute on.
inline bool IsFloat(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kBFloat16:
    case DType::kFloat16: return true;
    case DType::kInt64: return false;
  }
  return false;
}
// Throws std::invalid_argument naming `what` unless `dtype` is a floating-point dtype.
inline void RequireFloat(DType dtype, std::string_view what) {
  if (!IsFloat(dtype)) {
    throw std::invalid_argument(std::string(what) + ": " + std::string(DTypeName(dtype)) +
                                " is not a floating-point dtype (float32, float64, bfloat16 "
                                "or float16)");
  }
}
// Of two float dtypes, the one with fewer significand bits (bfloat16 < float16 < float32 <
// float64): the one whose rounding error dominates a comparison. int64 is refused.
inline DType LessPrecise(DType a, DType b) {
  const auto bits = [](DType d) {
    switch (d) {
      case DType::kBFloat16: return 8;
      case DType::kFloat16: return 11;
      case DType::kFloat32: return 24;
      case DType::kFloat64: return 53;
      case DType::kInt64: RequireFloat(d, "LessPrecise"); break;
    }
    return 0;
  };
  return bits(a) <= bits(b) ? a : b;
}
inline bool IsHalf(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }
// The dtype arithmetic on `dtype` happens in, and the dtype of accumulators (main_grad,
// softmax statistics) fed by it: float64 for float64, float32 for the other float dtypes.
// int64 has none (nothing computes on ids): refused.
inline DType ComputeDType(DType dtype) {
  RequireFloat(dtype, "ComputeDType");
  return dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

using Shape = std::vector<int64_t>;

inline int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Bytes of a tensor of `shape` and `dtype`, with room for the allocators' padding (`pad`
// bytes): every dimension must be >= 0 and the element count, the byte count and the padded
// size must fit (int64 elements, size_t bytes). Throws std::length_error naming the shape
// otherwise -- configs are refused before this (run/preflight.h), so reaching it is a bug,
// never a wrapped allocation.
size_t CheckedTensorBytes(const Shape& shape, DType dtype, size_t pad = 0);

std::string ShapeString(const Shape& shape);  // "[4, 8]"

class Tensor;
// Element i (flat) of a host tensor of any dtype, widened to double: exactly for the float
// dtypes, and for int64 values of magnitude up to 2^53 (token ids; larger ones round to
// nearest).
double HostValue(const Tensor& host, int64_t i);
// Stores v into element i of a host tensor: float64 exactly, float32 rounded to nearest,
// bfloat16/float16 rounded to float32 first and then to 16 bits (core/half.h), so every
// backend stores the same bits for the same double. An int64 element takes v only when v
// is an integer in [-2^63, 2^63); anything else (a fraction, NaN, out of range) throws
// std::invalid_argument instead of truncating.
void SetHostValue(Tensor& host, int64_t i, double v);
// A host float64 copy of a host tensor of any dtype.
Tensor HostToFloat64(const Tensor& host);

class Tensor {
 public:
  Tensor() = default;
  // Wraps storage the caller allocated; `storage` owns it (its deleter frees it).
  Tensor(Shape shape, DType dtype, Device device, std::shared_ptr<void> storage)
      : shape_(std::move(shape)), dtype_(dtype), device_(device), storage_(std::move(storage)) {}
  // Host tensor, zero-filled.
  static Tensor HostZeros(Shape shape, DType dtype);
  // Host tensor, uninitialised (for outputs that are overwritten completely).
  static Tensor HostEmpty(Shape shape, DType dtype);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int64_t numel() const { return NumElements(shape_); }
  size_t bytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }
  // 2-D view: rows = product of all but the last dimension, cols = the last dimension.
  int64_t rows() const {
    if (shape_.empty()) return 1;
    int64_t r = 1;
    for (size_t i = 0; i + 1 < shape_.size(); ++i) r *= shape_[i];
    return r;
  }
  int64_t cols() const { return shape_.empty() ? 1 : shape_.back(); }

  void* data() { return storage_.get(); }
  const void* data() const { return storage_.get(); }
  template <typename T>
  T* data_as() {
    return static_cast<T*>(storage_.get());
  }
  template <typename T>
  const T* data_as() const {
    return static_cast<const T*>(storage_.get());
  }

  // Same storage, another shape with the same number of elements.
  Tensor Reshaped(Shape shape) const {
    return Tensor(std::move(shape), dtype_, device_, storage_);
  }
  // Elements [offset, offset + count) of the flat storage, as a 1-D tensor [count] that
  // shares it (keeping all of it alive): a parameter's place in a flat buffer, or an
  // optimizer's shard. Throws std::out_of_range unless 0 <= offset <= offset + count <= numel.
  Tensor FlatSlice(int64_t offset, int64_t count) const;

 private:
  Shape shape_;
  DType dtype_ = DType::kFloat32;
  Device device_ = Device::kHost;
  std::shared_ptr<void> storage_;
};

}  // namespace mpusim
