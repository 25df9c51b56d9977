// Where each forward step's dropout draws fall on its pipeline rank's RNG tracker, for the
// float64 references of both models (gpt_reference.cc, reference_model.cc).
//
// Each pipeline rank draws from its own tracker (core/dropout.h) with two streams (0:
// "default", 1: "model-parallel-rng"), advanced by its forward steps in the order it runs
// them: the schedule's forward table (the micro-batches in order without pipeline stages),
// every training iteration continuing where the last one ended. A forward of model chunk c
// on pp rank r makes draws[r][c][stream] draws per stream, always the same number.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "core/config/parallel_config.h"
#include "core/status.h"

namespace mpusim {

struct DrawPositions {
  // first[r][{chunk, m}][stream]: the draws pp rank r made on the stream in one iteration
  // before its forward of (chunk, micro-batch m); per_iteration[r][stream]: all of one
  // iteration's.
  std::vector<std::map<std::pair<int64_t, int64_t>, std::array<int64_t, 2>>> first;
  std::vector<std::array<int64_t, 2>> per_iteration;

  // The tracker position of draw k of that forward in training iteration `iteration`.
  int64_t Position(int64_t iteration, int64_t pp_rank, int64_t chunk, int64_t microbatch,
                   size_t stream, int64_t k) const {
    const auto r = static_cast<size_t>(pp_rank);
    return iteration * per_iteration[r][stream] + first[r].at({chunk, microbatch})[stream] + k;
  }
};

// draws[r][c]: per stream, the draws of one forward of chunk c on pp rank r. Fails as the
// schedule does (BuildPipelineSchedule) for a pipeline it cannot build.
StatusOr<DrawPositions> NumberTrackerDraws(
    const ParallelConfig& parallel, int64_t num_microbatches,
    const std::vector<std::vector<std::array<int64_t, 2>>>& draws);

}  // namespace mpusim
