// The layer graph on K MPI ranks (ctest runs this binary with K = 1, 2, 4, 8) against the
// float64 reference: every op and flag, float64, float32 and 16-bit mixed precision, tp and
// dp layouts, sequence parallelism, dropout, recomputation, gradient accumulation (fused or
// not); plus the region mappings and
// utilities on integer data (exact), and the collectives the paper counts.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "core/backend.h"
#include "core/dump/compare.h"
#include "core/config/config.h"
#include "core/model/graph.h"
#include "core/schedule.h"
#include "core/tensor_parallel/mappings.h"
#include "core/tensor_parallel/tp_utils.h"
#include "core/topology.h"
#include "mpi/mpi_communicator.h"
#include "run/runner.h"
#include "sim/cpu_backend.h"
#include "sim/eigen_kernels.h"
#include "tests/mpi/world.h"

namespace mpusim {
namespace {

using nlohmann::json;

int WorldSize() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// Runs `config` on the CPU backend.
StatusOr<run::SimulationResult> Simulate(const Config& config, bool check) {
  CpuBackend backend;
  return run::Simulate(config, {check, 1, /*keep_records=*/true}, backend);
}

Config MakeConfig(const json& document) {
  Config config;
  const Status status = ParseConfig(document, &config);
  EXPECT_TRUE(status.ok()) << status.Message() << "\n" << document.dump();
  return config;
}

// Runs `document` and expects every tensor to match the reference; returns the result.
run::SimulationResult RunChecked(const json& document) {
  StatusOr<run::SimulationResult> result = Simulate(MakeConfig(document), true);
  EXPECT_TRUE(result.ok()) << result.status().Message();
  if (!result.ok()) return {};
  EXPECT_FALSE(result->check.tensors.empty());
  for (const run::TensorCheck& c : result->check.tensors) {
    EXPECT_TRUE(c.ok()) << c.name << ": " << c.mismatches << " of " << c.count
                        << " elements off, max abs " << c.max_abs << ", max rel " << c.max_rel
                        << (c.missing ? " (missing in reference)" : "") << "\n"
                        << document.dump();
  }
  if (result->has_loss) {
    // The loss is a mean of O(1) terms: its error is that of the storage dtype's rounding.
    const DType storage = MakeConfig(document).run->dtype;
    const double relative = IsHalf(storage) ? DefaultTolerance(storage).rtol : 1e-5;
    EXPECT_NEAR(result->loss, result->check.reference_loss,
                relative * std::fabs(result->check.reference_loss) + 1e-9);
  }
  return std::move(result).value();
}

json Parallel(int64_t tp, bool sequence_parallel = false) {
  return {{"world_size", WorldSize()},
          {"tensor_model_parallel_size", tp},
          {"sequence_parallel", sequence_parallel}};
}

json LanguageModel(double label_smoothing, int64_t vocab = 96, int64_t divisible = 8) {
  return {{"vocab_size", vocab},
          {"make_vocab_size_divisible_by", divisible},
          {"layers",
           {{{"name", "embedding"}, {"type", "VocabParallelEmbedding"}, {"embedding_dim", 16}},
            {{"name", "fc1"},
             {"type", "ColumnParallelLinear"},
             {"input_size", 16},
             {"output_size", 64},
             {"gather_output", false}},
            {{"name", "gelu"}, {"type", "GeLU"}},
            {{"name", "fc2"},
             {"type", "RowParallelLinear"},
             {"input_size", 64},
             {"output_size", 16},
             {"input_is_parallel", true}},
            {{"name", "head"},
             {"type", "ColumnParallelLinear"},
             {"input_size", 16},
             {"output_size", "padded_vocab_size"},
             {"gather_output", false},
             {"bias", false}},
            {{"name", "loss"},
             {"type", "VocabParallelCrossEntropy"},
             {"label_smoothing", label_smoothing}}}}};
}

json RunSection(const char* dtype, int64_t seq = 8, int64_t micro_batch = 2, int64_t microbatches = 1) {
  return {{"seed", 4321},
          {"dtype", dtype},
          {"seq_length", seq},
          {"micro_batch_size", micro_batch},
          {"num_microbatches", microbatches}};
}

// The MLP block: ColumnParallelLinear(h -> f) -> GeLU -> RowParallelLinear(f -> h).
json MlpBlock(int64_t hidden, int64_t ffn) {
  return {{"layers",
           {{{"name", "fc1"},
             {"type", "ColumnParallelLinear"},
             {"input_size", hidden},
             {"output_size", ffn},
             {"gather_output", false}},
            {{"name", "gelu"}, {"type", "GeLU"}},
            {{"name", "fc2"},
             {"type", "RowParallelLinear"},
             {"input_size", ffn},
             {"output_size", hidden},
             {"input_is_parallel", true}}}}};
}

// Every tp size that divides the world (the rest is data parallel), up to the 8 positions
// sequence parallelism splits.
std::vector<int64_t> TensorParallelSizes() {
  std::vector<int64_t> sizes;
  for (int64_t t = 1; t <= WorldSize() && t <= 8; t *= 2) {
    if (WorldSize() % t == 0) sizes.push_back(t);
  }
  return sizes;
}

TEST(GraphVsReference, LanguageModelEveryLayoutBothDtypes) {
  for (int64_t t : TensorParallelSizes()) {
    for (const char* dtype : {"float64", "float32"}) {
      SCOPED_TRACE(fmt::format("tp {} {}", t, dtype));
      RunChecked({{"parallel", Parallel(t)},
                  {"model", LanguageModel(0.1)},
                  {"run", RunSection(dtype, 8, 2, 2)}});
    }
  }
}

// bfloat16 and float16 storage with float32 arithmetic, on every layout, with and without
// sequence parallelism and the fused weight-gradient accumulation; main_grad as Megatron
// keeps it: float32 for bf16, float16 for fp16 (accumulate_allreduce_grads_in_fp32 off). bf16 is asked
// for the Megatron way (parallel.bf16), fp16 through run.dtype.
TEST(GraphVsReference, MixedPrecisionEveryLayout) {
  for (int64_t t : TensorParallelSizes()) {
    for (const char* dtype : {"bfloat16", "float16"}) {
      for (const bool sp : {false, true}) {
        SCOPED_TRACE(fmt::format("tp {} {} sequence_parallel {}", t, dtype, sp));
        json parallel = Parallel(t, sp);
        json run = RunSection("float32", 8, 2, 2);
        if (std::string(dtype) == "bfloat16") {
          parallel["bf16"] = true;
          run.erase("dtype");
        } else {
          run["dtype"] = dtype;
        }
        parallel["gradient_accumulation_fusion"] = sp;
        json model = LanguageModel(0.1);
        model["layers"].insert(model["layers"].begin() + 3,
                               json{{"name", "dropout"}, {"type", "Dropout"}, {"p", 0.25}});
        const run::SimulationResult r =
            RunChecked({{"parallel", parallel}, {"model", model}, {"run", run}});
        // Parameters and activations really are 16-bit; main_grad is float32 for bf16 and
        // float16 for fp16, the loss float32.
        const DType storage = *DTypeFromName(dtype);
        for (const TensorRecord& record : r.records) {
          if (record.name == "fc1.weight" || record.name == "gelu.output") {
            EXPECT_EQ(record.tensor.dtype(), storage) << record.name;
          }
          if (record.name == "fc1.weight_grad") {
            EXPECT_EQ(record.tensor.dtype(),
                      storage == DType::kFloat16 ? DType::kFloat16 : DType::kFloat32)
                << record.name;
          }
          if (record.name == "loss.output") {
            EXPECT_EQ(record.tensor.dtype(), DType::kFloat32) << record.name;
          }
        }
      }
    }
  }
}

// The 16-bit errors are there, of the size the storage dtype implies: larger than float32's
// by orders of magnitude, and bfloat16's larger than float16's.
TEST(GraphVsReference, MixedPrecisionErrorsHaveTheStorageSize) {
  auto worst = [](const char* dtype) {
    json run = RunSection(dtype, 8, 2, 1);
    const run::SimulationResult r = RunChecked(
        {{"parallel", Parallel(WorldSize())}, {"model", LanguageModel(0.0)}, {"run", run}});
    // The largest error relative to the tensor's scale, over every checked tensor.
    double normalized = 0;
    for (const run::TensorCheck& c : r.check.tensors) normalized = std::max(normalized, c.normalized);
    return normalized;
  };
  const double f32 = worst("float32"), f16 = worst("float16"), bf16 = worst("bfloat16");
  EXPECT_LT(f32, 1e-5);
  EXPECT_GT(f16, 0x1p-12);  // at least half a float16 unit roundoff (2^-11) somewhere
  EXPECT_GT(bf16, 0x1p-9);  // at least half a bfloat16 unit roundoff (2^-8)
  EXPECT_GT(bf16, 4 * f16);  // 8x fewer significand bits
}

TEST(GraphVsReference, SequenceParallel) {
  for (int64_t t : TensorParallelSizes()) {
    SCOPED_TRACE(fmt::format("tp {}", t));
    json model = LanguageModel(0.0);
    // skip_bias_add on fc1 with the bias added in the GeLU (bias_gelu).
    model["layers"][1]["skip_bias_add"] = true;
    model["layers"][2]["bias_from"] = "fc1";
    RunChecked({{"parallel", Parallel(t, true)}, {"model", model}, {"run", RunSection("float64", 16)}});
  }
}

// The loss does not depend on the layout, with label smoothing too (upstream Megatron's
// smoothing uses the local vocabulary size, so its loss changes with tp).
TEST(GraphVsReference, LossIsLayoutInvariantWithLabelSmoothing) {
  std::vector<double> losses;
  for (int64_t t : TensorParallelSizes()) {
    const int64_t d = WorldSize() / t;
    // The same global batch for every layout: micro_batch_size * d = world size.
    const run::SimulationResult result =
        RunChecked({{"parallel", Parallel(t)},
                    {"model", LanguageModel(0.2, 64, 8)},
                    {"run", RunSection("float64", 4, WorldSize() / d)}});
    losses.push_back(result.loss);
  }
  for (double loss : losses) EXPECT_NEAR(loss, losses.front(), 1e-12);
}

TEST(GraphVsReference, PaddedVocabulary) {
  for (int64_t t : TensorParallelSizes()) {
    SCOPED_TRACE(fmt::format("tp {}", t));
    // 90 tokens padded to a multiple of 4 * t; padded rows get gradients only from the head.
    const run::SimulationResult r = RunChecked(
        {{"parallel", Parallel(t)}, {"model", LanguageModel(0.1, 90, 4)}, {"run", RunSection("float64")}});
    const int64_t multiple = 4 * t;
    EXPECT_EQ(r.padded_vocab_size, (90 + multiple - 1) / multiple * multiple);
  }
}

TEST(GraphVsReference, LinearLayerFlags) {
  for (int64_t t : TensorParallelSizes()) {
    SCOPED_TRACE(fmt::format("tp {}", t));
    // gather_output, input_is_parallel false (scatter), frozen weight, no bias.
    RunChecked({{"parallel", Parallel(t)},
                {"model",
                 {{"layers",
                   {{{"name", "fc1"},
                     {"type", "ColumnParallelLinear"},
                     {"input_size", 16},
                     {"output_size", 32},
                     {"gather_output", true}},
                    {{"name", "fc2"},
                     {"type", "RowParallelLinear"},
                     {"input_size", 32},
                     {"output_size", 8},
                     {"input_is_parallel", false},
                     {"frozen", true}},
                    {{"name", "fc3"},
                     {"type", "ColumnParallelLinear"},
                     {"input_size", 8},
                     {"output_size", 16},
                     {"bias", false}}}}}},
                {"run", RunSection("float64")}});
    // stride 2 on both layers (a fused projection's layout).
    RunChecked({{"parallel", Parallel(t)},
                {"model",
                 {{"layers",
                   {{{"name", "fc1"},
                     {"type", "ColumnParallelLinear"},
                     {"input_size", 16},
                     {"output_size", 64},
                     {"gather_output", false},
                     {"stride", 2}},
                    {{"name", "dropout"}, {"type", "Dropout"}, {"p", 0.25}},
                    {{"name", "fc2"},
                     {"type", "RowParallelLinear"},
                     {"input_size", 64},
                     {"output_size", 16},
                     {"input_is_parallel", true},
                     {"stride", 2}}}}}},
                {"run", RunSection("float64")}});
  }
}

TEST(GraphVsReference, EmbeddingsTiedHeadDropoutAndAccumulation) {
  for (int64_t t : TensorParallelSizes()) {
    SCOPED_TRACE(fmt::format("tp {}", t));
    json model = LanguageModel(0.1);
    model["layers"][4]["skip_weight_param_allocation"] = true;
    model["layers"][4]["weight_from"] = "embedding";
    model["layers"].insert(model["layers"].begin() + 3,
                           json{{"name", "dropout"}, {"type", "Dropout"}, {"p", 0.3}});
    json parallel = Parallel(t);
    parallel["gradient_accumulation_fusion"] = true;
    RunChecked({{"parallel", parallel}, {"model", model}, {"run", RunSection("float32", 8, 2, 3)}});
    // ParallelEmbedding: embedding_dim split, then gathered.
    RunChecked({{"parallel", Parallel(t)},
                {"model",
                 {{"vocab_size", 50},
                  {"make_vocab_size_divisible_by", 1},
                  {"layers",
                   {{{"name", "embedding"},
                     {"type", "ParallelEmbedding"},
                     {"num_embeddings", 50},
                     {"embedding_dim", 16}},
                    {{"name", "fc"},
                     {"type", "ColumnParallelLinear"},
                     {"input_size", 16},
                     {"output_size", 16},
                     {"gather_output", false}}}}}},
                {"run", RunSection("float64")}});
  }
}

// Activation recomputation gives bit-identical gradients (dropout masks included).
TEST(GraphVsReference, RecomputeIsBitIdentical) {
  json model = LanguageModel(0.1);
  model["layers"].insert(model["layers"].begin() + 3,
                         json{{"name", "dropout"}, {"type", "Dropout"}, {"p", 0.5}});
  json run = RunSection("float32", 8, 2, 2);
  const run::SimulationResult plain = RunChecked(
      {{"parallel", Parallel(WorldSize())}, {"model", model}, {"run", run}});
  // The whole chunk as one group (the chain's layers), groups of 2 and 3 (the last one cut),
  // block over the first 1 and 4 layers.
  const std::vector<std::pair<const char*, int64_t>> options = {
      {"uniform", static_cast<int64_t>(model["layers"].size())},
      {"uniform", 2},
      {"uniform", 3},
      {"block", 1},
      {"block", 4}};
  int compared = 0;
  for (const auto& [method, n] : options) {
    SCOPED_TRACE(fmt::format("{} {}", method, n));
    run["recompute_granularity"] = "full";
    run["recompute_method"] = method;
    run["recompute_num_layers"] = n;
    const run::SimulationResult recomputed =
        RunChecked({{"parallel", Parallel(WorldSize())}, {"model", model}, {"run", run}});
    ASSERT_EQ(plain.records.size(), recomputed.records.size());
    for (size_t i = 0; i < plain.records.size(); ++i) {
      const TensorRecord& a = plain.records[i];
      const TensorRecord& b = recomputed.records[i];
      ASSERT_EQ(a.name, b.name);
      if (a.name.find("_grad") == std::string::npos) continue;
      ASSERT_EQ(a.tensor.bytes(), b.tensor.bytes()) << a.name;
      EXPECT_EQ(std::memcmp(a.tensor.data(), b.tensor.data(), a.tensor.bytes()), 0) << a.name;
      ++compared;
    }
  }
  EXPECT_GT(compared, 5 * 5);
}

// The Megatron paper's count: per MLP block one all-reduce forward and one backward; with
// sequence parallelism all-gathers and reduce-scatters instead, plus the backward all-gather
// of fc1's saved input shard for its weight gradient (Megatron-Core keeps the shard, as the
// GPT's column-parallel layers do: the chain's layers are the same modules).
TEST(GraphVsReference, CollectivesPerMlpBlock) {
  if (WorldSize() == 1) GTEST_SKIP() << "no collectives on one rank";
  const json mlp = MlpBlock(16, 64);
  auto count = [](const CommTrace& trace, Phase phase, CommOpKind op) {
    int n = 0;
    for (const CommRecord& r : trace.records()) n += r.phase == phase && r.op == op ? 1 : 0;
    return n;
  };
  const run::SimulationResult plain =
      RunChecked({{"parallel", Parallel(WorldSize())}, {"model", mlp}, {"run", RunSection("float64")}});
  EXPECT_EQ(plain.trace.records().size(), 2u);
  EXPECT_EQ(count(plain.trace, Phase::kForward, CommOpKind::kAllReduce), 1);
  EXPECT_EQ(count(plain.trace, Phase::kBackward, CommOpKind::kAllReduce), 1);
  const run::SimulationResult sp = RunChecked(
      {{"parallel", Parallel(WorldSize(), true)}, {"model", mlp}, {"run", RunSection("float64", 8)}});
  EXPECT_EQ(count(sp.trace, Phase::kForward, CommOpKind::kAllGather), 1);
  EXPECT_EQ(count(sp.trace, Phase::kForward, CommOpKind::kReduceScatter), 1);
  EXPECT_EQ(count(sp.trace, Phase::kBackward, CommOpKind::kAllGather), 2);
  EXPECT_EQ(count(sp.trace, Phase::kBackward, CommOpKind::kReduceScatter), 1);
  EXPECT_EQ(count(sp.trace, Phase::kForward, CommOpKind::kAllReduce), 0);
  // The sequence-parallel bias of fc2 is then all-reduced over tp once (phase "other").
  EXPECT_EQ(count(sp.trace, Phase::kOther, CommOpKind::kAllReduce), 1);
}

// The check can fail: a tp group that silently drops one all-reduce (the backward one of
// copy_to_tensor_model_parallel_region, the second all-reduce of an MLP block) is caught on an
// MLP whose weight gradients sum 512 tokens, in float32 and in bfloat16, while the same run
// with every all-reduce passes (the tolerance grows with the reduction length but stays far
// below a missing contribution).
class DroppingAllReduce final : public Communicator {
 public:
  DroppingAllReduce(std::unique_ptr<Communicator> inner, int drop)
      : inner_(std::move(inner)), drop_(drop) {}
  int Rank() const override { return inner_->Rank(); }
  int Size() const override { return inner_->Size(); }
  void AllReduce(Tensor& buffer, ReduceOp op) override {
    if (++calls_ != drop_) inner_->AllReduce(buffer, op);
  }
  void AllGather(const Tensor& in, Tensor& out) override { inner_->AllGather(in, out); }
  void ReduceScatter(const Tensor& in, Tensor& out) override { inner_->ReduceScatter(in, out); }
  void AllToAll(const Tensor& in, Tensor& out) override { inner_->AllToAll(in, out); }
  void AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                 const std::vector<int64_t>& recv_counts) override {
    inner_->AllToAllV(in, send_counts, out, recv_counts);
  }
  void Broadcast(Tensor& buffer, int root) override { inner_->Broadcast(buffer, root); }
  std::unique_ptr<PendingP2P> PostSendRecv(const std::vector<P2POp>& ops) override {
    return inner_->PostSendRecv(ops);
  }
  bool LeavesSendsInFlight() const override { return inner_->LeavesSendsInFlight(); }

 private:
  std::unique_ptr<Communicator> inner_;
  int drop_;
  int calls_ = 0;
};

class DroppingBackend final : public Backend {
 public:
  explicit DroppingBackend(int drop) : drop_(drop) {}
  std::string name() const override { return "cpu"; }
  Kernels& kernels() override { return cpu_.kernels(); }
  std::map<std::string, std::unique_ptr<Communicator>> MakeGroups(
      const Topology& topology, int64_t world_rank, const std::vector<std::string>& kinds) override {
    auto groups = cpu_.MakeGroups(topology, world_rank, kinds);
    groups["tp"] = std::make_unique<DroppingAllReduce>(std::move(groups["tp"]), drop_);
    return groups;
  }

 private:
  CpuBackend cpu_;
  int drop_;
};

TEST(GraphVsReference, ASkippedAllReduceFailsTheCheck) {
  if (WorldSize() == 1) GTEST_SKIP() << "no all-reduce on one rank";
  const json mlp = MlpBlock(128, 512);
  for (const char* dtype : {"float32", "bfloat16"}) {
    SCOPED_TRACE(dtype);
    const Config config = MakeConfig(
        {{"parallel", Parallel(WorldSize())}, {"model", mlp}, {"run", RunSection(dtype, 256, 2)}});
    for (const int drop : {0, 2}) {
      DroppingBackend backend(drop);
      StatusOr<run::SimulationResult> r = run::Simulate(config, {true, 1, false}, backend);
      ASSERT_TRUE(r.ok()) << r.status().Message();
      std::vector<std::string> failed;
      for (const run::TensorCheck& c : r->check.tensors) {
        if (!c.ok()) failed.push_back(c.name);
      }
      if (drop == 0) {
        EXPECT_EQ(failed, std::vector<std::string>());
      } else {
        // fc1's input gradient misses the other ranks' contributions; nothing upstream of it
        // depends on it, so it is the one tensor that fails.
        EXPECT_EQ(failed, std::vector<std::string>({"fc1.input_grad"}));
      }
    }
  }
}

// A chain whose synthetic input is a partial sum (every rank holds input / t): the input is
// recorded as a partial sum, its gradient as the full tensor every rank holds (d(sum)/d(part)
// is the identity), and every tensor matches the reference at every tp size, with
// reduce_from_tensor_model_parallel_region and, under sequence parallelism,
// reduce_scatter_to_sequence_parallel_region first.
TEST(GraphVsReference, ChainsStartingFromAPartialSum) {
  for (int64_t t : TensorParallelSizes()) {
    for (const bool sp : {false, true}) {
      SCOPED_TRACE(fmt::format("tp {} sequence_parallel {}", t, sp));
      json model = MlpBlock(16, 32);
      model["layers"].insert(
          model["layers"].begin(),
          json{{"name", "reduce"},
               {"type", sp ? "reduce_scatter_to_sequence_parallel_region"
                           : "reduce_from_tensor_model_parallel_region"}});
      const run::SimulationResult r = RunChecked(
          {{"parallel", Parallel(t, sp)}, {"model", model}, {"run", RunSection("float32", 8)}});
      std::map<std::string, bool> partial;
      for (const TensorRecord& record : r.records) partial[record.name] = record.partial_sum;
      ASSERT_EQ(partial.count("reduce.input"), 1u);
      ASSERT_EQ(partial.count("reduce.input_grad"), 1u);
      EXPECT_TRUE(partial["reduce.input"]);
      EXPECT_FALSE(partial["reduce.input_grad"]);
      EXPECT_EQ(r.check.tensors.size(), 24u);
    }
  }
}

// The plan-time warnings of a chain (Graph::warnings).
std::vector<std::string> PlanWarnings(const json& document) {
  const Config config = MakeConfig(document);
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  EXPECT_TRUE(topology.ok()) << topology.status().Message();
  if (!topology.ok()) return {"no topology"};
  StatusOr<std::unique_ptr<Graph>> graph = Graph::Build(config, *topology);
  EXPECT_TRUE(graph.ok()) << graph.status().Message();
  if (!graph.ok()) return {"no graph"};
  return (*graph)->Warnings();
}

// The names of the tensors that fail the check, sorted.
std::vector<std::string> FailedTensors(const json& document) {
  StatusOr<run::SimulationResult> r = Simulate(MakeConfig(document), true);
  EXPECT_TRUE(r.ok()) << r.status().Message();
  if (!r.ok()) return {"no result"};
  EXPECT_FALSE(r->check.tensors.empty());
  std::vector<std::string> failed;
  for (const run::TensorCheck& c : r->check.tensors) {
    if (!c.ok()) failed.push_back(c.name);
  }
  std::sort(failed.begin(), failed.end());
  return failed;
}

// Megatron's own t-fold gradients: an explicit copy_to_tensor_model_parallel_region whose
// gradient is already complete, and gather_from_sequence_parallel_region with
// tensor_parallel_output_grad before duplicated computation. The executor computes what
// Megatron computes, the plan warns with the reason (at t > 1 only), and the check fails on
// exactly the gradients upstream of the mapping, while everything else passes.
TEST(GraphVsReference, TFoldGradientsAreWarnedAndFailTheCheck) {
  const auto expected_warning = [](int index, const std::string& type, const std::string& name,
                                   const std::string& sum, int64_t t, const std::string& reached,
                                   const std::string& before) {
    return fmt::format(
        "model.layers[{}] ({} {}): {} sums t = {} copies of a gradient every rank already holds "
        "in full (the layers after it leave the full gradient on every rank), so the gradient "
        "reaching {} is {}x the full-model gradient; Megatron's code computes the same; the "
        "check against the reference will fail for {}.input_grad and the gradients of every "
        "layer before it ({})",
        index, type, name, sum, t, reached, t, name, before);
  };
  for (int64_t t : TensorParallelSizes()) {
    SCOPED_TRACE(fmt::format("tp {}", t));
    // (a) fc0 -> copy_to -> MLP: fc1 all-reduces its own input gradient, so the copy_to's
    // all-reduce sums t full gradients.
    json copy = MlpBlock(16, 32);
    copy["layers"].insert(copy["layers"].begin(),
                          {json{{"name", "fc0"},
                                {"type", "RowParallelLinear"},
                                {"input_size", 16},
                                {"output_size", 16},
                                {"input_is_parallel", true}},
                           json{{"name", "copy"}, {"type", "copy_to_tensor_model_parallel_region"}}});
    const json copy_doc = {{"parallel", Parallel(t)}, {"model", copy}, {"run", RunSection("float32")}};
    // (b) scatter_to_sequence_parallel -> gather_from_sequence_parallel -> GeLU -> MLP: the
    // gathered activation is used replicated, so the reduce-scatter sums t full gradients.
    json gather = MlpBlock(16, 32);
    gather["layers"].insert(gather["layers"].begin(),
                            {json{{"name", "scatter"}, {"type", "scatter_to_sequence_parallel_region"}},
                             json{{"name", "gather"},
                                  {"type", "gather_from_sequence_parallel_region"},
                                  {"tensor_parallel_output_grad", true}},
                             json{{"name", "gelu0"}, {"type", "GeLU"}}});
    const json gather_doc = {{"parallel", Parallel(t)}, {"model", gather}, {"run", RunSection("float32")}};
    if (t == 1) {
      EXPECT_EQ(PlanWarnings(copy_doc), std::vector<std::string>());
      EXPECT_EQ(PlanWarnings(gather_doc), std::vector<std::string>());
      RunChecked(copy_doc);
      RunChecked(gather_doc);
      continue;
    }
    EXPECT_EQ(PlanWarnings(copy_doc),
              std::vector<std::string>({expected_warning(1, "copy_to_tensor_model_parallel_region",
                                                         "copy", "its backward all-reduce", t,
                                                         "fc0", "fc0")}));
    EXPECT_EQ(FailedTensors(copy_doc),
              std::vector<std::string>({"copy.input_grad", "fc0.bias_grad", "fc0.input_grad",
                                        "fc0.output_grad", "fc0.weight_grad"}));
    EXPECT_EQ(PlanWarnings(gather_doc),
              std::vector<std::string>({expected_warning(
                  1, "gather_from_sequence_parallel_region", "gather",
                  "its backward reduce-scatter (tensor_parallel_output_grad true)", t, "scatter",
                  "scatter")}));
    EXPECT_EQ(FailedTensors(gather_doc),
              std::vector<std::string>({"gather.input_grad", "scatter.input_grad",
                                        "scatter.output_grad"}));
    // Split instead of reduce-scatter (tensor_parallel_output_grad false): no warning, and
    // every tensor passes.
    json split_doc = gather_doc;
    split_doc["model"]["layers"][1]["tensor_parallel_output_grad"] = false;
    EXPECT_EQ(PlanWarnings(split_doc), std::vector<std::string>());
    RunChecked(split_doc);
    // Two copy_to in a row: t copies of t-fold gradients, t^2 before the first.
    json twice = copy_doc;
    twice["model"]["layers"].insert(twice["model"]["layers"].begin() + 2,
                                    json{{"name", "copy2"},
                                         {"type", "copy_to_tensor_model_parallel_region"}});
    const std::vector<std::string> warnings = PlanWarnings(twice);
    ASSERT_EQ(warnings.size(), 2u);
    EXPECT_NE(warnings[0].find(fmt::format("model.layers[1] (copy_to_tensor_model_parallel_region "
                                           "copy): its backward all-reduce sums t = {} copies",
                                           t)),
              std::string::npos)
        << warnings[0];
    EXPECT_NE(warnings[0].find(fmt::format("reaching fc0 is {}x", t * t)), std::string::npos)
        << warnings[0];
    EXPECT_NE(warnings[1].find(fmt::format("model.layers[2] (copy_to_tensor_model_parallel_region "
                                           "copy2): its backward all-reduce sums t = {} copies",
                                           t)),
              std::string::npos)
        << warnings[1];
    EXPECT_NE(warnings[1].find(fmt::format("reaching copy is {}x", t)), std::string::npos)
        << warnings[1];
  }
}

// Chains without such a mapping have no warnings, on every layout.
TEST(GraphVsReference, OrdinaryChainsHaveNoWarnings) {
  for (int64_t t : TensorParallelSizes()) {
    for (const bool sp : {false, true}) {
      SCOPED_TRACE(fmt::format("tp {} sequence_parallel {}", t, sp));
      EXPECT_EQ(PlanWarnings({{"parallel", Parallel(t, sp)},
                              {"model", LanguageModel(0.1)},
                              {"run", RunSection("float32", 8)}}),
                std::vector<std::string>());
      EXPECT_EQ(PlanWarnings({{"parallel", Parallel(t, sp)},
                              {"model", MlpBlock(16, 32)},
                              {"run", RunSection("float32", 8)}}),
                std::vector<std::string>());
    }
  }
}

// A repeated step (--repeat) starts from zero gradients: every repetition computes the same
// tensors, so the last one still matches the reference.
// Repeated steps (--repeat) compute the same step: the RNG tracker starts every repetition
// where its iteration starts, so dropout draws the same masks each time.
TEST(GraphVsReference, RepeatedStepsGiveTheSameTensors) {
  CpuBackend backend;
  json model = LanguageModel(0.1);
  model["layers"].insert(model["layers"].begin() + 3,
                         json{{"name", "dropout"}, {"type", "Dropout"}, {"p", 0.3}});
  const Config config = MakeConfig({{"parallel", Parallel(WorldSize())},
                                    {"model", model},
                                    {"run", RunSection("float32", 8, 2, 2)}});
  StatusOr<run::SimulationResult> r = run::Simulate(config, {true, 3, false}, backend);
  ASSERT_TRUE(r.ok()) << r.status().Message();
  EXPECT_EQ(r->seconds.size(), 3u);
  for (const run::TensorCheck& c : r->check.tensors) EXPECT_TRUE(c.ok()) << c.name;
}

// Training the layer chain: every iteration's loss and gradient norm, and the final
// parameters, clipped gradients and optimizer state, against the float64 reference training
// the whole chain (reference/trainer.h). Without dropout every layout (tp, dp, sequence
// parallelism, the distributed optimizer) trains one loss curve.
json ChainTraining(json document, const char* optimizer, bool distributed) {
  document["run"]["train_iters"] = 4;
  if (std::string(optimizer) == "adam") {
    document["optimizer"] = {{"optimizer", "adam"},
                             {"lr", 0.01},
                             {"lr_warmup_iters", 1},
                             {"clip_grad", 1.0},
                             {"weight_decay", 0.1}};
  } else {
    document["optimizer"] = {{"optimizer", "sgd"},
                             {"lr", 0.5},
                             {"lr_decay_style", "cosine"},
                             {"clip_grad", 0.05},
                             {"weight_decay", 0.1}};
  }
  document["optimizer"]["use_distributed_optimizer"] = distributed;
  return document;
}

void ExpectIterationsMatch(const run::SimulationResult& result, double relative) {
  ASSERT_EQ(result.iterations.size(), 4u);
  ASSERT_EQ(result.check.reference_iterations.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const run::CheckResult::Iteration& ref = result.check.reference_iterations[i];
    EXPECT_NEAR(result.iterations[i].loss, ref.loss, relative * std::fabs(ref.loss) + 1e-300)
        << "iteration " << i;
    EXPECT_NEAR(result.iterations[i].grad_norm, ref.grad_norm, relative * ref.grad_norm)
        << "iteration " << i;
  }
}

TEST(GraphTraining, EveryLayoutTrainsTheReferencesLossCurve) {
  for (const char* optimizer : {"adam", "sgd"}) {
    // One curve per padded vocabulary (tp 8 pads the 96 entries to 128: another model).
    std::map<int64_t, std::vector<std::vector<double>>> curves;
    for (int64_t t : TensorParallelSizes()) {
      for (const bool sp : {false, true}) {
        for (const bool distributed : {false, true}) {
          if ((sp && t == 1) || (distributed && WorldSize() / t == 1)) continue;
          SCOPED_TRACE(fmt::format("{} tp {} sequence_parallel {} distributed {}", optimizer, t, sp,
                                   distributed));
          const int64_t dp = WorldSize() / t;
          const run::SimulationResult result = RunChecked(ChainTraining(
              {{"parallel", Parallel(t, sp)},
               {"model", LanguageModel(0.1)},
               {"run", RunSection("float64", 8, std::max<int64_t>(8, WorldSize()) / dp, 2)}},
              optimizer, distributed));
          ExpectIterationsMatch(result, 1e-12);
          std::vector<double> curve;
          for (const auto& row : result.iterations) curve.push_back(row.loss);
          EXPECT_NE(curve.front(), curve.back()) << "the chain did not learn";
          curves[result.padded_vocab_size].push_back(curve);
        }
      }
    }
    for (const auto& [padded, same_model] : curves) {
      for (const auto& curve : same_model) {
        for (size_t i = 0; i < curve.size(); ++i) {
          EXPECT_NEAR(curve[i], same_model.front()[i], 1e-12) << "padded vocabulary " << padded;
        }
      }
    }
  }
}

// Dropout (each iteration continuing the tracker's streams), recomputation, a frozen layer,
// a chain without a loss layer (trained on its synthetic output gradients), and 16-bit
// storage with float32 master weights.
TEST(GraphTraining, DropoutFrozenLayersNoLossAndMixedPrecision) {
  const int64_t t = WorldSize() >= 2 ? 2 : 1;
  json model = LanguageModel(0.1);
  model["layers"].insert(model["layers"].begin() + 3,
                         json{{"name", "dropout"}, {"type", "Dropout"}, {"p", 0.3}});
  model["layers"][1]["frozen"] = true;
  json run = RunSection("float64", 8, 2, 2);
  run["recompute_granularity"] = "full";
  run["recompute_method"] = "uniform";
  run["recompute_num_layers"] = model["layers"].size();
  ExpectIterationsMatch(
      RunChecked(ChainTraining({{"parallel", Parallel(t, t > 1)}, {"model", model}, {"run", run}},
                               "adam", false)),
      1e-12);
  json mlp = MlpBlock(16, 64);
  mlp["layers"].insert(mlp["layers"].begin() + 2,
                       json{{"name", "dropout"}, {"type", "Dropout"}, {"p", 0.2}});
  ExpectIterationsMatch(
      RunChecked(ChainTraining(
          {{"parallel", Parallel(t)}, {"model", mlp}, {"run", RunSection("float64", 8, 2, 3)}},
          "sgd", WorldSize() / t > 1)),
      1e-12);
  for (const char* dtype : {"float32", "bfloat16"}) {
    SCOPED_TRACE(dtype);
    RunChecked(ChainTraining({{"parallel", Parallel(t, t > 1)},
                              {"model", LanguageModel(0.1)},
                              {"run", RunSection(dtype, 8, 2, 2)}},
                             "adam", WorldSize() / t > 1));
  }
}

// Pipelines of a chain: its layers in p * v consecutive stages (docs/simulator.md, "Pipeline
// stages of a chain"), run by the 1F1B or interleaved schedule, trained and checked against
// the reference. The language model's tied head sits on the last stage, its embedding on the
// first: the embd all-reduce keeps the two copies equal. Without dropout every layout of one
// padded vocabulary trains one loss curve; with dropout every pipeline rank draws from its
// own tracker in the order it runs its forwards, and the reference numbers the draws from
// the stage rule and the schedule alone.
struct ChainLayout {
  int64_t pp, vp, tp;
};

// The layouts of the world whose stages the 6-layer language model fills.
std::vector<ChainLayout> ChainLayouts() {
  std::vector<ChainLayout> layouts;
  for (int64_t pp : {1, 2, 4}) {
    for (int64_t vp : {0, 2}) {
      if ((vp > 0 && pp == 1) || pp * std::max<int64_t>(vp, 1) > 6) continue;
      for (int64_t tp = 1; pp * tp <= WorldSize() && tp <= 8; tp *= 2) {
        if (WorldSize() % (pp * tp) == 0) layouts.push_back({pp, vp, tp});
      }
    }
  }
  return layouts;
}

json ChainPipelineDocument(const ChainLayout& l, bool dropout) {
  json model = LanguageModel(0.1);
  model["layers"][4]["skip_weight_param_allocation"] = true;
  model["layers"][4]["weight_from"] = "embedding";
  if (dropout) {
    // Two dropouts on one stream (replicated inputs: the default stream), which pp 2 x vp 2
    // puts in both chunks of pp rank 0, so that the order of its forwards decides the draws.
    model["layers"].insert(model["layers"].begin() + 4,
                           json{{"name", "dropout1"}, {"type", "Dropout"}, {"p", 0.3}});
    model["layers"].insert(model["layers"].begin() + 1,
                           json{{"name", "dropout0"}, {"type", "Dropout"}, {"p", 0.2}});
  }
  json parallel = Parallel(l.tp, l.tp > 1);
  parallel["pipeline_model_parallel_size"] = l.pp;
  if (l.vp > 0) parallel["virtual_pipeline_model_parallel_size"] = l.vp;
  const int64_t dp = WorldSize() / (l.pp * l.tp);
  return ChainTraining(
      {{"parallel", parallel},
       {"model", model},
       {"run", RunSection("float64", 8, std::max<int64_t>(8, WorldSize()) / dp, 4)}},
      "adam", dp > 1);
}

TEST(GraphPipeline, EveryLayoutTrainsTheReferencesLossCurve) {
  for (const bool dropout : {false, true}) {
    std::map<int64_t, std::vector<std::vector<double>>> curves;
    for (const ChainLayout& l : ChainLayouts()) {
      SCOPED_TRACE(fmt::format("pp {} vp {} tp {} dropout {}", l.pp, l.vp, l.tp, dropout));
      const run::SimulationResult result = RunChecked(ChainPipelineDocument(l, dropout));
      ExpectIterationsMatch(result, 1e-12);
      std::vector<double> curve;
      for (const auto& row : result.iterations) curve.push_back(row.loss);
      curves[result.padded_vocab_size].push_back(curve);
    }
    if (dropout) continue;  // the masks, and so the curves, depend on the layout
    for (const auto& [padded, same_model] : curves) {
      for (const auto& curve : same_model) {
        for (size_t i = 0; i < curve.size(); ++i) {
          EXPECT_NEAR(curve[i], same_model.front()[i], 1e-12) << "padded vocabulary " << padded;
        }
      }
    }
  }
}

// Activation memory follows the schedule, as for the GPT model: on pp rank r, 1F1B keeps at
// most min(p - r, M) micro-batches between their forward and backward, the interleaved
// schedule its warmup plus one; recomputation changes no bit.
TEST(GraphPipeline, StashesFollowTheScheduleAndRecomputationIsBitIdentical) {
  for (const ChainLayout& l : ChainLayouts()) {
    if (l.pp == 1 || l.tp != 1) continue;
    SCOPED_TRACE(fmt::format("pp {} vp {}", l.pp, l.vp));
    json document = ChainPipelineDocument(l, true);
    document.erase("optimizer");
    document["run"].erase("train_iters");
    std::vector<double> losses;
    // No recomputation; each chunk whole; every chain layer alone; the first of each chunk.
    const std::vector<std::pair<const char*, int64_t>> options = {
        {"", 0},
        {"uniform", static_cast<int64_t>(document["model"]["layers"].size())},
        {"uniform", 1},
        {"block", 1}};
    for (const auto& [method, n] : options) {
      if (n > 0) {
        document["run"]["recompute_granularity"] = "full";
        document["run"]["recompute_method"] = method;
        document["run"]["recompute_num_layers"] = n;
      }
      const run::SimulationResult result = RunChecked(document);
      losses.push_back(result.loss);
      StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(
          l.pp, l.vp > 0 ? std::optional<int64_t>(l.vp) : std::nullopt, 4, std::nullopt);
      ASSERT_TRUE(schedule.ok());
      const int64_t r = result.coords.pp;
      const int64_t expected = l.vp > 0 ? std::min<int64_t>(schedule->NumWarmup(r) + 1, 4 * l.vp)
                                        : std::min<int64_t>(l.pp - r, 4);
      EXPECT_EQ(result.peak_stashes, expected) << "pp rank " << r;
    }
    for (size_t i = 1; i < losses.size(); ++i) EXPECT_EQ(losses[0], losses[i]) << i;
  }
}

TEST(GraphPipeline, StagesThatCannotBeBuiltAreRefused) {
  if (WorldSize() < 4) GTEST_SKIP() << "needs pp 4";
  const auto refusal = [](json document) {
    StatusOr<run::SimulationResult> r = Simulate(MakeConfig(document), false);
    return r.ok() ? std::string("ran") : r.status().Message();
  };
  json document = ChainPipelineDocument({4, 2, 1}, false);  // 6 layers, 8 stages
  EXPECT_EQ(refusal(document),
            "model.layers: 6 layers cannot fill 8 pipeline stages (pipeline_model_parallel_size 4 "
            "x virtual_pipeline_model_parallel_size 2); each stage holds at least one layer");
  // Two MLP blocks, the second's fc3 multiplying by fc1's weight: fc1 runs on pp rank 0, fc3
  // on pp rank 2, and only the first and the last rank share a weight.
  json mlp = MlpBlock(16, 64);
  const json second = json::array({{{"name", "fc3"},
                                    {"type", "ColumnParallelLinear"},
                                    {"input_size", 16},
                                    {"output_size", 64},
                                    {"gather_output", false},
                                    {"skip_weight_param_allocation", true},
                                    {"weight_from", "fc1"}},
                                   {{"name", "gelu2"}, {"type", "GeLU"}},
                                   {{"name", "fc4"},
                                    {"type", "RowParallelLinear"},
                                    {"input_size", 64},
                                    {"output_size", 16},
                                    {"input_is_parallel", true}}});
  for (const json& layer : second) mlp["layers"].push_back(layer);
  json parallel = Parallel(1);
  parallel["pipeline_model_parallel_size"] = 4;
  document = {{"parallel", parallel}, {"model", mlp}, {"run", RunSection("float64", 8, 2, 4)}};
  EXPECT_EQ(refusal(document),
            "model.layers[3]: (ColumnParallelLinear fc3): uses fc1.weight from pipeline rank 0 "
            "but runs on pipeline rank 2; across pipeline ranks only a weight of the first rank "
            "is shared, with the last (Megatron's tied embeddings)")
      << refusal(document);
}

// Fewer token rows than ranks: some ranks hold an empty slice of the reference, and every
// element is still compared.
TEST(GraphVsReference, FewerTokenRowsThanRanks) {
  const run::SimulationResult r = RunChecked({{"parallel", Parallel(WorldSize())},
                                              {"model", LanguageModel(0.0)},
                                              {"run", RunSection("float64", 1, 1, 2)}});
  for (const run::TensorCheck& c : r.check.tensors) {
    EXPECT_GE(c.count, NumElements(c.full_shape)) << c.name;
  }
}

// The check's other failures: a tensor the run records under an unknown name or with another
// shape, a reference tensor no rank records, and a sharded tensor that one rank leaves out.
TEST(GraphVsReference, MissingAndUnknownTensorsFail) {
  CpuBackend backend;
  const Config config = MakeConfig({{"parallel", Parallel(WorldSize())},
                                    {"model", LanguageModel(0.0)},
                                    {"run", RunSection("float64")}});
  StatusOr<run::SimulationResult> r = run::Simulate(config, {false, 1, true}, backend);
  ASSERT_TRUE(r.ok()) << r.status().Message();
  std::vector<TensorRecord> records;
  for (TensorRecord record : r->records) {
    if (record.name == "fc2.output") continue;                 // nobody records it
    if (record.name == "fc1.weight" && WorldRank() == 0) continue;  // rank 0's shard is missing
    if (record.name == "gelu.output") record.name = "gelu.out";     // unknown to the reference
    if (record.name == "head.weight") record.full_shape[0] += 1;    // wrong full shape
    records.push_back(std::move(record));
  }
  StatusOr<run::CheckResult> checked =
      run::CheckRun(config, r->coords, records, [](const TensorRecord& t) { return t.tensor; });
  ASSERT_TRUE(checked.ok()) << checked.status().Message();
  std::map<std::string, const run::TensorCheck*> by_name;
  for (const run::TensorCheck& c : checked->tensors) by_name[c.name] = &c;
  ASSERT_EQ(by_name.count("fc2.output"), 1u);
  EXPECT_TRUE(by_name["fc2.output"]->not_produced);
  EXPECT_TRUE(by_name["gelu.out"]->missing);
  EXPECT_TRUE(by_name["gelu.output"]->not_produced);
  EXPECT_TRUE(by_name["head.weight"]->missing);
  const run::TensorCheck& fc1 = *by_name["fc1.weight"];
  EXPECT_FALSE(fc1.ok());
  if (WorldSize() == 1) {
    EXPECT_TRUE(fc1.not_produced);
  } else {
    EXPECT_LT(fc1.count, NumElements(fc1.full_shape));  // tp = K: every shard is needed
  }
  for (const char* name : {"fc1.output", "fc2.weight_grad", "loss"}) {
    EXPECT_TRUE(by_name[name]->ok()) << name;
  }
}

TEST(GraphVsReference, BadLayoutsAreRefusedOnEveryRank) {
  json model = LanguageModel(0.0);
  model["layers"][3]["input_is_parallel"] = false;  // fc2 now wants a replicated input
  StatusOr<run::SimulationResult> r =
      Simulate(MakeConfig({{"parallel", Parallel(1)}, {"model", model}, {"run", RunSection("float64")}}),
                    true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().where(), "model.layers[3]");
  EXPECT_NE(r.status().what().find("receives a hidden split activation but accepts only: "
                                   "replicated"),
            std::string::npos)
      << r.status().what();
}

// ---------------------------------------------------------------------------------------
// Region mappings and utilities on integer data: exact results.

struct TpFixture {
  StatusOr<Topology> topology = Topology::Create([] {
    ParallelConfig c;
    c.world_size = WorldSize();
    c.tensor_model_parallel_size = WorldSize();
    return c;
  }());
  EigenKernels kernels;
  CommTrace trace;
  RankContext ctx;
  TpFixture() {
    ctx.topology = &*topology;
    ctx.rank = WorldRank();
    ctx.coords = topology->Coordinates(ctx.rank);
    ctx.kernels = &kernels;
    ctx.trace = &trace;
    auto groups = MakeGroupCommunicators(*topology, ctx.rank, MPI_COMM_WORLD, {"tp"});
    ctx.groups = RankGroups::Take(groups);
    tp = &ctx.tp();
  }
  Communicator* tp = nullptr;
  // [rows, cols] with value f(row, col).
  Tensor Make(int64_t rows, int64_t cols, const std::function<double(int64_t, int64_t)>& f) {
    Tensor t = Tensor::HostZeros({rows, cols}, DType::kFloat64);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) t.data_as<double>()[i * cols + j] = f(i, j);
    }
    return t;
  }
};

void ExpectTensor(const Tensor& actual, int64_t rows, int64_t cols,
                  const std::function<double(int64_t, int64_t)>& f) {
  ASSERT_EQ(actual.rows(), rows);
  ASSERT_EQ(actual.cols(), cols);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      ASSERT_EQ(actual.data_as<double>()[i * cols + j], f(i, j)) << i << ", " << j;
    }
  }
}

TEST(RegionMappings, ForwardAndBackwardOnIntegers) {
  TpFixture fx;
  const int64_t t = WorldSize(), r = WorldRank();
  const int64_t rows = 2 * t, cols = 3 * t;
  // Rank-dependent input: x_r[i, j] = 100 * r + 10 * i + j.
  const auto own = [&](int64_t i, int64_t j) { return 100.0 * static_cast<double>(r) +
                                                      10.0 * static_cast<double>(i) +
                                                      static_cast<double>(j); };
  const Tensor x = fx.Make(rows, cols, own);
  const double rank_sum = 100.0 * static_cast<double>(t * (t - 1) / 2);
  const auto summed = [&](int64_t i, int64_t j) {
    return rank_sum + static_cast<double>(t) * (10.0 * static_cast<double>(i) +
                                                 static_cast<double>(j));
  };
  // copy_to: forward identity, backward all-reduce.
  ExpectTensor(MappingForward(fx.kernels, *fx.tp, Mapping::kCopyToTp, x), rows, cols, own);
  ExpectTensor(MappingBackward(fx.kernels, *fx.tp, Mapping::kCopyToTp, x), rows, cols, summed);
  // reduce_from: forward all-reduce, backward identity.
  ExpectTensor(MappingForward(fx.kernels, *fx.tp, Mapping::kReduceFromTp, x), rows, cols, summed);
  ExpectTensor(MappingBackward(fx.kernels, *fx.tp, Mapping::kReduceFromTp, x), rows, cols, own);
  // scatter_to: forward keeps columns [r*c, (r+1)*c); backward all-gathers the last dim.
  const int64_t c = cols / t;
  ExpectTensor(MappingForward(fx.kernels, *fx.tp, Mapping::kScatterToTp, x), rows, c,
               [&](int64_t i, int64_t j) { return own(i, r * c + j); });
  const Tensor piece = fx.Make(rows, c, [&](int64_t i, int64_t j) {
    return 1000.0 * static_cast<double>(r) + 10.0 * static_cast<double>(i) +
           static_cast<double>(j);
  });
  const auto gathered_cols = [&](int64_t i, int64_t j) {
    return 1000.0 * static_cast<double>(j / c) + 10.0 * static_cast<double>(i) +
           static_cast<double>(j % c);
  };
  ExpectTensor(MappingBackward(fx.kernels, *fx.tp, Mapping::kScatterToTp, piece), rows, cols, gathered_cols);
  // gather_from: forward all-gathers the last dim; backward splits it.
  ExpectTensor(MappingForward(fx.kernels, *fx.tp, Mapping::kGatherFromTp, piece), rows, cols, gathered_cols);
  ExpectTensor(MappingBackward(fx.kernels, *fx.tp, Mapping::kGatherFromTp, x), rows, c,
               [&](int64_t i, int64_t j) { return own(i, r * c + j); });
  // Sequence parallel: dim 0 is the leading block of rows.
  const int64_t rb = rows / t;
  ExpectTensor(MappingForward(fx.kernels, *fx.tp, Mapping::kScatterToSp, x), rb, cols,
               [&](int64_t i, int64_t j) { return own(r * rb + i, j); });
  const Tensor rows_piece = fx.Make(rb, cols, [&](int64_t i, int64_t j) {
    return 1000.0 * static_cast<double>(r) + 10.0 * static_cast<double>(i) +
           static_cast<double>(j);
  });
  const auto gathered_rows = [&](int64_t i, int64_t j) {
    return 1000.0 * static_cast<double>(i / rb) + 10.0 * static_cast<double>(i % rb) +
           static_cast<double>(j);
  };
  ExpectTensor(MappingBackward(fx.kernels, *fx.tp, Mapping::kScatterToSp, rows_piece), rows, cols,
               gathered_rows);
  ExpectTensor(MappingForward(fx.kernels, *fx.tp, Mapping::kGatherFromSp, rows_piece), rows, cols,
               gathered_rows);
  const auto scattered_sum = [&](int64_t i, int64_t j) { return summed(r * rb + i, j); };
  ExpectTensor(MappingBackward(fx.kernels, *fx.tp, Mapping::kGatherFromSp, x, true), rb, cols, scattered_sum);
  ExpectTensor(MappingBackward(fx.kernels, *fx.tp, Mapping::kGatherFromSp, x, false), rb, cols,
               [&](int64_t i, int64_t j) { return own(r * rb + i, j); });
  ExpectTensor(MappingForward(fx.kernels, *fx.tp, Mapping::kReduceScatterToSp, x), rb, cols, scattered_sum);
  ExpectTensor(MappingBackward(fx.kernels, *fx.tp, Mapping::kReduceScatterToSp, rows_piece), rows, cols,
               gathered_rows);
}

TEST(TensorParallelUtils, VocabRangesSplitsAndBroadcast) {
  TpFixture fx;
  const int64_t t = WorldSize(), r = WorldRank();
  EXPECT_EQ(VocabRangeFromGlobalVocabSize(64 * t, r, t), std::make_pair(64 * r, 64 * r + 64));
  EXPECT_EQ(VocabRangeFromPerPartitionVocabSize(10, 3), std::make_pair(int64_t{30}, int64_t{40}));
  EXPECT_THROW(VocabRangeFromGlobalVocabSize(7, 0, 2), std::invalid_argument);

  const Tensor x = fx.Make(3, 4 * t, [](int64_t i, int64_t j) { return 10.0 * static_cast<double>(i) + static_cast<double>(j); });
  const std::vector<Tensor> parts = SplitTensorAlongLastDim(fx.kernels, x, t);
  ASSERT_EQ(static_cast<int64_t>(parts.size()), t);
  for (int64_t p = 0; p < t; ++p) {
    ExpectTensor(parts[static_cast<size_t>(p)], 3, 4, [&](int64_t i, int64_t j) {
      return 10.0 * static_cast<double>(i) + static_cast<double>(p * 4 + j);
    });
  }
  const Tensor chunk = SplitTensorInto1dEqualChunks(fx.kernels, *fx.tp, x);
  ASSERT_EQ(chunk.numel(), 12);
  EXPECT_EQ(chunk.data_as<double>()[0], x.data_as<double>()[r * 12]);
  const Tensor whole = GatherSplit1dTensor(fx.kernels, *fx.tp, chunk);
  ASSERT_EQ(whole.numel(), x.numel());
  EXPECT_EQ(std::memcmp(whole.data(), x.data(), x.bytes()), 0);

  Tensor data = fx.Make(2, 2, [&](int64_t i, int64_t j) {
    return static_cast<double>(r + 1) * static_cast<double>(i * 2 + j + 1);
  });
  BroadcastData(*fx.tp, {&data});
  ExpectTensor(data, 2, 2, [](int64_t i, int64_t j) { return static_cast<double>(i * 2 + j + 1); });
}

}  // namespace
}  // namespace mpusim
