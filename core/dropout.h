// Dropout masks as pure functions of global indices ("dropout_mode": "global", the default
// for the GPT model).
//
// Every dropout site of a model has a name (the module's path in Megatron-Core's GPTModel, e.g.
// "decoder.layers.3.mlp_bda"). In micro-batch m of iteration it, element e of the site's FULL
// tensor (row-major in its unpartitioned shape, with the global batch B = b * d) is kept iff
//
//     UniformAt(seed, DropoutStream(site, it, m), e) >= p
//
// and kept elements are scaled by 1 / (1 - p). So the mask does not depend on the layout:
// tp = 1 and tp = 8, with or without sequence parallelism, draw the same mask, and two
// layouts can be diffed with dropout on. Each rank draws only its own elements, locating them
// with a GlobalIndexMap.
//
// "dropout_mode": "rng_tracker" keeps Megatron's semantics instead, so its masks change with
// the layout. Each rank draws from its RNG tracker (core/rng.h): the "default" stream (key
// DefaultSeed(seed, pp, dp): the same on every tp rank) or "model-parallel-rng" (key
// ModelParallelSeed(default key, tp): one per tp rank), with the LOCAL element index. Which
// stream a GPT site uses is Megatron-Core's: attention dropout always model-parallel-rng
// (DotProductAttention forks the tracker); the embedding dropout and the bias-dropout-adds
// model-parallel-rng under sequence parallelism (LanguageModelEmbedding forks, and the whole
// TransformerBlock runs inside the fork), else the default stream. Every site with p > 0 is one
// draw on its stream; the tracker is a state that each forward step advances, so draws are
// numbered in the order the rank runs them. A forward step of (chunk c, micro-batch m) on
// pipeline rank r makes D_c draws on a stream (its chunk's sites with p > 0 on it, in forward
// order: the embedding on the model's first chunk, then per layer attention, self_attn_bda,
// mlp_bda). Rank r runs its forwards in the schedule's forward-table order (core/schedule.h:
// micro-batches in order without virtual stages), and every iteration continues where the last
// one ended, so the k-th draw of (c, m) in iteration it is
//     n = it * M * sum_c' D_c' + (sum of D over r's forwards before (c, m)) + k,
// with pp = 1 simply n = (it * M + m) * D + k. Recomputation restores the tracker, so it
// redraws the same n. Local element e is kept iff UniformAt(key, n, e) >= p. The key holds
// the pipeline rank (DefaultSeed(seed, pp, dp)), so each stage draws its own masks.
//
// The GPT model's sites and full shapes (s = seq_length, B = global batch, a = heads):
//   embedding.embedding_dropout                                   [s, B, h]
//   decoder.layers.<i>.self_attention.core_attention.attention_dropout   [B, a, s, s]
//   decoder.layers.<i>.self_attn_bda                              [s, B, h]
//   decoder.layers.<i>.mlp_bda                                    [s, B, h]
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/init.h"
#include "core/ops/dropout.h"  // MapIndex

namespace mpusim {

// The Philox stream (counter_hi) of one site in one micro-batch of one iteration.
inline uint64_t DropoutStream(std::string_view site, int64_t iteration, int64_t microbatch) {
  return StreamId(fmt::format("{}@it{}.mb{}", site, iteration, microbatch));
}

// Where a rank's local elements sit in the full tensor: the local tensor is viewed as
// [dims[0], dims[1], dims[2]] (row-major, dims multiply to its numel), and its element
// (i, j, k) is full element base + i * strides[0] + j * strides[1] + k * strides[2].
struct GlobalIndexMap {
  int64_t base = 0;
  std::array<int64_t, 3> dims{1, 1, 1};
  std::array<int64_t, 3> strides{0, 0, 1};

  int64_t At(int64_t flat_local) const {
    return ops::MapIndex(base, dims.data(), strides.data(), flat_local);
  }
};

// A local tensor placed in its full tensor piece by piece: its elements [offset, offset +
// the product of map.dims) sit where `map` says.
struct IndexPiece {
  int64_t offset = 0;
  GlobalIndexMap map;
};
using IndexPieces = std::vector<IndexPiece>;

// The map of a local [s_local, b, w] activation whose full tensor is [s_full, B, w_full]:
// this rank holds sequence positions from seq_offset, samples from batch_offset and columns
// from col_offset.
inline GlobalIndexMap ActivationIndexMap(int64_t s_local, int64_t b, int64_t w, int64_t seq_offset,
                                         int64_t batch_offset, int64_t col_offset,
                                         int64_t batch_full, int64_t w_full) {
  GlobalIndexMap map;
  map.base = (seq_offset * batch_full + batch_offset) * w_full + col_offset;
  map.dims = {s_local, b, w};
  map.strides = {batch_full * w_full, w_full, 1};
  return map;
}

}  // namespace mpusim
