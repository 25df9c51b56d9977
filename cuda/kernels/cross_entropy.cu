// The GPU backend's vocab-parallel cross entropy pieces: the row max, the partial sums and
// the gradient, with core/ops/cross_entropy.h's pointwise math.
//
// One op per file (STYLE.md): its kernels, behind the launchers that device_kernels.h
// declares, instantiated for every storage type. What the kernel files share (the launch
// shape, loads and stores, BlockReduce, the instantiation lists) is cuda/device_common.cuh.
//
// A row kernel runs one block of kBlock threads per row and reduces with a shared-memory tree
// (BlockReduce), which fixes the summation order for a given row length (so repeated runs
// give identical bits). It reads everything its reductions need before the BlockReduce
// barrier and then writes only the elements each thread itself reads afterwards, which is
// what lets its output be its input (in place).
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/ops/cross_entropy.h"
#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

template <typename T>
__global__ void RowMaxKernel(const T* logits, int64_t rows, int64_t cols, ComputeOf<T> lowest,
                             ComputeOf<T>* row_max) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* row = logits + i * cols;
    C m = lowest;
    for (int64_t j = threadIdx.x; j < cols; j += kBlock) m = MaxOp()(m, Load(row[j]));
    m = BlockReduce(m, buf, MaxOp());
    if (threadIdx.x == 0) row_max[i] = m;
  }
}
template <typename T>
__global__ void CrossEntropyPartialsKernel(const T* logits, const ComputeOf<T>* row_max,
                                           const int64_t* labels, int64_t rows, int64_t cols,
                                           int64_t vocab_start, ComputeOf<T>* sum_exp,
                                           ComputeOf<T>* sum_z, ComputeOf<T>* target_z) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* row = logits + i * cols;
    const C m = row_max[i];
    C se = 0;
    C sz = 0;
    for (int64_t j = threadIdx.x; j < cols; j += kBlock) {
      const C z = ops::ShiftedLogit(Load(row[j]), m);
      se += ops::CrossEntropyExp<C>(z);
      sz += z;
    }
    se = BlockReduce(se, buf, SumOp());
    sz = BlockReduce(sz, buf, SumOp());
    if (threadIdx.x == 0) {
      sum_exp[i] = se;
      sum_z[i] = sz;
      const int64_t col = ops::LabelColumn(labels[i], vocab_start, cols);
      target_z[i] = col >= 0 ? ops::ShiftedLogit(Load(row[col]), m) : C(0);
    }
  }
}

template <typename T>
__global__ void CrossEntropyBackwardKernel(const T* logits, const ComputeOf<T>* row_max,
                                           const ComputeOf<T>* sum_exp, const int64_t* labels,
                                           int64_t rows, int64_t cols, int64_t vocab_start,
                                           ComputeOf<T> on_value, ComputeOf<T> off_value,
                                           const ComputeOf<T>* row_scale, T* grad) {
  using C = ComputeOf<T>;
  const int64_t n = rows * cols;
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    // Each thread reads and writes only element e, so grad may be logits.
    const int64_t i = e / cols;
    const int64_t j = e % cols;
    const C q = j == ops::LabelColumn(labels[i], vocab_start, cols) ? on_value : off_value;
    grad[e] = Store<T>(ops::CrossEntropyGrad(ops::ShiftedLogit(Load(logits[e]), row_max[i]),
                                             sum_exp[i], q, row_scale[i]));
  }
}

}  // namespace

template <typename T>
void LaunchRowMax(const T* logits, int64_t rows, int64_t cols, ComputeOf<T>* row_max,
                  cudaStream_t stream) {
  if (rows <= 0) return;
  const ComputeOf<T> lowest = -static_cast<ComputeOf<T>>(INFINITY);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  RowMaxKernel<T><<<grid, kBlock, 0, stream>>>(logits, rows, cols, lowest, row_max);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}
template <typename T>
void LaunchCrossEntropyPartials(const T* logits, const ComputeOf<T>* row_max,
                                const int64_t* labels, int64_t rows, int64_t cols,
                                int64_t vocab_start, ComputeOf<T>* sum_exp, ComputeOf<T>* sum_z,
                                ComputeOf<T>* target_z, cudaStream_t stream) {
  if (rows <= 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  CrossEntropyPartialsKernel<T><<<grid, kBlock, 0, stream>>>(
      logits, row_max, labels, rows, cols, vocab_start, sum_exp, sum_z, target_z);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchCrossEntropyBackward(const T* logits, const ComputeOf<T>* row_max,
                                const ComputeOf<T>* sum_exp, const int64_t* labels, int64_t rows,
                                int64_t cols, int64_t vocab_start, ComputeOf<T> on_value,
                                ComputeOf<T> off_value, const ComputeOf<T>* row_scale, T* grad,
                                cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n <= 0) return;
  CrossEntropyBackwardKernel<T><<<GridFor(n), kBlock, 0, stream>>>(
      logits, row_max, sum_exp, labels, rows, cols, vocab_start, on_value, off_value, row_scale,
      grad);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

#define MPUSIM_INSTANTIATE_CROSS_ENTROPY(T, C)                                               \
  template void LaunchRowMax<T>(const T*, int64_t, int64_t, C*, cudaStream_t);                 \
  template void LaunchCrossEntropyPartials<T>(const T*, const C*, const int64_t*, int64_t,     \
                                              int64_t, int64_t, C*, C*, C*, cudaStream_t);     \
  template void LaunchCrossEntropyBackward<T>(const T*, const C*, const C*, const int64_t*,    \
                                              int64_t, int64_t, int64_t, C, C, const C*, T*,   \
                                              cudaStream_t);
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_CROSS_ENTROPY)
#undef MPUSIM_INSTANTIATE_CROSS_ENTROPY

}  // namespace mpusim::cuda
