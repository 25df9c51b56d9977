// cp_comm_type "a2a" (see a2a.h).
#include "core/context_parallel/a2a.h"

#include "core/context_parallel/sequence_order.h"

namespace mpusim {

Tensor HeadsForSequence(Kernels& k, Communicator& cp, int64_t s, const Tensor& x, int64_t b,
                        int64_t heads, int64_t w) {
  const int64_t n = cp.Size(), hc = heads / n, piece = hc * (s / n) * w;
  Tensor send = k.Empty({n * b * piece}, x.dtype());  // [cp, b, hc, s_cp, w]
  k.StridedCopy(x, 0, {n, b, piece}, {piece, n * piece, 1}, send, 0, {b * piece, piece, 1});
  Tensor received = k.Empty({n * b * piece}, x.dtype());  // [cp, b, hc, s_cp, w]
  cp.AllToAll(send, received);
  Tensor out = k.Empty({b * hc * s, w}, x.dtype());
  ReorderSequence(k, n, s, received, out, b * hc, w, true);
  return out;
}

Tensor SequenceForHeads(Kernels& k, Communicator& cp, int64_t s, const Tensor& y, int64_t b,
                        int64_t heads, int64_t w) {
  const int64_t n = cp.Size(), hc = heads / n, piece = hc * (s / n) * w;
  Tensor send = k.Empty({n * b * piece}, y.dtype());  // [cp, b, hc, s_cp, w]
  ReorderSequence(k, n, s, y, send, b * hc, w, false);
  Tensor received = k.Empty({n * b * piece}, y.dtype());
  cp.AllToAll(send, received);
  Tensor out = k.Empty({b * heads * (s / n), w}, y.dtype());
  k.StridedCopy(received, 0, {n, b, piece}, {b * piece, piece, 1}, out, 0, {piece, n * piece, 1});
  return out;
}

}  // namespace mpusim
