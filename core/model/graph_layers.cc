// The layer chain's kinds of layer (graph_impl.h LayerKind): for each, the activation states
// and widths it accepts and produces and the parameters it adds (Plan), and its forward and
// backward, built from the modules the GPT model uses too: the linear layers
// (core/model/linear.h), the embeddings (core/model/embedding.h), the region mappings and the
// vocab-parallel cross entropy (core/tensor_parallel), and the activation and dropout ops.
//
// Shape legend (local, on one rank; t = tp size): activations [s, b, w] (s/t rows under
// sequence parallelism, w/t columns when hidden-split); the modules see them as [s*b, w]
// and the chain gives every output and input gradient its [s, b, w] shape back (graph.cc).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/model/embedding.h"
#include "core/model/graph.h"
#include "core/model/graph_impl.h"
#include "core/model/linear.h"
#include "core/rng.h"
#include "core/tensor_parallel/cross_entropy.h"
#include "core/tensor_parallel/mappings.h"

namespace mpusim {
namespace chain {

// ---------------------------------------------------------------------------------------
// The planner's checks

Status LayerPlanner::RequireState(std::initializer_list<Split> allowed) const {
  for (Split a : allowed) {
    if (state.split == a) return {};
  }
  std::vector<std::string> names;
  for (Split a : allowed) names.emplace_back(SplitName(a));
  return Fail(fmt::format("receives a {} activation but accepts only: {}", SplitName(state.split),
                          fmt::join(names, ", ")));
}

Status LayerPlanner::RequireDivisible(int64_t value, int64_t by, const std::string& what) const {
  if (value % by != 0) return Fail(fmt::format("{} ({}) must be divisible by {}", what, value, by));
  return {};
}

Status LayerPlanner::RequireWidth(int64_t expected, const char* field) const {
  if (width != expected) {
    return Fail(fmt::format("{} is {} but the incoming activation has width {}", field, expected,
                            width));
  }
  return {};
}

Status LayerPlanner::RequireSequenceDivisible() const {
  return RequireDivisible(g.run.seq_length, g.t, "run.seq_length under sequence parallelism");
}

namespace {

// ---------------------------------------------------------------------------------------
// Embeddings: VocabParallelEmbedding splits the rows (the vocabulary) over tp and, under
// sequence parallelism, reduce-scatters its output by sequence; ParallelEmbedding splits the
// columns and produces a replicated activation.

class EmbeddingLayer : public LayerKind {
 public:
  explicit EmbeddingLayer(bool vocab_parallel) : vocab_parallel_(vocab_parallel) {}
  bool takes_tokens() const override { return true; }

  Status Plan(LayerPlanner& p) const override {
    Graph::Impl& g = p.g;
    const LayerConfig& c = p.slot.config;
    const int64_t rows = c.num_embeddings.Resolve(g.padded_vocab);
    if (rows < *g.model.vocab_size) {
      return p.Fail(fmt::format("num_embeddings ({}) is smaller than model.vocab_size ({})", rows,
                                *g.model.vocab_size));
    }
    MPUSIM_RETURN_IF_ERROR(vocab_parallel_
                               ? p.RequireDivisible(rows, g.t, "num_embeddings")
                               : p.RequireDivisible(c.embedding_dim, g.t, "embedding_dim"));
    const TpSplitPlan split = vocab_parallel_ ? TpSplitPlan{0, 1} : TpSplitPlan{1, 1};
    p.slot.weight = g.AddParameter(c.name + ".weight", {rows, c.embedding_dim}, split, c, false);
    p.slot.owns_weight = true;
    p.state.split = Split::kReplicated;
    if (vocab_parallel_ && g.sequence_parallel) {
      MPUSIM_RETURN_IF_ERROR(p.RequireSequenceDivisible());
      p.state.split = Split::kSequence;
    }
    p.width = c.embedding_dim;
    g.needs_tokens = true;
    return {};
  }

  Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& /*x*/) const override {
    if (vocab_parallel_) {
      return VocabParallelEmbedding(slot.weight, call.module.shape.sequence_parallel)
          .Forward(call.module, call.batch.tokens);
    }
    return ParallelEmbedding(slot.weight).Forward(call.module, call.batch.tokens);
  }

  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    if (vocab_parallel_) {
      VocabParallelEmbedding(slot.weight, call.module.shape.sequence_parallel)
          .Backward(call.module, call.batch.tokens, dy);
    } else {
      ParallelEmbedding(slot.weight).Backward(call.module, call.batch.tokens, dy);
    }
    return Tensor();
  }

 private:
  bool vocab_parallel_;
};

// ---------------------------------------------------------------------------------------
// Linear layers

// A linear layer kind runs its module (Kind::Module(slot), over the slot's parameters) and
// keeps the module's saved input in the slot.
template <typename Kind, typename LinearModule>
class LinearLayer : public LayerKind {
 public:
  int64_t FixedInputWidth(const LayerConfig& c, int64_t /*padded_vocab*/) const override {
    return c.input_size;
  }

  Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& x) const override {
    typename LinearModule::Stash stash;
    Tensor y = Kind::Module(slot).Forward(call.module, x, &stash);
    slot.saved = stash.input;
    return y;
  }

  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    return Kind::Module(slot).Backward(call.module, dy, {slot.saved});
  }
};

class ColumnParallelLinearLayer
    : public LinearLayer<ColumnParallelLinearLayer, ColumnParallelLinear> {
 public:
  Split SyntheticInputSplit(const LayerConfig& /*c*/, bool sequence_parallel) const override {
    return sequence_parallel ? Split::kSequence : Split::kReplicated;
  }

  Status Plan(LayerPlanner& p) const override {
    Graph::Impl& g = p.g;
    LayerSlot& slot = p.slot;
    const LayerConfig& c = slot.config;
    if (g.sequence_parallel) {
      MPUSIM_RETURN_IF_ERROR(p.RequireState({Split::kSequence}));
      MPUSIM_RETURN_IF_ERROR(p.RequireSequenceDivisible());
      if (c.gather_output) {
        return p.Fail(
            "gather_output cannot be used with sequence_parallel (Megatron "
            "refuses it too); set gather_output to false");
      }
    } else {
      MPUSIM_RETURN_IF_ERROR(p.RequireState({Split::kReplicated}));
    }
    MPUSIM_RETURN_IF_ERROR(p.RequireWidth(c.input_size, "input_size"));
    const int64_t out = c.output_size.Resolve(g.padded_vocab);
    MPUSIM_RETURN_IF_ERROR(p.RequireDivisible(out, g.t * c.stride,
                                              "output_size / (tensor_model_parallel_size * "
                                              "stride): output_size"));
    if (c.gather_output && c.stride > 1) {
      return p.Fail(
          "gather_output with stride > 1 would leave the gathered columns in "
          "strided order; use gather_output false");
    }
    const TpSplitPlan split{0, c.stride};
    if (c.skip_weight_param_allocation) {
      MPUSIM_RETURN_IF_ERROR(BorrowWeight(p, {out, c.input_size}, split));
    } else {
      slot.weight = g.AddParameter(c.name + ".weight", {out, c.input_size}, split, c, false);
      slot.owns_weight = true;
    }
    if (c.bias) slot.bias = g.AddParameter(c.name + ".bias", {out}, split, c, true);
    p.state = c.gather_output ? ActivationState{Split::kReplicated, 1}
                              : ActivationState{Split::kHidden, c.stride};
    p.width = out;
    return {};
  }

  // With skip_bias_add the bias is left to a later GeLU's bias_from.
  static ColumnParallelLinear Module(const LayerSlot& slot) {
    const LayerConfig& c = slot.config;
    return ColumnParallelLinear(slot.weight, c.skip_bias_add ? nullptr : slot.bias,
                                c.gather_output);
  }


 private:
  // weight_from: the earlier layer's weight, which must have this layer's shape and split.
  static Status BorrowWeight(LayerPlanner& p, const Shape& want, const TpSplitPlan& split) {
    const LayerConfig& c = p.slot.config;
    LayerSlot* owner = p.g.FindLayer(c.weight_from);
    if (owner == nullptr || owner->weight == nullptr) {
      return p.Fail(
          fmt::format("weight_from '{}' is not an earlier layer with a weight", c.weight_from));
    }
    if (owner->weight->full_shape != want || owner->weight->split != split) {
      return p.Fail(fmt::format("weight_from '{}' has shape {} split on dim {}, but "
                                "this layer needs {} split on dim 0 with stride {}",
                                c.weight_from, ShapeString(owner->weight->full_shape),
                                owner->weight->split.dim, ShapeString(want), c.stride));
    }
    p.slot.weight = owner->weight;
    return {};
  }
};

class RowParallelLinearLayer : public LinearLayer<RowParallelLinearLayer, RowParallelLinear> {
 public:
  Split SyntheticInputSplit(const LayerConfig& c, bool /*sequence_parallel*/) const override {
    return c.input_is_parallel ? Split::kHidden : Split::kReplicated;
  }

  Status Plan(LayerPlanner& p) const override {
    Graph::Impl& g = p.g;
    LayerSlot& slot = p.slot;
    const LayerConfig& c = slot.config;
    if (c.input_is_parallel) {
      MPUSIM_RETURN_IF_ERROR(p.RequireState({Split::kHidden}));
      if (p.state.stride != c.stride) {
        return p.Fail(fmt::format("its input is split with stride {} but the layer's "
                                  "stride is {}; they must match",
                                  p.state.stride, c.stride));
      }
    } else {
      MPUSIM_RETURN_IF_ERROR(p.RequireState({Split::kReplicated}));
      if (c.stride != 1) {
        return p.Fail(
            "stride > 1 needs input_is_parallel (the scatter splits "
            "contiguously)");
      }
    }
    MPUSIM_RETURN_IF_ERROR(p.RequireWidth(c.input_size, "input_size"));
    MPUSIM_RETURN_IF_ERROR(p.RequireDivisible(c.input_size, g.t * c.stride,
                                              "input_size / (tensor_model_parallel_size * "
                                              "stride): input_size"));
    const int64_t out = c.output_size.Resolve(g.padded_vocab);
    slot.weight = g.AddParameter(c.name + ".weight", {out, c.input_size}, {1, c.stride}, c, false);
    slot.owns_weight = true;
    if (c.bias) {
      slot.bias = g.AddParameter(c.name + ".bias", {out}, TpSplitPlan{}, c, true);
      slot.bias->allreduce_grad_over_tp = g.sequence_parallel;
    }
    if (g.sequence_parallel) {
      MPUSIM_RETURN_IF_ERROR(p.RequireSequenceDivisible());
      p.state = ActivationState{Split::kSequence, 1};
    } else {
      p.state = ActivationState{Split::kReplicated, 1};
    }
    p.width = out;
    return {};
  }

  static RowParallelLinear Module(const LayerSlot& slot) {
    const LayerConfig& c = slot.config;
    return RowParallelLinear(slot.weight, c.skip_bias_add ? nullptr : slot.bias,
                             c.input_is_parallel);
  }
};

// ---------------------------------------------------------------------------------------
// Pointwise layers

// GeLU (exact), with bias_from adding a linear layer's skipped bias first (Megatron's
// bias_gelu fusion).
class GeLULayer : public LayerKind {
 public:
  Status Plan(LayerPlanner& p) const override {
    Graph::Impl& g = p.g;
    LayerSlot& slot = p.slot;
    const LayerConfig& c = slot.config;
    MPUSIM_RETURN_IF_ERROR(p.RequireState({Split::kReplicated, Split::kHidden, Split::kSequence}));
    if (c.bias_from.empty()) return {};
    LayerSlot* owner = g.FindLayer(c.bias_from);
    if (owner == nullptr || owner->bias == nullptr || !owner->config.skip_bias_add) {
      return p.Fail(fmt::format("bias_from '{}' must name an earlier linear layer with "
                                "bias and skip_bias_add",
                                c.bias_from));
    }
    if (owner->bias->full_shape[0] != p.width) {
      return p.Fail(fmt::format("bias_from '{}' has {} elements but the activation has "
                                "width {}",
                                c.bias_from, owner->bias->full_shape[0], p.width));
    }
    const bool bias_split = owner->bias->split.dim == 0;
    if (bias_split != (p.state.split == Split::kHidden)) {
      return p.Fail(fmt::format("bias_from '{}' is {} but the activation is {}", c.bias_from,
                                bias_split ? "split" : "replicated", SplitName(p.state.split)));
    }
    slot.added_bias = owner->bias;
    return {};
  }

  Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& x) const override {
    Kernels& k = call.module.k;
    Tensor pre = x;
    if (slot.added_bias != nullptr) {
      pre = k.Empty(x.shape(), x.dtype());
      k.Copy(x, pre);
      k.AddRowVector(slot.added_bias->value, pre);
    }
    slot.saved = pre;
    Tensor y = k.Empty(x.shape(), x.dtype());
    k.ActivationForward(Activation::kGelu, pre, y);
    return y;
  }

  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    Kernels& k = call.module.k;
    Tensor dx = k.Empty(dy.shape(), dy.dtype());
    k.ActivationBackward(Activation::kGelu, slot.saved, dy, dx);
    if (slot.added_bias != nullptr) {
      AccumulateGrad(k, *slot.added_bias, false,
                     [&](Tensor& g, double beta) { k.SumRows(dx, beta, g); });
    }
    return dx;
  }
};

// Inverted dropout on the RNG tracker's stream: "model-parallel-rng" for a split activation
// (each rank its own mask), "default" for a replicated one (the same mask on every rank).
class DropoutLayer : public LayerKind {
 public:
  Status Plan(LayerPlanner& p) const override {
    MPUSIM_RETURN_IF_ERROR(p.RequireState({Split::kReplicated, Split::kHidden, Split::kSequence}));
    if (p.g.model.IsTorchChain() && p.state.split != Split::kReplicated && p.slot.config.p > 0) {
      return p.Fail(
          fmt::format("receives a {} activation; in a chain of torch.nn modules mpusim "
                      "draws dropout masks on whole (Replicate()) activations only; "
                      "move the Dropout where the activation is whole",
                      SplitName(p.state.split)));
    }
    p.slot.rng_stream =
        p.state.split == Split::kReplicated ? kDefaultStream : kModelParallelStream;
    return {};
  }

  Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& x) const override {
    slot.draw = call.ctx.rng.Draw(slot.rng_stream);
    return Apply(call, slot, x);
  }

  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    return Apply(call, slot, dy);
  }

 private:
  static Tensor Apply(const LayerCall& call, const LayerSlot& slot, const Tensor& x) {
    Tensor y = call.module.k.Empty(x.shape(), x.dtype());
    call.module.k.Dropout(x, slot.config.p, slot.draw.key, slot.draw.subsequence, 0, y);
    return y;
  }
};

// The loss: per-token cross entropy of the vocab-split logits; its output is [s, b].
class CrossEntropyLayer : public LayerKind {
 public:
  bool is_loss() const override { return true; }
  Split SyntheticInputSplit(const LayerConfig& /*c*/, bool /*sequence_parallel*/) const override {
    return Split::kHidden;
  }
  int64_t FixedInputWidth(const LayerConfig& /*c*/, int64_t padded_vocab) const override {
    return padded_vocab;
  }

  Status Plan(LayerPlanner& p) const override {
    MPUSIM_RETURN_IF_ERROR(p.RequireState({Split::kHidden}));
    if (p.state.stride != 1) return p.Fail("the logits must be split with stride 1");
    MPUSIM_RETURN_IF_ERROR(p.RequireWidth(p.g.padded_vocab, "padded_vocab_size"));
    if (p.slot.config.label_smoothing > 0 && p.g.padded_vocab < 2) {
      return p.Fail("label smoothing needs at least 2 vocabulary entries");
    }
    p.g.needs_labels = true;
    p.state = ActivationState{Split::kReplicated, 1};
    p.width = 0;
    return {};
  }

  Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& x) const override {
    CrossEntropyStash stash;
    const Tensor losses =
        VocabParallelCrossEntropyForward(call.module.k, call.module.tp, x, call.batch.labels,
                                         call.padded_vocab, slot.config.label_smoothing, &stash);
    slot.row_max = stash.row_max;
    slot.sum_exp = stash.sum_exp;
    return losses.Reshaped(call.batch.labels.shape());
  }

  // dy holds d loss / d per-token loss.
  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    return VocabParallelCrossEntropyBackward(
        call.module.k, {slot.input, slot.row_max, slot.sum_exp}, call.batch.labels,
        call.padded_vocab, slot.config.label_smoothing, call.module.shape.tp_rank, dy);
  }
};

// ---------------------------------------------------------------------------------------
// Region mappings (Megatron's tensor_parallel/mappings.py), as rules: the state each accepts
// and produces, and what must divide for its split.

struct MappingRule {
  Mapping mapping;
  Split accepts;
  Split produces;  // kReplicated for copy_to: the state passes through unchanged
  enum class Divides : uint8_t { kNothing, kWidth, kSequence } divides = Divides::kNothing;
  bool unstrided_only = false;          // a gather cannot undo a strided split
  bool keeps_state = false;             // copy_to
  const char* redundant_sum = nullptr;  // PlanWarnings: its backward's sum of full gradients
  bool only_with_output_grad = false;   // ... only with tensor_parallel_output_grad
};

class RegionMappingLayer : public LayerKind {
 public:
  explicit RegionMappingLayer(MappingRule rule) : rule_(rule) {}

  Split SyntheticInputSplit(const LayerConfig& /*c*/, bool /*sequence_parallel*/) const override {
    return rule_.accepts;
  }

  const char* RedundantGradientSum(const LayerConfig& c) const override {
    if (rule_.only_with_output_grad && !c.tensor_parallel_output_grad) return nullptr;
    return rule_.redundant_sum;
  }

  Status Plan(LayerPlanner& p) const override {
    MPUSIM_RETURN_IF_ERROR(p.RequireState({rule_.accepts}));
    if (rule_.divides == MappingRule::Divides::kWidth) {
      MPUSIM_RETURN_IF_ERROR(p.RequireDivisible(p.width, p.g.t, "the activation width"));
    } else if (rule_.divides == MappingRule::Divides::kSequence) {
      MPUSIM_RETURN_IF_ERROR(p.RequireDivisible(p.g.run.seq_length, p.g.t, "run.seq_length"));
    }
    if (rule_.unstrided_only && p.state.stride != 1) {
      return p.Fail("cannot gather a strided split");
    }
    if (!rule_.keeps_state) p.state = ActivationState{rule_.produces, 1};
    return {};
  }

  Tensor Forward(const LayerCall& call, LayerSlot& /*slot*/, const Tensor& x) const override {
    return MappingForward(call.module.k, call.module.tp, rule_.mapping, x);
  }

  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    return MappingBackward(call.module.k, call.module.tp, rule_.mapping, dy,
                           slot.config.tensor_parallel_output_grad);
  }

 private:
  MappingRule rule_;
};

}  // namespace

const LayerKind& KindOf(LayerType type) {
  if (IsTorchModule(type)) return TorchKindOf(type);
  using D = MappingRule::Divides;
  static const EmbeddingLayer vocab_parallel_embedding(true), parallel_embedding(false);
  static const ColumnParallelLinearLayer column_parallel_linear;
  static const RowParallelLinearLayer row_parallel_linear;
  static const GeLULayer gelu;
  static const DropoutLayer dropout;
  static const CrossEntropyLayer cross_entropy;
  static const RegionMappingLayer copy_to({Mapping::kCopyToTp, Split::kReplicated,
                                           Split::kReplicated, D::kNothing, false, true,
                                           "its backward all-reduce"});
  static const RegionMappingLayer reduce_from(
      {Mapping::kReduceFromTp, Split::kPartialSum, Split::kReplicated});
  static const RegionMappingLayer scatter_to(
      {Mapping::kScatterToTp, Split::kReplicated, Split::kHidden, D::kWidth});
  static const RegionMappingLayer gather_from(
      {Mapping::kGatherFromTp, Split::kHidden, Split::kReplicated, D::kNothing, true});
  static const RegionMappingLayer scatter_to_sp(
      {Mapping::kScatterToSp, Split::kReplicated, Split::kSequence, D::kSequence});
  static const RegionMappingLayer gather_from_sp(
      {Mapping::kGatherFromSp, Split::kSequence, Split::kReplicated, D::kNothing, false, false,
       "its backward reduce-scatter (tensor_parallel_output_grad true)", true});
  static const RegionMappingLayer reduce_scatter_to_sp(
      {Mapping::kReduceScatterToSp, Split::kPartialSum, Split::kSequence, D::kSequence});
  // In LayerType's order (core/config/model_config.h).
  static const std::array<const LayerKind*, 14> kKinds = {
      &vocab_parallel_embedding, &parallel_embedding, &column_parallel_linear,
      &row_parallel_linear,      &gelu,               &dropout,
      &cross_entropy,            &copy_to,            &reduce_from,
      &scatter_to,               &gather_from,        &scatter_to_sp,
      &gather_from_sp,           &reduce_scatter_to_sp};
  static_assert(static_cast<size_t>(LayerType::kReduceScatterToSequenceParallelRegion) + 1 ==
                    kKinds.size(),
                "a LayerType without its kind");
  return *kKinds.at(static_cast<size_t>(type));
}

}  // namespace chain
}  // namespace mpusim
