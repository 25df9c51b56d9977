// The resource preflight of `mpusim run`: how many bytes one rank will hold, computed from
// the config before anything is allocated, and the refusal when that is over the limit.
//
// What it is: per-rank bytes of parameters, main_grad, for a GPT the optimizer's state and
// step buffers (core/model/optimizer_plan.h, as the estimate counts them), the activations
// (for a GPT: this
// rank's pipeline schedule at its peak, the declared stashes of the (chunk, micro-batch) pairs
// in flight, the backward step's working set and the pipeline's transfers, counted from the
// same declarations as `mpusim estimate`'s executor count, core/model/activation_plan.h; an
// MoE layer's rows the most its routing can give the rank; for the layer chain, each layer's
// saved tensors, graph_plan.cc), and, when the run is checked, the float64 reference's share (full master weights and gradients, this rank's slice of the
// token rows) and the check's exchange buffers. On the CPU all of it is host memory; with a
// GPU backend the executor's items are checked against the GPU's free memory
// (CheckDeviceMemory, once the backend exists) and only the reference's against the host's.
// Every count is formed in 128-bit arithmetic and capped (core/memory_plan.h), so sizes whose
// products wrap int64 or size_t are refused like any other oversized run, never allocated.
// Each model counts its own tensors (Model::PlanMemory); the preflight judges the sum.
// What it is not: an exact allocator trace. It counts each tensor the executor and the
// reference keep, not the program's own footprint (libraries, MPI buffers: tens of MiB),
// allocator slack or temporaries of a single kernel (nor the layer chain's optimizer). A
// GPT's activations and optimizer buffers are at least what the run measures (peak - held),
// equal to it for a dense model (MemoryEstimate.* in the MPI tests). `mpusim run` prints it next to the
// measured peak RSS, and the README's reliability section compares the two.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/config/config.h"
#include "core/memory_plan.h"
#include "core/model/model.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim::run {

// The plan for this rank of `model` (Model::PlanMemory), with the check's share when
// `check`: `world_size` ranks share the reference's work and exchange buffers of
// kExchangeBytes (run/check.h).
MemoryPlan PlanRankMemory(const Model& model, int64_t world_size, bool check);

// OK when plan.total <= limit_bytes; otherwise an error at "run" naming the total, the
// limit and where it comes from (`limit_source`), the biggest items and what to do (`remedy`).
Status CheckRankMemory(const MemoryPlan& plan, uint64_t limit_bytes,
                       const std::string& limit_source,
                       const std::string& remedy = "raise the limit with --max-memory");

// The device preflight of a backend with memory of its own (Backend::Memory, a GPU): the
// plan's device items against the device's free memory shared by the ranks that use it.
Status CheckDeviceMemory(const MemoryPlan& plan, const DeviceMemory& device);

// "512M", "4G", "1.5GiB", "1000000" (bytes): a size for --max-memory; nullopt if malformed
// or not positive.
std::optional<uint64_t> ParseByteSize(const std::string& text);

// "3.2 GiB", "512.0 MiB", "more than 16 EiB" for a 128-bit byte count.
std::string FormatBytes(unsigned __int128 bytes);

// This machine's available memory (MemAvailable in /proc/meminfo), nullopt if unknown.
std::optional<uint64_t> AvailableMemoryBytes();

}  // namespace mpusim::run
