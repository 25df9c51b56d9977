// The GPT model kind of the `model` section: Megatron-Core's GPTModel, configured with
// TransformerConfig's names and defaults.
//
// {
//   "model": {"type": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
//             "vocab_size": 1000, ...}
// }
//
// Its keys are declared once, in GptFields() (gpt_fields.cc): name, how each is read, default,
// meaning; the README's `model` key table is that table. Unknown keys are refused with a
// suggestion. ParseGptSection reads each value through the table, then resolves the defaults
// that depend on other keys (ffn_hidden_size 4 * hidden_size, kv_channels hidden_size /
// num_attention_heads, ...) and checks the rules between keys; CheckGptLayout checks what
// needs the layout and the run section (divisibility by the tensor-parallel size, sequence
// lengths), naming the field and what is allowed.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/config/field_table.h"
#include "core/init.h"
#include "core/ops/activation.h"  // Activation, ActivationName, IsGated
#include "core/ops/norm.h"        // Normalization, NormalizationName, IsCentered
#include "core/status.h"
#include "core/tensor.h"

namespace mpusim {

struct ParallelConfig;
struct RunConfig;

enum class PositionEmbedding : uint8_t { kLearnedAbsolute, kRope };
// How dropout masks are drawn (core/dropout.h).
enum class DropoutMode : uint8_t {
  kGlobal,      // every mask element a pure function of (seed, site, micro-batch, global index)
  kRngTracker,  // Megatron's: per-rank streams of its RNG tracker, local indices (core/dropout.h)
};

// Megatron's cp_comm_type: how attention under context parallelism reaches the keys and values
// of the other cp ranks' sequence chunks.
enum class CpCommType : uint8_t {
  kP2p,        // K/V passed around the cp ring, partial results merged by log-sum-exp
  kAllGather,  // K/V all-gathered over cp, dK/dV reduce-scattered back
  kA2a,        // heads exchanged with all-to-all (Ulysses)
  kA2aP2p,     // a2a inside hierarchical_context_parallel_sizes' first level, p2p across
};

// Megatron's AttnBackend (megatron/core/transformer/enums.py), in its order. "local" is
// Megatron's own DotProductAttention, "unfused" TransformerEngine's
// UnfusedDotProductAttention (both materialise the s x s probabilities), "flash"
// FlashAttention and "fused" cuDNN's fused attention through TransformerEngine (neither does),
// "auto" lets TransformerEngine choose (core/estimate/attention_backend.h).
enum class AttentionBackend : uint8_t { kFlash, kFused, kUnfused, kLocal, kAuto };

// Mixture of experts (Megatron's moe_* TransformerConfig fields, model section). Parsed and
// checked; core/model/moe.h runs it (expert_model_parallel_size 1 only, for now).
// TransformerConfig.fp8 and fp8_recipe (megatron/core/transformer/transformer_config.py).
enum class Fp8Format : uint8_t { kE4m3, kHybrid };
enum class Fp8Recipe : uint8_t { kDelayed, kTensorwise, kBlockwise, kMxfp8 };

// Megatron's moe_router_load_balancing_type values mpusim runs: the load-balancing loss over
// the micro-batch's tokens of a tp x cp group, per sample, or over the global batch (the counts
// summed over tp x dp x cp and averaged over the step's micro-batches; Qwen3's).
enum class MoeLoadBalancing : uint8_t { kAuxLoss, kSeqAuxLoss, kGlobalAuxLoss, kNone };
enum class MoeDispatcher : uint8_t { kAllGather, kAllToAll };
enum class MoeDropPolicy : uint8_t { kProbs, kPosition };
// TransformerConfig.moe_router_dtype: the router's GEMM, its probabilities and the weighting of
// the experts' outputs in float32 or float64 (null: the run's dtype).
enum class MoeRouterDType : uint8_t { kFp32, kFp64 };
// TransformerConfig.moe_router_score_function: the scores the top-k chooses from and the
// chosen probabilities are made of (softmax; sigmoid, DeepSeek-V3's; sqrtsoftplus,
// sqrt(softplus(logit))): sigmoid and sqrtsoftplus score each logit alone.
enum class MoeScoreFunction : uint8_t { kSoftmax, kSigmoid, kSqrtSoftplus };

struct MoeConfig {
  int64_t num_experts = 0;  // num_moe_experts; 0: a dense model
  int64_t router_topk = 2;
  // moe_ffn_hidden_size, resolved: the model's ffn_hidden_size unless given (0 until then)
  int64_t ffn_hidden_size = 0;
  // moe_layer_freq as given: an integer N makes layer i an MoE layer when i % N == 0, a list
  // of 0/1 gives the pattern itself.
  std::variant<int64_t, std::vector<bool>> layer_freq = int64_t{1};
  // moe_layer_freq resolved to one entry per layer (true: an MoE layer).
  std::vector<bool> layers;
  bool router_pre_softmax = false;
  // moe_router_load_balancing_type and moe_aux_loss_coeff: one type and its coefficient, or
  // (Megatron's list form, both keys lists of one length) several types, type i weighted by
  // coefficient i; the lists are empty in the single form. Read them through AuxLossCoeff.
  MoeLoadBalancing load_balancing = MoeLoadBalancing::kAuxLoss;
  double aux_loss_coeff = 0.0;
  std::vector<MoeLoadBalancing> load_balancing_list;
  std::vector<double> aux_loss_coeff_list;
  std::optional<double> z_loss_coeff;
  MoeDispatcher token_dispatcher = MoeDispatcher::kAllGather;
  std::optional<double> expert_capacity_factor;  // none: dropless
  MoeDropPolicy token_drop_policy = MoeDropPolicy::kProbs;
  bool pad_expert_input_to_capacity = false;
  std::optional<int64_t> shared_expert_intermediate_size;
  bool grouped_gemm = false;
  std::optional<MoeRouterDType> router_dtype;  // none: the run's dtype
  // DeepSeek-style routing (Megatron's topk_routing_with_score_function, moe_utils.py):
  MoeScoreFunction score_function = MoeScoreFunction::kSoftmax;
  std::optional<double> topk_scaling_factor;  // the chosen probabilities times it; none: 1
  // Group-limited top-k: the experts in num_groups equal groups, each token choosing from
  // the group_topk groups whose top (topk / group_topk) scores sum highest. Both none: off.
  std::optional<int64_t> num_groups, group_topk;
  // Aux-loss-free balancing: a float32 bias per expert added to the sigmoid scores for
  // choosing only, moved by bias_update_rate after each optimizer step against the experts'
  // token counts (Megatron's expert_bias, get_updated_expert_bias).
  bool enable_expert_bias = false;
  double bias_update_rate = 1e-3;

  bool enabled() const { return num_experts > 0; }
  bool group_limited() const { return group_topk.has_value(); }
  // Router.get_aux_loss_coeff: the coefficient of load-balancing loss `type` (0 when the
  // router does not compute it).
  double AuxLossCoeff(MoeLoadBalancing type) const;
  // sigmoid or sqrtsoftplus: a score per logit, the chosen ones normalised (Megatron's
  // shared branch of topk_routing_with_score_function).
  bool PerLogitScores() const { return score_function != MoeScoreFunction::kSoftmax; }
};

// The dtypes of an MoE router's tensors in a run storing `storage` (Megatron's TopKRouter,
// megatron/core/transformer/moe/router.py gating and moe_utils.py
// topk_routing_with_score_function):
//   logits  the gating GEMM's output (router_gating_linear casts x and the weight to it),
//           the probabilities the dispatcher carries (probs.type_as(logits)) and the
//           weighting of the experts' outputs (per_token_scale, computed in it and rounded to
//           the run's dtype): moe_router_dtype, else the run's dtype; a float64 run keeps
//           float64 (mpusim's own precision, never lowered)
//   scores  the softmaxes, over all experts and over the chosen k
//           (torch.softmax(..., dtype=torch.float32)): float32, float64 in a float64 run
struct RouterDTypes {
  DType logits;
  DType scores;
};
RouterDTypes RouterDTypesOf(const MoeConfig& moe, DType storage);

// Megatron's softmax_type (TransformerConfig): the attention softmax as it is, or with an
// attention sink, a logit in each row's denominator only: 0 ("off-by-one") or a learnable
// one per head ("learnable", the parameter core_attention.softmax_offset).
enum class SoftmaxType : uint8_t { kVanilla, kOffByOne, kLearnable };
// Multi-latent attention (DeepSeek-V2/V3; Megatron's MLATransformerConfig fields, model
// section, MLATransformerConfig's defaults), built with the local layer spec's MLASelfAttention
// (megatron/core/transformer/multi_latent_attention.py). Read only with enabled.
enum class MlaRopeType : uint8_t { kRope, kYarn };

struct MlaConfig {
  bool enabled = false;                      // multi_latent_attention
  std::optional<int64_t> q_lora_rank = 512;  // null: linear_q_proj, no query down projection
  int64_t kv_lora_rank = 512;
  int64_t qk_head_dim = 128;         // a head's query/key channels without rope
  int64_t qk_pos_emb_head_dim = 64;  // a head's rope channels (the key's shared by the heads)
  int64_t v_head_dim = 128;
  MlaRopeType rope_type = MlaRopeType::kYarn;
  double rotary_scaling_factor = 40.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;

  // A query's and a key's channels: qk_head_dim + qk_pos_emb_head_dim.
  int64_t QHeadDim() const { return qk_head_dim + qk_pos_emb_head_dim; }
};

struct GptConfig {
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t ffn_hidden_size = 0;   // resolved: 4 * hidden_size unless given
  int64_t kv_channels = 0;       // resolved: hidden_size / num_attention_heads unless given
  int64_t num_query_groups = 0;  // resolved: num_attention_heads unless given
  Normalization normalization = Normalization::kLayerNorm;
  double layernorm_epsilon = 1e-5;
  Activation activation = Activation::kGelu;
  // A gated activation's glu (Megatron's names and defaults): y = f(a) (b + offset), with a
  // clamped above and b on both sides by activation_func_clamp_value when set (gpt-oss: 1, 7).
  double glu_linear_offset = 0.0;
  std::optional<double> activation_func_clamp_value;
  bool add_bias_linear = true;
  bool add_qkv_bias = false;  // linear_qkv has a bias with add_bias_linear or add_qkv_bias
  double hidden_dropout = 0.1;
  double attention_dropout = 0.1;
  PositionEmbedding position_embedding_type = PositionEmbedding::kLearnedAbsolute;
  double rotary_base = 10000.0;
  double rotary_percent = 1.0;  // (0, 1]: RoPE turns the first RotaryDim() channels of a head
  bool qk_layernorm = false;
  int64_t max_position_embeddings = 0;  // 0: run.seq_length (resolved by CheckGptLayout)
  bool share_embeddings_and_output_weights = true;
  double init_method_std = 0.02;
  int64_t vocab_size = 0;
  int64_t make_vocab_size_divisible_by = 128;
  double label_smoothing = 0.0;
  DropoutMode dropout_mode = DropoutMode::kGlobal;
  CpCommType cp_comm_type = CpCommType::kP2p;  // Megatron's default
  AttentionBackend attention_backend = AttentionBackend::kAuto;  // Megatron's default
  std::optional<Fp8Format> fp8;                // none: the linear layers in the run's dtype
  Fp8Recipe fp8_recipe = Fp8Recipe::kDelayed;  // Megatron's default
  MoeConfig moe;
  // Multi-token prediction (Megatron's MultiTokenPredictionBlock, DeepSeek-V3): mtp_num_layers
  // depths after the decoder on the last pipeline stage, each predicting the token k + 1 ahead;
  // 0 (Megatron's None): none. Their losses, averaged over the depths and times
  // mtp_loss_scaling_factor, join the gradient but not the reported loss.
  int64_t mtp_num_layers = 0;
  double mtp_loss_scaling_factor = 0.1;
  // gpt-oss's attention (TransformerConfig.window_size, window_attn_skip_freq, softmax_type).
  // window_size [left, right] as Transformer Engine / flash-attn read it: query q sees keys
  // q - left .. q + right; a causal model takes [w, 0] (w >= 0) or [-1, 0] (no window).
  std::optional<std::array<int64_t, 2>> window_size;
  // window_attn_skip_freq as given: an integer N makes every N-th layer (layer number i + 1
  // divisible by N) a full-attention layer, a list of 0/1 per layer marks the sliding-window
  // layers with 1; none: every layer slides.
  std::optional<std::variant<int64_t, std::vector<bool>>> window_attn_skip_freq;
  SoftmaxType softmax_type = SoftmaxType::kVanilla;
  MlaConfig mla;
  // TransformerConfig fields given that change nothing mpusim computes, one line each
  // ("model.bias_dropout_fusion: ignored: why"), printed as notes.
  std::vector<std::string> ignored;

  // Megatron's _vocab_size_with_padding.
  int64_t PaddedVocabSize(int64_t tensor_model_parallel_size) const;
  // Rows of the fused QKV weight: (num_attention_heads + 2 * num_query_groups) * kv_channels.
  int64_t QkvRows() const { return (num_attention_heads + 2 * num_query_groups) * kv_channels; }
  // The glu the kernels take (GluOptions, core/ops/activation.h).
  GluOptions Glu() const {
    return {.linear_offset = glu_linear_offset,
            .clamped = activation_func_clamp_value.has_value(),
            .clamp_value = activation_func_clamp_value.value_or(0.0)};
  }
  // Rows of fc1: ffn_hidden_size, or 2 * ffn_hidden_size for a gated activation (swiglu).
  int64_t Fc1Rows() const { return IsGated(activation) ? 2 * ffn_hidden_size : ffn_hidden_size; }
  // Core attention's head dims: a query's and a key's (kv_channels; multi-latent attention's
  // qk_head_dim + qk_pos_emb_head_dim), a value's (kv_channels; MLA's v_head_dim).
  int64_t QueryKeyHeadDim() const { return mla.enabled ? mla.QHeadDim() : kv_channels; }
  int64_t ValueHeadDim() const { return mla.enabled ? mla.v_head_dim : kv_channels; }
  // Channels of a head RoPE turns: Megatron's int(kv_channels * rotary_percent).
  int64_t RotaryDim() const {
    return static_cast<int64_t>(static_cast<double>(kv_channels) * rotary_percent);
  }
  // The sliding window of layer `layer` (0-based): window_size[0] when the layer slides
  // (Megatron's is_layer_window_attention on its layer number layer + 1) and the window is
  // one (left >= 0), else -1 (full causal attention).
  int64_t AttentionWindow(int64_t layer) const;
  // Some layer has a sliding window.
  bool HasSlidingWindow() const;
  bool has_position_embeddings() const {
    return position_embedding_type == PositionEmbedding::kLearnedAbsolute;
  }
};

const char* PositionEmbeddingName(PositionEmbedding p);    // "learned_absolute", "rope"
const char* DropoutModeName(DropoutMode m);                // "global", "rng_tracker"
const char* CpCommTypeName(CpCommType c);  // "p2p", "all_gather", "a2a", "a2a+p2p"
const char* AttentionBackendName(AttentionBackend b);  // "flash", ..., "auto"
// Every AttentionBackend's name, in enum order (for flags that take one).
const std::vector<std::string_view>& AttentionBackendNames();
const char* Fp8FormatName(Fp8Format f);    // "e4m3", "hybrid"
const char* Fp8RecipeName(Fp8Recipe r);    // "delayed", "tensorwise", "blockwise", "mxfp8"
const char* MoeRouterDTypeName(MoeRouterDType d);  // "fp32", "fp64"
const char* MoeScoreFunctionName(MoeScoreFunction f);     // "softmax", "sigmoid", "sqrtsoftplus"
const char* MoeLoadBalancingName(MoeLoadBalancing type);  // "aux_loss", ...
const char* SoftmaxTypeName(SoftmaxType t);        // "vanilla", "off-by-one", "learnable"
const char* MlaRopeTypeName(MlaRopeType r);        // "rope", "yarn"

// The keys of a GPT `model` section, each declared once (gpt_fields.cc), in documentation
// order. The integer sizes Megatron resolves from other keys (ffn_hidden_size, kv_channels,
// num_query_groups, num_moe_experts, moe_ffn_hidden_size) are read as 0 when null or absent,
// and resolved by ParseGptSection.
std::span<const Field<GptConfig>> GptFields();
// Their names, in that order.
const std::vector<std::string_view>& GptConfigKeys();
// The TransformerConfig fields a GPT section accepts with a note (or refuses unless at the
// value mpusim computes).
bool IsAcceptedTransformerField(std::string_view key);

// True when the `model` section has a "type" key: the GPT kind (a chain has none).
bool IsGptSection(const nlohmann::json& section);

// Parses a `model` section with "type": "gpt". Errors name "model.<key>".
Status ParseGptSection(const nlohmann::json& section, GptConfig* out);

// Checks the model against the layout and the run section and resolves the defaults that
// depend on them (max_position_embeddings). Errors name the field: "model.num_query_groups:
// 6 is not divisible by tensor_model_parallel_size 4".
Status CheckGptLayout(const ParallelConfig& parallel, const RunConfig& run, GptConfig* gpt);

// One parameter of the model: Megatron-Core GPTModel's state-dict name (local layer spec),
// its full shape, how its master values are drawn, and how tensor parallelism splits it.
struct GptParameter {
  std::string name;     // "decoder.layers.0.self_attention.linear_qkv.weight"
  Shape shape;          // full
  InitSpec init;        // normal(std) weights, kZeros biases, kOnes normalization weights
  int tp_dim = -1;      // split over tp along this dim (-1: replicated)
  int64_t tp_stride = 1;  // Megatron's stride (2 for swiglu's fc1: [gate; up] per rank)
  // Replicated over tp, each rank's gradient a partial sum, so all-reduced over tp: fed by
  // the sequence-split stream under sequence parallelism (Megatron's `sequence_parallel`
  // attribute), or a query/key layer norm, which each rank applies to its own heads
  // (finalize_model_grads all-reduces those whenever tp > 1).
  bool allreduce_grad_over_tp = false;
};

// Every parameter in state-dict order: embedding, then each layer, then final norm and output
// layer (absent when shared with the word embeddings). `padded_vocab_size` is the layout's
// Vp; `sequence_parallel` marks the norm weights and the row-parallel biases (the q/k layer
// norms are marked whatever it is).
// `keep_layer` / `keep_expert`, when given, leave out the layers and experts they refuse (a
// rank's own model lists only its stages' layers and its ep rank's experts, without naming
// the others').
std::vector<GptParameter> GptParameters(
    const GptConfig& gpt, int64_t padded_vocab_size, bool sequence_parallel,
    const std::function<bool(int64_t)>& keep_layer = {},
    const std::function<bool(int64_t)>& keep_expert = {});

// The state-dict name of expert `e`'s fc1 (`fc` 1) or fc2 (`fc` 2) weight in the MoE layer
// `mlp_prefix` ("decoder.layers.<i>.mlp"):
// "<mlp_prefix>.experts.local_experts.<e>.linear_fc1.weight", `e` the global expert number.
// Megatron's local spec builds SequentialMLP whatever moe_grouped_gemm says (backends.py
// LocalSpecProvider.grouped_mlp_modules), so the flag changes no name, no initial value and no
// number; it only shapes the GPU estimate's launches.
std::string MoeExpertWeightName(const std::string& mlp_prefix, int64_t e, int fc);
// Its bias (add_bias_linear): "<mlp_prefix>.experts.local_experts.<e>.linear_fc<fc>.bias".
std::string MoeExpertBiasName(const std::string& mlp_prefix, int64_t e, int fc);

}  // namespace mpusim
