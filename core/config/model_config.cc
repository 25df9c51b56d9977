// Strict parsing of the `model` and `run` sections (see model_config.h).
//
// What it checks: JSON types, ranges, unknown keys and layer types (with a suggestion), the
// options each layer type accepts, and the references between layers (weight_from,
// bias_from). What it does not check: whether consecutive layers fit together (shapes,
// parallel states, sequence_parallel); core/model/graph owns that, since it needs the layout.
#include "core/config/model_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/config/field_table.h"
#include "core/config/json_fields.h"
#include "core/config/parallel_config.h"

namespace mpusim {
namespace {

using nlohmann::json;

constexpr std::string_view kPaddedVocab = "padded_vocab_size";



// An integer >= 1 or the string "padded_vocab_size".
Status ParseSize(const json& value, const std::string& where, SizeValue* out) {
  if (value.is_string() && value.get<std::string>() == kPaddedVocab) {
    *out = SizeValue{0, true};
    return {};
  }
  if (!value.is_number_integer()) {
    return Status::Error(where, fmt::format("must be an integer >= 1 or \"{}\", got {}",
                                            kPaddedVocab, DescribeJson(value)));
  }
  int64_t v = 0;
  MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &v));
  *out = SizeValue{v, false};
  return {};
}

// The name of another layer ("weight_from", "bias_from"); checked against the chain later.
Status ParseLayerName(const json& value, const std::string& where, std::string* out) {
  if (!value.is_string() || value.get<std::string>().empty()) {
    return Status::Error(
        where, fmt::format("must be the name of an earlier layer, got {}", DescribeJson(value)));
  }
  *out = value.get<std::string>();
  return {};
}

struct LayerTypeInfo {
  LayerType type;
  std::string_view name;                  // canonical spelling
  std::vector<std::string_view> options;  // keys besides "name" and "type", documentation order
};

const std::vector<LayerTypeInfo>& LayerTypes() {
  static const std::vector<LayerTypeInfo> kTypes = {
      {LayerType::kVocabParallelEmbedding,
       "VocabParallelEmbedding",
       {"num_embeddings", "embedding_dim", "init_method", "init_method_std"}},
      {LayerType::kParallelEmbedding,
       "ParallelEmbedding",
       {"num_embeddings", "embedding_dim", "init_method", "init_method_std"}},
      {LayerType::kColumnParallelLinear,
       "ColumnParallelLinear",
       {"input_size", "output_size", "bias", "gather_output", "stride", "skip_bias_add",
        "skip_weight_param_allocation", "weight_from", "frozen", "init_method", "init_method_std"}},
      {LayerType::kRowParallelLinear,
       "RowParallelLinear",
       {"input_size", "output_size", "bias", "input_is_parallel", "stride", "skip_bias_add",
        "frozen", "init_method", "init_method_std"}},
      {LayerType::kGeLU, "GeLU", {"bias_from"}},
      {LayerType::kDropout, "Dropout", {"p"}},
      {LayerType::kVocabParallelCrossEntropy, "VocabParallelCrossEntropy", {"label_smoothing"}},
      {LayerType::kCopyToTensorModelParallelRegion, "copy_to_tensor_model_parallel_region", {}},
      {LayerType::kReduceFromTensorModelParallelRegion,
       "reduce_from_tensor_model_parallel_region",
       {}},
      {LayerType::kScatterToTensorModelParallelRegion,
       "scatter_to_tensor_model_parallel_region",
       {}},
      {LayerType::kGatherFromTensorModelParallelRegion,
       "gather_from_tensor_model_parallel_region",
       {}},
      {LayerType::kScatterToSequenceParallelRegion, "scatter_to_sequence_parallel_region", {}},
      {LayerType::kGatherFromSequenceParallelRegion,
       "gather_from_sequence_parallel_region",
       {"tensor_parallel_output_grad"}},
      {LayerType::kReduceScatterToSequenceParallelRegion,
       "reduce_scatter_to_sequence_parallel_region",
       {}},
      {LayerType::kEmbedding,
       "Embedding",
       {"num_embeddings", "embedding_dim", "init_method", "init_method_std"}},
      {LayerType::kLinear,
       "Linear",
       {"in_features", "out_features", "bias", "init_method", "init_method_std"}},
      {LayerType::kReLU, "ReLU", {}},
      {LayerType::kCrossEntropyLoss, "CrossEntropyLoss", {}},
      {LayerType::kLayerNorm, "LayerNorm", {"normalized_shape", "eps"}},
  };
  return kTypes;
}

const LayerTypeInfo& InfoOf(LayerType type) {
  for (const LayerTypeInfo& info : LayerTypes()) {
    if (info.type == type) return info;
  }
  return LayerTypes().front();  // unreachable: every enumerator is in the table
}

// Accepted spellings besides the canonical ones (Megatron's GELU module, the
// vocab_parallel_cross_entropy function).
std::optional<LayerType> LookUpLayerType(std::string_view text) {
  if (text == "GELU") return LayerType::kGeLU;
  if (text == "vocab_parallel_cross_entropy") return LayerType::kVocabParallelCrossEntropy;
  for (const LayerTypeInfo& info : LayerTypes()) {
    if (info.name == text) return info.type;
  }
  return std::nullopt;
}

std::string SuggestLayerType(std::string_view text) {
  // Case slips ("gelu", "dropout") are too far apart for edit distance on short names.
  for (const LayerTypeInfo& info : LayerTypes()) {
    if (info.name.size() == text.size() &&
        std::equal(text.begin(), text.end(), info.name.begin(), [](char a, char b) {
          return std::tolower(static_cast<unsigned char>(a)) ==
                 std::tolower(static_cast<unsigned char>(b));
        })) {
      return std::string(info.name);
    }
  }
  std::vector<std::string_view> names;
  for (const LayerTypeInfo& info : LayerTypes()) names.push_back(info.name);
  return SuggestKey(text, names);
}

bool IsLinear(LayerType type) {
  return type == LayerType::kColumnParallelLinear || type == LayerType::kRowParallelLinear;
}

bool IsEmbedding(LayerType type) {
  return type == LayerType::kVocabParallelEmbedding || type == LayerType::kParallelEmbedding;
}

bool HasInit(LayerType type) {
  return IsLinear(type) || IsEmbedding(type) || type == LayerType::kLinear ||
         type == LayerType::kEmbedding;
}

// The layers whose tokens and labels come from model.vocab_size.
bool ReadsTokens(LayerType type) { return IsEmbedding(type) || type == LayerType::kEmbedding; }
bool ReadsLabels(LayerType type) {
  return type == LayerType::kVocabParallelCrossEntropy || type == LayerType::kCrossEntropyLoss;
}

// Parses `key` (already known to be an option of layer->type) into *layer.
Status ParseLayerOption(const std::string& key, const json& value, const std::string& where,
                        LayerConfig* layer) {
  if (key == "num_embeddings") {
    if (layer->type == LayerType::kEmbedding) {  // torch's: a number
      layer->num_embeddings.padded_vocab = false;
      return ParseInt(value, where, 1, &layer->num_embeddings.value);
    }
    return ParseSize(value, where, &layer->num_embeddings);
  }
  if (key == "in_features") return ParseInt(value, where, 1, &layer->input_size);
  if (key == "normalized_shape") return ParseInt(value, where, 1, &layer->normalized_shape);
  if (key == "eps") {
    if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() <= 0) {
      return Status::Error(where, fmt::format("must be a number > 0, got {}", DescribeJson(value)));
    }
    layer->eps = value.get<double>();
    return {};
  }
  if (key == "out_features") {
    layer->output_size.padded_vocab = false;
    return ParseInt(value, where, 1, &layer->output_size.value);
  }
  if (key == "embedding_dim") return ParseInt(value, where, 1, &layer->embedding_dim);
  if (key == "input_size") return ParseInt(value, where, 1, &layer->input_size);
  if (key == "output_size") return ParseSize(value, where, &layer->output_size);
  if (key == "bias") return ParseBool(value, where, &layer->bias);
  if (key == "gather_output") return ParseBool(value, where, &layer->gather_output);
  if (key == "input_is_parallel") return ParseBool(value, where, &layer->input_is_parallel);
  if (key == "stride") return ParseInt(value, where, 1, &layer->stride);
  if (key == "skip_bias_add") return ParseBool(value, where, &layer->skip_bias_add);
  if (key == "skip_weight_param_allocation") {
    return ParseBool(value, where, &layer->skip_weight_param_allocation);
  }
  if (key == "weight_from") return ParseLayerName(value, where, &layer->weight_from);
  if (key == "frozen") return ParseBool(value, where, &layer->frozen);
  if (key == "init_method") {
    if (!value.is_string()) {
      return Status::Error(where, fmt::format("must be one of xavier_normal, normal, zeros, "
                                              "got {}",
                                              DescribeJson(value)));
    }
    StatusOr<InitMethod> method = ParseInitMethod(value.get<std::string>(), where);
    if (!method.ok()) return method.status();
    layer->init.method = *method;
    return {};
  }
  if (key == "init_method_std") {
    if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() <= 0) {
      return Status::Error(where, fmt::format("must be a number > 0, got {}", DescribeJson(value)));
    }
    layer->init.std = value.get<double>();
    return {};
  }
  if (key == "bias_from") return ParseLayerName(value, where, &layer->bias_from);
  if (key == "p") return ParseFraction(value, where, &layer->p);
  if (key == "label_smoothing") return ParseFraction(value, where, &layer->label_smoothing);
  if (key == "tensor_parallel_output_grad") {
    return ParseBool(value, where, &layer->tensor_parallel_output_grad);
  }
  return Status::Error(where, "unhandled option");  // unreachable: the tables cover every key
}

std::string EarlierNames(const std::vector<LayerConfig>& earlier) {
  if (earlier.empty()) return "none";
  std::vector<std::string_view> names;
  for (const LayerConfig& layer : earlier) names.push_back(layer.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

const LayerConfig* FindEarlier(const std::vector<LayerConfig>& earlier, std::string_view name) {
  for (const LayerConfig& layer : earlier) {
    if (layer.name == name) return &layer;
  }
  return nullptr;
}

// weight_from: an earlier layer that owns a weight split on dim 0 like this layer's.
Status CheckWeightFrom(const LayerConfig& layer, const std::vector<LayerConfig>& earlier,
                       const std::string& prefix) {
  const std::string where = prefix + ".weight_from";
  const LayerConfig* owner = FindEarlier(earlier, layer.weight_from);
  if (owner == nullptr) {
    return Status::Error(where, fmt::format("\"{}\" is not an earlier layer (earlier layers: {})",
                                            layer.weight_from, EarlierNames(earlier)));
  }
  if (owner->type != LayerType::kVocabParallelEmbedding &&
      owner->type != LayerType::kColumnParallelLinear) {
    return Status::Error(where, fmt::format("\"{}\" is a {}; must name a VocabParallelEmbedding "
                                            "or ColumnParallelLinear (a weight split on dim 0)",
                                            owner->name, LayerTypeName(owner->type)));
  }
  if (owner->skip_weight_param_allocation) {
    return Status::Error(where, fmt::format("\"{}\" has no weight of its own (it uses \"{}\"'s); "
                                            "name \"{}\"",
                                            owner->name, owner->weight_from, owner->weight_from));
  }
  // The owner's stride decides how the shared weight is partitioned.
  const int64_t owner_stride = owner->type == LayerType::kColumnParallelLinear ? owner->stride : 1;
  if (layer.stride != owner_stride) {
    return Status::Error(prefix + ".stride",
                         fmt::format("must equal the stride of weight_from layer \"{}\" ({}), "
                                     "which partitions the shared weight; got {}",
                                     owner->name, owner_stride, layer.stride));
  }
  return {};
}

// bias_from: an earlier linear layer that returns its bias (skip_bias_add).
Status CheckBiasFrom(const LayerConfig& layer, const std::vector<LayerConfig>& earlier,
                     const std::string& prefix) {
  const std::string where = prefix + ".bias_from";
  const LayerConfig* source = FindEarlier(earlier, layer.bias_from);
  if (source == nullptr) {
    return Status::Error(where, fmt::format("\"{}\" is not an earlier layer (earlier layers: {})",
                                            layer.bias_from, EarlierNames(earlier)));
  }
  if (!IsLinear(source->type)) {
    return Status::Error(where, fmt::format("\"{}\" is a {}; must name a ColumnParallelLinear or "
                                            "RowParallelLinear with \"skip_bias_add\": true",
                                            source->name, LayerTypeName(source->type)));
  }
  if (!source->skip_bias_add) {
    return Status::Error(where, fmt::format("\"{}\" must set \"skip_bias_add\": true to return "
                                            "its bias instead of adding it",
                                            source->name));
  }
  if (!source->bias) {
    return Status::Error(
        where, fmt::format("\"{}\" has \"bias\": false; it returns no bias", source->name));
  }
  return {};
}

// name: used in tensor names "<layer>.<role>", so unique and without '.'.
Status ParseUniqueName(const json& value, const std::string& prefix,
                       const std::vector<LayerConfig>& earlier, LayerConfig* layer) {
  const std::string name_where = prefix + ".name";
  if (!value.contains("name")) {
    return Status::Error(name_where, "is required (a unique layer name, e.g. \"fc1\")");
  }
  const json& name = value.at("name");
  if (!name.is_string() || name.get<std::string>().empty()) {
    return Status::Error(name_where,
                         fmt::format("must be a non-empty string, got {}", DescribeJson(name)));
  }
  layer->name = name.get<std::string>();
  if (layer->name.find('.') != std::string::npos) {
    return Status::Error(name_where, fmt::format("must not contain '.' (tensor names are "
                                                 "\"<layer>.<role>\"), got \"{}\"",
                                                 layer->name));
  }
  for (size_t i = 0; i < earlier.size(); ++i) {
    if (earlier[i].name == layer->name) {
      return Status::Error(name_where, fmt::format("\"{}\" is already the name of model.layers[{}]",
                                                   layer->name, i));
    }
  }
  return {};
}

// type: one of LayerTypes(), with a suggestion for a near miss.
Status ParseType(const json& value, const std::string& prefix, LayerConfig* layer) {
  std::vector<std::string_view> type_names;
  for (const LayerTypeInfo& info : LayerTypes()) type_names.push_back(info.name);
  const std::string type_where = prefix + ".type";
  if (!value.contains("type")) {
    return Status::Error(type_where,
                         fmt::format("is required (one of: {})", fmt::join(type_names, ", ")));
  }
  const json& type = value.at("type");
  if (!type.is_string()) {
    return Status::Error(type_where, fmt::format("must be a string (one of: {}), got {}",
                                                 fmt::join(type_names, ", "), DescribeJson(type)));
  }
  const std::string type_text = type.get<std::string>();
  const std::optional<LayerType> layer_type = LookUpLayerType(type_text);
  if (!layer_type) {
    const std::string suggestion = SuggestLayerType(type_text);
    return Status::Error(
        type_where, suggestion.empty()
                        ? fmt::format("unknown layer type \"{}\"; types: {}", type_text,
                                      fmt::join(type_names, ", "))
                        : fmt::format("unknown layer type \"{}\"; did you mean '{}'? (types: {})",
                                      type_text, suggestion, fmt::join(type_names, ", ")));
  }
  layer->type = *layer_type;
  return {};
}

// Options, refused unless they belong to this type.
Status ParseOptions(const json& value, const std::string& prefix, LayerConfig* layer) {
  const LayerTypeInfo& info = InfoOf(layer->type);
  std::vector<std::string_view> keys = {"name", "type"};
  keys.insert(keys.end(), info.options.begin(), info.options.end());
  for (const auto& [key, option] : value.items()) {
    if (key == "name" || key == "type") continue;
    const std::string where = prefix + "." + key;
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      // `&key = key`: clang 14 cannot capture a structured binding itself.
      const bool of_another_type = std::any_of(
          LayerTypes().begin(), LayerTypes().end(), [&, &key = key](const LayerTypeInfo& other) {
            return std::find(other.options.begin(), other.options.end(), key) !=
                   other.options.end();
          });
      const std::string suggestion = SuggestKey(key, keys);
      if (of_another_type) {
        const auto owner = std::find_if(
            LayerTypes().begin(), LayerTypes().end(), [&, &key = key](const LayerTypeInfo& other) {
              return std::find(other.options.begin(), other.options.end(), key) !=
                     other.options.end();
            });
        if (!suggestion.empty()) {
          return Status::Error(where, fmt::format("unknown key; did you mean '{}'? ({} is an "
                                                  "option of {})",
                                                  suggestion, key, owner->name));
        }
        return Status::Error(where, fmt::format("not an option of {} (options: {})", info.name,
                                                fmt::join(keys, ", ")));
      }
      return Status::Error(where, suggestion.empty()
                                      ? fmt::format("unknown key; options of {}: {}", info.name,
                                                    fmt::join(keys, ", "))
                                      : fmt::format("unknown key; did you mean '{}'?", suggestion));
    }
    MPUSIM_RETURN_IF_ERROR(ParseLayerOption(key, option, where, layer));
  }
  return {};
}

// Required options.
Status CheckRequiredOptions(const json& value, const std::string& prefix,
                            const LayerConfig& layer) {
  if (ReadsTokens(layer.type) && !value.contains("embedding_dim")) {
    return Status::Error(prefix + ".embedding_dim", "is required (an integer >= 1)");
  }
  if (layer.type == LayerType::kEmbedding && !value.contains("num_embeddings")) {
    return Status::Error(prefix + ".num_embeddings",
                         "is required (an integer >= model.vocab_size, as nn.Embedding's)");
  }
  if (layer.type == LayerType::kLayerNorm && !value.contains("normalized_shape")) {
    return Status::Error(prefix + ".normalized_shape",
                         "is required (the width it normalises, as nn.LayerNorm's)");
  }
  if (layer.type == LayerType::kLinear) {
    for (const char* key : {"in_features", "out_features"}) {
      if (!value.contains(key)) {
        return Status::Error(fmt::format("{}.{}", prefix, key),
                             "is required (an integer >= 1, as nn.Linear's)");
      }
    }
  }
  if (IsLinear(layer.type)) {
    if (!value.contains("input_size")) {
      return Status::Error(prefix + ".input_size", "is required (an integer >= 1)");
    }
    if (!value.contains("output_size")) {
      return Status::Error(prefix + ".output_size",
                           "is required (an integer >= 1 or \"padded_vocab_size\")");
    }
  }
  if (layer.type == LayerType::kDropout && !value.contains("p")) {
    return Status::Error(prefix + ".p", "is required (the drop probability, in [0, 1))");
  }
  return {};
}

// Options that only make sense together.
Status CheckOptionsTogether(const json& value, const std::string& prefix,
                            const std::vector<LayerConfig>& earlier, const LayerConfig& layer) {
  if (layer.skip_weight_param_allocation) {
    if (layer.weight_from.empty()) {
      return Status::Error(prefix + ".weight_from",
                           "is required with \"skip_weight_param_allocation\": true (the "
                           "earlier layer whose weight is passed at forward)");
    }
    // The weight belongs to weight_from: its init and requires_grad are that layer's.
    for (std::string_view owned : {"init_method", "init_method_std", "frozen"}) {
      if (value.contains(owned)) {
        return Status::Error(fmt::format("{}.{}", prefix, owned),
                             "does not apply with \"skip_weight_param_allocation\": true (the "
                             "weight belongs to the weight_from layer)");
      }
    }
    MPUSIM_RETURN_IF_ERROR(CheckWeightFrom(layer, earlier, prefix));
  } else if (value.contains("weight_from")) {
    return Status::Error(prefix + ".weight_from",
                         "is only allowed with \"skip_weight_param_allocation\": true");
  }
  if (HasInit(layer.type) && value.contains("init_method_std") &&
      layer.init.method != InitMethod::kNormal) {
    return Status::Error(prefix + ".init_method_std",
                         "is only used with \"init_method\": \"normal\"");
  }
  if (!layer.bias_from.empty()) MPUSIM_RETURN_IF_ERROR(CheckBiasFrom(layer, earlier, prefix));
  return {};
}

Status ParseLayer(const json& value, const std::string& prefix,
                  const std::vector<LayerConfig>& earlier, LayerConfig* out) {
  if (!value.is_object()) {
    return Status::Error(prefix, fmt::format("must be a JSON object with \"name\" and \"type\", "
                                             "got {}",
                                             DescribeJson(value)));
  }
  LayerConfig layer;
  MPUSIM_RETURN_IF_ERROR(ParseUniqueName(value, prefix, earlier, &layer));
  MPUSIM_RETURN_IF_ERROR(ParseType(value, prefix, &layer));
  MPUSIM_RETURN_IF_ERROR(ParseOptions(value, prefix, &layer));
  MPUSIM_RETURN_IF_ERROR(CheckRequiredOptions(value, prefix, layer));
  MPUSIM_RETURN_IF_ERROR(CheckOptionsTogether(value, prefix, earlier, layer));
  *out = std::move(layer);
  return {};
}

bool UsesPaddedVocab(const LayerConfig& layer) {
  return (IsEmbedding(layer.type) && layer.num_embeddings.padded_vocab) ||
         (IsLinear(layer.type) && layer.output_size.padded_vocab);
}

// Whole-chain rules: vocab_size where tokens, labels or padded_vocab_size need it, and
// every returned bias consumed.
Status CheckChain(const ModelConfig& model) {
  // One family: torch's modules or Megatron's layers (GeLU and Dropout go with either).
  const LayerConfig* torch = nullptr;
  const LayerConfig* megatron = nullptr;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const LayerConfig& layer = model.layers[i];
    if (IsTorchModule(layer.type) && torch == nullptr) torch = &layer;
    if (IsMegatronLayer(layer.type) && megatron == nullptr) megatron = &layer;
    if (torch != nullptr && megatron != nullptr) {
      const LayerConfig& later = torch == &layer ? *torch : *megatron;
      const LayerConfig& earlier = torch == &layer ? *megatron : *torch;
      return Status::Error(
          fmt::format("model.layers[{}].type", i),
          fmt::format("\"{}\" ({}) is {}, but \"{}\" ({}) is {}; a chain is written in torch.nn's "
                      "modules (Embedding, Linear, ReLU, LayerNorm, CrossEntropyLoss: styled by a "
                      "parallelize_plan) or in Megatron's layers, not both (GeLU and Dropout go "
                      "with either)",
                      later.name, LayerTypeName(later.type),
                      IsTorchModule(later.type) ? "a torch.nn module" : "a Megatron layer",
                      earlier.name, LayerTypeName(earlier.type),
                      IsTorchModule(earlier.type) ? "a torch.nn module" : "a Megatron layer"));
    }
  }
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const LayerConfig& layer = model.layers[i];
    const std::string prefix = fmt::format("model.layers[{}]", i);
    const bool needs_vocab =
        ReadsTokens(layer.type) || UsesPaddedVocab(layer) || ReadsLabels(layer.type);
    if (needs_vocab && !model.vocab_size) {
      return Status::Error("model.vocab_size",
                           fmt::format("is required by {} (\"{}\", {}): tokens and labels are "
                                       "drawn from [0, vocab_size) and padded_vocab_size is "
                                       "derived from it",
                                       prefix, layer.name, LayerTypeName(layer.type)));
    }
    if (ReadsTokens(layer.type) && !layer.num_embeddings.padded_vocab &&
        layer.num_embeddings.value < *model.vocab_size) {
      return Status::Error(prefix + ".num_embeddings",
                           fmt::format("must be >= vocab_size ({}) since tokens are drawn from "
                                       "[0, vocab_size), got {}",
                                       *model.vocab_size, layer.num_embeddings.value));
    }
    if (IsLinear(layer.type) && layer.skip_bias_add && layer.bias) {
      const bool consumed =
          std::any_of(model.layers.begin() + static_cast<std::ptrdiff_t>(i) + 1, model.layers.end(),
                      [&](const LayerConfig& later) { return later.bias_from == layer.name; });
      if (!consumed) {
        return Status::Error(prefix + ".skip_bias_add",
                             fmt::format("the bias of \"{}\" is returned but no later GeLU takes "
                                         "it; add \"bias_from\": \"{}\" to one, or set "
                                         "\"bias\": false",
                                         layer.name, layer.name));
      }
    }
  }
  return {};
}

}  // namespace

bool IsTorchModule(LayerType type) {
  return type == LayerType::kEmbedding || type == LayerType::kLinear || type == LayerType::kReLU ||
         type == LayerType::kCrossEntropyLoss || type == LayerType::kLayerNorm;
}
bool IsMegatronLayer(LayerType type) {
  return !IsTorchModule(type) && type != LayerType::kGeLU && type != LayerType::kDropout;
}

bool ModelConfig::IsTorchChain() const {
  return std::any_of(layers.begin(), layers.end(),
                     [](const LayerConfig& layer) { return IsTorchModule(layer.type); });
}

const std::vector<std::string_view>& ModelConfigKeys() {
  static const std::vector<std::string_view> kKeys = {"vocab_size", "make_vocab_size_divisible_by",
                                                      "layers"};
  return kKeys;
}

namespace {

using RunField = Field<RunConfig>;

const char* RecomputeText(RunConfig::Recompute r) {
  return r == RunConfig::Recompute::kFull ? "full" : "selective";
}

constexpr RunConfig::RecomputeModule kRecomputeModules[] = {
    RunConfig::RecomputeModule::kCoreAttn, RunConfig::RecomputeModule::kLayernorm,
    RunConfig::RecomputeModule::kMlp,      RunConfig::RecomputeModule::kMoeAct,
    RunConfig::RecomputeModule::kMoe,      RunConfig::RecomputeModule::kSharedExperts,
};

// Megatron's rules between the recompute keys (TransformerConfig.__post_init__ and
// arguments.py validate_args): full needs a method and recompute_num_layers, selective takes
// neither; a key read only under one granularity is refused under another rather than
// ignored.
Status CheckRecompute(const RunConfig& run) {
  using R = RunConfig::Recompute;
  const bool method = run.recompute_method != RunConfig::RecomputeMethod::kNone;
  if (run.recompute == R::kFull) {
    if (!method) {
      return Status::Error("run.recompute_method",
                           "recompute_granularity \"full\" needs \"uniform\" or \"block\" "
                           "(Megatron's rule); every layer recomputed alone, as before, is "
                           "\"recompute_method\": \"uniform\", \"recompute_num_layers\": 1");
    }
    if (!run.recompute_num_layers) {
      return Status::Error("run.recompute_num_layers",
                           fmt::format("recompute_granularity \"full\" needs the number of "
                                       "layers {} (Megatron's rule), e.g. 1",
                                       run.recompute_method == RunConfig::RecomputeMethod::kUniform
                                           ? "per recomputed group"
                                           : "recomputed per model chunk"));
    }
  } else {
    const char* granularity = run.recompute == R::kSelective ? "\"selective\"" : "null";
    if (method) {
      return Status::Error("run.recompute_method",
                           fmt::format("is read only with recompute_granularity \"full\", "
                                       "got recompute_granularity {}; set it to null",
                                       granularity));
    }
    if (run.recompute_num_layers) {
      return Status::Error("run.recompute_num_layers",
                           fmt::format("must be null with recompute_granularity {} (Megatron's "
                                       "rule); it counts fully recomputed layers",
                                       granularity));
    }
  }
  if (run.recompute != R::kSelective && run.recompute_modules) {
    return Status::Error("run.recompute_modules",
                         fmt::format("is read only with recompute_granularity \"selective\", "
                                     "got {}; set it to null",
                                     run.recompute == R::kFull ? "\"full\"" : "null"));
  }
  return {};
}

// The section's keys, in documentation order.
constexpr RunField kRunFields[] = {
    {.key = "seed",
     .target = Codec<RunConfig>{
         FieldKind::kInt,
         [](const json& value, const std::string& where, RunConfig* run) {
           // The full uint64 range: seeds are Philox keys, not sizes.
           if (!value.is_number_integer()) {
             return Status::Error(
                 where, fmt::format("must be an integer >= 0, got {}", DescribeJson(value)));
           }
           if (!value.is_number_unsigned() && value.get<int64_t>() < 0) {
             return Status::Error(
                 where, fmt::format("must be an integer >= 0, got {}", value.get<int64_t>()));
           }
           run->seed = value.get<uint64_t>();
           return Status();
         },
         [](const RunConfig& run) { return json(run.seed); }},
     .help = "the seed of the initial values, the data and the dropout masks",
     .flag = "--seed",
     .effect = FieldEffect::kSeed},
    {.key = "dtype",
     .target = Codec<RunConfig>{
         FieldKind::kText,
         [](const json& value, const std::string& where, RunConfig* run) {
           run->dtype_given = true;
           const std::optional<DType> dtype =
               value.is_string() ? DTypeFromName(value.get<std::string>()) : std::nullopt;
           if (!dtype || !IsFloat(*dtype)) {  // int64 is a storage dtype for ids, not a run's
             return Status::Error(where, fmt::format("must be \"float32\", \"float64\", "
                                                     "\"bfloat16\" or \"float16\", got {}",
                                                     DescribeJson(value)));
           }
           run->dtype = *dtype;
           return Status();
         },
         [](const RunConfig& run) { return json(std::string(DTypeName(run.dtype))); }},
     .help = "storage dtype: float64, float32, bfloat16 or float16",
     .flag = "--dtype",
     .effect = FieldEffect::kPrecision},
    {.key = "seq_length",
     .target = &RunConfig::seq_length,
     .help = "tokens per sample",
     .flag = "--seq-length",
     .required = "tokens per sample, e.g. \"seq_length\": 8"},
    {.key = "micro_batch_size",
     .target = &RunConfig::micro_batch_size,
     .help = "samples per micro-batch",
     .flag = "--micro-batch-size",
     .effect = FieldEffect::kBatch},
    {.key = "num_microbatches",
     .target = &RunConfig::num_microbatches,
     .help = "micro-batches per iteration (gradients accumulate over them)",
     .flag = "--num-microbatches",
     .given = &RunConfig::num_microbatches_given,
     .effect = FieldEffect::kBatch},
    {.key = "recompute_granularity",
     .target = Codec<RunConfig>{
         FieldKind::kText,
         [](const json& value, const std::string& where, RunConfig* run) {
           if (value.is_null()) {
             run->recompute = RunConfig::Recompute::kNone;
           } else if (value == "full") {
             run->recompute = RunConfig::Recompute::kFull;
           } else if (value == "selective") {
             run->recompute = RunConfig::Recompute::kSelective;
           } else {
             return Status::Error(where, fmt::format("must be \"full\", \"selective\" or null, "
                                                     "got {}",
                                                     DescribeJson(value)));
           }
           return Status();
         },
         [](const RunConfig& run) {
           return run.recompute == RunConfig::Recompute::kNone
                      ? json(nullptr)
                      : json(RecomputeText(run.recompute));
         }},
     .help = "null, full (whole layers' forwards again in the backward: recompute_method) or "
             "selective (recompute_modules)",
     .flag = "--recompute",
     .effect = FieldEffect::kLayout},
    {.key = "recompute_method",
     .target = Codec<RunConfig>{
         FieldKind::kText,
         [](const json& value, const std::string& where, RunConfig* run) {
           if (value.is_null()) {
             run->recompute_method = RunConfig::RecomputeMethod::kNone;
           } else if (value == "uniform") {
             run->recompute_method = RunConfig::RecomputeMethod::kUniform;
           } else if (value == "block") {
             run->recompute_method = RunConfig::RecomputeMethod::kBlock;
           } else {
             return Status::Error(where, fmt::format("must be \"uniform\", \"block\" or null, "
                                                     "got {}",
                                                     DescribeJson(value)));
           }
           return Status();
         },
         [](const RunConfig& run) {
           return run.recompute_method == RunConfig::RecomputeMethod::kNone
                      ? json(nullptr)
                      : json(RecomputeMethodName(run.recompute_method));
         }},
     .help = "full only: uniform (groups of recompute_num_layers layers, each keeping its "
             "input) or block (the first recompute_num_layers layers of each chunk)",
     .flag = "--recompute-method",
     .effect = FieldEffect::kLayout},
    {.key = "recompute_num_layers",
     .target = &RunConfig::recompute_num_layers,
     .help = "full only: layers per uniform group, or recomputed layers per chunk (block)",
     .flag = "--recompute-num-layers",
     .effect = FieldEffect::kLayout},
    {.key = "recompute_modules",
     .target = Codec<RunConfig>{
         FieldKind::kText,
         [](const json& value, const std::string& where, RunConfig* run) {
           if (value.is_null()) {
             run->recompute_modules.reset();
             return Status();
           }
           const std::string allowed =
               "\"core_attn\", \"layernorm\", \"mlp\", \"moe_act\", \"moe\", "
               "\"shared_experts\"";
           if (!value.is_array()) {
             return Status::Error(where, fmt::format("must be null or a list of {}, got {}",
                                                     allowed, DescribeJson(value)));
           }
           std::vector<RunConfig::RecomputeModule> modules;
           for (size_t i = 0; i < value.size(); ++i) {
             const std::string at = fmt::format("{}[{}]", where, i);
             std::optional<RunConfig::RecomputeModule> found;
             for (const RunConfig::RecomputeModule m : kRecomputeModules) {
               if (value[i] == RecomputeModuleName(m)) found = m;
             }
             if (value[i] == "mla_up_proj") {
               // Megatron's module (only with multi_latent_attention): the up projections'
               // checkpoint, which MlaSelfAttention does not build.
               return Status::Error(at,
                                    "\"mla_up_proj\" (multi-latent attention's up-projection "
                                    "checkpoint) is not built; core_attn and layernorm are");
             }
             if (!found) {
               return Status::Error(
                   at, fmt::format("must be one of {}, got {}", allowed, DescribeJson(value[i])));
             }
             if (std::find(modules.begin(), modules.end(), *found) != modules.end()) {
               return Status::Error(at, fmt::format("lists {} twice", value[i].dump()));
             }
             modules.push_back(*found);
           }
           run->recompute_modules = std::move(modules);
           return Status();
         },
         [](const RunConfig& run) {
           if (!run.recompute_modules) return json(nullptr);
           json list = json::array();
           for (const RunConfig::RecomputeModule m : *run.recompute_modules) {
             list.push_back(RecomputeModuleName(m));
           }
           return list;
         }},
     .help = "selective only: the submodules recomputed in the backward (null: [\"core_attn\"])",
     .effect = FieldEffect::kLayout},
    {.key = "train_iters",
     .target = &RunConfig::train_iters,
     .help = "optimizer steps",
     .flag = "--train-iters",
     .effect = FieldEffect::kIterations},
    {.key = "global_batch_size",
     .target = &RunConfig::global_batch_size,
     .help = "samples per iteration over all dp ranks (sets num_microbatches per layout)",
     .flag = "--global-batch-size",
     .effect = FieldEffect::kBatch},
    {.key = "loss_parallel",
     .target = &RunConfig::loss_parallel,
     .help = "PyTorch's loss_parallel(): a torch.nn chain's CrossEntropyLoss on Shard(-1) "
             "logits, each rank its classes",
     .flag = "--loss-parallel",
     .effect = FieldEffect::kLayout},
};

}  // namespace

std::span<const Field<RunConfig>> RunFields() { return kRunFields; }

const std::vector<std::string_view>& RunConfigKeys() {
  static const std::vector<std::string_view> kKeys = KeysOf(RunFields());
  return kKeys;
}

const char* RecomputeMethodName(RunConfig::RecomputeMethod method) {
  return method == RunConfig::RecomputeMethod::kUniform ? "uniform"
         : method == RunConfig::RecomputeMethod::kBlock ? "block"
                                                        : "none";
}

const char* RecomputeModuleName(RunConfig::RecomputeModule module) {
  switch (module) {
    case RunConfig::RecomputeModule::kCoreAttn:
      return "core_attn";
    case RunConfig::RecomputeModule::kLayernorm:
      return "layernorm";
    case RunConfig::RecomputeModule::kMlp:
      return "mlp";
    case RunConfig::RecomputeModule::kMoeAct:
      return "moe_act";
    case RunConfig::RecomputeModule::kMoe:
      return "moe";
    case RunConfig::RecomputeModule::kSharedExperts:
      return "shared_experts";
  }
  return "?";
}

bool RunConfig::Recomputes(RecomputeModule module) const {
  if (recompute != Recompute::kSelective) return false;
  if (!recompute_modules) return module == RecomputeModule::kCoreAttn;  // Megatron's default
  return std::find(recompute_modules->begin(), recompute_modules->end(), module) !=
         recompute_modules->end();
}

RunConfig::RecomputeGroup RunConfig::GroupOf(int64_t index, int64_t chunk_layers) const {
  if (recompute != Recompute::kFull || !recompute_num_layers) return {};
  if (index < 0 || index >= chunk_layers) return {};  // not a layer of the chunk
  const int64_t n = *recompute_num_layers;
  if (recompute_method == RecomputeMethod::kUniform) {
    // The last group may be shorter: checkpointed_forward cuts it at the chunk's end.
    return {.recomputed = true, .first = index / n * n};
  }
  if (recompute_method == RecomputeMethod::kBlock) return {.recomputed = index < n, .first = index};
  return {};
}

std::string RecomputeSummary(const RunConfig& run) {
  switch (run.recompute) {
    case RunConfig::Recompute::kNone:
      return "none";
    case RunConfig::Recompute::kFull: {
      const int64_t n = run.recompute_num_layers.value_or(0);
      return fmt::format(
          "full ({}, {} layer{}{})", RecomputeMethodName(run.recompute_method), n,
          n == 1 ? "" : "s",
          run.recompute_method == RunConfig::RecomputeMethod::kBlock ? " per chunk" : " per group");
    }
    case RunConfig::Recompute::kSelective: {
      std::string names;
      for (const RunConfig::RecomputeModule m : kRecomputeModules) {
        if (!run.Recomputes(m)) continue;
        names += (names.empty() ? "" : ", ") + std::string(RecomputeModuleName(m));
      }
      return fmt::format("selective ({})", names.empty() ? "nothing" : names);
    }
  }
  return "?";
}

const char* LayerTypeName(LayerType type) { return InfoOf(type).name.data(); }

// Megatron's _vocab_size_with_padding. Returns 0 without a vocab_size; ParseModelSection
// requires one wherever padded_vocab_size is used.
int64_t ModelConfig::PaddedVocabSize(int64_t tensor_model_parallel_size) const {
  if (!vocab_size) return 0;
  const int64_t multiple = make_vocab_size_divisible_by * tensor_model_parallel_size;
  if (multiple <= 0) return *vocab_size;
  return (*vocab_size + multiple - 1) / multiple * multiple;
}

Status ParseModelSection(const json& section, ModelConfig* out) {
  const std::string prefix = "model";
  if (!section.is_object()) {
    return Status::Error(prefix, fmt::format("must be a JSON object, got {}", DescribeJson(section)));
  }
  ModelConfig model;
  for (const auto& [key, value] : section.items()) {
    const std::string where = prefix + "." + key;
    if (std::find(ModelConfigKeys().begin(), ModelConfigKeys().end(), key) == ModelConfigKeys().end()) {
      return UnknownKey(where, key, ModelConfigKeys());
    }
    if (key == "vocab_size") {
      MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &model.vocab_size));
    } else if (key == "make_vocab_size_divisible_by") {
      MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &model.make_vocab_size_divisible_by));
    } else if (key == "layers") {
      if (!value.is_array() || value.empty()) {
        return Status::Error(where, fmt::format("must be a non-empty list of layer objects, got {}",
                                                DescribeJson(value)));
      }
      for (size_t i = 0; i < value.size(); ++i) {
        LayerConfig layer;
        MPUSIM_RETURN_IF_ERROR(
            ParseLayer(value[i], fmt::format("{}[{}]", where, i), model.layers, &layer));
        model.layers.push_back(std::move(layer));
      }
    }
  }
  if (!section.contains("layers")) {
    return Status::Error(prefix + ".layers",
                         "is required (a non-empty list of layers, e.g. [{\"name\": \"fc1\", "
                         "\"type\": \"ColumnParallelLinear\", ...}])");
  }
  MPUSIM_RETURN_IF_ERROR(CheckChain(model));
  *out = std::move(model);
  return {};
}

Status ParseRunSection(const json& section, RunConfig* out) {
  const std::string prefix = "run";
  if (!section.is_object()) {
    return Status::Error(prefix, fmt::format("must be a JSON object, got {}", DescribeJson(section)));
  }
  RunConfig run;
  for (const auto& [key, value] : section.items()) {
    const std::string where = prefix + "." + key;
    const RunField* field = FindField(RunFields(), key);
    if (field == nullptr) return UnknownKey(where, key, RunConfigKeys());
    MPUSIM_RETURN_IF_ERROR(field->Parse(value, where, &run));
  }
  MPUSIM_RETURN_IF_ERROR(CheckRequired(RunFields(), section, prefix));
  MPUSIM_RETURN_IF_ERROR(CheckRecompute(run));
  *out = run;
  return {};
}

void ToJson(const RunConfig& run, json* out) {
  json j = EchoFields(RunFields(), run);
  // One of the two: a given global batch stands for num_microbatches in every layout.
  j.erase(std::string(run.global_batch_size ? RunKey(&RunConfig::num_microbatches)
                                            : RunKey(&RunConfig::global_batch_size)));
  *out = std::move(j);
}

}  // namespace mpusim
