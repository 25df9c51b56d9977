// Kernels: the compute a backend supplies to core/graph.
//
// Every tensor argument lives on the backend's device (host for sim/, GPU for cuda/) and is
// dense row-major; "2-D" means the Tensor::rows() x Tensor::cols() view. float32 and
// float64 are supported; all tensors of one call share a dtype. Accumulation happens in
// the tensor's dtype (float32 runs accumulate GEMMs in float32, as cuBLAS does by default).
// Names and argument order are the same in every backend: outputs last.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace mpusim {

class Kernels {
 public:
  virtual ~Kernels() = default;

  // --- memory -------------------------------------------------------------------------
  virtual Tensor Zeros(const Shape& shape, DType dtype) = 0;
  // Uninitialised storage, for outputs a kernel or collective overwrites completely.
  virtual Tensor Empty(const Shape& shape, DType dtype) = 0;
  virtual Tensor ToDevice(const Tensor& host) = 0;  // host -> backend (copy)
  virtual Tensor ToHost(const Tensor& tensor) = 0;  // backend -> host (copy)
  virtual void Copy(const Tensor& src, Tensor& dst) = 0;  // same numel
  // dst[dst_row0 + i, dst_col0 + j] = src[src_row0 + i, src_col0 + j], i < rows, j < cols
  // (2-D views).
  virtual void CopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                         int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols) = 0;

  // --- dense algebra ------------------------------------------------------------------
  // c = alpha * op(a) @ op(b) + beta * c on the 2-D views; op(x) = x^T when trans_x.
  virtual void Gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                    double beta, Tensor& c) = 0;
  // y[i, :] += bias (bias has y.cols() elements).
  virtual void AddRowVector(const Tensor& bias, Tensor& y) = 0;
  // out = beta * out + sum over rows of x (out has x.cols() elements).
  virtual void SumRows(const Tensor& x, double beta, Tensor& out) = 0;
  // y += alpha * x (same numel).
  virtual void Axpy(double alpha, const Tensor& x, Tensor& y) = 0;
  virtual void Scale(double alpha, Tensor& x) = 0;

  // --- elementwise --------------------------------------------------------------------
  // Exact GELU: y = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)).
  virtual void GeluForward(const Tensor& x, Tensor& y) = 0;
  // dx = dy * (Phi(x) + x phi(x)).
  virtual void GeluBackward(const Tensor& x, const Tensor& dy, Tensor& dx) = 0;
  // Inverted dropout with a counter-based mask: element e is kept iff
  // UniformAt(key, stream, offset + e) >= p, and kept elements are scaled by 1 / (1 - p).
  // Backward applies the same mask to the gradient (call it with dy, dx).
  virtual void Dropout(const Tensor& x, double p, uint64_t key, uint64_t stream, uint64_t offset,
                       Tensor& y) = 0;

  // --- embedding ----------------------------------------------------------------------
  // out[i, :] = weight[ids[i] - vocab_start, :] if vocab_start <= ids[i] < vocab_end, else 0
  // (Megatron's masked lookup for a vocabulary shard).
  virtual void EmbeddingForward(const Tensor& weight, const std::vector<int64_t>& ids,
                                int64_t vocab_start, int64_t vocab_end, Tensor& out) = 0;
  // dweight[ids[i] - vocab_start, :] += dy[i, :] for ids inside the shard.
  virtual void EmbeddingBackward(const Tensor& dy, const std::vector<int64_t>& ids,
                                 int64_t vocab_start, int64_t vocab_end, Tensor& dweight) = 0;

  // --- vocab-parallel cross entropy pieces (rows = tokens, cols = local vocabulary) ----
  // row_max[i] = max_j logits[i, j].
  virtual void RowMax(const Tensor& logits, Tensor& row_max) = 0;
  // With z = logits - row_max (row_max already all-reduced): sum_exp[i] = sum_j exp(z[i,j]),
  // sum_z[i] = sum_j z[i,j], target_z[i] = z[i, labels[i] - vocab_start] if the label is in
  // [vocab_start, vocab_start + cols), else 0.
  virtual void CrossEntropyPartials(const Tensor& logits, const Tensor& row_max,
                                    const std::vector<int64_t>& labels, int64_t vocab_start,
                                    Tensor& sum_exp, Tensor& sum_z, Tensor& target_z) = 0;
  // grad[i, j] = row_scale[i] * (exp(z[i,j]) / sum_exp[i] - q[i,j]) with the smoothed target
  // q = on_value at the label column, off_value elsewhere.
  virtual void CrossEntropyBackward(const Tensor& logits, const Tensor& row_max,
                                    const Tensor& sum_exp, const std::vector<int64_t>& labels,
                                    int64_t vocab_start, double on_value, double off_value,
                                    const Tensor& row_scale, Tensor& grad) = 0;
};

}  // namespace mpusim
