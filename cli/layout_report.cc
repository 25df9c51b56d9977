// Layout rendering (see layout_report.h).
#include "cli/layout_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <sstream>

#include "cli/estimate_report.h"
#include "core/html.h"
#include "core/pipeline/pipeline_plan.h"
#include "core/schedule.h"

namespace mpusim::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

constexpr size_t kLineWidth = 100;

// "<count> <kind> groups (<title>):", in the MPU lab's wording for its three kinds.
std::string KindHeading(const Topology& topology, size_t kind) {
  const GroupKind& info = topology.kinds()[kind];
  const int64_t count = topology.NumGroups(kind);
  if (info.name == "dp") return fmt::format("{} data_parallel groups:", count);
  if (info.name == "tp") return fmt::format("{} tensor model-parallel groups:", count);
  if (info.name == "pp") return fmt::format("{} pipeline model-parallel groups:", count);
  return fmt::format("{} {} groups ({}):", count, info.name, info.title);
}

// "[g0, g2], [g1, g3], ..." wrapped at kLineWidth, each line indented by 4.
void PrintGroupList(const Topology& topology, size_t kind, int64_t max_groups,
                    std::ostream& out) {
  const int64_t groups = topology.NumGroups(kind);
  const int64_t shown = max_groups > 0 ? std::min(groups, max_groups) : groups;
  std::string line = "   ";
  for (int64_t g = 0; g < shown; ++g) {
    std::string item = "[";
    const std::vector<int64_t> ranks = topology.Group(kind, g);
    for (size_t k = 0; k < ranks.size(); ++k) {
      item += fmt::format("{}g{}", k == 0 ? "" : ", ", ranks[k]);
    }
    item += g + 1 < groups ? "]," : "]";
    if (line.size() + 1 + item.size() > kLineWidth && line.size() > 3) {
      out << line << '\n';
      line = "   ";
    }
    line += " " + item;
  }
  if (shown < groups) {
    line += fmt::format(" ... {} more (--max-groups 0 shows all)", groups - shown);
  }
  out << line << '\n';
}

std::string OptionalText(const std::optional<int64_t>& v) {
  return v ? std::to_string(*v) : "-";
}

int64_t NumNodes(const Topology& topology) {
  const int64_t first = topology.NodeOf(topology.first_rank());
  const int64_t last = topology.NodeOf(topology.first_rank() + topology.world_size() - 1);
  return last - first + 1;
}

ordered_json SizesJson(const Topology& topology) {
  const DerivedSizes& s = topology.sizes();
  ordered_json j;
  j["tp"] = s.tp;
  j["pp"] = s.pp;
  j["cp"] = s.cp;
  j["dp"] = s.dp;
  j["vp"] = s.vp ? ordered_json(*s.vp) : ordered_json(nullptr);
  j["ep"] = s.ep;
  j["etp"] = s.etp;
  j["edp"] = s.edp;
  j["num_distributed_optimizer_instances"] = s.num_distributed_optimizer_instances;
  return j;
}

// The layer assignment, when the config sets num_layers; null otherwise.
ordered_json LayersJson(const Topology& topology) {
  const ParallelConfig& c = topology.config();
  if (!c.num_layers) return nullptr;
  auto layers = AssignLayers(c.pipeline_model_parallel_size,
                             c.virtual_pipeline_model_parallel_size, *c.num_layers);
  if (!layers.ok()) return nullptr;
  ordered_json j;
  j["num_layers"] = *c.num_layers;
  j["per_pp_rank"] = *layers;
  return j;
}

}  // namespace

std::vector<size_t> DefaultTextKindOrder(const Topology& topology) {
  std::vector<size_t> order;
  for (const char* name : {"dp", "tp", "pp"}) order.push_back(*topology.FindKind(name));
  for (size_t i = 0; i < topology.kinds().size(); ++i) {
    if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
  }
  return order;
}

// The kinds whose groups leaving a node are worth a warning: tp, expt_tp and ep, less
// expt_tp when its groups are tp's (the dense expert layout, ep = 1 and etp = tp: one
// warning for the same groups is enough).
// A direct kind's groups are fixed by its size and its generator's stride (the group of rank
// r is r's run of `size` ranks `stride` apart), so the comparison is O(1) at any world size.
std::vector<const char*> NodeWarningKinds(const Topology& topology) {
  const DerivedSizes& s = topology.sizes();
  const bool same =
      s.etp == s.tp && topology.dense().Stride(Axis::kTp) == topology.expert().Stride(Axis::kTp);
  if (same) return {"tp", "ep"};
  return {"tp", "expt_tp", "ep"};
}

std::vector<std::string> NodeWarnings(const Topology& topology) {
  std::vector<std::string> warnings;
  const int64_t gpus = topology.config().gpus_per_node;
  for (const char* name : NodeWarningKinds(topology)) {
    const size_t kind = *topology.FindKind(name);
    const int64_t spanning = topology.NumGroupsSpanningNodes(kind);
    if (spanning == 0) continue;
    warnings.push_back(fmt::format(
        "{} of {} {} groups (size {}) span nodes with gpus_per_node {}: their collectives "
        "would cross the inter-node network; keep {} groups inside a node",
        spanning, topology.NumGroups(kind), name, topology.GroupSize(kind), gpus, name));
  }
  return warnings;
}

std::vector<std::string> RankNodeWarnings(const Topology& topology, int64_t rank) {
  std::vector<std::string> warnings;
  const int64_t gpus = topology.config().gpus_per_node;
  for (const char* name : NodeWarningKinds(topology)) {
    const size_t kind = *topology.FindKind(name);
    const std::optional<GroupSlot> slot = topology.Locate(kind, rank);
    if (!slot || !topology.GroupSpansNodes(kind, slot->group_index)) continue;
    warnings.push_back(fmt::format(
        "rank {}'s {} group (size {}) spans nodes with gpus_per_node {}: its collectives would "
        "cross the inter-node network; keep {} groups inside a node",
        rank, name, topology.GroupSize(kind), gpus, name));
  }
  return warnings;
}

void PrintLayoutText(const Topology& topology, const LayoutReportOptions& options,
                     std::ostream& out) {
  const ParallelConfig& c = topology.config();
  const DerivedSizes& s = topology.sizes();
  const int64_t n = topology.world_size();
  out << fmt::format("layout of {}: world_size {}, order {}", options.source, n, c.order);
  if (c.rank_offset != 0) {
    out << fmt::format(", ranks {}..{}", c.rank_offset, c.rank_offset + n - 1);
  }
  out << '\n';
  const auto row = [&out](std::string_view key, const std::string& value,
                          const std::string& note = "") {
    out << fmt::format("  {:<38}{:>6}{}\n", key, value, note.empty() ? "" : "   " + note);
  };
  row(ParallelKey(&ParallelConfig::tensor_model_parallel_size), std::to_string(s.tp));
  row("pipeline_model_parallel_size", std::to_string(s.pp));
  row("virtual_pipeline_model_parallel_size", OptionalText(s.vp));
  row(ParallelKey(&ParallelConfig::context_parallel_size), std::to_string(s.cp));
  row("data_parallel_size", std::to_string(s.dp),
      fmt::format("derived: {} / (tp {} * pp {} * cp {})", n, s.tp, s.pp, s.cp));
  row("expert_model_parallel_size", std::to_string(s.ep));
  row("expert_tensor_parallel_size", std::to_string(s.etp),
      c.expert_tensor_parallel_size ? "" : "default: tensor_model_parallel_size");
  row("expert_data_parallel_size", std::to_string(s.edp),
      fmt::format("derived: {} / (etp {} * ep {} * pp {})", n, s.etp, s.ep, s.pp));
  row("num_distributed_optimizer_instances", std::to_string(s.num_distributed_optimizer_instances));
  if (!c.hierarchical_context_parallel_sizes.empty()) {
    row("hierarchical_context_parallel_sizes",
        fmt::format("[{}]", fmt::join(c.hierarchical_context_parallel_sizes, ", ")));
  }
  row("gpus_per_node", std::to_string(c.gpus_per_node), fmt::format("{} node{}", NumNodes(topology), NumNodes(topology) == 1 ? "" : "s"));

  const size_t mp = *topology.FindKind("mp");
  for (size_t kind : options.kinds) {
    out << '\n';
    if (kind == mp) {
      // The MPU lab's wording: one line per model-parallel group.
      const int64_t groups = topology.NumGroups(mp);
      out << fmt::format("Total :{} full models being partitioned into :{} GPUs  (mp groups: "
                         "tensor x pipeline)\n",
                         groups, n);
      const int64_t shown =
          options.max_groups > 0 ? std::min(groups, options.max_groups) : groups;
      for (int64_t g = 0; g < shown; ++g) {
        out << fmt::format("model {} : is partitioned into gpus :{}\n", g,
                           fmt::join(topology.Group(mp, g), ","));
      }
      if (shown < groups) {
        out << fmt::format("... {} more (--max-groups 0 shows all)\n", groups - shown);
      }
      continue;
    }
    out << KindHeading(topology, kind) << '\n';
    PrintGroupList(topology, kind, options.max_groups, out);
  }

  out << fmt::format("\nnode map: {} node{} of {} GPUs; rank r is on node r / {}\n",
                     NumNodes(topology), NumNodes(topology) == 1 ? "" : "s", c.gpus_per_node,
                     c.gpus_per_node);
  std::vector<std::string> spanning;
  std::vector<std::string> local;
  for (size_t kind : options.kinds) {
    const int64_t count = topology.NumGroupsSpanningNodes(kind);
    const std::string& name = topology.kinds()[kind].name;
    if (count > 0) {
      spanning.push_back(fmt::format("{} {}/{}", name, count, topology.NumGroups(kind)));
    } else {
      local.push_back(name);
    }
  }
  out << fmt::format("  groups that span nodes:   {}\n",
                     spanning.empty() ? "none" : fmt::format("{}", fmt::join(spanning, ", ")));
  out << fmt::format("  groups inside one node:   {}\n",
                     local.empty() ? "none" : fmt::format("{}", fmt::join(local, ", ")));

  if (c.num_layers) {
    auto layers = AssignLayers(c.pipeline_model_parallel_size,
                               c.virtual_pipeline_model_parallel_size, *c.num_layers);
    out << fmt::format("\nlayer assignment ({} layers", *c.num_layers);
    if (!layers.ok()) {
      out << fmt::format("): not possible: {}\n", layers.status().Message());
    } else {
      out << (s.vp ? fmt::format(", {} model chunks per pipeline rank", *s.vp) : "")
          << "; numbered from 1 as Megatron's layer_number: layer n is decoder.layers.<n-1> "
             "in the state dict and in mpusim explain):\n";
      for (size_t r = 0; r < layers->size(); ++r) {
        out << fmt::format("  pp rank {}:", r);
        for (const auto& chunk : (*layers)[r]) out << fmt::format(" [{}]", fmt::join(chunk, ", "));
        out << '\n';
      }
    }
  }
}

void PrintLayoutJson(const Topology& topology, const LayoutReportOptions& options,
                     std::ostream& out) {
  const ParallelConfig& c = topology.config();
  ordered_json head;
  head["schema_version"] = 1;
  head["source"] = options.source;
  head["world_size"] = topology.world_size();
  head["rank_offset"] = c.rank_offset;
  head["order"] = c.order;
  head["sizes"] = SizesJson(topology);
  nlohmann::json config;
  ToJson(c, &config);
  head["config"] = config;
  ordered_json nodes;
  nodes["gpus_per_node"] = c.gpus_per_node;
  nodes["num_nodes"] = NumNodes(topology);
  ordered_json spanning = ordered_json::object();
  for (size_t kind : options.kinds) {
    spanning[topology.kinds()[kind].name] = topology.NumGroupsSpanningNodes(kind);
  }
  nodes["groups_spanning_nodes"] = spanning;
  head["nodes"] = nodes;
  head["layers"] = LayersJson(topology);
  head["warnings"] = NodeWarnings(topology);

  // Write the small fields through nlohmann, then stream the groups.
  std::string text = head.dump(1);
  text.pop_back();  // the closing '}'
  while (!text.empty() && text.back() == '\n') text.pop_back();
  out << text << ",\n \"groups\": {";
  std::vector<int32_t> flat;
  std::string buffer;
  for (size_t i = 0; i < options.kinds.size(); ++i) {
    const size_t kind = options.kinds[i];
    topology.Enumerate(kind, &flat);
    const size_t size = static_cast<size_t>(topology.GroupSize(kind));
    buffer.clear();
    buffer += fmt::format("{}\n  \"{}\": [", i == 0 ? "" : ",", topology.kinds()[kind].name);
    for (size_t start = 0; start < flat.size(); start += size) {
      buffer += start == 0 ? "[" : ", [";
      for (size_t k = 0; k < size; ++k) {
        if (k > 0) buffer += ", ";
        buffer += std::to_string(flat[start + k]);
      }
      buffer += ']';
      if (buffer.size() > (1u << 20)) {
        out << buffer;
        buffer.clear();
      }
    }
    buffer += ']';
    out << buffer;
  }
  out << "\n }\n}\n";
}

namespace {

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

void PrintLayoutPicture(const Topology& topology, std::ostream& out) {
  const ParallelConfig& c = topology.config();
  const DerivedSizes& s = topology.sizes();
  struct Column {
    const char* label;
    int64_t size;
    int64_t RankCoordinates::*coord;
  };
  // Expert coordinates are shown only when the expert layout differs from the dense one.
  const bool expert_differs = s.ep > 1 || s.etp != s.tp;
  std::vector<Column> columns;
  for (const Column& col : {Column{"tp", s.tp, &RankCoordinates::tp},
                            Column{"cp", s.cp, &RankCoordinates::cp},
                            Column{"dp", s.dp, &RankCoordinates::dp},
                            Column{"pp", s.pp, &RankCoordinates::pp}}) {
    if (col.size > 1) columns.push_back(col);
  }
  if (expert_differs) {
    for (const Column& col : {Column{"ep", s.ep, &RankCoordinates::ep},
                              Column{"etp", s.etp, &RankCoordinates::etp},
                              Column{"edp", s.edp, &RankCoordinates::edp}}) {
      if (col.size > 1) columns.push_back(col);
    }
  }
  std::vector<std::string> labels;
  for (const Column& col : columns) labels.push_back(col.label);
  out << fmt::format("picture: one row per node, one cell per GPU: g<rank> then {}\n",
                     columns.empty() ? std::string("(every axis has size 1)")
                                     : fmt::format("{}", fmt::join(labels, " ")));
  const int64_t first = topology.first_rank();
  const int64_t last = first + topology.world_size() - 1;
  std::vector<std::string> cells;
  size_t width = 0;
  for (int64_t rank = first; rank <= last; ++rank) {
    const RankCoordinates coords = topology.Coordinates(rank);
    std::string cell = fmt::format("g{}", rank);
    for (const Column& col : columns) cell += fmt::format(" {}{}", col.label, coords.*col.coord);
    width = std::max(width, cell.size());
    cells.push_back(std::move(cell));
  }
  const int64_t gpus = c.gpus_per_node;
  for (int64_t node = topology.NodeOf(first); node <= topology.NodeOf(last); ++node) {
    std::string line = fmt::format("node {:>3} |", node);
    for (int64_t local = 0; local < gpus; ++local) {
      const int64_t rank = node * gpus + local;
      const std::string cell =
          rank < first || rank > last ? std::string() : cells[static_cast<size_t>(rank - first)];
      line += fmt::format(" {:<{}} |", cell, width);
    }
    out << line << '\n';
  }
}

void PrintRankText(const Topology& topology, int64_t rank, const LayoutReportOptions& options,
                   std::ostream& out) {
  const RankCoordinates coords = topology.Coordinates(rank);
  const DerivedSizes& s = topology.sizes();
  out << fmt::format("rank {}: node {}, local GPU {}\n", rank, coords.node, coords.local_rank);
  out << fmt::format("  coordinates:        tp {}/{}  cp {}/{}  dp {}/{}  pp {}/{}\n", coords.tp,
                     s.tp, coords.cp, s.cp, coords.dp, s.dp, coords.pp, s.pp);
  out << fmt::format("  expert coordinates: etp {}/{}  ep {}/{}  edp {}/{}  pp {}/{}\n",
                     coords.etp, s.etp, coords.ep, s.ep, coords.edp, s.edp, coords.pp, s.pp);
  const ParallelConfig& c = topology.config();
  if (c.num_layers) {
    auto layers = AssignLayers(c.pipeline_model_parallel_size,
                               c.virtual_pipeline_model_parallel_size, *c.num_layers);
    if (layers.ok()) {
      out << "  layers:            ";
      for (const auto& chunk : (*layers)[static_cast<size_t>(coords.pp)]) {
        out << fmt::format(" [{}]", fmt::join(chunk, ", "));
      }
      out << '\n';
    }
  }
  out << "  groups (index of the group among its kind, position of this rank in it):\n";
  constexpr size_t kMaxMembersShown = 32;
  for (size_t kind : options.kinds) {
    const GroupKind& info = topology.kinds()[kind];
    const std::optional<GroupSlot> slot = topology.Locate(kind, rank);
    if (!slot) {
      out << fmt::format("    {:<16} -  (this rank has no {} group)\n", info.name, info.name);
      continue;
    }
    const int64_t size = topology.GroupSize(kind);
    std::vector<int64_t> members;
    for (int64_t k = 0; k < size && members.size() < kMaxMembersShown; ++k) {
      members.push_back(topology.Member(kind, slot->group_index, k));
    }
    out << fmt::format("    {:<16} group {} of {}, position {} of {}: [{}{}]\n", info.name,
                       slot->group_index, topology.NumGroups(kind), slot->rank_in_group, size,
                       fmt::join(members, ", "),
                       static_cast<size_t>(size) > members.size() ? ", ..." : "");
  }
}

void PrintRankJson(const Topology& topology, int64_t rank, const LayoutReportOptions& options,
                   std::ostream& out) {
  const RankCoordinates coords = topology.Coordinates(rank);
  ordered_json j;
  j["schema_version"] = 1;
  j["source"] = options.source;
  j["world_size"] = topology.world_size();
  j["rank"] = rank;
  j["node"] = coords.node;
  j["local_rank"] = coords.local_rank;
  j["sizes"] = SizesJson(topology);
  j["coordinates"] = {{"tp", coords.tp}, {"cp", coords.cp},   {"dp", coords.dp},
                      {"pp", coords.pp}, {"etp", coords.etp}, {"ep", coords.ep},
                      {"edp", coords.edp}};
  ordered_json groups = ordered_json::object();
  for (size_t kind : options.kinds) {
    const std::optional<GroupSlot> slot = topology.Locate(kind, rank);
    if (!slot) {
      groups[topology.kinds()[kind].name] = nullptr;
      continue;
    }
    // Groups larger than a whole listing would cover keep their size but not their members.
    const int64_t size = topology.GroupSize(kind);
    groups[topology.kinds()[kind].name] = {
        {"group_index", slot->group_index},
        {"rank_in_group", slot->rank_in_group},
        {"group_size", size},
        {"ranks", size <= kMaxListedRanks ? ordered_json(topology.Group(kind, slot->group_index))
                                          : ordered_json(nullptr)}};
  }
  j["groups"] = groups;
  out << j.dump(1) << '\n';
}

}  // namespace mpusim::cli
