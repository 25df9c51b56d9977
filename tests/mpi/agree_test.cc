// The agreement helpers on K ranks: every rank learns whether any failed, and rank 0 gets each
// distinct message once, with the ranks that reported it unless all did.
#include "mpi/agree.h"

#include <mpi.h>

#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "tests/mpi/world.h"

namespace mpusim {
namespace {


int Size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

TEST(Agree, AllGatherStringsInRankOrder) {
  const std::vector<std::string> all = AllGatherStrings(std::string(static_cast<size_t>(WorldRank()), 'x'));
  ASSERT_EQ(static_cast<int>(all.size()), Size());
  for (int r = 0; r < Size(); ++r) EXPECT_EQ(all[static_cast<size_t>(r)], std::string(static_cast<size_t>(r), 'x'));
}

TEST(Agree, OneLineWhenEveryRankSaysTheSame) {
  std::vector<std::string> lines;
  EXPECT_TRUE(GatherErrors("--backend cuda: no device", &lines));
  if (WorldRank() == 0) {
    EXPECT_EQ(lines, std::vector<std::string>{"--backend cuda: no device"});
  } else {
    EXPECT_TRUE(lines.empty());
  }
}

TEST(Agree, RanksNamedWhenNotAllFailed) {
  std::vector<std::string> lines;
  const bool failed = GatherErrors(WorldRank() % 2 == 1 ? "disk full" : "", &lines);
  EXPECT_EQ(failed, Size() > 1);
  if (WorldRank() != 0) return;
  std::vector<int> odd;
  for (int r = 1; r < Size(); r += 2) odd.push_back(r);
  if (Size() == 1) {
    EXPECT_TRUE(lines.empty());
  } else {
    EXPECT_EQ(lines, std::vector<std::string>{fmt::format(
                         "rank{} {}: disk full", Size() > 3 ? "s" : "", fmt::join(odd, ","))});
  }
}

TEST(Agree, NothingWhenNoRankFailed) {
  std::vector<std::string> lines;
  EXPECT_FALSE(GatherErrors("", &lines));
  EXPECT_TRUE(lines.empty());
  EXPECT_EQ(AgreeOnWorst(WorldRank() == Size() - 1 ? 2 : 0), 2);
}

}  // namespace
}  // namespace mpusim
