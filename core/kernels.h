// Kernels: the compute a backend supplies to core/model/graph.
//
// Every tensor argument lives on the backend's device (host for sim/, GPU for cuda/) and is
// dense row-major; "2-D" means the Tensor::rows() x Tensor::cols() view. Names and argument
// order are the same in every backend: outputs last.
//
// Dtypes. float64, float32, bfloat16 and float16 are supported. int64 is for the ids and
// labels of the embedding and cross-entropy kernels; the memory operations (Zeros, Empty,
// ToDevice, ToHost, Copy, SetZero, CopyBlock, StridedCopy) move its bits like any other
// dtype's, and every other kernel refuses it (std::invalid_argument). Arithmetic happens in
// the compute dtype (ComputeDType: float64 for float64, float32 otherwise): 16-bit inputs are
// widened exactly, every sum and product is a float32 one, and each stored 16-bit element
// is rounded once, to nearest even (core/half.h) -- mixed precision as cuBLAS with
// CUBLAS_COMPUTE_32F and PyTorch's elementwise kernels do it. All tensors of a call share
// one dtype, with two exceptions:
//   accumulators   Gemm's and BatchedGemm's c, SumRows' out, Axpy's y, EmbeddingBackward's
//                  dweight and NormBackward's dweight and dbias may instead have the
//                  compute dtype of the inputs (a bfloat16 product accumulated straight
//                  into a float32 main_grad);
//   statistics     the cross-entropy pieces' row_max, sum_exp, sum_z, target_z and
//                  row_scale, and the norms' mean and rstd, always have the compute dtype
//                  of the logits / of x (Megatron runs the loss on logits.float(), and
//                  Apex's fused norms keep their statistics in float32).
//
// The operations, by section below: memory (Zeros, Empty, ToDevice, ToHost, Copy, SetZero,
// CopyBlock, StridedCopy, and Convert between float dtypes); dense algebra (Gemm,
// BatchedGemm, AddRowVector, SumRows, Axpy, Scale); elementwise (the activations, Dropout,
// DropoutAt); normalization (the norms of core/ops/norm.h); attention (CausalSoftmax, Rope);
// routing (TopK); embedding; vocab-parallel cross entropy; the optimizer (OptimizerStep,
// UnscaleState, ScaleState, SumOfSquares), so that training never copies weights or
// gradients off the device.
// What it is not: a graph or autograd -- every backward is its own call, made by the layer
// (core/model) that saved what it needs.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/dropout.h"
#include "core/ops/activation.h"
#include "core/ops/norm.h"
#include "core/optimizer_update.h"
#include "core/tensor.h"

namespace mpusim {

// The view OptimizerUpdate::Apply takes of an optimizer state tensor: its storage, read as
// M or, when the tensor is bfloat16 (the precision-aware optimizer's), as bfloat16; none for
// an undefined tensor (sgd's second state). Both backends' OptimizerStep build theirs here.
template <typename M>
OptimizerUpdate::Moment<M> MomentOf(Tensor& state) {
  if (!state.defined()) return {};
  return {state.data(), state.dtype() == DType::kBFloat16};
}

class Kernels {
 public:
  // The most dimensions a StridedCopy takes.
  static constexpr int kMaxCopyDims = 6;

  virtual ~Kernels() = default;

  // Returns once every operation this backend has started has finished: a no-op where calls
  // complete before they return (the CPU), a stream synchronisation on a GPU, whose kernels
  // run after their launch returns. Whoever reads a clock to time device work calls it first.
  virtual void Synchronize() {}

  // Each call checks its arguments (core/arg_checks.h: allocated tensors on this backend's
  // device, one dtype, matching shapes; std::invalid_argument otherwise), then runs the
  // backend's Do* implementation, so every backend enforces the same rules.

  // --- memory -------------------------------------------------------------------------
  Tensor Zeros(const Shape& shape, DType dtype);
  // Uninitialised storage, for outputs a kernel or collective overwrites completely.
  Tensor Empty(const Shape& shape, DType dtype);
  // Bytes of the tensors Zeros, Empty and ToDevice made that are alive now, and the most alive
  // at once since ResetPeakTensorBytes (views share their tensor's bytes; copies to the host
  // are not counted): what a step of the model really holds, measured.
  struct TensorBytes {
    int64_t live = 0;
    int64_t peak = 0;
  };
  TensorBytes tensor_bytes() const;
  void ResetPeakTensorBytes();
  Tensor ToDevice(const Tensor& host);   // host -> backend (copy)
  Tensor ToHost(const Tensor& tensor);   // backend -> host (copy)
  void Copy(const Tensor& src, Tensor& dst);  // same numel
  // dst = src with each element rounded to dst's dtype (RoundTo, core/half.h: to nearest
  // even, 16-bit via float32, as torch's .to() does); any two float dtypes, same numel, no
  // overlap. Widening is exact.
  void Convert(const Tensor& src, Tensor& dst);
  // x = 0, in place (all bits zero: +0.0 in every dtype); the storage is kept.
  void SetZero(Tensor& x);
  // dst[dst_row0 + i, dst_col0 + j] = src[src_row0 + i, src_col0 + j], i < rows, j < cols
  // (2-D views).
  void CopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                 int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols);
  // A permuting / slicing copy over the flat storage (element offsets): for every index
  // tuple i < dims (1 to 6 dimensions),
  //   dst[dst_offset + sum_k i_k dst_strides[k]] = src[src_offset + sum_k i_k src_strides[k]].
  // Same dtype; strides >= 0; every addressed element lies inside its tensor; src and dst
  // do not overlap; no dst element is addressed twice (sorted by stride, each dst stride
  // exceeds the span of the smaller ones). Splits a fused QKV [s, b, groups, r + 2, d] into
  // contiguous per-head tensors, and back.
  void StridedCopy(const Tensor& src, int64_t src_offset, const std::vector<int64_t>& dims,
                   const std::vector<int64_t>& src_strides, Tensor& dst, int64_t dst_offset,
                   const std::vector<int64_t>& dst_strides);

  // --- dense algebra ------------------------------------------------------------------
  // c = alpha * op(a) @ op(b) + beta * c on the 2-D views; op(x) = x^T when trans_x.
  void Gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
            double beta, Tensor& c);
  // c[i] = alpha * op(a[i]) @ op(b[i]) + beta * c[i] for every i < batch, on 3-D
  // [batch, rows, cols] tensors with one batch; dtypes and c as for Gemm.
  void BatchedGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                   double beta, Tensor& c);
  // y[i, :] += bias (bias has y.cols() elements).
  void AddRowVector(const Tensor& bias, Tensor& y);
  // out = beta * out + sum over rows of x (out has x.cols() elements).
  void SumRows(const Tensor& x, double beta, Tensor& out);
  // y += alpha * x (same numel).
  void Axpy(double alpha, const Tensor& x, Tensor& y);
  void Scale(double alpha, Tensor& x);

  // --- elementwise --------------------------------------------------------------------
  // The activation `act` (core/ops/activation.h). Plain: y = f(x) with y the shape of x,
  // and y may be x. Gated (swiglu): x = [a | b] [n, 2f], y = f(a) * b [n, f], y apart from x;
  // `glu` its offset and clamp (GluOptions, core/ops/activation.h; a plain act ignores it).
  void ActivationForward(Activation act, const Tensor& x, Tensor& y, const GluOptions& glu = {});
  // Plain: dx = dy * f'(x) (dx may be x or dy). Gated: dx = [dy * b * f'(a) | dy * f(a)]
  // [n, 2f] from dy [n, f] (zero where `glu` clamped); dx may be x, not dy.
  void ActivationBackward(Activation act, const Tensor& x, const Tensor& dy, Tensor& dx,
                          const GluOptions& glu = {});
  // Inverted dropout with a counter-based mask: element e is kept iff
  // UniformAt(key, stream, offset + e) >= p, and kept elements are scaled by 1 / (1 - p).
  // Backward applies the same mask to the gradient (call it with dy, dx).
  void Dropout(const Tensor& x, double p, uint64_t key, uint64_t stream, uint64_t offset,
               Tensor& y);
  // Dropout with the mask of a global tensor (core/dropout.h): element e of x is kept iff
  // UniformAt(key, stream, map.At(e)) >= p; map.dims multiply to x.numel(), and map's base,
  // dims and strides are >= 0. Otherwise exactly Dropout (same scale, same rounding); y may
  // be x.
  void DropoutAt(const Tensor& x, double p, uint64_t key, uint64_t stream,
                 const GlobalIndexMap& map, Tensor& y);

  // --- normalization over the last dimension (x [n, h] 2-D view, h >= 1) --------------
  // The norm `norm` (core/ops/norm.h) of each row i: with m_i = (1/h) sum_j x_ij for a
  // centered norm (IsCentered) and m_i = 0 otherwise,
  //   rstd_i = 1 / sqrt((1/h) sum_j (x_ij - m_i)^2 + eps) (biased),
  //   y_ij = (x_ij - m_i) * rstd_i * weight_j (+ bias_j when centered).
  // A centered norm takes bias [h] and mean [n] (receiving m), the other neither (both
  // null). weight and bias have x's dtype; mean and rstd [n] its compute dtype. y may be x.
  void NormForward(Normalization norm, const Tensor& x, const Tensor& weight, const Tensor* bias,
                   double eps, Tensor& y, Tensor* mean, Tensor& rstd);
  // With xhat = (x - m) * rstd (m = mean as the forward stored it, or 0) and
  // g = dy * weight (per row):
  //   dx = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat))   (mean_j(g) only when centered),
  //   dweight += sum_i dy * xhat,  dbias += sum_i dy           (dbias only when centered).
  // mean and dbias are given iff the norm is centered. dweight and dbias are accumulators
  // (main_grad) of one dtype: x's or its compute dtype. dx may be dy.
  void NormBackward(Normalization norm, const Tensor& x, const Tensor& weight, const Tensor* mean,
                    const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& dweight,
                    Tensor* dbias);

  // --- attention: positions -------------------------------------------------------------
  // Each row of a query tensor is one query position and each column of scores one key
  // position, given as int64 tensors on this backend's device: q_pos [sq] (row r is query
  // position q_pos[r % sq]; sq divides the rows) and k_pos [kv] (column j is key position
  // k_pos[j]). Without context parallelism both are 0, 1, ..., s - 1; with it they are the
  // rank's load-balanced chunks (core/sharding.h) and, for gathered keys, every cp rank's.
  // Key j is visible to row r when k_pos[j] <= q_pos[r % sq] (causal).
  //
  // Causal softmax of scores [rows, kv] (2-D view): over the visible keys V(r),
  //   probs[r, j] = exp(scale s[r, j] - m) / sum_{j' in V(r)} exp(scale s[r, j'] - m),
  // with m = max_{j in V(r)} scale s[r, j], and probs[r, j] = +0 for j not in V(r) (a row
  // that sees no key is all zero). Computed in the compute dtype (Megatron's
  // attention_softmax_in_fp32), stored in scores' dtype. probs may be scores.
  // With `lse` ([rows], the compute dtype) also each row's log-sum-exp over its visible keys,
  //   lse[r] = log sum_{j in V(r)} exp(scale s[r, j]) = m + log(sum), -inf for a row that
  //   sees no key,
  // by which context parallelism's p2p ring merges the softmaxes of its key blocks.
  //
  // Sliding-window attention (Megatron's window_size [w, 0]): with window = w >= 0 key j is
  // visible to row r only when also q_pos[r % sq] - k_pos[j] <= w (the row's own position and
  // the w before it); -1 is no window. The same `window` goes to FromLse and Backward.
  // Attention sinks (Megatron's softmax_type "off-by-one" / "learnable"): with `sink` ([heads]
  // in scores' dtype, heads dividing rows / sq) row r's softmax has the extra logit
  // o = sink[(r / sq) % heads] (not scaled) in its denominator only:
  //   probs[r, j] = exp(scale s[r, j]) / (exp(o) + sum_{j' in V(r)} exp(scale s[r, j'])),
  // taken around m = max(o, max_V scale s), and lse[r] = log(exp(o) + sum_V exp(scale s)).
  void CausalSoftmaxForward(const Tensor& scores, const Tensor& q_pos, const Tensor& k_pos,
                            double scale, Tensor& probs, Tensor* lse = nullptr, int64_t window = -1,
                            const Tensor* sink = nullptr);
  // The probabilities of one block of a row's keys given the row's log-sum-exp over all of
  // them (lse [rows], the compute dtype): probs[r, j] = exp(scale s[r, j] - lse[r]) for j in
  // V(r), +0 otherwise and for a row whose lse is -inf. probs may be scores.
  void CausalSoftmaxFromLse(const Tensor& scores, const Tensor& lse, const Tensor& q_pos,
                            const Tensor& k_pos, double scale, Tensor& probs, int64_t window = -1);
  // dscores[r, j] = scale * probs[r, j] * (dprobs[r, j] - dot_r) for j in V(r), +0
  // otherwise, with dot_r = sum_{j' in V(r)} probs dprobs, or row_dot[r] when given
  // ([rows], the compute dtype: the sum over all of a row's keys when probs and dprobs hold
  // one block of them; the p2p ring passes rowsum(dO * O)). dscores may be probs or dprobs.
  // (A sink changes nothing here: its probability is left out of the output, so its dprobs
  // is 0 and the row term is the same sum; its own gradient is SoftmaxSinkGrad's.)
  void CausalSoftmaxBackward(const Tensor& probs, const Tensor& dprobs, const Tensor& q_pos,
                             const Tensor& k_pos, double scale, Tensor& dscores,
                             const Tensor* row_dot = nullptr, int64_t window = -1);
  // The gradient of the attention sinks (softmax_type "learnable"): for rows of sq query rows
  // per head (row r's head (r / sq) % heads, sink [heads] in the rows' storage dtype, lse and
  // row_dot [rows] in its compute dtype: each row's log-sum-exp with the sink, and its
  // sum_V probs dprobs),
  //   dsink[h] += sum_{r of h} -exp(sink[h] - lse[r]) row_dot[r],
  // summed in the compute dtype and added to dsink ([heads], sink's dtype or its compute
  // dtype: main_grad).
  void SoftmaxSinkGrad(const Tensor& sink, const Tensor& lse, const Tensor& row_dot, int64_t sq,
                       Tensor& dsink);
  // out[r] = sum_c a[r, c] b[r, c] for a and b [rows, cols] (2-D views, one dtype), summed
  // in the compute dtype into out [rows] (the compute dtype).
  void RowDot(const Tensor& a, const Tensor& b, Tensor& out);
  // Merges a block's attention output into a running one by their log-sum-exps (out, part
  // [rows, d] 2-D views of one dtype; lse, part_lse [rows] in its compute dtype): per row,
  //   n = log(exp(lse) + exp(part_lse)),  out = out exp(lse - n) + part exp(part_lse - n),
  //   lse = n,
  // in the compute dtype (out stored rounded). A part whose lse is -inf (its row saw no key
  // of the block) leaves the row as it is; a running lse of -inf takes the part whole.
  void LseMerge(Tensor& out, Tensor& lse, const Tensor& part, const Tensor& part_lse);
  // Rotary embedding of the first `dim` columns of x [rows, d] (2-D view; dim even, 2 <= dim
  // <= d; Megatron's rotary_percent < 1 turns fewer than d), position p = pos[r % sq] (pos:
  // int64 [sq], sq divides the rows): for
  // i < dim/2, theta = p * base^(-2i/dim) in float64, c = cos theta, s = sin theta (rounded
  // to the compute dtype), and
  //   y[i] = x[i] c - x[i + dim/2] s,  y[i + dim/2] = x[i + dim/2] c + x[i] s;
  // columns >= dim pass through. inverse = true applies the transpose (the backward):
  // s -> -s. y may be x.
  void Rope(const Tensor& x, const Tensor& pos, double base, int64_t dim, bool inverse,
            Tensor& y);

  // --- routing (mixture of experts) ---------------------------------------------------
  // Per row r of scores [rows, n] (2-D view), its k largest entries in descending order:
  // values [rows, k] (scores' dtype, the stored bits) and their columns indices [rows, k]
  // (int64), 1 <= k <= n. Equal scores keep the lower column first (a documented,
  // deterministic tie rule: the router's choice never depends on the backend), and NaN ranks
  // above every number, as torch.topk's does.
  void TopK(const Tensor& scores, int64_t k, Tensor& values, Tensor& indices);

  // --- embedding ----------------------------------------------------------------------
  // ids and labels below are int64 tensors on this backend's device, of any shape with one
  // element per row (flat index i <-> row i); they are read where they are, never copied to
  // or from the host. Any id value is allowed: those outside the shard are masked.
  //
  // out[i, :] = weight[ids[i] - vocab_start, :] if vocab_start <= ids[i] < vocab_end, else 0
  // (Megatron's masked lookup for a vocabulary shard).
  void EmbeddingForward(const Tensor& weight, const Tensor& ids, int64_t vocab_start,
                        int64_t vocab_end, Tensor& out);
  // dweight[ids[i] - vocab_start, :] += dy[i, :] for ids inside the shard, in increasing i.
  void EmbeddingBackward(const Tensor& dy, const Tensor& ids, int64_t vocab_start,
                         int64_t vocab_end, Tensor& dweight);

  // --- vocab-parallel cross entropy pieces (rows = tokens, cols = local vocabulary) ----
  // row_max[i] = max_j logits[i, j].
  void RowMax(const Tensor& logits, Tensor& row_max);
  // With z = logits - row_max (row_max already all-reduced): sum_exp[i] = sum_j exp(z[i,j]),
  // sum_z[i] = sum_j z[i,j], target_z[i] = z[i, labels[i] - vocab_start] if the label is in
  // [vocab_start, vocab_start + cols), else 0. labels: int64, one per row (as ids above).
  void CrossEntropyPartials(const Tensor& logits, const Tensor& row_max, const Tensor& labels,
                            int64_t vocab_start, Tensor& sum_exp, Tensor& sum_z, Tensor& target_z);
  // grad[i, j] = row_scale[i] * (exp(z[i,j]) / sum_exp[i] - q[i,j]) with the smoothed target
  // q = on_value at the label column, off_value elsewhere.
  void CrossEntropyBackward(const Tensor& logits, const Tensor& row_max, const Tensor& sum_exp,
                            const Tensor& labels, int64_t vocab_start, double on_value,
                            double off_value, const Tensor& row_scale, Tensor& grad);

  // --- optimizer (flat tensors of one parameter's elements, or a shard of them) --------
  // For every element e, update(Widen(grad[e]), master[e], state1[e], state2[e]) in float64
  // (core/optimizer_update.h), then param[e] = RoundTo<param dtype>(master[e]). grad has any
  // float dtype (main_grad: the precision-aware optimizer reads a 16-bit one as it is);
  // master has the master dtype (float32 or float64); state1 and state2 have the master
  // dtype or, with a float32 master, bfloat16 (the precision-aware optimizer's bf16 moments);
  // state2 is adam's exp_avg_sq and undefined for sgd; param has any float dtype and overlaps
  // none of the others. All have one numel.
  // With update.param_remainders (store_param_remainders) master is the remainder: a 2-byte
  // tensor of dtype bfloat16 whose bits are the int16 remainder, never read as numbers
  // (mpusim has no int16 dtype); param is bfloat16, read (the master's high half) and
  // written; the states are float32 or bfloat16 (OptimizerUpdate::ApplyWithRemainder).
  void OptimizerStep(const OptimizerUpdate& update, const Tensor& grad, Tensor& master,
                     Tensor& state1, Tensor& state2, Tensor& param);
  // A float16 optimizer state stored scaled (core/optimizer_update.h ScaledFloat16): out
  // (float32) = q (float16) widened times scale[0] (float32, one element, on the device).
  void UnscaleState(const Tensor& q, const Tensor& scale, Tensor& out);
  // The other way: scale[0] = ScaleOf(max_e |x[e]|), then q[e] = Quantize(x[e], 1 / scale)
  // (x float32, q float16 of x's numel, scale float32 with one element).
  void ScaleState(const Tensor& x, Tensor& scale, Tensor& q);
  // out[0] += sum_e x[e]^2 in float64 (out: float64 with one element; x any float dtype,
  // widened exactly). The CPU sums e = 0, 1, ... in order; a GPU in an order of its own (a
  // fixed one).
  void SumOfSquares(const Tensor& x, Tensor& out);

 protected:
  // `backend` names the implementation in error messages; `device` is where its tensors live.
  Kernels(const char* backend, Device device) : backend_(backend), device_(device) {}

  // The implementations, called after the checks above passed. StridedCopy, BatchedGemm,
  // DropoutAt, the activations, the norms, the causal softmaxes and Rope reach their Do* only
  // with work to do: no StridedCopy dimension is 0, BatchedGemm's c is not empty (a and b may be, when
  // k == 0), and no tensor of the other calls is empty.
  virtual Tensor DoZeros(const Shape& shape, DType dtype) = 0;
  virtual Tensor DoEmpty(const Shape& shape, DType dtype) = 0;
  virtual Tensor DoToDevice(const Tensor& host) = 0;
  virtual Tensor DoToHost(const Tensor& tensor) = 0;
  virtual void DoCopy(const Tensor& src, Tensor& dst) = 0;
  virtual void DoSetZero(Tensor& x) = 0;
  virtual void DoConvert(const Tensor& src, Tensor& dst) = 0;
  virtual void DoCopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                           int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols) = 0;
  // dims, src_strides and dst_strides have the same length, 1 to 6; no dimension is 0.
  virtual void DoStridedCopy(const Tensor& src, int64_t src_offset,
                             const std::vector<int64_t>& dims,
                             const std::vector<int64_t>& src_strides, Tensor& dst,
                             int64_t dst_offset, const std::vector<int64_t>& dst_strides) = 0;
  virtual void DoGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                      double beta, Tensor& c) = 0;
  virtual void DoBatchedGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a,
                             const Tensor& b, double beta, Tensor& c) = 0;
  virtual void DoAddRowVector(const Tensor& bias, Tensor& y) = 0;
  virtual void DoSumRows(const Tensor& x, double beta, Tensor& out) = 0;
  virtual void DoAxpy(double alpha, const Tensor& x, Tensor& y) = 0;
  virtual void DoScale(double alpha, Tensor& x) = 0;
  virtual void DoActivationForward(Activation act, const Tensor& x, Tensor& y,
                                   const GluOptions& glu) = 0;
  virtual void DoActivationBackward(Activation act, const Tensor& x, const Tensor& dy, Tensor& dx,
                                    const GluOptions& glu) = 0;
  virtual void DoDropout(const Tensor& x, double p, uint64_t key, uint64_t stream, uint64_t offset,
                         Tensor& y) = 0;
  virtual void DoDropoutAt(const Tensor& x, double p, uint64_t key, uint64_t stream,
                           const GlobalIndexMap& map, Tensor& y) = 0;
  // The norms: bias, mean and dbias are null exactly when the norm is not centered, which is
  // all a backend needs to know of it (core/ops/norm.h's functors do the rest).
  virtual void DoNormForward(const Tensor& x, const Tensor& weight, const Tensor* bias,
                             double eps, Tensor& y, Tensor* mean, Tensor& rstd) = 0;
  virtual void DoNormBackward(const Tensor& x, const Tensor& weight, const Tensor* mean,
                              const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& dweight,
                              Tensor* dbias) = 0;
  virtual void DoCausalSoftmaxForward(const Tensor& scores, const Tensor& q_pos,
                                      const Tensor& k_pos, double scale, Tensor& probs, Tensor* lse,
                                      int64_t window, const Tensor* sink) = 0;
  virtual void DoCausalSoftmaxFromLse(const Tensor& scores, const Tensor& lse, const Tensor& q_pos,
                                      const Tensor& k_pos, double scale, Tensor& probs,
                                      int64_t window) = 0;
  virtual void DoCausalSoftmaxBackward(const Tensor& probs, const Tensor& dprobs,
                                       const Tensor& q_pos, const Tensor& k_pos, double scale,
                                       Tensor& dscores, const Tensor* row_dot, int64_t window) = 0;
  virtual void DoSoftmaxSinkGrad(const Tensor& sink, const Tensor& lse, const Tensor& row_dot,
                                 int64_t sq, Tensor& dsink) = 0;
  virtual void DoRowDot(const Tensor& a, const Tensor& b, Tensor& out) = 0;
  virtual void DoLseMerge(Tensor& out, Tensor& lse, const Tensor& part,
                          const Tensor& part_lse) = 0;
  virtual void DoRope(const Tensor& x, const Tensor& pos, double base, int64_t dim,
                      bool inverse, Tensor& y) = 0;
  virtual void DoTopK(const Tensor& scores, int64_t k, Tensor& values, Tensor& indices) = 0;
  virtual void DoEmbeddingForward(const Tensor& weight, const Tensor& ids, int64_t vocab_start,
                                  int64_t vocab_end, Tensor& out) = 0;
  virtual void DoEmbeddingBackward(const Tensor& dy, const Tensor& ids, int64_t vocab_start,
                                   int64_t vocab_end, Tensor& dweight) = 0;
  virtual void DoRowMax(const Tensor& logits, Tensor& row_max) = 0;
  virtual void DoCrossEntropyPartials(const Tensor& logits, const Tensor& row_max,
                                      const Tensor& labels, int64_t vocab_start, Tensor& sum_exp,
                                      Tensor& sum_z, Tensor& target_z) = 0;
  virtual void DoCrossEntropyBackward(const Tensor& logits, const Tensor& row_max,
                                      const Tensor& sum_exp, const Tensor& labels,
                                      int64_t vocab_start, double on_value, double off_value,
                                      const Tensor& row_scale, Tensor& grad) = 0;
  virtual void DoOptimizerStep(const OptimizerUpdate& update, const Tensor& grad, Tensor& master,
                               Tensor& state1, Tensor& state2, Tensor& param) = 0;
  virtual void DoUnscaleState(const Tensor& q, const Tensor& scale, Tensor& out) = 0;
  virtual void DoScaleState(const Tensor& x, Tensor& scale, Tensor& q) = 0;
  virtual void DoSumOfSquares(const Tensor& x, Tensor& out) = 0;

 private:
  // Wraps a new tensor's storage so that its bytes count while it is alive.
  Tensor Counted(Tensor t);
  struct ByteCounter {
    std::atomic<int64_t> live{0};
    std::atomic<int64_t> peak{0};
  };

  const char* backend_;
  Device device_;
  std::shared_ptr<ByteCounter> bytes_ = std::make_shared<ByteCounter>();
};

}  // namespace mpusim
