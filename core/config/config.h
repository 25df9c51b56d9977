// Config files: loading and the top level of the schema.
//
// {
//   "description": "...",           optional free text
//   "parallel": { ... }             required; see parallel_config.h
//   "model": { ... }, "run": { ... } optional; the model for `mpusim run`: a layer chain
//                                    (model_config.h) or, with "type": "gpt", Megatron's
//                                    GPT model (gpt_config.h)
//   "parallelize_plan": ...          optional; PyTorch's tensor-parallel plan over a chain of
//                                    torch.nn modules (parallelize_plan.h)
// }
// Unknown top-level keys are refused (with a suggestion), so a typo never silently keeps a
// default.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/config/gpt_config.h"
#include "core/config/model_config.h"
#include "core/config/optimizer_config.h"
#include "core/config/parallel_config.h"
#include "core/config/parallelize_plan.h"
#include "core/status.h"

namespace mpusim {

struct Config {
  std::string description;
  ParallelConfig parallel;
  std::optional<ModelConfig> model;  // the layer chain (the lab format)
  std::optional<GptConfig> gpt;      // or the GPT model ("model": {"type": "gpt", ...})
  std::optional<RunConfig> run;
  // Training (GPT models): run.train_iters optimizer steps (core/config/optimizer_config.h).
  std::optional<OptimizerConfig> optimizer;
  // parallelize_module's plan over a chain of torch.nn modules (ModelConfig::IsTorchChain), on
  // the tp dimension of parallel.device_mesh (or tensor_model_parallel_size).
  std::optional<ParallelizePlan> parallelize_plan;

  // Whether the config describes a model at all (core/model/model.h BuildModel builds it).
  bool has_model() const { return model.has_value() || gpt.has_value(); }
  // One line per field given that changes nothing mpusim computes (Megatron's fields of
  // `parallel` and of a GPT `model`), to print as "note: " lines.
  std::vector<std::string> notes() const {
    std::vector<std::string> out = parallel.ignored;
    if (gpt) out.insert(out.end(), gpt->ignored.begin(), gpt->ignored.end());
    return out;
  }
};

// The run section a command assumes when the config has none (layout, explain, estimate and
// advise; `mpusim run` needs one), the one defaulter of them all: the storage dtype of
// parallel.bf16/fp16/params_dtype (else float32); the sequence the model's positions are
// sized for, a GPT's max_position_embeddings when it has one (Megatron sizes the position
// table for the longest sequence), else the shortest sequence the layout splits (2 cp chunks,
// each cut over tp under sequence parallelism: 2 * tp * cp); and the fewest micro-batches
// every schedule accepts (microbatch_group_size_per_vp_stage, else pp).
RunConfig DefaultRun(const Config& config);

// The dtypes of the gradient buffer and the optimizer's tensors of a config's run (PrecisionOf
// in core/config/optimizer_config.h, with the run's storage dtype; float32 without a run).
OptimizerPrecision PrecisionOf(const Config& config);

// Parses a whole config document. Errors name the JSON path ("parallel.order").
Status ParseConfig(const nlohmann::json& document, Config* out);

// Parses JSON text; syntax errors are reported as "line L, column C: ...".
StatusOr<nlohmann::json> ParseJsonText(std::string_view text);

// Reads a file and parses it as JSON (no schema check). Errors carry no file name: the
// caller prefixes it.
StatusOr<nlohmann::json> ReadJsonFile(const std::string& path);

// The effective config of a run, as JSON: `document` (the file with every command-line
// override applied, which ParseConfig turned into `config`) with its `parallel` and `run`
// sections written back from `config` (their defaults and resolved values included;
// Megatron's fields that change nothing stay as given). Other sections stay as written.
// ParseConfig accepts it and gives the same run: what a dump and a run's summary record.
nlohmann::json EffectiveConfigJson(const nlohmann::json& document, const Config& config);

// ReadJsonFile + ParseConfig.
StatusOr<Config> LoadConfigFile(const std::string& path);

}  // namespace mpusim
