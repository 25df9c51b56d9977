// The float64 reference model (see reference_model.h): the full layer chain, forward and
// backward, with plain Eigen, one micro-batch at a time. Written from docs/simulator.md only.
//
// Shape legend (full model):
//   s = seq_length, b = micro_batch_size, d = data-parallel size, B = b*d, M = micro-batches,
//   t = tensor-parallel size, Vp = padded vocabulary, h = width of the current activation.
//   An activation [s, B, h] is a row-major Eigen matrix with s*B rows and h columns; row
//   r = i*B + g holds sequence position i of global sample g, so the matrix storage is the
//   row-major [s, B, h] tensor itself and converts to a Tensor by a flat copy.
//
// Per micro-batch m:
//   forward   x_0 = embedding(tokens) or input.mb<m>;  x_{k+1} = layer_k(x_k)
//   backward  dy = 1/(M*s*B) per token (loss) or output_grad.mb<m>;  walk the layers back,
//             adding parameter gradients into accumulators shared by all micro-batches.
#include "reference/reference_model.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <cmath>
#include <cstdint>
#include <map>
#include <numbers>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/init.h"
#include "core/philox.h"
#include "core/rng.h"
#include "core/sharding.h"

namespace mpusim {
namespace {

using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowVec = Eigen::Matrix<double, 1, Eigen::Dynamic>;

// The parallel state of an activation (docs/simulator.md, "Parallel states of an
// activation"). The full-model values never depend on it; only the dropout masks do,
// because each mask element is drawn by the rank that holds it.
enum class StateKind : uint8_t {
  kTokens,
  kReplicated,
  kHiddenSplit,
  kSequenceSplit,
  kPartialSum,
  kLoss,
};

struct ActState {
  StateKind kind = StateKind::kReplicated;
  int64_t stride = 1;  // kHiddenSplit: the stride of the layer that produced it
};

struct Sizes {
  uint64_t seed = 0;
  int64_t tp_size = 1;                  // t
  int64_t dp_size = 1;                  // d
  int64_t seq = 0;                      // s
  int64_t micro = 0;                    // b
  int64_t batch = 0;                    // B = b*d
  int64_t num_micro = 0;                // M
  int64_t vocab = 0;                    // vocab_size (0: not given)
  std::optional<int64_t> padded_vocab;  // Vp, when vocab_size is given
};

struct LayerPlan {
  const LayerConfig* config = nullptr;
  std::string where;      // "model.layers[i]"
  int64_t in_width = 0;   // 0 for embeddings (they read tokens)
  int64_t out_width = 0;  // 0 for the loss (it writes one value per token)
  // Weight: the layer whose weight this one multiplies by (itself for an owner, the
  // weight_from layer for a borrower, -1 without a weight).
  int weight_layer = -1;
  int64_t weight_rows = 0;  // owners: [out, in] or [num_embeddings, embedding_dim]
  int64_t weight_cols = 0;
  bool adds_bias = false;  // linear: bias && !skip_bias_add
  int bias_layer = -1;     // GeLU: the bias_from layer
  // Dropout
  ActState in_state;
  bool model_parallel_stream = false;
  int64_t stream_position = 0;  // position among the dropout layers on the same stream
};

struct Plan {
  Sizes sizes;
  std::vector<LayerPlan> layers;
  int64_t input_width = 0;  // synthetic input width; 0 when the chain starts with an embedding
  int64_t dropouts_on_default = 0;
  int64_t dropouts_on_model_parallel = 0;
  bool has_embedding = false;
  bool has_loss = false;
};

struct Parameters {
  std::vector<Mat> weight;       // by owner layer index; empty for non-owners
  std::vector<RowVec> bias;      // by layer index; empty without a bias
  std::vector<Mat> weight_grad;  // owners that are not frozen
  std::vector<RowVec> bias_grad;
};

bool IsEmbedding(LayerType type) {
  return type == LayerType::kVocabParallelEmbedding || type == LayerType::kParallelEmbedding;
}
bool IsLinear(LayerType type) {
  return type == LayerType::kColumnParallelLinear || type == LayerType::kRowParallelLinear;
}

std::string LayerWhere(size_t index) { return fmt::format("model.layers[{}]", index); }
std::string TypeName(LayerType type) {
  const char* name = LayerTypeName(type);
  return name != nullptr ? std::string(name) : std::string("?");
}

// The state of the synthetic input: what the first layer accepts. Width-keeping layers that
// accept any state (GeLU, Dropout) get a replicated input.
ActState InitialState(const LayerConfig& first, bool sequence_parallel) {
  switch (first.type) {
    case LayerType::kColumnParallelLinear:
      return {sequence_parallel ? StateKind::kSequenceSplit : StateKind::kReplicated, 1};
    case LayerType::kRowParallelLinear:
      return {first.input_is_parallel ? StateKind::kHiddenSplit : StateKind::kReplicated, 1};
    case LayerType::kReduceFromTensorModelParallelRegion:
    case LayerType::kReduceScatterToSequenceParallelRegion:
      return {StateKind::kPartialSum, 1};
    case LayerType::kGatherFromTensorModelParallelRegion:
    case LayerType::kVocabParallelCrossEntropy:
      return {StateKind::kHiddenSplit, 1};
    case LayerType::kGatherFromSequenceParallelRegion:
      return {StateKind::kSequenceSplit, 1};
    case LayerType::kVocabParallelEmbedding:
    case LayerType::kParallelEmbedding:
      return {StateKind::kTokens, 1};
    default:
      return {StateKind::kReplicated, 1};
  }
}

// The "produces" column of the contract's state table.
ActState NextState(const LayerConfig& layer, ActState in, bool sequence_parallel) {
  const StateKind row_out = sequence_parallel ? StateKind::kSequenceSplit : StateKind::kReplicated;
  switch (layer.type) {
    case LayerType::kVocabParallelEmbedding:
    case LayerType::kRowParallelLinear:
      return {row_out, 1};
    case LayerType::kParallelEmbedding:
    case LayerType::kCopyToTensorModelParallelRegion:
    case LayerType::kReduceFromTensorModelParallelRegion:
    case LayerType::kGatherFromTensorModelParallelRegion:
    case LayerType::kGatherFromSequenceParallelRegion:
      return {StateKind::kReplicated, 1};
    case LayerType::kColumnParallelLinear:
      if (layer.gather_output) return {StateKind::kReplicated, 1};
      return {StateKind::kHiddenSplit, layer.stride};
    case LayerType::kScatterToTensorModelParallelRegion:
      return {StateKind::kHiddenSplit, 1};
    case LayerType::kScatterToSequenceParallelRegion:
    case LayerType::kReduceScatterToSequenceParallelRegion:
      return {StateKind::kSequenceSplit, 1};
    case LayerType::kGeLU:
    case LayerType::kDropout:
      return in;
    case LayerType::kVocabParallelCrossEntropy:
      return {StateKind::kLoss, 1};
  }
  return in;
}

StatusOr<int64_t> ResolveSize(const SizeValue& size, const Sizes& sizes, const std::string& where,
                              std::string_view key) {
  if (size.padded_vocab && !sizes.padded_vocab.has_value()) {
    return Status::Error(fmt::format("{}.{}", where, key),
                         "\"padded_vocab_size\" needs model.vocab_size");
  }
  const int64_t value = size.Resolve(sizes.padded_vocab.value_or(0));
  if (value < 1) return Status::Error(fmt::format("{}.{}", where, key), "must be >= 1");
  return value;
}

// Width of the synthetic input when the first layer is not an embedding.
StatusOr<int64_t> SyntheticInputWidth(const ModelConfig& model, const Sizes& sizes) {
  const LayerConfig& first = model.layers.front();
  const bool keeps_width = !IsLinear(first.type) && !IsEmbedding(first.type) &&
                           first.type != LayerType::kVocabParallelCrossEntropy;
  if (keeps_width && first.input_size > 0) return first.input_size;
  for (const LayerConfig& layer : model.layers) {
    if (IsLinear(layer.type)) return layer.input_size;  // checked >= 1 by the caller
    if (layer.type == LayerType::kVocabParallelCrossEntropy) {
      if (!sizes.padded_vocab.has_value()) {
        return Status::Error("model.vocab_size", "required with a VocabParallelCrossEntropy");
      }
      return *sizes.padded_vocab;
    }
    if (IsEmbedding(layer.type)) break;
  }
  return Status::Error(LayerWhere(0),
                       "cannot tell the width of the synthetic input: no linear or loss layer "
                       "fixes it and the first layer has no input_size");
}

Status CheckSizes(const ParallelConfig& parallel, const ModelConfig& model, const RunConfig& run,
                  Sizes* sizes) {
  const int64_t tp_size = parallel.tensor_model_parallel_size;
  if (tp_size < 1) return Status::Error("parallel.tensor_model_parallel_size", "must be >= 1");
  if (parallel.world_size < 1 || parallel.world_size % tp_size != 0) {
    return Status::Error("parallel.world_size",
                         fmt::format("must be a positive multiple of tensor_model_parallel_size "
                                     "({}), got {}",
                                     tp_size, parallel.world_size));
  }
  if (parallel.pipeline_model_parallel_size != 1) {
    return Status::Error("parallel.pipeline_model_parallel_size", "mpusim run requires 1");
  }
  if (parallel.context_parallel_size != 1) {
    return Status::Error("parallel.context_parallel_size", "mpusim run requires 1");
  }
  if (run.seq_length < 1) return Status::Error("run.seq_length", "must be >= 1");
  if (run.micro_batch_size < 1) return Status::Error("run.micro_batch_size", "must be >= 1");
  if (run.num_microbatches < 1) return Status::Error("run.num_microbatches", "must be >= 1");
  sizes->seed = run.seed;
  sizes->tp_size = tp_size;
  sizes->dp_size = parallel.world_size / tp_size;
  sizes->seq = run.seq_length;
  sizes->micro = run.micro_batch_size;
  sizes->batch = run.micro_batch_size * sizes->dp_size;
  sizes->num_micro = run.num_microbatches;
  if (model.vocab_size.has_value()) {
    if (*model.vocab_size < 1) return Status::Error("model.vocab_size", "must be >= 1");
    if (model.make_vocab_size_divisible_by < 1) {
      return Status::Error("model.make_vocab_size_divisible_by", "must be >= 1");
    }
    sizes->vocab = *model.vocab_size;
    sizes->padded_vocab = model.PaddedVocabSize(tp_size);
    if (*sizes->padded_vocab < sizes->vocab) {
      return Status::Error("model.vocab_size", "padded vocabulary smaller than vocab_size");
    }
  }
  return Status();
}

// Checks the dropout's input state and places it on its random stream.
Status PlanDropout(const Sizes& sizes, ActState state, int64_t width, Plan* plan, LayerPlan* lp) {
  const double p = lp->config->p;
  if (!(p >= 0.0 && p <= 1.0)) return Status::Error(lp->where + ".p", "must be in [0, 1]");
  lp->in_state = state;
  switch (state.kind) {
    case StateKind::kReplicated:
      lp->model_parallel_stream = false;
      break;
    case StateKind::kHiddenSplit:
      if (state.stride < 1 || width % (sizes.tp_size * state.stride) != 0) {
        return Status::Error(lp->where, fmt::format("hidden-split input of width {} does not "
                                                    "divide into {} ranks x stride {}",
                                                    width, sizes.tp_size, state.stride));
      }
      lp->model_parallel_stream = true;
      break;
    case StateKind::kSequenceSplit:
      if (sizes.seq % sizes.tp_size != 0) {
        return Status::Error(lp->where, fmt::format("sequence-split input: seq_length {} is not "
                                                    "a multiple of {}",
                                                    sizes.seq, sizes.tp_size));
      }
      lp->model_parallel_stream = true;
      break;
    default:
      return Status::Error(lp->where,
                           "Dropout needs a replicated, hidden-split or "
                           "sequence-split input (not a partial sum)");
  }
  int64_t& count =
      lp->model_parallel_stream ? plan->dropouts_on_model_parallel : plan->dropouts_on_default;
  lp->stream_position = count++;
  return Status();
}

Status BuildPlan(const ParallelConfig& parallel, const ModelConfig& model, const RunConfig& run,
                 Plan* plan) {
  MPUSIM_RETURN_IF_ERROR(CheckSizes(parallel, model, run, &plan->sizes));
  const Sizes& sizes = plan->sizes;
  const std::vector<LayerConfig>& layers = model.layers;
  if (layers.empty()) return Status::Error("model.layers", "needs at least one layer");

  std::map<std::string, int> index_of;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].name.empty()) return Status::Error(LayerWhere(i) + ".name", "is empty");
    if (!index_of.emplace(layers[i].name, static_cast<int>(i)).second) {
      return Status::Error(LayerWhere(i) + ".name",
                           fmt::format("\"{}\" is used by an earlier layer", layers[i].name));
    }
  }

  ActState state = InitialState(layers.front(), parallel.sequence_parallel);
  int64_t width = 0;
  if (!IsEmbedding(layers.front().type)) {
    StatusOr<int64_t> input_width = SyntheticInputWidth(model, sizes);
    if (!input_width.ok()) return input_width.status();
    width = *input_width;
    plan->input_width = width;
  }

  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerConfig& c = layers[i];
    LayerPlan lp;
    lp.config = &c;
    lp.where = LayerWhere(i);
    lp.in_width = width;
    const bool last = i + 1 == layers.size();
    switch (c.type) {
      case LayerType::kVocabParallelEmbedding:
      case LayerType::kParallelEmbedding: {
        if (i != 0) {
          return Status::Error(lp.where, fmt::format("{} reads tokens, so it must be the first "
                                                     "layer",
                                                     TypeName(c.type)));
        }
        if (!sizes.padded_vocab.has_value()) {
          return Status::Error("model.vocab_size", "required with an embedding");
        }
        StatusOr<int64_t> rows = ResolveSize(c.num_embeddings, sizes, lp.where, "num_embeddings");
        if (!rows.ok()) return rows.status();
        if (*rows < sizes.vocab) {
          return Status::Error(
              lp.where + ".num_embeddings",
              fmt::format("{} rows cannot hold token ids < vocab_size {}", *rows, sizes.vocab));
        }
        if (c.embedding_dim < 1) return Status::Error(lp.where + ".embedding_dim", "must be >= 1");
        lp.weight_layer = static_cast<int>(i);
        lp.weight_rows = *rows;
        lp.weight_cols = c.embedding_dim;
        lp.out_width = c.embedding_dim;
        plan->has_embedding = true;
        break;
      }
      case LayerType::kColumnParallelLinear:
      case LayerType::kRowParallelLinear: {
        if (c.input_size < 1) return Status::Error(lp.where + ".input_size", "must be >= 1");
        if (c.input_size != width) {
          return Status::Error(
              lp.where + ".input_size",
              fmt::format("is {} but the incoming activation has width {}", c.input_size, width));
        }
        if (c.stride < 1) return Status::Error(lp.where + ".stride", "must be >= 1");
        StatusOr<int64_t> out = ResolveSize(c.output_size, sizes, lp.where, "output_size");
        if (!out.ok()) return out.status();
        lp.out_width = *out;
        if (!c.weight_from.empty()) {
          auto it = index_of.find(c.weight_from);
          if (it == index_of.end() || it->second == static_cast<int>(i)) {
            return Status::Error(lp.where + ".weight_from",
                                 fmt::format("no other layer is named \"{}\"", c.weight_from));
          }
          lp.weight_layer = it->second;  // shape checked once every owner is known
        } else if (c.skip_weight_param_allocation) {
          return Status::Error(lp.where + ".weight_from",
                               "skip_weight_param_allocation needs the layer to borrow from");
        } else {
          lp.weight_layer = static_cast<int>(i);
          lp.weight_rows = lp.out_width;
          lp.weight_cols = c.input_size;
        }
        lp.adds_bias = c.bias && !c.skip_bias_add;
        break;
      }
      case LayerType::kGeLU: {
        lp.out_width = width;
        if (c.bias_from.empty()) break;
        auto it = index_of.find(c.bias_from);
        if (it == index_of.end() || it->second >= static_cast<int>(i)) {
          return Status::Error(lp.where + ".bias_from",
                               fmt::format("no earlier layer is named \"{}\"", c.bias_from));
        }
        const LayerConfig& owner = layers[static_cast<size_t>(it->second)];
        const LayerPlan& owner_plan = plan->layers[static_cast<size_t>(it->second)];
        if (!IsLinear(owner.type) || !owner.bias || !owner.skip_bias_add) {
          return Status::Error(lp.where + ".bias_from",
                               fmt::format("\"{}\" is not a linear layer with bias and "
                                           "skip_bias_add",
                                           c.bias_from));
        }
        if (owner_plan.out_width != width) {
          return Status::Error(lp.where + ".bias_from",
                               fmt::format("the bias of \"{}\" has {} elements but the input has "
                                           "width {}",
                                           c.bias_from, owner_plan.out_width, width));
        }
        lp.bias_layer = it->second;
        break;
      }
      case LayerType::kDropout:
        lp.out_width = width;
        MPUSIM_RETURN_IF_ERROR(PlanDropout(sizes, state, width, plan, &lp));
        break;
      case LayerType::kVocabParallelCrossEntropy: {
        if (!last) return Status::Error(lp.where, "the loss must be the last layer");
        if (!sizes.padded_vocab.has_value()) {
          return Status::Error("model.vocab_size", "required with a VocabParallelCrossEntropy");
        }
        if (width != *sizes.padded_vocab) {
          return Status::Error(lp.where, fmt::format("logits have width {} but padded_vocab_size "
                                                     "is {}",
                                                     width, *sizes.padded_vocab));
        }
        const double alpha = c.label_smoothing;
        if (!(alpha >= 0.0 && alpha <= 1.0)) {
          return Status::Error(lp.where + ".label_smoothing", "must be in [0, 1]");
        }
        if (alpha > 0.0 && *sizes.padded_vocab < 2) {
          return Status::Error(lp.where + ".label_smoothing",
                               "needs at least 2 classes to spread the smoothing over");
        }
        lp.out_width = 0;
        plan->has_loss = true;
        break;
      }
      default:  // the seven region mappings: identity in the full model
        lp.out_width = width;
        break;
    }
    state = NextState(c, state, parallel.sequence_parallel);
    width = lp.out_width;
    plan->layers.push_back(std::move(lp));
  }

  // Borrowed weights: the owner must own one, of the borrower's shape [out, in].
  for (LayerPlan& lp : plan->layers) {
    if (lp.weight_layer < 0 || lp.weight_layer == &lp - plan->layers.data()) continue;
    const LayerPlan& owner = plan->layers[static_cast<size_t>(lp.weight_layer)];
    if (owner.weight_layer != lp.weight_layer) {
      return Status::Error(lp.where + ".weight_from",
                           fmt::format("\"{}\" owns no weight", owner.config->name));
    }
    if (owner.weight_rows != lp.out_width || owner.weight_cols != lp.in_width) {
      return Status::Error(lp.where + ".weight_from",
                           fmt::format("the weight of \"{}\" is [{}, {}], this layer needs "
                                       "[{}, {}]",
                                       owner.config->name, owner.weight_rows, owner.weight_cols,
                                       lp.out_width, lp.in_width));
    }
  }
  return Status();
}

StatusOr<Mat> FromOverride(const Tensor& tensor, const std::string& name, int64_t rows,
                           int64_t cols, const Shape& shape) {
  if (!tensor.defined() || tensor.device() != Device::kHost || tensor.dtype() != DType::kFloat64 ||
      tensor.shape() != shape) {
    return Status::Error(
        "parameter_overrides",
        fmt::format("\"{}\" must be a host float64 tensor of shape {}", name, ShapeString(shape)));
  }
  return Mat(Eigen::Map<const Mat>(tensor.data_as<double>(), rows, cols));
}

Status InitParameters(const Plan& plan, const std::map<std::string, Tensor>& overrides,
                      Parameters* params) {
  const size_t n = plan.layers.size();
  params->weight.assign(n, Mat());
  params->bias.assign(n, RowVec());
  params->weight_grad.assign(n, Mat());
  params->bias_grad.assign(n, RowVec());
  std::set<std::string> known;
  for (size_t i = 0; i < n; ++i) {
    const LayerPlan& lp = plan.layers[i];
    const LayerConfig& c = *lp.config;
    if (lp.weight_layer == static_cast<int>(i)) {
      const std::string name = c.name + ".weight";
      const Shape shape = {lp.weight_rows, lp.weight_cols};
      known.insert(name);
      if (auto it = overrides.find(name); it != overrides.end()) {
        StatusOr<Mat> w = FromOverride(it->second, name, lp.weight_rows, lp.weight_cols, shape);
        if (!w.ok()) return w.status();
        params->weight[i] = std::move(*w);
      } else {
        Mat w(lp.weight_rows, lp.weight_cols);
        for (int64_t f = 0; f < w.size(); ++f) {
          w.data()[f] = MasterValue(plan.sizes.seed, name, c.init, shape, f);
        }
        params->weight[i] = std::move(w);
      }
      if (!c.frozen) params->weight_grad[i] = Mat::Zero(lp.weight_rows, lp.weight_cols);
    }
    if (IsLinear(c.type) && c.bias) {
      const std::string name = c.name + ".bias";
      known.insert(name);
      if (auto it = overrides.find(name); it != overrides.end()) {
        StatusOr<Mat> b = FromOverride(it->second, name, 1, lp.out_width, Shape{lp.out_width});
        if (!b.ok()) return b.status();
        params->bias[i] = b->row(0);
      } else {
        params->bias[i] = RowVec::Zero(lp.out_width);  // the contract: biases start at zero
      }
      params->bias_grad[i] = RowVec::Zero(lp.out_width);
    }
  }
  for (const auto& [name, tensor] : overrides) {
    if (known.count(name) == 0) {
      return Status::Error("parameter_overrides", fmt::format("no parameter named \"{}\"", name));
    }
  }
  return Status();
}

// A synthetic [s, B, h] normal(0, 1) tensor (input.mb<m>, output_grad.mb<m>).
Mat SyntheticNormal(const Sizes& sizes, const std::string& name, int64_t width) {
  const Shape shape = {sizes.seq, sizes.batch, width};
  Mat x(sizes.seq * sizes.batch, width);
  const InitSpec spec{InitMethod::kNormal, 1.0};
  for (int64_t f = 0; f < x.size(); ++f) {
    x.data()[f] = MasterValue(sizes.seed, name, spec, shape, f);
  }
  return x;
}

std::vector<int64_t> Tokens(const Sizes& sizes, const std::string& name) {
  std::vector<int64_t> ids(static_cast<size_t>(sizes.seq * sizes.batch));
  for (size_t r = 0; r < ids.size(); ++r) {
    ids[r] = TokenAt(sizes.seed, name, static_cast<int64_t>(r), sizes.vocab);
  }
  return ids;
}

// keep / (1 - p) for every element of the dropout's [s, B, h] input: 1/(1-p) where kept, 0
// where dropped. Element (i, g, j) is drawn by the rank that holds it:
//   r_d = g / b, local sample g % b;
//   replicated      key DefaultSeed(seed, 0, r_d), local [s, b, h], position (i, g % b, j)
//   sequence split  key ModelParallelSeed(., r_t) with r_t = i / (s/t), local [s/t, b, h]
//   hidden split    key ModelParallelSeed(., r_t), local [s, b, h/t]; r_t and the local
//                   column come from inverting the producing layer's ShardSpec (stride rule)
// and kept iff UniformAt(key, n, e) >= p with e the row-major local index and
// n = m * (dropouts on the stream) + position on the stream.
Mat DropoutScale(const Plan& plan, const LayerPlan& lp, int64_t micro_batch) {
  const Sizes& sizes = plan.sizes;
  const double p = lp.config->p;
  const double scale = p < 1.0 ? 1.0 / (1.0 - p) : 0.0;
  const int64_t draws_per_micro_batch =
      lp.model_parallel_stream ? plan.dropouts_on_model_parallel : plan.dropouts_on_default;
  const uint64_t draw =
      static_cast<uint64_t>(micro_batch * draws_per_micro_batch + lp.stream_position);
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
      spec.shard_dim = 2;
      spec.num_shards = sizes.tp_size;
      spec.shard_index = tp_rank;
      spec.stride = lp.in_state.stride;
      for (int64_t l = 0; l < local_width; ++l) {
        const auto j = static_cast<size_t>(GlobalIndex(spec, 2, width, l));
        column_rank[j] = tp_rank;
        column_local[j] = l;
      }
    }
  }
  const int64_t local_seq =
      kind == StateKind::kSequenceSplit ? sizes.seq / sizes.tp_size : sizes.seq;

  Mat keep(sizes.seq * sizes.batch, width);
  for (int64_t i = 0; i < sizes.seq; ++i) {
    for (int64_t g = 0; g < sizes.batch; ++g) {
      const int64_t dp_rank = g / sizes.micro;
      const int64_t local_sample = g % sizes.micro;
      const int64_t seq_tp_rank = i / local_seq;  // 0 unless sequence split
      const int64_t local_i = i % local_seq;
      const uint64_t default_key = DefaultSeed(sizes.seed, 0, dp_rank);
      for (int64_t j = 0; j < width; ++j) {
        const auto jj = static_cast<size_t>(j);
        uint64_t key = default_key;
        if (kind == StateKind::kHiddenSplit) {
          key = ModelParallelSeed(default_key, column_rank[jj]);
        } else if (kind == StateKind::kSequenceSplit) {
          key = ModelParallelSeed(default_key, seq_tp_rank);
        }
        const int64_t e = (local_i * sizes.micro + local_sample) * local_width + column_local[jj];
        const bool kept = UniformAt(key, draw, static_cast<uint64_t>(e)) >= p;
        keep(i * sizes.batch + g, j) = kept ? scale : 0.0;
      }
    }
  }
  return keep;
}

double Gelu(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
// d gelu / dx = Phi(x) + x phi(x).
double GeluGrad(double x) {
  const double cdf = 0.5 * (1.0 + std::erf(x / std::sqrt(2.0)));
  const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * std::numbers::pi);
  return cdf + x * pdf;
}

Tensor ToTensor(const double* data, Shape shape) {
  Tensor t = Tensor::HostZeros(std::move(shape), DType::kFloat64);
  double* out = t.data_as<double>();
  for (int64_t k = 0; k < t.numel(); ++k) out[k] = data[k];
  return t;
}

Tensor ActivationTensor(const Sizes& sizes, const Mat& x) {
  return ToTensor(x.data(), {sizes.seq, sizes.batch, x.cols()});
}

Tensor TokensTensor(const Sizes& sizes, const std::vector<int64_t>& ids) {
  std::vector<double> values(ids.begin(), ids.end());
  return ToTensor(values.data(), {sizes.seq, sizes.batch});
}

// One micro-batch forward and backward. Adds into the gradient accumulators and into
// *loss_sum (the sum of the per-token losses); records activations when `record`.
void RunMicroBatch(const Plan& plan, int64_t m, Parameters* params, bool record,
                   ReferenceResult* result, double* loss_sum) {
  const Sizes& sizes = plan.sizes;
  const int64_t tokens_per_micro_batch = sizes.seq * sizes.batch;
  const size_t n = plan.layers.size();
  auto put = [&](const std::string& name, Tensor tensor) {
    if (record) result->tensors[name] = std::move(tensor);
  };

  std::vector<int64_t> tokens, labels;
  if (plan.has_embedding) {
    tokens = Tokens(sizes, fmt::format("tokens.mb{}", m));
    put("tokens", TokensTensor(sizes, tokens));
  }
  if (plan.has_loss) {
    labels = Tokens(sizes, fmt::format("labels.mb{}", m));
    put("labels", TokensTensor(sizes, labels));
  }

  // ---- forward ----------------------------------------------------------------------
  std::vector<Mat> inputs(n);        // each layer's input [s*B, h_in]
  std::vector<Mat> gelu_in(n);       // GeLU: X + bias
  std::vector<Mat> dropout_keep(n);  // Dropout: 0 or 1/(1-p)
  Mat loss_grad;                     // loss: dl/dz per token, before the 1/(M*s*B) scale
  Mat x;
  if (!plan.has_embedding)
    x = SyntheticNormal(sizes, fmt::format("input.mb{}", m), plan.input_width);
  for (size_t k = 0; k < n; ++k) {
    const LayerPlan& lp = plan.layers[k];
    const LayerConfig& c = *lp.config;
    if (!IsEmbedding(c.type)) {
      put(c.name + ".input", ActivationTensor(sizes, x));
      inputs[k] = x;
    }
    switch (c.type) {
      case LayerType::kVocabParallelEmbedding:
      case LayerType::kParallelEmbedding: {
        const Mat& w = params->weight[k];
        x.resize(tokens_per_micro_batch, w.cols());
        for (int64_t r = 0; r < tokens_per_micro_batch; ++r) {
          x.row(r) = w.row(tokens[static_cast<size_t>(r)]);
        }
        break;
      }
      case LayerType::kColumnParallelLinear:
      case LayerType::kRowParallelLinear: {
        const Mat& w = params->weight[static_cast<size_t>(lp.weight_layer)];
        Mat y = inputs[k] * w.transpose();
        if (lp.adds_bias) y.rowwise() += params->bias[k];
        x = std::move(y);
        break;
      }
      case LayerType::kGeLU: {
        Mat z = inputs[k];
        if (lp.bias_layer >= 0) z.rowwise() += params->bias[static_cast<size_t>(lp.bias_layer)];
        x = z.unaryExpr([](double v) { return Gelu(v); });
        gelu_in[k] = std::move(z);
        break;
      }
      case LayerType::kDropout:
        dropout_keep[k] = DropoutScale(plan, lp, m);
        x = inputs[k].cwiseProduct(dropout_keep[k]);
        break;
      case LayerType::kVocabParallelCrossEntropy: {
        // l = (1 - sm)(logZ - z_y) + sm (logZ - mean_j z_j), sm = alpha Vp / (Vp - 1);
        // shifting z by its row max changes neither term and keeps exp() finite.
        const Mat& z = inputs[k];
        const auto vp = static_cast<double>(z.cols());
        const double alpha = c.label_smoothing;
        const double sm = alpha > 0.0 ? alpha * vp / (vp - 1.0) : 0.0;
        Mat per_token(tokens_per_micro_batch, 1);
        loss_grad.resize(z.rows(), z.cols());
        for (int64_t r = 0; r < z.rows(); ++r) {
          const RowVec shifted = z.row(r).array() - z.row(r).maxCoeff();
          const double log_sum_exp = std::log(shifted.array().exp().sum());
          const int64_t y = labels[static_cast<size_t>(r)];
          per_token(r, 0) =
              (1.0 - sm) * (log_sum_exp - shifted(y)) + sm * (log_sum_exp - shifted.mean());
          // dl/dz_j = softmax_j - (1 - sm)[j == y] - sm / Vp
          loss_grad.row(r) = (shifted.array() - log_sum_exp).exp() - sm / vp;
          loss_grad(r, y) -= 1.0 - sm;
        }
        *loss_sum += per_token.sum();
        x = std::move(per_token);
        break;
      }
      default:  // region mappings: identity
        break;
    }
    if (c.type == LayerType::kVocabParallelCrossEntropy) {
      put(c.name + ".output", ToTensor(x.data(), {sizes.seq, sizes.batch}));
    } else {
      put(c.name + ".output", ActivationTensor(sizes, x));
    }
  }

  // ---- backward ---------------------------------------------------------------------
  Mat dy;
  if (plan.has_loss) {
    const double per_token = 1.0 / static_cast<double>(sizes.num_micro * tokens_per_micro_batch);
    dy = Mat::Constant(tokens_per_micro_batch, 1, per_token);
  } else {
    dy = SyntheticNormal(sizes, fmt::format("output_grad.mb{}", m), plan.layers.back().out_width);
  }
  for (size_t k = n; k-- > 0;) {
    const LayerPlan& lp = plan.layers[k];
    const LayerConfig& c = *lp.config;
    if (c.type == LayerType::kVocabParallelCrossEntropy) {
      put(c.name + ".output_grad", ToTensor(dy.data(), {sizes.seq, sizes.batch}));
    } else {
      put(c.name + ".output_grad", ActivationTensor(sizes, dy));
    }
    Mat dx;
    switch (c.type) {
      case LayerType::kVocabParallelEmbedding:
      case LayerType::kParallelEmbedding: {
        Mat& dw = params->weight_grad[k];
        if (dw.size() == 0) break;  // frozen
        for (int64_t r = 0; r < tokens_per_micro_batch; ++r) {
          dw.row(tokens[static_cast<size_t>(r)]) += dy.row(r);
        }
        break;
      }
      case LayerType::kColumnParallelLinear:
      case LayerType::kRowParallelLinear: {
        const auto owner = static_cast<size_t>(lp.weight_layer);
        dx = dy * params->weight[owner];
        Mat& dw = params->weight_grad[owner];
        if (dw.size() != 0) dw.noalias() += dy.transpose() * inputs[k];
        if (lp.adds_bias) params->bias_grad[k] += dy.colwise().sum();
        break;
      }
      case LayerType::kGeLU:
        dx = dy.cwiseProduct(gelu_in[k].unaryExpr([](double v) { return GeluGrad(v); }));
        if (lp.bias_layer >= 0) {
          params->bias_grad[static_cast<size_t>(lp.bias_layer)] += dx.colwise().sum();
        }
        break;
      case LayerType::kDropout:
        dx = dy.cwiseProduct(dropout_keep[k]);
        break;
      case LayerType::kVocabParallelCrossEntropy:
        dx = loss_grad.array().colwise() * dy.col(0).array();
        break;
      default:  // region mappings: identity
        dx = std::move(dy);
        break;
    }
    if (IsEmbedding(c.type)) break;  // the first layer; nothing flows into tokens
    put(c.name + ".input_grad", ActivationTensor(sizes, dx));
    dy = std::move(dx);
  }
}

}  // namespace

StatusOr<ReferenceResult> RunReferenceWithOverrides(
    const ParallelConfig& parallel, const ModelConfig& model, const RunConfig& run,
    const std::map<std::string, Tensor>& parameter_overrides) {
  Plan plan;
  MPUSIM_RETURN_IF_ERROR(BuildPlan(parallel, model, run, &plan));
  Parameters params;
  MPUSIM_RETURN_IF_ERROR(InitParameters(plan, parameter_overrides, &params));

  ReferenceResult result;
  double loss_sum = 0.0;
  for (int64_t m = 0; m < plan.sizes.num_micro; ++m) {
    RunMicroBatch(plan, m, &params, m + 1 == plan.sizes.num_micro, &result, &loss_sum);
  }

  for (size_t k = 0; k < plan.layers.size(); ++k) {
    const std::string& name = plan.layers[k].config->name;
    if (const Mat& w = params.weight[k]; w.size() != 0) {
      result.tensors[name + ".weight"] = ToTensor(w.data(), {w.rows(), w.cols()});
    }
    if (const Mat& dw = params.weight_grad[k]; dw.size() != 0) {
      result.tensors[name + ".weight_grad"] = ToTensor(dw.data(), {dw.rows(), dw.cols()});
    }
    if (const RowVec& b = params.bias[k]; b.size() != 0) {
      result.tensors[name + ".bias"] = ToTensor(b.data(), {b.size()});
      const RowVec& db = params.bias_grad[k];
      result.tensors[name + ".bias_grad"] = ToTensor(db.data(), {db.size()});
    }
  }
  if (plan.has_loss) {
    result.has_loss = true;
    result.loss =
        loss_sum / static_cast<double>(plan.sizes.num_micro * plan.sizes.seq * plan.sizes.batch);
    result.tensors["loss"] = ToTensor(&result.loss, {1});
  }
  return result;
}

StatusOr<ReferenceResult> RunReference(const ParallelConfig& parallel, const ModelConfig& model,
                                       const RunConfig& run) {
  return RunReferenceWithOverrides(parallel, model, run, {});
}

}  // namespace mpusim
