// Every layout of a model on N GPUs that the estimates can judge, ranked by predicted
// throughput: `mpusim advise`.
//
// The search, in the layout space (core/layout_space.h) with advise's candidates and caps:
// tensor-parallel size t (a divisor of N, at most the GPUs of a node by default,
// dividing the node's GPU count, the heads and the query groups), context-parallel size c
// (dividing N / t, at most max_cp, 2c dividing the sequence; the model's cp_comm_type),
// pipeline size p (dividing N / (t c) and the layers), the virtual pipeline size v (none, or
// 2.. such that p * v divides the layers, when p > 1 and the micro-batches divide by p),
// dp = N / (t c p), the micro-batch size (dividing global batch / dp), recomputation, sequence
// parallelism (t > 1) and the distributed optimizer, each from the lists the caller allows.
// For a mixture-of-experts model also ep (dividing dp x cp and the experts; the experts'
// tensor parallelism is Megatron's default, tp). Each candidate gets the memory estimate
// (held exactly; activations and buffers by Korthikanti's count with the attention backend
// the dtype and the GPU resolve, core/estimate/activation_estimate.h) and the memory reserve
// (core/estimate/memory_reserve.h, or options.reserve_bytes on every rank); it fits when every stage's peak + reserve is at
// most the GPU's memory. Those that fit get the step time (core/estimate/time_estimate.h) and
// are ranked by it, the fastest first, with near-ties ranked by headroom (below); those that
// do not are ranked by peak + reserve, the closest first, and only the first few get a step
// time.
//
// Near-ties: after sorting by step time, the list is cut into runs. A run starts at the
// fastest layout not yet placed, time t0, and holds every following layout whose step time is
// at most t0 x (1 + kNearTie); the next run starts at the first layout beyond it. Inside a
// run, layouts are ordered by headroom (HBM - peak - reserve of the stage that needs the
// most), the most first, then by step time, then by the order the search tries them (tp,
// cp, pp, vp ascending, then sequence parallelism, the distributed optimizer, the micro-batch
// size, ep and recomputation, each in the order of its list). The order is total and the
// same on every run of the program.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/estimate/attention_backend.h"
#include "core/estimate/time_estimate.h"
#include "core/memory_plan.h"
#include "core/status.h"

namespace mpusim {

struct AdviseOptions {
  int64_t world_size = 0;
  int64_t global_batch_size = 0;
  int64_t max_tp = 0;  // 0: the config's gpus_per_node
  int64_t max_cp = 0;  // 0: no limit; 1: no context parallelism
  std::vector<int64_t> micro_batch_sizes = {1, 2, 4, 8};
  // Searched granularities: "full" is every layer recomputed alone (recompute_method
  // "uniform", recompute_num_layers 1), "selective" core attention (Megatron's defaults).
  std::vector<RunConfig::Recompute> recompute = {RunConfig::Recompute::kNone,
                                                 RunConfig::Recompute::kSelective,
                                                 RunConfig::Recompute::kFull};
  std::vector<bool> sequence_parallel = {false, true};
  std::vector<bool> distributed_optimizer = {false, true};
  bool virtual_pipeline = true;
  // Megatron's overlap options, each on for every candidate that allows it (not searched:
  // overlap never makes a step slower in the time model): overlap_grad_reduce everywhere,
  // overlap_param_gather with the distributed optimizer, tp_comm_overlap with sequence
  // parallelism.
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  bool tp_comm_overlap = false;
  // overlap_moe_expert_parallel_comm (with delay_wgrad_compute when asked) on every candidate
  // Megatron allows it on: ep > 1, no pipelining or the interleaved schedule, no full
  // recomputation, the alltoall dispatcher.
  bool overlap_moe_expert_parallel_comm = false;
  bool delay_wgrad_compute = false;
  size_t timed_misses = 3;  // how many of the closest layouts that do not fit get a step time
  // Replaces the computed memory reserve of every rank (--reserve-gib); nullopt: computed.
  std::optional<PlanBytes> reserve_bytes;
};

// Step times within this fraction of a run's fastest are near-ties, ranked by headroom.
inline constexpr double kNearTie = 0.001;

struct AdvisedLayout {
  int64_t tp = 1, pp = 1, vp = 0, dp = 1;  // vp 0: not interleaved
  int64_t cp = 1;
  int64_t ep = 1;  // expert parallelism, of a mixture-of-experts model
  int64_t micro_batch_size = 1;
  RunConfig::Recompute recompute = RunConfig::Recompute::kNone;
  bool sequence_parallel = false;
  bool distributed_optimizer = false;
  TimeEstimate time;          // of a layout that fits, and of the first timed_misses that do not
  // The overlap options the candidate runs with (AdviseOptions, where allowed).
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  bool tp_comm_overlap = false;
  bool overlap_moe_expert_parallel_comm = false;
  bool delay_wgrad_compute = false;
  // The stage that needs the most memory, peak + reserve: its peak, reserve and activations.
  PlanBytes peak = 0;
  int64_t peak_stage = 0;
  PlanBytes activations = 0;
  PlanBytes reserved = 0;
  bool fits = false;
  int64_t tie_run = 0;  // the near-tie run it is ranked in (0 first), of a layout that fits
  PlanBytes needed() const { return SaturatingAdd(peak, reserved); }
};

struct Advice {
  ResolvedAttention attention;     // what every candidate counts (attention_backend.h)
  int64_t candidates = 0;          // layouts evaluated
  std::vector<AdvisedLayout> fit;  // fastest first
  std::vector<AdvisedLayout> too_big;  // smallest peak first
};

// `config` gives the model (a GPT), the dtype, the optimizer and gpus_per_node; its own
// layout is ignored. Errors name what makes the search impossible.
StatusOr<Advice> Advise(const Config& config, const GpuSpec& gpu, const AdviseOptions& options);

const char* RecomputeName(RunConfig::Recompute r);  // "none", "selective", "full"

}  // namespace mpusim
