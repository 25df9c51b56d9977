// `mpusim run`'s expert loads: per training iteration and MoE layer, the tokens each expert
// kept (summed over the micro-batches and the layer's tp x dp x cp ranks) and, with
// moe_router_enable_expert_bias, the bias after the update, in --summary's `moe_layers` and as
// one line under each iteration's row; neither for a dense model.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "core/dump/safetensors.h"
#include "tests/cli/cli_test_util.h"

namespace mpusim::cli {
namespace {

using nlohmann::json;
using test_util::Mpiexec;
using test_util::Sample;
using test_util::Shell;
namespace fs = std::filesystem;

int Count(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// The DeepSeek-routing sample (16 experts, top 4, 2 layers; tp 2 with sp, dp 2, ep 2): 3
// iterations checked against the reference. Each layer's counts add up to the iteration's
// seq_length x micro_batch_size x dp 2 x num_microbatches x topk choices; each bias is the
// iteration before's moved by sign(mean - count) x rate in float32; the last is the bias the
// dump holds (decoder.layers.<i>.mlp.router.expert_bias).
TEST(RunCommand, ExpertLoadsAndBiasPerIteration) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("mpusim_loads.{}", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string config = Sample("gpt_deepseek_routing_t2_sp_dp2_n4.json");
  const json sample = json::parse(std::ifstream(config));
  const json& model = sample["model"];
  const json& run = sample["run"];
  ASSERT_EQ(model["num_moe_experts"], 16);
  ASSERT_EQ(model["moe_router_enable_expert_bias"], true);
  const int64_t choices =
      run["seq_length"].get<int64_t>() * run["micro_batch_size"].get<int64_t>() * 2 *
      run["num_microbatches"].get<int64_t>() * model["moe_router_topk"].get<int64_t>();
  const auto rate = model["moe_router_bias_update_rate"].get<float>();
  std::string output;
  ASSERT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + config + " --train-iters 3 --summary " +
                      (dir / "s.json").string() + " --dump " + (dir / "dump").string(),
                  &output),
            0)
      << output;
  EXPECT_EQ(Count(output, "tokens per expert, min-max: L0 "), 3) << output;
  EXPECT_EQ(Count(output, ";  expert bias: L0 "), 3) << output;
  const json summary = json::parse(std::ifstream(dir / "s.json"));
  ASSERT_EQ(summary["iterations"].size(), 3u);
  std::vector<std::vector<float>> bias(2, std::vector<float>(16, 0.0f));
  for (const json& it : summary["iterations"]) {
    ASSERT_EQ(it["moe_layers"].size(), 2u) << it;
    for (size_t l = 0; l < 2; ++l) {
      const json& layer = it["moe_layers"][l];
      EXPECT_EQ(layer["layer"], l);
      const auto tokens = layer["tokens_per_expert"].get<std::vector<int64_t>>();
      ASSERT_EQ(tokens.size(), 16u);
      const int64_t total = std::accumulate(tokens.begin(), tokens.end(), int64_t{0});
      EXPECT_EQ(total, choices);
      const float mean = static_cast<float>(total) / 16.0f;
      for (size_t e = 0; e < 16; ++e) {
        const float offset = mean - static_cast<float>(tokens[e]);
        bias[l][e] += (offset > 0 ? 1.0f : offset < 0 ? -1.0f : 0.0f) * rate;
      }
      EXPECT_EQ(layer["expert_bias"].get<std::vector<float>>(), bias[l]) << layer;
    }
  }
  StatusOr<SafetensorsFile> rank0 =
      ReadSafetensors((dir / "dump" / "rank00000.safetensors").string());
  ASSERT_TRUE(rank0.ok()) << rank0.status().Message();
  int found = 0;
  for (const NamedTensor& t : rank0->tensors) {
    for (size_t l = 0; l < 2; ++l) {
      if (t.name != fmt::format("decoder.layers.{}.mlp.router.expert_bias", l)) continue;
      ++found;
      ASSERT_EQ(t.tensor.numel(), 16);
      const std::vector<float> dumped(t.tensor.data_as<float>(), t.tensor.data_as<float>() + 16);
      EXPECT_EQ(dumped, bias[l]) << t.name;
    }
  }
  EXPECT_EQ(found, 2);

  // Without the bias: the counts, no bias.
  ASSERT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + config +
                      " --train-iters 2 --no-check --moe-router-enable-expert-bias false "
                      "--summary " +
                      (dir / "off.json").string(),
                  &output),
            0)
      << output;
  EXPECT_EQ(Count(output, "tokens per expert, min-max: L0 "), 2) << output;
  EXPECT_EQ(Count(output, "expert bias:"), 0) << output;
  const json off = json::parse(std::ifstream(dir / "off.json"));
  for (const json& it : off["iterations"]) {
    ASSERT_EQ(it["moe_layers"].size(), 2u);
    EXPECT_FALSE(it["moe_layers"][0].contains("expert_bias"));
    const auto tokens = it["moe_layers"][1]["tokens_per_expert"].get<std::vector<int64_t>>();
    EXPECT_EQ(std::accumulate(tokens.begin(), tokens.end(), int64_t{0}), choices);
  }

  // A dense model: neither.
  ASSERT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + Sample("gpt_train_adam_p2_t2_n4.json") +
                      " --no-check --train-iters 2 --summary " + (dir / "dense.json").string(),
                  &output),
            0)
      << output;
  EXPECT_EQ(Count(output, "tokens per expert"), 0) << output;
  const json dense = json::parse(std::ifstream(dir / "dense.json"));
  ASSERT_FALSE(dense["iterations"].empty());
  EXPECT_FALSE(dense["iterations"][0].contains("moe_layers"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mpusim::cli
