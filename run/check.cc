// The check against the float64 reference, one reference per job (see check.h). The row
// tensors' exchange is in row_exchange.h.
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
#include "reference/reference_model.h"
#include "reference/trainer.h"
#include "run/gpt_check.h"
#include "run/row_exchange.h"

namespace mpusim::run {
namespace {

using Layout = ReferenceTensor::Layout;

// MPI counts are int: large buffers go in pieces.
void AllReduceSum(double* data, int64_t n) {
  constexpr int64_t kPiece = int64_t{1} << 30;
  for (int64_t at = 0; at < n; at += kPiece) {
    const int count = static_cast<int>(std::min(kPiece, n - at));
    watched::Allreduce(MPI_IN_PLACE, data + at, count, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD,
                       WorldLabel());
  }
}

double MaxAbs(const Tensor& host64) {
  double scale = 0;
  const double* v = host64.data_as<double>();
  for (int64_t i = 0; i < host64.numel(); ++i) scale = std::max(scale, std::fabs(v[i]));
  return scale;
}

// A local record compared with a whole reference tensor, element by element.
// `bounds`, when given, adds an absolute allowance per element (row-major in the full tensor):
// the error a trained parameter's gradients carry through the optimizer (reference/trainer.h).
void CompareWhole(const TensorRecord& record, const Tensor& host, const Tensor& expected,
                  const Tolerance& tol, const std::vector<double>* bounds, ErrorStats* stats) {
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
    stats->Add(flat, actual, want[flat],
               bounds != nullptr
                   ? Tolerance{tol.atol + (*bounds)[static_cast<size_t>(flat)], tol.rtol, 0}
                   : tol);
    for (size_t k = dims; k-- > 0;) {
      if (++index[k] < local[k]) break;
      index[k] = 0;
    }
  });
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

// The reference's master weights, generated once for the whole job instead of once per slice:
// the weights lie back to back in one buffer, rank k fills its 1/K of the buffer's elements
// (whichever weights they belong to), and one MPI_Allgatherv gives every rank all of them
// (each slice multiplies by whole weights). The tensors are views into the buffer. Past int
// counts (2^31 elements), every rank generates everything itself.
StatusOr<std::map<std::string, Tensor>> SharedMasterWeights(const Config& config, int world_rank,
                                                            int world_size) {
  StatusOr<std::vector<ReferenceParameter>> parameters =
      ReferenceParameters(config.parallel, *config.model, *config.run);
  if (!parameters.ok()) return parameters.status();
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const ReferenceParameter& p : *parameters) {
    offsets.push_back(total);
    total += NumElements(p.shape);
  }
  const std::shared_ptr<double[]> buffer(new double[static_cast<size_t>(total)]);
  double* data = buffer.get();
  const auto view = [&](int64_t offset, Shape shape) {  // shares ownership of the buffer
    return Tensor(std::move(shape), DType::kFloat64, Device::kHost,
                  std::shared_ptr<void>(buffer, data + offset));
  };
  const bool shared = total <= INT_MAX;
  const RowPartition share(total, shared ? world_size : 1);
  const int64_t mine_begin = shared ? share.Begin(world_rank) : 0;
  const int64_t mine_end = shared ? share.End(world_rank) : total;
  for (size_t w = 0; w < parameters->size(); ++w) {
    const ReferenceParameter& p = (*parameters)[w];
    const int64_t begin = std::max(mine_begin, offsets[w]);
    const int64_t end = std::min(mine_end, offsets[w] + NumElements(p.shape));
    if (begin >= end) continue;
    Tensor part = view(begin, {end - begin});
    FillFlatRange(config.run->seed, p.name, p.init, p.shape, begin - offsets[w], part);
  }
  if (shared) {
    std::vector<int> counts(static_cast<size_t>(world_size)), displs(counts.size());
    for (int k = 0; k < world_size; ++k) {
      counts[static_cast<size_t>(k)] = static_cast<int>(share.End(k) - share.Begin(k));
      displs[static_cast<size_t>(k)] = static_cast<int>(share.Begin(k));
    }
    watched::Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, counts.data(), displs.data(),
                        MPI_DOUBLE, MPI_COMM_WORLD, WorldLabel());
  }
  std::map<std::string, Tensor> weights;
  for (size_t w = 0; w < parameters->size(); ++w) {
    weights.emplace((*parameters)[w].name, view(offsets[w], (*parameters)[w].shape));
  }
  return weights;
}

// Sums the slices' shares (gradients, the loss) over the ranks: small tensors packed together
// into one MPI_Allreduce of at most kExchangeBytes, large ones each on their own.
void SumShares(std::vector<ReferenceTensor>& refs) {
  constexpr int64_t kPackDoubles = kExchangeBytes / 8;
  std::vector<double> pack;
  std::vector<ReferenceTensor*> packed;
  const auto flush = [&]() {
    AllReduceSum(pack.data(), static_cast<int64_t>(pack.size()));
    size_t at = 0;
    for (ReferenceTensor* t : packed) {
      std::memcpy(t->value.data(), pack.data() + at, t->value.bytes());
      at += static_cast<size_t>(t->value.numel());
    }
    pack.clear();
    packed.clear();
  };
  for (ReferenceTensor& t : refs) {
    if (t.layout != Layout::kWhole || !t.partial) continue;
    const int64_t n = t.value.numel();
    if (n > kPackDoubles) {
      AllReduceSum(t.value.data_as<double>(), n);
      continue;
    }
    if (static_cast<int64_t>(pack.size()) + n > kPackDoubles) flush();
    pack.insert(pack.end(), t.value.data_as<double>(), t.value.data_as<double>() + n);
    packed.push_back(&t);
  }
  if (!packed.empty()) flush();
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

// The memory figures of CheckResult, reduced over ranks.
void MeasureMemory(const ReferenceResult& reference, const std::vector<TensorRecord>& records,
                   CheckResult* result) {
  std::vector<const Tensor*> whole, rows;
  for (const ReferenceTensor& t : reference.tensors) {
    (t.layout == Layout::kWhole ? whole : rows).push_back(&t.value);
  }
  std::vector<const Tensor*> own;
  for (const TensorRecord& r : records) own.push_back(&r.tensor);
  const int64_t whole_bytes = DistinctBytes(whole);
  long long maxima[3] = {reference.row_end - reference.row_begin,
                         whole_bytes + DistinctBytes(rows), DistinctBytes(own)};
  long long row_bytes = DistinctBytes(rows);
  watched::Allreduce(MPI_IN_PLACE, maxima, 3, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD, WorldLabel());
  watched::Allreduce(MPI_IN_PLACE, &row_bytes, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD,
                     WorldLabel());
  result->reference_rows_max = maxima[0];
  result->reference_bytes_max = maxima[1];
  result->record_bytes_max = maxima[2];
  result->reference_bytes_whole = whole_bytes + row_bytes;
}

// One optimizer step of the reference on its full (summed) gradients, iteration k: the
// parameters are the whole, non-partial tensors, their gradients "<parameter>_grad" (frozen
// parameters have none and stay). Afterwards the result's parameters hold the updated values
// and its gradients the clipped ones, as the executor's records do.
// The gradients' error, which the trainer carries into its error bounds, is taken as the
// largest tolerance of any gradient tensor in the run's storage dtype.
void TrainReference(ReferenceResult& reference, int64_t k, DType storage, ReferenceTrainer& trainer,
                    std::vector<CheckResult::Iteration>* iterations) {
  std::map<std::string, Tensor*> grads;
  std::map<std::string, Tensor> parameters;
  double gradient_tolerance = 0;
  CheckResult::Iteration row;
  for (ReferenceTensor& t : reference.tensors) {
    if (t.layout != Layout::kWhole) continue;
    if (t.name == "loss") {
      row.loss = t.value.data_as<double>()[0];
    } else if (!t.partial) {
      parameters[t.name] = t.value;
    }
  }
  for (ReferenceTensor& t : reference.tensors) {
    if (t.layout != Layout::kWhole || !t.partial || !t.name.ends_with("_grad")) continue;
    const std::string parameter = t.name.substr(0, t.name.size() - 5);
    if (parameters.count(parameter) == 0) continue;
    grads[parameter] = &t.value;
    gradient_tolerance = std::max(gradient_tolerance, ToleranceFor(t.budget, storage).rtol);
  }
  if (!trainer.has_parameters()) trainer.SetParameters(parameters);
  trainer.SetGradientTolerance(0, gradient_tolerance, gradient_tolerance);
  row.grad_norm = trainer.Step(grads, k);
  row.lr = trainer.last_lr();
  iterations->push_back(row);
  for (ReferenceTensor& t : reference.tensors) {
    const auto it = trainer.parameters().find(t.name);
    if (it != trainer.parameters().end() && t.layout == Layout::kWhole && !t.partial) {
      t.value = it->second;
    }
  }
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
  std::vector<int> flags;                 // 2i: missing (wrong shape), 2i + 1: produced
  std::vector<ErrorStats> stats;
  std::map<std::string, const TensorRecord*> unmatched;  // records no reference tensor names
};

// The reference for this rank's slice of the token rows, the slices' shares of gradients and
// of the loss summed over the ranks. A training run: the reference trains the whole model
// too, iteration by iteration, each on the parameters the last one left (reference/trainer.h);
// the result is the last iteration's, with the parameters after its update. A reference that
// fails on any rank is a Status on every rank.
StatusOr<ReferenceResult> RunReferenceSlice(const Config& config, const RowPartition& partition,
                                            int world_rank, int world_size,
                                            std::optional<ReferenceTrainer>* trainer,
                                            std::vector<CheckResult::Iteration>* iterations) {
  const ReferenceSlice slice{partition.Begin(world_rank), partition.End(world_rank)};
  StatusOr<std::map<std::string, Tensor>> weights =
      SharedMasterWeights(config, world_rank, world_size);
  const int64_t iteration_count = config.optimizer ? config.run->train_iters : 1;
  if (config.optimizer) trainer->emplace(*config.optimizer, config.run->train_iters);
  StatusOr<ReferenceResult> reference = Status::Error("reference model", "not run");
  for (int64_t k = 0; k < iteration_count; ++k) {
    if (k == 0) {
      reference = weights.ok() ? RunReferenceWithOverrides(config.parallel, *config.model,
                                                           *config.run, *weights, slice, 0)
                               : StatusOr<ReferenceResult>(weights.status());
      weights = std::map<std::string, Tensor>();  // the reference holds what it needs
    } else {
      reference = RunReferenceWithOverrides(config.parallel, *config.model, *config.run,
                                            (*trainer)->parameters(), slice, k);
    }
    int failed = reference.ok() ? 0 : 1;
    watched::Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD, WorldLabel());
    if (failed != 0) {
      return reference.ok() ? Status::Error("reference model", "failed on another rank")
                            : Status::Error("reference model", reference.status().Message());
    }
    // Whole tensors: the slices' shares of gradients and of the loss add up.
    SumShares(reference->tensors);
    if (!*trainer) break;
    TrainReference(*reference, k, config.run->dtype, **trainer, iterations);
  }
  return reference;
}

// A training run: the trained tensors' error bounds, and the optimizer state appended to the
// reference's tensors, with the tolerance of its parameter's gradient and the error that
// gradient's tolerance carries into it.
void AddOptimizerState(const ReferenceTrainer& trainer, ReferenceResult& reference,
                       Comparison* c) {
  for (const auto& [name, b] : trainer.error_bounds()) c->bounds[name] = &b;
  c->state = trainer.State();
  for (const ReferenceTrainer::StateTensor& st : c->state) {
    const Tensor& parameter = trainer.parameters().at(st.parameter);
    const ReferenceTensor* grad = reference.Find(st.parameter + "_grad");
    ReferenceTensor t{st.name,
                      parameter.shape(),
                      Layout::kWhole,
                      false,
                      Tensor::HostEmpty(parameter.shape(), DType::kFloat64),
                      grad != nullptr ? grad->budget : ErrorBudget{}};
    std::memcpy(t.value.data(), st.values.data(), t.value.bytes());
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

  for (const TensorRecord& r : records) c->unmatched[r.name] = &r;
  c->stats.resize(n);
  c->flags.assign(2 * n, 0);
  c->tolerances.resize(n);
  c->mine.assign(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    c->tolerances[i] = ToleranceFor(refs[i].budget, storage).ForScale(c->scales[i]);
    const auto it = c->unmatched.find(refs[i].name);
    if (it == c->unmatched.end()) continue;
    c->flags[2 * i + 1] = 1;
    if (it->second->full_shape != refs[i].full_shape) {
      c->flags[2 * i] = 1;
    } else {
      c->mine[i] = it->second;
    }
    c->unmatched.erase(it);
  }
}

// Whole tensors: each rank its own shard. After training, the parameters first, with the
// error bounds training carries; then the optimizer state, its bounds grown by the drift the
// parameters' measured error adds (reference/trainer.h); the last iteration's activations and
// gradients were computed from those parameters, so they are then allowed the parameters'
// measured error too (TrainingDrift, collective).
void CompareWholeTensors(const ReferenceTrainer* trainer, const HostFetch& fetch,
                         Comparison* c) {
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
        if (c->bounds.count(refs[i].name) == 0) c->tolerances[i].atol += drift * c->scales[i];
      }
    }
    for (size_t i = 0; i < n; ++i) {
      if (refs[i].layout != Layout::kWhole || c->mine[i] == nullptr ||
          phase_of(refs[i].name) != phase) {
        continue;
      }
      const auto bound = c->bounds.find(refs[i].name);
      const Tensor host = fetch(*c->mine[i]);
      CompareWhole(*c->mine[i], host, refs[i].value, c->tolerances[i],
                   bound != c->bounds.end() ? bound->second : nullptr, &c->stats[i]);
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
void CompareRowTensors(const Config& config, const RowPartition& partition, int world_size,
                       int64_t row_begin, const HostFetch& fetch, Comparison* c) {
  const std::vector<ReferenceTensor>& refs = *c->refs;
  const std::vector<const TensorRecord*>& mine = c->mine;
  const size_t n = refs.size();
  const RowAgreement agreement(*c);
  std::vector<RowTarget> targets(n);
  for (size_t i = 0; i < n; ++i) targets[i] = {&refs[i], c->tolerances[i], &c->stats[i]};
  RowExchange exchange(partition, world_size, config.parallel.tensor_model_parallel_size,
                       row_begin, std::move(targets));
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
CheckResult BuildResult(const Config& config, const ReferenceResult& reference,
                        const std::vector<TensorRecord>& records,
                        std::vector<CheckResult::Iteration> reference_iterations, int world_rank,
                        int world_size, Comparison& c) {
  const std::vector<ReferenceTensor>& refs = *c.refs;
  const size_t n = refs.size();
  std::vector<std::string> unknown;
  for (const auto& [name, record] : c.unmatched) unknown.push_back(name);
  const std::vector<std::string> run_only = RunOnlyNames(unknown);

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
  if (const ReferenceTensor* loss = reference.Find("loss")) {
    result.has_loss = true;
    result.reference_loss = loss->value.data_as<double>()[0];
  }
  result.reference_iterations = std::move(reference_iterations);
  MeasureMemory(reference, records, &result);
  result.header = fmt::format(
      "check against the float64 reference ({} storage; computed once, split over {} ranks by "
      "token rows):\n"
      "  pass when |a - e| <= allowed * (max|e| + |e|); allowed = {:g} * sqrt(roundings * u^2 + "
      "terms * u_c^2) grows with the tensor's reduction lengths (README \"Checks and "
      "tolerances\")\n",
      DTypeName(config.run->dtype), world_size, kToleranceSafety);
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


StatusOr<CheckResult> CheckAgainstReference(const Config& config,
                                            const std::vector<TensorRecord>& records,
                                            const HostFetch& fetch) {
  int world_rank = 0, world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  const RowPartition partition(ReferenceRows(config.parallel, *config.run), world_size);
  // A training run: the tensors compared are the last iteration's, with the parameters after
  // its update and the optimizer state.
  std::optional<ReferenceTrainer> trainer;
  std::vector<CheckResult::Iteration> reference_iterations;
  StatusOr<ReferenceResult> reference = RunReferenceSlice(config, partition, world_rank,
                                                          world_size, &trainer,
                                                          &reference_iterations);
  if (!reference.ok()) return reference.status();
  Comparison c;
  c.refs = &reference->tensors;
  if (trainer) AddOptimizerState(*trainer, *reference, &c);
  MatchRecords(config.run->dtype, records, &c);
  CompareWholeTensors(trainer ? &*trainer : nullptr, fetch, &c);
  CompareRowTensors(config, partition, world_size, reference->row_begin, fetch, &c);
  return BuildResult(config, *reference, records, std::move(reference_iterations), world_rank,
                     world_size, c);
}

StatusOr<CheckResult> CheckRun(const Config& config, const Topology& topology,
                               const RankCoordinates& coords,
                               const std::vector<TensorRecord>& records, const HostFetch& fetch) {
  if (!config.gpt) return CheckAgainstReference(config, records, fetch);
  // The GPT as the executor resolved it for the layout (GptModel::Build did the same).
  GptConfig gpt = *config.gpt;
  MPUSIM_RETURN_IF_ERROR(CheckGptLayout(config.parallel, *config.run, &gpt));
  return CheckGptAgainstReference(config, gpt, topology, coords, records, fetch);
}

}  // namespace mpusim::run
