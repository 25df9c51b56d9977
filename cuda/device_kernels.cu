// CUDA kernels of the GPU backend (see device_kernels.h).
//
// Plain, readable kernels: elementwise ops are grid-stride loops over int64 indices (any
// size, at most kMaxBlocks blocks); row reductions (RowMax, cross entropy, the norms, the
// causal softmax) use one block of kBlock threads per row with a shared-memory tree, which
// fixes the summation order for a given row length (so repeated runs give identical bits).
// A row kernel reads everything its reductions need before the BlockReduce barrier and then
// writes only the elements each thread itself reads afterwards, which is what lets its
// output be its input (in place). Correctness and determinism over speed: cuBLAS does
// the heavy lifting (GEMMs), these kernels move O(elements) data.
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
#include "core/ops/norm.h"
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

// --- attention ------------------------------------------------------------------------

template <typename T>
__global__ void CausalSoftmaxForwardKernel(const T* scores, int64_t rows, int64_t seq,
                                           ComputeOf<T> scale, ComputeOf<T> lowest, T* probs) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* row = scores + i * seq;
    const int64_t visible = i % seq + 1;  // keys 0..q
    C m = lowest;
    for (int64_t k = threadIdx.x; k < visible; k += kBlock) {
      m = MaxOp()(m, scale * Load(row[k]));
    }
    m = BlockReduce(m, buf, MaxOp());
    C sum = 0;
    for (int64_t k = threadIdx.x; k < visible; k += kBlock) {
      sum += Exp(scale * Load(row[k]) - m);
    }
    sum = BlockReduce(sum, buf, SumOp());
    T* out = probs + i * seq;
    for (int64_t k = threadIdx.x; k < seq; k += kBlock) {
      // T{} is +0 for every storage type: masked keys are exactly zero.
      out[k] = k < visible ? Store<T>(Exp(scale * Load(row[k]) - m) / sum) : T{};
    }
  }
}

template <typename T>
__global__ void CausalSoftmaxBackwardKernel(const T* probs, const T* dprobs, int64_t rows,
                                            int64_t seq, ComputeOf<T> scale, T* dscores) {
  using C = ComputeOf<T>;
  __shared__ C buf[kBlock];
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* p = probs + i * seq;
    const T* dp = dprobs + i * seq;
    const int64_t visible = i % seq + 1;
    C dot = 0;
    for (int64_t k = threadIdx.x; k < visible; k += kBlock) {
      dot += Load(p[k]) * Load(dp[k]);
    }
    dot = BlockReduce(dot, buf, SumOp());
    T* out = dscores + i * seq;
    for (int64_t k = threadIdx.x; k < seq; k += kBlock) {
      out[k] = k < visible
                   ? Store<T>(scale * (Load(p[k]) * (Load(dp[k]) - dot)))
                   : T{};
    }
  }
}

template <typename T>
__global__ void RopeKernel(const T* x, int64_t rows, int64_t d, int64_t seq, double base,
                           bool inverse, T* y) {
  using C = ComputeOf<T>;
  const int64_t half = d / 2;
  const int64_t n = rows * half;
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    const int64_t r = e / half;
    const int64_t i = e % half;
    // The angle in double, as on the CPU; cos and sin rounded once to C.
    const double inv_freq = pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
    const double theta = static_cast<double>(r % seq) * inv_freq;
    const double sine = sin(theta);
    const C c = static_cast<C>(cos(theta));
    const C s = static_cast<C>(inverse ? -sine : sine);
    // This thread alone reads and writes the pair: y may be x.
    const C lo = Load(x[r * d + i]);
    const C hi = Load(x[r * d + half + i]);
    y[r * d + i] = Store<T>(lo * c - hi * s);
    y[r * d + half + i] = Store<T>(hi * c + lo * s);
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
      const C z = Load(row[j]) - m;
      se += Exp(z);
      sz += z;
    }
    se = BlockReduce(se, buf, SumOp());
    sz = BlockReduce(sz, buf, SumOp());
    if (threadIdx.x == 0) {
      sum_exp[i] = se;
      sum_z[i] = sz;
      const int64_t col = labels[i] - vocab_start;
      target_z[i] = col >= 0 && col < cols ? Load(row[col]) - m : C(0);
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
        Store<T>(row_scale[i] * (Exp(Load(logits[e]) - row_max[i]) / sum_exp[i] - q));
  }
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
void LaunchCausalSoftmaxForward(const T* scores, int64_t rows, int64_t seq, ComputeOf<T> scale,
                                T* probs, cudaStream_t stream) {
  if (rows <= 0 || seq <= 0) return;
  const ComputeOf<T> lowest = -static_cast<ComputeOf<T>>(INFINITY);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  CausalSoftmaxForwardKernel<T><<<grid, kBlock, 0, stream>>>(scores, rows, seq, scale, lowest,
                                                             probs);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchCausalSoftmaxBackward(const T* probs, const T* dprobs, int64_t rows, int64_t seq,
                                 ComputeOf<T> scale, T* dscores, cudaStream_t stream) {
  if (rows <= 0 || seq <= 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks));
  CausalSoftmaxBackwardKernel<T><<<grid, kBlock, 0, stream>>>(probs, dprobs, rows, seq, scale,
                                                              dscores);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchRope(const T* x, int64_t rows, int64_t d, int64_t seq, double base, bool inverse,
                T* y, cudaStream_t stream) {
  const int64_t n = rows * (d / 2);
  if (n <= 0) return;
  RopeKernel<T><<<GridFor(n), kBlock, 0, stream>>>(x, rows, d, seq, base, inverse, y);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
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
#define MPUSIM_INSTANTIATE_LAUNCHERS(T, C)                                                     \
  template void LaunchScale<T>(T*, int64_t, C, cudaStream_t);                                  \
  template void LaunchAddRowVector<T>(const T*, T*, int64_t, int64_t, cudaStream_t);           \
  template void LaunchActivationForward<T>(Activation, const T*, T*, int64_t, int64_t,         \
                                          cudaStream_t);                                       \
  template void LaunchActivationBackward<T>(Activation, const T*, const T*, T*, int64_t,       \
                                           int64_t, cudaStream_t);                             \
  template void LaunchDropout<T>(const T*, T*, int64_t, ops::Dropout, uint64_t,                \
                                 cudaStream_t);                                                \
  template void LaunchDropoutAt<T>(const T*, T*, int64_t, ops::Dropout, IndexMap,              \
                                   cudaStream_t);                                              \
  template void LaunchNormForward<T>(const T*, const T*, const T*, int64_t, int64_t, C, T*,    \
                                     C*, C*, cudaStream_t);                                    \
  template void LaunchCausalSoftmaxForward<T>(const T*, int64_t, int64_t, C, T*,               \
                                              cudaStream_t);                                   \
  template void LaunchCausalSoftmaxBackward<T>(const T*, const T*, int64_t, int64_t, C, T*,    \
                                               cudaStream_t);                                  \
  template void LaunchRope<T>(const T*, int64_t, int64_t, int64_t, double, bool, T*,           \
                              cudaStream_t);                                                   \
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
  template void LaunchEmbeddingBackward<T, A>(const T*, const int64_t*, int64_t, int64_t,        \
                                              int64_t, int64_t, A*, void*, cudaStream_t);        \
  template void LaunchNormBackward<T, A>(const T*, const T*, const C*, const C*, const T*,       \
                                         int64_t, int64_t, T*, A*, A*, cudaStream_t);

template void LaunchStridedCopy<uint16_t>(const uint16_t*, uint16_t*, const StridedCopyPlan&,
                                          cudaStream_t);
template void LaunchStridedCopy<uint32_t>(const uint32_t*, uint32_t*, const StridedCopyPlan&,
                                          cudaStream_t);
template void LaunchStridedCopy<uint64_t>(const uint64_t*, uint64_t*, const StridedCopyPlan&,
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
