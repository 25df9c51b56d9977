// The step-time model's pieces of work (time_estimate.h): what one piece of the model costs
// one rank per micro-batch (its GEMMs by shape, the core attention's FLOPs or flash kernel
// seconds, the bytes of its memory-bound kernels, its tp collectives), the backward and the
// recomputation of a piece, and the forward of a transformer layer's attention, a dense MLP,
// the embedding and the output layer. Internal to core/estimate: time_estimate.cc prices these
// Costs into seconds and replays them over the schedule. Not here: the mixture-of-experts layer
// (moe_cost.h), communication (comm_cost.h, comm_overlap.h), the GEMM curve (gemm_curve.cc).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/config/gpt_config.h"
#include "core/estimate/time_estimate.h"

namespace mpusim::step_time {

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
Cost Times(Cost c, int64_t n);
// A piece's backward: each GEMM C = A B gives two, dA = dC B^T [m, k] over n and dB = A^T dC
// [k, n] over m (a linear layer's dgrad and wgrad), with fp8 after the cast-transpose of dC;
// the core attention's FLOPs and the bytes twice the forward's; one collective per forward
// collective (the all-reduce of a column-parallel input's gradient answers the forward's
// row-parallel one). Flash / fused
// attention's backward is its own kernel (LayerForward).
Cost Backward(Cost c);
// Backward(c) in its two halves: the data gradients (every GEMM's dA, the memory-bound
// kernels, the collectives, the fused attention's backward) and the weight gradients (every
// GEMM's dB), which Megatron's delay_wgrad_compute runs apart.
std::pair<Cost, Cost> BackwardSplit(const Cost& c);
// A forward repeated in the backward (recomputation): its own backward is not repeated.
Cost Recomputed(Cost c);

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
Cost MlpForward(const Sizes& x, double fc1_rows, double ffn);

// Flash / fused attention kernels (attention_backend.h) on this GPU and dtype.
struct AttentionKernels {
  bool fused = false;
  double peak = 0;  // FLOP/s of the dtype
  double forward_efficiency = 0, backward_efficiency = 0;
  double hbm = 0;  // bytes/s the ring's merges of partial results move at
};

// One transformer layer's forward without its MLP (MlpForward or MoeForward adds it): its
// attention (multi-latent attention's projections when the model has it). `window`: the
// layer's sliding window (GptConfig::AttentionWindow; -1 none), which flash / fused attention
// skips the blocks left of (materialised attention computes the whole s x s whatever the
// mask).
LayerCost LayerForward(const GptConfig& g, const Sizes& x, const AttentionKernels& kernels,
                       int64_t window = -1);

// The first virtual stage's embedding (word and position lookups, their sum, dropout) and
// the last one's final norm, output layer and cross entropy, forward.
Cost EmbeddingForward(const GptConfig& g, const Sizes& x);
Cost OutputForward(const Sizes& x, double padded_vocab);

}  // namespace mpusim::step_time
