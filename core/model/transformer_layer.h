// Megatron-Core's TransformerLayer (local spec, pre-norm):
//
//   x1 = x  + dropout(linear_proj(attention(input_layernorm(x))) + proj_bias)   self_attn_bda
//   y  = x1 + dropout(linear_fc2(mlp(pre_mlp_layernorm(x1))) + fc2_bias)       mlp_bda
//
// on the residual stream [s_l*b, h] (module.h). Dropout sites are "<prefix>.self_attn_bda"
// and "<prefix>.mlp_bda", full tensors [s, B, h] (core/dropout.h).
// Recomputation (run.recompute_*, Megatron's): under "full" GptModel picks, per model chunk,
// the layers recomputed whole (RunConfig::GroupOf): the first layer of each recomputed group
// keeps only its input, the group's later layers keep nothing, and the backward reruns the
// group's forward from that input (GptModel::BackwardStep); "selective" drops what
// recompute_modules names: core attention's stash (SelfAttention), the norms' outputs and
// statistics (Megatron's CheckpointWithoutOutput around input_layernorm and
// pre_mlp_layernorm), the dense MLP's inner tensors (tensor_parallel.checkpoint around the
// MLP), an MoE layer's experts' activation (experts.py's CheckpointWithoutOutput around the
// activation), its shared expert's tensors (shared_experts.py) or all of it (moe_layer.py's
// checkpoint around the layer), each rebuilt in the backward. All give bit-identical gradients: the
// masks are pure functions of global indices.
#pragma once

#include <optional>
#include <string>

#include "core/config/model_config.h"
#include "core/model/attention.h"
#include "core/model/layer_norm.h"
#include "core/model/mla_attention.h"
#include "core/model/mlp.h"
#include "core/model/moe.h"
#include "core/model/stash_plan.h"

namespace mpusim {

// What one layer keeps from its forward to its backward.
struct LayerRecompute {
  // Full recomputation: kAll, the layer is not recomputed; kInput, the first layer of a
  // recomputed group (it keeps its input); kNothing, a later layer of the group.
  enum class Keep : uint8_t { kAll, kInput, kNothing };
  Keep keep = Keep::kAll;
  bool core_attn = false;  // selective "core_attn": the attention's core stash
  // Selective "layernorm": both norms' outputs and statistics (their inputs are kept anyway:
  // the layer's input, x1), recomputed before the MLP's and the attention's backward.
  bool layernorm = false;
  // Selective "mlp" (a dense layer's; Megatron ignores it on an MoE layer): the MLP keeps
  // only its input and reruns its forward before its backward.
  bool mlp = false;
  // Selective, on an MoE layer: "moe_act" the experts' activation output (rebuilt from their
  // fc1 output), "shared_experts" the shared expert's tensors, "moe" the whole layer's (it
  // keeps its input alone); each rebuilt before the MoE layer's backward, freed after it.
  bool moe_act = false, shared_experts = false, moe = false;
  // Layer `index` (0-based) of a model chunk of `chunk_layers` layers under `run`.
  static LayerRecompute Of(const RunConfig& run, int64_t index, int64_t chunk_layers);
  // A layer that full recomputation leaves alone (Keep::kAll), under `run`'s selective keys.
  static LayerRecompute Kept(const RunConfig& run);
};

class TransformerLayer {
 public:
  // Layer `layer` (0-based; its prefix "decoder.layers.<layer>", or `prefix` when given: a
  // multi-token prediction depth's "mtp.layers.<k>.transformer_layer", built as layer L - 1):
  // an MoE layer (moe.h) in place of the MLP where gpt.moe.layers says so. `number`: the
  // layer's own number from 0 where it is not `layer` (depth k's is k: Megatron numbers an MTP
  // layer from 1 within the block), which decides its sliding window.
  TransformerLayer(const GptConfig& gpt, int64_t layer, ParameterSet& params, int64_t t,
                   const RunConfig& run, const ExpertPlacement& experts = {},
                   std::string prefix = {}, std::optional<int64_t> number = {});

  struct Inner {
    Norm::Stash norm1;
    SelfAttention::Stash attention;
    MlaSelfAttention::Stash mla;  // multi_latent_attention's, in place of attention
    Norm::Stash norm2;
    Mlp::Stash mlp;
    MoeLayer::Stash moe;
  };
  struct Stash {
    Tensor input;                // [s_l*b, h] (undefined: a recomputed group's later layer)
    std::optional<Inner> inner;  // empty under full recomputation until backward
  };
  // The declared stash (stash_plan.h) on a rank of `shape`, in `dtype` storage, kept as
  // `recompute` says; `moe`: the MoE layer's declared stash (MoeLayer::PlanStash, its rows the
  // router's) in place of the MLP's, null for a dense layer.
  static StashPlan PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                             const LayerRecompute& recompute, const StashPlan* moe = nullptr);
  // `keep`: what full recomputation keeps of this layer (kAll without it).
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, LayerRecompute::Keep keep,
                 Stash* stash) const;
  // Full recomputation: the forward again from `x` (recording nothing), refilling `stash`
  // (its input and Inner) for the backward; returns the layer's output.
  Tensor Recompute(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
  // Expects stash.inner (GptModel::BackwardStep recomputes a group before its backward).
  Tensor Backward(const ModuleContext& ctx, const Tensor& dy, Stash& stash) const;
  // The MoE layer, or null for a dense one.
  const MoeLayer* moe() const { return moe_ ? &*moe_ : nullptr; }

 private:
  Tensor ForwardInner(const ModuleContext& ctx, const Tensor& x, Inner* inner) const;
  // residual + dropout(x + bias) at `site`; bias may be null.
  Tensor BiasDropoutAdd(const ModuleContext& ctx, const std::string& site, const Tensor& x,
                        const Parameter* bias, const Tensor& residual) const;
  // d(x) of BiasDropoutAdd for output gradient dy; accumulates the bias gradient.
  Tensor BiasDropoutAddBackward(const ModuleContext& ctx, const std::string& site, const Tensor& dy,
                                Parameter* bias) const;
  Parameter* AttentionBias() const { return mla_ ? mla_->proj_bias() : attention_->proj_bias(); }
  void RecordStream(const ModuleContext& ctx, const std::string& name, const Tensor& t) const;
  // Frees what selective recomputation rebuilds on the MLP side ("mlp", "moe", "moe_act",
  // "shared_experts"): after the forward, and again after the backward that used it.
  void DropRecomputedMlpSide(Inner* in) const;

  std::string prefix_;
  double hidden_dropout_;
  LayerRecompute selective_;  // what selective recomputation drops (Keep::kAll)
  Norm input_norm_;
  // The layer's self-attention: SelfAttention, or MLASelfAttention with
  // multi_latent_attention.
  std::optional<SelfAttention> attention_;
  std::optional<MlaSelfAttention> mla_;
  Norm pre_mlp_norm_;
  std::optional<Mlp> mlp_;     // a dense layer's
  std::optional<MoeLayer> moe_;  // or an MoE layer's
};

}  // namespace mpusim
