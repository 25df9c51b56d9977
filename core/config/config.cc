// Config files (see config.h).
#include "core/config/config.h"

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/config/strict_json.h"
#include "core/config/json_fields.h"

namespace mpusim {
namespace {

// One storage dtype from Megatron's switches (parallel.bf16 / fp16 / params_dtype) and our
// run.dtype: either may set it, and when both do they must agree.
Status ResolveStorageDType(const ParallelConfig& parallel, RunConfig* run) {
  const std::optional<DType> megatron = MegatronStorageDType(parallel);
  const char* field = parallel.bf16 ? "bf16" : parallel.fp16 ? "fp16" : "params_dtype";
  if (run == nullptr || !megatron) return {};
  if (!run->dtype_given) {
    run->dtype = *megatron;
    return {};
  }
  if (run->dtype != *megatron) {
    return Status::Error("run.dtype",
                         fmt::format("is \"{}\" but parallel.{} asks for {} storage; drop one of "
                                     "them or make them agree",
                                     DTypeName(run->dtype), field, DTypeName(*megatron)));
  }
  return {};
}

// run.global_batch_size -> num_microbatches for this layout's data-parallel size. A layout
// whose sizes do not divide the world is left for the topology to refuse.
Status ResolveGlobalBatch(const ParallelConfig& parallel, RunConfig* run) {
  if (!run->global_batch_size) return {};
  const int64_t model_parallel = std::max<int64_t>(parallel.tensor_model_parallel_size, 1) *
                                 std::max<int64_t>(parallel.pipeline_model_parallel_size, 1) *
                                 std::max<int64_t>(parallel.context_parallel_size, 1);
  if (parallel.world_size < 1 || parallel.world_size % model_parallel != 0) return {};
  const int64_t dp = parallel.world_size / model_parallel;
  const int64_t gbs = *run->global_batch_size;
  const int64_t per_microbatch = run->micro_batch_size * dp;
  if (gbs % per_microbatch != 0) {
    return Status::Error("run.global_batch_size",
                         fmt::format("{} is not divisible by micro_batch_size {} * "
                                     "data_parallel_size {} = {}",
                                     gbs, run->micro_batch_size, dp, per_microbatch));
  }
  const int64_t microbatches = gbs / per_microbatch;
  if (run->num_microbatches_given && run->num_microbatches != microbatches) {
    return Status::Error("run.num_microbatches",
                         fmt::format("{} disagrees with global_batch_size {} / (micro_batch_size "
                                     "{} * data_parallel_size {}) = {}; give one of them",
                                     run->num_microbatches, gbs, run->micro_batch_size, dp,
                                     microbatches));
  }
  run->num_microbatches = microbatches;
  return {};
}

const std::vector<std::string_view>& TopLevelKeys() {
  static const std::vector<std::string_view> kKeys = {
      "description", "parallel", "model", "run", "optimizer", "parallelize_plan"};
  return kKeys;
}

// A section of the file and the keys it takes.
struct SectionKeys {
  std::string_view name;  // "" for the top level
  const std::vector<std::string_view>* keys;
  bool (*also_accepts)(std::string_view) = nullptr;  // fields accepted with a note
  bool Knows(std::string_view key) const {
    return std::find(keys->begin(), keys->end(), key) != keys->end() ||
           (also_accepts != nullptr && also_accepts(key));
  }
  std::string Path(std::string_view key) const {
    return name.empty() ? std::string(key) : fmt::format("{}.{}", name, key);
  }
};

// What to tell of an unknown `key` of `section`: a near key of its own section, the section
// it belongs in, a near key of another section ("run.lr" -> "optimizer.lr"), or "".
std::string KeyHint(std::string_view key, const SectionKeys& section,
                    const std::vector<SectionKeys>& all) {
  const auto near = [&](const SectionKeys& s) -> std::string {
    std::string suggestion = SuggestKey(key, *s.keys);
    if (!suggestion.empty()) return suggestion;
    for (std::string_view candidate : *s.keys) {  // beta1 -> adam_beta1
      if (candidate.size() > key.size() + 1 && candidate.ends_with(key) &&
          candidate[candidate.size() - key.size() - 1] == '_') {
        return std::string(candidate);
      }
    }
    return "";
  };
  if (const std::string own = near(section); !own.empty()) {
    return fmt::format("did you mean '{}'?", own);
  }
  for (const SectionKeys& other : all) {
    if (other.name != section.name && other.Knows(key)) {
      return other.name.empty() ? "it is a top-level key"
                                : fmt::format("it belongs in {}", other.Path(key));
    }
  }
  for (const SectionKeys& other : all) {
    if (other.name == section.name) continue;
    if (const std::string there = near(other); !there.empty()) {
      return fmt::format("did you mean '{}'?", other.Path(there));
    }
  }
  return "";
}

// Every unknown key of the file at once (a pasted config would otherwise be refused one key
// per attempt), each with its hint; one error line.
Status CheckKeys(const nlohmann::json& document) {
  static const std::vector<std::string_view> kGptAndChain = [] {
    std::vector<std::string_view> keys = GptConfigKeys();
    for (std::string_view k : ModelConfigKeys()) {
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
    }
    return keys;
  }();
  const nlohmann::json* model = document.contains("model") ? &document.at("model") : nullptr;
  const bool gpt = model != nullptr && IsGptSection(*model);
  // A chain's `model` knows only its own keys; a GPT's its keys and Megatron's fields.
  const SectionKeys model_keys =
      gpt ? SectionKeys{"model", &GptConfigKeys(), IsAcceptedTransformerField}
          : SectionKeys{"model", &ModelConfigKeys()};
  const std::vector<SectionKeys> sections = {
      {"", &TopLevelKeys()},
      {"parallel", &ParallelConfigKeys(), IsAcceptedParallelField},
      model_keys,
      {"run", &RunConfigKeys()},
      {"optimizer", &OptimizerConfigKeys()}};
  // Where a key belongs, other sections are judged by everything they could take.
  std::vector<SectionKeys> targets = sections;
  targets[2] = SectionKeys{"model", &kGptAndChain, IsAcceptedTransformerField};
  if (model != nullptr && model->is_object() && !gpt) {
    for (const auto& [key, value] : model->items()) {
      if (!model_keys.Knows(key) &&
          std::find(GptConfigKeys().begin(), GptConfigKeys().end(), key) != GptConfigKeys().end()) {
        return Status::Error("model", fmt::format("has the GPT key \"{}\" but no \"type\": add "
                                                  "\"type\": \"gpt\" (a model without it is a "
                                                  "layer chain: {})",
                                                  key, fmt::join(ModelConfigKeys(), ", ")));
      }
    }
  }
  struct Unknown {
    std::string path, hint;
    const SectionKeys* section;
  };
  std::vector<Unknown> unknown;
  for (const SectionKeys& section : sections) {
    if (!section.name.empty() && !document.contains(std::string(section.name))) continue;
    const nlohmann::json& object =
        section.name.empty() ? document : document.at(std::string(section.name));
    if (!object.is_object()) continue;  // the section's parser says what it must be
    for (const auto& [key, value] : object.items()) {
      if (section.Knows(key)) continue;
      unknown.push_back({section.Path(key), KeyHint(key, section, targets), &section});
    }
  }
  if (unknown.empty()) return {};
  if (unknown.size() == 1) {
    const Unknown& u = unknown.front();
    const std::string what = u.section->name.empty() ? "unknown top-level key" : "unknown key";
    return Status::Error(u.path, u.hint.empty() ? fmt::format("{}; allowed: {}", what,
                                                              fmt::join(*u.section->keys, ", "))
                                                : fmt::format("{}; {}", what, u.hint));
  }
  // The first kListed keys, each cut to kShownChars: a generated file with thousands of
  // stray keys still gets one readable line.
  constexpr size_t kListed = 12;
  constexpr size_t kShownChars = 80;
  std::vector<std::string> parts;
  for (size_t i = 0; i < std::min(unknown.size(), kListed); ++i) {
    const Unknown& u = unknown[i];
    const std::string path = u.path.size() <= kShownChars
                                 ? u.path
                                 : fmt::format("{}... ({} characters)",
                                               u.path.substr(0, kShownChars), u.path.size());
    parts.push_back(u.hint.empty() ? path : fmt::format("{} ({})", path, u.hint));
  }
  if (unknown.size() > kListed) {
    parts.push_back(fmt::format("and {} more", unknown.size() - kListed));
  }
  return Status::Error("",
                       fmt::format("{} unknown keys: {}", unknown.size(), fmt::join(parts, "; ")));
}

}  // namespace

RunConfig DefaultRun(const Config& config) {
  const ParallelConfig& parallel = config.parallel;
  RunConfig run;
  run.dtype = MegatronStorageDType(parallel).value_or(DType::kFloat32);
  run.seq_length = config.gpt && config.gpt->max_position_embeddings > 0
                       ? config.gpt->max_position_embeddings
                       : 2 * std::max<int64_t>(parallel.tensor_model_parallel_size, 1) *
                             std::max<int64_t>(parallel.context_parallel_size, 1);
  run.num_microbatches = parallel.microbatch_group_size_per_vp_stage.value_or(
      std::max<int64_t>(parallel.pipeline_model_parallel_size, 1));
  return run;
}

OptimizerPrecision PrecisionOf(const Config& config) {
  const DType storage = config.run
                            ? config.run->dtype
                            : MegatronStorageDType(config.parallel).value_or(DType::kFloat32);
  return PrecisionOf(config.optimizer ? &*config.optimizer : nullptr, storage);
}

namespace {

// Megatron's checks of --use-torch-fsdp2 (megatron/training/arguments.py validate_args), and
// the models mpusim's fully_shard wraps (core/model/fully_shard.h).
Status CheckTorchFsdp2(const Config& config) {
  const std::string key = "optimizer.use_torch_fsdp2";
  const ParallelConfig& p = config.parallel;
  if (p.pipeline_model_parallel_size != 1) {
    return Status::Error(key, fmt::format("needs pipeline_model_parallel_size 1, got {} "
                                          "(Megatron: \"--use-torch-fsdp2 is not supported with "
                                          "pipeline parallelism\")",
                                          p.pipeline_model_parallel_size));
  }
  if (p.expert_model_parallel_size != 1) {
    return Status::Error(key, fmt::format("needs expert_model_parallel_size 1, got {} "
                                          "(Megatron: \"--use-torch-fsdp2 is not supported with "
                                          "expert parallelism\")",
                                          p.expert_model_parallel_size));
  }
  if (p.gradient_accumulation_fusion) {
    return Status::Error(key,
                         "cannot be combined with parallel.gradient_accumulation_fusion "
                         "(Megatron: \"--use-torch-fsdp2 is not supported with gradient "
                         "accumulation fusion\")");
  }
  if (config.run && config.run->dtype == DType::kFloat16) {
    return Status::Error(key,
                         "cannot train in fp16 (Megatron: \"--use-torch-fsdp2 not supported "
                         "with fp16 yet\"); use bf16 or fp32");
  }
  if (config.gpt) {
    if (config.gpt->share_embeddings_and_output_weights) {
      return Status::Error(key,
                           "needs model.share_embeddings_and_output_weights false (Megatron: "
                           "\"--use-torch-fsdp2 requires "
                           "--untie-embeddings-and-output-weights\")");
    }
    if (config.gpt->moe.num_experts > 0 || config.gpt->mtp_num_layers > 0) {
      return Status::Error(key,
                           "wraps a dense GPT without multi-token prediction in mpusim; "
                           "set num_moe_experts and mtp_num_layers to 0, or use DDP");
    }
  }
  return {};
}

}  // namespace

Status ParseConfig(const nlohmann::json& document, Config* out) {
  if (!document.is_object()) {
    return Status::Error("", fmt::format("the config must be a JSON object with a \"parallel\" "
                                         "section, got {}",
                                         document.type_name()));
  }
  MPUSIM_RETURN_IF_ERROR(CheckKeys(document));
  const std::vector<std::string_view>& kTopLevel = TopLevelKeys();
  Config config;
  for (const auto& [key, value] : document.items()) {
    if (key == "description") {
      if (!value.is_string()) {
        return Status::Error("description",
                             fmt::format("must be a string, got {}", value.type_name()));
      }
      config.description = value.get<std::string>();
    } else if (key == "parallel") {
      MPUSIM_RETURN_IF_ERROR(ParseParallelSection(value, "parallel", &config.parallel));
    } else if (key == "model" && IsGptSection(value)) {
      config.gpt.emplace();
      MPUSIM_RETURN_IF_ERROR(ParseGptSection(value, &*config.gpt));
    } else if (key == "model") {
      config.model.emplace();
      MPUSIM_RETURN_IF_ERROR(ParseModelSection(value, &*config.model));
    } else if (key == "run") {
      config.run.emplace();
      MPUSIM_RETURN_IF_ERROR(ParseRunSection(value, &*config.run));
    } else if (key == "optimizer") {
      config.optimizer.emplace();
      MPUSIM_RETURN_IF_ERROR(ParseOptimizerSection(value, &*config.optimizer));
    } else if (key == "parallelize_plan") {
      StatusOr<ParallelizePlan> plan = ParseParallelizePlan(value, "parallelize_plan");
      if (!plan.ok()) return plan.status();
      config.parallelize_plan = *std::move(plan);
    } else {
      const std::string suggestion = SuggestKey(key, kTopLevel);
      return Status::Error(
          key, suggestion.empty()
                   ? "unknown top-level key; allowed: description, parallel, model, run, "
                     "optimizer, parallelize_plan"
                   : fmt::format("unknown top-level key; did you mean '{}'?", suggestion));
    }
  }
  if (!document.contains("parallel")) {
    return Status::Error("parallel", "is required, e.g. {\"parallel\": {\"world_size\": 16, "
                                     "\"tensor_model_parallel_size\": 2}}");
  }
  // One source of truth for a GPT's layer count: model.num_layers (parallel.num_layers, the
  // layout's assignment, may repeat it but not contradict it).
  if (config.gpt) {
    const std::optional<int64_t>& given = config.parallel.num_layers;
    if (given && *given != config.gpt->num_layers) {
      return Status::Error("parallel.num_layers",
                           fmt::format("{} disagrees with model.num_layers {}; a GPT config's "
                                       "layers are model.num_layers: drop parallel.num_layers",
                                       *given, config.gpt->num_layers));
    }
    // An uneven pipeline split is checked against the layers here, so that every subcommand
    // refuses the same configs (the even split's divisibility stays the model's check).
    if (!config.parallel.Split().Even()) {
      StatusOr<LayerAssignment> layers =
          AssignLayers(config.parallel.Split(), config.gpt->num_layers);
      if (!layers.ok()) return layers.status();
      MPUSIM_RETURN_IF_ERROR(CheckMtpInLayout(config.parallel.Split(), config.gpt->mtp_num_layers));
    }
  }
  // A plan styles torch.nn modules (a chain written in them: core/model/graph_torch.cc) or
  // the GPT's, when it is Megatron's own plan (core/model/gpt_torch_plan.h).
  if (config.parallelize_plan && !config.gpt && !(config.model && config.model->IsTorchChain())) {
    return Status::Error("parallelize_plan",
                         "styles a chain of torch.nn modules (model.layers of type Embedding, "
                         "Linear, ReLU, GELU, Dropout, LayerNorm, CrossEntropyLoss) or a GPT's "
                         "modules; this config has neither");
  }
  if (config.run && config.run->loss_parallel && !(config.model && config.model->IsTorchChain())) {
    return Status::Error("run.loss_parallel",
                         "is PyTorch's loss_parallel() for a chain of torch.nn modules; "
                         "Megatron's layers compute the vocab-parallel cross entropy whenever "
                         "the logits are split");
  }
  MPUSIM_RETURN_IF_ERROR(ResolveStorageDType(config.parallel, config.run ? &*config.run : nullptr));
  if (config.run) MPUSIM_RETURN_IF_ERROR(ResolveGlobalBatch(config.parallel, &*config.run));
  if (config.optimizer && config.optimizer->use_torch_fsdp2) {
    MPUSIM_RETURN_IF_ERROR(CheckTorchFsdp2(config));
  }
  if (config.optimizer) {
    const DType storage = config.run
                              ? config.run->dtype
                              : MegatronStorageDType(config.parallel).value_or(DType::kFloat32);
    MPUSIM_RETURN_IF_ERROR(CheckOptimizerPrecision(*config.optimizer, storage));
  }
  *out = std::move(config);
  return {};
}

nlohmann::json EffectiveConfigJson(const nlohmann::json& document, const Config& config) {
  nlohmann::json out = document;
  nlohmann::json parallel;
  ToJson(config.parallel, &parallel);
  // update(), not assignment: the parallel echo leaves out the Megatron fields it ignores.
  out["parallel"].update(parallel);
  if (config.run) ToJson(*config.run, &out["run"]);
  return out;
}

StatusOr<nlohmann::json> ParseJsonText(std::string_view text) {
  return ParseStrictJson<nlohmann::json>(text);
}

StatusOr<nlohmann::json> ReadJsonFile(const std::string& path) {
  StatusOr<std::string> text = ReadJsonText(path);
  if (!text.ok()) return text.status();
  return ParseJsonText(*text);
}

StatusOr<Config> LoadConfigFile(const std::string& path) {
  StatusOr<nlohmann::json> document = ReadJsonFile(path);
  if (!document.ok()) return document.status();
  Config config;
  MPUSIM_RETURN_IF_ERROR(ParseConfig(*document, &config));
  return config;
}

}  // namespace mpusim
