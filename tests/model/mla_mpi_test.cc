// Multi-latent attention (MLASelfAttention, core/model/mla_attention.h) on K MPI ranks against
// the float64 GPT reference (reference/mla_reference.h): every tp in {1, 2, 4} with and
// without sequence parallelism, q_lora_rank set and null, qk_layernorm, rope_type "yarn" and
// "rope", LayerNorm with biases, in float64 and float32; pipelines (two stages, two of two
// virtual ones) and data parallelism with the distributed optimizer training three Adam
// iterations as one rank does; MoE layers with expert parallelism; bfloat16 with selective
// (core_attn) and full recomputation; the executor's activation count (the run's memory
// preflight) against the measured peak, to the byte. The q/k head dim (qk + pe = 16) differs
// from the value's (6), YaRN's ramp has both ends inside the rope channels, and mscale
// differs from mscale_all_dim so that the rope's cos/sin factor and the softmax scale's
// mscale^2 both change the model.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/topology.h"
#include "run/preflight.h"
#include "tests/model/gpt_mpi_helpers.h"
#include "tests/mpi/world.h"
#include "tests/sanitizers.h"

namespace mpusim {
namespace {

using nlohmann::json;
using namespace gpt_mpi;

// A Llama-style model of 4 heads with MLA: q_lora_rank 16 (or null), kv_lora_rank 8, qk_head_dim
// 8, qk_pos_emb_head_dim 8, v_head_dim 6; YaRN over an original context of 4 positions (its
// ramp interpolates some channel pairs and extrapolates others on 8 tokens).
json Mla(bool q_lora = true, const char* rope_type = "yarn") {
  json model = Llama(4, 4);
  model.erase("num_query_groups");
  model["vocab_size"] = 64;  // padded alike on every tp size: every layout trains one model
  model["multi_latent_attention"] = true;
  model["q_lora_rank"] = q_lora ? json(16) : json(nullptr);
  model["kv_lora_rank"] = 8;
  model["qk_head_dim"] = 8;
  model["qk_pos_emb_head_dim"] = 8;
  model["v_head_dim"] = 6;
  model["rope_type"] = rope_type;
  model["rotary_scaling_factor"] = 40.0;
  model["original_max_position_embeddings"] = 4;
  model["mscale"] = 1.0;
  model["mscale_all_dim"] = 0.5;
  return model;
}

// `model` on tp x pp (x vp) ranks, dp filling the world.
json MlaDocument(const json& model, int64_t tp, int64_t pp, bool sp, const char* dtype,
                 int64_t vp = 0) {
  json document = Document(model, tp, sp, dtype);
  document["parallel"]["pipeline_model_parallel_size"] = pp;
  if (vp > 0) document["parallel"]["virtual_pipeline_model_parallel_size"] = vp;
  document["run"]["micro_batch_size"] = Samples() / (WorldSize() / (tp * pp));
  return document;
}

// The cp_comm_types of cp x tp on the 4 heads: "a2a" where they divide over tp x cp,
// "a2a+p2p" (level 0 of 2 cp ranks) over tp x 2.
std::vector<const char*> MlaComms(int64_t cp, int64_t tp) {
  std::vector<const char*> comms = {"all_gather", "p2p"};
  if (4 % (tp * cp) == 0) comms.push_back("a2a");
  if (4 % (tp * 2) == 0) comms.push_back("a2a+p2p");
  return comms;
}

double Loss(const json& document) {
  StatusOr<run::SimulationResult> result = Simulate(document, false);
  EXPECT_TRUE(result.ok()) << result.status().Message();
  return result.ok() ? result->loss : 0.0;
}

// The model's variants: the query's down projection or not, the latent norms, the plain rope,
// a GPT-style LayerNorm model with biases (linear_proj's).
std::vector<std::pair<std::string, json>> Variants() {
  std::vector<std::pair<std::string, json>> variants;
  variants.emplace_back("q_lora yarn", Mla());
  variants.emplace_back("q_proj yarn", Mla(false));
  json norms = Mla();
  norms["qk_layernorm"] = true;
  variants.emplace_back("q_lora qk_layernorm yarn", norms);
  variants.emplace_back("q_proj qk_layernorm rope", [] {
    json m = Mla(false, "rope");
    m["qk_layernorm"] = true;
    return m;
  }());
  json gpt = Mla();
  gpt["normalization"] = "LayerNorm";
  gpt["add_bias_linear"] = true;
  gpt["qk_layernorm"] = true;
  variants.emplace_back("LayerNorm biases qk_layernorm yarn", gpt);
  return variants;
}

// Leaving out what MLA adds changes the model: the rope's mscale (mscale = mscale_all_dim), the
// softmax scale's (mscale_all_dim 0), the YaRN frequencies (rope_type "rope").
TEST(MlaAttention, ItsScalesAndRopeChangeTheModel) {
  // Weights of std 0.5: scores far from 0, so the scale and the rope move the loss.
  const auto sharp = [](json model) {
    model["init_method_std"] = 0.5;
    return model;
  };
  const double loss = Loss(MlaDocument(sharp(Mla()), 1, 1, false, "float64"));
  json same_mscale = Mla();
  same_mscale["mscale_all_dim"] = 1.0;
  json no_softmax_mscale = Mla();
  no_softmax_mscale["mscale_all_dim"] = 0.0;
  for (const json& other : {same_mscale, no_softmax_mscale, Mla(true, "rope")}) {
    const double other_loss = Loss(MlaDocument(sharp(other), 1, 1, false, "float64"));
    EXPECT_GT(std::fabs(other_loss - loss), 1e-4 * loss) << other.dump();
  }
}

// Every tp in {1, 2, 4} dividing the world, with and without sequence parallelism, every
// variant, float64 and float32: every tensor matches the reference.
TEST(MlaAttention, EveryTpLayoutMatchesTheReference) {
  const std::vector<const char*> dtypes = testing::kAddressSanitizer
                                              ? std::vector<const char*>{"float64"}
                                              : std::vector<const char*>{"float64", "float32"};
  for (const auto& [name, model] : Variants()) {
    for (const char* dtype : dtypes) {
      for (int64_t tp : {1, 2, 4}) {
        if (tp > WorldSize() || WorldSize() % tp != 0) continue;
        for (bool sp : {false, true}) {
          if (sp && tp == 1) continue;
          SCOPED_TRACE(fmt::format("{}: {} tp {} sp {}", name, dtype, tp, sp));
          if (WorldRank() == 0) fmt::print("  {} {} tp {} sp {}:", name, dtype, tp, sp);
          RunChecked(MlaDocument(model, tp, 1, sp, dtype));
        }
      }
    }
  }
}

// Three Adam iterations with the distributed optimizer on one rank's layout, a pipeline of two
// stages, two stages of two virtual ones, and tp 2 with sequence parallelism: every
// iteration's loss and gradient norm equal the first layout's (dp fills the world, so the
// first layout has the most data-parallel ranks).
TEST(MlaAttention, PipelineAndDistributedOptimizerTrainAsOneRank) {
  json model = Mla();
  model["num_layers"] = 4;
  model["qk_layernorm"] = true;
  struct Case {
    int64_t tp, pp, vp;
  };
  std::vector<Case> cases = {{1, 1, 0}};
  if (WorldSize() >= 2) cases.push_back({1, 2, 0});
  if (WorldSize() >= 2) cases.push_back({1, 2, 2});
  if (WorldSize() >= 4) cases.push_back({2, 2, 0});
  std::vector<std::vector<double>> curves;
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("tp {} pp {} vp {}", c.tp, c.pp, c.vp));
    if (WorldRank() == 0) {
      fmt::print("  tp {} pp {} vp {}, distributed optimizer:", c.tp, c.pp, c.vp);
    }
    curves.push_back(
        DistributedOptimizerCurve(MlaDocument(model, c.tp, c.pp, c.tp > 1, "float64", c.vp)));
  }
  ExpectSameCurves(curves);
}

// MoE layers (4 experts, top 2) after MLA, the experts over ep 2 where the world allows.
TEST(MlaAttention, MixtureOfExpertsWithExpertParallelism) {
  json model = Mla();
  model["num_moe_experts"] = 4;
  model["moe_router_topk"] = 2;
  model["moe_ffn_hidden_size"] = 16;
  model["moe_token_dispatcher_type"] = "alltoall";
  const int64_t ep = WorldSize() >= 2 ? 2 : 1;
  for (const char* dtype : {"float64", "float32"}) {
    if (WorldRank() == 0) fmt::print("  MoE ep {} {}:", ep, dtype);
    json document = MlaDocument(model, 1, 1, false, dtype);
    document["parallel"]["expert_model_parallel_size"] = ep;
    RunChecked(document);
  }
}

// bfloat16 with selective recomputation (core attention's probabilities rerun from the kept
// query, key and value) and with full recomputation, tp 2 with sequence parallelism where the
// world allows; recomputation gives the gradients of the run without it, bit for bit.
TEST(MlaAttention, BFloat16WithRecomputation) {
  const int64_t tp = WorldSize() >= 2 ? 2 : 1;
  json model = Mla();
  model["qk_layernorm"] = true;
  if (WorldRank() == 0) fmt::print("  bfloat16 tp {}:", tp);
  const double plain =
      RunChecked(Training(MlaDocument(model, tp, 1, tp > 1, "bfloat16"), "adam")).loss;
  for (const char* recompute : {"selective core_attn", "selective layernorm", "full"}) {
    if (WorldRank() == 0) fmt::print("  bfloat16 tp {} recompute {}:", tp, recompute);
    json document = MlaDocument(model, tp, 1, tp > 1, "bfloat16");
    SetRecompute(document["run"], recompute);
    EXPECT_EQ(RunChecked(Training(document, "adam")).loss, plain) << recompute;
  }
}

// The executor's activation count (core/model/activation_plan.cc, as the run's memory
// preflight sums it: the declared stashes in flight, the backward's working set with MLA's
// phases, the pipeline's transfers, the optimizer step's buffers) equals each rank's measured
// peak less what it holds before the first step, to the byte, on tp with and without sequence
// parallelism, both query paths, selective and full recomputation, a pipeline, and training.
TEST(MlaAttention, ActivationCountEqualsTheMeasuredPeak) {
  struct Case {
    const char* name;
    json model;
    int64_t tp, pp;
    bool sp;
    const char* dtype;
    const char* recompute;
    int64_t cp = 1;
    const char* comm = "p2p";
  };
  json norms = Mla();
  norms["qk_layernorm"] = true;
  json no_dropout = Mla(false);
  no_dropout["attention_dropout"] = 0.0;
  no_dropout["hidden_dropout"] = 0.0;
  const std::vector<Case> cases = {
      {"q_lora", Mla(), 1, 1, false, "float32", nullptr},
      {"q_lora qk_layernorm", norms, 2, 1, true, "float32", nullptr},
      {"q_lora qk_layernorm", norms, 2, 1, false, "bfloat16", nullptr},
      {"q_proj no dropout", no_dropout, 4, 1, true, "float32", nullptr},
      {"q_lora", Mla(), 2, 1, true, "bfloat16", "selective core_attn,layernorm"},
      {"q_proj", Mla(false), 1, 2, false, "float32", "full"},
      {"q_lora qk_layernorm", norms, 2, 2, true, "float32", "selective"},
      {"q_lora", Mla(), 1, 1, false, "float32", nullptr, 2, "all_gather"},
      {"q_lora", Mla(), 1, 1, false, "float32", nullptr, 2, "p2p"},
      {"q_lora", Mla(), 1, 1, false, "float32", nullptr, 2, "a2a"},
      {"q_proj no dropout", no_dropout, 1, 1, false, "float32", nullptr, 2, "a2a+p2p"},
      {"q_lora qk_layernorm", norms, 2, 1, true, "bfloat16", "selective core_attn", 2, "p2p"},
      {"q_lora qk_layernorm", norms, 1, 1, false, "float32", nullptr, 4, "a2a+p2p"},
      {"q_lora", Mla(), 1, 2, false, "bfloat16", "selective core_attn", 2, "all_gather"},
  };
  for (const Case& c : cases) {
    const int64_t ranks = c.tp * c.pp * c.cp;
    if (ranks > WorldSize() || WorldSize() % ranks != 0) continue;
    const std::string what = fmt::format("{} tp {} sp {} pp {} cp {}{} {} {}", c.name, c.tp, c.sp,
                                         c.pp, c.cp, c.cp > 1 ? fmt::format(" {}", c.comm) : "",
                                         c.dtype, c.recompute ? c.recompute : "");
    SCOPED_TRACE(what);
    json document =
        c.cp > 1 ? Training(CpDocument(c.model, c.cp, c.tp, c.pp, c.sp, c.dtype, c.comm), "adam")
                 : Training(MlaDocument(c.model, c.tp, c.pp, c.sp, c.dtype), "adam");
    document["run"]["train_iters"] = 2;
    // 32 tokens: the probabilities outweigh the output layer's logits, so the peak is in the
    // attention's backward.
    document["run"]["seq_length"] = 32;
    if (c.recompute != nullptr) SetRecompute(document["run"], c.recompute);
    const Config config = MakeConfig(document);
    CpuBackend backend;
    StatusOr<run::SimulationResult> result = run::Simulate(config, {false, 1, false}, backend);
    ASSERT_TRUE(result.ok()) << result.status().Message();
    StatusOr<Topology> topology = Topology::Create(config.parallel);
    ASSERT_TRUE(topology.ok());
    for (int64_t rank = 0; rank < WorldSize(); ++rank) {
      StatusOr<std::unique_ptr<Model>> model =
          BuildModel(config, *topology, topology->Coordinates(rank));
      ASSERT_TRUE(model.ok()) << model.status().Message();
      PlanBytes counted = 0;
      for (const MemoryItem& item : run::PlanRankMemory(**model, WorldSize(), false).items) {
        if (item.name.starts_with("activations:") || item.name.starts_with("optimizer: the ")) {
          counted += item.bytes;
        }
      }
      const run::SimulationResult::TensorBytes& measured =
          result->tensor_bytes[static_cast<size_t>(rank)];
      EXPECT_EQ(static_cast<int64_t>(counted), measured.peak - measured.held) << "rank " << rank;
      if (rank == 0 && WorldRank() == 0) {
        fmt::print("  {}: counted {} B, measured {} B on rank 0\n", what,
                   static_cast<int64_t>(counted), measured.peak - measured.held);
      }
    }
  }
}

// dropout_mode "rng_tracker": the probabilities' masks drawn on each rank's local [b, a_l, s, s]
// from its model-parallel stream, as the reference draws them.
TEST(MlaAttention, RngTrackerDropout) {
  const int64_t tp = WorldSize() >= 2 ? 2 : 1;
  json model = Mla();
  model["dropout_mode"] = "rng_tracker";
  if (WorldRank() == 0) fmt::print("  rng_tracker tp {}:", tp);
  RunChecked(MlaDocument(model, tp, 1, tp > 1, "float64"));
}

// Context parallelism (Transformer Engine's exchanges, the query and key head dim 16 apart
// from the value's 6; rope at each token's global position): every cp_comm_type on cp 2 and
// 4, tp 1 and 2 with sequence parallelism, both query paths, float64 and float32. Every
// tensor matches the reference, and the loss equals the cp 1 run's of the same tp.
TEST(MlaAttention, ContextParallelEveryCommType) {
  if (WorldSize() < 2) GTEST_SKIP() << "needs cp 2";
  const std::vector<const char*> dtypes = testing::kAddressSanitizer
                                              ? std::vector<const char*>{"float64"}
                                              : std::vector<const char*>{"float64", "float32"};
  json norms = Mla(false, "rope");
  norms["qk_layernorm"] = true;
  for (const auto& [name, model] :
       std::vector<std::pair<std::string, json>>{{"q_lora yarn", Mla()}, {"q_proj rope", norms}}) {
    for (int64_t tp : {1, 2}) {
      for (int64_t cp : {2, 4}) {
        if (cp * tp > WorldSize() || WorldSize() % (cp * tp) != 0) continue;
        for (const char* dtype : dtypes) {
          if (WorldRank() == 0) fmt::print("  {} cp 1 tp {} {}:", name, tp, dtype);
          const double cp_one = RunChecked(CpDocument(model, 1, tp, 1, tp > 1, dtype, "p2p")).loss;
          for (const char* comm : MlaComms(cp, tp)) {
            SCOPED_TRACE(fmt::format("{}: cp {} {} tp {} {}", name, cp, comm, tp, dtype));
            if (WorldRank() == 0) fmt::print("  {} cp {} {} tp {} {}:", name, cp, comm, tp, dtype);
            const double loss = RunChecked(CpDocument(model, cp, tp, 1, tp > 1, dtype, comm)).loss;
            if (std::string(dtype) == "float64") {
              EXPECT_NEAR(loss, cp_one, 1e-12 * cp_one);
            }
          }
        }
      }
    }
  }
}

// Training with context parallelism: three Adam iterations with the distributed optimizer
// (its shards over dp x cp) on cp 2 with each cp_comm_type, and with a pipeline of two stages
// where the world allows, give the cp 1 run's losses and gradient norms; bfloat16 with
// selective recomputation (the keys gathered again, the ring run again, the heads exchanged
// again) gives the run without it, bit for bit.
TEST(MlaAttention, ContextParallelTrainsAsCpOne) {
  if (WorldSize() < 2) GTEST_SKIP() << "needs cp 2";
  json model = Mla();
  model["num_layers"] = 4;
  std::vector<std::vector<double>> curves;
  for (const auto& [cp, comm, pp] :
       std::vector<std::tuple<int64_t, const char*, int64_t>>{{1, "p2p", 1},
                                                              {2, "all_gather", 1},
                                                              {2, "p2p", 1},
                                                              {2, "a2a", 1},
                                                              {2, "a2a+p2p", 2},
                                                              {2, "p2p", 2}}) {
    if (cp * pp > WorldSize()) continue;
    SCOPED_TRACE(fmt::format("cp {} {} pp {}", cp, comm, pp));
    if (WorldRank() == 0) fmt::print("  cp {} {} pp {}, distributed optimizer:", cp, comm, pp);
    curves.push_back(
        DistributedOptimizerCurve(CpDocument(model, cp, 1, pp, false, "float64", comm)));
  }
  ExpectSameCurves(curves);
  for (const char* comm : {"all_gather", "p2p", "a2a", "a2a+p2p"}) {
    SCOPED_TRACE(comm);
    if (WorldRank() == 0) fmt::print("  bfloat16 cp 2 {}:", comm);
    const double plain = RunChecked(CpDocument(Mla(), 2, 1, 1, false, "bfloat16", comm)).loss;
    json document = CpDocument(Mla(), 2, 1, 1, false, "bfloat16", comm);
    SetRecompute(document["run"], "selective core_attn");
    if (WorldRank() == 0) fmt::print("  bfloat16 cp 2 {} recompute core_attn:", comm);
    EXPECT_EQ(RunChecked(document).loss, plain);
  }
}

TEST(MlaAttention, RefusalsNameTheField) {
  if (WorldSize() < 2) GTEST_SKIP() << "context parallelism needs 2 ranks";
  // "a2a" splits the heads over tp x cp: one key and value head per query head (MLA reads
  // no num_query_groups), so 3 heads do not split over cp 2.
  json model = Mla();
  model["num_attention_heads"] = 3;
  model["kv_channels"] = 8;  // ignored by MLA; the GPT's defaults would need 32 % 3 == 0
  json document = CpDocument(model, 2, 1, 1, false, "float64", "a2a");
  StatusOr<run::SimulationResult> result = Simulate(document);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().Message(),
            "model.cp_comm_type: \"a2a\" gives each cp rank 1/cp of its tp rank's heads, so "
            "num_attention_heads 3 must be divisible by tensor_model_parallel_size * "
            "context_parallel_size = 2; set \"p2p\" or \"all_gather\", or another layout");
}

}  // namespace
}  // namespace mpusim
