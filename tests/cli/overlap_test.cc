// Megatron's communication overlap in the step-time estimate (core/estimate/time_estimate.h):
// overlap_grad_reduce, overlap_param_gather (optimizer section) and tp_comm_overlap (parallel
// section). Each is checked against a hand computation written here from the documented
// formulas (ring collectives, bucket counts, TE's chunking), not against the program's own
// numbers; the parts must add up to the step, and the refusals name the field.
#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli.h"
#include "tests/cli/cli_test_util.h"
#include "core/config/config.h"
#include "core/estimate/memory_estimate.h"
#include "core/estimate/time_estimate.h"
#include "core/schedule.h"
#include "core/topology.h"

namespace mpusim {
namespace {

using mpusim::cli::test_util::Result;
using mpusim::cli::test_util::Mpusim;
using mpusim::cli::test_util::ExpectUsageError;
using mpusim::cli::test_util::Sample;

using nlohmann::json;

// A GPT of 4 layers, h 1024, 16 heads, ffn 4096, in bf16 on one node of 8 GPUs.
json BaseConfig(int64_t world, int64_t tp, int64_t pp) {
  return json{{"parallel",
               {{"world_size", world},
                {"tensor_model_parallel_size", tp},
                {"pipeline_model_parallel_size", pp}}},
              {"model",
               {{"type", "gpt"},
                {"num_layers", 4},
                {"hidden_size", 1024},
                {"num_attention_heads", 16},
                {"ffn_hidden_size", 4096},
                {"vocab_size", 32000},
                {"max_position_embeddings", 4096}}},
              {"run",
               {{"dtype", "bfloat16"},
                {"seq_length", 4096},
                {"micro_batch_size", 1},
                {"num_microbatches", 4}}},
              {"optimizer", {{"optimizer", "adam"}, {"lr", 1e-4}}}};
}

struct Estimated {
  TimeEstimate time;
  std::vector<StageHeldMemory> held;
};

Estimated Estimate(const json& doc, const GpuSpec& gpu) {
  Config config;
  const Status parsed = ParseConfig(doc, &config);
  EXPECT_TRUE(parsed.ok()) << parsed.Message();
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  EXPECT_TRUE(topology.ok()) << topology.status().Message();
  StatusOr<std::vector<StageHeldMemory>> held = EstimateStageHeldMemory(config, *topology);
  EXPECT_TRUE(held.ok());
  StatusOr<TimeEstimate> time = EstimateStepTime(config, *topology, gpu);
  EXPECT_TRUE(time.ok()) << time.status().Message();
  return {*time, *held};
}

GpuSpec H100() { return *FindGpuPreset("h100-80gb"); }

// The hand formulas (docs/estimate.md, "The time model"): a ring collective over n ranks in
// `phases` passes, and what a pipeline of k chunks leaves exposed beside `compute`.
double Ring(double bytes, double n, double phases, const GpuSpec& gpu) {
  const double bw = gpu.intra_node_bandwidth * gpu.collective_efficiency;
  return phases * (n - 1) / n * bytes / bw + phases * (n - 1) * gpu.intra_node_latency_s;
}
double Exposed(double comm, double compute, double k) {
  return std::max(comm / k, comm - (k - 1) / k * compute);
}

// The step is its parts.
void ExpectPartsAddUp(const TimeEstimate& t) {
  const double parts = t.compute_s + t.recompute_s + t.tp_comm_s + t.cp_comm_s + t.ep_comm_s +
                       t.pp_comm_s + t.bubble_s + t.dp_comm_s + t.optimizer_s;
  EXPECT_NEAR(parts / t.step_time_s, 1, 1e-12);
}

// overlap_grad_reduce on tp 1, pp 1, dp 8: the all-reduce of the gradients, cut in
// ceil(N / bucket_size) buckets ready one by one during the last backward, is exposed only by
// max(C / nb, C - (nb - 1) / nb * B). Both branches: a fast link (the backward covers all but
// the last bucket) and a slow one (the reduction outlasts the backward).
TEST(Overlap, GradReduceHidesBucketsBehindTheLastBackward) {
  GpuSpec fast = H100(), slow = H100();
  fast.intra_node_bandwidth *= 1000;
  fast.intra_node_latency_s = 0;
  slow.intra_node_bandwidth /= 100;
  for (const bool covered : {true, false}) {
    const GpuSpec& gpu = covered ? fast : slow;
    json doc = BaseConfig(8, 1, 1);
    const Estimated plain = Estimate(doc, gpu);
    const double N = static_cast<double>(plain.held[0].held.parameter_elements);
    ASSERT_GT(N, 0);
    // main_grad in float32, all-reduced over dp 8 in the node.
    const double C = Ring(N * 4, 8, 2, gpu);
    EXPECT_NEAR(plain.time.dp_comm_s / C, 1, 1e-12);
    EXPECT_EQ(plain.time.dp_comm_hidden_s, 0);
    const auto bucket = static_cast<int64_t>(std::ceil(N / 4));
    doc["optimizer"]["overlap_grad_reduce"] = true;
    doc["optimizer"]["bucket_size"] = static_cast<int64_t>(bucket);
    const Estimated overlapped = Estimate(doc, gpu);
    const double nb = std::ceil(N / static_cast<double>(bucket));
    ASSERT_EQ(nb, 4);
    EXPECT_EQ(overlapped.time.dp_buckets, 4);
    const double B = plain.time.stages[0].backward_s;
    const double exposed = std::max(C / nb, C - (nb - 1) / nb * B);
    if (covered) {
      EXPECT_LT(C / nb, B / nb);  // the backward covers every bucket but the last
    } else {
      EXPECT_GT(C, B);  // the reduction outlasts the backward
    }
    EXPECT_NEAR(overlapped.time.dp_comm_s / exposed, 1, 1e-9);
    EXPECT_NEAR(overlapped.time.dp_comm_hidden_s / (C - exposed), 1, 1e-9);
    EXPECT_NEAR(plain.time.step_time_s - overlapped.time.step_time_s, C - exposed, 1e-12);
    // Nothing else moves.
    EXPECT_EQ(overlapped.time.compute_s, plain.time.compute_s);
    EXPECT_EQ(overlapped.time.bubble_s, plain.time.bubble_s);
    ExpectPartsAddUp(overlapped.time);
    // The communication row: exposed plus hidden is the whole all-reduce.
    const auto dp = std::find_if(overlapped.time.communication.begin(),
                                 overlapped.time.communication.end(),
                                 [](const CommTime& c) { return c.kind == "dp"; });
    ASSERT_NE(dp, overlapped.time.communication.end());
    EXPECT_NEAR((dp->seconds + dp->hidden_s) / C, 1, 1e-12);
  }
}

// Megatron's default bucket size: max(40M, 1M x dp_cp); one bucket (nothing hidden) when the
// chunk fits in it.
TEST(Overlap, DefaultBucketSizeIsMegatrons) {
  json doc = BaseConfig(8, 1, 1);
  doc["optimizer"]["overlap_grad_reduce"] = true;
  const Estimated e = Estimate(doc, H100());
  const double N = static_cast<double>(e.held[0].held.parameter_elements);
  EXPECT_EQ(e.time.dp_buckets, static_cast<int64_t>(std::ceil(N / 40e6)));
  EXPECT_GT(e.time.dp_buckets, 1);
  // Pipelined: only rank 0's first chunk is bucketed, a stage's parameters split over its
  // chunks (vp 2).
  json piped = BaseConfig(8, 1, 2);
  piped["parallel"]["virtual_pipeline_model_parallel_size"] = 2;
  piped["optimizer"]["overlap_grad_reduce"] = true;
  piped["optimizer"]["bucket_size"] = 1000000;
  const Estimated p = Estimate(piped, H100());
  const double N0 = static_cast<double>(p.held[0].held.parameter_elements);
  EXPECT_EQ(p.time.dp_buckets, static_cast<int64_t>(std::ceil(N0 / 2 / 1e6)));
  ExpectPartsAddUp(p.time);
  EXPECT_GT(p.time.dp_comm_hidden_s, 0);
}

// Megatron buckets only pipeline rank 0's first chunk; every other chunk is one bucket, ready
// when the chunk's last backward ends. On a link so slow that each chunk's reduction outlasts
// the rest of the backward, rank 0's second chunk then reduces from its last backward's end
// and its first chunk's buckets are all ready by the time the link frees: the exposed time
// cannot depend on the bucket size (it would if the other chunks were cut in buckets too),
// and the link must be busy at least C0 after chunk 1's reduction can start.
TEST(Overlap, OnlyPipelineRankZerosFirstChunkIsBucketed) {
  GpuSpec slow = H100();
  slow.intra_node_bandwidth /= 1000;
  json doc = BaseConfig(8, 1, 2);
  doc["parallel"]["virtual_pipeline_model_parallel_size"] = 2;
  doc["optimizer"]["overlap_grad_reduce"] = true;
  std::vector<double> exposed;
  for (const double bucket : {2e5, 1e6, 4e6}) {
    doc["optimizer"]["bucket_size"] = static_cast<int64_t>(bucket);
    const Estimated e = Estimate(doc, slow);
    const double N0 = static_cast<double>(e.held[0].held.parameter_elements);
    EXPECT_EQ(e.time.dp_buckets, static_cast<int64_t>(std::ceil(N0 / 2 / bucket)));
    const double C0 = Ring(N0 * 4, 4, 2, slow);  // dp 4 in the node
    EXPECT_GT(C0 / 2, e.time.stages[0].backward_s);  // the slow regime
    exposed.push_back(e.time.dp_comm_s);
    ExpectPartsAddUp(e.time);
  }
  EXPECT_GT(exposed[0], 0);
  EXPECT_NEAR(exposed[1] / exposed[0], 1, 1e-12);
  EXPECT_NEAR(exposed[2] / exposed[0], 1, 1e-12);
}

// overlap_param_gather with the distributed optimizer: the reduce-scatter of the gradients
// hides behind the last backward, the all-gather of the bf16 parameters behind the first
// forward, bucket by bucket: exposed max(R / nb, R - (nb - 1) / nb * B) +
// max(G / nb, G - (nb - 1) / nb * F).
TEST(Overlap, ParamGatherHidesBehindTheFirstForward) {
  const GpuSpec gpu = H100();
  json doc = BaseConfig(8, 1, 1);
  doc["optimizer"]["use_distributed_optimizer"] = true;
  const Estimated plain = Estimate(doc, gpu);
  const double N = static_cast<double>(plain.held[0].held.parameter_elements);
  const double R = Ring(N * 4, 8, 1, gpu), G = Ring(N * 2, 8, 1, gpu);
  EXPECT_NEAR(plain.time.dp_comm_s / (R + G), 1, 1e-12);
  doc["optimizer"]["overlap_grad_reduce"] = true;
  doc["optimizer"]["bucket_size"] = static_cast<int64_t>(std::ceil(N / 8));
  const Estimated reduce_only = Estimate(doc, gpu);
  const double nb = 8, B = plain.time.stages[0].backward_s, F = plain.time.stages[0].forward_s;
  // Without overlap_param_gather the gather stays after the optimizer step, all exposed.
  EXPECT_NEAR(reduce_only.time.dp_comm_s / (Exposed(R, B, nb) + G), 1, 1e-9);
  doc["optimizer"]["overlap_param_gather"] = true;
  const Estimated both = Estimate(doc, gpu);
  const double exposed = Exposed(R, B, nb) + Exposed(G, F, nb);
  EXPECT_NEAR(both.time.dp_comm_s / exposed, 1, 1e-9);
  EXPECT_NEAR(both.time.dp_comm_hidden_s / (R + G - exposed), 1, 1e-9);
  EXPECT_NEAR(plain.time.step_time_s - both.time.step_time_s, R + G - exposed, 1e-12);
  EXPECT_LT(both.time.step_time_s, reduce_only.time.step_time_s);
  ExpectPartsAddUp(both.time);
  // The rows: a reduce-scatter and an all-gather, each exposed + hidden = its whole time.
  std::vector<std::string> operations;
  for (const CommTime& c : both.time.communication) {
    if (c.kind != "dp") continue;
    operations.push_back(c.operation);
    const double whole = c.operation == "reduce-scatter" ? R : G;
    EXPECT_NEAR((c.seconds + c.hidden_s) / whole, 1, 1e-12) << c.operation;
  }
  EXPECT_EQ(operations, (std::vector<std::string>{"reduce-scatter", "all-gather"}));
}

// tp_comm_overlap at tp 2 with sequence parallelism: per layer and pass, each all-gather or
// reduce-scatter of [s, b, h] (a = (t-1)/t x bytes / bw + (t-1) latency) beside the GEMM TE
// pairs it with: forward QKV and fc1 (ring exchange, t chunks), projection and fc2 (pipeline,
// 4 chunks); backward the projection's and fc2's dgrad (ring exchange), the QKV's and fc1's
// wgrad (bulk: only what exceeds the GEMM), each GEMM priced by its shape. Full recomputation
// repeats the forward's.
TEST(Overlap, TpCommOverlapHidesCollectivesBehindTheirGemms) {
  const GpuSpec gpu = H100();
  for (const char* recompute : {"none", "full"}) {
    json doc = BaseConfig(2, 2, 1);
    doc["parallel"]["sequence_parallel"] = true;
    if (std::string(recompute) == "full") {
      doc["run"]["recompute_granularity"] = "full";
      doc["run"]["recompute_method"] = "uniform";
      doc["run"]["recompute_num_layers"] = 1;
    }
    const Estimated plain = Estimate(doc, gpu);
    doc["parallel"]["tp_comm_overlap"] = true;
    const Estimated overlapped = Estimate(doc, gpu);
    const double t = 2, T = 4096, h = 1024, heads = 16 / t, d = 64, f = 4096 / t, L = 4, M = 4;
    const double a = Ring(T * h * 2, t, 1, gpu);
    // Each GEMM C[m, n] = A[m, k] B[k, n] by the README's curve: whole waves of 256 x 128
    // tiles (either orientation, the fewer padded) over the SMs at the ceiling, or the HBM
    // roofline when that is longer.
    const auto gemm = [&](double m, double n, double k) {
      double padded = 0;
      for (const auto& [tm, tn] : {std::pair{256.0, 128.0}, std::pair{128.0, 256.0}}) {
        const double tiles = std::ceil(m / tm) * std::ceil(n / tn);
        const double sms = static_cast<double>(gpu.sm_count);
        const double work = std::ceil(tiles / sms) * sms * tm * tn;
        if (padded == 0 || work < padded) padded = work;
      }
      const double compute = 2 * padded * k / (gpu.peak_flops_16bit * gpu.gemm_efficiency);
      const double memory = 2 * (m * k + k * n + m * n) / (gpu.hbm_bandwidth * 0.8);
      return std::max(compute, memory);
    };
    const double qkv = gemm(T, 3 * heads * d, h), proj = gemm(T, h, heads * d);
    const double fc1 = gemm(T, f, h), fc2 = gemm(T, h, f);
    // The backward's partners: the projection's and fc2's dgrad, QKV's and fc1's wgrad.
    const double proj_dgrad = gemm(T, heads * d, h), fc2_dgrad = gemm(T, f, h);
    const double qkv_wgrad = gemm(h, 3 * heads * d, T), fc1_wgrad = gemm(h, f, T);
    const double forward = (a - Exposed(a, qkv, t)) + (a - Exposed(a, proj, 4)) +
                           (a - Exposed(a, fc1, t)) + (a - Exposed(a, fc2, 4));
    const double backward = (a - Exposed(a, proj_dgrad, t)) + (a - std::max(0.0, a - qkv_wgrad)) +
                            (a - Exposed(a, fc2_dgrad, t)) + (a - std::max(0.0, a - fc1_wgrad));
    const double recomputed = std::string(recompute) == "full" ? forward : 0;
    const double hidden = M * L * (forward + backward + recomputed);
    ASSERT_GT(hidden, 0);
    EXPECT_NEAR(overlapped.time.tp_comm_hidden_s / hidden, 1, 1e-9) << recompute;
    EXPECT_NEAR((plain.time.tp_comm_s - overlapped.time.tp_comm_s) / hidden, 1, 1e-9);
    EXPECT_NEAR((plain.time.step_time_s - overlapped.time.step_time_s) / hidden, 1, 1e-9);
    EXPECT_EQ(overlapped.time.compute_s, plain.time.compute_s);
    ExpectPartsAddUp(overlapped.time);
    // The tp row: exposed + hidden is the whole traffic's time.
    EXPECT_EQ(overlapped.time.communication[0].kind, "tp");
    EXPECT_NEAR((overlapped.time.communication[0].seconds +
                 overlapped.time.communication[0].hidden_s) /
                    plain.time.communication[0].seconds,
                1, 1e-12);
  }
}

// All three at once on a pipelined, interleaved layout: the parts still add up, overlap
// never slows the step here, and each kind's exposed + hidden is its whole time.
TEST(Overlap, PartsAddUpOnAnInterleavedPipeline) {
  json doc = BaseConfig(8, 2, 2);
  doc["parallel"]["virtual_pipeline_model_parallel_size"] = 2;
  doc["parallel"]["sequence_parallel"] = true;
  doc["run"]["num_microbatches"] = 8;
  doc["optimizer"]["use_distributed_optimizer"] = true;
  const Estimated plain = Estimate(doc, H100());
  doc["parallel"]["tp_comm_overlap"] = true;
  doc["optimizer"]["overlap_grad_reduce"] = true;
  doc["optimizer"]["overlap_param_gather"] = true;
  const Estimated overlapped = Estimate(doc, H100());
  ExpectPartsAddUp(overlapped.time);
  EXPECT_LT(overlapped.time.step_time_s, plain.time.step_time_s);
  EXPECT_NEAR((overlapped.time.tp_comm_s + overlapped.time.tp_comm_hidden_s) /
                  plain.time.tp_comm_s,
              1, 1e-12);
  EXPECT_LE(overlapped.time.dp_comm_s, plain.time.dp_comm_s);
}

// The replay's first-forward waits (where overlap_param_gather's exposed gathers go): each
// virtual stage's first forward starts that much later, once.
TEST(Overlap, FirstForwardWaitsDelayOnlyTheFirstForward) {
  StatusOr<PipelineSchedule> one = BuildPipelineSchedule(1, std::nullopt, 2, std::nullopt);
  ASSERT_TRUE(one.ok());
  // F B F B at 1 and 2 each, the first forward 0.5 later.
  EXPECT_DOUBLE_EQ(TimeSchedule(*one, StageCosts{{1.0}, {2.0}, 0.0, false, {0.5}}).makespan, 6.5);
  StatusOr<PipelineSchedule> two = BuildPipelineSchedule(2, std::nullopt, 1, std::nullopt);
  ASSERT_TRUE(two.ok());
  // F0 [0, 1], F1 waits 0.5: [1.5, 2.5], B1 [2.5, 3.5], B0 [3.5, 4.5].
  EXPECT_DOUBLE_EQ(
      TimeSchedule(*two, StageCosts{{1.0, 1.0}, {1.0, 1.0}, 0.0, false, {0.0, 0.5}}).makespan,
      4.5);
  EXPECT_THROW(TimeSchedule(*two, StageCosts{{1.0, 1.0}, {1.0, 1.0}, 0.0, false, {0.5}}),
               std::invalid_argument);
  EXPECT_THROW(TimeSchedule(*two, StageCosts{{1.0, 1.0}, {1.0, 1.0}, 0.0, false, {0.0, -1.0}}),
               std::invalid_argument);
}

// Megatron's constraints, refused in one line naming the field (exit 2, nothing on stdout).
TEST(Overlap, RefusalsNameTheField) {
  const auto refused = [](const json& doc) {
    Config config;
    const Status s = ParseConfig(doc, &config);
    return s.ok() ? std::string("accepted") : s.Message();
  };
  json doc = BaseConfig(8, 1, 1);
  doc["optimizer"]["overlap_param_gather"] = true;
  doc["optimizer"]["overlap_grad_reduce"] = true;
  EXPECT_EQ(refused(doc),
            "optimizer.overlap_param_gather: needs use_distributed_optimizer true (the all-gather "
            "it overlaps is the distributed optimizer's; Megatron refuses it too)");
  doc["optimizer"]["use_distributed_optimizer"] = true;
  doc["optimizer"]["overlap_grad_reduce"] = false;
  EXPECT_EQ(refused(doc),
            "optimizer.overlap_param_gather: needs overlap_grad_reduce true (Megatron: \"Must use "
            "--overlap-param-gather with --overlap-grad-reduce\")");
  doc["optimizer"]["overlap_grad_reduce"] = true;
  EXPECT_EQ(refused(doc), "accepted");
  doc["optimizer"]["bucket_size"] = 0;
  EXPECT_EQ(refused(doc).rfind("optimizer.bucket_size: ", 0), 0u) << refused(doc);
  json tp = BaseConfig(8, 2, 1);
  tp["parallel"]["tp_comm_overlap"] = true;
  EXPECT_EQ(refused(tp),
            "parallel.tp_comm_overlap: needs sequence_parallel true and "
            "tensor_model_parallel_size > 1 (TE overlaps the sequence-parallel all-gathers and "
            "reduce-scatters), got sequence_parallel false at tensor_model_parallel_size 2");
  tp["parallel"]["sequence_parallel"] = true;
  EXPECT_EQ(refused(tp), "accepted");
  tp["parallel"]["tensor_model_parallel_size"] = 1;
  EXPECT_EQ(refused(tp).rfind("parallel.tp_comm_overlap: needs sequence_parallel true", 0), 0u);
  tp["parallel"]["tp_comm_overlap"] = "yes";
  EXPECT_EQ(refused(tp), "parallel.tp_comm_overlap: must be true or false, got string \"yes\"");

  // The flags: the error names the flag.
  const std::string config = Sample("gpt3_175b_t8_p16_n1024.json");
  Result r = Mpusim({"estimate", config, "--tp-comm-overlap", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.rfind("error: command line: --tp-comm-overlap: needs sequence_parallel true", 0),
            0u)
      << r.err;
  r = Mpusim({"estimate", config, "--overlap-param-gather", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "error: command line: --overlap-param-gather: needs use_distributed_optimizer true "
            "(the all-gather it overlaps is the distributed optimizer's; Megatron refuses it "
            "too)\n");
  r = Mpusim({"estimate", "--world-size", "8", "--overlap-grad-reduce", "true"});
  ExpectUsageError(r,
            "error: command line: --overlap-grad-reduce: needs a config with an \"optimizer\" "
            "section (it sets optimizer.overlap_grad_reduce)");
  r = Mpusim({"estimate", config, "--overlap-grad-reduce", "maybe"});
  ExpectUsageError(r, "error: command line: --overlap-grad-reduce: must be true or false, got "
                      "'maybe'");
  r = Mpusim({"advise", config, "--global-batch-size", "1536", "--overlap-param-gather", "true"});
  ExpectUsageError(r,
            "error: command line: --overlap-param-gather: needs overlap_grad_reduce true "
            "(Megatron: \"Must use --overlap-param-gather with --overlap-grad-reduce\")");
}

// The three renderings show exposed and hidden apart.
TEST(Overlap, TextJsonAndHtmlShowHiddenAndExposed) {
  const std::vector<std::string> args = {
      "estimate",        Sample("gpt3_175b_t8_p16_n1024.json"),
      "--global-batch-size", "1536",
      "--sequence-parallel", "true",
      "--tp-comm-overlap",   "true",
      "--overlap-grad-reduce", "true"};
  Result r = Mpusim(args);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(" exposed ("), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hidden)"), std::string::npos);
  EXPECT_NE(r.out.find("overlapped: tp collectives with their GEMMs"), std::string::npos);
  std::vector<std::string> json_args = args;
  json_args.insert(json_args.end(), {"--format", "json"});
  r = Mpusim(json_args);
  ASSERT_EQ(r.code, 0) << r.err;
  const json doc = json::parse(r.out);
  const json& time = doc.at("time");
  EXPECT_GT(time.at("tp_comm_hidden_s").get<double>(), 0);
  EXPECT_GT(time.at("dp_comm_hidden_s").get<double>(), 0);
  EXPECT_EQ(doc.at("overlap").at("tp_comm_overlap"), true);
  EXPECT_EQ(doc.at("overlap").at("overlap_grad_reduce"), true);
  EXPECT_EQ(doc.at("overlap").at("overlap_param_gather"), false);
  double hidden = 0;
  for (const json& c : doc.at("communication")) hidden += c.at("hidden_seconds").get<double>();
  EXPECT_NEAR(hidden / (time.at("tp_comm_hidden_s").get<double>() +
                        time.at("dp_comm_hidden_s").get<double>()),
              1, 1e-12);
  std::vector<std::string> html_args = args;
  html_args.insert(html_args.end(), {"--format", "html"});
  r = Mpusim(html_args);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("<th>hidden</th>"), std::string::npos);
  EXPECT_NE(r.out.find(" exposed, "), std::string::npos);  // the bars' tooltips
}

// advise: the overlap flags apply wherever Megatron allows them, and the JSON says so.
TEST(Overlap, AdviseAppliesOverlapWhereAllowed) {
  const std::vector<std::string> base = {
      "advise", Sample("gpt3_175b_t8_p16_n1024.json"), "--global-batch-size", "1536",
      "--gpu", "a100-80gb", "--micro-batch-sizes", "1", "--recompute", "full",
      "--no-virtual-pipeline", "--max-cp", "1", "--top", "5", "--format", "json"};
  Result plain = Mpusim(base);
  ASSERT_EQ(plain.code, 0) << plain.err;
  std::vector<std::string> args = base;
  args.insert(args.end(), {"--tp-comm-overlap", "true", "--overlap-grad-reduce", "true"});
  Result overlapped = Mpusim(args);
  ASSERT_EQ(overlapped.code, 0) << overlapped.err;
  const json a = json::parse(plain.out), b = json::parse(overlapped.out);
  ASSERT_FALSE(b.at("layouts").empty());
  for (const json& l : b.at("layouts")) {
    EXPECT_EQ(l.at("overlap_grad_reduce"), true);
    EXPECT_EQ(l.at("tp_comm_overlap"), l.at("sequence_parallel").get<bool>() &&
                                           l.at("tensor_model_parallel_size").get<int>() > 1);
    EXPECT_EQ(l.at("overlap_param_gather"), false);
  }
  EXPECT_LT(b.at("layouts")[0].at("step_time_s").get<double>(),
            a.at("layouts")[0].at("step_time_s").get<double>());
}

}  // namespace
}  // namespace mpusim
