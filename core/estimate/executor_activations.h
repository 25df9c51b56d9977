// The activations mpusim's own executor holds at its schedule's peak, per stage, counted from
// the config: what `mpusim run --summary` measures on each rank as peak - held (the tensors
// alive at once during the step, less the parameters, main_grad and optimizer state held
// before it). The test (tests/model/estimate_mpi_test.cc) requires this count equal to the
// measurement on every GPT sample config and a sweep of layouts (within 5% where MoE routing
// decides it).
//
// The stashes, working set and transfers are core/model/activation_plan.h's count (shared with
// the run's memory preflight, which routes MoE tokens at their worst instead of balanced);
// the optimizer's buffers are core/model/optimizer_plan.h's, which the preflight reads too.
//
// It differs from activation_estimate.h's count of a GPU run of Megatron in what is kept,
// not in how the schedule keeps it:
//   - the stash of a (chunk, micro-batch) is the one its modules declare next to their Stash
//     structs (core/model/stash_plan.h; GptModel::PlanStash of the chunk, with each layer's
//     TransformerLayer::PlanStash): per layer the norms' statistics, the normalised inputs of
//     linear_qkv and linear_fc1, the fused qkv output and its per-head copies, the
//     probabilities, the context, the residual x1, fc1's output and the activation's, and
//     every layer's input; no dropout masks (the executor redraws them from their global
//     indices, core/dropout.h). A post-process chunk adds the final norm's input and output,
//     the logits and the cross entropy's row statistics; a pre-process chunk the embedding's
//     output before dropout; both the micro-batch's tokens, labels and positions.
//     tests/model/stash_plan_mpi_test.cc holds that declaration to what a real forward keeps.
//   - Full recomputation keeps each layer's input; selective drops the core attention's
//     tensors (q, k, v copies, probabilities).
//   - Working memory: the backward step of a chunk holds, besides the stashes alive, the
//     gradients of its first layer in flight: at the largest of the points where they peak
//     (the attention's fused qkv gradient while the probabilities' gradients are alive, the
//     ring's blocks, fc1's weight gradient, the output layer's), with that layer's recomputed
//     tensors under recomputation.
//   - Transfers: the pipeline plan (core/pipeline/pipeline_plan.h) replayed as the MPI walk
//     runs it: a received tensor until its step takes it, a sent one until the walk ends.
//   - Carried: from the second training iteration, the distributed optimizer's gradient
//     piece of the last step.
//   - The optimizer step, after the schedule, when it holds more: the flat gradient buffer
//     and its piece, the updated piece and the gathered parameters, one new parameter.
//   - A mixture-of-experts layer keeps, in place of the MLP's tensors, what MoeLayer::PlanStash
//     declares (core/model/moe.h: the router's scores, log-sum-exp and chosen probabilities,
//     the permutation's int64 ids, the experts' rows of x, their probabilities, fc1 output and
//     activation, the shared expert's fc1 output and activation), with the rows of balanced
//     routing below; its backward holds the gathered gradient,
//     the scatter targets of dx and d probs, each expert's gradients, then the way back, the
//     router's gradients and the shared expert's. The experts' rows depend on the routing:
//     the count assumes it balanced (each expert T k / E of each source rank's T tokens, at
//     most its capacity), exact where no rank can get an uneven share (ep 1 without a
//     capacity factor), within 5% of the tested ep > 1 and capacity layouts.
// What it leaves out: the tensors the check records (run without --no-check), and the
// forward's own temporaries (never the peak in the tested layouts).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/config/config.h"
#include "core/estimate/memory_estimate.h"
#include "core/memory_plan.h"
#include "core/model/stash_plan.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {

struct ExecutorActivations {
  int64_t stage = 0;
  int64_t peak_stashes = 0;  // (chunk, micro-batch) stashes alive at the peak
  PlanBytes stashes = 0;     // their bytes
  PlanBytes working = 0;     // the backward step's own tensors at that moment
  PlanBytes transfers = 0;   // the pipeline's received and sent tensors alive then
  PlanBytes optimizer_step = 0;  // the optimizer step's own tensors, after the schedule
  // From the second training iteration on: the distributed optimizer's gradient piece,
  // kept from the last step until the next reduce-scatter replaces it.
  PlanBytes carried = 0;
  PlanBytes schedule_peak() const { return stashes + working + transfers + carried; }
  PlanBytes peak() const { return std::max(schedule_peak(), optimizer_step); }
};

// One entry per pipeline stage (the same for every rank of the stage); `held`: the stages'
// held memory (EstimateStageHeldMemory), which sizes the optimizer step. Errors name the
// field the count cannot handle.
StatusOr<std::vector<ExecutorActivations>> EstimateExecutorActivations(
    const Config& config, const Topology& topology, const std::vector<StageHeldMemory>& held);

// The declared stash (core/model/stash_plan.h) of one (chunk, micro-batch) of virtual pipeline
// stage `u` (model chunk u / pp of pipeline rank u % pp) that the count sums: an MoE layer's
// rows those of balanced routing. An error for a stage the layout does not have.
StatusOr<StashPlan> ExecutorStash(const Config& config, const Topology& topology, int64_t u);

}  // namespace mpusim
