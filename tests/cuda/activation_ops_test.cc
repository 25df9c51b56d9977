// The activation op table (tests/ops/activation_ops.h) on the GPU backend; skipped when no
// CUDA device is visible.
#include "tests/ops/activation_ops.h"

#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

#include "core/tensor.h"
#include "cuda/cuda_kernels.h"

namespace mpusim {
namespace {

TEST(CudaActivationOps, EveryDtype) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear it
    GTEST_SKIP() << "no CUDA device is visible";
  }
  cuda::CudaKernels k;
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    activation_ops::CheckAll(k, dt);
  }
}

TEST(CudaActivationOps, GluByHand) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear it
    GTEST_SKIP() << "no CUDA device is visible";
  }
  cuda::CudaKernels k;
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    activation_ops::CheckGluByHand(k, dt);
  }
}

}  // namespace
}  // namespace mpusim
