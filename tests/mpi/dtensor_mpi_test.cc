// DTensor placements and their redistribution (core/tensor_parallel/dtensor.h) on the world's
// ranks as one mesh dimension. A [3, 5, 7] tensor (5 and 7 split unevenly over 2, 4 and 8
// ranks, with empty pieces on 8) goes from each of Shard(0), Shard(1), Shard(2), Replicate()
// and Partial() to each: every rank's result equals its piece of the global tensor exactly,
// and the one collective the redistribution issues is the one DTensor's rules name, counted
// as CommDebugMode counts it (the table below, written from redistribute_local_tensor).
// tests/core/dtensor_test.cc holds the placements' parsing and torch.chunk's piece sizes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor_parallel/dtensor.h"
#include "mpi/mpi_communicator.h"
#include "sim/eigen_kernels.h"
#include "tests/mpi/world.h"

namespace mpusim {
namespace {

// Forwards to `inner`, counting the collectives by CommDebugMode's names.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  int Rank() const override { return inner_.Rank(); }
  int Size() const override { return inner_.Size(); }
  void AllReduce(Tensor& buffer, ReduceOp op) override {
    ++counts["all_reduce"];
    inner_.AllReduce(buffer, op);
  }
  void AllGather(const Tensor& in, Tensor& out) override {
    ++counts["all_gather_into_tensor"];
    inner_.AllGather(in, out);
  }
  void ReduceScatter(const Tensor& in, Tensor& out) override {
    ++counts["reduce_scatter_tensor"];
    inner_.ReduceScatter(in, out);
  }
  void AllToAll(const Tensor& in, Tensor& out) override {
    ++counts["all_to_all_single"];
    inner_.AllToAll(in, out);
  }
  void AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                 const std::vector<int64_t>& recv_counts) override {
    ++counts["all_to_all_single"];
    inner_.AllToAllV(in, send_counts, out, recv_counts);
  }
  void Broadcast(Tensor& buffer, int root) override {
    ++counts["broadcast"];
    inner_.Broadcast(buffer, root);
  }
  std::unique_ptr<PendingP2P> PostSendRecv(const std::vector<P2POp>& ops) override {
    ++counts["send/recv"];
    return inner_.PostSendRecv(ops);
  }
  std::map<std::string, int> counts;

 private:
  Communicator& inner_;
};

const Shape kGlobal = {3, 5, 7};

double GlobalValue(int64_t i, int64_t j, int64_t l) {
  return static_cast<double>(1 + i * 100 + j * 10 + l);
}

// This rank's tensor of the global one under `p` (`scale` times it), a Partial()'s term
// being (rank + 1) times the whole, so that the ranks' terms sum to n (n + 1) / 2 times it.
Tensor LocalOf(const DTensorPlacement& p, int64_t n, int64_t r, double scale) {
  const Shape shape = DTensorLocalShape(kGlobal, p, n, r);
  Shape offset = {0, 0, 0};
  if (p.is_shard())
    offset[static_cast<size_t>(p.dim)] = ChunkOf(kGlobal[static_cast<size_t>(p.dim)], n, r).offset;
  const double factor = p.is_partial() ? static_cast<double>(r + 1) * scale : scale;
  Tensor t = Tensor::HostZeros(shape, DType::kFloat64);
  int64_t e = 0;
  for (int64_t i = 0; i < shape[0]; ++i) {
    for (int64_t j = 0; j < shape[1]; ++j) {
      for (int64_t l = 0; l < shape[2]; ++l) {
        SetHostValue(t, e++, factor * GlobalValue(i + offset[0], j + offset[1], l + offset[2]));
      }
    }
  }
  return t;
}

// The collective DTensor makes for from -> to on n > 1 ranks, by hand from
// redistribute_local_tensor: "" for none, "refused" for Shard -> Partial.
std::string Expected(const DTensorPlacement& from, const DTensorPlacement& to) {
  if (from == to) return "";
  if (from.is_shard() && to.is_partial()) return "refused";
  if (from.is_shard() && to.is_replicate()) return "all_gather_into_tensor";
  if (from.is_shard() && to.is_shard()) return "all_to_all_single";
  if (from.is_partial() && to.is_replicate()) return "all_reduce";
  if (from.is_partial() && to.is_shard()) return "reduce_scatter_tensor";
  return "";  // Replicate -> Shard (its piece), Replicate -> Partial (divided)
}

TEST(DTensorRedistribute, EveryPairOnTheWorldMatchesTheGlobalTensor) {
  std::unique_ptr<MpiCommunicator> world = MpiCommunicator::World();
  EigenKernels k;
  const int64_t n = world->Size(), r = world->Rank();
  const std::vector<DTensorPlacement> placements = {
      DTensorPlacement::Shard(0), DTensorPlacement::Shard(1), DTensorPlacement::Shard(2),
      DTensorPlacement::Replicate(), DTensorPlacement::Partial()};
  const double sum = static_cast<double>(n * (n + 1) / 2);  // a Partial()'s terms' factors
  int checked = 0;
  for (const DTensorPlacement& from : placements) {
    for (const DTensorPlacement& to : placements) {
      SCOPED_TRACE(fmt::format("{} -> {} on {} ranks", DTensorPlacementName(from),
                               DTensorPlacementName(to), n));
      CountingCommunicator group(*world);
      const Tensor local = k.ToDevice(LocalOf(from, n, r, 1.0));
      StatusOr<Tensor> out = Redistribute(k, group, local, kGlobal, from, to);
      const std::string expected =
          n == 1 && Expected(from, to) != "refused" ? "" : Expected(from, to);
      if (expected == "refused") {
        ASSERT_FALSE(out.ok());
        EXPECT_EQ(out.status().Message(),
                  fmt::format("placements: {} -> Partial(): DTensor does not redistribute a "
                              "shard to a partial (\"not supported yet\"); go through "
                              "Replicate()",
                              DTensorPlacementName(from)));
        EXPECT_TRUE(group.counts.empty());
        continue;
      }
      ASSERT_TRUE(out.ok()) << out.status().Message();
      std::map<std::string, int> want;
      if (!expected.empty()) want[expected] = 1;
      EXPECT_EQ(group.counts, want);
      StatusOr<DTensorCollective> named = RedistributeCollective(from, to, n);
      ASSERT_TRUE(named.ok());
      EXPECT_EQ(std::string(DTensorCollectiveName(*named)), expected);
      // What the rank must hold: its piece of the global tensor (n (n + 1) / 2 times it from
      // a Partial()); into Partial() the term n divides (from Replicate()) or keeps.
      const double scale = from.is_partial() && !to.is_partial() ? sum : 1.0;
      Tensor want_local;
      if (to.is_partial()) {
        want_local = from.is_partial() ? LocalOf(to, n, r, 1.0)
                                       : LocalOf(DTensorPlacement::Replicate(), n, r, 1.0);
        if (!from.is_partial()) {
          for (int64_t e = 0; e < want_local.numel(); ++e) {
            SetHostValue(want_local, e, HostValue(want_local, e) * (1.0 / static_cast<double>(n)));
          }
        }
      } else {
        want_local = LocalOf(to, n, r, scale);
      }
      const Tensor got = k.ToHost(*out);
      ASSERT_EQ(got.shape(), want_local.shape());
      int64_t off = 0;
      for (int64_t e = 0; e < got.numel(); ++e)
        off += HostValue(got, e) != HostValue(want_local, e);
      EXPECT_EQ(off, 0) << "elements differing on rank " << r;
      ++checked;
    }
  }
  if (WorldRank() == 0) fmt::print("  {} redistributions checked on {} ranks\n", checked, n);
}

// A local tensor that is not the placement's piece, or a tensor of more dimensions than a
// strided copy takes, is refused before anything is communicated.
TEST(DTensorRedistribute, RefusesAMismatchedLocalTensorBeforeCommunicating) {
  std::unique_ptr<MpiCommunicator> world = MpiCommunicator::World();
  EigenKernels k;
  const int64_t n = world->Size(), r = world->Rank();
  CountingCommunicator group(*world);
  const Tensor whole = k.Zeros(kGlobal, DType::kFloat64);
  StatusOr<Tensor> out = Redistribute(k, group, whole, kGlobal, DTensorPlacement::Shard(1),
                                      DTensorPlacement::Replicate());
  if (n == 1) {
    EXPECT_TRUE(out.ok());  // one rank's piece is the whole tensor
  } else {
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().Message(),
              fmt::format("placements: the local tensor is [3, 5, 7], but Shard(1) of [3, 5, 7] "
                          "on rank {} of {} is [3, {}, 7]",
                          r, n, ChunkOf(5, n, r).size));
  }
  const Shape deep = {1, 1, 1, 1, 1, 1, 2};
  StatusOr<Tensor> too_deep =
      Redistribute(k, group, k.Zeros(deep, DType::kFloat64), deep, DTensorPlacement::Replicate(),
                   DTensorPlacement::Shard(6));
  ASSERT_FALSE(too_deep.ok());
  EXPECT_EQ(too_deep.status().Message(), "placements: a tensor of 7 dimensions (at most 6)");
  EXPECT_TRUE(group.counts.empty());
}

}  // namespace
}  // namespace mpusim
