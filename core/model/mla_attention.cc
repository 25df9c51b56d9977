// Multi-latent attention (see mla_attention.h), written from MLASelfAttention
// (megatron/core/transformer/multi_latent_attention.py), YarnRotaryEmbedding
// (megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py) and rope_utils.py's
// _apply_rotary_pos_emb_bshd with mla_rotary_interleaved.
#include "core/model/mla_attention.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/tensor_parallel/mappings.h"

namespace mpusim {
namespace {

// _yarn_get_mscale: 0.1 m ln(f) + 1 for a scaling factor f > 1, else 1.
double YarnGetMscale(double f, double m) { return f <= 1.0 ? 1.0 : 0.1 * m * std::log(f) + 1.0; }

// _yarn_find_correction_dim.
double YarnCorrectionDim(double rotations, double dim, double base, double original) {
  return dim * std::log(original / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
}

}  // namespace

// rope_type "rope": RotaryEmbedding's base^(-2c/pe). "yarn": YarnRotaryEmbedding.forward's
// inv_freq_extrapolation * mask + inv_freq_interpolation * (1 - mask), the mask 1 - the
// linear ramp over [low, high] (_yarn_find_correction_range, clamped to [0, pe - 1]), and
// mscale = _yarn_get_mscale(f, mscale) / _yarn_get_mscale(f, mscale_all_dim).
MlaRopeFrequencies MlaRopeOf(const GptConfig& gpt) {
  const MlaConfig& mla = gpt.mla;
  const int64_t pairs = mla.qk_pos_emb_head_dim / 2;
  const auto dim = static_cast<double>(mla.qk_pos_emb_head_dim);
  MlaRopeFrequencies rope;
  for (int64_t c = 0; c < pairs; ++c) {
    rope.inv_freq.push_back(std::pow(gpt.rotary_base, -2.0 * static_cast<double>(c) / dim));
  }
  if (mla.rope_type == MlaRopeType::kRope) return rope;
  const auto original = static_cast<double>(mla.original_max_position_embeddings);
  const double low =
      std::max(std::floor(YarnCorrectionDim(mla.beta_fast, dim, gpt.rotary_base, original)), 0.0);
  double high = std::min(
      std::ceil(YarnCorrectionDim(mla.beta_slow, dim, gpt.rotary_base, original)), dim - 1.0);
  if (low == high) high += 0.001;  // _yarn_linear_ramp_mask's guard
  for (int64_t c = 0; c < pairs; ++c) {
    double& f = rope.inv_freq[static_cast<size_t>(c)];
    const double ramp = std::clamp((static_cast<double>(c) - low) / (high - low), 0.0, 1.0);
    const double extrapolate = 1.0 - ramp;
    f = f / mla.rotary_scaling_factor * (1.0 - extrapolate) + f * extrapolate;
  }
  rope.mscale = YarnGetMscale(mla.rotary_scaling_factor, mla.mscale) /
                YarnGetMscale(mla.rotary_scaling_factor, mla.mscale_all_dim);
  return rope;
}

// MultiLatentAttention.__init__: 1 / sqrt(q_head_dim), times mscale^2 with
// mscale = _yarn_get_mscale(rotary_scaling_factor, mscale_all_dim) (for either rope_type).
double MlaSoftmaxScaleOf(const GptConfig& gpt) {
  const double m = YarnGetMscale(gpt.mla.rotary_scaling_factor, gpt.mla.mscale_all_dim);
  return m * m / std::sqrt(static_cast<double>(gpt.mla.QHeadDim()));
}

CoreAttention::Dims MlaSelfAttention::CoreDims(const GptConfig& gpt) {
  CoreAttention::Dims dims;
  dims.a = dims.g = gpt.num_attention_heads;  // a key and a value head per query head
  dims.dq = gpt.QueryKeyHeadDim();
  dims.dv = gpt.ValueHeadDim();
  dims.scale = MlaSoftmaxScaleOf(gpt);
  return dims;
}

MlaSelfAttention::MlaSelfAttention(const GptConfig& gpt, std::string prefix, ParameterSet& params,
                                   int64_t t)
    : prefix_(std::move(prefix)),
      a_l_(gpt.num_attention_heads / t),
      qk_(gpt.mla.qk_head_dim),
      pe_(gpt.mla.qk_pos_emb_head_dim),
      dv_(gpt.mla.v_head_dim),
      ql_(gpt.mla.q_lora_rank.value_or(0)),
      kl_(gpt.mla.kv_lora_rank),
      rope_(MlaRopeOf(gpt)),
      core_(gpt, prefix_, CoreDims(gpt), -1, nullptr, t),
      kv_down_(&params.Get(prefix_ + ".linear_kv_down_proj.weight"), nullptr),
      kv_up_(&params.Get(prefix_ + ".linear_kv_up_proj.weight"), nullptr),
      proj_(&params.Get(prefix_ + ".linear_proj.weight")),
      proj_bias_(params.Find(prefix_ + ".linear_proj.bias")) {
  const auto norm = [&](const std::string& name) {
    return Norm(gpt.normalization, gpt.layernorm_epsilon, &params.Get(name + ".weight"),
                params.Find(name + ".bias"));
  };
  if (gpt.mla.q_lora_rank) {
    q_down_.emplace(&params.Get(prefix_ + ".linear_q_down_proj.weight"), nullptr);
    q_up_.emplace(&params.Get(prefix_ + ".linear_q_up_proj.weight"), nullptr);
    if (gpt.qk_layernorm) q_norm_ = norm(prefix_ + ".q_layernorm");
  } else {
    q_proj_.emplace(&params.Get(prefix_ + ".linear_q_proj.weight"), nullptr);
  }
  if (gpt.qk_layernorm) kv_norm_ = norm(prefix_ + ".kv_layernorm");
}

// y = M_p x for a pe-vector x of position p (this rank's token l at sequence position p):
// M_p[c][2c] = M_p[c + pe/2][2c + 1] = cos * ms, M_p[c][2c + 1] = -sin * ms, M_p[c + pe/2][2c] =
// sin * ms (angle p inv_freq[c]): the de-interleave and rotate_half of _apply_rotary_pos_emb_bshd,
// cos and sin rounded to the dtype as Megatron's .to(t.dtype) does.
Tensor MlaSelfAttention::RopeMatrices(const ModuleContext& ctx, DType dtype) const {
  const int64_t s = ctx.shape.s_cp(), pe = pe_, half = pe_ / 2;
  Tensor host = Tensor::HostZeros({s, pe, pe}, dtype);
  for (int64_t l = 0; l < s; ++l) {
    const int64_t m = l * pe * pe, p = ctx.shape.Position(l);
    for (int64_t c = 0; c < half; ++c) {
      const double theta = static_cast<double>(p) * rope_.inv_freq[static_cast<size_t>(c)];
      const double cs = std::cos(theta) * rope_.mscale, sn = std::sin(theta) * rope_.mscale;
      SetHostValue(host, m + c * pe + 2 * c, cs);
      SetHostValue(host, m + c * pe + 2 * c + 1, -sn);
      SetHostValue(host, m + (c + half) * pe + 2 * c + 1, cs);
      SetHostValue(host, m + (c + half) * pe + 2 * c, sn);
    }
  }
  return ctx.k.ToDevice(host);
}

Tensor MlaSelfAttention::Forward(const ModuleContext& ctx, const Tensor& x, bool keep_core,
                                 Stash* stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t s = sh.s_cp(), b = sh.b, R = s * b, al = a_l_, qk = qk_, pe = pe_, dv = dv_;
  const int64_t dq = qk + pe, wkv = qk + dv;
  const DType dtype = x.dtype();
  stash->x = x;
  stash->query = k.Empty({b * al * s, dq}, dtype);
  stash->key = k.Empty({b * al * s, dq}, dtype);
  stash->value = k.Empty({b * al * s, dv}, dtype);
  {  // query, key, value from x; the projections' outputs freed after
    // The query: [R, a_l*dq].
    Tensor q;
    if (q_down_) {
      ColumnParallelLinear::Stash unused;
      Tensor latent = AllGatherLastDim(k, ctx.tp, q_down_->Forward(ctx, x, &unused));
      if (sh.sequence_parallel) latent = SplitFirstDim(k, ctx.tp, latent);
      stash->q_latent = latent;
      const Tensor normed = q_norm_ ? q_norm_->Forward(ctx, latent, &stash->q_norm) : latent;
      q = q_up_->Forward(ctx, normed, &stash->q_up_in);
    } else {
      ColumnParallelLinear::Stash unused;
      q = q_proj_->Forward(ctx, x, &unused);
    }
    // The keys' latent and rope channels: [R, kl + pe] on every rank.
    ColumnParallelLinear::Stash unused;
    const Tensor compressed = AllGatherLastDim(k, ctx.tp, kv_down_.Forward(ctx, x, &unused));
    Tensor latent = k.Empty({R, kl_}, dtype);
    k.CopyBlock(compressed, 0, 0, latent, 0, 0, R, kl_);
    Tensor k_pe = k.Empty({s, b, pe}, dtype);
    k.CopyBlock(compressed, 0, kl_, k_pe, 0, 0, R, pe);
    if (sh.sequence_parallel) latent = SplitFirstDim(k, ctx.tp, latent);
    stash->kv_latent = latent;
    const Tensor normed = kv_norm_ ? kv_norm_->Forward(ctx, latent, &stash->kv_norm) : latent;
    const Tensor kv = kv_up_.Forward(ctx, normed, &stash->kv_up_in);
    // Rope on q_pe [s, b*a_l, pe] and k_pe [s, b, pe], a batch of positions.
    const Tensor rope = RopeMatrices(ctx, dtype);
    Tensor q_pe = k.Empty({s, b * al, pe}, dtype);
    k.StridedCopy(q, qk, {s, b * al, pe}, {b * al * dq, dq, 1}, q_pe, 0, {b * al * pe, pe, 1});
    Tensor q_rot = k.Empty({s, b * al, pe}, dtype);
    k.BatchedGemm(false, true, 1.0, q_pe, rope, 0.0, q_rot);
    Tensor k_rot = k.Empty({s, b, pe}, dtype);
    k.BatchedGemm(false, true, 1.0, k_pe, rope, 0.0, k_rot);
    // query, key [b, a_l, s, dq] and value [b, a_l, s, dv], contiguous per (sample, head).
    const auto to_heads = [&](const Tensor& src, int64_t src_offset,
                              std::vector<int64_t> src_strides, int64_t w, Tensor& dst,
                              int64_t dst_offset, int64_t dst_w) {
      k.StridedCopy(src, src_offset, {b, al, s, w}, std::move(src_strides), dst, dst_offset,
                    {al * s * dst_w, s * dst_w, dst_w, 1});
    };
    to_heads(q, 0, {al * dq, dq, b * al * dq, 1}, qk, stash->query, 0, dq);
    to_heads(q_rot, 0, {al * pe, pe, b * al * pe, 1}, pe, stash->query, qk, dq);
    to_heads(kv, 0, {al * wkv, wkv, b * al * wkv, 1}, qk, stash->key, 0, dq);
    to_heads(k_rot, 0, {pe, 0, b * pe, 1}, pe, stash->key, qk, dq);  // shared by the heads
    to_heads(kv, qk, {al * wkv, wkv, b * al * wkv, 1}, dv, stash->value, 0, dv);
  }
  CoreAttention::Stash core;
  const Tensor columns = core_.Forward(ctx, stash->query, stash->key, stash->value, &core);
  if (keep_core) stash->core = std::move(core);
  const Tensor out = proj_.Forward(ctx, columns, &stash->proj_in);
  ctx.Record(prefix_ + ".linear_proj.output", out, {sh.s, sh.B, out.cols()},
             sh.StreamSpec(ctx.dp_size));
  return out;
}

StashPlan MlaSelfAttention::PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                                      bool keep_core) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  const MlaConfig& mla = gpt.mla;
  const double Rl = d(shape.stream_rows()), R = d(shape.s_cp() * shape.b);
  const double al = d(gpt.num_attention_heads) / d(shape.t);
  const double dq = d(mla.QHeadDim()), dv = d(mla.v_head_dim), kl = d(mla.kv_lora_rank);
  StashPlan plan;
  plan.Add("x", {Rl, d(gpt.hidden_size)}, dtype);  // the input norm's output
  if (mla.q_lora_rank) {
    const double ql = d(*mla.q_lora_rank);
    plan.Add("q_latent", {Rl, ql}, dtype);
    if (gpt.qk_layernorm) {
      plan.Add("q_norm", Norm::PlanStash(gpt.normalization, Rl, dtype));
      plan.Add("q_up_in.input", {Rl, ql}, dtype);  // q_layernorm's output
    }
  }
  plan.Add("kv_latent", {Rl, kl}, dtype);
  if (gpt.qk_layernorm) {
    plan.Add("kv_norm", Norm::PlanStash(gpt.normalization, Rl, dtype));
    plan.Add("kv_up_in.input", {Rl, kl}, dtype);  // kv_layernorm's output
  }
  plan.Add("query", {R * al, dq}, dtype);
  plan.Add("key", {R * al, dq}, dtype);
  plan.Add("value", {R * al, dv}, dtype);
  // Core attention's: what its exchange makes beyond query, key and value (which it keeps).
  if (keep_core) plan.Add("core", CoreAttention::PlanStash(gpt, CoreDims(gpt), shape, dtype, true));
  plan.Add("proj_in.input", {R, al * dv}, dtype);
  return plan;
}

// In three phases, each one's temporaries freed at its end (activation_plan.cc counts them):
// core attention back to dquery, dkey, dvalue; those to the up projections' output gradients
// dq [R, a_l*dq], dkv [R, a_l*(qk + dv)] and k_pe's [R, pe]; then the key side and the query
// side back to x.
Tensor MlaSelfAttention::Backward(const ModuleContext& ctx, const Tensor& dy, Stash& stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = ctx.shape;
  const int64_t s = sh.s_cp(), b = sh.b, R = s * b, al = a_l_, qk = qk_, pe = pe_, dv = dv_;
  const int64_t dq = qk + pe, wkv = qk + dv;
  const DType dtype = dy.dtype();
  ctx.Record(prefix_ + ".linear_proj.output_grad", dy, {sh.s, sh.B, dy.cols()},
             sh.StreamSpec(ctx.dp_size));
  Tensor dquery, dkey, dvalue;  // [b*a_l*s, dq], [b*a_l*s, dq], [b*a_l*s, dv]
  {
    const Tensor dcolumns = proj_.Backward(ctx, dy, stash.proj_in);
    if (!stash.core) {
      // Selective recomputation: the probabilities again from query and key (no records).
      const RecomputeScope scope(ctx);
      CoreAttention::Stash core;
      core_.Recompute(scope.quiet, stash.query, stash.key, stash.value, &core);
      stash.core = std::move(core);
    }
    CoreAttention::Grads grads = core_.Backward(ctx, dcolumns, *stash.core);
    dquery = std::move(grads.dq);
    dkey = std::move(grads.dk);
    dvalue = std::move(grads.dv);
  }
  // Back to the projections' column layouts; R's transpose on the rope channels (x = M^T y).
  const auto from_heads = [&](const Tensor& src, int64_t src_offset, int64_t src_w, int64_t w,
                              Tensor& dst, int64_t dst_offset, std::vector<int64_t> dst_strides) {
    k.StridedCopy(src, src_offset, {b, al, s, w}, {al * s * src_w, s * src_w, src_w, 1}, dst,
                  dst_offset, std::move(dst_strides));
  };
  Tensor dq_cols = k.Empty({R, al * dq}, dtype);
  Tensor dkv = k.Empty({R, al * wkv}, dtype);
  Tensor dk_pe = k.Empty({s, b, pe}, dtype);
  {
    const Tensor rope = RopeMatrices(ctx, dtype);
    from_heads(dquery, 0, dq, qk, dq_cols, 0, {al * dq, dq, b * al * dq, 1});
    Tensor rotated = k.Empty({s, b * al, pe}, dtype);
    from_heads(dquery, qk, dq, pe, rotated, 0, {al * pe, pe, b * al * pe, 1});
    dquery = Tensor();
    Tensor turned = k.Empty({s, b * al, pe}, dtype);
    k.BatchedGemm(false, false, 1.0, rotated, rope, 0.0, turned);
    k.StridedCopy(turned, 0, {s, b * al, pe}, {b * al * pe, pe, 1}, dq_cols, qk,
                  {b * al * dq, dq, 1});
    from_heads(dkey, 0, dq, qk, dkv, 0, {al * wkv, wkv, b * al * wkv, 1});
    from_heads(dvalue, 0, dv, dv, dkv, qk, {al * wkv, wkv, b * al * wkv, 1});
    dvalue = Tensor();
    // k_pe's: summed over this rank's heads ([a_l, R*pe] rows), turned back.
    Tensor per_head = k.Empty({al, R * pe}, dtype);
    from_heads(dkey, qk, dq, pe, per_head, 0, {pe, R * pe, b * pe, 1});
    dkey = Tensor();
    Tensor summed = k.Empty({s, b, pe}, dtype);
    k.SumRows(per_head, 0.0, summed);
    k.BatchedGemm(false, false, 1.0, summed, rope, 0.0, dk_pe);
  }
  // Every tp rank's heads' part of k_pe's gradient (see the header: Megatron-LM issue 1699).
  dk_pe = AllReduceCopy(k, ctx.tp, dk_pe);
  // The key side: linear_kv_up_proj, kv_layernorm, the gathered [R, kl + pe] (its gradient
  // split back to this rank's columns), linear_kv_down_proj.
  Tensor dx;
  {
    Tensor dlatent = kv_up_.Backward(ctx, dkv, stash.kv_up_in);
    dkv = Tensor();
    if (kv_norm_) dlatent = kv_norm_->Backward(ctx, dlatent, stash.kv_norm);
    if (sh.sequence_parallel) dlatent = AllGatherFirstDim(k, ctx.tp, dlatent);
    Tensor dcompressed = k.Empty({R, kl_ + pe}, dtype);
    k.CopyBlock(dlatent, 0, 0, dcompressed, 0, 0, R, kl_);
    k.CopyBlock(dk_pe.Reshaped({R, pe}), 0, 0, dcompressed, 0, kl_, R, pe);
    dlatent = Tensor();
    dk_pe = Tensor();
    const Tensor mine = SplitLastDim(k, ctx.tp, dcompressed);
    dcompressed = Tensor();
    dx = kv_down_.Backward(ctx, mine, ColumnParallelLinear::Stash{stash.x});
  }
  // The query side.
  {
    Tensor dx_q;
    if (q_down_) {
      Tensor dq_latent = q_up_->Backward(ctx, dq_cols, stash.q_up_in);
      dq_cols = Tensor();
      if (q_norm_) dq_latent = q_norm_->Backward(ctx, dq_latent, stash.q_norm);
      if (sh.sequence_parallel) dq_latent = AllGatherFirstDim(k, ctx.tp, dq_latent);
      const Tensor mine = SplitLastDim(k, ctx.tp, dq_latent);
      dq_latent = Tensor();
      dx_q = q_down_->Backward(ctx, mine, ColumnParallelLinear::Stash{stash.x});
    } else {
      dx_q = q_proj_->Backward(ctx, dq_cols, ColumnParallelLinear::Stash{stash.x});
    }
    k.Axpy(1.0, dx_q, dx);
  }
  return dx;
}

}  // namespace mpusim
