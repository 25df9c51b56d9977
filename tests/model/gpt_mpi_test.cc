// The GPT model on K MPI ranks (ctest runs this binary with K = 1, 2, 4, 8) against the
// float64 GPT reference: every tp x dp layout the world size allows, with and without
// sequence parallelism, dropout on (the default 0.1, masks drawn per global element), in
// float64, float32 and bfloat16; the Llama-style options (RMSNorm, SwiGLU, RoPE, grouped-query
// attention, untied output layer, no biases, label smoothing); squared_relu; recomputation giving
// bit-identical results; and the same loss from every layout of one model.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "core/config/config.h"
#include "core/model/gpt_model.h"
#include "core/pipeline/executor.h"
#include "core/schedule.h"
#include "core/topology.h"
#include "core/train/train_step.h"
#include "run/runner.h"
#include "sim/cpu_backend.h"
#include "tests/model/gpt_mpi_helpers.h"
#include "tests/mpi/world.h"

namespace mpusim {
namespace {

using nlohmann::json;
using namespace gpt_mpi;

// Every tp size that divides the world, up to the models' 8 heads.
std::vector<int64_t> TensorParallelSizes() {
  std::vector<int64_t> sizes;
  for (int64_t t = 1; t <= WorldSize() && t <= 8; t *= 2) {
    if (WorldSize() % t == 0) sizes.push_back(t);
  }
  return sizes;
}


// One step of `model` on this rank (core/train RunStep) with the executor of its layout;
// returns the executor (its stashes and timeline).
PipelineExecutor StepModel(GptModel& model, const Config& config, RankContext& ctx,
                           bool record) {
  StatusOr<PipelineExecutor> executor = PipelineExecutor::ForRank(
      config.parallel, config.run->num_microbatches, ctx.coords.pp);
  if (!executor.ok()) throw std::runtime_error(executor.status().Message());
  RunStep(model, *executor, ctx, 0, record, /*reduce_dp=*/true);
  return std::move(executor).value();
}

TEST(GptMpi, EveryLayoutMatchesTheReferenceInFloat64) {
  std::vector<double> losses;
  for (const int64_t t : TensorParallelSizes()) {
    for (const bool sp : {false, true}) {
      if (sp && t == 1) continue;
      SCOPED_TRACE(fmt::format("tp {}, dp {}, sequence_parallel {}", t, WorldSize() / t, sp));
      losses.push_back(RunChecked(Document(Gpt(8, 8), t, sp, "float64")).loss);
    }
  }
  // One model, one padded vocabulary, masks drawn per global element: every layout computes
  // the same loss up to summation order.
  for (const double loss : losses) EXPECT_NEAR(loss, losses.front(), 1e-12);
}

// A 4-layer model on a pipeline of pp stages (vp virtual stages each, 0: none), tp the
// rest with sequence parallelism, dp filling the world; 4 micro-batches of the same global
// batch of 8 samples as every other layout.
json PipelineDocument(int64_t pp, int64_t vp, int64_t tp, const char* dtype) {
  json model = Gpt(8, 8);
  model["num_layers"] = 4;
  json document = Document(model, tp, tp > 1, dtype);
  document["parallel"]["pipeline_model_parallel_size"] = pp;
  if (vp > 0) document["parallel"]["virtual_pipeline_model_parallel_size"] = vp;
  const int64_t dp = WorldSize() / (pp * tp);
  document["run"]["micro_batch_size"] = Samples() / dp;
  document["run"]["num_microbatches"] = 4;
  return document;
}

struct PipelineLayout {
  int64_t pp, vp, tp;
};

std::vector<PipelineLayout> PipelineLayouts() {
  std::vector<PipelineLayout> layouts;
  for (int64_t pp : {1, 2, 4}) {
    for (int64_t vp : {0, 2}) {
      if (vp > 0 && (pp == 1 || 4 % (pp * vp) != 0)) continue;
      for (int64_t tp = 1; pp * tp <= WorldSize() && tp <= 8; tp *= 2) {  // 8 heads
        if (WorldSize() % (pp * tp) == 0) layouts.push_back({pp, vp, tp});
      }
    }
  }
  return layouts;
}

// Pipeline execution (1F1B and interleaved, core/pipeline's plan over the pp group): every
// tensor matches the float64 reference, and every layout gives the same loss as pp = 1.
TEST(GptMpi, PipelineLayoutsMatchTheReferenceAndEachOther) {
  std::vector<double> losses;
  for (const PipelineLayout& l : PipelineLayouts()) {
    SCOPED_TRACE(
        fmt::format("pp {} vp {} tp {} dp {}", l.pp, l.vp, l.tp, WorldSize() / (l.pp * l.tp)));
    if (WorldRank() == 0) {
      fmt::print("  pp {} vp {} tp {} dp {}:", l.pp, l.vp, l.tp, WorldSize() / (l.pp * l.tp));
    }
    losses.push_back(RunChecked(PipelineDocument(l.pp, l.vp, l.tp, "float64")).loss);
  }
  ASSERT_FALSE(losses.empty());
  for (const double loss : losses) EXPECT_NEAR(loss, losses.front(), 1e-12);
}

// Activation memory follows the schedule: on pp rank r, 1F1B keeps at most min(p - r, M)
// micro-batches between their forward and backward, the interleaved schedule its warmup
// forwards plus one.
TEST(GptMpi, PipelineStashesFollowTheSchedulesInFlightCount) {
  for (const PipelineLayout& l : PipelineLayouts()) {
    if (l.pp == 1 || l.tp != 1) continue;
    SCOPED_TRACE(fmt::format("pp {} vp {}", l.pp, l.vp));
    const Config config = MakeConfig(PipelineDocument(l.pp, l.vp, 1, "float32"));
    StatusOr<Topology> topology = Topology::Create(config.parallel);
    ASSERT_TRUE(topology.ok());
    const int rank = WorldRank();
    const RankCoordinates coords = topology->Coordinates(rank);
    StatusOr<std::unique_ptr<GptModel>> model = GptModel::Build(config, *topology, coords);
    ASSERT_TRUE(model.ok()) << model.status().Message();
    CpuBackend backend;
    CommTrace trace;
    RankContext ctx = run::MakeRankContext(config, backend, *topology, rank, &trace);
    (*model)->InitializeParameters(*ctx.kernels);
    const PipelineExecutor executor = StepModel(**model, config, ctx, false);
    EXPECT_EQ(executor.live_stashes(), 0);
    StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(
        l.pp, l.vp > 0 ? std::optional<int64_t>(l.vp) : std::nullopt, 4, std::nullopt);
    ASSERT_TRUE(schedule.ok());
    const int64_t expected = l.vp > 0
                                 ? std::min<int64_t>(schedule->NumWarmup(coords.pp) + 1, 4 * l.vp)
                                 : std::min<int64_t>(l.pp - coords.pp, 4);
    EXPECT_EQ(executor.peak_live_stashes(), expected) << "pp rank " << coords.pp;
  }
}

// The run's timeline (every rank's step spans on one clock) follows the data: the forward of
// (chunk, micro-batch) on virtual stage u > 0 starts after the forward on u - 1 ended, its
// backward after the backward on u + 1 ended; each rank runs 2 M steps per chunk, one at a time.
TEST(GptMpi, TimelineFollowsTheDataDependencies) {
  for (const PipelineLayout& l : PipelineLayouts()) {
    if (l.pp == 1 || l.tp != 1) continue;
    SCOPED_TRACE(fmt::format("pp {} vp {}", l.pp, l.vp));
    run::SimulateOptions options;
    options.check = false;
    CpuBackend backend;
    StatusOr<run::SimulationResult> result =
        run::Simulate(MakeConfig(PipelineDocument(l.pp, l.vp, 1, "float32")), options, backend);
    ASSERT_TRUE(result.ok()) << result.status().Message();
    const int64_t v = l.vp > 0 ? l.vp : 1;
    ASSERT_EQ(result->timeline.size(), static_cast<size_t>(WorldSize()));
    std::map<std::tuple<bool, int64_t, int64_t>, std::pair<double, double>> spans;  // (F, u, m)
    for (const auto& rank : result->timeline) {
      ASSERT_EQ(rank.steps.size(), static_cast<size_t>(2 * 4 * v));
      double previous_end = 0;
      for (const StepSpan& s : rank.steps) {
        EXPECT_GE(s.begin, previous_end);
        EXPECT_GE(s.end, s.begin);
        previous_end = s.end;
        spans[{s.forward, s.chunk * l.pp + rank.pp_rank, s.microbatch}] = {s.begin, s.end};
      }
      EXPECT_GE(rank.schedule_end, previous_end);
    }
    for (const auto& [key, span] : spans) {
      const auto& [forward, u, m] = key;
      if (forward && u > 0) {
        EXPECT_GE(span.first, spans.at({true, u - 1, m}).second) << "F u " << u << " m " << m;
      }
      if (!forward && u + 1 < l.pp * v) {
        EXPECT_GE(span.first, spans.at({false, u + 1, m}).second) << "B u " << u << " m " << m;
      }
    }
  }
}

// A pp group that completes every batch before returning, as NCCL's does.
class CompletingCommunicator final : public Communicator {
 public:
  explicit CompletingCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int Rank() const override { return inner_->Rank(); }
  int Size() const override { return inner_->Size(); }
  void AllReduce(Tensor& buffer, ReduceOp op) override { inner_->AllReduce(buffer, op); }
  void AllGather(const Tensor& in, Tensor& out) override { inner_->AllGather(in, out); }
  void ReduceScatter(const Tensor& in, Tensor& out) override { inner_->ReduceScatter(in, out); }
  void AllToAll(const Tensor& in, Tensor& out) override { inner_->AllToAll(in, out); }
  void AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                 const std::vector<int64_t>& recv_counts) override {
    inner_->AllToAllV(in, send_counts, out, recv_counts);
  }
  void Broadcast(Tensor& buffer, int root) override { inner_->Broadcast(buffer, root); }
  std::unique_ptr<PendingP2P> PostSendRecv(const std::vector<P2POp>& ops) override {
    std::unique_ptr<PendingP2P> pending = inner_->PostSendRecv(ops);
    pending->Wait();
    return pending;
  }
  bool LeavesSendsInFlight() const override { return false; }

 private:
  std::unique_ptr<Communicator> inner_;
};

// Without sends in flight (NCCL) the executor runs the lockstep plan (every batch waited
// for, untagged): 1F1B and interleaved give the loss of the default path bit for bit.
TEST(GptMpi, PipelineWithCompletingPointToPoint) {
  for (const PipelineLayout& l : PipelineLayouts()) {
    if (l.pp == 1) continue;
    SCOPED_TRACE(fmt::format("pp {} vp {} tp {}", l.pp, l.vp, l.tp));
    const Config config = MakeConfig(PipelineDocument(l.pp, l.vp, l.tp, "float32"));
    StatusOr<Topology> topology = Topology::Create(config.parallel);
    ASSERT_TRUE(topology.ok());
    const int rank = WorldRank();
    double losses[2] = {0, 0};
    for (int completing = 0; completing < 2; ++completing) {
      StatusOr<std::unique_ptr<GptModel>> model =
          GptModel::Build(config, *topology, topology->Coordinates(rank));
      ASSERT_TRUE(model.ok()) << model.status().Message();
      CpuBackend backend;
      CommTrace trace;
      RankContext ctx = run::MakeRankContext(config, backend, *topology, rank, &trace);
      if (completing == 1) {
        ctx.groups.pp = std::make_unique<CompletingCommunicator>(std::move(ctx.groups.pp));
      }
      (*model)->InitializeParameters(*ctx.kernels);
      StepModel(**model, config, ctx, false);
      losses[completing] = (*model)->loss();
    }
    EXPECT_EQ(losses[0], losses[1]);
  }
}

// Training (run.train_iters with an optimizer section): every iteration's loss, the last
// iteration's tensors and clipped gradients, and the final parameters match the float64
// reference training the same model; every layout of one model gives the same loss curve.
TEST(GptMpi, TrainingMatchesTheReferenceOnEveryLayout) {
  for (const char* optimizer : {"adam", "sgd"}) {
    std::vector<std::vector<double>> curves;
    // dp only, tp only, and a pipeline (of two stages when the world allows).
    std::vector<PipelineLayout> layouts = {{1, 0, 1}};
    if (WorldSize() > 1) layouts.push_back({1, 0, WorldSize()});
    if (WorldSize() > 1) layouts.push_back({2, 0, 1});
    for (const PipelineLayout& l : layouts) {
      SCOPED_TRACE(fmt::format("{}: pp {} tp {}", optimizer, l.pp, l.tp));
      if (WorldRank() == 0) fmt::print("  {} pp {} tp {}:", optimizer, l.pp, l.tp);
      const run::SimulationResult result =
          RunChecked(Training(PipelineDocument(l.pp, 0, l.tp, "float64"), optimizer));
      ASSERT_EQ(result.iterations.size(), 4u);
      ASSERT_EQ(result.check.reference_iterations.size(), 4u);
      std::vector<double> curve;
      for (size_t i = 0; i < 4; ++i) {
        const double expected = result.check.reference_iterations[i].loss;
        EXPECT_NEAR(result.iterations[i].loss, expected, 1e-12 * expected) << "iteration " << i;
        EXPECT_NEAR(result.iterations[i].grad_norm, result.check.reference_iterations[i].grad_norm,
                    1e-10 * result.check.reference_iterations[i].grad_norm);
        curve.push_back(result.iterations[i].loss);
      }
      // The model learns: the losses are not all the same.
      EXPECT_NE(curve.front(), curve.back());
      curves.push_back(curve);
    }
    for (const auto& curve : curves) {
      for (size_t i = 0; i < curve.size(); ++i) EXPECT_NEAR(curve[i], curves.front()[i], 1e-12);
    }
  }
}

// The distributed optimizer: state sharded over dp (and over the dp ranks of each instance
// with num_distributed_optimizer_instances 2), gradients reduce-scattered and parameters
// all-gathered. Every iteration's loss and gradient norm equal the plain optimizer's in
// float64, and the check (gradients, parameters and the gathered optimizer state against the
// reference) passes.
TEST(GptMpi, DistributedOptimizerTrainsAsThePlainOne) {
  if (WorldSize() < 2) GTEST_SKIP() << "needs dp >= 2";
  struct Case {
    int64_t pp;
    bool distributed;
    int64_t instances;
  };
  std::vector<Case> cases = {{1, false, 1}, {1, true, 1}};
  if (WorldSize() % 4 == 0) {
    cases.push_back({1, true, 2});
    cases.push_back({2, true, 2});
    cases.push_back({2, false, 1});
  }
  for (const char* optimizer : {"adam", "sgd"}) {
    std::map<int64_t, std::vector<double>> plain;  // by pp: the loss and norm curve
    std::vector<std::pair<int64_t, std::vector<double>>> distributed;
    for (const Case& c : cases) {
      SCOPED_TRACE(fmt::format("{}: pp {} distributed {} instances {}", optimizer, c.pp,
                               c.distributed, c.instances));
      if (WorldRank() == 0) {
        fmt::print("  {} pp {} distributed optimizer {} instances {}:", optimizer, c.pp,
                   c.distributed, c.instances);
      }
      json document = Training(PipelineDocument(c.pp, 0, 1, "float64"), optimizer);
      document["optimizer"]["use_distributed_optimizer"] = c.distributed;
      document["parallel"]["num_distributed_optimizer_instances"] = c.instances;
      const run::SimulationResult result = RunChecked(document);
      EXPECT_EQ(result.optimizer.distributed, c.distributed);
      std::vector<double> curve;
      for (const auto& row : result.iterations) {
        curve.push_back(row.loss);
        curve.push_back(row.grad_norm);
      }
      if (c.distributed) {
        // Each dp rank of an instance keeps 1/D of the flat buffer.
        const int64_t D = WorldSize() / c.pp / c.instances;
        EXPECT_EQ(result.optimizer.buffer % D, 0);
        EXPECT_EQ(result.optimizer.end - result.optimizer.begin, result.optimizer.buffer / D);
        distributed.emplace_back(c.pp, curve);
      } else {
        plain[c.pp] = curve;
      }
    }
    for (const auto& [pp, curve] : distributed) {
      ASSERT_EQ(curve.size(), plain.at(pp).size());
      for (size_t i = 0; i < curve.size(); ++i) {
        EXPECT_NEAR(curve[i], plain.at(pp)[i], 1e-12 * std::fabs(plain.at(pp)[i]))
            << optimizer << " pp " << pp << " value " << i;
      }
    }
  }
  // In 16-bit storage: float32 master weights and states, sharded.
  if (WorldRank() == 0) fmt::print("  bfloat16 adam, distributed optimizer:");
  json document = Training(PipelineDocument(1, 0, 1, "bfloat16"), "adam");
  document["optimizer"]["use_distributed_optimizer"] = true;
  RunChecked(document);
}

// float16 as Megatron runs it: main_grad (the gradient buffer: accumulated over the
// micro-batches and all-reduced over dp) in float16 by default, float32 with
// accumulate_allreduce_grads_in_fp32 (megatron/training/arguments.py forces that only for
// bf16); the step reads float32 copies. Both train and pass the check (the 16-bit sums are in
// the gradients' budgets), on the plain and the distributed optimizer, and each rank's
// gradient bytes are 2 or 4 per trained element.
TEST(GptMpi, Float16TrainsWithMegatronsGradientBuffer) {
  // Two data-parallel ranks where the world has two or more.
  const int64_t t = std::max<int64_t>(1, WorldSize() / 2);
  struct Case {
    const char* dtype;
    const char* key;  // the optimizer key set true, or null
    bool half_grad;   // main_grad in the storage dtype
  };
  for (const Case& c : {Case{"float16", nullptr, true},
                        Case{"float16", "accumulate_allreduce_grads_in_fp32", false},
                        Case{"bfloat16", "grad_reduce_in_bf16", true}}) {
    for (const bool distributed : {false, true}) {
      if (distributed && WorldSize() / t < 2) continue;
      SCOPED_TRACE(fmt::format("{} {} distributed {}", c.dtype, c.key ? c.key : "-", distributed));
      if (WorldRank() == 0) {
        fmt::print("  {} adam, main_grad {}, {} optimizer:", c.dtype,
                   c.half_grad ? c.dtype : "float32", distributed ? "distributed" : "plain");
      }
      json document = Training(Document(Gpt(8, 8), t, t > 1, c.dtype), "adam");
      document["run"]["num_microbatches"] = 2;
      if (c.key != nullptr) document["optimizer"][c.key] = true;
      document["optimizer"]["use_distributed_optimizer"] = distributed;
      const run::SimulationResult result = RunChecked(document);
      ASSERT_FALSE(result.tensor_bytes.empty());
      // Adam: a float32 master weight and two float32 moments per owned element; with the
      // plain optimizer every rank owns every element it holds.
      for (size_t rank = 0; rank < result.tensor_bytes.size() && !distributed; ++rank) {
        const run::SimulationResult::TensorBytes& bytes = result.tensor_bytes[rank];
        EXPECT_EQ(bytes.gradients * (c.half_grad ? 6 : 3), bytes.optimizer) << "rank " << rank;
      }
    }
  }
}

// The precision-aware optimizer (Transformer Engine's FusedAdam as Megatron hands it the
// distributed optimizer's shards: core/train/optimizer.h): bf16 moments; fp16 moments and
// fp16 master weights, stored scaled; a bf16 main_grad read as it is beside one bf16 and one
// fp32 moment; an fp16 run's fp16 main_grad with fp16 moments. Each trains and passes the
// check, whose bounds carry each stored state's rounding (reference/trainer.h), and each
// rank holds 4 (or 2) + 2 + 2 bytes of state per owned element, plus a float32 scale per
// float16 tensor.
TEST(GptMpi, PrecisionAwareOptimizerTrainsAsFusedAdam) {
  const int64_t t = std::max<int64_t>(1, WorldSize() / 2);
  struct Case {
    const char* dtype;
    json keys;
    int64_t state_bytes;  // per owned element: master, exp_avg, exp_avg_sq
  };
  // A bf16 run's float32 master is the parameter and a 2-byte remainder (Megatron's default
  // store_param_remainders), or 4 bytes of its own with the key false.
  const std::vector<Case> cases = {
      {"bfloat16", {{"exp_avg_dtype", "bf16"}, {"exp_avg_sq_dtype", "bf16"}}, 6},
      {"bfloat16",
       {{"exp_avg_dtype", "bf16"}, {"exp_avg_sq_dtype", "bf16"}, {"store_param_remainders", false}},
       8},
      {"bfloat16",
       {{"exp_avg_dtype", "fp16"}, {"exp_avg_sq_dtype", "fp16"}, {"main_params_dtype", "fp16"}},
       6},
      {"bfloat16",
       {{"main_grads_dtype", "bf16"}, {"exp_avg_dtype", "bf16"}, {"exp_avg_sq_dtype", "fp32"}},
       8},
      {"float16", {{"exp_avg_dtype", "fp16"}, {"exp_avg_sq_dtype", "fp16"}}, 8},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{} {}", c.dtype, c.keys.dump()));
    if (WorldRank() == 0) fmt::print("  {} precision-aware adam {}:", c.dtype, c.keys.dump());
    json document = Training(Document(Gpt(8, 8), t, t > 1, c.dtype), "adam");
    document["run"]["num_microbatches"] = 2;
    document["optimizer"]["use_distributed_optimizer"] = true;
    document["optimizer"]["use_precision_aware_optimizer"] = true;
    document["optimizer"].update(c.keys);
    const run::SimulationResult result = RunChecked(document);
    EXPECT_EQ(result.optimizer.state_bytes, c.state_bytes);
    ASSERT_FALSE(result.tensor_bytes.empty());
    const int64_t owned = result.optimizer.elements;
    const int64_t held = result.tensor_bytes[static_cast<size_t>(WorldRank())].optimizer;
    // The scales: at most 4 bytes per parameter and float16 tensor (none for bf16 ones).
    EXPECT_GE(held, owned * c.state_bytes);
    EXPECT_LE(held, owned * c.state_bytes + 3 * 4 * 64);
  }
}

// Lower precision: Adam moves a parameter whose exact gradient is 0 (the key bias) by O(lr)
// on rounding noise, which the check's error bounds carry (reference/trainer.h).
TEST(GptMpi, TrainingInFloat32AndBFloat16) {
  const int64_t t = TensorParallelSizes().back();
  for (const char* dtype : {"float32", "bfloat16"}) {
    for (const char* optimizer : {"adam", "sgd"}) {
      SCOPED_TRACE(fmt::format("{} {}", dtype, optimizer));
      if (WorldRank() == 0) fmt::print("  {} {}:", dtype, optimizer);
      RunChecked(Training(Document(Gpt(8, 8), t, t > 1, dtype), optimizer));
    }
  }
}

TEST(GptMpi, GroupedQueryAttentionLlamaStyle) {
  for (const int64_t t : TensorParallelSizes()) {
    if (t > 4) continue;  // 4 query groups
    SCOPED_TRACE(fmt::format("tp {}", t));
    RunChecked(Document(Llama(8, 4), t, t > 1, "float64"));
  }
}

// add_qkv_bias (Qwen's choice): linear_qkv's bias alone, split with its rows over tp.
TEST(GptMpi, QkvBiasAloneQwenStyle) {
  json qwen = Llama(8, 4);
  qwen["add_qkv_bias"] = true;
  for (const int64_t t : TensorParallelSizes()) {
    if (t > 4) continue;  // 4 query groups
    SCOPED_TRACE(fmt::format("tp {}", t));
    RunChecked(Document(qwen, t, t > 1, "float32"));
  }
}

// qk_layernorm (q_layernorm and k_layernorm over each head, as OLMo 2 and Qwen 3 have them)
// with rope on half of each head's channels (rotary_percent 0.5, 4 of 8 channels), both
// norms, on every tp size with and without sequence parallelism: each tp rank normalises its
// own heads, so the norms' gradients are all-reduced over tp either way.
TEST(GptMpi, QkLayerNormAndPartialRotary) {
  for (const char* norm : {"RMSNorm", "LayerNorm"}) {
    json model = Llama(8, 4);
    model["normalization"] = norm;
    model["qk_layernorm"] = true;
    model["kv_channels"] = 8;  // 4 turned channels: two frequencies
    model["rotary_percent"] = 0.5;
    for (const int64_t t : TensorParallelSizes()) {
      if (t > 4) continue;  // 4 query groups
      for (const bool sp : {false, true}) {
        if (sp && t == 1) continue;
        SCOPED_TRACE(fmt::format("{}, tp {}, sequence parallel {}", norm, t, sp));
        RunChecked(Document(model, t, sp, "float64"));
      }
    }
  }
  // Selective recomputation reruns the norms with core attention; float32 and bfloat16.
  json model = Llama(8, 4);
  model["qk_layernorm"] = true;
  model["kv_channels"] = 8;
  model["rotary_percent"] = 0.5;
  const int64_t t = std::min<int64_t>(TensorParallelSizes().back(), 4);
  for (const char* dtype : {"float32", "bfloat16"}) {
    SCOPED_TRACE(fmt::format("{}, tp {}, selective recomputation", dtype, t));
    RunChecked(Document(model, t, t > 1, dtype, "selective"));
  }
}

// Megatron's squared_relu (relu(x)^2, core/ops/activation.h) on every tp size, with sequence
// parallelism where tp > 1, in float64, and on the widest layout in float32 and bfloat16.
TEST(GptMpi, SquaredReluOnEveryLayout) {
  json model = Gpt(8, 8);
  model["activation"] = "squared_relu";
  for (const int64_t t : TensorParallelSizes()) {
    SCOPED_TRACE(fmt::format("tp {}", t));
    RunChecked(Document(model, t, t > 1, "float64"));
  }
  const int64_t t = TensorParallelSizes().back();
  for (const char* dtype : {"float32", "bfloat16"}) {
    SCOPED_TRACE(dtype);
    RunChecked(Document(model, t, t > 1, dtype));
  }
}

// gpt-oss's MLP: quick_geglu (Megatron's quick_gelu with gated_linear_unit) with
// glu_linear_offset 1 and activation_func_clamp_value 0.1: fc1's outputs have a standard
// deviation of about 0.02 sqrt(32) = 0.11 at initialisation, so about a fifth of the gates and
// two fifths of the linear halves are clamped. Every tp size in float64, the widest in float32
// (bfloat16's rounding moves near-bound elements across the clamp, where the gradient jumps).
TEST(GptMpi, ClampedQuickGegluOnEveryLayout) {
  json model = Gpt(8, 8);
  model["activation"] = "quick_geglu";
  model["glu_linear_offset"] = 1.0;
  model["activation_func_clamp_value"] = 0.1;
  for (const int64_t t : TensorParallelSizes()) {
    SCOPED_TRACE(fmt::format("tp {}", t));
    RunChecked(Document(model, t, t > 1, "float64"));
  }
  const int64_t t = TensorParallelSizes().back();
  RunChecked(Document(model, t, t > 1, "float32"));
}

TEST(GptMpi, Float32AndBFloat16) {
  const int64_t t = TensorParallelSizes().back();
  for (const char* dtype : {"float32", "bfloat16"}) {
    SCOPED_TRACE(dtype);
    RunChecked(Document(Gpt(8, 8), t, t > 1, dtype));
    if (t <= 4) RunChecked(Document(Llama(8, 4), t, t > 1, dtype));
  }
}

// Recomputation reruns the forward with the same masks: every recorded tensor is bit-identical.
// Recomputation per (chunk, micro-batch) inside the backward step, on one stage of 4 layers
// and on a pipeline of 2 stages x 2 virtual stages: every layer alone, uniform groups of 2
// and of 3 (the chunk's last group cut short), block over 1 and over 3 layers per chunk (all
// of a pipeline chunk's), and selective: core attention, the norms, the MLP, all three; on
// mixture-of-experts layers the whole layer, the experts' activation and the shared expert.
TEST(GptMpi, RecomputationIsBitIdentical) {
  const int64_t t = TensorParallelSizes().back();
  json four = Gpt(8, 8);
  four["num_layers"] = 4;
  // Mixture-of-experts layers 0, 2, 3 (a shared expert, the grouped GEMM, the alltoall
  // dispatcher), dense layer 1.
  json moe = Llama(8, 4);
  moe["num_layers"] = 4;
  moe["num_moe_experts"] = 4;
  moe["moe_router_topk"] = 2;
  moe["moe_ffn_hidden_size"] = 16;
  moe["moe_shared_expert_intermediate_size"] = 16;
  moe["moe_grouped_gemm"] = true;
  moe["moe_token_dispatcher_type"] = "alltoall";
  moe["moe_layer_freq"] = json::array({1, 0, 1, 1});
  const std::vector<const char*> dense_options = {"full",
                                                  "full uniform 2",
                                                  "full uniform 3",
                                                  "full block 1",
                                                  "full block 3",
                                                  "selective",
                                                  "selective layernorm",
                                                  "selective mlp",
                                                  "selective core_attn,layernorm,mlp"};
  const std::vector<const char*> moe_options = {"full uniform 2", "selective moe",
                                                "selective moe_act,shared_experts",
                                                "selective moe,layernorm,core_attn,mlp"};
  std::vector<std::pair<json, std::vector<const char*>>> documents = {
      {Document(four, t, t > 1, "float32"), dense_options},
      // Its 4 query groups split over tp 4 at most.
      {Document(moe, std::min<int64_t>(t, 4), t > 1, "float32"), moe_options}};
  if (WorldSize() % 2 == 0) {
    documents.push_back({PipelineDocument(2, 2, 1, "float32"), dense_options});
  }
  for (const auto& [document, options] : documents) {
    SCOPED_TRACE(document["parallel"].dump());
    StatusOr<run::SimulationResult> plain = Simulate(document, false);
    ASSERT_TRUE(plain.ok()) << plain.status().Message();
    for (const char* recompute : options) {
      SCOPED_TRACE(recompute);
      json recomputed = document;
      SetRecompute(recomputed["run"], recompute);
      StatusOr<run::SimulationResult> again = Simulate(recomputed, false);
      ASSERT_TRUE(again.ok()) << again.status().Message();
      ASSERT_EQ(plain->records.size(), again->records.size());
      for (size_t i = 0; i < plain->records.size(); ++i) {
        const TensorRecord& a = plain->records[i];
        const TensorRecord& b = again->records[i];
        ASSERT_EQ(a.name, b.name);
        ASSERT_EQ(a.tensor.bytes(), b.tensor.bytes()) << a.name;
        EXPECT_EQ(std::memcmp(a.tensor.data(), b.tensor.data(), a.tensor.bytes()), 0) << a.name;
      }
    }
  }
}

// Runs one step of `document` on this rank with the model split into `chunks` (nullopt: the
// planner's one chunk) and returns the records on the host; `peak` gets the step's highest
// number of live stashes.
std::vector<TensorRecord> RunChunked(const json& document,
                                     std::optional<std::vector<GptChunk>> chunks, int64_t* peak) {
  const Config config = MakeConfig(document);
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  EXPECT_TRUE(topology.ok());
  if (!topology.ok()) return {};
  const int rank = WorldRank();
  StatusOr<std::unique_ptr<GptModel>> model =
      GptModel::Build(config, *topology, topology->Coordinates(rank), std::move(chunks));
  EXPECT_TRUE(model.ok()) << model.status().Message();
  if (!model.ok()) return {};
  CpuBackend backend;
  CommTrace trace;
  RankContext ctx = run::MakeRankContext(config, backend, *topology, rank, &trace);
  (*model)->InitializeParameters(*ctx.kernels);
  const PipelineExecutor executor = StepModel(**model, config, ctx, true);
  std::vector<TensorRecord> records;
  (*model)->Records(ctx, &records);
  EXPECT_EQ(executor.live_stashes(), 0);
  *peak = executor.peak_live_stashes();
  for (TensorRecord& r : records) {
    if (r.tensor.device() != Device::kHost) r.tensor = ctx.kernels->ToHost(r.tensor);
  }
  return records;
}

// The executor's model chunks (what pipeline stages and virtual stages hold): a one-rank
// model cut into chunks, run chunk after chunk with the stream handed between them, gives
// bit-identical tensors, gradients and loss to the model in one chunk.
TEST(GptMpi, ModelChunksOnOneRankAreBitIdenticalToOneChunk) {
  const int64_t t = TensorParallelSizes().back();
  json model = Gpt(8, 8);
  model["num_layers"] = 4;
  const json document = Document(model, t, t > 1, "float32");
  int64_t peak = 0;
  const std::vector<TensorRecord> whole = RunChunked(document, std::nullopt, &peak);
  ASSERT_FALSE(whole.empty());
  EXPECT_EQ(peak, 1);
  const std::vector<std::vector<GptChunk>> splits = {
      {{{0}, true, false}, {{1, 2}, false, false}, {{3}, false, true}},
      {{{}, true, false}, {{0, 1, 2, 3}, false, false}, {{}, false, true}},
  };
  for (size_t k = 0; k < splits.size(); ++k) {
    SCOPED_TRACE(fmt::format("split {}", k));
    const std::vector<TensorRecord> chunked = RunChunked(document, splits[k], &peak);
    EXPECT_EQ(peak, 3);  // a micro-batch's three chunks between its forward and backward
    ASSERT_EQ(whole.size(), chunked.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      const TensorRecord& a = whole[i];
      const TensorRecord& b = chunked[i];
      ASSERT_EQ(a.name, b.name);
      EXPECT_EQ(a.shard, b.shard) << a.name;
      ASSERT_EQ(a.tensor.bytes(), b.tensor.bytes()) << a.name;
      EXPECT_EQ(std::memcmp(a.tensor.data(), b.tensor.data(), a.tensor.bytes()), 0) << a.name;
    }
  }
}

TEST(GptMpi, ChunkListsAreChecked) {
  json model = Gpt(4, 4);
  model["num_layers"] = 3;
  const Config config = MakeConfig(Document(model, 1, false, "float64"));
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  ASSERT_TRUE(topology.ok());
  const RankCoordinates coords = topology->Coordinates(WorldRank());
  auto refusal = [&](std::vector<GptChunk> chunks) {
    StatusOr<std::unique_ptr<GptModel>> built =
        GptModel::Build(config, *topology, coords, std::move(chunks));
    return built.ok() ? std::string("accepted") : built.status().Message();
  };
  EXPECT_EQ(refusal({{{0, 1, 2}, true, true}}), "accepted");
  EXPECT_EQ(refusal({{{0, 2}, true, true}}),
            "chunks[0]: layer 2 breaks the consecutive order of the model's 3 layers");
  EXPECT_EQ(refusal({{{0}, true, false}, {{2, 1}, false, true}}),
            "chunks[1]: layer 2 breaks the consecutive order of the model's 3 layers");
  EXPECT_EQ(refusal({{{0, 1}, true, true}}),
            "chunks: with pipeline_model_parallel_size 1 the rank's chunks hold the whole model");
  EXPECT_EQ(refusal({{{0}, true, false}, {{1, 2}, true, true}}),
            "chunks[1]: only the first chunk may hold the embedding and only the last the "
            "output layer");
  EXPECT_EQ(refusal({}), "chunks: a rank holds at least one model chunk");
}

// Megatron's tracker streams: every layout still matches the reference (which draws each
// element as the rank holding it does), but the masks, and so the loss, change with tp.
TEST(GptMpi, RngTrackerDropoutMatchesTheReferenceAndDependsOnTheLayout) {
  std::map<int64_t, double> losses;
  for (const int64_t t : TensorParallelSizes()) {
    for (const bool sp : {false, true}) {
      if (sp && t == 1) continue;
      SCOPED_TRACE(fmt::format("tp {}, sequence_parallel {}", t, sp));
      json model = Gpt(8, 8);
      model["dropout_mode"] = "rng_tracker";
      const double loss = RunChecked(Document(model, t, sp, "float64", "full")).loss;
      if (!sp) losses[t] = loss;
    }
  }
  if (losses.size() > 1) {
    EXPECT_NE(losses.begin()->second, losses.rbegin()->second)
        << "tp " << losses.begin()->first << " and tp " << losses.rbegin()->first
        << " drew the same masks";
  }
}

// The tracker in pipelines and training: each pipeline rank draws from its own streams in
// the order it runs its forwards (the interleaved schedule's table with virtual stages),
// and every iteration continues the streams. Every iteration's loss and the final tensors
// match the reference, which numbers the draws from the schedule alone; the pipeline's keys
// differ per stage, so its masks and loss differ from pp = 1.
TEST(GptMpi, RngTrackerDropoutInPipelinesAndTraining) {
  std::vector<PipelineLayout> layouts = {{1, 0, 1}};
  if (WorldSize() % 2 == 0) layouts.push_back({2, 0, 1});
  if (WorldSize() % 2 == 0) layouts.push_back({2, 2, 1});
  if (WorldSize() % 4 == 0) layouts.push_back({2, 2, 2});
  std::vector<double> first_losses;
  for (const PipelineLayout& l : layouts) {
    SCOPED_TRACE(fmt::format("pp {} vp {} tp {}", l.pp, l.vp, l.tp));
    if (WorldRank() == 0) fmt::print("  pp {} vp {} tp {}:", l.pp, l.vp, l.tp);
    json document = Training(PipelineDocument(l.pp, l.vp, l.tp, "float64"), "adam");
    document["model"]["dropout_mode"] = "rng_tracker";
    document["model"]["attention_dropout"] = 0.2;
    const run::SimulationResult result = RunChecked(document);
    ASSERT_EQ(result.iterations.size(), 4u);
    ASSERT_EQ(result.check.reference_iterations.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      const double expected = result.check.reference_iterations[i].loss;
      EXPECT_NEAR(result.iterations[i].loss, expected, 1e-12 * expected) << "iteration " << i;
    }
    first_losses.push_back(result.iterations[0].loss);
  }
  if (first_losses.size() > 1) {
    EXPECT_NE(first_losses[0], first_losses[1]) << "pp 1 and pp 2 drew the same masks";
  }
}

TEST(GptMpi, LayoutRefusalsNameTheField) {
  if (WorldSize() < 4) GTEST_SKIP() << "needs tp 4";
  StatusOr<run::SimulationResult> result = Simulate(Document(Llama(8, 2), 4, false, "float32"));
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().Message(),
            "model.num_query_groups: 2 is not divisible by tensor_model_parallel_size 4");
}

}  // namespace
}  // namespace mpusim
