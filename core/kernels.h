// Kernels: the compute a backend supplies to core/model/graph.
//
// Every tensor argument lives on the backend's device (host for sim/, GPU for cuda/) and is
// dense row-major; "2-D" means the Tensor::rows() x Tensor::cols() view. Names and argument
// order are the same in every backend: outputs last.
//
// Dtypes. float64, float32, bfloat16 and float16 are supported. Arithmetic happens in the
// compute dtype (ComputeDType: float64 for float64, float32 otherwise): 16-bit inputs are
// widened exactly, every sum and product is a float32 one, and each stored 16-bit element
// is rounded once, to nearest even (core/half.h) -- mixed precision as cuBLAS with
// CUBLAS_COMPUTE_32F and PyTorch's elementwise kernels do it. All tensors of a call share
// one dtype, with two exceptions:
//   accumulators   Gemm's c, SumRows' out, Axpy's y and EmbeddingBackward's dweight may
//                  instead have the compute dtype of the inputs (a bfloat16 product
//                  accumulated straight into a float32 main_grad);
//   statistics     the cross-entropy pieces' row_max, sum_exp, sum_z, target_z and
//                  row_scale always have the compute dtype of the logits (Megatron runs
//                  the loss on logits.float()).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace mpusim {

class Kernels {
 public:
  virtual ~Kernels() = default;

  // Each call checks its arguments (core/arg_checks.h: allocated tensors on this backend's
  // device, one dtype, matching shapes; std::invalid_argument otherwise), then runs the
  // backend's Do* implementation, so every backend enforces the same rules.

  // --- memory -------------------------------------------------------------------------
  Tensor Zeros(const Shape& shape, DType dtype);
  // Uninitialised storage, for outputs a kernel or collective overwrites completely.
  Tensor Empty(const Shape& shape, DType dtype);
  Tensor ToDevice(const Tensor& host);   // host -> backend (copy)
  Tensor ToHost(const Tensor& tensor);   // backend -> host (copy)
  void Copy(const Tensor& src, Tensor& dst);  // same numel
  // x = 0, in place (all bits zero: +0.0 in every dtype); the storage is kept.
  void SetZero(Tensor& x);
  // dst[dst_row0 + i, dst_col0 + j] = src[src_row0 + i, src_col0 + j], i < rows, j < cols
  // (2-D views).
  void CopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                 int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols);

  // --- dense algebra ------------------------------------------------------------------
  // c = alpha * op(a) @ op(b) + beta * c on the 2-D views; op(x) = x^T when trans_x.
  void Gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
            double beta, Tensor& c);
  // y[i, :] += bias (bias has y.cols() elements).
  void AddRowVector(const Tensor& bias, Tensor& y);
  // out = beta * out + sum over rows of x (out has x.cols() elements).
  void SumRows(const Tensor& x, double beta, Tensor& out);
  // y += alpha * x (same numel).
  void Axpy(double alpha, const Tensor& x, Tensor& y);
  void Scale(double alpha, Tensor& x);

  // --- elementwise --------------------------------------------------------------------
  // Exact GELU: y = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)).
  void GeluForward(const Tensor& x, Tensor& y);
  // dx = dy * (Phi(x) + x phi(x)).
  void GeluBackward(const Tensor& x, const Tensor& dy, Tensor& dx);
  // Inverted dropout with a counter-based mask: element e is kept iff
  // UniformAt(key, stream, offset + e) >= p, and kept elements are scaled by 1 / (1 - p).
  // Backward applies the same mask to the gradient (call it with dy, dx).
  void Dropout(const Tensor& x, double p, uint64_t key, uint64_t stream, uint64_t offset,
               Tensor& y);

  // --- embedding ----------------------------------------------------------------------
  // out[i, :] = weight[ids[i] - vocab_start, :] if vocab_start <= ids[i] < vocab_end, else 0
  // (Megatron's masked lookup for a vocabulary shard).
  void EmbeddingForward(const Tensor& weight, const std::vector<int64_t>& ids, int64_t vocab_start,
                        int64_t vocab_end, Tensor& out);
  // dweight[ids[i] - vocab_start, :] += dy[i, :] for ids inside the shard.
  void EmbeddingBackward(const Tensor& dy, const std::vector<int64_t>& ids, int64_t vocab_start,
                         int64_t vocab_end, Tensor& dweight);

  // --- vocab-parallel cross entropy pieces (rows = tokens, cols = local vocabulary) ----
  // row_max[i] = max_j logits[i, j].
  void RowMax(const Tensor& logits, Tensor& row_max);
  // With z = logits - row_max (row_max already all-reduced): sum_exp[i] = sum_j exp(z[i,j]),
  // sum_z[i] = sum_j z[i,j], target_z[i] = z[i, labels[i] - vocab_start] if the label is in
  // [vocab_start, vocab_start + cols), else 0.
  void CrossEntropyPartials(const Tensor& logits, const Tensor& row_max,
                            const std::vector<int64_t>& labels, int64_t vocab_start,
                            Tensor& sum_exp, Tensor& sum_z, Tensor& target_z);
  // grad[i, j] = row_scale[i] * (exp(z[i,j]) / sum_exp[i] - q[i,j]) with the smoothed target
  // q = on_value at the label column, off_value elsewhere.
  void CrossEntropyBackward(const Tensor& logits, const Tensor& row_max, const Tensor& sum_exp,
                            const std::vector<int64_t>& labels, int64_t vocab_start,
                            double on_value, double off_value, const Tensor& row_scale,
                            Tensor& grad);

 protected:
  // `backend` names the implementation in error messages; `device` is where its tensors live.
  Kernels(const char* backend, Device device) : backend_(backend), device_(device) {}

  // The implementations, called after the checks above passed.
  virtual Tensor DoZeros(const Shape& shape, DType dtype) = 0;
  virtual Tensor DoEmpty(const Shape& shape, DType dtype) = 0;
  virtual Tensor DoToDevice(const Tensor& host) = 0;
  virtual Tensor DoToHost(const Tensor& tensor) = 0;
  virtual void DoCopy(const Tensor& src, Tensor& dst) = 0;
  virtual void DoSetZero(Tensor& x) = 0;
  virtual void DoCopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                           int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols) = 0;
  virtual void DoGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                      double beta, Tensor& c) = 0;
  virtual void DoAddRowVector(const Tensor& bias, Tensor& y) = 0;
  virtual void DoSumRows(const Tensor& x, double beta, Tensor& out) = 0;
  virtual void DoAxpy(double alpha, const Tensor& x, Tensor& y) = 0;
  virtual void DoScale(double alpha, Tensor& x) = 0;
  virtual void DoGeluForward(const Tensor& x, Tensor& y) = 0;
  virtual void DoGeluBackward(const Tensor& x, const Tensor& dy, Tensor& dx) = 0;
  virtual void DoDropout(const Tensor& x, double p, uint64_t key, uint64_t stream, uint64_t offset,
                         Tensor& y) = 0;
  virtual void DoEmbeddingForward(const Tensor& weight, const std::vector<int64_t>& ids,
                                  int64_t vocab_start, int64_t vocab_end, Tensor& out) = 0;
  virtual void DoEmbeddingBackward(const Tensor& dy, const std::vector<int64_t>& ids,
                                   int64_t vocab_start, int64_t vocab_end, Tensor& dweight) = 0;
  virtual void DoRowMax(const Tensor& logits, Tensor& row_max) = 0;
  virtual void DoCrossEntropyPartials(const Tensor& logits, const Tensor& row_max,
                                      const std::vector<int64_t>& labels, int64_t vocab_start,
                                      Tensor& sum_exp, Tensor& sum_z, Tensor& target_z) = 0;
  virtual void DoCrossEntropyBackward(const Tensor& logits, const Tensor& row_max,
                                      const Tensor& sum_exp, const std::vector<int64_t>& labels,
                                      int64_t vocab_start, double on_value, double off_value,
                                      const Tensor& row_scale, Tensor& grad) = 0;

 private:
  const char* backend_;
  Device device_;
};

}  // namespace mpusim
