// The optimizer step (see optimizer.h).
#include "core/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "core/tensor.h"

namespace mpusim {

namespace {

// The whole of `t` as a flat tensor sharing its storage.
Tensor Flat(const Tensor& t) { return t.Reshaped({t.numel()}); }

// A new tensor shaped like `like` holding elements [offset, offset + like.numel()) of `flat`
// (a new one: records of the step before may still hold the tensor it replaces).
Tensor CopyOfPart(Kernels& k, const Tensor& flat, int64_t offset, const Tensor& like) {
  Tensor out = k.Empty(like.shape(), like.dtype());
  Tensor place = Flat(out);
  k.Copy(flat.FlatSlice(offset, like.numel()), place);
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
  }
  // Master weights (the owned elements widened exactly: Axpy into zeros) and zero states,
  // on the backend's device.
  for (State& s : states_) {
    s.begin = distributed() ? std::clamp(shard_begin_ - s.offset, int64_t{0}, s.numel) : 0;
    s.end = distributed() ? std::clamp(shard_end() - s.offset, int64_t{0}, s.numel) : s.numel;
    const int64_t owned = s.end - s.begin;
    if (owned == 0) continue;
    s.master = k.Zeros({owned}, master_dtype_);
    k.Axpy(1.0, Flat(s.param->value).FlatSlice(s.begin, owned), s.master);
    s.m = k.Zeros({owned}, master_dtype_);
    if (config.kind == OptimizerConfig::Kind::kAdam) s.v = k.Zeros({owned}, master_dtype_);
  }
}

void Optimizer::ReduceGradients(Kernels& k, CommTrace& trace) {
  if (!distributed()) return;
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (gradients)");
  Tensor flat = k.Zeros({padded_}, grad_dtype_);
  for (const State& s : states_) {
    Tensor place = flat.FlatSlice(s.offset, s.numel);
    k.Copy(Flat(s.param->grad), place);
  }
  if (groups_.shard->Size() > 1) {
    grad_shard_ = k.Zeros({shard_size_}, grad_dtype_);
    groups_.shard->ReduceScatter(flat, grad_shard_);
  } else {
    grad_shard_ = flat;
  }
  if (groups_.replicas != nullptr && groups_.replicas->Size() > 1) {
    groups_.replicas->AllReduce(grad_shard_, ReduceOp::kSum);
  }
}

Tensor Optimizer::OwnedGradient(const State& s) const {
  return grad_shard_.FlatSlice(s.offset + s.begin - shard_begin_, s.end - s.begin);
}

double Optimizer::GradNorm(Kernels& k, Communicator& tp, Communicator* pp, Communicator* ep,
                           int64_t tp_rank, CommTrace& trace) const {
  Tensor total = k.Zeros({1}, DType::kFloat64);
  Tensor experts = k.Zeros({1}, DType::kFloat64);
  bool any_expert = false;
  for (const State& s : states_) {
    const Parameter& p = *s.param;
    const bool tp_duplicate = p.shard.Find(ShardAxis::kTp) == nullptr && tp_rank != 0;
    if (tp_duplicate || p.shared) continue;
    Tensor& sum = p.expert ? experts : total;
    any_expert = any_expert || p.expert;
    if (distributed()) {
      if (s.end > s.begin) k.SumOfSquares(OwnedGradient(s), sum);
    } else {
      k.SumOfSquares(Flat(p.grad), sum);
    }
  }
  trace.SetPhase(Phase::kOther);
  trace.SetSite("optimizer (grad norm)");
  if (ep != nullptr && ep->Size() > 1) {
    if (distributed()) throw std::logic_error("GradNorm: experts with the distributed optimizer");
    ep->AllReduce(experts, ReduceOp::kSum);
  }
  if (any_expert || (ep != nullptr && ep->Size() > 1)) k.Axpy(1.0, experts, total);
  if (distributed()) {
    if (groups_.stats->Size() > 1) groups_.stats->AllReduce(total, ReduceOp::kSum);
  } else {
    if (tp.Size() > 1) tp.AllReduce(total, ReduceOp::kSum);
    if (pp != nullptr && pp->Size() > 1) pp->AllReduce(total, ReduceOp::kSum);
  }
  return std::sqrt(HostValue(k.ToHost(total), 0));
}

Tensor Optimizer::GatherFlat(Kernels& k, DType dtype, Tensor State::*member) const {
  Tensor shard = k.Zeros({shard_size_}, dtype);
  for (const State& s : states_) {
    if (s.end == s.begin) continue;
    Tensor place = shard.FlatSlice(s.offset + s.begin - shard_begin_, s.end - s.begin);
    k.Copy(s.*member, place);
  }
  return GatherShard(k, shard);
}

Tensor Optimizer::GatherShard(Kernels& k, const Tensor& shard) const {
  if (groups_.shard->Size() == 1) return shard;
  Tensor full = k.Zeros({padded_}, shard.dtype());
  groups_.shard->AllGather(shard, full);
  return full;
}

void Optimizer::Step(Kernels& k, double grad_norm, double lr, CommTrace& trace) {
  ++steps_;
  const double t = static_cast<double>(steps_);
  double clip = 1.0;
  if (config_.clip_grad > 0) {
    const double coeff = config_.clip_grad / (grad_norm + 1e-6);
    if (coeff < 1.0) clip = coeff;
  }
  OptimizerUpdate update;
  update.kind = config_.kind == OptimizerConfig::Kind::kAdam ? OptimizerUpdate::Kind::kAdam
                                                              : OptimizerUpdate::Kind::kSgd;
  update.lr = lr;
  update.beta1 = config_.adam_beta1;
  update.beta2 = config_.adam_beta2;
  update.eps = config_.adam_eps;
  update.bias_correction1 = 1 - std::pow(config_.adam_beta1, t);
  update.bias_correction2 = 1 - std::pow(config_.adam_beta2, t);
  update.momentum = config_.sgd_momentum;
  update.first_step = steps_ == 1;
  update.master_float64 = master_dtype_ == DType::kFloat64;
  // The distributed optimizer's updated shard, in the parameters' storage dtype.
  Tensor param_shard;
  if (distributed() && !states_.empty()) {
    param_shard = k.Zeros({shard_size_}, states_.front().param->value.dtype());
  }
  for (State& s : states_) {
    Parameter& p = *s.param;
    update.weight_decay = s.weight_decay;
    if (distributed()) {
      if (s.end == s.begin) continue;
      Tensor g = OwnedGradient(s);
      if (clip != 1.0) k.Scale(clip, g);
      Tensor out = param_shard.FlatSlice(s.offset + s.begin - shard_begin_, s.end - s.begin);
      k.OptimizerStep(update, g, s.master, s.m, s.v, out);
    } else {
      if (clip != 1.0) k.Scale(clip, p.grad);
      // A new tensor, as the model's records of this step may still hold the old one.
      Tensor value = k.Empty(p.value.shape(), p.value.dtype());
      Tensor out = Flat(value);
      k.OptimizerStep(update, Flat(p.grad), s.master, s.m, s.v, out);
      p.value = value;
    }
  }
  if (!distributed() || states_.empty()) return;
  // Every rank's updated shard, in the storage dtype, into every rank's parameters.
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (parameters)");
  const Tensor flat = GatherShard(k, param_shard);
  for (State& s : states_) s.param->value = CopyOfPart(k, flat, s.offset, s.param->value);
}

void Optimizer::GatherGradients(Kernels& k, CommTrace& trace) {
  if (!distributed() || states_.empty()) return;
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (gather gradients for records)");
  const Tensor flat = GatherShard(k, grad_shard_);
  for (State& s : states_) s.param->grad = CopyOfPart(k, flat, s.offset, s.param->grad);
}

void Optimizer::RecordState(Kernels& k, CommTrace& trace, std::vector<TensorRecord>* records) {
  if (states_.empty()) return;
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (gather state for records)");
  const bool adam = config_.kind == OptimizerConfig::Kind::kAdam;
  using Member = Tensor State::*;
  const std::vector<std::pair<const char*, Member>> kinds =
      adam ? std::vector<std::pair<const char*, Member>>{{".exp_avg", &State::m},
                                                         {".exp_avg_sq", &State::v}}
           : std::vector<std::pair<const char*, Member>>{{".momentum_buffer", &State::m}};
  for (const auto& [suffix, member] : kinds) {
    Tensor flat;
    if (distributed()) flat = GatherFlat(k, master_dtype_, member);
    for (const State& s : states_) {
      const Parameter& p = *s.param;
      Tensor state;
      if (distributed()) {
        state = flat.FlatSlice(s.offset, s.numel).Reshaped(p.value.shape());
      } else {
        state = k.Empty(p.value.shape(), master_dtype_);
        Tensor place = Flat(state);
        k.Copy(s.*member, place);
      }
      records->push_back({p.name + suffix, state, p.full_shape, p.shard, false});
    }
  }
}

}  // namespace mpusim
