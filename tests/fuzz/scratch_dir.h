// ScratchDir: one directory per fuzzing process, for readers that take a path.
//
// What it is: where fuzz_safetensors and fuzz_manifest write each input before calling
// ReadSafetensors or LoadDump. The directory is <base>/mpusim_<name>.<pid>: unique by pid,
// so parallel fuzzers (-jobs, -fork) and a concurrent ctest never share one. <base> is
// $TMPDIR when set, else /dev/shm when it exists (memory: an input written per execution
// costs no disk), else /tmp. It is removed when the process exits normally; a crashing
// process leaves it behind, with the input that crashed in it.
// What it is not: a general temporary-file helper. Failing to write is the harness's fault,
// not the input's, so it aborts with a message rather than returning a Status.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>

#include <unistd.h>

namespace mpusim::fuzz {

class ScratchDir {
 public:
  explicit ScratchDir(std::string_view name) {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::path base = "/tmp";
    if (const char* tmpdir = std::getenv("TMPDIR"); tmpdir != nullptr && *tmpdir != '\0') {
      base = tmpdir;
    } else if (fs::is_directory("/dev/shm", ec)) {
      base = "/dev/shm";
    }
    path_ = base / ("mpusim_" + std::string(name) + "." + std::to_string(::getpid()));
    fs::remove_all(path_, ec);
    if (!fs::create_directories(path_, ec)) Die("cannot create", path_, ec);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

  // Writes `size` bytes to path()/file_name, replacing the file; returns its path.
  std::string Write(std::string_view file_name, const uint8_t* data, size_t size) const {
    const std::filesystem::path file = path_ / file_name;
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    out.close();
    if (!out) Die("cannot write", file, std::error_code(errno, std::generic_category()));
    return file.string();
  }

 private:
  [[noreturn]] static void Die(const char* what, const std::filesystem::path& path,
                               const std::error_code& ec) {
    std::fprintf(stderr, "fuzz harness: %s '%s': %s\n", what, path.c_str(), ec.message().c_str());
    std::abort();
  }

  std::filesystem::path path_;
};

}  // namespace mpusim::fuzz
