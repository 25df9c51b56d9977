// Tests of the float64 reference model (reference/reference_model.h), single process.
//
// Gradients are checked by central finite differences of the loss; the other tests build
// small cases by hand from the contract (docs/simulator.md): the synthetic data and master
// weights come from core/init.h, the dropout masks from core/philox.h and core/rng.h.
// Tolerances: finite differences carry O(eps^2) truncation and O(1e-16 / eps) rounding
// error; everything else is compared exactly or to 1e-13 (softmax, GELU and sums done in
// another order).
#include "reference/reference_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/init.h"
#include "core/philox.h"
#include "core/rng.h"
#include "core/sharding.h"

namespace mpusim {
namespace {

// ---- config builders ------------------------------------------------------------------

LayerConfig Embedding(const std::string& name, int64_t dim) {
  LayerConfig layer;
  layer.name = name;
  layer.type = LayerType::kVocabParallelEmbedding;
  layer.embedding_dim = dim;
  return layer;
}

LayerConfig Linear(const std::string& name, LayerType type, int64_t in, int64_t out) {
  LayerConfig layer;
  layer.name = name;
  layer.type = type;
  layer.input_size = in;
  layer.output_size = SizeValue{out, false};
  return layer;
}

// ColumnParallelLinear with a hidden-split output (gather_output false).
LayerConfig Column(const std::string& name, int64_t in, int64_t out) {
  LayerConfig layer = Linear(name, LayerType::kColumnParallelLinear, in, out);
  layer.gather_output = false;
  return layer;
}

// The LM head: [padded_vocab_size, in], no bias.
LayerConfig Head(const std::string& name, int64_t in) {
  LayerConfig layer = Column(name, in, 0);
  layer.output_size = SizeValue{0, true};
  layer.bias = false;
  return layer;
}

LayerConfig Row(const std::string& name, int64_t in, int64_t out) {
  LayerConfig layer = Linear(name, LayerType::kRowParallelLinear, in, out);
  layer.input_is_parallel = true;
  return layer;
}

LayerConfig Simple(const std::string& name, LayerType type) {
  LayerConfig layer;
  layer.name = name;
  layer.type = type;
  return layer;
}

LayerConfig Dropout(const std::string& name, double p) {
  LayerConfig layer = Simple(name, LayerType::kDropout);
  layer.p = p;
  return layer;
}

LayerConfig Loss(const std::string& name, double label_smoothing) {
  LayerConfig layer = Simple(name, LayerType::kVocabParallelCrossEntropy);
  layer.label_smoothing = label_smoothing;
  return layer;
}

ParallelConfig Parallel(int64_t tp_size, int64_t world_size, bool sequence_parallel = false) {
  ParallelConfig parallel;
  parallel.tensor_model_parallel_size = tp_size;
  parallel.world_size = world_size;
  parallel.sequence_parallel = sequence_parallel;
  return parallel;
}

RunConfig RunOf(int64_t seq, int64_t micro_batch, int64_t num_micro) {
  RunConfig run;
  run.seed = 1234;
  run.seq_length = seq;
  run.micro_batch_size = micro_batch;
  run.num_microbatches = num_micro;
  return run;
}

ModelConfig Model(std::optional<int64_t> vocab, int64_t divisible_by,
                  std::vector<LayerConfig> layers) {
  ModelConfig model;
  model.vocab_size = vocab;
  model.make_vocab_size_divisible_by = divisible_by;
  model.layers = std::move(layers);
  return model;
}

// ---- result access ----------------------------------------------------------------------

const Tensor& Get(const ReferenceResult& result, const std::string& name) {
  static const Tensor kMissing;
  const ReferenceTensor* t = result.Find(name);
  EXPECT_NE(t, nullptr) << "no tensor " << name;
  return t == nullptr ? kMissing : t->value;
}

Shape FullShape(const ReferenceResult& result, const std::string& name) {
  const ReferenceTensor* t = result.Find(name);
  EXPECT_NE(t, nullptr) << "no tensor " << name;
  return t == nullptr ? Shape{} : t->full_shape;
}

size_t Count(const ReferenceResult& result, const std::string& name) {
  return result.Find(name) == nullptr ? 0 : 1;
}

std::vector<double> Values(const ReferenceResult& result, const std::string& name) {
  const Tensor& t = Get(result, name);
  if (!t.defined()) return {};
  const double* data = t.data_as<double>();
  return std::vector<double>(data, data + t.numel());
}

double Norm(const std::vector<double>& v) {
  double sum = 0.0;
  for (double x : v) sum += x * x;
  return std::sqrt(sum);
}

ReferenceResult MustRun(const ParallelConfig& parallel, const ModelConfig& model,
                        const RunConfig& run, const std::map<std::string, Tensor>& overrides = {}) {
  StatusOr<ReferenceResult> result = RunReferenceWithOverrides(parallel, model, run, overrides);
  EXPECT_TRUE(result.ok()) << result.status().Message();
  return result.ok() ? std::move(result).value() : ReferenceResult{};
}

Tensor Copy(const Tensor& t) {
  Tensor out = Tensor::HostZeros(t.shape(), DType::kFloat64);
  for (int64_t k = 0; k < t.numel(); ++k) out.data_as<double>()[k] = t.data_as<double>()[k];
  return out;
}

Tensor FromValues(const Shape& shape, const std::vector<double>& values) {
  Tensor out = Tensor::HostZeros(shape, DType::kFloat64);
  for (int64_t k = 0; k < out.numel(); ++k) {
    out.data_as<double>()[k] = values[static_cast<size_t>(k)];
  }
  return out;
}

// |actual - expected| <= atol + rtol * |expected|, elementwise, with NaN/Inf caught first.
::testing::AssertionResult AllNear(const std::string& name, const std::vector<double>& actual,
                                   const std::vector<double>& expected, double atol, double rtol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << name << ": " << actual.size() << " elements, expected " << expected.size();
  }
  for (size_t k = 0; k < actual.size(); ++k) {
    if (!std::isfinite(actual[k]) || !std::isfinite(expected[k]) ||
        std::abs(actual[k] - expected[k]) > atol + rtol * std::abs(expected[k])) {
      return ::testing::AssertionFailure()
             << name << "[" << k << "]: " << actual[k] << " vs " << expected[k];
    }
  }
  return ::testing::AssertionSuccess();
}

// d loss / d param[flat] by central differences, eps = 1e-6.
double FiniteDifference(const ParallelConfig& parallel, const ModelConfig& model,
                        const RunConfig& run, const ReferenceResult& base, const std::string& param,
                        int64_t flat, std::map<std::string, Tensor> overrides = {}) {
  constexpr double kEps = 1e-6;
  const Tensor& value = Get(base, param);
  double loss[2] = {0.0, 0.0};
  for (int side = 0; side < 2; ++side) {
    Tensor perturbed = Copy(value);
    perturbed.data_as<double>()[flat] += side == 0 ? kEps : -kEps;
    overrides[param] = perturbed;
    loss[side] = MustRun(parallel, model, run, overrides).loss;
  }
  return (loss[0] - loss[1]) / (2.0 * kEps);
}

::testing::AssertionResult GradientMatches(const std::string& what, double analytic,
                                           double numeric) {
  // Rounding of a ~3 loss over 2 eps = 2e-6 leaves ~1e-10 absolute noise; observed relative
  // errors are below 2e-7.
  if (std::abs(analytic) < 1e-6) {
    return ::testing::AssertionFailure()
           << what << ": gradient " << analytic << " too small to check";
  }
  if (std::abs(analytic - numeric) <= 1e-6 * std::abs(analytic) + 1e-10) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << what << ": analytic " << analytic << " vs finite "
                                       << "difference " << numeric;
}

// ---- gradients --------------------------------------------------------------------------

// embedding -> fc1 -> gelu -> fc2 -> head -> loss, t = 2, d = 2, M = 2.
ModelConfig Mlp() {
  return Model(10, 4,
               {Embedding("embedding", 8), Column("fc1", 8, 16), Simple("gelu", LayerType::kGeLU),
                Row("fc2", 16, 8), Head("head", 8), Loss("loss", 0.1)});
}

TEST(ReferenceModelTest, MlpGradientsMatchFiniteDifferences) {
  const ParallelConfig parallel = Parallel(2, 4);
  const ModelConfig model = Mlp();
  const RunConfig run = RunOf(4, 2, 2);
  // Biases start at zero; nonzero ones make the bias gradients go through GeLU curvature.
  std::map<std::string, Tensor> overrides;
  std::vector<double> fc1_bias(16), fc2_bias(8);
  for (size_t k = 0; k < fc1_bias.size(); ++k) fc1_bias[k] = 0.1 * static_cast<double>(k) - 0.7;
  for (size_t k = 0; k < fc2_bias.size(); ++k) fc2_bias[k] = 0.05 * static_cast<double>(k);
  overrides["fc1.bias"] = FromValues({16}, fc1_bias);
  overrides["fc2.bias"] = FromValues({8}, fc2_bias);
  const ReferenceResult base = MustRun(parallel, model, run, overrides);
  ASSERT_TRUE(base.has_loss);

  // Shapes: Vp = 10 rounded up to a multiple of 4 * t = 8 -> 16; B = b * d = 4.
  EXPECT_EQ(FullShape(base, "tokens"), (Shape{4, 4}));
  EXPECT_EQ(FullShape(base, "labels"), (Shape{4, 4}));
  EXPECT_EQ(FullShape(base, "embedding.weight"), (Shape{16, 8}));
  EXPECT_EQ(FullShape(base, "embedding.output"), (Shape{4, 4, 8}));
  EXPECT_EQ(FullShape(base, "fc1.weight"), (Shape{16, 8}));
  EXPECT_EQ(FullShape(base, "fc1.bias_grad"), (Shape{16}));
  EXPECT_EQ(FullShape(base, "head.weight"), (Shape{16, 8}));
  EXPECT_EQ(FullShape(base, "head.output"), (Shape{4, 4, 16}));
  EXPECT_EQ(FullShape(base, "loss.input_grad"), (Shape{4, 4, 16}));
  EXPECT_EQ(FullShape(base, "loss.output"), (Shape{4, 4}));
  EXPECT_EQ(FullShape(base, "loss.output_grad"), (Shape{4, 4}));
  EXPECT_EQ(FullShape(base, "loss"), (Shape{1}));
  EXPECT_EQ(Count(base, "embedding.input"), 0u);
  EXPECT_EQ(Count(base, "embedding.input_grad"), 0u);
  EXPECT_EQ(Count(base, "head.bias"), 0u);
  EXPECT_EQ(Values(base, "loss")[0], base.loss);
  // dl/d(token) = 1 / (M * s * B) = 1 / 32.
  for (double g : Values(base, "loss.output_grad")) EXPECT_EQ(g, 1.0 / 32.0);

  struct Probe {
    std::string param;
    int64_t flat;
  };
  const int64_t token = static_cast<int64_t>(Values(base, "tokens")[0]);
  const std::vector<Probe> probes = {
      {"fc1.weight", 3 * 8 + 5},
      {"fc1.weight", 15 * 8 + 0},
      {"fc2.weight", 1 * 16 + 2},
      {"fc2.weight", 7 * 16 + 11},
      {"head.weight", 7 * 8 + 3},
      {"head.weight", 12 * 8 + 6},
      {"embedding.weight", token * 8 + 1},
      {"fc1.bias", 4},
      {"fc1.bias", 9},
      {"fc2.bias", 2},
  };
  for (const Probe& probe : probes) {
    const std::string grad_name = probe.param.substr(0, probe.param.find('.')) +
                                  (probe.param.ends_with(".bias") ? ".bias_grad" : ".weight_grad");
    const double analytic = Values(base, grad_name)[static_cast<size_t>(probe.flat)];
    const double numeric =
        FiniteDifference(parallel, model, run, base, probe.param, probe.flat, overrides);
    EXPECT_TRUE(
        GradientMatches(probe.param + "[" + std::to_string(probe.flat) + "]", analytic, numeric));
  }
}

TEST(ReferenceModelTest, LossIsTheMeanOverAllMicroBatches) {
  const ParallelConfig parallel = Parallel(2, 4);
  const ModelConfig model = Mlp();
  const ReferenceResult one = MustRun(parallel, model, RunOf(4, 2, 1));
  const ReferenceResult two = MustRun(parallel, model, RunOf(4, 2, 2));
  // Micro-batch 0 (s * B = 16 tokens) is the same in both runs; the two-micro-batch loss
  // averages in micro-batch 1, whose per-token losses are two's "loss.output".
  double last_sum = 0.0;
  for (double l : Values(two, "loss.output")) last_sum += l;
  ASSERT_EQ(Values(two, "loss.output").size(), 16u);
  EXPECT_NEAR(two.loss, (one.loss * 16.0 + last_sum) / 32.0, 1e-14);
  EXPECT_NE(Values(one, "tokens"), Values(two, "tokens"));  // tokens.mb0 vs tokens.mb1
}

// ---- synthetic input and output gradient ---------------------------------------------

TEST(ReferenceModelTest, ChainWithoutLossUsesSyntheticOutputGrad) {
  const int64_t s = 3, b = 2, in = 6, out = 5, num_micro = 2;
  const ModelConfig model = Model(std::nullopt, 128, {Column("fc", in, out)});
  const ReferenceResult result = MustRun(Parallel(1, 1), model, RunOf(s, b, num_micro));
  EXPECT_FALSE(result.has_loss);
  EXPECT_EQ(Count(result, "loss"), 0u);

  const uint64_t seed = 1234;
  const InitSpec normal{InitMethod::kNormal, 1.0};
  const Shape w_shape = {out, in};
  std::vector<double> w(static_cast<size_t>(out * in));
  for (size_t f = 0; f < w.size(); ++f) {
    w[f] = MasterValue(seed, "fc.weight", InitSpec{}, w_shape, static_cast<int64_t>(f));
  }
  EXPECT_EQ(Values(result, "fc.weight"), w);
  EXPECT_EQ(Values(result, "fc.bias"), std::vector<double>(out, 0.0));

  const int64_t rows = s * b;
  std::vector<double> weight_grad(w.size(), 0.0), bias_grad(out, 0.0);
  std::vector<double> x, dy, y, dx;
  for (int64_t m = 0; m < num_micro; ++m) {
    const std::string mb = ".mb" + std::to_string(m);
    x.assign(static_cast<size_t>(rows * in), 0.0);
    dy.assign(static_cast<size_t>(rows * out), 0.0);
    for (size_t f = 0; f < x.size(); ++f) {
      x[f] = MasterValue(seed, "input" + mb, normal, {s, b, in}, static_cast<int64_t>(f));
    }
    for (size_t f = 0; f < dy.size(); ++f) {
      dy[f] = MasterValue(seed, "output_grad" + mb, normal, {s, b, out}, static_cast<int64_t>(f));
    }
    y.assign(dy.size(), 0.0);
    dx.assign(x.size(), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        const double g = dy[static_cast<size_t>(r * out + o)];
        bias_grad[static_cast<size_t>(o)] += g;
        for (int64_t k = 0; k < in; ++k) {
          const double xv = x[static_cast<size_t>(r * in + k)];
          const double wv = w[static_cast<size_t>(o * in + k)];
          y[static_cast<size_t>(r * out + o)] += xv * wv;          // Y = X W^T
          dx[static_cast<size_t>(r * in + k)] += g * wv;           // dX = dY W
          weight_grad[static_cast<size_t>(o * in + k)] += g * xv;  // dW = dY^T X
        }
      }
    }
  }
  ASSERT_GT(Norm(dx), 0.0);
  EXPECT_EQ(Values(result, "fc.input"), x);  // the last micro-batch
  EXPECT_EQ(Values(result, "fc.output_grad"), dy);
  EXPECT_EQ(FullShape(result, "fc.input"), (Shape{s, b, in}));
  EXPECT_TRUE(AllNear("fc.output", Values(result, "fc.output"), y, 1e-14, 1e-13));
  EXPECT_TRUE(AllNear("fc.input_grad", Values(result, "fc.input_grad"), dx, 1e-14, 1e-13));
  EXPECT_TRUE(
      AllNear("fc.weight_grad", Values(result, "fc.weight_grad"), weight_grad, 1e-14, 1e-13));
  EXPECT_TRUE(AllNear("fc.bias_grad", Values(result, "fc.bias_grad"), bias_grad, 1e-14, 1e-13));
}

TEST(ReferenceModelTest, SyntheticDataSpansTheDataParallelBatch) {
  // d = 3 data-parallel ranks of b = 2 samples: the full model sees B = 6.
  const ModelConfig model = Model(std::nullopt, 128, {Column("fc", 4, 4)});
  const ReferenceResult result = MustRun(Parallel(2, 6), model, RunOf(2, 2, 1));
  EXPECT_EQ(FullShape(result, "fc.input"), (Shape{2, 6, 4}));
  EXPECT_EQ(FullShape(result, "fc.output_grad"), (Shape{2, 6, 4}));
}

// ---- cross entropy ------------------------------------------------------------------------

// -sum_j q_j log softmax_j with q_y = 1 - alpha, q_j = alpha / (Vp - 1) elsewhere: the
// smoothed-target cross entropy, written differently from the contract's formula.
void CheckCrossEntropy(double alpha) {
  // Vp = 3 rounded up to a multiple of 4 = 4 logits, one of them padding.
  const int64_t s = 2, b = 2, vp = 4;
  const ModelConfig model = Model(3, 4, {Loss("loss", alpha)});
  const ReferenceResult result = MustRun(Parallel(1, 1), model, RunOf(s, b, 1));
  const std::vector<double> logits = Values(result, "loss.input");
  const std::vector<double> labels = Values(result, "labels");
  ASSERT_EQ(logits.size(), static_cast<size_t>(s * b * vp));

  double total = 0.0;
  std::vector<double> per_token, grad;
  for (int64_t r = 0; r < s * b; ++r) {
    const auto y = static_cast<int64_t>(labels[static_cast<size_t>(r)]);
    EXPECT_EQ(static_cast<double>(TokenAt(1234, "labels.mb0", r, 3)),
              labels[static_cast<size_t>(r)]);
    double sum_exp = 0.0;
    for (int64_t j = 0; j < vp; ++j) sum_exp += std::exp(logits[static_cast<size_t>(r * vp + j)]);
    double l = 0.0;
    for (int64_t j = 0; j < vp; ++j) {
      const double q = j == y ? 1.0 - alpha : alpha / static_cast<double>(vp - 1);
      const double softmax = std::exp(logits[static_cast<size_t>(r * vp + j)]) / sum_exp;
      l -= q * std::log(softmax);
      grad.push_back((softmax - q) / static_cast<double>(s * b));
    }
    if (alpha == 0.0) {  // plain NLL
      EXPECT_NEAR(l, std::log(sum_exp) - logits[static_cast<size_t>(r * vp + y)], 1e-14);
    }
    per_token.push_back(l);
    total += l;
  }
  EXPECT_TRUE(AllNear("loss.output", Values(result, "loss.output"), per_token, 1e-15, 1e-13));
  EXPECT_NEAR(result.loss, total / static_cast<double>(s * b), 1e-13);
  EXPECT_TRUE(AllNear("loss.input_grad", Values(result, "loss.input_grad"), grad, 1e-16, 1e-12));
}

TEST(ReferenceModelTest, LabelSmoothingMatchesSmoothedTargetCrossEntropy) {
  CheckCrossEntropy(0.1);
}
TEST(ReferenceModelTest, NoLabelSmoothingIsPlainNll) { CheckCrossEntropy(0.0); }

TEST(ReferenceModelTest, CrossEntropyIsStableForLargeLogits) {
  const ModelConfig model =
      Model(3, 4, {Linear("scale", LayerType::kColumnParallelLinear, 4, 4), Loss("loss", 0.1)});
  // A weight of 1e4 * I makes logits of order 1e4, where a naive exp() overflows.
  std::vector<double> w(16, 0.0);
  for (int k = 0; k < 4; ++k) w[static_cast<size_t>(k * 5)] = 1e4;
  const ReferenceResult result =
      MustRun(Parallel(1, 1), model, RunOf(2, 1, 1), {{"scale.weight", FromValues({4, 4}, w)}});
  EXPECT_TRUE(std::isfinite(result.loss));
  for (double g : Values(result, "loss.input_grad")) EXPECT_TRUE(std::isfinite(g));
}

// ---- skip_bias_add, weight_from, frozen ------------------------------------------------

TEST(ReferenceModelTest, SkipBiasAddWithGeluBiasEqualsBiasedLinearThenGelu) {
  LayerConfig fused_fc = Column("fc", 4, 6);
  fused_fc.skip_bias_add = true;
  LayerConfig fused_gelu = Simple("gelu", LayerType::kGeLU);
  fused_gelu.bias_from = "fc";
  const ModelConfig plain =
      Model(std::nullopt, 128, {Column("fc", 4, 6), Simple("gelu", LayerType::kGeLU)});
  const ModelConfig fused = Model(std::nullopt, 128, {fused_fc, fused_gelu});
  const std::map<std::string, Tensor> bias = {
      {"fc.bias", FromValues({6}, {0.5, -1.0, 0.25, 2.0, -0.75, 0.0})}};
  const ReferenceResult a = MustRun(Parallel(1, 1), plain, RunOf(3, 2, 2), bias);
  const ReferenceResult b = MustRun(Parallel(1, 1), fused, RunOf(3, 2, 2), bias);

  // The skip_bias_add layer's own output has no bias.
  std::vector<double> unbiased = Values(a, "fc.output");
  for (size_t k = 0; k < unbiased.size(); ++k) unbiased[k] -= Values(a, "fc.bias")[k % 6];
  EXPECT_TRUE(AllNear("fc.output", Values(b, "fc.output"), unbiased, 1e-15, 1e-14));
  // Same sums in another order: GELU inputs may differ in the last bit.
  for (const std::string name :
       {"gelu.output", "gelu.input_grad", "fc.input_grad", "fc.weight_grad", "fc.bias_grad"}) {
    ASSERT_GT(Norm(Values(a, name)), 0.0) << name;
    EXPECT_TRUE(AllNear(name, Values(b, name), Values(a, name), 1e-14, 1e-13));
  }
}

TEST(ReferenceModelTest, TiedHeadGradientIsTheSumOfBothUses) {
  LayerConfig tied_head = Head("head", 8);
  tied_head.skip_weight_param_allocation = true;
  tied_head.weight_from = "embedding";
  auto chain = [](LayerConfig head) {
    return Model(10, 4, {Embedding("embedding", 8), Column("fc", 8, 8), head, Loss("loss", 0.1)});
  };
  const ModelConfig tied = chain(tied_head);
  const ModelConfig untied = chain(Head("head", 8));
  const ParallelConfig parallel = Parallel(2, 2);
  const RunConfig run = RunOf(4, 2, 2);

  const ReferenceResult t = MustRun(parallel, tied, run);
  EXPECT_EQ(Count(t, "head.weight"), 0u);
  EXPECT_EQ(Count(t, "head.weight_grad"), 0u);
  // The untied run with the head's weight set to the embedding's computes the same model.
  const ReferenceResult u =
      MustRun(parallel, untied, run, {{"head.weight", Copy(Get(t, "embedding.weight"))}});
  EXPECT_NEAR(u.loss, t.loss, 1e-15);
  std::vector<double> sum = Values(u, "embedding.weight_grad");
  const std::vector<double> head_grad = Values(u, "head.weight_grad");
  for (size_t k = 0; k < sum.size(); ++k) sum[k] += head_grad[k];
  EXPECT_TRUE(
      AllNear("embedding.weight_grad", Values(t, "embedding.weight_grad"), sum, 1e-16, 1e-13));

  // Finite differences through both uses: a looked-up row, and a padding row (id >= 10) that
  // only the head uses.
  const int64_t token = static_cast<int64_t>(Values(t, "tokens")[1]);
  for (int64_t flat : {token * 8 + 2, int64_t{13 * 8 + 5}}) {
    const double analytic = Values(t, "embedding.weight_grad")[static_cast<size_t>(flat)];
    const double numeric = FiniteDifference(parallel, tied, run, t, "embedding.weight", flat);
    EXPECT_TRUE(
        GradientMatches("embedding.weight[" + std::to_string(flat) + "]", analytic, numeric));
  }
}

TEST(ReferenceModelTest, FrozenWeightHasNoGradient) {
  ModelConfig model = Mlp();
  model.layers[1].frozen = true;  // fc1
  const ReferenceResult result = MustRun(Parallel(1, 1), model, RunOf(2, 2, 1));
  EXPECT_EQ(Count(result, "fc1.weight_grad"), 0u);
  EXPECT_EQ(Count(result, "fc1.weight"), 1u);
  EXPECT_EQ(Count(result, "fc1.bias_grad"), 1u);
  EXPECT_EQ(Count(result, "fc2.weight_grad"), 1u);
  // Freezing changes no value: the same run unfrozen has the same loss and fc1.input_grad.
  const ReferenceResult unfrozen = MustRun(Parallel(1, 1), Mlp(), RunOf(2, 2, 1));
  EXPECT_EQ(result.loss, unfrozen.loss);
  EXPECT_EQ(Values(result, "fc1.input_grad"), Values(unfrozen, "fc1.input_grad"));
}

// ---- dropout ------------------------------------------------------------------------------

TEST(ReferenceModelTest, DropoutWithZeroProbabilityIsIdentity) {
  LayerConfig fc = Linear("fc", LayerType::kColumnParallelLinear, 4, 6);  // gather_output
  const ModelConfig model = Model(std::nullopt, 128, {fc, Dropout("drop", 0.0)});
  const ReferenceResult result = MustRun(Parallel(1, 1), model, RunOf(3, 2, 2));
  ASSERT_GT(Norm(Values(result, "drop.input")), 0.0);
  EXPECT_EQ(Values(result, "drop.output"), Values(result, "drop.input"));
  EXPECT_EQ(Values(result, "drop.input_grad"), Values(result, "drop.output_grad"));
}

// Checks y = x * keep / (1 - p) and dx = dy * keep / (1 - p) for one element.
struct MaskCheck {
  const ReferenceResult& result;
  std::string layer;
  double p;
  int64_t kept = 0, dropped = 0;

  void Element(int64_t flat, uint64_t key, uint64_t draw, uint64_t local) {
    const bool keep = UniformAt(key, draw, local) >= p;
    const double scale = keep ? 1.0 / (1.0 - p) : 0.0;
    const auto f = static_cast<size_t>(flat);
    EXPECT_EQ(Values(result, layer + ".output")[f], Values(result, layer + ".input")[f] * scale)
        << layer << " element " << flat;
    EXPECT_EQ(Values(result, layer + ".input_grad")[f],
              Values(result, layer + ".output_grad")[f] * scale)
        << layer << " element " << flat;
    ++(keep ? kept : dropped);
  }
};

TEST(ReferenceModelTest, DropoutMaskOnReplicatedInputComesFromDefaultStream) {
  // t = d = 1: key DefaultSeed(seed, 0, 0), local index = flat index. Two dropout layers on
  // the default stream and M = 2: in micro-batch 1 they make draws 2 and 3.
  const int64_t s = 3, b = 2, h = 6;
  LayerConfig fc = Linear("fc", LayerType::kColumnParallelLinear, 4, h);  // gather_output
  const ModelConfig model =
      Model(std::nullopt, 128, {fc, Dropout("drop1", 0.5), Dropout("drop2", 0.5)});
  const ReferenceResult result = MustRun(Parallel(1, 1), model, RunOf(s, b, 2));
  const uint64_t key = DefaultSeed(1234, 0, 0);
  for (const auto& [layer, draw] : {std::pair<std::string, uint64_t>{"drop1", 2},
                                    std::pair<std::string, uint64_t>{"drop2", 3}}) {
    MaskCheck check{result, layer, 0.5};
    for (int64_t e = 0; e < s * b * h; ++e) check.Element(e, key, draw, static_cast<uint64_t>(e));
    EXPECT_GT(check.kept, 0);
    EXPECT_GT(check.dropped, 0);
  }
}

TEST(ReferenceModelTest, DropoutMaskOnHiddenSplitInputIsDrawnByTheOwningRank) {
  // t = 2, d = 2, b = 1 (B = 2); fc (stride 2) leaves a hidden-split [s, B, 8] activation:
  // rank r_t holds global columns {2 r_t, 2 r_t + 1, 4 + 2 r_t, 5 + 2 r_t}.
  // Stream numbering per micro-batch: dropA (model-parallel #0), dropB (default #0), dropC
  // (model-parallel #1); M = 2, so in micro-batch 1 they draw 2, 1 and 3.
  const int64_t s = 2, b = 1, tp = 2, dp = 2, h = 8, batch = b * dp;
  LayerConfig fc = Column("fc", 4, h);
  fc.stride = 2;
  const ModelConfig model = Model(
      std::nullopt, 128,
      {fc, Dropout("dropA", 0.3), Simple("gather", LayerType::kGatherFromTensorModelParallelRegion),
       Dropout("dropB", 0.3), Simple("scatter", LayerType::kScatterToTensorModelParallelRegion),
       Dropout("dropC", 0.3)});
  const ReferenceResult result = MustRun(Parallel(tp, tp * dp), model, RunOf(s, b, 2));

  struct Case {
    std::string layer;
    int64_t stride;  // 0: replicated
    uint64_t draw;
  };
  for (const Case& c : {Case{"dropA", 2, 2}, Case{"dropB", 0, 1}, Case{"dropC", 1, 3}}) {
    MaskCheck check{result, c.layer, 0.3};
    for (int64_t dp_rank = 0; dp_rank < dp; ++dp_rank) {
      const uint64_t default_key = DefaultSeed(1234, 0, dp_rank);
      for (int64_t tp_rank = 0; tp_rank < (c.stride == 0 ? 1 : tp); ++tp_rank) {
        ShardSpec spec;
        if (c.stride > 0) spec.Split(ShardAxis::kTp, 2, tp, tp_rank, c.stride);
        const uint64_t key = c.stride == 0 ? default_key : ModelParallelSeed(default_key, tp_rank);
        const int64_t local_h = c.stride == 0 ? h : h / tp;
        for (int64_t i = 0; i < s; ++i) {
          for (int64_t local_g = 0; local_g < b; ++local_g) {
            for (int64_t l = 0; l < local_h; ++l) {
              const int64_t j = GlobalIndex(spec, 2, h, l);
              const int64_t g = dp_rank * b + local_g;
              const int64_t e = (i * b + local_g) * local_h + l;
              check.Element((i * batch + g) * h + j, key, c.draw, static_cast<uint64_t>(e));
            }
          }
        }
      }
    }
    EXPECT_EQ(check.kept + check.dropped, s * batch * h) << c.layer;
    EXPECT_GT(check.dropped, 0) << c.layer;
  }
}

TEST(ReferenceModelTest, DropoutMaskOnSequenceSplitInputIsDrawnByTheOwningRank) {
  // Sequence parallel, t = 2, d = 1: the RowParallelLinear reduce-scatters to [s/t, b, h] and
  // rank r_t holds positions [r_t * s/t, (r_t + 1) * s/t).
  const int64_t s = 4, b = 2, tp = 2, h = 3, local_s = s / tp;
  const ModelConfig model = Model(std::nullopt, 128, {Row("fc", 4, h), Dropout("drop", 0.5)});
  const ReferenceResult result = MustRun(Parallel(tp, tp, true), model, RunOf(s, b, 1));
  MaskCheck check{result, "drop", 0.5};
  for (int64_t tp_rank = 0; tp_rank < tp; ++tp_rank) {
    const uint64_t key = ModelParallelSeed(DefaultSeed(1234, 0, 0), tp_rank);
    for (int64_t e = 0; e < local_s * b * h; ++e) {
      check.Element(tp_rank * local_s * b * h + e, key, 0, static_cast<uint64_t>(e));
    }
  }
  EXPECT_GT(check.kept, 0);
  EXPECT_GT(check.dropped, 0);
}

// ---- refused inputs -----------------------------------------------------------------------

TEST(ReferenceModelTest, RefusesWhatItCannotRun) {
  auto error = [](const ParallelConfig& parallel, const ModelConfig& model,
                  const std::map<std::string, Tensor>& overrides = {}) {
    StatusOr<ReferenceResult> result =
        RunReferenceWithOverrides(parallel, model, RunOf(2, 1, 1), overrides);
    return result.ok() ? std::string("ok") : result.status().Message();
  };
  const ParallelConfig one = Parallel(1, 1);
  EXPECT_NE(error(one, Model(10, 4, {Column("fc", 8, 8), Embedding("embedding", 8)})), "ok");
  EXPECT_NE(error(one, Model(16, 4, {Loss("loss", 0.0), Column("fc", 16, 16)})), "ok");
  EXPECT_EQ(error(one, Model(std::nullopt, 128, {Column("fc1", 8, 4), Column("fc2", 5, 4)})),
            "model.layers[1].input_size: is 5 but the incoming activation has width 4");
  EXPECT_NE(error(one, Model(std::nullopt, 128, {Simple("gelu", LayerType::kGeLU)})), "ok");
  EXPECT_NE(error(one, Model(std::nullopt, 128, {})), "ok");
  EXPECT_NE(error(one, Model(std::nullopt, 128, {Column("fc", 4, 4)}),
                  {{"fc.weight", FromValues({4, 3}, std::vector<double>(12, 0.0))}}),
            "ok");
  EXPECT_EQ(error(one, Model(std::nullopt, 128, {Column("fc", 4, 4)}),
                  {{"nope.weight", FromValues({1}, {0.0})}}),
            "parameter_overrides: no parameter named \"nope.weight\"");
  // Hidden split of width 6 into t = 2 ranks x stride 2: no rank owns a whole chunk.
  LayerConfig strided = Column("fc", 4, 6);
  strided.stride = 2;
  EXPECT_NE(error(Parallel(2, 2), Model(std::nullopt, 128, {strided, Dropout("drop", 0.1)})), "ok");
  strided.stride = 1;
  EXPECT_EQ(error(Parallel(2, 2), Model(std::nullopt, 128, {strided, Dropout("drop", 0.1)})), "ok");
  ParallelConfig pipelined = Parallel(1, 2);
  pipelined.pipeline_model_parallel_size = 2;
  EXPECT_NE(error(pipelined, Model(std::nullopt, 128, {Column("fc", 4, 4)})), "ok");
  EXPECT_NE(error(Parallel(2, 3), Model(std::nullopt, 128, {Column("fc", 4, 4)})), "ok");
}

TEST(ReferenceModelTest, RegionMappingsAreIdentity) {
  // A chain that starts with a partial sum: the reference input is the synthetic input itself.
  const ModelConfig model =
      Model(std::nullopt, 128,
            {Simple("reduce", LayerType::kReduceFromTensorModelParallelRegion),
             Simple("copy", LayerType::kCopyToTensorModelParallelRegion),
             Simple("scatter", LayerType::kScatterToSequenceParallelRegion),
             Simple("gather", LayerType::kGatherFromSequenceParallelRegion), Column("fc", 4, 4)});
  const ReferenceResult result = MustRun(Parallel(2, 2), model, RunOf(2, 1, 1));
  const std::vector<double> input = Values(result, "reduce.input");
  ASSERT_GT(Norm(input), 0.0);
  EXPECT_EQ(input[0],
            MasterValue(1234, "input.mb0", InitSpec{InitMethod::kNormal, 1.0}, {2, 1, 4}, 0));
  for (const std::string name : {"reduce", "copy", "scatter", "gather"}) {
    EXPECT_EQ(Values(result, name + ".output"), input) << name;
    EXPECT_EQ(Values(result, name + ".input_grad"), Values(result, "fc.input_grad")) << name;
  }
}

// ---- slices of the batch ------------------------------------------------------------------

// The rows of a run split into slices (the way `mpusim run` splits it over ranks, uneven and
// with an empty slice) give the whole run back: row tensors concatenate, gradient and loss
// shares add up, parameters are the same in every slice.
TEST(ReferenceModelTest, SlicesOfTheBatchAddUpToTheWholeRun) {
  const ParallelConfig parallel = Parallel(2, 4);
  ModelConfig model = Mlp();
  model.layers.insert(model.layers.begin() + 3, Dropout("drop", 0.25));
  const RunConfig run = RunOf(4, 2, 3);  // s*B = 16 rows, 3 micro-batches
  const ReferenceResult whole = MustRun(parallel, model, run);
  ASSERT_EQ(whole.units, 16);
  const std::vector<std::pair<int64_t, int64_t>> slices = {{0, 5}, {5, 5}, {5, 11}, {11, 16}};
  std::vector<ReferenceResult> parts;
  for (const auto& [begin, end] : slices) {
    StatusOr<ReferenceResult> part = RunReference(parallel, model, run, {begin, end});
    ASSERT_TRUE(part.ok()) << part.status().Message();
    EXPECT_EQ(part->slice_begin, begin);
    EXPECT_EQ(part->slice_end, end);
    parts.push_back(std::move(part).value());
  }
  double loss = 0;
  for (const ReferenceResult& part : parts) loss += part.loss;
  EXPECT_NEAR(loss, whole.loss, 1e-14);
  for (const ReferenceTensor& expected : whole.tensors) {
    SCOPED_TRACE(expected.name);
    std::vector<double> joined;
    for (const ReferenceResult& part : parts) {
      const ReferenceTensor* t = part.Find(expected.name);
      ASSERT_NE(t, nullptr);
      EXPECT_EQ(t->full_shape, expected.full_shape);
      EXPECT_EQ(t->layout, expected.layout);
      EXPECT_EQ(t->budget.roundings, expected.budget.roundings);
      EXPECT_EQ(t->budget.terms, expected.budget.terms);
      const std::vector<double> values = Values(part, expected.name);
      if (expected.layout == ReferenceTensor::Layout::kRows) {
        EXPECT_EQ(t->value.rows(), part.slice_end - part.slice_begin);
        joined.insert(joined.end(), values.begin(), values.end());
      } else if (expected.partial) {
        if (joined.empty()) joined.assign(values.size(), 0.0);
        for (size_t k = 0; k < values.size(); ++k) joined[k] += values[k];
      } else {
        EXPECT_EQ(values, Values(whole, expected.name));
        joined = values;
      }
    }
    // Row tensors and parameters exactly; gradient sums over a different grouping of the
    // rows to rounding.
    EXPECT_TRUE(AllNear(expected.name, joined, Values(whole, expected.name), 1e-15, 1e-13));
  }
  EXPECT_FALSE(RunReference(parallel, model, run, {4, 3}).ok());
  EXPECT_FALSE(RunReference(parallel, model, run, {0, 17}).ok());
  EXPECT_EQ(ReferenceRows(parallel, run), 16);
}

// The master weights a caller may generate once for several slices: every owner's weight, with
// its shape and init; given back as overrides, they are used as they are (not copied).
TEST(ReferenceModelTest, ParametersListTheMasterWeights) {
  const ParallelConfig parallel = Parallel(2, 4);
  const RunConfig run = RunOf(4, 2, 1);
  StatusOr<std::vector<ReferenceParameter>> params = ReferenceParameters(parallel, Mlp(), run);
  ASSERT_TRUE(params.ok()) << params.status().Message();
  std::vector<std::string> names;
  std::map<std::string, Tensor> overrides;
  for (const ReferenceParameter& p : *params) {
    names.push_back(p.name);
    Tensor t = Tensor::HostZeros(p.shape, DType::kFloat64);
    FillFlatRange(run.seed, p.name, p.init, p.shape, 0, t);
    overrides.emplace(p.name, t);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"embedding.weight", "fc1.weight", "fc2.weight",
                                             "head.weight"}));
  const ReferenceResult plain = MustRun(parallel, Mlp(), run);
  const ReferenceResult given = MustRun(parallel, Mlp(), run, overrides);
  for (const auto& [name, tensor] : overrides) {
    EXPECT_EQ(Values(given, name), Values(plain, name)) << name;
    EXPECT_EQ(Get(given, name).data(), tensor.data()) << name;
  }
  EXPECT_EQ(given.loss, plain.loss);
}

// One value under two names is one buffer (a layer's input is the previous layer's output).
TEST(ReferenceModelTest, AliasesShareStorage) {
  const ReferenceResult result = MustRun(Parallel(2, 4), Mlp(), RunOf(4, 2, 1));
  EXPECT_EQ(Get(result, "fc1.output").data(), Get(result, "gelu.input").data());
  EXPECT_EQ(Get(result, "gelu.input_grad").data(), Get(result, "fc1.output_grad").data());
  EXPECT_NE(Get(result, "fc1.output").data(), Get(result, "gelu.output").data());
}

// The budgets count what the contract says: exact data, a gradient summing every token of
// every micro-batch, budgets that grow along the chain and with the reduction length.
TEST(ReferenceModelTest, ErrorBudgetsGrowWithTheWork) {
  const RunConfig run = RunOf(4, 2, 3);
  const ReferenceResult result = MustRun(Parallel(2, 4), Mlp(), run);
  const auto budget = [&](const std::string& name) { return result.Find(name)->budget; };
  EXPECT_EQ(budget("tokens").roundings + budget("tokens").terms, 0.0);
  EXPECT_EQ(budget("labels").roundings + budget("labels").terms, 0.0);
  EXPECT_GE(budget("fc1.weight_grad").terms, 3.0 * 4 * 4);  // M * s * B tokens
  EXPECT_GE(budget("fc1.output").terms, 8.0);                // inner dimension
  EXPECT_GT(budget("fc2.output").terms, budget("fc1.output").terms);
  EXPECT_GT(budget("fc2.output").roundings, budget("fc1.output").roundings);
  EXPECT_GT(budget("fc1.input_grad").terms, budget("fc2.input_grad").terms);
  RunConfig longer = run;
  longer.seq_length = 64;
  const ReferenceResult long_run = MustRun(Parallel(2, 4), Mlp(), longer);
  EXPECT_EQ(long_run.Find("fc1.weight_grad")->budget.terms -
                result.Find("fc1.weight_grad")->budget.terms,
            3.0 * (64 - 4) * 4);
}

}  // namespace
}  // namespace mpusim
