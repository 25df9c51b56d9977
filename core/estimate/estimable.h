// What the activation counts and the step-time model cover (core/estimate/activation_estimate.h,
// executor_activations.h, time_estimate.h): a GPT model with a run section (mixture-of-experts
// layers included). One check, so that all refuse alike.
#pragma once

#include <fmt/format.h>

#include <optional>
#include <string_view>

#include "core/config/config.h"
#include "core/schedule.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {

// `what` names the estimate in the error ("the step-time estimate"); the error names the
// field it cannot handle.
inline Status CheckEstimable(const Config& config, std::string_view what) {
  if (!config.gpt) {
    return Status::Error("model", fmt::format("{} needs a GPT model (\"type\": \"gpt\"); a lab "
                                              "chain has none",
                                              what));
  }
  if (!config.run) return Status::Error("run", fmt::format("{} needs a run section", what));
  return {};
}

// The run's pipeline schedule: `given` when the caller has it already (advise shares one among
// the candidates of the same pp, vp and micro-batch count), else built into `*built`.
inline StatusOr<const PipelineSchedule*> RunSchedule(const Topology& topology,
                                                     const RunConfig& run,
                                                     const PipelineSchedule* given,
                                                     std::optional<PipelineSchedule>* built) {
  if (given != nullptr) return given;
  StatusOr<PipelineSchedule> schedule =
      BuildPipelineSchedule(topology.sizes().pp, topology.sizes().vp, run.num_microbatches,
                            topology.config().microbatch_group_size_per_vp_stage,
                            topology.config().overlap_moe_expert_parallel_comm);
  if (!schedule.ok()) return schedule.status();
  *built = *std::move(schedule);
  return &**built;
}

}  // namespace mpusim
