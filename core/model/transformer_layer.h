// Megatron-Core's TransformerLayer (local spec, pre-norm):
//
//   x1 = x  + dropout(linear_proj(attention(input_layernorm(x))) + proj_bias)   self_attn_bda
//   y  = x1 + dropout(linear_fc2(mlp(pre_mlp_layernorm(x1))) + fc2_bias)       mlp_bda
//
// on the residual stream [s_l*b, h] (module.h). Dropout sites are "<prefix>.self_attn_bda"
// and "<prefix>.mlp_bda", full tensors [s, B, h] (core/dropout.h).
// Recomputation ("recompute_granularity"): "full" keeps only the layer's input and reruns
// the layer's forward in backward; "selective" drops core attention's stash (SelfAttention).
// Both give bit-identical gradients: the masks are pure functions of global indices.
#pragma once

#include <optional>
#include <string>

#include "core/model/attention.h"
#include "core/model/layer_norm.h"
#include "core/model/mlp.h"
#include "core/model/moe.h"
#include "core/model/stash_plan.h"
#include "core/config/model_config.h"

namespace mpusim {

class TransformerLayer {
 public:
  // Layer `layer` (0-based; its prefix "decoder.layers.<layer>"): an MoE layer (moe.h) in
  // place of the MLP where gpt.moe.layers says so.
  TransformerLayer(const GptConfig& gpt, int64_t layer, ParameterSet& params, int64_t t,
                   const RunConfig& run, const ExpertPlacement& experts = {});

  struct Inner {
    Norm::Stash norm1;
    SelfAttention::Stash attention;
    Norm::Stash norm2;
    Mlp::Stash mlp;
    MoeLayer::Stash moe;
  };
  struct Stash {
    Tensor input;                // [s_l*b, h]
    std::optional<Inner> inner;  // empty under full recomputation until backward
  };
  // The declared stash (stash_plan.h) on a rank of `shape`, in `dtype` storage, under
  // `recompute`; `moe`: the MoE layer's declared stash (MoeLayer::PlanStash, its rows the
  // router's) in place of the MLP's, null for a dense layer.
  static StashPlan PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                             RunConfig::Recompute recompute, const StashPlan* moe = nullptr);
  Tensor Forward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const;
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
  void RecordStream(const ModuleContext& ctx, const std::string& name, const Tensor& t) const;

  std::string prefix_;
  double hidden_dropout_;
  RunConfig::Recompute recompute_;
  Norm input_norm_;
  SelfAttention attention_;
  Norm pre_mlp_norm_;
  std::optional<Mlp> mlp_;     // a dense layer's
  std::optional<MoeLayer> moe_;  // or an MoE layer's
};

}  // namespace mpusim
