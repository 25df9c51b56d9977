// The check against the float64 reference, one reference per job (see check.h).
//
// Wire format of one exchange block (one tensor, one round, one sender -> one owner), all
// little-endian int64 words then raw element bytes:
//   header   dtype, shard_dim, num_shards, shard_index, stride, partial_sum, local_width, rows
//   rows     the global row (i*B + g) of each local row sent
//   values   rows * local_width elements in the record's dtype, padded to a multiple of 8 bytes
// The owner rebuilds each element's global column from the sender's ShardSpec.
#include "run/check.h"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "core/arg_checks.h"
#include "core/half.h"
#include "core/init.h"
#include "core/sharding.h"
#include "mpi/mpi_check.h"
#include "reference/reference_model.h"

namespace mpusim::run {
namespace {

using Layout = ReferenceTensor::Layout;

// Rows [Begin(k), End(k)) of the R rows belong to rank k: balanced contiguous blocks (some
// empty when R < K).
class RowPartition {
 public:
  RowPartition(int64_t rows, int ranks) : rows_(rows), begin_(static_cast<size_t>(ranks) + 1) {
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
  int64_t rows_;
  std::vector<int64_t> begin_;
};

constexpr int kHeaderWords = 8;

// MPI counts are int: large buffers go in pieces.
void AllReduceSum(double* data, int64_t n) {
  constexpr int64_t kPiece = int64_t{1} << 30;
  for (int64_t at = 0; at < n; at += kPiece) {
    const int count = static_cast<int>(std::min(kPiece, n - at));
    MPUSIM_MPI_CHECK(
        MPI_Allreduce(MPI_IN_PLACE, data + at, count, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  }
}

double MaxAbs(const Tensor& host64) {
  double scale = 0;
  const double* v = host64.data_as<double>();
  for (int64_t i = 0; i < host64.numel(); ++i) scale = std::max(scale, std::fabs(v[i]));
  return scale;
}

// "[i, j, k]": the multi-index of `flat` in `shape`.
std::string IndexString(const Shape& shape, int64_t flat) {
  Shape index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  return ShapeString(index);
}

// Calls fn(local_flat, value as double) for `count` elements of raw storage of `dtype`.
template <typename Fn>
void ForEachValue(DType dtype, const void* data, int64_t count, Fn&& fn) {
  DispatchStorage(dtype, [&]<typename T>() {
    const T* v = static_cast<const T*>(data);
    for (int64_t e = 0; e < count; ++e) fn(e, Widen(v[e]));
  });
}

// A local record compared with a whole reference tensor, element by element.
void CompareWhole(const TensorRecord& record, const Tensor& host, const Tensor& expected,
                  const Tolerance& tol, ErrorStats* stats) {
  const Shape& local = host.shape();
  const Shape& full = record.full_shape;
  const size_t dims = full.size();
  std::vector<int64_t> index(dims, 0);
  const double* want = expected.data_as<double>();
  ForEachValue(host.dtype(), host.data(), host.numel(), [&](int64_t, double actual) {
    int64_t flat = 0;
    for (size_t k = 0; k < dims; ++k) {
      flat = flat * full[k] + GlobalIndex(record.shard, static_cast<int>(k), full[k], index[k]);
    }
    stats->Add(flat, actual, want[flat], tol);
    for (size_t k = dims; k-- > 0;) {
      if (++index[k] < local[k]) break;
      index[k] = 0;
    }
  });
}

// The exchange of one row tensor: this rank's record rows [first, last) go to their owners;
// the blocks this rank owns are compared with its slice of the reference.
class RowExchange {
 public:
  RowExchange(const RowPartition& partition, int world_size, int64_t tp_size)
      : partition_(partition),
        size_(world_size),
        tp_size_(tp_size),
        rows_(static_cast<size_t>(world_size)),
        send_counts_(rows_.size()),
        send_offsets_(rows_.size()),
        recv_counts_(rows_.size()),
        recv_offsets_(rows_.size()) {}

  void Round(const ReferenceTensor& ref, int64_t slice_begin, const TensorRecord* record,
             const Tensor* host, int64_t first, int64_t last, const Tolerance& tol,
             ErrorStats* stats) {
    Pack(ref, record, host, first, last);
    MPUSIM_MPI_CHECK(MPI_Alltoall(send_counts_.data(), 1, MPI_INT, recv_counts_.data(), 1,
                                  MPI_INT, MPI_COMM_WORLD));
    int64_t total = 0;
    for (size_t i = 0; i < recv_counts_.size(); ++i) {
      recv_offsets_[i] = static_cast<int>(total);
      total += recv_counts_[i];
      if (total > INT_MAX) throw std::length_error("RowExchange: a round receives over 2 GiB");
    }
    recv_.resize(static_cast<size_t>(total));  // the buffers keep their capacity across rounds
    MPUSIM_MPI_CHECK(MPI_Alltoallv(send_.data(), send_counts_.data(), send_offsets_.data(),
                                   MPI_BYTE, recv_.data(), recv_counts_.data(),
                                   recv_offsets_.data(), MPI_BYTE, MPI_COMM_WORLD));
    for (size_t i = 0; i < recv_counts_.size(); ++i) {
      if (recv_counts_[i] > 0) {
        Unpack(ref, slice_begin, recv_.data() + recv_offsets_[i],
               static_cast<size_t>(recv_counts_[i]), tol, stats);
      }
    }
  }

 private:
  static size_t Padded(size_t bytes) { return (bytes + 7) / 8 * 8; }

  // Lays this rank's rows [first, last) of `record` out in send_, one block per owner.
  void Pack(const ReferenceTensor& ref, const TensorRecord* record, const Tensor* host,
            int64_t first, int64_t last) {
    for (auto& r : rows_) r.clear();
    size_t row_bytes = 0;
    if (record != nullptr) {
      const Shape& full = ref.full_shape;
      const Shape& local = host->shape();
      const int64_t local_batch = local[1];
      row_bytes = static_cast<size_t>(local.size() > 2 ? local[2] : 1) * DTypeSize(host->dtype());
      for (int64_t q = first; q < last; ++q) {
        const int64_t i = GlobalIndex(record->shard, 0, full[0], q / local_batch);
        const int64_t g = GlobalIndex(record->shard, 1, full[1], q % local_batch);
        const int64_t r = i * full[1] + g;
        rows_[static_cast<size_t>(partition_.Owner(r))].push_back({r, q});
      }
    }
    size_t total = 0;
    for (size_t k = 0; k < rows_.size(); ++k) {
      const size_t n = rows_[k].size();
      const size_t bytes =
          n == 0 ? 0 : kHeaderWords * 8 + n * 8 + Padded(n * row_bytes);
      if (total + bytes > INT_MAX) throw std::length_error("RowExchange: a round sends over 2 GiB");
      send_offsets_[k] = static_cast<int>(total);
      send_counts_[k] = static_cast<int>(bytes);
      total += bytes;
    }
    send_.resize(total);
    if (record == nullptr) return;
    const auto* values = static_cast<const std::byte*>(host->data());
    for (size_t k = 0; k < rows_.size(); ++k) {
      const auto n = static_cast<int64_t>(rows_[k].size());
      if (n == 0) continue;
      const int64_t header[kHeaderWords] = {static_cast<int64_t>(host->dtype()),
                                            record->shard.shard_dim,
                                            record->shard.num_shards,
                                            record->shard.shard_index,
                                            record->shard.stride,
                                            record->partial_sum ? 1 : 0,
                                            host->shape().size() > 2 ? host->shape()[2] : 1,
                                            n};
      std::byte* at = send_.data() + send_offsets_[k];
      std::memcpy(at, header, sizeof(header));
      at += sizeof(header);
      for (const auto& [r, q] : rows_[k]) {
        std::memcpy(at, &r, 8);
        at += 8;
      }
      for (const auto& [r, q] : rows_[k]) {
        std::memcpy(at, values + static_cast<size_t>(q) * row_bytes, row_bytes);
        at += row_bytes;
      }
    }
  }

  void Unpack(const ReferenceTensor& ref, int64_t slice_begin, const std::byte* block,
              size_t bytes, const Tolerance& tol, ErrorStats* stats) const {
    int64_t header[kHeaderWords];
    if (bytes < sizeof(header)) throw std::logic_error("RowExchange: short block");
    std::memcpy(header, block, sizeof(header));
    const auto dtype = static_cast<DType>(header[0]);
    ShardSpec spec;
    spec.shard_dim = static_cast<int>(header[1]);
    spec.num_shards = header[2];
    spec.shard_index = header[3];
    spec.stride = header[4];
    const double factor = header[5] != 0 ? static_cast<double>(tp_size_) : 1.0;
    const int64_t local_width = header[6];
    const int64_t n = header[7];
    const int64_t width = ref.width();
    const int last_dim = static_cast<int>(ref.full_shape.size()) - 1;
    std::vector<int64_t> column(static_cast<size_t>(local_width));
    for (int64_t c = 0; c < local_width; ++c) {
      column[static_cast<size_t>(c)] =
          spec.shard_dim == last_dim && last_dim == 2 ? GlobalIndex(spec, 2, width, c) : c;
    }
    const std::byte* rows_at = block + sizeof(header);
    const std::byte* values = rows_at + n * 8;
    const double* expected = ref.value.data_as<double>();
    const int64_t local_rows = ref.value.rows();
    const size_t row_bytes = static_cast<size_t>(local_width) * DTypeSize(dtype);
    for (int64_t k = 0; k < n; ++k) {
      int64_t r = 0;
      std::memcpy(&r, rows_at + k * 8, 8);
      const int64_t row = r - slice_begin;
      if (row < 0 || row >= local_rows) throw std::logic_error("RowExchange: row not in slice");
      const double* want = expected + row * width;
      ForEachValue(dtype, values + static_cast<size_t>(k) * row_bytes, local_width,
                   [&](int64_t c, double actual) {
                     const int64_t j = column[static_cast<size_t>(c)];
                     stats->Add(r * width + j, actual * factor, want[j], tol);
                   });
    }
  }

  const RowPartition& partition_;
  int size_;
  int64_t tp_size_;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows_;  // per owner: (global, local) row
  std::vector<int> send_counts_, send_offsets_, recv_counts_, recv_offsets_;
  std::vector<std::byte> send_, recv_;
};

// The names of records that no reference tensor matches, on any rank (sorted, the same on
// every rank).
std::vector<std::string> RunOnlyNames(const std::vector<std::string>& mine, int world_size) {
  std::string joined;
  for (const std::string& name : mine) joined += name + '\n';
  int length = static_cast<int>(joined.size());
  std::vector<int> lengths(static_cast<size_t>(world_size)), offsets(lengths.size());
  MPUSIM_MPI_CHECK(
      MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD));
  int total = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    offsets[i] = total;
    total += lengths[i];
  }
  std::string all(static_cast<size_t>(total), '\0');
  MPUSIM_MPI_CHECK(MPI_Allgatherv(joined.data(), length, MPI_CHAR, all.data(), lengths.data(),
                                  offsets.data(), MPI_CHAR, MPI_COMM_WORLD));
  std::set<std::string> names;
  size_t start = 0;
  for (size_t end = all.find('\n'); end != std::string::npos; end = all.find('\n', start)) {
    names.insert(all.substr(start, end - start));
    start = end + 1;
  }
  return {names.begin(), names.end()};
}

// The reference's master weights, generated once for the whole job instead of once per slice:
// rank k fills its share of each weight's elements, then MPI_Allgatherv gives every rank the
// whole tensor (each slice multiplies by all of it). A weight too large for int counts is
// generated whole by every rank.
StatusOr<std::map<std::string, Tensor>> SharedMasterWeights(const Config& config, int world_rank,
                                                            int world_size) {
  StatusOr<std::vector<ReferenceParameter>> parameters =
      ReferenceParameters(config.parallel, *config.model, *config.run);
  if (!parameters.ok()) return parameters.status();
  std::map<std::string, Tensor> weights;
  for (const ReferenceParameter& p : *parameters) {
    const int64_t n = NumElements(p.shape);
    Tensor full = Tensor::HostEmpty(p.shape, DType::kFloat64);
    if (n > INT_MAX) {
      FillFlatRange(config.run->seed, p.name, p.init, p.shape, 0, full);
    } else {
      const RowPartition share(n, world_size);
      std::vector<int> counts(static_cast<size_t>(world_size)), offsets(counts.size());
      for (int k = 0; k < world_size; ++k) {
        counts[static_cast<size_t>(k)] = static_cast<int>(share.End(k) - share.Begin(k));
        offsets[static_cast<size_t>(k)] = static_cast<int>(share.Begin(k));
      }
      double* data = full.data_as<double>();
      // A view of this rank's elements (aliasing: `full` owns the storage).
      Tensor mine({share.End(world_rank) - share.Begin(world_rank)}, DType::kFloat64,
                  Device::kHost,
                  std::shared_ptr<void>(std::shared_ptr<void>(), data + share.Begin(world_rank)));
      FillFlatRange(config.run->seed, p.name, p.init, p.shape, share.Begin(world_rank), mine);
      MPUSIM_MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, counts.data(),
                                      offsets.data(), MPI_DOUBLE, MPI_COMM_WORLD));
    }
    weights.emplace(p.name, std::move(full));
  }
  return weights;
}

bool ShardMetadataEqual(const TensorRecord& a, const TensorRecord& b) {
  const ShardSpec& x = a.shard;
  const ShardSpec& y = b.shard;
  return a.full_shape == b.full_shape && a.partial_sum == b.partial_sum &&
         x.shard_dim == y.shard_dim && x.num_shards == y.num_shards &&
         x.shard_index == y.shard_index && x.stride == y.stride && x.batch_dim == y.batch_dim &&
         x.batch_shards == y.batch_shards && x.batch_index == y.batch_index;
}

// Bytes of the distinct storages among `tensors`.
template <typename Range, typename Get>
int64_t DistinctBytes(const Range& tensors, Get get) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& item : tensors) {
    const Tensor& t = get(item);
    if (t.defined() && seen.insert(t.data()).second) bytes += static_cast<int64_t>(t.bytes());
  }
  return bytes;
}

}  // namespace

StatusOr<CheckResult> CheckAgainstReference(const Config& config,
                                            const std::vector<TensorRecord>& records,
                                            const HostFetch& fetch) {
  int world_rank = 0, world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  const RowPartition partition(ReferenceRows(config.parallel, *config.run), world_size);
  StatusOr<std::map<std::string, Tensor>> weights =
      SharedMasterWeights(config, world_rank, world_size);
  StatusOr<ReferenceResult> reference =
      weights.ok() ? RunReferenceWithOverrides(config.parallel, *config.model, *config.run, *weights,
                                               {partition.Begin(world_rank), partition.End(world_rank)})
                   : StatusOr<ReferenceResult>(weights.status());
  weights = std::map<std::string, Tensor>();  // the reference holds what it needs
  int failed = reference.ok() ? 0 : 1;
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  if (failed != 0) {
    return reference.ok() ? Status::Error("reference model", "failed on another rank")
                          : Status::Error("reference model", reference.status().Message());
  }
  std::vector<ReferenceTensor>& refs = reference->tensors;
  const size_t n = refs.size();

  // Whole tensors: the slices' shares of gradients and of the loss add up.
  for (ReferenceTensor& t : refs) {
    if (t.layout == Layout::kWhole && t.partial) AllReduceSum(t.value.data_as<double>(), t.value.numel());
  }
  std::vector<double> scales(n);
  for (size_t i = 0; i < n; ++i) scales[i] = MaxAbs(refs[i].value);
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, scales.data(), static_cast<int>(n), MPI_DOUBLE,
                                 MPI_MAX, MPI_COMM_WORLD));

  std::map<std::string, const TensorRecord*> by_name;
  for (const TensorRecord& r : records) by_name[r.name] = &r;
  std::vector<ErrorStats> stats(n);
  std::vector<int> flags(2 * n, 0);  // missing (wrong shape), produced
  std::vector<Tolerance> tolerances(n);
  std::vector<const TensorRecord*> mine(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    tolerances[i] = ToleranceFor(refs[i].budget, config.run->dtype).ForScale(scales[i]);
    const auto it = by_name.find(refs[i].name);
    if (it == by_name.end()) continue;
    flags[2 * i + 1] = 1;
    if (it->second->full_shape != refs[i].full_shape) {
      flags[2 * i] = 1;
    } else {
      mine[i] = it->second;
    }
    by_name.erase(it);
  }

  // Whole tensors: each rank its own shard.
  for (size_t i = 0; i < n; ++i) {
    if (refs[i].layout != Layout::kWhole || mine[i] == nullptr) continue;
    const Tensor host = fetch(*mine[i]);
    CompareWhole(*mine[i], host, refs[i].value, tolerances[i], &stats[i]);
  }

  // Row tensors: rounds of at most kExchangeBytes per rank, as many as the largest shard needs.
  std::vector<long long> rounds(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (refs[i].layout != Layout::kRows || mine[i] == nullptr) continue;
    const int64_t bytes = static_cast<int64_t>(mine[i]->tensor.bytes());
    rounds[i] = std::max<int64_t>(1, (bytes + kExchangeBytes - 1) / kExchangeBytes);
  }
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, rounds.data(), static_cast<int>(n), MPI_LONG_LONG,
                                 MPI_MAX, MPI_COMM_WORLD));
  // A tensor recorded under two names (a layer's input is the previous layer's output) is
  // compared once: when the reference and, on every rank, the record share storage with an
  // earlier tensor's, the earlier tensor's statistics stand for both.
  std::vector<int> alias_low(n, -1), alias_high(n, -1);
  for (size_t j = 0; j < n; ++j) {
    for (size_t i = 0; i < j; ++i) {
      const bool same_reference = refs[i].layout == Layout::kRows &&
                                  refs[j].layout == Layout::kRows &&
                                  refs[i].value.data() == refs[j].value.data() &&
                                  refs[i].full_shape == refs[j].full_shape;
      const bool same_record =
          (mine[i] == nullptr && mine[j] == nullptr) ||
          (mine[i] != nullptr && mine[j] != nullptr &&
           mine[i]->tensor.data() == mine[j]->tensor.data() &&
           mine[i]->tensor.dtype() == mine[j]->tensor.dtype() &&
           ShardMetadataEqual(*mine[i], *mine[j]));
      if (same_reference && same_record) {
        alias_low[j] = alias_high[j] = static_cast<int>(i);
        break;
      }
    }
  }
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, alias_low.data(), static_cast<int>(n), MPI_INT,
                                 MPI_MIN, MPI_COMM_WORLD));
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, alias_high.data(), static_cast<int>(n), MPI_INT,
                                 MPI_MAX, MPI_COMM_WORLD));
  RowExchange exchange(partition, world_size, config.parallel.tensor_model_parallel_size);
  for (size_t i = 0; i < n; ++i) {
    if (refs[i].layout != Layout::kRows) continue;
    if (alias_low[i] >= 0 && alias_low[i] == alias_high[i]) {
      stats[i] = stats[static_cast<size_t>(alias_low[i])];
      continue;
    }
    Tensor host;
    int64_t local_rows = 0;
    if (mine[i] != nullptr) {
      host = fetch(*mine[i]);
      if (host.shape() != LocalShape(mine[i]->shard, mine[i]->full_shape) ||
          host.shape().size() < 2) {
        throw std::logic_error(fmt::format("record {}: local shape {} does not fit its shard of {}",
                                           mine[i]->name, ShapeString(host.shape()),
                                           ShapeString(mine[i]->full_shape)));
      }
      local_rows = host.shape()[0] * host.shape()[1];
    }
    const int64_t per_round = (local_rows + rounds[i] - 1) / std::max<long long>(rounds[i], 1);
    for (int64_t round = 0; round < rounds[i]; ++round) {
      const int64_t first = std::min(local_rows, round * per_round);
      const int64_t last = std::min(local_rows, first + per_round);
      exchange.Round(refs[i], reference->row_begin, mine[i], &host, first, last, tolerances[i],
                     &stats[i]);
    }
  }

  // Records the reference does not know, on any rank.
  std::vector<std::string> unknown;
  for (const auto& [name, record] : by_name) unknown.push_back(name);
  const std::vector<std::string> run_only = RunOnlyNames(unknown, world_size);

  // Reduce over ranks: maxima, counts, flags, and the worst element (MAXLOC on its excess).
  std::vector<double> maxima(2 * n);
  std::vector<long long> counts(3 * n);
  struct Excess {
    double value;
    int rank;
  };
  std::vector<Excess> excess(n);
  for (size_t i = 0; i < n; ++i) {
    maxima[2 * i] = stats[i].max_abs;
    maxima[2 * i + 1] = stats[i].max_rel;
    counts[3 * i] = stats[i].count;
    counts[3 * i + 1] = stats[i].mismatches;
    counts[3 * i + 2] = stats[i].non_finite;
    excess[i] = {stats[i].count > 0 ? stats[i].worst_excess : -std::numeric_limits<double>::max(),
                 world_rank};
  }
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, maxima.data(), static_cast<int>(maxima.size()),
                                 MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, counts.data(), static_cast<int>(counts.size()),
                                 MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, flags.data(), static_cast<int>(flags.size()),
                                 MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, excess.data(), static_cast<int>(n),
                                 MPI_DOUBLE_INT, MPI_MAXLOC, MPI_COMM_WORLD));
  std::vector<double> worst(3 * n, 0.0);  // index, actual, expected (from the winning rank)
  for (size_t i = 0; i < n; ++i) {
    if (excess[i].rank != world_rank || stats[i].count == 0) continue;
    worst[3 * i] = static_cast<double>(stats[i].worst_index);
    worst[3 * i + 1] = stats[i].worst_actual;
    worst[3 * i + 2] = stats[i].worst_expected;
  }
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, worst.data(), static_cast<int>(worst.size()),
                                 MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));

  CheckResult result;
  {
    const auto value = [](const ReferenceTensor& t) -> const Tensor& { return t.value; };
    std::vector<ReferenceTensor> whole, rows;
    for (const ReferenceTensor& t : refs) (t.layout == Layout::kWhole ? whole : rows).push_back(t);
    const int64_t whole_bytes = DistinctBytes(whole, value);
    long long maxima_bytes[3] = {reference->row_end - reference->row_begin,
                                 whole_bytes + DistinctBytes(rows, value),
                                 DistinctBytes(records, [](const TensorRecord& r) -> const Tensor& {
                                   return r.tensor;
                                 })};
    long long row_bytes = DistinctBytes(rows, value);
    MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, maxima_bytes, 3, MPI_LONG_LONG, MPI_MAX,
                                   MPI_COMM_WORLD));
    MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &row_bytes, 1, MPI_LONG_LONG, MPI_SUM,
                                   MPI_COMM_WORLD));
    result.reference_rows_max = maxima_bytes[0];
    result.reference_bytes_max = maxima_bytes[1];
    result.record_bytes_max = maxima_bytes[2];
    result.reference_bytes_whole = whole_bytes + row_bytes;
  }
  for (size_t i = 0; i < n; ++i) {
    TensorCheck c;
    c.name = refs[i].name;
    c.full_shape = refs[i].full_shape;
    c.max_abs = maxima[2 * i];
    c.max_rel = maxima[2 * i + 1];
    c.scale = scales[i];
    c.normalized = c.scale > 0 ? c.max_abs / c.scale : 0.0;
    c.allowed = ToleranceFor(refs[i].budget, config.run->dtype).rtol;
    c.count = counts[3 * i];
    c.mismatches = counts[3 * i + 1];
    c.non_finite = counts[3 * i + 2];
    c.missing = flags[2 * i] != 0;
    c.not_produced = flags[2 * i + 1] == 0;
    if (c.count > 0) {
      c.worst_index = IndexString(c.full_shape, static_cast<int64_t>(worst[3 * i]));
      c.worst_actual = worst[3 * i + 1];
      c.worst_expected = worst[3 * i + 2];
    }
    if (c.name == "loss") {
      result.has_loss = true;
      result.reference_loss = refs[i].value.data_as<double>()[0];
    }
    result.tensors.push_back(std::move(c));
  }
  for (const std::string& name : run_only) {
    TensorCheck c;
    c.name = name;
    if (const auto it = std::find_if(records.begin(), records.end(),
                                     [&](const TensorRecord& r) { return r.name == name; });
        it != records.end()) {
      c.full_shape = it->full_shape;
    }
    c.missing = true;
    result.tensors.push_back(std::move(c));
  }
  return result;
}

}  // namespace mpusim::run
