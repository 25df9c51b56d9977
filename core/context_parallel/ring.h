// cp_comm_type "p2p": the ring that passes the keys and values around the cp group
// (Megatron's AttnFuncWithCPAndKVP2P), and with "a2a+p2p" around hcp level 1.
//
// What it is: the ring's steps, which blocks of a step some query sees, the block's layout
// and the pass of the gradients that travel with it. What it is not: attention; the caller's
// `body` computes each step's blocks (softmax, log-sum-exp merge, dropout).
//
// Rank me of a ring of `cp` ranks holds chunks Chunk(cp, me, 0) = me and Chunk(cp, me, 1) =
// 2 cp - 1 - me of c positions (sequence_order.h). Step i (0 <= i < cp) computes with the
// keys and values of rank src = (me - i) mod cp while passing them on to me + 1 and receiving
// the next block from me - 1. In a step, each pair of a query chunk and a key chunk is one
// c x c block, skipped when every key comes after every query. With cp = 2, rank 0 (chunks 0
// and 3): step 0 its own keys, blocks (0, 0), (3, 0), (3, 3); step 1 rank 1's (chunks 1 and
// 2), blocks (3, 1), (3, 2). A block on the ring is its keys and values (BlockPart).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "core/communicator.h"
#include "core/context_parallel/sequence_order.h"
#include "core/kernels.h"

namespace mpusim {

// The ring's cp steps on this rank (cp, me: the ring's size and this rank's place): step i
// computes `body(src, block)` with the block of rank src = (me - i) mod cp while that block
// is passed on to me + 1 and the next one received from me - 1 (messages tagged `tag`); the
// last step passes nothing on.
template <typename Body>
void RunRing(Kernels& k, Communicator& ring, int64_t cp, int64_t me, Tensor block, int tag,
             Body&& body) {
  const int next = static_cast<int>((me + 1) % cp), prev = static_cast<int>((me + cp - 1) % cp);
  for (int64_t step = 0; step < cp; ++step) {
    std::unique_ptr<PendingP2P> pending;
    Tensor incoming;
    if (step + 1 < cp) {  // pass the block on while computing with it
      incoming = k.Empty(block.shape(), block.dtype());
      pending = ring.PostSendRecv(
          {{P2POp::Kind::kSend, block, next, tag}, {P2POp::Kind::kRecv, incoming, prev, tag}});
    }
    body((me - step + cp) % cp, block);
    if (pending) {
      pending->Wait();
      block = incoming;
    }
  }
}

// The c x c blocks of a step with rank src's keys that some query of this rank sees: each of
// this rank's query halves qh against each of src's key halves kh, skipped when every key
// comes after every query. `fn(qh, kh, q_chunk, k_chunk)`.
template <typename Fn>
void ForEachVisibleBlock(int64_t cp, int64_t me, int64_t src, Fn&& fn) {
  for (int64_t qh = 0; qh < 2; ++qh) {
    for (int64_t kh = 0; kh < 2; ++kh) {
      const int64_t q_chunk = Chunk(cp, me, qh), k_chunk = Chunk(cp, src, kh);
      if (k_chunk <= q_chunk) fn(qh, kh, q_chunk, k_chunk);
    }
  }
}

// A chunk of a ring block (which = 0: the keys [bg, c, dq]; 1: the values [bg, c, dv]; chunk
// half h), as a view. A block is [2 (chunk), bg, c, dq] keys, then [2 (chunk), bg, c, dv]
// values: with multi-latent attention dq != dv.
Tensor BlockPart(const Tensor& block, int64_t which, int64_t half, int64_t bg, int64_t c,
                 int64_t dq, int64_t dv);

// The backward's pass of the gradients that travel with a block: `x` sent on to me + 1, the
// one from me - 1 returned (messages tagged `tag`); a ring of one rank keeps `x`.
Tensor PassOn(Kernels& k, Communicator& ring, int64_t cp, int64_t me, const Tensor& x, int tag);

}  // namespace mpusim
