// Strict parsing of the `parallel` section (see parallel_config.h).
#include "core/config/parallel_config.h"

#include <algorithm>
#include <limits>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/config/json_fields.h"

namespace mpusim {
namespace {

using nlohmann::json;

// Edits (insert, delete, substitute, swap two neighbours: "modle" is one from "model")
// between a and b: the optimal string alignment distance, in three rows of |b| + 1.
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> before(b.size() + 1), previous(b.size() + 1), row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) previous[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      row[j] = std::min({previous[j] + 1, row[j - 1] + 1,
                         previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        row[j] = std::min(row[j], before[j - 2] + 1);
      }
    }
    std::swap(before, previous);
    std::swap(previous, row);
  }
  return previous[b.size()];
}

// SuggestKey accepts a candidate only when the edits are at most a third of the longer name.
bool CloseEnough(size_t distance, size_t a_size, size_t b_size) {
  return distance * 3 <= std::max(a_size, b_size);
}

}  // namespace

std::optional<DType> MegatronStorageDType(const ParallelConfig& config) {
  if (config.bf16) return DType::kBFloat16;
  if (config.fp16) return DType::kFloat16;
  return config.params_dtype;
}

const std::vector<std::string_view>& ParallelConfigKeys() {
  static const std::vector<std::string_view> kKeys = {
      "world_size",
      "gpus_per_node",
      "tensor_model_parallel_size",
      "pipeline_model_parallel_size",
      "virtual_pipeline_model_parallel_size",
      "context_parallel_size",
      "hierarchical_context_parallel_sizes",
      "expert_model_parallel_size",
      "expert_tensor_parallel_size",
      "num_distributed_optimizer_instances",
      "order",
      "rank_offset",
      "microbatch_group_size_per_vp_stage",
      "num_layers",
      "sequence_parallel",
      "tp_comm_overlap",
      "overlap_moe_expert_parallel_comm",
      "delay_wgrad_compute",
      "gradient_accumulation_fusion",
      "fp16",
      "bf16",
      "params_dtype",
  };
  return kKeys;
}

std::string SuggestKey(std::string_view unknown, const std::vector<std::string_view>& candidates) {
  // Short names people type from papers and launch scripts.
  static const std::map<std::string, std::string, std::less<>> kAliases = {
      {"tp", "tensor_model_parallel_size"},
      {"tensor_parallel_size", "tensor_model_parallel_size"},
      {"tensor_model_parallel", "tensor_model_parallel_size"},
      {"pp", "pipeline_model_parallel_size"},
      {"pipeline_parallel_size", "pipeline_model_parallel_size"},
      {"vp", "virtual_pipeline_model_parallel_size"},
      {"vpp", "virtual_pipeline_model_parallel_size"},
      {"virtual_pipeline_parallel_size", "virtual_pipeline_model_parallel_size"},
      {"cp", "context_parallel_size"},
      {"hcp", "hierarchical_context_parallel_sizes"},
      {"ep", "expert_model_parallel_size"},
      {"expert_parallel_size", "expert_model_parallel_size"},
      {"etp", "expert_tensor_parallel_size"},
      {"n", "world_size"},
      {"world", "world_size"},
      {"nodes", "gpus_per_node"},
      {"layers", "num_layers"},
      // torch.nn.Linear's names for the sizes (seed 002's lab model), as Megatron's layers
      // name them.
      {"in_features", "input_size"},
      {"out_features", "output_size"},
  };
  if (auto it = kAliases.find(unknown); it != kAliases.end()) {
    if (std::find(candidates.begin(), candidates.end(), it->second) != candidates.end()) {
      return it->second;
    }
  }
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (std::string_view candidate : candidates) {
    // The distance is at least the difference in length: a name far longer or shorter than
    // the candidate is not measured (a 64 KiB key costs nothing against 40-character names).
    const size_t gap = unknown.size() > candidate.size() ? unknown.size() - candidate.size()
                                                         : candidate.size() - unknown.size();
    if (!CloseEnough(gap, unknown.size(), candidate.size())) continue;
    const size_t d = EditDistance(unknown, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = std::string(candidate);
    }
  }
  // Accept a suggestion only when it shares most of the spelling.
  if (best.empty() || !CloseEnough(best_distance, unknown.size(), best.size())) return "";
  return best;
}

namespace {

// ModelParallelConfig fields (seed 003) that do not change the process groups or the math
// mpusim models (json_fields.h AcceptedField).
constexpr std::string_view kOverlap =
    "overlaps communication with computation, which changes timing, not results";
constexpr std::string_view kCallable =
    "a Python callable set by the training loop; mpusim's run driver does its work";
constexpr AcceptedField kIgnoredFields[] = {
    {"pipeline_model_parallel_comm_backend", "",
     "mpusim's point-to-point runs on MPI, or NCCL with --backend cuda"},
    {"tp_comm_bootstrap_backend", "", "mpusim bootstraps NCCL over MPI"},
    {"perform_initialization", "",
     "mpusim initialises every parameter from its master values (core/init.h)"},
    {"use_cpu_initialization", "",
     "mpusim initialises every parameter from its master values (core/init.h)"},
    {"timers", "null", kCallable},
    {"finalize_model_grads_func", "null", kCallable},
    {"grad_scale_func", "null", kCallable},
    {"no_sync_func", "null", kCallable},
    {"grad_sync_func", "null", kCallable},
    {"param_sync_func", "null", kCallable},
    {"deterministic_mode", "", "mpusim's kernels are deterministic"},
    {"enable_autocast", "false", "mixed precision is run.dtype (or bf16/fp16 here)"},
    {"autocast_dtype", "", "mixed precision is run.dtype (or bf16/fp16 here)"},
    {"moe_extended_tp", "false", "the extended expert tensor parallelism is not modelled"},
    {"num_microbatches_with_partial_activation_checkpoints", "null",
     "recomputation is run.recompute_granularity, for every micro-batch"},
    {"async_tensor_model_parallel_allreduce", "", kOverlap},
    {"use_te_rng_tracker", "false", "dropout masks come from model.dropout_mode"},
    {"tp_comm_bulk_wgrad", "", kOverlap},
    {"tp_comm_bulk_dgrad", "", kOverlap},
    {"tp_comm_overlap_ag", "", kOverlap},
    {"tp_comm_overlap_rs", "", kOverlap},
    {"tp_comm_overlap_rs_dgrad", "", kOverlap},
    {"tp_comm_split_ag", "", kOverlap},
    {"tp_comm_atomic_ag", "", kOverlap},
    {"tp_comm_split_rs", "", kOverlap},
    {"tp_comm_atomic_rs", "", kOverlap},
    {"tp_comm_overlap_disable_qkv", "", kOverlap},
    {"tp_comm_overlap_disable_fc1", "", kOverlap},
    {"cross_entropy_loss_fusion", "", "a fused kernel of the same loss; mpusim's is unfused"},
    {"cross_entropy_fusion_impl", "", "a fused kernel of the same loss; mpusim's is unfused"},
    {"pipeline_dtype", "", "point-to-point tensors travel in run.dtype, the parameters' dtype"},
    {"variable_seq_lengths", "false", "every micro-batch has run.seq_length tokens"},
    {"overlap_p2p_comm", "", kOverlap},
    {"batch_p2p_comm", "", "mpusim posts each step's messages together (docs/simulator.md)"},
    {"batch_p2p_sync", "", kOverlap},
    {"use_ring_exchange_p2p", "", "mpusim posts each step's messages together (docs/simulator.md)"},
    {"deallocate_pipeline_outputs", "", "frees pipeline outputs early: memory, not values"},
    {"defer_embedding_wgrad_compute", "", kOverlap},
    {"wgrad_deferral_limit", "", kOverlap},
    {"overlap_p2p_comm_warmup_flush", "", kOverlap},
    {"cpu_offloading", "", "offloading moves tensors, not values"},
    {"cpu_offloading_num_layers", "", "offloading moves tensors, not values"},
    {"cpu_offloading_activations", "", "offloading moves tensors, not values"},
    {"cpu_offloading_weights", "", "offloading moves tensors, not values"},
    {"cpu_offloading_double_buffering", "", "offloading moves tensors, not values"},
};

const AcceptedField* FindIgnored(std::string_view key) {
  return FindAcceptedField(kIgnoredFields, key);
}

// One known key of the section: its value, checked, into `config`.
Status ParseParallelOption(const std::string& key, const json& value, const std::string& where,
                           ParallelConfig* config) {
  if (key == "world_size") {
    MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &config->world_size));
  } else if (key == "gpus_per_node") {
    MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &config->gpus_per_node));
  } else if (key == "tensor_model_parallel_size") {
    MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &config->tensor_model_parallel_size));
  } else if (key == "pipeline_model_parallel_size") {
    MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &config->pipeline_model_parallel_size));
  } else if (key == "virtual_pipeline_model_parallel_size") {
    MPUSIM_RETURN_IF_ERROR(
        ParseOptionalInt(value, where, 1, &config->virtual_pipeline_model_parallel_size));
  } else if (key == "context_parallel_size") {
    MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &config->context_parallel_size));
  } else if (key == "hierarchical_context_parallel_sizes") {
    config->hierarchical_context_parallel_sizes.clear();
    if (value.is_null()) return {};
    if (!value.is_array() || value.empty()) {
      return Status::Error(where, fmt::format("must be null or a non-empty list of integers "
                                              ">= 1 (e.g. [2, 4]), got {}",
                                              DescribeJson(value)));
    }
    for (size_t i = 0; i < value.size(); ++i) {
      int64_t level_size = 0;
      MPUSIM_RETURN_IF_ERROR(ParseInt(value[i], fmt::format("{}[{}]", where, i), 1, &level_size));
      config->hierarchical_context_parallel_sizes.push_back(level_size);
    }
  } else if (key == "expert_model_parallel_size") {
    MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &config->expert_model_parallel_size));
  } else if (key == "expert_tensor_parallel_size") {
    MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &config->expert_tensor_parallel_size));
  } else if (key == "num_distributed_optimizer_instances") {
    MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 1, &config->num_distributed_optimizer_instances));
  } else if (key == "order") {
    if (!value.is_string()) {
      return Status::Error(where, fmt::format("must be a string such as \"tp-cp-ep-dp-pp\", "
                                              "got {}",
                                              DescribeJson(value)));
    }
    config->order = value.get<std::string>();
  } else if (key == "rank_offset") {
    MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, 0, &config->rank_offset));
  } else if (key == "microbatch_group_size_per_vp_stage") {
    MPUSIM_RETURN_IF_ERROR(
        ParseOptionalInt(value, where, 1, &config->microbatch_group_size_per_vp_stage));
  } else if (key == "num_layers") {
    MPUSIM_RETURN_IF_ERROR(ParseOptionalInt(value, where, 1, &config->num_layers));
  } else if (key == "sequence_parallel" || key == "gradient_accumulation_fusion" || key == "fp16" ||
             key == "bf16" || key == "tp_comm_overlap" ||
             key == "overlap_moe_expert_parallel_comm" || key == "delay_wgrad_compute") {
    if (!value.is_boolean()) {
      return Status::Error(where,
                           fmt::format("must be true or false, got {}", DescribeJson(value)));
    }
    bool* flag = key == "sequence_parallel"              ? &config->sequence_parallel
                 : key == "gradient_accumulation_fusion" ? &config->gradient_accumulation_fusion
                 : key == "fp16"                         ? &config->fp16
                 : key == "tp_comm_overlap"              ? &config->tp_comm_overlap
                 : key == "overlap_moe_expert_parallel_comm"
                     ? &config->overlap_moe_expert_parallel_comm
                 : key == "delay_wgrad_compute" ? &config->delay_wgrad_compute
                                                         : &config->bf16;
    *flag = value.get<bool>();
  } else if (key == "params_dtype") {
    config->params_dtype.reset();
    if (value.is_null()) return {};
    std::string name = value.is_string() ? value.get<std::string>() : std::string();
    if (name.starts_with("torch.")) name = name.substr(6);
    config->params_dtype = DTypeFromName(name);
    if (!config->params_dtype || !IsFloat(*config->params_dtype) ||
        *config->params_dtype == DType::kFloat64) {
      return Status::Error(where, fmt::format("must be \"float32\", \"bfloat16\", \"float16\" "
                                              "or null, got {}",
                                              DescribeJson(value)));
    }
  }
  return {};
}

// fp16, bf16 and params_dtype agree.
Status CheckPrecision(const ParallelConfig& config, const std::string& prefix) {
  if (config.fp16 && config.bf16) {
    return Status::Error(prefix + ".bf16",
                         "cannot be true together with fp16 (Megatron refuses "
                         "it too); choose one 16-bit format");
  }
  if (config.params_dtype && (config.bf16 || config.fp16)) {
    const DType want = config.bf16 ? DType::kBFloat16 : DType::kFloat16;
    if (*config.params_dtype != want) {
      return Status::Error(prefix + ".params_dtype",
                           fmt::format("must be \"{}\" when {} is true (parameters, activations "
                                       "and gradients share one storage dtype), got \"{}\"",
                                       DTypeName(want), config.bf16 ? "bf16" : "fp16",
                                       DTypeName(*config.params_dtype)));
    }
  }
  return {};
}

}  // namespace

bool IsAcceptedParallelField(std::string_view key) {
  return FindIgnored(key) != nullptr || key == "data_parallel_size" ||
         key == "expert_data_parallel_size";
}

Status ParseParallelSection(const json& section, std::string_view path, ParallelConfig* out) {
  const std::string prefix(path);
  if (!section.is_object()) {
    return Status::Error(prefix, fmt::format("must be a JSON object, got {}", DescribeJson(section)));
  }
  ParallelConfig config;
  const auto& keys = ParallelConfigKeys();
  for (const auto& [key, value] : section.items()) {
    const std::string where = prefix + "." + key;
    if (key == "data_parallel_size" || key == "expert_data_parallel_size") {
      return Status::Error(where, "is derived, not set: it is world_size divided by the other "
                                  "sizes of its rank generator");
    }
    if (const AcceptedField* ignored = FindIgnored(key)) {
      MPUSIM_RETURN_IF_ERROR(JudgeAcceptedField(*ignored, value, where, &config.ignored));
      continue;
    }
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      const std::string suggestion = SuggestKey(key, keys);
      return Status::Error(where, suggestion.empty()
                                      ? fmt::format("unknown key; allowed: {}", fmt::join(keys, ", "))
                                      : fmt::format("unknown key; did you mean '{}'?", suggestion));
    }
    MPUSIM_RETURN_IF_ERROR(ParseParallelOption(key, value, where, &config));
  }
  MPUSIM_RETURN_IF_ERROR(CheckPrecision(config, prefix));
  // Megatron's check (megatron/training/arguments.py): "Tensor parallel communication/GEMM
  // overlap can happen only when sequence parallelism is enabled"; Megatron turns sequence
  // parallelism off at tp 1, so tp 1 fails the same check.
  if (config.tp_comm_overlap &&
      (!config.sequence_parallel || config.tensor_model_parallel_size < 2)) {
    return Status::Error(prefix + ".tp_comm_overlap",
                         fmt::format("needs sequence_parallel true and "
                                     "tensor_model_parallel_size > 1 (TE overlaps the sequence-"
                                     "parallel all-gathers and reduce-scatters), got "
                                     "sequence_parallel {} at tensor_model_parallel_size {}",
                                     config.sequence_parallel, config.tensor_model_parallel_size));
  }
  // Megatron's checks of the combined 1F1B schedule (TransformerConfig.__post_init__) that
  // need only this section, in its order; the model's and the run's are CheckGptLayout's.
  if (config.overlap_moe_expert_parallel_comm) {
    if (config.pipeline_model_parallel_size > 1 &&
        !config.virtual_pipeline_model_parallel_size) {
      return Status::Error(prefix + ".overlap_moe_expert_parallel_comm",
                           fmt::format("needs virtual_pipeline_model_parallel_size with "
                                       "pipeline_model_parallel_size {} (Megatron runs the "
                                       "combined 1F1B schedule without pipelining or "
                                       "interleaved)",
                                       config.pipeline_model_parallel_size));
    }
    if (config.expert_model_parallel_size < 2) {
      return Status::Error(prefix + ".overlap_moe_expert_parallel_comm",
                           "needs expert_model_parallel_size > 1 (it overlaps the experts' "
                           "all-to-alls with another micro-batch's compute), got 1");
    }
  }
  if (config.delay_wgrad_compute && !config.overlap_moe_expert_parallel_comm) {
    return Status::Error(prefix + ".delay_wgrad_compute",
                         "needs overlap_moe_expert_parallel_comm true (Megatron's rule)");
  }
  if (!section.contains("world_size")) {
    return Status::Error(prefix + ".world_size",
                         "is required (the number of ranks, e.g. \"world_size\": 16)");
  }
  *out = std::move(config);
  return {};
}

void ToJson(const ParallelConfig& c, json* out) {
  auto optional = [](const std::optional<int64_t>& v) { return v ? json(*v) : json(nullptr); };
  json j = json::object();
  j["world_size"] = c.world_size;
  j["gpus_per_node"] = c.gpus_per_node;
  j["tensor_model_parallel_size"] = c.tensor_model_parallel_size;
  j["pipeline_model_parallel_size"] = c.pipeline_model_parallel_size;
  j["virtual_pipeline_model_parallel_size"] = optional(c.virtual_pipeline_model_parallel_size);
  j["context_parallel_size"] = c.context_parallel_size;
  j["hierarchical_context_parallel_sizes"] =
      c.hierarchical_context_parallel_sizes.empty() ? json(nullptr)
                                                    : json(c.hierarchical_context_parallel_sizes);
  j["expert_model_parallel_size"] = c.expert_model_parallel_size;
  j["expert_tensor_parallel_size"] = optional(c.expert_tensor_parallel_size);
  j["num_distributed_optimizer_instances"] = c.num_distributed_optimizer_instances;
  j["order"] = c.order;
  j["rank_offset"] = c.rank_offset;
  j["microbatch_group_size_per_vp_stage"] = optional(c.microbatch_group_size_per_vp_stage);
  j["num_layers"] = optional(c.num_layers);
  j["sequence_parallel"] = c.sequence_parallel;
  j["tp_comm_overlap"] = c.tp_comm_overlap;
  j["overlap_moe_expert_parallel_comm"] = c.overlap_moe_expert_parallel_comm;
  j["delay_wgrad_compute"] = c.delay_wgrad_compute;
  j["gradient_accumulation_fusion"] = c.gradient_accumulation_fusion;
  j["fp16"] = c.fp16;
  j["bf16"] = c.bf16;
  j["params_dtype"] = c.params_dtype ? json(std::string(DTypeName(*c.params_dtype))) : json(nullptr);
  *out = std::move(j);
}

}  // namespace mpusim
