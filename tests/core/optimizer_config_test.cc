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

// The dtypes of an optimizer section of `keys` (lr added) for a run storing `storage`;
// the section must parse and pass CheckOptimizerPrecision.
OptimizerPrecision PrecisionFor(DType storage, const json& keys) {
  json section = keys;
  section["lr"] = 0.01;
  OptimizerConfig c;
  const Status s = ParseOptimizerSection(section, &c);
  EXPECT_TRUE(s.ok()) << s.Message();
  EXPECT_TRUE(CheckOptimizerPrecision(c, storage).ok());
  return PrecisionOf(&c, storage);
}

// The gradient buffer's and optimizer's dtypes as megatron/training/arguments.py resolves
// them: bf16 forces accumulate_allreduce_grads_in_fp32 (unless grad_reduce_in_bf16 or a bf16
// main_grads_dtype), fp16 leaves it off, so an fp16 run's main_grad is float16.
TEST(OptimizerPrecision, MainGradFollowsMegatronsRules) {
  const auto main_grad = [](DType storage, const json& keys) {
    return PrecisionFor(storage, keys).main_grad;
  };
  EXPECT_EQ(main_grad(DType::kFloat16, json::object()), DType::kFloat16);
  EXPECT_EQ(main_grad(DType::kFloat16, {{"accumulate_allreduce_grads_in_fp32", true}}),
            DType::kFloat32);
  EXPECT_EQ(main_grad(DType::kBFloat16, json::object()), DType::kFloat32);
  EXPECT_EQ(main_grad(DType::kBFloat16, {{"grad_reduce_in_bf16", true}}), DType::kBFloat16);
  EXPECT_EQ(main_grad(DType::kBFloat16, {{"use_precision_aware_optimizer", true},
                                         {"use_distributed_optimizer", true},
                                         {"main_grads_dtype", "bf16"}}),
            DType::kBFloat16);
  EXPECT_EQ(main_grad(DType::kFloat32, json::object()), DType::kFloat32);
  EXPECT_EQ(main_grad(DType::kFloat64, {{"accumulate_allreduce_grads_in_fp32", true}}),
            DType::kFloat64);
  // No optimizer section: every key at its default.
  EXPECT_EQ(PrecisionOf(nullptr, DType::kFloat16).main_grad, DType::kFloat16);
  EXPECT_TRUE(PrecisionOf(nullptr, DType::kFloat16).grads_copied_for_step);
  EXPECT_FALSE(PrecisionOf(nullptr, DType::kBFloat16).grads_copied_for_step);
  // The precision-aware optimizer's state dtypes, in Megatron's names.
  OptimizerConfig c;
  ASSERT_TRUE(ParseOptimizerSection(json{{"lr", 0.01},
                                         {"use_distributed_optimizer", true},
                                         {"use_precision_aware_optimizer", true},
                                         {"main_params_dtype", "fp16"},
                                         {"exp_avg_dtype", "bf16"},
                                         {"exp_avg_sq_dtype", "fp16"}},
                                    &c)
                  .ok());
  const OptimizerPrecision p = PrecisionOf(&c, DType::kBFloat16);
  EXPECT_EQ(p.master, DType::kFloat16);
  EXPECT_EQ(p.exp_avg, DType::kBFloat16);
  EXPECT_EQ(p.exp_avg_sq, DType::kFloat16);
  EXPECT_FALSE(p.grads_copied_for_step);
  EXPECT_FALSE(p.param_remainders);  // an fp16 master: FusedAdam keeps no remainders
}

// store_param_remainders (default true) holds only where Transformer Engine's FusedAdam keeps
// it: the precision-aware optimizer, bf16 parameters, a float32 master. Elsewhere it is
// accepted and ignored, as Megatron ignores it.
TEST(OptimizerPrecision, ParamRemaindersOnlyWhereFusedAdamKeepsThem) {
  const auto remainders = [](DType storage, const json& keys) {
    const OptimizerPrecision p = PrecisionFor(storage, keys);
    const bool fp16_master = keys.value("main_params_dtype", "fp32") == "fp16";
    EXPECT_EQ(p.master, storage == DType::kFloat64 ? DType::kFloat64
                        : fp16_master              ? DType::kFloat16
                                                   : DType::kFloat32);
    EXPECT_EQ(MasterBytes(p), p.param_remainders ? 2 : int64_t(DTypeSize(p.master)));
    return p.param_remainders;
  };
  const json aware = {{"use_distributed_optimizer", true}, {"use_precision_aware_optimizer", true}};
  EXPECT_TRUE(remainders(DType::kBFloat16, aware));
  json off = aware;
  off["store_param_remainders"] = false;
  EXPECT_FALSE(remainders(DType::kBFloat16, off));
  json fp16_master = aware;
  fp16_master["main_params_dtype"] = "fp16";
  EXPECT_FALSE(remainders(DType::kBFloat16, fp16_master));
  EXPECT_FALSE(remainders(DType::kFloat16, aware));
  EXPECT_FALSE(remainders(DType::kFloat32, aware));
  EXPECT_FALSE(remainders(DType::kBFloat16, json::object()));
  EXPECT_FALSE(remainders(DType::kBFloat16, {{"store_param_remainders", true}}));
  EXPECT_FALSE(remainders(DType::kFloat64, {{"store_param_remainders", true}}));
  EXPECT_EQ(MasterStorageName(PrecisionOf(nullptr, DType::kBFloat16)), "float32");
  OptimizerPrecision p = PrecisionOf(nullptr, DType::kBFloat16);
  p.param_remainders = true;
  EXPECT_EQ(MasterStorageName(p), "bfloat16 parameter + int16 remainder");
}

TEST(OptimizerPrecision, RefusalsAreMegatrons) {
  EXPECT_NE(Refusal({{"lr", 0.01}, {"exp_avg_dtype", "bf16"}})
                .find("optimizer.exp_avg_dtype: \"bf16\" needs use_precision_aware_optimizer"),
            std::string::npos);
  EXPECT_NE(Refusal({{"lr", 0.01}, {"use_precision_aware_optimizer", true}})
                .find("needs use_distributed_optimizer true"),
            std::string::npos);
  EXPECT_NE(Refusal({{"lr", 0.01},
                     {"optimizer", "sgd"},
                     {"use_distributed_optimizer", true},
                     {"use_precision_aware_optimizer", true}})
                .find("needs optimizer \"adam\""),
            std::string::npos);
  EXPECT_NE(Refusal({{"lr", 0.01}, {"main_params_dtype", "bf16"}})
                .find("optimizer.main_params_dtype: must be \"fp32\" or \"fp16\""),
            std::string::npos);
  EXPECT_NE(Refusal({{"lr", 0.01}, {"exp_avg_sq_dtype", "fp8"}}).find("not built"),
            std::string::npos);
  const auto checked = [](DType storage, const json& keys) {
    json section = keys;
    section["lr"] = 0.01;
    OptimizerConfig c;
    EXPECT_TRUE(ParseOptimizerSection(section, &c).ok());
    const Status s = CheckOptimizerPrecision(c, storage);
    return s.ok() ? std::string("accepted") : s.Message();
  };
  EXPECT_NE(checked(DType::kFloat16, {{"grad_reduce_in_bf16", true}})
                .find("optimizer.grad_reduce_in_bf16: applies to bf16 runs only"),
            std::string::npos);
  EXPECT_NE(checked(DType::kBFloat16, {{"accumulate_allreduce_grads_in_fp32", true},
                                       {"use_distributed_optimizer", true},
                                       {"use_precision_aware_optimizer", true},
                                       {"main_grads_dtype", "bf16"}})
                .find("optimizer.main_grads_dtype: must be \"fp32\" with "
                      "accumulate_allreduce_grads_in_fp32"),
            std::string::npos);
  // ParseConfig applies the check with the run's dtype.
  Config config;
  const Status s =
      ParseConfig(json{{"parallel", {{"world_size", 1}}},
                       {"run", {{"dtype", "float16"}, {"seq_length", 8}, {"micro_batch_size", 1}}},
                       {"optimizer", {{"lr", 0.01}, {"grad_reduce_in_bf16", true}}}},
                  &config);
  EXPECT_NE(s.Message().find("optimizer.grad_reduce_in_bf16"), std::string::npos) << s.Message();
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
