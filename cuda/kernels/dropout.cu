// The GPU backend's dropout: core/ops/dropout.h's element (the CPU's Philox draw and
// division), one thread per element, with the local or the global tensor's index.
//
// One op per file (STYLE.md): its kernels, behind the launchers that device_kernels.h
// declares, instantiated for every storage type. What the kernel files share (the launch
// shape, loads and stores, BlockReduce, the instantiation lists) is cuda/device_common.cuh.
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "core/ops/dropout.h"
#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

// ops::Dropout: the CPU's Philox element and division, so masks and values are bit-identical.
template <typename T>
__global__ void DropoutKernel(const T* x, T* y, int64_t n, ops::Dropout op, uint64_t offset) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    y[e] = op(x[e], offset + static_cast<uint64_t>(e));
  }
}

template <typename T>
__global__ void DropoutAtKernel(const T* x, T* y, int64_t n, ops::Dropout op, IndexMap map) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    y[e] = op(x[e], static_cast<uint64_t>(ops::MapIndex(map.base, map.dims, map.strides, e)));
  }
}

}  // namespace

template <typename T>
void LaunchDropout(const T* x, T* y, int64_t n, ops::Dropout op, uint64_t offset,
                   cudaStream_t stream) {
  if (n <= 0) return;
  DropoutKernel<T><<<GridFor(n), kBlock, 0, stream>>>(x, y, n, op, offset);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchDropoutAt(const T* x, T* y, int64_t n, ops::Dropout op, IndexMap map,
                     cudaStream_t stream) {
  if (n <= 0) return;
  DropoutAtKernel<T><<<GridFor(n), kBlock, 0, stream>>>(x, y, n, op, map);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

#define MPUSIM_INSTANTIATE_DROPOUT(T, C)                                                       \
  template void LaunchDropout<T>(const T*, T*, int64_t, ops::Dropout, uint64_t, cudaStream_t); \
  template void LaunchDropoutAt<T>(const T*, T*, int64_t, ops::Dropout, IndexMap, cudaStream_t);
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_DROPOUT)
#undef MPUSIM_INSTANTIATE_DROPOUT

}  // namespace mpusim::cuda
