// Inverted dropout of one element, the one definition that the CPU loop and the CUDA kernel
// both run (Kernels::Dropout and Kernels::DropoutAt; the argument rules are in
// core/kernels.cc). Element e is kept iff UniformAt(key, stream, index) >= p, with index
// offset + e (Dropout) or the element's index in the full tensor (DropoutAt, MapIndex below,
// core/dropout.h); a kept element is divided by 1 - p rounded to the compute type, a dropped
// one is 0. The same Philox draw and one division on either backend: masks and values are
// bit-identical on the CPU and the GPU.
#pragma once

#include <cstdint>

#include "core/ops/element.h"
#include "core/philox.h"  // UniformAt

namespace mpusim::ops {

struct Dropout {
  double p = 0;
  uint64_t key = 0;
  uint64_t stream = 0;

  template <typename T>
  MPUSIM_HD T operator()(T x, uint64_t index) const {
    using C = ComputeOf<T>;
    const bool keep = UniformAt(key, stream, index) >= p;  // p == 1: nothing is kept
    return Store<T>(keep ? Load(x) / static_cast<C>(1.0 - p) : C(0));
  }
};

// The full-tensor index of local element `flat` of a tensor viewed as [dims[0], dims[1],
// dims[2]] (row-major): base + i strides[0] + j strides[1] + k strides[2]
// (GlobalIndexMap::At, core/dropout.h).
MPUSIM_HD inline int64_t MapIndex(int64_t base, const int64_t* dims, const int64_t* strides,
                                  int64_t flat) {
  const int64_t k = flat % dims[2];
  const int64_t ij = flat / dims[2];
  const int64_t j = ij % dims[1];
  const int64_t i = ij / dims[1];
  return base + i * strides[0] + j * strides[1] + k * strides[2];
}

}  // namespace mpusim::ops
