// Vocab-parallel cross entropy (see cross_entropy.h).
#include "core/tensor_parallel/cross_entropy.h"

#include <cmath>

namespace mpusim {
namespace {

// The vocabulary split over `tp`, or whole on this rank when it is null.
Tensor CrossEntropyOver(Kernels& k, Communicator* tp, const Tensor& logits, const Tensor& labels,
                        int64_t padded_vocab, double label_smoothing, CrossEntropyStash* stash) {
  const int64_t rows = logits.rows();
  const int64_t start = tp != nullptr ? tp->Rank() * logits.cols() : 0;
  const bool split = tp != nullptr && tp->Size() > 1;
  const DType stats = ComputeDType(logits.dtype());
  stash->logits = logits;
  stash->row_max = k.Zeros({rows}, stats);
  k.RowMax(logits, stash->row_max);
  if (split) tp->AllReduce(stash->row_max, ReduceOp::kMax);
  stash->sum_exp = k.Zeros({rows}, stats);
  Tensor sum_z = k.Zeros({rows}, stats);
  Tensor target_z = k.Zeros({rows}, stats);
  k.CrossEntropyPartials(logits, stash->row_max, labels, start, stash->sum_exp, sum_z, target_z);
  if (split) {
    tp->AllReduce(target_z, ReduceOp::kSum);
    tp->AllReduce(stash->sum_exp, ReduceOp::kSum);
    if (label_smoothing > 0) tp->AllReduce(sum_z, ReduceOp::kSum);
  }
  const Tensor h_sum_exp = k.ToHost(stash->sum_exp);
  const Tensor h_sum_z = k.ToHost(sum_z);
  const Tensor h_target = k.ToHost(target_z);
  const double vp = static_cast<double>(padded_vocab);
  const double sm = label_smoothing > 0 ? label_smoothing * vp / (vp - 1) : 0.0;
  Tensor losses = Tensor::HostZeros({rows}, stats);
  for (int64_t i = 0; i < rows; ++i) {
    const double log_z = std::log(HostValue(h_sum_exp, i));
    const double loss = (1 - sm) * (log_z - HostValue(h_target, i)) +
                        sm * (log_z - HostValue(h_sum_z, i) / vp);
    SetHostValue(losses, i, loss);
  }
  return k.ToDevice(losses);
}

}  // namespace

Tensor VocabParallelCrossEntropyForward(Kernels& k, Communicator& tp, const Tensor& logits,
                                        const Tensor& labels, int64_t padded_vocab,
                                        double label_smoothing, CrossEntropyStash* stash) {
  return CrossEntropyOver(k, &tp, logits, labels, padded_vocab, label_smoothing, stash);
}

Tensor CrossEntropyForward(Kernels& k, const Tensor& logits, const Tensor& labels,
                           CrossEntropyStash* stash) {
  return CrossEntropyOver(k, nullptr, logits, labels, logits.cols(), 0.0, stash);
}

Tensor VocabParallelCrossEntropyBackward(Kernels& k, const CrossEntropyStash& stash,
                                         const Tensor& labels, int64_t padded_vocab,
                                         double label_smoothing, int64_t tp_rank,
                                         const Tensor& dloss) {
  const Tensor& logits = stash.logits;
  const double vp = static_cast<double>(padded_vocab);
  const double alpha = label_smoothing;
  Tensor grad = k.Empty(logits.shape(), logits.dtype());
  k.CrossEntropyBackward(logits, stash.row_max, stash.sum_exp, labels, tp_rank * logits.cols(),
                         1.0 - alpha, alpha > 0 ? alpha / (vp - 1) : 0.0,
                         dloss.Reshaped({logits.rows()}), grad);
  return grad;
}

}  // namespace mpusim
