// The layer graph (see graph.h and docs/simulator.md).
//
// Shape legend (local, on one rank; t = tp size, d = dp size):
//   s, b          sequence length (s/t under sequence parallelism), micro-batch per dp rank
//   x, y          activations [s, b, h] viewed as [s*b, h]
//   W_col         ColumnParallelLinear weight shard [out/t, in]
//   W_row         RowParallelLinear weight shard    [out, in/t]
//   E_vocab       VocabParallelEmbedding shard      [Vp/t, h]
//   E_dim         ParallelEmbedding shard           [V, h/t]
#include "core/model/graph.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/init.h"
#include "core/model/accumulate_grad.h"
#include "core/model/parameter.h"
#include "core/pipeline/pipeline_plan.h"
#include "core/rng.h"
#include "core/schedule.h"
#include "core/tensor_parallel/cross_entropy.h"
#include "core/tensor_parallel/mappings.h"
#include "core/tensor_parallel/tp_utils.h"

namespace mpusim {

using Split = ActivationState::Split;

const char* SplitName(Split split) {
  switch (split) {
    case Split::kReplicated: return "replicated";
    case Split::kHidden: return "hidden split";
    case Split::kSequence: return "sequence split";
    case Split::kPartialSum: return "partial sum";
  }
  return "?";
}

namespace {

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
  bool zero_init = false;  // biases
  bool frozen = false;     // no main_grad, never updated
  int64_t owner_stage = 0;  // the virtual pipeline stage of the layer that owns it
  bool held = true;         // on this rank (its owner's, or a tied user's, pipeline rank)
};

// One micro-batch's data on this rank.
struct Batch {
  int64_t microbatch = 0;
  Tensor tokens;  // [s, b] int64 on the device: full sequence, this dp rank's samples
  Tensor labels;  // [s, b] int64 on the device
  double token_scale = 0;  // d loss / d per-token loss = 1 / (M * s * B)
};

// What a layer keeps of one micro-batch: saved for its backward and, for the last
// micro-batch, for the records. A pipeline stashes them per (chunk, micro-batch).
struct SlotTensors {
  Tensor input, output, output_grad, input_grad;
  Tensor saved;             // layer-specific: CPL/RPL gathered or split input, GeLU pre-activation
  RngDraw draw{};           // Dropout
  Tensor row_max, sum_exp;  // cross entropy
};

struct LayerSlot : SlotTensors {
  LayerConfig config;
  int index = 0;
  int64_t stage = 0;  // the virtual pipeline stage holding it
  ActivationState in_state;
  ActivationState out_state;
  int64_t in_width = 0;   // full hidden width (0: tokens)
  int64_t out_width = 0;  // full hidden width (0: loss)
  ChainParameter* weight = nullptr;  // owned or borrowed (weight_from)
  bool owns_weight = false;
  ChainParameter* bias = nullptr;
  ChainParameter* added_bias = nullptr;  // GeLU with bias_from
  std::string rng_stream;                // Dropout
};

ShardSpec ActivationSpec(const ActivationState& state, const RankCoordinates& c, int64_t tp,
                         int64_t dp) {
  ShardSpec spec;
  spec.Split(ShardAxis::kDp, 1, dp, c.dp);
  if (state.split == Split::kHidden) {
    spec.Split(ShardAxis::kTp, 2, tp, c.tp, state.stride);
  } else if (state.split == Split::kSequence) {
    spec.Split(ShardAxis::kTp, 0, tp, c.tp);
  }
  return spec;
}

bool IsEmbedding(LayerType type) {
  return type == LayerType::kVocabParallelEmbedding || type == LayerType::kParallelEmbedding;
}

std::optional<Mapping> MappingOf(LayerType type) {
  switch (type) {
    case LayerType::kCopyToTensorModelParallelRegion: return Mapping::kCopyToTp;
    case LayerType::kReduceFromTensorModelParallelRegion: return Mapping::kReduceFromTp;
    case LayerType::kScatterToTensorModelParallelRegion: return Mapping::kScatterToTp;
    case LayerType::kGatherFromTensorModelParallelRegion: return Mapping::kGatherFromTp;
    case LayerType::kScatterToSequenceParallelRegion: return Mapping::kScatterToSp;
    case LayerType::kGatherFromSequenceParallelRegion: return Mapping::kGatherFromSp;
    case LayerType::kReduceScatterToSequenceParallelRegion: return Mapping::kReduceScatterToSp;
    default: return std::nullopt;
  }
}

}  // namespace

struct Graph::Impl {
  ParallelConfig parallel;
  ModelConfig model;
  RunConfig run;
  int64_t t = 1, d = 1;
  int64_t padded_vocab = 0;
  bool sequence_parallel = false;
  bool fuse_wgrad = false;  // parallel.gradient_accumulation_fusion
  std::vector<LayerSlot> layers;
  std::vector<std::unique_ptr<ChainParameter>> parameters;
  bool needs_tokens = false, needs_labels = false;
  std::vector<std::string> warnings;  // Graph::warnings(), filled by PlanWarnings
  int64_t planning_stage = 0;         // the stage of the layer Plan is at
  // Pipeline: p stages of v chunks; virtual stage u = chunk * p + pp_rank holds the layers
  // [stage_start[u], stage_start[u + 1]) (PipelineStages), and every pp rank's plan.
  int64_t pp_size = 1, vp_size = 1;
  std::vector<int64_t> stage_start;
  // This rank (InitializeParameters).
  int64_t pp_rank = 0;
  struct Stash : StepStash {
    std::vector<SlotTensors> slots;  // the chunk's layers; with recompute, nothing
    Tensor input;                    // the chunk's input (undefined on the first stage)
    Batch batch;
    RngTracker::States rng_before;  // the tracker before the forward, for recomputation
  };
  int64_t current_iteration = 0;
  // Results.
  double loss_sum = 0;  // sum over micro-batches of the mean token loss
  bool has_loss = false;
  Tensor last_tokens, last_labels;  // host float64 [s, b]

  Status Plan(const Topology& topology);
  void PlanWarnings();
  Status Fail(const LayerSlot& slot, const std::string& what) const {
    return Status::Error(fmt::format("model.layers[{}]", slot.index),
                         fmt::format("({} {}): {}", LayerTypeName(slot.config.type),
                                     slot.config.name, what));
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
    return LocalShape(ActivationSpec(state, c, t, d),
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

// ---------------------------------------------------------------------------------------
// Planning: states, shapes, parameters.

Status Graph::Impl::Plan(const Topology& topology) {
  t = topology.sizes().tp;
  d = topology.sizes().dp;
  sequence_parallel = parallel.sequence_parallel;
  fuse_wgrad = parallel.gradient_accumulation_fusion;
  const int64_t s = run.seq_length;
  if (model.vocab_size) padded_vocab = model.PaddedVocabSize(t);
  // Pipeline stages: the chain's n layers in p * v consecutive runs, as even as they go
  // (stage u starts at layer u * n / S; the later stages take the extra layers).
  pp_size = topology.sizes().pp;
  vp_size = parallel.virtual_pipeline_model_parallel_size.value_or(1);
  const auto n = static_cast<int64_t>(model.layers.size());
  const int64_t stages = pp_size * vp_size;
  if (n < stages) {
    return Status::Error(
        "model.layers",
        fmt::format("{} layers cannot fill {} pipeline stages (pipeline_model_parallel_size {} x "
                    "virtual_pipeline_model_parallel_size {}); each stage holds at least one layer",
                    n, stages, pp_size, vp_size));
  }
  stage_start.clear();
  for (int64_t u = 0; u <= stages; ++u) stage_start.push_back(u * n / stages);

  ActivationState state;
  int64_t width = 0;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    LayerSlot slot;
    slot.config = model.layers[i];
    slot.index = static_cast<int>(i);
    slot.stage = static_cast<int64_t>(
        std::upper_bound(stage_start.begin(), stage_start.end(), static_cast<int64_t>(i)) -
        stage_start.begin() - 1);
    planning_stage = slot.stage;
    const LayerConfig& c = slot.config;
    const bool first = i == 0;
    const bool needs_vocab = IsEmbedding(c.type) ||
                             c.type == LayerType::kVocabParallelCrossEntropy ||
                             c.output_size.padded_vocab;
    if (needs_vocab && !model.vocab_size) {
      return Fail(slot, "needs model.vocab_size (the vocabulary tokens and labels come from)");
    }

    // The state a first layer receives its synthetic input in.
    if (first && !IsEmbedding(c.type)) {
      switch (c.type) {
        case LayerType::kColumnParallelLinear:
          state.split = sequence_parallel ? Split::kSequence : Split::kReplicated;
          width = c.input_size;
          break;
        case LayerType::kRowParallelLinear:
          state.split = c.input_is_parallel ? Split::kHidden : Split::kReplicated;
          width = c.input_size;
          break;
        case LayerType::kReduceFromTensorModelParallelRegion:
        case LayerType::kReduceScatterToSequenceParallelRegion:
          state.split = Split::kPartialSum;
          break;
        case LayerType::kGatherFromTensorModelParallelRegion:
        case LayerType::kVocabParallelCrossEntropy: state.split = Split::kHidden; break;
        case LayerType::kGatherFromSequenceParallelRegion: state.split = Split::kSequence; break;
        default: state.split = Split::kReplicated;
      }
      // Layers without a size of their own take the width from the first later layer that
      // fixes it (a linear layer's input_size, or the loss's padded vocabulary).
      for (size_t j = i; width == 0 && j < model.layers.size(); ++j) {
        const LayerConfig& later = model.layers[j];
        if (later.type == LayerType::kColumnParallelLinear ||
            later.type == LayerType::kRowParallelLinear) {
          width = later.input_size;
        } else if (later.type == LayerType::kVocabParallelCrossEntropy) {
          width = padded_vocab;
        }
      }
      if (width == 0) {
        return Fail(slot, "no layer of the chain fixes the width of its synthetic input; add a "
                          "linear layer or the loss");
      }
    }
    slot.in_state = state;
    slot.in_width = IsEmbedding(c.type) ? 0 : width;
    if (IsEmbedding(c.type) && !first) {
      return Fail(slot, "an embedding consumes token ids, so it must be the first layer");
    }
    if (!first && layers.back().config.type == LayerType::kVocabParallelCrossEntropy) {
      return Fail(slot, "comes after the loss; VocabParallelCrossEntropy must be the last layer");
    }
    const auto require_state = [&](std::initializer_list<Split> allowed) -> Status {
      for (Split a : allowed) {
        if (state.split == a) return {};
      }
      std::vector<std::string> names;
      for (Split a : allowed) names.emplace_back(SplitName(a));
      return Fail(slot, fmt::format("receives a {} activation but accepts only: {}",
                                    SplitName(state.split), fmt::join(names, ", ")));
    };
    const auto require_divisible = [&](int64_t value, int64_t by,
                                       const std::string& what) -> Status {
      if (value % by != 0) {
        return Fail(slot, fmt::format("{} ({}) must be divisible by {}", what, value, by));
      }
      return {};
    };
    const auto require_width = [&](int64_t expected, const char* field) -> Status {
      if (width != expected) {
        return Fail(slot, fmt::format("{} is {} but the incoming activation has width {}", field,
                                      expected, width));
      }
      return {};
    };
    const auto require_sequence_divisible = [&]() -> Status {
      return require_divisible(s, t, "run.seq_length under sequence parallelism");
    };

    const TpSplitPlan replicated;
    switch (c.type) {
      case LayerType::kVocabParallelEmbedding: {
        const int64_t rows = c.num_embeddings.Resolve(padded_vocab);
        if (rows < *model.vocab_size) {
          return Fail(slot, fmt::format("num_embeddings ({}) is smaller than model.vocab_size "
                                        "({})",
                                        rows, *model.vocab_size));
        }
        MPUSIM_RETURN_IF_ERROR(require_divisible(rows, t, "num_embeddings"));
        slot.weight = AddParameter(c.name + ".weight", {rows, c.embedding_dim}, {0, 1}, c, false);
        slot.owns_weight = true;
        if (sequence_parallel) {
          MPUSIM_RETURN_IF_ERROR(require_sequence_divisible());
          state.split = Split::kSequence;
        } else {
          state.split = Split::kReplicated;
        }
        width = c.embedding_dim;
        needs_tokens = true;
        break;
      }
      case LayerType::kParallelEmbedding: {
        const int64_t rows = c.num_embeddings.Resolve(padded_vocab);
        if (rows < *model.vocab_size) {
          return Fail(slot, fmt::format("num_embeddings ({}) is smaller than model.vocab_size "
                                        "({})",
                                        rows, *model.vocab_size));
        }
        MPUSIM_RETURN_IF_ERROR(require_divisible(c.embedding_dim, t, "embedding_dim"));
        slot.weight = AddParameter(c.name + ".weight", {rows, c.embedding_dim}, {1, 1}, c, false);
        slot.owns_weight = true;
        state.split = Split::kReplicated;
        width = c.embedding_dim;
        needs_tokens = true;
        break;
      }
      case LayerType::kColumnParallelLinear: {
        if (sequence_parallel) {
          MPUSIM_RETURN_IF_ERROR(require_state({Split::kSequence}));
          MPUSIM_RETURN_IF_ERROR(require_sequence_divisible());
          if (c.gather_output) {
            return Fail(slot, "gather_output cannot be used with sequence_parallel (Megatron "
                              "refuses it too); set gather_output to false");
          }
        } else {
          MPUSIM_RETURN_IF_ERROR(require_state({Split::kReplicated}));
        }
        MPUSIM_RETURN_IF_ERROR(require_width(c.input_size, "input_size"));
        const int64_t out = c.output_size.Resolve(padded_vocab);
        MPUSIM_RETURN_IF_ERROR(
            require_divisible(out, t * c.stride, "output_size / (tensor_model_parallel_size * "
                                                 "stride): output_size"));
        if (c.gather_output && c.stride > 1) {
          return Fail(slot, "gather_output with stride > 1 would leave the gathered columns in "
                            "strided order; use gather_output false");
        }
        const TpSplitPlan split{0, c.stride};
        if (c.skip_weight_param_allocation) {
          LayerSlot* owner = FindLayer(c.weight_from);
          if (owner == nullptr || owner->weight == nullptr) {
            return Fail(slot, fmt::format("weight_from '{}' is not an earlier layer with a weight",
                                          c.weight_from));
          }
          const Shape want = {out, c.input_size};
          if (owner->weight->full_shape != want || owner->weight->split != split) {
            return Fail(slot, fmt::format("weight_from '{}' has shape {} split on dim {}, but "
                                          "this layer needs {} split on dim 0 with stride {}",
                                          c.weight_from, ShapeString(owner->weight->full_shape),
                                          owner->weight->split.dim, ShapeString(want),
                                          c.stride));
          }
          slot.weight = owner->weight;
        } else {
          slot.weight = AddParameter(c.name + ".weight", {out, c.input_size}, split, c, false);
          slot.owns_weight = true;
        }
        if (c.bias) {
          slot.bias = AddParameter(c.name + ".bias", {out}, split, c, true);
        }
        if (c.gather_output) {
          state = ActivationState{Split::kReplicated, 1};
        } else {
          state = ActivationState{Split::kHidden, c.stride};
        }
        width = out;
        break;
      }
      case LayerType::kRowParallelLinear: {
        if (c.input_is_parallel) {
          MPUSIM_RETURN_IF_ERROR(require_state({Split::kHidden}));
          if (state.stride != c.stride) {
            return Fail(slot, fmt::format("its input is split with stride {} but the layer's "
                                          "stride is {}; they must match",
                                          state.stride, c.stride));
          }
        } else {
          MPUSIM_RETURN_IF_ERROR(require_state({Split::kReplicated}));
          if (c.stride != 1) {
            return Fail(slot, "stride > 1 needs input_is_parallel (the scatter splits "
                              "contiguously)");
          }
        }
        MPUSIM_RETURN_IF_ERROR(require_width(c.input_size, "input_size"));
        MPUSIM_RETURN_IF_ERROR(require_divisible(c.input_size, t * c.stride,
                                                 "input_size / (tensor_model_parallel_size * "
                                                 "stride): input_size"));
        const int64_t out = c.output_size.Resolve(padded_vocab);
        slot.weight = AddParameter(c.name + ".weight", {out, c.input_size}, {1, c.stride}, c, false);
        slot.owns_weight = true;
        if (c.bias) {
          slot.bias = AddParameter(c.name + ".bias", {out}, replicated, c, true);
          slot.bias->sequence_parallel = sequence_parallel;
        }
        if (sequence_parallel) {
          MPUSIM_RETURN_IF_ERROR(require_sequence_divisible());
          state = ActivationState{Split::kSequence, 1};
        } else {
          state = ActivationState{Split::kReplicated, 1};
        }
        width = out;
        break;
      }
      case LayerType::kGeLU: {
        MPUSIM_RETURN_IF_ERROR(
            require_state({Split::kReplicated, Split::kHidden, Split::kSequence}));
        if (!c.bias_from.empty()) {
          LayerSlot* owner = FindLayer(c.bias_from);
          if (owner == nullptr || owner->bias == nullptr || !owner->config.skip_bias_add) {
            return Fail(slot, fmt::format("bias_from '{}' must name an earlier linear layer with "
                                          "bias and skip_bias_add",
                                          c.bias_from));
          }
          if (owner->bias->full_shape[0] != width) {
            return Fail(slot, fmt::format("bias_from '{}' has {} elements but the activation has "
                                          "width {}",
                                          c.bias_from, owner->bias->full_shape[0], width));
          }
          const bool bias_split = owner->bias->split.dim == 0;
          if (bias_split != (state.split == Split::kHidden)) {
            return Fail(slot, fmt::format("bias_from '{}' is {} but the activation is {}",
                                          c.bias_from, bias_split ? "split" : "replicated",
                                          SplitName(state.split)));
          }
          slot.added_bias = owner->bias;
        }
        break;
      }
      case LayerType::kDropout: {
        MPUSIM_RETURN_IF_ERROR(
            require_state({Split::kReplicated, Split::kHidden, Split::kSequence}));
        slot.rng_stream =
            state.split == Split::kReplicated ? kDefaultStream : kModelParallelStream;
        break;
      }
      case LayerType::kVocabParallelCrossEntropy: {
        MPUSIM_RETURN_IF_ERROR(require_state({Split::kHidden}));
        if (state.stride != 1) {
          return Fail(slot, "the logits must be split with stride 1");
        }
        MPUSIM_RETURN_IF_ERROR(require_width(padded_vocab, "padded_vocab_size"));
        if (c.label_smoothing > 0 && padded_vocab < 2) {
          return Fail(slot, "label smoothing needs at least 2 vocabulary entries");
        }
        needs_labels = true;
        state = ActivationState{Split::kReplicated, 1};
        width = 0;
        break;
      }
      default: {
        const Mapping mapping = *MappingOf(c.type);
        switch (mapping) {
          case Mapping::kCopyToTp:
            MPUSIM_RETURN_IF_ERROR(require_state({Split::kReplicated}));
            break;
          case Mapping::kReduceFromTp:
            MPUSIM_RETURN_IF_ERROR(require_state({Split::kPartialSum}));
            state = ActivationState{Split::kReplicated, 1};
            break;
          case Mapping::kScatterToTp:
            MPUSIM_RETURN_IF_ERROR(require_state({Split::kReplicated}));
            MPUSIM_RETURN_IF_ERROR(require_divisible(width, t, "the activation width"));
            state = ActivationState{Split::kHidden, 1};
            break;
          case Mapping::kGatherFromTp:
            MPUSIM_RETURN_IF_ERROR(require_state({Split::kHidden}));
            if (state.stride != 1) return Fail(slot, "cannot gather a strided split");
            state = ActivationState{Split::kReplicated, 1};
            break;
          case Mapping::kScatterToSp:
            MPUSIM_RETURN_IF_ERROR(require_state({Split::kReplicated}));
            MPUSIM_RETURN_IF_ERROR(require_divisible(s, t, "run.seq_length"));
            state = ActivationState{Split::kSequence, 1};
            break;
          case Mapping::kGatherFromSp:
            MPUSIM_RETURN_IF_ERROR(require_state({Split::kSequence}));
            state = ActivationState{Split::kReplicated, 1};
            break;
          case Mapping::kReduceScatterToSp:
            MPUSIM_RETURN_IF_ERROR(require_state({Split::kPartialSum}));
            MPUSIM_RETURN_IF_ERROR(require_divisible(s, t, "run.seq_length"));
            state = ActivationState{Split::kSequence, 1};
            break;
        }
      }
    }
    if (state.split == Split::kHidden && width % (t * state.stride) != 0) {
      return Fail(slot, fmt::format("the output width {} must be divisible by "
                                    "tensor_model_parallel_size * stride = {}",
                                    width, t * state.stride));
    }
    slot.out_state = state;
    slot.out_width = width;
    layers.push_back(std::move(slot));
  }
  // A layer using another layer's parameter on another pipeline rank: Megatron shares only
  // the word embeddings, between the first and the last stage (the last holds a copy whose
  // gradient is all-reduced with the first's over the embd group).
  for (LayerSlot& slot : layers) {
    const auto check = [&](ChainParameter* param, bool weight) -> Status {
      if (param == nullptr) return {};
      const int64_t owner = PipelineRankOf(param->owner_stage);
      const int64_t user = PipelineRankOf(slot.stage);
      if (owner == user) return {};
      if (weight && owner == 0 && user == pp_size - 1) {
        param->embedding_group = true;
        return {};
      }
      return Fail(slot, fmt::format("uses {} from pipeline rank {} but runs on pipeline rank {}; "
                                    "across pipeline ranks only a weight of the first rank is "
                                    "shared, with the last (Megatron's tied embeddings)",
                                    param->name, owner, user));
    };
    if (!slot.owns_weight) MPUSIM_RETURN_IF_ERROR(check(slot.weight, true));
    MPUSIM_RETURN_IF_ERROR(check(slot.added_bias, false));
  }
  PlanWarnings();
  return {};
}

// Plan-time warnings (docs/simulator.md, "Warnings"): region mappings whose gradients come
// out t-fold, exactly as Megatron's code computes them.
//
// Backward from the output, the gradient reaching every activation of the chain is complete
// on every rank: the full gradient of a replicated activation, the rank's shard of it for a
// split one. The output gradient is (synthetic, or the loss's constant), and every layer keeps
// it so: a ColumnParallelLinear's partial input gradients are summed inside it (its own
// copy_to all-reduce, or its reduce-scatter under sequence parallelism), the other layers and
// mappings take no sum or all-gather and split complete gradients. copy_to's backward
// all-reduce and gather_from_sequence_parallel_region's reduce-scatter (with
// tensor_parallel_output_grad) are meant for partial gradients; given a complete one, they add
// t identical copies. Backward is linear in the gradient, so every gradient before such a
// mapping is t times the full-model one (t^k behind k of them).
void Graph::Impl::PlanWarnings() {
  if (t == 1) return;
  double factor = 1;
  for (size_t i = layers.size(); i-- > 0;) {
    const LayerConfig& c = layers[i].config;
    const char* sum = nullptr;
    if (c.type == LayerType::kCopyToTensorModelParallelRegion) {
      sum = "its backward all-reduce";
    } else if (c.type == LayerType::kGatherFromSequenceParallelRegion &&
               c.tensor_parallel_output_grad) {
      sum = "its backward reduce-scatter (tensor_parallel_output_grad true)";
    }
    if (sum == nullptr) continue;
    factor *= static_cast<double>(t);
    std::vector<std::string> before;
    for (size_t j = 0; j < i && j < 4; ++j) before.push_back(layers[j].config.name);
    if (i > 4) before.push_back(fmt::format("and {} more", i - 4));
    warnings.push_back(fmt::format(
        "model.layers[{}] ({} {}): {} sums t = {} copies of a gradient every rank already holds "
        "in full (the layers after it leave the full gradient on every rank), so {} is {:g}x the "
        "full-model gradient; Megatron's code computes the same; the check against the "
        "reference will fail for {}.input_grad{}",
        i, LayerTypeName(c.type), c.name, sum, t,
        i == 0 ? std::string("the chain's input gradient")
               : fmt::format("the gradient reaching {}", layers[i - 1].config.name),
        factor, c.name,
        i == 0 ? std::string()
               : fmt::format(" and the gradients of every layer before it ({})",
                             fmt::join(before, ", "))));
  }
  std::reverse(warnings.begin(), warnings.end());  // in layer order
}

StatusOr<std::unique_ptr<Graph>> Graph::Build(const Config& config, const Topology& topology,
                                              const RankCoordinates& coords) {
  if (!config.model || !config.run) {
    return Status::Error(config.model ? "run" : "model",
                         "is required by mpusim run (see docs/simulator.md)");
  }
  const DerivedSizes& sizes = topology.sizes();
  if (sizes.cp != 1) {
    return Status::Error("parallel.context_parallel_size",
                         fmt::format("mpusim run does not simulate context parallelism; "
                                     "context_parallel_size must be 1, got {}",
                                     sizes.cp));
  }
  if (topology.first_rank() != 0) {
    return Status::Error("parallel.rank_offset", "mpusim run needs rank_offset 0");
  }
  if (config.run->recompute == RunConfig::Recompute::kSelective) {
    return Status::Error("run.recompute_granularity",
                         "\"selective\" recomputes core attention, which a layer chain does not "
                         "have; use \"full\" or null");
  }
  auto impl = std::make_unique<Impl>();
  impl->parallel = config.parallel;
  impl->model = *config.model;
  impl->run = *config.run;
  MPUSIM_RETURN_IF_ERROR(impl->Plan(topology));
  if (sizes.pp > 1) {
    StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(
        sizes.pp, config.parallel.virtual_pipeline_model_parallel_size,
        config.run->num_microbatches, config.parallel.microbatch_group_size_per_vp_stage);
    if (!schedule.ok()) return schedule.status();
  }
  std::unique_ptr<Graph> graph(new Graph(std::move(impl)));
  graph->config_ = config;
  graph->topology_ = &topology;
  graph->coords_ = coords;
  return graph;
}

Graph::Graph(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Graph::~Graph() = default;

int64_t Graph::padded_vocab_size() const { return impl_->padded_vocab; }
const std::vector<std::string>& Graph::warnings() const { return impl_->warnings; }
bool Graph::has_loss() const { return impl_->has_loss; }
double Graph::loss() const {
  return impl_->loss_sum / static_cast<double>(impl_->run.num_microbatches);
}

std::vector<Graph::PlannedLayer> Graph::Plan(const RankCoordinates& coords) const {
  std::vector<PlannedLayer> out;
  for (const LayerSlot& slot : impl_->layers) {
    PlannedLayer layer{slot.config.name,
                       LayerTypeName(slot.config.type),
                       slot.in_state,
                       slot.out_state,
                       slot.in_width,
                       slot.out_width,
                       {},
                       impl_->PipelineRankOf(slot.stage),
                       slot.stage / impl_->pp_size,
                       !slot.owns_weight && slot.weight != nullptr ? slot.weight->name : ""};
    for (const ChainParameter* p : {slot.owns_weight ? slot.weight : nullptr, slot.bias}) {
      if (p == nullptr) continue;
      const ShardSpec shard = impl_->RankShard(*p, coords.tp);
      layer.parameters.push_back({p->name, p->full_shape, LocalShape(shard, p->full_shape), shard,
                                  p->split.dim, p->split.stride});
    }
    out.push_back(std::move(layer));
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Parameters and data

void Graph::InitializeParameters(RankContext& ctx) {
  Impl& g = *impl_;
  g.pp_rank = ctx.coords.pp;
  g.initial_rng = ctx.rng.GetStates();
  g.draws_per_iteration.clear();
  // This rank's layers; a parameter is held where its owner runs and where a tied user runs.
  for (auto& p : g.parameters) p->held = g.PipelineRankOf(p->owner_stage) == g.pp_rank;
  for (const LayerSlot& slot : g.layers) {
    if (g.PipelineRankOf(slot.stage) != g.pp_rank) continue;
    if (slot.config.type == LayerType::kDropout) {
      g.draws_per_iteration[slot.rng_stream] += static_cast<uint64_t>(g.run.num_microbatches);
    }
    if (slot.weight != nullptr && !slot.weight->held) {
      slot.weight->held = true;
      slot.weight->shared = true;  // the last stage's copy: left out of the gradient norm
    }
  }
  for (auto& p : g.parameters) {
    if (!p->held) continue;
    p->shard = g.RankShard(*p, ctx.coords.tp);
    const Shape local = LocalShape(p->shard, p->full_shape);
    Tensor host = Tensor::HostZeros(local, g.run.dtype);
    if (!p->zero_init) FillShard(g.run.seed, p->name, p->init, p->full_shape, p->shard, host);
    p->value = ctx.kernels->ToDevice(host);
    if (!p->frozen) p->grad = ctx.kernels->Zeros(local, ComputeDType(g.run.dtype));
  }
}

Batch Graph::Impl::MakeBatch(RankContext& ctx, int64_t m, bool tokens, bool labels) const {
  Batch batch;
  batch.microbatch = m;
  ctx.trace->SetPhase(Phase::kOther);
  ctx.trace->SetSite("broadcast_data");
  const int64_t s = run.seq_length, b = run.micro_batch_size, B = b * d;
  batch.token_scale = 1.0 / static_cast<double>(run.num_microbatches * s * B);
  // Megatron's broadcast_data: the first rank of each tp group makes its data-parallel
  // slice and broadcasts it (int64, as torch.int64 there) to the group; the kernels then
  // read the ids on the device.
  auto make = [&](const char* stream, Tensor* out) {
    Tensor host = Tensor::HostZeros({s, b}, DType::kInt64);
    if (ctx.coords.tp == 0) {
      int64_t* v = host.data_as<int64_t>();
      const std::string name = fmt::format("{}.mb{}", stream, m);
      for (int64_t i = 0; i < s; ++i) {
        for (int64_t j = 0; j < b; ++j) {
          const int64_t g = ctx.coords.dp * b + j;
          v[i * b + j] = TokenAt(run.seed, name, i * B + g, *model.vocab_size);
        }
      }
    }
    *out = ctx.kernels->ToDevice(host);
    BroadcastData(ctx.tp(), {out});
  };
  if (tokens) make("tokens", &batch.tokens);
  if (labels) make("labels", &batch.labels);
  return batch;
}

Tensor Graph::Impl::SyntheticActivation(RankContext& ctx, const std::string& name,
                                        ActivationState state, int64_t width, DType dtype) {
  if (const auto it = synthetic_cache.find(name); it != synthetic_cache.end()) return it->second;
  const Shape full = {run.seq_length, run.micro_batch_size * d, width};
  const ShardSpec spec = ActivationSpec(state, ctx.coords, t, d);
  Tensor host = Tensor::HostZeros(LocalShape(spec, full), dtype);
  FillShard(run.seed, name, InitSpec{InitMethod::kNormal, 1.0}, full, spec, host);
  Tensor device = ctx.kernels->ToDevice(host);
  // A partial-sum input: every rank holds input / t, so that the sum is the input.
  if (state.split == Split::kPartialSum) ctx.kernels->Scale(1.0 / static_cast<double>(t), device);
  synthetic_cache.emplace(name, device);
  return device;
}

// ---------------------------------------------------------------------------------------
// Layers

Tensor Graph::Impl::Forward(RankContext& ctx, LayerSlot& slot, const Tensor& x,
                            const Batch& batch) {
  Kernels& k = *ctx.kernels;
  const LayerConfig& c = slot.config;
  const DType dtype = run.dtype;
  const int64_t s = run.seq_length, b = run.micro_batch_size;
  slot.input = x;
  switch (c.type) {
    case LayerType::kVocabParallelEmbedding: {
      // Masked lookup in this rank's vocabulary rows, then sum over tp (each token's row
      // lives on exactly one rank).
      const auto [first, last] =
          VocabRangeFromPerPartitionVocabSize(slot.weight->value.shape()[0], ctx.coords.tp);
      Tensor y = k.Zeros({s, b, c.embedding_dim}, dtype);
      k.EmbeddingForward(slot.weight->value, batch.tokens, first, last, y);
      if (sequence_parallel) return ReduceScatterFirstDim(k, ctx.tp(), y);
      return MappingForward(k, ctx.tp(), Mapping::kReduceFromTp, y);
    }
    case LayerType::kParallelEmbedding: {
      const int64_t rows = slot.weight->value.shape()[0];
      Tensor y = k.Zeros({s, b, c.embedding_dim / t}, dtype);
      k.EmbeddingForward(slot.weight->value, batch.tokens, 0, rows, y);
      return AllGatherLastDim(k, ctx.tp(), y);
    }
    case LayerType::kColumnParallelLinear: {
      // copy_to_tensor_model_parallel_region (identity), or the sequence-parallel all-gather.
      slot.saved = sequence_parallel ? AllGatherFirstDim(k, ctx.tp(), x) : x;
      const Tensor& w = slot.weight->value;
      Shape shape = slot.saved.shape();
      shape.back() = w.shape()[0];
      Tensor y = k.Empty(shape, dtype);
      k.Gemm(false, true, 1.0, slot.saved, w, 0.0, y);
      if (slot.bias != nullptr && !c.skip_bias_add) k.AddRowVector(slot.bias->value, y);
      return c.gather_output ? AllGatherLastDim(k, ctx.tp(), y) : y;
    }
    case LayerType::kRowParallelLinear: {
      slot.saved = c.input_is_parallel ? x : SplitLastDim(k, ctx.tp(), x);
      const Tensor& w = slot.weight->value;
      Shape shape = slot.saved.shape();
      shape.back() = w.shape()[0];
      Tensor partial = k.Empty(shape, dtype);
      k.Gemm(false, true, 1.0, slot.saved, w, 0.0, partial);
      Tensor y = sequence_parallel ? ReduceScatterFirstDim(k, ctx.tp(), partial)
                                   : MappingForward(k, ctx.tp(), Mapping::kReduceFromTp, partial);
      if (slot.bias != nullptr && !c.skip_bias_add) k.AddRowVector(slot.bias->value, y);
      return y;
    }
    case LayerType::kGeLU: {
      Tensor pre = x;
      if (slot.added_bias != nullptr) {
        pre = k.Empty(x.shape(), dtype);
        k.Copy(x, pre);
        k.AddRowVector(slot.added_bias->value, pre);
      }
      slot.saved = pre;
      Tensor y = k.Empty(x.shape(), dtype);
      k.ActivationForward(Activation::kGelu, pre, y);
      return y;
    }
    case LayerType::kDropout: {
      slot.draw = ctx.rng.Draw(slot.rng_stream);
      Tensor y = k.Empty(x.shape(), dtype);
      k.Dropout(x, c.p, slot.draw.key, slot.draw.subsequence, 0, y);
      return y;
    }
    case LayerType::kVocabParallelCrossEntropy: {
      CrossEntropyStash stash;
      const Tensor losses = VocabParallelCrossEntropyForward(
          k, ctx.tp(), x, batch.labels, padded_vocab, c.label_smoothing, &stash);
      slot.row_max = stash.row_max;
      slot.sum_exp = stash.sum_exp;
      return losses.Reshaped({s, b});
    }
    default:
      return MappingForward(k, ctx.tp(), *MappingOf(c.type), x);
  }
}

Tensor Graph::Impl::Backward(RankContext& ctx, LayerSlot& slot, const Tensor& dy,
                             const Batch& batch) {
  Kernels& k = *ctx.kernels;
  const LayerConfig& c = slot.config;
  const DType dtype = run.dtype;
  switch (c.type) {
    case LayerType::kVocabParallelEmbedding: {
      if (slot.weight->frozen) return Tensor();
      // Embedding gradients are scattered straight into main_grad (float32 under 16-bit
      // storage): one rounding fewer than torch's bf16 weight.grad followed by the DDP add.
      const Tensor full = sequence_parallel ? AllGatherFirstDim(k, ctx.tp(), dy) : dy;
      const auto [first, last] =
          VocabRangeFromPerPartitionVocabSize(slot.weight->value.shape()[0], ctx.coords.tp);
      k.EmbeddingBackward(full, batch.tokens, first, last, slot.weight->grad);
      return Tensor();
    }
    case LayerType::kParallelEmbedding: {
      if (slot.weight->frozen) return Tensor();
      const Tensor local = SplitLastDim(k, ctx.tp(), dy);
      k.EmbeddingBackward(local, batch.tokens, 0, slot.weight->value.shape()[0],
                          slot.weight->grad);
      return Tensor();
    }
    case LayerType::kColumnParallelLinear: {
      const Tensor d_local = c.gather_output ? SplitLastDim(k, ctx.tp(), dy) : dy;
      const Tensor& w = slot.weight->value;
      Tensor dx_total = k.Empty(slot.saved.shape(), dtype);
      k.Gemm(false, false, 1.0, d_local, w, 0.0, dx_total);  // [R, out/t] @ [out/t, in]
      if (!slot.weight->frozen) {
        AccumulateGrad(k, *slot.weight, fuse_wgrad, [&](Tensor& g, double beta) {
          k.Gemm(true, false, 1.0, d_local, slot.saved, beta, g);
        });
      }
      if (slot.bias != nullptr && !c.skip_bias_add && !slot.bias->frozen) {
        AccumulateGrad(k, *slot.bias, false,
                       [&](Tensor& g, double beta) { k.SumRows(d_local, beta, g); });
      }
      // Backward of the input mapping: reduce-scatter (sequence parallel) or the
      // all-reduce of copy_to_tensor_model_parallel_region.
      return sequence_parallel ? ReduceScatterFirstDim(k, ctx.tp(), dx_total)
                               : MappingBackward(k, ctx.tp(), Mapping::kCopyToTp, dx_total);
    }
    case LayerType::kRowParallelLinear: {
      const Tensor d_total = sequence_parallel ? AllGatherFirstDim(k, ctx.tp(), dy) : dy;
      const Tensor& w = slot.weight->value;
      Tensor dx_local = k.Empty(slot.saved.shape(), dtype);
      k.Gemm(false, false, 1.0, d_total, w, 0.0, dx_local);  // [R, out] @ [out, in/t]
      if (!slot.weight->frozen) {
        AccumulateGrad(k, *slot.weight, fuse_wgrad, [&](Tensor& g, double beta) {
          k.Gemm(true, false, 1.0, d_total, slot.saved, beta, g);
        });
      }
      if (slot.bias != nullptr && !c.skip_bias_add) {
        AccumulateGrad(k, *slot.bias, false, [&](Tensor& g, double beta) { k.SumRows(dy, beta, g); });
      }
      return c.input_is_parallel ? dx_local
                                 : AllGatherLastDim(k, ctx.tp(), dx_local);
    }
    case LayerType::kGeLU: {
      Tensor dx = k.Empty(dy.shape(), dtype);
      k.ActivationBackward(Activation::kGelu, slot.saved, dy, dx);
      if (slot.added_bias != nullptr) {
        AccumulateGrad(k, *slot.added_bias, false,
                       [&](Tensor& g, double beta) { k.SumRows(dx, beta, g); });
      }
      return dx;
    }
    case LayerType::kDropout: {
      Tensor dx = k.Empty(dy.shape(), dtype);
      k.Dropout(dy, c.p, slot.draw.key, slot.draw.subsequence, 0, dx);
      return dx;
    }
    case LayerType::kVocabParallelCrossEntropy: {
      // dy holds d loss / d per-token loss.
      return VocabParallelCrossEntropyBackward(k, {slot.input, slot.row_max, slot.sum_exp},
                                               batch.labels, padded_vocab, c.label_smoothing,
                                               ctx.coords.tp, dy);
    }
    default:
      return MappingBackward(k, ctx.tp(), *MappingOf(c.type), dy, c.tensor_parallel_output_grad);
  }
}

Tensor Graph::Impl::ForwardLayers(RankContext& ctx, int64_t first, int64_t end, Tensor x,
                                  const Batch& batch, bool count_loss) {
  ctx.trace->SetPhase(Phase::kForward);
  const LayerSlot& head = layers.front();
  if (first == 0 && !IsEmbedding(head.config.type)) {
    x = SyntheticActivation(ctx, fmt::format("input.mb{}", batch.microbatch), head.in_state,
                            head.in_width, run.dtype);
  }
  for (int64_t i = first; i < end; ++i) {
    LayerSlot& slot = layers[static_cast<size_t>(i)];
    ctx.trace->SetSite(slot.config.name);
    slot.output = Forward(ctx, slot, x, batch);
    x = slot.output;
  }
  const bool ends_with_loss = end == static_cast<int64_t>(layers.size()) &&
                              layers.back().config.type == LayerType::kVocabParallelCrossEntropy;
  if (!ends_with_loss || !count_loss) return x;
  // Mean token loss over this micro-batch's s * B tokens: local sum, summed over dp.
  const Tensor host = ctx.kernels->ToHost(x);
  double local = 0;
  for (int64_t i = 0; i < host.numel(); ++i) local += HostValue(host, i);
  Tensor sum = Tensor::HostZeros({1}, DType::kFloat64);
  sum.data_as<double>()[0] = local;
  Tensor device = ctx.kernels->ToDevice(sum);
  ctx.trace->SetPhase(Phase::kOther);
  ctx.trace->SetSite("loss");
  if (d > 1) ctx.dp().AllReduce(device, ReduceOp::kSum);
  const double total = ctx.kernels->ToHost(device).data_as<double>()[0];
  loss_sum += total / static_cast<double>(run.seq_length * run.micro_batch_size * d);
  return x;
}

Tensor Graph::Impl::BackwardLayers(RankContext& ctx, int64_t first, int64_t end, Tensor dy,
                                   const Batch& batch) {
  ctx.trace->SetPhase(Phase::kBackward);
  if (end == static_cast<int64_t>(layers.size())) {
    LayerSlot& last = layers.back();
    if (last.config.type == LayerType::kVocabParallelCrossEntropy) {
      Tensor host = Tensor::HostZeros(last.output.shape(), last.output.dtype());
      for (int64_t i = 0; i < host.numel(); ++i) SetHostValue(host, i, batch.token_scale);
      dy = ctx.kernels->ToDevice(host);
    } else {
      dy = SyntheticActivation(ctx, fmt::format("output_grad.mb{}", batch.microbatch),
                               last.out_state, last.out_width, run.dtype);
    }
  }
  for (int64_t i = end; i-- > first;) {
    LayerSlot& slot = layers[static_cast<size_t>(i)];
    ctx.trace->SetSite(slot.config.name);
    slot.output_grad = dy;
    dy = Backward(ctx, slot, dy, batch);
    slot.input_grad = dy;
  }
  return dy;
}

Tensor Graph::Impl::ForwardStep(const StepCall& call, const Tensor& input, Stash& stash) {
  RankContext& ctx = call.ctx;
  const int64_t m = call.microbatch;
  const int64_t first = First(call.chunk), end = End(call.chunk);
  const auto n = static_cast<int64_t>(layers.size());
  // Micro-batch m of iteration k reads the data of global micro-batch k*M + m.
  stash.batch = MakeBatch(ctx, current_iteration * run.num_microbatches + m,
                          first == 0 && needs_tokens, end == n && needs_labels);
  stash.input = input;
  stash.rng_before = ctx.rng.GetStates();
  const Tensor output = ForwardLayers(ctx, first, end, input, stash.batch, true);
  for (int64_t i = first; i < end; ++i) {
    LayerSlot& slot = layers[static_cast<size_t>(i)];
    // Activation checkpointing keeps only the chunk's input (and the tracker's state).
    if (run.recompute != RunConfig::Recompute::kFull) stash.slots.push_back(slot);
    static_cast<SlotTensors&>(slot) = SlotTensors();
  }
  return end == n ? Tensor() : output;
}

Tensor Graph::Impl::BackwardStep(const StepCall& call, const Tensor& output_grad,
                                 Stash& stash) {
  RankContext& ctx = call.ctx;
  const int64_t m = call.microbatch;
  const int64_t first = First(call.chunk), end = End(call.chunk);
  if (run.recompute == RunConfig::Recompute::kFull) {
    // Recompute the chunk's forward with the random streams as they were (Megatron's
    // CheckpointFunction), then put the streams back. Its collectives are real: they stay in
    // the trace, as forward.
    const SpanRecorder recompute(*call.spans, call.chunk, m, true, true);
    const RngTracker::States now = ctx.rng.GetStates();
    ctx.rng.SetStates(stash.rng_before);
    ForwardLayers(ctx, first, end, stash.input, stash.batch, false);
    ctx.rng.SetStates(now);
  } else {
    for (int64_t i = first; i < end; ++i) {
      static_cast<SlotTensors&>(layers[static_cast<size_t>(i)]) =
          stash.slots[static_cast<size_t>(i - first)];
    }
  }
  const Tensor input_grad = BackwardLayers(ctx, first, end, output_grad, stash.batch);
  if (m + 1 == run.num_microbatches) {
    // The last micro-batch's tensors stay for the records; tokens and labels as float64
    // [s, b] (what dumps and the check hold).
    if (stash.batch.tokens.defined()) {
      last_tokens = HostToFloat64(ctx.kernels->ToHost(stash.batch.tokens));
    }
    if (stash.batch.labels.defined()) {
      last_labels = HostToFloat64(ctx.kernels->ToHost(stash.batch.labels));
    }
  } else {
    for (int64_t i = first; i < end; ++i) {
      static_cast<SlotTensors&>(layers[static_cast<size_t>(i)]) = SlotTensors();
    }
  }
  return first == 0 ? Tensor() : input_grad;
}

std::vector<Parameter*> Graph::TrainableParameters() const {
  std::vector<Parameter*> out;
  for (const auto& p : impl_->parameters) {
    if (p->held && !p->frozen) out.push_back(p.get());
  }
  return out;
}

void Graph::BeginStep(RankContext& ctx, int64_t iteration, bool /*record*/) {
  Impl& g = *impl_;
  // Megatron's tracker keeps advancing from step to step: iteration k starts where k
  // iterations of draws left it (a repeated step starts where its iteration does).
  ctx.rng.SetStates(g.RngAtIteration(iteration));
  if (g.synthetic_iteration != iteration) {
    g.synthetic_cache.clear();
    g.synthetic_iteration = iteration;
  }
  g.current_iteration = iteration;
  // A new step: the previous step's activations are released before any new one is made (so
  // a repeated step reuses their memory instead of holding two steps' worth), and main_grad
  // starts from zero (Megatron's zero_grad_buffer), so every step computes the same gradients.
  for (LayerSlot& slot : g.layers) static_cast<SlotTensors&>(slot) = SlotTensors();
  for (auto& p : g.parameters) {
    if (p->held && !p->frozen) ctx.kernels->SetZero(p->grad);
  }
  g.loss_sum = 0;
  g.has_loss = g.layers.back().config.type == LayerType::kVocabParallelCrossEntropy;
}

int64_t Graph::num_model_chunks() const { return impl_->vp_size; }

// The activations and gradients at the chunk boundaries, each in its layer's state on the tp
// group: an activation enters the first layer of the virtual stage consuming it (on the
// receiving rank), a gradient the output of its last.
std::pair<Shape, DType> Graph::TransferShape(const RankContext& ctx, const Transfer& t) const {
  const Impl& g = *impl_;
  const int64_t receiver = t.send ? t.peer : g.pp_rank;
  const auto u = static_cast<size_t>(t.model_chunk * g.pp_size + receiver);
  const bool activation = t.kind == Transfer::Kind::kActivation;
  const LayerSlot& at =
      g.layers[static_cast<size_t>(activation ? g.stage_start[u] : g.stage_start[u + 1] - 1)];
  return {activation ? g.LocalActivationShape(at.in_state, at.in_width, ctx.coords)
                     : g.LocalActivationShape(at.out_state, at.out_width, ctx.coords),
          g.run.dtype};
}

std::unique_ptr<StepStash> Graph::NewStash(int64_t /*chunk*/) const {
  return std::make_unique<Impl::Stash>();
}

Tensor Graph::ForwardStep(const StepCall& call, const Tensor& input, StepStash& stash) {
  return impl_->ForwardStep(call, input, static_cast<Impl::Stash&>(stash));
}

Tensor Graph::BackwardStep(const StepCall& call, const Tensor& output_grad, StepStash& stash) {
  return impl_->BackwardStep(call, output_grad, static_cast<Impl::Stash&>(stash));
}

void Graph::EndStep(RankContext& ctx) {
  Impl& g = *impl_;
  if (ctx.rng.GetStates() != g.RngAtIteration(g.current_iteration + 1)) {
    throw std::logic_error(
        fmt::format("Graph: the RNG tracker did not advance by one iteration's draws "
                    "in iteration {}",
                    g.current_iteration));
  }
  if (g.pp_size > 1 && g.has_loss) {
    // The loss: the last stage computed it, the others add 0.
    Tensor total = Tensor::HostZeros({1}, DType::kFloat64);
    total.data_as<double>()[0] = g.loss_sum;
    Tensor device = ctx.kernels->ToDevice(total);
    ctx.trace->SetSite("loss");
    ctx.pp().AllReduce(device, ReduceOp::kSum);
    g.loss_sum = ctx.kernels->ToHost(device).data_as<double>()[0];
  }
}

void Graph::Records(RankContext& ctx, std::vector<TensorRecord>* records) const {
  std::vector<TensorRecord> mine = Records(ctx);
  records->insert(records->end(), std::make_move_iterator(mine.begin()),
                  std::make_move_iterator(mine.end()));
}

std::vector<TensorRecord> Graph::Records(RankContext& ctx) const {
  const Impl& g = *impl_;
  std::vector<TensorRecord> out;
  const int64_t s = g.run.seq_length, B = g.run.micro_batch_size * g.d;
  auto activation = [&](const std::string& name, const Tensor& tensor, ActivationState state,
                        int64_t width) {
    if (!tensor.defined()) return;
    TensorRecord r{name, tensor, {s, B, width}, ActivationSpec(state, ctx.coords, g.t, g.d),
                   state.split == Split::kPartialSum};
    out.push_back(std::move(r));
  };
  // A gradient is held as its activation is (in full when replicated, the rank's shard when
  // split), except for a partial sum's: d(sum)/d(part) is the identity, so every rank holds
  // the same full gradient, replicated (the input gradient of a chain that starts with
  // reduce_from or reduce_scatter).
  auto gradient = [&](const std::string& name, const Tensor& tensor, ActivationState state,
                      int64_t width) {
    if (state.split == Split::kPartialSum) state = ActivationState{Split::kReplicated, 1};
    activation(name, tensor, state, width);
  };
  ShardSpec batch_split;
  batch_split.Split(ShardAxis::kDp, 1, g.d, ctx.coords.dp);
  if (g.last_tokens.defined()) {
    out.push_back({"tokens", ctx.kernels->ToDevice(g.last_tokens), {s, B}, batch_split, false});
  }
  if (g.last_labels.defined()) {
    out.push_back({"labels", ctx.kernels->ToDevice(g.last_labels), {s, B}, batch_split, false});
  }
  for (const LayerSlot& slot : g.layers) {
    const std::string& n = slot.config.name;
    const bool embedding = IsEmbedding(slot.config.type);
    if (!embedding) {
      activation(n + ".input", slot.input, slot.in_state, slot.in_width);
      gradient(n + ".input_grad", slot.input_grad, slot.in_state, slot.in_width);
    }
    if (slot.config.type == LayerType::kVocabParallelCrossEntropy) {
      if (slot.output.defined()) {  // on the last pipeline stage
        out.push_back({n + ".output", slot.output, {s, B}, batch_split, false});
        out.push_back({n + ".output_grad", slot.output_grad, {s, B}, batch_split, false});
      }
    } else {
      activation(n + ".output", slot.output, slot.out_state, slot.out_width);
      gradient(n + ".output_grad", slot.output_grad, slot.out_state, slot.out_width);
    }
    for (const ChainParameter* p : {slot.owns_weight ? slot.weight : nullptr, slot.bias}) {
      if (p == nullptr || !p->held) continue;
      out.push_back({p->name, p->value, p->full_shape, p->shard, false});
      if (!p->frozen) out.push_back({p->name + "_grad", p->grad, p->full_shape, p->shard, false});
    }
  }
  if (g.has_loss) {
    Tensor loss = Tensor::HostZeros({1}, DType::kFloat64);
    loss.data_as<double>()[0] = this->loss();
    out.push_back({"loss", ctx.kernels->ToDevice(loss), {1}, ShardSpec{}, false});
  }
  return out;
}

}  // namespace mpusim
