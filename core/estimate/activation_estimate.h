// The activations a GPU run of Megatron keeps at its pipeline schedule's peak, per stage, by
// the published count: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
// Transformer Models", arXiv 2205.05198, section 4), generalised to the config's dtype,
// query groups, ffn size, gated activations and dropout, and walked through Megatron's own
// schedule instead of assuming p micro-batches in flight.
//
// Per layer and micro-batch, in bytes, with e the storage dtype's size, m_h / m_a 1 when the
// hidden / attention dropout is on (its mask is one byte per element), T = s * b tokens,
// t the tp size and, under sequence parallelism, everything divided by t:
//   kept whole by tp      T * h * (4e + 2 m_h)            norm 1 and 2 inputs, the QKV and
//                                                          fc1 inputs, two dropout masks
//   split over tp         T * e * (q + 2kv + q + f1 + f) / t   Q, K, V, the projection's input,
//                                                          the activation's input and output
//   attention scores      b * a * s^2 * (e + m_a * (e + 1)) / t   softmax output, and with
//                                                          dropout its mask and output
//                                                          (materialised attention: the
//                                                          "unfused" and "local" backends)
//   or the log-sum-exp    4 * b * a * s / t               flash / fused attention (the
//                                                          "flash" and "fused" backends,
//                                                          attention_backend.h): float32 per
//                                                          query row and head; Q, K, V and
//                                                          the output are the split terms;
//                                                          no dropout mask (the kernel
//                                                          regenerates it from its seed)
// where q = heads * kv_channels, kv = query_groups * kv_channels, f1 = fc1 rows (2 ffn when
// gated), f = ffn. For the standard GPT (e = 2, dropout on, q = h, kv = h, f = 4h) this is
// Korthikanti's sbh (10 + 24/t + 5as/(ht)), and sbh (34 + 5as/h) / t with sequence
// parallelism (materialised attention; "auto" resolves to it only for float32 or a GPU
// before compute capability 8.0, attention_backend.h). Selective recomputation drops what
// recompute_modules names: "core_attn" the scores (or the log-sum-exp), "layernorm" the QKV
// and fc1 (or MoE) inputs, "mlp" a dense layer's activation input and output. Full
// recomputation keeps, of each recomputed group of a chunk (run.recompute_method), its first
// layer's input alone, T * h * e (/ t with sp), and nothing of the others. The first stage adds the
// embedding dropout's mask, the last the final norm's input and the float32 logits of one
// micro-batch, 4 T V / t. Each model chunk's stash is added when its forward runs and dropped when
// its backward does, following Megatron's 1F1B or interleaved order (core/schedule.h); the peak is
// the largest sum. Under the combined 1F1B (overlap_moe_expert_parallel_comm) a steady pair runs
// the forward's layers beside the backward's in reverse, so the forward's stash grows a layer at a
// time as the backward's shrinks: the pair holds at most live + max(n lf - (n - 1) lb, lf)
// (per-layer stashes lf, lb over n layers).
//
// Buffers, per stage: the pipeline's send and receive of one activation each way
// (4 * T * h * e, / t with sp) and, under sequence parallelism, the all-gathered layer input
// (T * h * e). What a GPU run adds on top (cuBLAS workspaces, NCCL's own buffers, the caching
// allocator's slack) is not counted, and the text says so.
//
// Context parallelism (cp ranks) gives each rank s / cp tokens: every term above is divided
// by cp. With materialised attention the probabilities are of this rank's queries against
// every key under cp_comm_type "all_gather" (which also keeps the gathered keys and values of
// all s positions, 2 b s kv e / t) and of every query of 1/cp of the heads under "a2a":
// b a s^2 (...) / (t cp) either way; the ring ("p2p", Megatron's default, and "a2a+p2p") keeps
// no probabilities but each query row's log-sum-exp in float32, 4 b a (s / cp) / t, as
// mpusim's layer does. With flash / fused attention every cp_comm_type keeps that
// log-sum-exp (a2a: every row of 1/cp of the heads, as many) and all_gather its gathered keys
// and values.
//
// fp8 (model.fp8): Transformer Engine's linear layers save their inputs for the weight
// gradient quantized, column-wise only (transformer_engine/pytorch/module/linear.py
// `saved_inputmat`, layernorm_linear.py `ln_out_to_save`, GroupedLinear likewise): the QKV
// and fc1 inputs (norm outputs), the projection's input and fc2's (the activation's output),
// the experts' permuted rows and their fc2 input, and a shared expert's fc2 input each take
// x = 1 byte an element, plus the recipe's scales (blockwise 4 / 128, mxfp8 1 / 32, delayed
// and tensorwise none), in place of e: whole T h (2e + 2x + 2 m_h), split
// T (e (q + 2kv + f1) + x (q + f)) / t. Q, K, V (the core attention's), fc1's output (the
// activation's input) and the norms' inputs stay in the run's dtype.
//
// Multi-latent attention (model.multi_latent_attention; Megatron's MLASelfAttention with
// Transformer Engine's spec, its down projections "duplicated" over tp on the sequence-split
// input): in place of Q, K, V of kv_channels the core attention's queries and keys of
// qk + pe channels a head (the shared rope key expanded to every head) and values of v, the
// projection's input a v per head; and, whole (divided by t under sp), the q and kv latents
// (the q and kv norms' inputs, q_lora_rank and kv_lora_rank a token) and the norms' outputs
// (the up projections' inputs, x bytes), plus the rope key's input (pe a token, every
// position). The probabilities or log-sum-exp per head as above. Multi-token prediction
// (mtp_num_layers D) adds to the last stage's stash, per depth: its embedding's dropout mask,
// enorm's and hnorm's inputs and eh_proj's input (the two norms' outputs, x bytes), a layer
// like the last decoder layer (not recomputed), its final norm's input and another float32
// logits of one micro-batch: T h (m_h + 3e + 2x) / sp + layer + 4 T V / t. A sliding window
// (window_size) changes nothing here: flash / fused attention keeps its log-sum-exp, and
// materialised attention the whole s x s (the window is a mask, and flash stores none).
//
// This is a GPU run's count, not the CPU executor's: mpusim's executor keeps its own stash
// (float32 by default, and the tensors its kernels need), which `mpusim run --summary`
// measures as peak - held, and executor_activations.h counts.
//
// A mixture-of-experts layer keeps the attention's part above (the whole part, the split
// Q, K, V and projection input, the scores) and, in place of the MLP's activation input and
// output, what Megatron's MoE layer saves for its backward, for balanced routing (each expert
// gets as many of the choices; a capacity factor below 1 keeps that share of them, padding to
// the capacity keeps the capacity), with Tn this rank's tokens (T / t with sp, which MoE needs
// when t > 1), E experts, top k, kept rows r = Tn k and n = r etp rows for the rank's experts
// (gathered over its etp ranks), f_m the experts' ffn size (f1_m its fc1 rows):
//   router                Tn E (4 + 1) + Tn k 4          float32 scores and the routing map
//                                                          per expert, float32 chosen probs
//   experts               n h e + n (f1_m + f_m) e / etp  the permuted input rows, fc1's
//                                                          output and the activation's
//   combine               r (8 + h e + p)                  the permutation's int64 ids, the
//                                                          returned rows and their
//                                                          probabilities for the weighted sum,
//                                                          p bytes each: the router's dtype
//                                                          (moe_router_dtype, else the run's)
//   shared expert         T e (f1_s + f_s) / t            as a dense MLP's split part
// Selective recomputation drops the scores; full keeps the layer's input, as for a dense
// layer. The dispatchers' communication buffers are not counted.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config/config.h"
#include "core/estimate/attention_backend.h"
#include "core/memory_plan.h"
#include "core/schedule.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {

struct StageActivations {
  int64_t stage = 0;
  int64_t peak_stashes = 0;  // model-chunk stashes alive at the peak
  PlanBytes activations = 0;
  PlanBytes buffers = 0;
};

// Needs a GPT model and a run section; errors name the field the count cannot handle.
// `schedule`: the run's BuildPipelineSchedule, when the caller has it already (advise reuses
// it across the candidates that share pp, vp and the micro-batch count); else it is built here.
// `attention`: ResolveAttentionBackend's answer for the GPU (which attention is counted).
StatusOr<std::vector<StageActivations>> EstimateStageActivations(
    const Config& config, const Topology& topology, const ResolvedAttention& attention,
    const PipelineSchedule* schedule = nullptr);

}  // namespace mpusim
