// EigenKernels (see eigen_kernels.h): memory, dense algebra, the elementwise ops, RoPE,
// embedding and the optimizer. The row reductions (the norms, the causal softmax, the cross
// entropy's pieces) are in eigen_reduce_kernels.cc; what both files use (the Eigen views of
// tensors, the 16-bit staging) is in eigen_views.h.
//
// The base class checks the arguments, then a Do* method runs. float32 and float64 go
// through Dispatch, which runs the body once with T = float or T = double; tensors are
// viewed through Eigen::Map as row-major (rows x cols) matrices or flat arrays, and no data
// is copied except where an operation would otherwise read what it has already overwritten
// (overlapping CopyBlock).
//
// bfloat16 and float16 go through the float32 code, widened and rounded once
// (sim/eigen_views.h), except where an op functor loads and stores them itself.
#include "sim/eigen_kernels.h"

#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numbers>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unsupported/Eigen/SpecialFunctions>
#include <utility>

#include "core/arg_checks.h"
#include "core/half.h"
#include "core/ops/dropout.h"
#include "core/ops/rope.h"
#include "core/optimizer_update.h"
#include "core/philox.h"
#include "sim/eigen_views.h"

namespace mpusim {
namespace {

// Runs body.template operator()<T>() with T a type whose copies move `dtype`'s bits
// unchanged: float, double, int64_t, or uint16_t for both 16-bit dtypes (a copy needs no
// values).
template <typename Body>
void DispatchBits(DType dtype, Body&& body) {
  if (IsHalf(dtype)) {
    body.template operator()<uint16_t>();
  } else if (dtype == DType::kInt64) {
    body.template operator()<int64_t>();
  } else {
    Dispatch(dtype, std::forward<Body>(body));
  }
}

// A non-owning 2-D view [rows, cols] of batch entry i of a 3-D tensor; the caller's tensor
// keeps the storage alive. (A const input's view is only read.)
Tensor BatchEntry(const Tensor& t, int64_t i) {
  const Shape& shape = t.shape();
  const size_t entry_bytes = static_cast<size_t>(shape[1] * shape[2]) * DTypeSize(t.dtype());
  auto* base = static_cast<std::byte*>(const_cast<void*>(t.data())) +
               static_cast<size_t>(i) * entry_bytes;
  return Tensor({shape[1], shape[2]}, t.dtype(), t.device(),
                std::shared_ptr<void>(std::shared_ptr<void>(), base));
}

}  // namespace

#if defined(MPUSIM_HAVE_OPENBLAS)
extern "C" void openblas_set_num_threads(int num_threads);
#endif

EigenKernels::EigenKernels() : Kernels("EigenKernels", Device::kHost) {
#if defined(MPUSIM_HAVE_OPENBLAS)
  openblas_set_num_threads(1);
#endif
}

// --- memory ---------------------------------------------------------------------------

size_t EigenKernels::cached_bytes() const { return cache_->cached_bytes(); }

Tensor EigenKernels::DoZeros(const Shape& shape, DType dtype) {
  Tensor out = cache_->Empty(shape, dtype);
  if (out.bytes() > 0) std::memset(out.data(), 0, out.bytes());
  return out;
}

Tensor EigenKernels::DoEmpty(const Shape& shape, DType dtype) {
  return cache_->Empty(shape, dtype);
}

Tensor EigenKernels::DoToDevice(const Tensor& host) {
  Tensor out = cache_->Empty(host.shape(), host.dtype());
  if (host.bytes() > 0) std::memcpy(out.data(), host.data(), host.bytes());
  return out;
}

Tensor EigenKernels::DoToHost(const Tensor& tensor) {
  Tensor out = cache_->Empty(tensor.shape(), tensor.dtype());
  if (tensor.bytes() > 0) std::memcpy(out.data(), tensor.data(), tensor.bytes());
  return out;
}

void EigenKernels::DoSetZero(Tensor& x) {
  if (x.bytes() > 0) std::memset(x.data(), 0, x.bytes());
}

void EigenKernels::DoCopy(const Tensor& src, Tensor& dst) {
  if (src.bytes() > 0 && src.data() != dst.data()) {
    std::memmove(dst.data(), src.data(), src.bytes());
  }
}

void EigenKernels::DoConvert(const Tensor& src, Tensor& dst) {
  DispatchStorage(src.dtype(), [&]<typename S>() {
    DispatchStorage(dst.dtype(), [&]<typename D>() {
      const S* in = src.data_as<S>();
      D* out = dst.data_as<D>();
      const int64_t n = src.numel();
      for (int64_t e = 0; e < n; ++e) out[e] = RoundTo<D>(Widen(in[e]));
    });
  });
}

void EigenKernels::DoCopyBlock(const Tensor& src, int64_t src_row0, int64_t src_col0, Tensor& dst,
                             int64_t dst_row0, int64_t dst_col0, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return;
  DispatchBits(src.dtype(), [&]<typename T>() {
    const auto from = MatrixOf<T>(src).block(src_row0, src_col0, rows, cols);
    auto to = MatrixOf<T>(dst).block(dst_row0, dst_col0, rows, cols);
    if (Overlap(src, dst)) {
      to = from.eval();  // the blocks may overlap: read all of `from` first
    } else {
      to = from;
    }
  });
}

void EigenKernels::DoStridedCopy(const Tensor& src, int64_t src_offset,
                                 const std::vector<int64_t>& dims,
                                 const std::vector<int64_t>& src_strides, Tensor& dst,
                                 int64_t dst_offset, const std::vector<int64_t>& dst_strides) {
  DispatchBits(src.dtype(), [&]<typename T>() {
    const T* from = src.data_as<T>() + src_offset;
    T* to = dst.data_as<T>() + dst_offset;
    const size_t last = dims.size() - 1;
    const int64_t inner = dims[last];
    const int64_t src_inner = src_strides[last];
    const int64_t dst_inner = dst_strides[last];
    int64_t outer = 1;
    for (size_t k = 0; k < last; ++k) outer *= dims[k];
    // The outer indices advance like an odometer, carrying both offsets along, so each
    // element costs one load and one store and no division.
    std::vector<int64_t> index(last, 0);
    int64_t s = 0;
    int64_t d = 0;
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t j = 0; j < inner; ++j) to[d + j * dst_inner] = from[s + j * src_inner];
      for (size_t k = last; k-- > 0;) {
        ++index[k];
        s += src_strides[k];
        d += dst_strides[k];
        if (index[k] < dims[k]) break;
        s -= dims[k] * src_strides[k];
        d -= dims[k] * dst_strides[k];
        index[k] = 0;
      }
    }
  });
}

// --- dense algebra --------------------------------------------------------------------

void EigenKernels::DoGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                        double beta, Tensor& c) {
  const int64_t m = trans_a ? Cols(a) : Rows(a);
  const int64_t k = trans_a ? Rows(a) : Cols(a);
  const int64_t n = trans_b ? Rows(b) : Cols(b);
  if (IsHalf(a.dtype())) {
    // Widen a and b, run the float32 GEMM; a 16-bit c is computed in float32 (beta * c
    // included) and rounded once. beta == 0 never reads c, as below.
    const Tensor af = Widened(a, *cache_);
    const Tensor bf = Widened(b, *cache_);
    if (c.dtype() == DType::kFloat32) {
      DoGemm(trans_a, trans_b, alpha, af, bf, beta, c);
      return;
    }
    Tensor cf = beta == 0.0 ? cache_->Empty(c.shape(), DType::kFloat32) : Widened(c, *cache_);
    DoGemm(trans_a, trans_b, alpha, af, bf, beta, cf);
    StoreRounded(cf, c);
    return;
  }
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

void EigenKernels::DoBatchedGemm(bool trans_a, bool trans_b, double alpha, const Tensor& a,
                                 const Tensor& b, double beta, Tensor& c) {
  for (int64_t i = 0; i < c.shape()[0]; ++i) {
    Tensor entry = BatchEntry(c, i);
    DoGemm(trans_a, trans_b, alpha, BatchEntry(a, i), BatchEntry(b, i), beta, entry);
  }
}

void EigenKernels::DoAddRowVector(const Tensor& bias, Tensor& y) {
  if (y.numel() == 0) return;
  if (IsHalf(y.dtype())) {
    Tensor yf = Widened(y, *cache_);
    DoAddRowVector(Widened(bias, *cache_), yf);
    StoreRounded(yf, y);
    return;
  }
  Dispatch(bias.dtype(), [&]<typename T>() {
    const Eigen::Map<const RowVector<T>> row(bias.data_as<T>(), Cols(y));
    MatrixOf<T>(y).rowwise() += row;
  });
}

void EigenKernels::DoSumRows(const Tensor& x, double beta, Tensor& out) {
  if (IsHalf(x.dtype())) {
    const Tensor xf = Widened(x, *cache_);
    if (out.dtype() == DType::kFloat32) {
      DoSumRows(xf, beta, out);
      return;
    }
    Tensor of = beta == 0.0 ? cache_->Empty(out.shape(), DType::kFloat32) : Widened(out, *cache_);
    DoSumRows(xf, beta, of);
    StoreRounded(of, out);
    return;
  }
  Dispatch(x.dtype(), [&]<typename T>() {
    // Column sums accumulated row after row (sum_j = x_0j + x_1j + ... in that order, as the
    // CUDA kernel adds them), one vectorised pass over the row-major rows; then
    // out = beta * out + sum.
    const auto m = MatrixOf<T>(x);
    Eigen::Array<T, 1, Eigen::Dynamic> sum = Eigen::Array<T, 1, Eigen::Dynamic>::Zero(Cols(x));
    for (int64_t i = 0; i < Rows(x); ++i) sum += m.row(i).array();
    auto o = ArrayOf<T>(out);
    if (beta == 0.0) {
      o = sum.transpose();
    } else if (Rows(x) > 0) {
      if (beta != 1.0) o *= static_cast<T>(beta);
      o += sum.transpose();
    } else if (beta != 1.0) {
      o *= static_cast<T>(beta);
    }
  });
}

void EigenKernels::DoAxpy(double alpha, const Tensor& x, Tensor& y) {
  if (IsHalf(x.dtype())) {
    const Tensor xf = Widened(x, *cache_);
    if (y.dtype() == DType::kFloat32) {
      DoAxpy(alpha, xf, y);
      return;
    }
    Tensor yf = Widened(y, *cache_);
    DoAxpy(alpha, xf, yf);
    StoreRounded(yf, y);
    return;
  }
  Dispatch(x.dtype(),
           [&]<typename T>() { ArrayOf<T>(y) += static_cast<T>(alpha) * ArrayOf<T>(x); });
}

void EigenKernels::DoScale(double alpha, Tensor& x) {
  if (IsHalf(x.dtype())) {
    Tensor xf = Widened(x, *cache_);
    DoScale(alpha, xf);
    StoreRounded(xf, x);
    return;
  }
  Dispatch(x.dtype(), [&]<typename T>() { ArrayOf<T>(x) *= static_cast<T>(alpha); });
}

// --- elementwise ----------------------------------------------------------------------

template <typename T>
BlockMath::Value<ops::ComputeOf<T>> LoadBlock(const T* p, int64_t n) {
  BlockMath::Value<ops::ComputeOf<T>> v(n);
  for (int64_t k = 0; k < n; ++k) v[k] = ops::Load(p[k]);
  return v;
}
template <typename T>
void StoreBlock(const BlockMath::Value<ops::ComputeOf<T>>& v, T* p) {
  for (int64_t k = 0; k < v.size(); ++k) p[k] = ops::Store<T>(v[k]);
}

// Calls fn(offset, length) for the blocks of [0, n) in order.
template <typename Fn>
void ForBlocks(int64_t n, Fn&& fn) {
  for (int64_t at = 0; at < n; at += BlockMath::kOpBlock) {
    fn(at, std::min<int64_t>(BlockMath::kOpBlock, n - at));
  }
}

void EigenKernels::DoActivationForward(Activation act, const Tensor& x, Tensor& y,
                                       const GluOptions& glu) {
  const int64_t f = Cols(y);
  const int64_t rows = Rows(y);
  DispatchStorage(x.dtype(), [&]<typename T>() {
    using C = ops::ComputeOf<T>;
    ops::VisitActivation(act, [&]<typename A>() {
      const T* xs = x.data_as<T>();
      T* ys = y.data_as<T>();
      if constexpr (A::kGated) {
        for (int64_t i = 0; i < rows; ++i) {
          ForBlocks(f, [&](int64_t j, int64_t len) {
            const auto a = LoadBlock(xs + i * 2 * f + j, len);
            const auto b = LoadBlock(xs + i * 2 * f + f + j, len);
            StoreBlock<T>(ops::GatedForward<A, C, BlockMath>(a, b, glu), ys + i * f + j);
          });
        }
      } else {
        ForBlocks(y.numel(), [&](int64_t e, int64_t len) {
          StoreBlock<T>(ops::Forward<A, C, BlockMath>(LoadBlock(xs + e, len)), ys + e);
        });
      }
    });
  });
}

void EigenKernels::DoActivationBackward(Activation act, const Tensor& x, const Tensor& dy,
                                        Tensor& dx, const GluOptions& glu) {
  const int64_t f = Cols(dy);
  const int64_t rows = Rows(dy);
  DispatchStorage(x.dtype(), [&]<typename T>() {
    using C = ops::ComputeOf<T>;
    ops::VisitActivation(act, [&]<typename A>() {
      const T* xs = x.data_as<T>();
      const T* dys = dy.data_as<T>();
      T* dxs = dx.data_as<T>();
      if constexpr (A::kGated) {
        // A block of both halves is loaded before either is stored (dx may be x).
        for (int64_t i = 0; i < rows; ++i) {
          ForBlocks(f, [&](int64_t j, int64_t len) {
            const auto a = LoadBlock(xs + i * 2 * f + j, len);
            const auto b = LoadBlock(xs + i * 2 * f + f + j, len);
            BlockMath::Value<C> da(len), db(len);
            ops::GatedBackward<A, C, BlockMath>(a, b, LoadBlock(dys + i * f + j, len), da, db, glu);
            StoreBlock<T>(da, dxs + i * 2 * f + j);
            StoreBlock<T>(db, dxs + i * 2 * f + f + j);
          });
        }
      } else {
        ForBlocks(dy.numel(), [&](int64_t e, int64_t len) {
          StoreBlock<T>(ops::Backward<A, C, BlockMath>(LoadBlock(xs + e, len),
                                                       LoadBlock(dys + e, len)),
                        dxs + e);
        });
      }
    });
  });
}

// ops::Dropout on any storage type (its load widens, its store rounds once).
void EigenKernels::DoDropout(const Tensor& x, double p, uint64_t key, uint64_t stream,
                             uint64_t offset, Tensor& y) {
  if (p == 0.0) {
    Copy(x, y);
    return;
  }
  const ops::Dropout op{p, key, stream};
  DispatchStorage(x.dtype(), [&]<typename T>() {
    const T* xs = x.data_as<T>();
    T* ys = y.data_as<T>();
    const uint64_t n = static_cast<uint64_t>(x.numel());
    for (uint64_t e = 0; e < n; ++e) ys[e] = op(xs[e], offset + e);
  });
}

void EigenKernels::DoDropoutAt(const Tensor& x, double p, uint64_t key, uint64_t stream,
                               const GlobalIndexMap& map, Tensor& y) {
  if (p == 0.0) {
    Copy(x, y);
    return;
  }
  const ops::Dropout op{p, key, stream};
  DispatchStorage(x.dtype(), [&]<typename T>() {
    const T* xs = x.data_as<T>();
    T* ys = y.data_as<T>();
    // map.At(e) in storage order, walked without dividing: row-major over map.dims, whose
    // product is x.numel() (core/kernels.cc checks it).
    int64_t e = 0;
    for (int64_t i = 0; i < map.dims[0]; ++i) {
      for (int64_t j = 0; j < map.dims[1]; ++j) {
        const int64_t row = map.base + i * map.strides[0] + j * map.strides[1];
        for (int64_t k = 0; k < map.dims[2]; ++k, ++e) {
          ys[e] = op(xs[e], static_cast<uint64_t>(row + k * map.strides[2]));
        }
      }
    }
  });
}

// --- attention: RoPE ------------------------------------------------------------------

void EigenKernels::DoRope(const Tensor& x, const Tensor& pos, double base, int64_t dim,
                          bool inverse, Tensor& y) {
  if (IsHalf(x.dtype())) {
    Tensor xf = Widened(x, *cache_);
    DoRope(xf, pos, base, dim, inverse, xf);
    StoreRounded(xf, y);
    return;
  }
  Dispatch(x.dtype(), [&]<typename T>() {
    const int64_t d = Cols(x);
    const int64_t half = dim / 2;
    // The angles of the sq positions p = pos[l] (ops::RopeAngleAt), one table for every row.
    const int64_t seq = pos.numel();
    const int64_t* position = IdsOf(pos);
    std::vector<ops::RopeAngle<T>> angles(static_cast<size_t>(seq * half));
    for (int64_t p = 0; p < seq; ++p) {
      for (int64_t i = 0; i < half; ++i) {
        angles[static_cast<size_t>(p * half + i)] =
            ops::RopeAngleAt<T>(position[p], i, dim, base, inverse);
      }
    }
    const T* xs = x.data_as<T>();
    T* ys = y.data_as<T>();
    for (int64_t r = 0; r < Rows(x); ++r) {
      const ops::RopeAngle<T>* a = angles.data() + (r % seq) * half;
      for (int64_t i = 0; i < half; ++i) {
        ops::RopeRotate(xs[r * d + i], xs[r * d + half + i], a[i], ys[r * d + i],
                        ys[r * d + half + i]);
      }
      // The channels past dim pass through (rotary_percent < 1).
      if (ys != xs) std::copy(xs + r * d + dim, xs + (r + 1) * d, ys + r * d + dim);
    }
  });
}

// --- embedding ------------------------------------------------------------------------

void EigenKernels::DoEmbeddingForward(const Tensor& weight, const Tensor& ids, int64_t vocab_start,
                                      int64_t vocab_end, Tensor& out) {
  const int64_t num_ids = ids.numel();
  const int64_t* id_of = IdsOf(ids);
  DispatchBits(weight.dtype(), [&]<typename T>() {
    const auto w = MatrixOf<T>(weight);
    auto o = MatrixOf<T>(out);
    for (int64_t i = 0; i < num_ids; ++i) {
      const int64_t id = id_of[i];
      if (id >= vocab_start && id < vocab_end) {
        o.row(i) = w.row(id - vocab_start);
      } else {
        o.row(i).setZero();  // another shard owns this token (Megatron's input mask)
      }
    }
  });
}

void EigenKernels::DoEmbeddingBackward(const Tensor& dy, const Tensor& ids, int64_t vocab_start,
                                       int64_t vocab_end, Tensor& dweight) {
  const int64_t num_ids = ids.numel();
  const int64_t* id_of = IdsOf(ids);
  if (IsHalf(dy.dtype())) {
    if (dweight.dtype() == DType::kFloat32) {
      DoEmbeddingBackward(Widened(dy, *cache_), ids, vocab_start, vocab_end, dweight);
      return;
    }
    // A 16-bit dweight: each addition is a float32 one rounded once, in id order (what one
    // atomic 16-bit add per token does on a GPU), so a repeated token rounds once per use.
    DispatchHalf(dy.dtype(), [&]<typename H>() {
      const int64_t cols = Cols(dy);
      const H* g = dy.data_as<H>();
      H* dw = dweight.data_as<H>();
      for (int64_t i = 0; i < num_ids; ++i) {
        const int64_t id = id_of[i];
        if (id < vocab_start || id >= vocab_end) continue;
        H* row = dw + (id - vocab_start) * cols;
        const H* grad_row = g + i * cols;
        for (int64_t j = 0; j < cols; ++j) {
          row[j] = FromFloat<H>(ToFloat(row[j]) + ToFloat(grad_row[j]));
        }
      }
    });
    return;
  }
  Dispatch(dy.dtype(), [&]<typename T>() {
    const auto g = MatrixOf<T>(dy);
    auto dw = MatrixOf<T>(dweight);
    for (int64_t i = 0; i < num_ids; ++i) {
      const int64_t id = id_of[i];
      if (id >= vocab_start && id < vocab_end) dw.row(id - vocab_start) += g.row(i);
    }
  });
}

// --- optimizer ------------------------------------------------------------------------

void EigenKernels::DoOptimizerStep(const OptimizerUpdate& update, const Tensor& grad,
                                   Tensor& master, Tensor& state1, Tensor& state2,
                                   Tensor& param) {
  const int64_t n = master.numel();
  if (update.param_remainders) {
    const auto m = MomentOf<float>(state1), v = MomentOf<float>(state2);
    DispatchStorage(grad.dtype(), [&]<typename G>() {
      for (int64_t e = 0; e < n; ++e) {
        update.ApplyWithRemainder(grad.data_as<G>(), master.data_as<BFloat16>(), m, v,
                                  param.data_as<BFloat16>(), e);
      }
    });
    return;
  }
  DispatchStorage(grad.dtype(), [&]<typename G>() {
    Dispatch(master.dtype(), [&]<typename M>() {
      DispatchStorage(param.dtype(), [&]<typename P>() {
        const auto m = MomentOf<M>(state1), v = MomentOf<M>(state2);
        for (int64_t e = 0; e < n; ++e) {
          update.Apply(grad.data_as<G>(), master.data_as<M>(), m, v, param.data_as<P>(), e);
        }
      });
    });
  });
}

void EigenKernels::DoUnscaleState(const Tensor& q, const Tensor& scale, Tensor& out) {
  const float s = scale.data_as<float>()[0];
  const Float16* in = q.data_as<Float16>();
  float* x = out.data_as<float>();
  for (int64_t e = 0; e < q.numel(); ++e) x[e] = ScaledFloat16::Unscale(in[e], s);
}

void EigenKernels::DoScaleState(const Tensor& x, Tensor& scale, Tensor& q) {
  const float* in = x.data_as<float>();
  float absmax = 0;
  for (int64_t e = 0; e < x.numel(); ++e) absmax = std::max(absmax, std::fabs(in[e]));
  const float s = ScaledFloat16::ScaleOf(absmax);
  scale.data_as<float>()[0] = s;
  const float r = ScaledFloat16::ReciprocalOf(s);
  Float16* out = q.data_as<Float16>();
  for (int64_t e = 0; e < x.numel(); ++e) out[e] = ScaledFloat16::Quantize(in[e], r);
}

void EigenKernels::DoSumOfSquares(const Tensor& x, Tensor& out) {
  double sum = out.data_as<double>()[0];
  DispatchStorage(x.dtype(), [&]<typename T>() {
    const T* values = x.data_as<T>();
    for (int64_t e = 0; e < x.numel(); ++e) {
      const double value = Widen(values[e]);
      sum += value * value;
    }
  });
  out.data_as<double>()[0] = sum;
}

}  // namespace mpusim

