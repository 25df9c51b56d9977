// What communication costs in the step-time model (time_estimate.h): a ring collective's
// seconds, the link a kind of group runs on (intra- or inter-node, the rails a ring shares),
// context parallelism's exchange in one layer's core attention, and a stage's gradient
// reduction and parameter gather over dp x cp and expt_dp. Internal to core/estimate. Not
// here: what of it overlap hides (comm_overlap.h), the experts' token exchange (moe_cost.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config/gpt_config.h"
#include "core/estimate/gpu_spec.h"
#include "core/estimate/layer_cost.h"
#include "core/estimate/memory_estimate.h"
#include "core/tensor.h"
#include "core/topology.h"

namespace mpusim::step_time {

// A ring collective over n ranks moving `bytes` per rank in `phases` passes (an all-reduce
// is two: reduce-scatter and all-gather): phases * (n - 1) / n * bytes / bandwidth, plus a
// latency per ring step.
double RingSeconds(double bytes, int64_t n, int phases, double bandwidth, double latency);

struct Link {
  double bandwidth;
  double latency;
  bool inter_node;
};
// A kind's link for the busiest rank, whose group may be any of them: with a group across
// nodes, the network's. A ring collective (`ring`) whose group has g members on each node
// uses g of the node's adapters (one per GPU): every group of the kind runs at once, so the
// node's adapters are shared out g per group, and the ring's bytes between two nodes are
// split over g channels, as NCCL's rings are; a point-to-point send uses one.
Link LinkOf(const Topology& topology, const char* kind, const GpuSpec& gpu, bool ring);

// Context parallelism's exchange in one layer's core attention, per micro-batch: seconds
// of the forward and of the backward that the step waits for, and what a rank sends.
struct CpExchange {
  double forward_s = 0, backward_s = 0;
  int64_t forward_count = 0, backward_count = 0;
  double forward_bytes = 0, backward_bytes = 0;
  const char* operation = "";
};
// `step_forward_s`, `step_backward_s`: one ring step's attention seconds, forward and
// backward, behind which that step's sends run (a step's send waits for nothing else, but
// the next step needs it).
CpExchange CpExchangeOf(const GptConfig& g, const Sizes& x, int64_t cp, const Link& link,
                        double step_forward_s, double step_backward_s);

// One stage's gradient reduction and parameter gather (the busiest rank of the stage), per
// group kind (dp_cp for the dense parameters, expt_dp for the experts').
struct DpPart {
  std::string kind;  // "dp" or "expt_dp"
  double reduce_s = 0, gather_s = 0;  // the gather: the distributed optimizer's only
  double reduce_bytes = 0, gather_bytes = 0;
  bool inter_node = false;
};
// The parts of one stage whose busiest rank holds `held`: its dense parameters' gradients
// over dp_cp (`dp_link`), its experts' over expt_dp (`expt_dp_link`), in `grad_dtype` (the
// main_grad's: OptimizerPrecision); with the distributed optimizer a reduce-scatter and an
// all-gather of the parameters (`element_bytes` each), else an all-reduce. Groups of one rank
// and empty parts are left out.
std::vector<DpPart> DpPartsOf(const HeldMemory& held, const Topology& topology,
                              const Link& dp_link, const Link& expt_dp_link, DType grad_dtype,
                              double element_bytes, bool distributed);

}  // namespace mpusim::step_time
