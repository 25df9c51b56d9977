// Megatron's MoE token dispatchers: MoEAllGatherTokenDispatcher ("allgather") and
// MoEAlltoAllTokenDispatcher ("alltoall"). They take the tokens a rank routed (each token's
// k chosen experts, decided by the router) to the ranks holding those experts, in the order
// the experts compute them, and bring the experts' results back to the tokens.
//
// What it is: the groups, the permutation, the exchanges and their way back, forward and
// backward (the backward runs the same path with the gradients). What it is not: the router
// (top-k, capacity, auxiliary losses) nor the experts' math; core/model/moe does both.
//
// Shapes (T this rank's tokens, k = moe_router_topk, h the hidden size, t the expt_tp size,
// g the dispatch group's size; a route is [T * k], each (token, slot)'s expert or -1 once
// dropped):
//   allgather  dispatch  x [T, h], probs [T, k] and the route all-gathered over the dispatch
//                        group (tp_ep: etp x ep ranks when the experts are laid out apart,
//                        else tp under sequence parallelism) [g T, h]; the rows permuted over
//                        this rank's experts, expert by expert, tokens ascending [N, h]
//              combine   scatter-added back per token [g T, h], then one reduce-scatter over
//                        the group sums the etp slices and the ep ranks' experts and returns
//                        each rank its tokens [T, h]
//   alltoall   permute   this rank's kept (token, slot) rows, expert by expert, tokens
//                        ascending [N_send, h], their probabilities [N_send, 1]
//              counts    every ep rank's per-expert counts all-gathered over ep (the split
//                        sizes), every etp rank's arrival counts over expt_tp
//              exchange  the uneven all-to-all over ep, then the all-gather over expt_tp of
//                        each etp rank's rows padded to the largest [t R_pad, h]; the experts'
//                        rows sorted by local expert, then etp rank, then ep rank
//              combine   the reduce-scatter over expt_tp, the all-to-all back, each rank
//                        scatter-adding its rows' results to their tokens [T, h]
#pragma once

#include <cstdint>
#include <vector>

#include "core/communicator.h"
#include "core/config/gpt_config.h"
#include "core/expert_parallel/expert_placement.h"
#include "core/kernels.h"

namespace mpusim {

// The groups a dispatcher exchanges over; null where no other rank is involved.
struct DispatchGroups {
  // allgather: tp_ep (etp x ep) when the experts are laid out apart, else tp under sequence
  // parallelism (whose ranks hold different tokens); null when no rank but this one holds
  // tokens this rank's experts need.
  Communicator* gather = nullptr;
  // alltoall: the all-to-all over ep (null when expert_model_parallel_size is 1) and the
  // gather after it (Megatron's expt_tp exchange) over expt_tp, or tp under sequence
  // parallelism when the experts are laid out as the dense layers; null when one rank.
  Communicator* ep = nullptr;
  Communicator* expt_tp = nullptr;
};
// The groups from the layout's: tp, and tp_ep, expt_tp and ep (null when the experts are
// laid out as the dense layers, and ep when expert_model_parallel_size is 1).
DispatchGroups ChooseDispatchGroups(Communicator& tp, bool sequence_parallel, Communicator* tp_ep,
                                    Communicator* expt_tp, Communicator* ep);

// One forward's routing: what dispatch, combine and the backward need.
struct TokenRoute {
  Tensor token_ids, slot_ids;    // int64 [N]: each permuted row's token in [0, T_all) and
                                 // its entry token * k + slot of the gathered probs (the
                                 // alltoall dispatcher: both its row of the exchanged rows,
                                 // [0, t * tp_pad))
  std::vector<int64_t> offsets;  // [local experts + 1]: local expert e has permuted rows
                                 // [offsets[e], offsets[e + 1])
  // The alltoall dispatcher only (empty otherwise): this rank's rows in send order, their
  // token in [0, T) and entry token * k + slot; the rows sent to and received from each ep
  // rank; the rows after the all-to-all, and each etp rank's rows padded to tp_pad.
  Tensor send_tokens, send_slots;
  std::vector<int64_t> ep_send, ep_recv;
  int64_t tp_rows = 0, tp_pad = 0;
};

class TokenDispatcher {
 public:
  TokenDispatcher(MoeDispatcher kind, const DispatchGroups& groups)
      : alltoall_(kind == MoeDispatcher::kAllToAll), groups_(groups) {}

  // The permutation of `route` ([T * k]) over this rank's experts, written into `out`, and
  // for each of them the tokens it receives from each rank of the dispatch group (group rank
  // order; the alltoall dispatcher: of tp_ep, etp fastest) into `received`.
  void Route(Kernels& k, const std::vector<int64_t>& route, int64_t T, int64_t E, int64_t K,
             const ExpertPlacement& experts, TokenRoute* out,
             std::vector<std::vector<int64_t>>* received) const;
  // The rows the permutation (token_ids) picks from: the dispatch group's tokens [T_all, w]
  // (allgather), or the rows routed to this rank's experts (alltoall).
  Tensor DispatchTokens(Kernels& k, const Tensor& x, const TokenRoute& route) const;
  // The same for the probabilities [T, k] (slot_ids picks from them): [T_all * k, 1] or the
  // routed rows' [rows, 1].
  Tensor DispatchProbs(Kernels& k, const Tensor& probs, const TokenRoute& route) const;
  // The experts' results per dispatched row, `rows` [DispatchTokens' rows, w], back to this
  // rank's T tokens, summed [T, w].
  Tensor CombineTokens(Kernels& k, const Tensor& rows, int64_t T, const TokenRoute& route) const;
  // The probabilities' gradient per dispatched entry [ProbRows, 1] back to [T, k], summed.
  Tensor CombineProbs(Kernels& k, const Tensor& rows, int64_t T, int64_t K,
                      const TokenRoute& route) const;
  // DispatchProbs' rows for `token_rows` rows of DispatchTokens.
  int64_t ProbRows(int64_t token_rows, int64_t K) const {
    return alltoall_ ? token_rows : token_rows * K;
  }
  // What the last forward's all-to-all sent each ep rank, in rows (empty: no all-to-all).
  std::vector<int64_t> SentRows(const TokenRoute& route) const {
    return alltoall_ && groups_.ep != nullptr ? route.ep_send : std::vector<int64_t>{};
  }

 private:
  void RouteAllToAll(Kernels& k, const std::vector<int64_t>& route, int64_t T, int64_t E, int64_t K,
                     const ExpertPlacement& experts, TokenRoute* out,
                     std::vector<std::vector<int64_t>>* received) const;
  // The alltoall dispatcher's way to the experts and back (rows in send order [N_send, w]
  // <-> [t * tp_pad, w]).
  Tensor AllToAllDispatch(Kernels& k, const Tensor& rows, const TokenRoute& route) const;
  Tensor AllToAllCombine(Kernels& k, const Tensor& partial, const TokenRoute& route) const;

  bool alltoall_;
  DispatchGroups groups_;
};

}  // namespace mpusim
