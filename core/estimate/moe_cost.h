// A mixture-of-experts layer in the step-time model (time_estimate.h "moe"): the router, the
// permutation, the experts' GEMMs (grouped or one launch per expert), the shared expert, and
// the dispatcher's token exchange over ep / expt_tp / tp_ep, per micro-batch and rank, for
// balanced routing. Internal to core/estimate. Not here: the attention beside it
// (layer_cost.h), overlap_moe_expert_parallel_comm's pairing (comm_overlap.h).
#pragma once

#include <cstdint>

#include "core/config/gpt_config.h"
#include "core/estimate/comm_cost.h"
#include "core/estimate/layer_cost.h"
#include "core/topology.h"

namespace mpusim::step_time {

// A mixture-of-experts layer in place of the MLP, per micro-batch and rank, for balanced
// routing (every expert gets as many of the choices; capped at the capacity): the router,
// the permutation, the experts' GEMMs, the shared expert, and the token exchange over ep.
struct MoeCost {
  Cost compute;          // GEMMs, memory-bound kernels and the shared expert's tp collective
  Cost router;           // of `compute`: the router (Megatron's pre-dispatch part)
  Cost experts;          // of `compute`: the rest (the experts, permutation, shared expert)
  Cost activation;       // of `experts`: the experts' activation function
  Cost shared;           // of `experts`: the shared expert's MLP (empty without one)
  double exchange_s = 0;  // the dispatcher's exchanges of one pass (the backward's mirror them)
  int64_t exchanges = 0;  // collectives per pass
  double exchange_bytes = 0;  // what this rank sends per pass
  const char* operation = "";
  bool inter_node = false;
};

// `ep`, `etp`, `tp_ep`: the links of those groups for this layout (core/topology.h's kinds);
// `ep_intra` NVLink's, which the all-to-all's peers on the rank's own node use, and
// `ep_per_node` how many of an ep group's ranks share a node (all of them when the group stays
// in one).
struct MoeLinks {
  Link ep, etp, tp_ep;
  Link ep_intra;
  double ep_per_node = 1;
};

MoeCost MoeForward(const GptConfig& g, const Sizes& x, const DerivedSizes& sz,
                   const MoeLinks& links);

}  // namespace mpusim::step_time
