// Megatron's MoE token dispatchers (see token_dispatcher.h).
#include "core/expert_parallel/token_dispatcher.h"

#include <algorithm>
#include <numeric>

#include "core/expert_parallel/permute.h"
#include "core/tensor_parallel/mappings.h"

namespace mpusim {
namespace {

std::vector<int64_t> Times(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out;
  for (int64_t r : rows) out.push_back(r * width);
  return out;
}

}  // namespace

DispatchGroups ChooseDispatchGroups(Communicator& tp, bool sequence_parallel, Communicator* tp_ep,
                                    Communicator* expt_tp, Communicator* ep) {
  Communicator* sp_tp = sequence_parallel && tp.Size() > 1 ? &tp : nullptr;
  DispatchGroups groups;
  groups.gather = tp_ep != nullptr ? (tp_ep->Size() > 1 ? tp_ep : nullptr) : sp_tp;
  groups.ep = ep;
  groups.expt_tp = expt_tp != nullptr ? (expt_tp->Size() > 1 ? expt_tp : nullptr) : sp_tp;
  return groups;
}

void TokenDispatcher::Route(Kernels& k, const std::vector<int64_t>& route, int64_t T, int64_t E,
                            int64_t K, const ExpertPlacement& experts, TokenRoute* out,
                            std::vector<std::vector<int64_t>>* received) const {
  if (alltoall_) {
    RouteAllToAll(k, route, T, E, K, experts, out, received);
    return;
  }
  // The allgather dispatcher: the dispatch group's kept choices, then the permutation of the
  // gathered tokens over this rank's experts, expert by expert, tokens ascending.
  std::vector<int64_t> route_all = route;
  if (groups_.gather != nullptr) {
    route_all =
        IntsToHost(k, AllGatherFirstDim(k, *groups_.gather, IntsToDevice(k, route, {T, K})));
  }
  const int64_t T_all = static_cast<int64_t>(route_all.size()) / K;
  std::vector<int64_t> tokens, slots;
  out->offsets.assign(1, 0);
  for (int64_t e = experts.first(); e < experts.first() + experts.count(); ++e) {
    for (int64_t i = 0; i < T_all * K; ++i) {
      if (route_all[static_cast<size_t>(i)] != e) continue;
      tokens.push_back(i / K);
      slots.push_back(i);
    }
    out->offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  const auto N = static_cast<int64_t>(tokens.size());
  received->assign(static_cast<size_t>(experts.count()),
                   std::vector<int64_t>(static_cast<size_t>(T_all / T), 0));
  for (size_t e = 0; e + 1 < out->offsets.size(); ++e) {
    for (int64_t i = out->offsets[e]; i < out->offsets[e + 1]; ++i) {
      ++(*received)[e][static_cast<size_t>(tokens[static_cast<size_t>(i)] / T)];
    }
  }
  out->token_ids = IntsToDevice(k, tokens, {N});
  out->slot_ids = IntsToDevice(k, slots, {N});
}

void TokenDispatcher::RouteAllToAll(Kernels& k, const std::vector<int64_t>& route, int64_t T,
                                    int64_t E, int64_t K, const ExpertPlacement& experts,
                                    TokenRoute* out,
                                    std::vector<std::vector<int64_t>>* received) const {
  const int64_t P = groups_.ep != nullptr ? groups_.ep->Size() : 1, L = experts.count();
  const auto uE = static_cast<size_t>(E), uL = static_cast<size_t>(L);

  // This rank's rows, expert by expert, tokens ascending; the rows for each ep rank.
  std::vector<int64_t> tokens, slots, counts(uE, 0);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < T * K; ++i) {
      if (route[static_cast<size_t>(i)] != e) continue;
      tokens.push_back(i / K);
      slots.push_back(i);
      ++counts[static_cast<size_t>(e)];
    }
  }
  out->ep_send.assign(static_cast<size_t>(P), 0);
  for (int64_t e = 0; e < E; ++e) {
    out->ep_send[static_cast<size_t>(e / L)] += counts[static_cast<size_t>(e)];
  }

  // The split sizes: every ep rank's counts, so this rank knows what each sends its experts
  // (from[p * L + l]: rows of local expert l from ep rank p, in the order they arrive).
  std::vector<int64_t> table = counts;  // [P, E]
  if (groups_.ep != nullptr) {
    table = IntsToHost(k, AllGatherFirstDim(k, *groups_.ep, IntsToDevice(k, counts, {E})));
  }
  std::vector<int64_t> from(static_cast<size_t>(P) * uL);
  out->ep_recv.assign(static_cast<size_t>(P), 0);
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t l = 0; l < L; ++l) {
      const int64_t n = table[static_cast<size_t>(p * E + experts.first() + l)];
      from[static_cast<size_t>(p * L + l)] = n;
      out->ep_recv[static_cast<size_t>(p)] += n;
    }
  }
  out->tp_rows = std::accumulate(out->ep_recv.begin(), out->ep_recv.end(), int64_t{0});

  // The expt_tp exchange: every etp rank's arrivals ([t, P, L]), each rank's rows padded to
  // the most.
  Communicator* expt_tp = groups_.expt_tp;
  const int64_t t = expt_tp != nullptr ? expt_tp->Size() : 1;
  std::vector<int64_t> all_from = from;
  if (t > 1) {
    all_from = IntsToHost(k, AllGatherFirstDim(k, *expt_tp, IntsToDevice(k, from, {P * L})));
  }
  const auto at = [&](int64_t q, int64_t p, int64_t l) {
    return all_from[static_cast<size_t>((q * P + p) * L + l)];
  };
  out->tp_pad = 0;
  for (int64_t q = 0; q < t; ++q) {
    int64_t rows = 0;
    for (int64_t i = 0; i < P * L; ++i) rows += all_from[static_cast<size_t>(q * P * L + i)];
    out->tp_pad = std::max(out->tp_pad, rows);
  }

  // The experts' rows: local expert l, then etp rank q, then ep rank p, in arrival order.
  // `received` counts them per rank of the dispatch group (tp_ep, etp fastest, as the
  // allgather dispatcher reports them).
  std::vector<int64_t> ids;
  out->offsets.assign(1, 0);
  received->assign(uL, std::vector<int64_t>(static_cast<size_t>(t * P), 0));
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t q = 0; q < t; ++q) {
      int64_t first = q * out->tp_pad;  // (q, p, l)'s first row in q's block
      for (int64_t p = 0; p < P; ++p) {
        for (int64_t m = 0; m < l; ++m) first += at(q, p, m);
        for (int64_t i = 0; i < at(q, p, l); ++i) ids.push_back(first + i);
        (*received)[static_cast<size_t>(l)][static_cast<size_t>(p * t + q)] += at(q, p, l);
        for (int64_t m = l; m < L; ++m) first += at(q, p, m);
      }
    }
    out->offsets.push_back(static_cast<int64_t>(ids.size()));
  }
  const auto N = static_cast<int64_t>(ids.size());
  out->token_ids = IntsToDevice(k, ids, {N});
  out->slot_ids = out->token_ids;
  out->send_tokens = IntsToDevice(k, tokens, {static_cast<int64_t>(tokens.size())});
  out->send_slots = IntsToDevice(k, slots, {static_cast<int64_t>(slots.size())});
}

Tensor TokenDispatcher::DispatchTokens(Kernels& k, const Tensor& x, const TokenRoute& route) const {
  if (alltoall_) return AllToAllDispatch(k, GatherRows(k, x, route.send_tokens), route);
  return groups_.gather != nullptr ? AllGatherFirstDim(k, *groups_.gather, x) : x;
}

Tensor TokenDispatcher::DispatchProbs(Kernels& k, const Tensor& probs,
                                      const TokenRoute& route) const {
  if (alltoall_) {
    return AllToAllDispatch(k, GatherRows(k, probs.Reshaped({probs.numel(), 1}), route.send_slots),
                            route);
  }
  const Tensor all =
      groups_.gather != nullptr ? AllGatherFirstDim(k, *groups_.gather, probs) : probs;
  return all.Reshaped({all.rows() * all.cols(), 1});
}

Tensor TokenDispatcher::CombineTokens(Kernels& k, const Tensor& rows, int64_t T,
                                      const TokenRoute& route) const {
  if (!alltoall_) {
    return groups_.gather != nullptr ? ReduceScatterFirstDim(k, *groups_.gather, rows) : rows;
  }
  Tensor y = k.Zeros({T, rows.cols()}, rows.dtype());
  ScatterAddRows(k, AllToAllCombine(k, rows, route), route.send_tokens, y);
  return y;
}

Tensor TokenDispatcher::CombineProbs(Kernels& k, const Tensor& rows, int64_t T, int64_t K,
                                     const TokenRoute& route) const {
  if (!alltoall_) {
    const Tensor all = rows.Reshaped({rows.rows() / K, K});
    return groups_.gather != nullptr ? ReduceScatterFirstDim(k, *groups_.gather, all) : all;
  }
  Tensor flat = k.Zeros({T * K, 1}, rows.dtype());
  ScatterAddRows(k, AllToAllCombine(k, rows, route), route.send_slots, flat);
  return flat.Reshaped({T, K});
}

// Rows in send order [N_send, w] -> the uneven all-to-all over ep -> the all-gather over
// expt_tp of each rank's rows padded to tp_pad [t * tp_pad, w].
Tensor TokenDispatcher::AllToAllDispatch(Kernels& k, const Tensor& rows,
                                         const TokenRoute& route) const {
  const int64_t w = rows.cols();
  Tensor got = rows;
  if (groups_.ep != nullptr) {
    got = k.Empty({route.tp_rows, w}, rows.dtype());
    groups_.ep->AllToAllV(rows, Times(route.ep_send, w), got, Times(route.ep_recv, w));
  }
  if (groups_.expt_tp == nullptr) return got;
  Tensor padded = k.Zeros({route.tp_pad, w}, rows.dtype());
  if (route.tp_rows > 0) {
    Tensor head = Rows(padded, 0, route.tp_rows);
    k.Copy(got, head);
  }
  return AllGatherFirstDim(k, *groups_.expt_tp, padded);
}

// And back: the experts' partial sums [t * tp_pad, w] -> the reduce-scatter over expt_tp ->
// the all-to-all back over ep -> [N_send, w] in send order.
Tensor TokenDispatcher::AllToAllCombine(Kernels& k, const Tensor& partial,
                                        const TokenRoute& route) const {
  const int64_t w = partial.cols();
  Communicator* expt_tp = groups_.expt_tp;
  const Tensor mine = expt_tp != nullptr ? ReduceScatterFirstDim(k, *expt_tp, partial) : partial;
  const Tensor head = Rows(mine, 0, route.tp_rows);
  if (groups_.ep == nullptr) return head;
  int64_t n_send = 0;
  for (int64_t n : route.ep_send) n_send += n;
  Tensor back = k.Empty({n_send, w}, partial.dtype());
  groups_.ep->AllToAllV(head, Times(route.ep_recv, w), back, Times(route.ep_send, w));
  return back;
}

}  // namespace mpusim
