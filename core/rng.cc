// RngTracker (see rng.h): Megatron's CudaRNGStatesTracker, with each stream's state reduced
// to (Philox key, draws so far).
//
// What it is: per-rank bookkeeping of which random subsequence the next dropout mask uses.
// What it is not: a generator. The bits come from Philox4x32 (core/philox.h), so saving and
// restoring a state is copying two integers, not a device RNG state.
#include "core/rng.h"

#include <fmt/format.h>

#include <stdexcept>

namespace mpusim {

RngTracker RngTracker::ForRank(uint64_t seed, int64_t tp_rank, int64_t pp_rank, int64_t dp_rank) {
  if (tp_rank < 0 || pp_rank < 0 || dp_rank < 0) {
    throw std::invalid_argument(fmt::format(
        "RngTracker::ForRank: negative rank (tp {}, pp {}, dp {})", tp_rank, pp_rank, dp_rank));
  }
  RngTracker tracker;
  const uint64_t default_seed = DefaultSeed(seed, pp_rank, dp_rank);
  // The model-parallel key is the default key plus 2718 + tp_rank > 0 (mod 2^64), so the two
  // keys always differ and neither Add can be refused; a refusal would be a bug here.
  Status status = tracker.Add(kDefaultStream, default_seed);
  if (status.ok()) {
    status = tracker.Add(kModelParallelStream, ModelParallelSeed(default_seed, tp_rank));
  }
  if (!status.ok()) throw std::logic_error(status.Message());
  return tracker;
}

// Megatron checks seeds because two streams with one seed would produce the same masks,
// silently correlating dropout on different regions.
Status RngTracker::Add(const std::string& name, uint64_t key) {
  if (states_.count(name) != 0) {
    return Status::Error("", fmt::format("stream '{}' already exists", name));
  }
  for (const auto& [other, state] : states_) {
    if (state.key == key) {
      return Status::Error("", fmt::format("seed {} already exists (stream '{}')", key, other));
    }
  }
  states_.emplace(name, State{key, 0});
  return {};
}

// A missing stream is a caller bug (every rank's tracker comes from ForRank), so it throws.
RngDraw RngTracker::Draw(const std::string& name) {
  const auto it = states_.find(name);
  if (it == states_.end()) {
    throw std::out_of_range(fmt::format("RngTracker::Draw: no stream '{}'", name));
  }
  return RngDraw{it->second.key, it->second.calls++};
}

}  // namespace mpusim
