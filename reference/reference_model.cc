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
#include "reference/ops.h"
#include "reference/tracker_draws.h"

namespace mpusim {
namespace {

using Mat = ref::Mat;
using MatMap = Eigen::Map<Mat>;
using ConstMatMap = Eigen::Map<const Mat>;
using RowVecMap = Eigen::Map<ref::RowVec>;

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
  int64_t pp_size = 1;                  // p: pipeline stages (only dropout masks see them)
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
  // Who draws its mask: the pipeline rank and model chunk holding it, and its position among
  // that chunk's dropout layers on the same stream.
  int64_t pp_rank = 0;
  int64_t chunk = 0;
  int64_t stream_position = 0;
};

struct Plan {
  Sizes sizes;
  std::vector<LayerPlan> layers;
  int64_t input_width = 0;  // synthetic input width; 0 when the chain starts with an embedding
  // Where each pipeline rank's forwards start drawing (reference/tracker_draws.h;
  // docs/simulator.md, "Pipeline stages of a chain").
  DrawPositions draws;
  bool has_embedding = false;
  bool has_loss = false;
};

// Whole tensors, by layer index; undefined where the layer has none.
struct Parameters {
  std::vector<Tensor> weight;       // owners: [rows, cols]
  std::vector<Tensor> bias;         // linear layers with a bias: [out]
  std::vector<Tensor> weight_grad;  // owners that are not frozen
  std::vector<Tensor> bias_grad;
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
  const int64_t pp_size = parallel.pipeline_model_parallel_size;
  if (pp_size < 1 || parallel.world_size % (tp_size * pp_size) != 0) {
    return Status::Error("parallel.pipeline_model_parallel_size",
                         fmt::format("must be >= 1 and divide world_size / "
                                     "tensor_model_parallel_size, got {}",
                                     pp_size));
  }
  if (parallel.context_parallel_size != 1) {
    return Status::Error("parallel.context_parallel_size", "mpusim run requires 1");
  }
  if (run.seq_length < 1) return Status::Error("run.seq_length", "must be >= 1");
  if (run.micro_batch_size < 1) return Status::Error("run.micro_batch_size", "must be >= 1");
  if (run.num_microbatches < 1) return Status::Error("run.num_microbatches", "must be >= 1");
  sizes->seed = run.seed;
  sizes->tp_size = tp_size;
  sizes->pp_size = pp_size;
  sizes->dp_size = parallel.world_size / (tp_size * pp_size);
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

// Checks the dropout's input state and picks its random stream (PlaceDropouts numbers its draws).
Status PlanDropout(const Sizes& sizes, ActState state, int64_t width, LayerPlan* lp) {
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
  return Status();
}

// Who draws each dropout mask, and when (docs/simulator.md, "Pipeline stages of a chain"): the
// n layers fill the S = p * v virtual stages in consecutive runs, stage u taking layers
// [u n / S, (u + 1) n / S); stage u is chunk u / p of pipeline rank u % p. Each rank draws
// from its own tracker, advanced by its forwards in the schedule's forward-table order
// (micro-batches in order without virtual stages), every iteration continuing the streams.
Status PlaceDropouts(const ParallelConfig& parallel, const RunConfig& run, Plan* plan) {
  const int64_t p = plan->sizes.pp_size;
  const int64_t v = parallel.virtual_pipeline_model_parallel_size.value_or(1);
  const auto n = static_cast<int64_t>(plan->layers.size());
  const int64_t stages = p * v;
  if (v < 1 || n < stages) {
    return Status::Error("model.layers",
                         fmt::format("{} layers cannot fill {} pipeline stages", n, stages));
  }
  std::vector<std::array<int64_t, 2>> per_chunk(static_cast<size_t>(stages), {0, 0});
  for (int64_t u = 0, i = 0; u < stages; ++u) {
    for (; i < (u + 1) * n / stages; ++i) {
      LayerPlan& lp = plan->layers[static_cast<size_t>(i)];
      if (lp.config->type != LayerType::kDropout) continue;
      lp.pp_rank = u % p;
      lp.chunk = u / p;
      lp.stream_position = per_chunk[static_cast<size_t>(u)][lp.model_parallel_stream ? 1 : 0]++;
    }
  }
  // Per pp rank and chunk, one forward's draws on each stream (virtual stage u = c p + r).
  std::vector<std::vector<std::array<int64_t, 2>>> draws(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) {
    for (int64_t c = 0; c < v; ++c) {
      draws[static_cast<size_t>(r)].push_back(per_chunk[static_cast<size_t>(c * p + r)]);
    }
  }
  StatusOr<DrawPositions> numbered = NumberTrackerDraws(parallel, run.num_microbatches, draws);
  if (!numbered.ok()) return numbered.status();
  plan->draws = *std::move(numbered);
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
        MPUSIM_RETURN_IF_ERROR(PlanDropout(sizes, state, width, &lp));
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
  return PlaceDropouts(parallel, run, plan);
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
      const Shape shape = {lp.weight_rows, lp.weight_cols};
      known.insert(name);
      if (auto it = overrides.find(name); it != overrides.end()) {
        StatusOr<Tensor> w = FromOverride(it->second, name, shape);
        if (!w.ok()) return w.status();
        params->weight[i] = std::move(*w);
      } else {
        params->weight[i] = NewOutput(shape);
        FillFlatRange(plan.sizes.seed, name, c.init, shape, 0, params->weight[i]);
      }
      if (!c.frozen) params->weight_grad[i] = NewTensor(shape);
    }
    if (IsLinear(c.type) && c.bias) {
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
      case LayerType::kParallelEmbedding: {
        const Tensor& w = params->weight[k];
        x = NewAct(rows, w.cols(), kStored + kStored);
        ref::EmbeddingForward(ConstMat(w), st->tokens, AsMat(x.value));
        break;
      }
      case LayerType::kColumnParallelLinear:
      case LayerType::kRowParallelLinear: {
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
      case LayerType::kDropout:
        st->keep[k] = DropoutScale(plan, lp, m, row_begin, rows);
        x = NewAct(rows, lp.out_width, in.budget + kStored);
        AsMat(x.value) = ConstMat(in.value).cwiseProduct(ConstMat(st->keep[k]));
        break;
      case LayerType::kVocabParallelCrossEntropy: {
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
           c.type == LayerType::kVocabParallelCrossEntropy ? TokenShape()
                                                           : ActivationShape(lp.out_width),
           x);
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
           c.type == LayerType::kVocabParallelCrossEntropy ? TokenShape()
                                                           : ActivationShape(lp.out_width),
           dy);
    Act dx;
    switch (c.type) {
      case LayerType::kVocabParallelEmbedding:
      case LayerType::kParallelEmbedding: {
        Tensor& dw = params->weight_grad[k];
        weight_grad_budget[k] = dy.budget;
        if (!dw.defined()) break;  // frozen
        ref::EmbeddingBackward(ConstMat(dy.value), st.tokens, AsMat(dw));
        break;
      }
      case LayerType::kColumnParallelLinear:
      case LayerType::kRowParallelLinear: {
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
      case LayerType::kDropout:
        dx = NewAct(rows, lp.in_width, dy.budget + kStored);
        AsMat(dx.value) = AsMat(dy.value).cwiseProduct(ConstMat(st.keep[k]));
        break;
      case LayerType::kVocabParallelCrossEntropy:
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
                   ErrorBudget budget) {
    if (!value.defined()) return;
    out.push_back({name, value.shape(), ReferenceTensor::Layout::kWhole, partial, value, budget});
  };
  take("tokens");
  take("labels");
  for (size_t k = 0; k < plan.layers.size(); ++k) {
    const std::string& name = plan.layers[k].config->name;
    take(name + ".input");
    take(name + ".input_grad");
    take(name + ".output");
    take(name + ".output_grad");
    whole(name + ".weight", run.params->weight[k], false, kStored);
    whole(name + ".weight_grad", run.params->weight_grad[k], true,
          GradientSum(run.weight_grad_budget[k], sizes));
    whole(name + ".bias", run.params->bias[k], false, kStored);
    whole(name + ".bias_grad", run.params->bias_grad[k], true,
          GradientSum(run.bias_grad_budget[k], sizes));
  }
  if (plan.has_loss) {
    Tensor loss = NewTensor({1});
    loss.data_as<double>()[0] =
        run.loss_sum / static_cast<double>(sizes.num_micro * sizes.seq * sizes.batch);
    whole("loss", loss, true, run.loss_budget + kFunction);
  }
  return out;
}

#if defined(MPUSIM_HAVE_OPENBLAS)
extern "C" void openblas_set_num_threads(int num_threads);
#endif

}  // namespace

const ReferenceTensor* ReferenceResult::Find(std::string_view name) const {
  for (const ReferenceTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

StatusOr<std::vector<ReferenceParameter>> ReferenceParameters(const ParallelConfig& parallel,
                                                              const ModelConfig& model,
                                                              const RunConfig& run) {
  Plan plan;
  MPUSIM_RETURN_IF_ERROR(BuildPlan(parallel, model, run, &plan));
  std::vector<ReferenceParameter> out;
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerPlan& lp = plan.layers[i];
    if (lp.weight_layer != static_cast<int>(i)) continue;
    out.push_back({lp.config->name + ".weight", {lp.weight_rows, lp.weight_cols}, lp.config->init});
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
  const int64_t row_end = slice.row_end < 0 ? rows : slice.row_end;
  if (slice.row_begin < 0 || slice.row_begin > row_end || row_end > rows) {
    return Status::Error("reference slice", fmt::format("rows [{}, {}) are not inside [0, {})",
                                                        slice.row_begin, row_end, rows));
  }
  Parameters params;
  MPUSIM_RETURN_IF_ERROR(InitParameters(plan, parameter_overrides, &params));

  SliceRun slice_run(plan, slice.row_begin, row_end, &params);
  if (iteration < 0) {
    return Status::Error("reference iteration", fmt::format("is {}, not >= 0", iteration));
  }
  const int64_t M = plan.sizes.num_micro;
  for (int64_t m = 0; m < M; ++m) slice_run.MicroBatch(iteration * M + m, m + 1 == M);

  ReferenceResult result;
  result.rows = rows;
  result.row_begin = slice.row_begin;
  result.row_end = row_end;
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
