// cp_comm_type "all_gather" (see all_gather.h).
#include "core/context_parallel/all_gather.h"

#include "core/context_parallel/sequence_order.h"

namespace mpusim {

Tensor GatherSequence(Kernels& k, Communicator& cp, int64_t s, const Tensor& x, int64_t bg,
                      int64_t w) {
  const int64_t n = cp.Size(), s_cp = s / n;
  Tensor gathered = k.Empty({n * bg * s_cp, w}, x.dtype());
  cp.AllGather(x, gathered);
  Tensor out = k.Empty({bg * s, w}, x.dtype());
  ReorderSequence(k, n, s, gathered, out, bg, w, true);
  return out;
}

Tensor ReduceScatterSequence(Kernels& k, Communicator& cp, int64_t s, const Tensor& dy, int64_t bg,
                             int64_t w) {
  const int64_t n = cp.Size(), s_cp = s / n;
  Tensor by_rank = k.Empty({n * bg * s_cp, w}, dy.dtype());
  ReorderSequence(k, n, s, dy, by_rank, bg, w, false);
  Tensor out = k.Empty({bg * s_cp, w}, dy.dtype());
  cp.ReduceScatter(by_rank, out);
  return out;
}

}  // namespace mpusim
