// CudaKernels (see cuda_kernels.h).
//
// The base class (core/kernels.cc) checks every call's arguments; each Do* method here then
// either calls a CUDA runtime / cuBLAS function on stream_ or a launcher of device_kernels.h
// with T the storage type (double, float, BFloat16, Float16) and, for accumulators, A the
// accumulator's.
#include "cuda/cuda_kernels.h"

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "core/arg_checks.h"
#include "cuda/cuda_check.h"
#include "cuda/device_kernels.h"

namespace mpusim::cuda {
namespace {

class Args : public KernelArgs {
 public:
  explicit Args(std::string_view kernel, KernelDTypes dtypes = KernelDTypes::kFloat)
      : KernelArgs("CudaKernels", Device::kCuda, kernel, dtypes) {}
};

void FreeDevice(void* pointer) {
  const cudaError_t error = cudaFree(pointer);
  // At process exit the runtime may already be unloaded; the memory goes with the context.
  if (error != cudaSuccess && error != cudaErrorCudartUnloading) {
    Fatal("cudaFree(tensor storage)", CudaErrorText(error), __FILE__, __LINE__, __func__);
  }
}

// Runs body.template operator()<T, A>() with T the storage type of the inputs (dtype `in`)
// and A that of their accumulator (dtype `acc`): T itself, or the compute type of a 16-bit
// T (the base class allows nothing else).
template <typename Body>
void DispatchAccumulator(DType in, DType acc, Body&& body) {
  DispatchStorage(in, [&]<typename T>() {
    if (acc == in) {
      body.template operator()<T, T>();
    } else {
      body.template operator()<T, ComputeOf<T>>();
    }
  });
}

// cuBLAS's name of a dtype.
cudaDataType_t CudaDataType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat64: return CUDA_R_64F;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kInt64: break;  // no GEMM on ids (the base class refuses them first)
  }
  throw std::invalid_argument(
      fmt::format("CudaKernels: {} has no cuBLAS compute type", DTypeName(dtype)));
}

std::byte* BytePointer(Tensor& t) { return static_cast<std::byte*>(t.data()); }
const std::byte* BytePointer(const Tensor& t) { return static_cast<const std::byte*>(t.data()); }

}  // namespace

CudaKernels::CudaKernels() : Kernels("CudaKernels", Device::kCuda) {
  MPUSIM_CUDA_CHECK(cudaGetDevice(&device_));
  // A blocking stream: it also orders against any legacy-default-stream work.
  MPUSIM_CUDA_CHECK(cudaStreamCreate(&stream_));
  MPUSIM_CUBLAS_CHECK(cublasCreate(&cublas_));
  MPUSIM_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  // Prescribed precision throughout (no TF32, no reduced-precision reductions), so float32
  // GEMMs compare with the CPU's float32 GEMMs.
  MPUSIM_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_PEDANTIC_MATH));
}

CudaKernels::~CudaKernels() {
  MPUSIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (scratch_ != nullptr) MPUSIM_CUDA_CHECK(cudaFree(scratch_));
  MPUSIM_CUBLAS_CHECK(cublasDestroy(cublas_));
  MPUSIM_CUDA_CHECK(cudaStreamDestroy(stream_));
}

void CudaKernels::Synchronize() { MPUSIM_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

Tensor CudaKernels::Allocate(const Shape& shape, DType dtype) {
  const size_t bytes = CheckedTensorBytes(shape, dtype);
  void* pointer = nullptr;
  MPUSIM_CUDA_CHECK(cudaMalloc(&pointer, std::max<size_t>(bytes, 1)));
  return Tensor(shape, dtype, Device::kCuda, std::shared_ptr<void>(pointer, FreeDevice));
}

void* CudaKernels::Scratch(size_t bytes) {
  if (bytes > scratch_bytes_) {
    if (scratch_ != nullptr) MPUSIM_CUDA_CHECK(cudaFree(scratch_));  // waits for its users
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    void* pointer = nullptr;
    MPUSIM_CUDA_CHECK(cudaMalloc(&pointer, bytes));
    scratch_ = pointer;
    scratch_bytes_ = bytes;
  }
  return scratch_;
}

void CudaKernels::CopyFromHost(const Tensor& host, Tensor& device) {
  Args args("CopyFromHost", KernelDTypes::kAny);
  args.Add("host", host, Device::kHost).Add("device", device);
  args.Numel("device", device, host.numel(), "the numel of host");
  if (host.bytes() == 0) return;
  MPUSIM_CUDA_CHECK(cudaMemcpyAsync(device.data(), host.data(), host.bytes(),
                                    cudaMemcpyHostToDevice, stream_));
  MPUSIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// --- memory ---------------------------------------------------------------------------

Tensor CudaKernels::DoZeros(const Shape& shape, DType dtype) {
  Tensor out = Allocate(shape, dtype);
  if (out.bytes() > 0) MPUSIM_CUDA_CHECK(cudaMemsetAsync(out.data(), 0, out.bytes(), stream_));
  return out;
}

Tensor CudaKernels::DoEmpty(const Shape& shape, DType dtype) {
  return Allocate(shape, dtype);
}

Tensor CudaKernels::DoToDevice(const Tensor& host) {
  Tensor out = Allocate(host.shape(), host.dtype());
  if (host.bytes() > 0) {
    MPUSIM_CUDA_CHECK(cudaMemcpyAsync(out.data(), host.data(), host.bytes(),
                                      cudaMemcpyHostToDevice, stream_));
    MPUSIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  return out;
}

Tensor CudaKernels::DoToHost(const Tensor& tensor) {
  Tensor out = Tensor::HostEmpty(tensor.shape(), tensor.dtype());
  if (tensor.bytes() > 0) {
    MPUSIM_CUDA_CHECK(cudaMemcpyAsync(out.data(), tensor.data(), tensor.bytes(),
                                      cudaMemcpyDeviceToHost, stream_));
  }
  MPUSIM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return out;
}

void CudaKernels::DoSetZero(Tensor& x) {
  if (x.bytes() > 0) MPUSIM_CUDA_CHECK(cudaMemsetAsync(x.data(), 0, x.bytes(), stream_));
}

void CudaKernels::DoCopy(const Tensor& src, Tensor& dst) {
  if (src.bytes() == 0 || src.data() == dst.data()) return;
  if (Overlap(src, dst)) {
    // cudaMemcpy* is undefined for overlapping ranges; memmove semantics via a copy.
    Tensor staged = Allocate(src.shape(), src.dtype());
    MPUSIM_CUDA_CHECK(cudaMemcpyAsync(staged.data(), src.data(), src.bytes(),
                                      cudaMemcpyDeviceToDevice, stream_));
    MPUSIM_CUDA_CHECK(cudaMemcpyAsync(dst.data(), staged.data(), src.bytes(),
                                      cudaMemcpyDeviceToDevice, stream_));
    return;  // freeing `staged` (cudaFree) waits for both copies
  }
  MPUSIM_CUDA_CHECK(
      cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDeviceToDevice, stream_));
}

void CudaKernels::DoConvert(const Tensor& src, Tensor& dst) {
  DispatchStorage(src.dtype(), [&]<typename S>() {
    DispatchStorage(dst.dtype(), [&]<typename D>() {
      LaunchConvert<S, D>(src.data_as<S>(), dst.data_as<D>(), src.numel(), stream_);
    });
  });
}

void CudaKernels::DoCopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                            int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return;
  const size_t element = DTypeSize(src.dtype());
  const size_t width = static_cast<size_t>(cols) * element;
  const size_t height = static_cast<size_t>(rows);
  const size_t src_pitch = static_cast<size_t>(Cols(src)) * element;
  const size_t dst_pitch = static_cast<size_t>(Cols(dst)) * element;
  const std::byte* from =
      BytePointer(src) + static_cast<size_t>(src_row0 * Cols(src) + src_col0) * element;
  std::byte* to = BytePointer(dst) + static_cast<size_t>(dst_row0 * Cols(dst) + dst_col0) * element;
  if (Overlap(src, dst)) {
    // The blocks may overlap: read all of the source block first, as the CPU does.
    Tensor staged = Allocate({rows, cols}, src.dtype());
    MPUSIM_CUDA_CHECK(cudaMemcpy2DAsync(staged.data(), width, from, src_pitch, width, height,
                                        cudaMemcpyDeviceToDevice, stream_));
    MPUSIM_CUDA_CHECK(cudaMemcpy2DAsync(to, dst_pitch, staged.data(), width, width, height,
                                        cudaMemcpyDeviceToDevice, stream_));
    return;  // freeing `staged` (cudaFree) waits for both copies
  }
  MPUSIM_CUDA_CHECK(cudaMemcpy2DAsync(to, dst_pitch, from, src_pitch, width, height,
                                      cudaMemcpyDeviceToDevice, stream_));
}

void CudaKernels::DoStridedCopy(const Tensor& src, int64_t src_offset,
                                const std::vector<int64_t>& dims,
                                const std::vector<int64_t>& src_strides, Tensor& dst,
                                int64_t dst_offset, const std::vector<int64_t>& dst_strides) {
  static_assert(kCopyPlanDims == Kernels::kMaxCopyDims);
  // Right-align the caller's dimensions; the leading padding has size 1 and stride 0.
  StridedCopyPlan plan{};
  plan.count = 1;
  const size_t pad = static_cast<size_t>(kCopyPlanDims) - dims.size();
  for (size_t k = 0; k < static_cast<size_t>(kCopyPlanDims); ++k) {
    plan.dims[k] = k < pad ? 1 : dims[k - pad];
    plan.src_strides[k] = k < pad ? 0 : src_strides[k - pad];
    plan.dst_strides[k] = k < pad ? 0 : dst_strides[k - pad];
    plan.count *= plan.dims[k];
  }
  const size_t element = DTypeSize(src.dtype());
  const std::byte* from = BytePointer(src) + static_cast<size_t>(src_offset) * element;
  std::byte* to = BytePointer(dst) + static_cast<size_t>(dst_offset) * element;
  // The copy moves bits: an unsigned integer of the element's size stands for the dtype.
  const auto launch = [&]<typename U>() {
    LaunchStridedCopy<U>(reinterpret_cast<const U*>(from), reinterpret_cast<U*>(to), plan,
                         stream_);
  };
  switch (element) {
    case 2: launch.template operator()<uint16_t>(); break;
    case 4: launch.template operator()<uint32_t>(); break;
    case 8: launch.template operator()<uint64_t>(); break;
    default: throw std::invalid_argument("CudaKernels::StridedCopy: unknown element size");
  }
}

// --- dense algebra --------------------------------------------------------------------

void CudaKernels::DoGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                       double beta, Tensor& c) {
  const int64_t m = trans_a ? Cols(a) : Rows(a);
  const int64_t k = trans_a ? Rows(a) : Cols(a);
  const int64_t n = trans_b ? Rows(b) : Cols(b);
  for (int64_t dim : {m, n, k, Cols(a), Cols(b)}) {
    Args("Gemm").Require(dim <= INT_MAX, fmt::format("dimension {} exceeds cuBLAS's int", dim));
  }
  if (m == 0 || n == 0) return;
  if (k == 0 || alpha == 0.0) {
    // c = beta * c; beta == 0 overwrites (all-zero bits are +0.0 in IEEE 754, and in
    // bfloat16 and float16 too).
    if (beta == 0.0) {
      MPUSIM_CUDA_CHECK(cudaMemsetAsync(c.data(), 0, c.bytes(), stream_));
    } else if (beta != 1.0) {
      Scale(beta, c);
    }
    return;
  }
  // Row-major C (m x n) = op(A) op(B) is column-major C^T (n x m) = op(B)^T op(A)^T. A
  // row-major X read as column-major is X^T with leading dimension Cols(X), so cuBLAS gets
  // (B, op_b) first and (A, op_a) second with the caller's own transpose flags, and C^T has
  // leading dimension n. cuBLAS with beta == 0 does not read C (NaNs do not propagate).
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int cm = static_cast<int>(n);
  const int cn = static_cast<int>(m);
  const int ck = static_cast<int>(k);
  const int lda = static_cast<int>(Cols(a));
  const int ldb = static_cast<int>(Cols(b));
  const int ldc = static_cast<int>(n);
  if (IsHalf(a.dtype())) {
    // 16-bit a and b, c 16-bit or float32: products and sums in float32
    // (CUBLAS_COMPUTE_32F, float alpha and beta), each element of c rounded once. The
    // handle's pedantic math mode also rules out reduced-precision (16-bit) split-K
    // reductions, which would round partial sums.
    const float alpha_f = static_cast<float>(alpha);
    const float beta_f = static_cast<float>(beta);
    const cudaDataType_t ab_type = CudaDataType(a.dtype());
    MPUSIM_CUBLAS_CHECK(cublasGemmEx(cublas_, op_b, op_a, cm, cn, ck, &alpha_f, b.data(), ab_type,
                                     ldb, a.data(), ab_type, lda, &beta_f, c.data(),
                                     CudaDataType(c.dtype()), ldc, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
  } else if (a.dtype() == DType::kFloat32) {
    const float alpha_f = static_cast<float>(alpha);
    const float beta_f = static_cast<float>(beta);
    MPUSIM_CUBLAS_CHECK(cublasSgemm(cublas_, op_b, op_a, cm, cn, ck, &alpha_f, b.data_as<float>(),
                                    ldb, a.data_as<float>(), lda, &beta_f, c.data_as<float>(),
                                    ldc));
  } else {
    MPUSIM_CUBLAS_CHECK(cublasDgemm(cublas_, op_b, op_a, cm, cn, ck, &alpha, b.data_as<double>(),
                                    ldb, a.data_as<double>(), lda, &beta, c.data_as<double>(),
                                    ldc));
  }
}

void CudaKernels::DoBatchedGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a,
                                const Tensor& b, double beta, Tensor& c) {
  const Shape& as = a.shape();
  const Shape& bs = b.shape();
  const int64_t batch = c.shape()[0];
  const int64_t m = c.shape()[1];
  const int64_t n = c.shape()[2];
  const int64_t k = trans_a ? as[1] : as[2];
  for (int64_t dim : {batch, m, n, k, as[2], bs[2]}) {
    Args("BatchedGemm")
        .Require(dim <= INT_MAX, fmt::format("dimension {} exceeds cuBLAS's int", dim));
  }
  if (k == 0 || alpha == 0.0) {
    // c = beta * c, as in DoGemm.
    if (beta == 0.0) {
      MPUSIM_CUDA_CHECK(cudaMemsetAsync(c.data(), 0, c.bytes(), stream_));
    } else if (beta != 1.0) {
      Scale(beta, c);
    }
    return;
  }
  // DoGemm's row-major -> column-major mapping for every entry; entry i of each operand
  // starts rows * cols elements after entry i - 1.
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int cm = static_cast<int>(n);
  const int cn = static_cast<int>(m);
  const int ck = static_cast<int>(k);
  const int lda = static_cast<int>(as[2]);
  const int ldb = static_cast<int>(bs[2]);
  const int ldc = static_cast<int>(n);
  const long long stride_a = as[1] * as[2];
  const long long stride_b = bs[1] * bs[2];
  const long long stride_c = m * n;
  const cudaDataType_t ab_type = CudaDataType(a.dtype());
  const cudaDataType_t c_type = CudaDataType(c.dtype());
  if (a.dtype() == DType::kFloat64) {
    MPUSIM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        cublas_, op_b, op_a, cm, cn, ck, &alpha, b.data(), ab_type, ldb, stride_b, a.data(),
        ab_type, lda, stride_a, &beta, c.data(), c_type, ldc, stride_c, static_cast<int>(batch),
        CUBLAS_COMPUTE_64F, CUBLAS_GEMM_DEFAULT));
  } else {
    // float32, or 16-bit a and b into a 16-bit or float32 c: float32 products and sums
    // (pedantic math: no TF32, no 16-bit split-K), each element of c rounded once.
    const float alpha_f = static_cast<float>(alpha);
    const float beta_f = static_cast<float>(beta);
    MPUSIM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        cublas_, op_b, op_a, cm, cn, ck, &alpha_f, b.data(), ab_type, ldb, stride_b, a.data(),
        ab_type, lda, stride_a, &beta_f, c.data(), c_type, ldc, stride_c,
        static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

void CudaKernels::DoAddRowVector(const Tensor& bias, Tensor& y) {
  DispatchStorage(bias.dtype(), [&]<typename T>() {
    LaunchAddRowVector<T>(bias.data_as<T>(), y.data_as<T>(), Rows(y), Cols(y), stream_);
  });
}

void CudaKernels::DoSumRows(const Tensor& x, double beta, Tensor& out) {
  DispatchAccumulator(x.dtype(), out.dtype(), [&]<typename T, typename A>() {
    LaunchSumRows<T, A>(x.data_as<T>(), Rows(x), Cols(x), beta, out.data_as<A>(), stream_);
  });
}

void CudaKernels::DoAxpy(double alpha, const Tensor& x, Tensor& y) {
  DispatchAccumulator(x.dtype(), y.dtype(), [&]<typename T, typename A>() {
    LaunchAxpy<T, A>(x.data_as<T>(), y.data_as<A>(), x.numel(), static_cast<ComputeOf<T>>(alpha),
                     stream_);
  });
}

void CudaKernels::DoScale(double alpha, Tensor& x) {
  DispatchStorage(x.dtype(), [&]<typename T>() {
    LaunchScale<T>(x.data_as<T>(), x.numel(), static_cast<ComputeOf<T>>(alpha), stream_);
  });
}

// --- elementwise ----------------------------------------------------------------------

void CudaKernels::DoActivationForward(Activation act, const Tensor& x, Tensor& y,
                                      const GluOptions& glu) {
  DispatchStorage(x.dtype(), [&]<typename T>() {
    LaunchActivationForward<T>(act, x.data_as<T>(), y.data_as<T>(), y.numel(), Cols(y), glu,
                               stream_);
  });
}

void CudaKernels::DoActivationBackward(Activation act, const Tensor& x, const Tensor& dy,
                                       Tensor& dx, const GluOptions& glu) {
  DispatchStorage(x.dtype(), [&]<typename T>() {
    LaunchActivationBackward<T>(act, x.data_as<T>(), dy.data_as<T>(), dx.data_as<T>(), dy.numel(),
                                Cols(dy), glu, stream_);
  });
}

void CudaKernels::DoDropout(const Tensor& x, double p, uint64_t key, uint64_t stream,
                          uint64_t offset, Tensor& y) {
  if (p == 0.0) {
    Copy(x, y);
    return;
  }
  DispatchStorage(x.dtype(), [&]<typename T>() {
    LaunchDropout<T>(x.data_as<T>(), y.data_as<T>(), x.numel(), ops::Dropout{p, key, stream},
                     offset, stream_);
  });
}

void CudaKernels::DoDropoutAt(const Tensor& x, double p, uint64_t key, uint64_t stream,
                              const GlobalIndexMap& map, Tensor& y) {
  if (p == 0.0) {
    Copy(x, y);
    return;
  }
  const IndexMap device_map{map.base,
                            {map.dims[0], map.dims[1], map.dims[2]},
                            {map.strides[0], map.strides[1], map.strides[2]}};
  DispatchStorage(x.dtype(), [&]<typename T>() {
    LaunchDropoutAt<T>(x.data_as<T>(), y.data_as<T>(), x.numel(), ops::Dropout{p, key, stream},
                       device_map, stream_);
  });
}

// --- normalization --------------------------------------------------------------------
// x, weight, bias, y, dy and dx have the storage type T; mean and rstd are ComputeOf<T>;
// dweight and dbias share the accumulator type A (the base class checked all of it). A null
// mean (with bias and dbias) selects the uncentered norm in the launchers.

void CudaKernels::DoNormForward(const Tensor& x, const Tensor& weight, const Tensor* bias,
                                double eps, Tensor& y, Tensor* mean, Tensor& rstd) {
  DispatchStorage(x.dtype(), [&]<typename T>() {
    using C = ComputeOf<T>;
    LaunchNormForward<T>(x.data_as<T>(), weight.data_as<T>(),
                         bias != nullptr ? bias->data_as<T>() : nullptr, Rows(x), Cols(x),
                         static_cast<C>(eps), y.data_as<T>(),
                         mean != nullptr ? mean->data_as<C>() : nullptr, rstd.data_as<C>(),
                         stream_);
  });
}

void CudaKernels::DoNormBackward(const Tensor& x, const Tensor& weight, const Tensor* mean,
                                 const Tensor& rstd, const Tensor& dy, Tensor& dx,
                                 Tensor& dweight, Tensor* dbias) {
  DispatchAccumulator(x.dtype(), dweight.dtype(), [&]<typename T, typename A>() {
    using C = ComputeOf<T>;
    LaunchNormBackward<T, A>(x.data_as<T>(), weight.data_as<T>(),
                             mean != nullptr ? mean->data_as<C>() : nullptr, rstd.data_as<C>(),
                             dy.data_as<T>(), Rows(x), Cols(x), dx.data_as<T>(),
                             dweight.data_as<A>(),
                             dbias != nullptr ? dbias->data_as<A>() : nullptr, stream_);
  });
}

// --- attention ------------------------------------------------------------------------

void CudaKernels::DoCausalSoftmaxForward(const Tensor& scores, const Tensor& q_pos,
                                         const Tensor& k_pos, double scale, Tensor& probs,
                                         Tensor* lse, int64_t window, const Tensor* sink) {
  DispatchStorage(scores.dtype(), [&]<typename T>() {
    using C = ComputeOf<T>;
    LaunchCausalSoftmaxForward<T>(
        scores.data_as<T>(), q_pos.data_as<int64_t>(), q_pos.numel(), k_pos.data_as<int64_t>(),
        Rows(scores), Cols(scores), static_cast<C>(scale), window,
        sink != nullptr ? sink->data_as<T>() : nullptr, sink != nullptr ? sink->numel() : 1,
        probs.data_as<T>(), lse != nullptr ? lse->data_as<C>() : nullptr, stream_);
  });
}

void CudaKernels::DoCausalSoftmaxFromLse(const Tensor& scores, const Tensor& lse,
                                         const Tensor& q_pos, const Tensor& k_pos, double scale,
                                         Tensor& probs, int64_t window) {
  DispatchStorage(scores.dtype(), [&]<typename T>() {
    using C = ComputeOf<T>;
    LaunchCausalSoftmaxFromLse<T>(scores.data_as<T>(), lse.data_as<C>(), q_pos.data_as<int64_t>(),
                                  q_pos.numel(), k_pos.data_as<int64_t>(), Rows(scores),
                                  Cols(scores), static_cast<C>(scale), window, probs.data_as<T>(),
                                  stream_);
  });
}

void CudaKernels::DoCausalSoftmaxBackward(const Tensor& probs, const Tensor& dprobs,
                                          const Tensor& q_pos, const Tensor& k_pos, double scale,
                                          Tensor& dscores, const Tensor* row_dot, int64_t window) {
  DispatchStorage(probs.dtype(), [&]<typename T>() {
    using C = ComputeOf<T>;
    LaunchCausalSoftmaxBackward<T>(
        probs.data_as<T>(), dprobs.data_as<T>(), q_pos.data_as<int64_t>(), q_pos.numel(),
        k_pos.data_as<int64_t>(), Rows(probs), Cols(probs), static_cast<C>(scale), window,
        row_dot != nullptr ? row_dot->data_as<C>() : nullptr, dscores.data_as<T>(), stream_);
  });
}

void CudaKernels::DoSoftmaxSinkGrad(const Tensor& sink, const Tensor& lse, const Tensor& row_dot,
                                    int64_t sq, Tensor& dsink) {
  DispatchAccumulator(sink.dtype(), dsink.dtype(), [&]<typename T, typename A>() {
    using C = ComputeOf<T>;
    LaunchSoftmaxSinkGrad<T, A>(sink.data_as<T>(), sink.numel(), lse.data_as<C>(),
                                row_dot.data_as<C>(), lse.numel(), sq, dsink.data_as<A>(), stream_);
  });
}

void CudaKernels::DoRowDot(const Tensor& a, const Tensor& b, Tensor& out) {
  DispatchStorage(a.dtype(), [&]<typename T>() {
    LaunchRowDot<T>(a.data_as<T>(), b.data_as<T>(), Rows(a), Cols(a),
                    out.data_as<ComputeOf<T>>(), stream_);
  });
}

void CudaKernels::DoLseMerge(Tensor& out, Tensor& lse, const Tensor& part,
                             const Tensor& part_lse) {
  DispatchStorage(out.dtype(), [&]<typename T>() {
    using C = ComputeOf<T>;
    LaunchLseMerge<T>(out.data_as<T>(), lse.data_as<C>(), part.data_as<T>(),
                      part_lse.data_as<C>(), Rows(out), Cols(out), stream_);
  });
}

void CudaKernels::DoRope(const Tensor& x, const Tensor& pos, double base, int64_t dim,
                         bool inverse, Tensor& y) {
  DispatchStorage(x.dtype(), [&]<typename T>() {
    LaunchRope<T>(x.data_as<T>(), Rows(x), Cols(x), dim, pos.data_as<int64_t>(), pos.numel(),
                  base, inverse, y.data_as<T>(), stream_);
  });
}

// --- embedding ------------------------------------------------------------------------

void CudaKernels::DoEmbeddingForward(const Tensor& weight, const Tensor& ids, int64_t vocab_start,
                                     int64_t vocab_end, Tensor& out) {
  if (out.numel() == 0) return;
  DispatchStorage(weight.dtype(), [&]<typename T>() {
    LaunchEmbeddingForward<T>(weight.data_as<T>(), ids.data_as<int64_t>(), ids.numel(),
                              Cols(weight), vocab_start, vocab_end, out.data_as<T>(), stream_);
  });
}

void CudaKernels::DoEmbeddingBackward(const Tensor& dy, const Tensor& ids, int64_t vocab_start,
                                      int64_t vocab_end, Tensor& dweight) {
  const int64_t num_ids = ids.numel();
  const size_t scratch_bytes = EmbeddingBackwardScratchBytes(num_ids, vocab_end - vocab_start);
  if (dy.numel() == 0 || scratch_bytes == 0) return;
  void* scratch = Scratch(scratch_bytes);
  DispatchAccumulator(dy.dtype(), dweight.dtype(), [&]<typename T, typename A>() {
    LaunchEmbeddingBackward<T, A>(dy.data_as<T>(), ids.data_as<int64_t>(), num_ids, Cols(dweight),
                                  vocab_start, vocab_end, dweight.data_as<A>(), scratch, stream_);
  });
}

// --- vocab-parallel cross entropy -----------------------------------------------------
// Logits (and grad) have a storage type T; the statistics are ComputeOf<T> (the base class
// checked that they have the compute dtype of the logits).

void CudaKernels::DoTopK(const Tensor& scores, int64_t k, Tensor& values, Tensor& indices) {
  DispatchStorage(scores.dtype(), [&]<typename T>() {
    LaunchTopK<T>(scores.data_as<T>(), Rows(scores), Cols(scores), k, values.data_as<T>(),
                  indices.data_as<int64_t>(), stream_);
  });
}

void CudaKernels::DoRowMax(const Tensor& logits, Tensor& row_max) {
  DispatchStorage(logits.dtype(), [&]<typename T>() {
    LaunchRowMax<T>(logits.data_as<T>(), Rows(logits), Cols(logits),
                    row_max.data_as<ComputeOf<T>>(), stream_);
  });
}

void CudaKernels::DoCrossEntropyPartials(const Tensor& logits, const Tensor& row_max,
                                         const Tensor& labels, int64_t vocab_start, Tensor& sum_exp,
                                         Tensor& sum_z, Tensor& target_z) {
  const int64_t rows = Rows(logits);
  const int64_t cols = Cols(logits);
  if (rows == 0) return;
  const int64_t* device_labels = labels.data_as<int64_t>();
  DispatchStorage(logits.dtype(), [&]<typename T>() {
    using C = ComputeOf<T>;
    LaunchCrossEntropyPartials<T>(logits.data_as<T>(), row_max.data_as<C>(), device_labels, rows,
                                  cols, vocab_start, sum_exp.data_as<C>(), sum_z.data_as<C>(),
                                  target_z.data_as<C>(), stream_);
  });
}

void CudaKernels::DoCrossEntropyBackward(const Tensor& logits, const Tensor& row_max,
                                         const Tensor& sum_exp, const Tensor& labels,
                                         int64_t vocab_start, double on_value, double off_value,
                                         const Tensor& row_scale, Tensor& grad) {
  const int64_t rows = Rows(logits);
  const int64_t cols = Cols(logits);
  if (rows == 0 || cols == 0) return;
  const int64_t* device_labels = labels.data_as<int64_t>();
  DispatchStorage(logits.dtype(), [&]<typename T>() {
    using C = ComputeOf<T>;
    LaunchCrossEntropyBackward<T>(logits.data_as<T>(), row_max.data_as<C>(), sum_exp.data_as<C>(),
                                  device_labels, rows, cols, vocab_start,
                                  static_cast<C>(on_value), static_cast<C>(off_value),
                                  row_scale.data_as<C>(), grad.data_as<T>(), stream_);
  });
}

// --- optimizer ------------------------------------------------------------------------

void CudaKernels::DoOptimizerStep(const OptimizerUpdate& update, const Tensor& grad,
                                  Tensor& master, Tensor& state1, Tensor& state2, Tensor& param) {
  if (update.param_remainders) {
    const auto m = MomentOf<float>(state1), v = MomentOf<float>(state2);
    DispatchStorage(grad.dtype(), [&]<typename G>() {
      LaunchOptimizerStepWithRemainder<G>(update, grad.data_as<G>(), master.data_as<BFloat16>(), m,
                                          v, param.data_as<BFloat16>(), master.numel(), stream_);
    });
    return;
  }
  DispatchStorage(grad.dtype(), [&]<typename G>() {
    Dispatch(master.dtype(), [&]<typename M>() {
      if constexpr (sizeof(G) == 2 && sizeof(M) == 8) {
        throw std::invalid_argument("OptimizerStep: a 16-bit main_grad steps a float32 master");
      } else {
        DispatchStorage(param.dtype(), [&]<typename P>() {
          const auto m = MomentOf<M>(state1), v = MomentOf<M>(state2);
          LaunchOptimizerStep<G, M, P>(update, grad.data_as<G>(), master.data_as<M>(), m, v,
                                       param.data_as<P>(), master.numel(), stream_);
        });
      }
    });
  });
}

void CudaKernels::DoUnscaleState(const Tensor& q, const Tensor& scale, Tensor& out) {
  LaunchUnscaleState(q.data_as<Float16>(), scale.data_as<float>(), out.data_as<float>(), q.numel(),
                     stream_);
}

void CudaKernels::DoScaleState(const Tensor& x, Tensor& scale, Tensor& q) {
  LaunchScaleState(x.data_as<float>(), scale.data_as<float>(), q.data_as<Float16>(), x.numel(),
                   stream_);
}

void CudaKernels::DoSumOfSquares(const Tensor& x, Tensor& out) {
  DispatchStorage(x.dtype(), [&]<typename T>() {
    LaunchSumOfSquares<T>(x.data_as<T>(), x.numel(), out.data_as<double>(), stream_);
  });
}

}  // namespace mpusim::cuda

