// The float64 reference model (see reference_model.h): the full layer chain, forward and
// backward, with plain Eigen, one micro-batch at a time, on one slice of the token rows.
// Written from docs/simulator.md only.
//
// Shape legend (full model):
//   s = seq_length, b = micro_batch_size, d = data-parallel size, B = b*d, M = micro-batches,
//   t = tensor-parallel size, Vp = padded vocabulary, h = width of the current activation,
//   n = rows of this slice (row_end - row_begin).
//   An activation [s, B, h] is a row-major [s*B, h] matrix; row r = i*B + g holds sequence
//   position i of global sample g. This slice holds its rows [row_begin, row_end) as an
//   [n, h] float64 Tensor, used through an Eigen Map (no copies between the two).
//
// Per micro-batch m:
//   forward   x_0 = embedding(tokens) or input.mb<m>;  x_{k+1} = layer_k(x_k)
//   backward  dy = 1/(M*s*B) per token (loss) or output_grad.mb<m>;  walk the layers back,
//             adding parameter gradients into accumulators shared by all micro-batches.
// The ops' math is reference/ops.h, shared with the GPT reference; here each op also adds to
// the error budget of what it produces (the "Budgets" section below).
#include "reference/reference_model.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/init.h"
#include "core/schedule.h"
#include "core/sharding.h"
#include "reference/chain_plan.h"
#include "reference/ops.h"
#include "reference/tracker_draws.h"

namespace mpusim {
namespace {

using Mat = ref::Mat;
using MatMap = Eigen::Map<Mat>;
using ConstMatMap = Eigen::Map<const Mat>;
using RowVecMap = Eigen::Map<ref::RowVec>;
using chain_reference::ActState;
using chain_reference::BuildPlan;
using chain_reference::IsEmbedding;
using chain_reference::IsLinear;
using chain_reference::IsLoss;
using chain_reference::LayerPlan;
using chain_reference::Plan;
using chain_reference::Sizes;
using chain_reference::StateKind;

// Whole tensors, by layer index; undefined where the layer has none.
struct Parameters {
  std::vector<Tensor> weight;       // owners: [rows, cols]
  std::vector<Tensor> bias;         // linear layers with a bias: [out]
  std::vector<Tensor> weight_grad;  // owners that are not frozen
  std::vector<Tensor> bias_grad;
};

// A weight owner's full shape and initialisation: a LayerNorm's weight is a vector of ones.
Shape WeightShape(const LayerPlan& lp) {
  return lp.weight_cols == 0 ? Shape{lp.weight_rows} : Shape{lp.weight_rows, lp.weight_cols};
}
InitSpec WeightInit(const LayerPlan& lp) {
  return lp.config->type == LayerType::kLayerNorm ? InitSpec{InitMethod::kOnes, 0.0}
                                                  : lp.config->init;
}

// ---- budgets ------------------------------------------------------------------------------
// The rounding each op adds to what it produces (core/dump/compare.h, docs/simulator.md
// "Tolerances"). An op's result carries its inputs' budgets plus its own.

// A value written in the storage dtype.
constexpr ErrorBudget kStored{1, 0};
// An elementwise function evaluated in the compute dtype (exp, log, erf, a product).
constexpr ErrorBudget kFunction{1, 0};
ErrorBudget SumOf(int64_t terms) { return {0, static_cast<double>(terms)}; }
// A sum over the t ranks of the tp group (all-reduce or reduce-scatter of partial results):
// each partial is stored, then added in t - 1 steps that round in the storage dtype.
ErrorBudget TpSum(int64_t t) {
  return t > 1 ? ErrorBudget{static_cast<double>(t), static_cast<double>(t)} : ErrorBudget{};
}
// A parameter gradient: per-token contributions (`per_token`) summed over every token of every
// micro-batch and data-parallel rank, the storage rounding of weight.grad and the float32
// main_grad additions.
ErrorBudget GradientSum(const ErrorBudget& per_token, const Sizes& sizes) {
  return per_token + kStored + kStored + SumOf(sizes.num_micro * sizes.seq * sizes.batch) +
         TpSum(sizes.tp_size);
}
// Region mappings that add over the tp group, in the forward and in the backward.
bool MappingSumsForward(LayerType type) {
  return type == LayerType::kReduceFromTensorModelParallelRegion ||
         type == LayerType::kReduceScatterToSequenceParallelRegion;
}
bool MappingSumsBackward(const LayerConfig& layer) {
  return layer.type == LayerType::kCopyToTensorModelParallelRegion ||
         (layer.type == LayerType::kGatherFromSequenceParallelRegion &&
          layer.tensor_parallel_output_grad);
}

// ---- tensors of this slice ------------------------------------------------------------------

// Zero-filled (accumulators) and uninitialised (outputs an op writes completely).
Tensor NewTensor(Shape shape) { return Tensor::HostZeros(std::move(shape), DType::kFloat64); }
Tensor NewOutput(Shape shape) { return Tensor::HostEmpty(std::move(shape), DType::kFloat64); }
MatMap AsMat(Tensor& t) { return MatMap(t.data_as<double>(), t.rows(), t.cols()); }
ConstMatMap ConstMat(const Tensor& t) { return ConstMatMap(t.data_as<double>(), t.rows(), t.cols()); }
RowVecMap AsRow(Tensor& t) { return RowVecMap(t.data_as<double>(), t.numel()); }

// An activation of this slice: [n, width] rows and the budget of every element.
struct Act {
  Tensor value;
  ErrorBudget budget;
};

// An activation the op producing it writes completely.
Act NewAct(int64_t rows, int64_t width, ErrorBudget budget) {
  return {NewOutput({rows, width}), budget};
}

StatusOr<Tensor> FromOverride(const Tensor& tensor, const std::string& name, const Shape& shape) {
  if (!tensor.defined() || tensor.device() != Device::kHost || tensor.dtype() != DType::kFloat64 ||
      tensor.shape() != shape) {
    return Status::Error(
        "parameter_overrides",
        fmt::format("\"{}\" must be a host float64 tensor of shape {}", name, ShapeString(shape)));
  }
  return tensor;  // shared: parameters are only read
}

Status InitParameters(const Plan& plan, const std::map<std::string, Tensor>& overrides,
                      Parameters* params) {
  const size_t n = plan.layers.size();
  params->weight.assign(n, Tensor());
  params->bias.assign(n, Tensor());
  params->weight_grad.assign(n, Tensor());
  params->bias_grad.assign(n, Tensor());
  std::set<std::string> known;
  for (size_t i = 0; i < n; ++i) {
    const LayerPlan& lp = plan.layers[i];
    const LayerConfig& c = *lp.config;
    if (lp.weight_layer == static_cast<int>(i)) {
      const std::string name = c.name + ".weight";
      const Shape shape = WeightShape(lp);
      known.insert(name);
      if (auto it = overrides.find(name); it != overrides.end()) {
        StatusOr<Tensor> w = FromOverride(it->second, name, shape);
        if (!w.ok()) return w.status();
        params->weight[i] = std::move(*w);
      } else {
        params->weight[i] = NewOutput(shape);
        FillFlatRange(plan.sizes.seed, name, WeightInit(lp), shape, 0, params->weight[i]);
      }
      if (!c.frozen) params->weight_grad[i] = NewTensor(shape);
    }
    if ((IsLinear(c.type) && c.bias) || c.type == LayerType::kLayerNorm) {
      const std::string name = c.name + ".bias";
      const Shape shape = {lp.out_width};
      known.insert(name);
      if (auto it = overrides.find(name); it != overrides.end()) {
        StatusOr<Tensor> b = FromOverride(it->second, name, shape);
        if (!b.ok()) return b.status();
        params->bias[i] = std::move(*b);
      } else {
        params->bias[i] = NewTensor(shape);  // the contract: biases start at zero
      }
      params->bias_grad[i] = NewTensor(shape);
    }
  }
  for (const auto& [name, tensor] : overrides) {
    if (known.count(name) == 0) {
      return Status::Error("parameter_overrides", fmt::format("no parameter named \"{}\"", name));
    }
  }
  return Status();
}

// The slice's rows of a synthetic [s, B, h] normal(0, 1) tensor (input.mb<m>,
// output_grad.mb<m>).
Act SyntheticNormal(const Sizes& sizes, int64_t row_begin, int64_t rows, const std::string& name,
                    int64_t width) {
  Act x = NewAct(rows, width, kStored);
  FillFlatRange(sizes.seed, name, InitSpec{InitMethod::kNormal, 1.0},
                {sizes.seq, sizes.batch, width}, row_begin * width, x.value);
  return x;
}

std::vector<int64_t> Tokens(const Sizes& sizes, int64_t row_begin, int64_t rows,
                            const std::string& name) {
  std::vector<int64_t> ids(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    ids[static_cast<size_t>(r)] = TokenAt(sizes.seed, name, row_begin + r, sizes.vocab);
  }
  return ids;
}

// keep / (1 - p) for every element of the slice's rows of the dropout's [s, B, h] input: 1/(1-p)
// where kept, 0 where dropped. Element (i, g, j) is drawn by the rank that holds it:
//   r_d = g / b, local sample g % b;
//   replicated      key DefaultSeed(seed, 0, r_d), local [s, b, h], position (i, g % b, j)
//   sequence split  key ModelParallelSeed(., r_t) with r_t = i / (s/t), local [s/t, b, h]
//   hidden split    key ModelParallelSeed(., r_t), local [s, b, h/t]; r_t and the local
//                   column come from inverting the producing layer's ShardSpec (stride rule)
// and kept iff UniformAt(key, n, e) >= p with e the row-major local index and
// n = m * (dropouts on the stream) + position on the stream.
Tensor DropoutScale(const Plan& plan, const LayerPlan& lp, int64_t micro_batch, int64_t row_begin,
                    int64_t rows) {
  const Sizes& sizes = plan.sizes;
  // micro_batch is global: iteration it's micro-batch m.
  const int64_t it = micro_batch / sizes.num_micro, m = micro_batch % sizes.num_micro;
  const size_t stream = lp.model_parallel_stream ? 1 : 0;
  const auto draw = static_cast<uint64_t>(
      plan.draws.Position(it, lp.pp_rank, lp.chunk, m, stream, lp.stream_position));
  const int64_t width = lp.in_width;
  const StateKind kind = lp.in_state.kind;

  // Owner tp rank and local column of each global column.
  std::vector<int64_t> column_rank(static_cast<size_t>(width), 0);
  std::vector<int64_t> column_local(static_cast<size_t>(width));
  for (int64_t j = 0; j < width; ++j) column_local[static_cast<size_t>(j)] = j;
  int64_t local_width = width;
  if (kind == StateKind::kHiddenSplit) {
    local_width = width / sizes.tp_size;
    for (int64_t tp_rank = 0; tp_rank < sizes.tp_size; ++tp_rank) {
      ShardSpec spec;
      spec.Split(ShardAxis::kTp, 2, sizes.tp_size, tp_rank, lp.in_state.stride);
      for (int64_t l = 0; l < local_width; ++l) {
        const auto j = static_cast<size_t>(GlobalIndex(spec, 2, width, l));
        column_rank[j] = tp_rank;
        column_local[j] = l;
      }
    }
  }
  const int64_t local_seq =
      kind == StateKind::kSequenceSplit ? sizes.seq / sizes.tp_size : sizes.seq;

  Tensor keep = NewOutput({rows, width});
  const auto draw_of = [&](int64_t row, int64_t j) {
    const auto jj = static_cast<size_t>(j);
    const ref::LocalElement at = ref::LocalActivationElement(
        (row_begin + row) / sizes.batch, (row_begin + row) % sizes.batch, column_local[jj],
        local_seq, sizes.micro, local_width);
    // The rank holding a hidden-split column is its shard's; otherwise the sequence shard's.
    const int64_t tp_rank = kind == StateKind::kHiddenSplit ? column_rank[jj] : at.seq_rank;
    return ref::MaskDraw{
        ref::TrackerKey(sizes.seed, lp.pp_rank, at.dp_rank, lp.model_parallel_stream, tp_rank),
        draw, static_cast<uint64_t>(at.index)};
  };
  ref::DropoutKeep(lp.config->p, draw_of, AsMat(keep));
  return keep;
}

// Token ids as a [n, 1] float64 tensor (the rows of [s, B]).
Tensor IdsTensor(const std::vector<int64_t>& ids) {
  Tensor t = NewTensor({static_cast<int64_t>(ids.size()), 1});
  for (size_t r = 0; r < ids.size(); ++r) t.data_as<double>()[r] = static_cast<double>(ids[r]);
  return t;
}

// What one micro-batch's forward keeps for its backward (by layer index where per layer).
struct MicroBatchStash {
  std::vector<int64_t> tokens;  // [n] the embedding's ids
  std::vector<Act> inputs;      // each layer's input [n, h_in]
  std::vector<Act> gelu_in;     // GeLU: X + bias (X itself without bias_from)
  std::vector<Tensor> keep;     // Dropout: 0 or 1/(1-p)
  std::vector<Tensor> xhat;     // LayerNorm: (x - mean) * rstd [n, h]
  std::vector<std::vector<double>> rstd;  // LayerNorm: per row
  Tensor loss_grad;             // loss: dl/dz per token [n, Vp], before the 1/(M*s*B) scale
  ErrorBudget loss_grad_budget;
};

// The slice being computed and what it records.
struct SliceRun {
  SliceRun(const Plan& p, int64_t begin, int64_t end, Parameters* parameters)
      : plan(p),
        row_begin(begin),
        rows(end - begin),
        params(parameters),
        weight_grad_budget(p.layers.size()),
        bias_grad_budget(p.layers.size()) {}

  const Plan& plan;
  int64_t row_begin;
  int64_t rows;
  Parameters* params;
  // Rows of the last micro-batch, by name (activations share storage between names).
  std::map<std::string, ReferenceTensor> recorded;
  // Per-token budgets of what each parameter gradient sums (the same in every micro-batch).
  std::vector<ErrorBudget> weight_grad_budget, bias_grad_budget;
  ErrorBudget loss_budget;
  double loss_sum = 0;  // sum of this slice's per-token losses over all micro-batches

  void Record(bool record, const std::string& name, Shape full_shape, const Act& act) {
    if (!record) return;
    ReferenceTensor t;
    t.name = name;
    t.full_shape = std::move(full_shape);
    t.layout = ReferenceTensor::Layout::kRows;
    t.value = act.value;
    t.budget = act.budget;
    recorded[name] = std::move(t);
  }
  Shape ActivationShape(int64_t width) const {
    return {plan.sizes.seq, plan.sizes.batch, width};
  }
  Shape TokenShape() const { return {plan.sizes.seq, plan.sizes.batch}; }

  void MicroBatch(int64_t m, bool record);
  void Forward(int64_t m, bool record, MicroBatchStash* st);
  void Backward(int64_t m, bool record, const MicroBatchStash& st);
};

// One micro-batch forward and backward on this slice's rows: global micro-batch m (k*M + the
// micro-batch in training iteration k), whose number names its data and synthetic streams and
// numbers its dropout draws. Adds into the gradient accumulators and into loss_sum; records
// the activations when `record`.
void SliceRun::MicroBatch(int64_t m, bool record) {
  MicroBatchStash st;
  Forward(m, record, &st);
  Backward(m, record, st);
}

// The forward: records each layer's input and output, adds the per-token losses into
// loss_sum, and keeps in `st` what the backward needs.
void SliceRun::Forward(int64_t m, bool record, MicroBatchStash* st) {
  const Sizes& sizes = plan.sizes;
  const size_t n = plan.layers.size();
  const int64_t t = sizes.tp_size;

  std::vector<int64_t> labels;
  if (plan.has_embedding) {
    st->tokens = Tokens(sizes, row_begin, rows, fmt::format("tokens.mb{}", m));
    Record(record, "tokens", TokenShape(), Act{IdsTensor(st->tokens), {}});
  }
  if (plan.has_loss) {
    labels = Tokens(sizes, row_begin, rows, fmt::format("labels.mb{}", m));
    Record(record, "labels", TokenShape(), Act{IdsTensor(labels), {}});
  }
  st->inputs.assign(n, Act{});
  st->gelu_in.assign(n, Act{});
  st->keep.assign(n, Tensor());
  st->xhat.assign(n, Tensor());
  st->rstd.assign(n, {});
  Act x;
  if (!plan.has_embedding) {
    x = SyntheticNormal(sizes, row_begin, rows, fmt::format("input.mb{}", m), plan.input_width);
  }
  for (size_t k = 0; k < n; ++k) {
    const LayerPlan& lp = plan.layers[k];
    const LayerConfig& c = *lp.config;
    if (!IsEmbedding(c.type)) st->inputs[k] = x;
    const Act& in = st->inputs[k];
    switch (c.type) {
      case LayerType::kVocabParallelEmbedding:
      case LayerType::kParallelEmbedding:
      case LayerType::kEmbedding: {
        const Tensor& w = params->weight[k];
        x = NewAct(rows, w.cols(), kStored + kStored);
        ref::EmbeddingForward(ConstMat(w), st->tokens, AsMat(x.value));
        break;
      }
      case LayerType::kColumnParallelLinear:
      case LayerType::kRowParallelLinear:
      case LayerType::kLinear: {
        const Tensor& w = params->weight[static_cast<size_t>(lp.weight_layer)];
        ErrorBudget budget = in.budget + kStored + kStored + SumOf(c.input_size) + TpSum(t);
        if (lp.adds_bias) budget += kStored;
        x = NewAct(rows, lp.out_width, budget);
        ref::LinearForward(ConstMat(in.value), ConstMat(w), AsMat(x.value));
        if (lp.adds_bias) ref::AddBias(AsRow(params->bias[k]), AsMat(x.value));
        break;
      }
      case LayerType::kGeLU: {
        Act& gelu_in = st->gelu_in[k];
        gelu_in = in;
        if (lp.bias_layer >= 0) {
          gelu_in = NewAct(rows, lp.in_width, in.budget + kStored);
          AsMat(gelu_in.value) = ConstMat(in.value);
          ref::AddBias(AsRow(params->bias[static_cast<size_t>(lp.bias_layer)]),
                       AsMat(gelu_in.value));
        }
        x = NewAct(rows, lp.out_width, gelu_in.budget + kFunction + kStored);
        ref::ActivationForward(Activation::kGelu, ConstMat(gelu_in.value), AsMat(x.value));
        break;
      }
      case LayerType::kLayerNorm: {
        // Per row: the mean and the biased variance (sums of h terms), 1 / sqrt, the
        // normalised value, the weight's product and the bias's sum.
        const int64_t h = lp.in_width;
        x = NewAct(rows, h,
                   in.budget + SumOf(h) + SumOf(h) + kFunction + kFunction + kFunction + kStored);
        st->xhat[k] = NewOutput({rows, h});
        st->rstd[k].assign(static_cast<size_t>(rows), 0.0);
        const auto xin = ConstMat(in.value);
        auto xhat = AsMat(st->xhat[k]);
        auto y = AsMat(x.value);
        const auto w = AsRow(params->weight[k]);
        const auto b = AsRow(params->bias[k]);
        for (int64_t r = 0; r < rows; ++r) {
          const double mean = xin.row(r).mean();
          const double var = (xin.row(r).array() - mean).square().mean();
          const double rstd = 1.0 / std::sqrt(var + c.eps);
          st->rstd[k][static_cast<size_t>(r)] = rstd;
          xhat.row(r) = (xin.row(r).array() - mean) * rstd;
          y.row(r) = xhat.row(r).array() * w.array() + b.array();
        }
        break;
      }
      case LayerType::kReLU:  // exact
        x = NewAct(rows, lp.out_width, in.budget + kStored);
        ref::ActivationForward(Activation::kRelu, ConstMat(in.value), AsMat(x.value));
        break;
      case LayerType::kDropout:
        st->keep[k] = DropoutScale(plan, lp, m, row_begin, rows);
        x = NewAct(rows, lp.out_width, in.budget + kStored);
        AsMat(x.value) = ConstMat(in.value).cwiseProduct(ConstMat(st->keep[k]));
        break;
      case LayerType::kVocabParallelCrossEntropy:
      case LayerType::kCrossEntropyLoss: {
        // exp and log of every logit, the sums over Vp, the statistics summed over tp.
        const ErrorBudget budget =
            in.budget + kFunction + kFunction + SumOf(lp.in_width) + TpSum(t) + kStored;
        x = NewAct(rows, 1, budget);
        st->loss_grad = NewOutput({rows, lp.in_width});
        st->loss_grad_budget = budget;
        // The per-token gradient (token scale 1): the backward multiplies by output_grad.
        ref::CrossEntropy(ConstMat(in.value), labels, c.label_smoothing, 1.0,
                          std::span<double>(x.value.data_as<double>(), static_cast<size_t>(rows)),
                          AsMat(st->loss_grad));
        loss_sum += AsMat(x.value).sum();
        loss_budget = budget + SumOf(sizes.num_micro * sizes.seq * sizes.batch);
        break;
      }
      default:  // region mappings: identity
        if (MappingSumsForward(c.type)) x.budget += TpSum(t);
        break;
    }
    if (!IsEmbedding(c.type)) Record(record, c.name + ".input", ActivationShape(lp.in_width), in);
    Record(record, c.name + ".output",
           IsLoss(c.type) ? TokenShape() : ActivationShape(lp.out_width), x);
  }
}

// The backward: from 1/(M*s*B) per token (the loss) or output_grad.mb<m> back to the first
// layer, recording each gradient and adding the parameter gradients into the accumulators.
void SliceRun::Backward(int64_t m, bool record, const MicroBatchStash& st) {
  const Sizes& sizes = plan.sizes;
  const int64_t t = sizes.tp_size;
  Act dy;
  if (plan.has_loss) {
    const double per_token = 1.0 / static_cast<double>(sizes.num_micro * sizes.seq * sizes.batch);
    dy = NewAct(rows, 1, kStored);
    AsMat(dy.value).setConstant(per_token);
  } else {
    dy = SyntheticNormal(sizes, row_begin, rows, fmt::format("output_grad.mb{}", m),
                         plan.layers.back().out_width);
  }
  for (size_t k = plan.layers.size(); k-- > 0;) {
    const LayerPlan& lp = plan.layers[k];
    const LayerConfig& c = *lp.config;
    Record(record, c.name + ".output_grad",
           IsLoss(c.type) ? TokenShape() : ActivationShape(lp.out_width), dy);
    Act dx;
    switch (c.type) {
      case LayerType::kVocabParallelEmbedding:
      case LayerType::kParallelEmbedding:
      case LayerType::kEmbedding: {
        Tensor& dw = params->weight_grad[k];
        weight_grad_budget[k] = dy.budget;
        if (!dw.defined()) break;  // frozen
        ref::EmbeddingBackward(ConstMat(dy.value), st.tokens, AsMat(dw));
        break;
      }
      case LayerType::kColumnParallelLinear:
      case LayerType::kRowParallelLinear:
      case LayerType::kLinear: {
        const auto owner = static_cast<size_t>(lp.weight_layer);
        dx = NewAct(rows, lp.in_width,
                    dy.budget + kStored + kStored + SumOf(lp.out_width) + TpSum(t));
        ref::LinearGradInput(ConstMat(dy.value), ConstMat(params->weight[owner]), AsMat(dx.value));
        if (Tensor& dw = params->weight_grad[owner]; dw.defined()) {
          ref::LinearGradWeight(ConstMat(dy.value), ConstMat(st.inputs[k].value), AsMat(dw));
        }
        // A tied weight's gradient sums both uses: the larger budget stands for both.
        const ErrorBudget use = dy.budget + st.inputs[k].budget;
        if (use.roundings + use.terms >
            weight_grad_budget[owner].roundings + weight_grad_budget[owner].terms) {
          weight_grad_budget[owner] = use;
        }
        if (lp.adds_bias) {
          ref::LinearGradBias(ConstMat(dy.value), AsRow(params->bias_grad[k]));
          bias_grad_budget[k] = dy.budget;
        }
        break;
      }
      case LayerType::kGeLU:
        dx = NewAct(rows, lp.in_width, dy.budget + st.gelu_in[k].budget + kFunction + kStored);
        ref::ActivationBackward(Activation::kGelu, ConstMat(dy.value),
                                ConstMat(st.gelu_in[k].value), AsMat(dx.value));
        if (lp.bias_layer >= 0) {
          const auto owner = static_cast<size_t>(lp.bias_layer);
          ref::LinearGradBias(ConstMat(dx.value), AsRow(params->bias_grad[owner]));
          bias_grad_budget[owner] = dx.budget;
        }
        break;
      case LayerType::kLayerNorm: {
        // g = dy w; dx = rstd (g - mean(g) - xhat mean(g xhat)); dw += sum dy xhat, db += sum dy.
        const int64_t h = lp.in_width;
        const ErrorBudget budget = dy.budget + st.inputs[k].budget + SumOf(h) + SumOf(h) +
                                   kFunction + kFunction + kFunction + kStored;
        dx = NewAct(rows, h, budget);
        const auto xhat = ConstMat(st.xhat[k]);
        const auto d = AsMat(dy.value);
        auto out = AsMat(dx.value);
        const auto w = AsRow(params->weight[k]);
        for (int64_t r = 0; r < rows; ++r) {
          const Eigen::ArrayXd g = d.row(r).transpose().array() * w.transpose().array();
          const Eigen::ArrayXd xr = xhat.row(r).transpose().array();
          const double mean_g = g.mean(), mean_gx = (g * xr).mean();
          out.row(r) =
              (st.rstd[k][static_cast<size_t>(r)] * (g - mean_g - xr * mean_gx)).transpose();
        }
        AsRow(params->weight_grad[k]) += (d.array() * xhat.array()).colwise().sum().matrix();
        AsRow(params->bias_grad[k]) += d.colwise().sum();
        weight_grad_budget[k] = dy.budget + st.inputs[k].budget + SumOf(h) + kFunction;
        bias_grad_budget[k] = dy.budget;
        break;
      }
      case LayerType::kReLU:
        dx = NewAct(rows, lp.in_width, dy.budget + kStored);
        ref::ActivationBackward(Activation::kRelu, ConstMat(dy.value), ConstMat(st.inputs[k].value),
                                AsMat(dx.value));
        break;
      case LayerType::kDropout:
        dx = NewAct(rows, lp.in_width, dy.budget + kStored);
        AsMat(dx.value) = AsMat(dy.value).cwiseProduct(ConstMat(st.keep[k]));
        break;
      case LayerType::kVocabParallelCrossEntropy:
      case LayerType::kCrossEntropyLoss:
        dx = NewAct(rows, lp.in_width, dy.budget + st.loss_grad_budget + kStored);
        AsMat(dx.value) = ConstMat(st.loss_grad).array().colwise() * AsMat(dy.value).col(0).array();
        break;
      default:  // region mappings: identity
        dx = dy;
        if (MappingSumsBackward(c)) dx.budget += TpSum(t);
        break;
    }
    if (IsEmbedding(c.type)) break;  // the first layer; nothing flows into tokens
    Record(record, c.name + ".input_grad", ActivationShape(lp.in_width), dx);
    dy = std::move(dx);
  }
}

// The executor's record order: tokens, labels; per layer input, input_grad, output,
// output_grad, then weight, weight_grad (owners), bias, bias_grad; loss.
std::vector<ReferenceTensor> InRecordOrder(const Plan& plan, SliceRun& run) {
  const Sizes& sizes = plan.sizes;
  std::vector<ReferenceTensor> out;
  auto take = [&](const std::string& name) {
    auto it = run.recorded.find(name);
    if (it != run.recorded.end()) out.push_back(std::move(it->second));
  };
  auto whole = [&](const std::string& name, const Tensor& value, bool partial,
                   ErrorBudget budget, std::string gradient_of) {
    if (!value.defined()) return;
    ReferenceTensor t;
    t.name = name;
    t.full_shape = value.shape();
    t.partial = partial;
    t.value = value;
    t.budget = budget;
    t.parameter = !partial && gradient_of.empty();
    t.gradient_of = std::move(gradient_of);
    out.push_back(std::move(t));
  };
  take("tokens");
  take("labels");
  for (size_t k = 0; k < plan.layers.size(); ++k) {
    const std::string& name = plan.layers[k].config->name;
    take(name + ".input");
    take(name + ".input_grad");
    take(name + ".output");
    take(name + ".output_grad");
    // Trained: the weight owners' weights and the biases; the gradients say whose they are.
    whole(name + ".weight", run.params->weight[k], false, kStored, "");
    whole(name + ".weight_grad", run.params->weight_grad[k], true,
          GradientSum(run.weight_grad_budget[k], sizes), name + ".weight");
    whole(name + ".bias", run.params->bias[k], false, kStored, "");
    whole(name + ".bias_grad", run.params->bias_grad[k], true,
          GradientSum(run.bias_grad_budget[k], sizes), name + ".bias");
  }
  if (plan.has_loss) {
    Tensor loss = NewTensor({1});
    loss.data_as<double>()[0] =
        run.loss_sum / static_cast<double>(sizes.num_micro * sizes.seq * sizes.batch);
    whole("loss", loss, true, run.loss_budget + kFunction, "");
  }
  return out;
}

#if defined(MPUSIM_HAVE_OPENBLAS)
extern "C" void openblas_set_num_threads(int num_threads);
#endif

}  // namespace

StatusOr<std::vector<ReferenceParameter>> ReferenceParameters(const ParallelConfig& parallel,
                                                              const ModelConfig& model,
                                                              const RunConfig& run) {
  Plan plan;
  MPUSIM_RETURN_IF_ERROR(BuildPlan(parallel, model, run, &plan));
  std::vector<ReferenceParameter> out;
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerPlan& lp = plan.layers[i];
    if (lp.weight_layer != static_cast<int>(i)) continue;
    out.push_back({lp.config->name + ".weight", WeightShape(lp), WeightInit(lp)});
  }
  return out;
}

int64_t ReferenceRows(const ParallelConfig& parallel, const RunConfig& run) {
  const int64_t tp = std::max<int64_t>(parallel.tensor_model_parallel_size, 1);
  const int64_t pp = std::max<int64_t>(parallel.pipeline_model_parallel_size, 1);
  return run.seq_length * run.micro_batch_size * (parallel.world_size / (tp * pp));
}

StatusOr<ReferenceResult> RunReferenceWithOverrides(
    const ParallelConfig& parallel, const ModelConfig& model, const RunConfig& run,
    const std::map<std::string, Tensor>& parameter_overrides, ReferenceSlice slice,
    int64_t iteration) {
#if defined(MPUSIM_HAVE_OPENBLAS)
  openblas_set_num_threads(1);
#endif
  Plan plan;
  MPUSIM_RETURN_IF_ERROR(BuildPlan(parallel, model, run, &plan));
  const int64_t rows = plan.sizes.seq * plan.sizes.batch;
  const int64_t row_end = slice.end < 0 ? rows : slice.end;
  if (slice.begin < 0 || slice.begin > row_end || row_end > rows) {
    return Status::Error("reference slice", fmt::format("rows [{}, {}) are not inside [0, {})",
                                                        slice.begin, row_end, rows));
  }
  Parameters params;
  MPUSIM_RETURN_IF_ERROR(InitParameters(plan, parameter_overrides, &params));

  SliceRun slice_run(plan, slice.begin, row_end, &params);
  if (iteration < 0) {
    return Status::Error("reference iteration", fmt::format("is {}, not >= 0", iteration));
  }
  const int64_t M = plan.sizes.num_micro;
  for (int64_t m = 0; m < M; ++m) slice_run.MicroBatch(iteration * M + m, m + 1 == M);

  ReferenceResult result;
  result.units = rows;
  result.slice_begin = slice.begin;
  result.slice_end = row_end;
  result.tensors = InRecordOrder(plan, slice_run);
  if (plan.has_loss) {
    result.has_loss = true;
    result.loss = result.Find("loss")->value.data_as<double>()[0];
  }
  return result;
}

StatusOr<ReferenceResult> RunReference(const ParallelConfig& parallel, const ModelConfig& model,
                                       const RunConfig& run, ReferenceSlice slice) {
  return RunReferenceWithOverrides(parallel, model, run, {}, slice);
}

}  // namespace mpusim
