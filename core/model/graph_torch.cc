// The layer chain's torch.nn modules (Embedding, Linear, ReLU, LayerNorm, CrossEntropyLoss; GELU
// and Dropout are the chain's own kinds) and the parallelize_plan that styles them, as PyTorch's
// parallelize_module does (torch.distributed.tensor.parallel): ResolveStyles gives each
// module the style of the plan entry naming it; each module's Plan works out its placements
// on the tp mesh dimension (core/tensor_parallel/parallel_style.h) and refuses a plan whose
// layouts do not meet; Forward and Backward compute on this rank's pieces and move tensors
// between placements with DTensor's redistribution (core/tensor_parallel/dtensor.h).
//
// A module's boundary, on torch's batch-first [b, s, w] (Shard(1): the sequence, Shard(2) =
// Shard(-1): the width; mpusim keeps [s, b, w] inside, so the dims are mapped):
//   forward   x (arrives) --redistribute--> (computes) --the module--> (produces)
//             --redistribute--> (hands_on)
//   backward  the gradient of a placement is that placement, a Partial() one's Replicate()
//             (Redistribute.backward's normalisation); each redistribution runs back from the
//             gradient placement of its target to that of its source, and the module's own
//             backward gives its input gradient in its natural placement (a Colwise Linear's:
//             Partial(), summed over tp by the redistribution back to the input's placement).
// The rules a plan must meet (what torch would silently get wrong, or fail on):
//   - a styled module's input_layouts is the placement its input really has (torch's
//     from_local takes the local tensor for that placement, whatever it is);
//   - a module without a style has plain (replicated) parameters: a Linear or Embedding
//     needs its input whole (Replicate()), and a plain tensor (no DTensor: a module that
//     hands on a DTensor must be followed by a styled or pointwise one);
//   - a pointwise module (ReLU, GELU, Dropout) keeps its input's placement, but not Partial()
//     (relu of a sum is not the sum of relus); Dropout draws its mask on a replicated tensor;
//   - Shard(0) (the batch) is refused: mpusim's tp ranks hold the same samples.
#include <fmt/format.h>

#include <array>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/model/accumulate_grad.h"
#include "core/model/graph.h"
#include "core/model/graph_impl.h"
#include "core/tensor_parallel/cross_entropy.h"
#include "core/tensor_parallel/dtensor.h"
#include "core/tensor_parallel/parallel_style.h"

namespace mpusim {
namespace chain {
namespace {

using P = DTensorPlacement;

// torch's [b, s, w] placements <-> the chain's states.
P PlacementOf(Split split) {
  switch (split) {
    case Split::kHidden:
      return P::Shard(2);
    case Split::kSequence:
      return P::Shard(1);
    case Split::kPartialSum:
      return P::Partial();
    case Split::kReplicated:
      break;
  }
  return P::Replicate();
}
Split SplitOf(const P& p) {
  if (p.is_partial()) return Split::kPartialSum;
  if (p.is_shard()) return p.dim == 1 ? Split::kSequence : Split::kHidden;
  return Split::kReplicated;
}
// The same placement on mpusim's [s, b, w] storage.
P Stored(const P& p) { return p.is_shard() && p.dim == 1 ? P::Shard(0) : p; }
// The placement of a gradient of a tensor placed `p`.
P GradOf(const P& p) { return p.is_partial() ? P::Replicate() : p; }

std::string Name(const P& p) {
  return p.is_shard() && p.dim == 2 ? "Shard(-1)" : DTensorPlacementName(p);
}

// "Shard(-1): [2, 8, 16] of [2, 8, 32]" (torch's order) for messages.
std::string Described(const Graph::Impl& g, const P& p, int64_t width) {
  const Shape global = {g.run.micro_batch_size, g.run.seq_length, width};
  Shape local = global;
  if (p.is_shard()) local[static_cast<size_t>(p.dim)] /= g.t;
  if (local == global) return fmt::format("{} {}", Name(p), ShapeString(global));
  return fmt::format("{} {} of {}", Name(p), ShapeString(local), ShapeString(global));
}

std::string Previous(const LayerPlanner& p) {
  return p.slot.index == 0 ? std::string("the synthetic input") : p.g.layers.back().config.name;
}

// The module as the messages name it: "fc2 (RowwiseParallel (parallelize_plan.fc2))".
std::string Who(const LayerSlot& slot) {
  return fmt::format("{} ({})", slot.config.name,
                     slot.torch.style ? slot.torch.styled_by : std::string("no style"));
}

// The nearest earlier module with a style: where a fix changes what reaches this one.
std::string StyledSource(const LayerPlanner& p) {
  for (auto it = p.g.layers.rbegin(); it != p.g.layers.rend(); ++it) {
    if (it->torch.style) return it->config.name;
  }
  return Previous(p);
}

// Applies the slot's style (if any) and sets where its input arrives and what it computes on.
Status PlanInput(LayerPlanner& p, TorchModuleKind module, int64_t input_ndim) {
  LayerSlot& slot = p.slot;
  TorchPlacements& tp = slot.torch;
  tp.arrives = p.slot.kind->takes_tokens() ? P::Replicate() : PlacementOf(p.state.split);
  tp.computes = tp.arrives;
  const auto& entry = p.g.styles[static_cast<size_t>(slot.index)];
  if (!entry) return {};
  StatusOr<StyledModule> styled =
      ApplyParallelStyle(entry->second, module, input_ndim, 3, entry->first);
  if (!styled.ok()) return styled.status();
  tp.style = *styled;
  tp.styled_by = fmt::format("{} ({})", ParallelStyleName(entry->second.kind), entry->first);
  for (const std::optional<P>* given : {&tp.style->input_given, &tp.style->input_desired,
                                        &tp.style->output_produced, &tp.style->output_given}) {
    if (*given && (*given)->is_shard() && (*given)->dim == 0) {
      return p.Fail(
          fmt::format("{} uses Shard(0), the batch: mpusim's tp ranks hold the same "
                      "samples (the dp dimension splits the batch); shard the "
                      "sequence (Shard(1)) or the width (Shard(-1))",
                      tp.styled_by));
    }
  }
  if (tp.style->input_given) {
    if (*tp.style->input_given != tp.arrives) {
      const std::string what = p.slot.kind->takes_tokens()
                                   ? std::string("the token ids, whole on every rank (Replicate())")
                                   : Described(p.g, tp.arrives, p.width);
      return p.Fail(fmt::format(
          "{} takes its input as {} (input_layouts), but it receives {} from {}; torch would "
          "read each rank's tensor as that piece. Fix: set input_layouts to \"{}\" (the module "
          "then redistributes it to what it computes on), or make {} hand on {}",
          tp.styled_by, Name(*tp.style->input_given), what, Previous(p), Name(tp.arrives),
          Previous(p), Name(*tp.style->input_given)));
    }
    tp.computes = tp.style->input_desired.value_or(tp.arrives);
  }
  return {};
}

// What every module checks of the tensor it computes on before its own rules.
Status RequireNoDTensor(LayerPlanner& p) {
  if (p.g.planning_dtensor && !p.slot.torch.style) {
    return p.Fail(
        fmt::format("receives a DTensor from {} (its style's use_local_output is "
                    "false) but has no style: its parameters are plain tensors, which "
                    "torch does not mix with DTensors. Fix: give {} a style, or set "
                    "use_local_output true on {}",
                    Previous(p), p.slot.config.name, Previous(p)));
  }
  return {};
}

Status RequireWhole(LayerPlanner& p, const char* why) {
  const TorchPlacements& tp = p.slot.torch;
  if (tp.computes.is_replicate()) return {};
  const std::string source = StyledSource(p);
  std::string fix;
  if (tp.computes.is_shard() && tp.computes.dim == 2) {
    fix = fmt::format(
        "give {} RowwiseParallel (it takes Shard(-1)), or let {} hand on "
        "Replicate() (output_layouts \"Replicate()\": an all-gather)",
        p.slot.config.name, source);
  } else if (tp.computes.is_partial()) {
    fix = fmt::format("let {} hand on Replicate() (output_layouts \"Replicate()\": an all-reduce)",
                      source);
  } else {
    fix = fmt::format("let {} hand on Replicate() (output_layouts \"Replicate()\")", source);
  }
  return p.Fail(fmt::format("{} receives {} from {}, but {}. Fix: {}", Who(p.slot),
                            Described(p.g, tp.computes, p.width), Previous(p), why, fix));
}

Status RequireDivisible(LayerPlanner& p, const P& placement, int64_t width) {
  if (!placement.is_shard()) return {};
  if (placement.dim == 1) return p.RequireDivisible(p.g.run.seq_length, p.g.t, "run.seq_length");
  return p.RequireDivisible(width, p.g.t,
                            "the activation width (mpusim splits evenly over the tp mesh "
                            "dimension)");
}

// Sets what the module hands on from what it `produces`, and the flowing state.
Status PlanOutput(LayerPlanner& p, const P& produces, int64_t width) {
  TorchPlacements& tp = p.slot.torch;
  tp.produces = produces;
  tp.hands_on = produces;
  tp.hands_on_dtensor = false;
  if (tp.style) {
    // PrepareModuleOutput's output_layouts says what the module's output is.
    if (tp.style->output_produced && *tp.style->output_produced != produces) {
      return p.Fail(
          fmt::format("{} takes the output as {} (output_layouts), but the module "
                      "produces {}. Fix: set output_layouts to \"{}\"",
                      tp.styled_by, Name(*tp.style->output_produced),
                      Described(p.g, produces, width), Name(produces)));
    }
    if (tp.style->output_given) tp.hands_on = *tp.style->output_given;
    tp.hands_on_dtensor = !tp.style->use_local_output;
  }
  MPUSIM_RETURN_IF_ERROR(RequireDivisible(p, tp.hands_on, width));
  MPUSIM_RETURN_IF_ERROR(RequireDivisible(p, tp.produces, width));
  if (tp.produces.is_shard() && tp.hands_on.is_partial()) {
    return p.Fail(
        fmt::format("{} asks for output_layouts Partial() from a {} output; DTensor "
                    "cannot redistribute Shard to Partial",
                    tp.styled_by, Name(tp.produces)));
  }
  p.state = ActivationState{SplitOf(tp.hands_on), 1};
  p.width = width;
  p.g.planning_dtensor = tp.hands_on_dtensor;
  return {};
}

// The placement a module's own backward gives its input gradient in: a weight sharded by
// rows (Colwise Linear) gives each rank a term of it (Partial()); otherwise the gradient of
// what it computed on.
P NaturalInputGrad(const TorchPlacements& tp) {
  return tp.weight == P::Shard(0) && !tp.produces.is_partial() ? P::Partial() : GradOf(tp.computes);
}

// ---------------------------------------------------------------------------------------
// Execution helpers

// The local [s_l, b, w_l] shape of a tensor placed `p` (mpusim's order).
Shape LocalOf(const LayerCall& call, const P& p, int64_t width) {
  const StreamShape& sh = call.module.shape;
  return DTensorLocalShape({sh.s, sh.b, width}, Stored(p), sh.t, sh.tp_rank);
}

Tensor Move(const LayerCall& call, const Tensor& x, const P& from, const P& to, int64_t width) {
  if (from == to) return x;
  const StreamShape& sh = call.module.shape;
  StatusOr<Tensor> moved =
      Redistribute(call.module.k, call.module.tp, x.Reshaped(LocalOf(call, from, width)),
                   {sh.s, sh.b, width}, Stored(from), Stored(to));
  if (!moved.ok()) throw std::logic_error("redistribution: " + moved.status().Message());
  return *moved;
}

Tensor Flat(const Tensor& x) {
  const int64_t cols = x.cols();
  return x.Reshaped({cols == 0 ? 0 : x.numel() / cols, cols});
}

// ---------------------------------------------------------------------------------------
// nn.Linear: ColwiseParallel shards the weight's rows (and the bias): Replicate() in,
// Shard(-1) out; RowwiseParallel its columns: Shard(-1) in, Partial() out (the Replicate()
// bias joins the partial sums as bias / n, as DTensor adds it); no style: replicated.

class TorchLinear : public LayerKind {
 public:
  int64_t FixedInputWidth(const LayerConfig& c, int64_t /*padded_vocab*/) const override {
    return c.input_size;
  }

  Status Plan(LayerPlanner& p) const override {
    Graph::Impl& g = p.g;
    LayerSlot& slot = p.slot;
    const LayerConfig& c = slot.config;
    MPUSIM_RETURN_IF_ERROR(p.RequireWidth(c.input_size, "in_features"));
    MPUSIM_RETURN_IF_ERROR(PlanInput(p, TorchModuleKind::kLinear, 3));
    MPUSIM_RETURN_IF_ERROR(RequireNoDTensor(p));
    TorchPlacements& tp = slot.torch;
    const int64_t out = c.output_size.value;
    P produces = P::Replicate();
    TpSplitPlan weight_split{}, bias_split{};
    if (!tp.style) {
      MPUSIM_RETURN_IF_ERROR(RequireWhole(p, "its replicated weight multiplies whole rows"));
      tp.weight = P::Replicate();
    } else if (tp.style->parameters.front().second == P::Shard(0)) {  // Colwise
      MPUSIM_RETURN_IF_ERROR(RequireWhole(p, "ColwiseParallel multiplies whole input rows"));
      MPUSIM_RETURN_IF_ERROR(p.RequireDivisible(out, g.t, "out_features"));
      tp.weight = P::Shard(0);
      weight_split = bias_split = TpSplitPlan{0, 1};
      produces = P::Shard(2);
    } else {  // Rowwise
      if (tp.computes != P::Shard(2)) {
        return p.Fail(
            fmt::format("{} computes on {}; RowwiseParallel multiplies the "
                        "Shard(-1) columns of its input by its weight's columns",
                        tp.styled_by, Described(g, tp.computes, p.width)));
      }
      MPUSIM_RETURN_IF_ERROR(p.RequireDivisible(c.input_size, g.t, "in_features"));
      tp.weight = P::Shard(1);
      weight_split = TpSplitPlan{1, 1};
      produces = P::Partial();
    }
    MPUSIM_RETURN_IF_ERROR(RequireDivisible(p, tp.arrives, c.input_size));
    slot.weight = g.AddParameter(c.name + ".weight", {out, c.input_size}, weight_split, c, false);
    slot.owns_weight = true;
    if (c.bias) slot.bias = g.AddParameter(c.name + ".bias", {out}, bias_split, c, true);
    return PlanOutput(p, produces, out);
  }

  Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& x) const override {
    Kernels& k = call.module.k;
    const TorchPlacements& tp = slot.torch;
    const int64_t in = slot.config.input_size, out = slot.config.output_size.value;
    slot.saved = Move(call, x, tp.arrives, tp.computes, in);
    const Tensor& w = slot.weight->value;
    const Tensor x2 = Flat(slot.saved);
    Tensor y = k.Empty({x2.rows(), w.rows()}, w.dtype());
    k.Gemm(false, true, 1.0, x2, w, 0.0, y);
    if (slot.bias != nullptr) {
      if (tp.produces.is_partial()) {
        Tensor share = k.Empty(slot.bias->value.shape(), slot.bias->value.dtype());
        k.Copy(slot.bias->value, share);
        k.Scale(1.0 / static_cast<double>(call.module.shape.t), share);
        k.AddRowVector(share, y);
      } else {
        k.AddRowVector(slot.bias->value, y);
      }
    }
    return Move(call, y.Reshaped(LocalOf(call, tp.produces, out)), tp.produces, tp.hands_on, out);
  }

  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    Kernels& k = call.module.k;
    const TorchPlacements& tp = slot.torch;
    const int64_t in = slot.config.input_size, out = slot.config.output_size.value;
    const Tensor d = Flat(Move(call, dy, GradOf(tp.hands_on), GradOf(tp.produces), out));
    const Tensor x2 = Flat(slot.saved);
    const Tensor& w = slot.weight->value;
    Tensor dx = k.Empty({d.rows(), w.cols()}, w.dtype());
    k.Gemm(false, false, 1.0, d, w, 0.0, dx);
    if (slot.weight->grad.defined()) {
      AccumulateGrad(k, *slot.weight, call.module.fuse_wgrad,
                     [&](Tensor& g, double beta) { k.Gemm(true, false, 1.0, d, x2, beta, g); });
    }
    if (slot.bias != nullptr && slot.bias->grad.defined()) {
      AccumulateGrad(k, *slot.bias, false, [&](Tensor& g, double beta) { k.SumRows(d, beta, g); });
    }
    const P natural = NaturalInputGrad(tp);
    return Move(call, dx.Reshaped(LocalOf(call, natural, in)), natural, GradOf(tp.arrives), in);
  }
};

// nn.Embedding: ColwiseParallel shards the embedding dim (Shard(-1) out); RowwiseParallel the
// vocabulary (each rank looks up the tokens in its rows, zeros elsewhere: Partial() out,
// Megatron's VocabParallelEmbedding); no style: replicated. The token ids are whole on every
// rank (Replicate()).
class TorchEmbedding : public LayerKind {
 public:
  bool takes_tokens() const override { return true; }

  Status Plan(LayerPlanner& p) const override {
    Graph::Impl& g = p.g;
    LayerSlot& slot = p.slot;
    const LayerConfig& c = slot.config;
    const int64_t rows = c.num_embeddings.value;
    MPUSIM_RETURN_IF_ERROR(PlanInput(p, TorchModuleKind::kEmbedding, 2));
    TorchPlacements& tp = slot.torch;
    P produces = P::Replicate();
    TpSplitPlan split{};
    tp.weight = P::Replicate();
    if (tp.style && tp.style->parameters.front().second == P::Shard(1)) {  // Colwise
      MPUSIM_RETURN_IF_ERROR(p.RequireDivisible(c.embedding_dim, g.t, "embedding_dim"));
      tp.weight = P::Shard(1);
      split = TpSplitPlan{1, 1};
      produces = P::Shard(2);
    } else if (tp.style) {  // Rowwise: vocab-parallel
      MPUSIM_RETURN_IF_ERROR(p.RequireDivisible(rows, g.t, "num_embeddings"));
      tp.weight = P::Shard(0);
      split = TpSplitPlan{0, 1};
      produces = P::Partial();
    }
    slot.weight = g.AddParameter(c.name + ".weight", {rows, c.embedding_dim}, split, c, false);
    slot.owns_weight = true;
    g.needs_tokens = true;
    return PlanOutput(p, produces, c.embedding_dim);
  }

  Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& /*x*/) const override {
    Kernels& k = call.module.k;
    const TorchPlacements& tp = slot.torch;
    const Tensor& w = slot.weight->value;
    const Tensor& ids = call.batch.tokens;
    const auto [first, last] = VocabRange(call, slot);
    Tensor y = k.Empty({ids.numel(), w.cols()}, w.dtype());
    k.EmbeddingForward(w, ids, first, last, y);
    const int64_t width = slot.config.embedding_dim;
    return Move(call, y.Reshaped(LocalOf(call, tp.produces, width)), tp.produces, tp.hands_on,
                width);
  }

  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    const TorchPlacements& tp = slot.torch;
    const int64_t width = slot.config.embedding_dim;
    const Tensor d = Flat(Move(call, dy, GradOf(tp.hands_on), GradOf(tp.produces), width));
    if (slot.weight->grad.defined()) {
      const auto [first, last] = VocabRange(call, slot);
      call.module.k.EmbeddingBackward(d, call.batch.tokens, first, last, slot.weight->grad);
    }
    return Tensor();
  }

 private:
  static std::pair<int64_t, int64_t> VocabRange(const LayerCall& call, const LayerSlot& slot) {
    const int64_t rows = slot.weight->value.rows();
    const int64_t first = slot.torch.weight == P::Shard(0) ? call.module.shape.tp_rank * rows : 0;
    return {first, first + rows};
  }
};

// nn.ReLU: pointwise on whatever piece the rank holds (not a Partial() one).
class TorchReLU : public LayerKind {
 public:
  Status Plan(LayerPlanner& p) const override {
    MPUSIM_RETURN_IF_ERROR(PlanInput(p, TorchModuleKind::kOther, 3));
    if (p.slot.torch.computes.is_partial()) {
      return p.Fail(
          fmt::format("receives Partial() sums from {}: relu of a sum is not the sum "
                      "of relus. Fix: let {} hand on Replicate() (output_layouts "
                      "\"Replicate()\": an all-reduce) or Shard(1)",
                      Previous(p), StyledSource(p)));
    }
    const bool dtensor = p.g.planning_dtensor;
    MPUSIM_RETURN_IF_ERROR(PlanOutput(p, p.slot.torch.computes, p.width));
    if (!p.slot.torch.style) p.g.planning_dtensor = dtensor;  // a DTensor stays one
    return {};
  }

  Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& x) const override {
    Kernels& k = call.module.k;
    const TorchPlacements& tp = slot.torch;
    slot.saved = Move(call, x, tp.arrives, tp.computes, slot.in_width);
    Tensor y = k.Empty(slot.saved.shape(), slot.saved.dtype());
    k.ActivationForward(Activation::kRelu, slot.saved, y);
    return Move(call, y, tp.produces, tp.hands_on, slot.in_width);
  }

  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    Kernels& k = call.module.k;
    const TorchPlacements& tp = slot.torch;
    const Tensor d = Move(call, dy, GradOf(tp.hands_on), GradOf(tp.produces), slot.in_width)
                         .Reshaped(slot.saved.shape());
    Tensor dx = k.Empty(d.shape(), d.dtype());
    k.ActivationBackward(Activation::kRelu, slot.saved, d, dx);
    return Move(call, dx, GradOf(tp.computes), GradOf(tp.arrives), slot.in_width);
  }
};

// nn.LayerNorm over the width: on whole rows of every token (Replicate()), or of this rank's
// tokens under SequenceParallel (Shard(1): its weight and bias stay Replicate() and their
// gradients, each rank's tokens' share, are summed over tp after the step, as Megatron's
// sequence-parallel norms are).
class TorchLayerNorm : public LayerKind {
 public:
  Status Plan(LayerPlanner& p) const override {
    Graph::Impl& g = p.g;
    LayerSlot& slot = p.slot;
    const LayerConfig& c = slot.config;
    MPUSIM_RETURN_IF_ERROR(p.RequireWidth(c.normalized_shape, "normalized_shape"));
    MPUSIM_RETURN_IF_ERROR(PlanInput(p, TorchModuleKind::kLayerNorm, 3));
    MPUSIM_RETURN_IF_ERROR(RequireNoDTensor(p));
    TorchPlacements& tp = slot.torch;
    const bool sequence = tp.computes == P::Shard(1);
    if (sequence && !tp.style) {
      return p.Fail(
          fmt::format("{} receives {} from {}: its plain weight's gradient would cover "
                      "this rank's tokens only (torch sums a DTensor parameter's, not "
                      "a plain one's). Fix: give {} SequenceParallel",
                      Who(slot), Described(g, tp.computes, p.width), Previous(p), c.name));
    }
    if (!sequence) {
      MPUSIM_RETURN_IF_ERROR(RequireWhole(p, "a LayerNorm normalises whole rows"));
    }
    LayerConfig ones = c;
    ones.init = InitSpec{InitMethod::kOnes, 0.0};
    slot.weight = g.AddParameter(c.name + ".weight", {c.normalized_shape}, {}, ones, false);
    slot.owns_weight = true;
    slot.bias = g.AddParameter(c.name + ".bias", {c.normalized_shape}, {}, c, true);
    slot.weight->allreduce_grad_over_tp = slot.bias->allreduce_grad_over_tp = sequence;
    tp.weight = P::Replicate();
    return PlanOutput(p, tp.computes, c.normalized_shape);
  }

  Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& x) const override {
    Kernels& k = call.module.k;
    const TorchPlacements& tp = slot.torch;
    const int64_t h = slot.config.normalized_shape;
    slot.saved = Flat(Move(call, x, tp.arrives, tp.computes, h));
    const DType stats = ComputeDType(slot.saved.dtype());
    slot.mean = k.Zeros({slot.saved.rows()}, stats);
    slot.rstd = k.Zeros({slot.saved.rows()}, stats);
    Tensor y = k.Empty(slot.saved.shape(), slot.saved.dtype());
    k.NormForward(Normalization::kLayerNorm, slot.saved, slot.weight->value, &slot.bias->value,
                  slot.config.eps, y, &slot.mean, slot.rstd);
    return Move(call, y.Reshaped(LocalOf(call, tp.produces, h)), tp.produces, tp.hands_on, h);
  }

  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    Kernels& k = call.module.k;
    const TorchPlacements& tp = slot.torch;
    const int64_t h = slot.config.normalized_shape;
    const Tensor d = Flat(Move(call, dy, GradOf(tp.hands_on), GradOf(tp.produces), h));
    Tensor dx = k.Empty(d.shape(), d.dtype());
    k.NormBackward(Normalization::kLayerNorm, slot.saved, slot.weight->value, &slot.mean, slot.rstd,
                   d, dx, slot.weight->grad, &slot.bias->grad);
    return Move(call, dx.Reshaped(LocalOf(call, GradOf(tp.computes), h)), GradOf(tp.computes),
                GradOf(tp.arrives), h);
  }
};

// nn.CrossEntropyLoss: on whole logits (Replicate(), a plain tensor), or under
// loss_parallel() on Shard(-1) logits handed on as a DTensor, each rank over its classes
// (Megatron's vocab_parallel_cross_entropy: the row max, the label's logit and the sum of
// exponentials all-reduced; its input gradient Shard(-1), no collective). Per-token losses;
// the chain's mean over every token is its loss.
class TorchCrossEntropyLoss : public LayerKind {
 public:
  bool is_loss() const override { return true; }

  Status Plan(LayerPlanner& p) const override {
    Graph::Impl& g = p.g;
    MPUSIM_RETURN_IF_ERROR(PlanInput(p, TorchModuleKind::kOther, 3));
    TorchPlacements& tp = p.slot.torch;
    if (g.run.loss_parallel) {
      if (tp.computes != P::Shard(2) || !g.planning_dtensor) {
        return p.Fail(fmt::format(
            "under loss_parallel takes Shard(-1) logits as a DTensor, but receives {}{} from "
            "{}. Fix: give {} ColwiseParallel with use_local_output false (its output Shard(-1))",
            Described(g, tp.computes, p.width), g.planning_dtensor ? "" : " as a plain tensor",
            Previous(p), StyledSource(p)));
      }
      MPUSIM_RETURN_IF_ERROR(p.RequireDivisible(p.width, g.t, "the number of classes"));
    } else {
      MPUSIM_RETURN_IF_ERROR(RequireNoDTensor(p));
      MPUSIM_RETURN_IF_ERROR(RequireWhole(p, "the loss takes the softmax over every class"));
    }
    if (p.width < *g.model.vocab_size) {
      return p.Fail(
          fmt::format("the logits have {} classes, fewer than model.vocab_size {} (the "
                      "labels are drawn from [0, vocab_size))",
                      p.width, *g.model.vocab_size));
    }
    g.needs_labels = true;
    p.state = ActivationState{Split::kReplicated, 1};
    p.width = 0;
    return {};
  }

  Tensor Forward(const LayerCall& call, LayerSlot& slot, const Tensor& x) const override {
    const TorchPlacements& tp = slot.torch;
    slot.saved = Flat(Move(call, x, tp.arrives, tp.computes, slot.in_width));
    CrossEntropyStash stash;
    const Tensor losses =
        tp.computes.is_shard()
            ? VocabParallelCrossEntropyForward(call.module.k, call.module.tp, slot.saved,
                                               call.batch.labels, slot.in_width, 0.0, &stash)
            : CrossEntropyForward(call.module.k, slot.saved, call.batch.labels, &stash);
    slot.row_max = stash.row_max;
    slot.sum_exp = stash.sum_exp;
    return losses.Reshaped(call.batch.labels.shape());
  }

  Tensor Backward(const LayerCall& call, LayerSlot& slot, const Tensor& dy) const override {
    const TorchPlacements& tp = slot.torch;
    const Tensor& logits = slot.saved;
    const int64_t rank = tp.computes.is_shard() ? call.module.shape.tp_rank : 0;
    const Tensor dx =
        VocabParallelCrossEntropyBackward(call.module.k, {logits, slot.row_max, slot.sum_exp},
                                          call.batch.labels, slot.in_width, 0.0, rank, dy);
    return Move(call, dx.Reshaped(LocalOf(call, tp.computes, slot.in_width)), GradOf(tp.computes),
                GradOf(tp.arrives), slot.in_width);
  }
};

}  // namespace

std::vector<std::string> ExplainTorchModule(const LayerSlot& slot, int64_t t) {
  const TorchPlacements& tp = slot.torch;
  const LayerType type = slot.config.type;
  const bool tokens = type == LayerType::kEmbedding;
  const bool loss = type == LayerType::kCrossEntropyLoss;
  std::vector<std::string> lines;
  if (tp.style) lines.push_back("style: " + tp.styled_by);
  if (slot.weight != nullptr) {
    std::string params = fmt::format("weight {}", Name(tp.weight));
    if (slot.bias != nullptr) {
      params += fmt::format(", bias {}", slot.bias->split.dim == 0 ? "Shard(0)" : "Replicate()");
    }
    lines.push_back("parameters: " + params);
  }
  lines.push_back(
      fmt::format("placements: input {}{}{}", tokens ? "token ids Replicate()" : Name(tp.arrives),
                  tp.computes == tp.arrives ? std::string()
                                            : fmt::format(", computed on {}", Name(tp.computes)),
                  loss ? std::string()
                       : fmt::format("; output {}{}{}", Name(tp.produces),
                                     tp.hands_on == tp.produces
                                         ? std::string()
                                         : fmt::format(", handed on {}", Name(tp.hands_on)),
                                     tp.hands_on_dtensor ? " (a DTensor)" : "")));
  // Each redistribution with the collective DTensor runs for it.
  const auto moves = [&](std::initializer_list<std::pair<P, P>> pairs) {
    std::vector<std::string> out;
    for (const auto& [from, to] : pairs) {
      if (from == to) continue;
      StatusOr<DTensorCollective> c = RedistributeCollective(from, to, t);
      const std::string_view name = c.ok() ? DTensorCollectiveName(*c) : "refused";
      out.push_back(fmt::format("{} -> {} {}", Name(from), Name(to),
                                name.empty() ? std::string("(local)") : std::string(name)));
    }
    return out.empty() ? std::string("none") : fmt::format("{}", fmt::join(out, ", "));
  };
  if (!loss) {
    lines.push_back(fmt::format(
        "redistributes: forward {}; backward {}",
        moves({{tp.arrives, tp.computes}, {tp.produces, tp.hands_on}}),
        moves({{GradOf(tp.hands_on), GradOf(tp.produces)},
               {tokens ? GradOf(tp.arrives) : NaturalInputGrad(tp), GradOf(tp.arrives)}})));
  } else if (tp.arrives != tp.computes) {
    lines.push_back(fmt::format("redistributes: forward {}; backward {}",
                                moves({{tp.arrives, tp.computes}}),
                                moves({{GradOf(tp.computes), GradOf(tp.arrives)}})));
  }
  // Megatron's module that does the same.
  std::string megatron;
  const bool seq_in = tp.arrives == P::Shard(1), seq_out = tp.hands_on == P::Shard(1);
  if (type == LayerType::kLinear && tp.weight == P::Shard(0) && tp.computes.is_replicate()) {
    if (tp.hands_on == P::Shard(2)) {
      megatron = seq_in ? "ColumnParallelLinear under sequence_parallel"
                        : "ColumnParallelLinear (gather_output false)";
    } else if (tp.hands_on.is_replicate() && !seq_in) {
      megatron = "ColumnParallelLinear (gather_output true)";
    }
  } else if (type == LayerType::kLinear && tp.weight == P::Shard(1) && tp.arrives == P::Shard(2)) {
    if (tp.hands_on.is_replicate()) megatron = "RowParallelLinear (input_is_parallel true)";
    if (seq_out) megatron = "RowParallelLinear under sequence_parallel";
  } else if (tokens && tp.weight == P::Shard(0)) {
    if (tp.hands_on.is_replicate()) megatron = "VocabParallelEmbedding";
    if (seq_out) megatron = "VocabParallelEmbedding under sequence_parallel";
  } else if (tokens && tp.weight == P::Shard(1) && tp.hands_on.is_replicate()) {
    megatron = "ParallelEmbedding";
  }
  if (!megatron.empty()) lines.push_back("Megatron's way: " + megatron);
  return lines;
}

const LayerKind& TorchKindOf(LayerType type) {
  static const TorchEmbedding embedding;
  static const TorchLinear linear;
  static const TorchReLU relu;
  static const TorchCrossEntropyLoss loss;
  static const TorchLayerNorm layer_norm;
  switch (type) {
    case LayerType::kLayerNorm:
      return layer_norm;
    case LayerType::kEmbedding:
      return embedding;
    case LayerType::kLinear:
      return linear;
    case LayerType::kReLU:
      return relu;
    case LayerType::kCrossEntropyLoss:
      return loss;
    default:
      break;
  }
  throw std::logic_error("TorchKindOf: not a torch.nn module");
}

}  // namespace chain

// ---------------------------------------------------------------------------------------
// parallelize_plan -> each module's style

Status Graph::Impl::ResolveStyles() {
  styles.assign(model.layers.size(), std::nullopt);
  if (!parallelize_plan) return {};
  const auto& entries = parallelize_plan->entries;
  // One style for the whole model, as parallelize_module(model, style) applies it.
  if (entries.size() == 1 && entries.front().first.empty()) {
    const ParallelStyle& style = entries.front().second;
    if (style.kind != ParallelStyleKind::kPairwise) {
      return Status::Error(
          "parallelize_plan",
          fmt::format("{} on the whole model: torch applies it to the model itself, which is "
                      "not a Linear or Embedding (\"{} currently only support nn.Linear and "
                      "nn.Embedding!\"); name the modules instead, e.g. {{\"fc1\": \"{}\"}}",
                      ParallelStyleName(style.kind), ParallelStyleName(style.kind),
                      ParallelStyleName(style.kind)));
    }
    // PyTorch 2.0's parallelize_module: a module with more than one Linear child is an MLP
    // (_parallelize_mlp): its first Linears in pairs, Colwise then Rowwise, the first taking
    // its input as Replicate() and the last handing on Replicate() as a tensor; the DTensors
    // in between flow from one to the next.
    std::vector<size_t> linears;
    for (size_t i = 0; i < model.layers.size(); ++i) {
      if (model.layers[i].type == LayerType::kLinear) linears.push_back(i);
    }
    if (linears.size() < 2) {
      return Status::Error("parallelize_plan",
                           fmt::format("PairwiseParallel pairs the model's Linear modules, and "
                                       "it has {}: torch would leave every module unsharded; "
                                       "name the modules and their styles instead",
                                       linears.size()));
    }
    const size_t paired = linears.size() / 2 * 2;
    for (size_t j = 0; j < paired; ++j) {
      ParallelStyle s;
      s.kind = j % 2 == 0 ? ParallelStyleKind::kColwise : ParallelStyleKind::kRowwise;
      if (j % 2 == 0) {
        s.input_layouts = "Replicate()";
        s.use_local_output = false;
      } else {
        s.output_layouts = "Replicate()";
        s.use_local_output = j + 1 == paired;
      }
      styles[linears[j]] = std::make_pair(std::string("parallelize_plan: PairwiseParallel"), s);
    }
    return {};
  }
  for (const auto& [pattern, style] : entries) {
    const std::string where = "parallelize_plan." + pattern;
    bool matched = false;
    for (size_t i = 0; i < model.layers.size(); ++i) {
      const LayerConfig& layer = model.layers[i];
      if (!FqnMatches(pattern, layer.name)) continue;
      matched = true;
      if (styles[i]) {
        return Status::Error(where, fmt::format("styles module \"{}\", which {} styles too; give "
                                                "each module one style",
                                                layer.name, styles[i]->first));
      }
      if (style.kind == ParallelStyleKind::kPairwise) {
        return Status::Error(where,
                             fmt::format("PairwiseParallel pairs the Linear children of a "
                                         "module, and \"{}\" ({}) has none (torch would "
                                         "leave it unsharded); use ColwiseParallel and "
                                         "RowwiseParallel on the Linears, or PairwiseParallel "
                                         "on the whole model",
                                         layer.name, LayerTypeName(layer.type)));
      }
      if (!IsTorchModule(layer.type)) {
        return Status::Error(where, fmt::format("\"{}\" is a {}: mpusim styles Embedding, "
                                                "Linear, ReLU, LayerNorm and CrossEntropyLoss "
                                                "modules (a "
                                                "GELU or Dropout keeps the placement it "
                                                "receives); style the modules around it",
                                                layer.name, LayerTypeName(layer.type)));
      }
      styles[i] = std::make_pair(where, style);
    }
    if (!matched) {
      std::vector<std::string> names;
      for (const LayerConfig& layer : model.layers) names.push_back(layer.name);
      return Status::Error(
          where, fmt::format("matches no module; the modules are: {}", fmt::join(names, ", ")));
    }
  }
  return {};
}

}  // namespace mpusim
