// Fuzz target: config text -> ParseJsonText -> ParseConfig -> Topology -> Graph plan.
//
// What it is: the libFuzzer entry point for the config reader (core/config/config.h) and what
// `mpusim layout` and `mpusim run` do next with an accepted config, short of running it:
// build the planner (Topology::Create), locate the first and last rank in every group kind,
// and plan the layer graph (Graph::Build, Graph::Plan). Any input may be refused with a
// Status; a crash, a sanitizer report, a hang, an uncaught exception or a broken planner
// invariant (below) is a finding.
// Invariants checked on every accepted config, each in O(axes):
//   Locate(kind, r) = (g, i)  =>  g < NumGroups(kind), i < GroupSize(kind),
//                                 Member(kind, g, i) = r
// and, when world_size <= kMaxEnumeratedWorld, Enumerate(kind) lists NumGroups * GroupSize
// ranks with flat[g * GroupSize + i] = Member(kind, g, i). Larger worlds (up to 2^31 ranks)
// are never enumerated, so the fuzzer does not spend itself on allocation.
// What it is not: a test of what a valid config means (tests/core/ checks that against
// Megatron's groups). Built with -fsanitize=fuzzer when MPUSIM_FUZZ=ON, and always with
// replay_main.cc as the ctest test fuzz_replay_fuzz_config.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "core/config/config.h"
#include "core/model/graph.h"
#include "core/topology.h"

namespace {

constexpr int64_t kMaxEnumeratedWorld = 512;

void Require(bool holds, const char* invariant, size_t kind, int64_t rank) {
  if (holds) return;
  std::fprintf(stderr, "fuzz_config: planner invariant broken: %s (kind %zu, rank %lld)\n",
               invariant, kind, static_cast<long long>(rank));
  std::abort();
}

void CheckPlanner(const mpusim::Topology& topology) {
  const int64_t first = topology.first_rank();
  const int64_t last = first + topology.world_size() - 1;
  for (size_t kind = 0; kind < topology.kinds().size(); ++kind) {
    const int64_t group_size = topology.GroupSize(kind);
    const int64_t num_groups = topology.NumGroups(kind);
    for (int64_t rank : {first, last}) {
      const std::optional<mpusim::GroupSlot> slot = topology.Locate(kind, rank);
      if (!slot) continue;
      Require(slot->group_index >= 0 && slot->group_index < num_groups, "group_index in range",
              kind, rank);
      Require(slot->rank_in_group >= 0 && slot->rank_in_group < group_size,
              "rank_in_group in range", kind, rank);
      Require(topology.Member(kind, slot->group_index, slot->rank_in_group) == rank,
              "Member(Locate(rank)) == rank", kind, rank);
    }
    if (topology.world_size() > kMaxEnumeratedWorld) continue;
    std::vector<int32_t> flat;
    topology.Enumerate(kind, &flat);
    Require(static_cast<int64_t>(flat.size()) == num_groups * group_size,
            "Enumerate lists NumGroups * GroupSize ranks", kind, first);
    for (int64_t g = 0; g < num_groups; ++g) {
      for (int64_t i = 0; i < group_size; ++i) {
        const int64_t listed = flat[static_cast<size_t>(g * group_size + i)];
        Require(listed == topology.Member(kind, g, i), "Enumerate agrees with Member", kind,
                listed);
      }
    }
  }
  topology.Coordinates(first);
  topology.Coordinates(last);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  mpusim::StatusOr<nlohmann::json> document = mpusim::ParseJsonText(text);
  if (!document.ok()) return 0;
  mpusim::Config config;
  if (!mpusim::ParseConfig(*document, &config).ok()) return 0;
  mpusim::StatusOr<mpusim::Topology> topology = mpusim::Topology::Create(config.parallel);
  if (!topology.ok()) return 0;
  CheckPlanner(*topology);
  if (!config.model || !config.run) return 0;
  mpusim::StatusOr<std::unique_ptr<mpusim::Graph>> graph =
      mpusim::Graph::Build(config, *topology);
  if (!graph.ok()) return 0;
  const int64_t last = topology->first_rank() + topology->world_size() - 1;
  (*graph)->Plan(topology->Coordinates(topology->first_rank()));
  (*graph)->Plan(topology->Coordinates(last));
  return 0;
}
