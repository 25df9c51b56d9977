#include "core/estimate/not_modelled.h"

#include "core/config/model_facts.h"

namespace mpusim {

std::vector<std::string> NotModelled(const Config& config) {
  const bool ep_overlap = config.parallel.overlap_moe_expert_parallel_comm;
  std::vector<std::string> items = {
      "kernel launch overheads and host-side gaps between kernels",
      "data loading",
      ep_overlap
          ? "overlap of communication with compute beyond tp_comm_overlap, overlap_grad_reduce, "
            "overlap_param_gather, overlap_moe_expert_parallel_comm and the cp ring's sends (the "
            "pipeline's sends are exposed), and the slowdown of the compute that overlapped "
            "communication shares the GPU with"
          : "overlap of communication with compute beyond tp_comm_overlap, overlap_grad_reduce, "
            "overlap_param_gather and the cp ring's sends (the pipeline's sends and the experts' "
            "exchanges are exposed), and the slowdown of the compute that overlapped "
            "communication shares the GPU with",
      "GEMM tiles other than 256 x 128, split-K and stream-K (small GEMMs are priced "
      "pessimistically)",
      "the GPU's clock under power limits",
      "memory outside the reserve: TransformerEngine's userbuffers (tp_comm_overlap), CUDA "
      "graphs' pools, NCCL's per-communicator structures besides its buffers",
  };
  const ModelFacts facts = FactsOf(config);
  if (facts.fp8) {
    items.push_back("fp8 weights (fp8_param), fp8 attention, first_last_layers_bf16 and the "
                    "delayed recipe's amax reductions");
  }
  if (facts.moe.enabled()) {
    items.push_back("uneven expert routing (balanced routing assumed) and the dispatchers' "
                    "communication buffers");
    items.push_back(ep_overlap ? "the DeepEP / HybridEP (flex) dispatchers"
                               : "overlap of the experts' token exchanges with compute "
                                 "(overlap_moe_expert_parallel_comm, DeepEP / HybridEP "
                                 "dispatchers)");
  }
  return items;
}

}  // namespace mpusim
