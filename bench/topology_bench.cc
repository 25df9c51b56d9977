// Google Benchmark programs for the planner (core/topology.h) at cluster scale.
//
// What it is: the numbers behind three claims about the planner, measured on one
// Megatron-style layout scaled to n = 2^16, 2^18 and 2^20 ranks:
//   BM_EnumerateAllKinds/n  every group kind enumerated in well under 1 s at n = 2^20, with
//                           memory linear in n (bytes_per_rank stays flat as n grows);
//   BM_RankQuery            one rank's slot in every kind plus its coordinates in < 1 us;
//   BM_TopologyCreate       building the planner itself (independent of n).
// What it is not: a correctness test (tests/core checks the layouts) or a model of
// process-group creation time in NCCL or MPI.
//
// Layout, default order tp-cp-ep-dp-pp:
//   dense:  tp 8, cp 2, pp 16, dp = n / 256
//   expert: etp 1, ep 8, pp 16, edp = n / 128, 2 distributed-optimizer instances
// which exercises every derivation: direct kinds, picks (embd, pos_embd with pp 16), a
// concatenation (intra_dist_opt) and a strided split (inter_dist_opt).
//
// Counters (formulas):
//   ranks, kinds          n and topology.kinds().size()
//   bytes_per_rank        sum over kinds of 4 * (ranks listed by that kind) / n: the size of
//                         the enumerated group lists, all held at once
//   items_per_second      ranks * kinds / time   (one item = one rank placed in one kind)
//   peak_rss_MiB          getrusage(RUSAGE_SELF).ru_maxrss / 1024 after the run; the
//                         high-water mark is reset first through /proc/self/clear_refs where
//                         the kernel allows it, so each size reports its own peak
//   rss_growth_bytes_per_rank  (peak RSS - RSS when the run started) / n: the memory the
//                         run itself needed per rank, without the program's fixed footprint
//   time_per_kind         BM_RankQuery time per Locate() of one rank in one kind
//
// Run: bench/run_topology_bench.sh [path/to/topology_bench]
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <utility>
#include <vector>

#include "core/config/parallel_config.h"
#include "core/topology.h"

namespace mpusim {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

ParallelConfig BenchConfig(int64_t world_size) {
  ParallelConfig config;
  config.world_size = world_size;
  config.gpus_per_node = 8;
  config.tensor_model_parallel_size = 8;
  config.context_parallel_size = 2;
  config.pipeline_model_parallel_size = 16;
  config.expert_model_parallel_size = 8;
  config.expert_tensor_parallel_size = 1;
  config.num_distributed_optimizer_instances = 2;
  return config;
}

// Aborts the benchmark run: a config this program builds itself must be valid.
Topology CreateOrDie(int64_t world_size) {
  StatusOr<Topology> topology = Topology::Create(BenchConfig(world_size));
  if (!topology.ok()) {
    std::fprintf(stderr, "topology_bench: invalid benchmark config (n=%lld): %s\n",
                 static_cast<long long>(world_size), topology.status().Message().c_str());
    std::exit(2);
  }
  return std::move(topology).value();
}

// Resets the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); a no-op elsewhere or
// where /proc is read-only, in which case peak_rss_MiB is the process-wide peak so far.
void ResetPeakRss() {
  if (std::FILE* file = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", file);
    std::fclose(file);
  }
}

int64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // ru_maxrss is in KiB on Linux
}

void BM_EnumerateAllKinds(benchmark::State& state) {
  const int64_t n = state.range(0);
  const Topology topology = CreateOrDie(n);
  const size_t num_kinds = topology.kinds().size();
  ResetPeakRss();
  const int64_t start_rss = PeakRssBytes();  // right after the reset: the current RSS

  int64_t listed_bytes = 0;
  for (auto _ : state) {
    // Fresh lists every iteration, all alive together: the cost and the memory of writing a
    // whole layout out, allocation and first-touch page faults included.
    std::vector<std::vector<int32_t>> lists(num_kinds);
    for (size_t kind = 0; kind < num_kinds; ++kind) {
      topology.Enumerate(kind, &lists[kind]);
      benchmark::DoNotOptimize(lists[kind].data());
    }
    benchmark::ClobberMemory();
    listed_bytes = 0;
    for (const auto& list : lists) {
      listed_bytes += static_cast<int64_t>(list.size() * sizeof(int32_t));
    }
  }

  const double ranks = static_cast<double>(n);
  const int64_t peak_rss = PeakRssBytes();
  state.SetItemsProcessed(state.iterations() * n * static_cast<int64_t>(num_kinds));
  state.counters["ranks"] = ranks;
  state.counters["kinds"] = static_cast<double>(num_kinds);
  state.counters["bytes_per_rank"] = static_cast<double>(listed_bytes) / ranks;
  state.counters["peak_rss_MiB"] = static_cast<double>(peak_rss) / static_cast<double>(kMiB);
  state.counters["rss_growth_bytes_per_rank"] = static_cast<double>(peak_rss - start_rss) / ranks;
}
BENCHMARK(BM_EnumerateAllKinds)
    ->Arg(int64_t{1} << 16)
    ->Arg(int64_t{1} << 18)
    ->Arg(int64_t{1} << 20)
    ->Unit(benchmark::kMillisecond);

void BM_RankQuery(benchmark::State& state) {
  const int64_t n = int64_t{1} << 20;
  const Topology topology = CreateOrDie(n);
  const size_t num_kinds = topology.kinds().size();

  // Pseudo-random ranks from a fixed-seed 64-bit LCG (Knuth's MMIX constants), precomputed
  // so the generator is not timed; the high bits are the well-mixed ones.
  constexpr size_t kNumQueries = 4096;  // a power of two: the index wraps with a mask
  std::vector<int64_t> ranks(kNumQueries);
  uint64_t lcg = 0x2545F4914F6CDD1DULL;
  for (int64_t& rank : ranks) {
    lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    rank = static_cast<int64_t>((lcg >> 33) % static_cast<uint64_t>(n));
  }

  size_t next = 0;
  for (auto _ : state) {
    const int64_t rank = ranks[next++ & (kNumQueries - 1)];
    for (size_t kind = 0; kind < num_kinds; ++kind) {
      std::optional<GroupSlot> slot = topology.Locate(kind, rank);
      benchmark::DoNotOptimize(slot);
    }
    RankCoordinates coordinates = topology.Coordinates(rank);
    benchmark::DoNotOptimize(coordinates);
  }

  state.SetItemsProcessed(state.iterations());  // items = ranks queried
  state.counters["ranks"] = static_cast<double>(n);
  state.counters["kinds"] = static_cast<double>(num_kinds);
  // Seconds per Locate() of one rank in one kind (Coordinates() folded in).
  state.counters["time_per_kind"] = benchmark::Counter(
      static_cast<double>(num_kinds),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_RankQuery);

void BM_TopologyCreate(benchmark::State& state) {
  const ParallelConfig config = BenchConfig(int64_t{1} << 20);
  for (auto _ : state) {
    StatusOr<Topology> topology = Topology::Create(config);
    benchmark::DoNotOptimize(topology);
  }
  state.counters["ranks"] = static_cast<double>(config.world_size);
}
BENCHMARK(BM_TopologyCreate)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace mpusim

BENCHMARK_MAIN();
