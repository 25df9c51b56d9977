// The run's memory preflight split between the host and a backend's own device memory
// (run/preflight.h): which items live where, and the device check's verdict and its line.
#include <memory>
#include <vector>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/topology.h"
#include "run/preflight.h"

namespace mpusim::run {
namespace {

MemoryPlan Plan(std::initializer_list<MemoryItem> items) {
  MemoryPlan plan;
  for (const MemoryItem& item : items) {
    plan.items.push_back(item);
    plan.total += item.bytes;
  }
  return plan;
}

constexpr uint64_t kMiB = uint64_t{1} << 20;

TEST(DevicePreflight, HostAndDeviceItemsPartitionThePlan) {
  const MemoryPlan plan = Plan({{"fc1.weight", {4, 8}, DType::kFloat32, 3 * kMiB, false},
                                {"reference: master weights", {}, DType::kFloat64, 5 * kMiB, true},
                                {"fc1.output", {2, 8}, DType::kFloat32, 7 * kMiB, false}});
  EXPECT_EQ(plan.HostItems().total, 5 * kMiB);
  ASSERT_EQ(plan.HostItems().items.size(), 1u);
  EXPECT_EQ(plan.HostItems().items[0].name, "reference: master weights");
  EXPECT_EQ(plan.DeviceItems().total, 10 * kMiB);
  EXPECT_EQ(plan.DeviceItems().items.size(), 2u);
  EXPECT_EQ(plan.HostItems().total + plan.DeviceItems().total, plan.total);
}

TEST(DevicePreflight, TheDeviceItemsMustFitTheFreeMemoryOfEachRankOnTheDevice) {
  // 10 MiB on the device and 500 MiB of reference on the host: the host part never counts.
  const MemoryPlan plan = Plan({{"fc1.weight", {4, 8}, DType::kFloat32, 4 * kMiB, false},
                                {"fc1.output", {2, 8}, DType::kFloat32, 6 * kMiB, false},
                                {"reference: activations", {}, DType::kFloat64, 500 * kMiB, true}});
  DeviceMemory device{"CUDA device 0 (Test GPU)", 40 * kMiB, 80 * kMiB, 4};
  EXPECT_TRUE(CheckDeviceMemory(plan, device).ok());  // 10 MiB of 40 / 4
  device.ranks = 5;                                    // 8 MiB each
  const Status refused = CheckDeviceMemory(plan, device);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.where(), "run");
  const std::string line = refused.Message();
  for (const char* part :
       {"one rank would hold 10.0 MiB, more than the 8.0 MiB allowed",
        "CUDA device 0 (Test GPU)'s free memory, 40.0 MiB of 80.0 MiB, shared by 5 ranks",
        "biggest: fc1.output [2, 8] float32 6.0 MiB, fc1.weight [4, 8] float32 4.0 MiB;",
        "spread the model over more GPUs (tp, pp) or start fewer ranks per GPU"}) {
    EXPECT_NE(line.find(part), std::string::npos) << part << "\n" << line;
  }
  EXPECT_EQ(line.find("reference"), std::string::npos) << line;
  EXPECT_EQ(line.find("--max-memory"), std::string::npos) << line;
  device.ranks = 0;  // never divides by zero: counted as one rank
  EXPECT_TRUE(CheckDeviceMemory(plan, device).ok());
}

// Both models (core/model/model.h) plan their own memory: the float64 reference and the
// check's buffers on the host, the executor's tensors where the backend keeps them.
TEST(DevicePreflight, TheReferenceAndTheCheckLiveOnTheHost) {
  const char* gpt = R"({
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 2},
    "model": {"type": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "vocab_size": 100, "max_position_embeddings": 16},
    "run": {"seq_length": 16, "micro_batch_size": 2}})";
  const char* chain = R"({
    "parallel": {"world_size": 2, "tensor_model_parallel_size": 2},
    "model": {"vocab_size": 100, "layers": [
      {"name": "embedding", "type": "VocabParallelEmbedding", "embedding_dim": 32},
      {"name": "head", "type": "ColumnParallelLinear", "input_size": 32,
       "output_size": "padded_vocab_size", "gather_output": false},
      {"name": "loss", "type": "VocabParallelCrossEntropy"}]},
    "run": {"seq_length": 16, "micro_batch_size": 2}})";
  // The host items each model's check adds: the GPT's reference, the chain's reference and
  // its exchange buffers.
  for (const auto& [text, host_items] : {std::pair{gpt, 2}, std::pair{chain, 4}}) {
    StatusOr<nlohmann::json> document = ParseJsonText(text);
    ASSERT_TRUE(document.ok()) << document.status().Message();
    Config config;
    const Status parsed = ParseConfig(*document, &config);
    ASSERT_TRUE(parsed.ok()) << parsed.Message();
    StatusOr<Topology> topology = Topology::Create(config.parallel);
    ASSERT_TRUE(topology.ok()) << topology.status().Message();
    StatusOr<std::unique_ptr<Model>> model =
        BuildModel(config, *topology, topology->Coordinates(0));
    ASSERT_TRUE(model.ok()) << model.status().Message();
    for (const bool check : {false, true}) {
      const MemoryPlan plan = PlanRankMemory(**model, 2, check);
      int host = 0;
      for (const MemoryItem& item : plan.items) {
        const bool reference =
            item.name.rfind("reference:", 0) == 0 || item.name.rfind("check:", 0) == 0;
        EXPECT_EQ(item.host, reference) << item.name;
        host += item.host ? 1 : 0;
      }
      EXPECT_EQ(host, check ? host_items : 0) << text;
      EXPECT_GT(plan.DeviceItems().total, 0u);
      // The executor's part does not depend on the check.
      EXPECT_EQ(plan.DeviceItems().total, PlanRankMemory(**model, 2, false).total);
    }
  }
}

// With expert parallelism a rank plans its ep rank's experts only: ep 2 of 4 experts holds
// two of them, and every expert of the model is on one of the ep ranks.
TEST(DevicePreflight, AnEpRankPlansItsOwnExperts) {
  const char* text = R"({
    "parallel": {"world_size": 2, "expert_model_parallel_size": 2},
    "model": {"type": "gpt", "num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
              "vocab_size": 64, "add_bias_linear": false, "num_moe_experts": 4,
              "moe_ffn_hidden_size": 16},
    "run": {"seq_length": 8, "micro_batch_size": 1}})";
  StatusOr<nlohmann::json> document = ParseJsonText(text);
  ASSERT_TRUE(document.ok()) << document.status().Message();
  Config config;
  ASSERT_TRUE(ParseConfig(*document, &config).ok());
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  ASSERT_TRUE(topology.ok()) << topology.status().Message();
  for (int64_t rank : {0, 1}) {
    StatusOr<std::unique_ptr<Model>> model =
        BuildModel(config, *topology, topology->Coordinates(rank));
    ASSERT_TRUE(model.ok()) << model.status().Message();
    std::vector<std::string> experts;
    for (const MemoryItem& item : PlanRankMemory(**model, 2, false).items) {
      if (item.name.find(".mlp.experts.") != std::string::npos &&
          item.name.ends_with("linear_fc1.weight")) {
        experts.push_back(item.name);
      }
    }
    const auto name = [](int64_t e) {
      return fmt::format("decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight", e);
    };
    EXPECT_EQ(experts, (std::vector<std::string>{name(2 * rank), name(2 * rank + 1)}))
        << "rank " << rank;
  }
}

}  // namespace
}  // namespace mpusim::run
