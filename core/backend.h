// Backend: what a device brings to the layer graph: its Kernels and, for each group kind of
// the planner, this rank's Communicator. sim/ provides the CPU backend (Eigen + MPI), cuda/
// the GPU backend (CUDA/cuBLAS + NCCL, or host-staged MPI).
//
// Backend plugins. The GPU backend is not linked into the `mpusim` program: it is a shared
// library, libmpusim_backend_<name>.so, next to the program, that `mpusim run --backend
// <name>` loads with dlopen (run/backend_plugin.h), so that CPU runs and the planner never
// map the CUDA libraries. A plugin exports, with C linkage, the two symbols below. It and the
// program share libmpusim_core.so, so Backend, Kernels, Communicator, Tensor and Status are
// one set of types on both sides; kBackendAbi guards against a plugin left over from an
// older build.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "core/kernels.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {

// The memory of the device a backend's tensors live on, for the run's preflight.
struct DeviceMemory {
  std::string device;        // "CUDA device 0 (NVIDIA H100 80GB HBM3)"
  uint64_t free_bytes = 0;   // free now (cudaMemGetInfo), before this run allocates
  uint64_t total_bytes = 0;
  int64_t ranks = 1;         // ranks of this node that use the device (they share free_bytes)
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cpu", "cuda" (recorded in dumps)
  // What runs the math, for the run's header and benchmarks: the BLAS and its kernels, or the
  // GPU (e.g. "Eigen 3.4.0, GEMMs through OpenBLAS 0.3.21 (Haswell kernels), 1 thread").
  virtual std::string Describe() const { return name(); }
  virtual Kernels& kernels() = 0;
  // The memory of this rank's device, or nullopt when the backend's tensors live in host
  // memory (the CPU backend: the host preflight covers them).
  virtual std::optional<DeviceMemory> Memory() const { return std::nullopt; }
  // This rank's communicator for each kind in `kinds` (kinds whose groups leave this rank
  // out get no entry). Collective: every rank of the run calls it with the same kinds.
  virtual std::map<std::string, std::unique_ptr<Communicator>> MakeGroups(
      const Topology& topology, int64_t world_rank, const std::vector<std::string>& kinds) = 0;
};

// What the command line tells a backend (`mpusim run --backend NAME --comm COMM`).
struct BackendOptions {
  std::string comm = "nccl";  // cuda: "nccl" or "mpi" (host-staged)
};
using BackendOrStatus = StatusOr<std::unique_ptr<Backend>>;

// The plugin's entry points:
//   extern "C" const int mpusim_backend_abi;   // == kBackendAbi
//   extern "C" void mpusim_make_backend(const BackendOptions* options, BackendOrStatus* out);
// mpusim_make_backend is collective over MPI_COMM_WORLD (the GPU backend picks devices per
// node) and reports a missing or unusable device as a Status in *out, never by aborting.
// Bump kBackendAbi whenever these types or the entry points change.
inline constexpr int kBackendAbi = 3;
inline constexpr char kBackendAbiSymbol[] = "mpusim_backend_abi";
inline constexpr char kMakeBackendSymbol[] = "mpusim_make_backend";
using MakeBackendFunction = void (*)(const BackendOptions* options, BackendOrStatus* out);

}  // namespace mpusim
