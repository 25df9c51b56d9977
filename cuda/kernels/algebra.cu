// The GPU backend's dense algebra besides cuBLAS's GEMMs: Convert, Scale, Axpy, AddRowVector
// and SumRows, grid-stride loops over int64 indices (one thread per element or column).
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

template <typename S, typename D>
__global__ void ConvertKernel(const S* in, D* out, int64_t n) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    out[e] = RoundTo<D>(Widen(in[e]));
  }
}
template <typename T>
__global__ void ScaleKernel(T* x, int64_t n, ComputeOf<T> alpha) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    x[e] = Store<T>(Load(x[e]) * alpha);
  }
}
template <typename T, typename A>
__global__ void AxpyKernel(const T* x, A* y, int64_t n, ComputeOf<T> alpha) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    y[e] = Store<A>(Load(y[e]) + alpha * Load(x[e]));
  }
}
template <typename T>
__global__ void AddRowVectorKernel(const T* bias, T* y, int64_t n, int64_t cols) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    y[e] = Store<T>(Load(y[e]) + Load(bias[e % cols]));
  }
}
// beta_mode: 0 overwrite, 1 accumulate, 2 scale by beta first.
template <typename T, typename A>
__global__ void SumRowsKernel(const T* x, int64_t rows, int64_t cols, int beta_mode,
                              ComputeOf<T> beta, A* out) {
  using C = ComputeOf<T>;
  for (int64_t j = FirstIndex(); j < cols; j += GridStride()) {
    C sum = 0;
    for (int64_t i = 0; i < rows; ++i) sum += Load(x[i * cols + j]);
    const C kept = beta_mode == 0   ? C(0)
                   : beta_mode == 1 ? Load(out[j])
                                    : Load(out[j]) * beta;
    out[j] = Store<A>(rows > 0 ? kept + sum : kept);
  }
}

}  // namespace

template <typename S, typename D>
void LaunchConvert(const S* in, D* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  ConvertKernel<S, D><<<GridFor(n), kBlock, 0, stream>>>(in, out, n);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}
template <typename T>
void LaunchScale(T* x, int64_t n, ComputeOf<T> alpha, cudaStream_t stream) {
  if (n <= 0) return;
  ScaleKernel<T><<<GridFor(n), kBlock, 0, stream>>>(x, n, alpha);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}
template <typename T, typename A>
void LaunchAxpy(const T* x, A* y, int64_t n, ComputeOf<T> alpha, cudaStream_t stream) {
  if (n <= 0) return;
  AxpyKernel<T, A><<<GridFor(n), kBlock, 0, stream>>>(x, y, n, alpha);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}
template <typename T>
void LaunchAddRowVector(const T* bias, T* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n <= 0) return;
  AddRowVectorKernel<T><<<GridFor(n), kBlock, 0, stream>>>(bias, y, n, cols);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}
template <typename T, typename A>
void LaunchSumRows(const T* x, int64_t rows, int64_t cols, double beta, A* out,
                   cudaStream_t stream) {
  if (cols <= 0) return;
  const int beta_mode = beta == 0.0 ? 0 : beta == 1.0 ? 1 : 2;
  SumRowsKernel<T, A><<<GridFor(cols), kBlock, 0, stream>>>(
      x, rows, cols, beta_mode, static_cast<ComputeOf<T>>(beta), out);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

#define MPUSIM_INSTANTIATE_ALGEBRA(T, C)                        \
  template void LaunchScale<T>(T*, int64_t, C, cudaStream_t);    \
  template void LaunchAddRowVector<T>(const T*, T*, int64_t, int64_t, cudaStream_t);
// The accumulating launchers, for inputs of storage type T into an accumulator of type A
// (T itself, or the compute type C of a 16-bit T).
#define MPUSIM_INSTANTIATE_ACCUMULATORS(T, A, C)                              \
  template void LaunchAxpy<T, A>(const T*, A*, int64_t, C, cudaStream_t); \
  template void LaunchSumRows<T, A>(const T*, int64_t, int64_t, double, A*, cudaStream_t);
// Convert, from storage type S into each storage type.
#define MPUSIM_INSTANTIATE_CONVERT(S, D) \
  template void LaunchConvert<S, D>(const S*, D*, int64_t, cudaStream_t);
#define MPUSIM_INSTANTIATE_CONVERTS_FROM(S, C) \
  MPUSIM_INSTANTIATE_CONVERT(S, double)        \
  MPUSIM_INSTANTIATE_CONVERT(S, float)         \
  MPUSIM_INSTANTIATE_CONVERT(S, BFloat16)      \
  MPUSIM_INSTANTIATE_CONVERT(S, Float16)
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_ALGEBRA)
MPUSIM_FOR_EACH_ACCUMULATOR(MPUSIM_INSTANTIATE_ACCUMULATORS)
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_CONVERTS_FROM)
#undef MPUSIM_INSTANTIATE_CONVERTS_FROM
#undef MPUSIM_INSTANTIATE_CONVERT
#undef MPUSIM_INSTANTIATE_ACCUMULATORS
#undef MPUSIM_INSTANTIATE_ALGEBRA

}  // namespace mpusim::cuda
