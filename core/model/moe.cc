// Mixture-of-experts layer (see moe.h).
#include "core/model/moe.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>

#include "core/expert_parallel/permute.h"
#include "core/expert_parallel/token_dispatcher.h"
#include "core/model/accumulate_grad.h"

namespace mpusim {
namespace {

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

// --- DeepSeek-style routing on the host (Megatron's topk_routing_with_score_function,
// group_limited_topk and compute_routing_scores_for_aux_loss, moe_utils.py). The router's
// [T, E] scores are small; the choices are host decisions like the capacity's, and the
// per-logit scores (sigmoid, sqrtsoftplus) are computed here in double and stored in the
// scores' dtype.

// Megatron's epsilon in the per-logit scores' normalisations: s / (sum s + 1e-20).
constexpr double kSigmoidNormEps = 1e-20;

double Sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

// torch.nn.functional.softplus's threshold (beta 1): above it softplus(z) is z itself.
constexpr double kSoftplusThreshold = 20.0;

// A per-logit score: sigmoid(z), or sqrt(softplus(z)).
double PerLogitScore(MoeScoreFunction f, double z) {
  if (f == MoeScoreFunction::kSigmoid) return Sigmoid(z);
  return std::sqrt(z > kSoftplusThreshold ? z : std::log1p(std::exp(z)));
}

// d score / d z from the stored score s: sigmoid s (1 - s); sqrt(softplus): softplus'(z) /
// (2 s), softplus'(z) = sigmoid(z) = 1 - exp(-softplus(z)) = -expm1(-s^2) (torch's: 1 above the
// threshold).
double PerLogitScoreGrad(MoeScoreFunction f, double s) {
  if (f == MoeScoreFunction::kSigmoid) return s * (1.0 - s);
  const double softplus = s * s;
  return (softplus > kSoftplusThreshold ? 1.0 : -std::expm1(-softplus)) / (2.0 * s);
}

// The chosen experts of each of the T rows of `key` [T, E]: the top k (Largest's order), or
// with group-limited routing (Megatron's group_limited_topk) the top k of the experts in the
// group_topk groups (of E / num_groups consecutive experts) whose top (k / group_topk)
// keys sum highest, equal group sums by the lower group.
std::vector<int64_t> ChooseExperts(const std::vector<double>& key, int64_t T, int64_t E, int64_t K,
                                   const MoeConfig& moe) {
  std::vector<int64_t> chosen;
  chosen.reserve(static_cast<size_t>(T * K));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> row(key.begin() + t * E, key.begin() + (t + 1) * E);
    if (moe.group_limited()) {
      const int64_t G = *moe.num_groups, per = E / G, top = K / *moe.group_topk;
      std::vector<double> group_score(static_cast<size_t>(G), 0.0);
      for (int64_t g = 0; g < G; ++g) {
        const std::vector<double> members(row.begin() + g * per, row.begin() + (g + 1) * per);
        for (int64_t i : Largest(members, top)) {
          group_score[static_cast<size_t>(g)] += members[static_cast<size_t>(i)];
        }
      }
      std::vector<bool> open(static_cast<size_t>(G), false);
      for (int64_t g : Largest(group_score, *moe.group_topk)) open[static_cast<size_t>(g)] = true;
      for (int64_t e = 0; e < E; ++e) {
        if (!open[static_cast<size_t>(e / per)]) row[static_cast<size_t>(e)] = -INFINITY;
      }
    }
    for (int64_t e : Largest(row, K)) chosen.push_back(e);
  }
  return chosen;
}

// Per choice i = t * K + s: t * E + chosen[i], the choice's element of a [T, E] tensor.
std::vector<int64_t> FlatChoices(const std::vector<int64_t>& chosen, int64_t E, int64_t K) {
  std::vector<int64_t> flat(chosen.size());
  for (size_t i = 0; i < flat.size(); ++i) flat[i] = static_cast<int64_t>(i) / K * E + chosen[i];
  return flat;
}

// d logits [T, E] (in `dtype`, on the device) of a per-logit router (sigmoid, sqrtsoftplus)
// from d probs (the dispatched probabilities' gradient, [T * K] on the host) and the stashed
// scores sig:
//   probs  w = f p, p_s = v_s / (sum_s v_s + eps) (topk > 1; else p = v), v the chosen scores:
//          d v_s = (d p_s - sum_r d p_r p_r) / (sum v + eps), d p = f d w
//   aux    the load-balancing coefficients c (d objective / d a, a = sig / (sum_e sig_e + eps)):
//          d sig_j += (c_j - sum_i c_i a_i) / (sum sig + eps)
//   then   d z = d sig * d sig / d z (PerLogitScoreGrad)
Tensor PerLogitRouterBackward(Kernels& k, std::vector<double> dw, const MoeLayer::Stash& st,
                              const MoeConfig& moe, DType dtype) {
  const std::vector<double> sig = ValuesToHost(k, st.scores);
  const int64_t K = moe.router_topk, E = moe.num_experts;
  const auto T = static_cast<int64_t>(sig.size()) / E;
  std::vector<double> dsig(sig.size(), 0.0);
  const double f = moe.topk_scaling_factor.value_or(1.0);
  for (int64_t t = 0; t < T; ++t) {
    const auto at = [&](int64_t s) {
      return static_cast<size_t>(t * E + st.chosen[static_cast<size_t>(t * K + s)]);
    };
    double sum = 0, dot = 0;
    for (int64_t s = 0; s < K; ++s) sum += sig[at(s)];
    const double denom = sum + kSigmoidNormEps;
    for (int64_t s = 0; s < K; ++s) {
      dw[static_cast<size_t>(t * K + s)] *= f;
      dot += dw[static_cast<size_t>(t * K + s)] * sig[at(s)] / denom;
    }
    for (int64_t s = 0; s < K; ++s) {
      const double dp = dw[static_cast<size_t>(t * K + s)];
      dsig[at(s)] += K > 1 ? (dp - dot) / denom : dp;
    }
    if (!st.aux.empty()) {
      const size_t c0 = st.aux.size() == static_cast<size_t>(E) ? 0 : static_cast<size_t>(t * E);
      double all = 0, mean = 0;
      for (int64_t e = 0; e < E; ++e) all += sig[static_cast<size_t>(t * E + e)];
      all += kSigmoidNormEps;
      for (int64_t e = 0; e < E; ++e) {
        mean += st.aux[c0 + static_cast<size_t>(e)] * sig[static_cast<size_t>(t * E + e)] / all;
      }
      for (int64_t e = 0; e < E; ++e) {
        dsig[static_cast<size_t>(t * E + e)] += (st.aux[c0 + static_cast<size_t>(e)] - mean) / all;
      }
    }
  }
  for (size_t i = 0; i < dsig.size(); ++i) dsig[i] *= PerLogitScoreGrad(moe.score_function, sig[i]);
  return ValuesToDevice(k, dsig, {T, E}, dtype);
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

// The per-token scaling of the experts' activations: out[r, :] = p[r] * a[r, :], one batched
// GEMM of n tiny (1 x 1) @ (1 x w) products.
void ScaleRows(Kernels& k, const Tensor& p, const Tensor& a, Tensor& out) {
  const int64_t n = a.rows(), w = a.cols();
  Tensor out3 = out.Reshaped({n, 1, w});
  k.BatchedGemm(false, false, 1.0, p.Reshaped({n, 1, 1}), a.Reshaped({n, 1, w}), 0.0, out3);
}

// t itself when it has `dtype`, else a copy converted to it (Kernels::Convert).
Tensor As(Kernels& k, const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor out = k.Empty(t.shape(), dtype);
  k.Convert(t, out);
  return out;
}

// Megatron's per_token_scale (mlp.py: (a * p.unsqueeze(-1)).to(a.dtype)): out[r, :] = p[r] *
// a[r, :] computed in p's dtype (the router's) and rounded to a's; out has a's dtype.
void WeightRows(Kernels& k, const Tensor& p, const Tensor& a, Tensor& out) {
  if (p.dtype() == a.dtype()) {
    ScaleRows(k, p, a, out);
    return;
  }
  Tensor wide = k.Empty(a.shape(), p.dtype());
  ScaleRows(k, p, As(k, a, p.dtype()), wide);
  k.Convert(wide, out);
}

// The layer's dispatcher on this rank's groups.
TokenDispatcher Dispatcher(const ModuleContext& ctx, MoeDispatcher kind) {
  return TokenDispatcher(kind, ChooseDispatchGroups(ctx.tp, ctx.shape.sequence_parallel,
                                                    ctx.tp_ep, ctx.expt_tp, ctx.ep));
}

// Calls fn(e, first_row, rows) for each local expert e with permuted rows (offsets: the
// route's).
template <typename Fn>
void ForEachExpert(const std::vector<int64_t>& offsets, Fn fn) {
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n > 0) fn(e, offsets[e], n);
  }
}

}  // namespace

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
      glu_(gpt.Glu()),
      moe_(gpt.moe),
      num_microbatches_(num_microbatches),
      router_(&params.Get(prefix_ + ".router.weight")),
      router_bias_(params.Find(prefix_ + ".router.bias")),
      experts_(experts.num_experts > 0 ? experts : ExpertPlacement{gpt.moe.num_experts, 1, 0}) {
  for (int64_t e = experts_.first(); e < experts_.first() + experts_.count(); ++e) {
    fc1_.push_back(&params.Get(MoeExpertWeightName(prefix_, e, 1)));
    fc2_.push_back(&params.Get(MoeExpertWeightName(prefix_, e, 2)));
    if (gpt.add_bias_linear) {
      fc1_bias_.push_back(&params.Get(MoeExpertBiasName(prefix_, e, 1)));
      fc2_bias_.push_back(&params.Get(MoeExpertBiasName(prefix_, e, 2)));
    }
  }
  tokens_per_expert_.assign(static_cast<size_t>(moe_.num_experts), 0);
  if (moe_.enable_expert_bias) expert_bias_.assign(static_cast<size_t>(moe_.num_experts), 0.0f);
  if (moe_.AuxLossCoeff(MoeLoadBalancing::kGlobalAuxLoss) > 0) {
    global_tokens_per_expert_.assign(static_cast<size_t>(moe_.num_experts), 0.0f);
    global_average_.assign(static_cast<size_t>(num_microbatches_), {});
  }
  if (moe_.shared_expert_intermediate_size) {
    shared_fc1_.emplace(&params.Get(prefix_ + ".shared_experts.linear_fc1.weight"), nullptr);
    shared_fc2_.emplace(&params.Get(prefix_ + ".shared_experts.linear_fc2.weight"));
  }
}

void MoeLayer::Route(const ModuleContext& ctx, const Tensor& top_scores, const Tensor& probs,
                     Stash* st) const {
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
      const std::vector<double> p = ValuesToHost(k, probs);
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

  // This micro-batch's kept choices per expert (Megatron's local_tokens_per_expert +=
  // routing_map.sum(0), after the token dropping): the expert bias's counts, and what
  // `mpusim run` reports per iteration for every MoE layer.
  st->kept_per_expert.assign(static_cast<size_t>(E), 0);
  for (int64_t e : route) {
    if (e >= 0) ++st->kept_per_expert[static_cast<size_t>(e)];
  }

  // The auxiliary losses' gradient coefficients, scaled 1 / (M d): per expert (aux_loss,
  // global_aux_loss) and per token (seq_aux_loss), added when several are listed.
  const double per_dp = 1.0 / static_cast<double>(num_microbatches_ * ctx.dp_size);
  const int64_t tp_cp = (sh.sequence_parallel ? sh.t : 1) * sh.cp;
  const double aux_coeff = moe_.AuxLossCoeff(MoeLoadBalancing::kAuxLoss);
  const double seq_coeff = moe_.AuxLossCoeff(MoeLoadBalancing::kSeqAuxLoss);
  const double global_coeff = moe_.AuxLossCoeff(MoeLoadBalancing::kGlobalAuxLoss);
  st->aux.clear();
  if (aux_coeff > 0 || seq_coeff > 0 || global_coeff > 0) {
    // count_i: the tokens whose top-k of the (aux) scores holds i, before dropping; per sample
    // (count_ni, sample n = t % b of token t, rows position-major) for seq_aux_loss.
    const std::vector<int64_t> top = IntsToHost(k, top_scores);
    const auto count = [&](int64_t b) {
      std::vector<int64_t> counts(static_cast<size_t>(b * E), 0);
      for (size_t i = 0; i < top.size(); ++i) {
        const auto t = static_cast<int64_t>(i) / K;
        ++counts[static_cast<size_t>((t % b) * E + top[i])];
      }
      return IntsToDevice(k, counts, {b * E});
    };
    const SiteSuffix site(ctx.trace, "moe router");
    const auto s_all = static_cast<double>(T * tp_cp / sh.b);  // the sequence length
    const auto d = [](int64_t v) { return static_cast<double>(v); };
    std::vector<double> per_expert(static_cast<size_t>(E), 0.0), per_token;
    if (aux_coeff > 0 || seq_coeff > 0) {
      // Summed over the router ranks of this dp rank (tp under sequence parallelism, and
      // cp; the dense groups, whatever etp and ep are). aux_loss: coeff E / (k (s b)^2);
      // seq_aux_loss: Megatron's per-sample loss averaged over the b samples, coeff E / (k
      // s^2 b).
      for (const bool per_sequence : {false, true}) {
        const double coeff = per_sequence ? seq_coeff : aux_coeff;
        if (coeff == 0) continue;
        const int64_t b = per_sequence ? sh.b : 1;
        Tensor summed = count(b);
        if (sh.sequence_parallel) ctx.tp.AllReduce(summed, ReduceOp::kSum);
        if (ctx.cp != nullptr) ctx.cp->AllReduce(summed, ReduceOp::kSum);
        const std::vector<int64_t> counts = IntsToHost(k, summed);
        const double c = per_dp * coeff * d(E) /
                         (d(K) * s_all * s_all * d(sh.b) * (per_sequence ? 1.0 : d(sh.b)));
        if (!per_sequence) {
          for (int64_t e = 0; e < E; ++e) {
            per_expert[static_cast<size_t>(e)] += c * d(counts[static_cast<size_t>(e)]);
          }
          continue;
        }
        per_token.resize(static_cast<size_t>(T * E));
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t e = 0; e < E; ++e) {
            per_token[static_cast<size_t>(t * E + e)] =
                c * d(counts[static_cast<size_t>((t % b) * E + e)]);
          }
        }
      }
    }
    if (global_coeff > 0) {
      // Summed over tp x dp x cp (Megatron's tp_dp_cp_group all-reduce, mid-forward), then
      // averaged over the step's micro-batches so far; coeff E / (k T_g^2), T_g = T tp dp cp.
      Tensor summed = count(1);
      if (sh.sequence_parallel) ctx.tp.AllReduce(summed, ReduceOp::kSum);
      if (ctx.dp_cp != nullptr) ctx.dp_cp->AllReduce(summed, ReduceOp::kSum);
      const std::vector<float>& average = GlobalAverage(ctx.draw.microbatch, IntsToHost(k, summed));
      const double T_g = d(T * tp_cp * ctx.dp_size);
      const double c = per_dp * global_coeff * d(E) / (d(K) * T_g * T_g);
      for (int64_t e = 0; e < E; ++e) {
        per_expert[static_cast<size_t>(e)] +=
            c * static_cast<double>(average[static_cast<size_t>(e)]);
      }
    }
    if (per_token.empty()) {
      st->aux = std::move(per_expert);
    } else {
      for (size_t i = 0; i < per_token.size(); ++i) {
        per_token[i] += per_expert[i % static_cast<size_t>(E)];
      }
      st->aux = std::move(per_token);
    }
  }
  st->dlse.clear();
  if (moe_.z_loss_coeff) {
    const double c = 2.0 * per_dp * *moe_.z_loss_coeff / static_cast<double>(tp_cp) /
                     static_cast<double>(T);
    for (double lse : ValuesToHost(k, st->lse)) st->dlse.push_back(c * lse);
  }

  // The dispatcher's permutation of the kept choices over this rank's experts.
  const TokenDispatcher dispatcher = Dispatcher(ctx, moe_.token_dispatcher);
  {
    const SiteSuffix site(ctx.trace, "moe dispatch");
    dispatcher.Route(k, route, T, E, K, experts_, &st->route, &received_);
  }
  sent_rows_ = dispatcher.SentRows(st->route);
  if (!sent_rows_.empty()) {
    row_bytes_ = (st->x.cols() + 1) * static_cast<int64_t>(DTypeSize(st->x.dtype()));
  }
}

void MoeLayer::RecomputeActivation(const ModuleContext& ctx, Stash* st) const {
  if (!st->fc1_out.defined()) return;  // no rows routed here
  const int64_t f = fc2_.front()->value.cols();
  st->act = ctx.k.Empty({st->fc1_out.rows(), f}, st->fc1_out.dtype());
  ctx.k.ActivationForward(activation_, st->fc1_out, st->act, glu_);
}

void MoeLayer::RecomputeSharedExpert(const ModuleContext& ctx, Stash* st) const {
  if (!shared_fc1_) return;
  Kernels& k = ctx.k;
  // As Forward runs it; its output is not needed again.
  st->shared_fc1_out = shared_fc1_->Forward(ctx, st->shared_fc1_in.input, &st->shared_fc1_in);
  const Tensor& a = st->shared_fc1_out;
  Tensor act = k.Empty({a.rows(), IsGated(activation_) ? a.cols() / 2 : a.cols()}, a.dtype());
  k.ActivationForward(activation_, a, act, glu_);
  shared_fc2_->Forward(ctx, act, &st->shared_fc2_in);
}

Tensor MoeLayer::Forward(const ModuleContext& ctx, const Tensor& x, Stash* st) const {
  Kernels& k = ctx.k;
  const int64_t T = x.rows(), h = x.cols(), E = moe_.num_experts, K = moe_.router_topk;
  const DType dtype = x.dtype();
  const RouterDTypes dt = RouterDTypesOf(moe_, dtype);
  st->x = x;

  // The router: the gating GEMM on x and W_r cast to the router's dtype (Megatron's
  // router_gating_linear), the softmaxes in the scores' dtype.
  Tensor logits = k.Empty({T, E}, dt.logits);
  k.Gemm(false, true, 1.0, As(k, x, dt.logits), As(k, router_->value, dt.logits), 0.0, logits);
  if (router_bias_ != nullptr) k.AddRowVector(As(k, router_bias_->value, dt.logits), logits);
  const WholeRowSoftmax over_experts = MakeWholeRowSoftmax(k, E);
  const bool per_logit = moe_.PerLogitScores();  // sigmoid or sqrtsoftplus
  st->scores = k.Empty({T, E}, dt.scores);
  st->lse = k.Empty({T}, dt.scores);
  k.CausalSoftmaxForward(As(k, logits, dt.scores), over_experts.q_pos, over_experts.k_pos, 1.0,
                         st->scores, &st->lse);
  std::vector<double> sig;  // per-logit scores on the host, [T * E]
  if (per_logit) {
    // scores = sigmoid(logits.float()) or sqrt(softplus(logits.float())); the softmax above
    // stays for the z-loss only.
    if (moe_.z_loss_coeff) st->z_softmax = st->scores;
    sig = ValuesToHost(k, As(k, logits, dt.scores));
    for (double& v : sig) v = PerLogitScore(moe_.score_function, v);
    st->scores = ValuesToDevice(k, sig, {T, E}, dt.scores);
    sig = ValuesToHost(k, st->scores);  // as stored
  }
  const Tensor& ranked = per_logit || moe_.router_pre_softmax ? st->scores : logits;
  Tensor values, indices;
  if (moe_.group_limited() || moe_.enable_expert_bias) {
    // The expert bias joins the scores for choosing only (scores + expert_bias.float());
    // the chosen values are the scores themselves.
    std::vector<double> key = ValuesToHost(k, ranked);
    if (moe_.enable_expert_bias) {
      for (size_t i = 0; i < key.size(); ++i) key[i] += expert_bias_[i % static_cast<size_t>(E)];
    }
    const std::vector<int64_t> chosen = ChooseExperts(key, T, E, K, moe_);
    indices = IntsToDevice(k, chosen, {T, K});
    values = GatherRows(k, ranked.Reshaped({T * E, 1}),
                        IntsToDevice(k, FlatChoices(chosen, E, K), {T * K}))
                 .Reshaped({T, K});
  } else {
    values = k.Empty({T, K}, ranked.dtype());
    indices = k.Empty({T, K}, DType::kInt64);
    k.TopK(ranked, K, values, indices);
  }
  Tensor top_scores = indices;  // the load-balancing counts' top-k of the (aux) scores
  if (per_logit) {
    // probs: the chosen scores normalised to sum 1 (topk > 1); the load-balancing counts:
    // the top-k (no group limit) of the scores normalised over all experts.
    const std::vector<int64_t> chosen = IntsToHost(k, indices);
    std::vector<double> p(static_cast<size_t>(T * K)), aux_scores(sig.size());
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0, all = 0;
      for (int64_t s = 0; s < K; ++s)
        sum += sig[static_cast<size_t>(t * E + chosen[static_cast<size_t>(t * K + s)])];
      for (int64_t e = 0; e < E; ++e) all += sig[static_cast<size_t>(t * E + e)];
      for (int64_t s = 0; s < K; ++s) {
        const double v = sig[static_cast<size_t>(t * E + chosen[static_cast<size_t>(t * K + s)])];
        p[static_cast<size_t>(t * K + s)] = K > 1 ? v / (sum + kSigmoidNormEps) : v;
      }
      for (int64_t e = 0; e < E; ++e) {
        aux_scores[static_cast<size_t>(t * E + e)] =
            sig[static_cast<size_t>(t * E + e)] / (all + kSigmoidNormEps);
      }
    }
    st->probs = ValuesToDevice(k, p, {T, K}, dt.scores);
    std::vector<double> stored = ValuesToHost(k, ValuesToDevice(k, aux_scores, {T, E}, dt.scores));
    top_scores = IntsToDevice(k, ChooseExperts(stored, T, E, K, MoeConfig{}), {T, K});
  } else if (moe_.router_pre_softmax) {
    st->probs = values;
    if (moe_.group_limited()) {
      Tensor unused = k.Empty({T, K}, dt.scores);
      top_scores = k.Empty({T, K}, DType::kInt64);
      k.TopK(st->scores, K, unused, top_scores);
    }
  } else {
    const WholeRowSoftmax over_chosen = MakeWholeRowSoftmax(k, K);
    st->probs = k.Empty({T, K}, dt.scores);
    k.CausalSoftmaxForward(As(k, values, dt.scores), over_chosen.q_pos, over_chosen.k_pos, 1.0,
                           st->probs);
    Tensor unused = k.Empty({T, K}, dt.scores);
    top_scores = k.Empty({T, K}, DType::kInt64);
    k.TopK(st->scores, K, unused, top_scores);
  }
  st->chosen = IntsToHost(k, indices);
  // What the dispatcher carries: probs times moe_router_topk_scaling_factor in the scores'
  // dtype, then probs.type_as(logits).
  Tensor weights = st->probs;
  if (moe_.topk_scaling_factor) {
    weights = k.Empty(st->probs.shape(), st->probs.dtype());
    k.Copy(st->probs, weights);
    k.Scale(*moe_.topk_scaling_factor, weights);
  }
  const Tensor probs = As(k, weights, dt.logits);
  Route(ctx, top_scores, probs, st);

  // Dispatch, the experts, combine.
  // The rows the experts' permutation picks from: the dispatch group's tokens and
  // probabilities (allgather), or the rows routed to this rank's experts (alltoall).
  std::optional<SiteSuffix> site(std::in_place, ctx.trace, "moe dispatch");
  const TokenDispatcher dispatcher = Dispatcher(ctx, moe_.token_dispatcher);
  const TokenRoute& route = st->route;
  const Tensor x_src = dispatcher.DispatchTokens(k, x, route);
  const Tensor p_src = dispatcher.DispatchProbs(k, probs, route);
  const int64_t N = route.offsets.back();
  Tensor y_src = k.Zeros({x_src.rows(), h}, dtype);
  if (N > 0) {
    st->x_perm = GatherRows(k, x_src, route.token_ids);
    st->p_perm = GatherRows(k, p_src, route.slot_ids);
    const int64_t f1 = fc1_.front()->value.rows(), f = fc2_.front()->value.cols();
    st->fc1_out = k.Empty({N, f1}, dtype);
    ForEachExpert(route.offsets, [&](size_t e, int64_t o, int64_t n) {
      Tensor out = Rows(st->fc1_out, o, n);
      k.Gemm(false, true, 1.0, Rows(st->x_perm, o, n), fc1_[e]->value, 0.0, out);
      if (!fc1_bias_.empty()) k.AddRowVector(fc1_bias_[e]->value, out);
    });
    st->act = k.Empty({N, f}, dtype);
    k.ActivationForward(activation_, st->fc1_out, st->act, glu_);
    Tensor scaled = k.Empty({N, f}, dtype);
    WeightRows(k, st->p_perm, st->act, scaled);
    Tensor y_perm = k.Empty({N, h}, dtype);
    // With biases, Megatron's expert MLP adds fc2's weighted by the probability
    // (MLP.forward: output += output_bias * per_token_scale): y = p (fc2(act) + b2).
    const Tensor p_rows = fc2_bias_.empty() ? Tensor() : As(k, st->p_perm, dtype);
    ForEachExpert(route.offsets, [&](size_t e, int64_t o, int64_t n) {
      Tensor out = Rows(y_perm, o, n);
      k.Gemm(false, true, 1.0, Rows(scaled, o, n), fc2_[e]->value, 0.0, out);
      if (!fc2_bias_.empty()) {
        k.Gemm(false, false, 1.0, Rows(p_rows, o, n), fc2_bias_[e]->value.Reshaped({1, h}), 1.0,
               out);
      }
    });
    ScatterAddRows(k, y_perm, route.token_ids, y_src);  // per token (allgather) or row
  }
  Tensor y = dispatcher.CombineTokens(k, y_src, T, route);
  site.reset();

  if (shared_fc1_) {
    st->shared_fc1_out = shared_fc1_->Forward(ctx, x, &st->shared_fc1_in);
    const Tensor& a = st->shared_fc1_out;
    Tensor act = k.Empty({a.rows(), IsGated(activation_) ? a.cols() / 2 : a.cols()}, dtype);
    k.ActivationForward(activation_, a, act, glu_);
    k.Axpy(1.0, shared_fc2_->Forward(ctx, act, &st->shared_fc2_in), y);
  }
  return y;
}

StashPlan MoeLayer::PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                              int64_t etp, double rows, double sent) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  const MoeConfig& moe = gpt.moe;
  const double T = d(shape.stream_rows()), R = d(shape.s_cp() * shape.b);
  const double E = d(moe.num_experts), K = d(moe.router_topk), h = d(gpt.hidden_size);
  const double f = d(moe.ffn_hidden_size) / d(etp), f1 = IsGated(gpt.activation) ? 2 * f : f;
  const RouterDTypes dt = RouterDTypesOf(moe, dtype);
  StashPlan plan;
  plan.Add("x", {T, h}, dtype);  // the norm's output (shared_fc1_in.input is the same)
  plan.Add("scores", {T, E}, dt.scores);
  plan.Add("lse", {T}, dt.scores);
  plan.Add("probs", {T, K}, dt.scores);
  if (moe.PerLogitScores() && moe.z_loss_coeff) {
    plan.Add("z_softmax", {T, E}, dt.scores);
  }
  plan.Add("route.token_ids", {rows}, DType::kInt64);
  if (moe.token_dispatcher == MoeDispatcher::kAllToAll) {
    // slot_ids is token_ids.
    plan.Add("route.send_tokens", {sent}, DType::kInt64);
    plan.Add("route.send_slots", {sent}, DType::kInt64);
  } else {
    plan.Add("route.slot_ids", {rows}, DType::kInt64);
  }
  plan.Add("x_perm", {rows, h}, dtype);
  plan.Add("p_perm", {rows, 1}, dt.logits);
  plan.Add("fc1_out", {rows, f1}, dtype);
  plan.Add("act", {rows, f}, dtype);
  if (moe.shared_expert_intermediate_size) {
    const double fs = d(*moe.shared_expert_intermediate_size) / d(shape.t);
    plan.Add("shared_fc1_out", {R, IsGated(gpt.activation) ? 2 * fs : fs}, dtype);
    plan.Add("shared_fc2_in.input", {R, fs}, dtype);  // the shared expert's activation
  }
  return plan;
}

const std::vector<float>& MoeLayer::GlobalAverage(int64_t microbatch,
                                                  const std::vector<int64_t>& counts) const {
  std::vector<float>& average = global_average_.at(static_cast<size_t>(microbatch));
  if (!average.empty()) return average;  // a recomputed forward: counted at the first
  // global_tokens_per_expert += counts; ga_steps += 1; their quotient, all in float32 (the
  // counts are integers, exact below 2^24).
  for (size_t e = 0; e < counts.size(); ++e) {
    global_tokens_per_expert_[e] += static_cast<float>(counts[e]);
  }
  ga_steps_ += 1.0f;
  for (float total : global_tokens_per_expert_) average.push_back(total / ga_steps_);
  return average;
}

void MoeLayer::ResetGlobalAuxLossTracker() const {
  if (global_average_.empty()) return;
  if (ga_steps_ != static_cast<float>(num_microbatches_)) {
    throw std::logic_error(
        fmt::format("MoeLayer {}: the global aux loss tracker took {} "
                    "micro-batches of the step's {}",
                    prefix_, ga_steps_, num_microbatches_));
  }
  std::fill(global_tokens_per_expert_.begin(), global_tokens_per_expert_.end(), 0.0f);
  ga_steps_ = 0;
  for (std::vector<float>& average : global_average_) average.clear();
}

void MoeLayer::UpdateExpertBias(const std::vector<float>& tokens_per_expert) const {
  // get_updated_expert_bias in float32: offset = mean - count, bias += sign(offset) * rate.
  const auto n = static_cast<float>(tokens_per_expert.size());
  float total = 0;
  for (float c : tokens_per_expert) total += c;  // integers: exact in any order below 2^24
  const float mean = total / n;
  const auto rate = static_cast<float>(moe_.bias_update_rate);
  for (size_t e = 0; e < expert_bias_.size(); ++e) {
    const float offset = mean - tokens_per_expert[e];
    const float sign = offset > 0 ? 1.0f : offset < 0 ? -1.0f : 0.0f;
    expert_bias_[e] = expert_bias_[e] + sign * rate;
  }
}

Tensor MoeLayer::Backward(const ModuleContext& ctx, const Tensor& dy, const Stash& st) const {
  // The micro-batch's counts join the step's once, at its backward (a recomputed forward
  // routes the same tokens; Megatron counts only under grad, once per micro-batch).
  for (size_t e = 0; e < st.kept_per_expert.size(); ++e) {
    tokens_per_expert_[e] += st.kept_per_expert[e];
  }
  Kernels& k = ctx.k;
  const int64_t T = dy.rows(), h = dy.cols(), E = moe_.num_experts, K = moe_.router_topk;
  const DType dtype = dy.dtype();
  const RouterDTypes dt = RouterDTypesOf(moe_, dtype);

  // The experts, on the gathered gradient.
  std::optional<SiteSuffix> site(std::in_place, ctx.trace, "moe dispatch");
  const TokenDispatcher dispatcher = Dispatcher(ctx, moe_.token_dispatcher);
  const TokenRoute& route = st.route;
  const Tensor dy_src = dispatcher.DispatchTokens(k, dy, route);
  const int64_t N = route.offsets.back();
  Tensor dx_src = k.Zeros({dy_src.rows(), h}, dtype);
  Tensor dp_src = k.Zeros({dispatcher.ProbRows(dy_src.rows(), K), 1}, dt.logits);
  if (N > 0) {
    const Tensor dy_perm = GatherRows(k, dy_src, route.token_ids);
    const int64_t f = st.act.cols();
    Tensor scaled = k.Empty({N, f}, dtype);
    WeightRows(k, st.p_perm, st.act, scaled);
    Tensor dscaled = k.Empty({N, f}, dtype);
    const Tensor p_rows = fc2_bias_.empty() ? Tensor() : As(k, st.p_perm, dtype);
    ForEachExpert(route.offsets, [&](size_t e, int64_t o, int64_t n) {
      Parameter& w2 = *fc2_[e];
      const Tensor dy_e = Rows(dy_perm, o, n);
      Tensor out = Rows(dscaled, o, n);
      k.Gemm(false, false, 1.0, dy_e, w2.value, 0.0, out);
      if (w2.grad.defined()) {
        const Tensor s_e = Rows(scaled, o, n);
        AccumulateGrad(k, w2, ctx.fuse_wgrad,
                       [&](Tensor& g, double beta) { k.Gemm(true, false, 1.0, dy_e, s_e, beta, g); });
      }
      // d b2 = sum over the rows of p dy.
      if (!fc2_bias_.empty() && fc2_bias_[e]->grad.defined()) {
        const Tensor p_e = Rows(p_rows, o, n);
        AccumulateGrad(k, *fc2_bias_[e], false, [&](Tensor& g, double beta) {
          Tensor row = g.Reshaped({1, h});
          k.Gemm(true, false, 1.0, p_e, dy_e, beta, row);
        });
      }
    });
    // d p[r] = dscaled[r] . act[r] (+ dy[r] . b2 with biases) in the router's dtype;
    // d act = p dscaled.
    Tensor dp_perm = k.Empty({N, 1, 1}, dt.logits);
    k.BatchedGemm(false, true, 1.0, As(k, dscaled, dt.logits).Reshaped({N, 1, f}),
                  As(k, st.act, dt.logits).Reshaped({N, 1, f}), 0.0, dp_perm);
    if (!fc2_bias_.empty()) {
      Tensor dp_rows = dp_perm.Reshaped({N, 1});
      const Tensor dy_l = As(k, dy_perm, dt.logits);
      ForEachExpert(route.offsets, [&](size_t e, int64_t o, int64_t n) {
        Tensor out = Rows(dp_rows, o, n);
        k.Gemm(false, false, 1.0, Rows(dy_l, o, n),
               As(k, fc2_bias_[e]->value, dt.logits).Reshaped({h, 1}), 1.0, out);
      });
    }
    Tensor dact = k.Empty({N, f}, dtype);
    WeightRows(k, st.p_perm, dscaled, dact);
    Tensor dfc1 = k.Empty(st.fc1_out.shape(), dtype);
    k.ActivationBackward(activation_, st.fc1_out, dact, dfc1, glu_);
    Tensor dx_perm = k.Empty({N, h}, dtype);
    ForEachExpert(route.offsets, [&](size_t e, int64_t o, int64_t n) {
      Parameter& w1 = *fc1_[e];
      const Tensor d_e = Rows(dfc1, o, n);
      Tensor out = Rows(dx_perm, o, n);
      k.Gemm(false, false, 1.0, d_e, w1.value, 0.0, out);
      if (w1.grad.defined()) {
        const Tensor x_e = Rows(st.x_perm, o, n);
        AccumulateGrad(k, w1, ctx.fuse_wgrad,
                       [&](Tensor& g, double beta) { k.Gemm(true, false, 1.0, d_e, x_e, beta, g); });
      }
      if (!fc1_bias_.empty() && fc1_bias_[e]->grad.defined()) {
        AccumulateGrad(k, *fc1_bias_[e], false,
                       [&](Tensor& g, double beta) { k.SumRows(d_e, beta, g); });
      }
    });
    ScatterAddRows(k, dx_perm, route.token_ids, dx_src);
    ScatterAddRows(k, dp_perm.Reshaped({N, 1}), route.slot_ids, dp_src);
  }
  // The way back sums the tp ranks' partial sums and returns each rank its tokens.
  Tensor dx = dispatcher.CombineTokens(k, dx_src, T, route);
  const Tensor dprobs = dispatcher.CombineProbs(k, dp_src, T, K, route);
  site.reset();

  // The router: the probabilities' gradient, the load-balancing and z-loss terms, through
  // the softmaxes (or the per-logit scores) in the scores' dtype; d logits in the router's.
  Tensor dprobs_s = As(k, dprobs, dt.scores);
  Tensor dlogits_s, dvalues_s;  // dvalues_s: the chosen logits' gradient (post-softmax top-k)
  // (flat_ids, the positions and dscores are kept to the end, as the memory plan counts.)
  Tensor flat_ids, dscores;
  std::optional<WholeRowSoftmax> over_experts;
  if (moe_.PerLogitScores()) {
    dlogits_s = PerLogitRouterBackward(k, ValuesToHost(k, dprobs_s), st, moe_, dt.scores);
  } else {
    if (moe_.topk_scaling_factor) k.Scale(*moe_.topk_scaling_factor, dprobs_s);
    flat_ids = IntsToDevice(k, FlatChoices(st.chosen, E, K), {T * K});
    over_experts = MakeWholeRowSoftmax(k, E);
    dlogits_s = k.Empty({T, E}, dt.scores);
    dscores = k.Zeros({T, E}, dt.scores);
    if (static_cast<int64_t>(st.aux.size()) == E) {
      k.AddRowVector(ValuesToDevice(k, st.aux, {E}, dt.scores), dscores);
    } else if (!st.aux.empty()) {
      k.Axpy(1.0, ValuesToDevice(k, st.aux, {T, E}, dt.scores), dscores);
    }
    if (moe_.router_pre_softmax) {
      Tensor into = dscores.Reshaped({T * E, 1});
      k.EmbeddingBackward(dprobs_s.Reshaped({T * K, 1}), flat_ids, 0, T * E, into);
      k.CausalSoftmaxBackward(st.scores, dscores, over_experts->q_pos, over_experts->k_pos, 1.0,
                              dlogits_s);
    } else {
      const WholeRowSoftmax over_chosen = MakeWholeRowSoftmax(k, K);
      dvalues_s = k.Empty({T, K}, dt.scores);
      k.CausalSoftmaxBackward(st.probs, dprobs_s, over_chosen.q_pos, over_chosen.k_pos, 1.0,
                              dvalues_s);
      k.CausalSoftmaxBackward(st.scores, dscores, over_experts->q_pos, over_experts->k_pos, 1.0,
                              dlogits_s);
    }
  }
  if (!st.dlse.empty()) {
    // d lse_t / d logits_t = softmax(logits_t).
    const Tensor& softmax = st.z_softmax.defined() ? st.z_softmax : st.scores;
    Tensor term = k.Empty({T, 1, E}, dt.scores);
    k.BatchedGemm(false, false, 1.0, ValuesToDevice(k, st.dlse, {T, 1, 1}, dt.scores),
                  softmax.Reshaped({T, 1, E}), 0.0, term);
    k.Axpy(1.0, term, dlogits_s);
  }
  Tensor dlogits = As(k, dlogits_s, dt.logits);
  if (dvalues_s.defined()) {
    Tensor into = dlogits.Reshaped({T * E, 1});
    k.EmbeddingBackward(As(k, dvalues_s, dt.logits).Reshaped({T * K, 1}), flat_ids, 0, T * E, into);
  }
  // Megatron's RouterGatingLinearFunction backward: both products in the router's dtype,
  // then cast to the input's and the weight's dtype; the weight's gradient reaches main_grad
  // as a separate gradient (the function never fuses its accumulation).
  {
    Tensor dx_router = k.Empty({T, h}, dt.logits);
    k.Gemm(false, false, 1.0, dlogits, As(k, router_->value, dt.logits), 0.0, dx_router);
    k.Axpy(1.0, As(k, dx_router, dtype), dx);
  }
  if (router_->grad.defined()) {
    Tensor grad = k.Empty(router_->value.shape(), dt.logits);
    k.Gemm(true, false, 1.0, dlogits, As(k, st.x, dt.logits), 0.0, grad);
    k.Axpy(1.0, As(k, grad, router_->value.dtype()), router_->grad);
  }
  if (router_bias_ != nullptr && router_bias_->grad.defined()) {  // the rows' sum of d logits
    Tensor grad = k.Zeros(router_bias_->value.shape(), dt.logits);
    k.SumRows(dlogits, 0.0, grad);
    k.Axpy(1.0, As(k, grad, router_bias_->value.dtype()), router_bias_->grad);
  }

  if (shared_fc1_) {
    const Tensor dact = shared_fc2_->Backward(ctx, dy, st.shared_fc2_in);
    Tensor dh = k.Empty(st.shared_fc1_out.shape(), dtype);
    k.ActivationBackward(activation_, st.shared_fc1_out, dact, dh, glu_);
    k.Axpy(1.0, shared_fc1_->Backward(ctx, dh, st.shared_fc1_in), dx);
  }
  return dx;
}

}  // namespace mpusim
