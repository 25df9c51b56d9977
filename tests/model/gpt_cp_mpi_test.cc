// Context parallelism (cp_comm_type "all_gather", "p2p", "a2a" and "a2a+p2p") on K MPI ranks
// against
// the float64 GPT reference: every cp x tp x dp layout the world allows, with and without sequence
// parallelism, learned position embeddings and RoPE with grouped-query attention, dropout on
// (masks drawn per global element, so every layout computes the same numbers); with a
// pipeline, and training with the distributed optimizer sharded over dp x cp. Each layout's
// loss equals the cp = 1 layout's with the same data-parallel split. Megatron's
// rng_tracker dropout on cp layouts matches the reference drawing the same masks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <nlohmann/json.hpp>
#include <vector>

#include "tests/model/gpt_mpi_helpers.h"
#include "tests/mpi/world.h"

namespace mpusim {
namespace {

using nlohmann::json;
using namespace gpt_mpi;

struct Layout {
  int64_t cp, tp;
  bool sp;
};

// The cp_comm_types a layout runs: all of them with cp > 1 ("a2a" where the query groups
// divide over tp x cp, "a2a+p2p", its all-to-all over 2 cp ranks, over tp x 2), "all_gather"
// alone (the one read) with cp = 1.
std::vector<const char*> Comms(int64_t cp, int64_t tp, int64_t groups) {
  if (cp == 1) return {"all_gather"};
  std::vector<const char*> comms = {"all_gather", "p2p"};
  if (groups % (tp * cp) == 0) comms.push_back("a2a");
  if (groups % (tp * 2) == 0) comms.push_back("a2a+p2p");
  return comms;
}

// Every cp in {1, 2, 4} and tp in {1, 2, 4} whose product divides the world.
std::vector<Layout> Layouts() {
  std::vector<Layout> layouts;
  for (int64_t cp : {1, 2, 4}) {
    for (int64_t tp : {1, 2, 4}) {
      if (cp * tp > WorldSize() || WorldSize() % (cp * tp) != 0) continue;
      for (bool sp : {false, true}) {
        if (sp && tp == 1) continue;
        layouts.push_back({cp, tp, sp});
      }
    }
  }
  return layouts;
}

TEST(GptContextParallel, EveryLayoutMatchesTheReferenceAndCpOne) {
  for (const char* kind : {"gpt", "llama"}) {
    // Llama-style: RoPE at each token's global position, 4 query groups.
    const bool gpt = std::string(kind) == "gpt";
    const json model = gpt ? Gpt(8, 8) : Llama(8, 4);
    std::map<int64_t, double> cp_one;  // by tp (the Llama vocabulary pads per tp size)
    for (const Layout& l : Layouts()) {
      for (const char* comm : Comms(l.cp, l.tp, gpt ? 8 : 4)) {
        SCOPED_TRACE(fmt::format("{}: cp {} ({}) tp {} sequence_parallel {}", kind, l.cp, comm,
                                 l.tp, l.sp));
        if (WorldRank() == 0) {
          fmt::print("  {} cp {} {} tp {} sp {}:", kind, l.cp, comm, l.tp, l.sp);
        }
        const double loss =
            RunChecked(CpDocument(model, l.cp, l.tp, 1, l.sp, "float64", comm)).loss;
        if (l.cp == 1) cp_one.try_emplace(l.tp, loss);
        ASSERT_EQ(cp_one.count(l.tp), 1u);
        EXPECT_NEAR(loss, cp_one.at(l.tp), 1e-12 * cp_one.at(l.tp));
      }
    }
  }
}

// A pipeline of two stages with cp 2, and 3 Adam iterations with the distributed optimizer
// (its shards over dp x cp): every iteration's loss and gradient norm equal the cp = 1 run's.
// A dense GPT with global dropout masks computes the same numbers on any dp split, so the
// cp = 1 run may use the cp ranks as more dp ranks.
TEST(GptContextParallel, PipelineAndDistributedOptimizerTrainAsCpOne) {
  if (WorldSize() < 4) GTEST_SKIP() << "needs cp 2 x pp 2";
  json model = Llama(8, 4);
  model["num_layers"] = 4;
  std::vector<std::vector<double>> curves;
  for (const auto& [cp, comm] : {std::pair<int64_t, const char*>{1, "all_gather"},
                                 {2, "all_gather"}, {2, "p2p"}, {2, "a2a"}, {2, "a2a+p2p"}}) {
    SCOPED_TRACE(fmt::format("cp {} {}", cp, comm));
    if (WorldRank() == 0) fmt::print("  cp {} {} pp 2, distributed optimizer:", cp, comm);
    curves.push_back(
        DistributedOptimizerCurve(CpDocument(model, cp, 1, 2, false, "float64", comm)));
  }
  ExpectSameCurves(curves);
}

// 16-bit storage with selective recomputation (core attention rerun: the keys gathered
// again, the ring run again, or the heads exchanged again).
TEST(GptContextParallel, BFloat16WithSelectiveRecomputation) {
  if (WorldSize() < 2) GTEST_SKIP() << "needs cp 2";
  const int64_t tp = WorldSize() >= 4 ? 2 : 1;
  for (const char* comm : {"all_gather", "p2p", "a2a", "a2a+p2p"}) {
    if (WorldRank() == 0) fmt::print("  bfloat16 cp 2 {} tp {}:", comm, tp);
    json document = CpDocument(Llama(8, 4), 2, tp, 1, tp > 1, "bfloat16", comm);
    document["run"]["recompute_granularity"] = "selective";
    RunChecked(document);
  }
}

// dropout_mode "rng_tracker": each rank draws from its tracker with local indices, and cp
// ranks share Megatron's streams (the seeds hold the tp, pp and dp ranks only), so the masks
// follow the layout. Every cp layout matches the reference drawing the same masks; with a
// pipeline and training too.
TEST(GptContextParallel, RngTrackerDropoutMatchesTheReference) {
  if (WorldSize() < 2) GTEST_SKIP() << "needs cp 2";
  json model = Gpt(8, 8);
  model["dropout_mode"] = "rng_tracker";
  for (const Layout& l : Layouts()) {
    if (l.cp == 1) continue;
    for (const char* comm : Comms(l.cp, l.tp, 8)) {
      if (std::string(comm) == "a2a+p2p") continue;  // refused with rng_tracker masks
      SCOPED_TRACE(fmt::format("cp {} {} tp {} sequence_parallel {}", l.cp, comm, l.tp, l.sp));
      if (WorldRank() == 0) {
        fmt::print("  rng_tracker cp {} {} tp {} sp {}:", l.cp, comm, l.tp, l.sp);
      }
      RunChecked(CpDocument(model, l.cp, l.tp, 1, l.sp, "float64", comm));
    }
  }
  if (WorldSize() < 4) return;
  model["num_layers"] = 4;
  if (WorldRank() == 0) fmt::print("  rng_tracker cp 2 pp 2, 2 Adam iterations:");
  for (const char* comm : {"all_gather", "a2a"}) {
    json document = Training(CpDocument(model, 2, 1, 2, false, "float64", comm), "adam");
    document["run"]["train_iters"] = 2;
    RunChecked(document);
  }
}

TEST(GptContextParallel, RefusalsNameTheField) {
  if (WorldSize() < 2) GTEST_SKIP() << "needs cp 2";
  json document = CpDocument(Gpt(8, 8), 2, 1, 1, false, "float64");
  document["model"]["cp_comm_type"] = "a2a+p2p";
  StatusOr<run::SimulationResult> result = Simulate(document);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().Message(),
            "model.cp_comm_type: \"a2a+p2p\" needs parallel.hierarchical_context_parallel_sizes "
            "[a2a size, p2p size] (two levels multiplying to context_parallel_size 2), got 0 "
            "levels");
  document["parallel"]["hierarchical_context_parallel_sizes"] = {2, 1};
  document["model"]["num_query_groups"] = 1;
  result = Simulate(document);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().Message(),
            "model.cp_comm_type: \"a2a+p2p\" gives each rank 1/2 of its tp rank's heads, so "
            "num_query_groups 1 must be divisible by tensor_model_parallel_size * "
            "hierarchical_context_parallel_sizes[0] = 2");
  document["model"]["num_query_groups"] = 8;
  document["model"]["dropout_mode"] = "rng_tracker";
  document["model"]["attention_dropout"] = 0.1;
  result = Simulate(document);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().Message(),
            "model.dropout_mode: \"rng_tracker\" with attention_dropout and cp_comm_type "
            "\"a2a+p2p\" is not built yet (its masks' local indices); set dropout_mode "
            "\"global\" or another cp_comm_type");
  document["model"].erase("dropout_mode");
  document["parallel"].erase("hierarchical_context_parallel_sizes");
  document["model"]["cp_comm_type"] = "a2a";
  document["model"]["num_query_groups"] = 1;
  result = Simulate(document);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().Message(),
            "model.cp_comm_type: \"a2a\" gives each cp rank 1/cp of its tp rank's heads, so "
            "num_query_groups 1 must be divisible by tensor_model_parallel_size * "
            "context_parallel_size = 2; set \"p2p\" or \"all_gather\", or another layout");
  document["model"]["cp_comm_type"] = "all_gather";
  document["run"]["seq_length"] = 10;
  result = Simulate(document);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().Message(),
            "run.seq_length: 10 is not divisible by 2 * context_parallel_size = 4 (each cp rank "
            "holds two of 2 * cp equal chunks)");
}

}  // namespace
}  // namespace mpusim
