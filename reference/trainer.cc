// The reference's optimizer (see trainer.h).
#include "reference/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace mpusim {
namespace {

// The most a value x of a tensor whose largest magnitude is `absmax` changes when stored in
// `dtype` (trainer.h "Stored states").
double StoredError(DType dtype, double x, double absmax) {
  constexpr double u32 = 0x1p-24;
  switch (dtype) {
    case DType::kBFloat16:
      return (0x1p-8 + u32) * std::fabs(x);
    case DType::kFloat16: {
      const double scale = absmax * (1 + u32) / 32752.0;
      return (0x1p-11 + 4 * u32) * std::fabs(x) + 0x1p-25 * scale;
    }
    default:
      return 0.0;
  }
}

}  // namespace

ReferenceTrainer::ReferenceTrainer(const OptimizerConfig& config, int64_t train_iters)
    : config_(config), train_iters_(train_iters) {}

void ReferenceTrainer::SetParameters(const std::map<std::string, Tensor>& parameters) {
  parameters_.clear();
  for (const auto& [name, value] : parameters) {
    Tensor copy = Tensor::HostEmpty(value.shape(), DType::kFloat64);
    std::memcpy(copy.data(), value.data(), value.bytes());
    parameters_.emplace(name, std::move(copy));
  }
}

double ReferenceTrainer::Step(std::map<std::string, Tensor*>& grads, int64_t k) {
  ++steps_;
  double sum = 0;
  for (const auto& [name, g] : grads) {
    const double* x = g->data_as<double>();
    for (int64_t i = 0; i < g->numel(); ++i) sum += x[i] * x[i];
  }
  const double norm = std::sqrt(sum);
  if (config_.clip_grad > 0) {
    const double coeff = config_.clip_grad / (norm + 1e-6);
    if (coeff < 1.0) {
      for (auto& [name, g] : grads) {
        double* x = g->data_as<double>();
        for (int64_t i = 0; i < g->numel(); ++i) x[i] *= coeff;
      }
    }
  }
  const double lr = LearningRate(config_, k, train_iters_);
  last_lr_ = lr;
  const double clip = config_.clip_grad > 0 && config_.clip_grad / (norm + 1e-6) < 1.0
                          ? config_.clip_grad / (norm + 1e-6)
                          : 1.0;
  const double t = static_cast<double>(steps_);
  const double b1 = config_.adam_beta1, b2 = config_.adam_beta2;
  // K_t: the largest |update| Adam can make at step t.
  double k_t = 0;
  {
    double series = 0, r = 1;
    for (int64_t j = 0; j < steps_; ++j, r *= b1 / std::sqrt(b2)) series += r;
    k_t = (1 - b1) / std::sqrt(1 - b2) * series * std::sqrt(1 - std::pow(b2, t)) /
          (1 - std::pow(b1, t));
  }
  for (auto& [name, g] : grads) {
    const auto it = parameters_.find(name);
    if (it == parameters_.end()) {
      throw std::invalid_argument(fmt::format("ReferenceTrainer: no parameter '{}'", name));
    }
    Tensor& w = it->second;
    const double wd =
        TakesWeightDecay(name, static_cast<int64_t>(w.shape().size())) ? config_.weight_decay : 0.0;
    const auto n = static_cast<size_t>(w.numel());
    std::vector<double>& m = m_[name];
    std::vector<double>& dm = dm_[name];
    std::vector<double>& bound = bounds_[name];
    std::vector<double>& gm = gm_[name];
    m.resize(n, 0.0);
    dm.resize(n, 0.0);
    bound.resize(n, 0.0);
    gm.resize(n, 0.0);
    double* wv = w.data_as<double>();
    const double* gv = g->data_as<double>();
    // The gradient's error bound, through the clipping (whose coefficient carries the norm's
    // relative error, ntol at most).
    double g_max = 0;
    for (size_t i = 0; i < n; ++i) g_max = std::max(g_max, std::fabs(gv[i]));
    auto delta = [&](size_t i) {
      return (atol_ + ntol_ * g_max / clip + rtol_ * std::fabs(gv[i]) / clip) * clip +
             ntol_ * std::fabs(gv[i]);
    };
    // The gradient's error per unit of drift (see trainer.h): none at the first step, whose
    // parameters are the initial ones; its scale after, and |g_i| more through the clipping.
    auto drift_gain = [&](size_t i) {
      if (steps_ == 1) return 0.0;
      return g_max + (clip < 1.0 ? std::fabs(gv[i]) : 0.0);
    };
    if (config_.kind == OptimizerConfig::Kind::kAdam) {
      std::vector<double>& v = v_[name];
      std::vector<double>& dv = dv_[name];
      std::vector<double>& gv1 = gv1_[name];
      std::vector<double>& gv2 = gv2_[name];
      v.resize(n, 0.0);
      dv.resize(n, 0.0);
      gv1.resize(n, 0.0);
      gv2.resize(n, 0.0);
      // A float16 master: its initial scaling, at the first step.
      const auto absmax = [&](const std::vector<double>& x, const std::vector<double>& dx) {
        double out = 0;
        for (size_t i = 0; i < n; ++i) out = std::max(out, std::fabs(x[i]) + dx[i]);
        return out;
      };
      const auto store_master = [&]() {
        const double w_max = absmax(std::vector<double>(wv, wv + n), bound);
        for (size_t i = 0; i < n; ++i) {
          bound[i] += StoredError(DType::kFloat16, std::fabs(wv[i]) + bound[i], w_max);
        }
      };
      if (steps_ == 1 && precision_.master == DType::kFloat16) store_master();
      for (size_t i = 0; i < n; ++i) {
        const double d = delta(i);
        const double s = drift_gain(i);
        m[i] = b1 * m[i] + (1 - b1) * gv[i];
        v[i] = b2 * v[i] + (1 - b2) * gv[i] * gv[i];
        dm[i] = b1 * dm[i] + (1 - b1) * d;
        dv[i] = b2 * dv[i] + (1 - b2) * (2 * std::fabs(gv[i]) * d + d * d);
        // m and v are linear in g and g^2: a drift error adds to them as a rounding one does,
        // its cross term with the rounding error (2 d s rho) kept in the linear gain.
        gm[i] = b1 * gm[i] + (1 - b1) * s;
        gv1[i] = b2 * gv1[i] + (1 - b2) * 2 * (std::fabs(gv[i]) + d) * s;
        gv2[i] = b2 * gv2[i] + (1 - b2) * s * s;
      }
      // Each state stored in its dtype (trainer.h "Stored states").
      const double m_max = absmax(m, dm), v_max = absmax(v, dv);
      for (size_t i = 0; i < n; ++i) {
        dm[i] += StoredError(precision_.exp_avg, std::fabs(m[i]) + dm[i], m_max);
        dv[i] += StoredError(precision_.exp_avg_sq, std::fabs(v[i]) + dv[i], v_max);
      }
      for (size_t i = 0; i < n; ++i) {
        const double m_hat = m[i] / (1 - std::pow(b1, t));
        const double v_hat = v[i] / (1 - std::pow(b2, t));
        const double dm_hat = dm[i] / (1 - std::pow(b1, t));
        const double dv_hat = dv[i] / (1 - std::pow(b2, t));
        const double root = std::sqrt(v_hat);
        const double d_root =
            root > 0 ? std::min(std::sqrt(dv_hat), dv_hat / (2 * root)) : std::sqrt(dv_hat);
        const double denom = root + config_.adam_eps;
        const double update = m_hat / denom;
        const double d_update =
            (dm_hat + std::fabs(update) * d_root) / std::max(denom - d_root, config_.adam_eps);
        wv[i] -= lr * (update + wd * wv[i]);
        bound[i] = bound[i] * (1 + lr * wd) + lr * std::min(d_update, 2 * k_t);
      }
      // A float16 master stored after the update.
      if (precision_.master == DType::kFloat16) store_master();
    } else {
      for (size_t i = 0; i < n; ++i) {
        const double d = gv[i] + wd * wv[i];
        m[i] = steps_ == 1 ? d : config_.sgd_momentum * m[i] + d;
        dm[i] = (steps_ == 1 ? 0.0 : config_.sgd_momentum * dm[i]) + delta(i) + wd * bound[i];
        gm[i] = (steps_ == 1 ? 0.0 : config_.sgd_momentum * gm[i]) + drift_gain(i);
        wv[i] -= lr * m[i];
        bound[i] += lr * dm[i];
      }
    }
  }
  return norm;
}

std::vector<ReferenceTrainer::StateTensor> ReferenceTrainer::State() const {
  std::vector<StateTensor> out;
  const bool adam = config_.kind == OptimizerConfig::Kind::kAdam;
  for (const auto& [name, m] : m_) {
    out.push_back({name + (adam ? ".exp_avg" : ".momentum_buffer"), name, m, dm_.at(name),
                   gm_.at(name), {}});
    if (adam) {
      out.push_back({name + ".exp_avg_sq", name, v_.at(name), dv_.at(name), gv1_.at(name),
                     gv2_.at(name)});
    }
  }
  return out;
}

std::vector<double> ReferenceTrainer::StateTensor::BoundsAt(double rho) const {
  std::vector<double> out = bounds;
  for (size_t i = 0; i < out.size(); ++i) {
    if (i < drift_gain.size()) out[i] += rho * drift_gain[i];
    if (i < drift_gain2.size()) out[i] += rho * rho * drift_gain2[i];
  }
  return out;
}

}  // namespace mpusim
