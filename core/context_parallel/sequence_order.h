// Context parallelism's load-balanced split of the sequence (Megatron's), and the reorder
// between the order the cp ranks hold tokens in and sequence order.
//
// What it is: the layout the cp exchanges (all_gather.h, a2a.h, hierarchical.h, ring.h) agree
// on. What it is not: an exchange; nothing here communicates.
//
// The s positions are cut into 2 cp chunks of c = s / (2 cp); cp rank r holds chunks
//
//     Chunk(cp, r, 0) = r   and   Chunk(cp, r, 1) = 2 cp - 1 - r                      (1)
//
// in that order, as its s_cp = s / cp tokens, so every rank does the same causal-attention
// work. With cp = 2 and s = 8 (c = 2): rank 0 holds positions 0 1 6 7, rank 1 2 3 4 5.
// A tensor of every rank's rows is in rank order when it is [cp, rows, s_cp, w] (for each cp
// rank its rows of its s_cp tokens), in sequence order when it is [rows, s, w].
#pragma once

#include <cstdint>

#include "core/kernels.h"

namespace mpusim {

// The chunk (of 2 cp) that half `half` (0 or 1) of cp rank `rank`'s tokens is: equation (1).
inline int64_t Chunk(int64_t cp, int64_t rank, int64_t half) {
  return half == 0 ? rank : 2 * cp - 1 - rank;
}

// Copies `from` in rank order [cp, rows, s_cp, w] into `to` in sequence order [rows, s, w]
// (to_sequence), or back (!to_sequence); s is the whole sequence.
void ReorderSequence(Kernels& k, int64_t cp, int64_t s, const Tensor& from, Tensor& to,
                     int64_t rows, int64_t w, bool to_sequence);

}  // namespace mpusim
