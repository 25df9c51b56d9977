// The GPT model section (see gpt_config.h): reading it through its field table (gpt_fields.cc),
// then Megatron's post-parse defaults and the rules between keys, the checks against the
// layout, and the parameter list.
//
// Defaults are TransformerConfig's (megatron/core/transformer/transformer_config.py) and
// GPTModel's; the parameter list follows GPTModel's state dict with the local layer spec
// (get_gpt_layer_local_spec: separate input_layernorm / pre_mlp_layernorm modules).
#include "core/config/gpt_config.h"

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
    // Multi-token prediction's options beyond Megatron's default training math.
    {"mtp_use_repeated_layer", "false",
     "each depth has its own MTP layer; one layer applied at every depth is not modelled"},
    {"mtp_detach_heads", "false",
     "the MTP loss's gradient reaches the main model; detached heads are not modelled"},
    {"mtp_hsm", "false", "hidden-state mixing across the depths is not modelled"},
};

const AcceptedField* FindTransformerField(std::string_view key) {
  return FindAcceptedField(kTransformerFields, key);
}

// glu_linear_offset and activation_func_clamp_value (TransformerConfig): only a gated
// activation's glu reads them (megatron/core/transformer/mlp.py), and __post_init__'s rules for
// a clamped SwiGLU.
Status JudgeGlu(const json& section, GptConfig* gpt) {
  if (!IsGated(gpt->activation)) {
    for (const char* key : {"glu_linear_offset", "activation_func_clamp_value"}) {
      if (section.contains(key)) {
        gpt->ignored.push_back(fmt::format(
            "model.{}: ignored: only a gated activation's glu reads it, and \"activation\": "
            "\"{}\" is not gated",
            key, ActivationName(gpt->activation)));
      }
    }
    gpt->glu_linear_offset = 0.0;
    gpt->activation_func_clamp_value.reset();
    return {};
  }
  if (gpt->activation == Activation::kSwiglu && gpt->activation_func_clamp_value) {
    if (!gpt->moe.enabled()) {
      return Status::Error("model.activation_func_clamp_value",
                           "activation_func_clamp_value for SwiGLU is only supported with MoE "
                           "(Megatron's rule); set num_moe_experts or use \"quick_geglu\"");
    }
    if (gpt->glu_linear_offset != 0.0) {
      return Status::Error("model.glu_linear_offset",
                           "must be zero when activation_func_clamp_value is set for SwiGLU "
                           "(Megatron's rule)");
    }
  }
  return {};
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
                      "\"quick_geglu\" with quick_gelu, \"gelu\" and \"squared_relu\" are "
                      "ungated; set \"activation\" and drop gated_linear_unit",
                      v.get<bool>(), ActivationName(gpt->activation)));
    }
    gpt->ignored.push_back(fmt::format(
        "model.gated_linear_unit: ignored: the gate follows \"activation\": \"{}\"",
        ActivationName(gpt->activation)));
  }
  return JudgeGlu(section, gpt);
}

// Megatron's command-line spellings (megatron/training/arguments.py, and a TransformerConfig
// dumped with its activation_func named) of keys mpusim has, rewritten into those keys before
// the section is parsed; what they leave unsaid gets a note. A spelling that contradicts the
// key it stands for is refused naming both.
StatusOr<json> ResolveMegatronSpellings(const json& section, std::vector<std::string>* notes) {
  json out = section;
  const auto flag = [&](const char* key) -> StatusOr<std::optional<bool>> {
    if (!section.contains(key)) return std::optional<bool>();
    const json& v = section[key];
    if (!v.is_boolean()) {
      return Status::Error(fmt::format("model.{}", key),
                           fmt::format("must be true or false, got {}", DescribeJson(v)));
    }
    out.erase(key);
    return std::optional<bool>(v.get<bool>());
  };
  // --untie-embeddings-and-output-weights: share_embeddings_and_output_weights, negated.
  StatusOr<std::optional<bool>> untie = flag("untie_embeddings_and_output_weights");
  if (!untie.ok()) return untie.status();
  if (*untie) {
    const bool share = !**untie;
    if (section.contains("share_embeddings_and_output_weights") &&
        section["share_embeddings_and_output_weights"] != json(share)) {
      return Status::Error("model.untie_embeddings_and_output_weights",
                           fmt::format("{} contradicts share_embeddings_and_output_weights {} (it "
                                       "is Megatron's command-line spelling of its negation); "
                                       "keep one",
                                       **untie, !share));
    }
    out["share_embeddings_and_output_weights"] = share;
  }
  // --group-query-attention with --num-query-groups (argparse default 1); without it Megatron
  // ignores num_query_groups (every head its own group).
  StatusOr<std::optional<bool>> gqa = flag("group_query_attention");
  if (!gqa.ok()) return gqa.status();
  if (*gqa && **gqa && !section.contains("num_query_groups")) {
    out["num_query_groups"] = 1;
    notes->push_back(
        "model.group_query_attention: true without num_query_groups is one group of keys and "
        "values for all heads (Megatron's --num-query-groups default 1)");
  }
  if (*gqa && !**gqa && section.contains("num_query_groups")) {
    out.erase("num_query_groups");
    notes->push_back(
        "model.num_query_groups: ignored: group_query_attention is false, so every head has its "
        "own keys and values, as Megatron ignores --num-query-groups without "
        "--group-query-attention");
  }
  // --swiglu, and activation_func by name (with gated_linear_unit): the `activation` value.
  std::optional<std::string> activation;
  std::string from;
  StatusOr<std::optional<bool>> swiglu = flag("swiglu");
  if (!swiglu.ok()) return swiglu.status();
  if (*swiglu && **swiglu) {
    activation = "swiglu";
    from = "swiglu";
  }
  if (section.contains("activation_func")) {
    const json& v = section["activation_func"];
    if (!v.is_string()) {
      return Status::Error("model.activation_func",
                           fmt::format("must be the name of Megatron's activation_func (\"gelu\", "
                                       "\"silu\", \"quick_gelu\", \"squared_relu\", \"relu\"), "
                                       "got {}",
                                       DescribeJson(v)));
    }
    const bool gated = section.contains("gated_linear_unit") &&
                       section["gated_linear_unit"].is_boolean() &&
                       section["gated_linear_unit"].get<bool>();
    static const std::map<std::pair<std::string, bool>, std::string> kNames = {
        {{"gelu", false}, "gelu"},
        {{"silu", true}, "swiglu"},
        {{"quick_gelu", true}, "quick_geglu"},
        {{"squared_relu", false}, "squared_relu"},
        {{"relu", false}, "relu"}};
    const std::string name = v.get<std::string>();
    const auto it = kNames.find({name, gated});
    if (it == kNames.end()) {
      return Status::Error(
          "model.activation_func",
          fmt::format("\"{}\" with gated_linear_unit {} is not built; mpusim computes gelu, "
                      "silu with gated_linear_unit true (swiglu), quick_gelu with it "
                      "(quick_geglu), squared_relu and relu",
                      name, gated));
    }
    if (activation && *activation != it->second) {
      return Status::Error(
          "model.activation_func",
          fmt::format("\"{}\" is \"activation\": \"{}\", but swiglu is true", name, it->second));
    }
    activation = it->second;
    from = "activation_func";
    out.erase("activation_func");
    out.erase("gated_linear_unit");  // part of the name
  }
  if (activation) {
    if (section.contains("activation") && section["activation"] != json(*activation)) {
      return Status::Error(fmt::format("model.{}", from),
                           fmt::format("means \"activation\": \"{}\", but activation is {}; keep "
                                       "one",
                                       *activation, section["activation"].dump()));
    }
    out["activation"] = *activation;
  }
  return out;
}

// DeepSeek-style routing keys (TransformerConfig.__post_init__'s rules, with its reasons;
// plus the group-limited shapes Megatron's group_limited_topk cannot run).
Status ResolveMoeRouting(GptConfig* gpt) {
  MoeConfig& moe = gpt->moe;
  // TransformerConfig.__post_init__: the list form needs a list of coefficients as long.
  if (moe.load_balancing_list.size() != moe.aux_loss_coeff_list.size()) {
    return Status::Error(
        "model.moe_aux_loss_coeff",
        moe.load_balancing_list.empty()
            ? "a list needs moe_router_load_balancing_type to be a list of as many types"
            : "moe_aux_loss_coeff must be a list of the same length as "
              "moe_router_load_balancing_type");
  }
  if (moe.enable_expert_bias && !moe.PerLogitScores()) {
    return Status::Error(
        "model.moe_router_enable_expert_bias",
        "Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' score "
        "functions. Please set --moe-router-score-function to 'sigmoid' or 'sqrtsoftplus', or "
        "unset --moe-router-enable-expert-bias.");
  }
  if (moe.enable_expert_bias && moe.pad_expert_input_to_capacity) {
    return Status::Error("model.moe_router_enable_expert_bias",
                         "with moe_pad_expert_input_to_capacity is not built (Megatron counts "
                         "the padded routing map's tokens)");
  }
  if (moe.PerLogitScores() && moe.router_pre_softmax) {
    const bool sigmoid = moe.score_function == MoeScoreFunction::kSigmoid;
    gpt->ignored.push_back(fmt::format(
        "model.moe_router_pre_softmax: ignored: with moe_router_score_function \"{}\" the "
        "top-k always chooses from the {}",
        MoeScoreFunctionName(moe.score_function), sigmoid ? "sigmoids" : "sqrt(softplus) scores"));
  }
  if (!moe.group_topk) {
    if (moe.num_groups) {
      gpt->ignored.push_back(
          "model.moe_router_num_groups: ignored: group-limited routing needs "
          "moe_router_group_topk");
    }
    return {};
  }
  const std::string field = "model.moe_router_group_topk";
  if (!moe.num_groups) {
    return Status::Error(field,
                         "When using group limited routing, moe_router_num_groups must "
                         "be specified.");
  }
  const int64_t G = *moe.num_groups, g = *moe.group_topk, E = moe.num_experts, K = moe.router_topk;
  if (E % G != 0) {
    return Status::Error("model.moe_router_num_groups",
                         fmt::format("num_moe_experts ({}) should be divisible by "
                                     "moe_router_num_groups ({}).",
                                     E, G));
  }
  if (g > G) {
    return Status::Error(field, fmt::format("moe_router_group_topk ({}) should be smaller than "
                                            "moe_router_num_groups ({}).",
                                            g, G));
  }
  if (K < g) {
    return Status::Error(field, fmt::format("{} is more than moe_router_topk {}: a group's score "
                                            "is the sum of its top topk // group_topk = 0 "
                                            "scores, so every group would tie",
                                            g, K));
  }
  if (K / g > E / G) {
    return Status::Error(field, fmt::format("a group's score sums its top moe_router_topk // {} "
                                            "= {} scores, but a group has only {} experts",
                                            g, K / g, E / G));
  }
  if (K > g * (E / G)) {
    return Status::Error(field, fmt::format("the {} chosen groups hold {} experts, fewer than "
                                            "moe_router_topk {}",
                                            g, g * (E / G), K));
  }
  return {};
}

// The moe_* keys once the section is read: defaults resolved against the model, the pattern
// checked against num_layers, and keys that need num_moe_experts refused or noted without it.
Status ResolveMoe(const json& section, GptConfig* gpt) {
  MoeConfig& moe = gpt->moe;
  if (!moe.enabled()) {
    if (moe.ffn_hidden_size != 0) {
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
  if (moe.ffn_hidden_size == 0) moe.ffn_hidden_size = gpt->ffn_hidden_size;
  if (const auto* every = std::get_if<int64_t>(&moe.layer_freq)) {
    moe.layers.clear();
    for (int64_t i = 0; i < gpt->num_layers; ++i) moe.layers.push_back(i % *every == 0);
  } else {
    moe.layers = std::get<std::vector<bool>>(moe.layer_freq);
    if (static_cast<int64_t>(moe.layers.size()) != gpt->num_layers) {
      return Status::Error("model.moe_layer_freq",
                           fmt::format("the list has {} entries but the model has num_layers {}; "
                                       "give one 0 (dense) or 1 (MoE) per layer",
                                       moe.layers.size(), gpt->num_layers));
    }
  }
  if (gpt->add_bias_linear && moe.shared_expert_intermediate_size) {
    return Status::Error("model.add_bias_linear",
                         "must be false with moe_shared_expert_intermediate_size (Megatron's "
                         "SharedExpertMLP: bias is not supported in the shared experts)");
  }
  if (moe.pad_expert_input_to_capacity && !moe.expert_capacity_factor) {
    return Status::Error("model.moe_pad_expert_input_to_capacity",
                         "needs moe_expert_capacity_factor (the capacity to pad to)");
  }
  return ResolveMoeRouting(gpt);
}

// Multi-token prediction's rules between keys (megatron/training/arguments.py validate_args),
// and what mpusim has not built with it yet.
Status CheckMtp(const json& section, GptConfig* gpt) {
  if (gpt->mtp_num_layers == 0) {
    if (section.contains("mtp_loss_scaling_factor")) {
      gpt->ignored.push_back(
          "model.mtp_loss_scaling_factor: ignored: mtp_num_layers is null (no MTP)");
    }
    return {};
  }
  if (gpt->position_embedding_type != PositionEmbedding::kRope) {
    return Status::Error("model.position_embedding_type",
                         fmt::format("\"{}\" cannot run with mtp_num_layers (Megatron's rule: "
                                     "multi-token prediction takes \"rope\" or \"none\"); set "
                                     "\"rope\"",
                                     PositionEmbeddingName(gpt->position_embedding_type)));
  }
  if (gpt->dropout_mode == DropoutMode::kRngTracker &&
      (gpt->hidden_dropout > 0 || gpt->attention_dropout > 0)) {
    return Status::Error("model.dropout_mode",
                         "\"rng_tracker\" with mtp_num_layers is not built yet (the MTP layers' "
                         "draws in Megatron's streams); set dropout_mode \"global\" or the "
                         "dropouts to 0");
  }
  return {};
}

// gpt-oss's attention keys once the section is read (TransformerConfig window_size,
// window_attn_skip_freq): the causal rule on the window and the pattern against num_layers.
Status ResolveWindow(GptConfig* gpt) {
  if (gpt->window_size) {
    const auto [left, right] = *gpt->window_size;
    if (right != 0) {
      // Transformer Engine's check_set_window_size: a causal mask takes (-1, 0) or (>= 0, 0);
      // it would reset the right side to 0 with a warning (Megatron's local mask would let
      // queries see later keys).
      return Status::Error("model.window_size",
                           fmt::format("[{}, {}]: the GPT is causal, so the right side must be 0 "
                                       "([w, 0] with w >= 0, or [-1, 0]: Transformer Engine's "
                                       "rule for a causal mask)",
                                       left, right));
    }
  }
  if (gpt->window_attn_skip_freq) {
    if (!gpt->window_size || (*gpt->window_size)[0] < 0) {
      gpt->ignored.push_back(
          "model.window_attn_skip_freq: ignored: window_size sets no sliding window");
    } else if (const auto* pattern = std::get_if<std::vector<bool>>(&*gpt->window_attn_skip_freq);
               pattern != nullptr && static_cast<int64_t>(pattern->size()) != gpt->num_layers) {
      return Status::Error("model.window_attn_skip_freq",
                           fmt::format("the list has {} entries but the model has num_layers {}; "
                                       "give one 1 (sliding window) or 0 (full attention) per "
                                       "layer",
                                       pattern->size(), gpt->num_layers));
    }
  }
  return {};
}

// The keys only multi-latent attention reads (MLATransformerConfig's own fields).
constexpr std::string_view kMlaKeys[] = {
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
};

// multi_latent_attention once the section is read: without it its keys are noted as ignored;
// with it, the keys MLASelfAttention does not read are noted and the combinations it builds
// differently, or mpusim does not build, refused.
Status ResolveMla(const json& section, GptConfig* gpt) {
  MlaConfig& mla = gpt->mla;
  if (!mla.enabled) {
    for (std::string_view key : kMlaKeys) {
      if (section.contains(key)) {
        gpt->ignored.push_back(
            fmt::format("model.{}: ignored: multi_latent_attention is false", key));
      }
    }
    mla = MlaConfig{};
    return {};
  }
  for (const char* key : {"kv_channels", "num_query_groups", "add_qkv_bias"}) {
    if (section.contains(key)) {
      gpt->ignored.push_back(fmt::format(
          "model.{}: ignored: multi_latent_attention's heads are qk_head_dim + "
          "qk_pos_emb_head_dim (queries, keys) and v_head_dim (values), one key and value per "
          "query head, and its linear layers have no bias",
          key));
    }
  }
  // One key and one value head per query head: the groups core attention (and cp's head
  // exchanges) see.
  gpt->num_query_groups = gpt->num_attention_heads;
  if (gpt->softmax_type != SoftmaxType::kVanilla || gpt->HasSlidingWindow()) {
    return Status::Error(gpt->softmax_type != SoftmaxType::kVanilla ? "model.softmax_type"
                                                                     : "model.window_size",
                         "attention sinks and sliding windows with multi_latent_attention are "
                         "not built (MLA's core attention has neither); use one or the other");
  }
  if (mla.qk_pos_emb_head_dim % 2 != 0) {
    return Status::Error("model.qk_pos_emb_head_dim",
                         fmt::format("rope rotates pairs of channels, so it must be even, got {}",
                                     mla.qk_pos_emb_head_dim));
  }
  if (mla.rope_type == MlaRopeType::kYarn) {
    if (section.contains("rotary_percent")) {
      gpt->ignored.push_back(
          "model.rotary_percent: ignored: MLA's yarn rope turns all qk_pos_emb_head_dim "
          "channels");
    }
  } else if (gpt->rotary_percent < 1.0) {
    return Status::Error("model.rotary_percent",
                         fmt::format("{} with multi_latent_attention and rope_type \"rope\" is "
                                     "not built (MLA's rope on part of qk_pos_emb_head_dim); set "
                                     "1",
                                     gpt->rotary_percent));
  }
  return {};
}

}  // namespace

int64_t GptConfig::AttentionWindow(int64_t layer) const {
  // Megatron's is_layer_window_attention (megatron/core/transformer/utils.py), layer number
  // layer + 1; a window of [-1, 0] is full causal attention (Transformer Engine's).
  if (!window_size || (*window_size)[0] < 0) return -1;
  if (window_attn_skip_freq) {
    if (const auto* every = std::get_if<int64_t>(&*window_attn_skip_freq)) {
      if ((layer + 1) % *every == 0) return -1;
    } else if (!std::get<std::vector<bool>>(*window_attn_skip_freq)
                    .at(static_cast<size_t>(layer))) {
      return -1;
    }
  }
  return (*window_size)[0];
}

bool GptConfig::HasSlidingWindow() const {
  for (int64_t i = 0; i < num_layers; ++i) {
    if (AttentionWindow(i) >= 0) return true;
  }
  return false;
}

int64_t GptConfig::PaddedVocabSize(int64_t tensor_model_parallel_size) const {
  const int64_t multiple = make_vocab_size_divisible_by * tensor_model_parallel_size;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

bool IsAcceptedTransformerField(std::string_view key) {
  // gated_linear_unit is judged with the activation; the rest are Megatron's spellings of
  // mpusim's keys (ResolveMegatronSpellings).
  for (std::string_view spelling : {"gated_linear_unit", "swiglu", "group_query_attention",
                                    "untie_embeddings_and_output_weights", "activation_func"}) {
    if (key == spelling) return true;
  }
  return FindTransformerField(key) != nullptr;
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
  StatusOr<json> resolved = ResolveMegatronSpellings(section, &gpt.ignored);
  if (!resolved.ok()) return resolved.status();
  const json& keys = *resolved;
  for (const auto& [key, value] : keys.items()) {
    const std::string where = prefix + "." + key;
    if (key == "gated_linear_unit") continue;  // JudgeDependentFields
    if (const AcceptedField* field = FindTransformerField(key)) {
      MPUSIM_RETURN_IF_ERROR(JudgeAcceptedField(*field, value, where, &gpt.ignored));
      continue;
    }
    const Field<GptConfig>* field = FindField(GptFields(), key);
    if (field == nullptr) return UnknownKey(where, key, GptConfigKeys());
    MPUSIM_RETURN_IF_ERROR(field->Parse(value, where, &gpt));
  }
  MPUSIM_RETURN_IF_ERROR(CheckRequired(GptFields(), keys, prefix, " for \"type\": \"gpt\""));
  MPUSIM_RETURN_IF_ERROR(JudgeDependentFields(keys, &gpt));
  // TransformerConfig.__post_init__'s defaults (the table leaves 0 for an absent or null
  // size).
  if (gpt.ffn_hidden_size == 0) gpt.ffn_hidden_size = 4 * gpt.hidden_size;
  if (gpt.kv_channels == 0 && gpt.hidden_size % gpt.num_attention_heads != 0) {
    return Status::Error(prefix + ".num_attention_heads",
                         fmt::format("hidden_size {} is not divisible by num_attention_heads {}; "
                                     "set kv_channels or choose a divisor",
                                     gpt.hidden_size, gpt.num_attention_heads));
  }
  if (gpt.kv_channels == 0) gpt.kv_channels = gpt.hidden_size / gpt.num_attention_heads;
  if (gpt.num_query_groups == 0) gpt.num_query_groups = gpt.num_attention_heads;
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
  if (gpt.position_embedding_type != PositionEmbedding::kRope && keys.contains("rotary_percent")) {
    gpt.ignored.push_back(
        "model.rotary_percent: ignored: position_embedding_type is not \"rope\"");
  }
  if (!gpt.fp8 && keys.contains("fp8_recipe")) {
    gpt.ignored.push_back("model.fp8_recipe: ignored: fp8 is null");
  }
  if (gpt.label_smoothing > 0 && gpt.vocab_size < 2) {
    return Status::Error(prefix + ".label_smoothing", "needs a vocab_size of at least 2");
  }
  MPUSIM_RETURN_IF_ERROR(ResolveMoe(keys, &gpt));
  MPUSIM_RETURN_IF_ERROR(CheckMtp(keys, &gpt));
  MPUSIM_RETURN_IF_ERROR(ResolveWindow(&gpt));
  MPUSIM_RETURN_IF_ERROR(ResolveMla(keys, &gpt));
  *out = gpt;
  return {};
}

Status CheckGptLayout(const ParallelConfig& parallel, const RunConfig& run, GptConfig* gpt) {
  MPUSIM_RETURN_IF_ERROR(CheckMtpInLayout(parallel.Split(), gpt->mtp_num_layers));
  const int64_t t = parallel.tensor_model_parallel_size;
  const auto divisible = [&](const char* field, int64_t value) -> Status {
    if (value % t == 0) return {};
    return Status::Error(fmt::format("model.{}", field),
                         fmt::format("{} is not divisible by tensor_model_parallel_size {}", value, t));
  };
  MPUSIM_RETURN_IF_ERROR(divisible("num_attention_heads", gpt->num_attention_heads));
  MPUSIM_RETURN_IF_ERROR(divisible("num_query_groups", gpt->num_query_groups));
  MPUSIM_RETURN_IF_ERROR(divisible("ffn_hidden_size", gpt->ffn_hidden_size));
  if (gpt->mla.enabled) {
    // The local spec's linear_q_down_proj and linear_kv_down_proj are ColumnParallelLinear:
    // their outputs split over tp before the gather.
    if (gpt->mla.q_lora_rank) {
      MPUSIM_RETURN_IF_ERROR(divisible("q_lora_rank", *gpt->mla.q_lora_rank));
    }
    if ((gpt->mla.kv_lora_rank + gpt->mla.qk_pos_emb_head_dim) % t != 0) {
      return Status::Error("model.kv_lora_rank",
                           fmt::format("kv_lora_rank + qk_pos_emb_head_dim = {} is not divisible "
                                       "by tensor_model_parallel_size {} (linear_kv_down_proj is "
                                       "column-parallel)",
                                       gpt->mla.kv_lora_rank + gpt->mla.qk_pos_emb_head_dim, t));
    }
  }
  if (!parallel.Split().Even()) {
    // An uneven pipeline split's checks that need the layer count (Megatron's); the even
    // split's are the model's (GptModel::Build), as before.
    StatusOr<LayerAssignment> layers = AssignLayers(parallel.Split(), gpt->num_layers);
    if (!layers.ok()) return layers.status();
  }
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
    if (gpt->add_bias_linear && etp != 1) {
      return Status::Error("model.add_bias_linear",
                           fmt::format("is true with expert_tensor_parallel_size {}: Megatron "
                                       "supports bias in MoE only when ETP==1; set "
                                       "expert_tensor_parallel_size 1 or add_bias_linear false",
                                       etp));
    }
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
  // Megatron's rules for recompute_modules that need the model (transformer_config.py).
  if (run.recompute == RunConfig::Recompute::kSelective && run.recompute_modules) {
    for (size_t i = 0; i < run.recompute_modules->size(); ++i) {
      const RunConfig::RecomputeModule m = (*run.recompute_modules)[i];
      const std::string field = fmt::format("run.recompute_modules[{}]", i);
      if (m == RunConfig::RecomputeModule::kMoeAct && !gpt->moe.grouped_gemm) {
        return Status::Error(field,
                             "\"moe_act\" needs model.moe_grouped_gemm true "
                             "(Megatron's rule)");
      }
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
  // The key and value heads the cp exchanges split (multi-latent attention: one per head).
  const char* kv_heads = gpt->mla.enabled ? "num_attention_heads" : "num_query_groups";
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
                        "{} {} must be divisible by tensor_model_parallel_size * "
                        "hierarchical_context_parallel_sizes[0] = {}",
                        hcp[0], kv_heads, gpt->num_query_groups, t * hcp[0]));
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
                      "{} {} must be divisible by tensor_model_parallel_size * "
                      "context_parallel_size = {}; set \"p2p\" or \"all_gather\", or another "
                      "layout",
                      kv_heads, gpt->num_query_groups, t * cp));
    }
    if (gpt->HasSlidingWindow() &&
        (gpt->cp_comm_type == CpCommType::kP2p || gpt->cp_comm_type == CpCommType::kA2aP2p)) {
      // Transformer Engine's attn_forward_func_with_cp.
      return Status::Error(
          "model.window_size",
          fmt::format("a sliding window with context_parallel_size {} needs cp_comm_type "
                      "\"a2a\" or \"all_gather\", got \"{}\" (Transformer Engine: \"Context "
                      "parallelism does not support sliding window attention with "
                      "cp_comm_type={}\")",
                      cp, CpCommTypeName(gpt->cp_comm_type), CpCommTypeName(gpt->cp_comm_type)));
    }
    if (gpt->softmax_type != SoftmaxType::kVanilla && gpt->cp_comm_type != CpCommType::kA2a) {
      // Transformer Engine's attn_forward_func_with_cp.
      return Status::Error(
          "model.softmax_type",
          fmt::format("\"{}\" with context_parallel_size {} needs cp_comm_type \"a2a\", got "
                      "\"{}\" (Transformer Engine: \"Context parallelism only supports "
                      "softmax_type={} with cp_comm_type = 'a2a'!\")",
                      SoftmaxTypeName(gpt->softmax_type), cp, CpCommTypeName(gpt->cp_comm_type),
                      SoftmaxTypeName(gpt->softmax_type)));
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

// MLASelfAttention's parameters with the local spec (get_gpt_layer_local_spec with
// multi_latent_attention), in forward order. Every projection is a ColumnParallelLinear split
// along its output rows (the down projections too: their outputs are gathered over tp after),
// linear_proj a RowParallelLinear; no bias but linear_proj's (add_bias_linear). q_layernorm
// and kv_layernorm (qk_layernorm only; q_layernorm only with q_lora_rank) normalise the
// latents: each tp rank holds them whole, on its sequence shard under sequence parallelism
// (so their gradients are then partial sums over tp).
static void AddMlaParameters(const GptConfig& gpt, const std::string& prefix,
                             bool sequence_parallel, std::vector<GptParameter>* params) {
  const MlaConfig& mla = gpt.mla;
  const int64_t h = gpt.hidden_size, a = gpt.num_attention_heads;
  const InitSpec normal{InitMethod::kNormal, gpt.init_method_std};
  const InitSpec scaled{InitMethod::kNormal,
                        gpt.init_method_std / std::sqrt(2.0 * static_cast<double>(gpt.num_layers))};
  const InitSpec zeros{InitMethod::kZeros, 0.0};
  const InitSpec ones{InitMethod::kOnes, 0.0};
  const auto column = [&](const std::string& name, int64_t out, int64_t in) {
    params->push_back(GptParameter{prefix + name, {out, in}, normal, 0, 1, false});
  };
  const auto latent_norm = [&](const std::string& name, int64_t width) {
    if (!gpt.qk_layernorm) return;
    params->push_back(
        GptParameter{prefix + name + ".weight", {width}, ones, -1, 1, sequence_parallel});
    if (IsCentered(gpt.normalization)) {
      params->push_back(
          GptParameter{prefix + name + ".bias", {width}, zeros, -1, 1, sequence_parallel});
    }
  };
  if (mla.q_lora_rank) {
    column(".linear_q_down_proj.weight", *mla.q_lora_rank, h);
    latent_norm(".q_layernorm", *mla.q_lora_rank);
    column(".linear_q_up_proj.weight", a * mla.QHeadDim(), *mla.q_lora_rank);
  } else {
    column(".linear_q_proj.weight", a * mla.QHeadDim(), h);
  }
  column(".linear_kv_down_proj.weight", mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h);
  latent_norm(".kv_layernorm", mla.kv_lora_rank);
  column(".linear_kv_up_proj.weight", a * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank);
  params->push_back(
      GptParameter{prefix + ".linear_proj.weight", {h, a * mla.v_head_dim}, scaled, 1, 1, false});
  if (gpt.add_bias_linear) {
    params->push_back(
        GptParameter{prefix + ".linear_proj.bias", {h}, zeros, -1, 1, sequence_parallel});
  }
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
  // One transformer layer under `layer` (an MoE layer when `moe_layer`).
  const auto add_layer = [&](const std::string& layer, bool moe_layer) {
    norm(layer + ".input_layernorm");
    // Multi-latent attention in place of linear_qkv (its own linear_proj included).
    const bool mla = gpt.mla.enabled;
    if (mla) AddMlaParameters(gpt, layer + ".self_attention", sequence_parallel, &params);
    if (!mla) add(layer + ".self_attention.linear_qkv.weight", {gpt.QkvRows(), h}, normal, 0);
    if (!mla && (gpt.add_bias_linear || gpt.add_qkv_bias)) {
      add(layer + ".self_attention.linear_qkv.bias", {gpt.QkvRows()}, zeros, 0);
    }
    if (!mla && gpt.qk_layernorm) {
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
    if (gpt.softmax_type == SoftmaxType::kLearnable) {
      // DotProductAttention's softmax_offset: one sink logit per head, split over tp by heads,
      // drawn by config.init_method (normal(init_method_std)).
      add(layer + ".self_attention.core_attention.softmax_offset", {gpt.num_attention_heads},
          normal, 0);
    }
    if (!mla) add(layer + ".self_attention.linear_proj.weight", {h, attn_width}, scaled, 1);
    if (!mla && gpt.add_bias_linear) {
      add(layer + ".self_attention.linear_proj.bias", {h}, zeros, -1, 1, true);
    }
    norm(layer + ".pre_mlp_layernorm");
    if (moe_layer) {
      // MoELayer: the router (replicated; fed by the sequence-split stream under sequence
      // parallelism), the experts under their global numbers (SequentialMLP's
      // local_experts.<e>), the shared expert.
      // With add_bias_linear (expert_tensor_parallel_size 1, Megatron's rule): TopKRouter's
      // bias [E], drawn by its init_method as the weight is, and each expert's linear_fc1 and
      // linear_fc2 biases (zeros, as Megatron's linear layers initialise them).
      add(layer + ".mlp.router.weight", {gpt.moe.num_experts, h}, normal, -1, 1, true);
      if (gpt.add_bias_linear)
        add(layer + ".mlp.router.bias", {gpt.moe.num_experts}, normal, -1, 1, true);
      const int64_t f = gpt.moe.ffn_hidden_size, f1 = IsGated(gpt.activation) ? 2 * f : f;
      for (int64_t e = 0; e < gpt.moe.num_experts; ++e) {
        if (keep_expert && !keep_expert(e)) continue;
        const std::string fc1 = MoeExpertWeightName(layer + ".mlp", e, 1);
        const std::string fc2 = MoeExpertWeightName(layer + ".mlp", e, 2);
        add(fc1, {f1, h}, normal, 0, stride_fc1);
        if (gpt.add_bias_linear)
          add(MoeExpertBiasName(layer + ".mlp", e, 1), {f1}, zeros, 0, stride_fc1);
        add(fc2, {h, f}, scaled, 1);
        if (gpt.add_bias_linear)
          add(MoeExpertBiasName(layer + ".mlp", e, 2), {h}, zeros, -1);
      }
      if (const auto shared = gpt.moe.shared_expert_intermediate_size) {
        const int64_t s1 = IsGated(gpt.activation) ? 2 * *shared : *shared;
        add(layer + ".mlp.shared_experts.linear_fc1.weight", {s1, h}, normal, 0, stride_fc1);
        add(layer + ".mlp.shared_experts.linear_fc2.weight", {h, *shared}, scaled, 1);
      }
      return;
    }
    add(layer + ".mlp.linear_fc1.weight", {gpt.Fc1Rows(), h}, normal, 0, stride_fc1);
    if (gpt.add_bias_linear) add(layer + ".mlp.linear_fc1.bias", {gpt.Fc1Rows()}, zeros, 0, stride_fc1);
    add(layer + ".mlp.linear_fc2.weight", {h, gpt.ffn_hidden_size}, scaled, 1);
    if (gpt.add_bias_linear) add(layer + ".mlp.linear_fc2.bias", {h}, zeros, -1, 1, true);
  };
  const auto is_moe_layer = [&](int64_t i) {
    return gpt.moe.enabled() && gpt.moe.layers[static_cast<size_t>(i)];
  };
  for (int64_t i = 0; i < gpt.num_layers; ++i) {
    if (keep_layer && !keep_layer(i)) continue;
    add_layer(fmt::format("decoder.layers.{}", i), is_moe_layer(i));
  }
  norm("decoder.final_layernorm");
  // Multi-token prediction (MultiTokenPredictionLayer, built before the output layer), on the
  // stage that holds the last decoder layer (Megatron's default placement: the last pipeline
  // stage). Each depth: enorm (of the shifted tokens' embedding), hnorm (of the previous
  // hidden state), eh_proj (ColumnParallelLinear [h, 2h], no bias), a transformer layer built
  // from the last decoder layer's spec (checkpoint name transformer_layer), final_layernorm.
  if (gpt.mtp_num_layers > 0 && (!keep_layer || keep_layer(gpt.num_layers - 1))) {
    for (int64_t k = 0; k < gpt.mtp_num_layers; ++k) {
      const std::string mtp = fmt::format("mtp.layers.{}", k);
      norm(mtp + ".enorm");
      norm(mtp + ".hnorm");
      add(mtp + ".eh_proj.weight", {h, 2 * h}, normal, 0);
      add_layer(mtp + ".transformer_layer", is_moe_layer(gpt.num_layers - 1));
      norm(mtp + ".final_layernorm");
    }
  }
  if (!gpt.share_embeddings_and_output_weights) {
    add("output_layer.weight", {padded_vocab_size, h}, normal, 0);
  }
  return params;
}

std::string MoeExpertWeightName(const std::string& mlp_prefix, int64_t e, int fc) {
  return fmt::format("{}.experts.local_experts.{}.linear_fc{}.weight", mlp_prefix, e, fc);
}

std::string MoeExpertBiasName(const std::string& mlp_prefix, int64_t e, int fc) {
  return fmt::format("{}.experts.local_experts.{}.linear_fc{}.bias", mlp_prefix, e, fc);
}

double MoeConfig::AuxLossCoeff(MoeLoadBalancing type) const {
  if (load_balancing_list.empty()) return load_balancing == type ? aux_loss_coeff : 0.0;
  for (size_t i = 0; i < load_balancing_list.size(); ++i) {
    if (load_balancing_list[i] == type) return aux_loss_coeff_list[i];
  }
  return 0.0;
}

RouterDTypes RouterDTypesOf(const MoeConfig& moe, DType storage) {
  if (storage == DType::kFloat64) return {DType::kFloat64, DType::kFloat64};
  DType logits = storage;
  if (moe.router_dtype) {
    logits = *moe.router_dtype == MoeRouterDType::kFp64 ? DType::kFloat64 : DType::kFloat32;
  }
  return {logits, DType::kFloat32};
}

}  // namespace mpusim
