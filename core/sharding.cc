// ShardSpec helpers and validation (see sharding.h).
#include "core/sharding.h"

#include <algorithm>

#include <fmt/format.h>

namespace mpusim {

std::string_view ShardAxisName(ShardAxis axis) {
  switch (axis) {
    case ShardAxis::kTp:
      return "tp";
    case ShardAxis::kDp:
      return "dp";
    case ShardAxis::kCp:
      return "cp";
    case ShardAxis::kEp:
      return "ep";
    case ShardAxis::kEtp:
      return "etp";
  }
  return "?";
}

std::optional<ShardAxis> ParseShardAxis(std::string_view name) {
  for (ShardAxis axis :
       {ShardAxis::kTp, ShardAxis::kDp, ShardAxis::kCp, ShardAxis::kEp, ShardAxis::kEtp}) {
    if (name == ShardAxisName(axis)) return axis;
  }
  return std::nullopt;
}

ShardSpec& ShardSpec::Split(ShardAxis axis, int dim, int64_t shards, int64_t index,
                            int64_t stride) {
  if (shards != 1) placements.push_back({axis, dim, shards, index, stride});
  return *this;
}

ShardSpec& ShardSpec::SplitLoadBalanced(ShardAxis axis, int dim, int64_t shards, int64_t index) {
  if (shards != 1) placements.push_back({axis, dim, shards, index, 1, true});
  return *this;
}

const Placement* ShardSpec::Find(ShardAxis axis) const {
  for (const Placement& p : placements) {
    if (p.axis == axis) return &p;
  }
  return nullptr;
}

Placement* ShardSpec::Find(ShardAxis axis) {
  for (Placement& p : placements) {
    if (p.axis == axis) return &p;
  }
  return nullptr;
}

bool SameLayout(const ShardSpec& a, const ShardSpec& b) {
  if (a.placements.size() != b.placements.size()) return false;
  for (size_t i = 0; i < a.placements.size(); ++i) {
    const Placement& x = a.placements[i];
    const Placement& y = b.placements[i];
    if (x.axis != y.axis || x.dim != y.dim || x.shards != y.shards || x.stride != y.stride ||
        x.load_balanced != y.load_balanced) {
      return false;
    }
  }
  return true;
}

std::string LayoutString(const ShardSpec& spec) {
  if (spec.replicated()) return "replicated";
  std::string out;
  for (const Placement& p : spec.placements) {
    if (!out.empty()) out += "; ";
    out += fmt::format("{}: dim {}, {} shards", ShardAxisName(p.axis), p.dim, p.shards);
    if (p.stride != 1) out += fmt::format(", stride {}", p.stride);
    if (p.load_balanced) out += ", load-balanced";
  }
  return out;
}

std::string PieceString(const ShardSpec& spec) {
  if (spec.replicated()) return "the replicated tensor";
  std::string out;
  for (const Placement& p : spec.placements) {
    if (!out.empty()) out += ", ";
    out += fmt::format("{} index {} of {}", ShardAxisName(p.axis), p.index, p.shards);
  }
  return out;
}

std::string ShardSpecError(const ShardSpec& spec, const Shape& full) {
  const int ndim = static_cast<int>(full.size());
  for (int64_t d : full) {
    if (d < 0) return fmt::format("full shape {} has a negative dimension", ShapeString(full));
  }
  Shape level = full;  // each dimension's size after the placements so far
  for (size_t i = 0; i < spec.placements.size(); ++i) {
    const Placement& p = spec.placements[i];
    const std::string where = fmt::format("placement {} ({})", i, ShardAxisName(p.axis));
    if (ShardAxisName(p.axis) == "?") return fmt::format("placement {} has no valid axis", i);
    for (size_t k = 0; k < i; ++k) {
      if (spec.placements[k].axis == p.axis) {
        return fmt::format("{}: axis {} is used by placement {} already", where,
                           ShardAxisName(p.axis), k);
      }
    }
    if (p.dim < 0 || p.dim >= ndim) {
      return fmt::format("{}: dim {} is outside [0, {})", where, p.dim, ndim);
    }
    if (p.shards < 1 || p.stride < 1) {
      return fmt::format("{}: shards {} and stride {} must be >= 1", where, p.shards, p.stride);
    }
    if (p.index < 0 || p.index >= p.shards) {
      return fmt::format("{}: index {} is outside [0, {})", where, p.index, p.shards);
    }
    if (p.load_balanced && p.stride != 1) {
      return fmt::format("{}: a load-balanced placement has stride 1, got {}", where, p.stride);
    }
    int64_t& size = level[static_cast<size_t>(p.dim)];
    if (p.load_balanced) {
      int64_t chunks = 0;
      if (__builtin_mul_overflow(p.shards, int64_t{2}, &chunks) || size % chunks != 0) {
        return fmt::format("{}: dimension {} of {} (size {} here) is not divisible by 2 * "
                           "shards {} (load-balanced)",
                           where, p.dim, ShapeString(full), size, p.shards);
      }
      size /= p.shards;
      continue;
    }
    int64_t chunks = 0;
    if (__builtin_mul_overflow(p.shards, p.stride, &chunks) || size % chunks != 0) {
      return fmt::format(
          "{}: dimension {} of {} (size {} here) is not divisible by shards {} * "
          "stride {}",
          where, p.dim, ShapeString(full), size, p.shards, p.stride);
    }
    size /= p.shards;
  }
  return "";
}

std::vector<std::pair<int64_t, int64_t>> HeldRuns(const ShardSpec& spec, int dim, int64_t full) {
  int64_t size = full;  // the index space of the innermost placement on `dim`
  for (const Placement& p : spec.placements) {
    if (p.dim == dim) size /= p.shards;
  }
  std::vector<std::pair<int64_t, int64_t>> runs;
  if (size > 0) runs.emplace_back(0, size);
  // Outwards, as GlobalIndex maps an index: each run is cut at the placement's chunks, and
  // each piece moves to its chunk's place in the outer index space (pieces stay in order: a
  // load-balanced piece's second chunk lies after its first).
  for (auto it = spec.placements.rbegin(); it != spec.placements.rend(); ++it) {
    const Placement& p = *it;
    if (p.dim != dim) continue;
    const int64_t outer = size * p.shards;
    const int64_t chunk = p.ChunkSize(outer);
    std::vector<std::pair<int64_t, int64_t>> mapped;
    for (const auto& [begin, end] : runs) {
      for (int64_t a = begin; a < end;) {
        const int64_t block = a / chunk;
        const int64_t b = std::min(end, (block + 1) * chunk);
        const int64_t base = p.GlobalChunk(block) * chunk;
        const int64_t first = base + a % chunk, last = first + (b - a);
        if (!mapped.empty() && mapped.back().second == first) {
          mapped.back().second = last;
        } else {
          mapped.emplace_back(first, last);
        }
        a = b;
      }
    }
    runs = std::move(mapped);
    size = outer;
  }
  return runs;
}

std::vector<std::vector<int64_t>> FlatOffsets(const ShardSpec& spec, const Shape& full,
                                              const Shape& local) {
  std::vector<std::vector<int64_t>> offsets(full.size());
  int64_t stride = 1;
  for (size_t d = full.size(); d-- > 0;) {
    std::vector<int64_t>& table = offsets[d];
    table.resize(static_cast<size_t>(local[d]));
    for (size_t l = 0; l < table.size(); ++l) {
      table[l] = GlobalIndex(spec, static_cast<int>(d), full[d], static_cast<int64_t>(l)) * stride;
    }
    stride *= full[d];
  }
  return offsets;
}

}  // namespace mpusim

