// The check of a GPT run (`mpusim run` with "model": {"type": "gpt"}) against the float64
// GPT reference (reference/gpt_reference.h).
//
// What it is: attention mixes the positions of a sample, so the reference splits by samples,
// not token rows: every rank runs the reference on the samples its data-parallel rank holds
// ([dp * b, (dp + 1) * b) of each micro-batch), which covers every element of its own
// activation shards, whatever the tensor or sequence split. Gradients and the loss are the
// sums of the dp slices' shares (an MPI_Allreduce over the ranks of one tp coordinate).
// Every element of every record is compared on the rank that holds it, under the tolerance
// ToleranceFor(GptErrorBudget) gives (core/dump/compare.h), and the statistics are reduced over
// all ranks in a few packed collectives.
// What it is not: cheap at scale. The t ranks of a tensor-parallel group compute the same
// reference slice, and every rank holds the whole model's float64 parameters and gradients;
// it is meant for the models a laptop runs.
#pragma once

#include <vector>

#include "core/dump/compare.h"
#include "core/config/config.h"
#include "core/model/record.h"
#include "core/topology.h"
#include "run/check.h"

namespace mpusim::run {

// The error budget every tensor of a GPT run is charged (core/dump/compare.h): the stored values
// and sums on the longest path through the model, forward and backward (a conservative
// bound for the tensors nearer the input or the loss).
ErrorBudget GptErrorBudget(const GptConfig& gpt, const RunConfig& run, int64_t t, int64_t d,
                           int64_t padded_vocab);

// Collective over MPI_COMM_WORLD: every rank passes its own records of one run. `gpt` is the
// model as the executor resolved it (CheckGptLayout). A training run (config.optimizer) is
// checked as the reference trains (reference/trainer.h): each iteration's reference runs
// on the parameters the previous steps made, and the records (the last iteration's tensors,
// its clipped gradients and the final parameters) are compared with the last iteration's.
StatusOr<CheckResult> CheckGptAgainstReference(const Config& config, const GptConfig& gpt,
                                               const Topology& topology,
                                               const RankCoordinates& coords,
                                               const std::vector<TensorRecord>& records,
                                               const HostFetch& fetch);

}  // namespace mpusim::run
