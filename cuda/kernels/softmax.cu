// The GPU backend's causal softmax (forward, from the log-sum-exp, backward; sliding windows
// and attention sinks, the sinks' gradient) and context
// parallelism's ring pieces (the row dots, the log-sum-exp merge): core/ops/softmax.h's
// pointwise math.
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

#include "core/ops/softmax.h"
#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

// Key k is visible to row i when k_pos[k] <= q_pos[i % sq], and with a window w >= 0 also
// q_pos[i % sq] - k_pos[k] <= w (core/kernels.h). A sink's logit enters the max and the sum.
template <typename T>
__global__ void CausalSoftmaxForwardKernel(const T* scores, const int64_t* q_pos, int64_t sq,
                                           const int64_t* k_pos, int64_t rows, int64_t kv,
                                           ComputeOf<T> scale, int64_t window, const T* sink,
                                           int64_t heads, ComputeOf<T> lowest, T* probs,
                                           ComputeOf<T>* lse) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* row = scores + i * kv;
    const int64_t q = q_pos[i % sq];
    C m = lowest;
    for (int64_t k = threadIdx.x; k < kv; k += kBlock) {
      if (ops::KeyVisible(k_pos[k], q, window)) {
        m = MaxOp()(m, ops::SoftmaxLogit(Load(row[k]), scale));
      }
    }
    m = BlockReduce(m, buf, MaxOp());
    const C o = sink != nullptr ? Load(sink[(i / sq) % heads]) : lowest;
    if (sink != nullptr) m = MaxOp()(m, o);
    C sum = 0;
    for (int64_t k = threadIdx.x; k < kv; k += kBlock) {
      if (ops::KeyVisible(k_pos[k], q, window)) {
        sum += ops::SoftmaxExp(ops::SoftmaxLogit(Load(row[k]), scale), m);
      }
    }
    sum = BlockReduce(sum, buf, SumOp());
    if (sink != nullptr) sum += ops::SoftmaxExp(o, m);  // the sink's term last
    T* out = probs + i * kv;
    for (int64_t k = threadIdx.x; k < kv; k += kBlock) {
      // T{} is +0 for every storage type: masked keys are exactly zero, and so is a row that
      // sees no key (its sum is 0, and no exponential is taken).
      out[k] = ops::KeyVisible(k_pos[k], q, window)
                   ? Store<T>(ops::SoftmaxProb(ops::SoftmaxLogit(Load(row[k]), scale), m, sum))
                   : T{};
    }
    // A row that sees no key has m = -inf and sum = 0: its lse is -inf (m), without a log.
    if (lse != nullptr && threadIdx.x == 0) lse[i] = sum > 0 ? ops::SoftmaxLse(m, sum) : m;
  }
}

template <typename T>
__global__ void CausalSoftmaxFromLseKernel(const T* scores, const ComputeOf<T>* lse,
                                           const int64_t* q_pos, int64_t sq, const int64_t* k_pos,
                                           int64_t rows, int64_t kv, ComputeOf<T> scale,
                                           int64_t window, ComputeOf<T> none, T* probs) {
  using C = ComputeOf<T>;
  const int64_t n = rows * kv;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / kv, k = e % kv;
    const C l = lse[i];
    probs[e] = l != none && ops::KeyVisible(k_pos[k], q_pos[i % sq], window)
                   ? Store<T>(ops::SoftmaxExp(ops::SoftmaxLogit(Load(scores[e]), scale), l))
                   : T{};
  }
}

template <typename T>
__global__ void CausalSoftmaxBackwardKernel(const T* probs, const T* dprobs, const int64_t* q_pos,
                                            int64_t sq, const int64_t* k_pos, int64_t rows,
                                            int64_t kv, ComputeOf<T> scale, int64_t window,
                                            const ComputeOf<T>* row_dot, T* dscores) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* p = probs + i * kv;
    const T* dp = dprobs + i * kv;
    const int64_t q = q_pos[i % sq];
    C dot = 0;
    if (row_dot == nullptr) {
      for (int64_t k = threadIdx.x; k < kv; k += kBlock) {
        if (ops::KeyVisible(k_pos[k], q, window)) dot += Load(p[k]) * Load(dp[k]);
      }
    }
    // Every thread of the block reaches the barrier either way.
    dot = BlockReduce(dot, buf, SumOp());
    if (row_dot != nullptr) dot = row_dot[i];
    T* out = dscores + i * kv;
    for (int64_t k = threadIdx.x; k < kv; k += kBlock) {
      out[k] = ops::KeyVisible(k_pos[k], q, window)
                   ? Store<T>(ops::SoftmaxGrad(Load(p[k]), Load(dp[k]), dot, scale))
                   : T{};
    }
  }
}

// One block per head: its rows' -exp(o - lse) dot summed by the block tree, then added to
// the head's accumulator.
template <typename T, typename A>
__global__ void SoftmaxSinkGradKernel(const T* sink, int64_t heads, const ComputeOf<T>* lse,
                                      const ComputeOf<T>* row_dot, int64_t rows, int64_t sq,
                                      A* dsink) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  for (int64_t h = blockIdx.x; h < heads; h += gridDim.x) {
    const C o = Load(sink[h]);
    C sum = 0;
    for (int64_t r = threadIdx.x; r < rows; r += kBlock) {
      if ((r / sq) % heads == h) sum += ops::SinkGradTerm(o, lse[r], row_dot[r]);
    }
    sum = BlockReduce(sum, buf, SumOp());
    if (threadIdx.x == 0) dsink[h] = Store<A>(Load(dsink[h]) + sum);
  }
}

// --- context parallelism's ring: row dots and the log-sum-exp merge ------------------

template <typename T>
__global__ void RowDotKernel(const T* a, const T* b, int64_t rows, int64_t cols,
                             ComputeOf<T>* out) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    C sum = 0;
    for (int64_t j = threadIdx.x; j < cols; j += kBlock) {
      sum += Load(a[i * cols + j]) * Load(b[i * cols + j]);
    }
    sum = BlockReduce(sum, buf, SumOp());
    if (threadIdx.x == 0) out[i] = sum;
  }
}

template <typename T>
__global__ void LseMergeKernel(T* out, ComputeOf<T>* lse, const T* part,
                               const ComputeOf<T>* part_lse, int64_t rows, int64_t d,
                               ComputeOf<T> none) {
  using C = ComputeOf<T>;
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const C l = lse[i], pl = part_lse[i];
    if (pl == none) continue;  // the block showed this row no key
    // A running lse of -inf takes the part whole: 0 * 0 + part * 1.
    const ops::LseMergeWeights<C> w =
        l != none ? ops::LseMergeOf(l, pl) : ops::LseMergeWeights<C>{pl, C(0), C(1)};
    for (int64_t j = threadIdx.x; j < d; j += kBlock) {
      const C o = l == none ? C(0) : Load(out[i * d + j]);
      out[i * d + j] = Store<T>(ops::LseMerged(o, Load(part[i * d + j]), w));
    }
    // Every thread has read lse[i] before the block's first thread writes it.
    __syncthreads();
    if (threadIdx.x == 0) lse[i] = w.lse;
  }
}

}  // namespace

template <typename T>
void LaunchCausalSoftmaxForward(const T* scores, const int64_t* q_pos, int64_t sq,
                                const int64_t* k_pos, int64_t rows, int64_t kv, ComputeOf<T> scale,
                                int64_t window, const T* sink, int64_t heads, T* probs,
                                ComputeOf<T>* lse, cudaStream_t stream) {
  if (rows <= 0 || kv <= 0) return;
  const ComputeOf<T> lowest = -static_cast<ComputeOf<T>>(INFINITY);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  CausalSoftmaxForwardKernel<T><<<grid, kBlock, 0, stream>>>(
      scores, q_pos, sq, k_pos, rows, kv, scale, window, sink, heads, lowest, probs, lse);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchCausalSoftmaxFromLse(const T* scores, const ComputeOf<T>* lse, const int64_t* q_pos,
                                int64_t sq, const int64_t* k_pos, int64_t rows, int64_t kv,
                                ComputeOf<T> scale, int64_t window, T* probs, cudaStream_t stream) {
  const int64_t n = rows * kv;
  if (n <= 0) return;
  const ComputeOf<T> none = -static_cast<ComputeOf<T>>(INFINITY);
  CausalSoftmaxFromLseKernel<T><<<GridFor(n), kBlock, 0, stream>>>(
      scores, lse, q_pos, sq, k_pos, rows, kv, scale, window, none, probs);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchCausalSoftmaxBackward(const T* probs, const T* dprobs, const int64_t* q_pos, int64_t sq,
                                 const int64_t* k_pos, int64_t rows, int64_t kv, ComputeOf<T> scale,
                                 int64_t window, const ComputeOf<T>* row_dot, T* dscores,
                                 cudaStream_t stream) {
  if (rows <= 0 || kv <= 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  CausalSoftmaxBackwardKernel<T><<<grid, kBlock, 0, stream>>>(probs, dprobs, q_pos, sq, k_pos, rows,
                                                              kv, scale, window, row_dot, dscores);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename A>
void LaunchSoftmaxSinkGrad(const T* sink, int64_t heads, const ComputeOf<T>* lse,
                           const ComputeOf<T>* row_dot, int64_t rows, int64_t sq, A* dsink,
                           cudaStream_t stream) {
  if (heads <= 0 || rows <= 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(heads, kMaxBlocks));
  SoftmaxSinkGradKernel<T, A>
      <<<grid, kBlock, 0, stream>>>(sink, heads, lse, row_dot, rows, sq, dsink);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}
template <typename T>
void LaunchRowDot(const T* a, const T* b, int64_t rows, int64_t cols, ComputeOf<T>* out,
                  cudaStream_t stream) {
  if (rows <= 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  RowDotKernel<T><<<grid, kBlock, 0, stream>>>(a, b, rows, cols, out);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchLseMerge(T* out, ComputeOf<T>* lse, const T* part, const ComputeOf<T>* part_lse,
                    int64_t rows, int64_t d, cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return;
  const ComputeOf<T> none = -static_cast<ComputeOf<T>>(INFINITY);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  LseMergeKernel<T><<<grid, kBlock, 0, stream>>>(out, lse, part, part_lse, rows, d, none);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

#define MPUSIM_INSTANTIATE_SOFTMAX(T, C)                                                           \
  template void LaunchCausalSoftmaxForward<T>(const T*, const int64_t*, int64_t, const int64_t*,   \
                                              int64_t, int64_t, C, int64_t, const T*, int64_t, T*, \
                                              C*, cudaStream_t);                                   \
  template void LaunchCausalSoftmaxFromLse<T>(const T*, const C*, const int64_t*, int64_t,         \
                                              const int64_t*, int64_t, int64_t, C, int64_t, T*,    \
                                              cudaStream_t);                                       \
  template void LaunchCausalSoftmaxBackward<T>(const T*, const T*, const int64_t*, int64_t,        \
                                               const int64_t*, int64_t, int64_t, C, int64_t,       \
                                               const C*, T*, cudaStream_t);                        \
  template void LaunchRowDot<T>(const T*, const T*, int64_t, int64_t, C*, cudaStream_t);           \
  template void LaunchLseMerge<T>(T*, C*, const T*, const C*, int64_t, int64_t, cudaStream_t);
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_SOFTMAX)
#undef MPUSIM_INSTANTIATE_SOFTMAX
#define MPUSIM_INSTANTIATE_SINK_GRAD(T, A, C)                                               \
  template void LaunchSoftmaxSinkGrad<T, A>(const T*, int64_t, const C*, const C*, int64_t, \
                                            int64_t, A*, cudaStream_t);
MPUSIM_FOR_EACH_ACCUMULATOR(MPUSIM_INSTANTIATE_SINK_GRAD)
#undef MPUSIM_INSTANTIATE_SINK_GRAD

}  // namespace mpusim::cuda
