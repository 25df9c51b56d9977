// The resource preflight of `mpusim run`: how many bytes one rank will hold, computed from
// the config before anything is allocated, and the refusal when that is over the limit.
//
// What it is: per-rank bytes of parameters, main_grad, the activations and saved tensors of
// one micro-batch (the stash the backward pass needs), and, when the run is checked, the
// float64 reference's share (full master weights and gradients, this rank's slice of the
// token rows) and the check's exchange buffers. On the CPU all of it is host memory; with a
// GPU backend the executor's items are checked against the GPU's free memory
// (CheckDeviceMemory, once the backend exists) and only the reference's against the host's.
// Every count is formed in 128-bit arithmetic and capped, so sizes whose products wrap int64
// or size_t are refused like any other oversized run, never allocated.
// What it is not: an exact allocator trace. It counts each tensor the executor and the
// reference keep, not the program's own footprint (libraries, MPI buffers: tens of MiB),
// allocator slack or temporaries of a single kernel. `mpusim run` prints it next to the
// measured peak RSS, and the README's reliability section compares the two.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/config.h"
#include "core/model/graph.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim::run {

struct MemoryItem {
  std::string name;  // "fc1.weight", "fc1.output_grad", "reference: master weights"
  Shape shape;       // local shape on this rank ({} for aggregates)
  DType dtype;
  unsigned __int128 bytes;
  // In host memory whatever the backend (the float64 reference, the check's buffers); the
  // other items live where the backend's tensors do (a GPU's memory for --backend cuda).
  bool host = false;
};

struct MemoryPlan {
  std::vector<MemoryItem> items;
  unsigned __int128 total = 0;
  // The items with host set, or not: on a backend with device memory, the two sides of it.
  MemoryPlan HostItems() const { return Items(true); }
  MemoryPlan DeviceItems() const { return Items(false); }
  MemoryPlan Items(bool host) const;
};

// The plan for the rank at `coords` (every rank of a tp x dp layout holds the same sizes).
// `world_size` is the number of ranks sharing the reference's token rows.
MemoryPlan PlanRankMemory(const Config& config, const Graph& graph, const RankCoordinates& coords,
                          int64_t world_size, bool check);

// The plan for one rank of a GPT run (every rank of a tp x dp layout holds the same sizes),
// `gpt` as the executor resolved it.
MemoryPlan PlanGptRankMemory(const Config& config, const GptConfig& gpt, int64_t tp, bool check);

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
