// The layout as one self-contained HTML page (layout_report.h's PrintLayoutHtml): its style,
// its script (plain DOM: the nodes and GPUs drawn from the embedded JSON report, a group kind
// coloured, a clicked GPU's groups listed), the node warnings, the schedule's SVG and the
// estimate's section when given. Not the JSON it embeds (layout_json.cc).
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <string>

#include "cli/layout_report.h"
#include "cli/report_page.h"
#include "core/html.h"

namespace mpusim::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

// The page's script: draws the nodes and GPUs from the embedded layout, colours the groups of
// the chosen kind, and on a click shows the GPU's coordinates and every group it belongs to,
// highlighting the ranks of its group of the chosen kind. Plain DOM, no libraries.
constexpr const char* kPageScript = R"JS(
const L = JSON.parse(document.getElementById('layout').textContent);
const coords = L.coordinates;  // [rank] -> [node, local, tp, cp, dp, pp, etp, ep, edp]
const axes = ['tp', 'cp', 'dp', 'pp', 'etp', 'ep', 'edp'];
const kinds = Object.keys(L.groups);
const groupOf = {};  // kind -> Int32Array rank -> group index
for (const kind of kinds) {
  const of = new Int32Array(L.world_size).fill(-1);
  L.groups[kind].forEach((g, i) => { for (const r of g) of[r - L.rank_offset] = i; });
  groupOf[kind] = of;
}
const select = document.getElementById('kind');
for (const kind of kinds) {
  const o = document.createElement('option');
  o.value = kind;
  o.textContent = kind + ' (' + L.groups[kind].length + ' groups)';
  select.appendChild(o);
}
select.value = kinds.includes('tp') ? 'tp' : kinds[0];
const grid = document.getElementById('grid');
const cells = [];
let node = -1, row = null;
for (let r = 0; r < L.world_size; ++r) {
  const c = coords[r];
  if (c[0] !== node) {
    node = c[0];
    row = document.createElement('div');
    row.className = 'node';
    const label = document.createElement('span');
    label.className = 'label';
    label.textContent = 'node ' + node;
    row.appendChild(label);
    grid.appendChild(row);
  }
  const cell = document.createElement('div');
  cell.className = 'gpu';
  cell.id = 'g' + (r + L.rank_offset);
  cell.dataset.rank = r + L.rank_offset;
  const shown = axes.filter((a, i) => L.sizes[a] > 1 && (i < 4 || L.expert_differs));
  cell.innerHTML = '<b>g' + (r + L.rank_offset) + '</b><br>' +
      shown.map(a => a + c[2 + axes.indexOf(a)]).join(' ');
  cell.addEventListener('click', () => choose(r));
  row.appendChild(cell);
  cells.push(cell);
}
let chosen = -1;
function paint() {
  const kind = select.value, of = groupOf[kind], n = L.groups[kind].length;
  const mine = chosen >= 0 ? of[chosen] : -1;
  for (let r = 0; r < cells.length; ++r) {
    const g = of[r];
    cells[r].style.background = g < 0 ? '#eee' : 'hsl(' + Math.round(360 * g / n) + ', 70%, 82%)';
    cells[r].dataset.group = g;
    cells[r].classList.toggle('peer', mine >= 0 && g === mine);
    cells[r].classList.toggle('chosen', r === chosen);
  }
}
function choose(r) {
  chosen = r;
  paint();
  const c = coords[r];
  const lines = ['rank ' + (r + L.rank_offset) + ' on node ' + c[0] + ', GPU ' + c[1] + ': ' +
                 axes.map((a, i) => a + ' ' + c[2 + i]).join(', ')];
  for (const kind of kinds) {
    const g = groupOf[kind][r];
    if (g < 0) continue;
    const ranks = L.groups[kind][g];
    lines.push(kind + ' group ' + g + ': [' +
               (ranks.length > 32 ? ranks.slice(0, 32).join(', ') + ', ... (' + ranks.length + ' ranks)'
                                  : ranks.join(', ')) + ']');
  }
  // With a pipeline, the schedule below marks the GPU's stage (its pp rank's row).
  const stages = document.querySelectorAll('rect.stage');
  stages.forEach(e => e.classList.toggle('mine', Number(e.dataset.pp) === c[5]));
  if (stages.length > 0) lines.push('its stage: pp rank ' + c[5] + ', outlined in the schedule below');
  document.getElementById('info').textContent = lines.join('\n');
}
select.addEventListener('change', paint);
paint();
// A link can choose for the reader: #kind=pp&rank=5 selects the kind and clicks g5.
const wanted = new URLSearchParams(location.hash.slice(1));
if (kinds.includes(wanted.get('kind'))) { select.value = wanted.get('kind'); paint(); }
if (wanted.has('rank')) {
  const cell = document.getElementById('g' + wanted.get('rank'));
  if (cell) cell.click();
}
)JS";

constexpr const char* kPageStyle = R"CSS(
body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; }
.controls { margin: 8px 0; }
.node { display: flex; flex-wrap: wrap; align-items: stretch; margin: 4px 0; }
.label { width: 70px; font-weight: bold; align-self: center; }
.gpu { border: 1px solid #999; border-radius: 4px; padding: 3px 5px; margin: 2px; min-width: 56px;
       font: 11px monospace; cursor: pointer; }
.gpu.peer { border: 2px solid #c00; }
.gpu.chosen { outline: 3px solid #000; }
rect.stage.mine { stroke: #c00; stroke-width: 3; }
#info { white-space: pre-wrap; font: 12px monospace; background: #f6f6f6; padding: 8px;
        min-height: 3em; }
.warning { color: #a40; }
)CSS";

}  // namespace

void PrintLayoutHtml(const Topology& topology, const LayoutReportOptions& options,
                     const PipelineSchedule* schedule, const std::string& estimate,
                     std::ostream& out) {
  std::ostringstream layout_json;
  PrintLayoutJson(topology, options, layout_json);
  ordered_json data = ordered_json::parse(layout_json.str());  // kinds in Megatron's order
  ordered_json coordinates = ordered_json::array();
  bool expert_differs = false;
  for (int64_t r = 0; r < topology.world_size(); ++r) {
    const RankCoordinates c = topology.Coordinates(topology.first_rank() + r);
    coordinates.push_back({c.node, c.local_rank, c.tp, c.cp, c.dp, c.pp, c.etp, c.ep, c.edp});
    expert_differs = expert_differs || c.etp != c.tp || c.ep != 0;
  }
  data["coordinates"] = coordinates;
  data["expert_differs"] = expert_differs;
  const std::string embedded = JsonForScript(data.dump());
  const ParallelConfig& c = topology.config();
  std::string warnings;
  for (const std::string& w : NodeWarnings(topology)) {
    warnings += "<p class=\"warning\">warning: " + HtmlEscape(w) + "</p>\n";
  }
  out << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      << "<title>mpusim layout: " << HtmlEscape(options.source) << "</title>\n<style>" << kPageStyle
      << kReportStyle << "</style>\n</head>\n<body>\n"
      << fmt::format("<h1>mpusim layout of {}: {} ranks, tp {} pp {} cp {} dp {}</h1>\n",
                     HtmlEscape(options.source), topology.world_size(), topology.sizes().tp,
                     topology.sizes().pp, topology.sizes().cp, topology.sizes().dp)
      << fmt::format(
             "<p>{} node{} of {} GPUs, rank r on node r / {}. Choose a group kind to "
             "colour its groups; click a GPU for its coordinates and every group it "
             "belongs to (its group of the chosen kind is outlined in red). A link "
             "ending in #kind=pp&amp;rank=5 opens with that choice.</p>\n",
             NumNodes(topology), NumNodes(topology) == 1 ? "" : "s", c.gpus_per_node,
             c.gpus_per_node)
      << warnings << "<div class=\"controls\">group kind: <select id=\"kind\"></select></div>\n"
      << "<div id=\"grid\"></div>\n<pre id=\"info\">click a GPU</pre>\n";
  if (schedule != nullptr) {
    // The pipeline schedule on an idealised machine (`mpusim schedule --format svg`).
    out << fmt::format(
        "<h2>pipeline schedule, {} micro-batches (forward 1, backward 2 time units, "
        "communication free)</h2>\n",
        schedule->num_microbatches);
    PrintScheduleSvg(*schedule, 1, 2, /*standalone=*/false, out);
  }
  out << estimate;
  out << "<script id=\"layout\" type=\"application/json\">" << embedded << "</script>\n"
      << "<script>" << kPageScript << "</script>\n</body>\n</html>\n";
}

}  // namespace mpusim::cli
