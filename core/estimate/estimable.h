// What the activation counts and the step-time model cover (core/estimate/activation_estimate.h,
// executor_activations.h, time_estimate.h): a GPT model with a run section; mixture-of-experts
// layers only in the executor's count, which the others do not model yet. One check, so that
// all refuse alike.
#pragma once

#include <fmt/format.h>

#include <string_view>

#include "core/config/config.h"
#include "core/status.h"

namespace mpusim {

// `what` names the estimate in the error ("the step-time estimate"); the error names the
// field it cannot handle. `counts_moe`: the estimate handles mixture-of-experts layers (the
// executor's activation count does).
inline Status CheckEstimable(const Config& config, std::string_view what,
                             bool counts_moe = false) {
  if (!config.gpt) {
    return Status::Error("model", fmt::format("{} needs a GPT model (\"type\": \"gpt\"); a lab "
                                              "chain has none",
                                              what));
  }
  if (!config.run) return Status::Error("run", fmt::format("{} needs a run section", what));
  if (config.gpt->moe.enabled() && !counts_moe) {
    return Status::Error("model.num_moe_experts",
                         fmt::format("{} does not model mixture-of-experts layers yet", what));
  }
  return {};
}

}  // namespace mpusim
