// The layer chain's plan for the float64 reference (see chain_plan.h).
#include "reference/chain_plan.h"

#include <fmt/format.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/schedule.h"

namespace mpusim::chain_reference {

// torch.nn's Embedding, Linear and CrossEntropyLoss compute what Megatron's do in the full
// model; a parallelize_plan decides only where their pieces live.
bool IsEmbedding(LayerType type) {
  return type == LayerType::kVocabParallelEmbedding || type == LayerType::kParallelEmbedding ||
         type == LayerType::kEmbedding;
}
bool IsLinear(LayerType type) {
  return type == LayerType::kColumnParallelLinear || type == LayerType::kRowParallelLinear ||
         type == LayerType::kLinear;
}
bool IsLoss(LayerType type) {
  return type == LayerType::kVocabParallelCrossEntropy || type == LayerType::kCrossEntropyLoss;
}

namespace {

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
    case LayerType::kEmbedding:
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
    case LayerType::kCrossEntropyLoss:
      return {StateKind::kLoss, 1};
    // torch.nn modules: a chain of them draws dropout masks only where the activation is
    // whole on every rank (the executor refuses a Dropout elsewhere), so replicated for the
    // masks whatever the plan shards in between.
    case LayerType::kEmbedding:
    case LayerType::kLinear:
    case LayerType::kReLU:
    case LayerType::kLayerNorm:
      return {StateKind::kReplicated, 1};
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
  const bool keeps_width = !IsLinear(first.type) && !IsEmbedding(first.type) && !IsLoss(first.type);
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

// One layer's plan (BuildPlan): the width it produces, the weight it owns or borrows, its
// bias, its dropout stream; `state` and `width` are what it receives, `index_of` the layers
// by name.
Status PlanLayer(const ModelConfig& model, size_t i, const std::map<std::string, int>& index_of,
                 ActState state, int64_t width, Plan* plan, LayerPlan* lp_out) {
  const std::vector<LayerConfig>& layers = model.layers;
  const Sizes& sizes = plan->sizes;
  const LayerConfig& c = layers[i];
  LayerPlan& lp = *lp_out;
  const bool last = i + 1 == layers.size();
  switch (c.type) {
    case LayerType::kVocabParallelEmbedding:
    case LayerType::kParallelEmbedding:
    case LayerType::kEmbedding: {
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
    case LayerType::kRowParallelLinear:
    case LayerType::kLinear: {
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
    case LayerType::kReLU:
      lp.out_width = width;
      break;
    case LayerType::kLayerNorm:  // weight [h] (1 at the start) and bias [h] (0)
      if (c.normalized_shape != width) {
        return Status::Error(lp.where + ".normalized_shape",
                             fmt::format("is {} but the incoming activation has width {}",
                                         c.normalized_shape, width));
      }
      lp.out_width = width;
      lp.weight_layer = static_cast<int>(i);
      lp.weight_rows = width;
      lp.weight_cols = 0;
      lp.adds_bias = true;
      break;
    case LayerType::kCrossEntropyLoss:  // nn.CrossEntropyLoss over the logits' width
      if (!last) return Status::Error(lp.where, "the loss must be the last layer");
      if (sizes.vocab < 1) {
        return Status::Error("model.vocab_size", "required with a CrossEntropyLoss");
      }
      if (width < sizes.vocab) {
        return Status::Error(lp.where, fmt::format("logits have width {}, fewer classes than "
                                                   "vocab_size {}",
                                                   width, sizes.vocab));
      }
      lp.out_width = 0;
      plan->has_loss = true;
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
  return {};
}

// Borrowed weights: the owner must own one, of the borrower's shape [out, in].
Status CheckBorrowedWeights(const Plan& plan) {
  for (const LayerPlan& lp : plan.layers) {
    if (lp.weight_layer < 0 || lp.weight_layer == &lp - plan.layers.data()) continue;
    const LayerPlan& owner = plan.layers[static_cast<size_t>(lp.weight_layer)];
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
  return {};
}

}  // namespace

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
    MPUSIM_RETURN_IF_ERROR(PlanLayer(model, i, index_of, state, width, plan, &lp));
    state = NextState(c, state, parallel.sequence_parallel);
    width = lp.out_width;
    plan->layers.push_back(std::move(lp));
  }

  MPUSIM_RETURN_IF_ERROR(CheckBorrowedWeights(*plan));
  return PlaceDropouts(parallel, run, plan);
}

}  // namespace mpusim::chain_reference
