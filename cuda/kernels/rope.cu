// The GPU backend's rotary embedding: core/ops/rope.h's angle and rotation, one thread per
// rotated pair; the channels past dim are copied when y is not x.
//
// One op per file (STYLE.md): its kernels, behind the launchers that device_kernels.h
// declares, instantiated for every storage type. What the kernel files share (the launch
// shape, loads and stores, BlockReduce, the instantiation lists) is cuda/device_common.cuh.
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "core/ops/rope.h"
#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

template <typename T>
__global__ void RopeKernel(const T* x, int64_t rows, int64_t d, int64_t dim, const int64_t* pos,
                           int64_t sq, double base, bool inverse, T* y) {
  using C = ComputeOf<T>;
  const int64_t half = dim / 2;
  const int64_t n = rows * half;
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    const int64_t r = e / half;
    const int64_t i = e % half;
    // The CPU's angle and rotation (core/ops/rope.h). This thread alone reads and writes
    // the pair: y may be x.
    const ops::RopeAngle<C> a = ops::RopeAngleAt<C>(pos[r % sq], i, dim, base, inverse);
    C lo, hi;
    ops::RopeRotate(Load(x[r * d + i]), Load(x[r * d + half + i]), a, lo, hi);
    y[r * d + i] = Store<T>(lo);
    y[r * d + half + i] = Store<T>(hi);
  }
}

// The channels past dim pass through (rotary_percent < 1), when y is not x.
template <typename T>
__global__ void CopyTailKernel(const T* x, int64_t rows, int64_t d, int64_t dim, T* y) {
  const int64_t tail = d - dim;
  const int64_t n = rows * tail;
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    const int64_t at = (e / tail) * d + dim + e % tail;
    y[at] = x[at];
  }
}

}  // namespace

template <typename T>
void LaunchRope(const T* x, int64_t rows, int64_t d, int64_t dim, const int64_t* pos,
                int64_t sq, double base, bool inverse, T* y, cudaStream_t stream) {
  const int64_t n = rows * (dim / 2);
  if (n <= 0) return;
  RopeKernel<T><<<GridFor(n), kBlock, 0, stream>>>(x, rows, d, dim, pos, sq, base, inverse, y);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
  if (dim < d && x != y) {
    CopyTailKernel<T><<<GridFor(rows * (d - dim)), kBlock, 0, stream>>>(x, rows, d, dim, y);
    MPUSIM_CUDA_CHECK(cudaGetLastError());
  }
}

#define MPUSIM_INSTANTIATE_ROPE(T, C)                                                     \
  template void LaunchRope<T>(const T*, int64_t, int64_t, int64_t, const int64_t*, int64_t, \
                              double, bool, T*, cudaStream_t);
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_ROPE)
#undef MPUSIM_INSTANTIATE_ROPE

}  // namespace mpusim::cuda
