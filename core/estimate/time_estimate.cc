#include "core/estimate/time_estimate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <utility>

#include "core/config/config.h"
#include "core/config/parallel_config.h"
#include "core/estimate/estimable.h"
#include "core/estimate/memory_estimate.h"
#include "core/schedule.h"
#include "core/tensor.h"

namespace mpusim {
namespace {

constexpr double kTera = 1e12;

// One GEMM of a piece, `times` over (layers of a stage).
struct Gemm {
  GemmShape shape;
  double times = 1;
};

// Per micro-batch costs of one piece of the model: its GEMMs, each by its shape; FLOPs of
// the core attention's GEMMs (at the flat gemm_efficiency); bytes its memory-bound kernels
// move (fp8's cast-transposes apart); and its tp collectives (count, bytes each).
// Flash / fused attention runs at its own efficiency: its seconds and FLOPs apart, with those
// of its backward (which Backward() turns into the pass's own).
struct Cost {
  std::vector<Gemm> gemms;
  double flops = 0;  // the core attention's scores and context
  double bytes = 0;
  double quantize_bytes = 0;  // fp8: the cast-transposes of the GEMMs' inputs
  int64_t collectives = 0;
  double collective_bytes = 0;  // each
  double fused_s = 0, fused_flops = 0;
  double fused_backward_s = 0, fused_backward_flops = 0;
  Cost& operator+=(const Cost& o) {
    gemms.insert(gemms.end(), o.gemms.begin(), o.gemms.end());
    flops += o.flops;
    bytes += o.bytes;
    fused_s += o.fused_s;
    fused_flops += o.fused_flops;
    fused_backward_s += o.fused_backward_s;
    fused_backward_flops += o.fused_backward_flops;
    quantize_bytes += o.quantize_bytes;
    collectives += o.collectives;
    collective_bytes = std::max(collective_bytes, o.collective_bytes);
    return *this;
  }
  double TotalFlops() const {
    double f = flops + fused_flops;
    for (const Gemm& g : gemms) f += g.shape.Flops() * g.times;
    return f;
  }
  // A linear layer's GEMM: y[m, n] = x[m, k] W[k, n]; with fp8 its input's cast-transpose
  // (read 2 bytes, write the row- and column-wise 1-byte copies).
  void Linear(double m, double n, double k, bool fp8, double count = 1, double times = 1) {
    gemms.push_back({{m, n, k, count, fp8}, times});
    if (fp8) quantize_bytes += 4 * m * k * count * times;
  }
};
// `n` of the same piece (layers of a stage).
Cost Times(Cost c, int64_t n) {
  for (Gemm& g : c.gemms) g.times *= static_cast<double>(n);
  c.flops *= static_cast<double>(n);
  c.bytes *= static_cast<double>(n);
  c.quantize_bytes *= static_cast<double>(n);
  c.collectives *= n;
  c.fused_s *= static_cast<double>(n);
  c.fused_flops *= static_cast<double>(n);
  c.fused_backward_s *= static_cast<double>(n);
  c.fused_backward_flops *= static_cast<double>(n);
  return c;
}
// A piece's backward: each GEMM C = A B gives two, dA = dC B^T [m, k] over n and dB = A^T dC
// [k, n] over m (a linear layer's dgrad and wgrad), with fp8 after the cast-transpose of dC;
// the core attention's FLOPs and the bytes twice the forward's; one collective per forward
// collective (the all-reduce of a column-parallel input's gradient answers the forward's
// row-parallel one). Flash / fused
// attention's backward is its own kernel (LayerForward).
Cost Backward(Cost c) {
  std::vector<Gemm> backward;
  c.quantize_bytes = 0;
  for (const Gemm& g : c.gemms) {
    const GemmShape& s = g.shape;
    backward.push_back({{s.m, s.k, s.n, s.count, s.fp8}, g.times});
    backward.push_back({{s.k, s.n, s.m, s.count, s.fp8}, g.times});
    if (s.fp8) c.quantize_bytes += 4 * s.m * s.n * s.count * g.times;
  }
  c.gemms = std::move(backward);
  c.flops *= 2;
  c.bytes *= 2;
  c.fused_s = c.fused_backward_s;
  c.fused_flops = c.fused_backward_flops;
  c.fused_backward_s = c.fused_backward_flops = 0;
  return c;
}
// Backward(c) in its two halves: the data gradients (every GEMM's dA, the memory-bound
// kernels, the collectives, the fused attention's backward) and the weight gradients (every
// GEMM's dB), which Megatron's delay_wgrad_compute runs apart.
std::pair<Cost, Cost> BackwardSplit(const Cost& c) {
  Cost dgrad = Backward(c), wgrad;
  std::vector<Gemm> both = std::move(dgrad.gemms);
  dgrad.gemms.clear();
  for (size_t i = 0; i < both.size(); ++i) (i % 2 == 0 ? dgrad : wgrad).gemms.push_back(both[i]);
  return {dgrad, wgrad};
}
// A forward repeated in the backward (recomputation): its own backward is not repeated.
Cost Recomputed(Cost c) {
  c.fused_backward_s = c.fused_backward_flops = 0;
  return c;
}

// The sizes one rank works on for one micro-batch.
struct Sizes {
  double b, s, h, t;  // micro-batch, sequence, hidden, tp
  double e;           // bytes per element of the storage dtype
  bool sp;            // sequence parallelism: norms and dropouts on s / t tokens
  double cp = 1;      // context parallelism: this rank has s / cp of each sequence's tokens
  bool fp8 = false;   // model.fp8: the linear layers' GEMMs in fp8 (Transformer Engine)
  double tokens() const { return b * s / cp; }
  double region_tokens() const { return sp ? tokens() / t : tokens(); }
};

// One transformer layer's forward, split in the part selective recomputation repeats (the
// core attention: scores, softmax, dropout, context) and the rest.
struct LayerCost {
  Cost core_attention;
  Cost rest;
  // Flash / fused attention under the cp ring: one ring step's kernel seconds, forward and
  // backward (what a step's sends can hide behind).
  double ring_step_forward_s = 0, ring_step_backward_s = 0;
  Cost total() const {
    Cost c = rest;
    c += core_attention;
    return c;
  }
};

// A dense MLP's forward on a tp rank: fc1, the activation function (bias fused: reads fc1's
// output, writes fc2's input), fc2, and its tp collective of the layer's activation.
Cost MlpForward(const Sizes& x, double fc1_rows, double ffn) {
  const double T = x.tokens();
  const double fc1 = fc1_rows / x.t, f = ffn / x.t;
  Cost c;
  c.Linear(T, fc1, x.h, x.fp8);  // fc1: [T, h] x [h, fc1 / t]
  c.Linear(T, x.h, f, x.fp8);    // fc2: [T, f / t] x [f / t, h]
  c.bytes = T * (fc1 + f) * x.e;
  if (x.t > 1) {
    c.collectives = 1;
    c.collective_bytes = T * x.h * x.e;
  }
  return c;
}

// Flash / fused attention kernels (attention_backend.h) on this GPU and dtype.
struct AttentionKernels {
  bool fused = false;
  double peak = 0;  // FLOP/s of the dtype
  double forward_efficiency = 0, backward_efficiency = 0;
  double hbm = 0;  // bytes/s the ring's merges of partial results move at
};
// A flash kernel's efficiency over `keys` keys per query tile: the plateau times
// keys / (keys + L_half), the curve through cuDNN's measured 512- and 16k-position points
// in FlashAttention-3's Figures 5 and 6 (forward 497 and 595 TFLOP/s: L_half 105 keys;
// backward 305 and 516: L_half 374). Small blocks (a cp rank's) run below the plateau.
constexpr double kAttentionHalfKeysForward = 105;
constexpr double kAttentionHalfKeysBackward = 374;
double AttentionEfficiency(double plateau, double half_keys, double keys) {
  return plateau * keys / (keys + half_keys);
}
// Flash kernels tile the s x s scores in 128 x 128 blocks (FlashAttention 2 and 3, cuDNN:
// 128-row query tiles for head dims up to 128) and under a causal mask skip the blocks above
// the diagonal: of n x n blocks they compute n (n + 1) / 2.
constexpr double kAttentionTile = 128;
double CausalShare(double positions) {
  const double n = std::max(1.0, std::ceil(positions / kAttentionTile));
  return (n + 1) / (2 * n);
}
// The backward recomputes the probabilities (QK^T) and runs four GEMMs (dV, dP, dQ, dK):
// 5 GEMMs of the forward's 2, FlashAttention's own count.
constexpr double kFusedBackwardFlops = 2.5;

// One transformer layer's forward without its MLP (MlpForward or MoeForward adds it).
LayerCost LayerForward(const GptConfig& g, const Sizes& x, const AttentionKernels& kernels) {
  const double T = x.tokens(), Tn = x.region_tokens(), h = x.h, t = x.t, e = x.e;
  const double heads = static_cast<double>(g.num_attention_heads) / t;
  const double groups = static_cast<double>(g.num_query_groups) / t;
  const double d = static_cast<double>(g.kv_channels);
  const double mask_byte = 1;  // a dropout mask element
  LayerCost c;
  Cost& r = c.rest;
  // norm 1 and 2: read and write the layer's activation.
  r.bytes += 2 * (2 * Tn * h * e);
  // QKV and projection.
  r.Linear(T, (heads + 2 * groups) * d, h, x.fp8);
  r.Linear(T, h, heads * d, x.fp8);
  if (g.position_embedding_type == PositionEmbedding::kRope) {
    r.bytes += 2 * T * (heads + groups) * static_cast<double>(g.RotaryDim()) * e;
  }
  if (g.qk_layernorm) r.bytes += 2 * T * (heads + groups) * d * e;
  // two bias-dropout-adds: read the branch and the residual, write the sum (and a mask).
  const double dropout_mask = g.hidden_dropout > 0 ? mask_byte : 0;
  r.bytes += 2 * Tn * h * (3 * e + dropout_mask);
  // the attention's tp collective of the layer's activation (all-reduce, or reduce-scatter
  // and all-gather with sequence parallelism).
  if (x.t > 1) {
    r.collectives = 1;
    r.collective_bytes = T * h * e;
  }
  // core attention; under context parallelism this rank's queries against every key (a2a:
  // every query of 1/cp of the heads, as many).
  Cost& a = c.core_attention;
  const double scores = x.b * heads * (x.s / x.cp) * x.s;
  if (!kernels.fused) {
    // Materialised ("unfused", "local"): the full s x s scores whatever the mask, then
    // scale-mask-softmax and dropout over them in memory.
    a.flops += 2 * 2 * scores * d;
    a.bytes += 2 * scores * e;  // fused scale-mask-softmax
    if (g.attention_dropout > 0) a.bytes += scores * (2 * e + mask_byte);
    return c;
  }
  // Flash / fused: one kernel, nothing s x s in memory, the blocks above the causal diagonal
  // skipped. A kernel's efficiency follows the keys each query tile visits.
  const auto seconds_at = [&](double flops, double keys) {
    return std::pair<double, double>{
        flops / (kernels.peak *
                 AttentionEfficiency(kernels.forward_efficiency, kAttentionHalfKeysForward, keys)),
        kFusedBackwardFlops * flops /
            (kernels.peak *
             AttentionEfficiency(kernels.backward_efficiency, kAttentionHalfKeysBackward, keys))};
  };
  const double per_score = 2 * 2 * x.b * heads * d;  // FLOPs of one query-key pair, QK^T and PV
  double forward_flops = 0, forward_s = 0, backward_s = 0;
  if (x.cp > 1 && g.cp_comm_type == CpCommType::kP2p) {
    // The ring (Megatron's load-balanced chunks: a rank's s / cp queries are chunks r and
    // 2 cp - 1 - r of c = s / (2 cp) positions): step 0 its own keys, causal over 2c x 2c;
    // each of the cp - 1 other steps a half block, 2c x c (the half a causal mask keeps),
    // with c keys per query tile on the ranks that get the first half of the keys.
    const double chunk = x.s / (2 * x.cp);
    const double diagonal = per_score * 4 * chunk * chunk * CausalShare(2 * chunk);
    const double step = per_score * 2 * chunk * chunk;
    const auto [diagonal_f, diagonal_b] = seconds_at(diagonal, 2 * chunk * CausalShare(2 * chunk));
    const auto [step_f, step_b] = seconds_at(step, chunk);
    forward_flops = diagonal + (x.cp - 1) * step;
    // Merging the steps' partial results (TransformerEngine's AttnFuncWithCPAndKVP2P,
    // context_parallel.py) is memory-bound, after the ring or on a side stream: forward, each
    // of the cp steps' outputs read and folded into a float32 output by its log-sum-exp
    // ("fwd output correction: out in torch.float32"), then cast back; backward, each step's
    // dq added into dq and the received key and value gradients into dk, dv (read, read,
    // write). On the rank whose every step is full (cp rank cp - 1).
    const double q_elements = x.tokens() * heads * d;
    const double kv_elements = 2 * x.tokens() * static_cast<double>(g.num_query_groups) / x.t * d;
    const double merge_forward = x.cp * q_elements * (x.e + 8) + q_elements * (4 + x.e);
    const double merge_backward = x.cp * 3 * (q_elements + kv_elements) * x.e;
    forward_s = diagonal_f + (x.cp - 1) * step_f + merge_forward / kernels.hbm;
    backward_s = diagonal_b + (x.cp - 1) * step_b + merge_backward / kernels.hbm;
    c.ring_step_forward_s = step_f;
    c.ring_step_backward_s = step_b;
  } else {
    // One kernel over this rank's queries and every key (all_gather), or every query of 1/cp
    // of the heads (a2a): each query tile visits on average a causal share of the s keys.
    forward_flops = per_score * (x.s / x.cp) * x.s * CausalShare(x.s);
    std::tie(forward_s, backward_s) = seconds_at(forward_flops, x.s * CausalShare(x.s));
  }
  a.fused_flops = forward_flops;
  a.fused_s = forward_s;
  a.fused_backward_flops = kFusedBackwardFlops * forward_flops;
  a.fused_backward_s = backward_s;
  return c;
}

// The first virtual stage's embedding (word and position lookups, their sum, dropout) and
// the last one's final norm, output layer and cross entropy, forward.
Cost EmbeddingForward(const GptConfig& g, const Sizes& x) {
  Cost c;
  const double T = x.tokens();
  c.bytes += T * x.h * x.e * (g.has_position_embeddings() ? 4 : 2);
  if (g.hidden_dropout > 0) c.bytes += T * x.h * (2 * x.e + 1);
  if (x.t > 1) {  // the vocab-parallel lookup's all-reduce (reduce-scatter with sp)
    c.collectives = 1;
    c.collective_bytes = T * x.h * x.e;
  }
  return c;
}
Cost OutputForward(const Sizes& x, double padded_vocab) {
  Cost c;
  const double T = x.tokens(), v = padded_vocab / x.t;
  c.bytes += 2 * x.region_tokens() * x.h * x.e;  // final norm
  c.Linear(T, v, x.h, false);  // logits: tensor_parallel.ColumnParallelLinear, never fp8
  c.bytes += T * v * (x.e + 4 + 4);               // cross entropy: read logits, float32 softmax
  if (x.t > 1 && x.sp) {                          // all-gather of the final norm's output
    c.collectives = 1;
    c.collective_bytes = T * x.h * x.e;
  }
  return c;
}

double PeakFlops(const GpuSpec& gpu, DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return gpu.peak_flops_64bit;
    case DType::kFloat32:
      return gpu.peak_flops_32bit;
    default:
      return gpu.peak_flops_16bit;
  }
}

// A ring collective over n ranks moving `bytes` per rank in `phases` passes (an all-reduce
// is two: reduce-scatter and all-gather): phases * (n - 1) / n * bytes / bandwidth, plus a
// latency per ring step.
double RingSeconds(double bytes, int64_t n, int phases, double bandwidth, double latency) {
  if (n <= 1) return 0;
  const double steps = static_cast<double>(phases * (n - 1));
  return steps / static_cast<double>(n) * bytes / bandwidth + steps * latency;
}

struct Link {
  double bandwidth;
  double latency;
  bool inter_node;
};
// A kind's link for the busiest rank, whose group may be any of them: with a group across
// nodes, the network's. A ring collective (`ring`) whose group has g members on each node
// uses g of the node's adapters (one per GPU): every group of the kind runs at once, so the
// node's adapters are shared out g per group, and the ring's bytes between two nodes are
// split over g channels, as NCCL's rings are; a point-to-point send uses one.
Link LinkOf(const Topology& topology, const char* kind, const GpuSpec& gpu, bool ring) {
  const std::optional<size_t> k = topology.FindKind(kind);
  // O(axes) whatever the world size (all kinds here are direct); the fewest-members query
  // walks nodes only when a custom order puts another axis between the kind's axes.
  const bool inter = k && topology.AnyGroupSpansNodes(*k);
  if (!inter) {
    return {gpu.intra_node_bandwidth * gpu.collective_efficiency, gpu.intra_node_latency_s,
            false};
  }
  const auto rails = static_cast<double>(ring ? topology.FewestGroupMembersOnANode(*k) : 1);
  const double bw = std::min(rails * gpu.inter_node_bandwidth, gpu.intra_node_bandwidth);
  return {bw * gpu.collective_efficiency, gpu.inter_node_latency_s, true};
}

// Context parallelism's exchange in one layer's core attention, per micro-batch: seconds
// of the forward and of the backward that the step waits for, and what a rank sends.
struct CpExchange {
  double forward_s = 0, backward_s = 0;
  int64_t forward_count = 0, backward_count = 0;
  double forward_bytes = 0, backward_bytes = 0;
  const char* operation = "";
};
// `step_forward_s`, `step_backward_s`: one ring step's attention seconds, forward and
// backward, behind which that step's sends run (a step's send waits for nothing else, but
// the next step needs it).
CpExchange CpExchangeOf(const GptConfig& g, const Sizes& x, int64_t cp, const Link& link,
                        double step_forward_s, double step_backward_s) {
  CpExchange out;
  if (cp <= 1) return out;
  const double n = static_cast<double>(cp);
  const double T = x.tokens(), d = static_cast<double>(g.kv_channels);
  const double heads = static_cast<double>(g.num_attention_heads) / x.t;
  const double groups = static_cast<double>(g.num_query_groups) / x.t;
  const double kv = 2 * T * groups * d * x.e;  // this rank's keys and values
  switch (g.cp_comm_type) {
    case CpCommType::kAllGather:
      // All-gather the keys and values of every position; reduce-scatter their gradients.
      out.operation = "all-gather, reduce-scatter";
      out.forward_s = out.backward_s = RingSeconds(kv * n, cp, 1, link.bandwidth, link.latency);
      out.forward_count = out.backward_count = 1;
      out.forward_bytes = out.backward_bytes = kv * (n - 1);
      break;
    case CpCommType::kA2a: {
      // Four all-to-alls each way: q, k, v in, the context out.
      out.operation = "all-to-all";
      const double local = T * d * x.e * (2 * heads + 2 * groups);
      out.forward_s = out.backward_s =
          local * (n - 1) / n / link.bandwidth + 4 * (n - 1) * link.latency;
      out.forward_count = out.backward_count = 4;
      out.forward_bytes = out.backward_bytes = local * (n - 1) / n;
      break;
    }
    default: {
      // The ring: cp - 1 sends of this rank's keys and values forward, of them and their
      // gradients backward, each overlapped with one step's block of attention: what a send
      // takes beyond its step's kernel is exposed.
      out.operation = "ring send/recv";
      const double send = kv / link.bandwidth + link.latency;
      out.forward_s = (n - 1) * std::max(0.0, send - step_forward_s);
      out.backward_s = (n - 1) * std::max(0.0, 2 * send - step_backward_s);
      out.forward_count = cp - 1;
      out.backward_count = 2 * (cp - 1);
      out.forward_bytes = (n - 1) * kv;
      out.backward_bytes = 2 * (n - 1) * kv;
      break;
    }
  }
  return out;
}

// A mixture-of-experts layer in place of the MLP, per micro-batch and rank, for balanced
// routing (every expert gets as many of the choices; capped at the capacity): the router,
// the permutation, the experts' GEMMs, the shared expert, and the token exchange over ep.
struct MoeCost {
  Cost compute;          // GEMMs, memory-bound kernels and the shared expert's tp collective
  Cost router;           // of `compute`: the router (Megatron's pre-dispatch part)
  Cost experts;          // of `compute`: the rest (the experts, permutation, shared expert)
  double exchange_s = 0;  // the dispatcher's exchanges of one pass (the backward's mirror them)
  int64_t exchanges = 0;  // collectives per pass
  double exchange_bytes = 0;  // what this rank sends per pass
  const char* operation = "";
  bool inter_node = false;
};

// `ep`, `etp`, `tp_ep`: the links of those groups for this layout (core/topology.h's kinds);
// `ep_intra` NVLink's, which the all-to-all's peers on the rank's own node use, and
// `ep_per_node` how many of an ep group's ranks share a node (all of them when the group stays
// in one).
struct MoeLinks {
  Link ep, etp, tp_ep;
  Link ep_intra;
  double ep_per_node = 1;
};

MoeCost MoeForward(const GptConfig& g, const Sizes& x, const DerivedSizes& sz,
                   const MoeLinks& links) {
  const MoeConfig& moe = g.moe;
  const double Tn = x.region_tokens(), h = x.h, e = x.e;
  const double E = static_cast<double>(moe.num_experts);
  const double k = static_cast<double>(moe.router_topk);
  const double f = static_cast<double>(moe.ffn_hidden_size);
  const double f1 = IsGated(g.activation) ? 2 * f : f;
  const double ep = static_cast<double>(sz.ep), etp = static_cast<double>(sz.etp);
  // The share of the choices the experts compute: balanced routing keeps all of them unless
  // the capacity factor is below 1; padding to the capacity computes the capacity.
  double kept = 1;
  if (moe.expert_capacity_factor) {
    kept = moe.pad_expert_input_to_capacity ? *moe.expert_capacity_factor
                                            : std::min(1.0, *moe.expert_capacity_factor);
  }
  // This rank's tokens (its 1/t of the sequence with sp) choose k experts each; an expert's
  // rows reach its etp ranks, each computing 1/etp of its columns: per rank, Tn k kept rows
  // of whole experts' work.
  const double rows = Tn * k * kept;
  MoeCost out;
  out.router.Linear(Tn, E, h, false);  // the router's logits (a plain torch GEMM, never fp8)
  out.router.bytes += Tn * E * 4 * 3;  // softmax and top-k over float32 scores
  Cost& c = out.experts;
  // fc1 and fc2 of each local expert on its rows (the etp ranks' rows gathered, 1/etp of
  // the columns): one grouped launch with moe_grouped_gemm, else one GEMM per expert
  // (SequentialMLP).
  const double local = E / ep, per_expert = rows * etp / local;
  const double grouped = moe.grouped_gemm ? local : 1, launches = moe.grouped_gemm ? 1 : local;
  c.Linear(per_expert, f1 / etp, h, x.fp8, grouped, launches);
  c.Linear(per_expert, h, f / etp, x.fp8, grouped, launches);
  c.bytes += rows * (f1 + f) * e;            // the activation function
  c.bytes += 2 * (Tn * h * e + rows * h * e);  // permute and unpermute: read one, write the other
  if (moe.shared_expert_intermediate_size) {
    const double fs = static_cast<double>(*moe.shared_expert_intermediate_size);
    c += MlpForward(x, IsGated(g.activation) ? 2 * fs : fs, fs);
  }
  // The alltoall dispatcher's second permutation (token_dispatcher.py dispatch_postprocess
  // and combine_preprocess, sort_chunks_by_idxs): with more than one local expert the rows
  // received are sorted by local expert after the exchange and back before the return (read
  // and write each).
  if (moe.token_dispatcher == MoeDispatcher::kAllToAll && local > 1) {
    c.bytes += 2 * 2 * rows * etp * h * e;
  }
  out.compute = out.router;
  out.compute += out.experts;
  if (moe.token_dispatcher == MoeDispatcher::kAllToAll) {
    // Each rank's rows to their experts' ep ranks and back: two all-to-alls over ep; with
    // etp > 1 the received rows are all-gathered over expt_tp and the outputs
    // reduce-scattered back.
    out.operation = "all-to-all";
    if (sz.ep > 1) {
      // The rows for the ep - 1 other ranks: those on the rank's own node (g - 1 of them, g
      // the group's ranks per node) go over NVLink, the others over the rank's network adapter,
      // both at once (NCCL's all-to-all posts every peer's send together).
      const double sent = rows * h * e * (ep - 1) / ep;
      const double g_node = std::min(ep, links.ep_per_node);
      const double intra = rows * h * e * (g_node - 1) / ep, inter = sent - intra;
      const double seconds = links.ep.inter_node
                                 ? std::max(intra / links.ep_intra.bandwidth,
                                            inter / links.ep.bandwidth)
                                 : sent / links.ep.bandwidth;
      out.exchange_s += 2 * (seconds + links.ep.latency);
      out.exchanges += 2;
      out.exchange_bytes += 2 * sent;
      out.inter_node = links.ep.inter_node;
    }
    if (sz.etp > 1) {
      const double gathered = rows * etp * h * e;
      out.exchange_s +=
          2 * RingSeconds(gathered, sz.etp, 1, links.etp.bandwidth, links.etp.latency);
      out.exchanges += 2;
      out.exchange_bytes += 2 * gathered * (etp - 1) / etp;
      out.inter_node = out.inter_node || links.etp.inter_node;
    }
  } else {
    // Every rank's tokens all-gathered over etp x ep (tp_ep), each rank's experts' outputs
    // reduce-scattered back.
    out.operation = "all-gather + reduce-scatter";
    const int64_t group = sz.etp * sz.ep;
    if (group > 1) {
      const double gathered = Tn * h * e * static_cast<double>(group);
      out.exchange_s =
          2 * RingSeconds(gathered, group, 1, links.tp_ep.bandwidth, links.tp_ep.latency);
      out.exchanges = 2;
      out.exchange_bytes =
          2 * gathered * static_cast<double>(group - 1) / static_cast<double>(group);
      out.inter_node = links.tp_ep.inter_node;
    }
  }
  return out;
}

// What of `comm` seconds of communication stays exposed when it is cut into `n` equal chunks
// pipelined with `compute` seconds of work, chunk i's transfer beside chunk i-1's work (or
// the reverse): with c = comm / n and g = compute / n the pair takes c + (n - 1) max(c, g) + g,
// i.e. compute + max(comm / n, comm - (n - 1) / n * compute). Exposed: one chunk's transfer
// (the pipeline's fill) when the work covers the rest, else what exceeds the work. n = 1: all
// of it. Used for tp_comm_overlap's chunked collectives, overlap_grad_reduce's buckets
// (ready one by one during the last backward) and overlap_param_gather's (needed one by one
// by the forward).
double PipelinedExposed(double comm, double compute, double n) {
  if (comm <= 0) return 0;
  return std::max(comm / n, comm - (n - 1) / n * compute);
}
// A collective that runs whole beside a GEMM (TE's "bulk" overlap): only what exceeds it.
double BulkExposed(double comm, double compute) { return std::max(0.0, comm - compute); }

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

// One stage's gradient reduction and parameter gather (the busiest rank of the stage), per
// group kind (dp_cp for the dense parameters, expt_dp for the experts').
struct DpPart {
  std::string kind;  // "dp" or "expt_dp"
  double reduce_s = 0, gather_s = 0;  // the gather: the distributed optimizer's only
  double reduce_bytes = 0, gather_bytes = 0;
  bool inter_node = false;
};

}  // namespace

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

double GemmSeconds(const GpuSpec& gpu, const GemmShape& shape, double element_bytes, double peak) {
  if (shape.m <= 0 || shape.n <= 0 || shape.k <= 0 || shape.count <= 0) return 0;
  const double rate = shape.fp8 ? gpu.peak_flops_8bit * gpu.gemm_efficiency_8bit
                                : peak * gpu.gemm_efficiency;
  const auto sms = static_cast<double>(std::max<int64_t>(1, gpu.sm_count));
  // Tile and wave quantization: a wave computes one tile per SM; the partial last wave takes
  // as long as a full one. The tile with the least padded work is cuBLAS's pick.
  double padded = 0;
  for (const GemmTile& tile : kGemmTiles) {
    const auto tm = static_cast<double>(tile.rows), tn = static_cast<double>(tile.cols);
    const double tiles = shape.count * std::ceil(shape.m / tm) * std::ceil(shape.n / tn);
    const double work = std::ceil(tiles / sms) * sms * tm * tn;
    if (padded == 0 || work < padded) padded = work;
  }
  const double compute = 2 * padded * shape.k / rate;
  // The roofline: A and B read once, C written once, at the streaming kernels' HBM rate.
  const double in_bytes = shape.fp8 ? 1 : element_bytes, out_bytes = shape.fp8 ? 2 : element_bytes;
  const double bytes =
      shape.count * (in_bytes * (shape.m * shape.k + shape.k * shape.n) + out_bytes * shape.m * shape.n);
  const double memory = bytes / (gpu.hbm_bandwidth * gpu.memory_efficiency);
  return std::max(compute, memory);
}

double GemmEfficiency(const GpuSpec& gpu, const GemmShape& shape, double element_bytes,
                      double peak) {
  const double seconds = GemmSeconds(gpu, shape, element_bytes, peak);
  if (seconds <= 0) return 0;
  return shape.Flops() / seconds / (shape.fp8 ? gpu.peak_flops_8bit : peak);
}

double ModelFlopsPerIteration(const GptConfig& g, int64_t padded_vocab, int64_t seq_length,
                              int64_t samples) {
  const double h = static_cast<double>(g.hidden_size), s = static_cast<double>(seq_length);
  const double d = static_cast<double>(g.kv_channels);
  const double heads = static_cast<double>(g.num_attention_heads);
  const double groups = static_cast<double>(g.num_query_groups);
  // Forward GEMM FLOPs per token of one layer: QKV, projection, scores and context, and the
  // MLP; an MoE layer's MLP is its top-k experts' and the shared expert's (the router's
  // logits are not counted, as Megatron's count leaves them out). The scores and context
  // count half of s x s: "causal mask (only half of the mask is non-zero)", as
  // num_floating_point_operations (megatron/training/training.py) has since 2025-03-06
  // (commit 8873b55d6a); before, it counted the full s x s, as Narayanan et al. 2021 do.
  const double attention =
      2 * h * (heads + 2 * groups) * d + 2 * heads * d * h + 2 * 2 * s * heads * d / 2;
  const auto mlp = [&](double ffn) {
    return 2 * h * (IsGated(g.activation) ? 2 : 1) * ffn + 2 * ffn * h;
  };
  double per_token = 2 * h * static_cast<double>(padded_vocab);
  for (int64_t i = 0; i < g.num_layers; ++i) {
    per_token += attention;
    if (g.moe.enabled() && g.moe.layers[static_cast<size_t>(i)]) {
      per_token += static_cast<double>(g.moe.router_topk) *
                   mlp(static_cast<double>(g.moe.ffn_hidden_size));
      if (g.moe.shared_expert_intermediate_size) {
        per_token += mlp(static_cast<double>(*g.moe.shared_expert_intermediate_size));
      }
    } else {
      per_token += mlp(static_cast<double>(g.ffn_hidden_size));
    }
  }
  return 3 * per_token * s * static_cast<double>(samples);
}

StatusOr<TimeEstimate> EstimateStepTime(const Config& config, const Topology& topology,
                                        const GpuSpec& gpu,
                                        const std::vector<StageHeldMemory>* held_given,
                                        const PipelineSchedule* schedule_given) {
  if (Status s = CheckEstimable(config, "the step-time estimate"); !s.ok()) return s;
  const GptConfig& g = *config.gpt;
  const RunConfig& run = *config.run;
  const DerivedSizes& sz = topology.sizes();
  if (sz.cp > 1 && g.cp_comm_type == CpCommType::kA2aP2p) {
    return Status::Error("model.cp_comm_type",
                         "the step-time estimate does not model \"a2a+p2p\" (hierarchical "
                         "context parallelism) yet; p2p, all_gather and a2a it does");
  }
  const DType dtype = run.dtype;
  MPUSIM_RETURN_IF_ERROR(CheckFp8OnGpu(g, dtype, gpu));
  StatusOr<ResolvedAttention> attention =
      ResolveAttentionBackend(g, dtype, gpu.compute_capability, sz.cp);
  if (!attention.ok()) return attention.status();
  const AttentionKernels kernels{attention->fused(), PeakFlops(gpu, dtype),
                                 gpu.attention_efficiency_forward,
                                 gpu.attention_efficiency_backward,
                                 gpu.hbm_bandwidth * gpu.memory_efficiency};
  const double dense_peak = PeakFlops(gpu, dtype);
  const double peak = dense_peak * gpu.gemm_efficiency;
  const double hbm = gpu.hbm_bandwidth * gpu.memory_efficiency;
  const Sizes x{static_cast<double>(run.micro_batch_size), static_cast<double>(run.seq_length),
                static_cast<double>(g.hidden_size), static_cast<double>(sz.tp),
                static_cast<double>(DTypeSize(dtype)), topology.config().sequence_parallel,
                static_cast<double>(sz.cp), g.fp8.has_value()};
  const Link tp_link = LinkOf(topology, "tp", gpu, true);
  const Link pp_link = LinkOf(topology, "pp", gpu, false);
  const Link dp_link = LinkOf(topology, "dp_cp", gpu, true);
  // The ring's sends go to one neighbour; the collectives share the node's adapters.
  const Link cp_link = LinkOf(topology, "cp", gpu, g.cp_comm_type != CpCommType::kP2p);
  // `peak_s`: adds each shaped GEMM's seconds x its own peak (the achieved fraction's
  // denominator), when given.
  const auto seconds = [&](const Cost& c, double* peak_s = nullptr) {
    const double comm = static_cast<double>(c.collectives) *
                        RingSeconds(c.collective_bytes, sz.tp, 2, tp_link.bandwidth,
                                    tp_link.latency);
    double gemm = 0;
    for (const Gemm& m : c.gemms) {
      const double one = m.times * GemmSeconds(gpu, m.shape, x.e, dense_peak);
      gemm += one;
      if (peak_s) *peak_s += one * (m.shape.fp8 ? gpu.peak_flops_8bit : dense_peak);
    }
    return std::pair<double, double>{gemm + c.flops / peak + (c.bytes + c.quantize_bytes) / hbm + c.fused_s,
                                     comm};
  };

  // Each virtual stage's forward and backward (recomputation included) per micro-batch.
  const int64_t p = sz.pp, v = sz.vp.value_or(1), stages = p * v;
  const int64_t layers = g.num_layers / stages;
  const double vocab = static_cast<double>(g.PaddedVocabSize(sz.tp));
  const LayerCost layer = LayerForward(g, x, kernels);
  // A dense layer's forward, and an MoE layer's (its exchange over ep apart).
  Cost dense = layer.total();
  dense += MlpForward(x, static_cast<double>(g.Fc1Rows()), static_cast<double>(g.ffn_hidden_size));
  MoeCost moe;
  Cost sparse = layer.total();
  if (g.moe.enabled()) {
    const std::optional<size_t> ep_kind = topology.FindKind("ep");
    const Link ep_link = LinkOf(topology, "ep", gpu, false);
    moe = MoeForward(
        g, x, sz,
        {ep_link, LinkOf(topology, "expt_tp", gpu, true), LinkOf(topology, "tp_ep", gpu, true),
         {gpu.intra_node_bandwidth * gpu.collective_efficiency, gpu.intra_node_latency_s, false},
         ep_link.inter_node && ep_kind
             ? static_cast<double>(topology.FewestGroupMembersOnANode(*ep_kind))
             : static_cast<double>(sz.ep)});
    sparse += moe.compute;
  }
  // A ring step's attention: the fused kernel's block, or 1/cp of the materialised attention
  // (its backward twice that).
  const auto [core_compute, core_comm] = seconds(layer.core_attention);
  const double step_forward =
      kernels.fused ? layer.ring_step_forward_s : (core_compute + core_comm) / x.cp;
  const double step_backward = kernels.fused ? layer.ring_step_backward_s : 2 * step_forward;
  const CpExchange cp = CpExchangeOf(g, x, sz.cp, cp_link, step_forward, step_backward);
  // Recomputation (full, or selective's core attention) repeats the forward's exchange.
  const bool recomputes = run.recompute != RunConfig::Recompute::kNone;
  const double cp_forward = cp.forward_s;
  const double cp_backward = cp.backward_s + (recomputes ? cp.forward_s : 0);
  // The MoE exchanges: the backward mirrors the forward's, full recomputation repeats them.
  const bool full = run.recompute == RunConfig::Recompute::kFull;
  const double ep_forward = moe.exchange_s;
  const double ep_backward = moe.exchange_s * (full ? 2 : 1);
  // tp_comm_overlap: what TE's userbuffers hide of each layer's tp collectives.
  const bool tp_overlap = config.parallel.tp_comm_overlap && sz.tp > 1 && x.sp;
  const TpOverlap tpo = tp_overlap ? TpOverlapOf(g, x, tp_link, gpu, dense_peak) : TpOverlap{};
  // overlap_moe_expert_parallel_comm: what an MoE layer saves when its forward runs beside
  // another micro-batch's backward (CombinedSeconds), split as the stage's costs count it.
  const bool combined = config.parallel.overlap_moe_expert_parallel_comm && g.moe.enabled() &&
                        sz.ep > 1 && !full;
  double combined_saving = 0;
  if (combined) {
    Cost attention_side = layer.total();
    attention_side += moe.router;
    Cost attention_backward = Backward(attention_side);
    if (run.recompute == RunConfig::Recompute::kSelective) {
      attention_backward += Recomputed(layer.core_attention);
    }
    const auto [dgrad, wgrad] = BackwardSplit(moe.experts);
    const auto total = [&](const Cost& c) {
      const auto [compute, comm] = seconds(c);
      return compute + comm;
    };
    CombinedLayer l;
    l.attn_fwd = std::max(0.0, total(attention_side) - tpo.moe_forward);
    l.attn_bwd = std::max(0.0, total(attention_backward) - tpo.moe_backward);
    l.mlp_fwd = total(moe.experts);
    l.mlp_dgrad = total(dgrad);
    l.mlp_wgrad = total(wgrad);
    l.dispatch_fwd = l.combine_fwd = ep_forward / 2;
    l.dispatch_bwd = l.combine_bwd = ep_backward / 2;
    combined_saving = std::max(0.0, l.Forward() + l.Backward() -
                                        CombinedSeconds(l, config.parallel.delay_wgrad_compute));
  }
  StageCosts costs;
  std::vector<double> compute_of(static_cast<size_t>(stages)), comm_of(compute_of);
  std::vector<double> flops_of(compute_of), cp_of(compute_of), ep_of(compute_of);
  std::vector<double> recompute_s_of(compute_of);  // the recomputed forwards' compute
  std::vector<double> tp_hidden_of(compute_of);
  std::vector<double> gemm_flops_of(compute_of), gemm_peak_s_of(compute_of);
  std::vector<Cost> forward_of(static_cast<size_t>(stages)), recompute_of(forward_of);
  std::vector<int64_t> moe_layers_of(static_cast<size_t>(stages));
  for (int64_t u = 0; u < stages; ++u) {
    // Virtual stage u holds layers [u L / S, (u + 1) L / S), each dense or MoE.
    int64_t n_moe = 0;
    for (int64_t i = u * layers; i < (u + 1) * layers && g.moe.enabled(); ++i) {
      n_moe += g.moe.layers[static_cast<size_t>(i)] ? 1 : 0;
    }
    Cost forward = Times(dense, layers - n_moe);
    forward += Times(sparse, n_moe);
    Cost recompute;
    if (full) recompute = Recomputed(forward);
    if (run.recompute == RunConfig::Recompute::kSelective) {
      recompute = Times(Recomputed(layer.core_attention), layers);
    }
    if (u == 0) forward += EmbeddingForward(g, x);
    if (u == stages - 1) forward += OutputForward(x, vocab);
    Cost backward = Backward(forward);
    backward += recompute;
    const auto at = static_cast<size_t>(u);
    const auto [fc, fm] = seconds(forward, &gemm_peak_s_of[at]);
    const auto [bc, bm] = seconds(backward, &gemm_peak_s_of[at]);
    const auto n = static_cast<double>(layers), n_ep = static_cast<double>(n_moe);
    // The hidden tp seconds: every layer's forward, backward and (full) recomputed forward.
    const double hidden_forward = (n - n_ep) * tpo.dense_forward + n_ep * tpo.moe_forward;
    const double hidden_backward = (n - n_ep) * tpo.dense_backward + n_ep * tpo.moe_backward +
                                   (full ? hidden_forward : 0);
    costs.forward.push_back(fc + fm - hidden_forward + n * cp_forward + n_ep * ep_forward);
    costs.backward.push_back(bc + bm - hidden_backward + n * cp_backward + n_ep * ep_backward);
    recompute_s_of[at] = seconds(recompute).first;
    compute_of[at] = fc + bc - recompute_s_of[at];
    comm_of[at] = fm + bm - hidden_forward - hidden_backward;
    tp_hidden_of[at] = hidden_forward + hidden_backward;
    cp_of[at] = n * (cp_forward + cp_backward);
    ep_of[at] = n_ep * (ep_forward + ep_backward);
    flops_of[at] = forward.TotalFlops() + backward.TotalFlops();
    for (const Cost* c : {&forward, &backward}) {
      for (const Gemm& m : c->gemms) gemm_flops_of[at] += m.times * m.shape.Flops();
    }
    forward_of[at] = forward;
    recompute_of[at] = recompute;
    moe_layers_of[at] = n_moe;
  }
  // The activation (or its gradient) a stage sends: [s, b, h], a tp rank's 1/t of it with
  // sequence parallelism.
  const double p2p_bytes = x.tokens() * x.h * x.e / (x.sp ? x.t : 1);
  costs.transfer = p > 1 ? p2p_bytes / pp_link.bandwidth + pp_link.latency : 0;
  costs.blocking_sends = true;

  std::optional<PipelineSchedule> built;
  StatusOr<const PipelineSchedule*> schedule = RunSchedule(topology, run, schedule_given, &built);
  if (!schedule.ok()) return schedule.status();
  // The combined 1F1B schedule's pairs: a forward's MoE layers beside the backward's, layer
  // by layer (Megatron pairs layer i of the forward chunk with layer n - 1 - i of the
  // backward one; a pair of an MoE and a dense layer is counted as saving nothing).
  if (combined && (*schedule)->combined_1f1b) {
    costs.combined_saving.assign(static_cast<size_t>(stages * stages), 0.0);
    for (int64_t f = 0; f < stages; ++f) {
      for (int64_t b = 0; b < stages; ++b) {
        costs.combined_saving[static_cast<size_t>(f * stages + b)] =
            static_cast<double>(std::min(moe_layers_of[static_cast<size_t>(f)],
                                         moe_layers_of[static_cast<size_t>(b)])) *
            combined_saving;
      }
    }
  }
  // The replay without parameter gathers in it: the pipeline span the parts below add up to.
  const ScheduleTiming timing = TimeSchedule(**schedule, costs);

  // Each stage's gradient reduction and parameter gather: the dense parameters' over dp x cp,
  // the experts' over expt_dp (one after the other).
  std::vector<StageHeldMemory> counted;
  if (held_given == nullptr) {
    StatusOr<std::vector<StageHeldMemory>> held = EstimateStageHeldMemory(config, topology);
    if (!held.ok()) return held.status();
    counted = *std::move(held);
    held_given = &counted;
  }
  const bool distributed = config.optimizer && config.optimizer->use_distributed_optimizer;
  const Link expt_dp_link = LinkOf(topology, "expt_dp", gpu, true);
  const auto dp_parts = [&](const HeldMemory& held) {
    std::vector<DpPart> parts;
    const double experts = static_cast<double>(held.expert_elements);
    const double dense_elements = static_cast<double>(held.parameter_elements) - experts;
    for (const auto& [elements, kind, link] :
         {std::tuple{dense_elements, "dp_cp", dp_link},
          std::tuple{experts, "expt_dp", expt_dp_link}}) {
      const int64_t d = topology.GroupSize(*topology.FindKind(kind));
      if (d <= 1 || elements <= 0) continue;
      const double grad_bytes = elements * static_cast<double>(DTypeSize(ComputeDType(dtype)));
      const double share = static_cast<double>(d - 1) / static_cast<double>(d);
      DpPart part;
      part.kind = std::string(kind) == "dp_cp" ? "dp" : kind;
      part.inter_node = link.inter_node;
      if (distributed) {
        const double gathered = elements * x.e;
        part.reduce_s = RingSeconds(grad_bytes, d, 1, link.bandwidth, link.latency);
        part.gather_s = RingSeconds(gathered, d, 1, link.bandwidth, link.latency);
        part.reduce_bytes = grad_bytes * share;
        part.gather_bytes = gathered * share;
      } else {
        part.reduce_s = RingSeconds(grad_bytes, d, 2, link.bandwidth, link.latency);
        part.reduce_bytes = 2 * grad_bytes * share;
      }
      parts.push_back(part);
    }
    return parts;
  };
  const auto total = [](const std::vector<DpPart>& parts, double DpPart::*member) {
    double sum = 0;
    for (const DpPart& part : parts) sum += part.*member;
    return sum;
  };
  std::vector<std::vector<DpPart>> dp_of;
  for (const StageHeldMemory& stage : *held_given) dp_of.push_back(dp_parts(stage.held));
  // overlap_grad_reduce / overlap_param_gather (Megatron's DDP, megatron/core/distributed/):
  // buckets of bucket_size parameters (default max(40M, 1M x dp_cp)) on the first model chunk
  // of pipeline rank 0 only, one bucket per other chunk (training.py get_model: "Bucketing is
  // disabled for non-first chunks ... or for non-zero pipeline-parallel ranks"). A stage's
  // parameters are split evenly over its chunks.
  const bool overlap_reduce = config.optimizer && config.optimizer->overlap_grad_reduce;
  const bool overlap_gather = overlap_reduce && distributed &&
                              config.optimizer->overlap_param_gather;
  const auto buckets_of = [&](int64_t pp_rank, int64_t chunk) -> int64_t {
    if (!overlap_reduce || pp_rank != 0 || chunk != 0) return 1;
    // The trainable elements (Megatron buckets those with a gradient), the experts' with them.
    const HeldMemory& first = (*held_given)[0].held;
    const double elements = static_cast<double>(first.dense_elements + first.expert_elements) /
                            static_cast<double>(v);
    const auto size = static_cast<double>(config.optimizer->BucketSize(sz.dp * sz.cp));
    return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(elements / size)));
  };
  // overlap_param_gather: each chunk's first forward waits for the exposed part of its
  // gather. Without the interleaved schedule each stage starts its gather at its first
  // forward (Megatron's pre-hook; align_param_gather is off there): the bucketed chunk hides
  // all but PipelinedExposed behind its forward, a one-bucket chunk waits for all of it. With
  // it, Megatron aligns the launches (align_param_gather, on by default in
  // megatron/training/arguments.py): chunks 0 and 1 start at the step's start, chunk c >= 2
  // when chunk c - 1's first forward starts (schedules.py), one after the other on the rank;
  // a chunk waits for what is left when its first forward would start.
  double gather_exposed = 0;
  ScheduleTiming gathered_timing;
  const ScheduleTiming* replay = &timing;
  if (overlap_gather) {
    costs.first_forward_wait.assign(static_cast<size_t>(stages), 0.0);
    for (int64_t r = 0; r < p; ++r) {
      const double gather =
          total(dp_of[static_cast<size_t>(r)], &DpPart::gather_s) / static_cast<double>(v);
      // The first forward's start of each chunk in the replay without gathers.
      std::vector<double> first_start(static_cast<size_t>(v), 0.0);
      const auto& steps = (*schedule)->per_rank[static_cast<size_t>(r)];
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
    gathered_timing = TimeSchedule(**schedule, costs);
    gather_exposed = gathered_timing.makespan - timing.makespan;
    replay = &gathered_timing;
  }
  // overlap_grad_reduce: on each rank, a chunk's buckets become ready one by one during its
  // last backward (evenly), a one-bucket chunk's when that backward ends; the rank's reductions
  // run one after the other; the step waits for the last rank's last reduction.
  double reduce_exposed = 0;
  if (overlap_reduce) {
    double end = replay->makespan;
    for (int64_t r = 0; r < p; ++r) {
      const auto& steps = (*schedule)->per_rank[static_cast<size_t>(r)];
      const auto& starts = replay->start[static_cast<size_t>(r)];
      const auto& ends = replay->end[static_cast<size_t>(r)];
      const double reduce =
          total(dp_of[static_cast<size_t>(r)], &DpPart::reduce_s) / static_cast<double>(v);
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
    reduce_exposed = end - replay->makespan;
  }

  TimeEstimate out;
  out.gpu = gpu;
  out.attention = *attention;
  out.num_microbatches = run.num_microbatches;
  out.global_batch_size = run.micro_batch_size * run.num_microbatches * sz.dp;
  const auto m = static_cast<double>(run.num_microbatches);
  for (int64_t r = 0; r < p; ++r) {
    StageTime st;
    st.stage = r;
    for (int64_t c = 0; c < v; ++c) {
      const auto u = static_cast<size_t>(c * p + r);
      st.forward_s += costs.forward[u];
      st.backward_s += costs.backward[u];
      st.flops += flops_of[u];
    }
    out.stages.push_back(st);
  }
  // The busiest stage: the most work per micro-batch.
  const auto busiest = static_cast<size_t>(
      std::max_element(out.stages.begin(), out.stages.end(),
                       [](const StageTime& a, const StageTime& b) {
                         return a.forward_s + a.backward_s < b.forward_s + b.backward_s;
                       }) -
      out.stages.begin());
  double compute = 0, recomputed = 0, tp = 0, tp_hidden = 0, cp_s = 0, ep_s = 0;
  double gemm_flops = 0, gemm_peak_s = 0;
  int64_t tp_count = 0, moe_layers = 0;
  double tp_bytes = 0;
  for (int64_t c = 0; c < v; ++c) {
    const auto u = static_cast<size_t>(c * p) + busiest;
    compute += compute_of[u];
    recomputed += recompute_s_of[u];
    gemm_flops += gemm_flops_of[u];
    gemm_peak_s += gemm_peak_s_of[u];
    tp += comm_of[u];
    tp_hidden += tp_hidden_of[u];
    cp_s += cp_of[u];
    ep_s += ep_of[u];
    moe_layers += moe_layers_of[u];
    // The busiest stage's tp collectives, as seconds() counted them: the forward's and the
    // backward's answers, and the recomputed ones.
    if (sz.tp > 1) {
      const int64_t n = 2 * forward_of[u].collectives + recompute_of[u].collectives;
      tp_count += n;
      tp_bytes += static_cast<double>(n) * x.tokens() * x.h * x.e;
    }
  }
  // The busiest stage's sends per micro-batch: each chunk's activation onward (but the
  // last virtual stage's) and its gradient back (but the first's).
  int64_t sends = 0;
  for (int64_t c = 0; c < v; ++c) {
    const int64_t u = c * p + static_cast<int64_t>(busiest);
    sends += (u + 1 < stages ? 1 : 0) + (u > 0 ? 1 : 0);
  }
  out.compute_s = m * compute;
  out.recompute_s = m * recomputed;
  out.gemm_efficiency_achieved = gemm_peak_s > 0 ? gemm_flops / gemm_peak_s : 0;
  out.tp_comm_s = m * tp;
  out.tp_comm_hidden_s = m * tp_hidden;
  out.cp_comm_s = m * cp_s;
  out.ep_comm_s = m * ep_s;
  // What the combined pairs hid of the busiest rank's exchanges: each pair's saving.
  if (!costs.combined_saving.empty()) {
    const auto& steps = (*schedule)->per_rank[busiest];
    for (size_t i = 0; i + 1 < steps.size(); ++i) {
      if (!(*schedule)->CombinedPairAt(static_cast<int64_t>(busiest), i)) continue;
      const int64_t f = steps[i].model_chunk * p + static_cast<int64_t>(busiest);
      const int64_t b = steps[i + 1].model_chunk * p + static_cast<int64_t>(busiest);
      out.ep_comm_hidden_s += costs.combined_saving[static_cast<size_t>(f * stages + b)];
      ++i;
    }
    out.ep_comm_s -= out.ep_comm_hidden_s;
  }
  out.pp_comm_s = p > 1 ? m * static_cast<double>(sends) * costs.transfer : 0;
  out.bubble_s = std::max(0.0, timing.makespan - out.compute_s - out.recompute_s -
                                   out.tp_comm_s - out.cp_comm_s - out.ep_comm_s - out.pp_comm_s);
  out.flops_per_rank = m * out.stages[busiest].flops;
  if (sz.tp > 1) {
    out.communication.push_back({"tp", sz.tp > 1 && x.sp ? "reduce-scatter + all-gather"
                                                         : "all-reduce",
                                 static_cast<int64_t>(m) * tp_count,
                                 m * tp_bytes * 2 * static_cast<double>(sz.tp - 1) /
                                     static_cast<double>(sz.tp),
                                 out.tp_comm_s, tp_link.inter_node});
    out.communication.back().hidden_s = out.tp_comm_hidden_s;
  }
  if (sz.cp > 1) {
    // Every layer of the busiest stage's chunks, each micro-batch: forward, backward and the
    // recomputed forward.
    const int64_t per_layer = cp.forward_count + cp.backward_count +
                              (recomputes ? cp.forward_count : 0);
    const double per_layer_bytes = cp.forward_bytes + cp.backward_bytes +
                                   (recomputes ? cp.forward_bytes : 0);
    const int64_t n = v * layers * run.num_microbatches;
    out.communication.push_back({"cp", cp.operation, n * per_layer,
                                 static_cast<double>(n) * per_layer_bytes, out.cp_comm_s,
                                 cp_link.inter_node});
  }
  if (moe_layers > 0 && moe.exchanges > 0) {
    // Every MoE layer of the busiest stage's chunks, each micro-batch: forward, backward and
    // the recomputed forward.
    const int64_t passes = full ? 3 : 2;
    const int64_t n = moe_layers * run.num_microbatches * passes;
    out.communication.push_back({"ep", moe.operation, n * moe.exchanges,
                                 static_cast<double>(n) * moe.exchange_bytes, out.ep_comm_s,
                                 moe.inter_node});
    out.communication.back().hidden_s = out.ep_comm_hidden_s;
  }
  if (p > 1) {
    // The busiest stage's own sends (each a blocking wait), per micro-batch as counted above.
    const int64_t sent = sends * run.num_microbatches;
    out.communication.push_back({"pp", "send/recv", sent, static_cast<double>(sent) * p2p_bytes,
                                 out.pp_comm_s, pp_link.inter_node});
  }

  // Gradients over dp x cp after the last backward (or overlapped with it), the parameters'
  // all-gather after the step (or overlapped with the next forward); the optimizer step over
  // the owned part. The busiest stage's communication rows; what adds to the step: without
  // overlap all of its gradient reduction and gather, with it the exposed parts found above.
  const HeldMemory& mem = (*held_given)[busiest].held;
  const double elements = static_cast<double>(mem.parameter_elements);
  const std::vector<DpPart>& busiest_dp = dp_of[busiest];
  const double reduce_s = total(busiest_dp, &DpPart::reduce_s);
  const double gather_s = total(busiest_dp, &DpPart::gather_s);
  const double reduce_shown = overlap_reduce ? reduce_exposed : reduce_s;
  const double gather_shown = overlap_gather ? gather_exposed : gather_s;
  out.dp_buckets = buckets_of(0, 0);
  for (const DpPart& part : busiest_dp) {
    // A kind's share of the exposed seconds: its share of the busiest stage's seconds.
    const double reduce_exposed_part = reduce_s > 0 ? reduce_shown * part.reduce_s / reduce_s : 0;
    const double gather_exposed_part = gather_s > 0 ? gather_shown * part.gather_s / gather_s : 0;
    if (!overlap_reduce) {
      out.communication.push_back(
          {part.kind, distributed ? "reduce-scatter + all-gather" : "all-reduce",
           distributed ? 2 : 1, part.reduce_bytes + part.gather_bytes,
           part.reduce_s + part.gather_s, part.inter_node});
      continue;
    }
    // With overlap the reduction and the gather are shown apart: they hide behind different
    // work.
    CommTime reduce_row{part.kind, distributed ? "reduce-scatter" : "all-reduce", 1,
                        part.reduce_bytes, reduce_exposed_part, part.inter_node};
    reduce_row.hidden_s = std::max(0.0, part.reduce_s - reduce_exposed_part);
    out.communication.push_back(reduce_row);
    if (distributed) {
      CommTime gather_row{part.kind, "all-gather", 1, part.gather_bytes, gather_exposed_part,
                          part.inter_node};
      gather_row.hidden_s = std::max(0.0, part.gather_s - gather_exposed_part);
      out.communication.push_back(gather_row);
    }
  }
  out.dp_comm_s = reduce_shown + gather_shown;
  out.dp_comm_hidden_s = std::max(0.0, reduce_s + gather_s - out.dp_comm_s);
  // Per owned element: read main_grad, master and states, write master, states and the
  // parameter; per held element: zero main_grad.
  const double compute_bytes = static_cast<double>(DTypeSize(ComputeDType(dtype)));
  if (config.optimizer) {
    const bool adam = config.optimizer->kind == OptimizerConfig::Kind::kAdam;
    const double states = adam ? 3 : 2;
    out.optimizer_s = (static_cast<double>(mem.optimizer_elements) *
                           ((1 + 2 * states) * compute_bytes + x.e) +
                       elements * compute_bytes) /
                      hbm;
  }
  // fp8: each weight's cast-transpose once per iteration (Transformer Engine caches the fp8
  // weights over the micro-batches after the first: Megatron's is_first_microbatch), an
  // upper bound that counts every held element as a linear weight.
  if (g.fp8) out.optimizer_s += elements * 4 / hbm;
  out.step_time_s = timing.makespan + out.dp_comm_s + out.optimizer_s;
  out.model_flops = ModelFlopsPerIteration(g, g.PaddedVocabSize(sz.tp), run.seq_length,
                                           out.global_batch_size);
  const double world = static_cast<double>(topology.world_size());
  out.model_tflops_per_gpu = out.model_flops / out.step_time_s / world / kTera;
  out.mfu = out.model_flops / out.step_time_s / world / PeakFlops(gpu, dtype);
  return out;
}

}  // namespace mpusim
