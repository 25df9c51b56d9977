// CudaKernels: the GPU backend's Kernels, on CUDA device memory with cuBLAS and the kernels
// of cuda/kernels/ (device_kernels.h).
//
// What it is: every Kernels operation (core/kernels.h) for float64, float32, bfloat16 and
// float16 tensors, with int64 ids and labels, on the current CUDA device, with the semantics
// of the CPU reference (sim/eigen_kernels.h): the same formulas in the same order,
// bit-identical dropout masks (core/philox.h on the device) and a deterministic
// EmbeddingBackward that adds in the CPU's order. Gemm is cuBLAS in CUBLAS_PEDANTIC_MATH (no
// TF32, no reduced-precision shortcuts), so float32 GEMMs are true float32 GEMMs like the
// CPU's.
// 16-bit tensors follow the dtype contract of core/kernels.h: elements are widened exactly
// to float32, the float32 formula runs, and each stored element is rounded once with
// core/half.h's rounding (so elementwise results are bit-identical to the CPU's whenever
// the float32 values are). Gemm on 16-bit a and b is cublasGemmEx with CUBLAS_COMPUTE_32F
// into a 16-bit or float32 c, BatchedGemm cublasGemmStridedBatchedEx with CUBLAS_COMPUTE_32F
// (CUBLAS_COMPUTE_64F for float64); Axpy's y, SumRows' out, EmbeddingBackward's dweight and
// the norms' dweight and dbias may be float32 accumulators of 16-bit inputs, and the
// cross-entropy and norm statistics are float32. The row reductions (norms, causal softmax)
// sum in a tree, the CPU in another order: those results agree to rounding, not bitwise.
// What it is not: an allocator with a cache (every Zeros/Empty is a cudaMalloc, every free a
// cudaFree, which synchronises the device: simple and safe, not fast), multi-device (the
// device current at construction is used throughout) or thread-safe.
//
// Ordering: everything runs on one stream owned by this object (the communicators of the
// GPU backend use it too), so kernels, copies and collectives execute in call order.
// ToHost and ToDevice synchronise the stream before returning. Ids and labels are int64
// device tensors that the kernels read where they are (no per-call upload);
// EmbeddingBackward groups them by row on the device, in a scratch buffer this object owns.
// Failed CUDA/cuBLAS calls end the job (cuda_check.h).
//
// Storage: tensors own their device memory through a shared_ptr whose deleter calls
// cudaFree; they may outlive this object but not the process's CUDA context.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/kernels.h"
#include "core/tensor.h"

namespace mpusim::cuda {

class CudaKernels final : public Kernels {
 public:
  // Uses the current device (cudaSetDevice first): creates a stream and a cuBLAS handle.
  CudaKernels();
  ~CudaKernels() override;
  CudaKernels(const CudaKernels&) = delete;
  CudaKernels& operator=(const CudaKernels&) = delete;

  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  // Waits until everything enqueued on stream() has finished.
  void Synchronize() override;
  // device = host (same dtype and numel; a device tensor and a host tensor); synchronous.
  void CopyFromHost(const Tensor& host, Tensor& device);


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
  void DoStridedCopy(const Tensor& src, int64_t src_offset, const std::vector<int64_t>& dims,
                     const std::vector<int64_t>& src_strides, Tensor& dst, int64_t dst_offset,
                     const std::vector<int64_t>& dst_strides) override;

  // --- dense algebra ------------------------------------------------------------------
  // c must not share storage with a or b; beta == 0 overwrites c (NaNs do not propagate).
  void DoGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta,
            Tensor& c) override;
  void DoBatchedGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                     double beta, Tensor& c) override;
  void DoAddRowVector(const Tensor& bias, Tensor& y) override;
  void DoSumRows(const Tensor& x, double beta, Tensor& out) override;
  void DoAxpy(double alpha, const Tensor& x, Tensor& y) override;
  void DoScale(double alpha, Tensor& x) override;

  // --- elementwise (y may be x, dx may be dy) -----------------------------------------
  void DoActivationForward(Activation act, const Tensor& x, Tensor& y,
                           const GluOptions& glu) override;
  void DoActivationBackward(Activation act, const Tensor& x, const Tensor& dy, Tensor& dx,
                            const GluOptions& glu) override;
  void DoDropout(const Tensor& x, double p, uint64_t key, uint64_t stream, uint64_t offset,
               Tensor& y) override;
  void DoDropoutAt(const Tensor& x, double p, uint64_t key, uint64_t stream,
                   const GlobalIndexMap& map, Tensor& y) override;

  // --- normalization (y may be x, dx may be dy) ---------------------------------------
  void DoNormForward(const Tensor& x, const Tensor& weight, const Tensor* bias, double eps,
                     Tensor& y, Tensor* mean, Tensor& rstd) override;
  void DoNormBackward(const Tensor& x, const Tensor& weight, const Tensor* mean,
                      const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& dweight,
                      Tensor* dbias) override;

  // --- attention (probs may be scores, dscores may be probs or dprobs, y may be x) ------
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
  void DoRope(const Tensor& x, const Tensor& pos, double base, int64_t dim, bool inverse,
              Tensor& y) override;

  // --- embedding ----------------------------------------------------------------------
  void DoEmbeddingForward(const Tensor& weight, const Tensor& ids, int64_t vocab_start,
                          int64_t vocab_end, Tensor& out) override;
  void DoEmbeddingBackward(const Tensor& dy, const Tensor& ids, int64_t vocab_start,
                           int64_t vocab_end, Tensor& dweight) override;

  // --- vocab-parallel cross entropy pieces --------------------------------------------
  void DoRowMax(const Tensor& logits, Tensor& row_max) override;
  void DoCrossEntropyPartials(const Tensor& logits, const Tensor& row_max, const Tensor& labels,
                              int64_t vocab_start, Tensor& sum_exp, Tensor& sum_z,
                              Tensor& target_z) override;
  // grad may be logits.
  void DoCrossEntropyBackward(const Tensor& logits, const Tensor& row_max, const Tensor& sum_exp,
                              const Tensor& labels, int64_t vocab_start, double on_value,
                              double off_value, const Tensor& row_scale, Tensor& grad) override;
  void DoOptimizerStep(const OptimizerUpdate& update, const Tensor& grad, Tensor& master,
                       Tensor& state1, Tensor& state2, Tensor& param) override;
  void DoUnscaleState(const Tensor& q, const Tensor& scale, Tensor& out) override;
  void DoScaleState(const Tensor& x, Tensor& scale, Tensor& q) override;
  void DoSumOfSquares(const Tensor& x, Tensor& out) override;

 private:
  // Device storage for `bytes` bytes (at least 1, so the pointer is never null).
  Tensor Allocate(const Shape& shape, DType dtype);
  // A device buffer of at least `bytes` bytes owned by this object (reused and grown as
  // needed; stream order keeps earlier kernels' use before the next call's).
  void* Scratch(size_t bytes);

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  void* scratch_ = nullptr;  // device buffer of scratch_bytes_ bytes
  size_t scratch_bytes_ = 0;
};

}  // namespace mpusim::cuda
