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

// DefaultRun (core/config/config.h), the one run section a command assumes: a GPT's sequence
// is the one its positions are sized for; the chain's, and a GPT's without a position table
// size, the shortest every split of the layout divides.
TEST(DefaultRun, IsTheModelsSequenceElseTheShortestTheLayoutSplits) {
  Config config;
  config.parallel.tensor_model_parallel_size = 2;
  config.parallel.context_parallel_size = 3;
  config.parallel.pipeline_model_parallel_size = 4;
  config.parallel.bf16 = true;
  config.model = ModelConfig{};
  RunConfig run = DefaultRun(config);
  EXPECT_EQ(run.seq_length, 12);
  EXPECT_EQ(run.num_microbatches, 4);
  EXPECT_EQ(run.dtype, DType::kBFloat16);
  config.model.reset();
  config.gpt = GptConfig{};
  config.gpt->max_position_embeddings = 0;  // follows the run's sequence: unknown here
  EXPECT_EQ(DefaultRun(config).seq_length, 12);
  config.gpt->max_position_embeddings = 4096;
  EXPECT_EQ(DefaultRun(config).seq_length, 4096);
  config.parallel.microbatch_group_size_per_vp_stage = 6;
  EXPECT_EQ(DefaultRun(config).num_microbatches, 6);
}

}  // namespace
}  // namespace mpusim
