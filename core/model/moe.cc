// Mixture-of-experts layer (see moe.h).
#include "core/model/moe.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>

#include "core/model/accumulate_grad.h"
#include "core/tensor_parallel/mappings.h"

namespace mpusim {
namespace {

Tensor IntsToDevice(Kernels& k, const std::vector<int64_t>& v, Shape shape) {
  Tensor host = Tensor::HostEmpty(std::move(shape), DType::kInt64);
  std::copy(v.begin(), v.end(), host.data_as<int64_t>());
  return k.ToDevice(host);
}

std::vector<int64_t> IntsToHost(Kernels& k, const Tensor& t) {
  const Tensor host = k.ToHost(t);
  const int64_t* p = host.data_as<int64_t>();
  return std::vector<int64_t>(p, p + host.numel());
}

Tensor ValuesToDevice(Kernels& k, const std::vector<double>& v, Shape shape, DType dtype) {
  Tensor host = Tensor::HostEmpty(std::move(shape), dtype);
  for (size_t i = 0; i < v.size(); ++i) SetHostValue(host, static_cast<int64_t>(i), v[i]);
  return k.ToDevice(host);
}

std::vector<double> ValuesToHost(Kernels& k, const Tensor& t) {
  const Tensor host = k.ToHost(t);
  std::vector<double> v(static_cast<size_t>(host.numel()));
  for (int64_t i = 0; i < host.numel(); ++i) v[static_cast<size_t>(i)] = HostValue(host, i);
  return v;
}

// Rows [r0, r0 + n) of a 2-D tensor, as a view.
Tensor Rows(const Tensor& m, int64_t r0, int64_t n) {
  return m.FlatSlice(r0 * m.cols(), n * m.cols()).Reshaped({n, m.cols()});
}

// A softmax over all n columns of each row, as the causal softmax of a query that sees every
// key: query position n - 1, keys 0 .. n - 1.
struct WholeRowSoftmax {
  Tensor q_pos, k_pos;
};
WholeRowSoftmax MakeWholeRowSoftmax(Kernels& k, int64_t n) {
  std::vector<int64_t> keys(static_cast<size_t>(n));
  std::iota(keys.begin(), keys.end(), int64_t{0});
  return {IntsToDevice(k, {n - 1}, {1}), IntsToDevice(k, keys, {n})};
}

// The first `count` indices of `key` ordered largest first, equal values by the lower index.
std::vector<int64_t> Largest(const std::vector<double>& key, int64_t count) {
  std::vector<int64_t> order(key.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return key[static_cast<size_t>(a)] > key[static_cast<size_t>(b)];
  });
  order.resize(static_cast<size_t>(count));
  return order;
}

// Names the layer's collectives "<layer site> (<what>)" in the trace while alive.
class SiteSuffix {
 public:
  SiteSuffix(CommTrace& trace, const char* what) : trace_(trace), site_(trace.site()) {
    trace_.SetSite(fmt::format("{} ({})", site_, what));
  }
  ~SiteSuffix() { trace_.SetSite(site_); }
  SiteSuffix(const SiteSuffix&) = delete;
  SiteSuffix& operator=(const SiteSuffix&) = delete;

 private:
  CommTrace& trace_;
  std::string site_;
};

// The group the dispatcher exchanges tokens over: tp_ep (etp x ep) when the experts are laid
// out apart, else tp under sequence parallelism (whose ranks hold different tokens); null when
// no rank but this one holds tokens this rank's experts need.
Communicator* DispatchGroup(const ModuleContext& ctx) {
  if (ctx.tp_ep != nullptr) return ctx.tp_ep->Size() > 1 ? ctx.tp_ep : nullptr;
  return ctx.shape.sequence_parallel && ctx.tp.Size() > 1 ? &ctx.tp : nullptr;
}

// The per-token scaling of the experts' activations: out[r, :] = p[r] * a[r, :], one batched
// GEMM of n tiny (1 x 1) @ (1 x w) products.
void ScaleRows(Kernels& k, const Tensor& p, const Tensor& a, Tensor& out) {
  const int64_t n = a.rows(), w = a.cols();
  Tensor out3 = out.Reshaped({n, 1, w});
  k.BatchedGemm(false, false, 1.0, p.Reshaped({n, 1, 1}), a.Reshaped({n, 1, w}), 0.0, out3);
}

// out[i, :] = src[ids[i], :] (ids: int64 [n] into src's rows); [0, w] when n = 0.
Tensor GatherRows(Kernels& k, const Tensor& src, const Tensor& ids) {
  Tensor out = k.Empty({ids.numel(), src.cols()}, src.dtype());
  if (ids.numel() > 0) k.EmbeddingForward(src, ids, 0, src.rows(), out);
  return out;
}

// into[ids[i], :] += rows[i, :], in increasing i.
void ScatterAddRows(Kernels& k, const Tensor& rows, const Tensor& ids, Tensor& into) {
  if (ids.numel() > 0) k.EmbeddingBackward(rows, ids, 0, into.rows(), into);
}

std::vector<int64_t> Times(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out;
  for (int64_t r : rows) out.push_back(r * width);
  return out;
}

// The group the alltoall dispatcher gathers the rows over after the all-to-all (Megatron's
// expt_tp exchange): expt_tp, whose ranks hold different tokens (tp under sequence
// parallelism when the experts are laid out as the dense layers); null when it is one rank.
Communicator* ExpertTpGroup(const ModuleContext& ctx) {
  if (ctx.expt_tp != nullptr) return ctx.expt_tp->Size() > 1 ? ctx.expt_tp : nullptr;
  return ctx.shape.sequence_parallel && ctx.tp.Size() > 1 ? &ctx.tp : nullptr;
}

// The alltoall dispatcher's way to the experts: rows in send order [N_send, w] -> the uneven
// all-to-all over ep -> the all-gather over tp of each rank's rows padded to tp_pad
// [t * tp_pad, w].
Tensor AllToAllDispatch(const ModuleContext& ctx, const Tensor& rows,
                        const MoeLayer::Stash& st) {
  Kernels& k = ctx.k;
  const int64_t w = rows.cols();
  Tensor got = rows;
  if (ctx.ep != nullptr) {
    got = k.Empty({st.tp_rows, w}, rows.dtype());
    ctx.ep->AllToAllV(rows, Times(st.ep_send, w), got, Times(st.ep_recv, w));
  }
  Communicator* expt_tp = ExpertTpGroup(ctx);
  if (expt_tp == nullptr) return got;
  Tensor padded = k.Zeros({st.tp_pad, w}, rows.dtype());
  if (st.tp_rows > 0) {
    Tensor head = Rows(padded, 0, st.tp_rows);
    k.Copy(got, head);
  }
  return AllGatherFirstDim(k, *expt_tp, padded);
}

// And back: the experts' partial sums [t * tp_pad, w] -> the reduce-scatter over tp -> the
// all-to-all back over ep -> [N_send, w] in send order.
Tensor AllToAllCombine(const ModuleContext& ctx, const Tensor& partial,
                       const MoeLayer::Stash& st) {
  Kernels& k = ctx.k;
  const int64_t w = partial.cols();
  Communicator* expt_tp = ExpertTpGroup(ctx);
  const Tensor mine = expt_tp != nullptr ? ReduceScatterFirstDim(k, *expt_tp, partial) : partial;
  const Tensor head = Rows(mine, 0, st.tp_rows);
  if (ctx.ep == nullptr) return head;
  int64_t n_send = 0;
  for (int64_t n : st.ep_send) n_send += n;
  Tensor back = k.Empty({n_send, w}, partial.dtype());
  ctx.ep->AllToAllV(head, Times(st.ep_recv, w), back, Times(st.ep_send, w));
  return back;
}

// Calls fn(e, first_row, rows) for each local expert e with permuted rows (offsets: Stash's).
template <typename Fn>
void ForEachExpert(const std::vector<int64_t>& offsets, Fn fn) {
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n > 0) fn(e, offsets[e], n);
  }
}

}  // namespace

std::optional<int64_t> ExpertOf(std::string_view name) {
  for (std::string_view key : {".mlp.experts.local_experts.", ".mlp.experts.linear_fc1.weight",
                               ".mlp.experts.linear_fc2.weight"}) {
    const size_t at = name.find(key);
    if (at == std::string_view::npos) continue;
    size_t i = at + key.size();
    if (i >= name.size() || name[i] < '0' || name[i] > '9') continue;
    int64_t e = 0;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) e = e * 10 + (name[i] - '0');
    return e;
  }
  return std::nullopt;
}

std::string MoeLayer::ReceivedNote() const {
  std::vector<std::string> parts;
  for (size_t e = 0; e < received_.size(); ++e) {
    int64_t total = 0;
    for (int64_t n : received_[e]) total += n;
    parts.push_back(received_[e].size() == 1
                        ? fmt::format("expert {} <- {} tokens", experts_.first() + static_cast<int64_t>(e), total)
                        : fmt::format("expert {} <- {} tokens (from the dispatch group's ranks: {})",
                                      experts_.first() + static_cast<int64_t>(e), total,
                                      fmt::join(received_[e], " ")));
  }
  std::string note = fmt::format("{}", fmt::join(parts, ", "));
  if (!sent_rows_.empty()) {
    std::vector<int64_t> peers(sent_rows_.size()), bytes;
    std::iota(peers.begin(), peers.end(), int64_t{0});
    for (int64_t n : sent_rows_) bytes.push_back(n * row_bytes_);
    note += fmt::format("; all-to-all to ep ranks {}: {} rows, {} bytes", fmt::join(peers, " "),
                        fmt::join(sent_rows_, " "), fmt::join(bytes, " "));
  }
  return note;
}

MoeLayer::MoeLayer(const GptConfig& gpt, std::string prefix, ParameterSet& params,
                   int64_t num_microbatches, ExpertPlacement experts)
    : prefix_(std::move(prefix)),
      activation_(gpt.activation),
      moe_(gpt.moe),
      num_microbatches_(num_microbatches),
      router_(&params.Get(prefix_ + ".router.weight")),
      experts_(experts.num_experts > 0 ? experts : ExpertPlacement{gpt.moe.num_experts, 1, 0}) {
  for (int64_t e = experts_.first(); e < experts_.first() + experts_.count(); ++e) {
    fc1_.push_back(&params.Get(MoeExpertWeightName(moe_, prefix_, e, 1)));
    fc2_.push_back(&params.Get(MoeExpertWeightName(moe_, prefix_, e, 2)));
  }
  if (moe_.shared_expert_intermediate_size) {
    shared_fc1_.emplace(&params.Get(prefix_ + ".shared_experts.linear_fc1.weight"), nullptr);
    shared_fc2_.emplace(&params.Get(prefix_ + ".shared_experts.linear_fc2.weight"));
  }
}

void MoeLayer::Route(const ModuleContext& ctx, const Tensor& top_scores, Stash* st) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t T = st->x.rows(), E = moe_.num_experts, K = moe_.router_topk;
  const auto uk = static_cast<size_t>(K);

  // Capacity: per expert, the first `capacity` of this rank's tokens routed to it by
  // probability or position; the others are dropped.
  std::vector<int64_t> route = st->chosen;  // expert, or -1 once dropped
  if (moe_.expert_capacity_factor) {
    const auto capacity = static_cast<int64_t>(std::ceil(
        static_cast<double>(T * K) / static_cast<double>(E) * *moe_.expert_capacity_factor));
    if (capacity < T) {
      const std::vector<double> p = ValuesToHost(k, st->probs);
      for (int64_t e = 0; e < E; ++e) {
        std::vector<double> key(static_cast<size_t>(T), 0.0);
        for (size_t i = 0; i < st->chosen.size(); ++i) {
          if (st->chosen[i] != e) continue;
          key[i / uk] = moe_.token_drop_policy == MoeDropPolicy::kProbs ? p[i] : 1.0;
        }
        std::vector<bool> keep(static_cast<size_t>(T), false);
        for (int64_t t : Largest(key, capacity)) keep[static_cast<size_t>(t)] = true;
        for (size_t i = 0; i < st->chosen.size(); ++i) {
          if (st->chosen[i] == e && !keep[i / uk]) route[i] = -1;
        }
      }
    }
  }

  // The auxiliary losses' gradient coefficients, scaled 1 / (M d).
  const double per_dp = 1.0 / static_cast<double>(num_microbatches_ * ctx.dp_size);
  const int64_t tp_cp = (sh.sequence_parallel ? sh.t : 1) * sh.cp;
  st->aux.clear();
  const bool per_sequence = moe_.load_balancing == MoeLoadBalancing::kSeqAuxLoss;
  if ((moe_.load_balancing == MoeLoadBalancing::kAuxLoss || per_sequence) &&
      moe_.aux_loss_coeff > 0) {
    // count_i: the tokens whose top-k of the softmax holds i (before dropping), summed over
    // the router ranks of this dp rank (tp under sequence parallelism, and cp); per sample
    // (count_ni, sample n = t % b of token t, rows position-major) for seq_aux_loss.
    const int64_t b = per_sequence ? sh.b : 1;
    const std::vector<int64_t> top = IntsToHost(k, top_scores);
    std::vector<int64_t> counts(static_cast<size_t>(b * E), 0);
    for (size_t i = 0; i < top.size(); ++i) {
      const auto t = static_cast<int64_t>(i) / K;
      ++counts[static_cast<size_t>((t % b) * E + top[i])];
    }
    Tensor summed = IntsToDevice(k, counts, {b * E});
    const SiteSuffix site(ctx.trace, "moe router");
    if (sh.sequence_parallel) ctx.tp.AllReduce(summed, ReduceOp::kSum);
    if (ctx.cp != nullptr) ctx.cp->AllReduce(summed, ReduceOp::kSum);
    counts = IntsToHost(k, summed);
    // aux_loss: coeff E / (k (s b)^2); seq_aux_loss: Megatron's per-sample loss averaged
    // over the b samples, coeff E / (k s^2 b).
    const auto s_all = static_cast<double>(T * tp_cp / sh.b);
    const double c = per_dp * moe_.aux_loss_coeff * static_cast<double>(E) /
                     (static_cast<double>(K) * s_all * s_all * static_cast<double>(sh.b) *
                      (per_sequence ? 1.0 : static_cast<double>(sh.b)));
    if (per_sequence) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t e = 0; e < E; ++e) {
          st->aux.push_back(c * static_cast<double>(counts[static_cast<size_t>((t % b) * E + e)]));
        }
      }
    } else {
      for (int64_t count : counts) st->aux.push_back(c * static_cast<double>(count));
    }
  }
  st->dlse.clear();
  if (moe_.z_loss_coeff) {
    const double c = 2.0 * per_dp * *moe_.z_loss_coeff / static_cast<double>(tp_cp) /
                     static_cast<double>(T);
    for (double lse : ValuesToHost(k, st->lse)) st->dlse.push_back(c * lse);
  }

  if (moe_.token_dispatcher == MoeDispatcher::kAllToAll) {
    RouteAllToAll(ctx, route, st);
    return;
  }
  sent_rows_.clear();
  // The allgather dispatcher: the dispatch group's kept choices, then the permutation of the
  // gathered tokens over this rank's experts, expert by expert, tokens ascending.
  std::vector<int64_t> route_all = route;
  if (Communicator* group = DispatchGroup(ctx)) {
    const SiteSuffix site(ctx.trace, "moe dispatch");
    route_all = IntsToHost(k, AllGatherFirstDim(k, *group, IntsToDevice(k, route, {T, K})));
  }
  const int64_t T_all = static_cast<int64_t>(route_all.size()) / K;
  std::vector<int64_t> tokens, slots;
  st->offsets.assign(1, 0);
  for (int64_t e = experts_.first(); e < experts_.first() + experts_.count(); ++e) {
    for (int64_t i = 0; i < T_all * K; ++i) {
      if (route_all[static_cast<size_t>(i)] != e) continue;
      tokens.push_back(i / K);
      slots.push_back(i);
    }
    st->offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  const auto N = static_cast<int64_t>(tokens.size());
  received_.assign(static_cast<size_t>(experts_.count()),
                   std::vector<int64_t>(static_cast<size_t>(T_all / T), 0));
  for (size_t e = 0; e + 1 < st->offsets.size(); ++e) {
    for (int64_t i = st->offsets[e]; i < st->offsets[e + 1]; ++i) {
      ++received_[e][static_cast<size_t>(tokens[static_cast<size_t>(i)] / T)];
    }
  }
  st->token_ids = IntsToDevice(k, tokens, {N});
  st->slot_ids = IntsToDevice(k, slots, {N});
}

void MoeLayer::RouteAllToAll(const ModuleContext& ctx, const std::vector<int64_t>& route,
                             Stash* st) const {
  Kernels& k = ctx.k;
  const int64_t T = st->x.rows(), E = moe_.num_experts, K = moe_.router_topk;
  const int64_t P = ctx.ep != nullptr ? ctx.ep->Size() : 1, L = experts_.count();
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
  st->ep_send.assign(static_cast<size_t>(P), 0);
  for (int64_t e = 0; e < E; ++e) {
    st->ep_send[static_cast<size_t>(e / L)] += counts[static_cast<size_t>(e)];
  }

  // The split sizes: every ep rank's counts, so this rank knows what each sends its experts
  // (from[p * L + l]: rows of local expert l from ep rank p, in the order they arrive).
  std::vector<int64_t> table = counts;  // [P, E]
  const SiteSuffix site(ctx.trace, "moe dispatch");
  if (ctx.ep != nullptr) {
    table = IntsToHost(k, AllGatherFirstDim(k, *ctx.ep, IntsToDevice(k, counts, {E})));
  }
  std::vector<int64_t> from(static_cast<size_t>(P) * uL);
  st->ep_recv.assign(static_cast<size_t>(P), 0);
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t l = 0; l < L; ++l) {
      const int64_t n = table[static_cast<size_t>(p * E + experts_.first() + l)];
      from[static_cast<size_t>(p * L + l)] = n;
      st->ep_recv[static_cast<size_t>(p)] += n;
    }
  }
  st->tp_rows = std::accumulate(st->ep_recv.begin(), st->ep_recv.end(), int64_t{0});

  // The expt_tp exchange: every etp rank's arrivals ([t, P, L]), each rank's rows padded to
  // the most.
  Communicator* expt_tp = ExpertTpGroup(ctx);
  const int64_t t = expt_tp != nullptr ? expt_tp->Size() : 1;
  std::vector<int64_t> all_from = from;
  if (t > 1) {
    all_from = IntsToHost(k, AllGatherFirstDim(k, *expt_tp, IntsToDevice(k, from, {P * L})));
  }
  const auto at = [&](int64_t q, int64_t p, int64_t l) {
    return all_from[static_cast<size_t>((q * P + p) * L + l)];
  };
  st->tp_pad = 0;
  for (int64_t q = 0; q < t; ++q) {
    int64_t rows = 0;
    for (int64_t i = 0; i < P * L; ++i) rows += all_from[static_cast<size_t>(q * P * L + i)];
    st->tp_pad = std::max(st->tp_pad, rows);
  }

  // The experts' rows: local expert l, then etp rank q, then ep rank p, in arrival order.
  // received_ counts them per rank of the dispatch group (tp_ep, etp fastest, as the
  // allgather dispatcher reports them).
  std::vector<int64_t> ids;
  st->offsets.assign(1, 0);
  received_.assign(uL, std::vector<int64_t>(static_cast<size_t>(t * P), 0));
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t q = 0; q < t; ++q) {
      int64_t first = q * st->tp_pad;  // (q, p, l)'s first row in q's block
      for (int64_t p = 0; p < P; ++p) {
        for (int64_t m = 0; m < l; ++m) first += at(q, p, m);
        for (int64_t i = 0; i < at(q, p, l); ++i) ids.push_back(first + i);
        received_[static_cast<size_t>(l)][static_cast<size_t>(p * t + q)] += at(q, p, l);
        for (int64_t m = l; m < L; ++m) first += at(q, p, m);
      }
    }
    st->offsets.push_back(static_cast<int64_t>(ids.size()));
  }
  const auto N = static_cast<int64_t>(ids.size());
  st->token_ids = IntsToDevice(k, ids, {N});
  st->slot_ids = st->token_ids;
  st->send_tokens = IntsToDevice(k, tokens, {static_cast<int64_t>(tokens.size())});
  st->send_slots = IntsToDevice(k, slots, {static_cast<int64_t>(slots.size())});
  sent_rows_.clear();
  if (ctx.ep != nullptr) sent_rows_ = st->ep_send;
  row_bytes_ = (st->x.cols() + 1) * static_cast<int64_t>(DTypeSize(st->x.dtype()));
}

Tensor MoeLayer::Forward(const ModuleContext& ctx, const Tensor& x, Stash* st) const {
  Kernels& k = ctx.k;
  const int64_t T = x.rows(), h = x.cols(), E = moe_.num_experts, K = moe_.router_topk;
  const DType dtype = x.dtype();
  st->x = x;

  // The router.
  Tensor logits = k.Empty({T, E}, dtype);
  k.Gemm(false, true, 1.0, x, router_->value, 0.0, logits);
  const WholeRowSoftmax over_experts = MakeWholeRowSoftmax(k, E);
  st->scores = k.Empty({T, E}, dtype);
  st->lse = k.Empty({T}, ComputeDType(dtype));
  k.CausalSoftmaxForward(logits, over_experts.q_pos, over_experts.k_pos, 1.0, st->scores,
                         &st->lse);
  Tensor values = k.Empty({T, K}, dtype);
  Tensor indices = k.Empty({T, K}, DType::kInt64);
  k.TopK(moe_.router_pre_softmax ? st->scores : logits, K, values, indices);
  Tensor top_scores = indices;  // the load-balancing counts' top-k of the softmax
  if (moe_.router_pre_softmax) {
    st->probs = values;
  } else {
    const WholeRowSoftmax over_chosen = MakeWholeRowSoftmax(k, K);
    st->probs = k.Empty({T, K}, dtype);
    k.CausalSoftmaxForward(values, over_chosen.q_pos, over_chosen.k_pos, 1.0, st->probs);
    Tensor unused = k.Empty({T, K}, dtype);
    top_scores = k.Empty({T, K}, DType::kInt64);
    k.TopK(st->scores, K, unused, top_scores);
  }
  st->chosen = IntsToHost(k, indices);
  Route(ctx, top_scores, st);

  // Dispatch, the experts, combine.
  // The rows the experts' permutation picks from: the dispatch group's tokens and
  // probabilities (allgather), or the rows routed to this rank's experts (alltoall).
  std::optional<SiteSuffix> site(std::in_place, ctx.trace, "moe dispatch");
  const bool a2a = moe_.token_dispatcher == MoeDispatcher::kAllToAll;
  Communicator* group = a2a ? nullptr : DispatchGroup(ctx);
  Tensor x_src, p_src;
  if (a2a) {
    x_src = AllToAllDispatch(ctx, GatherRows(k, x, st->send_tokens), *st);
    p_src = AllToAllDispatch(ctx, GatherRows(k, st->probs.Reshaped({T * K, 1}), st->send_slots),
                             *st);
  } else {
    x_src = group != nullptr ? AllGatherFirstDim(k, *group, x) : x;
    const Tensor probs_all =
        group != nullptr ? AllGatherFirstDim(k, *group, st->probs) : st->probs;
    p_src = probs_all.Reshaped({probs_all.rows() * K, 1});
  }
  const int64_t N = st->offsets.back();
  Tensor y_src = k.Zeros({x_src.rows(), h}, dtype);
  if (N > 0) {
    st->x_perm = GatherRows(k, x_src, st->token_ids);
    st->p_perm = GatherRows(k, p_src, st->slot_ids);
    const int64_t f1 = fc1_.front()->value.rows(), f = fc2_.front()->value.cols();
    st->fc1_out = k.Empty({N, f1}, dtype);
    ForEachExpert(st->offsets, [&](size_t e, int64_t o, int64_t n) {
      Tensor out = Rows(st->fc1_out, o, n);
      k.Gemm(false, true, 1.0, Rows(st->x_perm, o, n), fc1_[e]->value, 0.0, out);
    });
    st->act = k.Empty({N, f}, dtype);
    k.ActivationForward(activation_, st->fc1_out, st->act);
    Tensor scaled = k.Empty({N, f}, dtype);
    ScaleRows(k, st->p_perm, st->act, scaled);
    Tensor y_perm = k.Empty({N, h}, dtype);
    ForEachExpert(st->offsets, [&](size_t e, int64_t o, int64_t n) {
      Tensor out = Rows(y_perm, o, n);
      k.Gemm(false, true, 1.0, Rows(scaled, o, n), fc2_[e]->value, 0.0, out);
    });
    ScatterAddRows(k, y_perm, st->token_ids, y_src);  // per token (allgather) or row
  }
  Tensor y;
  if (a2a) {
    y = k.Zeros({T, h}, dtype);
    ScatterAddRows(k, AllToAllCombine(ctx, y_src, *st), st->send_tokens, y);
  } else {
    y = group != nullptr ? ReduceScatterFirstDim(k, *group, y_src) : y_src;
  }
  site.reset();

  if (shared_fc1_) {
    st->shared_fc1_out = shared_fc1_->Forward(ctx, x, &st->shared_fc1_in);
    const Tensor& a = st->shared_fc1_out;
    Tensor act = k.Empty({a.rows(), IsGated(activation_) ? a.cols() / 2 : a.cols()}, dtype);
    k.ActivationForward(activation_, a, act);
    k.Axpy(1.0, shared_fc2_->Forward(ctx, act, &st->shared_fc2_in), y);
  }
  return y;
}

Tensor MoeLayer::Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& st) const {
  Kernels& k = ctx.k;
  const int64_t T = dy.rows(), h = dy.cols(), E = moe_.num_experts, K = moe_.router_topk;
  const DType dtype = dy.dtype();

  // The experts, on the gathered gradient.
  std::optional<SiteSuffix> site(std::in_place, ctx.trace, "moe dispatch");
  const bool a2a = moe_.token_dispatcher == MoeDispatcher::kAllToAll;
  Communicator* group = a2a ? nullptr : DispatchGroup(ctx);
  const Tensor dy_src = a2a ? AllToAllDispatch(ctx, GatherRows(k, dy, st.send_tokens), st)
                      : group != nullptr ? AllGatherFirstDim(k, *group, dy)
                                         : dy;
  const int64_t N = st.offsets.back();
  Tensor dx_src = k.Zeros({dy_src.rows(), h}, dtype);
  Tensor dp_src = k.Zeros({a2a ? dy_src.rows() : dy_src.rows() * K, 1}, dtype);
  if (N > 0) {
    const Tensor dy_perm = GatherRows(k, dy_src, st.token_ids);
    const int64_t f = st.act.cols();
    Tensor scaled = k.Empty({N, f}, dtype);
    ScaleRows(k, st.p_perm, st.act, scaled);
    Tensor dscaled = k.Empty({N, f}, dtype);
    ForEachExpert(st.offsets, [&](size_t e, int64_t o, int64_t n) {
      Parameter& w2 = *fc2_[e];
      const Tensor dy_e = Rows(dy_perm, o, n);
      Tensor out = Rows(dscaled, o, n);
      k.Gemm(false, false, 1.0, dy_e, w2.value, 0.0, out);
      if (w2.grad.defined()) {
        const Tensor s_e = Rows(scaled, o, n);
        AccumulateGrad(k, w2, ctx.fuse_wgrad,
                       [&](Tensor& g, double beta) { k.Gemm(true, false, 1.0, dy_e, s_e, beta, g); });
      }
    });
    // d p[r] = dscaled[r] . act[r]; d act = p dscaled.
    Tensor dp_perm = k.Empty({N, 1, 1}, dtype);
    k.BatchedGemm(false, true, 1.0, dscaled.Reshaped({N, 1, f}), st.act.Reshaped({N, 1, f}), 0.0,
                  dp_perm);
    Tensor dact = k.Empty({N, f}, dtype);
    ScaleRows(k, st.p_perm, dscaled, dact);
    Tensor dfc1 = k.Empty(st.fc1_out.shape(), dtype);
    k.ActivationBackward(activation_, st.fc1_out, dact, dfc1);
    Tensor dx_perm = k.Empty({N, h}, dtype);
    ForEachExpert(st.offsets, [&](size_t e, int64_t o, int64_t n) {
      Parameter& w1 = *fc1_[e];
      const Tensor d_e = Rows(dfc1, o, n);
      Tensor out = Rows(dx_perm, o, n);
      k.Gemm(false, false, 1.0, d_e, w1.value, 0.0, out);
      if (w1.grad.defined()) {
        const Tensor x_e = Rows(st.x_perm, o, n);
        AccumulateGrad(k, w1, ctx.fuse_wgrad,
                       [&](Tensor& g, double beta) { k.Gemm(true, false, 1.0, d_e, x_e, beta, g); });
      }
    });
    ScatterAddRows(k, dx_perm, st.token_ids, dx_src);
    ScatterAddRows(k, dp_perm.Reshaped({N, 1}), st.slot_ids, dp_src);
  }
  // The way back sums the tp ranks' partial sums and returns each rank its tokens.
  Tensor dx, dprobs;
  if (a2a) {
    dx = k.Zeros({T, h}, dtype);
    ScatterAddRows(k, AllToAllCombine(ctx, dx_src, st), st.send_tokens, dx);
    Tensor flat = k.Zeros({T * K, 1}, dtype);
    ScatterAddRows(k, AllToAllCombine(ctx, dp_src, st), st.send_slots, flat);
    dprobs = flat.Reshaped({T, K});
  } else {
    const Tensor dp_all = dp_src.Reshaped({dy_src.rows(), K});
    dx = group != nullptr ? ReduceScatterFirstDim(k, *group, dx_src) : dx_src;
    dprobs = group != nullptr ? ReduceScatterFirstDim(k, *group, dp_all) : dp_all;
  }
  site.reset();

  // The router: the probabilities' gradient, the load-balancing and z-loss terms.
  std::vector<int64_t> flat(st.chosen.size());  // token * E + expert of each choice
  for (size_t i = 0; i < flat.size(); ++i) {
    flat[i] = static_cast<int64_t>(i) / K * E + st.chosen[i];
  }
  const Tensor flat_ids = IntsToDevice(k, flat, {T * K});
  const WholeRowSoftmax over_experts = MakeWholeRowSoftmax(k, E);
  Tensor dlogits = k.Empty({T, E}, dtype);
  Tensor dscores = k.Zeros({T, E}, dtype);
  if (static_cast<int64_t>(st.aux.size()) == E) {
    k.AddRowVector(ValuesToDevice(k, st.aux, {E}, dtype), dscores);
  } else if (!st.aux.empty()) {
    k.Axpy(1.0, ValuesToDevice(k, st.aux, {T, E}, dtype), dscores);
  }
  if (moe_.router_pre_softmax) {
    Tensor into = dscores.Reshaped({T * E, 1});
    k.EmbeddingBackward(dprobs.Reshaped({T * K, 1}), flat_ids, 0, T * E, into);
    k.CausalSoftmaxBackward(st.scores, dscores, over_experts.q_pos, over_experts.k_pos, 1.0,
                            dlogits);
  } else {
    const WholeRowSoftmax over_chosen = MakeWholeRowSoftmax(k, K);
    Tensor dvalues = k.Empty({T, K}, dtype);
    k.CausalSoftmaxBackward(st.probs, dprobs, over_chosen.q_pos, over_chosen.k_pos, 1.0, dvalues);
    k.CausalSoftmaxBackward(st.scores, dscores, over_experts.q_pos, over_experts.k_pos, 1.0,
                            dlogits);
    Tensor into = dlogits.Reshaped({T * E, 1});
    k.EmbeddingBackward(dvalues.Reshaped({T * K, 1}), flat_ids, 0, T * E, into);
  }
  if (!st.dlse.empty()) {
    // d lse_t / d logits_t = scores_t.
    Tensor term = k.Empty({T, 1, E}, dtype);
    k.BatchedGemm(false, false, 1.0, ValuesToDevice(k, st.dlse, {T, 1, 1}, dtype),
                  st.scores.Reshaped({T, 1, E}), 0.0, term);
    k.Axpy(1.0, term, dlogits);
  }
  Tensor dx_router = k.Empty({T, h}, dtype);
  k.Gemm(false, false, 1.0, dlogits, router_->value, 0.0, dx_router);
  if (router_->grad.defined()) {
    AccumulateGrad(k, *router_, ctx.fuse_wgrad,
                   [&](Tensor& g, double beta) { k.Gemm(true, false, 1.0, dlogits, st.x, beta, g); });
  }
  k.Axpy(1.0, dx_router, dx);

  if (shared_fc1_) {
    const Tensor dact = shared_fc2_->Backward(ctx, dy, st.shared_fc2_in);
    Tensor dh = k.Empty(st.shared_fc1_out.shape(), dtype);
    k.ActivationBackward(activation_, st.shared_fc1_out, dact, dh);
    k.Axpy(1.0, shared_fc1_->Backward(ctx, dh, st.shared_fc1_in), dx);
  }
  return dx;
}

}  // namespace mpusim
