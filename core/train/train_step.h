// One step of a model on this rank, and the training loop around it.
//
// What it is: RunStep is Megatron's forward_backward_func followed by finalize_model_grads:
// the model's BeginStep, the executor's walk of this rank's schedule row over the model's
// (chunk, micro-batch) steps, the gradient finalisation (FinalizeModelGrads), and the
// model's EndStep (the loss over the stages and the dp ranks). Train is its loop with the
// optimizer: per iteration a step, the optimizer's gradient reduction (the distributed
// optimizer's reduce-scatter), the global gradient norm, clipping and the update at the
// schedule's learning rate.
// What it is not: the timing of benchmark repetitions or the report (run/).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/model/model.h"
#include "core/config/optimizer_config.h"
#include "core/pipeline/executor.h"
#include "core/rank_context.h"
#include "core/train/optimizer.h"

namespace mpusim {

// finalize_model_grads after the last micro-batch: a replicated parameter marked
// sequence_parallel (each tp rank saw only its sequence shard) all-reduced over tp; every
// gradient over dp_cp when `reduce_dp` (false: the distributed optimizer reduce-scatters them
// itself); a word embedding tied across the first and the last stage (embedding_group) over
// embd. Groups of one rank send nothing. Traced as phase "other", site
// "finalize_model_grads".
void FinalizeModelGrads(const std::vector<Parameter*>& params, RankContext& ctx, bool reduce_dp);

// One step (see above) of training iteration `iteration`; `record`: the model keeps the last
// micro-batch's tensors for Model::Records.
void RunStep(Model& model, PipelineExecutor& executor, RankContext& ctx, int64_t iteration,
             bool record, bool reduce_dp);

// One iteration of Train.
struct TrainedIteration {
  int64_t iteration = 0;  // from 1
  double loss = 0;        // the loss of the iteration's data before its update
  double grad_norm = 0;   // before clipping
  double lr = 0;
  double seconds = 0;     // wall time, fence to fence
  double start = 0;       // when it started (steady_clock, seconds)
  std::vector<ExpertLoad> experts;  // this rank's MoE layers after the update (ExpertLoads)
};

// What Train calls before (done false) and after (done true) iteration `iteration` (from 1):
// the run driver's synchronisation of every rank, which is also a safe point; true stops the
// loop there (an interrupt every rank agreed on), so every rank must return the same.
using TrainFence = std::function<bool(int64_t iteration, bool done)>;

// `iterations` training iterations of `model` (its TrainableParameters are `optimizer`'s):
// each clears the trace, calls `fence`, runs a step (recording the last iteration's when
// `record`) and the optimizer's update, waits for the device, and calls `fence` again. Returns
// the iterations done, fewer than `iterations` when a fence stopped the loop.
// `observe` (when set) gets each iteration's row as soon as it is done, on every rank (the run
// driver prints rank 0's as the run goes).
std::vector<TrainedIteration> Train(
    Model& model, PipelineExecutor& executor, Optimizer& optimizer, RankContext& ctx,
    const OptimizerConfig& config, int64_t iterations, bool record, const TrainFence& fence,
    const std::function<void(const TrainedIteration&)>& observe = {});

}  // namespace mpusim
