// cp_comm_type "a2a+p2p"'s level-0 exchange (see hierarchical.h).
#include "core/context_parallel/hierarchical.h"

#include "core/context_parallel/sequence_order.h"

namespace mpusim {

Tensor ToRingHeads(Kernels& k, Communicator& level0, int64_t s_cp, const Tensor& x, int64_t b,
                   int64_t heads, int64_t w) {
  const int64_t a = level0.Size();
  if (a == 1) return x;
  const int64_t c = s_cp / 2, s_ring = a * s_cp, ha = heads / a;
  const int64_t piece = ha * s_cp * w;
  Tensor send = k.Empty({a * b * piece}, x.dtype());  // [a, b, ha, s_cp, w]
  k.StridedCopy(x, 0, {a, b, piece}, {piece, a * piece, 1}, send, 0, {b * piece, piece, 1});
  Tensor received = k.Empty({a * b * piece}, x.dtype());  // [a (from j), b, ha, s_cp, w]
  level0.AllToAll(send, received);
  Tensor out = k.Empty({b * ha * s_ring, w}, x.dtype());
  for (int64_t j = 0; j < a; ++j) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t from = (j * b * ha * s_cp + half * c) * w;
      const int64_t to = Chunk(a, j, half) * c * w;  // the group's chunks as a ring of a
      k.StridedCopy(received, from, {b * ha, c * w}, {s_cp * w, 1}, out, to, {s_ring * w, 1});
    }
  }
  return out;
}

Tensor FromRingHeads(Kernels& k, Communicator& level0, int64_t s_cp, const Tensor& y, int64_t b,
                     int64_t heads, int64_t w) {
  const int64_t a = level0.Size();
  if (a == 1) return y;
  const int64_t c = s_cp / 2, s_ring = a * s_cp, ha = heads / a;
  const int64_t piece = ha * s_cp * w;
  Tensor send = k.Empty({a * b * piece}, y.dtype());  // [a (to j), b, ha, s_cp, w]
  for (int64_t j = 0; j < a; ++j) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t to = (j * b * ha * s_cp + half * c) * w;
      const int64_t from = Chunk(a, j, half) * c * w;
      k.StridedCopy(y, from, {b * ha, c * w}, {s_ring * w, 1}, send, to, {s_cp * w, 1});
    }
  }
  Tensor received = k.Empty({a * b * piece}, y.dtype());  // [a (from j), b, ha, s_cp, w]
  level0.AllToAll(send, received);
  Tensor out = k.Empty({b * heads * s_cp, w}, y.dtype());
  k.StridedCopy(received, 0, {a, b, piece}, {b * piece, piece, 1}, out, 0, {piece, a * piece, 1});
  return out;
}

}  // namespace mpusim
