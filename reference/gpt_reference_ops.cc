// The GPT reference's own ops (see gpt_reference_ops.h): linear on a layer's parameters, the
// norms, the dropout masks and attention, forward and backward.
#include "reference/gpt_reference_ops.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/dropout.h"

namespace mpusim::gpt_reference {

// ---- ops ----------------------------------------------------------------------------------
// The shared ops (reference/ops.h) on a layer's parameters, and the ops only this model has.

// y = x W^T (+ b).
Mat Linear(const Mat& x, const Param& weight, const Param& bias) {
  Mat y(x.rows(), weight.value.rows());
  ref::LinearForward(x, AsMat(weight.value), y);
  if (bias.defined()) ref::AddBias(AsRow(bias.value), y);
  return y;
}

// dx = dy W; dW += dy^T x; db += sum over rows of dy.
Mat LinearBackward(const Mat& dy, const Mat& x, Param& weight, Param& bias) {
  ref::LinearGradWeight(dy, x, AsMat(weight.grad));
  if (bias.defined()) ref::LinearGradBias(dy, AsRow(bias.grad));
  Mat dx(dy.rows(), weight.value.cols());
  ref::LinearGradInput(dy, AsMat(weight.value), dx);
  return dx;
}

// LayerNorm: xhat = (x - mean) * rstd, rstd = 1/sqrt(var + eps) (biased variance);
// RMSNorm:   xhat = x * rstd,          rstd = 1/sqrt(mean(x^2) + eps).
// y = xhat * w (+ b).
Mat NormForward(Normalization kind, double eps, const Mat& x, const NormParams& p,
                NormStash* stash) {
  const auto width = static_cast<double>(x.cols());
  stash->xhat.resize(x.rows(), x.cols());
  stash->rstd.resize(x.rows());
  for (int64_t row = 0; row < x.rows(); ++row) {
    if (kind == Normalization::kLayerNorm) {
      const RowVec centered = x.row(row).array() - x.row(row).mean();
      const double var = centered.squaredNorm() / width;
      stash->rstd(row) = 1.0 / std::sqrt(var + eps);
      stash->xhat.row(row) = centered * stash->rstd(row);
    } else {
      const double mean_square = x.row(row).squaredNorm() / width;
      stash->rstd(row) = 1.0 / std::sqrt(mean_square + eps);
      stash->xhat.row(row) = x.row(row) * stash->rstd(row);
    }
  }
  Mat y = stash->xhat.array().rowwise() * AsRow(p.weight.value).array();
  if (p.bias.defined()) y.rowwise() += AsRow(p.bias.value);
  return y;
}

// With dxhat = dy * w:
//   LayerNorm dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
//   RMSNorm   dx = rstd * (dxhat - xhat * mean(dxhat * xhat))
// dw += sum over rows of dy * xhat; db += sum over rows of dy.
Mat NormBackward(Normalization kind, const Mat& dy, const NormStash& stash, NormParams& p) {
  AsRow(p.weight.grad) += dy.cwiseProduct(stash.xhat).colwise().sum();
  if (p.bias.defined()) AsRow(p.bias.grad) += dy.colwise().sum();
  const Mat dxhat = dy.array().rowwise() * AsRow(p.weight.value).array();
  const auto width = static_cast<double>(dy.cols());
  Mat dx(dy.rows(), dy.cols());
  for (int64_t row = 0; row < dy.rows(); ++row) {
    const double mean_dot = dxhat.row(row).dot(stash.xhat.row(row)) / width;
    RowVec v = dxhat.row(row) - stash.xhat.row(row) * mean_dot;
    if (kind == Normalization::kLayerNorm) v.array() -= dxhat.row(row).mean();
    dx.row(row) = v * stash.rstd(row);
  }
  return dx;
}

// ---- dropout ------------------------------------------------------------------------------

namespace {

using ref::MaskDraw;

// What every element of `site`'s mask in micro-batch m shares, found once per mask: global
// mode, the site's stream; rng_tracker mode, the site's entry and its draw number.
struct SiteDraw {
  uint64_t stream = 0;
  const Dims::SiteDraw* at = nullptr;
  uint64_t n = 0;
};

SiteDraw SiteDrawOf(const Dims& d, const std::string& site, int64_t m) {
  if (!d.tracker) return {DropoutStream(site, d.iteration, m)};
  const Dims::SiteDraw& at = d.draw.at(site);
  const size_t stream = at.model_parallel ? 1 : 0;
  return {0, &at,
          static_cast<uint64_t>(d.draws.Position(d.iteration, at.pp, at.chunk, m, stream, at.k))};
}

// rng_tracker mode: the key and draw number of the site on the rank at (tp, dp) of the
// pipeline rank holding it.
MaskDraw TrackerDraw(const Dims& d, const SiteDraw& site, int64_t tp, int64_t dp,
                     int64_t local_index) {
  return {ref::TrackerKey(d.seed, site.at->pp, dp, site.at->model_parallel, tp), site.n,
          static_cast<uint64_t>(local_index)};
}

// Context parallelism: the index of position i among the s / cp tokens of the cp rank that
// holds it (Megatron's split: cp rank r holds chunks r and 2 cp - 1 - r of 2 cp, in that
// order); i itself when cp = 1.
int64_t CpLocal(const Dims& d, int64_t i) {
  if (d.cp == 1) return i;
  const int64_t c = d.s / (2 * d.cp);
  return i / c < d.cp ? i % c : c + i % c;
}

// Element (i, gs, c) of an [s, B, w] site. Global mode: full flat index (i*B + gs)*w + c.
// Tracker mode: the rank holding it (the sequence shard's tp rank under sequence parallelism,
// any tp rank otherwise: their default streams agree; any cp rank: they draw alike) and its
// index in that rank's [s_local, b, w] tensor.
MaskDraw HiddenDraw(const Dims& d, const SiteDraw& site, int64_t i, int64_t gs, int64_t c,
                    int64_t w) {
  if (!d.tracker) return {d.seed, site.stream, static_cast<uint64_t>((i * d.B + gs) * w + c)};
  const int64_t s_cp = d.s / d.cp;
  const ref::LocalElement at =
      ref::LocalActivationElement(CpLocal(d, i), gs, c, d.sp ? s_cp / d.t : s_cp, d.b, w);
  return TrackerDraw(d, site, at.seq_rank, at.dp_rank, at.index);
}

// Element (gs, hd, e) of the [B, a, s*s] attention site. Global mode: ((gs*a + hd)*s*s + e.
// Tracker mode: head hd lives on tp rank hd / (a/t), and query row e / s on the cp rank
// holding it, at local [b, a/t, s / cp, s] index; under cp_comm_type "a2a" on the cp rank
// holding the head, at local [b, a/(t cp), s, s] index.
MaskDraw ProbsDraw(const Dims& d, const SiteDraw& site, int64_t gs, int64_t hd, int64_t e) {
  if (!d.tracker) {
    return {d.seed, site.stream, static_cast<uint64_t>((gs * d.a + hd) * d.s * d.s + e)};
  }
  const int64_t heads_local = d.a / d.t;
  if (d.cp_heads) {
    const int64_t hc = heads_local / d.cp;
    return TrackerDraw(d, site, hd / heads_local, gs / d.b,
                       ((gs % d.b) * hc + hd % hc) * d.s * d.s + e);
  }
  const int64_t s_cp = d.s / d.cp;
  return TrackerDraw(
      d, site, hd / heads_local, gs / d.b,
      (((gs % d.b) * heads_local + hd % heads_local) * s_cp + CpLocal(d, e / d.s)) * d.s + e % d.s);
}

}  // namespace

// 0 or 1/(1-p) for this slice's rows of an [s, B, w] site: row i*n + j is position i of slice
// sample j.
Mat HiddenKeep(const Dims& d, const std::string& site, int64_t m, double p, int64_t w) {
  if (p == 0.0) return Mat::Ones(d.s * d.n, w);
  Mat keep(d.s * d.n, w);
  const SiteDraw draw = SiteDrawOf(d, site, m);
  ref::DropoutKeep(
      p,
      [&](int64_t row, int64_t c) {
        return HiddenDraw(d, draw, row / d.n, d.sample_begin + row % d.n, c, w);
      },
      keep);
  return keep;
}

// 0 or 1/(1-p) for the [s, s] probabilities of slice sample j, head hd of the [B, a, s, s]
// site: element (gs, hd, qi, ki) is full flat index ((gs*a + hd)*s + qi)*s + ki.
Mat AttentionKeep(const Dims& d, const std::string& site, int64_t m, double p, int64_t j,
                  int64_t hd) {
  if (p == 0.0) return Mat::Ones(d.s, d.s);
  Mat keep(d.s, d.s);
  const SiteDraw draw = SiteDrawOf(d, site, m);
  ref::DropoutKeep(
      p,
      [&](int64_t qi, int64_t ki) {
        return ProbsDraw(d, draw, d.sample_begin + j, hd, qi * d.s + ki);
      },
      keep);
  return keep;
}

namespace {

// ---- attention ----------------------------------------------------------------------------

// Megatron's fused QKV row order: per query group grp, its r query heads, its key head, its
// value head (dk rows each). Query head hd = grp*r + t.
int64_t QueryColumn(const Dims& d, int64_t hd) {
  return ((hd / d.r) * (d.r + 2) + hd % d.r) * d.dk;
}
int64_t KeyColumn(const Dims& d, int64_t grp) { return (grp * (d.r + 2) + d.r) * d.dk; }
int64_t ValueColumn(const Dims& d, int64_t grp) { return (grp * (d.r + 2) + d.r + 1) * d.dk; }

// The [s, dk] head of slice sample j at columns [col, col + dk) of an [s*n, w] activation.
Mat GatherHead(const Dims& d, const Mat& x, int64_t j, int64_t col) {
  Mat head(d.s, d.dk);
  for (int64_t i = 0; i < d.s; ++i) head.row(i) = x.block(i * d.n + j, col, 1, d.dk);
  return head;
}
void AddHead(const Dims& d, const Mat& head, int64_t j, int64_t col, Mat* x) {
  for (int64_t i = 0; i < d.s; ++i) x->block(i * d.n + j, col, 1, d.dk) += head.row(i);
}

// Non-interleaved RoPE (Megatron's rotate_half) of an [s, dk] head on its first rd channels
// (rd = int(dk * rotary_percent); the others pass through): row i is position i; channel
// c < rd/2 pairs with c + rd/2 and turns by theta = i * base^(-2c/rd):
//   y[c] = x[c] cos - x[c + rd/2] sin,  y[c + rd/2] = x[c + rd/2] cos + x[c] sin.
// sign -1 turns the other way: the transpose, for the backward.
void Rope(const Dims& d, double base, double sign, Mat* x) {
  const int64_t half = d.rd / 2;
  for (int64_t i = 0; i < d.s; ++i) {
    for (int64_t c = 0; c < half; ++c) {
      const double theta = static_cast<double>(i) * std::pow(base, -2.0 * static_cast<double>(c) /
                                                                       static_cast<double>(d.rd));
      const double cs = std::cos(theta), sn = sign * std::sin(theta);
      const double lo = (*x)(i, c), hi = (*x)(i, c + half);
      (*x)(i, c) = lo * cs - hi * sn;
      (*x)(i, c + half) = hi * cs + lo * sn;
    }
  }
}

}  // namespace

// context[i, j, hd*dk + c] = sum_ki dropout(softmax_ki(q_i . k_ki / sqrt(dk), ki <= i)) v_ki,
// with a sliding window only over i - window <= ki <= i.
Mat AttentionForward(const Dims& d, const GptConfig& gpt, const AttentionSoftmax& sm,
                     const Mat& qkv, const QkNormParams& qk_norm, const std::string& site,
                     int64_t m, AttentionStash* st) {
  const bool norm = qk_norm.defined();
  const bool rope = gpt.position_embedding_type == PositionEmbedding::kRope;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.dk));
  st->q.assign(static_cast<size_t>(d.n * d.a), Mat());
  st->k.assign(static_cast<size_t>(d.n * d.g), Mat());
  st->v.assign(static_cast<size_t>(d.n * d.g), Mat());
  st->q_norm.assign(norm ? static_cast<size_t>(d.n * d.a) : 0, NormStash());
  st->k_norm.assign(norm ? static_cast<size_t>(d.n * d.g) : 0, NormStash());
  st->probs.assign(static_cast<size_t>(d.n * d.a), Mat());
  st->keep.assign(static_cast<size_t>(d.n * d.a), Mat());
  st->sink.assign(static_cast<size_t>(d.n * d.a), Vec());
  const int64_t window = sm.window;
  Mat context(d.s * d.n, d.a * d.dk);
  for (int64_t j = 0; j < d.n; ++j) {
    for (int64_t grp = 0; grp < d.g; ++grp) {
      const auto kv = static_cast<size_t>(j * d.g + grp);
      st->k[kv] = GatherHead(d, qkv, j, KeyColumn(d, grp));
      st->v[kv] = GatherHead(d, qkv, j, ValueColumn(d, grp));
      if (norm) {
        st->k[kv] = NormForward(gpt.normalization, gpt.layernorm_epsilon, st->k[kv], qk_norm.k,
                                &st->k_norm[kv]);
      }
      if (rope) Rope(d, gpt.rotary_base, 1.0, &st->k[kv]);
    }
    for (int64_t hd = 0; hd < d.a; ++hd) {
      const auto qh = static_cast<size_t>(j * d.a + hd);
      const auto kv = static_cast<size_t>(j * d.g + hd / d.r);
      Mat& q = st->q[qh];
      q = GatherHead(d, qkv, j, QueryColumn(d, hd));
      if (norm) {
        q = NormForward(gpt.normalization, gpt.layernorm_epsilon, q, qk_norm.q, &st->q_norm[qh]);
      }
      if (rope) Rope(d, gpt.rotary_base, 1.0, &q);
      const Mat scores = (q * st->k[kv].transpose()) * scale;
      Mat& probs = st->probs[qh];
      probs = Mat::Zero(d.s, d.s);
      Vec& sink_prob = st->sink[qh];
      sink_prob = Vec::Zero(d.s);
      for (int64_t qi = 0; qi < d.s; ++qi) {
        const int64_t first = window < 0 ? 0 : std::max<int64_t>(0, qi - window);
        const int64_t seen = qi + 1 - first;  // keys first .. qi
        double max = scores.row(qi).segment(first, seen).maxCoeff();
        if (sm.has_sink()) max = std::max(max, sm.Sink(hd));
        double sum = 0.0;
        for (int64_t ki = first; ki <= qi; ++ki) {
          probs(qi, ki) = std::exp(scores(qi, ki) - max);
          sum += probs(qi, ki);
        }
        // The sink's term in the denominator only (Megatron's SoftmaxOne: softmax over the
        // row and the sink, the sink's column dropped).
        const double sink_term = sm.has_sink() ? std::exp(sm.Sink(hd) - max) : 0.0;
        sum += sink_term;
        probs.row(qi).segment(first, seen) /= sum;
        sink_prob(qi) = sink_term / sum;
      }
      st->keep[qh] = AttentionKeep(d, site, m, gpt.attention_dropout, j, hd);
      const Mat head = probs.cwiseProduct(st->keep[qh]) * st->v[kv];
      for (int64_t i = 0; i < d.s; ++i)
        context.block(i * d.n + j, hd * d.dk, 1, d.dk) = head.row(i);
    }
  }
  return context;
}

// Backward of AttentionForward, per (sample, head), with Pd = probs * keep:
//   dPd = dctx v^T;  dv += Pd^T dctx;  dprobs = dPd * keep;
//   dscores = probs * (dprobs - rowsum(dprobs * probs)) / sqrt(dk);
//   dq = dscores k;  dk += dscores^T q;  then RoPE's transpose on dq and dk, then the q/k
//   norms' backward.
// Returns d qkv [s*n, (a+2g)*dk]; `dprobs` gets the [n*a] matrices d loss / d probs.
Mat AttentionBackward(const Dims& d, const GptConfig& gpt, const Mat& dcontext,
                      const AttentionStash& st, QkNormParams& qk_norm, AttentionSoftmax& sm,
                      std::vector<Mat>* dprobs) {
  const bool norm = qk_norm.defined();
  const bool rope = gpt.position_embedding_type == PositionEmbedding::kRope;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.dk));
  Mat dqkv = Mat::Zero(d.s * d.n, d.qkv);
  dprobs->assign(static_cast<size_t>(d.n * d.a), Mat());
  for (int64_t j = 0; j < d.n; ++j) {
    std::vector<Mat> dk(static_cast<size_t>(d.g), Mat::Zero(d.s, d.dk));
    std::vector<Mat> dv(static_cast<size_t>(d.g), Mat::Zero(d.s, d.dk));
    for (int64_t hd = 0; hd < d.a; ++hd) {
      const auto qh = static_cast<size_t>(j * d.a + hd);
      const int64_t grp = hd / d.r;
      const auto kv = static_cast<size_t>(j * d.g + grp);
      const Mat dctx = GatherHead(d, dcontext, j, hd * d.dk);
      const Mat& probs = st.probs[qh];
      const Mat& keep = st.keep[qh];
      dv[static_cast<size_t>(grp)].noalias() += probs.cwiseProduct(keep).transpose() * dctx;
      Mat& dp = (*dprobs)[qh];
      dp = (dctx * st.v[kv].transpose()).cwiseProduct(keep);
      const Vec row_dot = dp.cwiseProduct(probs).rowwise().sum();
      // The sink is a logit whose probability p_o is left out: d o = sum_rows p_o (0 - dot).
      if (sm.sink.defined()) sm.sink.grad.data_as<double>()[hd] -= st.sink[qh].dot(row_dot);
      const Mat dscores = (probs.array() * (dp.colwise() - row_dot).array()).matrix() * scale;
      Mat dq = dscores * st.k[kv];
      dk[static_cast<size_t>(grp)].noalias() += dscores.transpose() * st.q[qh];
      if (rope) Rope(d, gpt.rotary_base, -1.0, &dq);
      if (norm) dq = NormBackward(gpt.normalization, dq, st.q_norm[qh], qk_norm.q);
      AddHead(d, dq, j, QueryColumn(d, hd), &dqkv);
    }
    for (int64_t grp = 0; grp < d.g; ++grp) {
      Mat& dkey = dk[static_cast<size_t>(grp)];
      if (rope) Rope(d, gpt.rotary_base, -1.0, &dkey);
      if (norm) {
        dkey = NormBackward(gpt.normalization, dkey,
                            st.k_norm[static_cast<size_t>(j * d.g + grp)], qk_norm.k);
      }
      AddHead(d, dkey, j, KeyColumn(d, grp), &dqkv);
      AddHead(d, dv[static_cast<size_t>(grp)], j, ValueColumn(d, grp), &dqkv);
    }
  }
  return dqkv;
}

}  // namespace mpusim::gpt_reference
