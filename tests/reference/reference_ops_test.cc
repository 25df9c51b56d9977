// Tests of the float64 reference's ops (reference/ops.h), each against values worked by hand
// or a central finite difference of a scalar of its output.
//
// Gradients: for an op y = f(x) and a fixed upstream gradient G, the scalar L = sum(G * y)
// has dL/dx = the op's backward of G, which is checked element by element against
// (L(x + h) - L(x - h)) / 2h. Tolerances: small integer-valued inputs make the linear ops'
// sums exact, so they are compared exactly (their finite differences, of a function linear in
// each element, to 1e-9); the smooth ops' differences with h = 1e-5 carry ~1e-10 truncation
// and ~1e-11 rounding error, so 1e-8; libm's erf and exp are within an ulp or two of the
// hand values, so 1e-15 relative.
#include "reference/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <stdexcept>
#include <vector>

#include "core/philox.h"

namespace mpusim {
namespace {

using ref::Mat;
using ref::RowVec;

// A small integer-valued [rows, cols] matrix in [-4, 4], a fixed function of `seed`.
Mat Ints(int64_t rows, int64_t cols, int seed) {
  Mat m(rows, cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      m(r, c) = static_cast<double>((r * 7 + c * 3 + seed * 5) % 9 - 4);
    }
  }
  return m;
}

// Non-integer values in (-3, 3) away from 0 (squared_relu has its kink there).
Mat Smooth(int64_t rows, int64_t cols, int seed) {
  Mat m(rows, cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double v = std::sin(static_cast<double>(r * 13 + c * 7 + seed)) * 3.0;
      m(r, c) = std::fabs(v) < 0.05 ? 0.3 : v;
    }
  }
  return m;
}

double Dot(const Mat& a, const Mat& b) { return a.cwiseProduct(b).sum(); }

// The central difference of scalar(x) with respect to each element of x (x is restored).
Mat FiniteDifference(Mat& x, double h, const std::function<double()>& scalar) {
  Mat grad(x.rows(), x.cols());
  for (int64_t r = 0; r < x.rows(); ++r) {
    for (int64_t c = 0; c < x.cols(); ++c) {
      const double saved = x(r, c);
      x(r, c) = saved + h;
      const double up = scalar();
      x(r, c) = saved - h;
      const double down = scalar();
      x(r, c) = saved;
      grad(r, c) = (up - down) / (2 * h);
    }
  }
  return grad;
}

void ExpectNear(const Mat& actual, const Mat& expected, double atol, const char* what) {
  ASSERT_EQ(actual.rows(), expected.rows()) << what;
  ASSERT_EQ(actual.cols(), expected.cols()) << what;
  ASSERT_GT(expected.norm(), 0.0) << what << ": all-zero expectation";
  for (int64_t r = 0; r < actual.rows(); ++r) {
    for (int64_t c = 0; c < actual.cols(); ++c) {
      EXPECT_NEAR(actual(r, c), expected(r, c), atol) << what << " (" << r << ", " << c << ")";
    }
  }
}

// ---- linear ----------------------------------------------------------------------------------

TEST(ReferenceOpsTest, LinearForwardIsXTimesWTransposedPlusBias) {
  Mat x(3, 2), w(3, 2);
  x << 1, 2, 3, 4, 5, -1;
  w << 1, 0, 2, -1, 0, 3;  // [out 3, in 2]
  RowVec b(3);
  b << 1, -2, 0.5;
  Mat y(3, 3);
  ref::LinearForward(x, w, y);
  ref::AddBias(b, y);
  Mat expected(3, 3);
  expected << 2, -2, 6.5,  //
      4, 0, 12.5,          //
      6, 9, -2.5;
  EXPECT_EQ(y, expected);
}

TEST(ReferenceOpsTest, LinearGradientsMatchFiniteDifferences) {
  const int64_t n = 5, in = 4, out = 3;
  Mat x = Ints(n, in, 1), w = Ints(out, in, 2);
  Mat b = Ints(1, out, 3);
  const Mat g = Ints(n, out, 4);  // dL/dy
  const auto loss = [&] {
    Mat y(n, out);
    ref::LinearForward(x, w, y);
    ref::AddBias(b.row(0), y);
    return Dot(g, y);
  };
  Mat dx(n, in), dw = Mat::Zero(out, in);
  RowVec db = RowVec::Zero(out);
  ref::LinearGradInput(g, w, dx);
  ref::LinearGradWeight(g, x, dw);
  ref::LinearGradBias(g, db);
  ExpectNear(dx, FiniteDifference(x, 0.5, loss), 1e-9, "dx");
  ExpectNear(dw, FiniteDifference(w, 0.5, loss), 1e-9, "dW");
  ExpectNear(db, FiniteDifference(b, 0.5, loss), 1e-9, "db");
  // Integer inputs: exact, and dx = G W by hand for one element.
  double dx00 = 0;
  for (int64_t o = 0; o < out; ++o) dx00 += g(0, o) * w(o, 0);
  EXPECT_EQ(dx(0, 0), dx00);
}

TEST(ReferenceOpsTest, LinearParameterGradientsAdd) {
  const Mat x = Ints(4, 3, 5), g = Ints(4, 2, 6);
  Mat dw = Mat::Zero(2, 3);
  RowVec db = RowVec::Zero(2);
  ref::LinearGradWeight(g, x, dw);
  ref::LinearGradBias(g, db);
  const Mat once = dw;
  const RowVec once_b = db;
  ASSERT_GT(once.norm(), 0.0);
  ref::LinearGradWeight(g, x, dw);
  ref::LinearGradBias(g, db);
  EXPECT_EQ(dw, Mat(2 * once));
  EXPECT_EQ(db, RowVec(2 * once_b));
  EXPECT_EQ(once_b(0), g.col(0).sum());
}

// ---- embedding -------------------------------------------------------------------------------

TEST(ReferenceOpsTest, EmbeddingLooksUpRowsAndAddsRepeatedTokens) {
  Mat w(4, 2);
  w << 1, 2, 3, 4, 5, 6, 7, 8;
  const std::vector<int64_t> tokens = {2, 0, 2};
  Mat y(3, 2);
  ref::EmbeddingForward(w, tokens, y);
  Mat expected(3, 2);
  expected << 5, 6, 1, 2, 5, 6;
  EXPECT_EQ(y, expected);

  Mat dy(3, 2);
  dy << 1, -1, 10, 20, 100, 200;
  Mat dw = Mat::Constant(4, 2, 0.5);  // adds to what is there
  ref::EmbeddingBackward(dy, tokens, dw);
  Mat expected_dw(4, 2);
  expected_dw << 10.5, 20.5, 0.5, 0.5, 101.5, 199.5, 0.5, 0.5;
  EXPECT_EQ(dw, expected_dw);
}

// ---- activations -----------------------------------------------------------------------------

TEST(ReferenceOpsTest, ActivationValuesByHand) {
  // Phi(1) = 0.841344746068542948585..., so gelu(+-1) = Phi(1) and Phi(1) - 1.
  EXPECT_EQ(ref::Gelu(0.0), 0.0);
  EXPECT_NEAR(ref::Gelu(1.0), 0.8413447460685429, 1e-15);
  EXPECT_NEAR(ref::Gelu(-1.0), -0.15865525393145705, 1e-15);
  EXPECT_NEAR(ref::Gelu(10.0), 10.0, 1e-15 * 10);
  // gelu'(0) = Phi(0) = 1/2; gelu'(1) = Phi(1) + phi(1), phi(1) = exp(-1/2) / sqrt(2 pi).
  EXPECT_NEAR(ref::GeluGrad(0.0), 0.5, 1e-15);
  EXPECT_NEAR(ref::GeluGrad(1.0), 0.8413447460685429 + 0.24197072451914337, 1e-15);
  // silu(1) = 1 / (1 + e^-1); silu'(0) = 1/2.
  EXPECT_NEAR(ref::ActivationF(Activation::kSwiglu, 1.0), 0.7310585786300049, 1e-15);
  EXPECT_NEAR(ref::ActivationGrad(Activation::kSwiglu, 0.0), 0.5, 1e-15);
  EXPECT_EQ(ref::ActivationF(Activation::kSquaredRelu, 3.0), 9.0);
  EXPECT_EQ(ref::ActivationF(Activation::kSquaredRelu, -2.0), 0.0);
  EXPECT_EQ(ref::ActivationGrad(Activation::kSquaredRelu, 3.0), 6.0);
  EXPECT_EQ(ref::ActivationGrad(Activation::kSquaredRelu, -2.0), 0.0);
  EXPECT_EQ(ref::ActivationF(Activation::kRelu, 3.0), 3.0);
  EXPECT_EQ(ref::ActivationF(Activation::kRelu, -2.0), 0.0);
  EXPECT_EQ(ref::ActivationGrad(Activation::kRelu, 3.0), 1.0);
  EXPECT_EQ(ref::ActivationGrad(Activation::kRelu, 0.0), 0.0);
  EXPECT_EQ(ref::ActivationF(Activation::kGelu, 0.7), ref::Gelu(0.7));
}

TEST(ReferenceOpsTest, GatedActivationMultipliesTheGateByTheUpHalf) {
  Mat x(1, 4);  // [a | b], F = 2
  x << 1.0, -2.0, 3.0, 5.0;
  Mat y(1, 2);
  ref::ActivationForward(Activation::kSwiglu, x, y);
  EXPECT_NEAR(y(0, 0), 0.7310585786300049 * 3.0, 1e-15);
  EXPECT_NEAR(y(0, 1), -2.0 / (1.0 + std::exp(2.0)) * 5.0, 1e-15);
}

TEST(ReferenceOpsTest, ActivationGradientsMatchFiniteDifferences) {
  const int64_t n = 3, f = 4;
  for (Activation kind : {Activation::kGelu, Activation::kSwiglu, Activation::kSquaredRelu,
                          Activation::kQuickGeglu, Activation::kRelu}) {
    SCOPED_TRACE(ActivationName(kind));
    const int64_t in_width = IsGated(kind) ? 2 * f : f;
    Mat x = Smooth(n, in_width, 1);
    const Mat g = Smooth(n, f, 2);  // dL/dy
    const auto loss = [&] {
      Mat y(n, f);
      ref::ActivationForward(kind, x, y);
      return Dot(g, y);
    };
    Mat dx(n, in_width);
    ref::ActivationBackward(kind, g, x, dx);
    ExpectNear(dx, FiniteDifference(x, 1e-5, loss), 1e-8, "dx");
  }
}

// gpt-oss's glu: offset 1, clamp 0.5; Smooth's inputs are away from the bounds by more than the
// difference step, so the clamped inputs' finite differences are zero as the gradient is.
TEST(ReferenceOpsTest, ClampedGluGradientsMatchFiniteDifferences) {
  const int64_t n = 3, f = 4;
  const GluOptions glu{.linear_offset = 1.0, .clamped = true, .clamp_value = 0.5};
  for (Activation kind : {Activation::kSwiglu, Activation::kQuickGeglu}) {
    SCOPED_TRACE(ActivationName(kind));
    Mat x = Smooth(n, 2 * f, 1);
    const Mat g = Smooth(n, f, 2);
    const auto loss = [&] {
      Mat y(n, f);
      ref::ActivationForward(kind, x, y, glu);
      return Dot(g, y);
    };
    Mat dx(n, 2 * f);
    ref::ActivationBackward(kind, g, x, dx, glu);
    int64_t clamped = 0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < f; ++j) {
        ASSERT_GT(std::fabs(x(i, j) - 0.5), 1e-4);
        ASSERT_GT(std::fabs(std::fabs(x(i, f + j)) - 0.5), 1e-4);
        clamped += (x(i, j) > 0.5) + (std::fabs(x(i, f + j)) > 0.5);
      }
    }
    EXPECT_GT(clamped, 0) << "no input reaches the clamp";
    EXPECT_LT(clamped, 2 * n * f) << "every input is clamped";
    ExpectNear(dx, FiniteDifference(x, 1e-5, loss), 1e-8, "dx");
  }
}

// ---- dropout ---------------------------------------------------------------------------------

TEST(ReferenceOpsTest, KeepScaleAndTrackerKeysByHand) {
  EXPECT_EQ(ref::KeepScale(0.0), 1.0);
  EXPECT_EQ(ref::KeepScale(0.25), 4.0 / 3.0);
  EXPECT_EQ(ref::KeepScale(1.0), 0.0);
  // DefaultSeed = seed + 100 pp + 10 dp; ModelParallelSeed = that + 2718 + tp.
  EXPECT_EQ(ref::TrackerKey(1234, 1, 2, false, 3), 1354u);
  EXPECT_EQ(ref::TrackerKey(1234, 1, 2, true, 3), 4075u);
}

TEST(ReferenceOpsTest, LocalElementOfASequenceSplitActivation) {
  // [s = 8, B = 6, w] held as [4, 3, 5] pieces (2 sequence shards, b = 3): element (6, 4, 2)
  // is local (2, 1, 2) on sequence shard 1, dp rank 1.
  const ref::LocalElement split = ref::LocalActivationElement(6, 4, 2, 4, 3, 5);
  EXPECT_EQ(split.seq_rank, 1);
  EXPECT_EQ(split.dp_rank, 1);
  EXPECT_EQ(split.index, (2 * 3 + 1) * 5 + 2);
  const ref::LocalElement whole = ref::LocalActivationElement(6, 4, 2, 8, 3, 5);
  EXPECT_EQ(whole.seq_rank, 0);
  EXPECT_EQ(whole.index, (6 * 3 + 1) * 5 + 2);
}

TEST(ReferenceOpsTest, DropoutKeepsWhereTheDrawIsAtLeastP) {
  const int64_t rows = 40, cols = 50;
  const auto draw_of = [&](int64_t r, int64_t c) {
    return ref::MaskDraw{7, 3, static_cast<uint64_t>(r * cols + c)};
  };
  const double p = 0.3;
  Mat keep(rows, cols);
  ref::DropoutKeep(p, draw_of, keep);
  int64_t kept = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const bool expect_kept = UniformAt(7, 3, static_cast<uint64_t>(r * cols + c)) >= p;
      EXPECT_EQ(keep(r, c), expect_kept ? 1.0 / 0.7 : 0.0) << r << ", " << c;
      kept += expect_kept ? 1 : 0;
    }
  }
  // 2000 draws keep 1400 +- 20.5 (one standard deviation): within 4 of them.
  EXPECT_NEAR(static_cast<double>(kept), 1400.0, 82.0);

  // p = 0 keeps everything without drawing; p = 1 drops everything.
  ref::DropoutKeep(
      0.0, [](int64_t, int64_t) -> ref::MaskDraw { throw std::logic_error("drew at p = 0"); },
      keep);
  EXPECT_EQ(keep, Mat::Ones(rows, cols));
  ref::DropoutKeep(1.0, draw_of, keep);
  EXPECT_EQ(keep, Mat::Zero(rows, cols));
}

// ---- cross entropy ---------------------------------------------------------------------------

TEST(ReferenceOpsTest, CrossEntropyByHand) {
  // Two classes, logits [0, ln 3]: softmax [1/4, 3/4]; label 0: loss ln 4, gradient
  // [1/4 - 1, 3/4], times the token scale.
  Mat z(1, 2);
  z << 0.0, std::log(3.0);
  const std::vector<int64_t> labels = {0};
  double loss = 0;
  Mat dz(1, 2);
  ref::CrossEntropy(z, labels, 0.0, 0.5, std::span<double>(&loss, 1), dz);
  EXPECT_NEAR(loss, std::log(4.0), 1e-15);
  EXPECT_NEAR(dz(0, 0), -0.75 * 0.5, 1e-15);
  EXPECT_NEAR(dz(0, 1), 0.75 * 0.5, 1e-15);
}

// With label smoothing ls the loss is the cross entropy against the target q_y = 1 - ls,
// q_j = ls / (Vp - 1) elsewhere (what sm = ls Vp / (Vp - 1) spreads).
TEST(ReferenceOpsTest, CrossEntropyIsTheSmoothedTargetsAndItsGradient) {
  const int64_t n = 3, vp = 5;
  const double ls = 0.2;
  Mat z = Smooth(n, vp, 3);
  const std::vector<int64_t> labels = {4, 0, 2};
  std::vector<double> loss(n);
  Mat dz(n, vp);
  ref::CrossEntropy(z, labels, ls, 1.0, loss, dz);
  for (int64_t r = 0; r < n; ++r) {
    double log_z = 0;
    for (int64_t j = 0; j < vp; ++j) log_z += std::exp(z(r, j));
    log_z = std::log(log_z);
    double expected = 0;
    for (int64_t j = 0; j < vp; ++j) {
      const double q = j == labels[static_cast<size_t>(r)] ? 1.0 - ls : ls / (vp - 1.0);
      expected -= q * (z(r, j) - log_z);
    }
    EXPECT_NEAR(loss[static_cast<size_t>(r)], expected, 1e-14) << "row " << r;
  }
  const auto total = [&] {
    std::vector<double> l(n);
    Mat unused(n, vp);
    ref::CrossEntropy(z, labels, ls, 1.0, l, unused);
    return l[0] + l[1] + l[2];
  };
  ExpectNear(dz, FiniteDifference(z, 1e-5, total), 1e-8, "dlogits");
}

TEST(ReferenceOpsTest, CrossEntropyIsStableForLargeLogits) {
  Mat z = Smooth(2, 6, 4);
  const Mat shifted = (z.array() + 1000.0).matrix();
  const std::vector<int64_t> labels = {1, 5};
  std::vector<double> loss(2), loss_shifted(2);
  Mat dz(2, 6), dz_shifted(2, 6);
  ref::CrossEntropy(z, labels, 0.1, 1.0, loss, dz);
  ref::CrossEntropy(shifted, labels, 0.1, 1.0, loss_shifted, dz_shifted);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(std::isfinite(loss_shifted[r]));
    EXPECT_NEAR(loss_shifted[r], loss[r], 1e-12);
  }
  ExpectNear(dz_shifted, dz, 1e-12, "dlogits");
}

}  // namespace
}  // namespace mpusim
