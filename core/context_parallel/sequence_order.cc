// Context parallelism's load-balanced split (see sequence_order.h).
#include "core/context_parallel/sequence_order.h"

namespace mpusim {

void ReorderSequence(Kernels& k, int64_t cp, int64_t s, const Tensor& from, Tensor& to,
                     int64_t rows, int64_t w, bool to_sequence) {
  const int64_t s_cp = s / cp, c = s_cp / 2;
  for (int64_t r = 0; r < cp; ++r) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t ranked = (r * rows * s_cp + half * c) * w;
      const int64_t ordered = Chunk(cp, r, half) * c * w;
      if (to_sequence) {
        k.StridedCopy(from, ranked, {rows, c * w}, {s_cp * w, 1}, to, ordered, {s * w, 1});
      } else {
        k.StridedCopy(from, ordered, {rows, c * w}, {s * w, 1}, to, ranked, {s_cp * w, 1});
      }
    }
  }
}

}  // namespace mpusim
