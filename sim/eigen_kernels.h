// EigenKernels: the simulator's Kernels, on host memory with Eigen.
//
// What it is: every Kernels operation (core/kernels.h) for float32, float64, bfloat16 and
// float16 host tensors, with int64 ids and labels read in place. Each call dispatches on the
// dtype once and then works on Eigen::Map views of the row-major storage; Gemm is Eigen's
// blocked GEMM (noalias, transposed views, alpha/beta folded into the product) and
// BatchedGemm one such GEMM per batch entry, elementwise ops are plain loops or Eigen array
// expressions, the norms and the causal softmax one pass per row, StridedCopy an odometer
// over its index tuples. float32 and float64 accumulate in their own dtype. bfloat16 and
// float16 are storage only: their elements are widened exactly to temporary float32
// tensors, the float32 code runs (OpenBLAS GEMM included), and each stored 16-bit element is
// rounded once to nearest even (core/half.h); a float32 accumulator or statistic is used as
// it is. One exception to "rounded once": a 16-bit EmbeddingBackward dweight rounds after
// every added token row, in id order. Nothing here starts threads (no OpenMP); how many
// threads Eigen may use is the caller's choice.
// What it is not: the float64 reference model (reference/reference_model is written
// independently), and not a place for layer logic (core/model/graph).
//
// Arguments are checked (device, dtype agreement, shapes, index ranges); a mismatch is a
// bug in the caller and throws std::invalid_argument naming the kernel and the tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/kernels.h"
#include "core/tensor.h"
#include "sim/host_block_cache.h"

namespace mpusim {

class EigenKernels final : public Kernels {
 public:
  // When built with OpenBLAS (MPUSIM_HAVE_OPENBLAS: Eigen's GEMMs go to BLAS through
  // EIGEN_USE_BLAS), pins OpenBLAS to one thread: every MPI rank plays one GPU on one core.
  EigenKernels();

  // Bytes of freed tensor storage held for reuse (sim/host_block_cache.h).
  size_t cached_bytes() const;

 protected:
  // The Kernels implementations; the base class checks the arguments first.
  // --- memory -------------------------------------------------------------------------
  Tensor DoZeros(const Shape& shape, DType dtype) override;
  Tensor DoEmpty(const Shape& shape, DType dtype) override;
  Tensor DoToDevice(const Tensor& host) override;
  Tensor DoToHost(const Tensor& tensor) override;
  void DoCopy(const Tensor& src, Tensor& dst) override;
  void DoConvert(const Tensor& src, Tensor& dst) override;
  void DoSetZero(Tensor& x) override;
  void DoCopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                 int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols) override;
  // Moves bits (16-bit elements as uint16_t), in row-major order of the index tuples.
  void DoStridedCopy(const Tensor& src, int64_t src_offset, const std::vector<int64_t>& dims,
                     const std::vector<int64_t>& src_strides, Tensor& dst, int64_t dst_offset,
                     const std::vector<int64_t>& dst_strides) override;

  // --- dense algebra ------------------------------------------------------------------
  // c must not share storage with a or b. beta == 0 overwrites c (NaNs in c do not
  // propagate), as in BLAS.
  void DoGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta,
            Tensor& c) override;
  // DoGemm on each batch entry (non-owning 2-D views), so each entry rounds as a Gemm does.
  void DoBatchedGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                     double beta, Tensor& c) override;
  void DoAddRowVector(const Tensor& bias, Tensor& y) override;
  // beta == 0 overwrites out.
  void DoSumRows(const Tensor& x, double beta, Tensor& out) override;
  void DoAxpy(double alpha, const Tensor& x, Tensor& y) override;
  void DoScale(double alpha, Tensor& x) override;

  // --- elementwise (y may be x, dx may be dy) -----------------------------------------
  void DoActivationForward(Activation act, const Tensor& x, Tensor& y,
                           const GluOptions& glu) override;
  void DoActivationBackward(Activation act, const Tensor& x, const Tensor& dy, Tensor& dx,
                            const GluOptions& glu) override;
  // y = keep ? x / (1 - p) : 0 with keep = UniformAt(key, stream, offset + e) >= p for flat
  // element e; p in [0, 1]; p == 0 copies, p == 1 zeroes.
  void DoDropout(const Tensor& x, double p, uint64_t key, uint64_t stream, uint64_t offset,
               Tensor& y) override;
  // DoDropout with UniformAt(key, stream, map.At(e)) for flat element e.
  void DoDropoutAt(const Tensor& x, double p, uint64_t key, uint64_t stream,
                   const GlobalIndexMap& map, Tensor& y) override;
  // sigmoid(a) = 1 / (1 + exp(-a)); dx may be x.

  // --- normalization (y may be x, dx may be dy) ---------------------------------------
  // Row statistics are sums in the compute dtype divided by h; dweight and dbias get the
  // column sums over the rows (in row order) added once, so a 16-bit accumulator rounds
  // once per call. The pointwise parts are core/ops/norm.h's functors, on whole rows.
  // One body for every norm: mean (and bias, dbias) null for one that is not centered.
  void DoNormForward(const Tensor& x, const Tensor& weight, const Tensor* bias, double eps,
                     Tensor& y, Tensor* mean, Tensor& rstd) override;
  void DoNormBackward(const Tensor& x, const Tensor& weight, const Tensor* mean,
                      const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& dweight,
                      Tensor* dbias) override;

  // --- attention (probs may be scores, dscores may be probs or dprobs, y may be x) ------
  // Keys ascending (without context parallelism): each row's visible keys are a run (a
  // prefix without a window).
  void DoCausalSoftmaxForward(const Tensor& scores, const Tensor& q_pos, const Tensor& k_pos,
                              double scale, Tensor& probs, Tensor* lse, int64_t window,
                              const Tensor* sink) override;
  void DoCausalSoftmaxFromLse(const Tensor& scores, const Tensor& lse, const Tensor& q_pos,
                              const Tensor& k_pos, double scale, Tensor& probs,
                              int64_t window) override;
  void DoCausalSoftmaxBackward(const Tensor& probs, const Tensor& dprobs, const Tensor& q_pos,
                               const Tensor& k_pos, double scale, Tensor& dscores,
                               const Tensor* row_dot, int64_t window) override;
  void DoSoftmaxSinkGrad(const Tensor& sink, const Tensor& lse, const Tensor& row_dot, int64_t sq,
                         Tensor& dsink) override;
  void DoRowDot(const Tensor& a, const Tensor& b, Tensor& out) override;
  void DoTopK(const Tensor& scores, int64_t k, Tensor& values, Tensor& indices) override;
  void DoLseMerge(Tensor& out, Tensor& lse, const Tensor& part, const Tensor& part_lse) override;
  // The cos/sin table [sq, dim/2] is computed once per call.
  void DoRope(const Tensor& x, const Tensor& pos, double base, int64_t dim, bool inverse,
              Tensor& y) override;

  // --- embedding (weight / dweight hold rows [vocab_start, vocab_end)) ----------------
  void DoEmbeddingForward(const Tensor& weight, const Tensor& ids, int64_t vocab_start,
                          int64_t vocab_end, Tensor& out) override;
  void DoEmbeddingBackward(const Tensor& dy, const Tensor& ids, int64_t vocab_start,
                           int64_t vocab_end, Tensor& dweight) override;

  // --- vocab-parallel cross entropy pieces --------------------------------------------
  // A row with no columns has row_max = -inf (the identity of the max all-reduce).
  void DoRowMax(const Tensor& logits, Tensor& row_max) override;
  void DoCrossEntropyPartials(const Tensor& logits, const Tensor& row_max, const Tensor& labels,
                              int64_t vocab_start, Tensor& sum_exp, Tensor& sum_z,
                              Tensor& target_z) override;
  // grad may be logits (computed in place, as Megatron does).
  void DoCrossEntropyBackward(const Tensor& logits, const Tensor& row_max, const Tensor& sum_exp,
                              const Tensor& labels, int64_t vocab_start, double on_value,
                              double off_value, const Tensor& row_scale, Tensor& grad) override;
  void DoOptimizerStep(const OptimizerUpdate& update, const Tensor& grad, Tensor& master,
                       Tensor& state1, Tensor& state2, Tensor& param) override;
  void DoUnscaleState(const Tensor& q, const Tensor& scale, Tensor& out) override;
  void DoScaleState(const Tensor& x, Tensor& scale, Tensor& q) override;
  void DoSumOfSquares(const Tensor& x, Tensor& out) override;

 private:
  // Storage of every tensor these kernels make (activations, temporaries), reused by size.
  std::shared_ptr<HostBlockCache> cache_ = HostBlockCache::Create();
};

}  // namespace mpusim
