// The Model interface (core/model/model.h) as the tools use it: BuildModel builds either model
// from its config section, each model's sharding map covers its parameters once per stage
// that holds them, and each says whether its dropout masks follow the layout.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>

#include "core/config/config.h"
#include "core/config/gpt_config.h"
#include "core/model/model.h"
#include "core/topology.h"

namespace mpusim {
namespace {

struct Built {
  Config config;
  std::unique_ptr<Topology> topology;
  std::unique_ptr<Model> model;
};

Built Build(const std::string& text) {
  Built b;
  StatusOr<nlohmann::json> document = ParseJsonText(text);
  EXPECT_TRUE(document.ok()) << document.status().Message();
  const Status parsed = ParseConfig(*document, &b.config);
  EXPECT_TRUE(parsed.ok()) << parsed.Message();
  StatusOr<Topology> topology = Topology::Create(b.config.parallel);
  EXPECT_TRUE(topology.ok()) << topology.status().Message();
  b.topology = std::make_unique<Topology>(std::move(topology).value());
  StatusOr<std::unique_ptr<Model>> model =
      BuildModel(b.config, *b.topology, b.topology->Coordinates(0));
  EXPECT_TRUE(model.ok()) << model.status().Message();
  if (model.ok()) b.model = std::move(model).value();
  return b;
}

std::string Gpt(int64_t pp, const std::string& dropout) {
  return R"({"parallel": {"world_size": )" + std::to_string(2 * pp) +
         R"(, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": )" +
         std::to_string(pp) + R"(},
    "model": {"type": "gpt", "num_layers": 2, "hidden_size": 16, "num_attention_heads": 2,
              "vocab_size": 50, "max_position_embeddings": 8, )" +
         dropout + R"(},
    "run": {"seq_length": 8, "micro_batch_size": 1, "num_microbatches": 2}})";
}

const char* kChain = R"({"parallel": {"world_size": 2, "tensor_model_parallel_size": 2},
  "model": {"vocab_size": 50, "layers": [
    {"name": "embedding", "type": "VocabParallelEmbedding", "embedding_dim": 16},
    {"name": "drop", "type": "Dropout", "p": 0.1},
    {"name": "head", "type": "ColumnParallelLinear", "input_size": 16,
     "output_size": "padded_vocab_size", "gather_output": false},
    {"name": "loss", "type": "VocabParallelCrossEntropy"}]},
  "run": {"seq_length": 8, "micro_batch_size": 1}})";

// The GPT's map is its state dict: every parameter once, on the stage that holds it, and the
// tied word embeddings a second time on the last stage (its copy).
TEST(ModelInterface, TheGptShardingMapIsItsStateDictPerStage) {
  const Built b = Build(Gpt(2, R"("hidden_dropout": 0, "attention_dropout": 0)"));
  ASSERT_NE(b.model, nullptr);
  std::map<std::string, int> seen;
  for (const ParameterPlacement& p : b.model->ShardingMap()) ++seen[p.name];
  GptConfig gpt = *b.config.gpt;
  ASSERT_TRUE(CheckGptLayout(b.config.parallel, *b.config.run, &gpt).ok());
  const auto all = GptParameters(gpt, b.model->padded_vocab_size(), false);
  EXPECT_EQ(seen.size(), all.size());
  for (const GptParameter& p : all) {
    const bool tied = p.name == "embedding.word_embeddings.weight" &&
                      gpt.share_embeddings_and_output_weights;
    EXPECT_EQ(seen[p.name], tied ? 2 : 1) << p.name;
  }
}

TEST(ModelInterface, EachModelSaysWhetherItsMasksFollowTheLayout) {
  EXPECT_TRUE(Build(Gpt(1, R"("dropout_mode": "rng_tracker", "hidden_dropout": 0.1)"))
                  .model->MasksDependOnLayout());
  EXPECT_FALSE(Build(Gpt(1, R"("dropout_mode": "global", "hidden_dropout": 0.1)"))
                   .model->MasksDependOnLayout());
  EXPECT_FALSE(Build(Gpt(1, R"("dropout_mode": "rng_tracker", "hidden_dropout": 0,
                               "attention_dropout": 0)"))
                   .model->MasksDependOnLayout());
  const Built chain = Build(kChain);
  ASSERT_NE(chain.model, nullptr);
  EXPECT_TRUE(chain.model->MasksDependOnLayout());
  EXPECT_FALSE(chain.model->Describe().empty());
}

TEST(ModelInterface, AConfigWithoutAModelIsRefusedNamingTheSection) {
  StatusOr<nlohmann::json> document =
      ParseJsonText(R"({"parallel": {"world_size": 2, "tensor_model_parallel_size": 2}})");
  ASSERT_TRUE(document.ok());
  Config config;
  ASSERT_TRUE(ParseConfig(*document, &config).ok());
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  ASSERT_TRUE(topology.ok());
  StatusOr<std::unique_ptr<Model>> model = BuildModel(config, *topology, RankCoordinates{});
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().where(), "model");
}

}  // namespace
}  // namespace mpusim
