// The argument checks every backend's kernels share (see kernels.h); the work itself is in
// the backends' Do* methods.
#include "core/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

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

// `t` has the 2-D view rows x cols.
void CheckMatrix(const KernelArgs& args, std::string_view name, const Tensor& t, int64_t rows,
                 int64_t cols, std::string_view because) {
  if (Rows(t) != rows || Cols(t) != cols) {
    args.Fail(fmt::format("{} {} must be {} x {} ({})", name, ShapeString(t.shape()), rows, cols,
                          because));
  }
}

// An output that may be computed in place: the same storage as `in`, or none of it.
void SameOrDisjoint(const KernelArgs& args, std::string_view out_name, const Tensor& out,
                    std::string_view in_name, const Tensor& in) {
  if (out.data() != in.data() && Overlap(out, in)) {
    args.Fail(fmt::format("{} partially overlaps {}", out_name, in_name));
  }
}

// Two tensors of one call that must not share storage (an output and anything else).
void Disjoint(const KernelArgs& args, std::string_view a_name, const Tensor& a,
              std::string_view b_name, const Tensor& b) {
  if (Overlap(a, b)) args.Fail(fmt::format("{} shares storage with {}", a_name, b_name));
}

// Rows of `seq` positions: seq >= 1 divides the rows of t.
// The query positions of `t`'s rows: an int64 tensor [sq], sq >= 1 dividing the rows (row r
// is position q_pos[r % sq]).
void CheckQueryPositions(KernelArgs& args, std::string_view name, const Tensor& t,
                         std::string_view pos_name, const Tensor& q_pos) {
  args.AddInt64(pos_name, q_pos);
  if (q_pos.shape().size() != 1 || q_pos.numel() < 1 || Rows(t) % q_pos.numel() != 0) {
    args.Fail(fmt::format("{} {} must be 1-D with at least one position, dividing the {} rows "
                          "of {} {}",
                          pos_name, ShapeString(q_pos.shape()), Rows(t), name,
                          ShapeString(t.shape())));
  }
}

// Query and key positions of a scores-shaped [rows, kv] tensor: q_pos as above, k_pos [kv].
void CheckAttentionPositions(KernelArgs& args, std::string_view name, const Tensor& t,
                             const Tensor& q_pos, const Tensor& k_pos, int64_t window) {
  CheckQueryPositions(args, name, t, "q_pos", q_pos);
  args.AddIndices("k_pos", k_pos, Cols(t), "one per column (key) of scores");
  if (k_pos.shape().size() != 1) {
    args.Fail(fmt::format("k_pos {} must be 1-D", ShapeString(k_pos.shape())));
  }
  args.Require(window >= -1, fmt::format("window = {} must be -1 (none) or >= 0", window));
}

// An attention sink's logits [heads] for rows of sq query rows per head: heads >= 1 dividing
// rows / sq.
void CheckSink(KernelArgs& args, const Tensor& sink, int64_t rows, const Tensor& q_pos) {
  args.Add("sink", sink);
  const int64_t heads = sink.numel(), sq = q_pos.numel();
  if (sink.shape().size() != 1 || heads < 1 || sq < 1 || rows % sq != 0 ||
      (rows / sq) % heads != 0) {
    args.Fail(
        fmt::format("sink {} must be [heads] with heads dividing the {} rows / {} query "
                    "positions",
                    ShapeString(sink.shape()), rows, sq));
  }
}

// The checks of both norms' forward: x [n, h] with h >= 1, weight (and bias) [h], y like x,
// the statistics [n], eps >= 0; y may be x.
void CheckNormForward(const KernelArgs& args, const Tensor& x, const Tensor& weight,
                      const Tensor* bias, double eps, const Tensor& y, const Tensor* mean,
                      const Tensor& rstd) {
  const int64_t n = Rows(x);
  const int64_t h = Cols(x);
  args.Require(h >= 1, fmt::format("x {} has no columns to normalize", ShapeString(x.shape())));
  args.Numel("weight", weight, h, "the columns of x");
  if (bias != nullptr) args.Numel("bias", *bias, h, "the columns of x");
  CheckMatrix(args, "y", y, n, h, "the 2-D shape of x");
  if (mean != nullptr) args.Numel("mean", *mean, n, "one per row of x");
  args.Numel("rstd", rstd, n, "one per row of x");
  args.Require(std::isfinite(eps) && eps >= 0, fmt::format("eps = {} must be >= 0", eps));
  SameOrDisjoint(args, "y", y, "x", x);
  Disjoint(args, "y", y, "weight", weight);
  if (bias != nullptr) Disjoint(args, "y", y, "bias", *bias);
  for (const auto& [name, stat] : {std::pair<std::string_view, const Tensor*>{"mean", mean},
                                   {"rstd", &rstd}}) {
    if (stat == nullptr) continue;
    Disjoint(args, name, *stat, "x", x);
    Disjoint(args, name, *stat, "y", y);
  }
  if (mean != nullptr) Disjoint(args, "mean", *mean, "rstd", rstd);
}

// The checks of both norms' backward: shapes as in the forward, dy and dx like x (dx may be
// dy), the accumulators [h] apart from every other tensor.
void CheckNormBackward(const KernelArgs& args, const Tensor& x, const Tensor& weight,
                       const Tensor* mean, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                       const Tensor& dweight, const Tensor* dbias) {
  const int64_t n = Rows(x);
  const int64_t h = Cols(x);
  args.Require(h >= 1, fmt::format("x {} has no columns to normalize", ShapeString(x.shape())));
  args.Numel("weight", weight, h, "the columns of x");
  if (mean != nullptr) args.Numel("mean", *mean, n, "one per row of x");
  args.Numel("rstd", rstd, n, "one per row of x");
  CheckMatrix(args, "dy", dy, n, h, "the 2-D shape of x");
  CheckMatrix(args, "dx", dx, n, h, "the 2-D shape of x");
  args.Numel("dweight", dweight, h, "the columns of x");
  if (dbias != nullptr) {
    args.Numel("dbias", *dbias, h, "the columns of x");
    args.Require(dbias->dtype() == dweight.dtype(),
                 fmt::format("dbias is {} but dweight is {}", DTypeName(dbias->dtype()),
                             DTypeName(dweight.dtype())));
  }
  SameOrDisjoint(args, "dx", dx, "dy", dy);
  Disjoint(args, "dx", dx, "x", x);
  Disjoint(args, "dx", dx, "weight", weight);
  Disjoint(args, "dx", dx, "rstd", rstd);
  if (mean != nullptr) Disjoint(args, "dx", dx, "mean", *mean);
  for (const auto& [name, acc] : {std::pair<std::string_view, const Tensor*>{"dweight", &dweight},
                                  {"dbias", dbias}}) {
    if (acc == nullptr) continue;
    for (const auto& [other_name, other] :
         {std::pair<std::string_view, const Tensor*>{"x", &x}, {"weight", &weight},
          {"mean", mean}, {"rstd", &rstd}, {"dy", &dy}, {"dx", &dx}}) {
      if (other != nullptr) Disjoint(args, name, *acc, other_name, *other);
    }
  }
  if (dbias != nullptr) Disjoint(args, "dweight", dweight, "dbias", *dbias);
}

// offset + sum_k (dims[k] - 1) * strides[k], the last element a StridedCopy addresses in
// one tensor, must be inside its `numel` elements (dims >= 1, strides >= 0 checked before).
void CheckSpan(const KernelArgs& args, std::string_view name, const Tensor& t, int64_t offset,
               const std::vector<int64_t>& dims, const std::vector<int64_t>& strides) {
  int64_t last = offset;
  bool overflow = false;
  for (size_t k = 0; k < dims.size(); ++k) {
    int64_t step = 0;
    overflow = overflow || __builtin_mul_overflow(dims[k] - 1, strides[k], &step) ||
               __builtin_add_overflow(last, step, &last);
  }
  if (overflow || last >= t.numel()) {
    args.Fail(fmt::format("{} offset {} with dims [{}] and strides [{}] reaches element {} but "
                          "{} {} has {}",
                          name, offset, fmt::join(dims, ", "), fmt::join(strides, ", "),
                          overflow ? "beyond int64" : fmt::format("{}", last), name,
                          ShapeString(t.shape()), t.numel()));
  }
}

}  // namespace

Tensor Kernels::Zeros(const Shape& shape, DType dtype) {
  CheckDims(backend_, "Zeros", shape);
  return Counted(DoZeros(shape, dtype));
}

Tensor Kernels::Empty(const Shape& shape, DType dtype) {
  CheckDims(backend_, "Empty", shape);
  return Counted(DoEmpty(shape, dtype));
}

Tensor Kernels::Counted(Tensor t) {
  const auto bytes = static_cast<int64_t>(t.bytes());
  if (bytes == 0) return t;
  const int64_t live = bytes_->live.fetch_add(bytes) + bytes;
  int64_t peak = bytes_->peak.load();
  while (live > peak && !bytes_->peak.compare_exchange_weak(peak, live)) {
  }
  Shape shape = t.shape();
  const DType dtype = t.dtype();
  const Device device = t.device();
  void* data = t.data();
  // The deleter holds the backend's tensor (its storage returns to the backend when the last
  // handle of the counted one goes) and the counter (which may outlive these kernels).
  std::shared_ptr<void> storage(data,
                                [counter = bytes_, held = std::move(t), bytes](void*) mutable {
                                  counter->live.fetch_sub(bytes);
                                  held = Tensor();
                                });
  return Tensor(std::move(shape), dtype, device, std::move(storage));
}

Kernels::TensorBytes Kernels::tensor_bytes() const {
  return {bytes_->live.load(), bytes_->peak.load()};
}

void Kernels::ResetPeakTensorBytes() { bytes_->peak.store(bytes_->live.load()); }

Tensor Kernels::ToDevice(const Tensor& host) {
  KernelArgs(backend_, device_, "ToDevice", KernelDTypes::kAny).Add("host", host, Device::kHost);
  return Counted(DoToDevice(host));
}

Tensor Kernels::ToHost(const Tensor& tensor) {
  KernelArgs(backend_, device_, "ToHost", KernelDTypes::kAny).Add("tensor", tensor);
  return DoToHost(tensor);
}

void Kernels::Copy(const Tensor& src, Tensor& dst) {
  KernelArgs args(backend_, device_, "Copy", KernelDTypes::kAny);
  args.Add("src", src).Add("dst", dst);
  args.Numel("dst", dst, src.numel(), "the numel of src");
  DoCopy(src, dst);
}

void Kernels::Convert(const Tensor& src, Tensor& dst) {
  KernelArgs(backend_, device_, "Convert").Add("src", src);
  KernelArgs args(backend_, device_, "Convert");
  args.Add("dst", dst);
  args.Numel("dst", dst, src.numel(), "the numel of src");
  if (src.numel() > 0 && Overlap(src, dst)) args.Fail("src and dst overlap");
  if (src.numel() == 0) return;
  if (src.dtype() == dst.dtype()) {
    DoCopy(src, dst);
    return;
  }
  DoConvert(src, dst);
}

void Kernels::SetZero(Tensor& x) {
  KernelArgs(backend_, device_, "SetZero", KernelDTypes::kAny).Add("x", x);
  DoSetZero(x);
}

void Kernels::CopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                        int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols) {
  KernelArgs args(backend_, device_, "CopyBlock", KernelDTypes::kAny);
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

void Kernels::StridedCopy(const Tensor& src, int64_t src_offset, const std::vector<int64_t>& dims,
                          const std::vector<int64_t>& src_strides, Tensor& dst,
                          int64_t dst_offset, const std::vector<int64_t>& dst_strides) {
  KernelArgs args(backend_, device_, "StridedCopy", KernelDTypes::kAny);
  args.Add("src", src).Add("dst", dst);
  const size_t rank = dims.size();
  args.Require(rank >= 1 && rank <= static_cast<size_t>(kMaxCopyDims),
               fmt::format("{} dimensions; 1 to {} are supported", rank, kMaxCopyDims));
  args.Require(src_strides.size() == rank && dst_strides.size() == rank,
               fmt::format("{} dims but {} src_strides and {} dst_strides", rank,
                           src_strides.size(), dst_strides.size()));
  const auto non_negative = [](const std::vector<int64_t>& v) {
    return std::all_of(v.begin(), v.end(), [](int64_t e) { return e >= 0; });
  };
  args.Require(non_negative(dims) && non_negative(src_strides) && non_negative(dst_strides) &&
                   src_offset >= 0 && dst_offset >= 0,
               fmt::format("dims [{}], strides [{}] and [{}] and offsets {} and {} must be >= 0",
                           fmt::join(dims, ", "), fmt::join(src_strides, ", "),
                           fmt::join(dst_strides, ", "), src_offset, dst_offset));
  if (std::find(dims.begin(), dims.end(), int64_t{0}) != dims.end()) return;  // no element
  CheckSpan(args, "src", src, src_offset, dims, src_strides);
  CheckSpan(args, "dst", dst, dst_offset, dims, dst_strides);
  Disjoint(args, "dst", dst, "src", src);
  // Every dst element at most once, so the copy order cannot matter: with the dimensions of
  // more than one element sorted by stride, each stride must exceed the span the smaller
  // ones cover (a sufficient condition that every strided sub-block of a dense tensor
  // meets). The spans stay below dst.numel(), checked above, so nothing overflows.
  std::vector<std::pair<int64_t, int64_t>> by_stride;  // (stride, dim)
  for (size_t k = 0; k < rank; ++k) {
    if (dims[k] > 1) by_stride.emplace_back(dst_strides[k], dims[k]);
  }
  std::sort(by_stride.begin(), by_stride.end());
  int64_t span = 0;
  for (const auto& [stride, dim] : by_stride) {
    if (stride <= span) {
      args.Fail(fmt::format("dst_strides [{}] with dims [{}] address some dst element twice",
                            fmt::join(dst_strides, ", "), fmt::join(dims, ", ")));
    }
    span += (dim - 1) * stride;
  }
  DoStridedCopy(src, src_offset, dims, src_strides, dst, dst_offset, dst_strides);
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

void Kernels::BatchedGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a,
                          const Tensor& b, double beta, Tensor& c) {
  KernelArgs args(backend_, device_, "BatchedGemm");
  args.Add("a", a).Add("b", b).AddAccumulator("c", c);
  for (const auto& [name, t] : {std::pair<std::string_view, const Tensor*>{"a", &a},
                                {"b", &b}, {"c", &c}}) {
    if (t->shape().size() != 3) {
      args.Fail(fmt::format("{} {} is not 3-D [batch, rows, cols]", name,
                            ShapeString(t->shape())));
    }
  }
  const Shape& as = a.shape();
  const Shape& bs = b.shape();
  const Shape& cs = c.shape();
  const int64_t m = trans_a ? as[2] : as[1];
  const int64_t k = trans_a ? as[1] : as[2];
  const int64_t kb = trans_b ? bs[2] : bs[1];
  const int64_t n = trans_b ? bs[1] : bs[2];
  if (bs[0] != as[0] || cs[0] != as[0] || k != kb || cs[1] != m || cs[2] != n) {
    args.Fail(fmt::format("a {} (trans_a {}), b {} (trans_b {}) and c {} are not batch x "
                          "(m x k) @ (k x n) = m x n with one batch",
                          ShapeString(as), trans_a, ShapeString(bs), trans_b, ShapeString(cs)));
  }
  args.Require(!Overlap(a, c) && !Overlap(b, c), "c shares storage with a or b");
  if (c.numel() == 0) return;
  DoBatchedGemm(trans_a, trans_b, alpha, a, b, beta, c);
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

// A clamp bound must be a finite number > 0 (Megatron's rule for activation_func_clamp_value).
static void CheckGlu(const KernelArgs& args, const GluOptions& glu) {
  args.Require(!glu.clamped || (std::isfinite(glu.clamp_value) && glu.clamp_value > 0),
               fmt::format("the glu clamp value {} must be finite and > 0", glu.clamp_value));
  args.Require(std::isfinite(glu.linear_offset),
               fmt::format("the glu linear offset {} must be finite", glu.linear_offset));
}

void Kernels::ActivationForward(Activation act, const Tensor& x, Tensor& y, const GluOptions& glu) {
  const std::string name = fmt::format("ActivationForward({})", ActivationName(act));
  KernelArgs args(backend_, device_, name.c_str());
  args.Add("x", x).Add("y", y);
  if (IsGated(act)) {
    args.Require(Cols(x) % 2 == 0,
                 fmt::format("x {} must have an even number of columns ([a | b])",
                             ShapeString(x.shape())));
    CheckMatrix(args, "y", y, Rows(x), Cols(x) / 2, "half the columns of x");
    Disjoint(args, "y", y, "x", x);
    CheckGlu(args, glu);
  } else {
    args.Numel("y", y, x.numel(), "the numel of x");
    SameOrDisjoint(args, "y", y, "x", x);
  }
  if (y.numel() == 0) return;
  DoActivationForward(act, x, y, glu);
}

void Kernels::ActivationBackward(Activation act, const Tensor& x, const Tensor& dy, Tensor& dx,
                                 const GluOptions& glu) {
  const std::string name = fmt::format("ActivationBackward({})", ActivationName(act));
  KernelArgs args(backend_, device_, name.c_str());
  args.Add("x", x).Add("dy", dy).Add("dx", dx);
  if (IsGated(act)) {
    args.Require(Cols(x) % 2 == 0,
                 fmt::format("x {} must have an even number of columns ([a | b])",
                             ShapeString(x.shape())));
    CheckMatrix(args, "dy", dy, Rows(x), Cols(x) / 2, "half the columns of x");
    CheckMatrix(args, "dx", dx, Rows(x), Cols(x), "the 2-D shape of x");
    Disjoint(args, "dx", dx, "dy", dy);
    CheckGlu(args, glu);
  } else {
    args.Numel("dy", dy, x.numel(), "the numel of x");
    args.Numel("dx", dx, x.numel(), "the numel of x");
    SameOrDisjoint(args, "dx", dx, "dy", dy);
  }
  SameOrDisjoint(args, "dx", dx, "x", x);
  if (dy.numel() == 0) return;
  DoActivationBackward(act, x, dy, dx, glu);
}

void Kernels::Dropout(const Tensor& x, double p, uint64_t key, uint64_t stream, uint64_t offset,
                      Tensor& y) {
  KernelArgs args(backend_, device_, "Dropout");
  args.Add("x", x).Add("y", y);
  args.Numel("y", y, x.numel(), "the numel of x");
  args.Require(p >= 0.0 && p <= 1.0, fmt::format("p = {} is not in [0, 1]", p));
  DoDropout(x, p, key, stream, offset, y);
}

void Kernels::DropoutAt(const Tensor& x, double p, uint64_t key, uint64_t stream,
                        const GlobalIndexMap& map, Tensor& y) {
  KernelArgs args(backend_, device_, "DropoutAt");
  args.Add("x", x).Add("y", y);
  args.Numel("y", y, x.numel(), "the numel of x");
  args.Require(p >= 0.0 && p <= 1.0, fmt::format("p = {} is not in [0, 1]", p));
  SameOrDisjoint(args, "y", y, "x", x);
  // Global indices are elements of the full tensor: base, dims and strides >= 0.
  int64_t count = 1;
  bool ok = map.base >= 0;
  for (size_t d = 0; d < map.dims.size(); ++d) {
    ok = ok && map.dims[d] >= 0 && map.strides[d] >= 0 &&
         !__builtin_mul_overflow(count, map.dims[d], &count);
  }
  if (!ok || count != x.numel()) {
    args.Fail(fmt::format("map (base {}, dims [{}], strides [{}]) must have base, dims and "
                          "strides >= 0 and dims multiplying to x's {} elements",
                          map.base, fmt::join(map.dims, ", "), fmt::join(map.strides, ", "),
                          x.numel()));
  }
  if (x.numel() == 0) return;
  DoDropoutAt(x, p, key, stream, map, y);
}

void Kernels::NormForward(Normalization norm, const Tensor& x, const Tensor& weight,
                          const Tensor* bias, double eps, Tensor& y, Tensor* mean,
                          Tensor& rstd) {
  KernelArgs args(backend_, device_, "NormForward");
  const bool centered = IsCentered(norm);
  args.Require((bias != nullptr) == centered && (mean != nullptr) == centered,
               fmt::format("{} takes {}", NormalizationName(norm),
                           centered ? "a bias and a mean" : "no bias and no mean"));
  args.Add("x", x).Add("weight", weight);
  if (bias != nullptr) args.Add("bias", *bias);
  args.Add("y", y);
  if (mean != nullptr) args.AddCompute("mean", *mean);
  args.AddCompute("rstd", rstd);
  CheckNormForward(args, x, weight, bias, eps, y, mean, rstd);
  if (x.numel() == 0) return;
  DoNormForward(x, weight, bias, eps, y, mean, rstd);
}

void Kernels::NormBackward(Normalization norm, const Tensor& x, const Tensor& weight,
                           const Tensor* mean, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                           Tensor& dweight, Tensor* dbias) {
  KernelArgs args(backend_, device_, "NormBackward");
  const bool centered = IsCentered(norm);
  args.Require((mean != nullptr) == centered && (dbias != nullptr) == centered,
               fmt::format("{} takes {}", NormalizationName(norm),
                           centered ? "a mean and a dbias" : "no mean and no dbias"));
  args.Add("x", x).Add("weight", weight).Add("dy", dy).Add("dx", dx);
  if (mean != nullptr) args.AddCompute("mean", *mean);
  args.AddCompute("rstd", rstd).AddAccumulator("dweight", dweight);
  if (dbias != nullptr) args.AddAccumulator("dbias", *dbias);
  CheckNormBackward(args, x, weight, mean, rstd, dy, dx, dweight, dbias);
  if (x.numel() == 0) return;
  DoNormBackward(x, weight, mean, rstd, dy, dx, dweight, dbias);
}

void Kernels::CausalSoftmaxForward(const Tensor& scores, const Tensor& q_pos, const Tensor& k_pos,
                                   double scale, Tensor& probs, Tensor* lse, int64_t window,
                                   const Tensor* sink) {
  KernelArgs args(backend_, device_, "CausalSoftmaxForward");
  args.Add("scores", scores).Add("probs", probs);
  if (lse != nullptr) args.AddCompute("lse", *lse);
  CheckAttentionPositions(args, "scores", scores, q_pos, k_pos, window);
  if (sink != nullptr) {
    CheckSink(args, *sink, Rows(scores), q_pos);
    Disjoint(args, "probs", probs, "sink", *sink);
  }
  CheckMatrix(args, "probs", probs, Rows(scores), Cols(scores), "the 2-D shape of scores");
  if (lse != nullptr) args.Numel("lse", *lse, Rows(scores), "one per row of scores");
  args.Require(std::isfinite(scale), fmt::format("scale = {} is not finite", scale));
  SameOrDisjoint(args, "probs", probs, "scores", scores);
  if (lse != nullptr) {
    Disjoint(args, "lse", *lse, "scores", scores);
    Disjoint(args, "lse", *lse, "probs", probs);
  }
  if (scores.numel() == 0) return;
  DoCausalSoftmaxForward(scores, q_pos, k_pos, scale, probs, lse, window, sink);
}

void Kernels::CausalSoftmaxFromLse(const Tensor& scores, const Tensor& lse, const Tensor& q_pos,
                                   const Tensor& k_pos, double scale, Tensor& probs,
                                   int64_t window) {
  KernelArgs args(backend_, device_, "CausalSoftmaxFromLse");
  args.Add("scores", scores).Add("probs", probs).AddCompute("lse", lse);
  CheckAttentionPositions(args, "scores", scores, q_pos, k_pos, window);
  CheckMatrix(args, "probs", probs, Rows(scores), Cols(scores), "the 2-D shape of scores");
  args.Numel("lse", lse, Rows(scores), "one per row of scores");
  args.Require(std::isfinite(scale), fmt::format("scale = {} is not finite", scale));
  SameOrDisjoint(args, "probs", probs, "scores", scores);
  Disjoint(args, "probs", probs, "lse", lse);
  if (scores.numel() == 0) return;
  DoCausalSoftmaxFromLse(scores, lse, q_pos, k_pos, scale, probs, window);
}

void Kernels::CausalSoftmaxBackward(const Tensor& probs, const Tensor& dprobs, const Tensor& q_pos,
                                    const Tensor& k_pos, double scale, Tensor& dscores,
                                    const Tensor* row_dot, int64_t window) {
  KernelArgs args(backend_, device_, "CausalSoftmaxBackward");
  args.Add("probs", probs).Add("dprobs", dprobs).Add("dscores", dscores);
  if (row_dot != nullptr) args.AddCompute("row_dot", *row_dot);
  CheckAttentionPositions(args, "probs", probs, q_pos, k_pos, window);
  CheckMatrix(args, "dprobs", dprobs, Rows(probs), Cols(probs), "the 2-D shape of probs");
  CheckMatrix(args, "dscores", dscores, Rows(probs), Cols(probs), "the 2-D shape of probs");
  if (row_dot != nullptr) args.Numel("row_dot", *row_dot, Rows(probs), "one per row of probs");
  args.Require(std::isfinite(scale), fmt::format("scale = {} is not finite", scale));
  SameOrDisjoint(args, "dscores", dscores, "probs", probs);
  SameOrDisjoint(args, "dscores", dscores, "dprobs", dprobs);
  if (row_dot != nullptr) Disjoint(args, "dscores", dscores, "row_dot", *row_dot);
  if (probs.numel() == 0) return;
  DoCausalSoftmaxBackward(probs, dprobs, q_pos, k_pos, scale, dscores, row_dot, window);
}

void Kernels::SoftmaxSinkGrad(const Tensor& sink, const Tensor& lse, const Tensor& row_dot,
                              int64_t sq, Tensor& dsink) {
  KernelArgs args(backend_, device_, "SoftmaxSinkGrad");
  args.Add("sink", sink).AddCompute("lse", lse).AddCompute("row_dot", row_dot);
  args.AddAccumulator("dsink", dsink);
  const int64_t heads = sink.numel(), rows = lse.numel();
  args.Require(sink.shape().size() == 1 && heads >= 1 && sq >= 1 && rows % sq == 0 &&
                   (rows / sq) % heads == 0,
               fmt::format("sink {} must be [heads] with heads dividing the {} rows of lse / sq "
                           "= {}",
                           ShapeString(sink.shape()), rows, sq));
  args.Numel("row_dot", row_dot, rows, "one per row of lse");
  args.Numel("dsink", dsink, heads, "one per head of sink");
  Disjoint(args, "dsink", dsink, "sink", sink);
  Disjoint(args, "dsink", dsink, "lse", lse);
  Disjoint(args, "dsink", dsink, "row_dot", row_dot);
  if (rows == 0) return;
  DoSoftmaxSinkGrad(sink, lse, row_dot, sq, dsink);
}

void Kernels::RowDot(const Tensor& a, const Tensor& b, Tensor& out) {
  KernelArgs args(backend_, device_, "RowDot");
  args.Add("a", a).Add("b", b).AddCompute("out", out);
  CheckMatrix(args, "b", b, Rows(a), Cols(a), "the 2-D shape of a");
  args.Numel("out", out, Rows(a), "one per row of a");
  Disjoint(args, "out", out, "a", a);
  Disjoint(args, "out", out, "b", b);
  if (out.numel() == 0) return;
  DoRowDot(a, b, out);
}

void Kernels::LseMerge(Tensor& out, Tensor& lse, const Tensor& part, const Tensor& part_lse) {
  KernelArgs args(backend_, device_, "LseMerge");
  args.Add("out", out).Add("part", part).AddCompute("lse", lse).AddCompute("part_lse", part_lse);
  CheckMatrix(args, "part", part, Rows(out), Cols(out), "the 2-D shape of out");
  args.Numel("lse", lse, Rows(out), "one per row of out");
  args.Numel("part_lse", part_lse, Rows(out), "one per row of out");
  Disjoint(args, "out", out, "part", part);
  Disjoint(args, "lse", lse, "part_lse", part_lse);
  Disjoint(args, "out", out, "lse", lse);
  if (out.numel() == 0) return;
  DoLseMerge(out, lse, part, part_lse);
}

void Kernels::Rope(const Tensor& x, const Tensor& pos, double base, int64_t dim, bool inverse,
                   Tensor& y) {
  KernelArgs args(backend_, device_, "Rope");
  args.Add("x", x).Add("y", y);
  CheckQueryPositions(args, "x", x, "pos", pos);
  args.Require(dim >= 2 && dim % 2 == 0 && dim <= Cols(x),
               fmt::format("dim = {} must be even, >= 2 and at most the {} columns of x {} "
                           "(rotated pairs)",
                           dim, Cols(x), ShapeString(x.shape())));
  CheckMatrix(args, "y", y, Rows(x), Cols(x), "the 2-D shape of x");
  args.Require(std::isfinite(base) && base > 0, fmt::format("base = {} must be > 0", base));
  SameOrDisjoint(args, "y", y, "x", x);
  if (x.numel() == 0) return;
  DoRope(x, pos, base, dim, inverse, y);
}

void Kernels::TopK(const Tensor& scores, int64_t k, Tensor& values, Tensor& indices) {
  KernelArgs args(backend_, device_, "TopK");
  args.Add("scores", scores).Add("values", values).AddInt64("indices", indices);
  args.Require(k >= 1 && k <= Cols(scores),
               fmt::format("k = {} must be in [1, {}] (the columns of scores {})", k,
                           Cols(scores), ShapeString(scores.shape())));
  CheckMatrix(args, "values", values, Rows(scores), k, "rows of scores by k");
  args.Numel("indices", indices, Rows(scores) * k, "rows of scores times k");
  Disjoint(args, "values", values, "scores", scores);
  Disjoint(args, "indices", indices, "scores", scores);
  Disjoint(args, "indices", indices, "values", values);
  if (scores.numel() == 0) return;
  DoTopK(scores, k, values, indices);
}

void Kernels::EmbeddingForward(const Tensor& weight, const Tensor& ids, int64_t vocab_start,
                               int64_t vocab_end, Tensor& out) {
  KernelArgs args(backend_, device_, "EmbeddingForward");
  args.Add("weight", weight).Add("out", out);
  CheckShard(args, "weight", weight, vocab_start, vocab_end);
  if (Cols(out) != Cols(weight)) {
    args.Fail(fmt::format("out {} must have the {} columns of weight {}", ShapeString(out.shape()),
                          Cols(weight), ShapeString(weight.shape())));
  }
  args.AddIndices("ids", ids, Rows(out), "one per row of out");
  Disjoint(args, "out", out, "ids", ids);
  DoEmbeddingForward(weight, ids, vocab_start, vocab_end, out);
}

void Kernels::EmbeddingBackward(const Tensor& dy, const Tensor& ids, int64_t vocab_start,
                                int64_t vocab_end, Tensor& dweight) {
  KernelArgs args(backend_, device_, "EmbeddingBackward");
  args.Add("dy", dy).AddAccumulator("dweight", dweight);
  CheckShard(args, "dweight", dweight, vocab_start, vocab_end);
  if (Cols(dy) != Cols(dweight)) {
    args.Fail(fmt::format("dy {} must have the {} columns of dweight {}", ShapeString(dy.shape()),
                          Cols(dweight), ShapeString(dweight.shape())));
  }
  args.AddIndices("ids", ids, Rows(dy), "one per row of dy");
  args.Require(!Overlap(dy, dweight), "dy shares storage with dweight");
  Disjoint(args, "dweight", dweight, "ids", ids);
  DoEmbeddingBackward(dy, ids, vocab_start, vocab_end, dweight);
}

void Kernels::RowMax(const Tensor& logits, Tensor& row_max) {
  KernelArgs args(backend_, device_, "RowMax");
  args.Add("logits", logits).AddCompute("row_max", row_max);
  args.Numel("row_max", row_max, Rows(logits), "one per row of logits");
  DoRowMax(logits, row_max);
}

void Kernels::CrossEntropyPartials(const Tensor& logits, const Tensor& row_max,
                                   const Tensor& labels, int64_t vocab_start, Tensor& sum_exp,
                                   Tensor& sum_z, Tensor& target_z) {
  KernelArgs args(backend_, device_, "CrossEntropyPartials");
  args.Add("logits", logits).AddCompute("row_max", row_max).AddCompute("sum_exp", sum_exp);
  args.AddCompute("sum_z", sum_z).AddCompute("target_z", target_z);
  const int64_t rows = Rows(logits);
  args.Numel("row_max", row_max, rows, "one per row of logits");
  args.Numel("sum_exp", sum_exp, rows, "one per row of logits");
  args.Numel("sum_z", sum_z, rows, "one per row of logits");
  args.Numel("target_z", target_z, rows, "one per row of logits");
  args.AddIndices("labels", labels, rows, "one per row of logits");
  for (const auto& [name, out] : {std::pair<std::string_view, const Tensor*>{"sum_exp", &sum_exp},
                                  {"sum_z", &sum_z},
                                  {"target_z", &target_z}}) {
    Disjoint(args, name, *out, "labels", labels);
  }
  DoCrossEntropyPartials(logits, row_max, labels, vocab_start, sum_exp, sum_z, target_z);
}

void Kernels::CrossEntropyBackward(const Tensor& logits, const Tensor& row_max,
                                   const Tensor& sum_exp, const Tensor& labels, int64_t vocab_start,
                                   double on_value, double off_value, const Tensor& row_scale,
                                   Tensor& grad) {
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
  args.AddIndices("labels", labels, rows, "one per row of logits");
  // grad may be logits itself but no other partial overlap.
  args.Require(grad.data() == logits.data() || !Overlap(grad, logits),
               "grad partially overlaps logits");
  Disjoint(args, "grad", grad, "labels", labels);
  DoCrossEntropyBackward(logits, row_max, sum_exp, labels, vocab_start, on_value, off_value,
                         row_scale, grad);
}

void Kernels::OptimizerStep(const OptimizerUpdate& update, const Tensor& grad, Tensor& master,
                            Tensor& state1, Tensor& state2, Tensor& param) {
  KernelArgs args(backend_, device_, "OptimizerStep");
  args.Add("master", master);
  const bool adam = update.kind == OptimizerUpdate::Kind::kAdam;
  if (!adam) {
    args.Require(!state2.defined(), "state2 must be undefined for sgd (it has one state)");
  }
  // The master's values: float32 when master holds the remainder.
  const DType master_dtype = update.param_remainders ? DType::kFloat32 : master.dtype();
  if (update.param_remainders) {
    args.Require(master.dtype() == DType::kBFloat16 && param.dtype() == DType::kBFloat16 &&
                     !update.master_float64,
                 fmt::format("param_remainders: master (the remainder) is {} and param {}; "
                             "both must be bfloat16 (the remainder's bits and the master's "
                             "high half), the master float32",
                             DTypeName(master.dtype()), DTypeName(param.dtype())));
  } else {
    args.Require(master.dtype() == DType::kFloat32 || master.dtype() == DType::kFloat64,
                 fmt::format("master is {}; the master dtype is float32 or float64",
                             DTypeName(master.dtype())));
    args.Require(update.master_float64 == (master.dtype() == DType::kFloat64),
                 "update.master_float64 does not match master's dtype");
  }
  // Each state in the master dtype, or bfloat16 beside a float32 master.
  for (const auto& [name, state] :
       {std::pair<const char*, const Tensor*>{"state1", &state1}, {"state2", &state2}}) {
    if (!adam && state == &state2) continue;
    KernelArgs(backend_, device_, "OptimizerStep").Add(name, *state);
    args.Require(state->dtype() == master_dtype ||
                     (state->dtype() == DType::kBFloat16 && master_dtype == DType::kFloat32),
                 fmt::format("{} is {}; a state has the master dtype ({}), or bfloat16 beside "
                             "a float32 master",
                             name, DTypeName(state->dtype()), DTypeName(master_dtype)));
  }
  KernelArgs(backend_, device_, "OptimizerStep").Add("grad", grad);
  args.Require(DTypeSize(grad.dtype()) != 2 || master_dtype == DType::kFloat32,
               fmt::format("grad is {}; a 16-bit main_grad steps a float32 master",
                           DTypeName(grad.dtype())));
  KernelArgs(backend_, device_, "OptimizerStep").Add("param", param);
  const int64_t n = master.numel();
  args.Numel("grad", grad, n, "the numel of master");
  args.Numel("state1", state1, n, "the numel of master");
  if (adam) args.Numel("state2", state2, n, "the numel of master");
  args.Numel("param", param, n, "the numel of master");
  for (const auto& [name, other] : {std::pair<const char*, const Tensor*>{"master", &master},
                                    {"grad", &grad}, {"state1", &state1}, {"state2", &state2}}) {
    if (other->defined() && Overlap(param, *other)) {
      args.Fail(fmt::format("param overlaps {}", name));
    }
  }
  if (n == 0) return;
  DoOptimizerStep(update, grad, master, state1, state2, param);
}

namespace {

// The float16 state's scale: a float32 tensor with one element, apart from the others.
void RequireStateScale(KernelArgs& args, const Tensor& scale) {
  args.Require(scale.dtype() == DType::kFloat32 && scale.numel() == 1,
               fmt::format("scale is {} {}; it must be float32 with one element",
                           DTypeName(scale.dtype()), ShapeString(scale.shape())));
}

}  // namespace

void Kernels::UnscaleState(const Tensor& q, const Tensor& scale, Tensor& out) {
  KernelArgs args(backend_, device_, "UnscaleState");
  args.Add("q", q);
  args.Require(q.dtype() == DType::kFloat16,
               fmt::format("q is {}; it must be float16", DTypeName(q.dtype())));
  KernelArgs(backend_, device_, "UnscaleState").Add("scale", scale);
  RequireStateScale(args, scale);
  KernelArgs(backend_, device_, "UnscaleState").Add("out", out);
  args.Require(out.dtype() == DType::kFloat32,
               fmt::format("out is {}; it must be float32", DTypeName(out.dtype())));
  args.Numel("out", out, q.numel(), "the numel of q");
  Disjoint(args, "out", out, "q", q);
  Disjoint(args, "out", out, "scale", scale);
  if (q.numel() == 0) return;
  DoUnscaleState(q, scale, out);
}

void Kernels::ScaleState(const Tensor& x, Tensor& scale, Tensor& q) {
  KernelArgs args(backend_, device_, "ScaleState");
  args.Add("x", x);
  args.Require(x.dtype() == DType::kFloat32,
               fmt::format("x is {}; it must be float32", DTypeName(x.dtype())));
  KernelArgs(backend_, device_, "ScaleState").Add("scale", scale);
  RequireStateScale(args, scale);
  KernelArgs(backend_, device_, "ScaleState").Add("q", q);
  args.Require(q.dtype() == DType::kFloat16,
               fmt::format("q is {}; it must be float16", DTypeName(q.dtype())));
  args.Numel("q", q, x.numel(), "the numel of x");
  Disjoint(args, "q", q, "x", x);
  Disjoint(args, "scale", scale, "x", x);
  Disjoint(args, "scale", scale, "q", q);
  if (x.numel() == 0) return;
  DoScaleState(x, scale, q);
}

void Kernels::SumOfSquares(const Tensor& x, Tensor& out) {
  KernelArgs args(backend_, device_, "SumOfSquares");
  args.Add("x", x);
  KernelArgs(backend_, device_, "SumOfSquares").Add("out", out);
  args.Require(out.dtype() == DType::kFloat64 && out.numel() == 1,
               fmt::format("out is {} {}; it must be float64 with one element",
                           DTypeName(out.dtype()), ShapeString(out.shape())));
  if (x.numel() == 0) return;
  DoSumOfSquares(x, out);
}

}  // namespace mpusim
