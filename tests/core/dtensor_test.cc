// DTensor placements (core/tensor_parallel/dtensor.h) without ranks: torch.chunk's piece
// sizes, torch's spellings of the placements and their errors, and the gradient's placement.
// tests/mpi/dtensor_mpi_test.cc runs the redistributions themselves.
#include "core/tensor_parallel/dtensor.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace mpusim {
namespace {

TEST(DTensorPlacement, PieceSizesFollowTorchChunk) {
  // torch.chunk: pieces of ceil(D / n), the last ones shorter, empty where none is left.
  const auto sizes = [](int64_t d, int64_t n) {
    std::vector<int64_t> out;
    for (int64_t r = 0; r < n; ++r) out.push_back(ChunkOf(d, n, r).size);
    return out;
  };
  EXPECT_EQ(sizes(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(sizes(6, 4), (std::vector<int64_t>{2, 2, 2, 0}));
  EXPECT_EQ(sizes(7, 3), (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(sizes(2, 4), (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(sizes(8, 4), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(ChunkOf(5, 4, 3).offset, 5);
}

TEST(DTensorPlacement, PlacementsParseAsTorchWritesThem) {
  const auto parsed = [](const char* text) {
    StatusOr<DTensorPlacement> p = ParseDTensorPlacement(text, 3, "input_layouts");
    return p.ok() ? DTensorPlacementName(*p) : p.status().Message();
  };
  EXPECT_EQ(parsed("Shard(-1)"), "Shard(2)");
  EXPECT_EQ(parsed("Shard(dim=1)"), "Shard(1)");
  EXPECT_EQ(parsed(" Shard( 0 ) "), "Shard(0)");
  EXPECT_EQ(parsed("S(1)"), "Shard(1)");
  EXPECT_EQ(parsed("Replicate()"), "Replicate()");
  EXPECT_EQ(parsed("Partial()"), "Partial()");
  EXPECT_EQ(parsed("Partial(sum)"), "Partial()");
  EXPECT_EQ(parsed("Shard(3)"),
            "input_layouts: \"Shard(3)\": dim 3 is out of range for a tensor of 3 dimensions "
            "(allowed [-3, 2])");
  EXPECT_EQ(parsed("Partial(max)"),
            "input_layouts: \"Partial(max)\": only Partial()'s sum reduction is built "
            "(DTensor's default)");
  EXPECT_EQ(parsed("Sharded(0)"),
            "input_layouts: \"Sharded(0)\" is not a placement; use \"Shard(d)\" (d in [-3, 2]), "
            "\"Replicate()\" or \"Partial()\"");
  // The gradient goes back to Replicate() where the forward left a Partial().
  EXPECT_EQ(GradientPlacement(DTensorPlacement::Partial(), DTensorPlacement::Shard(0)),
            DTensorPlacement::Replicate());
  EXPECT_EQ(GradientPlacement(DTensorPlacement::Partial(), DTensorPlacement::Replicate()),
            DTensorPlacement::Replicate());
  EXPECT_EQ(GradientPlacement(DTensorPlacement::Shard(1), DTensorPlacement::Replicate()),
            DTensorPlacement::Shard(1));
}

}  // namespace
}  // namespace mpusim
