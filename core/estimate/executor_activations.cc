#include "core/estimate/executor_activations.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "core/estimate/estimable.h"
#include "core/pipeline/pipeline_plan.h"
#include "core/schedule.h"
#include "core/tensor.h"

namespace mpusim {
namespace {

PlanBytes ToBytes(double bytes) { return static_cast<PlanBytes>(std::llround(bytes)); }

double Max(std::initializer_list<double> values) { return std::max(values); }

}  // namespace

StatusOr<std::vector<ExecutorActivations>> EstimateExecutorActivations(
    const Config& config, const Topology& topology, const std::vector<StageHeldMemory>& held) {
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
  // "a2a" exchanges each back to this rank's tokens: dk's new copy beside the old.
  const bool heads = sz.cp > 1 && g.cp_comm_type == CpCommType::kA2a;
  const double dkey = gathered ? b * gl * s * dk * e + kv : heads ? 2 * kv : kv;
  const double dvalue = kv;
  double attention_point;
  if (ring) {
    // The ring's backward (attention.cc RingBackward): d context and its copy ("a2a+p2p":
    // and its exchange to the ring's heads), each query half's d out, row dot products and
    // dq, the gradients travelling with the block; then per step the block received next,
    // and per block its probabilities, their gradient, the scores' gradient (and with
    // dropout the dropped copies of both), or at the step's end the gradients passed on;
    // at the end dq, dk, dv in this rank's order ("a2a+p2p": exchanged back, one at a
    // time); last the fused qkv gradient.
    const std::vector<int64_t>& levels = topology.config().hierarchical_context_parallel_sizes;
    const bool hier = g.cp_comm_type == CpCommType::kA2aP2p;
    const double ring_size = hier && !levels.empty() ? cp / static_cast<double>(levels[0]) : cp;
    const double chunk = s / (2 * ring_size);  // positions per ring chunk
    const double block = R * al / 2 * chunk * e;  // one query half's block of probabilities
    const double base = 2 * q + (hier ? q : 0) + q + R * al * c + q + 2 * kv;
    const double incoming = ring_size > 1 ? 2 * kv : 0;
    const double in_order = base + q + 2 * kv;
    attention_point = Max({base + incoming + (attention_dropout ? 5 : 3) * block,
                           base + 2 * incoming, in_order,
                           hier ? Max({in_order + 3 * q, in_order + q + 4 * kv}) : 0,
                           2 * q + q + 2 * kv + (qk_norm ? q + kv : 0) + qkv});
  } else {
    const double gradients = 2 * q /*dcontext, its copy*/ + probs /*dprobs*/ + dvalue +
                             (attention_dropout ? probs : 0) + probs /*dscores*/ + q /*dq*/;
    attention_point = gradients + dkey + (qk_norm ? q + kv : 0) + qkv;
    // "a2a": dq's exchange (send, receive and result buffers) before dk's.
    if (heads) attention_point = std::max(attention_point, gradients + kv + 3 * q);
  }
  attention_point += dmlp + stream /*dln2*/ + stream /*dx1*/ + dattn;
  // fc2's and fc1's weight gradients (with sp each GEMM's gathered input), qkv's and proj's.
  const double fc2_point = dmlp + (sp ? full : 0) + R * f * e + weight_grad(h, f);
  const double fc1_point =
      dmlp + R * f * e + R * f1 * e + full + (sp ? full : 0) + weight_grad(f1, h);
  const double after_core = dmlp + stream + stream + dattn + q /*dcontext*/;
  const double qkv_point =
      after_core + qkv + full + (sp ? full : 0) + weight_grad((al + 2 * gl) * dk, h);
  const double proj_point =
      dmlp + 2 * stream + dattn + (sp ? full : 0) + q + weight_grad(h, al * dk);
  // Recomputation rebuilds the layer's tensors (full: before its backward starts) or its
  // core attention's (selective: after linear_proj's backward, kept until the layer's ends).
  const double rebuilt_layer = full_recompute ? inner : 0;
  const double rebuilt_core = full_recompute ? inner : selective ? core : 0;
  const double layer_working =
      stream /*dy*/ + Max({rebuilt_layer + Max({fc2_point, fc1_point, proj_point}),
                           rebuilt_core + Max({attention_point, qkv_point})});
  // The head's backward: d loss per token, d logits, the output layer's input gradient
  // (with sp its gathered input) and weight gradient.
  const double head_working =
      R * c + R * vocab * e + full + (sp ? full : 0) + weight_grad(vocab, h);

  const int64_t p = sz.pp, v = sz.vp.value_or(1), stages = p * v;
  const double layers = static_cast<double>(g.num_layers / stages);
  StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(
      p, sz.vp, run.num_microbatches, topology.config().microbatch_group_size_per_vp_stage);
  if (!schedule.ok()) return schedule.status();
  // The pipeline's transfers as the executor's MPI walk makes them (core/pipeline/
  // pipeline_walk.h): a receive's buffer from when its batch is posted until its step takes
  // it, every send's tensor until the walk's end (its request holds it).
  const PipelinePlan plan = p > 1 ? PlanPipelineTransfers(*schedule) : PipelinePlan{};
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
      // Under full recomputation every layer rebuilds as much, so the chunk's second layer
      // peaks highest: the walk still holds the gradient it received for the first.
      const double received = full_recompute && !post && p > 1 && layers > 1 ? stream : 0;
      working[static_cast<size_t>(chunk)] =
          layers > 0 ? std::max(layer_working + received, post ? head_working : 0)
                     : head_working;
    }
    ExecutorActivations act;
    act.stage = r;
    double stashes = 0, transfers = 0, best = -1;
    int64_t alive = 0;
    const auto step = [&](const ScheduleStep& st) {
      const auto chunk = static_cast<size_t>(st.model_chunk);
      const int64_t u = st.model_chunk * p + r;
      if (st.pass == Pass::kForward) {
        if (u > 0 && p > 1) transfers -= stream;  // the received input joins the stash
        stashes += stash[chunk];
        ++alive;
        return;
      }
      if (u < stages - 1 && p > 1) transfers -= stream;  // the received gradient: its dy
      if (stashes + working[chunk] + transfers > best) {
        best = stashes + working[chunk] + transfers;
        act.peak_stashes = alive;
        act.stashes = ToBytes(stashes);
        act.working = ToBytes(working[chunk]);
        act.transfers = ToBytes(transfers);
      }
      stashes -= stash[chunk];
      --alive;
    };
    if (p == 1) {
      for (const ScheduleStep& st : schedule->per_rank[0]) step(st);
    } else {
      for (const PlanAction& action : plan[static_cast<size_t>(r)]) {
        // Each a receive's buffer, or a sent tensor kept until the end.
        transfers += stream * static_cast<double>(action.batch.size());
        if (action.step) step(*action.step);
      }
    }
    // The optimizer's step, once every stash is gone: each update makes a new parameter
    // tensor; the distributed optimizer also gathers the main_grads into a flat buffer
    // (compute dtype, padded to its D pieces), reduce-scatters it to this rank's piece, and
    // all-gathers the updated pieces in the storage dtype.
    if (config.optimizer) {
      const HeldMemory& mine = held.at(static_cast<size_t>(r)).held;
      const double largest = static_cast<double>(mine.largest_parameter_elements) * e;
      double step_bytes = largest;
      if (config.optimizer->use_distributed_optimizer) {
        const double d = static_cast<double>(mine.dense_shards);
        const double padded =
            std::ceil(static_cast<double>(mine.dense_elements) / d) * d, piece = padded / d;
        // The piece (all of the buffer when d is 1) stays until the next step replaces it.
        const double carried = run.train_iters > 1 ? piece * c : 0;
        const double scatter = padded * c + (d > 1 ? piece * c : 0) + carried;
        const double gather = piece * c + piece * e + (d > 1 ? padded * e : 0) + largest;
        step_bytes = std::max(scatter, gather);
        act.carried = ToBytes(carried);
      }
      act.optimizer_step = ToBytes(step_bytes);
    }
    out.push_back(act);
  }
  return out;
}

}  // namespace mpusim
