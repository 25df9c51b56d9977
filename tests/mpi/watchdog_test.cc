// The communication watchdog (mpi/watchdog.h) under mpiexec -n K (K = 1, 2, 4, 8): every
// watched call gives the bits its blocking MPI counterpart gives on the same data, labels name
// the planner's groups, a slow peer within the timeout is waited for, and MPUSIM_FAULT values
// parse or are refused with one message. What happens when the timeout expires is tested on
// whole jobs (tests/fault/fault_test.cc), since it ends the job.
#include "mpi/watchdog.h"

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/config/parallel_config.h"
#include "core/topology.h"
#include "mpi/mpi_check.h"
#include "mpi/mpi_communicator.h"
#include "tests/mpi/world.h"

namespace mpusim {
namespace {

// Rank-dependent small integers, so every sum is exact and a mix-up of ranks shows.
std::vector<int64_t> Values(int rank, size_t n) {
  std::vector<int64_t> v(n);
  for (size_t e = 0; e < n; ++e) v[e] = 1000 * (rank + 1) + static_cast<int64_t>(e * e % 97);
  return v;
}

class WatchedTest : public ::testing::Test {
 protected:
  const int rank_ = WorldRank();
  const int size_ = WorldSize();
  const size_t k_ = static_cast<size_t>(size_);
  const CommLabel& world_ = WorldLabel();
};

TEST_F(WatchedTest, AllreduceReduceAndReduceScatterMatchBlockingMpi) {
  const size_t n = 37;
  const std::vector<int64_t> mine = Values(rank_, n * k_);
  std::vector<int64_t> watched_out(mine.size()), blocking_out(mine.size());
  watched::Allreduce(mine.data(), watched_out.data(), static_cast<int>(mine.size()), MPI_INT64_T,
                     MPI_SUM, MPI_COMM_WORLD, world_);
  MPUSIM_MPI_CHECK(MPI_Allreduce(mine.data(), blocking_out.data(), static_cast<int>(mine.size()),
                                 MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD));
  ASSERT_GT(blocking_out[0], 0);
  EXPECT_EQ(watched_out, blocking_out);

  std::vector<int64_t> in_place = mine;
  watched::Allreduce(MPI_IN_PLACE, in_place.data(), static_cast<int>(n), MPI_INT64_T, MPI_MAX,
                     MPI_COMM_WORLD, world_);
  EXPECT_EQ(in_place[0], Values(size_ - 1, 1)[0]);

  for (int root = 0; root < size_; ++root) {
    std::vector<int64_t> a(n, -1), b(n, -1);
    watched::Reduce(mine.data(), a.data(), static_cast<int>(n), MPI_INT64_T, MPI_SUM, root,
                    MPI_COMM_WORLD, world_);
    MPUSIM_MPI_CHECK(MPI_Reduce(mine.data(), b.data(), static_cast<int>(n), MPI_INT64_T, MPI_SUM,
                                root, MPI_COMM_WORLD));
    EXPECT_EQ(a, b) << "root " << root;
  }

  std::vector<int64_t> a(n), b(n);
  watched::ReduceScatterBlock(mine.data(), a.data(), static_cast<int>(n), MPI_INT64_T, MPI_SUM,
                              MPI_COMM_WORLD, world_);
  MPUSIM_MPI_CHECK(MPI_Reduce_scatter_block(mine.data(), b.data(), static_cast<int>(n), MPI_INT64_T,
                                            MPI_SUM, MPI_COMM_WORLD));
  EXPECT_EQ(a, b);
}

TEST_F(WatchedTest, GathersAndAllToAllsMatchBlockingMpi) {
  const size_t n = 5;
  const std::vector<int64_t> mine = Values(rank_, n * k_);
  std::vector<int64_t> a(n * k_), b(n * k_);
  watched::Allgather(mine.data(), static_cast<int>(n), MPI_INT64_T, a.data(), static_cast<int>(n),
                     MPI_INT64_T, MPI_COMM_WORLD, world_);
  MPUSIM_MPI_CHECK(MPI_Allgather(mine.data(), static_cast<int>(n), MPI_INT64_T, b.data(),
                                 static_cast<int>(n), MPI_INT64_T, MPI_COMM_WORLD));
  EXPECT_EQ(a, b);

  // Rank q contributes q + 1 elements (Allgatherv) and sends q + 1 elements to each rank
  // (Alltoallv).
  std::vector<int> counts(k_), offsets(k_);
  for (size_t q = 0; q < k_; ++q) counts[q] = static_cast<int>(q) + 1;
  std::exclusive_scan(counts.begin(), counts.end(), offsets.begin(), 0);
  const size_t total = static_cast<size_t>(offsets.back() + counts.back());
  std::vector<int64_t> va(total), vb(total);
  watched::Allgatherv(mine.data(), rank_ + 1, MPI_INT64_T, va.data(), counts.data(), offsets.data(),
                      MPI_INT64_T, MPI_COMM_WORLD, world_);
  MPUSIM_MPI_CHECK(MPI_Allgatherv(mine.data(), rank_ + 1, MPI_INT64_T, vb.data(), counts.data(),
                                  offsets.data(), MPI_INT64_T, MPI_COMM_WORLD));
  EXPECT_EQ(va, vb);

  watched::Alltoall(mine.data(), static_cast<int>(n), MPI_INT64_T, a.data(), static_cast<int>(n),
                    MPI_INT64_T, MPI_COMM_WORLD, world_);
  MPUSIM_MPI_CHECK(MPI_Alltoall(mine.data(), static_cast<int>(n), MPI_INT64_T, b.data(),
                                static_cast<int>(n), MPI_INT64_T, MPI_COMM_WORLD));
  EXPECT_EQ(a, b);

  std::vector<int> send_counts(k_, rank_ + 1), send_offsets(k_);
  std::exclusive_scan(send_counts.begin(), send_counts.end(), send_offsets.begin(), 0);
  const std::vector<int64_t> send = Values(rank_, static_cast<size_t>(rank_ + 1) * k_);
  watched::Alltoallv(send.data(), send_counts.data(), send_offsets.data(), MPI_INT64_T, va.data(),
                     counts.data(), offsets.data(), MPI_INT64_T, MPI_COMM_WORLD, world_);
  MPUSIM_MPI_CHECK(MPI_Alltoallv(send.data(), send_counts.data(), send_offsets.data(), MPI_INT64_T,
                                 vb.data(), counts.data(), offsets.data(), MPI_INT64_T,
                                 MPI_COMM_WORLD));
  EXPECT_EQ(va, vb);
}

TEST_F(WatchedTest, BcastBarrierSplitAndDup) {
  for (int root = 0; root < size_; ++root) {
    std::vector<int64_t> buffer = Values(rank_, 9);
    watched::Bcast(buffer.data(), 9, MPI_INT64_T, root, MPI_COMM_WORLD, world_);
    EXPECT_EQ(buffer, Values(root, 9)) << "root " << root;
  }
  watched::Barrier(MPI_COMM_WORLD, world_);

  // Odd and even ranks, each ordered by descending world rank.
  MPI_Comm split = watched::CommSplit(MPI_COMM_WORLD, rank_ % 2, -rank_, world_);
  ASSERT_NE(split, MPI_COMM_NULL);
  const CommLabel parity = LabelOf(split, "parity");
  std::vector<int> expected;
  for (int q = size_ - 1; q >= 0; --q) {
    if (q % 2 == rank_ % 2) expected.push_back(q);
  }
  EXPECT_EQ(parity.kind, "parity");
  EXPECT_EQ(parity.world_ranks, expected);
  MPI_Comm dup = watched::CommDup(split, parity);
  EXPECT_EQ(LabelOf(dup, "dup").world_ranks, expected);
  MPUSIM_MPI_CHECK(MPI_Comm_free(&dup));
  MPUSIM_MPI_CHECK(MPI_Comm_free(&split));

  // A rank left out of every group gets MPI_COMM_NULL, as from MPI_Comm_split.
  MPI_Comm none = watched::CommSplit(MPI_COMM_WORLD, rank_ == 0 ? 0 : MPI_UNDEFINED, 0, world_);
  EXPECT_EQ(none != MPI_COMM_NULL, rank_ == 0);
  if (none != MPI_COMM_NULL) MPUSIM_MPI_CHECK(MPI_Comm_free(&none));
}

// Rank 0 arrives 0.3 s late: the others poll (and sleep) through it well inside the timeout.
TEST_F(WatchedTest, WaitsForASlowPeerWithinTheTimeout) {
  const double before = CommTimeout();
  SetCommTimeout(30);
  if (rank_ == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  int64_t value = rank_ + 1;
  const auto start = std::chrono::steady_clock::now();
  watched::Allreduce(MPI_IN_PLACE, &value, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD, world_);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(value, int64_t{size_} * (size_ + 1) / 2);
  // Sleeps are at most a tenth of the time waited (and 1 ms): no long overshoot, even with
  // 8 ranks sharing 2 cores.
  if (rank_ != 0) {
    EXPECT_LT(waited, 1.5);
  }
  SetCommTimeout(before);
}

TEST(CommTimeoutTest, DefaultIsTorchDistributedsAndBadValuesAreRefused) {
  EXPECT_EQ(kDefaultCommTimeoutS, 1800);
  const double before = CommTimeout();
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_THROW(SetCommTimeout(bad), std::invalid_argument) << bad;
  }
  EXPECT_EQ(CommTimeout(), before);
  SetCommTimeout(2.5);
  EXPECT_EQ(CommTimeout(), 2.5);
  SetCommTimeout(before);
}

TEST(CommLabelTest, WorldAndGroupsNameTheirMembers) {
  const int rank = WorldRank(), size = WorldSize();
  std::vector<int> all(static_cast<size_t>(size));
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(WorldLabel().kind, "world");
  EXPECT_EQ(WorldLabel().world_ranks, all);

  std::unique_ptr<MpiCommunicator> world = MpiCommunicator::World();
  EXPECT_EQ(world->label().kind, "world");
  EXPECT_EQ(world->label().world_ranks, all);
  MPI_Comm self = MPI_COMM_NULL;
  MPUSIM_MPI_CHECK(MPI_Comm_dup(MPI_COMM_SELF, &self));
  std::unique_ptr<MpiCommunicator> alone = MpiCommunicator::Adopt(self);
  EXPECT_EQ(alone->label().kind, size == 1 ? "world" : "comm");
  EXPECT_EQ(alone->label().world_ranks, std::vector<int>{rank});

  ParallelConfig config;
  config.world_size = size;
  config.tensor_model_parallel_size = size % 2 == 0 ? 2 : 1;
  StatusOr<Topology> topology = Topology::Create(config);
  ASSERT_TRUE(topology.ok()) << topology.status().Message();
  auto groups = MakeGroupCommunicators(*topology, rank, MPI_COMM_WORLD, {"tp", "dp"});
  for (const char* kind : {"tp", "dp"}) {
    const size_t index = *topology->FindKind(kind);
    const int64_t group = topology->Locate(index, rank)->group_index;
    const auto& label = dynamic_cast<const MpiCommunicator&>(*groups.at(kind)).label();
    EXPECT_EQ(label.kind, kind);
    const std::vector<int64_t> members = topology->Group(index, group);
    EXPECT_EQ(label.world_ranks, std::vector<int>(members.begin(), members.end())) << kind;
  }
}

TEST(CommLabelTest, LongGroupsAreAbbreviated) {
  EXPECT_EQ(DescribeGroup({"tp", {0, 1, 2, 3}}), "tp group [0, 1, 2, 3]");
  EXPECT_EQ(DescribeGroup({"dp", {1, 3, 5, 7, 9, 11, 13, 15}}),
            "dp group [1, 3, 5, 7, 9, 11, 13, 15]");
  std::vector<int> many(64);
  std::iota(many.begin(), many.end(), 0);
  EXPECT_EQ(DescribeGroup({"world", many}), "world group [0, 1, 2, 3, ..., 62, 63] (64 ranks)");
}

TEST(FaultSpecTest, ParsesEveryOpAndAction) {
  StatusOr<FaultSpec> spec = ParseFaultSpec("rank=1,op=allreduce,call=3,action=stop");
  ASSERT_TRUE(spec.ok()) << spec.status().Message();
  EXPECT_EQ(spec->world_rank, 1);
  EXPECT_EQ(spec->op, WatchedOp::kAllReduce);
  EXPECT_EQ(spec->call, 3);
  EXPECT_EQ(spec->action, FaultAction::kStop);

  spec = ParseFaultSpec("action=exit,call=12,op=any,rank=0");  // any order
  ASSERT_TRUE(spec.ok()) << spec.status().Message();
  EXPECT_EQ(spec->op, WatchedOp::kAny);
  EXPECT_EQ(spec->action, FaultAction::kExit);
  EXPECT_EQ(spec->call, 12);

  for (int op = 0; op <= static_cast<int>(WatchedOp::kAny); ++op) {
    const std::string name = WatchedOpName(static_cast<WatchedOp>(op));
    spec = ParseFaultSpec("rank=2,op=" + name + ",call=1,action=kill");
    ASSERT_TRUE(spec.ok()) << spec.status().Message();
    EXPECT_EQ(spec->op, static_cast<WatchedOp>(op)) << name;
    EXPECT_EQ(spec->action, FaultAction::kKill);
  }
}

TEST(FaultSpecTest, RefusesMalformedValuesWithOneMessage) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"rank=1", "'op' is missing"},
      {"rank=1,op=allreduce,call=3", "'action' is missing"},
      {"rank=1,op=allreduce,call=3,action=pause", "unknown action 'pause'"},
      {"rank=1,op=alltoallw,call=3,action=stop", "unknown op 'alltoallw'"},
      {"rank=1,op=allreduce,call=0,action=stop", "call '0' is not a number from 1"},
      {"rank=1,op=allreduce,call=3x,action=stop", "call '3x' is not a number from 1"},
      {"rank=-1,op=allreduce,call=3,action=stop", "rank '-1' is not a world rank"},
      {"rank=1,op=allreduce,call=3,action=stop,when=now", "unknown key 'when'"},
      {"rank=1,rank=2,op=allreduce,call=3,action=stop", "'rank' is given twice"},
      {"rank,op=allreduce,call=3,action=stop", "'rank' is not key=value"},
      {"rank=1;op=allreduce", "'op' is missing"},
      {"rank=1,op=allreduce,call=3,action=stop,", "'' is not key=value"},
  };
  for (const auto& [text, what] : cases) {
    const StatusOr<FaultSpec> spec = ParseFaultSpec(text);
    ASSERT_FALSE(spec.ok()) << text;
    EXPECT_EQ(spec.status().where(), "MPUSIM_FAULT");
    EXPECT_NE(spec.status().what().find(what), std::string::npos) << spec.status().Message();
    EXPECT_NE(spec.status().what().find("expected rank=R,op=OP,call=N,action=stop|kill|exit|throw|oom"),
              std::string::npos);
    EXPECT_EQ(spec.status().Message().find('\n'), std::string::npos);
  }
}

// An unset variable arms nothing; a rank outside the job is refused once MPI knows the size.
TEST(FaultSpecTest, ArmChecksTheRankAgainstTheJob) {
  unsetenv("MPUSIM_FAULT");
  EXPECT_TRUE(ArmFaultInjection().ok());
  setenv("MPUSIM_FAULT", fmt::format("rank={},op=any,call=1,action=stop", WorldSize()).c_str(), 1);
  const Status status = ArmFaultInjection();
  unsetenv("MPUSIM_FAULT");
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.what().find("is not a rank of this job"), std::string::npos) << status.Message();
  EXPECT_TRUE(ArmFaultInjection().ok());  // disarmed again
}

}  // namespace
}  // namespace mpusim
