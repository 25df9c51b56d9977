// CONFIG file plus quick flags (see config_options.h).
#include "cli/config_options.h"

#include <charconv>
#include <ostream>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/config/parallel_config.h"
#include "core/model/model.h"

namespace mpusim::cli {
namespace {

// The one table of quick flags.
constexpr ConfigFlag kConfigFlags[] = {
    {"--world-size,-n", "world_size", FlagType::kInt, "number of ranks (GPUs)"},
    {"--tp", "tensor_model_parallel_size", FlagType::kInt, "tensor-parallel size"},
    {"--pp", "pipeline_model_parallel_size", FlagType::kInt, "pipeline-parallel size"},
    {"--vp", "virtual_pipeline_model_parallel_size", FlagType::kInt,
     "virtual pipeline size (model chunks per pipeline rank)"},
    {"--cp", "context_parallel_size", FlagType::kInt, "context-parallel size"},
    {"--hcp", "hierarchical_context_parallel_sizes", FlagType::kIntList,
     "hierarchical context-parallel sizes, e.g. 2,2"},
    {"--ep", "expert_model_parallel_size", FlagType::kInt, "expert-parallel size"},
    {"--etp", "expert_tensor_parallel_size", FlagType::kInt,
     "expert tensor-parallel size (default: --tp)"},
    {"--dist-opt-instances", "num_distributed_optimizer_instances", FlagType::kInt,
     "number of distributed-optimizer instances"},
    {"--order", "order", FlagType::kString, "rank order of the axes (default tp-cp-ep-dp-pp)"},
    {"--rank-offset", "rank_offset", FlagType::kInt, "first global rank of the layout"},
    {"--gpus-per-node", "gpus_per_node", FlagType::kInt, "GPUs per node for the node map"},
    {"--microbatch-group-size", "microbatch_group_size_per_vp_stage", FlagType::kInt,
     "microbatch_group_size_per_vp_stage (interleaved schedule; default: pp size)"},
    {"--num-layers", "num_layers", FlagType::kInt, "layers, for the virtual-pipeline assignment"},
    {"--sequence-parallel", "sequence_parallel", FlagType::kBool,
     "true or false: sequence parallelism (norms and dropouts on s / tp tokens)"},
    {"--tp-comm-overlap", "tp_comm_overlap", FlagType::kBool,
     "true or false: TE's overlap of the tp collectives with the GEMMs (timing only; needs "
     "--sequence-parallel true)"},
    {"--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm", FlagType::kBool,
     "true or false: Megatron's combined 1F1B schedule, the experts' all-to-alls hidden behind "
     "another micro-batch's compute (timing only; needs --ep > 1)"},
    {"--delay-wgrad-compute", "delay_wgrad_compute", FlagType::kBool,
     "true or false: the experts' weight gradients after their backward all-to-all starts "
     "(timing only; needs --overlap-moe-expert-parallel-comm true)"},
    {"--distributed-optimizer", "use_distributed_optimizer", FlagType::kBool,
     "true or false: optimizer.use_distributed_optimizer, the optimizer state sharded over dp",
     "optimizer"},
    {"--overlap-grad-reduce", "overlap_grad_reduce", FlagType::kBool,
     "true or false: optimizer.overlap_grad_reduce, the bucketed gradient reduction overlapped "
     "with the backward (timing only)",
     "optimizer"},
    {"--overlap-param-gather", "overlap_param_gather", FlagType::kBool,
     "true or false: optimizer.overlap_param_gather, the distributed optimizer's parameter "
     "all-gather overlapped with the forward (timing only)",
     "optimizer"},
};

StatusOr<int64_t> ParseInteger(const std::string& text, const std::string& flag) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end) {
    return Status::Error(flag, fmt::format("must be an integer, got '{}'", text));
  }
  return value;
}

}  // namespace

std::span<const ConfigFlag> ConfigFlags() { return kConfigFlags; }

std::string LongName(const char* flag) {
  std::string name(flag);
  return name.substr(0, name.find(','));
}

StatusOr<nlohmann::json> FlagValue(const ConfigFlag& f, const std::string& text) {
  const std::string flag = LongName(f.flag);
  switch (f.type) {
    case FlagType::kString:
      return nlohmann::json(text);
    case FlagType::kBool:
      if (text != "true" && text != "false") {
        return Status::Error(flag, fmt::format("must be true or false, got '{}'", text));
      }
      return nlohmann::json(text == "true");
    case FlagType::kInt: {
      StatusOr<int64_t> parsed = ParseInteger(text, flag);
      if (!parsed.ok()) return parsed.status();
      return nlohmann::json(*parsed);
    }
    case FlagType::kIntList: {
      nlohmann::json value = nlohmann::json::array();
      for (const std::string& item : SplitCommaList(text)) {
        StatusOr<int64_t> parsed = ParseInteger(item, flag);
        if (!parsed.ok()) return parsed.status();
        value.push_back(*parsed);
      }
      return value;
    }
  }
  return Status::Error(flag, "unknown flag type");
}

std::string FlagGroup(const ConfigFlag& f) {
  return std::string_view(f.section) == "parallel"
             ? "Layout flags (set or override parallel keys)"
             : "Optimizer flags (set or override optimizer keys)";
}

std::string FlagTypeName(const ConfigFlag& f) {
  return f.type == FlagType::kInt       ? "INT"
         : f.type == FlagType::kIntList ? "INT,INT,..."
         : f.type == FlagType::kBool    ? "BOOL"
                                        : "TEXT";
}

void ConfigOptions::Register(CLI::App* app) {
  app->add_option("CONFIG", path_, "config file (JSON with a \"parallel\" section)");
  for (const ConfigFlag& f : kConfigFlags) {
    std::string& slot = values_[f.key];
    app->add_option(f.flag, slot, f.help)->group(FlagGroup(f))->type_name(FlagTypeName(f));
  }
}

StatusOr<Config> ConfigOptions::Resolve() {
  nlohmann::json document = {{"parallel", nlohmann::json::object()}};
  if (!path_.empty()) {
    StatusOr<nlohmann::json> read = ReadJsonFile(path_);
    if (!read.ok()) return read.status();
    document = std::move(read).value();
  }
  flag_of_key_.clear();
  for (const ConfigFlag& f : kConfigFlags) {
    const std::string& text = values_.at(f.key);
    if (text.empty()) continue;
    const std::string flag = LongName(f.flag);
    StatusOr<nlohmann::json> parsed = FlagValue(f, text);
    if (!parsed.ok()) return parsed.status();
    const nlohmann::json value = *std::move(parsed);
    flag_of_key_[f.key] = flag;
    const std::string section = f.section;
    if (section != "parallel" &&
        !(document.is_object() && document.contains(section) && document[section].is_object())) {
      return Status::Error(flag, fmt::format("needs a config with an \"{}\" section (it sets "
                                             "{}.{})",
                                             section, section, f.key));
    }
    // Flags override the file. A file whose section is not an object is reported by
    // ParseConfig below, so only merge into a well-formed one.
    if (document.is_object() && document.contains(section) && document[section].is_object()) {
      document[section][f.key] = value;
    }
  }
  if (path_.empty() && flag_of_key_.count("world_size") == 0) {
    return Status::Error("CONFIG", "give a config file, or --world-size with quick flags (e.g. "
                                   "mpusim layout --world-size 16 --tp 2 --pp 4)");
  }
  Config config;
  MPUSIM_RETURN_IF_ERROR(ParseConfig(document, &config));
  return config;
}

Status ConfigOptions::Attribute(const Status& status, std::string* source) const {
  *source = path_.empty() ? "command line" : path_;
  const std::string& where = status.where();
  if (where.rfind("--", 0) == 0 || where == "CONFIG") {
    *source = "command line";
    return status;
  }
  for (const std::string_view prefix : {"parallel.", "optimizer."}) {
    if (where.rfind(prefix, 0) != 0) continue;
    const std::string key = where.substr(prefix.size(), where.find('[') - prefix.size());
    if (auto it = flag_of_key_.find(key); it != flag_of_key_.end()) {
      *source = "command line";
      return Status::Error(it->second, status.what());
    }
  }
  if (!flag_of_key_.empty() && !path_.empty() && ConfigFileIsValid(path_)) {
    *source = "command line";
    return Status::Error(FlagsText(), status.Message());
  }
  return status;
}

std::string ConfigOptions::FlagsText() const {
  std::string text;
  for (const ConfigFlag& f : kConfigFlags) {
    const std::string& value = values_.at(f.key);
    if (value.empty()) continue;
    text += fmt::format("{}{} {}", text.empty() ? "" : " ", LongName(f.flag), value);
  }
  return text;
}

std::optional<ConfigOptions::Layout> ConfigOptions::ResolveLayout(std::ostream& err) {
  std::string source;
  StatusOr<Config> config = Resolve();
  if (!config.ok()) {
    ReportError(err, source, Attribute(config.status(), &source).Message());
    return std::nullopt;
  }
  StatusOr<Topology> topology = Topology::Create(config->parallel);
  if (!topology.ok()) {
    ReportError(err, source, Attribute(topology.status(), &source).Message());
    return std::nullopt;
  }
  for (const std::string& line : config->notes()) err << "note: " << line << '\n';
  return Layout{std::move(config).value(), std::move(topology).value()};
}

std::optional<ConfigOptions::Layout> ConfigOptions::ResolveModelLayout(std::ostream& err,
                                                                      std::string_view command,
                                                                      std::string_view why) {
  std::optional<Layout> layout = ResolveLayout(err);
  if (!layout || layout->config.has_model()) return layout;
  std::string source;
  const Status missing = Attribute(
      Status::Error("model", fmt::format("is required by mpusim {} ({}; `mpusim layout` shows a "
                                         "layout's groups)",
                                         command, why)),
      &source);
  ReportError(err, source, missing.Message());
  return std::nullopt;
}

std::vector<std::string> SplitCommaList(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma - start));
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

bool FillMissingRun(Config* config, const Topology& topology) {
  if (config->run) return true;
  RunConfig run;
  run.dtype = MegatronStorageDType(config->parallel).value_or(DType::kFloat32);
  run.seq_length = 2 * topology.sizes().tp * topology.sizes().cp;
  run.num_microbatches =
      config->parallel.microbatch_group_size_per_vp_stage.value_or(topology.sizes().pp);
  config->run = run;
  return false;
}

}  // namespace mpusim::cli
