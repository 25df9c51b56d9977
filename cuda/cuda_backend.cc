// The GPU backend (see cuda_backend.h).
#include "cuda/cuda_backend.h"

#include <mpi.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "cuda/cuda_check.h"
#include "cuda/cuda_kernels.h"
#include "cuda/host_staged_communicator.h"
#include "cuda/nccl_communicator.h"
#include "mpi/mpi_check.h"
#include "mpi/mpi_communicator.h"
#include "mpi/watchdog.h"

namespace mpusim::cuda {
namespace {

bool MpiRunning() {
  int initialized = 0;
  int finalized = 0;
  MPUSIM_MPI_CHECK(MPI_Initialized(&initialized));
  MPUSIM_MPI_CHECK(MPI_Finalized(&finalized));
  return initialized != 0 && finalized == 0;
}

class CudaBackend final : public Backend {
 public:
  // The device must be current (cudaSetDevice) before construction: kernels_ binds to it.
  CudaBackend(std::string comm, int device, int64_t ranks_on_device, double nccl_timeout_s)
      : comm_(std::move(comm)),
        device_(device),
        ranks_on_device_(ranks_on_device),
        nccl_timeout_s_(nccl_timeout_s) {}

  std::string name() const override { return "cuda"; }
  std::string Describe() const override {
    return fmt::format("{}, cuBLAS, {} collectives", DeviceName(),
                       comm_ == "mpi" ? "host-staged MPI" : "NCCL");
  }
  Kernels& kernels() override { return kernels_; }
  std::optional<DeviceMemory> Memory() const override {
    MPUSIM_CUDA_CHECK(cudaSetDevice(device_));
    size_t free_bytes = 0, total_bytes = 0;
    MPUSIM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return DeviceMemory{DeviceName(), free_bytes, total_bytes, ranks_on_device_};
  }

  std::map<std::string, std::unique_ptr<Communicator>> MakeGroups(
      const Topology& topology, int64_t world_rank,
      const std::vector<std::string>& kinds) override {
    MPUSIM_CUDA_CHECK(cudaSetDevice(device_));
    // MPI builds the groups (validated and agreed on by every rank, then one MPI_Comm_split
    // per kind); each is then either wrapped (host-staged) or used once to bootstrap NCCL.
    // Map order is the same on every rank, so NCCL initialisations never wait in a cycle.
    std::map<std::string, std::unique_ptr<Communicator>> mpi_groups =
        MakeGroupCommunicators(topology, world_rank, MPI_COMM_WORLD, kinds);
    std::map<std::string, std::unique_ptr<Communicator>> out;
    for (auto& [kind, communicator] : mpi_groups) {
      if (dynamic_cast<MpiCommunicator*>(communicator.get()) == nullptr) {
        throw std::logic_error("CudaBackend::MakeGroups: MakeGroupCommunicators returned a "
                               "communicator that is not an MpiCommunicator");
      }
      std::unique_ptr<MpiCommunicator> group(
          static_cast<MpiCommunicator*>(communicator.release()));
      if (comm_ == "mpi") {
        out[kind] = std::make_unique<HostStagedCommunicator>(std::move(group), kernels_);
      } else {
        out[kind] = NcclCommunicator::Create(*group, kind, kernels_.stream(), nccl_timeout_s_);
      }
    }
    return out;
  }

 private:
  // "CUDA device 0 (NVIDIA H100 80GB HBM3)".
  std::string DeviceName() const {
    cudaDeviceProp properties{};
    const bool known = cudaGetDeviceProperties(&properties, device_) == cudaSuccess;
    return fmt::format("CUDA device {} ({})", device_, known ? properties.name : "?");
  }

  std::string comm_;
  int device_;
  int64_t ranks_on_device_;  // ranks of this node on device_ (they share its memory)
  double nccl_timeout_s_;
  CudaKernels kernels_;
};

// MPUSIM_NCCL_TIMEOUT_S when set, else the communication timeout of the MPI watchdog
// (`mpusim run --timeout`, mpi/watchdog.h), so that NCCL and MPI collectives give up together.
StatusOr<double> NcclTimeout() {
  const char* text = std::getenv("MPUSIM_NCCL_TIMEOUT_S");
  if (text == nullptr || text[0] == '\0') return CommTimeout();
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(seconds) || seconds <= 0) {
    return Status::Error("MPUSIM_NCCL_TIMEOUT_S",
                         fmt::format("'{}' is not a positive number of seconds", text));
  }
  return seconds;
}

// What one rank tells the other ranks of its node about the GPU it would use.
struct DeviceClaim {
  int usable = 0;  // 0: this rank has no usable device (its own Status says why)
  unsigned char uuid[16] = {};
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const std::string& comm) {
  // The ranks of this node. Done first and by every rank, so that no rank is left waiting in
  // a collective when another one returns an error.
  int local_rank = 0;
  int local_size = 1;
  MPI_Comm node = MPI_COMM_NULL;
  const bool mpi = MpiRunning();
  if (mpi) {
    MPUSIM_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL,
                                         &node));
    SetErrorsReturn(node);
    MPUSIM_MPI_CHECK(MPI_Comm_rank(node, &local_rank));
    MPUSIM_MPI_CHECK(MPI_Comm_size(node, &local_size));
  }

  Status status;
  double nccl_timeout_s = CommTimeout();
  int device = -1;
  int device_count = 0;
  DeviceClaim claim;
  if (comm != "nccl" && comm != "mpi") {
    status = Status::Error("--comm", fmt::format("'{}' is not nccl or mpi", comm));
  }
  if (status.ok()) {
    StatusOr<double> timeout = NcclTimeout();
    if (timeout.ok()) {
      nccl_timeout_s = *timeout;
    } else {
      status = timeout.status();
    }
  }
  if (status.ok()) {
    const cudaError_t error = cudaGetDeviceCount(&device_count);
    if (error != cudaSuccess || device_count <= 0) {
      cudaGetLastError();  // clear the (non-sticky) error for later callers
      status = Status::Error(
          "--backend cuda",
          fmt::format("no CUDA device is visible (cudaGetDeviceCount: {})",
                      error != cudaSuccess ? CudaErrorText(error) : std::string("0 devices")));
    }
  }
  if (status.ok()) {
    device = local_rank % device_count;
    cudaDeviceProp properties{};
    cudaError_t error = cudaSetDevice(device);
    if (error == cudaSuccess) error = cudaFree(nullptr);  // creates the context now
    if (error == cudaSuccess) error = cudaGetDeviceProperties(&properties, device);
    if (error != cudaSuccess) {
      cudaGetLastError();
      status = Status::Error("--backend cuda",
                             fmt::format("cannot use CUDA device {} of {} (local rank {}): {}",
                                         device, device_count, local_rank, CudaErrorText(error)));
    } else {
      claim.usable = 1;
      std::memcpy(claim.uuid, &properties.uuid, sizeof(claim.uuid));
    }
  }

  // NCCL: no two ranks of this node may end up on the same GPU. Every rank of the node
  // takes part in the exchange, whatever its own status.
  if (mpi && comm == "nccl") {
    std::vector<DeviceClaim> claims(static_cast<size_t>(local_size));
    watched::Allgather(&claim, static_cast<int>(sizeof(DeviceClaim)), MPI_BYTE, claims.data(),
                       static_cast<int>(sizeof(DeviceClaim)), MPI_BYTE, node,
                       LabelOf(node, "node"));
    // Distinct GPUs among the usable claims (a node has a handful of ranks: pairwise is fine).
    int usable = 0;
    int distinct = 0;
    for (size_t i = 0; i < claims.size(); ++i) {
      if (claims[i].usable == 0) continue;
      ++usable;
      bool seen = false;
      for (size_t j = 0; j < i && !seen; ++j) {
        seen = claims[j].usable != 0 &&
               std::memcmp(claims[j].uuid, claims[i].uuid, sizeof(claims[i].uuid)) == 0;
      }
      if (!seen) ++distinct;
    }
    if (status.ok() && distinct < usable) {
      status = Status::Error(
          "--comm nccl",
          fmt::format("{} ranks on this node but only {} GPUs visible; NCCL cannot put two "
                      "ranks on one GPU ('Duplicate GPU detected'): start at most {} ranks per "
                      "node, or use --comm mpi (host-staged MPI collectives, all kernels still "
                      "on the GPU)",
                      local_size, distinct, distinct));
    }
  }
  if (node != MPI_COMM_NULL) MPUSIM_MPI_CHECK(MPI_Comm_free(&node));
  if (!status.ok()) return status;
  // Local ranks r with r % device_count == device share it.
  const int64_t ranks_on_device =
      local_size / device_count + (device < local_size % device_count ? 1 : 0);
  return std::unique_ptr<Backend>(new CudaBackend(comm, device, ranks_on_device, nccl_timeout_s));
}

}  // namespace mpusim::cuda
