// The float64 reference a job's check compares with (run/check.h), computed once per job:
// each rank computes its slice of the model's reference (reference/reference.h, the split the
// reference gives), the master parameters are generated once for the whole job, and the
// slices' shares of gradients and of the loss are summed over the ranks whose slices
// partition the batch. A training run trains the reference too, iteration by iteration
// (reference/trainer.h).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
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
  // Read from a stored reference (run/stored_reference.h) in this folder; empty: computed.
  std::string stored_dir;
};

// Called with iteration k's result (shares summed) before its optimizer step: what a stored
// reference keeps of each iteration (run/stored_reference.h).
using BeforeStep = std::function<Status(int64_t k, const ReferenceResult& result)>;

// Collective over MPI_COMM_WORLD. A reference that cannot run, on any rank, is a Status on
// every rank; so is a `before_step` that fails on any rank.
StatusOr<JobReference> ComputeJobReference(const Config& config, const RankCoordinates& coords,
                                           const BeforeStep& before_step = nullptr);

// One optimizer step of the reference on iteration k's full (summed) gradients, the
// reference's `parameter` tensors and their `gradient_of` tensors in `result`: the first step
// takes the parameters from it. Afterwards `result`'s parameters hold the updated values and
// its gradients the clipped ones, as the executor's records do. The gradients' error, which
// the trainer carries into its error bounds, is the largest tolerance of any gradient in the
// run's storage dtype.
void TrainReference(ReferenceResult& result, int64_t k, DType storage, ReferenceTrainer& trainer,
                    std::vector<ReferenceIteration>* iterations);

}  // namespace mpusim::run
