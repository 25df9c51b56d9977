// What overlap hides (comm_overlap.h), and overlap_moe_expert_parallel_comm's pair of an MoE
// layer's forward beside another micro-batch's backward (time_estimate.h's CombinedSeconds).
#include "core/estimate/comm_overlap.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/estimate/time_estimate.h"

namespace mpusim {
namespace step_time {

double PipelinedExposed(double comm, double compute, double n) {
  if (comm <= 0) return 0;
  return std::max(comm / n, comm - (n - 1) / n * compute);
}
double BulkExposed(double comm, double compute) { return std::max(0.0, comm - compute); }

TpOverlap TpOverlapOf(const GptConfig& g, const Sizes& x, const Link& link, const GpuSpec& gpu,
                      double dense_peak) {
  const double T = x.tokens(), h = x.h, t = x.t;
  const double heads = static_cast<double>(g.num_attention_heads) / t;
  const double groups = static_cast<double>(g.num_query_groups) / t;
  const double d = static_cast<double>(g.kv_channels);
  const double fc1 = static_cast<double>(g.Fc1Rows()) / t;
  const double f = static_cast<double>(g.ffn_hidden_size) / t;
  // One all-gather or reduce-scatter of the layer's activation over tp.
  const double a = RingSeconds(T * h * x.e, static_cast<int64_t>(t), 1, link.bandwidth,
                               link.latency);
  // The GEMMs each collective runs beside, priced by their shapes as the step prices them
  // (GemmSeconds): C[m, n] = A[m, k] B[k, n].
  const auto gemm = [&](double m, double n, double k) {
    return GemmSeconds(gpu, {m, n, k, 1, x.fp8}, x.e, dense_peak);
  };
  const double qkv_rows = (heads + 2 * groups) * d;
  const double qkv = gemm(T, qkv_rows, h), proj = gemm(T, h, heads * d);
  const double up = gemm(T, fc1, h), down = gemm(T, h, f);
  // The backward's: the projection's and fc2's dgrad (dA = dC B^T), QKV's and fc1's wgrad
  // (dB = A^T dC).
  const double proj_dgrad = gemm(T, heads * d, h), down_dgrad = gemm(T, f, h);
  const double qkv_wgrad = gemm(h, qkv_rows, T), up_wgrad = gemm(h, fc1, T);
  constexpr double kPipelineSplits = 4;  // TE's num_splits for the "pipeline" method
  const auto hidden_pipelined = [&](double gemm_s, double n) {
    return a - PipelinedExposed(a, gemm_s, n);
  };
  const auto hidden_bulk = [&](double gemm_s) { return a - BulkExposed(a, gemm_s); };
  TpOverlap o;
  const double attention_forward =
      hidden_pipelined(qkv, t) + hidden_pipelined(proj, kPipelineSplits);
  const double attention_backward = hidden_pipelined(proj_dgrad, t) + hidden_bulk(qkv_wgrad);
  o.moe_forward = attention_forward;
  o.moe_backward = attention_backward;
  o.dense_forward = attention_forward + hidden_pipelined(up, t) +
                    hidden_pipelined(down, kPipelineSplits);
  o.dense_backward = attention_backward + hidden_pipelined(down_dgrad, t) + hidden_bulk(up_wgrad);
  return o;
}

DpOverlap DpOverlapOf(const PipelineSchedule& schedule, StageCosts costs,
                      const ScheduleTiming& timing, const std::vector<double>& gather_s,
                      const std::vector<double>& reduce_s, int64_t first_chunk_buckets,
                      bool overlap_reduce, bool overlap_gather, int64_t p, int64_t v) {
  DpOverlap out;
  const int64_t stages = p * v;
  const auto buckets_of = [&](int64_t pp_rank, int64_t chunk) -> int64_t {
    return pp_rank == 0 && chunk == 0 ? first_chunk_buckets : 1;
  };
  // overlap_param_gather: each chunk's first forward waits for the exposed part of its
  // gather. Without the interleaved schedule each stage starts its gather at its first
  // forward (Megatron's pre-hook; align_param_gather is off there): the bucketed chunk hides
  // all but PipelinedExposed behind its forward, a one-bucket chunk waits for all of it. With
  // it, Megatron aligns the launches (align_param_gather, on by default in
  // megatron/training/arguments.py): chunks 0 and 1 start at the step's start, chunk c >= 2
  // when chunk c - 1's first forward starts (schedules.py), one after the other on the rank;
  // a chunk waits for what is left when its first forward would start.
  ScheduleTiming gathered_timing;
  const ScheduleTiming* replay = &timing;
  if (overlap_gather) {
    costs.first_forward_wait.assign(static_cast<size_t>(stages), 0.0);
    for (int64_t r = 0; r < p; ++r) {
      const double gather = gather_s[static_cast<size_t>(r)] / static_cast<double>(v);
      // The first forward's start of each chunk in the replay without gathers.
      std::vector<double> first_start(static_cast<size_t>(v), 0.0);
      const auto& steps = schedule.per_rank[static_cast<size_t>(r)];
      for (size_t i = 0; i < steps.size(); ++i) {
        if (steps[i].pass == Pass::kForward && steps[i].microbatch == 0) {
          first_start[static_cast<size_t>(steps[i].model_chunk)] =
              timing.start[static_cast<size_t>(r)][i];
        }
      }
      double done = 0;
      for (int64_t c = 0; c < v; ++c) {
        const auto u = static_cast<size_t>(c * p + r);
        const double forward = costs.forward[u];
        const double pipelined =
            PipelinedExposed(gather, forward, static_cast<double>(buckets_of(r, c)));
        double wait = pipelined;
        if (v > 1) {
          // Aligned: the rank's gathers run one after another from their launches; rank 0's
          // first chunk (launched at 0, its first forward at 0) hides bucket by bucket.
          const double launch = c < 2 ? 0.0 : first_start[static_cast<size_t>(c - 1)];
          done = std::max(done, launch) + gather;
          if (r != 0 || c != 0) wait = std::max(0.0, done - first_start[static_cast<size_t>(c)]);
        }
        costs.first_forward_wait[u] = wait;
      }
    }
    gathered_timing = TimeSchedule(schedule, costs);
    out.gather_exposed = gathered_timing.makespan - timing.makespan;
    replay = &gathered_timing;
  }
  // overlap_grad_reduce: on each rank, a chunk's buckets become ready one by one during its
  // last backward (evenly), a one-bucket chunk's when that backward ends; the rank's reductions
  // run one after the other; the step waits for the last rank's last reduction.
  if (overlap_reduce) {
    double end = replay->makespan;
    for (int64_t r = 0; r < p; ++r) {
      const auto& steps = schedule.per_rank[static_cast<size_t>(r)];
      const auto& starts = replay->start[static_cast<size_t>(r)];
      const auto& ends = replay->end[static_cast<size_t>(r)];
      const double reduce = reduce_s[static_cast<size_t>(r)] / static_cast<double>(v);
      std::vector<std::pair<double, double>> ready;  // (when, seconds)
      for (int64_t c = 0; c < v; ++c) {
        size_t last = 0;
        for (size_t i = 0; i < steps.size(); ++i) {
          if (steps[i].pass == Pass::kBackward && steps[i].model_chunk == c) last = i;
        }
        const int64_t buckets = buckets_of(r, c);
        const auto nb = static_cast<double>(buckets);
        for (int64_t k = 1; k <= buckets; ++k) {
          ready.emplace_back(
              starts[last] + static_cast<double>(k) / nb * (ends[last] - starts[last]),
              reduce / nb);
        }
      }
      std::sort(ready.begin(), ready.end());
      double clock = 0;
      for (const auto& [when, span] : ready) clock = std::max(clock, when) + span;
      end = std::max(end, clock);
    }
    out.reduce_exposed = end - replay->makespan;
  }
  return out;
}

}  // namespace step_time

double CombinedSeconds(const CombinedLayer& l, bool delay_wgrad_compute) {
  const double combine_bwd = l.combine_bwd, attn_fwd = l.attn_fwd;
  const double dgrad = std::max(attn_fwd, combine_bwd) + l.mlp_dgrad;
  const double wgrad = dgrad + l.mlp_wgrad;
  const double dispatch_fwd = std::max(combine_bwd, attn_fwd) + l.dispatch_fwd;
  const double dispatch_bwd =
      std::max(dispatch_fwd, delay_wgrad_compute ? dgrad : wgrad) + l.dispatch_bwd;
  const double mlp_fwd = std::max(wgrad, dispatch_fwd) + l.mlp_fwd;
  const double combine_fwd = std::max(dispatch_bwd, mlp_fwd) + l.combine_fwd;
  const double attn_bwd = std::max(mlp_fwd, dispatch_bwd) + l.attn_bwd;
  return std::max(combine_fwd, attn_bwd);
}

}  // namespace mpusim
