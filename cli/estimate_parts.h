// The pieces of the estimate's report (estimate_report.h) that its text, JSON and HTML
// renderings share: which of Megatron's overlap options the estimate ran with, a stage's peak
// and what must fit the GPU, and the words for fits, recomputation, the optimizer, overlap,
// the attention's time and the MoE routing assumption. Internal to cli/estimate_*.cc; not a
// rendering itself (estimate_text.cc, estimate_json.cc, estimate_html.cc).
#pragma once

#include <cstddef>
#include <string>

#include "cli/estimate_report.h"
#include "core/config/config.h"
#include "core/estimate/time_estimate.h"
#include "core/memory_plan.h"
#include "core/topology.h"

namespace mpusim::cli {

// Which of Megatron's overlap options the estimate ran with.
bool TpOverlap(const Config& config);
bool GradOverlap(const Config& config);
bool EpOverlap(const Config& config);
bool AnyOverlap(const Config& config);
// "12.3 ms exposed (45.6 ms hidden)" for a part that overlap hides, else "12.3 ms".
std::string ExposedText(double exposed, double hidden, bool overlapped);
// The model line's words on overlap: what runs beside compute.
std::string OverlapText(const Config& config, const TimeEstimate& t, bool ring);

// A stage's busiest rank at the schedule's peak: held + activations + buffers.
PlanBytes StagePeak(const EstimateReport& r, size_t i);
// A stage's peak and the reserve on top: what must fit the GPU's memory.
PlanBytes StageNeeds(const EstimateReport& r, size_t i);
// "yes, 1.2 GiB free" or "no, 3.4 GiB over".
std::string FitsText(PlanBytes peak, PlanBytes hbm);
// "main_grad and Adam (...) in float32, distributed optimizer (1 instance)".
std::string OptimizerText(const Config& config, const Topology& topology);
// How the step time counts the core attention.
std::string AttentionTimeText(const TimeEstimate& t);

// The executor count's assumption for mixture-of-experts layers, whose stash follows the
// router (core/estimate/executor_activations.h).
inline constexpr const char* kMoeRoutingNote =
    "MoE layers are counted for balanced routing: each expert gets T k / E of each rank's "
    "T tokens (at most its capacity); exact with expert_model_parallel_size 1 and no "
    "capacity factor, where every rank gets every choice of its dispatch group.";

}  // namespace mpusim::cli
