// What of the communication overlap hides in the step-time model (time_estimate.h): the
// pipelined-chunks rule (PipelinedExposed) that tp_comm_overlap, overlap_grad_reduce and
// overlap_param_gather follow, TE's bulk overlap, tp_comm_overlap's hidden seconds per layer,
// and the gradient buckets and parameter gathers replayed on the schedule (DpOverlapOf).
// overlap_moe_expert_parallel_comm's pairing (CombinedSeconds) is declared in
// time_estimate.h and defined in comm_overlap.cc. Internal to core/estimate. Not here: what
// the communication costs (comm_cost.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/config/gpt_config.h"
#include "core/estimate/comm_cost.h"
#include "core/estimate/gpu_spec.h"
#include "core/estimate/layer_cost.h"
#include "core/schedule.h"

namespace mpusim::step_time {

// What of `comm` seconds of communication stays exposed when it is cut into `n` equal chunks
// pipelined with `compute` seconds of work, chunk i's transfer beside chunk i-1's work (or
// the reverse): with c = comm / n and g = compute / n the pair takes c + (n - 1) max(c, g) + g,
// i.e. compute + max(comm / n, comm - (n - 1) / n * compute). Exposed: one chunk's transfer
// (the pipeline's fill) when the work covers the rest, else what exceeds the work. n = 1: all
// of it. Used for tp_comm_overlap's chunked collectives, overlap_grad_reduce's buckets
// (ready one by one during the last backward) and overlap_param_gather's (needed one by one
// by the forward).
double PipelinedExposed(double comm, double compute, double n);
// A collective that runs whole beside a GEMM (TE's "bulk" overlap): only what exceeds it.
double BulkExposed(double comm, double compute);

// tp_comm_overlap: the seconds of one layer's tp collectives that Transformer Engine's
// userbuffers hide behind the GEMMs next to them, per pass. TE's defaults
// (transformer_engine/pytorch/module/base.py, initialize_ub):
//   forward:  qkv_fprop and fc1_fprop all-gather their input by "ring_exchange" in tp chunks
//             pipelined with the QKV / fc1 GEMM; proj_fprop and fc2_fprop reduce-scatter their
//             output by "pipeline" in 4 chunks (num_splits 4) with the projection / fc2 GEMM;
//   backward: proj_dgrad and fc2_dgrad all-gather the output gradient by "ring_exchange" (tp
//             chunks) with the dgrad GEMM (as long as the forward GEMM); qkv_wgrad and
//             fc1_wgrad reduce-scatter the input gradient in "bulk" beside the wgrad GEMM.
// mpusim counts a layer's tp traffic as an all-gather and a reduce-scatter of [s, b, h] per
// block (attention, MLP) and pass; each is paired as above. An MoE layer's only overlapped
// collectives are its attention's (the experts' exchanges and a shared expert's tp collective
// stay exposed), as are the embedding's and the output layer's (not TE layers in Megatron).
struct TpOverlap {
  double dense_forward = 0, dense_backward = 0;  // hidden seconds per dense layer and pass
  double moe_forward = 0, moe_backward = 0;      // per MoE layer (its attention's)
};
TpOverlap TpOverlapOf(const GptConfig& g, const Sizes& x, const Link& link, const GpuSpec& gpu,
                      double dense_peak);

// overlap_param_gather and overlap_grad_reduce on the replayed schedule: what of each pipeline
// rank's parameter gather its chunks' first forwards wait for, and what of its gradient
// reduction runs past the pipeline's span. `costs` and `timing`: the stages' costs and their
// replay without gathers; `gather_s`, `reduce_s`: each pp rank's gather and reduction seconds
// (all group kinds, one after the other); `first_chunk_buckets`: the buckets of pipeline rank
// 0's first chunk (every other chunk has one); `p`, `v`: pipeline ranks and chunks per rank.
struct DpOverlap {
  double gather_exposed = 0;  // the step's delay from the gathers (overlap_param_gather)
  double reduce_exposed = 0;  // the reductions' end past the replay (overlap_grad_reduce)
};
DpOverlap DpOverlapOf(const PipelineSchedule& schedule, StageCosts costs,
                      const ScheduleTiming& timing, const std::vector<double>& gather_s,
                      const std::vector<double>& reduce_s, int64_t first_chunk_buckets,
                      bool overlap_reduce, bool overlap_gather, int64_t p, int64_t v);

}  // namespace mpusim::step_time
