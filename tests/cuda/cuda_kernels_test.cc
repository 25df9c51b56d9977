// CudaKernels against EigenKernels (the CPU reference), for float32 and float64, and for
// bfloat16 and float16 including their float32 accumulators and statistics.
//
// Single process, no MPI. Every test is skipped (GTEST_SKIP) when no CUDA device is visible;
// CI compiles this file without a GPU.
//
// Each test feeds the same host inputs to EigenKernels and (through ToDevice) to
// CudaKernels and compares the results. Inputs are small integers (Philox-drawn, fixed
// keys), so sums and products are exact in both dtypes and whatever the summation order:
// those comparisons are exact (TensorsNear with atol = rtol = 0). Dropout masks and
// EmbeddingBackward (same additions in the same order) are bit-identical even on
// non-integer data. Only the erf/exp-based kernels (GELU, cross entropy) get tolerances,
// each with its reason next to it.
//
// 16-bit dtypes (second half of the file): both backends widen to float32, compute the
// float32 formula and round each stored element once with core/half.h, so wherever the
// float32 values agree the stored bits agree too; elementwise kernels are compared
// bitwise. GEMMs on non-integer data get the K-dependent float32 bound plus one 16-bit ulp
// (the float32 results may fall on either side of a 16-bit rounding boundary).
//
// The model kernels (BatchedGemm, causal softmax, Rope, StridedCopy, DropoutAt; last part of
// the file): one typed suite over all four dtypes, with the tolerances explained there. The
// activations and the norms are in the op tables of tests/ops, which every backend runs
// (tests/cuda/*_ops_test.cc here).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <memory>
#include <numbers>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "core/dropout.h"
#include "core/half.h"
#include "core/philox.h"
#include "core/tensor.h"
#include "cuda/cuda_kernels.h"
#include "tests/kernel_test_util.h"
#include "sim/eigen_kernels.h"

namespace mpusim::cuda {
namespace {

bool DeviceVisible() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear it
    return false;
  }
  return count > 0;
}

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

// Uniform in [-1, 1): values that are not exactly representable sums.
std::vector<double> Reals(uint64_t key, int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) {
    v[static_cast<size_t>(e)] = 2 * UniformAt(key, 9, static_cast<uint64_t>(e)) - 1;
  }
  return v;
}

// Same dtype, same numel and the same bits in every element (of any dtype).
::testing::AssertionResult SameBits(const std::string& name, const Tensor& actual,
                                    const Tensor& expected) {
  if (actual.dtype() != expected.dtype() || actual.numel() != expected.numel()) {
    return ::testing::AssertionFailure()
           << name << ": " << DTypeName(actual.dtype()) << " " << ShapeString(actual.shape())
           << " vs " << DTypeName(expected.dtype()) << " " << ShapeString(expected.shape());
  }
  const size_t size = DTypeSize(actual.dtype());
  const auto* a = static_cast<const unsigned char*>(actual.data());
  const auto* x = static_cast<const unsigned char*>(expected.data());
  int64_t bad = 0;
  std::string first;
  for (int64_t e = 0; e < actual.numel(); ++e) {
    const size_t at = static_cast<size_t>(e) * size;
    if (std::memcmp(a + at, x + at, size) != 0 && bad++ < 10) {
      first += fmt::format("\n  [{}] {} vs {}", e, HostValue(actual, e), HostValue(expected, e));
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << name << " (" << DTypeName(actual.dtype()) << "): " << bad
                                       << " of " << actual.numel() << " differ bitwise:" << first;
}

// erf/exp: CUDA's erff/expf are within 2 ulp, erf/exp (double) within 2 / 1 ulp, and the
// CPU's Eigen/glibc versions within a few ulp of their own; these tolerances are twice the
// CPU test's tolerance against the exact value, since here both sides carry such errors.
template <typename T>
constexpr double kUlpTol = std::is_same_v<T, float> ? 4e-6 : 2e-14;

// Both kernel suites: host and device tensors of T (or of `dtype`) from values, and values
// back from either.
template <typename T>
class CudaKernelsTest : public ::testing::Test {
 public:
  void SetUp() override {
    if (!DeviceVisible()) GTEST_SKIP() << "no CUDA device is visible";
    gpu_ = std::make_unique<CudaKernels>();
  }

  Tensor Host(const Shape& shape, const std::vector<double>& values, DType dtype = kDType<T>) {
    return MakeOf(dtype, shape, values);
  }
  Tensor Dev(const Shape& shape, const std::vector<double>& values, DType dtype = kDType<T>) {
    return gpu_->ToDevice(MakeOf(dtype, shape, values));
  }
  // Values of a host or a device tensor.
  std::vector<double> Values(const Tensor& t) {
    return ValuesOf(t.device() == Device::kCuda ? gpu_->ToHost(t) : t);
  }
  Tensor Back(const Tensor& device) { return gpu_->ToHost(device); }
  // Token ids or labels, int64 on the device.
  Tensor DevIds(const std::vector<int64_t>& ids) { return gpu_->ToDevice(Ids(ids)); }

  EigenKernels cpu_;
  std::unique_ptr<CudaKernels> gpu_;
};

// TYPED_TEST bodies see the fixture only through `this`.
using DTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(CudaKernelsTest, DTypes);

// --- memory ---------------------------------------------------------------------------

TYPED_TEST(CudaKernelsTest, ZerosEmptyToDeviceToHostCopy) {
  using T = TypeParam;
  CudaKernels& gpu = *this->gpu_;
  Tensor z = gpu.Zeros({3, 4}, kDType<T>);
  EXPECT_EQ(z.shape(), (Shape{3, 4}));
  EXPECT_EQ(z.dtype(), kDType<T>);
  EXPECT_EQ(z.device(), Device::kCuda);
  EXPECT_TRUE(TensorsNear("zeros", this->Values(z), std::vector<double>(12, 0.0)));
  EXPECT_THROW(gpu.Zeros({2, -1}, kDType<T>), std::invalid_argument);
  EXPECT_THROW(gpu.Empty({-3}, kDType<T>), std::invalid_argument);

  Tensor empty = gpu.Empty({0, 5}, kDType<T>);
  EXPECT_TRUE(empty.defined());  // zero elements, still a valid (non-null) allocation
  EXPECT_EQ(empty.device(), Device::kCuda);
  EXPECT_EQ(gpu.ToHost(empty).numel(), 0);

  const std::vector<double> v = Ints(1, 12);
  ASSERT_GT(Norm(v), 0);
  const Tensor host = this->Host({3, 4}, v);
  Tensor dev = gpu.ToDevice(host);
  EXPECT_EQ(dev.device(), Device::kCuda);
  EXPECT_EQ(dev.shape(), host.shape());
  EXPECT_NE(dev.data(), host.data());
  Tensor back = gpu.ToHost(dev);
  EXPECT_EQ(back.device(), Device::kHost);
  EXPECT_TRUE(TensorsNear("round trip", ValuesOf(back), v));
  EXPECT_THROW(gpu.ToDevice(dev), std::invalid_argument);
  EXPECT_THROW(gpu.ToHost(host), std::invalid_argument);

  Tensor dst = this->Dev({4, 3}, std::vector<double>(12, 9.0));
  gpu.Copy(dev, dst);
  EXPECT_TRUE(TensorsNear("copy", this->Values(dst), v));
  Tensor wrong = gpu.Zeros({5}, kDType<T>);
  EXPECT_THROW(gpu.Copy(dev, wrong), std::invalid_argument);
  Tensor host_dst = Tensor::HostZeros({12}, kDType<T>);
  EXPECT_THROW(gpu.Copy(dev, host_dst), std::invalid_argument);

  const void* storage = dst.data();
  gpu.SetZero(dst);
  EXPECT_EQ(dst.data(), storage);
  EXPECT_TRUE(TensorsNear("set_zero", this->Values(dst), std::vector<double>(12, 0.0)));
  EXPECT_THROW(gpu.SetZero(host_dst), std::invalid_argument);

  // Overlapping source and destination behave like memmove: views at elements 0 and 4 of
  // one 12-element buffer (shared_ptr aliasing keeps the storage alive).
  Tensor buffer = this->Dev({12}, v);
  T* base = buffer.template data_as<T>();
  auto alias = [&](int64_t offset, int64_t n) {
    // Non-owning views (aliasing constructor on an empty owner); `buffer` keeps the storage.
    return Tensor({n}, kDType<T>, Device::kCuda,
                  std::shared_ptr<void>(std::shared_ptr<void>(), base + offset));
  };
  const Tensor src_view = alias(0, 8);
  Tensor dst_view = alias(4, 8);
  gpu.Copy(src_view, dst_view);
  std::vector<double> moved = v;
  for (size_t e = 0; e < 8; ++e) moved[4 + e] = v[e];
  EXPECT_TRUE(TensorsNear("copy overlapping", this->Values(buffer), moved));
}

TYPED_TEST(CudaKernelsTest, CopyFromHost) {
  using T = TypeParam;
  const std::vector<double> v = Ints(5, 6);
  Tensor dev = this->gpu_->Zeros({2, 3}, kDType<T>);
  this->gpu_->CopyFromHost(this->Host({6}, v), dev);
  EXPECT_TRUE(TensorsNear("copy from host", this->Values(dev), v));
  EXPECT_THROW(this->gpu_->CopyFromHost(this->Host({5}, Ints(5, 5)), dev), std::invalid_argument);
  EXPECT_THROW(this->gpu_->CopyFromHost(dev, dev), std::invalid_argument);
}

TYPED_TEST(CudaKernelsTest, CopyBlock) {
  CudaKernels& gpu = *this->gpu_;
  const std::vector<double> sv = Ints(2, 5 * 6);
  const std::vector<double> dv = Ints(3, 4 * 7);
  Tensor cpu_dst = this->Host({2, 2, 7}, dv);  // 2-D view 4 x 7
  this->cpu_.CopyBlock(this->Host({5, 6}, sv), 1, 2, cpu_dst, 0, 3, 3, 4);
  Tensor gpu_dst = this->Dev({2, 2, 7}, dv);
  gpu.CopyBlock(this->Dev({5, 6}, sv), 1, 2, gpu_dst, 0, 3, 3, 4);
  EXPECT_TRUE(TensorsNear("copy_block", this->Values(gpu_dst), ValuesOf(cpu_dst)));
  EXPECT_NE(this->Values(gpu_dst), dv);

  // Overlapping blocks of one tensor behave as if the source were read first.
  Tensor cpu_self = this->Host({5, 6}, sv);
  this->cpu_.CopyBlock(cpu_self, 0, 0, cpu_self, 1, 1, 4, 5);
  Tensor gpu_self = this->Dev({5, 6}, sv);
  gpu.CopyBlock(gpu_self, 0, 0, gpu_self, 1, 1, 4, 5);
  EXPECT_TRUE(TensorsNear("copy_block overlap", this->Values(gpu_self), ValuesOf(cpu_self)));

  // A block of zero rows or columns is a no-op.
  Tensor untouched = this->Dev({5, 6}, sv);
  gpu.CopyBlock(this->Dev({5, 6}, Ints(4, 30)), 0, 0, untouched, 0, 0, 0, 6);
  EXPECT_TRUE(TensorsNear("copy_block empty", this->Values(untouched), sv));

  const Tensor src = this->Dev({5, 6}, sv);
  EXPECT_THROW(gpu.CopyBlock(src, 3, 0, gpu_dst, 0, 0, 3, 2), std::invalid_argument);
  EXPECT_THROW(gpu.CopyBlock(src, 0, 0, gpu_dst, 0, 5, 1, 3), std::invalid_argument);
  EXPECT_THROW(gpu.CopyBlock(src, 0, 0, gpu_dst, 0, 0, -1, 3), std::invalid_argument);
}

// --- dense algebra --------------------------------------------------------------------

template <typename T>
void CheckGemm(CudaKernelsTest<T>& t, int64_t m, int64_t n, int64_t k) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (double alpha : {1.0, -2.0, 0.5}) {
        for (double beta : {0.0, 1.0, 3.0}) {
          const std::vector<double> av = Ints(10, m * k), bv = Ints(11, k * n),
                                    cv = Ints(12, m * n);
          const Shape a_shape = ta ? Shape{k, m} : Shape{m, k};
          const Shape b_shape = tb ? Shape{n, k} : Shape{k, n};
          Tensor cpu_c = t.Host({m, n}, cv);
          t.cpu_.Gemm(ta, tb, alpha, t.Host(a_shape, av), t.Host(b_shape, bv), beta, cpu_c);
          Tensor gpu_c = t.Dev({m, n}, cv);
          t.gpu_->Gemm(ta, tb, alpha, t.Dev(a_shape, av), t.Dev(b_shape, bv), beta, gpu_c);
          const std::vector<double> expected = ValuesOf(cpu_c);
          ASSERT_GT(Norm(expected), 0);
          EXPECT_TRUE(TensorsNear(fmt::format("gemm {}x{}x{} ta={} tb={} alpha={} beta={}", m, n,
                                              k, ta, tb, alpha, beta),
                                  t.Values(gpu_c), expected));
        }
      }
    }
  }
}

TYPED_TEST(CudaKernelsTest, GemmSmallAllTransposes) { CheckGemm<TypeParam>(*this, 5, 7, 6); }

// |partial sums| <= 80 * 16 stay exact in float32.
TYPED_TEST(CudaKernelsTest, GemmLargerAllTransposes) { CheckGemm<TypeParam>(*this, 70, 65, 80); }

// TF32 (10-bit mantissa) or any reduced-precision mode would round x = 1 + 2^-12 to 1: the
// pedantic float32 GEMM must keep it. Every partial sum j x = j + j 2^-12 (j <= 64) needs at
// most 19 significant bits, so the result 64 + 2^-6 is exact in any summation order.
TYPED_TEST(CudaKernelsTest, GemmIsFullPrecision) {
  using T = TypeParam;
  const int64_t m = 64, n = 64, k = 64;
  const double x = 1.0 + std::ldexp(1.0, -12);
  Tensor c = this->gpu_->Empty({m, n}, kDType<T>);
  const auto size = [](int64_t count) { return static_cast<size_t>(count); };
  this->gpu_->Gemm(false, false, 1.0, this->Dev({m, k}, std::vector<double>(size(m * k), x)),
                   this->Dev({k, n}, std::vector<double>(size(k * n), 1.0)), 0.0, c);
  EXPECT_TRUE(TensorsNear("gemm keeps 2^-12", this->Values(c),
                          std::vector<double>(size(m * n), 64.0 + std::ldexp(1.0, -6))));
}

// Non-integer data: rounding differs between cuBLAS and the CPU GEMM (blocking, FMA), but
// both are within the classic bound |error| <= k u sum_l |a_il b_lj| (<= k^2 u here, since
// |a|, |b| < 1), scaled by |alpha| and plus the rounding of beta * c.
TYPED_TEST(CudaKernelsTest, GemmRealValuesWithinRoundingBound) {
  using T = TypeParam;
  const int64_t m = 33, n = 47, k = 129;
  const double u = std::numeric_limits<T>::epsilon() / 2;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const std::vector<double> av = Reals(1, m * k), bv = Reals(2, k * n), cv = Reals(3, m * n);
      const Shape a_shape = ta ? Shape{k, m} : Shape{m, k};
      const Shape b_shape = tb ? Shape{n, k} : Shape{k, n};
      Tensor cpu_c = this->Host({m, n}, cv);
      this->cpu_.Gemm(ta, tb, 1.5, this->Host(a_shape, av), this->Host(b_shape, bv), 0.5, cpu_c);
      Tensor gpu_c = this->Dev({m, n}, cv);
      this->gpu_->Gemm(ta, tb, 1.5, this->Dev(a_shape, av), this->Dev(b_shape, bv), 0.5, gpu_c);
      const double bound = 2 * (1.5 * static_cast<double>(k * k) + 2) * u;  // both sides' error
      EXPECT_TRUE(TensorsNear(fmt::format("gemm reals ta={} tb={}", ta, tb), this->Values(gpu_c),
                              ValuesOf(cpu_c), bound));
    }
  }
}

TYPED_TEST(CudaKernelsTest, GemmBetaZeroOverwritesNaNAndEmptyK) {
  using T = TypeParam;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor c = this->Dev({2, 2}, std::vector<double>(4, nan));
  this->gpu_->Gemm(false, false, 1.0, this->Dev({2, 3}, Ints(20, 6)), this->Dev({3, 2}, Ints(21, 6)),
                   0.0, c);
  Tensor cpu_c = this->Host({2, 2}, std::vector<double>(4, nan));
  this->cpu_.Gemm(false, false, 1.0, this->Host({2, 3}, Ints(20, 6)),
                  this->Host({3, 2}, Ints(21, 6)), 0.0, cpu_c);
  EXPECT_TRUE(TensorsNear("gemm beta=0", this->Values(c), ValuesOf(cpu_c)));

  // k == 0: c = beta * c (beta == 0 overwrites NaN); alpha == 0 likewise.
  const std::vector<double> cv = Ints(22, 6);
  Tensor c0 = this->Dev({2, 3}, cv);
  this->gpu_->Gemm(false, false, 1.0, this->gpu_->Zeros({2, 0}, kDType<T>),
                   this->gpu_->Zeros({0, 3}, kDType<T>), 2.0, c0);
  std::vector<double> doubled = cv;
  for (double& x : doubled) x *= 2;
  EXPECT_TRUE(TensorsNear("gemm k=0 beta=2", this->Values(c0), doubled));
  Tensor c_nan = this->Dev({2, 3}, std::vector<double>(6, nan));
  this->gpu_->Gemm(false, false, 1.0, this->gpu_->Zeros({2, 0}, kDType<T>),
                   this->gpu_->Zeros({0, 3}, kDType<T>), 0.0, c_nan);
  EXPECT_TRUE(TensorsNear("gemm k=0 beta=0", this->Values(c_nan), std::vector<double>(6, 0.0)));
  Tensor c_alpha0 = this->Dev({2, 3}, cv);
  this->gpu_->Gemm(false, false, 0.0, this->Dev({2, 4}, Ints(23, 8)), this->Dev({4, 3}, Ints(24, 12)),
                   1.0, c_alpha0);
  EXPECT_TRUE(TensorsNear("gemm alpha=0 beta=1", this->Values(c_alpha0), cv));
}

TYPED_TEST(CudaKernelsTest, GemmRejectsBadArguments) {
  using T = TypeParam;
  CudaKernels& gpu = *this->gpu_;
  const Tensor a = this->Dev({2, 3}, Ints(20, 6));
  const Tensor b = this->Dev({3, 2}, Ints(21, 6));
  Tensor c = gpu.Zeros({2, 2}, kDType<T>);
  Tensor c_wrong = gpu.Zeros({2, 3}, kDType<T>);
  EXPECT_THROW(gpu.Gemm(false, false, 1, a, b, 0, c_wrong), std::invalid_argument);
  EXPECT_THROW(gpu.Gemm(true, false, 1, a, b, 0, c), std::invalid_argument);
  Tensor other = gpu.Zeros({3, 2}, kDType<T> == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32);
  EXPECT_THROW(gpu.Gemm(false, false, 1, a, other, 0, c), std::invalid_argument);
  Tensor square = this->Dev({2, 2}, Ints(22, 4));
  EXPECT_THROW(gpu.Gemm(false, false, 1, square, square, 0, square), std::invalid_argument);
  try {
    gpu.Gemm(false, false, 1, a, this->Host({3, 2}, Ints(21, 6)), 0, c);
    ADD_FAILURE() << "no exception for a host tensor";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("CudaKernels::Gemm"), std::string::npos) << e.what();
  }
}

TYPED_TEST(CudaKernelsTest, AddRowVectorSumRowsAxpyScale) {
  CudaKernels& gpu = *this->gpu_;
  EigenKernels& cpu = this->cpu_;
  for (const auto& [r, c] : {std::pair<int64_t, int64_t>{6, 5}, {300, 701}}) {
    SCOPED_TRACE(fmt::format("{} x {}", r, c));
    const std::vector<double> xv = Ints(30, r * c), bv = Ints(31, c), ov = Ints(32, c);

    Tensor cpu_y = this->Host({r, c}, xv);
    cpu.AddRowVector(this->Host({c}, bv), cpu_y);
    Tensor gpu_y = this->Dev({r, c}, xv);
    gpu.AddRowVector(this->Dev({c}, bv), gpu_y);
    EXPECT_TRUE(TensorsNear("add_row_vector", this->Values(gpu_y), ValuesOf(cpu_y)));

    for (double beta : {0.0, 1.0, 2.0}) {
      Tensor cpu_out = this->Host({c}, ov);
      cpu.SumRows(this->Host({r, c}, xv), beta, cpu_out);
      Tensor gpu_out = this->Dev({c}, ov);
      gpu.SumRows(this->Dev({r, c}, xv), beta, gpu_out);
      ASSERT_GT(Norm(ValuesOf(cpu_out)), 0);
      EXPECT_TRUE(TensorsNear(fmt::format("sum_rows beta={}", beta), this->Values(gpu_out),
                              ValuesOf(cpu_out)));
    }

    const std::vector<double> yv = Ints(33, r * c);
    Tensor cpu_a = this->Host({r, c}, yv);
    cpu.Axpy(-1.5, this->Host({r * c}, xv), cpu_a);
    Tensor gpu_a = this->Dev({r, c}, yv);
    gpu.Axpy(-1.5, this->Dev({r * c}, xv), gpu_a);
    EXPECT_TRUE(TensorsNear("axpy", this->Values(gpu_a), ValuesOf(cpu_a)));

    Tensor cpu_s = this->Host({r, c}, xv);
    cpu.Scale(0.25, cpu_s);
    Tensor gpu_s = this->Dev({r, c}, xv);
    gpu.Scale(0.25, gpu_s);
    EXPECT_TRUE(TensorsNear("scale", this->Values(gpu_s), ValuesOf(cpu_s)));
  }
  // Axpy and Scale on non-integer data round identically (no FMA contraction on the GPU).
  const std::vector<double> rx = Reals(34, 1000), ry = Reals(35, 1000);
  Tensor cpu_a = this->Host({1000}, ry);
  cpu.Axpy(0.3, this->Host({1000}, rx), cpu_a);
  Tensor gpu_a = this->Dev({1000}, ry);
  gpu.Axpy(0.3, this->Dev({1000}, rx), gpu_a);
  EXPECT_TRUE(SameBits("axpy reals", this->Back(gpu_a), cpu_a));

  Tensor y = this->Dev({6, 5}, Ints(30, 30));
  EXPECT_THROW(gpu.AddRowVector(this->Dev({6}, Ints(1, 6)), y), std::invalid_argument);
  EXPECT_THROW(gpu.Axpy(1, this->Dev({3}, Ints(1, 3)), y), std::invalid_argument);
  Tensor out = this->Dev({4}, Ints(1, 4));
  EXPECT_THROW(gpu.SumRows(y, 0, out), std::invalid_argument);
  Tensor host_y = this->Host({6, 5}, Ints(30, 30));
  EXPECT_THROW(gpu.Scale(2, host_y), std::invalid_argument);
}

// --- elementwise ----------------------------------------------------------------------

TYPED_TEST(CudaKernelsTest, DropoutIsBitIdenticalToTheCpu) {
  using T = TypeParam;
  CudaKernels& gpu = *this->gpu_;
  const std::vector<double> xv = Reals(50, 200);  // non-integer: the division is compared too
  // The last p is element 5's own draw: kept (u >= p) on both, or the boundary differs.
  for (double p : {0.25, 0.5, 0.9, UniformAt(1234, 3, 77 + 5)}) {
    SCOPED_TRACE(fmt::format("p = {}", p));
    Tensor cpu_y = Tensor::HostZeros({10, 20}, kDType<T>);
    this->cpu_.Dropout(this->Host({10, 20}, xv), p, 1234, 3, 77, cpu_y);
    Tensor gpu_y = gpu.Zeros({10, 20}, kDType<T>);
    gpu.Dropout(this->Dev({10, 20}, xv), p, 1234, 3, 77, gpu_y);
    EXPECT_TRUE(SameBits("dropout", this->Back(gpu_y), cpu_y));
    Tensor x = this->Dev({10, 20}, xv);
    gpu.Dropout(x, p, 1234, 3, 77, x);
    EXPECT_TRUE(SameBits("dropout in place", this->Back(x), cpu_y));
  }
  // A shard at offset 50 gets the same mask as those elements of the whole.
  Tensor whole = gpu.Zeros({200}, kDType<T>);
  gpu.Dropout(this->Dev({200}, xv), 0.5, 9, 1, 0, whole);
  Tensor part = gpu.Zeros({30}, kDType<T>);
  gpu.Dropout(this->Dev({30}, std::vector<double>(xv.begin() + 50, xv.begin() + 80)), 0.5, 9, 1,
              50, part);
  const std::vector<double> wv = this->Values(whole);
  EXPECT_TRUE(TensorsNear("dropout offset", this->Values(part),
                          std::vector<double>(wv.begin() + 50, wv.begin() + 80)));

  Tensor copy = gpu.Zeros({200}, kDType<T>);
  gpu.Dropout(this->Dev({200}, xv), 0.0, 1, 1, 0, copy);
  EXPECT_TRUE(TensorsNear("dropout p=0", this->Values(copy), ValuesOf(this->Host({200}, xv))));
  gpu.Dropout(this->Dev({200}, xv), 1.0, 1, 1, 0, copy);
  EXPECT_TRUE(TensorsNear("dropout p=1", this->Values(copy), std::vector<double>(200, 0.0)));
  EXPECT_THROW(gpu.Dropout(copy, 1.5, 1, 1, 0, copy), std::invalid_argument);
  EXPECT_THROW(gpu.Dropout(copy, -0.1, 1, 1, 0, copy), std::invalid_argument);
}

// More elements than one grid covers (65535 blocks x 256 threads), so the grid-stride loop
// wraps around, and a 64-bit Philox offset.
TYPED_TEST(CudaKernelsTest, DropoutLargeTensorIsBitIdentical) {
  using T = TypeParam;
  const int64_t n = int64_t{65535} * 256 + 1001;
  const uint64_t offset = (uint64_t{1} << 40) + 3;
  Tensor host = Tensor::HostEmpty({n}, kDType<T>);
  for (int64_t e = 0; e < n; ++e) host.data_as<T>()[e] = static_cast<T>(1 + e % 7);
  Tensor cpu_y = Tensor::HostEmpty({n}, kDType<T>);
  this->cpu_.Dropout(host, 0.3, 42, 5, offset, cpu_y);
  Tensor gpu_y = this->gpu_->ToDevice(host);
  this->gpu_->Dropout(gpu_y, 0.3, 42, 5, offset, gpu_y);
  EXPECT_TRUE(SameBits("dropout large", this->Back(gpu_y), cpu_y));
}

// --- embedding ------------------------------------------------------------------------

TYPED_TEST(CudaKernelsTest, EmbeddingForwardBackwardMask) {
  using T = TypeParam;
  CudaKernels& gpu = *this->gpu_;
  const int64_t vocab_start = 4, vocab_end = 9, h = 3;  // this shard: tokens 4..8
  const std::vector<int64_t> ids = {4, 3, 8, 9, 6, 0, 6, 12};
  const int64_t num_ids = static_cast<int64_t>(ids.size());
  const std::vector<double> wv = Ints(60, (vocab_end - vocab_start) * h);

  const size_t out_numel = static_cast<size_t>(num_ids * h);
  Tensor cpu_out = this->Host({2, 4, h}, std::vector<double>(out_numel, 7.0));
  this->cpu_.EmbeddingForward(this->Host({vocab_end - vocab_start, h}, wv), Ids(ids), vocab_start,
                              vocab_end, cpu_out);
  Tensor gpu_out = this->Dev({2, 4, h}, std::vector<double>(out_numel, 7.0));
  gpu.EmbeddingForward(this->Dev({vocab_end - vocab_start, h}, wv), this->DevIds(ids), vocab_start,
                       vocab_end, gpu_out);
  ASSERT_GT(Norm(ValuesOf(cpu_out)), 0);
  EXPECT_TRUE(TensorsNear("embedding forward", this->Values(gpu_out), ValuesOf(cpu_out)));

  const std::vector<double> dyv = Ints(61, num_ids * h);
  const std::vector<double> dw0 = Ints(62, (vocab_end - vocab_start) * h);
  Tensor cpu_dw = this->Host({vocab_end - vocab_start, h}, dw0);
  this->cpu_.EmbeddingBackward(this->Host({num_ids, h}, dyv), Ids(ids), vocab_start, vocab_end,
                               cpu_dw);
  Tensor gpu_dw = this->Dev({vocab_end - vocab_start, h}, dw0);
  gpu.EmbeddingBackward(this->Dev({num_ids, h}, dyv), this->DevIds(ids), vocab_start, vocab_end,
                        gpu_dw);
  EXPECT_TRUE(TensorsNear("embedding backward", this->Values(gpu_dw), ValuesOf(cpu_dw)));
  EXPECT_NE(ValuesOf(cpu_dw), dw0);

  // No id in the shard: nothing changes.
  Tensor untouched = this->Dev({vocab_end - vocab_start, h}, dw0);
  gpu.EmbeddingBackward(this->Dev({3, h}, Ints(63, 3 * h)), this->DevIds({0, 1, 20}), vocab_start,
                        vocab_end, untouched);
  EXPECT_TRUE(TensorsNear("embedding backward outside", this->Values(untouched), dw0));

  Tensor short_out = gpu.Zeros({7, h}, kDType<T>);
  const Tensor weight = this->Dev({vocab_end - vocab_start, h}, wv);
  EXPECT_THROW(gpu.EmbeddingForward(weight, this->DevIds(ids), vocab_start, vocab_end, short_out),
               std::invalid_argument);
  EXPECT_THROW(gpu.EmbeddingForward(weight, this->DevIds(ids), vocab_start, vocab_end + 1, gpu_out),
               std::invalid_argument);
  EXPECT_THROW(
      gpu.EmbeddingBackward(gpu_out, this->DevIds(ids), vocab_start, vocab_end - 1, gpu_dw),
      std::invalid_argument);
}

// Many tokens hitting few rows, non-integer gradients: the GPU adds each row's tokens in
// token order, like the CPU loop, so the result is bit-identical (no atomics).
TYPED_TEST(CudaKernelsTest, EmbeddingBackwardIsDeterministicAndBitIdentical) {
  using T = TypeParam;
  const int64_t vocab_start = 100, vocab_end = 137, h = 300, num_ids = 500;
  std::vector<int64_t> ids(static_cast<size_t>(num_ids));
  for (int64_t i = 0; i < num_ids; ++i) {
    // Mostly in the shard, heavily repeated; some outside on both sides.
    ids[static_cast<size_t>(i)] = 95 + static_cast<int64_t>(IntAt(64, i, 0, 45));
  }
  const std::vector<double> dyv = Reals(65, num_ids * h);
  const std::vector<double> dw0 = Reals(66, (vocab_end - vocab_start) * h);
  Tensor cpu_dw = this->Host({vocab_end - vocab_start, h}, dw0);
  this->cpu_.EmbeddingBackward(this->Host({num_ids, h}, dyv), Ids(ids), vocab_start, vocab_end,
                               cpu_dw);
  Tensor gpu_dw = this->Dev({vocab_end - vocab_start, h}, dw0);
  this->gpu_->EmbeddingBackward(this->Dev({num_ids, h}, dyv), this->DevIds(ids), vocab_start,
                                vocab_end, gpu_dw);
  EXPECT_TRUE(SameBits("embedding backward reals", this->Back(gpu_dw), cpu_dw));

  Tensor cpu_out = Tensor::HostZeros({num_ids, h}, kDType<T>);
  this->cpu_.EmbeddingForward(cpu_dw, Ids(ids), vocab_start, vocab_end, cpu_out);
  Tensor gpu_out = this->gpu_->Zeros({num_ids, h}, kDType<T>);
  this->gpu_->EmbeddingForward(gpu_dw, this->DevIds(ids), vocab_start, vocab_end, gpu_out);
  EXPECT_TRUE(SameBits("embedding forward reals", this->Back(gpu_out), cpu_out));
}

// Ids and labels are int64 device tensors of any shape with one element per row, read by
// the kernels where they are; host ids and float ids are refused.
TYPED_TEST(CudaKernelsTest, IdsAreInt64DeviceTensors) {
  using T = TypeParam;
  CudaKernels& gpu = *this->gpu_;
  const int64_t h = 3, vocab = 5;
  const std::vector<int64_t> flat = {4, -7, 2, 5, 2, 0};  // -7 and 5: outside the table
  const std::vector<double> wv = Ints(95, vocab * h);
  Tensor cpu_out = Tensor::HostZeros({2, 3, h}, kDType<T>);
  this->cpu_.EmbeddingForward(this->Host({vocab, h}, wv), Ids(flat).Reshaped({2, 3}), 0, vocab,
                              cpu_out);
  const Tensor weight = this->Dev({vocab, h}, wv);
  Tensor gpu_out = gpu.Zeros({2, 3, h}, kDType<T>);
  gpu.EmbeddingForward(weight, this->DevIds(flat).Reshaped({2, 3}), 0, vocab, gpu_out);
  ASSERT_GT(Norm(ValuesOf(cpu_out)), 0);
  EXPECT_TRUE(TensorsNear("[2, 3] ids", this->Values(gpu_out), ValuesOf(cpu_out)));

  // A shard every id misses, and an empty shard: dweight stays as it was.
  const Tensor dy = this->Dev({6, h}, Ints(96, 6 * h));
  Tensor far = this->Dev({2, h}, Ints(97, 2 * h));
  gpu.EmbeddingBackward(dy, this->DevIds(flat), 100, 102, far);
  EXPECT_TRUE(TensorsNear("no id in the shard", this->Values(far), Ints(97, 2 * h)));
  Tensor none = gpu.Zeros({0, h}, kDType<T>);
  gpu.EmbeddingBackward(dy, this->DevIds(flat), 3, 3, none);

  Tensor dweight = gpu.Zeros({vocab, h}, kDType<T>);
  const Tensor logits = this->Dev({6, vocab}, Ints(98, 6 * vocab));
  Tensor stat = gpu.Zeros({6}, kDType<T>);
  Tensor grad = gpu.Zeros({6, vocab}, kDType<T>);
  const Tensor host_ids = Ids(flat);
  const Tensor float_ids = this->Dev({6}, {4, 0, 2, 1, 2, 0});
  for (const Tensor* wrong : {&host_ids, &float_ids}) {
    EXPECT_THROW(gpu.EmbeddingForward(weight, *wrong, 0, vocab, gpu_out), std::invalid_argument);
    EXPECT_THROW(gpu.EmbeddingBackward(dy, *wrong, 0, vocab, dweight), std::invalid_argument);
    EXPECT_THROW(gpu.CrossEntropyPartials(logits, stat, *wrong, 0, stat, stat, stat),
                 std::invalid_argument);
    EXPECT_THROW(gpu.CrossEntropyBackward(logits, stat, stat, *wrong, 0, 1, 0, stat, grad),
                 std::invalid_argument);
  }
}

// int64 tensors move through the device memory operations bit for bit.
TEST(CudaKernelsInt64Test, MemoryOpsMoveIds) {
  if (!DeviceVisible()) GTEST_SKIP() << "no CUDA device is visible";
  CudaKernels gpu;
  const int64_t big = (int64_t{1} << 62) + 3;  // not a double: a float path would show
  const std::vector<int64_t> v = {big, -big, 7, 0, -1, 42};
  const auto ints = [&](const Tensor& t) {
    const Tensor host = t.device() == Device::kCuda ? gpu.ToHost(t) : t;
    return std::vector<int64_t>(host.data_as<int64_t>(), host.data_as<int64_t>() + host.numel());
  };
  const Tensor dev = gpu.ToDevice(Ids(v).Reshaped({2, 3}));
  EXPECT_EQ(dev.dtype(), DType::kInt64);
  EXPECT_EQ(ints(dev), v);
  Tensor z = gpu.Zeros({2, 3}, DType::kInt64);
  EXPECT_EQ(ints(z), std::vector<int64_t>(6, 0));
  gpu.Copy(dev, z);
  EXPECT_EQ(ints(z), v);
  gpu.SetZero(z);
  gpu.CopyBlock(dev, 0, 1, z, 1, 0, 1, 2);  // row 0, columns 1..2 -> row 1, columns 0..1
  EXPECT_EQ(ints(z), (std::vector<int64_t>{0, 0, 0, -big, 7, 0}));
  Tensor t = gpu.Empty({3, 2}, DType::kInt64);
  gpu.StridedCopy(dev, 0, {3, 2}, {1, 3}, t, 0, {2, 1});  // transpose
  EXPECT_EQ(ints(t), (std::vector<int64_t>{big, 0, -big, -1, 7, 42}));
  Tensor staged = gpu.Zeros({6}, DType::kInt64);
  gpu.CopyFromHost(Ids(v), staged);  // what HostStagedCommunicator's broadcast does
  EXPECT_EQ(ints(staged), v);
  EXPECT_THROW(gpu.Scale(2.0, z), std::invalid_argument);
}

// Convert gives the CPU's bits between every pair of float dtypes (core/half.h RoundTo, the
// one definition both backends call), ties and float16's overflow included.
TEST(CudaKernelsConvertTest, EveryPairOfFloatDtypesIsBitIdenticalToTheCpu) {
  if (!DeviceVisible()) GTEST_SKIP() << "no CUDA device is visible";
  CudaKernels gpu;
  EigenKernels cpu;
  std::vector<double> x;
  for (int i = -40; i <= 40; ++i) {
    x.push_back(1 + i * std::ldexp(1.0, -12) + i * std::ldexp(1.0, -30));
    x.push_back(std::ldexp(1.0 + i / 64.0, i));  // magnitudes from 2^-40 to 2^40
  }
  x.push_back(65520.0);
  x.push_back(-0.0);
  const Shape shape = {static_cast<int64_t>(x.size())};
  const DType dtypes[] = {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (DType from : dtypes) {
    const Tensor src = MakeOf(from, shape, x);
    const Tensor dev_src = gpu.ToDevice(src);
    for (DType to : dtypes) {
      Tensor want = cpu.Empty(shape, to);
      cpu.Convert(src, want);
      Tensor got = gpu.Empty(shape, to);
      gpu.Convert(dev_src, got);
      EXPECT_TRUE(
          SameBits(fmt::format("{} -> {}", DTypeName(from), DTypeName(to)), gpu.ToHost(got), want));
    }
  }
}

// --- vocab-parallel cross entropy -----------------------------------------------------

TYPED_TEST(CudaKernelsTest, RowMax) {
  using T = TypeParam;
  CudaKernels& gpu = *this->gpu_;
  // Small; wide (several strides of a block); and more rows than grid blocks.
  for (const auto& [r, c] : {std::pair<int64_t, int64_t>{4, 6}, {3, 3000}, {70000, 3}}) {
    SCOPED_TRACE(fmt::format("{} x {}", r, c));
    const std::vector<double> lv = Ints(70, r * c, -9, 9);
    Tensor cpu_max = Tensor::HostZeros({r}, kDType<T>);
    this->cpu_.RowMax(this->Host({r, c}, lv), cpu_max);
    Tensor gpu_max = gpu.Zeros({r}, kDType<T>);
    gpu.RowMax(this->Dev({r, c}, lv), gpu_max);
    EXPECT_TRUE(TensorsNear("row_max", this->Values(gpu_max), ValuesOf(cpu_max)));
  }
  Tensor empty_max = gpu.Zeros({3}, kDType<T>);
  gpu.RowMax(gpu.Zeros({3, 0}, kDType<T>), empty_max);
  EXPECT_TRUE(TensorsNear("row_max of no columns", this->Values(empty_max),
                          std::vector<double>(3, -std::numeric_limits<double>::infinity())));
  EXPECT_THROW(gpu.RowMax(this->Dev({4, 6}, Ints(70, 24)), empty_max), std::invalid_argument);
}

TYPED_TEST(CudaKernelsTest, CrossEntropyPartials) {
  using T = TypeParam;
  CudaKernels& gpu = *this->gpu_;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{4, 5}, {6, 1000}}) {
    SCOPED_TRACE(fmt::format("{} x {}", rows, cols));
    const int64_t vocab_start = cols;  // the second shard of a 2 * cols vocabulary
    const std::vector<double> lv = Ints(80, rows * cols, -6, 6);
    // Even rows: a label inside this shard; odd rows: below or above it.
    std::vector<int64_t> labels;
    for (int64_t i = 0; i < rows; ++i) {
      labels.push_back(i % 2 == 0 ? vocab_start + (i * 37 + 1) % cols
                                  : (i % 4 == 1 ? i : vocab_start + cols + i));
    }
    // As if all-reduced from a larger maximum elsewhere: z = l - max <= -1, never 0, so
    // every in-shard target_z is nonzero.
    std::vector<double> max(static_cast<size_t>(rows), 7.0);
    for (int64_t i = 0; i < rows; i += 2) max[static_cast<size_t>(i)] = 8.0;

    Tensor cpu_se = Tensor::HostZeros({rows}, kDType<T>);
    Tensor cpu_sz = Tensor::HostZeros({rows}, kDType<T>);
    Tensor cpu_tz = Tensor::HostZeros({rows}, kDType<T>);
    this->cpu_.CrossEntropyPartials(this->Host({rows, cols}, lv), this->Host({rows}, max),
                                    Ids(labels), vocab_start, cpu_se, cpu_sz, cpu_tz);
    Tensor gpu_se = gpu.Zeros({rows}, kDType<T>);
    Tensor gpu_sz = gpu.Zeros({rows}, kDType<T>);
    Tensor gpu_tz = gpu.Zeros({rows}, kDType<T>);
    gpu.CrossEntropyPartials(this->Dev({rows, cols}, lv), this->Dev({rows}, max),
                             this->DevIds(labels), vocab_start, gpu_se, gpu_sz, gpu_tz);
    // exp differs by a few ulp (see kUlpTol), and the GPU sums in a tree, the CPU in another
    // order: a sum of n positive terms is within (n - 1) u relative of exact on each side.
    const double order = static_cast<double>(cols) * std::numeric_limits<T>::epsilon();
    EXPECT_TRUE(TensorsNear("sum_exp", this->Values(gpu_se), ValuesOf(cpu_se), 0,
                            4 * kUlpTol<T> + order));
    // z are small integers: exact in any order.
    EXPECT_TRUE(TensorsNear("sum_z", this->Values(gpu_sz), ValuesOf(cpu_sz)));
    EXPECT_TRUE(TensorsNear("target_z", this->Values(gpu_tz), ValuesOf(cpu_tz)));
    ASSERT_GT(Norm(ValuesOf(cpu_tz)), 0);
  }
  Tensor se = gpu.Zeros({4}, kDType<T>), sz = gpu.Zeros({4}, kDType<T>),
         tz = gpu.Zeros({4}, kDType<T>);
  EXPECT_THROW(gpu.CrossEntropyPartials(this->Dev({4, 5}, Ints(80, 20)), this->Dev({4}, Ints(1, 4)),
                                        this->DevIds({1, 2, 3}), 0, se, sz, tz),
               std::invalid_argument);
}

TYPED_TEST(CudaKernelsTest, CrossEntropyBackwardIncludingInPlace) {
  using T = TypeParam;
  CudaKernels& gpu = *this->gpu_;
  const int64_t rows = 5, cols = 300, vocab_start = 300;
  const std::vector<double> lv = Ints(90, rows * cols, -6, 6);
  const std::vector<int64_t> labels = {300, 599, 17, 450, 600};  // first, last, outside x2, mid
  const std::vector<double> max(static_cast<size_t>(rows), 6.0);
  // Feed both sides the same sum_exp so that only exp and the division differ.
  std::vector<double> se(static_cast<size_t>(rows), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      se[static_cast<size_t>(i)] += std::exp(lv[static_cast<size_t>(i * cols + j)] - 6.0);
    }
  }
  const std::vector<double> scale = {1, 0.5, 2, 0.25, 1};
  for (const auto& [on, off] : {std::pair<double, double>{1.0, 0.0}, {0.9, 0.1 / 599}}) {
    SCOPED_TRACE(fmt::format("on {} off {}", on, off));
    Tensor cpu_grad = Tensor::HostZeros({rows, cols}, kDType<T>);
    this->cpu_.CrossEntropyBackward(this->Host({rows, cols}, lv), this->Host({rows}, max),
                                    this->Host({rows}, se), Ids(labels), vocab_start, on, off,
                                    this->Host({rows}, scale), cpu_grad);
    Tensor gpu_grad = gpu.Zeros({rows, cols}, kDType<T>);
    gpu.CrossEntropyBackward(this->Dev({rows, cols}, lv), this->Dev({rows}, max),
                             this->Dev({rows}, se), this->DevIds(labels), vocab_start, on, off,
                             this->Dev({rows}, scale), gpu_grad);
    // exp within a few ulp on both sides; softmax values are <= 1 and are scaled by <= 2,
    // so an absolute tolerance of a few ulp of 1 covers the cancellation against q.
    EXPECT_TRUE(TensorsNear("grad", this->Values(gpu_grad), ValuesOf(cpu_grad), kUlpTol<T>,
                            kUlpTol<T>));
    ASSERT_GT(Norm(ValuesOf(cpu_grad)), 0);

    Tensor in_place = this->Dev({rows, cols}, lv);
    gpu.CrossEntropyBackward(in_place, this->Dev({rows}, max), this->Dev({rows}, se),
                             this->DevIds(labels), vocab_start, on, off, this->Dev({rows}, scale),
                             in_place);
    EXPECT_TRUE(TensorsNear("grad in place", this->Values(in_place), this->Values(gpu_grad)));
  }
  Tensor wrong = gpu.Zeros({rows, cols + 1}, kDType<T>);
  EXPECT_THROW(gpu.CrossEntropyBackward(this->Dev({rows, cols}, lv), this->Dev({rows}, max),
                                        this->Dev({rows}, se), this->DevIds(labels), vocab_start, 1,
                                        0, this->Dev({rows}, scale), wrong),
               std::invalid_argument);
}

// --- bfloat16 and float16 -------------------------------------------------------------
//
// The same host inputs (rounded once to the 16-bit dtype by SetHostValue) go to both
// backends. Inputs are generated as doubles and stored through core/half.h, so they are
// exact 16-bit values on both sides.

// The spacing of the 16-bit values in [1, 2): one ulp relative, 2^-7 (bfloat16) or 2^-10
// (float16). A float32 value x rounded to 16 bits moves by at most eps/2 * |x|.
template <typename H>
constexpr double kHalfEps = std::is_same_v<H, BFloat16> ? 0x1p-7 : 0x1p-10;
// float32's unit roundoff.
constexpr double kFloatU = 0x1p-24;

template <typename H>
class CudaKernelsHalfTest : public CudaKernelsTest<H> {
 public:
  static constexpr DType kHalf = kDType<H>;
};

using HalfTypes = ::testing::Types<BFloat16, Float16>;
TYPED_TEST_SUITE(CudaKernelsHalfTest, HalfTypes);

// Special values (NaN, inf, subnormals, -0) survive every copy bit for bit: copies move
// 16-bit patterns, never values.
TYPED_TEST(CudaKernelsHalfTest, CopiesMoveBits) {
  using H = TypeParam;
  const DType h = kDType<H>;
  CudaKernels& gpu = *this->gpu_;
  const std::vector<uint16_t> patterns = {0x0000, 0x8000, 0x0001, 0x8001, 0x7fc0, 0x7e00,
                                          0x7f80, 0xff80, 0x7c00, 0xfc00, 0x3c00, 0x3f80,
                                          0x03ff, 0xffff, 0x1234, 0xabcd};
  Tensor host = Tensor::HostEmpty({4, 4}, h);
  std::memcpy(host.data(), patterns.data(), patterns.size() * sizeof(uint16_t));
  Tensor dev = gpu.ToDevice(host);
  EXPECT_TRUE(SameBits("round trip", gpu.ToHost(dev), host));

  Tensor copied = gpu.Empty({16}, h);
  gpu.Copy(dev, copied);
  EXPECT_TRUE(SameBits("copy", gpu.ToHost(copied), host.Reshaped({16})));
  Tensor from_host = gpu.Zeros({2, 8}, h);
  gpu.CopyFromHost(host, from_host);
  EXPECT_TRUE(SameBits("copy from host", gpu.ToHost(from_host), host.Reshaped({2, 8})));

  const Tensor zeros = gpu.ToHost(gpu.Zeros({3, 5}, h));
  EXPECT_TRUE(SameBits("zeros", zeros, this->Host({3, 5}, std::vector<double>(15, 0.0))));

  // CopyBlock with 2-byte elements: the CPU's result, and the hand-computed one.
  const std::vector<double> sv = Ints(2, 5 * 6);
  const std::vector<double> dv = Ints(3, 4 * 7);
  Tensor cpu_dst = this->Host({4, 7}, dv);
  this->cpu_.CopyBlock(this->Host({5, 6}, sv), 1, 2, cpu_dst, 0, 3, 3, 4);
  Tensor gpu_dst = this->Dev({4, 7}, dv);
  gpu.CopyBlock(this->Dev({5, 6}, sv), 1, 2, gpu_dst, 0, 3, 3, 4);
  EXPECT_TRUE(SameBits("copy_block", this->Back(gpu_dst), cpu_dst));
  std::vector<double> expected = dv;
  for (size_t i = 0; i < 3; ++i) {
    for (size_t j = 0; j < 4; ++j) expected[i * 7 + 3 + j] = sv[(1 + i) * 6 + 2 + j];
  }
  EXPECT_TRUE(TensorsNear("copy_block by hand", this->Values(gpu_dst), expected));

  Tensor cpu_self = this->Host({5, 6}, sv);
  this->cpu_.CopyBlock(cpu_self, 0, 0, cpu_self, 1, 1, 4, 5);
  Tensor gpu_self = this->Dev({5, 6}, sv);
  gpu.CopyBlock(gpu_self, 0, 0, gpu_self, 1, 1, 4, 5);
  EXPECT_TRUE(SameBits("copy_block overlap", this->Back(gpu_self), cpu_self));
}

// --- 16-bit dense algebra -------------------------------------------------------------

// Small integers: every product and partial sum is exact in float32 on both sides, so both
// round the same exact value once and the bits agree, for a 16-bit and a float32 c alike.
// The sums (up to 80 * 16 * 2 + 3 * 4) exceed 256, so a bfloat16 c really rounds.
TYPED_TEST(CudaKernelsHalfTest, GemmIntegersAreBitIdenticalForEveryAccumulator) {
  using H = TypeParam;
  const DType h = kDType<H>;
  for (const DType c_dtype : {h, DType::kFloat32}) {
    for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{5, 7, 6}, {70, 65, 80}}) {
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          for (double alpha : {1.0, -2.0, 0.5}) {
            for (double beta : {0.0, 1.0, 3.0}) {
              const std::string name =
                  fmt::format("gemm c={} {}x{}x{} ta={} tb={} alpha={} beta={}",
                              DTypeName(c_dtype), m, n, k, ta, tb, alpha, beta);
              const std::vector<double> av = Ints(10, m * k), bv = Ints(11, k * n),
                                        cv = Ints(12, m * n);
              const Shape a_shape = ta ? Shape{k, m} : Shape{m, k};
              const Shape b_shape = tb ? Shape{n, k} : Shape{k, n};
              Tensor cpu_c = this->Host({m, n}, cv, c_dtype);
              this->cpu_.Gemm(ta, tb, alpha, this->Host(a_shape, av), this->Host(b_shape, bv),
                              beta, cpu_c);
              Tensor gpu_c = this->Dev({m, n}, cv, c_dtype);
              this->gpu_->Gemm(ta, tb, alpha, this->Dev(a_shape, av), this->Dev(b_shape, bv),
                               beta, gpu_c);
              ASSERT_GT(Norm(ValuesOf(cpu_c)), 0) << name;
              EXPECT_TRUE(SameBits(name, this->Back(gpu_c), cpu_c));
            }
          }
        }
      }
    }
  }
}

// Non-integer data: the float32 results differ by the classic bound |error| <=
// k u sum_l |a_il b_lj| <= k^2 u on each side (|a|, |b| <= 1), scaled by |alpha| and plus
// the rounding of beta * c; a 16-bit c then rounds each side once, which may land one
// 16-bit ulp apart when the float32 values straddle a rounding boundary.
TYPED_TEST(CudaKernelsHalfTest, GemmRealValuesWithinRoundingBound) {
  using H = TypeParam;
  const DType h = kDType<H>;
  const int64_t m = 33, n = 47, k = 129;
  const double float_bound = 2 * (1.5 * static_cast<double>(k * k) + 2) * kFloatU;
  for (const DType c_dtype : {h, DType::kFloat32}) {
    const double rtol = c_dtype == h ? kHalfEps<H> : 0.0;
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const std::vector<double> av = Reals(1, m * k), bv = Reals(2, k * n),
                                  cv = Reals(3, m * n);
        const Shape a_shape = ta ? Shape{k, m} : Shape{m, k};
        const Shape b_shape = tb ? Shape{n, k} : Shape{k, n};
        Tensor cpu_c = this->Host({m, n}, cv, c_dtype);
        this->cpu_.Gemm(ta, tb, 1.5, this->Host(a_shape, av), this->Host(b_shape, bv), 0.5,
                        cpu_c);
        Tensor gpu_c = this->Dev({m, n}, cv, c_dtype);
        this->gpu_->Gemm(ta, tb, 1.5, this->Dev(a_shape, av), this->Dev(b_shape, bv), 0.5,
                         gpu_c);
        const std::vector<double> expected = ValuesOf(cpu_c);
        ASSERT_GT(Norm(expected), 0);
        EXPECT_TRUE(TensorsNear(fmt::format("gemm reals c={} ta={} tb={}", DTypeName(c_dtype), ta,
                                            tb),
                                this->Values(gpu_c), expected, float_bound, rtol));
      }
    }
  }
}

// A 16-bit product is a float32 one: x = 1 + 2^-7 (bfloat16) or 1 + 2^-10 (float16) is a
// 16-bit value whose square 1 + 2 eps + eps^2 needs float32 to survive the k = 64 sum; the
// float32 c must then hold 64 (1 + 2 eps + eps^2) exactly (any 16-bit accumulation or a
// 16-bit C in between would lose eps^2).
TYPED_TEST(CudaKernelsHalfTest, GemmAccumulatesInFloat32) {
  using H = TypeParam;
  const DType h = kDType<H>;
  const int64_t m = 8, n = 8, k = 64;
  const double x = 1.0 + kHalfEps<H>;
  const auto size = [](int64_t count) { return static_cast<size_t>(count); };
  Tensor c = this->gpu_->Empty({m, n}, DType::kFloat32);
  this->gpu_->Gemm(false, false, 1.0, this->Dev({m, k}, std::vector<double>(size(m * k), x)),
                   this->Dev({k, n}, std::vector<double>(size(k * n), x)), 0.0, c);
  EXPECT_TRUE(TensorsNear("gemm float32 accumulation", this->Values(c),
                          std::vector<double>(size(m * n), 64.0 * x * x)));
  // Into a 16-bit c: one rounding of that float32 value.
  Tensor c16 = this->gpu_->Empty({m, n}, h);
  this->gpu_->Gemm(false, false, 1.0, this->Dev({m, k}, std::vector<double>(size(m * k), x)),
                   this->Dev({k, n}, std::vector<double>(size(k * n), x)), 0.0, c16);
  EXPECT_TRUE(SameBits("gemm rounded once", this->Back(c16),
                       this->Host({m, n}, std::vector<double>(size(m * n), 64.0 * x * x))));
}

TYPED_TEST(CudaKernelsHalfTest, GemmBetaZeroOverwritesNaNAndEmptyK) {
  using H = TypeParam;
  const DType h = kDType<H>;
  CudaKernels& gpu = *this->gpu_;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const DType c_dtype : {h, DType::kFloat32}) {
    SCOPED_TRACE(DTypeName(c_dtype));
    Tensor c = this->Dev({2, 2}, std::vector<double>(4, nan), c_dtype);
    gpu.Gemm(false, false, 1.0, this->Dev({2, 3}, Ints(20, 6)), this->Dev({3, 2}, Ints(21, 6)),
             0.0, c);
    Tensor cpu_c = this->Host({2, 2}, std::vector<double>(4, 0.0), c_dtype);
    this->cpu_.Gemm(false, false, 1.0, this->Host({2, 3}, Ints(20, 6)),
                    this->Host({3, 2}, Ints(21, 6)), 0.0, cpu_c);
    EXPECT_TRUE(SameBits("gemm beta=0", this->Back(c), cpu_c));

    // k == 0: c = beta * c, rounded once; beta == 0 overwrites NaN; alpha == 0 likewise.
    const std::vector<double> cv = Reals(22, 6);
    Tensor c0 = this->Dev({2, 3}, cv, c_dtype);
    gpu.Gemm(false, false, 1.0, gpu.Zeros({2, 0}, h), gpu.Zeros({0, 3}, h), 0.3, c0);
    Tensor cpu_c0 = this->Host({2, 3}, cv, c_dtype);
    this->cpu_.Gemm(false, false, 1.0, this->cpu_.Zeros({2, 0}, h), this->cpu_.Zeros({0, 3}, h),
                    0.3, cpu_c0);
    EXPECT_TRUE(SameBits("gemm k=0 beta=0.3", this->Back(c0), cpu_c0));
    Tensor c_nan = this->Dev({2, 3}, std::vector<double>(6, nan), c_dtype);
    gpu.Gemm(false, false, 1.0, gpu.Zeros({2, 0}, h), gpu.Zeros({0, 3}, h), 0.0, c_nan);
    EXPECT_TRUE(TensorsNear("gemm k=0 beta=0", this->Values(c_nan), std::vector<double>(6, 0.0)));
    Tensor c_alpha0 = this->Dev({2, 3}, cv, c_dtype);
    gpu.Gemm(false, false, 0.0, this->Dev({2, 4}, Ints(23, 8)), this->Dev({4, 3}, Ints(24, 12)),
             1.0, c_alpha0);
    EXPECT_TRUE(SameBits("gemm alpha=0 beta=1", this->Back(c_alpha0),
                         this->Host({2, 3}, cv, c_dtype)));
  }
}

TYPED_TEST(CudaKernelsHalfTest, GemmRejectsMixedDtypes) {
  using H = TypeParam;
  const DType h = kDType<H>;
  const DType other_half = h == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
  CudaKernels& gpu = *this->gpu_;
  const Tensor a = this->Dev({2, 3}, Ints(20, 6));
  const Tensor b = this->Dev({3, 2}, Ints(21, 6));
  Tensor c64 = gpu.Zeros({2, 2}, DType::kFloat64);
  EXPECT_THROW(gpu.Gemm(false, false, 1, a, b, 0, c64), std::invalid_argument);
  Tensor c_other = gpu.Zeros({2, 2}, other_half);
  EXPECT_THROW(gpu.Gemm(false, false, 1, a, b, 0, c_other), std::invalid_argument);
  const Tensor b_other = gpu.Zeros({3, 2}, other_half);
  Tensor c = gpu.Zeros({2, 2}, h);
  EXPECT_THROW(gpu.Gemm(false, false, 1, a, b_other, 0, c), std::invalid_argument);
  // A float32 product has no 16-bit accumulator.
  const Tensor a32 = this->Dev({2, 3}, Ints(20, 6), DType::kFloat32);
  const Tensor b32 = this->Dev({3, 2}, Ints(21, 6), DType::kFloat32);
  EXPECT_THROW(gpu.Gemm(false, false, 1, a32, b32, 0, c), std::invalid_argument);
}

// AddRowVector, Axpy and Scale on non-integer data: one float32 operation per element,
// rounded once, on both sides: bit-identical. SumRows on integers (exact float32 sums in
// any order; the bfloat16 results round since the sums exceed 256).
TYPED_TEST(CudaKernelsHalfTest, AddRowVectorSumRowsAxpyScale) {
  using H = TypeParam;
  const DType h = kDType<H>;
  CudaKernels& gpu = *this->gpu_;
  EigenKernels& cpu = this->cpu_;
  for (const auto& [r, c] : {std::pair<int64_t, int64_t>{6, 5}, {300, 701}}) {
    SCOPED_TRACE(fmt::format("{} x {}", r, c));
    const std::vector<double> xv = Reals(30, r * c), bv = Reals(31, c);

    Tensor cpu_y = this->Host({r, c}, xv);
    cpu.AddRowVector(this->Host({c}, bv), cpu_y);
    Tensor gpu_y = this->Dev({r, c}, xv);
    gpu.AddRowVector(this->Dev({c}, bv), gpu_y);
    EXPECT_TRUE(SameBits("add_row_vector", this->Back(gpu_y), cpu_y));

    const std::vector<double> iv = Ints(32, r * c), ov = Ints(33, c);
    for (const DType out_dtype : {h, DType::kFloat32}) {
      for (double beta : {0.0, 1.0, 2.0}) {
        const std::string name = fmt::format("sum_rows out={} beta={}", DTypeName(out_dtype), beta);
        Tensor cpu_out = this->Host({c}, ov, out_dtype);
        cpu.SumRows(this->Host({r, c}, iv), beta, cpu_out);
        Tensor gpu_out = this->Dev({c}, ov, out_dtype);
        gpu.SumRows(this->Dev({r, c}, iv), beta, gpu_out);
        ASSERT_GT(Norm(ValuesOf(cpu_out)), 0) << name;
        EXPECT_TRUE(SameBits(name, this->Back(gpu_out), cpu_out));
      }
    }

    const std::vector<double> yv = Reals(34, r * c);
    for (const DType y_dtype : {h, DType::kFloat32}) {
      const std::string name = fmt::format("axpy y={}", DTypeName(y_dtype));
      Tensor cpu_a = this->Host({r, c}, yv, y_dtype);
      cpu.Axpy(0.3, this->Host({r * c}, xv), cpu_a);
      Tensor gpu_a = this->Dev({r, c}, yv, y_dtype);
      gpu.Axpy(0.3, this->Dev({r * c}, xv), gpu_a);
      EXPECT_TRUE(SameBits(name, this->Back(gpu_a), cpu_a));
    }

    Tensor cpu_s = this->Host({r, c}, xv);
    cpu.Scale(0.7, cpu_s);
    Tensor gpu_s = this->Dev({r, c}, xv);
    gpu.Scale(0.7, gpu_s);
    EXPECT_TRUE(SameBits("scale", this->Back(gpu_s), cpu_s));
  }

  // Accumulators must be the inputs' dtype or float32.
  Tensor y64 = gpu.Zeros({6}, DType::kFloat64);
  EXPECT_THROW(gpu.Axpy(1, this->Dev({6}, Ints(1, 6)), y64), std::invalid_argument);
  Tensor out64 = gpu.Zeros({5}, DType::kFloat64);
  EXPECT_THROW(gpu.SumRows(this->Dev({6, 5}, Ints(1, 30)), 0, out64), std::invalid_argument);
  Tensor y32 = gpu.Zeros({6, 5}, DType::kFloat32);
  EXPECT_THROW(gpu.AddRowVector(this->Dev({5}, Ints(1, 5)), y32), std::invalid_argument);
}

// --- 16-bit elementwise ---------------------------------------------------------------

// The same Philox mask and one float32 division rounded once: bit-identical.
TYPED_TEST(CudaKernelsHalfTest, DropoutIsBitIdenticalToTheCpu) {
  using H = TypeParam;
  const DType h = kDType<H>;
  CudaKernels& gpu = *this->gpu_;
  const std::vector<double> xv = Reals(50, 200);
  for (double p : {0.25, 0.5, 0.9}) {
    SCOPED_TRACE(fmt::format("p = {}", p));
    Tensor cpu_y = Tensor::HostZeros({10, 20}, h);
    this->cpu_.Dropout(this->Host({10, 20}, xv), p, 1234, 3, 77, cpu_y);
    Tensor gpu_y = gpu.Zeros({10, 20}, h);
    gpu.Dropout(this->Dev({10, 20}, xv), p, 1234, 3, 77, gpu_y);
    EXPECT_TRUE(SameBits("dropout", this->Back(gpu_y), cpu_y));
    Tensor x = this->Dev({10, 20}, xv);
    gpu.Dropout(x, p, 1234, 3, 77, x);
    EXPECT_TRUE(SameBits("dropout in place", this->Back(x), cpu_y));
  }
  // A shard at offset 50 gets the same mask as those elements of the whole.
  Tensor whole = gpu.Zeros({200}, h);
  gpu.Dropout(this->Dev({200}, xv), 0.5, 9, 1, 0, whole);
  Tensor part = gpu.Zeros({30}, h);
  gpu.Dropout(this->Dev({30}, std::vector<double>(xv.begin() + 50, xv.begin() + 80)), 0.5, 9, 1,
              50, part);
  const std::vector<double> wv = this->Values(whole);
  EXPECT_TRUE(TensorsNear("dropout offset", this->Values(part),
                          std::vector<double>(wv.begin() + 50, wv.begin() + 80)));
  Tensor copy = gpu.Zeros({200}, h);
  gpu.Dropout(this->Dev({200}, xv), 1.0, 1, 1, 0, copy);
  EXPECT_TRUE(TensorsNear("dropout p=1", this->Values(copy), std::vector<double>(200, 0.0)));
}

// --- 16-bit embedding -----------------------------------------------------------------

// Forward copies bits. Backward adds each row's tokens in token order like the CPU, each
// addition a float32 one rounded to dweight's dtype: bit-identical for a 16-bit dweight
// (rounded per token on both sides) and for a float32 one (a plain float32 sum).
TYPED_TEST(CudaKernelsHalfTest, EmbeddingForwardBackward) {
  using H = TypeParam;
  const DType h = kDType<H>;
  CudaKernels& gpu = *this->gpu_;
  const int64_t vocab_start = 100, vocab_end = 137, hidden = 300, num_ids = 500;
  const int64_t vocab = vocab_end - vocab_start;
  std::vector<int64_t> ids(static_cast<size_t>(num_ids));
  for (int64_t i = 0; i < num_ids; ++i) {
    // Mostly in the shard, heavily repeated; some outside on both sides.
    ids[static_cast<size_t>(i)] = 95 + static_cast<int64_t>(IntAt(64, i, 0, 45));
  }
  const std::vector<double> wv = Reals(60, vocab * hidden);
  const size_t out_numel = static_cast<size_t>(num_ids * hidden);
  Tensor cpu_out = this->Host({num_ids, hidden}, std::vector<double>(out_numel, 7.0));
  this->cpu_.EmbeddingForward(this->Host({vocab, hidden}, wv), Ids(ids), vocab_start, vocab_end,
                              cpu_out);
  Tensor gpu_out = this->Dev({num_ids, hidden}, std::vector<double>(out_numel, 7.0));
  gpu.EmbeddingForward(this->Dev({vocab, hidden}, wv), this->DevIds(ids), vocab_start, vocab_end,
                       gpu_out);
  EXPECT_TRUE(SameBits("embedding forward", this->Back(gpu_out), cpu_out));

  for (const DType dw_dtype : {h, DType::kFloat32}) {
    for (const bool integers : {true, false}) {
      const std::string name = fmt::format("embedding backward dweight={} {}",
                                           DTypeName(dw_dtype), integers ? "ints" : "reals");
      const std::vector<double> dyv =
          integers ? Ints(61, num_ids * hidden) : Reals(61, num_ids * hidden);
      const std::vector<double> dw0 =
          integers ? Ints(62, vocab * hidden) : Reals(62, vocab * hidden);
      Tensor cpu_dw = this->Host({vocab, hidden}, dw0, dw_dtype);
      this->cpu_.EmbeddingBackward(this->Host({num_ids, hidden}, dyv), Ids(ids), vocab_start,
                                   vocab_end, cpu_dw);
      Tensor gpu_dw = this->Dev({vocab, hidden}, dw0, dw_dtype);
      gpu.EmbeddingBackward(this->Dev({num_ids, hidden}, dyv), this->DevIds(ids), vocab_start,
                            vocab_end, gpu_dw);
      EXPECT_TRUE(SameBits(name, this->Back(gpu_dw), cpu_dw));
      EXPECT_NE(ValuesOf(cpu_dw), ValuesOf(this->Host({vocab, hidden}, dw0, dw_dtype))) << name;
    }
  }
  Tensor dw64 = gpu.Zeros({vocab, hidden}, DType::kFloat64);
  EXPECT_THROW(gpu.EmbeddingBackward(gpu_out, this->DevIds(ids), vocab_start, vocab_end, dw64),
               std::invalid_argument);
}

// --- 16-bit cross entropy -------------------------------------------------------------

TYPED_TEST(CudaKernelsHalfTest, RowMaxIntoFloat32) {
  using H = TypeParam;
  const DType h = kDType<H>;
  CudaKernels& gpu = *this->gpu_;
  for (const auto& [r, c] : {std::pair<int64_t, int64_t>{4, 6}, {3, 3000}, {70000, 3}}) {
    SCOPED_TRACE(fmt::format("{} x {}", r, c));
    const std::vector<double> lv = Reals(70, r * c);  // the maximum is exact either way
    Tensor cpu_max = Tensor::HostZeros({r}, DType::kFloat32);
    this->cpu_.RowMax(this->Host({r, c}, lv), cpu_max);
    Tensor gpu_max = gpu.Zeros({r}, DType::kFloat32);
    gpu.RowMax(this->Dev({r, c}, lv), gpu_max);
    EXPECT_TRUE(SameBits("row_max", this->Back(gpu_max), cpu_max));
  }
  Tensor empty_max = gpu.Zeros({3}, DType::kFloat32);
  gpu.RowMax(gpu.Zeros({3, 0}, h), empty_max);
  EXPECT_TRUE(TensorsNear("row_max of no columns", this->Values(empty_max),
                          std::vector<double>(3, -std::numeric_limits<double>::infinity())));
  // Statistics are float32, never 16-bit.
  Tensor half_max = gpu.Zeros({4}, h);
  EXPECT_THROW(gpu.RowMax(this->Dev({4, 6}, Ints(70, 24)), half_max), std::invalid_argument);
}

TYPED_TEST(CudaKernelsHalfTest, CrossEntropyPartialsIntoFloat32) {
  using H = TypeParam;
  const DType h = kDType<H>;
  const DType f32 = DType::kFloat32;
  CudaKernels& gpu = *this->gpu_;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{4, 5}, {6, 1000}}) {
    SCOPED_TRACE(fmt::format("{} x {}", rows, cols));
    const int64_t vocab_start = cols;
    const std::vector<double> lv = Ints(80, rows * cols, -6, 6);
    std::vector<int64_t> labels;
    for (int64_t i = 0; i < rows; ++i) {
      labels.push_back(i % 2 == 0 ? vocab_start + (i * 37 + 1) % cols
                                  : (i % 4 == 1 ? i : vocab_start + cols + i));
    }
    std::vector<double> max(static_cast<size_t>(rows), 7.0);
    for (int64_t i = 0; i < rows; i += 2) max[static_cast<size_t>(i)] = 8.0;

    Tensor cpu_se = Tensor::HostZeros({rows}, f32);
    Tensor cpu_sz = Tensor::HostZeros({rows}, f32);
    Tensor cpu_tz = Tensor::HostZeros({rows}, f32);
    this->cpu_.CrossEntropyPartials(this->Host({rows, cols}, lv), this->Host({rows}, max, f32),
                                    Ids(labels), vocab_start, cpu_se, cpu_sz, cpu_tz);
    Tensor gpu_se = gpu.Zeros({rows}, f32);
    Tensor gpu_sz = gpu.Zeros({rows}, f32);
    Tensor gpu_tz = gpu.Zeros({rows}, f32);
    gpu.CrossEntropyPartials(this->Dev({rows, cols}, lv), this->Dev({rows}, max, f32),
                             this->DevIds(labels), vocab_start, gpu_se, gpu_sz, gpu_tz);
    // As for float32: exp within a few ulp, tree vs sequential summation.
    const double order = static_cast<double>(cols) * std::numeric_limits<float>::epsilon();
    EXPECT_TRUE(TensorsNear("sum_exp", this->Values(gpu_se), ValuesOf(cpu_se), 0,
                            4 * kUlpTol<float> + order));
    EXPECT_TRUE(SameBits("sum_z", this->Back(gpu_sz), cpu_sz));
    EXPECT_TRUE(SameBits("target_z", this->Back(gpu_tz), cpu_tz));
    ASSERT_GT(Norm(ValuesOf(cpu_tz)), 0);
  }
  Tensor se = gpu.Zeros({4}, h), sz = gpu.Zeros({4}, f32), tz = gpu.Zeros({4}, f32);
  EXPECT_THROW(
      gpu.CrossEntropyPartials(this->Dev({4, 5}, Ints(80, 20)), this->Dev({4}, Ints(1, 4), f32),
                               this->DevIds({1, 2, 3, 4}), 0, se, sz, tz),
      std::invalid_argument);
}

// grad in the logits' 16-bit dtype from float32 statistics: the float32 values differ by a
// few ulp (exp, see kUlpTol), so after rounding they may be one 16-bit ulp apart.
TYPED_TEST(CudaKernelsHalfTest, CrossEntropyBackwardIncludingInPlace) {
  using H = TypeParam;
  const DType h = kDType<H>;
  const DType f32 = DType::kFloat32;
  CudaKernels& gpu = *this->gpu_;
  const int64_t rows = 5, cols = 300, vocab_start = 300;
  const std::vector<double> lv = Ints(90, rows * cols, -6, 6);
  const std::vector<int64_t> labels = {300, 599, 17, 450, 600};
  const std::vector<double> max(static_cast<size_t>(rows), 6.0);
  std::vector<double> se(static_cast<size_t>(rows), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      se[static_cast<size_t>(i)] += std::exp(lv[static_cast<size_t>(i * cols + j)] - 6.0);
    }
  }
  const std::vector<double> scale = {1, 0.5, 2, 0.25, 1};
  for (const auto& [on, off] : {std::pair<double, double>{1.0, 0.0}, {0.9, 0.1 / 599}}) {
    SCOPED_TRACE(fmt::format("on {} off {}", on, off));
    Tensor cpu_grad = Tensor::HostZeros({rows, cols}, h);
    this->cpu_.CrossEntropyBackward(this->Host({rows, cols}, lv), this->Host({rows}, max, f32),
                                    this->Host({rows}, se, f32), Ids(labels), vocab_start, on, off,
                                    this->Host({rows}, scale, f32), cpu_grad);
    Tensor gpu_grad = gpu.Zeros({rows, cols}, h);
    gpu.CrossEntropyBackward(this->Dev({rows, cols}, lv), this->Dev({rows}, max, f32),
                             this->Dev({rows}, se, f32), this->DevIds(labels), vocab_start, on, off,
                             this->Dev({rows}, scale, f32), gpu_grad);
    EXPECT_TRUE(TensorsNear("grad", this->Values(gpu_grad), ValuesOf(cpu_grad), kUlpTol<float>,
                            kHalfEps<H>));
    ASSERT_GT(Norm(ValuesOf(cpu_grad)), 0);

    Tensor in_place = this->Dev({rows, cols}, lv);
    gpu.CrossEntropyBackward(in_place, this->Dev({rows}, max, f32), this->Dev({rows}, se, f32),
                             this->DevIds(labels), vocab_start, on, off,
                             this->Dev({rows}, scale, f32), in_place);
    EXPECT_TRUE(SameBits("grad in place", this->Back(in_place), this->Back(gpu_grad)));
  }
  // grad has the logits' dtype; row_scale is float32.
  Tensor grad32 = gpu.Zeros({rows, cols}, f32);
  EXPECT_THROW(gpu.CrossEntropyBackward(this->Dev({rows, cols}, lv), this->Dev({rows}, max, f32),
                                        this->Dev({rows}, se, f32), this->DevIds(labels),
                                        vocab_start, 1, 0, this->Dev({rows}, scale, f32), grad32),
               std::invalid_argument);
  Tensor grad = gpu.Zeros({rows, cols}, h);
  EXPECT_THROW(gpu.CrossEntropyBackward(this->Dev({rows, cols}, lv), this->Dev({rows}, max, f32),
                                        this->Dev({rows}, se, f32), this->DevIds(labels),
                                        vocab_start, 1, 0, this->Dev({rows}, scale), grad),
               std::invalid_argument);
}

// --- the model kernels (attention, strided copies), every dtype -----------------------
//
// One typed suite over float64, float32, bfloat16 and float16, each result against
// EigenKernels on the same stored inputs. Copies (StridedCopy), masks (DropoutAt) and
// integer GEMMs (BatchedGemm) are compared exactly. The rest computes the same formula in
// the compute dtype on both sides, but sums rows in a tree on the GPU and in Eigen's order
// on the CPU, with different exp/sqrt/cos libraries: MatchesCpu allows kModelRtol, a few
// dozen roundings of the compute dtype, plus one 16-bit ulp for 16-bit storage (the two
// float32 values may straddle a rounding boundary), and the same tolerance times the
// largest |value| as an absolute term (cancellation near zero).

template <typename T>
constexpr bool kIsHalf = std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>;

template <typename T>
double ModelRtol() {
  if constexpr (std::is_same_v<T, double>) {
    return 1e-12;
  } else if constexpr (kIsHalf<T>) {
    return kHalfEps<T> + 1e-5;
  } else {
    return 1e-5;
  }
}

template <typename T>
::testing::AssertionResult MatchesCpu(const std::string& name, const std::vector<double>& gpu,
                                      const std::vector<double>& cpu) {
  double max_abs = 0;
  for (double v : cpu) max_abs = std::max(max_abs, std::fabs(v));
  return TensorsNear(name, gpu, cpu, ModelRtol<T>() * max_abs, ModelRtol<T>());
}
template <typename T>
std::vector<DType> AccumulatorDTypes() {
  if constexpr (kIsHalf<T>) {
    return {kDType<T>, DType::kFloat32};
  } else {
    return {kDType<T>};
  }
}

template <typename T>
class CudaKernelsModelTest : public CudaKernelsTest<T> {};
using AllDTypes = ::testing::Types<double, float, BFloat16, Float16>;
TYPED_TEST_SUITE(CudaKernelsModelTest, AllDTypes);

// Integer inputs: every product and sum is exact in every dtype (|c| <= 2 * 20 * 4 + 3 * 2 <
// 256, exact even in bfloat16), so cuBLAS and the CPU agree bit for bit.
TYPED_TEST(CudaKernelsModelTest, BatchedGemmIsExactOnIntegers) {
  using T = TypeParam;
  const DType dt = kDType<T>;
  CudaKernels& gpu = *this->gpu_;
  for (const auto& [batch, m, n, k] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{3, 5, 7, 6}, {2, 33, 47, 20}}) {
    for (DType c_dtype : AccumulatorDTypes<T>()) {
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          for (double alpha : {1.0, -2.0}) {
            for (double beta : {0.0, 1.0, 3.0}) {
              const std::string name =
                  fmt::format("{}x{}x{}x{} c={} ta={} tb={} alpha={} beta={}", batch, m, n, k,
                              DTypeName(c_dtype), ta, tb, alpha, beta);
              const Shape a_shape = ta ? Shape{batch, k, m} : Shape{batch, m, k};
              const Shape b_shape = tb ? Shape{batch, n, k} : Shape{batch, k, n};
              const std::vector<double> av = Ints(310, batch * m * k, -2, 2),
                                        bv = Ints(311, batch * k * n, -2, 2),
                                        cv = Ints(312, batch * m * n, -2, 2);
              Tensor cpu_c = this->Host({batch, m, n}, cv, c_dtype);
              this->cpu_.BatchedGemm(ta, tb, alpha, this->Host(a_shape, av),
                                     this->Host(b_shape, bv), beta, cpu_c);
              Tensor gpu_c = this->Dev({batch, m, n}, cv, c_dtype);
              gpu.BatchedGemm(ta, tb, alpha, this->Dev(a_shape, av), this->Dev(b_shape, bv),
                              beta, gpu_c);
              ASSERT_GT(Norm(ValuesOf(cpu_c)), 0) << name;
              EXPECT_TRUE(SameBits(name, this->Back(gpu_c), cpu_c));
            }
          }
        }
      }
    }
  }
  // k == 0 and alpha == 0: c = beta * c.
  const std::vector<double> cv = Ints(313, 2 * 3 * 4);
  Tensor c0 = this->Dev({2, 3, 4}, cv);
  gpu.BatchedGemm(false, false, 1.0, gpu.Zeros({2, 3, 0}, dt), gpu.Zeros({2, 0, 4}, dt), 2.0, c0);
  std::vector<double> doubled = cv;
  for (double& v : doubled) v *= 2;
  EXPECT_TRUE(TensorsNear("batched gemm k=0", this->Values(c0), doubled));
  Tensor c_alpha0 = this->Dev({2, 3, 4}, cv);
  gpu.BatchedGemm(false, false, 0.0, this->Dev({2, 3, 5}, Ints(314, 30)),
                  this->Dev({2, 5, 4}, Ints(315, 40)), 0.0, c_alpha0);
  EXPECT_TRUE(TensorsNear("batched gemm alpha=0 beta=0", this->Values(c_alpha0),
                          std::vector<double>(cv.size(), 0.0)));
  Tensor c2d = gpu.Zeros({6, 4}, dt);
  EXPECT_THROW(gpu.BatchedGemm(false, false, 1, this->Dev({2, 3, 5}, Ints(314, 30)),
                               this->Dev({2, 5, 4}, Ints(315, 40)), 0, c2d),
               std::invalid_argument);
}

// Positions 0..n-1, and context-parallel rank 0's of 2 over a sequence of 2n (chunks of n/2:
// positions [0, n/2) and [3n/2, 2n)) with every rank's keys gathered in rank order.
std::vector<int64_t> Arange(int64_t begin, int64_t end) {
  std::vector<int64_t> v;
  for (int64_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

TYPED_TEST(CudaKernelsModelTest, CausalSoftmaxForwardBackward) {
  using T = TypeParam;
  const DType dt = kDType<T>;
  CudaKernels& gpu = *this->gpu_;
  struct Case {
    int64_t rows;
    std::vector<int64_t> q, k;
  };
  std::vector<Case> cases;
  // (rows, seq) without cp: small; rows wider than a block; more rows than grid blocks.
  for (const auto& [rows, seq] : {std::pair<int64_t, int64_t>{18, 9}, {600, 300}, {70000, 5}}) {
    cases.push_back({rows, Arange(0, seq), Arange(0, seq)});
  }
  // cp rank 0 of 2 over s = 600 (chunks of 150), keys of both ranks gathered in rank order.
  std::vector<int64_t> q = Arange(0, 150), k;
  for (int64_t p : Arange(450, 600)) q.push_back(p);
  k = q;
  for (int64_t p : Arange(150, 450)) k.push_back(p);
  cases.push_back({600, q, k});
  // A ring step: keys after some queries, whose rows see none.
  cases.push_back({40, Arange(0, 20), Arange(10, 30)});
  for (const Case& c : cases) {
    const int64_t rows = c.rows, kv = static_cast<int64_t>(c.k.size());
    SCOPED_TRACE(fmt::format("{} rows, {} query positions, {} keys", rows, c.q.size(), kv));
    const Tensor cpu_q = Ids(c.q), cpu_k = Ids(c.k);
    const Tensor gpu_q = this->DevIds(c.q), gpu_k = this->DevIds(c.k);
    const double scale = 0.35;
    std::vector<double> sv = Reals(320, rows * kv);
    for (double& v : sv) v *= 6;
    const std::vector<double> dpv = Reals(321, rows * kv);
    Tensor cpu_p = this->Host({rows, kv}, std::vector<double>(static_cast<size_t>(rows * kv)));
    this->cpu_.CausalSoftmaxForward(this->Host({rows, kv}, sv), cpu_q, cpu_k, scale, cpu_p);
    Tensor gpu_p = this->Dev({rows, kv}, std::vector<double>(static_cast<size_t>(rows * kv), 7));
    gpu.CausalSoftmaxForward(this->Dev({rows, kv}, sv), gpu_q, gpu_k, scale, gpu_p);
    const std::vector<double> pv = this->Values(gpu_p);
    EXPECT_TRUE(MatchesCpu<T>("probs", pv, ValuesOf(cpu_p)));
    int64_t masked_nonzero = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t query = c.q[static_cast<size_t>(r) % c.q.size()];
      for (int64_t j = 0; j < kv; ++j) {
        if (c.k[static_cast<size_t>(j)] > query) {
          masked_nonzero += pv[static_cast<size_t>(r * kv + j)] != 0.0;
        }
      }
    }
    EXPECT_EQ(masked_nonzero, 0);
    Tensor in_place = this->Dev({rows, kv}, sv);
    gpu.CausalSoftmaxForward(in_place, gpu_q, gpu_k, scale, in_place);
    EXPECT_TRUE(SameBits("probs in place", this->Back(in_place), this->Back(gpu_p)));

    // Backward from the CPU's probabilities on both sides.
    Tensor cpu_ds = this->Host({rows, kv}, std::vector<double>(static_cast<size_t>(rows * kv)));
    this->cpu_.CausalSoftmaxBackward(cpu_p, this->Host({rows, kv}, dpv), cpu_q, cpu_k, scale,
                                     cpu_ds);
    const Tensor probs = gpu.ToDevice(cpu_p);
    Tensor gpu_ds = gpu.Zeros({rows, kv}, dt);
    gpu.CausalSoftmaxBackward(probs, this->Dev({rows, kv}, dpv), gpu_q, gpu_k, scale, gpu_ds);
    ASSERT_GT(Norm(ValuesOf(cpu_ds)), 0);
    EXPECT_TRUE(MatchesCpu<T>("dscores", this->Values(gpu_ds), ValuesOf(cpu_ds)));
    Tensor ds_in_place = this->Dev({rows, kv}, dpv);
    gpu.CausalSoftmaxBackward(probs, ds_in_place, gpu_q, gpu_k, scale, ds_in_place);
    EXPECT_TRUE(SameBits("dscores in place", this->Back(ds_in_place), this->Back(gpu_ds)));
  }
}

// Context parallelism's p2p ring kernels against the CPU's on the same inputs: the softmax's
// log-sum-exp, a block's share of the full softmax from it, the backward with a given row
// dot, RowDot and LseMerge (rows of a ring step that see no key of the block included).
TYPED_TEST(CudaKernelsModelTest, RingKernelsMatchTheCpu) {
  using T = TypeParam;
  const DType dt = kDType<T>;
  const DType ct = ComputeDType(dt);
  CudaKernels& gpu = *this->gpu_;
  // A ring step (rows 0-9 of each head see no key), and the cp rank 0 of 2 case above.
  std::vector<int64_t> q = Arange(0, 150);
  for (int64_t p : Arange(450, 600)) q.push_back(p);
  struct Case {
    int64_t rows;
    std::vector<int64_t> q, k;
  };
  for (const Case& c : {Case{40, Arange(0, 20), Arange(10, 30)}, Case{600, q, Arange(150, 450)}}) {
    const int64_t rows = c.rows, kv = static_cast<int64_t>(c.k.size()), d = 5;
    SCOPED_TRACE(fmt::format("{} rows, {} keys", rows, kv));
    const Tensor cpu_q = Ids(c.q), cpu_k = Ids(c.k);
    const Tensor gpu_q = this->DevIds(c.q), gpu_k = this->DevIds(c.k);
    const double scale = 0.35;
    std::vector<double> sv = Reals(340, rows * kv);
    for (double& v : sv) v *= 6;
    // The softmax with its lse.
    Tensor cpu_p = this->cpu_.Zeros({rows, kv}, dt), cpu_lse = this->cpu_.Zeros({rows}, ct);
    this->cpu_.CausalSoftmaxForward(this->Host({rows, kv}, sv), cpu_q, cpu_k, scale, cpu_p,
                                    &cpu_lse);
    Tensor gpu_p = gpu.Zeros({rows, kv}, dt), gpu_lse = gpu.Zeros({rows}, ct);
    gpu.CausalSoftmaxForward(this->Dev({rows, kv}, sv), gpu_q, gpu_k, scale, gpu_p, &gpu_lse);
    EXPECT_TRUE(MatchesCpu<T>("probs", this->Values(gpu_p), ValuesOf(cpu_p)));
    const std::vector<double> gl = this->Values(gpu_lse), cl = ValuesOf(cpu_lse);
    int64_t unseen = 0;
    for (size_t r = 0; r < cl.size(); ++r) {
      if (std::isinf(cl[r])) {
        ++unseen;
        EXPECT_EQ(gl[r], cl[r]) << "row " << r;
      } else {
        EXPECT_NEAR(gl[r], cl[r], 1e-5 * (1 + std::fabs(cl[r]))) << "row " << r;
      }
    }
    EXPECT_EQ(unseen > 0, rows == 40);  // the ring step's early rows see no key
    // A block's share from a larger lse (as if the row had more keys elsewhere).
    std::vector<double> bigger = cl;
    for (double& l : bigger) l = std::isinf(l) ? l : l + 0.5;
    Tensor cpu_share = this->cpu_.Zeros({rows, kv}, dt), gpu_share = gpu.Zeros({rows, kv}, dt);
    this->cpu_.CausalSoftmaxFromLse(this->Host({rows, kv}, sv), MakeOf(ct, {rows}, bigger),
                                    cpu_q, cpu_k, scale, cpu_share);
    gpu.CausalSoftmaxFromLse(this->Dev({rows, kv}, sv), this->Dev({rows}, bigger, ct), gpu_q,
                             gpu_k, scale, gpu_share);
    EXPECT_TRUE(MatchesCpu<T>("share", this->Values(gpu_share), ValuesOf(cpu_share)));
    // The backward with a given row dot, and RowDot itself.
    const std::vector<double> dpv = Reals(341, rows * kv);
    Tensor cpu_dot = this->cpu_.Zeros({rows}, ct), gpu_dot = gpu.Zeros({rows}, ct);
    this->cpu_.RowDot(cpu_p, this->Host({rows, kv}, dpv), cpu_dot);
    gpu.RowDot(gpu.ToDevice(cpu_p), this->Dev({rows, kv}, dpv), gpu_dot);
    EXPECT_TRUE(TensorsNear("row dot", this->Values(gpu_dot), ValuesOf(cpu_dot), 1e-5, 1e-5));
    std::vector<double> dots = ValuesOf(cpu_dot);
    for (double& v : dots) v += 0.25;  // not the block's own sum
    Tensor cpu_ds = this->cpu_.Zeros({rows, kv}, dt), gpu_ds = gpu.Zeros({rows, kv}, dt);
    const Tensor cpu_dots = MakeOf(ct, {rows}, dots);
    this->cpu_.CausalSoftmaxBackward(cpu_p, this->Host({rows, kv}, dpv), cpu_q, cpu_k, scale,
                                     cpu_ds, &cpu_dots);
    const Tensor gpu_dots = this->Dev({rows}, dots, ct);
    gpu.CausalSoftmaxBackward(gpu.ToDevice(cpu_p), this->Dev({rows, kv}, dpv), gpu_q, gpu_k,
                              scale, gpu_ds, &gpu_dots);
    EXPECT_TRUE(MatchesCpu<T>("dscores with a row dot", this->Values(gpu_ds), ValuesOf(cpu_ds)));
    // LseMerge of a part into a running output, rows with either lse -inf included.
    const std::vector<double> ov = Reals(342, rows * d), pv = Reals(343, rows * d);
    std::vector<double> run_lse = Reals(344, rows), part_lse = Reals(345, rows);
    run_lse[0] = -INFINITY;
    part_lse[1] = -INFINITY;
    Tensor cpu_out = this->Host({rows, d}, ov), cpu_l = MakeOf(ct, {rows}, run_lse);
    this->cpu_.LseMerge(cpu_out, cpu_l, this->Host({rows, d}, pv), MakeOf(ct, {rows}, part_lse));
    Tensor gpu_out = this->Dev({rows, d}, ov), gpu_l = this->Dev({rows}, run_lse, ct);
    gpu.LseMerge(gpu_out, gpu_l, this->Dev({rows, d}, pv), this->Dev({rows}, part_lse, ct));
    EXPECT_TRUE(MatchesCpu<T>("merged output", this->Values(gpu_out), ValuesOf(cpu_out)));
    EXPECT_TRUE(TensorsNear("merged lse", this->Values(gpu_l), ValuesOf(cpu_l), 1e-5, 1e-5));
  }
}

// TopK: the same picks as the CPU, bit for bit (the order is a comparison, no arithmetic),
// on rows with ties everywhere, a NaN and infinities, for k = 1, 2 and every column.
TYPED_TEST(CudaKernelsModelTest, TopKMatchesTheCpu) {
  using T = TypeParam;
  const DType dt = kDType<T>;
  CudaKernels& gpu = *this->gpu_;
  const int64_t rows = 300, n = 64;
  std::vector<double> v = Ints(350, rows * n, -3, 3);
  v[5] = std::numeric_limits<double>::quiet_NaN();
  v[n + 7] = std::numeric_limits<double>::infinity();
  v[2 * n + 9] = -std::numeric_limits<double>::infinity();
  for (int64_t k : {int64_t{1}, int64_t{2}, n}) {
    SCOPED_TRACE(fmt::format("k {}", k));
    Tensor cpu_v = this->cpu_.Zeros({rows, k}, dt), cpu_i = this->cpu_.Zeros({rows, k}, DType::kInt64);
    this->cpu_.TopK(this->Host({rows, n}, v), k, cpu_v, cpu_i);
    Tensor gpu_v = gpu.Zeros({rows, k}, dt), gpu_i = gpu.Zeros({rows, k}, DType::kInt64);
    gpu.TopK(this->Dev({rows, n}, v), k, gpu_v, gpu_i);
    const Tensor host_i = gpu.ToHost(gpu_i);
    EXPECT_EQ(std::vector<int64_t>(host_i.data_as<int64_t>(), host_i.data_as<int64_t>() + rows * k),
              std::vector<int64_t>(cpu_i.data_as<int64_t>(), cpu_i.data_as<int64_t>() + rows * k));
    const std::vector<double> gv = this->Values(gpu_v), cv = ValuesOf(cpu_v);
    ASSERT_EQ(gv.size(), cv.size());
    for (size_t e = 0; e < cv.size(); ++e) {
      if (std::isnan(cv[e])) {
        EXPECT_TRUE(std::isnan(gv[e])) << e;
      } else {
        EXPECT_EQ(gv[e], cv[e]) << e;
      }
    }
  }
}

TYPED_TEST(CudaKernelsModelTest, Rope) {
  using T = TypeParam;
  const DType dt = kDType<T>;
  CudaKernels& gpu = *this->gpu_;
  const int64_t seq = 7, rows = 4 * seq, d = 64;
  const std::vector<double> xv = Reals(330, rows * d);
  // Positions 0..6 and a context-parallel rank's; dim 24 of 64: rotary_percent 0.375, the
  // other 40 columns copied.
  for (const std::vector<int64_t>& positions :
       {Arange(0, seq), std::vector<int64_t>{0, 1, 12, 13, 2, 27, 26}}) {
    for (const int64_t dim : {d, int64_t{24}}) {
      for (bool inverse : {false, true}) {
        SCOPED_TRACE(fmt::format("positions from {}, dim {} inverse {}", positions[2], dim,
                                 inverse));
        const Tensor cpu_pos = Ids(positions), gpu_pos = this->DevIds(positions);
        Tensor cpu_y = this->Host({rows, d}, std::vector<double>(static_cast<size_t>(rows * d)));
        this->cpu_.Rope(this->Host({rows, d}, xv), cpu_pos, 10000.0, dim, inverse, cpu_y);
        Tensor gpu_y = gpu.Zeros({rows, d}, dt);
        gpu.Rope(this->Dev({rows, d}, xv), gpu_pos, 10000.0, dim, inverse, gpu_y);
        // cos and sin of the same double angle from two libraries, rounded to the compute
        // dtype.
        EXPECT_TRUE(MatchesCpu<T>("rope", this->Values(gpu_y), ValuesOf(cpu_y)));
        Tensor in_place = this->Dev({rows, d}, xv);
        gpu.Rope(in_place, gpu_pos, 10000.0, dim, inverse, in_place);
        EXPECT_TRUE(SameBits("rope in place", this->Back(in_place), this->Back(gpu_y)));
      }
    }
  }
}

// Copies move bits: the GPU's result equals the CPU's exactly.
TYPED_TEST(CudaKernelsModelTest, StridedCopyIsBitIdentical) {
  using T = TypeParam;
  const DType dt = kDType<T>;
  CudaKernels& gpu = *this->gpu_;
  // A 5-D permutation (src.permute(2, 0, 4, 1, 3)) and the fused-QKV split of
  // core/model/attention.cc with an offset into each row.
  const int64_t s = 33, b = 4, g = 2, r = 3, d = 64, w = g * (r + 2) * d;
  struct Case {
    std::string name;
    Shape src_shape, dst_shape;
    int64_t src_offset, dst_offset;
    std::vector<int64_t> dims, src_strides, dst_strides;
  };
  const Case cases[] = {
      {"permute", {2, 3, 4, 5, 6}, {4, 2, 6, 3, 5}, 0, 0, {2, 3, 4, 5, 6},
       {360, 120, 30, 6, 1}, {90, 5, 180, 1, 15}},
      {"qkv -> k", {s * b, w}, {b * g * s, d}, r * d, 0, {b, g, s, d},
       {w, (r + 2) * d, b * w, 1}, {g * s * d, s * d, d, 1}},
      {"q -> qkv", {b * g * r * s, d}, {s * b, w}, 0, 0, {b, g, r, s, d},
       {g * r * s * d, r * s * d, s * d, d, 1}, {w, (r + 2) * d, d, b * w, 1}},
  };
  for (const Case& c : cases) {
    const std::vector<double> sv = Reals(350, NumElements(c.src_shape));
    const std::vector<double> fill(static_cast<size_t>(NumElements(c.dst_shape)), -3.0);
    Tensor cpu_dst = this->Host(c.dst_shape, fill);
    this->cpu_.StridedCopy(this->Host(c.src_shape, sv), c.src_offset, c.dims, c.src_strides,
                           cpu_dst, c.dst_offset, c.dst_strides);
    Tensor gpu_dst = this->Dev(c.dst_shape, fill);
    gpu.StridedCopy(this->Dev(c.src_shape, sv), c.src_offset, c.dims, c.src_strides, gpu_dst,
                    c.dst_offset, c.dst_strides);
    EXPECT_TRUE(SameBits(c.name, this->Back(gpu_dst), cpu_dst));
    EXPECT_NE(ValuesOf(cpu_dst), fill) << c.name;
  }
  Tensor dst = gpu.Zeros({4, 6}, dt);
  EXPECT_THROW(gpu.StridedCopy(this->Dev({4, 6}, Ints(1, 24)), 0, {4, 6}, {6, 1}, dst, 0, {0, 1}),
               std::invalid_argument);
}

TYPED_TEST(CudaKernelsModelTest, DropoutAtIsBitIdentical) {
  using T = TypeParam;
  const DType dt = kDType<T>;
  CudaKernels& gpu = *this->gpu_;
  // A [16, 8, 96] shard of a full [64, 32, 384] activation, and attention probabilities
  // [b, a_l, s * s] of a full [B, a, s, s].
  const GlobalIndexMap maps[] = {ActivationIndexMap(16, 8, 96, 32, 8, 192, 32, 384),
                                 GlobalIndexMap{5 * 12 * 100, {4, 3, 100}, {12 * 100, 100, 1}}};
  for (const GlobalIndexMap& map : maps) {
    const int64_t n = map.dims[0] * map.dims[1] * map.dims[2];
    SCOPED_TRACE(fmt::format("map base {} dims [{}]", map.base, fmt::join(map.dims, ", ")));
    const std::vector<double> xv = Reals(360, n);
    for (double p : {0.1, 0.5}) {
      Tensor cpu_y = Tensor::HostZeros({n}, dt);
      this->cpu_.DropoutAt(this->Host({n}, xv), p, 99, 7, map, cpu_y);
      Tensor gpu_y = gpu.Zeros({n}, dt);
      gpu.DropoutAt(this->Dev({n}, xv), p, 99, 7, map, gpu_y);
      EXPECT_TRUE(SameBits(fmt::format("dropout at p={}", p), this->Back(gpu_y), cpu_y));
      Tensor in_place = this->Dev({n}, xv);
      gpu.DropoutAt(in_place, p, 99, 7, map, in_place);
      EXPECT_TRUE(SameBits(fmt::format("dropout at in place p={}", p), this->Back(in_place),
                           cpu_y));
    }
  }
  Tensor y = gpu.Zeros({24}, dt);
  GlobalIndexMap wrong;
  wrong.dims = {1, 1, 23};
  EXPECT_THROW(gpu.DropoutAt(this->Dev({24}, Ints(1, 24)), 0.5, 1, 1, wrong, y),
               std::invalid_argument);
}

// --- optimizer ------------------------------------------------------------------------

// The optimizer step is one functor on both backends (core/optimizer_update.h), in float64
// with --fmad=false: three steps of each optimizer must give the CPU's bits exactly, for
// every gradient, master and parameter dtype.
TEST(CudaOptimizerTest, StepIsBitIdenticalToTheCpu) {
  if (!DeviceVisible()) GTEST_SKIP() << "no CUDA device is visible";
  CudaKernels gpu;
  EigenKernels cpu;
  const int64_t n = 5000;
  for (const bool adam : {true, false}) {
    for (const DType grad_dtype : {DType::kFloat32, DType::kFloat64}) {
      for (const DType master_dtype : {DType::kFloat32, DType::kFloat64}) {
        for (const DType param_dtype :
             {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
          SCOPED_TRACE(fmt::format("{} grad {} master {} param {}", adam ? "adam" : "sgd",
                                   DTypeName(grad_dtype), DTypeName(master_dtype),
                                   DTypeName(param_dtype)));
          Tensor cpu_master = MakeOf(master_dtype, {n}, Reals(401, n));
          Tensor cpu_m = cpu.Zeros({n}, master_dtype);
          Tensor cpu_v = adam ? cpu.Zeros({n}, master_dtype) : Tensor();
          Tensor cpu_param = cpu.Zeros({n}, param_dtype);
          Tensor gpu_master = gpu.ToDevice(cpu_master);
          Tensor gpu_m = gpu.Zeros({n}, master_dtype);
          Tensor gpu_v = adam ? gpu.Zeros({n}, master_dtype) : Tensor();
          Tensor gpu_param = gpu.Zeros({n}, param_dtype);
          for (int step = 1; step <= 3; ++step) {
            OptimizerUpdate u;
            u.kind = adam ? OptimizerUpdate::Kind::kAdam : OptimizerUpdate::Kind::kSgd;
            u.lr = 0.01;
            u.weight_decay = 0.1;
            u.bias_correction1 = 1 - std::pow(u.beta1, step);
            u.bias_correction2 = 1 - std::pow(u.beta2, step);
            u.momentum = 0.9;
            u.first_step = step == 1;
            u.master_float64 = master_dtype == DType::kFloat64;
            std::vector<double> g = Reals(410 + static_cast<uint64_t>(step), n);
            for (double& x : g) x *= 0.1;
            const Tensor grad = MakeOf(grad_dtype, {n}, g);
            cpu.OptimizerStep(u, grad, cpu_master, cpu_m, cpu_v, cpu_param);
            gpu.OptimizerStep(u, gpu.ToDevice(grad), gpu_master, gpu_m, gpu_v, gpu_param);
          }
          EXPECT_TRUE(SameBits("master", gpu.ToHost(gpu_master), cpu_master));
          EXPECT_TRUE(SameBits("state1", gpu.ToHost(gpu_m), cpu_m));
          if (adam) {
            EXPECT_TRUE(SameBits("state2", gpu.ToHost(gpu_v), cpu_v));
          }
          EXPECT_TRUE(SameBits("param", gpu.ToHost(gpu_param), cpu_param));
        }
      }
    }
  }
}

// store_param_remainders (OptimizerUpdate::ApplyWithRemainder): three adam steps from a
// bf16 parameter and zero remainders, float32 and bfloat16 gradients and moments: the GPU's
// parameter and remainder bits must be the CPU's.
TEST(CudaOptimizerTest, ParamRemaindersAreBitIdenticalToTheCpu) {
  if (!DeviceVisible()) GTEST_SKIP() << "no CUDA device is visible";
  CudaKernels gpu;
  EigenKernels cpu;
  const int64_t n = 5000;
  for (const DType grad_dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (const DType moment_dtype : {DType::kFloat32, DType::kBFloat16}) {
      SCOPED_TRACE(
          fmt::format("grad {} moments {}", DTypeName(grad_dtype), DTypeName(moment_dtype)));
      Tensor cpu_param = MakeOf(DType::kBFloat16, {n}, Reals(401, n));
      Tensor cpu_rem = cpu.Zeros({n}, DType::kBFloat16);
      Tensor cpu_m = cpu.Zeros({n}, moment_dtype), cpu_v = cpu.Zeros({n}, moment_dtype);
      Tensor gpu_param = gpu.ToDevice(cpu_param), gpu_rem = gpu.Zeros({n}, DType::kBFloat16);
      Tensor gpu_m = gpu.Zeros({n}, moment_dtype), gpu_v = gpu.Zeros({n}, moment_dtype);
      for (int step = 1; step <= 3; ++step) {
        OptimizerUpdate u;
        u.lr = 0.01;
        u.weight_decay = 0.1;
        u.bias_correction1 = 1 - std::pow(u.beta1, step);
        u.bias_correction2 = 1 - std::pow(u.beta2, step);
        u.param_remainders = true;
        std::vector<double> g = Reals(410 + static_cast<uint64_t>(step), n);
        for (double& x : g) x *= 0.1;
        const Tensor grad = MakeOf(grad_dtype, {n}, g);
        cpu.OptimizerStep(u, grad, cpu_rem, cpu_m, cpu_v, cpu_param);
        gpu.OptimizerStep(u, gpu.ToDevice(grad), gpu_rem, gpu_m, gpu_v, gpu_param);
      }
      EXPECT_TRUE(SameBits("remainder", gpu.ToHost(gpu_rem), cpu_rem));
      EXPECT_TRUE(SameBits("param", gpu.ToHost(gpu_param), cpu_param));
      EXPECT_TRUE(SameBits("exp_avg", gpu.ToHost(gpu_m), cpu_m));
      EXPECT_TRUE(SameBits("exp_avg_sq", gpu.ToHost(gpu_v), cpu_v));
    }
  }
}

// The gradient norm's sum of squares: exact on integer data (every partial sum is), the
// CPU's to a few float64 ulps on real data (another summation order), and the same bits on
// every call (one block, a fixed order).
TEST(CudaOptimizerTest, SumOfSquares) {
  if (!DeviceVisible()) GTEST_SKIP() << "no CUDA device is visible";
  CudaKernels gpu;
  EigenKernels cpu;
  for (const DType dtype : {DType::kFloat32, DType::kFloat64}) {
    SCOPED_TRACE(DTypeName(dtype));
    const int64_t n = 300001;
    const Tensor ints = MakeOf(dtype, {n}, Ints(420, n, -100, 100));
    Tensor gpu_out = gpu.Zeros({1}, DType::kFloat64);
    gpu.SumOfSquares(gpu.ToDevice(ints), gpu_out);
    Tensor cpu_out = cpu.Zeros({1}, DType::kFloat64);
    cpu.SumOfSquares(ints, cpu_out);
    ASSERT_GT(ValuesOf(cpu_out)[0], 0);
    EXPECT_EQ(ValuesOf(gpu.ToHost(gpu_out))[0], ValuesOf(cpu_out)[0]);

    const Tensor reals = MakeOf(dtype, {n}, Reals(421, n));
    const Tensor device_reals = gpu.ToDevice(reals);
    Tensor first = gpu.Zeros({1}, DType::kFloat64), second = gpu.Zeros({1}, DType::kFloat64);
    gpu.SumOfSquares(device_reals, first);
    gpu.SumOfSquares(device_reals, second);
    Tensor cpu_reals = cpu.Zeros({1}, DType::kFloat64);
    cpu.SumOfSquares(reals, cpu_reals);
    EXPECT_EQ(ValuesOf(gpu.ToHost(first))[0], ValuesOf(gpu.ToHost(second))[0]);
    EXPECT_TRUE(TensorsNear("sum of squares", ValuesOf(gpu.ToHost(first)), ValuesOf(cpu_reals),
                            0, 1e-13));
  }
}

}  // namespace
}  // namespace mpusim::cuda
