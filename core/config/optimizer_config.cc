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

#include "core/config/json_fields.h"

namespace mpusim {

namespace {

// A finite number >= 0.
Status ParseNonNegative(const nlohmann::json& value, const std::string& where, double* out) {
  if (!value.is_number() || value.is_boolean() || !std::isfinite(value.get<double>()) ||
      value.get<double>() < 0) {
    return Status::Error(where,
                         fmt::format("must be a finite number >= 0, got {}", DescribeJson(value)));
  }
  *out = value.get<double>();
  return {};
}

}  // namespace

const std::vector<std::string_view>& OptimizerConfigKeys() {
  static const std::vector<std::string_view> kKeys = {"optimizer",
                                                      "lr",
                                                      "min_lr",
                                                      "lr_decay_style",
                                                      "lr_warmup_iters",
                                                      "lr_decay_iters",
                                                      "weight_decay",
                                                      "adam_beta1",
                                                      "adam_beta2",
                                                      "adam_eps",
                                                      "sgd_momentum",
                                                      "clip_grad",
                                                      "use_distributed_optimizer",
                                                      "overlap_grad_reduce",
                                                      "overlap_param_gather",
                                                      "bucket_size"};
  return kKeys;
}

Status ParseOptimizerSection(const nlohmann::json& section, OptimizerConfig* out) {
  const std::string prefix = "optimizer";
  if (!section.is_object()) {
    return Status::Error(prefix,
                         fmt::format("must be a JSON object, got {}", DescribeJson(section)));
  }
  const std::vector<std::string_view>& kKeys = OptimizerConfigKeys();
  OptimizerConfig c;
  for (const auto& [key, value] : section.items()) {
    const std::string where = prefix + "." + key;
    if (std::find(kKeys.begin(), kKeys.end(), key) == kKeys.end()) {
      return UnknownKey(where, key, kKeys);
    }
    if (key == "optimizer") {
      if (value == "adam" || value == "adamw") {  // Megatron's "adam" is AdamW
        c.kind = OptimizerConfig::Kind::kAdam;
      } else if (value == "sgd") {
        c.kind = OptimizerConfig::Kind::kSgd;
      } else {
        return Status::Error(
            where, fmt::format("must be \"adam\" (AdamW; \"adamw\" is accepted too) or \"sgd\", got {}", DescribeJson(value)));
      }
    } else if (key == "lr") {
      MPUSIM_RETURN_IF_ERROR(ParsePositive(value, where, &c.lr));
    } else if (key == "min_lr") {
      MPUSIM_RETURN_IF_ERROR(ParseNonNegative(value, where, &c.min_lr));
    } else if (key == "lr_decay_style") {
      if (value == "constant") {
        c.lr_decay_style = OptimizerConfig::DecayStyle::kConstant;
      } else if (value == "linear") {
        c.lr_decay_style = OptimizerConfig::DecayStyle::kLinear;
      } else if (value == "cosine") {
        c.lr_decay_style = OptimizerConfig::DecayStyle::kCosine;
      } else {
        return Status::Error(where, fmt::format("must be \"constant\", \"linear\" or \"cosine\", "
                                                "got {}",
                                                DescribeJson(value)));
      }
    } else if (key == "lr_warmup_iters") {
      MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 0, &c.lr_warmup_iters));
    } else if (key == "lr_decay_iters") {
      MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &c.lr_decay_iters));
    } else if (key == "weight_decay") {
      MPUSIM_RETURN_IF_ERROR(ParseNonNegative(value, where, &c.weight_decay));
    } else if (key == "adam_beta1") {
      MPUSIM_RETURN_IF_ERROR(ParseFraction(value, where, &c.adam_beta1));
    } else if (key == "adam_beta2") {
      MPUSIM_RETURN_IF_ERROR(ParseFraction(value, where, &c.adam_beta2));
    } else if (key == "adam_eps") {
      MPUSIM_RETURN_IF_ERROR(ParsePositive(value, where, &c.adam_eps));
    } else if (key == "sgd_momentum") {
      MPUSIM_RETURN_IF_ERROR(ParseFraction(value, where, &c.sgd_momentum));
    } else if (key == "clip_grad") {
      MPUSIM_RETURN_IF_ERROR(ParseNonNegative(value, where, &c.clip_grad));
    } else if (key == "use_distributed_optimizer") {
      MPUSIM_RETURN_IF_ERROR(ParseBool(value, where, &c.use_distributed_optimizer));
    } else if (key == "overlap_grad_reduce") {
      MPUSIM_RETURN_IF_ERROR(ParseBool(value, where, &c.overlap_grad_reduce));
    } else if (key == "overlap_param_gather") {
      MPUSIM_RETURN_IF_ERROR(ParseBool(value, where, &c.overlap_param_gather));
    } else if (key == "bucket_size") {
      MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &c.bucket_size));
    }
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
  if (!section.contains("lr")) {
    return Status::Error(prefix + ".lr", "is required (the peak learning rate, e.g. \"lr\": 1e-3)");
  }
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
