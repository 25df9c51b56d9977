// ShardSpec validation (see sharding.h).
#include "core/sharding.h"

#include <fmt/format.h>

namespace mpusim {

std::string ShardSpecError(const ShardSpec& spec, const Shape& full) {
  const int ndim = static_cast<int>(full.size());
  for (int64_t d : full) {
    if (d < 0) return fmt::format("full shape {} has a negative dimension", ShapeString(full));
  }
  if (spec.shard_dim < -1 || spec.shard_dim >= ndim) {
    return fmt::format("shard_dim {} is outside [-1, {})", spec.shard_dim, ndim);
  }
  if (spec.batch_dim < -1 || spec.batch_dim >= ndim) {
    return fmt::format("batch_dim {} is outside [-1, {})", spec.batch_dim, ndim);
  }
  if (spec.shard_dim >= 0 && spec.shard_dim == spec.batch_dim) {
    return fmt::format("shard_dim and batch_dim are both {}", spec.shard_dim);
  }
  if (spec.shard_dim < 0) {
    if (spec.num_shards != 1 || spec.shard_index != 0 || spec.stride != 1) {
      return fmt::format(
          "shard_dim -1 (not split) needs num_shards 1, shard_index 0 and "
          "stride 1, got {}, {} and {}",
          spec.num_shards, spec.shard_index, spec.stride);
    }
  } else {
    if (spec.num_shards < 1 || spec.stride < 1) {
      return fmt::format("num_shards {} and stride {} must be >= 1", spec.num_shards, spec.stride);
    }
    if (spec.shard_index < 0 || spec.shard_index >= spec.num_shards) {
      return fmt::format("shard_index {} is outside [0, {})", spec.shard_index, spec.num_shards);
    }
    const int64_t size = full[static_cast<size_t>(spec.shard_dim)];
    int64_t chunks = 0;
    if (__builtin_mul_overflow(spec.num_shards, spec.stride, &chunks) || size % chunks != 0) {
      return fmt::format(
          "dimension {} of {} (size {}) is not divisible by num_shards {} * stride {}",
          spec.shard_dim, ShapeString(full), size, spec.num_shards, spec.stride);
    }
  }
  if (spec.batch_dim < 0) {
    if (spec.batch_shards != 1 || spec.batch_index != 0) {
      return fmt::format(
          "batch_dim -1 (not split) needs batch_shards 1 and batch_index 0, "
          "got {} and {}",
          spec.batch_shards, spec.batch_index);
    }
  } else {
    if (spec.batch_shards < 1)
      return fmt::format("batch_shards {} must be >= 1", spec.batch_shards);
    if (spec.batch_index < 0 || spec.batch_index >= spec.batch_shards) {
      return fmt::format("batch_index {} is outside [0, {})", spec.batch_index, spec.batch_shards);
    }
    const int64_t size = full[static_cast<size_t>(spec.batch_dim)];
    if (size % spec.batch_shards != 0) {
      return fmt::format("batch dimension {} of {} (size {}) is not divisible by batch_shards {}",
                         spec.batch_dim, ShapeString(full), size, spec.batch_shards);
    }
  }
  return "";
}

}  // namespace mpusim
