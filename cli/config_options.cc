// CONFIG file plus quick flags (see config_options.h).
#include "cli/config_options.h"

#include <charconv>
#include <ostream>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/config/optimizer_config.h"
#include "core/config/parallel_config.h"
#include "core/model/model.h"

namespace mpusim::cli {
namespace {

// The quick flags: every key of the parallel and optimizer tables that declares one
// (core/config/field_table.h), in the tables' order.
template <typename Section>
void AddFlags(std::span<const Field<Section>> fields, const char* section,
              std::vector<ConfigFlag>* flags) {
  for (const Field<Section>& f : fields) {
    if (f.flag.empty()) continue;
    ConfigFlag flag;
    flag.flag = std::string(f.flag);
    flag.key = std::string(f.key);
    flag.section = section;
    flag.type = f.kind();
    const std::string where =
        std::string_view(section) == "parallel" ? "" : fmt::format("{}.{}: ", section, f.key);
    flag.help = fmt::format("{}{}{}", flag.type == FieldKind::kBool ? "true or false: " : "",
                            where, f.help);
    flags->push_back(std::move(flag));
  }
}

const std::vector<ConfigFlag>& AllConfigFlags() {
  static const std::vector<ConfigFlag> kFlags = [] {
    std::vector<ConfigFlag> flags;
    AddFlags(ParallelFields(), "parallel", &flags);
    AddFlags(OptimizerFields(), "optimizer", &flags);
    return flags;
  }();
  return kFlags;
}

const std::vector<ConfigFlag>& AllRunFlags() {
  static const std::vector<ConfigFlag> kFlags = [] {
    std::vector<ConfigFlag> flags;
    AddFlags(RunFields(), "run", &flags);
    return flags;
  }();
  return kFlags;
}

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

std::span<const ConfigFlag> ConfigFlags() { return AllConfigFlags(); }
std::span<const ConfigFlag> RunFlags() { return AllRunFlags(); }

std::string LongName(const std::string& flag) { return flag.substr(0, flag.find(',')); }

StatusOr<nlohmann::json> FlagValue(const ConfigFlag& f, const std::string& text) {
  const std::string flag = LongName(f.flag);
  switch (f.type) {
    case FieldKind::kText:
      // "none" (or "null") is the key's null: --recompute none.
      return text == "none" || text == "null" ? nlohmann::json(nullptr) : nlohmann::json(text);
    case FieldKind::kBool:
      if (text != "true" && text != "false") {
        return Status::Error(flag, fmt::format("must be true or false, got '{}'", text));
      }
      return nlohmann::json(text == "true");
    case FieldKind::kInt: {
      StatusOr<int64_t> parsed = ParseInteger(text, flag);
      if (!parsed.ok()) return parsed.status();
      return nlohmann::json(*parsed);
    }
    case FieldKind::kIntList: {
      nlohmann::json value = nlohmann::json::array();
      for (const std::string& item : SplitCommaList(text)) {
        StatusOr<int64_t> parsed = ParseInteger(item, flag);
        if (!parsed.ok()) return parsed.status();
        value.push_back(*parsed);
      }
      return value;
    }
    case FieldKind::kNumber: {
      double value = 0;
      const char* end = text.data() + text.size();
      const auto [ptr, ec] = std::from_chars(text.data(), end, value);
      if (ec != std::errc() || ptr != end) {
        return Status::Error(flag, fmt::format("must be a number, got '{}'", text));
      }
      return nlohmann::json(value);
    }
  }
  return Status::Error(flag, "unknown flag type");
}

std::string FlagGroup(const ConfigFlag& f) {
  const std::string_view section = f.section;
  return section == "parallel" ? "Layout flags (set or override parallel keys)"
         : section == "run"    ? "Run flags (set or override run keys)"
                               : "Optimizer flags (set or override optimizer keys)";
}

std::string FlagTypeName(const ConfigFlag& f) {
  return f.type == FieldKind::kInt       ? "INT"
         : f.type == FieldKind::kIntList ? "INT,INT,..."
         : f.type == FieldKind::kBool    ? "BOOL"
         : f.type == FieldKind::kNumber  ? "NUMBER"
                                         : "TEXT";
}

void ConfigOptions::Register(CLI::App* app) {
  command_ = app->get_name();
  app->add_option("CONFIG", path_, "config file (JSON with a \"parallel\" section)");
  for (const ConfigFlag& f : ConfigFlags()) {
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
  for (const ConfigFlag& f : ConfigFlags()) {
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
  const std::string world_size(ParallelKey(&ParallelConfig::world_size));
  if (path_.empty() && flag_of_key_.count(world_size) == 0) {
    return Status::Error("CONFIG", fmt::format("give a config file (e.g. mpusim {} "
                                               "sample_configs/gpt_tiny_t2_sp_dp2_n4.json), or "
                                               "--world-size with quick flags (e.g. mpusim {} "
                                               "--world-size 16 --tp 2 --pp 4)",
                                               command_, command_));
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
  for (const ConfigFlag& f : ConfigFlags()) {
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

bool FillMissingRun(Config* config) {
  if (config->run) return true;
  config->run = DefaultRun(*config);
  return false;
}

}  // namespace mpusim::cli
