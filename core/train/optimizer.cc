// The optimizer step (see optimizer.h).
#include "core/train/optimizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "core/model/fully_shard.h"
#include "core/tensor.h"

namespace mpusim {

namespace {

// The whole of `t` as a flat tensor sharing its storage.
Tensor Flat(const Tensor& t) { return t.Reshaped({t.numel()}); }

// A new tensor holding t's values in `dtype` (widening here: exact).
Tensor Converted(Kernels& k, const Tensor& t, DType dtype) {
  Tensor out = k.Empty(t.shape(), dtype);
  k.Convert(t, out);
  return out;
}

// A new tensor shaped like `like`, in `flat`'s dtype, holding elements
// [offset, offset + like.numel()) of `flat` (a new one: records of the step before may still
// hold the tensor it replaces).
Tensor CopyOfPart(Kernels& k, const Tensor& flat, int64_t offset, const Tensor& like) {
  Tensor out = k.Empty(like.shape(), flat.dtype());
  Tensor place = Flat(out);
  k.Copy(flat.FlatSlice(offset, like.numel()), place);
  return out;
}

}  // namespace

Optimizer::Optimizer(const OptimizerConfig& config, const std::vector<Parameter*>& params,
                     Kernels& k, DistributedOptimizerGroups groups)
    : config_(config), groups_(groups) {
  const DType storage = params.empty() ? DType::kFloat32 : params.front()->value.dtype();
  master_dtype_ = ComputeDType(storage);
  precision_ = PrecisionOf(&config, storage);
  if (!params.empty()) grad_dtype_ = params.front()->grad.dtype();
  // The precision-aware optimizer reads a 16-bit main_grad as it is (Megatron hands FusedAdam
  // the main_grad shard as `decoupled_grad`); the others read float32 copies.
  copies_grads_ = DTypeSize(grad_dtype_) == 2 && !config.use_precision_aware_optimizer;
  if (config.use_precision_aware_optimizer &&
      (groups_.shard == nullptr || config.kind != OptimizerConfig::Kind::kAdam)) {
    throw std::logic_error(
        "Optimizer: the precision-aware optimizer is adam with the "
        "distributed optimizer (CheckOptimizerPrecision refuses the rest)");
  }
  for (Parameter* p : params) {
    State s;
    s.param = p;
    s.weight_decay = TakesWeightDecay(p->name, static_cast<int64_t>(p->full_shape.size()))
                         ? config.weight_decay
                         : 0.0;
    s.numel = p->value.numel();
    states_.push_back(std::move(s));
  }
  // The flat buffers: parameters in reverse order of registration, the experts' apart when
  // they shard over their own group.
  const bool expert_buffer = groups_.shard != nullptr && groups_.expert_shard != nullptr;
  std::vector<int64_t> totals(expert_buffer ? 2 : 1, 0);
  for (auto it = states_.rbegin(); it != states_.rend(); ++it) {
    if (it->param->expert && groups_.shard != nullptr && !expert_buffer) {
      throw std::logic_error("Optimizer: an expert parameter but no expert shard group");
    }
    it->buffer = expert_buffer && it->param->expert ? 1 : 0;
    it->offset = totals[it->buffer];
    totals[it->buffer] += it->numel;
  }
  if (distributed()) {
    for (size_t b = 0; b < totals.size(); ++b) {
      Buffer buffer;
      buffer.shard = b == 0 ? groups_.shard : groups_.expert_shard;
      buffer.replicas = groups_.replicas;
      const int64_t D = buffer.shard->Size();
      buffer.padded = (totals[b] + D - 1) / D * D;
      buffer.size = buffer.padded / D;
      buffer.begin = buffer.shard->Rank() * buffer.size;
      buffers_.push_back(buffer);
    }
  }
  // Master weights (the owned elements widened exactly: Axpy into zeros) and zero states,
  // on the backend's device, each in its dtype. A float16 master is the widened parameter
  // scaled (FusedAdam.initialize_state: set_scaled_state(param.float())); a float16 moment
  // starts at zero with scale 1 (its `_scales` start as torch.ones).
  const auto zero_state = [&](DType dtype, int64_t owned) {
    Stored out{k.Zeros({owned}, dtype), Tensor()};
    if (dtype == DType::kFloat16) {
      Tensor one = Tensor::HostEmpty({1}, DType::kFloat32);
      one.data_as<float>()[0] = 1.0f;
      out.scale = k.ToDevice(one);
    }
    return out;
  };
  for (State& s : states_) {
    const Buffer& b = Find(s.buffer);
    s.begin = distributed() ? std::clamp(b.begin - s.offset, int64_t{0}, s.numel) : 0;
    s.end =
        distributed() ? std::clamp(b.begin + b.size - s.offset, int64_t{0}, s.numel) : s.numel;
    const int64_t owned = s.end - s.begin;
    if (owned == 0) continue;
    const Tensor values = Flat(s.param->value).FlatSlice(s.begin, owned);
    if (precision_.param_remainders) {
      // No float32 master: the parameter is its high half, and the remainder starts at zero
      // (fused_adam.py _initialize_state: torch.zeros_like(param, dtype=torch.int16)), so
      // the master starts as the parameter widened, as without remainders.
      s.master = {k.Zeros({owned}, kRemainderDType), Tensor()};
    } else if (precision_.master == DType::kFloat16) {
      const Tensor widened = Converted(k, values, DType::kFloat32);
      s.master = {k.Empty({owned}, DType::kFloat16), k.Zeros({1}, DType::kFloat32)};
      ScaleBack(k, widened, s.master);
    } else {
      s.master = {Converted(k, values, precision_.master), Tensor()};
    }
    s.m = zero_state(precision_.exp_avg, owned);
    if (config.kind == OptimizerConfig::Kind::kAdam) s.v = zero_state(precision_.exp_avg_sq, owned);
  }
}

Tensor Optimizer::Unscaled(Kernels& k, const Stored& stored) {
  if (!stored.scale.defined()) return stored.value;
  Tensor out = k.Empty(stored.value.shape(), DType::kFloat32);
  k.UnscaleState(stored.value, stored.scale, out);
  return out;
}

void Optimizer::ScaleBack(Kernels& k, const Tensor& unscaled, Stored& stored) {
  if (stored.scale.defined()) k.ScaleState(unscaled, stored.scale, stored.value);
}

void Optimizer::ReduceGradients(Kernels& k, CommTrace& trace) {
  if (distributed()) ReduceShards(k, trace);
  if (!copies_grads_) return;
  // Exact widening of what the step reads.
  if (distributed()) {
    for (Buffer& b : buffers_) b.step_grad = Converted(k, b.grad_shard, DType::kFloat32);
  } else {
    for (State& s : states_) {
      if (s.numel > 0) s.step_grad = Converted(k, Flat(s.param->grad), DType::kFloat32);
    }
  }
}

void Optimizer::ZeroGrad() {
  for (Buffer& b : buffers_) b.step_grad = Tensor();
  for (State& s : states_) s.step_grad = Tensor();
}

void Optimizer::ReduceShards(Kernels& k, CommTrace& trace) {
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (gradients)");
  for (size_t b = 0; b < buffers_.size(); ++b) {
    Buffer& buffer = buffers_[b];
    Tensor flat = k.Zeros({buffer.padded}, grad_dtype_);
    for (const State& s : states_) {
      if (s.buffer != b) continue;
      Tensor place = flat.FlatSlice(s.offset, s.numel);
      k.Copy(Flat(s.param->grad), place);
    }
    if (buffer.shard->Size() > 1) {
      buffer.grad_shard = k.Zeros({buffer.size}, grad_dtype_);
      buffer.shard->ReduceScatter(flat, buffer.grad_shard);
    } else {
      buffer.grad_shard = flat;
    }
    if (buffer.replicas != nullptr && buffer.replicas->Size() > 1) {
      buffer.replicas->AllReduce(buffer.grad_shard, ReduceOp::kSum);
    }
  }
}

Tensor Optimizer::StepGradient(const State& s) const {
  if (!distributed()) return copies_grads_ ? s.step_grad : Flat(s.param->grad);
  const Buffer& b = buffers_[s.buffer];
  const Tensor& shard = copies_grads_ ? b.step_grad : b.grad_shard;
  return shard.FlatSlice(s.offset + s.begin - b.begin, s.end - s.begin);
}

double Optimizer::GradNorm(Kernels& k, Communicator& tp, Communicator* pp, Communicator* tp_ep,
                           int64_t tp_rank, CommTrace& trace) const {
  Tensor total = k.Zeros({1}, DType::kFloat64);
  Tensor experts = k.Zeros({1}, DType::kFloat64);
  for (const State& s : states_) {
    const Parameter& p = *s.param;
    // A replicated dense parameter counts on tp rank 0; an expert weight is never replicated
    // within its tp_ep group (split over etp, or etp = 1).
    const bool tp_duplicate =
        !p.expert && p.shard.Find(ShardAxis::kTp) == nullptr && tp_rank != 0;
    if (tp_duplicate || p.shared) continue;
    Tensor& sum = p.expert ? experts : total;
    if (s.end > s.begin) k.SumOfSquares(StepGradient(s), sum);
  }
  trace.SetPhase(Phase::kOther);
  trace.SetSite("optimizer (grad norm)");
  if (distributed()) {
    // The sum over intra_dist_opt spans every rank of the instance, so each owned element,
    // dense or expert, counts once.
    k.Axpy(1.0, experts, total);
    if (groups_.stats->Size() > 1) groups_.stats->AllReduce(total, ReduceOp::kSum);
  } else {
    // The dense squares over tp, the experts' over tp_ep (every etp slice of every ep rank's
    // experts), then both over pp.
    if (tp.Size() > 1) tp.AllReduce(total, ReduceOp::kSum);
    if (tp_ep != nullptr && tp_ep->Size() > 1) tp_ep->AllReduce(experts, ReduceOp::kSum);
    k.Axpy(1.0, experts, total);
    if (pp != nullptr && pp->Size() > 1) pp->AllReduce(total, ReduceOp::kSum);
    // FSDP2: each rank holds its rows of every parameter.
    Communicator* rows = groups_.fully_shard;
    if (rows != nullptr && rows->Size() > 1) rows->AllReduce(total, ReduceOp::kSum);
  }
  return std::sqrt(HostValue(k.ToHost(total), 0));
}

Tensor Optimizer::GatherFlat(Kernels& k, size_t b, DType dtype,
                             const std::vector<Tensor>& owned) const {
  const Buffer& buffer = buffers_[b];
  Tensor shard = k.Zeros({buffer.size}, dtype);
  for (size_t i = 0; i < states_.size(); ++i) {
    const State& s = states_[i];
    if (s.buffer != b || s.end == s.begin) continue;
    Tensor place = shard.FlatSlice(s.offset + s.begin - buffer.begin, s.end - s.begin);
    k.Copy(owned[i], place);
  }
  return GatherShard(k, b, shard);
}

Tensor Optimizer::GatherShard(Kernels& k, size_t b, const Tensor& shard) const {
  const Buffer& buffer = buffers_[b];
  if (buffer.shard->Size() == 1) return shard;
  Tensor full = k.Zeros({buffer.padded}, shard.dtype());
  buffer.shard->AllGather(shard, full);
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
  update.param_remainders = precision_.param_remainders;
  // The distributed optimizer's updated shards, in the parameters' storage dtype.
  std::vector<Tensor> param_shards;
  if (distributed() && !states_.empty()) {
    for (const Buffer& b : buffers_) {
      param_shards.push_back(k.Zeros({b.size}, states_.front().param->value.dtype()));
    }
  }
  // Transformer Engine's FusedAdam.step: every float16 tensor read unscaled into a float32
  // one first, the update on those, then each scaled back (_apply_scale); the float32
  // tensors are gone before the parameters are gathered (`del unscaled_lists`).
  const bool adam = update.kind == OptimizerUpdate::Kind::kAdam;
  std::vector<std::array<Tensor, 3>> work(states_.size());  // master, m, v as updated
  for (size_t i = 0; i < states_.size(); ++i) {
    const State& s = states_[i];
    if (s.end == s.begin) continue;
    work[i] = {Unscaled(k, s.master), Unscaled(k, s.m), adam ? Unscaled(k, s.v) : Tensor()};
  }
  for (size_t i = 0; i < states_.size(); ++i) {
    State& s = states_[i];
    Parameter& p = *s.param;
    update.weight_decay = s.weight_decay;
    auto& [master, m, v] = work[i];
    if (distributed()) {
      if (s.end == s.begin) continue;
      Tensor g = StepGradient(s);
      if (clip != 1.0) k.Scale(clip, g);
      Tensor out = param_shards[s.buffer].FlatSlice(s.offset + s.begin - buffers_[s.buffer].begin,
                                                    s.end - s.begin);
      // With remainders the step reads the parameter too: the master's high half.
      if (precision_.param_remainders) {
        k.Copy(Flat(p.value).FlatSlice(s.begin, s.end - s.begin), out);
      }
      k.OptimizerStep(update, g, master, m, v, out);
    } else {
      if (s.numel == 0) continue;  // FSDP2: a rank without rows of this parameter
      Tensor g = StepGradient(s);
      if (clip != 1.0) k.Scale(clip, g);
      // A new tensor, as the model's records of this step may still hold the old one.
      Tensor value = k.Empty(p.value.shape(), p.value.dtype());
      Tensor out = Flat(value);
      k.OptimizerStep(update, g, master, m, v, out);
      p.value = value;
    }
  }
  for (size_t i = 0; i < states_.size(); ++i) {
    State& s = states_[i];
    if (s.end == s.begin) continue;
    ScaleBack(k, work[i][0], s.master);
    ScaleBack(k, work[i][1], s.m);
    if (adam) ScaleBack(k, work[i][2], s.v);
  }
  work.clear();
  if (!distributed() || states_.empty()) return;
  // Every rank's updated shard, in the storage dtype, into every rank's parameters.
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (parameters)");
  for (size_t b = 0; b < buffers_.size(); ++b) {
    const Tensor flat = GatherShard(k, b, param_shards[b]);
    for (State& s : states_) {
      if (s.buffer == b) s.param->value = CopyOfPart(k, flat, s.offset, s.param->value);
    }
  }
}

void Optimizer::GatherGradients(Kernels& k, CommTrace& trace) {
  if (!distributed() && copies_grads_) {
    for (State& s : states_) {
      if (s.step_grad.defined()) s.param->grad = s.step_grad.Reshaped(s.param->value.shape());
    }
    return;
  }
  if (!distributed() || states_.empty()) return;
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (gather gradients for records)");
  for (size_t b = 0; b < buffers_.size(); ++b) {
    const Buffer& buffer = buffers_[b];
    const Tensor& shard = copies_grads_ ? buffer.step_grad : buffer.grad_shard;
    if (!shard.defined()) continue;
    const Tensor flat = GatherShard(k, b, shard);
    for (State& s : states_) {
      if (s.buffer == b) s.param->grad = CopyOfPart(k, flat, s.offset, s.param->grad);
    }
  }
}

void Optimizer::RecordState(Kernels& k, CommTrace& trace, std::vector<TensorRecord>* records) {
  if (states_.empty()) return;
  trace.SetPhase(Phase::kOther);
  trace.SetSite("distributed optimizer (gather state for records)");
  const bool adam = config_.kind == OptimizerConfig::Kind::kAdam;
  using Member = Stored State::*;
  struct Kind {
    const char* suffix;
    Member member;
    DType dtype;
  };
  const std::vector<Kind> kinds =
      adam ? std::vector<Kind>{{".exp_avg", &State::m, precision_.exp_avg},
                               {".exp_avg_sq", &State::v, precision_.exp_avg_sq}}
           : std::vector<Kind>{{".momentum_buffer", &State::m, precision_.exp_avg}};
  for (const auto& [suffix, member, stored_dtype] : kinds) {
    // Each state in its dtype; a float16 one unscaled to float32 (what FusedAdam.state_dict
    // gives: get_unscaled_state).
    const DType dtype = stored_dtype == DType::kFloat16 ? DType::kFloat32 : stored_dtype;
    std::vector<Tensor> owned(states_.size());
    for (size_t i = 0; i < states_.size(); ++i) {
      if (states_[i].end > states_[i].begin) owned[i] = Unscaled(k, states_[i].*member);
    }
    std::vector<Tensor> flat;
    if (distributed()) {
      for (size_t b = 0; b < buffers_.size(); ++b) flat.push_back(GatherFlat(k, b, dtype, owned));
    }
    for (size_t i = 0; i < states_.size(); ++i) {
      const State& s = states_[i];
      const Parameter& p = *s.param;
      Tensor state;
      if (distributed()) {
        state = flat[s.buffer].FlatSlice(s.offset, s.numel).Reshaped(p.value.shape());
      } else {
        state = k.Empty(p.value.shape(), dtype);
        Tensor place = Flat(state);
        if (s.numel > 0) k.Copy(owned[i], place);
        if (groups_.fully_shard != nullptr) {
          state = FullyShard::GatherRows(k, *groups_.fully_shard, state,
                                         LocalShape(p.shard, p.full_shape));
        }
      }
      records->push_back({p.name + suffix, state, p.full_shape, p.shard, false});
    }
  }
}

}  // namespace mpusim
