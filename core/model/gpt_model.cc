// The GPT model (see gpt_model.h).
#include "core/model/gpt_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <set>
#include <stdexcept>
#include <string_view>
#include <tuple>

#include "core/context_parallel/roll.h"
#include "core/init.h"
#include "core/model/gpt_torch_plan.h"
#include "core/pipeline/step_span.h"
#include "core/rng.h"
#include "core/schedule.h"
#include "core/tensor_parallel/mappings.h"

namespace mpusim {

namespace {

// Megatron-Core's streams for each GPT dropout site of this rank (core/dropout.h,
// "rng_tracker"), in forward order within each chunk: the embedding (on the first chunk of
// the model), then per layer attention, self_attn_bda, mlp_bda.
TrackerDraws MakeTrackerDraws(const GptConfig& gpt, uint64_t seed, const RankCoordinates& coords,
                              bool sequence_parallel, const std::vector<GptChunk>& chunks) {
  TrackerDraws t;
  t.default_key = DefaultSeed(seed, coords.pp, coords.dp);
  t.model_parallel_key = ModelParallelSeed(t.default_key, coords.tp);
  for (const GptChunk& chunk : chunks) {
    TrackerDraws::Count& count = t.per_chunk.emplace_back();
    const auto add = [&](std::string site, bool model_parallel, double p) {
      if (p == 0.0) return;
      int64_t& n = model_parallel ? count.model_parallel_draws : count.default_draws;
      t.sites[std::move(site)] = {model_parallel, n++};
    };
    if (chunk.pre_process)
      add("embedding.embedding_dropout", sequence_parallel, gpt.hidden_dropout);
    for (int64_t i : chunk.layers) {
      const std::string layer = fmt::format("decoder.layers.{}", i);
      add(layer + ".self_attention.core_attention.attention_dropout", true, gpt.attention_dropout);
      add(layer + ".self_attn_bda", sequence_parallel, gpt.hidden_dropout);
      add(layer + ".mlp_bda", sequence_parallel, gpt.hidden_dropout);
    }
  }
  return t;
}

// A rank's chunks: each a run of consecutive layers, the chunks in increasing order (with
// virtual stages a rank's chunks are not adjacent); the model's first chunk pre_process and
// its last post_process. When the rank holds the whole model (pp = 1), its chunks together
// hold every layer once, in order.
Status CheckChunks(const std::vector<GptChunk>& chunks, int64_t num_layers, int64_t pp) {
  if (chunks.empty()) return Status::Error("chunks", "a rank holds at least one model chunk");
  int64_t next = 0;  // the lowest layer the next one may be
  for (size_t c = 0; c < chunks.size(); ++c) {
    const GptChunk& chunk = chunks[c];
    for (size_t i = 0; i < chunk.layers.size(); ++i) {
      const int64_t layer = chunk.layers[i];
      const bool in_order =
          i == 0 ? layer >= next && (pp > 1 || layer == next) : layer == chunk.layers[i - 1] + 1;
      if (layer < 0 || layer >= num_layers || !in_order) {
        return Status::Error(fmt::format("chunks[{}]", c),
                             fmt::format("layer {} breaks the consecutive order of the model's "
                                         "{} layers",
                                         layer, num_layers));
      }
      next = layer + 1;
    }
    if ((chunk.pre_process && c != 0) || (chunk.post_process && c + 1 != chunks.size())) {
      return Status::Error(fmt::format("chunks[{}]", c),
                           "only the first chunk may hold the embedding and only the last the "
                           "output layer");
    }
  }
  if (pp == 1 && (next != num_layers || !chunks.front().pre_process ||
                  !chunks.back().post_process)) {
    return Status::Error("chunks", "with pipeline_model_parallel_size 1 the rank's chunks hold "
                                   "the whole model");
  }
  return Status();
}

// The layer number of a "decoder.layers.<i>." parameter, or nullopt for the others.
std::optional<int64_t> LayerOf(std::string_view name) {
  constexpr std::string_view kPrefix = "decoder.layers.";
  if (!name.starts_with(kPrefix)) return std::nullopt;
  int64_t layer = 0;
  for (size_t i = kPrefix.size(); i < name.size() && name[i] != '.'; ++i) {
    layer = layer * 10 + (name[i] - '0');
  }
  return layer;
}

}  // namespace

std::vector<HeldGptParameter> HeldGptParameters(const GptConfig& gpt, const DerivedSizes& sizes,
                                                const RankCoordinates& coords,
                                                const std::set<int64_t>& held, bool pre, bool post,
                                                int64_t padded_vocab, bool sequence_parallel) {
  constexpr std::string_view kWord = "embedding.word_embeddings.weight";
  const bool tied = gpt.share_embeddings_and_output_weights;
  const bool mtp = gpt.mtp_num_layers > 0;
  const ExpertPlacement experts{gpt.moe.num_experts, sizes.ep, coords.ep};
  std::vector<HeldGptParameter> out;
  // Multi-token prediction's parameters come with the last decoder layer's (GptParameters);
  // they live on the last stage, which may hold no decoder layer (its layer's are dropped
  // below by their name).
  for (GptParameter& p : GptParameters(
           gpt, padded_vocab, sequence_parallel,
           [&](int64_t layer) {
             return held.count(layer) != 0 || (post && mtp && layer == gpt.num_layers - 1);
           },
           [&](int64_t expert) { return experts.Holds(expert); })) {
    const std::optional<int64_t> layer = LayerOf(p.name);
    const bool mine = layer ? held.count(*layer) != 0
                      : p.name.starts_with("embedding.")
                          ? pre || (post && (tied || mtp) && p.name == kWord)
                          : post;
    if (!mine) continue;
    const std::optional<int64_t> expert = ExpertOf(p.name);
    if (expert && !experts.Holds(*expert)) continue;
    const bool embedding_group = p.name == kWord && (tied || mtp) && sizes.pp > 1;
    out.push_back({std::move(p), expert, embedding_group});
  }
  return out;
}

namespace {}  // namespace

StatusOr<std::unique_ptr<GptModel>> GptModel::Build(const Config& config,
                                                    const Topology& topology,
                                                    const RankCoordinates& coords,
                                                    std::optional<std::vector<GptChunk>> chunks) {
  if (!config.gpt || !config.run) {
    return Status::Error(config.gpt ? "run" : "model",
                         "is required by mpusim run (see docs/simulator.md)");
  }
  std::unique_ptr<GptModel> model(new GptModel());
  model->config_ = config;
  model->topology_ = &topology;
  model->coords_ = coords;
  model->gpt_ = *config.gpt;
  model->run_ = *config.run;
  MPUSIM_RETURN_IF_ERROR(CheckGptLayout(config.parallel, model->run_, &model->gpt_));
  // A PyTorch plan over the GPT's modules: accepted when it is Megatron's own.
  if (config.parallelize_plan) {
    MPUSIM_RETURN_IF_ERROR(
        CheckMegatronPlan(*config.parallelize_plan, model->gpt_,
                          config.parallel.sequence_parallel && topology.sizes().tp > 1));
  }
  if (model->gpt_.mtp_num_layers > 0) {
    // Megatron's "block" skips the MTP layers (with a warning: Warnings); "uniform"
    // checkpoints each depth's projection, layer and final norm, and asserts
    // recompute_num_layers 1 ("recompute_num_layers must be 1 for MTP recompute").
    if (model->run_.CheckpointsMtpDepths() && model->run_.recompute_num_layers.value_or(1) != 1) {
      return Status::Error(
          "run.recompute_num_layers",
          fmt::format("{} with mtp_num_layers and recompute_method \"uniform\": Megatron "
                      "checkpoints each MTP depth alone and asserts 1 (\"recompute_num_layers "
                      "must be 1 for MTP recompute\")",
                      *model->run_.recompute_num_layers));
    }
  }
  if (topology.first_rank() != 0) {
    return Status::Error("parallel.rank_offset", "mpusim run needs rank_offset 0");
  }
  const DerivedSizes& sizes = topology.sizes();
  const int64_t t = sizes.tp;
  model->d_ = sizes.dp;
  model->padded_vocab_ = model->gpt_.PaddedVocabSize(t);
  model->fuse_wgrad_ = config.parallel.gradient_accumulation_fusion;
  StreamShape& sh = model->shape_;
  sh.s = model->run_.seq_length;
  sh.b = model->run_.micro_batch_size;
  sh.B = sh.b * sizes.dp;
  sh.dp_rank = coords.dp;
  sh.t = t;
  sh.tp_rank = coords.tp;
  sh.cp = sizes.cp;
  sh.cp_rank = coords.cp;
  // Megatron turns sequence parallelism off when tp = 1.
  sh.sequence_parallel = config.parallel.sequence_parallel && t > 1;

  const GptConfig& gpt = model->gpt_;
  if (chunks) {
    model->chunks_ = std::move(*chunks);
  } else {
    StatusOr<std::vector<std::vector<std::vector<int64_t>>>> assigned =
        AssignLayers(config.parallel.Split(), gpt.num_layers);
    if (!assigned.ok()) return assigned.status();
    const auto& mine = (*assigned)[static_cast<size_t>(coords.pp)];
    for (size_t c = 0; c < mine.size(); ++c) {
      GptChunk chunk;
      for (int64_t layer : mine[c]) chunk.layers.push_back(layer - 1);  // 1-based there
      chunk.pre_process = coords.pp == 0 && c == 0;
      chunk.post_process = coords.pp == sizes.pp - 1 && c + 1 == mine.size();
      model->chunks_.push_back(std::move(chunk));
    }
  }
  MPUSIM_RETURN_IF_ERROR(CheckChunks(model->chunks_, gpt.num_layers, sizes.pp));
  bool pre = false, post = false;
  std::set<int64_t> held;
  for (const GptChunk& chunk : model->chunks_) {
    pre = pre || chunk.pre_process;
    post = post || chunk.post_process;
    held.insert(chunk.layers.begin(), chunk.layers.end());
  }
  for (const HeldGptParameter& held_p : HeldGptParameters(
           gpt, sizes, coords, held, pre, post, model->padded_vocab_, sh.sequence_parallel)) {
    const GptParameter& p = held_p.declared;
    // An expert weight is split over expt_tp (etp ranks) where the dense weights are over tp.
    const bool own_tp = held_p.expert.has_value() && sizes.etp != t;
    Parameter& added = model->params_.Add(
        p.name, p.shape, p.init, p.tp_dim, p.tp_stride, p.allreduce_grad_over_tp,
        own_tp ? sizes.etp : t, own_tp ? coords.etp : coords.tp,
        own_tp ? ShardAxis::kEtp : ShardAxis::kTp);
    added.expert = held_p.expert.has_value() && sizes.experts_apart();
    added.embedding_group = held_p.embedding_group;
    added.shared = added.embedding_group && !pre;
  }
  constexpr std::string_view kWord = "embedding.word_embeddings.weight";
  const bool tied = gpt.share_embeddings_and_output_weights;
  const ExpertPlacement experts{gpt.moe.num_experts, sizes.ep, coords.ep};
  ParameterSet& params = model->params_;
  model->word_ = params.Find(kWord);
  if (pre) model->position_ = params.Find("embedding.position_embeddings.weight");
  if (sizes.pp > 1) {
    StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(
        sizes.pp, config.parallel.virtual_pipeline_model_parallel_size,
        model->run_.num_microbatches, config.parallel.microbatch_group_size_per_vp_stage);
    if (!schedule.ok()) return schedule.status();
  }
  for (int64_t i : held) {
    model->layers_.try_emplace(i, gpt, i, params, t, model->run_, experts);
  }
  if (post) {
    model->final_norm_.emplace(gpt.normalization, gpt.layernorm_epsilon,
                               &params.Get("decoder.final_layernorm.weight"),
                               params.Find("decoder.final_layernorm.bias"));
    Parameter* output = tied ? model->word_ : &params.Get("output_layer.weight");
    model->output_layer_.emplace(output, nullptr);
    const auto norm = [&](const std::string& name) {
      return Norm(gpt.normalization, gpt.layernorm_epsilon, &params.Get(name + ".weight"),
                  params.Find(name + ".bias"));
    };
    // Each depth's transformer layer is built from the last decoder layer's spec, numbered
    // within the block (its window).
    for (int64_t k = 0; k < gpt.mtp_num_layers; ++k) {
      const std::string prefix = fmt::format("mtp.layers.{}", k);
      model->mtp_.push_back(
          MtpDepth{norm(prefix + ".enorm"), norm(prefix + ".hnorm"),
                   ColumnParallelLinear(&params.Get(prefix + ".eh_proj.weight"), nullptr),
                   TransformerLayer(gpt, gpt.num_layers - 1, params, t, model->run_, experts,
                                    prefix + ".transformer_layer", k),
                   norm(prefix + ".final_layernorm")});
    }
  }
  if (gpt.dropout_mode == DropoutMode::kRngTracker) {
    model->tracker_ =
        MakeTrackerDraws(gpt, model->run_.seed, coords, sh.sequence_parallel, model->chunks_);
  }
  return model;
}

std::vector<std::string> GptModel::Warnings() const {
  if (gpt_.mtp_num_layers == 0 || run_.recompute != RunConfig::Recompute::kFull) return {};
  return {
      "run.recompute_method: \"block\" recomputes the decoder's layers, not the multi-token "
      "prediction depths' (Megatron: \"recompute_method == 'block' is not supported for MTP "
      "yet. Skipping recompute.\")"};
}

std::vector<GptModel::HeldMoe> GptModel::MoeLayers() const {
  std::vector<HeldMoe> held;
  for (const auto& [layer, module] : layers_) {
    if (module.moe() != nullptr) {
      held.push_back({layer, fmt::format("decoder.layers.{}", layer), module.moe()});
    }
  }
  for (size_t k = 0; k < mtp_.size(); ++k) {
    if (mtp_[k].layer.moe() != nullptr) {
      held.push_back({gpt_.num_layers + static_cast<int64_t>(k),
                      fmt::format("mtp.layers.{}.transformer_layer", k), mtp_[k].layer.moe()});
    }
  }
  return held;
}

std::vector<std::string> GptModel::StepNotes() const {
  // One line per MoE layer from the first rank of each expert tensor-parallel group (its
  // expt_tp peers compute slices of the same experts on the same tokens).
  std::vector<std::string> notes;
  if (coords_.etp != 0) return notes;
  for (const HeldMoe& l : MoeLayers()) {
    if (l.moe->received().empty()) continue;
    notes.push_back(fmt::format("rank {} (ep rank {}) layer {}: {}", coords_.rank, coords_.ep,
                                l.number, l.moe->ReceivedNote()));
  }
  return notes;
}

// Megatron's TorchFullyShardedDataParallel wraps LanguageModelEmbedding, every
// TransformerLayer and the output layer (Transformer Engine's layers are not
// tensor_parallel.ColumnParallelLinear), then the model itself, the root, which keeps the
// rest (the final layernorm).
std::vector<FullyShardUnitPlan> GptModel::FullyShardUnits() const {
  if (!config_.optimizer || !config_.optimizer->use_torch_fsdp2) return {};
  std::vector<FullyShardUnitPlan> units;
  units.push_back({"model", true, {}});
  units.push_back({"embedding", false, {}});
  for (const auto& [layer, module] : layers_) {
    units.push_back({fmt::format("decoder.layers.{}", layer), false, {}});
  }
  units.push_back({"output_layer", false, {}});
  for (const auto& p : params_.all()) {
    size_t at = 0;
    for (size_t u = 1; u < units.size(); ++u) {
      if (p->name.starts_with(units[u].name + ".")) at = u;
    }
    units[at].params.push_back(p->name);
  }
  return units;
}

void GptModel::InitializeParameters(RankContext& ctx) {
  InitializeParameters(*ctx.kernels);
  const std::vector<FullyShardUnitPlan> plans = FullyShardUnits();
  if (plans.empty()) return;
  std::vector<FullyShard::Unit> units;
  for (size_t u = 0; u < plans.size(); ++u) {
    const FullyShardUnitPlan& plan = plans[u];
    FullyShard::Unit& unit = units.emplace_back();
    unit.name = plan.name;
    unit.root = plan.root;
    for (const std::string& name : plan.params) unit.params.push_back(&params_.Get(name));
    if (plan.root) fsdp_root_ = u;
    if (plan.name == "embedding") fsdp_embedding_ = u;
    if (plan.name == "output_layer") fsdp_output_ = u;
  }
  for (const auto& [layer, module] : layers_) {
    const std::string name = fmt::format("decoder.layers.{}", layer);
    for (size_t u = 0; u < plans.size(); ++u) {
      if (plans[u].name == name) fsdp_layer_[layer] = u;
    }
  }
  fsdp_ = std::make_unique<FullyShard>(std::move(units), ctx.dp_cp(),
                                       config_.optimizer->torch_fsdp2_reshard_after_forward,
                                       *ctx.kernels);
}

void GptModel::UnitPreForward(const ModuleContext& ctx, size_t unit) const {
  if (fsdp_) fsdp_->PreForward(ctx.k, unit, ctx.trace);
}

void GptModel::UnitPostForward(size_t unit, bool recomputing) const {
  if (fsdp_) fsdp_->PostForward(unit, recomputing);
}

void GptModel::UnitPreBackward(const ModuleContext& ctx, size_t unit) const {
  if (fsdp_) fsdp_->PreBackward(ctx.k, unit, ctx.trace);
}

void GptModel::UnitPostBackward(const ModuleContext& ctx, size_t unit) const {
  if (fsdp_) fsdp_->PostBackward(ctx.k, unit, ctx.trace);
}

void GptModel::InitializeParameters(Kernels& k) {
  params_.Initialize(k, run_.seed, run_.dtype, PrecisionOf(config_).main_grad);
  const int64_t s_cp = shape_.s_cp();
  Tensor positions = Tensor::HostEmpty({s_cp}, DType::kInt64);
  for (int64_t i = 0; i < s_cp; ++i) positions.data_as<int64_t>()[i] = shape_.Position(i);
  positions_ = k.ToDevice(positions);
  if (shape_.cp == 1) {
    key_positions_ = positions_;
    return;
  }
  Tensor keys = Tensor::HostEmpty({shape_.s}, DType::kInt64);
  for (int64_t i = 0; i < shape_.s; ++i) keys.data_as<int64_t>()[i] = i;
  key_positions_ = k.ToDevice(keys);
}

GptModel::Batch GptModel::MakeBatch(Kernels& k, int64_t microbatch) const {
  const StreamShape& sh = shape_;
  const int64_t s_cp = sh.s_cp();
  Tensor tokens = Tensor::HostEmpty({s_cp, sh.b}, DType::kInt64);
  Tensor labels = Tensor::HostEmpty({s_cp, sh.b}, DType::kInt64);
  Tensor positions = Tensor::HostEmpty({s_cp, sh.b}, DType::kInt64);
  const std::string text = fmt::format("text.mb{}", microbatch);
  for (int64_t l = 0; l < s_cp; ++l) {
    const int64_t i = sh.Position(l);  // Megatron's get_batch_on_this_cp_rank
    for (int64_t j = 0; j < sh.b; ++j) {
      const int64_t gs = sh.dp_rank * sh.b + j;
      const int64_t row = l * sh.b + j;
      tokens.data_as<int64_t>()[row] =
          TokenAt(run_.seed, text, gs * (sh.s + 1) + i, gpt_.vocab_size);
      labels.data_as<int64_t>()[row] =
          TokenAt(run_.seed, text, gs * (sh.s + 1) + i + 1, gpt_.vocab_size);
      positions.data_as<int64_t>()[row] = i;
    }
  }
  return Batch{k.ToDevice(tokens), k.ToDevice(labels), k.ToDevice(positions)};
}

// LanguageModelEmbedding: word embeddings (vocab-parallel: a partial sum over tp) plus
// learned position embeddings, then under sequence parallelism the split to this rank's
// sequence shard, then dropout. Megatron reduce-scatters the word embeddings directly when
// nothing is added to them (rope); otherwise it all-reduces, adds, and scatters.
Tensor GptModel::EmbeddingForward(const ModuleContext& ctx, const Batch& batch,
                                  Stash* stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = shape_;
  const int64_t rows = sh.s_cp() * sh.b, h = gpt_.hidden_size;
  Tensor embeddings = WordEmbeddings().Forward(ctx, batch.tokens);
  if (position_ != nullptr) {
    Tensor positions = k.Empty({rows, h}, run_.dtype);
    k.EmbeddingForward(position_->value, batch.positions, 0, position_->value.rows(), positions);
    k.Axpy(1.0, positions, embeddings);
    if (sh.sequence_parallel) embeddings = SplitFirstDim(k, ctx.tp, embeddings);
  }
  stash->embedding_in = embeddings;
  const Tensor out =
      gpt_.hidden_dropout > 0
          ? DropoutAtSite(ctx, "embedding.embedding_dropout", gpt_.hidden_dropout, sh.StreamMap(h),
                          embeddings)
          : embeddings;
  ctx.Record("embedding.output", out, {sh.s, sh.B, h}, sh.StreamSpec(d_));
  return out;
}

void GptModel::EmbeddingBackward(const ModuleContext& ctx, const Batch& batch,
                                 const Tensor& dy) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = shape_;
  const int64_t h = gpt_.hidden_size;
  ctx.Record("embedding.output_grad", dy, {sh.s, sh.B, h}, sh.StreamSpec(d_));
  const Tensor ddrop =
      gpt_.hidden_dropout > 0
          ? DropoutAtSite(ctx, "embedding.embedding_dropout", gpt_.hidden_dropout, sh.StreamMap(h), dy)
          : dy;
  // With position embeddings the backward of the split is an all-gather (the word
  // embeddings' all-reduce then has the identity); without, the word embeddings undo their
  // own reduce-scatter.
  Tensor grad = ddrop;
  if (position_ != nullptr) {
    if (sh.sequence_parallel) grad = AllGatherFirstDim(k, ctx.tp, ddrop);
    k.EmbeddingBackward(grad, batch.positions, 0, position_->value.rows(), position_->grad);
  }
  WordEmbeddings().Backward(ctx, batch.tokens, grad);
}

// LanguageModelEmbedding's word embeddings: reduce-scattered straight to the sequence shard
// under sequence parallelism when nothing is added to them (rope), else all-reduced.
VocabParallelEmbedding GptModel::WordEmbeddings() const {
  return VocabParallelEmbedding(word_, shape_.sequence_parallel && position_ == nullptr);
}

ModuleContext GptModel::Context(RankContext& ctx, int64_t microbatch, const Stash& stash,
                                std::vector<TensorRecord>* records) const {
  const DropoutDraw draw{run_.seed, iteration_, microbatch, tracker_ ? &*tracker_ : nullptr,
                         stash.draws};
  ModuleContext module{*ctx.kernels, ctx.tp(), *ctx.trace, shape_, d_, draw, fuse_wgrad_, records};
  module.positions = positions_;
  module.key_positions = key_positions_;
  const DerivedSizes& sizes = topology_->sizes();
  if (sizes.experts_apart()) {
    if (ctx.groups.tp_ep == nullptr || ctx.groups.tp_ep->Size() != sizes.etp * sizes.ep) {
      throw std::logic_error("GptModel: the experts are laid out apart but the tp_ep group is "
                             "missing or not etp x ep ranks");
    }
    module.tp_ep = ctx.groups.tp_ep.get();
    if (ctx.groups.expt_tp == nullptr || ctx.groups.expt_tp->Size() != sizes.etp ||
        ctx.groups.expt_tp->Rank() != coords_.etp) {
      throw std::logic_error("GptModel: the expt_tp group does not place this rank at its etp "
                             "rank");
    }
    module.expt_tp = ctx.groups.expt_tp.get();
  }
  if (ctx.groups.dp_cp != nullptr && ctx.groups.dp_cp->Size() > 1) {
    module.dp_cp = ctx.groups.dp_cp.get();
  }
  if (sizes.ep > 1) {
    if (ctx.groups.ep == nullptr || ctx.groups.ep->Size() != sizes.ep ||
        ctx.groups.ep->Rank() != coords_.ep) {
      throw std::logic_error("GptModel: the ep group does not place this rank at its ep rank");
    }
    module.ep = ctx.groups.ep.get();
  }
  if (shape_.cp > 1) {
    module.cp = &ctx.cp();
    if (module.cp->Rank() != shape_.cp_rank || module.cp->Size() != shape_.cp) {
      throw std::logic_error(fmt::format("GptModel: the cp group has this rank at {} of {}, the "
                                         "layout at {} of {}",
                                         module.cp->Rank(), module.cp->Size(), shape_.cp_rank,
                                         shape_.cp));
    }
    if (gpt_.cp_comm_type == CpCommType::kA2aP2p) {
      // Level 0 holds consecutive cp ranks: cp rank = level-0 rank + a * level-1 rank.
      Communicator* a2a = ctx.groups.hcp_L0.get();
      Communicator* p2p = ctx.groups.hcp_L1.get();
      if (a2a == nullptr || p2p == nullptr || a2a->Size() * p2p->Size() != shape_.cp ||
          a2a->Rank() + a2a->Size() * p2p->Rank() != shape_.cp_rank) {
        throw std::logic_error("GptModel: a2a+p2p without hcp_L0 and hcp_L1 groups that place "
                               "this rank at its cp rank");
      }
      module.hcp_a2a = a2a;
      module.hcp_p2p = p2p;
    }
  }
  return module;
}

double GptModel::HeadForward(const ModuleContext& ctx, const Tensor& x, Stash* stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = shape_;
  ctx.trace.SetSite("output_layer");
  const Tensor final = final_norm_->Forward(ctx, x, &stash->final_norm);
  ctx.Record("decoder.final_layernorm.output", final, {sh.s, sh.B, final.cols()},
             sh.StreamSpec(d_));
  if (!mtp_.empty()) MtpForward(ctx, final, stash);
  ctx.trace.SetSite("output_layer");
  UnitPreForward(ctx, fsdp_output_);
  const Tensor logits = output_layer_->Forward(ctx, final, &stash->output_layer);
  UnitPostForward(fsdp_output_);
  ctx.Record("output_layer.output", logits, {sh.s, sh.B, padded_vocab_}, sh.ColumnSpec(d_, 1));
  const Tensor losses = VocabParallelCrossEntropyForward(
      k, ctx.tp, logits, stash->batch.labels, padded_vocab_, gpt_.label_smoothing, &stash->loss);
  ctx.Record("loss.per_token", losses.Reshaped({sh.s_cp(), sh.b}), {sh.s, sh.B}, sh.TokenSpec(d_));
  const Tensor host = k.ToHost(losses);
  double sum = 0;
  for (int64_t i = 0; i < host.numel(); ++i) sum += HostValue(host, i);
  return sum;
}

Tensor GptModel::HeadBackward(const ModuleContext& ctx, Stash& stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = shape_;
  // The final norm's output also feeds the first multi-token prediction depth's hnorm: its
  // gradient through the depths first, so that their tensors are gone before the head's.
  Tensor dmtp;
  if (!mtp_.empty()) dmtp = MtpBackward(ctx, stash);
  ctx.trace.SetSite("output_layer");
  const int64_t rows = sh.s_cp() * sh.b;
  const DType stats = ComputeDType(run_.dtype);
  Tensor dloss_host = Tensor::HostEmpty({rows}, stats);
  const double scale = 1.0 / static_cast<double>(run_.num_microbatches * sh.s * sh.B);
  for (int64_t i = 0; i < rows; ++i) SetHostValue(dloss_host, i, scale);
  const Tensor dloss = k.ToDevice(dloss_host);
  ctx.Record("loss.per_token_grad", dloss.Reshaped({sh.s_cp(), sh.b}), {sh.s, sh.B},
             sh.TokenSpec(d_));
  const Tensor dlogits =
      VocabParallelCrossEntropyBackward(k, stash.loss, stash.batch.labels, padded_vocab_,
                                        gpt_.label_smoothing, sh.tp_rank, dloss);
  ctx.Record("output_layer.output_grad", dlogits, {sh.s, sh.B, padded_vocab_},
             sh.ColumnSpec(d_, 1));
  UnitPreBackward(ctx, fsdp_root_);  // the final layernorm's gradients
  UnitPreBackward(ctx, fsdp_output_);
  Tensor dfinal = output_layer_->Backward(ctx, dlogits, stash.output_layer);
  UnitPostBackward(ctx, fsdp_output_);
  if (dmtp.defined()) {
    k.Axpy(1.0, dmtp, dfinal);
    dmtp = Tensor();
  }
  ctx.Record("decoder.final_layernorm.output_grad", dfinal, {sh.s, sh.B, dfinal.cols()},
             sh.StreamSpec(d_));
  return final_norm_->Backward(ctx, dfinal, stash.final_norm);
}

// MultiTokenPredictionBlock: depth k (0-based) at position i joins the previous depth's
// hidden state at i (depth 0: the decoder's final norm output) with the embedding of the
// ids rolled k + 1 places, so that it predicts the label k + 1 further ahead:
//   x = eh_proj([enorm(dropout(E[ids_k])), hnorm(h_{k-1})]);  h_k = final_layernorm(layer(x))
// The embedding is the model's own (LanguageModelEmbedding with rope: under sequence
// parallelism reduce-scattered straight to this rank's shard). eh_proj is column parallel
// ([h/t, 2h] per rank, no bias; under sp its input gathered along the sequence), its output
// gathered over tp (gather_from_tensor_model_parallel_region, whose backward takes this
// rank's columns) and under sp scattered back to the sequence shard before the layer. Then
// process_mtp_loss: h_k's logits through the shared output layer, the cross entropy against
// the labels rolled k + 1 places, masked where the roll left no label (the last k + 1
// positions).
void GptModel::MtpForward(const ModuleContext& ctx, const Tensor& hidden, Stash* stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = shape_;
  const int64_t h = gpt_.hidden_size;
  const ShardSpec stream = sh.StreamSpec(d_);
  // roll_tensor over the cp ranks (a local torch.roll when cp = 1), tagged apart from the
  // ring attention's messages.
  constexpr int kRollTag = 16;
  const auto roll = [&](const Tensor& x) {
    return RollLeftAcrossCp(k, ctx.cp, sh.cp, sh.cp_rank, x, kRollTag);
  };
  Tensor prev = hidden;
  // The previous depth's ids, positions and labels (the micro-batch's first) and loss mask
  // (ones first: every token has its label).
  Tensor ids = stash->batch.tokens, positions = stash->batch.positions,
         labels = stash->batch.labels;
  Tensor mask_host = Tensor::HostEmpty({sh.s_cp(), sh.b}, DType::kFloat32);
  std::fill_n(mask_host.data_as<float>(), mask_host.numel(), 1.0f);
  Tensor mask = k.ToDevice(mask_host);
  for (size_t d = 0; d < mtp_.size(); ++d) {
    MtpStash& st = stash->mtp[d];
    const std::string prefix = fmt::format("mtp.layers.{}", d);
    ctx.trace.SetSite(prefix);
    // MultiTokenPredictionLayer._get_embeddings: the ids and positions rolled once more
    // (rope: the positions reach no embedding; Megatron rolls them all the same).
    ids = st.batch.tokens = roll(ids);
    positions = roll(positions);
    const Tensor embedded = WordEmbeddings().Forward(ctx, st.batch.tokens);
    const Tensor e = gpt_.hidden_dropout > 0
                         ? DropoutAtSite(ctx, prefix + ".embedding.embedding_dropout",
                                         gpt_.hidden_dropout, sh.StreamMap(h), embedded)
                         : embedded;
    ctx.Record(prefix + ".embedding.output", e, {sh.s, sh.B, h}, stream);
    Tensor out;
    if (run_.CheckpointsMtpDepths()) {
      // Full recomputation ("uniform"): CheckpointFunction over _proj_and_transformer_layer
      // keeps its two inputs alone; the backward rebuilds the rest.
      MtpStash scratch;
      out = MtpDepthForward(ctx, d, e, prev, &scratch);
      st.checkpointed_e = e;
      st.checkpointed_h = prev;
    } else {
      out = MtpDepthForward(ctx, d, e, prev, &st);
    }
    const Tensor logits = output_layer_->Forward(ctx, out, &st.output_layer);
    ctx.Record(prefix + ".output_layer.output", logits, {sh.s, sh.B, padded_vocab_},
               sh.ColumnSpec(d_, 1));
    // process_mtp_loss: the labels and the loss mask rolled once more.
    ctx.trace.SetSite(prefix + " (loss)");
    labels = st.batch.labels = roll(labels);
    mask = roll(mask);
    st.loss_mask = k.ToHost(mask);
    const Tensor losses = VocabParallelCrossEntropyForward(
        k, ctx.tp, logits, st.batch.labels, padded_vocab_, gpt_.label_smoothing, &st.loss);
    if (ctx.recording()) {
      // No loss where the roll left no label.
      Tensor masked = k.ToHost(losses);
      for (int64_t i = 0; i < masked.numel(); ++i) {
        if (st.loss_mask.data_as<float>()[i] == 0.0f) SetHostValue(masked, i, 0.0);
      }
      ctx.Record(prefix + ".loss.per_token", k.ToDevice(masked).Reshaped({sh.s_cp(), sh.b}),
                 {sh.s, sh.B}, sh.TokenSpec(d_));
    }
    prev = out;
  }
}

// MultiTokenPredictionLayer._proj_and_transformer_layer (what "uniform" checkpoints):
// eh_proj([enorm(e), hnorm(prev)]) column parallel (under sp its input gathered along the
// sequence), its output gathered over tp and under sp scattered back to the sequence shard,
// the transformer layer, final_layernorm (_postprocess). Fills st's enorm, hnorm, eh_proj,
// layer and final_norm; returns h_k.
Tensor GptModel::MtpDepthForward(const ModuleContext& ctx, size_t d, const Tensor& e,
                                 const Tensor& prev, MtpStash* st) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = shape_;
  const int64_t h = gpt_.hidden_size, rows = sh.stream_rows();
  const ShardSpec stream = sh.StreamSpec(d_);
  const MtpDepth& depth = mtp_[d];
  const std::string prefix = fmt::format("mtp.layers.{}", d);
  Tensor concat = k.Empty({rows, 2 * h}, run_.dtype);
  {
    const Tensor en = depth.enorm.Forward(ctx, e, &st->enorm);
    ctx.Record(prefix + ".enorm.output", en, {sh.s, sh.B, h}, stream);
    k.CopyBlock(en, 0, 0, concat, 0, 0, rows, h);
    const Tensor hn = depth.hnorm.Forward(ctx, prev, &st->hnorm);
    ctx.Record(prefix + ".hnorm.output", hn, {sh.s, sh.B, h}, stream);
    k.CopyBlock(hn, 0, 0, concat, 0, h, rows, h);
  }
  Tensor x = AllGatherLastDim(k, ctx.tp, depth.eh_proj.Forward(ctx, concat, &st->eh_proj));
  concat = Tensor();
  if (sh.sequence_parallel) x = SplitFirstDim(k, ctx.tp, x);
  ctx.Record(prefix + ".eh_proj.output", x, {sh.s, sh.B, h}, stream);
  const Tensor y = depth.layer.Forward(ctx, x, LayerRecompute::Keep::kAll, &st->layer);
  x = Tensor();
  const Tensor out = depth.final_norm.Forward(ctx, y, &st->final_norm);
  ctx.Record(prefix + ".final_layernorm.output", out, {sh.s, sh.B, h}, stream);
  return out;
}

// The depths' backward, deepest first: h_k's gradient is its logits' plus depth k + 1's
// hnorm's. MTPLossAutoScaler gives each depth's loss the gradient
// mtp_loss_scaling_factor / D / num_tokens_k times the main loss's backward scale 1 / M
// (num_tokens_k: this rank's unmasked tokens, roll_tensor's local sum: b (s - k - 1) without
// cp), and the gradient average over dp x cp divides by d cp: per unmasked token
// f / (D M d cp num_tokens_k), f / (D M B (s - k - 1)) without cp.
Tensor GptModel::MtpBackward(const ModuleContext& ctx, Stash& stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = shape_;
  const int64_t h = gpt_.hidden_size, rows = sh.stream_rows(), tokens = sh.s_cp() * sh.b;
  const ShardSpec stream = sh.StreamSpec(d_);
  const auto D = static_cast<int64_t>(mtp_.size());
  Tensor dnext;  // d loss / d h_k through depth k + 1
  for (int64_t d = D; d-- > 0;) {
    const MtpDepth& depth = mtp_[static_cast<size_t>(d)];
    MtpStash& st = stash.mtp[static_cast<size_t>(d)];
    const std::string prefix = fmt::format("mtp.layers.{}", d);
    ctx.trace.SetSite(prefix);
    Tensor dout;  // d loss / d h_k
    {
      const float* mask = st.loss_mask.data_as<float>();
      int64_t num_tokens = 0;
      for (int64_t i = 0; i < tokens; ++i) num_tokens += mask[i] != 0.0f ? 1 : 0;
      const double scale =
          num_tokens > 0
              ? gpt_.mtp_loss_scaling_factor /
                    static_cast<double>(D * run_.num_microbatches * d_ * sh.cp * num_tokens)
              : 0.0;
      Tensor dloss_host = Tensor::HostEmpty({tokens}, ComputeDType(run_.dtype));
      for (int64_t i = 0; i < tokens; ++i) SetHostValue(dloss_host, i, mask[i] * scale);
      const Tensor dloss = k.ToDevice(dloss_host);
      const Tensor dlogits = VocabParallelCrossEntropyBackward(
          k, st.loss, st.batch.labels, padded_vocab_, gpt_.label_smoothing, sh.tp_rank, dloss);
      ctx.Record(prefix + ".output_layer.output_grad", dlogits, {sh.s, sh.B, padded_vocab_},
                 sh.ColumnSpec(d_, 1));
      dout = output_layer_->Backward(ctx, dlogits, st.output_layer);
    }
    if (dnext.defined()) {
      k.Axpy(1.0, dnext, dout);
      dnext = Tensor();
    }
    if (run_.CheckpointsMtpDepths()) {
      // The checkpoint's backward: the depth's forward again from its two inputs, recording
      // nothing; its collectives are real and stay in the trace.
      std::optional<SpanRecorder> span;
      if (ctx.recompute_spans != nullptr) {
        span.emplace(*ctx.recompute_spans, ctx.chunk, ctx.draw.microbatch, true, true);
      }
      ModuleContext quiet = ctx;
      quiet.records = nullptr;
      MtpDepthForward(quiet, static_cast<size_t>(d), st.checkpointed_e, st.checkpointed_h, &st);
    }
    ctx.Record(prefix + ".final_layernorm.output_grad", dout, {sh.s, sh.B, h}, stream);
    Tensor dy = depth.final_norm.Backward(ctx, dout, st.final_norm);
    dout = Tensor();
    dy = depth.layer.Backward(ctx, dy, st.layer);
    ctx.Record(prefix + ".eh_proj.output_grad", dy, {sh.s, sh.B, h}, stream);
    // The scatter's backward gathers the sequence; the gather's takes this rank's columns.
    if (sh.sequence_parallel) dy = AllGatherFirstDim(k, ctx.tp, dy);
    dy = SplitLastDim(k, ctx.tp, dy);
    Tensor dconcat = depth.eh_proj.Backward(ctx, dy, st.eh_proj);
    dy = Tensor();
    Tensor de = k.Empty({rows, h}, run_.dtype), dh = k.Empty({rows, h}, run_.dtype);
    k.CopyBlock(dconcat, 0, 0, de, 0, 0, rows, h);
    k.CopyBlock(dconcat, 0, h, dh, 0, 0, rows, h);
    dconcat = Tensor();
    ctx.Record(prefix + ".enorm.output_grad", de, {sh.s, sh.B, h}, stream);
    ctx.Record(prefix + ".hnorm.output_grad", dh, {sh.s, sh.B, h}, stream);
    de = depth.enorm.Backward(ctx, de, st.enorm);
    ctx.Record(prefix + ".embedding.output_grad", de, {sh.s, sh.B, h}, stream);
    if (gpt_.hidden_dropout > 0) {
      de = DropoutAtSite(ctx, prefix + ".embedding.embedding_dropout", gpt_.hidden_dropout,
                         sh.StreamMap(h), de);
    }
    WordEmbeddings().Backward(ctx, st.batch.tokens, de);
    de = Tensor();
    dnext = depth.hnorm.Backward(ctx, dh, st.hnorm);
    if (run_.CheckpointsMtpDepths()) {
      // The rebuilt tensors go with the checkpoint's backward.
      st.enorm = {};
      st.hnorm = {};
      st.eh_proj = {};
      st.layer = {};
      st.final_norm = {};
    }
  }
  return dnext;
}

void GptModel::BeginStep(RankContext& ctx, int64_t iteration, bool record) {
  if (fsdp_) {
    fsdp_->ZeroGrads(*ctx.kernels);
  } else {
    params_.ZeroGrads(*ctx.kernels);
  }
  loss_sum_ = 0;
  iteration_ = iteration;
  record_ = record;
  recorded_.clear();
  for (const HeldMoe& l : MoeLayers()) l.moe->ResetTokensPerExpert();
  // The tracker's state at the start of the iteration: every earlier iteration ran M
  // forwards of every chunk.
  if (tracker_) tracker_next_ = TrackerAtIteration(iteration);
}

TrackerDraws::Count GptModel::TrackerAtIteration(int64_t iteration) const {
  TrackerDraws::Count at;
  for (const TrackerDraws::Count& count : tracker_->per_chunk) {
    at.default_draws += iteration * run_.num_microbatches * count.default_draws;
    at.model_parallel_draws += iteration * run_.num_microbatches * count.model_parallel_draws;
  }
  return at;
}

std::pair<Shape, DType> GptModel::TransferShape(const RankContext& /*ctx*/,
                                                const Transfer& /*transfer*/) const {
  return {{shape_.stream_rows(), gpt_.hidden_size}, run_.dtype};
}

std::unique_ptr<StepStash> GptModel::NewStash(int64_t /*chunk*/) const {
  return std::make_unique<Stash>();
}

Tensor GptModel::ForwardStep(const StepCall& call, const Tensor& input, StepStash& stashed) {
  RankContext& ctx = call.ctx;
  const GptChunk& spec = chunks_.at(static_cast<size_t>(call.chunk));
  auto& stash = static_cast<Stash&>(stashed);
  if (tracker_) {
    // Megatron's tracker is a state that every forward advances, in the order this rank runs
    // them; recomputation in the backward step redraws the same numbers (core/dropout.h).
    const TrackerDraws::Count& count = tracker_->per_chunk.at(static_cast<size_t>(call.chunk));
    stash.draws = tracker_next_;
    tracker_next_.default_draws += count.default_draws;
    tracker_next_.model_parallel_draws += count.model_parallel_draws;
  }
  const ModuleContext mctx = Context(ctx, call.microbatch, stash, call.record ? &recorded_ : nullptr);
  mctx.trace.SetPhase(Phase::kForward);
  if (spec.pre_process || spec.post_process) {
    stash.batch = MakeBatch(*ctx.kernels, iteration_ * run_.num_microbatches + call.microbatch);
  }
  if (spec.post_process) stash.mtp.resize(mtp_.size());  // MtpForward rolls each depth's ids
  Tensor x = input;
  // FSDP2's root unit is gathered as the model's forward starts (pp = 1: one chunk).
  UnitPreForward(mctx, fsdp_root_);
  if (spec.pre_process) {
    mctx.trace.SetSite("embedding");
    UnitPreForward(mctx, fsdp_embedding_);
    x = EmbeddingForward(mctx, stash.batch, &stash);
    UnitPostForward(fsdp_embedding_);
  }
  stash.layers.resize(spec.layers.size());
  const auto n = static_cast<int64_t>(spec.layers.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t layer = spec.layers[static_cast<size_t>(i)];
    mctx.trace.SetSite(fmt::format("decoder.layers.{}", layer));
    const size_t unit = fsdp_ ? fsdp_layer_.at(layer) : 0;
    UnitPreForward(mctx, unit);
    x = layers_.at(layer).Forward(mctx, x, LayerRecompute::Of(run_, i, n).keep,
                                  &stash.layers[static_cast<size_t>(i)]);
    UnitPostForward(unit);
  }
  if (!spec.post_process) return x;
  loss_sum_ += HeadForward(mctx, x, &stash);
  return Tensor();
}

Tensor GptModel::BackwardStep(const StepCall& call, const Tensor& output_grad,
                              StepStash& stashed) {
  const GptChunk& spec = chunks_.at(static_cast<size_t>(call.chunk));
  auto& stash = static_cast<Stash&>(stashed);
  ModuleContext mctx =
      Context(call.ctx, call.microbatch, stash, call.record ? &recorded_ : nullptr);
  mctx.recompute_spans = call.spans;
  mctx.chunk = call.chunk;
  mctx.trace.SetPhase(Phase::kBackward);
  Tensor dx = spec.post_process ? HeadBackward(mctx, stash) : output_grad;
  const auto n = static_cast<int64_t>(spec.layers.size());
  for (int64_t i = n; i-- > 0;) {
    const int64_t layer = spec.layers[static_cast<size_t>(i)];
    TransformerLayer::Stash& layer_stash = stash.layers[static_cast<size_t>(i)];
    const RunConfig::RecomputeGroup group = run_.GroupOf(i, n);
    if (group.recomputed && !layer_stash.inner) {
      // Full recomputation (Megatron's CheckpointFunction over layers first..i, i the group's
      // last): the group's forward again from its first layer's input, recording nothing;
      // its collectives are real and stay in the trace. Every layer of the group is then
      // backwarded from what this rebuilt.
      std::optional<SpanRecorder> span;
      if (call.spans != nullptr) span.emplace(*call.spans, call.chunk, call.microbatch, true, true);
      Tensor y = stash.layers[static_cast<size_t>(group.first)].input;
      for (int64_t j = group.first; j <= i; ++j) {
        const int64_t redone = spec.layers[static_cast<size_t>(j)];
        mctx.trace.SetSite(fmt::format("decoder.layers.{}", redone));
        if (fsdp_) UnitPreForward(mctx, fsdp_layer_.at(redone));  // kept until its backward
        y = layers_.at(redone).Recompute(mctx, y, &stash.layers[static_cast<size_t>(j)]);
      }
    }
    mctx.trace.SetSite(fmt::format("decoder.layers.{}", layer));
    const size_t unit = fsdp_ ? fsdp_layer_.at(layer) : 0;
    UnitPreBackward(mctx, unit);
    dx = layers_.at(layer).Backward(mctx, dx, layer_stash);
    UnitPostBackward(mctx, unit);
    // A group's later layer frees the input it did not keep in the forward.
    if (group.recomputed && group.first != i) layer_stash.input = Tensor();
  }
  if (!spec.pre_process) return dx;
  mctx.trace.SetSite("embedding");
  UnitPreBackward(mctx, fsdp_embedding_);
  EmbeddingBackward(mctx, stash.batch, dx);
  UnitPostBackward(mctx, fsdp_embedding_);
  UnitPostBackward(mctx, fsdp_root_);
  return Tensor();
}

void GptModel::EndStep(RankContext& ctx) {
  Kernels& k = *ctx.kernels;
  const int64_t M = run_.num_microbatches;
  // After the gradients' finalisation, as finalize_model_grads resets the routers' global
  // aux loss trackers (reset_model_temporary_tensors).
  for (const HeldMoe& l : MoeLayers()) l.moe->ResetGlobalAuxLossTracker();
  if (tracker_ && tracker_next_ != TrackerAtIteration(iteration_ + 1)) {
    throw std::logic_error(
        fmt::format("GptModel: the RNG tracker advanced to draws ({}, {}), not to the end of "
                    "iteration {}",
                    tracker_next_.default_draws, tracker_next_.model_parallel_draws, iteration_));
  }
  if (record_) {
    const Batch batch = MakeBatch(k, iteration_ * M + M - 1);
    const ShardSpec batch_split = shape_.TokenSpec(d_);
    // Recorded as float64 [s, b], as dumps and the check hold them.
    for (const auto* ids : {&batch.tokens, &batch.labels}) {
      recorded_.push_back({ids == &batch.tokens ? "tokens" : "labels",
                           k.ToDevice(HostToFloat64(k.ToHost(*ids))), {shape_.s, shape_.B},
                           batch_split, false});
    }
  }
  // The reported loss: mean over every token of every micro-batch on every dp and cp rank;
  // the last pipeline stage computed it, the others add 0.
  Tensor total = Tensor::HostEmpty({1}, DType::kFloat64);
  total.data_as<double>()[0] = loss_sum_;
  Tensor device_total = k.ToDevice(total);
  ctx.trace->SetSite("loss");
  if (ctx.pp().Size() > 1) ctx.pp().AllReduce(device_total, ReduceOp::kSum);
  Communicator& data = shape_.cp > 1 ? ctx.dp_cp() : ctx.dp();
  if (data.Size() > 1) data.AllReduce(device_total, ReduceOp::kSum);
  loss_ = HostValue(k.ToHost(device_total), 0) / static_cast<double>(M * shape_.s * shape_.B);
  if (!record_) return;
  Tensor loss = Tensor::HostEmpty({1}, DType::kFloat64);
  loss.data_as<double>()[0] = loss_;
  recorded_.push_back({"loss", k.ToDevice(loss), {1}, ShardSpec{}, false});
}

void GptModel::Records(RankContext& ctx, std::vector<TensorRecord>* records) const {
  records->insert(records->end(), recorded_.begin(), recorded_.end());
  RecordParameters(records);
  // The routers' expert biases as Megatron's state dict names them (float32 [E], the same on
  // every rank).
  expert_bias_records_.clear();
  for (const HeldMoe& l : MoeLayers()) {
    if (l.moe->expert_bias().empty()) continue;
    const std::vector<float>& bias = l.moe->expert_bias();
    Tensor host = Tensor::HostEmpty({static_cast<int64_t>(bias.size())}, DType::kFloat32);
    std::copy(bias.begin(), bias.end(), host.data_as<float>());
    expert_bias_records_.push_back(ctx.kernels->ToDevice(host));
    records->push_back({l.name + ".mlp.router.expert_bias", expert_bias_records_.back(),
                        host.shape(), ShardSpec{}, false});
  }
}

void GptModel::AfterOptimizerStep(RankContext& ctx) {
  std::vector<const MoeLayer*> biased;
  for (const HeldMoe& l : MoeLayers()) {
    if (!l.moe->expert_bias().empty()) biased.push_back(l.moe);
  }
  if (biased.empty()) return;
  // finalize_model_grads's _update_router_expert_bias: the counts of every layer stacked
  // (float32) and all-reduced over tp x dp x cp: over tp (sequence parallelism: each tp rank
  // routed its own tokens), then over dp x cp.
  Kernels& k = *ctx.kernels;
  const size_t E = biased.front()->expert_bias().size();
  Tensor host = Tensor::HostEmpty({static_cast<int64_t>(biased.size() * E)}, DType::kFloat32);
  for (size_t l = 0; l < biased.size(); ++l) {
    const std::vector<int64_t>& counts = biased[l]->tokens_per_expert();
    for (size_t e = 0; e < E; ++e) host.data_as<float>()[l * E + e] = static_cast<float>(counts[e]);
  }
  Tensor counts = k.ToDevice(host);
  ctx.trace->SetSite("finalize_model_grads (expert bias)");
  if (ctx.tp().Size() > 1) ctx.tp().AllReduce(counts, ReduceOp::kSum);
  if (ctx.dp_cp().Size() > 1) ctx.dp_cp().AllReduce(counts, ReduceOp::kSum);
  const Tensor summed = k.ToHost(counts);
  for (size_t l = 0; l < biased.size(); ++l) {
    const float* c = summed.data_as<float>() + l * E;
    biased[l]->UpdateExpertBias(std::vector<float>(c, c + E));
  }
}

std::vector<ExpertLoad> GptModel::ExpertLoads() const {
  std::vector<ExpertLoad> loads;
  for (const HeldMoe& l : MoeLayers()) {
    loads.push_back({l.number, l.moe->tokens_per_expert(), l.moe->expert_bias()});
  }
  return loads;
}

void GptModel::RecordParameters(std::vector<TensorRecord>* records) const {
  for (const auto& p : params_.all()) {
    records->push_back({p->name, p->value, p->full_shape, p->shard, false});
    records->push_back({p->name + ".grad", p->grad, p->full_shape, p->shard, false});
  }
}

}  // namespace mpusim
