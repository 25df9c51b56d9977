// Transformer layer (see transformer_layer.h).
#include "core/model/transformer_layer.h"

#include <fmt/format.h>

#include <optional>
#include <utility>

namespace mpusim {
namespace {

Norm MakeNorm(const GptConfig& gpt, const std::string& prefix, ParameterSet& params) {
  return Norm(gpt.normalization, gpt.layernorm_epsilon, &params.Get(prefix + ".weight"),
              params.Find(prefix + ".bias"));
}

}  // namespace

TransformerLayer::TransformerLayer(const GptConfig& gpt, int64_t layer, ParameterSet& params,
                                   int64_t t, const RunConfig& run, const ExpertPlacement& experts,
                                   std::string prefix, std::optional<int64_t> number)
    : prefix_(prefix.empty() ? fmt::format("decoder.layers.{}", layer) : std::move(prefix)),
      hidden_dropout_(gpt.hidden_dropout),
      selective_(LayerRecompute::Kept(run)),
      input_norm_(MakeNorm(gpt, prefix_ + ".input_layernorm", params)),
      pre_mlp_norm_(MakeNorm(gpt, prefix_ + ".pre_mlp_layernorm", params)) {
  if (gpt.mla.enabled) {
    mla_.emplace(gpt, prefix_ + ".self_attention", params, t);
  } else {
    attention_.emplace(gpt, number.value_or(layer), prefix_ + ".self_attention", params, t);
  }
  if (gpt.moe.enabled() && gpt.moe.layers.at(static_cast<size_t>(layer))) {
    moe_.emplace(gpt, prefix_ + ".mlp", params, run.num_microbatches, experts);
  } else {
    mlp_.emplace(gpt, prefix_ + ".mlp", params);
  }
}

void TransformerLayer::RecordStream(const ModuleContext& ctx, const std::string& name,
                                    const Tensor& t) const {
  const StreamShape& sh = ctx.shape;
  ctx.Record(prefix_ + name, t, {sh.s, sh.B, t.cols()}, sh.StreamSpec(ctx.dp_size));
}

Tensor TransformerLayer::BiasDropoutAdd(const ModuleContext& ctx, const std::string& site,
                                        const Tensor& x, const Parameter* bias,
                                        const Tensor& residual) const {
  Kernels& k = ctx.k;
  Tensor biased = x;
  if (bias != nullptr) {
    biased = k.Empty(x.shape(), x.dtype());
    k.Copy(x, biased);
    k.AddRowVector(bias->value, biased);
  }
  const Tensor dropped =
      hidden_dropout_ > 0
          ? DropoutAtSite(ctx, prefix_ + site, hidden_dropout_, ctx.shape.StreamMap(x.cols()), biased)
          : biased;
  Tensor out = k.Empty(residual.shape(), residual.dtype());
  k.Copy(residual, out);
  k.Axpy(1.0, dropped, out);
  return out;
}

Tensor TransformerLayer::BiasDropoutAddBackward(const ModuleContext& ctx, const std::string& site,
                                                const Tensor& dy, Parameter* bias) const {
  Kernels& k = ctx.k;
  const Tensor dx =
      hidden_dropout_ > 0
          ? DropoutAtSite(ctx, prefix_ + site, hidden_dropout_, ctx.shape.StreamMap(dy.cols()), dy)
          : dy;
  if (bias != nullptr) {
    AccumulateGrad(k, *bias, false, [&](Tensor& g, double beta) { k.SumRows(dx, beta, g); });
  }
  return dx;
}

Tensor TransformerLayer::ForwardInner(const ModuleContext& ctx, const Tensor& x, Inner* in) const {
  const Tensor ln1 = input_norm_.Forward(ctx, x, &in->norm1);
  RecordStream(ctx, ".input_layernorm.output", ln1);
  const Tensor attn = mla_ ? mla_->Forward(ctx, ln1, !selective_.core_attn, &in->mla)
                           : attention_->Forward(ctx, ln1, !selective_.core_attn, &in->attention);
  if (selective_.layernorm) {
    // The norm's output (the attention's saved input) and statistics go; its input is the
    // layer's, kept.
    in->norm1 = Norm::Stash{};
    in->attention.qkv_in.input = Tensor();
    in->mla.x = Tensor();
  }
  const Tensor x1 = BiasDropoutAdd(ctx, ".self_attn_bda", attn, AttentionBias(), x);
  RecordStream(ctx, ".self_attn_bda.output", x1);
  const Tensor ln2 = pre_mlp_norm_.Forward(ctx, x1, &in->norm2);
  RecordStream(ctx, ".pre_mlp_layernorm.output", ln2);
  const Tensor mlp = mlp_ ? mlp_->Forward(ctx, ln2, &in->mlp) : moe_->Forward(ctx, ln2, &in->moe);
  DropRecomputedMlpSide(in);
  if (selective_.layernorm) {
    // x1 stays (the residual's and the norm's input); ln2, wherever the MLP or the MoE layer
    // keeps it, and the statistics go.
    in->norm2.mean = Tensor();
    in->norm2.rstd = Tensor();
    if (mlp_) {
      in->mlp.fc1_in.input = Tensor();
    } else {
      in->moe.x = Tensor();
      in->moe.shared_fc1_in.input = Tensor();
    }
  }
  const Tensor y = BiasDropoutAdd(ctx, ".mlp_bda", mlp, mlp_ ? mlp_->fc2_bias() : nullptr, x1);
  RecordStream(ctx, ".mlp_bda.output", y);
  return y;
}

void TransformerLayer::DropRecomputedMlpSide(Inner* in) const {
  if (mlp_ && selective_.mlp) {  // the MLP keeps its input (ln2) alone
    in->mlp.fc1_out = Tensor();
    in->mlp.fc2_in = RowParallelLinear::Stash{};
  }
  if (!moe_) return;
  if (selective_.moe) {
    // The MoE layer keeps its input (ln2) alone (Megatron's checkpoint around the layer).
    MoeLayer::Stash kept;
    kept.x = in->moe.x;
    kept.shared_fc1_in = in->moe.shared_fc1_in;
    in->moe = std::move(kept);
    return;
  }
  if (selective_.moe_act) in->moe.act = Tensor();
  if (selective_.shared_experts) {
    in->moe.shared_fc1_out = Tensor();
    in->moe.shared_fc2_in = RowParallelLinear::Stash{};
  }
}

LayerRecompute LayerRecompute::Of(const RunConfig& run, int64_t index, int64_t chunk_layers) {
  LayerRecompute r = Kept(run);
  const RunConfig::RecomputeGroup group = run.GroupOf(index, chunk_layers);
  if (group.recomputed) r.keep = group.first == index ? Keep::kInput : Keep::kNothing;
  return r;
}

LayerRecompute LayerRecompute::Kept(const RunConfig& run) {
  LayerRecompute r;
  r.core_attn = run.Recomputes(RunConfig::RecomputeModule::kCoreAttn);
  r.layernorm = run.Recomputes(RunConfig::RecomputeModule::kLayernorm);
  r.mlp = run.Recomputes(RunConfig::RecomputeModule::kMlp);
  r.moe_act = run.Recomputes(RunConfig::RecomputeModule::kMoeAct);
  r.shared_experts = run.Recomputes(RunConfig::RecomputeModule::kSharedExperts);
  r.moe = run.Recomputes(RunConfig::RecomputeModule::kMoe);
  return r;
}

Tensor TransformerLayer::Forward(const ModuleContext& ctx, const Tensor& x,
                                 LayerRecompute::Keep keep, Stash* stash) const {
  // A recomputed group's later layer does not keep its input (the previous layer's output):
  // the group's backward rebuilds it.
  if (keep != LayerRecompute::Keep::kNothing) stash->input = x;
  Inner inner;
  const Tensor y = ForwardInner(ctx, x, &inner);
  if (keep == LayerRecompute::Keep::kAll) stash->inner = std::move(inner);
  return y;
}

Tensor TransformerLayer::Recompute(const ModuleContext& ctx, const Tensor& x, Stash* stash) const {
  ModuleContext quiet = ctx;
  quiet.records = nullptr;
  stash->input = x;
  Inner inner;
  const Tensor y = ForwardInner(quiet, x, &inner);
  stash->inner = std::move(inner);
  return y;
}

StashPlan TransformerLayer::PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                                      const LayerRecompute& recompute, const StashPlan* moe) {
  const double Rs = static_cast<double>(shape.stream_rows());
  const double h = static_cast<double>(gpt.hidden_size);
  StashPlan plan;
  if (recompute.keep == LayerRecompute::Keep::kNothing) return plan;  // rebuilt in backward
  plan.Add("input", {Rs, h}, dtype);
  if (recompute.keep == LayerRecompute::Keep::kInput) return plan;  // Inner: rebuilt too
  // norm1.input is the layer's input; norm2.input is x1, kept here alone.
  StashPlan inner;
  inner.Add("norm1", Norm::PlanStash(gpt.normalization, Rs, dtype));
  inner.Add("attention", gpt.mla.enabled
                             ? MlaSelfAttention::PlanStash(gpt, shape, dtype, !recompute.core_attn)
                             : SelfAttention::PlanStash(gpt, shape, dtype, !recompute.core_attn));
  inner.Add("norm2.input", {Rs, h}, dtype);
  inner.Add("norm2", Norm::PlanStash(gpt.normalization, Rs, dtype));
  if (moe != nullptr) {
    inner.Add("moe", *moe);
  } else {
    inner.Add("mlp", Mlp::PlanStash(gpt, shape, dtype));
  }
  // What selective recomputation drops (Forward): the norms' outputs (where their consumers
  // keep them) and statistics; the dense MLP's tensors but its input; the MoE layer's
  // activation output, shared expert, or all of it but its input.
  const auto dropped = [&](const std::string& name) {
    const bool norm_output = name == "attention.qkv_in.input" || name == "attention.x" ||
                             name == "mlp.fc1_in.input" || name == "moe.x" ||
                             name == "moe.shared_fc1_in.input";
    const bool norm_stats =
        name.starts_with("norm1.") || (name.starts_with("norm2.") && name != "norm2.input");
    const bool mlp_inner = name == "mlp.fc1_out" || name == "mlp.fc2_in.input";
    const bool moe_inner = name.starts_with("moe.") && name != "moe.x";
    const bool shared = name == "moe.shared_fc1_out" || name == "moe.shared_fc2_in.input";
    return (recompute.layernorm && (norm_output || norm_stats)) ||
           (recompute.mlp && moe == nullptr && mlp_inner) || (recompute.moe && moe_inner) ||
           (recompute.moe_act && name == "moe.act") || (recompute.shared_experts && shared);
  };
  for (const StashTensor& tensor : inner.tensors()) {
    if (!dropped(tensor.name)) plan.Add("inner." + tensor.name, tensor.shape, tensor.dtype);
  }
  return plan;
}

Tensor TransformerLayer::Backward(const ModuleContext& ctx, const Tensor& dy, Stash& stash) const {
  Kernels& k = ctx.k;
  Inner& in = *stash.inner;
  RecordStream(ctx, ".mlp_bda.output_grad", dy);
  const Tensor dmlp =
      BiasDropoutAddBackward(ctx, ".mlp_bda", dy, mlp_ ? mlp_->fc2_bias() : nullptr);
  ModuleContext quiet = ctx;  // recomputation records nothing
  quiet.records = nullptr;
  if (selective_.layernorm) {
    // pre_mlp_layernorm again from x1: its output (kept to the layer's end) and statistics.
    const Tensor ln2 = pre_mlp_norm_.Forward(quiet, in.norm2.input, &in.norm2);
    if (mlp_) {
      in.mlp.fc1_in.input = ln2;
    } else {
      in.moe.x = ln2;
      in.moe.shared_fc1_in.input = ln2;  // the shared expert's input, if the layer has one
    }
  }
  if (mlp_ && selective_.mlp) mlp_->Forward(quiet, in.mlp.fc1_in.input, &in.mlp);
  if (moe_ && selective_.moe) {
    // The whole MoE layer again: router, dispatch (real exchanges), experts, shared expert.
    moe_->Forward(quiet, in.moe.x, &in.moe);
  } else if (moe_) {
    if (selective_.moe_act) moe_->RecomputeActivation(quiet, &in.moe);
    if (selective_.shared_experts) moe_->RecomputeSharedExpert(quiet, &in.moe);
  }
  const Tensor dln2 = mlp_ ? mlp_->Backward(ctx, dmlp, in.mlp) : moe_->Backward(ctx, dmlp, in.moe);
  DropRecomputedMlpSide(&in);  // what the recomputation rebuilt goes with its backward
  RecordStream(ctx, ".pre_mlp_layernorm.output_grad", dln2);
  // x1 feeds both the MLP branch and the residual.
  Tensor dx1 = pre_mlp_norm_.Backward(ctx, dln2, in.norm2);
  k.Axpy(1.0, dy, dx1);
  RecordStream(ctx, ".self_attn_bda.output_grad", dx1);
  const Tensor dattn = BiasDropoutAddBackward(ctx, ".self_attn_bda", dx1, AttentionBias());
  if (selective_.layernorm) {
    // input_layernorm again from the layer's input: the attention's saved input, statistics.
    const Tensor ln1 = input_norm_.Forward(quiet, stash.input, &in.norm1);
    (mla_ ? in.mla.x : in.attention.qkv_in.input) = ln1;
  }
  const Tensor dln1 =
      mla_ ? mla_->Backward(ctx, dattn, in.mla) : attention_->Backward(ctx, dattn, in.attention);
  RecordStream(ctx, ".input_layernorm.output_grad", dln1);
  Tensor dx = input_norm_.Backward(ctx, dln1, in.norm1);
  k.Axpy(1.0, dx1, dx);
  stash.inner.reset();
  return dx;
}

}  // namespace mpusim
