// What communication costs in the step-time model (comm_cost.h): ring collectives, the
// link of a kind of group, context parallelism's exchange, the gradient reduction and
// parameter gather of a stage. Not here: overlap (comm_overlap.cc).
#include "core/estimate/comm_cost.h"

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace mpusim::step_time {

double RingSeconds(double bytes, int64_t n, int phases, double bandwidth, double latency) {
  if (n <= 1) return 0;
  const double steps = static_cast<double>(phases * (n - 1));
  return steps / static_cast<double>(n) * bytes / bandwidth + steps * latency;
}

Link LinkOf(const Topology& topology, const char* kind, const GpuSpec& gpu, bool ring) {
  const std::optional<size_t> k = topology.FindKind(kind);
  // O(axes) whatever the world size (all kinds here are direct); the fewest-members query
  // walks nodes only when a custom order puts another axis between the kind's axes.
  const bool inter = k && topology.AnyGroupSpansNodes(*k);
  if (!inter) {
    return {gpu.intra_node_bandwidth * gpu.collective_efficiency, gpu.intra_node_latency_s,
            false};
  }
  const auto rails = static_cast<double>(ring ? topology.FewestGroupMembersOnANode(*k) : 1);
  const double bw = std::min(rails * gpu.inter_node_bandwidth, gpu.intra_node_bandwidth);
  return {bw * gpu.collective_efficiency, gpu.inter_node_latency_s, true};
}

CpExchange CpExchangeOf(const GptConfig& g, const Sizes& x, int64_t cp, const Link& link,
                        double step_forward_s, double step_backward_s) {
  CpExchange out;
  if (cp <= 1) return out;
  const double n = static_cast<double>(cp);
  const double T = x.tokens();
  // The query and key head dim, the value's (multi-latent attention's differ).
  const double dq = static_cast<double>(g.QueryKeyHeadDim());
  const double dv = static_cast<double>(g.ValueHeadDim());
  const double heads = static_cast<double>(g.num_attention_heads) / x.t;
  const double groups = static_cast<double>(g.num_query_groups) / x.t;
  const double kv = T * groups * (dq + dv) * x.e;  // this rank's keys and values
  switch (g.cp_comm_type) {
    case CpCommType::kAllGather:
      // All-gather the keys and values of every position; reduce-scatter their gradients.
      out.operation = "all-gather, reduce-scatter";
      out.forward_s = out.backward_s = RingSeconds(kv * n, cp, 1, link.bandwidth, link.latency);
      out.forward_count = out.backward_count = 1;
      out.forward_bytes = out.backward_bytes = kv * (n - 1);
      break;
    case CpCommType::kA2a: {
      // Four all-to-alls each way: q, k, v in, the context out.
      out.operation = "all-to-all";
      const double local = T * x.e * (heads * (dq + dv) + groups * (dq + dv));
      out.forward_s = out.backward_s =
          local * (n - 1) / n / link.bandwidth + 4 * (n - 1) * link.latency;
      out.forward_count = out.backward_count = 4;
      out.forward_bytes = out.backward_bytes = local * (n - 1) / n;
      break;
    }
    default: {
      // The ring: cp - 1 sends of this rank's keys and values forward, of them and their
      // gradients backward, each overlapped with one step's block of attention: what a send
      // takes beyond its step's kernel is exposed.
      out.operation = "ring send/recv";
      const double send = kv / link.bandwidth + link.latency;
      out.forward_s = (n - 1) * std::max(0.0, send - step_forward_s);
      out.backward_s = (n - 1) * std::max(0.0, 2 * send - step_backward_s);
      out.forward_count = cp - 1;
      out.backward_count = 2 * (cp - 1);
      out.forward_bytes = (n - 1) * kv;
      out.backward_bytes = 2 * (n - 1) * kv;
      break;
    }
  }
  return out;
}

std::vector<DpPart> DpPartsOf(const HeldMemory& held, const Topology& topology,
                              const Link& dp_link, const Link& expt_dp_link, DType grad_dtype,
                              double element_bytes, bool distributed) {
  std::vector<DpPart> parts;
  const double experts = static_cast<double>(held.expert_elements);
  const double dense_elements = static_cast<double>(held.parameter_elements) - experts;
  for (const auto& [elements, kind, link] :
       {std::tuple{dense_elements, "dp_cp", dp_link},
        std::tuple{experts, "expt_dp", expt_dp_link}}) {
    const int64_t d = topology.GroupSize(*topology.FindKind(kind));
    if (d <= 1 || elements <= 0) continue;
    const double grad_bytes = elements * static_cast<double>(DTypeSize(grad_dtype));
    const double share = static_cast<double>(d - 1) / static_cast<double>(d);
    DpPart part;
    part.kind = std::string(kind) == "dp_cp" ? "dp" : kind;
    part.inter_node = link.inter_node;
    if (distributed) {
      const double gathered = elements * element_bytes;
      part.reduce_s = RingSeconds(grad_bytes, d, 1, link.bandwidth, link.latency);
      part.gather_s = RingSeconds(gathered, d, 1, link.bandwidth, link.latency);
      part.reduce_bytes = grad_bytes * share;
      part.gather_bytes = gathered * share;
    } else {
      part.reduce_s = RingSeconds(grad_bytes, d, 2, link.bandwidth, link.latency);
      part.reduce_bytes = 2 * grad_bytes * share;
    }
    parts.push_back(part);
  }
  return parts;
}

}  // namespace mpusim::step_time
