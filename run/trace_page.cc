// The self-contained timeline page of a Chrome trace (see trace_page.h).
#include "run/trace_page.h"

#include <fmt/format.h>

#include "core/html.h"

namespace mpusim::run {
namespace {

// Draws the trace's events as SVG rectangles: a row per rank of three lines, its steps
// (recomputations as a band inside their backward step; tid r), its collectives (tid W + r)
// and its sends and receives (tid 2W + r: each message in flight from its posting to the end
// of its wait as a thin translucent bar, the wait, when the rank was blocked, solid), and its
// share of the step in forward and backward steps; W is otherData.ranks (run/report.cc
// WriteTrace). Micro-batches get hues a golden angle apart; collectives and send / recv waits
// are coloured by the kind of group they ran on, with a legend of the kinds present. Plain DOM,
// no libraries.
constexpr const char* kScript = R"JS(
const T = JSON.parse(document.getElementById('trace').textContent);
const W = T.otherData.ranks;
const names = {}, slices = [], flights = [], opened = {};
for (const e of T.traceEvents) {
  if (e.ph === 'M' && e.name === 'thread_name' && e.tid < W) names[e.tid] = e.args.name;
  if (e.ph === 'X') slices.push(e);
  if (e.ph === 'b') opened[e.id] = e;
  if (e.ph === 'e' && opened[e.id]) {
    flights.push({name: e.name, tid: e.tid, ts: opened[e.id].ts, dur: e.ts - opened[e.id].ts});
  }
}
const rankOf = tid => tid % W;
const ranks = [...Array(W).keys()];
let end = 0;
const busy = {};  // rank -> time in forward and backward steps (recomputations lie inside)
for (const r of ranks) busy[r] = 0;
for (const s of slices.concat(flights)) {
  end = Math.max(end, s.ts + s.dur);
  if (s.cat === 'forward' || s.cat === 'backward') busy[rankOf(s.tid)] += s.dur;
}
const steps = slices.filter(s => s.cat === 'forward' || s.cat === 'backward' || s.cat === 'recompute');
const microbatches = 1 + Math.max(0, ...steps.map(s => s.args.microbatch));
const hue = m => Math.round(m * 137.508) % 360;
// Collectives and waits by the kind of group they ran on (the op is in the tooltip): the tensor-,
// context-, expert- and data-parallel families, the pipeline and the tied embeddings.
const groupKinds = [
  ['tensor parallel (tp)', '#1f5fae', g => g === 'tp'],
  ['context parallel (cp, hcp)', '#2e8b3d', g => g === 'cp' || g.startsWith('hcp') || g === 'tp_cp'],
  ['experts (ep, etp, tp_ep)', '#d0661a', g => g === 'ep' || g === 'etp' || g.startsWith('expt_tp') || g === 'tp_ep'],
  ['data parallel (dp, dp_cp, expt_dp, dist. optimizer)', '#7a3ea3',
   g => g.startsWith('dp') || g.startsWith('expt_dp') || g.endsWith('dist_opt')],
  ['pipeline (pp)', '#8b5a2b', g => g === 'pp'],
  ['embeddings (embd, position_embedding)', '#b0306e', g => g === 'embd' || g === 'position_embedding'],
];
const groupOf = s => (s.args && s.args.group) || s.name.split(' ').slice(-1)[0];
function groupColour(g) {
  for (const [, c, test] of groupKinds) if (test(g)) return c;
  return '#777';
}
function colour(s) {
  if (s.cat === 'comm' || s.cat === 'p2p wait') return groupColour(groupOf(s));
  const h = hue(s.args.microbatch);
  if (s.cat === 'recompute') return 'hsl(' + h + ', 30%, 35%)';
  return 'hsl(' + h + ', ' + (s.cat === 'forward' ? '70%, 72%' : '60%, 45%') + ')';
}
const line = s => s.cat === 'comm' ? 1 : s.cat === 'p2p wait' ? 2 : 0;
const LEFT = 190, LANE = 58, TOP = 10;
const svgNS = 'http://www.w3.org/2000/svg';
function legend() {
  const box = document.getElementById('microbatches');
  box.replaceChildren();
  for (let m = 0; m < microbatches; ++m) {
    for (const [cat, label] of [['forward', 'F'], ['backward', 'B']]) {
      const span = document.createElement('span');
      span.style.background = colour({cat: cat, args: {microbatch: m}});
      span.textContent = label + ' mb ' + m;
      box.appendChild(span);
    }
  }
  const r = document.createElement('span');
  r.style.background = colour({cat: 'recompute', args: {microbatch: 0}});
  r.style.color = '#fff';
  r.textContent = 'recomputation (band, shaded by micro-batch)';
  box.appendChild(r);  // The group kinds this trace has, in their colours.
  const groups = document.getElementById('groups');
  groups.replaceChildren('collectives and send / recv waits by group: ');
  const present = new Set(slices.filter(s => s.cat === 'comm' || s.cat === 'p2p wait').map(groupOf));
  for (const [label, c, test] of groupKinds.concat([['other', '#777', g => true]])) {
    const names = [...present].filter(g => test(g));
    names.forEach(g => present.delete(g));
    if (names.length === 0) continue;
    const span = document.createElement('span');
    span.style.background = c;
    span.style.color = '#fff';
    span.textContent = label + ': ' + names.sort().join(', ');
    groups.appendChild(span);
  }
  const flight = document.createElement('span');
  flight.style.background = 'rgba(136,136,136,0.35)';
  flight.textContent = 'a message in flight';
  groups.appendChild(flight);
}
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
  // Messages in flight: a thin translucent bar each (they overlap), under the waits.
  for (const f of flights) {
    const y = TOP + rankOf(f.tid) * LANE + 36;
    const g = add('g', {class: 'flight'});
    add('rect', {x: x(f.ts), y: y + 9, width: Math.max(x(f.ts + f.dur) - x(f.ts), 0.5), height: 4,
                 fill: '#888', 'fill-opacity': 0.35}, g);
    add('title', {}, g).textContent = 'rank ' + rankOf(f.tid) + ': ' + f.name + ' in flight, ' +
        (f.ts / 1000).toFixed(3) + ' to ' + ((f.ts + f.dur) / 1000).toFixed(3) + ' ms';
  }
  // Steps first, then recomputations and communication over them.
  const order = {forward: 0, backward: 0, recompute: 1, comm: 2, 'p2p wait': 2};
  for (const s of [...slices].sort((a, b) => order[a.cat] - order[b.cat])) {
    const rank = rankOf(s.tid);
    const y = TOP + rank * LANE;
    const top = [s.cat === 'recompute' ? y + 11 : y, y + 21, y + 36][line(s)];
    const height = line(s) > 0 ? (line(s) === 2 ? 9 : 13) : s.cat === 'recompute' ? 7 : 18;
    const g = add('g', {class: 'slice ' + s.cat.replace(' ', '-')});
    const w = Math.max(x(s.ts + s.dur) - x(s.ts), 0.5);
    add('rect', {x: x(s.ts), y: top, width: w, height: height, fill: colour(s),
                 stroke: '#333', 'stroke-width': 0.3}, g);
    if (line(s) === 0 && s.cat !== 'recompute' && w > 26) {
      add('text', {x: x(s.ts) + w / 2, y: y + 13, 'text-anchor': 'middle'}, g).textContent = s.name;
    }
    const args = Object.entries(s.args || {}).map(([k, v]) => k + ': ' + v).join(', ');
    add('title', {}, g).textContent = (names[rank] || 'rank ' + rank) + ': ' + s.name +
        (s.cat === 'p2p wait' ? ' (waiting)' : '') + ', ' +
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
legend();
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
      "step, and below them its collectives and its sends and receives: a message in flight "
      "from its posting to the end of the wait for it as a thin bar, the wait itself (the "
      "rank blocked) solid. Hover a slice for its details. zoom: <select "
      "id=\"zoom\"><option value=\"1\">1x</option><option "
      "value=\"2\">2x</option><option value=\"4\">4x</option><option value=\"8\">8x</option>"
      "<option value=\"16\">16x</option></select></p>\n"
      "<p class=\"legend\" id=\"groups\"></p>\n"
      "<p class=\"legend\" id=\"microbatches\"></p>\n"
      "<div id=\"timeline\"></div>\n"
      "<script id=\"trace\" type=\"application/json\">{2}</script>\n"
      "<script>{3}</script>\n</body>\n</html>\n",
      HtmlEscape(title), kStyle, JsonForScript(trace.dump()), kScript);
}

}  // namespace mpusim::run
