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

// The group the dispatcher exchanges tokens over: tp_ep under expert parallelism, else tp
// under sequence parallelism (whose ranks hold different tokens); null when no rank but this
// one holds tokens this rank's experts need.
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
  return fmt::format("{}", fmt::join(parts, ", "));
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
  if (moe_.load_balancing == MoeLoadBalancing::kAuxLoss && moe_.aux_loss_coeff > 0) {
    // count_i: the tokens whose top-k of the softmax holds i (before dropping), summed over
    // the router ranks of this dp rank (tp under sequence parallelism, and cp).
    const std::vector<int64_t> top = IntsToHost(k, top_scores);
    std::vector<int64_t> counts(static_cast<size_t>(E), 0);
    for (int64_t e : top) ++counts[static_cast<size_t>(e)];
    Tensor summed = IntsToDevice(k, counts, {E});
    const SiteSuffix site(ctx.trace, "moe router");
    if (sh.sequence_parallel) ctx.tp.AllReduce(summed, ReduceOp::kSum);
    if (ctx.cp != nullptr) ctx.cp->AllReduce(summed, ReduceOp::kSum);
    counts = IntsToHost(k, summed);
    const auto total = static_cast<double>(T * tp_cp);  // s * b
    const double c = per_dp * moe_.aux_loss_coeff * static_cast<double>(E) /
                     (static_cast<double>(K) * total * total);
    for (int64_t count : counts) st->aux.push_back(c * static_cast<double>(count));
  }
  st->dlse.clear();
  if (moe_.z_loss_coeff) {
    const double c = 2.0 * per_dp * *moe_.z_loss_coeff / static_cast<double>(tp_cp) /
                     static_cast<double>(T);
    for (double lse : ValuesToHost(k, st->lse)) st->dlse.push_back(c * lse);
  }

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
  std::optional<SiteSuffix> site(std::in_place, ctx.trace, "moe dispatch");
  Communicator* group = DispatchGroup(ctx);
  const Tensor x_all = group != nullptr ? AllGatherFirstDim(k, *group, x) : x;
  const Tensor probs_all = group != nullptr ? AllGatherFirstDim(k, *group, st->probs) : st->probs;
  const int64_t T_all = x_all.rows();
  const int64_t N = st->offsets.back();
  Tensor y_all = k.Zeros({T_all, h}, dtype);
  if (N > 0) {
    st->x_perm = k.Empty({N, h}, dtype);
    k.EmbeddingForward(x_all, st->token_ids, 0, T_all, st->x_perm);
    st->p_perm = k.Empty({N, 1}, dtype);
    k.EmbeddingForward(probs_all.Reshaped({T_all * K, 1}), st->slot_ids, 0, T_all * K,
                       st->p_perm);
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
    k.EmbeddingBackward(y_perm, st->token_ids, 0, T_all, y_all);  // scatter-add per token
  }
  Tensor y = group != nullptr ? ReduceScatterFirstDim(k, *group, y_all) : y_all;
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
  Communicator* group = DispatchGroup(ctx);
  const Tensor dy_all = group != nullptr ? AllGatherFirstDim(k, *group, dy) : dy;
  const int64_t T_all = dy_all.rows();
  const int64_t N = st.offsets.back();
  Tensor dx_all = k.Zeros({T_all, h}, dtype);
  Tensor dprobs_all = k.Zeros({T_all, K}, dtype);
  if (N > 0) {
    Tensor dy_perm = k.Empty({N, h}, dtype);
    k.EmbeddingForward(dy_all, st.token_ids, 0, T_all, dy_perm);
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
    k.EmbeddingBackward(dx_perm, st.token_ids, 0, T_all, dx_all);
    Tensor dprobs_flat = dprobs_all.Reshaped({T_all * K, 1});
    k.EmbeddingBackward(dp_perm.Reshaped({N, 1}), st.slot_ids, 0, T_all * K, dprobs_flat);
  }
  // The reduce-scatter sums the tp ranks' partial sums and returns each rank its tokens.
  Tensor dx = group != nullptr ? ReduceScatterFirstDim(k, *group, dx_all) : dx_all;
  const Tensor dprobs =
      group != nullptr ? ReduceScatterFirstDim(k, *group, dprobs_all) : dprobs_all;
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
  if (!st.aux.empty()) k.AddRowVector(ValuesToDevice(k, st.aux, {E}, dtype), dscores);
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
