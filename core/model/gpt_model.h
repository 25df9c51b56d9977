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
// Chunks: a rank holds one or more model chunks (Megatron's virtual pipeline stages), each a
// run of consecutive decoder layers; the first chunk of the model also holds the embedding
// (pre_process), the last the final norm, output layer and loss (post_process). By default
// a rank holds the chunks the planner assigns it (core/schedule.h AssignLayers); with
// pipeline_model_parallel_size 1 that is one chunk holding everything.
//
// State: parameters live in a ParameterSet; activations live in a Stash per (chunk,
// micro-batch) that ForwardStep creates and BackwardStep consumes and frees, so steps of
// different micro-batches and chunks may interleave in any order a schedule gives. Records
// (tensors for the dump and the check) are taken from the last micro-batch.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/model/layer_norm.h"
#include "core/model/linear.h"
#include "core/model/model.h"
#include "core/model/parameter.h"
#include "core/model/record.h"
#include "core/model/step_span.h"
#include "core/model/transformer_layer.h"
#include "core/pipeline/pipeline_plan.h"
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

class GptModel final : public Model {
 public:
  // Checks the model against the layout (core/gpt_config.h CheckGptLayout); errors name the
  // field. `config.gpt` and `config.run` must be set. `chunks` overrides the planner's
  // assignment for this rank (tests split a one-rank model into chunks); it must cover the
  // model's layers in order, the first chunk pre_process and the last post_process.
  static StatusOr<std::unique_ptr<GptModel>> Build(
      const Config& config, const Topology& topology, const RankCoordinates& coords,
      std::optional<std::vector<GptChunk>> chunks = std::nullopt);

  // Allocates this rank's parameter shards and fills them from the master values.
  void InitializeParameters(Kernels& k);
  void InitializeParameters(RankContext& ctx) override { InitializeParameters(*ctx.kernels); }
  // One step on a rank that holds the whole model: every micro-batch forward through the
  // chunks and backward through them in reverse, then the gradient finalisation. Records
  // of the last micro-batch, the parameters, their gradients and the loss are appended to
  // `records` when it is not null.
  // `iteration` picks the data and dropout streams (training iteration k reads micro-batches
  // k*M .. k*M + M - 1). The parameters are not recorded: RecordParameters appends them (and
  // their gradients), after an optimizer step when there is one. With the distributed
  // optimizer (optimizer.use_distributed_optimizer) the gradients are left unreduced over dp:
  // Optimizer::ReduceGradients reduce-scatters them.
  void Run(RankContext& ctx, std::vector<TensorRecord>* records, int64_t iteration = 0);
  void RecordParameters(std::vector<TensorRecord>* records) const;

  // The Model interface (model.h). Step runs Run and keeps the records it is asked for;
  // Records appends them and then RecordParameters'.
  void Step(RankContext& ctx, int64_t iteration, bool record) override;
  void Records(RankContext& ctx, std::vector<TensorRecord>* records) const override;
  std::vector<Parameter*> TrainableParameters() const override { return params_.pointers(); }
  bool has_loss() const override { return true; }
  std::string Describe() const override;
  std::vector<ParameterPlacement> ShardingMap() const override;
  std::string ParameterSplitNote() const override;
  void Explain(std::ostream& out) const override;
  std::vector<std::string> Warnings() const override { return {}; }
  bool MasksDependOnLayout() const override;
  MemoryPlan PlanMemory(const MemoryPlanOptions& options) const override;

  // The step pieces a pipeline schedule calls. BeginStep zeroes the gradients and the loss.
  // ForwardStep runs chunk `chunk` on micro-batch m: `input` is the previous chunk's output
  // stream [s_l*b, h] (ignored by a pre_process chunk); it returns this chunk's output
  // stream, or an undefined tensor for a post_process chunk (whose per-token losses are
  // summed into the step's loss). BackwardStep takes the gradient of that output (ignored
  // by a post_process chunk), frees the stash, and returns the gradient of `input`
  // (undefined for a pre_process chunk). `records` is passed for the last micro-batch.
  void BeginStep(Kernels& k);
  Tensor ForwardStep(RankContext& ctx, int64_t chunk, int64_t microbatch, const Tensor& input,
                     std::vector<TensorRecord>* records);
  Tensor BackwardStep(RankContext& ctx, int64_t chunk, int64_t microbatch,
                      const Tensor& output_grad, std::vector<TensorRecord>* records);

  // Where a step's time went (core/model/step_span.h): the span of every forward and backward
  // step in the order they ran, and of the whole schedule (BeginStep to the last send's
  // completion, before the gradient finalisation).
  using StepSpan = ::mpusim::StepSpan;
  const std::vector<StepSpan>& step_spans() const override { return spans_; }  // since BeginStep
  double schedule_begin() const { return schedule_begin_; }
  double schedule_end() const override { return schedule_end_; }

  const std::vector<GptChunk>& chunks() const { return chunks_; }
  int64_t live_stashes() const { return static_cast<int64_t>(stashes_.size()); }
  int64_t peak_live_stashes() const override { return peak_stashes_; }  // since BeginStep
  double loss() const override { return loss_; }  // after Run
  int64_t padded_vocab_size() const override { return padded_vocab_; }
  const GptConfig& gpt() const { return gpt_; }
  ParameterSet& parameters() { return params_; }

 private:
  GptModel() = default;
  // One micro-batch's ids, int64 on the device, made once and read by the kernels there.
  struct Batch {
    Tensor tokens, labels;  // [s, b], index i * b + j
    Tensor positions;       // [s, b]: i
  };
  // Activations of one (chunk, micro-batch) between its forward and its backward.
  struct Stash {
    Batch batch;          // pre_process or post_process chunks
    Tensor embedding_in;  // [s*b, h] before the sequence split (position embeddings added)
    std::vector<TransformerLayer::Stash> layers;
    Norm::Stash final_norm;
    ColumnParallelLinear::Stash output_layer;
    CrossEntropyStash loss;
    TrackerDraws::Count draws;  // rng_tracker: the forward step's first draws
  };
  Batch MakeBatch(Kernels& k, int64_t microbatch) const;
  // Walks this rank's row of the pipeline plan (pp > 1): receives, steps, posted sends.
  void RunSchedule(RankContext& ctx, std::vector<TensorRecord>* records);
  ModuleContext Context(RankContext& ctx, int64_t microbatch, const Stash& stash,
                        std::vector<TensorRecord>* records) const;
  Tensor EmbeddingForward(const ModuleContext& ctx, const Batch& batch, Stash* stash) const;
  void EmbeddingBackward(const ModuleContext& ctx, const Batch& batch, const Tensor& dy) const;
  // The head of a post_process chunk: final norm, output layer, cross entropy. Returns the
  // sum of this rank's per-token losses.
  double HeadForward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  Tensor HeadBackward(const ModuleContext& ctx, Stash& stash) const;

  // This rank's account of one pipeline stage for Explain (the whole model when pp = 1).
  void ExplainStage(std::ostream& out) const;

  Config config_;  // as built (ShardingMap and Explain build the other stages from it)
  const Topology* topology_ = nullptr;
  RankCoordinates coords_;
  GptConfig gpt_;
  RunConfig run_;
  StreamShape shape_;
  int64_t d_ = 1;
  int64_t padded_vocab_ = 0;
  bool fuse_wgrad_ = false;
  bool dp_reduces_grads_ = true;  // false: the distributed optimizer reduce-scatters them
  ParameterSet params_;
  Parameter* word_ = nullptr;
  Parameter* position_ = nullptr;
  std::vector<GptChunk> chunks_;
  RankPipelinePlans plans_;                     // this rank's pipeline plans; empty when pp = 1
  std::map<int64_t, TransformerLayer> layers_;  // by global layer number
  std::optional<Norm> final_norm_;
  std::optional<ColumnParallelLinear> output_layer_;
  std::map<std::pair<int64_t, int64_t>, Stash> stashes_;  // by (chunk, micro-batch)
  int64_t peak_stashes_ = 0;
  std::vector<StepSpan> spans_;
  double schedule_begin_ = 0, schedule_end_ = 0;
  double loss_sum_ = 0;  // this step's per-token losses on this rank
  int64_t iteration_ = 0;  // the training iteration being run (data and dropout streams)
  double loss_ = 0;
  std::vector<TensorRecord> recorded_;  // Step's records (record = true)
  std::optional<TrackerDraws> tracker_;  // dropout_mode "rng_tracker"
  TrackerDraws::Count tracker_next_;     // its state: the next draw on each stream
};

}  // namespace mpusim
