// CUDA / cuBLAS / NCCL error reporting (see cuda_check.h).
#include "cuda/cuda_check.h"

#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

namespace mpusim::cuda {
namespace {

bool MpiRunning() {
  int initialized = 0;
  int finalized = 0;
  // Callable at any time; not checked, since a failure here would recurse into Fatal.
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized != 0 && finalized == 0;
}

}  // namespace

std::string FatalMessage(const char* statement, const std::string& message, const char* file,
                         int line, const char* function) {
  int world_rank = -1;
  std::string host = "?";
  if (MpiRunning()) {
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    if (MPI_Get_processor_name(name, &length) == MPI_SUCCESS) host.assign(name, name + length);
  } else {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) == 0) host = name;
  }
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  return fmt::format("mpusim: CUDA error on rank {} (host {}, device {}): {} failed at {}:{} in {}: {}",
                     world_rank, host, device, statement, file, line, function, message);
}

void Fatal(const char* statement, const std::string& message, const char* file, int line,
           const char* function) {
  const std::string text = FatalMessage(statement, message, file, line, function);
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
  if (MpiRunning()) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

std::string CudaErrorText(cudaError_t error) {
  return fmt::format("{}: {}", cudaGetErrorName(error), cudaGetErrorString(error));
}

std::string CublasErrorText(cublasStatus_t status) {
  return fmt::format("{}: {}", cublasGetStatusName(status), cublasGetStatusString(status));
}

std::string NcclErrorText(ncclResult_t result) {
  // ncclGetLastError ignores its argument (any communicator's last error).
  const char* last = ncclGetLastError(nullptr);
  std::string text = ncclGetErrorString(result);
  if (last != nullptr && last[0] != '\0') text += fmt::format(" (last NCCL error: {})", last);
  return text;
}

}  // namespace mpusim::cuda
