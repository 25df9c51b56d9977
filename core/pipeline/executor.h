// The executor: one step of a model on this rank, every micro-batch forward and backward in
// the order this rank's row of the schedule gives (core/schedule.h).
//
// What it is: the owner of the (chunk, micro-batch) stashes (created for a forward step,
// handed to its backward step, freed after it; a second forward of a live pair, a backward
// without one, or a step that starts while one is live is an executor bug and throws), the
// walk of the schedule (pp > 1: WalkPipelinePlan, the chunks' boundary tensors sent and
// received on the pp group; pp = 1: each micro-batch forward through the rank's chunks in
// order, then backward through them in reverse), and the timeline of every step (StepSpan).
// The model is a StagedModel: the forward and backward of one (chunk, micro-batch) over a
// stash of its own type, and the shape of a boundary tensor.
// What it is not: the model's math, the gradient finalisation or the optimizer (core/train
// runs a step: RunStep).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "core/config/parallel_config.h"
#include "core/pipeline/pipeline_plan.h"
#include "core/pipeline/step_span.h"
#include "core/rank_context.h"
#include "core/status.h"

namespace mpusim {

// What a model keeps of one (chunk, micro-batch) between its forward and its backward step.
struct StepStash {
  virtual ~StepStash() = default;
};

// One forward or backward step the executor asks of a model.
struct StepCall {
  RankContext& ctx;
  int64_t chunk = 0;
  int64_t microbatch = 0;
  bool record = false;  // the step's tensors go to the records (the last micro-batch)
  std::vector<StepSpan>* spans = nullptr;  // a recomputation in the step appends its span here
};

// The executor's view of a model (core/model/model.h's Model is one).
class StagedModel {
 public:
  virtual ~StagedModel() = default;
  // The model chunks this rank holds (Megatron's virtual pipeline stages on it).
  virtual int64_t num_model_chunks() const = 0;
  // The local shape and dtype of the tensor a pipeline transfer carries.
  virtual std::pair<Shape, DType> TransferShape(const RankContext& ctx,
                                                const Transfer& transfer) const = 0;
  // An empty stash for a forward step of `chunk`.
  virtual std::unique_ptr<StepStash> NewStash(int64_t chunk) const = 0;
  // The forward of (call.chunk, call.microbatch): `input` is the previous chunk's output
  // (undefined for the model's first chunk); returns this chunk's output, or an undefined
  // tensor when nothing follows (the loss). Keeps in `stash` what the backward needs.
  virtual Tensor ForwardStep(const StepCall& call, const Tensor& input, StepStash& stash) = 0;
  // The backward: `output_grad` is the gradient of the forward's output (undefined for the
  // model's last chunk); returns the gradient of its input (undefined for the first chunk).
  virtual Tensor BackwardStep(const StepCall& call, const Tensor& output_grad,
                              StepStash& stash) = 0;
};

class PipelineExecutor {
 public:
  // A step of `num_microbatches` micro-batches; `plans`: this rank's pipeline plans
  // (core/pipeline/pipeline_plan.h) for that many, empty when pp = 1.
  explicit PipelineExecutor(int64_t num_microbatches, RankPipelinePlans plans = {})
      : num_microbatches_(num_microbatches), plans_(std::move(plans)) {}
  // The executor of the rank at pipeline rank `pp_rank` of `parallel`'s layout, for steps of
  // `num_microbatches` (the schedule's errors name the field).
  static StatusOr<PipelineExecutor> ForRank(const ParallelConfig& parallel,
                                            int64_t num_microbatches, int64_t pp_rank);

  // Every micro-batch of one step, forward and backward, in this rank's schedule order;
  // `record`: the last micro-batch's steps record their tensors.
  void Run(RankContext& ctx, StagedModel& model, bool record);

  // The pieces Run uses (tests call them to step by hand). Begin starts a step: it throws
  // when a stash of the last one is still live, and clears the timeline.
  void Begin();
  Tensor Forward(RankContext& ctx, StagedModel& model, int64_t chunk, int64_t microbatch,
                 const Tensor& input, bool record);
  Tensor Backward(RankContext& ctx, StagedModel& model, int64_t chunk, int64_t microbatch,
                  const Tensor& output_grad, bool record);

  int64_t live_stashes() const { return static_cast<int64_t>(stashes_.size()); }
  // The most stashes live at once since Begin: the activation memory the schedule's
  // in-flight count bounds (1 without a pipeline and with one chunk).
  int64_t peak_live_stashes() const { return peak_stashes_; }
  // Since Begin: every forward and backward step (and recomputation) in the order they ran,
  // and when the schedule began and ended (its last send completed).
  const std::vector<StepSpan>& step_spans() const { return spans_; }
  double schedule_begin() const { return schedule_begin_; }
  double schedule_end() const { return schedule_end_; }

 private:
  int64_t num_microbatches_ = 1;
  RankPipelinePlans plans_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<StepStash>> stashes_;
  int64_t peak_stashes_ = 0;
  std::vector<StepSpan> spans_;
  double schedule_begin_ = 0, schedule_end_ = 0;
};

}  // namespace mpusim
