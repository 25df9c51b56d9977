// The optimizer section and Megatron's learning-rate schedule (core/config/optimizer_config.h).
#include "core/config/optimizer_config.h"

#include "core/config/config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>
#include <string>

namespace mpusim {
namespace {

using nlohmann::json;

std::string Refusal(const json& section) {
  OptimizerConfig c;
  const Status s = ParseOptimizerSection(section, &c);
  return s.ok() ? "accepted" : s.Message();
}

TEST(OptimizerConfig, DefaultsAreMegatrons) {
  OptimizerConfig c;
  ASSERT_TRUE(ParseOptimizerSection(json{{"lr", 0.01}}, &c).ok());
  EXPECT_EQ(c.kind, OptimizerConfig::Kind::kAdam);
  EXPECT_EQ(c.lr_decay_style, OptimizerConfig::DecayStyle::kLinear);
  EXPECT_EQ(c.weight_decay, 0.01);
  EXPECT_EQ(c.adam_beta1, 0.9);
  EXPECT_EQ(c.adam_beta2, 0.999);
  EXPECT_EQ(c.adam_eps, 1e-8);
  EXPECT_EQ(c.sgd_momentum, 0.9);
  EXPECT_EQ(c.clip_grad, 1.0);
  EXPECT_FALSE(c.use_distributed_optimizer);
  EXPECT_FALSE(c.lr_decay_iters.has_value());
  ASSERT_TRUE(
      ParseOptimizerSection(json{{"lr", 0.01}, {"use_distributed_optimizer", true}}, &c).ok());
  EXPECT_TRUE(c.use_distributed_optimizer);
}

TEST(OptimizerConfig, RefusalsNameTheField) {
  EXPECT_EQ(Refusal(json::object()),
            "optimizer.lr: is required (the peak learning rate, e.g. "
            "\"lr\": 1e-3)");
  EXPECT_EQ(Refusal(json{{"lr", 1}, {"optimizer", "lamb"}}),
            "optimizer.optimizer: must be \"adam\" (AdamW; \"adamw\" is accepted too) or "
            "\"sgd\", got string \"lamb\"");
  // Megatron's "adam" is AdamW; either name is taken.
  EXPECT_EQ(Refusal(json{{"lr", 1}, {"optimizer", "adamw"}}), "accepted");
  EXPECT_EQ(Refusal(json{{"lr", 0.1}, {"min_lr", 0.2}}), "optimizer.min_lr: 0.2 is above lr 0.1");
  EXPECT_EQ(Refusal(json{{"lr", 1}, {"lr_decay_iters", 3}, {"lr_warmup_iters", 3}}),
            "optimizer.lr_decay_iters: 3 must exceed lr_warmup_iters 3");
  EXPECT_EQ(Refusal(json{{"lr", 1}, {"adam_beta2", 1.0}}).rfind("optimizer.adam_beta2: ", 0), 0u);
  EXPECT_EQ(Refusal(json{{"lr", 1}, {"clip_grad", -1}}),
            "optimizer.clip_grad: must be a finite number >= 0, got number -1");
  EXPECT_EQ(Refusal(json{{"lr", 1}, {"use_distributed_optimizer", 1}})
                .rfind("optimizer.use_distributed_optimizer: ", 0),
            0u);
  EXPECT_EQ(Refusal(json{{"lr", 1}, {"learning_rate", 1}}).rfind("optimizer.learning_rate: ", 0),
            0u);
}

TEST(LearningRate, WarmupThenLinearCosineOrConstant) {
  OptimizerConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.lr_warmup_iters = 2;
  // Warmup from 0: the first iteration runs at 0, as Megatron's scheduler starts at step 0.
  EXPECT_EQ(LearningRate(c, 0, 12), 0.0);
  EXPECT_EQ(LearningRate(c, 1, 12), 0.5);
  EXPECT_EQ(LearningRate(c, 2, 12), 1.0);
  // Linear over (warmup, decay = train_iters]: halfway is the midpoint of lr and min_lr.
  EXPECT_DOUBLE_EQ(LearningRate(c, 7, 12), 0.55);
  EXPECT_DOUBLE_EQ(LearningRate(c, 12, 12), 0.1);
  EXPECT_EQ(LearningRate(c, 13, 12), 0.1);
  c.lr_decay_style = OptimizerConfig::DecayStyle::kCosine;
  EXPECT_DOUBLE_EQ(LearningRate(c, 7, 12), 0.1 + 0.9 * 0.5 * (std::cos(std::numbers::pi / 2) + 1));
  c.lr_decay_iters = 4;
  EXPECT_DOUBLE_EQ(LearningRate(c, 3, 12), 0.1 + 0.9 * 0.5 * (std::cos(std::numbers::pi / 2) + 1));
  EXPECT_EQ(LearningRate(c, 5, 12), 0.1);
  c.lr_decay_style = OptimizerConfig::DecayStyle::kConstant;
  EXPECT_EQ(LearningRate(c, 1, 12), 0.5);
  EXPECT_EQ(LearningRate(c, 9, 12), 1.0);
}

TEST(LearningRate, NoWeightDecayOnBiasesAndNorms) {
  EXPECT_TRUE(TakesWeightDecay("decoder.layers.0.mlp.linear_fc1.weight", 2));
  EXPECT_FALSE(TakesWeightDecay("decoder.layers.0.mlp.linear_fc1.bias", 1));
  EXPECT_FALSE(TakesWeightDecay("decoder.final_layernorm.weight", 1));
}

// run.global_batch_size fixes the samples per iteration; num_microbatches follows the
// layout's data-parallel size.
TEST(GlobalBatch, NumMicrobatchesFollowsTheDataParallelSize) {
  auto parse = [](int64_t world, int64_t tp, json run) {
    Config config;
    const Status s = ParseConfig(
        json{{"parallel", {{"world_size", world}, {"tensor_model_parallel_size", tp}}},
             {"run", run}},
        &config);
    return s.ok() ? std::to_string(config.run->num_microbatches) : s.Message();
  };
  const json run = {{"seq_length", 8}, {"micro_batch_size", 2}, {"global_batch_size", 16}};
  EXPECT_EQ(parse(8, 1, run), "1");  // dp 8
  EXPECT_EQ(parse(8, 2, run), "2");  // dp 4
  EXPECT_EQ(parse(8, 8, run), "8");  // dp 1
  json agreeing = run;
  agreeing["num_microbatches"] = 2;
  EXPECT_EQ(parse(8, 2, agreeing), "2");
  EXPECT_EQ(parse(8, 1, agreeing),
            "run.num_microbatches: 2 disagrees with global_batch_size 16 / (micro_batch_size 2 * "
            "data_parallel_size 8) = 1; give one of them");
  json odd = run;
  odd["global_batch_size"] = 12;
  EXPECT_EQ(parse(8, 1, odd), "run.global_batch_size: 12 is not divisible by micro_batch_size 2 "
                              "* data_parallel_size 8 = 16");
}

}  // namespace
}  // namespace mpusim
