// The optimizer's own tensors on a rank, counted from the config: its state (each trainable
// element's master weight and moments, or SGD's, in the compute dtype) and what its step
// allocates (the distributed optimizer's flat gradient buffers, pieces and gathers; each
// update's new parameter), read by the run's memory preflight (GptModel::PlanMemory) and
// `mpusim estimate`'s executor count (core/estimate/executor_activations.h), so the two
// cannot drift. What it is not: the parameters or their main_grad (counted beside it).
#pragma once

#include <cstdint>
#include <vector>

#include "core/config/optimizer_config.h"
#include "core/memory_plan.h"
#include "core/tensor.h"

namespace mpusim {

// What sizes them on one rank: the trainable elements of the dense buffer and of the
// experts' (mixture of experts), the largest parameter shard, and the pieces the distributed
// optimizer cuts each buffer into (over dp x cp, and over expt_dp).
struct OptimizerShards {
  PlanBytes dense_elements = 0;
  PlanBytes expert_elements = 0;
  PlanBytes largest_parameter_elements = 0;
  int64_t dense_shards = 1;
  int64_t expert_shards = 1;
};

struct OptimizerStepBytes {
  // The step's own tensors, after the schedule, at their most.
  double step = 0;
  // From the second training iteration on: the distributed optimizer's gradient piece, kept
  // from the last step until the next reduce-scatter replaces it (alive during the schedule).
  double carried = 0;
};

// `storage`: the run's dtype; `precision`: its gradient buffer's and optimizer's dtypes;
// `train_iters`: the run's iterations.
OptimizerStepBytes PlanOptimizerStep(const OptimizerConfig& optimizer, DType storage,
                                     const OptimizerPrecision& precision, int64_t train_iters,
                                     const OptimizerShards& shards);

// Bytes of optimizer state per owned element: the master weight (MasterBytes: 2 for a
// remainder) and Adam's two moments (or SGD's momentum), each in its dtype
// (OptimizerPrecision).
int64_t OptimizerStateBytes(const OptimizerConfig& optimizer, const OptimizerPrecision& precision);

// How many of a parameter's optimizer tensors (master weight, moments) are float16: the
// precision-aware optimizer stores each scaled, with a float32 scale of its own per
// parameter (kStateScaleBytes, core/optimizer_update.h ScaledFloat16), and its step reads
// each into a float32 tensor of the owned elements, alive while the update runs.
int64_t ScaledStates(const OptimizerConfig& optimizer, const OptimizerPrecision& precision);
inline constexpr int64_t kStateScaleBytes = 4;

// The parameters of which rank `rank` of a shard group of `shards` owns at least one element
// (core/train/optimizer.h: the parameters laid end to end in reverse order of registration,
// the buffer cut in `shards` equal pieces): `elements`, each parameter's, in registration
// order. One shard: every parameter with an element.
int64_t OwnedParameters(const std::vector<PlanBytes>& elements, int64_t shards, int64_t rank);

}  // namespace mpusim
