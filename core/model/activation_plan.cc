// The activations a rank of the GPT's executor holds over its schedule (see activation_plan.h).
#include "core/model/activation_plan.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <utility>

#include "core/model/attention.h"
#include "core/model/gpt_model.h"
#include "core/model/layer_norm.h"
#include "core/model/mla_attention.h"
#include "core/model/mlp.h"
#include "core/model/moe.h"
#include "core/model/transformer_layer.h"
#include "core/pipeline/pipeline_plan.h"
#include "core/tensor.h"

namespace mpusim {
namespace {

double Max(std::initializer_list<double> values) { return std::max(values); }

// The bytes of the tensors of `plan` whose names start with `prefix`, in declaration order.
double Bytes(const StashPlan& plan, std::string_view prefix) {
  double sum = 0;
  for (const StashTensor& tensor : plan.tensors()) {
    if (tensor.name.starts_with(prefix)) sum += tensor.bytes();
  }
  return sum;
}

}  // namespace

MoeRoute RouteMoe(const GptConfig& g, const DerivedSizes& sz, bool sp, double T,
                  MoeRouting routing) {
  const MoeConfig& moe = g.moe;
  const double E = static_cast<double>(moe.num_experts);
  const double K = static_cast<double>(moe.router_topk);
  const double ep = static_cast<double>(sz.ep), L = E / ep;
  const double te = static_cast<double>(sz.etp), t = static_cast<double>(sz.tp);
  const bool a2a = moe.token_dispatcher == MoeDispatcher::kAllToAll;
  MoeRoute r;
  r.group = sz.experts_apart() ? te * ep : sp ? t : 1;
  r.gather = sz.experts_apart() ? te : sp ? t : 1;
  // The most choices one (source rank, expert) pair keeps: its capacity C when that is
  // below T (moe.cc drops the rest), else every token.
  double capacity = T;
  if (moe.expert_capacity_factor) {
    capacity = std::min(T, std::ceil(T * K / E * *moe.expert_capacity_factor));
  }
  if (routing == MoeRouting::kBalanced) {
    const double kept = std::min(T * K / E, capacity);
    r.local = L * kept;
    r.sent = E * kept;
  } else {
    r.local = std::min(T * std::min(K, L), L * capacity);
    r.sent = std::min(T * K, E * capacity);
  }
  r.arrived = ep * r.local;
  r.rows = a2a ? r.gather * r.arrived : r.group * r.local;
  r.src = a2a ? (r.gather > 1 ? r.gather * r.arrived : ep > 1 ? r.arrived : r.sent) : r.group * T;
  return r;
}

DeclaredStashes DeclareStashes(const Config& config, const Topology& topology,
                               MoeRouting routing) {
  const GptConfig& g = *config.gpt;
  const RunConfig& run = *config.run;
  const DerivedSizes& sz = topology.sizes();
  DeclaredStashes d;
  d.shape = StreamShape{.s = run.seq_length,
                        .b = run.micro_batch_size,
                        .t = sz.tp,
                        .sequence_parallel = topology.config().sequence_parallel && sz.tp > 1,
                        .cp = sz.cp};
  if (g.moe.enabled()) {
    d.route = RouteMoe(g, sz, d.shape.sequence_parallel,
                       static_cast<double>(d.shape.stream_rows()), routing);
    const bool a2a = g.moe.token_dispatcher == MoeDispatcher::kAllToAll;
    d.moe =
        MoeLayer::PlanStash(g, d.shape, run.dtype, sz.etp, d.route.rows, a2a ? d.route.sent : 0);
  }
  // A layer as it keeps everything but what selective recomputation drops (full
  // recomputation's choice of layers is DeclaredChunkStash's, per chunk).
  const LayerRecompute kept = LayerRecompute::Kept(run);
  d.dense_layer = TransformerLayer::PlanStash(g, d.shape, run.dtype, kept);
  d.moe_layer = TransformerLayer::PlanStash(g, d.shape, run.dtype, kept, &d.moe);
  return d;
}

StashPlan DeclaredChunkStash(const Config& config, const Topology& topology,
                             const DeclaredStashes& declared, int64_t u) {
  const GptConfig& g = *config.gpt;
  const std::vector<StageLayers> split = CheckedStages(topology.config().Split(), g.num_layers);
  const auto stages = static_cast<int64_t>(split.size());
  const StageLayers& mine = split.at(static_cast<size_t>(u));
  GptChunk chunk{.layers = {}, .pre_process = u == 0, .post_process = u == stages - 1};
  std::vector<StashPlan> plans;
  for (int64_t i = mine.first; i < mine.first + mine.count; ++i) {
    const bool is_moe = g.moe.enabled() && g.moe.layers[static_cast<size_t>(i)];
    chunk.layers.push_back(i);
    const LayerRecompute keep = LayerRecompute::Of(*config.run, i - mine.first, mine.count);
    plans.push_back(keep.keep == LayerRecompute::Keep::kAll
                        ? (is_moe ? declared.moe_layer : declared.dense_layer)
                        : TransformerLayer::PlanStash(g, declared.shape, config.run->dtype, keep,
                                                      is_moe ? &declared.moe : nullptr));
  }
  // Multi-token prediction's layers are built like the last decoder layer (an MoE layer where
  // it is one) and never fully recomputed (GptModel::Build).
  const bool mtp_moe = g.moe.enabled() && g.moe.layers.back();
  return GptModel::PlanStash(g, declared.shape, config.run->dtype, chunk, plans,
                             mtp_moe ? &declared.moe_layer : &declared.dense_layer,
                             config.run->CheckpointsMtpDepths());
}

StatusOr<std::vector<ScheduleActivations>> PlanScheduleActivations(
    const Config& config, const Topology& topology, MoeRouting routing,
    const PipelineSchedule* schedule) {
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
  const bool hidden_dropout = g.hidden_dropout > 0, attention_dropout = g.attention_dropout > 0;
  const bool qk_norm = g.qk_layernorm;
  const bool ring = sz.cp > 1 && (g.cp_comm_type == CpCommType::kP2p ||
                                  g.cp_comm_type == CpCommType::kA2aP2p);
  const bool gathered = sz.cp > 1 && g.cp_comm_type == CpCommType::kAllGather;

  const double stream = Rs * h * e;   // a residual-stream tensor
  const double full = R * h * e;      // the same with every row (gathered under sp)
  const double q = R * al * dk * e;   // this rank's queries (and the context)
  const double kv = R * gl * dk * e;  // its keys, or its values
  const double qkv = R * (al + 2 * gl) * dk * e;
  const double probs = R * al * s * e;  // its queries' scores over every key

  // --- the stash of one layer: the modules' declarations (core/model/stash_plan.h) ---
  const DeclaredStashes declared = DeclareStashes(config, topology, routing);
  const StreamShape& shape = declared.shape;
  const bool selective_core = run.Recomputes(RunConfig::RecomputeModule::kCoreAttn);
  // Core attention's stash (rebuilt by selective recomputation in the backward).
  const double core = g.mla.enabled
                          ? Bytes(MlaSelfAttention::PlanStash(g, shape, run.dtype, true), "core.")
                          : Bytes(SelfAttention::PlanStash(g, shape, run.dtype, true), "core.");
  // A layer's stash but its input, as kept (or, under full recomputation, as rebuilt).
  const LayerRecompute kept = LayerRecompute::Kept(run);
  const auto inner_of = [&](const StashPlan* moe) {
    return Bytes(TransformerLayer::PlanStash(g, shape, run.dtype, kept, moe), "inner.");
  };
  const double inner = inner_of(nullptr);

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
    // The ring's backward (core_attention.cc RingBackward): d context and its copy ("a2a+p2p":
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
  double qkv_point = after_core + qkv + full + (sp ? full : 0) + weight_grad((al + 2 * gl) * dk, h);
  double proj_point = dmlp + 2 * stream + dattn + (sp ? full : 0) + q + weight_grad(h, al * dk);
  if (g.mla.enabled) {
    // Multi-latent attention's backward (MlaSelfAttention::Backward) in its phases, on top of
    // the layer's gradients (`outer`): linear_proj's (its gathered dy under sp, d context C,
    // the weight's gradient); core attention's (d context's copy, d probs, d value, with
    // dropout the dropped copy, d scores, d query, d key); the way back to the up
    // projections' gradients dq [R, a_l*dq], dkv [R, a_l*(qk + dv)] and k_pe's [R, pe] (with
    // the rope matrices [s, pe, pe] and the rope channels' copies [R*a_l, pe], d query, d key
    // and d value freed in turn); the key side (linear_kv_up_proj's backward, kv_layernorm's,
    // the gathered latent, the [R, kl + pe] gradient and its tp split, linear_kv_down_proj's),
    // then the query side beside the key side's dx.
    const MlaConfig& mla = g.mla;
    const double qk = static_cast<double>(mla.qk_head_dim);
    const double pe = static_cast<double>(mla.qk_pos_emb_head_dim);
    const double dv = static_cast<double>(mla.v_head_dim);
    const double kl = static_cast<double>(mla.kv_lora_rank);
    const double dqh = qk + pe;
    const double C = R * al * dv * e, Q = R * al * dqh * e, KV = R * al * (qk + dv) * e;
    const double Pe = R * pe * e, PeH = R * al * pe * e, M = s / cp * pe * pe * e;
    // A ColumnParallelLinear's backward of input width `in` (its out/t output columns): dx
    // [R, in], under sp the gathered input, the weight's gradient; then the reduce-scatter's
    // (sp) or the all-reduce's (tp > 1) new dx beside the old.
    const auto column = [&](double out, double in) {
      return R * in * e +
             std::max((sp ? R * in * e : 0) + weight_grad(out, in), sz.tp > 1 ? Rs * in * e : 0);
    };
    const double outer = dmlp + stream /*dln2*/ + stream /*dx1*/ + dattn;
    const double split_copy = sz.tp > 1 ? 1.0 / t : 0.0;  // SplitLastDim's new copy (tp > 1)
    // Core attention's (CoreAttention::Backward; the keys Q wide, the values C). Without a
    // ring, at its fullest: d context and its copy, d probs, d value, the dropped copy, d
    // scores, d query, d key; "all_gather" makes d key and d value of every position and
    // reduce-scatters them (the result beside the old, one at a time); "a2a" exchanges d
    // context first and d query, d key, d value after (send, receive and result buffers).
    double core_a;
    if (ring) {
      // As the GQA ring's below: d context and its copy ("a2a+p2p": and its exchange), each
      // query half's d out, row dot products and dq, the gradients travelling with the block
      // (a key's and a value's), then the block received next or per block its
      // probabilities' tensors; at the end dq, dk, dv in this rank's order ("a2a+p2p":
      // exchanged back one at a time).
      const std::vector<int64_t>& levels = topology.config().hierarchical_context_parallel_sizes;
      const bool hier = g.cp_comm_type == CpCommType::kA2aP2p;
      const double ring_size = hier && !levels.empty() ? cp / static_cast<double>(levels[0]) : cp;
      const double block = R * al / 2 * (s / (2 * ring_size)) * e;
      const double base = 2 * C + (hier ? C : 0) + C + R * al * c + Q + (Q + C);
      const double incoming = ring_size > 1 ? Q + C : 0;
      const double in_order = base + 2 * Q + C;
      core_a = Max({base + incoming + (attention_dropout ? 5 : 3) * block, base + 2 * incoming,
                    in_order, hier ? in_order + std::max(4 * Q, 2 * Q + 3 * C) : 0});
    } else {
      const double whole = gathered ? cp : 1;  // d key and d value of every position
      const double at_most =
          2 * C + (attention_dropout ? 3 : 2) * probs + whole * C + Q + whole * Q;
      core_a = heads      ? Max({5 * C, at_most + 3 * Q, at_most + Q + 3 * C})
               : gathered ? Max({at_most + whole * Q + Q, at_most + Q + whole * C + C})
                          : at_most;
    }
    const double base_b = 3 * Q + C + KV + Pe + M;
    const double way_back = Max({base_b + PeH, base_b - Q + 2 * PeH, base_b - Q - C + 3 * PeH,
                                 base_b - 2 * Q - C + 3 * PeH + Pe, Q + KV + 2 * Pe});
    const double latent = Rs * kl * e, latent_all = R * kl * e;
    const double key_side =
        Max({Q + KV + Pe + column(al * (qk + dv), kl), Q + KV + Pe + latent,
             qk_norm ? Q + Pe + 2 * latent : 0, sp ? Q + Pe + latent + latent_all : 0,
             Q + Pe + latent_all + R * (kl + pe) * e, Q + R * (kl + pe) * e * (1 + split_copy),
             Q + R * (kl + pe) * e * (sz.tp > 1 ? split_copy : 1) + column((kl + pe) / t, h)});
    double query_side;
    if (mla.q_lora_rank) {
      const double ql = static_cast<double>(*mla.q_lora_rank);
      const double q_latent = Rs * ql * e, q_gathered = R * ql * e;
      const double mine = sz.tp > 1 ? R * ql / t * e : q_gathered;
      query_side =
          stream + Max({Q + column(al * dqh, ql), Q + q_latent, qk_norm ? 2 * q_latent : 0,
                        sp ? q_latent + q_gathered : 0, q_gathered + (sz.tp > 1 ? mine : 0),
                        mine + column(ql / t, h), mine + stream});
    } else {
      query_side = stream + Max({Q + column(al * dqh, h), Q + stream});
    }
    attention_point = outer + Max({core_a, way_back, key_side, query_side});
    qkv_point = 0;
    proj_point = outer + (sp ? full : 0) + C + weight_grad(h, al * dv);
  }
  // Recomputation rebuilds layers' tensors (full: `rebuilt`, the group's, before the layer's
  // backward starts) or, selective (TransformerLayer::Backward), core attention's (after
  // linear_proj's backward, kept until the layer's end), each norm's output and statistics
  // ("layernorm": the pre-MLP norm's before the MLP's backward, the input norm's before the
  // attention's, both kept until the layer's end), the dense MLP's inner tensors ("mlp":
  // for the MLP's backward alone) or an MoE layer's (below). `mlp_point`: the most the layer's
  // MLP's backward holds.
  const double norm_rebuilt = run.Recomputes(RunConfig::RecomputeModule::kLayernorm)
                                  ? stream + Norm::PlanStash(g.normalization, Rs, run.dtype).bytes()
                                  : 0;
  const double mlp_rebuilt = run.Recomputes(RunConfig::RecomputeModule::kMlp)
                                 ? Bytes(Mlp::PlanStash(g, shape, run.dtype), "fc1_out") +
                                       Bytes(Mlp::PlanStash(g, shape, run.dtype), "fc2_in.")
                                 : 0;
  // An MoE layer's ("moe_act": the experts' activation; "shared_experts": the shared
  // expert's tensors; "moe": all of its stash but its input), for its backward alone.
  double moe_rebuilt = 0;
  for (const StashTensor& tensor : declared.moe.tensors()) {
    const bool shared = tensor.name.starts_with("shared_");
    if (run.Recomputes(RunConfig::RecomputeModule::kMoe)
            ? tensor.name != "x"
            : (run.Recomputes(RunConfig::RecomputeModule::kMoeAct) && tensor.name == "act") ||
                  (run.Recomputes(RunConfig::RecomputeModule::kSharedExperts) && shared)) {
      moe_rebuilt += tensor.bytes();
    }
  }
  const auto working_of = [&](double rebuilt, double mlp_point, bool dense) {
    const double rebuilt_core = rebuilt + (selective_core ? core : 0);
    const double mlp_side = norm_rebuilt + (dense ? mlp_rebuilt : moe_rebuilt);
    return stream /*dy*/ +
           Max({rebuilt + mlp_side + mlp_point, rebuilt + 2 * norm_rebuilt + proj_point,
                rebuilt_core + 2 * norm_rebuilt + Max({attention_point, qkv_point})});
  };
  const double dense_point = std::max(fc2_point, fc1_point);

  // --- a mixture-of-experts layer in place of the MLP (core/model/moe.h) ---
  // Its stash and backward with the rows of the routing the caller picked (MoeRoute).
  double moe_inner = 0, moe_point = 0;
  if (g.moe.enabled()) {
    const MoeConfig& moe = g.moe;
    const double T = Rs;  // the router's tokens: this rank's rows of the stream
    const double E = static_cast<double>(moe.num_experts);
    const double K = static_cast<double>(moe.router_topk);
    const double te = static_cast<double>(sz.etp);
    const double fm = static_cast<double>(moe.ffn_hidden_size) / te;
    const double fm1 = IsGated(g.activation) ? 2 * fm : fm;
    const bool a2a = moe.token_dispatcher == MoeDispatcher::kAllToAll;
    const double group = declared.route.group;
    const double N = declared.route.rows, src = declared.route.src;
    const double fs = moe.shared_expert_intermediate_size
                          ? static_cast<double>(*moe.shared_expert_intermediate_size) / t
                          : 0;
    const double fs1 = IsGated(g.activation) ? 2 * fs : fs;
    moe_inner = inner_of(&declared.moe);
    // The backward (MoeLayer::Backward): the gathered gradient (allgather without a group:
    // the gradient itself), the scatter targets of dx and d probs, then per expert fc2's and
    // fc1's gradients; after the experts the way back (dx, d probs), the router's gradients
    // and the shared expert's, all kept to the layer's end. The router's tensors in its
    // dtypes (RouterDTypesOf: d probs in `r`, the softmaxes' gradients in `sc`); a router
    // wider than the run's dtype adds the float copies its casts make (`cast_e`: x, the
    // weight, the experts' rows; `cast_s`: between the two router dtypes).
    const RouterDTypes rdt = RouterDTypesOf(moe, run.dtype);
    const double r = static_cast<double>(DTypeSize(rdt.logits));
    const double sc = static_cast<double>(DTypeSize(rdt.scores));
    const bool cast_e = rdt.logits != run.dtype, cast_s = rdt.logits != rdt.scores;
    // The per-logit router's backward (MoeLayer's PerLogitRouterBackward: sigmoid,
    // sqrtsoftplus) computes d logits on the host: of the softmaxes' tensors only d logits
    // [T, E] is on the device.
    const bool sigmoid = moe.PerLogitScores();
    const bool post = !moe.router_pre_softmax && !sigmoid;
    // New tensors for the gathered gradient and the way back (else views of dy and dx_src).
    const bool exchanged = a2a || group > 1;
    const double dy_src = exchanged ? src * h * e : 0;
    const double base = dmlp + dy_src + src * h * e + (a2a ? src : group * T * K) * r;
    const double weigh = cast_e ? 2 * N * fm * r : 0;  // WeightRows' copies in the router dtype
    const double scaled_moe = base + N * h * e + N * fm * e + weigh;
    const double fc2_moe = base + N * h * e + 2 * N * fm * e + weight_grad(h, fm);
    const double dp_moe = base + N * h * e + 2 * N * fm * e + N * r + weigh;
    const double dact_moe = base + N * h * e + 3 * N * fm * e + N * r + weigh;
    const double fc1_moe =
        base + N * h * e + 3 * N * fm * e + N * r + N * fm1 * e + N * h * e + weight_grad(fm1, h);
    const double back = exchanged ? T * (h * e + K * r) : 0;  // dx, d probs
    const bool z_loss = moe.z_loss_coeff.has_value();
    // flat ids, the softmax's int64 positions over the experts, d probs cast, d logits and
    // d scores, d values (post-softmax top-k; its softmax's positions while it runs).
    const double router = sigmoid
                              ? base + back + (cast_s ? T * K * sc : 0) + T * E * sc
                              : base + back + 8 * T * K + 8 * (E + 1) + (cast_s ? T * K * sc : 0) +
                                    2 * T * E * sc + (post ? T * K * sc : 0);
    const double chosen_positions = post ? 8 * (K + 1) : 0;
    const double z_term = z_loss ? T * E * sc + T * sc : 0;       // the term and d lse
    const double router_end = router + (cast_s ? T * E * r : 0);  // d logits in `r`
    const double values_cast = post && cast_s ? T * K * r : 0;
    // The router's two products: dx (with the weight's copy in the GEMM, then dx's copy in
    // the run's dtype) and the weight's gradient (with x's copy, then its own).
    const double dx_router = T * h * r + (cast_e ? std::max(E * h * r, T * h * e) : 0);
    const double w_router = E * h * r + (cast_e ? std::max(T * h * r, E * h * e) : 0);
    const double shared_fc2 = (sp ? full : 0) + R * fs * e + weight_grad(h, fs);
    const double shared_fc1 = R * fs * e + R * fs1 * e + full + (sp ? full : 0) +
                              weight_grad(fs1, h);
    const double shared = fs > 0 ? router_end + std::max(shared_fc2, shared_fc1) : 0;
    moe_point = Max({scaled_moe, fc2_moe, dp_moe, dact_moe, fc1_moe, router + chosen_positions,
                     router + z_term, router_end + values_cast, router_end + dx_router,
                     router_end + w_router, shared});
  }
  // The head's backward: d loss per token, d logits, the output layer's input gradient
  // (with sp its gathered input) and weight gradient.
  const double head_working =
      R * c + R * vocab * e + full + (sp ? full : 0) + weight_grad(vocab, h);

  // The backward of a chunk holding the embedding and no layer (an uneven split's): the
  // gradient it received, the embedding dropout's gradient, and under sequence parallelism
  // the gradient gathered to every row (with learned positions before the position
  // embeddings, with RoPE inside the word embeddings' backward).
  // A chunk holding the head and no layer (an uneven split's) also peaks in the final norm's
  // backward: d loss per token and d logits still held, the norm's output gradient and the
  // input gradient it makes, which is the chunk's output (with layers, the first layer's
  // backward holds more).
  const double head_alone_working = std::max(head_working, R * c + R * vocab * e + 2 * stream);

  // --- multi-token prediction's depths, backwarded first on the post_process chunk ---
  // GptModel::MtpBackward, deepest depth first, holding the gradient passed on from the
  // depth after it (`carried`): the depth's head as the main head's; its final norm's
  // backward; its layer's (dense, or MoE as the last decoder layer), whose Inner it then frees;
  // under sp the gradient gathered to every row, then this rank's columns of it (gather_from's
  // backward); eh_proj's backward (ColumnParallelLinear: d x [R, 2h], with sp its gathered input,
  // the weight gradient, then the reduce-scatter or the all-reduce's copy); the two halves of d
  // concat split; enorm's backward and the embedding dropout's; the word embeddings' gathered
  // gradient; hnorm's backward. Each point is less the depths' Inner already freed; the main head
  // then holds the depths' gradient beside its own, and the decoder's layers start with every
  // depth's Inner freed.
  const int64_t depths = g.mtp_num_layers;
  const bool mtp_moe = g.moe.enabled() && g.moe.layers.back();
  // Full recomputation by "uniform": each depth's checkpoint (its norms' statistics,
  // eh_proj's input, the layer whole, the final norm's input and statistics) is rebuilt after
  // its head's backward, held through the depth's backward (the layer's Inner freed after the
  // layer's) and released at its end; the stash holds none of it.
  const bool mtp_checkpointed = run.CheckpointsMtpDepths();
  double mtp_rebuilt = 0;
  if (mtp_checkpointed && depths > 0) {
    const GptChunk head{.layers = {}, .pre_process = false, .post_process = true};
    const StashPlan* layer_plan = mtp_moe ? &declared.moe_layer : &declared.dense_layer;
    mtp_rebuilt = (GptModel::PlanStash(g, shape, run.dtype, head, {}, layer_plan).bytes() -
                   GptModel::PlanStash(g, shape, run.dtype, head, {}, layer_plan, true).bytes()) /
                  static_cast<double>(depths);
  }
  const double mtp_inner = mtp_moe ? moe_inner : inner;
  double mtp_working = 0, mtp_freed = 0;
  for (int64_t k = depths; k-- > 0;) {
    const double carried = k + 1 < depths ? stream : 0;
    const double col = R * h / t * e;  // d eh_proj's output, this rank's columns
    const double eh_proj =
        col + 2 * full +
        std::max((sp ? 2 * full : 0) + weight_grad(h / t, 2 * h), sp          ? 2 * stream
                                                                  : sz.tp > 1 ? 2 * full
                                                                              : 0);
    const double before =
        Max({carried + head_working, 2 * stream + mtp_rebuilt,
             working_of(mtp_rebuilt, mtp_moe ? moe_point : dense_point, !mtp_moe)});
    mtp_working = std::max(mtp_working, before - mtp_freed);
    // The layer's Inner: freed from the stash after the layer's backward, or from what the
    // checkpoint rebuilt.
    const double held_after = mtp_checkpointed ? mtp_rebuilt - mtp_inner : 0;
    if (!mtp_checkpointed) mtp_freed += mtp_inner;
    const double after = Max({sp ? stream + full : 0, sz.tp > 1 ? full + col : stream, eh_proj,
                              4 * stream, 3 * stream, 2 * stream + (sp ? full : 0)});
    mtp_working = std::max(mtp_working, held_after + after - mtp_freed);
  }
  const double mtp_carried = depths > 0 ? stream : 0;  // the depths' gradient of the final norm
  const double post_head_working =
      depths > 0 ? std::max(mtp_working, head_working + mtp_carried - mtp_freed) : head_working;
  const double post_head_alone_working =
      depths > 0 ? std::max(post_head_working, R * c + R * vocab * e + 2 * stream - mtp_freed)
                 : head_alone_working;
  const double embedding_working = stream + (hidden_dropout ? stream : 0) + (sp ? full : 0);

  const int64_t p = sz.pp, v = sz.vp.value_or(1), stages = p * v;
  // Each virtual stage's layers: the planner's split (uneven ones included).
  const std::vector<StageLayers> split = CheckedStages(topology.config().Split(), g.num_layers);
  std::optional<PipelineSchedule> built;
  if (schedule == nullptr) {
    // Without a pipeline every micro-batch runs its forward and backward alone, so one
    // micro-batch's walk has the peak of any number of them (and 2^31 micro-batches are not
    // listed step by step).
    const int64_t walked = p == 1 ? std::min<int64_t>(run.num_microbatches, 1)
                                  : run.num_microbatches;
    StatusOr<PipelineSchedule> made =
        BuildPipelineSchedule(p, sz.vp, walked,
                              topology.config().microbatch_group_size_per_vp_stage,
                              topology.config().overlap_moe_expert_parallel_comm);
    if (!made.ok()) return made.status();
    built = *std::move(made);
    schedule = &*built;
  }
  // The pipeline's transfers as the executor's MPI walk makes them (core/pipeline/
  // pipeline_walk.h): a receive's buffer from when its batch is posted until its step takes
  // it, every send's tensor until the walk's end (its request holds it).
  const PipelinePlan plan = p > 1 ? PlanPipelineTransfers(*schedule) : PipelinePlan{};
  std::vector<ScheduleActivations> out;
  for (int64_t r = 0; r < p; ++r) {
    std::vector<double> stash(static_cast<size_t>(v)), working(static_cast<size_t>(v));
    for (int64_t chunk = 0; chunk < v; ++chunk) {
      const int64_t u = chunk * p + r;
      const bool post = u == stages - 1;
      // The chunk's declared stash; the most its layers' backwards hold beyond it, in the
      // backward's order: each layer's backward adds its working set and what
      // recomputation rebuilt and still holds (its group's tensors up to this layer: each
      // one's Inner, and the inputs the group's later layers did not keep), less the Inner
      // of every kept layer already backwarded (freed); behind the chunk's last layer the
      // walk still holds the gradient it received (a later stage's).
      stash[static_cast<size_t>(chunk)] = DeclaredChunkStash(config, topology, declared, u).bytes();
      double layer_working = 0, freed = post ? mtp_freed : 0;
      const StageLayers& held = split[static_cast<size_t>(u)];
      const int64_t layers = held.count;
      for (int64_t k = layers; k-- > 0;) {
        const int64_t i = held.first + k;
        const bool is_moe = g.moe.enabled() && g.moe.layers[static_cast<size_t>(i)];
        const RunConfig::RecomputeGroup group = run.GroupOf(k, layers);
        double rebuilt = 0;
        if (group.recomputed) {
          for (int64_t j = group.first; j <= k; ++j) {
            const bool moe_j =
                g.moe.enabled() && g.moe.layers[static_cast<size_t>(held.first + j)];
            rebuilt += (moe_j ? moe_inner : inner) + (j > group.first ? stream : 0);
          }
        }
        const double received = !post && p > 1 && k + 1 < layers ? stream : 0;
        layer_working =
            std::max(layer_working, working_of(rebuilt, is_moe ? moe_point : dense_point, !is_moe) +
                                        received - freed);
        if (!group.recomputed) freed += is_moe ? moe_inner : inner;
      }
      working[static_cast<size_t>(chunk)] =
          layers > 0 ? std::max(layer_working, post ? post_head_working : 0)
          : post     ? post_head_alone_working
          : u == 0   ? embedding_working
                     : stream;  // a chunk that passes its input on holds the gradient it got
    }
    ScheduleActivations act;
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
        act.stashes = stashes;
        act.working = working[chunk];
        act.transfers = transfers;
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
    out.push_back(act);
  }
  return out;
}

}  // namespace mpusim
