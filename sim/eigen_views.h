// What EigenKernels' two source files share (eigen_kernels.cc: memory, dense algebra, the
// elementwise ops, RoPE, embedding, the optimizer; eigen_reduce_kernels.cc: the row
// reductions): row-major Eigen views of host tensors, the int64 ids, the 16-bit staging, and
// the math (BlockMath) that runs core/ops' functors on blocks and rows of elements.
// Private to sim/.
//
// bfloat16 and float16 (core/kernels.h: compute in float32, round each stored element
// once) reuse the float32 code instead of a second copy of every formula: the 16-bit
// inputs are widened exactly into temporary float32 tensors (Widened), the float32 Do*
// method runs on them, and the float32 results are rounded once into the 16-bit output
// (StoreRounded). A float32 accumulator or statistic (Gemm's and BatchedGemm's c, SumRows'
// out, Axpy's y, EmbeddingBackward's dweight, the norms' dweight and dbias, the
// cross-entropy and norm statistics) is passed to the float32 code as it is. The
// temporaries cost one float32 copy of the operands per call; the 16-bit path trades that
// for having exactly the float32 formulas (and OpenBLAS for Gemm). Copies move 16-bit
// elements as uint16_t bit patterns (DispatchBits, StridedCopy too), never through float.
#pragma once

#include <fmt/format.h>

#include <Eigen/Core>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "core/arg_checks.h"  // Rows, Cols, Dispatch
#include "core/half.h"
#include "core/tensor.h"
#include "sim/host_block_cache.h"

namespace mpusim {

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

// Runs body.template operator()<H>() with H = BFloat16 or Float16, the storage type of a
// 16-bit `dtype`.
template <typename Body>
void DispatchHalf(DType dtype, Body&& body) {
  if (dtype == DType::kBFloat16) {
    body.template operator()<BFloat16>();
  } else if (dtype == DType::kFloat16) {
    body.template operator()<Float16>();
  } else {
    throw std::invalid_argument(
        fmt::format("EigenKernels: {} is not a 16-bit dtype", DTypeName(dtype)));
  }
}

// A float32 host tensor of t's shape holding t's 16-bit elements widened (exactly).
inline Tensor Widened(const Tensor& t, HostBlockCache& cache) {
  Tensor out = cache.Empty(t.shape(), DType::kFloat32);
  DispatchHalf(t.dtype(), [&]<typename H>() {
    const H* in = t.data_as<H>();
    float* o = out.data_as<float>();
    const int64_t n = t.numel();
    for (int64_t e = 0; e < n; ++e) o[e] = ToFloat(in[e]);
  });
  return out;
}

// dst = src rounded once, element by element, to dst's 16-bit dtype (round to nearest even,
// core/half.h); src is float32 with dst's numel.
inline void StoreRounded(const Tensor& src, Tensor& dst) {
  DispatchHalf(dst.dtype(), [&]<typename H>() {
    const float* in = src.data_as<float>();
    H* o = dst.data_as<H>();
    const int64_t n = dst.numel();
    for (int64_t e = 0; e < n; ++e) o[e] = FromFloat<H>(in[e]);
  });
}

// The int64 ids (or labels) of a host tensor, flat: element i belongs to row i.
inline const int64_t* IdsOf(const Tensor& ids) { return ids.data_as<int64_t>(); }

// The op functors (core/ops) on blocks of elements: their formulas with Eigen's vectorised
// array functions (erf a rational approximation within a few ulp for float, std::erf for
// double; exp likewise), over blocks of at most kOpBlock elements held on the stack (the
// elementwise ops, whose loads widen and stores round once, ops::Load and ops::Store, so that
// every storage type runs the same code with no float32 copies of 16-bit tensors), or on a
// row's array expression (the row reductions). Erf needs <unsupported/Eigen/SpecialFunctions>.
struct BlockMath {
  static constexpr int kOpBlock = 256;
  template <typename C>
  using Value = Eigen::Array<C, Eigen::Dynamic, 1, Eigen::ColMajor, kOpBlock, 1>;
  template <typename E>
  static auto Exp(const E& x) {
    return x.exp();
  }
  template <typename E>
  static auto Erf(const E& x) {
    return x.erf();
  }
  // Eigen's select takes at most one scalar; two (relu's 1 or 0) become a constant block.
  template <typename W, typename A, typename B>
  static auto Select(const W& where, const A& a, const B& b) {
    if constexpr (std::is_arithmetic_v<A> && std::is_arithmetic_v<B>) {
      using Block = Eigen::Array<A, Eigen::Dynamic, 1, Eigen::ColMajor, kOpBlock, 1>;
      return Block(where.select(Block::Constant(where.rows(), a), b));
    } else {
      return where.select(a, b);
    }
  }
};

}  // namespace mpusim
