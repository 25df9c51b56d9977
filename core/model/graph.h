// The layer graph: a chain of Megatron tensor-parallel layers, run forward and backward on
// one rank. Its logic lives here once; backends supply only Kernels and Communicators.
//
// What it is: for each layer, *what* to compute and *which collective in which group*, in
// forward and backward (docs/simulator.md is the contract), plus data generation, gradient
// accumulation over micro-batches, activation recomputation, and the pipeline stages (the
// layers in p * v consecutive runs; the executor, core/pipeline/executor.h, walks each rank's
// row of the 1F1B or interleaved schedule with a stash per chunk and micro-batch). The
// gradient reductions (core/train RunStep) follow the parameters' flags: sequence-parallel
// replicated parameters over tp, every one over dp, a weight tied across the first and last
// pipeline rank over embd. Training iterations differ only in their data and random streams;
// the optimizer (core/train) updates TrainableParameters.
// Precision: parameters, activations and activation gradients are stored in run.dtype
// (float64, float32, bfloat16 or float16); main_grad, the softmax statistics and the loss
// are in its compute dtype (float32 for 16-bit storage), as in Megatron's mixed precision.
// What it is not: a checker (run/ compares the results with the float64 reference) or a
// launcher (run/ and cuda/ set up ranks and communicators).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/model/parameter.h"
#include "core/model/record.h"
#include "core/pipeline/step_span.h"
#include "core/rank_context.h"
#include "core/sharding.h"
#include "core/status.h"

namespace mpusim {

// How an activation is laid out across the tp group (docs/simulator.md, "Parallel states").
struct ActivationState {
  enum class Split : uint8_t { kReplicated, kHidden, kSequence, kPartialSum };
  Split split = Split::kReplicated;
  int64_t stride = 1;  // kHidden: the producing layer's stride
};
const char* SplitName(ActivationState::Split split);

class Graph final : public Model {
 public:
  // Checks that the layers fit together (shapes, parallel states, divisibility) for this
  // layout; errors name "model.layers[i]" and say what is allowed. `coords` is the rank the
  // model runs on (its memory plan's); `topology` must outlive the graph.
  static StatusOr<std::unique_ptr<Graph>> Build(const Config& config, const Topology& topology,
                                                const RankCoordinates& coords = {});
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Allocates this rank's parameter shards and fills them from the master values.
  void InitializeParameters(RankContext& ctx) override;
  // The Model interface (model.h) and its steps (core/pipeline/executor.h). BeginStep starts
  // training iteration `iteration`: micro-batch m reads global micro-batch iteration*M + m's
  // data and synthetic tensors, and the RNG tracker starts where `iteration` earlier
  // iterations left it, so a repeated step computes the same; main_grad starts from zero. A
  // step of chunk c runs the layers of its virtual stage c * p + pp_rank (under "full"
  // recomputation, each group of the chunk's layers that run.recompute_method picks keeps
  // only its input and runs its forward again before its backward); the chain keeps the last
  // micro-batch's tensors for Records whatever `record` says. EndStep checks that the
  // tracker advanced by one iteration's draws and sums the loss over the stages.
  void BeginStep(RankContext& ctx, int64_t iteration, bool record) override;
  void EndStep(RankContext& ctx) override;
  int64_t num_model_chunks() const override;
  std::pair<Shape, DType> TransferShape(const RankContext& ctx,
                                        const Transfer& transfer) const override;
  std::unique_ptr<StepStash> NewStash(int64_t chunk) const override;
  Tensor ForwardStep(const StepCall& call, const Tensor& input, StepStash& stash) override;
  Tensor BackwardStep(const StepCall& call, const Tensor& output_grad, StepStash& stash) override;
  void Records(RankContext& ctx, std::vector<TensorRecord>* records) const override;
  // The parameters with a main_grad (not frozen), in registration order: what the gradient
  // finalisation reduces and the optimizer updates.
  std::vector<Parameter*> TrainableParameters() const override;
  std::vector<const Parameter*> HeldParameters() const override;
  FullyShard* fully_shard() const override;
  std::vector<FullyShardUnitPlan> FullyShardUnits() const override;
  std::vector<HeldParameterShape> HeldParameterShapes() const override;

  // After a step: every tensor of the last micro-batch plus parameters and gradients.
  std::vector<TensorRecord> Records(RankContext& ctx) const;
  bool has_loss() const override;
  double loss() const override;  // mean over all tokens of all micro-batches (all dp ranks)

  // The layers as planned, for `mpusim explain`: name, type, input/output states, full
  // parameter shapes and their shard specs on this rank.
  struct PlannedParameter {
    std::string name;
    Shape full_shape;
    Shape local_shape;
    ShardSpec shard;
    int tp_dim = -1;        // the dimension split over tp whatever t is (-1: replicated)
    int64_t tp_stride = 1;  // Megatron's stride of that split
  };
  struct PlannedLayer {
    std::string name;
    std::string type;
    ActivationState input;
    ActivationState output;
    int64_t input_width;   // full hidden width (0 for token input)
    int64_t output_width;  // full hidden width (0 for the loss)
    std::vector<PlannedParameter> parameters;
    // Its pipeline stage: the pp rank and model chunk holding it (docs/simulator.md,
    // "Pipeline stages of a chain").
    int64_t pp_rank = 0;
    int64_t chunk = 0;
    // weight_from: the name of the earlier layer's weight this layer uses (not in
    // `parameters`; on another pp rank it holds a copy, all-reduced over embd). Empty if none.
    std::string tied_weight;
  };
  std::vector<PlannedLayer> Plan(const RankCoordinates& coords) const;
  int64_t padded_vocab_size() const override;

  // The rest of the Model interface (graph_plan.cc), from Plan: the layer table `mpusim run`
  // prints, the sharding map (a weight_from copy on another stage is a row of its own), the
  // lab's notation for `mpusim explain`, and the memory plan of this rank.
  std::string Describe() const override;
  std::vector<ParameterPlacement> ShardingMap() const override;
  std::string ParameterSplitNote() const override { return ""; }
  void Explain(std::ostream& out) const override;
  // Plan-time warnings, one line each ("model.layers[i] (type name): why"): region mappings
  // whose backward sums t copies of a gradient every rank already holds in full, so the
  // gradients before them come out t-fold, as Megatron's own code computes them (the check
  // then fails for those tensors; docs/simulator.md, "Warnings"). Empty at t = 1.
  std::vector<std::string> Warnings() const override;
  bool MasksDependOnLayout() const override;
  MemoryPlan PlanMemory(const MemoryPlanOptions& options) const override;

  struct Impl;

 private:
  explicit Graph(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  Config config_;  // as built
  const Topology* topology_ = nullptr;
  RankCoordinates coords_;
};

}  // namespace mpusim
