// Multi-token prediction (mtp_num_layers, Megatron-Core's MultiTokenPredictionBlock) on K MPI
// ranks against the float64 GPT reference: one and two depths, tied and untied embeddings
// (untied, the last stage keeps its own copy of the word embeddings for the depths' shifted
// ids, its gradient all-reduced over embd), tp with and without sequence parallelism, pipelines
// of 2 and 4 stages and of 2 stages of 2 virtual ones (the depths on the last), context
// parallelism (the ids, labels and loss mask rolled across the cp ranks), data parallelism
// with the distributed optimizer training, float64, float32 and bfloat16 with selective and
// with full (block) recomputation. The depths add to the gradient but not to the reported
// loss. With multi-latent attention and with MoE layers too (DeepSeek-V3's pairs).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/topology.h"
#include "tests/model/gpt_mpi_helpers.h"
#include "tests/mpi/world.h"
#include "tests/sanitizers.h"

namespace mpusim {
namespace {

using nlohmann::json;
using namespace gpt_mpi;

// A Llama-style model (RoPE, RMSNorm, SwiGLU, 4 query groups of 8 heads) of 4 layers with
// `depths` MTP depths, both dropouts on (drawn per global element, so every layout draws the
// same masks, the depths' embedding dropout included).
json Mtp(int64_t depths, bool tied) {
  json model = Llama(8, 4);
  model["num_layers"] = 4;
  model["mtp_num_layers"] = depths;
  model["mtp_loss_scaling_factor"] = 0.3;
  model["share_embeddings_and_output_weights"] = tied;
  model["hidden_dropout"] = 0.1;
  model["attention_dropout"] = 0.1;
  return model;
}

struct Layout {
  int64_t tp = 1;
  bool sp = false;
  int64_t pp = 1, vp = 0;
  int64_t cp = 1;
};

std::string Name(const Layout& l) {
  return fmt::format("tp {}{} pp {}{}{}", l.tp, l.sp ? " sp" : "", l.pp,
                     l.vp > 0 ? fmt::format(" vp {}", l.vp) : "",
                     l.cp > 1 ? fmt::format(" cp {}", l.cp) : "");
}

bool Fits(const Layout& l) {
  const int64_t ranks = l.tp * l.pp * l.cp;
  return ranks <= WorldSize() && WorldSize() % ranks == 0;
}

// `model` on the layout, dp filling the world, every layout on the same global batch.
json MtpDocument(const json& model, const Layout& l, const char* dtype) {
  json document = Document(model, l.tp, l.sp, dtype);
  document["parallel"]["pipeline_model_parallel_size"] = l.pp;
  if (l.vp > 0) document["parallel"]["virtual_pipeline_model_parallel_size"] = l.vp;
  document["parallel"]["context_parallel_size"] = l.cp;
  document["run"]["micro_batch_size"] = Samples() / (WorldSize() / (l.tp * l.pp * l.cp));
  document["run"]["num_microbatches"] = 2 * l.pp;
  return document;
}

// Context parallelism rolls the ids, labels and loss mask across the cp ranks (roll_tensor)
// and normalises each rank's depth losses by its own unmasked tokens: cp 2 with and without
// tp and on a pipeline, and cp 4 (whose middle ranks pass the rolled positions both ways).
std::vector<Layout> Layouts() {
  std::vector<Layout> all = {{1, false, 1, 0},    {2, false, 1, 0},    {2, true, 1, 0},
                             {1, false, 2, 0},    {2, true, 2, 0},     {1, false, 4, 0},
                             {1, false, 2, 2},    {1, false, 1, 0, 2}, {2, true, 1, 0, 2},
                             {1, false, 2, 0, 2}, {1, false, 1, 0, 4}};
  if (testing::kAddressSanitizer) {
    all = {{2, true, 2, 0}, {1, false, 2, 2}, {1, false, 1, 0, 2}, {1, false, 1, 0, 4}};
  }
  return all;
}

// Every layout the world holds, one and two depths, tied and untied: every tensor (the
// depths' embeddings, norms, projections, layers, logits, masked losses and their gradients;
// the parameters' gradients) matches the float64 reference.
TEST(MultiTokenPrediction, EveryLayoutMatchesTheReference) {
  for (int64_t depths : {1, 2}) {
    for (bool tied : {false, true}) {
      for (const Layout& l : Layouts()) {
        if (!Fits(l)) continue;
        SCOPED_TRACE(fmt::format("depths {} tied {} {}", depths, tied, Name(l)));
        if (WorldRank() == 0) fmt::print("  depths {} tied {} {}:", depths, tied, Name(l));
        RunChecked(MtpDocument(Mtp(depths, tied), l, "float64"));
      }
    }
  }
}

// The depths change the gradient and not the reported loss (process_mtp_loss keeps the MTP
// losses out of the LM loss): the first step's loss is the model's without them, its
// gradient norm is not.
TEST(MultiTokenPrediction, DepthsJoinTheGradientNotTheLoss) {
  json without = Mtp(1, false);
  without.erase("mtp_num_layers");
  without.erase("mtp_loss_scaling_factor");
  const Layout one{1, false, 1, 0};
  json a = Training(MtpDocument(Mtp(2, false), one, "float64"), "adam");
  json b = Training(MtpDocument(without, one, "float64"), "adam");
  a["run"]["train_iters"] = 1;
  b["run"]["train_iters"] = 1;
  StatusOr<run::SimulationResult> with_mtp = Simulate(a, false);
  StatusOr<run::SimulationResult> plain = Simulate(b, false);
  ASSERT_TRUE(with_mtp.ok()) << with_mtp.status().Message();
  ASSERT_TRUE(plain.ok()) << plain.status().Message();
  ASSERT_EQ(with_mtp->iterations.size(), 1u);
  ASSERT_EQ(plain->iterations.size(), 1u);
  EXPECT_EQ(with_mtp->iterations[0].loss, plain->iterations[0].loss);
  EXPECT_GT(std::fabs(with_mtp->iterations[0].grad_norm - plain->iterations[0].grad_norm),
            1e-6 * plain->iterations[0].grad_norm);
}

// float32 on tp 2 with sequence parallelism and a pipeline where the world allows, and
// bfloat16 with selective recomputation (core attention, the norms and the MLP rebuilt in
// the MTP layer's backward too), training 4 Adam steps; then bfloat16 with full
// recomputation by block.
TEST(MultiTokenPrediction, Float32AndBFloat16) {
  const Layout l{WorldSize() >= 2 ? 2 : 1, WorldSize() >= 2, WorldSize() >= 4 ? 2 : 1, 0};
  for (const char* dtype : {"float32", "bfloat16"}) {
    if (WorldRank() == 0) fmt::print("  {} {}:", dtype, Name(l));
    json document = MtpDocument(Mtp(2, false), l, dtype);
    if (std::string(dtype) == "bfloat16") {
      SetRecompute(document["run"], "selective core_attn,layernorm,mlp");
    }
    RunChecked(Training(document, "adam"));
  }
  // Full recomputation by block: the decoder's layers rerun, the depths' are kept (Megatron
  // skips them, and the run says so).
  if (WorldRank() == 0) fmt::print("  bfloat16 {} full block 2:", Name(l));
  json document = MtpDocument(Mtp(2, true), l, "bfloat16");
  SetRecompute(document["run"], "full block 2");
  RunChecked(document);
  const Config config = MakeConfig(document);
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  ASSERT_TRUE(topology.ok()) << topology.status().Message();
  StatusOr<std::unique_ptr<Model>> model =
      BuildModel(config, *topology, topology->Coordinates(WorldRank()));
  ASSERT_TRUE(model.ok()) << model.status().Message();
  const std::vector<std::string> warnings = (*model)->Warnings();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("not the multi-token prediction depths'"), std::string::npos)
      << warnings[0];
}

// Three Adam iterations with the distributed optimizer over dp on pipelines: every
// iteration's loss and gradient norm equal the one-stage run's (and each run is checked
// against the reference's training).
TEST(MultiTokenPrediction, DistributedOptimizerTrainsAsOneStage) {
  std::vector<Layout> layouts = {
      {1, false, 1, 0}, {1, false, 2, 0}, {1, false, 2, 2}, {2, true, 2, 0}};
  std::vector<std::vector<double>> curves;
  for (const Layout& l : layouts) {
    if (!Fits(l)) continue;
    if (testing::kAddressSanitizer && l.vp > 0) continue;
    SCOPED_TRACE(Name(l));
    if (WorldRank() == 0) fmt::print("  {} distributed optimizer:", Name(l));
    const std::vector<double> curve =
        DistributedOptimizerCurve(MtpDocument(Mtp(2, false), l, "float64"));
    // The vocabulary pads the same on every layout with tp 1: their curves are compared (the
    // sanitizer build skips the vp layout, so they are not simply the first three).
    if (l.tp == 1) curves.push_back(curve);
  }
  ExpectSameCurves(curves);
}

// DeepSeek-V3's pair: multi-latent attention in the decoder and in the depth's transformer
// layer (built from the last layer's spec), two depths, untied, float64 and float32: every
// tensor matches the float64 reference.
TEST(MultiTokenPrediction, WithMultiLatentAttention) {
  json model = Mtp(2, false);
  model.erase("num_query_groups");
  model["multi_latent_attention"] = true;
  model["q_lora_rank"] = 16;
  model["kv_lora_rank"] = 12;
  model["qk_head_dim"] = 8;
  model["qk_pos_emb_head_dim"] = 4;
  model["v_head_dim"] = 6;
  model["qk_layernorm"] = true;
  for (const Layout& l : {Layout{2, true, 2, 0}, Layout{1, false, 1, 0}}) {
    if (!Fits(l)) continue;
    for (const char* dtype : {"float64", "float32"}) {
      SCOPED_TRACE(fmt::format("{} {}", Name(l), dtype));
      if (WorldRank() == 0) fmt::print("  mla {} {}:", Name(l), dtype);
      RunChecked(MtpDocument(model, l, dtype));
    }
  }
}

// DeepSeek-V3's pair: the depths' transformer layers are MoE layers (the last decoder layer's
// spec) with DeepSeek-style routing: sigmoid scores, 8 experts in 4 groups, top 3 from the
// best 3 groups, scaled by 2.5, the expert bias, the sequence-level load-balancing loss, the
// z-loss and a shared expert; the first decoder layer dense.
json MtpMoe(int64_t depths) {
  json model = WithDeepSeekRouting(Mtp(depths, false));
  model["moe_layer_freq"] = json::array({0, 1, 1, 1});
  model["moe_router_enable_expert_bias"] = true;
  model["moe_router_load_balancing_type"] = "seq_aux_loss";
  return model;
}

struct MoeLayout {
  Layout layout;
  int64_t ep = 1, etp = 0;  // etp 0: tp's
  std::string Name() const {
    return fmt::format("{} ep {}{}", mpusim::Name(layout), ep,
                       etp > 0 ? fmt::format(" etp {}", etp) : "");
  }
  bool Fits() const {
    const int64_t ranks = layout.tp * layout.pp;
    const int64_t expert_ranks = (etp > 0 ? etp : layout.tp) * ep * layout.pp;
    return mpusim::Fits(layout) && WorldSize() % expert_ranks == 0 &&
           (WorldSize() / ranks) % ep == 0;
  }
  // The alltoall dispatcher where experts are split over ep ranks.
  json Document(const json& model, const char* dtype) const {
    json document = MtpDocument(model, layout, dtype);
    document["parallel"]["expert_model_parallel_size"] = ep;
    if (etp > 0) document["parallel"]["expert_tensor_parallel_size"] = etp;
    if (ep > 1) document["model"]["moe_token_dispatcher_type"] = "alltoall";
    return document;
  }
};

// Every tensor of the depths' MoE layers (router scores, dispatch, experts, shared expert and
// their gradients; each router's load-balancing and z-loss gradients, not scaled by the MTP
// factor) and every parameter gradient matches the float64 reference, on tp with sp, ep and
// etp, pipelines with the depths on the last stage, virtual stages, and cp 2 (each router's
// sequence-level loss over the sample's tp x cp pieces); then 3 Adam
// iterations with the distributed optimizer in which each router's expert bias (the depths'
// too: finalize_model_grads updates every router's) moves by its own counts, every
// iteration's gradient norm the reference trainer's.
TEST(MultiTokenPrediction, WithMixtureOfExperts) {
  std::vector<MoeLayout> layouts = {{{1, false, 1, 0}, 1, 0},  {{2, true, 1, 0}, 2, 0},
                                    {{1, false, 2, 0}, 2, 0},  {{2, true, 2, 0}, 2, 1},
                                    {{1, false, 2, 2}, 1, 0},  {{1, false, 1, 0, 2}, 2, 0},
                                    {{2, true, 1, 0, 2}, 2, 1}};
  if (testing::kAddressSanitizer) layouts = {{{2, true, 1, 0}, 2, 0}, {{1, false, 2, 0}, 2, 0}};
  for (const MoeLayout& l : layouts) {
    if (!l.Fits()) continue;
    SCOPED_TRACE(l.Name());
    if (WorldRank() == 0) fmt::print("  moe {}:", l.Name());
    RunChecked(l.Document(MtpMoe(2), "float64"));
  }
  const MoeLayout trained{{1, false, WorldSize() >= 2 ? 2 : 1, 0}, WorldSize() >= 4 ? 2 : 1, 0};
  if (WorldRank() == 0) fmt::print("  moe {} distributed optimizer:", trained.Name());
  json document = Training(trained.Document(MtpMoe(1), "float64"), "adam");
  document["run"]["train_iters"] = 3;
  document["optimizer"]["use_distributed_optimizer"] = true;
  const run::SimulationResult result = RunChecked(document);
  ASSERT_EQ(result.iterations.size(), result.check.reference_iterations.size());
  for (size_t i = 0; i < result.iterations.size(); ++i) {
    const double ref = result.check.reference_iterations[i].grad_norm;
    EXPECT_NEAR(result.iterations[i].grad_norm, ref, 1e-12 * ref) << "iteration " << i + 1;
  }
}

// gpt-oss's sliding window on the layers window_attn_skip_freq 2 marks (odd layer numbers):
// the depths' layers take their own numbers within the block (Megatron's
// MultiTokenPredictionLayer numbers them from 1), so depth 0 slides and depth 1 does not,
// whatever the last decoder layer does; with tp 2 + sp and with cp 2 ("all_gather": Transformer
// Engine takes a window on no ring).
TEST(MultiTokenPrediction, WithSlidingWindow) {
  json model = Mtp(2, false);
  model["window_size"] = json::array({3, 0});
  model["window_attn_skip_freq"] = 2;
  for (const Layout& l :
       {Layout{1, false, 1, 0}, Layout{2, true, 1, 0}, Layout{1, false, 1, 0, 2}}) {
    if (!Fits(l)) continue;
    SCOPED_TRACE(Name(l));
    if (WorldRank() == 0) fmt::print("  window {}:", Name(l));
    json document = MtpDocument(model, l, "float64");
    if (l.cp > 1) document["model"]["cp_comm_type"] = "all_gather";
    RunChecked(document);
  }
}

TEST(MultiTokenPrediction, RefusalsNameTheField) {
  const auto refused = [](const json& document) {
    StatusOr<run::SimulationResult> result = Simulate(document);
    EXPECT_FALSE(result.ok());
    return result.ok() ? std::string() : result.status().Message();
  };
  json document = MtpDocument(Mtp(1, false), {1, false, 1, 0}, "float64");
  SetRecompute(document["run"], "full uniform 2");
  EXPECT_EQ(refused(document),
            "run.recompute_num_layers: 2 with mtp_num_layers and recompute_method \"uniform\": "
            "Megatron checkpoints each MTP depth alone and asserts 1 (\"recompute_num_layers "
            "must be 1 for MTP recompute\")");
}

// Full recomputation by "uniform" (recompute_num_layers 1, as Megatron asserts for MTP):
// every decoder layer and every depth's projection, layer and final norm checkpointed
// (MultiTokenPredictionLayer._checkpointed_forward) and rebuilt in the backward, with tp 2 +
// sp and a pipeline, an MoE depth with ep 2, and cp 2; every tensor matches the reference.
TEST(MultiTokenPrediction, FullUniformRecomputation) {
  for (const Layout& l :
       {Layout{1, false, 1, 0}, Layout{2, true, 2, 0}, Layout{1, false, 1, 0, 2}}) {
    if (!Fits(l)) continue;
    SCOPED_TRACE(Name(l));
    if (WorldRank() == 0) fmt::print("  full uniform 1 {}:", Name(l));
    json document = MtpDocument(Mtp(2, false), l, "float64");
    SetRecompute(document["run"], "full uniform 1");
    RunChecked(document);
  }
  const MoeLayout moe{{1, false, 1, 0}, WorldSize() >= 2 ? 2 : 1, 0};
  if (WorldRank() == 0) fmt::print("  full uniform 1 moe {}:", moe.Name());
  json document = moe.Document(MtpMoe(1), "float32");
  SetRecompute(document["run"], "full uniform 1");
  RunChecked(document);
}

}  // namespace
}  // namespace mpusim
