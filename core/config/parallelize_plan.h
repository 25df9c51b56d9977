// parallelize_plan (a config's top-level key): PyTorch's tensor-parallel styles
// (torch.distributed.tensor.parallel.style) as a plan writes them, module FQN patterns to
// styles, parsed and checked for their keys; their layouts stay torch's strings until
// core/tensor_parallel/parallel_style.h applies a style to a module and resolves them
// against the tensor's rank.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace mpusim {

enum class ParallelStyleKind : uint8_t {
  kColwise,
  kRowwise,
  kPairwise,  // PyTorch 2.0: Colwise on the first Linear of a pair, Rowwise on the second
  kSequenceParallel,
  kPrepareModuleInput,
  kPrepareModuleOutput,
};

// A style as a plan writes it; layouts as torch spells them, resolved against the tensor's
// rank when the style is applied (a negative Shard counts from the end).
struct ParallelStyle {
  ParallelStyleKind kind = ParallelStyleKind::kColwise;
  std::optional<std::string> input_layouts, desired_input_layouts;
  std::optional<std::string> output_layouts, desired_output_layouts;
  std::optional<bool> use_local_output;  // none: the style's default
  int64_t sequence_dim = 1;              // SequenceParallel
};

std::string_view ParallelStyleName(ParallelStyleKind kind);  // "ColwiseParallel", ...

// A style from a plan's JSON: its name ("ColwiseParallel") or an object {"style": name,
// "input_layouts": "Shard(-1)", ...} with the style's keyword arguments; `where` names the
// plan entry in errors (one line naming the key and what is allowed).
StatusOr<ParallelStyle> ParseParallelStyle(const nlohmann::json& value, const std::string& where);

// parallelize_plan: one style for the whole model, or module FQN patterns ('*' stands for
// one path component) to styles, in the JSON object's key order (sorted: a plan applier must
// not let two patterns on one module depend on it).
struct ParallelizePlan {
  std::vector<std::pair<std::string, ParallelStyle>> entries;  // FQN "" : the whole model
};
StatusOr<ParallelizePlan> ParseParallelizePlan(const nlohmann::json& value,
                                               const std::string& where);
// Whether `fqn` ("decoder.layers.3.mlp") matches `pattern` ("decoder.layers.*.mlp"), path
// component by path component with fnmatch's '*' and '?' (parallelize_module matches each
// component with fnmatch: "norm*" is norm and norm2, never a.b).
bool FqnMatches(std::string_view pattern, std::string_view fqn);

}  // namespace mpusim
