// What the GPT MPI suites share (gpt_mpi_test.cc, gpt_cp_mpi_test.cc): configs of small GPT
// models on the world's ranks, and a run checked tensor by tensor against the float64
// reference.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/config/config.h"
#include "run/runner.h"
#include "sim/cpu_backend.h"
#include "tests/mpi/world.h"

namespace mpusim::gpt_mpi {

using nlohmann::json;

inline Config MakeConfig(const json& document) {
  Config config;
  const Status status = ParseConfig(document, &config);
  EXPECT_TRUE(status.ok()) << status.Message() << "\n" << document.dump();
  return config;
}

inline StatusOr<run::SimulationResult> Simulate(const json& document, bool check = true) {
  CpuBackend backend;
  return run::Simulate(MakeConfig(document), {check, 1, /*keep_records=*/true}, backend);
}

// Runs `document` and expects every tensor to match the reference; prints the worst margin.
inline run::SimulationResult RunChecked(const json& document) {
  StatusOr<run::SimulationResult> result = Simulate(document);
  EXPECT_TRUE(result.ok()) << result.status().Message();
  if (!result.ok()) return {};
  EXPECT_FALSE(result->check.tensors.empty());
  double worst = 0;
  std::string worst_name;
  for (const run::TensorCheck& c : result->check.tensors) {
    EXPECT_TRUE(c.ok()) << c.name << ": " << c.mismatches << " of " << c.count
                        << " elements off, max abs " << c.max_abs << ", normalized "
                        << c.normalized << ", allowed " << c.allowed << ", worst " << c.worst_index
                        << " " << c.worst_actual << " vs " << c.worst_expected
                        << (c.missing ? " (not in the reference)" : "")
                        << (c.not_produced ? " (not recorded by the run)" : "") << "\n"
                        << document.dump();
    if (c.used > worst) {
      worst = c.used;
      worst_name = c.name;
    }
  }
  if (WorldRank() == 0) {
    fmt::print("  {} tensors, worst error {:.3f} of its allowance ({}); loss {:.12g} vs "
               "reference {:.12g}\n",
               result->check.tensors.size(), worst, worst_name, result->loss,
               result->check.reference_loss);
  }
  const double relative = document["run"]["dtype"] == "float64" ? 1e-12 : 1e-2;
  EXPECT_NEAR(result->loss, result->check.reference_loss,
              relative * std::fabs(result->check.reference_loss));
  return std::move(result).value();
}

// Samples per micro-batch over all dp ranks: 8, or the world size past 8 ranks.
inline int64_t Samples() { return std::max<int64_t>(8, WorldSize()); }

inline json Gpt(int64_t heads, int64_t groups) {
  return {{"type", "gpt"},          {"num_layers", 2},       {"hidden_size", 32},
          {"num_attention_heads", heads}, {"num_query_groups", groups},
          {"ffn_hidden_size", 64},  {"vocab_size", 64},      {"make_vocab_size_divisible_by", 1}};
}

inline json Llama(int64_t heads, int64_t groups) {
  json model = Gpt(heads, groups);
  model["normalization"] = "RMSNorm";
  model["activation"] = "swiglu";
  model["position_embedding_type"] = "rope";
  model["share_embeddings_and_output_weights"] = false;
  model["add_bias_linear"] = false;
  model["label_smoothing"] = 0.1;
  model["vocab_size"] = 50;  // padded, differently at each tp size
  model["make_vocab_size_divisible_by"] = 8;
  return model;
}

// DeepSeek-V3-style routing on `model` (Megatron's topk_routing_with_score_function): 8
// experts of moe_ffn_hidden_size 16 in 4 groups of 2, each token choosing 3 experts from the 3
// groups whose best expert scores highest, the chosen sigmoids normalised and scaled by 2.5;
// the load-balancing loss (0.01) on the normalised sigmoids, the z-loss (0.001) and a shared
// expert of 24.
inline json WithDeepSeekRouting(json model) {
  model["num_moe_experts"] = 8;
  model["moe_router_topk"] = 3;
  model["moe_ffn_hidden_size"] = 16;
  model["moe_router_score_function"] = "sigmoid";
  model["moe_router_num_groups"] = 4;
  model["moe_router_group_topk"] = 3;
  model["moe_router_topk_scaling_factor"] = 2.5;
  model["moe_aux_loss_coeff"] = 0.01;
  model["moe_z_loss_coeff"] = 0.001;
  model["moe_shared_expert_intermediate_size"] = 24;
  return model;
}

// Sets the run's recompute keys from `spec`: "selective" (Megatron's default modules),
// "selective <module>,<module>", "full" (every layer recomputed alone: uniform, 1 layer),
// "full uniform <n>" or "full block <n>".
inline void SetRecompute(json& run, const std::string& spec) {
  std::istringstream words(spec);
  std::string granularity, second;
  int64_t n = 1;
  words >> granularity >> second >> n;
  run["recompute_granularity"] = granularity;
  if (granularity == "full") {
    run["recompute_method"] = second.empty() ? "uniform" : second;
    run["recompute_num_layers"] = n;
  } else if (!second.empty()) {
    json modules = json::array();
    std::istringstream names(second);
    for (std::string name; std::getline(names, name, ',');) modules.push_back(name);
    run["recompute_modules"] = modules;
  }
}

inline json Document(const json& model, int64_t tp, bool sequence_parallel, const char* dtype,
              const char* recompute = nullptr) {
  // A global batch of 8 samples per micro-batch on every layout (16 on 16 ranks), so that
  // every layout trains on the same data.
  const int64_t dp = WorldSize() / tp;
  json run = {{"seed", 7},
              {"dtype", dtype},
              {"seq_length", 8},
              {"micro_batch_size", Samples() / dp},
              {"num_microbatches", 2}};
  if (recompute != nullptr) SetRecompute(run, recompute);
  return {{"parallel",
           {{"world_size", WorldSize()},
            {"tensor_model_parallel_size", tp},
            {"sequence_parallel", sequence_parallel}}},
          {"model", model},
          {"run", run}};
}

// `model` on cp x tp x pp ranks (sequence parallelism with tp > 1 when `sp`), dp filling the
// world; 16 tokens (2 cp chunks of 16 / (2 cp) each on every cp rank), the global batch of
// every other layout of the suite.
inline json CpDocument(const json& model, int64_t cp, int64_t tp, int64_t pp, bool sp,
                       const char* dtype, const char* comm = "all_gather") {
  json document = Document(model, tp, sp, dtype);
  document["parallel"]["context_parallel_size"] = cp;
  document["parallel"]["pipeline_model_parallel_size"] = pp;
  document["model"]["cp_comm_type"] = comm;
  // "a2a+p2p": the heads' all-to-all over pairs of cp ranks, the ring across the pairs.
  if (std::string(comm) == "a2a+p2p") {
    document["parallel"]["hierarchical_context_parallel_sizes"] = {2, cp / 2};
  }
  document["run"]["seq_length"] = 16;
  document["run"]["micro_batch_size"] = Samples() / (WorldSize() / (cp * tp * pp));
  return document;
}

// A training run of `document`: 4 iterations of Adam (with warm-up and clipping) or SGD
// (cosine decay, clipping, weight decay).
inline json Training(json document, const char* optimizer) {
  document["run"]["train_iters"] = 4;
  if (std::string(optimizer) == "adam") {
    document["optimizer"] = {
        {"optimizer", "adam"}, {"lr", 1e-3}, {"lr_warmup_iters", 1}, {"clip_grad", 1.0}};
  } else {
    document["optimizer"] = {{"optimizer", "sgd"}, {"lr", 0.5},        {"lr_decay_style", "cosine"},
                             {"min_lr", 0.05},     {"clip_grad", 0.5}, {"weight_decay", 0.1}};
  }
  return document;
}

// A training run's curve: each iteration's loss and gradient norm, in turn.
inline std::vector<double> LossAndNormCurve(const run::SimulationResult& result) {
  std::vector<double> curve;
  for (const auto& row : result.iterations) {
    curve.push_back(row.loss);
    curve.push_back(row.grad_norm);
  }
  return curve;
}

// The curve of `document` trained 3 Adam iterations of 4 micro-batches with the distributed
// optimizer, every tensor checked against the reference (the runs ExpectSameCurves compares
// across layouts).
inline std::vector<double> DistributedOptimizerCurve(const json& document) {
  json trained = Training(document, "adam");
  trained["run"]["train_iters"] = 3;
  trained["run"]["num_microbatches"] = 4;
  trained["optimizer"]["use_distributed_optimizer"] = true;
  const run::SimulationResult result = RunChecked(trained);
  EXPECT_EQ(result.iterations.size(), 3u);
  EXPECT_TRUE(result.optimizer.distributed);
  return LossAndNormCurve(result);
}

// Every curve equals the first to 1e-12 relative (float64 runs of one model in other layouts).
inline void ExpectSameCurves(const std::vector<std::vector<double>>& curves) {
  for (size_t c = 1; c < curves.size(); ++c) {
    ASSERT_EQ(curves[c].size(), curves[0].size()) << "layout " << c;
    for (size_t i = 0; i < curves[c].size(); ++i) {
      EXPECT_NEAR(curves[c][i], curves[0][i], 1e-12 * std::fabs(curves[0][i]))
          << "layout " << c << " value " << i;
    }
  }
}

}  // namespace mpusim::gpt_mpi
