// The float64 GPT reference (see gpt_reference.h): Megatron-Core's GPTModel, forward and
// backward by hand, with plain Eigen, one micro-batch at a time, on one slice of the samples.
// Written from the model's math (core/config/gpt_config.h, core/dropout.h) only. The ops it shares
// with the layer chain (linear, embedding, activations, dropout masks, cross entropy) are
// reference/ops.h; the ones only this model has (norms, dropout masks, RoPE, attention) are
// gpt_reference_ops.{h,cc}. Here: the parameters, the micro-batch loop and the entry points.
//
// Shape legend (full model unless said):
//   s = seq_length, B = b*d global samples, M = micro-batches, n = samples of this slice,
//   h = hidden_size, a = heads, g = query groups, r = a/g heads per group, dk = kv_channels,
//   F = ffn_hidden_size, f1 = fc1 rows (F, or 2F for swiglu), Vp = padded vocabulary.
//   An activation [s, n, w] is a row-major [s*n, w] matrix: row i*n + j holds position i of
//   slice sample j (global sample gs = sample_begin + j). Weights are [out, in].
//   Attention works per (sample, head) on [s, dk] heads and [s, s] probabilities.
//
// Per micro-batch m:
//   forward   x = dropout(E[tokens] (+ P[i]));  per layer
//               x += dropout(Attn(Norm1(x)) Wproj^T + bproj);  x += dropout(MLP(Norm2(x)) + b2)
//             logits = NormF(x) Wout^T;  loss per token: vocab-parallel cross entropy
//   backward  dloss = 1/(M*s*B) per token; walk back, adding parameter gradients into
//             accumulators shared by all micro-batches.
#include "reference/gpt_reference.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/init.h"
#include "core/schedule.h"
#include "reference/gpt_reference_ops.h"
#include "reference/mla_reference.h"
#include "reference/moe_reference.h"
#include "reference/ops.h"
#include "reference/tracker_draws.h"

namespace mpusim {
namespace {

using gpt_reference::AsMat;
using gpt_reference::AsRow;
using gpt_reference::AttentionBackward;
using gpt_reference::AttentionForward;
using gpt_reference::AttentionStash;
using gpt_reference::Dims;
using gpt_reference::HiddenKeep;
using gpt_reference::Linear;
using gpt_reference::LinearBackward;
using gpt_reference::Mat;
using gpt_reference::MatMap;
using gpt_reference::MlaBackward;
using gpt_reference::MlaForward;
using gpt_reference::MlaParams;
using gpt_reference::MlaStash;
using gpt_reference::MoeForward;
using gpt_reference::MoeBackward;
using gpt_reference::MoeLayout;
using gpt_reference::MoeParams;
using gpt_reference::MoeStash;
using gpt_reference::NormBackward;
using gpt_reference::NormForward;
using gpt_reference::NormParams;
using gpt_reference::NormStash;
using gpt_reference::QkNormParams;
using gpt_reference::Param;
using gpt_reference::Vec;

// ---- tensors ------------------------------------------------------------------------------

Tensor NewTensor(Shape shape) { return Tensor::HostZeros(std::move(shape), DType::kFloat64); }

Tensor ToTensor(const Mat& m, Shape shape) {
  Tensor t = Tensor::HostEmpty(std::move(shape), DType::kFloat64);
  MatMap(t.data_as<double>(), m.rows(), m.cols()) = m;
  return t;
}

// ---- parameters ---------------------------------------------------------------------------

struct LayerParams {
  NormParams input_layernorm;
  Param qkv_weight, qkv_bias;    // [(a+2g)*dk, h], [(a+2g)*dk]
  Param proj_weight, proj_bias;  // [h, a*dk], [h]
  QkNormParams qk_norm;          // [dk] each; qk_layernorm only
  NormParams pre_mlp_layernorm;
  Param fc1_weight, fc1_bias;  // [f1, h], [f1]
  Param fc2_weight, fc2_bias;  // [h, F], [h]
  MoeParams moe;               // an MoE layer (moe_layer_freq) instead of the MLP
  gpt_reference::AttentionSoftmax softmax;  // its window and sink (softmax_offset [a])
  MlaParams mla;               // multi_latent_attention instead of linear_qkv
};

// One multi-token prediction depth (MultiTokenPredictionLayer).
struct MtpParams {
  NormParams enorm, hnorm;  // [h] each
  Param eh_proj;            // [h, 2h]: columns [0, h) act on enorm's output, [h, 2h) on hnorm's
  LayerParams layer;        // the transformer layer, like the last decoder layer
  NormParams final_layernorm;
};

struct ModelParams {
  std::vector<GptParameter> list;  // GptParameters order
  std::map<std::string, Param> by_name;
  Param word;      // [Vp, h]
  Param position;  // [max_position_embeddings, h], learned_absolute only
  std::vector<LayerParams> layers;
  NormParams final_layernorm;
  std::vector<MtpParams> mtp;  // mtp_num_layers depths
  Param output;  // [Vp, h]: the word embedding's handles when tied
};

Status InitParameters(const GptConfig& gpt, const Dims& d,
                      const std::map<std::string, Tensor>& overrides, ModelParams* p) {
  p->list = GptParameters(gpt, d.Vp, false);
  for (const GptParameter& gp : p->list) {
    Param param;
    if (auto it = overrides.find(gp.name); it != overrides.end()) {
      const Tensor& t = it->second;
      if (!t.defined() || t.device() != Device::kHost || t.dtype() != DType::kFloat64 ||
          t.shape() != gp.shape) {
        return Status::Error("parameter_overrides",
                             fmt::format("\"{}\" must be a host float64 tensor of shape {}",
                                         gp.name, ShapeString(gp.shape)));
      }
      param.value = t;  // shared: parameters are only read
    } else {
      param.value = Tensor::HostEmpty(gp.shape, DType::kFloat64);
      FillFlatRange(d.seed, gp.name, gp.init, gp.shape, 0, param.value);
    }
    param.grad = NewTensor(gp.shape);
    p->by_name.emplace(gp.name, param);
  }
  for (const auto& [name, tensor] : overrides) {
    if (name.ends_with(".router.expert_bias")) continue;  // state, read below
    if (p->by_name.count(name) == 0) {
      return Status::Error("parameter_overrides", fmt::format("no parameter named \"{}\"", name));
    }
  }
  const auto get = [&](const std::string& name) {
    auto it = p->by_name.find(name);
    return it == p->by_name.end() ? Param{} : it->second;
  };
  const auto norm = [&](const std::string& prefix) {
    return NormParams{get(prefix + ".weight"), get(prefix + ".bias")};
  };
  p->word = get("embedding.word_embeddings.weight");
  p->position = get("embedding.position_embeddings.weight");
  const auto is_moe_layer = [&](int64_t i) {
    return gpt.moe.enabled() && gpt.moe.layers[static_cast<size_t>(i)];
  };
  // Layer `i`'s parameters under `prefix` (an MTP depth's layer is built like the last
  // decoder layer: i = L - 1); `number`, from 0, decides its sliding window (depth k's: k,
  // MultiTokenPredictionLayer's layer_number k + 1).
  const auto layer_params = [&](const std::string& prefix, int64_t i,
                                int64_t number) -> StatusOr<LayerParams> {
    const bool moe_layer = is_moe_layer(i);
    LayerParams lp;
    lp.input_layernorm = norm(prefix + ".input_layernorm");
    lp.qkv_weight = get(prefix + ".self_attention.linear_qkv.weight");
    lp.qkv_bias = get(prefix + ".self_attention.linear_qkv.bias");
    lp.proj_weight = get(prefix + ".self_attention.linear_proj.weight");
    lp.proj_bias = get(prefix + ".self_attention.linear_proj.bias");
    if (!gpt.mla.enabled) {  // MLA's q_layernorm is its latent's (MlaParams)
      lp.qk_norm = {norm(prefix + ".self_attention.q_layernorm"),
                    norm(prefix + ".self_attention.k_layernorm")};
    }
    lp.softmax = {gpt.AttentionWindow(number), gpt.softmax_type,
                  get(prefix + ".self_attention.core_attention.softmax_offset")};
    lp.pre_mlp_layernorm = norm(prefix + ".pre_mlp_layernorm");
    const std::string attn = prefix + ".self_attention";
    lp.mla.q_down = get(attn + ".linear_q_down_proj.weight");
    lp.mla.q_up = get(attn + ".linear_q_up_proj.weight");
    lp.mla.q_proj = get(attn + ".linear_q_proj.weight");
    lp.mla.q_norm = norm(attn + ".q_layernorm");
    lp.mla.kv_down = get(attn + ".linear_kv_down_proj.weight");
    lp.mla.kv_norm = norm(attn + ".kv_layernorm");
    lp.mla.kv_up = get(attn + ".linear_kv_up_proj.weight");
    lp.fc1_weight = get(prefix + ".mlp.linear_fc1.weight");
    lp.fc1_bias = get(prefix + ".mlp.linear_fc1.bias");
    lp.fc2_weight = get(prefix + ".mlp.linear_fc2.weight");
    lp.fc2_bias = get(prefix + ".mlp.linear_fc2.bias");
    if (moe_layer) {
      lp.moe.router = get(prefix + ".mlp.router.weight");
      lp.moe.router_bias = get(prefix + ".mlp.router.bias");
      for (int64_t e = 0; e < gpt.moe.num_experts; ++e) {
        lp.moe.fc1.push_back(get(MoeExpertWeightName(prefix + ".mlp", e, 1)));
        lp.moe.fc2.push_back(get(MoeExpertWeightName(prefix + ".mlp", e, 2)));
        lp.moe.fc1_bias.push_back(get(MoeExpertBiasName(prefix + ".mlp", e, 1)));
        lp.moe.fc2_bias.push_back(get(MoeExpertBiasName(prefix + ".mlp", e, 2)));
      }
      lp.moe.shared_fc1 = get(prefix + ".mlp.shared_experts.linear_fc1.weight");
      lp.moe.shared_fc2 = get(prefix + ".mlp.shared_experts.linear_fc2.weight");
      if (gpt.moe.enable_expert_bias) {
        const std::string name = prefix + ".mlp.router.expert_bias";
        lp.moe.expert_bias.assign(static_cast<size_t>(gpt.moe.num_experts), 0.0);
        if (auto it = overrides.find(name); it != overrides.end()) {
          const Tensor& t = it->second;
          if (t.device() != Device::kHost || t.dtype() != DType::kFloat64 ||
              t.shape() != Shape{gpt.moe.num_experts}) {
            return Status::Error("parameter_overrides",
                                 fmt::format("\"{}\" must be a host float64 tensor of shape [{}]",
                                             name, gpt.moe.num_experts));
          }
          lp.moe.expert_bias.assign(t.data_as<double>(), t.data_as<double>() + t.numel());
        }
      }
    }
    return lp;
  };
  for (int64_t i = 0; i < d.L; ++i) {
    StatusOr<LayerParams> layer = layer_params(fmt::format("decoder.layers.{}", i), i, i);
    if (!layer.ok()) return layer.status();
    p->layers.push_back(std::move(*layer));
  }
  p->final_layernorm = norm("decoder.final_layernorm");
  for (int64_t k = 0; k < gpt.mtp_num_layers; ++k) {
    const std::string prefix = fmt::format("mtp.layers.{}", k);
    StatusOr<LayerParams> layer = layer_params(prefix + ".transformer_layer", d.L - 1, k);
    if (!layer.ok()) return layer.status();
    p->mtp.push_back(MtpParams{norm(prefix + ".enorm"), norm(prefix + ".hnorm"),
                               get(prefix + ".eh_proj.weight"), std::move(*layer),
                               norm(prefix + ".final_layernorm")});
  }
  p->output = gpt.share_embeddings_and_output_weights ? p->word : get("output_layer.weight");
  return Status();
}

// ---- one slice ----------------------------------------------------------------------------

// What a layer's forward keeps for its backward.
struct LayerStash {
  NormStash ln1;
  Mat ln1_out;  // [s*n, h]
  AttentionStash attention;
  MlaStash mla;   // multi_latent_attention's
  Mat context;    // [s*n, a*dk]
  Mat keep_attn;  // [s*n, h] self_attn_bda dropout
  NormStash ln2;
  Mat ln2_out;   // [s*n, h]
  Mat fc1;       // [s*n, f1] with bias
  Mat act;       // [s*n, F]
  MoeStash moe;  // an MoE layer's
  Mat keep_mlp;  // [s*n, h] mlp_bda dropout
};

// What a multi-token prediction depth's forward keeps for its backward.
struct MtpStash {
  std::vector<int64_t> ids;  // [s*n] the tokens rolled left k + 1 times
  Mat keep_embedding;        // [s*n, h] its embedding's dropout
  NormStash enorm, hnorm;
  Mat concat;  // [s*n, 2h] [enorm output, hnorm output], eh_proj's input
  LayerStash layer;
  NormStash final;
  Mat out;      // [s*n, h] h_k, after final_layernorm
  Mat dlogits;  // [s*n, Vp] the scaled, masked loss's gradient
};

enum class Kind : uint8_t {
  kHidden,    // [s, B, w], value [s, n, w]
  kPerToken,  // [s, B],    value [s, n]
  kProbs,     // [B, a, s, s], value [n, a, s, s]
};

struct SliceRun {
  const GptConfig& gpt;
  const Dims& d;
  ModelParams& params;
  std::vector<std::string> order;  // recorded activations, forward order
  std::map<std::string, ReferenceTensor> recorded;
  double loss_sum = 0.0;  // this slice's per-token losses, all micro-batches
  double moe_aux = 0.0;   // the MoE layers' auxiliary objective, all micro-batches
  MoeLayout moe_layout;

  void Record(bool record, const std::string& name, Kind kind, const Mat& value) {
    if (!record) return;
    ReferenceTensor t;
    t.name = name;
    t.layout = ReferenceTensor::Layout::kSamples;
    switch (kind) {
      case Kind::kHidden:
        t.full_shape = {d.s, d.B, value.cols()};
        t.batch_dim = 1;
        t.value = ToTensor(value, {d.s, d.n, value.cols()});
        break;
      case Kind::kPerToken:
        t.full_shape = {d.s, d.B};
        t.batch_dim = 1;
        t.value = ToTensor(value, {d.s, d.n});
        break;
      case Kind::kProbs:
        t.full_shape = {d.B, d.a, d.s, d.s};
        t.batch_dim = 0;
        t.value = ToTensor(value, {d.n, d.a, d.s, d.s});
        break;
    }
    if (!name.ends_with("_grad") && name != "tokens" && name != "labels") order.push_back(name);
    recorded[name] = std::move(t);
  }
  // The [n*a] per-head [s, s] matrices as one [n*a*s, s] matrix (row-major [n, a, s, s]).
  static Mat Stack(const std::vector<Mat>& heads, int64_t s) {
    Mat out(static_cast<int64_t>(heads.size()) * s, s);
    for (size_t k = 0; k < heads.size(); ++k)
      out.block(static_cast<int64_t>(k) * s, 0, s, s) = heads[k];
    return out;
  }

  void MicroBatch(int64_t m, const std::vector<int64_t>& all_tokens,
                  const std::vector<int64_t>& all_labels, bool record);
};

// This slice's rows of an [s*B] list of ids (element i*B + gs): [s*n], row i*n + j.
std::vector<int64_t> SliceRows(const Dims& d, const std::vector<int64_t>& all) {
  std::vector<int64_t> rows(static_cast<size_t>(d.s * d.n));
  for (int64_t i = 0; i < d.s; ++i) {
    for (int64_t j = 0; j < d.n; ++j) {
      rows[static_cast<size_t>(i * d.n + j)] =
          all[static_cast<size_t>(i * d.B + d.sample_begin + j)];
    }
  }
  return rows;
}

// Megatron's roll_tensor(shifts=-1) along the sequence (cp 1): position i of each sample takes
// position i + 1's id; the last position gets 0.
std::vector<int64_t> RollLeft(const Dims& d, const std::vector<int64_t>& ids) {
  std::vector<int64_t> rolled(ids.size(), 0);
  for (int64_t r = 0; r + d.n < d.s * d.n; ++r) {
    rolled[static_cast<size_t>(r)] = ids[static_cast<size_t>(r + d.n)];
  }
  return rolled;
}

// The sequence position of each of this slice's rows: row i*n + j is position i.
std::vector<int64_t> RowPositions(const Dims& d) {
  std::vector<int64_t> positions(static_cast<size_t>(d.s * d.n));
  for (int64_t row = 0; row < d.s * d.n; ++row) positions[static_cast<size_t>(row)] = row / d.n;
  return positions;
}

// Ids [s*n] as an [s, n] matrix of doubles (for the record).
Mat IdsMat(const Dims& d, const std::vector<int64_t>& ids) {
  Mat out(d.s, d.n);
  for (int64_t r = 0; r < d.s * d.n; ++r) {
    out(r / d.n, r % d.n) = static_cast<double>(ids[static_cast<size_t>(r)]);
  }
  return out;
}

// The embedding of this slice's rows before its dropout, [s*n, h]: word rows E[tokens], plus
// the position rows P[i] with learned absolute positions (row i*n + j is position i).
Mat Embed(const Dims& d, const ModelParams& params, const std::vector<int64_t>& tokens) {
  Mat x(d.s * d.n, d.h);
  ref::EmbeddingForward(AsMat(params.word.value), tokens, x);
  if (params.position.defined()) {
    Mat position(d.s * d.n, d.h);
    ref::EmbeddingForward(AsMat(params.position.value), RowPositions(d), position);
    x += position;
  }
  return x;
}

// Embed's backward: dE[tokens] += dx (and dP[i] += dx).
void EmbedBackward(const Dims& d, const Mat& dx, const std::vector<int64_t>& tokens,
                   ModelParams& params) {
  ref::EmbeddingBackward(dx, tokens, AsMat(params.word.grad));
  if (params.position.defined()) {
    ref::EmbeddingBackward(dx, RowPositions(d), AsMat(params.position.grad));
  }
}

void SliceRun::MicroBatch(int64_t m, const std::vector<int64_t>& all_tokens,
                          const std::vector<int64_t>& all_labels, bool record) {
  const int64_t rows = d.s * d.n;
  const std::vector<int64_t> tokens = SliceRows(d, all_tokens), labels = SliceRows(d, all_labels);
  Record(record, "tokens", Kind::kPerToken, IdsMat(d, tokens));
  Record(record, "labels", Kind::kPerToken, IdsMat(d, labels));

  // ---- forward --------------------------------------------------------------------------
  // One transformer layer on the residual stream x (`prefix`: its state-dict name).
  const auto layer_forward = [&](const std::string& prefix, const LayerParams& p, LayerStash& st,
                                 Mat& x) {
    st.ln1_out =
        NormForward(gpt.normalization, gpt.layernorm_epsilon, x, p.input_layernorm, &st.ln1);
    Record(record, prefix + ".input_layernorm.output", Kind::kHidden, st.ln1_out);
    const std::string attention_dropout =
        prefix + ".self_attention.core_attention.attention_dropout";
    if (p.mla.defined()) {
      st.context = MlaForward(d, gpt, st.ln1_out, p.mla, attention_dropout, m, &st.mla);
      Record(record, prefix + ".self_attention.core_attention.probs", Kind::kProbs,
             Stack(st.mla.probs, d.s));
    } else {
      const Mat qkv = Linear(st.ln1_out, p.qkv_weight, p.qkv_bias);
      Record(record, prefix + ".self_attention.linear_qkv.output", Kind::kHidden, qkv);
      st.context = AttentionForward(d, gpt, p.softmax, qkv, p.qk_norm, attention_dropout, m,
                                    &st.attention);
      Record(record, prefix + ".self_attention.core_attention.probs", Kind::kProbs,
             Stack(st.attention.probs, d.s));
    }
    Record(record, prefix + ".self_attention.core_attention.output", Kind::kHidden, st.context);
    Mat proj = Linear(st.context, p.proj_weight, Param{});
    Record(record, prefix + ".self_attention.linear_proj.output", Kind::kHidden, proj);
    // Bias-dropout-add: x + dropout(proj + b).
    if (p.proj_bias.defined()) ref::AddBias(AsRow(p.proj_bias.value), proj);
    st.keep_attn = HiddenKeep(d, prefix + ".self_attn_bda", m, gpt.hidden_dropout, d.h);
    x += proj.cwiseProduct(st.keep_attn);
    Record(record, prefix + ".self_attn_bda.output", Kind::kHidden, x);

    st.ln2_out =
        NormForward(gpt.normalization, gpt.layernorm_epsilon, x, p.pre_mlp_layernorm, &st.ln2);
    Record(record, prefix + ".pre_mlp_layernorm.output", Kind::kHidden, st.ln2_out);
    if (p.moe.defined()) {
      const Mat y = MoeForward(d, gpt, moe_layout, st.ln2_out, p.moe, &st.moe, &moe_aux);
      st.keep_mlp = HiddenKeep(d, prefix + ".mlp_bda", m, gpt.hidden_dropout, d.h);
      x += y.cwiseProduct(st.keep_mlp);
      Record(record, prefix + ".mlp_bda.output", Kind::kHidden, x);
      return;
    }
    st.fc1 = Linear(st.ln2_out, p.fc1_weight, p.fc1_bias);
    Record(record, prefix + ".mlp.linear_fc1.output", Kind::kHidden, st.fc1);
    st.act.resize(rows, d.F);
    ref::ActivationForward(gpt.activation, st.fc1, st.act, gpt.Glu());
    Mat fc2 = Linear(st.act, p.fc2_weight, Param{});
    Record(record, prefix + ".mlp.linear_fc2.output", Kind::kHidden, fc2);
    if (p.fc2_bias.defined()) ref::AddBias(AsRow(p.fc2_bias.value), fc2);
    st.keep_mlp = HiddenKeep(d, prefix + ".mlp_bda", m, gpt.hidden_dropout, d.h);
    x += fc2.cwiseProduct(st.keep_mlp);
    Record(record, prefix + ".mlp_bda.output", Kind::kHidden, x);
  };
  Mat x = Embed(d, params, tokens);
  const Mat keep_embedding =
      HiddenKeep(d, "embedding.embedding_dropout", m, gpt.hidden_dropout, d.h);
  x = x.cwiseProduct(keep_embedding);
  Record(record, "embedding.output", Kind::kHidden, x);

  std::vector<LayerStash> stash(static_cast<size_t>(d.L));
  for (int64_t l = 0; l < d.L; ++l) {
    layer_forward(fmt::format("decoder.layers.{}", l), params.layers[static_cast<size_t>(l)],
                  stash[static_cast<size_t>(l)], x);
  }

  NormStash final_stash;
  const Mat final_out = NormForward(gpt.normalization, gpt.layernorm_epsilon, x,
                                    params.final_layernorm, &final_stash);
  Record(record, "decoder.final_layernorm.output", Kind::kHidden, final_out);

  // ---- multi-token prediction (MultiTokenPredictionBlock, process_mtp_loss) ---------------
  // Depth k (1-based) at position i joins the previous depth's hidden state at i (depth 0:
  // the decoder's final norm) with the embedding of the token k ahead: the ids are rolled
  // left once per depth, roll_tensor's vacated last position filled with id 0; the labels
  // and the loss mask roll the same way, so depth k predicts labels[i + k] where i + k < s.
  //   x = [enorm(dropout(E[ids_k])), hnorm(h_{k-1})] eh_proj^T;  h_k = finalnorm_k(layer_k(x))
  //   loss_k: cross entropy of h_k Wout^T (the shared output head) against labels_k, masked
  // The gradient gets mtp_loss_scaling_factor / D * loss_k / num_tokens_k per micro-batch and
  // data-parallel rank (MTPLossAutoScaler, scaled by 1/M like the main loss; num_tokens_k =
  // b * (s - k)), averaged over dp: per token f / (D * M * B * (s - k)). With context
  // parallelism each cp rank normalises by its own unmasked tokens (roll_tensor's local sum)
  // and the average runs over dp x cp: a token held by a cp rank with v of its positions
  // unmasked gets f / (D * M * B * cp * v) (v = s - k on one rank). The reported loss is the
  // main one only.
  const int64_t D = gpt.mtp_num_layers;
  std::vector<MtpStash> mtp(static_cast<size_t>(D));
  {
    std::vector<int64_t> ids = tokens, targets = labels;
    const Mat* prev = &final_out;
    for (int64_t k = 0; k < D; ++k) {
      const std::string prefix = fmt::format("mtp.layers.{}", k);
      MtpParams& p = params.mtp[static_cast<size_t>(k)];
      MtpStash& st = mtp[static_cast<size_t>(k)];
      ids = RollLeft(d, ids);
      targets = RollLeft(d, targets);
      st.ids = ids;
      st.keep_embedding =
          HiddenKeep(d, prefix + ".embedding.embedding_dropout", m, gpt.hidden_dropout, d.h);
      const Mat e = Embed(d, params, ids).cwiseProduct(st.keep_embedding);
      Record(record, prefix + ".embedding.output", Kind::kHidden, e);
      st.concat.resize(rows, 2 * d.h);
      st.concat.leftCols(d.h) =
          NormForward(gpt.normalization, gpt.layernorm_epsilon, e, p.enorm, &st.enorm);
      st.concat.rightCols(d.h) =
          NormForward(gpt.normalization, gpt.layernorm_epsilon, *prev, p.hnorm, &st.hnorm);
      Record(record, prefix + ".enorm.output", Kind::kHidden, st.concat.leftCols(d.h));
      Record(record, prefix + ".hnorm.output", Kind::kHidden, st.concat.rightCols(d.h));
      Mat y = Linear(st.concat, p.eh_proj, Param{});
      Record(record, prefix + ".eh_proj.output", Kind::kHidden, y);
      layer_forward(prefix + ".transformer_layer", p.layer, st.layer, y);
      st.out =
          NormForward(gpt.normalization, gpt.layernorm_epsilon, y, p.final_layernorm, &st.final);
      Record(record, prefix + ".final_layernorm.output", Kind::kHidden, st.out);
      const Mat mtp_logits = Linear(st.out, params.output, Param{});
      Record(record, prefix + ".output_layer.output", Kind::kHidden, mtp_logits);
      const int64_t valid = d.s - (k + 1);  // positions with a label k + 1 ahead
      // Each cp rank's unmasked positions (Megatron's split: rank r holds chunks r and
      // 2 cp - 1 - r of 2 cp).
      const auto cp_rank = [&](int64_t i) {
        if (d.cp == 1) return int64_t{0};
        const int64_t chunk = i / (d.s / (2 * d.cp));
        return chunk < d.cp ? chunk : 2 * d.cp - 1 - chunk;
      };
      std::vector<int64_t> unmasked(static_cast<size_t>(d.cp), 0);
      for (int64_t i = 0; i < valid; ++i) ++unmasked[static_cast<size_t>(cp_rank(i))];
      Vec mtp_loss(rows);
      st.dlogits.resize(rows, mtp_logits.cols());
      ref::CrossEntropy(mtp_logits, targets, gpt.label_smoothing, 1.0,
                        std::span<double>(mtp_loss.data(), static_cast<size_t>(rows)), st.dlogits);
      for (int64_t i = 0; i < d.s; ++i) {
        const int64_t v = unmasked[static_cast<size_t>(cp_rank(i))];
        const double scale =
            i < valid ? gpt.mtp_loss_scaling_factor / static_cast<double>(D * d.M * d.B * d.cp * v)
                      : 0.0;
        for (int64_t j = 0; j < d.n; ++j) {
          // loss_mask rolled: the last k + 1 positions have no label
          if (i >= valid) mtp_loss(i * d.n + j) = 0.0;
          st.dlogits.row(i * d.n + j) *= scale;
        }
      }
      Record(record, prefix + ".loss.per_token", Kind::kPerToken,
             MatMap(mtp_loss.data(), d.s, d.n));
      prev = &st.out;
    }
  }
  const Mat logits = Linear(final_out, params.output, Param{});
  Record(record, "output_layer.output", Kind::kHidden, logits);
  const double token_scale = 1.0 / static_cast<double>(d.M * d.s * d.B);
  Vec loss(rows);
  Mat dlogits(rows, logits.cols());
  ref::CrossEntropy(logits, labels, gpt.label_smoothing, token_scale,
                    std::span<double>(loss.data(), static_cast<size_t>(rows)), dlogits);
  loss_sum += loss.sum();
  Record(record, "loss.per_token", Kind::kPerToken, MatMap(loss.data(), d.s, d.n));

  // ---- backward -------------------------------------------------------------------------
  Record(record, "loss.per_token_grad", Kind::kPerToken, Mat::Constant(d.s, d.n, token_scale));
  Record(record, "output_layer.output_grad", Kind::kHidden, dlogits);
  Param no_bias;
  Mat dfinal = LinearBackward(dlogits, final_out, params.output, no_bias);

  // One transformer layer's backward: dx, the residual stream's gradient, in and out.
  const auto layer_backward = [&](const std::string& prefix, LayerParams& p, const LayerStash& st,
                                  Mat& dx) {
    Record(record, prefix + ".mlp_bda.output_grad", Kind::kHidden, dx);
    Mat dln2;
    if (p.moe.defined()) {
      dln2 = MoeBackward(d, gpt, dx.cwiseProduct(st.keep_mlp), st.moe, p.moe);
    } else {
      const Mat dfc2 = dx.cwiseProduct(st.keep_mlp);  // also d(fc2 + b)
      Record(record, prefix + ".mlp.linear_fc2.output_grad", Kind::kHidden, dfc2);
      const Mat dact = LinearBackward(dfc2, st.act, p.fc2_weight, p.fc2_bias);
      Mat dfc1(rows, d.f1);
      ref::ActivationBackward(gpt.activation, dact, st.fc1, dfc1, gpt.Glu());
      Record(record, prefix + ".mlp.linear_fc1.output_grad", Kind::kHidden, dfc1);
      dln2 = LinearBackward(dfc1, st.ln2_out, p.fc1_weight, p.fc1_bias);
    }
    Record(record, prefix + ".pre_mlp_layernorm.output_grad", Kind::kHidden, dln2);
    // The residual stream's gradient adds: the skip path plus the norm's.
    dx += NormBackward(gpt.normalization, dln2, st.ln2, p.pre_mlp_layernorm);

    Record(record, prefix + ".self_attn_bda.output_grad", Kind::kHidden, dx);
    const Mat dproj = dx.cwiseProduct(st.keep_attn);
    Record(record, prefix + ".self_attention.linear_proj.output_grad", Kind::kHidden, dproj);
    const Mat dcontext = LinearBackward(dproj, st.context, p.proj_weight, p.proj_bias);
    Record(record, prefix + ".self_attention.core_attention.output_grad", Kind::kHidden, dcontext);
    std::vector<Mat> dprobs;
    Mat dln1;
    if (p.mla.defined()) {
      dln1 = MlaBackward(d, gpt, st.ln1_out, dcontext, st.mla, p.mla, &dprobs);
      Record(record, prefix + ".self_attention.core_attention.probs_grad", Kind::kProbs,
             Stack(dprobs, d.s));
    } else {
      const Mat dqkv = AttentionBackward(d, gpt, dcontext, st.attention, p.qk_norm, p.softmax,
                                         &dprobs);
      Record(record, prefix + ".self_attention.core_attention.probs_grad", Kind::kProbs,
             Stack(dprobs, d.s));
      Record(record, prefix + ".self_attention.linear_qkv.output_grad", Kind::kHidden, dqkv);
      dln1 = LinearBackward(dqkv, st.ln1_out, p.qkv_weight, p.qkv_bias);
    }
    Record(record, prefix + ".input_layernorm.output_grad", Kind::kHidden, dln1);
    dx += NormBackward(gpt.normalization, dln1, st.ln1, p.input_layernorm);
  };

  // Multi-token prediction, deepest first: h_k feeds its own logits and depth k + 1's hnorm.
  {
    Mat dnext = Mat::Zero(rows, d.h);  // d loss / d h_k through depth k + 1
    for (int64_t k = D; k-- > 0;) {
      const std::string prefix = fmt::format("mtp.layers.{}", k);
      MtpParams& p = params.mtp[static_cast<size_t>(k)];
      const MtpStash& st = mtp[static_cast<size_t>(k)];
      Record(record, prefix + ".output_layer.output_grad", Kind::kHidden, st.dlogits);
      Mat dout = LinearBackward(st.dlogits, st.out, params.output, no_bias);
      dout += dnext;
      Record(record, prefix + ".final_layernorm.output_grad", Kind::kHidden, dout);
      Mat dy = NormBackward(gpt.normalization, dout, st.final, p.final_layernorm);
      layer_backward(prefix + ".transformer_layer", p.layer, st.layer, dy);
      Record(record, prefix + ".eh_proj.output_grad", Kind::kHidden, dy);
      const Mat dconcat = LinearBackward(dy, st.concat, p.eh_proj, no_bias);
      Record(record, prefix + ".enorm.output_grad", Kind::kHidden, dconcat.leftCols(d.h));
      Record(record, prefix + ".hnorm.output_grad", Kind::kHidden, dconcat.rightCols(d.h));
      const Mat de = NormBackward(gpt.normalization, dconcat.leftCols(d.h), st.enorm, p.enorm);
      Record(record, prefix + ".embedding.output_grad", Kind::kHidden, de);
      EmbedBackward(d, de.cwiseProduct(st.keep_embedding), st.ids, params);
      dnext = NormBackward(gpt.normalization, dconcat.rightCols(d.h), st.hnorm, p.hnorm);
    }
    dfinal += dnext;
  }
  Record(record, "decoder.final_layernorm.output_grad", Kind::kHidden, dfinal);
  Mat dx = NormBackward(gpt.normalization, dfinal, final_stash, params.final_layernorm);
  for (int64_t l = d.L; l-- > 0;) {
    layer_backward(fmt::format("decoder.layers.{}", l), params.layers[static_cast<size_t>(l)],
                   stash[static_cast<size_t>(l)], dx);
  }

  Record(record, "embedding.output_grad", Kind::kHidden, dx);
  EmbedBackward(d, dx.cwiseProduct(keep_embedding), tokens, params);
}

Status CheckTokenLists(const std::vector<std::vector<int64_t>>& lists, const char* what,
                       const Dims& d) {
  if (lists.empty()) return Status();
  const std::string where = fmt::format("GptReferenceOptions.{}", what);
  if (static_cast<int64_t>(lists.size()) != d.M) {
    return Status::Error(where,
                         fmt::format("has {} micro-batches, the run has {}", lists.size(), d.M));
  }
  for (size_t m = 0; m < lists.size(); ++m) {
    if (static_cast<int64_t>(lists[m].size()) != d.s * d.B) {
      return Status::Error(
          fmt::format("{}[{}]", where, m),
          fmt::format("has {} ids, expected s*B = {}", lists[m].size(), d.s * d.B));
    }
    for (size_t k = 0; k < lists[m].size(); ++k) {
      if (lists[m][k] < 0 || lists[m][k] >= d.V) {
        return Status::Error(fmt::format("{}[{}][{}]", where, m, k),
                             fmt::format("id {} is not in [0, vocab_size {})", lists[m][k], d.V));
      }
    }
  }
  return Status();
}

#if defined(MPUSIM_HAVE_OPENBLAS)
extern "C" void openblas_set_num_threads(int num_threads);
#endif

}  // namespace

ErrorBudget GptErrorBudget(const GptConfig& gpt, const RunConfig& run, int64_t t, int64_t d,
                           int64_t padded_vocab) {
  // Multi-token prediction's depths are layers on the longest path, each with its logits.
  const double L = static_cast<double>(gpt.num_layers + gpt.mtp_num_layers);
  const double s = static_cast<double>(run.seq_length);
  const double tokens = static_cast<double>(run.num_microbatches * run.seq_length *
                                            run.micro_batch_size * d);
  // Roundings: a stored value carries at most u of relative error, but most of a layer's
  // stored values (qkv, scores, probabilities, context, fc1, activation) feed the residual
  // stream through GEMMs that average their errors; calibrated as 4 independent roundings
  // per layer, forward and backward (bench/tolerance_margins.py's rule: the largest error on
  // every test layout stays under a fifth of its allowance). Terms: the reductions of the
  // layer's GEMMs and norms, forward and backward.
  const double per_layer_terms =
      static_cast<double>(gpt.hidden_size) * 4 +
      static_cast<double>(gpt.num_attention_heads * gpt.kv_channels) * 2 + s * 2 +
      static_cast<double>(gpt.ffn_hidden_size) * 2;
  ErrorBudget budget;
  budget.roundings = 4 * (L + 2);
  budget.terms = per_layer_terms * (L + 1) +
                 static_cast<double>(padded_vocab * (1 + gpt.mtp_num_layers)) * 2 + tokens +
                 static_cast<double>(t + d);
  return budget;
}

int64_t GptReferenceSamples(const ParallelConfig& parallel, const RunConfig& run) {
  const int64_t model_parallel = std::max<int64_t>(parallel.tensor_model_parallel_size, 1) *
                                 std::max<int64_t>(parallel.pipeline_model_parallel_size, 1) *
                                 std::max<int64_t>(parallel.context_parallel_size, 1);
  return run.micro_batch_size * (parallel.world_size / model_parallel);
}

GptReferenceTokens DrawGptReferenceTokens(const GptConfig& gpt, const ParallelConfig& parallel,
                                          const RunConfig& run, int64_t microbatch) {
  const int64_t s = run.seq_length;
  const int64_t B = GptReferenceSamples(parallel, run);
  const std::string stream = fmt::format("text.mb{}", microbatch);
  GptReferenceTokens out;
  out.tokens.resize(static_cast<size_t>(s * B));
  out.labels.resize(static_cast<size_t>(s * B));
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t gs = 0; gs < B; ++gs) {
      // Sample gs reads s + 1 consecutive tokens: the labels are the inputs shifted by one.
      const int64_t first = gs * (s + 1) + i;
      out.tokens[static_cast<size_t>(i * B + gs)] =
          TokenAt(run.seed, stream, first, gpt.vocab_size);
      out.labels[static_cast<size_t>(i * B + gs)] =
          TokenAt(run.seed, stream, first + 1, gpt.vocab_size);
    }
  }
  return out;
}

namespace {

// What the reference needs of the config: resolved sizes, a layout that divides the world.
Status CheckGptReferenceConfig(const GptConfig& gpt, const ParallelConfig& parallel,
                               const RunConfig& run) {
  const int64_t t = parallel.tensor_model_parallel_size;
  const int64_t model_parallel =
      t * parallel.pipeline_model_parallel_size * parallel.context_parallel_size;
  if (t < 1 || model_parallel < 1 || parallel.world_size < model_parallel ||
      parallel.world_size % model_parallel != 0) {
    return Status::Error("parallel.world_size",
                         fmt::format("{} is not a multiple of tp * pp * cp = {}",
                                     parallel.world_size, model_parallel));
  }
  if (run.seq_length < 1 || run.micro_batch_size < 1 || run.num_microbatches < 1) {
    return Status::Error("run", "seq_length, micro_batch_size and num_microbatches must be >= 1");
  }
  if (gpt.num_layers < 1 || gpt.hidden_size < 1 || gpt.num_attention_heads < 1 ||
      gpt.num_query_groups < 1 || gpt.kv_channels < 1 || gpt.ffn_hidden_size < 1 ||
      gpt.vocab_size < 1) {
    return Status::Error("model", "the GPT section is not resolved (a size is < 1)");
  }
  if (gpt.num_attention_heads % gpt.num_query_groups != 0) {
    return Status::Error("model.num_query_groups",
                         fmt::format("num_attention_heads {} is not divisible by {}",
                                     gpt.num_attention_heads, gpt.num_query_groups));
  }
  if (gpt.position_embedding_type == PositionEmbedding::kRope &&
      (gpt.RotaryDim() < 2 || gpt.RotaryDim() % 2 != 0 || gpt.rotary_percent > 1.0)) {
    return Status::Error("model.rotary_percent",
                         "rope needs an even number of turned channels, at least 2, at most "
                         "kv_channels");
  }
  if (gpt.has_position_embeddings() && gpt.max_position_embeddings < run.seq_length) {
    return Status::Error("model.max_position_embeddings",
                         fmt::format("{} is shorter than run.seq_length {}",
                                     gpt.max_position_embeddings, run.seq_length));
  }
  if (gpt.mtp_num_layers > 0 &&
      (gpt.has_position_embeddings() || gpt.dropout_mode == DropoutMode::kRngTracker)) {
    return Status::Error("model.mtp_num_layers",
                         "multi-token prediction needs rope and dropout_mode \"global\" (what "
                         "ParseGptSection accepts)");
  }

  return {};
}

// Where each dropout site of every pipeline rank draws from under dropout_mode "rng_tracker"
// (core/dropout.h, reference/tracker_draws.h): its stream, and its position among the draws
// of the rank's forwards in schedule order.
Status PlanTrackerDraws(const GptConfig& gpt, const ParallelConfig& parallel, const RunConfig& run,
                        Dims* dims) {
  Dims& d = *dims;
  const int64_t t = parallel.tensor_model_parallel_size;
  // Megatron-Core's stream per site, in forward order (core/dropout.h).
  d.tracker = true;
  d.t = t;
  d.b = run.micro_batch_size;
  d.sp = parallel.sequence_parallel && t > 1;
  d.cp = parallel.context_parallel_size;
  d.cp_heads = d.cp > 1 && gpt.cp_comm_type == CpCommType::kA2a;
  // Each pipeline rank draws from its own tracker in the order it runs its forwards
  // (reference/tracker_draws.h).
  const int64_t p = parallel.pipeline_model_parallel_size;
  StatusOr<std::vector<std::vector<std::vector<int64_t>>>> layers =
      AssignLayers(parallel.Split(), gpt.num_layers);
  if (!layers.ok()) return layers.status();
  // Per pp rank and chunk, one forward's draws on each stream.
  std::vector<std::vector<std::array<int64_t, 2>>> draws(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) {
    const auto& chunks = (*layers)[static_cast<size_t>(r)];
    std::vector<std::array<int64_t, 2>>& per_chunk = draws[static_cast<size_t>(r)];
    per_chunk.assign(chunks.size(), {0, 0});
    for (size_t c = 0; c < chunks.size(); ++c) {
      const auto site = [&](const std::string& name, bool on_model_parallel, double prob) {
        if (prob > 0) {
          d.draw[name] = {on_model_parallel, r, static_cast<int64_t>(c),
                          per_chunk[c][on_model_parallel ? 1 : 0]++};
        }
      };
      if (r == 0 && c == 0) site("embedding.embedding_dropout", d.sp, gpt.hidden_dropout);
      for (int64_t layer : chunks[c]) {  // 1-based
        const std::string name = fmt::format("decoder.layers.{}", layer - 1);
        site(name + ".self_attention.core_attention.attention_dropout", true,
             gpt.attention_dropout);
        site(name + ".self_attn_bda", d.sp, gpt.hidden_dropout);
        site(name + ".mlp_bda", d.sp, gpt.hidden_dropout);
      }
    }
  }
  StatusOr<DrawPositions> numbered = NumberTrackerDraws(parallel, d.M, draws);
  if (!numbered.ok()) return numbered.status();
  d.draws = *std::move(numbered);
  return {};
}

}  // namespace

StatusOr<ReferenceResult> RunGptReference(const GptConfig& gpt_in,
                                          const ParallelConfig& parallel, const RunConfig& run,
                                          const GptReferenceOptions& options) {
#if defined(MPUSIM_HAVE_OPENBLAS)
  openblas_set_num_threads(1);
#endif
  GptConfig gpt = gpt_in;
  if (gpt.max_position_embeddings == 0) gpt.max_position_embeddings = run.seq_length;
  MPUSIM_RETURN_IF_ERROR(CheckGptReferenceConfig(gpt, parallel, run));
  const int64_t t = parallel.tensor_model_parallel_size;
  Dims d;
  d.seed = run.seed;
  d.iteration = options.iteration;
  d.s = run.seq_length;
  d.B = GptReferenceSamples(parallel, run);
  d.M = run.num_microbatches;
  d.h = gpt.hidden_size;
  d.a = gpt.num_attention_heads;
  d.g = gpt.num_query_groups;
  d.r = d.a / d.g;
  d.dk = gpt.kv_channels;
  d.rd = gpt.RotaryDim();
  d.F = gpt.ffn_hidden_size;
  d.f1 = gpt.Fc1Rows();
  d.V = gpt.vocab_size;
  d.Vp = gpt.PaddedVocabSize(t);
  d.L = gpt.num_layers;
  d.qkv = gpt.QkvRows();
  d.cp = parallel.context_parallel_size;  // multi-token prediction's per-rank token counts
  if (gpt.dropout_mode == DropoutMode::kRngTracker) {
    MPUSIM_RETURN_IF_ERROR(PlanTrackerDraws(gpt, parallel, run, &d));
  }
  const int64_t sample_end = options.slice.end < 0 ? d.B : options.slice.end;
  if (options.slice.begin < 0 || options.slice.begin > sample_end || sample_end > d.B) {
    return Status::Error("reference slice", fmt::format("samples [{}, {}) are not inside [0, {})",
                                                        options.slice.begin, sample_end, d.B));
  }
  d.sample_begin = options.slice.begin;
  d.n = sample_end - options.slice.begin;
  MPUSIM_RETURN_IF_ERROR(CheckTokenLists(options.tokens, "tokens", d));
  MPUSIM_RETURN_IF_ERROR(CheckTokenLists(options.labels, "labels", d));

  ModelParams params;
  MPUSIM_RETURN_IF_ERROR(InitParameters(gpt, d, options.parameter_overrides, &params));

  SliceRun slice{gpt, d, params, {}, {}, 0.0, 0.0, {}};
  // Every router by its module's name: the decoder's MoE layers, then the depths' (an MTP
  // layer is built like the last decoder layer, with a router of its own).
  std::map<std::string, MoeParams*> routers;
  for (int64_t i = 0; i < d.L; ++i) {
    MoeParams& moe = params.layers[static_cast<size_t>(i)].moe;
    if (moe.defined()) routers[fmt::format("decoder.layers.{}.mlp.router", i)] = &moe;
  }
  for (int64_t k = 0; k < gpt.mtp_num_layers; ++k) {
    MoeParams& moe = params.mtp[static_cast<size_t>(k)].layer.moe;
    if (moe.defined()) routers[fmt::format("mtp.layers.{}.transformer_layer.mlp.router", k)] = &moe;
  }
  // The expert biases' counts, per router over every micro-batch (kept choices).
  std::map<std::string, std::vector<double>> tokens_per_expert;
  if (gpt.moe.enabled() && gpt.moe.enable_expert_bias) {
    for (auto& [router, moe] : routers) {
      tokens_per_expert[router].assign(static_cast<size_t>(gpt.moe.num_experts), 0.0);
      moe->tokens_per_expert = &tokens_per_expert[router];
    }
  }
  // The global load-balancing loss's trackers, per router (this step's).
  std::map<std::string, MoeParams::GlobalAuxTracker> global_aux;
  if (gpt.moe.enabled() && gpt.moe.AuxLossCoeff(MoeLoadBalancing::kGlobalAuxLoss) > 0) {
    if (d.n != d.B && d.n != 0) {  // (an empty slice lists the tensors)
      return Status::Error("reference slice",
                           fmt::format("samples [{}, {}) are not the whole batch of {}, which "
                                       "\"global_aux_loss\"'s counts need",
                                       d.sample_begin, sample_end, d.B));
    }
    for (auto& [router, moe] : routers) {
      global_aux[router].tokens.assign(static_cast<size_t>(gpt.moe.num_experts), 0.0f);
      moe->global_aux = &global_aux[router];
    }
  }
  if (gpt.moe.enabled()) {
    // Routers see whole dp ranks' tokens: the slice must hold whole dp ranks.
    const int64_t b = run.micro_batch_size;
    if (d.sample_begin % b != 0 || d.n % b != 0) {
      return Status::Error("reference slice",
                           fmt::format("samples [{}, {}) are not whole data-parallel ranks of {} "
                                       "samples (an MoE model's routers need them)",
                                       d.sample_begin, sample_end, b));
    }
    slice.moe_layout = {b, t, parallel.context_parallel_size, parallel.sequence_parallel && t > 1};
  }
  for (int64_t m = 0; m < d.M; ++m) {
    GptReferenceTokens drawn;
    if (options.tokens.empty() || options.labels.empty()) {
      drawn = DrawGptReferenceTokens(gpt, parallel, run, options.iteration * d.M + m);
    }
    const auto um = static_cast<size_t>(m);
    slice.MicroBatch(m, options.tokens.empty() ? drawn.tokens : options.tokens[um],
                     options.labels.empty() ? drawn.labels : options.labels[um], m + 1 == d.M);
  }

  ReferenceResult result;
  result.units = d.B;
  result.slice_begin = d.sample_begin;
  result.slice_end = sample_end;
  result.has_loss = true;
  result.loss = slice.loss_sum / static_cast<double>(d.M * d.s * d.B);
  result.moe_aux_objective = slice.moe_aux;
  // Every tensor but the token ids is charged the budget of the model's longest path.
  const ErrorBudget budget =
      GptErrorBudget(gpt, run, t, d.B / run.micro_batch_size, d.Vp);
  auto take = [&](const std::string& name) {
    auto it = slice.recorded.find(name);
    if (it == slice.recorded.end()) return;
    if (name != "tokens" && name != "labels") it->second.budget = budget;
    result.tensors.push_back(std::move(it->second));
  };
  take("tokens");
  take("labels");
  for (const std::string& name : slice.order) {
    take(name);
    take(name + "_grad");
  }
  const auto whole = [&](std::string name, const Shape& shape, const Tensor& value, bool partial) {
    ReferenceTensor w;
    w.name = std::move(name);
    w.full_shape = shape;
    w.partial = partial;
    w.value = value;
    w.budget = budget;
    result.tensors.push_back(std::move(w));
    return &result.tensors.back();
  };
  for (const GptParameter& gp : params.list) {
    const Param& p = params.by_name.at(gp.name);
    whole(gp.name, gp.shape, p.value, false)->parameter = true;
    whole(gp.name + ".grad", gp.shape, p.grad, true)->gradient_of = gp.name;
  }
  Tensor loss = NewTensor({1});
  loss.data_as<double>()[0] = result.loss;
  whole("loss", {1}, loss, true);
  for (const auto& [router, counts] : tokens_per_expert) {
    const std::vector<double>& bias = routers.at(router)->expert_bias;
    const Shape shape{gpt.moe.num_experts};
    Tensor b = NewTensor(shape), c = NewTensor(shape);
    std::copy(bias.begin(), bias.end(), b.data_as<double>());
    std::copy(counts.begin(), counts.end(), c.data_as<double>());
    // Exact values (float32 steps of the rate; whole counts): compared for equality.
    whole(router + ".expert_bias", shape, b, false)->budget = ErrorBudget{};
    whole(router + ".local_tokens_per_expert", shape, c, true)->budget = ErrorBudget{};
  }
  return result;
}

void FinishGptReferenceIteration(const GptConfig& gpt, ReferenceResult& result, bool trained,
                                 std::map<std::string, Tensor>* state) {
  const std::string counts_suffix = ".local_tokens_per_expert", bias_suffix = ".expert_bias";
  std::map<std::string, Tensor> counts;  // by the router's prefix
  for (const ReferenceTensor& t : result.tensors) {
    if (t.name.ends_with(counts_suffix)) {
      counts[t.name.substr(0, t.name.size() - counts_suffix.size())] = t.value;
    }
  }
  std::erase_if(result.tensors,
                [&](const ReferenceTensor& t) { return t.name.ends_with(counts_suffix); });
  for (ReferenceTensor& t : result.tensors) {
    if (!t.name.ends_with(bias_suffix)) continue;
    const Tensor& c = counts.at(t.name.substr(0, t.name.size() - bias_suffix.size()));
    Tensor next = NewTensor(t.value.shape());
    const auto n = static_cast<size_t>(c.numel());
    // get_updated_expert_bias, in float32 as Megatron's buffer: offset = mean - count,
    // bias + sign(offset) * rate.
    float total = 0;
    for (size_t e = 0; e < n; ++e) total += static_cast<float>(c.data_as<double>()[e]);
    const float mean = total / static_cast<float>(n);
    const auto rate = static_cast<float>(gpt.moe.bias_update_rate);
    for (size_t e = 0; e < n; ++e) {
      const auto bias = static_cast<float>(t.value.data_as<double>()[e]);
      const float offset = mean - static_cast<float>(c.data_as<double>()[e]);
      const float sign = offset > 0 ? 1.0f : offset < 0 ? -1.0f : 0.0f;
      next.data_as<double>()[e] = trained ? static_cast<double>(bias + sign * rate) : bias;
    }
    t.value = next;
    (*state)[t.name] = next;
  }
}

}  // namespace mpusim
