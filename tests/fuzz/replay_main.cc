// Corpus replay: runs a fuzz target's LLVMFuzzerTestOneInput once on every file it is given.
//
// What it is: the main() that turns a fuzz target (tests/fuzz/<target>.cc) into an ordinary
// program, so the committed corpus runs as a ctest test in every build, with any compiler
// and without libFuzzer. Arguments are files or directories (every regular file directly
// inside, in name order). Each file's name is printed before it runs, so when an input
// crashes the process the last line names it. Exit code 0 when every input returned, 2 on a
// usage error or an unreadable file; a finding ends the process (abort, sanitizer report,
// uncaught exception) with its own code.
// What it is not: a fuzzer. It does not mutate, minimize or look for coverage; the fuzz
// build (MPUSIM_FUZZ=ON) links the same target with -fsanitize=fuzzer for that.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

// The files to replay: each argument itself, or the regular files directly inside it.
bool CollectInputs(const char* argument, std::vector<fs::path>* out) {
  std::error_code ec;
  const fs::path path(argument);
  if (!fs::is_directory(path, ec)) {
    out->push_back(path);
    return true;
  }
  std::vector<fs::path> inside;
  for (const fs::directory_entry& entry : fs::directory_iterator(path, ec)) {
    if (entry.is_regular_file(ec)) inside.push_back(entry.path());
  }
  if (ec) {
    std::fprintf(stderr, "replay: cannot list '%s': %s\n", argument, ec.message().c_str());
    return false;
  }
  std::sort(inside.begin(), inside.end());
  out->insert(out->end(), inside.begin(), inside.end());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE_OR_DIR...\n", argv[0]);
    return 2;
  }
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    if (!CollectInputs(argv[i], &inputs)) return 2;
  }
  for (const fs::path& input : inputs) {
    std::ifstream in(input, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "replay: cannot open '%s'\n", input.c_str());
      return 2;
    }
    const std::vector<char> bytes{std::istreambuf_iterator<char>(in),
                                  std::istreambuf_iterator<char>()};
    std::fprintf(stderr, "replay: %s (%zu bytes)\n", input.c_str(), bytes.size());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::fprintf(stderr, "replay: %zu inputs, no finding\n", inputs.size());
  return 0;
}
