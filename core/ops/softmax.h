// The causal softmax's pointwise math, each part defined once: the host/device functions that
// the CPU backend's row loop and the CUDA backend's row kernels both call
// (Kernels::CausalSoftmaxForward / CausalSoftmaxFromLse / CausalSoftmaxBackward / LseMerge),
// with the argument rules once in core/kernels.cc. The reductions over a row (its max, its
// sums) stay backend code (Eigen's, a block tree per row on the GPU); the functions get
// their results.
//
// What they are, for a row of scores s over its visible keys V (key position k visible to
// query position q when k <= q, and with a sliding window w >= 0 also q - k <= w: KeyVisible):
//   forward   z = s scale                                      SoftmaxLogit
//             m = max_V z,  sum = sum_V exp(z - m)             (SoftmaxExp's terms)
//             with an attention sink (a logit o of the row's head): m = max(m, o) and
//             sum += exp(o - m), the sink's term in the denominator only
//             p = exp(z - m) / sum  on V, +0 elsewhere         SoftmaxProb
//             lse = m + log(sum)    (-inf for a row that sees no key)   SoftmaxLse
//   from lse  p = exp(z - lse)                                 SoftmaxExp
//   backward  ds = scale (p (dp - dot)),  dot = sum_V p dp     SoftmaxGrad
//             the sink's  do = -exp(o - lse) dot                SinkGradTerm
//   merge     hi = max(l, l'),  n = hi + log(exp(l - hi) + exp(l' - hi)),
//             out = out exp(l - n) + part exp(l' - n)          LseMergeOf, LseMerged
// (the merge of two blocks' attention outputs by their log-sum-exps, context parallelism's
// ring).
//
// Arithmetic is in the compute type C, each formula in the order written above, so that
// the CPU's and the GPU's elements round alike (the .cu is built with --fmad=false). Like
// core/ops/activation.h's functors, the ones with exp take the math M: one element of C
// with ScalarMath, or a row of elements on the CPU (an Eigen array expression, evaluated
// where the backend assigns it).
#pragma once

#include <cstdint>

#include "core/ops/element.h"  // ScalarMath, MPUSIM_HD

namespace mpusim::ops {

// Causal attention: key position k is visible to query position q when k <= q; with a
// sliding window (Megatron's window_size [w, 0], w >= 0) only the w keys before q and q
// itself, q - w <= k <= q. window -1: no window.
MPUSIM_HD inline bool KeyVisible(int64_t k, int64_t q, int64_t window = -1) {
  return k <= q && (window < 0 || q - k <= window);
}

// z = s scale.
template <typename X, typename C>
MPUSIM_HD auto SoftmaxLogit(const X& s, C scale) {
  return s * scale;
}

// exp(z - m): a term of the row's sum (m its max), or a probability from the log-sum-exp
// (m = lse).
template <typename C, typename M = ScalarMath, typename X>
MPUSIM_HD auto SoftmaxExp(const X& z, C m) {
  return M::Exp(z - m);
}

// p = exp(z - m) / sum.
template <typename C, typename M = ScalarMath, typename X>
MPUSIM_HD auto SoftmaxProb(const X& z, C m, C sum) {
  return SoftmaxExp<C, M>(z, m) / sum;
}

// lse = m + log(sum), for a row that sees a key (sum > 0).
template <typename C>
MPUSIM_HD C SoftmaxLse(C m, C sum) {
  return m + ScalarMath::Log(sum);
}

// ds = scale (p (dp - dot)).
template <typename X, typename Y, typename C>
MPUSIM_HD auto SoftmaxGrad(const X& p, const Y& dp, C dot, C scale) {
  return scale * (p * (dp - dot));
}

// A row's share of its head's sink-logit gradient: the sink o is a logit whose probability
// exp(o - lse) is left out of the output, so d o = p_o (0 - dot) = -exp(o - lse) dot, with
// dot = sum_V p dp the softmax backward's row term and lse over the keys and the sink.
template <typename C, typename M = ScalarMath>
MPUSIM_HD C SinkGradTerm(C sink, C lse, C dot) {
  return -(M::Exp(sink - lse) * dot);
}

// The merge of a running row (log-sum-exp l) and a part (l'), both finite: the new
// log-sum-exp n and the weights exp(l - n) of the running row and exp(l' - n) of the part.
template <typename C>
struct LseMergeWeights {
  C lse;
  C keep;
  C take;
};
template <typename C>
MPUSIM_HD LseMergeWeights<C> LseMergeOf(C l, C part_l) {
  const C hi = l < part_l ? part_l : l;  // std::max's choice
  const C n = hi + ScalarMath::Log(ScalarMath::Exp(l - hi) + ScalarMath::Exp(part_l - hi));
  return {n, ScalarMath::Exp(l - n), ScalarMath::Exp(part_l - n)};
}

// out exp(l - n) + part exp(l' - n).
template <typename X, typename Y, typename C>
MPUSIM_HD auto LseMerged(const X& out, const Y& part, const LseMergeWeights<C>& w) {
  return out * w.keep + part * w.take;
}

}  // namespace mpusim::ops
