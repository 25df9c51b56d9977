// Config files (see config.h).
#include "core/config/config.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/config/strict_json.h"

namespace mpusim {
namespace {

// One storage dtype from Megatron's switches (parallel.bf16 / fp16 / params_dtype) and our
// run.dtype: either may set it, and when both do they must agree.
Status ResolveStorageDType(const ParallelConfig& parallel, RunConfig* run) {
  std::optional<DType> megatron = parallel.params_dtype;
  const char* field = "params_dtype";
  if (parallel.bf16) {
    megatron = DType::kBFloat16;
    field = "bf16";
  } else if (parallel.fp16) {
    megatron = DType::kFloat16;
    field = "fp16";
  }
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

}  // namespace

Status ParseConfig(const nlohmann::json& document, Config* out) {
  if (!document.is_object()) {
    return Status::Error("", fmt::format("the config must be a JSON object with a \"parallel\" "
                                         "section, got {}",
                                         document.type_name()));
  }
  static const std::vector<std::string_view> kTopLevel = {"description", "parallel", "model", "run",
                                                          "optimizer"};
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
    } else {
      const std::string suggestion = SuggestKey(key, kTopLevel);
      return Status::Error(
          key, suggestion.empty()
                   ? "unknown top-level key; allowed: description, parallel, model, run, "
                     "optimizer"
                   : fmt::format("unknown top-level key; did you mean '{}'?", suggestion));
    }
  }
  if (!document.contains("parallel")) {
    return Status::Error("parallel", "is required, e.g. {\"parallel\": {\"world_size\": 16, "
                                     "\"tensor_model_parallel_size\": 2}}");
  }
  MPUSIM_RETURN_IF_ERROR(ResolveStorageDType(config.parallel, config.run ? &*config.run : nullptr));
  if (config.run) MPUSIM_RETURN_IF_ERROR(ResolveGlobalBatch(config.parallel, &*config.run));
  *out = std::move(config);
  return {};
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
