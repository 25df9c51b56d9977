// A stored float64 reference: computed once (`mpusim reference CONFIG --out DIR`), read back by
// any run of the same model and data (`mpusim run CONFIG --reference DIR`, the sweep) instead
// of computed again.
//
// What it is: a folder of
//   reference.json          the identity (what the values depend on: the model, optimizer and
//                           data sections, the iterations, the reference's LayoutIdentity), the
//                           units and how the stored slices cover them, and each tensor's
//                           name, full shape, slicing, role and the earlier tensor it aliases;
//                           written last, so a folder without it is not a reference
//   initial.safetensors     the master parameters the reference started from
//   iteration<k>.safetensors  iteration k's summed shares (gradients before clipping, loss)
//   slice<j>.safetensors    slice j of the last iteration's row and sample tensors
// A run reads reference.json, refuses a reference whose identity differs from its own in one
// line naming the first difference, and builds exactly the JobReference that
// ComputeJobReference would: the tensors of its own slice from the slice files that overlap
// it (one file at a time, never the whole reference), the whole tensors, and after training
// the trainer replayed over the stored gradients (float64, so bit for bit the same
// parameters, state, error bounds and iteration rows). Tolerances are the run's own: its
// reference on an empty slice gives every tensor's error budget for its layout without
// computing a value. So the check's verdict and numbers are those of the inline check.
// Every file is untrusted: sizes, shapes and names are checked before use, and a bad file is
// a Status naming it.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/status.h"
#include "core/topology.h"
#include "run/job_reference.h"

namespace mpusim::run {

// The identity of `config`'s reference: `effective_config` (EffectiveConfigJson) gives the
// model and optimizer sections, the config the run's seed, sequence, micro-batches and
// iterations, and the reference its LayoutIdentity.
StatusOr<nlohmann::json> ReferenceIdentity(const nlohmann::json& effective_config,
                                           const Config& config);

// Collective over MPI_COMM_WORLD: computes the job's reference (ComputeJobReference) and
// writes it to `dir` (made if missing; must hold no stored reference or other files yet).
// Returns the bytes written (summed over the ranks).
StatusOr<int64_t> StoreJobReference(const Config& config, const RankCoordinates& coords,
                                    const nlohmann::json& identity, const std::string& dir);

// This rank's JobReference read from the stored reference in `dir`, or a Status naming the
// first difference of identity or what is wrong with a file. Not collective.
StatusOr<JobReference> LoadJobReference(const Config& config, const RankCoordinates& coords,
                                        const nlohmann::json& identity, const std::string& dir);

}  // namespace mpusim::run
