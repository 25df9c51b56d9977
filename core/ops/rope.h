// Rotary position embedding's pointwise math, defined once: the angle of a rotated pair and
// the rotation itself, host/device functions that the CPU backend's row loop and the CUDA
// backend's kernel both call (Kernels::Rope), with the argument rules once in
// core/kernels.cc.
//
// What it is (Su et al. 2021; Megatron's apply_rotary_pos_emb, not interleaved): the first
// `dim` channels of a head row x are dim/2 pairs (x[i], x[i + dim/2]); pair i at position p
// turns by the angle
//   theta = p base^(-2i/dim),  c = cos theta,  s = sin theta      (RopeAngleAt)
//   y[i] = x[i] c - x[i + dim/2] s,  y[i + dim/2] = x[i + dim/2] c + x[i] s   (RopeRotate)
// and the channels past dim pass through (rotary_percent < 1). The inverse (the backward)
// is the transpose: s -> -s.
//
// theta, its cosine and its sine are taken in float64 (libm on the host, CUDA's double
// math on the device) and rounded once to the compute type C; the rotation is in C, in the
// order written above, so that the CPU's and the GPU's elements round alike (the .cu is
// built with --fmad=false).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/ops/element.h"  // MPUSIM_HD

namespace mpusim::ops {

// cos theta and +-sin theta of one pair, in the compute type.
template <typename C>
struct RopeAngle {
  C cos;
  C sin;
};

// Pair i (< dim/2) at position `position`: theta = position * base^(-2i/dim) in float64,
// its cosine and sine rounded once to C; the sine negated (exactly) for the inverse.
template <typename C>
MPUSIM_HD RopeAngle<C> RopeAngleAt(int64_t position, int64_t i, int64_t dim, double base,
                                   bool inverse) {
  const double inv_freq = pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
  const double theta = static_cast<double>(position) * inv_freq;
  const double sine = sin(theta);
  return {static_cast<C>(cos(theta)), static_cast<C>(inverse ? -sine : sine)};
}

// The pair (lo, hi) = (x[i], x[i + dim/2]) turned by `a`: y_lo = lo c - hi s,
// y_hi = hi c + lo s. Both are read before either is written, so y may be x.
template <typename C>
MPUSIM_HD void RopeRotate(C lo, C hi, RopeAngle<C> a, C& y_lo, C& y_hi) {
  y_lo = lo * a.cos - hi * a.sin;
  y_hi = hi * a.cos + lo * a.sin;
}

}  // namespace mpusim::ops
