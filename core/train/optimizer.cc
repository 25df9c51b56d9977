// The optimizer step (see optimizer.h).
#include "core/train/optimizer.h"

#include <cmath>

#include "core/half.h"
#include "core/tensor.h"

namespace mpusim {

namespace {

// `value` rounded to the master dtype (float32, or float64 for a float64 run) and widened back:
// core/half.h's rounding, the one every backend shares.
double RoundTo(double value, DType master) {
  return master == DType::kFloat64 ? value : Widen(mpusim::RoundTo<float>(value));
}

std::vector<double> HostValues(Kernels& k, const Tensor& t) {
  const Tensor host = k.ToHost(t);
  std::vector<double> out(static_cast<size_t>(host.numel()));
  for (int64_t i = 0; i < host.numel(); ++i) out[static_cast<size_t>(i)] = HostValue(host, i);
  return out;
}

}  // namespace

Optimizer::Optimizer(const OptimizerConfig& config, ParameterSet& params, Kernels& k)
    : config_(config) {
  master_dtype_ =
      params.all().empty() ? DType::kFloat32 : ComputeDType(params.all().front()->value.dtype());
  for (const auto& p : params.all()) {
    State s;
    s.param = p.get();
    s.weight_decay = TakesWeightDecay(p->name, static_cast<int64_t>(p->full_shape.size()))
                         ? config.weight_decay
                         : 0.0;
    s.master = HostValues(k, p->value);
    s.m.assign(s.master.size(), 0.0);
    if (config.kind == OptimizerConfig::Kind::kAdam) s.v.assign(s.master.size(), 0.0);
    states_.push_back(std::move(s));
  }
}

double Optimizer::GradNorm(Kernels& k, Communicator& tp, Communicator* pp, int64_t tp_rank,
                           CommTrace& trace) const {
  double sum = 0;
  for (const State& s : states_) {
    const Parameter& p = *s.param;
    const bool tp_duplicate = p.shard.Find(ShardAxis::kTp) == nullptr && tp_rank != 0;
    if (tp_duplicate || p.shared) continue;
    for (double g : HostValues(k, p.grad)) sum += g * g;
  }
  Tensor total = Tensor::HostEmpty({1}, DType::kFloat64);
  total.data_as<double>()[0] = sum;
  Tensor device = k.ToDevice(total);
  trace.SetPhase(Phase::kOther);
  trace.SetSite("optimizer (grad norm)");
  if (tp.Size() > 1) tp.AllReduce(device, ReduceOp::kSum);
  if (pp != nullptr && pp->Size() > 1) pp->AllReduce(device, ReduceOp::kSum);
  return std::sqrt(HostValue(k.ToHost(device), 0));
}

void Optimizer::Step(Kernels& k, double grad_norm, double lr) {
  ++steps_;
  const double t = static_cast<double>(steps_);
  double clip = 1.0;
  if (config_.clip_grad > 0) {
    const double coeff = config_.clip_grad / (grad_norm + 1e-6);
    if (coeff < 1.0) clip = coeff;
  }
  const double b1 = config_.adam_beta1, b2 = config_.adam_beta2;
  for (State& s : states_) {
    Parameter& p = *s.param;
    if (clip != 1.0) k.Scale(clip, p.grad);
    const std::vector<double> g = HostValues(k, p.grad);
    Tensor host = Tensor::HostEmpty(p.value.shape(), p.value.dtype());
    for (size_t i = 0; i < g.size(); ++i) {
      double& w = s.master[i];
      if (config_.kind == OptimizerConfig::Kind::kAdam) {
        s.m[i] = RoundTo(b1 * s.m[i] + (1 - b1) * g[i], master_dtype_);
        s.v[i] = RoundTo(b2 * s.v[i] + (1 - b2) * g[i] * g[i], master_dtype_);
        const double m_hat = s.m[i] / (1 - std::pow(b1, t));
        const double v_hat = s.v[i] / (1 - std::pow(b2, t));
        w -= lr * (m_hat / (std::sqrt(v_hat) + config_.adam_eps) + s.weight_decay * w);
      } else {
        const double d = g[i] + s.weight_decay * w;
        s.m[i] = RoundTo(steps_ == 1 ? d : config_.sgd_momentum * s.m[i] + d, master_dtype_);
        w -= lr * s.m[i];
      }
      w = RoundTo(w, master_dtype_);
      SetHostValue(host, static_cast<int64_t>(i), w);
    }
    p.value = k.ToDevice(host);
  }
}

}  // namespace mpusim
