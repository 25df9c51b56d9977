// The float64 reference's ops (see ops.h).
#include "reference/ops.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numbers>
#include <stdexcept>

#include "core/rng.h"

namespace mpusim::ref {

// ---- linear ----------------------------------------------------------------------------------

void LinearForward(ConstMatRef x, ConstMatRef w, MatRef y) { y.noalias() = x * w.transpose(); }

void AddBias(ConstRowRef b, MatRef y) { y.rowwise() += b; }

void LinearGradInput(ConstMatRef dy, ConstMatRef w, MatRef dx) { dx.noalias() = dy * w; }

void LinearGradWeight(ConstMatRef dy, ConstMatRef x, MatRef dw) {
  dw.noalias() += dy.transpose() * x;
}

void LinearGradBias(ConstMatRef dy, RowRef db) { db += dy.colwise().sum(); }

// ---- embedding -------------------------------------------------------------------------------

void EmbeddingForward(ConstMatRef w, std::span<const int64_t> tokens, MatRef y) {
  for (int64_t r = 0; r < y.rows(); ++r) y.row(r) = w.row(tokens[static_cast<size_t>(r)]);
}

void EmbeddingBackward(ConstMatRef dy, std::span<const int64_t> tokens, MatRef dw) {
  for (int64_t r = 0; r < dy.rows(); ++r) dw.row(tokens[static_cast<size_t>(r)]) += dy.row(r);
}

// ---- activations -----------------------------------------------------------------------------

double Gelu(double x) { return 0.5 * x * (1.0 + std::erf(x / std::numbers::sqrt2)); }

double GeluGrad(double x) {
  const double cdf = 0.5 * (1.0 + std::erf(x / std::numbers::sqrt2));
  const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * std::numbers::pi);
  return cdf + x * pdf;
}

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

double ActivationF(Activation kind, double x) {
  switch (kind) {
    case Activation::kGelu:
      return Gelu(x);
    case Activation::kSwiglu:
      return x * Sigmoid(x);  // silu
    case Activation::kSquaredRelu:
      return x > 0.0 ? x * x : 0.0;
    case Activation::kQuickGeglu:  // quick_gelu(x) = x sigmoid(1.702 x)
      return x * Sigmoid(1.702 * x);
    case Activation::kRelu:
      return x > 0.0 ? x : 0.0;
  }
  throw std::logic_error("reference: unknown activation");
}

// silu'(x) = sig(x) (1 + x (1 - sig(x))); relu(x)^2' = 2 relu(x).
double ActivationGrad(Activation kind, double x) {
  switch (kind) {
    case Activation::kGelu:
      return GeluGrad(x);
    case Activation::kSwiglu:
      return Sigmoid(x) * (1.0 + x * (1.0 - Sigmoid(x)));
    case Activation::kSquaredRelu:
      return x > 0.0 ? 2.0 * x : 0.0;
    case Activation::kQuickGeglu:  // s (1 + 1.702 x (1 - s)), s = sigmoid(1.702 x)
      return Sigmoid(1.702 * x) * (1.0 + 1.702 * x * (1.0 - Sigmoid(1.702 * x)));
    case Activation::kRelu:
      return x > 0.0 ? 1.0 : 0.0;
  }
  throw std::logic_error("reference: unknown activation");
}

// Megatron's glu (megatron/core/transformer/mlp.py): x_glu.clamp(max=c), x_linear.clamp(-c, c)
// when clamped. Back, torch's clamp passes the gradient where min <= x <= max.
namespace {
double GluGate(const GluOptions& glu, double a) {
  return glu.clamped ? std::min(a, glu.clamp_value) : a;
}
double GluLinear(const GluOptions& glu, double b) {
  return glu.clamped ? std::clamp(b, -glu.clamp_value, glu.clamp_value) : b;
}
}  // namespace

void ActivationForward(Activation kind, ConstMatRef x, MatRef y, const GluOptions& glu) {
  if (!IsGated(kind)) {
    y = x.unaryExpr([kind](double v) { return ActivationF(kind, v); });
    return;
  }
  const int64_t f = y.cols();
  for (int64_t row = 0; row < x.rows(); ++row) {
    for (int64_t c = 0; c < f; ++c) {
      y(row, c) = ActivationF(kind, GluGate(glu, x(row, c))) *
                  (GluLinear(glu, x(row, f + c)) + glu.linear_offset);
    }
  }
}

void ActivationBackward(Activation kind, ConstMatRef dy, ConstMatRef x, MatRef dx,
                        const GluOptions& glu) {
  if (!IsGated(kind)) {
    dx = dy.cwiseProduct(x.unaryExpr([kind](double v) { return ActivationGrad(kind, v); }));
    return;
  }
  const int64_t f = dy.cols();
  for (int64_t row = 0; row < x.rows(); ++row) {
    for (int64_t c = 0; c < f; ++c) {
      const double a = x(row, c), b = x(row, f + c);
      const double gate = GluGate(glu, a), up = GluLinear(glu, b) + glu.linear_offset;
      const bool gate_passes = !glu.clamped || a <= glu.clamp_value;
      const bool up_passes = !glu.clamped || (b >= -glu.clamp_value && b <= glu.clamp_value);
      dx(row, c) = gate_passes ? dy(row, c) * up * ActivationGrad(kind, gate) : 0.0;
      dx(row, f + c) = up_passes ? dy(row, c) * ActivationF(kind, gate) : 0.0;
    }
  }
}

// ---- dropout ---------------------------------------------------------------------------------

double KeepScale(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }

uint64_t TrackerKey(uint64_t seed, int64_t pp_rank, int64_t dp_rank, bool model_parallel,
                    int64_t tp_rank) {
  const uint64_t default_key = DefaultSeed(seed, pp_rank, dp_rank);
  return model_parallel ? ModelParallelSeed(default_key, tp_rank) : default_key;
}

LocalElement LocalActivationElement(int64_t i, int64_t g, int64_t local_column, int64_t s_local,
                                    int64_t b, int64_t w_local) {
  return {i / s_local, g / b, ((i % s_local) * b + g % b) * w_local + local_column};
}

// ---- loss ------------------------------------------------------------------------------------

void CrossEntropy(ConstMatRef logits, std::span<const int64_t> labels, double label_smoothing,
                  double token_scale, std::span<double> loss, MatRef dlogits) {
  const auto vp = static_cast<double>(logits.cols());
  const double sm = label_smoothing > 0.0 ? label_smoothing * vp / (vp - 1.0) : 0.0;
  for (int64_t row = 0; row < logits.rows(); ++row) {
    const RowVec shifted = logits.row(row).array() - logits.row(row).maxCoeff();
    const double log_z = std::log(shifted.array().exp().sum());
    const int64_t y = labels[static_cast<size_t>(row)];
    loss[static_cast<size_t>(row)] =
        (1.0 - sm) * (log_z - shifted(y)) + sm * (log_z - shifted.mean());
    dlogits.row(row) = ((shifted.array() - log_z).exp() - sm / vp) * token_scale;
    dlogits(row, y) -= (1.0 - sm) * token_scale;
  }
}

}  // namespace mpusim::ref
