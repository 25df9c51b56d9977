// The GPT run's check (see gpt_check.h).
#include "run/gpt_check.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "mpi/watchdog.h"
#include "reference/gpt_reference.h"
#include "reference/trainer.h"

namespace mpusim::run {
namespace {

// Where a record's local elements sit in a reference tensor: for local flat index l, the
// flat index into the reference value, or -1 when the element is outside the reference's
// sample slice (a record of another dp rank's samples: never for a correct layout).
class ElementMap {
 public:
  ElementMap(const TensorRecord& record, const GptReferenceTensor& ref, int64_t sample_begin,
             int64_t sample_end)
      : record_(record), ref_(ref), local_(LocalShape(record.shard, record.full_shape)) {
    ref_shape_ = record.full_shape;
    if (ref.batch_dim >= 0) {
      ref_shape_[static_cast<size_t>(ref.batch_dim)] = sample_end - sample_begin;
      sample_begin_ = sample_begin;
    }
  }
  int64_t RefIndex(int64_t local_flat) const {
    int64_t flat = 0, ref_stride = 1;
    int64_t rest = local_flat;
    for (size_t dim = local_.size(); dim-- > 0;) {
      const int64_t l = rest % local_[dim];
      rest /= local_[dim];
      int64_t g = GlobalIndex(record_.shard, static_cast<int>(dim), record_.full_shape[dim], l);
      if (static_cast<int>(dim) == ref_.batch_dim) {
        g -= sample_begin_;
        if (g < 0 || g >= ref_shape_[dim]) return -1;
      }
      flat += g * ref_stride;
      ref_stride *= ref_shape_[dim];
    }
    return flat;
  }
  // The flat index of the element in the full tensor (for the worst-element report).
  int64_t FullIndex(int64_t local_flat) const {
    int64_t flat = 0, stride = 1, rest = local_flat;
    for (size_t dim = local_.size(); dim-- > 0;) {
      const int64_t l = rest % local_[dim];
      rest /= local_[dim];
      flat += GlobalIndex(record_.shard, static_cast<int>(dim), record_.full_shape[dim], l) * stride;
      stride *= record_.full_shape[dim];
    }
    return flat;
  }

 private:
  const TensorRecord& record_;
  const GptReferenceTensor& ref_;
  Shape local_;
  Shape ref_shape_;
  int64_t sample_begin_ = 0;
};

// One optimizer step of the reference on its full gradients, iteration k; the records hold
// the clipped gradients and the parameters after the step, and so does `ref` afterwards.
void TrainGptReference(const std::set<std::string>& parameter_names, int64_t k,
                       ReferenceTrainer& trainer, GptReferenceResult* ref,
                       std::vector<CheckResult::Iteration>* iterations) {
  std::map<std::string, Tensor> parameters;
  std::map<std::string, Tensor*> grads;
  CheckResult::Iteration row;
  for (GptReferenceTensor& t : ref->tensors) {
    if (parameter_names.count(t.name) != 0) {
      parameters[t.name] = t.value;
    } else if (t.name.ends_with(".grad") &&
               parameter_names.count(t.name.substr(0, t.name.size() - 5)) != 0) {
      grads[t.name.substr(0, t.name.size() - 5)] = &t.value;
    } else if (t.name == "loss") {
      row.loss = t.value.data_as<double>()[0];
    }
  }
  if (!trainer.has_parameters()) trainer.SetParameters(parameters);
  row.grad_norm = trainer.Step(grads, k);
  row.lr = trainer.last_lr();
  iterations->push_back(row);
  // The result's parameter tensors show the values after the step.
  for (GptReferenceTensor& t : ref->tensors) {
    const auto it = trainer.parameters().find(t.name);
    if (it != trainer.parameters().end()) t.value = it->second;
  }
}

// The reference on this rank's sample slice, the whole tensors' shares (gradients, the loss)
// summed over the dp slices (an MPI_Allreduce per partial tensor over the ranks of one pp,
// cp and tp coordinate). A training run: each iteration's reference runs on the parameters
// the previous steps made, and the result is the last iteration's, after its step.
StatusOr<GptReferenceResult> RunGptReferenceSlice(const Config& config, const GptConfig& gpt,
                                                  const DerivedSizes& sizes,
                                                  const RankCoordinates& coords,
                                                  GptReferenceOptions options,
                                                  ReferenceTrainer* trainer,
                                                  std::vector<CheckResult::Iteration>* iterations) {
  const RunConfig& run = *config.run;
  MPI_Comm dp_comm = watched::CommSplit(
      MPI_COMM_WORLD, static_cast<int>((coords.pp * sizes.cp + coords.cp) * sizes.tp + coords.tp),
      static_cast<int>(coords.dp), WorldLabel());
  const CommLabel dp_label = LabelOf(dp_comm, "dp");
  const std::set<std::string> parameter_names = [&] {
    std::set<std::string> names;
    for (const GptParameter& p : GptParameters(gpt, gpt.PaddedVocabSize(sizes.tp), false)) {
      names.insert(p.name);
    }
    return names;
  }();
  const int64_t iteration_count = config.optimizer ? run.train_iters : 1;
  GptReferenceResult ref;
  for (int64_t k = 0; k < iteration_count; ++k) {
    options.iteration = k;
    if (trainer != nullptr && trainer->has_parameters()) {
      options.parameter_overrides = trainer->parameters();
    }
    StatusOr<GptReferenceResult> reference = RunGptReference(gpt, config.parallel, run, options);
    if (!reference.ok()) {
      MPI_Comm_free(&dp_comm);
      return reference.status();
    }
    ref = std::move(reference).value();
    for (GptReferenceTensor& t : ref.tensors) {
      if (!t.partial || sizes.dp == 1) continue;
      watched::Allreduce(MPI_IN_PLACE, t.value.data(), static_cast<int>(t.value.numel()),
                         MPI_DOUBLE, MPI_SUM, dp_comm, dp_label);
    }
    if (trainer == nullptr) break;
    TrainGptReference(parameter_names, k, *trainer, &ref, iterations);
  }
  MPI_Comm_free(&dp_comm);
  return ref;
}

// A training run: the optimizer state after the last step appended to the reference's
// tensors; returns the state tensors (their error bounds and drift gains) by name.
std::map<std::string, ReferenceTrainer::StateTensor> AddGptOptimizerState(
    const ReferenceTrainer& trainer, GptReferenceResult* ref) {
  std::map<std::string, ReferenceTrainer::StateTensor> state;
  for (ReferenceTrainer::StateTensor& st : trainer.State()) {
    const Tensor& parameter = trainer.parameters().at(st.parameter);
    GptReferenceTensor t;
    t.name = st.name;
    t.full_shape = parameter.shape();
    t.value = Tensor::HostEmpty(parameter.shape(), DType::kFloat64);
    std::memcpy(t.value.data(), st.values.data(), t.value.bytes());
    st.values.clear();  // the reference tensor holds them now
    ref->tensors.push_back(std::move(t));
    std::string name = st.name;
    state.emplace(std::move(name), std::move(st));
  }
  return state;
}

// The tensors in the reference's order, and this rank's records of each. Run-only names must
// be the same list on every rank: gathering them from rank 0's records is not enough (ranks
// may differ), so each rank marks which reference slots it covers and run-only names are
// reported by the ranks that have them.
struct GptSlots {
  std::vector<std::string> names;                         // the reference's tensors
  std::vector<std::vector<const TensorRecord*>> by_slot;  // this rank's records of each
  std::vector<const TensorRecord*> extra;                 // records the reference lacks
};

GptSlots MatchGptRecords(const GptReferenceResult& ref, const std::vector<TensorRecord>& records) {
  GptSlots slots;
  std::map<std::string, size_t> slot;
  for (const GptReferenceTensor& t : ref.tensors) {
    slot.emplace(t.name, slots.names.size());
    slots.names.push_back(t.name);
  }
  slots.by_slot.resize(slots.names.size());
  for (const TensorRecord& r : records) {
    const auto it = slot.find(r.name);
    const GptReferenceTensor* rt = it == slot.end() ? nullptr : &ref.tensors[it->second];
    if (rt == nullptr || rt->full_shape != r.full_shape) {
      slots.extra.push_back(&r);
    } else {
      slots.by_slot[it->second].push_back(&r);
    }
  }
  return slots;
}

// Pass 1: the scale max|e| of each tensor over the elements any rank compares (one
// MPI_Allreduce).
std::vector<double> GptScales(const GptReferenceResult& ref, const GptSlots& slots,
                              const GptReferenceOptions& options) {
  const size_t T = slots.names.size();
  std::vector<double> scale(T, 0.0);
  for (size_t i = 0; i < T; ++i) {
    const GptReferenceTensor& rt = ref.tensors[i];
    const double* e = rt.value.data_as<double>();
    for (const TensorRecord* r : slots.by_slot[i]) {
      const ElementMap map(*r, rt, options.sample_begin, options.sample_end);
      const int64_t n = NumElements(LocalShape(r->shard, r->full_shape));
      for (int64_t l = 0; l < n; ++l) {
        const int64_t k = map.RefIndex(l);
        if (k >= 0) scale[i] = std::max(scale[i], std::fabs(e[k]));
      }
    }
  }
  watched::Allreduce(MPI_IN_PLACE, scale.data(), static_cast<int>(T), MPI_DOUBLE, MPI_MAX,
                     MPI_COMM_WORLD, WorldLabel());
  return scale;
}

// What pass 2 compares with: the reference, its scales and tolerance, and after training the
// error bounds of the trained tensors.
struct GptCompareContext {
  const GptReferenceResult* ref = nullptr;
  const GptSlots* slots = nullptr;
  const std::vector<double>* scale = nullptr;
  Tolerance tolerance{0, 0, 0};
  const ReferenceTrainer* trainer = nullptr;  // a training run
  const std::map<std::string, ReferenceTrainer::StateTensor>* state = nullptr;
  const GptReferenceOptions* options = nullptr;
};

// Pass 2: compare. After training, the parameters first, with the error bounds training
// carries; then the optimizer state, with its bounds and the drift the parameters' measured
// error adds to them (reference/trainer.h); last the final iteration's activations and
// gradients, which were computed from those parameters, so they are allowed the parameters'
// measured error too, relative to their scale (TrainingDrift: the sum over the parameters of
// max|a - e| / max|e|, times the tolerance's safety factor: to first order every product adds
// its factors' relative errors; collective).
void CompareGptTensors(const GptCompareContext& ctx, const HostFetch& fetch,
                       std::vector<ErrorStats>* stats, std::vector<double>* budget_atol) {
  const std::vector<double>& scale = *ctx.scale;
  const size_t T = ctx.slots->names.size();
  const ReferenceTrainer* trainer = ctx.trainer;
  enum class Phase { kParameters, kState, kRest };
  auto phase_of = [&](const std::string& name) {
    if (trainer != nullptr && trainer->error_bounds().count(name) != 0) return Phase::kParameters;
    if (ctx.state != nullptr && ctx.state->count(name) != 0) return Phase::kState;
    return Phase::kRest;
  };
  double drift = 0;
  std::map<std::string, std::vector<double>> state_bounds;  // at the measured drift
  for (const Phase phase : {Phase::kParameters, Phase::kState, Phase::kRest}) {
    if (phase == Phase::kState && trainer != nullptr) {
      drift = TrainingDrift(ctx.slots->names, scale, *stats, trainer->parameters());
      for (const auto& [name, st] : *ctx.state) state_bounds[name] = st.BoundsAt(drift);
    }
    for (size_t i = 0; i < T; ++i) {
      const GptReferenceTensor& rt = ctx.ref->tensors[i];
      if (phase_of(rt.name) != phase) continue;
      const double* e = rt.value.data_as<double>();
      // Token ids are exact data: compared for equality.
      const bool exact = rt.name == "tokens" || rt.name == "labels";
      Tolerance tol = exact ? Tolerance{0, 0, 0} : ctx.tolerance.ForScale(scale[i]);
      // A trained parameter or optimizer state: each element's allowance also holds the
      // error its gradients' tolerance carries through the optimizer steps.
      const std::vector<double>* bounds =
          phase == Phase::kParameters ? &trainer->error_bounds().at(rt.name)
          : phase == Phase::kState    ? &state_bounds.at(rt.name)
                                      : nullptr;
      if (phase == Phase::kRest && !exact) tol.atol += drift * scale[i];
      (*budget_atol)[i] = tol.atol + (bounds != nullptr && !bounds->empty()
                                          ? *std::max_element(bounds->begin(), bounds->end())
                                          : 0.0);
      for (const TensorRecord* r : ctx.slots->by_slot[i]) {
        const Tensor host = fetch(*r);
        const ElementMap map(*r, rt, ctx.options->sample_begin, ctx.options->sample_end);
        const int64_t n = host.numel();
        for (int64_t l = 0; l < n; ++l) {
          const int64_t k = map.RefIndex(l);
          // An element outside this rank's reference slice cannot be judged here: count it
          // as a mismatch (a record placed on the wrong samples is a bug).
          const double expected = k >= 0 ? e[k] : std::numeric_limits<double>::quiet_NaN();
          const Tolerance element_tol =
              bounds != nullptr && k >= 0
                  ? Tolerance{tol.atol + (*bounds)[static_cast<size_t>(k)], tol.rtol, 0}
                  : tol;
          (*stats)[i].Add(map.FullIndex(l), HostValue(host, l), expected, element_tol);
        }
      }
    }
  }
}

// The statistics reduced over all ranks, 3 values per tensor in each.
struct GptReducedStats {
  std::vector<int64_t> sums;         // count, mismatches, non_finite
  std::vector<double> maxima;        // max_abs, max_rel, max_used
  std::vector<double> worst_values;  // the worst element's index, actual, expected
};

// Reduce: sums, maxima, and the worst element from the rank that holds it.
GptReducedStats ReduceGptStats(const std::vector<ErrorStats>& stats) {
  const size_t T = stats.size();
  std::vector<int64_t> sums(3 * T);
  std::vector<double> maxima(3 * T);
  struct DoubleInt {  // MPI_DOUBLE_INT's layout
    double excess;
    int rank;
  };
  std::vector<DoubleInt> worst(T);
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  for (size_t i = 0; i < T; ++i) {
    sums[3 * i] = stats[i].count;
    sums[3 * i + 1] = stats[i].mismatches;
    sums[3 * i + 2] = stats[i].non_finite;
    maxima[3 * i] = stats[i].max_abs;
    maxima[3 * i + 1] = stats[i].max_rel;
    maxima[3 * i + 2] = stats[i].max_used;
    worst[i] = {stats[i].count > 0 ? std::min(stats[i].worst_excess, 1e300) : -1e300, world_rank};
  }
  watched::Allreduce(MPI_IN_PLACE, sums.data(), static_cast<int>(sums.size()), MPI_INT64_T,
                     MPI_SUM, MPI_COMM_WORLD, WorldLabel());
  watched::Allreduce(MPI_IN_PLACE, maxima.data(), static_cast<int>(maxima.size()), MPI_DOUBLE,
                     MPI_MAX, MPI_COMM_WORLD, WorldLabel());
  watched::Allreduce(MPI_IN_PLACE, worst.data(), static_cast<int>(T), MPI_DOUBLE_INT, MPI_MAXLOC,
                     MPI_COMM_WORLD, WorldLabel());
  std::vector<double> worst_values(3 * T, 0.0);
  for (size_t i = 0; i < T; ++i) {
    if (worst[i].rank != world_rank || stats[i].count == 0) continue;
    worst_values[3 * i] = static_cast<double>(stats[i].worst_index);
    worst_values[3 * i + 1] = stats[i].worst_actual;
    worst_values[3 * i + 2] = stats[i].worst_expected;
  }
  watched::Allreduce(MPI_IN_PLACE, worst_values.data(), static_cast<int>(worst_values.size()),
                     MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD, WorldLabel());
  return {std::move(sums), std::move(maxima), std::move(worst_values)};
}

// One TensorCheck per reference tensor, from the reduced statistics.
std::vector<TensorCheck> GptTensorChecks(const GptReferenceResult& ref,
                                         const GptReducedStats& reduced,
                                         const std::vector<double>& scale,
                                         const Tolerance& tolerance,
                                         const std::vector<double>& budget_atol) {
  const std::vector<int64_t>& sums = reduced.sums;
  const std::vector<double>& maxima = reduced.maxima;
  const std::vector<double>& worst_values = reduced.worst_values;
  std::vector<TensorCheck> checks;
  for (size_t i = 0; i < scale.size(); ++i) {
    const GptReferenceTensor& rt = ref.tensors[i];
    TensorCheck c;
    c.name = rt.name;
    c.full_shape = rt.full_shape;
    c.count = sums[3 * i];
    c.mismatches = sums[3 * i + 1];
    c.non_finite = sums[3 * i + 2];
    c.max_abs = maxima[3 * i];
    c.max_rel = maxima[3 * i + 1];
    c.used = maxima[3 * i + 2];
    c.scale = scale[i];
    c.normalized = scale[i] > 0 ? c.max_abs / scale[i] : 0.0;
    c.allowed = rt.name == "tokens" || rt.name == "labels" ? 0.0 : tolerance.rtol;
    c.budget_atol = budget_atol[i];
    c.not_produced = c.count == 0;
    if (c.mismatches > 0) {
      c.worst_index = IndexString(rt.full_shape, static_cast<int64_t>(worst_values[3 * i]));
      c.worst_actual = worst_values[3 * i + 1];
      c.worst_expected = worst_values[3 * i + 2];
    }
    checks.push_back(std::move(c));
  }
  return checks;
}

// Run-only tensors: agreed over all ranks by count (each rank reports its own names, and
// rank 0's report lists them; the verdict fails on every rank).
void AddRunOnly(const std::vector<const TensorRecord*>& extra, CheckResult* result) {
  int64_t extras = static_cast<int64_t>(extra.size());
  watched::Allreduce(MPI_IN_PLACE, &extras, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD, WorldLabel());
  for (const TensorRecord* r : extra) {
    TensorCheck c;
    c.name = r->name;
    c.full_shape = r->full_shape;
    c.missing = true;
    result->tensors.push_back(std::move(c));
  }
  if (extras > 0 && extra.empty()) {
    TensorCheck c;
    c.name = "(tensors of other ranks)";
    c.missing = true;
    result->tensors.push_back(std::move(c));
  }
}

// The reference's loss and iterations, the memory figures (maxima over the ranks) and the
// report's lines.
void AddGptSummary(const RunConfig& run, const GptReferenceResult& ref,
                   const std::vector<TensorRecord>& records,
                   std::vector<CheckResult::Iteration> reference_iterations,
                   CheckResult* result) {
  const int64_t b = run.micro_batch_size;
  result->has_loss = true;
  result->reference_iterations = std::move(reference_iterations);
  result->reference_loss = ref.loss;
  const GptReferenceTensor* loss = ref.Find("loss");
  if (loss != nullptr) result->reference_loss = loss->value.data_as<double>()[0];
  int64_t held = 0;
  for (const GptReferenceTensor& t : ref.tensors) held += static_cast<int64_t>(t.value.bytes());
  result->reference_rows_max = run.seq_length * b;
  result->reference_bytes_max = held;
  watched::Allreduce(MPI_IN_PLACE, &result->reference_bytes_max, 1, MPI_INT64_T, MPI_MAX,
                     MPI_COMM_WORLD, WorldLabel());
  result->reference_bytes_whole = held;
  int64_t own = 0;
  for (const TensorRecord& r : records) own += static_cast<int64_t>(r.tensor.bytes());
  result->record_bytes_max = own;
  watched::Allreduce(MPI_IN_PLACE, &result->record_bytes_max, 1, MPI_INT64_T, MPI_MAX,
                     MPI_COMM_WORLD, WorldLabel());
  result->header = fmt::format(
      "check against the float64 GPT reference ({} storage; each rank computes its dp rank's "
      "samples):\n"
      "  pass when |a - e| <= allowed * (max|e| + |e|); allowed = {:g} * sqrt(roundings * u^2 "
      "+ terms * u_c^2) for the model's longest path (README \"Checks and tolerances\")\n",
      DTypeName(run.dtype), kToleranceSafety);
  result->memory = fmt::format(
      "reference memory: {:.1f} MiB on the largest rank (the whole model and {} token rows); "
      "the largest rank's own tensors: {:.1f} MiB\n",
      Mebibytes(result->reference_bytes_max), result->reference_rows_max,
      Mebibytes(result->record_bytes_max));
}

}  // namespace

ErrorBudget GptErrorBudget(const GptConfig& gpt, const RunConfig& run, int64_t t, int64_t d,
                           int64_t padded_vocab) {
  const double L = static_cast<double>(gpt.num_layers);
  const double s = static_cast<double>(run.seq_length);
  const double tokens = static_cast<double>(run.num_microbatches * run.seq_length *
                                            run.micro_batch_size * d);
  // Roundings: a stored value carries at most u of relative error, but most of a layer's
  // stored values (qkv, scores, probabilities, context, fc1, activation) feed the residual
  // stream through GEMMs that average their errors; calibrated as 4 independent roundings
  // per layer, forward and backward (bench/tolerance_margins.py's rule: the largest error on
  // every test layout stays under a fifth of its allowance). Terms: the reductions of the
  // layer's GEMMs and norms, forward and backward.
  const double per_layer_terms =
      static_cast<double>(gpt.hidden_size) * 4 +
      static_cast<double>(gpt.num_attention_heads * gpt.kv_channels) * 2 + s * 2 +
      static_cast<double>(gpt.ffn_hidden_size) * 2;
  ErrorBudget budget;
  budget.roundings = 4 * (L + 2);
  budget.terms = per_layer_terms * (L + 1) + static_cast<double>(padded_vocab) * 2 + tokens +
                 static_cast<double>(t + d);
  return budget;
}

StatusOr<CheckResult> CheckGptAgainstReference(const Config& config, const GptConfig& gpt,
                                               const Topology& topology,
                                               const RankCoordinates& coords,
                                               const std::vector<TensorRecord>& records,
                                               const HostFetch& fetch) {
  const RunConfig& run = *config.run;
  const DerivedSizes& sizes = topology.sizes();
  const int64_t b = run.micro_batch_size;
  GptReferenceOptions options;
  options.sample_begin = coords.dp * b;
  options.sample_end = coords.dp * b + b;
  const ErrorBudget budget =
      GptErrorBudget(gpt, run, sizes.tp, sizes.dp, gpt.PaddedVocabSize(sizes.tp));
  const Tolerance tolerance = ToleranceFor(budget, run.dtype);
  std::optional<ReferenceTrainer> trainer;
  if (config.optimizer) {
    trainer.emplace(*config.optimizer, run.train_iters);
    trainer->SetGradientTolerance(tolerance.atol, tolerance.ntol, tolerance.rtol);
  }
  std::vector<CheckResult::Iteration> reference_iterations;
  StatusOr<GptReferenceResult> reference =
      RunGptReferenceSlice(config, gpt, sizes, coords, options, trainer ? &*trainer : nullptr,
                           &reference_iterations);
  if (!reference.ok()) return reference.status();
  GptReferenceResult& ref = *reference;
  std::map<std::string, ReferenceTrainer::StateTensor> state;
  if (trainer) state = AddGptOptimizerState(*trainer, &ref);

  const GptSlots slots = MatchGptRecords(ref, records);
  const std::vector<double> scale = GptScales(ref, slots, options);
  std::vector<ErrorStats> stats(slots.names.size());
  std::vector<double> budget_atol(slots.names.size(), 0.0);  // TensorCheck::budget_atol
  const GptCompareContext ctx{&ref,      &slots, &scale, tolerance, trainer ? &*trainer : nullptr,
                              &state, &options};
  CompareGptTensors(ctx, fetch, &stats, &budget_atol);

  CheckResult result;
  result.tensors = GptTensorChecks(ref, ReduceGptStats(stats), scale, tolerance, budget_atol);
  AddRunOnly(slots.extra, &result);
  AddGptSummary(run, ref, records, std::move(reference_iterations), &result);
  return result;
}

}  // namespace mpusim::run
