// The check of `mpusim run` against the float64 reference, one check for every model.
//
// What it is: the job computes the model's reference once (run/job_reference.h), each rank
// its slice of it as the reference splits the batch (reference/reference.h: the layer chain
// by token rows over every rank, the GPT by samples over the data-parallel ranks). Then,
// tensor by tensor, by how the reference tensor covers its full tensor:
//   whole tensors (parameters, gradients, the loss, the optimizer state): each rank compares
//     its own shard;
//   sample tensors (the GPT's activations): each rank compares its own shard, whose samples
//     its slice holds;
//   row tensors (the chain's activations, tokens, labels, per-token losses): every rank sends
//     the rows of its shard to the ranks whose slices hold them, and each rank compares what
//     it receives with its slice; tensors share exchanges (one MPI_Alltoallv each) of at most
//     kExchangeBytes per rank, so a small model's check is one exchange at any rank count.
// The statistics are then reduced over all ranks. Every element of every recorded tensor is
// compared, on whichever rank holds it (replicas included: a tp-replicated activation is
// compared once per copy), under the tolerance its error budget gives (core/dump/compare.h).
// Host copies are made one record at a time, when that record is compared.
// What it is not: a gather. No rank ever holds a full activation tensor.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dump/compare.h"
#include "core/config/config.h"
#include "core/model/record.h"
#include "core/topology.h"
#include "core/status.h"
#include "run/job_reference.h"

namespace mpusim::run {

// One tensor's comparison with the reference, reduced over all ranks (the same on every
// rank).
struct TensorCheck {
  std::string name;
  Shape full_shape;
  double max_abs = 0;
  double max_rel = 0;
  double scale = 0;       // max |expected| over the full tensor
  double normalized = 0;  // max_abs / scale (0 when the tensor is all zeros)
  double allowed = 0;     // the tensor's tolerance: pass when |a - e| <= allowed * (scale + |e|)
  // The largest share of its own allowance any element's error uses: <= 1 passes. Equal to
  // the largest |a - e| / (allowed * (scale + |e|)), except for trained parameters and
  // optimizer states, whose elements are also allowed the error their gradients' tolerance
  // carries through the optimizer steps.
  double used = 0;
  // The absolute part of the allowance, `allowed` being the relative one: every element was
  // allowed |a - e| <= budget_atol + allowed * |e|. It is allowed * scale, plus after
  // training the parameters' drift (TrainingDrift) or, for a trained parameter or optimizer
  // state, the largest of its elements' training bounds (the state's grown by that drift: a
  // summary that covers each). A dump
  // records both as the tensor's error budget (manifest "budget"), and `mpusim diff` allows
  // two dumps with budgets the sum of theirs (core/dump/diff.h).
  double budget_atol = 0;
  int64_t count = 0;      // elements compared (every copy of a replicated element counts)
  int64_t mismatches = 0;
  int64_t non_finite = 0;
  bool missing = false;       // recorded by the run, but the reference has no such tensor/shape
  bool not_produced = false;  // in the reference, but no rank recorded it
  // The element that most exceeds its tolerance (or the first non-finite one).
  std::string worst_index;  // "[i, j, k]" in the full tensor
  double worst_actual = 0;
  double worst_expected = 0;

  bool ok() const {
    return !missing && !not_produced && mismatches == 0 && count >= NumElements(full_shape);
  }
};

struct CheckResult {
  std::vector<TensorCheck> tensors;  // the reference's order, then run-only tensors
  bool has_loss = false;
  double reference_loss = 0;
  // A training run: the reference's loss, gradient norm and learning rate per iteration
  // (the last iteration's loss is reference_loss).
  using Iteration = ReferenceIteration;
  std::vector<Iteration> reference_iterations;
  // Memory, in bytes of distinct storage (aliases counted once), over all ranks:
  int64_t reference_rows_max = 0;     // the most token rows one rank's slice holds
  int64_t reference_bytes_max = 0;    // the most reference tensors one rank holds
  int64_t reference_bytes_whole = 0;  // what one process holding the whole reference would hold
  int64_t record_bytes_max = 0;       // the most bytes of its own tensors one rank checked
  // What the report prints of the check: the lines before the table (which reference, how
  // it was split, how the tolerances grow) and the line on the reference's memory.
  std::string header;
  std::string memory;
};

// After training, what the last iteration's activations and gradients (and, through every
// iteration's gradients, the optimizer state: reference/trainer.h "Drift") inherit from the
// trained parameters on top of their own rounding, relative to their scale: the parameters'
// measured errors (stats[i].max_abs of the tensors in `names` that are `parameters`, the largest over
// the ranks) over their scales, summed (to first order every product adds its factors'
// relative errors), times kToleranceSafety. Collective over MPI_COMM_WORLD.
double TrainingDrift(const std::vector<std::string>& names, const std::vector<double>& scales,
                     const std::vector<ErrorStats>& stats,
                     const std::map<std::string, Tensor>& parameters);

// Host view of a record's tensor (a copy for device tensors, the tensor itself on the host).
using HostFetch = std::function<Tensor(const TensorRecord&)>;

// Collective over MPI_COMM_WORLD: every rank calls it with its own records of one run of
// `config`, taken from the rank at `coords`. A reference that cannot run is a Status on every
// rank.
// Where the check's reference comes from: computed by the job (stored_dir empty), or read from
// the stored reference in stored_dir (run/stored_reference.h), which must have `identity`.
struct ReferenceSource {
  std::string stored_dir;
  nlohmann::json identity;
};

StatusOr<CheckResult> CheckRun(const Config& config, const RankCoordinates& coords,
                               const std::vector<TensorRecord>& records, const HostFetch& fetch,
                               const ReferenceSource& source = {});

// "[i, j, k]": the multi-index of `flat` in `shape` (a TensorCheck's worst_index).
std::string IndexString(const Shape& shape, int64_t flat);

// `bytes` in MiB, for the report.
inline double Mebibytes(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// Bytes a rank sends per exchange (and sums per packed all-reduce): bounds the buffers.
inline constexpr int64_t kExchangeBytes = int64_t{32} << 20;

}  // namespace mpusim::run
