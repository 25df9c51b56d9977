// A module's declared stash: the tensors its Stash struct holds from its forward to its
// backward, field by field, each with this rank's shape as a function of the layout and the
// model's dims. Every module of the GPT declares its own next to its Stash struct (a static
// PlanStash: layer_norm.h, attention.h, mlp.h, moe.h, transformer_layer.h, gpt_model.h), and
// whoever counts activations sums the declaration instead of keeping a mirror of the structs:
// core/model/activation_plan.h walks a rank's schedule over them, for the executor's
// activation count (core/estimate/executor_activations.h, `mpusim estimate`) and the run's
// memory preflight (GptModel::PlanMemory, run/preflight.h).
// tests/model/stash_plan_mpi_test.cc holds the declaration to what a real forward leaves
// allocated.
//
// A tensor is declared once, by the field that keeps it first in the forward's order; a field
// that keeps a tensor made elsewhere (a linear layer's input is its caller's output, a norm's
// input the stream it normalises) is named in a comment of the declaration, not counted twice.
// Extents are doubles: where the router decides a tensor's rows (an MoE layer's experts) the
// caller passes their expectation, and the count keeps its fraction until it is rounded.
//
// What it is not: a memory plan of the whole step (the backward's working set, the pipeline's
// transfers and the optimizer's buffers are counted by core/estimate), nor an allocator.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace mpusim {

struct StashTensor {
  std::string name;           // the field: "attention.core.probs"
  std::vector<double> shape;  // this rank's
  DType dtype;
  // The extents' product times the dtype's size, multiplied left to right.
  double bytes() const;
};

class StashPlan {
 public:
  void Add(std::string name, std::vector<double> shape, DType dtype) {
    tensors_.push_back({std::move(name), std::move(shape), dtype});
  }
  // Every tensor of `inner` (a sub-module's stash), named "<prefix>.<its name>".
  void Add(const std::string& prefix, const StashPlan& inner);
  // The tensors' bytes, summed in declaration order.
  double bytes() const;
  const std::vector<StashTensor>& tensors() const { return tensors_; }

 private:
  std::vector<StashTensor> tensors_;
};

}  // namespace mpusim
