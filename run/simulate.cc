// One run of a model on this MPI rank (see simulate.h).
#include "run/simulate.h"

#include <fmt/format.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/config/model_facts.h"
#include "core/model/optimizer_plan.h"
#include "core/pipeline/executor.h"
#include "core/train/optimizer.h"
#include "core/train/train_step.h"
#include "mpi/agree.h"
#include "mpi/interrupt.h"
#include "mpi/mpi_check.h"
#include "mpi/watchdog.h"

namespace mpusim::run {

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
  const bool hierarchical_cp =
      FactsOf(config).cp_comm_type == CpCommType::kA2aP2p && topology.sizes().cp > 1;
  auto groups =
      backend.MakeGroups(topology, world_rank,
                         RankGroups::Kinds(distributed_optimizer,
                                           topology.sizes().num_distributed_optimizer_instances,
                                           topology.sizes().experts_apart(), hierarchical_cp));
  for (auto& [kind, comm] : groups) {
    comm = std::make_unique<TracedCommunicator>(std::move(comm), kind, trace);
  }
  ctx.groups = RankGroups::Take(groups);
  return ctx;
}

namespace {

// A safe point: every rank asks whether any rank got SIGINT or SIGTERM (one all-reduce, which
// also fences the step's timing as a barrier would: no rank leaves it before all arrived).
// True when one did; result->interrupt then says which, and where every rank stopped.
bool StopsAt(SimulationResult* result, const char* before_after, const char* what,
             int64_t number, int64_t count) {
  const Interrupt agreed = AgreeOnInterrupt();
  if (!agreed) return false;
  result->interrupt = agreed;
  result->interrupted_where = count == 1 ? fmt::format("{} the {}", before_after, what)
                                         : fmt::format("{} {} {} of {}", before_after, what,
                                                       number, count);
  return true;
}

// Runs `step` options.repeat times between safe points, timing each: a step ends when the
// backend's last kernel has (Kernels::Synchronize: a GPU's kernels outlive their launch).
// False when an interrupt stopped it.
template <typename Step>
bool TimedSteps(const SimulateOptions& options, Kernels& k, SimulationResult* result,
                Step&& step) {
  for (int i = 0; i < options.repeat; ++i) {
    result->trace.Clear();
    if (StopsAt(result, "before", "step", i + 1, options.repeat)) return false;
    const auto start = std::chrono::steady_clock::now();
    result->step_start = std::chrono::duration<double>(start.time_since_epoch()).count();
    step(i + 1 == options.repeat);
    k.Synchronize();
    const bool stop = StopsAt(result, "after", "step", i + 1, options.repeat);
    result->seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (stop) return false;
  }
  return true;
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
                               static_cast<int>(r.phase), r.peer, r.begin, r.end, r.wait});
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
      const double end = c[7].get<double>(), wait = c[8].get<double>();
      t.comms.push_back({static_cast<CommOpKind>(c[0].get<int>()), c[1].get<std::string>(),
                         c[2].get<std::string>(), c[3].get<int64_t>(),
                         static_cast<Phase>(c[4].get<int>()), c[5].get<int>(),
                         c[6].get<double>() - origin, end > 0 ? end - origin : 0.0,
                         wait > 0 ? wait - origin : 0.0});
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
    // With the experts laid out apart their buffer shards over expt_dp within the instance.
    if (ctx.topology->sizes().experts_apart()) {
      dist_groups.expert_shard = ctx.groups.expt_dp_partial.get();
    }
  }
  if (config.optimizer->use_torch_fsdp2) dist_groups.fully_shard = &ctx.dp_cp();
  auto optimizer = std::make_unique<Optimizer>(*config.optimizer, params, *ctx.kernels, dist_groups);
  SimulationResult::OptimizerShard& shard = result->optimizer;
  shard.distributed = optimizer->distributed();
  shard.buffer = optimizer->padded_elements();
  shard.begin = optimizer->shard_begin();
  shard.end = optimizer->shard_end();
  for (const Parameter* p : params) shard.parameters += p->value.numel();
  shard.expert_buffer = optimizer->padded_elements(1);
  shard.expert_begin = optimizer->shard_begin(1);
  shard.expert_end = optimizer->shard_end(1);
  shard.elements = optimizer->distributed() ? optimizer->shard_end() - optimizer->shard_begin() +
                                                  shard.expert_end - shard.expert_begin
                                            : shard.parameters;
  shard.state_tensors = config.optimizer->kind == OptimizerConfig::Kind::kAdam ? 3 : 2;
  shard.state_bytes = OptimizerStateBytes(*config.optimizer, PrecisionOf(config));
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

// Every rank's ExpertLoads of each iteration, summed per layer over the world: a layer's
// ranks are its pipeline stage's, tp x cp x dp, each counting the choices of its own tokens,
// so the sum is the count finalize_model_grads all-reduces for the expert bias's update. The
// bias is the same on every rank holding the layer; the first rank's is kept. Collective
// (every rank calls it): the result goes into every rank's `result->iterations`.
void SumExpertLoads(const std::vector<TrainedIteration>& rows, SimulationResult* result) {
  nlohmann::json mine = nlohmann::json::array();
  for (const TrainedIteration& row : rows) {
    nlohmann::json layers = nlohmann::json::array();
    for (const ExpertLoad& l : row.experts) layers.push_back({l.layer, l.tokens, l.bias});
    mine.push_back(layers);
  }
  std::vector<std::map<int64_t, ExpertLoad>> summed(rows.size());
  for (const std::string& text : AllGatherStrings(mine.dump())) {
    const nlohmann::json rank = nlohmann::json::parse(text);
    for (size_t i = 0; i < rank.size() && i < summed.size(); ++i) {
      for (const nlohmann::json& l : rank[i]) {
        const auto layer = l[0].get<int64_t>();
        const auto tokens = l[1].get<std::vector<int64_t>>();
        auto [at, first] = summed[i].try_emplace(layer);
        if (first) {
          at->second = {layer, tokens, l[2].get<std::vector<float>>()};
          continue;
        }
        for (size_t e = 0; e < tokens.size(); ++e) at->second.tokens[e] += tokens[e];
      }
    }
  }
  for (size_t i = 0; i < summed.size(); ++i) {
    for (auto& [layer, load] : summed[i]) result->iterations[i].experts.push_back(std::move(load));
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
  const int64_t before_init = kernels.tensor_bytes().live;
  model.InitializeParameters(ctx);
  const int64_t after_init = kernels.tensor_bytes().live;
  const bool want_records = options.check || options.keep_records;
  std::unique_ptr<Optimizer> optimizer;
  // Under FSDP2 the optimizer updates each rank's rows of the parameters.
  const FullyShard* fsdp = model.fully_shard();
  if (config.optimizer) {
    optimizer =
        MakeOptimizer(config, ctx, fsdp ? fsdp->Shards() : model.TrainableParameters(), &result);
  }
  // The tensors held before the first step (parameters, main_grad, optimizer state), and the
  // most alive at once while the steps run: the difference is the step's activations and the
  // gradients in flight.
  const int64_t held = kernels.tensor_bytes().live;
  int64_t parameter_bytes = 0, gradient_bytes = 0;
  for (const Parameter* p : fsdp ? fsdp->Held() : model.HeldParameters()) {
    parameter_bytes += static_cast<int64_t>(p->value.bytes());
    if (p->grad.defined()) gradient_bytes += static_cast<int64_t>(p->grad.bytes());
  }
  kernels.ResetPeakTensorBytes();
  if (!config.optimizer) {
    if (!TimedSteps(options, kernels, &result, [&](bool last) {
          RunStep(model, *executor, ctx, 0, last && want_records, /*reduce_dp=*/true);
        })) {
      return result;
    }
  } else {
    // Training: run.train_iters iterations, each a step and an optimizer update.
    const int64_t iterations = config.run->train_iters;
    const std::vector<TrainedIteration> rows = Train(
        model, *executor, *optimizer, ctx, *config.optimizer, iterations, want_records,
        [&](int64_t iteration, bool done) {
          return StopsAt(&result, done ? "after" : "before", "iteration", iteration, iterations);
        },
        options.on_iteration);
    for (const TrainedIteration& row : rows) {
      result.seconds.push_back(row.seconds);
      result.iterations.push_back(
          {row.iteration, row.loss, row.grad_norm, row.lr, row.seconds, {}});
      result.step_start = row.start;
    }
    if (result.interrupt) return result;
    SumExpertLoads(rows, &result);  // empty for a model without MoE layers
  }
  result.has_loss = model.has_loss();
  result.loss = result.has_loss ? model.loss() : 0.0;
  result.peak_stashes = executor->peak_live_stashes();
  for (const std::string& text : AllGatherStrings(fmt::format(
           "{} {} {} {} {} {}", held, kernels.tensor_bytes().peak, parameter_bytes, gradient_bytes,
           held - after_init, after_init - before_init - parameter_bytes - gradient_bytes))) {
    SimulationResult::TensorBytes& bytes = result.tensor_bytes.emplace_back();
    std::sscanf(text.c_str(),
                "%" SCNd64 " %" SCNd64 " %" SCNd64 " %" SCNd64 " %" SCNd64 " %" SCNd64,
                &bytes.held, &bytes.peak, &bytes.parameters, &bytes.gradients, &bytes.optimizer,
                &bytes.other);
  }
  {
    std::string mine;
    for (const std::string& line : model.StepNotes()) mine += line + "\n";
    for (std::string& text : AllGatherStrings(mine)) {
      if (!text.empty()) result.step_notes.push_back(std::move(text));
    }
  }
  result.timeline = GatherTimeline(executor->step_spans(), executor->schedule_end(), result.trace,
                                   options.timeline_comms, ctx.coords.pp, result.step_start);
  if (!want_records) return result;

  // The records are the model's own tensors (no copies); a host copy of one is made only
  // while the check or the dump reads it, and not at all on a host backend. After training:
  // the last iteration's activations, the final parameters, the clipped gradients and the
  // optimizer state (the distributed optimizer's gathers for them left out of the trace).
  // Under FSDP2 the parameters and their gradients are gathered whole for them first (left
  // out of the trace too).
  std::vector<TensorRecord> records;
  const CommTrace iteration_trace = result.trace;
  if (optimizer) optimizer->GatherGradients(kernels, result.trace);
  if (FullyShard* sharded = model.fully_shard()) {
    result.trace.SetPhase(Phase::kOther);
    sharded->GatherForRecords(kernels, result.trace);
  }
  model.Records(ctx, &records);
  if (optimizer) optimizer->RecordState(kernels, result.trace, &records);
  result.trace = iteration_trace;
  if (options.check) {
    const HostFetch fetch = [&](const TensorRecord& r) {
      return r.tensor.device() == Device::kHost ? r.tensor : kernels.ToHost(r.tensor);
    };
    StatusOr<CheckResult> checked = CheckRun(config, ctx.coords, records, fetch, options.reference);
    if (!checked.ok()) return checked.status();
    result.check = std::move(checked).value();
  }
  if (options.keep_records) result.records = std::move(records);
  return result;
}

}  // namespace mpusim::run
