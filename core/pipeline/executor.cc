// The executor (see executor.h).
#include "core/pipeline/executor.h"

#include <fmt/format.h>

#include <stdexcept>

#include "core/pipeline/pipeline_walk.h"

namespace mpusim {

StatusOr<PipelineExecutor> PipelineExecutor::ForRank(const ParallelConfig& parallel,
                                                     int64_t num_microbatches, int64_t pp_rank) {
  if (parallel.pipeline_model_parallel_size <= 1) return PipelineExecutor(num_microbatches);
  StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(
      parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size,
      num_microbatches, parallel.microbatch_group_size_per_vp_stage);
  if (!schedule.ok()) return schedule.status();
  return PipelineExecutor(num_microbatches,
                          PlanPipelineRanks(*schedule).at(static_cast<size_t>(pp_rank)));
}

void PipelineExecutor::Begin() {
  if (!stashes_.empty()) {
    throw std::logic_error(fmt::format("PipelineExecutor: {} stashes of the last step were never "
                                       "consumed by a backward step",
                                       stashes_.size()));
  }
  peak_stashes_ = 0;
  spans_.clear();
  schedule_begin_ = MonotonicSeconds();
}

Tensor PipelineExecutor::Forward(RankContext& ctx, StagedModel& model, int64_t chunk,
                                 int64_t microbatch, const Tensor& input, bool record) {
  const SpanRecorder span(spans_, chunk, microbatch, true);
  const auto [it, inserted] = stashes_.try_emplace({chunk, microbatch});
  if (!inserted) {
    throw std::logic_error(fmt::format("PipelineExecutor: chunk {} micro-batch {} ran forward "
                                       "twice before its backward",
                                       chunk, microbatch));
  }
  it->second = model.NewStash(chunk);
  peak_stashes_ = std::max(peak_stashes_, live_stashes());
  return model.ForwardStep({ctx, chunk, microbatch, record, &spans_}, input, *it->second);
}

Tensor PipelineExecutor::Backward(RankContext& ctx, StagedModel& model, int64_t chunk,
                                  int64_t microbatch, const Tensor& output_grad, bool record) {
  const SpanRecorder span(spans_, chunk, microbatch, false);
  auto node = stashes_.extract({chunk, microbatch});
  if (node.empty()) {
    throw std::logic_error(fmt::format("PipelineExecutor: chunk {} micro-batch {} has no stash "
                                       "(no forward step, or a second backward)",
                                       chunk, microbatch));
  }
  return model.BackwardStep({ctx, chunk, microbatch, record, &spans_}, output_grad,
                            *node.mapped());
}

void PipelineExecutor::Run(RankContext& ctx, StagedModel& model, bool record) {
  Begin();
  const int64_t M = num_microbatches_;
  if (plans_.in_flight.empty()) {
    const int64_t C = model.num_model_chunks();
    for (int64_t m = 0; m < M; ++m) {
      const bool last = record && m + 1 == M;
      Tensor x;
      for (int64_t c = 0; c < C; ++c) x = Forward(ctx, model, c, m, x, last);
      Tensor dy;
      for (int64_t c = C; c-- > 0;) dy = Backward(ctx, model, c, m, dy, last);
    }
  } else {
    PipelineStepFunctions functions;
    functions.shape = [&](const Transfer& t) { return model.TransferShape(ctx, t); };
    functions.step = [&](const ScheduleStep& step, const Tensor& input) {
      const bool last = record && step.microbatch + 1 == M;
      return step.pass == Pass::kForward
                 ? Forward(ctx, model, step.model_chunk, step.microbatch, input, last)
                 : Backward(ctx, model, step.model_chunk, step.microbatch, input, last);
    };
    WalkPipelinePlan(plans_, ctx.pp(), *ctx.kernels, *ctx.trace, functions);
  }
  schedule_end_ = MonotonicSeconds();
}

}  // namespace mpusim
