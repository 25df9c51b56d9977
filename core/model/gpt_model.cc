// The GPT model (see gpt_model.h).
#include "core/model/gpt_model.h"

#include <fmt/format.h>

#include "core/init.h"
#include "core/rng.h"
#include "core/tensor_parallel/mappings.h"

namespace mpusim {

namespace {

// Megatron-Core's streams for each GPT dropout site (core/dropout.h, "rng_tracker"), in
// forward order: the embedding, then per layer attention, self_attn_bda, mlp_bda.
TrackerDraws MakeTrackerDraws(const GptConfig& gpt, uint64_t seed, const RankCoordinates& coords,
                              bool sequence_parallel) {
  TrackerDraws t;
  t.default_key = DefaultSeed(seed, coords.pp, coords.dp);
  t.model_parallel_key = ModelParallelSeed(t.default_key, coords.tp);
  const auto add = [&](std::string site, bool model_parallel, double p) {
    if (p == 0.0) return;
    int64_t& count = model_parallel ? t.model_parallel_per_microbatch : t.default_per_microbatch;
    t.sites[std::move(site)] = {model_parallel, count++};
  };
  add("embedding.embedding_dropout", sequence_parallel, gpt.hidden_dropout);
  for (int64_t i = 0; i < gpt.num_layers; ++i) {
    const std::string layer = fmt::format("decoder.layers.{}", i);
    add(layer + ".self_attention.core_attention.attention_dropout", true, gpt.attention_dropout);
    add(layer + ".self_attn_bda", sequence_parallel, gpt.hidden_dropout);
    add(layer + ".mlp_bda", sequence_parallel, gpt.hidden_dropout);
  }
  return t;
}

}  // namespace

StatusOr<std::unique_ptr<GptModel>> GptModel::Build(const Config& config, const Topology& topology,
                                                    const RankCoordinates& coords) {
  if (!config.gpt || !config.run) {
    return Status::Error(config.gpt ? "run" : "model",
                         "is required by mpusim run (see docs/simulator.md)");
  }
  std::unique_ptr<GptModel> model(new GptModel());
  model->gpt_ = *config.gpt;
  model->run_ = *config.run;
  MPUSIM_RETURN_IF_ERROR(CheckGptLayout(config.parallel, model->run_, &model->gpt_));
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
  // Megatron turns sequence parallelism off when tp = 1.
  sh.sequence_parallel = config.parallel.sequence_parallel && t > 1;

  const GptConfig& gpt = model->gpt_;
  for (const GptParameter& p : GptParameters(gpt, model->padded_vocab_, sh.sequence_parallel)) {
    model->params_.Add(p.name, p.shape, p.init, p.tp_dim, p.tp_stride, p.sequence_parallel, t,
                       coords.tp);
  }
  ParameterSet& params = model->params_;
  model->word_ = &params.Get("embedding.word_embeddings.weight");
  model->position_ = params.Find("embedding.position_embeddings.weight");
  model->layers_.reserve(static_cast<size_t>(gpt.num_layers));
  for (int64_t i = 0; i < gpt.num_layers; ++i) {
    model->layers_.emplace_back(gpt, fmt::format("decoder.layers.{}", i), params, t,
                                model->run_.recompute);
  }
  model->final_norm_.emplace(gpt.normalization, gpt.layernorm_epsilon,
                             &params.Get("decoder.final_layernorm.weight"),
                             params.Find("decoder.final_layernorm.bias"));
  Parameter* output = gpt.share_embeddings_and_output_weights ? model->word_
                                                              : &params.Get("output_layer.weight");
  model->output_layer_.emplace(output, nullptr);
  if (gpt.dropout_mode == DropoutMode::kRngTracker) {
    model->tracker_ = MakeTrackerDraws(gpt, model->run_.seed, coords, sh.sequence_parallel);
  }
  return model;
}

void GptModel::InitializeParameters(Kernels& k) { params_.Initialize(k, run_.seed, run_.dtype); }

GptModel::Batch GptModel::MakeBatch(Kernels& k, int64_t microbatch) const {
  const StreamShape& sh = shape_;
  Tensor tokens = Tensor::HostEmpty({sh.s, sh.b}, DType::kInt64);
  Tensor labels = Tensor::HostEmpty({sh.s, sh.b}, DType::kInt64);
  Tensor positions = Tensor::HostEmpty({sh.s, sh.b}, DType::kInt64);
  const std::string text = fmt::format("text.mb{}", microbatch);
  for (int64_t i = 0; i < sh.s; ++i) {
    for (int64_t j = 0; j < sh.b; ++j) {
      const int64_t gs = sh.dp_rank * sh.b + j;
      const int64_t row = i * sh.b + j;
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
  const int64_t rows = sh.s * sh.b, h = gpt_.hidden_size;
  const int64_t vocab_local = word_->value.rows();
  const int64_t vstart = sh.tp_rank * vocab_local;
  Tensor words = k.Empty({rows, h}, run_.dtype);
  k.EmbeddingForward(word_->value, batch.tokens, vstart, vstart + vocab_local, words);
  Tensor embeddings;
  if (position_ != nullptr) {
    embeddings = MappingForward(k, ctx.tp, Mapping::kReduceFromTp, words);
    Tensor positions = k.Empty({rows, h}, run_.dtype);
    k.EmbeddingForward(position_->value, batch.positions, 0, position_->value.rows(), positions);
    k.Axpy(1.0, positions, embeddings);
    if (sh.sequence_parallel) embeddings = SplitFirstDim(k, ctx.tp, embeddings);
  } else {
    embeddings = sh.sequence_parallel
                     ? ReduceScatterFirstDim(k, ctx.tp, words)
                     : MappingForward(k, ctx.tp, Mapping::kReduceFromTp, words);
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
  // The backward of the scatter (or of the reduce-scatter) is an all-gather; that of the
  // reduce_from all-reduce is the identity.
  const Tensor full = sh.sequence_parallel ? AllGatherFirstDim(k, ctx.tp, ddrop) : ddrop;
  if (position_ != nullptr) {
    k.EmbeddingBackward(full, batch.positions, 0, position_->value.rows(), position_->grad);
  }
  const int64_t vocab_local = word_->value.rows();
  const int64_t vstart = sh.tp_rank * vocab_local;
  k.EmbeddingBackward(full, batch.tokens, vstart, vstart + vocab_local, word_->grad);
}

double GptModel::Forward(const ModuleContext& ctx, const Batch& batch, Stash* stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = shape_;
  ctx.trace.SetPhase(Phase::kForward);
  ctx.trace.SetSite("embedding");
  Tensor x = EmbeddingForward(ctx, batch, stash);
  stash->layers.resize(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    ctx.trace.SetSite(fmt::format("decoder.layers.{}", i));
    x = layers_[i].Forward(ctx, x, &stash->layers[i]);
  }
  ctx.trace.SetSite("output_layer");
  const Tensor final = final_norm_->Forward(ctx, x, &stash->final_norm);
  ctx.Record("decoder.final_layernorm.output", final, {sh.s, sh.B, final.cols()},
             sh.StreamSpec(d_));
  const Tensor logits = output_layer_->Forward(ctx, final, &stash->output_layer);
  ctx.Record("output_layer.output", logits, {sh.s, sh.B, padded_vocab_}, sh.ColumnSpec(d_, 1));
  const Tensor losses = VocabParallelCrossEntropyForward(
      k, ctx.tp, logits, batch.labels, padded_vocab_, gpt_.label_smoothing, &stash->loss);
  ctx.Record("loss.per_token", losses.Reshaped({sh.s, sh.b}), {sh.s, sh.B}, sh.BatchSpec(1, d_));
  const Tensor host = k.ToHost(losses);
  double sum = 0;
  for (int64_t i = 0; i < host.numel(); ++i) sum += HostValue(host, i);
  return sum;
}

void GptModel::Backward(const ModuleContext& ctx, const Batch& batch, Stash& stash) const {
  Kernels& k = ctx.k;
  const StreamShape& sh = shape_;
  ctx.trace.SetPhase(Phase::kBackward);
  ctx.trace.SetSite("output_layer");
  const int64_t rows = sh.s * sh.b;
  const DType stats = ComputeDType(run_.dtype);
  Tensor dloss_host = Tensor::HostEmpty({rows}, stats);
  const double scale = 1.0 / static_cast<double>(run_.num_microbatches * sh.s * sh.B);
  for (int64_t i = 0; i < rows; ++i) SetHostValue(dloss_host, i, scale);
  const Tensor dloss = k.ToDevice(dloss_host);
  ctx.Record("loss.per_token_grad", dloss.Reshaped({sh.s, sh.b}), {sh.s, sh.B}, sh.BatchSpec(1, d_));
  const Tensor dlogits = VocabParallelCrossEntropyBackward(
      k, stash.loss, batch.labels, padded_vocab_, gpt_.label_smoothing, sh.tp_rank, dloss);
  ctx.Record("output_layer.output_grad", dlogits, {sh.s, sh.B, padded_vocab_}, sh.ColumnSpec(d_, 1));
  const Tensor dfinal = output_layer_->Backward(ctx, dlogits, stash.output_layer);
  ctx.Record("decoder.final_layernorm.output_grad", dfinal, {sh.s, sh.B, dfinal.cols()},
             sh.StreamSpec(d_));
  Tensor dx = final_norm_->Backward(ctx, dfinal, stash.final_norm);
  for (size_t i = layers_.size(); i-- > 0;) {
    ctx.trace.SetSite(fmt::format("decoder.layers.{}", i));
    dx = layers_[i].Backward(ctx, dx, stash.layers[i]);
  }
  ctx.trace.SetSite("embedding");
  EmbeddingBackward(ctx, batch, dx);
}

void GptModel::Run(RankContext& ctx, std::vector<TensorRecord>* records) {
  Kernels& k = *ctx.kernels;
  params_.ZeroGrads(k);
  double loss_sum = 0;
  const int64_t M = run_.num_microbatches;
  for (int64_t m = 0; m < M; ++m) {
    const Batch batch = MakeBatch(k, m);
    ModuleContext mctx{k, ctx.tp(), *ctx.trace, shape_, d_,
                       DropoutDraw{run_.seed, 0, m, tracker_ ? &*tracker_ : nullptr},
                       fuse_wgrad_, m + 1 == M ? records : nullptr};
    Stash stash;
    loss_sum += Forward(mctx, batch, &stash);
    Backward(mctx, batch, stash);
    if (m + 1 == M && records != nullptr) {
      const ShardSpec batch_split = shape_.BatchSpec(1, d_);
      // Recorded as float64 [s, b], as dumps and the check hold them.
      for (const auto* ids : {&batch.tokens, &batch.labels}) {
        records->push_back({ids == &batch.tokens ? "tokens" : "labels",
                            k.ToDevice(HostToFloat64(k.ToHost(*ids))), {shape_.s, shape_.B},
                            batch_split, false});
      }
    }
  }
  params_.FinalizeGrads(ctx.tp(), ctx.dp_cp(), *ctx.trace);
  // The reported loss: mean over every token of every micro-batch on every dp rank.
  Tensor total = Tensor::HostEmpty({1}, DType::kFloat64);
  total.data_as<double>()[0] = loss_sum;
  Tensor device_total = k.ToDevice(total);
  ctx.trace->SetSite("loss");
  if (d_ > 1) ctx.dp().AllReduce(device_total, ReduceOp::kSum);
  loss_ = HostValue(k.ToHost(device_total), 0) /
          static_cast<double>(M * shape_.s * shape_.B);
  if (records == nullptr) return;
  for (const auto& p : params_.all()) {
    records->push_back({p->name, p->value, p->full_shape, p->shard, false});
    records->push_back({p->name + ".grad", p->grad, p->full_shape, p->shard, false});
  }
  Tensor loss = Tensor::HostEmpty({1}, DType::kFloat64);
  loss.data_as<double>()[0] = loss_;
  records->push_back({"loss", k.ToDevice(loss), {1}, ShardSpec{}, false});
}

}  // namespace mpusim
