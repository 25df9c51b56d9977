// Pipeline schedules: Megatron-Core's 1F1B and interleaved 1F1B as per-pipeline-rank tables of
// forward and backward steps.
//
// This is the *order* in which each pipeline rank runs its compute, reproduced exactly from
// Megatron-Core (checked against tests/data/golden/schedules). It is not a timing model, it
// does no communication, and it knows nothing about what a forward or backward computes.
//
// Notation: p = pipeline_model_parallel_size, v = virtual_pipeline_model_parallel_size
// (number of model chunks per rank), M = num_microbatches,
// N = microbatch_group_size_per_vp_stage, r = pp_rank.
//
// Non-interleaved 1F1B (v not given, one chunk):
//   warmup(r) = min(p - r - 1, M) forwards,
//   then M - warmup(r) steady pairs (F k+warmup, B k), then warmup(r) cooldown backwards.
//   Rank p-1 starts at once with F0 B0 F1 B1 ...; rank 0 has the most activations in flight.
//
// Interleaved 1F1B (v given, p > 1): each rank runs M*v virtual microbatches. All ranks share
// one forward table of (microbatch, chunk) pairs, built group by group. Groups start at
// g0 = 0, N, 2N, ...; a group covers microbatches [g0, g0+N), except that the group with
// g0 + N >= M is the last one and covers [g0, M). Within a group, chunks run in order, and
// for each chunk the group's microbatches in order:
//   table = for g0: for chunk in 0..v-1: for mb in group(g0): (mb, chunk)
// Forward k runs table[k]; backward k runs table[k] with chunk c replaced by v-1-c, because
// gradients flow through the chunks in reverse.
//   warmup(r) = min((p - r - 1) * 2 + (v - 1) * N, M*v)
// then M*v - warmup(r) steady pairs (F k+warmup, B k), then the cooldown backwards.
//
// Worked example (Megatron's documentation), p = 2, v = 2, M = 4, N = 2:
//   table microbatches   0 1 0 1 2 3 2 3,  chunks 0 0 1 1 0 0 1 1
//   rank 0, warmup 4:    F0.0 F0.1 F1.0 F1.1 | F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 |
//                        B1.2 B1.3 B0.2 B0.3
//   rank 1, warmup 2:    F0.0 F0.1 | F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2
//                        F1.3 B1.3 | B0.2 B0.3
//
// Allowed interleaved inputs, as Megatron enforces them: p <= N <= M, and the final group
// size M % N is either 0 or at least p (a shorter final group would leave the pipeline
// waiting on microbatches that do not exist).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/pipeline_split.h"
#include "core/status.h"

namespace mpusim {

enum class Pass { kForward, kBackward };

struct ScheduleStep {
  Pass pass;
  int64_t model_chunk;
  int64_t microbatch;
};

// "F<chunk>.<microbatch>" or "B<chunk>.<microbatch>", e.g. "F1.0", as in the golden files.
std::string FormatStep(const ScheduleStep& step);

struct PipelineSchedule {
  bool interleaved;  // virtual_pipeline_model_parallel_size was given
  int64_t pipeline_model_parallel_size;
  int64_t num_model_chunks;  // v, or 1 when not interleaved
  int64_t num_microbatches;
  // Effective N: the given value, else p (Megatron's default; unused when not interleaved).
  int64_t microbatch_group_size_per_vp_stage;
  // Megatron's combined 1F1B (overlap_moe_expert_parallel_comm): one more warmup forward on
  // every rank, and each steady forward runs beside the backward that follows it.
  bool combined_1f1b = false;
  // Forward order of (microbatch_id, model_chunk_id), the same on every pp rank
  // (Megatron's schedule table). Size M*v.
  std::vector<std::pair<int64_t, int64_t>> forward_table;
  // per_rank[pp_rank] is that rank's execution order; 2*M*v steps each.
  std::vector<std::vector<ScheduleStep>> per_rank;

  // Megatron's num_warmup_microbatches for pp_rank: the forwards run before the steady 1F1B
  // phase. The steady phase opens with one more forward, so the first backward comes after
  // min(NumWarmup + 1, M*v) forwards. Requires 0 <= pp_rank < p (std::out_of_range otherwise:
  // a bad rank here is a caller bug, not bad user input).
  int64_t NumWarmup(int64_t pp_rank) const;
  // With combined_1f1b: whether steps i and i + 1 of pp_rank are one of its steady phase's
  // (forward, backward) pairs, which Megatron runs together (warmup forwards and cooldown
  // backwards run alone). False without combined_1f1b.
  bool CombinedPairAt(int64_t pp_rank, size_t i) const;
};

// The schedule lists every step of every rank; this bounds what it lists (far beyond any real
// run: 2^24 steps), so that absurd sizes are refused instead of exhausting memory.
inline constexpr int64_t kMaxScheduleSteps = int64_t{1} << 24;

// Builds every rank's schedule. Refuses, naming the field and what is allowed:
//   more than kMaxScheduleSteps steps in all (pp * 2 * M * v);
//   sizes below 1; v given with p == 1; N given without v (it only shapes the interleaved
//   schedule); for interleaved, N outside [p, M] and 0 < M % N < p; combined_1f1b (Megatron's
//   overlap_moe_expert_parallel_comm: one more warmup forward per rank) with p > 1 and no v.
StatusOr<PipelineSchedule> BuildPipelineSchedule(
    int64_t pipeline_model_parallel_size,
    std::optional<int64_t> virtual_pipeline_model_parallel_size, int64_t num_microbatches,
    std::optional<int64_t> microbatch_group_size_per_vp_stage, bool combined_1f1b = false);

// pp_rank's steps joined by single spaces, e.g. "F0.0 F0.1 F1.0 B1.0 ...". Requires
// 0 <= pp_rank < p (std::out_of_range otherwise).
std::string FormatRank(const PipelineSchedule& schedule, int64_t pp_rank);

// The schedule on an idealised machine: every forward takes `forward` time units, every
// backward `backward`, communication is free, and a step starts as soon as its rank's previous
// step has ended and the step it needs has: the forward of (chunk, m) on virtual stage
// u = chunk * p + rank needs the forward of (u - 1, m), its backward the backward of
// (u + 1, m). With equal costs 1F1B takes (M + p - 1)(F + B): the bubble fraction
// (p - 1) / (M + p - 1) of Megatron's paper. For pictures and the bubble a schedule implies;
// the executor's timeline (`mpusim run --summary`) is the measured counterpart.
struct ScheduleTiming {
  std::vector<std::vector<double>> start;  // [pp_rank][step of per_rank[pp_rank]]
  std::vector<std::vector<double>> end;
  double makespan = 0;
  // Idle time over p * makespan.
  double BubbleFraction() const;
  // The most micro-batches between their forward and backward at once on `pp_rank`.
  static int64_t PeakInFlight(const PipelineSchedule& schedule, int64_t pp_rank);
};
// Requires forward, backward > 0 (std::invalid_argument otherwise).
ScheduleTiming TimeSchedule(const PipelineSchedule& schedule, double forward, double backward);

// The same replay with a cost per virtual stage u = chunk * p + rank (the stages of a real
// model differ: the first holds the embedding, the last the output layer and the loss) and a
// transfer time added to every dependency between two ranks (the p2p send of an activation
// or its gradient; a dependency within a rank, p == 1, costs nothing). The step-time estimate
// (core/estimate/time_estimate.h) replays Megatron's own schedule with it. Requires one
// forward and backward cost >= 0 per virtual stage (0: an empty stage of a layout, which only
// passes its input on) and transfer >= 0 (std::invalid_argument otherwise).
struct StageCosts {
  std::vector<double> forward;   // [virtual stage]
  std::vector<double> backward;  // [virtual stage]
  double transfer = 0;
  // Megatron's sends block (p2p_communication.py waits on every batch_isend_irecv unless
  // overlap_p2p_comm): a step whose output goes to another rank holds its own rank for the
  // transfer too, before its next step can start. False: sends overlap the next step.
  bool blocking_sends = false;
  // [virtual stage], or empty (none): seconds the first forward of that virtual stage (its
  // first micro-batch) waits before it starts, on top of its inputs (the exposed part of the
  // parameter all-gather that Megatron's overlap_param_gather runs before it).
  std::vector<double> first_forward_wait = {};
  // With a combined 1F1B schedule (PipelineSchedule::combined_1f1b), or empty: the seconds
  // saved when the forward of virtual stage f runs beside the backward of virtual stage b that
  // follows it on the rank, [f * stages + b] (their all-to-alls hidden behind each other's
  // compute). Such a pair starts when both can and both end at its start + forward + backward
  // - saving.
  std::vector<double> combined_saving = {};
};
ScheduleTiming TimeSchedule(const PipelineSchedule& schedule, const StageCosts& costs);

// The layer assignment (AssignLayers) is core/pipeline_split.h's.

}  // namespace mpusim
