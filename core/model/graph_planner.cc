// The layer chain's plan (see graph.h and graph_impl.h): Build checks that the layers fit
// together for the layout and plans, for each layer, the activation state and width it
// receives and produces, its parameters and how tp splits them, and its pipeline stage; then
// the ties between stages and the plan-time warnings.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/model/graph.h"
#include "core/model/graph_impl.h"
#include "core/schedule.h"

namespace mpusim {

using chain::ChainParameter;
using chain::IsEmbedding;
using chain::LayerSlot;
using chain::MappingOf;
using chain::TpSplitPlan;
using Split = ActivationState::Split;

namespace {

// Plans one layer (Graph::Impl::PlanLayer): checks the state and width it receives, adds its
// parameters, and leaves the state and width it produces in `state` and `width`. One method
// per kind of layer; errors name "model.layers[i]" (Graph::Impl::Fail).
class LayerPlanner {
 public:
  LayerPlanner(Graph::Impl& g, LayerSlot& slot, ActivationState& state, int64_t& width)
      : g_(g), slot_(slot), state_(state), width_(width) {}

  // The layer's kind's method below.
  Status Run();

 private:
  Status Embedding(bool vocab_parallel);
  Status ColumnParallelLinear();
  Status RowParallelLinear();
  Status GeLU();
  Status Dropout();
  Status VocabParallelCrossEntropy();
  Status RegionMapping();
  Status Fail(const std::string& what) const { return g_.Fail(slot_, what); }
  Status RequireState(std::initializer_list<Split> allowed) const {
    for (Split a : allowed) {
      if (state_.split == a) return {};
    }
    std::vector<std::string> names;
    for (Split a : allowed) names.emplace_back(SplitName(a));
    return Fail(fmt::format("receives a {} activation but accepts only: {}",
                            SplitName(state_.split), fmt::join(names, ", ")));
  }
  Status RequireDivisible(int64_t value, int64_t by, const std::string& what) const {
    if (value % by != 0) {
      return Fail(fmt::format("{} ({}) must be divisible by {}", what, value, by));
    }
    return {};
  }
  Status RequireWidth(int64_t expected, const char* field) const {
    if (width_ != expected) {
      return Fail(fmt::format("{} is {} but the incoming activation has width {}", field, expected,
                              width_));
    }
    return {};
  }
  Status RequireSequenceDivisible() const {
    return RequireDivisible(g_.run.seq_length, g_.t, "run.seq_length under sequence parallelism");
  }

  Graph::Impl& g_;
  LayerSlot& slot_;
  ActivationState& state_;
  int64_t& width_;
};

// VocabParallelEmbedding splits the rows (the vocabulary) over tp and, under sequence
// parallelism, scatters its output by sequence; ParallelEmbedding splits the columns and
// produces a replicated activation.
Status LayerPlanner::Embedding(bool vocab_parallel) {
  Graph::Impl& g = g_;
  const LayerConfig& c = slot_.config;
  const int64_t rows = c.num_embeddings.Resolve(g.padded_vocab);
  if (rows < *g.model.vocab_size) {
    return Fail(fmt::format("num_embeddings ({}) is smaller than model.vocab_size ({})", rows,
                            *g.model.vocab_size));
  }
  MPUSIM_RETURN_IF_ERROR(vocab_parallel ? RequireDivisible(rows, g.t, "num_embeddings")
                                        : RequireDivisible(c.embedding_dim, g.t, "embedding_dim"));
  const TpSplitPlan split = vocab_parallel ? TpSplitPlan{0, 1} : TpSplitPlan{1, 1};
  slot_.weight = g.AddParameter(c.name + ".weight", {rows, c.embedding_dim}, split, c, false);
  slot_.owns_weight = true;
  state_.split = Split::kReplicated;
  if (vocab_parallel && g.sequence_parallel) {
    MPUSIM_RETURN_IF_ERROR(RequireSequenceDivisible());
    state_.split = Split::kSequence;
  }
  width_ = c.embedding_dim;
  g.needs_tokens = true;
  return {};
}

Status LayerPlanner::ColumnParallelLinear() {
  Graph::Impl& g = g_;
  LayerSlot& slot = slot_;
  const LayerConfig& c = slot.config;
  ActivationState& state = state_;
  int64_t& width = width_;
  const int64_t t = g.t;
  if (g.sequence_parallel) {
    MPUSIM_RETURN_IF_ERROR(RequireState({Split::kSequence}));
    MPUSIM_RETURN_IF_ERROR(RequireSequenceDivisible());
    if (c.gather_output) {
      return Fail(
          "gather_output cannot be used with sequence_parallel (Megatron "
          "refuses it too); set gather_output to false");
    }
  } else {
    MPUSIM_RETURN_IF_ERROR(RequireState({Split::kReplicated}));
  }
  MPUSIM_RETURN_IF_ERROR(RequireWidth(c.input_size, "input_size"));
  const int64_t out = c.output_size.Resolve(g.padded_vocab);
  MPUSIM_RETURN_IF_ERROR(RequireDivisible(out, t * c.stride,
                                          "output_size / (tensor_model_parallel_size * "
                                          "stride): output_size"));
  if (c.gather_output && c.stride > 1) {
    return Fail(
        "gather_output with stride > 1 would leave the gathered columns in "
        "strided order; use gather_output false");
  }
  const TpSplitPlan split{0, c.stride};
  if (c.skip_weight_param_allocation) {
    LayerSlot* owner = g.FindLayer(c.weight_from);
    if (owner == nullptr || owner->weight == nullptr) {
      return Fail(
          fmt::format("weight_from '{}' is not an earlier layer with a weight", c.weight_from));
    }
    const Shape want = {out, c.input_size};
    if (owner->weight->full_shape != want || owner->weight->split != split) {
      return Fail(
          fmt::format("weight_from '{}' has shape {} split on dim {}, but "
                      "this layer needs {} split on dim 0 with stride {}",
                      c.weight_from, ShapeString(owner->weight->full_shape),
                      owner->weight->split.dim, ShapeString(want), c.stride));
    }
    slot.weight = owner->weight;
  } else {
    slot.weight = g.AddParameter(c.name + ".weight", {out, c.input_size}, split, c, false);
    slot.owns_weight = true;
  }
  if (c.bias) {
    slot.bias = g.AddParameter(c.name + ".bias", {out}, split, c, true);
  }
  if (c.gather_output) {
    state = ActivationState{Split::kReplicated, 1};
  } else {
    state = ActivationState{Split::kHidden, c.stride};
  }
  width = out;
  return {};
}

Status LayerPlanner::RowParallelLinear() {
  Graph::Impl& g = g_;
  LayerSlot& slot = slot_;
  const LayerConfig& c = slot.config;
  ActivationState& state = state_;
  int64_t& width = width_;
  const int64_t t = g.t;
  const TpSplitPlan replicated;
  if (c.input_is_parallel) {
    MPUSIM_RETURN_IF_ERROR(RequireState({Split::kHidden}));
    if (state.stride != c.stride) {
      return Fail(
          fmt::format("its input is split with stride {} but the layer's "
                      "stride is {}; they must match",
                      state.stride, c.stride));
    }
  } else {
    MPUSIM_RETURN_IF_ERROR(RequireState({Split::kReplicated}));
    if (c.stride != 1) {
      return Fail(
          "stride > 1 needs input_is_parallel (the scatter splits "
          "contiguously)");
    }
  }
  MPUSIM_RETURN_IF_ERROR(RequireWidth(c.input_size, "input_size"));
  MPUSIM_RETURN_IF_ERROR(RequireDivisible(c.input_size, t * c.stride,
                                          "input_size / (tensor_model_parallel_size * "
                                          "stride): input_size"));
  const int64_t out = c.output_size.Resolve(g.padded_vocab);
  slot.weight = g.AddParameter(c.name + ".weight", {out, c.input_size}, {1, c.stride}, c, false);
  slot.owns_weight = true;
  if (c.bias) {
    slot.bias = g.AddParameter(c.name + ".bias", {out}, replicated, c, true);
    slot.bias->sequence_parallel = g.sequence_parallel;
  }
  if (g.sequence_parallel) {
    MPUSIM_RETURN_IF_ERROR(RequireSequenceDivisible());
    state = ActivationState{Split::kSequence, 1};
  } else {
    state = ActivationState{Split::kReplicated, 1};
  }
  width = out;
  return {};
}

Status LayerPlanner::GeLU() {
  Graph::Impl& g = g_;
  LayerSlot& slot = slot_;
  const LayerConfig& c = slot.config;
  ActivationState& state = state_;
  int64_t& width = width_;
  MPUSIM_RETURN_IF_ERROR(RequireState({Split::kReplicated, Split::kHidden, Split::kSequence}));
  if (!c.bias_from.empty()) {
    LayerSlot* owner = g.FindLayer(c.bias_from);
    if (owner == nullptr || owner->bias == nullptr || !owner->config.skip_bias_add) {
      return Fail(
          fmt::format("bias_from '{}' must name an earlier linear layer with "
                      "bias and skip_bias_add",
                      c.bias_from));
    }
    if (owner->bias->full_shape[0] != width) {
      return Fail(
          fmt::format("bias_from '{}' has {} elements but the activation has "
                      "width {}",
                      c.bias_from, owner->bias->full_shape[0], width));
    }
    const bool bias_split = owner->bias->split.dim == 0;
    if (bias_split != (state.split == Split::kHidden)) {
      return Fail(fmt::format("bias_from '{}' is {} but the activation is {}", c.bias_from,
                              bias_split ? "split" : "replicated", SplitName(state.split)));
    }
    slot.added_bias = owner->bias;
  }
  return {};
}

Status LayerPlanner::Dropout() {
  MPUSIM_RETURN_IF_ERROR(RequireState({Split::kReplicated, Split::kHidden, Split::kSequence}));
  slot_.rng_stream = state_.split == Split::kReplicated ? kDefaultStream : kModelParallelStream;
  return {};
}

Status LayerPlanner::VocabParallelCrossEntropy() {
  MPUSIM_RETURN_IF_ERROR(RequireState({Split::kHidden}));
  if (state_.stride != 1) return Fail("the logits must be split with stride 1");
  MPUSIM_RETURN_IF_ERROR(RequireWidth(g_.padded_vocab, "padded_vocab_size"));
  if (slot_.config.label_smoothing > 0 && g_.padded_vocab < 2) {
    return Fail("label smoothing needs at least 2 vocabulary entries");
  }
  g_.needs_labels = true;
  state_ = ActivationState{Split::kReplicated, 1};
  width_ = 0;
  return {};
}

Status LayerPlanner::RegionMapping() {
  Graph::Impl& g = g_;
  LayerSlot& slot = slot_;
  const LayerConfig& c = slot.config;
  ActivationState& state = state_;
  int64_t& width = width_;
  const int64_t t = g.t;
  const Mapping mapping = *MappingOf(c.type);
  switch (mapping) {
    case Mapping::kCopyToTp:
      MPUSIM_RETURN_IF_ERROR(RequireState({Split::kReplicated}));
      break;
    case Mapping::kReduceFromTp:
      MPUSIM_RETURN_IF_ERROR(RequireState({Split::kPartialSum}));
      state = ActivationState{Split::kReplicated, 1};
      break;
    case Mapping::kScatterToTp:
      MPUSIM_RETURN_IF_ERROR(RequireState({Split::kReplicated}));
      MPUSIM_RETURN_IF_ERROR(RequireDivisible(width, t, "the activation width"));
      state = ActivationState{Split::kHidden, 1};
      break;
    case Mapping::kGatherFromTp:
      MPUSIM_RETURN_IF_ERROR(RequireState({Split::kHidden}));
      if (state.stride != 1) return Fail("cannot gather a strided split");
      state = ActivationState{Split::kReplicated, 1};
      break;
    case Mapping::kScatterToSp:
      MPUSIM_RETURN_IF_ERROR(RequireState({Split::kReplicated}));
      MPUSIM_RETURN_IF_ERROR(RequireDivisible(g.run.seq_length, t, "run.seq_length"));
      state = ActivationState{Split::kSequence, 1};
      break;
    case Mapping::kGatherFromSp:
      MPUSIM_RETURN_IF_ERROR(RequireState({Split::kSequence}));
      state = ActivationState{Split::kReplicated, 1};
      break;
    case Mapping::kReduceScatterToSp:
      MPUSIM_RETURN_IF_ERROR(RequireState({Split::kPartialSum}));
      MPUSIM_RETURN_IF_ERROR(RequireDivisible(g.run.seq_length, t, "run.seq_length"));
      state = ActivationState{Split::kSequence, 1};
      break;
  }
  return {};
}

Status LayerPlanner::Run() {
  switch (slot_.config.type) {
    case LayerType::kVocabParallelEmbedding:
      return Embedding(/*vocab_parallel=*/true);
    case LayerType::kParallelEmbedding:
      return Embedding(/*vocab_parallel=*/false);
    case LayerType::kColumnParallelLinear:
      return ColumnParallelLinear();
    case LayerType::kRowParallelLinear:
      return RowParallelLinear();
    case LayerType::kGeLU:
      return GeLU();
    case LayerType::kDropout:
      return Dropout();
    case LayerType::kVocabParallelCrossEntropy:
      return VocabParallelCrossEntropy();
    default:
      return RegionMapping();
  }
}

}  // namespace

Status Graph::Impl::Plan(const Topology& topology) {
  t = topology.sizes().tp;
  d = topology.sizes().dp;
  sequence_parallel = parallel.sequence_parallel;
  fuse_wgrad = parallel.gradient_accumulation_fusion;
  if (model.vocab_size) padded_vocab = model.PaddedVocabSize(t);
  pp_size = topology.sizes().pp;
  vp_size = parallel.virtual_pipeline_model_parallel_size.value_or(1);
  MPUSIM_RETURN_IF_ERROR(PlanStages());
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
    MPUSIM_RETURN_IF_ERROR(PlanLayer(slot, &state, &width));
    layers.push_back(std::move(slot));
  }
  MPUSIM_RETURN_IF_ERROR(PlanTies());
  PlanWarnings();
  return {};
}

// Pipeline stages: the chain's n layers in p * v consecutive runs, as even as they go (stage
// u starts at layer u * n / S; the later stages take the extra layers).
Status Graph::Impl::PlanStages() {
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
  return {};
}

// The state and width a first layer that is not an embedding receives its synthetic input in.
Status Graph::Impl::PlanSyntheticInput(const LayerSlot& slot, ActivationState* state_out,
                                       int64_t* width_out) const {
  const LayerConfig& c = slot.config;
  ActivationState& state = *state_out;
  int64_t& width = *width_out;
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
    case LayerType::kVocabParallelCrossEntropy:
      state.split = Split::kHidden;
      break;
    case LayerType::kGatherFromSequenceParallelRegion:
      state.split = Split::kSequence;
      break;
    default:
      state.split = Split::kReplicated;
  }
  // Layers without a size of their own take the width from the first later layer that
  // fixes it (a linear layer's input_size, or the loss's padded vocabulary).
  for (size_t j = 0; width == 0 && j < model.layers.size(); ++j) {
    const LayerConfig& later = model.layers[j];
    if (later.type == LayerType::kColumnParallelLinear ||
        later.type == LayerType::kRowParallelLinear) {
      width = later.input_size;
    } else if (later.type == LayerType::kVocabParallelCrossEntropy) {
      width = padded_vocab;
    }
  }
  if (width == 0) {
    return Fail(slot,
                "no layer of the chain fixes the width of its synthetic input; add a "
                "linear layer or the loss");
  }
  return {};
}

Status Graph::Impl::PlanLayer(LayerSlot& slot, ActivationState* state, int64_t* width) {
  const LayerConfig& c = slot.config;
  const bool first = slot.index == 0;
  const bool needs_vocab = IsEmbedding(c.type) || c.type == LayerType::kVocabParallelCrossEntropy ||
                           c.output_size.padded_vocab;
  if (needs_vocab && !model.vocab_size) {
    return Fail(slot, "needs model.vocab_size (the vocabulary tokens and labels come from)");
  }
  if (first && !IsEmbedding(c.type)) {
    MPUSIM_RETURN_IF_ERROR(PlanSyntheticInput(slot, state, width));
  }
  slot.in_state = *state;
  slot.in_width = IsEmbedding(c.type) ? 0 : *width;
  if (IsEmbedding(c.type) && !first) {
    return Fail(slot, "an embedding consumes token ids, so it must be the first layer");
  }
  if (!first && layers.back().config.type == LayerType::kVocabParallelCrossEntropy) {
    return Fail(slot, "comes after the loss; VocabParallelCrossEntropy must be the last layer");
  }
  MPUSIM_RETURN_IF_ERROR(LayerPlanner(*this, slot, *state, *width).Run());
  if (state->split == Split::kHidden && *width % (t * state->stride) != 0) {
    return Fail(slot, fmt::format("the output width {} must be divisible by "
                                  "tensor_model_parallel_size * stride = {}",
                                  *width, t * state->stride));
  }
  slot.out_state = *state;
  slot.out_width = *width;
  return {};
}

Status Graph::Impl::PlanTies() {
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
std::vector<std::string> Graph::Warnings() const { return impl_->warnings; }
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

}  // namespace mpusim
