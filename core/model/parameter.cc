// Parameters (see parameter.h).
#include "core/model/parameter.h"

#include <stdexcept>

#include <fmt/format.h>

namespace mpusim {

Parameter& ParameterSet::Add(std::string name, Shape full_shape, InitSpec init, int tp_dim,
                             int64_t stride, bool allreduce_grad_over_tp, int64_t tp_size,
                             int64_t tp_rank, ShardAxis axis) {
  auto p = std::make_unique<Parameter>();
  p->name = std::move(name);
  p->full_shape = std::move(full_shape);
  p->init = init;
  p->allreduce_grad_over_tp = allreduce_grad_over_tp && tp_size > 1;
  if (tp_dim >= 0) p->shard.Split(axis, tp_dim, tp_size, tp_rank, stride);
  by_name_.try_emplace(p->name, p.get());
  params_.push_back(std::move(p));
  return *params_.back();
}

Parameter* ParameterSet::Find(std::string_view name) {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

Parameter& ParameterSet::Get(std::string_view name) {
  if (Parameter* p = Find(name)) return *p;
  throw std::out_of_range(fmt::format("no parameter named '{}'", name));
}

std::vector<Parameter*> ParameterSet::pointers() const {
  std::vector<Parameter*> out;
  out.reserve(params_.size());
  for (const auto& p : params_) out.push_back(p.get());
  return out;
}

void ParameterSet::Initialize(Kernels& k, uint64_t seed, DType dtype, DType grad_dtype) {
  for (auto& p : params_) {
    const Shape local = LocalShape(p->shard, p->full_shape);
    Tensor host = Tensor::HostEmpty(local, dtype);
    FillShard(seed, p->name, p->init, p->full_shape, p->shard, host);
    p->value = k.ToDevice(host);
    p->grad = k.Zeros(local, grad_dtype);
  }
}

void ParameterSet::ZeroGrads(Kernels& k) {
  for (auto& p : params_) k.SetZero(p->grad);
}

}  // namespace mpusim
