// The exchange of row tensors for the check against the float64 reference (run/check.h): the
// token rows of a job split into one contiguous block per rank, and the collective that sends
// every record's rows to the rank whose reference slice holds them, where they are compared.
// What it is not: a gather. Each rank receives only the rows of its own slice.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/arg_checks.h"
#include "core/dump/compare.h"
#include "core/half.h"
#include "core/model/record.h"
#include "reference/reference_model.h"

namespace mpusim::run {

// Rows [Begin(k), End(k)) of the R rows belong to rank k: balanced contiguous blocks (some
// empty when R < K).
class RowPartition {
 public:
  RowPartition(int64_t rows, int ranks) : begin_(static_cast<size_t>(ranks) + 1) {
    for (int k = 0; k <= ranks; ++k) {
      begin_[static_cast<size_t>(k)] = static_cast<int64_t>(
          static_cast<__int128>(k) * rows / ranks);
    }
  }
  int64_t Begin(int k) const { return begin_[static_cast<size_t>(k)]; }
  int64_t End(int k) const { return begin_[static_cast<size_t>(k) + 1]; }
  // The rank whose block holds row r (the last k with Begin(k) <= r, skipping empty blocks).
  int Owner(int64_t r) const {
    const auto it = std::upper_bound(begin_.begin(), begin_.end() - 1, r);
    return static_cast<int>(it - begin_.begin()) - 1;
  }

 private:
  std::vector<int64_t> begin_;
};

// Calls fn(local_flat, value as double) for `count` elements of raw storage of `dtype`.
template <typename Fn>
void ForEachValue(DType dtype, const void* data, int64_t count, Fn&& fn) {
  DispatchStorage(dtype, [&]<typename T>() {
    const T* v = static_cast<const T*>(data);
    for (int64_t e = 0; e < count; ++e) fn(e, Widen(v[e]));
  });
}

// One piece of an exchange: rows [first, last) of this rank's record of row tensor `tensor`
// (none when this rank does not hold it).
struct RowPart {
  size_t tensor = 0;
  const TensorRecord* record = nullptr;
  const Tensor* host = nullptr;
  int64_t first = 0;
  int64_t last = 0;
};

// What the owner of a block needs to compare it: the reference slice, its tolerance and where
// the statistics go, per reference tensor.
struct RowTarget {
  const ReferenceTensor* ref = nullptr;
  Tolerance tolerance{0, 0, 0};
  ErrorStats* stats = nullptr;
};

// The exchange of row tensors: every rank sends the rows of its parts to their owners (one
// MPI_Alltoallv for all the parts of one exchange), and compares the blocks it owns with its
// slice of the reference. The buffers keep their capacity from one exchange to the next.
class RowExchange {
 public:
  RowExchange(const RowPartition& partition, int world_size, int64_t tp_size,
              int64_t slice_begin, std::vector<RowTarget> targets)
      : partition_(partition),
        size_(world_size),
        tp_size_(tp_size),
        slice_begin_(slice_begin),
        targets_(std::move(targets)),
        send_counts_(static_cast<size_t>(world_size)),
        send_offsets_(send_counts_.size()),
        recv_counts_(send_counts_.size()),
        recv_offsets_(send_counts_.size()) {}

  // Collective over MPI_COMM_WORLD: every rank passes its parts of the same exchange (a part
  // with no record where it holds none of that tensor).
  void Exchange(const std::vector<RowPart>& parts);

 private:
  static size_t Padded(size_t bytes) { return (bytes + 7) / 8 * 8; }
  static size_t RowBytes(const Tensor& host) {
    return static_cast<size_t>(host.shape().size() > 2 ? host.shape()[2] : 1) *
           DTypeSize(host.dtype());
  }

  // Lays the parts out in send_: for each owner, one block per part with rows for it.
  void Pack(const std::vector<RowPart>& parts);
  // Compares one block with this rank's slice; returns where the next block starts.
  const std::byte* Unpack(const std::byte* block, const std::byte* end) const;

  const RowPartition& partition_;
  int size_;
  int64_t tp_size_;
  int64_t slice_begin_;
  std::vector<RowTarget> targets_;  // by reference tensor index
  std::vector<int> send_counts_, send_offsets_, recv_counts_, recv_offsets_;
  std::vector<std::byte> send_, recv_;
};

}  // namespace mpusim::run
