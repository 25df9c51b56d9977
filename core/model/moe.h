// Megatron-Core's MoELayer (local spec) in place of the MLP on the layers moe_layer_freq
// picks: the TopKRouter, the allgather token dispatcher, SequentialMLP experts (or the
// grouped GEMM's, the same math) and an optional shared expert. Each expert is split over
// expt_tp, expert_tensor_parallel_size (etp) ranks: tp's own group by default, as the dense
// MLP is; with expert_model_parallel_size ep a rank holds E/ep of them (ExpertPlacement). When
// the experts are laid out apart (ep > 1 or etp != tp) the dispatcher's group is tp_ep (etp x
// ep ranks, carved out of tp x dp x cp), else tp. Every rank's tokens are its own (sequence
// parallelism is required with tp > 1), so any such group gathers distinct tokens.
//
// Shape legend (module.h; T = s_l*b this rank's tokens, T_all = g*T the dispatch group's (g
// its size: etp x ep, or tp under sequence parallelism, or 1), E experts, k =
// moe_router_topk, f = moe_ffn_hidden_size, f1 = 2f (swiglu) or f, t = etp):
//   router    logits = x W_r^T                 [T, E]      (W_r replicated; its gradient
//                                                           all-reduced over tp with the
//                                                           sequence-parallel parameters)
//             scores = softmax(logits)         [T, E]      lse [T]
//             (dtypes: RouterDTypesOf, core/config/gpt_config.h: the logits, the dispatched
//             probabilities and their weighting of the experts' outputs in moe_router_dtype
//             or the run's dtype; the softmaxes in float32, as Megatron's TopKRouter)
//             top-k of logits (or of scores with moe_router_pre_softmax), equal values by
//             the lower expert (Kernels::TopK); probs = softmax over the k chosen logits
//             (or the chosen scores)            [T, k]
//             moe_router_score_function "sigmoid" (DeepSeek-V3): scores = sigmoid(logits),
//             top-k of the scores, probs = the chosen scores / (their sum + 1e-20) when
//             k > 1 (the softmax stays for the z-loss's lse); group-limited top-k
//             (moe_router_num_groups G, moe_router_group_topk g): only the experts of the g
//             groups whose top k / g ranked values sum highest are chosen from; the
//             dispatched probabilities are probs * moe_router_topk_scaling_factor. These
//             choices are made on the host, as the capacity's (Megatron's
//             topk_routing_with_score_function, group_limited_topk); with
//             moe_router_enable_expert_bias the top-k (grouped or not) ranks scores +
//             expert_bias, the probabilities stay the unbiased scores
//             moe_router_score_function "sqrtsoftplus": scores = sqrt(softplus(logits))
//             (torch's softplus: the logit itself above 20), otherwise as the sigmoid
//   capacity  with moe_expert_capacity_factor: per expert ceil(T k / E * factor) of this
//             rank's tokens when that is below T, kept by probability ("probs") or position,
//             equal values by the lower token (the float64 reference's rule, on the host)
//   dispatch  x, probs and the kept choices all-gathered over the group [T_all, h], [T_all, k]
//             permuted over this rank's experts, tokens ascending       x_perm [N, h]
//   experts   per expert e on its n_e rows: fc1 [n_e, f1/t], act [n_e, f/t], times the
//             token's probability (Megatron's per_token_scale), fc2 partial sums [n_e, h]
//   combine   scatter-added back to tokens [T_all, h], reduce-scattered over the group to
//             [T, h] (the one collective sums the tp slices and the ep ranks' experts and
//             returns each rank its tokens); plus the shared expert's MLP (column/row-parallel,
//             as the dense MLP)
// The alltoall dispatcher (Megatron's MoEAlltoAllTokenDispatcher) moves only the routed rows:
// an uneven all-to-all over ep, then an all-gather over expt_tp, and back; the experts run
// as above on the rows it delivers. Dispatch and combine, of both dispatchers, and which
// experts a rank holds are core/expert_parallel/'s (token_dispatcher.h, expert_placement.h);
// this module keeps the router, the capacity, the auxiliary losses and the experts' math.
// Auxiliary losses, their gradients only (the reported loss stays the LM loss), scaled
// 1 / (M d) as Megatron's MoEAuxLossAutoScaler at cp / M leaves them after the 1 / (d cp)
// data-parallel average:
//   load balancing  coeff E / (k T_tot^2) sum_i count_i sum_t scores_ti, count_i the tokens
//                   whose top-k of scores holds i, summed over tp and cp (T_tot = T tp cp;
//                   the dense groups, whatever etp and ep are); with the sigmoid, scores_ti
//                   = sigmoid_ti / (sum_e sigmoid_te + 1e-20) (compute_routing_scores_for_aux_
//                   loss), no group limit in either
//   seq_aux_loss    per sample n of the b: coeff E / (k s^2) sum_i count_ni sum_{t of n}
//                   scores_ti, averaged over the b samples (count_ni over its s positions)
//   global_aux_loss coeff E / (k T_g^2) sum_i avg_i sum_t scores_ti: count_i summed over tp x
//                   dp x cp (T_g = T tp dp cp, the micro-batch's tokens of the whole pp
//                   stage), avg_i the mean of those counts over the step's micro-batches up to
//                   this one (Megatron's float32 global_tokens_per_expert / ga_steps, reset at
//                   the step's end: finalize_model_grads); its gradient is 1 / (M d) of each
//                   rank's share, as the others' (so 1 / d of the global loss's per micro-batch)
//   (moe_router_load_balancing_type may list several: each with its own coefficient, their
//   gradients added)
//   z-loss          coeff_z / (tp cp) mean_t lse_t^2
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "core/config/gpt_config.h"
#include "core/expert_parallel/expert_placement.h"
#include "core/expert_parallel/token_dispatcher.h"
#include "core/model/linear.h"
#include "core/model/stash_plan.h"

namespace mpusim {

class MoeLayer {
 public:
  // `prefix` is "decoder.layers.<i>.mlp"; `num_microbatches` scales the auxiliary losses.
  // `experts`: the ones this rank holds (all of them by default: no expert parallelism).
  MoeLayer(const GptConfig& gpt, std::string prefix, ParameterSet& params,
           int64_t num_microbatches, ExpertPlacement experts = {});
  struct Stash {
    Tensor x;               // [T, h] the router's input
    Tensor scores, lse;     // [T, E] softmax of the logits, [T] their log-sum-exp
    Tensor probs;           // [T, k] routing probabilities (before dropping and before
                            // moe_router_topk_scaling_factor)
                            // (all three in RouterDTypes' scores dtype)
    Tensor z_softmax;       // [T, E] sigmoid scores with the z-loss: softmax of the logits
    std::vector<int64_t> chosen;  // [T * k] experts, per token in rank order
    std::vector<double> aux;      // d(objective)/d(scores_ti): [E], the same for every t
                                  // (aux_loss, global_aux_loss), or [T, E] (with
                                  // seq_aux_loss: per sample)
    std::vector<double> dlse;     // [T] d(objective)/d(lse_t) of the z-loss (empty: none)
    std::vector<int64_t> kept_per_expert;  // [E] the kept choices per expert
    TokenRoute route;        // the dispatcher's permutation: N rows over the local experts
    Tensor x_perm, p_perm;   // [N, h], [N, 1] (p_perm in RouterDTypes' logits dtype)
    Tensor fc1_out, act;     // [N, f1/t], [N, f/t] (act before the probability)
    ColumnParallelLinear::Stash shared_fc1_in;
    Tensor shared_fc1_out;
    RowParallelLinear::Stash shared_fc2_in;
  };
  // The declared stash (stash_plan.h) on a rank of `shape`, in `dtype` storage, the experts
  // split over `etp` ranks: `rows` (N) permuted rows and, for the alltoall dispatcher, `sent`
  // rows in send order. The router decides both; a count passes their expectation. The host
  // vectors (chosen, aux, dlse, the route's offsets) are not the backend's tensors.
  static StashPlan PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                             int64_t etp, double rows, double sent);
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const;
  // Selective recomputation (transformer_layer.h): the experts' activation again from their
  // fc1 output ("moe_act"), and the shared expert's forward again from the layer's input
  // (st->shared_fc1_in.input; "shared_experts"), each refilling `st`.
  void RecomputeActivation(const ModuleContext& ctx, Stash* st) const;
  void RecomputeSharedExpert(const ModuleContext& ctx, Stash* st) const;
  // The last forward's dispatch: for each of this rank's experts, the tokens it received
  // from each rank of the dispatch group (group rank order); empty before a forward.
  const std::vector<std::vector<int64_t>>& received() const { return received_; }
  // received() as one line: "expert 2 <- 37 tokens (from the dispatch group's ranks: 10 9 9
  // 9), expert 3 <- ..."; with the alltoall dispatcher and ep > 1 followed by what the
  // last forward's all-to-all sent each ep rank: "; all-to-all to ep ranks 0 1: 61 67 rows,
  // 15860 17420 bytes" (a row: the token's hidden state and its probability).
  std::string ReceivedNote() const;
  // moe_router_enable_expert_bias: Megatron's `expert_bias` buffer (float32 [E], zeros at
  // the start; empty without the key). tokens_per_expert: the kept choices per expert of
  // this rank's micro-batches of the step (local_tokens_per_expert, counted at each
  // backward; every MoE layer counts them, and the step's start resets them).
  // UpdateExpertBias takes those counts summed over tp x dp x cp (finalize_model_grads's
  // all-reduce) and moves the bias as get_updated_expert_bias does; the counts stay for the
  // run's report until the next step.
  const std::vector<float>& expert_bias() const { return expert_bias_; }
  const std::vector<int64_t>& tokens_per_expert() const { return tokens_per_expert_; }
  void UpdateExpertBias(const std::vector<float>& tokens_per_expert) const;
  void ResetTokensPerExpert() const {
    std::fill(tokens_per_expert_.begin(), tokens_per_expert_.end(), 0);
  }
  // "global_aux_loss": the step's end (finalize_model_grads's reset_model_temporary_tensors,
  // reset_global_aux_loss_tracker): checks that each of the M micro-batches joined the
  // tracker once, then zeroes it. Nothing without the loss.
  void ResetGlobalAuxLossTracker() const;

 private:
  // The host-side routing of one forward: counts, capacity, the auxiliary gradients'
  // coefficients, then the dispatcher's permutation.
  // `probs`: the chosen probabilities as the dispatcher carries them (the capacity's key).
  void Route(const ModuleContext& ctx, const Tensor& top_scores, const Tensor& probs,
             Stash* st) const;
  // "global_aux_loss": the averaged counts micro-batch `microbatch`'s loss uses, its
  // tp x dp x cp `counts` joining the tracker at its first forward.
  const std::vector<float>& GlobalAverage(int64_t microbatch,
                                          const std::vector<int64_t>& counts) const;

  std::string prefix_;
  Activation activation_;
  GluOptions glu_;  // the gated activation's offset and clamp (routed and shared experts)
  MoeConfig moe_;
  int64_t num_microbatches_;
  Parameter* router_;
  Parameter* router_bias_;  // add_bias_linear: TopKRouter's bias [E]; else null
  ExpertPlacement experts_;
  std::vector<Parameter*> fc1_, fc2_;  // per local expert, etp shards [f1/t, h], [h, f/t]
  // add_bias_linear (expert_tensor_parallel_size 1): per local expert [f1], [h]; else empty.
  std::vector<Parameter*> fc1_bias_, fc2_bias_;
  mutable std::vector<std::vector<int64_t>> received_;  // see received()
  mutable std::vector<int64_t> sent_rows_;  // the last forward's rows to each ep rank
  mutable int64_t row_bytes_ = 0;           // bytes of one such row
  mutable std::vector<float> expert_bias_;  // see expert_bias()
  mutable std::vector<int64_t> tokens_per_expert_;  // see tokens_per_expert()
  // "global_aux_loss": Megatron's float32 buffers global_tokens_per_expert [E] and ga_steps,
  // advanced by each micro-batch's forward; and per micro-batch of the step the averaged
  // counts its loss used (empty until then: a recomputed forward reuses them, as Megatron's
  // tracker counts a micro-batch once).
  mutable std::vector<float> global_tokens_per_expert_;
  mutable float ga_steps_ = 0;
  mutable std::vector<std::vector<float>> global_average_;
  std::optional<ColumnParallelLinear> shared_fc1_;
  std::optional<RowParallelLinear> shared_fc2_;
};

}  // namespace mpusim
