// Megatron-Core's GPTModel on one rank: embedding, transformer layers, final norm, output
// layer and vocab-parallel cross entropy, forward and backward over micro-batches, with
// tensor, sequence and data parallelism (docs/simulator.md, "The GPT model").
//
// Shape legend (module.h): tokens and labels [s, b] (this dp rank's samples, full sequence);
// the residual stream [s_l*b, h]; logits [s*b, Vp/t].
//
// Data: micro-batch m draws a text of s + 1 tokens per global sample gs from the stream
// "text.mb<m>" (core/init.h TokenAt, index gs * (s + 1) + i); tokens are its first s, labels
// its last s (the next tokens), as Megatron's GPT dataset does. Every rank draws its own
// samples (no broadcast_data: the draw is a pure function of global indices).
// Loss: mean per-token loss over all tokens of all micro-batches and dp ranks, so each
// token's loss gradient is 1 / (M * s * B).
//
// State: parameters live in a ParameterSet; activations live in a per-micro-batch Stash that
// Run creates, hands from forward to backward and frees. Records (tensors for the dump and
// the check) are taken from the last micro-batch.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "core/config.h"
#include "core/model/layer_norm.h"
#include "core/model/linear.h"
#include "core/model/parameter.h"
#include "core/model/record.h"
#include "core/model/transformer_layer.h"
#include "core/rank_context.h"
#include "core/status.h"
#include "core/tensor_parallel/cross_entropy.h"

namespace mpusim {

class GptModel {
 public:
  // Checks the model against the layout (core/gpt_config.h CheckGptLayout); errors name the
  // field. `config.gpt` and `config.run` must be set.
  static StatusOr<std::unique_ptr<GptModel>> Build(const Config& config, const Topology& topology,
                                                   const RankCoordinates& coords);

  // Allocates this rank's parameter shards and fills them from the master values.
  void InitializeParameters(Kernels& k);
  // One step: every micro-batch forward and backward, then the gradient finalisation.
  // Records of the last micro-batch, the parameters, their gradients and the loss are
  // appended to `records` when it is not null.
  void Run(RankContext& ctx, std::vector<TensorRecord>* records);

  double loss() const { return loss_; }  // after Run
  int64_t padded_vocab_size() const { return padded_vocab_; }
  const GptConfig& gpt() const { return gpt_; }
  ParameterSet& parameters() { return params_; }

  // Activations of one micro-batch between its forward and its backward.
  struct Stash {
    Tensor embedding_in;  // [s*b, h] before the sequence split (position embeddings added)
    std::vector<TransformerLayer::Stash> layers;
    Norm::Stash final_norm;
    ColumnParallelLinear::Stash output_layer;
    CrossEntropyStash loss;
  };

 private:
  GptModel() = default;
  // One micro-batch's ids, int64 on the device, made once and read by the kernels there.
  struct Batch {
    Tensor tokens, labels;  // [s, b], index i * b + j
    Tensor positions;       // [s, b]: i
  };
  Batch MakeBatch(Kernels& k, int64_t microbatch) const;
  // Returns the sum of this rank's per-token losses.
  double Forward(const ModuleContext& ctx, const Batch& batch, Stash* stash) const;
  void Backward(const ModuleContext& ctx, const Batch& batch, Stash& stash) const;
  Tensor EmbeddingForward(const ModuleContext& ctx, const Batch& batch, Stash* stash) const;
  void EmbeddingBackward(const ModuleContext& ctx, const Batch& batch, const Tensor& dy) const;

  GptConfig gpt_;
  RunConfig run_;
  StreamShape shape_;
  int64_t d_ = 1;
  int64_t padded_vocab_ = 0;
  bool fuse_wgrad_ = false;
  ParameterSet params_;
  Parameter* word_ = nullptr;
  Parameter* position_ = nullptr;
  std::vector<TransformerLayer> layers_;
  std::optional<Norm> final_norm_;
  std::optional<ColumnParallelLinear> output_layer_;
  double loss_ = 0;
  std::optional<TrackerDraws> tracker_;  // dropout_mode "rng_tracker"
};

}  // namespace mpusim
