// ParallelConfig: the `parallel` section of an mpusim config file.
//
// Keys are the keyword arguments of Megatron-Core's initialize_model_parallel under their
// own names, plus three of ours:
//   world_size        number of ranks the layout covers (Megatron reads it from torch)
//   gpus_per_node     for the node map (default 8)
//   num_layers        only for the virtual-pipeline layer assignment (optional)
// and Megatron's uneven-split keys (pipeline_model_parallel_layout,
// decoder_first/last_pipeline_num_layers, account_for_embedding/loss_in_pipeline_split),
// and the ModelParallelConfig fields microbatch_group_size_per_vp_stage (schedules),
// sequence_parallel, gradient_accumulation_fusion, fp16, bf16 and params_dtype (the
// simulator; config.h resolves the last three against run.dtype), and tp_comm_overlap,
// overlap_moe_expert_parallel_comm and delay_wgrad_compute (the step-time estimate).
//
// Parsing is strict: unknown keys (with a suggestion), wrong JSON types and out-of-range
// values are refused with a Status naming the JSON path. Cross-field rules (divisibility,
// order string, ...) are checked by the planner (topology.h), which owns the layout math.
// This file knows nothing about files or the command line.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/config/field_table.h"
#include "core/pipeline_split.h"
#include "core/status.h"
#include "core/tensor.h"

namespace mpusim {

struct ParallelConfig {
  int64_t world_size = 0;  // required
  // One line per ModelParallelConfig field the section sets that mpusim accepts and ignores
  // ("parallel.tp_comm_overlap: ignored: ..."): the commands print them on stderr.
  std::vector<std::string> ignored;
  int64_t gpus_per_node = 8;
  int64_t tensor_model_parallel_size = 1;
  int64_t pipeline_model_parallel_size = 1;
  std::optional<int64_t> virtual_pipeline_model_parallel_size;
  int64_t context_parallel_size = 1;
  std::vector<int64_t> hierarchical_context_parallel_sizes;  // empty: not hierarchical
  int64_t expert_model_parallel_size = 1;
  std::optional<int64_t> expert_tensor_parallel_size;  // default: tensor_model_parallel_size
  int64_t num_distributed_optimizer_instances = 1;
  std::string order = "tp-cp-ep-dp-pp";
  int64_t rank_offset = 0;
  std::optional<int64_t> microbatch_group_size_per_vp_stage;  // default: pp size
  std::optional<int64_t> num_layers;
  // Megatron's uneven pipeline splits (core/pipeline_split.h has the rules): a layout string
  // ("Et|tt|tt|tL"), or the first and last pipeline stages' layer counts, or the embedding
  // and the loss counted as layers. A layout without virtual_pipeline_model_parallel_size
  // sets it to stages / pp (when above 1), as Megatron does.
  std::optional<std::string> pipeline_model_parallel_layout;
  std::optional<int64_t> decoder_first_pipeline_num_layers;
  std::optional<int64_t> decoder_last_pipeline_num_layers;
  bool account_for_embedding_in_pipeline_split = false;
  bool account_for_loss_in_pipeline_split = false;
  // ModelParallelConfig fields read by the simulator (mpusim run); the planner ignores them.
  bool sequence_parallel = false;
  // ModelParallelConfig.tp_comm_overlap (megatron/core/model_parallel_config.py): Transformer
  // Engine's userbuffers pipeline the tp all-gathers and reduce-scatters with the GEMMs next
  // to them. Timing only (the step-time estimate hides what the GEMMs cover); Megatron
  // requires sequence parallelism for it (megatron/training/arguments.py), hence tp > 1.
  bool tp_comm_overlap = false;
  // ModelParallelConfig.overlap_moe_expert_parallel_comm: Megatron's combined 1F1B schedule
  // (pipeline_parallel/combined_1f1b.py) runs one micro-batch's forward beside another's
  // backward, layer by layer, so each one's expert all-to-alls hide behind the other's compute
  // (one more warmup forward per rank). delay_wgrad_compute runs the experts' weight gradients
  // after their backward all-to-all has started. Timing and the micro-batches in flight; the
  // values are the same (mpusim run refuses it: its executor runs the plain schedule).
  bool overlap_moe_expert_parallel_comm = false;
  bool delay_wgrad_compute = false;
  // Weight-gradient GEMMs accumulate straight into the float32 main_grad instead of writing
  // weight.grad in the parameter dtype and adding it (Megatron's fused wgrad kernel).
  bool gradient_accumulation_fusion = false;
  // Mixed precision: parameters, activations and gradients stored in bfloat16 / float16,
  // arithmetic and main_grad in float32. params_dtype accepts "float32", "bfloat16" and
  // "float16" (with or without "torch.").
  bool fp16 = false;
  bool bf16 = false;
  std::optional<DType> params_dtype;
  // PyTorch's init_device_mesh("cuda", mesh_shape, mesh_dim_names): ranks row-major over the
  // shape (the last dimension varies fastest); dimensions named "dp" and "tp". It sets
  // tensor_model_parallel_size, world_size (when absent) and the rank order ("tp" last: the
  // default order, tp fastest; "tp" first: dp fastest), and no other size may be set with it.
  struct DeviceMesh {
    std::vector<int64_t> mesh_shape;
    std::vector<std::string> mesh_dim_names;
    // The size of the dimension `name`, 1 when the mesh has none.
    int64_t SizeOf(std::string_view name) const;
  };
  std::optional<DeviceMesh> device_mesh;

  // The keys that decide which layers each pipeline stage holds (AssignLayers' input).
  PipelineSplit Split() const {
    return {pipeline_model_parallel_size,      virtual_pipeline_model_parallel_size,
            pipeline_model_parallel_layout,    decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers,  account_for_embedding_in_pipeline_split,
            account_for_loss_in_pipeline_split};
  }

  int64_t EffectiveExpertTensorParallelSize() const {
    return expert_tensor_parallel_size.value_or(tensor_model_parallel_size);
  }
};

// The section's keys, each declared once (core/config/field_table.h): name, member, type,
// range, meaning and flag. ParallelConfigKeys lists them in documentation order; ParallelKey
// names the key a member holds (ParallelKey(&ParallelConfig::context_parallel_size)).
std::span<const Field<ParallelConfig>> ParallelFields();
const std::vector<std::string_view>& ParallelConfigKeys();
template <typename T>
std::string_view ParallelKey(T ParallelConfig::*member) {
  return KeyOf(ParallelFields(), member);
}
// ModelParallelConfig fields accepted with a note (or refused unless at mpusim's value), and
// the derived sizes refused with their own message.
bool IsAcceptedParallelField(std::string_view key);

// Parses `section` (the value of the "parallel" key); `path` prefixes field names in
// errors, normally "parallel".
Status ParseParallelSection(const nlohmann::json& section, std::string_view path,
                            ParallelConfig* out);

// The storage dtype Megatron's switches ask for (bf16, else fp16, else params_dtype), or
// nullopt when none is set; ParseConfig makes run.dtype agree with it.
std::optional<DType> MegatronStorageDType(const ParallelConfig& config);

// Writes every key back (nulls for unset optionals), for `--format json` and tests.
void ToJson(const ParallelConfig& config, nlohmann::json* out);

// The closest accepted key to `unknown` among `candidates`, or "" when none is close:
// common short names (tp, pp, dp, ...) map to their Megatron keys, otherwise the smallest
// edit distance wins if it is small relative to the key's length.
std::string SuggestKey(std::string_view unknown, const std::vector<std::string_view>& candidates);

}  // namespace mpusim
