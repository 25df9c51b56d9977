// ShardSpec: how a rank's local tensor maps onto the full (unpartitioned) tensor.
//
// A spec is a list of placements, outermost first. Each placement splits one dimension of
// the tensor over one parallel axis of the layout:
//
//   axis     which group the split runs over: "tp" (tensor parallelism, and sequence
//            parallelism, which splits the sequence over the tp group), "dp" (data
//            parallelism: an activation's samples), "cp" (context parallelism), "ep"
//            (expert parallelism) or "etp" (expert tensor parallelism: an expert weight's
//            split over expt_tp, expert_tensor_parallel_size ranks)
//   dim      the dimension it splits
//   shards   how many pieces (the group's size); a spec never holds a 1-shard placement
//   index    this rank's piece (its rank in that group)
//   stride   Megatron's stride rule (below); 1 for a plain contiguous split
//
// A dimension of size F split by one placement is cut into shards * stride chunks of
// c = F / (shards * stride) elements, and piece r holds chunks r, r + shards,
// r + 2*shards, ... (stride of them) concatenated. With stride 1 piece r is simply the r-th
// contiguous block.
//
//   local index l along the dimension -> global index
//       k = l / c (which of the rank's chunks), o = l % c
//       global = (k * shards + index) * c + o
//
// Example: F = 8, shards = 2, stride = 2, so c = 2; piece 0 holds global [0 1 4 5],
// piece 1 holds [2 3 6 7].
//
// A load-balanced placement (context parallelism's split of the sequence, Megatron's) cuts
// the dimension into 2 * shards chunks of c = F / (2 * shards) and piece r holds chunks r and
// 2 * shards - 1 - r, so that under a causal mask every piece has the same work (stride 1):
//       k = l / c (0 or 1), o = l % c
//       global = (k == 0 ? index : 2 * shards - 1 - index) * c + o
// Example: F = 8, shards = 2, so c = 2; piece 0 holds [0 1 6 7], piece 1 holds [2 3 4 5].
//
// Several placements may split the same dimension: each later one splits the piece the
// earlier ones left (a sequence split over cp, then over tp). The mapping applies them from
// the innermost back out. A spec with no placements is a full, replicated tensor.
//
// Examples: a sequence-parallel activation [s, b, h] with dp 2, tp 4 on (tp 1, dp 0):
// {tp dim 0 4 shards index 1, dp dim 1 2 shards index 0}; a SwiGLU fc1 weight [2f, h] on tp
// rank 3 of 4: {tp dim 0 4 shards index 3 stride 2}.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace mpusim {

enum class ShardAxis : uint8_t { kTp, kDp, kCp, kEp, kEtp };

std::string_view ShardAxisName(ShardAxis axis);  // "tp", "dp", "cp", "ep", "etp"
std::optional<ShardAxis> ParseShardAxis(std::string_view name);

struct Placement {
  ShardAxis axis = ShardAxis::kTp;
  int dim = 0;
  int64_t shards = 1;
  int64_t index = 0;
  int64_t stride = 1;
  bool load_balanced = false;  // chunks index and 2 * shards - 1 - index (above); stride 1

  // The size of the chunks a dimension of `outer` elements is cut into, and the global chunk
  // number of this piece's k-th chunk.
  int64_t ChunkSize(int64_t outer) const {
    return outer / (load_balanced ? 2 * shards : shards * stride);
  }
  int64_t GlobalChunk(int64_t k) const {
    return load_balanced ? (k == 0 ? index : 2 * shards - 1 - index) : k * shards + index;
  }

  bool operator==(const Placement&) const = default;
};

struct ShardSpec {
  std::vector<Placement> placements;  // outermost first

  bool replicated() const { return placements.empty(); }
  // Appends a placement; a 1-shard split changes nothing and is left out, so that every
  // layout of a tensor has one spelling. Returns *this for chaining.
  ShardSpec& Split(ShardAxis axis, int dim, int64_t shards, int64_t index, int64_t stride = 1);
  // The same with a load-balanced placement (context parallelism's sequence split).
  ShardSpec& SplitLoadBalanced(ShardAxis axis, int dim, int64_t shards, int64_t index);
  // The placement over `axis`, or nullptr.
  const Placement* Find(ShardAxis axis) const;
  Placement* Find(ShardAxis axis);

  bool operator==(const ShardSpec&) const = default;
};

// Same placements except for the indices: two pieces of one tensor.
bool SameLayout(const ShardSpec& a, const ShardSpec& b);
// "tp: dim 0, 2 shards, stride 2; dp: dim 1, 2 shards", or "replicated".
std::string LayoutString(const ShardSpec& spec);
// "tp index 1 of 2, dp index 0 of 2", or "the replicated tensor".
std::string PieceString(const ShardSpec& spec);

// Why `spec` cannot describe a shard of a tensor of shape `full`, or "" when it can: dims in
// range, each axis at most once, shards and stride >= 1, indices in range, and exact
// divisibility at every level (GlobalIndex and LocalShape assume it). Products are guarded
// against overflow, since specs are also read from files.
std::string ShardSpecError(const ShardSpec& spec, const Shape& full);

// Global index along `dim` of local index `local`, for a full dimension of size `full`.
inline int64_t GlobalIndex(const ShardSpec& spec, int dim, int64_t full, int64_t local) {
  int64_t size = full;  // the size of the piece the innermost placement on `dim` leaves
  for (const Placement& p : spec.placements) {
    if (p.dim == dim) size /= p.shards;
  }
  for (auto it = spec.placements.rbegin(); it != spec.placements.rend(); ++it) {
    const Placement& p = *it;
    if (p.dim != dim) continue;
    const int64_t outer = size * p.shards;
    const int64_t chunk = p.ChunkSize(outer);
    local = p.GlobalChunk(local / chunk) * chunk + local % chunk;
    size = outer;
  }
  return local;
}

// The global indices along `dim` that a rank holding `spec` has, as sorted, disjoint runs
// [begin, end) with adjacent runs merged: GlobalIndex over every local index, computed in
// O(runs) rather than O(local size) (a 2^31 vocabulary split over tp is one run per rank, a
// stride-s split s runs), so a sharding map of any size answers at once.
std::vector<std::pair<int64_t, int64_t>> HeldRuns(const ShardSpec& spec, int dim, int64_t full);

// offsets[d][l] = GlobalIndex(spec, d, full[d], l) * (row-major stride of d in `full`), so the
// global flat index of a local multi-index is a sum of table lookups: GlobalIndex runs once
// per (dimension, local index) rather than once per element.
std::vector<std::vector<int64_t>> FlatOffsets(const ShardSpec& spec, const Shape& full,
                                              const Shape& local);

// Local shape of a tensor of full shape `full` under `spec`.
inline Shape LocalShape(const ShardSpec& spec, Shape full) {
  for (const Placement& p : spec.placements) full[static_cast<size_t>(p.dim)] /= p.shards;
  return full;
}

}  // namespace mpusim
