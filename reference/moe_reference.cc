// The reference's mixture-of-experts layer (see moe_reference.h).
#include "reference/moe_reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace mpusim::gpt_reference {
namespace {

// The columns of `v` ordered by value, largest first, equal values by the lower column; the
// first k of them.
std::vector<int64_t> FirstK(const std::vector<double>& v, int64_t k) {
  std::vector<int64_t> order(v.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return v[static_cast<size_t>(a)] > v[static_cast<size_t>(b)];
  });
  order.resize(static_cast<size_t>(k));
  return order;
}

// The experts a token chooses from its ranked values v [E]: the first k, or with
// group-limited routing the first k among the experts of the group_topk groups (E / G
// consecutive experts each) whose largest k / group_topk values sum highest, equal sums by the
// lower group.
std::vector<int64_t> Choose(const MoeConfig& moe, std::vector<double> v) {
  const int64_t k = moe.router_topk;
  if (moe.group_topk) {
    const int64_t G = *moe.num_groups, per = static_cast<int64_t>(v.size()) / G;
    std::vector<double> sums(static_cast<size_t>(G), 0.0);
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> members(v.begin() + g * per, v.begin() + (g + 1) * per);
      for (int64_t i : FirstK(members, k / *moe.group_topk)) {
        sums[static_cast<size_t>(g)] += members[static_cast<size_t>(i)];
      }
    }
    std::vector<bool> open(static_cast<size_t>(G), false);
    for (int64_t g : FirstK(sums, *moe.group_topk)) open[static_cast<size_t>(g)] = true;
    for (size_t e = 0; e < v.size(); ++e) {
      if (!open[e / static_cast<size_t>(per)]) v[e] = -INFINITY;
    }
  }
  return FirstK(v, k);
}

constexpr double kSigmoidEps = 1e-20;  // Megatron's s / (sum s + 1e-20)

// torch's softplus (beta 1, threshold 20): log(1 + e^z), z itself above the threshold; its
// derivative sigmoid(z), 1 above the threshold.
constexpr double kSoftplusThreshold = 20.0;

// The per-logit score of z (sigmoid, or sqrt(softplus)) and its derivative.
double PerLogitScore(MoeScoreFunction f, double z) {
  if (f == MoeScoreFunction::kSigmoid) return 1.0 / (1.0 + std::exp(-z));
  return std::sqrt(z > kSoftplusThreshold ? z : std::log1p(std::exp(z)));
}
double PerLogitScoreGrad(MoeScoreFunction f, double z) {
  const double sigmoid = 1.0 / (1.0 + std::exp(-z));
  if (f == MoeScoreFunction::kSigmoid) return sigmoid * (1.0 - sigmoid);
  return (z > kSoftplusThreshold ? 1.0 : sigmoid) / (2.0 * PerLogitScore(f, z));
}

std::vector<double> RowOf(const Mat& m, int64_t r) {
  std::vector<double> v(static_cast<size_t>(m.cols()));
  for (int64_t c = 0; c < m.cols(); ++c) v[static_cast<size_t>(c)] = m(r, c);
  return v;
}

// The router groups of the slice's dp rank q: its cp ranks' positions (chunks c and
// 2 cp - 1 - c), each cut into t pieces under sequence parallelism; rows position-major.
std::vector<std::vector<int64_t>> RouterGroups(const Dims& d, const MoeLayout& l, int64_t q) {
  std::vector<std::vector<int64_t>> groups;
  for (int64_t c = 0; c < l.cp; ++c) {
    std::vector<int64_t> positions;
    if (l.cp == 1) {
      for (int64_t i = 0; i < d.s; ++i) positions.push_back(i);
    } else {
      const int64_t cs = d.s / (2 * l.cp);
      for (int64_t chunk : {c, 2 * l.cp - 1 - c}) {
        for (int64_t i = 0; i < cs; ++i) positions.push_back(chunk * cs + i);
      }
    }
    const int64_t pieces = l.sp ? l.t : 1;
    const int64_t per = static_cast<int64_t>(positions.size()) / pieces;
    for (int64_t piece = 0; piece < pieces; ++piece) {
      std::vector<int64_t> rows;
      for (int64_t i = piece * per; i < (piece + 1) * per; ++i) {
        for (int64_t j = 0; j < l.b; ++j) {
          rows.push_back(positions[static_cast<size_t>(i)] * d.n + q * l.b + j);
        }
      }
      groups.push_back(std::move(rows));
    }
  }
  return groups;
}

// Expert e's bias, or an undefined one (no add_bias_linear: the list is empty). Params share
// their tensors, so the copy's gradient is the model's.
Param BiasOf(const std::vector<Param>& biases, int64_t e) {
  return biases.empty() ? Param{} : biases[static_cast<size_t>(e)];
}

Mat Gather(const Mat& x, const std::vector<int64_t>& rows) {
  Mat out(static_cast<int64_t>(rows.size()), x.cols());
  for (size_t i = 0; i < rows.size(); ++i) out.row(static_cast<int64_t>(i)) = x.row(rows[i]);
  return out;
}

// fc2(act(fc1(x) + b1) * scale) + b2 * scale (Megatron's MLP.forward with per_token_scale:
// output += output_bias * per_token_scale; b1, b2 undefined without add_bias_linear); keeps
// fc1 and act (before the scale).
Mat Mlp(Activation act, const GluOptions& glu, const Mat& x, const Param& w1, const Param& w2,
        const Vec* scale, Mat* fc1_out, Mat* act_out, const Param& b1 = {}, const Param& b2 = {}) {
  *fc1_out = Linear(x, w1, b1);
  act_out->resize(x.rows(), w2.value.cols());
  ref::ActivationForward(act, *fc1_out, *act_out, glu);
  if (scale == nullptr) return Linear(*act_out, w2, b2);
  Mat out = Linear(act_out->array().colwise() * scale->array(), w2, Param{});
  if (b2.defined()) out += *scale * AsRow(b2.value);
  return out;
}

// The backward of Mlp: dx, and with `scale` d(scale) per row into *dscale.
Mat MlpBackward(Activation act, const GluOptions& glu, const Mat& dy, const Mat& x, const Mat& fc1,
                const Mat& a, Param& w1, Param& w2, const Vec* scale, Vec* dscale, Param& b1,
                Param& b2) {
  Param no_bias;
  Mat scaled = a;
  if (scale != nullptr) scaled = a.array().colwise() * scale->array();
  Mat du = LinearBackward(dy, scaled, w2, scale == nullptr ? b2 : no_bias);  // d(act * scale)
  if (scale != nullptr) {
    *dscale = (a.array() * du.array()).rowwise().sum();
    if (b2.defined()) {  // out += scale * b2: d scale += dy . b2, d b2 += sum of scale dy
      *dscale += dy * AsRow(b2.value).transpose();
      AsRow(b2.grad) += scale->transpose() * dy;
    }
    du = du.array().colwise() * scale->array();
  }
  Mat dfc1(fc1.rows(), fc1.cols());
  ref::ActivationBackward(act, du, fc1, dfc1, glu);
  return LinearBackward(dfc1, x, w1, b1);
}

}  // namespace

Mat MoeForward(const Dims& d, const GptConfig& gpt, const MoeLayout& layout, const Mat& x,
               const MoeParams& p, MoeStash* stash, double* aux_objective) {
  const MoeConfig& moe = gpt.moe;
  const int64_t E = moe.num_experts, k = moe.router_topk;
  const double per_dp = 1.0 / static_cast<double>(d.M * (d.B / layout.b));  // 1 / (M d)
  const bool sigmoid = moe.PerLogitScores();  // sigmoid or sqrtsoftplus: g.sig
  const double scaling = moe.topk_scaling_factor.value_or(1.0);
  const double aux_coeff = moe.AuxLossCoeff(MoeLoadBalancing::kAuxLoss);
  const double seq_coeff = moe.AuxLossCoeff(MoeLoadBalancing::kSeqAuxLoss);
  const double global_coeff = moe.AuxLossCoeff(MoeLoadBalancing::kGlobalAuxLoss);
  Vec global_counts = Vec::Zero(E);  // the micro-batch's counts over every dp rank
  MoeStash& st = *stash;
  st.x = x;
  st.groups.clear();
  st.experts.assign(static_cast<size_t>(E), {});
  for (int64_t q = 0; q < d.n / layout.b; ++q) {
    std::vector<std::vector<int64_t>> rows = RouterGroups(d, layout, q);
    const size_t first = st.groups.size();
    Vec counts = Vec::Zero(E);
    Mat sample_counts = Mat::Zero(layout.b, E);  // seq_aux_loss: per sample of the dp rank
    for (std::vector<int64_t>& group_rows : rows) {
      MoeStash::Group g;
      g.rows = std::move(group_rows);
      const auto T = static_cast<int64_t>(g.rows.size());
      g.logits = Linear(Gather(x, g.rows), p.router, p.router_bias);  // router_gating_linear
      g.scores.resize(T, E);
      g.lse.resize(T);
      if (sigmoid) {
        g.sig.resize(T, E);
        g.aux_scores.resize(T, E);
      }
      for (int64_t t = 0; t < T; ++t) {
        const double m = g.logits.row(t).maxCoeff();
        const double sum = (g.logits.row(t).array() - m).exp().sum();
        g.lse(t) = m + std::log(sum);
        g.scores.row(t) = (g.logits.row(t).array() - g.lse(t)).exp();
        if (sigmoid) {
          for (int64_t e = 0; e < E; ++e) {
            g.sig(t, e) = PerLogitScore(moe.score_function, g.logits(t, e));
          }
          g.aux_scores.row(t) = g.sig.row(t) / (g.sig.row(t).sum() + kSigmoidEps);
        }
        // The load-balancing counts: the top-k of the softmax (or of the normalised sigmoids),
        // no group limit, before any dropping.
        const int64_t sample = g.rows[static_cast<size_t>(t)] % d.n - q * layout.b;
        for (int64_t e : FirstK(RowOf(sigmoid ? g.aux_scores : g.scores, t), k)) {
          counts(e) += 1;
          sample_counts(sample, e) += 1;
        }
        std::vector<double> key = RowOf(sigmoid                  ? g.sig
                                        : moe.router_pre_softmax ? g.scores
                                                                 : g.logits,
                                        t);
        for (size_t e = 0; e < p.expert_bias.size(); ++e) key[e] += p.expert_bias[e];
        const std::vector<int64_t> chosen = Choose(moe, key);
        std::vector<double> probs(static_cast<size_t>(k));
        if (sigmoid) {
          double chosen_sum = 0;
          for (int64_t e : chosen) chosen_sum += g.sig(t, e);
          for (int64_t s = 0; s < k; ++s) {
            const double v = g.sig(t, chosen[static_cast<size_t>(s)]);
            probs[static_cast<size_t>(s)] = k > 1 ? v / (chosen_sum + kSigmoidEps) : v;
          }
        } else if (moe.router_pre_softmax) {
          for (int64_t s = 0; s < k; ++s) probs[static_cast<size_t>(s)] = g.scores(t, chosen[static_cast<size_t>(s)]);
        } else {
          double top = -INFINITY, total = 0;
          for (int64_t e : chosen) top = std::max(top, g.logits(t, e));
          for (int64_t s = 0; s < k; ++s) {
            probs[static_cast<size_t>(s)] = std::exp(g.logits(t, chosen[static_cast<size_t>(s)]) - top);
            total += probs[static_cast<size_t>(s)];
          }
          for (double& v : probs) v /= total;
        }
        for (double& v : probs) v *= scaling;  // moe_router_topk_scaling_factor
        g.chosen.push_back(chosen);
        g.p.push_back(probs);
        g.kept.emplace_back(static_cast<size_t>(k), true);
      }
      if (moe.expert_capacity_factor) {
        const auto capacity = static_cast<int64_t>(
            std::ceil(static_cast<double>(T * k) / static_cast<double>(E) * *moe.expert_capacity_factor));
        if (capacity < T) {
          for (int64_t e = 0; e < E; ++e) {
            std::vector<double> key(static_cast<size_t>(T), 0.0);
            for (int64_t t = 0; t < T; ++t) {
              for (int64_t s = 0; s < k; ++s) {
                if (g.chosen[static_cast<size_t>(t)][static_cast<size_t>(s)] != e) continue;
                key[static_cast<size_t>(t)] = moe.token_drop_policy == MoeDropPolicy::kProbs
                                                  ? g.p[static_cast<size_t>(t)][static_cast<size_t>(s)]
                                                  : 1.0;
              }
            }
            std::vector<bool> keep(static_cast<size_t>(T), false);
            for (int64_t t : FirstK(key, capacity)) keep[static_cast<size_t>(t)] = true;
            for (int64_t t = 0; t < T; ++t) {
              for (int64_t s = 0; s < k; ++s) {
                if (g.chosen[static_cast<size_t>(t)][static_cast<size_t>(s)] == e && !keep[static_cast<size_t>(t)]) {
                  g.kept[static_cast<size_t>(t)][static_cast<size_t>(s)] = false;
                }
              }
            }
          }
        }
      }
      if (moe.z_loss_coeff) {
        const double coeff = *moe.z_loss_coeff / static_cast<double>(layout.t * layout.cp);
        *aux_objective += per_dp * coeff * g.lse.array().square().mean();
        g.z_scale = per_dp * coeff / static_cast<double>(T);
      }
      st.groups.push_back(std::move(g));
    }
    // The dp rank's load-balancing losses' coefficients, from its summed counts: over all
    // its tokens (aux_loss) and per sample, averaged over them (seq_aux_loss); added when
    // both are listed.
    if (aux_coeff > 0 || seq_coeff > 0) {
      const auto T_dp = static_cast<double>(d.s * layout.b);
      const auto s = static_cast<double>(d.s);
      const double aux_scale =
          per_dp * aux_coeff * static_cast<double>(E) / (static_cast<double>(k) * T_dp * T_dp);
      const double seq_scale = per_dp * seq_coeff * static_cast<double>(E) /
                               (static_cast<double>(k) * s * s * static_cast<double>(layout.b));
      for (size_t gi = first; gi < st.groups.size(); ++gi) {
        MoeStash::Group& g = st.groups[gi];
        const auto T = static_cast<int64_t>(g.rows.size());
        g.aux_c = Mat::Zero(T, E);
        for (int64_t t = 0; t < T; ++t) {
          const int64_t sample = g.rows[static_cast<size_t>(t)] % d.n - q * layout.b;
          g.aux_c.row(t) = aux_scale * counts.transpose() + seq_scale * sample_counts.row(sample);
        }
      }
    }
    global_counts += counts;
  }
  // global_aux_loss: the micro-batch's counts over the whole batch (this slice is all of it)
  // join Megatron's float32 tracker of the step, which gives their mean over the step's
  // micro-batches so far; coeff E / (k T_g^2), T_g = s B.
  if (global_coeff > 0 && d.n > 0) {
    if (p.global_aux == nullptr || d.n != d.B) {
      throw std::logic_error("MoeForward: global_aux_loss without its tracker or the whole batch");
    }
    MoeParams::GlobalAuxTracker& tracker = *p.global_aux;
    tracker.steps += 1.0f;
    Vec average(E);
    for (int64_t e = 0; e < E; ++e) {
      tracker.tokens[static_cast<size_t>(e)] += static_cast<float>(global_counts(e));
      average(e) = static_cast<double>(tracker.tokens[static_cast<size_t>(e)] / tracker.steps);
    }
    const auto T_g = static_cast<double>(d.s * d.B);
    const double scale =
        per_dp * global_coeff * static_cast<double>(E) / (static_cast<double>(k) * T_g * T_g);
    for (MoeStash::Group& g : st.groups) {
      const auto T = static_cast<int64_t>(g.rows.size());
      if (g.aux_c.rows() != T) g.aux_c = Mat::Zero(T, E);
      g.aux_c.rowwise() += scale * average.transpose();
    }
  }
  // The objective: each token's load-balancing scores weighted by its coefficients.
  for (const MoeStash::Group& g : st.groups) {
    if (g.aux_c.rows() == 0) continue;
    *aux_objective += ((sigmoid ? g.aux_scores : g.scores).array() * g.aux_c.array()).sum();
  }
  // The experts, each on its kept tokens in slice-row order.
  for (size_t gi = 0; gi < st.groups.size(); ++gi) {
    const MoeStash::Group& g = st.groups[gi];
    for (size_t t = 0; t < g.rows.size(); ++t) {
      for (int64_t s = 0; s < k; ++s) {
        if (!g.kept[t][static_cast<size_t>(s)]) continue;
        if (p.tokens_per_expert != nullptr) {
          (*p.tokens_per_expert)[static_cast<size_t>(g.chosen[t][static_cast<size_t>(s)])] += 1;
        }
        MoeStash::Expert& ex = st.experts[static_cast<size_t>(g.chosen[t][static_cast<size_t>(s)])];
        ex.rows.push_back(g.rows[t]);
        ex.group.push_back(static_cast<int64_t>(gi));
        ex.token.push_back(static_cast<int64_t>(t));
        ex.slot.push_back(s);
      }
    }
  }
  Mat y = Mat::Zero(x.rows(), x.cols());
  for (int64_t e = 0; e < E; ++e) {
    MoeStash::Expert& ex = st.experts[static_cast<size_t>(e)];
    if (ex.rows.empty()) continue;
    // Sorted by slice row (the combine adds per token, so the order only fixes the stash).
    std::vector<size_t> order(ex.rows.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ex.rows[a] < ex.rows[b]; });
    MoeStash::Expert sorted;
    for (size_t i : order) {
      sorted.rows.push_back(ex.rows[i]);
      sorted.group.push_back(ex.group[i]);
      sorted.token.push_back(ex.token[i]);
      sorted.slot.push_back(ex.slot[i]);
    }
    ex = std::move(sorted);
    Vec scale(static_cast<int64_t>(ex.rows.size()));
    for (size_t i = 0; i < ex.rows.size(); ++i) {
      const MoeStash::Group& g = st.groups[static_cast<size_t>(ex.group[i])];
      scale(static_cast<int64_t>(i)) = g.p[static_cast<size_t>(ex.token[i])][static_cast<size_t>(ex.slot[i])];
    }
    const Mat out = Mlp(gpt.activation, gpt.Glu(), Gather(x, ex.rows),
                        p.fc1[static_cast<size_t>(e)], p.fc2[static_cast<size_t>(e)], &scale,
                        &ex.fc1, &ex.act, BiasOf(p.fc1_bias, e), BiasOf(p.fc2_bias, e));
    for (size_t i = 0; i < ex.rows.size(); ++i) y.row(ex.rows[i]) += out.row(static_cast<int64_t>(i));
  }
  if (p.shared_fc1.defined()) {
    y += Mlp(gpt.activation, gpt.Glu(), x, p.shared_fc1, p.shared_fc2, nullptr, &st.shared_fc1,
             &st.shared_act);
  }
  return y;
}

Mat MoeBackward(const Dims& d, const GptConfig& gpt, const Mat& dy, const MoeStash& st,
                MoeParams& p) {
  (void)d;
  const MoeConfig& moe = gpt.moe;
  const int64_t E = moe.num_experts, k = moe.router_topk;
  const bool sigmoid = moe.PerLogitScores();  // sigmoid or sqrtsoftplus: g.sig
  const double scaling = moe.topk_scaling_factor.value_or(1.0);
  Mat dx = Mat::Zero(dy.rows(), dy.cols());
  if (p.shared_fc1.defined()) {
    Param no_bias;
    dx += MlpBackward(gpt.activation, gpt.Glu(), dy, st.x, st.shared_fc1, st.shared_act,
                      p.shared_fc1, p.shared_fc2, nullptr, nullptr, no_bias, no_bias);
  }
  // d p[group][token][slot] from the experts.
  std::vector<std::vector<std::vector<double>>> dp(st.groups.size());
  for (size_t gi = 0; gi < st.groups.size(); ++gi) {
    dp[gi].assign(st.groups[gi].rows.size(), std::vector<double>(static_cast<size_t>(k), 0.0));
  }
  for (int64_t e = 0; e < E; ++e) {
    const MoeStash::Expert& ex = st.experts[static_cast<size_t>(e)];
    if (ex.rows.empty()) continue;
    Vec scale(static_cast<int64_t>(ex.rows.size()));
    for (size_t i = 0; i < ex.rows.size(); ++i) {
      scale(static_cast<int64_t>(i)) =
          st.groups[static_cast<size_t>(ex.group[i])].p[static_cast<size_t>(ex.token[i])][static_cast<size_t>(ex.slot[i])];
    }
    Vec dscale;
    Param b1 = BiasOf(p.fc1_bias, e), b2 = BiasOf(p.fc2_bias, e);
    const Mat dxe = MlpBackward(
        gpt.activation, gpt.Glu(), Gather(dy, ex.rows), Gather(st.x, ex.rows), ex.fc1, ex.act,
        p.fc1[static_cast<size_t>(e)], p.fc2[static_cast<size_t>(e)], &scale, &dscale, b1, b2);
    for (size_t i = 0; i < ex.rows.size(); ++i) {
      dx.row(ex.rows[i]) += dxe.row(static_cast<int64_t>(i));
      dp[static_cast<size_t>(ex.group[i])][static_cast<size_t>(ex.token[i])][static_cast<size_t>(ex.slot[i])] =
          dscale(static_cast<int64_t>(i));
    }
  }
  // The router: each token's probabilities, load-balancing and z terms into d logits.
  for (size_t gi = 0; gi < st.groups.size(); ++gi) {
    const MoeStash::Group& g = st.groups[gi];
    const auto T = static_cast<int64_t>(g.rows.size());
    Mat dz = Mat::Zero(T, E);
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<int64_t>& chosen = g.chosen[static_cast<size_t>(t)];
      // The probabilities before the scaling factor and their gradient.
      std::vector<double> pt = g.p[static_cast<size_t>(t)], dpt = dp[gi][static_cast<size_t>(t)];
      for (double& v : pt) v /= scaling;
      for (double& v : dpt) v *= scaling;
      double dot = 0;
      for (int64_t s = 0; s < k; ++s) dot += pt[static_cast<size_t>(s)] * dpt[static_cast<size_t>(s)];
      if (sigmoid) {
        // p = v / (sum v + eps) (k > 1), v the chosen sigmoids; then d sig into d z below.
        Vec dsig = Vec::Zero(E);
        double sum = 0;
        for (int64_t e : chosen) sum += g.sig(t, e);
        for (int64_t s = 0; s < k; ++s) {
          dsig(chosen[static_cast<size_t>(s)]) +=
              k > 1 ? (dpt[static_cast<size_t>(s)] - dot) / (sum + kSigmoidEps)
                    : dpt[static_cast<size_t>(s)];
        }
        if (g.aux_c.rows() == T) {
          // a = sig / (sum sig + eps): d sig = (c - c . a) / (sum sig + eps).
          const double all = g.sig.row(t).sum() + kSigmoidEps;
          const double mean_c = g.aux_scores.row(t).dot(g.aux_c.row(t));
          dsig += ((g.aux_c.row(t).array() - mean_c) / all).matrix().transpose();
        }
        for (int64_t e = 0; e < E; ++e) {
          dz(t, e) += dsig(e) * PerLogitScoreGrad(moe.score_function, g.logits(t, e));
        }
      } else if (moe.router_pre_softmax) {
        // p = softmax(Z)[chosen]: dZ_j = sm_j (dp_j - sum_s p_s dp_s), dp 0 off the chosen.
        for (int64_t j = 0; j < E; ++j) dz(t, j) -= g.scores(t, j) * dot;
        for (int64_t s = 0; s < k; ++s) {
          dz(t, chosen[static_cast<size_t>(s)]) += g.scores(t, chosen[static_cast<size_t>(s)]) * dpt[static_cast<size_t>(s)];
        }
      } else {
        // p = softmax over the chosen logits.
        for (int64_t s = 0; s < k; ++s) {
          dz(t, chosen[static_cast<size_t>(s)]) += pt[static_cast<size_t>(s)] * (dpt[static_cast<size_t>(s)] - dot);
        }
      }
      if (g.aux_c.rows() == T && !sigmoid) {
        // d/dZ of sum_i c_i softmax(Z)_i = sm (c - sm . c), c this token's coefficients.
        const double mean_c = g.scores.row(t).dot(g.aux_c.row(t));
        dz.row(t) += (g.scores.row(t).array() * (g.aux_c.row(t).array() - mean_c)).matrix();
      }
      if (g.z_scale != 0) dz.row(t) += 2 * g.z_scale * g.lse(t) * g.scores.row(t);
    }
    const Mat dxg = LinearBackward(dz, Gather(st.x, g.rows), p.router, p.router_bias);
    for (int64_t t = 0; t < T; ++t) dx.row(g.rows[static_cast<size_t>(t)]) += dxg.row(t);
  }
  return dx;
}

}  // namespace mpusim::gpt_reference
