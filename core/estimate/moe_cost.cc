// The mixture-of-experts layer's cost per micro-batch and rank (moe_cost.h).
#include "core/estimate/moe_cost.h"

#include <algorithm>

#include "core/config/gpt_config.h"

namespace mpusim::step_time {

MoeCost MoeForward(const GptConfig& g, const Sizes& x, const DerivedSizes& sz,
                   const MoeLinks& links) {
  const MoeConfig& moe = g.moe;
  const double Tn = x.region_tokens(), h = x.h, e = x.e;
  const double E = static_cast<double>(moe.num_experts);
  const double k = static_cast<double>(moe.router_topk);
  const double f = static_cast<double>(moe.ffn_hidden_size);
  const double f1 = IsGated(g.activation) ? 2 * f : f;
  const double ep = static_cast<double>(sz.ep), etp = static_cast<double>(sz.etp);
  // The share of the choices the experts compute: balanced routing keeps all of them unless
  // the capacity factor is below 1; padding to the capacity computes the capacity.
  double kept = 1;
  if (moe.expert_capacity_factor) {
    kept = moe.pad_expert_input_to_capacity ? *moe.expert_capacity_factor
                                            : std::min(1.0, *moe.expert_capacity_factor);
  }
  // This rank's tokens (its 1/t of the sequence with sp) choose k experts each; an expert's
  // rows reach its etp ranks, each computing 1/etp of its columns: per rank, Tn k kept rows
  // of whole experts' work.
  const double rows = Tn * k * kept;
  MoeCost out;
  out.router.Linear(Tn, E, h, false);  // the router's logits (a plain torch GEMM, never fp8)
  out.router.bytes += Tn * E * 4 * 3;  // softmax and top-k over float32 scores
  Cost& c = out.experts;
  // fc1 and fc2 of each local expert on its rows (the etp ranks' rows gathered, 1/etp of
  // the columns): one grouped launch with moe_grouped_gemm, else one GEMM per expert
  // (SequentialMLP).
  const double local = E / ep, per_expert = rows * etp / local;
  const double grouped = moe.grouped_gemm ? local : 1, launches = moe.grouped_gemm ? 1 : local;
  c.Linear(per_expert, f1 / etp, h, x.fp8, grouped, launches);
  c.Linear(per_expert, h, f / etp, x.fp8, grouped, launches);
  out.activation.bytes = rows * (f1 + f) * e;  // the activation function
  c.bytes += out.activation.bytes;
  c.bytes += 2 * (Tn * h * e + rows * h * e);  // permute and unpermute: read one, write the other
  if (moe.shared_expert_intermediate_size) {
    const double fs = static_cast<double>(*moe.shared_expert_intermediate_size);
    out.shared = MlpForward(x, IsGated(g.activation) ? 2 * fs : fs, fs);
    c += out.shared;
  }
  // The alltoall dispatcher's second permutation (token_dispatcher.py dispatch_postprocess
  // and combine_preprocess, sort_chunks_by_idxs): with more than one local expert the rows
  // received are sorted by local expert after the exchange and back before the return (read
  // and write each).
  if (moe.token_dispatcher == MoeDispatcher::kAllToAll && local > 1) {
    c.bytes += 2 * 2 * rows * etp * h * e;
  }
  out.compute = out.router;
  out.compute += out.experts;
  if (moe.token_dispatcher == MoeDispatcher::kAllToAll) {
    // Each rank's rows to their experts' ep ranks and back: two all-to-alls over ep; with
    // etp > 1 the received rows are all-gathered over expt_tp and the outputs
    // reduce-scattered back.
    out.operation = "all-to-all";
    if (sz.ep > 1) {
      // The rows for the ep - 1 other ranks: those on the rank's own node (g - 1 of them, g
      // the group's ranks per node) go over NVLink, the others over the rank's network adapter,
      // both at once (NCCL's all-to-all posts every peer's send together).
      const double sent = rows * h * e * (ep - 1) / ep;
      const double g_node = std::min(ep, links.ep_per_node);
      const double intra = rows * h * e * (g_node - 1) / ep, inter = sent - intra;
      const double seconds = links.ep.inter_node
                                 ? std::max(intra / links.ep_intra.bandwidth,
                                            inter / links.ep.bandwidth)
                                 : sent / links.ep.bandwidth;
      out.exchange_s += 2 * (seconds + links.ep.latency);
      out.exchanges += 2;
      out.exchange_bytes += 2 * sent;
      out.inter_node = links.ep.inter_node;
    }
    if (sz.etp > 1) {
      const double gathered = rows * etp * h * e;
      out.exchange_s +=
          2 * RingSeconds(gathered, sz.etp, 1, links.etp.bandwidth, links.etp.latency);
      out.exchanges += 2;
      out.exchange_bytes += 2 * gathered * (etp - 1) / etp;
      out.inter_node = out.inter_node || links.etp.inter_node;
    }
  } else {
    // Every rank's tokens all-gathered over etp x ep (tp_ep), each rank's experts' outputs
    // reduce-scattered back.
    out.operation = "all-gather + reduce-scatter";
    const int64_t group = sz.etp * sz.ep;
    if (group > 1) {
      const double gathered = Tn * h * e * static_cast<double>(group);
      out.exchange_s =
          2 * RingSeconds(gathered, group, 1, links.tp_ep.bandwidth, links.tp_ep.latency);
      out.exchanges = 2;
      out.exchange_bytes =
          2 * gathered * static_cast<double>(group - 1) / static_cast<double>(group);
      out.inter_node = links.tp_ep.inter_node;
    }
  }
  return out;
}

}  // namespace mpusim::step_time
