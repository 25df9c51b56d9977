// Rendering of a planned layout: text (in the style of the Megatron MPU lab), JSON
// (schema_version 1), a node-by-GPU picture and an HTML page, plus one rank's coordinates and
// groups. Everything here only formats what core/topology computes (layout_report.cc: text,
// picture, rank; layout_json.cc; layout_html.cc; the schedule's SVG is schedule_svg.h).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "cli/schedule_svg.h"  // PrintScheduleSvg, which the page draws with
#include "core/schedule.h"
#include "core/topology.h"

namespace mpusim::cli {

struct LayoutReportOptions {
  std::string source;         // config file or "command line", for the header
  std::vector<size_t> kinds;  // indices into topology.kinds(), in print order
  int64_t max_groups = 32;    // text only: groups shown per kind (0 = all)
};

// Kinds in the order the text report prints them: the lab's dp, tp, pp first, then the rest
// in Megatron's order.
std::vector<size_t> DefaultTextKindOrder(const Topology& topology);

// The largest world a whole-layout listing (text, json, picture) covers: it takes time and
// output in proportion to the world size (about 150 MiB of JSON at this size). One rank's
// query (--rank) works at any size.
inline constexpr int64_t kMaxListedRanks = int64_t{1} << 20;

// Human-readable notes about groups that leave a node (tp, expt_tp, ep): how many of each
// kind's groups do (O(world size) time, see NumGroupsSpanningNodes).
std::vector<std::string> NodeWarnings(const Topology& topology);
// The same for the groups of one rank only (O(axes)), for worlds of any size.
std::vector<std::string> RankNodeWarnings(const Topology& topology, int64_t rank);
// The nodes the layout's ranks occupy (rank r on node r / gpus_per_node).
int64_t NumNodes(const Topology& topology);

void PrintLayoutText(const Topology& topology, const LayoutReportOptions& options,
                     std::ostream& out);
// {"schema_version": 1, "world_size": N, "sizes": {...}, "groups": {"<kind>": [[...]]}, ...}
// Groups are streamed, so 2^20-rank layouts do not build a JSON tree.
void PrintLayoutJson(const Topology& topology, const LayoutReportOptions& options,
                     std::ostream& out);
// A grid: one row per node, one cell per GPU with its coordinates on the axes of size > 1.
void PrintLayoutPicture(const Topology& topology, std::ostream& out);
// One self-contained HTML page (inline CSS, script and data; nothing fetched): the nodes and
// their GPUs; choosing a group kind colours its groups, clicking a GPU shows its coordinates
// and every group it belongs to and outlines the ranks of its group of the chosen kind. The
// node map's warnings are shown. The data is the JSON report plus every rank's coordinates.
// With `schedule` (pp > 1), the page also shows the pipeline schedule's picture, and then
// `estimate` (HTML, cli/estimate_report.h's section; empty: none).
void PrintLayoutHtml(const Topology& topology, const LayoutReportOptions& options,
                     const PipelineSchedule* schedule, const std::string& estimate,
                     std::ostream& out);

void PrintRankText(const Topology& topology, int64_t rank, const LayoutReportOptions& options,
                   std::ostream& out);
void PrintRankJson(const Topology& topology, int64_t rank, const LayoutReportOptions& options,
                   std::ostream& out);

}  // namespace mpusim::cli
