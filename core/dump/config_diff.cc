// Comparison of two runs' configs (see config_diff.h).
#include "core/dump/config_diff.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>

#include "core/config/gpt_config.h"
#include "core/config/model_config.h"
#include "core/config/optimizer_config.h"
#include "core/config/parallel_config.h"

namespace mpusim {
namespace {

using Json = nlohmann::ordered_json;

void Flatten(const Json& value, const std::string& key, FlatConfig* out) {
  const bool has_containers =
      value.is_array() && std::any_of(value.begin(), value.end(), [](const Json& v) {
        return v.is_object() || v.is_array();
      });
  if (value.is_object() && !value.empty()) {
    for (const auto& [name, child] : value.items()) {
      Flatten(child, key.empty() ? name : key + "." + name, out);
    }
  } else if (has_containers) {
    for (size_t i = 0; i < value.size(); ++i) Flatten(value[i], fmt::format("{}[{}]", key, i), out);
  } else {
    (*out)[key] = value;
  }
}

// Keys of a chain's layer (model.layers[i].<key>) that change tensor names or shapes.
constexpr std::array<std::string_view, 11> kLayerShapeKeys = {
    "name",          "type",         "input_size",     "output_size",
    "embedding_dim", "bias",         "weight_from",    "skip_weight_param_allocation",
    "in_features",   "out_features", "num_embeddings",
};
template <size_t N>
bool Contains(const std::array<std::string_view, N>& keys, std::string_view key) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}
// Layer types that hold the same parameters and compute the same thing, laid out differently:
// torch.nn's modules and Megatron's (a PyTorch plan against Megatron's layers).
constexpr std::array<std::array<std::string_view, 3>, 4> kSameModule = {{
    {"Linear", "ColumnParallelLinear", "RowParallelLinear"},
    {"Embedding", "VocabParallelEmbedding", "ParallelEmbedding"},
    {"GELU", "GeLU", ""},
    {"CrossEntropyLoss", "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy"},
}};
bool SameModule(const Json& a, const Json& b) {
  if (!a.is_string() || !b.is_string()) return false;
  for (const auto& group : kSameModule) {
    if (Contains(group, a.get<std::string>()) && Contains(group, b.get<std::string>())) {
      return !a.get<std::string>().empty();
    }
  }
  return false;
}

// A positive integer of a flattened config, or `fallback` when the key is absent or null;
// nullopt for anything else (the config is untrusted).
std::optional<int64_t> PositiveInt(const FlatConfig& config, const std::string& key,
                                   int64_t fallback) {
  const auto it = config.find(key);
  if (it == config.end() || it->second.is_null()) return fallback;
  const Json& v = it->second;
  if (v.is_number_unsigned() && v.get<uint64_t>() > 0 &&
      v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() > 0) {
    return v.get<int64_t>();
  }
  return std::nullopt;
}

// Samples per micro-batch (micro_batch_size x data-parallel size) and per iteration of a
// run, when its config says them plainly; nullopt otherwise.
std::optional<std::pair<int64_t, int64_t>> Samples(const FlatConfig& config) {
  const auto parallel = [&](auto member, int64_t fallback) {
    return PositiveInt(config, fmt::format("parallel.{}", ParallelKey(member)), fallback);
  };
  const auto run = [&](auto member, int64_t fallback) {
    return PositiveInt(config, fmt::format("run.{}", RunKey(member)), fallback);
  };
  const auto world = parallel(&ParallelConfig::world_size, 1);
  const auto tp = parallel(&ParallelConfig::tensor_model_parallel_size, 1);
  const auto pp = parallel(&ParallelConfig::pipeline_model_parallel_size, 1);
  const auto cp = parallel(&ParallelConfig::context_parallel_size, 1);
  const auto mbs = run(&RunConfig::micro_batch_size, 1);
  const auto microbatches = run(&RunConfig::num_microbatches, 1);
  const auto global = run(&RunConfig::global_batch_size, 0);
  if (!world || !tp || !pp || !cp || !mbs || !microbatches || !global) return std::nullopt;
  int64_t model_parallel = 0;
  int64_t per_microbatch = 0;
  int64_t per_iteration = 0;
  if (__builtin_mul_overflow(*tp, *pp, &model_parallel) ||
      __builtin_mul_overflow(model_parallel, *cp, &model_parallel) ||
      *world % model_parallel != 0 ||
      __builtin_mul_overflow(*mbs, *world / model_parallel, &per_microbatch) ||
      __builtin_mul_overflow(per_microbatch, *microbatches, &per_iteration)) {
    return std::nullopt;
  }
  // A global batch, when given, is the samples per iteration (num_microbatches follows).
  return std::pair{per_microbatch, *global > 0 ? *global : per_iteration};
}

ConfigChange Classify(const std::string& key, bool in_a, bool in_b, const FlatConfig& a,
                      const FlatConfig& b) {
  const size_t dot = key.find('.');
  const std::string_view section = std::string_view(key).substr(0, dot);
  const std::string_view rest =
      dot == std::string::npos ? std::string_view() : std::string_view(key).substr(dot + 1);
  const bool both = in_a && in_b;
  // What the key's declaration says a change of it changes (core/config/field_table.h).
  FieldEffect effect = FieldEffect::kSection;
  if (section == "parallel") {
    if (const auto* f = FindField(ParallelFields(), rest)) effect = f->effect;
    return effect == FieldEffect::kPrecision ? ConfigChange::kDType : ConfigChange::kLayout;
  }
  if (section == "run") {
    if (const auto* f = FindField(RunFields(), rest)) effect = f->effect;
    switch (effect) {
      case FieldEffect::kSeed:
        return ConfigChange::kSeed;
      case FieldEffect::kPrecision:
        return ConfigChange::kDType;
      case FieldEffect::kIterations:
        return ConfigChange::kIterations;
      case FieldEffect::kLayout:
        return ConfigChange::kLayout;
      case FieldEffect::kBatch: {
        // dp 2 with micro_batch_size 1 sees the samples dp 1 with micro_batch_size 2 does.
        const auto samples_a = Samples(a);
        return samples_a && samples_a == Samples(b) ? ConfigChange::kLayout : ConfigChange::kData;
      }
      case FieldEffect::kSection:
      case FieldEffect::kShape:
        break;
    }
    return ConfigChange::kData;
  }
  if (section == "optimizer") {
    // The distributed optimizer, overlaps and buckets lay out the same update.
    const auto* f = FindField(OptimizerFields(), rest);
    return f != nullptr && f->effect == FieldEffect::kLayout ? ConfigChange::kLayout
                                                              : ConfigChange::kTraining;
  }
  if (section == "parallelize_plan") return ConfigChange::kLayout;  // where the pieces live
  if (section != "model") return ConfigChange::kOptions;
  if (rest == "type") return ConfigChange::kModel;  // a GPT against a chain (which has none)
  if (rest.starts_with("layers[")) {
    // A layer one side lacks: the chains differ in length.
    const std::string layer(key.substr(0, key.find(']') + 1));
    if (a.count(layer + ".name") == 0 || b.count(layer + ".name") == 0) {
      return ConfigChange::kModel;
    }
    const std::string_view option = rest.substr(rest.rfind('.') + 1);
    if (both && option == "type" && SameModule(a.at(key), b.at(key))) return ConfigChange::kLayout;
    return both && Contains(kLayerShapeKeys, option) ? ConfigChange::kModel
                                                     : ConfigChange::kOptions;
  }
  // A GPT key (a chain's vocab_size and make_vocab_size_divisible_by are the GPT's too): its
  // declared effect. kShape renames or reshapes tensors (moe_router_topk: how many rows each
  // expert's activations hold), kLayout lays out or runs the same math (attention_backend:
  // the executor computes the same attention whatever it says).
  if (const auto* f = FindField(GptFields(), rest)) effect = f->effect;
  if (effect == FieldEffect::kLayout) return ConfigChange::kLayout;
  return both && effect == FieldEffect::kShape ? ConfigChange::kModel : ConfigChange::kOptions;
}

}  // namespace

FlatConfig FlattenConfig(const Json& config) {
  FlatConfig out;
  if (config.is_object()) Flatten(config, "", &out);
  return out;
}

const char* ConfigChangeName(ConfigChange change) {
  switch (change) {
    case ConfigChange::kModel: return "model";
    case ConfigChange::kLayout: return "layout";
    case ConfigChange::kDType: return "dtype";
    case ConfigChange::kSeed: return "seed";
    case ConfigChange::kData: return "data";
    case ConfigChange::kIterations: return "iterations";
    case ConfigChange::kTraining: return "training";
    case ConfigChange::kOptions: return "options";
  }
  return "options";
}

bool ExpectsDifferences(ConfigChange change) {
  return change != ConfigChange::kModel && change != ConfigChange::kLayout &&
         change != ConfigChange::kDType;
}

std::vector<ConfigDifference> CompareConfigs(const FlatConfig& a, const FlatConfig& b) {
  std::vector<ConfigDifference> out;
  const auto add = [&](const std::string& key, const Json* va, const Json* vb) {
    if (key == "description" || key.starts_with("description.")) return;  // free text
    if (va != nullptr && vb != nullptr && *va == *vb) return;
    ConfigDifference d;
    d.key = key;
    d.in_a = va != nullptr;
    d.in_b = vb != nullptr;
    if (d.in_a) d.a = *va;
    if (d.in_b) d.b = *vb;
    d.change = Classify(key, d.in_a, d.in_b, a, b);
    out.push_back(std::move(d));
  };
  // A merge of the two sorted maps: every key of either, once, in order.
  auto ia = a.begin();
  auto ib = b.begin();
  while (ia != a.end() || ib != b.end()) {
    if (ib == b.end() || (ia != a.end() && ia->first < ib->first)) {
      add(ia->first, &ia->second, nullptr);
      ++ia;
    } else if (ia == a.end() || ib->first < ia->first) {
      add(ib->first, nullptr, &ib->second);
      ++ib;
    } else {
      add(ia->first, &ia->second, &ib->second);
      ++ia;
      ++ib;
    }
  }
  return out;
}

std::string ConfigValueText(const Json& value, bool set) {
  if (!set) return "(not set)";
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace mpusim
