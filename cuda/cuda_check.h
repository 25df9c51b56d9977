// MPUSIM_CUDA_CHECK, MPUSIM_CUBLAS_CHECK, MPUSIM_NCCL_CHECK: every CUDA, cuBLAS and NCCL
// call of the GPU backend goes through one of them.
//
// What it is: checks in the style of ggml's CUDA_CHECK_GEN. A failed call prints one line
//   mpusim: CUDA error on rank R (host H, device D): STATEMENT failed at FILE:LINE in
//   FUNCTION: MESSAGE
// (R = rank in MPI_COMM_WORLD, -1 without MPI; D = the current CUDA device, -1 if unknown;
// MESSAGE = the library's own text: cudaGetErrorName + cudaGetErrorString,
// cublasGetStatusName + cublasGetStatusString, ncclGetErrorString + ncclGetLastError) and
// then ends the whole job with MPI_Abort (std::abort when MPI is not running), so a failed
// kernel or collective never leaves the other ranks hanging.
// What it is not: argument checking. Shape and dtype mistakes are bugs in the caller and
// throw std::invalid_argument before any library call (see cuda_kernels.h).
//
// After every kernel launch: MPUSIM_CUDA_CHECK(cudaGetLastError()).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

namespace mpusim::cuda {

// Prints the line above to stderr, then MPI_Abort(MPI_COMM_WORLD, 1), or std::abort() if MPI
// is not running.
[[noreturn]] void Fatal(const char* statement, const std::string& message, const char* file,
                        int line, const char* function);

// The line Fatal prints, without the trailing newline (exposed for tests).
std::string FatalMessage(const char* statement, const std::string& message, const char* file,
                         int line, const char* function);

std::string CudaErrorText(cudaError_t error);        // "cudaErrorX: <description>"
std::string CublasErrorText(cublasStatus_t status);  // "CUBLAS_STATUS_X: <description>"
std::string NcclErrorText(ncclResult_t result);      // "<description> (last NCCL error: ...)"

}  // namespace mpusim::cuda

#define MPUSIM_CHECK_GEN(expr, ok, to_str)                                             \
  do {                                                                                 \
    const auto mpusim_check_result_ = (expr);                                          \
    if (mpusim_check_result_ != (ok)) {                                                \
      ::mpusim::cuda::Fatal(#expr, to_str(mpusim_check_result_), __FILE__, __LINE__,   \
                            __func__);                                                 \
    }                                                                                  \
  } while (0)

#define MPUSIM_CUDA_CHECK(x) MPUSIM_CHECK_GEN(x, cudaSuccess, ::mpusim::cuda::CudaErrorText)
#define MPUSIM_CUBLAS_CHECK(x) \
  MPUSIM_CHECK_GEN(x, CUBLAS_STATUS_SUCCESS, ::mpusim::cuda::CublasErrorText)
#define MPUSIM_NCCL_CHECK(x) MPUSIM_CHECK_GEN(x, ncclSuccess, ::mpusim::cuda::NcclErrorText)
