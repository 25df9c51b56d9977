// The layer graph (see graph.h and docs/simulator.md): its parameters and data, the forward
// and backward steps over a chunk's layers (each layer's kind, graph_layers.cc, computes it),
// and the records.
//
// Shape legend (local, on one rank; t = tp size, d = dp size):
//   s, b          sequence length (s/t under sequence parallelism), micro-batch per dp rank
//   x, y          activations [s, b, w] (w/t columns when hidden-split)
#include "core/model/graph.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/init.h"
#include "core/model/graph_impl.h"
#include "core/model/parameter.h"
#include "core/rng.h"
#include "core/tensor_parallel/tp_utils.h"

namespace mpusim {

using Split = ActivationState::Split;

const char* SplitName(Split split) {
  switch (split) {
    case Split::kReplicated: return "replicated";
    case Split::kHidden: return "hidden split";
    case Split::kSequence: return "sequence split";
    case Split::kPartialSum: return "partial sum";
  }
  return "?";
}

namespace chain {

ShardSpec ActivationSpec(const ActivationState& state, const RankCoordinates& c, int64_t tp,
                         int64_t dp) {
  ShardSpec spec;
  spec.Split(ShardAxis::kDp, 1, dp, c.dp);
  if (state.split == Split::kHidden) {
    spec.Split(ShardAxis::kTp, 2, tp, c.tp, state.stride);
  } else if (state.split == Split::kSequence) {
    spec.Split(ShardAxis::kTp, 0, tp, c.tp);
  }
  return spec;
}

}  // namespace chain

using chain::ActivationSpec;
using chain::Batch;
using chain::LayerCall;
using chain::ChainParameter;
using chain::LayerSlot;
using chain::SlotTensors;


// ---------------------------------------------------------------------------------------
// Parameters and data

void Graph::InitializeParameters(RankContext& ctx) {
  Impl& g = *impl_;
  g.pp_rank = ctx.coords.pp;
  g.initial_rng = ctx.rng.GetStates();
  g.draws_per_iteration.clear();
  // This rank's layers; a parameter is held where its owner runs and where a tied user runs.
  const std::vector<Impl::Holding> holdings = g.HoldingsOf(g.pp_rank);
  for (size_t i = 0; i < g.parameters.size(); ++i) {
    g.parameters[i]->held = holdings[i].held;
    // The last stage's copy: left out of the gradient norm.
    if (holdings[i].shared) g.parameters[i]->shared = true;
  }
  for (const LayerSlot& slot : g.layers) {
    if (g.PipelineRankOf(slot.stage) != g.pp_rank) continue;
    if (!slot.rng_stream.empty()) {  // a Dropout layer
      g.draws_per_iteration[slot.rng_stream] += static_cast<uint64_t>(g.run.num_microbatches);
    }
  }
  for (auto& p : g.parameters) {
    if (!p->held) continue;
    p->shard = g.RankShard(*p, ctx.coords.tp);
    const Shape local = LocalShape(p->shard, p->full_shape);
    Tensor host = Tensor::HostZeros(local, g.run.dtype);
    if (!p->zero_init) FillShard(g.run.seed, p->name, p->init, p->full_shape, p->shard, host);
    p->value = ctx.kernels->ToDevice(host);
    if (!p->frozen) p->grad = ctx.kernels->Zeros(local, g.grad_dtype);
  }
  if (config_.optimizer && config_.optimizer->use_torch_fsdp2) {
    g.BuildFullyShard(ctx, config_.optimizer->torch_fsdp2_reshard_after_forward);
  }
}

// fully_shard on every layer holding parameters, as a user wraps each such torch.nn module
// (the root, the chain itself, then holds none). Layers sharing a parameter (weight_from,
// bias_from) and the layers between them are one unit, as fully_shard on a module holding
// them all would be.
std::vector<Graph::Impl::UnitRange> Graph::Impl::FullyShardRanges() const {
  const auto n = static_cast<int64_t>(layers.size());
  const auto params_of = [&](const LayerSlot& slot) {
    std::vector<ChainParameter*> out;
    for (ChainParameter* p : {slot.weight, slot.bias, slot.added_bias}) {
      if (p != nullptr && p->held) out.push_back(p);
    }
    return out;
  };
  // The furthest layer each layer's unit must reach: the last user of any parameter of it.
  std::vector<int64_t> reach(static_cast<size_t>(n), -1);
  std::map<const ChainParameter*, int64_t> first_user;
  for (int64_t i = 0; i < n; ++i) {
    for (ChainParameter* p : params_of(layers[static_cast<size_t>(i)])) {
      const int64_t first = first_user.try_emplace(p, i).first->second;
      reach[static_cast<size_t>(first)] = std::max(reach[static_cast<size_t>(first)], i);
      reach[static_cast<size_t>(i)] = std::max(reach[static_cast<size_t>(i)], i);
    }
  }
  std::vector<UnitRange> units;
  for (int64_t i = 0; i < n;) {
    if (reach[static_cast<size_t>(i)] < 0) {
      ++i;
      continue;
    }
    int64_t last = reach[static_cast<size_t>(i)];
    for (int64_t j = i; j <= last; ++j) last = std::max(last, reach[static_cast<size_t>(j)]);
    UnitRange& unit = units.emplace_back();
    unit.first = i;
    unit.last = last;
    unit.name = layers[static_cast<size_t>(i)].config.name;
    if (last > i) unit.name += ".." + layers[static_cast<size_t>(last)].config.name;
    std::set<const ChainParameter*> seen;
    for (int64_t j = i; j <= last; ++j) {
      for (ChainParameter* p : params_of(layers[static_cast<size_t>(j)])) {
        if (seen.insert(p).second) unit.params.push_back(p);
      }
    }
    i = last + 1;
  }
  return units;
}

std::vector<FullyShardUnitPlan> Graph::FullyShardUnits() const {
  if (!config_.optimizer || !config_.optimizer->use_torch_fsdp2) return {};
  std::vector<FullyShardUnitPlan> out;
  for (const Impl::UnitRange& range : impl_->FullyShardRanges()) {
    FullyShardUnitPlan& unit = out.emplace_back();
    unit.name = range.name;
    for (const ChainParameter* p : range.params) unit.params.push_back(p->name);
  }
  return out;
}

void Graph::Impl::BuildFullyShard(RankContext& ctx, bool reshard_after_forward) {
  unit_of.assign(layers.size(), -1);
  unit_first.clear();
  unit_last.clear();
  std::vector<FullyShard::Unit> units;
  for (UnitRange& range : FullyShardRanges()) {
    for (int64_t j = range.first; j <= range.last; ++j) {
      unit_of[static_cast<size_t>(j)] = static_cast<int64_t>(units.size());
    }
    unit_first.push_back(range.first);
    unit_last.push_back(range.last);
    units.push_back({std::move(range.name), {range.params.begin(), range.params.end()}, false});
  }
  fsdp = std::make_unique<FullyShard>(std::move(units), ctx.dp_cp(), reshard_after_forward,
                                      *ctx.kernels);
}

Batch Graph::Impl::MakeBatch(RankContext& ctx, int64_t m, bool tokens, bool labels) const {
  Batch batch;
  batch.microbatch = m;
  ctx.trace->SetPhase(Phase::kOther);
  ctx.trace->SetSite("broadcast_data");
  const int64_t s = run.seq_length, b = run.micro_batch_size, B = b * d;
  batch.token_scale = 1.0 / static_cast<double>(run.num_microbatches * s * B);
  // Megatron's broadcast_data: the first rank of each tp group makes its data-parallel
  // slice and broadcasts it (int64, as torch.int64 there) to the group; the kernels then
  // read the ids on the device.
  auto make = [&](const char* stream, Tensor* out) {
    Tensor host = Tensor::HostZeros({s, b}, DType::kInt64);
    if (ctx.coords.tp == 0) {
      int64_t* v = host.data_as<int64_t>();
      const std::string name = fmt::format("{}.mb{}", stream, m);
      for (int64_t i = 0; i < s; ++i) {
        for (int64_t j = 0; j < b; ++j) {
          const int64_t g = ctx.coords.dp * b + j;
          v[i * b + j] = TokenAt(run.seed, name, i * B + g, *model.vocab_size);
        }
      }
    }
    *out = ctx.kernels->ToDevice(host);
    BroadcastData(ctx.tp(), {out});
  };
  if (tokens) make("tokens", &batch.tokens);
  if (labels) make("labels", &batch.labels);
  return batch;
}

Tensor Graph::Impl::SyntheticActivation(RankContext& ctx, const std::string& name,
                                        ActivationState state, int64_t width, DType dtype) {
  if (const auto it = synthetic_cache.find(name); it != synthetic_cache.end()) return it->second;
  const Shape full = {run.seq_length, run.micro_batch_size * d, width};
  const ShardSpec spec = ActivationSpec(state, ctx.coords, t, d);
  Tensor host = Tensor::HostZeros(LocalShape(spec, full), dtype);
  FillShard(run.seed, name, InitSpec{InitMethod::kNormal, 1.0}, full, spec, host);
  Tensor device = ctx.kernels->ToDevice(host);
  // A partial-sum input: every rank holds input / t, so that the sum is the input.
  if (state.split == Split::kPartialSum) ctx.kernels->Scale(1.0 / static_cast<double>(t), device);
  synthetic_cache.emplace(name, device);
  return device;
}

// ---------------------------------------------------------------------------------------
// Layers: each kind's forward and backward (graph_layers.cc) on the module context of this
// rank, with the [s, b, w] shape of the layer's output and input gradient given back.

LayerCall Graph::Impl::Call(RankContext& ctx, const Batch& batch) const {
  const StreamShape shape{run.seq_length, run.micro_batch_size, run.micro_batch_size * d,
                          ctx.coords.dp,  t,                    ctx.coords.tp,
                          sequence_parallel};
  return LayerCall{ctx,
                   ModuleContext{*ctx.kernels, ctx.tp(), *ctx.trace, shape, d, {}, fuse_wgrad},
                   batch, padded_vocab};
}

Tensor Graph::Impl::Forward(RankContext& ctx, LayerSlot& slot, const Tensor& x,
                            const Batch& batch) {
  slot.input = x;
  const int64_t u = fsdp ? unit_of[static_cast<size_t>(slot.index)] : -1;
  if (u >= 0) fsdp->PreForward(*ctx.kernels, static_cast<size_t>(u), *ctx.trace);
  const Tensor y = slot.kind->Forward(Call(ctx, batch), slot, x);
  if (u >= 0 && slot.index == unit_last[static_cast<size_t>(u)]) {
    fsdp->PostForward(static_cast<size_t>(u), recomputing);
  }
  if (slot.kind->is_loss()) return y;
  return y.Reshaped(LocalActivationShape(slot.out_state, slot.out_width, ctx.coords));
}

Tensor Graph::Impl::Backward(RankContext& ctx, LayerSlot& slot, const Tensor& dy,
                             const Batch& batch) {
  const int64_t u = fsdp ? unit_of[static_cast<size_t>(slot.index)] : -1;
  if (u >= 0) fsdp->PreBackward(*ctx.kernels, static_cast<size_t>(u), *ctx.trace);
  const Tensor dx = slot.kind->Backward(Call(ctx, batch), slot, dy);
  if (u >= 0 && slot.index == unit_first[static_cast<size_t>(u)]) {
    fsdp->PostBackward(*ctx.kernels, static_cast<size_t>(u), *ctx.trace);
  }
  if (slot.kind->takes_tokens()) return dx;
  return dx.Reshaped(LocalActivationShape(slot.in_state, slot.in_width, ctx.coords));
}

Tensor Graph::Impl::ForwardLayers(RankContext& ctx, int64_t first, int64_t end, Tensor x,
                                  const Batch& batch, bool count_loss) {
  ctx.trace->SetPhase(Phase::kForward);
  const LayerSlot& head = layers.front();
  if (first == 0 && !head.kind->takes_tokens()) {
    x = SyntheticActivation(ctx, fmt::format("input.mb{}", batch.microbatch), head.in_state,
                            head.in_width, run.dtype);
  }
  for (int64_t i = first; i < end; ++i) {
    LayerSlot& slot = layers[static_cast<size_t>(i)];
    ctx.trace->SetSite(slot.config.name);
    slot.output = Forward(ctx, slot, x, batch);
    x = slot.output;
  }
  const bool ends_with_loss =
      end == static_cast<int64_t>(layers.size()) && layers.back().kind->is_loss();
  if (!ends_with_loss || !count_loss) return x;
  // Mean token loss over this micro-batch's s * B tokens: local sum, summed over dp.
  const Tensor host = ctx.kernels->ToHost(x);
  double local = 0;
  for (int64_t i = 0; i < host.numel(); ++i) local += HostValue(host, i);
  Tensor sum = Tensor::HostZeros({1}, DType::kFloat64);
  sum.data_as<double>()[0] = local;
  Tensor device = ctx.kernels->ToDevice(sum);
  ctx.trace->SetPhase(Phase::kOther);
  ctx.trace->SetSite("loss");
  if (d > 1) ctx.dp().AllReduce(device, ReduceOp::kSum);
  const double total = ctx.kernels->ToHost(device).data_as<double>()[0];
  loss_sum += total / static_cast<double>(run.seq_length * run.micro_batch_size * d);
  return x;
}

Tensor Graph::Impl::BackwardLayers(RankContext& ctx, int64_t first, int64_t end, Tensor dy,
                                   const Batch& batch) {
  ctx.trace->SetPhase(Phase::kBackward);
  if (end == static_cast<int64_t>(layers.size())) {
    LayerSlot& last = layers.back();
    if (last.kind->is_loss()) {
      Tensor host = Tensor::HostZeros(last.output.shape(), last.output.dtype());
      for (int64_t i = 0; i < host.numel(); ++i) SetHostValue(host, i, batch.token_scale);
      dy = ctx.kernels->ToDevice(host);
    } else {
      dy = SyntheticActivation(ctx, fmt::format("output_grad.mb{}", batch.microbatch),
                               last.out_state, last.out_width, run.dtype);
    }
  }
  for (int64_t i = end; i-- > first;) {
    LayerSlot& slot = layers[static_cast<size_t>(i)];
    ctx.trace->SetSite(slot.config.name);
    slot.output_grad = dy;
    dy = Backward(ctx, slot, dy, batch);
    slot.input_grad = dy;
  }
  return dy;
}

Tensor Graph::Impl::ForwardStep(const StepCall& call, const Tensor& input, Stash& stash) {
  RankContext& ctx = call.ctx;
  const int64_t m = call.microbatch;
  const int64_t first = First(call.chunk), end = End(call.chunk);
  const auto n = static_cast<int64_t>(layers.size());
  // Micro-batch m of iteration k reads the data of global micro-batch k*M + m.
  stash.batch = MakeBatch(ctx, current_iteration * run.num_microbatches + m,
                          first == 0 && needs_tokens, end == n && needs_labels);
  const int64_t count = end - first;
  stash.slots.assign(static_cast<size_t>(count), SlotTensors());
  stash.group_input.assign(static_cast<size_t>(count), Tensor());
  stash.group_rng.assign(static_cast<size_t>(count), RngTracker::States());
  Tensor x = input;
  for (int64_t i = first; i < end; ++i) {
    // Activation checkpointing (Megatron's CheckpointFunction over a group of layers) keeps
    // only a recomputed group's input and the tracker's state before it.
    const RunConfig::RecomputeGroup group = run.GroupOf(i - first, count);
    const auto at = static_cast<size_t>(i - first);
    if (group.recomputed && group.first == i - first) {
      stash.group_input[at] = x;
      stash.group_rng[at] = ctx.rng.GetStates();
    }
    x = ForwardLayers(ctx, i, i + 1, x, stash.batch, true);
    LayerSlot& slot = layers[static_cast<size_t>(i)];
    if (!group.recomputed) stash.slots[at] = slot;
    static_cast<SlotTensors&>(slot) = SlotTensors();
  }
  return end == n ? Tensor() : x;
}

Tensor Graph::Impl::BackwardStep(const StepCall& call, const Tensor& output_grad,
                                 Stash& stash) {
  RankContext& ctx = call.ctx;
  const int64_t m = call.microbatch;
  const int64_t first = First(call.chunk), end = End(call.chunk);
  const int64_t count = end - first;
  // Backward segment by segment, last first: a kept layer from its stash; a recomputed group
  // after its forward again, with the random streams as they were before it (then put back).
  // Its collectives are real: they stay in the trace, as forward.
  Tensor input_grad = output_grad;
  for (int64_t stop = end; stop > first;) {
    const RunConfig::RecomputeGroup group = run.GroupOf(stop - 1 - first, count);
    const int64_t start = group.recomputed ? first + group.first : stop - 1;
    if (group.recomputed) {
      const SpanRecorder recompute(*call.spans, call.chunk, m, true, true);
      const RngTracker::States now = ctx.rng.GetStates();
      ctx.rng.SetStates(stash.group_rng[static_cast<size_t>(group.first)]);
      recomputing = true;
      ForwardLayers(ctx, start, stop, stash.group_input[static_cast<size_t>(group.first)],
                    stash.batch, false);
      recomputing = false;
      ctx.rng.SetStates(now);
    } else {
      static_cast<SlotTensors&>(layers[static_cast<size_t>(start)]) =
          stash.slots[static_cast<size_t>(start - first)];
    }
    input_grad = BackwardLayers(ctx, start, stop, input_grad, stash.batch);
    stop = start;
  }
  if (m + 1 == run.num_microbatches) {
    // The last micro-batch's tensors stay for the records; tokens and labels as float64
    // [s, b] (what dumps and the check hold).
    if (stash.batch.tokens.defined()) {
      last_tokens = HostToFloat64(ctx.kernels->ToHost(stash.batch.tokens));
    }
    if (stash.batch.labels.defined()) {
      last_labels = HostToFloat64(ctx.kernels->ToHost(stash.batch.labels));
    }
  } else {
    for (int64_t i = first; i < end; ++i) {
      static_cast<SlotTensors&>(layers[static_cast<size_t>(i)]) = SlotTensors();
    }
  }
  return first == 0 ? Tensor() : input_grad;
}

std::vector<Parameter*> Graph::TrainableParameters() const {
  std::vector<Parameter*> out;
  for (const auto& p : impl_->parameters) {
    if (p->held && !p->frozen) out.push_back(p.get());
  }
  return out;
}

FullyShard* Graph::fully_shard() const { return impl_->fsdp.get(); }

std::vector<const Parameter*> Graph::HeldParameters() const {
  std::vector<const Parameter*> out;
  for (const auto& p : impl_->parameters) {
    if (p->held) out.push_back(p.get());
  }
  return out;
}

std::vector<HeldParameterShape> Graph::HeldParameterShapes() const {
  const Impl& g = *impl_;
  const std::vector<Impl::Holding> holdings = g.HoldingsOf(coords_.pp);
  std::vector<HeldParameterShape> out;
  for (size_t i = 0; i < g.parameters.size(); ++i) {
    if (!holdings[i].held) continue;
    const ChainParameter& p = *g.parameters[i];
    out.push_back({p.name, LocalShape(g.RankShard(p, coords_.tp), p.full_shape), !p.frozen, false});
  }
  return out;
}

void Graph::BeginStep(RankContext& ctx, int64_t iteration, bool /*record*/) {
  Impl& g = *impl_;
  // Megatron's tracker keeps advancing from step to step: iteration k starts where k
  // iterations of draws left it (a repeated step starts where its iteration does).
  ctx.rng.SetStates(g.RngAtIteration(iteration));
  if (g.synthetic_iteration != iteration) {
    g.synthetic_cache.clear();
    g.synthetic_iteration = iteration;
  }
  g.current_iteration = iteration;
  // A new step: the previous step's activations are released before any new one is made (so
  // a repeated step reuses their memory instead of holding two steps' worth), and main_grad
  // starts from zero (Megatron's zero_grad_buffer), so every step computes the same gradients.
  for (LayerSlot& slot : g.layers) static_cast<SlotTensors&>(slot) = SlotTensors();
  if (g.fsdp) {
    g.fsdp->ZeroGrads(*ctx.kernels);
  } else {
    for (auto& p : g.parameters) {
      if (p->held && !p->frozen) ctx.kernels->SetZero(p->grad);
    }
  }
  g.loss_sum = 0;
  g.has_loss = g.layers.back().kind->is_loss();
}

int64_t Graph::num_model_chunks() const { return impl_->vp_size; }

// The activations and gradients at the chunk boundaries, each in its layer's state on the tp
// group: an activation enters the first layer of the virtual stage consuming it (on the
// receiving rank), a gradient the output of its last.
std::pair<Shape, DType> Graph::TransferShape(const RankContext& ctx, const Transfer& t) const {
  const Impl& g = *impl_;
  const int64_t receiver = t.send ? t.peer : g.pp_rank;
  const auto u = static_cast<size_t>(t.model_chunk * g.pp_size + receiver);
  const bool activation = t.kind == Transfer::Kind::kActivation;
  const LayerSlot& at =
      g.layers[static_cast<size_t>(activation ? g.stage_start[u] : g.stage_start[u + 1] - 1)];
  return {activation ? g.LocalActivationShape(at.in_state, at.in_width, ctx.coords)
                     : g.LocalActivationShape(at.out_state, at.out_width, ctx.coords),
          g.run.dtype};
}

std::unique_ptr<StepStash> Graph::NewStash(int64_t /*chunk*/) const {
  return std::make_unique<Impl::Stash>();
}

Tensor Graph::ForwardStep(const StepCall& call, const Tensor& input, StepStash& stash) {
  return impl_->ForwardStep(call, input, static_cast<Impl::Stash&>(stash));
}

Tensor Graph::BackwardStep(const StepCall& call, const Tensor& output_grad, StepStash& stash) {
  return impl_->BackwardStep(call, output_grad, static_cast<Impl::Stash&>(stash));
}

void Graph::EndStep(RankContext& ctx) {
  Impl& g = *impl_;
  if (ctx.rng.GetStates() != g.RngAtIteration(g.current_iteration + 1)) {
    throw std::logic_error(
        fmt::format("Graph: the RNG tracker did not advance by one iteration's draws "
                    "in iteration {}",
                    g.current_iteration));
  }
  if (g.pp_size > 1 && g.has_loss) {
    // The loss: the last stage computed it, the others add 0.
    Tensor total = Tensor::HostZeros({1}, DType::kFloat64);
    total.data_as<double>()[0] = g.loss_sum;
    Tensor device = ctx.kernels->ToDevice(total);
    ctx.trace->SetSite("loss");
    ctx.pp().AllReduce(device, ReduceOp::kSum);
    g.loss_sum = ctx.kernels->ToHost(device).data_as<double>()[0];
  }
}

void Graph::Records(RankContext& ctx, std::vector<TensorRecord>* records) const {
  std::vector<TensorRecord> mine = Records(ctx);
  records->insert(records->end(), std::make_move_iterator(mine.begin()),
                  std::make_move_iterator(mine.end()));
}

std::vector<TensorRecord> Graph::Records(RankContext& ctx) const {
  const Impl& g = *impl_;
  std::vector<TensorRecord> out;
  const int64_t s = g.run.seq_length, B = g.run.micro_batch_size * g.d;
  auto activation = [&](const std::string& name, const Tensor& tensor, ActivationState state,
                        int64_t width) {
    if (!tensor.defined()) return;
    TensorRecord r{name, tensor, {s, B, width}, ActivationSpec(state, ctx.coords, g.t, g.d),
                   state.split == Split::kPartialSum};
    out.push_back(std::move(r));
  };
  // A gradient is held as its activation is (in full when replicated, the rank's shard when
  // split), except for a partial sum's: d(sum)/d(part) is the identity, so every rank holds
  // the same full gradient, replicated (the input gradient of a chain that starts with
  // reduce_from or reduce_scatter).
  auto gradient = [&](const std::string& name, const Tensor& tensor, ActivationState state,
                      int64_t width) {
    if (state.split == Split::kPartialSum) state = ActivationState{Split::kReplicated, 1};
    activation(name, tensor, state, width);
  };
  ShardSpec batch_split;
  batch_split.Split(ShardAxis::kDp, 1, g.d, ctx.coords.dp);
  if (g.last_tokens.defined()) {
    out.push_back({"tokens", ctx.kernels->ToDevice(g.last_tokens), {s, B}, batch_split, false});
  }
  if (g.last_labels.defined()) {
    out.push_back({"labels", ctx.kernels->ToDevice(g.last_labels), {s, B}, batch_split, false});
  }
  for (const LayerSlot& slot : g.layers) {
    const std::string& n = slot.config.name;
    if (!slot.kind->takes_tokens()) {
      activation(n + ".input", slot.input, slot.in_state, slot.in_width);
      gradient(n + ".input_grad", slot.input_grad, slot.in_state, slot.in_width);
    }
    if (slot.kind->is_loss()) {
      if (slot.output.defined()) {  // on the last pipeline stage
        out.push_back({n + ".output", slot.output, {s, B}, batch_split, false});
        out.push_back({n + ".output_grad", slot.output_grad, {s, B}, batch_split, false});
      }
    } else {
      activation(n + ".output", slot.output, slot.out_state, slot.out_width);
      gradient(n + ".output_grad", slot.output_grad, slot.out_state, slot.out_width);
    }
    for (const ChainParameter* p : {slot.owns_weight ? slot.weight : nullptr, slot.bias}) {
      if (p == nullptr || !p->held) continue;
      out.push_back({p->name, p->value, p->full_shape, p->shard, false});
      if (!p->frozen) out.push_back({p->name + "_grad", p->grad, p->full_shape, p->shard, false});
    }
  }
  if (g.has_loss) {
    Tensor loss = Tensor::HostZeros({1}, DType::kFloat64);
    loss.data_as<double>()[0] = this->loss();
    out.push_back({"loss", ctx.kernels->ToDevice(loss), {1}, ShardSpec{}, false});
  }
  return out;
}

}  // namespace mpusim
