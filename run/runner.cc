// `mpusim run` on MPI ranks (see runner.h).
#include "run/runner.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <set>
#include <sstream>

#include "core/config.h"
#include "core/safetensors.h"
#include "core/schedule.h"
#include "core/topology.h"
#include "core/train/optimizer.h"
#include "core/train/train_step.h"
#include "mpi/agree.h"
#include "mpi/mpi_check.h"
#include "mpi/watchdog.h"
#include "run/dump.h"
#include "run/preflight.h"
#include "run/trace_page.h"

namespace mpusim::run {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitOutOfMemory = 3;
constexpr int kExitInternalError = 4;

// A "<Key>: <n> kB" line of a /proc file, in bytes; 0 when the file or the key is not there.
int64_t ProcKilobytes(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + key.size()) * 1024;
  }
  return 0;
}

const char* RecomputeNote(RunConfig::Recompute recompute) {
  switch (recompute) {
    case RunConfig::Recompute::kFull: return ", recompute_granularity full";
    case RunConfig::Recompute::kSelective: return ", recompute_granularity selective";
    case RunConfig::Recompute::kNone: break;
  }
  return "";
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

}  // namespace

RankContext MakeRankContext(const Config& config, Backend& backend, const Topology& topology,
                            int world_rank, CommTrace* trace) {
  RankContext ctx;
  ctx.topology = &topology;
  ctx.rank = world_rank;
  ctx.coords = topology.Coordinates(world_rank);
  ctx.kernels = &backend.kernels();
  ctx.trace = trace;
  ctx.rng = RngTracker::ForRank(config.run->seed, ctx.coords.tp, ctx.coords.pp, ctx.coords.dp);
  const bool distributed_optimizer =
      config.optimizer.has_value() && config.optimizer->use_distributed_optimizer;
  auto groups =
      backend.MakeGroups(topology, world_rank,
                         RankGroups::Kinds(distributed_optimizer,
                                           topology.sizes().num_distributed_optimizer_instances));
  for (auto& [kind, comm] : groups) {
    comm = std::make_unique<TracedCommunicator>(std::move(comm), kind, trace);
  }
  ctx.groups = RankGroups::Take(groups);
  return ctx;
}

namespace {

// Runs `step` options.repeat times between barriers, timing each: a step ends when the
// backend's last kernel has (Kernels::Synchronize: a GPU's kernels outlive their launch).
template <typename Step>
void TimedSteps(const SimulateOptions& options, Kernels& k, SimulationResult* result,
                Step&& step) {
  for (int i = 0; i < options.repeat; ++i) {
    result->trace.Clear();
    watched::Barrier(MPI_COMM_WORLD, WorldLabel());
    const auto start = std::chrono::steady_clock::now();
    result->step_start = std::chrono::duration<double>(start.time_since_epoch()).count();
    step(i + 1 == options.repeat);
    k.Synchronize();
    watched::Barrier(MPI_COMM_WORLD, WorldLabel());
    result->seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

// Every rank's step spans of the model's last step, in seconds from the step's start. On one
// machine every process reads the same monotonic clock, so the start is the earliest rank's
// `start` (its clock as it left the barrier before the step). Across machines the clocks are
// unrelated: each rank's times count from its own `start` instead, since the ranks leave the
// barrier together (to the barrier's skew).
std::vector<SimulationResult::RankTimeline> GatherTimeline(const std::vector<StepSpan>& spans,
                                                           double schedule_end,
                                                           const CommTrace& trace, bool comms,
                                                           int64_t pp_rank, double start) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  nlohmann::json mine = {{"pp_rank", pp_rank},
                         {"host", std::string(host)},
                         {"start", start},
                         {"end", schedule_end},
                         {"steps", nlohmann::json::array()},
                         {"comms", nlohmann::json::array()}};
  for (const StepSpan& s : spans) {
    mine["steps"].push_back({s.chunk, s.microbatch, s.forward, s.begin, s.end, s.recompute});
  }
  if (comms) {
    for (const CommRecord& r : trace.records()) {
      mine["comms"].push_back({static_cast<int>(r.op), r.group, r.site, r.bytes,
                               static_cast<int>(r.phase), r.peer, r.begin, r.end});
    }
  }
  std::vector<nlohmann::json> ranks;
  bool one_machine = true;
  double earliest = start;
  for (const std::string& text : AllGatherStrings(mine.dump())) {
    ranks.push_back(nlohmann::json::parse(text));
    one_machine = one_machine && ranks.back()["host"] == ranks.front()["host"];
    earliest = std::min(earliest, ranks.back()["start"].get<double>());
  }
  std::vector<SimulationResult::RankTimeline> out;
  for (const nlohmann::json& r : ranks) {
    const double origin = one_machine ? earliest : r["start"].get<double>();
    SimulationResult::RankTimeline t;
    t.pp_rank = r["pp_rank"].get<int64_t>();
    t.schedule_end = r["end"].get<double>() - origin;
    for (const nlohmann::json& step : r["steps"]) {
      t.steps.push_back({step[0].get<int64_t>(), step[1].get<int64_t>(), step[2].get<bool>(),
                         step[3].get<double>() - origin, step[4].get<double>() - origin,
                         step[5].get<bool>()});
    }
    for (const nlohmann::json& c : r["comms"]) {
      const double end = c[7].get<double>();
      t.comms.push_back({static_cast<CommOpKind>(c[0].get<int>()), c[1].get<std::string>(),
                         c[2].get<std::string>(), c[3].get<int64_t>(),
                         static_cast<Phase>(c[4].get<int>()), c[5].get<int>(),
                         c[6].get<double>() - origin, end > 0 ? end - origin : 0.0});
    }
    out.push_back(std::move(t));
  }
  return out;
}

// The optimizer of a training run over `params`, and what the report says of its state.
std::unique_ptr<Optimizer> MakeOptimizer(const Config& config, RankContext& ctx,
                                         const std::vector<Parameter*>& params,
                                         SimulationResult* result) {
  DistributedOptimizerGroups dist_groups;
  if (config.optimizer->use_distributed_optimizer) {
    dist_groups = {ctx.groups.dp_cp_partial.get(), ctx.groups.inter_dist_opt.get(),
                   ctx.groups.intra_dist_opt.get()};
  }
  auto optimizer = std::make_unique<Optimizer>(*config.optimizer, params, *ctx.kernels, dist_groups);
  SimulationResult::OptimizerShard& shard = result->optimizer;
  shard.distributed = optimizer->distributed();
  shard.buffer = optimizer->padded_elements();
  shard.begin = optimizer->shard_begin();
  shard.end = optimizer->shard_end();
  for (const Parameter* p : params) shard.parameters += p->value.numel();
  shard.elements =
      optimizer->distributed() ? optimizer->shard_end() - optimizer->shard_begin() : shard.parameters;
  shard.state_tensors = config.optimizer->kind == OptimizerConfig::Kind::kAdam ? 3 : 2;
  shard.element_bytes = static_cast<int64_t>(DTypeSize(ComputeDType(config.run->dtype)));
  return optimizer;
}

// The model's description for the report, and its parameter sizes: this rank's trainable
// shards and the whole model's.
void DescribeModel(const Model& model, DType dtype, SimulationResult* result) {
  result->padded_vocab_size = model.padded_vocab_size();
  result->model_description = model.Describe();
  result->parameter_split = model.ParameterSplitNote();
  const auto element_bytes = static_cast<int64_t>(DTypeSize(dtype));
  for (const Parameter* p : model.TrainableParameters()) {
    result->parameter_bytes_rank += NumElements(LocalShape(p->shard, p->full_shape)) * element_bytes;
  }
  std::set<std::string> seen;  // a tied weight's copy on another stage is counted once
  for (const ParameterPlacement& p : model.ShardingMap()) {
    if (!seen.insert(p.name).second) continue;
    result->parameter_names.push_back(p.name);
    result->parameter_bytes_model += NumElements(p.full_shape) * element_bytes;
  }
}

}  // namespace

StatusOr<SimulationResult> Simulate(const Config& config, const SimulateOptions& options,
                                    Backend& backend) {
  int world_rank = 0, world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  const bool has_model = config.has_model();
  if (!has_model || !config.run) {
    return Status::Error(has_model ? "run" : "model",
                         "is required by mpusim run (see docs/simulator.md)");
  }
  if (config.run->train_iters > 1 && !config.optimizer) {
    return Status::Error("run.train_iters", fmt::format("is {}, but there is no \"optimizer\" "
                                                        "section to train with",
                                                        config.run->train_iters));
  }
  if (config.optimizer && options.repeat > 1) {
    return Status::Error("--repeat",
                         "must be 1 for a training run (run.train_iters sets the "
                         "iterations)");
  }
  if (config.optimizer && !config.optimizer->use_distributed_optimizer &&
      config.parallel.num_distributed_optimizer_instances > 1) {
    return Status::Error("parallel.num_distributed_optimizer_instances",
                         fmt::format("is {}, which shards the distributed optimizer's state; set "
                                     "optimizer.use_distributed_optimizer to true, or use 1",
                                     config.parallel.num_distributed_optimizer_instances));
  }
  if (config.parallel.world_size != world_size) {
    return Status::Error("parallel.world_size",
                         fmt::format("the config needs {} ranks but MPI started {}",
                                     config.parallel.world_size, world_size));
  }
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  if (!topology.ok()) return topology.status();
  StatusOr<std::unique_ptr<Model>> built =
      BuildModel(config, *topology, topology->Coordinates(world_rank));
  if (!built.ok()) return built.status();
  Model& model = **built;

  SimulationResult result;
  Kernels& kernels = backend.kernels();
  RankContext ctx = MakeRankContext(config, backend, *topology, world_rank, &result.trace);
  result.coords = ctx.coords;
  DescribeModel(model, config.run->dtype, &result);
  StatusOr<PipelineExecutor> executor =
      PipelineExecutor::ForRank(config.parallel, config.run->num_microbatches, ctx.coords.pp);
  if (!executor.ok()) return executor.status();
  model.InitializeParameters(ctx);
  const bool want_records = options.check || options.keep_records;
  std::unique_ptr<Optimizer> optimizer;
  if (!config.optimizer) {
    TimedSteps(options, kernels, &result, [&](bool last) {
      RunStep(model, *executor, ctx, 0, last && want_records, /*reduce_dp=*/true);
    });
  } else {
    // Training: run.train_iters iterations, each a step and an optimizer update.
    optimizer = MakeOptimizer(config, ctx, model.TrainableParameters(), &result);
    const std::vector<TrainedIteration> rows =
        Train(model, *executor, *optimizer, ctx, *config.optimizer, config.run->train_iters,
              want_records, [] { watched::Barrier(MPI_COMM_WORLD, WorldLabel()); });
    for (const TrainedIteration& row : rows) {
      result.seconds.push_back(row.seconds);
      result.iterations.push_back({row.iteration, row.loss, row.grad_norm, row.lr, row.seconds});
      result.step_start = row.start;
    }
  }
  result.has_loss = model.has_loss();
  result.loss = result.has_loss ? model.loss() : 0.0;
  result.peak_stashes = executor->peak_live_stashes();
  result.timeline = GatherTimeline(executor->step_spans(), executor->schedule_end(), result.trace,
                                   options.timeline_comms, ctx.coords.pp, result.step_start);
  if (!want_records) return result;

  // The records are the model's own tensors (no copies); a host copy of one is made only
  // while the check or the dump reads it, and not at all on a host backend. After training:
  // the last iteration's activations, the final parameters, the clipped gradients and the
  // optimizer state (the distributed optimizer's gathers for them left out of the trace).
  std::vector<TensorRecord> records;
  if (optimizer) {
    const CommTrace iteration_trace = result.trace;
    optimizer->GatherGradients(kernels, result.trace);
    model.Records(ctx, &records);
    optimizer->RecordState(kernels, result.trace, &records);
    result.trace = iteration_trace;
  } else {
    model.Records(ctx, &records);
  }
  if (options.check) {
    const HostFetch fetch = [&](const TensorRecord& r) {
      return r.tensor.device() == Device::kHost ? r.tensor : kernels.ToHost(r.tensor);
    };
    StatusOr<CheckResult> checked = CheckRun(config, *topology, ctx.coords, records, fetch);
    if (!checked.ok()) return checked.status();
    result.check = std::move(checked).value();
  }
  if (options.keep_records) result.records = std::move(records);
  return result;
}

namespace {

class RankRun {
 public:
  RankRun(const RunOptions& options, std::ostream& out, std::ostream& err, int world_rank,
          int world_size, const BackendFactory& factory)
      : options_(options),
        factory_(factory),
        out_(world_rank == 0 ? out : null_),
        err_(world_rank == 0 ? err : null_),
        world_rank_(world_rank),
        world_size_(world_size) {}

  int Run();

 private:
  int Usage(const std::string& source, const std::string& message) {
    err_ << "error: " << EscapeControl(source) << ": " << EscapeControl(message) << '\n';
    return kExitUsage;
  }
  // Every rank's refusal (GatherErrors' lines), one Usage line each.
  int Refused(const std::string& source, const std::vector<std::string>& lines) {
    for (const std::string& line : lines) Usage(source, line);
    return kExitUsage;
  }
  void PrintLayout(const Topology& topology, const SimulationResult& result);
  void PrintParameterMemory(const SimulationResult& result);
  int PrintChecks(const CheckResult& check, const SimulationResult& result);
  // The per-iteration table of a training run, with the reference's losses when checked;
  // returns how many iterations' losses fail the loss tensor's tolerance.
  int PrintTraining(const SimulationResult& result);
  // --summary FILE: the results as JSON (rank 0).
  Status WriteSummary(const SimulationResult& result, int code);
  void PrintStages(const SimulationResult& result, const PipelineSchedule& schedule);
  void PrintCommTrace(const CommTrace& trace);
  Status WriteTrace(const Topology& topology, const SimulationResult& result);
  void PrintMemory();
  std::string PreflightError(const MemoryPlan& plan) const;
  unsigned __int128 preflight_bytes_ = 0;  // this rank's preflight estimate

  const RunOptions& options_;
  const BackendFactory& factory_;
  std::string backend_name_ = "cpu";
  std::string backend_description_;
  std::ostringstream null_;
  std::ostream& out_;
  std::ostream& err_;
  int world_rank_;
  int world_size_;
  Config config_;
};

// "" when `plan` fits this rank's limit: --max-memory, else the machine's available memory
// shared by the ranks on this node; the refusal otherwise.
std::string RankRun::PreflightError(const MemoryPlan& plan) const {
  uint64_t limit = options_.max_memory_bytes;
  std::string source = "--max-memory";
  if (limit == 0) {
    const std::optional<uint64_t> available = AvailableMemoryBytes();
    if (!available) return "";  // no /proc/meminfo: nothing to judge against
    int64_t local_ranks = world_size_;
    for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
      if (const char* value = std::getenv(name)) local_ranks = std::max(1L, std::atol(value));
    }
    limit = *available / static_cast<uint64_t>(local_ranks);
    source = fmt::format("this machine's available memory, {}, shared by {} rank{}",
                         FormatBytes(*available), local_ranks, local_ranks == 1 ? "" : "s");
  }
  const Status status = CheckRankMemory(plan, limit, source);
  return status.ok() ? "" : status.Message();
}

int RankRun::Run() {
  const std::string& source = options_.config_path;
  // Every rank parses the same file; only rank 0 reports, and everyone exits 2 together.
  StatusOr<nlohmann::json> document = ReadJsonFile(source);
  if (!document.ok()) return Usage(source, document.status().Message());
  for (const RunOptions::Override& o : options_.overrides) {
    const size_t dot = o.key.find('.');
    nlohmann::json& section = (*document)[o.key.substr(0, dot)];
    if (!section.is_object()) section = nlohmann::json::object();
    section[o.key.substr(dot + 1)] = nlohmann::json::parse(o.value, nullptr, false);
  }
  if (const Status parsed = ParseConfig(*document, &config_); !parsed.ok()) {
    for (const RunOptions::Override& o : options_.overrides) {
      if (parsed.where() == o.key) return Usage("command line", o.flag + ": " + parsed.Message());
    }
    return Usage(source, parsed.Message());
  }
  if (world_rank_ == 0) {
    for (const std::string& line : config_.parallel.ignored) err_ << "note: " << line << '\n';
  }
  const bool has_model = config_.has_model();
  if (!has_model || !config_.run) {
    return Usage(source, fmt::format("{}: is required by mpusim run (see docs/simulator.md)",
                                     has_model ? "run" : "model"));
  }
  const int64_t want = config_.parallel.world_size;
  if (want != world_size_) {
    const bool under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr ||
                              std::getenv("PMI_SIZE") != nullptr;
    // Open MPI refuses more ranks than this machine's cores without --oversubscribe.
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const std::string launch =
        fmt::format("mpirun -n {}{} mpusim run {}", want,
                    cores > 0 && want > cores ? " --oversubscribe" : "", source);
    if (!under_mpirun) {
      return Usage(source, fmt::format("parallel.world_size: the config needs {} ranks but mpusim "
                                       "run was started without mpirun; run: {}",
                                       want, launch));
    }
    return Usage(source, fmt::format("parallel.world_size: the config needs {} ranks but mpirun "
                                     "started {}; run: {}",
                                     want, world_size_, launch));
  }
  StatusOr<Topology> topology = Topology::Create(config_.parallel);
  if (!topology.ok()) return Usage(source, topology.status().Message());
  std::vector<std::string> warnings;  // the model's plan-time warnings (Model::Warnings)
  // The preflight: refuse a run that would not fit before anything is allocated. Every rank
  // judges its own share against its own limit; one refusal stops them all. A GPU backend's
  // tensors are judged against the GPU's memory once the backend exists (below), so here
  // only the host's part of its plan is.
  MemoryPlan plan;
  const bool own_memory = options_.backend != "cpu";
  {
    StatusOr<std::unique_ptr<Model>> built =
        BuildModel(config_, *topology, topology->Coordinates(world_rank_));
    if (!built.ok()) return Usage(source, built.status().Message());
    warnings = (*built)->Warnings();
    plan = PlanRankMemory(**built, world_size_, options_.check);
    preflight_bytes_ = plan.total;
    std::vector<std::string> lines;
    if (GatherErrors(PreflightError(own_memory ? plan.HostItems() : plan), &lines)) {
      return Refused(source, lines);
    }
  }
  DumpTarget dump_target{options_.dump_dir, options_.config_path, "", config_.run->dtype, ""};
  if (!options_.dump_dir.empty()) {
    const Status ready = PrepareDump(&dump_target);
    if (!ready.ok()) return Usage("command line", ready.Message());
  }
  std::unique_ptr<Backend> backend;
  {
    BackendOrStatus made = factory_(options_);
    std::vector<std::string> lines;
    if (GatherErrors(made.ok() ? std::string() : made.status().Message(), &lines)) {
      for (const std::string& line : lines) err_ << "error: " << EscapeControl(line) << '\n';
      return kExitUsage;
    }
    backend = std::move(made).value();
  }
  if (own_memory) {
    const std::optional<DeviceMemory> memory = backend->Memory();
    std::string error;
    if (memory) {
      const Status fits = CheckDeviceMemory(plan, *memory);
      if (!fits.ok()) error = fits.Message();
    } else {
      error = PreflightError(plan);  // a plugin whose tensors live in host memory
    }
    std::vector<std::string> lines;
    if (GatherErrors(error, &lines)) return Refused(source, lines);
  }
  backend_name_ = backend->name();
  backend_description_ = backend->Describe();
  const bool dump = !options_.dump_dir.empty();
  StatusOr<SimulationResult> result = Simulate(
      config_, {options_.check, options_.repeat, dump, !options_.trace_path.empty()}, *backend);
  if (!result.ok()) return Usage(source, result.status().Message());
  PrintLayout(*topology, *result);
  // Megatron's own t-fold gradients (docs/simulator.md, "Warnings"): the run computes them as
  // Megatron does, and says here, before the check fails on them, why.
  for (const std::string& warning : warnings) out_ << "warning: " << EscapeControl(warning) << '\n';
  if (result->has_loss) out_ << fmt::format("\nloss {:.9g}\n", result->loss);
  if (options_.repeat > 1) {
    std::vector<double> sorted = result->seconds;
    std::sort(sorted.begin(), sorted.end());
    const size_t mid = sorted.size() / 2;
    const double median =
        sorted.size() % 2 == 1 ? sorted[mid] : 0.5 * (sorted[mid - 1] + sorted[mid]);
    out_ << fmt::format("time per step (forward + backward, all micro-batches): median {:.4f} s "
                        "over {} runs, min {:.4f} s, max {:.4f} s\n",
                        median, sorted.size(), sorted.front(), sorted.back());
  }
  int code = kExitOk;
  const int iteration_failures = PrintTraining(*result);
  if (options_.check) code = PrintChecks(result->check, *result);
  if (iteration_failures > 0) code = kExitCheckFailed;
  if (!options_.summary_path.empty() && world_rank_ == 0) {
    const Status written = WriteSummary(*result, code);
    if (!written.ok()) return Usage("", written.Message());
  }
  if (!options_.trace_path.empty() && world_rank_ == 0) {
    const Status written = WriteTrace(*topology, *result);
    if (!written.ok()) return Usage("", written.Message());
  }
  PrintCommTrace(result->trace);
  if (dump) {
    DumpTarget target = dump_target;
    target.backend = backend_name_;
    std::vector<std::string> lines;
    const Status written =
        WriteDump(target, result->coords, result->records,
                  [&](const TensorRecord& r) {
                    return r.tensor.device() == Device::kHost ? r.tensor
                                                              : backend->kernels().ToHost(r.tensor);
                  },
                  ErrorBudgets(result->check), &lines);
    result->records.clear();
    if (!written.ok()) {
      if (lines.empty()) return Usage("command line", written.Message());
      for (const std::string& line : lines) err_ << "error: " << EscapeControl(line) << '\n';
      return kExitUsage;
    }
    out_ << fmt::format("\ndump: {} ({} files + manifest.json)\n", options_.dump_dir,
                        world_size_);
  }
  if (!result->parameter_split.empty()) PrintParameterMemory(*result);
  PrintMemory();
  return code;
}

void RankRun::PrintLayout(const Topology& topology, const SimulationResult& result) {
  const DerivedSizes& s = topology.sizes();
  const RunConfig& run = *config_.run;
  out_ << fmt::format("mpusim run: {} on {} ranks ({} backend, {}, seed {})\n",
                      options_.config_path, world_size_, backend_name_, DTypeName(run.dtype),
                      run.seed);
  out_ << fmt::format("backend: {}\n", backend_description_);
  out_ << fmt::format(
      "layout: tensor_model_parallel_size {}, data_parallel_size {}, "
      "sequence_parallel {}{}\n",
      s.tp, s.dp, config_.parallel.sequence_parallel,
      s.pp > 1 ? fmt::format(", pipeline_model_parallel_size {}{}", s.pp,
                             s.vp ? fmt::format(", virtual_pipeline_model_"
                                                "parallel_size {}",
                                                *s.vp)
                                  : std::string())
               : std::string());
  std::vector<const char*> kinds = {"tp", "dp"};
  if (s.pp > 1) kinds.push_back("pp");
  if (config_.optimizer && config_.optimizer->use_distributed_optimizer) {
    kinds.push_back("dp_cp_partial");
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
  out_ << fmt::format("data: seq_length {}, micro_batch_size {} per dp rank ({} in all), "
                      "num_microbatches {}{}\n",
                      run.seq_length, run.micro_batch_size, run.micro_batch_size * s.dp,
                      run.num_microbatches, RecomputeNote(run.recompute));
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

void RankRun::PrintParameterMemory(const SimulationResult& result) {
  out_ << fmt::format("parameters: {} on rank 0 of {} for the whole model ({:.3f}; {})\n",
                      FormatBytes(static_cast<uint64_t>(result.parameter_bytes_rank)),
                      FormatBytes(static_cast<uint64_t>(result.parameter_bytes_model)),
                      static_cast<double>(result.parameter_bytes_rank) /
                          static_cast<double>(std::max<int64_t>(1, result.parameter_bytes_model)),
                      result.parameter_split);
}

Status RankRun::WriteSummary(const SimulationResult& result, int code) {
  nlohmann::ordered_json j;
  j["schema_version"] = 1;
  j["config"] = options_.config_path;
  j["loss"] = result.loss;
  j["padded_vocab_size"] = result.padded_vocab_size;
  j["passed"] = code == kExitOk;
  nlohmann::ordered_json iterations = nlohmann::ordered_json::array();
  const std::vector<CheckResult::Iteration>& ref = result.check.reference_iterations;
  for (size_t i = 0; i < result.iterations.size(); ++i) {
    const SimulationResult::Iteration& row = result.iterations[i];
    nlohmann::ordered_json it = {
        {"loss", row.loss}, {"grad_norm", row.grad_norm}, {"lr", row.lr}, {"seconds", row.seconds}};
    if (i < ref.size()) it["reference_loss"] = ref[i].loss;
    iterations.push_back(it);
  }
  j["iterations"] = iterations;
  if (options_.check) {
    int64_t failed = 0;
    double parameter_error = 0;  // the largest normalized error of a parameter
    const std::set<std::string> parameters(result.parameter_names.begin(),
                                           result.parameter_names.end());
    for (const TensorCheck& c : result.check.tensors) {
      if (!c.ok()) ++failed;
      if (parameters.count(c.name) != 0) parameter_error = std::max(parameter_error, c.normalized);
    }
    j["check"] = {{"tensors", result.check.tensors.size()},
                  {"failed", failed},
                  {"reference_loss", result.check.reference_loss},
                  {"max_parameter_normalized_error", parameter_error}};
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
  return WriteFileAtomically(options_.summary_path, j.dump(1) + "\n");
}

// --trace FILE: the last step as Chrome trace events (the format chrome://tracing, Perfetto
// and PyTorch's profiler use): a process per node, a thread per rank named by its
// coordinates, a complete ("X") event per forward or backward step (and per recomputation,
// nested in its backward step) and per collective or
// send/receive, times in microseconds from the step's start.
Status RankRun::WriteTrace(const Topology& topology, const SimulationResult& result) {
  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  std::set<int64_t> nodes;
  const auto micros = [](double seconds) { return seconds * 1e6; };
  for (size_t r = 0; r < result.timeline.size(); ++r) {
    const auto rank = static_cast<int64_t>(r);
    const RankCoordinates c = topology.Coordinates(rank);
    const int64_t node = topology.NodeOf(rank);
    if (nodes.insert(node).second) {
      events.push_back({{"name", "process_name"},
                        {"ph", "M"},
                        {"pid", node},
                        {"tid", 0},
                        {"args", {{"name", fmt::format("node {}", node)}}}});
    }
    events.push_back(
        {{"name", "thread_name"},
         {"ph", "M"},
         {"pid", node},
         {"tid", rank},
         {"args",
          {{"name", fmt::format("rank {} (tp {}, pp {}, dp {})", rank, c.tp, c.pp, c.dp)}}}});
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", node},
                      {"tid", rank},
                      {"args", {{"sort_index", rank}}}});
    const SimulationResult::RankTimeline& t = result.timeline[r];
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
                        {"tid", rank},
                        {"args", {{"chunk", s.chunk}, {"microbatch", s.microbatch}}}});
    }
    for (const CommRecord& m : t.comms) {
      nlohmann::ordered_json args = {
          {"site", m.site}, {"group", m.group}, {"bytes", m.bytes}, {"phase", PhaseName(m.phase)}};
      if (m.peer >= 0) args["peer (group rank)"] = m.peer;
      const double end = m.end > 0 ? m.end : m.begin;
      events.push_back({{"name", fmt::format("{} {}", CommOpName(m.op), m.group)},
                        {"cat", "comm"},
                        {"ph", "X"},
                        {"ts", micros(m.begin)},
                        {"dur", micros(end - m.begin)},
                        {"pid", node},
                        {"tid", rank},
                        {"args", args}});
    }
  }
  nlohmann::ordered_json j = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  // FILE.html: the same events drawn by a self-contained page (run/trace_page.h).
  if (options_.trace_path.ends_with(".html")) {
    return WriteFileAtomically(options_.trace_path, TracePageHtml(j, options_.config_path));
  }
  return WriteFileAtomically(options_.trace_path, j.dump() + "\n");
}

int RankRun::PrintTraining(const SimulationResult& result) {
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
  const double state_mib =
      static_cast<double>(sh.elements * sh.state_tensors * sh.element_bytes) / (1024.0 * 1024.0);
  if (sh.distributed) {
    out_ << fmt::format(
        "  distributed optimizer: rank 0 keeps master weights and state for elements [{}, {}) of "
        "its {}-element flat buffer ({:.2f} MiB, 1/{} of the plain optimizer's {:.2f} MiB), "
        "gradients reduce-scattered and parameters all-gathered over dp_cp_partial\n",
        sh.begin, sh.end, sh.buffer, state_mib,
        sh.end > sh.begin ? sh.buffer / (sh.end - sh.begin) : 0,
        static_cast<double>(sh.parameters * sh.state_tensors * sh.element_bytes) /
            (1024.0 * 1024.0));
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

int RankRun::PrintChecks(const CheckResult& check, const SimulationResult& result) {
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
  return failed > 0 ? kExitCheckFailed : kExitOk;
}

// Each pipeline stage's share of the last step, from the gathered timeline (its first rank).
void RankRun::PrintStages(const SimulationResult& result, const PipelineSchedule& schedule) {
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

void RankRun::PrintCommTrace(const CommTrace& trace) {
  std::map<CommSummaryKey, std::pair<int64_t, int64_t>> summary;  // count, bytes
  for (const CommRecord& r : trace.records()) {
    auto& entry = summary[{r.phase, r.site, r.op, r.group}];
    entry.first += 1;
    entry.second += r.bytes;
  }
  out_ << fmt::format("\ncollectives on rank 0 ({} in all; groups of one rank move no data and "
                      "are not listed):\n",
                      trace.records().size());
  size_t site_width = 24, group_width = 6;
  for (const auto& [key, value] : summary) {
    site_width = std::max(site_width, key.site.size());
    group_width = std::max(group_width, key.group.size());
  }
  out_ << fmt::format("  {:<9} {:<{}} {:<16} {:<{}} {:>6} {:>14}\n", "phase", "issued by",
                      site_width, "op", "group", group_width, "count", "bytes");
  for (const auto& [key, value] : summary) {
    out_ << fmt::format("  {:<9} {:<{}} {:<16} {:<{}} {:>6} {:>14}\n", PhaseName(key.phase),
                        key.site, site_width, CommOpName(key.op), key.group, group_width,
                        value.first, value.second);
  }
}

// Peak resident set (VmHWM) of the largest rank, and the proportional set size (Pss: a page
// that n ranks share counts 1/n to each, so the sum is what the job really holds) of all ranks
// together at the end of the run. A sum of RSS would count every shared library page once per
// rank: 5x the truth at 64 ranks.
void RankRun::PrintMemory() {
  long long peak = ProcKilobytes("/proc/self/status", "VmHWM:");
  long long pss = ProcKilobytes("/proc/self/smaps_rollup", "Pss:");
  watched::Reduce(world_rank_ == 0 ? MPI_IN_PLACE : &peak, &peak, 1, MPI_LONG_LONG, MPI_MAX, 0,
                  MPI_COMM_WORLD, WorldLabel());
  watched::Reduce(world_rank_ == 0 ? MPI_IN_PLACE : &pss, &pss, 1, MPI_LONG_LONG, MPI_SUM, 0,
                  MPI_COMM_WORLD, WorldLabel());
  out_ << fmt::format("\nmemory: peak RSS {:.1f} MiB on the largest rank; {:.1f} MiB held by all "
                      "{} ranks at the end (PSS: pages shared between ranks counted once); the "
                      "preflight estimated {} per rank for tensors\n",
                      Mebibytes(peak), Mebibytes(pss), world_size_, FormatBytes(preflight_bytes_));
}

}  // namespace

int RunSimulation(const RunOptions& options, std::ostream& out, std::ostream& err,
                  const BackendFactory& factory) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized == 0) MPI_Init(nullptr, nullptr);
  int world_rank = 0, world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  int code = kExitOk;
  try {
    // Before the first communication: the watchdog's timeout and its test hook (MPUSIM_FAULT,
    // mpi/watchdog.h); a malformed hook is bad input, reported once.
    SetCommTimeout(options.timeout_s);
    const Status fault = ArmFaultInjection();
    std::vector<std::string> lines;
    if (GatherErrors(fault.ok() ? std::string() : fault.Message(), &lines)) {
      for (const std::string& line : lines) err << "error: " << line << '\n';
      code = kExitUsage;
    } else {
      RankRun run(options, out, err, world_rank, world_size, factory);
      code = run.Run();
    }
  } catch (const std::bad_alloc&) {
    // Past the preflight (run/preflight.h), memory ran out anyway: other processes, or an
    // estimate too low. End the whole job with the out-of-memory exit code.
    AbortJob(fmt::format("error: rank {}: out of memory: an allocation failed after the "
                         "preflight accepted the run; free memory or shrink the run",
                         world_rank),
             kExitOutOfMemory);
  } catch (const std::exception& e) {
    // A bug or an unexpected failure on one rank: end the whole job rather than leave the
    // other ranks waiting in a collective.
    AbortJob(fmt::format("error: rank {}: internal error: {}", world_rank, e.what()),
             kExitInternalError);
  }
  code = AgreeOnWorst(code);
  if (initialized == 0) FinalizeWatched();
  return code;
}

}  // namespace mpusim::run
