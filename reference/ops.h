// The float64 reference's ops, each written once: the math that both references run, the
// layer chain (reference_model.cc) and the GPT model (gpt_reference.cc). Each op is a plain
// Eigen function on row-major matrices, one token per row, its forward and backward side by
// side.
//
// What it is: the per-token math of docs/simulator.md and core/config/gpt_config.h (linear layers,
// embedding lookups, activations, dropout masks, cross entropy), with no knowledge of the
// parallel layout beyond what a dropout mask's draw needs, and no error budgets (the chain
// counts those where it calls an op). What it is not: the executor's ops (core/ops, the
// backends' kernels). It shares no code with them: only the Activation enum that names an
// activation, and the random draws (core/philox.h, core/rng.h) that define the inputs.
//
// Shape legend: n = rows (tokens), in/out = a linear layer's widths, w = an activation's
// width, F = a gated activation's output width (its input is [n, 2F]), V = embedding rows,
// Vp = logits per token. Weights are [out, in], as the checkpoints store them.
//
// The arithmetic of each op is in one fixed order: the references' values, which the checks
// and the dumps compare, stay the same to the last bit as long as the order does. An output
// must not alias an input.
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <span>

#include "core/config/gpt_config.h"  // Activation, IsGated
#include "core/philox.h"

namespace mpusim::ref {

using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowVec = Eigen::Matrix<double, 1, Eigen::Dynamic>;
using MatRef = Eigen::Ref<Mat>;
using ConstMatRef = Eigen::Ref<const Mat>;
using RowRef = Eigen::Ref<RowVec>;
using ConstRowRef = Eigen::Ref<const RowVec>;

// ---- linear: y = x W^T + b -----------------------------------------------------------------

// y [n, out] = x [n, in] W^T, W [out, in].
void LinearForward(ConstMatRef x, ConstMatRef w, MatRef y);
// y [n, w] += b [w] on every row: a linear layer's bias, or one added by a later op
// (skip_bias_add, the bias-dropout-add).
void AddBias(ConstRowRef b, MatRef y);
// dx [n, in] = dy [n, out] W.
void LinearGradInput(ConstMatRef dy, ConstMatRef w, MatRef dx);
// dW [out, in] += dy^T x: adds, because a weight's gradient sums every micro-batch (and both
// uses of a tied weight).
void LinearGradWeight(ConstMatRef dy, ConstMatRef x, MatRef dw);
// db [out] += the column sums of dy [n, out] (adds, as the weight's).
void LinearGradBias(ConstMatRef dy, RowRef db);

// ---- embedding: a lookup of rows -------------------------------------------------------------

// y [n, h]: row r is row tokens[r] of W [V, h].
void EmbeddingForward(ConstMatRef w, std::span<const int64_t> tokens, MatRef y);
// dW [V, h] row tokens[r] += dy [n, h] row r, in row order: a token that repeats adds each of
// its rows.
void EmbeddingBackward(ConstMatRef dy, std::span<const int64_t> tokens, MatRef dw);

// ---- activations -----------------------------------------------------------------------------
//   gelu          f(x) = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))   (exact, not tanh)
//   swiglu        gated silu: silu(a) = a sigmoid(a)
//   squared_relu  f(x) = relu(x)^2

double Gelu(double x);
// Phi(x) + x phi(x).
double GeluGrad(double x);
double Sigmoid(double x);
// f and f' of an activation (for swiglu: silu, its gate's function).
double ActivationF(Activation kind, double x);
double ActivationGrad(Activation kind, double x);

// Plain: y [n, w] = f(x [n, w]). Gated: x = [a | b] [n, 2F] (F = y's columns), y [n, F] =
// f(a) * (b + glu.linear_offset), a and b first clamped when glu.clamped (GluOptions,
// core/ops/activation.h: a <= c, -c <= b <= c).
void ActivationForward(Activation kind, ConstMatRef x, MatRef y, const GluOptions& glu = {});
// Plain: dx = dy * f'(x). Gated: da = dy * (b + o) * f'(a), db = dy * f(a) with the clamped
// a, b; dx [n, 2F] = [da | db], each zero where its clamp bit (a > c; |b| > c).
void ActivationBackward(Activation kind, ConstMatRef dy, ConstMatRef x, MatRef dx,
                        const GluOptions& glu = {});

// ---- dropout ---------------------------------------------------------------------------------
// Element e of a mask with probability p is kept iff its uniform draw UniformAt(key, stream,
// index) (core/philox.h) is >= p; kept elements scale by 1/(1-p) so that the mean is
// unchanged. Which (key, stream, index) an element draws is the model's business
// (core/dropout.h): the helpers below are the rng_tracker parts that both models share.

// 1/(1-p); 0 for p = 1 (every element is dropped).
double KeepScale(double p);

// Where one mask element's uniform number comes from: UniformAt(key, stream, index).
struct MaskDraw {
  uint64_t key, stream, index;
};

// The key of a rank's RNG tracker stream (core/rng.h): the "default" stream's
// DefaultSeed(seed, pp_rank, dp_rank), the same on every tp rank, or the "model-parallel-rng"
// stream's ModelParallelSeed(that, tp_rank), one per tp rank.
uint64_t TrackerKey(uint64_t seed, int64_t pp_rank, int64_t dp_rank, bool model_parallel,
                    int64_t tp_rank);

// Element (i, g, c) of an [s, B, w] activation as the rank holding it sees it, when the ranks
// hold local [s_local, b, w_local] pieces: position i on the sequence shard i / s_local (0
// without sequence parallelism, s_local = s), sample g on dp rank g / b, and the row-major
// index of (i % s_local, g % b, local_column) in the local piece.
struct LocalElement {
  int64_t seq_rank;
  int64_t dp_rank;
  int64_t index;
};
LocalElement LocalActivationElement(int64_t i, int64_t g, int64_t local_column, int64_t s_local,
                                    int64_t b, int64_t w_local);

// keep [rows, cols]: KeepScale(p) where the draw of element (r, c), draw_of(r, c) -> MaskDraw,
// is >= p, else 0. p = 0 keeps every element without drawing (every draw is >= 0).
template <typename DrawOf>
void DropoutKeep(double p, DrawOf&& draw_of, MatRef keep) {
  if (p == 0.0) {
    keep.setOnes();
    return;
  }
  const double scale = KeepScale(p);
  for (int64_t r = 0; r < keep.rows(); ++r) {
    for (int64_t c = 0; c < keep.cols(); ++c) {
      const MaskDraw at = draw_of(r, c);
      keep(r, c) = UniformAt(at.key, at.stream, at.index) >= p ? scale : 0.0;
    }
  }
}

// ---- loss ------------------------------------------------------------------------------------

// Vocab-parallel cross entropy over all Vp logits of each row, with the label smoothing ls
// spread as Megatron does, sm = ls * Vp / (Vp - 1):
//   loss = (1 - sm)(logZ - z_y) + sm (logZ - mean_j z_j),  logZ = log sum_j exp z_j
//   d loss / d z_j = softmax_j - (1 - sm)[j == y] - sm / Vp.
// Shifting z by its row max changes neither and keeps exp() finite. logits [n, Vp], labels
// [n] in [0, Vp), loss [n]; dlogits [n, Vp] gets the gradient times token_scale (d total loss
// / d per-token loss; 1 gives the per-token gradient).
void CrossEntropy(ConstMatRef logits, std::span<const int64_t> labels, double label_smoothing,
                  double token_scale, std::span<double> loss, MatRef dlogits);

}  // namespace mpusim::ref
