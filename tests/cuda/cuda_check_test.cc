// The CUDA / cuBLAS / NCCL checks: messages and the abort. Needs no GPU (only the libraries'
// error-string tables), so it runs everywhere.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include <gtest/gtest.h>

#include "cuda/cuda_check.h"

namespace mpusim::cuda {
namespace {

TEST(CudaCheckTest, TextsCarryTheLibrariesOwnMessages) {
  EXPECT_EQ(CudaErrorText(cudaErrorMemoryAllocation).rfind("cudaErrorMemoryAllocation: ", 0), 0u)
      << CudaErrorText(cudaErrorMemoryAllocation);
  EXPECT_NE(CudaErrorText(cudaErrorMemoryAllocation).find(
                cudaGetErrorString(cudaErrorMemoryAllocation)),
            std::string::npos);
  EXPECT_EQ(CublasErrorText(CUBLAS_STATUS_NOT_INITIALIZED).rfind("CUBLAS_STATUS_NOT_INITIALIZED", 0),
            0u)
      << CublasErrorText(CUBLAS_STATUS_NOT_INITIALIZED);
  EXPECT_EQ(NcclErrorText(ncclInvalidArgument).rfind(ncclGetErrorString(ncclInvalidArgument), 0),
            0u)
      << NcclErrorText(ncclInvalidArgument);
}

TEST(CudaCheckTest, FatalMessageNamesRankHostDeviceStatementAndPlace) {
  const std::string line = FatalMessage("cudaMalloc(&p, 8)", "cudaErrorMemoryAllocation: oom",
                                        "cuda/x.cc", 12, "Allocate");
  // No MPI in this binary: rank -1. The device is whatever cudaGetDevice says (-1 without one).
  EXPECT_EQ(line.rfind("mpusim: CUDA error on rank -1 (host ", 0), 0u) << line;
  EXPECT_NE(line.find(", device "), std::string::npos) << line;
  EXPECT_NE(line.find("): cudaMalloc(&p, 8) failed at cuda/x.cc:12 in Allocate: "
                      "cudaErrorMemoryAllocation: oom"),
            std::string::npos)
      << line;
}

TEST(CudaCheckDeathTest, FailedCheckAbortsWithTheMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the CUDA runtime may run threads
  EXPECT_DEATH(MPUSIM_CUDA_CHECK(cudaErrorInvalidValue),
               "CUDA error on rank -1 .*cudaErrorInvalidValue failed at .*cuda_check_test\\.cc:"
               "[0-9]+ in TestBody: cudaErrorInvalidValue: ");
  EXPECT_DEATH(MPUSIM_NCCL_CHECK(ncclSystemError), "ncclSystemError failed at .*: ");
  EXPECT_DEATH(MPUSIM_CUBLAS_CHECK(CUBLAS_STATUS_EXECUTION_FAILED),
               "failed at .*: CUBLAS_STATUS_EXECUTION_FAILED");
}

}  // namespace
}  // namespace mpusim::cuda
