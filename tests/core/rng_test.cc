// RngTracker: Megatron's seed layout across (tp, pp, dp) ranks, draw bookkeeping, and the
// save/restore that makes recomputed dropout masks bit-identical.
#include "core/rng.h"

#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <vector>

#include "core/philox.h"

namespace mpusim {
namespace {

constexpr uint64_t kSeed = 1234;

uint64_t Key(const RngTracker& tracker, const std::string& stream) {
  return tracker.GetStates().at(stream).key;
}

TEST(RngTracker, ForRankFollowsMegatronSeeds) {
  const RngTracker tracker = RngTracker::ForRank(kSeed, 3, 2, 1);
  ASSERT_EQ(tracker.GetStates().size(), 2u);
  EXPECT_EQ(Key(tracker, kDefaultStream), kSeed + 100 * 2 + 10 * 1);
  EXPECT_EQ(Key(tracker, kModelParallelStream), kSeed + 100 * 2 + 10 * 1 + 2718 + 3);
  EXPECT_EQ(tracker.GetStates().at(kDefaultStream).calls, 0u);
  EXPECT_EQ(tracker.GetStates().at(kModelParallelStream).calls, 0u);
}

TEST(RngTracker, KeysAreSharedOrDistinctAcrossRanksAsInMegatron) {
  constexpr int64_t kTp = 4, kPp = 3, kDp = 3;
  std::set<uint64_t> default_keys;
  for (int64_t pp = 0; pp < kPp; ++pp) {
    for (int64_t dp = 0; dp < kDp; ++dp) {
      const uint64_t default_key = Key(RngTracker::ForRank(kSeed, 0, pp, dp), kDefaultStream);
      // Distinct across pp and dp ranks (for dp < 10, Megatron's 10 * dp offset).
      EXPECT_TRUE(default_keys.insert(default_key).second) << "pp " << pp << " dp " << dp;
      std::set<uint64_t> model_parallel_keys;
      for (int64_t tp = 0; tp < kTp; ++tp) {
        const RngTracker tracker = RngTracker::ForRank(kSeed, tp, pp, dp);
        // The same on every tp rank: replicated activations get the same dropout mask.
        EXPECT_EQ(Key(tracker, kDefaultStream), default_key) << "tp " << tp;
        // Different on every tp rank: each shard of a split activation gets its own mask.
        EXPECT_TRUE(model_parallel_keys.insert(Key(tracker, kModelParallelStream)).second)
            << "tp " << tp;
      }
    }
  }
  EXPECT_THROW(RngTracker::ForRank(kSeed, -1, 0, 0), std::invalid_argument);
}

TEST(RngTracker, DrawHandsOutSuccessiveSubsequencesPerStream) {
  RngTracker tracker = RngTracker::ForRank(kSeed, 1, 0, 0);
  const uint64_t default_key = Key(tracker, kDefaultStream);
  const uint64_t mp_key = Key(tracker, kModelParallelStream);
  for (uint64_t n = 0; n < 3; ++n) {
    const RngDraw draw = tracker.Draw(kDefaultStream);
    EXPECT_EQ(draw.key, default_key);
    EXPECT_EQ(draw.subsequence, n);
  }
  // Streams advance independently.
  const RngDraw mp = tracker.Draw(kModelParallelStream);
  EXPECT_EQ(mp.key, mp_key);
  EXPECT_EQ(mp.subsequence, 0u);
  EXPECT_EQ(tracker.GetStates().at(kDefaultStream).calls, 3u);
  EXPECT_EQ(tracker.GetStates().at(kModelParallelStream).calls, 1u);
  EXPECT_THROW(tracker.Draw("no-such-stream"), std::out_of_range);
}

TEST(RngTracker, SetStatesReplaysTheSameDraws) {
  // Activation recomputation: save before the forward, restore before recomputing.
  RngTracker tracker = RngTracker::ForRank(kSeed, 0, 0, 0);
  tracker.Draw(kDefaultStream);
  const RngTracker::States saved = tracker.GetStates();

  auto mask_bits = [](const RngDraw& draw) {
    std::vector<double> u;
    for (uint64_t e = 0; e < 16; ++e) u.push_back(UniformAt(draw.key, draw.subsequence, e));
    return u;
  };
  const RngDraw a_default = tracker.Draw(kDefaultStream);
  const RngDraw a_mp = tracker.Draw(kModelParallelStream);
  tracker.SetStates(saved);
  const RngDraw b_default = tracker.Draw(kDefaultStream);
  const RngDraw b_mp = tracker.Draw(kModelParallelStream);

  EXPECT_EQ(a_default.key, b_default.key);
  EXPECT_EQ(a_default.subsequence, b_default.subsequence);
  EXPECT_EQ(a_mp.key, b_mp.key);
  EXPECT_EQ(a_mp.subsequence, b_mp.subsequence);
  EXPECT_EQ(mask_bits(a_default), mask_bits(b_default));
  EXPECT_EQ(mask_bits(a_mp), mask_bits(b_mp));
  // And not the draw before the save.
  EXPECT_NE(mask_bits(a_default), mask_bits(RngDraw{a_default.key, 0}));
}

TEST(RngTracker, AddRefusesDuplicateNamesAndSeeds) {
  RngTracker tracker;
  ASSERT_TRUE(tracker.Add("a", 7).ok());
  const Status same_name = tracker.Add("a", 8);
  ASSERT_FALSE(same_name.ok());
  EXPECT_EQ(same_name.Message(), "stream 'a' already exists");
  const Status same_seed = tracker.Add("b", 7);
  ASSERT_FALSE(same_seed.ok());
  EXPECT_EQ(same_seed.Message(), "seed 7 already exists (stream 'a')");
  // A refused Add leaves the tracker as it was.
  EXPECT_EQ(tracker.GetStates().size(), 1u);
  EXPECT_TRUE(tracker.Add("b", 8).ok());
}

}  // namespace
}  // namespace mpusim
