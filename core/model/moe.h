// Megatron-Core's MoELayer (local spec) in place of the MLP on the layers moe_layer_freq
// picks: the TopKRouter, the allgather token dispatcher, SequentialMLP experts (or the
// grouped GEMM's, the same math) and an optional shared expert. Expert parallelism is not
// built yet: every rank holds every expert, split over tp as the dense MLP is (expert tensor
// parallelism = tp), so the dispatcher's group tp_ep is the tp group.
//
// Shape legend (module.h; T = s_l*b this rank's tokens, T_all = t*T the tp group's under
// sequence parallelism (t = 1 otherwise), E experts, k = moe_router_topk, f = moe_ffn_hidden_size,
// f1 = 2f (swiglu) or f):
//   router    logits = x W_r^T                 [T, E]      (W_r replicated; its gradient
//                                                           all-reduced over tp with the
//                                                           sequence-parallel parameters)
//             scores = softmax(logits)         [T, E]      lse [T]
//             top-k of logits (or of scores with moe_router_pre_softmax), equal values by
//             the lower expert (Kernels::TopK); probs = softmax over the k chosen logits
//             (or the chosen scores)            [T, k]
//   capacity  with moe_expert_capacity_factor: per expert ceil(T k / E * factor) of this
//             rank's tokens when that is below T, kept by probability ("probs") or position,
//             equal values by the lower token (the float64 reference's rule, on the host)
//   dispatch  x, probs and the kept choices all-gathered over tp      [T_all, h], [T_all, k]
//             permuted expert by expert, tokens ascending               x_perm [N, h]
//   experts   per expert e on its n_e rows: fc1 [n_e, f1/t], act [n_e, f/t], times the
//             token's probability (Megatron's per_token_scale), fc2 partial sums [n_e, h]
//   combine   scatter-added back to tokens [T_all, h], reduce-scattered over tp to [T, h]
//             (the one collective sums the tp ranks' partial sums and returns each its
//             tokens); plus the shared expert's MLP (column/row-parallel, as the dense MLP)
// Auxiliary losses, their gradients only (the reported loss stays the LM loss), scaled
// 1 / (M d) as Megatron's MoEAuxLossAutoScaler at cp / M leaves them after the 1 / (d cp)
// data-parallel average:
//   load balancing  coeff E / (k T_tot^2) sum_i count_i sum_t scores_ti, count_i the tokens
//                   whose top-k of scores holds i, summed over tp and cp (T_tot = T t cp)
//   z-loss          coeff_z / (t cp) mean_t lse_t^2
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/config/gpt_config.h"
#include "core/model/linear.h"

namespace mpusim {

class MoeLayer {
 public:
  // `prefix` is "decoder.layers.<i>.mlp"; `num_microbatches` scales the auxiliary losses.
  MoeLayer(const GptConfig& gpt, std::string prefix, ParameterSet& params,
           int64_t num_microbatches);
  struct Stash {
    Tensor x;               // [T, h] the router's input
    Tensor scores, lse;     // [T, E] softmax of the logits, [T] their log-sum-exp
    Tensor probs;           // [T, k] routing probabilities (before dropping)
    std::vector<int64_t> chosen;  // [T * k] experts, per token in rank order
    std::vector<double> aux;      // [E] d(objective)/d(scores_ti), the same for every t
    std::vector<double> dlse;     // [T] d(objective)/d(lse_t) of the z-loss (empty: none)
    Tensor token_ids, slot_ids;   // int64 [N]: each permuted row's token in [0, T_all) and
                                  // its entry token * k + slot of the gathered probs
    std::vector<int64_t> offsets;  // [E + 1] expert e has permuted rows [offsets[e], offsets[e+1])
    Tensor x_perm, p_perm;   // [N, h], [N, 1]
    Tensor fc1_out, act;     // [N, f1/t], [N, f/t] (act before the probability)
    ColumnParallelLinear::Stash shared_fc1_in;
    Tensor shared_fc1_out;
    RowParallelLinear::Stash shared_fc2_in;
  };
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& stash) const;

 private:
  // The per-token scaling of the experts' activations: out[r, :] = p[r] * a[r, :].
  void ScaleRows(Kernels& k, const Tensor& p, const Tensor& a, Tensor& out) const;
  // The host-side routing of one forward: counts, capacity, the gathered choices, the
  // permutation and the auxiliary gradients' coefficients.
  void Route(const ModuleContext& ctx, const Tensor& top_scores, Stash* st) const;

  std::string prefix_;
  Activation activation_;
  MoeConfig moe_;
  int64_t num_microbatches_;
  Parameter* router_;
  std::vector<Parameter*> fc1_, fc2_;  // per expert, local shards [f1/t, h], [h, f/t]
  std::optional<ColumnParallelLinear> shared_fc1_;
  std::optional<RowParallelLinear> shared_fc2_;
};

}  // namespace mpusim
