// Options shared by the subcommands that read a parallel layout: a CONFIG file and/or quick
// flags (`--tp 2 --pp 4 --world-size 16`) that set or override `parallel` keys.
//
// Each flag comes from its key's declaration (core/config/field_table.h; ConfigFlags and
// RunFlags below), so the help text, the parser and the error messages cannot drift apart, and
// `mpusim run` takes the same flags.
#pragma once

#include <iosfwd>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim::cli {

// The quick flags: each sets a key of the `parallel` or `optimizer` section, derived from the
// key's declaration (core/config/field_table.h: every field that names a flag). The commands
// that read a layout (ConfigOptions below) and `mpusim run` (its overrides) take every one of
// them under the same name.
struct ConfigFlag {
  std::string flag;  // "--world-size,-n": the long name, then any short one
  std::string key;   // the key it sets, in `section`
  FieldKind type = FieldKind::kInt;  // what its text is read as: the key's kind
  std::string help;
  std::string section = "parallel";  // or "optimizer" (which the config must have)
};
std::span<const ConfigFlag> ConfigFlags();
// The `run` section's flags (--seq-length, --micro-batch-size, --recompute, ...), from its
// table the same way: `mpusim run` takes them as overrides. (estimate and advise take flags of
// these names with their own defaults: a batch to price, a search.)
std::span<const ConfigFlag> RunFlags();
// "--world-size" of "--world-size,-n".
std::string LongName(const std::string& flag);
// The JSON value `text` gives `f`'s key, or an error naming the flag ("--tp: must be an
// integer, got 'x'").
StatusOr<nlohmann::json> FlagValue(const ConfigFlag& f, const std::string& text);
// The --help group and value name of a flag.
std::string FlagGroup(const ConfigFlag& f);
std::string FlagTypeName(const ConfigFlag& f);

// For the commands that need a run section only to build the model (layout, explain,
// estimate): when `config` has none, gives it DefaultRun's (core/config/config.h). Returns
// whether it had one.
bool FillMissingRun(Config* config);

// "1,2,,4" -> {"1", "2", "", "4"}: the items of a comma-separated flag value, empty ones
// kept so that the caller refuses them.
std::vector<std::string> SplitCommaList(const std::string& text);

class ConfigOptions {
 public:
  // Adds the positional CONFIG and the quick flags to `app`.
  void Register(CLI::App* app);

  // Loads CONFIG (if given), applies the flags and parses the result. Errors go through
  // Attribute.
  StatusOr<Config> Resolve();

  // Names the source of an error about the resolved config: the flag, when the field it
  // names was set by a flag ("command line", "--tp"); the flags given ("command line",
  // "--tp 3"), when the file alone is a valid layout and model (the flags broke it: --tp 3
  // on a 4-rank file fails on world_size); else the file ("<CONFIG>", field). Sets `*source`
  // and returns the Status to print after it.
  Status Attribute(const Status& status, std::string* source) const;

  // Resolve, then plan the layout. On error, prints the one-line error to `err` (with the
  // source attributed as above) and returns nullopt.
  struct Layout {
    Config config;
    Topology topology;
  };
  std::optional<Layout> ResolveLayout(std::ostream& err);
  // ResolveLayout for a command that reads the model: a config without one is refused with
  // "model: is required by mpusim <command> (<why>; `mpusim layout` shows a layout's groups)".
  std::optional<Layout> ResolveModelLayout(std::ostream& err, std::string_view command,
                                           std::string_view why);

  const std::string& path() const { return path_; }

 private:
  // The flags given, as typed: "--tp 3 --pp 2".
  std::string FlagsText() const;

  std::string path_;
  std::string command_ = "layout";  // the subcommand it is registered with (examples)
  std::map<std::string, std::string> values_;       // JSON key -> flag text as typed
  std::map<std::string, std::string> flag_of_key_;  // JSON key -> flag, for flags given
};

}  // namespace mpusim::cli
