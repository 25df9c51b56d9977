// How a gradient reaches main_grad, for any parameter type with `value` (storage dtype) and
// `grad` (main_grad, compute dtype) tensors: the layer chain's parameters and the GPT model's.
#pragma once

#include "core/kernels.h"

namespace mpusim {

// main_grad += grad, where `op(g, beta)` computes a gradient into g (beta 0: overwrite;
// beta 1: accumulate). With `fused` (gradient_accumulation_fusion) the op accumulates into
// main_grad directly; otherwise it writes a gradient in the parameter's storage dtype that
// is then added to main_grad, as Megatron does without the fusion.
template <typename Param, typename Op>
void AccumulateGrad(Kernels& k, Param& p, bool fused, Op op) {
  if (fused) {
    op(p.grad, 1.0);
    return;
  }
  Tensor grad = k.Empty(p.value.shape(), p.value.dtype());
  op(grad, 0.0);
  k.Axpy(1.0, grad, p.grad);
}

}  // namespace mpusim
