// The GPU backend: CudaKernels (CUDA kernels + cuBLAS) and, per group kind, an NCCL or a
// host-staged MPI communicator.
//
// What it is: MakeCudaBackend, which picks this rank's GPU and returns the Backend that
// `mpusim run --backend cuda` runs the layer graph on. Device selection: the ranks of a node
// (MPI_Comm_split_type SHARED, in world-rank order) get local ranks 0, 1, ...; local rank r
// uses visible device r % G (G = cudaGetDeviceCount), so with every GPU visible to every
// rank, rank r takes GPU r, and with one GPU bound per rank (CUDA_VISIBLE_DEVICES set by the
// launcher) each rank takes its own.
//   comm "nccl": NCCL collectives, bootstrapped over MPI. NCCL cannot put two ranks of a
//     communicator on one GPU, so if two ranks of a node would share a GPU (compared by
//     UUID), every rank gets a Status saying how many GPUs there are and what to do.
//   comm "mpi": host-staged MPI collectives (HostStagedCommunicator); ranks may share GPUs.
// What it is not: a launcher (start one MPI rank per simulated GPU) or a scheduler.
//
// Collective over MPI_COMM_WORLD when MPI is running (every rank must call it); without MPI
// (single-process tests) it acts as local rank 0 of 1. Errors are Statuses, never aborts:
//   no device:  "--backend cuda: no CUDA device is visible (cudaGetDeviceCount: ...)"
//   too many ranks for NCCL, an unusable device, a bad --comm or MPUSIM_NCCL_TIMEOUT_S.
// Timeout: how long an NCCL collective may take before the job is aborted is the MPI
// watchdog's communication timeout (`mpusim run --timeout`, default 1800 s, mpi/watchdog.h)
// unless the environment variable MPUSIM_NCCL_TIMEOUT_S (seconds) overrides it for NCCL.
#pragma once

#include <memory>
#include <string>

#include "core/backend.h"
#include "core/status.h"

namespace mpusim::cuda {

// comm: "nccl" or "mpi".
StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const std::string& comm);

}  // namespace mpusim::cuda
