// The estimate as HTML: the section (a bar per stage against the GPU's memory, the tables, the
// step time's bar, the communication table, the JSON report embedded) that the estimate's own
// page and the layout page show, the page itself, and the step time's bar that advise's page
// draws too. The page kit (style, bars as SVG, page head and end) is report_page.cc.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <ostream>
#include <string>
#include <vector>

#include "cli/estimate_parts.h"
#include "cli/estimate_report.h"
#include "core/config/model_facts.h"
#include "core/estimate/not_modelled.h"
#include "core/html.h"
#include "run/preflight.h"

namespace mpusim::cli {
namespace {

std::string Td(const std::string& text) { return "<td>" + HtmlEscape(text) + "</td>"; }

}  // namespace

void PrintEstimateHtmlSection(const EstimateReport& r, const Topology& topology,
                              std::ostream& out) {
  const Config& config = r.config;
  const auto hbm = static_cast<PlanBytes>(r.gpu.hbm_bytes);
  out << fmt::format("<h2>memory and step time estimate on {} (mpusim estimate)</h2>\n",
                     HtmlEscape(r.gpu.name));
  out << fmt::format("<p>{} ranks ({}), parameters in {}{}; {}.</p>\n", topology.world_size(),
                     HtmlEscape(LayoutText(topology.sizes())), DTypeName(config.run->dtype),
                     r.run_given ? "" : " (no run section)",
                     HtmlEscape(OptimizerText(config, topology)));
  // Memory: a bar per stage, what its busiest rank holds at the peak.
  // "step copies": what the step's float32 copies of a 16-bit main_grad add beyond the
  // schedule's activations and buffers, where the step is the peak (HeldMemory::PeakWith).
  const std::vector<std::string> memory_names = {"parameters", "gradients",   "optimizer",
                                                 "activations", "buffers",    "step copies",
                                                 "reserve"};
  std::vector<Bar> bars;
  for (size_t i = 0; i < r.stages.size(); ++i) {
    const HeldMemory& h = r.stages[i].held;
    std::vector<PlanBytes> parts = {h.parameters, h.gradients, h.optimizer};
    if (r.activations) {
      const StageActivations& a = (*r.activations)[i];
      parts.push_back(a.activations);
      parts.push_back(a.buffers);
      parts.push_back(StagePeak(r, i) - SaturatingAdd(h.total(), SaturatingAdd(a.activations,
                                                                                a.buffers)));
      parts.push_back(r.reserves[i].total);
    }
    Bar bar{fmt::format("stage {} (rank {})", r.stages[i].stage, r.stages[i].rank), {}};
    for (size_t p = 0; p < parts.size(); ++p) {
      bar.parts.push_back({static_cast<double>(parts[p]),
                           fmt::format("stage {} {}: {}", r.stages[i].stage, memory_names[p],
                                       run::FormatBytes(parts[p]))});
    }
    bars.push_back(std::move(bar));
  }
  out << (r.activations ? "<h3>memory at the schedule's peak, by each stage's busiest rank</h3>\n"
                        : "<h3>memory held before the first step, by each stage's busiest "
                          "rank</h3>\n");
  PrintBarsSvg(memory_names, bars, static_cast<double>(hbm),
               fmt::format("{} of HBM", run::FormatBytes(hbm)), out);
  out << "<table class=\"report\"><tr><th>stage</th><th>rank</th><th>parameters</th>"
         "<th>gradients</th><th>optimizer</th><th>held</th>";
  if (r.activations) {
    out << "<th>stashes</th><th>activations</th><th>buffers</th><th>peak</th><th>reserve</th>"
           "<th>NCCL communicators</th><th>fits (peak + reserve)</th>";
  }
  out << "</tr>\n";
  for (size_t i = 0; i < r.stages.size(); ++i) {
    const StageHeldMemory& s = r.stages[i];
    out << "<tr>" << Td(std::to_string(s.stage)) << Td(std::to_string(s.rank))
        << Td(run::FormatBytes(s.held.parameters)) << Td(run::FormatBytes(s.held.gradients))
        << Td(run::FormatBytes(s.held.optimizer)) << Td(run::FormatBytes(s.held.total()));
    if (r.activations) {
      const StageActivations& a = (*r.activations)[i];
      const MemoryReserve& m = r.reserves[i];
      const PlanBytes needs = StageNeeds(r, i);
      out << Td(std::to_string(a.peak_stashes)) << Td(run::FormatBytes(a.activations))
          << Td(run::FormatBytes(a.buffers)) << Td(run::FormatBytes(StagePeak(r, i)))
          << Td(run::FormatBytes(m.total))
          << Td(m.given ? std::string("(--reserve-gib)")
                        : fmt::format("{}", fmt::join(m.communicators, ", ")))
          << (needs <= hbm ? "<td>" : "<td class=\"over\">")
          << HtmlEscape(FitsText(needs, hbm)) << "</td>";
    }
    out << "</tr>\n";
  }
  out << "</table>\n";
  if (!r.activations) {
    out << "<p class=\"note\">activations: not estimated: " << HtmlEscape(r.activations_missing)
        << "</p>\n";
  }
  out << "<p class=\"note\">Activations are Megatron's on a GPU as Korthikanti et al. 2022 "
         "count them, walked through the pipeline schedule. The reserve is what a GPU run adds "
         "(docs/estimate.md, \"The memory reserve\"): the CUDA context, cuBLAS workspaces, NCCL's "
         "buffers "
         "per communicator and the caching allocator's fragmentation, or --reserve-gib.</p>\n";
  if (!r.reserves.empty() && !r.reserves.front().given) {
    out << fmt::format(
        "<p class=\"note\">Reserve per rank: CUDA context {}, cuBLAS workspaces {}, NCCL "
        "buffers {} per communicator, allocator fragmentation {:.0f}% of the activations and "
        "buffers.</p>\n",
        run::FormatBytes(kCudaContextBytes), run::FormatBytes(r.reserves.front().cublas_workspaces),
        run::FormatBytes(kNcclBytesPerCommunicator),
        100 * kFragmentation);
  }
  if (r.attention) {
    out << "<p class=\"note\">Counted with " << HtmlEscape(AttentionText(*r.attention))
        << ".</p>\n";
  }
  if (r.executor) {
    out << fmt::format("<h3>what <code>mpusim run</code> keeps on the CPU executor, in {}</h3>\n",
                       DTypeName(config.run->dtype));
    out << "<table class=\"report\"><tr><th>stage</th><th>stashes</th><th>stash bytes</th>"
           "<th>working</th><th>transfers</th><th>carried</th><th>optimizer step</th>"
           "<th>activations</th></tr>\n";
    for (const ExecutorActivations& a : *r.executor) {
      out << "<tr>" << Td(std::to_string(a.stage)) << Td(std::to_string(a.peak_stashes))
          << Td(run::FormatBytes(a.stashes)) << Td(run::FormatBytes(a.working))
          << Td(run::FormatBytes(a.transfers)) << Td(run::FormatBytes(a.carried))
          << Td(run::FormatBytes(a.optimizer_step))
          << Td(run::FormatBytes(a.peak())) << "</tr>\n";
    }
    out << "</table>\n<p class=\"note\">The executor's own stash (norm statistics in the "
           "compute dtype, per-head copies, no dropout masks) walked through the same "
           "schedule, with the backward's working set, the pipeline's received and in-flight "
           "tensors, the distributed optimizer's gradient piece kept between iterations, or "
           "the optimizer step if larger: what <code>mpusim run --no-check --summary</code> "
           "measures as activations (peak - held).</p>\n";
    if (FactsOf(config).moe.enabled()) {
      out << "<p class=\"note\">" << HtmlEscape(kMoeRoutingNote) << "</p>\n";
    }
  }
  if (r.time) {
    const TimeEstimate& t = *r.time;
    const RunConfig& run = *config.run;
    out << fmt::format(
        "<h3>step time {}: {:.1f} model TFLOP/s per GPU, MFU {:.1f}%</h3>\n<p>global batch {} "
        "({} micro-batches of {} x dp {}), sequence {}, recompute {}; the busiest stage's "
        "rank.</p>\n",
        SecondsText(t.step_time_s), t.model_tflops_per_gpu, 100 * t.mfu, t.global_batch_size,
        t.num_microbatches, run.micro_batch_size, topology.sizes().dp, run.seq_length,
        RecomputeSummary(run));
    const bool cp = topology.sizes().cp > 1;
    const bool ep = FactsOf(config).moe.enabled();
    PrintBarsSvg(TimePartNames(cp, ep), {TimeBar("one iteration", t, cp, ep)}, 0, "", out);
    out << "<table class=\"report\"><tr><th>group</th><th>operation</th><th>count</th>"
           "<th>sent</th><th>time (exposed)</th><th>hidden</th><th>link</th></tr>\n";
    for (const CommTime& c : t.communication) {
      out << "<tr>" << Td(c.kind) << "<td class=\"name\">" << HtmlEscape(c.operation) << "</td>"
          << Td(std::to_string(c.count)) << Td(run::FormatBytes(static_cast<PlanBytes>(c.bytes)))
          << Td(SecondsText(c.seconds)) << Td(SecondsText(c.hidden_s))
          << Td(c.inter_node ? "across nodes" : "in a node") << "</tr>\n";
    }
    out << "</table>\n";
    out << fmt::format(
        "<p class=\"note\">GEMMs by their shapes at {:.1f}% of peak (ceiling {:.0f}%), "
        "memory-bound kernels at {:.0f}% of HBM bandwidth, collectives at {:.0f}% of link "
        "bandwidth; {}; attention: {}.</p>\n",
        100 * t.gemm_efficiency_achieved, 100 * t.gpu.gemm_efficiency,
        100 * t.gpu.memory_efficiency, 100 * t.gpu.collective_efficiency,
        HtmlEscape(OverlapText(config, t,
                               topology.sizes().cp > 1 &&
                                   FactsOf(config).cp_comm_type == CpCommType::kP2p)),
        HtmlEscape(AttentionTimeText(t)));
  } else {
    out << "<p class=\"note\">step time: not estimated: " << HtmlEscape(r.time_missing)
        << "</p>\n";
  }
  for (const std::string& part : ModelParts(config)) {
    out << "<p class=\"note\">Model part: " << HtmlEscape(part) << ".</p>\n";
  }
  if (!r.executor_missing.empty()) {
    out << "<p class=\"note\">CPU executor's activations: not counted: "
        << HtmlEscape(r.executor_missing) << "</p>\n";
  }
  out << "<p class=\"note\">Not modelled: "
      << HtmlEscape(fmt::format("{}", fmt::join(NotModelled(config), "; "))) << ".</p>\n";
  out << "<script id=\"estimate\" type=\"application/json\">"
      << JsonForScript(EstimateJson(r, topology).dump()) << "</script>\n";
}

std::vector<std::string> TimePartNames(bool cp, bool ep) {
  std::vector<std::string> names = {"compute", "recompute", "tp collectives", "pp sends",
                                    "bubble", "dp gradient reduction", "optimizer"};
  if (cp) names.push_back("cp exchanges");
  if (ep) names.push_back("ep token exchanges");
  return names;
}

Bar TimeBar(const std::string& label, const TimeEstimate& t, bool cp, bool ep) {
  std::vector<double> parts = {t.compute_s, t.recompute_s, t.tp_comm_s, t.pp_comm_s,
                               t.bubble_s,  t.dp_comm_s,   t.optimizer_s};
  if (cp) parts.push_back(t.cp_comm_s);
  if (ep) parts.push_back(t.ep_comm_s);
  const std::vector<std::string> names = TimePartNames(cp, ep);
  Bar bar{label, {}};
  for (size_t p = 0; p < parts.size(); ++p) {
    // The bar draws what adds to the step; the tooltip names what overlap hides beside it.
    const double hidden = names[p] == "tp collectives"          ? t.tp_comm_hidden_s
                          : names[p] == "dp gradient reduction"   ? t.dp_comm_hidden_s
                          : names[p] == "ep token exchanges"      ? t.ep_comm_hidden_s
                                                                  : 0;
    const std::string note =
        hidden > 0 ? fmt::format(" exposed, {} hidden", SecondsText(hidden)) : "";
    bar.parts.push_back(
        {parts[p], fmt::format("{} {}: {}{}", label, names[p], SecondsText(parts[p]), note)});
  }
  return bar;
}

void PrintEstimateHtml(const EstimateReport& r, const Topology& topology,
                       const std::string& source, std::ostream& out) {
  PrintReportPageStart("mpusim estimate of " + source, out);
  PrintEstimateHtmlSection(r, topology, out);
  PrintReportPageEnd(out);
}

}  // namespace mpusim::cli
