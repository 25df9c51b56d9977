// The op table (tests/ops/op_table.h) on the GPU backend, against the CPU backend's float64
// run of every row; skipped when no CUDA device is visible.
#include "tests/ops/op_table.h"

#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

#include "cuda/cuda_kernels.h"
#include "sim/eigen_kernels.h"

namespace mpusim {
namespace {

TEST(CudaOpTable, EveryDtype) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear it
    GTEST_SKIP() << "no CUDA device is visible";
  }
  cuda::CudaKernels k;
  EigenKernels cpu;
  op_table::CheckAll(k, cpu);
}

}  // namespace
}  // namespace mpusim
