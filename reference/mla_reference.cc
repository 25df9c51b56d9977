// Multi-latent attention's float64 reference (see mla_reference.h): forward and backward by
// hand, per (sample, head), written from MLASelfAttention's math
// (megatron/core/transformer/multi_latent_attention.py,
// megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py, rope_utils.py).
#include "reference/mla_reference.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace mpusim::gpt_reference {
namespace {

// YaRN's _yarn_get_mscale: 0.1 * m * ln(f) + 1 for a scaling factor f > 1, else 1.
double YarnMscale(double f, double m) { return f <= 1.0 ? 1.0 : 0.1 * m * std::log(f) + 1.0; }

// YaRN's _yarn_find_correction_dim: the channel pair whose wavelength fits `rotations` turns
// into the original context.
double CorrectionDim(double rotations, double dim, double base, double original) {
  return dim * std::log(original / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
}

// The sample-j rows [s, w] at columns [col, col + w) of an [s*n, *] activation, and back.
Mat Gather(const Dims& d, const Mat& x, int64_t j, int64_t col, int64_t w) {
  Mat out(d.s, w);
  for (int64_t i = 0; i < d.s; ++i) out.row(i) = x.block(i * d.n + j, col, 1, w);
  return out;
}
void Scatter(const Dims& d, const Mat& head, int64_t j, int64_t col, Mat* x) {
  for (int64_t i = 0; i < d.s; ++i) x->block(i * d.n + j, col, 1, head.cols()) += head.row(i);
}

// R on an [s, pe] matrix (row i is position i): y[c] = (t[2c] cos - t[2c+1] sin) * ms,
// y[c + pe/2] = (t[2c+1] cos + t[2c] sin) * ms, angle i * inv_freq[c].
Mat RopeForward(const MlaRopeTable& rope, const Mat& t) {
  const int64_t half = t.cols() / 2;
  Mat y(t.rows(), t.cols());
  for (int64_t i = 0; i < t.rows(); ++i) {
    for (int64_t c = 0; c < half; ++c) {
      const double theta = static_cast<double>(i) * rope.inv_freq[static_cast<size_t>(c)];
      const double cs = std::cos(theta) * rope.mscale, sn = std::sin(theta) * rope.mscale;
      const double even = t(i, 2 * c), odd = t(i, 2 * c + 1);
      y(i, c) = even * cs - odd * sn;
      y(i, c + half) = odd * cs + even * sn;
    }
  }
  return y;
}

// R's transpose: d t from d y.
Mat RopeBackward(const MlaRopeTable& rope, const Mat& dy) {
  const int64_t half = dy.cols() / 2;
  Mat dt(dy.rows(), dy.cols());
  for (int64_t i = 0; i < dy.rows(); ++i) {
    for (int64_t c = 0; c < half; ++c) {
      const double theta = static_cast<double>(i) * rope.inv_freq[static_cast<size_t>(c)];
      const double cs = std::cos(theta) * rope.mscale, sn = std::sin(theta) * rope.mscale;
      const double lo = dy(i, c), hi = dy(i, c + half);
      dt(i, 2 * c) = lo * cs + hi * sn;
      dt(i, 2 * c + 1) = hi * cs - lo * sn;
    }
  }
  return dt;
}

}  // namespace

// rope_type "rope": RotaryEmbedding's inv_freq[c] = base^(-2c/pe). "yarn": between the
// interpolated base^(-2c/pe) / f and the extrapolated base^(-2c/pe), by YaRN's linear ramp
// over the channel pairs [low, high] that the beta_fast / beta_slow rotations bound; cos and
// sin scaled by mscale(f, mscale) / mscale(f, mscale_all_dim).
MlaRopeTable MlaRope(const GptConfig& gpt) {
  const MlaConfig& mla = gpt.mla;
  const int64_t dim = mla.qk_pos_emb_head_dim;
  const auto fdim = static_cast<double>(dim);
  MlaRopeTable rope;
  rope.inv_freq.resize(static_cast<size_t>(dim / 2));
  if (mla.rope_type == MlaRopeType::kRope) {
    for (int64_t c = 0; c < dim / 2; ++c) {
      rope.inv_freq[static_cast<size_t>(c)] =
          1.0 / std::pow(gpt.rotary_base, 2.0 * static_cast<double>(c) / fdim);
    }
    return rope;
  }
  const auto original = static_cast<double>(mla.original_max_position_embeddings);
  double low = std::floor(CorrectionDim(mla.beta_fast, fdim, gpt.rotary_base, original));
  double high = std::ceil(CorrectionDim(mla.beta_slow, fdim, gpt.rotary_base, original));
  low = std::max(low, 0.0);
  high = std::min(high, fdim - 1.0);
  if (low == high) high += 0.001;  // YaRN's guard against a zero-width ramp
  for (int64_t c = 0; c < dim / 2; ++c) {
    const double extra = 1.0 / std::pow(gpt.rotary_base, 2.0 * static_cast<double>(c) / fdim);
    const double inter = extra / mla.rotary_scaling_factor;
    const double ramp = std::clamp((static_cast<double>(c) - low) / (high - low), 0.0, 1.0);
    const double mask = 1.0 - ramp;  // 1: extrapolated (high frequencies), 0: interpolated
    rope.inv_freq[static_cast<size_t>(c)] = inter * (1.0 - mask) + extra * mask;
  }
  rope.mscale = YarnMscale(mla.rotary_scaling_factor, mla.mscale) /
                YarnMscale(mla.rotary_scaling_factor, mla.mscale_all_dim);
  return rope;
}

double MlaSoftmaxScale(const GptConfig& gpt) {
  const double m = YarnMscale(gpt.mla.rotary_scaling_factor, gpt.mla.mscale_all_dim);
  return m * m / std::sqrt(static_cast<double>(gpt.mla.QHeadDim()));
}

Mat MlaForward(const Dims& d, const GptConfig& gpt, const Mat& x, const MlaParams& p,
               const std::string& site, int64_t m, MlaStash* st) {
  const MlaConfig& mla = gpt.mla;
  const int64_t qk = mla.qk_head_dim, pe = mla.qk_pos_emb_head_dim, dv = mla.v_head_dim;
  const int64_t dq = qk + pe, kl = mla.kv_lora_rank;
  const MlaRopeTable rope = MlaRope(gpt);
  const double scale = MlaSoftmaxScale(gpt);
  Mat q;
  if (p.q_down.defined()) {
    st->q_in = Linear(x, p.q_down, Param{});
    if (p.q_norm.weight.defined()) {
      st->q_in =
          NormForward(gpt.normalization, gpt.layernorm_epsilon, st->q_in, p.q_norm, &st->q_norm);
    }
    q = Linear(st->q_in, p.q_up, Param{});
  } else {
    st->q_in = x;
    q = Linear(x, p.q_proj, Param{});
  }
  const Mat c = Linear(x, p.kv_down, Param{});
  st->kv_in = c.leftCols(kl);
  if (p.kv_norm.weight.defined()) {
    st->kv_in =
        NormForward(gpt.normalization, gpt.layernorm_epsilon, st->kv_in, p.kv_norm, &st->kv_norm);
  }
  const Mat kv = Linear(st->kv_in, p.kv_up, Param{});
  const auto heads = static_cast<size_t>(d.n * d.a);
  st->query.assign(heads, Mat());
  st->key.assign(heads, Mat());
  st->value.assign(heads, Mat());
  st->probs.assign(heads, Mat());
  st->keep.assign(heads, Mat());
  Mat context = Mat::Zero(d.s * d.n, d.a * dv);
  for (int64_t j = 0; j < d.n; ++j) {
    const Mat k_pe = RopeForward(rope, Gather(d, c, j, kl, pe));  // shared by the heads
    for (int64_t hd = 0; hd < d.a; ++hd) {
      const auto h = static_cast<size_t>(j * d.a + hd);
      Mat& query = st->query[h];
      query.resize(d.s, dq);
      query.leftCols(qk) = Gather(d, q, j, hd * dq, qk);
      query.rightCols(pe) = RopeForward(rope, Gather(d, q, j, hd * dq + qk, pe));
      Mat& key = st->key[h];
      key.resize(d.s, dq);
      key.leftCols(qk) = Gather(d, kv, j, hd * (qk + dv), qk);
      key.rightCols(pe) = k_pe;
      st->value[h] = Gather(d, kv, j, hd * (qk + dv) + qk, dv);
      const Mat scores = (query * key.transpose()) * scale;
      Mat& probs = st->probs[h];
      probs = Mat::Zero(d.s, d.s);
      for (int64_t qi = 0; qi < d.s; ++qi) {
        const double max = scores.row(qi).head(qi + 1).maxCoeff();
        double sum = 0.0;
        for (int64_t ki = 0; ki <= qi; ++ki) {
          probs(qi, ki) = std::exp(scores(qi, ki) - max);
          sum += probs(qi, ki);
        }
        probs.row(qi).head(qi + 1) /= sum;
      }
      st->keep[h] = AttentionKeep(d, site, m, gpt.attention_dropout, j, hd);
      Scatter(d, probs.cwiseProduct(st->keep[h]) * st->value[h], j, hd * dv, &context);
    }
  }
  return context;
}

// Per (sample, head), with Pd = probs * keep:
//   dvalue = Pd^T dctx;  dprobs = (dctx value^T) * keep;
//   dscores = probs * (dprobs - rowsum(dprobs * probs)) * softmax_scale;
//   dquery = dscores key;  dkey = dscores^T query;
// then R's transpose on the rope channels (k_pe's summed over the heads first), and the
// projections and norms back to x (both paths add into dx).
Mat MlaBackward(const Dims& d, const GptConfig& gpt, const Mat& x, const Mat& dcontext,
                const MlaStash& st, MlaParams& p, std::vector<Mat>* dprobs) {
  const MlaConfig& mla = gpt.mla;
  const int64_t qk = mla.qk_head_dim, pe = mla.qk_pos_emb_head_dim, dv = mla.v_head_dim;
  const int64_t dq = qk + pe, kl = mla.kv_lora_rank;
  const MlaRopeTable rope = MlaRope(gpt);
  const double scale = MlaSoftmaxScale(gpt);
  const int64_t rows = d.s * d.n;
  Mat dq_all = Mat::Zero(rows, d.a * dq);
  Mat dkv = Mat::Zero(rows, d.a * (qk + dv));
  Mat dc = Mat::Zero(rows, kl + pe);
  dprobs->assign(static_cast<size_t>(d.n * d.a), Mat());
  for (int64_t j = 0; j < d.n; ++j) {
    Mat dk_pe = Mat::Zero(d.s, pe);
    for (int64_t hd = 0; hd < d.a; ++hd) {
      const auto h = static_cast<size_t>(j * d.a + hd);
      const Mat dctx = Gather(d, dcontext, j, hd * dv, dv);
      const Mat& probs = st.probs[h];
      const Mat& keep = st.keep[h];
      Scatter(d, probs.cwiseProduct(keep).transpose() * dctx, j, hd * (qk + dv) + qk, &dkv);
      Mat& dp = (*dprobs)[h];
      dp = (dctx * st.value[h].transpose()).cwiseProduct(keep);
      const Vec row_dot = dp.cwiseProduct(probs).rowwise().sum();
      const Mat dscores = (probs.array() * (dp.colwise() - row_dot).array()).matrix() * scale;
      const Mat dquery = dscores * st.key[h];
      const Mat dkey = dscores.transpose() * st.query[h];
      Scatter(d, dquery.leftCols(qk), j, hd * dq, &dq_all);
      Scatter(d, RopeBackward(rope, dquery.rightCols(pe)), j, hd * dq + qk, &dq_all);
      Scatter(d, dkey.leftCols(qk), j, hd * (qk + dv), &dkv);
      dk_pe += dkey.rightCols(pe);
    }
    Scatter(d, RopeBackward(rope, dk_pe), j, kl, &dc);
  }
  Param no_bias;
  Mat dkv_in = LinearBackward(dkv, st.kv_in, p.kv_up, no_bias);
  if (p.kv_norm.weight.defined()) {
    dkv_in = NormBackward(gpt.normalization, dkv_in, st.kv_norm, p.kv_norm);
  }
  dc.leftCols(kl) += dkv_in;
  Mat dx = LinearBackward(dc, x, p.kv_down, no_bias);
  if (p.q_down.defined()) {
    Mat dq_in = LinearBackward(dq_all, st.q_in, p.q_up, no_bias);
    if (p.q_norm.weight.defined()) {
      dq_in = NormBackward(gpt.normalization, dq_in, st.q_norm, p.q_norm);
    }
    dx += LinearBackward(dq_in, x, p.q_down, no_bias);
  } else {
    dx += LinearBackward(dq_all, x, p.q_proj, no_bias);
  }
  return dx;
}

}  // namespace mpusim::gpt_reference
