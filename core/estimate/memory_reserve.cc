#include "core/estimate/memory_reserve.h"

#include <cmath>
#include <optional>

#include "core/config/model_facts.h"

namespace mpusim {
namespace {

// Whether world rank `rank` is in a group of kind `kind` with more than one member.
bool InGroupOfSeveral(const Topology& topology, const char* kind, int64_t rank) {
  const std::optional<size_t> k = topology.FindKind(kind);
  if (!k || topology.GroupSize(*k) <= 1) return false;
  return topology.Locate(*k, rank).has_value();
}

}  // namespace

std::vector<std::string> NcclCommunicators(const Config& config, const Topology& topology,
                                           int64_t rank) {
  std::vector<std::string> kinds;
  const auto add = [&](const char* kind) {
    if (InGroupOfSeveral(topology, kind, rank)) kinds.emplace_back(kind);
  };
  // The default group: Megatron's initialize.py synchronises it with barriers.
  if (topology.world_size() > 1) kinds.emplace_back("world");
  add("tp");
  add("cp");
  add("pp");
  add("dp_cp");
  const bool distributed = config.optimizer && config.optimizer->use_distributed_optimizer;
  if (config.optimizer) add(distributed ? "intra_dist_opt" : "mp");
  const ModelFacts facts = FactsOf(config);
  if (facts.tied_embeddings) add("embd");
  if (facts.moe.enabled()) {
    if (facts.moe.token_dispatcher == MoeDispatcher::kAllToAll) {
      add("ep");
      add("expt_tp");
    } else {
      add("tp_ep");
    }
    add("expt_dp");
  }
  return kinds;
}

MemoryReserve EstimateMemoryReserve(const Config& config, const Topology& topology,
                                    const GpuSpec& gpu, int64_t rank, PlanBytes transient) {
  MemoryReserve r;
  r.cuda_context = kCudaContextBytes;
  const bool hopper = gpu.compute_capability >= 90;
  const PlanBytes te = hopper ? kTeCublasWorkspaceSm90 : kTeCublasWorkspaceOlder;
  const MoeConfig& moe = FactsOf(config).moe;
  const bool grouped = moe.enabled() && moe.grouped_gemm;
  r.cublas_workspaces = (hopper ? kTorchCublasWorkspaceSm90 : kTorchCublasWorkspaceOlder) +
                        te * (1 + (grouped ? kTeGroupedGemmStreams : 0));
  r.communicators = NcclCommunicators(config, topology, rank);
  r.nccl_buffers = static_cast<PlanBytes>(r.communicators.size()) * kNcclBytesPerCommunicator;
  // Rounded down to a byte: the fraction of a count below 2^100 (core/memory_plan.h).
  r.fragmentation = static_cast<PlanBytes>(std::floor(static_cast<double>(transient) *
                                                      kFragmentation));
  r.total = SaturatingAdd(SaturatingAdd(r.cuda_context, r.cublas_workspaces),
                          SaturatingAdd(r.nccl_buffers, r.fragmentation));
  return r;
}

MemoryReserve GivenReserve(PlanBytes bytes) {
  MemoryReserve r;
  r.given = true;
  r.total = bytes;
  return r;
}

StatusOr<PlanBytes> ReserveGibToBytes(double gib) {
  if (!std::isfinite(gib) || gib < 0 || gib > 1e6) {
    return Status::Error("--reserve-gib", "must be a number of GiB from 0 to 1e6");
  }
  return static_cast<PlanBytes>(std::llround(gib * 1024.0 * 1024.0 * 1024.0));
}

}  // namespace mpusim
