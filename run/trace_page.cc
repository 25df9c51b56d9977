// The self-contained timeline page of a Chrome trace (see trace_page.h).
#include "run/trace_page.h"

#include <fmt/format.h>

#include "core/html.h"

namespace mpusim::run {
namespace {

// Draws the trace's complete events as SVG rectangles: a row per rank (tid) of three lines,
// its steps (recomputations as a band inside their backward step), its collectives and its
// sends and receives, and its share of the step in forward and backward steps. Plain DOM,
// no libraries.
constexpr const char* kScript = R"JS(
const T = JSON.parse(document.getElementById('trace').textContent);
const names = {}, slices = [];
for (const e of T.traceEvents) {
  if (e.ph === 'M' && e.name === 'thread_name') names[e.tid] = e.args.name;
  if (e.ph === 'X') slices.push(e);
}
const ranks = [...new Set(slices.map(s => s.tid).concat(Object.keys(names).map(Number)))]
    .sort((a, b) => a - b);
const row = {};
ranks.forEach((r, i) => { row[r] = i; });
let end = 0;
const busy = {};  // rank -> time in forward and backward steps (recomputations lie inside)
for (const s of slices) {
  end = Math.max(end, s.ts + s.dur);
  if (s.cat === 'forward' || s.cat === 'backward') busy[s.tid] = (busy[s.tid] || 0) + s.dur;
}
for (const r of Object.keys(names)) busy[r] = busy[r] || 0;
const microbatches = 1 + Math.max(0, ...slices.filter(s => s.cat !== 'comm').map(s => s.args.microbatch));
const commColour = {'all-reduce': '#d9534f', 'all-gather': '#5cb85c', 'reduce-scatter': '#428bca',
                    'send': '#f0ad4e', 'recv': '#f0ad4e', 'broadcast': '#9b59b6'};
function colour(s) {
  if (s.cat === 'comm') {
    const op = s.name.split(' ')[0].replace('(max)', '');
    return commColour[op] || '#999';
  }
  const hue = Math.round(360 * s.args.microbatch / microbatches);
  if (s.cat === 'recompute') return 'hsl(' + hue + ', 30%, 35%)';
  return 'hsl(' + hue + ', ' + (s.cat === 'forward' ? '70%, 70%' : '45%, 50%') + ')';
}
const LEFT = 190, LANE = 58, TOP = 10;
const p2p = s => /^(send|recv) /.test(s.name);
const svgNS = 'http://www.w3.org/2000/svg';
function draw() {
  // 1x fits the window; the zoom menu multiplies it.
  const fit = Math.max(600, document.getElementById('timeline').clientWidth - LEFT - 50);
  const width = document.getElementById('zoom').value * fit;
  const x = t => LEFT + t / end * width;
  const svg = document.createElementNS(svgNS, 'svg');
  svg.setAttribute('width', LEFT + width + 40);
  svg.setAttribute('height', TOP + ranks.length * LANE + 30);
  svg.setAttribute('font-family', 'sans-serif');
  svg.setAttribute('font-size', '11');
  const add = (tag, attrs, parent) => {
    const el = document.createElementNS(svgNS, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    (parent || svg).appendChild(el);
    return el;
  };
  ranks.forEach((r, i) => {
    const y = TOP + i * LANE;
    add('text', {x: 4, y: y + 16}).textContent = names[r] || ('rank ' + r);
    add('text', {x: 4, y: y + 31, fill: '#555'}).textContent =
        'compute ' + Math.round(100 * busy[r] / end) + '%';
    add('rect', {x: LEFT, y: y, width: width, height: 18, fill: '#eee'});
    add('rect', {x: LEFT, y: y + 21, width: width, height: 13, fill: '#f6f6f6'});
    add('rect', {x: LEFT, y: y + 36, width: width, height: 13, fill: '#f6f6f6'});
    add('text', {x: LEFT - 6, y: y + 31, 'text-anchor': 'end', fill: '#777'}).textContent = 'collectives';
    add('text', {x: LEFT - 6, y: y + 46, 'text-anchor': 'end', fill: '#777'}).textContent = 'send / recv';
  });
  // Steps first, then recomputations and communication over them.
  const order = {forward: 0, backward: 0, recompute: 1, comm: 2};
  for (const s of [...slices].sort((a, b) => order[a.cat] - order[b.cat])) {
    const y = TOP + row[s.tid] * LANE;
    const top = s.cat === 'comm' ? y + (p2p(s) ? 36 : 21) : s.cat === 'recompute' ? y + 11 : y;
    const height = s.cat === 'comm' ? 13 : s.cat === 'recompute' ? 7 : 18;
    const g = add('g', {class: 'slice ' + s.cat});
    const w = Math.max(x(s.ts + s.dur) - x(s.ts), 0.5);
    // Sends last from their posting to their wait and overlap: translucent, so that
    // overlapping ones show darker.
    add('rect', {x: x(s.ts), y: top, width: w, height: height, fill: colour(s),
                 'fill-opacity': p2p(s) ? 0.45 : 1, stroke: '#333', 'stroke-width': 0.3}, g);
    if (s.cat !== 'comm' && s.cat !== 'recompute' && w > 26) {
      add('text', {x: x(s.ts) + w / 2, y: y + 13, 'text-anchor': 'middle'}, g).textContent = s.name;
    }
    const args = Object.entries(s.args || {}).map(([k, v]) => k + ': ' + v).join(', ');
    add('title', {}, g).textContent = (names[s.tid] || 'rank ' + s.tid) + ': ' + s.name + ', ' +
        (s.ts / 1000).toFixed(3) + ' to ' + ((s.ts + s.dur) / 1000).toFixed(3) + ' ms' +
        (args ? ' (' + args + ')' : '');
  }
  // Ten ticks, with as many decimals as tell them apart.
  const y = TOP + ranks.length * LANE + 16;
  const digits = Math.max(0, Math.min(6, Math.ceil(-Math.log10(end / 10000)) + 1));
  for (let k = 0; k <= 10; ++k) {
    add('text', {x: x(end * k / 10), y: y, 'text-anchor': 'middle'}).textContent =
        (end * k / 10000).toFixed(digits) + ' ms';
  }
  const box = document.getElementById('timeline');
  box.replaceChildren(svg);
}
document.getElementById('summary').textContent =
    ranks.length + ' ranks, ' + slices.length + ' slices over ' + (end / 1000).toFixed(3) + ' ms';
document.getElementById('zoom').addEventListener('change', draw);
draw();
)JS";

constexpr const char* kStyle = R"CSS(
body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; }
#timeline { overflow-x: auto; border: 1px solid #ccc; }
.legend span { display: inline-block; padding: 1px 6px; margin-right: 6px; border: 1px solid #999; }
)CSS";

}  // namespace

std::string TracePageHtml(const nlohmann::ordered_json& trace, const std::string& title) {
  return fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<title>mpusim trace: {0}</title>\n<style>{1}</style>\n</head>\n<body>\n"
      "<h1>mpusim trace of {0}: the last step</h1>\n"
      "<p><span id=\"summary\"></span>. A row per rank, with the share of the step it spent "
      "in forward and backward steps: its forward (light) and backward (dark) steps coloured "
      "by micro-batch, a recomputation as a band inside its backward "
      "step, and below them its collectives and its sends and receives (each from its "
      "posting to the end of the wait for it). Hover a slice for its details. zoom: <select "
      "id=\"zoom\"><option value=\"1\">1x</option><option "
      "value=\"2\">2x</option><option value=\"4\">4x</option><option value=\"8\">8x</option>"
      "<option value=\"16\">16x</option></select></p>\n"
      "<p class=\"legend\"><span style=\"background:#d9534f\">all-reduce</span><span "
      "style=\"background:#5cb85c\">all-gather</span><span "
      "style=\"background:#428bca\">reduce-scatter</span><span "
      "style=\"background:#f0ad4e\">send / recv</span><span "
      "style=\"background:#9b59b6\">broadcast</span></p>\n"
      "<div id=\"timeline\"></div>\n"
      "<script id=\"trace\" type=\"application/json\">{2}</script>\n"
      "<script>{3}</script>\n</body>\n</html>\n",
      HtmlEscape(title), kStyle, JsonForScript(trace.dump()), kScript);
}

}  // namespace mpusim::run
