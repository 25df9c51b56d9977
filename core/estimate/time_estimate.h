// How long one training iteration of a layout takes on a GPU cluster, and the model FLOP/s
// and MFU that follow, from the config and a GPU description alone.
//
// The model, per micro-batch and pipeline stage (docs/estimate.md, "The time model" has the table):
//   compute     every linear GEMM priced by its own shape (GemmSeconds below: QKV, projection,
//               fc1, fc2, logits, router, the experts' fc1 and fc2 as one grouped launch of
//               rows-per-expert GEMMs, the shared expert; backward: each GEMM's dgrad and
//               wgrad by their shapes), materialised attention's scores and context at the flat
//               gemm_efficiency x the dense peak (flash / fused: below), plus every memory-bound
//               kernel's bytes (norms, softmax, dropout, the activation function, bias-dropout-add,
//               cross entropy, fp8's quantize kernels) at memory_efficiency of the HBM bandwidth;
//               backward = twice the forward's bytes, and full recomputation adds a layer's
//               forward to its backward (selective: the core attention's), reported apart as
//               recompute (TimeEstimate::recompute_s);
//   attention   by the backend attention_backend.h resolves: materialised ("unfused",
//               "local") computes the full s x s scores and context as GEMMs and moves the
//               softmax's and dropout's s x s bytes, as above; flash / fused ("flash",
//               "fused") runs one kernel that moves nothing s x s, skips the 128 x 128 tiles
//               above the causal diagonal (of n x n tiles, n (n + 1) / 2: n = 16 at 2048
//               positions, 17/32 of the scores), and whose backward recomputes QK^T (2.5 x the
//               forward's FLOPs); each at the GPU's attention_efficiency_forward / _backward
//               times L / (L + L_half), L the keys a query tile visits (L_half 105 forward, 374
//               backward: the curve through cuDNN's measured 512- and 16k-position points,
//               layer_cost.cc), so small blocks run slower;
//   tp          the layer's collectives (two per forward, two per backward, two more per
//               recomputed forward: all-reduces, or reduce-scatter + all-gather with sequence
//               parallelism; the same bytes per rank), ring algorithm, not overlapped with
//               compute (Megatron's default); with parallel.tp_comm_overlap each all-gather or
//               reduce-scatter beside the GEMM Transformer Engine's userbuffers pair it with
//               (TpOverlapOf in comm_overlap.cc: QKV/fc1 forward and the projection's/fc2's
//               dgrad in tp chunks, the projection/fc2 forward in 4, the QKV's/fc1's wgrad in
//               bulk), only its exposed part in the step;
//   cp          each rank computes s / cp tokens (its queries against every key); per layer
//               and pass, cp_comm_type "all_gather" all-gathers the keys and values forward
//               and reduce-scatters their gradients backward, "a2a" makes four all-to-alls
//               each way (q, k, v, the context), both not overlapped; the ring ("p2p") sends
//               its keys and values cp - 1 times forward and them and their gradients
//               backward, each send overlapped with one ring step's attention only (flash:
//               a half block of c = s / (2 cp) keys by 2c queries at the efficiency of c
//               keys; materialised: 1/cp of the core attention), what a send takes beyond
//               its step exposed, and flash's merges of the steps' partial results
//               (memory-bound) counted as compute; recomputation repeats the forward's;
//               "a2a+p2p" is refused;
//   moe         an MoE layer in place of the MLP, for balanced routing (each rank's tokens
//               choose k experts each, every expert gets as many choices; a capacity factor
//               below 1 keeps that share, padding to the capacity computes it): the router's
//               logits and top-k, the experts' fc1 and fc2 on the rank's T k rows of whole
//               experts' work (etp splits an expert's columns over the rows gathered from its
//               etp ranks) as E / ep GEMMs of (rows x etp) / (E / ep) rows each, one
//               grouped launch with moe_grouped_gemm, else one launch per expert
//               (SequentialMLP), the permutation's copies (alltoall with local experts > 1:
//               the received rows sorted by expert and back too), the shared expert as a
//               dense MLP; the dispatcher's exchanges per layer and pass, not overlapped
//               (but see overlap_moe_expert_parallel_comm below): "alltoall" two
//               all-to-alls over ep (each rank's rows that go to other ep ranks: those for
//               its own node's ep ranks over NVLink, the rest over its network adapter, at
//               once, the slower setting the time) and with
//               etp > 1 an all-gather and a reduce-scatter over expt_tp, "allgather" an
//               all-gather and a reduce-scatter over etp x ep; full recomputation repeats them;
//               an MoE layer's only tp collective is its attention's (and a shared expert's);
//               with parallel.overlap_moe_expert_parallel_comm Megatron's combined 1F1B runs
//               each steady forward beside the backward after it (one more warmup forward per
//               rank, core/schedule.h), an MoE layer of one beside one of the other on two
//               streams (CombinedSeconds below), so each one's all-to-alls hide behind the
//               other's compute;
//   pp          each activation and gradient p2p transfer delays the step that waits for it
//               and holds the rank that sends it (Megatron waits for its sends unless
//               overlap_p2p_comm); the bubble comes from replaying Megatron's own 1F1B or
//               interleaved schedule (core/schedule.h, TimeSchedule) with every virtual
//               stage's costs;
//   dp          the gradient all-reduce over dp x cp (with the distributed optimizer: reduce-
//               scatter of the gradients and all-gather of the parameters) after the last
//               backward, exposed; the experts' parameters over expt_dp after it. With
//               optimizer.overlap_grad_reduce the reductions run bucket by bucket during each
//               chunk's last backward (bucket_size parameters on pipeline rank 0's first chunk,
//               one bucket per other chunk, as Megatron's DDP), one after another per rank;
//               with overlap_param_gather each chunk's first forward waits for the exposed part
//               of its all-gather (aligned launches with the interleaved schedule) and the
//               schedule is replayed with those waits;
//   optimizer   the step's memory traffic over the elements the rank owns.
// Overlapped transfers follow one rule: comm cut in n chunks pipelined with compute leaves
// max(comm / n, comm - (n - 1) / n * compute) exposed (PipelinedExposed); *_comm_s is the
// exposed part, *_comm_hidden_s the rest. Not modelled: the slowdown of the compute that
// overlapped communication shares the GPU with (SMs and memory bandwidth).
// Step time = the replayed pipeline span + dp + optimizer. A collective's bandwidth is the
// intra-node one when its group stays in a node. Across nodes a ring collective whose group
// has g members on each node gets g x the per-GPU inter-node bandwidth (at most the intra-
// node one): all groups of a kind run at once and share a node's adapters, one per GPU; a
// p2p send gets one adapter's. Each ring step pays the link's latency.
//
// Model FLOPs are counted as Megatron's num_floating_point_operations counts them: 3 x the
// forward GEMMs' FLOPs (QKV, attention scores and context over half of s x s for the causal
// mask, as its count does since 2025-03, projection, MLP or an MoE layer's top-k experts and
// shared expert, logits), no recomputation (nor flash attention's recomputed QK^T, which
// flops_per_rank counts); model TFLOP/s per GPU = that / step time / world size, and MFU =
// that / the GPU's peak for the run's dtype.
//
// The GEMM curve (GemmSeconds): a GEMM C[m, n] = A[m, k] B[k, n] (`count` of them in one
// grouped launch) takes
//   max(compute, memory),
//   compute = waves x sm_count x 2 tm tn k / (ceiling x peak),
//             waves = ceil(count ceil(m / tm) ceil(n / tn) / sm_count), (tm, tn) the
//             orientation of kGemmTiles with the fewer waves x tile area; every SM
//             computes one output tile per wave, the last wave partly
//             idle (tile and wave quantization, NVIDIA's "Matrix Multiplication Background
//             User's Guide" sections 3.1 and 3.2);
//   memory  = (in_bytes (m k + k n) + out_bytes m n) x count / (memory_efficiency x HBM)
//             (the guide's arithmetic-intensity roofline, section 2);
// ceiling x peak is the "maximum achievable matmul FLOPS" (MAMF) measured for the GPU and
// dtype (Stas Bekman, ml-engineering, compute/accelerator/README.md): gemm_efficiency for
// bf16/fp16, gemm_efficiency_8bit for fp8. Large GEMMs reach the ceiling; small ones pay
// their partial wave and, below the ridge point, HBM. Its efficiency = 2 m n k count /
// (seconds x peak).
//
// fp8 (model.fp8, Transformer Engine's recipes): the linear layers' GEMMs (QKV, projection,
// fc1, fc2, experts, shared expert) run at peak_flops_8bit x gemm_efficiency_8bit with 1-byte
// inputs and 2-byte outputs, forward, dgrad and wgrad; the router, the logits
// (Megatron's output_layer is tensor_parallel.ColumnParallelLinear, not TE) and the core
// attention stay at the 16-bit peak. Each linear's input, and in the backward its output
// gradient, passes one cast-transpose kernel (read 2 bytes, write 1-byte row- and column-wise
// copies: 4 bytes an element); each weight one per iteration (TE caches fp8 weights after
// the first micro-batch). MFU stays quoted against the 16-bit dense peak whatever fp8 does,
// so a model's fp8 and bf16 runs compare on one scale (Megatron logs model TFLOP/s per GPU).
//
// What it does not model (EstimateStepTime refuses, naming the field): "a2a+p2p"
// hierarchical context parallelism; a lab chain model. What it leaves out: kernel launch
// overheads, data loading, overlap of communication with compute beyond the three overlap
// options and the cp ring, uneven routing, and the GPU's clock under power limits.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/config/config.h"
#include "core/estimate/attention_backend.h"
#include "core/estimate/gpu_spec.h"
#include "core/estimate/memory_estimate.h"
#include "core/schedule.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {


// The output tiles the GEMM curve chooses from (rows x columns of C): the 256 x 128 tile of
// NVIDIA's Matrix Multiplication Background guide (section 2.3, cuBLAS's largest and most
// efficient; section 3.2 quantizes waves with it), in either orientation. Smaller tiles that
// cuBLAS may pick for small GEMMs are not modelled (a small GEMM is priced as this tile
// runs it: pessimistic where a smaller tile would fill the waves better).
struct GemmTile {
  int64_t rows, cols;
};
inline constexpr GemmTile kGemmTiles[] = {{256, 128}, {128, 256}};

// One GEMM C[m, n] = A[m, k] B[k, n]; `count` independent ones of this shape in one launch
// (a grouped GEMM of experts, a batched one of heads). `fp8`: Transformer Engine's fp8 GEMM
// (1-byte inputs, 2-byte output) at the fp8 peak; else the run's dtype.
struct GemmShape {
  double m = 0, n = 0, k = 0;
  double count = 1;
  bool fp8 = false;
  double Flops() const { return 2 * m * n * k * count; }
};
// Seconds of `shape` on `gpu` (the curve in the header comment); `element_bytes` the run's
// dtype size (ignored for fp8), `peak` the run's dtype's dense peak.
double GemmSeconds(const GpuSpec& gpu, const GemmShape& shape, double element_bytes, double peak);
// Achieved fraction of `peak` (fp8: of the fp8 peak).
double GemmEfficiency(const GpuSpec& gpu, const GemmShape& shape, double element_bytes,
                      double peak);

// overlap_moe_expert_parallel_comm: one MoE layer's forward of one micro-batch beside its
// backward of another, as Megatron's TransformerLayerSchedulePlan.run issues them on two
// streams (megatron/core/models/common/model_chunk_schedule_plan.py):
//   comm stream:    combine_bwd | dispatch_fwd -> dispatch_bwd       | combine_fwd
//   compute stream: attn_fwd    | mlp_bwd -> mlp_bwd_dw -> mlp_fwd   | attn_bwd
// each starting when its stream is free and its input exists: mlp_bwd (the data gradients,
// `mlp_dgrad`) after combine_bwd, dispatch_fwd after attn_fwd (the router's choices),
// dispatch_bwd after mlp_bwd's data gradients with delay_wgrad_compute, else after its weight
// gradients (`mlp_wgrad`) too, mlp_fwd after dispatch_fwd, combine_fwd after mlp_fwd,
// attn_bwd after dispatch_bwd. The pair takes until both streams are done. "attn" is the
// layer's pre-dispatch part (norms, attention, router, the tp collectives beside them), "mlp"
// the experts (permutation and shared expert included); each exchange is one all-to-all (and
// with etp > 1 its gather or scatter over expt_tp).
struct CombinedLayer {
  double attn_fwd = 0, mlp_fwd = 0, dispatch_fwd = 0, combine_fwd = 0;
  double attn_bwd = 0, mlp_dgrad = 0, mlp_wgrad = 0, dispatch_bwd = 0, combine_bwd = 0;
  double Forward() const { return attn_fwd + mlp_fwd + dispatch_fwd + combine_fwd; }
  double Backward() const {
    return attn_bwd + mlp_dgrad + mlp_wgrad + dispatch_bwd + combine_bwd;
  }
};
double CombinedSeconds(const CombinedLayer& layer, bool delay_wgrad_compute);

// A pipeline stage's costs per micro-batch: all of its model chunks together.
struct StageTime {
  int64_t stage = 0;
  double forward_s = 0;
  double backward_s = 0;  // recomputation included
  double flops = 0;       // executed per micro-batch (recomputation included)
};

// One kind of communication of the busiest stage's rank over one iteration.
struct CommTime {
  std::string kind;  // "tp", "cp", "ep", "pp", "dp", "expt_dp"
  std::string operation;
  int64_t count = 0;  // per iteration
  double bytes = 0;   // per iteration, what this rank sends
  double seconds = 0;   // what the step waits for (exposed)
  bool inter_node = false;
  double hidden_s = 0;  // what runs beside compute (tp_comm_overlap, overlap_grad_reduce, ...)
};

struct TimeEstimate {
  GpuSpec gpu;
  int64_t num_microbatches = 0;
  int64_t global_batch_size = 0;
  double step_time_s = 0;
  // Parts of the step on the busiest stage: compute, tp, cp and ep are M x its
  // per-micro-batch costs; pp its blocking sends (Megatron waits for each send: every step
  // whose output goes to another rank holds its rank for the transfer); bubble = pipeline
  // span - compute - recompute - tp - cp - ep - pp (idle time, waits for receives included).
  // With overlap (tp_comm_overlap, overlap_grad_reduce, overlap_param_gather,
  // overlap_moe_expert_parallel_comm) each kind's *_comm_s is its exposed part, the one that
  // adds to the step, and *_comm_hidden_s what runs beside compute; the total traffic's time
  // is their sum.
  double compute_s = 0;
  // The busiest stage's recomputation (full: each layer's forward again; selective: its core
  // attention), M x per micro-batch; apart from compute_s, whose GEMMs and kernels it repeats.
  double recompute_s = 0;
  double tp_comm_s = 0;
  double tp_comm_hidden_s = 0;
  double cp_comm_s = 0;  // what the step waits for of context parallelism's exchanges
  double ep_comm_s = 0;  // mixture-of-experts layers' token exchanges (the dispatcher's)
  // What overlap_moe_expert_parallel_comm's combined pairs hide of them.
  double ep_comm_hidden_s = 0;
  double pp_comm_s = 0;
  double bubble_s = 0;
  double dp_comm_s = 0;          // gradient reduction and parameter gather, exposed
  double dp_comm_hidden_s = 0;   // of the busiest stage's, what overlap hides
  int64_t dp_buckets = 1;        // gradient buckets of pipeline rank 0's first chunk
  double optimizer_s = 0;
  // The busiest stage's shape-priced GEMMs (all but the core attention's): their FLOPs over
  // the seconds each takes x its own peak (fp8 GEMMs the fp8 peak): the achieved fraction.
  double gemm_efficiency_achieved = 0;
  double flops_per_rank = 0;  // executed by the busiest stage's rank per iteration
  double model_flops = 0;     // per iteration over all ranks, Megatron's count
  double model_tflops_per_gpu = 0;
  double mfu = 0;
  std::vector<StageTime> stages;
  std::vector<CommTime> communication;
  ResolvedAttention attention;  // the attention kernel counted (attention_backend.h)
};

// Needs a GPT model and a run section (seq_length, micro_batch_size, num_microbatches).
// Errors name the field that makes the estimate impossible.
// `held`: EstimateStageHeldMemory(config, topology), when the caller has it already (advise
// reuses it across the candidates that share a layout); else it is counted here. `schedule`:
// the run's BuildPipelineSchedule, likewise.
StatusOr<TimeEstimate> EstimateStepTime(const Config& config, const Topology& topology,
                                        const GpuSpec& gpu,
                                        const std::vector<StageHeldMemory>* held = nullptr,
                                        const PipelineSchedule* schedule = nullptr);

// Megatron's model FLOPs of one iteration of `samples` sequences (no recomputation).
double ModelFlopsPerIteration(const GptConfig& gpt, int64_t padded_vocab, int64_t seq_length,
                              int64_t samples);

}  // namespace mpusim
