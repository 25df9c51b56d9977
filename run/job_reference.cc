// The job's reference (see job_reference.h).
#include "run/job_reference.h"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>
#include <string>

#include "core/dump/compare.h"
#include "mpi/watchdog.h"
#include "run/check.h"
#include "run/row_exchange.h"

namespace mpusim::run {
namespace {

using Layout = ReferenceTensor::Layout;

// MPI counts are int: large buffers go in pieces.
void AllReduceSum(double* data, int64_t n, MPI_Comm comm, const CommLabel& label) {
  constexpr int64_t kPiece = int64_t{1} << 30;
  for (int64_t at = 0; at < n; at += kPiece) {
    const int count = static_cast<int>(std::min(kPiece, n - at));
    watched::Allreduce(MPI_IN_PLACE, data + at, count, MPI_DOUBLE, MPI_SUM, comm, label);
  }
}

// The reference's master parameters, generated once for the whole job instead of once per
// slice: they lie back to back in one buffer, rank k fills its 1/K of the buffer's elements
// (whichever parameters they belong to), and one MPI_Allgatherv gives every rank all of them
// (each slice needs whole parameters). The tensors are views into the buffer. Past int
// counts (2^31 elements), every rank generates everything itself.
StatusOr<std::map<std::string, Tensor>> SharedMasterParameters(const Reference& reference,
                                                               uint64_t seed, int world_rank,
                                                               int world_size) {
  StatusOr<std::vector<ReferenceParameter>> parameters = reference.Parameters();
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
    FillFlatRange(seed, p.name, p.init, p.shape, begin - offsets[w], part);
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
  std::map<std::string, Tensor> values;
  for (size_t w = 0; w < parameters->size(); ++w) {
    values.emplace((*parameters)[w].name, view(offsets[w], (*parameters)[w].shape));
  }
  return values;
}

// Sums the slices' shares (gradients, the loss) over the ranks of `comm`: small tensors
// packed together into one MPI_Allreduce of at most kExchangeBytes, large ones each on their
// own.
void SumShares(std::vector<ReferenceTensor>& tensors, MPI_Comm comm, const CommLabel& label) {
  constexpr int64_t kPackDoubles = kExchangeBytes / 8;
  std::vector<double> pack;
  std::vector<ReferenceTensor*> packed;
  const auto flush = [&]() {
    AllReduceSum(pack.data(), static_cast<int64_t>(pack.size()), comm, label);
    size_t at = 0;
    for (ReferenceTensor* t : packed) {
      std::memcpy(t->value.data(), pack.data() + at, t->value.bytes());
      at += static_cast<size_t>(t->value.numel());
    }
    pack.clear();
    packed.clear();
  };
  for (ReferenceTensor& t : tensors) {
    if (t.layout != Layout::kWhole || !t.partial) continue;
    const int64_t n = t.value.numel();
    if (n > kPackDoubles) {
      AllReduceSum(t.value.data_as<double>(), n, comm, label);
      continue;
    }
    if (static_cast<int64_t>(pack.size()) + n > kPackDoubles) flush();
    pack.insert(pack.end(), t.value.data_as<double>(), t.value.data_as<double>() + n);
    packed.push_back(&t);
  }
  if (!packed.empty()) flush();
}

}  // namespace

void TrainReference(ReferenceResult& reference, int64_t k, DType storage,
                    ReferenceTrainer& trainer, std::vector<ReferenceIteration>* iterations) {
  std::map<std::string, Tensor> parameters;
  std::map<std::string, Tensor*> grads;
  double gradient_tolerance = 0;
  ReferenceIteration row;
  for (ReferenceTensor& t : reference.tensors) {
    if (t.parameter) parameters[t.name] = t.value;
    if (t.name == "loss") row.loss = t.value.data_as<double>()[0];
  }
  for (ReferenceTensor& t : reference.tensors) {
    if (t.gradient_of.empty() || parameters.count(t.gradient_of) == 0) continue;
    grads[t.gradient_of] = &t.value;
    gradient_tolerance = std::max(gradient_tolerance, ToleranceFor(t.budget, storage).rtol);
  }
  if (!trainer.has_parameters()) trainer.SetParameters(parameters);
  trainer.SetGradientTolerance(0, gradient_tolerance, gradient_tolerance);
  row.grad_norm = trainer.Step(grads, k);
  row.lr = trainer.last_lr();
  iterations->push_back(row);
  for (ReferenceTensor& t : reference.tensors) {
    const auto it = trainer.parameters().find(t.name);
    if (t.parameter && it != trainer.parameters().end()) t.value = it->second;
  }
}

StatusOr<JobReference> ComputeJobReference(const Config& config, const RankCoordinates& coords,
                                           const BeforeStep& before_step) {
  int world_rank = 0, world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  JobReference job;
  StatusOr<std::unique_ptr<Reference>> built = BuildReference(config);
  if (!built.ok()) return built.status();
  job.reference = std::move(built).value();
  job.split = job.reference->SplitFor(coords, world_rank, world_size);
  // The ranks whose slices partition the batch sum their shares (every rank's, when one
  // group holds them all: no communicator to make).
  const bool whole_world = job.split.group_size == world_size;
  MPI_Comm group = whole_world ? MPI_COMM_WORLD
                               : watched::CommSplit(MPI_COMM_WORLD, job.split.group,
                                                    job.split.index, WorldLabel());
  const CommLabel group_label = whole_world ? WorldLabel() : LabelOf(group, "reference slices");
  const auto free_group = [&] {
    if (!whole_world) MPI_Comm_free(&group);
  };

  StatusOr<std::map<std::string, Tensor>> master =
      SharedMasterParameters(*job.reference, config.run->seed, world_rank, world_size);
  const int64_t iteration_count = config.optimizer ? config.run->train_iters : 1;
  if (config.optimizer) {
    job.trainer.emplace(*config.optimizer, config.run->train_iters);
    job.trainer->SetPrecision(PrecisionOf(config));
  }
  StatusOr<ReferenceResult> result = Status::Error("reference model", "not run");
  // What moves with training besides the parameters (Reference::FinishIteration).
  std::map<std::string, Tensor> state;
  for (int64_t k = 0; k < iteration_count; ++k) {
    if (k == 0) {
      result = master.ok() ? job.reference->Run({job.split.slice, 0, &*master})
                           : StatusOr<ReferenceResult>(master.status());
      master = std::map<std::string, Tensor>();  // the result holds what it needs
    } else {
      std::map<std::string, Tensor> inputs = job.trainer->parameters();
      inputs.insert(state.begin(), state.end());
      result = job.reference->Run({job.split.slice, k, &inputs});
    }
    int failed = result.ok() ? 0 : 1;
    watched::Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD, WorldLabel());
    if (failed != 0) {
      free_group();
      return result.ok() ? Status::Error("reference model", "failed on another rank")
                         : Status::Error("reference model", result.status().Message());
    }
    SumShares(result->tensors, group, group_label);
    job.reference->FinishIteration(*result, job.trainer.has_value(), &state);
    if (before_step) {
      const Status kept = before_step(k, *result);
      int bad = kept.ok() ? 0 : 1;
      watched::Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD, WorldLabel());
      if (bad != 0) {
        free_group();
        return kept.ok() ? Status::Error("reference", "failed on another rank") : kept;
      }
    }
    if (!job.trainer) break;
    TrainReference(*result, k, config.run->dtype, *job.trainer, &job.iterations);
  }
  free_group();
  job.result = std::move(result).value();
  return job;
}

}  // namespace mpusim::run
