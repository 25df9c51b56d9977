// PyTorch's tensor-parallel styles (torch.distributed.tensor.parallel.style: ColwiseParallel,
// RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput) as placements:
// what a style makes of a module's parameters, of its input and of its output, on the tp mesh
// dimension (dtensor.h's placements). The executor moves tensors between them; this file only
// says which, as style.py's partition and prepare functions do:
//
//   style             module      parameters                 input: given -> computed on
//                                                            output: produced -> given
//   ColwiseParallel   Linear      weight, bias Shard(0)      input_layouts (Replicate()) ->
//   Replicate()
//                                                            Shard(-1) -> output_layouts
//                                                            (Shard(-1))
//                     Embedding   weight Shard(1)            the same
//   RowwiseParallel   Linear      weight Shard(1), bias      input_layouts (Shard(-1)) -> Shard(-1)
//                                 Replicate()                Partial() -> output_layouts
//                                 (Replicate())
//                     Embedding   weight Shard(0)            input_layouts (Shard(-1)) ->
//                     Replicate()
//                                 (vocab-parallel)           Partial() -> output_layouts
//                                 (Replicate())
//   SequenceParallel  LayerNorm,  parameters Replicate()     Shard(sequence_dim) (default 1), kept
//                     RMSNorm,                               Shard(sequence_dim) -> the same
//                     Dropout
//   PrepareModuleInput   any      unchanged                  input_layouts -> desired_input_layouts
//   PrepareModuleOutput  any      unchanged                  output_layouts ->
//   desired_output_layouts
//
// use_local_output (True for Colwise, Rowwise and PrepareModuleOutput, False for
// SequenceParallel and PrepareModuleInput) says whether the next module sees a plain tensor
// (annotated anew by its own style) or the DTensor. Placements refer to torch's batch-first
// shapes ([b, s, h]: Shard(1) is the sequence, Shard(-1) the hidden width).
//
// PyTorch 2.0's spellings (the seed document) are accepted with their meaning:
// PairwiseParallel (a Linear pair as Colwise then Rowwise: parallelize_module's expansion,
// PairwiseStyles), and `_prepare_input` / `_prepare_output` naming the make_* functions
// (make_input_replicate_1d: Replicate(); make_input_shard_1d: Shard(0);
// make_input_shard_1d_last_dim: Shard(-1); make_input_reshard_replicate: Shard(0) then
// Replicate(); make_output_replicate_1d: Replicate(); make_output_shard_1d: Shard(0);
// make_output_tensor: Replicate() as a tensor; make_sharded_output_tensor: the shard as a
// tensor).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/config/parallelize_plan.h"
#include "core/status.h"
#include "core/tensor_parallel/dtensor.h"

namespace mpusim {

// The modules a style applies to (torch.nn's types).
enum class TorchModuleKind : uint8_t {
  kLinear,
  kEmbedding,
  kLayerNorm,
  kRMSNorm,
  kDropout,
  kOther
};

// A style applied to one module (the table above), its placements resolved for an input of
// `input_ndim` dimensions (an Embedding's token ids: 2) and an output of `output_ndim`.
struct StyledModule {
  // {"weight", Shard(0)}: of the parameters the module has (a Linear without bias: no "bias")
  std::vector<std::pair<std::string, DTensorPlacement>> parameters;
  std::optional<DTensorPlacement> input_given;    // none: the input is left as it comes
  std::optional<DTensorPlacement> input_desired;  // what the module computes on
  std::optional<DTensorPlacement> output_produced;
  std::optional<DTensorPlacement> output_given;  // what the next module receives
  bool use_local_output = true;
};
// Refused, naming `fqn`, where style.py raises: a Colwise or Rowwise style on a module other
// than Linear or Embedding ("ColwiseParallel currently only support nn.Linear and
// nn.Embedding!"), SequenceParallel on one other than a norm or Dropout; and a layout that
// does not parse for its tensor's dimensions. kPairwise is expanded by the plan, not applied.
StatusOr<StyledModule> ApplyParallelStyle(const ParallelStyle& style, TorchModuleKind module,
                                          int64_t input_ndim, int64_t output_ndim,
                                          std::string_view fqn);

}  // namespace mpusim
