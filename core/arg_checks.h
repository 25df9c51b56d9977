// Argument checks shared by every backend's Kernels (sim/eigen_kernels, cuda/cuda_kernels)
// and Communicators (mpi/mpi_communicator, cuda/nccl_communicator).
//
// A bad argument to a kernel or a collective is a caller bug, not user input: it throws
// std::invalid_argument naming the backend, the call and the offending tensor, before any
// work is queued. The rules are the same on every device, so they live here once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/half.h"
#include "core/tensor.h"

namespace mpusim {

// The 2-D view of a tensor (Tensor::rows() / cols()).
inline int64_t Rows(const Tensor& t) { return t.rows(); }
inline int64_t Cols(const Tensor& t) { return t.cols(); }

// Whether two tensors' storage overlaps.
inline bool Overlap(const Tensor& a, const Tensor& b) {
  const auto* a0 = static_cast<const std::byte*>(a.data());
  const auto* b0 = static_cast<const std::byte*>(b.data());
  return a.bytes() > 0 && b.bytes() > 0 && a0 < b0 + b.bytes() && b0 < a0 + a.bytes();
}

// Runs body.template operator()<T>() with T the C++ type of `dtype`: float or double. For
// kernels that compute in float64 or float32 only; 16-bit dtypes are the caller's to handle.
template <typename Body>
void Dispatch(DType dtype, Body&& body) {
  if (dtype == DType::kFloat32) {
    body.template operator()<float>();
  } else if (dtype == DType::kFloat64) {
    body.template operator()<double>();
  } else {
    throw std::invalid_argument(fmt::format("Dispatch: {} has no float32/float64 body",
                                            DTypeName(dtype)));
  }
}

// Runs body.template operator()<T>() with T the storage type of `dtype`: double, float,
// BFloat16 or Float16 (core/half.h). Bodies widen with ToFloat and narrow with FromFloat<T>
// (double bodies use their own arithmetic).
template <typename Body>
void DispatchStorage(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::kFloat32: body.template operator()<float>(); break;
    case DType::kFloat64: body.template operator()<double>(); break;
    case DType::kBFloat16: body.template operator()<BFloat16>(); break;
    case DType::kFloat16: body.template operator()<Float16>(); break;
    case DType::kInt64:
      throw std::invalid_argument("DispatchStorage: int64 has no float body (ids are read by "
                                  "the kernels that take them, never computed on)");
  }
}

// Which dtypes the tensors of a kernel call (those given to Add) may have: kFloat for
// kernels that compute (the four float dtypes), kAny for the ones that only move or clear
// bits (copies, transfers), which take int64 tensors too.
enum class KernelDTypes : uint8_t { kFloat, kAny };

// Checks of one kernel call: every tensor is allocated on the backend's device (or the one
// named), and all tensors of the call share the first one's dtype, a float dtype unless
// the call is a kAny one. Index tensors (ids, labels) are checked apart with AddIndices.
class KernelArgs {
 public:
  KernelArgs(std::string_view backend, Device device, std::string_view kernel,
             KernelDTypes dtypes = KernelDTypes::kFloat)
      : backend_(backend), device_(device), kernel_(kernel), dtypes_(dtypes) {}

  KernelArgs& Add(std::string_view name, const Tensor& t) { return Add(name, t, device_); }
  KernelArgs& Add(std::string_view name, const Tensor& t, Device device) {
    Allocated(name, t, device);
    if (dtypes_ == KernelDTypes::kFloat && !IsFloat(t.dtype())) {
      Fail(fmt::format("{} is {}; this kernel computes on float32, float64, bfloat16 or "
                       "float16 only",
                       name, DTypeName(t.dtype())));
    }
    if (first_name_.empty()) {
      first_name_ = name;
      dtype_ = t.dtype();
    } else if (t.dtype() != dtype_) {
      Fail(fmt::format("{} is {} but {} is {}", name, DTypeName(t.dtype()), first_name_,
                       DTypeName(dtype_)));
    }
    return *this;
  }
  // An accumulator fed by the tensors added so far: their dtype, or their compute dtype
  // (a bfloat16 product accumulated into a float32 main_grad).
  KernelArgs& AddAccumulator(std::string_view name, const Tensor& t) {
    Allocated(name, t, device_);
    if (t.dtype() != dtype_ && t.dtype() != ComputeDType(dtype_)) {
      Fail(fmt::format("{} is {} but must be {} or {} (the dtype of {})", name,
                       DTypeName(t.dtype()), DTypeName(dtype_), DTypeName(ComputeDType(dtype_)),
                       first_name_));
    }
    return *this;
  }
  // A statistic in the compute dtype of the tensors added so far (float32 for 16-bit ones).
  KernelArgs& AddCompute(std::string_view name, const Tensor& t) {
    Allocated(name, t, device_);
    if (t.dtype() != ComputeDType(dtype_)) {
      Fail(fmt::format("{} is {} but must be {} (the compute dtype of {} {})", name,
                       DTypeName(t.dtype()), DTypeName(ComputeDType(dtype_)), DTypeName(dtype_),
                       first_name_));
    }
    return *this;
  }
  // An index tensor (token ids, labels): int64 of any shape on the backend's device, with
  // exactly `numel` elements (one per row of the data it indexes).
  KernelArgs& AddIndices(std::string_view name, const Tensor& t, int64_t numel,
                         std::string_view because) {
    AddInt64(name, t);
    Numel(name, t, numel, because);
    return *this;
  }
  // An int64 tensor of any size on this kernel's device (positions whose count the caller
  // checks against the shapes).
  KernelArgs& AddInt64(std::string_view name, const Tensor& t) {
    Allocated(name, t, device_);
    if (t.dtype() != DType::kInt64) {
      Fail(fmt::format("{} is {} but must be int64 (token ids, labels, positions)", name,
                       DTypeName(t.dtype())));
    }
    return *this;
  }
  // `t` has exactly `numel` elements.
  void Numel(std::string_view name, const Tensor& t, int64_t numel,
             std::string_view because) const {
    if (t.numel() != numel) {
      Fail(fmt::format("{} {} has {} elements, expected {} ({})", name, ShapeString(t.shape()),
                       t.numel(), numel, because));
    }
  }
  void Require(bool ok, std::string_view what) const {
    if (!ok) Fail(std::string(what));
  }
  [[noreturn]] void Fail(const std::string& what) const {
    throw std::invalid_argument(fmt::format("{}::{}: {}", backend_, kernel_, what));
  }
  DType dtype() const { return dtype_; }

 private:
  void Allocated(std::string_view name, const Tensor& t, Device device) const {
    if (!t.defined()) Fail(fmt::format("{} is not allocated", name));
    if (t.device() != device) {
      Fail(fmt::format("{} is not a {} tensor", name, device == Device::kCuda ? "CUDA" : "host"));
    }
  }

  std::string_view backend_;
  Device device_;
  std::string_view kernel_;
  KernelDTypes dtypes_;
  std::string_view first_name_;
  DType dtype_ = DType::kFloat32;
};

// A token-indexed vocabulary shard [vocab_start, vocab_end) must match its table's rows.
inline void CheckShard(const KernelArgs& args, std::string_view name, const Tensor& table,
                       int64_t vocab_start, int64_t vocab_end) {
  args.Require(vocab_start <= vocab_end,
               fmt::format("vocab_start {} > vocab_end {}", vocab_start, vocab_end));
  if (Rows(table) != vocab_end - vocab_start) {
    args.Fail(fmt::format("{} {} has {} rows but the shard [{}, {}) has {}", name,
                          ShapeString(table.shape()), Rows(table), vocab_start, vocab_end,
                          vocab_end - vocab_start));
  }
}

// Checks of one collective call on a communicator whose buffers live on `device`.
class CollectiveArgs {
 public:
  CollectiveArgs(std::string_view backend, Device device, std::string_view function)
      : backend_(backend), device_(device), function_(function) {}

  [[noreturn]] void Fail(const std::string& what) const {
    throw std::invalid_argument(fmt::format("{}::{}: {}", backend_, function_, what));
  }
  // An allocated buffer on the communicator's device.
  void Buffer(std::string_view name, const Tensor& tensor) const {
    if (!tensor.defined()) Fail(fmt::format("{} is not allocated", name));
    if (tensor.device() != device_) {
      Fail(fmt::format("{} must be a {} tensor", name,
                       device_ == Device::kCuda ? "CUDA" : "host"));
    }
  }
  // in/out of an all-gather or reduce-scatter: same dtype, no overlap, and
  // big.numel() == size * small.numel().
  // in/out of an all-to-all: same dtype and element count, a multiple of size, no overlap.
  void Exchanged(const Tensor& in, const Tensor& out, int size) const {
    Buffer("in", in);
    Buffer("out", out);
    if (in.dtype() != out.dtype()) {
      Fail(fmt::format("in is {} but out is {}", DTypeName(in.dtype()), DTypeName(out.dtype())));
    }
    if (in.numel() != out.numel() || in.numel() % size != 0) {
      Fail(fmt::format("in {} and out {} must have the same element count, a multiple of the "
                       "group size {}",
                       ShapeString(in.shape()), ShapeString(out.shape()), size));
    }
    if (in.numel() > 0 && Overlap(in, out)) Fail("in and out overlap");
  }
  // in/out of an uneven all-to-all: same dtype, `size` non-negative counts per side summing
  // to the buffer's element count, no overlap.
  void SplitExchanged(const Tensor& in, const std::vector<int64_t>& send_counts, const Tensor& out,
                      const std::vector<int64_t>& recv_counts, int size) const {
    Buffer("in", in);
    Buffer("out", out);
    if (in.dtype() != out.dtype()) {
      Fail(fmt::format("in is {} but out is {}", DTypeName(in.dtype()), DTypeName(out.dtype())));
    }
    const auto check = [&](std::string_view name, const std::vector<int64_t>& counts,
                           const Tensor& buffer) {
      if (counts.size() != static_cast<size_t>(size)) {
        Fail(fmt::format("{} has {} entries, not the group size {}", name, counts.size(), size));
      }
      int64_t total = 0;
      for (int64_t c : counts) {
        if (c < 0 || c > buffer.numel() - total) {
          Fail(fmt::format("{} must be non-negative and sum to the {} elements of its buffer",
                           name, buffer.numel()));
        }
        total += c;
      }
      if (total != buffer.numel()) {
        Fail(fmt::format("{} sum to {}, but its buffer holds {} elements", name, total,
                         buffer.numel()));
      }
    };
    check("send_counts", send_counts, in);
    check("recv_counts", recv_counts, out);
    if (in.numel() > 0 && out.numel() > 0 && Overlap(in, out)) Fail("in and out overlap");
  }
  void Chunked(const Tensor& in, const Tensor& out, const Tensor& small, const Tensor& big,
               int size) const {
    Buffer("in", in);
    Buffer("out", out);
    if (in.dtype() != out.dtype()) {
      Fail(fmt::format("in is {} but out is {}", DTypeName(in.dtype()), DTypeName(out.dtype())));
    }
    if (big.numel() != size * small.numel()) {
      Fail(fmt::format("in {} and out {} do not match the group size {}: need {} == {} * {}",
                       ShapeString(in.shape()), ShapeString(out.shape()), size, big.numel(),
                       size, small.numel()));
    }
    if (in.numel() > 0 && Overlap(in, out)) Fail("in and out overlap");
  }

 private:
  std::string_view backend_;
  Device device_;
  std::string_view function_;
};

}  // namespace mpusim
