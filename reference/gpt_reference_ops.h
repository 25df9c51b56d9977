// The GPT reference's own ops (gpt_reference.cc), on one slice of the samples: a linear layer
// on its parameters, LayerNorm and RMSNorm, the dropout masks of both dropout modes, and causal
// attention with RoPE, each forward with its backward; and what they share with the model: its
// sizes (Dims), the handles of its parameters and the views of a tensor as a matrix. The ops
// both references share are reference/ops.h. Shared by gpt_reference.cc (the parameters, the
// micro-batch loop, the entry points) and gpt_reference_ops.cc; not an interface of its own.
//
// Shape legend: as gpt_reference.cc's. An activation [s, n, w] is a row-major [s*n, w] matrix:
// row i*n + j holds position i of slice sample j.
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/config/gpt_config.h"
#include "core/tensor.h"
#include "reference/ops.h"
#include "reference/tracker_draws.h"

namespace mpusim::gpt_reference {

using Mat = ref::Mat;
using Vec = Eigen::VectorXd;
using RowVec = ref::RowVec;
using MatMap = Eigen::Map<Mat>;
using ConstMatMap = Eigen::Map<const Mat>;
using RowMap = Eigen::Map<RowVec>;
using ConstRowMap = Eigen::Map<const RowVec>;

// The model's sizes and this slice's samples (legend: gpt_reference.cc).
struct Dims {
  uint64_t seed = 0;
  int64_t iteration = 0;  // the training iteration: its data and dropout streams
  int64_t s = 0, B = 0, M = 0;
  int64_t n = 0, sample_begin = 0;  // this slice
  int64_t h = 0, a = 0, g = 0, r = 0, dk = 0, F = 0, f1 = 0, V = 0, Vp = 0, L = 0;
  int64_t qkv = 0;  // (a + 2g) * dk
  int64_t rd = 0;   // channels of a head RoPE turns: int(dk * rotary_percent)
  // dropout_mode "rng_tracker" (core/dropout.h): masks depend on who draws them, so the
  // layout enters: t, sequence parallelism, b samples per dp rank, cp (whose ranks draw from
  // the same streams as Megatron's, on the tokens each holds), and each site's draw.
  bool tracker = false;
  int64_t t = 1, b = 1;
  bool sp = false;
  // context_parallel_size: the tracker's draws above, and multi-token prediction's loss
  // normalisation (each cp rank divides by its own unmasked tokens), set whatever the mode.
  int64_t cp = 1;
  // cp_comm_type "a2a": each cp rank holds 1/cp of its tp rank's heads for every query,
  // rather than its query positions for every head.
  bool cp_heads = false;
  struct SiteDraw {
    bool model_parallel = false;  // "model-parallel-rng", else "default"
    int64_t pp = 0;               // the pipeline rank that draws it (its key)
    int64_t chunk = 0;            // the model chunk of that rank holding it
    int64_t k = 0;                // its draw among that chunk's draws on its stream
  };
  std::map<std::string, SiteDraw> draw;
  // Where each pipeline rank's forwards start drawing (reference/tracker_draws.h).
  DrawPositions draws;
};

// ---- tensors ------------------------------------------------------------------------------

// A float64 tensor as a row-major matrix, or as one row.
inline ConstMatMap AsMat(const Tensor& t) {
  return ConstMatMap(t.data_as<double>(), t.rows(), t.cols());
}
inline MatMap AsMat(Tensor& t) { return MatMap(t.data_as<double>(), t.rows(), t.cols()); }
inline ConstRowMap AsRow(const Tensor& t) { return ConstRowMap(t.data_as<double>(), t.numel()); }
inline RowMap AsRow(Tensor& t) { return RowMap(t.data_as<double>(), t.numel()); }

// ---- parameters ---------------------------------------------------------------------------

// A parameter and its gradient accumulator; both undefined where the model has none.
struct Param {
  Tensor value;
  Tensor grad;
  bool defined() const { return value.defined(); }
};

struct NormParams {
  Param weight;
  Param bias;  // LayerNorm only
};

// q_layernorm and k_layernorm (qk_layernorm): the model's normalization over a head's dk
// channels, shared by the heads; undefined without qk_layernorm.
struct QkNormParams {
  NormParams q, k;
  bool defined() const { return q.weight.defined(); }
};

// ---- ops ----------------------------------------------------------------------------------

// y = x W^T (+ b).
Mat Linear(const Mat& x, const Param& weight, const Param& bias);
// dx = dy W; dW += dy^T x; db += sum over rows of dy.
Mat LinearBackward(const Mat& dy, const Mat& x, Param& weight, Param& bias);

// What NormForward keeps for NormBackward (the math: gpt_reference_ops.cc).
struct NormStash {
  Mat xhat;  // [rows, h]
  Vec rstd;  // [rows]
};

// LayerNorm or RMSNorm of each row: y = xhat * w (+ b).
Mat NormForward(Normalization kind, double eps, const Mat& x, const NormParams& p,
                NormStash* stash);
// dx; dw and db add into the gradient accumulators.
Mat NormBackward(Normalization kind, const Mat& dy, const NormStash& stash, NormParams& p);

// ---- dropout ------------------------------------------------------------------------------

// 0 or 1/(1-p) for this slice's rows of an [s, B, w] site: row i*n + j is position i of slice
// sample j.
Mat HiddenKeep(const Dims& d, const std::string& site, int64_t m, double p, int64_t w);

// ---- attention ----------------------------------------------------------------------------

// A layer's softmax beyond the causal mask: its sliding window (window_size[0] on a sliding
// layer, -1: none) and its attention sink (Megatron's SoftmaxOne: "off-by-one" a logit 0 per
// head, "learnable" the parameter core_attention.softmax_offset [a], `sink`).
struct AttentionSoftmax {
  int64_t window = -1;
  SoftmaxType type = SoftmaxType::kVanilla;
  Param sink;  // "learnable" only
  bool has_sink() const { return type != SoftmaxType::kVanilla; }
  double Sink(int64_t head) const {
    return sink.defined() ? sink.value.data_as<double>()[head] : 0.0;
  }
};

// 0 or 1/(1-p) for the [s, s] probabilities of slice sample j, head hd of the [B, a, s, s]
// attention dropout site `site`.
Mat AttentionKeep(const Dims& d, const std::string& site, int64_t m, double p, int64_t j,
                  int64_t hd);

struct AttentionStash {
  std::vector<Mat> q;      // [n*a] (index j*a + hd): normalised, rotated query heads [s, dk]
  std::vector<Mat> k, v;   // [n*g] (index j*g + grp): normalised, rotated key heads, value
                           // heads [s, dk]
  std::vector<NormStash> q_norm, k_norm;  // qk_layernorm only, indexed as q and k
  std::vector<Mat> probs;  // [n*a]: softmax [s, s], exactly 0 above the diagonal (and
                           // before a sliding window)
  std::vector<Mat> keep;   // [n*a]: attention dropout scales [s, s]
  std::vector<Vec> sink;   // [n*a]: each row's sink probability exp(o) / denominator [s]
};

// context[i, j, hd*dk + c] = sum_ki dropout(softmax_ki(q_i . k_ki / sqrt(dk), ki <= i)) v_ki,
// the dropout masks of `site` in micro-batch m; q and k each head's slice of qkv, normalised
// by `qk_norm` when defined, then turned by RoPE. With a sliding window (sm.window >= 0,
// window_size [window, 0]) the softmax runs only over i - window <= ki <= i; the backward
// needs no window of its own (the probabilities outside it are exactly 0). With a sink o of
// the head the softmax's denominator is exp(o) + sum_ki exp(score).
Mat AttentionForward(const Dims& d, const GptConfig& gpt, const AttentionSoftmax& sm,
                     const Mat& qkv, const QkNormParams& qk_norm, const std::string& site,
                     int64_t m, AttentionStash* st);
// Returns d qkv [s*n, (a+2g)*dk]; `dprobs` gets the [n*a] matrices d loss / d probs; the q/k
// norms' gradients and a learnable sink's (d o = -sum over the head's rows of p_o rowsum(dprobs
// probs)) add into their accumulators.
Mat AttentionBackward(const Dims& d, const GptConfig& gpt, const Mat& dcontext,
                      const AttentionStash& st, QkNormParams& qk_norm, AttentionSoftmax& sm,
                      std::vector<Mat>* dprobs);

}  // namespace mpusim::gpt_reference
