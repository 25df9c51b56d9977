// Tests of the GPT model section (core/config/gpt_config.h): TransformerConfig's defaults, one-line
// refusals naming the field, the layout checks, and the parameter list (Megatron-Core
// GPTModel state-dict names, shapes, tensor-parallel splits).
#include "core/config/gpt_config.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>

#include "core/config/config.h"
#include "core/config/parallel_config.h"

namespace mpusim {
namespace {

using nlohmann::json;

json Minimal() {
  return json{{"type", "gpt"}, {"num_layers", 2}, {"hidden_size", 64},
              {"num_attention_heads", 8}, {"vocab_size", 1000}};
}

std::string Refusal(const json& section) {
  GptConfig gpt;
  const Status status = ParseGptSection(section, &gpt);
  return status.ok() ? "accepted" : status.Message();
}

TEST(GptConfig, MegatronDefaults) {
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(Minimal(), &gpt).ok());
  EXPECT_EQ(gpt.ffn_hidden_size, 256);
  EXPECT_EQ(gpt.kv_channels, 8);
  EXPECT_EQ(gpt.num_query_groups, 8);
  EXPECT_EQ(gpt.normalization, Normalization::kLayerNorm);
  EXPECT_EQ(gpt.layernorm_epsilon, 1e-5);
  EXPECT_EQ(gpt.activation, Activation::kGelu);
  EXPECT_TRUE(gpt.add_bias_linear);
  EXPECT_EQ(gpt.hidden_dropout, 0.1);
  EXPECT_EQ(gpt.attention_dropout, 0.1);
  EXPECT_EQ(gpt.position_embedding_type, PositionEmbedding::kLearnedAbsolute);
  EXPECT_EQ(gpt.rotary_base, 10000.0);
  EXPECT_TRUE(gpt.share_embeddings_and_output_weights);
  EXPECT_EQ(gpt.init_method_std, 0.02);
  EXPECT_EQ(gpt.make_vocab_size_divisible_by, 128);
  EXPECT_EQ(gpt.PaddedVocabSize(1), 1024);
  EXPECT_EQ(gpt.PaddedVocabSize(8), 1024);
  EXPECT_EQ(gpt.PaddedVocabSize(16), 2048);
  EXPECT_EQ(gpt.QkvRows(), 3 * 64);
}

TEST(GptConfig, GroupedQuerySwigluRope) {
  json section = Minimal();
  section["num_query_groups"] = 2;
  section["activation"] = "swiglu";
  section["ffn_hidden_size"] = 96;
  section["position_embedding_type"] = "rope";
  section["normalization"] = "RMSNorm";
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.QkvRows(), (8 + 2 * 2) * 8);
  EXPECT_EQ(gpt.Fc1Rows(), 192);
  EXPECT_FALSE(gpt.has_position_embeddings());
}

// Megatron's command-line spellings (megatron/training/arguments.py) of keys mpusim has are
// read as those keys; one that contradicts its key is refused naming both.
TEST(GptConfig, MegatronsCommandLineSpellings) {
  const auto parsed = [](json section) {
    GptConfig gpt;
    const Status status = ParseGptSection(section, &gpt);
    EXPECT_TRUE(status.ok()) << status.Message();
    return gpt;
  };
  json section = Minimal();
  section["swiglu"] = true;
  section["group_query_attention"] = true;
  section["num_query_groups"] = 2;
  section["untie_embeddings_and_output_weights"] = true;
  GptConfig gpt = parsed(section);
  EXPECT_EQ(gpt.activation, Activation::kSwiglu);
  EXPECT_EQ(gpt.num_query_groups, 2);
  EXPECT_FALSE(gpt.share_embeddings_and_output_weights);
  // --group-query-attention alone: --num-query-groups' default, 1; without it the groups are
  // ignored, as Megatron ignores them.
  section = Minimal();
  section["group_query_attention"] = true;
  EXPECT_EQ(parsed(section).num_query_groups, 1);
  section["group_query_attention"] = false;
  section["num_query_groups"] = 2;
  gpt = parsed(section);
  EXPECT_EQ(gpt.num_query_groups, 8);
  ASSERT_EQ(gpt.ignored.size(), 1u);
  EXPECT_NE(gpt.ignored[0].find("model.num_query_groups: ignored"), std::string::npos);
  // activation_func by name, with gated_linear_unit.
  for (const auto& [func, gated, activation] :
       {std::tuple{"silu", true, Activation::kSwiglu},
        {"gelu", false, Activation::kGelu},
        {"quick_gelu", true, Activation::kQuickGeglu},
        {"relu", false, Activation::kRelu},
        {"squared_relu", false, Activation::kSquaredRelu}}) {
    section = Minimal();
    section["activation_func"] = func;
    if (gated) section["gated_linear_unit"] = true;
    EXPECT_EQ(parsed(section).activation, activation) << func;
  }
  section = Minimal();
  section["activation_func"] = "silu";
  EXPECT_EQ(Refusal(section),
            "model.activation_func: \"silu\" with gated_linear_unit false is not built; mpusim "
            "computes gelu, silu with gated_linear_unit true (swiglu), quick_gelu with it "
            "(quick_geglu), squared_relu and relu");
  section = Minimal();
  section["swiglu"] = true;
  section["activation"] = "gelu";
  EXPECT_EQ(Refusal(section),
            "model.swiglu: means \"activation\": \"swiglu\", but activation is "
            "\"gelu\"; keep one");
  section = Minimal();
  section["untie_embeddings_and_output_weights"] = true;
  section["share_embeddings_and_output_weights"] = true;
  EXPECT_NE(Refusal(section).find("model.untie_embeddings_and_output_weights: true contradicts "
                                  "share_embeddings_and_output_weights true"),
            std::string::npos);
}

// A plain activation keeps fc1 at ffn_hidden_size rows with stride 1; a gated one doubles it.
TEST(GptConfig, SquaredReluIsPlain) {
  json section = Minimal();
  section["activation"] = "squared_relu";
  section["ffn_hidden_size"] = 96;
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.activation, Activation::kSquaredRelu);
  EXPECT_EQ(ActivationName(gpt.activation), "squared_relu");
  EXPECT_EQ(gpt.Fc1Rows(), 96);
}

TEST(GptConfig, Refusals) {
  json typo = Minimal();
  typo["num_attention_head"] = 4;
  EXPECT_EQ(Refusal(typo), "model.num_attention_head: unknown key; did you mean 'num_attention_heads'?");
  json missing = Minimal();
  missing.erase("vocab_size");
  EXPECT_EQ(Refusal(missing), "model.vocab_size: is required for \"type\": \"gpt\" (an integer >= 1)");
  json norm = Minimal();
  norm["normalization"] = "layernorm";
  EXPECT_EQ(Refusal(norm),
            "model.normalization: must be \"LayerNorm\" or \"RMSNorm\", got string \"layernorm\"");
  json act = Minimal();
  act["activation"] = "tanh";
  EXPECT_EQ(Refusal(act),
            "model.activation: must be \"gelu\", \"swiglu\", \"squared_relu\", "
            "\"quick_geglu\" or \"relu\", got string \"tanh\"");
  json groups = Minimal();
  groups["num_query_groups"] = 3;
  EXPECT_EQ(Refusal(groups),
            "model.num_query_groups: num_attention_heads 8 is not divisible by num_query_groups 3");
  json heads = Minimal();
  heads["num_attention_heads"] = 6;
  EXPECT_EQ(Refusal(heads),
            "model.num_attention_heads: hidden_size 64 is not divisible by num_attention_heads 6; "
            "set kv_channels or choose a divisor");
  json rope = Minimal();
  rope["position_embedding_type"] = "rope";
  rope["kv_channels"] = 7;
  EXPECT_EQ(Refusal(rope),
            "model.kv_channels: rope rotates pairs of channels, so kv_channels must be even, got 7");
  json dropout = Minimal();
  dropout["hidden_dropout"] = 1.0;
  EXPECT_EQ(Refusal(dropout), "model.hidden_dropout: must be a number in [0, 1), got number 1.0");
  json type = Minimal();
  type["type"] = "GPT";
  EXPECT_EQ(Refusal(type),
            "model.type: must be \"gpt\" (a layer chain has no \"type\", only \"layers\"), got "
            "string \"GPT\"");
  json eps = Minimal();
  eps["layernorm_epsilon"] = 0;
  EXPECT_EQ(Refusal(eps), "model.layernorm_epsilon: must be a number > 0, got number 0");
}

TEST(GptConfig, ConfigRoutesByType) {
  const json document = {{"parallel", {{"world_size", 2}, {"tensor_model_parallel_size", 2}}},
                         {"model", Minimal()},
                         {"run", {{"seq_length", 16}}}};
  Config config;
  ASSERT_TRUE(ParseConfig(document, &config).ok());
  EXPECT_TRUE(config.gpt.has_value());
  EXPECT_FALSE(config.model.has_value());
}

// A Megatron user's TransformerConfig fields at Megatron's defaults: accepted, one note each
// saying why it changes nothing mpusim computes.
TEST(GptConfig, PastedTransformerConfigFieldsAtTheirDefaultsGiveNotes) {
  json section = Minimal();
  const json pasted = {{"apply_query_key_layer_scaling", false},
                       {"bias_dropout_fusion", true},
                       {"masked_softmax_fusion", true},
                       {"attention_softmax_in_fp32", true},
                       {"bias_activation_fusion", true},
                       {"persist_layer_norm", true},
                       {"memory_efficient_layer_norm", false},
                       {"apply_residual_connection_post_layernorm", false},
                       {"add_qkv_bias", false},
                       {"fp32_residual_connection", false},
                       {"qk_layernorm", false},
                       {"rotary_percent", 1.0},
                       {"rotary_interleaved", false},
                       {"gated_linear_unit", false}};
  section.update(pasted);
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  // add_qkv_bias, qk_layernorm and rotary_percent are keys of their own; rotary_percent gets
  // a note of its own on a model without rope.
  ASSERT_EQ(gpt.ignored.size(), pasted.size() - 2);
  EXPECT_NE(std::find(gpt.ignored.begin(), gpt.ignored.end(),
                      "model.rotary_percent: ignored: position_embedding_type is not \"rope\""),
            gpt.ignored.end());
  EXPECT_NE(std::find(gpt.ignored.begin(), gpt.ignored.end(),
                      "model.fp32_residual_connection: false is what mpusim computes: the "
                      "residual stream is kept in run.dtype"),
            gpt.ignored.end());
  // Values that would change the model are refused, each with its reason.
  const auto refused = [&](const char* key, const json& value) {
    json bad = Minimal();
    bad[key] = value;
    return Refusal(bad);
  };
  EXPECT_EQ(refused("rotary_interleaved", true),
            "model.rotary_interleaved: boolean true: RoPE pairs channel c with c + d/2 "
            "(rotate_half); interleaved pairs are not modelled; only false is accepted");
  EXPECT_EQ(refused("fp32_residual_connection", true),
            "model.fp32_residual_connection: boolean true: the residual stream is kept in "
            "run.dtype; only false is accepted");
  EXPECT_NE(refused("gated_linear_unit", true).find("\"swiglu\" is Megatron's gated_linear_unit"),
            std::string::npos);
  json swiglu = Minimal();
  swiglu["activation"] = "swiglu";
  swiglu["gated_linear_unit"] = true;
  EXPECT_EQ(Refusal(swiglu), "accepted");
}

// gpt-oss's MLP: "quick_geglu" (Megatron's activation_func quick_gelu with gated_linear_unit)
// with glu_linear_offset and activation_func_clamp_value; an ungated activation ignores both
// with a note (Megatron reads them only in the glu); a clamped SwiGLU keeps Megatron's rules.
TEST(GptConfig, QuickGegluWithTheGluOffsetAndClamp) {
  json section = Minimal();
  section["activation"] = "quick_geglu";
  section["gated_linear_unit"] = true;
  section["glu_linear_offset"] = 1.0;
  section["activation_func_clamp_value"] = 7.0;
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.activation, Activation::kQuickGeglu);
  EXPECT_EQ(gpt.Fc1Rows(), 2 * gpt.ffn_hidden_size);
  const GluOptions glu = gpt.Glu();
  EXPECT_EQ(glu.linear_offset, 1.0);
  EXPECT_TRUE(glu.clamped);
  EXPECT_EQ(glu.clamp_value, 7.0);
  EXPECT_FALSE(GptConfig{}.Glu().clamped);  // Megatron's defaults: 0.0 and None

  json gelu = Minimal();
  gelu["glu_linear_offset"] = 1.0;
  gelu["activation_func_clamp_value"] = 7.0;
  GptConfig plain;
  ASSERT_TRUE(ParseGptSection(gelu, &plain).ok());
  EXPECT_EQ(plain.glu_linear_offset, 0.0);
  EXPECT_FALSE(plain.activation_func_clamp_value.has_value());
  EXPECT_NE(std::find(plain.ignored.begin(), plain.ignored.end(),
                      "model.activation_func_clamp_value: ignored: only a gated activation's glu "
                      "reads it, and \"activation\": \"gelu\" is not gated"),
            plain.ignored.end());

  json bad = section;
  bad["activation_func_clamp_value"] = 0;
  EXPECT_EQ(Refusal(bad), "model.activation_func_clamp_value: must be a number > 0, got number 0");
  bad = section;
  bad["glu_linear_offset"] = "1";
  EXPECT_EQ(Refusal(bad), "model.glu_linear_offset: must be a finite number, got string \"1\"");
  json swiglu = Minimal();
  swiglu["activation"] = "swiglu";
  swiglu["activation_func_clamp_value"] = 7.0;
  EXPECT_EQ(Refusal(swiglu),
            "model.activation_func_clamp_value: activation_func_clamp_value for SwiGLU is only "
            "supported with MoE (Megatron's rule); set num_moe_experts or use \"quick_geglu\"");
  swiglu["num_moe_experts"] = 4;
  swiglu["add_bias_linear"] = false;
  EXPECT_EQ(Refusal(swiglu), "accepted");
  swiglu["glu_linear_offset"] = 1.0;
  EXPECT_EQ(Refusal(swiglu),
            "model.glu_linear_offset: must be zero when activation_func_clamp_value is set for "
            "SwiGLU (Megatron's rule)");
}

// qk_layernorm: q_layernorm and k_layernorm after linear_qkv, [kv_channels] each, the
// model's normalization (a bias with LayerNorm), gradient all-reduced over tp with or
// without sequence parallelism; rotary_percent: int(kv_channels * p) channels turned, even.
TEST(GptConfig, QkLayerNormAndRotaryPercent) {
  json section = Minimal();
  section["kv_channels"] = 12;
  section["qk_layernorm"] = true;
  section["position_embedding_type"] = "rope";
  section["rotary_percent"] = 0.5;
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_TRUE(gpt.qk_layernorm);
  EXPECT_EQ(gpt.RotaryDim(), 6);
  EXPECT_TRUE(gpt.ignored.empty());
  const std::vector<GptParameter> params = GptParameters(gpt, 1024, /*sequence_parallel=*/false);
  std::vector<std::string> names;
  for (const GptParameter& p : params) {
    if (p.name.find("_layernorm") == std::string::npos || !p.name.starts_with("decoder.layers.0.")) {
      continue;
    }
    names.push_back(p.name);
    if (p.name.find("self_attention") != std::string::npos) {
      EXPECT_EQ(p.shape, (Shape{12})) << p.name;
      EXPECT_EQ(p.tp_dim, -1) << p.name;
      EXPECT_TRUE(p.allreduce_grad_over_tp) << p.name;
    } else {
      EXPECT_FALSE(p.allreduce_grad_over_tp) << p.name;
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{
                       "decoder.layers.0.input_layernorm.weight",
                       "decoder.layers.0.input_layernorm.bias",
                       "decoder.layers.0.self_attention.q_layernorm.weight",
                       "decoder.layers.0.self_attention.q_layernorm.bias",
                       "decoder.layers.0.self_attention.k_layernorm.weight",
                       "decoder.layers.0.self_attention.k_layernorm.bias",
                       "decoder.layers.0.pre_mlp_layernorm.weight",
                       "decoder.layers.0.pre_mlp_layernorm.bias"}));

  const auto refusal = [&](const json& percent) {
    json bad = section;
    bad["rotary_percent"] = percent;
    return Refusal(bad);
  };
  EXPECT_EQ(refusal(0.25),  // int(12 * 0.25) = 3 channels: no pairs
            "model.rotary_percent: 0.25 of kv_channels 12 turns int(12 * 0.25) = 3 channels; "
            "rope rotates pairs, so that must be even and at least 2");
  EXPECT_EQ(refusal(1.5),
            "model.rotary_percent: must be in (0, 1] (the share of each head's channels RoPE "
            "turns), got number 1.5");
  EXPECT_EQ(refusal(0.0).rfind("model.rotary_percent: ", 0), 0u);
  EXPECT_EQ(refusal(0.34), "accepted");  // int(4.08) = 4
}

// add_qkv_bias: linear_qkv's bias without the other linear biases (Qwen's choice).
TEST(GptConfig, QkvBiasAlone) {
  json section = Minimal();
  section["add_bias_linear"] = false;
  section["add_qkv_bias"] = true;
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_TRUE(gpt.add_qkv_bias);
  std::vector<std::string> biases;
  for (const GptParameter& p : GptParameters(gpt, 1024, /*sequence_parallel=*/false)) {
    if (p.name.ends_with("bias")) biases.push_back(p.name);
  }
  EXPECT_EQ(biases, (std::vector<std::string>{
                        "decoder.layers.0.input_layernorm.bias",
                        "decoder.layers.0.self_attention.linear_qkv.bias",
                        "decoder.layers.0.pre_mlp_layernorm.bias",
                        "decoder.layers.1.input_layernorm.bias",
                        "decoder.layers.1.self_attention.linear_qkv.bias",
                        "decoder.layers.1.pre_mlp_layernorm.bias", "decoder.final_layernorm.bias"}));
}

// Every unknown key of a file in one line, each with where it belongs or what was meant.
TEST(GptConfig, UnknownKeysAreReportedAtOnceWithWhereTheyBelong) {
  const auto refusal = [](const json& document) {
    Config config;
    const Status status = ParseConfig(document, &config);
    return status.ok() ? std::string("accepted") : status.Message();
  };
  json model = Minimal();
  model["seq_length"] = 16;
  model["sequence_parallel"] = true;
  model["bias_gelu_fusion"] = true;
  const json document = {{"parallel", {{"world_size", 1}}},
                         {"model", model},
                         {"run", {{"seq_length", 16}, {"lr", 1e-4}}},
                         {"optimizer", {{"lr", 1e-4}, {"beta1", 0.9}}}};
  EXPECT_EQ(refusal(document),
            "5 unknown keys: model.bias_gelu_fusion; model.seq_length (it belongs in "
            "run.seq_length); model.sequence_parallel (it belongs in parallel.sequence_parallel); "
            "run.lr (it belongs in optimizer.lr); optimizer.beta1 (did you mean 'adam_beta1'?)");
  // One unknown key keeps the one-key form; a swapped pair of letters is a slip.
  EXPECT_EQ(refusal({{"parallel", {{"world_size", 1}}}, {"modle", Minimal()}}),
            "modle: unknown top-level key; did you mean 'model'?");
  json untyped = Minimal();
  untyped.erase("type");
  EXPECT_EQ(refusal({{"parallel", {{"world_size", 1}}}, {"model", untyped}}),
            "model: has the GPT key \"hidden_size\" but no \"type\": add \"type\": \"gpt\" (a "
            "model without it is a layer chain: vocab_size, make_vocab_size_divisible_by, "
            "layers)");
}

// A file with many stray keys gets one readable line: the first twelve, long names cut, and a
// count of the rest. Long names are never measured against the known keys (the fuzzer found a
// 64 KiB key taking seconds per comparison).
TEST(GptConfig, ManyOrLongUnknownKeysStayOneShortLine) {
  json document = {{"parallel", {{"world_size", 1}}}, {"model", Minimal()}};
  document["model"][std::string(50000, 'k')] = 1;
  for (int i = 0; i < 20; ++i) document["run"][fmt::format("stray_{:02}", i)] = i;
  Config config;
  const std::string message = ParseConfig(document, &config).Message();
  EXPECT_TRUE(message.starts_with("21 unknown keys: model." + std::string(74, 'k') +
                                  "... (50006 characters); run.stray_00; "))
      << message;
  EXPECT_TRUE(message.ends_with("; run.stray_10; and 9 more")) << message;
  EXPECT_LT(message.size(), 400u) << message;
  // Near names are still found, whatever their length.
  const std::vector<std::string_view>& keys = ParallelConfigKeys();
  EXPECT_EQ(SuggestKey("tensor_model_paralel_size", keys), "tensor_model_parallel_size");
  EXPECT_EQ(SuggestKey("pipeline_model_parallel_size_of_this_model_here", keys), "");
  EXPECT_EQ(SuggestKey(std::string(3000, 'x'), keys), "");
}

// A GPT's layer count has one source, model.num_layers: parallel.num_layers may repeat it,
// and one that disagrees is refused (it used to be taken silently).
TEST(GptConfig, LayerCountHasOneSource) {
  Config config;
  ASSERT_TRUE(ParseConfig({{"parallel", {{"world_size", 1}, {"num_layers", 2}}},
                           {"model", Minimal()}},
                          &config)
                  .ok());
  const Status conflict = ParseConfig(
      {{"parallel", {{"world_size", 1}, {"num_layers", 16}}}, {"model", Minimal()}}, &config);
  EXPECT_EQ(conflict.Message(),
            "parallel.num_layers: 16 disagrees with model.num_layers 2; a GPT config's layers "
            "are model.num_layers: drop parallel.num_layers");
}

// recompute_modules' rules that need the model: Megatron's moe_act needs the grouped GEMM.
TEST(GptConfig, RecomputeModulesNeedWhatTheyRecompute) {
  GptConfig gpt;
  json section = Minimal();
  section["add_bias_linear"] = false;
  section["num_moe_experts"] = 4;
  section["moe_router_topk"] = 2;
  const Status parsed = ParseGptSection(section, &gpt);
  ASSERT_TRUE(parsed.ok()) << parsed.Message();
  ParallelConfig parallel;
  parallel.world_size = 1;
  RunConfig run;
  run.seq_length = 8;
  run.recompute = RunConfig::Recompute::kSelective;
  using M = RunConfig::RecomputeModule;
  run.recompute_modules = {{M::kCoreAttn, M::kLayernorm, M::kMlp}};
  GptConfig copy = gpt;
  EXPECT_TRUE(CheckGptLayout(parallel, run, &copy).ok());
  run.recompute_modules = {{M::kLayernorm, M::kMoeAct}};
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "run.recompute_modules[1]: \"moe_act\" needs model.moe_grouped_gemm true (Megatron's "
            "rule)");
  copy = gpt;
  copy.moe.grouped_gemm = true;
  run.recompute_modules = {{M::kMoeAct, M::kMoe, M::kSharedExperts, M::kLayernorm}};
  EXPECT_TRUE(CheckGptLayout(parallel, run, &copy).ok());
}

TEST(GptConfig, LayoutChecks) {
  GptConfig gpt;
  json section = Minimal();
  section["num_query_groups"] = 2;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  ParallelConfig parallel;
  parallel.world_size = 4;
  parallel.tensor_model_parallel_size = 4;
  RunConfig run;
  run.seq_length = 6;
  GptConfig copy = gpt;
  Status status = CheckGptLayout(parallel, run, &copy);
  EXPECT_EQ(status.Message(),
            "model.num_query_groups: 2 is not divisible by tensor_model_parallel_size 4");
  parallel.tensor_model_parallel_size = 2;
  parallel.sequence_parallel = true;
  copy = gpt;
  status = CheckGptLayout(parallel, run, &copy);
  ASSERT_TRUE(status.ok()) << status.Message();
  EXPECT_EQ(copy.max_position_embeddings, 6);
  run.seq_length = 7;
  copy = gpt;
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "run.seq_length: 7 is not divisible by tensor_model_parallel_size 2 (sequence_parallel "
            "splits the sequence over tp)");
  parallel.sequence_parallel = false;
  copy = gpt;
  copy.max_position_embeddings = 4;
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "model.max_position_embeddings: 4 is shorter than run.seq_length 7");
  copy = gpt;
  parallel.pipeline_model_parallel_size = 2;  // runs (core/pipeline)
  parallel.world_size = 4;
  EXPECT_TRUE(CheckGptLayout(parallel, run, &copy).ok());
  parallel.pipeline_model_parallel_size = 1;
  parallel.context_parallel_size = 2;
  copy = gpt;
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "run.seq_length: 7 is not divisible by 2 * context_parallel_size = 4 (each cp rank "
            "holds two of 2 * cp equal chunks)");
  copy.cp_comm_type = CpCommType::kA2aP2p;
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "model.cp_comm_type: \"a2a+p2p\" needs parallel.hierarchical_context_parallel_sizes "
            "[a2a size, p2p size] (two levels multiplying to context_parallel_size 2), got 0 "
            "levels");
  parallel.hierarchical_context_parallel_sizes = {2, 1};
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "model.cp_comm_type: \"a2a+p2p\" gives each rank 1/2 of its tp rank's heads, so "
            "num_query_groups 2 must be divisible by tensor_model_parallel_size * "
            "hierarchical_context_parallel_sizes[0] = 4");
  parallel.hierarchical_context_parallel_sizes.clear();
  copy.cp_comm_type = CpCommType::kAllGather;
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "run.seq_length: 7 is not divisible by 2 * context_parallel_size = 4 (each cp rank "
            "holds two of 2 * cp equal chunks)");
  run.seq_length = 12;
  parallel.sequence_parallel = true;
  parallel.tensor_model_parallel_size = 4;
  copy.num_query_groups = 4;
  copy.max_position_embeddings = 0;
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "run.seq_length: 12 / context_parallel_size 2 = 6 is not divisible by "
            "tensor_model_parallel_size 4 (sequence_parallel splits each cp rank's tokens over tp)");
  parallel.sequence_parallel = false;
  EXPECT_TRUE(CheckGptLayout(parallel, run, &copy).ok());
  copy.cp_comm_type = CpCommType::kA2a;  // 4 query groups over tp 4 x cp 2
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "model.cp_comm_type: \"a2a\" gives each cp rank 1/cp of its tp rank's heads, so "
            "num_query_groups 4 must be divisible by tensor_model_parallel_size * "
            "context_parallel_size = 8; set \"p2p\" or \"all_gather\", or another layout");
  parallel.tensor_model_parallel_size = 2;
  EXPECT_TRUE(CheckGptLayout(parallel, run, &copy).ok());
  copy.cp_comm_type = CpCommType::kAllGather;
  parallel.tensor_model_parallel_size = 4;
  parallel.context_parallel_size = 1;
  parallel.expert_model_parallel_size = 2;
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "parallel.expert_model_parallel_size: 2 splits experts, but the model has none; "
            "set num_moe_experts or expert_model_parallel_size 1");
}

// Megatron's moe_* fields: read with their defaults, the layer pattern resolved from an
// integer or a list, each bad value refused naming its key, the keys noted as ignored on a
// dense model; a GPT run with experts is refused until the MoE layer is built.
TEST(GptConfig, MoeKeysAreReadAndChecked) {
  json section = Minimal();
  section["num_layers"] = 4;
  section["add_bias_linear"] = false;
  section["num_moe_experts"] = 8;
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_TRUE(gpt.moe.enabled());
  EXPECT_EQ(gpt.moe.router_topk, 2);
  EXPECT_EQ(gpt.moe.ffn_hidden_size, gpt.ffn_hidden_size);
  EXPECT_EQ(gpt.moe.layers, std::vector<bool>(4, true));
  EXPECT_EQ(gpt.moe.load_balancing, MoeLoadBalancing::kAuxLoss);
  EXPECT_EQ(gpt.moe.token_dispatcher, MoeDispatcher::kAllGather);
  EXPECT_FALSE(gpt.moe.expert_capacity_factor.has_value());
  EXPECT_FALSE(gpt.moe.z_loss_coeff.has_value());

  section["moe_router_topk"] = 3;
  section["moe_ffn_hidden_size"] = 48;
  section["moe_layer_freq"] = 2;
  section["moe_router_pre_softmax"] = true;
  section["moe_router_load_balancing_type"] = "seq_aux_loss";
  section["moe_aux_loss_coeff"] = 0.01;
  section["moe_z_loss_coeff"] = 0.001;
  section["moe_token_dispatcher_type"] = "alltoall";
  section["moe_expert_capacity_factor"] = 1.25;
  section["moe_token_drop_policy"] = "position";
  section["moe_pad_expert_input_to_capacity"] = true;
  section["moe_shared_expert_intermediate_size"] = 96;
  section["moe_grouped_gemm"] = true;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.moe.router_topk, 3);
  EXPECT_EQ(gpt.moe.ffn_hidden_size, 48);
  EXPECT_EQ(gpt.moe.layers, (std::vector<bool>{true, false, true, false}));
  EXPECT_TRUE(gpt.moe.router_pre_softmax);
  EXPECT_EQ(gpt.moe.load_balancing, MoeLoadBalancing::kSeqAuxLoss);
  EXPECT_EQ(gpt.moe.aux_loss_coeff, 0.01);
  EXPECT_EQ(gpt.moe.z_loss_coeff, 0.001);
  EXPECT_EQ(gpt.moe.token_dispatcher, MoeDispatcher::kAllToAll);
  EXPECT_EQ(gpt.moe.expert_capacity_factor, 1.25);
  EXPECT_EQ(gpt.moe.token_drop_policy, MoeDropPolicy::kPosition);
  EXPECT_TRUE(gpt.moe.pad_expert_input_to_capacity);
  EXPECT_EQ(gpt.moe.shared_expert_intermediate_size, 96);
  EXPECT_TRUE(gpt.moe.grouped_gemm);
  section["moe_layer_freq"] = json::array({0, 1, 1, 0});
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.moe.layers, (std::vector<bool>{false, true, true, false}));

  const auto refusal = [&](const char* key, const json& value) {
    json bad = section;
    bad[key] = value;
    GptConfig unused;
    return ParseGptSection(bad, &unused).Message();
  };
  EXPECT_EQ(refusal("moe_router_topk", 9),
            "model.moe_router_topk: 9 is more than the num_moe_experts 8 a token can be routed to");
  EXPECT_EQ(refusal("moe_layer_freq", json::array({1, 0})),
            "model.moe_layer_freq: the list has 2 entries but the model has num_layers 4; give "
            "one 0 (dense) or 1 (MoE) per layer");
  EXPECT_EQ(refusal("moe_layer_freq", json::array({1, 2, 1, 0})),
            "model.moe_layer_freq: a list must hold only 0 (dense) and 1 (MoE), got number 2");
  EXPECT_EQ(refusal("moe_layer_freq", 0),
            "model.moe_layer_freq: must be an integer >= 1 (every N-th layer is an MoE layer) or "
            "a list of 0/1 per layer, got number 0");
  EXPECT_EQ(refusal("moe_token_dispatcher_type", "flex"),
            "model.moe_token_dispatcher_type: must be \"allgather\" or \"alltoall\", got "
            "string \"flex\"");
  EXPECT_EQ(refusal("moe_aux_loss_coeff", -1), "model.moe_aux_loss_coeff: must be a number >= 0, "
                                               "got number -1");
  EXPECT_EQ(refusal("moe_expert_capacity_factor", nullptr),
            "model.moe_pad_expert_input_to_capacity: needs moe_expert_capacity_factor (the "
            "capacity to pad to)");
  EXPECT_EQ(refusal("num_moe_experts", nullptr),
            "model.moe_ffn_hidden_size: is set but num_moe_experts is not; set num_moe_experts "
            "or remove moe_ffn_hidden_size");

  // A dense model notes the other moe_* keys as ignored.
  json dense = Minimal();
  dense["moe_router_topk"] = 4;
  GptConfig plain;
  ASSERT_TRUE(ParseGptSection(dense, &plain).ok());
  EXPECT_FALSE(plain.moe.enabled());
  EXPECT_EQ(plain.ignored,
            std::vector<std::string>{
                "model.moe_router_topk: ignored: the model has no experts (num_moe_experts)"});

  ParallelConfig parallel;
  parallel.world_size = 1;
  RunConfig run;
  run.seq_length = 8;
  // The layout checks of an MoE run: Megatron's sequence-parallel rule, the experts' sizes.
  GptConfig moe = gpt;
  moe.moe.load_balancing = MoeLoadBalancing::kAuxLoss;
  EXPECT_TRUE(CheckGptLayout(parallel, run, &moe).ok());
  EXPECT_TRUE(CheckGptLayout(parallel, run, &gpt).ok());  // seq_aux_loss
  parallel.world_size = 2;
  parallel.tensor_model_parallel_size = 2;
  EXPECT_EQ(CheckGptLayout(parallel, run, &moe).Message(),
            "parallel.sequence_parallel: must be true for a mixture-of-experts model with "
            "tensor_model_parallel_size 2 (Megatron's rule: each tp rank's router sees its own "
            "sequence shard)");
  parallel.sequence_parallel = true;
  EXPECT_TRUE(CheckGptLayout(parallel, run, &moe).ok());
  // The experts split over expt_tp, the shared expert over tp.
  parallel.expert_tensor_parallel_size = 1;
  EXPECT_TRUE(CheckGptLayout(parallel, run, &moe).ok());
  GptConfig odd = moe;
  odd.moe.ffn_hidden_size = 6;
  parallel.expert_tensor_parallel_size = 4;
  EXPECT_EQ(CheckGptLayout(parallel, run, &odd).Message(),
            "model.moe_ffn_hidden_size: 6 is not divisible by expert_tensor_parallel_size 4 "
            "(each expert's fc1 and fc2 are split over expt_tp)");
  parallel.expert_tensor_parallel_size = 2;
  odd.moe.shared_expert_intermediate_size = 3;
  EXPECT_EQ(CheckGptLayout(parallel, run, &odd).Message(),
            "model.moe_shared_expert_intermediate_size: 3 is not divisible by "
            "tensor_model_parallel_size 2");
  parallel = ParallelConfig();
  parallel.world_size = 1;
  // Biases with MoE: Megatron allows them only with expert_tensor_parallel_size 1 and not in
  // the shared expert (SharedExpertMLP asserts add_bias_linear false).
  json biased = section;
  biased["add_bias_linear"] = true;
  biased.erase("moe_shared_expert_intermediate_size");
  GptConfig with_bias;
  ASSERT_TRUE(ParseGptSection(biased, &with_bias).ok());
  EXPECT_TRUE(CheckGptLayout(parallel, run, &with_bias).ok());
  parallel.world_size = 2;
  parallel.tensor_model_parallel_size = 2;
  parallel.sequence_parallel = true;
  parallel.expert_tensor_parallel_size = 1;
  EXPECT_TRUE(CheckGptLayout(parallel, run, &with_bias).ok());
  parallel.expert_tensor_parallel_size = 2;
  EXPECT_EQ(CheckGptLayout(parallel, run, &with_bias).Message(),
            "model.add_bias_linear: is true with expert_tensor_parallel_size 2: Megatron "
            "supports bias in MoE only when ETP==1; set expert_tensor_parallel_size 1 or "
            "add_bias_linear false");
  biased["moe_shared_expert_intermediate_size"] = 8;
  GptConfig unused;
  EXPECT_EQ(ParseGptSection(biased, &unused).Message(),
            "model.add_bias_linear: must be false with moe_shared_expert_intermediate_size "
            "(Megatron's SharedExpertMLP: bias is not supported in the shared experts)");
}

// add_bias_linear with MoE: TopKRouter's bias (drawn as its weight is) and each expert's
// linear_fc1 and linear_fc2 biases, named as Megatron's local spec names them (or the grouped
// GEMM's linear_fc<n>.bias<e>).
TEST(GptConfig, MoeBiasesFollowMegatronStateDict) {
  json section = Minimal();
  section["num_layers"] = 1;
  section["activation"] = "quick_geglu";
  section["num_moe_experts"] = 2;
  section["moe_ffn_hidden_size"] = 16;
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  std::map<std::string, GptParameter> by_name;
  for (const GptParameter& p : GptParameters(gpt, 1024, /*sequence_parallel=*/true)) {
    by_name.emplace(p.name, p);
  }
  const std::string mlp = "decoder.layers.0.mlp.";
  ASSERT_EQ(by_name.count(mlp + "router.bias"), 1u);
  EXPECT_EQ(by_name.at(mlp + "router.bias").shape, (Shape{2}));
  EXPECT_EQ(by_name.at(mlp + "router.bias").init.method, InitMethod::kNormal);
  EXPECT_TRUE(by_name.at(mlp + "router.bias").allreduce_grad_over_tp);
  for (int64_t e = 0; e < 2; ++e) {
    const std::string expert = fmt::format("{}experts.local_experts.{}.", mlp, e);
    ASSERT_EQ(by_name.count(expert + "linear_fc1.bias"), 1u);
    EXPECT_EQ(by_name.at(expert + "linear_fc1.bias").shape, (Shape{32}));
    EXPECT_EQ(by_name.at(expert + "linear_fc1.bias").init.method, InitMethod::kZeros);
    EXPECT_EQ(by_name.at(expert + "linear_fc2.bias").shape, (Shape{64}));
  }
  gpt.moe.grouped_gemm = true;  // the local spec's names whatever the flag
  EXPECT_EQ(MoeExpertBiasName("decoder.layers.0.mlp", 1, 2),
            "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.bias");
  section["add_bias_linear"] = false;
  GptConfig plain;
  ASSERT_TRUE(ParseGptSection(section, &plain).ok());
  for (const GptParameter& p : GptParameters(plain, 1024, true)) {
    EXPECT_FALSE(p.name.find(".mlp.") != std::string::npos && p.name.ends_with(".bias")) << p.name;
  }
}

// DeepSeek-style routing keys: read with Megatron's defaults, and Megatron's refusals
// (TransformerConfig.__post_init__) with its reasons, plus the group shapes its
// group_limited_topk cannot run.
// moe_router_load_balancing_type "global_aux_loss", and Megatron's list form: a list of types
// with a list of as many coefficients (Router.get_aux_loss_coeff reads type i's at i), echoed
// as given; TransformerConfig's length rule and mpusim's own (no empty list, no type twice, a
// list of coefficients only with a list of types) as one-line refusals.
TEST(GptConfig, LoadBalancingTypesMayBeListed) {
  json section = Minimal();
  section["num_moe_experts"] = 8;
  section["moe_router_load_balancing_type"] = "global_aux_loss";
  section["moe_aux_loss_coeff"] = 0.01;
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.moe.AuxLossCoeff(MoeLoadBalancing::kGlobalAuxLoss), 0.01);
  EXPECT_EQ(gpt.moe.AuxLossCoeff(MoeLoadBalancing::kAuxLoss), 0.0);
  section["moe_router_load_balancing_type"] = json::array({"seq_aux_loss", "global_aux_loss"});
  section["moe_aux_loss_coeff"] = json::array({0.05, 0.1});
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.moe.AuxLossCoeff(MoeLoadBalancing::kSeqAuxLoss), 0.05);
  EXPECT_EQ(gpt.moe.AuxLossCoeff(MoeLoadBalancing::kGlobalAuxLoss), 0.1);
  EXPECT_EQ(gpt.moe.AuxLossCoeff(MoeLoadBalancing::kAuxLoss), 0.0);
  json echoed;
  for (const Field<GptConfig>& field : GptFields()) {
    if (field.key == "moe_router_load_balancing_type" || field.key == "moe_aux_loss_coeff") {
      echoed[std::string(field.key)] = std::get<Codec<GptConfig>>(field.target).echo(gpt);
    }
  }
  EXPECT_EQ(echoed["moe_router_load_balancing_type"], section["moe_router_load_balancing_type"]);
  EXPECT_EQ(echoed["moe_aux_loss_coeff"], section["moe_aux_loss_coeff"]);

  const auto refusal = [&](const json& types, const json& coeffs) {
    json bad = section;
    bad["moe_router_load_balancing_type"] = types;
    bad["moe_aux_loss_coeff"] = coeffs;
    GptConfig unused;
    return ParseGptSection(bad, &unused).Message();
  };
  EXPECT_EQ(refusal(json::array({"aux_loss", "global_aux_loss"}), json::array({0.1})),
            "model.moe_aux_loss_coeff: moe_aux_loss_coeff must be a list of the same length as "
            "moe_router_load_balancing_type");
  EXPECT_EQ(refusal(json::array({"aux_loss", "global_aux_loss"}), 0.1),
            "model.moe_aux_loss_coeff: moe_aux_loss_coeff must be a list of the same length as "
            "moe_router_load_balancing_type");
  EXPECT_EQ(refusal("aux_loss", json::array({0.1})),
            "model.moe_aux_loss_coeff: a list needs moe_router_load_balancing_type to be a list "
            "of as many types");
  EXPECT_EQ(refusal(json::array(), json::array({0.1})),
            "model.moe_router_load_balancing_type: must be a type or a non-empty list of types, "
            "got []");
  EXPECT_EQ(refusal(json::array({"aux_loss"}), json::array()),
            "model.moe_aux_loss_coeff: must be a number >= 0 or a non-empty list of them, got []");
  EXPECT_EQ(refusal(json::array({"aux_loss", "aux_loss"}), json::array({0.1, 0.2})),
            "model.moe_router_load_balancing_type: lists \"aux_loss\" twice (Megatron would "
            "weight it by its first coefficient only)");
  EXPECT_EQ(refusal(json::array({"aux_loss", "sinkhorn"}), json::array({0.1, 0.2})),
            "model.moe_router_load_balancing_type[1]: must be \"aux_loss\", \"seq_aux_loss\", "
            "\"global_aux_loss\" or \"none\", got string \"sinkhorn\"");
  EXPECT_EQ(refusal(json::array({"aux_loss"}), json::array({-1})),
            "model.moe_aux_loss_coeff[0]: must be a number >= 0, got number -1");
}

TEST(GptConfig, DeepSeekRoutingKeys) {
  json section = Minimal();
  section["num_layers"] = 2;
  section["add_bias_linear"] = false;
  section["num_moe_experts"] = 8;
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.moe.score_function, MoeScoreFunction::kSoftmax);
  EXPECT_FALSE(gpt.moe.topk_scaling_factor || gpt.moe.num_groups || gpt.moe.group_topk);
  section["moe_router_topk"] = 4;
  section["moe_router_score_function"] = "sigmoid";
  section["moe_router_topk_scaling_factor"] = 2.5;
  section["moe_router_num_groups"] = 4;
  section["moe_router_group_topk"] = 2;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.moe.score_function, MoeScoreFunction::kSigmoid);
  EXPECT_EQ(gpt.moe.topk_scaling_factor, 2.5);
  EXPECT_EQ(gpt.moe.num_groups, 4);
  EXPECT_EQ(gpt.moe.group_topk, 2);
  EXPECT_TRUE(gpt.ignored.empty());

  const auto refusal = [&](const char* key, const json& value) {
    json bad = section;
    if (value.is_null()) {
      bad.erase(key);
    } else {
      bad[key] = value;
    }
    GptConfig unused;
    return ParseGptSection(bad, &unused).Message();
  };
  EXPECT_EQ(refusal("moe_router_score_function", "sqrt"),
            "model.moe_router_score_function: must be \"softmax\", \"sigmoid\" or "
            "\"sqrtsoftplus\", got string \"sqrt\"");
  EXPECT_EQ(refusal("moe_router_num_groups", nullptr),
            "model.moe_router_group_topk: When using group limited routing, "
            "moe_router_num_groups must be specified.");
  EXPECT_EQ(refusal("moe_router_num_groups", 3),
            "model.moe_router_num_groups: num_moe_experts (8) should be divisible by "
            "moe_router_num_groups (3).");
  EXPECT_EQ(refusal("moe_router_group_topk", 5),
            "model.moe_router_group_topk: moe_router_group_topk (5) should be smaller than "
            "moe_router_num_groups (4).");
  EXPECT_EQ(refusal("moe_router_topk", 1),
            "model.moe_router_group_topk: 2 is more than moe_router_topk 1: a group's score is "
            "the sum of its top topk // group_topk = 0 scores, so every group would tie");
  EXPECT_EQ(refusal("moe_router_topk", 6),
            "model.moe_router_group_topk: a group's score sums its top moe_router_topk // 2 = 3 "
            "scores, but a group has only 2 experts");
  EXPECT_EQ(refusal("moe_router_topk_scaling_factor", 0),
            "model.moe_router_topk_scaling_factor: must be a number > 0, got number 0");
  section["moe_router_enable_expert_bias"] = true;
  section["moe_router_score_function"] = "sqrtsoftplus";
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.moe.score_function, MoeScoreFunction::kSqrtSoftplus);
  section["moe_router_score_function"] = "sigmoid";
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_TRUE(gpt.moe.enable_expert_bias);
  EXPECT_EQ(gpt.moe.bias_update_rate, 1e-3);
  EXPECT_EQ(refusal("moe_router_score_function", "softmax"),
            "model.moe_router_enable_expert_bias: Expert bias for aux-loss-free routing only "
            "supports 'sigmoid' and 'sqrtsoftplus' score functions. Please set "
            "--moe-router-score-function to 'sigmoid' or 'sqrtsoftplus', or unset "
            "--moe-router-enable-expert-bias.");
  EXPECT_EQ(refusal("moe_router_bias_update_rate", -1),
            "model.moe_router_bias_update_rate: must be a number >= 0, got number -1");
  section["moe_router_enable_expert_bias"] = false;

  // Accepted but without effect, as in Megatron: noted.
  section["moe_router_pre_softmax"] = true;
  section.erase("moe_router_group_topk");
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.ignored,
            (std::vector<std::string>{
                "model.moe_router_pre_softmax: ignored: with moe_router_score_function "
                "\"sigmoid\" the top-k always chooses from the sigmoids",
                "model.moe_router_num_groups: ignored: group-limited routing needs "
                "moe_router_group_topk"}));
}

TEST(GptConfig, ParametersFollowMegatronStateDict) {
  GptConfig gpt;
  json section = Minimal();
  section["num_layers"] = 1;
  section["activation"] = "swiglu";
  section["share_embeddings_and_output_weights"] = false;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  gpt.max_position_embeddings = 16;
  const std::vector<GptParameter> params = GptParameters(gpt, 1024, /*sequence_parallel=*/true);
  std::vector<std::string> names;
  for (const GptParameter& p : params) names.push_back(p.name);
  const std::vector<std::string> expected = {
      "embedding.word_embeddings.weight",
      "embedding.position_embeddings.weight",
      "decoder.layers.0.input_layernorm.weight",
      "decoder.layers.0.input_layernorm.bias",
      "decoder.layers.0.self_attention.linear_qkv.weight",
      "decoder.layers.0.self_attention.linear_qkv.bias",
      "decoder.layers.0.self_attention.linear_proj.weight",
      "decoder.layers.0.self_attention.linear_proj.bias",
      "decoder.layers.0.pre_mlp_layernorm.weight",
      "decoder.layers.0.pre_mlp_layernorm.bias",
      "decoder.layers.0.mlp.linear_fc1.weight",
      "decoder.layers.0.mlp.linear_fc1.bias",
      "decoder.layers.0.mlp.linear_fc2.weight",
      "decoder.layers.0.mlp.linear_fc2.bias",
      "decoder.final_layernorm.weight",
      "decoder.final_layernorm.bias",
      "output_layer.weight"};
  EXPECT_EQ(names, expected);
  const auto find = [&](const std::string& name) {
    for (const GptParameter& p : params) {
      if (p.name == name) return p;
    }
    ADD_FAILURE() << name;
    return GptParameter{};
  };
  const GptParameter fc1 = find("decoder.layers.0.mlp.linear_fc1.weight");
  EXPECT_EQ(fc1.shape, (Shape{512, 64}));
  EXPECT_EQ(fc1.tp_dim, 0);
  EXPECT_EQ(fc1.tp_stride, 2);  // [gate; up] on every tp rank
  const GptParameter proj = find("decoder.layers.0.self_attention.linear_proj.weight");
  EXPECT_EQ(proj.tp_dim, 1);
  EXPECT_DOUBLE_EQ(proj.init.std, 0.02 / std::sqrt(2.0));
  EXPECT_TRUE(find("decoder.layers.0.self_attention.linear_proj.bias").allreduce_grad_over_tp);
  EXPECT_FALSE(find("decoder.layers.0.self_attention.linear_qkv.bias").allreduce_grad_over_tp);
  EXPECT_TRUE(find("decoder.final_layernorm.weight").allreduce_grad_over_tp);
  EXPECT_EQ(find("decoder.final_layernorm.weight").init.method, InitMethod::kOnes);
  EXPECT_FALSE(GptParameters(gpt, 1024, false)[2].allreduce_grad_over_tp);
}

// Multi-token prediction: Megatron's keys and defaults (mtp_num_layers None, scaling factor
// 0.1), its refusals (position embeddings other than rope, per Megatron's validate_args; the
// options beyond the default training math), and the parameters each depth adds on the stage
// holding the last decoder layer, before the output layer, under Megatron's checkpoint names.
TEST(GptConfig, MultiTokenPrediction) {
  json section = Minimal();
  section["position_embedding_type"] = "rope";
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.mtp_num_layers, 0);
  EXPECT_DOUBLE_EQ(gpt.mtp_loss_scaling_factor, 0.1);
  section["mtp_num_layers"] = 2;
  section["mtp_loss_scaling_factor"] = 0.3;
  section["num_layers"] = 1;
  section["share_embeddings_and_output_weights"] = false;
  section["mtp_hsm"] = false;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_EQ(gpt.mtp_num_layers, 2);
  EXPECT_DOUBLE_EQ(gpt.mtp_loss_scaling_factor, 0.3);

  const auto refused = [&](const char* key, const json& value) {
    json bad = section;
    bad[key] = value;
    return Refusal(bad);
  };
  EXPECT_EQ(refused("position_embedding_type", "learned_absolute"),
            "model.position_embedding_type: \"learned_absolute\" cannot run with mtp_num_layers "
            "(Megatron's rule: multi-token prediction takes \"rope\" or \"none\"); set "
            "\"rope\"");
  EXPECT_EQ(refused("mtp_num_layers", -1).rfind("model.mtp_num_layers: ", 0), 0u);
  EXPECT_EQ(refused("mtp_hsm", true),
            "model.mtp_hsm: boolean true: hidden-state mixing across the depths is not "
            "modelled; only false is accepted");
  EXPECT_NE(refused("mtp_use_repeated_layer", true).find("only false is accepted"),
            std::string::npos);
  EXPECT_NE(refused("mtp_detach_heads", true).find("only false is accepted"), std::string::npos);
  EXPECT_NE(refused("dropout_mode", "rng_tracker").find("model.dropout_mode: "), std::string::npos);

  const std::vector<GptParameter> params = GptParameters(gpt, 1024, /*sequence_parallel=*/true);
  std::vector<std::string> names;
  for (const GptParameter& p : params) names.push_back(p.name);
  // rope: no position embedding; 12 tensors per layer; 19 per depth.
  ASSERT_EQ(names.size(), 15u + 2u * 19u + 1u);
  EXPECT_EQ(names[14], "decoder.final_layernorm.bias");
  const std::vector<std::string> depth = {
      "mtp.layers.1.enorm.weight",
      "mtp.layers.1.enorm.bias",
      "mtp.layers.1.hnorm.weight",
      "mtp.layers.1.hnorm.bias",
      "mtp.layers.1.eh_proj.weight",
      "mtp.layers.1.transformer_layer.input_layernorm.weight",
      "mtp.layers.1.transformer_layer.input_layernorm.bias",
      "mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight",
      "mtp.layers.1.transformer_layer.self_attention.linear_qkv.bias",
      "mtp.layers.1.transformer_layer.self_attention.linear_proj.weight",
      "mtp.layers.1.transformer_layer.self_attention.linear_proj.bias",
      "mtp.layers.1.transformer_layer.pre_mlp_layernorm.weight",
      "mtp.layers.1.transformer_layer.pre_mlp_layernorm.bias",
      "mtp.layers.1.transformer_layer.mlp.linear_fc1.weight",
      "mtp.layers.1.transformer_layer.mlp.linear_fc1.bias",
      "mtp.layers.1.transformer_layer.mlp.linear_fc2.weight"};
  EXPECT_EQ(std::vector<std::string>(names.begin() + 15 + 19, names.begin() + 15 + 19 + 16), depth);
  EXPECT_EQ(names.back(), "output_layer.weight");
  const GptParameter& eh_proj = params[15 + 4];
  EXPECT_EQ(eh_proj.name, "mtp.layers.0.eh_proj.weight");
  EXPECT_EQ(eh_proj.shape, (Shape{64, 128}));
  EXPECT_EQ(eh_proj.tp_dim, 0);  // ColumnParallelLinear, gather_output false
  EXPECT_DOUBLE_EQ(eh_proj.init.std, 0.02);
  EXPECT_TRUE(params[15].allreduce_grad_over_tp);  // enorm: fed by the sequence-split stream
  // A stage without the last decoder layer holds no depth.
  EXPECT_EQ(GptParameters(gpt, 1024, true, [](int64_t) { return false; }).size(), 4u);
}

// multi_latent_attention and MLATransformerConfig's keys: its defaults, notes for the keys it
// does not read (and for its keys without it), the refusals, the tp divisibility of the
// column-parallel down projections, and MLASelfAttention's parameters with the local spec.
TEST(GptConfig, MultiLatentAttentionKeys) {
  GptConfig gpt;
  json section = Minimal();
  section["q_lora_rank"] = 32;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_FALSE(gpt.mla.enabled);
  EXPECT_EQ(
      gpt.ignored,
      (std::vector<std::string>{"model.q_lora_rank: ignored: multi_latent_attention is false"}));
  EXPECT_EQ(gpt.mla.q_lora_rank, 512);  // reset: not read

  section = Minimal();
  section["multi_latent_attention"] = true;
  section["kv_channels"] = 8;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  // MLATransformerConfig's defaults.
  EXPECT_TRUE(gpt.mla.enabled);
  EXPECT_EQ(gpt.mla.q_lora_rank, 512);
  EXPECT_EQ(gpt.mla.kv_lora_rank, 512);
  EXPECT_EQ(gpt.mla.qk_head_dim, 128);
  EXPECT_EQ(gpt.mla.qk_pos_emb_head_dim, 64);
  EXPECT_EQ(gpt.mla.v_head_dim, 128);
  EXPECT_EQ(gpt.mla.rope_type, MlaRopeType::kYarn);
  EXPECT_EQ(gpt.mla.rotary_scaling_factor, 40.0);
  EXPECT_EQ(gpt.mla.original_max_position_embeddings, 4096);
  EXPECT_EQ(gpt.mla.beta_fast, 32.0);
  EXPECT_EQ(gpt.mla.beta_slow, 1.0);
  EXPECT_EQ(gpt.mla.mscale, 1.0);
  EXPECT_EQ(gpt.mla.mscale_all_dim, 0.0);
  ASSERT_EQ(gpt.ignored.size(), 1u);
  EXPECT_EQ(gpt.ignored[0].rfind("model.kv_channels: ignored: multi_latent_attention's heads", 0),
            0u);

  section["q_lora_rank"] = nullptr;
  section["rope_type"] = "rope";
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  EXPECT_FALSE(gpt.mla.q_lora_rank.has_value());
  EXPECT_EQ(gpt.mla.rope_type, MlaRopeType::kRope);

  const auto refusal = [&](const char* key, const json& value) {
    json bad = Minimal();
    bad["multi_latent_attention"] = true;
    bad[key] = value;
    return Refusal(bad);
  };
  EXPECT_EQ(refusal("qk_pos_emb_head_dim", 7),
            "model.qk_pos_emb_head_dim: rope rotates pairs of channels, so it must be even, got 7");
  EXPECT_EQ(refusal("rope_type", "ntk"),
            "model.rope_type: must be \"rope\" or \"yarn\", got string \"ntk\"");
  EXPECT_EQ(refusal("q_lora_rank", 0).rfind("model.q_lora_rank: ", 0), 0u);
  EXPECT_EQ(refusal("mscale_all_dim", -1).rfind("model.mscale_all_dim: ", 0), 0u);
  // MLA's core attention has no sink and no window (yet): refused, not silently dropped.
  EXPECT_EQ(refusal("softmax_type", "learnable"),
            "model.softmax_type: attention sinks and sliding windows with multi_latent_attention "
            "are not built (MLA's core attention has neither); use one or the other");
  EXPECT_EQ(refusal("window_size", json::array({4, 0}))
                .rfind("model.window_size: attention "
                       "sinks and sliding windows",
                       0),
            0u);
  json rope = Minimal();
  rope["multi_latent_attention"] = true;
  rope["rope_type"] = "rope";
  rope["rotary_percent"] = 0.5;
  EXPECT_EQ(Refusal(rope),
            "model.rotary_percent: 0.5 with multi_latent_attention and rope_type \"rope\" is not "
            "built (MLA's rope on part of qk_pos_emb_head_dim); set 1");
  rope["rope_type"] = "yarn";  // YarnRotaryEmbedding turns every rope channel
  ASSERT_TRUE(ParseGptSection(rope, &gpt).ok());
  EXPECT_EQ(gpt.ignored.back(),
            "model.rotary_percent: ignored: MLA's yarn rope turns all qk_pos_emb_head_dim "
            "channels");

  // The down projections are column-parallel: their widths divide by tp.
  json small = Minimal();
  small["multi_latent_attention"] = true;
  small["q_lora_rank"] = 6;
  small["kv_lora_rank"] = 10;
  small["qk_pos_emb_head_dim"] = 4;
  ASSERT_TRUE(ParseGptSection(small, &gpt).ok());
  ParallelConfig parallel;
  parallel.world_size = 4;
  parallel.tensor_model_parallel_size = 4;
  RunConfig run;
  run.seq_length = 8;
  GptConfig copy = gpt;
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "model.q_lora_rank: 6 is not divisible by tensor_model_parallel_size 4");
  gpt.mla.q_lora_rank.reset();
  copy = gpt;
  EXPECT_EQ(CheckGptLayout(parallel, run, &copy).Message(),
            "model.kv_lora_rank: kv_lora_rank + qk_pos_emb_head_dim = 14 is not divisible by "
            "tensor_model_parallel_size 4 (linear_kv_down_proj is column-parallel)");
  parallel.tensor_model_parallel_size = 2;
  copy = gpt;
  EXPECT_TRUE(CheckGptLayout(parallel, run, &copy).ok());
}

TEST(GptConfig, MultiLatentAttentionParametersFollowTheLocalSpec) {
  json section = Minimal();
  section["num_layers"] = 1;
  section["multi_latent_attention"] = true;
  section["qk_layernorm"] = true;
  section["q_lora_rank"] = 24;
  section["kv_lora_rank"] = 16;
  section["qk_head_dim"] = 6;
  section["qk_pos_emb_head_dim"] = 4;
  section["v_head_dim"] = 5;
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(section, &gpt).ok());
  gpt.max_position_embeddings = 16;
  const std::vector<GptParameter> params = GptParameters(gpt, 1024, /*sequence_parallel=*/true);
  struct Row {
    std::string name;
    Shape shape;
    int tp_dim;
    bool allreduce;
  };
  std::vector<Row> rows;
  for (const GptParameter& p : params) {
    if (p.name.find(".self_attention.") == std::string::npos) continue;
    rows.push_back({p.name.substr(std::string("decoder.layers.0.self_attention.").size()), p.shape,
                    p.tp_dim, p.allreduce_grad_over_tp});
  }
  // 8 heads of 6 + 4 query/key channels and 5 value channels; LayerNorm latents with biases.
  const std::vector<Row> expected = {{"linear_q_down_proj.weight", {24, 64}, 0, false},
                                     {"q_layernorm.weight", {24}, -1, true},
                                     {"q_layernorm.bias", {24}, -1, true},
                                     {"linear_q_up_proj.weight", {80, 24}, 0, false},
                                     {"linear_kv_down_proj.weight", {20, 64}, 0, false},
                                     {"kv_layernorm.weight", {16}, -1, true},
                                     {"kv_layernorm.bias", {16}, -1, true},
                                     {"linear_kv_up_proj.weight", {88, 16}, 0, false},
                                     {"linear_proj.weight", {64, 40}, 1, false},
                                     {"linear_proj.bias", {64}, -1, true}};
  ASSERT_EQ(rows.size(), expected.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].name, expected[i].name);
    EXPECT_EQ(rows[i].shape, expected[i].shape) << rows[i].name;
    EXPECT_EQ(rows[i].tp_dim, expected[i].tp_dim) << rows[i].name;
    EXPECT_EQ(rows[i].allreduce, expected[i].allreduce) << rows[i].name;
  }
  // Without sequence parallelism every tp rank normalises the whole latent: no reduction.
  for (const GptParameter& p : GptParameters(gpt, 1024, false)) {
    if (p.name.find("layernorm") != std::string::npos) {
      EXPECT_FALSE(p.allreduce_grad_over_tp) << p.name;
    }
  }
  // q_lora_rank null: one linear_q_proj; no qk_layernorm: no latent norms.
  gpt.mla.q_lora_rank.reset();
  gpt.qk_layernorm = false;
  std::vector<std::string> names;
  for (const GptParameter& p : GptParameters(gpt, 1024, false)) {
    if (p.name.find(".self_attention.") != std::string::npos) names.push_back(p.name);
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"decoder.layers.0.self_attention.linear_q_proj.weight",
                                      "decoder.layers.0.self_attention.linear_kv_down_proj.weight",
                                      "decoder.layers.0.self_attention.linear_kv_up_proj.weight",
                                      "decoder.layers.0.self_attention.linear_proj.weight",
                                      "decoder.layers.0.self_attention.linear_proj.bias"}));
}

}  // namespace
}  // namespace mpusim
