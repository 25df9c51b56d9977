// The norm op table (tests/ops/norm_ops.h) on the GPU backend, and the GPU's one rule of its
// own (every tensor on the device); skipped when no CUDA device is visible.
#include "tests/ops/norm_ops.h"

#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

#include <stdexcept>

#include "core/tensor.h"
#include "cuda/cuda_kernels.h"

namespace mpusim {
namespace {

bool DeviceVisible() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear it
    return false;
  }
  return true;
}

TEST(CudaNormOps, EveryDtype) {
  if (!DeviceVisible()) GTEST_SKIP() << "no CUDA device is visible";
  cuda::CudaKernels k;
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    norm_ops::CheckAll(k, dt);
  }
}

TEST(CudaNormOps, HostStatisticsAreRefused) {
  if (!DeviceVisible()) GTEST_SKIP() << "no CUDA device is visible";
  cuda::CudaKernels k;
  const Tensor x = k.ToDevice(MakeOf(DType::kFloat32, {2, 3}, {1, 2, 3, 4, 5, 6}));
  const Tensor w = k.ToDevice(MakeOf(DType::kFloat32, {3}, {1, 2, 3}));
  Tensor y = k.Zeros({2, 3}, DType::kFloat32);
  Tensor host_rstd = Tensor::HostZeros({2}, DType::kFloat32);
  EXPECT_THROW(k.NormForward(Normalization::kRMSNorm, x, w, nullptr, 1e-5, y, nullptr, host_rstd),
               std::invalid_argument);
}

}  // namespace
}  // namespace mpusim
