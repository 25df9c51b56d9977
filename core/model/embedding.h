// Megatron's tensor-parallel embeddings as modules: the GPT model's word embeddings and the
// layer chain's two embedding layers are built from them.
//
// Shape legend (module.h): tokens [s, b] int64 on the device, R = s * b rows, h the embedding
// width; E_vocab [Vp/t, h] (a contiguous block of the padded vocabulary per rank), E_dim [V, h/t].
//
//   VocabParallelEmbedding  forward  masked lookup in this rank's rows: [R, h] partial sums
//                                    (a token's row lives on exactly one rank, the others
//                                    read zeros) --all-reduce, or reduce-scatter-->  [R or R/t, h]
//                           backward dy --identity, or all-gather--> [R, h];
//                                    dE[token - vocab_start] += dy[row] for this rank's tokens
//   ParallelEmbedding       forward  lookup of this rank's columns [R, h/t] --all-gather last dim-->
//                                    [R, h]
//                           backward dy --split last dim--> [R, h/t]; dE[token] += dy[row]
//
// The reduce-scatter (Megatron's reduce_scatter_embeddings, under sequence parallelism)
// leaves each rank its sequence shard. Embedding gradients are scattered straight into
// main_grad: one rounding fewer than torch's bf16 weight.grad followed by the DDP add. A
// frozen weight (no main_grad) gets no gradient and its backward communicates nothing.
#pragma once

#include "core/model/module.h"
#include "core/model/parameter.h"

namespace mpusim {

class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding(Parameter* weight, bool reduce_scatter)
      : weight_(weight), reduce_scatter_(reduce_scatter) {}
  Tensor Forward(const ModuleContext& ctx, const Tensor& tokens) const;
  void Backward(const ModuleContext& ctx, const Tensor& tokens, const Tensor& dy) const;

 private:
  Parameter* weight_;
  bool reduce_scatter_;
};

class ParallelEmbedding {
 public:
  explicit ParallelEmbedding(Parameter* weight) : weight_(weight) {}
  Tensor Forward(const ModuleContext& ctx, const Tensor& tokens) const;
  void Backward(const ModuleContext& ctx, const Tensor& tokens, const Tensor& dy) const;

 private:
  Parameter* weight_;
};

}  // namespace mpusim
