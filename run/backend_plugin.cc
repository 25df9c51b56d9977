// Loading a backend plugin (see backend_plugin.h).
#include "run/backend_plugin.h"

#include <dlfcn.h>

#include <filesystem>
#include <system_error>
#include <vector>

#include <fmt/format.h>

namespace mpusim::run {
namespace {

// The directory of the running program, or "" when /proc/self/exe cannot be read.
std::filesystem::path ProgramDirectory() {
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::filesystem::path() : exe.parent_path();
}

}  // namespace

std::string BackendPluginFileName(const std::string& name) {
  return fmt::format("libmpusim_backend_{}.so", name);
}

std::string FindBackendPlugin(const std::string& name) {
  const std::string file = BackendPluginFileName(name);
  const std::filesystem::path dir = ProgramDirectory();
  for (const std::filesystem::path& candidate :
       {dir / file, dir / ".." / "lib" / "mpusim" / file}) {
    std::error_code error;
    if (std::filesystem::is_regular_file(candidate, error)) return candidate.string();
  }
  return "";
}

BackendOrStatus LoadBackendPlugin(const std::string& name, const BackendOptions& options) {
  const std::string where = "--backend " + name;
  const std::string file = BackendPluginFileName(name);
  const std::filesystem::path dir = ProgramDirectory();
  const std::filesystem::path path = FindBackendPlugin(name);
  if (path.empty()) {
    return Status::Error(
        where, fmt::format("this mpusim has no {} backend: {} is not next to the program ({}); "
                           "it is built when CMake finds the CUDA toolkit and NCCL "
                           "(MPUSIM_WITH_CUDA=AUTO or ON)",
                           name, file, dir.string()));
  }
  // RTLD_LOCAL: the plugin's libraries stay out of the global namespace. The handle is never
  // closed: the backend's code must stay mapped until the process ends.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return Status::Error(where, fmt::format("cannot load {}: {}", path.string(),
                                            why != nullptr ? why : "unknown dlopen error"));
  }
  const auto* abi = static_cast<const int*>(dlsym(handle, kBackendAbiSymbol));
  const auto make = reinterpret_cast<MakeBackendFunction>(dlsym(handle, kMakeBackendSymbol));
  if (abi == nullptr || make == nullptr) {
    return Status::Error(where, fmt::format("{} is not an mpusim backend plugin (no {} or {})",
                                            path.string(), kBackendAbiSymbol,
                                            kMakeBackendSymbol));
  }
  if (*abi != kBackendAbi) {
    return Status::Error(where, fmt::format("{} was built for backend ABI {}, this mpusim "
                                            "needs {}; rebuild both from one tree",
                                            path.string(), *abi, kBackendAbi));
  }
  BackendOrStatus made = Status::Error(where, "the plugin made no backend");
  make(&options, &made);
  return made;
}

}  // namespace mpusim::run
