// EigenKernels against naive loops, for float32 and float64, then for bfloat16 and float16.
//
// float32/float64: inputs are small integers (Philox-drawn, fixed keys), so sums and
// products are exact in both dtypes and most results are compared with EXPECT_EQ-strength
// checks (TensorsEqual). Only GELU and the exp-based cross-entropy pieces get tolerances,
// because std::erf/std::exp and Eigen's vectorised exp may differ from the double-precision
// reference by a few ulp.
//
// bfloat16/float16: inputs are Philox reals rounded to the 16-bit dtype, so they use every
// mantissa bit; the reference is float64 arithmetic on the widened inputs. A kernel computes
// in float32 and rounds each stored element once, so its error is at most half a 16-bit ulp
// of the exact value (the rounding) plus the float32 arithmetic's own error, which each test
// bounds separately (gamma_K = K * 2^-24 for sums of K terms). Half an ulp, not one, so a
// truncating or twice-rounding kernel fails.
//
// The model kernels (BatchedGemm, causal softmax, Rope, StridedCopy, DropoutAt; last part of
// the file): one typed suite over all four dtypes against naive float64 loops on the stored
// inputs, with the tolerances explained there, plus the norm backward formulas against
// finite differences. The activations and the norms are in the op tables of tests/ops, which
// every backend runs.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numbers>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/dropout.h"
#include "core/half.h"
#include "core/philox.h"
#include "core/tensor.h"
#include "sim/eigen_kernels.h"
#include "tests/kernel_test_util.h"

namespace mpusim {
namespace {

// Integer in [lo, hi], element e of Philox stream `key`.
double IntAt(uint64_t key, int64_t e, int lo, int hi) {
  const double u = UniformAt(key, 7, static_cast<uint64_t>(e));
  return lo + std::floor(u * (hi - lo + 1));
}

std::vector<double> Ints(uint64_t key, int64_t n, int lo = -4, int hi = 4) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) v[static_cast<size_t>(e)] = IntAt(key, e, lo, hi);
  return v;
}

template <typename T>
class EigenKernelsTest : public ::testing::Test {
 protected:
  EigenKernels k_;
};
using DTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(EigenKernelsTest, DTypes);

// --- memory ---------------------------------------------------------------------------

TYPED_TEST(EigenKernelsTest, ZerosToDeviceToHostCopy) {
  using T = TypeParam;
  Tensor z = this->k_.Zeros({3, 4}, kDType<T>);
  EXPECT_EQ(z.shape(), (Shape{3, 4}));
  EXPECT_EQ(z.dtype(), kDType<T>);
  EXPECT_EQ(z.device(), Device::kHost);
  EXPECT_TRUE(TensorsNear("zeros", ValuesOf(z), std::vector<double>(12, 0.0)));
  EXPECT_THROW(this->k_.Zeros({2, -1}, kDType<T>), std::invalid_argument);

  const std::vector<double> v = Ints(1, 12);
  ASSERT_GT(Norm(v), 0);
  const Tensor host = Make<T>({3, 4}, v);
  Tensor dev = this->k_.ToDevice(host);
  EXPECT_NE(dev.data(), host.data());
  EXPECT_EQ(dev.shape(), host.shape());
  EXPECT_TRUE(TensorsNear("to_device", ValuesOf(dev), v));
  Tensor back = this->k_.ToHost(dev);
  EXPECT_NE(back.data(), dev.data());
  EXPECT_TRUE(TensorsNear("to_host", ValuesOf(back), v));

  Tensor dst = Make<T>({4, 3}, std::vector<double>(12, 9.0));
  this->k_.Copy(host, dst);
  EXPECT_TRUE(TensorsNear("copy", ValuesOf(dst), v));
  Tensor wrong = this->k_.Zeros({5}, kDType<T>);
  EXPECT_THROW(this->k_.Copy(host, wrong), std::invalid_argument);

  const void* storage = dst.data();
  this->k_.SetZero(dst);
  EXPECT_EQ(dst.data(), storage);
  EXPECT_TRUE(TensorsNear("set_zero", ValuesOf(dst), std::vector<double>(12, 0.0)));
  Tensor undefined;
  EXPECT_THROW(this->k_.SetZero(undefined), std::invalid_argument);
}

TYPED_TEST(EigenKernelsTest, CopyBlock) {
  using T = TypeParam;
  const std::vector<double> sv = Ints(2, 5 * 6);
  const Tensor src = Make<T>({5, 6}, sv);
  const std::vector<double> dv = Ints(3, 4 * 7);
  Tensor dst = Make<T>({2, 2, 7}, dv);  // 2-D view 4 x 7
  this->k_.CopyBlock(src, 1, 2, dst, 0, 3, 3, 4);
  std::vector<double> expected = dv;
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 4; ++j)
      expected[static_cast<size_t>((0 + i) * 7 + 3 + j)] =
          sv[static_cast<size_t>((1 + i) * 6 + 2 + j)];
  }
  EXPECT_TRUE(TensorsNear("copy_block", ValuesOf(dst), expected));

  // Overlapping blocks of one tensor behave as if the source were read first.
  Tensor self = Make<T>({5, 6}, sv);
  this->k_.CopyBlock(self, 0, 0, self, 1, 1, 4, 5);
  std::vector<double> shifted = sv;
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 5; ++j)
      shifted[static_cast<size_t>((1 + i) * 6 + 1 + j)] = sv[static_cast<size_t>(i * 6 + j)];
  }
  EXPECT_TRUE(TensorsNear("copy_block_overlap", ValuesOf(self), shifted));

  EXPECT_THROW(this->k_.CopyBlock(src, 3, 0, dst, 0, 0, 3, 2), std::invalid_argument);
  EXPECT_THROW(this->k_.CopyBlock(src, 0, 0, dst, 0, 5, 1, 3), std::invalid_argument);
  EXPECT_THROW(this->k_.CopyBlock(src, 0, 0, dst, 0, 0, -1, 3), std::invalid_argument);
}

// --- dense algebra --------------------------------------------------------------------

std::vector<double> NaiveGemm(bool ta, bool tb, double alpha, const std::vector<double>& a,
                              const std::vector<double>& b, double beta, std::vector<double> c,
                              int64_t m, int64_t n, int64_t k) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l) {
        const double av =
            ta ? a[static_cast<size_t>(l * m + i)] : a[static_cast<size_t>(i * k + l)];
        const double bv =
            tb ? b[static_cast<size_t>(j * k + l)] : b[static_cast<size_t>(l * n + j)];
        s += av * bv;
      }
      double& cv = c[static_cast<size_t>(i * n + j)];
      cv = alpha * s + (beta == 0 ? 0 : beta * cv);
    }
  }
  return c;
}

template <typename T>
void CheckGemm(EigenKernels& kernels, int64_t m, int64_t n, int64_t k) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (double alpha : {1.0, -2.0, 0.5}) {
        for (double beta : {0.0, 1.0, 3.0}) {
          const std::vector<double> av = Ints(10, m * k), bv = Ints(11, k * n),
                                    cv = Ints(12, m * n);
          const Tensor a = Make<T>(ta ? Shape{k, m} : Shape{m, k}, av);
          const Tensor b = Make<T>(tb ? Shape{n, k} : Shape{k, n}, bv);
          Tensor c = Make<T>({m, n}, cv);
          kernels.Gemm(ta, tb, alpha, a, b, beta, c);
          const std::vector<double> expected = NaiveGemm(ta, tb, alpha, av, bv, beta, cv, m, n, k);
          ASSERT_GT(Norm(expected), 0);
          EXPECT_TRUE(TensorsNear(fmt::format("gemm {}x{}x{} ta={} tb={} alpha={} beta={}", m, n, k,
                                              ta, tb, alpha, beta),
                                  ValuesOf(c), expected));
        }
      }
    }
  }
}

TYPED_TEST(EigenKernelsTest, GemmSmallAllTransposes) { CheckGemm<TypeParam>(this->k_, 5, 7, 6); }

// Large enough for Eigen's blocked, packed GEMM path; |partial sums| <= 80 * 16 stay exact.
TYPED_TEST(EigenKernelsTest, GemmBlockedAllTransposes) {
  CheckGemm<TypeParam>(this->k_, 70, 65, 80);
}

TYPED_TEST(EigenKernelsTest, GemmBetaZeroOverwritesNaN) {
  using T = TypeParam;
  const Tensor a = Make<T>({2, 3}, Ints(20, 6));
  const Tensor b = Make<T>({3, 2}, Ints(21, 6));
  Tensor c = Make<T>({2, 2}, std::vector<double>(4, std::numeric_limits<double>::quiet_NaN()));
  this->k_.Gemm(false, false, 1.0, a, b, 0.0, c);
  EXPECT_TRUE(TensorsNear("gemm beta=0", ValuesOf(c),
                          NaiveGemm(false, false, 1, Ints(20, 6), Ints(21, 6), 0,
                                    std::vector<double>(4, 0.0), 2, 2, 3)));
}

TYPED_TEST(EigenKernelsTest, GemmRejectsBadArguments) {
  using T = TypeParam;
  const Tensor a = Make<T>({2, 3}, Ints(20, 6));
  const Tensor b = Make<T>({3, 2}, Ints(21, 6));
  Tensor c = this->k_.Zeros({2, 2}, kDType<T>);
  Tensor c_wrong = this->k_.Zeros({2, 3}, kDType<T>);
  EXPECT_THROW(this->k_.Gemm(false, false, 1, a, b, 0, c_wrong), std::invalid_argument);
  EXPECT_THROW(this->k_.Gemm(true, false, 1, a, b, 0, c), std::invalid_argument);
  Tensor other =
      this->k_.Zeros({3, 2}, kDType<T> == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32);
  EXPECT_THROW(this->k_.Gemm(false, false, 1, a, other, 0, c), std::invalid_argument);
  Tensor square = Make<T>({2, 2}, Ints(22, 4));
  EXPECT_THROW(this->k_.Gemm(false, false, 1, square, square, 0, square), std::invalid_argument);
  // A tensor that claims to live on a GPU (its storage is host memory, never touched).
  auto storage = std::make_shared<std::vector<double>>(6);
  Tensor on_gpu(Shape{3, 2}, kDType<T>, Device::kCuda,
                std::shared_ptr<void>(storage, storage->data()));
  try {
    this->k_.Gemm(false, false, 1, a, on_gpu, 0, c);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("Gemm"), std::string::npos) << e.what();
  }
}

TYPED_TEST(EigenKernelsTest, AddRowVectorSumRowsAxpyScale) {
  using T = TypeParam;
  const int64_t r = 6, c = 5;
  const std::vector<double> xv = Ints(30, r * c), bv = Ints(31, c), ov = Ints(32, c);

  Tensor y = Make<T>({2, 3, c}, xv);
  this->k_.AddRowVector(Make<T>({c}, bv), y);
  std::vector<double> expected = xv;
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < c; ++j)
      expected[static_cast<size_t>(i * c + j)] += bv[static_cast<size_t>(j)];
  }
  EXPECT_TRUE(TensorsNear("add_row_vector", ValuesOf(y), expected));
  EXPECT_THROW(this->k_.AddRowVector(Make<T>({c + 1}, Ints(1, c + 1)), y), std::invalid_argument);

  for (double beta : {0.0, 1.0, 2.0}) {
    Tensor out = Make<T>({c}, ov);
    this->k_.SumRows(Make<T>({r, c}, xv), beta, out);
    std::vector<double> sums(static_cast<size_t>(c));
    for (int64_t j = 0; j < c; ++j) {
      double s = 0;
      for (int64_t i = 0; i < r; ++i) s += xv[static_cast<size_t>(i * c + j)];
      sums[static_cast<size_t>(j)] = beta * ov[static_cast<size_t>(j)] + s;
    }
    ASSERT_GT(Norm(sums), 0);
    EXPECT_TRUE(TensorsNear(fmt::format("sum_rows beta={}", beta), ValuesOf(out), sums));
  }

  Tensor ay = Make<T>({r, c}, Ints(33, r * c));
  const std::vector<double> yv = ValuesOf(ay);
  this->k_.Axpy(-1.5, Make<T>({r * c}, xv), ay);
  std::vector<double> axpy(yv.size());
  for (size_t e = 0; e < yv.size(); ++e) axpy[e] = yv[e] - 1.5 * xv[e];
  EXPECT_TRUE(TensorsNear("axpy", ValuesOf(ay), axpy));
  EXPECT_THROW(this->k_.Axpy(1, Make<T>({3}, Ints(1, 3)), ay), std::invalid_argument);

  Tensor s = Make<T>({r, c}, xv);
  this->k_.Scale(0.25, s);
  std::vector<double> scaled(xv.size());
  for (size_t e = 0; e < xv.size(); ++e) scaled[e] = 0.25 * xv[e];
  EXPECT_TRUE(TensorsNear("scale", ValuesOf(s), scaled));
}

// --- elementwise ----------------------------------------------------------------------

// Results through exp or erf: a few ulp of the dtype.
template <typename T>
constexpr double kUlpTol = std::is_same_v<T, float> ? 2e-6 : 1e-14;

template <typename T>
std::vector<double> NaiveDropout(const std::vector<double>& x, double p, uint64_t key,
                                 uint64_t stream, uint64_t offset) {
  std::vector<double> y(x.size());
  for (size_t e = 0; e < x.size(); ++e) {
    const bool keep = UniformAt(key, stream, offset + e) >= p;
    y[e] = keep ? static_cast<double>(static_cast<T>(x[e]) / static_cast<T>(1 - p)) : 0.0;
  }
  return y;
}

TYPED_TEST(EigenKernelsTest, DropoutMatchesMaskAndWorksInPlace) {
  using T = TypeParam;
  const std::vector<double> xv = Ints(50, 200, 1, 9);  // nonzero: a zero would hide a drop
  for (double p : {0.25, 0.5, 0.9}) {
    const std::vector<double> expected = NaiveDropout<T>(xv, p, 1234, 3, 77);
    Tensor y = this->k_.Zeros({10, 20}, kDType<T>);
    this->k_.Dropout(Make<T>({10, 20}, xv), p, 1234, 3, 77, y);
    EXPECT_TRUE(TensorsNear(fmt::format("dropout p={}", p), ValuesOf(y), expected));
    Tensor x = Make<T>({10, 20}, xv);
    this->k_.Dropout(x, p, 1234, 3, 77, x);
    EXPECT_TRUE(TensorsNear(fmt::format("dropout in place p={}", p), ValuesOf(x), expected));
  }
  // A shard at offset 50 of a flat tensor gets the same mask as those elements of the whole.
  Tensor whole = this->k_.Zeros({200}, kDType<T>);
  this->k_.Dropout(Make<T>({200}, xv), 0.5, 9, 1, 0, whole);
  Tensor part = this->k_.Zeros({30}, kDType<T>);
  this->k_.Dropout(Make<T>({30}, std::vector<double>(xv.begin() + 50, xv.begin() + 80)), 0.5, 9, 1,
                   50, part);
  const std::vector<double> wv = ValuesOf(whole);
  EXPECT_TRUE(TensorsNear("dropout offset", ValuesOf(part),
                          std::vector<double>(wv.begin() + 50, wv.begin() + 80)));

  Tensor copy = this->k_.Zeros({200}, kDType<T>);
  this->k_.Dropout(Make<T>({200}, xv), 0.0, 1, 1, 0, copy);
  EXPECT_TRUE(TensorsNear("dropout p=0", ValuesOf(copy), xv));
  this->k_.Dropout(Make<T>({200}, xv), 1.0, 1, 1, 0, copy);
  EXPECT_TRUE(TensorsNear("dropout p=1", ValuesOf(copy), std::vector<double>(200, 0.0)));
  EXPECT_THROW(this->k_.Dropout(copy, 1.5, 1, 1, 0, copy), std::invalid_argument);
  EXPECT_THROW(this->k_.Dropout(copy, -0.1, 1, 1, 0, copy), std::invalid_argument);
  // The boundary: an element whose uniform equals p exactly is kept (u >= p), so with p set
  // to element 5's own draw, element 5 survives.
  const double u5 = UniformAt(1234, 3, 77 + 5);
  Tensor edge = this->k_.Zeros({10, 20}, kDType<T>);
  this->k_.Dropout(Make<T>({10, 20}, xv), u5, 1234, 3, 77, edge);
  EXPECT_NE(ValuesOf(edge)[5], 0.0) << "u == p must keep the element (u = " << u5 << ")";
}

TYPED_TEST(EigenKernelsTest, DropoutKeepRateAndScale) {
  using T = TypeParam;
  const int64_t n = 1 << 20;
  const double p = 0.3;
  Tensor x = Make<T>({n}, std::vector<double>(static_cast<size_t>(n), 1.0));
  this->k_.Dropout(x, p, 42, 5, 0, x);
  int64_t kept = 0;
  const T scale = static_cast<T>(1) / static_cast<T>(1 - p);
  const T* v = x.template data_as<T>();
  int64_t bad = 0;
  for (int64_t e = 0; e < n; ++e) {
    if (v[e] != 0) {
      ++kept;
      if (std::fabs(v[e] - scale) > 4 * std::numeric_limits<T>::epsilon()) ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << "kept elements must equal 1 / (1 - p)";
  // Binomial: standard deviation sqrt(p (1 - p) / n) ~ 4.5e-4; allow ~6.5 sigma.
  EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(n), 1 - p, 3e-3);
}

// --- embedding ------------------------------------------------------------------------

TYPED_TEST(EigenKernelsTest, EmbeddingForwardBackwardMask) {
  using T = TypeParam;
  const int64_t vocab_start = 4, vocab_end = 9, h = 3;  // this shard: tokens 4..8
  const std::vector<int64_t> ids = {4, 3, 8, 9, 6, 0, 6, 12};
  const std::vector<double> wv = Ints(60, (vocab_end - vocab_start) * h);
  const Tensor weight = Make<T>({vocab_end - vocab_start, h}, wv);
  Tensor out = Make<T>({2, 4, h}, std::vector<double>(ids.size() * h, 7.0));
  this->k_.EmbeddingForward(weight, Ids(ids), vocab_start, vocab_end, out);
  std::vector<double> expected(ids.size() * h, 0.0);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < vocab_start || ids[i] >= vocab_end) continue;
    for (int64_t j = 0; j < h; ++j)
      expected[i * h + static_cast<size_t>(j)] =
          wv[static_cast<size_t>((ids[i] - vocab_start) * h + j)];
  }
  ASSERT_GT(Norm(expected), 0);
  EXPECT_TRUE(TensorsNear("embedding forward", ValuesOf(out), expected));

  const std::vector<double> dyv = Ints(61, static_cast<int64_t>(ids.size()) * h);
  const std::vector<double> dw0 = Ints(62, (vocab_end - vocab_start) * h);
  Tensor dweight = Make<T>({vocab_end - vocab_start, h}, dw0);
  this->k_.EmbeddingBackward(Make<T>({static_cast<int64_t>(ids.size()), h}, dyv), Ids(ids),
                             vocab_start, vocab_end, dweight);
  std::vector<double> dw = dw0;  // accumulates; token 6 appears twice
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < vocab_start || ids[i] >= vocab_end) continue;
    for (int64_t j = 0; j < h; ++j)
      dw[static_cast<size_t>((ids[i] - vocab_start) * h + j)] +=
          dyv[i * h + static_cast<size_t>(j)];
  }
  EXPECT_TRUE(TensorsNear("embedding backward", ValuesOf(dweight), dw));

  Tensor short_out = this->k_.Zeros({7, h}, kDType<T>);
  EXPECT_THROW(this->k_.EmbeddingForward(weight, Ids(ids), vocab_start, vocab_end, short_out),
               std::invalid_argument);
  EXPECT_THROW(this->k_.EmbeddingForward(weight, Ids(ids), vocab_start, vocab_end + 1, out),
               std::invalid_argument);
  EXPECT_THROW(this->k_.EmbeddingBackward(out, Ids(ids), vocab_start, vocab_end - 1, dweight),
               std::invalid_argument);
}

// Ids are int64 tensors of any shape with one element per row; a float tensor of ids (what
// the chain used to broadcast) is refused, never truncated.
TYPED_TEST(EigenKernelsTest, IdsAreInt64WithOneElementPerRow) {
  using T = TypeParam;
  const int64_t h = 2, vocab = 4;
  const std::vector<int64_t> flat = {0, 3, 9, -1, 2, 1};  // 9 and -1: outside the table
  const Tensor weight = Make<T>({vocab, h}, Ints(90, vocab * h));
  Tensor out = this->k_.Zeros({2, 3, h}, kDType<T>);
  this->k_.EmbeddingForward(weight, Ids(flat).Reshaped({2, 3}), 0, vocab, out);
  Tensor flat_out = this->k_.Zeros({6, h}, kDType<T>);
  this->k_.EmbeddingForward(weight, Ids(flat), 0, vocab, flat_out);
  ASSERT_GT(Norm(ValuesOf(out)), 0);
  EXPECT_EQ(ValuesOf(out), ValuesOf(flat_out));
  EXPECT_EQ(ValuesOf(out)[2 * h], 0.0);  // id 9 is masked
  EXPECT_EQ(ValuesOf(out)[3 * h], 0.0);  // id -1 too

  const Tensor dy = Make<T>({6, h}, Ints(91, 6 * h));
  Tensor dweight = this->k_.Zeros({vocab, h}, kDType<T>);
  Tensor logits = Make<T>({6, vocab}, Ints(92, 6 * vocab));
  Tensor stat = this->k_.Zeros({6}, ComputeDType(kDType<T>));
  Tensor grad = this->k_.Zeros({6, vocab}, kDType<T>);
  // The same calls with int64 ids pass, so the refusals below are the dtype's.
  EXPECT_NO_THROW(this->k_.EmbeddingBackward(dy, Ids(flat), 0, vocab, dweight));
  EXPECT_NO_THROW(this->k_.CrossEntropyPartials(logits, stat, Ids(flat), 0, stat, stat, stat));
  EXPECT_NO_THROW(
      this->k_.CrossEntropyBackward(logits, stat, stat, Ids(flat), 0, 1, 0, stat, grad));
  for (DType wrong : {DType::kFloat64, DType::kFloat32}) {
    const Tensor float_ids = MakeOf(wrong, {6}, {0, 3, 9, -1, 2, 1});
    EXPECT_THROW(this->k_.EmbeddingForward(weight, float_ids, 0, vocab, flat_out),
                 std::invalid_argument);
    EXPECT_THROW(this->k_.EmbeddingBackward(dy, float_ids, 0, vocab, dweight),
                 std::invalid_argument);
    EXPECT_THROW(this->k_.CrossEntropyPartials(logits, stat, float_ids, 0, stat, stat, stat),
                 std::invalid_argument);
    EXPECT_THROW(this->k_.CrossEntropyBackward(logits, stat, stat, float_ids, 0, 1, 0, stat, grad),
                 std::invalid_argument);
  }
  // One id per row: 5 or 7 ids for 6 rows are refused, whatever their shape.
  for (const std::vector<int64_t>& count :
       {std::vector<int64_t>(5, 1), std::vector<int64_t>(7, 1)}) {
    EXPECT_THROW(this->k_.EmbeddingForward(weight, Ids(count), 0, vocab, flat_out),
                 std::invalid_argument);
    EXPECT_THROW(this->k_.EmbeddingBackward(dy, Ids(count), 0, vocab, dweight),
                 std::invalid_argument);
  }
  // Ids on another device (host memory labelled CUDA: never dereferenced).
  const Tensor elsewhere({6}, DType::kInt64, Device::kCuda,
                         std::make_shared<std::array<int64_t, 6>>());
  EXPECT_THROW(this->k_.EmbeddingForward(weight, elsewhere, 0, vocab, flat_out),
               std::invalid_argument);
  // The table itself must be a float: an int64 weight is not a lookup table of values.
  EXPECT_THROW(
      this->k_.EmbeddingForward(Ids(std::vector<int64_t>(vocab * h, 1)).Reshaped({vocab, h}),
                                Ids(flat), 0, vocab, flat_out),
      std::invalid_argument);
}

// Kernels::tensor_bytes counts what Zeros, Empty and ToDevice made while it lives (a view or
// a copy of the handle adds nothing), and the peak since ResetPeakTensorBytes; the storage
// still goes back to the backend's cache when the last handle goes.
TEST(EigenKernelsTensorBytes, CountsLiveTensorsAndThePeak) {
  EigenKernels k;
  EXPECT_EQ(k.tensor_bytes().live, 0);
  EXPECT_EQ(k.tensor_bytes().peak, 0);
  Tensor held = k.Zeros({10}, DType::kFloat64);  // 80 bytes
  k.ResetPeakTensorBytes();
  EXPECT_EQ(k.tensor_bytes().peak, 80);
  {
    Tensor a = k.Empty({4, 8}, DType::kFloat32);  // 128 bytes
    const Tensor view = a.Reshaped({32});
    const Tensor handle = a;
    EXPECT_EQ(k.tensor_bytes().live, 208);
    a = Tensor();  // the view and the other handle keep it alive
    EXPECT_EQ(k.tensor_bytes().live, 208);
    Tensor b = k.Zeros({2}, DType::kBFloat16);  // 4 bytes
    EXPECT_EQ(k.tensor_bytes().live, 212);
    EXPECT_EQ(ValuesOf(b), (std::vector<double>{0.0, 0.0}));
  }
  EXPECT_EQ(k.tensor_bytes().live, 80);
  EXPECT_EQ(k.tensor_bytes().peak, 212);
  k.ResetPeakTensorBytes();
  EXPECT_EQ(k.tensor_bytes().peak, 80);
  const Tensor empty = k.Empty({0, 3}, DType::kFloat32);
  EXPECT_EQ(k.tensor_bytes().live, 80);
  {
    // A copy to the device is the device's memory (a parameter's value is one); a copy to
    // the host is not.
    const Tensor device = k.ToDevice(Tensor::HostEmpty({5}, DType::kFloat32));  // 20 bytes
    EXPECT_EQ(k.tensor_bytes().live, 100);
    const Tensor host = k.ToHost(device);
    EXPECT_EQ(k.tensor_bytes().live, 100);
  }
  EXPECT_EQ(k.tensor_bytes().live, 80);
  held = Tensor();
  EXPECT_EQ(k.tensor_bytes().live, 0);
}

// int64 tensors move through the memory operations bit for bit; every kernel that computes
// refuses them.
TEST(EigenKernelsInt64Test, MemoryOpsMoveIdsAndArithmeticRefusesThem) {
  EigenKernels k;
  const int64_t big = (int64_t{1} << 62) + 3;  // not a double: a float path would show
  const std::vector<int64_t> v = {big, -big, 7, 0, -1, 42};
  const Tensor host = Ids(v).Reshaped({2, 3});
  const auto ints = [](const Tensor& t) {
    return std::vector<int64_t>(t.data_as<int64_t>(), t.data_as<int64_t>() + t.numel());
  };
  Tensor dev = k.ToDevice(host);
  EXPECT_EQ(dev.dtype(), DType::kInt64);
  EXPECT_EQ(ints(k.ToHost(dev)), v);
  Tensor z = k.Zeros({2, 3}, DType::kInt64);
  EXPECT_EQ(ints(z), std::vector<int64_t>(6, 0));
  k.Copy(dev, z);
  EXPECT_EQ(ints(z), v);
  k.SetZero(z);
  EXPECT_EQ(ints(z), std::vector<int64_t>(6, 0));
  k.CopyBlock(dev, 0, 1, z, 1, 0, 1, 2);  // row 0, columns 1..2 -> row 1, columns 0..1
  EXPECT_EQ(ints(z), (std::vector<int64_t>{0, 0, 0, -big, 7, 0}));
  Tensor t = k.Empty({3, 2}, DType::kInt64);
  k.StridedCopy(dev, 0, {3, 2}, {1, 3}, t, 0, {2, 1});  // transpose
  EXPECT_EQ(ints(t), (std::vector<int64_t>{big, 0, -big, -1, 7, 42}));

  Tensor f32 = k.Zeros({2, 3}, DType::kFloat32);
  EXPECT_THROW(k.Scale(2.0, dev), std::invalid_argument);
  EXPECT_THROW(k.Axpy(1.0, dev, z), std::invalid_argument);
  EXPECT_THROW(k.Axpy(1.0, f32, z), std::invalid_argument);  // an int64 accumulator
  EXPECT_THROW(k.ActivationForward(Activation::kGelu, dev, z), std::invalid_argument);
  Tensor c = k.Zeros({2, 2}, DType::kInt64);
  EXPECT_THROW(k.Gemm(false, true, 1.0, dev, dev, 0.0, c), std::invalid_argument);
  Tensor row_max = k.Zeros({2}, DType::kFloat32);
  EXPECT_THROW(k.RowMax(dev, row_max), std::invalid_argument);
  Tensor copy_to_float = k.Zeros({2, 3}, DType::kFloat64);
  EXPECT_THROW(k.Copy(dev, copy_to_float), std::invalid_argument);  // a copy converts nothing
}

// Convert rounds each element once to the destination's dtype, to nearest even (16-bit via
// float32, as torch's .to() does); widening is exact. Values chosen to sit between, on and
// halfway between neighbours of each dtype.
TEST(EigenKernelsConvertTest, RoundsToNearestEvenBetweenEveryPairOfFloatDtypes) {
  EigenKernels k;
  const double u8 = std::ldexp(1.0, -8);    // half of bfloat16's spacing at 1 (2^-7)
  const double u11 = std::ldexp(1.0, -11);  // half of float16's spacing at 1 (2^-10)
  const double u24 = std::ldexp(1.0, -24);  // half of float32's spacing at 1 (2^-23)
  // x, then x rounded to float32, bfloat16 and float16 (by hand: ties go to the even one).
  const std::vector<std::array<double, 4>> cases = {
      {1 + u8, 1 + u8, 1, 1 + u8},                       // a bfloat16 tie -> 1 (even)
      {1 + 3 * u8, 1 + 3 * u8, 1 + 4 * u8, 1 + 3 * u8},  // a bfloat16 tie -> 1 + 2^-6 (even)
      {1 + u11, 1 + u11, 1, 1},                          // a float16 tie -> 1 (even)
      {1 + 3 * u11, 1 + 3 * u11, 1, 1 + 4 * u11},        // a float16 tie -> 1 + 2^-9 (even)
      {1 + u24, 1, 1, 1},                                // a float32 tie -> 1 (even)
      {-(1 + 1.5 * u24), -(1 + 2 * u24), -1, -1},        // float32 rounds up in magnitude
      {65520.0, 65520.0, 65536.0, INFINITY},             // float16's overflow
      {0.1, 0.100000001490116119384765625, 0.10009765625, 0.0999755859375},
  };
  std::vector<double> x, want32, want_bf16, want_f16;
  for (const auto& c : cases) {
    x.push_back(c[0]);
    want32.push_back(c[1]);
    want_bf16.push_back(c[2]);
    want_f16.push_back(c[3]);
  }
  const Shape shape = {static_cast<int64_t>(x.size())};
  const Tensor src = MakeOf(DType::kFloat64, shape, x);
  const auto to = [&](const Tensor& from, DType dtype) {
    Tensor out = k.Empty(shape, dtype);
    k.Convert(from, out);
    return ValuesOf(out);
  };
  EXPECT_EQ(to(src, DType::kFloat64), x);
  EXPECT_EQ(to(src, DType::kFloat32), want32);
  EXPECT_EQ(to(src, DType::kBFloat16), want_bf16);
  EXPECT_EQ(to(src, DType::kFloat16), want_f16);
  // Widening is exact: every dtype's values come back unchanged through any wider one.
  for (DType narrow : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    Tensor n = k.Empty(shape, narrow);
    k.Convert(src, n);
    for (DType wide : {DType::kFloat64, DType::kFloat32}) {
      if (DTypeSize(wide) <= DTypeSize(narrow)) continue;
      EXPECT_EQ(to(n, wide), ValuesOf(n)) << DTypeName(narrow) << " -> " << DTypeName(wide);
    }
  }
  // float32 -> 16-bit rounds the float32 value (one rounding from float32).
  Tensor f32 = k.Empty(shape, DType::kFloat32);
  k.Convert(src, f32);
  EXPECT_EQ(to(f32, DType::kBFloat16), want_bf16);

  Tensor ids = k.Zeros(shape, DType::kInt64);
  Tensor shorter = k.Empty({shape[0] - 1}, DType::kFloat32);
  EXPECT_THROW(k.Convert(ids, f32), std::invalid_argument);
  EXPECT_THROW(k.Convert(src, ids), std::invalid_argument);
  EXPECT_THROW(k.Convert(src, shorter), std::invalid_argument);
}

// --- vocab-parallel cross entropy -----------------------------------------------------

TYPED_TEST(EigenKernelsTest, RowMax) {
  using T = TypeParam;
  const std::vector<double> lv = Ints(70, 4 * 6, -9, 9);
  Tensor row_max = this->k_.Zeros({4}, kDType<T>);
  this->k_.RowMax(Make<T>({4, 6}, lv), row_max);
  std::vector<double> expected(4, -1e300);
  for (size_t i = 0; i < 4; ++i) {
    for (size_t j = 0; j < 6; ++j) expected[i] = std::max(expected[i], lv[i * 6 + j]);
  }
  EXPECT_TRUE(TensorsNear("row_max", ValuesOf(row_max), expected));
  Tensor empty_max = this->k_.Zeros({3}, kDType<T>);
  this->k_.RowMax(this->k_.Zeros({3, 0}, kDType<T>), empty_max);
  EXPECT_TRUE(TensorsNear("row_max of no columns", ValuesOf(empty_max),
                          std::vector<double>(3, -std::numeric_limits<double>::infinity())));
  EXPECT_THROW(this->k_.RowMax(Make<T>({4, 6}, lv), empty_max), std::invalid_argument);
}

// Full vocabulary of 10, split into two shards of 5 columns; 4 tokens.
struct CeExample {
  static constexpr int64_t kRows = 4, kVocab = 10, kShard = 5;
  std::vector<double> logits = Ints(80, kRows* kVocab, -6, 6);
  std::vector<int64_t> labels = {2, 7, 5, 9};
  std::vector<double> Max() const {
    std::vector<double> m(kRows, -1e300);
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = 0; j < kVocab; ++j)
        m[static_cast<size_t>(i)] = std::max(m[static_cast<size_t>(i)], At(i, j));
    }
    return m;
  }
  double At(int64_t i, int64_t j) const { return logits[static_cast<size_t>(i * kVocab + j)]; }
  std::vector<double> Shard(int64_t s) const {
    std::vector<double> out;
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = s * kShard; j < (s + 1) * kShard; ++j) out.push_back(At(i, j));
    }
    return out;
  }
};

TYPED_TEST(EigenKernelsTest, CrossEntropyPartialsPerShardSumToFull) {
  using T = TypeParam;
  const CeExample ex;
  const int64_t rows = CeExample::kRows;
  const std::vector<double> max = ex.Max();  // what the max all-reduce over shards gives
  std::vector<double> total_exp(rows, 0.0), total_z(rows, 0.0), total_target(rows, 0.0);
  for (int64_t s = 0; s < 2; ++s) {
    Tensor sum_exp = this->k_.Zeros({rows}, kDType<T>);
    Tensor sum_z = this->k_.Zeros({rows}, kDType<T>);
    Tensor target_z = this->k_.Zeros({rows}, kDType<T>);
    this->k_.CrossEntropyPartials(Make<T>({rows, CeExample::kShard}, ex.Shard(s)),
                                  Make<T>({rows}, max), Ids(ex.labels), s * CeExample::kShard,
                                  sum_exp, sum_z, target_z);
    std::vector<double> e(rows), z(rows), t(rows);
    for (int64_t i = 0; i < rows; ++i) {
      const size_t r = static_cast<size_t>(i);
      for (int64_t j = s * CeExample::kShard; j < (s + 1) * CeExample::kShard; ++j) {
        e[r] += std::exp(ex.At(i, j) - max[r]);
        z[r] += ex.At(i, j) - max[r];
      }
      const int64_t label = ex.labels[r];
      if (label >= s * CeExample::kShard && label < (s + 1) * CeExample::kShard) {
        t[r] = ex.At(i, label) - max[r];
      }
      total_exp[r] += ValuesOf(sum_exp)[r];
      total_z[r] += ValuesOf(sum_z)[r];
      total_target[r] += ValuesOf(target_z)[r];
    }
    // exp: library and vectorised exp differ by a few ulp.
    EXPECT_TRUE(
        TensorsNear(fmt::format("sum_exp shard {}", s), ValuesOf(sum_exp), e, 0, 4 * kUlpTol<T>));
    EXPECT_TRUE(TensorsNear(fmt::format("sum_z shard {}", s), ValuesOf(sum_z), z));
    EXPECT_TRUE(TensorsNear(fmt::format("target_z shard {}", s), ValuesOf(target_z), t));
  }
  // The all-reduced pieces give the unsharded quantities.
  std::vector<double> full_exp(rows), full_z(rows), full_target(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const size_t r = static_cast<size_t>(i);
    for (int64_t j = 0; j < CeExample::kVocab; ++j) {
      full_exp[r] += std::exp(ex.At(i, j) - max[r]);
      full_z[r] += ex.At(i, j) - max[r];
    }
    full_target[r] = ex.At(i, ex.labels[r]) - max[r];
  }
  ASSERT_GT(Norm(full_z), 0);
  EXPECT_TRUE(TensorsNear("sum_exp total", total_exp, full_exp, 0, 4 * kUlpTol<T>));
  EXPECT_TRUE(TensorsNear("sum_z total", total_z, full_z));
  EXPECT_TRUE(TensorsNear("target_z total", total_target, full_target));

  Tensor small = this->k_.Zeros({rows - 1}, kDType<T>);
  Tensor ok = this->k_.Zeros({rows}, kDType<T>);
  const Tensor shard = Make<T>({rows, CeExample::kShard}, ex.Shard(0));
  EXPECT_THROW(
      this->k_.CrossEntropyPartials(shard, Make<T>({rows}, max), Ids(ex.labels), 0, small, ok, ok),
      std::invalid_argument);
  EXPECT_THROW(
      this->k_.CrossEntropyPartials(shard, Make<T>({rows}, max), Ids({1, 2}), 0, ok, ok, ok),
      std::invalid_argument);
}

TYPED_TEST(EigenKernelsTest, CrossEntropyBackward) {
  using T = TypeParam;
  const CeExample ex;
  const int64_t rows = CeExample::kRows;
  const std::vector<double> max = ex.Max();
  std::vector<double> sum_exp(rows);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < CeExample::kVocab; ++j)
      sum_exp[static_cast<size_t>(i)] += std::exp(ex.At(i, j) - max[static_cast<size_t>(i)]);
  }
  const double alpha = 0.1;  // label smoothing: q = 1 - alpha at the label, alpha / (V - 1) else
  const double on = 1 - alpha, off = alpha / (CeExample::kVocab - 1);
  const std::vector<double> row_scale = {0.25, 0.5, 1.0, 2.0};
  for (int64_t s = 0; s < 2; ++s) {
    const int64_t start = s * CeExample::kShard;
    const Tensor logits = Make<T>({rows, CeExample::kShard}, ex.Shard(s));
    Tensor grad = this->k_.Zeros({rows, CeExample::kShard}, kDType<T>);
    this->k_.CrossEntropyBackward(logits, Make<T>({rows}, max), Make<T>({rows}, sum_exp),
                                  Ids(ex.labels), start, on, off, Make<T>({rows}, row_scale), grad);
    std::vector<double> expected;
    for (int64_t i = 0; i < rows; ++i) {
      const size_t r = static_cast<size_t>(i);
      for (int64_t j = start; j < start + CeExample::kShard; ++j) {
        const double q = j == ex.labels[r] ? on : off;
        expected.push_back(row_scale[r] * (std::exp(ex.At(i, j) - max[r]) / sum_exp[r] - q));
      }
    }
    ASSERT_GT(Norm(expected), 0);
    // exp: a few ulp; the subtraction of q can cancel, so an absolute term as well.
    EXPECT_TRUE(TensorsNear(fmt::format("ce grad shard {}", s), ValuesOf(grad), expected,
                            4 * kUlpTol<T>, 4 * kUlpTol<T>));

    Tensor in_place = Make<T>({rows, CeExample::kShard}, ex.Shard(s));
    this->k_.CrossEntropyBackward(in_place, Make<T>({rows}, max), Make<T>({rows}, sum_exp),
                                  Ids(ex.labels), start, on, off, Make<T>({rows}, row_scale),
                                  in_place);
    EXPECT_TRUE(TensorsNear(fmt::format("ce grad in place shard {}", s), ValuesOf(in_place),
                            ValuesOf(grad)));
  }
  // Without smoothing and with unit scale, each full row of the gradient sums to 0.
  const Tensor full = Make<T>({rows, CeExample::kVocab}, ex.logits);
  Tensor grad = this->k_.Zeros({rows, CeExample::kVocab}, kDType<T>);
  this->k_.CrossEntropyBackward(full, Make<T>({rows}, max), Make<T>({rows}, sum_exp),
                                Ids(ex.labels), 0, 1.0, 0.0,
                                Make<T>({rows}, std::vector<double>(rows, 1.0)), grad);
  const std::vector<double> g = ValuesOf(grad);
  for (int64_t i = 0; i < rows; ++i) {
    double s = 0;
    for (int64_t j = 0; j < CeExample::kVocab; ++j)
      s += g[static_cast<size_t>(i * CeExample::kVocab + j)];
    EXPECT_NEAR(s, 0.0, 16 * kUlpTol<T>) << "row " << i;
  }
  Tensor wrong = this->k_.Zeros({rows, CeExample::kVocab + 1}, kDType<T>);
  EXPECT_THROW(
      this->k_.CrossEntropyBackward(full, Make<T>({rows}, max), Make<T>({rows}, sum_exp),
                                    Ids(ex.labels), 0, 1.0, 0.0, Make<T>({rows}, row_scale), wrong),
      std::invalid_argument);
}

// --- bfloat16 / float16 ---------------------------------------------------------------

// Precision (significand bits, implicit one included) and smallest normal exponent.
template <typename H>
constexpr int kDigits = std::is_same_v<H, BFloat16> ? 8 : 11;
template <typename H>
constexpr int kMinExp = std::is_same_v<H, BFloat16> ? -126 : -14;
// float32 unit roundoff.
constexpr double kU32 = 0x1p-24;

// The spacing of H's values at |v| (one ulp of the binade holding v; subnormal spacing
// below the smallest normal).
template <typename H>
double UlpAt(double v) {
  int e = 0;
  std::frexp(v, &e);  // |v| = m * 2^e, m in [0.5, 1), so the binade is [2^(e-1), 2^e)
  const int binade = v == 0 ? kMinExp<H> : std::max(e - 1, kMinExp<H>);
  return std::ldexp(1.0, binade - (kDigits<H> - 1));
}

// A 16-bit host tensor holding `values` rounded (float64 -> float32 -> H, core/half.h).

// Reals uniform in [lo, hi) (Philox stream `key`).
std::vector<double> Reals(uint64_t key, int64_t n, double lo = -4, double hi = 4) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) {
    v[static_cast<size_t>(e)] = lo + (hi - lo) * UniformAt(key, 9, static_cast<uint64_t>(e));
  }
  return v;
}

// Element e passes when |actual - expected| <= slack[e] + half_ulp(expected[e]); NaN and
// Inf never pass.
template <typename HalfUlp>
::testing::AssertionResult WithinBound(const std::string& name, const std::vector<double>& actual,
                                       const std::vector<double>& expected,
                                       const std::vector<double>& slack, HalfUlp half_ulp) {
  if (actual.size() != expected.size() || slack.size() != expected.size()) {
    return ::testing::AssertionFailure() << name << ": " << actual.size() << " elements, expected "
                                         << expected.size() << " (" << slack.size() << " slacks)";
  }
  int64_t bad = 0;
  std::string first;
  for (size_t e = 0; e < actual.size(); ++e) {
    const double a = actual[e];
    const double x = expected[e];
    const double bound = slack[e] + half_ulp(x);
    if (std::isfinite(a) && std::fabs(a - x) <= bound) continue;
    if (bad++ < 10)
      first +=
          fmt::format("\n  [{}] {} vs {} (|diff| {}, bound {})", e, a, x, std::fabs(a - x), bound);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << name << ": " << bad << " of " << actual.size() << " outside the bound:" << first;
}

// float32 results (a float32 accumulator or statistic) against exact values, within the
// float32 arithmetic error slack[e] that the caller bounds.
::testing::AssertionResult WithinSlack(const std::string& name, const std::vector<double>& actual,
                                       const std::vector<double>& expected,
                                       const std::vector<double>& slack) {
  return WithinBound(name, actual, expected, slack, [](double) { return 0.0; });
}

// 16-bit results against exact values: element e passes when
//   |actual - expected| <= ulp_H(expected) / 2 + slack[e],
// the rounding to H plus the float32 arithmetic error slack[e] that the caller bounds.
template <typename H>
::testing::AssertionResult HalfNear(const std::string& name, const std::vector<double>& actual,
                                    const std::vector<double>& expected,
                                    const std::vector<double>& slack) {
  return WithinBound(name, actual, expected, slack, [](double x) { return 0.5 * UlpAt<H>(x); });
}
// The same slack for every element: atol + rtol * |expected|.
template <typename H>
::testing::AssertionResult HalfNear(const std::string& name, const std::vector<double>& actual,
                                    const std::vector<double>& expected, double atol, double rtol) {
  std::vector<double> slack(expected.size());
  for (size_t e = 0; e < expected.size(); ++e) slack[e] = atol + rtol * std::fabs(expected[e]);
  return HalfNear<H>(name, actual, expected, slack);
}

template <typename H>
class EigenKernelsHalfTest : public ::testing::Test {
 protected:
  EigenKernels k_;
};
using HalfTypes = ::testing::Types<BFloat16, Float16>;
TYPED_TEST_SUITE(EigenKernelsHalfTest, HalfTypes);

TYPED_TEST(EigenKernelsHalfTest, MemoryOpsMoveBitsUnchanged) {
  using H = TypeParam;
  constexpr DType dt = kDType<H>;
  // Every bit pattern class, including a signalling NaN (0x7f81 / 0x7c01), which any
  // conversion through float32 would quieten, and -0.
  std::vector<uint16_t> patterns = {0x0000, 0x8000, 0x7f81, 0x7c01, 0x3f80, 0x3c00,
                                    0xffff, 0x0001, 0x7bff, 0xc2c4, 0x1234, 0xfe01};
  for (uint16_t i = 0; patterns.size() < 24; ++i)
    patterns.push_back(static_cast<uint16_t>(i * 2654 + 77));
  Tensor host = Tensor::HostZeros({4, 6}, dt);
  std::memcpy(host.data(), patterns.data(), patterns.size() * sizeof(uint16_t));

  Tensor z = this->k_.Zeros({4, 6}, dt);
  EXPECT_EQ(z.dtype(), dt);
  EXPECT_EQ(Bits(z), std::vector<uint16_t>(24, 0));
  EXPECT_EQ(this->k_.Empty({4, 6}, dt).dtype(), dt);
  const Tensor dev = this->k_.ToDevice(host);
  EXPECT_EQ(dev.dtype(), dt);
  EXPECT_EQ(Bits(dev), patterns);
  EXPECT_EQ(Bits(this->k_.ToHost(dev)), patterns);
  Tensor dst = this->k_.Zeros({24}, dt);
  this->k_.Copy(host, dst);
  EXPECT_EQ(Bits(dst), patterns);

  Tensor block = this->k_.Zeros({3, 5}, dt);
  this->k_.CopyBlock(host, 1, 2, block, 1, 0, 2, 3);
  std::vector<uint16_t> expected(15, 0);
  for (size_t i = 0; i < 2; ++i) {
    for (size_t j = 0; j < 3; ++j) expected[(1 + i) * 5 + j] = patterns[(1 + i) * 6 + 2 + j];
  }
  EXPECT_EQ(Bits(block), expected);
  // Overlapping blocks of one tensor: as if the source were read first.
  Tensor self = this->k_.ToDevice(host);
  this->k_.CopyBlock(self, 0, 0, self, 1, 1, 3, 5);
  std::vector<uint16_t> shifted = patterns;
  for (size_t i = 0; i < 3; ++i) {
    for (size_t j = 0; j < 5; ++j) shifted[(1 + i) * 6 + 1 + j] = patterns[i * 6 + j];
  }
  EXPECT_EQ(Bits(self), shifted);

  // Embedding rows are bit copies too; ids outside the shard give +0.
  const std::vector<int64_t> ids = {5, 2, 3, 9};
  Tensor out = this->k_.Empty({4, 6}, dt);
  this->k_.EmbeddingForward(host, Ids(ids), 2, 6, out);
  std::vector<uint16_t> rows(24, 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 2 || ids[i] >= 6) continue;
    for (size_t j = 0; j < 6; ++j)
      rows[i * 6 + j] = patterns[static_cast<size_t>(ids[i] - 2) * 6 + j];
  }
  EXPECT_EQ(Bits(out), rows);
}

// Exact GEMM on the widened inputs, and the float32 error bound of each element:
// (K + 2) u32 (|alpha| sum_l |a_il b_lj| + |beta c_ij|) covers the K-term float32 dot product,
// the alpha and beta products and the final addition.
struct GemmReference {
  std::vector<double> value, slack;
};
GemmReference ExactGemm(bool ta, bool tb, double alpha, const std::vector<double>& a,
                        const std::vector<double>& b, double beta, const std::vector<double>& c,
                        int64_t m, int64_t n, int64_t k) {
  std::vector<double> abs_a(a.size()), abs_b(b.size()), abs_c(c.size());
  for (size_t e = 0; e < a.size(); ++e) abs_a[e] = std::fabs(a[e]);
  for (size_t e = 0; e < b.size(); ++e) abs_b[e] = std::fabs(b[e]);
  for (size_t e = 0; e < c.size(); ++e) abs_c[e] = std::fabs(c[e]);
  GemmReference r;
  r.value = NaiveGemm(ta, tb, alpha, a, b, beta, c, m, n, k);
  r.slack = NaiveGemm(ta, tb, std::fabs(alpha), abs_a, abs_b, std::fabs(beta), abs_c, m, n, k);
  for (double& s : r.slack) s *= static_cast<double>(k + 2) * kU32;
  return r;
}

template <typename H>
void CheckHalfGemm(EigenKernels& kernels, int64_t m, int64_t n, int64_t k) {
  for (DType c_dtype : {kDType<H>, DType::kFloat32}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (double alpha : {1.0, -0.7}) {
          for (double beta : {0.0, 1.0, 0.3}) {
            const Tensor a = Make<H>(ta ? Shape{k, m} : Shape{m, k}, Reals(10, m * k));
            const Tensor b = Make<H>(tb ? Shape{n, k} : Shape{k, n}, Reals(11, k * n));
            const std::vector<double> av = ValuesOf(a), bv = ValuesOf(b);
            Tensor c;
            std::vector<double> cv;
            if (c_dtype == DType::kFloat32) {
              c = Make<float>({m, n}, Reals(12, m * n, -20, 20));
              cv = ValuesOf(c);
            } else {
              c = Make<H>({m, n}, Reals(12, m * n, -20, 20));
              cv = ValuesOf(c);
            }
            // The float32 path on the widened inputs, for the "rounded once" check below.
            Tensor c32 = Make<float>({m, n}, cv);
            kernels.Gemm(ta, tb, alpha, Make<float>(a.shape(), av), Make<float>(b.shape(), bv),
                         beta, c32);

            kernels.Gemm(ta, tb, alpha, a, b, beta, c);
            const GemmReference ref = ExactGemm(ta, tb, alpha, av, bv, beta, cv, m, n, k);
            ASSERT_GT(Norm(ref.value), 0);
            const std::string name = fmt::format(
                "{} gemm into {} {}x{}x{} ta={} tb={} alpha={} beta={}", DTypeName(kDType<H>),
                DTypeName(c_dtype), m, n, k, ta, tb, alpha, beta);
            if (c_dtype == DType::kFloat32) {
              EXPECT_TRUE(WithinSlack(name, ValuesOf(c), ref.value, ref.slack));
              EXPECT_TRUE(
                  TensorsNear(name + " = float32 path", ValuesOf(c), ValuesOf(c32)));
            } else {
              EXPECT_TRUE(HalfNear<H>(name, ValuesOf(c), ref.value, ref.slack));
              std::vector<double> rounded = ValuesOf(c32);
              for (double& v : rounded) v = ToFloat(FromFloat<H>(static_cast<float>(v)));
              EXPECT_TRUE(
                  TensorsNear(name + " = float32 path rounded once", ValuesOf(c), rounded));
            }
          }
        }
      }
    }
  }
}

TYPED_TEST(EigenKernelsHalfTest, GemmSmallAllTransposes) {
  CheckHalfGemm<TypeParam>(this->k_, 5, 7, 6);
}

// Blocked (OpenBLAS or Eigen's packed) GEMM sizes.
TYPED_TEST(EigenKernelsHalfTest, GemmBlockedAllTransposes) {
  CheckHalfGemm<TypeParam>(this->k_, 70, 65, 80);
}

TYPED_TEST(EigenKernelsHalfTest, GemmBetaZeroOverwritesNaN) {
  using H = TypeParam;
  const Tensor a = Make<H>({2, 3}, Reals(20, 6));
  const Tensor b = Make<H>({3, 2}, Reals(21, 6));
  Tensor c = Make<H>({2, 2}, std::vector<double>(4, std::numeric_limits<double>::quiet_NaN()));
  this->k_.Gemm(false, false, 1.0, a, b, 0.0, c);
  const GemmReference ref = ExactGemm(false, false, 1, ValuesOf(a), ValuesOf(b), 0,
                                      std::vector<double>(4, 0.0), 2, 2, 3);
  EXPECT_TRUE(HalfNear<H>("gemm beta=0", ValuesOf(c), ref.value, ref.slack));
}

TYPED_TEST(EigenKernelsHalfTest, RejectsWrongAccumulatorAndStatisticDtypes) {
  using H = TypeParam;
  constexpr DType dt = kDType<H>;
  constexpr DType other_half = dt == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
  const Tensor a = Make<H>({2, 3}, Reals(20, 6));
  const Tensor b = Make<H>({3, 2}, Reals(21, 6));
  for (DType wrong : {DType::kFloat64, other_half}) {
    SCOPED_TRACE(DTypeName(wrong));
    Tensor c = this->k_.Zeros({2, 2}, wrong);
    EXPECT_THROW(this->k_.Gemm(false, false, 1, a, b, 0, c), std::invalid_argument);
    Tensor out = this->k_.Zeros({3}, wrong);
    EXPECT_THROW(this->k_.SumRows(a, 0, out), std::invalid_argument);
    Tensor y = this->k_.Zeros({2, 3}, wrong);
    EXPECT_THROW(this->k_.Axpy(1, a, y), std::invalid_argument);
    EXPECT_THROW(this->k_.ActivationForward(Activation::kGelu, a, y), std::invalid_argument);  // not an accumulator
    Tensor dweight = this->k_.Zeros({4, 3}, wrong);
    EXPECT_THROW(this->k_.EmbeddingBackward(a, Ids({0, 1}), 0, 4, dweight), std::invalid_argument);
  }
  // a and b must share one dtype; the statistics must be float32, not the logits' dtype.
  const Tensor b_other = this->k_.Zeros({3, 2}, other_half);
  Tensor c32 = this->k_.Zeros({2, 2}, DType::kFloat32);
  EXPECT_THROW(this->k_.Gemm(false, false, 1, a, b_other, 0, c32), std::invalid_argument);
  for (DType wrong : {dt, DType::kFloat64}) {
    SCOPED_TRACE(DTypeName(wrong));
    Tensor row_max = this->k_.Zeros({2}, wrong);
    EXPECT_THROW(this->k_.RowMax(a, row_max), std::invalid_argument);
    const Tensor stat = this->k_.Zeros({2}, wrong);
    const Tensor f32 = this->k_.Zeros({2}, DType::kFloat32);
    Tensor grad = this->k_.Zeros({2, 3}, dt);
    EXPECT_THROW(this->k_.CrossEntropyBackward(a, f32, f32, Ids({0, 1}), 0, 1, 0, stat, grad),
                 std::invalid_argument);
  }
}

TYPED_TEST(EigenKernelsHalfTest, AddRowVectorSumRowsAxpyScale) {
  using H = TypeParam;
  constexpr DType dt = kDType<H>;
  const int64_t r = 6, c = 5;
  const Tensor x = Make<H>({r, c}, Reals(30, r * c));
  const std::vector<double> xv = ValuesOf(x);
  ASSERT_GT(Norm(xv), 0);

  // y + bias: one float32 addition.
  Tensor y = Make<H>({2, 3, c}, Reals(31, r * c, -100, 100));
  const Tensor bias = Make<H>({c}, Reals(32, c));
  std::vector<double> expected = ValuesOf(y);
  const std::vector<double> bv = ValuesOf(bias);
  for (size_t e = 0; e < expected.size(); ++e) expected[e] += bv[e % static_cast<size_t>(c)];
  this->k_.AddRowVector(bias, y);
  EXPECT_TRUE(HalfNear<H>("add_row_vector", ValuesOf(y), expected, 0, kU32));

  // beta * out + the r-row column sum: r + 1 float32 roundings of terms bounded by
  // |beta out| + sum |x|.
  for (DType out_dtype : {dt, DType::kFloat32}) {
    for (double beta : {0.0, 1.0, 0.3}) {
      const std::vector<double> ov0 = Reals(33, c, -50, 50);
      Tensor out = out_dtype == dt ? Make<H>({c}, ov0) : Make<float>({c}, ov0);
      const std::vector<double> ov = out_dtype == dt ? ValuesOf(out) : ValuesOf(out);
      std::vector<double> sums(static_cast<size_t>(c)), slack(static_cast<size_t>(c));
      for (size_t j = 0; j < static_cast<size_t>(c); ++j) {
        double s = 0, abs_s = 0;
        for (size_t i = 0; i < static_cast<size_t>(r); ++i) {
          s += xv[i * static_cast<size_t>(c) + j];
          abs_s += std::fabs(xv[i * static_cast<size_t>(c) + j]);
        }
        sums[j] = beta * ov[j] + s;
        slack[j] = static_cast<double>(r + 2) * kU32 * (std::fabs(beta * ov[j]) + abs_s);
      }
      this->k_.SumRows(x, beta, out);
      const std::string name = fmt::format("sum_rows into {} beta={}", DTypeName(out_dtype), beta);
      if (out_dtype == dt) {
        EXPECT_TRUE(HalfNear<H>(name, ValuesOf(out), sums, slack));
      } else {
        EXPECT_TRUE(WithinSlack(name, ValuesOf(out), sums, slack));
      }
    }
  }

  // y + alpha x: alpha x and the sum, two float32 roundings.
  const double alpha = -1.3;
  for (DType y_dtype : {dt, DType::kFloat32}) {
    const std::vector<double> yv0 = Reals(34, r * c, -10, 10);
    Tensor ay = y_dtype == dt ? Make<H>({r, c}, yv0) : Make<float>({r, c}, yv0);
    const std::vector<double> yv = y_dtype == dt ? ValuesOf(ay) : ValuesOf(ay);
    std::vector<double> axpy(yv.size()), slack(yv.size());
    for (size_t e = 0; e < yv.size(); ++e) {
      axpy[e] = yv[e] + alpha * xv[e];
      slack[e] = 2 * kU32 * (std::fabs(yv[e]) + std::fabs(alpha * xv[e]));
    }
    this->k_.Axpy(alpha, x.Reshaped({r * c}), ay);
    const std::string name = fmt::format("axpy into {}", DTypeName(y_dtype));
    if (y_dtype == dt) {
      EXPECT_TRUE(HalfNear<H>(name, ValuesOf(ay), axpy, slack));
    } else {
      EXPECT_TRUE(WithinSlack(name, ValuesOf(ay), axpy, slack));
    }
  }

  // alpha x: one float32 rounding (alpha itself is rounded to float, as in the float32 path).
  Tensor s = Make<H>({r, c}, xv);
  this->k_.Scale(0.3, s);
  std::vector<double> scaled(xv.size());
  for (size_t e = 0; e < xv.size(); ++e) scaled[e] = 0.3 * xv[e];
  EXPECT_TRUE(HalfNear<H>("scale", ValuesOf(s), scaled, 0, 2 * kU32));
}

TYPED_TEST(EigenKernelsHalfTest, DropoutMatchesMaskAndFloatScale) {
  using H = TypeParam;
  constexpr DType dt = kDType<H>;
  const Tensor x = Make<H>({10, 20}, Reals(50, 200, 1, 9));  // nonzero: a 0 hides a drop
  const std::vector<double> xv = ValuesOf(x);
  for (double p : {0.25, 0.5, 0.9}) {
    // x / float(1 - p): two float32 roundings (the scale, the quotient).
    std::vector<double> expected(xv.size());
    for (size_t e = 0; e < xv.size(); ++e) {
      const bool keep = UniformAt(1234, 3, 77 + e) >= p;
      expected[e] = keep ? xv[e] / (1 - p) : 0.0;
    }
    Tensor y = this->k_.Zeros({10, 20}, dt);
    this->k_.Dropout(x, p, 1234, 3, 77, y);
    const std::vector<double> yv = ValuesOf(y);
    for (size_t e = 0; e < yv.size(); ++e) {
      EXPECT_EQ(yv[e] == 0, expected[e] == 0) << "mask differs at " << e << " p=" << p;
    }
    EXPECT_TRUE(HalfNear<H>(fmt::format("dropout p={}", p), yv, expected, 0, 2 * kU32));
    Tensor in_place = Make<H>({10, 20}, xv);
    this->k_.Dropout(in_place, p, 1234, 3, 77, in_place);
    EXPECT_EQ(Bits(in_place), Bits(y)) << "in place p=" << p;
  }
  Tensor copy = this->k_.Zeros({10, 20}, dt);
  this->k_.Dropout(x, 0.0, 1, 1, 0, copy);
  EXPECT_EQ(Bits(copy), Bits(x));
  this->k_.Dropout(x, 1.0, 1, 1, 0, copy);
  EXPECT_EQ(ValuesOf(copy), std::vector<double>(200, 0.0));
}

TYPED_TEST(EigenKernelsHalfTest, EmbeddingBackwardAccumulates) {
  using H = TypeParam;
  constexpr DType dt = kDType<H>;
  const int64_t vocab_start = 4, vocab_end = 9, h = 3;
  const std::vector<int64_t> ids = {4, 3, 8, 6, 9, 6, 0, 6};  // token 6 three times
  const int64_t rows = vocab_end - vocab_start;
  const Tensor dy = Make<H>({static_cast<int64_t>(ids.size()), h},
                                Reals(61, static_cast<int64_t>(ids.size()) * h));
  const std::vector<double> dyv = ValuesOf(dy);
  const std::vector<double> dw0 = Reals(62, rows * h, -100, 100);

  // float32 dweight: float32 sums (at most 3 roundings into a row element, each at most
  // u32 times |dweight| + sum |dy|).
  Tensor dw32 = Make<float>({rows, h}, dw0);
  std::vector<double> sums = ValuesOf(dw32), slack(sums.size());
  for (size_t e = 0; e < slack.size(); ++e) slack[e] = std::fabs(sums[e]);
  // 16-bit dweight: one rounding after each addition, in id order.
  Tensor dw16 = Make<H>({rows, h}, dw0);
  std::vector<double> stepwise = ValuesOf(dw16);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < vocab_start || ids[i] >= vocab_end) continue;
    for (size_t j = 0; j < static_cast<size_t>(h); ++j) {
      const size_t at = static_cast<size_t>(ids[i] - vocab_start) * static_cast<size_t>(h) + j;
      const double g = dyv[i * static_cast<size_t>(h) + j];
      sums[at] += g;
      slack[at] += std::fabs(g);
      // The sum of two 16-bit values is exact in float64, so this is round-once-to-H.
      stepwise[at] = ToFloat(FromFloat<H>(static_cast<float>(stepwise[at] + g)));
    }
  }
  for (double& s : slack) s *= 4 * kU32;
  this->k_.EmbeddingBackward(dy, Ids(ids), vocab_start, vocab_end, dw32);
  EXPECT_TRUE(WithinSlack("float32 dweight", ValuesOf(dw32), sums, slack));
  EXPECT_NE(ValuesOf(dw32), ValuesOf(Make<float>({rows, h}, dw0)));
  this->k_.EmbeddingBackward(dy, Ids(ids), vocab_start, vocab_end, dw16);
  EXPECT_TRUE(TensorsNear(fmt::format("{} dweight", DTypeName(dt)), ValuesOf(dw16), stepwise));

  // Where the two differ: 2^digits has an ulp of 2, so adding 0.75 three times rounds back
  // down each time, while one rounding of the float32 sum would give 2^digits + 2.
  const double base = std::ldexp(1.0, kDigits<H>);
  const Tensor small_dy = Make<H>({3, 1}, {0.75, 0.75, 0.75});
  Tensor one_row = Make<H>({1, 1}, {base});
  this->k_.EmbeddingBackward(small_dy, Ids({0, 0, 0}), 0, 1, one_row);
  EXPECT_EQ(ValuesOf(one_row), std::vector<double>{base});
  Tensor one_row32 = Make<float>({1, 1}, {base});
  this->k_.EmbeddingBackward(small_dy, Ids({0, 0, 0}), 0, 1, one_row32);
  EXPECT_EQ(ValuesOf(one_row32), std::vector<double>{base + 2.25});
}

TYPED_TEST(EigenKernelsHalfTest, CrossEntropyPiecesWithFloat32Statistics) {
  using H = TypeParam;
  constexpr DType dt = kDType<H>;
  const int64_t rows = 4, cols = 7;
  const Tensor logits = Make<H>({rows, cols}, Reals(80, rows * cols, -6, 6));
  const std::vector<double> lv = ValuesOf(logits);
  const int64_t vocab_start = 3;                     // this shard holds columns [3, 10)
  const std::vector<int64_t> labels = {2, 9, 5, 0};  // 2 and 0 belong to another shard
  const auto at = [&](int64_t i, int64_t j) { return lv[static_cast<size_t>(i * cols + j)]; };

  // Row max of the widened logits is a 16-bit value: exact.
  Tensor row_max = this->k_.Zeros({rows}, DType::kFloat32);
  this->k_.RowMax(logits, row_max);
  std::vector<double> max(rows, -1e300);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j)
      max[static_cast<size_t>(i)] = std::max(max[static_cast<size_t>(i)], at(i, j));
  }
  EXPECT_TRUE(TensorsNear("row_max", ValuesOf(row_max), max));

  Tensor sum_exp = this->k_.Zeros({rows}, DType::kFloat32);
  Tensor sum_z = this->k_.Zeros({rows}, DType::kFloat32);
  Tensor target_z = this->k_.Zeros({rows}, DType::kFloat32);
  this->k_.CrossEntropyPartials(logits, row_max, Ids(labels), vocab_start, sum_exp, sum_z,
                                target_z);
  std::vector<double> e(rows), z(rows), t(rows), abs_z(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const size_t r = static_cast<size_t>(i);
    for (int64_t j = 0; j < cols; ++j) {
      e[r] += std::exp(at(i, j) - max[r]);
      z[r] += at(i, j) - max[r];
      abs_z[r] += std::fabs(at(i, j) - max[r]);
    }
    const int64_t col = labels[r] - vocab_start;
    if (col >= 0 && col < cols) t[r] = at(i, col) - max[r];
  }
  ASSERT_GT(Norm(z), 0);
  ASSERT_GT(Norm(t), 0);
  EXPECT_TRUE(TensorsNear("sum_exp", ValuesOf(sum_exp), e, 0, 4 * kUlpTol<float>));
  // cols float32 subtractions and cols - 1 additions, each rounding by at most u32 sum |z|.
  for (double& a : abs_z) a *= static_cast<double>(2 * cols) * kU32;
  EXPECT_TRUE(WithinSlack("sum_z", ValuesOf(sum_z), z, abs_z));
  EXPECT_TRUE(TensorsNear("target_z", ValuesOf(target_z), t));

  // Backward: float32 statistics in, a 16-bit gradient out, rounded once.
  const std::vector<double> row_scale = {0.25, 0.5, 1.0, 2.0};
  const double on = 0.9, off = 0.1 / 9;
  Tensor grad = this->k_.Zeros({rows, cols}, dt);
  this->k_.CrossEntropyBackward(logits, row_max, sum_exp, Ids(labels), vocab_start, on, off,
                                Make<float>({rows}, row_scale), grad);
  std::vector<double> expected;
  const std::vector<double> se = ValuesOf(sum_exp);
  for (int64_t i = 0; i < rows; ++i) {
    const size_t r = static_cast<size_t>(i);
    for (int64_t j = 0; j < cols; ++j) {
      const double q = j + vocab_start == labels[r] ? on : off;
      expected.push_back(row_scale[r] * (std::exp(at(i, j) - max[r]) / se[r] - q));
    }
  }
  ASSERT_GT(Norm(expected), 0);
  // The float32 test's tolerance (exp, cancellation against q) on top of the rounding.
  EXPECT_TRUE(HalfNear<H>("ce grad", ValuesOf(grad), expected, 4 * kUlpTol<float>,
                          4 * kUlpTol<float>));
  Tensor in_place = Make<H>({rows, cols}, lv);
  this->k_.CrossEntropyBackward(in_place, row_max, sum_exp, Ids(labels), vocab_start, on, off,
                                Make<float>({rows}, row_scale), in_place);
  EXPECT_EQ(Bits(in_place), Bits(grad));
}

// --- the model kernels (attention, strided copies), every dtype -----------------------
//
// One typed suite over float64, float32, bfloat16 and float16. Inputs are Philox reals
// stored in the dtype (Make rounds each once); the reference is a naive float64 loop over
// the stored values. An element passes when |actual - expected| <= kArith<T> * scale, where
// scale bounds the magnitudes of the terms that feed it (so cancellation is covered), and a
// 16-bit element gets half an ulp of its dtype on top (the one rounding to storage, as
// HalfNear): kArith is 1e-12 for float64 (a handful of 2^-53 roundings) and 1e-5 for
// float32 arithmetic (a few dozen 2^-24 roundings, and exp/sqrt within a few ulp).

template <typename T>
constexpr bool kIsHalf = std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>;
template <typename T>
constexpr double kArith = std::is_same_v<T, double> ? 1e-12 : 1e-5;

// T results against float64 values, with slack kArith<T> * scale[e] (plus half an ulp for
// 16-bit T).
template <typename T>
::testing::AssertionResult OpNear(const std::string& name, const std::vector<double>& actual,
                                  const std::vector<double>& expected,
                                  const std::vector<double>& scale) {
  std::vector<double> slack(scale.size());
  for (size_t e = 0; e < scale.size(); ++e) slack[e] = kArith<T> * scale[e];
  if constexpr (kIsHalf<T>) {
    return HalfNear<T>(name, actual, expected, slack);
  } else {
    return WithinSlack(name, actual, expected, slack);
  }
}
// Results in the compute dtype (statistics, float32 accumulators): no 16-bit rounding.
template <typename T>
::testing::AssertionResult ComputeNear(const std::string& name,
                                       const std::vector<double>& actual,
                                       const std::vector<double>& expected,
                                       const std::vector<double>& scale) {
  std::vector<double> slack(scale.size());
  for (size_t e = 0; e < scale.size(); ++e) slack[e] = kArith<T> * scale[e];
  return WithinSlack(name, actual, expected, slack);
}

std::vector<double> Abs(std::vector<double> v) {
  for (double& x : v) x = std::fabs(x);
  return v;
}

// The accumulator dtypes a T input may feed: T, and float32 for 16-bit T.
template <typename T>
std::vector<DType> AccumulatorDTypes() {
  if constexpr (kIsHalf<T>) {
    return {kDType<T>, DType::kFloat32};
  } else {
    return {kDType<T>};
  }
}

template <typename T>
class EigenKernelsModelTest : public ::testing::Test {
 protected:
  EigenKernels k_;
};
using AllDTypes = ::testing::Types<double, float, BFloat16, Float16>;
TYPED_TEST_SUITE(EigenKernelsModelTest, AllDTypes);

// The analytic backward formulas themselves, against central differences of the float64
// forward: L = sum_ij c_ij y_ij has dL/dx = the backward with dy = c. Step 1e-6: the
// truncation error (~1e-12 times the third derivative) and the cancellation error (~1e-16
// |L| / 1e-6) both stay far below the 1e-6 tolerance.
TEST(EigenKernelsModelFloat64, NormBackwardsMatchFiniteDifferences) {
  EigenKernels k;
  const int64_t n = 3, h = 7;
  const double eps = 1e-5, step = 1e-6;
  for (bool layer_norm : {true, false}) {
    SCOPED_TRACE(layer_norm ? "LayerNorm" : "RMSNorm");
    const std::vector<double> xv = Reals(130, n * h, -2, 3), wv = Reals(131, h, 0.5, 1.5),
                              bv = Reals(132, h, -1, 1), cv = Reals(133, n * h, -1, 1);
    // L(x, w, b); RMSNorm ignores b.
    const auto loss = [&](const std::vector<double>& x, const std::vector<double>& w,
                          const std::vector<double>& b) {
      Tensor y = k.Zeros({n, h}, DType::kFloat64);
      Tensor mean = k.Zeros({n}, DType::kFloat64);
      Tensor rstd = k.Zeros({n}, DType::kFloat64);
      const Tensor bias = Make<double>({h}, b);
      k.NormForward(layer_norm ? Normalization::kLayerNorm : Normalization::kRMSNorm,
                    Make<double>({n, h}, x), Make<double>({h}, w), layer_norm ? &bias : nullptr,
                    eps, y, layer_norm ? &mean : nullptr, rstd);
      double l = 0;
      const std::vector<double> yv = ValuesOf(y);
      for (size_t e = 0; e < yv.size(); ++e) l += cv[e] * yv[e];
      return l;
    };
    // (L(v + step e_i) - L(v - step e_i)) / 2 step for every i, v one of x, w, b.
    const auto central = [&](int which) {
      const std::vector<double>& v = which == 0 ? xv : which == 1 ? wv : bv;
      std::vector<double> out;
      for (size_t e = 0; e < v.size(); ++e) {
        std::vector<double> args[3] = {xv, wv, bv};
        args[which][e] = v[e] + step;
        const double up = loss(args[0], args[1], args[2]);
        args[which][e] = v[e] - step;
        out.push_back((up - loss(args[0], args[1], args[2])) / (2 * step));
      }
      return out;
    };
    const std::vector<double> fd_dx = central(0), fd_dw = central(1);
    ASSERT_GT(Norm(fd_dx), 0);

    Tensor y = k.Zeros({n, h}, DType::kFloat64);
    Tensor mean = k.Zeros({n}, DType::kFloat64);
    Tensor rstd = k.Zeros({n}, DType::kFloat64);
    Tensor dx = k.Zeros({n, h}, DType::kFloat64);
    Tensor dw = k.Zeros({h}, DType::kFloat64);
    const Tensor x = Make<double>({n, h}, xv), w = Make<double>({h}, wv);
    const Tensor c = Make<double>({n, h}, cv);
    if (layer_norm) {
      Tensor db = k.Zeros({h}, DType::kFloat64);
      const Tensor b = Make<double>({h}, bv);
      k.NormForward(Normalization::kLayerNorm, x, w, &b, eps, y, &mean, rstd);
      k.NormBackward(Normalization::kLayerNorm, x, w, &mean, rstd, c, dx, dw, &db);
      EXPECT_TRUE(TensorsNear("dbias vs finite differences", ValuesOf(db), central(2), 1e-6,
                              1e-6));
    } else {
      k.NormForward(Normalization::kRMSNorm, x, w, nullptr, eps, y, nullptr, rstd);
      k.NormBackward(Normalization::kRMSNorm, x, w, nullptr, rstd, c, dx, dw, nullptr);
    }
    EXPECT_TRUE(TensorsNear("dx vs finite differences", ValuesOf(dx), fd_dx, 1e-6, 1e-6));
    EXPECT_TRUE(TensorsNear("dweight vs finite differences", ValuesOf(dw), fd_dw, 1e-6, 1e-6));
  }
}

TYPED_TEST(EigenKernelsModelTest, BatchedGemm) {
  using T = TypeParam;
  constexpr DType dt = kDType<T>;
  const int64_t batch = 3, m = 5, n = 7, k = 6;
  for (DType c_dtype : AccumulatorDTypes<T>()) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (double alpha : {1.0, -0.7}) {
          for (double beta : {0.0, 0.3}) {
            const Shape a_shape = ta ? Shape{batch, k, m} : Shape{batch, m, k};
            const Shape b_shape = tb ? Shape{batch, n, k} : Shape{batch, k, n};
            const Tensor a = Make<T>(a_shape, Reals(140, batch * m * k));
            const Tensor b = Make<T>(b_shape, Reals(141, batch * k * n));
            Tensor c = MakeOf(c_dtype, {batch, m, n}, Reals(142, batch * m * n, -5, 5));
            const std::vector<double> av = ValuesOf(a), bv = ValuesOf(b), cv = ValuesOf(c);
            // Entry i of each operand is a plain GEMM on its slice.
            std::vector<double> expected, scale;
            const auto slice = [](const std::vector<double>& v, int64_t i, int64_t size) {
              return std::vector<double>(v.begin() + i * size, v.begin() + (i + 1) * size);
            };
            for (int64_t i = 0; i < batch; ++i) {
              const std::vector<double> ai = slice(av, i, m * k), bi = slice(bv, i, k * n),
                                        ci = slice(cv, i, m * n);
              const std::vector<double> value = NaiveGemm(ta, tb, alpha, ai, bi, beta, ci, m, n, k);
              const std::vector<double> bound = NaiveGemm(ta, tb, std::fabs(alpha), Abs(ai),
                                                          Abs(bi), beta, Abs(ci), m, n, k);
              expected.insert(expected.end(), value.begin(), value.end());
              scale.insert(scale.end(), bound.begin(), bound.end());
            }
            ASSERT_GT(Norm(expected), 0);
            this->k_.BatchedGemm(ta, tb, alpha, a, b, beta, c);
            const std::string name =
                fmt::format("batched gemm into {} ta={} tb={} alpha={} beta={}",
                            DTypeName(c_dtype), ta, tb, alpha, beta);
            if (c_dtype == dt) {
              EXPECT_TRUE(OpNear<T>(name, ValuesOf(c), expected, scale));
            } else {
              EXPECT_TRUE(ComputeNear<T>(name, ValuesOf(c), expected, scale));
            }
          }
        }
      }
    }
  }
  const Tensor a = Make<T>({batch, m, k}, Reals(143, batch * m * k));
  const Tensor b = Make<T>({batch, k, n}, Reals(144, batch * k * n));
  Tensor c = this->k_.Zeros({batch, m, n}, dt);
  Tensor c2d = this->k_.Zeros({batch * m, n}, dt);
  EXPECT_THROW(this->k_.BatchedGemm(false, false, 1, a, b, 0, c2d), std::invalid_argument);
  const Tensor b_other_batch = Make<T>({batch - 1, k, n}, Reals(144, (batch - 1) * k * n));
  EXPECT_THROW(this->k_.BatchedGemm(false, false, 1, a, b_other_batch, 0, c),
               std::invalid_argument);
  EXPECT_THROW(this->k_.BatchedGemm(false, true, 1, a, b, 0, c), std::invalid_argument);
  Tensor c64 = this->k_.Zeros({batch, m, n}, dt == DType::kFloat64 ? DType::kFloat32
                                                                   : DType::kFloat64);
  EXPECT_THROW(this->k_.BatchedGemm(false, false, 1, a, b, 0, c64), std::invalid_argument);
}

// scores [heads * sq, kv] for 2 heads: row r is query position q_pos[r % sq], column j key
// position k_pos[j], visible when k_pos[j] <= q_pos.
constexpr int64_t kHeads = 2;

struct AttentionPositions {
  const char* name;
  std::vector<int64_t> q, k;
};

// Without context parallelism (keys ascending: each row sees a prefix); cp rank 0 of 2 over
// s = 12 (chunks of 3: it holds positions 0-2 and 9-11) with every rank's keys gathered in
// rank order (a mask); and a ring step whose keys all lie after some of the queries (rows that
// see no key at all).
std::vector<AttentionPositions> PositionCases() {
  std::vector<int64_t> arange(9);
  for (int64_t i = 0; i < 9; ++i) arange[static_cast<size_t>(i)] = i;
  return {{"no cp", arange, arange},
          {"cp rank 0 of 2, keys gathered", {0, 1, 2, 9, 10, 11}, {0, 1, 2, 9, 10, 11, 3, 4, 5, 6, 7, 8}},
          {"ring step", {3, 4, 5, 6, 7, 8}, {9, 10, 11, 0, 1, 2}}};
}

bool Sees(const AttentionPositions& c, int64_t r, int64_t j) {
  return c.k[static_cast<size_t>(j)] <= c.q[static_cast<size_t>(r) % c.q.size()];
}

// `call` throws std::invalid_argument whose message holds `expected`.
template <typename Call>
void ExpectRefused(Call&& call, const std::string& expected) {
  try {
    call();
    ADD_FAILURE() << "not refused; expected: " << expected;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
}

// The causal softmax of every row in float64.
std::vector<double> NaiveCausalSoftmax(const std::vector<double>& s, int64_t rows,
                                       const AttentionPositions& c, double scale) {
  const auto kv = static_cast<int64_t>(c.k.size());
  std::vector<double> p(s.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const auto at = [&](int64_t j) { return s[static_cast<size_t>(r * kv + j)]; };
    double m = -1e300, sum = 0;
    for (int64_t j = 0; j < kv; ++j) {
      if (Sees(c, r, j)) m = std::max(m, scale * at(j));
    }
    for (int64_t j = 0; j < kv; ++j) {
      if (Sees(c, r, j)) sum += std::exp(scale * at(j) - m);
    }
    for (int64_t j = 0; j < kv; ++j) {
      if (Sees(c, r, j)) p[static_cast<size_t>(r * kv + j)] = std::exp(scale * at(j) - m) / sum;
    }
  }
  return p;
}

TYPED_TEST(EigenKernelsModelTest, CausalSoftmaxForward) {
  using T = TypeParam;
  constexpr DType dt = kDType<T>;
  const double scale = 0.35;
  for (const AttentionPositions& c : PositionCases()) {
    SCOPED_TRACE(c.name);
    const auto sq = static_cast<int64_t>(c.q.size()), kv = static_cast<int64_t>(c.k.size());
    const int64_t rows = kHeads * sq;
    const Tensor q_pos = Ids(c.q), k_pos = Ids(c.k);
    const Tensor scores = Make<T>({kHeads, sq, kv}, Reals(150, rows * kv, -6, 6));
    const std::vector<double> expected = NaiveCausalSoftmax(ValuesOf(scores), rows, c, scale);
    // Overwritten.
    Tensor probs = Make<T>({rows, kv}, std::vector<double>(static_cast<size_t>(rows * kv), 7.0));
    this->k_.CausalSoftmaxForward(scores, q_pos, k_pos, scale, probs);
    const std::vector<double> pv = ValuesOf(probs);
    // exp(z - m) with |z|, |m| <= 2.1: relative errors of a few ulp of the compute dtype.
    EXPECT_TRUE(OpNear<T>("causal softmax", pv, expected, expected));
    for (int64_t r = 0; r < rows; ++r) {
      double row_sum = 0;
      bool sees_any = false;
      for (int64_t j = 0; j < kv; ++j) {
        const double p = pv[static_cast<size_t>(r * kv + j)];
        if (!Sees(c, r, j)) {
          EXPECT_EQ(p, 0.0) << "masked (" << r << ", " << j << ")";
          EXPECT_FALSE(std::signbit(p)) << "masked (" << r << ", " << j << ") is -0";
        }
        sees_any = sees_any || Sees(c, r, j);
        row_sum += p;
      }
      // kv 16-bit roundings of at most half an ulp of 1 each; a row that sees no key is 0.
      const double tol =
          kIsHalf<T> ? static_cast<double>(kv) * 0.5 * UlpAt<BFloat16>(1.0) : 10 * kArith<T>;
      EXPECT_NEAR(row_sum, sees_any ? 1.0 : 0.0, tol) << "row " << r;
    }
    Tensor in_place = Make<T>({rows, kv}, ValuesOf(scores));
    this->k_.CausalSoftmaxForward(in_place, q_pos, k_pos, scale, in_place);
    EXPECT_EQ(ValuesOf(in_place), pv);

    // k_pos must have one position per column, q_pos divide the rows.
    EXPECT_THROW(this->k_.CausalSoftmaxForward(scores, q_pos, Ids({0, 1}), scale, probs),
                 std::invalid_argument);
    Tensor odd_rows = this->k_.Zeros({rows - 1, kv}, dt);
    EXPECT_THROW(this->k_.CausalSoftmaxForward(odd_rows, q_pos, k_pos, scale, odd_rows),
                 std::invalid_argument);
    Tensor wrong = this->k_.Zeros({rows, kv + 1}, dt);
    EXPECT_THROW(this->k_.CausalSoftmaxForward(scores, q_pos, k_pos, scale, wrong),
                 std::invalid_argument);
    EXPECT_THROW(this->k_.CausalSoftmaxForward(scores,
                                               Make<T>({sq}, std::vector<double>(c.q.size())),
                                               k_pos, scale, probs),
                 std::invalid_argument);  // positions are int64
  }
  // Each refusal names the positions and what is allowed.
  const Tensor scores = this->k_.Zeros({4, 2}, dt);
  Tensor probs = this->k_.Zeros({4, 2}, dt);
  Tensor q2 = Tensor::HostEmpty({2, 1}, DType::kInt64);  // 2-D
  q2.data_as<int64_t>()[0] = 0;
  q2.data_as<int64_t>()[1] = 1;
  ExpectRefused([&] { this->k_.CausalSoftmaxForward(scores, q2, Ids({0, 1}), 1.0, probs); },
                "q_pos [2, 1] must be 1-D with at least one position, dividing the 4 rows of "
                "scores [4, 2]");
  Tensor k2 = Tensor::HostEmpty({1, 2}, DType::kInt64);
  k2.data_as<int64_t>()[0] = 0;
  k2.data_as<int64_t>()[1] = 1;
  ExpectRefused([&] { this->k_.CausalSoftmaxForward(scores, Ids({0, 1}), k2, 1.0, probs); },
                "k_pos [1, 2] must be 1-D");
  ExpectRefused([&] { this->k_.CausalSoftmaxForward(scores, Ids({}), Ids({0, 1}), 1.0, probs); },
                "q_pos [0] must be 1-D with at least one position");
  ExpectRefused(
      [&] {
        this->k_.CausalSoftmaxForward(scores, Make<T>({2}, {0, 1}), Ids({0, 1}), 1.0, probs);
      },
      "q_pos is " + std::string(DTypeName(dt)) + " but must be int64");
}

TYPED_TEST(EigenKernelsModelTest, CausalSoftmaxBackward) {
  using T = TypeParam;
  constexpr DType dt = kDType<T>;
  const double scale = 0.35;
  for (const AttentionPositions& c : PositionCases()) {
    SCOPED_TRACE(c.name);
    const auto sq = static_cast<int64_t>(c.q.size()), kv = static_cast<int64_t>(c.k.size());
    const int64_t rows = kHeads * sq;
    const Tensor q_pos = Ids(c.q), k_pos = Ids(c.k);
    Tensor probs = this->k_.Zeros({rows, kv}, dt);
    this->k_.CausalSoftmaxForward(Make<T>({rows, kv}, Reals(160, rows * kv, -6, 6)), q_pos,
                                  k_pos, 1.0, probs);
    // dprobs is nonzero at masked positions too: they must not leak into the result.
    const Tensor dprobs = Make<T>({rows, kv}, Reals(161, rows * kv, -2, 2));
    const std::vector<double> p = ValuesOf(probs), dp = ValuesOf(dprobs);
    std::vector<double> expected(p.size(), 0.0), bound(p.size(), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const size_t row = static_cast<size_t>(r * kv);
      double dot = 0, abs_dot = 0;
      for (int64_t j = 0; j < kv; ++j) {
        if (!Sees(c, r, j)) continue;
        dot += p[row + static_cast<size_t>(j)] * dp[row + static_cast<size_t>(j)];
        abs_dot += std::fabs(p[row + static_cast<size_t>(j)] * dp[row + static_cast<size_t>(j)]);
      }
      for (int64_t j = 0; j < kv; ++j) {
        if (!Sees(c, r, j)) continue;
        const size_t e = row + static_cast<size_t>(j);
        expected[e] = scale * p[e] * (dp[e] - dot);
        bound[e] = scale * p[e] * (std::fabs(dp[e]) + abs_dot);
      }
    }
    ASSERT_GT(Norm(expected), 0);
    Tensor dscores = this->k_.Zeros({rows, kv}, dt);
    this->k_.CausalSoftmaxBackward(probs, dprobs, q_pos, k_pos, scale, dscores);
    const std::vector<double> ds = ValuesOf(dscores);
    EXPECT_TRUE(OpNear<T>("causal softmax backward", ds, expected, bound));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < kv; ++j) {
        if (!Sees(c, r, j)) {
          EXPECT_EQ(ds[static_cast<size_t>(r * kv + j)], 0.0) << "masked (" << r << ", " << j << ")";
        }
      }
    }
    // In place over either input.
    Tensor over_dprobs = Make<T>({rows, kv}, dp);
    this->k_.CausalSoftmaxBackward(probs, over_dprobs, q_pos, k_pos, scale, over_dprobs);
    EXPECT_EQ(ValuesOf(over_dprobs), ds);
    Tensor over_probs = Make<T>({rows, kv}, p);
    this->k_.CausalSoftmaxBackward(over_probs, dprobs, q_pos, k_pos, scale, over_probs);
    EXPECT_EQ(ValuesOf(over_probs), ds);
    Tensor short_dprobs = this->k_.Zeros({rows - sq, kv}, dt);
    EXPECT_THROW(
        this->k_.CausalSoftmaxBackward(probs, short_dprobs, q_pos, k_pos, scale, dscores),
        std::invalid_argument);
  }
}

// gpt-oss's softmax, worked by hand: a sliding window of 1 (a row sees itself and the key
// before it) and a sink per head. q_pos [3, 1] (sq 2), keys 0..3, scale 1, four rows: rows 0
// and 1 of head 0 (sink 0), rows 2 and 3 of head 1 (sink 2). The keys each row sees have
// equal logits, so with the sink's term each is 1/3 (1/2 without the sink); the large
// scores outside the window (row 0's 5, row 2's 9) and after the query (rows 1 and 3) would
// take the row if not masked.
TYPED_TEST(EigenKernelsModelTest, SlidingWindowAndSinkByHand) {
  using T = TypeParam;
  constexpr DType dt = kDType<T>;
  // 1/3 rounded once to T (half an ulp), the logs in the compute type.
  const double tol = kIsHalf<T> ? UlpAt<T>(1.0 / 3.0) : 10 * kArith<T>;
  const Tensor q_pos = Ids({3, 1}), k_pos = Ids({0, 1, 2, 3});
  const Tensor sink = Make<T>({2}, {0.0, 2.0});
  const Tensor scores = Make<T>({4, 4}, {5, -7, 0, 0,  //
                                         0, 0, 9, 9,   //
                                         9, 9, 2, 2,   //
                                         2, 2, -9, 9});
  Tensor probs = this->k_.Zeros({4, 4}, dt);
  Tensor lse = this->k_.Zeros({4}, ComputeDType(dt));
  this->k_.CausalSoftmaxForward(scores, q_pos, k_pos, 1.0, probs, &lse, 1, &sink);
  const double t = 1.0 / 3.0;
  const std::vector<double> expected = {0, 0, t, t, t, t, 0, 0, 0, 0, t, t, t, t, 0, 0};
  const std::vector<double> pv = ValuesOf(probs);
  for (size_t e = 0; e < expected.size(); ++e) EXPECT_NEAR(pv[e], expected[e], tol) << e;
  const std::vector<double> lv = ValuesOf(lse);
  const double l3 = std::log(3.0);
  const std::vector<double> expected_lse = {l3, l3, 2 + l3, 2 + l3};
  for (size_t r = 0; r < 4; ++r)
    EXPECT_NEAR(lv[r], expected_lse[r], 10 * kArith<ops::ComputeOf<T>>) << r;

  // The backward masks by the same window: probs 1/2 on the masked keys 0 and 1 of row 0
  // (q = 3) leave dscores 0 there and out of the row's dot = 1/3 * 3 + 1/3 * 0 = 1, so
  // dscores = p (dp - 1) = 2/3, -1/3 (with keys 0 and 1 the dot would be 2).
  const Tensor p0 = Make<T>({1, 4}, {0.5, 0.5, t, t});
  const Tensor dp0 = Make<T>({1, 4}, {1, 1, 3, 0});
  Tensor ds = this->k_.Zeros({1, 4}, dt);
  this->k_.CausalSoftmaxBackward(p0, dp0, Ids({3}), k_pos, 1.0, ds, nullptr, 1);
  const std::vector<double> dsv = ValuesOf(ds);
  const std::vector<double> expected_ds = {0, 0, 2 * t, -t};
  for (size_t e = 0; e < 4; ++e) EXPECT_NEAR(dsv[e], expected_ds[e], 4 * tol) << e;

  // The sink's gradient, -exp(o - lse) dot per row: the sink's probability is 1/3 in every
  // row; row dots 1, 2 (head 0) and 3, 0 (head 1) give -1 and -1, added to 1/2 and 1/4.
  const Tensor dots = this->k_.ToDevice(MakeOf(ComputeDType(dt), {4}, {1, 2, 3, 0}));
  Tensor dsink = Make<T>({2}, {0.5, 0.25});
  this->k_.SoftmaxSinkGrad(sink, lse, dots, 2, dsink);
  const std::vector<double> dv = ValuesOf(dsink);
  EXPECT_NEAR(dv[0], -0.5, 8 * tol);
  EXPECT_NEAR(dv[1], -0.75, 8 * tol);

  ExpectRefused([&] { this->k_.CausalSoftmaxForward(scores, q_pos, k_pos, 1.0, probs, &lse, -2); },
                "window = -2 must be -1 (none) or >= 0");
  const Tensor three = Make<T>({3}, {0, 0, 0});
  ExpectRefused(
      [&] { this->k_.CausalSoftmaxForward(scores, q_pos, k_pos, 1.0, probs, &lse, 1, &three); },
      "sink [3] must be [heads] with heads dividing the 4 rows / 2 query positions");
}

// Rotary embedding of the first `dim` of d columns in float64: theta = p / base^(2i/dim) for
// row r's position p = pos[r % pos.size()], cos and sin unrounded, the other columns copied;
// `scale` gets the magnitudes |x c| + |x' s| of each result's terms.
// Context parallelism's p2p ring: a row's keys come in blocks. Each block's softmax with its
// log-sum-exp (CausalSoftmaxForward with lse), merged by LseMerge, gives the attention output
// and the log-sum-exp of all the keys; CausalSoftmaxFromLse gives a block's share of the full
// softmax; CausalSoftmaxBackward with the full row's RowDot gives the full backward's
// columns of the block. Against float64 loops, for every position case, the keys in two
// blocks (rows of the ring step see no key of the first).
TYPED_TEST(EigenKernelsModelTest, RingBlocksMergeToTheFullSoftmax) {
  using T = TypeParam;
  constexpr DType dt = kDType<T>;
  const DType ct = ComputeDType(dt);
  const double scale = 0.35;
  const int64_t d = 3;  // channels of the values
  for (const AttentionPositions& c : PositionCases()) {
    SCOPED_TRACE(c.name);
    const auto sq = static_cast<int64_t>(c.q.size()), kv = static_cast<int64_t>(c.k.size());
    const int64_t rows = kHeads * sq, half = kv / 2;
    // Scores as stored (rounded to T), so that the float64 truths see what the kernels see.
    const std::vector<double> sv = ValuesOf(Make<T>({rows * kv}, Reals(170, rows * kv, -6, 6)));
    const std::vector<double> vv = Reals(171, kv * d, -1, 1);
    const std::vector<double> dpv = Reals(172, rows * kv, -2, 2);
    const std::vector<double> full = NaiveCausalSoftmax(sv, rows, c, scale);
    // float64 truths: each row's lse over all its keys (-inf when none), out = P V, and the
    // backward's row dot sum_j P dP.
    std::vector<double> lse(static_cast<size_t>(rows), -INFINITY);
    std::vector<double> out(static_cast<size_t>(rows * d), 0.0);
    std::vector<double> dot(static_cast<size_t>(rows), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      double m = -INFINITY;
      for (int64_t j = 0; j < kv; ++j) {
        if (Sees(c, r, j)) m = std::max(m, scale * sv[static_cast<size_t>(r * kv + j)]);
      }
      double sum = 0;
      for (int64_t j = 0; j < kv; ++j) {
        if (!Sees(c, r, j)) continue;
        const auto e = static_cast<size_t>(r * kv + j);
        sum += std::exp(scale * sv[e] - m);
        dot[static_cast<size_t>(r)] += full[e] * dpv[e];
        for (int64_t x = 0; x < d; ++x) {
          out[static_cast<size_t>(r * d + x)] += full[e] * vv[static_cast<size_t>(j * d + x)];
        }
      }
      if (sum > 0) lse[static_cast<size_t>(r)] = m + std::log(sum);
    }
    // The blocks: columns [0, half) and [half, kv) of scores, dprobs and the full softmax.
    const auto columns = [&](const std::vector<double>& v, int64_t begin, int64_t end) {
      std::vector<double> block;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = begin; j < end; ++j) block.push_back(v[static_cast<size_t>(r * kv + j)]);
      }
      return block;
    };
    Tensor merged = this->k_.Zeros({rows, d}, dt);
    // Each block's stored partial output and lse, for the merge's own formula.
    std::vector<std::pair<std::vector<double>, std::vector<double>>> parts;
    // The running output starts empty: every row's lse -inf.
    Tensor merged_lse = MakeOf(ct, {rows}, std::vector<double>(static_cast<size_t>(rows), -INFINITY));
    for (const auto& [begin, end] : {std::pair<int64_t, int64_t>{0, half}, {half, kv}}) {
      const int64_t w = end - begin;
      const AttentionPositions block_case{
          c.name, c.q, std::vector<int64_t>(c.k.begin() + begin, c.k.begin() + end)};
      const Tensor k_pos = Ids(block_case.k), q_pos = Ids(c.q);
      const Tensor scores = Make<T>({rows, w}, columns(sv, begin, end));
      // The block's own softmax and lse.
      Tensor probs = this->k_.Zeros({rows, w}, dt);
      Tensor block_lse = this->k_.Zeros({rows}, ct);
      this->k_.CausalSoftmaxForward(scores, q_pos, k_pos, scale, probs, &block_lse);
      const std::vector<double> pb = ValuesOf(probs), lb = ValuesOf(block_lse);
      const std::vector<double> stored = ValuesOf(scores);
      EXPECT_TRUE(OpNear<T>("block softmax", pb,
                            NaiveCausalSoftmax(ValuesOf(scores), rows, block_case, scale), pb));
      for (int64_t r = 0; r < rows; ++r) {
        double m = -INFINITY, sum = 0;
        const auto at = [&](int64_t j) { return stored[static_cast<size_t>(r * w + j)]; };
        for (int64_t j = 0; j < w; ++j) {
          if (Sees(block_case, r, j)) m = std::max(m, scale * at(j));
        }
        for (int64_t j = 0; j < w; ++j) {
          if (Sees(block_case, r, j)) sum += std::exp(scale * at(j) - m);
        }
        const double want = sum > 0 ? m + std::log(sum) : -INFINITY;
        if (std::isinf(want)) {
          EXPECT_EQ(lb[static_cast<size_t>(r)], want) << "row " << r << " sees no key of the block";
        } else {
          EXPECT_NEAR(lb[static_cast<size_t>(r)], want, 4 * kArith<T> * (1 + std::fabs(want)))
              << "row " << r;
        }
      }
      // The block's partial output P_b V_b, in float64 from the stored probabilities.
      std::vector<double> part(static_cast<size_t>(rows * d), 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < w; ++j) {
          for (int64_t x = 0; x < d; ++x) {
            part[static_cast<size_t>(r * d + x)] +=
                pb[static_cast<size_t>(r * w + j)] * vv[static_cast<size_t>((begin + j) * d + x)];
          }
        }
      }
      const Tensor part_stored = Make<T>({rows, d}, part);
      parts.push_back({ValuesOf(part_stored), lb});
      this->k_.LseMerge(merged, merged_lse, part_stored, block_lse);
      // The full softmax's share in this block, from the full lse.
      Tensor full_lse = MakeOf(ct, {rows}, lse);
      Tensor share = this->k_.Zeros({rows, w}, dt);
      this->k_.CausalSoftmaxFromLse(scores, full_lse, q_pos, k_pos, scale, share);
      const std::vector<double> want_share = columns(full, begin, end);
      EXPECT_TRUE(OpNear<T>("share of the full softmax", ValuesOf(share), want_share, want_share));
      // The full backward's columns of this block, with the full row dot.
      const Tensor p_full = Make<T>({rows, w}, want_share);
      const Tensor dprobs = Make<T>({rows, w}, columns(dpv, begin, end));
      Tensor row_dot = MakeOf(ct, {rows}, dot);
      Tensor dscores = this->k_.Zeros({rows, w}, dt);
      this->k_.CausalSoftmaxBackward(p_full, dprobs, q_pos, k_pos, scale, dscores, &row_dot);
      const std::vector<double> pf = ValuesOf(p_full), dp = ValuesOf(dprobs);
      std::vector<double> want_ds(pf.size(), 0.0), bound(pf.size(), 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < w; ++j) {
          if (!Sees(block_case, r, j)) continue;
          const auto e = static_cast<size_t>(r * w + j);
          want_ds[e] = scale * pf[e] * (dp[e] - dot[static_cast<size_t>(r)]);
          bound[e] = scale * pf[e] * (std::fabs(dp[e]) + std::fabs(dot[static_cast<size_t>(r)]));
        }
      }
      EXPECT_TRUE(OpNear<T>("block backward with the row dot", ValuesOf(dscores), want_ds, bound));
    }
    // Merged over both blocks: LseMerge's formula on the stored parts (one rounding), and in
    // float32 and float64 the full attention output itself.
    const std::vector<double> mo = ValuesOf(merged), ml = ValuesOf(merged_lse);
    std::vector<double> formula(out.size(), 0.0), magnitude(out.size(), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const double la = parts[0].second[static_cast<size_t>(r)];
      const double lb = parts[1].second[static_cast<size_t>(r)];
      const double n = std::isinf(la) && std::isinf(lb) ? -INFINITY
                       : std::isinf(la)                 ? lb
                       : std::isinf(lb)                 ? la
                                        : std::max(la, lb) + std::log(std::exp(la - std::max(la, lb)) +
                                                                      std::exp(lb - std::max(la, lb)));
      for (int64_t x = 0; x < d; ++x) {
        const auto e = static_cast<size_t>(r * d + x);
        const double a_part = std::isinf(la) ? 0.0 : parts[0].first[e] * std::exp(la - n);
        const double b_part = std::isinf(lb) ? 0.0 : parts[1].first[e] * std::exp(lb - n);
        formula[e] = a_part + b_part;
        magnitude[e] = std::fabs(a_part) + std::fabs(b_part);
      }
    }
    EXPECT_TRUE(OpNear<T>("merged output (the formula)", mo, formula, magnitude));
    if constexpr (!kIsHalf<T>) {
      std::vector<double> out_scale(out.size(), 1.0);
      EXPECT_TRUE(OpNear<T>("merged output (the full attention)", mo, out, out_scale));
    }
    for (int64_t r = 0; r < rows; ++r) {
      const double want = lse[static_cast<size_t>(r)];
      if (std::isinf(want)) {
        EXPECT_EQ(ml[static_cast<size_t>(r)], want) << "row " << r;
        for (int64_t x = 0; x < d; ++x) EXPECT_EQ(mo[static_cast<size_t>(r * d + x)], 0.0);
      } else {
        EXPECT_NEAR(ml[static_cast<size_t>(r)], want, 8 * kArith<T> * (1 + std::fabs(want)))
            << "row " << r;
      }
    }
    // RowDot of the full softmax and dprobs: the row dots above.
    const Tensor a = Make<T>({rows, kv}, full), b = Make<T>({rows, kv}, dpv);
    const std::vector<double> av = ValuesOf(a), bv = ValuesOf(b);  // as stored
    std::vector<double> want_dot(dot.size(), 0.0), dot_scale(dot.size(), 0.0);
    for (size_t e = 0; e < av.size(); ++e) {
      want_dot[e / static_cast<size_t>(kv)] += av[e] * bv[e];
      dot_scale[e / static_cast<size_t>(kv)] += std::fabs(av[e] * bv[e]);
    }
    Tensor dots = this->k_.Zeros({rows}, ct);
    this->k_.RowDot(a, b, dots);
    EXPECT_TRUE(ComputeNear<T>("row dot", ValuesOf(dots), want_dot, dot_scale));
  }
  // Refusals: lse in the storage dtype of 16-bit scores, or of the wrong length.
  const Tensor scores = this->k_.Zeros({4, 2}, dt);
  Tensor probs = this->k_.Zeros({4, 2}, dt);
  Tensor short_lse = this->k_.Zeros({3}, ct);
  ExpectRefused(
      [&] { this->k_.CausalSoftmaxForward(scores, Ids({0, 1}), Ids({0, 1}), 1.0, probs, &short_lse); },
      "lse [3] has 3 elements, expected 4 (one per row of scores)");
  Tensor out = this->k_.Zeros({4, 2}, dt), lse4 = this->k_.Zeros({4}, ct);
  ExpectRefused([&] { this->k_.LseMerge(out, lse4, out, lse4); }, "out shares storage with part");
  ExpectRefused(
      [&] { this->k_.CausalSoftmaxFromLse(scores, short_lse, Ids({0, 1}), Ids({0, 1}), 1.0, probs); },
      "lse [3] has 3 elements, expected 4 (one per row of scores)");
  Tensor flat = this->k_.Zeros({8}, dt);
  ExpectRefused(
      [&] { this->k_.CausalSoftmaxFromLse(scores, lse4, Ids({0, 1}), Ids({0, 1}), 1.0, flat); },
      "probs [8] must be 4 x 2 (the 2-D shape of scores)");
  Tensor dscores = this->k_.Zeros({4, 2}, dt);
  ExpectRefused(
      [&] {
        this->k_.CausalSoftmaxBackward(probs, scores, Ids({0, 1}), Ids({0, 1}), 1.0, dscores,
                                       &short_lse);
      },
      "row_dot [3] has 3 elements, expected 4 (one per row of probs)");
  ExpectRefused([&] { this->k_.RowDot(scores, probs, short_lse); },
                "out [3] has 3 elements, expected 4 (one per row of a)");
  const Tensor wide = this->k_.Zeros({4, 3}, dt);
  ExpectRefused([&] { this->k_.RowDot(scores, wide, lse4); },
                "b [4, 3] must be 4 x 2 (the 2-D shape of a)");
}

// TopK against a sort by (score descending, column ascending), NaN first: hand-picked rows
// with ties, infinities and NaN, then many small integer scores (ties everywhere), exact in
// every dtype.
TYPED_TEST(EigenKernelsModelTest, TopKRanksScoresWithTheTieRule) {
  using T = TypeParam;
  const DType dt = kDType<T>;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const auto run = [&](int64_t rows, int64_t n, int64_t k, const std::vector<double>& v) {
    Tensor values = this->k_.Zeros({rows, k}, dt);
    Tensor indices = this->k_.Zeros({rows, k}, DType::kInt64);
    this->k_.TopK(Make<T>({rows, n}, v), k, values, indices);
    return std::pair{ValuesOf(values),
                     std::vector<int64_t>(indices.data_as<int64_t>(),
                                          indices.data_as<int64_t>() + rows * k)};
  };
  const auto [v3, i3] = run(3, 6, 3, {1, 3, 3, 2, 5, 0,  //
                                      nan, -1, 7, nan, 7, 7,  //
                                      -inf, -2, -2, -2, -3, inf});
  EXPECT_EQ(i3, (std::vector<int64_t>{4, 1, 2, 0, 3, 2, 5, 1, 2}));
  EXPECT_EQ(v3[0], 5);
  EXPECT_EQ(v3[1], 3);
  EXPECT_TRUE(std::isnan(v3[3]) && std::isnan(v3[4]));
  EXPECT_EQ(v3[5], 7);
  EXPECT_EQ(v3[6], inf);
  // Every k of many rows of scores in {-2, ..., 2}.
  const int64_t rows = 23, n = 11;
  const std::vector<double> v = Ints(60, rows * n, -2, 2);
  for (int64_t k = 1; k <= n; ++k) {
    const auto [got_v, got_i] = run(rows, n, k, v);
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int64_t> order(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) order[static_cast<size_t>(j)] = j;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return v[static_cast<size_t>(r * n + a)] > v[static_cast<size_t>(r * n + b)];
      });
      for (int64_t j = 0; j < k; ++j) {
        const auto at = static_cast<size_t>(r * k + j);
        ASSERT_EQ(got_i[at], order[static_cast<size_t>(j)]) << "k " << k << " row " << r;
        ASSERT_EQ(got_v[at], v[static_cast<size_t>(r * n + got_i[at])]);
      }
    }
  }
  // Refusals: k out of range, indices not int64, values of the wrong shape.
  const Tensor scores = Make<T>({2, 3}, Ints(61, 6));
  Tensor values = this->k_.Zeros({2, 2}, dt), indices = this->k_.Zeros({2, 2}, DType::kInt64);
  ExpectRefused([&] { this->k_.TopK(scores, 0, values, indices); },
                "k = 0 must be in [1, 3] (the columns of scores [2, 3])");
  ExpectRefused([&] { this->k_.TopK(scores, 4, values, indices); },
                "k = 4 must be in [1, 3]");
  Tensor float_indices = this->k_.Zeros({2, 2}, dt);
  ExpectRefused([&] { this->k_.TopK(scores, 2, values, float_indices); },
                "indices is " + std::string(DTypeName(dt)) + " but must be int64");
  ExpectRefused([&] { this->k_.TopK(scores, 1, values, indices); },
                "values [2, 2] must be 2 x 1 (rows of scores by k)");
}

std::vector<double> NaiveRope(const std::vector<double>& x, int64_t rows, int64_t d, int64_t dim,
                              const std::vector<int64_t>& pos, double base, bool inverse,
                              std::vector<double>* scale) {
  const auto seq = static_cast<int64_t>(pos.size());
  std::vector<double> y = x;
  scale->assign(x.size(), 0.0);
  const int64_t half = dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < half; ++i) {
      const double theta = static_cast<double>(pos[static_cast<size_t>(r % seq)]) /
                           std::pow(base, static_cast<double>(2 * i) / static_cast<double>(dim));
      const double c = std::cos(theta);
      const double s = inverse ? -std::sin(theta) : std::sin(theta);
      const size_t lo = static_cast<size_t>(r * d + i), hi = lo + static_cast<size_t>(half);
      y[lo] = x[lo] * c - x[hi] * s;
      y[hi] = x[hi] * c + x[lo] * s;
      (*scale)[lo] = (*scale)[hi] = std::fabs(x[lo] * c) + std::fabs(x[hi] * s) +
                                    std::fabs(x[hi] * c) + std::fabs(x[lo] * s);
    }
  }
  return y;
}

TYPED_TEST(EigenKernelsModelTest, RopeForwardInverseInPlace) {
  using T = TypeParam;
  constexpr DType dt = kDType<T>;
  const int64_t seq = 5, rows = 3 * seq, d = 8;
  const Tensor x = Make<T>({3, seq, d}, Reals(170, rows * d));
  const std::vector<double> xv = ValuesOf(x);
  // Positions 0..4, and a context-parallel rank's (not ascending, not contiguous).
  const std::vector<std::vector<int64_t>> position_sets = {{0, 1, 2, 3, 4}, {0, 7, 8, 15, 2}};
  // dim 4 of 8: rotary_percent 0.5; the last 4 columns of every row pass through unchanged.
  for (const auto& [base, dim, set] :
       {std::tuple{10000.0, d, 0}, {3.0, d, 0}, {10000.0, d / 2, 0}, {10000.0, d, 1}}) {
    const std::vector<int64_t>& positions = position_sets[static_cast<size_t>(set)];
    const Tensor pos = Ids(positions);
    for (bool inverse : {false, true}) {
      SCOPED_TRACE(fmt::format("base {} dim {} positions {} inverse {}", base, dim, set, inverse));
      std::vector<double> scale;
      const std::vector<double> expected =
          NaiveRope(xv, rows, d, dim, positions, base, inverse, &scale);
      Tensor y = this->k_.Zeros({rows, d}, dt);
      this->k_.Rope(x, pos, base, dim, inverse, y);
      const std::vector<double> yv = ValuesOf(y);
      EXPECT_TRUE(OpNear<T>("rope", yv, expected, scale));
      EXPECT_NE(yv, xv);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = dim; j < d; ++j) {
          const size_t e = static_cast<size_t>(r * d + j);
          EXPECT_EQ(yv[e], xv[e]) << "passed-through row " << r << " col " << j;
        }
      }
      // Position 0 (rows 0, seq, 2 seq) is not rotated: cos 0 = 1, sin 0 = 0 exactly.
      for (int64_t r = 0; r < rows; r += seq) {
        for (int64_t j = 0; j < d; ++j) {
          const size_t e = static_cast<size_t>(r * d + j);
          EXPECT_EQ(yv[e], xv[e]) << "row " << r << " col " << j;
        }
      }
      Tensor in_place = Make<T>({rows, d}, xv);
      this->k_.Rope(in_place, pos, base, dim, inverse, in_place);
      EXPECT_EQ(ValuesOf(in_place), yv);
    }
    // The inverse undoes the forward (a rotation and its transpose): up to the roundings of
    // the stored intermediate and result, two for 16-bit dtypes.
    Tensor round_trip = Make<T>({rows, d}, xv);
    this->k_.Rope(round_trip, pos, base, dim, false, round_trip);
    this->k_.Rope(round_trip, pos, base, dim, true, round_trip);
    double max_abs = 0;
    for (double v : xv) max_abs = std::max(max_abs, std::fabs(v));
    double tol = 4 * kArith<T> * max_abs;
    if constexpr (kIsHalf<T>) tol += 2 * UlpAt<T>(max_abs);
    EXPECT_TRUE(TensorsNear(fmt::format("inverse(forward(x)) base {} dim {}", base, dim),
                            ValuesOf(round_trip), xv, tol));
  }
  const Tensor pos = Ids(position_sets[0]);
  Tensor odd = this->k_.Zeros({rows, d - 1}, dt);
  EXPECT_THROW(this->k_.Rope(odd, pos, 10000, d - 1, false, odd), std::invalid_argument);
  Tensor y = this->k_.Zeros({rows, d}, dt);
  // 4 positions do not divide the 15 rows.
  EXPECT_THROW(this->k_.Rope(x, Ids({0, 1, 2, 3}), 10000, d, false, y), std::invalid_argument);
  EXPECT_THROW(this->k_.Rope(x, pos, 0.0, d, false, y), std::invalid_argument);
  for (const int64_t dim : {int64_t{0}, int64_t{3}, d + 2}) {
    EXPECT_THROW(this->k_.Rope(x, pos, 10000, dim, false, y), std::invalid_argument) << dim;
  }
  ExpectRefused([&] { this->k_.Rope(x, Make<T>({5}, {0, 1, 2, 3, 4}), 10000, d, false, y); },
                "pos is " + std::string(DTypeName(dt)) + " but must be int64");
}

// StridedCopy moves bits: compared exactly, in every dtype.
TYPED_TEST(EigenKernelsModelTest, StridedCopyPermutes5D) {
  using T = TypeParam;
  constexpr DType dt = kDType<T>;
  // src [2, 3, 4, 5, 6] contiguous -> dst = src.permute(2, 0, 4, 1, 3), shape [4, 2, 6, 3, 5].
  const std::vector<int64_t> dims = {2, 3, 4, 5, 6};
  const std::vector<int64_t> src_strides = {360, 120, 30, 6, 1};
  const std::vector<int64_t> dst_strides = {90, 5, 180, 1, 15};
  const Tensor src = Make<T>({2, 3, 4, 5, 6}, Reals(190, 720));
  const std::vector<double> sv = ValuesOf(src);
  std::vector<double> expected(720);
  for (int64_t i0 = 0; i0 < 2; ++i0) {
    for (int64_t i1 = 0; i1 < 3; ++i1) {
      for (int64_t i2 = 0; i2 < 4; ++i2) {
        for (int64_t i3 = 0; i3 < 5; ++i3) {
          for (int64_t i4 = 0; i4 < 6; ++i4) {
            const int64_t to = (((i2 * 2 + i0) * 6 + i4) * 3 + i1) * 5 + i3;
            const int64_t from = (((i0 * 3 + i1) * 4 + i2) * 5 + i3) * 6 + i4;
            expected[static_cast<size_t>(to)] = sv[static_cast<size_t>(from)];
          }
        }
      }
    }
  }
  Tensor dst = this->k_.Zeros({4, 2, 6, 3, 5}, dt);
  this->k_.StridedCopy(src, 0, dims, src_strides, dst, 0, dst_strides);
  EXPECT_TRUE(TensorsNear("permute(2, 0, 4, 1, 3)", ValuesOf(dst), expected));

  // A sub-block with offsets on both sides leaves the rest of dst untouched: src rows 1..2,
  // cols 3..6 of a [4, 8] matrix into dst rows 0..1, cols 1..4 of a [3, 6] one.
  const Tensor m = Make<T>({4, 8}, Reals(191, 32));
  Tensor block = Make<T>({3, 6}, std::vector<double>(18, -9.0));
  this->k_.StridedCopy(m, 1 * 8 + 3, {2, 4}, {8, 1}, block, 1, {6, 1});
  std::vector<double> expected_block(18, -9.0);
  const std::vector<double> mv = ValuesOf(m);
  for (size_t i = 0; i < 2; ++i) {
    for (size_t j = 0; j < 4; ++j) expected_block[i * 6 + 1 + j] = mv[(1 + i) * 8 + 3 + j];
  }
  EXPECT_TRUE(TensorsNear("block", ValuesOf(block), expected_block));
}

// The split of a fused QKV output [s, b, g, r + 2, d] into q [b, g, r, s, d], k and v
// [b, g, s, d] (core/model/attention.cc) and back is the identity.
TYPED_TEST(EigenKernelsModelTest, StridedCopySplitsAndMergesQkv) {
  using T = TypeParam;
  constexpr DType dt = kDType<T>;
  const int64_t s = 3, b = 2, g = 2, r = 3, d = 4;
  const int64_t w = g * (r + 2) * d;
  const Tensor qkv = Make<T>({s * b, w}, Reals(195, s * b * w));
  const std::vector<double> qv = ValuesOf(qkv);
  Tensor q = this->k_.Zeros({b * g * r * s, d}, dt);
  Tensor k = this->k_.Zeros({b * g * s, d}, dt);
  Tensor v = this->k_.Zeros({b * g * s, d}, dt);
  this->k_.StridedCopy(qkv, 0, {b, g, r, s, d}, {w, (r + 2) * d, d, b * w, 1}, q, 0,
                       {g * r * s * d, r * s * d, s * d, d, 1});
  this->k_.StridedCopy(qkv, r * d, {b, g, s, d}, {w, (r + 2) * d, b * w, 1}, k, 0,
                       {g * s * d, s * d, d, 1});
  this->k_.StridedCopy(qkv, (r + 1) * d, {b, g, s, d}, {w, (r + 2) * d, b * w, 1}, v, 0,
                       {g * s * d, s * d, d, 1});
  // Spot-check the layout with a naive index: q[bi, gi, ri, si, di] = qkv[si, bi, gi, ri, di].
  const std::vector<double> q_values = ValuesOf(q), v_values = ValuesOf(v);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t gi = 0; gi < g; ++gi) {
      for (int64_t si = 0; si < s; ++si) {
        for (int64_t di = 0; di < d; ++di) {
          const auto full = [&](int64_t slot) {
            return qv[static_cast<size_t>((si * b + bi) * w + (gi * (r + 2) + slot) * d + di)];
          };
          for (int64_t ri = 0; ri < r; ++ri) {
            EXPECT_EQ(q_values[static_cast<size_t>((((bi * g + gi) * r + ri) * s + si) * d + di)],
                      full(ri));
          }
          EXPECT_EQ(v_values[static_cast<size_t>(((bi * g + gi) * s + si) * d + di)], full(r + 1));
        }
      }
    }
  }
  Tensor merged = Make<T>({s * b, w}, std::vector<double>(static_cast<size_t>(s * b * w), 5.0));
  this->k_.StridedCopy(q, 0, {b, g, r, s, d}, {g * r * s * d, r * s * d, s * d, d, 1}, merged, 0,
                       {w, (r + 2) * d, d, b * w, 1});
  this->k_.StridedCopy(k, 0, {b, g, s, d}, {g * s * d, s * d, d, 1}, merged, r * d,
                       {w, (r + 2) * d, b * w, 1});
  this->k_.StridedCopy(v, 0, {b, g, s, d}, {g * s * d, s * d, d, 1}, merged, (r + 1) * d,
                       {w, (r + 2) * d, b * w, 1});
  EXPECT_TRUE(TensorsNear("split then merge", ValuesOf(merged), qv));
}

TYPED_TEST(EigenKernelsModelTest, StridedCopyRejectsBadLayouts) {
  using T = TypeParam;
  constexpr DType dt = kDType<T>;
  const Tensor src = Make<T>({4, 6}, Reals(197, 24));
  Tensor dst = this->k_.Zeros({4, 6}, dt);
  const auto copy = [&](int64_t src_offset, std::vector<int64_t> dims,
                        std::vector<int64_t> src_strides, int64_t dst_offset,
                        std::vector<int64_t> dst_strides) {
    this->k_.StridedCopy(src, src_offset, dims, src_strides, dst, dst_offset, dst_strides);
  };
  EXPECT_NO_THROW(copy(0, {4, 6}, {6, 1}, 0, {1, 4}));       // a transpose into [6, 4]
  EXPECT_THROW(copy(1, {4, 6}, {6, 1}, 0, {6, 1}), std::invalid_argument);   // src end 24
  EXPECT_THROW(copy(0, {4, 6}, {6, 1}, 0, {6, 2}), std::invalid_argument);   // dst end 28
  EXPECT_THROW(copy(0, {4, 6}, {6, 1}, 0, {0, 1}), std::invalid_argument);   // rows collide
  EXPECT_THROW(copy(0, {2, 6}, {6, 1}, 0, {3, 1}), std::invalid_argument);   // rows overlap
  EXPECT_THROW(copy(0, {4, 6}, {6, 1}, 0, {6}), std::invalid_argument);      // stride count
  EXPECT_THROW(copy(0, {4, 6}, {6, -1}, 0, {6, 1}), std::invalid_argument);  // negative
  EXPECT_THROW(copy(-1, {4, 6}, {6, 1}, 0, {6, 1}), std::invalid_argument);
  EXPECT_THROW(copy(0, {1, 1, 1, 1, 1, 1, 1}, std::vector<int64_t>(7, 1), 0,
                    std::vector<int64_t>(7, 1)),
               std::invalid_argument);  // 7 dimensions
  EXPECT_THROW(copy(0, {4, 6}, {6, 1}, 0, {int64_t{1} << 62, 1}), std::invalid_argument);
  // A zero dimension copies nothing, even with strides that would be out of range.
  EXPECT_NO_THROW(copy(0, {0, 6}, {100, 1}, 0, {100, 1}));
  Tensor self = Make<T>({4, 6}, Reals(197, 24));
  EXPECT_THROW(this->k_.StridedCopy(self, 0, {12}, {1}, self, 12, {1}), std::invalid_argument);
  const Tensor other = this->k_.Zeros({4, 6}, dt == DType::kFloat32 ? DType::kFloat64
                                                                    : DType::kFloat32);
  EXPECT_THROW(this->k_.StridedCopy(other, 0, {24}, {1}, dst, 0, {1}), std::invalid_argument);
}

TYPED_TEST(EigenKernelsModelTest, DropoutAtMatchesGlobalMask) {
  using T = TypeParam;
  constexpr DType dt = kDType<T>;
  const uint64_t key = 1234, stream = 3;
  const double p = 0.4;
  // Nonzero inputs, so a dropped element is recognisable.
  const Tensor x = Make<T>({2, 3, 4}, Reals(200, 24, 1, 9));
  const std::vector<double> xv = ValuesOf(x);

  // The identity map at base 77 is Dropout at offset 77, bit for bit.
  GlobalIndexMap flat;
  flat.base = 77;
  flat.dims = {1, 1, 24};
  flat.strides = {0, 0, 1};
  Tensor y = this->k_.Zeros({2, 3, 4}, dt);
  this->k_.DropoutAt(x, p, key, stream, flat, y);
  Tensor y_ref = this->k_.Zeros({2, 3, 4}, dt);
  this->k_.Dropout(x, p, key, stream, 77, y_ref);
  EXPECT_EQ(ValuesOf(y), ValuesOf(y_ref));

  // A [2, 3, 4] shard of a full [5, 6, 8] activation at sequence 1, sample 2, column 3:
  // element (i, j, k) is full element ((1 + i) * 6 + 2 + j) * 8 + 3 + k.
  const GlobalIndexMap shard = ActivationIndexMap(2, 3, 4, 1, 2, 3, 6, 8);
  Tensor ys = this->k_.Zeros({2, 3, 4}, dt);
  this->k_.DropoutAt(x, p, key, stream, shard, ys);
  const std::vector<double> yv = ValuesOf(ys);
  std::vector<double> expected(24);
  int kept = 0;
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 3; ++j) {
      for (int64_t k = 0; k < 4; ++k) {
        const size_t e = static_cast<size_t>((i * 3 + j) * 4 + k);
        const uint64_t global = static_cast<uint64_t>(((1 + i) * 6 + 2 + j) * 8 + 3 + k);
        const bool keep = UniformAt(key, stream, global) >= p;
        expected[e] = keep ? xv[e] / (1 - p) : 0.0;
        kept += keep;
        EXPECT_EQ(yv[e] != 0, keep) << "mask differs at " << e;
      }
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, 24);
  // x / (1 - p) with 1 - p rounded to the compute dtype: two roundings.
  EXPECT_TRUE(OpNear<T>("dropout at shard", yv, expected, expected));
  // The full tensor's Dropout at offset 0 holds the same values at the shard's elements.
  std::vector<double> fv(240, 0.0);
  for (size_t e = 0; e < 24; ++e) {
    fv[static_cast<size_t>(shard.At(static_cast<int64_t>(e)))] = xv[e];
  }
  const Tensor full_x = Make<T>({5, 6, 8}, fv);
  Tensor full_y = this->k_.Zeros({5, 6, 8}, dt);
  this->k_.Dropout(full_x, p, key, stream, 0, full_y);
  const std::vector<double> full_values = ValuesOf(full_y);
  for (size_t e = 0; e < 24; ++e) {
    EXPECT_EQ(yv[e], full_values[static_cast<size_t>(shard.At(static_cast<int64_t>(e)))]) << e;
  }

  Tensor in_place = Make<T>({2, 3, 4}, xv);
  this->k_.DropoutAt(in_place, p, key, stream, shard, in_place);
  EXPECT_EQ(ValuesOf(in_place), yv);

  GlobalIndexMap wrong = shard;
  wrong.dims = {2, 3, 5};
  EXPECT_THROW(this->k_.DropoutAt(x, p, key, stream, wrong, ys), std::invalid_argument);
  wrong = shard;
  wrong.strides[1] = -8;
  EXPECT_THROW(this->k_.DropoutAt(x, p, key, stream, wrong, ys), std::invalid_argument);
  EXPECT_THROW(this->k_.DropoutAt(x, 1.5, key, stream, shard, ys), std::invalid_argument);
}

}  // namespace
}  // namespace mpusim
