// CUDA / cuBLAS / NCCL error reporting (see cuda_check.h).
#include "cuda/cuda_check.h"

#include <fmt/format.h>

#include "mpi/mpi_check.h"

namespace mpusim::cuda {

std::string FatalMessage(const char* statement, const std::string& message, const char* file,
                         int line, const char* function) {
  const ProcessPlace place = WhereAmI();
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  return fmt::format("mpusim: CUDA error on rank {} (host {}, device {}): {} failed at {}:{} in {}: {}",
                     place.world_rank, place.host, device, statement, file, line, function,
                     message);
}

void Fatal(const char* statement, const std::string& message, const char* file, int line,
           const char* function) {
  AbortJob(FatalMessage(statement, message, file, line, function));
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
