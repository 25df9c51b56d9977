// Strict parsing of the `parallel` section (see parallel_config.h).
#include "core/config/parallel_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "core/config/field_table.h"
#include "core/config/json_fields.h"
#include "core/config/suggest.h"

namespace mpusim {
namespace {

using nlohmann::json;

}  // namespace

std::optional<DType> MegatronStorageDType(const ParallelConfig& config) {
  if (config.bf16) return DType::kBFloat16;
  if (config.fp16) return DType::kFloat16;
  return config.params_dtype;
}

namespace {

using ParallelField = Field<ParallelConfig>;

// {"mesh_shape": [2, 4], "mesh_dim_names": ["dp", "tp"]}: the shape and its names, read as
// given (ResolveDeviceMesh checks them against the other keys once the section is read).
Status ParseDeviceMesh(const json& value, const std::string& where, ParallelConfig* c) {
  const char* kForm =
      "must be {\"mesh_shape\": [sizes], \"mesh_dim_names\": [names]} with names \"dp\" and "
      "\"tp\", e.g. {\"mesh_shape\": [2, 4], \"mesh_dim_names\": [\"dp\", \"tp\"]}";
  if (!value.is_object()) return Status::Error(where, kForm);
  ParallelConfig::DeviceMesh mesh;
  for (const auto& [key, v] : value.items()) {
    const std::string at = where + "." + key;
    if (key == "mesh_shape") {
      MPUSIM_RETURN_IF_ERROR(ParseIntList(v, at, 1, &mesh.mesh_shape));
    } else if (key == "mesh_dim_names") {
      if (!v.is_array()) return Status::Error(at, "must be a list of names, e.g. [\"dp\", \"tp\"]");
      for (const json& name : v) {
        if (!name.is_string() || (name != "dp" && name != "tp")) {
          return Status::Error(at, fmt::format("names \"dp\" and \"tp\" only (the dimensions "
                                               "mpusim's layouts have), got {}",
                                               DescribeJson(name)));
        }
        if (std::find(mesh.mesh_dim_names.begin(), mesh.mesh_dim_names.end(), name) !=
            mesh.mesh_dim_names.end()) {
          return Status::Error(at, fmt::format("names {} twice", DescribeJson(name)));
        }
        mesh.mesh_dim_names.push_back(name.get<std::string>());
      }
    } else {
      return Status::Error(at, "unknown key; a device mesh has mesh_shape and mesh_dim_names");
    }
  }
  if (mesh.mesh_shape.empty() || mesh.mesh_shape.size() != mesh.mesh_dim_names.size()) {
    return Status::Error(where,
                         fmt::format("{}; mesh_shape has {} sizes and mesh_dim_names {} "
                                     "names",
                                     kForm, mesh.mesh_shape.size(), mesh.mesh_dim_names.size()));
  }
  c->device_mesh = std::move(mesh);
  return {};
}

// A device mesh's sizes and order, set once the whole section is read; refused where another
// key says otherwise.
Status ResolveDeviceMesh(const json& section, const std::string& prefix, ParallelConfig* c) {
  const ParallelConfig::DeviceMesh& mesh = *c->device_mesh;
  const std::string where = prefix + ".device_mesh";
  int64_t world = 1;
  for (int64_t size : mesh.mesh_shape) {
    if (size > (int64_t{1} << 20) / world) {
      return Status::Error(where + ".mesh_shape", "covers more than 2^20 ranks");
    }
    world *= size;
  }
  const int64_t tp = mesh.SizeOf("tp");
  if (section.contains("tensor_model_parallel_size") && c->tensor_model_parallel_size != tp) {
    return Status::Error(prefix + ".tensor_model_parallel_size",
                         fmt::format("is {} but device_mesh's \"tp\" dimension is {}; set one of "
                                     "them",
                                     c->tensor_model_parallel_size, tp));
  }
  if (section.contains("world_size") && c->world_size != world) {
    return Status::Error(prefix + ".world_size",
                         fmt::format("is {} but device_mesh covers {} ranks; set one of them",
                                     c->world_size, world));
  }
  // The mesh decides the layout: the other sizes stay 1 and the order is the mesh's (an
  // effective config, which writes them all back, reads the same).
  const bool tp_fastest = mesh.mesh_dim_names.back() == "tp";
  const std::string order = tp_fastest ? "tp-cp-ep-dp-pp" : "dp-tp-cp-ep-pp";
  const std::pair<const char*, bool> others[] = {
      {"pipeline_model_parallel_size", c->pipeline_model_parallel_size == 1},
      {"context_parallel_size", c->context_parallel_size == 1},
      {"expert_model_parallel_size", c->expert_model_parallel_size == 1},
      {"virtual_pipeline_model_parallel_size", !c->virtual_pipeline_model_parallel_size},
      {"order", !section.contains("order") || c->order == order}};
  for (const auto& [key, agrees] : others) {
    if (!agrees) {
      return Status::Error(prefix + "." + key,
                           fmt::format("cannot be set with device_mesh: a mesh of \"dp\" and "
                                       "\"tp\" dimensions decides the layout (order \"{}\", "
                                       "the other sizes 1)",
                                       order));
    }
  }
  c->tensor_model_parallel_size = tp;
  c->world_size = world;
  // init_device_mesh is row-major: the last name varies fastest. Megatron's order lists the
  // fastest first, tp by default.
  c->order = order;
  return {};
}

// The section's keys, in documentation order.
constexpr ParallelField kFields[] = {
    {.key = "world_size",
     .target = &ParallelConfig::world_size,
     .help = "number of ranks (GPUs) the layout covers",
     .flag = "--world-size,-n",
     .required = "the number of ranks, e.g. \"world_size\": 16"},
    {"gpus_per_node", &ParallelConfig::gpus_per_node, "GPUs per node for the node map (default 8)",
     "--gpus-per-node"},
    {"tensor_model_parallel_size", &ParallelConfig::tensor_model_parallel_size,
     "tensor-parallel size", "--tp"},
    {"pipeline_model_parallel_size", &ParallelConfig::pipeline_model_parallel_size,
     "pipeline-parallel size", "--pp"},
    {"virtual_pipeline_model_parallel_size", &ParallelConfig::virtual_pipeline_model_parallel_size,
     "virtual pipeline size (model chunks per pipeline rank)", "--vp"},
    {"context_parallel_size", &ParallelConfig::context_parallel_size, "context-parallel size",
     "--cp"},
    {"hierarchical_context_parallel_sizes", &ParallelConfig::hierarchical_context_parallel_sizes,
     "hierarchical context-parallel sizes, e.g. 2,2", "--hcp"},
    {"expert_model_parallel_size", &ParallelConfig::expert_model_parallel_size,
     "expert-parallel size", "--ep"},
    {"expert_tensor_parallel_size", &ParallelConfig::expert_tensor_parallel_size,
     "expert tensor-parallel size (default: --tp)", "--etp"},
    {"num_distributed_optimizer_instances", &ParallelConfig::num_distributed_optimizer_instances,
     "number of distributed-optimizer instances", "--dist-opt-instances"},
    {"order",
     Codec<ParallelConfig>{
         FieldKind::kText,
         [](const json& value, const std::string& where, ParallelConfig* c) {
           if (!value.is_string()) {
             return Status::Error(where, fmt::format("must be a string such as \"tp-cp-ep-dp-pp\", "
                                                     "got {}",
                                                     DescribeJson(value)));
           }
           c->order = value.get<std::string>();
           return Status();
         },
         [](const ParallelConfig& c) { return json(c.order); }},
     "rank order of the axes (default tp-cp-ep-dp-pp)", "--order"},
    {"rank_offset", &ParallelConfig::rank_offset, "first global rank of the layout",
     "--rank-offset", 0},
    {"microbatch_group_size_per_vp_stage", &ParallelConfig::microbatch_group_size_per_vp_stage,
     "microbatch_group_size_per_vp_stage (interleaved schedule; default: pp size)",
     "--microbatch-group-size"},
    {"num_layers", &ParallelConfig::num_layers, "layers, for the virtual-pipeline assignment",
     "--num-layers"},
    {"pipeline_model_parallel_layout",
     Codec<ParallelConfig>{
         FieldKind::kText,
         [](const json& value, const std::string& where, ParallelConfig* c) {
           c->pipeline_model_parallel_layout.reset();
           if (value.is_null()) return Status();
           if (!value.is_string()) {
             return Status::Error(where, fmt::format("must be a layout string such as "
                                                     "\"Ettt|(tt|)*2,tL\" or null, got {}",
                                                     DescribeJson(value)));
           }
           c->pipeline_model_parallel_layout = value.get<std::string>();
           return Status();
         },
         [](const ParallelConfig& c) {
           return c.pipeline_model_parallel_layout ? json(*c.pipeline_model_parallel_layout)
                                                   : json(nullptr);
         }},
     "Megatron's layout of the pipeline stages, e.g. \"Et|tt|tt|tL\": E embedding, t layer, L "
     "loss, | between stages",
     "--pipeline-model-parallel-layout"},
    {"decoder_first_pipeline_num_layers", &ParallelConfig::decoder_first_pipeline_num_layers,
     "decoder layers on the first pipeline stage (the others share the rest)",
     "--decoder-first-pipeline-num-layers"},
    {"decoder_last_pipeline_num_layers", &ParallelConfig::decoder_last_pipeline_num_layers,
     "decoder layers on the last pipeline stage (the others share the rest)",
     "--decoder-last-pipeline-num-layers"},
    {"account_for_embedding_in_pipeline_split",
     &ParallelConfig::account_for_embedding_in_pipeline_split,
     "the embedding counts as one layer when the layers are split over the stages",
     "--account-for-embedding-in-pipeline-split"},
    {"account_for_loss_in_pipeline_split", &ParallelConfig::account_for_loss_in_pipeline_split,
     "the loss counts as one layer when the layers are split over the stages",
     "--account-for-loss-in-pipeline-split"},
    {"sequence_parallel", &ParallelConfig::sequence_parallel,
     "sequence parallelism (norms and dropouts on s / tp tokens)", "--sequence-parallel"},
    {"tp_comm_overlap", &ParallelConfig::tp_comm_overlap,
     "TE's overlap of the tp collectives with the GEMMs (timing only; needs "
     "--sequence-parallel true)",
     "--tp-comm-overlap"},
    {"overlap_moe_expert_parallel_comm", &ParallelConfig::overlap_moe_expert_parallel_comm,
     "Megatron's combined 1F1B schedule, the experts' all-to-alls hidden behind another "
     "micro-batch's compute (timing only; needs --ep > 1)",
     "--overlap-moe-expert-parallel-comm"},
    {"delay_wgrad_compute", &ParallelConfig::delay_wgrad_compute,
     "the experts' weight gradients after their backward all-to-all starts (timing only; needs "
     "--overlap-moe-expert-parallel-comm true)",
     "--delay-wgrad-compute"},
    {"gradient_accumulation_fusion", &ParallelConfig::gradient_accumulation_fusion,
     "weight-gradient GEMMs accumulate straight into main_grad"},
    {.key = "fp16",
     .target = &ParallelConfig::fp16,
     .help = "parameters, activations and gradients in float16",
     .effect = FieldEffect::kPrecision},
    {.key = "bf16",
     .target = &ParallelConfig::bf16,
     .help = "parameters, activations and gradients in bfloat16",
     .effect = FieldEffect::kPrecision},
    {.key = "params_dtype",
     .target = Codec<ParallelConfig>{
         FieldKind::kText,
         [](const json& value, const std::string& where, ParallelConfig* c) {
           c->params_dtype.reset();
           if (value.is_null()) return Status();
           std::string name = value.is_string() ? value.get<std::string>() : std::string();
           if (name.starts_with("torch.")) name = name.substr(6);
           c->params_dtype = DTypeFromName(name);
           if (!c->params_dtype || !IsFloat(*c->params_dtype) ||
               *c->params_dtype == DType::kFloat64) {
             return Status::Error(where, fmt::format("must be \"float32\", \"bfloat16\", "
                                                     "\"float16\" or null, got {}",
                                                     DescribeJson(value)));
           }
           return Status();
         },
         [](const ParallelConfig& c) {
           return c.params_dtype ? json(std::string(DTypeName(*c.params_dtype))) : json(nullptr);
         }},
     .help = "the parameters' storage dtype (float32, bfloat16 or float16)",
     .effect = FieldEffect::kPrecision},
    {"device_mesh",
     Codec<ParallelConfig>{FieldKind::kText,
                           [](const json& value, const std::string& where, ParallelConfig* c) {
                             c->device_mesh.reset();
                             if (value.is_null()) return Status();
                             return ParseDeviceMesh(value, where, c);
                           },
                           [](const ParallelConfig& c) {
                             if (!c.device_mesh) return json(nullptr);
                             return json{{"mesh_shape", c.device_mesh->mesh_shape},
                                         {"mesh_dim_names", c.device_mesh->mesh_dim_names}};
                           }},
     "PyTorch's device mesh, e.g. {\"mesh_shape\": [2, 4], \"mesh_dim_names\": [\"dp\", "
     "\"tp\"]} (init_device_mesh; sets tensor_model_parallel_size and world_size)"},
};

}  // namespace

std::span<const Field<ParallelConfig>> ParallelFields() { return kFields; }

int64_t ParallelConfig::DeviceMesh::SizeOf(std::string_view name) const {
  for (size_t i = 0; i < mesh_dim_names.size(); ++i) {
    if (mesh_dim_names[i] == name) return mesh_shape[i];
  }
  return 1;
}

const std::vector<std::string_view>& ParallelConfigKeys() {
  static const std::vector<std::string_view> kKeys = KeysOf(ParallelFields());
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
  return ClosestName(unknown, candidates);
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
    const ParallelField* field = FindField(ParallelFields(), key);
    if (field == nullptr) return UnknownKey(where, key, ParallelConfigKeys());
    MPUSIM_RETURN_IF_ERROR(field->Parse(value, where, &config));
  }
  MPUSIM_RETURN_IF_ERROR(CheckPrecision(config, prefix));
  // Megatron's checks of the split keys; a layout may set the virtual pipeline size.
  PipelineSplit split = config.Split();
  MPUSIM_RETURN_IF_ERROR(ResolvePipelineSplitKeys(&split));
  config.virtual_pipeline_model_parallel_size = split.virtual_pipeline_model_parallel_size;
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
  if (config.device_mesh) {
    MPUSIM_RETURN_IF_ERROR(ResolveDeviceMesh(section, prefix, &config));
  } else {
    MPUSIM_RETURN_IF_ERROR(CheckRequired(ParallelFields(), section, prefix));
  }
  *out = std::move(config);
  return {};
}

void ToJson(const ParallelConfig& c, json* out) { *out = EchoFields(ParallelFields(), c); }

}  // namespace mpusim
