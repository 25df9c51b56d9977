// What `mpusim estimate` finds for a config on a layout, and its three renderings: text, JSON
// (the schema in the README) and an HTML section, which the estimate's own page and the
// layout page (`mpusim layout --format html`) both show. Everything here formats what
// core/estimate counts (estimate_report.cc; the renderings estimate_text.cc, estimate_json.cc,
// estimate_html.cc); `mpusim advise`'s page draws its bars with the same page kit (report_page.h).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "cli/report_page.h"  // the page kit, which the estimate's HTML uses
#include "core/config/config.h"
#include "core/estimate/activation_estimate.h"
#include "core/estimate/executor_activations.h"
#include "core/estimate/memory_estimate.h"
#include "core/estimate/memory_reserve.h"
#include "core/estimate/time_estimate.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim::cli {

struct EstimateReport {
  Config config;           // with the run section the estimate used
  bool run_given = false;  // the config or the flags gave that run section
  GpuSpec gpu;
  std::vector<StageHeldMemory> stages;
  std::vector<PlanBytes> other_optimizer;  // the optimizer the other way; empty: no optimizer
  std::optional<std::vector<StageActivations>> activations;
  std::string activations_missing;  // why not, when activations is empty
  // What `mpusim run` of this config would hold on the CPU executor (with the activations).
  std::optional<std::vector<ExecutorActivations>> executor;
  // Why not, when the CPU executor does not build the model yet (its error line); empty
  // otherwise (the combined 1F1B schedule, which `mpusim run` refuses, leaves it out silently).
  std::string executor_missing;
  std::optional<TimeEstimate> time;
  std::string time_missing;  // why not, when time is empty
  // Each stage's busiest rank's memory reserve (core/estimate/memory_reserve.h), with the
  // activations: a stage fits when its peak + reserve is at most the GPU's memory.
  std::vector<MemoryReserve> reserves;
  // The attention the activations and the step time count (with a run section).
  std::optional<ResolvedAttention> attention;
};

// "attention_backend \"fused\" (auto, bfloat16 on ...): keeps each query row's float32
// log-sum-exp, not the s x s probabilities": which attention an estimate counts, and what
// that keeps.
std::string AttentionText(const ResolvedAttention& attention);

// --attention-backend NAME (estimate, advise; CLI checks NAME is one of
// AttentionBackendNames()): sets model.attention_backend of a GPT config; empty: the
// config's.
void SetAttentionBackend(const std::string& name, Config* config);
// An error the flag caused ("flash" in float32) names it: "--attention-backend flash: ...".
bool FromAttentionFlag(const std::string& name, const Status& status);

// Counts `config` (its run section already set, FillMissingRun) on `topology`: the held
// memory always, the activations, the reserve and the step time on `gpu` when `time_asked`
// (a run section was given). `reserve_bytes` replaces every stage's computed reserve
// (--reserve-gib). Errors are the held-memory count's, naming a config field.
StatusOr<EstimateReport> MakeEstimateReport(Config config, const Topology& topology,
                                            const GpuSpec& gpu, bool run_given, bool time_asked,
                                            std::optional<PlanBytes> reserve_bytes = {});

void PrintEstimateText(const EstimateReport& report, const Topology& topology,
                       std::ostream& out);
nlohmann::ordered_json EstimateJson(const EstimateReport& report, const Topology& topology);
// The estimate as a part of an HTML page (no <html>, no style of its own: it uses
// kReportStyle's classes): a bar per stage of what its busiest rank holds at the peak against
// the GPU's memory, the step time's parts, the communication table, and EstimateJson in
// <script id="estimate" type="application/json"> for scripts.
void PrintEstimateHtmlSection(const EstimateReport& report, const Topology& topology,
                              std::ostream& out);
// A self-contained page (PrintReportPageStart) holding PrintEstimateHtmlSection.
void PrintEstimateHtml(const EstimateReport& report, const Topology& topology,
                       const std::string& source, std::ostream& out);

// The parts of a step's time as bars draw them: compute, recompute, tp collectives, pp sends,
// bubble, dp gradient reduction, optimizer, with `cp` context parallelism's exchanges and with
// `ep` the mixture-of-experts layers' token exchanges.
std::vector<std::string> TimePartNames(bool cp, bool ep);
Bar TimeBar(const std::string& label, const TimeEstimate& time, bool cp, bool ep);

// "tp 2 · pp 2 · dp 2": the axes of the layout larger than 1 (all 1: "one rank").
std::string LayoutText(const DerivedSizes& sizes);
// "1.23 s", "45.6 ms", "789 us".
std::string SecondsText(double seconds);
// A byte count for JSON: exact below 2^64 (every count here is far below; the counts
// saturate at 2^100, core/memory_plan.h).
nlohmann::ordered_json JsonBytes(PlanBytes bytes);

}  // namespace mpusim::cli
