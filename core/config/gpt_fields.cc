// The GPT model section's field table (see gpt_config.h): each key of `"model": {"type":
// "gpt", ...}` declared once, with TransformerConfig's name and default, how it is read, its
// one-line meaning and what a change of it changes. ParseGptSection (gpt_config.cc) reads
// through it, GptConfigKeys() lists it, `mpusim diff` classifies by it and the README's
// `model` key table is checked against it (tests/readme).
//
// Values a key may be given as that are no plain member: an enum spelled as strings
// (Choice), a size whose default is resolved from other keys once the section is read
// (ResolvedSize: 0 until then, echoed as null), a nullable number or enum, and the moe_* keys,
// which live in GptConfig::moe (InnerMember, or a path of members).
#include "core/config/gpt_config.h"

#include <cmath>
#include <string_view>
#include <variant>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/config/field_table.h"
#include "core/config/json_fields.h"

namespace mpusim {
namespace {

using nlohmann::json;
using GptField = Field<GptConfig>;

const std::vector<std::string_view>& PositionEmbeddingNames() {
  static const std::vector<std::string_view> kNames = {"learned_absolute", "rope"};
  return kNames;
}
const std::vector<std::string_view>& DropoutModeNames() {
  static const std::vector<std::string_view> kNames = {"global", "rng_tracker"};
  return kNames;
}
const std::vector<std::string_view>& CpCommTypeNames() {
  static const std::vector<std::string_view> kNames = {"p2p", "all_gather", "a2a", "a2a+p2p"};
  return kNames;
}
const std::vector<std::string_view>& Fp8FormatNames() {
  static const std::vector<std::string_view> kNames = {"e4m3", "hybrid"};
  return kNames;
}
const std::vector<std::string_view>& Fp8RecipeNames() {
  static const std::vector<std::string_view> kNames = {"delayed", "tensorwise", "blockwise",
                                                       "mxfp8"};
  return kNames;
}
const std::vector<std::string_view>& MoeLoadBalancingNames() {
  static const std::vector<std::string_view> kNames = {"aux_loss", "seq_aux_loss",
                                                       "global_aux_loss", "none"};
  return kNames;
}
const std::vector<std::string_view>& MoeDispatcherNames() {
  static const std::vector<std::string_view> kNames = {"allgather", "alltoall"};
  return kNames;
}
const std::vector<std::string_view>& MoeDropPolicyNames() {
  static const std::vector<std::string_view> kNames = {"probs", "position"};
  return kNames;
}
const std::vector<std::string_view>& MlaRopeTypeNames() {
  static const std::vector<std::string_view> kNames = {"rope", "yarn"};
  return kNames;
}
const std::vector<std::string_view>& MoeRouterDTypeNames() {
  static const std::vector<std::string_view> kNames = {"fp32", "fp64"};
  return kNames;
}
const std::vector<std::string_view>& MoeScoreFunctionNames() {
  static const std::vector<std::string_view> kNames = {"softmax", "sigmoid", "sqrtsoftplus"};
  return kNames;
}
const std::vector<std::string_view>& SoftmaxTypeNames() {
  static const std::vector<std::string_view> kNames = {"vanilla", "off-by-one", "learnable"};
  return kNames;
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
    const char* separator = i == 0 ? "" : i + 1 == names.size() ? " or " : ", ";
    allowed += fmt::format("{}\"{}\"", separator, names[i]);
  }
  return Status::Error(where, fmt::format("must be {}, got {}", allowed, DescribeJson(value)));
}

// A finite number >= 0 (a loss coefficient).
Status ParseCoefficient(const json& value, const std::string& where, double* out) {
  if (value.is_number() && !value.is_boolean() && std::isfinite(value.get<double>()) &&
      value.get<double>() >= 0) {
    *out = value.get<double>();
    return {};
  }
  return Status::Error(where, fmt::format("must be a number >= 0, got {}", DescribeJson(value)));
}

// Any finite number (glu_linear_offset).
Status ParseFiniteNumber(const json& value, const std::string& where, double* out) {
  if (value.is_number() && !value.is_boolean() && std::isfinite(value.get<double>())) {
    *out = value.get<double>();
    return {};
  }
  return Status::Error(where, fmt::format("must be a finite number, got {}", DescribeJson(value)));
}

// An enum member (at the member path kPath) spelled as one of kNames().
template <auto kNames, auto... kPath>
constexpr Codec<GptConfig> Choice() {
  return {FieldKind::kText,
          [](const json& value, const std::string& where, GptConfig* gpt) {
            return ParseChoice(value, where, kNames(), &MemberAt<kPath...>(*gpt));
          },
          [](const GptConfig& gpt) {
            return json(kNames()[static_cast<size_t>(MemberAt<kPath...>(gpt))]);
          }};
}

// An optional enum: null (Megatron's None, the default) or one of kNames().
template <auto kNames, auto... kPath>
constexpr Codec<GptConfig> NullableChoice() {
  return {FieldKind::kText,
          [](const json& value, const std::string& where, GptConfig* gpt) {
            auto& member = MemberAt<kPath...>(*gpt);
            if (value.is_null()) {
              member.reset();
              return Status();
            }
            typename std::remove_reference_t<decltype(member)>::value_type choice{};
            MPUSIM_RETURN_IF_ERROR(ParseChoice(value, where, kNames(), &choice));
            member = choice;
            return Status();
          },
          [](const GptConfig& gpt) {
            const auto& member = MemberAt<kPath...>(gpt);
            return member ? json(kNames()[static_cast<size_t>(*member)]) : json(nullptr);
          }};
}

// A size Megatron defaults to None and resolves from other keys once the section is read
// (TransformerConfig.__post_init__): null or absent leaves 0 here for ParseGptSection to
// resolve, and the echo writes an unresolved 0 as null.
template <auto... kPath>
constexpr Codec<GptConfig> ResolvedSize() {
  return {FieldKind::kInt,
          [](const json& value, const std::string& where, GptConfig* gpt) {
            std::optional<int64_t> size;
            MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &size));
            MemberAt<kPath...>(*gpt) = size.value_or(0);
            return Status();
          },
          [](const GptConfig& gpt) {
            const int64_t size = MemberAt<kPath...>(gpt);
            return size == 0 ? json(nullptr) : json(size);
          }};
}

// A loss coefficient (a finite number >= 0).
template <auto... kPath>
constexpr Codec<GptConfig> Coefficient() {
  return {FieldKind::kNumber,
          [](const json& value, const std::string& where, GptConfig* gpt) {
            return ParseCoefficient(value, where, &MemberAt<kPath...>(*gpt));
          },
          [](const GptConfig& gpt) { return json(MemberAt<kPath...>(gpt)); }};
}

// null (Megatron's None, the default) or a number `kParse` reads.
template <auto kParse, auto... kPath>
constexpr Codec<GptConfig> NullableNumber() {
  return {FieldKind::kNumber,
          [](const json& value, const std::string& where, GptConfig* gpt) {
            std::optional<double>& member = MemberAt<kPath...>(*gpt);
            if (value.is_null()) {
              member.reset();
              return Status();
            }
            double number = 0;
            MPUSIM_RETURN_IF_ERROR(kParse(value, where, &number));
            member = number;
            return Status();
          },
          [](const GptConfig& gpt) {
            const std::optional<double>& member = MemberAt<kPath...>(gpt);
            return member ? json(*member) : json(nullptr);
          }};
}

// A per-layer pattern as Megatron takes it: an integer N >= 1 or a list of 0/1, one per layer
// (its length is checked once num_layers is known). `list_rule` says what a list may hold and
// `rule` what the value may be, for the error lines.
Status ParseLayerPattern(const json& value, const std::string& where, std::string_view list_rule,
                         std::string_view rule, std::variant<int64_t, std::vector<bool>>* out) {
  if (value.is_array()) {
    std::vector<bool> pattern;
    for (const json& entry : value) {
      if (!entry.is_number_integer() || (entry.get<int64_t>() != 0 && entry.get<int64_t>() != 1)) {
        return Status::Error(
            where, fmt::format("a list must hold only {}, got {}", list_rule, DescribeJson(entry)));
      }
      pattern.push_back(entry.get<int64_t>() == 1);
    }
    *out = pattern;
    return {};
  }
  int64_t every = 0;
  if (!ParseInt(value, where, 1, &every).ok()) {
    return Status::Error(where, fmt::format("must be {}, got {}", rule, DescribeJson(value)));
  }
  *out = every;
  return {};
}

// moe_layer_freq: an integer N >= 1 (layer i is an MoE layer when i % N == 0) or a list of
// 0/1, one per layer (Megatron's pattern).
Status ParseMoeLayerFreq(const json& value, const std::string& where, GptConfig* gpt) {
  return ParseLayerPattern(value, where, "0 (dense) and 1 (MoE)",
                           "an integer >= 1 (every N-th layer is an MoE layer) or a list of 0/1 "
                           "per layer",
                           &gpt->moe.layer_freq);
}

json EchoMoeLayerFreq(const GptConfig& gpt) {
  const std::variant<int64_t, std::vector<bool>>& freq = gpt.moe.layer_freq;
  if (const auto* every = std::get_if<int64_t>(&freq)) return *every;
  json pattern = json::array();
  for (bool moe : std::get<std::vector<bool>>(freq)) pattern.push_back(moe ? 1 : 0);
  return pattern;
}

// window_size: null (no sliding window) or [left, right], each an integer >= -1 (-1: no
// limit on that side). The causal rule on right is ParseGptSection's.
Status ParseWindowSize(const json& value, const std::string& where, GptConfig* gpt) {
  if (value.is_null()) {
    gpt->window_size.reset();
    return {};
  }
  if (value.is_array() && value.size() == 2 && value[0].is_number_integer() &&
      value[1].is_number_integer() && value[0].get<int64_t>() >= -1 &&
      value[1].get<int64_t>() >= -1) {
    gpt->window_size = std::array<int64_t, 2>{value[0].get<int64_t>(), value[1].get<int64_t>()};
    return {};
  }
  return Status::Error(where, fmt::format("must be null or [left, right], two integers >= -1 "
                                          "(-1: unlimited), got {}",
                                          DescribeJson(value)));
}

json EchoWindowSize(const GptConfig& gpt) {
  if (!gpt.window_size) return nullptr;
  return json::array({(*gpt.window_size)[0], (*gpt.window_size)[1]});
}

// window_attn_skip_freq: null, an integer N >= 1 (every N-th layer full attention) or a list
// of 0/1 per layer (1: a sliding-window layer).
Status ParseWindowSkipFreq(const json& value, const std::string& where, GptConfig* gpt) {
  if (value.is_null()) {
    gpt->window_attn_skip_freq.reset();
    return {};
  }
  std::variant<int64_t, std::vector<bool>> pattern;
  MPUSIM_RETURN_IF_ERROR(ParseLayerPattern(
      value, where, "1 (sliding window) and 0 (full attention)",
      "null, an integer >= 1 (every N-th layer has full attention) or a list of 0/1 per layer "
      "(1: sliding window)",
      &pattern));
  gpt->window_attn_skip_freq = std::move(pattern);
  return {};
}

json EchoWindowSkipFreq(const GptConfig& gpt) {
  if (!gpt.window_attn_skip_freq) return nullptr;
  if (const auto* every = std::get_if<int64_t>(&*gpt.window_attn_skip_freq)) return *every;
  json pattern = json::array();
  for (bool slides : std::get<std::vector<bool>>(*gpt.window_attn_skip_freq)) {
    pattern.push_back(slides ? 1 : 0);
  }
  return pattern;
}

// moe_router_load_balancing_type: one type, or a non-empty list of distinct types (Megatron's
// list form, each weighted by the coefficient at its position in moe_aux_loss_coeff).
Status ParseLoadBalancing(const json& value, const std::string& where, GptConfig* gpt) {
  MoeConfig& moe = gpt->moe;
  moe.load_balancing_list.clear();
  if (!value.is_array()) {
    return ParseChoice(value, where, MoeLoadBalancingNames(), &moe.load_balancing);
  }
  if (value.empty()) {
    return Status::Error(where, "must be a type or a non-empty list of types, got []");
  }
  for (size_t i = 0; i < value.size(); ++i) {
    MoeLoadBalancing type{};
    MPUSIM_RETURN_IF_ERROR(
        ParseChoice(value[i], fmt::format("{}[{}]", where, i), MoeLoadBalancingNames(), &type));
    for (MoeLoadBalancing listed : moe.load_balancing_list) {
      if (listed != type) continue;
      return Status::Error(where, fmt::format("lists \"{}\" twice (Megatron would weight it by "
                                              "its first coefficient only)",
                                              MoeLoadBalancingName(type)));
    }
    moe.load_balancing_list.push_back(type);
  }
  return {};
}

json EchoLoadBalancing(const GptConfig& gpt) {
  if (gpt.moe.load_balancing_list.empty()) return MoeLoadBalancingName(gpt.moe.load_balancing);
  json types = json::array();
  for (MoeLoadBalancing type : gpt.moe.load_balancing_list) {
    types.push_back(MoeLoadBalancingName(type));
  }
  return types;
}

// moe_aux_loss_coeff: a number >= 0, or a list of them (with a list of types).
Status ParseAuxLossCoeff(const json& value, const std::string& where, GptConfig* gpt) {
  MoeConfig& moe = gpt->moe;
  moe.aux_loss_coeff_list.clear();
  if (!value.is_array()) return ParseCoefficient(value, where, &moe.aux_loss_coeff);
  for (size_t i = 0; i < value.size(); ++i) {
    double coeff = 0;
    MPUSIM_RETURN_IF_ERROR(ParseCoefficient(value[i], fmt::format("{}[{}]", where, i), &coeff));
    moe.aux_loss_coeff_list.push_back(coeff);
  }
  if (moe.aux_loss_coeff_list.empty()) {
    return Status::Error(where, "must be a number >= 0 or a non-empty list of them, got []");
  }
  return {};
}

json EchoAuxLossCoeff(const GptConfig& gpt) {
  if (gpt.moe.aux_loss_coeff_list.empty()) return gpt.moe.aux_loss_coeff;
  return gpt.moe.aux_loss_coeff_list;
}

constexpr std::string_view kRequired = "an integer >= 1";
constexpr FieldEffect kShape = FieldEffect::kShape;

// The section's keys, in documentation order (the README's table and the unknown-key error's
// list follow it). `effect`: kShape when a change renames or reshapes tensors (another model),
// kLayout when the same math is laid out or run differently, else the section's default
// (options).
constexpr GptField kFields[] = {
    {.key = "type",
     .target = Codec<GptConfig>{FieldKind::kText,
                                [](const json& value, const std::string& where, GptConfig*) {
                                  if (value != "gpt") {
                                    return Status::Error(
                                        where, fmt::format("must be \"gpt\" (a layer chain has no "
                                                           "\"type\", only \"layers\"), got {}",
                                                           DescribeJson(value)));
                                  }
                                  return Status();
                                },
                                [](const GptConfig&) { return json("gpt"); }},
     .help = "the GPT model (Megatron-Core GPTModel); a model without it is a layer chain",
     .effect = kShape},
    {.key = "num_layers",
     .target = &GptConfig::num_layers,
     .help = "transformer layers",
     .effect = kShape,
     .required = kRequired},
    {.key = "hidden_size",
     .target = &GptConfig::hidden_size,
     .help = "h, the width of the residual stream",
     .effect = kShape,
     .required = kRequired},
    {.key = "num_attention_heads",
     .target = &GptConfig::num_attention_heads,
     .help = "query heads",
     .effect = kShape,
     .required = kRequired},
    {.key = "ffn_hidden_size",
     .target = ResolvedSize<&GptConfig::ffn_hidden_size>(),
     .help = "the MLP's hidden width",
     .effect = kShape,
     .absent = "4 * hidden_size"},
    {.key = "kv_channels",
     .target = ResolvedSize<&GptConfig::kv_channels>(),
     .help = "channels per head",
     .effect = kShape,
     .absent = "hidden_size / num_attention_heads"},
    {.key = "num_query_groups",
     .target = ResolvedSize<&GptConfig::num_query_groups>(),
     .help = "key/value heads; fewer than the query heads is grouped-query attention (must "
             "divide num_attention_heads)",
     .effect = kShape,
     .absent = "num_attention_heads"},
    {.key = "normalization",
     .target = Choice<&NormalizationNames, &GptConfig::normalization>(),
     .help = "\"LayerNorm\" or \"RMSNorm\"",
     .effect = kShape},
    {"layernorm_epsilon", &GptConfig::layernorm_epsilon, "the norms' epsilon"},
    {.key = "activation",
     .target = Choice<&ActivationNames, &GptConfig::activation>(),
     .help = "the MLP's activation: \"gelu\", \"swiglu\" (gated: fc1 has 2 * ffn_hidden_size "
             "rows), \"squared_relu\" (relu(x)^2) or \"quick_geglu\" (gated quick_gelu, "
             "x sigmoid(1.702 x): Megatron's activation_func quick_gelu with gated_linear_unit)",
     .effect = kShape},
    {.key = "glu_linear_offset",
     .target = Codec<GptConfig>{FieldKind::kNumber,
                                [](const json& value, const std::string& where, GptConfig* gpt) {
                                  return ParseFiniteNumber(value, where, &gpt->glu_linear_offset);
                                },
                                [](const GptConfig& gpt) { return json(gpt.glu_linear_offset); }},
     .help = "a gated activation's offset: f(a) * (b + glu_linear_offset) (gpt-oss: 1)"},
    {.key = "activation_func_clamp_value",
     .target = NullableNumber<&ParsePositive, &GptConfig::activation_func_clamp_value>(),
     .help = "a gated activation clamps a to at most this and b to [-this, this] before f(a) * b "
             "(gpt-oss: 7); null: no clamp"},
    {.key = "add_bias_linear",
     .target = &GptConfig::add_bias_linear,
     .help = "biases in every linear layer; with MoE the router's and each expert's fc1 and fc2 "
             "biases, fc2's weighted by the routing probability (expert_tensor_parallel_size 1)",
     .effect = kShape},
    {.key = "add_qkv_bias",
     .target = &GptConfig::add_qkv_bias,
     .help = "a bias in linear_qkv even without add_bias_linear (Qwen's)",
     .effect = kShape},
    {"hidden_dropout",
     &GptConfig::hidden_dropout,
     "dropout after attention and the MLP",
     {},
     1,
     NumberRule::kFraction},
    {"attention_dropout",
     &GptConfig::attention_dropout,
     "dropout on the attention probabilities",
     {},
     1,
     NumberRule::kFraction},
    {.key = "position_embedding_type",
     .target = Choice<&PositionEmbeddingNames, &GptConfig::position_embedding_type>(),
     .help = "\"learned_absolute\" (a position embedding table) or \"rope\"",
     .effect = kShape},
    {"rotary_base", &GptConfig::rotary_base, "RoPE's base"},
    {"rotary_percent",
     Codec<GptConfig>{FieldKind::kNumber,
                      [](const json& value, const std::string& where, GptConfig* gpt) {
                        MPUSIM_RETURN_IF_ERROR(ParsePositive(value, where, &gpt->rotary_percent));
                        if (gpt->rotary_percent > 1.0) {
                          return Status::Error(
                              where, fmt::format("must be in (0, 1] (the share of each head's "
                                                 "channels RoPE turns), got {}",
                                                 DescribeJson(value)));
                        }
                        return Status();
                      },
                      [](const GptConfig& gpt) { return json(gpt.rotary_percent); }},
     "the share of each head's channels RoPE turns: the first int(kv_channels * "
     "rotary_percent), even"},
    {.key = "qk_layernorm",
     .target = &GptConfig::qk_layernorm,
     .help = "the model's normalization on each query and key head ([kv_channels], shared by "
             "the heads)",
     .effect = kShape},
    {.key = "max_position_embeddings",
     .target = &GptConfig::max_position_embeddings,
     .help = "rows of the position embedding table (learned_absolute)",
     .effect = kShape,
     .absent = "run.seq_length"},
    {.key = "share_embeddings_and_output_weights",
     .target = &GptConfig::share_embeddings_and_output_weights,
     .help = "the output layer tied to the word embeddings",
     .effect = kShape},
    {"init_method_std", &GptConfig::init_method_std,
     "the standard deviation of the weights' "
     "normal init"},
    {.key = "vocab_size",
     .target = &GptConfig::vocab_size,
     .help = "the tokenizer's vocabulary",
     .effect = kShape,
     .required = kRequired},
    {"make_vocab_size_divisible_by", &GptConfig::make_vocab_size_divisible_by,
     "the vocabulary is padded to a multiple of this times tensor_model_parallel_size"},
    {"label_smoothing",
     &GptConfig::label_smoothing,
     "of the vocab-parallel cross entropy",
     {},
     1,
     NumberRule::kFraction},
    {"dropout_mode", Choice<&DropoutModeNames, &GptConfig::dropout_mode>(),
     "how dropout masks are drawn: \"global\" (layout-independent) or \"rng_tracker\" "
     "(Megatron's per-rank streams; core/dropout.h)"},
    {.key = "cp_comm_type",
     .target = Choice<&CpCommTypeNames, &GptConfig::cp_comm_type>(),
     .help = "how attention under context parallelism meets the other ranks' keys and values: "
             "\"p2p\" (the ring), \"all_gather\" or \"a2a\" (Ulysses); \"a2a+p2p\" refused",
     .effect = FieldEffect::kLayout},
    {.key = "attention_backend",
     .target = Choice<&AttentionBackendNames, &GptConfig::attention_backend>(),
     .help = "Megatron's AttnBackend: \"flash\", \"fused\", \"unfused\", \"local\" or \"auto\" "
             "(the estimate's memory and time; the executor's math is the same)",
     .effect = FieldEffect::kLayout},
    {"fp8", NullableChoice<&Fp8FormatNames, &GptConfig::fp8>(),
     "Transformer Engine's fp8 for the linear layers: \"e4m3\" or \"hybrid\" (estimate and "
     "advise only)"},
    {"fp8_recipe", Choice<&Fp8RecipeNames, &GptConfig::fp8_recipe>(),
     "\"delayed\", \"tensorwise\", \"blockwise\" or \"mxfp8\" (read only with fp8)"},
    // Mixture of experts (MoeConfig).
    {.key = "num_moe_experts",
     .target = ResolvedSize<&GptConfig::moe, &MoeConfig::num_experts>(),
     .help = "experts per MoE layer; null: a dense model",
     .effect = kShape},
    {.key = "moe_router_topk",
     .target = InnerMember<&GptConfig::moe, &MoeConfig::router_topk>(),
     .help = "experts each token is routed to",
     .effect = kShape},
    {.key = "moe_ffn_hidden_size",
     .target = ResolvedSize<&GptConfig::moe, &MoeConfig::ffn_hidden_size>(),
     .help = "each expert's hidden width",
     .effect = kShape,
     .absent = "ffn_hidden_size"},
    {.key = "moe_layer_freq",
     .target = Codec<GptConfig>{FieldKind::kText,
                                [](const json& value, const std::string& where, GptConfig* gpt) {
                                  return ParseMoeLayerFreq(value, where, gpt);
                                },
                                &EchoMoeLayerFreq},
     .help = "an integer N (layer i is an MoE layer when i % N == 0) or a list of 0/1 per layer",
     .effect = kShape},
    {"moe_router_pre_softmax", InnerMember<&GptConfig::moe, &MoeConfig::router_pre_softmax>(),
     "softmax before the top-k (else over the chosen k)"},
    {"moe_router_load_balancing_type",
     Codec<GptConfig>{FieldKind::kText, &ParseLoadBalancing, &EchoLoadBalancing},
     "\"aux_loss\", \"seq_aux_loss\", \"global_aux_loss\" (over the global batch: counts "
     "summed over tp x dp x cp and averaged over the step's micro-batches) or \"none\"; or a "
     "list of them, each weighted by its entry of moe_aux_loss_coeff"},
    {"moe_aux_loss_coeff",
     Codec<GptConfig>{FieldKind::kNumber, &ParseAuxLossCoeff, &EchoAuxLossCoeff},
     "the load-balancing loss's coefficient; a list with a list of types"},
    {"moe_z_loss_coeff",
     NullableNumber<&ParseCoefficient, &GptConfig::moe, &MoeConfig::z_loss_coeff>(),
     "the router z-loss's coefficient; null: none"},
    {.key = "moe_token_dispatcher_type",
     .target = Choice<&MoeDispatcherNames, &GptConfig::moe, &MoeConfig::token_dispatcher>(),
     .help = "\"allgather\" or \"alltoall\"",
     .effect = FieldEffect::kLayout},
    {"moe_expert_capacity_factor",
     NullableNumber<&ParsePositive, &GptConfig::moe, &MoeConfig::expert_capacity_factor>(),
     "tokens an expert takes, as a multiple of its even share; null: dropless"},
    {"moe_token_drop_policy",
     Choice<&MoeDropPolicyNames, &GptConfig::moe, &MoeConfig::token_drop_policy>(),
     "which tokens over capacity are dropped: \"probs\" (the lowest) or \"position\" (the "
     "last)"},
    {"moe_pad_expert_input_to_capacity",
     InnerMember<&GptConfig::moe, &MoeConfig::pad_expert_input_to_capacity>(),
     "pad each expert's tokens to the capacity (needs moe_expert_capacity_factor)"},
    {.key = "moe_shared_expert_intermediate_size",
     .target = InnerMember<&GptConfig::moe, &MoeConfig::shared_expert_intermediate_size>(),
     .help = "the shared expert's hidden width; null: none",
     .effect = kShape},
    {.key = "moe_grouped_gemm",
     .target = InnerMember<&GptConfig::moe, &MoeConfig::grouped_gemm>(),
     .help = "the experts as one grouped GEMM on the GPU (the estimate's launches and "
             "workspaces; the same names and numbers)",
     .effect = FieldEffect::kLayout},
    {.key = "moe_router_dtype",
     .target = NullableChoice<&MoeRouterDTypeNames, &GptConfig::moe, &MoeConfig::router_dtype>(),
     .help = "the router's logits, probabilities and the experts' output weighting in \"fp32\" "
             "or \"fp64\"; null: the run's dtype",
     .effect = FieldEffect::kPrecision},
    // Multi-token prediction.
    {.key = "mtp_num_layers",
     .target = Codec<GptConfig>{
         FieldKind::kInt,
         [](const json& value, const std::string& where, GptConfig* gpt) {
           std::optional<int64_t> depths;
           MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 0, &depths));
           gpt->mtp_num_layers = depths.value_or(0);
           return Status();
         },
         [](const GptConfig& gpt) {
           return gpt.mtp_num_layers == 0 ? json(nullptr) : json(gpt.mtp_num_layers);
         }},
     .help = "multi-token prediction depths (MultiTokenPredictionBlock on the last pipeline "
             "stage: each adds enorm, hnorm, eh_proj, a transformer layer like the last "
             "decoder layer and final_layernorm, and predicts one token further); null: none",
     .effect = kShape},
    {"mtp_loss_scaling_factor", Coefficient<&GptConfig::mtp_loss_scaling_factor>(),
     "the weight of the mean of the depths' losses in the gradient (not in the reported loss)"},
    // DeepSeek-style routing (MoeConfig; topk_routing_with_score_function).
    {.key = "moe_router_score_function",
     .target = Choice<&MoeScoreFunctionNames, &GptConfig::moe, &MoeConfig::score_function>(),
     .help = "\"softmax\", \"sigmoid\" (DeepSeek-V3: the chosen sigmoids normalised to sum "
             "1 when topk > 1) or \"sqrtsoftplus\" (sqrt(softplus(logit)), normalised as the "
             "sigmoids)"},
    {.key = "moe_router_topk_scaling_factor",
     .target = NullableNumber<&ParsePositive, &GptConfig::moe, &MoeConfig::topk_scaling_factor>(),
     .help = "the chosen probabilities times this; null: 1"},
    {.key = "moe_router_num_groups",
     .target = InnerMember<&GptConfig::moe, &MoeConfig::num_groups>(),
     .help = "group-limited routing: the experts in this many equal groups; null: none"},
    {.key = "moe_router_group_topk",
     .target = InnerMember<&GptConfig::moe, &MoeConfig::group_topk>(),
     .help = "group-limited routing: each token chooses from this many groups (those whose top "
             "topk / group_topk scores sum highest); null: no group limit"},
    {.key = "moe_router_enable_expert_bias",
     .target = InnerMember<&GptConfig::moe, &MoeConfig::enable_expert_bias>(),
     .help = "aux-loss-free balancing: a per-expert bias added to the sigmoid (or "
             "sqrtsoftplus) scores for choosing only, updated after each optimizer step"},
    {.key = "moe_router_bias_update_rate",
     .target = Coefficient<&GptConfig::moe, &MoeConfig::bias_update_rate>(),
     .help = "the expert bias's step: + rate for experts below the mean token count, - rate "
             "above"},
    // gpt-oss's attention.
    {.key = "window_size",
     .target = Codec<GptConfig>{FieldKind::kIntList, &ParseWindowSize, &EchoWindowSize},
     .help = "sliding-window attention: [w, 0] lets a query see itself and the w keys before "
             "it (Transformer Engine's [left, right]; [-1, 0] or null: full causal attention)"},
    {"window_attn_skip_freq",
     Codec<GptConfig>{FieldKind::kText, &ParseWindowSkipFreq, &EchoWindowSkipFreq},
     "which layers slide: an integer N (layer numbers divisible by N have full attention) or a "
     "list of 0/1 per layer (1: sliding window); null: all"},
    {.key = "softmax_type",
     .target = Choice<&SoftmaxTypeNames, &GptConfig::softmax_type>(),
     .help = "the attention softmax: \"vanilla\", \"off-by-one\" (a logit 0 in each "
             "denominator) or \"learnable\" (a sink logit per head, "
             "core_attention.softmax_offset)",
     .effect = kShape},
    // Multi-latent attention (MlaConfig; MLATransformerConfig's defaults).
    {.key = "multi_latent_attention",
     .target = InnerMember<&GptConfig::mla, &MlaConfig::enabled>(),
     .help = "DeepSeek's multi-latent attention (MLASelfAttention) instead of linear_qkv; the "
             "mla keys below are read only with it",
     .effect = kShape},
    {.key = "q_lora_rank",
     .target = InnerMember<&GptConfig::mla, &MlaConfig::q_lora_rank>(),
     .help = "the query's latent width (linear_q_down_proj, q_layernorm, linear_q_up_proj); "
             "null: one linear_q_proj",
     .effect = kShape},
    {.key = "kv_lora_rank",
     .target = InnerMember<&GptConfig::mla, &MlaConfig::kv_lora_rank>(),
     .help = "the keys' and values' latent width (linear_kv_down_proj, kv_layernorm)",
     .effect = kShape},
    {.key = "qk_head_dim",
     .target = InnerMember<&GptConfig::mla, &MlaConfig::qk_head_dim>(),
     .help = "a query/key head's channels without rope",
     .effect = kShape},
    {.key = "qk_pos_emb_head_dim",
     .target = InnerMember<&GptConfig::mla, &MlaConfig::qk_pos_emb_head_dim>(),
     .help = "a query/key head's rope channels; the key's come from linear_kv_down_proj, "
             "shared by the heads",
     .effect = kShape},
    {.key = "v_head_dim",
     .target = InnerMember<&GptConfig::mla, &MlaConfig::v_head_dim>(),
     .help = "a value head's channels",
     .effect = kShape},
    {"rope_type", Choice<&MlaRopeTypeNames, &GptConfig::mla, &MlaConfig::rope_type>(),
     "MLA's rope: \"rope\" or \"yarn\" (YaRN's frequencies and mscale)"},
    {"rotary_scaling_factor", InnerMember<&GptConfig::mla, &MlaConfig::rotary_scaling_factor>(),
     "YaRN's scaling factor (also in MLA's softmax scale)"},
    {"original_max_position_embeddings",
     InnerMember<&GptConfig::mla, &MlaConfig::original_max_position_embeddings>(),
     "YaRN's original context length"},
    {"beta_fast", InnerMember<&GptConfig::mla, &MlaConfig::beta_fast>(),
     "YaRN's fast rotation bound"},
    {"beta_slow", InnerMember<&GptConfig::mla, &MlaConfig::beta_slow>(),
     "YaRN's slow rotation bound"},
    {"mscale", InnerMember<&GptConfig::mla, &MlaConfig::mscale, 1, NumberRule::kNonNegative>(),
     "YaRN's mscale: rope's cos and sin scale by mscale(f, mscale) / mscale(f, mscale_all_dim)"},
    {"mscale_all_dim",
     InnerMember<&GptConfig::mla, &MlaConfig::mscale_all_dim, 1, NumberRule::kNonNegative>(),
     "YaRN's mscale_all_dim: the softmax scale is mscale(f, mscale_all_dim)^2 / "
     "sqrt(qk_head_dim + qk_pos_emb_head_dim)"},
};

}  // namespace

std::span<const Field<GptConfig>> GptFields() { return kFields; }

const std::vector<std::string_view>& GptConfigKeys() {
  static const std::vector<std::string_view> kKeys = KeysOf(GptFields());
  return kKeys;
}

const char* PositionEmbeddingName(PositionEmbedding p) {
  return PositionEmbeddingNames()[static_cast<size_t>(p)].data();
}
const char* DropoutModeName(DropoutMode m) {
  return DropoutModeNames()[static_cast<size_t>(m)].data();
}
const char* CpCommTypeName(CpCommType c) {
  return CpCommTypeNames()[static_cast<size_t>(c)].data();
}
const char* AttentionBackendName(AttentionBackend b) {
  return AttentionBackendNames()[static_cast<size_t>(b)].data();
}
const std::vector<std::string_view>& AttentionBackendNames() {
  static const std::vector<std::string_view> kNames = {"flash", "fused", "unfused", "local",
                                                       "auto"};
  return kNames;
}
const char* Fp8FormatName(Fp8Format f) { return Fp8FormatNames()[static_cast<size_t>(f)].data(); }
const char* Fp8RecipeName(Fp8Recipe r) { return Fp8RecipeNames()[static_cast<size_t>(r)].data(); }
const char* MlaRopeTypeName(MlaRopeType r) {
  return MlaRopeTypeNames()[static_cast<size_t>(r)].data();
}
const char* MoeRouterDTypeName(MoeRouterDType d) {
  return MoeRouterDTypeNames()[static_cast<size_t>(d)].data();
}
const char* MoeLoadBalancingName(MoeLoadBalancing type) {
  return MoeLoadBalancingNames()[static_cast<size_t>(type)].data();
}

const char* MoeScoreFunctionName(MoeScoreFunction f) {
  return MoeScoreFunctionNames()[static_cast<size_t>(f)].data();
}
const char* SoftmaxTypeName(SoftmaxType t) {
  return SoftmaxTypeNames()[static_cast<size_t>(t)].data();
}

}  // namespace mpusim
