#include "core/estimate/executor_activations.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "core/estimate/estimable.h"
#include "core/schedule.h"
#include "core/tensor.h"

namespace mpusim {
namespace {

PlanBytes ToBytes(double bytes) { return static_cast<PlanBytes>(std::llround(bytes)); }

double Max(std::initializer_list<double> values) { return std::max(values); }

}  // namespace

StatusOr<std::vector<ExecutorActivations>> EstimateExecutorActivations(const Config& config,
                                                                       const Topology& topology) {
  if (Status s = CheckEstimable(config, "the executor's activation count"); !s.ok()) return s;
  const GptConfig& g = *config.gpt;
  const RunConfig& run = *config.run;
  const DerivedSizes& sz = topology.sizes();
  const bool sp = topology.config().sequence_parallel && sz.tp > 1;
  const bool fused = topology.config().gradient_accumulation_fusion;
  const double e = static_cast<double>(DTypeSize(run.dtype));
  const double c = static_cast<double>(DTypeSize(ComputeDType(run.dtype)));
  const double t = static_cast<double>(sz.tp), cp = static_cast<double>(sz.cp);
  const double b = static_cast<double>(run.micro_batch_size);
  const double s = static_cast<double>(run.seq_length);
  const double R = s / cp * b;        // this rank's tokens (rows of the full-width tensors)
  const double Rs = sp ? R / t : R;   // rows of the residual stream
  const double h = static_cast<double>(g.hidden_size), dk = static_cast<double>(g.kv_channels);
  const double al = static_cast<double>(g.num_attention_heads) / t;
  const double gl = static_cast<double>(g.num_query_groups) / t;
  const double f1 = static_cast<double>(g.Fc1Rows()) / t;
  const double f = static_cast<double>(g.ffn_hidden_size) / t;
  const double vocab = static_cast<double>(g.PaddedVocabSize(sz.tp)) / t;
  const double stats = g.normalization == Normalization::kLayerNorm ? 2 : 1;  // mean, rstd
  const bool hidden_dropout = g.hidden_dropout > 0, attention_dropout = g.attention_dropout > 0;
  const bool qk_norm = g.qk_layernorm;
  const bool ring = sz.cp > 1 && (g.cp_comm_type == CpCommType::kP2p ||
                                  g.cp_comm_type == CpCommType::kA2aP2p);
  const bool gathered = sz.cp > 1 && g.cp_comm_type == CpCommType::kAllGather;

  const double stream = Rs * h * e;          // a residual-stream tensor
  const double full = R * h * e;             // the same with every row (gathered under sp)
  const double q = R * al * dk * e;          // this rank's queries (and the context)
  const double kv = R * gl * dk * e;         // its keys, or its values
  const double qkv = R * (al + 2 * gl) * dk * e;
  const double probs = R * al * s * e;       // its queries' scores over every key
  const double norm_stats = stats * Rs * c;  // a norm's statistics over the stream

  // --- the stash of one layer, its input apart ---
  // Core attention: the per-head copies (after qk_layernorm, the norms' outputs too, their
  // inputs kept by the norms' stashes with their statistics over each head's dk).
  double core = q + 2 * kv;
  if (qk_norm) core += q + kv + stats * R * (al + gl) * c;
  if (gathered) core += 2 * (b * gl * s * dk * e - kv);  // every position's keys and values
  if (ring) {
    // The ring's own copy of the queries, the merged output, the log-sum-exp per query row
    // (compute dtype) and the block of keys and values it passes on.
    core += q + q + R * al * c + 2 * kv;
  } else {
    core += attention_dropout ? 2 * probs : probs;
  }
  const bool selective = run.recompute == RunConfig::Recompute::kSelective;
  const bool full_recompute = run.recompute == RunConfig::Recompute::kFull;
  const double inner = norm_stats + stream + qkv + (selective ? 0 : core) + q /*context*/ +
                       stream /*x1*/ + norm_stats + stream /*ln2*/ + R * f1 * e + R * f * e;
  const double layer = full_recompute ? 0 : inner;

  // --- working memory: the first layer's backward ---
  const double dmlp = hidden_dropout ? stream : 0, dattn = dmlp;
  const auto weight_grad = [&](double out, double in) { return fused ? 0.0 : out * in * e; };
  // The keys' and values' gradients as core attention makes them: every position's under
  // all_gather (then reduce-scattered to this rank's: both alive), else this rank's.
  const double dkey = gathered ? b * gl * s * dk * e + kv : kv;
  const double dvalue = kv;
  double attention_point;
  if (ring) {
    // After the ring: dout, the row dot products, dq, the travelling block's gradients, and
    // the gradients in this rank's order, then the fused qkv gradient.
    attention_point = 2 * q /*dcontext, its copy*/ + q /*dout*/ + R * al * c + q /*dq*/ +
                      2 * kv /*dblock*/ + q + 2 * kv /*in order*/ + qkv;
  } else {
    attention_point = 2 * q /*dcontext, its copy*/ + probs /*dprobs*/ + dvalue +
                      (attention_dropout ? probs : 0) + probs /*dscores*/ + q /*dq*/ + dkey +
                      (qk_norm ? q + kv : 0) + qkv;
  }
  attention_point += dmlp + stream /*dln2*/ + stream /*dx1*/ + dattn;
  // fc2's and fc1's weight gradients (with sp each GEMM's gathered input), qkv's and proj's.
  const double fc2_point = dmlp + (sp ? full : 0) + R * f * e + weight_grad(h, f);
  const double fc1_point =
      dmlp + R * f * e + R * f1 * e + full + (sp ? full : 0) + weight_grad(f1, h);
  const double after_core = dmlp + stream + stream + dattn + q /*dcontext*/;
  const double qkv_point = after_core + qkv + full + (sp ? full : 0) + weight_grad(al * dk + 2 * gl * dk, h);
  const double proj_point = dmlp + 2 * stream + dattn + (sp ? full : 0) + q + weight_grad(h, al * dk);
  // Recomputation rebuilds the layer's tensors (full) or its core attention's (selective).
  const double rebuilt = full_recompute ? inner : selective ? core : 0;
  const double layer_working =
      stream /*dy*/ + rebuilt +
      Max({attention_point, fc2_point, fc1_point, qkv_point, proj_point});
  // The head's backward: d loss per token, d logits, the output layer's input gradient
  // (with sp its gathered input) and weight gradient.
  const double head_working =
      R * c + R * vocab * e + full + (sp ? full : 0) + weight_grad(vocab, h);

  const int64_t p = sz.pp, v = sz.vp.value_or(1), stages = p * v;
  const double layers = static_cast<double>(g.num_layers / stages);
  StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(
      p, sz.vp, run.num_microbatches, topology.config().microbatch_group_size_per_vp_stage);
  if (!schedule.ok()) return schedule.status();
  std::vector<ExecutorActivations> out;
  for (int64_t r = 0; r < p; ++r) {
    std::vector<double> stash(static_cast<size_t>(v)), working(static_cast<size_t>(v));
    for (int64_t chunk = 0; chunk < v; ++chunk) {
      const int64_t u = chunk * p + r;
      const bool pre = u == 0, post = u == stages - 1;
      // Every layer's input (the chunk's own input included) and stash.
      double bytes = layers * (stream + layer);
      if (pre || post) bytes += 3 * R * 8;  // tokens, labels, positions
      if (pre && hidden_dropout) bytes += stream;  // the embedding before its dropout
      if (post) {
        // The last layer's output, the final norm's statistics and output, the logits and
        // the cross entropy's row maximum and sum.
        bytes += stream + norm_stats + stream + R * vocab * e + 2 * R * c;
      }
      stash[static_cast<size_t>(chunk)] = bytes;
      working[static_cast<size_t>(chunk)] =
          layers > 0 ? std::max(layer_working, post ? head_working : 0) : head_working;
    }
    double live = 0, peak = 0, peak_stashes_bytes = 0;
    int64_t alive = 0, peak_alive = 0;
    for (const ScheduleStep& step : schedule->per_rank[static_cast<size_t>(r)]) {
      const auto chunk = static_cast<size_t>(step.model_chunk);
      if (step.pass == Pass::kForward) {
        live += stash[chunk];
        ++alive;
        continue;
      }
      if (live + working[chunk] > peak) {
        peak = live + working[chunk];
        peak_stashes_bytes = live;
        peak_alive = alive;
      }
      live -= stash[chunk];
      --alive;
    }
    ExecutorActivations act;
    act.stage = r;
    act.peak_stashes = peak_alive;
    act.stashes = ToBytes(peak_stashes_bytes);
    act.working = ToBytes(peak - peak_stashes_bytes);
    out.push_back(act);
  }
  return out;
}

}  // namespace mpusim
