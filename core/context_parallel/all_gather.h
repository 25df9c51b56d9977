// cp_comm_type "all_gather": the keys and values of every position, all-gathered over the cp
// group and put in sequence order (Megatron's AttnFuncWithCPAndKVAllGather); their gradients
// go back by reduce-scatter.
//
// What it is: the exchange and its backward, on tensors of rows of tokens. What it is not:
// attention; the caller computes it on what GatherSequence returns.
//
// Shapes (bg rows of tokens, e.g. b * g_l key heads; s the sequence, s_cp = s / cp a cp
// rank's tokens, in the load-balanced split of sequence_order.h):
//   GatherSequence         x [bg * s_cp, w]  ->  every rank's, in sequence order [bg * s, w]
//   ReduceScatterSequence  dy [bg * s, w]    ->  summed over the ranks, this rank's tokens
//                                                [bg * s_cp, w]
#pragma once

#include <cstdint>

#include "core/communicator.h"
#include "core/kernels.h"

namespace mpusim {

Tensor GatherSequence(Kernels& k, Communicator& cp, int64_t s, const Tensor& x, int64_t bg,
                      int64_t w);
// GatherSequence's backward.
Tensor ReduceScatterSequence(Kernels& k, Communicator& cp, int64_t s, const Tensor& dy, int64_t bg,
                             int64_t w);

}  // namespace mpusim
