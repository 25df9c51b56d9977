#include "core/estimate/memory_estimate.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "core/estimate/estimable.h"
#include "core/model/gpt_model.h"
#include "core/model/model.h"
#include "core/model/optimizer_plan.h"
#include "core/pipeline_split.h"

namespace mpusim {
namespace {

// The elements of one distributed-optimizer buffer of `total` elements that rank
// `rank_in_group` of a shard group of `group_size` ranks owns (core/train/optimizer.h).
PlanBytes OwnedElements(PlanBytes total, int64_t group_size, int64_t rank_in_group) {
  const auto d = static_cast<PlanBytes>(std::max<int64_t>(1, group_size));
  const PlanBytes piece = (total + d - 1) / d;
  const PlanBytes begin = SaturatingMul(piece, static_cast<PlanBytes>(rank_in_group));
  if (begin >= total) return 0;
  return std::min(piece, total - begin);
}

// Rank `rank`'s position in its group of the kind called `kind`: {group size, rank in group}.
std::pair<int64_t, int64_t> GroupPosition(const Topology& topology, const char* kind,
                                          int64_t rank) {
  const std::optional<size_t> k = topology.FindKind(kind);
  if (!k) return {1, 0};
  const std::optional<GroupSlot> slot = topology.Locate(*k, rank);
  if (!slot) return {1, 0};
  return {topology.GroupSize(*k), slot->rank_in_group};
}

}  // namespace

StatusOr<std::vector<HeldParameterShape>> CountedParameterShapes(const Config& config,
                                                                 const Topology& topology,
                                                                 int64_t rank) {
  const GptConfig* model = EstimatedModel(config);
  if (model == nullptr || !config.run) {
    return Status::Error(model != nullptr ? "run" : "model",
                         "the parameter count needs a GPT model and a run section");
  }
  GptConfig gpt = *model;
  MPUSIM_RETURN_IF_ERROR(CheckGptLayout(config.parallel, *config.run, &gpt));
  const RankCoordinates coords = topology.Coordinates(rank);
  const DerivedSizes& sizes = topology.sizes();
  StatusOr<LayerAssignment> assigned = AssignLayers(config.parallel.Split(), gpt.num_layers);
  if (!assigned.ok()) return assigned.status();
  std::set<int64_t> held;
  for (const auto& chunk : (*assigned)[static_cast<size_t>(coords.pp)]) {
    for (int64_t layer : chunk) held.insert(layer - 1);  // 1-based there
  }
  const bool pre = coords.pp == 0, post = coords.pp == sizes.pp - 1;
  std::vector<HeldParameterShape> out;
  for (const HeldGptParameter& held_p :
       HeldGptParameters(gpt, sizes, coords, held, pre, post, gpt.PaddedVocabSize(sizes.tp),
                         config.parallel.sequence_parallel && sizes.tp > 1)) {
    const GptParameter& p = held_p.declared;
    // An expert weight is split over expt_tp (etp ranks) where the dense weights are over tp.
    const int64_t shards = held_p.expert ? sizes.etp : sizes.tp;
    Shape local = p.shape;
    if (p.tp_dim >= 0) local[static_cast<size_t>(p.tp_dim)] /= shards;
    out.push_back({p.name, local, true, held_p.expert.has_value() && sizes.experts_apart()});
  }
  return out;
}

Status ExecutorBuildsParts(const Config& config, const Topology& topology) {
  if (EstimatedModel(config) == nullptr) return {};
  return BuildModel(config, topology, topology.Coordinates(topology.first_rank())).status();
}

StatusOr<HeldMemory> EstimateHeldMemory(const Config& config, const Topology& topology,
                                        int64_t rank) {
  std::vector<HeldParameterShape> shapes;
  if (EstimatedModel(config) != nullptr && config.run) {
    // A GPT model: counted from its parameter list (HeldGptParameters, the list
    // GptModel::Build builds from), so the count needs no executor and holds for the layouts
    // Megatron runs and the executor does not yet.
    StatusOr<std::vector<HeldParameterShape>> counted =
        CountedParameterShapes(config, topology, rank);
    if (!counted.ok()) return counted.status();
    shapes = *std::move(counted);
  } else {
    StatusOr<std::unique_ptr<Model>> built =
        BuildModel(config, topology, topology.Coordinates(rank));
    if (!built.ok()) return built.status();
    shapes = (*built)->HeldParameterShapes();
  }
  if (config.optimizer && config.optimizer->use_torch_fsdp2) {
    // FSDP2 keeps its rows of dim 0 of each piece over the D ranks of dp x cp
    // (core/model/fully_shard.h FullyShardRows).
    const auto [d, r] = GroupPosition(topology, "dp_cp", rank);
    for (HeldParameterShape& p : shapes) {
      if (!p.local_shape.empty()) p.local_shape[0] = FullyShardRows(p.local_shape[0], d, r).count();
    }
  }
  const DType storage = config.run ? config.run->dtype : DType::kFloat32;
  HeldMemory held;
  PlanBytes dense = 0, experts = 0;  // elements of the two distributed-optimizer buffers
  PlanBytes trainable = 0;
  std::vector<PlanBytes> dense_parameters, expert_parameters;  // registration order
  for (const HeldParameterShape& p : shapes) {
    const PlanBytes elements = PlanElements(p.local_shape);
    held.parameter_elements = SaturatingAdd(held.parameter_elements, elements);
    if (!p.trainable) continue;
    held.largest_parameter_elements = std::max(held.largest_parameter_elements, elements);
    trainable = SaturatingAdd(trainable, elements);
    (p.expert ? experts : dense) = SaturatingAdd(p.expert ? experts : dense, elements);
    (p.expert ? expert_parameters : dense_parameters).push_back(elements);
  }
  held.parameters = SaturatingMul(held.parameter_elements, DTypeSize(storage));
  const OptimizerPrecision precision = PrecisionOf(config);
  held.gradients = SaturatingMul(trainable, DTypeSize(precision.main_grad));
  held.dense_elements = dense;
  held.expert_elements = experts;
  if (!config.optimizer) return held;
  const OptimizerConfig& optimizer = *config.optimizer;
  // The parameters with owned elements (each float16 tensor of theirs has a scale), this
  // rank's and the most of any rank of its shard groups.
  int64_t owned_parameters = 0, most_parameters = 0;
  const auto count = [&](const std::vector<PlanBytes>& elements, int64_t d, int64_t r) {
    owned_parameters += OwnedParameters(elements, d, r);
    int64_t most = 0;
    for (int64_t other = 0; other < d; ++other) {
      most = std::max(most, OwnedParameters(elements, d, other));
    }
    most_parameters += most;
  };
  if (!optimizer.use_distributed_optimizer) {
    held.optimizer_elements = trainable;
    count(dense_parameters, 1, 0);
    count(expert_parameters, 1, 0);
  } else {
    const auto [d, r] = GroupPosition(topology, "dp_cp_partial", rank);
    held.dense_shards = d;
    held.optimizer_elements = OwnedElements(dense, d, r);
    count(dense_parameters, d, r);
    if (experts > 0) {
      const auto [de, re] = GroupPosition(topology, "expt_dp_partial", rank);
      held.expert_shards = de;
      held.optimizer_elements =
          SaturatingAdd(held.optimizer_elements, OwnedElements(experts, de, re));
      count(expert_parameters, de, re);
    }
  }
  const auto scales = [&](int64_t parameters) {
    return static_cast<PlanBytes>(parameters * ScaledStates(optimizer, precision) *
                                  kStateScaleBytes);
  };
  held.optimizer_scales = scales(owned_parameters);
  held.optimizer_scales_most = scales(most_parameters);
  held.optimizer = SaturatingAdd(
      SaturatingMul(held.optimizer_elements,
                    static_cast<PlanBytes>(OptimizerStateBytes(optimizer, precision))),
      held.optimizer_scales);
  if (precision.grads_copied_for_step) {
    held.step_gradient_copies = SaturatingMul(held.optimizer_elements, PlanBytes{4});
  }
  return held;
}

StatusOr<std::vector<StageHeldMemory>> EstimateStageHeldMemory(const Config& config,
                                                               const Topology& topology) {
  std::vector<StageHeldMemory> stages;
  const int64_t pp = topology.sizes().pp;
  for (int64_t rank = 0; rank < topology.world_size() && static_cast<int64_t>(stages.size()) < pp;
       ++rank) {
    const RankCoordinates coords = topology.Coordinates(rank);
    if (coords.pp != static_cast<int64_t>(stages.size())) continue;
    if (coords.tp != 0 || coords.cp != 0 || coords.dp != 0 || coords.ep != 0) continue;
    StatusOr<HeldMemory> held = EstimateHeldMemory(config, topology, rank);
    if (!held.ok()) return held.status();
    held->optimizer += held->optimizer_scales_most - held->optimizer_scales;
    held->optimizer_scales = held->optimizer_scales_most;
    stages.push_back({coords.pp, rank, *held});
  }
  return stages;
}

}  // namespace mpusim
