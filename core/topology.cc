// The planner (see topology.h for the formula and a worked example): the rank generators,
// the checks and the group kinds of a config, and the per-kind and per-rank queries. The
// node map (which groups span nodes) is topology_nodes.cc.
#include "core/topology.h"

#include <algorithm>
#include <cctype>
#include <limits>

#include <fmt/format.h>

namespace mpusim {
namespace {

constexpr std::array<std::string_view, kNumAxes> kAxisNames = {"tp", "cp", "ep", "dp", "pp"};

size_t Index(Axis axis) { return static_cast<size_t>(axis); }

}  // namespace

std::string_view AxisName(Axis axis) { return kAxisNames[Index(axis)]; }

// ---------------------------------------------------------------------------------------
// RankGenerator

RankGenerator::RankGenerator(const std::array<int64_t, kNumAxes>& sizes,
                             const std::vector<Axis>& order, int64_t rank_offset)
    : size_(sizes), order_(order), rank_offset_(rank_offset) {
  int64_t stride = 1;
  for (Axis axis : order_) {
    stride_[Index(axis)] = stride;
    stride *= size_[Index(axis)];
  }
  world_size_ = stride;
}

int64_t RankGenerator::Coord(Axis axis, int64_t rank) const {
  return ((rank - rank_offset_) / stride_[Index(axis)]) % size_[Index(axis)];
}

int64_t RankGenerator::GroupSize(AxisMask mask) const {
  int64_t group_size = 1;
  for (Axis axis : order_) {
    if (InMask(mask, axis)) group_size *= size_[Index(axis)];
  }
  return group_size;
}

GroupSlot RankGenerator::Locate(AxisMask mask, int64_t rank) const {
  const int64_t local = rank - rank_offset_;
  GroupSlot slot;
  int64_t in_radix = 1;   // place value among the masked axes
  int64_t out_radix = 1;  // place value among the other axes
  for (Axis axis : order_) {
    const int64_t size = size_[Index(axis)];
    const int64_t coord = (local / stride_[Index(axis)]) % size;
    if (InMask(mask, axis)) {
      slot.rank_in_group += coord * in_radix;
      in_radix *= size;
    } else {
      slot.group_index += coord * out_radix;
      out_radix *= size;
    }
  }
  return slot;
}

int64_t RankGenerator::Member(AxisMask mask, int64_t group_index, int64_t rank_in_group) const {
  int64_t rank = rank_offset_;
  for (Axis axis : order_) {
    const int64_t size = size_[Index(axis)];
    int64_t& digits = InMask(mask, axis) ? rank_in_group : group_index;
    rank += (digits % size) * stride_[Index(axis)];
    digits /= size;
  }
  return rank;
}

void RankGenerator::Enumerate(AxisMask mask, std::vector<int32_t>* flat) const {
  // Offsets of the ranks inside a group (masked digits) and of the groups (other digits),
  // each built fastest axis first; rank = rank_offset + group base + offset in group.
  std::vector<int64_t> in_group = {0};
  std::vector<int64_t> group_base = {0};
  for (Axis axis : order_) {
    std::vector<int64_t>& list = InMask(mask, axis) ? in_group : group_base;
    const size_t previous = list.size();
    const int64_t size = size_[Index(axis)];
    list.resize(previous * static_cast<size_t>(size));
    for (int64_t c = size - 1; c >= 1; --c) {
      for (size_t i = 0; i < previous; ++i) {
        list[static_cast<size_t>(c) * previous + i] = list[i] + c * stride_[Index(axis)];
      }
    }
  }
  flat->resize(static_cast<size_t>(world_size_));
  int32_t* out = flat->data();
  for (int64_t base : group_base) {
    const int64_t start = rank_offset_ + base;
    for (int64_t offset : in_group) *out++ = static_cast<int32_t>(start + offset);
  }
}

// ---------------------------------------------------------------------------------------
// Validation and construction

StatusOr<std::vector<Axis>> ParseOrder(std::string_view order, std::string_view where) {
  std::vector<Axis> axes;
  size_t start = 0;
  while (true) {
    const size_t dash = order.find('-', start);
    std::string token(order.substr(start, dash == std::string_view::npos ? order.npos
                                                                          : dash - start));
    std::transform(token.begin(), token.end(), token.begin(),
                   [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    const auto it = std::find(kAxisNames.begin(), kAxisNames.end(), token);
    if (it == kAxisNames.end()) {
      return Status::Error(std::string(where),
                           fmt::format("'{}' has unknown axis '{}'; use tp, cp, ep, dp and pp "
                                       "joined by '-', e.g. \"tp-cp-ep-dp-pp\"",
                                       order, token));
    }
    const Axis axis = static_cast<Axis>(it - kAxisNames.begin());
    if (std::find(axes.begin(), axes.end(), axis) != axes.end()) {
      return Status::Error(std::string(where),
                           fmt::format("'{}' names axis '{}' twice; each axis may appear once",
                                       order, token));
    }
    axes.push_back(axis);
    if (dash == std::string_view::npos) break;
    start = dash + 1;
  }
  return axes;
}

namespace {

// Megatron's RankGenerator refuses an order that leaves out an axis of size > 1, and
// appends the (size-1) axes it leaves out.
StatusOr<std::vector<Axis>> CompleteOrder(const ParallelConfig& config,
                                          const std::vector<Axis>& listed,
                                          const std::array<int64_t, kNumAxes>& sizes,
                                          const std::array<std::string_view, kNumAxes>& fields,
                                          std::string_view generator) {
  std::vector<Axis> order = listed;
  for (int i = 0; i < kNumAxes; ++i) {
    const Axis axis = static_cast<Axis>(i);
    if (std::find(listed.begin(), listed.end(), axis) != listed.end()) continue;
    if (sizes[Index(axis)] != 1) {
      return Status::Error(
          "parallel.order",
          fmt::format("'{}' leaves out axis '{}' of the {} rank generator, whose size ({}) is {}; "
                      "every axis of size > 1 must appear in the order",
                      config.order, AxisName(axis), generator, fields[Index(axis)],
                      sizes[Index(axis)]));
    }
    order.push_back(axis);
  }
  return order;
}

// a * b * c, or world_size + 1 if the product exceeds world_size (it cannot divide it then).
int64_t ProductCapped(std::initializer_list<int64_t> factors, int64_t world_size) {
  int64_t product = 1;
  for (int64_t f : factors) {
    if (f > world_size || product > world_size / f) return world_size + 1;
    product *= f;
  }
  return product;
}

GroupKind Direct(std::string name, std::string title, GroupKind::Generator generator,
                 AxisMask mask) {
  GroupKind kind;
  kind.name = std::move(name);
  kind.title = std::move(title);
  kind.generator = generator;
  kind.mask = mask;
  return kind;
}

GroupKind Split(GroupKind base, std::string name, std::string title, int64_t inner,
                int64_t size) {
  base.name = std::move(name);
  base.title = std::move(title);
  base.derivation = GroupKind::Derivation::kSplit;
  base.split_inner = inner;
  base.split_size = size;
  return base;
}

// The dense sizes: world_size and rank_offset in range, tp * pp * cp dividing the world,
// virtual pipeline stages only with a pipeline. Fills tp, pp, cp, dp = world_size / (tp * pp
// * cp) and model_size.
Status CheckDenseSizes(const ParallelConfig& config, DerivedSizes* sizes) {
  const int64_t n = config.world_size;
  if (n < 1) return Status::Error("parallel.world_size", "must be an integer >= 1");
  if (config.rank_offset > std::numeric_limits<int32_t>::max() - (n - 1)) {
    return Status::Error("parallel.rank_offset",
                         fmt::format("rank_offset + world_size - 1 must be at most {}",
                                     std::numeric_limits<int32_t>::max()));
  }
  const int64_t t = config.tensor_model_parallel_size;
  const int64_t p = config.pipeline_model_parallel_size;
  const int64_t c = config.context_parallel_size;
  const int64_t model_size = ProductCapped({t, p, c}, n);
  if (n % model_size != 0) {
    return Status::Error(
        "parallel.world_size",
        fmt::format("{} is not divisible by tensor_model_parallel_size * "
                    "pipeline_model_parallel_size * context_parallel_size = {} * {} * {}",
                    n, t, p, c));
  }
  const int64_t d = n / model_size;
  if (config.virtual_pipeline_model_parallel_size && p <= 1) {
    return Status::Error("parallel.virtual_pipeline_model_parallel_size",
                         fmt::format("needs pipeline_model_parallel_size > 1 (the interleaved "
                                     "schedule), but pipeline_model_parallel_size is {}; "
                                     "set it to null or raise pipeline_model_parallel_size",
                                     p));
  }
  sizes->tp = t;
  sizes->pp = p;
  sizes->cp = c;
  sizes->dp = d;
  sizes->model_size = model_size;
  return Status();
}

// The dense generator (tp, cp, ep = 1, dp, pp) in the listed order, completed.
StatusOr<RankGenerator> DenseGenerator(const ParallelConfig& config,
                                       const std::vector<Axis>& listed, const DerivedSizes& sizes) {
  std::array<int64_t, kNumAxes> dense_sizes{};
  dense_sizes[Index(Axis::kTp)] = sizes.tp;
  dense_sizes[Index(Axis::kCp)] = sizes.cp;
  dense_sizes[Index(Axis::kEp)] = 1;
  dense_sizes[Index(Axis::kDp)] = sizes.dp;
  dense_sizes[Index(Axis::kPp)] = sizes.pp;
  StatusOr<std::vector<Axis>> dense_order = CompleteOrder(
      config, listed, dense_sizes,
      {ParallelKey(&ParallelConfig::tensor_model_parallel_size),
       ParallelKey(&ParallelConfig::context_parallel_size),
       ParallelKey(&ParallelConfig::expert_model_parallel_size), "data_parallel_size",
       ParallelKey(&ParallelConfig::pipeline_model_parallel_size)},
      "dense");
  if (!dense_order.ok()) return dense_order.status();
  return RankGenerator(dense_sizes, *dense_order, config.rank_offset);
}

// The expert generator (etp, cp = 1, ep, edp, pp) in the listed order, completed, where
// etp * ep * pp divides the world. Fills ep, etp and edp = world_size / (etp * ep * pp).
StatusOr<RankGenerator> ExpertGenerator(const ParallelConfig& config,
                                        const std::vector<Axis>& listed, DerivedSizes* sizes) {
  const int64_t n = config.world_size;
  const int64_t p = sizes->pp;
  const int64_t etp = config.EffectiveExpertTensorParallelSize();
  const int64_t e = config.expert_model_parallel_size;
  const int64_t expert_model_size = ProductCapped({etp, e, p}, n);
  if (n % expert_model_size != 0) {
    return Status::Error(
        "parallel.world_size",
        fmt::format("{} is not divisible by expert_tensor_parallel_size * "
                    "expert_model_parallel_size * pipeline_model_parallel_size = {} * {} * {}",
                    n, etp, e, p));
  }
  const int64_t edp = n / expert_model_size;
  std::array<int64_t, kNumAxes> expert_sizes{};
  expert_sizes[Index(Axis::kTp)] = etp;
  expert_sizes[Index(Axis::kCp)] = 1;
  expert_sizes[Index(Axis::kEp)] = e;
  expert_sizes[Index(Axis::kDp)] = edp;
  expert_sizes[Index(Axis::kPp)] = p;
  StatusOr<std::vector<Axis>> expert_order = CompleteOrder(
      config, listed, expert_sizes,
      {ParallelKey(&ParallelConfig::expert_tensor_parallel_size),
       ParallelKey(&ParallelConfig::context_parallel_size),
       ParallelKey(&ParallelConfig::expert_model_parallel_size), "expert_data_parallel_size",
       ParallelKey(&ParallelConfig::pipeline_model_parallel_size)},
      "expert");
  if (!expert_order.ok()) return expert_order.status();
  sizes->ep = e;
  sizes->etp = etp;
  sizes->edp = edp;
  return RankGenerator(expert_sizes, *expert_order, config.rank_offset);
}

// The dense and expert generators must lay out the same pipeline groups.
Status CheckPipelineGroups(const ParallelConfig& config, const std::vector<Axis>& listed,
                           const DerivedSizes& sizes, const RankGenerator& dense,
                           const RankGenerator& expert) {
  const int64_t p = sizes.pp;
  if (listed.back() != Axis::kPp && p != 1 && sizes.edp != sizes.dp) {
    return Status::Error(
        "parallel.order",
        fmt::format("'{}' does not end with pp, which needs the expert data-parallel size "
                    "({}) to equal the data-parallel size ({}); end the order with pp or "
                    "change the expert sizes",
                    config.order, sizes.edp, sizes.dp));
  }
  // Both generators must lay out identical pp groups. With equal pp sizes and world sizes
  // the groups coincide exactly when the pp strides do (groups are numbered by their
  // smallest rank in both), so this is Megatron's list comparison in O(1).
  if (p > 1 && dense.Stride(Axis::kPp) != expert.Stride(Axis::kPp)) {
    return Status::Error(
        "parallel.order",
        fmt::format("'{}' gives the dense and expert rank generators different pipeline groups "
                    "(pp stride {} vs {}); Megatron requires them equal: put pp last, or make "
                    "the axes before pp multiply to the same size on both sides",
                    config.order, dense.Stride(Axis::kPp), expert.Stride(Axis::kPp)));
  }
  return Status();
}

// The sizes of the split kinds: the distributed-optimizer instances divide dp * cp and edp;
// the hierarchical context-parallel levels multiply to cp. Fills
// num_distributed_optimizer_instances.
Status CheckSplitSizes(const ParallelConfig& config, DerivedSizes* sizes) {
  const int64_t c = sizes->cp;
  const int64_t d = sizes->dp;
  const int64_t edp = sizes->edp;
  const int64_t instances = config.num_distributed_optimizer_instances;
  if ((d * c) % instances != 0) {
    return Status::Error(
        "parallel.num_distributed_optimizer_instances",
        fmt::format("{} must divide data_parallel_size * context_parallel_size = {} * {} = {}",
                    instances, d, c, d * c));
  }
  const auto& hcp = config.hierarchical_context_parallel_sizes;
  if (!hcp.empty()) {
    int64_t hcp_product = 1;
    for (int64_t level : hcp) hcp_product = ProductCapped({hcp_product, level}, c);
    if (hcp_product != c) {
      return Status::Error(
          "parallel.hierarchical_context_parallel_sizes",
          fmt::format("[{}] must multiply to context_parallel_size ({})", fmt::join(hcp, ", "), c));
    }
  }
  if (edp % instances != 0) {
    return Status::Error(
        "parallel.num_distributed_optimizer_instances",
        fmt::format("{} must divide the expert data-parallel size {} (= world_size / "
                    "(expert_tensor_parallel_size * expert_model_parallel_size * "
                    "pipeline_model_parallel_size))",
                    instances, edp));
  }
  sizes->num_distributed_optimizer_instances = instances;
  return Status();
}

// Keys that shape the schedule and the layer assignment, checked here so that a config
// is either usable by every subcommand or refused up front.
Status CheckScheduleKeys(const ParallelConfig& config) {
  const int64_t p = config.pipeline_model_parallel_size;
  const auto& vp = config.virtual_pipeline_model_parallel_size;
  if (config.microbatch_group_size_per_vp_stage) {
    if (!vp) {
      return Status::Error("parallel.microbatch_group_size_per_vp_stage",
                           "only shapes the interleaved schedule; set "
                           "virtual_pipeline_model_parallel_size or remove it");
    }
    if (*config.microbatch_group_size_per_vp_stage < p) {
      return Status::Error("parallel.microbatch_group_size_per_vp_stage",
                           fmt::format("must be at least pipeline_model_parallel_size ({}), got {}",
                                       p, *config.microbatch_group_size_per_vp_stage));
    }
  }
  if (config.num_layers && !config.Split().Even()) {
    // An uneven split's own checks (Megatron's), naming its key.
    StatusOr<LayerAssignment> layers = AssignLayers(config.Split(), *config.num_layers);
    if (!layers.ok()) return layers.status();
  } else if (config.num_layers) {
    const int64_t stages = ProductCapped({p, vp.value_or(1)}, *config.num_layers);
    if (*config.num_layers % stages != 0) {
      return Status::Error("parallel.num_layers",
                           fmt::format("{} is not divisible by pipeline_model_parallel_size * "
                                       "virtual_pipeline_model_parallel_size = {} * {}",
                                       *config.num_layers, p, vp.value_or(1)));
    }
  }
  return Status();
}

// The dense generator's kinds, the hierarchical context-parallel levels among them, in the
// golden files' order.
void AddDenseKinds(const DerivedSizes& sizes, const std::vector<int64_t>& hcp,
                   std::vector<GroupKind>* kinds) {
  const int64_t p = sizes.pp;
  using G = GroupKind::Generator;
  const GroupKind dp_cp =
      Direct("dp_cp", "data+context-parallel", G::kDense, MaskOf({Axis::kDp, Axis::kCp}));
  const GroupKind cp = Direct("cp", "context-parallel", G::kDense, MaskOf({Axis::kCp}));
  const GroupKind pp = Direct("pp", "pipeline model-parallel", G::kDense, MaskOf({Axis::kPp}));
  kinds->push_back(Direct("tp", "tensor model-parallel", G::kDense, MaskOf({Axis::kTp})));
  kinds->push_back(pp);
  kinds->push_back(Direct("dp", "data_parallel", G::kDense, MaskOf({Axis::kDp})));
  kinds->push_back(dp_cp);
  kinds->push_back(Split(dp_cp, "dp_cp_partial",
                         "data+context-parallel within one distributed-optimizer instance", 1,
                         sizes.dp * sizes.cp / sizes.num_distributed_optimizer_instances));
  kinds->push_back(cp);
  int64_t inner = 1;
  for (size_t level = 0; level < hcp.size(); ++level) {
    kinds->push_back(Split(cp, fmt::format("hcp_L{}", level),
                           fmt::format("hierarchical context-parallel level {}", level), inner,
                           hcp[level]));
    inner *= hcp[level];
  }
  kinds->push_back(
      Direct("mp", "model-parallel: tensor x pipeline", G::kDense, MaskOf({Axis::kTp, Axis::kPp})));
  GroupKind embd = pp;
  embd.name = "embd";
  embd.title = "embedding: first and last pipeline stage";
  embd.derivation = GroupKind::Derivation::kPick;
  embd.picks = p == 1 ? std::vector<int64_t>{0} : std::vector<int64_t>{0, p - 1};
  embd.covers_world = p <= 2;
  kinds->push_back(embd);
  GroupKind pos_embd = pp;
  pos_embd.name = "pos_embd";
  pos_embd.title = "position embedding: first pipeline stage";
  pos_embd.derivation = GroupKind::Derivation::kPick;
  pos_embd.picks = {0};
  pos_embd.covers_world = p == 1;
  kinds->push_back(pos_embd);
  kinds->push_back(
      Direct("tp_dp", "tensor+data-parallel", G::kDense, MaskOf({Axis::kTp, Axis::kDp})));
  kinds->push_back(Direct("tp_dp_cp", "tensor+data+context-parallel", G::kDense,
                          MaskOf({Axis::kTp, Axis::kDp, Axis::kCp})));
  kinds->push_back(
      Direct("tp_cp", "tensor+context-parallel", G::kDense, MaskOf({Axis::kTp, Axis::kCp})));
}

// The expert generator's kinds and the distributed-optimizer groups built on them, in the
// golden files' order.
void AddExpertKinds(const DerivedSizes& sizes, std::vector<GroupKind>* kinds) {
  const int64_t instances = sizes.num_distributed_optimizer_instances;
  using G = GroupKind::Generator;
  const GroupKind expt_dp =
      Direct("expt_dp", "expert data-parallel", G::kExpert, MaskOf({Axis::kDp}));
  const GroupKind tp_ep_pp = Direct("tp_ep_pp", "expert tensor+expert+pipeline-parallel",
                                    G::kExpert, MaskOf({Axis::kTp, Axis::kEp, Axis::kPp}));
  kinds->push_back(Direct("ep", "expert model-parallel", G::kExpert, MaskOf({Axis::kEp})));
  kinds->push_back(Direct("expt_tp", "expert tensor-parallel", G::kExpert, MaskOf({Axis::kTp})));
  kinds->push_back(
      Direct("tp_ep", "expert tensor+expert-parallel", G::kExpert, MaskOf({Axis::kTp, Axis::kEp})));
  kinds->push_back(tp_ep_pp);
  kinds->push_back(expt_dp);
  const int64_t intra_edp = sizes.edp / instances;
  kinds->push_back(Split(expt_dp, "expt_dp_partial",
                         "expert data-parallel within one distributed-optimizer instance", 1,
                         intra_edp));
  GroupKind intra = tp_ep_pp;
  intra.name = "intra_dist_opt";
  intra.title = "all ranks of one distributed-optimizer instance";
  intra.derivation = GroupKind::Derivation::kConcat;
  intra.concat = intra_edp;
  kinds->push_back(intra);
  if (instances > 1) {
    kinds->push_back(Split(expt_dp, "inter_dist_opt",
                           "same position across distributed-optimizer instances", intra_edp,
                           instances));
  }
}

}  // namespace

StatusOr<Topology> Topology::Create(const ParallelConfig& config) {
  DerivedSizes sizes{};
  MPUSIM_RETURN_IF_ERROR(CheckDenseSizes(config, &sizes));
  StatusOr<std::vector<Axis>> listed = ParseOrder(config.order, "parallel.order");
  if (!listed.ok()) return listed.status();
  // The two completed orders differ only in which size-1 axes were appended, which does
  // not change any stride of a size > 1 axis.
  StatusOr<RankGenerator> dense = DenseGenerator(config, *listed, sizes);
  if (!dense.ok()) return dense.status();
  StatusOr<RankGenerator> expert = ExpertGenerator(config, *listed, &sizes);
  if (!expert.ok()) return expert.status();
  MPUSIM_RETURN_IF_ERROR(CheckPipelineGroups(config, *listed, sizes, *dense, *expert));
  MPUSIM_RETURN_IF_ERROR(CheckSplitSizes(config, &sizes));
  MPUSIM_RETURN_IF_ERROR(CheckScheduleKeys(config));
  sizes.vp = config.virtual_pipeline_model_parallel_size;

  std::vector<GroupKind> kinds;
  AddDenseKinds(sizes, config.hierarchical_context_parallel_sizes, &kinds);
  AddExpertKinds(sizes, &kinds);
  return Topology(config, sizes, std::move(*dense), std::move(*expert), std::move(kinds));
}

Topology::Topology(ParallelConfig config, DerivedSizes sizes, RankGenerator dense,
                   RankGenerator expert, std::vector<GroupKind> kinds)
    : config_(std::move(config)),
      sizes_(sizes),
      dense_(std::move(dense)),
      expert_(std::move(expert)),
      kinds_(std::move(kinds)) {}

// ---------------------------------------------------------------------------------------
// Queries

std::optional<size_t> Topology::FindKind(std::string_view name) const {
  for (size_t i = 0; i < kinds_.size(); ++i) {
    if (kinds_[i].name == name) return i;
  }
  return std::nullopt;
}

const RankGenerator& Topology::GeneratorOf(const GroupKind& kind) const {
  return kind.generator == GroupKind::Generator::kDense ? dense_ : expert_;
}

int64_t Topology::GroupSize(size_t kind_index) const {
  const GroupKind& kind = kinds_[kind_index];
  const int64_t base = GeneratorOf(kind).GroupSize(kind.mask);
  switch (kind.derivation) {
    case GroupKind::Derivation::kDirect: return base;
    case GroupKind::Derivation::kSplit: return kind.split_size;
    case GroupKind::Derivation::kPick: return static_cast<int64_t>(kind.picks.size());
    case GroupKind::Derivation::kConcat: return base * kind.concat;
  }
  return base;
}

int64_t Topology::NumGroups(size_t kind_index) const {
  const GroupKind& kind = kinds_[kind_index];
  const RankGenerator& generator = GeneratorOf(kind);
  const int64_t base_groups = generator.NumGroups(kind.mask);
  switch (kind.derivation) {
    case GroupKind::Derivation::kDirect:
    case GroupKind::Derivation::kPick: return base_groups;
    case GroupKind::Derivation::kSplit:
      return base_groups * (generator.GroupSize(kind.mask) / kind.split_size);
    case GroupKind::Derivation::kConcat: return base_groups / kind.concat;
  }
  return base_groups;
}

std::optional<GroupSlot> Topology::Locate(size_t kind_index, int64_t rank) const {
  const GroupKind& kind = kinds_[kind_index];
  const RankGenerator& generator = GeneratorOf(kind);
  const GroupSlot base = generator.Locate(kind.mask, rank);
  switch (kind.derivation) {
    case GroupKind::Derivation::kDirect: return base;
    case GroupKind::Derivation::kSplit: {
      // Base group position q = (l_i * s + s_i) * u + u_i; sub-groups ordered by (l_i, u_i).
      const int64_t u = kind.split_inner;
      const int64_t s = kind.split_size;
      const int64_t per_base = generator.GroupSize(kind.mask) / s;
      const int64_t q = base.rank_in_group;
      return GroupSlot{base.group_index * per_base + (q / (s * u)) * u + q % u, (q / u) % s};
    }
    case GroupKind::Derivation::kPick: {
      const auto it = std::find(kind.picks.begin(), kind.picks.end(), base.rank_in_group);
      if (it == kind.picks.end()) return std::nullopt;
      return GroupSlot{base.group_index, it - kind.picks.begin()};
    }
    case GroupKind::Derivation::kConcat: {
      const int64_t base_size = generator.GroupSize(kind.mask);
      return GroupSlot{base.group_index / kind.concat,
                       (base.group_index % kind.concat) * base_size + base.rank_in_group};
    }
  }
  return base;
}

int64_t Topology::Member(size_t kind_index, int64_t group_index, int64_t rank_in_group) const {
  const GroupKind& kind = kinds_[kind_index];
  const RankGenerator& generator = GeneratorOf(kind);
  switch (kind.derivation) {
    case GroupKind::Derivation::kDirect: break;
    case GroupKind::Derivation::kSplit: {
      const int64_t u = kind.split_inner;
      const int64_t s = kind.split_size;
      const int64_t per_base = generator.GroupSize(kind.mask) / s;
      const int64_t local = group_index % per_base;
      const int64_t q = ((local / u) * s + rank_in_group) * u + local % u;
      return generator.Member(kind.mask, group_index / per_base, q);
    }
    case GroupKind::Derivation::kPick:
      return generator.Member(kind.mask, group_index,
                              kind.picks[static_cast<size_t>(rank_in_group)]);
    case GroupKind::Derivation::kConcat: {
      const int64_t base_size = generator.GroupSize(kind.mask);
      return generator.Member(kind.mask, group_index * kind.concat + rank_in_group / base_size,
                              rank_in_group % base_size);
    }
  }
  return generator.Member(kind.mask, group_index, rank_in_group);
}

std::vector<int64_t> Topology::Group(size_t kind_index, int64_t group_index) const {
  std::vector<int64_t> ranks(static_cast<size_t>(GroupSize(kind_index)));
  for (size_t k = 0; k < ranks.size(); ++k) {
    ranks[k] = Member(kind_index, group_index, static_cast<int64_t>(k));
  }
  return ranks;
}

void Topology::Enumerate(size_t kind_index, std::vector<int32_t>* flat) const {
  const GroupKind& kind = kinds_[kind_index];
  const RankGenerator& generator = GeneratorOf(kind);
  if (kind.derivation == GroupKind::Derivation::kDirect ||
      kind.derivation == GroupKind::Derivation::kConcat ||
      (kind.derivation == GroupKind::Derivation::kSplit && kind.split_inner == 1)) {
    // Concatenating consecutive groups, or cutting each into contiguous runs, leaves the
    // flat list unchanged.
    generator.Enumerate(kind.mask, flat);
    return;
  }
  std::vector<int32_t> base;
  generator.Enumerate(kind.mask, &base);
  const size_t base_size = static_cast<size_t>(generator.GroupSize(kind.mask));
  flat->clear();
  flat->reserve(base.size() / base_size * static_cast<size_t>(GroupSize(kind_index)));
  for (size_t start = 0; start < base.size(); start += base_size) {
    const int32_t* group = base.data() + start;
    if (kind.derivation == GroupKind::Derivation::kPick) {
      for (int64_t pick : kind.picks) flat->push_back(group[pick]);
      continue;
    }
    const size_t u = static_cast<size_t>(kind.split_inner);
    const size_t s = static_cast<size_t>(kind.split_size);
    for (size_t outer = 0; outer < base_size / (s * u); ++outer) {
      for (size_t ui = 0; ui < u; ++ui) {
        for (size_t si = 0; si < s; ++si) flat->push_back(group[(outer * s + si) * u + ui]);
      }
    }
  }
}

RankCoordinates Topology::Coordinates(int64_t rank) const {
  RankCoordinates c;
  c.rank = rank;
  c.node = NodeOf(rank);
  c.local_rank = rank % config_.gpus_per_node;
  c.tp = dense_.Coord(Axis::kTp, rank);
  c.cp = dense_.Coord(Axis::kCp, rank);
  c.dp = dense_.Coord(Axis::kDp, rank);
  c.pp = dense_.Coord(Axis::kPp, rank);
  c.etp = expert_.Coord(Axis::kTp, rank);
  c.ep = expert_.Coord(Axis::kEp, rank);
  c.edp = expert_.Coord(Axis::kDp, rank);
  return c;
}

std::vector<int64_t> DivisorsOf(int64_t n) {
  std::vector<int64_t> small, large;
  for (int64_t d = 1; d <= n / d; ++d) {
    if (n % d != 0) continue;
    small.push_back(d);
    if (d != n / d) large.push_back(n / d);
  }
  small.insert(small.end(), large.rbegin(), large.rend());
  return small;
}

}  // namespace mpusim
