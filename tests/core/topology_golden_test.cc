// Golden layouts: Megatron-Core's own output (tests/data/golden/layouts, recorded by running
// initialize_model_parallel for every rank) and the worked examples of its docstrings.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/topology.h"

namespace mpusim {
namespace {

using nlohmann::json;

Topology MakeTopology(const json& parallel) {
  ParallelConfig config;
  const Status status = ParseParallelSection(parallel, "parallel", &config);
  EXPECT_TRUE(status.ok()) << status.Message();
  StatusOr<Topology> topology = Topology::Create(config);
  EXPECT_TRUE(topology.ok()) << topology.status().Message();
  return std::move(topology).value();
}

std::vector<std::vector<int64_t>> AllGroups(const Topology& topology, std::string_view kind) {
  const std::optional<size_t> index = topology.FindKind(kind);
  EXPECT_TRUE(index.has_value()) << kind;
  std::vector<std::vector<int64_t>> groups;
  if (!index) return groups;
  for (int64_t g = 0; g < topology.NumGroups(*index); ++g) {
    groups.push_back(topology.Group(*index, g));
  }
  return groups;
}

class MegatronGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(MegatronGoldenTest, EveryKindEveryGroupEveryRank) {
  const std::filesystem::path path =
      std::filesystem::path(MPUSIM_TEST_DATA_DIR) / "golden" / "layouts" / GetParam();
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const json golden = json::parse(in);
  json parallel = golden.at("args");
  parallel["world_size"] = golden.at("world_size");
  const Topology topology = MakeTopology(parallel);

  ASSERT_FALSE(golden.at("groups").empty());
  for (const auto& [kind, groups] : golden.at("groups").items()) {
    SCOPED_TRACE("kind " + kind);
    const auto expected = groups.get<std::vector<std::vector<int64_t>>>();
    ASSERT_FALSE(expected.empty());
    EXPECT_EQ(AllGroups(topology, kind), expected);

    // Per-rank query: the enumeration's answer, rank by rank, without enumerating.
    const size_t index = *topology.FindKind(kind);
    const json& ranks = golden.at("rank_in_group").at(kind);
    for (int64_t rank = 0; rank < topology.world_size(); ++rank) {
      const std::optional<GroupSlot> slot = topology.Locate(index, rank);
      const json& want = ranks.at(static_cast<size_t>(rank));
      if (want.is_null()) {
        EXPECT_FALSE(slot.has_value()) << "rank " << rank;
        continue;
      }
      ASSERT_TRUE(slot.has_value()) << "rank " << rank;
      EXPECT_EQ(slot->rank_in_group, want.get<int64_t>()) << "rank " << rank;
      EXPECT_EQ(topology.Member(index, slot->group_index, slot->rank_in_group), rank);
    }
  }
  // Nothing Megatron builds for these configs is missing from ours, and we build nothing more.
  std::vector<std::string> ours;
  for (const GroupKind& kind : topology.kinds()) ours.push_back(kind.name);
  std::vector<std::string> theirs;
  for (const auto& [kind, unused] : golden.at("groups").items()) theirs.push_back(kind);
  std::sort(ours.begin(), ours.end());
  std::sort(theirs.begin(), theirs.end());
  EXPECT_EQ(ours, theirs);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MegatronGoldenTest,
                         ::testing::Values("classic_tp2_pp4_ws16.json",
                                           "cp_tp2_pp2_cp2_dp2_ws16.json",
                                           "ep_tp2_pp2_cp1_dp4_ep2_etp1_ws16.json"));

// initialize_model_parallel's docstring: 16 GPUs, t=2, p=4.
TEST(MegatronDocExamples, InitializeModelParallelDocstring) {
  const Topology topology = MakeTopology(
      {{"world_size", 16}, {"tensor_model_parallel_size", 2}, {"pipeline_model_parallel_size", 4}});
  using Groups = std::vector<std::vector<int64_t>>;
  EXPECT_EQ(AllGroups(topology, "dp"),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(AllGroups(topology, "tp"),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(AllGroups(topology, "pp"),
            (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  // The MPU lab's "model 0 : is partitioned into gpus :0,1,4,5,8,9,12,13".
  EXPECT_EQ(AllGroups(topology, "mp"),
            (Groups{{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}}));
}

// initialize_model_parallel's docstring on context parallelism: 8 GPUs, t=4, c=2.
TEST(MegatronDocExamples, ContextParallelDocstring) {
  const Topology topology = MakeTopology(
      {{"world_size", 8}, {"tensor_model_parallel_size", 4}, {"context_parallel_size", 2}});
  EXPECT_EQ(AllGroups(topology, "cp"),
            (std::vector<std::vector<int64_t>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
}

// generate_masked_orthogonal_rank_groups' docstring: sizes [tp, dp, pp] = [2, 3, 4],
// order tp-dp-pp, dp groups [0, 2, 4], [1, 3, 5], ..., [19, 21, 23]; and order tp-pp-dp
// with 2-2-2 on 8 GPUs gives dp groups [[0, 4], [1, 5], [2, 6], [3, 7]].
TEST(MegatronDocExamples, MaskedOrthogonalRankGroupsDocstring) {
  const Topology a = MakeTopology({{"world_size", 24},
                                   {"tensor_model_parallel_size", 2},
                                   {"pipeline_model_parallel_size", 4},
                                   {"order", "tp-dp-pp"}});
  const auto dp = AllGroups(a, "dp");
  ASSERT_EQ(dp.size(), 8u);
  EXPECT_EQ(dp[0], (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(dp[1], (std::vector<int64_t>{1, 3, 5}));
  EXPECT_EQ(dp[7], (std::vector<int64_t>{19, 21, 23}));

  const Topology b = MakeTopology({{"world_size", 8},
                                   {"tensor_model_parallel_size", 2},
                                   {"pipeline_model_parallel_size", 2},
                                   {"order", "tp-pp-dp"}});
  EXPECT_EQ(AllGroups(b, "dp"),
            (std::vector<std::vector<int64_t>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
}

// create_hierarchical_groups' docstring: 16 ranks, sizes [2, 2, 4].
TEST(MegatronDocExamples, HierarchicalGroupsDocstring) {
  const Topology topology = MakeTopology({{"world_size", 16},
                                          {"context_parallel_size", 16},
                                          {"hierarchical_context_parallel_sizes", {2, 2, 4}}});
  using Groups = std::vector<std::vector<int64_t>>;
  EXPECT_EQ(AllGroups(topology, "hcp_L0"),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(AllGroups(topology, "hcp_L1"),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(AllGroups(topology, "hcp_L2"),
            (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
}

// Partial distributed optimizer: 2 instances over dp 4 (t=2, n=8). dp_cp_partial cuts each
// dp_cp group in halves; inter_dist_opt pairs the same position of each instance.
TEST(MegatronDocExamples, DistributedOptimizerInstances) {
  const Topology topology = MakeTopology({{"world_size", 8},
                                          {"tensor_model_parallel_size", 2},
                                          {"num_distributed_optimizer_instances", 2}});
  using Groups = std::vector<std::vector<int64_t>>;
  EXPECT_EQ(AllGroups(topology, "dp_cp"), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(AllGroups(topology, "dp_cp_partial"), (Groups{{0, 2}, {4, 6}, {1, 3}, {5, 7}}));
  EXPECT_EQ(AllGroups(topology, "expt_dp_partial"), (Groups{{0, 2}, {4, 6}, {1, 3}, {5, 7}}));
  EXPECT_EQ(AllGroups(topology, "inter_dist_opt"), (Groups{{0, 4}, {2, 6}, {1, 5}, {3, 7}}));
  EXPECT_EQ(AllGroups(topology, "intra_dist_opt"), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
}

TEST(MegatronDocExamples, RankOffsetShiftsEveryGroup) {
  const Topology topology = MakeTopology({{"world_size", 4},
                                          {"tensor_model_parallel_size", 2},
                                          {"rank_offset", 8}});
  EXPECT_EQ(AllGroups(topology, "tp"), (std::vector<std::vector<int64_t>>{{8, 9}, {10, 11}}));
  EXPECT_EQ(AllGroups(topology, "dp"), (std::vector<std::vector<int64_t>>{{8, 10}, {9, 11}}));
  const size_t tp = *topology.FindKind("tp");
  EXPECT_EQ(topology.Locate(tp, 11)->group_index, 1);
  EXPECT_EQ(topology.Locate(tp, 11)->rank_in_group, 1);
}

}  // namespace
}  // namespace mpusim
