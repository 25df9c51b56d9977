// The GPU backend's row reductions (see device_kernels.h): the norms forward and backward
// (their pointwise math is core/ops/norm.h's), the causal softmax (core/ops/softmax.h), and the
// pieces of the vocab-parallel cross entropy (core/ops/cross_entropy.h); the rest of the
// kernels are in device_kernels.cu.
//
// A row kernel runs one block of kBlock threads per row and reduces with a shared-memory tree
// (BlockReduce, device_common.cuh), which fixes the summation order for a given row length
// (so repeated runs give identical bits). It reads everything its reductions need before the
// BlockReduce barrier and then writes only the elements each thread itself reads afterwards,
// which is what lets its output be its input (in place). Loads widen exactly and stores round
// once (ops::Load, ops::Store), as in every kernel of this backend.
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/half.h"
#include "core/ops/cross_entropy.h"
#include "core/ops/norm.h"
#include "core/ops/softmax.h"
#include "core/ops/topk.h"
#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return b > a ? b : a;
  }
};

// --- normalization --------------------------------------------------------------------

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

// --- attention: the causal softmax ----------------------------------------------------

// Key k is visible to row i when k_pos[k] <= q_pos[i % sq] (core/kernels.h).
template <typename T>
__global__ void CausalSoftmaxForwardKernel(const T* scores, const int64_t* q_pos, int64_t sq,
                                           const int64_t* k_pos, int64_t rows, int64_t kv,
                                           ComputeOf<T> scale, ComputeOf<T> lowest, T* probs,
                                           ComputeOf<T>* lse) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* row = scores + i * kv;
    const int64_t q = q_pos[i % sq];
    C m = lowest;
    for (int64_t k = threadIdx.x; k < kv; k += kBlock) {
      if (ops::KeyVisible(k_pos[k], q)) m = MaxOp()(m, ops::SoftmaxLogit(Load(row[k]), scale));
    }
    m = BlockReduce(m, buf, MaxOp());
    C sum = 0;
    for (int64_t k = threadIdx.x; k < kv; k += kBlock) {
      if (ops::KeyVisible(k_pos[k], q)) {
        sum += ops::SoftmaxExp(ops::SoftmaxLogit(Load(row[k]), scale), m);
      }
    }
    sum = BlockReduce(sum, buf, SumOp());
    T* out = probs + i * kv;
    for (int64_t k = threadIdx.x; k < kv; k += kBlock) {
      // T{} is +0 for every storage type: masked keys are exactly zero, and so is a row that
      // sees no key (its sum is 0, and no exponential is taken).
      out[k] = ops::KeyVisible(k_pos[k], q)
                   ? Store<T>(ops::SoftmaxProb(ops::SoftmaxLogit(Load(row[k]), scale), m, sum))
                   : T{};
    }
    // A row that sees no key has m = -inf and sum = 0: its lse is -inf (m), without a log.
    if (lse != nullptr && threadIdx.x == 0) lse[i] = sum > 0 ? ops::SoftmaxLse(m, sum) : m;
  }
}

template <typename T>
__global__ void CausalSoftmaxFromLseKernel(const T* scores, const ComputeOf<T>* lse,
                                           const int64_t* q_pos, int64_t sq,
                                           const int64_t* k_pos, int64_t rows, int64_t kv,
                                           ComputeOf<T> scale, ComputeOf<T> none, T* probs) {
  using C = ComputeOf<T>;
  const int64_t n = rows * kv;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / kv, k = e % kv;
    const C l = lse[i];
    probs[e] = l != none && ops::KeyVisible(k_pos[k], q_pos[i % sq])
                   ? Store<T>(ops::SoftmaxExp(ops::SoftmaxLogit(Load(scores[e]), scale), l))
                   : T{};
  }
}

template <typename T>
__global__ void CausalSoftmaxBackwardKernel(const T* probs, const T* dprobs, const int64_t* q_pos,
                                            int64_t sq, const int64_t* k_pos, int64_t rows,
                                            int64_t kv, ComputeOf<T> scale,
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
        if (ops::KeyVisible(k_pos[k], q)) dot += Load(p[k]) * Load(dp[k]);
      }
    }
    // Every thread of the block reaches the barrier either way.
    dot = BlockReduce(dot, buf, SumOp());
    if (row_dot != nullptr) dot = row_dot[i];
    T* out = dscores + i * kv;
    for (int64_t k = threadIdx.x; k < kv; k += kBlock) {
      out[k] = ops::KeyVisible(k_pos[k], q)
                   ? Store<T>(ops::SoftmaxGrad(Load(p[k]), Load(dp[k]), dot, scale))
                   : T{};
    }
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

// --- cross entropy --------------------------------------------------------------------

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

// One thread per row: ops::TopKRow, the CPU's selection too.
template <typename T>
__global__ void TopKKernel(const T* scores, int64_t rows, int64_t n, int64_t k, T* values,
                           int64_t* indices) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  ops::TopKRow(scores + r * n, n, k, values + r * k, indices + r * k);
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

// --- launchers ------------------------------------------------------------------------

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

template <typename T>
void LaunchCausalSoftmaxForward(const T* scores, const int64_t* q_pos, int64_t sq,
                                const int64_t* k_pos, int64_t rows, int64_t kv,
                                ComputeOf<T> scale, T* probs, ComputeOf<T>* lse,
                                cudaStream_t stream) {
  if (rows <= 0 || kv <= 0) return;
  const ComputeOf<T> lowest = -static_cast<ComputeOf<T>>(INFINITY);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  CausalSoftmaxForwardKernel<T><<<grid, kBlock, 0, stream>>>(scores, q_pos, sq, k_pos, rows, kv,
                                                             scale, lowest, probs, lse);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchCausalSoftmaxFromLse(const T* scores, const ComputeOf<T>* lse, const int64_t* q_pos,
                                int64_t sq, const int64_t* k_pos, int64_t rows, int64_t kv,
                                ComputeOf<T> scale, T* probs, cudaStream_t stream) {
  const int64_t n = rows * kv;
  if (n <= 0) return;
  const ComputeOf<T> none = -static_cast<ComputeOf<T>>(INFINITY);
  CausalSoftmaxFromLseKernel<T><<<GridFor(n), kBlock, 0, stream>>>(scores, lse, q_pos, sq, k_pos,
                                                                  rows, kv, scale, none, probs);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchCausalSoftmaxBackward(const T* probs, const T* dprobs, const int64_t* q_pos,
                                 int64_t sq, const int64_t* k_pos, int64_t rows, int64_t kv,
                                 ComputeOf<T> scale, const ComputeOf<T>* row_dot, T* dscores,
                                 cudaStream_t stream) {
  if (rows <= 0 || kv <= 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  CausalSoftmaxBackwardKernel<T><<<grid, kBlock, 0, stream>>>(probs, dprobs, q_pos, sq, k_pos,
                                                              rows, kv, scale, row_dot, dscores);
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
void LaunchTopK(const T* scores, int64_t rows, int64_t n, int64_t k, T* values,
                int64_t* indices, cudaStream_t stream) {
  if (rows <= 0) return;
  constexpr int64_t kThreads = 128;
  const auto grid = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  TopKKernel<T><<<grid, kThreads, 0, stream>>>(scores, rows, n, k, values, indices);
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

// Every storage type (C = ComputeOf<T>), and the norms' backward for every accumulator type
// A of it.
#define MPUSIM_INSTANTIATE_ROW_LAUNCHERS(T, C)                                               \
  template void LaunchNormForward<T>(const T*, const T*, const T*, int64_t, int64_t, C, T*,  \
                                     C*, C*, cudaStream_t);                                  \
  template void LaunchCausalSoftmaxForward<T>(const T*, const int64_t*, int64_t,             \
                                              const int64_t*, int64_t, int64_t, C, T*, C*,   \
                                              cudaStream_t);                                 \
  template void LaunchCausalSoftmaxFromLse<T>(const T*, const C*, const int64_t*, int64_t,   \
                                              const int64_t*, int64_t, int64_t, C, T*,       \
                                              cudaStream_t);                                 \
  template void LaunchCausalSoftmaxBackward<T>(const T*, const T*, const int64_t*, int64_t,  \
                                               const int64_t*, int64_t, int64_t, C,          \
                                               const C*, T*, cudaStream_t);                  \
  template void LaunchRowDot<T>(const T*, const T*, int64_t, int64_t, C*, cudaStream_t);     \
  template void LaunchLseMerge<T>(T*, C*, const T*, const C*, int64_t, int64_t,              \
                                  cudaStream_t);                                             \
  template void LaunchRowMax<T>(const T*, int64_t, int64_t, C*, cudaStream_t);               \
  template void LaunchTopK<T>(const T*, int64_t, int64_t, int64_t, T*, int64_t*, cudaStream_t); \
  template void LaunchCrossEntropyPartials<T>(const T*, const C*, const int64_t*, int64_t,   \
                                              int64_t, int64_t, C*, C*, C*, cudaStream_t);   \
  template void LaunchCrossEntropyBackward<T>(const T*, const C*, const C*, const int64_t*,  \
                                              int64_t, int64_t, int64_t, C, C, const C*, T*, \
                                              cudaStream_t);
#define MPUSIM_INSTANTIATE_NORM_BACKWARD(T, A, C)                                          \
  template void LaunchNormBackward<T, A>(const T*, const T*, const C*, const C*, const T*, \
                                         int64_t, int64_t, T*, A*, A*, cudaStream_t);

MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_ROW_LAUNCHERS)
MPUSIM_FOR_EACH_ACCUMULATOR(MPUSIM_INSTANTIATE_NORM_BACKWARD)

#undef MPUSIM_INSTANTIATE_NORM_BACKWARD
#undef MPUSIM_INSTANTIATE_ROW_LAUNCHERS

}  // namespace mpusim::cuda
