// Tests for core/schedule: Megatron's recorded schedules (golden), hand-written 1F1B examples,
// properties over every small (p, v, M, N), every refusal, and the layer assignment.
//
// Not a performance test: the dataflow simulation below uses unit-time steps only to prove
// that every rank's order can complete, not to predict how long it takes.
#include "core/schedule.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#ifndef MPUSIM_TEST_DATA_DIR
#error "MPUSIM_TEST_DATA_DIR must name the tests/data folder"
#endif

namespace mpusim {
namespace {

size_t Idx(int64_t i) { return static_cast<size_t>(i); }

PipelineSchedule BuildOrDie(int64_t pp_size, std::optional<int64_t> vp_size,
                            int64_t num_microbatches, std::optional<int64_t> group_size) {
  StatusOr<PipelineSchedule> schedule =
      BuildPipelineSchedule(pp_size, vp_size, num_microbatches, group_size);
  EXPECT_TRUE(schedule.ok()) << schedule.status().Message();
  return schedule.ok() ? *schedule : PipelineSchedule{};
}

std::string Describe(int64_t pp_size, std::optional<int64_t> vp_size, int64_t num_microbatches,
                     std::optional<int64_t> group_size) {
  std::ostringstream out;
  out << "p=" << pp_size << " v=" << (vp_size ? std::to_string(*vp_size) : "none")
      << " M=" << num_microbatches << " N=" << (group_size ? std::to_string(*group_size) : "none");
  return out.str();
}

// ---------------------------------------------------------------------------------------------
// Golden: Megatron's own output for the two documented interleaved examples.

TEST(ScheduleGoldenTest, DocsExamplesMatchMegatron) {
  const std::string path =
      std::string(MPUSIM_TEST_DATA_DIR) + "/golden/schedules/docs_examples.json";
  std::ifstream file(path);
  ASSERT_TRUE(file.good()) << "cannot open " << path;
  const nlohmann::json golden = nlohmann::json::parse(file);
  const nlohmann::json& cases = golden.at("cases");
  ASSERT_GT(cases.size(), 0u) << "no cases in " << path;

  for (const nlohmann::json& c : cases) {
    const int64_t pp_size = c.at("pp").get<int64_t>();
    const int64_t vp_size = c.at("vp").get<int64_t>();
    const int64_t num_microbatches = c.at("num_microbatches").get<int64_t>();
    const int64_t group_size = c.at("microbatch_group_size_per_vp_stage").get<int64_t>();
    SCOPED_TRACE(Describe(pp_size, vp_size, num_microbatches, group_size));

    const PipelineSchedule schedule = BuildOrDie(pp_size, vp_size, num_microbatches, group_size);
    EXPECT_TRUE(schedule.interleaved);
    EXPECT_EQ(schedule.num_model_chunks, vp_size);
    EXPECT_EQ(schedule.microbatch_group_size_per_vp_stage, group_size);

    std::vector<int64_t> microbatch_ids;
    std::vector<int64_t> chunk_ids;
    for (const auto& [microbatch, chunk] : schedule.forward_table) {
      microbatch_ids.push_back(microbatch);
      chunk_ids.push_back(chunk);
    }
    EXPECT_EQ(microbatch_ids, c.at("microbatch_id_sequence").get<std::vector<int64_t>>());
    EXPECT_EQ(chunk_ids, c.at("model_chunk_id_sequence").get<std::vector<int64_t>>());

    const nlohmann::json& compute = c.at("per_rank_compute");
    const nlohmann::json& order = c.at("per_rank_order");
    ASSERT_EQ(compute.size(), Idx(pp_size));
    ASSERT_EQ(schedule.per_rank.size(), Idx(pp_size));
    for (int64_t pp_rank = 0; pp_rank < pp_size; ++pp_rank) {
      SCOPED_TRACE("pp_rank " + std::to_string(pp_rank));
      const std::string key = std::to_string(pp_rank);
      EXPECT_EQ(FormatRank(schedule, pp_rank), compute.at(key).get<std::string>());
      // Megatron's trace encoding of the same order: +(chunk+1) forward, -(chunk+1) backward.
      std::vector<int64_t> signed_chunks;
      for (const ScheduleStep& step : schedule.per_rank[Idx(pp_rank)]) {
        const int64_t chunk = step.model_chunk + 1;
        signed_chunks.push_back(step.pass == Pass::kForward ? chunk : -chunk);
      }
      EXPECT_EQ(signed_chunks, order.at(key).get<std::vector<int64_t>>());
    }
  }
}

// The ModelParallelConfig docstring prints the table's microbatch ids per rank.
TEST(ScheduleGoldenTest, DocstringMicrobatchSequences) {
  auto microbatch_ids = [](const PipelineSchedule& schedule) {
    std::string out;
    for (const auto& [microbatch, chunk] : schedule.forward_table) {
      if (!out.empty()) out += ' ';
      out += std::to_string(microbatch);
    }
    return out;
  };
  EXPECT_EQ(microbatch_ids(BuildOrDie(2, 2, 4, 2)), "0 1 0 1 2 3 2 3");
  EXPECT_EQ(microbatch_ids(BuildOrDie(2, 2, 5, 3)), "0 1 2 0 1 2 3 4 3 4");
}

// ---------------------------------------------------------------------------------------------
// Hand-written examples of the non-interleaved and interleaved rules.

TEST(ScheduleTest, NonInterleavedOneFOneB) {
  const PipelineSchedule schedule = BuildOrDie(4, std::nullopt, 6, std::nullopt);
  EXPECT_FALSE(schedule.interleaved);
  EXPECT_EQ(schedule.num_model_chunks, 1);
  EXPECT_EQ(schedule.microbatch_group_size_per_vp_stage, 4);
  EXPECT_EQ(FormatRank(schedule, 0), "F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 F0.5 B0.2 B0.3 B0.4 B0.5");
  EXPECT_EQ(FormatRank(schedule, 1), "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 F0.4 B0.2 F0.5 B0.3 B0.4 B0.5");
  EXPECT_EQ(FormatRank(schedule, 3), "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 F0.4 B0.4 F0.5 B0.5");
  EXPECT_EQ(schedule.NumWarmup(0), 3);
  EXPECT_EQ(schedule.NumWarmup(3), 0);
}

TEST(ScheduleTest, NonInterleavedWarmupClampedToMicrobatches) {
  const PipelineSchedule schedule = BuildOrDie(4, std::nullopt, 2, std::nullopt);
  EXPECT_EQ(schedule.NumWarmup(0), 2);
  EXPECT_EQ(FormatRank(schedule, 0), "F0.0 F0.1 B0.0 B0.1");
  EXPECT_EQ(FormatRank(schedule, 2), "F0.0 F0.1 B0.0 B0.1");  // warmup 1, one steady pair
  EXPECT_EQ(FormatRank(schedule, 3), "F0.0 B0.0 F0.1 B0.1");
}

TEST(ScheduleTest, SingleStageAlternates) {
  const PipelineSchedule schedule = BuildOrDie(1, std::nullopt, 3, std::nullopt);
  ASSERT_EQ(schedule.per_rank.size(), 1u);
  EXPECT_EQ(FormatRank(schedule, 0), "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2");
}

TEST(ScheduleTest, InterleavedAllWarmupWhenWarmupReachesTotal) {
  // p = 2, v = 2, M = N = 2: rank 0 warmup = 2 + 2 = 4 = M*v, so all forwards come first.
  const PipelineSchedule schedule = BuildOrDie(2, 2, 2, std::nullopt);
  EXPECT_EQ(schedule.NumWarmup(0), 4);
  EXPECT_EQ(FormatRank(schedule, 0), "F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 B0.0 B0.1");
  EXPECT_EQ(schedule.NumWarmup(1), 2);
  EXPECT_EQ(FormatRank(schedule, 1), "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 B0.0 B0.1");
}

TEST(ScheduleTest, InterleavedFinalGroupIsTheRemainder) {
  // p = 2, N = 3, M = 8: groups [0,3) [3,6) and a final [6,8) of M % N = 2 >= p microbatches.
  const PipelineSchedule schedule = BuildOrDie(2, 2, 8, 3);
  const std::vector<std::pair<int64_t, int64_t>> expected = {
      {0, 0}, {1, 0}, {2, 0}, {0, 1}, {1, 1}, {2, 1}, {3, 0}, {4, 0},
      {5, 0}, {3, 1}, {4, 1}, {5, 1}, {6, 0}, {7, 0}, {6, 1}, {7, 1}};
  EXPECT_EQ(schedule.forward_table, expected);
}

TEST(ScheduleTest, FormatStep) {
  EXPECT_EQ(FormatStep({Pass::kForward, 1, 0}), "F1.0");
  EXPECT_EQ(FormatStep({Pass::kBackward, 0, 12}), "B0.12");
  EXPECT_EQ(FormatStep({Pass::kBackward, 3, 7}), "B3.7");
}

TEST(ScheduleTest, BadRankIsOutOfRange) {
  const PipelineSchedule schedule = BuildOrDie(2, std::nullopt, 2, std::nullopt);
  EXPECT_THROW(FormatRank(schedule, 2), std::out_of_range);
  EXPECT_THROW(FormatRank(schedule, -1), std::out_of_range);
  EXPECT_THROW(static_cast<void>(schedule.NumWarmup(2)), std::out_of_range);
}

// ---------------------------------------------------------------------------------------------
// Properties over every small configuration.

// Index of a (pass, chunk, microbatch) step in a flat per-rank array.
size_t StepIndex(Pass pass, int64_t chunk, int64_t microbatch, int64_t num_chunks,
                 int64_t num_microbatches) {
  const int64_t pass_index = pass == Pass::kForward ? 0 : 1;
  return Idx((pass_index * num_chunks + chunk) * num_microbatches + microbatch);
}

// Each rank runs every forward and every backward exactly once, each backward after its own
// forward, and the forwards in table order.
testing::AssertionResult PerRankValid(const PipelineSchedule& schedule) {
  const int64_t v = schedule.num_model_chunks;
  const int64_t m = schedule.num_microbatches;
  if (schedule.forward_table.size() != Idx(v * m)) {
    return testing::AssertionFailure()
           << "forward_table has " << schedule.forward_table.size() << " entries, want " << v * m;
  }
  if (schedule.per_rank.size() != Idx(schedule.pipeline_model_parallel_size)) {
    return testing::AssertionFailure() << "per_rank has " << schedule.per_rank.size() << " ranks";
  }
  for (size_t pp_rank = 0; pp_rank < schedule.per_rank.size(); ++pp_rank) {
    const std::vector<ScheduleStep>& steps = schedule.per_rank[pp_rank];
    std::vector<int> seen(Idx(2 * v * m), 0);
    size_t next_forward = 0;
    int64_t forwards_before_backward = 0;
    bool saw_backward = false;
    for (const ScheduleStep& step : steps) {
      if (step.model_chunk < 0 || step.model_chunk >= v || step.microbatch < 0 ||
          step.microbatch >= m) {
        return testing::AssertionFailure()
               << "rank " << pp_rank << ": bad step " << FormatStep(step);
      }
      if (++seen[StepIndex(step.pass, step.model_chunk, step.microbatch, v, m)] != 1) {
        return testing::AssertionFailure()
               << "rank " << pp_rank << ": repeats " << FormatStep(step);
      }
      if (step.pass == Pass::kForward) {
        const auto& [microbatch, chunk] = schedule.forward_table[next_forward++];
        if (step.microbatch != microbatch || step.model_chunk != chunk) {
          return testing::AssertionFailure()
                 << "rank " << pp_rank << ": forward " << FormatStep(step) << " out of table order";
        }
        if (!saw_backward) {
          ++forwards_before_backward;
        }
      } else {
        saw_backward = true;
        if (seen[StepIndex(Pass::kForward, step.model_chunk, step.microbatch, v, m)] != 1) {
          return testing::AssertionFailure()
                 << "rank " << pp_rank << ": " << FormatStep(step) << " before its forward";
        }
      }
    }
    if (steps.size() != Idx(2 * v * m)) {
      return testing::AssertionFailure()
             << "rank " << pp_rank << " has " << steps.size() << " steps, want " << 2 * v * m;
    }
    const int64_t warmup = schedule.NumWarmup(static_cast<int64_t>(pp_rank));
    if (forwards_before_backward != std::min(warmup + 1, v * m)) {
      return testing::AssertionFailure()
             << "rank " << pp_rank << ": " << forwards_before_backward
             << " forwards before the first backward, NumWarmup " << warmup;
    }
  }
  return testing::AssertionSuccess();
}

// Runs every rank in lock step, one unit-time op per rank per tick; an op may start once the
// ops it consumes finished in an earlier tick:
//   F(c,m) on r needs F(c,m) on r-1, or F(c-1,m) on p-1 when r == 0 and c > 0;
//   B(c,m) on r needs F(c,m) on r, and B(c,m) on r+1, or B(c+1,m) on 0 when r == p-1 and
//   c < v-1.
// Fails if a tick passes in which no rank can move before all are done (a deadlock).
testing::AssertionResult DataflowCompletes(const PipelineSchedule& schedule) {
  const int64_t p = schedule.pipeline_model_parallel_size;
  const int64_t v = schedule.num_model_chunks;
  const int64_t m = schedule.num_microbatches;
  constexpr int64_t kNotDone = -1;
  // finished[r][StepIndex] = tick at which that op finished on rank r.
  std::vector<std::vector<int64_t>> finished(Idx(p),
                                             std::vector<int64_t>(Idx(2 * v * m), kNotDone));
  std::vector<size_t> next(Idx(p), 0);
  auto done_before = [&](int64_t pp_rank, Pass pass, int64_t chunk, int64_t microbatch,
                         int64_t tick) {
    const int64_t at = finished[Idx(pp_rank)][StepIndex(pass, chunk, microbatch, v, m)];
    return at != kNotDone && at < tick;
  };
  auto ready = [&](int64_t r, const ScheduleStep& step, int64_t tick) {
    const int64_t c = step.model_chunk;
    const int64_t mb = step.microbatch;
    if (step.pass == Pass::kForward) {
      if (r > 0) {
        return done_before(r - 1, Pass::kForward, c, mb, tick);
      }
      if (c > 0) {
        return done_before(p - 1, Pass::kForward, c - 1, mb, tick);
      }
      return true;
    }
    if (!done_before(r, Pass::kForward, c, mb, tick)) {
      return false;
    }
    if (r < p - 1) {
      return done_before(r + 1, Pass::kBackward, c, mb, tick);
    }
    if (c < v - 1) {
      return done_before(0, Pass::kBackward, c + 1, mb, tick);
    }
    return true;
  };

  const size_t steps_per_rank = Idx(2 * v * m);
  size_t remaining = Idx(p) * steps_per_rank;
  for (int64_t tick = 0; remaining > 0; ++tick) {
    bool moved = false;
    for (int64_t r = 0; r < p; ++r) {
      size_t& i = next[Idx(r)];
      if (i == steps_per_rank) {
        continue;
      }
      const ScheduleStep& step = schedule.per_rank[Idx(r)][i];
      if (!ready(r, step, tick)) {
        continue;
      }
      finished[Idx(r)][StepIndex(step.pass, step.model_chunk, step.microbatch, v, m)] = tick;
      ++i;
      --remaining;
      moved = true;
    }
    if (!moved) {
      testing::AssertionResult failure = testing::AssertionFailure();
      failure << "deadlock at tick " << tick << ", waiting:";
      for (int64_t r = 0; r < p; ++r) {
        const size_t i = next[Idx(r)];
        failure << " rank " << r << " "
                << (i == steps_per_rank ? "done" : FormatStep(schedule.per_rank[Idx(r)][i]));
      }
      return failure;
    }
  }
  return testing::AssertionSuccess();
}

// The checkers must be able to fail.
TEST(SchedulePropertyTest, CheckersCatchBrokenSchedules) {
  // Rank 1 wants microbatch 1 first, which rank 0 only sends after rank 1 has returned the
  // gradient of microbatch 0.
  PipelineSchedule swapped = BuildOrDie(2, std::nullopt, 2, std::nullopt);
  swapped.per_rank[0] = {{Pass::kForward, 0, 0},
                         {Pass::kBackward, 0, 0},
                         {Pass::kForward, 0, 1},
                         {Pass::kBackward, 0, 1}};
  swapped.per_rank[1] = {{Pass::kForward, 0, 1},
                         {Pass::kBackward, 0, 1},
                         {Pass::kForward, 0, 0},
                         {Pass::kBackward, 0, 0}};
  EXPECT_FALSE(DataflowCompletes(swapped));

  // Without the v-1-c flip, rank p-1 runs B0.m before rank 0 could have sent its gradient.
  PipelineSchedule unflipped = BuildOrDie(2, 2, 4, 2);
  for (auto& steps : unflipped.per_rank) {
    for (ScheduleStep& step : steps) {
      if (step.pass == Pass::kBackward) {
        step.model_chunk = 1 - step.model_chunk;
      }
    }
  }
  EXPECT_FALSE(DataflowCompletes(unflipped));

  PipelineSchedule backward_first = BuildOrDie(1, std::nullopt, 2, std::nullopt);
  std::swap(backward_first.per_rank[0][0], backward_first.per_rank[0][1]);
  EXPECT_FALSE(PerRankValid(backward_first));

  PipelineSchedule missing = BuildOrDie(2, std::nullopt, 2, std::nullopt);
  missing.per_rank[1].pop_back();
  EXPECT_FALSE(PerRankValid(missing));
}

TEST(SchedulePropertyTest, EverySmallConfigurationIsCompleteAndDeadlockFree) {
  int64_t num_checked = 0;
  for (int64_t p = 1; p <= 8; ++p) {
    for (int64_t vp = 0; vp <= 4; ++vp) {  // 0 stands for "not given"
      const std::optional<int64_t> vp_size = vp == 0 ? std::nullopt : std::optional<int64_t>(vp);
      if (vp_size && p == 1) {
        continue;  // refused; see the validation tests
      }
      for (int64_t m = 1; m <= 24; ++m) {
        std::vector<std::optional<int64_t>> group_sizes = {std::nullopt};
        if (vp_size) {
          for (int64_t n = p; n <= m; ++n) {
            group_sizes.push_back(n);
          }
        }
        for (const std::optional<int64_t>& n : group_sizes) {
          StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(p, vp_size, m, n);
          const int64_t effective_n = n.value_or(p);
          const bool expect_ok =
              !vp_size || (effective_n <= m && (m % effective_n == 0 || m % effective_n >= p));
          ASSERT_EQ(schedule.ok(), expect_ok)
              << Describe(p, vp_size, m, n) << ": " << schedule.status().Message();
          if (!schedule.ok()) {
            continue;
          }
          ASSERT_TRUE(PerRankValid(*schedule)) << Describe(p, vp_size, m, n);
          ASSERT_TRUE(DataflowCompletes(*schedule)) << Describe(p, vp_size, m, n);
          ++num_checked;
        }
      }
    }
  }
  EXPECT_GT(num_checked, 1000);
}

// With v = 1 the interleaved machinery runs the same table as plain 1F1B (only the warmup
// differs), so both must agree on what each rank computes.
TEST(SchedulePropertyTest, OneChunkInterleavedRunsTheSameTable) {
  const PipelineSchedule plain = BuildOrDie(4, std::nullopt, 8, std::nullopt);
  const PipelineSchedule one_chunk = BuildOrDie(4, 1, 8, std::nullopt);
  EXPECT_EQ(plain.forward_table, one_chunk.forward_table);
  EXPECT_EQ(one_chunk.NumWarmup(0), 6);  // 2*(p-1): Megatron's interleaved formula
  EXPECT_EQ(plain.NumWarmup(0), 3);
}

// ---------------------------------------------------------------------------------------------
// Validation: every refusal names its field and says what is allowed.

void ExpectScheduleError(int64_t p, std::optional<int64_t> vp, int64_t m, std::optional<int64_t> n,
                         const std::string& where, const std::string& what_contains) {
  StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(p, vp, m, n);
  ASSERT_FALSE(schedule.ok()) << Describe(p, vp, m, n);
  EXPECT_EQ(schedule.status().where(), where) << Describe(p, vp, m, n);
  EXPECT_NE(schedule.status().what().find(what_contains), std::string::npos)
      << Describe(p, vp, m, n) << ": " << schedule.status().Message();
}

TEST(ScheduleValidationTest, SizesBelowOne) {
  ExpectScheduleError(0, std::nullopt, 4, std::nullopt, "pipeline_model_parallel_size",
                      "must be at least 1, got 0");
  ExpectScheduleError(-2, 2, 4, std::nullopt, "pipeline_model_parallel_size",
                      "must be at least 1, got -2");
  ExpectScheduleError(2, 0, 4, std::nullopt, "virtual_pipeline_model_parallel_size",
                      "must be at least 1, got 0");
  ExpectScheduleError(2, std::nullopt, 0, std::nullopt, "num_microbatches",
                      "must be at least 1, got 0");
  ExpectScheduleError(2, 2, 4, 0, "microbatch_group_size_per_vp_stage", "must be in [p, M]");
}

TEST(ScheduleValidationTest, InterleavedNeedsMoreThanOneStage) {
  ExpectScheduleError(1, 2, 4, std::nullopt, "virtual_pipeline_model_parallel_size",
                      "pipeline-model-parallel size should be greater than 1 with interleaved "
                      "schedule");
}

TEST(ScheduleValidationTest, GroupSizeWithoutInterleaving) {
  ExpectScheduleError(2, std::nullopt, 4, 2, "microbatch_group_size_per_vp_stage",
                      "only applies to the interleaved schedule");
}

TEST(ScheduleValidationTest, GroupSizeOutsideRange) {
  ExpectScheduleError(4, 2, 8, 3, "microbatch_group_size_per_vp_stage",
                      "must be in [p, M] = [4, 8], got 3");
  ExpectScheduleError(4, 2, 8, 9, "microbatch_group_size_per_vp_stage",
                      "must be in [p, M] = [4, 8], got 9");
  // With the default N = p, too few microbatches is M's fault.
  ExpectScheduleError(4, 2, 3, std::nullopt, "num_microbatches",
                      "must be at least pipeline_model_parallel_size (4");
}

TEST(ScheduleValidationTest, ShortFinalGroup) {
  ExpectScheduleError(4, 2, 10, 4, "num_microbatches", "M % N = 10 % 4 = 2 must be 0 or at least");
  ExpectScheduleError(4, 2, 6, std::nullopt, "num_microbatches", "defaulted to p");
  // A remainder of at least p is allowed.
  EXPECT_TRUE(BuildPipelineSchedule(2, 2, 5, 3).ok());
  EXPECT_TRUE(BuildPipelineSchedule(4, 2, 12, 8).ok());  // final group 4 = p
}

// ---------------------------------------------------------------------------------------------
// Layer assignment.

using Layers = std::vector<std::vector<std::vector<int64_t>>>;

TEST(AssignLayersTest, MegatronDocstringExample) {
  StatusOr<Layers> layers = AssignLayers(4, 2, 16);
  ASSERT_TRUE(layers.ok()) << layers.status().Message();
  const Layers expected = {
      {{1, 2}, {9, 10}}, {{3, 4}, {11, 12}}, {{5, 6}, {13, 14}}, {{7, 8}, {15, 16}}};
  EXPECT_EQ(*layers, expected);
}

TEST(AssignLayersTest, WithoutVirtualPipelineOneChunkPerRank) {
  StatusOr<Layers> layers = AssignLayers(4, std::nullopt, 8);
  ASSERT_TRUE(layers.ok()) << layers.status().Message();
  const Layers expected = {{{1, 2}}, {{3, 4}}, {{5, 6}}, {{7, 8}}};
  EXPECT_EQ(*layers, expected);
  StatusOr<Layers> one_chunk = AssignLayers(4, 1, 8);
  ASSERT_TRUE(one_chunk.ok()) << one_chunk.status().Message();
  EXPECT_EQ(*one_chunk, expected);
  StatusOr<Layers> single_stage = AssignLayers(1, std::nullopt, 3);
  ASSERT_TRUE(single_stage.ok()) << single_stage.status().Message();
  EXPECT_EQ(*single_stage, Layers({{{1, 2, 3}}}));
}

// Walking virtual stages in dataflow order (chunk-major, then rank) visits 1..L in order.
TEST(AssignLayersTest, VirtualStagesCoverLayersInDataflowOrder) {
  for (int64_t p = 1; p <= 8; ++p) {
    for (int64_t vp = 0; vp <= 4; ++vp) {
      if (vp > 0 && p == 1) {
        continue;
      }
      const int64_t v = vp == 0 ? 1 : vp;
      for (int64_t per_chunk = 1; per_chunk <= 3; ++per_chunk) {
        const int64_t num_layers = p * v * per_chunk;
        StatusOr<Layers> layers =
            AssignLayers(p, vp == 0 ? std::nullopt : std::optional<int64_t>(vp), num_layers);
        ASSERT_TRUE(layers.ok()) << layers.status().Message();
        int64_t expected_layer = 1;
        for (int64_t c = 0; c < v; ++c) {
          for (int64_t r = 0; r < p; ++r) {
            for (int64_t layer : (*layers)[Idx(r)][Idx(c)]) {
              EXPECT_EQ(layer, expected_layer++);
            }
          }
        }
        EXPECT_EQ(expected_layer, num_layers + 1);
      }
    }
  }
}

void ExpectLayersError(int64_t p, std::optional<int64_t> vp, int64_t num_layers,
                       const std::string& where, const std::string& what_contains) {
  StatusOr<Layers> layers = AssignLayers(p, vp, num_layers);
  ASSERT_FALSE(layers.ok());
  EXPECT_EQ(layers.status().where(), where);
  EXPECT_NE(layers.status().what().find(what_contains), std::string::npos)
      << layers.status().Message();
}

TEST(AssignLayersTest, Errors) {
  ExpectLayersError(0, std::nullopt, 8, "pipeline_model_parallel_size", "must be at least 1");
  ExpectLayersError(2, 0, 8, "virtual_pipeline_model_parallel_size", "must be at least 1");
  ExpectLayersError(2, 2, 0, "num_layers", "must be at least 1");
  ExpectLayersError(1, 2, 8, "virtual_pipeline_model_parallel_size",
                    "should be greater than 1 with interleaved schedule");
  ExpectLayersError(4, 2, 12, "num_layers",
                    "must be divisible by pipeline_model_parallel_size * "
                    "virtual_pipeline_model_parallel_size = 4 * 2, got 12");
  ExpectLayersError(4, std::nullopt, 6, "num_layers",
                    "must be divisible by pipeline_model_parallel_size = 4, got 6");
  ExpectLayersError(4, std::nullopt, 2, "num_layers", "must be divisible");
  // Huge v must be refused, not overflow p*v into something that divides L.
  ExpectLayersError(2, int64_t{1} << 62, 8, "num_layers", "must be divisible");
}

}  // namespace
}  // namespace mpusim

namespace mpusim {
namespace {

// The idealised timing: 1F1B with equal forward and backward costs takes (M + p - 1)(F + B),
// the bubble fraction (p - 1) / (M + p - 1) of Megatron's paper; the interleaved schedule
// shrinks it towards (p - 1) / (v M + p - 1); every step waits for the step it needs.
TEST(ScheduleTimingTest, OneFOneBBubbleIsThePapersFormula) {
  for (int64_t p = 1; p <= 6; ++p) {
    for (int64_t m = 1; m <= 9; ++m) {
      StatusOr<PipelineSchedule> s = BuildPipelineSchedule(p, std::nullopt, m, std::nullopt);
      ASSERT_TRUE(s.ok());
      const ScheduleTiming t = TimeSchedule(*s, 1.0, 1.0);
      EXPECT_DOUBLE_EQ(t.makespan, 2.0 * static_cast<double>(m + p - 1)) << p << " " << m;
      EXPECT_NEAR(t.BubbleFraction(), static_cast<double>(p - 1) / static_cast<double>(m + p - 1),
                  1e-12)
          << p << " " << m;
      for (int64_t r = 0; r < p; ++r) {
        EXPECT_EQ(ScheduleTiming::PeakInFlight(*s, r), std::min(p - r, m));
      }
    }
  }
}

TEST(ScheduleTimingTest, InterleavedStepsWaitForTheirInputsAndShrinkTheBubble) {
  for (int64_t p = 2; p <= 4; ++p) {
    for (int64_t v = 2; v <= 3; ++v) {
      for (int64_t m = p; m <= 8; m += p) {
        StatusOr<PipelineSchedule> s = BuildPipelineSchedule(p, v, m, std::nullopt);
        ASSERT_TRUE(s.ok());
        const ScheduleTiming t = TimeSchedule(*s, 1.0, 2.0);
        const StatusOr<PipelineSchedule> plain =
            BuildPipelineSchedule(p, std::nullopt, m, std::nullopt);
        // The same work (v chunks of 1/v of the layers each) in 1F1B takes longer.
        const ScheduleTiming base =
            TimeSchedule(*plain, static_cast<double>(v), 2.0 * static_cast<double>(v));
        EXPECT_LT(t.makespan, base.makespan) << p << " " << v << " " << m;
        EXPECT_LT(t.BubbleFraction(), base.BubbleFraction());
        // Data dependencies: every forward of virtual stage u > 0 starts after stage u - 1's.
        std::map<std::tuple<bool, int64_t, int64_t>, std::pair<double, double>> spans;
        for (int64_t r = 0; r < p; ++r) {
          const auto& steps = s->per_rank[static_cast<size_t>(r)];
          for (size_t i = 0; i < steps.size(); ++i) {
            spans[{steps[i].pass == Pass::kForward, steps[i].model_chunk * p + r,
                   steps[i].microbatch}] = {t.start[static_cast<size_t>(r)][i],
                                            t.end[static_cast<size_t>(r)][i]};
            if (i > 0) {
              EXPECT_GE(t.start[static_cast<size_t>(r)][i], t.end[static_cast<size_t>(r)][i - 1]);
            }
          }
        }
        for (const auto& [key, span] : spans) {
          const auto& [forward, u, mb] = key;
          if (forward && u > 0) {
            EXPECT_GE(span.first, spans.at({true, u - 1, mb}).second);
          }
          if (!forward && u + 1 < p * v) {
            EXPECT_GE(span.first, spans.at({false, u + 1, mb}).second);
          }
        }
      }
    }
  }
}

// Per-stage costs and transfers: one micro-batch runs the forwards down the pipeline and the
// backwards up it, paying a transfer at each of the p - 1 boundaries both ways; with many
// micro-batches the slowest stage sets the pace, (M - 1) of its steps plus one of everyone's.
TEST(ScheduleTimingTest, StageCostsAndTransfersFollowTheCriticalPath) {
  const std::vector<double> forward = {1.0, 2.0, 1.5, 0.5}, backward = {3.0, 4.0, 2.0, 1.0};
  const double transfer = 0.25;
  StatusOr<PipelineSchedule> one = BuildPipelineSchedule(4, std::nullopt, 1, std::nullopt);
  ASSERT_TRUE(one.ok());
  const ScheduleTiming single = TimeSchedule(*one, StageCosts{forward, backward, transfer});
  EXPECT_DOUBLE_EQ(single.makespan, (1.0 + 2.0 + 1.5 + 0.5) + (3.0 + 4.0 + 2.0 + 1.0) +
                                        2 * 3 * transfer);
  // Equal costs and no transfer: the uniform overload's answer.
  StatusOr<PipelineSchedule> many = BuildPipelineSchedule(4, std::nullopt, 8, std::nullopt);
  ASSERT_TRUE(many.ok());
  EXPECT_DOUBLE_EQ(TimeSchedule(*many, StageCosts{std::vector<double>(4, 1.0),
                                                  std::vector<double>(4, 2.0), 0.0})
                       .makespan,
                   TimeSchedule(*many, 1.0, 2.0).makespan);
  // A slow stage bounds the span from below: M of its steps, plus the others' fill and drain.
  const ScheduleTiming slow = TimeSchedule(*many, StageCosts{forward, backward, 0.0});
  EXPECT_GE(slow.makespan, 8 * (2.0 + 4.0) + 1.0 + 3.0);
  EXPECT_LE(slow.makespan, 8 * (2.0 + 4.0) + 1.0 + 3.0 + 1.5 + 2.0 + 0.5 + 1.0 + 1e-9);
  EXPECT_THROW(TimeSchedule(*many, StageCosts{forward, {1.0}, 0.0}), std::invalid_argument);
  EXPECT_THROW(TimeSchedule(*many, StageCosts{forward, backward, -1.0}), std::invalid_argument);
  // An empty stage (a layout's "|" with no layer) costs nothing and still passes its input on:
  // one micro-batch pays the other stages' steps and every transfer.
  const ScheduleTiming empty =
      TimeSchedule(*one, StageCosts{{1.0, 0.0, 1.5, 0.5}, {3.0, 0.0, 2.0, 1.0}, transfer});
  EXPECT_DOUBLE_EQ(empty.makespan, (1.0 + 1.5 + 0.5) + (3.0 + 2.0 + 1.0) + 2 * 3 * transfer);
  EXPECT_THROW(TimeSchedule(*many, StageCosts{{1.0, -1.0, 1.5, 0.5}, backward, 0.0}),
               std::invalid_argument);
}

// Blocking sends, as Megatron's p2p waits for them: 1F1B on 2 ranks, 2 micro-batches, every
// step 1, transfers 0.5. Rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1. Overlapped sends:
// rank 1's B1 ends at 5.5, rank 0's B1 runs [6, 7]. Blocking: rank 0 is free after F0 at
// 1.5, F1 runs [1.5, 2.5]; rank 1 runs F0 [1.5, 2.5], B0 [2.5, 3.5] and is free at 4, F1
// [4, 5], B1 [5, 6]; rank 0's B1 waits for it: [6.5, 7.5].
TEST(ScheduleTimingTest, BlockingSendsHoldTheSender) {
  StatusOr<PipelineSchedule> s = BuildPipelineSchedule(2, std::nullopt, 2, std::nullopt);
  ASSERT_TRUE(s.ok());
  StageCosts costs{{1.0, 1.0}, {1.0, 1.0}, 0.5};
  EXPECT_DOUBLE_EQ(TimeSchedule(*s, costs).makespan, 7.0);
  costs.blocking_sends = true;
  const ScheduleTiming blocking = TimeSchedule(*s, costs);
  EXPECT_DOUBLE_EQ(blocking.makespan, 7.5);
  EXPECT_DOUBLE_EQ(blocking.start[0][1], 1.5);  // rank 0's F1, after F0's send
  EXPECT_DOUBLE_EQ(blocking.start[1][2], 4.0);  // rank 1's F1, after B0's send
  // One rank: nothing crosses, nothing blocks.
  StatusOr<PipelineSchedule> alone = BuildPipelineSchedule(1, std::nullopt, 2, std::nullopt);
  ASSERT_TRUE(alone.ok());
  EXPECT_DOUBLE_EQ(TimeSchedule(*alone, StageCosts{{1.0}, {1.0}, 0.5, true}).makespan, 4.0);
}

}  // namespace
}  // namespace mpusim
