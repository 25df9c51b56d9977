// MpiCommunicator and MakeGroupCommunicators, run under mpiexec -n K (K = 1, 2, 4, 8).
//
// Data are small integers (for 16-bit dtypes: small multiples of 1/4 whose every partial
// sum fits bfloat16's 8-bit significand), so sums and maxima are exact in every dtype and
// every check is an exact comparison; 16-bit all-gather and broadcast are checked bit for
// bit on arbitrary bit patterns, NaNs included. Every rank runs every collective (no
// rank-dependent early return before a collective), so a failing check cannot hang the job.
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstring>
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

#include "core/half.h"
#include "core/config/parallel_config.h"
#include "core/philox.h"
#include "core/tensor.h"
#include "core/topology.h"
#include "mpi/mpi_check.h"
#include "mpi/mpi_communicator.h"
#include "tests/mpi/world.h"
#include "tests/kernel_test_util.h"

namespace mpusim {
namespace {

bool HasErrorsReturn(MPI_Comm comm) {
  MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
  MPUSIM_MPI_CHECK(MPI_Comm_get_errhandler(comm, &handler));
  const bool is_return = handler == MPI_ERRORS_RETURN;
  MPUSIM_MPI_CHECK(MPI_Errhandler_free(&handler));
  return is_return;
}


template <typename T>
Tensor Fill(int64_t n, const std::function<double(int64_t)>& value) {
  Tensor t = Tensor::HostZeros({n}, kDType<T>);
  for (int64_t e = 0; e < n; ++e) t.data_as<T>()[e] = static_cast<T>(value(e));
  return t;
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
  EXPECT_EQ(ValuesOf(sum), Expected(n, [&](int64_t e) {
              return 100.0 * k * (k - 1) / 2 + static_cast<double>(k * e);
            }));

  // Element e is largest on rank (e mod k); values are negative, so a 0 would be caught.
  Tensor max = Fill<T>(n, [&](int64_t e) { return -1000.0 + ((e + k - r) % k == 0 ? 500 : r); });
  this->world_->AllReduce(max, ReduceOp::kMax);
  EXPECT_EQ(ValuesOf(max), Expected(n, [&](int64_t) { return -500.0; }));
}

TYPED_TEST(MpiCommunicatorTest, AllGatherConcatenatesInRankOrder) {
  using T = TypeParam;
  const int64_t n = 5;
  const int k = this->size_;
  const Tensor in =
      Fill<T>(n, [&](int64_t e) { return 10.0 * this->rank_ + static_cast<double>(e); });
  Tensor out = Tensor::HostZeros({k, n}, kDType<T>);
  this->world_->AllGather(in, out);
  EXPECT_EQ(ValuesOf(out), Expected(k * n, [&](int64_t f) {
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
  EXPECT_EQ(ValuesOf(out), Expected(n, [&](int64_t e) {
              return k * (k + 1) / 2.0 * static_cast<double>(r * n + e + 1);
            }));
  Tensor wrong = Tensor::HostZeros({n + 1}, kDType<T>);
  EXPECT_THROW(this->world_->ReduceScatter(in, wrong), std::invalid_argument);
}

// Rank q sends 100 q + 10 j + e as element e of chunk j to rank j: this rank's chunk j is then
// 100 j + 10 r + e. Any chunk landing at another rank or place breaks a digit.
TYPED_TEST(MpiCommunicatorTest, AllToAllSwapsChunksInRankOrder) {
  using T = TypeParam;
  const int64_t n = 3;
  const int k = this->size_, r = this->rank_;
  const Tensor in = Fill<T>(k * n, [&](int64_t f) {
    return 100.0 * r + 10.0 * static_cast<double>(f / n) + static_cast<double>(f % n);
  });
  Tensor out = Tensor::HostZeros({k, n}, kDType<T>);
  this->world_->AllToAll(in, out);
  EXPECT_EQ(ValuesOf(out), Expected(k * n, [&](int64_t f) {
              return 100.0 * static_cast<double>(f / n) + 10.0 * r + static_cast<double>(f % n);
            }));
  Tensor wrong = Tensor::HostZeros({k * n + k}, kDType<T>);
  EXPECT_THROW(this->world_->AllToAll(in, wrong), std::invalid_argument);
  Tensor other =
      Tensor::HostZeros({k, n}, kDType<T> == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32);
  EXPECT_THROW(this->world_->AllToAll(in, other), std::invalid_argument);
  if (k > 1) {
    const Tensor odd = Tensor::HostZeros({k * n + 1}, kDType<T>);
    Tensor odd_out = Tensor::HostZeros({k * n + 1}, kDType<T>);
    EXPECT_THROW(this->world_->AllToAll(odd, odd_out), std::invalid_argument);
  }
  EXPECT_THROW(this->world_->AllToAll(out.Reshaped({k * n}), out), std::invalid_argument);
}

// Rank q sends rank j a part of (q + j) % 3 elements (some empty), element e being
// 100 q + 10 j + e: this rank's part j then holds (j + r) % 3 elements 100 j + 10 r + e.
TYPED_TEST(MpiCommunicatorTest, AllToAllVSwapsUnevenPartsInRankOrder) {
  using T = TypeParam;
  const int k = this->size_, r = this->rank_;
  std::vector<double> sent, expected;
  std::vector<int64_t> send_counts, recv_counts;
  for (int j = 0; j < k; ++j) {
    send_counts.push_back((r + j) % 3);
    for (int e = 0; e < (r + j) % 3; ++e) sent.push_back(100.0 * r + 10.0 * j + e);
    recv_counts.push_back((j + r) % 3);
    for (int e = 0; e < (j + r) % 3; ++e) expected.push_back(100.0 * j + 10.0 * r + e);
  }
  const auto n_in = static_cast<int64_t>(sent.size());
  const Tensor in = Fill<T>(n_in, [&](int64_t f) { return sent[static_cast<size_t>(f)]; });
  Tensor out = Tensor::HostZeros({static_cast<int64_t>(expected.size())}, kDType<T>);
  this->world_->AllToAllV(in, send_counts, out, recv_counts);
  EXPECT_EQ(ValuesOf(out), expected);

  std::vector<int64_t> short_counts(send_counts.begin(), send_counts.end() - 1);
  EXPECT_THROW(this->world_->AllToAllV(in, short_counts, out, recv_counts),
               std::invalid_argument);
  std::vector<int64_t> too_many = send_counts;
  too_many.back() += 1;
  EXPECT_THROW(this->world_->AllToAllV(in, too_many, out, recv_counts), std::invalid_argument);
  std::vector<int64_t> negative = recv_counts;
  negative.front() = -1;
  if (k > 1) negative.back() += 1 + recv_counts.front();  // the sum still right
  EXPECT_THROW(this->world_->AllToAllV(in, send_counts, out, negative), std::invalid_argument);
  Tensor other = Tensor::HostZeros(
      out.shape(), kDType<T> == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32);
  EXPECT_THROW(this->world_->AllToAllV(in, send_counts, other, recv_counts),
               std::invalid_argument);
  if (out.numel() > 0) {  // in and out the same storage
    EXPECT_THROW(this->world_->AllToAllV(out, recv_counts, out, recv_counts),
                 std::invalid_argument);
  }
}

TYPED_TEST(MpiCommunicatorTest, BroadcastFromEveryRoot) {
  using T = TypeParam;
  const int64_t n = 9;
  for (int root = 0; root < this->size_; ++root) {
    Tensor buffer = Fill<T>(n, [&](int64_t e) {
      return this->rank_ == root ? 1000.0 * (root + 1) + static_cast<double>(e) : -1.0;
    });
    this->world_->Broadcast(buffer, root);
    EXPECT_EQ(ValuesOf(buffer),
              Expected(n, [&](int64_t e) { return 1000.0 * (root + 1) + static_cast<double>(e); }))
        << "root " << root;
  }
  Tensor buffer = Tensor::HostZeros({n}, kDType<T>);
  EXPECT_THROW(this->world_->Broadcast(buffer, this->size_), std::invalid_argument);
  EXPECT_THROW(this->world_->Broadcast(buffer, -1), std::invalid_argument);
}

// --- int64 (token ids) -------------------------------------------------------------------

// Megatron's broadcast_data sends token ids as int64: every bit must arrive, including
// values no double holds (above 2^53), and int64 sums are exact.
TEST(MpiCommunicatorInt64Test, BroadcastAllGatherAndAllReduceAreExact) {
  const std::unique_ptr<MpiCommunicator> world = MpiCommunicator::World();
  const int r = WorldRank(), k = WorldSize();
  const int64_t n = 7;
  const int64_t big = (int64_t{1} << 58) + 1;  // not a double; 8 * big still fits
  const auto value = [&](int root, int64_t e) { return big * (e % 2 == 0 ? 1 : -1) + root + e; };
  for (int root = 0; root < k; ++root) {
    Tensor buffer = Tensor::HostZeros({n}, DType::kInt64);
    for (int64_t e = 0; e < n; ++e) buffer.data_as<int64_t>()[e] = r == root ? value(root, e) : -1;
    world->Broadcast(buffer, root);
    for (int64_t e = 0; e < n; ++e) {
      EXPECT_EQ(buffer.data_as<int64_t>()[e], value(root, e)) << "root " << root << " e " << e;
    }
  }

  Tensor in = Tensor::HostZeros({n}, DType::kInt64);
  for (int64_t e = 0; e < n; ++e) in.data_as<int64_t>()[e] = value(r, e);
  Tensor out = Tensor::HostZeros({k, n}, DType::kInt64);
  world->AllGather(in, out);
  for (int q = 0; q < k; ++q) {
    for (int64_t e = 0; e < n; ++e) EXPECT_EQ(out.data_as<int64_t>()[q * n + e], value(q, e));
  }

  Tensor sum = Tensor::HostZeros({n}, DType::kInt64);
  for (int64_t e = 0; e < n; ++e) sum.data_as<int64_t>()[e] = big + r * (e + 1);
  world->AllReduce(sum, ReduceOp::kSum);
  for (int64_t e = 0; e < n; ++e) {
    EXPECT_EQ(sum.data_as<int64_t>()[e], big * k + int64_t{k} * (k - 1) / 2 * (e + 1));
  }
  Tensor floats = Tensor::HostZeros({k, n}, DType::kFloat64);
  EXPECT_THROW(world->AllGather(in, floats), std::invalid_argument);  // dtypes must agree
}

// --- bfloat16 / float16 ------------------------------------------------------------------

// Unit roundoff of H: 2^-8 (bfloat16), 2^-11 (float16).
template <typename H>
constexpr double kHalfU = std::is_same_v<H, BFloat16> ? 0x1p-8 : 0x1p-11;

// value(e) rounded to H (float64 -> float32 -> H, core/half.h).
template <typename H>
Tensor FillHalf(int64_t n, const std::function<double(int64_t)>& value) {
  Tensor t = Tensor::HostZeros({n}, kDType<H>);
  for (int64_t e = 0; e < n; ++e) t.data_as<H>()[e] = FromFloat<H>(static_cast<float>(value(e)));
  return t;
}


// A rank-dependent 16-bit pattern covering every exponent and sign, NaNs and infinities
// included (any conversion through float would change the signalling NaNs' bits).
uint16_t PatternAt(int rank, int64_t e) {
  return static_cast<uint16_t>(
      (static_cast<uint32_t>(rank) * 0x1357u + static_cast<uint32_t>(e) * 0x0b11u + 0x7c01u) &
      0xffffu);
}
Tensor Patterns(DType dtype, int rank, int64_t n) {
  Tensor t = Tensor::HostZeros({n}, dtype);
  for (int64_t e = 0; e < n; ++e) t.data_as<uint16_t>()[e] = PatternAt(rank, e);
  return t;
}

template <typename H>
class MpiCommunicatorHalfTest : public ::testing::Test {
 protected:
  std::unique_ptr<MpiCommunicator> world_ = MpiCommunicator::World();
  int rank_ = WorldRank();
  int size_ = WorldSize();
};
using HalfTypes = ::testing::Types<BFloat16, Float16>;
TYPED_TEST_SUITE(MpiCommunicatorHalfTest, HalfTypes);

TYPED_TEST(MpiCommunicatorHalfTest, AllReduceSumAndMax) {
  using H = TypeParam;
  const int64_t n = 37;
  const int r = this->rank_, k = this->size_;
  // Rank q holds (q + 1) (e mod 7 - 3) / 4: partial sums are multiples of 1/4 of magnitude
  // <= 36 * 3 / 4, exact in 8 significant bits.
  const auto term = [](int q, int64_t e) { return (q + 1) * static_cast<double>(e % 7 - 3) / 4; };
  Tensor sum = FillHalf<H>(n, [&](int64_t e) { return term(r, e); });
  this->world_->AllReduce(sum, ReduceOp::kSum);
  const std::vector<double> expected = Expected(
      n, [&](int64_t e) { return k * (k + 1) / 2.0 * static_cast<double>(e % 7 - 3) / 4; });
  ASSERT_GT(std::fabs(expected[0]) + std::fabs(expected[6]), 0);
  EXPECT_EQ(ValuesOf(sum), expected);

  // Element e is largest (-50) on rank e mod k; the rest are -100 + q, so a 0 would be caught.
  Tensor max = FillHalf<H>(n, [&](int64_t e) { return -100.0 + ((e + k - r) % k == 0 ? 50 : r); });
  // Elements 0 and 1: NaN on the first or the last rank only; elements 2 and 3: -0 on even
  // or odd ranks, +0 on the others. Both arrangements, so that an operation that depends on
  // its operands' order fails whichever order MPI uses.
  max.data_as<H>()[0] = FromFloat<H>(r == 0 ? std::nanf("") : 1.0f);
  max.data_as<H>()[1] = FromFloat<H>(r == k - 1 ? std::nanf("") : 1.0f);
  max.data_as<H>()[2] = FromFloat<H>(r % 2 == 0 ? -0.0f : 0.0f);
  max.data_as<H>()[3] = FromFloat<H>(r % 2 == 1 ? -0.0f : 0.0f);
  this->world_->AllReduce(max, ReduceOp::kMax);
  const std::vector<double> got = ValuesOf(max);
  EXPECT_TRUE(std::isnan(got[0]) && std::isnan(got[1]))
      << "a NaN on one rank must reach every rank, got " << got[0] << ", " << got[1];
  EXPECT_EQ(Bits(max)[2], k == 1 ? 0x8000 : 0x0000) << "max(-0, +0) is +0";
  EXPECT_EQ(Bits(max)[3], 0x0000) << "max(-0, +0) is +0";
  EXPECT_EQ(std::vector<double>(got.begin() + 4, got.end()), std::vector<double>(n - 4, -50.0));
}

TYPED_TEST(MpiCommunicatorHalfTest, ReduceScatterSumsOwnChunk) {
  using H = TypeParam;
  const int64_t n = 6;
  const int k = this->size_, r = this->rank_;
  // Rank q contributes (q + 1) (f mod 7 + 1) at flat position f: sums <= 36 * 7 = 252, exact.
  const Tensor in =
      FillHalf<H>(k * n, [&](int64_t f) { return (r + 1.0) * static_cast<double>(f % 7 + 1); });
  Tensor out = Tensor::HostZeros({n}, kDType<H>);
  this->world_->ReduceScatter(in, out);
  EXPECT_EQ(ValuesOf(out), Expected(n, [&](int64_t e) {
              return k * (k + 1) / 2.0 * static_cast<double>((r * n + e) % 7 + 1);
            }));
  Tensor other = Tensor::HostZeros(
      {n}, kDType<H> == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16);
  EXPECT_THROW(this->world_->ReduceScatter(in, other), std::invalid_argument);
}

TYPED_TEST(MpiCommunicatorHalfTest, AllGatherAndBroadcastMoveBits) {
  using H = TypeParam;
  const int64_t n = 5;
  const int k = this->size_;
  const Tensor in = Patterns(kDType<H>, this->rank_, n);
  Tensor out = Tensor::HostZeros({k, n}, kDType<H>);
  this->world_->AllGather(in, out);
  std::vector<uint16_t> expected;
  for (int q = 0; q < k; ++q) {
    for (int64_t e = 0; e < n; ++e) expected.push_back(PatternAt(q, e));
  }
  EXPECT_EQ(Bits(out), expected);

  const int64_t m = 64;  // every 0x0b11-th pattern: NaNs, infinities and both zeros' neighbours
  for (int root = 0; root < k; ++root) {
    Tensor buffer = this->rank_ == root ? Patterns(kDType<H>, root, m)
                                        : Tensor::HostZeros({m}, kDType<H>);
    this->world_->Broadcast(buffer, root);
    EXPECT_EQ(Bits(buffer), Bits(Patterns(kDType<H>, root, m))) << "root " << root;
  }
}

// Inexact sums: every rank must still end with the same bits (the ops are commutative
// exactly), within the rounding bound of k - 1 additions of 16-bit partial sums. Sizes
// from a few elements to 128 KiB, so MPI's small- and large-message algorithms both run.
TYPED_TEST(MpiCommunicatorHalfTest, AllReduceSumIsBitIdenticalOnEveryRank) {
  using H = TypeParam;
  const int k = this->size_;
  const auto input = [](int q, int64_t e) {
    return 8.0 * UniformAt(17, static_cast<uint64_t>(q), static_cast<uint64_t>(e)) - 4.0;
  };
  for (int64_t n : {int64_t{37}, int64_t{1} << 16}) {
    SCOPED_TRACE(n);
    Tensor sum = FillHalf<H>(n, [&](int64_t e) { return input(this->rank_, e); });
    this->world_->AllReduce(sum, ReduceOp::kSum);

    // Each rank's result, gathered to all: rank q's copy must equal rank 0's, bit for bit.
    Tensor all = Tensor::HostZeros({k, n}, kDType<H>);
    this->world_->AllGather(sum, all);
    const std::vector<uint16_t> bits = Bits(all);
    int64_t differ = 0;
    for (size_t f = static_cast<size_t>(n); f < bits.size(); ++f) {
      if (bits[f] != bits[f % static_cast<size_t>(n)]) ++differ;
    }
    EXPECT_EQ(differ, 0) << "elements whose bits differ from rank 0's";

    // Each of the k - 1 roundings errs by at most u |partial sum| <= u sum_q |x_q|.
    const std::vector<double> got = ValuesOf(sum);
    int64_t bad = 0;
    for (int64_t e = 0; e < n; ++e) {
      double exact = 0, magnitude = 0;
      for (int q = 0; q < k; ++q) {
        const double x = ToFloat(FromFloat<H>(static_cast<float>(input(q, e))));
        exact += x;
        magnitude += std::fabs(x);
      }
      if (!(std::fabs(got[static_cast<size_t>(e)] - exact) <= (k - 1) * kHalfU<H> * magnitude)) {
        ++bad;
      }
    }
    EXPECT_EQ(bad, 0) << "elements outside the rounding bound";
  }
}

// --- point-to-point ---------------------------------------------------------------------

// Rank q's message of n elements of `dtype`: small integers for float32/float64 (exact), and
// arbitrary bit patterns (NaNs included) for the 16-bit dtypes, which must arrive bit for bit.
Tensor Message(DType dtype, int q, int64_t n) {
  if (IsHalf(dtype)) return Patterns(dtype, q, n);
  Tensor t = Tensor::HostZeros({n}, dtype);
  for (int64_t e = 0; e < n; ++e) {
    SetHostValue(t, e, 1000.0 * (q + 1) + static_cast<double>(e % 997));
  }
  return t;
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.bytes() == b.bytes() &&
         std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

// Every dtype, a short message and one past the eager limit (128 KiB and more: the rendezvous
// protocol, where Send waits for the matching Recv).
class MpiCommunicatorP2pTest : public ::testing::TestWithParam<DType> {
 protected:
  std::unique_ptr<MpiCommunicator> world_ = MpiCommunicator::World();
  int rank_ = WorldRank();
  int size_ = WorldSize();
};
INSTANTIATE_TEST_SUITE_P(AllDTypes, MpiCommunicatorP2pTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                                           DType::kFloat16),
                         [](const ::testing::TestParamInfo<DType>& dtype) {
                           return std::string(DTypeName(dtype.param));
                         });

// Pairs (2g, 2g + 1): the even rank sends and then receives, the odd one the other way round,
// so both directions are checked.
TEST_P(MpiCommunicatorP2pTest, RoundTripsBetweenPairs) {
  const DType dtype = GetParam();
  const int partner = rank_ ^ 1;
  if (partner >= size_) GTEST_SKIP() << "no partner for rank " << rank_;
  for (int64_t n : {int64_t{7}, int64_t{1} << 17}) {
    SCOPED_TRACE(n);
    const Tensor mine = Message(dtype, rank_, n);
    Tensor got = Tensor::HostZeros({n}, dtype);
    if (rank_ % 2 == 0) {
      world_->Send(mine, partner);
      world_->Recv(got, partner);
    } else {
      world_->Recv(got, partner);
      world_->Send(mine, partner);
    }
    ASSERT_TRUE(SameBytes(got, Message(dtype, partner, n))) << "from rank " << partner;
  }
}

// A ring: rank r sends to r + 1 and receives from r - 1 (even ranks send first, odd ranks
// receive first, so blocking sends never wait in a cycle); several messages in a row arrive
// in order.
TEST_P(MpiCommunicatorP2pTest, RingDeliversInOrder) {
  const DType dtype = GetParam();
  if (size_ % 2 != 0) GTEST_SKIP() << "the ring needs an even number of ranks";
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  const int64_t n = 1000;
  for (int round = 0; round < 3; ++round) {
    const Tensor mine = Message(dtype, rank_ + 10 * round, n);
    Tensor got = Tensor::HostZeros({n}, dtype);
    if (rank_ % 2 == 0) {
      world_->Send(mine, next);
      world_->Recv(got, prev);
    } else {
      world_->Recv(got, prev);
      world_->Send(mine, next);
    }
    EXPECT_TRUE(SameBytes(got, Message(dtype, prev + 10 * round, n))) << "round " << round;
  }
}

TEST_P(MpiCommunicatorP2pTest, RefusesPeersOutsideTheGroupAndItself) {
  Tensor buffer = Tensor::HostZeros({3}, GetParam());
  for (int peer : {-1, size_, rank_}) {
    EXPECT_THROW(world_->Send(buffer, peer), std::invalid_argument) << peer;
    EXPECT_THROW(world_->Recv(buffer, peer), std::invalid_argument) << peer;
  }
  EXPECT_THROW(world_->Send(Tensor(), (rank_ + 1) % size_), std::invalid_argument);
}

// Batched: every rank sends to both ring neighbours and receives from both in one batch,
// large messages (rendezvous: a send completes only once its receive is posted), the sends
// listed first. Done one message at a time in that order, every rank would wait in its
// first send; posted together, the batch completes. Several batches in a row keep their
// order, and a trace records each message with its peer and bytes.
TEST_P(MpiCommunicatorP2pTest, BatchSendRecvExchangesWithBothNeighbours) {
  const DType dtype = GetParam();
  if (size_ < 2) GTEST_SKIP() << "needs two ranks";
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  const int64_t n = int64_t{1} << 17;
  CommTrace trace;
  TracedCommunicator traced(MpiCommunicator::World(), "pp", &trace);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    const Tensor to_next = Message(dtype, 2 * rank_ + 20 * round, n);
    const Tensor to_prev = Message(dtype, 2 * rank_ + 1 + 20 * round, n);
    Tensor from_prev = Tensor::HostZeros({n}, dtype);
    Tensor from_next = Tensor::HostZeros({n}, dtype);
    traced.BatchSendRecv({{P2POp::Kind::kSend, to_next, next},
                          {P2POp::Kind::kSend, to_prev, prev},
                          {P2POp::Kind::kRecv, from_prev, prev},
                          {P2POp::Kind::kRecv, from_next, next}});
    // With 2 ranks next == prev: the neighbour's two messages match this rank's two
    // receives in the order both sides list them.
    EXPECT_TRUE(SameBytes(from_prev, Message(dtype, 2 * prev + 20 * round, n)));
    EXPECT_TRUE(SameBytes(from_next, Message(dtype, 2 * next + 1 + 20 * round, n)));
  }
  ASSERT_EQ(trace.records().size(), 8u);
  const CommRecord& first = trace.records()[0];
  EXPECT_EQ(first.op, CommOpKind::kSend);
  EXPECT_EQ(first.peer, next);
  EXPECT_EQ(first.group, "pp");
  EXPECT_EQ(first.bytes, n * static_cast<int64_t>(DTypeSize(dtype)));
  EXPECT_EQ(trace.records()[3].op, CommOpKind::kRecv);
  EXPECT_EQ(trace.records()[3].peer, next);
  // An empty batch is allowed and does nothing.
  world_->BatchSendRecv({});
}

// Posted sends left in flight while the rank waits for a receive: both partners post a
// rendezvous-sized send, then each waits for the other's message, then for its own send.
// Messages with different tags are received in another order than they were sent.
TEST_P(MpiCommunicatorP2pTest, PostedSendsAndTagsLetPartnersReceiveInAnyOrder) {
  const DType dtype = GetParam();
  const int partner = rank_ ^ 1;
  if (partner >= size_) GTEST_SKIP() << "no partner for rank " << rank_;
  const int64_t n = int64_t{1} << 17;
  const Tensor first = Message(dtype, 2 * rank_, n);
  const Tensor second = Message(dtype, 2 * rank_ + 1, n);
  std::unique_ptr<PendingP2P> sends = world_->PostSendRecv(
      {{P2POp::Kind::kSend, first, partner, 7}, {P2POp::Kind::kSend, second, partner, 9}});
  Tensor got_second = Tensor::HostZeros({n}, dtype);
  Tensor got_first = Tensor::HostZeros({n}, dtype);
  world_->BatchSendRecv({{P2POp::Kind::kRecv, got_second, partner, 9}});
  world_->BatchSendRecv({{P2POp::Kind::kRecv, got_first, partner, 7}});
  sends->Wait();
  EXPECT_TRUE(SameBytes(got_first, Message(dtype, 2 * partner, n)));
  EXPECT_TRUE(SameBytes(got_second, Message(dtype, 2 * partner + 1, n)));
  EXPECT_THROW(world_->PostSendRecv({{P2POp::Kind::kSend, first, partner, 32768}}),
               std::invalid_argument);
}

TEST_P(MpiCommunicatorP2pTest, BatchSendRecvRefusesBadPeersAndBuffers) {
  const Tensor buffer = Tensor::HostZeros({3}, GetParam());
  for (int peer : {-1, size_, rank_}) {
    EXPECT_THROW(world_->BatchSendRecv({{P2POp::Kind::kSend, buffer, peer}}), std::invalid_argument)
        << peer;
    EXPECT_THROW(world_->BatchSendRecv({{P2POp::Kind::kRecv, buffer, peer}}), std::invalid_argument)
        << peer;
  }
  EXPECT_THROW(world_->BatchSendRecv({{P2POp::Kind::kSend, Tensor(), (rank_ + 1) % size_}}),
               std::invalid_argument);
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
      for (double v : ValuesOf(members)) gathered.push_back(static_cast<int64_t>(v));
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
  EXPECT_EQ(ValuesOf(members), expected);
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
