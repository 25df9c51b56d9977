// What rank 0 prints of a run, and its --summary and --trace files (see report.h).
#include "run/report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>

#include "core/config/model_facts.h"
#include "core/dump/safetensors.h"
#include "core/schedule.h"
#include "mpi/watchdog.h"
#include "run/preflight.h"
#include "run/trace_page.h"

namespace mpusim::run {
namespace {

// A "<Key>: <n> kB" line of a /proc file, in bytes; 0 when the file or the key is not there.
int64_t ProcKilobytes(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + key.size()) * 1024;
  }
  return 0;
}

std::string RecomputeNote(const RunConfig& run) {
  return run.recompute == RunConfig::Recompute::kNone ? "" : ", recompute " + RecomputeSummary(run);
}

struct CommSummaryKey {
  Phase phase;
  std::string site;
  CommOpKind op;
  std::string group;
  bool operator<(const CommSummaryKey& o) const {
    return std::tie(phase, site, op, group) < std::tie(o.phase, o.site, o.op, o.group);
  }
};

// An MoE model's line under an iteration's row: per MoE layer the fewest and the most
// tokens an expert kept (the iteration's micro-batches, summed over the stage's tp x dp x
// cp ranks) and, with the expert bias, its range after the update. Four layers at most;
// --summary has every layer and expert.
std::string ExpertLoadLine(const std::vector<ExpertLoad>& layers) {
  constexpr size_t kShown = 4;
  std::string tokens, bias;
  for (size_t i = 0; i < layers.size() && i < kShown; ++i) {
    const ExpertLoad& l = layers[i];
    const auto [few, most] = std::minmax_element(l.tokens.begin(), l.tokens.end());
    tokens += fmt::format(" L{} {}-{}", l.layer, *few, *most);
    if (!l.bias.empty()) {
      const auto [low, high] = std::minmax_element(l.bias.begin(), l.bias.end());
      bias += fmt::format(" L{} {:+.4f}..{:+.4f}", l.layer, *low, *high);
    }
  }
  const std::string more =
      layers.size() > kShown ? fmt::format(" (+{} layers)", layers.size() - kShown) : "";
  return fmt::format("  {:>9} tokens per expert, min-max:{}{}{}\n", "", tokens,
                     bias.empty() ? "" : ";  expert bias:" + bias, more);
}

}  // namespace

void RunReport::PrintLayout(const Topology& topology, const SimulationResult& result) {
  const DerivedSizes& s = topology.sizes();
  const RunConfig& run = *config_.run;
  out_ << fmt::format("mpusim run: {} on {} ranks ({} backend, {}, seed {})\n",
                      options_.config_path, world_size_, backend_name_, DTypeName(run.dtype),
                      run.seed);
  out_ << fmt::format("backend: {}\n", backend_description_);
  out_ << fmt::format(
      "layout: tensor_model_parallel_size {}, data_parallel_size {}, "
      "sequence_parallel {}{}{}{}{}\n",
      s.tp, s.dp, config_.parallel.sequence_parallel,
      s.cp > 1 ? fmt::format(", context_parallel_size {}", s.cp) : std::string(),
      s.ep > 1 ? fmt::format(", expert_model_parallel_size {}", s.ep) : std::string(),
      s.etp != s.tp ? fmt::format(", expert_tensor_parallel_size {}", s.etp) : std::string(),
      s.pp > 1 ? fmt::format(", pipeline_model_parallel_size {}{}", s.pp,
                             s.vp ? fmt::format(", virtual_pipeline_model_"
                                                "parallel_size {}",
                                                *s.vp)
                                  : std::string())
               : std::string());
  std::vector<const char*> kinds = {"tp", "dp"};
  if (s.cp > 1) kinds.insert(kinds.end(), {"cp", "dp_cp"});
  if (s.pp > 1) kinds.push_back("pp");
  if (s.ep > 1) kinds.push_back("ep");
  if (s.experts_apart()) kinds.insert(kinds.end(), {"expt_tp", "tp_ep", "expt_dp"});
  if (config_.optimizer && config_.optimizer->use_distributed_optimizer) {
    kinds.push_back("dp_cp_partial");
    if (s.experts_apart() && s.num_distributed_optimizer_instances > 1) {
      kinds.push_back("expt_dp_partial");
    }
    if (s.num_distributed_optimizer_instances > 1) kinds.push_back("inter_dist_opt");
  }
  for (const char* kind : kinds) {
    const size_t k = *topology.FindKind(kind);
    std::vector<std::string> groups;
    for (int64_t g = 0; g < std::min<int64_t>(topology.NumGroups(k), 8); ++g) {
      groups.push_back(fmt::format("[{}]", fmt::join(topology.Group(k, g), ", ")));
    }
    out_ << fmt::format("  {} groups: {}{}\n", kind, fmt::join(groups, " "),
                        topology.NumGroups(k) > 8 ? " ..." : "");
  }
  out_ << fmt::format(
      "data: seq_length {}, micro_batch_size {} per dp rank ({} in all), "
      "num_microbatches {}{}\n",
      run.seq_length, run.micro_batch_size, run.micro_batch_size * s.dp, run.num_microbatches,
      RecomputeNote(run));
  if (s.cp > 1) {
    // Megatron's load-balanced split: cp rank r holds chunks r and 2 cp - 1 - r.
    const int64_t c = run.seq_length / (2 * s.cp);
    const std::optional<CpCommType> cp_comm_type = FactsOf(config_).cp_comm_type;
    std::vector<std::string> held;
    for (int64_t r = 0; r < s.cp; ++r) {
      const int64_t second = 2 * s.cp - 1 - r;
      held.push_back(fmt::format("{}: {}-{} and {}-{}", r, r * c, r * c + c - 1, second * c,
                                 second * c + c - 1));
    }
    out_ << fmt::format("context parallel: cp_comm_type \"{}\"; the sequence in {} chunks of {} "
                        "positions, cp rank r holding chunks r and {} - r (positions by cp "
                        "rank: {})\n",
                        cp_comm_type ? CpCommTypeName(*cp_comm_type) : "none",
                        2 * s.cp, c, 2 * s.cp - 1, fmt::join(held, "; "));
  }
  if (s.pp > 1) {
    StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(
        s.pp, s.vp, run.num_microbatches, config_.parallel.microbatch_group_size_per_vp_stage);
    if (schedule.ok()) {
      out_ << fmt::format(
          "pipeline: {} schedule; rank 0 (stage 0) runs {} (`mpusim schedule` "
          "shows every stage); at most {} micro-batch stash{} live on rank 0\n",
          schedule->interleaved ? "interleaved 1F1B" : "1F1B", FormatRank(*schedule, 0),
          result.peak_stashes, result.peak_stashes == 1 ? "" : "es");
      PrintStages(result, *schedule);
    }
  }
  out_ << result.model_description;
}

void RunReport::PrintLoss(const SimulationResult& result) {
  if (result.has_loss) out_ << fmt::format("\nloss {:.9g}\n", result.loss);
  if (options_.repeat > 1) {
    std::vector<double> sorted = result.seconds;
    std::sort(sorted.begin(), sorted.end());
    const size_t mid = sorted.size() / 2;
    const double median =
        sorted.size() % 2 == 1 ? sorted[mid] : 0.5 * (sorted[mid - 1] + sorted[mid]);
    out_ << fmt::format("time per step (forward + backward, all micro-batches): median {:.4f} s "
                        "over {} runs, min {:.4f} s, max {:.4f} s\n",
                        median, sorted.size(), sorted.front(), sorted.back());
  }
}

void RunReport::PrintParameterMemory(const SimulationResult& result) {
  out_ << fmt::format("parameters: {} on rank 0 of {} for the whole model ({:.3f}; {})\n",
                      FormatBytes(static_cast<uint64_t>(result.parameter_bytes_rank)),
                      FormatBytes(static_cast<uint64_t>(result.parameter_bytes_model)),
                      static_cast<double>(result.parameter_bytes_rank) /
                          static_cast<double>(std::max<int64_t>(1, result.parameter_bytes_model)),
                      result.parameter_split);
}

// Each rank's tensors as its kernels counted them (SimulationResult::tensor_bytes), ranks with
// the same numbers on one line: what the step's activations cost, measured, beside the
// preflight's estimate below.
void RunReport::PrintStepNotes(const SimulationResult& result) {
  if (result.step_notes.empty()) return;
  out_ << "\nexperts: the tokens each rank's experts received in the last forward (the first "
          "rank of each expert tensor-parallel group; its expt_tp peers compute slices of the same):\n";
  for (const std::string& text : result.step_notes) {
    std::string::size_type begin = 0, end;
    while ((end = text.find('\n', begin)) != std::string::npos) {
      out_ << "  " << text.substr(begin, end - begin) << "\n";
      begin = end + 1;
    }
  }
}

void RunReport::PrintTensorBytes(const SimulationResult& result) {
  const std::vector<SimulationResult::TensorBytes>& all = result.tensor_bytes;
  if (all.empty()) return;
  out_ << "\ntensors per rank, as the kernels allocate them (held: before the step; "
          "activations: what the step adds at its peak):\n";
  const auto format = [](int64_t bytes) { return FormatBytes(static_cast<uint64_t>(bytes)); };
  for (size_t first = 0; first < all.size();) {
    size_t last = first;
    while (last + 1 < all.size() && all[last + 1].held == all[first].held &&
           all[last + 1].peak == all[first].peak) {
      ++last;
    }
    const std::string ranks = first == last ? fmt::format("rank {}", first)
                                            : fmt::format("ranks {}-{}", first, last);
    out_ << fmt::format("  {:<12} held {:>10}   peak {:>10}   activations {:>10}\n", ranks,
                        format(all[first].held), format(all[first].peak),
                        format(all[first].peak - all[first].held));
    first = last + 1;
  }
}

Status RunReport::WriteSummary(const SimulationResult& result, int code) {
  nlohmann::ordered_json j;
  j["schema_version"] = 1;
  j["config"] = options_.config_path;
  // What ran: the config after the command line's overrides, and the command line.
  j["effective_config"] = effective_config_;
  j["command_line"] = options_.command_line;
  j["loss"] = result.loss;
  j["padded_vocab_size"] = result.padded_vocab_size;
  // Without the check nothing was compared: "checked" false, "passed" null.
  j["checked"] = options_.check;
  j["passed"] = options_.check ? nlohmann::ordered_json(code == 0) : nlohmann::ordered_json();
  nlohmann::ordered_json iterations = nlohmann::ordered_json::array();
  const std::vector<CheckResult::Iteration>& ref = result.check.reference_iterations;
  for (size_t i = 0; i < result.iterations.size(); ++i) {
    const SimulationResult::Iteration& row = result.iterations[i];
    nlohmann::ordered_json it = {
        {"loss", row.loss}, {"grad_norm", row.grad_norm}, {"lr", row.lr}, {"seconds", row.seconds}};
    if (i < ref.size()) it["reference_loss"] = ref[i].loss;
    // An MoE model: each MoE layer's kept choices per expert over the iteration (its
    // micro-batches and its stage's tp x dp x cp ranks), and the expert bias after the update.
    if (!row.experts.empty()) {
      nlohmann::ordered_json layers = nlohmann::ordered_json::array();
      for (const ExpertLoad& l : row.experts) {
        nlohmann::ordered_json layer = {{"layer", l.layer}, {"tokens_per_expert", l.tokens}};
        if (!l.bias.empty()) layer["expert_bias"] = l.bias;
        layers.push_back(layer);
      }
      it["moe_layers"] = layers;
    }
    iterations.push_back(it);
  }
  j["iterations"] = iterations;
  // Rank 0's collectives per micro-batch of the last step, forward and backward, under
  // CommDebugMode's names (what a PyTorch user counts a plan's traffic with): comm_counts on
  // the tensor-parallel mesh dimension, comm_counts_dp on the data-parallel one (FSDP2's
  // per-module gathers and reduce-scatters; DDP's reduction runs after the step, in neither).
  {
    const int64_t microbatches = config_.run ? config_.run->num_microbatches : 1;
    for (const auto& [key, groups] :
         {std::pair<const char*, std::set<std::string>>{"comm_counts", {"tp"}},
          {"comm_counts_dp", {"dp", "dp_cp"}}}) {
      std::map<std::string, int64_t> forward, backward;
      for (const CommRecord& r : result.trace.records()) {
        if (groups.count(r.group) == 0 || r.phase == Phase::kOther) continue;
        ++(r.phase == Phase::kForward ? forward : backward)[FunctionalCollectiveName(r.op)];
      }
      nlohmann::ordered_json counts = {{"forward", nlohmann::ordered_json::object()},
                                       {"backward", nlohmann::ordered_json::object()}};
      for (const auto& [name, n] : forward) counts["forward"][name] = n / microbatches;
      for (const auto& [name, n] : backward) counts["backward"][name] = n / microbatches;
      j[key] = counts;
    }
  }
  nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
  for (const SimulationResult::TensorBytes& t : result.tensor_bytes) {
    tensors.push_back({{"held", t.held},
                       {"peak", t.peak},
                       {"activations", t.peak - t.held},
                       {"parameters", t.parameters},
                       {"main_grad", t.gradients},
                       {"optimizer", t.optimizer},
                       {"constants", t.other}});
  }
  j["tensor_bytes"] = tensors;  // per world rank, in bytes
  if (options_.check) {
    int64_t failed = 0;
    double parameter_error = 0;  // the largest normalized error of a parameter
    const std::set<std::string> parameters(result.parameter_names.begin(),
                                           result.parameter_names.end());
    // The worst margin: the largest share of its allowance any element used (<= 1 passes), so
    // that a margin shrinking on another machine is seen before it fails.
    const TensorCheck* worst = nullptr;
    for (const TensorCheck& c : result.check.tensors) {
      if (!c.ok()) ++failed;
      if (parameters.count(c.name) != 0) parameter_error = std::max(parameter_error, c.normalized);
      if (worst == nullptr || c.used > worst->used) worst = &c;
    }
    j["check"] = {{"tensors", result.check.tensors.size()},
                  {"failed", failed},
                  {"reference_loss", result.check.reference_loss},
                  {"max_parameter_normalized_error", parameter_error},
                  {"max_used", worst != nullptr ? worst->used : 0.0},
                  {"max_used_tensor", worst != nullptr ? worst->name : ""}};
  }
  std::vector<double> sorted = result.seconds;
  std::sort(sorted.begin(), sorted.end());
  j["seconds_median"] = sorted.empty() ? 0.0 : sorted[sorted.size() / 2];
  j["peak_stashes_rank0"] = result.peak_stashes;
  if (config_.optimizer) j["distributed_optimizer"] = config_.optimizer->use_distributed_optimizer;
  // The last step's timeline: per world rank, its pp rank, when its schedule ended and its
  // steps [chunk, micro-batch, "F", "B" or "R" (a recomputation inside its backward), begin,
  // end] in seconds from the earliest start.
  nlohmann::ordered_json timeline = nlohmann::ordered_json::array();
  for (const SimulationResult::RankTimeline& t : result.timeline) {
    nlohmann::ordered_json steps = nlohmann::ordered_json::array();
    for (const StepSpan& s : t.steps) {
      steps.push_back({s.chunk, s.microbatch,
                       s.recompute ? "R"
                       : s.forward ? "F"
                                   : "B",
                       s.begin, s.end});
    }
    timeline.push_back(
        {{"pp_rank", t.pp_rank}, {"schedule_end", t.schedule_end}, {"steps", steps}});
  }
  if (!result.timeline.empty()) j["timeline"] = timeline;
  // Paths and arguments need not be UTF-8; JSON text must be.
  return WriteFileAtomically(
      options_.summary_path,
      j.dump(1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n");
}

// --trace FILE: the last step as Chrome trace events (the format chrome://tracing, Perfetto
// and PyTorch's profiler use), times in microseconds from the step's start. A process per
// node; per rank three threads, so that the complete ("X") events of a thread nest as the
// format requires: tid r (named by the rank's coordinates) its forward and backward steps
// (a recomputation nested in its backward step), tid W + r its collectives, tid 2W + r the
// waits of its sends and receives (the rank blocked), each message also an async span ("b"
// and "e", category "p2p") from its posting to the end of its wait, as messages in flight
// overlap. W, the number of ranks, is otherData.ranks.
Status RunReport::WriteTrace(const Topology& topology, const SimulationResult& result) {
  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  std::set<int64_t> nodes;
  const auto micros = [](double seconds) { return seconds * 1e6; };
  const auto world = static_cast<int64_t>(result.timeline.size());
  int64_t message = 0;  // async span ids
  for (int64_t rank = 0; rank < world; ++rank) {
    const RankCoordinates c = topology.Coordinates(rank);
    const int64_t node = topology.NodeOf(rank);
    if (nodes.insert(node).second) {
      events.push_back({{"name", "process_name"},
                        {"ph", "M"},
                        {"pid", node},
                        {"tid", 0},
                        {"args", {{"name", fmt::format("node {}", node)}}}});
    }
    // Every coordinate the layout has: cp, ep and etp only where they split something.
    const DerivedSizes& sz = topology.sizes();
    std::vector<std::string> coordinates = {fmt::format("tp {}", c.tp)};
    if (sz.cp > 1) coordinates.push_back(fmt::format("cp {}", c.cp));
    if (sz.ep > 1) coordinates.push_back(fmt::format("ep {}", c.ep));
    if (sz.experts_apart() && sz.etp != sz.tp) coordinates.push_back(fmt::format("etp {}", c.etp));
    coordinates.push_back(fmt::format("pp {}", c.pp));
    coordinates.push_back(fmt::format("dp {}", c.dp));
    const std::string rank_name = fmt::format("rank {} ({})", rank, fmt::join(coordinates, ", "));
    const int64_t steps = rank, collectives = world + rank, p2p = 2 * world + rank;
    for (const auto& [tid, name, order] :
         {std::tuple{steps, rank_name, 3 * rank},
          std::tuple{collectives, fmt::format("rank {} collectives", rank), 3 * rank + 1},
          std::tuple{p2p, fmt::format("rank {} send/recv waits", rank), 3 * rank + 2}}) {
      events.push_back({{"name", "thread_name"},
                        {"ph", "M"},
                        {"pid", node},
                        {"tid", tid},
                        {"args", {{"name", name}}}});
      events.push_back({{"name", "thread_sort_index"},
                        {"ph", "M"},
                        {"pid", node},
                        {"tid", tid},
                        {"args", {{"sort_index", order}}}});
    }
    const SimulationResult::RankTimeline& t = result.timeline[static_cast<size_t>(rank)];
    for (const StepSpan& s : t.steps) {
      events.push_back({{"name", fmt::format("{}{}.{}",
                                             s.recompute ? "R"
                                             : s.forward ? "F"
                                                         : "B",
                                             s.chunk, s.microbatch)},
                        {"cat", s.recompute ? "recompute"
                                : s.forward ? "forward"
                                            : "backward"},
                        {"ph", "X"},
                        {"ts", micros(s.begin)},
                        {"dur", micros(s.end - s.begin)},
                        {"pid", node},
                        {"tid", steps},
                        {"args", {{"chunk", s.chunk}, {"microbatch", s.microbatch}}}});
    }
    for (const CommRecord& m : t.comms) {
      nlohmann::ordered_json args = {
          {"site", m.site}, {"group", m.group}, {"bytes", m.bytes}, {"phase", PhaseName(m.phase)}};
      const std::string name = fmt::format("{} {}", CommOpName(m.op), m.group);
      const double end = m.end > 0 ? m.end : m.begin;
      if (m.peer < 0) {
        events.push_back({{"name", name},
                          {"cat", "comm"},
                          {"ph", "X"},
                          {"ts", micros(m.begin)},
                          {"dur", micros(end - m.begin)},
                          {"pid", node},
                          {"tid", collectives},
                          {"args", args}});
        continue;
      }
      args["peer (group rank)"] = m.peer;
      const double wait = m.wait > 0 ? std::clamp(m.wait, m.begin, end) : m.begin;
      args["posted (us)"] = micros(m.begin);
      events.push_back({{"name", name},
                        {"cat", "p2p wait"},
                        {"ph", "X"},
                        {"ts", micros(wait)},
                        {"dur", micros(end - wait)},
                        {"pid", node},
                        {"tid", p2p},
                        {"args", args}});
      const std::string id = fmt::format("0x{:x}", ++message);
      events.push_back({{"name", name}, {"cat", "p2p"}, {"ph", "b"}, {"id", id},
                        {"ts", micros(m.begin)}, {"pid", node}, {"tid", p2p},
                        {"args", {{"site", m.site}, {"bytes", m.bytes}}}});
      events.push_back({{"name", name}, {"cat", "p2p"}, {"ph", "e"}, {"id", id},
                        {"ts", micros(end)}, {"pid", node}, {"tid", p2p}});
    }
  }
  nlohmann::ordered_json j = {
      {"traceEvents", events}, {"displayTimeUnit", "ms"}, {"otherData", {{"ranks", world}}}};
  // FILE.html: the same events drawn by a self-contained page (run/trace_page.h).
  if (options_.trace_path.ends_with(".html")) {
    return WriteFileAtomically(options_.trace_path, TracePageHtml(j, options_.config_path));
  }
  return WriteFileAtomically(options_.trace_path, j.dump() + "\n");
}

int RunReport::PrintTraining(const SimulationResult& result) {
  if (result.iterations.empty() || !config_.optimizer) return 0;
  const OptimizerConfig& o = *config_.optimizer;
  static constexpr const char* kStyles[] = {"constant", "linear", "cosine"};
  out_ << fmt::format(
      "\ntraining: {} ({}), lr {:g} ({} decay to {:g}, {} warmup iterations), weight_decay {:g}, "
      "clip_grad {:g}; {} iterations\n",
      o.kind == OptimizerConfig::Kind::kAdam ? "adam" : "sgd",
      o.kind == OptimizerConfig::Kind::kAdam
          ? fmt::format("betas {:g} {:g}, eps {:g}", o.adam_beta1, o.adam_beta2, o.adam_eps)
          : fmt::format("momentum {:g}", o.sgd_momentum),
      o.lr, kStyles[static_cast<size_t>(o.lr_decay_style)], o.min_lr, o.lr_warmup_iters,
      o.weight_decay, o.clip_grad, result.iterations.size());
  const SimulationResult::OptimizerShard& sh = result.optimizer;
  const double state_mib = static_cast<double>(sh.elements * sh.state_bytes) / (1024.0 * 1024.0);
  if (sh.distributed) {
    out_ << fmt::format(
        "  distributed optimizer: rank 0 keeps master weights and state for elements [{}, {}) of "
        "its {}-element flat buffer{} ({:.2f} MiB, {} of the plain optimizer's {:.2f} MiB), "
        "gradients reduce-scattered and parameters all-gathered over dp_cp_partial{}\n",
        sh.begin, sh.end, sh.buffer,
        sh.expert_buffer > 0 ? fmt::format(" and [{}, {}) of its {}-element expert buffer",
                                           sh.expert_begin, sh.expert_end, sh.expert_buffer)
                             : std::string(),
        state_mib,
        sh.expert_buffer > 0
            ? fmt::format("{:.3f}", static_cast<double>(sh.elements) /
                                        static_cast<double>(std::max<int64_t>(sh.parameters, 1)))
            : fmt::format("1/{}", sh.end > sh.begin ? sh.buffer / (sh.end - sh.begin) : 0),
        static_cast<double>(sh.parameters * sh.state_bytes) / (1024.0 * 1024.0),
        sh.expert_buffer == 0 ? ""
        : config_.parallel.num_distributed_optimizer_instances > 1
            ? " (the expert buffer's over expt_dp_partial; both shards all-reduced over "
              "inter_dist_opt)"
            : " (the expert buffer's over expt_dp)");
  } else {
    out_ << fmt::format(
        "  optimizer state on rank 0: master weights and {} for its {} parameter elements "
        "({:.2f} MiB)\n",
        sh.state_tensors == 3 ? "m, v" : "the momentum buffer", sh.elements, state_mib);
  }
  const std::vector<CheckResult::Iteration>& ref = result.check.reference_iterations;
  const bool checked = options_.check && ref.size() == result.iterations.size();
  // A chain without a loss layer trains on its synthetic output gradients: its iterations
  // are judged by the gradient norm, with the largest tolerance of a parameter gradient.
  const bool by_loss = result.has_loss;
  double allowed = 0;
  for (const TensorCheck& c : result.check.tensors) {
    if (by_loss && c.name == "loss") allowed = c.allowed;
    if (!by_loss && (c.name.ends_with("_grad") || c.name.ends_with(".grad"))) {
      allowed = std::max(allowed, c.allowed);
    }
  }
  out_ << fmt::format("  {:>9} {:>14} {:>11} {:>11} {:>9}{}\n", "iteration", "loss", "grad norm",
                      "lr", "time",
                      checked ? fmt::format(" {:>16} {:>12} {:>11}  result", "reference loss",
                                            "|difference|", "ref. norm")
                              : std::string());
  int failures = 0;
  for (size_t i = 0; i < result.iterations.size(); ++i) {
    const SimulationResult::Iteration& row = result.iterations[i];
    std::string tail;
    if (checked) {
      const double mine = by_loss ? row.loss : row.grad_norm;
      const double theirs = by_loss ? ref[i].loss : ref[i].grad_norm;
      const double difference = std::fabs(mine - theirs);
      const bool pass = difference <= allowed * 2 * std::fabs(theirs);
      failures += pass ? 0 : 1;
      tail = fmt::format(" {:>16} {:>12.3g} {:>11.4g}  {}",
                         by_loss ? fmt::format("{:.10g}", ref[i].loss) : std::string("-"),
                         difference, ref[i].grad_norm, pass ? "pass" : "FAIL");
    }
    out_ << fmt::format("  {:>9} {:>14} {:>11.4g} {:>11.4g} {:>7.3f} s{}\n", row.iteration,
                        by_loss ? fmt::format("{:.10g}", row.loss) : std::string("-"),
                        row.grad_norm, row.lr, row.seconds, tail);
    if (!row.experts.empty()) out_ << ExpertLoadLine(row.experts);
  }
  if (checked) {
    out_ << fmt::format(
        "  the {} of every iteration against the reference training the same model in "
        "float64: {} of {} pass (|difference| <= {:.3g} * 2 |reference|)\n",
        by_loss ? "loss" : "gradient norm (the chain has no loss layer)",
        result.iterations.size() - static_cast<size_t>(failures), result.iterations.size(),
        allowed);
  }
  return failures;
}

int RunReport::PrintChecks(const CheckResult& check, const SimulationResult& result) {
  if (check.has_loss) {
    out_ << fmt::format("reference loss {:.9g} (float64), |difference| {:.3g}\n",
                        check.reference_loss, std::fabs(result.loss - check.reference_loss));
  }
  out_ << '\n' << check.header;
  size_t name_width = 26;
  for (const TensorCheck& c : check.tensors) name_width = std::max(name_width, c.name.size());
  out_ << fmt::format("  {:<{}} {:<16} {:>12} {:>12} {:>12} {:>10}  {}\n", "tensor", name_width, "shape",
                      "max abs err", "max rel err", "normalized", "allowed", "result");
  int failed = 0;
  for (const TensorCheck& c : check.tensors) {
    std::string verdict = "pass";
    if (c.missing) {
      verdict = "FAIL (not produced by the reference)";
    } else if (c.not_produced) {
      verdict = "FAIL (not produced by the run)";
    } else if (c.mismatches > 0) {
      verdict = fmt::format("FAIL ({} of {} elements{}; worst {}: {:.9g} vs {:.9g})",
                            c.mismatches, c.count,
                            c.non_finite > 0 ? fmt::format(", {} not finite", c.non_finite)
                                             : std::string(),
                            c.worst_index, c.worst_actual, c.worst_expected);
    } else if (c.count < NumElements(c.full_shape)) {
      verdict = fmt::format("FAIL (only {} of {} elements produced)", c.count,
                            NumElements(c.full_shape));
    }
    if (c.ok() && c.normalized > c.allowed) {
      // A trained parameter or optimizer state: its elements are also allowed the error
      // their gradients' tolerance carries through the updates.
      verdict = fmt::format("pass ({:.2g} of its allowance with the training bound)", c.used);
    }
    if (!c.ok()) ++failed;
    out_ << fmt::format("  {:<{}} {:<16} {:>12.3g} {:>12.3g} {:>12.3g} {:>10.3g}  {}\n", c.name,
                        name_width,
                        ShapeString(c.full_shape), c.max_abs, c.max_rel, c.normalized, c.allowed,
                        verdict);
  }
  out_ << fmt::format("{} passed, {} failed\n", check.tensors.size() - static_cast<size_t>(failed),
                      failed);
  out_ << check.memory;
  return failed;
}

// Each pipeline stage's share of the last step, from the gathered timeline (its first rank).
void RunReport::PrintStages(const SimulationResult& result, const PipelineSchedule& schedule) {
  if (result.timeline.empty()) return;
  const int64_t p = schedule.pipeline_model_parallel_size;
  const double m = static_cast<double>(schedule.num_microbatches);
  const double v = static_cast<double>(schedule.num_model_chunks);
  out_ << fmt::format(
      "  stage  rank  steps  peak stashes  warmup  busy of the schedule (last step; the "
      "schedule's bubble is (p - 1) / ({}M + p - 1) = {:.3f})\n",
      schedule.interleaved ? "v " : "",
      static_cast<double>(p - 1) / (v * m + static_cast<double>(p) - 1));
  for (int64_t stage = 0; stage < p; ++stage) {
    for (size_t r = 0; r < result.timeline.size(); ++r) {
      const SimulationResult::RankTimeline& t = result.timeline[r];
      if (t.pp_rank != stage) continue;
      int64_t live = 0, peak = 0, steps = 0;
      double busy = 0;
      for (const StepSpan& span : t.steps) {
        if (span.recompute) continue;  // inside its backward step
        ++steps;
        live += span.forward ? 1 : -1;
        peak = std::max(peak, live);
        busy += span.end - span.begin;
      }
      out_ << fmt::format("  {:>5}  {:>4}  {:>5}  {:>12}  {:>6}  {:.0f}% of {:.3f} s\n", stage, r,
                          steps, peak, schedule.NumWarmup(stage),
                          t.schedule_end > 0 ? 100 * busy / t.schedule_end : 0.0, t.schedule_end);
      break;
    }
  }
}

void RunReport::PrintCommTrace(const CommTrace& trace) {
  std::map<CommSummaryKey, std::pair<int64_t, int64_t>> summary;  // count, bytes
  for (const CommRecord& r : trace.records()) {
    // The check's gathers for the records, whichever step made them, are one row.
    const bool check = r.site.find("for records") != std::string::npos;
    auto& entry = summary[{check ? Phase::kOther : r.phase, r.site, r.op, r.group}];
    entry.first += 1;
    entry.second += r.bytes;
  }
  out_ << fmt::format("\ncollectives on rank 0 ({} in all; groups of one rank move no data and "
                      "are not listed):\n",
                      trace.records().size());
  // A chain of torch.nn modules names its collectives as PyTorch's CommDebugMode does.
  const bool torch = config_.model && config_.model->IsTorchChain();
  const auto op_name = [&](CommOpKind op) {
    return std::string(torch ? FunctionalCollectiveName(op) : CommOpName(op));
  };
  size_t site_width = 24, group_width = 6, op_width = 16;
  for (const auto& [key, value] : summary) {
    site_width = std::max(site_width, key.site.size());
    group_width = std::max(group_width, key.group.size());
    op_width = std::max(op_width, op_name(key.op).size());
  }
  out_ << fmt::format("  {:<9} {:<{}} {:<{}} {:<{}} {:>6} {:>14}\n", "phase", "issued by",
                      site_width, "op", op_width, "group", group_width, "count", "bytes");
  for (const auto& [key, value] : summary) {
    // What only the check needs (a layer's tensors gathered for the records) is the check's,
    // not Megatron's: its phase says so.
    const bool check = key.site.find("for records") != std::string::npos;
    out_ << fmt::format("  {:<9} {:<{}} {:<{}} {:<{}} {:>6} {:>14}\n",
                        check ? "check" : PhaseName(key.phase), key.site, site_width,
                        op_name(key.op), op_width, key.group, group_width, value.first,
                        value.second);
  }
}

// Peak resident set (VmHWM) of the largest rank, and the proportional set size (Pss: a page
// that n ranks share counts 1/n to each, so the sum is what the job really holds) of all ranks
// together at the end of the run. A sum of RSS would count every shared library page once per
// rank: 5x the truth at 64 ranks.
void RunReport::PrintMemory(PlanBytes preflight_bytes) {
  long long peak = ProcKilobytes("/proc/self/status", "VmHWM:");
  long long pss = ProcKilobytes("/proc/self/smaps_rollup", "Pss:");
  watched::Reduce(world_rank_ == 0 ? MPI_IN_PLACE : &peak, &peak, 1, MPI_LONG_LONG, MPI_MAX, 0,
                  MPI_COMM_WORLD, WorldLabel());
  watched::Reduce(world_rank_ == 0 ? MPI_IN_PLACE : &pss, &pss, 1, MPI_LONG_LONG, MPI_SUM, 0,
                  MPI_COMM_WORLD, WorldLabel());
  out_ << fmt::format("\nmemory: peak RSS {:.1f} MiB on the largest rank; {:.1f} MiB held by all "
                      "{} ranks at the end (PSS: pages shared between ranks counted once); the "
                      "preflight estimated {} per rank for tensors\n",
                      Mebibytes(peak), Mebibytes(pss), world_size_, FormatBytes(preflight_bytes));
}

}  // namespace mpusim::run
