// Parameters that know their shard, their master values and how their gradients reduce.
//
// What it is: a model's parameters as one list, each with its full shape, this rank's
// ShardSpec (Megatron's tensor-parallel split and stride), its initialisation (core/init.h:
// layout-invariant master values), its local value in the storage dtype and its main_grad in
// the compute dtype, and the flags the gradient finalisation reads (core/train
// FinalizeModelGrads: the tp all-reduce of replicated parameters of which each rank saw
// only its sequence shard or its heads; the data-parallel all-reduce; embd for a tied
// embedding). What it is not: the finalisation or an optimizer (core/train).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/communicator.h"
#include "core/init.h"
#include "core/kernels.h"
#include "core/model/accumulate_grad.h"
#include "core/sharding.h"

namespace mpusim {

struct Parameter {
  std::string name;  // Megatron's state-dict name
  Shape full_shape;
  ShardSpec shard;   // this rank's piece
  InitSpec init;
  // Gradient all-reduced over tp (core/train FinalizeModelGrads): each tp rank summed only
  // its share, its sequence shard (Megatron's `sequence_parallel` attribute) or its heads (a
  // query/key layer norm).
  bool allreduce_grad_over_tp = false;
  bool embedding_group = false;    // a tied word embedding held by the first and the last
                                   // pipeline stage: gradient all-reduced over embd
  bool shared = false;             // the last stage's copy of it (Megatron's `shared`): left
                                   // out of the gradient norm, which counts the first's
  bool expert = false;             // an expert's weight laid out by the expert groups (expert
                                   // parallelism, or expert_tensor_parallel_size other than
                                   // tp): its gradient reduces over expt_dp (not dp_cp) and
                                   // its square sums over tp_ep (etp x ep) in the norm
  Tensor value;  // local, storage dtype
  Tensor grad;   // local main_grad: float32, or the storage dtype where Megatron keeps the
                 // gradient buffer in it (fp16 by default; OptimizerPrecision)
};

class ParameterSet {
 public:
  // Adds a parameter split over `tp_size` ranks along `tp_dim` (-1: replicated) with
  // Megatron's `stride`; this rank is `tp_rank`. `axis`: the group the split runs over (tp;
  // etp for an expert weight whose expt_tp group is not tp).
  Parameter& Add(std::string name, Shape full_shape, InitSpec init, int tp_dim, int64_t stride,
                 bool allreduce_grad_over_tp, int64_t tp_size, int64_t tp_rank,
                 ShardAxis axis = ShardAxis::kTp);
  // The parameter called `name`; throws std::out_of_range naming it when there is none.
  Parameter& Get(std::string_view name);
  // The parameter called `name`, or nullptr (optional biases).
  Parameter* Find(std::string_view name);
  const std::vector<std::unique_ptr<Parameter>>& all() const { return params_; }
  // The same list as pointers (what the optimizer takes).
  std::vector<Parameter*> pointers() const;

  // Fills every local value with its master values (in `dtype`) and zeroes main_grad (in
  // `grad_dtype`: OptimizerPrecision::main_grad, core/config/optimizer_config.h).
  void Initialize(Kernels& k, uint64_t seed, DType dtype, DType grad_dtype);
  // main_grad = 0 (Megatron's zero_grad_buffer), before a step's first micro-batch.
  void ZeroGrads(Kernels& k);

 private:
  std::vector<std::unique_ptr<Parameter>> params_;
  // Name -> the first parameter of that name: Find in O(log n), not a walk of every
  // parameter (a model of 96 layers x 128 experts has ~37k of them).
  std::map<std::string, Parameter*, std::less<>> by_name_;
};

}  // namespace mpusim
