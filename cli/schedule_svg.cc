// The pipeline schedule as SVG (schedule_svg.h): `mpusim schedule --format svg` and the
// layout page's drawing. Not the schedule itself (core/schedule.h) nor its timing (TimeSchedule).
#include "cli/schedule_svg.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "core/html.h"
#include "core/pipeline/pipeline_plan.h"

namespace mpusim::cli {

void PrintScheduleSvg(const PipelineSchedule& s, double kForward, double kBackward, bool standalone,
                      std::ostream& out) {
  const ScheduleTiming t = TimeSchedule(s, kForward, kBackward);
  const int64_t p = s.pipeline_model_parallel_size;
  constexpr double kUnit = 28, kRow = 34, kLeft = 78, kTop = 44;
  const std::string title = fmt::format(
      "{}: p {}{}, M {}; forward {:g}, backward {:g} units; bubble {:.3f} of the ranks' time",
      s.interleaved ? "interleaved 1F1B" : "1F1B", p,
      s.interleaved ? fmt::format(", v {}", s.num_model_chunks) : "", s.num_microbatches, kForward,
      kBackward, t.BubbleFraction());
  const std::string legend[] = {
      "F<chunk>.<micro-batch> forward (light), B backward (dark); colour: micro-batch; grey: idle "
      "(the bubble)",
      "lines: activations sent on (solid), gradients sent back (dashed); peak: most "
      "micro-batches in flight"};
  // Sized to the drawing and to its text (about 0.6 em per character), with a viewBox so that
  // a page can scale it to its width instead of scrolling or clipping.
  const auto text_width = [](const std::string& text, double font) {
    return 0.6 * font * static_cast<double>(text.size());
  };
  const double width = std::max({kLeft + t.makespan * kUnit + 20, 8 + text_width(title, 13) + 20,
                                 8 + text_width(legend[0], 11) + 20,
                                 8 + text_width(legend[1], 11) + 20});
  const double axis = kTop + static_cast<double>(p) * kRow + 4;
  const double height = axis + 62;
  out << fmt::format(
      "<svg{} viewBox=\"0 0 {:.0f} {:.0f}\" width=\"{:.0f}\" height=\"{:.0f}\" "
      "style=\"max-width:100%;height:auto\" font-family=\"sans-serif\" font-size=\"11\">\n",
      // Inside an HTML page the svg element needs no namespace (and the page no URL).
      standalone ? " xmlns=\"http://www.w3.org/2000/svg\"" : "", width, height, width, height);
  out << fmt::format("<text x=\"8\" y=\"18\" font-size=\"13\">{}</text>\n", HtmlEscape(title));
  // The executor's transfers (core/pipeline): action i posts step i's receive and step
  // i - 1's sends, so step i's send is in action i + 1.
  const PipelinePlan plan = PlanPipelineTransfers(s);
  const auto transfers_of = [&](int64_t r, size_t i) {
    std::vector<Transfer> out_transfers;
    const auto& actions = plan[static_cast<size_t>(r)];
    for (const Transfer& transfer : actions[i].batch) {
      if (!transfer.send) out_transfers.push_back(transfer);
    }
    for (const Transfer& transfer : actions[i + 1].batch) {
      if (transfer.send) out_transfers.push_back(transfer);
    }
    return out_transfers;
  };
  // Where a sent message is consumed: the step of the peer with its pass, chunk and
  // micro-batch.
  const auto consumer = [&](const Transfer& sent) -> std::optional<size_t> {
    const auto& steps = s.per_rank[static_cast<size_t>(sent.peer)];
    const Pass pass = sent.kind == Transfer::Kind::kActivation ? Pass::kForward : Pass::kBackward;
    for (size_t j = 0; j < steps.size(); ++j) {
      if (steps[j].pass == pass && steps[j].model_chunk == sent.model_chunk &&
          steps[j].microbatch == sent.microbatch) {
        return j;
      }
    }
    return std::nullopt;
  };
  for (int64_t r = 0; r < p; ++r) {
    const double y = kTop + static_cast<double>(r) * kRow;
    out << fmt::format(
        "<text x=\"8\" y=\"{:.0f}\">pp rank {}</text><text x=\"8\" y=\"{:.0f}\" "
        "font-size=\"9\" fill=\"#555\">peak {}</text>\n<rect class=\"stage\" data-pp=\"{}\" "
        "x=\"{}\" y=\"{:.0f}\" width=\"{:.0f}\" height=\"{:.0f}\" fill=\"#eeeeee\"/>\n",
        y + kRow / 2 - 1, r, y + kRow / 2 + 9, ScheduleTiming::PeakInFlight(s, r), r, kLeft, y,
        t.makespan * kUnit, kRow - 6);
    const auto& steps = s.per_rank[static_cast<size_t>(r)];
    for (size_t i = 0; i < steps.size(); ++i) {
      const ScheduleStep& step = steps[i];
      const bool forward = step.pass == Pass::kForward;
      // Neighbouring micro-batches a golden angle apart on the colour wheel.
      const double hue = std::fmod(137.508 * static_cast<double>(step.microbatch), 360.0);
      const double light = 45.0 + 20.0 * static_cast<double>(step.model_chunk) /
                                      static_cast<double>(s.num_model_chunks);
      const double x = kLeft + t.start[static_cast<size_t>(r)][i] * kUnit;
      const double w =
          (t.end[static_cast<size_t>(r)][i] - t.start[static_cast<size_t>(r)][i]) * kUnit;
      std::string moves;
      for (const Transfer& transfer : transfers_of(r, i)) {
        moves += "; " + FormatTransfer(transfer);
      }
      out << fmt::format(
          "<g><title>rank {} {} chunk {} micro-batch {}: {:g} to {:g}{}</title><rect x=\"{:.1f}\" "
          "y=\"{:.0f}\" width=\"{:.1f}\" height=\"{:.0f}\" fill=\"hsl({:.0f},{},{:.0f}%)\" "
          "stroke=\"#333\" stroke-width=\"0.5\"/><text x=\"{:.1f}\" y=\"{:.0f}\" "
          "text-anchor=\"middle\">{}</text></g>\n",
          r, forward ? "forward" : "backward", step.model_chunk, step.microbatch,
          t.start[static_cast<size_t>(r)][i], t.end[static_cast<size_t>(r)][i], moves, x, y + 2,
          w - 1, kRow - 10, hue, forward ? "70%" : "45%", light, x + w / 2, y + kRow / 2 + 2,
          FormatStep(step));
    }
  }
  // A line per send, from the end of the producing step to the start of the step that
  // consumes it: activations solid, gradients dashed.
  for (int64_t r = 0; r < p; ++r) {
    const auto& steps = s.per_rank[static_cast<size_t>(r)];
    for (size_t i = 0; i < steps.size(); ++i) {
      for (const Transfer& transfer : transfers_of(r, i)) {
        if (!transfer.send) continue;
        const std::optional<size_t> j = consumer(transfer);
        if (!j) continue;
        const bool down = transfer.peer > r;
        const double y0 = kTop + static_cast<double>(r) * kRow + (down ? kRow - 8 : 2);
        const double y1 = kTop + static_cast<double>(transfer.peer) * kRow + (down ? 2 : kRow - 8);
        out << fmt::format(
            "<line class=\"message\" x1=\"{:.1f}\" y1=\"{:.0f}\" x2=\"{:.1f}\" y2=\"{:.0f}\" "
            "stroke=\"#333\" stroke-opacity=\"0.45\"{}/>\n",
            kLeft + t.end[static_cast<size_t>(r)][i] * kUnit, y0,
            kLeft + t.start[static_cast<size_t>(transfer.peer)][*j] * kUnit, y1,
            transfer.kind == Transfer::Kind::kGradient ? " stroke-dasharray=\"3,2\"" : "");
      }
    }
  }
  // The time axis, in the units of forward and backward: about ten ticks at a round step.
  const double raw = std::max(t.makespan / 10.0, 1e-9);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double tick = raw <= magnitude ? magnitude
                      : raw <= 2 * magnitude ? 2 * magnitude
                      : raw <= 5 * magnitude ? 5 * magnitude
                                             : 10 * magnitude;
  out << fmt::format("<line x1=\"{}\" y1=\"{:.0f}\" x2=\"{:.1f}\" y2=\"{:.0f}\" stroke=\"#555\"/>\n",
                     kLeft, axis, kLeft + t.makespan * kUnit, axis);
  for (double at = 0; at <= t.makespan + 1e-9; at += tick) {
    out << fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.0f}\" x2=\"{0:.1f}\" y2=\"{2:.0f}\" stroke=\"#555\"/>"
        "<text x=\"{0:.1f}\" y=\"{3:.0f}\" text-anchor=\"middle\" font-size=\"9\">{4:g}</text>\n",
        kLeft + at * kUnit, axis, axis + 4, axis + 14, at);
  }
  out << fmt::format("<text x=\"8\" y=\"{:.0f}\" font-size=\"9\" fill=\"#555\">time (units)</text>\n",
                     axis + 14);
  out << fmt::format("<text x=\"8\" y=\"{:.0f}\">{}</text>\n<text x=\"8\" y=\"{:.0f}\">{}</text>\n</svg>\n",
                     height - 24, HtmlEscape(legend[0]), height - 10, HtmlEscape(legend[1]));
}

}  // namespace mpusim::cli
