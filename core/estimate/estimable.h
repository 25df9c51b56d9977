// What the activation count and the step-time model cover (core/estimate/activation_estimate.h,
// time_estimate.h): a GPT model with a run section, without mixture-of-experts layers, which
// neither models yet, and for the step time without context parallelism. One check, so that
// both refuse alike.
#pragma once

#include <fmt/format.h>

#include <string_view>

#include "core/config/config.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {

// `what` names the estimate in the error ("the step-time estimate"); the error names the
// field it cannot handle. `with_cp`: the estimate models context parallelism.
inline Status CheckEstimable(const Config& config, const Topology& topology,
                             std::string_view what, bool with_cp = false) {
  if (!config.gpt) {
    return Status::Error("model", fmt::format("{} needs a GPT model (\"type\": \"gpt\"); a lab "
                                              "chain has none",
                                              what));
  }
  if (!config.run) return Status::Error("run", fmt::format("{} needs a run section", what));
  if (topology.sizes().cp > 1 && !with_cp) {
    return Status::Error("parallel.context_parallel_size",
                         fmt::format("{} does not model context parallelism yet", what));
  }
  if (config.gpt->moe.enabled()) {
    return Status::Error("model.num_moe_experts",
                         fmt::format("{} does not model mixture-of-experts layers yet", what));
  }
  return {};
}

}  // namespace mpusim
