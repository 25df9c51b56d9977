// The memory estimate's held bytes (core/estimate/memory_estimate.h: parameters, main_grad,
// optimizer state, counted from the config alone) against what the executor allocates, on
// every rank: every sample config the world runs, and a sweep of GPT layouts (tp with and
// without sequence parallelism, pp with vp, cp, ep with etp, recomputation, float32,
// bfloat16, float16 (float16 main_grad) and float64, Adam and SGD, the plain and the
// distributed optimizer with one and two instances, uneven pipeline splits). Parameters,
// gradients and optimizer state must be equal to the byte, and so must the activations (each
// rank's measured peak - held) and the executor's count (core/estimate/executor_activations.h:
// stashes, the backward's working set, the pipeline's transfers, the optimizer step's buffers)
// on every rank, except where the count assumes balanced routing (mixture of experts with
// ep > 1 or a capacity): there within 5%. The same runs bound the preflight (run/preflight.h):
// its activations, optimizer state and total at least what each rank measured.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/estimate/executor_activations.h"
#include "core/estimate/memory_estimate.h"
#include "core/model/model.h"
#include "core/topology.h"
#include "tests/model/gpt_mpi_helpers.h"
#include "run/preflight.h"
#include "tests/mpi/world.h"
#include "tests/sanitizers.h"

namespace mpusim {
namespace {

using nlohmann::json;
using namespace gpt_mpi;

// The preflight's figures for the rank at `coords` (GptModel::PlanMemory, run/preflight.h),
// from one build of its model (unchecked): the activations (the declared stashes in flight,
// the backward's working set, the pipeline's transfers) with the optimizer's buffers (the
// gradient piece carried from the last step, the step's beyond the activations), the
// optimizer's state, and the whole plan.
struct PreflightFigures {
  PlanBytes activations = 0;
  PlanBytes state = 0;
  PlanBytes total = 0;
};

PreflightFigures Preflight(const Config& config, const Topology& topology,
                           const RankCoordinates& coords) {
  StatusOr<std::unique_ptr<Model>> model = BuildModel(config, topology, coords);
  if (!model.ok()) throw std::logic_error(model.status().Message());
  const MemoryPlan plan = run::PlanRankMemory(**model, WorldSize(), false);
  PreflightFigures figures;
  figures.total = plan.total;
  for (const MemoryItem& item : plan.items) {
    if (item.name.starts_with("optimizer: state")) figures.state += item.bytes;
    if (item.name.starts_with("activations:") || item.name.starts_with("optimizer: the ")) {
      figures.activations += item.bytes;
    }
  }
  return figures;
}

// The preflight against this rank's run: its activations at least the rank's measured
// peak - held, and for a dense model equal to the executor count `counted`, to the byte (both
// read core/model/activation_plan.h and optimizer_plan.h; MoE layers: the preflight takes the
// most rows the routing can give a rank, so it may only be above); the optimizer's state at
// least what the rank holds; the whole plan at least the rank's measured peak (parameters,
// main_grad, optimizer state and the model's constants included). Each rank checks its own
// (a failure on any rank fails the test: tests/mpi/mpi_test_main.cc).
void ExpectPreflightBoundsMeasurement(const Config& config, const Topology& topology,
                                      const run::SimulationResult::TensorBytes& measured,
                                      PlanBytes counted, const std::string& what) {
  const int64_t rank = WorldRank();
  const PreflightFigures preflight = Preflight(config, topology, topology.Coordinates(rank));
  const int64_t activations = measured.peak - measured.held;
  EXPECT_GE(static_cast<int64_t>(preflight.activations), activations)
      << "rank " << rank << ": the preflight counts " << static_cast<int64_t>(preflight.activations)
      << " B of activations, the run measured " << activations << " B";
  EXPECT_GE(static_cast<int64_t>(preflight.state), measured.optimizer)
      << "rank " << rank << ": the optimizer's state";
  EXPECT_GE(static_cast<int64_t>(preflight.total), measured.peak)
      << "rank " << rank << ": the preflight's total";
  if (!config.gpt->moe.enabled()) {
    EXPECT_EQ(static_cast<int64_t>(preflight.activations), static_cast<int64_t>(counted))
        << "rank " << rank << ": the preflight and the executor count differ";
  }
  if (rank == 0) {
    fmt::print(
        "  {}: preflight activations {} B on rank 0, measured {} B ({:+.1f}%)\n", what,
        static_cast<int64_t>(preflight.activations), activations,
        100 * (static_cast<double>(preflight.activations) / static_cast<double>(activations) - 1));
  }
}

// Runs `config` (no check) and compares each rank's measured held bytes with the estimate for
// that rank, and for a GPT its activations with the executor count and the preflight's bounds
// (one run for both); returns how many ranks were compared.
int64_t ExpectEstimateEqualsMeasurement(const Config& config, const std::string& what) {
  SCOPED_TRACE(what);
  CpuBackend backend;
  StatusOr<run::SimulationResult> result = run::Simulate(config, {false, 1, false}, backend);
  EXPECT_TRUE(result.ok()) << result.status().Message();
  if (!result.ok()) return 0;
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  EXPECT_TRUE(topology.ok());
  if (!topology.ok()) return 0;
  EXPECT_EQ(result->tensor_bytes.size(), static_cast<size_t>(WorldSize()));
  for (size_t rank = 0; rank < result->tensor_bytes.size(); ++rank) {
    const run::SimulationResult::TensorBytes& measured = result->tensor_bytes[rank];
    StatusOr<HeldMemory> estimate =
        EstimateHeldMemory(config, *topology, static_cast<int64_t>(rank));
    EXPECT_TRUE(estimate.ok()) << estimate.status().Message();
    if (!estimate.ok()) return 0;
    const auto bytes = [](PlanBytes b) { return static_cast<int64_t>(b); };
    EXPECT_EQ(bytes(estimate->parameters), measured.parameters) << "rank " << rank;
    EXPECT_EQ(bytes(estimate->gradients), measured.gradients) << "rank " << rank;
    EXPECT_EQ(bytes(estimate->optimizer), measured.optimizer) << "rank " << rank;
    // The rest of what the model allocated at initialisation: its constant tensors (the
    // positions RoPE reads), a few hundred bytes at most here.
    EXPECT_GE(measured.other, 0) << "rank " << rank;
    EXPECT_LE(measured.other, 1024) << "rank " << rank;
  }
  if (config.gpt) {
    // The activations: the executor's count against each rank's measured peak - held.
    StatusOr<std::vector<StageHeldMemory>> held = EstimateStageHeldMemory(config, *topology);
    EXPECT_TRUE(held.ok()) << held.status().Message();
    if (!held.ok()) return 0;
    StatusOr<std::vector<ExecutorActivations>> stages =
        EstimateExecutorActivations(config, *topology, *held);
    EXPECT_TRUE(stages.ok()) << stages.status().Message();
    if (!stages.ok()) return 0;
    // Where the router cannot route unevenly (a dense model, or experts all on every rank
    // without a capacity) the count is exact; elsewhere it assumes balanced routing.
    const MoeConfig& moe = config.gpt->moe;
    const bool exact =
        !moe.enabled() || (topology->sizes().ep == 1 && !moe.expert_capacity_factor);
    double worst = 0;
    for (size_t rank = 0; rank < result->tensor_bytes.size(); ++rank) {
      const run::SimulationResult::TensorBytes& measured = result->tensor_bytes[rank];
      const ExecutorActivations& counted =
          (*stages)[static_cast<size_t>(topology->Coordinates(static_cast<int64_t>(rank)).pp)];
      const double activations = static_cast<double>(measured.peak - measured.held);
      const double error = (static_cast<double>(counted.peak()) - activations) / activations;
      EXPECT_LE(std::abs(error), exact ? 0.0 : 0.05)
          << "rank " << rank << ": counted " << static_cast<int64_t>(counted.peak())
          << " B (stashes " << static_cast<int64_t>(counted.stashes) << ", working "
          << static_cast<int64_t>(counted.working) << ", transfers "
          << static_cast<int64_t>(counted.transfers) << ", carried "
          << static_cast<int64_t>(counted.carried) << "; optimizer step "
          << static_cast<int64_t>(counted.optimizer_step) << "), measured " << activations
          << " B";
      if (std::abs(error) > std::abs(worst)) worst = error;
    }
    const int64_t rank = WorldRank();
    ExpectPreflightBoundsMeasurement(
        config, *topology, result->tensor_bytes[static_cast<size_t>(rank)],
        (*stages)[static_cast<size_t>(topology->Coordinates(rank).pp)].peak(), what);
    if (WorldRank() == 0) {
      fmt::print("  {}: activations counted {} B on rank 0, measured {} B; worst rank {:+.2f}% "
                 "({})\n",
                 what, static_cast<int64_t>((*stages)[0].peak()),
                 result->tensor_bytes[0].peak - result->tensor_bytes[0].held, 100 * worst,
                 exact ? "must be exact" : "balanced routing, within 5%");
    }
  }
  if (WorldRank() == 0) {
    const run::SimulationResult::TensorBytes& first = result->tensor_bytes.front();
    fmt::print("  {}: rank 0 holds {} B parameters, {} B main_grad, {} B optimizer (equal to "
               "the estimate on {} ranks) and {} B of constants\n",
               what, first.parameters, first.gradients, first.optimizer, WorldSize(), first.other);
  }
  return WorldSize();
}

TEST(MemoryEstimate, EverySampleConfigHoldsWhatTheEstimateCounts) {
  int64_t compared = 0;
  for (const auto& entry : std::filesystem::directory_iterator(MPUSIM_SAMPLE_CONFIG_DIR)) {
    if (entry.path().extension() != ".json") continue;
    StatusOr<Config> config = LoadConfigFile(entry.path().string());
    ASSERT_TRUE(config.ok()) << entry.path() << ": " << config.status().Message();
    if (!config->run || config->parallel.world_size != WorldSize()) continue;
    // Two iterations at most: the second starts with what the first's optimizer kept.
    config->run->train_iters = std::min<int64_t>(config->run->train_iters, 2);
    compared += ExpectEstimateEqualsMeasurement(*config, entry.path().filename().string());
  }
  if (WorldRank() == 0) fmt::print("  {} rank runs compared\n", compared);
}

struct Case {
  std::string name;
  json document;
};

// GPT layouts of the world's ranks, each trained one iteration.
std::vector<Case> Layouts() {
  const int64_t w = WorldSize();
  std::vector<Case> cases;
  json dense = Llama(8, 4);
  dense["num_layers"] = 4;
  json moe = dense;
  moe["num_moe_experts"] = 4;
  moe["moe_router_topk"] = 2;
  moe["moe_ffn_hidden_size"] = 16;
  moe["moe_shared_expert_intermediate_size"] = 16;
  // The alltoall dispatcher; top-1 routing over scores before the softmax, with a capacity,
  // on every second layer, with the grouped GEMM's weights.
  json moe_a2a = moe;
  moe_a2a["moe_token_dispatcher_type"] = "alltoall";
  json moe_gg = moe_a2a;  // the experts' weights as one grouped GEMM (moe_act needs it)
  moe_gg["moe_grouped_gemm"] = true;
  json moe_capacity = dense;
  moe_capacity["num_moe_experts"] = 4;
  moe_capacity["moe_router_topk"] = 1;
  moe_capacity["moe_router_pre_softmax"] = true;
  moe_capacity["moe_layer_freq"] = json::array({0, 1, 0, 1});
  moe_capacity["moe_ffn_hidden_size"] = 24;
  moe_capacity["moe_expert_capacity_factor"] = 1.0;
  moe_capacity["moe_grouped_gemm"] = true;
  moe_capacity["moe_z_loss_coeff"] = 0.001;
  // gpt-oss's MoE MLP: the router's and the experts' biases (no shared expert: Megatron has
  // none with biases) and the clamped quick-GELU GLU.
  json moe_bias = dense;
  moe_bias["add_bias_linear"] = true;
  moe_bias["activation"] = "quick_geglu";
  moe_bias["glu_linear_offset"] = 1.0;
  moe_bias["activation_func_clamp_value"] = 0.1;
  moe_bias["num_moe_experts"] = 4;
  moe_bias["moe_router_topk"] = 2;
  moe_bias["moe_ffn_hidden_size"] = 16;
  // Many narrow experts: the router's tensors ([T, E] scores, logits and their gradients)
  // outgrow the experts' rows, so its backward is the peak the count must match.
  json moe_router = dense;
  moe_router["num_moe_experts"] = 256;
  moe_router["moe_router_topk"] = 2;
  moe_router["moe_ffn_hidden_size"] = 4;
  moe_router["moe_z_loss_coeff"] = 0.001;
  // The same experts routed DeepSeek-style: sigmoid scores (their backward on the host),
  // group-limited, scaled, with the load-balancing loss.
  json moe_sigmoid = moe_router;
  moe_sigmoid["moe_router_score_function"] = "sigmoid";
  moe_sigmoid["moe_router_num_groups"] = 8;
  moe_sigmoid["moe_router_group_topk"] = 2;
  moe_sigmoid["moe_router_topk_scaling_factor"] = 2.5;
  moe_sigmoid["moe_aux_loss_coeff"] = 0.01;
  // Sizes that no data-parallel size divides, so the distributed optimizer pads its buffer
  // and the last rank owns fewer elements than the first.
  json odd = Gpt(3, 3);
  odd["hidden_size"] = 21;
  odd["ffn_hidden_size"] = 43;
  odd["vocab_size"] = 51;
  // Wide and short: the optimizer step's buffers (float16's float32 gradient copies above
  // all) outgrow the activations, so the step is the peak the count must match.
  json wide = Gpt(4, 4);
  wide["num_layers"] = 1;
  wide["hidden_size"] = 128;
  wide["ffn_hidden_size"] = 512;
  wide["vocab_size"] = 256;
  // gpt-oss's attention: a sliding window on every second layer and learnable sinks (each
  // row's log-sum-exp kept for the sinks' gradient).
  json oss = dense;
  oss["window_size"] = {3, 0};
  oss["window_attn_skip_freq"] = 2;
  oss["softmax_type"] = "learnable";
  // Two multi-token prediction depths on the last stage (its word embedding copy, each
  // depth's layer, logits and loss).
  json mtp = dense;
  mtp["mtp_num_layers"] = 2;
  // DeepSeek-V3's pair: the depths' layers are MoE layers (the last decoder layer's spec),
  // each with its router, experts and shared expert.
  json moe_mtp = moe;
  moe_mtp["mtp_num_layers"] = 2;
  struct Layout {
    const char* model;
    int64_t tp, pp, vp, cp, ep, etp;
    bool sp;
    const char* cp_comm = nullptr;    // the model's default: "p2p"
    // SetRecompute's spec; none: "full" at tp 2 without pp or cp, else none
    const char* recompute = nullptr;
    bool qk_norm = false, fusion = false;
  };
  const std::vector<Layout> layouts = {
      {"dense", 1, 1, 1, 1, 1, 0, false},
      {"dense", 2, 1, 1, 1, 1, 0, true},
      {"dense", 4, 1, 1, 1, 1, 0, false},
      {"dense", 1, 2, 1, 1, 1, 0, false},
      {"dense", 2, 2, 2, 1, 1, 0, true},
      {"dense", 1, 4, 1, 1, 1, 0, false},
      {"dense", 1, 1, 1, 2, 1, 0, false},
      {"dense", 2, 1, 1, 2, 1, 0, true},
      {"moe", 1, 1, 1, 1, 2, 0, false},
      {"moe", 2, 1, 1, 1, 2, 1, true},
      {"moe", 1, 2, 1, 1, 2, 0, false},
      {"moe", 2, 1, 1, 1, 1, 1, true},
      {"moe", 1, 1, 1, 1, 4, 0, false},
      {"moe_a2a", 1, 1, 1, 1, 1, 0, false},
      {"moe_a2a", 2, 1, 1, 1, 2, 1, true},
      {"moe_a2a", 1, 2, 1, 1, 4, 0, false},
      {"moe_capacity", 2, 1, 1, 1, 2, 0, true},
      {"moe_capacity", 1, 1, 1, 1, 1, 0, false},
      {"moe_router", 1, 1, 1, 1, 1, 0, false},
      {"moe_router", 2, 1, 1, 1, 1, 0, true},
      {"moe_sigmoid", 1, 1, 1, 1, 1, 0, false},
      {"moe_sigmoid", 2, 1, 1, 1, 1, 0, true},
      {"odd", 1, 1, 1, 1, 1, 0, false},
      {"odd", 1, 2, 1, 1, 1, 0, false},
      {"wide", 1, 1, 1, 1, 1, 0, false},
      {"wide", 2, 1, 1, 1, 1, 0, true},
      // What the executor's activation count distinguishes: each cp_comm_type, selective and
      // full recomputation with a pipeline, the q/k norms, gradient accumulation fusion.
      {"dense", 1, 1, 1, 2, 1, 0, false, "all_gather"},
      {"dense", 2, 1, 1, 2, 1, 0, true, "a2a"},
      {"dense", 1, 1, 1, 4, 1, 0, false, "a2a+p2p"},
      {"dense", 1, 2, 1, 1, 1, 0, false, nullptr, "selective"},
      {"dense", 2, 1, 1, 2, 1, 0, true, "p2p", "selective", true},
      {"dense", 1, 1, 1, 2, 1, 0, false, "all_gather", nullptr, true},
      {"dense", 2, 2, 1, 1, 1, 0, true, nullptr, "full", false, true},
      // Full recomputation's methods (4 layers; 2 per chunk on pp 2): uniform groups of 2 and
      // of 3 (the last one cut short), block over the first layer, and over 3 of an MoE
      // model's layers.
      {"dense", 1, 1, 1, 1, 1, 0, false, nullptr, "full uniform 2"},
      {"dense", 1, 1, 1, 1, 1, 0, false, nullptr, "full uniform 3"},
      {"dense", 1, 2, 1, 1, 1, 0, false, nullptr, "full uniform 2"},
      {"dense", 2, 1, 1, 1, 1, 0, true, nullptr, "full block 1"},
      {"dense", 1, 2, 1, 1, 1, 0, false, nullptr, "full block 1", true},
      {"moe_a2a", 1, 1, 1, 1, 1, 0, false, nullptr, "full block 3"},
      // Selective recompute_modules: the norms, the dense MLP, all three on a pipeline and
      // with cp and the q/k norms, and an MoE model's norms.
      {"dense", 1, 1, 1, 1, 1, 0, false, nullptr, "selective layernorm"},
      {"dense", 2, 1, 1, 1, 1, 0, true, nullptr, "selective mlp"},
      {"dense", 1, 2, 1, 1, 1, 0, false, nullptr, "selective core_attn,layernorm,mlp"},
      {"dense", 2, 1, 1, 2, 1, 0, true, "p2p", "selective layernorm,mlp", true},
      {"moe_a2a", 1, 1, 1, 1, 1, 0, false, nullptr, "selective layernorm,mlp"},
      // The MoE modules: the experts' activation, the shared expert, the whole layer (with
      // ep 2 its exchanges again), and with the norms on a pipeline.
      {"moe_gg", 1, 1, 1, 1, 1, 0, false, nullptr, "selective moe_act"},
      {"moe_gg", 2, 1, 1, 1, 1, 1, true, nullptr, "selective moe_act,shared_experts"},
      {"moe_a2a", 1, 1, 1, 1, 1, 0, false, nullptr, "selective moe"},
      {"moe_a2a", 1, 1, 1, 1, 2, 0, false, nullptr, "selective moe"},
      {"moe", 1, 2, 1, 1, 1, 0, false, nullptr, "selective moe,layernorm"},
      {"moe_bias", 1, 1, 1, 1, 2, 0, false},
      {"moe_bias", 2, 1, 1, 1, 1, 1, true},
      {"odd", 1, 1, 1, 1, 1, 0, false, nullptr, nullptr, false, true},
      // gpt-oss's attention: plain, with cp 2 "a2a" (its sinks' only cp) and tp 2, and with
      // core attention recomputed on a pipeline.
      {"oss", 1, 1, 1, 1, 1, 0, false},
      {"oss", 2, 1, 1, 2, 1, 0, true, "a2a"},
      {"oss", 1, 2, 1, 1, 1, 0, false, nullptr, "selective"},
      // Multi-token prediction: alone, with tp 2 + sp on a pipeline, with virtual stages,
      // with the norms and the MLP recomputed (in the depths' layers too), and full
      // recomputation by block (the depths' layers kept whole, as Megatron skips them).
      {"mtp", 1, 1, 1, 1, 1, 0, false},
      {"mtp", 2, 2, 1, 1, 1, 0, true},
      {"mtp", 1, 2, 2, 1, 1, 0, false},
      {"mtp", 2, 1, 1, 1, 1, 0, true, nullptr, "selective layernorm,mlp"},
      {"mtp", 1, 2, 1, 1, 1, 0, false, nullptr, "full block 1"},
      {"mtp", 2, 1, 1, 1, 1, 0, true, nullptr, "full uniform 1"},
      {"mtp", 1, 2, 1, 1, 1, 0, false, nullptr, "full uniform 1"},
      // The same on an MoE model: the depths' experts split over ep 2 on a pipeline, and
      // with tp 2 + sp (expert tp 1) and the norms and the MoE layers recomputed (the depths'
      // too).
      {"moe_mtp", 1, 2, 1, 1, 2, 0, false},
      {"moe_mtp", 2, 1, 1, 1, 2, 1, true, nullptr, "selective layernorm,moe"},
  };
  for (const Layout& l : layouts) {
    const int64_t model_ranks = l.tp * l.pp * l.cp;
    if (model_ranks > w || w % model_ranks != 0) continue;
    const int64_t dp = w / model_ranks;
    if ((dp * l.cp) % l.ep != 0) continue;
    if (l.etp > 0 && (l.etp * l.ep * l.pp > w || w % (l.etp * l.ep * l.pp) != 0)) continue;
    // Each layout under four storage and optimizer settings (0 instances: the plain one).
    struct Variant {
      const char* dtype;
      const char* optimizer;
      int64_t instances;
      int64_t iterations = 1;  // 2: the second starts with what the first's optimizer kept
      const char* router_dtype = nullptr;  // an MoE model's moe_router_dtype
      // The precision-aware optimizer (distributed only): kFp16, float16 moments and master
      // weights (scaled, a float32 scale per tensor; the step reads them into float32
      // tensors); kRemainders, a bf16 run's float32 master kept as the parameter and a 16-bit
      // remainder (store_param_remainders at Megatron's default), bf16 exp_avg; kFp32Master,
      // the same with store_param_remainders false (a 4-byte master).
      enum class Aware : uint8_t { kNo, kFp16, kRemainders, kFp32Master };
      Aware precision_aware = Aware::kNo;
    };
    using Aware = Variant::Aware;
    // Two instances where both the dp size and the expert dp size divide by 2.
    const int64_t expt_dp = w / ((l.etp > 0 ? l.etp : l.tp) * l.ep * l.pp);
    const std::string name = l.model;
    const bool is_moe = name.rfind("moe", 0) == 0;
    const bool halves = dp % 2 == 0 && (!is_moe || expt_dp % 2 == 0);
    // float16 keeps Megatron's float16 main_grad and copies it to float32 for the step
    // (core/train/optimizer.h): plain for dense models, distributed for MoE ones and the wide
    // one at tp 2.
    // The sanitizer build (5 to 10 times slower) looks for memory errors, not other counts:
    // each layout keeps two settings, float32 and one bfloat16 with the distributed optimizer
    // (the code every dtype and optimizer shares), and each other setting's own code runs
    // where it shows: float16 on the wide model (whose step peak is what float16 adds), the
    // precision-aware states on the dense and the first MoE model without a pipeline, the 256
    // narrow experts on their router-dtype variants alone, the second iteration's carried
    // gradient (bfloat16 SGD, two instances) on the dense model, float64 on the odd one. The
    // release build runs them all.
    const auto sanitizer_keeps = [](const std::string& model_name, const Variant& v, int64_t pp) {
      const std::string dtype = v.dtype;
      if (model_name == "moe_router") return v.router_dtype != nullptr;
      if (dtype == "float16") return model_name == "wide";
      if (v.precision_aware != Aware::kNo) {
        return (model_name == "dense" || model_name == "moe") && pp == 1;
      }
      if (v.router_dtype == nullptr && (dtype == "float32" || v.instances == 1)) return true;
      if (dtype == "bfloat16") return model_name == "dense";
      return dtype == "float64" && model_name == "odd";
    };
    for (const Variant& v :
         {Variant{"float32", "adam", 0}, Variant{"bfloat16", "adam", 1},
          Variant{"bfloat16", "sgd", halves ? 2 : 1, 2, "fp32"}, Variant{"float64", "sgd", 0},
          Variant{"float16", "adam", is_moe || (name == "wide" && l.tp == 2), 2, "fp64"},
          Variant{"bfloat16", "adam", 1, 2, nullptr, Aware::kFp16},
          Variant{"bfloat16", "adam", halves ? 2 : 1, 2, nullptr, Aware::kRemainders},
          Variant{"bfloat16", "adam", 1, 1, nullptr, Aware::kFp32Master}}) {
      // The layouts, not the recompute; the 4-byte master on the first models only.
      if (v.precision_aware != Aware::kNo && l.recompute != nullptr) continue;
      if (v.precision_aware == Aware::kFp32Master && name != "dense" && name != "moe") continue;
      if (mpusim::testing::kAddressSanitizer && !sanitizer_keeps(name, v, l.pp)) continue;
      const json& model = name == "moe"            ? moe
                          : name == "moe_a2a"      ? moe_a2a
                          : name == "moe_gg"       ? moe_gg
                          : name == "moe_capacity" ? moe_capacity
                          : name == "moe_router"   ? moe_router
                          : name == "moe_sigmoid"  ? moe_sigmoid
                          : name == "moe_bias"     ? moe_bias
                          : name == "odd"          ? odd
                          : name == "wide"         ? wide
                          : name == "oss"          ? oss
                          : name == "mtp"          ? mtp
                          : name == "moe_mtp"      ? moe_mtp
                                                   : dense;
      json document = Document(model, l.tp, l.sp, v.dtype);
      if (is_moe && v.router_dtype != nullptr)
        document["model"]["moe_router_dtype"] = v.router_dtype;
      document = Training(document, v.optimizer);
      document["run"]["train_iters"] = v.iterations;
      json& parallel = document["parallel"];
      parallel["pipeline_model_parallel_size"] = l.pp;
      if (l.vp > 1) parallel["virtual_pipeline_model_parallel_size"] = l.vp;
      parallel["context_parallel_size"] = l.cp;
      parallel["expert_model_parallel_size"] = l.ep;
      if (l.etp > 0) parallel["expert_tensor_parallel_size"] = l.etp;
      document["run"]["micro_batch_size"] = Samples() / dp;
      // The MoE layouts route more tokens, so that each rank's share of the choices comes
      // close to the balanced routing the count assumes.
      document["run"]["seq_length"] = (is_moe ? 32 : 8) * l.cp;
      document["run"]["num_microbatches"] = 2 * l.pp;
      if (l.recompute != nullptr) {
        SetRecompute(document["run"], l.recompute);
      } else if (l.tp == 2 && l.pp == 1 && l.cp == 1) {
        SetRecompute(document["run"], "full");
      }
      if (l.cp_comm != nullptr) document["model"]["cp_comm_type"] = l.cp_comm;
      if (std::string(l.cp_comm == nullptr ? "" : l.cp_comm) == "a2a+p2p") {
        parallel["hierarchical_context_parallel_sizes"] = {2, l.cp / 2};
      }
      if (l.qk_norm) document["model"]["qk_layernorm"] = true;
      if (l.fusion) parallel["gradient_accumulation_fusion"] = true;
      if (v.instances > 0) {
        document["optimizer"]["use_distributed_optimizer"] = true;
        parallel["num_distributed_optimizer_instances"] = v.instances;
      }
      if (v.precision_aware == Aware::kFp16) {
        document["optimizer"].update({{"use_precision_aware_optimizer", true},
                                      {"main_params_dtype", "fp16"},
                                      {"exp_avg_dtype", "fp16"},
                                      {"exp_avg_sq_dtype", "fp16"}});
      } else if (v.precision_aware != Aware::kNo) {
        document["optimizer"].update(
            {{"use_precision_aware_optimizer", true}, {"exp_avg_dtype", "bf16"}});
        if (v.precision_aware == Aware::kFp32Master) {
          document["optimizer"]["store_param_remainders"] = false;
        }
      }
      std::string extra;
      if (l.cp_comm != nullptr) extra += fmt::format(" {}", l.cp_comm);
      if (l.recompute != nullptr) extra += fmt::format(" recompute {}", l.recompute);
      if (l.qk_norm) extra += " qk_layernorm";
      if (l.fusion) extra += " fused wgrad";
      if (is_moe && v.router_dtype != nullptr) extra += fmt::format(" router {}", v.router_dtype);
      cases.push_back(
          {fmt::format(
               "{} tp {}{} pp {} vp {} cp {}{} ep {} etp {} {} {} {}{}", l.model, l.tp,
               l.sp ? " sp" : "", l.pp, l.vp, l.cp, extra, l.ep, l.etp > 0 ? l.etp : l.tp, v.dtype,
               v.optimizer,
               v.instances == 0 ? std::string("plain")
               : v.precision_aware == Aware::kNo
                   ? fmt::format("distributed x{}", v.instances)
                   : fmt::format("distributed x{} precision-aware {}", v.instances,
                                 v.precision_aware == Aware::kFp16         ? "fp16"
                                 : v.precision_aware == Aware::kRemainders ? "bf16 + remainders"
                                                                           : "fp32 master"),
               v.iterations > 1 ? ", 2 iterations" : ""),
           document});
    }
  }
  // Uneven pipeline splits (core/pipeline_split.h): stages of different layer counts, a
  // chunk with no layer (embedding only, loss only, or passing its input on), each split key.
  struct Uneven {
    int64_t pp, num_layers;
    json keys;       // the parallel section's split keys
    int64_t tp = 1;  // with sequence parallelism when 2
  };
  const std::vector<Uneven> uneven = {
      {2, 4, {{"pipeline_model_parallel_layout", "Et|tttL"}}},
      {2, 4, {{"pipeline_model_parallel_layout", "E|tt|tt|L"}}},
      {2, 4, {{"decoder_first_pipeline_num_layers", 1}}},
      {2,
       2,
       {{"virtual_pipeline_model_parallel_size", 2},
        {"account_for_embedding_in_pipeline_split", true},
        {"account_for_loss_in_pipeline_split", true}}},
      {4, 8, {{"pipeline_model_parallel_layout", "E|t|tt|t||t|t|ttL"}}},
      {4, 6, {{"decoder_last_pipeline_num_layers", 3}}},
      {4,
       6,
       {{"account_for_embedding_in_pipeline_split", true},
        {"account_for_loss_in_pipeline_split", true}}},
      {2, 4, {{"pipeline_model_parallel_layout", "Et||ttt|L"}}},
      {4, 4, {{"pipeline_model_parallel_layout", "Ett||tt|L"}}},  // pp rank 1 holds nothing
      {2, 4, {{"pipeline_model_parallel_layout", "E|tt|t|tL"}}, 2},
      {2, 4, {{"pipeline_model_parallel_layout", "Et|t||ttL"}}, 2},
      {2, 4, {{"pipeline_model_parallel_layout", "Ett|t|t|L"}}, 2},
  };
  for (const Uneven& u : uneven) {
    if (u.pp * u.tp > w || w % (u.pp * u.tp) != 0) continue;
    json model = dense;
    model["num_layers"] = u.num_layers;
    json document = Training(Document(model, u.tp, u.tp > 1, "float32"), "adam");
    document["run"]["train_iters"] = 1;
    document["parallel"]["pipeline_model_parallel_size"] = u.pp;
    document["parallel"].update(u.keys);
    document["run"]["micro_batch_size"] = Samples() / (w / (u.pp * u.tp));
    document["run"]["seq_length"] = 8;
    document["run"]["num_microbatches"] = 2 * u.pp;
    cases.push_back({fmt::format("dense tp {}{} pp {} layers {} split {}", u.tp,
                                 u.tp > 1 ? " sp" : "", u.pp, u.num_layers, u.keys.dump()),
                     document});
  }
  return cases;
}

TEST(MemoryEstimate, EveryLayoutHoldsWhatTheEstimateCounts) {
  int64_t compared = 0;
  for (const Case& c : Layouts()) {
    Config config;
    const Status status = ParseConfig(c.document, &config);
    ASSERT_TRUE(status.ok()) << c.name << ": " << status.Message();
    compared += ExpectEstimateEqualsMeasurement(config, c.name);
  }
  if (WorldRank() == 0) fmt::print("  {} rank runs compared\n", compared);
}

// The busiest rank of each stage: the first, which owns the fullest distributed-optimizer
// pieces; no rank of the stage holds more.
TEST(MemoryEstimate, EachStageNamesItsBusiestRank) {
  for (const Case& c : Layouts()) {
    SCOPED_TRACE(c.name);
    Config config;
    ASSERT_TRUE(ParseConfig(c.document, &config).ok());
    StatusOr<Topology> topology = Topology::Create(config.parallel);
    ASSERT_TRUE(topology.ok());
    StatusOr<std::vector<StageHeldMemory>> stages = EstimateStageHeldMemory(config, *topology);
    ASSERT_TRUE(stages.ok()) << stages.status().Message();
    ASSERT_EQ(static_cast<int64_t>(stages->size()), topology->sizes().pp);
    for (int64_t rank = 0; rank < topology->world_size(); ++rank) {
      const int64_t pp = topology->Coordinates(rank).pp;
      StatusOr<HeldMemory> held = EstimateHeldMemory(config, *topology, rank);
      ASSERT_TRUE(held.ok());
      EXPECT_LE(held->total(), (*stages)[static_cast<size_t>(pp)].held.total()) << "rank " << rank;
      EXPECT_EQ(held->parameters, (*stages)[static_cast<size_t>(pp)].held.parameters);
    }
  }
}

}  // namespace
}  // namespace mpusim
