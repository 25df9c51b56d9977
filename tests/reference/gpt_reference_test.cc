// Tests of the float64 GPT reference (reference/gpt_reference.h), single process.
//
// Nothing here comes from the reference's own output: parameter gradients are checked by
// finite differences of the loss and against a PyTorch autograd golden (tests/data/
// gpt_golden/, made by make_gpt_golden.py from the model's math); activation gradients are
// tied to those parameter gradients by the chain rule (dW = dY^T X, dX = dY W); dropout
// masks, token streams and master values are recomputed here from core/philox.h,
// core/dropout.h and core/init.h.
// Tolerances: central differences of fourth order with step 5e-4 carry ~1e-14 truncation
// and ~1e-12 rounding error (a loss of ~3 over the step), so 1e-7 relative is loose; the
// golden is float64 on both sides with sums in other orders (1e-10 relative); tensors that
// the same arithmetic produces are compared to 1e-15 or exactly.
#include "reference/gpt_reference.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/dropout.h"
#include "core/config/gpt_config.h"
#include "core/init.h"
#include "core/philox.h"
#include "core/dump/safetensors.h"

#ifndef MPUSIM_TEST_DATA_DIR
#error "MPUSIM_TEST_DATA_DIR must name the tests/data folder"
#endif

namespace mpusim {
namespace {

using nlohmann::json;

// ---- setups ---------------------------------------------------------------------------------

struct GptSetup {
  GptConfig gpt;
  ParallelConfig parallel;
  RunConfig run;
};

GptSetup MakeSetup(const json& model, int64_t tp, int64_t world, int64_t seq, int64_t micro_batch,
                   int64_t num_micro) {
  GptSetup x;
  const Status parsed = ParseGptSection(model, &x.gpt);
  EXPECT_TRUE(parsed.ok()) << parsed.Message();
  x.parallel.world_size = world;
  x.parallel.tensor_model_parallel_size = tp;
  x.run.seed = 1234;
  x.run.dtype = DType::kFloat64;
  x.run.seq_length = seq;
  x.run.micro_batch_size = micro_batch;
  x.run.num_microbatches = num_micro;
  const Status checked = CheckGptLayout(x.parallel, x.run, &x.gpt);
  EXPECT_TRUE(checked.ok()) << checked.Message();
  return x;
}

// LayerNorm, gelu, learned absolute positions (6 rows for s = 4), tied, MHA, biases.
// d = 2 (world 2, tp 1), B = 4, Vp = 12.
GptSetup ConfigOne(double dropout = 0.1, int64_t num_micro = 2) {
  const json model = {{"type", "gpt"},
                      {"num_layers", 2},
                      {"hidden_size", 8},
                      {"num_attention_heads", 2},
                      {"normalization", "LayerNorm"},
                      {"activation", "gelu"},
                      {"position_embedding_type", "learned_absolute"},
                      {"max_position_embeddings", 6},
                      {"share_embeddings_and_output_weights", true},
                      {"add_bias_linear", true},
                      {"hidden_dropout", dropout},
                      {"attention_dropout", dropout},
                      {"vocab_size", 11},
                      {"make_vocab_size_divisible_by", 4},
                      {"label_smoothing", 0.1},
                      {"init_method_std", 0.3}};
  return MakeSetup(model, 1, 2, 4, 2, num_micro);
}

// RMSNorm, swiglu, rope, GQA (4 heads in 2 groups, kv_channels 4: attention width 16 != h),
// untied, no linear biases. tp 2, d = 2 (world 4), B = 4, Vp = 16.
GptSetup ConfigTwo(double dropout = 0.1, int64_t num_micro = 2) {
  const json model = {{"type", "gpt"},
                      {"num_layers", 2},
                      {"hidden_size", 8},
                      {"num_attention_heads", 4},
                      {"num_query_groups", 2},
                      {"kv_channels", 4},
                      {"ffn_hidden_size", 12},
                      {"normalization", "RMSNorm"},
                      {"activation", "swiglu"},
                      {"position_embedding_type", "rope"},
                      {"rotary_base", 100},
                      {"share_embeddings_and_output_weights", false},
                      {"add_bias_linear", false},
                      {"add_qkv_bias", true},
                      {"hidden_dropout", dropout},
                      {"attention_dropout", dropout},
                      {"vocab_size", 11},
                      {"make_vocab_size_divisible_by", 4},
                      {"label_smoothing", 0.1},
                      {"init_method_std", 0.3}};
  return MakeSetup(model, 2, 4, 4, 2, num_micro);
}

// ---- result access --------------------------------------------------------------------------

ReferenceResult MustRun(const GptSetup& x, const GptReferenceOptions& options = {}) {
  StatusOr<ReferenceResult> result = RunGptReference(x.gpt, x.parallel, x.run, options);
  EXPECT_TRUE(result.ok()) << result.status().Message();
  return result.ok() ? std::move(result).value() : ReferenceResult{};
}

const ReferenceTensor& Get(const ReferenceResult& result, const std::string& name) {
  static const ReferenceTensor kMissing;
  const ReferenceTensor* t = result.Find(name);
  EXPECT_NE(t, nullptr) << "no tensor " << name;
  return t == nullptr ? kMissing : *t;
}

std::vector<double> Values(const ReferenceResult& result, const std::string& name) {
  const Tensor& t = Get(result, name).value;
  if (!t.defined()) return {};
  return std::vector<double>(t.data_as<double>(), t.data_as<double>() + t.numel());
}

double Norm(const std::vector<double>& v) {
  double sum = 0.0;
  for (double x : v) sum += x * x;
  return std::sqrt(sum);
}

Tensor FromValues(const Shape& shape, const std::vector<double>& values) {
  Tensor out = Tensor::HostZeros(shape, DType::kFloat64);
  std::copy(values.begin(), values.end(), out.data_as<double>());
  return out;
}

// |actual - expected| <= atol + rtol * |expected| elementwise, NaN/Inf caught first; on
// failure the max abs and rel errors and the worst element.
::testing::AssertionResult AllNear(const std::string& name, const std::vector<double>& actual,
                                   const std::vector<double>& expected, double atol, double rtol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << name << ": " << actual.size() << " elements, expected " << expected.size();
  }
  double max_abs = 0, max_rel = 0;
  size_t worst = 0, bad = 0;
  for (size_t k = 0; k < actual.size(); ++k) {
    const double err = std::abs(actual[k] - expected[k]);
    if (!std::isfinite(actual[k]) || !std::isfinite(expected[k])) {
      return ::testing::AssertionFailure()
             << name << "[" << k << "] not finite: " << actual[k] << " vs " << expected[k];
    }
    if (err > max_abs) {
      max_abs = err;
      worst = k;
    }
    if (expected[k] != 0) max_rel = std::max(max_rel, err / std::abs(expected[k]));
    if (err > atol + rtol * std::abs(expected[k])) ++bad;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << name << ": " << bad << " of " << actual.size() << " elements off; max abs error "
         << max_abs << ", max rel error " << max_rel << "; worst [" << worst
         << "]: " << actual[worst] << " vs " << expected[worst];
}

// Nonzero biases and norm parameters (they start at 0 and 1), so that every gradient path
// carries curvature: norm weights 1 + 0.2 N(0,1), biases 0.2 N(0,1).
std::map<std::string, Tensor> PerturbedOverrides(const GptSetup& x) {
  std::map<std::string, Tensor> overrides;
  for (const GptParameter& p :
       GptParameters(x.gpt, x.gpt.PaddedVocabSize(x.parallel.tensor_model_parallel_size), false)) {
    if (p.init.method != InitMethod::kOnes && p.init.method != InitMethod::kZeros) continue;
    std::vector<double> v(static_cast<size_t>(NumElements(p.shape)));
    for (size_t e = 0; e < v.size(); ++e) {
      v[e] = (p.init.method == InitMethod::kOnes ? 1.0 : 0.0) +
             0.2 * NormalAt(77, StreamId(p.name), e);
    }
    overrides[p.name] = FromValues(p.shape, v);
  }
  return overrides;
}

// The whole-tensor parameter names of a result, in order.
std::vector<std::string> ParameterNames(const ReferenceResult& r) {
  std::vector<std::string> names;
  for (const ReferenceTensor& t : r.tensors) {
    if (t.parameter) names.push_back(t.name);
  }
  return names;
}

// ---- 1. finite differences ------------------------------------------------------------------

// d loss / d param[flat] by the fourth-order central difference
// (-L(+2h) + 8 L(+h) - 8 L(-h) + L(-2h)) / 12h.
double FiniteDifference(const GptSetup& x, GptReferenceOptions options,
                        const ReferenceResult& base, const std::string& param, int64_t flat) {
  constexpr double kStep = 5e-4;
  const Tensor& value = Get(base, param).value;
  const double weights[4] = {-1.0, 8.0, -8.0, 1.0};
  const double offsets[4] = {2.0, 1.0, -1.0, -2.0};
  double sum = 0.0;
  for (int k = 0; k < 4; ++k) {
    std::vector<double> v(value.data_as<double>(), value.data_as<double>() + value.numel());
    v[static_cast<size_t>(flat)] += offsets[k] * kStep;
    options.parameter_overrides[param] = FromValues(value.shape(), v);
    sum += weights[k] * MustRun(x, options).loss;
  }
  return sum / (12.0 * kStep);
}

// Every parameter: its largest-gradient element and three spread over it, each to 1e-7
// relative (1e-11 absolute for elements whose gradient is 0, such as unused rows).
void CheckGradientsByFiniteDifferences(const GptSetup& x) {
  GptReferenceOptions options;
  options.parameter_overrides = PerturbedOverrides(x);
  const ReferenceResult base = MustRun(x, options);
  const std::vector<std::string> params = ParameterNames(base);
  ASSERT_FALSE(params.empty());
  double worst_rel = 0.0;
  int checked = 0;
  for (const std::string& param : params) {
    const std::vector<double> grad = Values(base, param + ".grad");
    ASSERT_FALSE(grad.empty()) << param;
    ASSERT_GT(Norm(grad), 0.0) << param;
    const auto n = static_cast<int64_t>(grad.size());
    std::set<int64_t> elements;
    elements.insert(std::max_element(grad.begin(), grad.end(),
                                     [](double a, double b) { return std::abs(a) < std::abs(b); }) -
                    grad.begin());
    for (int64_t k = 1; k <= 3; ++k) elements.insert((k * 7919 + 13) % n);
    for (int64_t e : elements) {
      const double analytic = grad[static_cast<size_t>(e)];
      const double numeric = FiniteDifference(x, options, base, param, e);
      EXPECT_LE(std::abs(analytic - numeric), 1e-11 + 1e-7 * std::abs(analytic))
          << param << "[" << e << "]: analytic " << analytic << " vs finite difference " << numeric;
      if (std::abs(analytic) > 1e-6) {
        worst_rel = std::max(worst_rel, std::abs(analytic - numeric) / std::abs(analytic));
      }
      ++checked;
    }
  }
  std::printf("  %d elements of %zu parameters, worst relative error %.2e\n", checked,
              params.size(), worst_rel);
}

TEST(GptReferenceTest, GradientsMatchFiniteDifferencesLayerNormGeluTied) {
  CheckGradientsByFiniteDifferences(ConfigOne());
}

TEST(GptReferenceTest, GradientsMatchFiniteDifferencesRmsNormSwigluRopeGqaUntied) {
  CheckGradientsByFiniteDifferences(ConfigTwo());
}

// ---- the recorded activation gradients, by the chain rule ----------------------------------

// A recorded [s, n, w] activation as a [rows, w] matrix (std::vector, row-major).
struct Rows {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  double operator()(int64_t r, int64_t c) const { return v[static_cast<size_t>(r * cols + c)]; }
};
Rows AsRows(const ReferenceResult& result, const std::string& name) {
  const Tensor& t = Get(result, name).value;
  Rows out;
  out.cols = t.cols();
  out.rows = t.rows();
  out.v = Values(result, name);
  return out;
}
// A^T B over rows: [A.cols, B.cols].
std::vector<double> TransposeTimes(const Rows& a, const Rows& b) {
  std::vector<double> out(static_cast<size_t>(a.cols * b.cols), 0.0);
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t i = 0; i < a.cols; ++i) {
      for (int64_t j = 0; j < b.cols; ++j)
        out[static_cast<size_t>(i * b.cols + j)] += a(r, i) * b(r, j);
    }
  }
  return out;
}
// A W for W [A.cols, k] row-major: [A.rows, k].
std::vector<double> Times(const Rows& a, const std::vector<double>& w, int64_t k) {
  std::vector<double> out(static_cast<size_t>(a.rows * k), 0.0);
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t i = 0; i < a.cols; ++i) {
      for (int64_t j = 0; j < k; ++j)
        out[static_cast<size_t>(r * k + j)] += a(r, i) * w[static_cast<size_t>(i * k + j)];
    }
  }
  return out;
}
std::vector<double> ColumnSums(const Rows& a) {
  std::vector<double> out(static_cast<size_t>(a.cols), 0.0);
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t c = 0; c < a.cols; ++c) out[static_cast<size_t>(c)] += a(r, c);
  }
  return out;
}

// Keep scale of element `flat` of a dropout site in micro-batch m.
double Keep(const GptSetup& x, const std::string& site, int64_t m, double p, int64_t flat) {
  const bool kept =
      UniformAt(x.run.seed, DropoutStream(site, 0, m), static_cast<uint64_t>(flat)) >= p;
  return kept ? 1.0 / (1.0 - p) : 0.0;
}

// One micro-batch, so parameter gradients are sums over the recorded activations. The
// parameter gradients are checked by finite differences above; these tie every recorded
// activation gradient to them.
void CheckChainRule(const GptSetup& x) {
  ASSERT_EQ(x.run.num_microbatches, 1);
  const double p = x.gpt.hidden_dropout;
  GptReferenceOptions options;
  options.parameter_overrides = PerturbedOverrides(x);
  const ReferenceResult r = MustRun(x, options);
  const int64_t s = x.run.seq_length, B = GptReferenceSamples(x.parallel, x.run);
  const int64_t h = x.gpt.hidden_size, a = x.gpt.num_attention_heads, dk = x.gpt.kv_channels;
  const int64_t groups = x.gpt.num_query_groups, heads_per_group = a / groups;
  const int64_t vp = x.gpt.PaddedVocabSize(x.parallel.tensor_model_parallel_size);
  constexpr double kAtol = 1e-15, kRtol = 1e-11;
  const auto near = [&](const std::string& what, const std::vector<double>& actual,
                        const std::vector<double>& expected) {
    EXPECT_GT(Norm(expected), 0.0) << what;
    EXPECT_TRUE(AllNear(what, actual, expected, kAtol, kRtol));
  };

  for (int64_t l = 0; l < x.gpt.num_layers; ++l) {
    const std::string P = "decoder.layers." + std::to_string(l);
    const std::string qkv = P + ".self_attention.linear_qkv",
                      proj = P + ".self_attention.linear_proj";
    const std::string fc1 = P + ".mlp.linear_fc1", fc2 = P + ".mlp.linear_fc2";
    const std::string core = P + ".self_attention.core_attention";
    // dW = dY^T X and dX = dY W for the four linears.
    near(qkv + ".weight.grad", Values(r, qkv + ".weight.grad"),
         TransposeTimes(AsRows(r, qkv + ".output_grad"), AsRows(r, P + ".input_layernorm.output")));
    near(P + ".input_layernorm.output_grad", Values(r, P + ".input_layernorm.output_grad"),
         Times(AsRows(r, qkv + ".output_grad"), Values(r, qkv + ".weight"), h));
    near(proj + ".weight.grad", Values(r, proj + ".weight.grad"),
         TransposeTimes(AsRows(r, proj + ".output_grad"), AsRows(r, core + ".output")));
    near(core + ".output_grad", Values(r, core + ".output_grad"),
         Times(AsRows(r, proj + ".output_grad"), Values(r, proj + ".weight"), a * dk));
    near(fc1 + ".weight.grad", Values(r, fc1 + ".weight.grad"),
         TransposeTimes(AsRows(r, fc1 + ".output_grad"),
                        AsRows(r, P + ".pre_mlp_layernorm.output")));
    near(P + ".pre_mlp_layernorm.output_grad", Values(r, P + ".pre_mlp_layernorm.output_grad"),
         Times(AsRows(r, fc1 + ".output_grad"), Values(r, fc1 + ".weight"), h));
    if (x.gpt.add_bias_linear || x.gpt.add_qkv_bias) {
      near(qkv + ".bias.grad", Values(r, qkv + ".bias.grad"),
           ColumnSums(AsRows(r, qkv + ".output_grad")));
    }
    if (x.gpt.add_bias_linear) {
      near(proj + ".bias.grad", Values(r, proj + ".bias.grad"),
           ColumnSums(AsRows(r, proj + ".output_grad")));
      near(fc2 + ".bias.grad", Values(r, fc2 + ".bias.grad"),
           ColumnSums(AsRows(r, fc2 + ".output_grad")));
    }
    // Bias-dropout-add: d(proj) = d(residual) * keep, elementwise with the site's mask.
    for (const auto& [site, out, in] :
         {std::tuple{P + ".self_attn_bda", P + ".self_attn_bda.output_grad", proj + ".output_grad"},
          std::tuple{P + ".mlp_bda", P + ".mlp_bda.output_grad", fc2 + ".output_grad"}}) {
      const std::vector<double> dres = Values(r, out);
      std::vector<double> expected(dres.size());
      for (size_t e = 0; e < dres.size(); ++e)
        expected[e] = dres[e] * Keep(x, site, 0, p, static_cast<int64_t>(e));
      near(in, Values(r, in), expected);
    }
    // probs_grad[gs, hd, qi, ki] = keep * sum_c context_grad[qi, gs, hd*dk + c] v[ki, gs, c],
    // v the value head of hd's group in the fused qkv output (Megatron's group-major order).
    const Rows dctx = AsRows(r, core + ".output_grad");
    const Rows qkv_out = AsRows(r, qkv + ".output");
    std::vector<double> dprobs(static_cast<size_t>(B * a * s * s));
    for (int64_t gs = 0; gs < B; ++gs) {
      for (int64_t hd = 0; hd < a; ++hd) {
        const int64_t group = hd / heads_per_group;
        const int64_t value_col = (group * (heads_per_group + 2) + heads_per_group + 1) * dk;
        for (int64_t qi = 0; qi < s; ++qi) {
          for (int64_t ki = 0; ki < s; ++ki) {
            double sum = 0;
            for (int64_t c = 0; c < dk; ++c)
              sum += dctx(qi * B + gs, hd * dk + c) * qkv_out(ki * B + gs, value_col + c);
            const int64_t flat = ((gs * a + hd) * s + qi) * s + ki;
            dprobs[static_cast<size_t>(flat)] =
                sum * Keep(x, core + ".attention_dropout", 0, x.gpt.attention_dropout, flat);
          }
        }
      }
    }
    near(core + ".probs_grad", Values(r, core + ".probs_grad"), dprobs);
  }

  // The loss: d/d per-token loss = 1/(M s B); d/d logits = (softmax - (1-sm) onehot - sm/Vp)
  // times that, with sm = ls Vp / (Vp - 1).
  const double per_token = 1.0 / static_cast<double>(s * B);
  for (double g : Values(r, "loss.per_token_grad")) EXPECT_EQ(g, per_token);
  const Rows logits = AsRows(r, "output_layer.output");
  const std::vector<double> labels = Values(r, "labels");
  const double sm = x.gpt.label_smoothing * static_cast<double>(vp) / static_cast<double>(vp - 1);
  std::vector<double> dlogits(logits.v.size());
  for (int64_t row = 0; row < logits.rows; ++row) {
    double z = 0;
    for (int64_t j = 0; j < vp; ++j) z += std::exp(logits(row, j));
    for (int64_t j = 0; j < vp; ++j) {
      const double onehot = static_cast<int64_t>(labels[static_cast<size_t>(row)]) == j ? 1.0 : 0.0;
      dlogits[static_cast<size_t>(row * vp + j)] =
          (std::exp(logits(row, j)) / z - (1 - sm) * onehot - sm / static_cast<double>(vp)) *
          per_token;
    }
  }
  near("output_layer.output_grad", Values(r, "output_layer.output_grad"), dlogits);
  near(
      "decoder.final_layernorm.output_grad", Values(r, "decoder.final_layernorm.output_grad"),
      Times(AsRows(r, "output_layer.output_grad"),
            Values(r, x.gpt.share_embeddings_and_output_weights ? "embedding.word_embeddings.weight"
                                                                : "output_layer.weight"),
            h));
  // The embedding: its rows' gradients sum embedding.output_grad * keep over the tokens.
  const Rows demb = AsRows(r, "embedding.output_grad");
  const std::vector<double> tokens = Values(r, "tokens");
  std::vector<double> dword(static_cast<size_t>(vp * h), 0.0), dpos;
  if (x.gpt.has_position_embeddings())
    dpos.assign(static_cast<size_t>(x.gpt.max_position_embeddings * h), 0.0);
  for (int64_t row = 0; row < s * B; ++row) {
    const auto tok = static_cast<int64_t>(tokens[static_cast<size_t>(row)]);
    for (int64_t c = 0; c < h; ++c) {
      const double g = demb(row, c) * Keep(x, "embedding.embedding_dropout", 0, p, row * h + c);
      dword[static_cast<size_t>(tok * h + c)] += g;
      if (!dpos.empty()) dpos[static_cast<size_t>((row / B) * h + c)] += g;
    }
  }
  if (x.gpt.share_embeddings_and_output_weights) {
    // Tied: the lookup's share plus the output layer's dW = dlogits^T final.
    const std::vector<double> out = TransposeTimes(AsRows(r, "output_layer.output_grad"),
                                                   AsRows(r, "decoder.final_layernorm.output"));
    for (size_t k = 0; k < dword.size(); ++k) dword[k] += out[k];
  } else {
    near("output_layer.weight.grad", Values(r, "output_layer.weight.grad"),
         TransposeTimes(AsRows(r, "output_layer.output_grad"),
                        AsRows(r, "decoder.final_layernorm.output")));
  }
  near("embedding.word_embeddings.weight.grad", Values(r, "embedding.word_embeddings.weight.grad"),
       dword);
  if (!dpos.empty()) {
    near("embedding.position_embeddings.weight.grad",
         Values(r, "embedding.position_embeddings.weight.grad"), dpos);
  }
}

TEST(GptReferenceTest, ActivationGradientsFollowTheChainRuleLayerNormGeluTied) {
  CheckChainRule(ConfigOne(0.1, 1));
}

TEST(GptReferenceTest, ActivationGradientsFollowTheChainRuleRmsNormSwigluRopeGqaUntied) {
  CheckChainRule(ConfigTwo(0.1, 1));
}

// ---- 2. slices of the batch -----------------------------------------------------------------

// Slices of the samples (uneven, one empty) give the whole run back: sliced activations are
// the whole run's samples, gradient and loss shares add up, parameters are the same.
void CheckSlicesAddUpToTheWholeRun(const GptSetup& x) {
  const ReferenceResult whole = MustRun(x);
  const std::vector<std::pair<int64_t, int64_t>> slices = {{0, 1}, {1, 1}, {1, 3}, {3, 4}};
  std::vector<ReferenceResult> parts;
  for (const auto& [begin, end] : slices) {
    GptReferenceOptions options;
    options.slice.begin = begin;
    options.slice.end = end;
    parts.push_back(MustRun(x, options));
    EXPECT_EQ(parts.back().slice_begin, begin);
    EXPECT_EQ(parts.back().slice_end, end);
  }
  double loss = 0;
  for (const ReferenceResult& part : parts) loss += part.loss;
  EXPECT_NEAR(loss, whole.loss, 1e-14);
  ASSERT_GT(whole.tensors.size(), 50u);
  for (const ReferenceTensor& expected : whole.tensors) {
    SCOPED_TRACE(expected.name);
    const std::vector<double> all = Values(whole, expected.name);
    // Biases start at zero (Megatron's initialisation); everything else must be non-trivial.
    if (!expected.name.ends_with(".bias")) {
      ASSERT_GT(Norm(all), 0.0);
    }
    std::vector<double> joined(all.size(), 0.0);
    for (size_t k = 0; k < parts.size(); ++k) {
      const ReferenceTensor& t = Get(parts[k], expected.name);
      ASSERT_EQ(t.full_shape, expected.full_shape);
      ASSERT_EQ(t.layout, expected.layout);
      ASSERT_EQ(t.batch_dim, expected.batch_dim);
      ASSERT_EQ(t.partial, expected.partial);
      const std::vector<double> values = Values(parts[k], expected.name);
      if (expected.layout == ReferenceTensor::Layout::kWhole) {
        EXPECT_EQ(t.value.shape(), expected.full_shape);
        if (!expected.partial) {
          EXPECT_EQ(values, all);
          joined = values;
        } else {
          for (size_t e = 0; e < values.size(); ++e) joined[e] += values[e];
        }
        continue;
      }
      // Scatter the slice's samples into their place in the whole tensor.
      Shape shape = expected.full_shape;
      const auto bd = static_cast<size_t>(expected.batch_dim);
      const int64_t n = slices[k].second - slices[k].first;
      shape[bd] = n;
      EXPECT_EQ(t.value.shape(), shape);
      int64_t outer = 1, inner = 1;
      for (size_t dim = 0; dim < bd; ++dim) outer *= shape[dim];
      for (size_t dim = bd + 1; dim < shape.size(); ++dim) inner *= shape[dim];
      const int64_t B = expected.full_shape[bd];
      for (int64_t o = 0; o < outer; ++o) {
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t e = 0; e < inner; ++e) {
            joined[static_cast<size_t>((o * B + slices[k].first + j) * inner + e)] =
                values[static_cast<size_t>((o * n + j) * inner + e)];
          }
        }
      }
    }
    // Activations to the rounding of GEMMs of other sizes; gradient sums in another order.
    EXPECT_TRUE(AllNear(expected.name, joined, all, 1e-15, 1e-12));
  }
}

TEST(GptReferenceTest, SlicesOfTheSamplesAddUpToTheWholeRun) {
  CheckSlicesAddUpToTheWholeRun(ConfigTwo(0.1, 3));
}

// Multi-token prediction's depths (with their dropout sites): each depth's loss is weighted
// over the global batch's tokens, so slices' gradients add up to the whole run's.
TEST(GptReferenceTest, SlicesOfTheSamplesAddUpToTheWholeRunWithMultiTokenPrediction) {
  GptSetup x = ConfigTwo(0.1, 3);
  x.gpt.mtp_num_layers = 2;
  x.gpt.mtp_loss_scaling_factor = 0.5;
  CheckSlicesAddUpToTheWholeRun(x);
}

TEST(GptReferenceTest, BadSlicesOverridesAndTokensAreErrors) {
  const GptSetup x = ConfigOne(0.1, 2);
  const auto fails = [&](const GptReferenceOptions& options, const std::string& where) {
    StatusOr<ReferenceResult> result = RunGptReference(x.gpt, x.parallel, x.run, options);
    ASSERT_FALSE(result.ok());
    EXPECT_NE(result.status().Message().find(where), std::string::npos)
        << result.status().Message();
  };
  GptReferenceOptions options;
  options.slice.begin = 3;
  options.slice.end = 2;
  fails(options, "slice");
  options.slice.begin = 0;
  options.slice.end = 5;  // B = 4
  fails(options, "slice");
  options = {};
  options.slice.begin = -1;
  fails(options, "slice");
  options = {};
  options.parameter_overrides["decoder.layers.7.mlp.linear_fc1.weight"] = FromValues({1}, {0.0});
  fails(options, "no parameter named");
  options = {};
  options.parameter_overrides["decoder.final_layernorm.weight"] =
      FromValues({7}, std::vector<double>(7));
  fails(options, "decoder.final_layernorm.weight");
  options = {};
  options.parameter_overrides["decoder.final_layernorm.weight"] =
      Tensor::HostZeros({8}, DType::kFloat32);
  fails(options, "float64");
  options = {};
  options.tokens = {std::vector<int64_t>(16, 0)};  // one micro-batch of two
  fails(options, "tokens");
  options.tokens = {std::vector<int64_t>(16, 0), std::vector<int64_t>(15, 0)};
  fails(options, "tokens[1]");
  options = {};
  options.labels = {std::vector<int64_t>(16, 0), std::vector<int64_t>(16, 0)};
  options.labels[1][3] = 11;  // vocab_size 11
  fails(options, "labels[1][3]");
  ParallelConfig odd = x.parallel;
  odd.tensor_model_parallel_size = 2;
  odd.world_size = 3;
  StatusOr<ReferenceResult> result = RunGptReference(x.gpt, odd, x.run, {});
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().where(), "parallel.world_size");
}

// ---- 3. inputs: tokens, master values, dropout masks ---------------------------------------

// Tokens come from the stream "text.mb<m>": sample gs reads s + 1 consecutive ids, the labels
// are the next tokens. Parameters are the master values (norm weights 1, biases 0).
TEST(GptReferenceTest, TokensAndParametersAreTheDrawnInputs) {
  const GptSetup x = ConfigOne(0.1, 2);
  const ReferenceResult r = MustRun(x);
  const int64_t s = 4, B = 4, V = 11;
  const std::vector<double> tokens = Values(r, "tokens"), labels = Values(r, "labels");
  ASSERT_EQ(tokens.size(), static_cast<size_t>(s * B));
  EXPECT_EQ(Get(r, "tokens").full_shape, (Shape{s, B}));
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t gs = 0; gs < B; ++gs) {
      const auto k = static_cast<size_t>(i * B + gs);
      EXPECT_EQ(tokens[k], static_cast<double>(TokenAt(1234, "text.mb1", gs * (s + 1) + i, V)));
      EXPECT_EQ(labels[k], static_cast<double>(TokenAt(1234, "text.mb1", gs * (s + 1) + i + 1, V)));
      if (i + 1 < s) {
        EXPECT_EQ(labels[k], tokens[k + B]);
      }
    }
  }
  const GptReferenceTokens drawn = DrawGptReferenceTokens(x.gpt, x.parallel, x.run, 1);
  for (size_t k = 0; k < tokens.size(); ++k)
    EXPECT_EQ(static_cast<double>(drawn.tokens[k]), tokens[k]);

  const std::vector<GptParameter> params = GptParameters(x.gpt, 12, false);
  ASSERT_EQ(ParameterNames(r).size(), params.size());
  for (size_t k = 0; k < params.size(); ++k) {
    const GptParameter& p = params[k];
    EXPECT_EQ(ParameterNames(r)[k], p.name);
    EXPECT_EQ(Get(r, p.name).full_shape, p.shape);
    EXPECT_TRUE(Get(r, p.name + ".grad").partial);
    const std::vector<double> v = Values(r, p.name);
    for (int64_t e : {int64_t{0}, NumElements(p.shape) / 2, NumElements(p.shape) - 1}) {
      EXPECT_EQ(v[static_cast<size_t>(e)], MasterValue(1234, p.name, p.init, p.shape, e)) << p.name;
    }
  }
  EXPECT_EQ(Values(r, "decoder.final_layernorm.weight"), std::vector<double>(8, 1.0));
  EXPECT_EQ(Values(r, "decoder.layers.1.mlp.linear_fc2.bias"), std::vector<double>(8, 0.0));
  EXPECT_EQ(Values(r, "loss")[0], r.loss);
  // An override is used as it is, not copied.
  GptReferenceOptions options;
  options.parameter_overrides = PerturbedOverrides(x);
  const ReferenceResult given = MustRun(x, options);
  for (const auto& [name, tensor] : options.parameter_overrides) {
    EXPECT_EQ(Get(given, name).value.data(), tensor.data()) << name;
  }
}

// Every dropout site's mask is UniformAt(seed, DropoutStream(site, 0, m), full flat index)
// >= p, with kept elements scaled by 1/(1-p): checked through the recorded tensors of the
// last micro-batch (m = 1) of one slice of the samples, for each site.
TEST(GptReferenceTest, DropoutMasksAreGlobalPureFunctions) {
  const GptSetup x = ConfigOne(0.3, 2);
  const double p = 0.3, scale = 1.0 / 0.7;
  const int64_t s = 4, B = 4, h = 8, a = 2, dk = 4, m = 1, sb = 1, n = 2;
  GptReferenceOptions options;
  options.slice.begin = sb;
  options.slice.end = sb + n;
  options.parameter_overrides = PerturbedOverrides(x);
  const ReferenceResult r = MustRun(x, options);
  const auto keep = [&](const std::string& site, int64_t flat) {
    return UniformAt(1234, DropoutStream(site, 0, m), static_cast<uint64_t>(flat)) >= p ? scale
                                                                                        : 0.0;
  };
  // Embedding: (word[token] + position[i]) * keep, element (i, gs, c) = (i*B + gs)*h + c.
  const std::vector<double> word = Values(r, "embedding.word_embeddings.weight");
  const std::vector<double> pos = Values(r, "embedding.position_embeddings.weight");
  const std::vector<double> tokens = Values(r, "tokens");
  std::vector<double> expected;
  int dropped = 0;
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const auto tok = static_cast<int64_t>(tokens[static_cast<size_t>(i * n + j)]);
      for (int64_t c = 0; c < h; ++c) {
        const double k = keep("embedding.embedding_dropout", (i * B + sb + j) * h + c);
        dropped += k == 0.0;
        expected.push_back(
            (word[static_cast<size_t>(tok * h + c)] + pos[static_cast<size_t>(i * h + c)]) * k);
      }
    }
  }
  EXPECT_GT(dropped, 0);
  EXPECT_LT(dropped, s * n * h);
  EXPECT_TRUE(AllNear("embedding.output", Values(r, "embedding.output"), expected, 0, 1e-15));

  // Bias-dropout-add of layer 0: residual + (linear output + bias) * keep.
  const std::string P = "decoder.layers.0";
  for (const auto& [site, residual, linear, bias, out] :
       {std::tuple{P + ".self_attn_bda", std::string("embedding.output"),
                   P + ".self_attention.linear_proj.output", P + ".self_attention.linear_proj.bias",
                   P + ".self_attn_bda.output"},
        std::tuple{P + ".mlp_bda", P + ".self_attn_bda.output", P + ".mlp.linear_fc2.output",
                   P + ".mlp.linear_fc2.bias", P + ".mlp_bda.output"}}) {
    const std::vector<double> res = Values(r, residual), lin = Values(r, linear),
                              b = Values(r, bias);
    expected.assign(res.size(), 0.0);
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t c = 0; c < h; ++c) {
          const auto e = static_cast<size_t>((i * n + j) * h + c);
          expected[e] =
              res[e] + (lin[e] + b[static_cast<size_t>(c)]) * keep(site, (i * B + sb + j) * h + c);
        }
      }
    }
    EXPECT_TRUE(AllNear(out, Values(r, out), expected, 1e-15, 1e-14));
  }

  // Attention: context[qi, gs, hd*dk + c] = sum_ki probs * keep * v, element (gs, hd, qi, ki)
  // of [B, a, s, s]; v: head hd's value columns (MHA: group hd, columns (3 hd + 2) dk).
  const std::string core = P + ".self_attention.core_attention";
  const std::vector<double> probs = Values(r, core + ".probs"),
                            qkv = Values(r, P + ".self_attention.linear_qkv.output");
  EXPECT_EQ(Get(r, core + ".probs").value.shape(), (Shape{n, a, s, s}));
  expected.assign(static_cast<size_t>(s * n * a * dk), 0.0);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t hd = 0; hd < a; ++hd) {
      for (int64_t qi = 0; qi < s; ++qi) {
        for (int64_t ki = 0; ki < s; ++ki) {
          const double pr = probs[static_cast<size_t>(((j * a + hd) * s + qi) * s + ki)];
          if (ki > qi) {
            EXPECT_EQ(pr, 0.0);
          }
          const double k =
              keep(core + ".attention_dropout", (((sb + j) * a + hd) * s + qi) * s + ki);
          for (int64_t c = 0; c < dk; ++c) {
            expected[static_cast<size_t>((qi * n + j) * a * dk + hd * dk + c)] +=
                pr * k *
                qkv[static_cast<size_t>((ki * n + j) * 3 * a * dk + (3 * hd + 2) * dk + c)];
          }
        }
      }
    }
  }
  EXPECT_TRUE(AllNear(core + ".output", Values(r, core + ".output"), expected, 1e-15, 1e-13));
}

// The masks and every value are functions of the full model, not of the layout: tp 1 and
// tp 2 with the same Vp (and the same d) give the same tensors, bit for bit.
TEST(GptReferenceTest, LayoutsWithTheSamePaddedVocabularyAgree) {
  GptSetup one = ConfigTwo(0.2, 2);
  one.gpt.make_vocab_size_divisible_by = 8;  // Vp = 16 for tp 1 (multiple 8) and tp 2 (16)
  GptSetup two = one;
  one.parallel.tensor_model_parallel_size = 1;
  one.parallel.world_size = 2;
  two.parallel.sequence_parallel = true;
  ASSERT_EQ(one.gpt.PaddedVocabSize(1), two.gpt.PaddedVocabSize(2));
  const ReferenceResult a = MustRun(one), b = MustRun(two);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  EXPECT_EQ(a.loss, b.loss);
  for (const ReferenceTensor& t : a.tensors) {
    EXPECT_EQ(Values(a, t.name), Values(b, t.name)) << t.name;
  }
  // A different data-parallel size is a different global batch.
  GptSetup wider = two;
  wider.parallel.world_size = 8;
  EXPECT_EQ(Get(MustRun(wider), "tokens").full_shape, (Shape{4, 8}));
}

// ---- 4. causality ---------------------------------------------------------------------------

// Changing the last token of sample 1 changes nothing at earlier positions of sample 1, nor
// anything of the other samples, and does change the last position.
TEST(GptReferenceTest, LaterTokensDoNotChangeEarlierPositions) {
  for (const GptSetup& x : {ConfigOne(0.1, 1), ConfigTwo(0.1, 1)}) {
    const int64_t s = 4, B = 4, changed = 1;
    const GptReferenceTokens drawn = DrawGptReferenceTokens(x.gpt, x.parallel, x.run, 0);
    GptReferenceOptions before, after;
    before.tokens = {drawn.tokens};
    before.labels = {drawn.labels};
    after = before;
    int64_t& last = after.tokens[0][static_cast<size_t>((s - 1) * B + changed)];
    last = (last + 5) % x.gpt.vocab_size;
    const ReferenceResult r0 = MustRun(x, before), r1 = MustRun(x, after);
    int compared = 0;
    for (const ReferenceTensor& t : r0.tensors) {
      if (t.layout != ReferenceTensor::Layout::kSamples || t.name.ends_with("_grad")) continue;  // gradients see the future
      SCOPED_TRACE(t.name);
      const std::vector<double> v0 = Values(r0, t.name), v1 = Values(r1, t.name);
      // [s, B, w] (batch_dim 1) or [B, a, s, s] (batch_dim 0, the query position is dim 2).
      const Shape& shape = t.value.shape();
      int64_t inner = 1;
      for (size_t dim = 2; dim < shape.size(); ++dim) inner *= shape[dim];
      bool last_position_changed = false;
      for (size_t e = 0; e < v0.size(); ++e) {
        const auto flat = static_cast<int64_t>(e);
        int64_t position, sample;
        if (t.batch_dim == 1) {
          position = flat / (B * inner);
          sample = flat / inner % B;
        } else {
          sample = flat / (shape[1] * inner);
          position = flat / s % s;
        }
        if (sample == changed && position == s - 1) {
          last_position_changed |= v0[e] != v1[e];
        } else {
          EXPECT_EQ(v0[e], v1[e]) << "element " << e;
        }
      }
      if (t.name != "labels") {
        EXPECT_TRUE(last_position_changed);
      }
      ++compared;
    }
    EXPECT_GT(compared, 20);
  }
}

// ---- 5. the PyTorch golden ------------------------------------------------------------------

// tests/data/gpt_golden/gpt_golden_<a|b|c>.safetensors: parameters, tokens and labels, the loss
// and every parameter gradient from torch autograd (see make_gpt_golden.py and its README).
void CheckGolden(const std::string& file) {
  const std::string path = std::string(MPUSIM_TEST_DATA_DIR) + "/gpt_golden/" + file;
  StatusOr<SafetensorsFile> golden = ReadSafetensors(path);
  ASSERT_TRUE(golden.ok()) << path << ": " << golden.status().Message();
  ASSERT_EQ(golden->metadata.count("config"), 1u);
  StatusOr<json> document = ParseJsonText(golden->metadata.at("config"));
  ASSERT_TRUE(document.ok()) << document.status().Message();
  Config config;
  const Status parsed = ParseConfig(*document, &config);
  ASSERT_TRUE(parsed.ok()) << parsed.Message();
  ASSERT_TRUE(config.gpt.has_value() && config.run.has_value());
  GptConfig gpt = *config.gpt;
  const Status layout = CheckGptLayout(config.parallel, *config.run, &gpt);
  ASSERT_TRUE(layout.ok()) << layout.Message();

  std::map<std::string, Tensor> tensors;
  for (const NamedTensor& t : golden->tensors) tensors[t.name] = t.tensor;
  const int64_t s = config.run->seq_length, B = GptReferenceSamples(config.parallel, *config.run);
  const int64_t M = config.run->num_microbatches;
  GptReferenceOptions options;
  for (const char* which : {"tokens", "labels"}) {
    ASSERT_EQ(tensors.count(which), 1u) << which;
    const Tensor& ids = tensors.at(which);
    ASSERT_EQ(ids.shape(), (Shape{M, s, B})) << which;
    auto& lists = std::string(which) == "tokens" ? options.tokens : options.labels;
    for (int64_t m = 0; m < M; ++m) {
      const double* d = ids.data_as<double>() + m * s * B;
      lists.emplace_back(d, d + s * B);  // [s, B] row-major: element i*B + gs
    }
  }
  std::set<std::string> golden_params;
  for (const auto& [name, tensor] : tensors) {
    if (name == "tokens" || name == "labels" || name == "loss" || name == "moe_aux_objective" ||
        name.ends_with(".grad") || name.ends_with(".expert_bias.updated")) {
      continue;
    }
    // A router's expert bias is state the reference reads, not a parameter.
    if (!name.ends_with(".expert_bias")) golden_params.insert(name);
    options.parameter_overrides[name] = tensor;
  }
  ReferenceResult r = MustRun({gpt, config.parallel, *config.run}, options);
  const std::vector<std::string> names = ParameterNames(r);
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), golden_params);

  const double expected_loss = tensors.at("loss").data_as<double>()[0];
  EXPECT_NEAR(r.loss, expected_loss, 1e-12 * expected_loss) << file;
  std::printf("  %s: loss %.17g (torch %.17g)\n", file.c_str(), r.loss, expected_loss);
  if (tensors.count("moe_aux_objective") == 1) {
    const double expected_aux = tensors.at("moe_aux_objective").data_as<double>()[0];
    EXPECT_NEAR(r.moe_aux_objective, expected_aux, 1e-12 * expected_aux) << file;
    std::printf("  %s: MoE auxiliary objective %.17g (torch %.17g)\n", file.c_str(),
                r.moe_aux_objective, expected_aux);
  }
  double worst = 0.0;
  for (const std::string& name : names) {
    SCOPED_TRACE(file + ": " + name);
    ASSERT_EQ(tensors.count(name + ".grad"), 1u);
    const Tensor& expected_tensor = tensors.at(name + ".grad");
    ASSERT_EQ(expected_tensor.shape(), Get(r, name + ".grad").full_shape);
    const std::vector<double> expected(expected_tensor.data_as<double>(),
                                       expected_tensor.data_as<double>() + expected_tensor.numel());
    const std::vector<double> actual = Values(r, name + ".grad");
    ASSERT_GT(Norm(expected), 0.0);
    // Relative to the tensor's largest gradient: both sides are float64, summing in other
    // orders (cancellation makes an element's own relative error unbounded near 0).
    double scale = 0.0;
    for (double e : expected) scale = std::max(scale, std::abs(e));
    EXPECT_TRUE(AllNear(name + ".grad", actual, expected, 1e-10 * scale, 1e-10));
    for (size_t k = 0; k < actual.size(); ++k)
      worst = std::max(worst, std::abs(actual[k] - expected[k]) / scale);
  }
  std::printf("  %s: %zu gradients, worst error %.2e of the tensor's max\n", file.c_str(),
              names.size(), worst);
  // The expert biases as the step leaves them (Megatron's get_updated_expert_bias on the
  // step's token counts): equal, float32 steps of the rate.
  std::map<std::string, Tensor> state;
  FinishGptReferenceIteration(gpt, r, /*trained=*/true, &state);
  int updated = 0;
  for (const auto& [name, tensor] : tensors) {
    if (!name.ends_with(".expert_bias.updated")) continue;
    const std::string bias = name.substr(0, name.size() - std::string(".updated").size());
    ASSERT_EQ(state.count(bias), 1u) << bias;
    const std::vector<double> expected(tensor.data_as<double>(),
                                       tensor.data_as<double>() + tensor.numel());
    const std::vector<double> actual(state.at(bias).data_as<double>(),
                                     state.at(bias).data_as<double>() + state.at(bias).numel());
    EXPECT_EQ(actual, expected) << bias;
    ++updated;
  }
  EXPECT_EQ(updated, static_cast<int>(state.size()));
  if (updated > 0) std::printf("  %s: %d expert biases updated as torch\n", file.c_str(), updated);
}

TEST(GptReferenceTest, MatchesTorchGoldenLayerNormGeluLearnedTiedPadded) {
  CheckGolden("gpt_golden_a.safetensors");
}

TEST(GptReferenceTest, MatchesTorchGoldenRmsNormSwigluRopeGqaUntiedSmoothed) {
  CheckGolden("gpt_golden_b.safetensors");
}

TEST(GptReferenceTest, MatchesTorchGoldenQkLayerNormPartialRopeGqa) {
  CheckGolden("gpt_golden_c.safetensors");
}

// Mixture of experts: top-2 routing with capacity dropping, the load-balancing and z losses
// and a shared expert (tests/data/gpt_golden/README.md, config D).
TEST(GptReferenceTest, MatchesTorchGoldenMixtureOfExperts) {
  CheckGolden("gpt_golden_d.safetensors");
}

// Softmax before top-1, dropping by position (ties between tokens: the earlier kept), an
// expert that receives no token, the grouped GEMM's parameter names (config E).
TEST(GptReferenceTest, MatchesTorchGoldenMixtureOfExpertsPreSoftmaxPositionDrop) {
  CheckGolden("gpt_golden_e.safetensors");
}

// The sequence-level load-balancing loss ("seq_aux_loss": per sample, averaged over the
// micro-batch's), computed in torch as Megatron's router reshapes it (config F).
TEST(GptReferenceTest, MatchesTorchGoldenMixtureOfExpertsSequenceAuxLoss) {
  CheckGolden("gpt_golden_f.safetensors");
}

// Multi-token prediction (MultiTokenPredictionBlock and process_mtp_loss): two depths, each
// joining enorm(embedding of the tokens rolled once more) and hnorm(previous hidden state)
// through eh_proj and a transformer layer, the shared output head, the depths' losses
// weighted by mtp_loss_scaling_factor / mtp_num_layers over their own token counts in the
// gradient and absent from the loss (tests/data/gpt_golden/README.md, config K): an untied
// output layer with label smoothing, tp 2 ...
TEST(GptReferenceTest, MatchesTorchGoldenMultiTokenPredictionUntied) {
  CheckGolden("gpt_golden_k.safetensors");
}

// ... and the output layer tied to the word embedding that the depths also read.
TEST(GptReferenceTest, MatchesTorchGoldenMultiTokenPredictionTied) {
  CheckGolden("gpt_golden_k_tied.safetensors");
}

// Config K tied's depths on context parallelism 2: the labels and loss mask rolled across the
// cp ranks (roll_tensor's exchange, written out in torch), each cp rank's depth losses over its
// own unmasked tokens, so the rank holding the sequence's end weighs its tokens more.
TEST(GptReferenceTest, MatchesTorchGoldenMultiTokenPredictionContextParallel) {
  CheckGolden("gpt_golden_k_cp.safetensors");
}

// Config K's depths with a sliding window on odd layer numbers (window_attn_skip_freq 2): the
// depths' layers take their own numbers within the block (1 slides, 2 does not), not the last
// decoder layer's.
TEST(GptReferenceTest, MatchesTorchGoldenMultiTokenPredictionSlidingWindow) {
  CheckGolden("gpt_golden_k_window.safetensors");
}

// DeepSeek-V3's pair (config K MoE): two depths whose transformer layers are MoE layers (the
// last decoder layer's spec) on DeepSeek-style routing with the sequence-level loss: each
// depth's router adds its load-balancing and z losses to the gradient as the decoder's do
// (not scaled by the MTP factor), and its expert bias moves by its own token counts.
TEST(GptReferenceTest, MatchesTorchGoldenMultiTokenPredictionMixtureOfExperts) {
  CheckGolden("gpt_golden_k_moe.safetensors");
}

// DeepSeek-V3-style routing: sigmoid scores, the expert bias (for choosing only, and its
// update), group-limited top-k, the chosen scores normalised and scaled, the load-balancing
// loss on the normalised sigmoids (config G, through Megatron's own routing functions).
TEST(GptReferenceTest, MatchesTorchGoldenMixtureOfExpertsSigmoidGroupLimited) {
  CheckGolden("gpt_golden_g.safetensors");
}

// Qwen3's global-batch load-balancing loss listed with the sequence-level one (config L): the
// top-k counts of both dp ranks, a float32 tracker averaging them over the step's three
// micro-batches, each loss with its own coefficient.
TEST(GptReferenceTest, MatchesTorchGoldenMixtureOfExpertsGlobalAuxLoss) {
  CheckGolden("gpt_golden_l.safetensors");
}

// sqrt(softplus) scores (moe_router_score_function "sqrtsoftplus") with config G's group
// limit, expert bias and scaling, and the global load-balancing loss on them.
TEST(GptReferenceTest, MatchesTorchGoldenMixtureOfExpertsSqrtSoftplus) {
  CheckGolden("gpt_golden_l_sqrtsoftplus.safetensors");
}

// gpt-oss's MLP: the clamped quick-GELU GLU (glu_linear_offset 1, activation_func_clamp_value
// 1) with add_bias_linear on an MoE layer (the router's bias, the experts' linear_fc1 and
// linear_fc2 biases, fc2's weighted by the probability) and on a dense layer (config I).
TEST(GptReferenceTest, MatchesTorchGoldenGptOssBiasesAndClampedGlu) {
  CheckGolden("gpt_golden_i.safetensors");
}

// gpt-oss's attention (config H): a sliding window of 2 on the layer window_attn_skip_freq
// [0, 1] marks, learnable attention sinks per head (softmax_offset, split over tp 2), built in
// torch from Megatron's own get_sliding_window_causal_mask and SoftmaxOne.
TEST(GptReferenceTest, MatchesTorchGoldenSlidingWindowAndLearnableSinks) {
  CheckGolden("gpt_golden_h.safetensors");
}

// Multi-latent attention (Megatron's MLASelfAttention, local spec): the query's latent with
// q_layernorm, the kv latent with its rope channels and kv_layernorm, yarn rope with mscale
// 1 / mscale_all_dim 0.5 (cos/sin and the softmax scale both scaled), tp 2 (config J).
TEST(GptReferenceTest, MatchesTorchGoldenMultiLatentAttentionYarn) {
  CheckGolden("gpt_golden_j.safetensors");
}

// Multi-latent attention with q_lora_rank null (linear_q_proj), plain rope yet the softmax
// scale's mscale_all_dim, LayerNorm latents with biases, linear_proj's bias, learned positions.
TEST(GptReferenceTest, MatchesTorchGoldenMultiLatentAttentionQProjRope) {
  CheckGolden("gpt_golden_j_q_proj.safetensors");
}

}  // namespace
}  // namespace mpusim
