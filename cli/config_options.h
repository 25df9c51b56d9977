// Options shared by the subcommands that read a parallel layout: a CONFIG file and/or quick
// flags (`--tp 2 --pp 4 --world-size 16`) that set or override `parallel` keys.
//
// One table (kParallelFlags in config_options.cc) maps each flag to its JSON key, so the
// help text, the parser and the error messages cannot drift apart.
#pragma once

#include <iosfwd>
#include <map>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "core/config/config.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim::cli {

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

  const std::string& path() const { return path_; }

 private:
  // The flags given, as typed: "--tp 3 --pp 2".
  std::string FlagsText() const;

  std::string path_;
  std::map<std::string, std::string> values_;       // JSON key -> flag text as typed
  std::map<std::string, std::string> flag_of_key_;  // JSON key -> flag, for flags given
};

}  // namespace mpusim::cli
