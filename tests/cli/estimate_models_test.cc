// The estimate of the newer model parts (issue 48): multi-latent attention, multi-token
// prediction, sliding windows, attention sinks, DeepSeek-style routing, gated activations.
// Megatron's model FLOPs are checked against num_floating_point_operations
// (megatron/training/training.py) transliterated here, and against a value computed by hand;
// the parameter count without the executor (CountedParameterShapes) against the executor's
// own shapes wherever the executor builds the model; the full-size DeepSeek-V3 sample against
// its published parameter counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "core/config/config.h"
#include "core/estimate/activation_estimate.h"
#include "core/estimate/attention_backend.h"
#include "core/estimate/gpu_spec.h"
#include "core/estimate/memory_estimate.h"
#include "core/estimate/time_estimate.h"
#include "core/model/model.h"
#include "core/topology.h"
#include "tests/cli/cli_test_util.h"

namespace mpusim {
namespace {

using cli::test_util::Mpusim;
using cli::test_util::Sample;
using nlohmann::json;

Config Parse(const json& doc) {
  Config config;
  const Status parsed = ParseConfig(doc, &config);
  EXPECT_TRUE(parsed.ok()) << parsed.Message();
  return config;
}

// A sample config, with a run section of one micro-batch of `seq_length` when it has none.
Config ReadSample(const std::string& name, int64_t seq_length = 4096) {
  StatusOr<json> doc = ReadJsonFile(Sample(name));
  EXPECT_TRUE(doc.ok()) << doc.status().Message();
  if (!doc->contains("run")) {
    (*doc)["run"] = {{"seq_length", seq_length}, {"micro_batch_size", 1}, {"num_microbatches", 16}};
  }
  return Parse(*doc);
}

// ---- Megatron's model FLOPs ------------------------------------------------------------------

// num_floating_point_operations' transformer_flops for BSHD batches, transliterated from
// megatron/training/training.py (its names), independent of model_flops.cc: the arguments as
// Megatron's args has them.
struct MegatronArgs {
  double hidden_size, num_layers, num_attention_heads, kv_channels, num_query_groups;
  double ffn_hidden_size, padded_vocab_size, seq_length;
  bool swiglu = false;
  // MoE (num_experts none when 0): moe_layer_freq as a pattern.
  double num_experts = 0, moe_router_topk = 0, moe_ffn_hidden_size = 0, shared = 0;
  std::vector<int> moe_layer_pattern = {};
  // MLA (multi_latent_attention when kv_lora_rank > 0); q_lora_rank 0: None.
  double q_lora_rank = 0, kv_lora_rank = 0, qk_head_dim = 0, qk_pos_emb_head_dim = 0,
         v_head_dim = 0;
  double mtp_num_layers = 0;  // None: 0
};

double MegatronFlops(const MegatronArgs& args, double batch_size) {
  const double seqlen_squared_sum_in_batch = batch_size * args.seq_length * args.seq_length;
  const double total_real_tokens_in_batch = batch_size * args.seq_length;
  double num_dense_layers = args.num_layers, num_moe_layers = 0, num_experts_routed_to = 0;
  double last_layer_is_moe = 0;
  if (args.num_experts > 0) {
    num_moe_layers = 0;
    for (int v : args.moe_layer_pattern) num_moe_layers += v;
    num_dense_layers = args.num_layers - num_moe_layers;
    num_experts_routed_to = args.moe_router_topk;
    last_layer_is_moe = args.moe_layer_pattern.back();
  }
  double num_layers = args.num_layers;
  const double mtp_num_layers = args.mtp_num_layers;
  if (mtp_num_layers > 0) {
    num_moe_layers += last_layer_is_moe * mtp_num_layers;
    num_dense_layers += (1 - last_layer_is_moe) * mtp_num_layers;
    num_layers = args.num_layers + mtp_num_layers;
  }
  const double moe_ffn_hidden_size =
      args.moe_ffn_hidden_size > 0 ? args.moe_ffn_hidden_size : args.ffn_hidden_size;
  const double shared_expert_ffn_hidden_size = args.shared;
  const double forward_backward_expansion_factor = 3;
  const double fma_expansion_factor = 2;
  const double ffn_expansion_factor = args.swiglu ? 3 : 2;
  double standard_self_attn_term = 0, standard_self_attn_core_term = 0;
  if (args.kv_lora_rank > 0) {
    const double q_term =
        args.q_lora_rank == 0
            ? args.hidden_size * args.num_attention_heads *
                  (args.qk_head_dim + args.qk_pos_emb_head_dim)
            : args.q_lora_rank *
                  (args.hidden_size +
                   args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim) + 1);
    standard_self_attn_term =
        forward_backward_expansion_factor * fma_expansion_factor *
        (q_term +
         args.kv_lora_rank * (args.hidden_size +
                              args.num_attention_heads * (args.qk_head_dim + args.v_head_dim) + 1) +
         args.hidden_size * args.qk_pos_emb_head_dim +
         (args.num_attention_heads * args.v_head_dim) * args.hidden_size);
    standard_self_attn_core_term =
        forward_backward_expansion_factor * fma_expansion_factor *
        (args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim) / 2 +
         args.num_attention_heads * args.v_head_dim / 2);
  } else {
    const double query_projection_size = args.kv_channels * args.num_attention_heads;
    const double key_projection_size = args.kv_channels * args.num_query_groups;
    const double value_projection_size = args.kv_channels * args.num_query_groups;
    standard_self_attn_term =
        forward_backward_expansion_factor * fma_expansion_factor *
        (args.hidden_size * (query_projection_size + key_projection_size + value_projection_size) +
         query_projection_size * args.hidden_size);
    standard_self_attn_core_term =
        forward_backward_expansion_factor * fma_expansion_factor * query_projection_size / 2 * 2;
  }
  const double self_attn_term = standard_self_attn_term * num_layers;
  const double self_attn_core_term = standard_self_attn_core_term * num_layers;
  return total_real_tokens_in_batch *
             (forward_backward_expansion_factor * fma_expansion_factor * args.hidden_size *
                  ((args.ffn_hidden_size * ffn_expansion_factor) * num_dense_layers +
                   (moe_ffn_hidden_size * num_experts_routed_to * ffn_expansion_factor) *
                       num_moe_layers +
                   (shared_expert_ffn_hidden_size * ffn_expansion_factor) * num_moe_layers) +
              self_attn_term +
              forward_backward_expansion_factor * fma_expansion_factor * mtp_num_layers *
                  (3 * args.hidden_size + 2 * args.hidden_size * args.hidden_size) +
              forward_backward_expansion_factor * fma_expansion_factor * args.hidden_size *
                  args.padded_vocab_size * (mtp_num_layers + 1)) +
         seqlen_squared_sum_in_batch * self_attn_core_term;
}

// A small MLA + MTP model: 2 layers, h 64, 4 heads, q_lora_rank 32, kv_lora_rank 16, heads of
// 16 + 8 rope channels and values of 16, swiglu ffn 128, vocabulary 256, one MTP depth.
json SmallMlaMtp() {
  return json{{"parallel", {{"world_size", 1}}},
              {"model",
               {{"type", "gpt"},
                {"num_layers", 2},
                {"hidden_size", 64},
                {"num_attention_heads", 4},
                {"ffn_hidden_size", 128},
                {"activation", "swiglu"},
                {"normalization", "RMSNorm"},
                {"add_bias_linear", false},
                {"vocab_size", 256},
                {"position_embedding_type", "rope"},
                {"qk_layernorm", true},
                {"multi_latent_attention", true},
                {"q_lora_rank", 32},
                {"kv_lora_rank", 16},
                {"qk_head_dim", 16},
                {"qk_pos_emb_head_dim", 8},
                {"v_head_dim", 16},
                {"mtp_num_layers", 1}}},
              {"run", {{"seq_length", 32}, {"micro_batch_size", 1}, {"num_microbatches", 4}}}};
}

// SmallMlaMtp's dense model as Megatron's arguments (no MLA, no MTP).
MegatronArgs SmallArgs(bool swiglu) {
  return MegatronArgs{.hidden_size = 64,
                      .num_layers = 2,
                      .num_attention_heads = 4,
                      .kv_channels = 16,
                      .num_query_groups = 4,
                      .ffn_hidden_size = 128,
                      .padded_vocab_size = 256,
                      .seq_length = 32,
                      .swiglu = swiglu};
}

TEST(EstimateModelFlops, SmallMlaAndMtpMatchMegatronsFormulaAndTheHandCount) {
  const Config config = Parse(SmallMlaMtp());
  const GptConfig& g = *config.gpt;
  const double ours = ModelFlopsPerIteration(g, 256, 32, 4);
  MegatronArgs args = SmallArgs(true);
  args.q_lora_rank = 32;
  args.kv_lora_rank = 16;
  args.qk_head_dim = 16;
  args.qk_pos_emb_head_dim = 8;
  args.v_head_dim = 16;
  args.mtp_num_layers = 1;
  EXPECT_DOUBLE_EQ(ours, MegatronFlops(args, 4));
  // By hand, per token and forward: q_term 32 (64 + 4 * 24 + 1) = 5152; kv 16 (64 + 4 * 32
  // + 1) = 3088; rope key 64 * 8 = 512; linear_proj 4 * 16 * 64 = 4096: 2 x 12848 = 25696 a
  // layer; core 32 (4 * 24 / 2 + 4 * 16 / 2) x 2 = 5120; MLP 2 x 64 x 128 x 3 = 49152; three
  // layers (two decoder, one MTP): 3 x 79968 = 239904; MTP norms and eh_proj 2 (3 x 64 + 2 x
  // 64^2) = 16768; logits 2 x 64 x 256 x 2 = 65536: 322208 a token, x 3 x 128 tokens.
  EXPECT_DOUBLE_EQ(ours, 322208.0 * 3 * 32 * 4);
}

TEST(EstimateModelFlops, MegatronCountsOnlySwigluAsGated) {
  json doc = SmallMlaMtp();
  doc["model"]["multi_latent_attention"] = false;
  doc["model"]["mtp_num_layers"] = nullptr;
  doc["model"]["activation"] = "quick_geglu";
  const Config geglu = Parse(doc);
  MegatronArgs args = SmallArgs(false);
  // quick_geglu: Megatron's args.swiglu is false, so its MLP counts as a plain one.
  EXPECT_DOUBLE_EQ(ModelFlopsPerIteration(*geglu.gpt, 256, 32, 4), MegatronFlops(args, 4));
  doc["model"]["activation"] = "swiglu";
  args.swiglu = true;
  EXPECT_DOUBLE_EQ(ModelFlopsPerIteration(*Parse(doc).gpt, 256, 32, 4), MegatronFlops(args, 4));
  // A sliding window changes nothing Megatron counts.
  doc["model"]["window_size"] = {8, 0};
  EXPECT_DOUBLE_EQ(ModelFlopsPerIteration(*Parse(doc).gpt, 256, 32, 4), MegatronFlops(args, 4));
}

MegatronArgs DeepSeekV3Args() {
  MegatronArgs args{.hidden_size = 7168,
                    .num_layers = 61,
                    .num_attention_heads = 128,
                    .kv_channels = 128,
                    .num_query_groups = 128,
                    .ffn_hidden_size = 18432,
                    .padded_vocab_size = 129280,
                    .seq_length = 4096,
                    .swiglu = true};
  args.num_experts = 256;
  args.moe_router_topk = 8;
  args.moe_ffn_hidden_size = 2048;
  args.shared = 2048;
  args.moe_layer_pattern.assign(3, 0);
  args.moe_layer_pattern.resize(61, 1);
  args.q_lora_rank = 1536;
  args.kv_lora_rank = 512;
  args.qk_head_dim = 128;
  args.qk_pos_emb_head_dim = 64;
  args.v_head_dim = 128;
  args.mtp_num_layers = 1;
  return args;
}

TEST(EstimateModelFlops, DeepSeekV3MatchesMegatronsFormula) {
  const Config config = ReadSample("deepseek_v3_671b_p16_v2_ep64_n2048.json");
  const GptConfig& g = *config.gpt;
  ASSERT_EQ(g.PaddedVocabSize(1), 129280);
  const double ours = ModelFlopsPerIteration(g, 129280, 4096, 15360);
  EXPECT_NEAR(ours / MegatronFlops(DeepSeekV3Args(), 15360), 1.0, 1e-12);
  // Per token: 6 x 37.6B active parameters' GEMMs plus attention's s^2 part and MTP: about
  // 1.5e12 FLOPs (a check of scale, not of the formula).
  const double per_token = ours / (4096.0 * 15360);
  EXPECT_GT(per_token, 6 * 37e9);
  EXPECT_LT(per_token, 6 * 37e9 * 1.6);
}

// ---- parameters without the executor ----------------------------------------------------------

using ShapeKey = std::tuple<std::string, Shape, bool>;
std::vector<ShapeKey> Keys(const std::vector<HeldParameterShape>& shapes) {
  std::vector<ShapeKey> keys;
  for (const HeldParameterShape& s : shapes) keys.emplace_back(s.name, s.local_shape, s.expert);
  std::sort(keys.begin(), keys.end());
  return keys;
}

// On models the executor builds, the count gives every rank the executor's own shapes.
void ExpectCountedAsBuilt(const json& doc) {
  const Config config = Parse(doc);
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  ASSERT_TRUE(topology.ok()) << topology.status().Message();
  for (int64_t rank = 0; rank < topology->world_size(); ++rank) {
    StatusOr<std::unique_ptr<Model>> built =
        BuildModel(config, *topology, topology->Coordinates(rank));
    ASSERT_TRUE(built.ok()) << built.status().Message();
    StatusOr<std::vector<HeldParameterShape>> counted =
        CountedParameterShapes(config, *topology, rank);
    ASSERT_TRUE(counted.ok()) << counted.status().Message();
    EXPECT_EQ(Keys(*counted), Keys((*built)->HeldParameterShapes()))
        << "rank " << rank << " of " << doc["parallel"].dump();
  }
}

json SmallGpt(json parallel) {
  return json{{"parallel", std::move(parallel)},
              {"model",
               {{"type", "gpt"},
                {"num_layers", 4},
                {"hidden_size", 32},
                {"num_attention_heads", 4},
                {"vocab_size", 100},
                {"make_vocab_size_divisible_by", 16},
                {"max_position_embeddings", 16}}},
              {"run", {{"seq_length", 16}, {"micro_batch_size", 1}, {"num_microbatches", 4}}}};
}

TEST(EstimateCountedParameters, MatchTheExecutorsShapesOnEveryRank) {
  // tp 2, pp 2, tied embeddings (the last stage's copy), learned positions.
  ExpectCountedAsBuilt(SmallGpt({{"world_size", 4},
                                 {"tensor_model_parallel_size", 2},
                                 {"pipeline_model_parallel_size", 2},
                                 {"sequence_parallel", true}}));
  // pp 2 with virtual stages, untied, rope, qk norms, sinks, swiglu.
  json vp = SmallGpt({{"world_size", 2},
                      {"pipeline_model_parallel_size", 2},
                      {"virtual_pipeline_model_parallel_size", 2}});
  vp["model"]["share_embeddings_and_output_weights"] = false;
  vp["model"]["position_embedding_type"] = "rope";
  vp["model"]["qk_layernorm"] = true;
  vp["model"]["softmax_type"] = "learnable";
  vp["model"]["activation"] = "swiglu";
  ExpectCountedAsBuilt(vp);
  // Mixture of experts: tp 2 with sp, ep 2, etp 1, a dense layer; the router's and the
  // experts' biases, then a shared expert (which takes no bias).
  json moe = SmallGpt({{"world_size", 4},
                       {"tensor_model_parallel_size", 2},
                       {"sequence_parallel", true},
                       {"expert_model_parallel_size", 2},
                       {"expert_tensor_parallel_size", 1}});
  moe["model"]["num_moe_experts"] = 4;
  moe["model"]["moe_layer_freq"] = {0, 1, 1, 1};
  moe["model"]["moe_ffn_hidden_size"] = 16;
  moe["model"]["moe_token_dispatcher_type"] = "alltoall";
  ExpectCountedAsBuilt(moe);
  moe["model"]["add_bias_linear"] = false;
  moe["model"]["moe_shared_expert_intermediate_size"] = 24;
  ExpectCountedAsBuilt(moe);
}

// A rank's parameter elements by the count.
int64_t Elements(const std::vector<HeldParameterShape>& shapes, bool expert) {
  int64_t n = 0;
  for (const HeldParameterShape& s : shapes) {
    if (s.expert == expert) n += static_cast<int64_t>(PlanElements(s.local_shape));
  }
  return n;
}

TEST(EstimateCountedParameters, MtpSitsOnTheLastStageWithItsEmbedding) {
  json doc = SmallMlaMtp();
  doc["parallel"] = json{{"world_size", 2}, {"pipeline_model_parallel_size", 2}};
  doc["model"]["share_embeddings_and_output_weights"] = false;
  const Config config = Parse(doc);
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  ASSERT_TRUE(topology.ok());
  StatusOr<std::vector<HeldParameterShape>> first = CountedParameterShapes(config, *topology, 0);
  StatusOr<std::vector<HeldParameterShape>> last = CountedParameterShapes(config, *topology, 1);
  ASSERT_TRUE(first.ok() && last.ok());
  const auto has = [](const std::vector<HeldParameterShape>& shapes, const std::string& name) {
    return std::any_of(shapes.begin(), shapes.end(),
                       [&](const HeldParameterShape& s) { return s.name == name; });
  };
  EXPECT_TRUE(has(*first, "embedding.word_embeddings.weight"));
  EXPECT_FALSE(has(*first, "mtp.layers.0.eh_proj.weight"));
  EXPECT_TRUE(has(*last, "embedding.word_embeddings.weight"));  // MTP's embedding
  EXPECT_TRUE(has(*last, "output_layer.weight"));
  EXPECT_TRUE(has(*last, "mtp.layers.0.eh_proj.weight"));
  EXPECT_TRUE(has(*last, "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight"));
  // By hand: h 64, V 256. An MLA layer: q down 32 x 64 = 2048, q norm 32, q up 96 x 32 =
  // 3072, kv down 24 x 64 = 1536, kv norm 16, kv up 128 x 16 = 2048, proj 64 x 64 = 4096, two
  // norms 64 each: 12976; MLP 256 x 64 + 64 x 128 = 24576: 37552 a layer. First stage:
  // embedding 16384 + a layer = 53936. Last: a layer, final norm 64, MTP (enorm, hnorm 64
  // each, eh_proj 64 x 128, a layer, final norm 64: 45936), the embedding copy 16384 and the
  // output layer 16384.
  EXPECT_EQ(Elements(*first, false), 53936);
  EXPECT_EQ(Elements(*last, false), 37552 + 64 + 45936 + 16384 + 16384);
  // The estimate counts it, the CPU executor's activations included (the executor builds MLA
  // and MTP), on an MoE model too (the depth's layer an MoE layer).
  const cli::test_util::Result r =
      Mpusim({"estimate", cli::test_util::WriteTemp("mpusim_mla_mtp_estimate.json", doc.dump())});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("What `mpusim run --no-check` keeps on the CPU executor"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("not counted"), std::string::npos) << r.out;
  json moe = doc;
  moe["model"]["num_moe_experts"] = 4;
  moe["model"]["moe_router_topk"] = 2;
  const cli::test_util::Result m =
      Mpusim({"estimate", cli::test_util::WriteTemp("mpusim_moe_mtp_estimate.json", moe.dump())});
  ASSERT_EQ(m.code, 0) << m.err;
  EXPECT_NE(m.out.find("What `mpusim run --no-check` keeps on the CPU executor"), std::string::npos)
      << m.out;
  EXPECT_EQ(m.out.find("not counted"), std::string::npos) << m.out;
  EXPECT_NE(m.out.find("a mixture-of-experts layer like the last decoder layer"), std::string::npos)
      << m.out;
  EXPECT_NE(r.out.find("Model part: multi-latent attention (q_lora_rank 32"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("Model part: multi-token prediction (1 depth, on the last pipeline stage)"),
            std::string::npos)
      << r.out;
}

// ---- DeepSeek-V3 at full size ------------------------------------------------------------------

TEST(EstimateDeepSeekV3, ParametersMatchThePublishedCounts) {
  const Config config = ReadSample("deepseek_v3_671b_p16_v2_ep64_n2048.json");
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  ASSERT_TRUE(topology.ok()) << topology.status().Message();
  const GptConfig& g = *config.gpt;
  // The model's own parameters (each once): 671B without the MTP depth (the technical
  // report's total), 685B with the depth and the copies of the embedding and output head the
  // published checkpoint stores with it (its model.layers.61: 684.49B, "685B").
  double main = 0, mtp = 0;
  for (const GptParameter& p : GptParameters(g, 129280, false)) {
    (p.name.starts_with("mtp.") ? mtp : main) += static_cast<double>(PlanElements(p.shape));
  }
  EXPECT_NEAR(main / 671e9, 1.0, 1e-3) << main;
  EXPECT_NEAR((main + mtp + 2 * 129280.0 * 7168) / 685e9, 1.0, 1e-3) << main + mtp;
  // The estimate's stages (each its ep rank 0's share; the experts evenly over ep 64) add up
  // to the model's parameters once each, plus the embedding copy MTP keeps on the last stage.
  StatusOr<std::vector<StageHeldMemory>> stages = EstimateStageHeldMemory(config, *topology);
  ASSERT_TRUE(stages.ok()) << stages.status().Message();
  ASSERT_EQ(stages->size(), 16u);
  double total = 0;
  for (const StageHeldMemory& s : *stages) {
    const HeldMemory& h = s.held;
    total += static_cast<double>(h.parameter_elements - h.expert_elements) +
             64 * static_cast<double>(h.expert_elements);
  }
  EXPECT_EQ(total, main + mtp + 129280.0 * 7168);
}

TEST(EstimateDeepSeekV3, EstimateRunsAndNamesEveryPart) {
  const cli::test_util::Result r =
      Mpusim({"estimate", Sample("deepseek_v3_671b_p16_v2_ep64_n2048.json"), "--global-batch-size",
              "8192", "--seq-length", "4096", "--gpu", "h800"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* part : {"Model part: multi-latent attention (q_lora_rank 1536, kv_lora_rank 512",
                           "Model part: multi-token prediction (1 depth",
                           "Model part: DeepSeek-style routing (sigmoid scores, expert bias",
                           "What `mpusim run --no-check` keeps on the CPU executor",
                           "Step time on h800", "model TFLOP/s per GPU"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
  EXPECT_EQ(r.out.find("Step time: not estimated"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("Activations: not estimated"), std::string::npos) << r.out;
  // JSON names them too.
  const cli::test_util::Result j =
      Mpusim({"estimate", Sample("deepseek_v3_671b_p16_v2_ep64_n2048.json"), "--global-batch-size",
              "8192", "--seq-length", "4096", "--format", "json"});
  ASSERT_EQ(j.code, 0) << j.err;
  const json doc = json::parse(j.out);
  ASSERT_TRUE(doc.contains("model_parts"));
  EXPECT_EQ(doc["model_parts"].size(), 3u) << doc["model_parts"].dump();
}

// Megatron's documented layout for DeepSeek-V3 on pp 16 vp 2, "Et*3|(tt|)*29,m|L", with its
// MTP stage ('m', which mpusim's split does not place) left empty: that virtual stage only
// passes its input on, and the schedule times it at no cost (it stopped the estimate with an
// internal error).
// Megatron's documented DeepSeek-V3 layout puts the MTP depth on a stage of its own before
// the loss's (mtp_standalone), which mpusim does not build: one line, exit 2.
TEST(EstimateDeepSeekV3, AStandaloneMtpStageIsRefused) {
  json doc = json::parse(std::ifstream(Sample("deepseek_v3_671b_p16_v2_ep64_n2048.json")));
  doc["parallel"]["pipeline_model_parallel_layout"] = "Et*3|(tt|)*29,m|L";
  const std::string path = cli::test_util::WriteTemp("mpusim_standalone_mtp.json", doc.dump());
  const cli::test_util::Result r =
      Mpusim({"estimate", path, "--global-batch-size", "8192", "--seq-length", "4096"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err,
            "error: " + path +
                ": parallel.pipeline_model_parallel_layout: has the MTP layers on stage 30 and "
                "the loss on stage 31: a standalone MTP stage (Megatron's mtp_standalone, which "
                "sends the depths' hidden states with the decoder's to the loss stage) is not "
                "built yet; put the m's on the last stage, before L\n");
}

TEST(EstimateDeepSeekV3, AnEmptyVirtualStageIsTimed) {
  json doc = json::parse(std::ifstream(Sample("deepseek_v3_671b_p16_v2_ep64_n2048.json")));
  doc["parallel"]["pipeline_model_parallel_layout"] = "Et*3|(tt|)*29,|mL";
  const cli::test_util::Result r =
      Mpusim({"estimate", cli::test_util::WriteTemp("mpusim_empty_stage.json", doc.dump()),
              "--global-batch-size", "8192", "--seq-length", "4096"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("Step time on h100-80gb"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model TFLOP/s per GPU"), std::string::npos) << r.out;
}

// ---- activations and time --------------------------------------------------------------------

struct Counted {
  std::vector<StageActivations> activations;
  TimeEstimate time;
};

Counted Count(const json& doc, const std::string& gpu_name = "h100-80gb") {
  const Config config = Parse(doc);
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  EXPECT_TRUE(topology.ok()) << topology.status().Message();
  const GpuSpec gpu = *FindGpuPreset(gpu_name);
  StatusOr<ResolvedAttention> attention =
      ResolveAttentionBackend(*config.gpt, config.run->dtype, gpu.compute_capability, 1);
  EXPECT_TRUE(attention.ok()) << attention.status().Message();
  StatusOr<std::vector<StageActivations>> a =
      EstimateStageActivations(config, *topology, *attention);
  EXPECT_TRUE(a.ok()) << a.status().Message();
  StatusOr<TimeEstimate> t = EstimateStepTime(config, *topology, gpu);
  EXPECT_TRUE(t.ok()) << t.status().Message();
  return {*a, *t};
}

// One layer, bf16, no dropout, flash / fused attention on one rank: every activation term by
// hand.
json OneLayer() {
  return json{{"parallel", {{"world_size", 1}}},
              {"model",
               {{"type", "gpt"},
                {"num_layers", 1},
                {"hidden_size", 1024},
                {"num_attention_heads", 8},
                {"ffn_hidden_size", 4096},
                {"vocab_size", 1024},
                {"hidden_dropout", 0.0},
                {"attention_dropout", 0.0},
                {"position_embedding_type", "rope"},
                {"qk_layernorm", true},
                {"add_bias_linear", false}}},
              {"run",
               {{"dtype", "bfloat16"},
                {"seq_length", 4096},
                {"micro_batch_size", 1},
                {"num_microbatches", 1}}}};
}

TEST(EstimateMlaActivations, MatchTheHandCount) {
  json doc = OneLayer();
  doc["model"]["multi_latent_attention"] = true;
  doc["model"]["q_lora_rank"] = 256;
  doc["model"]["kv_lora_rank"] = 128;
  doc["model"]["qk_head_dim"] = 128;
  doc["model"]["qk_pos_emb_head_dim"] = 64;
  doc["model"]["v_head_dim"] = 128;
  const Counted mla = Count(doc);
  // T = 4096 tokens, e = 2, h = 1024, 8 heads: the norms' inputs and outputs 4 T h e; the
  // latents and their norms' outputs T (256 + 128) 2e and the rope key's input T 64 e; Q, K
  // of 8 x 192, V of 8 x 128 and the projection's input 8 x 128; fc1's output 4096 and fc2's
  // input 4096; the log-sum-exp 4 x 8 T; the final norm's input T h e and float32 logits 4 T V.
  const double T = 4096, e = 2;
  const double layer = T * 1024 * 4 * e + T * 384 * 2 * e + T * 64 * e +
                       T * e * (1536 + 1536 + 1024 + 1024) + T * e * (4096 + 4096) + 4 * 8 * T;
  const double expected = layer + T * 1024 * e + 4 * T * 1024;
  EXPECT_EQ(static_cast<double>(mla.activations[0].activations), expected);
}

TEST(EstimateMtpActivations, TheLastStageKeepsTheDepthsLayerAndLogits) {
  json doc = OneLayer();
  doc["parallel"] = {{"world_size", 2}, {"pipeline_model_parallel_size", 2}};
  doc["model"]["num_layers"] = 2;
  const Counted without = Count(doc);
  doc["model"]["mtp_num_layers"] = 1;
  const Counted with = Count(doc);
  // The depth: enorm's and hnorm's inputs and eh_proj's input 4 T h e, a decoder layer's
  // stash, the final norm's input T h e and float32 logits 4 T V; one micro-batch in flight
  // on the last stage.
  const double T = 4096, e = 2;
  const double layer =
      T * 1024 * 4 * e + T * e * (1024 * 3 + 4096) + T * e * (1024 + 4096) + 4 * 8 * T;
  const double depth = 4 * T * 1024 * e + layer + T * 1024 * e + 4 * T * 1024;
  EXPECT_EQ(
      static_cast<double>(with.activations[1].activations - without.activations[1].activations),
      depth);
  EXPECT_EQ(with.activations[0].activations, without.activations[0].activations);
  // The last stage works longer: one more layer and output layer.
  EXPECT_GT(with.time.stages[1].forward_s, without.time.stages[1].forward_s);
  EXPECT_EQ(with.time.stages[0].forward_s, without.time.stages[0].forward_s);
}

// Full recomputation by "uniform" checkpoints the depth (MultiTokenPredictionLayer's
// _checkpointed_forward): its stash is the checkpoint's two inputs (enorm's and hnorm's, 2 T h
// e) and the logits, and its projection, layer and final norm run again in the backward.
TEST(EstimateMtpActivations, UniformRecomputationCheckpointsTheDepth) {
  json doc = OneLayer();
  doc["parallel"] = {{"world_size", 2}, {"pipeline_model_parallel_size", 2}};
  doc["model"]["num_layers"] = 2;
  doc["run"]["recompute_granularity"] = "full";
  doc["run"]["recompute_method"] = "uniform";
  doc["run"]["recompute_num_layers"] = 1;
  const Counted without = Count(doc);
  doc["model"]["mtp_num_layers"] = 1;
  const Counted with = Count(doc);
  const double T = 4096, e = 2;
  EXPECT_EQ(
      static_cast<double>(with.activations[1].activations - without.activations[1].activations),
      2 * T * 1024 * e + 4 * T * 1024);
  // The depth's executed FLOPs beyond the plain run's: its forward once more.
  json plain = doc;
  plain["run"].erase("recompute_granularity");
  plain["run"].erase("recompute_method");
  plain["run"].erase("recompute_num_layers");
  const Counted plain_with = Count(plain);
  plain["model"].erase("mtp_num_layers");
  const Counted plain_without = Count(plain);
  EXPECT_GT(with.time.stages[1].flops - without.time.stages[1].flops,
            plain_with.time.stages[1].flops - plain_without.time.stages[1].flops);
  EXPECT_EQ(with.time.stages[0].flops, without.time.stages[0].flops);
}

TEST(EstimateSlidingWindow, FlashSkipsWhatLiesLeftOfTheWindowAndKeepsTheSame) {
  json doc = OneLayer();
  doc["model"]["num_layers"] = 4;
  const Counted full = Count(doc);
  doc["model"]["window_size"] = {511, 0};
  doc["model"]["window_attn_skip_freq"] = 2;  // layers 2 and 4 full, 1 and 3 slide
  const Counted windowed = Count(doc);
  EXPECT_EQ(windowed.activations[0].activations, full.activations[0].activations);
  // 4096 positions in 32 tiles of 128; a window of 511 keys reaches 4 blocks back (query
  // tile i sees keys from 128 i - 511, in block i - 4): tiles 0..4 compute 1..5 blocks, the
  // other 27 compute 5: 15 + 135 = 150 of 1024 blocks, where causal attention computes 528. The
  // sliding layers' forward attention FLOPs: 150 / 528 of a full layer's.
  const double per_layer_full = 2 * 8 * (128 + 128.0) * 4096 * 4096 * 528 / 1024;
  const double saved = 2 * per_layer_full * (1 - 150.0 / 528);
  // Forward 1, backward 2.5 (the recomputed QK^T and four GEMMs) of the forward's FLOPs.
  EXPECT_NEAR(full.time.stages[0].flops - windowed.time.stages[0].flops, 3.5 * saved,
              1e-9 * full.time.stages[0].flops);
  EXPECT_LT(windowed.time.step_time_s, full.time.step_time_s);
  EXPECT_EQ(windowed.time.model_flops, full.time.model_flops);  // Megatron's count
}

TEST(EstimateSinks, TransformerEngineRunsThemWithoutFlashAttention) {
  json doc = OneLayer();
  doc["model"]["softmax_type"] = "learnable";
  Config config = Parse(doc);
  // A100: auto would pick FlashAttention; with sinks TE runs cuDNN's fused attention.
  StatusOr<ResolvedAttention> a100 = ResolveAttentionBackend(*config.gpt, DType::kBFloat16, 80, 1);
  ASSERT_TRUE(a100.ok());
  EXPECT_EQ(a100->backend, AttentionBackend::kFused);
  config.gpt->attention_backend = AttentionBackend::kFlash;
  StatusOr<ResolvedAttention> flash = ResolveAttentionBackend(*config.gpt, DType::kBFloat16, 90, 1);
  ASSERT_FALSE(flash.ok());
  EXPECT_EQ(flash.status().Message(),
            "model.attention_backend: \"flash\" does not run softmax_type \"learnable\" "
            "(TransformerEngine's get_attention_backend disables FlashAttention for sinks): use "
            "\"fused\", \"unfused\", \"local\" or \"auto\"");
}

}  // namespace
}  // namespace mpusim
