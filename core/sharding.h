// ShardSpec: how a rank's local tensor maps onto the full (unpartitioned) tensor.
//
// A tensor may be split along one "model" dimension (tensor parallelism: hidden or vocab
// columns; sequence parallelism: the sequence dimension) and, for activations, along the
// batch dimension (data parallelism). Along the model dimension Megatron's `stride` rule
// applies: the full dimension of size F is cut into num_shards * stride chunks of
// c = F / (num_shards * stride) elements, and shard r holds chunks r, r + num_shards,
// r + 2*num_shards, ... (stride of them) concatenated. With stride 1 shard r is simply the
// r-th contiguous block.
//
//   local index l along the model dimension -> global index
//       k = l / c (which of the rank's chunks), o = l % c
//       global = (k * num_shards + shard_index) * c + o
//
// Example: F = 8, num_shards = 2, stride = 2, so c = 2; shard 0 holds global [0 1 4 5],
// shard 1 holds [2 3 6 7].
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace mpusim {

struct ShardSpec {
  int shard_dim = -1;  // -1: not split along a model dimension (replicated)
  int64_t num_shards = 1;
  int64_t shard_index = 0;
  int64_t stride = 1;
  int batch_dim = -1;  // -1: not split along the batch (data parallelism)
  int64_t batch_shards = 1;
  int64_t batch_index = 0;

  bool replicated() const { return shard_dim < 0 && batch_dim < 0; }
};

// Why `spec` cannot describe a shard of a tensor of shape `full`, or "" when it can: dims in
// range and distinct, indices in range, defaults (1 shard, index 0, stride 1) on an unsplit
// dimension, and exact divisibility (GlobalIndex and LocalShape assume it). Products are
// guarded against overflow, since specs are also read from files.
std::string ShardSpecError(const ShardSpec& spec, const Shape& full);

// Global index along `dim` of local index `local`, for a full dimension of size `full`.
inline int64_t GlobalIndex(const ShardSpec& spec, int dim, int64_t full, int64_t local) {
  if (dim == spec.shard_dim) {
    const int64_t chunk = full / (spec.num_shards * spec.stride);
    const int64_t k = local / chunk;
    return (k * spec.num_shards + spec.shard_index) * chunk + local % chunk;
  }
  if (dim == spec.batch_dim) return spec.batch_index * (full / spec.batch_shards) + local;
  return local;
}

// Local shape of a tensor of full shape `full` under `spec`.
inline Shape LocalShape(const ShardSpec& spec, Shape full) {
  if (spec.shard_dim >= 0) full[static_cast<size_t>(spec.shard_dim)] /= spec.num_shards;
  if (spec.batch_dim >= 0) full[static_cast<size_t>(spec.batch_dim)] /= spec.batch_shards;
  return full;
}

}  // namespace mpusim
