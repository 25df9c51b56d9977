// CUDA kernels of the GPU backend (see device_kernels.h).
//
// Plain, readable kernels: elementwise ops are grid-stride loops over int64 indices (any
// size, at most kMaxBlocks blocks); row reductions use one block of kBlock threads per row
// with a shared-memory tree, which fixes the summation order for a given row length (so
// repeated runs give identical bits). Correctness and determinism over speed: cuBLAS does
// the heavy lifting (GEMMs), these kernels move O(elements) data.
//
// One body per op, templated on the storage type: loads go through ToCompute (exact
// widening), stores through ToStorage<T> (one rounding, core/half.h), both the identity for
// float and double, so the float32 and float64 kernels are exactly what they were.
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/half.h"
#include "core/philox.h"
#include "cuda/cuda_check.h"

namespace mpusim::cuda {
namespace {

constexpr int kBlock = 256;          // threads per block (a power of two: BlockReduce)
constexpr int64_t kMaxBlocks = 65535;  // grid-stride loops cover the rest

unsigned GridFor(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kBlock - 1) / kBlock, kMaxBlocks));
}

__device__ inline int64_t FirstIndex() {
  return static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x;
}
__device__ inline int64_t GridStride() { return static_cast<int64_t>(gridDim.x) * kBlock; }

__device__ inline float Exp(float x) { return expf(x); }
__device__ inline double Exp(double x) { return exp(x); }
__device__ inline float Erf(float x) { return erff(x); }
__device__ inline double Erf(double x) { return erf(x); }

// Loads: a stored element widened exactly to its compute type.
__device__ inline double ToCompute(double v) { return v; }
__device__ inline float ToCompute(float v) { return v; }
__device__ inline float ToCompute(BFloat16 v) { return ToFloat(v); }
__device__ inline float ToCompute(Float16 v) { return ToFloat(v); }

// Stores: a compute-type value rounded once to the storage type S (exact for S = C).
template <typename S>
__device__ inline S ToStorage(ComputeOf<S> v) {
  if constexpr (std::is_same_v<S, ComputeOf<S>>) {
    return v;
  } else {
    return FromFloat<S>(v);
  }
}

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

// --- elementwise ----------------------------------------------------------------------

template <typename T>
__global__ void ScaleKernel(T* x, int64_t n, ComputeOf<T> alpha) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    x[e] = ToStorage<T>(ToCompute(x[e]) * alpha);
  }
}

template <typename T, typename A>
__global__ void AxpyKernel(const T* x, A* y, int64_t n, ComputeOf<T> alpha) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    y[e] = ToStorage<A>(ToCompute(y[e]) + alpha * ToCompute(x[e]));
  }
}

template <typename T>
__global__ void AddRowVectorKernel(const T* bias, T* y, int64_t n, int64_t cols) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    y[e] = ToStorage<T>(ToCompute(y[e]) + ToCompute(bias[e % cols]));
  }
}

// beta_mode: 0 overwrite, 1 accumulate, 2 scale by beta first.
template <typename T, typename A>
__global__ void SumRowsKernel(const T* x, int64_t rows, int64_t cols, int beta_mode,
                              ComputeOf<T> beta, A* out) {
  using C = ComputeOf<T>;
  for (int64_t j = FirstIndex(); j < cols; j += GridStride()) {
    C sum = 0;
    for (int64_t i = 0; i < rows; ++i) sum += ToCompute(x[i * cols + j]);
    const C kept = beta_mode == 0   ? C(0)
                   : beta_mode == 1 ? ToCompute(out[j])
                                    : ToCompute(out[j]) * beta;
    out[j] = ToStorage<A>(rows > 0 ? kept + sum : kept);
  }
}

template <typename T>
__global__ void GeluForwardKernel(const T* x, T* y, int64_t n, ComputeOf<T> inv_sqrt2) {
  using C = ComputeOf<T>;
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    const C v = ToCompute(x[e]);
    y[e] = ToStorage<T>((C(0.5) * v) * (C(1) + Erf(v * inv_sqrt2)));
  }
}

template <typename T>
__global__ void GeluBackwardKernel(const T* x, const T* dy, T* dx, int64_t n,
                                   ComputeOf<T> inv_sqrt2, ComputeOf<T> inv_sqrt_2pi) {
  using C = ComputeOf<T>;
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    const C v = ToCompute(x[e]);
    const C cdf = C(0.5) * (C(1) + Erf(v * inv_sqrt2));
    const C v_pdf = (v * Exp(C(-0.5) * (v * v))) * inv_sqrt_2pi;
    dx[e] = ToStorage<T>(ToCompute(dy[e]) * (cdf + v_pdf));
  }
}

template <typename T>
__global__ void DropoutKernel(const T* x, T* y, int64_t n, double p,
                              ComputeOf<T> keep_probability, uint64_t key, uint64_t rng_stream,
                              uint64_t offset) {
  using C = ComputeOf<T>;
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    // The same Philox element as the CPU: masks are bit-identical.
    const bool keep = UniformAt(key, rng_stream, offset + static_cast<uint64_t>(e)) >= p;
    y[e] = ToStorage<T>(keep ? ToCompute(x[e]) / keep_probability : C(0));
  }
}

// --- embedding ------------------------------------------------------------------------

template <typename T>
__global__ void EmbeddingForwardKernel(const T* weight, const int64_t* ids, int64_t n,
                                       int64_t cols, int64_t vocab_start, int64_t vocab_end,
                                       T* out) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    const int64_t id = ids[e / cols];
    // T{} is +0 for every storage type (all-zero bits).
    out[e] = id >= vocab_start && id < vocab_end ? weight[(id - vocab_start) * cols + e % cols]
                                                 : T{};
  }
}

template <typename T, typename A>
__global__ void EmbeddingBackwardKernel(const T* dy, const int64_t* plan, int64_t num_rows,
                                        int64_t cols, A* dweight) {
  const int64_t* local_rows = plan;
  const int64_t* offsets = plan + num_rows;
  const int64_t* tokens = plan + 2 * num_rows + 1;
  const int64_t n = num_rows * cols;
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    const int64_t r = e / cols;
    const int64_t j = e % cols;
    A* target = dweight + local_rows[r] * cols + j;
    // Each token's addition is rounded to A, as the CPU's loop stores after every token
    // (only a 16-bit A actually rounds).
    A acc = *target;
    for (int64_t t = offsets[r]; t < offsets[r + 1]; ++t) {
      acc = ToStorage<A>(ToCompute(acc) + ToCompute(dy[tokens[t] * cols + j]));
    }
    *target = acc;
  }
}

// --- cross entropy --------------------------------------------------------------------

template <typename T>
__global__ void RowMaxKernel(const T* logits, int64_t rows, int64_t cols, ComputeOf<T> lowest,
                             ComputeOf<T>* row_max) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* row = logits + i * cols;
    C m = lowest;
    for (int64_t j = threadIdx.x; j < cols; j += kBlock) m = MaxOp()(m, ToCompute(row[j]));
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
      const C z = ToCompute(row[j]) - m;
      se += Exp(z);
      sz += z;
    }
    se = BlockReduce(se, buf, SumOp());
    sz = BlockReduce(sz, buf, SumOp());
    if (threadIdx.x == 0) {
      sum_exp[i] = se;
      sum_z[i] = sz;
      const int64_t col = labels[i] - vocab_start;
      target_z[i] = col >= 0 && col < cols ? ToCompute(row[col]) - m : C(0);
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
    const C q = j == labels[i] - vocab_start ? on_value : off_value;
    grad[e] =
        ToStorage<T>(row_scale[i] * (Exp(ToCompute(logits[e]) - row_max[i]) / sum_exp[i] - q));
  }
}

}  // namespace

// --- launchers ------------------------------------------------------------------------

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

template <typename T>
void LaunchGeluForward(const T* x, T* y, int64_t n, ComputeOf<T> inv_sqrt2, cudaStream_t stream) {
  if (n <= 0) return;
  GeluForwardKernel<T><<<GridFor(n), kBlock, 0, stream>>>(x, y, n, inv_sqrt2);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchGeluBackward(const T* x, const T* dy, T* dx, int64_t n, ComputeOf<T> inv_sqrt2,
                        ComputeOf<T> inv_sqrt_2pi, cudaStream_t stream) {
  if (n <= 0) return;
  GeluBackwardKernel<T><<<GridFor(n), kBlock, 0, stream>>>(x, dy, dx, n, inv_sqrt2,
                                                           inv_sqrt_2pi);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchDropout(const T* x, T* y, int64_t n, double p, ComputeOf<T> keep_probability,
                   uint64_t key, uint64_t rng_stream, uint64_t offset, cudaStream_t stream) {
  if (n <= 0) return;
  DropoutKernel<T><<<GridFor(n), kBlock, 0, stream>>>(x, y, n, p, keep_probability, key,
                                                      rng_stream, offset);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchEmbeddingForward(const T* weight, const int64_t* ids, int64_t num_ids, int64_t cols,
                            int64_t vocab_start, int64_t vocab_end, T* out, cudaStream_t stream) {
  const int64_t n = num_ids * cols;
  if (n <= 0) return;
  EmbeddingForwardKernel<T><<<GridFor(n), kBlock, 0, stream>>>(weight, ids, n, cols,
                                                               vocab_start, vocab_end, out);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename A>
void LaunchEmbeddingBackward(const T* dy, const int64_t* plan, int64_t num_rows, int64_t cols,
                             A* dweight, cudaStream_t stream) {
  const int64_t n = num_rows * cols;
  if (n <= 0) return;
  EmbeddingBackwardKernel<T, A><<<GridFor(n), kBlock, 0, stream>>>(dy, plan, num_rows, cols,
                                                                   dweight);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

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

// Every storage type, with C = ComputeOf<T>.
#define MPUSIM_INSTANTIATE_LAUNCHERS(T, C)                                                     \
  template void LaunchScale<T>(T*, int64_t, C, cudaStream_t);                                  \
  template void LaunchAddRowVector<T>(const T*, T*, int64_t, int64_t, cudaStream_t);           \
  template void LaunchGeluForward<T>(const T*, T*, int64_t, C, cudaStream_t);                  \
  template void LaunchGeluBackward<T>(const T*, const T*, T*, int64_t, C, C, cudaStream_t);    \
  template void LaunchDropout<T>(const T*, T*, int64_t, double, C, uint64_t, uint64_t,         \
                                 uint64_t, cudaStream_t);                                      \
  template void LaunchEmbeddingForward<T>(const T*, const int64_t*, int64_t, int64_t, int64_t, \
                                          int64_t, T*, cudaStream_t);                          \
  template void LaunchRowMax<T>(const T*, int64_t, int64_t, C*, cudaStream_t);                 \
  template void LaunchCrossEntropyPartials<T>(const T*, const C*, const int64_t*, int64_t,     \
                                              int64_t, int64_t, C*, C*, C*, cudaStream_t);     \
  template void LaunchCrossEntropyBackward<T>(const T*, const C*, const C*, const int64_t*,    \
                                              int64_t, int64_t, int64_t, C, C, const C*, T*,   \
                                              cudaStream_t);

// The accumulating launchers, for inputs of storage type T into an accumulator of type A
// (T itself, or the compute type C of a 16-bit T).
#define MPUSIM_INSTANTIATE_ACCUMULATORS(T, A, C)                                                 \
  template void LaunchAxpy<T, A>(const T*, A*, int64_t, C, cudaStream_t);                        \
  template void LaunchSumRows<T, A>(const T*, int64_t, int64_t, double, A*, cudaStream_t);       \
  template void LaunchEmbeddingBackward<T, A>(const T*, const int64_t*, int64_t, int64_t, A*,    \
                                              cudaStream_t);

MPUSIM_INSTANTIATE_LAUNCHERS(double, double)
MPUSIM_INSTANTIATE_LAUNCHERS(float, float)
MPUSIM_INSTANTIATE_LAUNCHERS(BFloat16, float)
MPUSIM_INSTANTIATE_LAUNCHERS(Float16, float)
MPUSIM_INSTANTIATE_ACCUMULATORS(double, double, double)
MPUSIM_INSTANTIATE_ACCUMULATORS(float, float, float)
MPUSIM_INSTANTIATE_ACCUMULATORS(BFloat16, BFloat16, float)
MPUSIM_INSTANTIATE_ACCUMULATORS(BFloat16, float, float)
MPUSIM_INSTANTIATE_ACCUMULATORS(Float16, Float16, float)
MPUSIM_INSTANTIATE_ACCUMULATORS(Float16, float, float)

#undef MPUSIM_INSTANTIATE_ACCUMULATORS
#undef MPUSIM_INSTANTIATE_LAUNCHERS

}  // namespace mpusim::cuda
