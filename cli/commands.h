// The subcommands. Each registers its options on a CLI11 subcommand and runs after parsing.
#pragma once

#include <iosfwd>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

namespace mpusim::cli {

class Command {
 public:
  virtual ~Command() = default;
  virtual CLI::App* app() = 0;
  // Runs after a successful parse; returns the exit code.
  virtual int Run(std::ostream& out, std::ostream& err) = 0;
};

std::unique_ptr<Command> MakeLayoutCommand(CLI::App* parent);
std::unique_ptr<Command> MakeScheduleCommand(CLI::App* parent);
std::unique_ptr<Command> MakeExplainCommand(CLI::App* parent);
// `command_line`: the whole command line, shell-quoted, which the run records.
std::unique_ptr<Command> MakeRunCommand(CLI::App* parent, std::string command_line);
std::unique_ptr<Command> MakeReferenceCommand(CLI::App* parent, std::string command_line);
std::unique_ptr<Command> MakeDiffCommand(CLI::App* parent);
std::unique_ptr<Command> MakeSweepCommand(CLI::App* parent);
std::unique_ptr<Command> MakeEstimateCommand(CLI::App* parent);
std::unique_ptr<Command> MakeAdviseCommand(CLI::App* parent);

// Prints "error: <source>: <where>: <what>" and returns kExitUsage.
int ReportError(std::ostream& err, const std::string& source, const std::string& message);

}  // namespace mpusim::cli
