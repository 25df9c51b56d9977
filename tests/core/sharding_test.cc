// HeldRuns (core/sharding.h): the runs of global indices a shard holds, computed from its
// placements, against GlobalIndex over every local index, for every split of small sizes
// (one and two placements on a dimension, strides, another dimension's placement between),
// and at sizes where visiting every index would take seconds. Also the stream shape of a
// context-parallel rank (core/model/module.h): its positions, dropout pieces and record spec.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/model/module.h"
#include "core/sharding.h"

namespace mpusim {
namespace {

using Runs = std::vector<std::pair<int64_t, int64_t>>;

// The same runs the slow way: every local index through GlobalIndex, adjacent ones joined.
Runs ByEveryIndex(const ShardSpec& spec, int dim, int64_t full) {
  int64_t local = full;
  for (const Placement& p : spec.placements) {
    if (p.dim == dim) local /= p.shards;
  }
  std::vector<int64_t> held;
  for (int64_t l = 0; l < local; ++l) held.push_back(GlobalIndex(spec, dim, full, l));
  std::sort(held.begin(), held.end());
  Runs runs;
  for (const int64_t g : held) {
    if (!runs.empty() && runs.back().second == g) {
      ++runs.back().second;
    } else {
      runs.emplace_back(g, g + 1);
    }
  }
  return runs;
}

TEST(HeldRuns, EqualsGlobalIndexOverEveryLocalIndex) {
  int checked = 0;
  for (int64_t t = 1; t <= 4; ++t) {
    for (int64_t stride = 1; stride <= 3; ++stride) {
      for (int64_t e = 1; e <= 3; ++e) {        // a second (outer) split of the same dim
        for (int64_t blocks = 1; blocks <= 3; ++blocks) {
          const int64_t full = t * stride * e * blocks * 2;
          for (int64_t r = 0; r < t; ++r) {
            for (int64_t q = 0; q < e; ++q) {
              ShardSpec spec;
              spec.Split(ShardAxis::kDp, 0, e, q);           // outer, same dim
              spec.Split(ShardAxis::kCp, 1, 2, 1);           // another dim, in between
              spec.Split(ShardAxis::kTp, 0, t, r, stride);   // inner, strided
              SCOPED_TRACE(::testing::Message() << "full " << full << " t " << t << " r " << r
                                                << " stride " << stride << " e " << e
                                                << " q " << q);
              const Runs runs = HeldRuns(spec, 0, full);
              EXPECT_EQ(runs, ByEveryIndex(spec, 0, full));
              EXPECT_EQ(HeldRuns(spec, 1, 8), ByEveryIndex(spec, 1, 8));
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, (1 + 2 + 3 + 4) * 3 * (1 + 2 + 3) * 3);
}

// Context parallelism's load-balanced split (Megatron's): piece r holds chunks r and
// 2 cp - 1 - r of 2 cp; the pieces tile the dimension; with sequence parallelism inside it
// (tp splits each cp piece) the runs still equal GlobalIndex's.
TEST(LoadBalancedPlacement, HoldsChunksRAndTheirMirror) {
  ShardSpec cp0, cp1;
  cp0.SplitLoadBalanced(ShardAxis::kCp, 0, 2, 0);
  cp1.SplitLoadBalanced(ShardAxis::kCp, 0, 2, 1);
  EXPECT_EQ(HeldRuns(cp0, 0, 8), (Runs{{0, 2}, {6, 8}}));
  EXPECT_EQ(HeldRuns(cp1, 0, 8), (Runs{{2, 6}}));
  std::vector<int64_t> order;
  for (int64_t l = 0; l < 4; ++l) order.push_back(GlobalIndex(cp0, 0, 8, l));
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(LayoutString(cp0), "cp: dim 0, 2 shards, load-balanced");
  ShardSpec strided;
  strided.Split(ShardAxis::kCp, 0, 2, 0, 2);  // the stride rule: chunks 0 and 2, not 0 and 3
  EXPECT_FALSE(SameLayout(cp0, strided));
  EXPECT_EQ(HeldRuns(strided, 0, 8), (Runs{{0, 2}, {4, 6}}));

  for (int64_t cp = 1; cp <= 4; ++cp) {
    for (int64_t t = 1; t <= 4; t *= 2) {
      const int64_t full = 2 * cp * t * 3;
      std::vector<int> seen(static_cast<size_t>(full), 0);
      for (int64_t r = 0; r < cp; ++r) {
        for (int64_t j = 0; j < t; ++j) {
          ShardSpec spec;
          spec.Split(ShardAxis::kDp, 1, 2, 1);
          spec.SplitLoadBalanced(ShardAxis::kCp, 0, cp, r);
          spec.Split(ShardAxis::kTp, 0, t, j);
          SCOPED_TRACE(::testing::Message() << "cp " << cp << " r " << r << " t " << t << " j " << j);
          EXPECT_EQ(ShardSpecError(spec, {full, 4}), "");
          EXPECT_EQ(HeldRuns(spec, 0, full), ByEveryIndex(spec, 0, full));
          for (const auto& [begin, end] : HeldRuns(spec, 0, full)) {
            for (int64_t g = begin; g < end; ++g) ++seen[static_cast<size_t>(g)];
          }
        }
      }
      EXPECT_EQ(seen, std::vector<int>(static_cast<size_t>(full), 1)) << "cp " << cp << " t " << t;
    }
  }
  ShardSpec odd;
  odd.SplitLoadBalanced(ShardAxis::kCp, 0, 2, 0);
  EXPECT_EQ(ShardSpecError(odd, {6}),
            "placement 0 (cp): dimension 0 of [6] (size 6 here) is not divisible by 2 * shards 2 "
            "(load-balanced)");
  odd.placements[0].stride = 2;
  EXPECT_EQ(ShardSpecError(odd, {8}),
            "placement 0 (cp): a load-balanced placement has stride 1, got 2");
}

TEST(HeldRuns, AnswersForDimensionsOfBillions) {
  ShardSpec replicated;
  EXPECT_EQ(HeldRuns(replicated, 0, 2147483647), (Runs{{0, 2147483647}}));
  ShardSpec vocab;
  vocab.Split(ShardAxis::kTp, 0, 2, 1);  // the second half of a 2 * (2^31 - 1) vocabulary
  EXPECT_EQ(HeldRuns(vocab, 0, 4294967294), (Runs{{2147483647, 4294967294}}));
  ShardSpec qkv;
  qkv.Split(ShardAxis::kTp, 0, 4, 3, 3);  // stride 3: one run per block
  const int64_t full = int64_t{3} * 4 * (int64_t{1} << 30);
  EXPECT_EQ(HeldRuns(qkv, 0, full),
            (Runs{{3 * (int64_t{1} << 30), 4 * (int64_t{1} << 30)},
                  {7 * (int64_t{1} << 30), 8 * (int64_t{1} << 30)},
                  {11 * (int64_t{1} << 30), 12 * (int64_t{1} << 30)}}));
}

}  // namespace
}  // namespace mpusim

namespace mpusim {
namespace {

// The full-tensor index of local element e of a [s_l, b, w] stream, as the record's shard
// spec places it.
int64_t SpecIndex(const ShardSpec& spec, const Shape& full, int64_t e) {
  const Shape local = LocalShape(spec, full);
  int64_t flat = 0, stride = 1;
  for (size_t dim = local.size(); dim-- > 0;) {
    const int64_t l = e % local[dim];
    e /= local[dim];
    flat += GlobalIndex(spec, static_cast<int>(dim), full[dim], l) * stride;
    stride *= full[dim];
  }
  return flat;
}

// Context parallelism: a rank's token positions, its dropout pieces (two when a sequence-
// parallel piece straddles its two chunks: tp 3) and its records' load-balanced spec all
// place every stream element at the same full index.
TEST(StreamShapeContextParallel, PositionsAndDropoutPiecesFollowTheRecordSpec) {
  for (const int64_t cp : {1, 2, 4}) {
    for (const int64_t t : {1, 2, 3}) {
      for (const bool sp : {false, true}) {
        StreamShape sh;
        sh.s = 2 * cp * 3 * t;
        sh.b = 2;
        sh.B = 4;
        sh.dp_rank = 1;
        sh.t = t;
        sh.sequence_parallel = sp;
        sh.cp = cp;
        const int64_t w = 5;
        const Shape full = {sh.s, sh.B, w};
        int64_t straddles = 0;
        for (sh.cp_rank = 0; sh.cp_rank < cp; ++sh.cp_rank) {
          // Positions: chunks cp_rank and 2 cp - 1 - cp_rank, in that order.
          const int64_t c = sh.s / (2 * cp);
          for (int64_t l = 0; l < sh.s_cp(); ++l) {
            const int64_t chunk = l < c ? sh.cp_rank : 2 * cp - 1 - sh.cp_rank;
            ASSERT_EQ(sh.Position(l), chunk * c + l % c) << "cp " << cp << " l " << l;
          }
          for (sh.tp_rank = 0; sh.tp_rank < t; ++sh.tp_rank) {
            SCOPED_TRACE(fmt::format("cp {} rank {}, tp {} rank {}, sp {}", cp, sh.cp_rank, t,
                                     sh.tp_rank, sp));
            const ShardSpec spec = sh.StreamSpec(2);
            const IndexPieces pieces = sh.StreamMap(w);
            // Without a sequence-parallel split the rank's rows are its two chunks: 2 pieces.
            if (!sp || t == 1) {
              EXPECT_EQ(pieces.size(), cp == 1 ? 1u : 2u);
            }
            if (sp && t > 1 && pieces.size() > 1) ++straddles;
            int64_t covered = 0;
            for (const IndexPiece& piece : pieces) {
              ASSERT_EQ(piece.offset, covered);
              const int64_t n = piece.map.dims[0] * piece.map.dims[1] * piece.map.dims[2];
              for (int64_t e = 0; e < n; ++e) {
                ASSERT_EQ(piece.map.At(e), SpecIndex(spec, full, piece.offset + e))
                    << "element " << piece.offset + e;
              }
              covered += n;
            }
            EXPECT_EQ(covered, sh.stream_rows() * w);
          }
        }
        // Under sequence parallelism only tp 3 cuts a tp piece (2 c / 3 rows) across the
        // rank's two chunks.
        EXPECT_EQ(straddles > 0, cp > 1 && sp && t == 3) << "cp " << cp << " tp " << t;
      }
    }
  }
}

}  // namespace
}  // namespace mpusim
