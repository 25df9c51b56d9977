// The argument checks every backend's kernels share (see kernels.h); the work itself is in
// the backends' Do* methods.
#include "core/kernels.h"

#include <string_view>

#include <fmt/format.h>

#include "core/arg_checks.h"

namespace mpusim {
namespace {

void CheckDims(const char* backend, std::string_view kernel, const Shape& shape) {
  for (int64_t d : shape) {
    if (d < 0) {
      throw std::invalid_argument(
          fmt::format("{}::{}: negative dimension in {}", backend, kernel, ShapeString(shape)));
    }
  }
}

}  // namespace

Tensor Kernels::Zeros(const Shape& shape, DType dtype) {
  CheckDims(backend_, "Zeros", shape);
  return DoZeros(shape, dtype);
}

Tensor Kernels::Empty(const Shape& shape, DType dtype) {
  CheckDims(backend_, "Empty", shape);
  return DoEmpty(shape, dtype);
}

Tensor Kernels::ToDevice(const Tensor& host) {
  KernelArgs(backend_, device_, "ToDevice").Add("host", host, Device::kHost);
  return DoToDevice(host);
}

Tensor Kernels::ToHost(const Tensor& tensor) {
  KernelArgs(backend_, device_, "ToHost").Add("tensor", tensor);
  return DoToHost(tensor);
}

void Kernels::Copy(const Tensor& src, Tensor& dst) {
  KernelArgs args(backend_, device_, "Copy");
  args.Add("src", src).Add("dst", dst);
  args.Numel("dst", dst, src.numel(), "the numel of src");
  DoCopy(src, dst);
}

void Kernels::SetZero(Tensor& x) {
  KernelArgs(backend_, device_, "SetZero").Add("x", x);
  DoSetZero(x);
}

void Kernels::CopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                        int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols) {
  KernelArgs args(backend_, device_, "CopyBlock");
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
  DoCopyBlock(src, src_row0, src_col0, dst, dst_row0, dst_col0, rows, cols);
}

void Kernels::Gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                   double beta, Tensor& c) {
  KernelArgs args(backend_, device_, "Gemm");
  args.Add("a", a).Add("b", b).AddAccumulator("c", c);
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
  DoGemm(trans_a, trans_b, alpha, a, b, beta, c);
}

void Kernels::AddRowVector(const Tensor& bias, Tensor& y) {
  KernelArgs args(backend_, device_, "AddRowVector");
  args.Add("bias", bias).Add("y", y);
  args.Numel("bias", bias, Cols(y), "the columns of y");
  if (y.numel() == 0) return;
  DoAddRowVector(bias, y);
}

void Kernels::SumRows(const Tensor& x, double beta, Tensor& out) {
  KernelArgs args(backend_, device_, "SumRows");
  args.Add("x", x).AddAccumulator("out", out);
  args.Numel("out", out, Cols(x), "the columns of x");
  DoSumRows(x, beta, out);
}

void Kernels::Axpy(double alpha, const Tensor& x, Tensor& y) {
  KernelArgs args(backend_, device_, "Axpy");
  args.Add("x", x).AddAccumulator("y", y);
  args.Numel("y", y, x.numel(), "the numel of x");
  DoAxpy(alpha, x, y);
}

void Kernels::Scale(double alpha, Tensor& x) {
  KernelArgs(backend_, device_, "Scale").Add("x", x);
  DoScale(alpha, x);
}

void Kernels::GeluForward(const Tensor& x, Tensor& y) {
  KernelArgs args(backend_, device_, "GeluForward");
  args.Add("x", x).Add("y", y);
  args.Numel("y", y, x.numel(), "the numel of x");
  DoGeluForward(x, y);
}

void Kernels::GeluBackward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  KernelArgs args(backend_, device_, "GeluBackward");
  args.Add("x", x).Add("dy", dy).Add("dx", dx);
  args.Numel("dy", dy, x.numel(), "the numel of x");
  args.Numel("dx", dx, x.numel(), "the numel of x");
  DoGeluBackward(x, dy, dx);
}

void Kernels::Dropout(const Tensor& x, double p, uint64_t key, uint64_t stream, uint64_t offset,
                      Tensor& y) {
  KernelArgs args(backend_, device_, "Dropout");
  args.Add("x", x).Add("y", y);
  args.Numel("y", y, x.numel(), "the numel of x");
  args.Require(p >= 0.0 && p <= 1.0, fmt::format("p = {} is not in [0, 1]", p));
  DoDropout(x, p, key, stream, offset, y);
}

void Kernels::EmbeddingForward(const Tensor& weight, const std::vector<int64_t>& ids,
                               int64_t vocab_start, int64_t vocab_end, Tensor& out) {
  KernelArgs args(backend_, device_, "EmbeddingForward");
  args.Add("weight", weight).Add("out", out);
  CheckShard(args, "weight", weight, vocab_start, vocab_end);
  const int64_t num_ids = static_cast<int64_t>(ids.size());
  if (Rows(out) != num_ids || Cols(out) != Cols(weight)) {
    args.Fail(fmt::format("out {} must be {} x {} ({} ids, weight {})", ShapeString(out.shape()),
                          num_ids, Cols(weight), num_ids, ShapeString(weight.shape())));
  }
  DoEmbeddingForward(weight, ids, vocab_start, vocab_end, out);
}

void Kernels::EmbeddingBackward(const Tensor& dy, const std::vector<int64_t>& ids,
                                int64_t vocab_start, int64_t vocab_end, Tensor& dweight) {
  KernelArgs args(backend_, device_, "EmbeddingBackward");
  args.Add("dy", dy).AddAccumulator("dweight", dweight);
  CheckShard(args, "dweight", dweight, vocab_start, vocab_end);
  const int64_t num_ids = static_cast<int64_t>(ids.size());
  if (Rows(dy) != num_ids || Cols(dy) != Cols(dweight)) {
    args.Fail(fmt::format("dy {} must be {} x {} ({} ids, dweight {})", ShapeString(dy.shape()),
                          num_ids, Cols(dweight), num_ids, ShapeString(dweight.shape())));
  }
  args.Require(!Overlap(dy, dweight), "dy shares storage with dweight");
  DoEmbeddingBackward(dy, ids, vocab_start, vocab_end, dweight);
}

void Kernels::RowMax(const Tensor& logits, Tensor& row_max) {
  KernelArgs args(backend_, device_, "RowMax");
  args.Add("logits", logits).AddCompute("row_max", row_max);
  args.Numel("row_max", row_max, Rows(logits), "one per row of logits");
  DoRowMax(logits, row_max);
}

void Kernels::CrossEntropyPartials(const Tensor& logits, const Tensor& row_max,
                                   const std::vector<int64_t>& labels, int64_t vocab_start,
                                   Tensor& sum_exp, Tensor& sum_z, Tensor& target_z) {
  KernelArgs args(backend_, device_, "CrossEntropyPartials");
  args.Add("logits", logits).AddCompute("row_max", row_max).AddCompute("sum_exp", sum_exp);
  args.AddCompute("sum_z", sum_z).AddCompute("target_z", target_z);
  const int64_t rows = Rows(logits);
  args.Numel("row_max", row_max, rows, "one per row of logits");
  args.Numel("sum_exp", sum_exp, rows, "one per row of logits");
  args.Numel("sum_z", sum_z, rows, "one per row of logits");
  args.Numel("target_z", target_z, rows, "one per row of logits");
  args.Require(static_cast<int64_t>(labels.size()) == rows,
               fmt::format("{} labels for {} rows of logits", labels.size(), rows));
  DoCrossEntropyPartials(logits, row_max, labels, vocab_start, sum_exp, sum_z, target_z);
}

void Kernels::CrossEntropyBackward(const Tensor& logits, const Tensor& row_max,
                                   const Tensor& sum_exp, const std::vector<int64_t>& labels,
                                   int64_t vocab_start, double on_value, double off_value,
                                   const Tensor& row_scale, Tensor& grad) {
  KernelArgs args(backend_, device_, "CrossEntropyBackward");
  args.Add("logits", logits).Add("grad", grad);
  args.AddCompute("row_max", row_max).AddCompute("sum_exp", sum_exp);
  args.AddCompute("row_scale", row_scale);
  const int64_t rows = Rows(logits);
  args.Numel("row_max", row_max, rows, "one per row of logits");
  args.Numel("sum_exp", sum_exp, rows, "one per row of logits");
  args.Numel("row_scale", row_scale, rows, "one per row of logits");
  if (Rows(grad) != rows || Cols(grad) != Cols(logits)) {
    args.Fail(fmt::format("grad {} must have the 2-D shape of logits {}", ShapeString(grad.shape()),
                          ShapeString(logits.shape())));
  }
  args.Require(static_cast<int64_t>(labels.size()) == rows,
               fmt::format("{} labels for {} rows of logits", labels.size(), rows));
  // grad may be logits itself but no other partial overlap.
  args.Require(grad.data() == logits.data() || !Overlap(grad, logits),
               "grad partially overlaps logits");
  DoCrossEntropyBackward(logits, row_max, sum_exp, labels, vocab_start, on_value, off_value,
                         row_scale, grad);
}

}  // namespace mpusim
