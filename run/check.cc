// The check against the float64 reference, one reference per job (see check.h). The
// reference is computed in job_reference.cc, the row tensors' exchange is in row_exchange.h.
#include "run/check.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

#include "core/arg_checks.h"
#include "core/half.h"
#include "core/init.h"
#include "core/sharding.h"
#include "mpi/agree.h"
#include "mpi/mpi_check.h"
#include "mpi/watchdog.h"
#include "reference/reference.h"
#include "reference/trainer.h"
#include "run/row_exchange.h"
#include "run/stored_reference.h"

namespace mpusim::run {
namespace {

using Layout = ReferenceTensor::Layout;

double MaxAbs(const Tensor& host64) {
  double scale = 0;
  const double* v = host64.data_as<double>();
  for (int64_t i = 0; i < host64.numel(); ++i) scale = std::max(scale, std::fabs(v[i]));
  return scale;
}

// Where a record's local elements sit in a whole or a sample-sliced reference tensor, walked
// in the record's row-major order: the flat index into the reference's value, or -1 when the
// element is outside the reference's slice (a record of samples this rank's slice lacks: never
// for a correct layout), and the flat index in the full tensor (for the worst-element
// report). Each dimension's local indices are placed once (GlobalIndex), so the walk adds a
// few table entries per element and divides nothing.
class ElementMap {
 public:
  ElementMap(const TensorRecord& record, const ReferenceTensor& ref, int64_t slice_begin,
             int64_t slice_end) {
    const Shape local = LocalShape(record.shard, record.full_shape);
    const size_t dims = local.size();
    full_ = FlatOffsets(record.shard, record.full_shape, local);
    ref_.resize(dims);
    int64_t ref_stride = 1;
    for (size_t dim = dims; dim-- > 0;) {
      const bool sliced = ref.layout == Layout::kSamples && static_cast<int>(dim) == ref.batch_dim;
      const int64_t ref_size = sliced ? slice_end - slice_begin : record.full_shape[dim];
      for (int64_t l = 0; l < local[dim]; ++l) {
        const int64_t g =
            GlobalIndex(record.shard, static_cast<int>(dim), record.full_shape[dim], l);
        const int64_t r = sliced ? g - slice_begin : g;
        ref_[dim].push_back(r >= 0 && r < ref_size ? r * ref_stride : kOutside);
      }
      ref_stride *= ref_size;
    }
  }

  // The walk: MoveTo(l) for l = 0, 1, 2, ... in turn (the record's elements in storage order),
  // then Ref() and Full() of that element.
  class Walk {
   public:
    explicit Walk(const ElementMap& map) : map_(map), at_(map.ref_.size(), 0) {}
    // Moves to local element l, the one after the last asked for (or the first).
    void MoveTo(int64_t l) {
      if (l == next_) {
        if (l > 0) Step();
        ++next_;
        return;
      }
      throw std::logic_error("ElementMap::Walk: elements must be visited in order");
    }
    int64_t Ref() const {
      int64_t flat = 0;
      for (size_t dim = 0; dim < at_.size(); ++dim) {
        const int64_t r = map_.ref_[dim][static_cast<size_t>(at_[dim])];
        if (r == kOutside) return -1;
        flat += r;
      }
      return flat;
    }
    int64_t Full() const {
      int64_t flat = 0;
      for (size_t dim = 0; dim < at_.size(); ++dim) {
        flat += map_.full_[dim][static_cast<size_t>(at_[dim])];
      }
      return flat;
    }

   private:
    void Step() {
      for (size_t dim = at_.size(); dim-- > 0;) {
        if (++at_[dim] < static_cast<int64_t>(map_.ref_[dim].size())) return;
        at_[dim] = 0;
      }
    }
    const ElementMap& map_;
    std::vector<int64_t> at_;
    int64_t next_ = 0;
  };

 private:
  static constexpr int64_t kOutside = -1;
  std::vector<std::vector<int64_t>> ref_;   // per dimension and local index: its part of the
                                            // reference's flat index, or kOutside
  std::vector<std::vector<int64_t>> full_;  // its part of the full tensor's flat index
                                            // (FlatOffsets)
};

// A local record compared with a whole or sample-sliced reference tensor, element by element.
// `bounds`, when given, adds an absolute allowance per element (row-major in the reference
// value): the error a trained parameter's gradients carry through the optimizer
// (reference/trainer.h).
void CompareLocal(const TensorRecord& record, const Tensor& host, const ReferenceTensor& ref,
                  const ReferenceResult& reference, const Tolerance& tol,
                  const std::vector<double>* bounds, ErrorStats* stats) {
  const ElementMap map(record, ref, reference.slice_begin, reference.slice_end);
  ElementMap::Walk walk(map);
  const double* want = ref.value.data_as<double>();
  const auto compare = [&](int64_t l, double actual) {
    walk.MoveTo(l);
    const int64_t k = walk.Ref();
    // An element outside this rank's slice cannot be judged here: it counts as a mismatch
    // (a record placed on the wrong samples is a bug).
    const double expected = k >= 0 ? want[k] : std::numeric_limits<double>::quiet_NaN();
    stats->AddAt([&] { return walk.Full(); }, actual, expected,
                 bounds != nullptr && k >= 0
                     ? Tolerance{tol.atol + (*bounds)[static_cast<size_t>(k)], tol.rtol, 0}
                     : tol);
  };
  if (host.dtype() == DType::kInt64) {  // token ids
    for (int64_t l = 0; l < host.numel(); ++l) compare(l, HostValue(host, l));
  } else {
    ForEachValue(host.dtype(), host.data(), host.numel(), compare);
  }
}

// The names of records that no reference tensor matches, on any rank (sorted, the same on
// every rank).
std::vector<std::string> RunOnlyNames(const std::vector<std::string>& mine) {
  std::string joined;
  for (const std::string& name : mine) joined += name + '\n';
  std::set<std::string> names;
  for (const std::string& all : AllGatherStrings(joined)) {
    size_t start = 0;
    for (size_t end = all.find('\n'); end != std::string::npos; end = all.find('\n', start)) {
      names.insert(all.substr(start, end - start));
      start = end + 1;
    }
  }
  return {names.begin(), names.end()};
}

bool ShardMetadataEqual(const TensorRecord& a, const TensorRecord& b) {
  const ShardSpec& x = a.shard;
  const ShardSpec& y = b.shard;
  return a.full_shape == b.full_shape && a.partial_sum == b.partial_sum && x == y;
}

// Bytes of the distinct storages among `tensors` (aliases count once).
int64_t DistinctBytes(const std::vector<const Tensor*>& tensors) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const Tensor* t : tensors) {
    if (t->defined() && seen.insert(t->data()).second) bytes += static_cast<int64_t>(t->bytes());
  }
  return bytes;
}

// The statistics of every rank reduced into one TensorCheck per reference tensor (the same on
// every rank): maxima, counts, flags, and the worst element (MAXLOC on its excess over the
// tolerance, then the winning rank's index and values).
std::vector<TensorCheck> ReduceOverRanks(const std::vector<ReferenceTensor>& refs,
                                         const std::vector<double>& scales,
                                         const std::vector<ErrorStats>& stats,
                                         const std::vector<double>& budget_atol,
                                         std::vector<int>& flags, DType storage, int world_rank) {
  const size_t n = refs.size();
  std::vector<double> maxima(3 * n);
  std::vector<long long> counts(3 * n);
  struct Excess {  // MPI_DOUBLE_INT
    double value;
    int rank;
  };
  std::vector<Excess> excess(n);
  for (size_t i = 0; i < n; ++i) {
    maxima[3 * i] = stats[i].max_abs;
    maxima[3 * i + 1] = stats[i].max_rel;
    maxima[3 * i + 2] = stats[i].max_used;
    counts[3 * i] = stats[i].count;
    counts[3 * i + 1] = stats[i].mismatches;
    counts[3 * i + 2] = stats[i].non_finite;
    excess[i] = {stats[i].count > 0 ? stats[i].worst_excess : -std::numeric_limits<double>::max(),
                 world_rank};
  }
  watched::Allreduce(MPI_IN_PLACE, maxima.data(), static_cast<int>(maxima.size()), MPI_DOUBLE,
                     MPI_MAX, MPI_COMM_WORLD, WorldLabel());
  watched::Allreduce(MPI_IN_PLACE, counts.data(), static_cast<int>(counts.size()), MPI_LONG_LONG,
                     MPI_SUM, MPI_COMM_WORLD, WorldLabel());
  watched::Allreduce(MPI_IN_PLACE, flags.data(), static_cast<int>(flags.size()), MPI_INT, MPI_MAX,
                     MPI_COMM_WORLD, WorldLabel());
  watched::Allreduce(MPI_IN_PLACE, excess.data(), static_cast<int>(n), MPI_DOUBLE_INT, MPI_MAXLOC,
                     MPI_COMM_WORLD, WorldLabel());
  std::vector<double> worst(3 * n, 0.0);  // index, actual, expected (from the winning rank)
  for (size_t i = 0; i < n; ++i) {
    if (excess[i].rank != world_rank || stats[i].count == 0) continue;
    worst[3 * i] = static_cast<double>(stats[i].worst_index);
    worst[3 * i + 1] = stats[i].worst_actual;
    worst[3 * i + 2] = stats[i].worst_expected;
  }
  watched::Allreduce(MPI_IN_PLACE, worst.data(), static_cast<int>(worst.size()), MPI_DOUBLE,
                     MPI_SUM, MPI_COMM_WORLD, WorldLabel());
  std::vector<TensorCheck> checks;
  for (size_t i = 0; i < n; ++i) {
    TensorCheck c;
    c.name = refs[i].name;
    c.full_shape = refs[i].full_shape;
    c.max_abs = maxima[3 * i];
    c.max_rel = maxima[3 * i + 1];
    c.used = maxima[3 * i + 2];
    c.scale = scales[i];
    c.normalized = c.scale > 0 ? c.max_abs / c.scale : 0.0;
    c.allowed = ToleranceFor(refs[i].budget, storage).rtol;
    c.budget_atol = budget_atol[i];
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
    checks.push_back(std::move(c));
  }
  return checks;
}

// The memory figures of CheckResult, reduced over ranks. Every group of ranks computes the
// whole reference once (ReferenceSplit), so the whole reference is the whole tensors and one
// group's slices.
void MeasureMemory(const JobReference& job, const std::vector<TensorRecord>& records,
                   int world_size, CheckResult* result) {
  const ReferenceResult& reference = job.result;
  std::vector<const Tensor*> whole, sliced;
  for (const ReferenceTensor& t : reference.tensors) {
    (t.layout == Layout::kWhole ? whole : sliced).push_back(&t.value);
  }
  std::vector<const Tensor*> own;
  for (const TensorRecord& r : records) own.push_back(&r.tensor);
  const int64_t whole_bytes = DistinctBytes(whole);
  long long maxima[3] = {
      (reference.slice_end - reference.slice_begin) * job.reference->RowsPerUnit(),
      whole_bytes + DistinctBytes(sliced), DistinctBytes(own)};
  long long sliced_bytes = DistinctBytes(sliced);
  watched::Allreduce(MPI_IN_PLACE, maxima, 3, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD, WorldLabel());
  watched::Allreduce(MPI_IN_PLACE, &sliced_bytes, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD,
                     WorldLabel());
  const int64_t groups = world_size / std::max(job.split.group_size, 1);
  result->reference_rows_max = maxima[0];
  result->reference_bytes_max = maxima[1];
  result->record_bytes_max = maxima[2];
  result->reference_bytes_whole = whole_bytes + sliced_bytes / std::max<int64_t>(groups, 1);
}

// What this rank knows of each reference tensor i (refs[i]) while it compares: its scale and
// tolerance, its own record of it, and the statistics of that record's elements.
struct Comparison {
  std::vector<ReferenceTensor>* refs = nullptr;
  // A training run: the optimizer state (it owns the state's bounds), and per trained tensor
  // the absolute allowance each element gets from training (reference/trainer.h).
  std::vector<ReferenceTrainer::StateTensor> state;
  std::map<std::string, const std::vector<double>*> bounds;
  std::vector<double> scales;  // max |e| over all ranks
  std::vector<Tolerance> tolerances;
  std::vector<const TensorRecord*> mine;  // this rank's record, nullptr when none fits
  // Further records of the same name and shape on this rank (whole and sample tensors).
  std::vector<std::vector<const TensorRecord*>> more;
  std::vector<int> flags;  // 2i: missing (wrong shape), 2i + 1: produced
  std::vector<ErrorStats> stats;
  std::vector<std::string> unmatched;  // names of records no reference tensor has
};

// A training run: the trained tensors' error bounds, and the optimizer state appended to the
// reference's tensors, with the tolerance of its parameter's gradient and the error that
// gradient's tolerance carries into it.
void AddOptimizerState(const ReferenceTrainer& trainer, ReferenceResult& reference,
                       Comparison* c) {
  for (const auto& [name, b] : trainer.error_bounds()) c->bounds[name] = &b;
  std::map<std::string, ErrorBudget> gradient_budget;
  for (const ReferenceTensor& t : reference.tensors) {
    if (!t.gradient_of.empty()) gradient_budget[t.gradient_of] = t.budget;
  }
  c->state = trainer.State();
  for (ReferenceTrainer::StateTensor& st : c->state) {
    const Tensor& parameter = trainer.parameters().at(st.parameter);
    ReferenceTensor t;
    t.name = st.name;
    t.full_shape = parameter.shape();
    t.value = Tensor::HostEmpty(parameter.shape(), DType::kFloat64);
    t.budget = gradient_budget[st.parameter];
    std::memcpy(t.value.data(), st.values.data(), t.value.bytes());
    st.values.clear();  // the reference tensor holds them now
    reference.tensors.push_back(std::move(t));
    c->bounds[st.name] = &st.bounds;
  }
}

// The scales over all ranks (one MPI_Allreduce), the tolerances they give, and which of this
// rank's records each reference tensor is compared with.
void MatchRecords(DType storage, const std::vector<TensorRecord>& records, Comparison* c) {
  const std::vector<ReferenceTensor>& refs = *c->refs;
  const size_t n = refs.size();
  c->scales.resize(n);
  for (size_t i = 0; i < n; ++i) c->scales[i] = MaxAbs(refs[i].value);
  watched::Allreduce(MPI_IN_PLACE, c->scales.data(), static_cast<int>(n), MPI_DOUBLE, MPI_MAX,
                     MPI_COMM_WORLD, WorldLabel());

  std::multimap<std::string, const TensorRecord*> by_name;
  for (const TensorRecord& r : records) by_name.emplace(r.name, &r);
  c->stats.resize(n);
  c->flags.assign(2 * n, 0);
  c->tolerances.resize(n);
  c->mine.assign(n, nullptr);
  c->more.assign(n, {});
  for (size_t i = 0; i < n; ++i) {
    c->tolerances[i] = ToleranceFor(refs[i].budget, storage).ForScale(c->scales[i]);
    const auto [first, last] = by_name.equal_range(refs[i].name);
    if (first == last) continue;
    c->flags[2 * i + 1] = 1;
    for (auto it = first; it != last; ++it) {
      if (it->second->full_shape != refs[i].full_shape) {
        c->flags[2 * i] = 1;
      } else if (c->mine[i] == nullptr) {
        c->mine[i] = it->second;
      } else {
        c->more[i].push_back(it->second);
      }
    }
    by_name.erase(first, last);
  }
  for (const auto& [name, record] : by_name) c->unmatched.push_back(name);
}

// Whole and sample tensors: each rank its own shards. After training, the parameters first, with the
// error bounds training carries; then the optimizer state, its bounds grown by the drift the
// parameters' measured error adds (reference/trainer.h); the last iteration's activations and
// gradients were computed from those parameters, so they are then allowed the parameters'
// measured error too (TrainingDrift, collective).
void CompareLocalTensors(const JobReference& job, const HostFetch& fetch, Comparison* c) {
  const ReferenceTrainer* trainer = job.trainer ? &*job.trainer : nullptr;
  const std::vector<ReferenceTensor>& refs = *c->refs;
  const size_t n = refs.size();
  enum class Phase { kParameters, kState, kRest };
  auto phase_of = [&](const std::string& name) {
    if (c->bounds.count(name) == 0) return Phase::kRest;
    return trainer != nullptr && trainer->parameters().count(name) != 0 ? Phase::kParameters
                                                                         : Phase::kState;
  };
  for (const Phase phase : {Phase::kParameters, Phase::kState, Phase::kRest}) {
    if (phase == Phase::kState && trainer != nullptr) {
      std::vector<std::string> names;
      for (const ReferenceTensor& t : refs) names.push_back(t.name);
      const double drift = TrainingDrift(names, c->scales, c->stats, trainer->parameters());
      // c->bounds points at these vectors: they now hold the bounds at the measured drift.
      for (ReferenceTrainer::StateTensor& st : c->state) st.bounds = st.BoundsAt(drift);
      for (size_t i = 0; i < n; ++i) {
        const bool exact = refs[i].budget.roundings == 0 && refs[i].budget.terms == 0;
        if (c->bounds.count(refs[i].name) == 0 && !exact) {
          c->tolerances[i].atol += drift * c->scales[i];
        }
      }
    }
    for (size_t i = 0; i < n; ++i) {
      if (refs[i].layout == Layout::kRows || c->mine[i] == nullptr ||
          phase_of(refs[i].name) != phase) {
        continue;
      }
      const auto bound = c->bounds.find(refs[i].name);
      std::vector<const TensorRecord*> records{c->mine[i]};
      records.insert(records.end(), c->more[i].begin(), c->more[i].end());
      for (const TensorRecord* record : records) {
        const Tensor host = fetch(*record);
        CompareLocal(*record, host, refs[i], job.result, c->tolerances[i],
                     bound != c->bounds.end() ? bound->second : nullptr, &c->stats[i]);
      }
    }
  }
}

// What all ranks agree on about the row tensors (one reduction): each tensor's largest shard
// (bytes) and which tensors are one value under two names: a tensor whose reference and, on
// every rank, whose record share storage with an earlier tensor's (a layer's input is the
// previous layer's output) is compared once, and the earlier tensor's statistics stand for
// both.
class RowAgreement {
 public:
  explicit RowAgreement(const Comparison& c) : n_(c.refs->size()), agreed_(3 * n_, 0) {
    const std::vector<ReferenceTensor>& refs = *c.refs;
    const std::vector<const TensorRecord*>& mine = c.mine;
    for (size_t j = 0; j < n_; ++j) {
      if (refs[j].layout != Layout::kRows) continue;
      if (mine[j] != nullptr) agreed_[j] = static_cast<long long>(mine[j]->tensor.bytes());
      for (size_t i = 0; i < j; ++i) {
        const bool same_reference = refs[i].layout == Layout::kRows &&
                                    refs[i].value.data() == refs[j].value.data() &&
                                    refs[i].full_shape == refs[j].full_shape;
        const bool same_record =
            (mine[i] == nullptr && mine[j] == nullptr) ||
            (mine[i] != nullptr && mine[j] != nullptr &&
             mine[i]->tensor.data() == mine[j]->tensor.data() &&
             mine[i]->tensor.dtype() == mine[j]->tensor.dtype() &&
             ShardMetadataEqual(*mine[i], *mine[j]));
        if (same_reference && same_record) {
          agreed_[n_ + j] = static_cast<long long>(i) + 1;
          agreed_[2 * n_ + j] = -agreed_[n_ + j];
          break;
        }
      }
    }
    watched::Allreduce(MPI_IN_PLACE, agreed_.data(), static_cast<int>(agreed_.size()),
                       MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD, WorldLabel());
  }
  // The largest shard of tensor i on any rank, in bytes.
  int64_t Bytes(size_t i) const { return agreed_[i]; }
  // The earlier tensor whose statistics stand for tensor j; -1: compared on its own.
  int64_t AliasOf(size_t j) const {
    return agreed_[n_ + j] > 0 && agreed_[n_ + j] == -agreed_[2 * n_ + j] ? agreed_[n_ + j] - 1
                                                                          : -1;
  }

 private:
  size_t n_;
  // [0, n) largest bytes; [n, 2n) earlier index + 1; [2n, 3n) -(earlier index + 1), so that
  // one MAX gives the largest and the smallest index any rank saw.
  std::vector<long long> agreed_;
};

// Row tensors: each goes in ceil(bytes / kExchangeBytes) parts; consecutive parts share one
// exchange while their largest sizes add up to at most kExchangeBytes (a small model's
// tensors all go in one), so that a job on many ranks makes few collectives. Every rank
// makes the same exchanges, from the agreed sizes.
void CompareRowTensors(const Config& config, const JobReference& job, int world_size,
                       const HostFetch& fetch, Comparison* c) {
  const RowPartition partition(job.result.units, world_size);
  const std::vector<ReferenceTensor>& refs = *c->refs;
  const std::vector<const TensorRecord*>& mine = c->mine;
  const size_t n = refs.size();
  const RowAgreement agreement(*c);
  std::vector<RowTarget> targets(n);
  for (size_t i = 0; i < n; ++i) targets[i] = {&refs[i], c->tolerances[i], &c->stats[i]};
  RowExchange exchange(partition, world_size, config.parallel.tensor_model_parallel_size,
                       job.result.slice_begin, std::move(targets));
  std::map<size_t, Tensor> hosts;  // host copies of the tensors with parts still to send
  std::vector<std::pair<size_t, int64_t>> group;  // (tensor, part)
  int64_t group_bytes = 0;
  const auto parts_of = [&](size_t i) {
    return std::max<int64_t>(1, (agreement.Bytes(i) + kExchangeBytes - 1) / kExchangeBytes);
  };
  const auto flush = [&]() {
    std::vector<RowPart> parts;
    for (const auto& [i, part] : group) {
      RowPart p{i, mine[i], nullptr, 0, 0};
      if (mine[i] != nullptr) {
        auto it = hosts.find(i);
        if (it == hosts.end()) it = hosts.emplace(i, fetch(*mine[i])).first;
        const Tensor& host = it->second;
        if (host.shape() != LocalShape(mine[i]->shard, mine[i]->full_shape) ||
            host.shape().size() < 2) {
          throw std::logic_error(fmt::format(
              "record {}: local shape {} does not fit its shard of {}", mine[i]->name,
              ShapeString(host.shape()), ShapeString(mine[i]->full_shape)));
        }
        const int64_t local_rows = host.shape()[0] * host.shape()[1];
        const int64_t per_part = (local_rows + parts_of(i) - 1) / parts_of(i);
        p.host = &host;
        p.first = std::min(local_rows, part * per_part);
        p.last = std::min(local_rows, p.first + per_part);
      }
      parts.push_back(p);
    }
    exchange.Exchange(parts);
    for (const auto& [i, part] : group) {
      if (part + 1 == parts_of(i)) hosts.erase(i);
    }
    group.clear();
    group_bytes = 0;
  };
  for (size_t i = 0; i < n; ++i) {
    if (refs[i].layout != Layout::kRows || agreement.AliasOf(i) >= 0 || agreement.Bytes(i) == 0) {
      continue;
    }
    const int64_t part_bytes = (agreement.Bytes(i) + parts_of(i) - 1) / parts_of(i);
    for (int64_t part = 0; part < parts_of(i); ++part) {
      if (!group.empty() && group_bytes + part_bytes > kExchangeBytes) flush();
      group.emplace_back(i, part);
      group_bytes += part_bytes;
    }
  }
  if (!group.empty()) flush();
  for (size_t j = 0; j < n; ++j) {
    const int64_t alias = agreement.AliasOf(j);
    if (alias >= 0) c->stats[j] = c->stats[static_cast<size_t>(alias)];
  }
}

// The CheckResult, the same on every rank: the statistics reduced over the ranks, the
// reference's loss and iterations, the memory figures, and the records the reference does
// not know on any rank (collective: the run-only names, the statistics, the memory).
CheckResult BuildResult(const Config& config, JobReference& job,
                        const std::vector<TensorRecord>& records, int world_rank, int world_size,
                        Comparison& c) {
  const std::vector<ReferenceTensor>& refs = *c.refs;
  const size_t n = refs.size();
  const std::vector<std::string> run_only = RunOnlyNames(c.unmatched);

  std::vector<double> budget_atol(n);  // TensorCheck::budget_atol
  for (size_t i = 0; i < n; ++i) {
    const auto bound = c.bounds.find(refs[i].name);
    const std::vector<double>* b = bound != c.bounds.end() ? bound->second : nullptr;
    budget_atol[i] = c.tolerances[i].atol +
                     (b != nullptr && !b->empty() ? *std::max_element(b->begin(), b->end()) : 0.0);
  }
  CheckResult result;
  result.tensors = ReduceOverRanks(refs, c.scales, c.stats, budget_atol, c.flags,
                                   config.run->dtype, world_rank);
  if (const ReferenceTensor* loss = job.result.Find("loss")) {
    result.has_loss = true;
    result.reference_loss = loss->value.data_as<double>()[0];
  }
  result.reference_iterations = std::move(job.iterations);
  MeasureMemory(job, records, world_size, &result);
  result.header = fmt::format(
      "check against the float64 reference ({} storage; {}):\n"
      "  pass when |a - e| <= allowed * (max|e| + |e|); allowed = {:g} * sqrt(roundings * u^2 + "
      "terms * u_c^2) {} (docs/running.md, \"Checks and tolerances\")\n",
      DTypeName(config.run->dtype),
      job.stored_dir.empty() ? job.reference->SplitText(world_size)
                             : fmt::format("read from the stored reference {}, each rank its {}",
                                           job.stored_dir, job.reference->UnitName()),
      kToleranceSafety, job.reference->BudgetText());
  result.memory = fmt::format(
      "reference memory: {:.1f} MiB on the largest rank ({} token rows), {:.1f} MiB for the "
      "whole reference; the largest rank's own tensors: {:.1f} MiB\n",
      Mebibytes(result.reference_bytes_max), result.reference_rows_max,
      Mebibytes(result.reference_bytes_whole), Mebibytes(result.record_bytes_max));
  for (const std::string& name : run_only) {
    TensorCheck check;
    check.name = name;
    if (const auto it = std::find_if(records.begin(), records.end(),
                                     [&](const TensorRecord& r) { return r.name == name; });
        it != records.end()) {
      check.full_shape = it->full_shape;
    }
    check.missing = true;
    result.tensors.push_back(std::move(check));
  }
  return result;
}

}  // namespace

std::string IndexString(const Shape& shape, int64_t flat) {
  Shape index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  return ShapeString(index);
}

double TrainingDrift(const std::vector<std::string>& names, const std::vector<double>& scales,
                     const std::vector<ErrorStats>& stats,
                     const std::map<std::string, Tensor>& parameters) {
  std::vector<double> errors;
  std::vector<size_t> which;
  for (size_t i = 0; i < names.size(); ++i) {
    if (parameters.count(names[i]) == 0) continue;
    errors.push_back(stats[i].max_abs);
    which.push_back(i);
  }
  watched::Allreduce(MPI_IN_PLACE, errors.data(), static_cast<int>(errors.size()), MPI_DOUBLE,
                     MPI_MAX, MPI_COMM_WORLD, WorldLabel());
  double drift = 0;
  for (size_t j = 0; j < which.size(); ++j) {
    if (scales[which[j]] > 0) drift += errors[j] / scales[which[j]];
  }
  return kToleranceSafety * drift;
}


StatusOr<CheckResult> CheckRun(const Config& config, const RankCoordinates& coords,
                               const std::vector<TensorRecord>& records, const HostFetch& fetch,
                               const ReferenceSource& source) {
  int world_rank = 0, world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  // A training run: the tensors compared are the last iteration's, with the parameters after
  // its update and the optimizer state.
  StatusOr<JobReference> job = source.stored_dir.empty()
                                   ? ComputeJobReference(config, coords)
                                   : LoadJobReference(config, coords, source.identity,
                                                      source.stored_dir);
  if (!source.stored_dir.empty()) {
    // Each rank reads its own part: the first rank that could not fails them all.
    const std::vector<std::string> problems =
        AllGatherStrings(job.ok() ? std::string() : job.status().Message());
    for (const std::string& problem : problems) {
      if (!problem.empty()) return Status::Error("reference", problem);
    }
  }
  if (!job.ok()) return job.status();
  Comparison c;
  c.refs = &job->result.tensors;
  if (job->trainer) AddOptimizerState(*job->trainer, job->result, &c);
  MatchRecords(config.run->dtype, records, &c);
  CompareLocalTensors(*job, fetch, &c);
  // Every rank holds the same list of tensors, so all take this branch or none.
  const bool rows = std::any_of(c.refs->begin(), c.refs->end(), [](const ReferenceTensor& t) {
    return t.layout == Layout::kRows;
  });
  if (rows) {
    if (job->split.group_size != world_size) {
      throw std::logic_error("a reference with row tensors must split its rows over every rank");
    }
    CompareRowTensors(config, *job, world_size, fetch, &c);
  }
  return BuildResult(config, *job, records, world_rank, world_size, c);
}

}  // namespace mpusim::run
