// Random streams with Megatron's semantics (tensor_parallel.random), on Philox.
//
// model_parallel_cuda_manual_seed(seed) in Megatron gives every rank two streams:
//   default stream         seed                      (the same on every tp rank)
//   "model-parallel-rng"   seed + 2718 + tp_rank     (different on every tp rank)
// and the training script offsets the seed per pipeline stage and, with
// data_parallel_random_init, per data-parallel rank:  seed + 100 * pp_rank + 10 * dp_rank.
// We always apply the data-parallel offset, so the default stream differs across dp ranks.
//
// A stream's state is (key, calls): each draw hands out a fresh Philox subsequence
// (counter_hi = calls) and advances `calls`; element e of the draw uses counter_lo = e.
// Dropout on a tensor-parallel split activation draws from "model-parallel-rng" (Megatron
// forks the tracker there), on a replicated one from the default stream.
// Activation recomputation saves the tracker's states before the forward and restores them
// before recomputing, so the recomputed masks are bit-identical.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "core/status.h"

namespace mpusim {

inline constexpr char kDefaultStream[] = "default";
inline constexpr char kModelParallelStream[] = "model-parallel-rng";

inline uint64_t DefaultSeed(uint64_t seed, int64_t pp_rank, int64_t dp_rank) {
  return seed + 100 * static_cast<uint64_t>(pp_rank) + 10 * static_cast<uint64_t>(dp_rank);
}
inline uint64_t ModelParallelSeed(uint64_t default_seed, int64_t tp_rank) {
  return default_seed + 2718 + static_cast<uint64_t>(tp_rank);
}

struct RngDraw {
  uint64_t key;
  uint64_t subsequence;  // Philox counter_hi for this draw
};

class RngTracker {
 public:
  struct State {
    uint64_t key = 0;
    uint64_t calls = 0;
    bool operator==(const State&) const = default;
  };
  using States = std::map<std::string, State>;

  // Megatron's model_parallel_cuda_manual_seed plus the per-stage/per-dp offset.
  static RngTracker ForRank(uint64_t seed, int64_t tp_rank, int64_t pp_rank, int64_t dp_rank);

  // Megatron refuses to add a stream twice (and two streams with one seed).
  Status Add(const std::string& name, uint64_t key);
  // The next draw of a stream (advances it). The stream must exist.
  RngDraw Draw(const std::string& name);
  const States& GetStates() const { return states_; }
  void SetStates(const States& states) { states_ = states; }

 private:
  States states_;
};

}  // namespace mpusim
