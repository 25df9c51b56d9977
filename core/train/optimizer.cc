// The optimizer step (see optimizer.h).
#include "core/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>

#include "core/half.h"
#include "core/tensor.h"

namespace mpusim {

namespace {

// `value` rounded to `dtype` (float32 or float64: the master and gradient dtypes) and widened
// back: core/half.h's rounding, the one every backend shares.
double RoundTo(double value, DType dtype) {
  return dtype == DType::kFloat64 ? value : Widen(mpusim::RoundTo<float>(value));
}

std::vector<double> HostValues(Kernels& k, const Tensor& t) {
  const Tensor host = k.ToHost(t);
  std::vector<double> out(static_cast<size_t>(host.numel()));
  for (int64_t i = 0; i < host.numel(); ++i) out[static_cast<size_t>(i)] = HostValue(host, i);
  return out;
}

Tensor HostZeros(int64_t n, DType dtype) {
  Tensor t = Tensor::HostEmpty({n}, dtype);
  std::memset(t.data(), 0, t.bytes());
  return t;
}

// Elements [offset, offset + numel(shape)) of the flat host tensor `flat`, as a host tensor
// of `shape`.
Tensor Slice(const Tensor& flat, int64_t offset, const Shape& shape) {
  Tensor out = Tensor::HostEmpty(shape, flat.dtype());
  const size_t element = DTypeSize(flat.dtype());
  std::memcpy(out.data(),
              static_cast<const std::byte*>(flat.data()) + static_cast<size_t>(offset) * element,
              out.bytes());
  return out;
}

}  // namespace

Optimizer::Optimizer(const OptimizerConfig& config, const std::vector<Parameter*>& params,
                     Kernels& k, DistributedOptimizerGroups groups)
    : config_(config), groups_(groups) {
  master_dtype_ = params.empty() ? DType::kFloat32 : ComputeDType(params.front()->value.dtype());
  if (!params.empty()) grad_dtype_ = params.front()->grad.dtype();
  for (Parameter* p : params) {
    State s;
    s.param = p;
    s.weight_decay = TakesWeightDecay(p->name, static_cast<int64_t>(p->full_shape.size()))
                         ? config.weight_decay
                         : 0.0;
    s.numel = p->value.numel();
    states_.push_back(std::move(s));
  }
  // The flat buffer: parameters in reverse order of registration.
  int64_t total = 0;
  for (auto it = states_.rbegin(); it != states_.rend(); ++it) {
    it->offset = total;
    total += it->numel;
  }
  if (distributed()) {
    const int64_t D = groups_.shard->Size();
    padded_ = (total + D - 1) / D * D;
    shard_size_ = padded_ / D;
    shard_begin_ = groups_.shard->Rank() * shard_size_;
    grad_shard_.assign(static_cast<size_t>(shard_size_), 0.0);
  }
  for (State& s : states_) {
    s.begin = distributed() ? std::clamp(shard_begin_ - s.offset, int64_t{0}, s.numel) : 0;
    s.end = distributed() ? std::clamp(shard_end() - s.offset, int64_t{0}, s.numel) : s.numel;
    const std::vector<double> values = HostValues(k, s.param->value);
    s.master.assign(values.begin() + s.begin, values.begin() + s.end);
    s.m.assign(s.master.size(), 0.0);
    if (config.kind == OptimizerConfig::Kind::kAdam) s.v.assign(s.master.size(), 0.0);
  }
}

void Optimizer::ReduceGradients(Kernels& k, CommTrace& trace) {
  if (!distributed()) return;
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (gradients)");
  Tensor flat = HostZeros(padded_, grad_dtype_);
  const size_t element = DTypeSize(grad_dtype_);
  for (const State& s : states_) {
    const Tensor host = k.ToHost(s.param->grad);
    std::memcpy(static_cast<std::byte*>(flat.data()) + static_cast<size_t>(s.offset) * element,
                host.data(), host.bytes());
  }
  Tensor shard;
  if (groups_.shard->Size() > 1) {
    shard = k.Zeros({shard_size_}, grad_dtype_);
    groups_.shard->ReduceScatter(k.ToDevice(flat), shard);
  } else {
    shard = k.ToDevice(flat);
  }
  if (groups_.replicas != nullptr && groups_.replicas->Size() > 1) {
    groups_.replicas->AllReduce(shard, ReduceOp::kSum);
  }
  const Tensor host = k.ToHost(shard);
  for (int64_t i = 0; i < shard_size_; ++i)
    grad_shard_[static_cast<size_t>(i)] = HostValue(host, i);
}

double Optimizer::GradNorm(Kernels& k, Communicator& tp, Communicator* pp, int64_t tp_rank,
                           CommTrace& trace) const {
  double sum = 0;
  for (const State& s : states_) {
    const Parameter& p = *s.param;
    const bool tp_duplicate = p.shard.Find(ShardAxis::kTp) == nullptr && tp_rank != 0;
    if (tp_duplicate || p.shared) continue;
    if (distributed()) {
      for (int64_t i = s.begin; i < s.end; ++i) {
        const double g = grad_shard_[static_cast<size_t>(s.offset + i - shard_begin_)];
        sum += g * g;
      }
    } else {
      for (double g : HostValues(k, p.grad)) sum += g * g;
    }
  }
  Tensor total = Tensor::HostEmpty({1}, DType::kFloat64);
  total.data_as<double>()[0] = sum;
  Tensor device = k.ToDevice(total);
  trace.SetPhase(Phase::kOther);
  trace.SetSite("optimizer (grad norm)");
  if (distributed()) {
    if (groups_.stats->Size() > 1) groups_.stats->AllReduce(device, ReduceOp::kSum);
  } else {
    if (tp.Size() > 1) tp.AllReduce(device, ReduceOp::kSum);
    if (pp != nullptr && pp->Size() > 1) pp->AllReduce(device, ReduceOp::kSum);
  }
  return std::sqrt(HostValue(k.ToHost(device), 0));
}

template <typename Value>
Tensor Optimizer::GatherFlat(Kernels& k, DType dtype, Value&& value) {
  Tensor shard = HostZeros(shard_size_, dtype);
  for (const State& s : states_) {
    for (int64_t i = s.begin; i < s.end; ++i) {
      SetHostValue(shard, s.offset + i - shard_begin_, value(s, i - s.begin));
    }
  }
  if (groups_.shard->Size() == 1) return shard;
  Tensor full = k.Zeros({padded_}, dtype);
  groups_.shard->AllGather(k.ToDevice(shard), full);
  return k.ToHost(full);
}

void Optimizer::Step(Kernels& k, double grad_norm, double lr, CommTrace& trace) {
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
    // The owned elements' gradients, clipped.
    std::vector<double> g;
    if (distributed()) {
      double* shard = grad_shard_.data() + (s.offset + s.begin - shard_begin_);
      if (clip != 1.0) {
        for (int64_t i = 0; i < s.end - s.begin; ++i)
          shard[i] = RoundTo(clip * shard[i], grad_dtype_);
      }
      g.assign(shard, shard + (s.end - s.begin));
    } else {
      if (clip != 1.0) k.Scale(clip, p.grad);
      g = HostValues(k, p.grad);
    }
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
    }
    if (!distributed()) {
      Tensor host = Tensor::HostEmpty(p.value.shape(), p.value.dtype());
      for (size_t i = 0; i < s.master.size(); ++i) {
        SetHostValue(host, static_cast<int64_t>(i), s.master[i]);
      }
      p.value = k.ToDevice(host);
    }
  }
  if (!distributed() || states_.empty()) return;
  // Every rank's updated shard, in the storage dtype, into every rank's parameters.
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (parameters)");
  const Tensor flat =
      GatherFlat(k, states_.front().param->value.dtype(),
                 [](const State& s, int64_t j) { return s.master[static_cast<size_t>(j)]; });
  for (State& s : states_)
    s.param->value = k.ToDevice(Slice(flat, s.offset, s.param->value.shape()));
}

void Optimizer::GatherGradients(Kernels& k, CommTrace& trace) {
  if (!distributed() || states_.empty()) return;
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (gather gradients for records)");
  const Tensor flat = GatherFlat(k, grad_dtype_, [this](const State& s, int64_t j) {
    return grad_shard_[static_cast<size_t>(s.offset + s.begin + j - shard_begin_)];
  });
  for (State& s : states_) s.param->grad = k.ToDevice(Slice(flat, s.offset, s.param->grad.shape()));
}

void Optimizer::RecordState(Kernels& k, CommTrace& trace, std::vector<TensorRecord>* records) {
  if (states_.empty()) return;
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (gather state for records)");
  const bool adam = config_.kind == OptimizerConfig::Kind::kAdam;
  using Member = std::vector<double> State::*;
  const std::vector<std::pair<const char*, Member>> kinds =
      adam ? std::vector<std::pair<const char*, Member>>{{".exp_avg", &State::m},
                                                         {".exp_avg_sq", &State::v}}
           : std::vector<std::pair<const char*, Member>>{{".momentum_buffer", &State::m}};
  for (const auto& kind : kinds) {
    const char* suffix = kind.first;
    const Member member = kind.second;
    Tensor flat;
    if (distributed()) {
      flat = GatherFlat(k, master_dtype_, [member](const State& s, int64_t j) {
        return (s.*member)[static_cast<size_t>(j)];
      });
    }
    for (const State& s : states_) {
      const Parameter& p = *s.param;
      Tensor host;
      if (distributed()) {
        host = Slice(flat, s.offset, p.value.shape());
      } else {
        host = Tensor::HostEmpty(p.value.shape(), master_dtype_);
        const std::vector<double>& values = s.*member;
        for (size_t i = 0; i < values.size(); ++i) {
          SetHostValue(host, static_cast<int64_t>(i), values[i]);
        }
      }
      records->push_back({p.name + suffix, k.ToDevice(host), p.full_shape, p.shard, false});
    }
  }
}

}  // namespace mpusim
