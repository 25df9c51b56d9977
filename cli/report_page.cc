// The kit of mpusim's self-contained report pages (report_page.h): the style of their
// sections, bars as inline SVG on one scale, and a page's head and end. What the bars and
// tables say is the estimate's (estimate_html.cc), advise's and layout's own.
#include "cli/report_page.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <ostream>

#include "core/html.h"

namespace mpusim::cli {
namespace {

// The palette of the bars' parts, in turn: as many as a bar has parts (the step time's nine
// with cp and ep), so that no two parts of one bar share a colour.
constexpr std::array<const char*, 9> kColours = {"#4e79a7", "#f28e2b", "#76b7b2",
                                                 "#e15759", "#59a14f", "#b07aa1",
                                                 "#edc948", "#ff9da7", "#9c755f"};

}  // namespace

const char* const kReportStyle = R"CSS(
table.report { border-collapse: collapse; margin: 6px 0 12px; font: 12px monospace; }
table.report th, table.report td { border: 1px solid #ccc; padding: 2px 8px; text-align: right;
                                   white-space: nowrap; }
table.report th { background: #f0f0f0; }
table.report td.name { text-align: left; }
.over { color: #c00; font-weight: bold; }
.legend span { display: inline-block; margin-right: 12px; font-size: 12px; }
.legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
.note { color: #555; font-size: 12px; }
)CSS";

void PrintBarsSvg(const std::vector<std::string>& names, const std::vector<Bar>& bars,
                  double limit, const std::string& limit_name, std::ostream& out) {
  out << "<div class=\"legend\">";
  for (size_t i = 0; i < names.size(); ++i) {
    out << fmt::format("<span><i style=\"background:{}\"></i>{}</span>",
                       kColours[i % kColours.size()], HtmlEscape(names[i]));
  }
  double largest = 0;
  for (const Bar& bar : bars) {
    double total = 0;
    for (const BarPart& p : bar.parts) total += p.value;
    largest = std::max(largest, total);
  }
  // A limit far beyond the bars would squeeze them to nothing: it is then named, not drawn.
  const bool draw_limit = limit > 0 && limit <= 2 * largest;
  if (draw_limit) {
    out << fmt::format("<span><i style=\"background:#c00\"></i>{}</span>", HtmlEscape(limit_name));
  } else if (limit > 0) {
    out << fmt::format("<span>{} (off the scale: the largest bar is {:.2g}% of it)</span>",
                       HtmlEscape(limit_name), 100 * largest / limit);
  }
  out << "</div>\n";
  const double scale = std::max(draw_limit ? limit : 0, largest);
  // Labels in 11 px monospace take about 7 px a character.
  size_t label_chars = 20;
  for (const Bar& bar : bars) label_chars = std::max(label_chars, bar.label.size());
  const double kLabel = 7 * static_cast<double>(label_chars) + 10;
  constexpr double kWidth = 600, kRow = 22;
  const double height = kRow * static_cast<double>(bars.size()) + 6;
  out << fmt::format("<svg viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\" "
                     "font-family=\"monospace\" font-size=\"11\">\n",
                     kLabel + kWidth + 10, height, kLabel + kWidth + 10, height);
  for (size_t row = 0; row < bars.size(); ++row) {
    const Bar& bar = bars[row];
    const double y = kRow * static_cast<double>(row) + 3;
    out << fmt::format("<text x=\"0\" y=\"{}\">{}</text>\n", y + 14, HtmlEscape(bar.label));
    double x = kLabel;
    for (size_t i = 0; i < bar.parts.size(); ++i) {
      const double w = scale > 0 ? kWidth * bar.parts[i].value / scale : 0;
      if (w > 0) {
        out << fmt::format("<rect x=\"{:.2f}\" y=\"{}\" width=\"{:.2f}\" height=\"{}\" "
                           "fill=\"{}\"><title>{}</title></rect>\n",
                           x, y, w, kRow - 6, kColours[i % kColours.size()],
                           HtmlEscape(bar.parts[i].tooltip));
      }
      x += w;
    }
  }
  if (draw_limit) {
    const double x = kLabel + kWidth * limit / scale;
    out << fmt::format("<line x1=\"{:.2f}\" y1=\"0\" x2=\"{:.2f}\" y2=\"{}\" stroke=\"#c00\" "
                       "stroke-width=\"2\"><title>{}</title></line>\n",
                       x, x, height, HtmlEscape(limit_name));
  }
  out << "</svg>\n";
}

void PrintReportPageStart(const std::string& title, std::ostream& out) {
  out << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>"
      << HtmlEscape(title) << "</title>\n<style>\n"
      << "body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }\n"
      << "h1 { font-size: 18px; margin: 0 0 8px; }\n"
      << kReportStyle << "</style>\n</head>\n<body>\n<h1>" << HtmlEscape(title) << "</h1>\n";
}

void PrintReportPageEnd(std::ostream& out) { out << "</body>\n</html>\n"; }

}  // namespace mpusim::cli
