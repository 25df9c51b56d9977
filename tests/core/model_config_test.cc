// The `model` and `run` sections: the documented example parses to the right values, and
// every refused input names its JSON path and says what is allowed (exact messages).
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/config/model_config.h"

namespace mpusim {
namespace {

using nlohmann::json;

// The example in the header comment of core/config/model_config.h.
json ExampleModel() {
  return json::parse(R"({
    "vocab_size": 64,
    "make_vocab_size_divisible_by": 128,
    "layers": [
      {"name": "embedding", "type": "VocabParallelEmbedding", "embedding_dim": 32},
      {"name": "fc1", "type": "ColumnParallelLinear", "input_size": 32, "output_size": 128,
       "gather_output": false},
      {"name": "gelu", "type": "GeLU"},
      {"name": "fc2", "type": "RowParallelLinear", "input_size": 128, "output_size": 32,
       "input_is_parallel": true},
      {"name": "head", "type": "ColumnParallelLinear", "input_size": 32,
       "output_size": "padded_vocab_size", "gather_output": false, "bias": false},
      {"name": "loss", "type": "VocabParallelCrossEntropy", "label_smoothing": 0.1}
    ]
  })");
}

// The error of ParseModelSection, or "" when accepted.
std::string ModelRefusal(const json& model) {
  ModelConfig config;
  const Status status = ParseModelSection(model, &config);
  return status.ok() ? "" : status.Message();
}

// {"vocab_size": 64, "layers": layers}.
std::string LayersRefusal(const json& layers) {
  return ModelRefusal({{"vocab_size", 64}, {"layers", layers}});
}

// A model whose only layer is `layer`.
std::string LayerRefusal(const json& layer) { return LayersRefusal(json::array({layer})); }

std::string RunRefusal(const json& run) {
  RunConfig config;
  const Status status = ParseRunSection(run, &config);
  return status.ok() ? "" : status.Message();
}

const json kFc1 = {
    {"name", "fc1"}, {"type", "ColumnParallelLinear"}, {"input_size", 8}, {"output_size", 16}};

TEST(ModelConfig, HeaderExampleParses) {
  ModelConfig model;
  const Status status = ParseModelSection(ExampleModel(), &model);
  ASSERT_TRUE(status.ok()) << status.Message();
  EXPECT_EQ(model.vocab_size, 64);
  EXPECT_EQ(model.make_vocab_size_divisible_by, 128);
  ASSERT_EQ(model.layers.size(), 6u);

  const LayerConfig& embedding = model.layers[0];
  EXPECT_EQ(embedding.name, "embedding");
  EXPECT_EQ(embedding.type, LayerType::kVocabParallelEmbedding);
  EXPECT_TRUE(embedding.num_embeddings.padded_vocab);
  EXPECT_EQ(embedding.num_embeddings.Resolve(256), 256);
  EXPECT_EQ(embedding.embedding_dim, 32);
  EXPECT_EQ(embedding.init.method, InitMethod::kXavierNormal);

  const LayerConfig& fc1 = model.layers[1];
  EXPECT_EQ(fc1.type, LayerType::kColumnParallelLinear);
  EXPECT_EQ(fc1.input_size, 32);
  EXPECT_FALSE(fc1.output_size.padded_vocab);
  EXPECT_EQ(fc1.output_size.Resolve(256), 128);
  EXPECT_TRUE(fc1.bias);
  EXPECT_FALSE(fc1.gather_output);
  EXPECT_EQ(fc1.stride, 1);
  EXPECT_FALSE(fc1.skip_bias_add);
  EXPECT_FALSE(fc1.skip_weight_param_allocation);
  EXPECT_FALSE(fc1.frozen);

  EXPECT_EQ(model.layers[2].type, LayerType::kGeLU);
  EXPECT_EQ(model.layers[2].bias_from, "");

  const LayerConfig& fc2 = model.layers[3];
  EXPECT_EQ(fc2.type, LayerType::kRowParallelLinear);
  EXPECT_EQ(fc2.input_size, 128);
  EXPECT_EQ(fc2.output_size.Resolve(256), 32);
  EXPECT_TRUE(fc2.input_is_parallel);
  EXPECT_TRUE(fc2.bias);

  const LayerConfig& head = model.layers[4];
  EXPECT_EQ(head.input_size, 32);
  EXPECT_TRUE(head.output_size.padded_vocab);
  EXPECT_FALSE(head.bias);
  EXPECT_FALSE(head.gather_output);

  const LayerConfig& loss = model.layers[5];
  EXPECT_EQ(loss.type, LayerType::kVocabParallelCrossEntropy);
  EXPECT_DOUBLE_EQ(loss.label_smoothing, 0.1);

  EXPECT_EQ(model.PaddedVocabSize(1), 128);
  EXPECT_EQ(model.PaddedVocabSize(2), 256);
}

TEST(ModelConfig, EveryOptionIsRead) {
  const json layers = json::parse(R"([
    {"name": "emb", "type": "ParallelEmbedding", "num_embeddings": 100, "embedding_dim": 16,
     "init_method": "normal", "init_method_std": 1},
    {"name": "fc1", "type": "ColumnParallelLinear", "input_size": 16, "output_size": 32,
     "stride": 2, "skip_bias_add": true, "frozen": true, "init_method": "zeros"},
    {"name": "gelu", "type": "GELU", "bias_from": "fc1"},
    {"name": "drop", "type": "Dropout", "p": 0},
    {"name": "fc2", "type": "RowParallelLinear", "input_size": 32, "output_size": 16,
     "stride": 3, "bias": false, "skip_bias_add": true, "init_method": "normal",
     "init_method_std": 0.5},
    {"name": "proj", "type": "ColumnParallelLinear", "input_size": 16, "output_size": 32,
     "stride": 2, "skip_weight_param_allocation": true, "weight_from": "fc1", "bias": false},
    {"name": "sp", "type": "gather_from_sequence_parallel_region",
     "tensor_parallel_output_grad": false},
    {"name": "loss", "type": "vocab_parallel_cross_entropy"}
  ])");
  ModelConfig model;
  const Status status = ParseModelSection(
      {{"vocab_size", 100}, {"make_vocab_size_divisible_by", 4}, {"layers", layers}}, &model);
  ASSERT_TRUE(status.ok()) << status.Message();
  ASSERT_EQ(model.layers.size(), 8u);
  EXPECT_EQ(model.make_vocab_size_divisible_by, 4);

  const LayerConfig& emb = model.layers[0];
  EXPECT_EQ(emb.type, LayerType::kParallelEmbedding);
  EXPECT_FALSE(emb.num_embeddings.padded_vocab);
  EXPECT_EQ(emb.num_embeddings.Resolve(104), 100);
  EXPECT_EQ(emb.init.method, InitMethod::kNormal);
  EXPECT_EQ(emb.init.std, 1.0);

  const LayerConfig& fc1 = model.layers[1];
  EXPECT_EQ(fc1.stride, 2);
  EXPECT_TRUE(fc1.skip_bias_add);
  EXPECT_TRUE(fc1.frozen);
  EXPECT_EQ(fc1.init.method, InitMethod::kZeros);

  EXPECT_EQ(model.layers[2].type, LayerType::kGeLU);
  EXPECT_EQ(model.layers[2].bias_from, "fc1");
  EXPECT_EQ(model.layers[3].type, LayerType::kDropout);
  EXPECT_EQ(model.layers[3].p, 0.0);

  const LayerConfig& fc2 = model.layers[4];
  EXPECT_EQ(fc2.stride, 3);
  EXPECT_FALSE(fc2.bias);
  EXPECT_FALSE(fc2.input_is_parallel);
  EXPECT_EQ(fc2.init.std, 0.5);

  const LayerConfig& proj = model.layers[5];
  EXPECT_TRUE(proj.skip_weight_param_allocation);
  EXPECT_EQ(proj.weight_from, "fc1");

  EXPECT_EQ(model.layers[6].type, LayerType::kGatherFromSequenceParallelRegion);
  EXPECT_FALSE(model.layers[6].tensor_parallel_output_grad);
  EXPECT_EQ(model.layers[7].type, LayerType::kVocabParallelCrossEntropy);
  EXPECT_EQ(model.layers[7].label_smoothing, 0.0);
}

// Every accepted spelling parses to a type whose LayerTypeName is the canonical spelling.
TEST(ModelConfig, LayerTypeSpellings) {
  const std::vector<std::pair<std::string, std::string>> spellings = {
      {"GeLU", "GeLU"},
      {"GELU", "GeLU"},
      {"Dropout", "Dropout"},
      {"VocabParallelCrossEntropy", "VocabParallelCrossEntropy"},
      {"vocab_parallel_cross_entropy", "VocabParallelCrossEntropy"},
      {"copy_to_tensor_model_parallel_region", "copy_to_tensor_model_parallel_region"},
      {"reduce_from_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"},
      {"scatter_to_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region"},
      {"gather_from_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region"},
      {"scatter_to_sequence_parallel_region", "scatter_to_sequence_parallel_region"},
      {"gather_from_sequence_parallel_region", "gather_from_sequence_parallel_region"},
      {"reduce_scatter_to_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region"},
  };
  for (const auto& [spelling, canonical] : spellings) {
    json layer = {{"name", "x"}, {"type", spelling}};
    if (canonical == "Dropout") layer["p"] = 0.5;
    ModelConfig model;
    const Status status = ParseModelSection({{"vocab_size", 8}, {"layers", {layer}}}, &model);
    ASSERT_TRUE(status.ok()) << spelling << ": " << status.Message();
    EXPECT_STREQ(LayerTypeName(model.layers[0].type), canonical.c_str()) << spelling;
  }
  EXPECT_STREQ(LayerTypeName(LayerType::kVocabParallelEmbedding), "VocabParallelEmbedding");
  EXPECT_STREQ(LayerTypeName(LayerType::kParallelEmbedding), "ParallelEmbedding");
  EXPECT_STREQ(LayerTypeName(LayerType::kColumnParallelLinear), "ColumnParallelLinear");
  EXPECT_STREQ(LayerTypeName(LayerType::kRowParallelLinear), "RowParallelLinear");
  // Mapping functions default to Megatron's arguments.
  ModelConfig model;
  ASSERT_TRUE(
      ParseModelSection(
          {{"layers", {{{"name", "g"}, {"type", "gather_from_sequence_parallel_region"}}}}}, &model)
          .ok());
  EXPECT_TRUE(model.layers[0].tensor_parallel_output_grad);
  EXPECT_FALSE(model.vocab_size.has_value());
}

TEST(ModelConfig, SectionErrors) {
  EXPECT_EQ(ModelRefusal(json::array()), "model: must be a JSON object, got array []");
  EXPECT_EQ(ModelRefusal({{"vocab_size", 64}}),
            "model.layers: is required (a non-empty list of layers, e.g. [{\"name\": \"fc1\", "
            "\"type\": \"ColumnParallelLinear\", ...}])");
  EXPECT_EQ(ModelRefusal({{"vocab_size", 64}, {"layers", json::array()}}),
            "model.layers: must be a non-empty list of layer objects, got array []");
  EXPECT_EQ(ModelRefusal({{"vocab_size", 64}, {"layers", {{"name", "x"}}}}),
            "model.layers: must be a non-empty list of layer objects, got object "
            "{\"name\":\"x\"}");
  EXPECT_EQ(ModelRefusal({{"vocab_sise", 64}, {"layers", {kFc1}}}),
            "model.vocab_sise: unknown key; did you mean 'vocab_size'?");
  EXPECT_EQ(ModelRefusal({{"hidden_size", 64}, {"layers", {kFc1}}}),
            "model.hidden_size: unknown key; allowed: vocab_size, make_vocab_size_divisible_by, "
            "layers");
  EXPECT_EQ(ModelRefusal({{"vocab_size", 0}, {"layers", {kFc1}}}),
            "model.vocab_size: must be an integer >= 1, got 0");
  EXPECT_EQ(ModelRefusal({{"vocab_size", "64"}, {"layers", {kFc1}}}),
            "model.vocab_size: must be an integer >= 1, got string \"64\"");
  EXPECT_EQ(ModelRefusal({{"vocab_size", 64.0}, {"layers", {kFc1}}}),
            "model.vocab_size: must be an integer >= 1, got number 64.0");
  EXPECT_EQ(ModelRefusal({{"vocab_size", 4294967296LL}, {"layers", {kFc1}}}),
            "model.vocab_size: must be at most 2147483647, got 4294967296");
  EXPECT_EQ(ModelRefusal({{"vocab_size", nullptr}, {"layers", {kFc1}}}), "");
  EXPECT_EQ(ModelRefusal({{"make_vocab_size_divisible_by", 0}, {"layers", {kFc1}}}),
            "model.make_vocab_size_divisible_by: must be an integer >= 1, got 0");
  EXPECT_EQ(LayersRefusal({kFc1, 3}),
            "model.layers[1]: must be a JSON object with \"name\" and \"type\", got number 3");
}

TEST(ModelConfig, NameErrors) {
  EXPECT_EQ(LayerRefusal({{"type", "GeLU"}}),
            "model.layers[0].name: is required (a unique layer name, e.g. \"fc1\")");
  EXPECT_EQ(LayerRefusal({{"name", ""}, {"type", "GeLU"}}),
            "model.layers[0].name: must be a non-empty string, got string \"\"");
  EXPECT_EQ(LayerRefusal({{"name", 1}, {"type", "GeLU"}}),
            "model.layers[0].name: must be a non-empty string, got number 1");
  EXPECT_EQ(LayerRefusal({{"name", "mlp.fc1"}, {"type", "GeLU"}}),
            "model.layers[0].name: must not contain '.' (tensor names are \"<layer>.<role>\"), "
            "got \"mlp.fc1\"");
  EXPECT_EQ(LayersRefusal(
                {kFc1, {{"name", "gelu"}, {"type", "GeLU"}}, {{"name", "fc1"}, {"type", "GeLU"}}}),
            "model.layers[2].name: \"fc1\" is already the name of model.layers[0]");
}

TEST(ModelConfig, TypeErrors) {
  const std::string types =
      "VocabParallelEmbedding, ParallelEmbedding, ColumnParallelLinear, RowParallelLinear, "
      "GeLU, Dropout, VocabParallelCrossEntropy, copy_to_tensor_model_parallel_region, "
      "reduce_from_tensor_model_parallel_region, scatter_to_tensor_model_parallel_region, "
      "gather_from_tensor_model_parallel_region, scatter_to_sequence_parallel_region, "
      "gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region, "
      "Embedding, Linear, ReLU, CrossEntropyLoss, LayerNorm";
  EXPECT_EQ(LayerRefusal({{"name", "x"}}),
            "model.layers[0].type: is required (one of: " + types + ")");
  EXPECT_EQ(LayerRefusal({{"name", "x"}, {"type", 7}}),
            "model.layers[0].type: must be a string (one of: " + types + "), got number 7");
  EXPECT_EQ(LayerRefusal({{"name", "x"}, {"type", "ColumnParalelLinear"}}),
            "model.layers[0].type: unknown layer type \"ColumnParalelLinear\"; did you mean "
            "'ColumnParallelLinear'? (types: " +
                types + ")");
  // torch.nn.Linear's names (the lab's seed model) point to Megatron's.
  EXPECT_EQ(LayerRefusal({{"name", "x"}, {"type", "ColumnParallelLinear"}, {"in_features", 8}}),
            "model.layers[0].in_features: unknown key; did you mean 'input_size'? (in_features "
            "is an option of Linear)");
  EXPECT_EQ(LayerRefusal({{"name", "x"}, {"type", "RowParallelLinear"}, {"out_features", 8}}),
            "model.layers[0].out_features: unknown key; did you mean 'output_size'? "
            "(out_features is an option of Linear)");
  EXPECT_EQ(LayerRefusal({{"name", "x"}, {"type", "gelu"}}),
            "model.layers[0].type: unknown layer type \"gelu\"; did you mean 'GeLU'? (types: " +
                types + ")");
  EXPECT_EQ(LayerRefusal({{"name", "x"}, {"type", "copy_to_tensor_parallel_region"}}),
            "model.layers[0].type: unknown layer type \"copy_to_tensor_parallel_region\"; did "
            "you mean 'copy_to_tensor_model_parallel_region'? (types: " +
                types + ")");
  EXPECT_EQ(LayerRefusal({{"name", "x"}, {"type", "Softmax"}}),
            "model.layers[0].type: unknown layer type \"Softmax\"; types: " + types);
}

TEST(ModelConfig, UnknownOptions) {
  EXPECT_EQ(LayersRefusal({kFc1,
                           {{"name", "fc2"},
                            {"type", "RowParallelLinear"},
                            {"input_size", 16},
                            {"output_size", 8},
                            {"gather_output", false}}}),
            "model.layers[1].gather_output: not an option of RowParallelLinear (options: name, "
            "type, input_size, output_size, bias, input_is_parallel, stride, skip_bias_add, "
            "frozen, init_method, init_method_std)");
  EXPECT_EQ(LayerRefusal({{"name", "g"}, {"type", "GeLU"}, {"p", 0.1}}),
            "model.layers[0].p: not an option of GeLU (options: name, type, bias_from)");
  EXPECT_EQ(LayerRefusal({{"name", "c"},
                          {"type", "copy_to_tensor_model_parallel_region"},
                          {"tensor_parallel_output_grad", false}}),
            "model.layers[0].tensor_parallel_output_grad: not an option of "
            "copy_to_tensor_model_parallel_region (options: name, type)");
  EXPECT_EQ(LayerRefusal({{"name", "fc1"},
                          {"type", "ColumnParallelLinear"},
                          {"input_size", 8},
                          {"output_sise", 16}}),
            "model.layers[0].output_sise: unknown key; did you mean 'output_size'?");
  EXPECT_EQ(LayerRefusal({{"name", "d"}, {"type", "Dropout"}, {"p", 0.1}, {"inplace", true}}),
            "model.layers[0].inplace: unknown key; options of Dropout: name, type, p");
}

TEST(ModelConfig, OptionValueErrors) {
  auto with = [](json layer, const std::string& key, json value) {
    layer[key] = std::move(value);
    return LayerRefusal(layer);
  };
  const json emb = {{"name", "emb"}, {"type", "VocabParallelEmbedding"}, {"embedding_dim", 8}};
  const json row = {
      {"name", "fc2"}, {"type", "RowParallelLinear"}, {"input_size", 8}, {"output_size", 4}};
  EXPECT_EQ(with(kFc1, "input_size", 0),
            "model.layers[0].input_size: must be an integer >= 1, got 0");
  EXPECT_EQ(with(kFc1, "input_size", "padded_vocab_size"),
            "model.layers[0].input_size: must be an integer >= 1, got string "
            "\"padded_vocab_size\"");
  EXPECT_EQ(with(kFc1, "output_size", "vocab_size"),
            "model.layers[0].output_size: must be an integer >= 1 or \"padded_vocab_size\", got "
            "string \"vocab_size\"");
  EXPECT_EQ(with(kFc1, "output_size", -4),
            "model.layers[0].output_size: must be an integer >= 1, got -4");
  EXPECT_EQ(with(emb, "num_embeddings", 2.5),
            "model.layers[0].num_embeddings: must be an integer >= 1 or \"padded_vocab_size\", "
            "got number 2.5");
  EXPECT_EQ(with(emb, "embedding_dim", true),
            "model.layers[0].embedding_dim: must be an integer >= 1, got boolean true");
  EXPECT_EQ(with(kFc1, "bias", "false"),
            "model.layers[0].bias: must be true or false, got string \"false\"");
  EXPECT_EQ(with(kFc1, "gather_output", 0),
            "model.layers[0].gather_output: must be true or false, got number 0");
  EXPECT_EQ(with(row, "input_is_parallel", nullptr),
            "model.layers[0].input_is_parallel: must be true or false, got null null");
  EXPECT_EQ(with(kFc1, "stride", 0), "model.layers[0].stride: must be an integer >= 1, got 0");
  EXPECT_EQ(with(kFc1, "frozen", 1), "model.layers[0].frozen: must be true or false, got number 1");
  EXPECT_EQ(with(kFc1, "init_method", 3),
            "model.layers[0].init_method: must be one of xavier_normal, normal, zeros, got "
            "number 3");
  {
    // The wording for an unknown name belongs to core/init.cc; the path is ours.
    ModelConfig model;
    json layer = kFc1;
    layer["init_method"] = "uniform";
    const Status status = ParseModelSection({{"layers", {layer}}}, &model);
    EXPECT_EQ(status.where(), "model.layers[0].init_method");
  }
  json normal = kFc1;
  normal["init_method"] = "normal";
  EXPECT_EQ(with(normal, "init_method_std", 0),
            "model.layers[0].init_method_std: must be a number > 0, got number 0");
  EXPECT_EQ(with(normal, "init_method_std", -0.5),
            "model.layers[0].init_method_std: must be a number > 0, got number -0.5");
  EXPECT_EQ(with(normal, "init_method_std", "0.02"),
            "model.layers[0].init_method_std: must be a number > 0, got string \"0.02\"");
  EXPECT_EQ(with(kFc1, "init_method_std", 0.02),
            "model.layers[0].init_method_std: is only used with \"init_method\": \"normal\"");
  EXPECT_EQ(with(emb, "init_method_std", 0.02),
            "model.layers[0].init_method_std: is only used with \"init_method\": \"normal\"");

  const json drop = {{"name", "d"}, {"type", "Dropout"}};
  EXPECT_EQ(LayerRefusal(drop), "model.layers[0].p: is required (the drop probability, in [0, 1))");
  EXPECT_EQ(with(drop, "p", 1), "model.layers[0].p: must be a number in [0, 1), got number 1");
  EXPECT_EQ(with(drop, "p", 1.0), "model.layers[0].p: must be a number in [0, 1), got number 1.0");
  EXPECT_EQ(with(drop, "p", -0.1),
            "model.layers[0].p: must be a number in [0, 1), got number -0.1");
  EXPECT_EQ(with(drop, "p", "0.1"),
            "model.layers[0].p: must be a number in [0, 1), got string \"0.1\"");
  EXPECT_EQ(with(drop, "p", true),
            "model.layers[0].p: must be a number in [0, 1), got boolean true");
  EXPECT_EQ(with(drop, "p", std::numeric_limits<double>::quiet_NaN()),
            "model.layers[0].p: must be a number in [0, 1), got number null");
  EXPECT_EQ(with(drop, "p", 0.5), "");
  const json loss = {{"name", "loss"}, {"type", "VocabParallelCrossEntropy"}};
  EXPECT_EQ(with(loss, "label_smoothing", 1),
            "model.layers[0].label_smoothing: must be a number in [0, 1), got number 1");
  EXPECT_EQ(with(loss, "label_smoothing", nullptr),
            "model.layers[0].label_smoothing: must be a number in [0, 1), got null null");
  EXPECT_EQ(with({{"name", "g"}, {"type", "gather_from_sequence_parallel_region"}},
                 "tensor_parallel_output_grad", "no"),
            "model.layers[0].tensor_parallel_output_grad: must be true or false, got string "
            "\"no\"");
  EXPECT_EQ(with({{"name", "g"}, {"type", "GeLU"}}, "bias_from", 1),
            "model.layers[0].bias_from: must be the name of an earlier layer, got number 1");
}

TEST(ModelConfig, RequiredOptions) {
  EXPECT_EQ(LayerRefusal({{"name", "emb"}, {"type", "VocabParallelEmbedding"}}),
            "model.layers[0].embedding_dim: is required (an integer >= 1)");
  EXPECT_EQ(LayerRefusal({{"name", "emb"}, {"type", "ParallelEmbedding"}}),
            "model.layers[0].embedding_dim: is required (an integer >= 1)");
  EXPECT_EQ(LayerRefusal({{"name", "fc"}, {"type", "RowParallelLinear"}, {"output_size", 4}}),
            "model.layers[0].input_size: is required (an integer >= 1)");
  EXPECT_EQ(LayerRefusal({{"name", "fc"}, {"type", "ColumnParallelLinear"}, {"input_size", 4}}),
            "model.layers[0].output_size: is required (an integer >= 1 or \"padded_vocab_size\")");
}

TEST(ModelConfig, VocabSizeRules) {
  const json emb = {{"name", "emb"}, {"type", "VocabParallelEmbedding"}, {"embedding_dim", 8}};
  EXPECT_EQ(ModelRefusal({{"layers", {emb}}}),
            "model.vocab_size: is required by model.layers[0] (\"emb\", VocabParallelEmbedding): "
            "tokens and labels are drawn from [0, vocab_size) and padded_vocab_size is derived "
            "from it");
  json head = kFc1;
  head["output_size"] = "padded_vocab_size";
  head["name"] = "head";
  EXPECT_EQ(ModelRefusal({{"layers", {kFc1, head}}})
                .rfind("model.vocab_size: is required by model.layers[1] (\"head\", "
                       "ColumnParallelLinear): ",
                       0),
            0u);
  EXPECT_EQ(ModelRefusal({{"layers", {{{"name", "loss"}, {"type", "VocabParallelCrossEntropy"}}}}})
                .rfind("model.vocab_size: is required by model.layers[0] (\"loss\", "
                       "VocabParallelCrossEntropy): ",
                       0),
            0u);
  json small = emb;
  small["num_embeddings"] = 63;
  EXPECT_EQ(LayerRefusal(small),
            "model.layers[0].num_embeddings: must be >= vocab_size (64) since tokens are drawn "
            "from [0, vocab_size), got 63");
  small["num_embeddings"] = 64;
  EXPECT_EQ(LayerRefusal(small), "");
}

TEST(ModelConfig, WeightFrom) {
  const json emb = {{"name", "emb"}, {"type", "VocabParallelEmbedding"}, {"embedding_dim", 8}};
  const json tied = {{"name", "head"},      {"type", "ColumnParallelLinear"},
                     {"input_size", 8},     {"output_size", "padded_vocab_size"},
                     {"bias", false},       {"skip_weight_param_allocation", true},
                     {"weight_from", "emb"}};
  const json gelu = {{"name", "gelu"}, {"type", "GeLU"}};
  EXPECT_EQ(LayersRefusal({emb, gelu, tied}), "");

  json missing = tied;
  missing.erase("weight_from");
  EXPECT_EQ(LayersRefusal({emb, missing}),
            "model.layers[1].weight_from: is required with \"skip_weight_param_allocation\": "
            "true (the earlier layer whose weight is passed at forward)");
  json unwanted = tied;
  unwanted["skip_weight_param_allocation"] = false;
  EXPECT_EQ(LayersRefusal({emb, unwanted}),
            "model.layers[1].weight_from: is only allowed with \"skip_weight_param_allocation\": "
            "true");
  unwanted.erase("skip_weight_param_allocation");
  EXPECT_EQ(LayersRefusal({emb, unwanted}),
            "model.layers[1].weight_from: is only allowed with \"skip_weight_param_allocation\": "
            "true");
  json later = tied;
  later["weight_from"] = "fc9";
  EXPECT_EQ(LayersRefusal({emb, gelu, later}),
            "model.layers[2].weight_from: \"fc9\" is not an earlier layer (earlier layers: emb, "
            "gelu)");
  later["weight_from"] = "head";
  EXPECT_EQ(LayersRefusal(json::array({later})),
            "model.layers[0].weight_from: \"head\" is not an earlier layer (earlier layers: "
            "none)");
  json from_gelu = tied;
  from_gelu["weight_from"] = "gelu";
  EXPECT_EQ(LayersRefusal({emb, gelu, from_gelu}),
            "model.layers[2].weight_from: \"gelu\" is a GeLU; must name a VocabParallelEmbedding "
            "or ColumnParallelLinear (a weight split on dim 0)");
  json from_row = tied;
  from_row["weight_from"] = "fc2";
  const json row = {
      {"name", "fc2"}, {"type", "RowParallelLinear"}, {"input_size", 8}, {"output_size", 8}};
  EXPECT_EQ(LayersRefusal({row, from_row}),
            "model.layers[1].weight_from: \"fc2\" is a RowParallelLinear; must name a "
            "VocabParallelEmbedding or ColumnParallelLinear (a weight split on dim 0)");
  json chained = tied;
  chained["name"] = "head2";
  chained["weight_from"] = "head";
  EXPECT_EQ(LayersRefusal({emb, tied, chained}),
            "model.layers[2].weight_from: \"head\" has no weight of its own (it uses \"emb\"'s); "
            "name \"emb\"");
  json strided = tied;
  strided["stride"] = 2;
  EXPECT_EQ(LayersRefusal({emb, strided}),
            "model.layers[1].stride: must equal the stride of weight_from layer \"emb\" (1), "
            "which partitions the shared weight; got 2");
  json fc1_strided = kFc1;
  fc1_strided["stride"] = 2;
  json shares_fc1 = tied;
  shares_fc1["weight_from"] = "fc1";
  EXPECT_EQ(LayersRefusal({fc1_strided, shares_fc1}),
            "model.layers[1].stride: must equal the stride of weight_from layer \"fc1\" (2), "
            "which partitions the shared weight; got 1");
  for (const char* owned : {"init_method", "init_method_std", "frozen"}) {
    json extra = tied;
    extra[owned] = std::string(owned) == "frozen" ? json(true) : json("normal");
    if (std::string(owned) == "init_method_std") extra[owned] = 0.02;
    EXPECT_EQ(LayersRefusal({emb, extra}),
              std::string("model.layers[1].") + owned +
                  ": does not apply with \"skip_weight_param_allocation\": true (the weight "
                  "belongs to the weight_from layer)");
  }
}

TEST(ModelConfig, BiasFrom) {
  json fc1 = kFc1;
  fc1["skip_bias_add"] = true;
  const json gelu = {{"name", "gelu"}, {"type", "GeLU"}, {"bias_from", "fc1"}};
  EXPECT_EQ(LayersRefusal({fc1, gelu}), "");

  EXPECT_EQ(LayersRefusal({gelu, fc1}),
            "model.layers[0].bias_from: \"fc1\" is not an earlier layer (earlier layers: none)");
  json other = gelu;
  other["bias_from"] = "fc3";
  EXPECT_EQ(LayersRefusal({fc1, {{"name", "g0"}, {"type", "GeLU"}, {"bias_from", "fc1"}}, other}),
            "model.layers[2].bias_from: \"fc3\" is not an earlier layer (earlier layers: fc1, "
            "g0)");
  other["bias_from"] = "d";
  EXPECT_EQ(LayersRefusal({{{"name", "d"}, {"type", "Dropout"}, {"p", 0.1}}, other}),
            "model.layers[1].bias_from: \"d\" is a Dropout; must name a ColumnParallelLinear or "
            "RowParallelLinear with \"skip_bias_add\": true");
  EXPECT_EQ(LayersRefusal({kFc1, gelu}),
            "model.layers[1].bias_from: \"fc1\" must set \"skip_bias_add\": true to return its "
            "bias instead of adding it");
  json no_bias = fc1;
  no_bias["bias"] = false;
  EXPECT_EQ(LayersRefusal({no_bias, gelu}),
            "model.layers[1].bias_from: \"fc1\" has \"bias\": false; it returns no bias");
  // A returned bias that nothing adds would silently vanish.
  EXPECT_EQ(LayersRefusal({fc1, {{"name", "gelu"}, {"type", "GeLU"}}}),
            "model.layers[0].skip_bias_add: the bias of \"fc1\" is returned but no later GeLU "
            "takes it; add \"bias_from\": \"fc1\" to one, or set \"bias\": false");
  EXPECT_EQ(LayersRefusal(json::array({no_bias})), "");
}

// Megatron's _vocab_size_with_padding.
TEST(ModelConfig, PaddedVocabSize) {
  ModelConfig model;
  model.vocab_size = 50257;
  model.make_vocab_size_divisible_by = 128;
  EXPECT_EQ(model.PaddedVocabSize(8), 51200);
  EXPECT_EQ(model.PaddedVocabSize(1), 50304);
  model.vocab_size = 64;
  model.make_vocab_size_divisible_by = 4;
  EXPECT_EQ(model.PaddedVocabSize(2), 64);
  model.vocab_size = 65;
  EXPECT_EQ(model.PaddedVocabSize(2), 72);
  model.vocab_size = 1;
  model.make_vocab_size_divisible_by = 1;
  EXPECT_EQ(model.PaddedVocabSize(1), 1);
}

TEST(RunConfig, DefaultsAndValues) {
  RunConfig run;
  ASSERT_TRUE(ParseRunSection({{"seq_length", 8}}, &run).ok());
  EXPECT_EQ(run.seed, 1234u);
  EXPECT_EQ(run.dtype, DType::kFloat32);
  EXPECT_EQ(run.seq_length, 8);
  EXPECT_EQ(run.micro_batch_size, 1);
  EXPECT_EQ(run.num_microbatches, 1);
  EXPECT_EQ(run.recompute, RunConfig::Recompute::kNone);

  const json full = json::parse(R"({"seed": 18446744073709551615, "dtype": "float64",
      "seq_length": 16, "micro_batch_size": 2, "num_microbatches": 3,
      "recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": 1})");
  ASSERT_TRUE(ParseRunSection(full, &run).ok());
  EXPECT_EQ(run.seed, 18446744073709551615u);
  EXPECT_EQ(run.dtype, DType::kFloat64);
  EXPECT_EQ(run.seq_length, 16);
  EXPECT_EQ(run.micro_batch_size, 2);
  EXPECT_EQ(run.num_microbatches, 3);
  EXPECT_EQ(run.recompute, RunConfig::Recompute::kFull);

  ASSERT_TRUE(
      ParseRunSection({{"seq_length", 8}, {"seed", 0}, {"recompute_granularity", nullptr}}, &run)
          .ok());
  EXPECT_EQ(run.seed, 0u);
  EXPECT_EQ(run.recompute, RunConfig::Recompute::kNone);
  ASSERT_TRUE(ParseRunSection({{"seq_length", 8}, {"recompute_granularity", "selective"}}, &run).ok());
  EXPECT_EQ(run.recompute, RunConfig::Recompute::kSelective);
}

TEST(RunConfig, Errors) {
  EXPECT_EQ(RunRefusal(json::array()), "run: must be a JSON object, got array []");
  EXPECT_EQ(RunRefusal(json::object()),
            "run.seq_length: is required (tokens per sample, e.g. \"seq_length\": 8)");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"sead", 1}}),
            "run.sead: unknown key; did you mean 'seed'?");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"hidden_size", 8}}),
            "run.hidden_size: unknown key; allowed: seed, dtype, seq_length, "
            "micro_batch_size, num_microbatches, recompute_granularity, recompute_method, "
            "recompute_num_layers, recompute_modules, train_iters, global_batch_size, "
            "loss_parallel");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"train_iters", 0}}).rfind("run.train_iters: ", 0), 0u);
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"seed", -1}}),
            "run.seed: must be an integer >= 0, got -1");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"seed", 1.5}}),
            "run.seed: must be an integer >= 0, got number 1.5");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"dtype", "bf16"}}),
            "run.dtype: must be \"float32\", \"float64\", \"bfloat16\" or \"float16\", got "
            "string \"bf16\"");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"dtype", 32}}),
            "run.dtype: must be \"float32\", \"float64\", \"bfloat16\" or \"float16\", got "
            "number 32");
  // int64 is a storage dtype (token ids), never a run's.
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"dtype", "int64"}}),
            "run.dtype: must be \"float32\", \"float64\", \"bfloat16\" or \"float16\", got "
            "string \"int64\"");
  EXPECT_EQ(RunRefusal({{"seq_length", 0}}), "run.seq_length: must be an integer >= 1, got 0");
  EXPECT_EQ(RunRefusal({{"seq_length", "8"}}),
            "run.seq_length: must be an integer >= 1, got string \"8\"");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"micro_batch_size", 0}}),
            "run.micro_batch_size: must be an integer >= 1, got 0");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"num_microbatches", 2.0}}),
            "run.num_microbatches: must be an integer >= 1, got number 2.0");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"recompute_granularity", "Full"}}),
            "run.recompute_granularity: must be \"full\", \"selective\" or null, got string \"Full\"");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"recompute_granularity", true}}),
            "run.recompute_granularity: must be \"full\", \"selective\" or null, got boolean true");
}

// Megatron's recompute keys: full with a method and its layer count, selective with modules,
// and Megatron's grouping of a chunk's layers (recompute.py checkpointed_forward).
TEST(RunConfig, RecomputeMethodsAndModules) {
  RunConfig run;
  ASSERT_TRUE(ParseRunSection({{"seq_length", 8},
                               {"recompute_granularity", "full"},
                               {"recompute_method", "uniform"},
                               {"recompute_num_layers", 2}},
                              &run)
                  .ok());
  EXPECT_EQ(run.recompute_method, RunConfig::RecomputeMethod::kUniform);
  EXPECT_EQ(run.recompute_num_layers, 2);
  EXPECT_EQ(RecomputeSummary(run), "full (uniform, 2 layers per group)");
  // A chunk of 5 layers: groups [0, 2), [2, 4), [4] (the last one cut at the chunk's end).
  const std::vector<int64_t> firsts = {0, 0, 2, 2, 4};
  for (int64_t i = 0; i < 5; ++i) {
    const RunConfig::RecomputeGroup group = run.GroupOf(i, 5);
    EXPECT_TRUE(group.recomputed) << i;
    EXPECT_EQ(group.first, firsts[static_cast<size_t>(i)]) << i;
  }
  ASSERT_TRUE(ParseRunSection({{"seq_length", 8},
                               {"recompute_granularity", "full"},
                               {"recompute_method", "block"},
                               {"recompute_num_layers", 2}},
                              &run)
                  .ok());
  EXPECT_EQ(RecomputeSummary(run), "full (block, 2 layers per chunk)");
  // block: the chunk's first 2 layers, each alone; the rest kept.
  for (int64_t i = 0; i < 5; ++i) {
    const RunConfig::RecomputeGroup group = run.GroupOf(i, 5);
    EXPECT_EQ(group.recomputed, i < 2) << i;
    if (group.recomputed) {
      EXPECT_EQ(group.first, i);
    }
  }
  // Selective: Megatron's default ["core_attn"], or the modules given, in any order.
  ASSERT_TRUE(
      ParseRunSection({{"seq_length", 8}, {"recompute_granularity", "selective"}}, &run).ok());
  EXPECT_TRUE(run.Recomputes(RunConfig::RecomputeModule::kCoreAttn));
  EXPECT_FALSE(run.Recomputes(RunConfig::RecomputeModule::kMlp));
  EXPECT_FALSE(run.GroupOf(0, 4).recomputed);
  EXPECT_EQ(RecomputeSummary(run), "selective (core_attn)");
  ASSERT_TRUE(ParseRunSection({{"seq_length", 8},
                               {"recompute_granularity", "selective"},
                               {"recompute_modules", {"mlp", "layernorm"}}},
                              &run)
                  .ok());
  EXPECT_FALSE(run.Recomputes(RunConfig::RecomputeModule::kCoreAttn));
  EXPECT_TRUE(run.Recomputes(RunConfig::RecomputeModule::kMlp));
  EXPECT_TRUE(run.Recomputes(RunConfig::RecomputeModule::kLayernorm));
  EXPECT_EQ(RecomputeSummary(run), "selective (layernorm, mlp)");
  // The echo parses back to the same keys.
  json echo;
  ToJson(run, &echo);
  EXPECT_EQ(echo["recompute_modules"], json({"mlp", "layernorm"}));
  EXPECT_EQ(echo["recompute_method"], nullptr);
  RunConfig again;
  ASSERT_TRUE(ParseRunSection(echo, &again).ok());
  EXPECT_EQ(again.recompute_modules, run.recompute_modules);
}

TEST(RunConfig, RecomputeRefusals) {
  const json full = {{"seq_length", 8}, {"recompute_granularity", "full"}};
  EXPECT_EQ(RunRefusal(full),
            "run.recompute_method: recompute_granularity \"full\" needs \"uniform\" or "
            "\"block\" (Megatron's rule); every layer recomputed alone, as before, is "
            "\"recompute_method\": \"uniform\", \"recompute_num_layers\": 1");
  json no_count = full;
  no_count["recompute_method"] = "block";
  EXPECT_EQ(RunRefusal(no_count),
            "run.recompute_num_layers: recompute_granularity \"full\" needs the number of layers "
            "recomputed per model chunk (Megatron's rule), e.g. 1");
  no_count["recompute_method"] = "uniform";
  EXPECT_EQ(RunRefusal(no_count),
            "run.recompute_num_layers: recompute_granularity \"full\" needs the number of layers "
            "per recomputed group (Megatron's rule), e.g. 1");
  no_count["recompute_num_layers"] = 0;
  EXPECT_EQ(RunRefusal(no_count), "run.recompute_num_layers: must be an integer >= 1, got 0");
  json method = full;
  method["recompute_method"] = "Uniform";
  EXPECT_EQ(RunRefusal(method),
            "run.recompute_method: must be \"uniform\", \"block\" or null, got string "
            "\"Uniform\"");
  const json selective = {{"seq_length", 8}, {"recompute_granularity", "selective"}};
  json with_method = selective;
  with_method["recompute_method"] = "uniform";
  EXPECT_EQ(RunRefusal(with_method),
            "run.recompute_method: is read only with recompute_granularity \"full\", got "
            "recompute_granularity \"selective\"; set it to null");
  json with_count = selective;
  with_count["recompute_num_layers"] = 1;
  EXPECT_EQ(RunRefusal(with_count),
            "run.recompute_num_layers: must be null with recompute_granularity \"selective\" "
            "(Megatron's rule); it counts fully recomputed layers");
  EXPECT_EQ(RunRefusal({{"seq_length", 8}, {"recompute_num_layers", 1}}),
            "run.recompute_num_layers: must be null with recompute_granularity null (Megatron's "
            "rule); it counts fully recomputed layers");
  json modules = selective;
  modules["recompute_modules"] = {"core_attn", "mlp_act"};
  EXPECT_EQ(RunRefusal(modules),
            "run.recompute_modules[1]: must be one of \"core_attn\", \"layernorm\", \"mlp\", "
            "\"moe_act\", \"moe\", \"shared_experts\", got string \"mlp_act\"");
  modules["recompute_modules"] = {"mla_up_proj"};
  EXPECT_EQ(RunRefusal(modules),
            "run.recompute_modules[0]: \"mla_up_proj\" (multi-latent attention's up-projection "
            "checkpoint) is not built; core_attn and layernorm are");
  modules["recompute_modules"] = {"mlp", "mlp"};
  EXPECT_EQ(RunRefusal(modules), "run.recompute_modules[1]: lists \"mlp\" twice");
  modules["recompute_modules"] = "core_attn";
  EXPECT_EQ(RunRefusal(modules),
            "run.recompute_modules: must be null or a list of \"core_attn\", \"layernorm\", "
            "\"mlp\", \"moe_act\", \"moe\", \"shared_experts\", got string \"core_attn\"");
  json full_modules = full;
  full_modules["recompute_method"] = "uniform";
  full_modules["recompute_num_layers"] = 1;
  full_modules["recompute_modules"] = {"core_attn"};
  EXPECT_EQ(RunRefusal(full_modules),
            "run.recompute_modules: is read only with recompute_granularity \"selective\", got "
            "\"full\"; set it to null");
}

// The effective config a dump records: defaults written in (the file gives no seed, so the
// echo says 1234), the file's other keys kept, and it parses back to the same run.
TEST(RunConfig, EffectiveConfigWritesDefaultsAndParsesBack) {
  const json document = {
      {"description", "x"},
      {"parallel", {{"world_size", 2}, {"tensor_model_parallel_size", 2}, {"bf16", true}}},
      {"model", {{"vocab_size", 8}, {"layers", {{{"name", "e"}, {"type", "VocabParallelEmbedding"},
                                                  {"embedding_dim", 4}}}}}},
      {"run", {{"seq_length", 4}, {"global_batch_size", 6}, {"micro_batch_size", 3}}}};
  Config config;
  ASSERT_TRUE(ParseConfig(document, &config).ok());
  const json effective = EffectiveConfigJson(document, config);
  EXPECT_EQ(effective["run"]["seed"], 1234);
  EXPECT_EQ(effective["run"]["dtype"], "bfloat16");  // from parallel.bf16
  EXPECT_EQ(effective["run"]["global_batch_size"], 6);
  EXPECT_FALSE(effective["run"].contains("num_microbatches"));  // derived from the batch
  EXPECT_EQ(effective["parallel"]["pipeline_model_parallel_size"], 1);
  EXPECT_EQ(effective["description"], "x");
  EXPECT_EQ(effective["model"], document["model"]);
  Config again;
  ASSERT_TRUE(ParseConfig(effective, &again).ok()) << ParseConfig(effective, &again).Message();
  EXPECT_EQ(EffectiveConfigJson(effective, again), effective);
  EXPECT_EQ(again.run->num_microbatches, 2);
  EXPECT_EQ(again.run->dtype, DType::kBFloat16);
}

// parallelize_plan styles a chain of torch.nn modules; anywhere else it is refused with the
// reason, and a torch chain's options are nn's (in_features, normalized_shape, ...).
TEST(ModelConfig, ParallelizePlanStylesTorchModulesOnly) {
  const json torch_layers = json::array(
      {{{"name", "fc1"}, {"type", "Linear"}, {"in_features", 8}, {"out_features", 16}},
       {{"name", "norm"}, {"type", "LayerNorm"}, {"normalized_shape", 16}, {"eps", 1e-6}},
       {{"name", "act"}, {"type", "ReLU"}}});
  Config config;
  ASSERT_TRUE(ParseConfig(json{{"parallel", {{"world_size", 2}, {"tensor_model_parallel_size", 2}}},
                               {"model", {{"layers", torch_layers}}},
                               {"parallelize_plan", {{"fc1", "ColwiseParallel"}}}},
                          &config)
                  .ok());
  ASSERT_TRUE(config.parallelize_plan.has_value());
  EXPECT_TRUE(config.model->IsTorchChain());
  EXPECT_EQ(config.model->layers[0].input_size, 8);
  EXPECT_EQ(config.model->layers[0].output_size.value, 16);
  EXPECT_EQ(config.model->layers[1].normalized_shape, 16);
  EXPECT_EQ(config.model->layers[1].eps, 1e-6);
  const auto refusal = [](const json& document) {
    Config c;
    const Status status = ParseConfig(document, &c);
    return status.ok() ? std::string("accepted") : status.Message();
  };
  EXPECT_EQ(refusal({{"parallel", {{"world_size", 1}}},
                     {"model", {{"layers", json::array({kFc1})}}},
                     {"parallelize_plan", "PairwiseParallel"}}),
            "parallelize_plan: styles a chain of torch.nn modules (model.layers of type "
            "Embedding, Linear, ReLU, GELU, Dropout, LayerNorm, CrossEntropyLoss) or a GPT's "
            "modules; this config has neither");
  EXPECT_EQ(refusal({{"parallel", {{"world_size", 1}}},
                     {"model", {{"layers", torch_layers}}},
                     {"parallelize_plan", {{"fc1", "ColwisParallel"}}}}),
            "parallelize_plan.fc1: \"ColwisParallel\" is not a parallel style; use one of "
            "\"ColwiseParallel\", \"RowwiseParallel\", \"PairwiseParallel\", "
            "\"SequenceParallel\", \"PrepareModuleInput\", \"PrepareModuleOutput\"");
  EXPECT_EQ(LayerRefusal({{"name", "n"}, {"type", "LayerNorm"}}),
            "model.layers[0].normalized_shape: is required (the width it normalises, as "
            "nn.LayerNorm's)");
  EXPECT_EQ(LayerRefusal({{"name", "e"}, {"type", "Embedding"}, {"embedding_dim", 8}}),
            "model.layers[0].num_embeddings: is required (an integer >= model.vocab_size, as "
            "nn.Embedding's)");
}

}  // namespace
}  // namespace mpusim
