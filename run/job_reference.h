// The float64 reference a job's check compares with (run/check.h), computed once per job:
// each rank computes its slice of the model's reference (reference/reference.h, the split the
// reference gives), the master parameters are generated once for the whole job, and the
// slices' shares of gradients and of the loss are summed over the ranks whose slices
// partition the batch. A training run trains the reference too, iteration by iteration
// (reference/trainer.h).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "core/config/config.h"
#include "core/status.h"
#include "core/topology.h"
#include "reference/reference.h"
#include "reference/trainer.h"

namespace mpusim::run {

// One training iteration of the reference: its loss, gradient norm and learning rate.
struct ReferenceIteration {
  double loss = 0, grad_norm = 0, lr = 0;
};

struct JobReference {
  std::unique_ptr<Reference> reference;
  ReferenceSplit split;
  // The last iteration's tensors on this rank's slice, shares summed; after training, the
  // parameters after the last step and the gradients clipped, as the executor's records are.
  ReferenceResult result;
  // A training run: the reference's optimizer (its parameters, state and error bounds) and
  // the loss, gradient norm and learning rate of every iteration.
  std::optional<ReferenceTrainer> trainer;
  std::vector<ReferenceIteration> iterations;
};

// Collective over MPI_COMM_WORLD. A reference that cannot run, on any rank, is a Status on
// every rank.
StatusOr<JobReference> ComputeJobReference(const Config& config, const RankCoordinates& coords);

}  // namespace mpusim::run
