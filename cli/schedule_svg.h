// The pipeline schedule as SVG, for `mpusim schedule --format svg` and the layout page
// (layout_report.h). It draws core/schedule.h's schedule on an idealised machine; it times
// nothing of a real run.
#pragma once

#include <ostream>

#include "core/schedule.h"

namespace mpusim::cli {

// The schedule on an idealised machine (TimeSchedule with `forward` and `backward` time units)
// as SVG: a row per pipeline rank, a box per step at its time, coloured by micro-batch,
// lighter for later chunks, a tooltip naming each box; the gaps are the bubble. `standalone`:
// a file of its own (with the SVG namespace), else an element inside an HTML page.
void PrintScheduleSvg(const PipelineSchedule& schedule, double forward, double backward,
                      bool standalone, std::ostream& out);

}  // namespace mpusim::cli
