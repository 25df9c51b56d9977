// The kit of mpusim's self-contained HTML report pages (estimate, advise, layout): the style
// of their sections, a page's head and end, and horizontal bars of coloured parts as inline
// SVG on one scale. It draws what it is given; what the bars and tables say is each
// subcommand's (estimate_report.h, advise, layout_report.h).
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace mpusim::cli {

// The CSS of the report sections (bars, tables, legend), for the pages that hold them.
extern const char* const kReportStyle;

// One horizontal bar made of coloured parts, with its label and a tooltip per part.
struct BarPart {
  double value = 0;
  std::string tooltip;
};
struct Bar {
  std::string label;
  std::vector<BarPart> parts;  // in the order of the legend's names
};

// A self-contained report page's head (inline style: the body's and kReportStyle) up to its
// <h1>`title`</h1>, and its end.
void PrintReportPageStart(const std::string& title, std::ostream& out);
void PrintReportPageEnd(std::ostream& out);

// Bars as an inline SVG, all on one scale, parts coloured in turn from one palette, with a
// legend of `names` above them. A `limit` > 0 (the GPU's memory) up to twice the largest
// bar is drawn as a red line named `limit_name` and the scale reaches it; a larger one is
// only named in the legend, with the largest bar's share of it.
void PrintBarsSvg(const std::vector<std::string>& names, const std::vector<Bar>& bars,
                  double limit, const std::string& limit_name, std::ostream& out);

}  // namespace mpusim::cli
