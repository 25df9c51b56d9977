// What the cli_tests files share: running the CLI in-process and the shape of a usage error.
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

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

}  // namespace mpusim::cli::test_util
