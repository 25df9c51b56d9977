// EigenKernels (see eigen_kernels.h).
//
// Every public method checks its arguments, then calls Dispatch, which runs the body once
// with T = float or T = double. Tensors are viewed through Eigen::Map as row-major
// (rows x cols) matrices or flat arrays; no data is copied except where an operation
// would otherwise read what it has already overwritten (overlapping CopyBlock).
#include "sim/eigen_kernels.h"

#include <malloc.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <numbers>
#include <stdexcept>
#include <string>
#include <string_view>

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>
#include <fmt/format.h>

#include "core/arg_checks.h"
#include "core/philox.h"

namespace mpusim {
namespace {

template <typename T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using RowVector = Eigen::Matrix<T, 1, Eigen::Dynamic>;
template <typename T>
using FlatArray = Eigen::Array<T, Eigen::Dynamic, 1>;

template <typename T>
Eigen::Map<RowMatrix<T>> MatrixOf(Tensor& t) {
  return Eigen::Map<RowMatrix<T>>(t.data_as<T>(), Rows(t), Cols(t));
}
template <typename T>
Eigen::Map<const RowMatrix<T>> MatrixOf(const Tensor& t) {
  return Eigen::Map<const RowMatrix<T>>(t.data_as<T>(), Rows(t), Cols(t));
}
template <typename T>
Eigen::Map<FlatArray<T>> ArrayOf(Tensor& t) {
  return Eigen::Map<FlatArray<T>>(t.data_as<T>(), t.numel());
}
template <typename T>
Eigen::Map<const FlatArray<T>> ArrayOf(const Tensor& t) {
  return Eigen::Map<const FlatArray<T>>(t.data_as<T>(), t.numel());
}

// Column of `label` in a shard starting at vocab_start with `cols` columns, or -1.
int64_t LocalColumn(int64_t label, int64_t vocab_start, int64_t cols) {
  const int64_t col = label - vocab_start;
  return col >= 0 && col < cols ? col : -1;
}

}  // namespace

#if defined(MPUSIM_HAVE_OPENBLAS)
extern "C" void openblas_set_num_threads(int num_threads);
#endif

EigenKernels::EigenKernels() : Kernels("EigenKernels", Device::kHost) {
#if defined(MPUSIM_HAVE_OPENBLAS)
  openblas_set_num_threads(1);
#endif
  // Activations are tens of MiB and freed every step. glibc would hand such blocks back to
  // the kernel (mmap/munmap) and pay page faults to get them again; keeping them in the heap
  // lets the next step reuse them, as a GPU framework's caching allocator does.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// --- memory ---------------------------------------------------------------------------

Tensor EigenKernels::DoZeros(const Shape& shape, DType dtype) {
  return Tensor::HostZeros(shape, dtype);
}

Tensor EigenKernels::DoEmpty(const Shape& shape, DType dtype) {
  return Tensor::HostEmpty(shape, dtype);
}

Tensor EigenKernels::DoToDevice(const Tensor& host) {
  Tensor out = Tensor::HostZeros(host.shape(), host.dtype());
  if (host.bytes() > 0) std::memcpy(out.data(), host.data(), host.bytes());
  return out;
}

Tensor EigenKernels::DoToHost(const Tensor& tensor) {
  Tensor out = Tensor::HostZeros(tensor.shape(), tensor.dtype());
  if (tensor.bytes() > 0) std::memcpy(out.data(), tensor.data(), tensor.bytes());
  return out;
}

void EigenKernels::DoCopy(const Tensor& src, Tensor& dst) {
  if (src.bytes() > 0 && src.data() != dst.data()) {
    std::memmove(dst.data(), src.data(), src.bytes());
  }
}

void EigenKernels::DoCopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                             int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return;
  Dispatch(src.dtype(), [&]<typename T>() {
    const auto from = MatrixOf<T>(src).block(src_row0, src_col0, rows, cols);
    auto to = MatrixOf<T>(dst).block(dst_row0, dst_col0, rows, cols);
    if (Overlap(src, dst)) {
      to = from.eval();  // the blocks may overlap: read all of `from` first
    } else {
      to = from;
    }
  });
}

// --- dense algebra --------------------------------------------------------------------

void EigenKernels::DoGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                        double beta, Tensor& c) {
  const int64_t m = trans_a ? Cols(a) : Rows(a);
  const int64_t k = trans_a ? Rows(a) : Cols(a);
  const int64_t n = trans_b ? Rows(b) : Cols(b);
  Dispatch(a.dtype(), [&]<typename T>() {
    auto cm = MatrixOf<T>(c);
    if (beta == 0.0) {
      cm.setZero();
    } else if (beta != 1.0) {
      cm *= static_cast<T>(beta);
    }
    if (m == 0 || n == 0 || k == 0 || alpha == 0.0) return;
    const auto am = MatrixOf<T>(a);
    const auto bm = MatrixOf<T>(b);
    const T scale = static_cast<T>(alpha);
    // Eigen folds the scalar and the transposes into one call of its blocked GEMM.
    if (!trans_a && !trans_b) {
      cm.noalias() += scale * am * bm;
    } else if (!trans_a && trans_b) {
      cm.noalias() += scale * am * bm.transpose();
    } else if (trans_a && !trans_b) {
      cm.noalias() += scale * am.transpose() * bm;
    } else {
      cm.noalias() += scale * am.transpose() * bm.transpose();
    }
  });
}

void EigenKernels::DoAddRowVector(const Tensor& bias, Tensor& y) {
  if (y.numel() == 0) return;
  Dispatch(bias.dtype(), [&]<typename T>() {
    const Eigen::Map<const RowVector<T>> row(bias.data_as<T>(), Cols(y));
    MatrixOf<T>(y).rowwise() += row;
  });
}

void EigenKernels::DoSumRows(const Tensor& x, double beta, Tensor& out) {
  Dispatch(x.dtype(), [&]<typename T>() {
    auto o = ArrayOf<T>(out);
    if (beta == 0.0) {
      o.setZero();
    } else if (beta != 1.0) {
      o *= static_cast<T>(beta);
    }
    if (x.numel() > 0) o += MatrixOf<T>(x).colwise().sum().transpose().array();
  });
}

void EigenKernels::DoAxpy(double alpha, const Tensor& x, Tensor& y) {
  Dispatch(x.dtype(),
           [&]<typename T>() { ArrayOf<T>(y) += static_cast<T>(alpha) * ArrayOf<T>(x); });
}

void EigenKernels::DoScale(double alpha, Tensor& x) {
  Dispatch(x.dtype(), [&]<typename T>() { ArrayOf<T>(x) *= static_cast<T>(alpha); });
}

// --- elementwise ----------------------------------------------------------------------

void EigenKernels::DoGeluForward(const Tensor& x, Tensor& y) {
  Dispatch(x.dtype(), [&]<typename T>() {
    // Eigen's array erf is vectorised for float (a few ulp), scalar std::erf for double.
    const auto xs = ArrayOf<T>(x);
    auto ys = ArrayOf<T>(y);
    const T inv_sqrt2 = static_cast<T>(1) / std::numbers::sqrt2_v<T>;
    ys = static_cast<T>(0.5) * xs * (static_cast<T>(1) + (xs * inv_sqrt2).erf());
  });
}

void EigenKernels::DoGeluBackward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  Dispatch(x.dtype(), [&]<typename T>() {
    const auto xs = ArrayOf<T>(x);
    const auto dys = ArrayOf<T>(dy);
    auto dxs = ArrayOf<T>(dx);
    const T inv_sqrt2 = static_cast<T>(1) / std::numbers::sqrt2_v<T>;
    // phi(x) = exp(-x^2 / 2) / sqrt(2 pi) = exp(-x^2 / 2) * (1 / sqrt(pi)) / sqrt(2)
    const T inv_sqrt_2pi = std::numbers::inv_sqrtpi_v<T> * inv_sqrt2;
    dxs = dys * (static_cast<T>(0.5) * (static_cast<T>(1) + (xs * inv_sqrt2).erf()) +
                 xs * (static_cast<T>(-0.5) * xs.square()).exp() * inv_sqrt_2pi);
  });
}

void EigenKernels::DoDropout(const Tensor& x, double p, uint64_t key, uint64_t stream,
                           uint64_t offset, Tensor& y) {
  if (p == 0.0) {
    Copy(x, y);
    return;
  }
  Dispatch(x.dtype(), [&]<typename T>() {
    const T* xs = x.data_as<T>();
    T* ys = y.data_as<T>();
    const T keep_probability = static_cast<T>(1.0 - p);  // unused when p == 1: nothing is kept
    const uint64_t n = static_cast<uint64_t>(x.numel());
    for (uint64_t e = 0; e < n; ++e) {
      const bool keep = UniformAt(key, stream, offset + e) >= p;
      ys[e] = keep ? xs[e] / keep_probability : static_cast<T>(0);
    }
  });
}

// --- embedding ------------------------------------------------------------------------

void EigenKernels::DoEmbeddingForward(const Tensor& weight, const std::vector<int64_t>& ids,
                                    int64_t vocab_start, int64_t vocab_end, Tensor& out) {
  const int64_t num_ids = static_cast<int64_t>(ids.size());
  Dispatch(weight.dtype(), [&]<typename T>() {
    const auto w = MatrixOf<T>(weight);
    auto o = MatrixOf<T>(out);
    for (int64_t i = 0; i < num_ids; ++i) {
      const int64_t id = ids[static_cast<size_t>(i)];
      if (id >= vocab_start && id < vocab_end) {
        o.row(i) = w.row(id - vocab_start);
      } else {
        o.row(i).setZero();  // another shard owns this token (Megatron's input mask)
      }
    }
  });
}

void EigenKernels::DoEmbeddingBackward(const Tensor& dy, const std::vector<int64_t>& ids,
                                     int64_t vocab_start, int64_t vocab_end, Tensor& dweight) {
  const int64_t num_ids = static_cast<int64_t>(ids.size());
  Dispatch(dy.dtype(), [&]<typename T>() {
    const auto g = MatrixOf<T>(dy);
    auto dw = MatrixOf<T>(dweight);
    for (int64_t i = 0; i < num_ids; ++i) {
      const int64_t id = ids[static_cast<size_t>(i)];
      if (id >= vocab_start && id < vocab_end) dw.row(id - vocab_start) += g.row(i);
    }
  });
}

// --- vocab-parallel cross entropy -----------------------------------------------------

void EigenKernels::DoRowMax(const Tensor& logits, Tensor& row_max) {
  Dispatch(logits.dtype(), [&]<typename T>() {
    auto out = ArrayOf<T>(row_max);
    if (Cols(logits) == 0) {
      out.setConstant(-std::numeric_limits<T>::infinity());
    } else if (Rows(logits) > 0) {
      out = MatrixOf<T>(logits).rowwise().maxCoeff().array();
    }
  });
}

void EigenKernels::DoCrossEntropyPartials(const Tensor& logits, const Tensor& row_max,
                                        const std::vector<int64_t>& labels, int64_t vocab_start,
                                        Tensor& sum_exp, Tensor& sum_z, Tensor& target_z) {
  const int64_t rows = Rows(logits);
  const int64_t cols = Cols(logits);
  Dispatch(logits.dtype(), [&]<typename T>() {
    const auto l = MatrixOf<T>(logits);
    const auto m = ArrayOf<T>(row_max);
    auto se = ArrayOf<T>(sum_exp);
    auto sz = ArrayOf<T>(sum_z);
    auto tz = ArrayOf<T>(target_z);
    for (int64_t i = 0; i < rows; ++i) {
      const auto z = l.row(i).array() - m[i];
      se[i] = z.exp().sum();
      sz[i] = z.sum();
      const int64_t col = LocalColumn(labels[static_cast<size_t>(i)], vocab_start, cols);
      tz[i] = col >= 0 ? l(i, col) - m[i] : static_cast<T>(0);
    }
  });
}

void EigenKernels::DoCrossEntropyBackward(const Tensor& logits, const Tensor& row_max,
                                        const Tensor& sum_exp, const std::vector<int64_t>& labels,
                                        int64_t vocab_start, double on_value, double off_value,
                                        const Tensor& row_scale, Tensor& grad) {
  const int64_t rows = Rows(logits);
  const int64_t cols = Cols(logits);
  Dispatch(logits.dtype(), [&]<typename T>() {
    const auto l = MatrixOf<T>(logits);
    const auto m = ArrayOf<T>(row_max);
    const auto se = ArrayOf<T>(sum_exp);
    const auto scale = ArrayOf<T>(row_scale);
    auto g = MatrixOf<T>(grad);
    const T on = static_cast<T>(on_value);
    const T off = static_cast<T>(off_value);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t col = LocalColumn(labels[static_cast<size_t>(i)], vocab_start, cols);
      // Read the label's logit before the row is overwritten (grad may be logits).
      const T z_label = col >= 0 ? l(i, col) - m[i] : static_cast<T>(0);
      g.row(i).array() = scale[i] * ((l.row(i).array() - m[i]).exp() / se[i] - off);
      if (col >= 0) g(i, col) = scale[i] * (std::exp(z_label) / se[i] - on);
    }
  });
}

}  // namespace mpusim
