// The GPT model section (see gpt_config.h).
//
// Defaults are TransformerConfig's (megatron/core/transformer/transformer_config.py) and
// GPTModel's; the parameter list follows GPTModel's state dict with the local layer spec
// (get_gpt_layer_local_spec: separate input_layernorm / pre_mlp_layernorm modules).
#include "core/config/gpt_config.h"

#include <algorithm>
#include <cmath>
#include <string_view>
#include <variant>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/config/json_fields.h"
#include "core/config/model_config.h"
#include "core/config/parallel_config.h"

namespace mpusim {
namespace {

using nlohmann::json;

// TransformerConfig fields (megatron/core/transformer/transformer_config.py) a pasted
// Megatron config carries that do not change what mpusim computes, with why; `refused_unless`
// the only value mpusim computes ("" = any value). gated_linear_unit depends on activation
// and is judged in ParseGptSection (json_fields.h AcceptedField).
constexpr std::string_view kFusion =
    "a fused kernel computing the same values; mpusim's kernels are unfused";
constexpr AcceptedField kTransformerFields[] = {
    {"apply_query_key_layer_scaling", "",
     "divides Q K^T by the layer number and the softmax multiplies it back: the same "
     "probabilities (a float16 overflow guard)"},
    {"bias_dropout_fusion", "", kFusion},
    {"masked_softmax_fusion", "", kFusion},
    {"bias_activation_fusion", "", kFusion},
    {"persist_layer_norm", "", kFusion},
    {"memory_efficient_layer_norm", "",
     "recomputes the norm's input in its backward: memory, not values"},
    {"attention_softmax_in_fp32", "true",
     "the softmax runs in the compute dtype, float32 for 16-bit storage"},
    {"apply_residual_connection_post_layernorm", "false",
     "the residual is the norm's input (pre-norm, Megatron-Core's default); the post-norm "
     "residual is not modelled"},
    {"fp32_residual_connection", "false", "the residual stream is kept in run.dtype"},
    {"rotary_interleaved", "false",
     "RoPE pairs channel c with c + d/2 (rotate_half); interleaved pairs are not modelled"},
};

const AcceptedField* FindTransformerField(std::string_view key) {
  return FindAcceptedField(kTransformerFields, key);
}

// gated_linear_unit, once activation is known: a note when it agrees with what mpusim
// computes, else the error naming what to set instead.
Status JudgeDependentFields(const json& section, GptConfig* gpt) {
  if (section.contains("gated_linear_unit")) {
    const json& v = section["gated_linear_unit"];
    if (!v.is_boolean()) {
      return Status::Error("model.gated_linear_unit", fmt::format("must be true or false, got {}",
                                                                  DescribeJson(v)));
    }
    if (v.get<bool>() != IsGated(gpt->activation)) {
      return Status::Error(
          "model.gated_linear_unit",
          fmt::format("{} disagrees with \"activation\": \"{}\"; mpusim names the gate with the "
                      "activation: \"swiglu\" is Megatron's gated_linear_unit true with silu, "
                      "\"gelu\" and \"squared_relu\" are ungated; set \"activation\" and drop "
                      "gated_linear_unit",
                      v.get<bool>(), ActivationName(gpt->activation)));
    }
    gpt->ignored.push_back(fmt::format(
        "model.gated_linear_unit: ignored: the gate follows \"activation\": \"{}\"",
        ActivationName(gpt->activation)));
  }
  return {};
}

const std::vector<std::string_view>& GptKeys() {
  static const std::vector<std::string_view> keys = {
      "type", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
      "kv_channels", "num_query_groups", "normalization", "layernorm_epsilon", "activation",
      "add_bias_linear", "add_qkv_bias", "hidden_dropout", "attention_dropout",
      "position_embedding_type", "rotary_base", "rotary_percent", "qk_layernorm",
      "max_position_embeddings", "share_embeddings_and_output_weights",
      "init_method_std", "vocab_size", "make_vocab_size_divisible_by", "label_smoothing",
      "dropout_mode", "cp_comm_type", "attention_backend", "fp8", "fp8_recipe",
      // Mixture of experts (MoeConfig).
      "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
      "moe_router_pre_softmax", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
      "moe_z_loss_coeff", "moe_token_dispatcher_type", "moe_expert_capacity_factor",
      "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
      "moe_shared_expert_intermediate_size", "moe_grouped_gemm"};
  return keys;
}

// One of `names` (the enum's spellings, in enum order).
template <typename Enum>
Status ParseChoice(const json& value, const std::string& where,
                   const std::vector<std::string_view>& names, Enum* out) {
  if (value.is_string()) {
    const std::string text = value.get<std::string>();
    for (size_t i = 0; i < names.size(); ++i) {
      if (text == names[i]) {
        *out = static_cast<Enum>(i);
        return {};
      }
    }
  }
  std::string allowed;
  for (size_t i = 0; i < names.size(); ++i) {
    allowed += fmt::format("{}\"{}\"", i == 0 ? "" : i + 1 == names.size() ? " or " : ", ", names[i]);
  }
  return Status::Error(where, fmt::format("must be {}, got {}", allowed, DescribeJson(value)));
}

const std::vector<std::string_view> kPositionEmbeddings = {"learned_absolute", "rope"};
const std::vector<std::string_view> kDropoutModes = {"global", "rng_tracker"};
const std::vector<std::string_view> kCpCommTypes = {"p2p", "all_gather", "a2a", "a2a+p2p"};
const std::vector<std::string_view> kAttentionBackends = {"flash", "fused", "unfused", "local",
                                                          "auto"};
const std::vector<std::string_view> kFp8Formats = {"e4m3", "hybrid"};
const std::vector<std::string_view> kFp8Recipes = {"delayed", "tensorwise", "blockwise", "mxfp8"};
const std::vector<std::string_view> kMoeLoadBalancing = {"aux_loss", "seq_aux_loss", "none"};
const std::vector<std::string_view> kMoeDispatchers = {"allgather", "alltoall"};
const std::vector<std::string_view> kMoeDropPolicies = {"probs", "position"};

// A finite number >= 0 (a loss coefficient).
Status ParseCoefficient(const json& value, const std::string& where, double* out) {
  if (value.is_number() && !value.is_boolean() && std::isfinite(value.get<double>()) &&
      value.get<double>() >= 0) {
    *out = value.get<double>();
    return {};
  }
  return Status::Error(where, fmt::format("must be a number >= 0, got {}", DescribeJson(value)));
}

// moe_layer_freq: an integer N >= 1 (layer i is an MoE layer when i % N == 0) or a list of
// 0/1, one per layer (Megatron's pattern). The pattern is resolved once num_layers is known.
Status ParseMoeLayerFreq(const json& value, const std::string& where,
                         std::variant<int64_t, std::vector<bool>>* out) {
  if (value.is_array()) {
    std::vector<bool> pattern;
    for (const json& entry : value) {
      if (!entry.is_number_integer() || (entry.get<int64_t>() != 0 && entry.get<int64_t>() != 1)) {
        return Status::Error(where, fmt::format("a list must hold only 0 (dense) and 1 (MoE), "
                                                "got {}",
                                                DescribeJson(entry)));
      }
      pattern.push_back(entry.get<int64_t>() == 1);
    }
    *out = pattern;
    return {};
  }
  int64_t every = 0;
  if (!ParseInt(value, where, 1, &every).ok()) {
    return Status::Error(where, fmt::format("must be an integer >= 1 (every N-th layer is an MoE "
                                            "layer) or a list of 0/1 per layer, got {}",
                                            DescribeJson(value)));
  }
  *out = every;
  return {};
}

// The moe_* keys once the section is read: defaults resolved against the model, the pattern
// checked against num_layers, and keys that need num_moe_experts refused or noted without it.
Status ResolveMoe(const json& section, const std::optional<int64_t>& moe_ffn,
                  const std::variant<int64_t, std::vector<bool>>& freq, GptConfig* gpt) {
  MoeConfig& moe = gpt->moe;
  if (!moe.enabled()) {
    if (moe_ffn) {
      return Status::Error("model.moe_ffn_hidden_size",
                           "is set but num_moe_experts is not; set num_moe_experts or remove "
                           "moe_ffn_hidden_size");
    }
    for (const auto& [key, value] : section.items()) {
      if (key.rfind("moe_", 0) == 0) {
        gpt->ignored.push_back(
            fmt::format("model.{}: ignored: the model has no experts (num_moe_experts)", key));
      }
    }
    moe = MoeConfig{};
    return {};
  }
  if (moe.router_topk > moe.num_experts) {
    return Status::Error("model.moe_router_topk",
                         fmt::format("{} is more than the num_moe_experts {} a token can be "
                                     "routed to",
                                     moe.router_topk, moe.num_experts));
  }
  moe.ffn_hidden_size = moe_ffn.value_or(gpt->ffn_hidden_size);
  if (const auto* every = std::get_if<int64_t>(&freq)) {
    moe.layers.clear();
    for (int64_t i = 0; i < gpt->num_layers; ++i) moe.layers.push_back(i % *every == 0);
  } else {
    moe.layers = std::get<std::vector<bool>>(freq);
    if (static_cast<int64_t>(moe.layers.size()) != gpt->num_layers) {
      return Status::Error("model.moe_layer_freq",
                           fmt::format("the list has {} entries but the model has num_layers {}; "
                                       "give one 0 (dense) or 1 (MoE) per layer",
                                       moe.layers.size(), gpt->num_layers));
    }
  }
  if (gpt->add_bias_linear) {
    return Status::Error("model.add_bias_linear",
                         "must be false with num_moe_experts (mpusim's experts have no biases; "
                         "Megatron allows them only with expert_tensor_parallel_size 1)");
  }
  if (moe.pad_expert_input_to_capacity && !moe.expert_capacity_factor) {
    return Status::Error("model.moe_pad_expert_input_to_capacity",
                         "needs moe_expert_capacity_factor (the capacity to pad to)");
  }
  return {};
}

}  // namespace

const char* PositionEmbeddingName(PositionEmbedding p) {
  return kPositionEmbeddings[static_cast<size_t>(p)].data();
}
const char* DropoutModeName(DropoutMode m) { return kDropoutModes[static_cast<size_t>(m)].data(); }
const char* CpCommTypeName(CpCommType c) { return kCpCommTypes[static_cast<size_t>(c)].data(); }
const char* AttentionBackendName(AttentionBackend b) {
  return kAttentionBackends[static_cast<size_t>(b)].data();
}
const std::vector<std::string_view>& AttentionBackendNames() { return kAttentionBackends; }
const char* Fp8FormatName(Fp8Format f) { return kFp8Formats[static_cast<size_t>(f)].data(); }
const char* Fp8RecipeName(Fp8Recipe r) { return kFp8Recipes[static_cast<size_t>(r)].data(); }

int64_t GptConfig::PaddedVocabSize(int64_t tensor_model_parallel_size) const {
  const int64_t multiple = make_vocab_size_divisible_by * tensor_model_parallel_size;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

const std::vector<std::string_view>& GptConfigKeys() { return GptKeys(); }

bool IsAcceptedTransformerField(std::string_view key) {
  return key == "gated_linear_unit" || FindTransformerField(key) != nullptr;
}

bool IsGptSection(const json& section) {
  return section.is_object() && section.contains("type");
}

Status ParseGptSection(const json& section, GptConfig* out) {
  const std::string prefix = "model";
  if (!section.is_object()) {
    return Status::Error(prefix, fmt::format("must be a JSON object, got {}", DescribeJson(section)));
  }
  GptConfig gpt;
  std::optional<int64_t> ffn, kv, groups, moe_ffn, moe_experts, shared;
  std::variant<int64_t, std::vector<bool>> moe_freq = int64_t{1};
  for (const auto& [key, value] : section.items()) {
    const std::string where = prefix + "." + key;
    if (key == "gated_linear_unit") continue;  // JudgeDependentFields
    if (const AcceptedField* field = FindTransformerField(key)) {
      MPUSIM_RETURN_IF_ERROR(JudgeAcceptedField(*field, value, where, &gpt.ignored));
      continue;
    }
    if (std::find(GptKeys().begin(), GptKeys().end(), key) == GptKeys().end()) {
      return UnknownKey(where, key, GptKeys());
    }
    if (key == "type") {
      if (value != "gpt") {
        return Status::Error(where, fmt::format("must be \"gpt\" (a layer chain has no \"type\", "
                                                "only \"layers\"), got {}",
                                                DescribeJson(value)));
      }
    } else if (key == "num_layers") {
      MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &gpt.num_layers));
    } else if (key == "hidden_size") {
      MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &gpt.hidden_size));
    } else if (key == "num_attention_heads") {
      MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &gpt.num_attention_heads));
    } else if (key == "ffn_hidden_size") {
      MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &ffn));
    } else if (key == "kv_channels") {
      MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &kv));
    } else if (key == "num_query_groups") {
      MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &groups));
    } else if (key == "normalization") {
      MPUSIM_RETURN_IF_ERROR(ParseChoice(value, where, NormalizationNames(), &gpt.normalization));
    } else if (key == "layernorm_epsilon") {
      MPUSIM_RETURN_IF_ERROR(ParsePositive(value, where, &gpt.layernorm_epsilon));
    } else if (key == "activation") {
      MPUSIM_RETURN_IF_ERROR(ParseChoice(value, where, ActivationNames(), &gpt.activation));
    } else if (key == "add_bias_linear") {
      MPUSIM_RETURN_IF_ERROR(ParseBool(value, where, &gpt.add_bias_linear));
    } else if (key == "add_qkv_bias") {
      MPUSIM_RETURN_IF_ERROR(ParseBool(value, where, &gpt.add_qkv_bias));
    } else if (key == "hidden_dropout") {
      MPUSIM_RETURN_IF_ERROR(ParseFraction(value, where, &gpt.hidden_dropout));
    } else if (key == "attention_dropout") {
      MPUSIM_RETURN_IF_ERROR(ParseFraction(value, where, &gpt.attention_dropout));
    } else if (key == "position_embedding_type") {
      MPUSIM_RETURN_IF_ERROR(
          ParseChoice(value, where, kPositionEmbeddings, &gpt.position_embedding_type));
    } else if (key == "rotary_base") {
      MPUSIM_RETURN_IF_ERROR(ParsePositive(value, where, &gpt.rotary_base));
    } else if (key == "rotary_percent") {
      MPUSIM_RETURN_IF_ERROR(ParsePositive(value, where, &gpt.rotary_percent));
      if (gpt.rotary_percent > 1.0) {
        return Status::Error(where, fmt::format("must be in (0, 1] (the share of each head's "
                                                "channels RoPE turns), got {}",
                                                DescribeJson(value)));
      }
    } else if (key == "qk_layernorm") {
      MPUSIM_RETURN_IF_ERROR(ParseBool(value, where, &gpt.qk_layernorm));
    } else if (key == "max_position_embeddings") {
      MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &gpt.max_position_embeddings));
    } else if (key == "share_embeddings_and_output_weights") {
      MPUSIM_RETURN_IF_ERROR(ParseBool(value, where, &gpt.share_embeddings_and_output_weights));
    } else if (key == "init_method_std") {
      MPUSIM_RETURN_IF_ERROR(ParsePositive(value, where, &gpt.init_method_std));
    } else if (key == "vocab_size") {
      MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &gpt.vocab_size));
    } else if (key == "make_vocab_size_divisible_by") {
      MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &gpt.make_vocab_size_divisible_by));
    } else if (key == "label_smoothing") {
      MPUSIM_RETURN_IF_ERROR(ParseFraction(value, where, &gpt.label_smoothing));
    } else if (key == "dropout_mode") {
      MPUSIM_RETURN_IF_ERROR(ParseChoice(value, where, kDropoutModes, &gpt.dropout_mode));
    } else if (key == "cp_comm_type") {
      MPUSIM_RETURN_IF_ERROR(ParseChoice(value, where, kCpCommTypes, &gpt.cp_comm_type));
    } else if (key == "attention_backend") {
      MPUSIM_RETURN_IF_ERROR(
          ParseChoice(value, where, kAttentionBackends, &gpt.attention_backend));
    } else if (key == "fp8") {
      // null: Megatron's default (no fp8).
      if (!value.is_null()) {
        Fp8Format f{};
        MPUSIM_RETURN_IF_ERROR(ParseChoice(value, where, kFp8Formats, &f));
        gpt.fp8 = f;
      }
    } else if (key == "fp8_recipe") {
      MPUSIM_RETURN_IF_ERROR(ParseChoice(value, where, kFp8Recipes, &gpt.fp8_recipe));
    } else if (key == "num_moe_experts") {
      MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &moe_experts));
      gpt.moe.num_experts = moe_experts.value_or(0);
    } else if (key == "moe_router_topk") {
      MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &gpt.moe.router_topk));
    } else if (key == "moe_ffn_hidden_size") {
      MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &moe_ffn));
    } else if (key == "moe_layer_freq") {
      MPUSIM_RETURN_IF_ERROR(ParseMoeLayerFreq(value, where, &moe_freq));
    } else if (key == "moe_router_pre_softmax") {
      MPUSIM_RETURN_IF_ERROR(ParseBool(value, where, &gpt.moe.router_pre_softmax));
    } else if (key == "moe_router_load_balancing_type") {
      MPUSIM_RETURN_IF_ERROR(ParseChoice(value, where, kMoeLoadBalancing, &gpt.moe.load_balancing));
    } else if (key == "moe_aux_loss_coeff") {
      MPUSIM_RETURN_IF_ERROR(ParseCoefficient(value, where, &gpt.moe.aux_loss_coeff));
    } else if (key == "moe_z_loss_coeff") {
      if (!value.is_null()) {
        double coeff = 0;
        MPUSIM_RETURN_IF_ERROR(ParseCoefficient(value, where, &coeff));
        gpt.moe.z_loss_coeff = coeff;
      }
    } else if (key == "moe_token_dispatcher_type") {
      MPUSIM_RETURN_IF_ERROR(ParseChoice(value, where, kMoeDispatchers, &gpt.moe.token_dispatcher));
    } else if (key == "moe_expert_capacity_factor") {
      if (!value.is_null()) {
        double factor = 0;
        MPUSIM_RETURN_IF_ERROR(ParsePositive(value, where, &factor));
        gpt.moe.expert_capacity_factor = factor;
      }
    } else if (key == "moe_token_drop_policy") {
      MPUSIM_RETURN_IF_ERROR(ParseChoice(value, where, kMoeDropPolicies, &gpt.moe.token_drop_policy));
    } else if (key == "moe_pad_expert_input_to_capacity") {
      MPUSIM_RETURN_IF_ERROR(ParseBool(value, where, &gpt.moe.pad_expert_input_to_capacity));
    } else if (key == "moe_shared_expert_intermediate_size") {
      MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &shared));
      gpt.moe.shared_expert_intermediate_size = shared;
    } else if (key == "moe_grouped_gemm") {
      MPUSIM_RETURN_IF_ERROR(ParseBool(value, where, &gpt.moe.grouped_gemm));
    }
  }
  for (const char* required : {"num_layers", "hidden_size", "num_attention_heads", "vocab_size"}) {
    if (!section.contains(required)) {
      return Status::Error(fmt::format("{}.{}", prefix, required),
                           "is required for \"type\": \"gpt\" (an integer >= 1)");
    }
  }
  MPUSIM_RETURN_IF_ERROR(JudgeDependentFields(section, &gpt));
  // TransformerConfig.__post_init__'s defaults.
  gpt.ffn_hidden_size = ffn.value_or(4 * gpt.hidden_size);
  if (!kv && gpt.hidden_size % gpt.num_attention_heads != 0) {
    return Status::Error(prefix + ".num_attention_heads",
                         fmt::format("hidden_size {} is not divisible by num_attention_heads {}; "
                                     "set kv_channels or choose a divisor",
                                     gpt.hidden_size, gpt.num_attention_heads));
  }
  gpt.kv_channels = kv.value_or(gpt.hidden_size / gpt.num_attention_heads);
  gpt.num_query_groups = groups.value_or(gpt.num_attention_heads);
  if (gpt.num_attention_heads % gpt.num_query_groups != 0) {
    return Status::Error(prefix + ".num_query_groups",
                         fmt::format("num_attention_heads {} is not divisible by "
                                     "num_query_groups {}",
                                     gpt.num_attention_heads, gpt.num_query_groups));
  }
  if (gpt.position_embedding_type == PositionEmbedding::kRope && gpt.kv_channels % 2 != 0) {
    return Status::Error(prefix + ".kv_channels",
                         fmt::format("rope rotates pairs of channels, so kv_channels must be even, "
                                     "got {}",
                                     gpt.kv_channels));
  }
  if (gpt.position_embedding_type == PositionEmbedding::kRope && gpt.rotary_percent < 1.0 &&
      (gpt.RotaryDim() < 2 || gpt.RotaryDim() % 2 != 0)) {
    return Status::Error(prefix + ".rotary_percent",
                         fmt::format("{} of kv_channels {} turns int({} * {}) = {} channels; "
                                     "rope rotates pairs, so that must be even and at least 2",
                                     gpt.rotary_percent, gpt.kv_channels, gpt.kv_channels,
                                     gpt.rotary_percent, gpt.RotaryDim()));
  }
  if (gpt.position_embedding_type != PositionEmbedding::kRope && section.contains("rotary_percent")) {
    gpt.ignored.push_back(
        "model.rotary_percent: ignored: position_embedding_type is not \"rope\"");
  }
  if (!gpt.fp8 && section.contains("fp8_recipe")) {
    gpt.ignored.push_back("model.fp8_recipe: ignored: fp8 is null");
  }
  if (gpt.label_smoothing > 0 && gpt.vocab_size < 2) {
    return Status::Error(prefix + ".label_smoothing", "needs a vocab_size of at least 2");
  }
  MPUSIM_RETURN_IF_ERROR(ResolveMoe(section, moe_ffn, moe_freq, &gpt));
  *out = gpt;
  return {};
}

Status CheckGptLayout(const ParallelConfig& parallel, const RunConfig& run, GptConfig* gpt) {
  const int64_t t = parallel.tensor_model_parallel_size;
  const auto divisible = [&](const char* field, int64_t value) -> Status {
    if (value % t == 0) return {};
    return Status::Error(fmt::format("model.{}", field),
                         fmt::format("{} is not divisible by tensor_model_parallel_size {}", value, t));
  };
  MPUSIM_RETURN_IF_ERROR(divisible("num_attention_heads", gpt->num_attention_heads));
  MPUSIM_RETURN_IF_ERROR(divisible("num_query_groups", gpt->num_query_groups));
  MPUSIM_RETURN_IF_ERROR(divisible("ffn_hidden_size", gpt->ffn_hidden_size));
  if (parallel.sequence_parallel && run.seq_length % t != 0) {
    return Status::Error("run.seq_length",
                         fmt::format("{} is not divisible by tensor_model_parallel_size {} "
                                     "(sequence_parallel splits the sequence over tp)",
                                     run.seq_length, t));
  }
  if (gpt->max_position_embeddings == 0) gpt->max_position_embeddings = run.seq_length;
  if (gpt->has_position_embeddings() && gpt->max_position_embeddings < run.seq_length) {
    return Status::Error("model.max_position_embeddings",
                         fmt::format("{} is shorter than run.seq_length {}",
                                     gpt->max_position_embeddings, run.seq_length));
  }
  const int64_t ep = parallel.expert_model_parallel_size;
  if (ep != 1 && !gpt->moe.enabled()) {
    return Status::Error("parallel.expert_model_parallel_size",
                         fmt::format("{} splits experts, but the model has none; set "
                                     "num_moe_experts or expert_model_parallel_size 1",
                                     ep));
  }
  if (gpt->moe.enabled()) {
    if (gpt->moe.num_experts % ep != 0) {
      return Status::Error("parallel.expert_model_parallel_size",
                           fmt::format("num_moe_experts {} is not divisible by "
                                       "expert_model_parallel_size {} (each ep rank holds "
                                       "num_moe_experts / ep experts)",
                                       gpt->moe.num_experts, ep));
    }
    const int64_t etp = parallel.EffectiveExpertTensorParallelSize();
    if (gpt->moe.ffn_hidden_size % etp != 0) {
      return Status::Error("model.moe_ffn_hidden_size",
                           fmt::format("{} is not divisible by expert_tensor_parallel_size {} "
                                       "(each expert's fc1 and fc2 are split over expt_tp)",
                                       gpt->moe.ffn_hidden_size, etp));
    }
    if (const auto shared = gpt->moe.shared_expert_intermediate_size; shared && *shared % t != 0) {
      MPUSIM_RETURN_IF_ERROR(divisible("moe_shared_expert_intermediate_size", *shared));
    }
    if (t > 1 && !parallel.sequence_parallel) {
      return Status::Error("parallel.sequence_parallel",
                           fmt::format("must be true for a mixture-of-experts model with "
                                       "tensor_model_parallel_size {} (Megatron's rule: each "
                                       "tp rank's router sees its own sequence shard)",
                                       t));
    }
  }
  // Megatron's checks of the combined 1F1B schedule that need the model and the run
  // (TransformerConfig.__post_init__, in its order; the layout's are the parallel section's).
  if (parallel.overlap_moe_expert_parallel_comm) {
    const std::string field = "parallel.overlap_moe_expert_parallel_comm";
    if (!gpt->moe.enabled()) {
      return Status::Error(field, "needs a mixture-of-experts model (num_moe_experts)");
    }
    if (gpt->moe.token_dispatcher != MoeDispatcher::kAllToAll) {
      return Status::Error(field, "needs model.moe_token_dispatcher_type \"alltoall\" (Megatron "
                                  "also takes \"flex\"), got \"allgather\"");
    }
    if (run.recompute == RunConfig::Recompute::kFull) {
      return Status::Error(field, "cannot run with run.recompute_granularity \"full\" "
                                  "(Megatron's rule); use null or \"selective\"");
    }
    if (run.dtype != DType::kBFloat16 && run.dtype != DType::kFloat16) {
      return Status::Error(field, fmt::format("needs a bfloat16 or float16 run (Megatron's "
                                              "rule), got run.dtype {}",
                                              DTypeName(run.dtype)));
    }
  }
  const int64_t cp = parallel.context_parallel_size;
  if (cp > 1) {
    if (gpt->cp_comm_type == CpCommType::kA2aP2p) {
      const std::vector<int64_t>& hcp = parallel.hierarchical_context_parallel_sizes;
      if (hcp.size() != 2) {
        return Status::Error(
            "model.cp_comm_type",
            fmt::format("\"a2a+p2p\" needs parallel.hierarchical_context_parallel_sizes "
                        "[a2a size, p2p size] (two levels multiplying to "
                        "context_parallel_size {}), got {} level{}",
                        cp, hcp.size(), hcp.size() == 1 ? "" : "s"));
      }
      if (gpt->num_query_groups % (t * hcp[0]) != 0) {
        return Status::Error(
            "model.cp_comm_type",
            fmt::format("\"a2a+p2p\" gives each rank 1/{} of its tp rank's heads, so "
                        "num_query_groups {} must be divisible by tensor_model_parallel_size * "
                        "hierarchical_context_parallel_sizes[0] = {}",
                        hcp[0], gpt->num_query_groups, t * hcp[0]));
      }
      if (gpt->dropout_mode == DropoutMode::kRngTracker && gpt->attention_dropout > 0) {
        return Status::Error(
            "model.dropout_mode",
            "\"rng_tracker\" with attention_dropout and cp_comm_type \"a2a+p2p\" is not built "
            "yet (its masks' local indices); set dropout_mode \"global\" or another "
            "cp_comm_type");
      }
    }
    if (gpt->cp_comm_type == CpCommType::kA2a && gpt->num_query_groups % (t * cp) != 0) {
      return Status::Error(
          "model.cp_comm_type",
          fmt::format("\"a2a\" gives each cp rank 1/cp of its tp rank's heads, so "
                      "num_query_groups {} must be divisible by tensor_model_parallel_size * "
                      "context_parallel_size = {}; set \"p2p\" or \"all_gather\", or another "
                      "layout",
                      gpt->num_query_groups, t * cp));
    }
    if (run.seq_length % (2 * cp) != 0) {
      return Status::Error("run.seq_length",
                           fmt::format("{} is not divisible by 2 * context_parallel_size = {} "
                                       "(each cp rank holds two of 2 * cp equal chunks)",
                                       run.seq_length, 2 * cp));
    }
    if (parallel.sequence_parallel && (run.seq_length / cp) % t != 0) {
      return Status::Error("run.seq_length",
                           fmt::format("{} / context_parallel_size {} = {} is not divisible by "
                                       "tensor_model_parallel_size {} (sequence_parallel splits "
                                       "each cp rank's tokens over tp)",
                                       run.seq_length, cp, run.seq_length / cp, t));
    }
  }
  return {};
}

std::vector<GptParameter> GptParameters(const GptConfig& gpt, int64_t padded_vocab_size,
                                        bool sequence_parallel,
                                        const std::function<bool(int64_t)>& keep_layer,
                                        const std::function<bool(int64_t)>& keep_expert) {
  const int64_t h = gpt.hidden_size;
  const InitSpec normal{InitMethod::kNormal, gpt.init_method_std};
  // Megatron's scaled_init_method_normal: the projections into the residual stream.
  const InitSpec scaled{InitMethod::kNormal,
                        gpt.init_method_std / std::sqrt(2.0 * static_cast<double>(gpt.num_layers))};
  const InitSpec zeros{InitMethod::kZeros, 0.0};
  const InitSpec ones{InitMethod::kOnes, 0.0};
  std::vector<GptParameter> params;
  const auto add = [&](std::string name, Shape shape, InitSpec init, int tp_dim,
                       int64_t stride = 1, bool seq_par = false) {
    params.push_back(GptParameter{std::move(name), std::move(shape), init, tp_dim, stride,
                                  seq_par && sequence_parallel});
  };
  const auto norm = [&](const std::string& prefix) {
    add(prefix + ".weight", {h}, ones, -1, 1, true);
    if (IsCentered(gpt.normalization)) add(prefix + ".bias", {h}, zeros, -1, 1, true);
  };
  add("embedding.word_embeddings.weight", {padded_vocab_size, h}, normal, 0);
  if (gpt.has_position_embeddings()) {
    add("embedding.position_embeddings.weight", {gpt.max_position_embeddings, h}, normal, -1);
  }
  const int64_t stride_fc1 = IsGated(gpt.activation) ? 2 : 1;
  const int64_t attn_width = gpt.num_attention_heads * gpt.kv_channels;
  for (int64_t i = 0; i < gpt.num_layers; ++i) {
    if (keep_layer && !keep_layer(i)) continue;
    const std::string layer = fmt::format("decoder.layers.{}", i);
    norm(layer + ".input_layernorm");
    add(layer + ".self_attention.linear_qkv.weight", {gpt.QkvRows(), h}, normal, 0);
    if (gpt.add_bias_linear || gpt.add_qkv_bias) {
      add(layer + ".self_attention.linear_qkv.bias", {gpt.QkvRows()}, zeros, 0);
    }
    if (gpt.qk_layernorm) {
      // Megatron's q_layernorm / k_layernorm: the model's normalization over kv_channels,
      // one set shared by every head; each tp rank sums its own heads' gradient.
      for (const char* which : {".self_attention.q_layernorm", ".self_attention.k_layernorm"}) {
        const std::string prefix = layer + which;
        params.push_back(GptParameter{prefix + ".weight", {gpt.kv_channels}, ones, -1, 1, true});
        if (IsCentered(gpt.normalization)) {
          params.push_back(GptParameter{prefix + ".bias", {gpt.kv_channels}, zeros, -1, 1, true});
        }
      }
    }
    add(layer + ".self_attention.linear_proj.weight", {h, attn_width}, scaled, 1);
    if (gpt.add_bias_linear) add(layer + ".self_attention.linear_proj.bias", {h}, zeros, -1, 1, true);
    norm(layer + ".pre_mlp_layernorm");
    if (gpt.moe.enabled() && gpt.moe.layers[static_cast<size_t>(i)]) {
      // MoELayer: the router (replicated; fed by the sequence-split stream under sequence
      // parallelism), the experts under their global numbers (SequentialMLP's
      // local_experts.<e>, or the grouped GEMM's linear_fc1.weight<e>), the shared expert.
      add(layer + ".mlp.router.weight", {gpt.moe.num_experts, h}, normal, -1, 1, true);
      const int64_t f = gpt.moe.ffn_hidden_size, f1 = IsGated(gpt.activation) ? 2 * f : f;
      for (int64_t e = 0; e < gpt.moe.num_experts; ++e) {
        if (keep_expert && !keep_expert(e)) continue;
        const std::string fc1 = MoeExpertWeightName(gpt.moe, layer + ".mlp", e, 1);
        const std::string fc2 = MoeExpertWeightName(gpt.moe, layer + ".mlp", e, 2);
        add(fc1, {f1, h}, normal, 0, stride_fc1);
        add(fc2, {h, f}, scaled, 1);
      }
      if (const auto shared = gpt.moe.shared_expert_intermediate_size) {
        const int64_t s1 = IsGated(gpt.activation) ? 2 * *shared : *shared;
        add(layer + ".mlp.shared_experts.linear_fc1.weight", {s1, h}, normal, 0, stride_fc1);
        add(layer + ".mlp.shared_experts.linear_fc2.weight", {h, *shared}, scaled, 1);
      }
      continue;
    }
    add(layer + ".mlp.linear_fc1.weight", {gpt.Fc1Rows(), h}, normal, 0, stride_fc1);
    if (gpt.add_bias_linear) add(layer + ".mlp.linear_fc1.bias", {gpt.Fc1Rows()}, zeros, 0, stride_fc1);
    add(layer + ".mlp.linear_fc2.weight", {h, gpt.ffn_hidden_size}, scaled, 1);
    if (gpt.add_bias_linear) add(layer + ".mlp.linear_fc2.bias", {h}, zeros, -1, 1, true);
  }
  norm("decoder.final_layernorm");
  if (!gpt.share_embeddings_and_output_weights) {
    add("output_layer.weight", {padded_vocab_size, h}, normal, 0);
  }
  return params;
}

std::string MoeExpertWeightName(const MoeConfig& moe, const std::string& mlp_prefix, int64_t e,
                                int fc) {
  return moe.grouped_gemm ? fmt::format("{}.experts.linear_fc{}.weight{}", mlp_prefix, fc, e)
                          : fmt::format("{}.experts.local_experts.{}.linear_fc{}.weight",
                                        mlp_prefix, e, fc);
}

}  // namespace mpusim
