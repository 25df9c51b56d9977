// What the activation count and the step-time model cover (core/estimate/activation_estimate.h,
// time_estimate.h): a GPT model with a run section, without mixture-of-experts layers, which
// neither models yet. One check, so that both refuse alike.
#pragma once

#include <fmt/format.h>

#include <string_view>

#include "core/config/config.h"
#include "core/status.h"

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
  if (config.gpt->moe.enabled()) {
    return Status::Error("model.num_moe_experts",
                         fmt::format("{} does not model mixture-of-experts layers yet", what));
  }
  return {};
}

}  // namespace mpusim
