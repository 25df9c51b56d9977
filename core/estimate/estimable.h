// What the activation counts and the step-time model cover (core/estimate/activation_estimate.h,
// executor_activations.h, time_estimate.h): a GPT model with a run section (mixture-of-experts
// layers included). One check, so that all refuse alike; and the one place in core/estimate
// that takes the GptConfig out of a Config (EstimatedModel), since what the estimate counts is
// that model's shapes. What any model answers (experts, fp8, cp_comm_type) is read with
// FactsOf (core/config/model_facts.h) instead.
#pragma once

#include <fmt/format.h>

#include <optional>
#include <string_view>

#include "core/config/config.h"
#include "core/schedule.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {

// The GPT model the estimate counts, or nullptr when `config` holds a layer chain (which has
// none of the shapes the estimate counts).
inline const GptConfig* EstimatedModel(const Config& config) {
  return config.gpt ? &*config.gpt : nullptr;
}
inline GptConfig* EstimatedModel(Config* config) {
  return config->gpt ? &*config->gpt : nullptr;
}

// The model to count, when `config` is estimable. `what` names the estimate in the error ("the
// step-time estimate"); the error names the field it cannot handle.
inline StatusOr<const GptConfig*> EstimableModel(const Config& config, std::string_view what) {
  const GptConfig* model = EstimatedModel(config);
  if (model == nullptr) {
    return Status::Error("model", fmt::format("{} needs a GPT model (\"type\": \"gpt\"); a lab "
                                              "chain has none",
                                              what));
  }
  if (!config.run) return Status::Error("run", fmt::format("{} needs a run section", what));
  if (config.optimizer && config.optimizer->use_torch_fsdp2) {
    return Status::Error("optimizer.use_torch_fsdp2",
                         fmt::format("{} does not model FSDP2 yet (each module's parameter "
                                     "all-gathers and gradient reduce-scatters, and the gathered "
                                     "module it holds at a time); the memory held counts its "
                                     "shards",
                                     what));
  }
  return model;
}
// EstimableModel's check alone.
inline Status CheckEstimable(const Config& config, std::string_view what) {
  return EstimableModel(config, what).status();
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
