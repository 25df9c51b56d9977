// Philox known answers, the statistics of UniformAt/NormalAt, and the layout invariance of
// initialisation: every sharding of a tensor reassembles into the same master tensor, bit for
// bit. Statistical bounds are about 5 standard errors wide, and the seeds are fixed, so the
// tests are deterministic.
#include "core/init.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numbers>
#include <set>
#include <string>
#include <vector>

#include "core/philox.h"
#include "core/sharding.h"

namespace mpusim {
namespace {

constexpr uint64_t kSeed = 1234;

// Element `i` of a float32 or float64 host tensor, as a double.
double At(const Tensor& t, int64_t i) {
  const auto index = static_cast<size_t>(i);
  return t.dtype() == DType::kFloat32 ? static_cast<double>(t.data_as<float>()[index])
                                      : t.data_as<double>()[index];
}

double SumOfSquares(const Tensor& t) {
  double sum = 0;
  for (int64_t i = 0; i < t.numel(); ++i) sum += At(t, i) * At(t, i);
  return sum;
}

bool BitwiseEqual(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

Tensor Fill(std::string_view name, const InitSpec& init, const Shape& full, const ShardSpec& spec,
            DType dtype) {
  Tensor t = Tensor::HostZeros(LocalShape(spec, full), dtype);
  FillShard(kSeed, name, init, full, spec, t);
  return t;
}

// ---------------------------------------------------------------------------------------
// Philox and the streams built on it.

// Random123's kat_vectors for philox4x32_10. Our counter words are (lo32, hi32) of
// counter_lo then of counter_hi, and the key words (lo32, hi32) of key.
TEST(Philox, MatchesRandom123KnownAnswers) {
  struct Kat {
    uint32_t ctr[4];
    uint32_t key[2];
    uint32_t expected[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& kat : kats) {
    const uint64_t counter_lo = uint64_t{kat.ctr[1]} << 32 | kat.ctr[0];
    const uint64_t counter_hi = uint64_t{kat.ctr[3]} << 32 | kat.ctr[2];
    const uint64_t key = uint64_t{kat.key[1]} << 32 | kat.key[0];
    const PhiloxResult r = Philox4x32(counter_lo, counter_hi, key);
    for (int w = 0; w < 4; ++w) EXPECT_EQ(r.v[w], kat.expected[w]) << "word " << w;
  }
}

// Published FNV-1a 64-bit test vectors (Fowler, Noll, Vo).
TEST(StreamId, IsFnv1a64) {
  EXPECT_EQ(StreamId(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(StreamId("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(StreamId("foobar"), 0x85944171f73967e8ull);
  EXPECT_NE(StreamId("fc1.weight"), StreamId("fc2.weight"));
}

TEST(UniformAt, LiesInUnitIntervalWithUniformMoments) {
  constexpr int kN = 100000;
  double sum = 0, sum_sq = 0;
  for (int i = 0; i < kN; ++i) {
    const double u = UniformAt(kSeed, StreamId("uniform"), static_cast<uint64_t>(i));
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    sum_sq += u * u;
  }
  const double mean = sum / kN;
  // Standard errors: mean 0.29/sqrt(N) = 0.0009, variance 0.075/sqrt(N) = 0.00024.
  EXPECT_NEAR(mean, 0.5, 0.005);
  EXPECT_NEAR(sum_sq / kN - mean * mean, 1.0 / 12.0, 0.0015);
}

TEST(NormalAt, IsBoxMullerOnConsecutiveUniforms) {
  const uint64_t stream = StreamId("normal");
  for (uint64_t i : {0ull, 1ull, 17ull, 123456789ull}) {
    const double u1 = UniformAt(kSeed, stream, 2 * i);
    const double u2 = UniformAt(kSeed, stream, 2 * i + 1);
    EXPECT_EQ(NormalAt(kSeed, stream, i),
              std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(2.0 * std::numbers::pi * u2));
  }
}

TEST(NormalAt, HasStandardMoments) {
  constexpr int kN = 100000;
  double sum = 0, sum_sq = 0;
  for (int i = 0; i < kN; ++i) {
    const double x = NormalAt(kSeed, StreamId("normal"), static_cast<uint64_t>(i));
    ASSERT_TRUE(std::isfinite(x));
    sum += x;
    sum_sq += x * x;
  }
  const double mean = sum / kN;
  // Standard errors: mean 1/sqrt(N) = 0.0032, variance sqrt(2/N) = 0.0045.
  EXPECT_NEAR(mean, 0.0, 0.02);
  EXPECT_NEAR(sum_sq / kN - mean * mean, 1.0, 0.025);
}

// ---------------------------------------------------------------------------------------
// Master values.

TEST(InitMethod, ParsesTheThreeNamesAndRefusesOthers) {
  for (InitMethod method : {InitMethod::kXavierNormal, InitMethod::kNormal, InitMethod::kZeros}) {
    StatusOr<InitMethod> parsed = ParseInitMethod(InitMethodName(method), "x");
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, method);
  }
  StatusOr<InitMethod> bad = ParseInitMethod("foo", "layers[0].init_method");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().where(), "layers[0].init_method");
  EXPECT_EQ(bad.status().what(), "must be one of xavier_normal, normal, zeros, got 'foo'");
}

TEST(MasterValue, XavierUsesTorchFans) {
  const uint64_t stream = StreamId("w");
  const InitSpec xavier;
  struct Case {
    Shape shape;
    int64_t fan_sum;  // fan_in + fan_out
  };
  const Case cases[] = {
      {{6, 10}, 16},        // [out, in]
      {{7}, 14},            // 1-D: fan_in = fan_out = 7
      {{4, 6, 3, 5}, 150},  // receptive 15: fan_in 6*15, fan_out 4*15
  };
  for (const Case& c : cases) {
    const double sigma = std::sqrt(2.0 / static_cast<double>(c.fan_sum));
    for (int64_t f : {int64_t{0}, int64_t{3}, NumElements(c.shape) - 1}) {
      EXPECT_DOUBLE_EQ(MasterValue(kSeed, "w", xavier, c.shape, f),
                       sigma * NormalAt(kSeed, stream, static_cast<uint64_t>(f)))
          << ShapeString(c.shape) << " flat " << f;
    }
  }
  const InitSpec normal{InitMethod::kNormal, 0.5};
  EXPECT_EQ(MasterValue(kSeed, "w", normal, {6, 10}, 9), 0.5 * NormalAt(kSeed, stream, 9));
  EXPECT_THROW(MasterValue(kSeed, "w", normal, {6, 10}, 60), std::out_of_range);
}

TEST(MasterValue, XavierStdOnALargeMatrix) {
  const Shape full = {256, 768};
  const Tensor w = Fill("big.weight", InitSpec{}, full, ShardSpec{}, DType::kFloat64);
  const double expected = std::sqrt(2.0 / (256 + 768));
  // Relative standard error of a sample std: 1/sqrt(2N) = 0.16%.
  EXPECT_NEAR(std::sqrt(SumOfSquares(w) / static_cast<double>(w.numel())), expected,
              0.01 * expected);
}

TEST(MasterValue, NormalStdAndZeros) {
  const Shape full = {64, 1024};
  const Tensor n = Fill("n", InitSpec{InitMethod::kNormal, 0.02}, full, {}, DType::kFloat64);
  EXPECT_NEAR(std::sqrt(SumOfSquares(n) / static_cast<double>(n.numel())), 0.02, 0.0004);

  // The output is not assumed to start zeroed.
  Tensor z = Tensor::HostZeros(full, DType::kFloat32);
  std::memset(z.data(), 0xff, z.bytes());
  FillShard(kSeed, "b", InitSpec{InitMethod::kZeros}, full, {}, z);
  const Tensor zeros = Tensor::HostZeros(full, DType::kFloat32);
  EXPECT_TRUE(BitwiseEqual(z, zeros));  // +0.0, never -0.0
  EXPECT_EQ(MasterValue(kSeed, "b", InitSpec{InitMethod::kZeros}, full, 5), 0.0);
}

TEST(FillShard, RoundsMasterValuesOnceToFloat32) {
  const Shape full = {5, 6};
  const InitSpec spec;
  const Tensor f32 = Fill("w", spec, full, {}, DType::kFloat32);
  const Tensor f64 = Fill("w", spec, full, {}, DType::kFloat64);
  ASSERT_GT(SumOfSquares(f64), 0);
  for (int64_t i = 0; i < f32.numel(); ++i) {
    const double master = MasterValue(kSeed, "w", spec, full, i);
    EXPECT_EQ(At(f64, i), master);
    EXPECT_EQ(At(f32, i), static_cast<double>(static_cast<float>(master)));
  }
}

// A split over tp along `dim` (tp rank `index`).
ShardSpec Tp(int dim, int64_t shards, int64_t index = 0, int64_t stride = 1) {
  ShardSpec s;
  s.Split(ShardAxis::kTp, dim, shards, index, stride);
  return s;
}

// Every piece of `layout` (whatever its indices say): one spec per combination of indices.
std::vector<ShardSpec> AllPieces(const ShardSpec& layout) {
  std::vector<ShardSpec> pieces;
  ShardSpec piece = layout;
  for (Placement& p : piece.placements) p.index = 0;
  while (true) {
    pieces.push_back(piece);
    size_t i = piece.placements.size();
    while (i > 0) {
      Placement& p = piece.placements[i - 1];
      if (++p.index < p.shards) break;
      p.index = 0;
      --i;
    }
    if (i == 0) return pieces;
  }
}

TEST(FillShard, RefusesBadLayoutsAndOutputs) {
  const Shape full = {12, 8};
  Tensor out = Tensor::HostZeros({12, 3}, DType::kFloat32);
  // 8 columns do not split into 3 shards.
  EXPECT_THROW(FillShard(kSeed, "w", {}, full, Tp(1, 3), out), std::invalid_argument);
  // The local shape of a 2-way column split is [12, 4].
  EXPECT_THROW(FillShard(kSeed, "w", {}, full, Tp(1, 2), out), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------
// Layout invariance.

TEST(Sharding, StrideExampleFromTheHeader) {
  // F = 8, 2 shards, stride 2: chunks of 2, shard 0 holds [0 1 4 5], shard 1 [2 3 6 7].
  const std::vector<std::vector<int64_t>> expected = {{0, 1, 4, 5}, {2, 3, 6, 7}};
  const Shape full = {3, 8};
  const Tensor master = Fill("w", InitSpec{}, full, {}, DType::kFloat64);
  for (int64_t r = 0; r < 2; ++r) {
    const ShardSpec spec = Tp(1, 2, r, 2);
    ASSERT_EQ(LocalShape(spec, full), (Shape{3, 4}));
    const Tensor shard = Fill("w", InitSpec{}, full, spec, DType::kFloat64);
    for (int64_t l = 0; l < 4; ++l) {
      const int64_t g = expected[static_cast<size_t>(r)][static_cast<size_t>(l)];
      EXPECT_EQ(GlobalIndex(spec, 1, 8, l), g);
      for (int64_t row = 0; row < 3; ++row) {
        EXPECT_EQ(At(shard, row * 4 + l), At(master, row * 8 + g)) << "shard " << r;
      }
    }
  }
}

// Fills every shard of `layout` (its indices ignored) and reassembles them.
StatusOr<Tensor> FillAndAssemble(std::string_view name, const Shape& full, const ShardSpec& layout,
                                 DType dtype, const InitSpec& init = InitSpec{}) {
  std::vector<Tensor> shards;
  const std::vector<ShardSpec> specs = AllPieces(layout);
  for (const ShardSpec& spec : specs) shards.push_back(Fill(name, init, full, spec, dtype));
  return AssembleFull(shards, specs, full);
}

TEST(Sharding, EveryModelSplitReassemblesToTheMasterTensor) {
  const Shape full = {12, 8};
  int checked = 0;
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    const Tensor master = Fill("fc.weight", InitSpec{}, full, {}, dtype);
    ASSERT_GT(SumOfSquares(master), 0);
    for (int dim : {0, 1}) {
      for (int64_t num_shards : {1, 2, 4}) {
        for (int64_t stride : {1, 2}) {
          if (full[static_cast<size_t>(dim)] % (num_shards * stride) != 0) continue;
          const ShardSpec layout = Tp(dim, num_shards, 0, stride);
          StatusOr<Tensor> assembled = FillAndAssemble("fc.weight", full, layout, dtype);
          ASSERT_TRUE(assembled.ok()) << assembled.status().Message();
          EXPECT_TRUE(BitwiseEqual(*assembled, master))
              << DTypeName(dtype) << " dim " << dim << " shards " << num_shards << " stride "
              << stride;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * (5 + 6));  // dim 0 skips 4 shards * stride 2 (12 % 8 != 0)
}

TEST(Sharding, DataParallelBatchSplitReassembles) {
  // [s, B, h] = [4, 6, 8] activations: batch split alone, with a hidden split (stride 2), and
  // with a sequence split.
  const Shape full = {4, 6, 8};
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    const Tensor master = Fill("input.mb0", InitSpec{InitMethod::kNormal, 1.0}, full, {}, dtype);
    ASSERT_GT(SumOfSquares(master), 0);
    for (int64_t batch_shards : {1, 2, 3, 6}) {
      for (const ShardSpec& tp : {ShardSpec{}, Tp(2, 2, 0, 2), Tp(0, 4)}) {
        ShardSpec layout;
        layout.Split(ShardAxis::kDp, 1, batch_shards, 0);
        layout.placements.insert(layout.placements.end(), tp.placements.begin(),
                                 tp.placements.end());
        StatusOr<Tensor> assembled =
            FillAndAssemble("input.mb0", full, layout, dtype, InitSpec{InitMethod::kNormal, 1.0});
        ASSERT_TRUE(assembled.ok()) << assembled.status().Message();
        EXPECT_TRUE(BitwiseEqual(*assembled, master)) << LayoutString(layout);
      }
    }
  }
}

TEST(Sharding, DataParallelRankHoldsItsContiguousSamples) {
  // d = 3, b = 2: dp rank 1 holds global samples 2 and 3 of every sequence position.
  const Shape full = {4, 6, 8};
  const InitSpec spec{InitMethod::kNormal, 1.0};
  const Tensor master = Fill("x", spec, full, {}, DType::kFloat64);
  ShardSpec dp1;
  dp1.Split(ShardAxis::kDp, 1, 3, 1);
  const Tensor shard = Fill("x", spec, full, dp1, DType::kFloat64);
  ASSERT_EQ(shard.shape(), (Shape{4, 2, 8}));
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t g = 0; g < 2; ++g) {
      for (int64_t h = 0; h < 8; ++h) {
        EXPECT_EQ(At(shard, (i * 2 + g) * 8 + h), At(master, (i * 6 + 2 + g) * 8 + h));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Reassembly errors.

TEST(AssembleFull, RefusesMissingCoverage) {
  const Shape full = {12, 8};
  const ShardSpec shard0 = Tp(1, 2, 0, 2);
  StatusOr<Tensor> result =
      AssembleFull({Fill("w", {}, full, shard0, DType::kFloat32)}, {shard0}, full);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().Message(),
            "element [0, 2] of [12, 8] is covered by no shard (48 of 96 elements missing)");
}

TEST(AssembleFull, RefusesMismatchedShards) {
  const Shape full = {12, 8};
  const ShardSpec s0 = Tp(0, 2, 0);
  const ShardSpec s1 = Tp(0, 2, 1);
  const Tensor t0 = Fill("w", {}, full, s0, DType::kFloat32);
  const Tensor t1 = Fill("w", {}, full, s1, DType::kFloat32);
  ASSERT_TRUE(AssembleFull({t0, t1}, {s0, s1}, full).ok());

  auto refusal = [&](const std::vector<Tensor>& shards, const std::vector<ShardSpec>& specs) {
    StatusOr<Tensor> result = AssembleFull(shards, specs, full);
    return result.ok() ? std::string("accepted") : result.status().Message();
  };
  EXPECT_EQ(refusal({t0, Tensor::HostZeros({12, 4}, DType::kFloat32)}, {s0, s1}),
            "shards[1]: shape [12, 4] must be [6, 8], the local shape of [12, 8] under its spec");
  EXPECT_EQ(refusal({t0, Tensor::HostZeros({6, 8}, DType::kFloat64)}, {s0, s1}),
            "shards[1]: dtype float64 differs from shards[0] (float32)");
  EXPECT_EQ(refusal({t0, t1}, {s0}), "2 shards but 1 specs");
  EXPECT_EQ(refusal({}, {}), "no shards to assemble");
  EXPECT_EQ(refusal({t0, Tensor()}, {s0, s1}), "shards[1]: must be a defined host tensor");

  const ShardSpec four_way = Tp(0, 4, 1);
  EXPECT_EQ(refusal({t0, Fill("w", {}, full, four_way, DType::kFloat32)}, {s0, four_way}),
            "shards[1]: layout (tp: dim 0, 4 shards) differs from shards[0] (tp: dim 0, 2 "
            "shards)");

  ShardSpec dp_first;  // the same two splits in the other order
  dp_first.Split(ShardAxis::kDp, 1, 2, 0).Split(ShardAxis::kTp, 0, 2, 0);
  ShardSpec tp_first;
  tp_first.Split(ShardAxis::kTp, 0, 2, 0).Split(ShardAxis::kDp, 1, 2, 0);
  EXPECT_EQ(refusal({Fill("w", {}, full, dp_first, DType::kFloat32),
                     Fill("w", {}, full, tp_first, DType::kFloat32)},
                    {dp_first, tp_first}),
            "shards[1]: layout (tp: dim 0, 2 shards; dp: dim 1, 2 shards) differs from "
            "shards[0] (dp: dim 1, 2 shards; tp: dim 0, 2 shards)");

  ShardSpec out_of_range = s1;
  out_of_range.placements[0].index = 2;
  EXPECT_EQ(refusal({t0, t1}, {s0, out_of_range}),
            "shards[1]: placement 0 (tp): index 2 is outside [0, 2)");
}

TEST(AssembleFull, AcceptsIdenticalReplicasAndRefusesDisagreeingOnes) {
  // A weight replicated over two dp ranks and split over two tp ranks: four shards.
  const Shape full = {4, 6};
  const ShardSpec s0 = Tp(1, 2, 0);
  const ShardSpec s1 = Tp(1, 2, 1);
  const Tensor t0 = Fill("w", {}, full, s0, DType::kFloat64);
  const Tensor t1 = Fill("w", {}, full, s1, DType::kFloat64);
  StatusOr<Tensor> ok = AssembleFull({t0, t1, t0, t1}, {s0, s1, s0, s1}, full);
  ASSERT_TRUE(ok.ok()) << ok.status().Message();
  EXPECT_TRUE(BitwiseEqual(*ok, Fill("w", {}, full, {}, DType::kFloat64)));

  Tensor bad = Tensor::HostZeros(t1.shape(), DType::kFloat64);
  std::memcpy(bad.data(), t1.data(), t1.bytes());
  bad.data_as<double>()[4] = 0.5;  // local [1, 1] -> global [1, 4]
  StatusOr<Tensor> refused = AssembleFull({t0, t1, t0, bad}, {s0, s1, s0, s1}, full);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().where(), "shards[3]");
  EXPECT_NE(refused.status().what().find("element [1, 4] of [4, 6] is 0.5 here"), std::string::npos)
      << refused.status().what();
}

// ---------------------------------------------------------------------------------------
// Synthetic tokens.

TEST(TokenAt, StaysInRangeAndUsesEveryId) {
  for (int64_t vocab : {int64_t{1}, int64_t{7}, int64_t{50257}}) {
    std::set<int64_t> seen;
    for (int64_t i = 0; i < 2000; ++i) {
      const int64_t token = TokenAt(kSeed, "tokens.mb0", i, vocab);
      ASSERT_GE(token, 0);
      ASSERT_LT(token, vocab);
      EXPECT_EQ(token, TokenAt(kSeed, "tokens.mb0", i, vocab));  // a pure function
      seen.insert(token);
    }
    if (vocab <= 7) {
      EXPECT_EQ(static_cast<int64_t>(seen.size()), vocab);
    }
  }
  // Tokens and labels are different streams.
  int same = 0;
  for (int64_t i = 0; i < 100; ++i) {
    same += TokenAt(kSeed, "tokens.mb0", i, 50257) == TokenAt(kSeed, "labels.mb0", i, 50257);
  }
  EXPECT_LT(same, 5);
  EXPECT_THROW(TokenAt(kSeed, "tokens.mb0", 0, 0), std::invalid_argument);
}

}  // namespace
}  // namespace mpusim
