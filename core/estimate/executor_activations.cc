#include "core/estimate/executor_activations.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "core/estimate/estimable.h"
#include "core/model/activation_plan.h"
#include "core/model/optimizer_plan.h"
#include "core/schedule.h"
#include "core/tensor.h"

namespace mpusim {
namespace {

PlanBytes ToBytes(double bytes) { return static_cast<PlanBytes>(std::llround(bytes)); }

}  // namespace

StatusOr<StashPlan> ExecutorStash(const Config& config, const Topology& topology, int64_t u) {
  if (Status s = CheckEstimable(config, "the executor's activation count"); !s.ok()) return s;
  const int64_t stages = topology.sizes().pp * topology.sizes().vp.value_or(1);
  if (u < 0 || u >= stages) {
    return Status::Error(
        "parallel", fmt::format("no virtual pipeline stage {} (the layout has {})", u, stages));
  }
  return DeclaredChunkStash(config, topology,
                            DeclareStashes(config, topology, MoeRouting::kBalanced), u);
}

StatusOr<std::vector<ExecutorActivations>> EstimateExecutorActivations(
    const Config& config, const Topology& topology, const std::vector<StageHeldMemory>& held) {
  if (Status s = CheckEstimable(config, "the executor's activation count"); !s.ok()) return s;
  const RunConfig& run = *config.run;
  std::optional<PipelineSchedule> built;
  StatusOr<const PipelineSchedule*> found = RunSchedule(topology, run, nullptr, &built);
  if (!found.ok()) return found.status();
  // The schedule's peak: the declared stashes in flight, the backward's working set and the
  // pipeline's transfers (core/model/activation_plan.h), MoE rows those of balanced routing.
  StatusOr<std::vector<ScheduleActivations>> planned =
      PlanScheduleActivations(config, topology, MoeRouting::kBalanced, *found);
  if (!planned.ok()) return planned.status();
  std::vector<ExecutorActivations> out;
  for (const ScheduleActivations& stage : *planned) {
    const int64_t r = stage.stage;
    ExecutorActivations act;
    act.stage = r;
    act.peak_stashes = stage.peak_stashes;
    act.stashes = ToBytes(stage.stashes);
    act.working = ToBytes(stage.working);
    act.transfers = ToBytes(stage.transfers);
    if (config.optimizer) {
      const HeldMemory& mine = held.at(static_cast<size_t>(r)).held;
      const OptimizerStepBytes step = PlanOptimizerStep(
          *config.optimizer, run.dtype, PrecisionOf(config), run.train_iters,
          {mine.dense_elements, mine.expert_elements, mine.largest_parameter_elements,
           mine.dense_shards, mine.expert_shards});
      act.carried = ToBytes(step.carried);
      act.optimizer_step = ToBytes(step.step);
    }
    out.push_back(act);
  }
  return out;
}

}  // namespace mpusim
