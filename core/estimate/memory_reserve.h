// The memory reserve: what a GPU run of Megatron-Core holds beyond the tensors the estimate
// counts (parameters, main_grad, optimizer state, activations, the pipeline and sequence-
// parallel buffers), so that "fits" means peak + reserve <= the GPU's memory.
//
// What it is, per pipeline stage's busiest rank (docs/estimate.md, "The memory reserve" has the
// table and the sources):
//   cuda context   kCudaContextBytes: the CUDA context with its loaded kernels, as measured
//                  under PyTorch (the first CUDA tensor takes 723 MiB of a GPU: PyTorch forum
//                  "What is the reason for pytorch's GPU memory floor?", discuss.pytorch.org
//                  t/73021; ~700+ MiB in t/81330);
//   cublas         PyTorch's cuBLAS workspace of the one compute stream Megatron's GEMMs run
//                  on (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize:
//                  ":4096:8" = 32 MiB on compute capability >= 9.0, ":4096:2:16:8" = 8 MiB +
//                  128 KiB below; the cuBLASLt workspace is the same buffer,
//                  TORCH_CUBLASLT_UNIFIED_WORKSPACE), plus TransformerEngine's own
//                  (transformer_engine/pytorch/module/base.py, get_cublas_workspace_size_bytes:
//                  32 MiB on >= 9.0, 4 MiB below), and with moe_grouped_gemm one more per
//                  stream of TE's multi-stream grouped GEMM (get_multi_stream_cublas_workspace,
//                  nvte_get_num_compute_streams() = 4);
//   nccl           per NCCL communicator the rank uses in a step, kNcclChannels channels each
//                  holding one connection's buffers for the three protocols (NCCL
//                  src/init.cc: DEFAULT_BUFFSIZE 4 MiB for Simple, DEFAULT_LL_BUFFSIZE
//                  8 x 512 x 8 x 16 B = 512 KiB, DEFAULT_LL128_BUFFSIZE 120 x 640 x 8 x 8 B =
//                  4.69 MiB); the communicators are Megatron's groups of size > 1 that a step
//                  uses (NcclCommunicators below);
//   fragmentation  kFragmentation of what the step allocates and frees (the activations and
//                  buffers at the peak): the caching allocator's average fragmentation
//                  GMLake measured over eight LLMs on A100-80GB (Guo et al., ASPLOS 2024,
//                  arXiv 2401.08156: 15% on average, up to 33%); the held tensors live in a
//                  few buffers allocated once (Megatron's ParamAndGradBuffer), so they are not
//                  charged.
// `mpusim estimate --reserve-gib X` and `mpusim advise --reserve-gib X` replace the sum with
// X GiB on every rank.
// What it is not: a measurement (no GPU has checked it; the context predates CUDA's lazy
// loading and may be high, the NCCL channels may be low on H100s). TE's userbuffers
// (tp_comm_overlap), CUDA graphs' pools, NCCL's small per-communicator structures and the MoE
// dispatchers' buffers are not in it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/estimate/time_estimate.h"
#include "core/memory_plan.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {

inline constexpr PlanBytes kMiB = PlanBytes{1} << 20;
inline constexpr PlanBytes kCudaContextBytes = 723 * kMiB;
inline constexpr PlanBytes kTorchCublasWorkspaceSm90 = 4096 * 1024 * 8;           // ":4096:8"
inline constexpr PlanBytes kTorchCublasWorkspaceOlder = 4096 * 1024 * 2 + 16 * 1024 * 8;
inline constexpr PlanBytes kTeCublasWorkspaceSm90 = 33554432;
inline constexpr PlanBytes kTeCublasWorkspaceOlder = 4194304;
inline constexpr int64_t kTeGroupedGemmStreams = 4;
inline constexpr PlanBytes kNcclSimpleBuffer = PlanBytes{1} << 22;
inline constexpr PlanBytes kNcclLlBuffer = 8 * 512 * 8 * 16;
inline constexpr PlanBytes kNcclLl128Buffer = 120 * 640 * 8 * 8;
// NCCL picks the channels by topology (at most NCCL_MAX_NCHANNELS); 16 is what it reports
// for the 8 H800s of a node ("16 coll channels", NVIDIA/nccl issue #892); H100s, with more
// NVLinks, may get up to 32.
inline constexpr int64_t kNcclChannels = 16;
// One communicator's buffers: every channel holds one connection's of the three protocols.
inline constexpr PlanBytes kNcclBytesPerCommunicator =
    kNcclChannels * (kNcclSimpleBuffer + kNcclLlBuffer + kNcclLl128Buffer);
inline constexpr double kFragmentation = 0.15;

struct MemoryReserve {
  PlanBytes cuda_context = 0;
  PlanBytes cublas_workspaces = 0;
  PlanBytes nccl_buffers = 0;
  std::vector<std::string> communicators;  // the group kinds whose NCCL buffers are counted
  PlanBytes fragmentation = 0;
  bool given = false;  // --reserve-gib replaced the count; total is that
  PlanBytes total = 0;
};

// The group kinds (the planner's names, and "world") whose NCCL communicator world rank
// `rank` uses in a
// training step: world (the default group, which megatron/training/initialize.py's barriers
// use), tp (the layers' collectives), cp (the attention's exchanges), pp (the
// p2p sends), dp_cp (the gradients, distributed_data_parallel.py), the gradient-norm group
// (mp with the plain optimizer, intra_dist_opt with the distributed one: optimizer.py and
// distrib_optimizer.py get_grad_stats_parallel_group), embd when the rank is in it and the
// embeddings are tied (finalize_model_grads.py), and for MoE layers ep and expt_tp
// (alltoall dispatcher) or tp_ep (allgather), and expt_dp (the experts' gradients); each only
// when its group has more than one rank.
std::vector<std::string> NcclCommunicators(const Config& config, const Topology& topology,
                                           int64_t rank);

// The reserve of world rank `rank` whose step allocates and frees `transient` bytes
// (activations + buffers at the peak; 0 when they are not known).
MemoryReserve EstimateMemoryReserve(const Config& config, const Topology& topology,
                                    const GpuSpec& gpu, int64_t rank, PlanBytes transient);
// The reserve --reserve-gib gives.
MemoryReserve GivenReserve(PlanBytes bytes);
// --reserve-gib's value in bytes (rounded to the nearest byte); errors name the flag.
StatusOr<PlanBytes> ReserveGibToBytes(double gib);

}  // namespace mpusim
