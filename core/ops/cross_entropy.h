// The vocab-parallel cross entropy's pointwise math, each part defined once: the host/device
// functions that the CPU backend's row loop and the CUDA backend's kernels both call
// (Kernels::CrossEntropyPartials / CrossEntropyBackward), with the argument rules once in
// core/kernels.cc. The reductions over a row (its max, which the tp group all-reduces, and
// the partial sums) stay backend code; the functions get their results.
//
// What they are (Megatron's _VocabParallelCrossEntropy), for row i of a vocabulary shard's
// logits l [rows, cols] starting at column vocab_start, with m the row's global max:
//   z = l - m                                                  ShiftedLogit
//   sum_exp = sum_j exp(z_j),  sum_z = sum_j z_j               (CrossEntropyExp's terms)
//   target_z = z at the label's local column (LabelColumn), 0 when another shard holds it
//   grad = scale (exp(z) / sum_exp - q),  q = on_value at the label's column, off_value
//          elsewhere (label smoothing)                         CrossEntropyGrad
//
// Arithmetic is in the compute type C, each formula in the order written above, so that
// the CPU's and the GPU's elements round alike (the .cu is built with --fmad=false). The
// functions with exp take the math M, as core/ops/activation.h's do: one element of C with
// ScalarMath, or a row of elements on the CPU (an Eigen array expression).
#pragma once

#include <cstdint>

#include "core/ops/element.h"  // ScalarMath, MPUSIM_HD

namespace mpusim::ops {

// The local column of `label` in a shard of `cols` columns starting at vocab_start, or -1
// when the label is outside the shard.
MPUSIM_HD inline int64_t LabelColumn(int64_t label, int64_t vocab_start, int64_t cols) {
  const int64_t col = label - vocab_start;
  return col >= 0 && col < cols ? col : -1;
}

// z = l - m.
template <typename X, typename C>
MPUSIM_HD auto ShiftedLogit(const X& l, C m) {
  return l - m;
}

// exp(z), a term of sum_exp.
template <typename C, typename M = ScalarMath, typename X>
MPUSIM_HD auto CrossEntropyExp(const X& z) {
  return M::Exp(z);
}

// grad = scale (exp(z) / sum_exp - q).
template <typename C, typename M = ScalarMath, typename X>
MPUSIM_HD auto CrossEntropyGrad(const X& z, C sum_exp, C q, C scale) {
  return scale * (CrossEntropyExp<C, M>(z) / sum_exp - q);
}

}  // namespace mpusim::ops
