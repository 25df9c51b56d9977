// The layer chain's internals (graph.h), shared by its files: graph_layers.cc (each kind of
// layer: how it plans and how it runs, from the core/model modules), graph_planner.cc
// (Build: states, shapes, parameters, stages, ties, warnings) and graph.cc (parameters, data,
// the forward and backward steps). Not an interface: nothing outside core/model/graph*.cc
// includes it.
//
// Shape legend (local, on one rank; t = tp size, d = dp size):
//   s, b          sequence length (s/t under sequence parallelism), micro-batch per dp rank
//   x, y          activations [s, b, h] viewed as [s*b, h]
#pragma once

#include <fmt/format.h>

#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/model/graph.h"
#include "core/model/module.h"
#include "core/model/parameter.h"
#include "core/pipeline/executor.h"
#include "core/rng.h"
#include "core/tensor_parallel/dtensor.h"
#include "core/tensor_parallel/mappings.h"
#include "core/tensor_parallel/parallel_style.h"

namespace mpusim {
namespace chain {

using Split = ActivationState::Split;

// How a parameter is split over the tp ranks, whatever t is (dim -1: replicated).
struct TpSplitPlan {
  int dim = -1;
  int64_t stride = 1;
  bool operator==(const TpSplitPlan&) const = default;
};

// A chain parameter: the shared Parameter (core/model/parameter.h: what the optimizer
// updates) with how the chain plans it.
struct ChainParameter : Parameter {
  TpSplitPlan split;
  bool zero_init = false;   // biases
  bool frozen = false;      // no main_grad, never updated
  int64_t owner_stage = 0;  // the virtual pipeline stage of the layer that owns it
  bool held = true;         // on this rank (its owner's, or a tied user's, pipeline rank)
};

// One micro-batch's data on this rank.
struct Batch {
  int64_t microbatch = 0;
  Tensor tokens;           // [s, b] int64 on the device: full sequence, this dp rank's samples
  Tensor labels;           // [s, b] int64 on the device
  double token_scale = 0;  // d loss / d per-token loss = 1 / (M * s * B)
};

class LayerKind;
class LayerPlanner;

// What a layer kind's Forward and Backward are given: the rank, the modules' context (the
// backend, the tp group, the stream shape with sequence parallelism, gradient accumulation
// fusion), the micro-batch's tokens and labels, and the padded vocabulary.
struct LayerCall {
  RankContext& ctx;
  ModuleContext module;
  const Batch& batch;
  int64_t padded_vocab = 0;
};

// What a layer keeps of one micro-batch: saved for its backward and, for the last
// micro-batch, for the records. A pipeline stashes them per (chunk, micro-batch).
struct SlotTensors {
  Tensor input, output, output_grad, input_grad;
  Tensor saved;             // layer-specific: CPL/RPL gathered or split input, GeLU pre-activation
  RngDraw draw{};           // Dropout
  Tensor row_max, sum_exp;  // cross entropy
  Tensor mean, rstd;        // LayerNorm's statistics
};

// A torch.nn module's placements on the tp mesh dimension (graph_torch.cc), on torch's
// batch-first [b, s, w] (Shard(1) the sequence, Shard(2) the width): the input as it
// arrives, what the module computes on, what it produces and what it hands on, and its
// weight's placement. Unstyled: its parameters replicated and nothing redistributed.
struct TorchPlacements {
  std::optional<StyledModule> style;
  std::string styled_by;  // the plan entry ("parallelize_plan.fc1"), "" when unstyled
  DTensorPlacement arrives, computes, produces, hands_on, weight;
  bool hands_on_dtensor = false;  // use_local_output false: the next module gets the DTensor
};

struct LayerSlot : SlotTensors {
  LayerConfig config;
  const LayerKind* kind = nullptr;  // KindOf(config.type)
  int index = 0;
  int64_t stage = 0;  // the virtual pipeline stage holding it
  ActivationState in_state;
  ActivationState out_state;
  int64_t in_width = 0;              // full hidden width (0: tokens)
  int64_t out_width = 0;             // full hidden width (0: loss)
  ChainParameter* weight = nullptr;  // owned or borrowed (weight_from)
  bool owns_weight = false;
  ChainParameter* bias = nullptr;
  ChainParameter* added_bias = nullptr;  // GeLU with bias_from
  std::string rng_stream;                // Dropout
  TorchPlacements torch;                 // torch.nn modules
};

// One kind of layer (graph_layers.cc), built from the core/model modules: what it accepts
// and produces (Plan), and its forward and backward on one rank. A LayerSlot holds its
// layer's parameters and the tensors of the micro-batch in flight; the kind holds nothing.
// Adding a kind of layer: its LayerType and config options (core/config/model_config), a
// class in graph_layers.cc with its row in KindOf, and its float64 reference (reference/).
class LayerKind {
 public:
  virtual ~LayerKind() = default;
  // An embedding: consumes the token ids, so it is the first layer and has no input
  // activation (its backward returns an undefined tensor).
  virtual bool takes_tokens() const { return false; }
  // The loss: the last layer, its output the per-token losses [s, b].
  virtual bool is_loss() const { return false; }
  // The state a chain starting with this layer gets its synthetic input in.
  virtual Split SyntheticInputSplit(const LayerConfig& /*c*/, bool /*sequence_parallel*/) const {
    return Split::kReplicated;
  }
  // The input width the layer fixes by itself (0: it takes any).
  virtual int64_t FixedInputWidth(const LayerConfig& /*c*/, int64_t /*padded_vocab*/) const {
    return 0;
  }
  // Checks the state and width the layer receives, adds its parameters and leaves the state
  // and width it produces in the planner; errors name "model.layers[i]".
  virtual Status Plan(LayerPlanner& p) const = 0;
  // The layer's backward collective when it sums t copies of a gradient that every rank
  // already holds in full (Graph::Impl::PlanWarnings), or null.
  virtual const char* RedundantGradientSum(const LayerConfig& /*c*/) const { return nullptr; }
  // Forward of the slot's layer on x (saving what its backward needs in the slot); backward
  // from dy, accumulating its parameters' gradients, returns the input gradient.
  virtual Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& x) const = 0;
  virtual Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const = 0;
};
// The kind of a layer type (a table, in LayerType's order); torch.nn's modules are
// graph_torch.cc's (TorchKindOf).
const LayerKind& KindOf(LayerType type);
const LayerKind& TorchKindOf(LayerType type);
// `mpusim explain`'s lines for a torch.nn module on `t` tp ranks: its style, its parameters'
// and activations' placements, the redistributions forward and backward with their
// collectives, and the Megatron module that does the same, when there is one.
std::vector<std::string> ExplainTorchModule(const LayerSlot& slot, int64_t t);

// The tensor-parallel layout of an activation in `state` on the rank at `c`.
ShardSpec ActivationSpec(const ActivationState& state, const RankCoordinates& c, int64_t tp,
                         int64_t dp);

}  // namespace chain

struct Graph::Impl {
  using ChainParameter = chain::ChainParameter;
  using LayerSlot = chain::LayerSlot;
  using SlotTensors = chain::SlotTensors;
  using Batch = chain::Batch;
  using LayerCall = chain::LayerCall;
  using TpSplitPlan = chain::TpSplitPlan;
  using Split = ActivationState::Split;

  ParallelConfig parallel;
  ModelConfig model;
  RunConfig run;
  int64_t t = 1, d = 1;
  int64_t padded_vocab = 0;
  bool sequence_parallel = false;
  bool fuse_wgrad = false;             // parallel.gradient_accumulation_fusion
  DType grad_dtype = DType::kFloat32;  // main_grad (OptimizerPrecision)
  std::vector<LayerSlot> layers;
  std::vector<std::unique_ptr<ChainParameter>> parameters;
  bool needs_tokens = false, needs_labels = false;
  std::vector<std::string> warnings;  // Graph::Warnings(), filled by PlanWarnings
  // parallelize_plan (torch.nn chains): each layer's style and the entry that gave it, from
  // ResolveStyles (graph_torch.cc); and while planning, whether the activation flowing is a
  // DTensor (a styled module handed it on with use_local_output false).
  std::optional<ParallelizePlan> parallelize_plan;
  std::vector<std::optional<std::pair<std::string, ParallelStyle>>> styles;
  bool planning_dtensor = false;
  int64_t planning_stage = 0;         // the stage of the layer Plan is at
  // Pipeline: p stages of v chunks; virtual stage u = chunk * p + pp_rank holds the layers
  // [stage_start[u], stage_start[u + 1]) (PipelineStages), and every pp rank's plan.
  int64_t pp_size = 1, vp_size = 1;
  std::vector<int64_t> stage_start;
  // This rank (InitializeParameters).
  int64_t pp_rank = 0;
  // optimizer.use_torch_fsdp2 (BuildFullyShard): the fully_shard units, each a run of
  // layers [unit_first[u], unit_last[u]]; each layer's unit (-1: none, it holds no
  // parameter); and whether a forward runs inside the backward (recomputation).
  std::unique_ptr<FullyShard> fsdp;
  std::vector<int64_t> unit_of, unit_first, unit_last;
  bool recomputing = false;
  struct Stash : StepStash {
    // Per layer of the chunk: its tensors, empty for a layer that full recomputation reruns
    // (run.recompute_method over the chunk's layers, RunConfig::GroupOf); for the first layer
    // of a recomputed group, the group's input (undefined on the first stage) and the
    // tracker's state before it.
    std::vector<SlotTensors> slots;
    std::vector<Tensor> group_input;
    std::vector<RngTracker::States> group_rng;
    Batch batch;
  };
  int64_t current_iteration = 0;
  // Results.
  double loss_sum = 0;  // sum over micro-batches of the mean token loss
  bool has_loss = false;
  Tensor last_tokens, last_labels;  // host float64 [s, b]

  // Build's plan (graph_planner.cc): the stages, then each layer in order (PlanLayer; a first
  // layer that is not an embedding gets its synthetic input's state and width from
  // PlanSyntheticInput), then the ties across stages and the warnings.
  Status Plan(const Topology& topology);
  Status PlanStages();
  Status PlanSyntheticInput(const LayerSlot& slot, ActivationState* state, int64_t* width) const;
  Status PlanLayer(LayerSlot& slot, ActivationState* state, int64_t* width);
  Status PlanTies();
  Status ResolveStyles();  // graph_torch.cc
  // The fully_shard units: each a run of layers [first, last] and the parameters they use.
  struct UnitRange {
    int64_t first = 0, last = 0;
    std::string name;
    std::vector<ChainParameter*> params;
  };
  std::vector<UnitRange> FullyShardRanges() const;
  void BuildFullyShard(RankContext& ctx, bool reshard_after_forward);
  void PlanWarnings();
  Status Fail(const LayerSlot& slot, const std::string& what) const {
    return Status::Error(
        fmt::format("model.layers[{}]", slot.index),
        fmt::format("({} {}): {}", LayerTypeName(slot.config.type), slot.config.name, what));
  }
  ChainParameter* AddParameter(std::string name, Shape full, TpSplitPlan split,
                               const LayerConfig& c, bool zero_init) {
    auto p = std::make_unique<ChainParameter>();
    p->name = std::move(name);
    p->full_shape = std::move(full);
    p->split = split;
    p->init = c.init;
    p->zero_init = zero_init;
    p->frozen = c.frozen && !zero_init;
    p->owner_stage = planning_stage;
    parameters.push_back(std::move(p));
    return parameters.back().get();
  }
  // Which parameters (by index) pipeline rank `rank` holds: those its layers own, and the
  // weights its layers borrow (weight_from) from another rank's, whose copy is `shared`.
  struct Holding {
    bool held = false, shared = false;
  };
  std::vector<Holding> HoldingsOf(int64_t rank) const {
    std::vector<Holding> holdings(parameters.size());
    for (size_t i = 0; i < parameters.size(); ++i) {
      holdings[i].held = PipelineRankOf(parameters[i]->owner_stage) == rank;
    }
    for (const LayerSlot& slot : layers) {
      if (PipelineRankOf(slot.stage) != rank || slot.weight == nullptr) continue;
      for (size_t i = 0; i < parameters.size(); ++i) {
        if (parameters[i].get() == slot.weight && !holdings[i].held) holdings[i] = {true, true};
      }
    }
    return holdings;
  }
  ShardSpec RankShard(const ChainParameter& p, int64_t tp_rank) const {
    ShardSpec shard;
    if (p.split.dim >= 0) shard.Split(ShardAxis::kTp, p.split.dim, t, tp_rank, p.split.stride);
    return shard;
  }
  LayerSlot* FindLayer(const std::string& name) {
    for (LayerSlot& slot : layers) {
      if (slot.config.name == name) return &slot;
    }
    return nullptr;
  }

  int64_t PipelineRankOf(int64_t stage) const { return stage % pp_size; }
  int64_t First(int64_t chunk) const {
    return stage_start[static_cast<size_t>(chunk * pp_size + pp_rank)];
  }
  int64_t End(int64_t chunk) const {
    return stage_start[static_cast<size_t>(chunk * pp_size + pp_rank) + 1];
  }
  // The local [s_l, b, w_l] shape of an activation in `state` of full width `width`.
  Shape LocalActivationShape(ActivationState state, int64_t width, const RankCoordinates& c) const {
    return LocalShape(chain::ActivationSpec(state, c, t, d),
                      {run.seq_length, run.micro_batch_size * d, width});
  }

  // Execution.
  Batch MakeBatch(RankContext& ctx, int64_t m, bool tokens, bool labels) const;
  Tensor SyntheticActivation(RankContext& ctx, const std::string& name, ActivationState state,
                             int64_t width, DType dtype);
  // Synthetic inputs and output gradients are fixed by the seed and the iteration: made once,
  // reused by every repetition of Run with that iteration.
  std::map<std::string, Tensor> synthetic_cache;
  int64_t synthetic_iteration = -1;
  // The RNG tracker's states before the first step, and how far one iteration advances each
  // stream (M draws per Dropout layer on it).
  RngTracker::States initial_rng;
  std::map<std::string, uint64_t> draws_per_iteration;
  RngTracker::States RngAtIteration(int64_t iteration) const {
    RngTracker::States states = initial_rng;
    for (auto& [name, state] : states) {
      const auto it = draws_per_iteration.find(name);
      if (it != draws_per_iteration.end())
        state.calls += static_cast<uint64_t>(iteration) * it->second;
    }
    return states;
  }
  LayerCall Call(RankContext& ctx, const Batch& batch) const;
  Tensor Forward(RankContext& ctx, LayerSlot& slot, const Tensor& x, const Batch& batch);
  Tensor Backward(RankContext& ctx, LayerSlot& slot, const Tensor& dy, const Batch& batch);
  // Layers [first, end) forward from `x` (the synthetic input or the embedding's tokens when
  // first is 0); returns the last one's output. Adds the micro-batch's mean token loss to
  // loss_sum when the chunk ends with the loss and `count_loss`.
  Tensor ForwardLayers(RankContext& ctx, int64_t first, int64_t end, Tensor x, const Batch& batch,
                       bool count_loss);
  // Layers [first, end) backward from `dy` (the loss's constant or the synthetic output
  // gradient when end is the chain's end); returns the gradient of the first one's input.
  Tensor BackwardLayers(RankContext& ctx, int64_t first, int64_t end, Tensor dy,
                        const Batch& batch);
  Tensor ForwardStep(const StepCall& call, const Tensor& input, Stash& stash);
  Tensor BackwardStep(const StepCall& call, const Tensor& output_grad, Stash& stash);
};

namespace chain {

// What a layer kind's Plan works on: the chain, the layer's slot, and the activation state
// and width flowing through (the one it receives, then the one it produces), with the
// checks every kind uses. Errors name "model.layers[i]" (Graph::Impl::Fail).
class LayerPlanner {
 public:
  LayerPlanner(Graph::Impl& chain, LayerSlot& layer, ActivationState& flowing_state,
               int64_t& flowing_width)
      : g(chain), slot(layer), state(flowing_state), width(flowing_width) {}

  Status Fail(const std::string& what) const { return g.Fail(slot, what); }
  Status RequireState(std::initializer_list<Split> allowed) const;
  Status RequireDivisible(int64_t value, int64_t by, const std::string& what) const;
  Status RequireWidth(int64_t expected, const char* field) const;
  Status RequireSequenceDivisible() const;

  Graph::Impl& g;
  LayerSlot& slot;
  ActivationState& state;
  int64_t& width;
};

}  // namespace chain

}  // namespace mpusim
