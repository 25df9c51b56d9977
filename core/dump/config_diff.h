// What two runs' configs differ in: `mpusim diff` says it before it compares tensors.
//
// What it is: a key-by-key comparison of two effective configs (the manifest's "config": the
// file with the command line's overrides, parallel and run sections with their defaults
// written in; core/config/config.h EffectiveConfigJson), each difference named by its dotted
// key ("run.seed", "model.layers[2].output_size") and classified by what it means for the
// comparison of tensors. The configs come from dumps, so they are untrusted: any JSON is
// taken, and a value of an unexpected type is only a difference like any other.
// What it is not: a config validator (core/config) or the tensor comparison (diff.h).
//
// Classes (ConfigChange), by the key:
//   model      the tensors' names or shapes differ: the dumps hold different models, and diff
//              refuses them. The shape keys of model.* (model.num_layers, hidden_size,
//              ffn_hidden_size, num_attention_heads, kv_channels, num_query_groups, vocab_size,
//              normalization, activation, add_bias_linear, add_qkv_bias, qk_layernorm,
//              position_embedding_type, max_position_embeddings,
//              share_embeddings_and_output_weights, the MoE sizes and layer pattern, type) and a
//              chain's layer list (its length; a layer's name, type, sizes, bias and the
//              layers it borrows from), when both configs set the key. A key one config
//              leaves to its default is "options": the default may be the other's value
//              (ffn_hidden_size is 4 * hidden_size unless given).
//   layout     parallel.* but the precision switches, model.cp_comm_type,
//              model.moe_token_dispatcher_type and model.attention_backend (the executor
//              computes the same attention whatever it says), run.recompute_* (granularity,
//              method, num_layers, modules), and the batch keys
//              (run.micro_batch_size, num_microbatches, global_batch_size) when both runs
//              still see the same samples per micro-batch (micro_batch_size x dp) and per
//              iteration: diff reassembles tensors across layouts.
//   dtype      parallel.fp16, bf16, params_dtype and run.dtype: each tensor is judged at the
//              less precise dtype.
//   seed       run.seed.
//   data       run.seq_length, and the batch keys when the samples differ.
//   iterations run.train_iters.
//   training   optimizer.*.
//   options    every other model.* key (init_method_std, dropout, label smoothing,
//              make_vocab_size_divisible_by, ...): the same tensors with other values.
// "description" is free text and not compared. Seed, data, iterations, training and options
// differences mean the tensors are expected to differ.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace mpusim {

// A config flattened to its leaves: dotted key -> value (objects open into "a.b", arrays of
// objects or arrays into "a[0]"; an array of plain values is one leaf).
using FlatConfig = std::map<std::string, nlohmann::ordered_json>;
FlatConfig FlattenConfig(const nlohmann::ordered_json& config);

enum class ConfigChange : uint8_t {
  kModel,
  kLayout,
  kDType,
  kSeed,
  kData,
  kIterations,
  kTraining,
  kOptions,
};
const char* ConfigChangeName(ConfigChange change);  // "model", "layout", ...
// True for the classes after which tensors are expected to differ.
bool ExpectsDifferences(ConfigChange change);

struct ConfigDifference {
  std::string key;           // "run.seed"
  nlohmann::ordered_json a;  // the value in A (null when !in_a)
  nlohmann::ordered_json b;
  bool in_a = true;  // false: A's config does not set the key
  bool in_b = true;
  ConfigChange change = ConfigChange::kOptions;
};

// The differences in key order. Model differences decide whether the dumps can be compared.
std::vector<ConfigDifference> CompareConfigs(const FlatConfig& a, const FlatConfig& b);

// A value as the text report shows it: its JSON text, "(not set)" when absent.
std::string ConfigValueText(const nlohmann::ordered_json& value, bool set);

}  // namespace mpusim
