// The "optimizer" section of a config: Megatron's optimizer and learning-rate arguments, and
// the learning rate of an iteration (Megatron's OptimizerParamScheduler).
//
//   "optimizer": {
//     "optimizer": "adam",       "adam" (AdamW: decoupled weight decay, as Megatron's fused
//                                Adam) or "sgd" (momentum sgd_momentum), default "adam"
//     "lr": 1e-3,                required: the peak learning rate
//     "min_lr": 0,               the floor the decay ends at
//     "lr_decay_style": "linear",  "constant", "linear" or "cosine"
//     "lr_warmup_iters": 0,      iterations of linear warmup from 0 to lr
//     "lr_decay_iters": null,    iterations over which lr decays (default: run.train_iters)
//     "weight_decay": 0.01,      not applied to biases and other 1-D parameters (norms)
//     "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8,
//     "sgd_momentum": 0.9,
//     "clip_grad": 1.0,          the global gradient norm's limit; 0 turns clipping off
//     "use_distributed_optimizer": false
//                                shard the optimizer state over the data-parallel ranks of each
//                                distributed-optimizer instance (parallel.
//                                num_distributed_optimizer_instances): gradients
//                                reduce-scattered, parameters all-gathered (core/train/optimizer.h)
//     "overlap_grad_reduce": false,
//                                Megatron's DistributedDataParallelConfig field (megatron/core/
//                                distributed/distributed_data_parallel_config.py): reduce the
//                                gradients bucket by bucket while the last micro-batch's backward
//                                still runs. Timing only: `mpusim run` computes the same values;
//                                the step-time estimate hides what the backward covers
//                                (core/estimate/time_estimate.h)
//     "overlap_param_gather": false,
//                                the distributed optimizer's parameter all-gather overlapped with
//                                the next iteration's forward, bucket by bucket. Megatron refuses
//                                it without use_distributed_optimizer and without
//                                overlap_grad_reduce (megatron/training/arguments.py); so does
//                                mpusim, naming this field
//     "bucket_size": null        parameters per gradient bucket when overlap_grad_reduce is on;
//                                null: Megatron's default max(40000000, 1000000 x dp_cp size)
//                                (megatron/training/training.py resolve_ddp_bucket_size);
//                                Megatron buckets only the first model chunk of pipeline rank 0
//                                (the others are one bucket each)
//   }
//
// Learning rate of iteration k (0-based: the k-th optimizer step), as Megatron's scheduler
// gives it (its step counter is k * global_batch_size when iteration k runs, and warmup and
// decay are measured in the same unit, so iterations can be used directly), W warmup and D
// decay iterations:
//   k < W (warmup):         lr * k / W           (0 at the first iteration)
//   constant:               lr
//   k > D:                  min_lr
//   otherwise r = (k - W) / (D - W), linear c = 1 - r, cosine c = (cos(pi r) + 1) / 2:
//                           min_lr + c * (lr - min_lr)
#pragma once

#include <algorithm>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "core/config/field_table.h"
#include "core/status.h"

namespace mpusim {

struct OptimizerConfig {
  enum class Kind : uint8_t { kAdam, kSgd };
  enum class DecayStyle : uint8_t { kConstant, kLinear, kCosine };
  Kind kind = Kind::kAdam;
  double lr = 0;
  double min_lr = 0;
  DecayStyle lr_decay_style = DecayStyle::kLinear;
  int64_t lr_warmup_iters = 0;
  std::optional<int64_t> lr_decay_iters;
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double sgd_momentum = 0.9;
  double clip_grad = 1.0;
  bool use_distributed_optimizer = false;
  // Megatron's DistributedDataParallelConfig overlap fields: timing, not values.
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  std::optional<int64_t> bucket_size;  // parameters; null: BucketSize's default
  // The parameters per gradient bucket Megatron uses on a dp x cp group of `dp_cp_size`:
  // bucket_size, else max(40000000, 1000000 x dp_cp_size).
  int64_t BucketSize(int64_t dp_cp_size) const {
    return bucket_size.value_or(std::max<int64_t>(40000000, 1000000 * dp_cp_size));
  }
};

// The keys of the `optimizer` section, each declared once (core/config/field_table.h).
std::span<const Field<OptimizerConfig>> OptimizerFields();
const std::vector<std::string_view>& OptimizerConfigKeys();
template <typename T>
std::string_view OptimizerKey(T OptimizerConfig::*member) {
  return KeyOf(OptimizerFields(), member);
}

Status ParseOptimizerSection(const nlohmann::json& section, OptimizerConfig* out);

// The learning rate of 0-based iteration `k` of a run of `train_iters` iterations.
double LearningRate(const OptimizerConfig& config, int64_t k, int64_t train_iters);

// Megatron's default no_weight_decay_cond: biases and 1-D parameters take no weight decay.
bool TakesWeightDecay(std::string_view name, int64_t ndim);

}  // namespace mpusim
