// cp_comm_type "a2a" (Ulysses, Megatron's / Transformer Engine's AttnFuncWithCPAndQKVOA2A):
// heads exchanged for positions. An all-to-all over the cp group gives each cp rank every
// position of 1/cp of the heads; a second one gives the context back to the tokens' ranks.
//
// What it is: the two all-to-alls, on per-head tensors. What it is not: attention; between
// the two the caller computes it on whole sequences of its heads.
//
// Shapes (b samples, `heads` heads of this rank, hc = heads / cp; s the sequence, s_cp = s /
// cp a cp rank's tokens, in the load-balanced split of sequence_order.h):
//   HeadsForSequence  x [b, heads, s_cp, w]  ->  [b, hc, s, w] in sequence order: cp rank j
//                     is sent heads [j hc, (j + 1) hc) of this rank's tokens
//   SequenceForHeads  y [b, hc, s, w]        ->  [b, heads, s_cp, w], each cp rank's tokens
//                     back to it: the inverse, and so also the backward of either
#pragma once

#include <cstdint>

#include "core/communicator.h"
#include "core/kernels.h"

namespace mpusim {

Tensor HeadsForSequence(Kernels& k, Communicator& cp, int64_t s, const Tensor& x, int64_t b,
                        int64_t heads, int64_t w);
Tensor SequenceForHeads(Kernels& k, Communicator& cp, int64_t s, const Tensor& y, int64_t b,
                        int64_t heads, int64_t w);

}  // namespace mpusim
