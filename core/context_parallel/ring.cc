// cp_comm_type "p2p"'s ring (see ring.h).
#include "core/context_parallel/ring.h"

namespace mpusim {

Tensor BlockPart(const Tensor& block, int64_t which, int64_t half, int64_t bg, int64_t c,
                 int64_t dq, int64_t dv) {
  const int64_t keys = bg * c * dq, values = bg * c * dv;
  if (which == 0) return block.FlatSlice(half * keys, keys).Reshaped({bg, c, dq});
  return block.FlatSlice(2 * keys + half * values, values).Reshaped({bg, c, dv});
}

Tensor PassOn(Kernels& k, Communicator& ring, int64_t cp, int64_t me, const Tensor& x, int tag) {
  if (cp == 1) return x;
  const int next = static_cast<int>((me + 1) % cp), prev = static_cast<int>((me + cp - 1) % cp);
  Tensor incoming = k.Empty(x.shape(), x.dtype());
  ring.BatchSendRecv(
      {{P2POp::Kind::kSend, x, next, tag}, {P2POp::Kind::kRecv, incoming, prev, tag}});
  return incoming;
}

}  // namespace mpusim
