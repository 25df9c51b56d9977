// EigenKernels' row reductions (see eigen_kernels.h): the norms forward and backward (their
// pointwise math is core/ops/norm.h's), the causal softmax (core/ops/softmax.h), and the pieces
// of the vocab-parallel cross entropy (core/ops/cross_entropy.h). Each walks the rows: it
// takes a row's reductions (Eigen's sums and maxima) before it writes the row, so an output
// may be its input, and the norms' column sums run over the rows in row order. 16-bit tensors are staged through float32
// (sim/eigen_views.h); the rest of EigenKernels is in eigen_kernels.cc.
#include "sim/eigen_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "core/ops/cross_entropy.h"
#include "core/ops/norm.h"
#include "core/ops/softmax.h"
#include "core/ops/topk.h"
#include "sim/eigen_views.h"

namespace mpusim {

// --- normalization --------------------------------------------------------------------

void EigenKernels::DoNormForward(const Tensor& x, const Tensor& weight, const Tensor* bias,
                               double eps, Tensor& y, Tensor* mean, Tensor& rstd) {
  if (IsHalf(x.dtype())) {
    // The statistics are float32 already; y is computed in place on x's float32 copy.
    Tensor xf = Widened(x, *cache_);
    const Tensor wf = Widened(weight, *cache_);
    const Tensor bf = bias != nullptr ? Widened(*bias, *cache_) : Tensor();
    DoNormForward(xf, wf, bias != nullptr ? &bf : nullptr, eps, xf, mean, rstd);
    StoreRounded(xf, y);
    return;
  }
  Dispatch(x.dtype(), [&]<typename T>() {
    const int64_t h = Cols(x);
    const T count = static_cast<T>(h);
    const auto xs = MatrixOf<T>(x);
    auto ys = MatrixOf<T>(y);
    const auto w = Eigen::Map<const RowVector<T>>(weight.data_as<T>(), h).array();
    T* mu = mean != nullptr ? mean->data_as<T>() : nullptr;
    T* rs = rstd.data_as<T>();
    for (int64_t i = 0; i < Rows(x); ++i) {
      // Statistics first, then the row is written (y may be x).
      const auto row = xs.row(i).array();
      const T m = mu != nullptr ? row.sum() / count : static_cast<T>(0);
      const T var = (row - m).square().sum() / count;
      const T r = ops::NormRstd(var, static_cast<T>(eps));
      if (mu != nullptr) mu[i] = m;
      rs[i] = r;
      if (bias != nullptr) {
        const auto b = Eigen::Map<const RowVector<T>>(bias->data_as<T>(), h).array();
        ys.row(i).array() = ops::NormOutput(ops::Normalize(row, m, r), w, b);
      } else {
        ys.row(i).array() = ops::NormOutput(ops::Normalize(row, m, r), w);
      }
    }
  });
}

void EigenKernels::DoNormBackward(const Tensor& x, const Tensor& weight, const Tensor* mean,
                                  const Tensor& rstd, const Tensor& dy, Tensor& dx,
                                  Tensor& dweight, Tensor* dbias) {
  if (IsHalf(x.dtype())) {
    // dx in place on dy's float32 copy; float32 accumulators are used as they are, 16-bit
    // ones widened and rounded once after the column sums were added.
    Tensor dyf = Widened(dy, *cache_);
    const bool narrow = dweight.dtype() != DType::kFloat32;
    Tensor dwf = narrow ? Widened(dweight, *cache_) : dweight;
    Tensor dbf;
    if (dbias != nullptr) dbf = narrow ? Widened(*dbias, *cache_) : *dbias;
    DoNormBackward(Widened(x, *cache_), Widened(weight, *cache_), mean, rstd, dyf, dyf, dwf,
                   dbias != nullptr ? &dbf : nullptr);
    StoreRounded(dyf, dx);
    if (narrow) {
      StoreRounded(dwf, dweight);
      if (dbias != nullptr) StoreRounded(dbf, *dbias);
    }
    return;
  }
  Dispatch(x.dtype(), [&]<typename T>() {
    const int64_t h = Cols(x);
    const T count = static_cast<T>(h);
    const auto xs = MatrixOf<T>(x);
    const auto dys = MatrixOf<T>(dy);
    auto dxs = MatrixOf<T>(dx);
    const auto w = Eigen::Map<const RowVector<T>>(weight.data_as<T>(), h).array();
    const T* mu = mean != nullptr ? mean->data_as<T>() : nullptr;
    const T* rs = rstd.data_as<T>();
    // Column sums over the rows, in row order, added to the accumulators at the end.
    Eigen::Array<T, 1, Eigen::Dynamic> dw_sum = Eigen::Array<T, 1, Eigen::Dynamic>::Zero(h);
    Eigen::Array<T, 1, Eigen::Dynamic> db_sum = Eigen::Array<T, 1, Eigen::Dynamic>::Zero(h);
    for (int64_t i = 0; i < Rows(x); ++i) {
      const T m = mu != nullptr ? mu[i] : static_cast<T>(0);
      const T r = rs[i];
      const auto dy_row = dys.row(i).array();
      const auto xhat = ops::Normalize(xs.row(i).array(), m, r);
      const auto g = ops::NormXhatGrad(dy_row, w);
      const T mean_g = mu != nullptr ? g.sum() / count : static_cast<T>(0);
      const T mean_gx = (g * xhat).sum() / count;
      // Everything that reads dy comes before the row of dx is written (dx may be dy).
      dw_sum += ops::NormWeightGrad(dy_row, xhat);
      if (dbias != nullptr) db_sum += ops::NormBiasGrad(dy_row);
      dxs.row(i).array() = ops::NormInputGrad(g, xhat, r, mean_g, mean_gx);
    }
    ArrayOf<T>(dweight) += dw_sum.transpose();
    if (dbias != nullptr) ArrayOf<T>(*dbias) += db_sum.transpose();
  });
}

// --- attention: the causal softmax ----------------------------------------------------

namespace {

// The keys a query position sees (core/kernels.h): a run of columns when the key positions
// ascend (no context parallelism, or keys in global order), else a mask.
class VisibleKeys {
 public:
  VisibleKeys(const Tensor& q_pos, const Tensor& k_pos, int64_t window)
      : q_(IdsOf(q_pos)),
        k_(IdsOf(k_pos)),
        sq_(q_pos.numel()),
        kv_(k_pos.numel()),
        window_(window),
        ascending_(std::is_sorted(k_, k_ + kv_)) {}
  int64_t query(int64_t row) const { return q_[row % sq_]; }
  // With ascending keys: the columns [first, end) row `row` sees (first 0 without a window);
  // false when it is a mask.
  bool Run(int64_t row, int64_t* first, int64_t* end) const {
    if (!ascending_) return false;
    const int64_t q = query(row);
    *end = std::upper_bound(k_, k_ + kv_, q) - k_;
    *first = window_ < 0 ? 0 : std::lower_bound(k_, k_ + *end, q - window_) - k_;
    return true;
  }
  bool Sees(int64_t q, int64_t column) const { return ops::KeyVisible(k_[column], q, window_); }
  int64_t columns() const { return kv_; }

 private:
  const int64_t* q_;
  const int64_t* k_;
  int64_t sq_, kv_, window_;
  bool ascending_;
};

// Row r's sink logit (core/kernels.h): sink[(r / sq) % heads], or none.
template <typename T>
class SinkOf {
 public:
  SinkOf(const Tensor* sink, int64_t sq)
      : s_(sink != nullptr ? sink->data_as<T>() : nullptr),
        heads_(sink != nullptr ? sink->numel() : 1),
        sq_(sq) {}
  bool present() const { return s_ != nullptr; }
  T operator()(int64_t row) const { return s_[(row / sq_) % heads_]; }

 private:
  const T* s_;
  int64_t heads_, sq_;
};

}  // namespace

void EigenKernels::DoCausalSoftmaxForward(const Tensor& scores, const Tensor& q_pos,
                                          const Tensor& k_pos, double scale, Tensor& probs,
                                          Tensor* lse, int64_t window, const Tensor* sink) {
  if (IsHalf(scores.dtype())) {
    Tensor sf = Widened(scores, *cache_);
    Tensor sink_f;
    if (sink != nullptr) sink_f = Widened(*sink, *cache_);
    DoCausalSoftmaxForward(sf, q_pos, k_pos, scale, sf, lse, window,
                           sink != nullptr ? &sink_f : nullptr);  // lse is float32
    StoreRounded(sf, probs);
    return;
  }
  const VisibleKeys keys(q_pos, k_pos, window);
  const int64_t kv = keys.columns();
  Dispatch(scores.dtype(), [&]<typename T>() {
    const auto ss = MatrixOf<T>(scores);
    auto ps = MatrixOf<T>(probs);
    T* ls = lse != nullptr ? lse->data_as<T>() : nullptr;
    const SinkOf<T> sinks(sink, q_pos.numel());
    const T c = static_cast<T>(scale);
    constexpr T kNone = -std::numeric_limits<T>::infinity();
    for (int64_t r = 0; r < Rows(scores); ++r) {
      // The max and the sum are taken first, then the row is written (probs may be scores).
      // A sink's logit enters the max and the sum (its term last), not the row.
      int64_t first = 0, end = 0;
      if (keys.Run(r, &first, &end)) {
        const int64_t visible = end - first;
        if (visible == 0 && !sinks.present()) {
          ps.row(r).setZero();
          if (ls != nullptr) ls[r] = kNone;
          continue;
        }
        const auto s = ss.row(r).segment(first, visible).array();
        const auto z = ops::SoftmaxLogit(s, c);
        T m = visible > 0 ? z.maxCoeff() : kNone;
        if (sinks.present()) m = visible > 0 ? std::max(m, sinks(r)) : sinks(r);
        T sum = visible > 0 ? ops::SoftmaxExp<T, BlockMath>(z, m).sum() : T(0);
        if (sinks.present()) sum += ops::SoftmaxExp(sinks(r), m);
        ps.row(r).head(first).setZero();
        ps.row(r).segment(first, visible).array() = ops::SoftmaxProb<T, BlockMath>(z, m, sum);
        ps.row(r).tail(kv - end).setZero();
        if (ls != nullptr) ls[r] = ops::SoftmaxLse(m, sum);
        continue;
      }
      const int64_t q = keys.query(r);
      T m = kNone;
      bool any = false;
      for (int64_t j = 0; j < kv; ++j) {
        if (keys.Sees(q, j)) {
          const T z = ops::SoftmaxLogit(ss(r, j), c);
          m = any ? std::max(m, z) : z;
          any = true;
        }
      }
      if (sinks.present()) m = any ? std::max(m, sinks(r)) : sinks(r);
      T sum = 0;
      for (int64_t j = 0; j < kv; ++j) {
        if (keys.Sees(q, j)) sum += ops::SoftmaxExp(ops::SoftmaxLogit(ss(r, j), c), m);
      }
      if (sinks.present()) sum += ops::SoftmaxExp(sinks(r), m);
      for (int64_t j = 0; j < kv; ++j) {
        ps(r, j) = any && keys.Sees(q, j) ? ops::SoftmaxProb(ops::SoftmaxLogit(ss(r, j), c), m, sum)
                                          : T(0);
      }
      if (ls != nullptr) ls[r] = any || sinks.present() ? ops::SoftmaxLse(m, sum) : kNone;
    }
  });
}

void EigenKernels::DoCausalSoftmaxFromLse(const Tensor& scores, const Tensor& lse,
                                          const Tensor& q_pos, const Tensor& k_pos, double scale,
                                          Tensor& probs, int64_t window) {
  if (IsHalf(scores.dtype())) {
    Tensor sf = Widened(scores, *cache_);
    DoCausalSoftmaxFromLse(sf, lse, q_pos, k_pos, scale, sf, window);
    StoreRounded(sf, probs);
    return;
  }
  const VisibleKeys keys(q_pos, k_pos, window);
  const int64_t kv = keys.columns();
  Dispatch(scores.dtype(), [&]<typename T>() {
    const auto ss = MatrixOf<T>(scores);
    auto ps = MatrixOf<T>(probs);
    const T* ls = lse.data_as<T>();
    const T c = static_cast<T>(scale);
    for (int64_t r = 0; r < Rows(scores); ++r) {
      const int64_t q = keys.query(r);
      const T l = ls[r];
      const bool seen = l != -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < kv; ++j) {
        ps(r, j) = seen && keys.Sees(q, j) ? ops::SoftmaxExp(ops::SoftmaxLogit(ss(r, j), c), l)
                                           : T(0);
      }
    }
  });
}

void EigenKernels::DoCausalSoftmaxBackward(const Tensor& probs, const Tensor& dprobs,
                                           const Tensor& q_pos, const Tensor& k_pos, double scale,
                                           Tensor& dscores, const Tensor* row_dot, int64_t window) {
  if (IsHalf(probs.dtype())) {
    Tensor dpf = Widened(dprobs, *cache_);
    DoCausalSoftmaxBackward(Widened(probs, *cache_), dpf, q_pos, k_pos, scale, dpf, row_dot,
                            window);
    StoreRounded(dpf, dscores);
    return;
  }
  const VisibleKeys keys(q_pos, k_pos, window);
  const int64_t kv = keys.columns();
  Dispatch(probs.dtype(), [&]<typename T>() {
    const auto ps = MatrixOf<T>(probs);
    const auto dps = MatrixOf<T>(dprobs);
    auto ds = MatrixOf<T>(dscores);
    const T* given = row_dot != nullptr ? row_dot->data_as<T>() : nullptr;
    const T c = static_cast<T>(scale);
    for (int64_t r = 0; r < Rows(probs); ++r) {
      int64_t first = 0, end = 0;
      if (keys.Run(r, &first, &end)) {
        const int64_t visible = end - first;
        const auto p = ps.row(r).segment(first, visible).array();
        const auto dp = dps.row(r).segment(first, visible).array();
        // Before the row is written (dscores may alias).
        const T dot = given != nullptr ? given[r] : (p * dp).sum();
        ds.row(r).segment(first, visible).array() = ops::SoftmaxGrad(p, dp, dot, c);
        ds.row(r).head(first).setZero();
        ds.row(r).tail(kv - end).setZero();
        continue;
      }
      const int64_t q = keys.query(r);
      T dot = 0;
      if (given != nullptr) {
        dot = given[r];
      } else {
        for (int64_t j = 0; j < kv; ++j) {
          if (keys.Sees(q, j)) dot += ps(r, j) * dps(r, j);
        }
      }
      for (int64_t j = 0; j < kv; ++j) {
        ds(r, j) = keys.Sees(q, j) ? ops::SoftmaxGrad(ps(r, j), dps(r, j), dot, c) : T(0);
      }
    }
  });
}

void EigenKernels::DoSoftmaxSinkGrad(const Tensor& sink, const Tensor& lse, const Tensor& row_dot,
                                     int64_t sq, Tensor& dsink) {
  if (IsHalf(sink.dtype())) {
    // A float32 accumulator is used as it is, a 16-bit one widened and rounded once.
    const bool narrow = dsink.dtype() != DType::kFloat32;
    Tensor df = narrow ? Widened(dsink, *cache_) : dsink;
    DoSoftmaxSinkGrad(Widened(sink, *cache_), lse, row_dot, sq, df);
    if (narrow) StoreRounded(df, dsink);
    return;
  }
  Dispatch(sink.dtype(), [&]<typename T>() {
    const T* o = sink.data_as<T>();
    const T* l = lse.data_as<T>();
    const T* dot = row_dot.data_as<T>();
    T* d = dsink.data_as<T>();
    const int64_t heads = sink.numel(), rows = lse.numel();
    // Each head's rows summed in row order, then added to its accumulator.
    std::vector<T> sum(static_cast<size_t>(heads), T(0));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = (r / sq) % heads;
      sum[static_cast<size_t>(h)] += ops::SinkGradTerm(o[h], l[r], dot[r]);
    }
    for (int64_t h = 0; h < heads; ++h) d[h] += sum[static_cast<size_t>(h)];
  });
}

void EigenKernels::DoRowDot(const Tensor& a, const Tensor& b, Tensor& out) {
  if (IsHalf(a.dtype())) {
    DoRowDot(Widened(a, *cache_), Widened(b, *cache_), out);  // out is float32
    return;
  }
  Dispatch(a.dtype(), [&]<typename T>() {
    const auto as = MatrixOf<T>(a);
    const auto bs = MatrixOf<T>(b);
    T* o = out.data_as<T>();
    for (int64_t r = 0; r < Rows(a); ++r) o[r] = (as.row(r).array() * bs.row(r).array()).sum();
  });
}

void EigenKernels::DoLseMerge(Tensor& out, Tensor& lse, const Tensor& part,
                              const Tensor& part_lse) {
  if (IsHalf(out.dtype())) {
    Tensor of = Widened(out, *cache_);
    DoLseMerge(of, lse, Widened(part, *cache_), part_lse);
    StoreRounded(of, out);
    return;
  }
  Dispatch(out.dtype(), [&]<typename T>() {
    auto os = MatrixOf<T>(out);
    const auto parts = MatrixOf<T>(part);
    T* l = lse.data_as<T>();
    const T* pl = part_lse.data_as<T>();
    constexpr T kNone = -std::numeric_limits<T>::infinity();
    for (int64_t r = 0; r < Rows(out); ++r) {
      if (pl[r] == kNone) continue;  // the block showed this row no key
      if (l[r] == kNone) {
        os.row(r) = parts.row(r);
        l[r] = pl[r];
        continue;
      }
      const ops::LseMergeWeights<T> w = ops::LseMergeOf(l[r], pl[r]);
      os.row(r).array() = ops::LseMerged(os.row(r).array(), parts.row(r).array(), w);
      l[r] = w.lse;
    }
  });
}

// --- vocab-parallel cross entropy -----------------------------------------------------

void EigenKernels::DoRowMax(const Tensor& logits, Tensor& row_max) {
  if (IsHalf(logits.dtype())) {
    DoRowMax(Widened(logits, *cache_), row_max);  // row_max is float32
    return;
  }
  Dispatch(logits.dtype(), [&]<typename T>() {
    auto out = ArrayOf<T>(row_max);
    if (Cols(logits) == 0) {
      out.setConstant(-std::numeric_limits<T>::infinity());
    } else if (Rows(logits) > 0) {
      out = MatrixOf<T>(logits).rowwise().maxCoeff().array();
    }
  });
}

// Per row: ops::TopKRow, the GPU's selection too (the values are the stored elements).
void EigenKernels::DoTopK(const Tensor& scores, int64_t k, Tensor& values, Tensor& indices) {
  const int64_t rows = Rows(scores), n = Cols(scores);
  DispatchStorage(scores.dtype(), [&]<typename T>() {
    const T* s = scores.data_as<T>();
    T* v = values.data_as<T>();
    int64_t* idx = indices.data_as<int64_t>();
    for (int64_t r = 0; r < rows; ++r) ops::TopKRow(s + r * n, n, k, v + r * k, idx + r * k);
  });
}

void EigenKernels::DoCrossEntropyPartials(const Tensor& logits, const Tensor& row_max,
                                          const Tensor& labels, int64_t vocab_start,
                                          Tensor& sum_exp, Tensor& sum_z, Tensor& target_z) {
  const int64_t rows = Rows(logits);
  const int64_t cols = Cols(logits);
  if (IsHalf(logits.dtype())) {
    // The statistics are float32 already.
    DoCrossEntropyPartials(Widened(logits, *cache_), row_max, labels, vocab_start, sum_exp, sum_z, target_z);
    return;
  }
  Dispatch(logits.dtype(), [&]<typename T>() {
    const auto l = MatrixOf<T>(logits);
    const auto m = ArrayOf<T>(row_max);
    auto se = ArrayOf<T>(sum_exp);
    auto sz = ArrayOf<T>(sum_z);
    auto tz = ArrayOf<T>(target_z);
    for (int64_t i = 0; i < rows; ++i) {
      const auto row = l.row(i).array();
      const auto z = ops::ShiftedLogit(row, m[i]);
      se[i] = ops::CrossEntropyExp<T, BlockMath>(z).sum();
      sz[i] = z.sum();
      const int64_t col = ops::LabelColumn(IdsOf(labels)[i], vocab_start, cols);
      tz[i] = col >= 0 ? ops::ShiftedLogit(l(i, col), m[i]) : static_cast<T>(0);
    }
  });
}

void EigenKernels::DoCrossEntropyBackward(const Tensor& logits, const Tensor& row_max,
                                          const Tensor& sum_exp, const Tensor& labels,
                                          int64_t vocab_start, double on_value, double off_value,
                                          const Tensor& row_scale, Tensor& grad) {
  const int64_t rows = Rows(logits);
  const int64_t cols = Cols(logits);
  if (IsHalf(logits.dtype())) {
    // Widening reads all of logits before grad (which may be logits) is written; the float32
    // code then runs in place on the copy.
    Tensor lf = Widened(logits, *cache_);
    DoCrossEntropyBackward(lf, row_max, sum_exp, labels, vocab_start, on_value, off_value,
                           row_scale, lf);
    StoreRounded(lf, grad);
    return;
  }
  Dispatch(logits.dtype(), [&]<typename T>() {
    const auto l = MatrixOf<T>(logits);
    const auto m = ArrayOf<T>(row_max);
    const auto se = ArrayOf<T>(sum_exp);
    const auto scale = ArrayOf<T>(row_scale);
    auto g = MatrixOf<T>(grad);
    const T on = static_cast<T>(on_value);
    const T off = static_cast<T>(off_value);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t col = ops::LabelColumn(IdsOf(labels)[i], vocab_start, cols);
      // Read the label's logit before the row is overwritten (grad may be logits).
      const T z_label = col >= 0 ? ops::ShiftedLogit(l(i, col), m[i]) : static_cast<T>(0);
      const auto row = l.row(i).array();
      g.row(i).array() =
          ops::CrossEntropyGrad<T, BlockMath>(ops::ShiftedLogit(row, m[i]), se[i], off, scale[i]);
      if (col >= 0) g(i, col) = ops::CrossEntropyGrad(z_label, se[i], on, scale[i]);
    }
  });
}

}  // namespace mpusim
