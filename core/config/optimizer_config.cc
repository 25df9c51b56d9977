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
    {"min_lr", &OptimizerConfig::min_lr, "the learning rate the decay ends at", {}, 1,
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
    {"lr_warmup_iters", &OptimizerConfig::lr_warmup_iters,
     "iterations of linear warmup from 0 to lr", {}, 0},
    {"lr_decay_iters", &OptimizerConfig::lr_decay_iters,
     "iterations the decay spans (default run.train_iters)"},
    {"weight_decay", &OptimizerConfig::weight_decay, "decoupled weight decay (AdamW)", {}, 1,
     NumberRule::kNonNegative},
    {"adam_beta1", &OptimizerConfig::adam_beta1, "Adam's first-moment decay", {}, 1,
     NumberRule::kFraction},
    {"adam_beta2", &OptimizerConfig::adam_beta2, "Adam's second-moment decay", {}, 1,
     NumberRule::kFraction},
    {"adam_eps", &OptimizerConfig::adam_eps, "Adam's epsilon"},
    {"sgd_momentum", &OptimizerConfig::sgd_momentum, "SGD's momentum", {}, 1,
     NumberRule::kFraction},
    {"clip_grad", &OptimizerConfig::clip_grad,
     "the global gradient norm's limit; 0 turns clipping off", {}, 1,
     NumberRule::kNonNegative},
    // How the same update is laid out and scheduled over the ranks (FieldEffect::kLayout).
    {"use_distributed_optimizer", &OptimizerConfig::use_distributed_optimizer,
     "the optimizer state sharded over dp", "--distributed-optimizer", 1,
     NumberRule::kPositive, nullptr, FieldEffect::kLayout},
    {"overlap_grad_reduce", &OptimizerConfig::overlap_grad_reduce,
     "the bucketed gradient reduction overlapped with the backward (timing only)",
     "--overlap-grad-reduce", 1, NumberRule::kPositive, nullptr, FieldEffect::kLayout},
    {"overlap_param_gather", &OptimizerConfig::overlap_param_gather,
     "the distributed optimizer's parameter all-gather overlapped with the forward (timing "
     "only)",
     "--overlap-param-gather", 1, NumberRule::kPositive, nullptr, FieldEffect::kLayout},
    {"bucket_size", &OptimizerConfig::bucket_size,
     "parameters per gradient bucket when overlap_grad_reduce is on", {}, 1,
     NumberRule::kPositive, nullptr, FieldEffect::kLayout},
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
