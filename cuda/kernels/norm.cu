// The GPU backend's norms forward and backward: core/ops/norm.h's pointwise math, one block
// per row for the statistics and dx, one thread per column for dweight and dbias.
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
#include <cstdint>

#include "core/ops/norm.h"
#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

template <typename T>
__global__ void NormForwardKernel(const T* x, const T* weight, const T* bias, int64_t rows,
                                  int64_t cols, ComputeOf<T> eps, T* y, ComputeOf<T>* mean,
                                  ComputeOf<T>* rstd) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  const C count = static_cast<C>(cols);
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* row = x + i * cols;
    C m = 0;
    if (mean != nullptr) {
      C sum = 0;
      for (int64_t j = threadIdx.x; j < cols; j += kBlock) sum += Load(row[j]);
      m = BlockReduce(sum, buf, SumOp()) / count;
    }
    C squares = 0;
    for (int64_t j = threadIdx.x; j < cols; j += kBlock) {
      const C centered = Load(row[j]) - m;
      squares += centered * centered;
    }
    const C var = BlockReduce(squares, buf, SumOp()) / count;
    const C r = ops::NormRstd(var, eps);
    if (threadIdx.x == 0) {
      if (mean != nullptr) mean[i] = m;
      rstd[i] = r;
    }
    T* out = y + i * cols;
    for (int64_t j = threadIdx.x; j < cols; j += kBlock) {
      const C xhat = ops::Normalize(Load(row[j]), m, r);
      out[j] = Store<T>(bias != nullptr ? ops::NormOutput(xhat, Load(weight[j]), Load(bias[j]))
                                        : ops::NormOutput(xhat, Load(weight[j])));
    }
  }
}

// dweight[j] (dbias[j]) += the column sum of dy * xhat (dy), rows in order.
template <typename T, typename A>
__global__ void NormColumnsKernel(const T* x, const ComputeOf<T>* mean, const ComputeOf<T>* rstd,
                                  const T* dy, int64_t rows, int64_t cols, A* dweight,
                                  A* dbias) {
  using C = ComputeOf<T>;
  for (int64_t j = FirstIndex(); j < cols; j += GridStride()) {
    C dw = 0;
    C db = 0;
    for (int64_t i = 0; i < rows; ++i) {
      const C m = mean != nullptr ? mean[i] : C(0);
      const C xhat = ops::Normalize(Load(x[i * cols + j]), m, rstd[i]);
      const C g = Load(dy[i * cols + j]);
      dw += ops::NormWeightGrad(g, xhat);
      db += ops::NormBiasGrad(g);
    }
    dweight[j] = Store<A>(Load(dweight[j]) + dw);
    if (dbias != nullptr) dbias[j] = Store<A>(Load(dbias[j]) + db);
  }
}

template <typename T>
__global__ void NormRowsBackwardKernel(const T* x, const T* weight, const ComputeOf<T>* mean,
                                       const ComputeOf<T>* rstd, const T* dy, int64_t rows,
                                       int64_t cols, T* dx) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  const C count = static_cast<C>(cols);
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* x_row = x + i * cols;
    const T* dy_row = dy + i * cols;
    const C m = mean != nullptr ? mean[i] : C(0);
    const C r = rstd[i];
    C sum_g = 0;
    C sum_gx = 0;
    for (int64_t j = threadIdx.x; j < cols; j += kBlock) {
      const C xhat = ops::Normalize(Load(x_row[j]), m, r);
      const C g = ops::NormXhatGrad(Load(dy_row[j]), Load(weight[j]));
      sum_g += g;
      sum_gx += g * xhat;
    }
    sum_g = BlockReduce(sum_g, buf, SumOp());
    sum_gx = BlockReduce(sum_gx, buf, SumOp());
    const C mean_g = mean != nullptr ? sum_g / count : C(0);
    const C mean_gx = sum_gx / count;
    T* dx_row = dx + i * cols;
    for (int64_t j = threadIdx.x; j < cols; j += kBlock) {
      const C xhat = ops::Normalize(Load(x_row[j]), m, r);
      const C g = ops::NormXhatGrad(Load(dy_row[j]), Load(weight[j]));
      dx_row[j] = Store<T>(ops::NormInputGrad(g, xhat, r, mean_g, mean_gx));
    }
  }
}

}  // namespace

template <typename T>
void LaunchNormForward(const T* x, const T* weight, const T* bias, int64_t rows, int64_t cols,
                       ComputeOf<T> eps, T* y, ComputeOf<T>* mean, ComputeOf<T>* rstd,
                       cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  NormForwardKernel<T><<<grid, kBlock, 0, stream>>>(x, weight, bias, rows, cols, eps, y, mean,
                                                    rstd);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename A>
void LaunchNormBackward(const T* x, const T* weight, const ComputeOf<T>* mean,
                        const ComputeOf<T>* rstd, const T* dy, int64_t rows, int64_t cols, T* dx,
                        A* dweight, A* dbias, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  // Columns first: they read dy, which the row pass may overwrite (dx may be dy).
  NormColumnsKernel<T, A><<<GridFor(cols), kBlock, 0, stream>>>(x, mean, rstd, dy, rows, cols,
                                                                dweight, dbias);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  NormRowsBackwardKernel<T><<<grid, kBlock, 0, stream>>>(x, weight, mean, rstd, dy, rows, cols,
                                                         dx);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

#define MPUSIM_INSTANTIATE_NORM_FORWARD(T, C)                                              \
  template void LaunchNormForward<T>(const T*, const T*, const T*, int64_t, int64_t, C, T*, \
                                     C*, C*, cudaStream_t);
#define MPUSIM_INSTANTIATE_NORM_BACKWARD(T, A, C)                                          \
  template void LaunchNormBackward<T, A>(const T*, const T*, const C*, const C*, const T*, \
                                         int64_t, int64_t, T*, A*, A*, cudaStream_t);
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_NORM_FORWARD)
MPUSIM_FOR_EACH_ACCUMULATOR(MPUSIM_INSTANTIATE_NORM_BACKWARD)
#undef MPUSIM_INSTANTIATE_NORM_BACKWARD
#undef MPUSIM_INSTANTIATE_NORM_FORWARD

}  // namespace mpusim::cuda
