// The GPU backend's top-k: core/ops/topk.h's selection (the CPU's too), one thread per row.
//
// One op per file (STYLE.md): its kernels, behind the launchers that device_kernels.h
// declares, instantiated for every storage type. What the kernel files share (the launch
// shape, loads and stores, BlockReduce, the instantiation lists) is cuda/device_common.cuh.
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "core/ops/topk.h"
#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

// One thread per row: ops::TopKRow, the CPU's selection too.
template <typename T>
__global__ void TopKKernel(const T* scores, int64_t rows, int64_t n, int64_t k, T* values,
                           int64_t* indices) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  ops::TopKRow(scores + r * n, n, k, values + r * k, indices + r * k);
}

}  // namespace

template <typename T>
void LaunchTopK(const T* scores, int64_t rows, int64_t n, int64_t k, T* values,
                int64_t* indices, cudaStream_t stream) {
  if (rows <= 0) return;
  constexpr int64_t kThreads = 128;
  const auto grid = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  TopKKernel<T><<<grid, kThreads, 0, stream>>>(scores, rows, n, k, values, indices);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

#define MPUSIM_INSTANTIATE_TOPK(T, C) \
  template void LaunchTopK<T>(const T*, int64_t, int64_t, int64_t, T*, int64_t*, cudaStream_t);
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_TOPK)
#undef MPUSIM_INSTANTIATE_TOPK

}  // namespace mpusim::cuda
