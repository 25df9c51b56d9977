// FactsOf (core/config/model_facts.h): a GPT answers its own fields, the layer chain and a
// config without a model the neutral value of each.
#include "core/config/model_facts.h"

#include <gtest/gtest.h>

#include "core/config/config.h"

namespace mpusim {
namespace {

void ExpectNeutral(const ModelFacts& facts) {
  EXPECT_FALSE(facts.has_attention());
  EXPECT_FALSE(facts.cp_comm_type.has_value());
  EXPECT_FALSE(facts.moe.enabled());
  EXPECT_EQ(facts.moe.num_experts, 0);
  EXPECT_FALSE(facts.fp8.has_value());
  EXPECT_EQ(facts.fp8_recipe, Fp8Recipe::kDelayed);
  EXPECT_FALSE(facts.tied_embeddings);
}

TEST(ModelFacts, TheLayerChainAnswersTheNeutralValues) {
  Config config;
  config.model = ModelConfig{};
  ExpectNeutral(FactsOf(config));
  ExpectNeutral(FactsOf(Config{}));  // no model at all
}

TEST(ModelFacts, AGptAnswersItsFields) {
  Config config;
  GptConfig gpt;
  gpt.cp_comm_type = CpCommType::kA2a;
  gpt.moe.num_experts = 8;
  gpt.moe.token_dispatcher = MoeDispatcher::kAllToAll;
  gpt.moe.grouped_gemm = true;
  gpt.fp8 = Fp8Format::kHybrid;
  gpt.fp8_recipe = Fp8Recipe::kMxfp8;
  gpt.share_embeddings_and_output_weights = false;
  config.gpt = gpt;
  const ModelFacts facts = FactsOf(config);
  EXPECT_TRUE(facts.has_attention());
  EXPECT_EQ(facts.cp_comm_type, CpCommType::kA2a);
  EXPECT_TRUE(facts.moe.enabled());
  EXPECT_EQ(facts.moe.num_experts, 8);
  EXPECT_EQ(facts.moe.token_dispatcher, MoeDispatcher::kAllToAll);
  EXPECT_TRUE(facts.moe.grouped_gemm);
  EXPECT_EQ(facts.fp8, Fp8Format::kHybrid);
  EXPECT_EQ(facts.fp8_recipe, Fp8Recipe::kMxfp8);
  EXPECT_FALSE(facts.tied_embeddings);

  config.gpt = GptConfig{};  // Megatron's defaults: p2p, dense, no fp8, tied embeddings
  const ModelFacts defaults = FactsOf(config);
  EXPECT_EQ(defaults.cp_comm_type, CpCommType::kP2p);
  EXPECT_FALSE(defaults.moe.enabled());
  EXPECT_FALSE(defaults.fp8.has_value());
  EXPECT_TRUE(defaults.tied_embeddings);
}

}  // namespace
}  // namespace mpusim
