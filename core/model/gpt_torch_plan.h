// A PyTorch parallelize_plan over the GPT model's modules (their state-dict FQNs, as `mpusim
// explain` prints them): mpusim's GPT runs Megatron's own modules, so a plan is accepted
// when it is the plan Megatron's layout is, module by module, and refused otherwise with the
// module and the style Megatron gives it. Megatron's plan for tensor_model_parallel_size t:
//
//   embedding.word_embeddings        RowwiseParallel(input_layouts=Replicate(),
//                                      output_layouts=Replicate(), or Shard(1) under sp
//                                      with rope: learned absolute positions are added to the
//                                      whole sum, so there the embedding module hands on
//                                      Shard(1): PrepareModuleOutput(output_layouts=
//                                      Replicate(), desired_output_layouts=Shard(1)))
//   *.linear_qkv, *.linear_fc1,      ColwiseParallel (input_layouts=Shard(1) under sp)
//   output_layer
//   *.linear_proj, *.linear_fc2      RowwiseParallel (output_layouts=Shard(1) under sp)
//   the norms                        SequenceParallel under sp, no style without
//   the rest (position embeddings)   no style
//
// (the vocab-parallel cross entropy on the output layer's Shard(-1) logits is torch's
// loss_parallel). PyTorch 2.0's PairwiseParallel on the whole model leaves the embedding and
// the output layer replicated, which Megatron does not: refused. Models with MoE layers or
// multi-latent attention are refused (their modules' styles are not built).
#pragma once

#include "core/config/gpt_config.h"
#include "core/config/parallelize_plan.h"
#include "core/status.h"

namespace mpusim {

// OK when `plan` is Megatron's plan of `gpt` with `sequence_parallel` (and tp > 1); errors
// name the plan entry or "parallelize_plan".
Status CheckMegatronPlan(const ParallelizePlan& plan, const GptConfig& gpt, bool sequence_parallel);

}  // namespace mpusim
