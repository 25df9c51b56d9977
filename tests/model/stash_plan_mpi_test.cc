// The declared stashes (core/model/stash_plan.h) against the executor: after a real forward
// step of a chunk on every rank, the bytes its Stash holds (the backend's live tensor bytes
// the step added, less its output, plus its input when the chunk receives one) equal what the
// modules declare, to the byte, and freeing the stash frees all of them. Two ways:
//   - each chunk of the planner's assignment against ExecutorStash, the declaration as the
//     executor's activation count sums it (core/estimate/executor_activations.h);
//   - on layouts without a pipeline, the model cut into one chunk per part (the embedding,
//     each layer, the head) against GptModel::PlanStash of that part, so a failure names the
//     module whose declaration is off.
// Layouts: tp with sequence parallelism, each cp_comm_type, qk_layernorm, LayerNorm and
// RMSNorm, both dropouts, selective and full recomputation (every layer alone, uniform groups
// of 2 and 3, block over 1, 2 and 3 layers per chunk; selective "layernorm" and "mlp"), pp
// with vp, uneven pipeline splits (chunks without layers among them), bfloat16, and MoE
// layers (both dispatchers, the experts on the tp group or apart, a shared expert) where no
// rank can be routed unevenly (ep 1 without a capacity), so balanced routing is exact,
// multi-latent attention (with each cp_comm_type too) and multi-token prediction.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/estimate/executor_activations.h"
#include "core/model/gpt_model.h"
#include "core/model/stash_plan.h"
#include "core/model/transformer_layer.h"
#include "core/topology.h"
#include "run/simulate.h"
#include "sim/cpu_backend.h"
#include "tests/model/gpt_mpi_helpers.h"
#include "tests/mpi/world.h"

namespace mpusim {
namespace {

using nlohmann::json;
using namespace gpt_mpi;

struct Layout {
  // "dense", "moe" (allgather), "moe_a2a", "moe_gg" (grouped GEMM), "mla" (dense with
  // multi-latent attention), "mla_q_proj" (the same with q_lora_rank null), "mtp" (dense,
  // two multi-token prediction depths), "moe_mtp" ("moe" with the two depths: MoE layers)
  const char* model;
  int64_t tp, pp, vp, cp, etp;  // etp 0: tp's
  const char* cp_comm = nullptr;
  const char* recompute = nullptr;
  const char* dtype = "float32";
  bool qk_norm = false;
  bool layer_norm = false;  // LayerNorm (mean and rstd) instead of RMSNorm
  double dropout = 0.1;     // hidden and attention
  const char* split = nullptr;  // JSON: the parallel section's uneven split keys
};

std::string Name(const Layout& l) {
  return fmt::format("{} tp {} pp {} vp {} cp {}{} etp {}{}{}{} {} dropout {}", l.model, l.tp, l.pp,
                     l.vp, l.cp, l.cp_comm ? fmt::format(" {}", l.cp_comm) : "",
                     l.etp > 0 ? l.etp : l.tp,
                     l.recompute ? fmt::format(" recompute {}", l.recompute) : "",
                     l.qk_norm ? " qk_layernorm" : "", l.layer_norm ? " LayerNorm" : "", l.dtype,
                     l.dropout) +
         (l.split ? fmt::format(" split {}", l.split) : "");
}

// The layout's config on the world's ranks, or nullopt where they cannot hold it.
std::optional<Config> LayoutConfig(const Layout& l) {
  const int64_t w = WorldSize(), model_ranks = l.tp * l.pp * l.cp;
  if (model_ranks > w || w % model_ranks != 0) return std::nullopt;
  if (l.etp > 0 && (l.etp * l.pp > w || w % (l.etp * l.pp) != 0)) return std::nullopt;
  json model = Llama(8, 4);
  model["num_layers"] = 4;
  model["hidden_dropout"] = l.dropout;
  model["attention_dropout"] = l.dropout;
  if (l.qk_norm) model["qk_layernorm"] = true;
  if (l.layer_norm) model["normalization"] = "LayerNorm";
  if (std::string(l.model).starts_with("mla")) {
    model.erase("num_query_groups");
    model["multi_latent_attention"] = true;
    model["q_lora_rank"] = std::string(l.model) == "mla" ? json(16) : json(nullptr);
    model["kv_lora_rank"] = 8;
    model["qk_head_dim"] = 8;
    model["qk_pos_emb_head_dim"] = 8;
    model["v_head_dim"] = 6;
  } else if (std::string(l.model) == "mtp") {
    model["mtp_num_layers"] = 2;
  } else if (std::string(l.model) != "dense") {
    if (std::string(l.model) == "moe_mtp") model["mtp_num_layers"] = 2;
    model["num_moe_experts"] = 4;
    model["moe_router_topk"] = 2;
    model["moe_ffn_hidden_size"] = 16;
    model["moe_shared_expert_intermediate_size"] = 16;
    model["moe_layer_freq"] = json::array({1, 0, 1, 1});
    if (std::string(l.model) == "moe_a2a") model["moe_token_dispatcher_type"] = "alltoall";
    if (std::string(l.model) == "moe_gg") model["moe_grouped_gemm"] = true;
  }
  if (l.cp_comm != nullptr) model["cp_comm_type"] = l.cp_comm;
  json document = Document(model, l.tp, l.tp > 1, l.dtype, l.recompute);
  json& parallel = document["parallel"];
  parallel["pipeline_model_parallel_size"] = l.pp;
  if (l.vp > 1) parallel["virtual_pipeline_model_parallel_size"] = l.vp;
  if (l.split != nullptr) parallel.update(json::parse(l.split));
  parallel["context_parallel_size"] = l.cp;
  if (l.etp > 0) parallel["expert_tensor_parallel_size"] = l.etp;
  if (l.cp_comm != nullptr && std::string(l.cp_comm) == "a2a+p2p") {
    parallel["hierarchical_context_parallel_sizes"] = {2, l.cp / 2};
  }
  const int64_t dp = w / model_ranks;
  document["run"]["micro_batch_size"] = Samples() / dp;
  document["run"]["seq_length"] = 8 * l.cp;
  document["run"]["num_microbatches"] = 2 * l.pp;
  return MakeConfig(document);
}

// The bytes chunk `chunk`'s stash holds after a forward step on this rank: what the step left
// allocated, less its output (the next stage's input), plus the input it was given (a chunk
// after the first keeps it as its first layer's input). Expects freeing the stash to free
// them all.
int64_t StashBytes(GptModel& model, RankContext& ctx, const StreamShape& shape, DType dtype,
                   int64_t chunk) {
  Kernels& k = *ctx.kernels;
  const auto bytes = [](const Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.bytes()) : 0;
  };
  Tensor input;
  const GptChunk& spec = model.chunks().at(static_cast<size_t>(chunk));
  if (!spec.pre_process) {
    input = k.Zeros({shape.stream_rows(), model.gpt().hidden_size}, dtype);
  }
  // A chunk without layers, embedding or head (an empty stage of an uneven split) passes its
  // input on: its output is the input, allocated before the step, and it keeps nothing.
  const bool passes_on = spec.layers.empty() && !spec.pre_process && !spec.post_process;
  const int64_t before = k.tensor_bytes().live;
  std::unique_ptr<StepStash> stash = model.NewStash(chunk);
  const Tensor output = model.ForwardStep({ctx, chunk, 0}, input, *stash);
  const int64_t created = passes_on ? 0 : bytes(output);
  const int64_t held = k.tensor_bytes().live - before - created + (passes_on ? 0 : bytes(input));
  stash.reset();
  EXPECT_EQ(k.tensor_bytes().live, before + created)
      << "chunk " << chunk << ": freeing its stash leaves tensors the stash did not hold";
  return held;
}

// `declared`'s tensors, one line each, for a failure message.
std::string Listing(const StashPlan& declared) {
  std::string out;
  for (const StashTensor& t : declared.tensors()) {
    out += fmt::format("  {} [{}] {} {} B\n", t.name, fmt::join(t.shape, ", "), DTypeName(t.dtype),
                       t.bytes());
  }
  return out;
}

void ExpectDeclared(int64_t held, const StashPlan& declared, const std::string& what) {
  EXPECT_EQ(held, std::llround(declared.bytes()))
      << what << " on rank " << WorldRank() << ": the stash holds " << held
      << " B, its declaration " << declared.bytes() << " B:\n"
      << Listing(declared);
}

TEST(StashPlan, EveryChunkHoldsWhatItsModulesDeclare) {
  const std::vector<Layout> layouts = {
      {"dense", 1, 1, 1, 1, 0},
      {"dense", 2, 1, 1, 1, 0, nullptr, nullptr, "float32", true, true},
      {"dense", 2, 1, 1, 1, 0, nullptr, "selective", "bfloat16"},
      {"dense", 1, 1, 1, 1, 0, nullptr, "full", "float32", false, true, 0.0},
      {"dense", 1, 2, 2, 1, 0, nullptr, nullptr, "float32", false, false, 0.0},
      {"dense", 2, 2, 1, 1, 0, nullptr, "full", "bfloat16"},
      {"dense", 1, 1, 1, 2, 0, "all_gather", nullptr, "float32", true},
      {"dense", 1, 1, 1, 2, 0, "p2p"},
      {"dense", 2, 1, 1, 2, 0, "a2a", "selective", "float32", true},
      {"dense", 1, 1, 1, 4, 0, "a2a+p2p", nullptr, "float32", false, true},
      {"moe", 1, 1, 1, 1, 0},
      {"moe", 2, 1, 1, 1, 0, nullptr, "selective", "float32", false, false, 0.0},
      {"moe", 2, 1, 1, 1, 1, nullptr, nullptr, "bfloat16"},
      {"moe_a2a", 1, 1, 1, 1, 0},
      {"moe_a2a", 2, 1, 1, 1, 1, nullptr, "full"},
      // Full recomputation's methods: uniform groups of 2, of 3 (the last group cut at the
      // chunk's end; on pp 2 one group per chunk), block over 1 and 2 layers of each chunk.
      {"dense", 1, 1, 1, 1, 0, nullptr, "full uniform 2"},
      {"dense", 1, 1, 1, 1, 0, nullptr, "full uniform 3", "float32", false, true},
      {"dense", 2, 2, 1, 1, 0, nullptr, "full uniform 3", "bfloat16"},
      {"dense", 1, 2, 2, 1, 0, nullptr, "full block 1"},
      {"dense", 2, 1, 1, 1, 0, nullptr, "full block 2"},
      {"moe", 1, 1, 1, 1, 0, nullptr, "full block 3"},
      {"moe_a2a", 1, 1, 1, 1, 0, nullptr, "full uniform 2"},
      // Selective recompute_modules: the norms (LayerNorm's mean too), the dense MLP, all
      // three with a cp ring and the q/k norms, and on MoE layers (whose MLP "mlp" leaves).
      {"dense", 2, 1, 1, 1, 0, nullptr, "selective layernorm", "float32", false, true},
      {"dense", 1, 1, 1, 1, 0, nullptr, "selective mlp", "bfloat16"},
      {"dense", 2, 1, 1, 2, 0, "p2p", "selective core_attn,layernorm,mlp", "float32", true},
      {"moe", 2, 1, 1, 1, 0, nullptr, "selective layernorm,mlp"},
      {"moe_a2a", 1, 2, 1, 1, 0, nullptr, "selective mlp,layernorm,core_attn"},
      // The MoE modules: the experts' activation, the shared expert, the whole layer, and
      // with the norms.
      {"moe_gg", 1, 1, 1, 1, 0, nullptr, "selective moe_act"},
      {"moe", 2, 1, 1, 1, 0, nullptr, "selective shared_experts"},
      {"moe_a2a", 1, 1, 1, 1, 0, nullptr, "selective moe"},
      {"moe", 2, 1, 1, 1, 1, nullptr, "selective moe,layernorm", "bfloat16"},
      {"moe_gg", 2, 1, 1, 1, 0, nullptr, "selective moe_act,shared_experts,layernorm"},
      // Uneven pipeline splits: an embedding-only and a loss-only chunk, a chunk that passes
      // its input on, stages of 1 and 3 layers.
      {"dense", 1, 2, 1, 1, 0, nullptr, nullptr, "float32", false, false, 0.1,
       R"({"pipeline_model_parallel_layout": "E|tt|tt|L"})"},
      {"dense", 1, 2, 1, 1, 0, nullptr, "full", "float32", false, false, 0.1,
       R"({"pipeline_model_parallel_layout": "Et||ttt|L"})"},
      // Recomputation groups in chunks of their own sizes: uniform 2 over a chunk of 3
      // layers, block 2 over chunks of 1 and 3.
      {"dense", 1, 2, 1, 1, 0, nullptr, "full uniform 2", "float32", false, false, 0.1,
       R"({"pipeline_model_parallel_layout": "Et||ttt|L"})"},
      {"dense", 1, 2, 1, 1, 0, nullptr, "full block 2", "float32", false, false, 0.1,
       R"({"decoder_first_pipeline_num_layers": 1})"},
      {"dense", 1, 2, 1, 1, 0, nullptr, "selective", "float32", false, false, 0.1,
       R"({"decoder_last_pipeline_num_layers": 3})"},
      {"moe", 1, 2, 1, 1, 0, nullptr, nullptr, "float32", false, false, 0.1,
       R"({"decoder_first_pipeline_num_layers": 1})"},
      // Multi-latent attention: its latents (and their norms' outputs with qk_layernorm),
      // query, key, value, probabilities; selective core_attn and layernorm, full, tp with
      // sequence parallelism, pp with vp.
      {"mla", 1, 1, 1, 1, 0},
      {"mla", 2, 1, 1, 1, 0, nullptr, nullptr, "float32", true, true},
      {"mla_q_proj", 2, 1, 1, 1, 0, nullptr, "selective core_attn,layernorm", "bfloat16", true},
      {"mla", 1, 1, 1, 1, 0, nullptr, "full", "float32", false, false, 0.0},
      {"mla", 1, 2, 2, 1, 0, nullptr, "selective", "float32", true},
      // With context parallelism: the keys and values core attention gathers ("all_gather")
      // or exchanges ("a2a"), the ring's stash ("p2p", "a2a+p2p").
      {"mla", 1, 1, 1, 2, 0, "all_gather"},
      {"mla", 1, 1, 1, 2, 0, "p2p", nullptr, "float32", true},
      {"mla_q_proj", 1, 1, 1, 2, 0, "a2a"},
      {"mla", 2, 1, 1, 2, 0, "a2a+p2p", "selective core_attn", "bfloat16", true},
      // Multi-token prediction's depths on the last chunk: with dropout, tp 2 + sp, a
      // pipeline with virtual stages, selective recomputation in bfloat16, full by block (the
      // depths' layers kept whole).
      {"mtp", 1, 1, 1, 1, 0},
      {"mtp", 2, 2, 1, 1, 0},
      {"mtp", 1, 2, 2, 1, 0, nullptr, nullptr, "float32", false, false, 0.0},
      {"mtp", 2, 1, 1, 1, 0, nullptr, "selective layernorm,mlp", "bfloat16"},
      {"mtp", 1, 2, 1, 1, 0, nullptr, "full block 1"},
      // Full recomputation by "uniform": each depth keeps its checkpoint's inputs alone.
      {"mtp", 1, 1, 1, 1, 0, nullptr, "full uniform 1"},
      {"mtp", 2, 2, 1, 1, 0, nullptr, "full uniform 1", "bfloat16"},
      // The depths as MoE layers (the last decoder layer's spec): alone, and with tp 2 + sp on
      // a pipeline.
      {"moe_mtp", 1, 1, 1, 1, 0},
      {"moe_mtp", 2, 2, 1, 1, 0},
  };
  int64_t compared = 0;
  for (const Layout& l : layouts) {
    const std::optional<Config> config = LayoutConfig(l);
    if (!config) continue;
    const std::string name = Name(l);
    SCOPED_TRACE(name);
    StatusOr<Topology> topology = Topology::Create(config->parallel);
    ASSERT_TRUE(topology.ok()) << topology.status().Message();
    const int rank = WorldRank();
    const RankCoordinates coords = topology->Coordinates(rank);
    const DerivedSizes& sz = topology->sizes();
    const GptConfig& gpt = *config->gpt;
    const DType dtype = config->run->dtype;
    const StreamShape shape{.s = config->run->seq_length,
                            .b = config->run->micro_batch_size,
                            .t = sz.tp,
                            .sequence_parallel = config->parallel.sequence_parallel && sz.tp > 1,
                            .cp = sz.cp};
    CpuBackend backend;
    CommTrace trace;
    RankContext ctx = run::MakeRankContext(*config, backend, *topology, rank, &trace);

    // The planner's chunks, against the declaration the executor's count sums.
    StatusOr<std::unique_ptr<GptModel>> model = GptModel::Build(*config, *topology, coords);
    ASSERT_TRUE(model.ok()) << model.status().Message();
    (*model)->InitializeParameters(*ctx.kernels);
    (*model)->BeginStep(ctx, 0, false);
    for (int64_t c = 0; c < (*model)->num_model_chunks(); ++c) {
      const int64_t u = c * sz.pp + coords.pp;
      StatusOr<StashPlan> declared = ExecutorStash(*config, *topology, u);
      ASSERT_TRUE(declared.ok()) << declared.status().Message();
      ExpectDeclared(StashBytes(**model, ctx, shape, dtype, c), *declared,
                     fmt::format("virtual stage {}", u));
      ++compared;
    }
    EXPECT_FALSE(ExecutorStash(*config, *topology, sz.pp * sz.vp.value_or(1)).ok());
    if (rank == 0) fmt::print("  {}: each chunk holds what it declares\n", name);
    if (sz.pp > 1 || gpt.moe.enabled()) continue;

    // One chunk per part: the embedding, each layer, the head.
    std::vector<GptChunk> parts = {{.layers = {}, .pre_process = true, .post_process = false}};
    for (int64_t i = 0; i < gpt.num_layers; ++i) parts.push_back({.layers = {i}});
    parts.push_back({.layers = {}, .pre_process = false, .post_process = true});
    StatusOr<std::unique_ptr<GptModel>> cut = GptModel::Build(*config, *topology, coords, parts);
    ASSERT_TRUE(cut.ok()) << cut.status().Message();
    (*cut)->InitializeParameters(*ctx.kernels);
    (*cut)->BeginStep(ctx, 0, false);
    // Each part a chunk of its own: a layer is its chunk's first (and only) one.
    const StashPlan layer =
        TransformerLayer::PlanStash(gpt, shape, dtype, LayerRecompute::Of(*config->run, 0, 1));
    // Multi-token prediction's layers: kept but for what selective recomputation drops.
    const StashPlan mtp_layer =
        TransformerLayer::PlanStash(gpt, shape, dtype, LayerRecompute::Kept(*config->run));
    for (size_t c = 0; c < parts.size(); ++c) {
      const std::vector<StashPlan> layers(parts[c].layers.size(), layer);
      const StashPlan declared = GptModel::PlanStash(
          gpt, shape, dtype, parts[c], layers, &mtp_layer, config->run->CheckpointsMtpDepths());
      const std::string part = parts[c].pre_process    ? std::string("the embedding")
                               : parts[c].post_process ? std::string("the head")
                                                       : fmt::format("layer {}", c - 1);
      ExpectDeclared(StashBytes(**cut, ctx, shape, dtype, static_cast<int64_t>(c)), declared, part);
      ++compared;
    }
    if (rank == 0) fmt::print("  {}: so do the embedding, each layer and the head\n", name);
  }
  if (WorldRank() == 0) fmt::print("  {} stashes compared on rank 0\n", compared);
}

}  // namespace
}  // namespace mpusim
