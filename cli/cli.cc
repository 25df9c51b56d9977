// Dispatch of `mpusim <subcommand>` (see cli.h).
#include "cli/cli.h"

#include <ostream>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/status.h"

namespace mpusim::cli {

int ReportError(std::ostream& err, const std::string& source, const std::string& message) {
  err << "error: " << EscapeControl(source) << ": " << EscapeControl(message) << '\n';
  return kExitUsage;
}

std::string ShellQuote(const std::string& text) {
  const bool bare = !text.empty() && text.find_first_not_of(
                                         "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                         "0123456789_-+=/.,:@%") == std::string::npos;
  if (bare) return text;
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string ShellCommandLine(const std::vector<std::string>& args) {
  std::string line;
  for (const std::string& arg : args) line += (line.empty() ? "" : " ") + ShellQuote(arg);
  return line;
}

int RunCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  CLI::App app{"mpusim: Megatron-style model parallelism without a GPU cluster.\n"
               "Plans Megatron-Core's process groups and pipeline schedules, and runs the\n"
               "tensor-parallel layers on MPI ranks against a float64 reference.",
               "mpusim"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "mpusim 0.1.0");
  std::vector<std::unique_ptr<Command>> commands;
  commands.push_back(MakeLayoutCommand(&app));
  commands.push_back(MakeScheduleCommand(&app));
  commands.push_back(MakeExplainCommand(&app));
  commands.push_back(MakeRunCommand(&app, ShellCommandLine(args)));
  commands.push_back(MakeReferenceCommand(&app, ShellCommandLine(args)));
  commands.push_back(MakeDiffCommand(&app));
  commands.push_back(MakeSweepCommand(&app));
  commands.push_back(MakeEstimateCommand(&app));
  commands.push_back(MakeAdviseCommand(&app));

  std::vector<std::string> reversed(args.rbegin(), args.rend());
  if (!reversed.empty()) reversed.pop_back();  // the program name
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    return kExitOk;
  } catch (const CLI::CallForAllHelp&) {
    out << app.help("", CLI::AppFormatMode::All);
    return kExitOk;
  } catch (const CLI::CallForVersion&) {
    out << "mpusim 0.1.0\n";
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    // A subcommand's --help arrives here as a success-coded ParseError in some versions.
    if (e.get_exit_code() == 0) {
      for (const auto& command : commands) {
        if (command->app()->parsed()) {
          out << command->app()->help();
          return kExitOk;
        }
      }
      out << app.help();
      return kExitOk;
    }
    std::string what = e.what();
    if (const size_t newline = what.find('\n'); newline != std::string::npos) {
      what.resize(newline);
    }
    return ReportError(err, "command line",
                       fmt::format("{} (run 'mpusim --help' for usage)", what));
  }
  for (const auto& command : commands) {
    if (command->app()->parsed()) return command->Run(out, err);
  }
  return ReportError(err, "command line", "no subcommand given (layout, schedule, explain, run, diff)");
}

}  // namespace mpusim::cli
