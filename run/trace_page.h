// The timeline of `mpusim run --trace FILE.html`: the Chrome trace events of the last step
// drawn by one self-contained HTML page (inline script and data, nothing fetched), for a
// laptop without a network or a class without Perfetto.
//
// What it is: a row per rank (its name from the trace's thread_name events, its share of the
// step in forward and backward steps), the forward, backward and recompute slices on a
// compute line, and below it a line of collectives and one of sends and receives, with a
// tooltip per slice (name, times, args) and a zoom menu.
// The page embeds the trace itself, so a reader can still save it for Perfetto.
// What it is not: a general trace viewer; it reads only the events WriteTrace writes
// (metadata "M" and complete "X" events).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace mpusim::run {

// `trace`: {"traceEvents": [...], ...}; `title`: what the page's heading names (the config).
std::string TracePageHtml(const nlohmann::ordered_json& trace, const std::string& title);

}  // namespace mpusim::run
