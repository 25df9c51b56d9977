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
//     "use_torch_fsdp2": false,  Megatron's --use-torch-fsdp2: the model wrapped in PyTorch's FSDP2
//                                (fully_shard, megatron/core/distributed/
//                                torch_fully_sharded_data_parallel.py) over the dp x cp ranks:
//                                parameters sharded by rows, gathered per module before its
//                                forward and its backward, gradients reduce-scattered after it
//                                (core/model/fully_shard.h). Megatron refuses it with pipeline or
//                                expert parallelism, the distributed optimizer, gradient
//                                accumulation fusion, tied embeddings and fp16; so does mpusim
//     "torch_fsdp2_reshard_after_forward": true,
//                                release each module's gathered parameters after its forward
//                                (gathered again for its backward); false keeps them until the
//                                backward (Megatron's --torch-fsdp2-no-reshard-after-forward)
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
//     "bucket_size": null,       parameters per gradient bucket when overlap_grad_reduce is on;
//                                null: Megatron's default max(40000000, 1000000 x dp_cp size)
//                                (megatron/training/training.py resolve_ddp_bucket_size);
//                                Megatron buckets only the first model chunk of pipeline rank 0
//                                (the others are one bucket each)
//     "accumulate_allreduce_grads_in_fp32": false,
//                                main_grad (the gradient buffer: the accumulation over
//                                micro-batches and the data-parallel reduction) in float32
//                                instead of the parameters' dtype. Megatron forces it on for
//                                bf16 runs and leaves it off for fp16 runs, whose main_grad is
//                                then float16 (PrecisionOf below)
//     "grad_reduce_in_bf16": false,
//                                a bf16 run keeps main_grad in bfloat16 (Megatron's
//                                --grad-reduce-in-bf16: turns the forced float32 off)
//     "use_precision_aware_optimizer": false,
//                                Transformer Engine's FusedAdam with the dtypes below (Megatron
//                                allows it with adam and use_distributed_optimizer only)
//     "main_grads_dtype": "fp32",  "fp32" or "bf16" (a bf16 run's main_grad)
//     "main_params_dtype": "fp32", "fp32" or "fp16": the master weights
//     "exp_avg_dtype": "fp32",     "fp32", "bf16" or "fp16": Adam's first moment as stored
//     "exp_avg_sq_dtype": "fp32",  the same for the second moment
//                                (Megatron refuses these four off "fp32" without the
//                                precision-aware optimizer)
//     "store_param_remainders": true
//                                Megatron's OptimizerConfig field, passed to Transformer
//                                Engine's FusedAdam: with the precision-aware optimizer, a
//                                bf16 run and an fp32 master, keep of each float32 master
//                                weight only its low 16 bits (the bf16 parameter holds the
//                                high 16, rounded: core/optimizer_update.h ParamRemainder).
//                                Ignored, as Megatron ignores it, everywhere else
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
#include <string>
#include <string_view>
#include <vector>

#include "core/config/field_table.h"
#include "core/status.h"
#include "core/tensor.h"

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
  bool use_torch_fsdp2 = false;
  bool torch_fsdp2_reshard_after_forward = true;
  // Megatron's DistributedDataParallelConfig overlap fields: timing, not values.
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  std::optional<int64_t> bucket_size;  // parameters; null: BucketSize's default
  // Megatron's mixed-precision switches (megatron/training/arguments.py,
  // megatron/core/optimizer/optimizer_config.py); PrecisionOf resolves them.
  bool accumulate_allreduce_grads_in_fp32 = false;
  bool grad_reduce_in_bf16 = false;
  bool use_precision_aware_optimizer = false;
  DType main_grads_dtype = DType::kFloat32;
  DType main_params_dtype = DType::kFloat32;
  DType exp_avg_dtype = DType::kFloat32;
  DType exp_avg_sq_dtype = DType::kFloat32;
  bool store_param_remainders = true;
  // The parameters per gradient bucket Megatron uses on a dp x cp group of `dp_cp_size`:
  // bucket_size, else max(40000000, 1000000 x dp_cp_size).
  int64_t BucketSize(int64_t dp_cp_size) const {
    return bucket_size.value_or(std::max<int64_t>(40000000, 1000000 * dp_cp_size));
  }
};

// The dtypes of a run's gradient buffer and optimizer tensors, as Megatron resolves them for
// parameters stored in `storage` (megatron/training/arguments.py: bf16 forces
// accumulate_allreduce_grads_in_fp32 unless grad_reduce_in_bf16 or a bfloat16
// main_grads_dtype; DistributedDataParallel's grad_reduce_in_fp32 is that switch, and the
// buffer is float32 with it, the parameters' dtype without). `optimizer` null: no optimizer
// section, every key at its default. A float64 run (mpusim's own) keeps all of them in
// float64.
struct OptimizerPrecision {
  DType main_grad;            // the gradient buffer: accumulated and reduced in this dtype
  DType master;               // the master weights
  DType exp_avg, exp_avg_sq;  // Adam's moments as stored (SGD's momentum: exp_avg)
  // A 16-bit main_grad copied into float32 gradients of the master weights for the step
  // (Megatron's _copy_model_grads_to_main_grads: main_param.grad = main_grad.float()); the
  // precision-aware optimizer reads main_grad itself.
  bool grads_copied_for_step = false;
  // Transformer Engine's FusedAdam store_param_remainders (precision-aware optimizer, bf16
  // parameters, float32 master, the key true): the float32 master (its values are still
  // `master`'s) is kept as the bf16 parameter and a 16-bit remainder, 2 bytes per owned
  // element instead of 4 (core/optimizer_update.h ParamRemainder).
  bool param_remainders = false;
};
// Bytes per owned element of the master weights as stored: 2 (the remainder) with
// param_remainders, else the master dtype's.
int64_t MasterBytes(const OptimizerPrecision& precision);
// The master weights as stored, for reports: the master dtype's name, or with
// param_remainders "bfloat16 parameter + int16 remainder".
std::string MasterStorageName(const OptimizerPrecision& precision);
OptimizerPrecision PrecisionOf(const OptimizerConfig* optimizer, DType storage);
// Megatron's refusals of these switches for a run storing in `storage` (ParseConfig calls it
// once every section is read); errors name "optimizer.<key>".
Status CheckOptimizerPrecision(const OptimizerConfig& optimizer, DType storage);

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
