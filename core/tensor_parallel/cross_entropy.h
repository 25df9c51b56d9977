// Megatron's vocab_parallel_cross_entropy (tensor_parallel/cross_entropy.py), forward and
// backward, on logits whose vocabulary columns are split over the tensor-parallel group.
//
// Shape legend: logits [rows, Vp/t] (rows = tokens), labels [rows] global vocabulary ids
// (int64, on the device; any shape with rows elements, e.g. [s, b]).
// Forward: a numerically stable softmax over the whole vocabulary: the row max, the sums of
// exp(z - max), of the label's shifted logit and (with label smoothing) of all shifted logits,
// each all-reduced over `tp`. With ls = label_smoothing and sm = ls * Vp / (Vp - 1):
//     loss = (1 - sm) * (log sum exp z - z_label) + sm * (log sum exp z - mean_j z_j)
// which is Megatron's (1 - sm) * nll - sm * mean_j log p_j. Statistics and losses are in the
// compute dtype of the logits (Megatron runs the loss on logits.float()).
// Backward: grad = dloss * (softmax - q), q = 1 - ls at the label and ls / (Vp - 1) elsewhere;
// no collective.
#pragma once

#include <cstdint>

#include "core/communicator.h"
#include "core/kernels.h"

namespace mpusim {

// What the backward needs from the forward.
struct CrossEntropyStash {
  Tensor logits;   // [rows, Vp/t]
  Tensor row_max;  // [rows] compute dtype, all-reduced
  Tensor sum_exp;  // [rows] compute dtype, all-reduced
};

// Per-token losses [rows] (compute dtype, on the device). `padded_vocab` is the full Vp.
Tensor VocabParallelCrossEntropyForward(Kernels& k, Communicator& tp, const Tensor& logits,
                                        const Tensor& labels, int64_t padded_vocab,
                                        double label_smoothing, CrossEntropyStash* stash);

// torch's cross_entropy (nn.CrossEntropyLoss, reduction "none") on logits [rows, V] whose
// whole vocabulary this rank holds: the same arithmetic, no collective. Its backward is
// VocabParallelCrossEntropyBackward with padded_vocab V, no smoothing and tp_rank 0.
Tensor CrossEntropyForward(Kernels& k, const Tensor& logits, const Tensor& labels,
                           CrossEntropyStash* stash);

// d loss / d logits [rows, Vp/t] in the logits' dtype; dloss [rows] holds d total / d
// per-token loss. `tp_rank` places the local vocabulary columns.
Tensor VocabParallelCrossEntropyBackward(Kernels& k, const CrossEntropyStash& stash,
                                         const Tensor& labels, int64_t padded_vocab,
                                         double label_smoothing, int64_t tp_rank,
                                         const Tensor& dloss);

}  // namespace mpusim
