// The GPT model's account of itself (see gpt_model.h and model.h): its description for
// `mpusim run`, its sharding map and `mpusim explain`'s text, and its memory plan.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/model/activation_plan.h"
#include "core/model/gpt_model.h"
#include "core/model/mla_attention.h"
#include "core/model/moe.h"
#include "core/model/optimizer_plan.h"

namespace mpusim {

namespace {

// The mixture-of-experts line of Describe.
std::string DescribeMoe(const GptConfig& gpt) {
  const MoeConfig& moe = gpt.moe;
  std::vector<int64_t> layers;
  for (size_t i = 0; i < moe.layers.size(); ++i) {
    if (moe.layers[i]) layers.push_back(static_cast<int64_t>(i));
  }
  std::vector<std::string> losses;
  for (const auto& [type, name] : {std::pair{MoeLoadBalancing::kAuxLoss, ""},
                                   std::pair{MoeLoadBalancing::kSeqAuxLoss, "sequence "},
                                   std::pair{MoeLoadBalancing::kGlobalAuxLoss, "global "}}) {
    if (moe.AuxLossCoeff(type) > 0) {
      losses.push_back(fmt::format("{}load-balancing loss coeff {}", name, moe.AuxLossCoeff(type)));
    }
  }
  const std::string balance =
      losses.empty() ? "no load-balancing loss" : fmt::format("{}", fmt::join(losses, ", "));
  return fmt::format(
      "  mixture of experts on layers {}: {} experts of ffn {}, top-{} {} softmax, {}, {}{}{}, "
      "{} dispatcher\n",
      fmt::join(layers, " "), moe.num_experts, moe.ffn_hidden_size, moe.router_topk,
      moe.score_function == MoeScoreFunction::kSigmoid ? "of the sigmoid scores, not a"
      : moe.router_pre_softmax                         ? "before the"
                                                       : "after the",
      moe.expert_capacity_factor
          ? fmt::format("capacity factor {} (drop by {})", *moe.expert_capacity_factor,
                        moe.token_drop_policy == MoeDropPolicy::kProbs ? "probs" : "position")
          : std::string("dropless"),
      balance, moe.z_loss_coeff ? fmt::format(", z-loss coeff {}", *moe.z_loss_coeff) : "",
      moe.shared_expert_intermediate_size
          ? fmt::format(", shared expert of ffn {}", *moe.shared_expert_intermediate_size)
          : "",
      moe.token_dispatcher == MoeDispatcher::kAllGather ? "allgather" : "alltoall");
}

}  // namespace

std::string GptModel::Describe() const {
  const GptConfig& gpt = gpt_;
  const std::string heads =
      gpt.mla.enabled ? fmt::format("{} multi-latent attention heads", gpt.num_attention_heads)
                      : fmt::format("{} heads of {} channels in {} query groups",
                                    gpt.num_attention_heads, gpt.kv_channels, gpt.num_query_groups);
  std::string out = fmt::format(
      "model: GPT (Megatron-Core GPTModel, local layer spec), {} layers, hidden_size {}, {}, "
      "ffn_hidden_size {} ({})\n",
      gpt.num_layers, gpt.hidden_size, heads, gpt.ffn_hidden_size, ActivationName(gpt.activation));
  const bool partial_rope =
      gpt.position_embedding_type == PositionEmbedding::kRope && gpt.RotaryDim() < gpt.kv_channels;
  out += fmt::format(
      "  {}{}, {} position embeddings{}, bias {}{}, dropout hidden {} attention {} ({}), "
      "embeddings {}\n",
      NormalizationName(gpt.normalization),
      !gpt.qk_layernorm     ? ""
      : !gpt.mla.enabled    ? " (and on each query and key head)"
      : gpt.mla.q_lora_rank ? " (and on the query and key-value latents)"
                            : " (and on the key-value latent)",
      PositionEmbeddingName(gpt.position_embedding_type),
      partial_rope ? fmt::format(" on {} of {} channels", gpt.RotaryDim(), gpt.kv_channels) : "",
      gpt.add_bias_linear, !gpt.add_bias_linear && gpt.add_qkv_bias ? " (linear_qkv's alone)" : "",
      gpt.hidden_dropout, gpt.attention_dropout,
      gpt.dropout_mode == DropoutMode::kRngTracker
          ? "masks from each rank's RNG tracker streams, as Megatron draws them"
          : "masks drawn per global element",
      gpt.share_embeddings_and_output_weights ? "shared with the output layer"
                                              : "separate from the output layer");
  out += fmt::format("vocab_size {}, padded_vocab_size {}, label_smoothing {}\n", gpt.vocab_size,
                     padded_vocab_, gpt.label_smoothing);
  if (gpt.moe.enabled()) out += DescribeMoe(gpt);
  if (gpt.mtp_num_layers > 0) {
    out += fmt::format(
        "  multi-token prediction: {} depth{} after the final norm on the last stage, each the "
        "embedding of the ids rolled once more, enorm, hnorm, eh_proj and a transformer layer{}, "
        "through the shared output layer; their losses times mtp_loss_scaling_factor {} / {} "
        "join the gradient, not the reported loss\n",
        gpt.mtp_num_layers, gpt.mtp_num_layers == 1 ? "" : "s",
        gpt.moe.enabled() && gpt.moe.layers.back()
            ? fmt::format(" (an MoE layer like layer {}, its own router and experts, numbered {}+ "
                          "in the expert lines)",
                          gpt.num_layers - 1, gpt.num_layers)
            : std::string(),
        gpt.mtp_loss_scaling_factor, gpt.mtp_num_layers);
  }
  return out;
}

std::string GptModel::ParameterSplitNote() const {
  const int64_t pp = topology_->sizes().pp;
  const int64_t ep = topology_->sizes().ep;
  const int64_t etp = topology_->sizes().etp;
  return fmt::format("tp {} splits the weight matrices, norms and row-parallel biases stay "
                     "whole{}{}{}",
                     topology_->sizes().tp,
                     ep > 1 ? fmt::format("; ep {} splits the experts", ep) : std::string(),
                     etp == topology_->sizes().tp ? std::string()
                     : etp == 1 ? std::string("; each expert whole (etp 1)")
                                : fmt::format("; etp {} splits each expert's weights", etp),
                     pp > 1 ? fmt::format("; pp {} splits the layers, the first stage holds the "
                                          "embedding",
                                          pp)
                            : std::string());
}

bool GptModel::MasksDependOnLayout() const {
  return gpt_.dropout_mode == DropoutMode::kRngTracker &&
         (gpt_.hidden_dropout > 0 || gpt_.attention_dropout > 0);
}

std::vector<const Parameter*> GptModel::HeldParameters() const {
  std::vector<const Parameter*> out;
  for (const auto& p : params_.all()) {
    if (p->value.defined()) out.push_back(p.get());
  }
  return out;
}

std::vector<HeldParameterShape> GptModel::HeldParameterShapes() const {
  std::vector<HeldParameterShape> out;
  for (const auto& p : params_.all()) {
    out.push_back({p->name, LocalShape(p->shard, p->full_shape), true, p->expert});
  }
  return out;
}

// Every stage's model, built from the same config (this one's when pp = 1), and under expert
// parallelism every ep rank's, for its experts.
std::vector<ParameterPlacement> GptModel::ShardingMap() const {
  std::vector<ParameterPlacement> mapped;
  const int64_t pp = topology_->sizes().pp;
  const int64_t ep = topology_->sizes().ep;
  for (int64_t built_for = 0; built_for < pp * ep; ++built_for) {
    const int64_t stage = built_for / ep, ep_rank = built_for % ep;
    RankCoordinates coords = coords_;
    coords.pp = stage;
    coords.ep = ep_rank;
    StatusOr<std::unique_ptr<GptModel>> built = Build(config_, *topology_, coords);
    if (!built.ok()) throw std::logic_error("GptModel::ShardingMap: " + built.status().Message());
    const GptModel& model = **built;
    const std::vector<GptChunk>& chunks = model.chunks();
    for (const auto& p : model.params_.all()) {
      const bool expert = ExpertOf(p->name).has_value();
      if (!expert && ep_rank > 0) continue;
      ParameterPlacement row;
      // The chunk holding it: its layer's, the embedding's first, the head's last.
      constexpr std::string_view kLayers = "decoder.layers.";
      if (p->name.starts_with(kLayers)) {
        const int64_t layer = std::stoll(p->name.substr(kLayers.size()));
        for (size_t c = 0; c < chunks.size(); ++c) {
          if (std::find(chunks[c].layers.begin(), chunks[c].layers.end(), layer) !=
              chunks[c].layers.end()) {
            row.chunk = static_cast<int64_t>(c);
          }
        }
      } else if (!p->name.starts_with("embedding.") || p->shared) {
        row.chunk = static_cast<int64_t>(chunks.size()) - 1;
      }
      const Placement* etp = p->shard.Find(ShardAxis::kEtp);
      const Placement* split = etp != nullptr ? etp : p->shard.Find(ShardAxis::kTp);
      row.name = p->name;
      row.full_shape = p->full_shape;
      row.tp_dim = split != nullptr ? split->dim : -1;
      row.tp_stride = split != nullptr ? split->stride : 1;
      row.over_etp = etp != nullptr;
      row.ep_rank = expert && ep > 1 ? ep_rank : -1;
      row.pp_rank = stage;
      if (p->shared) {
        row.note = fmt::format(
            "the last stage's copy of the word embeddings ({}), gradient "
            "all-reduced over embd",
            model.gpt_.share_embeddings_and_output_weights
                ? "tied to the output layer"
                : "for the multi-token prediction depths' shifted ids");
      }
      // Another ep rank's experts go after the same layer's experts listed so far.
      auto at = mapped.end();
      if (ep_rank > 0) {
        const std::string experts = p->name.substr(0, p->name.find(".mlp.experts.")) +
                                    ".mlp.experts.";
        for (auto it = mapped.begin(); it != mapped.end(); ++it) {
          if (it->pp_rank == stage && it->name.starts_with(experts)) at = it + 1;
        }
      }
      mapped.insert(at, std::move(row));
    }
  }
  return mapped;
}

void GptModel::Explain(std::ostream& out) const {
  const int64_t pp = topology_->sizes().pp;
  for (int64_t stage = 0; stage < pp; ++stage) {
    RankCoordinates coords = coords_;
    coords.pp = stage;
    StatusOr<std::unique_ptr<GptModel>> built = Build(config_, *topology_, coords);
    if (!built.ok()) throw std::logic_error("GptModel::Explain: " + built.status().Message());
    (*built)->ExplainStage(out);
  }
}

namespace {

// The MoE router's DeepSeek-style choices in words (empty: Megatron's default router).
std::string MoeRoutingNote(const MoeConfig& moe) {
  std::vector<std::string> parts;
  if (moe.score_function == MoeScoreFunction::kSigmoid) {
    parts.push_back(
        fmt::format("sigmoid scores (moe_router_score_function){}",
                    moe.router_topk > 1 ? ", the chosen ones normalised to sum 1" : ""));
  }
  if (moe.score_function == MoeScoreFunction::kSqrtSoftplus) {
    parts.push_back(
        fmt::format("sqrt(softplus) scores (moe_router_score_function \"sqrtsoftplus\"){}",
                    moe.router_topk > 1 ? ", the chosen ones normalised to sum 1" : ""));
  }
  if (moe.group_limited()) {
    parts.push_back(
        fmt::format("each token's top {} from {} of {} expert groups "
                    "(moe_router_group_topk, moe_router_num_groups)",
                    moe.router_topk, *moe.group_topk, *moe.num_groups));
  }
  if (moe.topk_scaling_factor) {
    parts.push_back(fmt::format("probabilities times {} (moe_router_topk_scaling_factor)",
                                *moe.topk_scaling_factor));
  }
  if (moe.enable_expert_bias) {
    parts.push_back(
        fmt::format("a float32 expert bias added to the scores for choosing only, "
                    "moved by {} after each optimizer step against the token "
                    "counts summed over tp x dp x cp "
                    "(moe_router_enable_expert_bias)",
                    moe.bias_update_rate));
  }
  if (const double coeff = moe.AuxLossCoeff(MoeLoadBalancing::kGlobalAuxLoss); coeff > 0) {
    parts.push_back(
        fmt::format("the global load-balancing loss (coeff {}; \"global_aux_loss\"): each "
                    "micro-batch's top-k counts all-reduced over tp x dp x cp in its forward "
                    "and averaged over the step's micro-batches so far",
                    coeff));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

// The attention in words: multi-latent attention's latents, heads and rope; gpt-oss's sliding
// window and the layers it slides on, the sinks (empty: plain causal attention everywhere).
std::string AttentionNote(const GptConfig& gpt) {
  std::vector<std::string> parts;
  if (gpt.mla.enabled) {
    const MlaConfig& mla = gpt.mla;
    parts.push_back(fmt::format(
        "multi-latent attention (MLASelfAttention, local spec): the query {}, the keys and "
        "values from a latent of kv_lora_rank {} and {} rope channels shared by the heads "
        "(linear_kv_down_proj, then {}linear_kv_up_proj); heads of {} + {} query/key channels "
        "and {} value channels; rope_type {}{}, softmax scale {:.6g}; the down projections' "
        "outputs all-gathered over tp, k_pe's gradient summed over tp (Megatron-LM issue 1699)",
        mla.q_lora_rank ? fmt::format("from a latent of q_lora_rank {} (linear_q_down_proj, then "
                                      "{}linear_q_up_proj)",
                                      *mla.q_lora_rank, gpt.qk_layernorm ? "q_layernorm, " : "")
                        : std::string("from linear_q_proj (q_lora_rank null)"),
        mla.kv_lora_rank, mla.qk_pos_emb_head_dim, gpt.qk_layernorm ? "kv_layernorm, " : "",
        mla.qk_head_dim, mla.qk_pos_emb_head_dim, mla.v_head_dim, MlaRopeTypeName(mla.rope_type),
        mla.rope_type == MlaRopeType::kYarn
            ? fmt::format(" (scaling factor {}, cos/sin times mscale {:.6g})",
                          mla.rotary_scaling_factor, MlaRopeOf(gpt).mscale)
            : std::string(),
        MlaSoftmaxScaleOf(gpt)));
  }
  if (gpt.HasSlidingWindow()) {
    std::vector<int64_t> sliding;
    for (int64_t i = 0; i < gpt.num_layers; ++i) {
      if (gpt.AttentionWindow(i) >= 0) sliding.push_back(i);
    }
    const int64_t w = (*gpt.window_size)[0];
    std::string layers = "every layer";
    if (static_cast<int64_t>(sliding.size()) < gpt.num_layers) {
      constexpr size_t kListed = 12;
      const std::vector<int64_t> head(
          sliding.begin(),
          sliding.begin() + static_cast<std::ptrdiff_t>(std::min(sliding.size(), kListed)));
      layers = fmt::format("{} of {} layers ({}{}; window_attn_skip_freq)", sliding.size(),
                           gpt.num_layers, fmt::join(head, ", "),
                           sliding.size() > kListed ? ", ..." : "");
    }
    const bool all = static_cast<int64_t>(sliding.size()) == gpt.num_layers;
    parts.push_back(
        fmt::format("a sliding window (window_size [{}, 0]): each query sees itself "
                    "and the {} keys before it, on {}{}",
                    w, w, layers,
                    all ? ""
                        : "; the others attend causally to every key before "
                          "them"));
  }
  if (gpt.softmax_type == SoftmaxType::kOffByOne) {
    parts.push_back(
        "an attention sink (softmax_type \"off-by-one\"): a logit 0 in each "
        "softmax's denominator");
  } else if (gpt.softmax_type == SoftmaxType::kLearnable) {
    parts.push_back(
        "attention sinks (softmax_type \"learnable\"): a logit per head "
        "(core_attention.softmax_offset, split over tp by heads) in each softmax's "
        "denominator");
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

// A gated activation's glu options in words (empty: none set).
std::string GluNote(const GptConfig& gpt) {
  if (!IsGated(gpt.activation)) return {};
  const GluOptions glu = gpt.Glu();
  if (!glu.clamped && glu.linear_offset == 0.0) return {};
  std::string gate = "act(g)", linear = "l";
  if (glu.clamped) {
    gate = fmt::format("act(min(g, {}))", glu.clamp_value);
    linear = fmt::format("clamp(l, -{}, {})", glu.clamp_value, glu.clamp_value);
  }
  if (glu.linear_offset != 0.0) linear = fmt::format("({} + {})", linear, glu.linear_offset);
  return fmt::format(
      "{} of fc1's gate half g and linear half l: {} * {} "
      "(activation_func_clamp_value, glu_linear_offset)",
      ActivationName(gpt.activation), gate, linear);
}

}  // namespace

// One pipeline stage's parameters (the whole model when pp = 1).
void GptModel::ExplainStage(std::ostream& out) const {
  const GptConfig& gpt = gpt_;
  const int64_t t = topology_->sizes().tp;
  const int64_t pp = topology_->sizes().pp;
  const int64_t stage = coords_.pp;
  if (stage == 0) {
    out << fmt::format(
        "GPT model (Megatron-Core GPTModel, local layer spec), "
        "tensor_model_parallel_size {}, sequence_parallel {}: a split parameter "
        "is cut into {} slices and rank r of a tp group holds slice r\n",
        t, shape_.sequence_parallel, t);
    if (config_.parallelize_plan) {
      out << "parallelize_plan: Megatron's own plan for this layout (each Colwise module's "
             "weight Shard(0), each Rowwise one's Shard(1), the word embeddings' Shard(0): "
             "the splits below)\n";
    }
    if (shape_.cp > 1) {
      // Which sequence positions each cp rank's tokens are (module.h StreamShape::Position).
      const int64_t c = shape_.s / (2 * shape_.cp);
      out << fmt::format(
          "context_parallel_size {} (cp_comm_type \"{}\"): the {} positions in {} chunks of {}; "
          "cp rank r holds chunks r and {} - r, and every parameter whole (its gradient "
          "reduced over dp x cp)\n",
          shape_.cp, CpCommTypeName(gpt.cp_comm_type), shape_.s, 2 * shape_.cp, c,
          2 * shape_.cp - 1);
      const std::vector<int64_t>& hcp = config_.parallel.hierarchical_context_parallel_sizes;
      StreamShape sh = shape_;
      // Past 64 cp ranks the first three and the last are shown: the lines follow one
      // pattern, and a listing of every cp rank would grow with cp (up to 2^29).
      constexpr int64_t kListedCp = 64;
      for (sh.cp_rank = 0; sh.cp_rank < sh.cp; ++sh.cp_rank) {
        if (sh.cp > kListedCp && sh.cp_rank == 3) {
          out << fmt::format("  ... cp ranks 3 to {} likewise\n", sh.cp - 2);
          sh.cp_rank = sh.cp - 1;
        }
        std::string how;
        switch (gpt.cp_comm_type) {
          case CpCommType::kAllGather:
            how = fmt::format("attention all-gathers the keys and values of the other {} chunks",
                              2 * sh.cp - 2);
            break;
          case CpCommType::kP2p:
            how = fmt::format("the ring brings it the other {} ranks' keys and values, one "
                              "step each",
                              sh.cp - 1);
            break;
          case CpCommType::kA2a:
            how = fmt::format("an all-to-all gives it every position of head block {} of {} "
                              "(its tp rank's heads cut in {})",
                              sh.cp_rank, sh.cp, sh.cp);
            break;
          case CpCommType::kA2aP2p: {
            const int64_t a = hcp.size() == 2 ? hcp[0] : 1;
            const int64_t l1 = sh.cp_rank / a, cs = sh.s / (2 * (sh.cp / a));
            const int64_t second = 2 * (sh.cp / a) - 1 - l1;
            const int64_t others = sh.cp / a - 1;
            how = fmt::format("an all-to-all over its hcp_L0 group (cp ranks {}-{}) gives it "
                              "positions {}-{} and {}-{} of head block {} of {}, and the ring "
                              "over hcp_L1 brings {} keys and values",
                              l1 * a, l1 * a + a - 1, l1 * cs, l1 * cs + cs - 1, second * cs,
                              second * cs + cs - 1, sh.cp_rank % a, a,
                              others == 0   ? std::string("no other group's")
                              : others == 1 ? std::string("the other group's")
                                            : fmt::format("the other {} groups'", others));
            break;
          }
        }
        out << fmt::format("  cp rank {}: positions {}-{} and {}-{}; {}\n", sh.cp_rank,
                           sh.Position(0), sh.Position(c - 1), sh.Position(c),
                           sh.Position(2 * c - 1), how);
      }
    }
    // What recomputation keeps (transformer_layer.h): Megatron's meaning of the run's keys.
    if (run_.recompute == RunConfig::Recompute::kFull) {
      const int64_t n = run_.recompute_num_layers.value_or(0);
      out << fmt::format(
          "recompute {}: {}; the backward reruns their forward (same dropout masks, same "
          "values)\n",
          RecomputeSummary(run_),
          run_.recompute_method == RunConfig::RecomputeMethod::kUniform
              ? fmt::format("each model chunk's layers in groups of {} (the last one cut at "
                            "the chunk's end), a group keeping only its first layer's input",
                            n)
              : fmt::format("the first {} layers of each model chunk keep only their input, "
                            "the others every activation",
                            n));
    } else if (run_.recompute == RunConfig::Recompute::kSelective) {
      out << fmt::format(
          "recompute {}: each layer drops what those modules keep for its "
          "backward and reruns their forward there (same values)\n",
          RecomputeSummary(run_));
    }
  }
  if (stage == 0) {
    if (const std::string attention = AttentionNote(gpt); !attention.empty()) {
      out << "attention: " << attention << '\n';
    }
    if (const std::string glu = GluNote(gpt); !glu.empty()) out << "activation: " << glu << '\n';
  }
  if (stage == 0 && gpt.moe.enabled()) {
    const DerivedSizes& sizes = topology_->sizes();
    if (!sizes.experts_apart()) {
      out << fmt::format(
          "mixture of experts, expert_model_parallel_size 1: every rank holds all {} experts "
          "of each MoE layer, each expert split over tp as the dense MLP (expert tensor "
          "parallel size {}); the router sees this rank's own tokens{}, the dispatcher "
          "gathers the tp ranks' tokens, each rank computes its slice of every expert on them "
          "and a reduce-scatter returns the sums; expert gradients reduce over dp{} as the "
          "dense ones\n",
          gpt.moe.num_experts, t, shape_.sequence_parallel ? " (its sequence shard)" : "",
          shape_.cp > 1 ? " x cp" : "");
    } else {
      const int64_t per = gpt.moe.num_experts / sizes.ep;
      const bool a2a = gpt.moe.token_dispatcher == MoeDispatcher::kAllToAll;
      const std::string held =
          sizes.ep > 1 ? fmt::format("ep rank r holds experts [{} r, {} (r + 1)) of each MoE layer",
                                     per, per)
                       : fmt::format("every rank holds all {} experts of each MoE layer", per);
      const std::string split =
          sizes.etp > 1 ? fmt::format("each split over expt_tp ({} ranks{})", sizes.etp,
                                      sizes.etp == t ? ", the tp group" : "")
                        : std::string("each whole (expert_tensor_parallel_size 1)");
      const std::string dispatch =
          a2a ? fmt::format(
                    "the alltoall dispatcher {}{}each rank computes its experts' slices on them, "
                    "and {} return each rank its rows' results",
                    sizes.ep > 1 ? "sends each ep rank the rows routed to its experts (an "
                                   "uneven all-to-all over ep), "
                                 : "",
                    sizes.etp > 1 ? "gathers the rows of the expt_tp ranks over expt_tp, " : "",
                    sizes.etp > 1 && sizes.ep > 1 ? "a reduce-scatter over expt_tp and the "
                                                    "all-to-all back"
                    : sizes.etp > 1               ? "a reduce-scatter over expt_tp"
                                                  : "the all-to-all back")
              : sizes.etp * sizes.ep > 1
                  ? fmt::format("the allgather dispatcher all-gathers the tokens of its tp_ep "
                                "group (etp {} x ep {} ranks), each rank computes its experts' "
                                "slices on them and a reduce-scatter over tp_ep returns each "
                                "rank its tokens' sums",
                                sizes.etp, sizes.ep)
                  : std::string("each rank computes the experts on its own tokens");
      out << fmt::format(
          "mixture of experts, expert_model_parallel_size {}, expert_tensor_parallel_size {}: "
          "{}, {}; the router sees this rank's own tokens{}, {}; expert gradients reduce over "
          "expt_dp ({} rank{}), the dense ones over dp{}\n",
          sizes.ep, sizes.etp, held, split,
          shape_.sequence_parallel ? " (its sequence shard)" : "", dispatch, sizes.edp,
          sizes.edp == 1 ? "" : "s", shape_.cp > 1 ? " x cp" : "");
      const Topology& topo = *topology_;
      for (int64_t r = 0; r < std::min<int64_t>(topo.world_size(), 64); ++r) {
        const RankCoordinates c = topo.Coordinates(r);
        if (sizes.ep == 1 || c.pp != 0 || c.etp != 0) continue;
        out << fmt::format("  rank {}: ep rank {}, experts {}-{}\n", r, c.ep, c.ep * per,
                           c.ep * per + per - 1);
      }
    }
    const std::string routing = MoeRoutingNote(gpt.moe);
    if (!routing.empty()) out << "  the router: " << routing << '\n';
  }
  if (pp > 1) {
    std::vector<std::string> chunks;
    for (const GptChunk& chunk : chunks_) {
      std::vector<std::string> parts;
      if (chunk.pre_process) parts.push_back("embedding");
      if (!chunk.layers.empty()) {
        parts.push_back(chunk.layers.size() == 1
                            ? fmt::format("layer {}", chunk.layers.front())
                            : fmt::format("layers {}-{}", chunk.layers.front(),
                                          chunk.layers.back()));
      }
      if (chunk.post_process && gpt.mtp_num_layers > 0) {
        parts.push_back(fmt::format("final norm, {} MTP depth{}, output layer, loss",
                                    gpt.mtp_num_layers, gpt.mtp_num_layers == 1 ? "" : "s"));
      } else if (chunk.post_process) {
        parts.push_back("final norm, output layer, loss");
      }
      // An empty stage of an uneven split (Megatron's layout allows one).
      if (parts.empty()) parts.push_back("no layer: passes its input on");
      chunks.push_back(fmt::format("[{}]", fmt::join(parts, ", ")));
    }
    out << fmt::format("pipeline stage {} of {}: chunks {}\n", stage, pp, fmt::join(chunks, " "));
  }
  const int64_t groups_local = gpt.num_query_groups / t;
  const int64_t per_group = gpt.num_attention_heads / gpt.num_query_groups;
  for (const auto& p : params_.all()) {
    const Shape local = LocalShape(p->shard, p->full_shape);
    std::string how = ExpertOf(p->name) && topology_->sizes().etp == 1
                          ? "whole (expert_tensor_parallel_size 1)"
                          : "replicated";
    const Placement* split = p->shard.Find(ShardAxis::kTp);
    const Placement* etp = p->shard.Find(ShardAxis::kEtp);
    if (etp != nullptr) {
      how = fmt::format("split over expt_tp on dim {}{}: {} per rank", etp->dim,
                        etp->stride > 1 ? fmt::format(" with stride {}", etp->stride) : "",
                        ShapeString(local));
    } else if (split != nullptr) {
      how = fmt::format("split on dim {}{}: {} per rank", split->dim,
                        split->stride > 1 ? fmt::format(" with stride {}", split->stride) : "",
                        ShapeString(local));
    }
    std::string note;
    if (p->name.find("linear_qkv") != std::string::npos) {
      note = fmt::format("; per rank {} query group{} of ({} query head{}, 1 key, 1 value) x {} "
                         "channels",
                         groups_local, groups_local == 1 ? "" : "s", per_group,
                         per_group == 1 ? "" : "s", gpt.kv_channels);
    } else if (split != nullptr && split->stride == 2) {
      note = "; per rank its gate rows, then the same up rows (SwiGLU)";
    } else if (p->name == "embedding.word_embeddings.weight" && t > 1) {
      note = fmt::format("; rank r holds vocabulary rows [{} r, {} (r + 1))", local[0], local[0]);
    }
    if (p->allreduce_grad_over_tp) {
      // MLA's q_layernorm normalises the latent (each rank its sequence shard under sp).
      note += !gpt.mla.enabled && (p->name.find(".q_layernorm.") != std::string::npos ||
                                   p->name.find(".k_layernorm.") != std::string::npos)
                  ? "; gradient all-reduced over tp (each rank normalised its own heads)"
                  : "; gradient all-reduced over tp (sequence parallel)";
    }
    if (p->embedding_group) {
      note += fmt::format(
          "; {}: the first and the last stage each hold it, gradient "
          "all-reduced over embd",
          gpt.share_embeddings_and_output_weights
              ? "tied"
              : "the multi-token prediction depths embed with it");
    }
    out << fmt::format("  {} {} {}{}\n", p->name, ShapeString(p->full_shape), how, note);
  }
  if (gpt.share_embeddings_and_output_weights && stage == pp - 1) {
    out << "  output_layer uses embedding.word_embeddings.weight (shared)\n";
  }
}

StashPlan GptModel::PlanStash(const GptConfig& gpt, const StreamShape& shape, DType dtype,
                              const GptChunk& chunk, const std::vector<StashPlan>& layers,
                              const StashPlan* mtp_layer, bool mtp_checkpointed) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  const double R = d(shape.s_cp() * shape.b), Rs = d(shape.stream_rows());
  const double h = d(gpt.hidden_size);
  StashPlan plan;
  if (chunk.pre_process || chunk.post_process) {
    for (const char* ids : {"batch.tokens", "batch.labels", "batch.positions"}) {
      plan.Add(ids, {d(shape.s_cp()), d(shape.b)}, DType::kInt64);
    }
  }
  // Without dropout the embedding's output is the first layer's input.
  if (chunk.pre_process && gpt.hidden_dropout > 0) plan.Add("embedding_in", {Rs, h}, dtype);
  for (size_t i = 0; i < layers.size(); ++i) plan.Add(fmt::format("layers.{}", i), layers[i]);
  if (chunk.post_process) {
    // final_norm.input: the last layer's output (or the chunk's input); output_layer.input:
    // the final norm's output.
    plan.Add("final_norm.input", {Rs, h}, dtype);
    plan.Add("final_norm", Norm::PlanStash(gpt.normalization, Rs, dtype));
    plan.Add("output_layer.input", {Rs, h}, dtype);
    // Multi-token prediction's depths (MtpStash): hnorm.input is the previous depth's hidden
    // state (the final norm's output first), the layer's input eh_proj's gathered output.
    if (gpt.mtp_num_layers > 0 && mtp_layer == nullptr && !mtp_checkpointed) {
      throw std::logic_error(
          "GptModel::PlanStash: multi-token prediction without the declared "
          "stash of its transformer layer");
    }
    for (int64_t k = 0; k < gpt.mtp_num_layers; ++k) {
      const std::string depth = fmt::format("mtp.{}.", k);
      for (const char* ids : {"batch.tokens", "batch.labels"}) {
        plan.Add(depth + ids, {d(shape.s_cp()), d(shape.b)}, DType::kInt64);
      }
      plan.Add(depth + "enorm.input", {Rs, h}, dtype);  // the embedding (after its dropout)
      if (mtp_checkpointed) {
        // The checkpoint's other input is the previous depth's output (its output_layer's
        // input); the depth's output is its output layer's.
        plan.Add(depth + "output_layer.input", {Rs, h}, dtype);
        plan.Add(depth + "loss.logits", {R, d(gpt.PaddedVocabSize(shape.t)) / d(shape.t)}, dtype);
        plan.Add(depth + "loss.row_max", {R}, ComputeDType(dtype));
        plan.Add(depth + "loss.sum_exp", {R}, ComputeDType(dtype));
        continue;
      }
      plan.Add(depth + "enorm", Norm::PlanStash(gpt.normalization, Rs, dtype));
      plan.Add(depth + "hnorm", Norm::PlanStash(gpt.normalization, Rs, dtype));
      plan.Add(depth + "eh_proj.input", {Rs, 2 * h}, dtype);
      plan.Add(depth + "layer", *mtp_layer);
      plan.Add(depth + "final_norm.input", {Rs, h}, dtype);
      plan.Add(depth + "final_norm", Norm::PlanStash(gpt.normalization, Rs, dtype));
      plan.Add(depth + "output_layer.input", {Rs, h}, dtype);
      plan.Add(depth + "loss.logits", {R, d(gpt.PaddedVocabSize(shape.t)) / d(shape.t)}, dtype);
      plan.Add(depth + "loss.row_max", {R}, ComputeDType(dtype));
      plan.Add(depth + "loss.sum_exp", {R}, ComputeDType(dtype));
    }
    plan.Add("loss.logits", {R, d(gpt.PaddedVocabSize(shape.t)) / d(shape.t)}, dtype);
    plan.Add("loss.row_max", {R}, ComputeDType(dtype));
    plan.Add("loss.sum_exp", {R}, ComputeDType(dtype));
  }
  return plan;
}

// The optimizer's state and step buffers of this rank's own parameters (optimizer_plan.h),
// as `mpusim estimate` counts them: its state (master weights and moments, compute dtype),
// with the distributed optimizer the first rank's piece of each buffer, the fullest; the
// gradient piece carried from the last step (alive through the schedule); and what the step
// allocates after the schedule beyond `schedule_peak` (the activations' peak), so the items
// add up to the larger of the two, as the run's peak does.
void GptModel::PlanOptimizerMemory(const OptimizerConfig& optimizer, double schedule_peak,
                                   MemoryPlan* plan) const {
  const DType storage = run_.dtype, compute = ComputeDType(storage);
  OptimizerShards shards;
  int64_t trained = 0;  // parameters: at most this many have a scale per float16 state
  for (const HeldParameterShape& p : HeldParameterShapes()) {
    if (!p.trainable) continue;
    ++trained;
    const PlanBytes elements = PlanElements(p.local_shape);
    shards.largest_parameter_elements = std::max(shards.largest_parameter_elements, elements);
    PlanBytes& buffer = p.expert ? shards.expert_elements : shards.dense_elements;
    buffer = SaturatingAdd(buffer, elements);
  }
  PlanBytes owned = SaturatingAdd(shards.dense_elements, shards.expert_elements);
  if (optimizer.use_distributed_optimizer) {
    const auto group = [&](const char* kind) {
      const std::optional<size_t> k = topology_->FindKind(kind);
      return k ? topology_->GroupSize(*k) : int64_t{1};
    };
    shards.dense_shards = group("dp_cp_partial");
    shards.expert_shards = group("expt_dp_partial");
    const auto piece = [](PlanBytes total, int64_t d) {
      const auto n = static_cast<PlanBytes>(std::max<int64_t>(1, d));
      return (total + n - 1) / n;
    };
    owned = SaturatingAdd(piece(shards.dense_elements, shards.dense_shards),
                          piece(shards.expert_elements, shards.expert_shards));
  }
  const OptimizerPrecision precision = PrecisionOf(config_);
  const int64_t states = optimizer.kind == OptimizerConfig::Kind::kAdam ? 3 : 2;
  plan->AddBytes(
      fmt::format("optimizer: state ({} per trained element)", states),
      SaturatingMul(owned, static_cast<PlanBytes>(OptimizerStateBytes(optimizer, precision))),
      compute);
  if (const int64_t scaled = ScaledStates(optimizer, precision); scaled > 0) {
    plan->AddBytes("optimizer: state (the float16 tensors' scales)",
                   static_cast<PlanBytes>(trained * scaled * kStateScaleBytes), DType::kFloat32);
  }
  const OptimizerStepBytes step =
      PlanOptimizerStep(optimizer, storage, precision, run_.train_iters, shards);
  if (step.carried > 0) {
    plan->AddBytes("optimizer: the gradient piece carried from the last step",
                   PlanByteCount(step.carried), precision.main_grad);
  }
  const double beyond = step.step - (schedule_peak + step.carried);
  if (beyond > 0) {
    plan->AddBytes("optimizer: the step's buffers beyond the activations' peak",
                   PlanByteCount(beyond), storage);
  }
}

// The parameters and main_grad of the whole model (a pipeline stage is counted as if it held
// every layer: an upper bound per rank), this rank's activations at its schedule's peak.
MemoryPlan GptModel::PlanMemory(const MemoryPlanOptions& options) const {
  MemoryPlan plan;
  const GptConfig& gpt = gpt_;
  const RunConfig& run = run_;
  const DType storage = run.dtype;
  const int64_t t = std::max<int64_t>(1, shape_.t);
  const int64_t s = run.seq_length, b = run.micro_batch_size;
  const int64_t h = gpt.hidden_size;
  const PlanBytes L = static_cast<PlanBytes>(gpt.num_layers);
  const int64_t vp = gpt.PaddedVocabSize(t);
  PlanBytes full_parameters = 0;
  const DerivedSizes& sizes = topology_->sizes();
  const ExpertPlacement experts{gpt.moe.num_experts, sizes.ep, coords_.ep};
  for (const GptParameter& p : GptParameters(gpt, vp, false)) {
    full_parameters = SaturatingAdd(full_parameters, PlanElements(p.shape));
    // With expert parallelism the rank holds its ep rank's experts only.
    const std::optional<int64_t> expert = ExpertOf(p.name);
    if (expert && sizes.ep > 1 && !experts.Holds(*expert)) continue;
    Shape local = p.shape;
    if (p.tp_dim >= 0) local[static_cast<size_t>(p.tp_dim)] /= expert ? sizes.etp : t;
    plan.Add(p.name, local, storage);
    plan.Add(p.name + ".main_grad", local, PrecisionOf(config_).main_grad);
  }
  // The constants InitializeParameters makes: this rank's token positions, and under context
  // parallelism every key's.
  plan.Add("constants: this rank's token positions", {shape_.s_cp()}, DType::kInt64);
  if (shape_.cp > 1) plan.Add("constants: every key's position", {s}, DType::kInt64);
  // The activations, from the modules' declared stashes (activation_plan.h, the same count
  // as `mpusim estimate`'s executor count): this rank's pipeline schedule walked as the
  // executor walks it, at its peak, the stashes of the (chunk, micro-batch) pairs in flight,
  // the backward step's working set and the pipeline's transfers. The preflight refuses runs
  // that cannot fit, so it must not under-count: an MoE layer's rows are the most its
  // declaration can take (MoeRouting::kWorst: every token's choices on this rank's experts,
  // at most their capacity), not the balanced expectation the estimate counts; for a dense
  // model the two are the same bytes.
  StatusOr<std::vector<ScheduleActivations>> planned =
      PlanScheduleActivations(config_, *topology_, MoeRouting::kWorst);
  if (!planned.ok()) throw std::logic_error("GptModel::PlanMemory: " + planned.status().Message());
  const ScheduleActivations& mine = (*planned)[static_cast<size_t>(coords_.pp)];
  const auto bytes = PlanByteCount;
  plan.AddBytes(fmt::format("activations: the declared stashes of {} (chunk, micro-batch) "
                            "pair{} in flight",
                            mine.peak_stashes, mine.peak_stashes == 1 ? "" : "s"),
                bytes(mine.stashes), storage);
  plan.AddBytes("activations: the backward step's working set", bytes(mine.working), storage);
  if (mine.transfers > 0) {
    plan.AddBytes("activations: the pipeline's received and sent tensors", bytes(mine.transfers),
                  storage);
  }
  if (config_.optimizer) PlanOptimizerMemory(*config_.optimizer, mine.peak(), &plan);
  if (options.check) {
    // Every rank runs the float64 reference on its dp rank's b samples (run/check.h).
    plan.AddElements("reference: parameters and gradients (float64, full)",
                     SaturatingMul(full_parameters, 2), DType::kFloat64, true);
    int64_t attn = gpt.num_attention_heads * gpt.kv_channels, qkv = gpt.QkvRows();
    if (gpt.mla.enabled) {
      // MLA's (reference/mla_reference.h MlaStash): the latents, q and kv, the per-head query,
      // key and value, the context.
      const MlaConfig& mla = gpt.mla;
      const int64_t a = gpt.num_attention_heads;
      attn = a * mla.v_head_dim;
      qkv = mla.q_lora_rank.value_or(0) + 2 * mla.kv_lora_rank + mla.qk_pos_emb_head_dim +
            a * (2 * mla.QHeadDim() + mla.qk_head_dim + mla.v_head_dim) +
            a * (2 * mla.QHeadDim() + mla.v_head_dim);
    }
    const PlanBytes ref_layer = SaturatingAdd(
        PlanElements({s * b, 6 * h + qkv + attn + gpt.Fc1Rows() + 2 * gpt.ffn_hidden_size}),
        PlanElements({2 * b * gpt.num_attention_heads, s, s}));
    plan.AddElements(
        "reference: activations and their gradients (float64, this rank's samples)",
        SaturatingMul(SaturatingAdd(SaturatingMul(ref_layer, L), PlanElements({s * b, 2 * vp})), 2),
        DType::kFloat64, true);
  }
  return plan;
}

}  // namespace mpusim
