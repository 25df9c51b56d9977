#include "core/estimate/not_modelled.h"

#include <fmt/format.h>

#include "core/config/model_facts.h"
#include "core/estimate/estimable.h"

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
    // Latency-bound, per MoE layer and micro-batch; their count and groups are Megatron's
    // (router.py, token_dispatcher.py), their price would need a small-message model (tree
    // and LL protocols) the ring model here does not have.
    items.push_back(
        "the router's and the dispatcher's small collectives beside the tokens' "
        "exchange: the token counts' all-reduce for the load-balancing loss (over "
        "tp x cp, or tp x dp x cp for global_aux_loss) or all-gather for the "
        "alltoall dispatcher's splits (over expt_tp x ep), and the routing "
        "probabilities' exchange (all-to-all, or all-gather with the routing map)");
    items.push_back(ep_overlap ? "the DeepEP / HybridEP (flex) dispatchers"
                               : "overlap of the experts' token exchanges with compute "
                                 "(overlap_moe_expert_parallel_comm, DeepEP / HybridEP "
                                 "dispatchers)");
  }
  const GptConfig* model = EstimatedModel(config);
  if (model != nullptr && model->mla.enabled) {
    items.push_back(
        "multi-latent attention's all-gathers of its latents under sequence "
        "parallelism and its fused rope kernels");
  }
  return items;
}

std::vector<std::string> ModelParts(const Config& config) {
  std::vector<std::string> parts;
  const GptConfig* model = EstimatedModel(config);
  if (model == nullptr) return parts;
  const GptConfig& g = *model;
  if (g.mla.enabled) {
    const MlaConfig& m = g.mla;
    parts.push_back(fmt::format(
        "multi-latent attention ({}, kv_lora_rank {}, query/key heads {} + {} rope, value "
        "heads {}): its projections' parameters and GEMMs, the q/kv latents, the up-projected "
        "queries, keys and values and the probabilities (or log-sum-exp) in the activations, "
        "Megatron's MLA FLOPs",
        m.q_lora_rank ? fmt::format("q_lora_rank {}", *m.q_lora_rank)
                      : std::string("no q_lora_rank: linear_q_proj"),
        m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim));
  }
  if (g.mtp_num_layers > 0) {
    const bool moe_layer = g.moe.enabled() && g.moe.layers.back();
    parts.push_back(fmt::format(
        "multi-token prediction ({} depth{}, on the last pipeline stage): its embedding copy, "
        "enorm, hnorm, eh_proj, a {} layer like the last decoder layer and final norm in the "
        "parameters; their activations and one more float32 logits a depth; their time and "
        "the extra output layer's (the last stage's imbalance); Megatron's MTP FLOPs (logits x "
        "{})",
        g.mtp_num_layers, g.mtp_num_layers == 1 ? "" : "s",
        moe_layer ? "mixture-of-experts" : "dense", g.mtp_num_layers + 1));
  }
  if (g.HasSlidingWindow()) {
    int64_t sliding = 0;
    for (int64_t i = 0; i < g.num_layers; ++i) sliding += g.AttentionWindow(i) >= 0 ? 1 : 0;
    parts.push_back(fmt::format(
        "sliding-window attention (window {} on {} of {} layers): flash / fused attention "
        "skips the blocks left of the window in the time; nothing changes in the activations "
        "(no mask is kept; materialised attention keeps the whole s x s); Megatron's FLOPs "
        "count full causal attention",
        (*g.window_size)[0], sliding, g.num_layers));
  }
  if (g.softmax_type != SoftmaxType::kVanilla) {
    parts.push_back(fmt::format(
        "attention sinks (softmax_type \"{}\"){}: TransformerEngine runs them with cuDNN's "
        "fused or the unfused attention, not FlashAttention (the attention backend resolved "
        "so)",
        SoftmaxTypeName(g.softmax_type),
        g.softmax_type == SoftmaxType::kLearnable ? ": a parameter per head" : ""));
  }
  if (g.moe.enabled() && (g.moe.score_function == MoeScoreFunction::kSigmoid ||
                          g.moe.enable_expert_bias || g.moe.group_limited())) {
    parts.push_back(fmt::format(
        "DeepSeek-style routing ({} scores{}{}): balanced routing assumed as for softmax; the "
        "router's GEMM in the time, not in Megatron's FLOPs",
        MoeScoreFunctionName(g.moe.score_function),
        g.moe.enable_expert_bias ? ", expert bias (float32 state, not a parameter)" : "",
        g.moe.group_limited()
            ? fmt::format(", top {} of {} groups", *g.moe.group_topk, g.moe.num_groups.value_or(0))
            : std::string()));
  }
  if (IsGated(g.activation) && g.activation != Activation::kSwiglu) {
    parts.push_back(fmt::format(
        "{} (gated): fc1's two halves in the parameters, activations and time; Megatron's "
        "FLOPs count swiglu alone as gated, so the model FLOPs (and MFU) count this MLP as a "
        "plain one, as Megatron reports it",
        ActivationName(g.activation)));
  }
  return parts;
}

}  // namespace mpusim
