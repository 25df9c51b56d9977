// Megatron-Core's GPTModel on one rank: embedding, transformer layers, final norm, output
// layer and vocab-parallel cross entropy, forward and backward over micro-batches, with
// tensor, sequence, context and data parallelism (docs/simulator.md, "The GPT model").
//
// Shape legend (module.h): tokens and labels [s_cp, b] (this dp rank's samples, this cp rank's
// positions: the whole sequence when cp = 1); the residual stream [s_l*b, h]; logits
// [s_cp*b, Vp/t].
//
// Data: micro-batch m draws a text of s + 1 tokens per global sample gs from the stream
// "text.mb<m>" (core/init.h TokenAt, index gs * (s + 1) + i); tokens are its first s, labels
// its last s (the next tokens), as Megatron's GPT dataset does. Every rank draws its own
// samples (no broadcast_data: the draw is a pure function of global indices).
// Context parallelism: cp rank r takes the tokens, labels and position ids of chunks r and
// 2 cp - 1 - r of the sequence cut into 2 cp (Megatron's get_batch_on_this_cp_rank); RoPE
// turns each token by its global position and attention gathers the keys (attention.h).
// Loss: mean per-token loss over all tokens of all micro-batches and dp and cp ranks, so each
// token's loss gradient is 1 / (M * s * B).
//
// Chunks: a rank holds one or more model chunks (Megatron's virtual pipeline stages), each a
// run of consecutive decoder layers; the first chunk of the model also holds the embedding
// (pre_process), the last the final norm, output layer and loss (post_process). By default
// a rank holds the chunks the planner assigns it (core/pipeline_split.h AssignLayers, even or
// uneven; a chunk may hold no layer); with pipeline_model_parallel_size 1 that is one chunk
// holding everything.
//
// State: parameters live in a ParameterSet; activations live in a Stash per (chunk,
// micro-batch) that the executor (core/pipeline/executor.h) creates for ForwardStep, hands
// to BackwardStep and frees, so steps of different micro-batches and chunks may interleave
// in any order a schedule gives. Records (tensors for the dump and the check) are taken
// from the last micro-batch.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "core/config/config.h"
#include "core/model/embedding.h"
#include "core/model/layer_norm.h"
#include "core/model/linear.h"
#include "core/model/model.h"
#include "core/model/parameter.h"
#include "core/model/record.h"
#include "core/model/stash_plan.h"
#include "core/model/transformer_layer.h"
#include "core/pipeline/step_span.h"
#include "core/rank_context.h"
#include "core/status.h"
#include "core/tensor_parallel/cross_entropy.h"

namespace mpusim {

// One model chunk on this rank.
struct GptChunk {
  std::vector<int64_t> layers;  // 0-based global layer numbers, consecutive, possibly none
  bool pre_process = false;     // holds the embedding (the model's first chunk)
  bool post_process = false;    // holds final norm, output layer and loss (the last chunk)
};

// A GPT parameter on a rank: its declaration (GptParameters), its expert (expert layers),
// and whether it is a word-embedding copy synchronised over embd.
struct HeldGptParameter {
  GptParameter declared;
  std::optional<int64_t> expert;
  bool embedding_group = false;
};
// The parameters a rank holds, in state-dict order: those of the decoder layers `held`
// (0-based), the embedding when `pre`, the final norm, the multi-token prediction depths and the
// output layer when `post`, its ep rank's experts only. With tied weights, or with multi-token
// prediction (whose depths embed the shifted ids), the last stage holds its own copy of the
// word embeddings (Megatron's shared_embedding on the last stage): the same master values, its
// gradient all-reduced with the first stage's over embd (finalize_model_grads'
// _allreduce_word_embedding_grads). GptModel::Build adds them; the estimate counts them where
// the executor does not build the model.
std::vector<HeldGptParameter> HeldGptParameters(const GptConfig& gpt, const DerivedSizes& sizes,
                                                const RankCoordinates& coords,
                                                const std::set<int64_t>& held, bool pre, bool post,
                                                int64_t padded_vocab, bool sequence_parallel);

class GptModel final : public Model {
 public:
  // Checks the model against the layout (core/config/gpt_config.h CheckGptLayout); errors name the
  // field. `config.gpt` and `config.run` must be set. `chunks` overrides the planner's
  // assignment for this rank (tests split a one-rank model into chunks); it must cover the
  // model's layers in order, the first chunk pre_process and the last post_process.
  static StatusOr<std::unique_ptr<GptModel>> Build(
      const Config& config, const Topology& topology, const RankCoordinates& coords,
      std::optional<std::vector<GptChunk>> chunks = std::nullopt);

  // Allocates this rank's parameter shards and fills them from the master values.
  void InitializeParameters(Kernels& k);
  // With optimizer.use_torch_fsdp2 the parameters are then sharded (fully_shard).
  void InitializeParameters(RankContext& ctx) override;
  // The parameters and their gradients, appended to `records` (Records does it after the
  // activations).
  void RecordParameters(std::vector<TensorRecord>* records) const;

  // The Model interface (model.h). BeginStep zeroes the gradients and the loss and sets the
  // iteration's data and dropout streams (training iteration k reads micro-batches k*M ..
  // k*M + M - 1). ForwardStep runs chunk `call.chunk` on micro-batch `call.microbatch`:
  // `input` is the previous chunk's output stream [s_l*b, h] (ignored by a pre_process
  // chunk); it returns this chunk's output stream, or an undefined tensor for a post_process
  // chunk (whose per-token losses are summed into the step's loss). BackwardStep takes the
  // gradient of that output (ignored by a post_process chunk) and returns the gradient of
  // `input` (undefined for a pre_process chunk). Every transfer is the residual stream
  // [s_l*b, h] or its gradient. EndStep checks that the RNG tracker advanced by one
  // iteration's draws and reduces the loss over pp and dp. Records appends the last
  // micro-batch's tensors, tokens, labels and loss, then RecordParameters'.
  void BeginStep(RankContext& ctx, int64_t iteration, bool record) override;
  void EndStep(RankContext& ctx) override;
  int64_t num_model_chunks() const override { return static_cast<int64_t>(chunks_.size()); }
  std::pair<Shape, DType> TransferShape(const RankContext& ctx,
                                        const Transfer& transfer) const override;
  std::unique_ptr<StepStash> NewStash(int64_t chunk) const override;
  Tensor ForwardStep(const StepCall& call, const Tensor& input, StepStash& stash) override;
  Tensor BackwardStep(const StepCall& call, const Tensor& output_grad, StepStash& stash) override;
  void Records(RankContext& ctx, std::vector<TensorRecord>* records) const override;
  std::vector<Parameter*> TrainableParameters() const override { return params_.pointers(); }
  std::vector<const Parameter*> HeldParameters() const override;
  FullyShard* fully_shard() const override { return fsdp_.get(); }
  std::vector<FullyShardUnitPlan> FullyShardUnits() const override;
  std::vector<HeldParameterShape> HeldParameterShapes() const override;
  bool has_loss() const override { return true; }
  std::string Describe() const override;
  std::vector<ParameterPlacement> ShardingMap() const override;
  std::string ParameterSplitNote() const override;
  void Explain(std::ostream& out) const override;
  // Full recomputation by "block" with multi-token prediction: its depths are not recomputed.
  std::vector<std::string> Warnings() const override;
  bool MasksDependOnLayout() const override;
  MemoryPlan PlanMemory(const MemoryPlanOptions& options) const override;
  // PlanMemory's optimizer items (gpt_model_plan.cc).
  void PlanOptimizerMemory(const OptimizerConfig& optimizer, double schedule_peak,
                           MemoryPlan* plan) const;
  std::vector<std::string> StepNotes() const override;
  // The MoE routers' expert biases (moe_router_enable_expert_bias): the step's token counts
  // summed over tp x dp x cp, then each layer's update (MoeLayer::UpdateExpertBias).
  void AfterOptimizerStep(RankContext& ctx) override;
  std::vector<ExpertLoad> ExpertLoads() const override;

  // The declared stash (stash_plan.h) of one (chunk, micro-batch) on a rank of `shape`, in
  // `dtype` storage: `layers[i]` is the declared stash of chunk.layers[i]
  // (TransformerLayer::PlanStash), `mtp_layer` (a post_process chunk with multi-token
  // prediction: required unless `mtp_checkpointed`) the declared stash of each depth's
  // transformer layer, kept whole but for what selective recomputation drops;
  // `mtp_checkpointed` (full recomputation by "uniform"): each depth keeps its checkpoint's
  // inputs alone (RunConfig::CheckpointsMtpDepths). A count of the executor's activations sums it
  // (core/estimate/executor_activations.h).
  static StashPlan PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                             const GptChunk& chunk, const std::vector<StashPlan>& layers,
                             const StashPlan* mtp_layer = nullptr, bool mtp_checkpointed = false);

  const std::vector<GptChunk>& chunks() const { return chunks_; }
  double loss() const override { return loss_; }  // after EndStep
  int64_t padded_vocab_size() const override { return padded_vocab_; }
  const GptConfig& gpt() const { return gpt_; }
  ParameterSet& parameters() { return params_; }

 private:
  GptModel() = default;
  // One micro-batch's ids, int64 on the device, made once and read by the kernels there.
  struct Batch {
    Tensor tokens, labels;  // [s_cp, b], index l * b + j, at positions Position(l)
    Tensor positions;       // [s_cp, b]: Position(l)
  };
  // One multi-token prediction depth k of a post_process chunk (MultiTokenPredictionLayer):
  // the ids and labels rolled k + 1 places, its modules' stashes, its logits' loss.
  struct MtpStash {
    Batch batch;                          // tokens, labels rolled (zeros shifted in at the end)
    Tensor loss_mask;                     // host float32 [s_l, b]: 1 where a label is left
    // Full recomputation ("uniform"): the checkpoint's inputs, the embedding after its dropout
    // and the previous depth's hidden state (the rest is rebuilt in the backward).
    Tensor checkpointed_e, checkpointed_h;
    Norm::Stash enorm;                    // input: the shifted tokens' embedding [s_l*b, h]
    Norm::Stash hnorm;                    // input: the previous depth's hidden state [s_l*b, h]
    ColumnParallelLinear::Stash eh_proj;  // input: [enorm, hnorm] concatenated [s_l*b, 2h]
    TransformerLayer::Stash layer;
    Norm::Stash final_norm;
    ColumnParallelLinear::Stash output_layer;  // input: the depth's hidden state [s_l*b, h]
    CrossEntropyStash loss;
  };
  // Activations of one (chunk, micro-batch) between its forward and its backward.
  struct Stash : StepStash {
    Batch batch;          // pre_process or post_process chunks
    Tensor embedding_in;  // [s_l*b, h] before the dropout (the output itself without one)
    std::vector<TransformerLayer::Stash> layers;
    Norm::Stash final_norm;
    ColumnParallelLinear::Stash output_layer;
    CrossEntropyStash loss;
    std::vector<MtpStash> mtp;  // a post_process chunk's multi-token prediction depths
    TrackerDraws::Count draws;  // rng_tracker: the forward step's first draws
  };
  // Micro-batch `microbatch`'s ids, labels and positions on this rank (each data-parallel
  // rank's samples, each cp rank's positions), drawn per global position (multi-token
  // prediction's depths roll them over the cp ranks: MtpForward).
  Batch MakeBatch(Kernels& k, int64_t microbatch) const;
  // The RNG tracker's next draws at the start of `iteration` (every earlier iteration ran M
  // forward steps of every chunk).
  TrackerDraws::Count TrackerAtIteration(int64_t iteration) const;
  ModuleContext Context(RankContext& ctx, int64_t microbatch, const Stash& stash,
                        std::vector<TensorRecord>* records) const;
  Tensor EmbeddingForward(const ModuleContext& ctx, const Batch& batch, Stash* stash) const;
  void EmbeddingBackward(const ModuleContext& ctx, const Batch& batch, const Tensor& dy) const;
  VocabParallelEmbedding WordEmbeddings() const;
  // The head of a post_process chunk: final norm, output layer, cross entropy. Returns the
  // sum of this rank's per-token losses.
  double HeadForward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  Tensor HeadBackward(const ModuleContext& ctx, Stash& stash) const;
  // Multi-token prediction (MultiTokenPredictionBlock and process_mtp_loss) after the final
  // norm, from its output `hidden` [s_l*b, h]; the backward returns the gradient of `hidden`
  // through the depths (to be added to the main head's).
  void MtpForward(const ModuleContext& ctx, const Tensor& hidden, Stash* stash) const;
  // Depth d's projection, layer and final norm from its embedding `e` and the previous hidden
  // state (what full recomputation "uniform" checkpoints); fills st, returns h_d.
  Tensor MtpDepthForward(const ModuleContext& ctx, size_t d, const Tensor& e, const Tensor& prev,
                         MtpStash* st) const;

  Tensor MtpBackward(const ModuleContext& ctx, Stash& stash) const;

  // This rank's account of one pipeline stage for Explain (the whole model when pp = 1).
  void ExplainStage(std::ostream& out) const;

  // This rank's MoE layers: the decoder's held ones, then the multi-token prediction depths'
  // (each built like the last decoder layer, with a router, experts and expert bias of its
  // own). `number`: the decoder layer from 0, depth k as num_layers + k (the number
  // Megatron's router logs it under); `name`: the layer's module, "decoder.layers.<i>" or
  // "mtp.layers.<k>.transformer_layer".
  struct HeldMoe {
    int64_t number;
    std::string name;
    const MoeLayer* moe;
  };
  std::vector<HeldMoe> MoeLayers() const;

  Config config_;  // as built (ShardingMap and Explain build the other stages from it)
  const Topology* topology_ = nullptr;
  RankCoordinates coords_;
  GptConfig gpt_;
  RunConfig run_;
  StreamShape shape_;
  int64_t d_ = 1;
  int64_t padded_vocab_ = 0;
  bool fuse_wgrad_ = false;
  ParameterSet params_;
  Tensor positions_;      // int64 [s_cp] on the device: this rank's token positions
  Tensor key_positions_;  // int64 [s]: 0, 1, ..., s - 1 (ModuleContext::key_positions)
  Parameter* word_ = nullptr;
  Parameter* position_ = nullptr;
  std::vector<GptChunk> chunks_;
  std::map<int64_t, TransformerLayer> layers_;  // by global layer number
  std::optional<Norm> final_norm_;
  std::optional<ColumnParallelLinear> output_layer_;
  // Multi-token prediction's depths (on a post_process chunk): enorm, hnorm, eh_proj (column
  // parallel, no bias), the transformer layer, final_layernorm.
  struct MtpDepth {
    Norm enorm, hnorm;
    ColumnParallelLinear eh_proj;
    TransformerLayer layer;
    Norm final_norm;
  };
  std::vector<MtpDepth> mtp_;
  // optimizer.use_torch_fsdp2: Megatron's fully_shard units (TorchFullyShardedDataParallel
  // with Transformer Engine's layers): the embedding, each decoder layer, the output layer,
  // and the root (the final layernorm); indices into fsdp_->units().
  std::unique_ptr<FullyShard> fsdp_;
  size_t fsdp_embedding_ = 0, fsdp_output_ = 0, fsdp_root_ = 0;
  std::map<int64_t, size_t> fsdp_layer_;  // by global layer number
  // The FSDP2 hooks around a unit (nothing without FSDP2).
  void UnitPreForward(const ModuleContext& ctx, size_t unit) const;
  void UnitPostForward(size_t unit, bool recomputing = false) const;
  void UnitPreBackward(const ModuleContext& ctx, size_t unit) const;
  void UnitPostBackward(const ModuleContext& ctx, size_t unit) const;
  double loss_sum_ = 0;  // this step's per-token losses on this rank
  int64_t iteration_ = 0;  // the training iteration being run (data and dropout streams)
  double loss_ = 0;
  bool record_ = false;                  // this step records (BeginStep)
  mutable std::vector<Tensor> expert_bias_records_;  // Records' copies of the expert biases
  std::vector<TensorRecord> recorded_;  // the last micro-batch's records of this step
  std::optional<TrackerDraws> tracker_;  // dropout_mode "rng_tracker"
  TrackerDraws::Count tracker_next_;     // its state: the next draw on each stream
};

}  // namespace mpusim
