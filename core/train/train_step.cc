// One step and the training loop (see train_step.h).
#include "core/train/train_step.h"

#include <chrono>
#include <stdexcept>

namespace mpusim {

void FinalizeModelGrads(const std::vector<Parameter*>& params, RankContext& ctx, bool reduce_dp) {
  CommTrace& trace = *ctx.trace;
  trace.SetPhase(Phase::kOther);
  trace.SetSite("finalize_model_grads");
  Communicator& tp = ctx.tp();
  Communicator* dp = reduce_dp ? &ctx.dp_cp() : nullptr;
  Communicator* expt_dp = reduce_dp ? ctx.groups.expt_dp.get() : nullptr;
  for (Parameter* p : params) {
    if (p->allreduce_grad_over_tp && tp.Size() > 1) tp.AllReduce(p->grad, ReduceOp::kSum);
    Communicator* group = p->expert ? expt_dp : dp;
    if (p->expert && reduce_dp && group == nullptr) {
      throw std::logic_error("FinalizeModelGrads: an expert parameter but no expt_dp group");
    }
    if (group != nullptr && group->Size() > 1) group->AllReduce(p->grad, ReduceOp::kSum);
  }
  Communicator* embd = ctx.embd();
  for (Parameter* p : params) {
    if (p->embedding_group && embd != nullptr && embd->Size() > 1) {
      embd->AllReduce(p->grad, ReduceOp::kSum);
    }
  }
}

void RunStep(Model& model, PipelineExecutor& executor, RankContext& ctx, int64_t iteration,
             bool record, bool reduce_dp) {
  model.BeginStep(ctx, iteration, record);
  executor.Run(ctx, model, record);
  // Under FSDP2 the data-parallel reduction is done (each module's reduce-scatter), and the
  // rest finalises the sharded gradients.
  if (const FullyShard* fsdp = model.fully_shard()) {
    FinalizeModelGrads(fsdp->Shards(), ctx, /*reduce_dp=*/false);
  } else {
    FinalizeModelGrads(model.TrainableParameters(), ctx, reduce_dp);
  }
  model.EndStep(ctx);
}

std::vector<TrainedIteration> Train(Model& model, PipelineExecutor& executor, Optimizer& optimizer,
                                    RankContext& ctx, const OptimizerConfig& config,
                                    int64_t iterations, bool record, const TrainFence& fence,
                                    const std::function<void(const TrainedIteration&)>& observe) {
  Kernels& k = *ctx.kernels;
  CommTrace& trace = *ctx.trace;
  Communicator* pp = ctx.pp().Size() > 1 ? &ctx.pp() : nullptr;
  std::vector<TrainedIteration> rows;
  for (int64_t it = 0; it < iterations; ++it) {
    trace.Clear();
    if (fence(it + 1, false)) break;
    const auto start = std::chrono::steady_clock::now();
    optimizer.ZeroGrad();
    RunStep(model, executor, ctx, it, record && it + 1 == iterations, !optimizer.distributed());
    const double loss = model.has_loss() ? model.loss() : 0.0;
    optimizer.ReduceGradients(k, trace);
    const double norm =
        optimizer.GradNorm(k, ctx.tp(), pp, ctx.groups.tp_ep.get(), ctx.coords.tp, trace);
    const double lr = LearningRate(config, it, iterations);
    optimizer.Step(k, norm, lr, trace);
    model.AfterOptimizerStep(ctx);
    k.Synchronize();
    const bool stop = fence(it + 1, true);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    rows.push_back({it + 1, loss, norm, lr, seconds,
                    std::chrono::duration<double>(start.time_since_epoch()).count(),
                    model.ExpertLoads()});
    if (observe) observe(rows.back());
    if (stop) break;
  }
  return rows;
}

}  // namespace mpusim
