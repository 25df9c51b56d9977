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

class Args : public KernelArgs {
 public:
  explicit Args(std::string_view kernel) : KernelArgs("EigenKernels", Device::kHost, kernel) {}
};

// Column of `label` in a shard starting at vocab_start with `cols` columns, or -1.
int64_t LocalColumn(int64_t label, int64_t vocab_start, int64_t cols) {
  const int64_t col = label - vocab_start;
  return col >= 0 && col < cols ? col : -1;
}

}  // namespace

#if defined(MPUSIM_HAVE_OPENBLAS)
extern "C" void openblas_set_num_threads(int num_threads);
#endif

EigenKernels::EigenKernels() {
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

Tensor EigenKernels::Zeros(const Shape& shape, DType dtype) {
  for (int64_t d : shape) {
    if (d < 0) {
      throw std::invalid_argument(
          fmt::format("EigenKernels::Zeros: negative dimension in {}", ShapeString(shape)));
    }
  }
  return Tensor::HostZeros(shape, dtype);
}

Tensor EigenKernels::Empty(const Shape& shape, DType dtype) {
  for (int64_t d : shape) {
    if (d < 0) {
      throw std::invalid_argument(
          fmt::format("EigenKernels::Empty: negative dimension in {}", ShapeString(shape)));
    }
  }
  return Tensor::HostEmpty(shape, dtype);
}

Tensor EigenKernels::ToDevice(const Tensor& host) {
  Args("ToDevice").Add("host", host);
  Tensor out = Tensor::HostZeros(host.shape(), host.dtype());
  if (host.bytes() > 0) std::memcpy(out.data(), host.data(), host.bytes());
  return out;
}

Tensor EigenKernels::ToHost(const Tensor& tensor) {
  Args("ToHost").Add("tensor", tensor);
  Tensor out = Tensor::HostZeros(tensor.shape(), tensor.dtype());
  if (tensor.bytes() > 0) std::memcpy(out.data(), tensor.data(), tensor.bytes());
  return out;
}

void EigenKernels::Copy(const Tensor& src, Tensor& dst) {
  Args args("Copy");
  args.Add("src", src).Add("dst", dst);
  args.Numel("dst", dst, src.numel(), "the numel of src");
  if (src.bytes() > 0 && src.data() != dst.data()) {
    std::memmove(dst.data(), src.data(), src.bytes());
  }
}

void EigenKernels::CopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                             int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols) {
  Args args("CopyBlock");
  args.Add("src", src).Add("dst", dst);
  const auto check = [&](std::string_view name, const Tensor& t, int64_t row0, int64_t col0) {
    if (rows < 0 || cols < 0 || row0 < 0 || col0 < 0 || row0 + rows > Rows(t) ||
        col0 + cols > Cols(t)) {
      args.Fail(fmt::format("block [{}:{}, {}:{}] is outside {} ({} x {})", row0, row0 + rows, col0,
                            col0 + cols, name, Rows(t), Cols(t)));
    }
  };
  check("src", src, src_row0, src_col0);
  check("dst", dst, dst_row0, dst_col0);
  if (rows == 0 || cols == 0) return;
  Dispatch(args.dtype(), [&]<typename T>() {
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

void EigenKernels::Gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                        double beta, Tensor& c) {
  Args args("Gemm");
  args.Add("a", a).Add("b", b).Add("c", c);
  const int64_t m = trans_a ? Cols(a) : Rows(a);
  const int64_t k = trans_a ? Rows(a) : Cols(a);
  const int64_t kb = trans_b ? Cols(b) : Rows(b);
  const int64_t n = trans_b ? Rows(b) : Cols(b);
  if (k != kb || Rows(c) != m || Cols(c) != n) {
    args.Fail(
        fmt::format("op(a) is {} x {} (a {}, trans_a {}), op(b) is {} x {} (b {}, "
                    "trans_b {}), c is {} x {} ({})",
                    m, k, ShapeString(a.shape()), trans_a, kb, n, ShapeString(b.shape()), trans_b,
                    Rows(c), Cols(c), ShapeString(c.shape())));
  }
  args.Require(!Overlap(a, c) && !Overlap(b, c), "c shares storage with a or b");
  Dispatch(args.dtype(), [&]<typename T>() {
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

void EigenKernels::AddRowVector(const Tensor& bias, Tensor& y) {
  Args args("AddRowVector");
  args.Add("bias", bias).Add("y", y);
  args.Numel("bias", bias, Cols(y), "the columns of y");
  if (y.numel() == 0) return;
  Dispatch(args.dtype(), [&]<typename T>() {
    const Eigen::Map<const RowVector<T>> row(bias.data_as<T>(), Cols(y));
    MatrixOf<T>(y).rowwise() += row;
  });
}

void EigenKernels::SumRows(const Tensor& x, double beta, Tensor& out) {
  Args args("SumRows");
  args.Add("x", x).Add("out", out);
  args.Numel("out", out, Cols(x), "the columns of x");
  Dispatch(args.dtype(), [&]<typename T>() {
    auto o = ArrayOf<T>(out);
    if (beta == 0.0) {
      o.setZero();
    } else if (beta != 1.0) {
      o *= static_cast<T>(beta);
    }
    if (x.numel() > 0) o += MatrixOf<T>(x).colwise().sum().transpose().array();
  });
}

void EigenKernels::Axpy(double alpha, const Tensor& x, Tensor& y) {
  Args args("Axpy");
  args.Add("x", x).Add("y", y);
  args.Numel("y", y, x.numel(), "the numel of x");
  Dispatch(args.dtype(),
           [&]<typename T>() { ArrayOf<T>(y) += static_cast<T>(alpha) * ArrayOf<T>(x); });
}

void EigenKernels::Scale(double alpha, Tensor& x) {
  Args args("Scale");
  args.Add("x", x);
  Dispatch(args.dtype(), [&]<typename T>() { ArrayOf<T>(x) *= static_cast<T>(alpha); });
}

// --- elementwise ----------------------------------------------------------------------

void EigenKernels::GeluForward(const Tensor& x, Tensor& y) {
  Args args("GeluForward");
  args.Add("x", x).Add("y", y);
  args.Numel("y", y, x.numel(), "the numel of x");
  Dispatch(args.dtype(), [&]<typename T>() {
    // Eigen's array erf is vectorised for float (a few ulp), scalar std::erf for double.
    const auto xs = ArrayOf<T>(x);
    auto ys = ArrayOf<T>(y);
    const T inv_sqrt2 = static_cast<T>(1) / std::numbers::sqrt2_v<T>;
    ys = static_cast<T>(0.5) * xs * (static_cast<T>(1) + (xs * inv_sqrt2).erf());
  });
}

void EigenKernels::GeluBackward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  Args args("GeluBackward");
  args.Add("x", x).Add("dy", dy).Add("dx", dx);
  args.Numel("dy", dy, x.numel(), "the numel of x");
  args.Numel("dx", dx, x.numel(), "the numel of x");
  Dispatch(args.dtype(), [&]<typename T>() {
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

void EigenKernels::Dropout(const Tensor& x, double p, uint64_t key, uint64_t stream,
                           uint64_t offset, Tensor& y) {
  Args args("Dropout");
  args.Add("x", x).Add("y", y);
  args.Numel("y", y, x.numel(), "the numel of x");
  args.Require(p >= 0.0 && p <= 1.0, fmt::format("p = {} is not in [0, 1]", p));
  if (p == 0.0) {
    Copy(x, y);
    return;
  }
  Dispatch(args.dtype(), [&]<typename T>() {
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

void EigenKernels::EmbeddingForward(const Tensor& weight, const std::vector<int64_t>& ids,
                                    int64_t vocab_start, int64_t vocab_end, Tensor& out) {
  Args args("EmbeddingForward");
  args.Add("weight", weight).Add("out", out);
  CheckShard(args, "weight", weight, vocab_start, vocab_end);
  const int64_t num_ids = static_cast<int64_t>(ids.size());
  if (Rows(out) != num_ids || Cols(out) != Cols(weight)) {
    args.Fail(fmt::format("out {} must be {} x {} ({} ids, weight {})", ShapeString(out.shape()),
                          num_ids, Cols(weight), num_ids, ShapeString(weight.shape())));
  }
  Dispatch(args.dtype(), [&]<typename T>() {
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

void EigenKernels::EmbeddingBackward(const Tensor& dy, const std::vector<int64_t>& ids,
                                     int64_t vocab_start, int64_t vocab_end, Tensor& dweight) {
  Args args("EmbeddingBackward");
  args.Add("dy", dy).Add("dweight", dweight);
  CheckShard(args, "dweight", dweight, vocab_start, vocab_end);
  const int64_t num_ids = static_cast<int64_t>(ids.size());
  if (Rows(dy) != num_ids || Cols(dy) != Cols(dweight)) {
    args.Fail(fmt::format("dy {} must be {} x {} ({} ids, dweight {})", ShapeString(dy.shape()),
                          num_ids, Cols(dweight), num_ids, ShapeString(dweight.shape())));
  }
  args.Require(!Overlap(dy, dweight), "dy shares storage with dweight");
  Dispatch(args.dtype(), [&]<typename T>() {
    const auto g = MatrixOf<T>(dy);
    auto dw = MatrixOf<T>(dweight);
    for (int64_t i = 0; i < num_ids; ++i) {
      const int64_t id = ids[static_cast<size_t>(i)];
      if (id >= vocab_start && id < vocab_end) dw.row(id - vocab_start) += g.row(i);
    }
  });
}

// --- vocab-parallel cross entropy -----------------------------------------------------

void EigenKernels::RowMax(const Tensor& logits, Tensor& row_max) {
  Args args("RowMax");
  args.Add("logits", logits).Add("row_max", row_max);
  args.Numel("row_max", row_max, Rows(logits), "one per row of logits");
  Dispatch(args.dtype(), [&]<typename T>() {
    auto out = ArrayOf<T>(row_max);
    if (Cols(logits) == 0) {
      out.setConstant(-std::numeric_limits<T>::infinity());
    } else if (Rows(logits) > 0) {
      out = MatrixOf<T>(logits).rowwise().maxCoeff().array();
    }
  });
}

void EigenKernels::CrossEntropyPartials(const Tensor& logits, const Tensor& row_max,
                                        const std::vector<int64_t>& labels, int64_t vocab_start,
                                        Tensor& sum_exp, Tensor& sum_z, Tensor& target_z) {
  Args args("CrossEntropyPartials");
  args.Add("logits", logits).Add("row_max", row_max).Add("sum_exp", sum_exp);
  args.Add("sum_z", sum_z).Add("target_z", target_z);
  const int64_t rows = Rows(logits);
  const int64_t cols = Cols(logits);
  args.Numel("row_max", row_max, rows, "one per row of logits");
  args.Numel("sum_exp", sum_exp, rows, "one per row of logits");
  args.Numel("sum_z", sum_z, rows, "one per row of logits");
  args.Numel("target_z", target_z, rows, "one per row of logits");
  args.Require(static_cast<int64_t>(labels.size()) == rows,
               fmt::format("{} labels for {} rows of logits", labels.size(), rows));
  Dispatch(args.dtype(), [&]<typename T>() {
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

void EigenKernels::CrossEntropyBackward(const Tensor& logits, const Tensor& row_max,
                                        const Tensor& sum_exp, const std::vector<int64_t>& labels,
                                        int64_t vocab_start, double on_value, double off_value,
                                        const Tensor& row_scale, Tensor& grad) {
  Args args("CrossEntropyBackward");
  args.Add("logits", logits).Add("row_max", row_max).Add("sum_exp", sum_exp);
  args.Add("row_scale", row_scale).Add("grad", grad);
  const int64_t rows = Rows(logits);
  const int64_t cols = Cols(logits);
  args.Numel("row_max", row_max, rows, "one per row of logits");
  args.Numel("sum_exp", sum_exp, rows, "one per row of logits");
  args.Numel("row_scale", row_scale, rows, "one per row of logits");
  if (Rows(grad) != rows || Cols(grad) != cols) {
    args.Fail(fmt::format("grad {} must have the 2-D shape of logits {}", ShapeString(grad.shape()),
                          ShapeString(logits.shape())));
  }
  args.Require(static_cast<int64_t>(labels.size()) == rows,
               fmt::format("{} labels for {} rows of logits", labels.size(), rows));
  // grad may be logits itself but no other partial overlap.
  args.Require(grad.data() == logits.data() || !Overlap(grad, logits),
               "grad partially overlaps logits");
  Dispatch(args.dtype(), [&]<typename T>() {
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
