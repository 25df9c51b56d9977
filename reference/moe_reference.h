// The float64 reference's mixture-of-experts layer (gpt_reference.cc calls it in place of the
// MLP on the layers moe_layer_freq makes MoE layers): Megatron-Core's MoELayer with the
// TopKRouter, written from the model's math, forward and backward by hand.
//
// On the pre-MLP norm's output x [s*n, h] (row i*n + j: position i of slice sample j), per
// data-parallel rank of the slice (its b samples) and, inside it, per router group (the
// tokens one rank's router sees: the rank's cp chunks and, under sequence parallelism, its tp
// piece of them; row order position-major as Megatron's [s_local, b, h] -> [s_local*b, h]):
//   logits   Z = x W_router^T                                   [T, E]
//   top-k    the k largest logits (or softmax(Z) with moe_router_pre_softmax), equal values
//            by the lower expert (Kernels::TopK's rule); p = softmax over the k chosen
//            logits (or the chosen entries of softmax(Z))
//            moe_router_score_function "sigmoid": the k largest sigmoid(Z), p = the chosen
//            sigmoids / (their sum + 1e-20) when k > 1, else the chosen sigmoid;
//            "sqrtsoftplus" the same with sqrt(softplus(Z)) (torch's softplus: Z above 20)
//            group-limited (moe_router_num_groups G, moe_router_group_topk g): the k are
//            chosen among the experts of the g groups (E / G consecutive experts) whose
//            largest k / g ranked values sum highest, equal sums by the lower group
//            p times moe_router_topk_scaling_factor (capacity and experts see it scaled)
//            moe_router_enable_expert_bias: the choice (grouped or not) ranks the sigmoids
//            plus the expert bias, p stays of the sigmoids; the kept choices are counted
//            per expert for the bias's update (gpt_reference.h)
//   capacity with moe_expert_capacity_factor: per group and expert, ceil(T k / E * factor)
//            tokens; when that is below T, the expert keeps the tokens with the largest p (0
//            for a token not routed to it; "probs") or the earliest routed ("position"),
//            equal values by the lower token, and drops the others
//   experts  y_t = sum over the experts e that kept t of fc2_e(act(fc1_e(x_t)) * p_te), plus
//            the shared expert's fc2(act(fc1(x_t)))
// The auxiliary objective, per micro-batch and dp rank, scaled 1 / (M d) (Megatron's
// MoEAuxLossAutoScaler at cp / M after the 1 / (d cp) data-parallel average):
//   load balancing  coeff E / (k T_dp^2) sum_i count_i sum_t softmax(Z_t)_i, count_i the
//                   tokens of the dp rank whose top-k of softmax(Z) holds i (before dropping);
//                   with the sigmoid, sigmoid(Z_t) / (sum sigmoid(Z_t) + 1e-20) in place of
//                   softmax(Z_t), in the counts' top-k too (no group limit in either)
//   seq_aux_loss    1 / b sum over the dp rank's samples n of coeff E / (k s^2) sum_i
//                   count_ni sum_{t of n} softmax(Z_t)_i, count_ni over sample n's tokens
//   global_aux_loss coeff E / (k (s B)^2) sum_i avg_i sum over all B samples' tokens of
//                   softmax(Z_t)_i, avg_i the float32 mean over the step's micro-batches so
//                   far of count_i over the whole batch (Megatron's global_tokens_per_expert
//                   / ga_steps; the run's slice must be the whole batch)
//   (a list of types adds their terms, each with its own coefficient)
//   z-loss          coeff_z / (tp cp) sum over its groups of mean_t logsumexp(Z_t)^2
// They add gradients to the router only; the reported loss stays the LM loss.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config/gpt_config.h"
#include "reference/gpt_reference_ops.h"

namespace mpusim::gpt_reference {

struct MoeParams {
  Param router;                 // [E, h]
  Param router_bias;            // add_bias_linear: [E]; else undefined
  std::vector<Param> fc1, fc2;  // per expert: [f1e, h], [h, fe]
  std::vector<Param> fc1_bias, fc2_bias;  // add_bias_linear: per expert [f1e], [h]; else empty
  Param shared_fc1, shared_fc2;  // moe_shared_expert_intermediate_size only
  // moe_router_enable_expert_bias: the bias [E] added to the sigmoids for choosing only
  // (float32 values), and the kept choices per expert counted over the forwards (the step's
  // local_tokens_per_expert; the caller zeroes it). Both empty without the key.
  std::vector<double> expert_bias;
  std::vector<double>* tokens_per_expert = nullptr;
  // moe_router_load_balancing_type "global_aux_loss": Megatron's float32 tracker of the step
  // (global_tokens_per_expert [E], ga_steps), which each micro-batch's forward advances; the
  // caller starts it at zero each step. Null without the loss.
  struct GlobalAuxTracker {
    std::vector<float> tokens;
    float steps = 0;
  };
  GlobalAuxTracker* global_aux = nullptr;
  bool defined() const { return router.defined(); }
};

// How the slice's tokens meet the routers: b samples per dp rank; the tp x cp router groups
// of a dp rank (tp only under sequence parallelism).
struct MoeLayout {
  int64_t b = 1, t = 1, cp = 1;
  bool sp = false;
};

struct MoeStash {
  struct Group {
    std::vector<int64_t> rows;  // slice rows of its tokens, in the router's order
    Mat logits, scores;         // [T, E]; scores = softmax(logits)
    Mat sig, aux_scores;        // [T, E] per-logit scores (sigmoid or sqrt(softplus) of the
                                // logits), and normalised
                                // over the experts (the load-balancing loss's scores)
    Vec lse;                    // [T]
    std::vector<std::vector<int64_t>> chosen;  // [T][k] experts, in rank order
    std::vector<std::vector<double>> p;        // [T][k] probabilities before dropping
    std::vector<std::vector<bool>> kept;       // [T][k]
    Mat aux_c;                  // [T, E] the load-balancing gradient's coefficients per
                                // token (scaled; empty: no load-balancing loss)
    double z_scale = 0;         // d(z objective)/d(lse_t^2) per token (scaled)
  };
  std::vector<Group> groups;
  Mat x;  // [rows, h]
  struct Expert {
    std::vector<int64_t> rows;   // slice rows it computes, ascending
    std::vector<int64_t> group;  // and for each, its group and token and top-k slot
    std::vector<int64_t> token, slot;
    Mat fc1, act;  // [tokens, f1e], [tokens, fe] (before the probability)
  };
  std::vector<Expert> experts;
  Mat shared_fc1, shared_act;
};

// y [rows, h]; adds the micro-batch's auxiliary objective (already scaled) to *aux_objective.
Mat MoeForward(const Dims& d, const GptConfig& gpt, const MoeLayout& layout, const Mat& x,
               const MoeParams& p, MoeStash* stash, double* aux_objective);
// dx [rows, h] from dy; the parameter gradients add into their accumulators.
Mat MoeBackward(const Dims& d, const GptConfig& gpt, const Mat& dy, const MoeStash& stash,
                MoeParams& p);

}  // namespace mpusim::gpt_reference
