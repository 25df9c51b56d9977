// The activations a rank of the GPT's executor holds over its pipeline schedule, counted from
// the modules' declared stashes (stash_plan.h): one count read by both `mpusim run`'s memory
// preflight (GptModel::PlanMemory) and `mpusim estimate`'s executor count
// (core/estimate/executor_activations.h, which adds the optimizer's buffers), so neither keeps
// a mirror of the stashes that could drift from the other.
//
// Per pipeline rank, walking its schedule (core/schedule.h) as the executor does:
//   - stashes: the declared stash of every (chunk, micro-batch) forwarded and not yet
//     backwarded (GptModel::PlanStash of the chunk, TransformerLayer::PlanStash per layer);
//   - working: the backward step's own tensors, at the largest of the points where the
//     gradients of a layer peak (see activation_plan.cc), walking the chunk's layers in the
//     backward's order: what recomputation rebuilt and still holds (full: the layer's group;
//     selective: the recompute_modules' tensors), less what the layers already backwarded
//     freed; or the head's backward;
//   - transfers: the pipeline plan (core/pipeline/pipeline_plan.h) replayed as the MPI walk
//     runs it: a received tensor until its step takes it, a sent one until the walk ends.
// The peak is the largest stashes + working + transfers at the start of a backward step.
//
// A mixture-of-experts layer's rows depend on where the router sends the tokens; the caller
// picks the routing the count assumes (MoeRouting): the estimate its expectation, the
// preflight, a guard that must not under-count, the most the declaration can take.
//
// What it is not: the optimizer's buffers (the estimate adds them), the parameters, nor the
// tensors the check records.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config/config.h"
#include "core/model/module.h"
#include "core/model/stash_plan.h"
#include "core/schedule.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {

// How a count routes an MoE layer's tokens (T: the router's tokens on each source rank, the
// rows of its stream; E experts, top-K, L = E / ep of them on this rank; a capacity
// C = ceil(T K / E factor) per (source rank, expert) when a factor is set and C < T).
enum class MoeRouting {
  // Every (source rank, expert) pair gets T K / E of the choices (at most C): the
  // expectation. Exact where no rank can get an uneven share (ep 1 without a capacity).
  kBalanced,
  // Every source rank sends this rank the most it can: each token's choices on this rank's
  // experts, min(K, L) copies (a token chooses distinct experts), at most L C rows; and a
  // rank's sent rows are all its T K choices (at most E C). An upper bound of any routing.
  kWorst,
};

// The rows an MoE layer's dispatcher gives this rank under a routing.
struct MoeRoute {
  double group = 1;    // the allgather dispatcher's group
  double gather = 1;   // the alltoall dispatcher's gather after the exchange
  double local = 0;    // the rows one source rank routes to this rank's experts
  double sent = 0;     // alltoall: this rank's rows, in send order
  double arrived = 0;  // alltoall: its experts' rows after the exchange
  double rows = 0;     // the experts' rows (N)
  double src = 0;      // the rows of the gradient they gather from and scatter into
};

// `T`: the router's tokens, this rank's rows of the stream; `sp`: sequence parallelism on.
MoeRoute RouteMoe(const GptConfig& gpt, const DerivedSizes& sizes, bool sp, double T,
                  MoeRouting routing);

// What a count reads of the modules' declared stashes for one layout.
struct DeclaredStashes {
  StreamShape shape;
  MoeRoute route;                    // MoE only
  StashPlan moe;                     // an MoE layer's MoeLayer stash under the routing
  StashPlan dense_layer, moe_layer;  // a layer's stash as the schedule keeps it
};

// `config` needs its gpt and run sections.
DeclaredStashes DeclareStashes(const Config& config, const Topology& topology,
                               MoeRouting routing);

// The declared stash of one (chunk, micro-batch) of virtual pipeline stage `u` (model chunk
// u / pp of pipeline rank u % pp): every layer's input (the chunk's own included) and stash.
StashPlan DeclaredChunkStash(const Config& config, const Topology& topology,
                             const DeclaredStashes& declared, int64_t u);

// One pipeline rank's activations at its schedule's peak (bytes; doubles, as the balanced
// routing's rows may be fractional).
struct ScheduleActivations {
  int64_t stage = 0;
  int64_t peak_stashes = 0;  // (chunk, micro-batch) stashes alive at the peak
  double stashes = 0;        // their bytes
  double working = 0;        // the backward step's own tensors at that moment
  double transfers = 0;      // the pipeline's received and sent tensors alive then
  double peak() const { return stashes + working + transfers; }
};

// One entry per pipeline stage (the same for every rank of the stage). `schedule`: the run's
// (BuildPipelineSchedule of the layout and run), or null to build it here. Errors: the
// schedule's, naming the field.
StatusOr<std::vector<ScheduleActivations>> PlanScheduleActivations(
    const Config& config, const Topology& topology, MoeRouting routing,
    const PipelineSchedule* schedule = nullptr);

}  // namespace mpusim
