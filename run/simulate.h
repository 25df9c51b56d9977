// One run of a model on this MPI rank (`mpusim run`'s job without its report): the rank's
// groups and backend context, the model (core/model/model.h BuildModel) stepped by the
// executor (core/pipeline) or trained (core/train), the timeline gathered from every rank,
// the records for the dump and the check against the float64 reference (run/check.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/communicator.h"
#include "core/config/config.h"
#include "core/model/model.h"
#include "core/rank_context.h"
#include "core/status.h"
#include "core/train/train_step.h"
#include "mpi/interrupt.h"
#include "run/check.h"

namespace mpusim::run {

struct SimulationResult {
  // Set when every rank stopped early at a safe point for a signal (mpi/interrupt.h): which
  // rank got which, and where they stopped ("after iteration 3 of 10"). Only `coords`,
  // `seconds` and `iterations` (those done) are filled in then.
  Interrupt interrupt;
  std::string interrupted_where;
  RankCoordinates coords;             // this rank's place in the layout
  // This rank's tensors (on the backend's device), kept only when asked for (a dump).
  std::vector<TensorRecord> records;
  CheckResult check;                  // empty without the check
  bool has_loss = false;
  double loss = 0;
  CommTrace trace;                    // this rank's collectives (the last repetition)
  std::vector<double> seconds;        // wall time of each repetition
  int64_t padded_vocab_size = 0;
  std::string model_description;   // Model::Describe
  std::string parameter_split;     // Model::ParameterSplitNote ("": no parameter-memory line)
  std::vector<std::string> parameter_names;  // the whole model's (Model::ShardingMap)
  int64_t parameter_bytes_rank = 0;   // this rank's trainable parameter shards
  int64_t parameter_bytes_model = 0;  // the whole model's parameters
  int64_t peak_stashes = 0;  // the most (chunk, micro-batch) stashes live at once
  // Every world rank's tensors, counted by its kernels (Kernels::tensor_bytes): those held
  // before the first step (parameters, main_grad, optimizer state) and the most alive at
  // once during the steps; peak - held is the activations and gradients in flight.
  // `held` measured apart (core/estimate/memory_estimate.h counts the first three from the
  // config): the parameters' and main_grads' tensors as InitializeParameters allocated them
  // (Model::HeldParameters), what the optimizer's construction added to the live bytes
  // (master weights and states), and the rest of what InitializeParameters added (the
  // model's constant tensors, such as the positions RoPE reads).
  struct TensorBytes {
    int64_t held = 0, peak = 0;
    int64_t parameters = 0, gradients = 0, optimizer = 0, other = 0;
  };
  std::vector<TensorBytes> tensor_bytes;
  // Every world rank's Model::StepNotes, in rank order (the MoE layers' tokens per expert).
  std::vector<std::string> step_notes;
  // A training run: one row per iteration (the loss of the iteration's data before its
  // update, the gradient norm before clipping, the learning rate, the wall time).
  struct Iteration {
    int64_t iteration = 0;  // from 1
    double loss = 0, grad_norm = 0, lr = 0, seconds = 0;
    // An MoE model: per MoE layer, in layer order, the kept choices per expert summed over
    // the iteration's micro-batches and the ranks of the layer's stage (tp x dp x cp: what
    // the expert bias's update sums), and the expert bias after the update (empty without
    // moe_router_enable_expert_bias).
    std::vector<ExpertLoad> experts;
  };
  std::vector<Iteration> iterations;
  // A training run: this rank's optimizer state, in elements per state tensor (master
  // weights, m, v): every parameter's for the plain optimizer, its shard [begin, end) of a
  // flat buffer of `buffer` elements for the distributed one.
  struct OptimizerShard {
    bool distributed = false;
    int64_t buffer = 0, begin = 0, end = 0;
    // The experts' flat buffer, sharded over expt_dp (expert parallelism; 0 0 0 otherwise).
    int64_t expert_buffer = 0, expert_begin = 0, expert_end = 0;
    int64_t elements = 0;    // owned, both buffers
    int64_t parameters = 0;  // this rank's parameter elements
    int state_tensors = 0;   // per element: master + m (+ v for adam)
    int64_t state_bytes = 0;  // per element, all of them, each in its dtype (PrecisionOf)
  };
  OptimizerShard optimizer;
  // When the last step (or iteration) started: this rank's steady_clock, in seconds, as it
  // left the barrier before the step.
  double step_start = 0;
  // On every rank: each world rank's forward and backward step spans of the last
  // step (or iteration), in seconds from the step's start (the earliest rank's step_start on
  // one machine; each rank's own across machines), the schedule's end on that rank (its last
  // send completed), and its pp rank.
  struct RankTimeline {
    int64_t pp_rank = 0;
    double schedule_end = 0;
    std::vector<StepSpan> steps;
    std::vector<CommRecord> comms;  // with timeline_comms: the last step's, times as above
  };
  std::vector<RankTimeline> timeline;
};

struct SimulateOptions {
  bool check = true;          // compare with the float64 reference
  int repeat = 1;             // run the step this many times (benchmarks)
  bool keep_records = false;  // return the records (for a dump)
  bool timeline_comms = false;  // gather every rank's timed collectives too (--trace)
  ReferenceSource reference = {};  // the check's reference: computed, or a stored one
  // A training run: each iteration's row as soon as it is done (core/train Train's observe).
  std::function<void(const TrainedIteration&)> on_iteration = {};
};

// Runs `config` on MPI_COMM_WORLD (collective: every rank calls it with the same config;
// the world size must equal parallel.world_size). Bad configs give a Status on every rank.
// Safe points (every rank asks AgreeOnInterrupt, mpi/interrupt.h): before and after every
// step (--repeat) or training iteration; an interrupt there ends it early on every rank, with
// `interrupt` set, before the reference check and the records.
StatusOr<SimulationResult> Simulate(const Config& config, const SimulateOptions& options,
                                    Backend& backend);

// The context a rank runs a model in: its coordinates, the backend's kernels, its groups
// (each traced into `trace`) and its random streams. Collective: every rank of the world
// calls it (making the groups communicates).
RankContext MakeRankContext(const Config& config, Backend& backend, const Topology& topology,
                            int world_rank, CommTrace* trace);

}  // namespace mpusim::run
