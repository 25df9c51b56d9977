// Expert parallelism's grouping of the experts: which of a MoE layer's E experts an ep rank
// holds, and which parameters are an expert's (their gradients reduce over expt_dp, not dp).
//
// What it is: Megatron's local-expert numbering. What it is not: the expert groups (the
// planner's expert rank generator, core/topology.h), nor the experts' math (core/model/moe).
//
// With expert_model_parallel_size ep, ep rank r holds experts [r E/ep, (r + 1) E/ep); E must
// be divisible by ep. E = 8, ep = 4: ep rank 0 holds experts 0 1, ep rank 3 experts 6 7.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace mpusim {

// Which experts a rank holds: ep rank r of `ep` holds experts [r E/ep, (r + 1) E/ep)
// (Megatron's local experts; E divisible by ep).
struct ExpertPlacement {
  int64_t num_experts = 0;
  int64_t ep = 1;
  int64_t ep_rank = 0;
  int64_t first() const { return ep_rank * (num_experts / ep); }
  int64_t count() const { return num_experts / ep; }
  bool Holds(int64_t e) const { return e >= first() && e < first() + count(); }
};

// The expert number in an expert parameter's name ("...mlp.experts.local_experts.<e>...."), or
// none for any other parameter.
std::optional<int64_t> ExpertOf(std::string_view name);

}  // namespace mpusim
