// Properties of the planner over every factorisation of n <= 64 (and every expert
// factorisation of each), checked against an independent definition of Megatron's groups:
// two ranks share a group iff their coordinates agree outside the kind's axes; groups are
// numbered by the outside coordinates, members by the inside ones (earlier axis = faster
// digit). The reference below buckets ranks by that definition; the planner computes
// strides and offsets. They must agree group for group and rank for rank.
#include <algorithm>
#include <limits>
#include <map>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/topology.h"

namespace mpusim {
namespace {

std::vector<int64_t> Divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 1; i <= n; ++i) {
    if (n % i == 0) out.push_back(i);
  }
  return out;
}

// Reference groups of a generator kind, by bucketing every rank's coordinates.
std::vector<std::vector<int64_t>> ReferenceGroups(const std::vector<std::pair<Axis, int64_t>>& axes,
                                                  AxisMask mask, int64_t offset) {
  int64_t n = 1;
  int64_t group_size = 1;
  for (const auto& [axis, size] : axes) {
    n *= size;
    if ((mask >> static_cast<unsigned>(axis)) & 1u) group_size *= size;
  }
  std::vector<std::vector<int64_t>> groups(static_cast<size_t>(n / group_size),
                                           std::vector<int64_t>(static_cast<size_t>(group_size)));
  for (int64_t rank = 0; rank < n; ++rank) {
    int64_t rest = rank;
    int64_t group = 0, position = 0, group_radix = 1, position_radix = 1;
    for (const auto& [axis, size] : axes) {
      const int64_t coord = rest % size;
      rest /= size;
      if ((mask >> static_cast<unsigned>(axis)) & 1u) {
        position += coord * position_radix;
        position_radix *= size;
      } else {
        group += coord * group_radix;
        group_radix *= size;
      }
    }
    groups[static_cast<size_t>(group)][static_cast<size_t>(position)] = rank + offset;
  }
  return groups;
}

std::vector<std::pair<Axis, int64_t>> OrderedSizes(const RankGenerator& generator) {
  std::vector<std::pair<Axis, int64_t>> axes;
  for (Axis axis : generator.order()) axes.emplace_back(axis, generator.Size(axis));
  return axes;
}

// Checks every kind of one topology; returns the number of failed expectations' configs.
void CheckTopology(const Topology& topology, const std::string& label) {
  SCOPED_TRACE(label);
  const int64_t n = topology.world_size();
  const int64_t first = topology.first_rank();
  std::vector<int32_t> flat;
  for (size_t kind_index = 0; kind_index < topology.kinds().size(); ++kind_index) {
    const GroupKind& kind = topology.kinds()[kind_index];
    SCOPED_TRACE("kind " + kind.name);
    topology.Enumerate(kind_index, &flat);
    const int64_t size = topology.GroupSize(kind_index);
    const int64_t groups = topology.NumGroups(kind_index);
    ASSERT_EQ(static_cast<int64_t>(flat.size()), size * groups);

    const RankGenerator& generator =
        kind.generator == GroupKind::Generator::kDense ? topology.dense() : topology.expert();
    if (kind.derivation == GroupKind::Derivation::kDirect) {
      const auto reference = ReferenceGroups(OrderedSizes(generator), kind.mask, first);
      ASSERT_EQ(static_cast<int64_t>(reference.size()), groups);
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t k = 0; k < size; ++k) {
          ASSERT_EQ(flat[static_cast<size_t>(g * size + k)],
                    reference[static_cast<size_t>(g)][static_cast<size_t>(k)])
              << "group " << g << " member " << k;
        }
      }
    }
    // Kinds that cover the world partition it; embd / pos_embd are disjoint subsets.
    std::vector<int32_t> sorted = flat;
    std::sort(sorted.begin(), sorted.end());
    ASSERT_TRUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
    if (kind.covers_world) {
      ASSERT_EQ(static_cast<int64_t>(sorted.size()), n);
      ASSERT_EQ(sorted.front(), first);
      ASSERT_EQ(sorted.back(), first + n - 1);
    }
    // The per-rank query agrees with the enumeration, and Member inverts Locate.
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t k = 0; k < size; ++k) {
        const int64_t rank = flat[static_cast<size_t>(g * size + k)];
        const std::optional<GroupSlot> slot = topology.Locate(kind_index, rank);
        ASSERT_TRUE(slot.has_value()) << "rank " << rank;
        ASSERT_EQ(slot->group_index, g) << "rank " << rank;
        ASSERT_EQ(slot->rank_in_group, k) << "rank " << rank;
        ASSERT_EQ(topology.Member(kind_index, g, k), rank);
      }
    }
    if (!kind.covers_world) {
      int64_t located = 0;
      for (int64_t rank = first; rank < first + n; ++rank) {
        located += topology.Locate(kind_index, rank).has_value() ? 1 : 0;
      }
      ASSERT_EQ(located, static_cast<int64_t>(flat.size()));
    }
  }
}

TEST(TopologyProperties, EveryFactorisationUpTo64) {
  int64_t configs = 0;
  for (int64_t n = 1; n <= 64; ++n) {
    for (int64_t t : Divisors(n)) {
      for (int64_t c : Divisors(n / t)) {
        for (int64_t p : Divisors(n / (t * c))) {
          for (int64_t etp : Divisors(n / p)) {
            for (int64_t e : Divisors(n / (p * etp))) {
              ParallelConfig config;
              config.world_size = n;
              config.tensor_model_parallel_size = t;
              config.context_parallel_size = c;
              config.pipeline_model_parallel_size = p;
              config.expert_tensor_parallel_size = etp;
              config.expert_model_parallel_size = e;
              config.rank_offset = (n % 3 == 0) ? 5 : 0;
              StatusOr<Topology> topology = Topology::Create(config);
              ASSERT_TRUE(topology.ok()) << topology.status().Message();
              const DerivedSizes& s = topology->sizes();
              ASSERT_EQ(s.tp * s.cp * s.dp * s.pp, n);
              ASSERT_EQ(s.etp * s.ep * s.edp * s.pp, n);
              CheckTopology(*topology, fmt::format("n={} t={} c={} p={} etp={} ep={}", n, t, c,
                                                   p, etp, e));
              if (HasFatalFailure()) return;
              ++configs;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(configs, 27642);
}

// Two kinds of one generator whose axes are disjoint meet in exactly one rank, and the
// kind with the union of their axes has the product of their sizes.
TEST(TopologyProperties, OrthogonalKindsMeetInExactlyOneRank) {
  const std::vector<std::string> orders = {"tp-cp-ep-dp-pp", "tp-pp-dp-cp", "pp-dp-cp-tp",
                                           "dp-tp-cp-pp"};
  int64_t checked = 0;
  for (int64_t n : {8, 12, 16, 24, 36, 48, 64}) {
    for (const std::string& order : orders) {
      for (int64_t t : Divisors(n)) {
        for (int64_t c : Divisors(n / t)) {
          for (int64_t p : Divisors(n / (t * c))) {
            ParallelConfig config;
            config.world_size = n;
            config.tensor_model_parallel_size = t;
            config.context_parallel_size = c;
            config.pipeline_model_parallel_size = p;
            config.order = order;
            StatusOr<Topology> topology = Topology::Create(config);
            // Orders that do not end in pp are refused when cp > 1 and pp > 1 (the expert
            // data-parallel size, d * c, then differs from d); that rule has its own test.
            if (!topology.ok()) continue;
            ++checked;
            const std::vector<std::string> names = {"tp", "cp", "dp", "pp", "mp", "dp_cp",
                                                    "tp_dp", "tp_cp", "tp_dp_cp"};
            for (const std::string& a : names) {
              for (const std::string& b : names) {
                const GroupKind& ka = topology->kinds()[*topology->FindKind(a)];
                const GroupKind& kb = topology->kinds()[*topology->FindKind(b)];
                if ((ka.mask & kb.mask) != 0) continue;
                for (int64_t rank = 0; rank < n; ++rank) {
                  const size_t ia = *topology->FindKind(a), ib = *topology->FindKind(b);
                  auto ga = topology->Group(ia, topology->Locate(ia, rank)->group_index);
                  auto gb = topology->Group(ib, topology->Locate(ib, rank)->group_index);
                  std::sort(ga.begin(), ga.end());
                  std::sort(gb.begin(), gb.end());
                  std::vector<int64_t> both;
                  std::set_intersection(ga.begin(), ga.end(), gb.begin(), gb.end(),
                                        std::back_inserter(both));
                  ASSERT_EQ(both, std::vector<int64_t>{rank})
                      << a << " x " << b << " n=" << n << " order " << order;
                }
              }
            }
            EXPECT_EQ(topology->GroupSize(*topology->FindKind("mp")), t * p);
            EXPECT_EQ(topology->GroupSize(*topology->FindKind("tp_dp_cp")),
                      t * topology->sizes().dp * c);
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 300);
}

// Megatron compares the two generators' pp group lists; we compare pp strides. Over every
// order of the five axes and every small factorisation, both rules must agree.
TEST(TopologyProperties, PipelineGroupsAgreementMatchesListComparison) {
  std::vector<std::string> axes = {"cp", "dp", "ep", "pp", "tp"};
  int64_t refused = 0, accepted = 0;
  do {
    const std::string order = fmt::format("{}", fmt::join(axes, "-"));
    for (int64_t n : {8, 12, 16}) {
      for (int64_t t : Divisors(n)) {
        for (int64_t p : Divisors(n / t)) {
          for (int64_t etp : Divisors(n / p)) {
            for (int64_t e : Divisors(n / (p * etp))) {
              ParallelConfig config;
              config.world_size = n;
              config.tensor_model_parallel_size = t;
              config.pipeline_model_parallel_size = p;
              config.expert_tensor_parallel_size = etp;
              config.expert_model_parallel_size = e;
              config.order = order;
              StatusOr<Topology> topology = Topology::Create(config);
              const int64_t d = n / (t * p), edp = n / (etp * e * p);
              const bool dp_rule_refuses = axes.back() != "pp" && p != 1 && edp != d;
              if (dp_rule_refuses) {
                EXPECT_FALSE(topology.ok());
                continue;
              }
              // Megatron's rule, literally: the pp group lists must be equal.
              std::vector<std::pair<Axis, int64_t>> dense, expert;
              for (const std::string& name : axes) {
                const Axis axis = *ParseOrder(name, "x").value().begin();
                const int64_t ds = name == "tp" ? t : name == "dp" ? d : name == "pp" ? p : 1;
                const int64_t es = name == "tp"   ? etp
                                   : name == "ep" ? e
                                   : name == "dp" ? edp
                                   : name == "pp" ? p
                                                  : 1;
                dense.emplace_back(axis, ds);
                expert.emplace_back(axis, es);
              }
              const AxisMask pp_mask = MaskOf({Axis::kPp});
              const bool same = ReferenceGroups(dense, pp_mask, 0) ==
                                ReferenceGroups(expert, pp_mask, 0);
              EXPECT_EQ(topology.ok(), same) << order << " n=" << n << " t=" << t << " p=" << p
                                             << " etp=" << etp << " ep=" << e;
              (same ? accepted : refused) += 1;
            }
          }
        }
      }
    }
  } while (std::next_permutation(axes.begin(), axes.end()));
  EXPECT_GT(refused, 0);
  EXPECT_GT(accepted, 0);
}

TEST(TopologyProperties, DistributedOptimizerAndHierarchicalKinds) {
  for (int64_t n : {8, 16, 32, 64}) {
    for (int64_t t : Divisors(n)) {
      for (int64_t c : Divisors(n / t)) {
        const int64_t d = n / (t * c);
        for (int64_t instances : Divisors(d)) {
          ParallelConfig config;
          config.world_size = n;
          config.tensor_model_parallel_size = t;
          config.context_parallel_size = c;
          config.num_distributed_optimizer_instances = instances;
          if (c % 2 == 0) config.hierarchical_context_parallel_sizes = {2, c / 2};
          StatusOr<Topology> topology = Topology::Create(config);
          ASSERT_TRUE(topology.ok()) << topology.status().Message();
          CheckTopology(*topology, fmt::format("n={} t={} c={} instances={}", n, t, c, instances));
          if (HasFatalFailure()) return;
          EXPECT_EQ(topology->FindKind("inter_dist_opt").has_value(), instances > 1);
          EXPECT_EQ(topology->FindKind("hcp_L1").has_value(), c % 2 == 0);
        }
      }
    }
  }
}

// The closed forms of AnyGroupSpansNodes and FewestGroupMembersOnANode (which the time
// estimate uses, O(axes) instead of O(groups) or O(group size)) against the brute force
// they replace, over every factorisation (dense and expert) of n <= 24, several orders,
// node sizes that divide the world and ones that do not, and two rank offsets.
void CheckNodeQueries(const Topology& topology, const std::string& label) {
  for (size_t kind = 0; kind < topology.kinds().size(); ++kind) {
    SCOPED_TRACE(label + " kind " + topology.kinds()[kind].name);
    ASSERT_EQ(topology.AnyGroupSpansNodes(kind), topology.NumGroupsSpanningNodes(kind) > 0);
    int64_t fewest = 1;
    if (topology.GroupSpansNodes(kind, 0)) {
      std::map<int64_t, int64_t> per_node;
      for (const int64_t rank : topology.Group(kind, 0)) ++per_node[topology.NodeOf(rank)];
      fewest = std::numeric_limits<int64_t>::max();
      for (const auto& [node, count] : per_node) fewest = std::min(fewest, count);
    }
    ASSERT_EQ(topology.FewestGroupMembersOnANode(kind), fewest);
  }
}

TEST(TopologyProperties, NodeQueriesMatchBruteForce) {
  int64_t checked = 0;
  const std::vector<std::string> orders = {"tp-cp-ep-dp-pp", "tp-pp-dp-cp", "pp-dp-cp-tp",
                                           "dp-tp-cp-pp", "cp-dp-tp-pp"};
  for (int64_t n = 1; n <= 24; ++n) {
    for (const std::string& order : orders) {
      for (int64_t t : Divisors(n)) {
        for (int64_t c : Divisors(n / t)) {
          for (int64_t p : Divisors(n / (t * c))) {
            for (int64_t etp : Divisors(n / p)) {
              for (int64_t e : Divisors(n / (p * etp))) {
                for (int64_t gpus_per_node : {1, 2, 3, 4, 6, 8, 64}) {
                  for (int64_t offset : {0, 5}) {
                    ParallelConfig config;
                    config.world_size = n;
                    config.gpus_per_node = gpus_per_node;
                    config.tensor_model_parallel_size = t;
                    config.context_parallel_size = c;
                    config.pipeline_model_parallel_size = p;
                    config.expert_tensor_parallel_size = etp;
                    config.expert_model_parallel_size = e;
                    config.rank_offset = offset;
                    config.order = order;
                    StatusOr<Topology> topology = Topology::Create(config);
                    if (!topology.ok()) continue;  // orders refused with cp > 1 and pp > 1
                    CheckNodeQueries(*topology,
                                     fmt::format("n={} {} t={} c={} p={} etp={} ep={} G={} o={}",
                                                 n, order, t, c, p, etp, e, gpus_per_node,
                                                 offset));
                    if (HasFatalFailure()) return;
                    ++checked;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 134708);
}

}  // namespace
}  // namespace mpusim
