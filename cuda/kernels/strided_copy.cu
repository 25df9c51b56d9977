// The GPU backend's strided copy: one thread per index tuple, moving the elements' bits.
//
// One op per file (STYLE.md): its kernels, behind the launchers that device_kernels.h
// declares, instantiated for every storage type. What the kernel files share (the launch
// shape, loads and stores, BlockReduce, the instantiation lists) is cuda/device_common.cuh.
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

// U is an unsigned integer of the element's size: the copy moves bits.
template <typename U>
__global__ void StridedCopyKernel(const U* src, U* dst, StridedCopyPlan plan) {
  for (int64_t e = FirstIndex(); e < plan.count; e += GridStride()) {
    int64_t rest = e;
    int64_t from = 0;
    int64_t to = 0;
#pragma unroll
    for (int k = kCopyPlanDims - 1; k >= 0; --k) {
      const int64_t index = rest % plan.dims[k];
      rest /= plan.dims[k];
      from += index * plan.src_strides[k];
      to += index * plan.dst_strides[k];
    }
    dst[to] = src[from];
  }
}

}  // namespace

template <typename U>
void LaunchStridedCopy(const U* src, U* dst, const StridedCopyPlan& plan, cudaStream_t stream) {
  if (plan.count <= 0) return;
  StridedCopyKernel<U><<<GridFor(plan.count), kBlock, 0, stream>>>(src, dst, plan);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template void LaunchStridedCopy<uint16_t>(const uint16_t*, uint16_t*, const StridedCopyPlan&,
                                          cudaStream_t);
template void LaunchStridedCopy<uint32_t>(const uint32_t*, uint32_t*, const StridedCopyPlan&,
                                          cudaStream_t);
template void LaunchStridedCopy<uint64_t>(const uint64_t*, uint64_t*, const StridedCopyPlan&,
                                          cudaStream_t);

}  // namespace mpusim::cuda
