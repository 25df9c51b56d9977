// The `mpusim` command line: subcommands only. Each subcommand parses its options, calls
// core, and renders the result; no layout or schedule logic lives here.
//
// Exit codes: 0 success (and --help), 1 a check failed, 2 bad input (config, flags, files),
// printed as one line: "error: <source>: <field>: <what and what is allowed>"; 3 out of
// memory (std::bad_alloc past the preflight) and 4 an internal error (any other exception
// nothing expected), each printed as one line by main().
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace mpusim::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitOutOfMemory = 3;
inline constexpr int kExitInternalError = 4;

// Runs one command line (args[0] is the program name). Output goes to `out`, errors and
// warnings to `err`.
int RunCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

// `text` as one POSIX shell word: bare when it holds only characters no shell treats
// specially, else in single quotes (a ' inside as '\'').
std::string ShellQuote(const std::string& text);

// `args` as a line a shell would split back into them: what a dump and a summary record.
std::string ShellCommandLine(const std::vector<std::string>& args);

}  // namespace mpusim::cli
