// What a module's Forward and Backward are given: the backend, the tensor-parallel group, the
// shape of the residual stream on this rank, and where to record tensors.
//
// Modules (layer_norm, linear, attention, mlp, transformer_layer, gpt_model) hold Parameter
// pointers and no activations: what a backward needs is returned in a typed Stash that the
// caller keeps per (model chunk, micro-batch) and frees, so several micro-batches can be in
// flight (pipeline schedules) and a stash can be dropped and rebuilt (recomputation).
//
// Shape legend (this rank; t = tp size, d = dp size):
//   s        full sequence length            s_l = s / t under sequence parallelism, else s
//   b        micro-batch per dp rank         B = b * d global samples per micro-batch
//   stream   the residual stream [s_l, b, h], stored as [s_l * b, h]
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "core/dropout.h"
#include "core/kernels.h"
#include "core/model/record.h"
#include "core/pipeline/step_span.h"

namespace mpusim {

struct StreamShape {
  int64_t s = 0;        // full sequence length
  int64_t b = 0;        // samples per micro-batch on this dp rank
  int64_t B = 0;        // global samples per micro-batch (b * d)
  int64_t dp_rank = 0;  // this rank's samples are [dp_rank * b, (dp_rank + 1) * b)
  int64_t t = 1;        // tensor-parallel size
  int64_t tp_rank = 0;
  bool sequence_parallel = false;
  // Context parallelism (Megatron's load-balanced split): the sequence is cut into 2 * cp
  // chunks of s / (2 cp) positions and this rank holds chunks cp_rank and 2 cp - 1 - cp_rank,
  // in that order, as its s_cp() tokens.
  int64_t cp = 1;
  int64_t cp_rank = 0;

  int64_t s_cp() const { return s / cp; }
  int64_t s_local() const { return sequence_parallel ? s_cp() / t : s_cp(); }
  int64_t stream_rows() const { return s_local() * b; }
  // The global sequence position of this cp rank's token l (0 <= l < s_cp()).
  int64_t Position(int64_t l) const {
    if (cp == 1) return l;
    const int64_t c = s / (2 * cp);
    return l < c ? cp_rank * c + l : (2 * cp - 1 - cp_rank) * c + (l - c);
  }
  // Where this rank's [s_l, b, w] stream elements sit in the full [s, B, w] tensor: one piece
  // per run of consecutive positions (two when a sequence-parallel piece straddles this cp
  // rank's two chunks).
  IndexPieces StreamMap(int64_t w) const {
    const int64_t first = sequence_parallel ? tp_rank * s_local() : 0;
    const int64_t end = first + s_local();
    const int64_t cut = cp == 1 ? end : s / (2 * cp);  // this rank's second chunk starts here
    IndexPieces pieces;
    for (int64_t l = first; l < end;) {
      const int64_t next = l < cut ? std::min(cut, end) : end;
      pieces.push_back({(l - first) * b * w,
                        ActivationIndexMap(next - l, b, w, Position(l), dp_rank * b, 0, B, w)});
      l = next;
    }
    return pieces;
  }
  // Shard spec of a tensor whose dimension `batch_dim` holds the global samples, split over
  // the dp ranks.
  ShardSpec BatchSpec(int batch_dim, int64_t dp_size) const {
    ShardSpec spec;
    spec.Split(ShardAxis::kDp, batch_dim, dp_size, dp_rank);
    return spec;
  }
  // Shard spec of a per-token tensor [s, B] (tokens, labels, per-token losses): samples split
  // over dp, the sequence over cp.
  ShardSpec TokenSpec(int64_t dp_size) const { return CpSplit(BatchSpec(1, dp_size), 0); }
  // Shard spec of a stream tensor [s, B, w]: batch split over dp, the sequence over cp and,
  // inside each cp rank's tokens, over tp under SP.
  ShardSpec StreamSpec(int64_t dp_size) const {
    return sequence_parallel ? TpSplit(TokenSpec(dp_size), 0, 1) : TokenSpec(dp_size);
  }
  // Shard spec of a column-parallel output [s, B, w] (this cp rank's tokens, columns split
  // over tp with Megatron's `stride`).
  ShardSpec ColumnSpec(int64_t dp_size, int64_t stride) const {
    return TpSplit(TokenSpec(dp_size), 2, stride);
  }
  // Shard spec of per-head attention tensors [B, a, s, s]: samples split over dp, heads over
  // tp, query positions over cp (every key position on every rank).
  ShardSpec HeadSpec(int64_t dp_size) const {
    return TpSplit(CpSplit(BatchSpec(0, dp_size), 2), 1, 1);
  }
  // The same under cp_comm_type "a2a" (Ulysses): heads split over tp, then each tp rank's
  // heads over cp; every query and key position on every rank.
  ShardSpec CpHeadSpec(int64_t dp_size) const {
    ShardSpec spec = TpSplit(BatchSpec(0, dp_size), 1, 1);
    spec.Split(ShardAxis::kCp, 1, cp, cp_rank);
    return spec;
  }

 private:
  // `spec` also split over the tp ranks along `dim` (nothing to split when t = 1).
  ShardSpec TpSplit(ShardSpec spec, int dim, int64_t stride) const {
    spec.Split(ShardAxis::kTp, dim, t, tp_rank, stride);
    return spec;
  }
  // `spec` also split over the cp ranks along the sequence dim `dim`, load-balanced.
  ShardSpec CpSplit(ShardSpec spec, int dim) const {
    spec.SplitLoadBalanced(ShardAxis::kCp, dim, cp, cp_rank);
    return spec;
  }
};

// dropout_mode "rng_tracker" (core/dropout.h): this rank's stream keys and where each
// site's draw is. A forward step of chunk c takes the next draws[c] numbers of each stream.
struct TrackerDraws {
  struct Site {
    bool model_parallel = false;  // "model-parallel-rng", else "default"
    int64_t position = 0;         // its draw among its chunk's draws on that stream
  };
  struct Count {
    int64_t default_draws = 0;
    int64_t model_parallel_draws = 0;
    bool operator==(const Count&) const = default;
  };
  uint64_t default_key = 0;
  uint64_t model_parallel_key = 0;
  std::vector<Count> per_chunk;                    // draws of one forward step of chunk c
  std::map<std::string, Site, std::less<>> sites;  // this rank's sites with p > 0
};

// The random draws of one micro-batch (core/dropout.h).
struct DropoutDraw {
  uint64_t seed = 0;
  int64_t iteration = 0;
  int64_t microbatch = 0;
  const TrackerDraws* tracker = nullptr;  // set: dropout_mode "rng_tracker"; else "global"
  TrackerDraws::Count first;              // rng_tracker: the step's first draw on each stream
};

struct ModuleContext {
  Kernels& k;
  Communicator& tp;
  CommTrace& trace;
  StreamShape shape;
  int64_t dp_size = 1;
  DropoutDraw draw;
  bool fuse_wgrad = false;                      // gradient_accumulation_fusion
  std::vector<TensorRecord>* records = nullptr;  // null: this pass records nothing
  // int64 [s_cp] on the device: the sequence position of each of this rank's tokens (its
  // query rows, and the keys it computes); 0, 1, ..., s - 1 without context parallelism.
  // Undefined for a model without attention.
  Tensor positions = Tensor();
  // int64 [s] on the device: the position of each key attention sees once the cp ranks'
  // keys are gathered (0, 1, ..., s - 1: positions itself when cp = 1).
  Tensor key_positions = Tensor();
  // The context-parallel group; null when cp = 1.
  Communicator* cp = nullptr;
  // The data x context-parallel group (dense dp x cp: the global load-balancing loss's
  // counts); null when it is one rank.
  Communicator* dp_cp = nullptr;
  // cp_comm_type "a2a+p2p": the two levels of hierarchical_context_parallel_sizes, the heads'
  // all-to-all (hcp_L0, consecutive cp ranks) and the ring (hcp_L1); null otherwise.
  Communicator* hcp_a2a = nullptr;
  Communicator* hcp_p2p = nullptr;
  // The expert tensor x expert-parallel group the MoE dispatcher exchanges tokens over, and
  // the expert tensor-parallel group an expert's slices are split over (the alltoall
  // dispatcher's gather); both null when the experts are laid out as the dense layers
  // (expert_model_parallel_size 1 and expert_tensor_parallel_size = tp: the dispatcher then
  // uses tp).
  Communicator* tp_ep = nullptr;
  Communicator* expt_tp = nullptr;
  // The expert-parallel group (the alltoall dispatcher's all-to-all); null when
  // expert_model_parallel_size is 1.
  Communicator* ep = nullptr;
  // Set: a recomputation in this pass appends its span (chunk `chunk`, the draw's
  // micro-batch) here, for the timeline.
  std::vector<StepSpan>* recompute_spans = nullptr;
  int64_t chunk = 0;

  // Records `tensor` (any view of the rank's local elements) with the local shape its shard
  // of `full_shape` has, as dumps and the check expect.
  void Record(std::string name, const Tensor& tensor, Shape full_shape, ShardSpec shard) const {
    if (records == nullptr) return;
    Shape local_shape = LocalShape(shard, full_shape);
    if (NumElements(local_shape) != tensor.numel()) {
      throw std::logic_error(fmt::format("record {}: {} elements, but its shard of {} has {}", name,
                                         tensor.numel(), ShapeString(full_shape),
                                         NumElements(local_shape)));
    }
    Tensor local = tensor.Reshaped(std::move(local_shape));
    records->push_back({std::move(name), std::move(local), std::move(full_shape), shard});
  }
  bool recording() const { return records != nullptr; }
};

// A module's selective recomputation inside its backward (core attention rerun from what was
// kept): `quiet` records nothing, and while the scope lives the rerun is one recomputation span
// of the trace.
struct RecomputeScope {
  explicit RecomputeScope(const ModuleContext& ctx) : quiet(ctx) {
    quiet.records = nullptr;
    if (ctx.recompute_spans != nullptr) {
      span.emplace(*ctx.recompute_spans, ctx.chunk, ctx.draw.microbatch, true, true);
    }
  }
  ModuleContext quiet;
  std::optional<SpanRecorder> span;
};

// Inverted dropout of `x` at `site` (p may be 0: a copy), with this rank's elements placed by
// `pieces` in the site's full tensor. Under dropout_mode "rng_tracker" an element's index is
// its local one: its flat index in `x`, or where `local` places it in the rank's whole local
// tensor when `x` is a part of it (a ring step's block of the probabilities). Its backward
// is the same call on the gradient.
inline Tensor DropoutAtSite(const ModuleContext& ctx, const std::string& site, double p,
                            const IndexPieces& pieces, const Tensor& x,
                            const IndexPieces* local = nullptr) {
  Tensor y = ctx.k.Empty(x.shape(), x.dtype());
  if (p == 0.0) {
    ctx.k.Copy(x, y);
    return y;
  }
  uint64_t key = ctx.draw.seed;
  uint64_t stream = DropoutStream(site, ctx.draw.iteration, ctx.draw.microbatch);
  const IndexPieces* maps = &pieces;
  if (const TrackerDraws* tracker = ctx.draw.tracker) {
    // Megatron's tracker: this rank's stream, the local element index.
    const TrackerDraws::Site& at = tracker->sites.at(site);
    const int64_t first =
        at.model_parallel ? ctx.draw.first.model_parallel_draws : ctx.draw.first.default_draws;
    key = at.model_parallel ? tracker->model_parallel_key : tracker->default_key;
    stream = static_cast<uint64_t>(first + at.position);
    if (local == nullptr) {
      ctx.k.Dropout(x, p, key, stream, 0, y);
      return y;
    }
    maps = local;
  }
  if (maps->size() == 1 && maps->front().offset == 0) {
    ctx.k.DropoutAt(x, p, key, stream, maps->front().map, y);
    return y;
  }
  for (const IndexPiece& piece : *maps) {
    const int64_t n = piece.map.dims[0] * piece.map.dims[1] * piece.map.dims[2];
    Tensor y_piece = y.FlatSlice(piece.offset, n);
    ctx.k.DropoutAt(x.FlatSlice(piece.offset, n), p, key, stream, piece.map, y_piece);
  }
  return y;
}

}  // namespace mpusim
