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
using chain::KindOf;
using chain::LayerKind;
using chain::LayerSlot;
using Split = ActivationState::Split;

Status Graph::Impl::Plan(const Topology& topology) {
  t = topology.sizes().tp;
  d = topology.sizes().dp;
  sequence_parallel = parallel.sequence_parallel;
  fuse_wgrad = parallel.gradient_accumulation_fusion;
  if (model.vocab_size) padded_vocab = model.PaddedVocabSize(t);
  pp_size = topology.sizes().pp;
  vp_size = parallel.virtual_pipeline_model_parallel_size.value_or(1);
  if (!parallel.Split().Even()) {
    // The chain's stages are its own even runs of layers (PlanStages); Megatron's uneven
    // splits are the GPT model's.
    const std::string_view key =
        parallel.pipeline_model_parallel_layout      ? "pipeline_model_parallel_layout"
        : parallel.decoder_first_pipeline_num_layers ? "decoder_first_pipeline_num_layers"
        : parallel.decoder_last_pipeline_num_layers  ? "decoder_last_pipeline_num_layers"
        : parallel.account_for_embedding_in_pipeline_split
            ? "account_for_embedding_in_pipeline_split"
            : "account_for_loss_in_pipeline_split";
    return Status::Error(fmt::format("parallel.{}", key),
                         "the layer chain (a model with \"layers\") splits its layers evenly "
                         "over the pipeline stages; uneven splits are for the GPT model "
                         "(\"type\": \"gpt\")");
  }
  MPUSIM_RETURN_IF_ERROR(PlanStages());
  MPUSIM_RETURN_IF_ERROR(ResolveStyles());
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
  state_out->split = slot.kind->SyntheticInputSplit(slot.config, sequence_parallel);
  // The width: the first layer of the chain that fixes its input width (a linear layer's
  // input_size, or the loss's padded vocabulary); the layers in between keep it.
  int64_t& width = *width_out;
  for (size_t j = 0; width == 0 && j < model.layers.size(); ++j) {
    width = KindOf(model.layers[j].type).FixedInputWidth(model.layers[j], padded_vocab);
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
  const LayerKind& kind = KindOf(c.type);
  slot.kind = &kind;
  const bool first = slot.index == 0;
  const bool needs_vocab = kind.takes_tokens() || kind.is_loss() || c.output_size.padded_vocab;
  if (needs_vocab && !model.vocab_size) {
    return Fail(slot, "needs model.vocab_size (the vocabulary tokens and labels come from)");
  }
  if (first && !kind.takes_tokens()) {
    MPUSIM_RETURN_IF_ERROR(PlanSyntheticInput(slot, state, width));
  }
  slot.in_state = *state;
  slot.in_width = kind.takes_tokens() ? 0 : *width;
  if (kind.takes_tokens() && !first) {
    return Fail(slot, "an embedding consumes token ids, so it must be the first layer");
  }
  if (!first && layers.back().kind->is_loss()) {
    return Fail(slot, "comes after the loss; VocabParallelCrossEntropy must be the last layer");
  }
  chain::LayerPlanner planner(*this, slot, *state, *width);
  MPUSIM_RETURN_IF_ERROR(kind.Plan(planner));
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
    const char* sum = layers[i].kind->RedundantGradientSum(c);
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
  if (config.model->IsTorchChain() && config.parallel.sequence_parallel) {
    return Status::Error("parallel.sequence_parallel",
                         "is Megatron's switch; a chain of torch.nn modules shards the sequence "
                         "by its parallelize_plan (Shard(1) layouts)");
  }
  auto impl = std::make_unique<Impl>();
  impl->parallel = config.parallel;
  impl->parallelize_plan = config.parallelize_plan;
  impl->model = *config.model;
  impl->run = *config.run;
  impl->grad_dtype = PrecisionOf(config).main_grad;
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
