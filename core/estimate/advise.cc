#include "core/estimate/advise.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <optional>
#include <tuple>
#include <utility>

#include "core/config/gpt_config.h"
#include "core/estimate/activation_estimate.h"
#include "core/estimate/estimable.h"
#include "core/estimate/memory_estimate.h"
#include "core/estimate/memory_reserve.h"
#include "core/layout_space.h"
#include "core/schedule.h"
#include "core/topology.h"

namespace mpusim {
namespace {

// Calls f(0) .. f(n - 1) on up to one thread per core, each index once; an exception from any
// call is rethrown here after every thread has stopped.
void ParallelFor(size_t n, const std::function<void(size_t)>& f) {
  const size_t threads =
      std::min<size_t>(n, std::max<size_t>(1, std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  const auto work = [&] {
    for (size_t i = next++; i < n; i = next++) {
      try {
        f(i);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next = n;
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

const char* RecomputeName(RunConfig::Recompute r) {
  switch (r) {
    case RunConfig::Recompute::kFull:
      return "full";
    case RunConfig::Recompute::kSelective:
      return "selective";
    default:
      return "none";
  }
}

StatusOr<Advice> Advise(const Config& config, const GpuSpec& gpu, const AdviseOptions& options) {
  const GptConfig* const gpt = EstimatedModel(config);
  if (gpt == nullptr) return Status::Error("model", "advise needs a GPT model (\"type\": \"gpt\")");
  const GptConfig& model = *gpt;
  if (config.optimizer && config.optimizer->use_torch_fsdp2) {
    return Status::Error("optimizer.use_torch_fsdp2",
                         "advise ranks DDP and distributed-optimizer layouts; the step-time "
                         "model has no FSDP2 yet (set it false to rank the others)");
  }
  const int64_t n = options.world_size, batch = options.global_batch_size;
  if (n < 1) return Status::Error("--world-size", "must be >= 1");
  if (batch < 1) return Status::Error("--global-batch-size", "must be >= 1");
  const int64_t max_tp = options.max_tp > 0 ? options.max_tp : config.parallel.gpus_per_node;
  // Timing needs the real sequence: without a run section, the one the model's positions
  // are sized for (DefaultRun).
  if (!config.run && model.max_position_embeddings < 1) {
    return Status::Error("--seq-length", "is needed: the config has no run section and the "
                                         "model no max_position_embeddings");
  }
  const RunConfig base_run = config.run ? *config.run : DefaultRun(config);
  // fp8 on a GPU or dtype that cannot run it: one refusal, not every layout "not timed".
  MPUSIM_RETURN_IF_ERROR(CheckFp8OnGpu(model, base_run.dtype, gpu));
  Advice advice;
  // The attention every candidate counts (the dtype and the GPU decide it, not the layout).
  StatusOr<ResolvedAttention> attention =
      ResolveAttentionBackend(model, base_run.dtype, gpu.compute_capability, 1);
  if (!attention.ok()) return attention.status();
  advice.attention = *attention;
  // The config of one candidate: `config` with the layout, the batch split and recomputation;
  // nullopt when the model refuses the layout.
  const auto configure = [&](const AdvisedLayout& l) -> std::optional<Config> {
    Config c = config;
    ParallelConfig& par = c.parallel;
    par.world_size = n;
    par.tensor_model_parallel_size = l.tp;
    par.pipeline_model_parallel_size = l.pp;
    par.virtual_pipeline_model_parallel_size =
        l.vp > 0 ? std::optional<int64_t>(l.vp) : std::nullopt;
    par.context_parallel_size = l.cp;
    par.hierarchical_context_parallel_sizes.clear();
    par.expert_model_parallel_size = l.ep;
    par.expert_tensor_parallel_size.reset();
    par.num_distributed_optimizer_instances = 1;
    par.microbatch_group_size_per_vp_stage.reset();
    par.num_layers = model.num_layers;
    par.sequence_parallel = l.sequence_parallel;
    par.tp_comm_overlap = l.tp_comm_overlap;
    par.overlap_moe_expert_parallel_comm = l.overlap_moe_expert_parallel_comm;
    par.delay_wgrad_compute = l.delay_wgrad_compute;
    RunConfig run = base_run;
    run.micro_batch_size = l.micro_batch_size;
    run.num_microbatches = batch / (l.micro_batch_size * l.dp);
    run.global_batch_size = batch;
    run.recompute = l.recompute;
    // "full": every layer recomputed alone (Megatron's uniform method, one layer per group);
    // "selective": core attention (Megatron's default recompute_modules).
    run.recompute_method = l.recompute == RunConfig::Recompute::kFull
                               ? RunConfig::RecomputeMethod::kUniform
                               : RunConfig::RecomputeMethod::kNone;
    run.recompute_num_layers.reset();
    if (l.recompute == RunConfig::Recompute::kFull) run.recompute_num_layers = 1;
    run.recompute_modules.reset();
    c.run = run;
    if (c.optimizer) {
      c.optimizer->use_distributed_optimizer = l.distributed_optimizer;
      c.optimizer->overlap_grad_reduce = l.overlap_grad_reduce;
      c.optimizer->overlap_param_gather = l.overlap_param_gather;
    }
    if (!CheckGptLayout(c.parallel, *c.run, EstimatedModel(&c)).ok()) return std::nullopt;
    return c;
  };
  // Counted once each: the topology of (tp, cp, ep, pp, vp, sp), and held memory, which depends
  // on (tp, cp, ep, pp, vp, distributed optimizer) only (cp through the distributed optimizer's
  // shards over dp x cp).
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool>;
  std::map<Key, std::optional<Topology>> topologies;
  // Held memory is counted after the enumeration, once per key, on every core (it builds
  // each stage's busiest rank's model, the search's costliest part for a large MoE model).
  struct HeldSlot {
    std::optional<Config> config;
    const Topology* topology = nullptr;
    std::optional<std::vector<StageHeldMemory>> value;
  };
  std::map<Key, HeldSlot> held;
  const auto topology_of = [&](const Config& c, const AdvisedLayout& l) -> const Topology* {
    auto [it, added] =
        topologies.try_emplace(Key{l.tp, l.cp, l.ep, l.pp, l.vp, l.sequence_parallel},
                               std::nullopt);
    if (added) {
      StatusOr<Topology> t = Topology::Create(c.parallel);
      if (t.ok()) it->second = *std::move(t);
    }
    return it->second ? &*it->second : nullptr;
  };
  std::map<std::tuple<int64_t, int64_t, int64_t, bool>, std::optional<PipelineSchedule>>
      schedules;
  const auto schedule_of = [&](const AdvisedLayout& l) -> const PipelineSchedule* {
    const int64_t m = batch / (l.micro_batch_size * l.dp);
    const bool combined = l.overlap_moe_expert_parallel_comm;
    auto [it, added] = schedules.try_emplace({l.pp, l.vp, m, combined}, std::nullopt);
    if (added) {
      StatusOr<PipelineSchedule> s = BuildPipelineSchedule(
          l.pp, l.vp > 0 ? std::optional<int64_t>(l.vp) : std::nullopt, m, std::nullopt,
          combined);
      if (s.ok()) it->second = *std::move(s);
    }
    return it->second ? &*it->second : nullptr;
  };
  const auto held_slot = [&](const Config& c, const Topology& t,
                             const AdvisedLayout& l) -> HeldSlot* {
    auto [it, added] =
        held.try_emplace(Key{l.tp, l.cp, l.ep, l.pp, l.vp, l.distributed_optimizer});
    if (added) {
      it->second.config = c;
      it->second.topology = &t;
    }
    return &it->second;
  };
  // First every candidate, with the topology, held memory and schedule it shares with others;
  // then each one's activations, peak and (when it fits) step time, on every core: those are
  // pure functions of the candidate and what it shares, which is no longer changed.
  struct Candidate {
    AdvisedLayout layout;
    const Topology* topology;
    HeldSlot* slot;
    const std::vector<StageHeldMemory>* held;  // the slot's, once counted
    const PipelineSchedule* schedule;
  };
  std::vector<Candidate> candidates;
  // The layouts advise searches (core/layout_space.h), in the space's order: tp, cp, pp, vp,
  // sequence parallelism, the distributed optimizer, the micro-batch size, ep, recomputation.
  LayoutSpace space;
  space.world_size = n;
  space.max_tp = max_tp;
  space.gpus_per_node = config.parallel.gpus_per_node;
  space.max_cp = options.max_cp;
  space.num_layers = model.num_layers;
  space.virtual_pipeline = options.virtual_pipeline
                               ? LayoutSpace::VirtualPipeline::kDividingStageLayers
                               : LayoutSpace::VirtualPipeline::kNone;
  space.sequence_parallel = options.sequence_parallel;
  space.distributed_optimizer = options.distributed_optimizer;
  space.has_optimizer = config.optimizer.has_value();
  space.global_batch_size = batch;
  space.micro_batch_sizes = options.micro_batch_sizes;
  space.num_experts = model.moe.enabled() ? model.moe.num_experts : 0;
  space.recompute = options.recompute;
  // An empty recompute list searches nothing (in the space it would mean "not searched").
  const std::vector<Layout> layouts =
      options.recompute.empty() ? std::vector<Layout>{} : EnumerateLayouts(space);
  for (const Layout& l : layouts) {
    const int64_t tp = l.tp, pp = l.pp, vp = l.vp, ep = l.ep;
    const bool sp = l.sequence_parallel, distributed = l.distributed_optimizer;
    const RunConfig::Recompute recompute = *l.recompute;
    AdvisedLayout layout{tp, pp, vp, l.dp, l.cp, ep, l.micro_batch_size, recompute, sp,
                         distributed, {}};
    // The overlap options wherever Megatron allows them.
    layout.overlap_grad_reduce = options.overlap_grad_reduce && config.optimizer;
    layout.overlap_param_gather =
        options.overlap_param_gather && layout.overlap_grad_reduce && distributed;
    layout.tp_comm_overlap = options.tp_comm_overlap && sp && tp > 1;
    layout.overlap_moe_expert_parallel_comm =
        options.overlap_moe_expert_parallel_comm && ep > 1 && (pp == 1 || vp > 0) &&
        recompute != RunConfig::Recompute::kFull &&
        model.moe.token_dispatcher == MoeDispatcher::kAllToAll &&
        (base_run.dtype == DType::kBFloat16 || base_run.dtype == DType::kFloat16);
    layout.delay_wgrad_compute =
        layout.overlap_moe_expert_parallel_comm && options.delay_wgrad_compute;
    const std::optional<Config> c = configure(layout);
    if (!c) continue;
    const Topology* topology = topology_of(*c, layout);
    if (topology == nullptr) continue;
    HeldSlot* slot = held_slot(*c, *topology, layout);
    const PipelineSchedule* schedule = schedule_of(layout);
    if (schedule == nullptr) continue;
    candidates.push_back({layout, topology, slot, nullptr, schedule});
  }
  std::vector<HeldSlot*> slots;
  for (auto& [key, slot] : held) slots.push_back(&slot);
  ParallelFor(slots.size(), [&](size_t i) {
    HeldSlot& slot = *slots[i];
    StatusOr<std::vector<StageHeldMemory>> h =
        EstimateStageHeldMemory(*slot.config, *slot.topology);
    if (h.ok()) slot.value = *std::move(h);
  });
  std::erase_if(candidates, [](Candidate& k) {
    if (!k.slot->value) return true;
    k.held = &*k.slot->value;
    return false;
  });
  std::vector<std::optional<AdvisedLayout>> evaluated(candidates.size());
  ParallelFor(candidates.size(), [&](size_t i) {
    const Candidate& k = candidates[i];
    AdvisedLayout layout = k.layout;
    const Config c = *configure(layout);
    StatusOr<std::vector<StageActivations>> acts =
        EstimateStageActivations(c, *k.topology, advice.attention, k.schedule);
    if (!acts.ok()) return;
    // The stage that needs the most, its peak and the reserve of its busiest rank together.
    for (size_t s = 0; s < acts->size(); ++s) {
      const StageActivations& a = (*acts)[s];
      const PlanBytes transient = SaturatingAdd(a.activations, a.buffers);
      const PlanBytes peak = (*k.held)[s].held.PeakWith(transient);
      const PlanBytes reserved =
          options.reserve_bytes
              ? *options.reserve_bytes
              : EstimateMemoryReserve(c, *k.topology, gpu, (*k.held)[s].rank, transient).total;
      if (s == 0 || SaturatingAdd(peak, reserved) > layout.needed()) {
        layout.peak = peak;
        layout.reserved = reserved;
        layout.peak_stage = static_cast<int64_t>(s);
        layout.activations = a.activations;
      }
    }
    layout.fits = layout.needed() <= static_cast<PlanBytes>(gpu.hbm_bytes);
    // The step time of those that fit; of the others, only the closest few's (below).
    if (layout.fits) {
      StatusOr<TimeEstimate> time = EstimateStepTime(c, *k.topology, gpu, k.held, k.schedule);
      if (!time.ok()) return;
      layout.time = *std::move(time);
    }
    evaluated[i] = std::move(layout);
  });
  for (std::optional<AdvisedLayout>& layout : evaluated) {
    if (!layout) continue;
    ++advice.candidates;
    (layout->fits ? advice.fit : advice.too_big).push_back(*std::move(layout));
  }
  std::stable_sort(advice.fit.begin(), advice.fit.end(),
                   [](const AdvisedLayout& a, const AdvisedLayout& b) {
                     return a.time.step_time_s < b.time.step_time_s;
                   });
  // Near-ties (advise.h): runs of step times within kNearTie of the run's fastest, each
  // ranked by headroom; the stable sorts keep the search's order last.
  const auto hbm = static_cast<PlanBytes>(gpu.hbm_bytes);
  int64_t run = 0;
  for (size_t begin = 0; begin < advice.fit.size(); ++run) {
    const double limit = advice.fit[begin].time.step_time_s * (1 + kNearTie);
    size_t end = begin + 1;
    while (end < advice.fit.size() && advice.fit[end].time.step_time_s <= limit) ++end;
    const auto first = advice.fit.begin() + static_cast<std::ptrdiff_t>(begin);
    const auto last = advice.fit.begin() + static_cast<std::ptrdiff_t>(end);
    std::stable_sort(first, last, [&](const AdvisedLayout& a, const AdvisedLayout& b) {
      const PlanBytes free_a = hbm - a.needed(), free_b = hbm - b.needed();
      if (free_a != free_b) return free_a > free_b;
      return a.time.step_time_s < b.time.step_time_s;
    });
    for (auto it = first; it != last; ++it) it->tie_run = run;
    begin = end;
  }
  std::stable_sort(advice.too_big.begin(), advice.too_big.end(),
                   [](const AdvisedLayout& a, const AdvisedLayout& b) {
                     return a.needed() < b.needed();
                   });
  const size_t timed = std::min(advice.too_big.size(), options.timed_misses);
  for (size_t i = 0; i < timed; ++i) {
    AdvisedLayout& l = advice.too_big[i];
    // Each was configured, its topology made and its held memory counted above.
    const Config c = *configure(l);
    const Topology* topology = topology_of(c, l);
    const HeldSlot* slot = held_slot(c, *topology, l);
    StatusOr<TimeEstimate> time =
        EstimateStepTime(c, *topology, gpu, &*slot->value, schedule_of(l));
    if (time.ok()) l.time = *std::move(time);
  }
  return advice;
}

}  // namespace mpusim
