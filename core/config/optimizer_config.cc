// The optimizer section and the learning-rate schedule (see optimizer_config.h).
#include "core/config/optimizer_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>
#include <string>
#include <string_view>
#include <vector>

#include "core/config/field_table.h"
#include "core/config/json_fields.h"

namespace mpusim {

namespace {

using nlohmann::json;
using OptimizerField = Field<OptimizerConfig>;

// Megatron's names of the precision-aware optimizer's dtypes (megatron/training/arguments.py
// map_dtype): "fp32", "bf16", "fp16". `kAllowed` lists the 16-bit ones a key takes.
enum AllowedHalf : int { kBf16 = 1, kFp16 = 2 };

std::string_view MegatronDTypeName(DType dtype) {
  return dtype == DType::kBFloat16 ? "bf16" : dtype == DType::kFloat16 ? "fp16" : "fp32";
}

template <DType OptimizerConfig::*kMember, int kAllowed>
Status ParseOptimizerDType(const json& value, const std::string& where, OptimizerConfig* c) {
  std::string allowed = "\"fp32\"";
  if (kAllowed & kBf16) allowed += (kAllowed & kFp16) ? ", \"bf16\"" : " or \"bf16\"";
  if (kAllowed & kFp16) allowed += " or \"fp16\"";
  const std::string name = value.is_string() ? value.get<std::string>() : std::string();
  if (name == "fp32") {
    c->*kMember = DType::kFloat32;
  } else if (name == "bf16" && (kAllowed & kBf16)) {
    c->*kMember = DType::kBFloat16;
  } else if (name == "fp16" && (kAllowed & kFp16)) {
    c->*kMember = DType::kFloat16;
  } else if (name == "fp8") {
    return Status::Error(where, fmt::format("\"fp8\" optimizer states are not built (mpusim "
                                            "has no fp8 tensors); allowed: {}",
                                            allowed));
  } else {
    return Status::Error(
        where, fmt::format("must be {} (Megatron's names), got {}", allowed, DescribeJson(value)));
  }
  return Status();
}

template <DType OptimizerConfig::*kMember>
json EchoOptimizerDType(const OptimizerConfig& c) {
  return json(std::string(MegatronDTypeName(c.*kMember)));
}

template <DType OptimizerConfig::*kMember, int kAllowed>
constexpr Codec<OptimizerConfig> kDTypeCodec{
    FieldKind::kText, ParseOptimizerDType<kMember, kAllowed>, EchoOptimizerDType<kMember>};

// The section's keys, in documentation order.
constexpr OptimizerField kFields[] = {
    {"optimizer",
     Codec<OptimizerConfig>{
         FieldKind::kText,
         [](const json& value, const std::string& where, OptimizerConfig* c) {
           if (value == "adam" || value == "adamw") {  // Megatron's "adam" is AdamW
             c->kind = OptimizerConfig::Kind::kAdam;
           } else if (value == "sgd") {
             c->kind = OptimizerConfig::Kind::kSgd;
           } else {
             return Status::Error(where, fmt::format("must be \"adam\" (AdamW; \"adamw\" is "
                                                     "accepted too) or \"sgd\", got {}",
                                                     DescribeJson(value)));
           }
           return Status();
         },
         [](const OptimizerConfig& c) {
           return json(c.kind == OptimizerConfig::Kind::kAdam ? "adam" : "sgd");
         }},
     "adam (AdamW) or sgd"},
    {.key = "lr",
     .target = &OptimizerConfig::lr,
     .help = "the peak learning rate",
     .required = "the peak learning rate, e.g. \"lr\": 1e-3"},
    {"min_lr",
     &OptimizerConfig::min_lr,
     "the learning rate the decay ends at",
     {},
     1,
     NumberRule::kNonNegative},
    {"lr_decay_style",
     Codec<OptimizerConfig>{
         FieldKind::kText,
         [](const json& value, const std::string& where, OptimizerConfig* c) {
           if (value == "constant") {
             c->lr_decay_style = OptimizerConfig::DecayStyle::kConstant;
           } else if (value == "linear") {
             c->lr_decay_style = OptimizerConfig::DecayStyle::kLinear;
           } else if (value == "cosine") {
             c->lr_decay_style = OptimizerConfig::DecayStyle::kCosine;
           } else {
             return Status::Error(where, fmt::format("must be \"constant\", \"linear\" or "
                                                     "\"cosine\", got {}",
                                                     DescribeJson(value)));
           }
           return Status();
         },
         [](const OptimizerConfig& c) {
           return json(c.lr_decay_style == OptimizerConfig::DecayStyle::kConstant ? "constant"
                       : c.lr_decay_style == OptimizerConfig::DecayStyle::kLinear ? "linear"
                                                                                   : "cosine");
         }},
     "constant, linear or cosine"},
    {"lr_warmup_iters",
     &OptimizerConfig::lr_warmup_iters,
     "iterations of linear warmup from 0 to lr",
     {},
     0},
    {"lr_decay_iters", &OptimizerConfig::lr_decay_iters,
     "iterations the decay spans (default run.train_iters)"},
    {"weight_decay",
     &OptimizerConfig::weight_decay,
     "decoupled weight decay (AdamW)",
     {},
     1,
     NumberRule::kNonNegative},
    {"adam_beta1",
     &OptimizerConfig::adam_beta1,
     "Adam's first-moment decay",
     {},
     1,
     NumberRule::kFraction},
    {"adam_beta2",
     &OptimizerConfig::adam_beta2,
     "Adam's second-moment decay",
     {},
     1,
     NumberRule::kFraction},
    {"adam_eps", &OptimizerConfig::adam_eps, "Adam's epsilon"},
    {"sgd_momentum",
     &OptimizerConfig::sgd_momentum,
     "SGD's momentum",
     {},
     1,
     NumberRule::kFraction},
    {"clip_grad",
     &OptimizerConfig::clip_grad,
     "the global gradient norm's limit; 0 turns clipping off",
     {},
     1,
     NumberRule::kNonNegative},
    // How the same update is laid out and scheduled over the ranks (FieldEffect::kLayout).
    {"use_distributed_optimizer", &OptimizerConfig::use_distributed_optimizer,
     "the optimizer state sharded over dp", "--distributed-optimizer", 1, NumberRule::kPositive,
     nullptr, FieldEffect::kLayout},
    {.key = "use_torch_fsdp2",
     .target = &OptimizerConfig::use_torch_fsdp2,
     .help = "PyTorch's FSDP2 (fully_shard) over dp x cp: parameters sharded, gathered per module",
     .flag = "--use-torch-fsdp2",
     .effect = FieldEffect::kLayout},
    {.key = "torch_fsdp2_reshard_after_forward",
     .target = &OptimizerConfig::torch_fsdp2_reshard_after_forward,
     .help = "FSDP2 releases each module's gathered parameters after its forward",
     .effect = FieldEffect::kLayout},
    {"overlap_grad_reduce", &OptimizerConfig::overlap_grad_reduce,
     "the bucketed gradient reduction overlapped with the backward (timing only)",
     "--overlap-grad-reduce", 1, NumberRule::kPositive, nullptr, FieldEffect::kLayout},
    {"overlap_param_gather", &OptimizerConfig::overlap_param_gather,
     "the distributed optimizer's parameter all-gather overlapped with the forward (timing "
     "only)",
     "--overlap-param-gather", 1, NumberRule::kPositive, nullptr, FieldEffect::kLayout},
    {"bucket_size",
     &OptimizerConfig::bucket_size,
     "parameters per gradient bucket when overlap_grad_reduce is on",
     {},
     1,
     NumberRule::kPositive,
     nullptr,
     FieldEffect::kLayout},
    // The dtypes of the gradient buffer and the optimizer's tensors (PrecisionOf).
    {.key = "accumulate_allreduce_grads_in_fp32",
     .target = &OptimizerConfig::accumulate_allreduce_grads_in_fp32,
     .help = "main_grad accumulated and reduced in float32 (forced for bf16; off for fp16)",
     .flag = "--accumulate-allreduce-grads-in-fp32",
     .effect = FieldEffect::kPrecision},
    {.key = "grad_reduce_in_bf16",
     .target = &OptimizerConfig::grad_reduce_in_bf16,
     .help = "a bf16 run's main_grad in bfloat16",
     .flag = "--grad-reduce-in-bf16",
     .effect = FieldEffect::kPrecision},
    {.key = "use_precision_aware_optimizer",
     .target = &OptimizerConfig::use_precision_aware_optimizer,
     .help = "Transformer Engine's FusedAdam with the four dtypes below",
     .effect = FieldEffect::kPrecision},
    {.key = "main_grads_dtype",
     .target = kDTypeCodec<&OptimizerConfig::main_grads_dtype, kBf16>,
     .help = "fp32 or bf16: a bf16 run's main_grad (precision-aware optimizer)",
     .effect = FieldEffect::kPrecision},
    {.key = "main_params_dtype",
     .target = kDTypeCodec<&OptimizerConfig::main_params_dtype, kFp16>,
     .help = "fp32 or fp16: the master weights (precision-aware optimizer)",
     .effect = FieldEffect::kPrecision},
    {.key = "exp_avg_dtype",
     .target = kDTypeCodec<&OptimizerConfig::exp_avg_dtype, kBf16 | kFp16>,
     .help = "fp32, bf16 or fp16: Adam's first moment (precision-aware optimizer)",
     .effect = FieldEffect::kPrecision},
    {.key = "exp_avg_sq_dtype",
     .target = kDTypeCodec<&OptimizerConfig::exp_avg_sq_dtype, kBf16 | kFp16>,
     .help = "fp32, bf16 or fp16: Adam's second moment (precision-aware optimizer)",
     .effect = FieldEffect::kPrecision},
    {.key = "store_param_remainders",
     .target = &OptimizerConfig::store_param_remainders,
     .help = "an fp32 master kept as the bf16 parameter + a 16-bit remainder (precision-aware "
             "optimizer, bf16 runs)",
     .effect = FieldEffect::kPrecision},
};

}  // namespace

std::span<const Field<OptimizerConfig>> OptimizerFields() { return kFields; }

const std::vector<std::string_view>& OptimizerConfigKeys() {
  static const std::vector<std::string_view> kKeys = KeysOf(OptimizerFields());
  return kKeys;
}

Status ParseOptimizerSection(const nlohmann::json& section, OptimizerConfig* out) {
  const std::string prefix = "optimizer";
  if (!section.is_object()) {
    return Status::Error(prefix,
                         fmt::format("must be a JSON object, got {}", DescribeJson(section)));
  }
  OptimizerConfig c;
  for (const auto& [key, value] : section.items()) {
    const std::string where = prefix + "." + key;
    const OptimizerField* field = FindField(OptimizerFields(), key);
    if (field == nullptr) return UnknownKey(where, key, OptimizerConfigKeys());
    MPUSIM_RETURN_IF_ERROR(field->Parse(value, where, &c));
  }
  // Megatron's own checks (megatron/training/arguments.py, validate_args).
  if (c.overlap_param_gather && !c.use_distributed_optimizer) {
    return Status::Error(prefix + ".overlap_param_gather",
                         "needs use_distributed_optimizer true (the all-gather it overlaps is "
                         "the distributed optimizer's; Megatron refuses it too)");
  }
  if (c.overlap_param_gather && !c.overlap_grad_reduce) {
    return Status::Error(prefix + ".overlap_param_gather",
                         "needs overlap_grad_reduce true (Megatron: \"Must use "
                         "--overlap-param-gather with --overlap-grad-reduce\")");
  }
  if (c.use_torch_fsdp2 && c.use_distributed_optimizer) {
    return Status::Error(prefix + ".use_torch_fsdp2",
                         "cannot be combined with use_distributed_optimizer (Megatron: "
                         "\"--use-torch-fsdp2 is not supported with MCore's distributed "
                         "optimizer\"); FSDP2 shards the optimizer state itself");
  }
  if (!c.torch_fsdp2_reshard_after_forward && !c.use_torch_fsdp2) {
    return Status::Error(prefix + ".torch_fsdp2_reshard_after_forward",
                         "is false, but use_torch_fsdp2 is not true (it is FSDP2's setting)");
  }
  if (c.use_precision_aware_optimizer && c.kind != OptimizerConfig::Kind::kAdam) {
    return Status::Error(prefix + ".use_precision_aware_optimizer",
                         "needs optimizer \"adam\" (Megatron: \"--use-precision-aware-optimizer "
                         "only supported with adam\")");
  }
  if (c.use_precision_aware_optimizer && !c.use_distributed_optimizer) {
    return Status::Error(prefix + ".use_precision_aware_optimizer",
                         "needs use_distributed_optimizer true (Megatron: \"only supported with "
                         "distributed optimizer\")");
  }
  if (!c.use_precision_aware_optimizer) {
    for (const auto& [key, dtype] : {std::pair{"main_grads_dtype", c.main_grads_dtype},
                                     {"main_params_dtype", c.main_params_dtype},
                                     {"exp_avg_dtype", c.exp_avg_dtype},
                                     {"exp_avg_sq_dtype", c.exp_avg_sq_dtype}}) {
      if (dtype != DType::kFloat32) {
        return Status::Error(prefix + "." + key,
                             fmt::format("\"{}\" needs use_precision_aware_optimizer true "
                                         "(Megatron: \"{} can only be fp32 when not using "
                                         "precision-aware optimizer\")",
                                         MegatronDTypeName(dtype), key));
      }
    }
  }
  MPUSIM_RETURN_IF_ERROR(CheckRequired(OptimizerFields(), section, prefix));
  if (c.min_lr > c.lr) {
    return Status::Error(prefix + ".min_lr", fmt::format("{} is above lr {}", c.min_lr, c.lr));
  }
  if (c.lr_decay_iters && *c.lr_decay_iters <= c.lr_warmup_iters &&
      c.lr_decay_style != OptimizerConfig::DecayStyle::kConstant) {
    return Status::Error(
        prefix + ".lr_decay_iters",
        fmt::format("{} must exceed lr_warmup_iters {}", *c.lr_decay_iters, c.lr_warmup_iters));
  }
  *out = c;
  return {};
}

OptimizerPrecision PrecisionOf(const OptimizerConfig* optimizer, DType storage) {
  const OptimizerConfig defaults;
  const OptimizerConfig& c = optimizer != nullptr ? *optimizer : defaults;
  if (storage == DType::kFloat64) {
    return {DType::kFloat64, DType::kFloat64, DType::kFloat64, DType::kFloat64, false, false};
  }
  // megatron/training/arguments.py: for bf16, accumulate_allreduce_grads_in_fp32 is forced
  // on unless grad_reduce_in_bf16 or main_grads_dtype bf16; for fp16 it stays as given.
  bool in_fp32 = c.accumulate_allreduce_grads_in_fp32;
  if (storage == DType::kBFloat16 && !c.grad_reduce_in_bf16 &&
      c.main_grads_dtype == DType::kFloat32) {
    in_fp32 = true;
  }
  OptimizerPrecision out;
  // DistributedDataParallel: grad_dtype = float32 if grad_reduce_in_fp32 else param.dtype.
  out.main_grad = in_fp32 ? DType::kFloat32 : storage;
  out.master = c.main_params_dtype;
  out.exp_avg = c.exp_avg_dtype;
  out.exp_avg_sq = c.exp_avg_sq_dtype;
  out.grads_copied_for_step = out.main_grad != DType::kFloat32 && !c.use_precision_aware_optimizer;
  // Megatron passes store_param_remainders to FusedAdam, which keeps it only with float32
  // master weights (`store_param_remainders and master_weights and master_weight_dtype ==
  // torch.float32`) and applies it to bf16 parameters (`p.dtype == torch.bfloat16`).
  out.param_remainders = c.use_precision_aware_optimizer && c.store_param_remainders &&
                         storage == DType::kBFloat16 && out.master == DType::kFloat32;
  return out;
}

int64_t MasterBytes(const OptimizerPrecision& precision) {
  return precision.param_remainders ? 2 : static_cast<int64_t>(DTypeSize(precision.master));
}

std::string MasterStorageName(const OptimizerPrecision& precision) {
  return precision.param_remainders ? "bfloat16 parameter + int16 remainder"
                                    : std::string(DTypeName(precision.master));
}

Status CheckOptimizerPrecision(const OptimizerConfig& c, DType storage) {
  const std::string prefix = "optimizer.";
  if (c.grad_reduce_in_bf16 && storage != DType::kBFloat16) {
    return Status::Error(
        prefix + "grad_reduce_in_bf16",
        fmt::format("applies to bf16 runs only (this run stores {}); drop it", DTypeName(storage)));
  }
  if (c.main_grads_dtype == DType::kBFloat16 && storage != DType::kBFloat16) {
    return Status::Error(
        prefix + "main_grads_dtype",
        fmt::format("\"bf16\" applies to bf16 runs only (this run stores {})", DTypeName(storage)));
  }
  if (storage == DType::kBFloat16 && c.accumulate_allreduce_grads_in_fp32 &&
      c.main_grads_dtype != DType::kFloat32) {
    return Status::Error(prefix + "main_grads_dtype",
                         "must be \"fp32\" with accumulate_allreduce_grads_in_fp32 true "
                         "(Megatron: \"--main-grads-dtype can only be fp32 when "
                         "--accumulate-allreduce-grads-in-fp32 is set\")");
  }
  if (c.use_precision_aware_optimizer && storage == DType::kFloat64) {
    return Status::Error(prefix + "use_precision_aware_optimizer",
                         "a float64 run keeps every optimizer tensor in float64; the "
                         "precision-aware optimizer needs run.dtype float32, bfloat16 or "
                         "float16");
  }
  return {};
}

double LearningRate(const OptimizerConfig& c, int64_t k, int64_t train_iters) {
  const int64_t warmup = c.lr_warmup_iters;
  const int64_t decay = c.lr_decay_iters.value_or(train_iters);
  if (warmup > 0 && k < warmup) {
    return c.lr * static_cast<double>(k) / static_cast<double>(warmup);
  }
  if (c.lr_decay_style == OptimizerConfig::DecayStyle::kConstant) return c.lr;
  if (k > decay) return c.min_lr;
  if (decay <= warmup) return c.min_lr;
  const double ratio = static_cast<double>(k - warmup) / static_cast<double>(decay - warmup);
  const double coeff = c.lr_decay_style == OptimizerConfig::DecayStyle::kLinear
                           ? 1.0 - ratio
                           : 0.5 * (std::cos(std::numbers::pi * ratio) + 1.0);
  return c.min_lr + coeff * (c.lr - c.min_lr);
}

bool TakesWeightDecay(std::string_view name, int64_t ndim) {
  return !name.ends_with(".bias") && ndim != 1;
}

}  // namespace mpusim
