// What the GPU backend's kernel files (cuda/kernels/<op>.cu, one op each) share: the launch
// shape, the loads and stores, the block-wide reductions, and the storage and accumulator
// types every launcher is instantiated for. CUDA code: only the .cu files include it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/half.h"
#include "core/ops/element.h"

namespace mpusim::cuda {

inline constexpr int kBlock = 256;            // threads per block (a power of two: BlockReduce)
inline constexpr int64_t kMaxBlocks = 65535;  // grid-stride loops cover the rest

inline unsigned GridFor(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kBlock - 1) / kBlock, kMaxBlocks));
}

__device__ inline int64_t FirstIndex() {
  return static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x;
}
__device__ inline int64_t GridStride() { return static_cast<int64_t>(gridDim.x) * kBlock; }

// Loads and stores are the op functors' (core/ops/element.h): a stored element widened
// exactly to its compute type, and a compute-type value rounded once to its storage type.
using ops::Load;
using ops::Store;

struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return b > a ? b : a;
  }
};

// Reduces one value per thread of the block; every thread gets the result. `buf` has kBlock
// elements. Must be reached by all threads of the block.
template <typename T, typename Op>
__device__ T BlockReduce(T value, T* buf, Op op) {
  buf[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kBlock / 2; stride > 0; stride /= 2) {
    if (static_cast<int>(threadIdx.x) < stride) {
      buf[threadIdx.x] = op(buf[threadIdx.x], buf[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  const T result = buf[0];
  __syncthreads();  // buf may be reused right after
  return result;
}

}  // namespace mpusim::cuda

// The launchers' explicit instantiations: X(T, C) for every storage type T with its compute
// type C = ComputeOf<T>, and X(T, A, C) for every accumulator type A a T input may feed (T
// itself, or C for a 16-bit T).
#define MPUSIM_FOR_EACH_STORAGE(X) \
  X(double, double)                \
  X(float, float)                  \
  X(BFloat16, float)               \
  X(Float16, float)
#define MPUSIM_FOR_EACH_ACCUMULATOR(X) \
  X(double, double, double)            \
  X(float, float, float)               \
  X(BFloat16, BFloat16, float)         \
  X(BFloat16, float, float)            \
  X(Float16, Float16, float)           \
  X(Float16, float, float)
