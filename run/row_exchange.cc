// The row exchange of the check against the float64 reference (see row_exchange.h).
//
// Wire format of one exchange block (one part of one tensor, one sender -> one owner; an
// exchange carries a sender's blocks for an owner back to back): native int64 words, then raw
// element bytes (every rank of a job runs the same binary):
//   header   tensor (index in the reference's list), dtype, the tp placement's dim (-1: none),
//            shards, index and stride, partial_sum, local_width, rows
//   rows     the global row (i*B + g) of each local row sent
//   values   rows * local_width elements in the record's dtype, padded to a multiple of 8 bytes
// The owner rebuilds each element's global column from the sender's tp placement (a chain's
// tensors split their columns over tp only; rows carry their global index).
#include "run/row_exchange.h"

#include <mpi.h>

#include <climits>
#include <cstring>
#include <stdexcept>

#include "core/sharding.h"
#include "mpi/watchdog.h"

namespace mpusim::run {
namespace {

constexpr int kHeaderWords = 9;

}  // namespace

void RowExchange::Exchange(const std::vector<RowPart>& parts) {
  Pack(parts);
  watched::Alltoall(send_counts_.data(), 1, MPI_INT, recv_counts_.data(), 1, MPI_INT,
                    MPI_COMM_WORLD, WorldLabel());
  int64_t total = 0;
  for (size_t i = 0; i < recv_counts_.size(); ++i) {
    recv_offsets_[i] = static_cast<int>(total);
    total += recv_counts_[i];
    if (total > INT_MAX) throw std::length_error("RowExchange: an exchange receives over 2 GiB");
  }
  recv_.resize(static_cast<size_t>(total));
  watched::Alltoallv(send_.data(), send_counts_.data(), send_offsets_.data(), MPI_BYTE,
                     recv_.data(), recv_counts_.data(), recv_offsets_.data(), MPI_BYTE,
                     MPI_COMM_WORLD, WorldLabel());
  for (size_t i = 0; i < recv_counts_.size(); ++i) {
    const std::byte* at = recv_.data() + recv_offsets_[i];
    const std::byte* end = at + recv_counts_[i];
    while (at < end) at = Unpack(at, end);
  }
}

// Lays the parts out in send_: for each owner, one block per part with rows for it.
void RowExchange::Pack(const std::vector<RowPart>& parts) {
  // rows[p][k]: (global row, local row) of part p that owner k holds, in local order.
  std::vector<std::vector<std::vector<std::pair<int64_t, int64_t>>>> rows(parts.size());
  for (size_t p = 0; p < parts.size(); ++p) {
    rows[p].resize(static_cast<size_t>(size_));
    const RowPart& part = parts[p];
    if (part.record == nullptr) continue;
    const Shape& full = part.record->full_shape;
    const int64_t local_batch = part.host->shape()[1];
    for (int64_t q = part.first; q < part.last; ++q) {
      const int64_t i = GlobalIndex(part.record->shard, 0, full[0], q / local_batch);
      const int64_t g = GlobalIndex(part.record->shard, 1, full[1], q % local_batch);
      const int64_t r = i * full[1] + g;
      rows[p][static_cast<size_t>(partition_.Owner(r))].push_back({r, q});
    }
  }
  size_t total = 0;
  for (size_t k = 0; k < static_cast<size_t>(size_); ++k) {
    size_t bytes = 0;
    for (size_t p = 0; p < parts.size(); ++p) {
      const size_t n = rows[p][k].size();
      if (n > 0) bytes += kHeaderWords * 8 + n * 8 + Padded(n * RowBytes(*parts[p].host));
    }
    if (total + bytes > INT_MAX) throw std::length_error("RowExchange: an exchange sends over 2 GiB");
    send_offsets_[k] = static_cast<int>(total);
    send_counts_[k] = static_cast<int>(bytes);
    total += bytes;
  }
  send_.resize(total);
  for (size_t k = 0; k < static_cast<size_t>(size_); ++k) {
    std::byte* at = send_.data() + send_offsets_[k];
    for (size_t p = 0; p < parts.size(); ++p) {
      const auto& owned = rows[p][k];
      if (owned.empty()) continue;
      const RowPart& part = parts[p];
      const Tensor& host = *part.host;
      const Placement* tp = part.record->shard.Find(ShardAxis::kTp);
      const Placement none{ShardAxis::kTp, -1, 1, 0, 1};
      const Placement& split = tp != nullptr ? *tp : none;
      const size_t row_bytes = RowBytes(host);
      const int64_t header[kHeaderWords] = {static_cast<int64_t>(part.tensor),
                                            static_cast<int64_t>(host.dtype()),
                                            split.dim,
                                            split.shards,
                                            split.index,
                                            split.stride,
                                            part.record->partial_sum ? 1 : 0,
                                            host.shape().size() > 2 ? host.shape()[2] : 1,
                                            static_cast<int64_t>(owned.size())};
      std::memcpy(at, header, sizeof(header));
      at += sizeof(header);
      for (const auto& [r, q] : owned) {
        std::memcpy(at, &r, 8);
        at += 8;
      }
      const auto* values = static_cast<const std::byte*>(host.data());
      std::byte* values_start = at;
      for (const auto& [r, q] : owned) {
        std::memcpy(at, values + static_cast<size_t>(q) * row_bytes, row_bytes);
        at += row_bytes;
      }
      at = values_start + Padded(owned.size() * row_bytes);
    }
  }
}

// Compares one block with this rank's slice; returns where the next block starts.
const std::byte* RowExchange::Unpack(const std::byte* block, const std::byte* end) const {
  int64_t header[kHeaderWords];
  if (end - block < static_cast<std::ptrdiff_t>(sizeof(header))) {
    throw std::logic_error("RowExchange: short block");
  }
  std::memcpy(header, block, sizeof(header));
  const RowTarget& target = targets_.at(static_cast<size_t>(header[0]));
  const ReferenceTensor& ref = *target.ref;
  const auto dtype = static_cast<DType>(header[1]);
  ShardSpec spec;
  const bool split_columns = header[2] == 2;
  if (split_columns) spec.Split(ShardAxis::kTp, 2, header[3], header[4], header[5]);
  const double factor = header[6] != 0 ? static_cast<double>(tp_size_) : 1.0;
  const int64_t local_width = header[7];
  const int64_t n = header[8];
  const int64_t width = ref.width();
  const int last_dim = static_cast<int>(ref.full_shape.size()) - 1;
  std::vector<int64_t> column(static_cast<size_t>(local_width));
  for (int64_t c = 0; c < local_width; ++c) {
    column[static_cast<size_t>(c)] =
        split_columns && last_dim == 2 ? GlobalIndex(spec, 2, width, c) : c;
  }
  const std::byte* rows_at = block + sizeof(header);
  const std::byte* values = rows_at + n * 8;
  const double* expected = ref.value.data_as<double>();
  const int64_t local_rows = ref.value.rows();
  const size_t row_bytes = static_cast<size_t>(local_width) * DTypeSize(dtype);
  for (int64_t k = 0; k < n; ++k) {
    int64_t r = 0;
    std::memcpy(&r, rows_at + k * 8, 8);
    const int64_t row = r - slice_begin_;
    if (row < 0 || row >= local_rows) throw std::logic_error("RowExchange: row not in slice");
    const double* want = expected + row * width;
    ForEachValue(dtype, values + static_cast<size_t>(k) * row_bytes, local_width,
                 [&](int64_t c, double actual) {
                   const int64_t j = column[static_cast<size_t>(c)];
                   target.stats->Add(r * width + j, actual * factor, want[j], target.tolerance);
                 });
  }
  return values + Padded(static_cast<size_t>(n) * row_bytes);
}

}  // namespace mpusim::run
