// The planner: Megatron-Core's process-group layout as a pure function of ParallelConfig.
//
// What it is: for a validated ParallelConfig, every group kind that Megatron-Core's
// initialize_model_parallel creates (tp, pp, dp, dp_cp, cp, mp, embd, ..., and the expert
// side), with the same groups, in the same order, with the same rank order inside each
// group; a rank's coordinates and groups in O(number of axes); a node map.
// What it is not: a process-group runtime. Communicators are built from it by sim/ and cuda/.
//
// ## The rank formula
// A rank generator owns an ordered list of axes (the `order` string, e.g. tp-cp-ep-dp-pp,
// first axis fastest) with sizes s_0, s_1, ... and strides d_i = s_0 * ... * s_{i-1}:
//
//     rank = rank_offset + sum_i coord_i * d_i,        coord_i in [0, s_i)        (1)
//
// A group kind selects a subset M of the axes (a mask). Two ranks share a group iff their
// coordinates agree on every axis outside M. Groups are numbered by the coordinates outside
// M and ranks inside a group by the coordinates inside M, each read as a mixed-radix number
// with the earlier axis of `order` as the faster digit:
//
//     group_index   = sum_{i not in M} coord_i * prod_{j not in M, j < i} s_j
//     rank_in_group = sum_{i in M}     coord_i * prod_{j in M,     j < i} s_j
//
// This is exactly the enumeration of Megatron's generate_masked_orthogonal_rank_groups.
//
// Worked example (8 GPUs, order tp-cp-ep-dp-pp, t=2, p=2, so d=2; strides tp 1, dp 2, pp 4):
//     rank:  0 1 2 3 4 5 6 7
//     tp:    0 1 0 1 0 1 0 1
//     dp:    0 0 1 1 0 0 1 1
//     pp:    0 0 0 0 1 1 1 1
//   tp groups (M={tp}):    [0,1] [2,3] [4,5] [6,7]
//   dp groups (M={dp}):    [0,2] [1,3] [4,6] [5,7]
//   pp groups (M={pp}):    [0,4] [1,5] [2,6] [3,7]
//   mp groups (M={tp,pp}): [0,1,4,5] [2,3,6,7]
//   embd (first and last stage of each pp group): [0,4] [1,5] [2,6] [3,7]
//
// Megatron runs two generators over the same ranks: the dense one (tp, cp, ep=1, dp, pp)
// and the expert one (tp=etp, cp=1, ep, dp=edp, pp); edp = n / (etp * ep * pp) is derived
// just as dp = n / (tp * cp * pp). A few kinds are derived from a generator kind:
//   split    contiguous or strided sub-groups of each group (dp_cp_partial, hcp_L<k>,
//            expt_dp_partial, inter_dist_opt: Megatron's hierarchical groups
//            "(l s u) -> (l u) s": level sizes S, u = prod S[:k], s = S[k])
//   pick     chosen positions of each pp group (embd: first and last; pos_embd: first)
//   concat   consecutive groups joined (intra_dist_opt: tp_ep_pp groups in runs of
//            edp / num_distributed_optimizer_instances)
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/config/parallel_config.h"
#include "core/status.h"

namespace mpusim {

enum class Axis : uint8_t { kTp = 0, kCp = 1, kEp = 2, kDp = 3, kPp = 4 };
inline constexpr int kNumAxes = 5;
std::string_view AxisName(Axis axis);  // "tp", "cp", "ep", "dp", "pp"

using AxisMask = uint8_t;  // bit i set: Axis(i) is in the group
constexpr AxisMask MaskOf(std::initializer_list<Axis> axes) {
  AxisMask m = 0;
  for (Axis a : axes) m = static_cast<AxisMask>(m | (1u << static_cast<unsigned>(a)));
  return m;
}
constexpr bool InMask(AxisMask mask, Axis axis) {
  return (static_cast<unsigned>(mask) >> static_cast<unsigned>(axis)) & 1u;
}

// Where a rank sits inside the groups of one kind.
struct GroupSlot {
  int64_t group_index = 0;
  int64_t rank_in_group = 0;
};

// Megatron's RankGenerator: equation (1) above.
class RankGenerator {
 public:
  // `sizes` is indexed by Axis; `order` lists every axis exactly once, fastest first.
  RankGenerator(const std::array<int64_t, kNumAxes>& sizes, const std::vector<Axis>& order,
                int64_t rank_offset);

  int64_t world_size() const { return world_size_; }
  int64_t rank_offset() const { return rank_offset_; }
  int64_t Size(Axis axis) const { return size_[static_cast<size_t>(axis)]; }
  int64_t Stride(Axis axis) const { return stride_[static_cast<size_t>(axis)]; }
  const std::vector<Axis>& order() const { return order_; }

  // Coordinate of a global rank on one axis.
  int64_t Coord(Axis axis, int64_t rank) const;
  int64_t GroupSize(AxisMask mask) const;
  int64_t NumGroups(AxisMask mask) const { return world_size_ / GroupSize(mask); }
  GroupSlot Locate(AxisMask mask, int64_t rank) const;                 // O(axes)
  int64_t Member(AxisMask mask, int64_t group_index, int64_t rank_in_group) const;  // O(axes)
  // All groups, concatenated in Megatron's order: group g is flat[g*size, (g+1)*size).
  void Enumerate(AxisMask mask, std::vector<int32_t>* flat) const;     // O(world size)

 private:
  std::array<int64_t, kNumAxes> size_{};
  std::array<int64_t, kNumAxes> stride_{};
  std::vector<Axis> order_;
  int64_t world_size_ = 1;
  int64_t rank_offset_ = 0;
};

// One group kind ("tp", "hcp_L1", ...) and how it is derived.
struct GroupKind {
  enum class Generator : uint8_t { kDense, kExpert };
  enum class Derivation : uint8_t { kDirect, kSplit, kPick, kConcat };

  std::string name;         // Megatron-style short name, as in the golden files
  std::string title;        // words for humans: "tensor model-parallel"
  Generator generator = Generator::kDense;
  AxisMask mask = 0;        // the generator kind this one is built on
  Derivation derivation = Derivation::kDirect;
  int64_t split_inner = 1;  // kSplit: u = product of the lower levels' sizes
  int64_t split_size = 1;   // kSplit: s = this level's size
  std::vector<int64_t> picks;  // kPick: positions in the base group
  int64_t concat = 1;       // kConcat: base groups per group
  bool covers_world = true; // false for embd / pos_embd (some ranks have no group)
};

// Sizes derived from the config, as Megatron computes them.
struct DerivedSizes {
  int64_t tp, pp, cp, dp, ep, etp, edp;
  std::optional<int64_t> vp;
  int64_t num_distributed_optimizer_instances;
  int64_t model_size;  // tp * pp * cp
  // Whether the experts are laid out by groups of their own: expert parallelism, or an
  // expert tensor-parallel size other than tp (else the expert groups are the dense ones:
  // expt_tp = tp, expt_dp = dp_cp, tp_ep = tp).
  bool experts_apart() const { return ep > 1 || etp != tp; }
};

// A rank's coordinate on every axis of both generators.
struct RankCoordinates {
  int64_t rank = 0;
  int64_t node = 0;
  int64_t local_rank = 0;  // GPU index on its node
  int64_t tp = 0, cp = 0, dp = 0, pp = 0;  // dense generator
  int64_t etp = 0, ep = 0, edp = 0;        // expert generator (its pp equals the dense pp)
};

// The divisors of n >= 1, ascending, in O(sqrt n) trials (d and n / d pair up): the sizes a
// parallel dimension of n ranks can take. Used by `layout --sweep` and `advise`.
std::vector<int64_t> DivisorsOf(int64_t n);

class Topology {
 public:
  // Validates the cross-field rules Megatron enforces and builds the planner. Errors name
  // the config fields ("parallel.<key>") and the allowed values.
  static StatusOr<Topology> Create(const ParallelConfig& config);

  const ParallelConfig& config() const { return config_; }
  const DerivedSizes& sizes() const { return sizes_; }
  int64_t world_size() const { return config_.world_size; }
  int64_t first_rank() const { return config_.rank_offset; }
  bool HasRank(int64_t rank) const {
    return rank >= first_rank() && rank < first_rank() + world_size();
  }
  const RankGenerator& dense() const { return dense_; }
  const RankGenerator& expert() const { return expert_; }

  // Kinds in Megatron's naming, in the order the golden files list them.
  const std::vector<GroupKind>& kinds() const { return kinds_; }
  std::optional<size_t> FindKind(std::string_view name) const;

  int64_t GroupSize(size_t kind) const;
  int64_t NumGroups(size_t kind) const;
  // nullopt: the rank belongs to no group of this kind (embd / pos_embd only).
  // Rank arguments of Locate and Coordinates must satisfy HasRank (callers check input).
  std::optional<GroupSlot> Locate(size_t kind, int64_t rank) const;  // O(axes)
  int64_t Member(size_t kind, int64_t group_index, int64_t rank_in_group) const;  // O(axes)
  std::vector<int64_t> Group(size_t kind, int64_t group_index) const;  // O(group size)
  // O(world size); pick and strided-split kinds use a temporary list of the base kind.
  void Enumerate(size_t kind, std::vector<int32_t>* flat) const;

  RankCoordinates Coordinates(int64_t rank) const;  // O(axes)

  // Node map: rank r is on node r / gpus_per_node (ranks fill nodes in order).
  int64_t NodeOf(int64_t rank) const { return rank / config_.gpus_per_node; }
  // Whether a group has members on two nodes: O(axes) for direct kinds, O(group size)
  // otherwise.
  bool GroupSpansNodes(size_t kind, int64_t group_index) const;
  // How many groups of this kind span nodes: O(number of groups) time for direct kinds,
  // O(world size) otherwise; O(group size) memory.
  int64_t NumGroupsSpanningNodes(size_t kind) const;
  // Whether NumGroupsSpanningNodes(kind) > 0: O(axes) for direct kinds (a closed form, see
  // topology_nodes.cc), NumGroupsSpanningNodes otherwise.
  bool AnyGroupSpansNodes(size_t kind) const;
  // The fewest members group 0 of a kind has on one of the nodes it touches; 1 when it
  // stays on one node. O(axes) for a direct kind whose axes of size > 1 are consecutive in
  // the order; O(nodes group 0 touches) time and O(1) memory for other direct kinds;
  // O(group size) for derived kinds.
  int64_t FewestGroupMembersOnANode(size_t kind) const;

 private:
  Topology(ParallelConfig config, DerivedSizes sizes, RankGenerator dense, RankGenerator expert,
           std::vector<GroupKind> kinds);
  GroupSlot LocateBase(const GroupKind& kind, int64_t rank) const;
  const RankGenerator& GeneratorOf(const GroupKind& kind) const;

  ParallelConfig config_;
  DerivedSizes sizes_;
  RankGenerator dense_;
  RankGenerator expert_;
  std::vector<GroupKind> kinds_;
};

// Parses an order string ("tp-cp-ep-dp-pp", case-insensitive) into the axes it lists, in
// its order. Unknown and repeated axes are errors reported at `where`.
StatusOr<std::vector<Axis>> ParseOrder(std::string_view order, std::string_view where);

}  // namespace mpusim
