// What the cli_tests files share: running the CLI in-process and the shape of a usage error.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cli/cli.h"

namespace mpusim::cli::test_util {

// One in-process run of `mpusim ARGS`: exit code, stdout, stderr.
struct Result {
  int code;
  std::string out;
  std::string err;
};

inline Result Mpusim(std::vector<std::string> args) {
  args.insert(args.begin(), "mpusim");
  std::ostringstream out, err;
  const int code = RunCli(args, out, err);
  return {code, out.str(), err.str()};
}

// A shipped sample config's path.
inline std::string Sample(const std::string& name) {
  return std::string(MPUSIM_SAMPLE_CONFIG_DIR) + "/" + name;
}

// Writes a temporary file and returns its path.
inline std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / name;
  std::ofstream(path) << text;
  return path.string();
}

// Bad input: exactly one line on stderr starting with "error: ", exit 2, empty stdout.
inline void ExpectUsageError(const Result& r, const std::string& expected_line) {
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, expected_line + "\n");
}

// Runs `command` in a shell with Open MPI allowed as root, its stdout and stderr together into
// `*output` (when given); the exit status, -1 when it did not exit.
inline int Shell(const std::string& command, std::string* output = nullptr) {
  // Unique per process and call: ctest runs tests of one binary in parallel.
  static int calls = 0;
  const std::string log = (std::filesystem::temp_directory_path() /
                           fmt::format("mpusim_cli_run.{}.{}.log", ::getpid(), ++calls))
                              .string();
  const std::string env = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
  const int raw = std::system((env + command + " > " + log + " 2>&1").c_str());
  if (output != nullptr) {
    std::ifstream in(log);
    *output = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
}

// "mpiexec -n RANKS --oversubscribe " (the test build's MPIEXEC).
inline std::string Mpiexec(int ranks) {
  return fmt::format("{} -n {} --oversubscribe ", MPUSIM_MPIEXEC, ranks);
}

}  // namespace mpusim::cli::test_util
