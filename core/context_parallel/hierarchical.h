// cp_comm_type "a2a+p2p" (hierarchical context parallelism, Transformer Engine's;
// hierarchical_context_parallel_sizes [a, c], a c = cp): the level-0 all-to-all of heads for
// positions, after which the "p2p" ring (ring.h) runs over level 1.
//
// What it is: the level-0 exchange and its inverse. What it is not: the ring, nor attention.
//
// Level 0 (hcp_L0) groups a consecutive cp ranks a l .. a l + a - 1; level 1 (hcp_L1) the
// ranks at the same place of each group, so cp rank r = j + a l is rank j of its level-0
// group and rank l of its ring. With c_cp = s / (2 cp) (sequence_order.h), the group's first
// chunks a l .. a l + a - 1 form one run of a c_cp positions, and its second chunks, taken in
// the opposite rank order, the run 2 c - 1 - l of a sequence cut in 2 c super-chunks: exactly
// the load-balanced split of a ring of c ranks.
//
// Shapes (b samples, `heads` heads of this rank, ha = heads / a; s_cp = s / cp this rank's
// tokens):
//   ToRingHeads    x [b, heads, s_cp, w]  ->  [b, ha, 2 a c_cp, w]: the tokens of the
//                  level-0 group for 1/a of the heads (level-0 rank j is sent heads
//                  [j ha, (j + 1) ha)); the rows are ring rank l's two super-chunks, the
//                  group's first chunks (rank j's at j c_cp), then its second chunks in the
//                  opposite rank order (rank j's at (2a - 1 - j) c_cp), positions ascending
//   FromRingHeads  y [b, ha, 2 a c_cp, w] ->  [b, heads, s_cp, w]: the inverse, and so also
//                  the backward of either
// A level 0 of one rank returns its input.
#pragma once

#include <cstdint>

#include "core/communicator.h"
#include "core/kernels.h"

namespace mpusim {

Tensor ToRingHeads(Kernels& k, Communicator& level0, int64_t s_cp, const Tensor& x, int64_t b,
                   int64_t heads, int64_t w);
Tensor FromRingHeads(Kernels& k, Communicator& level0, int64_t s_cp, const Tensor& y, int64_t b,
                     int64_t heads, int64_t w);

}  // namespace mpusim
