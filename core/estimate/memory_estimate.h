// What a rank holds before its first step, counted from the config alone: nothing is
// allocated and nothing runs.
//
// What it is: for one rank of a layout (or each pipeline stage's busiest rank), the bytes of
//   parameters  its parameter shards (the model built for the rank,
//               Model::HeldParameterShapes: each parameter's local shape under its tensor- or
//               expert-tensor-parallel split, frozen ones and a tied copy included), in the
//               run's storage dtype;
//   gradients   the trainable ones' main_grad, in its dtype as Megatron resolves it
//               (OptimizerPrecision::main_grad: float32, or float16 for an fp16 run without
//               accumulate_allreduce_grads_in_fp32, bfloat16 with grad_reduce_in_bf16;
//               float64 for a float64 run);
//   optimizer   master weights and states, each in its dtype (float32 unless the
//               precision-aware optimizer says otherwise; float64 for a float64 run): 3 per
//               element for Adam (master, exp_avg, exp_avg_sq), 2 for SGD (master, momentum
//               buffer), for every
//               element with the plain optimizer; with the distributed optimizer for the
//               elements this rank owns: each flat buffer (dense; the experts' when they are
//               laid out apart) padded to a multiple of D, its shard group's size
//               (dp_cp_partial; expt_dp_partial), and cut into D equal pieces, of which group
//               rank r owns the real (unpadded) elements of piece r.
// These are exactly the tensors the executor allocates before its first step
// (core/train/optimizer.h); `mpusim run` measures them per rank (run/simulate.h), and
// tests/model/estimate_mpi_test.cc requires the two equal on every rank of every layout.
// What it is not (yet): the model's constant tensors (the positions RoPE reads: bytes, which
// `--summary` reports as `constants`), activations, communication buffers, the step time, or
// what a GPU run adds (cuBLAS workspaces, NCCL buffers, the caching allocator's slack).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/config/config.h"
#include "core/memory_plan.h"
#include "core/model/model.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {

struct HeldMemory {
  PlanBytes parameters = 0;
  PlanBytes gradients = 0;
  PlanBytes optimizer = 0;
  PlanBytes parameter_elements = 0;  // of this rank's shards
  PlanBytes optimizer_elements = 0;  // whose master weights and states this rank keeps
  // What the optimizer's step allocates is sized by these: the trainable elements of the
  // dense buffer and of the experts' (mixture of experts), and the largest parameter shard
  // (each update makes a new one).
  PlanBytes dense_elements = 0;
  PlanBytes expert_elements = 0;
  PlanBytes largest_parameter_elements = 0;
  // The distributed optimizer's dense buffer is cut in this many pieces (over dp x cp), the
  // experts' in expert_shards (over expt_dp).
  int64_t dense_shards = 1;
  int64_t expert_shards = 1;
  // A 16-bit main_grad's float32 copies, which Megatron's mixed-precision optimizers make for
  // the step (main_param.grad = main_grad.float(), 4 bytes per owned element) and keep until
  // the next iteration's zero_grad: the step's own peak above what is held.
  PlanBytes step_gradient_copies = 0;
  // The precision-aware optimizer's float16 tensors' scales (4 bytes per parameter with
  // owned elements and float16 tensor; in `optimizer`), and the most any rank of the same
  // shard groups keeps: a later rank's piece may cut one parameter more.
  PlanBytes optimizer_scales = 0;
  PlanBytes optimizer_scales_most = 0;
  PlanBytes total() const { return SaturatingAdd(SaturatingAdd(parameters, gradients), optimizer); }
  // The rank's peak when the schedule's `transient` bytes (activations and buffers) come on
  // top of what it holds: the larger of the schedule's and the step's.
  PlanBytes PeakWith(PlanBytes transient) const {
    return SaturatingAdd(total(), std::max(transient, step_gradient_copies));
  }
};

// World rank `rank` of `topology` (which `config.parallel` laid out). A GPT model with a run
// section is counted by CountedParameterShapes (Megatron's rules, not the executor's: every
// layout Megatron runs); another model is built for the rank, as `mpusim run` builds it.
// Errors: the model's own, naming the field.
StatusOr<HeldMemory> EstimateHeldMemory(const Config& config, const Topology& topology,
                                        int64_t rank);

// One pipeline stage's busiest rank: the first rank of the stage (every other coordinate 0),
// which holds as many parameters as any rank of the stage and owns the first, fullest piece
// of each distributed-optimizer buffer; its optimizer bytes count the most float16 scales
// any rank of the stage keeps (HeldMemory::optimizer_scales_most).
// Rank `rank`'s parameter shards counted from the model's parameter list (GptParameters,
// MLA's and MTP's included) without building the model: its pipeline stage's layers (the
// planner's split), the embedding on the first stage, the final norm, the MTP depths and the
// output layer on the last, which also holds the word embeddings when they are tied and the
// whole embedding under multi-token prediction (Megatron's GPTModel builds it where
// mtp_process is); its ep rank's experts, each split over etp, the other weights over tp.
// For the models the executor builds it gives what Model::HeldParameterShapes gives (the
// estimate tests require it).
StatusOr<std::vector<HeldParameterShape>> CountedParameterShapes(const Config& config,
                                                                 const Topology& topology,
                                                                 int64_t rank);

// Whether the CPU executor builds `config`'s GPT model, which EstimateHeldMemory counts
// without it: the executor's refusal, naming the field, when it does not (a part Megatron
// runs and mpusim run does not yet), so the estimate
// leaves out only the executor's own counts (executor_activations.h, which need the model);
// OK for a model of another kind.
Status ExecutorBuildsParts(const Config& config, const Topology& topology);

struct StageHeldMemory {
  int64_t stage = 0;
  int64_t rank = 0;
  HeldMemory held;
};
StatusOr<std::vector<StageHeldMemory>> EstimateStageHeldMemory(const Config& config,
                                                               const Topology& topology);

}  // namespace mpusim
