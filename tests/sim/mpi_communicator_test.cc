// MpiCommunicator and MakeGroupCommunicators, run under mpiexec -n K (K = 1, 2, 4, 8).
//
// Data are small integers, so sums and maxima are exact in float32 and float64 and every
// check is an exact comparison. Every rank runs every collective (no rank-dependent early
// return before a collective), so a failing check cannot hang the job.
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "core/parallel_config.h"
#include "core/tensor.h"
#include "core/topology.h"
#include "sim/mpi_check.h"
#include "sim/mpi_communicator.h"

namespace mpusim {
namespace {

int WorldRank() {
  int rank = 0;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}
int WorldSize() {
  int size = 0;
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  return size;
}

bool HasErrorsReturn(MPI_Comm comm) {
  MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
  MPUSIM_MPI_CHECK(MPI_Comm_get_errhandler(comm, &handler));
  const bool is_return = handler == MPI_ERRORS_RETURN;
  MPUSIM_MPI_CHECK(MPI_Errhandler_free(&handler));
  return is_return;
}

template <typename T>
constexpr DType kDType = std::is_same_v<T, float> ? DType::kFloat32 : DType::kFloat64;

template <typename T>
Tensor Fill(int64_t n, const std::function<double(int64_t)>& value) {
  Tensor t = Tensor::HostZeros({n}, kDType<T>);
  for (int64_t e = 0; e < n; ++e) t.data_as<T>()[e] = static_cast<T>(value(e));
  return t;
}

template <typename T>
std::vector<double> Values(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (size_t e = 0; e < v.size(); ++e) v[e] = static_cast<double>(t.data_as<T>()[e]);
  return v;
}

std::vector<double> Expected(int64_t n, const std::function<double(int64_t)>& value) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) v[static_cast<size_t>(e)] = value(e);
  return v;
}

template <typename T>
class MpiCommunicatorTest : public ::testing::Test {
 protected:
  std::unique_ptr<MpiCommunicator> world_ = MpiCommunicator::World();
  int rank_ = WorldRank();
  int size_ = WorldSize();
};
using DTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MpiCommunicatorTest, DTypes);

TYPED_TEST(MpiCommunicatorTest, WorldMatchesMpiAndReturnsErrors) {
  EXPECT_EQ(this->world_->Rank(), this->rank_);
  EXPECT_EQ(this->world_->Size(), this->size_);
  EXPECT_NE(this->world_->comm(), MPI_COMM_WORLD);  // a duplicate, owned and freed by us
  EXPECT_TRUE(HasErrorsReturn(this->world_->comm()));
  EXPECT_THROW(MpiCommunicator::Adopt(MPI_COMM_WORLD), std::invalid_argument);
  EXPECT_THROW(MpiCommunicator::Adopt(MPI_COMM_NULL), std::invalid_argument);
}

TYPED_TEST(MpiCommunicatorTest, AllReduceSumAndMax) {
  using T = TypeParam;
  const int64_t n = 37;
  const int r = this->rank_, k = this->size_;
  Tensor sum = Fill<T>(n, [&](int64_t e) { return 100.0 * r + static_cast<double>(e); });
  this->world_->AllReduce(sum, ReduceOp::kSum);
  EXPECT_EQ(Values<T>(sum), Expected(n, [&](int64_t e) {
              return 100.0 * k * (k - 1) / 2 + static_cast<double>(k * e);
            }));

  // Element e is largest on rank (e mod k); values are negative, so a 0 would be caught.
  Tensor max = Fill<T>(n, [&](int64_t e) { return -1000.0 + ((e + k - r) % k == 0 ? 500 : r); });
  this->world_->AllReduce(max, ReduceOp::kMax);
  EXPECT_EQ(Values<T>(max), Expected(n, [&](int64_t) { return -500.0; }));
}

TYPED_TEST(MpiCommunicatorTest, AllGatherConcatenatesInRankOrder) {
  using T = TypeParam;
  const int64_t n = 5;
  const int k = this->size_;
  const Tensor in =
      Fill<T>(n, [&](int64_t e) { return 10.0 * this->rank_ + static_cast<double>(e); });
  Tensor out = Tensor::HostZeros({k, n}, kDType<T>);
  this->world_->AllGather(in, out);
  EXPECT_EQ(Values<T>(out), Expected(k * n, [&](int64_t f) {
              return 10.0 * static_cast<double>(f / n) + static_cast<double>(f % n);
            }));
  Tensor wrong = Tensor::HostZeros({k * n + 1}, kDType<T>);
  EXPECT_THROW(this->world_->AllGather(in, wrong), std::invalid_argument);
  Tensor other =
      Tensor::HostZeros({k, n}, kDType<T> == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32);
  EXPECT_THROW(this->world_->AllGather(in, other), std::invalid_argument);
  EXPECT_THROW(this->world_->AllGather(out.Reshaped({k * n}), out), std::invalid_argument);
}

TYPED_TEST(MpiCommunicatorTest, ReduceScatterSumsOwnChunk) {
  using T = TypeParam;
  const int64_t n = 6;
  const int k = this->size_, r = this->rank_;
  // Rank q contributes (q + 1) * (f + 1) at flat position f.
  const Tensor in =
      Fill<T>(k * n, [&](int64_t f) { return (r + 1.0) * static_cast<double>(f + 1); });
  Tensor out = Tensor::HostZeros({n}, kDType<T>);
  this->world_->ReduceScatter(in, out);
  EXPECT_EQ(Values<T>(out), Expected(n, [&](int64_t e) {
              return k * (k + 1) / 2.0 * static_cast<double>(r * n + e + 1);
            }));
  Tensor wrong = Tensor::HostZeros({n + 1}, kDType<T>);
  EXPECT_THROW(this->world_->ReduceScatter(in, wrong), std::invalid_argument);
}

TYPED_TEST(MpiCommunicatorTest, BroadcastFromEveryRoot) {
  using T = TypeParam;
  const int64_t n = 9;
  for (int root = 0; root < this->size_; ++root) {
    Tensor buffer = Fill<T>(n, [&](int64_t e) {
      return this->rank_ == root ? 1000.0 * (root + 1) + static_cast<double>(e) : -1.0;
    });
    this->world_->Broadcast(buffer, root);
    EXPECT_EQ(Values<T>(buffer),
              Expected(n, [&](int64_t e) { return 1000.0 * (root + 1) + static_cast<double>(e); }))
        << "root " << root;
  }
  Tensor buffer = Tensor::HostZeros({n}, kDType<T>);
  EXPECT_THROW(this->world_->Broadcast(buffer, this->size_), std::invalid_argument);
  EXPECT_THROW(this->world_->Broadcast(buffer, -1), std::invalid_argument);
}

// MPI_ERRORS_RETURN on our communicators is what lets MPUSIM_MPI_CHECK see a failure: a
// call with an invalid count comes back with an error code instead of aborting in MPI.
TEST(MpiCheckTest, ErrorsComeBackAndAreReported) {
  std::unique_ptr<MpiCommunicator> world = MpiCommunicator::World();
  int value = 1;
  const int code = MPI_Allreduce(MPI_IN_PLACE, &value, -1, MPI_INT, MPI_SUM, world->comm());
  ASSERT_NE(code, MPI_SUCCESS);
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  ASSERT_EQ(MPI_Error_string(code, text, &length), MPI_SUCCESS);
  const std::string message =
      MpiErrorMessage("MPI_Allreduce(x, -1)", code, "sim/file.cc", 42, "Caller");
  for (const std::string& part :
       {fmt::format("rank {} (host ", WorldRank()), std::string("MPI_Allreduce(x, -1)"),
        std::string("sim/file.cc:42"), std::string("Caller"), std::string(text, text + length)}) {
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

// --- MakeGroupCommunicators -------------------------------------------------------------

std::vector<ParallelConfig> ConfigsFor(int k) {
  std::vector<ParallelConfig> configs;
  const auto add = [&](int64_t tp, int64_t pp, int64_t cp, int64_t ep) {
    ParallelConfig c;
    c.world_size = k;
    c.tensor_model_parallel_size = tp;
    c.pipeline_model_parallel_size = pp;
    c.context_parallel_size = cp;
    c.expert_model_parallel_size = ep;
    configs.push_back(c);
  };
  add(k % 2 == 0 ? 2 : 1, 1, 1, 1);
  add(1, k, 1, 1);  // pp groups span the world; embd / pos_embd leave middle ranks out
  if (k % 4 == 0) {
    add(2, 2, 1, 1);
    add(1, 2, 1, 2);
  }
  if (k == 8) {
    add(2, 1, 2, 2);
    add(2, 4, 1, 1);
    ParallelConfig c;
    c.world_size = k;
    c.tensor_model_parallel_size = 2;
    c.context_parallel_size = 4;
    c.hierarchical_context_parallel_sizes = {2, 2};
    c.num_distributed_optimizer_instances = 2;
    c.order = "tp-cp-ep-dp-pp";
    configs.push_back(c);
    c = ParallelConfig{};
    c.world_size = k;
    c.tensor_model_parallel_size = 2;
    c.pipeline_model_parallel_size = 2;
    c.order = "tp-pp-dp";
    configs.push_back(c);
  }
  return configs;
}

std::string Describe(const ParallelConfig& c) {
  return fmt::format("world {} tp {} pp {} cp {} ep {} order {}", c.world_size,
                     c.tensor_model_parallel_size, c.pipeline_model_parallel_size,
                     c.context_parallel_size, c.expert_model_parallel_size, c.order);
}

TEST(MakeGroupCommunicatorsTest, EveryKindMatchesThePlanner) {
  const int world_rank = WorldRank();
  for (const ParallelConfig& config : ConfigsFor(WorldSize())) {
    SCOPED_TRACE(Describe(config));
    StatusOr<Topology> topology = Topology::Create(config);
    ASSERT_TRUE(topology.ok()) << topology.status().Message();  // the same on every rank
    std::vector<std::string> names;
    for (const GroupKind& kind : topology->kinds()) names.push_back(kind.name);
    ASSERT_FALSE(names.empty());
    std::map<std::string, std::unique_ptr<Communicator>> comms =
        MakeGroupCommunicators(*topology, world_rank, MPI_COMM_WORLD, names);

    for (size_t index = 0; index < names.size(); ++index) {
      const std::string& name = names[index];
      SCOPED_TRACE(name);
      const std::optional<GroupSlot> slot = topology->Locate(index, world_rank);
      const auto it = comms.find(name);
      if (!slot.has_value()) {
        EXPECT_EQ(it, comms.end()) << "rank " << world_rank << " is in no " << name << " group";
        continue;
      }
      ASSERT_NE(it, comms.end()) << "no communicator for " << name;
      Communicator& comm = *it->second;
      EXPECT_EQ(comm.Rank(), slot->rank_in_group);
      EXPECT_EQ(comm.Size(), topology->GroupSize(index));
      const auto* mpi = dynamic_cast<const MpiCommunicator*>(&comm);
      ASSERT_NE(mpi, nullptr);
      EXPECT_TRUE(HasErrorsReturn(mpi->comm()));

      // Gathering world ranks over the group must give Megatron's member list, in order.
      Tensor mine = Tensor::HostZeros({1}, DType::kFloat64);
      *mine.data_as<double>() = world_rank;
      Tensor members = Tensor::HostZeros({comm.Size()}, DType::kFloat64);
      comm.AllGather(mine, members);
      std::vector<int64_t> gathered;
      for (double v : Values<double>(members)) gathered.push_back(static_cast<int64_t>(v));
      EXPECT_EQ(gathered, topology->Group(index, slot->group_index))
          << "group " << slot->group_index;
    }
  }
}

TEST(MakeGroupCommunicatorsTest, TpGroupIsMegatronsList) {
  const int k = WorldSize();
  ParallelConfig config;
  config.world_size = k;
  config.tensor_model_parallel_size = k % 2 == 0 ? 2 : 1;
  StatusOr<Topology> topology = Topology::Create(config);
  ASSERT_TRUE(topology.ok()) << topology.status().Message();
  const int world_rank = WorldRank();
  auto comms = MakeGroupCommunicators(*topology, world_rank, MPI_COMM_WORLD, {"tp", "dp"});
  ASSERT_EQ(comms.size(), 2u);
  // tp groups are consecutive pairs [2g, 2g + 1] (or single ranks when k is odd).
  const int tp = static_cast<int>(config.tensor_model_parallel_size);
  Tensor mine = Tensor::HostZeros({1}, DType::kFloat32);
  *mine.data_as<float>() = static_cast<float>(world_rank);
  Tensor members = Tensor::HostZeros({tp}, DType::kFloat32);
  comms.at("tp")->AllGather(mine, members);
  std::vector<double> expected;
  for (int i = 0; i < tp; ++i) expected.push_back(world_rank / tp * tp + i);
  EXPECT_EQ(Values<float>(members), expected);
  EXPECT_EQ(comms.at("dp")->Size(), k / tp);
  EXPECT_EQ(comms.at("dp")->Rank(), world_rank / tp);
}

TEST(MakeGroupCommunicatorsTest, RefusesBadArgumentsOnEveryRank) {
  const int k = WorldSize();
  ParallelConfig config;
  config.world_size = k;
  StatusOr<Topology> topology = Topology::Create(config);
  ASSERT_TRUE(topology.ok()) << topology.status().Message();
  const int world_rank = WorldRank();
  EXPECT_THROW(MakeGroupCommunicators(*topology, world_rank, MPI_COMM_WORLD, {"tp", "tensor"}),
               std::invalid_argument);

  config.world_size = 2 * k;
  StatusOr<Topology> too_big = Topology::Create(config);
  ASSERT_TRUE(too_big.ok()) << too_big.status().Message();
  EXPECT_THROW(MakeGroupCommunicators(*too_big, world_rank, MPI_COMM_WORLD, {"tp"}),
               std::invalid_argument);

  // Only the last rank passes a wrong world_rank; every rank must still throw, not hang.
  const int64_t claimed = world_rank == k - 1 ? world_rank + 1 : world_rank;
  EXPECT_THROW(MakeGroupCommunicators(*topology, claimed, MPI_COMM_WORLD, {"tp"}),
               std::invalid_argument);
  EXPECT_TRUE(MakeGroupCommunicators(*topology, world_rank, MPI_COMM_WORLD, {}).empty());
}

}  // namespace
}  // namespace mpusim
