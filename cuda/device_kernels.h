// Device kernels of the GPU backend, behind plain host-callable launchers.
//
// What it is: one launcher per CUDA kernel (in cuda/kernels/<op>.cu, one file per op:
// algebra, activation, dropout, norm, softmax, rope, topk, embedding, cross_entropy,
// optimizer, strided_copy), instantiated for the storage types T = double, float, BFloat16
// and Float16 (core/half.h). Each takes raw device pointers, sizes and the stream, enqueues
// the kernel and checks cudaGetLastError. Every formula is written in the same order as the
// CPU reference (sim/eigen_kernels.cc, sim/eigen_reduce_kernels.cc) and the .cu files are
// compiled with --fmad=false, so elementwise results round exactly like the CPU where the
// math functions agree.
//
// Dtypes (core/kernels.h): a kernel computes in C = ComputeOf<T> (double for double, float
// otherwise). It widens each loaded element to C exactly (ToFloat), evaluates the float32
// formula, and rounds each stored element once (FromFloat<T>, the shared round-to-nearest-
// even of core/half.h, never CUDA's own conversions), so for float and double nothing
// changes and for 16-bit storage the CPU and the GPU store the same bits for the same
// float32 value. Accumulators (Axpy's y, SumRows' out, EmbeddingBackward's dweight, the
// norms' dweight and dbias) have their own storage type A: T or C. Cross-entropy statistics
// (row_max, sum_exp, sum_z, target_z, row_scale) and the norms' mean and rstd are always C;
// scalars are passed as C.
//
// Row kernels (RowMax, the cross-entropy partials, the norms, the causal softmax) run one
// block per row and reduce with a shared-memory tree; elementwise ones (SwiGLU, Rope,
// DropoutAt, StridedCopy) one thread per element (or rotated pair) in a grid-stride loop.
// What it is not: argument checking (CudaKernels in cuda_kernels.h checks every call
// first) or anything that allocates memory (EmbeddingBackward's sort gets its scratch from
// the caller). A launcher with nothing to do (n == 0) enqueues nothing: a launch with zero
// blocks is an error in CUDA.
//
// This header is plain C++ (no CUDA syntax), so host files compiled by the C++ compiler
// with the project's warnings can include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "core/half.h"
#include "core/ops/activation.h"
#include "core/ops/dropout.h"
#include "core/optimizer_update.h"

namespace mpusim::cuda {

// The type a kernel on storage type T computes in: double for double, float otherwise
// (core/ops/element.h).
using ops::ComputeOf;

// out[e] = RoundTo<D>(Widen(in[e])) (core/half.h), for any two storage types.
template <typename S, typename D>
void LaunchConvert(const S* in, D* out, int64_t n, cudaStream_t stream);

// x[e] = round(alpha * x[e]).
template <typename T>
void LaunchScale(T* x, int64_t n, ComputeOf<T> alpha, cudaStream_t stream);

// y[e] = round(y[e] + alpha * x[e]); A is T or ComputeOf<T>.
template <typename T, typename A>
void LaunchAxpy(const T* x, A* y, int64_t n, ComputeOf<T> alpha, cudaStream_t stream);

// y[i, j] = round(y[i, j] + bias[j]) on a rows x cols matrix.
template <typename T>
void LaunchAddRowVector(const T* bias, T* y, int64_t rows, int64_t cols, cudaStream_t stream);

// out[j] = round((beta == 0 ? 0 : beta == 1 ? out[j] : out[j] * beta) + sum_i x[i, j]); the
// sum runs in ComputeOf<T> over i = 0, 1, ... in order (one thread per column); A is T or
// ComputeOf<T>.
template <typename T, typename A>
void LaunchSumRows(const T* x, int64_t rows, int64_t cols, double beta, A* out,
                   cudaStream_t stream);

// The activation `act` (core/ops/activation.h, its element functions run as they are):
// y has n elements and f columns; plain y = f(x) (y may be x), gated y = f(a) * b with
// x = [a | b] [n / f, 2f], with `glu`'s offset and clamp.
template <typename T>
void LaunchActivationForward(Activation act, const T* x, T* y, int64_t n, int64_t f, GluOptions glu,
                             cudaStream_t stream);

// dy has n elements and f columns; plain dx = dy * f'(x) (dx may be x or dy), gated
// dx = [dy * b * f'(a) | dy * f(a)] (dx may be x; zero where `glu` clamped).
template <typename T>
void LaunchActivationBackward(Activation act, const T* x, const T* dy, T* dx, int64_t n, int64_t f,
                              GluOptions glu, cudaStream_t stream);

// y[e] = op(x[e], offset + e) (ops::Dropout, core/ops/dropout.h: the CPU's definition); y
// may be x.
template <typename T>
void LaunchDropout(const T* x, T* y, int64_t n, ops::Dropout op, uint64_t offset,
                   cudaStream_t stream);

// core/dropout.h's GlobalIndexMap in plain arrays, for a kernel argument: element e of the
// local tensor is element ops::MapIndex(base, dims, strides, e) of the full tensor.
struct IndexMap {
  int64_t base;
  int64_t dims[3];
  int64_t strides[3];
};

// y[e] = op(x[e], MapIndex(map, e)); y may be x.
template <typename T>
void LaunchDropoutAt(const T* x, T* y, int64_t n, ops::Dropout op, IndexMap map,
                     cudaStream_t stream);

// Both norms, one block per row of x [rows, cols]; the pointwise parts (r, xhat, y) are
// core/ops/norm.h's functors, which the CPU runs too. A centered norm when mean is given:
//   m = sum x / cols, var = sum (x - m)^2 / cols, r = 1 / sqrt(var + eps),
//   y = round(((x - m) * r) * weight + bias);
// the uncentered one when mean is null: m = 0 and no bias (bias is null). mean (if given)
// and rstd receive m and r; y may be x.
template <typename T>
void LaunchNormForward(const T* x, const T* weight, const T* bias, int64_t rows, int64_t cols,
                       ComputeOf<T> eps, T* y, ComputeOf<T>* mean, ComputeOf<T>* rstd,
                       cudaStream_t stream);

// Both norms' backward (mean null: the uncentered one, and dbias is null too), with
// xhat = (x - m) * r and g = dy * weight (core/ops/norm.h's functors, as every pointwise part
// of dx, dweight and dbias). Two kernels, in this order:
//   columns  one thread per column sums dy * xhat (and dy) over the rows in row order and
//            adds the sum to dweight (dbias) once: dweight[j] = round(dweight[j] + sum);
//   rows     one block per row: dx = round(r * (g - mean(g) - xhat * mean(g * xhat))),
//            mean(g) = 0 for the uncentered norm.
// The column pass reads dy before the row pass overwrites it, so dx may be dy. A is T or
// ComputeOf<T>.
template <typename T, typename A>
void LaunchNormBackward(const T* x, const T* weight, const ComputeOf<T>* mean,
                        const ComputeOf<T>* rstd, const T* dy, int64_t rows, int64_t cols, T* dx,
                        A* dweight, A* dbias, cudaStream_t stream);

// One block per row of scores [rows, kv], query position q = q_pos[row % sq], key k visible
// when k_pos[k] <= q (and q - k_pos[k] <= window for window >= 0), z = scale * s: probs =
// round(exp(z - m) / sum_visible exp(z_k - m)) for visible k (m the max over them), +0 for
// the others (a row that sees none is all +0). With sink non-null (heads logits) the row's
// sink o = sink[(row / sq) % heads] enters m (max) and the sum (exp(o - m)). probs may be
// scores. The positions are int64 device arrays.
// With lse non-null also lse[row] = m + log(sum), -inf for a row that sees no key (nor sink).
template <typename T>
void LaunchCausalSoftmaxForward(const T* scores, const int64_t* q_pos, int64_t sq,
                                const int64_t* k_pos, int64_t rows, int64_t kv, ComputeOf<T> scale,
                                int64_t window, const T* sink, int64_t heads, T* probs,
                                ComputeOf<T>* lse, cudaStream_t stream);

// One thread per element of scores [rows, kv]: probs = round(exp(scale * s - lse[row])) for
// visible k, +0 for the others and for a row whose lse is -inf. probs may be scores.
template <typename T>
void LaunchCausalSoftmaxFromLse(const T* scores, const ComputeOf<T>* lse, const int64_t* q_pos,
                                int64_t sq, const int64_t* k_pos, int64_t rows, int64_t kv,
                                ComputeOf<T> scale, int64_t window, T* probs, cudaStream_t stream);

// One block per row: dscores = round(scale * (p * (dp - dot))) for visible k, +0 for the
// others, dot = sum_visible p dp, or row_dot[row] when row_dot is non-null. dscores may be
// probs or dprobs.
template <typename T>
void LaunchCausalSoftmaxBackward(const T* probs, const T* dprobs, const int64_t* q_pos, int64_t sq,
                                 const int64_t* k_pos, int64_t rows, int64_t kv, ComputeOf<T> scale,
                                 int64_t window, const ComputeOf<T>* row_dot, T* dscores,
                                 cudaStream_t stream);

// One block per head h of sink [heads]: dsink[h] += sum over the rows r of h (r / sq %
// heads == h) of -exp(sink[h] - lse[r]) row_dot[r] (core/kernels.h SoftmaxSinkGrad), in
// ComputeOf<T>, rounded once into the accumulator A.
template <typename T, typename A>
void LaunchSoftmaxSinkGrad(const T* sink, int64_t heads, const ComputeOf<T>* lse,
                           const ComputeOf<T>* row_dot, int64_t rows, int64_t sq, A* dsink,
                           cudaStream_t stream);

// One block per row of a, b [rows, cols]: out[row] = sum_c a b in ComputeOf<T>.
template <typename T>
void LaunchRowDot(const T* a, const T* b, int64_t rows, int64_t cols, ComputeOf<T>* out,
                  cudaStream_t stream);

// One block per row of out, part [rows, d] (core/kernels.h LseMerge): n = log(exp(lse) +
// exp(part_lse)) taken around their max, out = round(out exp(lse - n) + part exp(part_lse -
// n)), lse = n; a part_lse of -inf leaves the row, a lse of -inf takes the part.
template <typename T>
void LaunchLseMerge(T* out, ComputeOf<T>* lse, const T* part, const ComputeOf<T>* part_lse,
                    int64_t rows, int64_t d, cudaStream_t stream);

// One thread per rotated pair (row r, i < dim/2) of x [rows, d]: theta = pos[r % sq] *
// base^(-2i/dim) in double, c = cos theta and s = +-sin theta (- when inverse) rounded to
// ComputeOf<T>, y[i] = round(x[i] c - x[i + dim/2] s), y[i + dim/2] = round(x[i + dim/2] c +
// x[i] s); columns >= dim copied when y is not x. y may be x.
template <typename T>
void LaunchRope(const T* x, int64_t rows, int64_t d, int64_t dim, const int64_t* pos,
                int64_t sq, double base, bool inverse, T* y, cudaStream_t stream);

// The dimensions of a StridedCopyPlan: Kernels::kMaxCopyDims (cuda_kernels.cc asserts it).
constexpr int kCopyPlanDims = 6;

// A strided copy's index space, padded at the front to kCopyPlanDims dimensions (size 1,
// strides 0); count = the product of dims (> 0).
struct StridedCopyPlan {
  int64_t dims[kCopyPlanDims];
  int64_t src_strides[kCopyPlanDims];
  int64_t dst_strides[kCopyPlanDims];
  int64_t count;
};

// dst[sum_k i_k dst_strides[k]] = src[sum_k i_k src_strides[k]] for every index tuple, one
// thread per tuple; src and dst point at the first element (offsets applied). U is
// uint16_t, uint32_t or uint64_t, an unsigned integer of the element's size: the copy moves
// bits, never values.
template <typename U>
void LaunchStridedCopy(const U* src, U* dst, const StridedCopyPlan& plan, cudaStream_t stream);

// out[i, :] = weight[ids[i] - vocab_start, :] when vocab_start <= ids[i] < vocab_end, else 0
// (a copy of the stored bits).
template <typename T>
void LaunchEmbeddingForward(const T* weight, const int64_t* ids, int64_t num_ids, int64_t cols,
                            int64_t vocab_start, int64_t vocab_end, T* out, cudaStream_t stream);

// The device scratch, in bytes, LaunchEmbeddingBackward needs for num_ids ids and a shard of
// vocab_rows rows (0 when there is nothing to do). Enqueues nothing.
size_t EmbeddingBackwardScratchBytes(int64_t num_ids, int64_t vocab_rows);

// dweight[ids[i] - vocab_start, :] += dy[i, :] for the ids inside [vocab_start, vocab_end),
// with the ids read on the device (no host round trip). The tokens are grouped by the local
// row they update on the device: a stable radix sort of (row, token) pairs, in which an id
// outside the shard gets the key vocab_end - vocab_start and sorts last. Then one thread per
// (sorted position, column) that starts a run of one row adds dy[token, column] for the
// run's tokens in increasing token order: no atomics, deterministic, and the same additions
// in the same order as the CPU's loop over tokens, so the result is bit-identical. Each
// addition is a ComputeOf<T> one rounded to A, like the CPU's, which stores after every
// token: a 16-bit dweight rounds once per token, a float32 one is a plain float32 sum. A is
// T or ComputeOf<T>. `scratch` holds EmbeddingBackwardScratchBytes(num_ids, vocab_end -
// vocab_start) bytes of device memory, which stream order keeps to this call.
template <typename T, typename A>
void LaunchEmbeddingBackward(const T* dy, const int64_t* ids, int64_t num_ids, int64_t cols,
                             int64_t vocab_start, int64_t vocab_end, A* dweight, void* scratch,
                             cudaStream_t stream);

// Per row of scores [rows, n], its k largest in core/ops/topk.h's order: values [rows, k]
// (the stored bits) and indices [rows, k]. One thread per row, k selection passes.
template <typename T>
void LaunchTopK(const T* scores, int64_t rows, int64_t n, int64_t k, T* values,
                int64_t* indices, cudaStream_t stream);

// row_max[i] = max_j logits[i, j] (-inf for a row with no columns). One block per row.
template <typename T>
void LaunchRowMax(const T* logits, int64_t rows, int64_t cols, ComputeOf<T>* row_max,
                  cudaStream_t stream);

// Per row i (one block per row), with z = logits[i, :] - row_max[i] in ComputeOf<T>:
// sum_exp[i] = sum exp(z), sum_z[i] = sum z, target_z[i] = z[labels[i] - vocab_start] if
// that column is in [0, cols), else 0.
template <typename T>
void LaunchCrossEntropyPartials(const T* logits, const ComputeOf<T>* row_max,
                                const int64_t* labels, int64_t rows, int64_t cols,
                                int64_t vocab_start, ComputeOf<T>* sum_exp, ComputeOf<T>* sum_z,
                                ComputeOf<T>* target_z, cudaStream_t stream);

// grad[i, j] = round(row_scale[i] * (exp(logits[i, j] - row_max[i]) / sum_exp[i] - q)) with
// q = on_value at the label column, off_value elsewhere; grad may be logits.
template <typename T>
void LaunchCrossEntropyBackward(const T* logits, const ComputeOf<T>* row_max,
                                const ComputeOf<T>* sum_exp, const int64_t* labels, int64_t rows,
                                int64_t cols, int64_t vocab_start, ComputeOf<T> on_value,
                                ComputeOf<T> off_value, const ComputeOf<T>* row_scale, T* grad,
                                cudaStream_t stream);

// --- optimizer ------------------------------------------------------------------------

// For every e < n: update(grad[e], master[e], state1[e], state2[e]) in double (the functor
// of core/optimizer_update.h, the CPU's too), then param[e] = RoundTo<P>(master[e]). G and
// P are any storage type (the gradient's and the parameter's), M float or double (the
// master's); each state is M or bfloat16 (OptimizerUpdate::Moment); state2's data may be
// null (sgd).
template <typename G, typename M, typename P>
void LaunchOptimizerStep(const OptimizerUpdate& update, const G* grad, M* master,
                         OptimizerUpdate::Moment<M> state1, OptimizerUpdate::Moment<M> state2,
                         P* param, int64_t n, cudaStream_t stream);

// The same with store_param_remainders (OptimizerUpdate::ApplyWithRemainder): remainder is
// the int16 remainder's bits, param the bf16 parameter, read and written; G any storage type.
template <typename G>
void LaunchOptimizerStepWithRemainder(const OptimizerUpdate& update, const G* grad,
                                      BFloat16* remainder, OptimizerUpdate::Moment<float> state1,
                                      OptimizerUpdate::Moment<float> state2, BFloat16* param,
                                      int64_t n, cudaStream_t stream);

// A float16 state's scaling (core/optimizer_update.h ScaledFloat16): out[e] =
// Unscale(q[e], scale[0]); and scale[0] = ScaleOf(max |x|) (one block, a fixed order) then
// q[e] = Quantize(x[e], ReciprocalOf(scale[0])). scale lives on the device.
void LaunchUnscaleState(const Float16* q, const float* scale, float* out, int64_t n,
                        cudaStream_t stream);
void LaunchScaleState(const float* x, float* scale, Float16* q, int64_t n, cudaStream_t stream);

// out[0] += sum_e x[e]^2, accumulated in double by one block in a fixed order (each thread
// its grid-stride elements, then a tree), so the same input gives the same bits every time.
template <typename T>
void LaunchSumOfSquares(const T* x, int64_t n, double* out, cudaStream_t stream);

}  // namespace mpusim::cuda

