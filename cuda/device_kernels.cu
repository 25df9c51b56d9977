// CUDA kernels of the GPU backend (see device_kernels.h): the elementwise ops, copies, RoPE,
// embedding and the optimizer. The row reductions (the norms, the causal softmax, the cross
// entropy's pieces) are in device_reduce_kernels.cu; what both files share is in
// device_common.cuh.
//
// Plain, readable kernels: elementwise ops are grid-stride loops over int64 indices (any
// size, at most kMaxBlocks blocks). Correctness and determinism over speed: cuBLAS does the
// heavy lifting (GEMMs), these kernels move O(elements) data.
//
// One body per op, templated on the storage type: loads go through ops::Load (exact
// widening), stores through ops::Store<T> (one rounding), both the identity for
// float and double, so the float32 and float64 kernels are exactly what they were.
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cub/device/device_radix_sort.cuh>

#include "core/half.h"
#include "core/ops/activation.h"
#include "core/ops/rope.h"
#include "core/philox.h"
#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

// --- elementwise ----------------------------------------------------------------------

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

template <typename A, typename T>
__global__ void ActivationForwardKernel(const T* x, T* y, int64_t n, int64_t f) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    ops::ActivationForwardAt<A>(x, y, e, f);
  }
}

// A gated A's thread alone reads and writes its pair (i, j), (i, f + j): dx may be x.
template <typename A, typename T>
__global__ void ActivationBackwardKernel(const T* x, const T* dy, T* dx, int64_t n, int64_t f) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    ops::ActivationBackwardAt<A>(x, dy, dx, e, f);
  }
}

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

// --- attention: RoPE ------------------------------------------------------------------

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

// --- strided copy ---------------------------------------------------------------------

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

// The sort's input: key = the local row of token e's id, or `outside` (the shard's row
// count, past every row) when another shard owns it; value = e.
__global__ void EmbeddingKeysKernel(const int64_t* ids, int64_t num_ids, int64_t vocab_start,
                                    int64_t vocab_end, uint64_t* rows, int64_t* tokens) {
  for (int64_t e = FirstIndex(); e < num_ids; e += GridStride()) {
    const int64_t id = ids[e];
    rows[e] = static_cast<uint64_t>(id >= vocab_start && id < vocab_end ? id - vocab_start
                                                                        : vocab_end - vocab_start);
    tokens[e] = e;
  }
}

// rows/tokens sorted by row (stably: tokens increase within a row). The thread of sorted
// position p and column j works only if p starts a run of one in-shard row; it then adds
// the run's gradients in token order.
template <typename T, typename A>
__global__ void EmbeddingBackwardKernel(const T* dy, const uint64_t* rows, const int64_t* tokens,
                                        int64_t num_ids, int64_t cols, uint64_t outside,
                                        A* dweight) {
  const int64_t n = num_ids * cols;
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    const int64_t p = e / cols;
    const int64_t j = e % cols;
    const uint64_t r = rows[p];
    if (r == outside || (p > 0 && rows[p - 1] == r)) continue;
    A* target = dweight + static_cast<int64_t>(r) * cols + j;
    // Each token's addition is rounded to A, as the CPU's loop stores after every token
    // (only a 16-bit A actually rounds).
    A acc = *target;
    for (int64_t q = p; q < num_ids && rows[q] == r; ++q) {
      acc = Store<A>(Load(acc) + Load(dy[tokens[q] * cols + j]));
    }
    *target = acc;
  }
}

// The pieces of EmbeddingBackward's scratch, each at a 256-byte boundary: the keys and
// values before and after the sort, then CUB's own temporary storage.
struct EmbeddingScratch {
  uint64_t* rows_in;
  uint64_t* rows_out;
  int64_t* tokens_in;
  int64_t* tokens_out;
  void* sort_temp;
  size_t sort_bytes;
  size_t total_bytes;
};

constexpr size_t kScratchAlign = 256;

size_t AlignUp(size_t bytes) { return (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

// Bits of the sort keys: enough for every value in [0, vocab_rows] (outside included).
int KeyBits(int64_t vocab_rows) {
  int bits = 1;
  while (bits < 63 && (int64_t{1} << bits) <= vocab_rows) ++bits;
  return bits;
}

// The layout over `base` (nullptr: only the sizes, for EmbeddingBackwardScratchBytes).
EmbeddingScratch LayOutEmbeddingScratch(void* base, int64_t num_ids, int64_t vocab_rows) {
  EmbeddingScratch s{};
  const size_t keys = AlignUp(static_cast<size_t>(num_ids) * sizeof(uint64_t));
  const size_t values = AlignUp(static_cast<size_t>(num_ids) * sizeof(int64_t));
  // CUB reports its temporary storage for these sizes without touching the pointers.
  MPUSIM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, s.sort_bytes, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
      static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr), num_ids, 0,
      KeyBits(vocab_rows)));
  s.total_bytes = 2 * keys + 2 * values + AlignUp(s.sort_bytes);
  if (base != nullptr) {
    auto* at = static_cast<unsigned char*>(base);
    s.rows_in = reinterpret_cast<uint64_t*>(at);
    s.rows_out = reinterpret_cast<uint64_t*>(at + keys);
    s.tokens_in = reinterpret_cast<int64_t*>(at + 2 * keys);
    s.tokens_out = reinterpret_cast<int64_t*>(at + 2 * keys + values);
    s.sort_temp = at + 2 * keys + 2 * values;
  }
  return s;
}

// --- optimizer ------------------------------------------------------------------------

template <typename G, typename M, typename P>
__global__ void OptimizerStepKernel(OptimizerUpdate update, const G* grad, M* master, M* state1,
                                    M* state2, P* param, int64_t n) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    update.Apply(grad, master, state1, state2, param, e);
  }
}

template <typename T>
__global__ void SumOfSquaresKernel(const T* x, int64_t n, double* out) {
  __shared__ double buf[kBlock];
  double sum = 0;
  for (int64_t e = threadIdx.x; e < n; e += kBlock) {
    const double value = static_cast<double>(x[e]);
    sum += value * value;
  }
  const double total = BlockReduce(sum, buf, [](double a, double b) { return a + b; });
  if (threadIdx.x == 0) out[0] += total;
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

// The kernels of the activation ops::VisitActivation picks (a visitor struct: C++17).
template <typename T>
struct ActivationForwardLaunch {
  const T* x;
  T* y;
  int64_t n, f;
  cudaStream_t stream;
  template <typename A>
  void operator()() const {
    ActivationForwardKernel<A, T><<<GridFor(n), kBlock, 0, stream>>>(x, y, n, f);
  }
};
template <typename T>
struct ActivationBackwardLaunch {
  const T* x;
  const T* dy;
  T* dx;
  int64_t n, f;
  cudaStream_t stream;
  template <typename A>
  void operator()() const {
    ActivationBackwardKernel<A, T><<<GridFor(n), kBlock, 0, stream>>>(x, dy, dx, n, f);
  }
};

template <typename T>
void LaunchActivationForward(Activation act, const T* x, T* y, int64_t n, int64_t f,
                             cudaStream_t stream) {
  if (n <= 0) return;
  ops::VisitActivation(act, ActivationForwardLaunch<T>{x, y, n, f, stream});
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchActivationBackward(Activation act, const T* x, const T* dy, T* dx, int64_t n,
                              int64_t f, cudaStream_t stream) {
  if (n <= 0) return;
  ops::VisitActivation(act, ActivationBackwardLaunch<T>{x, dy, dx, n, f, stream});
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

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

template <typename U>
void LaunchStridedCopy(const U* src, U* dst, const StridedCopyPlan& plan, cudaStream_t stream) {
  if (plan.count <= 0) return;
  StridedCopyKernel<U><<<GridFor(plan.count), kBlock, 0, stream>>>(src, dst, plan);
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

size_t EmbeddingBackwardScratchBytes(int64_t num_ids, int64_t vocab_rows) {
  if (num_ids <= 0 || vocab_rows <= 0) return 0;
  return LayOutEmbeddingScratch(nullptr, num_ids, vocab_rows).total_bytes;
}

template <typename T, typename A>
void LaunchEmbeddingBackward(const T* dy, const int64_t* ids, int64_t num_ids, int64_t cols,
                             int64_t vocab_start, int64_t vocab_end, A* dweight, void* scratch,
                             cudaStream_t stream) {
  const int64_t vocab_rows = vocab_end - vocab_start;
  if (num_ids <= 0 || cols <= 0 || vocab_rows <= 0) return;
  EmbeddingScratch s = LayOutEmbeddingScratch(scratch, num_ids, vocab_rows);
  EmbeddingKeysKernel<<<GridFor(num_ids), kBlock, 0, stream>>>(ids, num_ids, vocab_start, vocab_end,
                                                               s.rows_in, s.tokens_in);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
  MPUSIM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(s.sort_temp, s.sort_bytes, s.rows_in,
                                                    s.rows_out, s.tokens_in, s.tokens_out, num_ids,
                                                    0, KeyBits(vocab_rows), stream));
  const int64_t n = num_ids * cols;
  EmbeddingBackwardKernel<T, A><<<GridFor(n), kBlock, 0, stream>>>(
      dy, s.rows_out, s.tokens_out, num_ids, cols, static_cast<uint64_t>(vocab_rows), dweight);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename G, typename M, typename P>
void LaunchOptimizerStep(const OptimizerUpdate& update, const G* grad, M* master, M* state1,
                         M* state2, P* param, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  OptimizerStepKernel<G, M, P><<<GridFor(n), kBlock, 0, stream>>>(update, grad, master, state1,
                                                                   state2, param, n);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchSumOfSquares(const T* x, int64_t n, double* out, cudaStream_t stream) {
  if (n <= 0) return;
  SumOfSquaresKernel<T><<<1, kBlock, 0, stream>>>(x, n, out);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

// Every storage type, with C = ComputeOf<T>.
#define MPUSIM_INSTANTIATE_LAUNCHERS(T, C)                                                       \
  template void LaunchScale<T>(T*, int64_t, C, cudaStream_t);                                    \
  template void LaunchAddRowVector<T>(const T*, T*, int64_t, int64_t, cudaStream_t);             \
  template void LaunchActivationForward<T>(Activation, const T*, T*, int64_t, int64_t,           \
                                           cudaStream_t);                                        \
  template void LaunchActivationBackward<T>(Activation, const T*, const T*, T*, int64_t,         \
                                            int64_t, cudaStream_t);                              \
  template void LaunchDropout<T>(const T*, T*, int64_t, ops::Dropout, uint64_t, cudaStream_t);   \
  template void LaunchDropoutAt<T>(const T*, T*, int64_t, ops::Dropout, IndexMap, cudaStream_t); \
  template void LaunchRope<T>(const T*, int64_t, int64_t, int64_t, const int64_t*, int64_t,      \
                              double, bool, T*,                                                  \
                              cudaStream_t);                                                     \
  template void LaunchEmbeddingForward<T>(const T*, const int64_t*, int64_t, int64_t, int64_t,   \
                                          int64_t, T*, cudaStream_t);

// The accumulating launchers, for inputs of storage type T into an accumulator of type A
// (T itself, or the compute type C of a 16-bit T).
#define MPUSIM_INSTANTIATE_ACCUMULATORS(T, A, C)                                           \
  template void LaunchAxpy<T, A>(const T*, A*, int64_t, C, cudaStream_t);                  \
  template void LaunchSumRows<T, A>(const T*, int64_t, int64_t, double, A*, cudaStream_t); \
  template void LaunchEmbeddingBackward<T, A>(const T*, const int64_t*, int64_t, int64_t,  \
                                              int64_t, int64_t, A*, void*, cudaStream_t);

template void LaunchStridedCopy<uint16_t>(const uint16_t*, uint16_t*, const StridedCopyPlan&,
                                          cudaStream_t);
template void LaunchStridedCopy<uint32_t>(const uint32_t*, uint32_t*, const StridedCopyPlan&,
                                          cudaStream_t);
template void LaunchStridedCopy<uint64_t>(const uint64_t*, uint64_t*, const StridedCopyPlan&,
                                          cudaStream_t);
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_LAUNCHERS)
MPUSIM_FOR_EACH_ACCUMULATOR(MPUSIM_INSTANTIATE_ACCUMULATORS)

// The optimizer: gradient type G and master type M (float or double), parameter type P.
#define MPUSIM_INSTANTIATE_OPTIMIZER(G, M, P)                                                   \
  template void LaunchOptimizerStep<G, M, P>(const OptimizerUpdate&, const G*, M*, M*, M*, P*, \
                                             int64_t, cudaStream_t);
#define MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(G, M)  \
  MPUSIM_INSTANTIATE_OPTIMIZER(G, M, double)       \
  MPUSIM_INSTANTIATE_OPTIMIZER(G, M, float)        \
  MPUSIM_INSTANTIATE_OPTIMIZER(G, M, BFloat16)     \
  MPUSIM_INSTANTIATE_OPTIMIZER(G, M, Float16)
MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(float, float)
MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(float, double)
MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(double, float)
MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(double, double)
template void LaunchSumOfSquares<float>(const float*, int64_t, double*, cudaStream_t);
template void LaunchSumOfSquares<double>(const double*, int64_t, double*, cudaStream_t);

#undef MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS
#undef MPUSIM_INSTANTIATE_OPTIMIZER
#undef MPUSIM_INSTANTIATE_ACCUMULATORS
#undef MPUSIM_INSTANTIATE_LAUNCHERS

}  // namespace mpusim::cuda
