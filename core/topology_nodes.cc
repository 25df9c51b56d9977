// The planner's node map (see topology.h): which groups of a kind have members on two nodes,
// and how few members group 0 has on a node it touches. Ranks fill nodes in order: rank r is
// on node r / gpus_per_node.
//
// What it is: the node queries of Topology, in O(axes) where a closed form exists (direct
// kinds), by walking the members otherwise. What it is not: the groups themselves (the rank
// formula and the kinds, topology.cc).
#include "core/topology.h"

#include <algorithm>
#include <limits>
#include <map>
#include <vector>

namespace mpusim {

bool Topology::GroupSpansNodes(size_t kind_index, int64_t group_index) const {
  const int64_t size = GroupSize(kind_index);
  if (kinds_[kind_index].derivation == GroupKind::Derivation::kDirect) {
    // A direct group's members run from rank_in_group 0 (every coordinate in the mask 0) to
    // size - 1 (every one at its maximum), and nodes are runs of consecutive ranks: it spans
    // nodes iff its smallest and largest members do.
    return NodeOf(Member(kind_index, group_index, 0)) !=
           NodeOf(Member(kind_index, group_index, size - 1));
  }
  const std::vector<int64_t> members = Group(kind_index, group_index);
  for (const int64_t member : members) {
    if (NodeOf(member) != NodeOf(members.front())) return true;
  }
  return false;
}

int64_t Topology::NumGroupsSpanningNodes(size_t kind_index) const {
  int64_t spanning = 0;
  const int64_t groups = NumGroups(kind_index);
  for (int64_t g = 0; g < groups; ++g) spanning += GroupSpansNodes(kind_index, g) ? 1 : 0;
  return spanning;
}

// Some group of a direct kind spans nodes iff a node boundary falls inside the world away
// from a multiple of D (local ranks x = rank - rank_offset), where D = stride * size of the
// kind's slowest axis of size > 1 (the block of all axes up to it).
// Proof. A group's members run from its base b (digits 0 on its axes) to b + E, with
// E = sum over its axes of (s_i - 1) d_i; it spans nodes iff a boundary y (a multiple of
// gpus_per_node, minus rank_offset) has b < y <= b + E. Group bases are periodic with
// period D, and D divides the world, so only y mod D matters. Inside one block
// [0, D): with k the slowest axis, every base is below d_k and E >= (s_k - 1) d_k >= d_k;
// so [0, E] (base 0) holds y - 1 and y when y <= E, and the last base
// Nlow = sum of (s_i - 1) d_i over the other axes below k has Nlow + E = D - 1 and
// Nlow < d_k <= E < y, so [Nlow, D - 1] holds them when E < y < D. At y = 0 mod D the ranks
// y - 1 and y lie in two blocks, and no group holds both.
// So: a boundary with y mod D != 0 exists among the boundaries in (0, n). Two boundaries
// differ by gpus_per_node, so if D does not divide gpus_per_node, two of them suffice;
// if it does, they all agree with the first one mod D.
bool Topology::AnyGroupSpansNodes(size_t kind_index) const {
  const GroupKind& kind = kinds_[kind_index];
  if (kind.derivation != GroupKind::Derivation::kDirect) {
    return NumGroupsSpanningNodes(kind_index) > 0;
  }
  const RankGenerator& generator = GeneratorOf(kind);
  int64_t block = 0;  // D; 0 while no axis of size > 1 is in the kind
  for (Axis axis : generator.order()) {
    if (InMask(kind.mask, axis) && generator.Size(axis) > 1) {
      block = generator.Stride(axis) * generator.Size(axis);
    }
  }
  if (block == 0) return false;
  const int64_t g = config_.gpus_per_node;
  const int64_t o = config_.rank_offset;
  const int64_t end = o + world_size();  // boundaries t with o < t < end; end < 2^31
  const int64_t node_start = o - o % g;
  if (g >= end - node_start) return false;  // no boundary: the world is on one node
  const int64_t first = node_start + g - o;  // the first boundary, as a local rank
  if (first % block != 0) return true;
  return g % block != 0 && g < end - node_start - g;
}

namespace {

// |{m in group 0 : m < y}| for a direct kind, y a local rank in [0, n]: the mixed-radix
// count of numbers below y whose digits outside the mask are 0, slowest digit first.
int64_t MembersBelow(const RankGenerator& generator, AxisMask mask, int64_t y) {
  if (y >= generator.world_size()) return generator.GroupSize(mask);
  int64_t below = 0;
  const std::vector<Axis>& order = generator.order();
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const int64_t digit = (y / generator.Stride(*it)) % generator.Size(*it);
    int64_t inner = 1;  // members per value of this digit: the mask's sizes below it
    for (auto jt = it + 1; jt != order.rend(); ++jt) {
      if (InMask(mask, *jt)) inner *= generator.Size(*jt);
    }
    if (InMask(mask, *it)) {
      below += digit * inner;
    } else if (digit > 0) {
      return below + inner;  // every member with this prefix and a 0 here is below y
    }
  }
  return below;  // y itself is a member
}

}  // namespace

// Group 0 of a direct kind is rank_offset + its axes' digits. When those axes (of size > 1)
// are consecutive in the order, it is an arithmetic progression o + c a, c in [0, L), with
// a the stride of its fastest axis and L the group size. With gpus_per_node = G:
//   a >= G: no node holds two members, so the fewest is 1.
//   a < G:  every node from the first (q0) to the last (q1) holds members; a node strictly
//           between them lies inside the progression, so it holds floor(G/a) or ceil(G/a).
//           Their total S over the N inner nodes is known, so N * ceil - S of them hold
//           floor: the fewest is min(first, last, that).
// Otherwise the walk visits each node group 0 touches and counts its members in O(axes).
int64_t Topology::FewestGroupMembersOnANode(size_t kind_index) const {
  const GroupKind& kind = kinds_[kind_index];
  if (!GroupSpansNodes(kind_index, 0)) return 1;
  const int64_t g = config_.gpus_per_node;
  const int64_t o = config_.rank_offset;
  if (kind.derivation != GroupKind::Derivation::kDirect) {
    std::map<int64_t, int64_t> per_node;
    for (const int64_t rank : Group(kind_index, 0)) ++per_node[NodeOf(rank)];
    int64_t fewest = std::numeric_limits<int64_t>::max();
    for (const auto& [node, count] : per_node) fewest = std::min(fewest, count);
    return fewest;
  }
  const RankGenerator& generator = GeneratorOf(kind);
  const int64_t size = GroupSize(kind_index);
  const int64_t last = Member(kind_index, 0, size - 1);
  const auto below = [&](int64_t rank) {  // members of group 0 below an absolute rank
    return MembersBelow(generator, kind.mask, std::clamp<int64_t>(rank - o, 0, world_size()));
  };
  const int64_t q0 = o / g;
  const int64_t q1 = last / g;
  const auto on_node = [&](int64_t q) { return below(std::min(last + 1, (q + 1) * g)) -
                                               below(std::max(o, q * g)); };
  // Consecutive: between the fastest and slowest axes of size > 1, none is outside it.
  int64_t fastest = 0;
  bool inside = false, consecutive = true, left = false;
  for (Axis axis : generator.order()) {
    if (generator.Size(axis) == 1) continue;
    if (InMask(kind.mask, axis)) {
      if (left) consecutive = false;
      if (!inside) fastest = generator.Stride(axis);
      inside = true;
    } else if (inside) {
      left = true;
    }
  }
  if (consecutive) {
    if (fastest >= g) return 1;
    int64_t fewest = std::min(on_node(q0), on_node(q1));
    const int64_t inner_nodes = q1 - q0 - 1;
    if (inner_nodes > 0) {
      const int64_t ceil = (g + fastest - 1) / fastest;
      const int64_t sum = below(q1 * g) - below((q0 + 1) * g);
      fewest = std::min(fewest, inner_nodes * ceil - sum > 0 ? g / fastest : ceil);
    }
    return fewest;
  }
  int64_t fewest = std::numeric_limits<int64_t>::max();
  for (int64_t q = q0; q <= q1; ++q) {
    const int64_t count = on_node(q);
    if (count > 0) fewest = std::min(fewest, count);
  }
  return fewest;
}

}  // namespace mpusim
