// The key that tells a dump tensor's copies from its distinct pieces (see diff.h): shards
// with equal keys hold the same elements and must agree bit for bit. LoadDump checks that
// every key is present (coverage); Dump::Assemble places one shard per key.
//
// What it is: one definition shared by the dump reader (dump_loader.cc) and the reassembly
// (diff.cc). What it is not: part of the diff API; only core/dump/ includes it.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dump/diff.h"
#include "core/sharding.h"

namespace mpusim {

// The coordinates that tell copies (equal keys) from distinct pieces (see diff.h): each
// placement's index, after the tp rank for a partial sum.
using ShardKey = std::vector<int64_t>;

inline ShardKey KeyOf(const DumpTensor& t, const DumpShard& s) {
  ShardKey key;
  if (t.partial_sum) key.push_back(s.tp_rank);
  for (const Placement& p : s.spec.placements) key.push_back(p.index);
  return key;
}

}  // namespace mpusim
