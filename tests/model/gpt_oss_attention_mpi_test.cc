// gpt-oss's attention on K MPI ranks against the float64 GPT reference: sliding windows
// (window_size, window_attn_skip_freq) and attention sinks (softmax_type "off-by-one" and
// "learnable") on every tp (+ sp) x cp x dp layout Transformer Engine builds them on (windows
// with cp_comm_type "all_gather" and "a2a", sinks with "a2a"), with a pipeline (and virtual
// stages) and the distributed optimizer training, in float64, float32 and bfloat16. Each
// layout's loss equals the cp = 1 layout's with the same data-parallel split, and the window
// and the sink change the model (a run without them differs).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/config/config.h"
#include "tests/model/gpt_mpi_helpers.h"
#include "tests/mpi/world.h"

namespace mpusim {
namespace {

using nlohmann::json;
using namespace gpt_mpi;

// A Llama-style model (RoPE, 4 query groups of 8 heads) with a window of 3 on layer 1 of 2
// (window_attn_skip_freq 2: layer number 2 has full attention) and `softmax` as its softmax.
json Oss(const char* softmax) {
  json model = Llama(8, 4);
  model["window_size"] = {3, 0};
  model["window_attn_skip_freq"] = 2;
  model["softmax_type"] = softmax;
  return model;
}

// `model` on cp x tp x pp (x vp) ranks, dp filling the world; 16 tokens, a window of 3 far
// shorter than the sequence and than a cp rank's two chunks.
json OssDocument(const json& model, int64_t cp, int64_t tp, int64_t pp, bool sp, const char* dtype,
                 const char* comm, int64_t vp = 0) {
  json document = Document(model, tp, sp, dtype);
  document["parallel"]["context_parallel_size"] = cp;
  document["parallel"]["pipeline_model_parallel_size"] = pp;
  if (vp > 0) document["parallel"]["virtual_pipeline_model_parallel_size"] = vp;
  document["model"]["cp_comm_type"] = comm;
  document["run"]["seq_length"] = 16;
  document["run"]["micro_batch_size"] = Samples() / (WorldSize() / (cp * tp * pp));
  return document;
}

// The cp_comm_types Transformer Engine builds `softmax` with a sliding window on: with cp > 1
// "all_gather" (not with a sink) and "a2a" where the query groups divide over tp x cp.
std::vector<const char*> Comms(const char* softmax, int64_t cp, int64_t tp) {
  if (cp == 1) return {"all_gather"};
  std::vector<const char*> comms;
  if (std::string(softmax) == "vanilla") comms.push_back("all_gather");
  if (4 % (tp * cp) == 0) comms.push_back("a2a");
  return comms;
}

double Loss(const json& document) {
  StatusOr<run::SimulationResult> result = Simulate(document, false);
  EXPECT_TRUE(result.ok()) << result.status().Message();
  return result.ok() ? result->loss : 0.0;
}

// The window and the sink are in the model: leaving either out changes the loss, a window as
// long as the sequence is full attention, and the list form of window_attn_skip_freq is the
// integer's.
TEST(GptOssAttention, WindowAndSinkChangeTheModel) {
  const json oss = Oss("learnable");
  const double loss = Loss(OssDocument(oss, 1, 1, 1, false, "float64", "all_gather"));
  json no_window = oss;
  no_window.erase("window_size");
  json no_sink = oss;
  no_sink["softmax_type"] = "vanilla";
  json off_by_one = oss;
  off_by_one["softmax_type"] = "off-by-one";
  for (const json& other : {no_window, no_sink, off_by_one}) {
    const double other_loss = Loss(OssDocument(other, 1, 1, 1, false, "float64", "all_gather"));
    EXPECT_GT(std::fabs(other_loss - loss), 1e-6 * loss) << other.dump();
  }
  json whole = oss;
  whole["window_size"] = {15, 0};  // every key of 16 positions
  EXPECT_EQ(Loss(OssDocument(whole, 1, 1, 1, false, "float64", "all_gather")),
            Loss(OssDocument(no_window, 1, 1, 1, false, "float64", "all_gather")));
  json listed = oss;
  listed["window_attn_skip_freq"] = {1, 0};
  EXPECT_EQ(Loss(OssDocument(listed, 1, 1, 1, false, "float64", "all_gather")), loss);
}

// Every cp in {1, 2, 4} and tp in {1, 2, 4} whose product divides the world, with and without
// sequence parallelism, each cp_comm_type that builds the softmax: every tensor matches the
// reference and the loss is the cp = 1 layout's.
TEST(GptOssAttention, EveryLayoutMatchesTheReferenceAndCpOne) {
  for (const char* softmax : {"vanilla", "off-by-one", "learnable"}) {
    const json model = Oss(softmax);
    std::map<int64_t, double> cp_one;  // by tp (the vocabulary pads per tp size)
    for (int64_t cp : {1, 2, 4}) {
      for (int64_t tp : {1, 2, 4}) {
        if (cp * tp > WorldSize() || WorldSize() % (cp * tp) != 0) continue;
        for (bool sp : {false, true}) {
          if (sp && tp == 1) continue;
          for (const char* comm : Comms(softmax, cp, tp)) {
            SCOPED_TRACE(fmt::format("{}: cp {} ({}) tp {} sp {}", softmax, cp, comm, tp, sp));
            if (WorldRank() == 0) {
              fmt::print("  {} cp {} {} tp {} sp {}:", softmax, cp, comm, tp, sp);
            }
            const double loss = RunChecked(OssDocument(model, cp, tp, 1, sp, "float64", comm)).loss;
            if (cp == 1) cp_one.try_emplace(tp, loss);
            ASSERT_EQ(cp_one.count(tp), 1u);
            EXPECT_NEAR(loss, cp_one.at(tp), 1e-12 * cp_one.at(tp));
          }
        }
      }
    }
  }
}

// Three Adam iterations with the distributed optimizer on pipelines (two stages, and two
// stages of two virtual ones), with cp 2 where the world allows: every iteration's loss and
// gradient norm equal the cp = 1, pp = 1 run's, the learnable sinks trained and checked.
TEST(GptOssAttention, PipelineAndDistributedOptimizerTrainAsOneRank) {
  json model = Oss("learnable");
  model["num_layers"] = 4;
  struct Case {
    int64_t cp, pp, vp;
  };
  std::vector<Case> cases = {{1, 1, 0}};
  if (WorldSize() >= 2) cases.push_back({1, 2, 2});
  if (WorldSize() >= 4) cases.push_back({2, 2, 0});
  std::vector<std::vector<double>> curves;
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("cp {} pp {} vp {}", c.cp, c.pp, c.vp));
    if (WorldRank() == 0) {
      fmt::print("  learnable sinks cp {} a2a pp {} vp {}, distributed optimizer:", c.cp, c.pp,
                 c.vp);
    }
    curves.push_back(DistributedOptimizerCurve(
        OssDocument(model, c.cp, 1, c.pp, false, "float64", "a2a", c.vp)));
  }
  ExpectSameCurves(curves);
}

// float32, and bfloat16 with selective recomputation (core attention rerun: the window and
// the sink's log-sum-exp recomputed), tp and cp where the world allows.
TEST(GptOssAttention, Float32AndBFloat16) {
  const int64_t cp = WorldSize() >= 2 ? 2 : 1;
  const int64_t tp = WorldSize() >= 4 ? 2 : 1;
  for (const char* softmax : {"off-by-one", "learnable"}) {
    for (const char* dtype : {"float32", "bfloat16"}) {
      if (WorldRank() == 0) fmt::print("  {} {} cp {} a2a tp {}:", softmax, dtype, cp, tp);
      json document = OssDocument(Oss(softmax), cp, tp, 1, tp > 1, dtype, "a2a");
      if (std::string(dtype) == "bfloat16") document["run"]["recompute_granularity"] = "selective";
      RunChecked(Training(document, "adam"));
    }
  }
  if (WorldSize() < 2) return;
  if (WorldRank() == 0) fmt::print("  window bfloat16 cp 2 all_gather, selective:");
  json document = OssDocument(Oss("vanilla"), 2, 1, 1, false, "bfloat16", "all_gather");
  document["run"]["recompute_granularity"] = "selective";
  RunChecked(document);
}

TEST(GptOssAttention, RefusalsNameTheField) {
  // The section's rules (ParseConfig), then the layout's (the run).
  const auto refused = [](const json& document) {
    Config config;
    const Status parsed = ParseConfig(document, &config);
    if (!parsed.ok()) return parsed.Message();
    StatusOr<run::SimulationResult> result = Simulate(document);
    EXPECT_FALSE(result.ok());
    return result.ok() ? std::string() : result.status().Message();
  };
  json document = OssDocument(Oss("vanilla"), 1, 1, 1, false, "float64", "all_gather");
  document["model"]["window_size"] = {3, 2};
  EXPECT_EQ(refused(document),
            "model.window_size: [3, 2]: the GPT is causal, so the right side must be 0 ([w, 0] "
            "with w >= 0, or [-1, 0]: Transformer Engine's rule for a causal mask)");
  document["model"]["window_size"] = {3, 0};
  document["model"]["window_attn_skip_freq"] = {1, 0, 1};
  EXPECT_EQ(refused(document),
            "model.window_attn_skip_freq: the list has 3 entries but the model has num_layers "
            "2; give one 1 (sliding window) or 0 (full attention) per layer");
  document["model"]["window_attn_skip_freq"] = 0;
  EXPECT_EQ(refused(document),
            "model.window_attn_skip_freq: must be null, an integer >= 1 (every N-th layer has "
            "full attention) or a list of 0/1 per layer (1: sliding window), got number 0");
  document["model"]["window_attn_skip_freq"] = 2;
  document["model"]["softmax_type"] = "sink";
  EXPECT_EQ(refused(document),
            "model.softmax_type: must be \"vanilla\", \"off-by-one\" or \"learnable\", got "
            "string \"sink\"");
  if (WorldSize() < 2) return;
  document = OssDocument(Oss("vanilla"), 2, 1, 1, false, "float64", "p2p");
  EXPECT_EQ(refused(document),
            "model.window_size: a sliding window with context_parallel_size 2 needs "
            "cp_comm_type \"a2a\" or \"all_gather\", got \"p2p\" (Transformer Engine: "
            "\"Context parallelism does not support sliding window attention with "
            "cp_comm_type=p2p\")");
  document["model"].erase("window_size");
  document["model"]["softmax_type"] = "learnable";
  for (const char* comm : {"p2p", "all_gather"}) {
    document["model"]["cp_comm_type"] = comm;
    EXPECT_EQ(refused(document),
              fmt::format("model.softmax_type: \"learnable\" with context_parallel_size 2 needs "
                          "cp_comm_type \"a2a\", got \"{}\" (Transformer Engine: \"Context "
                          "parallelism only supports softmax_type=learnable with cp_comm_type = "
                          "'a2a'!\")",
                          comm));
  }
  // A window of [-1, 0] is full causal attention: the ring runs it.
  document["model"]["softmax_type"] = "vanilla";
  document["model"]["cp_comm_type"] = "p2p";
  document["model"]["window_size"] = {-1, 0};
  EXPECT_TRUE(Simulate(document).ok());
}

}  // namespace
}  // namespace mpusim
