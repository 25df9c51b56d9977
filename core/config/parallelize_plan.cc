// parallelize_plan: PyTorch's tensor-parallel styles as a config writes them (see
// parallelize_plan.h).
#include "core/config/parallelize_plan.h"

#include <fmt/format.h>

#include <array>

namespace mpusim {
namespace {

using nlohmann::json;

struct StyleName {
  std::string_view name;
  ParallelStyleKind kind;
};
constexpr std::array<StyleName, 6> kStyles = {{
    {"ColwiseParallel", ParallelStyleKind::kColwise},
    {"RowwiseParallel", ParallelStyleKind::kRowwise},
    {"PairwiseParallel", ParallelStyleKind::kPairwise},
    {"SequenceParallel", ParallelStyleKind::kSequenceParallel},
    {"PrepareModuleInput", ParallelStyleKind::kPrepareModuleInput},
    {"PrepareModuleOutput", ParallelStyleKind::kPrepareModuleOutput},
}};

std::string StyleNames() {
  std::string out;
  for (const StyleName& s : kStyles)
    out += fmt::format("{}\"{}\"", out.empty() ? "" : ", ", s.name);
  return out;
}

// PyTorch 2.0's prepare functions: the layout each annotates or redistributes to, and
// whether the module then hands on a plain tensor.
struct PrepareFn {
  std::string_view name;
  const char* layout;  // null: the output as produced
  bool local;          // a torch.Tensor (true) or the DTensor
};
constexpr std::array<PrepareFn, 4> kPrepareInputs = {{
    {"make_input_replicate_1d", "Replicate()", false},
    {"make_input_shard_1d", "Shard(0)", false},
    {"make_input_shard_1d_last_dim", "Shard(-1)", false},
    {"make_input_reshard_replicate", "Shard(0)", false},  // then Replicate(): the style's own
}};
constexpr std::array<PrepareFn, 5> kPrepareOutputs = {{
    {"make_output_replicate_1d", "Replicate()", false},
    {"make_output_shard_1d", "Shard(0)", false},
    {"make_output_tensor", "Replicate()", true},
    {"make_output_reshard_tensor", "Shard(0)", true},
    {"make_sharded_output_tensor", nullptr, true},
}};

template <size_t N>
std::string FnNames(const std::array<PrepareFn, N>& fns) {
  std::string out;
  for (const PrepareFn& f : fns) out += fmt::format("{}\"{}\"", out.empty() ? "" : ", ", f.name);
  return out;
}

Status ReadString(const json& value, const std::string& where, std::optional<std::string>* out) {
  if (value.is_null()) return {};
  if (!value.is_string()) {
    return Status::Error(where,
                         "must be a placement string such as \"Shard(-1)\" or "
                         "\"Replicate()\"");
  }
  *out = value.get<std::string>();
  return {};
}

}  // namespace

std::string_view ParallelStyleName(ParallelStyleKind kind) {
  for (const StyleName& s : kStyles) {
    if (s.kind == kind) return s.name;
  }
  return "";
}

StatusOr<ParallelStyle> ParseParallelStyle(const json& value, const std::string& where) {
  const auto kind_of = [&](const json& name, const std::string& at) -> StatusOr<ParallelStyleKind> {
    if (name.is_string()) {
      for (const StyleName& s : kStyles) {
        if (name.get<std::string>() == s.name) return s.kind;
      }
    }
    return Status::Error(
        at, fmt::format("{} is not a parallel style; use one of {}", name.dump(), StyleNames()));
  };
  ParallelStyle style;
  if (value.is_string()) {
    StatusOr<ParallelStyleKind> kind = kind_of(value, where);
    if (!kind.ok()) return kind.status();
    style.kind = *kind;
    return style;
  }
  if (!value.is_object() || !value.contains("style")) {
    return Status::Error(where,
                         "must be a style name such as \"ColwiseParallel\" or an object "
                         "{\"style\": name, ...its keyword arguments}");
  }
  StatusOr<ParallelStyleKind> kind = kind_of(value["style"], where + ".style");
  if (!kind.ok()) return kind.status();
  style.kind = *kind;
  for (const auto& [key, v] : value.items()) {
    const std::string at = where + "." + key;
    Status read;
    if (key == "style") {
      continue;
    } else if (key == "input_layouts") {
      read = ReadString(v, at, &style.input_layouts);
    } else if (key == "desired_input_layouts") {
      read = ReadString(v, at, &style.desired_input_layouts);
    } else if (key == "output_layouts") {
      read = ReadString(v, at, &style.output_layouts);
    } else if (key == "desired_output_layouts") {
      read = ReadString(v, at, &style.desired_output_layouts);
    } else if (key == "use_local_output") {
      if (!v.is_boolean()) return Status::Error(at, "must be true or false");
      style.use_local_output = v.get<bool>();
    } else if (key == "sequence_dim") {
      if (!v.is_number_integer()) return Status::Error(at, "must be an integer");
      style.sequence_dim = v.get<int64_t>();
    } else if (key == "_prepare_input" || key == "_prepare_output") {
      const bool input = key == "_prepare_input";
      const std::string name = v.is_string() ? v.get<std::string>() : v.dump();
      const PrepareFn* fn = nullptr;
      if (input) {
        for (const PrepareFn& f : kPrepareInputs) fn = f.name == name ? &f : fn;
      } else {
        for (const PrepareFn& f : kPrepareOutputs) fn = f.name == name ? &f : fn;
      }
      if (fn == nullptr) {
        return Status::Error(
            at, fmt::format("\"{}\" is not one of PyTorch 2.0's {} functions: {}", name,
                            input ? "input" : "output",
                            input ? FnNames(kPrepareInputs) : FnNames(kPrepareOutputs)));
      }
      if (input) {
        style.input_layouts = fn->layout;
      } else {
        if (fn->layout != nullptr) style.output_layouts = fn->layout;
        style.use_local_output = fn->local;
      }
    } else {
      return Status::Error(at, fmt::format("is not a keyword of {}; allowed: input_layouts, "
                                           "desired_input_layouts, output_layouts, "
                                           "desired_output_layouts, use_local_output, "
                                           "sequence_dim, _prepare_input, _prepare_output",
                                           ParallelStyleName(style.kind)));
    }
    if (!read.ok()) return read;
  }
  const bool prepare_in = style.kind == ParallelStyleKind::kPrepareModuleInput;
  const bool prepare_out = style.kind == ParallelStyleKind::kPrepareModuleOutput;
  if (prepare_in && style.input_layouts.has_value() != style.desired_input_layouts.has_value()) {
    return Status::Error(where,
                         "PrepareModuleInput needs input_layouts and "
                         "desired_input_layouts together (\"desired module inputs should "
                         "not be None!\")");
  }
  if (prepare_out && (!style.output_layouts || !style.desired_output_layouts)) {
    return Status::Error(where,
                         "PrepareModuleOutput needs output_layouts and "
                         "desired_output_layouts");
  }
  return style;
}

StatusOr<ParallelizePlan> ParseParallelizePlan(const json& value, const std::string& where) {
  ParallelizePlan plan;
  if (value.is_string() || (value.is_object() && value.contains("style"))) {
    StatusOr<ParallelStyle> style = ParseParallelStyle(value, where);
    if (!style.ok()) return style.status();
    plan.entries.emplace_back("", *style);
    return plan;
  }
  if (!value.is_object() || value.empty()) {
    return Status::Error(where,
                         "must be a style (\"PairwiseParallel\") or an object from "
                         "module FQN to style ({\"fc1\": \"ColwiseParallel\"})");
  }
  for (const auto& [fqn, style_json] : value.items()) {
    if (fqn.empty() || fqn.front() == '.' || fqn.back() == '.' ||
        fqn.find("..") != std::string::npos) {
      return Status::Error(where, fmt::format("\"{}\" is not a module FQN (dot-separated names, "
                                              "'*' for one of them)",
                                              fqn));
    }
    StatusOr<ParallelStyle> style = ParseParallelStyle(style_json, where + "." + fqn);
    if (!style.ok()) return style.status();
    plan.entries.emplace_back(fqn, *style);
  }
  return plan;
}

namespace {

// fnmatch's '*' (any run of characters) and '?' (one character) within one path component.
bool ComponentMatches(std::string_view pattern, std::string_view name) {
  size_t p = 0, n = 0, star = std::string_view::npos, resume = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace

bool FqnMatches(std::string_view pattern, std::string_view fqn) {
  while (true) {
    const size_t p = pattern.find('.'), f = fqn.find('.');
    if (!ComponentMatches(pattern.substr(0, p), fqn.substr(0, f))) return false;
    if (p == std::string_view::npos || f == std::string_view::npos) {
      return p == std::string_view::npos && f == std::string_view::npos;
    }
    pattern.remove_prefix(p + 1);
    fqn.remove_prefix(f + 1);
  }
}

}  // namespace mpusim
