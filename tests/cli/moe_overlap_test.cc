// overlap_moe_expert_parallel_comm (and delay_wgrad_compute) in the schedule and the step-time
// estimate: Megatron's combined 1F1B, one more warmup forward per rank and each steady forward
// beside the backward after it, an MoE layer's all-to-alls hidden behind the other
// micro-batch's compute (core/estimate/time_estimate.h CombinedSeconds). The two-stream
// timing is checked on hand-worked cases, the schedule's order against Megatron's own
// description, the estimate's parts against the identities they must keep, and the refusals
// against Megatron's checks.
#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/estimate/time_estimate.h"
#include "core/schedule.h"
#include "tests/cli/cli_test_util.h"

namespace mpusim {
namespace {

using mpusim::cli::test_util::ExpectUsageError;
using mpusim::cli::test_util::Mpusim;
using mpusim::cli::test_util::Result;
using mpusim::cli::test_util::WriteTemp;
using nlohmann::json;

// The two streams by hand (comm: combine_bwd | dispatch_fwd, dispatch_bwd | combine_fwd;
// compute: attn_fwd | mlp dgrad, wgrad, mlp_fwd | attn_bwd).
TEST(MoeOverlap, TwoStreamsByHand) {
  CombinedLayer l;
  l.attn_fwd = 3, l.mlp_fwd = 4, l.attn_bwd = 6, l.mlp_dgrad = 4, l.mlp_wgrad = 4;
  // Nothing to exchange: the compute stream alone.
  EXPECT_DOUBLE_EQ(CombinedSeconds(l, false), 3 + 4 + 4 + 4 + 6);
  // Nothing to compute: the comm stream alone.
  CombinedLayer c;
  c.dispatch_fwd = 1, c.combine_fwd = 2, c.dispatch_bwd = 3, c.combine_bwd = 4;
  EXPECT_DOUBLE_EQ(CombinedSeconds(c, true), 1 + 2 + 3 + 4);
  // Both, exchanges of 5 each. combine_bwd [0, 5] beside attn_fwd [0, 3]; mlp dgrad [5, 9],
  // dispatch_fwd [5, 10]; wgrad [9, 13]; dispatch_bwd after dispatch_fwd and the dgrad (delay)
  // [10, 15] or after the wgrad too [13, 18]; mlp_fwd after wgrad and dispatch_fwd [13, 17];
  // combine_fwd after dispatch_bwd and mlp_fwd: [17, 22] or [18, 23]; attn_bwd after mlp_fwd
  // and dispatch_bwd: [17, 23] or [18, 24].
  l.dispatch_fwd = l.combine_fwd = l.dispatch_bwd = l.combine_bwd = 5;
  EXPECT_DOUBLE_EQ(CombinedSeconds(l, true), 23);
  EXPECT_DOUBLE_EQ(CombinedSeconds(l, false), 24);
  // Never faster than either stream, never slower than one after the other.
  EXPECT_GE(CombinedSeconds(l, true), 20);  // the comm stream: 4 x 5
  EXPECT_GE(CombinedSeconds(l, true), 21);  // the compute stream: 3 + 4 + 4 + 4 + 6
  EXPECT_LE(CombinedSeconds(l, false), l.Forward() + l.Backward());
}

// The order Megatron describes (combined_1f1b.py without pipelining: F0; B0 with F1; ...;
// the last B alone; with pipelining one more warmup forward than the interleaved schedule).
TEST(MoeOverlap, ScheduleRunsOneMoreWarmupForward) {
  StatusOr<PipelineSchedule> one = BuildPipelineSchedule(1, std::nullopt, 4, std::nullopt, true);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(FormatRank(*one, 0), "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3");
  for (int64_t p : {2, 4}) {
    for (int64_t v : {2, 3}) {
      StatusOr<PipelineSchedule> plain = BuildPipelineSchedule(p, v, 2 * p, std::nullopt);
      StatusOr<PipelineSchedule> combined =
          BuildPipelineSchedule(p, v, 2 * p, std::nullopt, true);
      ASSERT_TRUE(plain.ok() && combined.ok());
      for (int64_t r = 0; r < p; ++r) {
        EXPECT_EQ(combined->NumWarmup(r), std::min(plain->NumWarmup(r) + 1, 2 * p * v));
        const auto& steps = combined->per_rank[static_cast<size_t>(r)];
        // Each steady pair is a forward and a backward of different micro-batches.
        for (size_t i = static_cast<size_t>(combined->NumWarmup(r)); i + 1 < steps.size();
             i += 2) {
          if (steps[i].pass != Pass::kForward || steps[i + 1].pass != Pass::kBackward) break;
          EXPECT_NE(steps[i].microbatch * 100 + steps[i].model_chunk,
                    steps[i + 1].microbatch * 100 + (v - 1 - steps[i + 1].model_chunk))
              << "p " << p << " v " << v << " rank " << r << " step " << i;
        }
      }
    }
  }
  StatusOr<PipelineSchedule> refused =
      BuildPipelineSchedule(2, std::nullopt, 4, std::nullopt, true);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().Message(),
            "virtual_pipeline_model_parallel_size: is needed by the combined 1F1B schedule "
            "(overlap_moe_expert_parallel_comm) with pipeline_model_parallel_size 2");
}

// The replay of a combined schedule: without pipelining M (F + B) - (M - 1) x saving by hand;
// with pipelining every (p, v, M) completes, and a saving never makes it slower.
TEST(MoeOverlap, ReplayPairsEachSteadyForwardWithItsBackward) {
  StatusOr<PipelineSchedule> one = BuildPipelineSchedule(1, std::nullopt, 5, std::nullopt, true);
  ASSERT_TRUE(one.ok());
  StageCosts costs{{2.0}, {3.0}, 0.0, false, {}, {1.5}};
  EXPECT_DOUBLE_EQ(TimeSchedule(*one, costs).makespan, 5 * (2.0 + 3.0) - 4 * 1.5);
  // A saving needs a combined schedule.
  StatusOr<PipelineSchedule> plain = BuildPipelineSchedule(1, std::nullopt, 5, std::nullopt);
  EXPECT_THROW(TimeSchedule(*plain, costs), std::invalid_argument);
  for (int64_t p : {2, 3, 4, 8}) {
    for (int64_t v : {2, 4}) {
      for (int64_t m : {p, 2 * p, 3 * p}) {
        StatusOr<PipelineSchedule> s = BuildPipelineSchedule(p, v, m, std::nullopt, true);
        ASSERT_TRUE(s.ok());
        const size_t stages = static_cast<size_t>(p * v);
        StageCosts c{std::vector<double>(stages, 1.0), std::vector<double>(stages, 2.0), 0.1,
                     true, {}, std::vector<double>(stages * stages, 0.0)};
        double none = 0;
        ASSERT_NO_THROW(none = TimeSchedule(*s, c).makespan) << p << " " << v << " " << m;
        std::fill(c.combined_saving.begin(), c.combined_saving.end(), 1.0);
        const double saved = TimeSchedule(*s, c).makespan;
        EXPECT_LT(saved, none) << p << " " << v << " " << m;
      }
    }
  }
}

// An MoE GPT on two nodes of 8 H100s, ep across them: the option hides part of the
// all-to-alls (ep exposed + hidden = the plain ep time), the parts add up to the step, and
// without pipelining the step is shorter by exactly what is hidden.
json MoeConfig(int64_t pp, std::optional<int64_t> vp) {
  json parallel = {{"world_size", 16}, {"expert_model_parallel_size", 16},
                   {"pipeline_model_parallel_size", pp}, {"bf16", true}};
  if (vp) parallel["virtual_pipeline_model_parallel_size"] = *vp;
  if (pp > 1) parallel["expert_model_parallel_size"] = 16 / pp;
  return {{"parallel", parallel},
          {"model",
           {{"type", "gpt"}, {"num_layers", 8}, {"hidden_size", 2048},
            {"num_attention_heads", 32}, {"num_query_groups", 4}, {"ffn_hidden_size", 6144},
            {"activation", "swiglu"}, {"vocab_size", 32768},
            {"position_embedding_type", "rope"}, {"add_bias_linear", false},
            {"num_moe_experts", 16}, {"moe_ffn_hidden_size", 768}, {"moe_router_topk", 8},
            {"moe_token_dispatcher_type", "alltoall"}, {"moe_grouped_gemm", true}}},
          {"run", {{"seq_length", 4096}, {"micro_batch_size", 1}, {"num_microbatches", 8}}}};
}

// Without pipelining, and interleaved (pp 2, vp 2): the two schedules the option runs with.
const std::pair<int64_t, std::optional<int64_t>> kLayouts[] = {{1, std::nullopt}, {2, 2}};

json EstimateJson(const json& config, const std::string& name) {
  const std::string path = WriteTemp("mpusim_moe_overlap_" + name + ".json", config.dump());
  const Result r = Mpusim({"estimate", path, "--gpu", "h100-80gb", "--format", "json"});
  EXPECT_EQ(r.code, 0) << r.err;
  return json::parse(r.out);
}

TEST(MoeOverlap, EstimateHidesExchangesAndPartsAddUp) {
  for (const auto& [pp, vp] : kLayouts) {
    json config = MoeConfig(pp, vp);
    const std::string name = "pp" + std::to_string(pp);
    const json plain = EstimateJson(config, name + "_plain");
    config["parallel"]["overlap_moe_expert_parallel_comm"] = true;
    const json combined = EstimateJson(config, name + "_combined");
    config["parallel"]["delay_wgrad_compute"] = true;
    const json delayed = EstimateJson(config, name + "_delayed");
    const json& t0 = plain.at("time");
    for (const json* j : {&combined, &delayed}) {
      const json& t = j->at("time");
      const double hidden = t.at("ep_comm_hidden_s").get<double>();
      EXPECT_GT(hidden, 0) << name;
      EXPECT_NEAR((t.at("ep_comm_s").get<double>() + hidden) / t0.at("ep_comm_s").get<double>(),
                  1, 1e-12)
          << name;
      double parts = 0;
      for (const char* k : {"compute_s", "recompute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s",
                            "pp_comm_s", "bubble_s", "dp_comm_s", "optimizer_s"}) {
        parts += t.at(k).get<double>();
      }
      EXPECT_NEAR(parts / j->at("step_time_s").get<double>(), 1, 1e-12) << name;
      EXPECT_LT(j->at("step_time_s").get<double>(), plain.at("step_time_s").get<double>());
      EXPECT_TRUE(j->at("overlap").at("overlap_moe_expert_parallel_comm").get<bool>());
      if (pp == 1) {
        // One rank, M - 1 pairs: the step is the plain one less what the pairs hide.
        EXPECT_NEAR((plain.at("step_time_s").get<double>() - hidden) /
                        j->at("step_time_s").get<double>(),
                    1, 1e-12);
      }
      // The communication row says the same.
      for (const json& row : j->at("communication")) {
        if (row.at("kind") == "ep") {
          EXPECT_DOUBLE_EQ(row.at("hidden_seconds").get<double>(), hidden);
        }
      }
    }
    // Splitting off the weight gradients can only let dispatch_bwd start earlier.
    EXPECT_LE(delayed.at("step_time_s").get<double>(), combined.at("step_time_s").get<double>());
  }
}

// One more micro-batch in flight: stage 0 keeps one more stash, partly. Without pipelining
// the pair's forward stash grows a layer at a time as the backward's shrinks, so the peak is
// one micro-batch's stash and one layer's of another (n = 8 layers), not two stashes.
TEST(MoeOverlap, OneMoreMicroBatchInFlight) {
  for (const auto& [pp, vp] : kLayouts) {
    json config = MoeConfig(pp, vp);
    const std::string name = "stash_pp" + std::to_string(pp);
    const json plain = EstimateJson(config, name + "_plain");
    config["parallel"]["overlap_moe_expert_parallel_comm"] = true;
    const json combined = EstimateJson(config, name + "_combined");
    const auto stashes = [](const json& j) {
      return j.at("stages").at(0).at("peak_stashes").get<int64_t>();
    };
    const auto activations = [](const json& j) {
      return j.at("stages").at(0).at("memory").at("activations").get<double>();
    };
    EXPECT_EQ(stashes(combined), stashes(plain) + 1) << name;
    // No executor count: mpusim run refuses the combined schedule.
    EXPECT_FALSE(plain.at("stages").at(0).at("executor").is_null()) << name;
    EXPECT_TRUE(combined.at("stages").at(0).at("executor").is_null()) << name;
    EXPECT_GT(activations(combined), activations(plain)) << name;
    if (pp == 1) {
      EXPECT_NEAR(activations(combined) / activations(plain), 1 + 1.0 / 8, 1e-6) << name;
    }
  }
}

// Megatron's checks (TransformerConfig.__post_init__), one line naming the field; run refuses
// the option, estimate's flag sets it.
TEST(MoeOverlap, RefusalsNameTheField) {
  const auto refused = [](const json& doc) {
    Config config;
    Status s = ParseConfig(doc, &config);
    if (s.ok() && config.gpt && config.run) {
      s = CheckGptLayout(config.parallel, *config.run, &*config.gpt);
    }
    return s.ok() ? std::string("accepted") : s.Message();
  };
  json doc = MoeConfig(2, std::nullopt);
  doc["parallel"]["overlap_moe_expert_parallel_comm"] = true;
  EXPECT_EQ(refused(doc),
            "parallel.overlap_moe_expert_parallel_comm: needs virtual_pipeline_model_parallel_size "
            "with pipeline_model_parallel_size 2 (Megatron runs the combined 1F1B schedule "
            "without pipelining or interleaved)");
  doc = MoeConfig(1, std::nullopt);
  doc["parallel"]["overlap_moe_expert_parallel_comm"] = true;
  EXPECT_EQ(refused(doc), "accepted");
  doc["parallel"]["expert_model_parallel_size"] = 1;
  EXPECT_EQ(refused(doc),
            "parallel.overlap_moe_expert_parallel_comm: needs expert_model_parallel_size > 1 (it "
            "overlaps the experts' all-to-alls with another micro-batch's compute), got 1");
  doc = MoeConfig(1, std::nullopt);
  doc["parallel"]["overlap_moe_expert_parallel_comm"] = true;
  doc["model"]["moe_token_dispatcher_type"] = "allgather";
  EXPECT_EQ(refused(doc),
            "parallel.overlap_moe_expert_parallel_comm: needs model.moe_token_dispatcher_type "
            "\"alltoall\" (Megatron also takes \"flex\"), got \"allgather\"");
  doc["model"]["moe_token_dispatcher_type"] = "alltoall";
  doc["run"]["recompute_granularity"] = "full";
  doc["run"]["recompute_method"] = "uniform";
  doc["run"]["recompute_num_layers"] = 1;
  EXPECT_EQ(refused(doc),
            "parallel.overlap_moe_expert_parallel_comm: cannot run with "
            "run.recompute_granularity \"full\" (Megatron's rule); use null or \"selective\"");
  for (const char* key : {"recompute_granularity", "recompute_method", "recompute_num_layers"}) {
    doc["run"].erase(key);
  }
  doc["parallel"]["bf16"] = false;
  EXPECT_EQ(refused(doc),
            "parallel.overlap_moe_expert_parallel_comm: needs a bfloat16 or float16 run "
            "(Megatron's rule), got run.dtype float32");
  doc = MoeConfig(1, std::nullopt);
  doc["parallel"]["delay_wgrad_compute"] = true;
  EXPECT_EQ(refused(doc),
            "parallel.delay_wgrad_compute: needs overlap_moe_expert_parallel_comm true "
            "(Megatron's rule)");

  doc = MoeConfig(1, std::nullopt);
  const std::string path = WriteTemp("mpusim_moe_overlap_flags.json", doc.dump());
  Result r = Mpusim({"estimate", path, "--overlap-moe-expert-parallel-comm", "true", "--format",
                     "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_GT(json::parse(r.out).at("time").at("ep_comm_hidden_s").get<double>(), 0);
  r = Mpusim({"estimate", path, "--ep", "1", "--overlap-moe-expert-parallel-comm", "true"});
  ExpectUsageError(r, "error: command line: --overlap-moe-expert-parallel-comm: needs "
                      "expert_model_parallel_size > 1 (it overlaps the experts' all-to-alls "
                      "with another micro-batch's compute), got 1");
  doc["parallel"]["overlap_moe_expert_parallel_comm"] = true;
  const std::string run_path = WriteTemp("mpusim_moe_overlap_run.json", doc.dump());
  r = Mpusim({"run", run_path});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("parallel.overlap_moe_expert_parallel_comm: true is for mpusim estimate "
                       "and advise only"),
            std::string::npos)
      << r.err;
}

// advise applies it where Megatron allows it (ep > 1; without pipelining or interleaved; no
// full recomputation) and names it among the features.
TEST(MoeOverlap, AdviseAppliesItWhereAllowed) {
  json doc = MoeConfig(1, std::nullopt);
  doc["parallel"]["overlap_moe_expert_parallel_comm"] = true;
  doc["parallel"]["delay_wgrad_compute"] = true;
  doc["run"]["global_batch_size"] = 32;
  const std::string path = WriteTemp("mpusim_moe_overlap_advise.json", doc.dump());
  const Result r = Mpusim({"advise", path, "--gpu", "h100-80gb", "--format", "json", "--top",
                           "1000", "--max-cp", "1"});
  ASSERT_EQ(r.code, 0) << r.err;
  int on = 0, off = 0;
  const json advice = json::parse(r.out);
  for (const json& l : advice.at("layouts")) {
    const int64_t ep = l.at("expert_model_parallel_size").get<int64_t>();
    const int64_t pp = l.at("pipeline_model_parallel_size").get<int64_t>();
    const bool interleaved = !l.at("virtual_pipeline_model_parallel_size").is_null();
    const bool allowed = ep > 1 && (pp == 1 || interleaved) &&
                         l.at("recompute_granularity") != "full";
    EXPECT_EQ(l.at("overlap_moe_expert_parallel_comm").get<bool>(), allowed) << l.dump();
    EXPECT_EQ(l.at("delay_wgrad_compute").get<bool>(), allowed) << l.dump();
    (allowed ? on : off) += 1;
  }
  EXPECT_GT(on, 0);
  EXPECT_GT(off, 0);
}

}  // namespace
}  // namespace mpusim
