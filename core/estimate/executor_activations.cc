#include "core/estimate/executor_activations.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "core/estimate/estimable.h"
#include "core/model/activation_plan.h"
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
  const double e = static_cast<double>(DTypeSize(run.dtype));
  const double c = static_cast<double>(DTypeSize(ComputeDType(run.dtype)));
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
    // The optimizer's step, once every stash is gone: each update makes a new parameter
    // tensor; the distributed optimizer also gathers the main_grads of each buffer (the
    // dense one, then the experts') into a flat buffer (compute dtype, padded to its D
    // pieces), reduce-scatters it to this rank's piece, and after the update all-gathers
    // each buffer's updated pieces in the storage dtype.
    if (config.optimizer) {
      const HeldMemory& mine = held.at(static_cast<size_t>(r)).held;
      const double largest = static_cast<double>(mine.largest_parameter_elements) * e;
      double step_bytes = largest;
      if (config.optimizer->use_distributed_optimizer) {
        struct Buffer {
          double padded, piece, d;
        };
        std::vector<Buffer> buffers;
        for (const auto& [elements, shards] :
             {std::pair{mine.dense_elements, mine.dense_shards},
              std::pair{mine.expert_elements, mine.expert_shards}}) {
          if (elements == 0 && !buffers.empty()) continue;
          const double d = static_cast<double>(shards);
          const double padded = std::ceil(static_cast<double>(elements) / d) * d;
          buffers.push_back({padded, padded / d, d});
        }
        // Each piece (all of the buffer when d is 1) stays until the next step replaces it:
        // a buffer's flat gradients and new piece are made beside the new pieces of the
        // buffers before it and the last step's of it and those after it.
        const bool carries = run.train_iters > 1;
        double last = 0, pieces = 0;
        for (const Buffer& buffer : buffers) {
          last += carries ? buffer.piece * c : 0;
          pieces += buffer.piece;
        }
        double scatter = 0, done = 0, all_gathered = 0;
        for (const Buffer& buffer : buffers) {
          const double piece = buffer.d > 1 ? buffer.piece * c : 0;  // a new one
          scatter = std::max(scatter, done + last + buffer.padded * c + piece);
          done += buffer.piece * c;
          last -= carries ? buffer.piece * c : 0;
          all_gathered = std::max(all_gathered, buffer.d > 1 ? buffer.padded * e : 0);
        }
        const double carried = carries ? done : 0;
        const double gather = pieces * c + pieces * e + all_gathered + largest;
        step_bytes = std::max(scatter, gather);
        act.carried = ToBytes(carried);
      }
      act.optimizer_step = ToBytes(step_bytes);
    }
    out.push_back(act);
  }
  return out;
}

}  // namespace mpusim
