// Tensor-parallel embeddings (see embedding.h).
#include "core/model/embedding.h"

#include "core/tensor_parallel/mappings.h"
#include "core/tensor_parallel/tp_utils.h"

namespace mpusim {

Tensor VocabParallelEmbedding::Forward(const ModuleContext& ctx, const Tensor& tokens) const {
  Kernels& k = ctx.k;
  const Tensor& w = weight_->value;
  const auto [first, last] = VocabRangeFromPerPartitionVocabSize(w.rows(), ctx.shape.tp_rank);
  Tensor partial = k.Empty({tokens.numel(), w.cols()}, w.dtype());
  k.EmbeddingForward(w, tokens, first, last, partial);
  return reduce_scatter_ ? ReduceScatterFirstDim(k, ctx.tp, partial)
                         : MappingForward(k, ctx.tp, Mapping::kReduceFromTp, partial);
}

void VocabParallelEmbedding::Backward(const ModuleContext& ctx, const Tensor& tokens,
                                      const Tensor& dy) const {
  if (!weight_->grad.defined()) return;
  Kernels& k = ctx.k;
  const Tensor full = reduce_scatter_ ? AllGatherFirstDim(k, ctx.tp, dy) : dy;
  const auto [first, last] =
      VocabRangeFromPerPartitionVocabSize(weight_->value.rows(), ctx.shape.tp_rank);
  k.EmbeddingBackward(full, tokens, first, last, weight_->grad);
}

Tensor ParallelEmbedding::Forward(const ModuleContext& ctx, const Tensor& tokens) const {
  Kernels& k = ctx.k;
  const Tensor& w = weight_->value;
  Tensor local = k.Empty({tokens.numel(), w.cols()}, w.dtype());
  k.EmbeddingForward(w, tokens, 0, w.rows(), local);
  return AllGatherLastDim(k, ctx.tp, local);
}

void ParallelEmbedding::Backward(const ModuleContext& ctx, const Tensor& tokens,
                                 const Tensor& dy) const {
  if (!weight_->grad.defined()) return;
  Kernels& k = ctx.k;
  const Tensor local = SplitLastDim(k, ctx.tp, dy);
  k.EmbeddingBackward(local, tokens, 0, weight_->value.rows(), weight_->grad);
}

}  // namespace mpusim
