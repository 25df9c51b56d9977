// Loading a backend plugin: `mpusim run --backend cuda` finds libmpusim_backend_cuda.so next
// to the running program and asks it for the backend (the entry points are in
// core/backend.h).
//
// What it is: the one place that calls dlopen. The CUDA runtime, cuBLAS and NCCL are
// dependencies of the plugin, not of `mpusim`, so they are mapped only when a run asks for
// the GPU backend; CPU runs and the planner commands never load them.
// What it is not: a search path. The plugin is looked for in the program's own directory
// (the build tree puts both in build/cli/), then in ../lib/mpusim/ relative to it (an
// installed tree); nothing else, so the plugin that runs is the one built with the program.
#pragma once

#include <string>

#include "core/backend.h"

namespace mpusim::run {

// The file name of backend `name`'s plugin: "libmpusim_backend_<name>.so".
std::string BackendPluginFileName(const std::string& name);

// Where backend `name`'s plugin is (the program's directory, then ../lib/mpusim/), or "" when
// this mpusim was built without it.
std::string FindBackendPlugin(const std::string& name);

// Loads backend `name`'s plugin and calls its mpusim_make_backend (collective over
// MPI_COMM_WORLD, like the call it makes). Every failure is a Status whose `where` is
// "--backend <name>": the plugin is not there (this mpusim was built without the backend),
// dlopen failed (its message says which library is missing), the entry points are missing
// or from another build (ABI), or the plugin refused (no device, ...).
BackendOrStatus LoadBackendPlugin(const std::string& name, const BackendOptions& options);

}  // namespace mpusim::run
