// The optimizer step of a training iteration: Megatron's gradient clipping by the global
// norm, then AdamW or momentum SGD with the iteration's learning rate (core/config/optimizer_config.h),
// on every parameter (the plain optimizer) or on this rank's shard of them (the distributed
// optimizer).
//
// Gradient norm (Megatron's get_grad_norm_fp32): sqrt of the sum of squares of every
// parameter's main_grad, counting each parameter once: a replicated parameter (not split over
// tp) only on tp rank 0 (param_is_not_tensor_parallel_duplicate), and the tied word
// embedding only on the first stage (the last stage's copy is `shared`); the sum is
// all-reduced over tp and pp (the model-parallel group). Every dp rank holds the same
// finalized gradients, so it computes the same norm. With clip_grad > 0 and
// c = clip_grad / (norm + 1e-6) < 1, every gradient is scaled by c.
//
// Update of parameter w with gradient g at step t (1-based), learning rate lr, weight decay
// wd (0 for biases and 1-D parameters):
//   adam (AdamW, as Megatron's fused Adam):  m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2,
//        w -= lr * ((m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd w)
//   sgd (torch.optim.SGD with momentum mu):  d = g + wd w,  buf = d at t = 1, else mu buf + d,
//        w -= lr * buf
// Master weights and states: kept on the backend's device in the run's compute dtype
// (float32, float64 for a float64 run), as Megatron keeps float32 main params (the
// precision-aware optimizer: below); the update
// runs in float64 per element (Kernels::OptimizerStep, whose one definition both backends
// call: core/optimizer_update.h) and the parameter's storage gets the master rounded to it.
// The gradient norm's sum of squares is a device reduction too (Kernels::SumOfSquares); the
// only value that reaches the host in a step is the norm itself.
//
// Distributed optimizer (optimizer.use_distributed_optimizer, Megatron's DistributedOptimizer
// with num_distributed_optimizer_instances): the rank's parameters are laid end to end in one
// flat buffer, in reverse order of registration as Megatron's grad buffer holds them, padded
// at the end to a multiple of D, the data-parallel size of one instance (the dp_cp_partial
// group; D = dp / num_distributed_optimizer_instances). Group rank r of dp_cp_partial owns
// elements [r S, (r + 1) S), S = padded size / D, and keeps master weights and states for
// those only. An iteration:
//   1. finalize_model_grads leaves the data-parallel reduction to the optimizer
//      (ParameterSet::FinalizeGrads without dp); ReduceGradients reduce-scatters the flat
//      gradient buffer over dp_cp_partial, then all-reduces the owned shard over
//      inter_dist_opt (the same position in every instance; absent with one instance);
//   2. GradNorm sums the squares of the owned shard (each parameter once, as above) and
//      all-reduces them over intra_dist_opt (every rank of one instance: tp x pp x D);
//   3. Step clips and updates the owned elements, then all-gathers the updated parameters
//      (in their storage dtype) over dp_cp_partial into every rank's parameters.
// With the experts laid out apart (expert parallelism, or expert_tensor_parallel_size other
// than tp) the expert parameters (Parameter::expert) have a flat buffer of their own, sharded
// the same way over expt_dp_partial (the ranks of one instance holding the same expert
// slices, as Megatron's expert grad buffers over the partial expert data-parallel group; all
// of expt_dp with one instance): 1. and 3. run per buffer, each over its group, the owned
// shards of both all-reduced over inter_dist_opt (whose ranks share their expert position
// as well as their dense one), and the norm's sum over intra_dist_opt (the whole instance:
// every tp, ep, dp and pp rank) counts each expert element once, at the rank of its
// expt_dp_partial group that owns it.
// The layout of the flat buffer is mpusim's (Megatron also aligns each parameter's start and
// splits large buffers into buckets); the arithmetic does not depend on it, and neither do
// the gathered state tensors RecordState writes.
// A 16-bit main_grad (fp16 runs by default, bf16 with grad_reduce_in_bf16: core/config/
// optimizer_config.h PrecisionOf) is accumulated and reduced in that dtype; the step then
// reads float32 copies of this rank's owned gradients, as Megatron's mixed-precision
// optimizers copy them (_copy_model_grads_to_main_grads: main_param.grad =
// main_grad.float()): the norm, the clipping (a float32 product) and the update use the
// copies, which live, as Megatron's do, until the next iteration zeroes the gradients
// (ZeroGrad). Widening is exact, so the copies change no value, only the memory.
// The precision-aware optimizer (optimizer.use_precision_aware_optimizer: adam and the
// distributed optimizer only, as Megatron allows it) is Transformer Engine's FusedAdam as
// Megatron's DistributedOptimizer drives it: the owned shard's main_grad is read as it is,
// 16-bit included (decoupled_grad: no float32 copy; the norm and the clipping work on it),
// and the master weights and moments are kept in their dtypes (OptimizerPrecision): bf16
// moments rounded to nearest after each update, float16 moments and master weights scaled
// per tensor (core/optimizer_update.h). A step unscales every float16 tensor into float32,
// updates, and scales back (FusedAdam.step), the float32 tensors freed before the
// all-gather. RecordState gives bf16 states as they are, float16 ones unscaled in float32.
// With FusedAdam's store_param_remainders (Megatron's default; OptimizerPrecision::
// param_remainders: bf16 parameters, float32 master) the master of the owned elements is a
// 2-byte remainder (kRemainderDType), zero at the start: the step copies the owned
// parameter elements into the shard it all-gathers, and the update rebuilds the float32
// master from them and the remainder and writes both back, the parameter rounded with ties
// away from zero (core/optimizer_update.h ParamRemainder). The master is never recorded.
// What it is not: the loss scaler of float16 training, fp8 states, or Megatron's bucketed,
// aligned buffer layout.
#pragma once

#include <cstdint>
#include <vector>

#include "core/communicator.h"
#include "core/kernels.h"
#include "core/model/parameter.h"
#include "core/model/record.h"
#include "core/config/optimizer_config.h"

namespace mpusim {

// The groups of the distributed optimizer (all null for the plain optimizer).
struct DistributedOptimizerGroups {
  Communicator* shard = nullptr;     // dp_cp_partial: reduce-scatter and all-gather
  Communicator* replicas = nullptr;  // inter_dist_opt; null with one instance
  Communicator* stats = nullptr;     // intra_dist_opt: the gradient norm's sum
  Communicator* expert_shard = nullptr;  // expt_dp_partial: the expert buffer's (null: no
                                         // experts laid out apart); it shares `replicas`
  // Not the distributed optimizer but FSDP2 (core/model/fully_shard.h): the plain optimizer
  // over sharded parameters, each rank's rows of them over this group (dp x cp). The norm's
  // sum runs over it too, and RecordState gathers the states' rows over it.
  Communicator* fully_shard = nullptr;
};

class Optimizer {
 public:
  // Updates `params` (in registration order; every one with a main_grad), which must
  // outlive it. `groups.shard` null: the plain optimizer, every parameter whole on every rank.
  Optimizer(const OptimizerConfig& config, const std::vector<Parameter*>& params, Kernels& k,
            DistributedOptimizerGroups groups = {});

  bool distributed() const { return groups_.shard != nullptr; }
  // The distributed optimizer's data-parallel reduction of the gradients (1. above); nothing
  // for the plain one, whose gradients FinalizeGrads all-reduced.
  // With a 16-bit main_grad, both then make the float32 copies the step reads.
  void ReduceGradients(Kernels& k, CommTrace& trace);
  // The start of an iteration (Megatron's optimizer.zero_grad): the last step's float32
  // gradient copies are released.
  void ZeroGrad();
  // The global gradient norm (see above), before clipping. `tp_ep` (the experts laid out
  // apart; may be null): the plain optimizer sums the experts' squares over it, each of its
  // ranks holding other experts or other etp slices of them.
  double GradNorm(Kernels& k, Communicator& tp, Communicator* pp, Communicator* tp_ep,
                  int64_t tp_rank, CommTrace& trace) const;
  // Clips to clip_grad (when set) given the norm, then updates every parameter with `lr`.
  void Step(Kernels& k, double grad_norm, double lr, CommTrace& trace);
  int64_t steps() const { return steps_; }

  // For records and dumps: the distributed optimizer all-gathers the reduced, clipped
  // gradient shards into every parameter's main_grad (the plain one holds them already).
  // With a 16-bit main_grad the records get the clipped float32 copies instead (what
  // Megatron's optimizer holds as main_param.grad), whole, in float32.
  void GatherGradients(Kernels& k, CommTrace& trace);
  // Appends the optimizer state of every parameter, whole, with the parameter's shape and
  // tensor-parallel shard, in the master dtype: "<name>.exp_avg" and "<name>.exp_avg_sq"
  // (adam, torch's names for m and v) or "<name>.momentum_buffer" (sgd). The distributed
  // optimizer all-gathers its shards first.
  void RecordState(Kernels& k, CommTrace& trace, std::vector<TensorRecord>* records);

  // The distributed optimizer's buffers (0: the dense parameters; 1: the experts', with
  // expert parallelism): this rank's elements [begin, end) of the padded flat buffer of
  // `padded` elements (0, 0, 0 for the plain optimizer or a buffer that does not exist).
  int64_t shard_begin(size_t buffer = 0) const { return Find(buffer).begin; }
  int64_t shard_end(size_t buffer = 0) const { return Find(buffer).begin + Find(buffer).size; }
  int64_t padded_elements(size_t buffer = 0) const { return Find(buffer).padded; }

 private:
  // One flat buffer of the distributed optimizer and its shard.
  struct Buffer {
    Communicator* shard = nullptr;     // the group its elements are sharded over
    Communicator* replicas = nullptr;  // the other instances' same shard (may be null)
    int64_t padded = 0, begin = 0, size = 0;
    Tensor grad_shard;  // [size] the reduced gradients of the owned elements
    Tensor step_grad;   // [size] float32 copy of grad_shard (a 16-bit main_grad only)
  };
  const Buffer& Find(size_t buffer) const {
    static const Buffer kNone;
    return buffer < buffers_.size() ? buffers_[buffer] : kNone;
  }
  // One optimizer tensor of a state's owned elements as stored: in its dtype, and a float16
  // one (the precision-aware optimizer's) scaled, with its float32 scale (core/
  // optimizer_update.h ScaledFloat16; Transformer Engine's FusedAdam `_scales`, one per
  // tensor).
  // The remainder of store_param_remainders: a 2-byte tensor whose bits are Transformer
  // Engine's int16 remainder (mpusim has no int16 dtype; Kernels::OptimizerStep never reads
  // it as numbers).
  static constexpr DType kRemainderDType = DType::kBFloat16;
  struct Stored {
    Tensor value;  // [end - begin]; the master's: the remainder with param_remainders
    Tensor scale;  // [1] float32; undefined unless value is float16
  };
  struct State {
    Parameter* param = nullptr;
    size_t buffer = 0;           // distributed: its flat buffer (1: an expert's)
    double weight_decay = 0;
    int64_t numel = 0;           // of the local (tensor-parallel) parameter
    int64_t offset = 0;          // of element 0 in its flat buffer (distributed)
    int64_t begin = 0, end = 0;  // the owned elements of the flattened local parameter
    // The master weights and the states (adam's exp_avg and exp_avg_sq, sgd's momentum
    // buffer in m), on the device: in the master dtype (OptimizerPrecision), each in its own
    // with the precision-aware optimizer; v is adam's only; none when nothing is owned.
    Stored master, m, v;
    Tensor step_grad;            // plain optimizer, 16-bit main_grad: float32 copy of it
  };
  // The tensor a step updates in place for `stored`: its value, or for a float16 one a new
  // float32 tensor holding it unscaled (ScaleBack stores it back).
  static Tensor Unscaled(Kernels& k, const Stored& stored);
  static void ScaleBack(Kernels& k, const Tensor& unscaled, Stored& stored);
  // The reduced gradients of a state's owned elements that the step reads: its part of
  // grad_shard (distributed) or its main_grad (plain), or their float32 copies.
  Tensor StepGradient(const State& s) const;
  // The distributed optimizer's reduce-scatter (and all-reduce over the instances).
  void ReduceShards(Kernels& k, CommTrace& trace);
  // Every rank's `owned` tensors (one per state, its owned elements; end to end in buffer
  // order) all-gathered over the shard group: flat buffer `b`, in `dtype`.
  Tensor GatherFlat(Kernels& k, size_t b, DType dtype, const std::vector<Tensor>& owned) const;
  // This rank's shard of flat buffer `b` all-gathered over its shard group (itself when the
  // group has one rank).
  Tensor GatherShard(Kernels& k, size_t b, const Tensor& shard) const;

  OptimizerConfig config_;
  DistributedOptimizerGroups groups_;
  DType master_dtype_;            // the compute dtype: of the update's float32/float64 arithmetic
  OptimizerPrecision precision_;  // each tensor's dtype (PrecisionOf)
  DType grad_dtype_ = DType::kFloat32;
  bool copies_grads_ = false;  // a 16-bit main_grad: the step reads float32 copies
  std::vector<State> states_;  // registration order
  int64_t steps_ = 0;
  std::vector<Buffer> buffers_;  // distributed: the dense buffer, then the experts' if any
};

}  // namespace mpusim
