// PyTorch's tensor-parallel plans at the command line: a chain of torch.nn modules styled by a
// parallelize_plan on a dp x tp device mesh passes its check against the float64 reference,
// diffs clean against the plan-less model on one rank, and communicates what DTensor's rules
// say (the counts below are derived by hand from them); a plan whose layouts do not meet is
// refused before the run with one line naming the module and the fix.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"

namespace mpusim::cli {
namespace {

using nlohmann::json;
using test_util::Mpiexec;
using test_util::Mpusim;
using test_util::Result;
using test_util::Shell;
using test_util::WriteTemp;

// The issue's toy model: Embedding -> Linear -> ReLU -> Linear -> head -> loss, in float64.
json Toy() {
  return json::parse(R"json({
    "parallel": {"device_mesh": {"mesh_shape": [2, 2], "mesh_dim_names": ["dp", "tp"]}},
    "model": {
      "vocab_size": 64,
      "layers": [
        {"name": "embedding", "type": "Embedding", "num_embeddings": 64, "embedding_dim": 32},
        {"name": "in_proj", "type": "Linear", "in_features": 32, "out_features": 128},
        {"name": "relu", "type": "ReLU"},
        {"name": "out_proj", "type": "Linear", "in_features": 128, "out_features": 32},
        {"name": "head", "type": "Linear", "in_features": 32, "out_features": 64, "bias": false},
        {"name": "loss", "type": "CrossEntropyLoss"}
      ]
    },
    "parallelize_plan": {"in_proj": "ColwiseParallel", "out_proj": "RowwiseParallel"},
    "run": {"seq_length": 8, "micro_batch_size": 2, "num_microbatches": 2, "dtype": "float64"}
  })json");
}

std::filesystem::path Scratch(const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / (name + "." + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

// Runs `config` on `ranks` ranks with a dump and a summary; returns the summary.
json RunDumped(const json& config, int ranks, const std::filesystem::path& dump,
               const std::string& name) {
  const std::string path = WriteTemp(name + ".json", config.dump());
  const std::filesystem::path summary = Scratch(name + "_summary.json");
  std::string output;
  EXPECT_EQ(Shell(Mpiexec(ranks) + MPUSIM_BINARY + " run " + path + " --dump " + dump.string() +
                      " --summary " + summary.string(),
                  &output),
            0)
      << output;
  std::ifstream in(summary);
  json j = json::parse(in, nullptr, false);
  std::filesystem::remove(summary);
  return j;
}

// The same model without a plan on one rank, holding all four samples of a micro-batch.
json OneRank(json config) {
  config.erase("parallelize_plan");
  config["parallel"] = {{"world_size", 1}};
  config["run"]["micro_batch_size"] = 4;
  return config;
}

void ExpectDiffClean(const std::filesystem::path& a, const std::filesystem::path& b,
                     const std::string& atol) {
  const Result r = Mpusim({"diff", a.string(), b.string(), "--atol", atol, "--rtol", "0"});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find(" 0 failed"), std::string::npos) << r.out;
}

// Done-when of the plan: checked, the issue's counts, clean against one plan-less rank, and
// PairwiseParallel on the whole model computes the same tensors.
TEST(TorchPlan, ToyPlanOnDpByTpMeshIsCheckedCountedAndDiffsCleanAgainstOneRank) {
  const std::filesystem::path plan = Scratch("mpusim_torch_plan");
  const std::filesystem::path pairwise = Scratch("mpusim_torch_pairwise");
  const std::filesystem::path one = Scratch("mpusim_torch_one");
  const json summary = RunDumped(Toy(), 4, plan, "mpusim_torch_plan");
  ASSERT_TRUE(summary.is_object());
  EXPECT_TRUE(summary["passed"].get<bool>());
  EXPECT_EQ(summary["check"]["failed"], 0);
  // Rowwise's Partial() output -> Replicate(): one all_reduce forward; Colwise's Partial()
  // input gradient -> Replicate(): one backward. Per micro-batch (2 of them).
  EXPECT_EQ(
      summary["comm_counts"],
      json::parse(R"json({"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}})json"));
  json whole = Toy();
  whole["parallelize_plan"] = "PairwiseParallel";
  const json pairwise_summary = RunDumped(whole, 4, pairwise, "mpusim_torch_pairwise");
  EXPECT_EQ(pairwise_summary["comm_counts"], summary["comm_counts"]);
  RunDumped(OneRank(Toy()), 1, one, "mpusim_torch_one");
  ExpectDiffClean(plan, one, "1e-12");
  ExpectDiffClean(pairwise, plan, "0");
  for (const auto& dir : {plan, pairwise, one}) std::filesystem::remove_all(dir);
}

// The sequence-parallel plan (torchtitan's shape of it): the embedding hands on Shard(1), the
// norms run on it (SequenceParallel), each Colwise gathers the sequence (input_layouts
// Shard(1)), each Rowwise reduce-scatters back to it, and the head hands the loss whole
// logits. By DTensor's rules, per micro-batch:
//   forward   embedding Partial -> Shard(1): reduce_scatter; in_proj Shard(1) -> Replicate:
//             all_gather; out_proj Partial -> Shard(1): reduce_scatter; head Shard(1) ->
//             Replicate and its Shard(-1) output -> Replicate: two all_gathers
//   backward  head's Partial input gradient -> Shard(1): reduce_scatter (its output gradient
//             Replicate -> Shard(-1) is a local slice); out_proj's Shard(1) gradient ->
//             Replicate: all_gather; in_proj's Partial -> Shard(1): reduce_scatter;
//             the embedding's Shard(1) gradient -> Replicate: all_gather
// A LayerNorm under SequenceParallel runs on the rank's tokens; its weight and bias gradients
// are summed over tp after the step (not counted: neither forward nor backward).
json WithNorms(json config) {
  auto& layers = config["model"]["layers"];
  layers.insert(layers.begin() + 1,
                json{{"name", "norm"}, {"type", "LayerNorm"}, {"normalized_shape", 32}});
  layers.insert(layers.begin() + 5,
                json{{"name", "norm2"}, {"type", "LayerNorm"}, {"normalized_shape", 32}});
  return config;
}

TEST(TorchPlan, SequenceParallelPlanCountsWhatDTensorsRulesSay) {
  json config = WithNorms(Toy());
  config["parallelize_plan"] = json::parse(R"json({
    "embedding": {"style": "RowwiseParallel", "input_layouts": "Replicate()",
                  "output_layouts": "Shard(1)"},
    "norm*": "SequenceParallel",
    "in_proj": {"style": "ColwiseParallel", "input_layouts": "Shard(1)"},
    "out_proj": {"style": "RowwiseParallel", "output_layouts": "Shard(1)"},
    "head": {"style": "ColwiseParallel", "input_layouts": "Shard(1)",
             "output_layouts": "Replicate()"}
  })json");
  const std::filesystem::path plan = Scratch("mpusim_torch_sp");
  const std::filesystem::path one = Scratch("mpusim_torch_sp_one");
  const json summary = RunDumped(config, 4, plan, "mpusim_torch_sp");
  ASSERT_TRUE(summary.is_object());
  EXPECT_TRUE(summary["passed"].get<bool>());
  EXPECT_EQ(summary["comm_counts"], json::parse(R"json({
    "forward": {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 2},
    "backward": {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}})json"));
  RunDumped(OneRank(WithNorms(Toy())), 1, one, "mpusim_torch_sp_one");
  ExpectDiffClean(plan, one, "1e-12");
  for (const auto& dir : {plan, one}) std::filesystem::remove_all(dir);
}

// loss_parallel(): the head hands on its Shard(-1) logits as a DTensor and the loss computes
// over each rank's classes. By DTensor's rules (torch's loss_parallel), per micro-batch:
//   forward   out_proj's Partial -> Replicate all_reduce; the loss's row max, label logit and
//             sum of exponentials all_reduce (3)
//   backward  head's and in_proj's Partial input gradients -> Replicate: all_reduce 2 (the
//             loss's gradient is Shard(-1), as the logits are: no collective)
TEST(TorchPlan, LossParallelComputesTheLossOnShardedLogits) {
  json config = Toy();
  config["parallelize_plan"]["head"] = {{"style", "ColwiseParallel"}, {"use_local_output", false}};
  config["run"]["loss_parallel"] = true;
  const std::filesystem::path plan = Scratch("mpusim_torch_loss_parallel");
  const std::filesystem::path one = Scratch("mpusim_torch_loss_parallel_one");
  const json summary = RunDumped(config, 4, plan, "mpusim_torch_loss_parallel");
  ASSERT_TRUE(summary.is_object());
  EXPECT_TRUE(summary["passed"].get<bool>());
  EXPECT_EQ(
      summary["comm_counts"],
      json::parse(R"json({"forward": {"all_reduce": 4}, "backward": {"all_reduce": 2}})json"));
  json plain = OneRank(Toy());
  RunDumped(plain, 1, one, "mpusim_torch_loss_parallel_one");
  ExpectDiffClean(plan, one, "1e-12");
  for (const auto& dir : {plan, one}) std::filesystem::remove_all(dir);
  // Without loss_parallel the same plan's DTensor logits reach a plain CrossEntropyLoss.
  config["run"]["loss_parallel"] = false;
  const Result r = Mpusim({"explain", WriteTemp("mpusim_torch_no_lp.json", config.dump())});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("(CrossEntropyLoss loss): receives a DTensor from head"), std::string::npos)
      << r.err;
}

// A plan whose layouts do not meet: one line naming the module, what it receives and the fix,
// exit code 2, before any rank computes.
TEST(TorchPlan, PlansWhoseLayoutsDoNotMeetAreRefused) {
  const auto refused = [](const json& config, const std::string& name,
                          const std::string& expected) {
    const std::string path = WriteTemp(name, config.dump());
    std::string output;
    EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + path, &output) != 0, true) << output;
    const Result r = Mpusim({"explain", path});
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_EQ(r.out, "");
    EXPECT_NE(r.err.find(expected), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  json swapped = Toy();
  swapped["parallelize_plan"] = {{"in_proj", "RowwiseParallel"}, {"out_proj", "ColwiseParallel"}};
  refused(swapped, "mpusim_torch_swapped.json",
          "model.layers[1]: (Linear in_proj): RowwiseParallel (parallelize_plan.in_proj) takes "
          "its input as Shard(-1) (input_layouts), but it receives Replicate() [2, 8, 32] from "
          "embedding");
  json half = Toy();
  half["parallelize_plan"] = {{"in_proj", "ColwiseParallel"}};
  refused(half, "mpusim_torch_half.json",
          "out_proj (no style) receives Shard(-1) [2, 8, 64] of [2, 8, 128] from relu, but its "
          "replicated weight multiplies whole rows. Fix: give out_proj RowwiseParallel");
  json twice = Toy();
  twice["parallelize_plan"] = {{"in_proj", "ColwiseParallel"}, {"*", "RowwiseParallel"}};
  refused(twice, "mpusim_torch_twice.json",
          "parallelize_plan.in_proj: styles module \"in_proj\", which parallelize_plan.* styles "
          "too");
  json nothing = Toy();
  nothing["parallelize_plan"] = {{"fc1", "ColwiseParallel"}};
  refused(nothing, "mpusim_torch_nothing.json",
          "parallelize_plan.fc1: matches no module; the modules are: embedding, in_proj, relu, "
          "out_proj, head, loss");
  json partial_relu = Toy();
  partial_relu["parallelize_plan"] = json::parse(R"json({"in_proj": {"style": "ColwiseParallel"},
    "out_proj": {"style": "RowwiseParallel", "output_layouts": "Partial()"}})json");
  partial_relu["model"]["layers"].insert(partial_relu["model"]["layers"].begin() + 4,
                                         json{{"name", "relu2"}, {"type", "ReLU"}});
  refused(partial_relu, "mpusim_torch_partial.json",
          "(ReLU relu2): receives Partial() sums from out_proj: relu of a sum is not the sum of "
          "relus");
  json plain_norm = WithNorms(Toy());
  plain_norm["parallelize_plan"] = json::parse(R"json({
    "embedding": {"style": "RowwiseParallel", "input_layouts": "Replicate()",
                  "output_layouts": "Shard(1)"}})json");
  refused(plain_norm, "mpusim_torch_plain_norm.json",
          "norm (no style) receives Shard(1) [2, 4, 32] of [2, 8, 32] from embedding: its plain "
          "weight's gradient would cover this rank's tokens only");
  json batch = Toy();
  batch["parallelize_plan"]["out_proj"] = {{"style", "RowwiseParallel"},
                                           {"output_layouts", "Shard(0)"}};
  refused(batch, "mpusim_torch_batch.json",
          "RowwiseParallel (parallelize_plan.out_proj) uses Shard(0), the batch");
  json prepared = Toy();
  prepared["parallelize_plan"]["relu"] = {{"style", "PrepareModuleOutput"},
                                          {"output_layouts", "Replicate()"},
                                          {"desired_output_layouts", "Shard(-1)"}};
  refused(prepared, "mpusim_torch_prepared.json",
          "PrepareModuleOutput (parallelize_plan.relu) takes the output as Replicate() "
          "(output_layouts), but the module produces Shard(-1) [2, 8, 64] of [2, 8, 128]");
  json megatron_loss = Toy();
  megatron_loss["model"]["layers"] = json::array({{{"name", "fc1"},
                                                   {"type", "ColumnParallelLinear"},
                                                   {"input_size", 32},
                                                   {"output_size", 64}}});
  megatron_loss.erase("parallelize_plan");
  megatron_loss["run"]["loss_parallel"] = true;
  refused(megatron_loss, "mpusim_torch_megatron_loss.json",
          "run.loss_parallel: is PyTorch's loss_parallel() for a chain of torch.nn modules");
  json mixed = Toy();
  mixed["model"]["layers"][1] = {{"name", "in_proj"},
                                 {"type", "ColumnParallelLinear"},
                                 {"input_size", 32},
                                 {"output_size", 128}};
  refused(mixed, "mpusim_torch_mixed.json", "a chain is written in torch.nn's modules");
}

// A GPT with Megatron's plan written over its modules (sample_configs/
// gpt_torch_plan_t2_sp_dp2_n4.json) runs Megatron's tp 2 with sequence parallelism: its float64
// dump equals the plan-less run's to the bit. Plans that are not Megatron's are refused,
// naming the module and the style Megatron gives it.
TEST(TorchPlan, GptWithMegatronsPlanIsMegatronsTensorParallelRun) {
  std::ifstream in(std::string(MPUSIM_SAMPLE_CONFIG_DIR) + "/gpt_torch_plan_t2_sp_dp2_n4.json");
  json planned = json::parse(in);
  planned["run"]["dtype"] = "float64";
  planned["run"]["num_microbatches"] = 1;
  json megatron = planned;
  megatron.erase("parallelize_plan");
  megatron["parallel"] = {
      {"world_size", 4}, {"tensor_model_parallel_size", 2}, {"sequence_parallel", true}};
  const std::filesystem::path a = Scratch("mpusim_torch_gpt_plan");
  const std::filesystem::path b = Scratch("mpusim_torch_gpt_megatron");
  const json summary = RunDumped(planned, 4, a, "mpusim_torch_gpt_plan");
  ASSERT_TRUE(summary.is_object());
  EXPECT_TRUE(summary["passed"].get<bool>());
  // Per micro-batch, 2 layers, by Megatron's code (what runs), in DTensor's terms:
  //   forward   the embedding's Partial -> Shard(1) reduce_scatter; per layer linear_qkv and
  //             linear_fc1 gather the sequence (all_gather), linear_proj and linear_fc2
  //             reduce-scatter their Partial sums; output_layer gathers its input; the
  //             vocab-parallel cross entropy (loss_parallel) all-reduces the row max, the
  //             label's logit and the sum of exponentials: all_gather 5, reduce_scatter 5,
  //             all_reduce 3
  //   backward  output_layer's and each Colwise layer's Partial input gradient ->
  //             Shard(1) (reduce_scatter 1 + 2 x 2); each Rowwise layer's Shard(1) output
  //             gradient -> Replicate (all_gather 2 x 2), the embedding's likewise (1); and
  //             Megatron's re-gather of each Colwise layer's saved Shard(1) input for its
  //             weight gradient (1 + 2 x 2), where DTensor keeps the gathered input: all_gather
  //             10 (DTensor's rules alone: 5), reduce_scatter 5
  EXPECT_EQ(summary["comm_counts"], json::parse(R"json({
    "forward": {"all_gather_into_tensor": 5, "all_reduce": 3, "reduce_scatter_tensor": 5},
    "backward": {"all_gather_into_tensor": 10, "reduce_scatter_tensor": 5}})json"));
  RunDumped(megatron, 4, b, "mpusim_torch_gpt_megatron");
  ExpectDiffClean(a, b, "0");
  for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);

  const auto refusal = [](const json& config, const std::string& name) {
    const Result r = Mpusim({"explain", WriteTemp(name, config.dump())});
    EXPECT_EQ(r.code, 2);
    EXPECT_EQ(r.out, "");
    return r.err.substr(r.err.find(": ", r.err.find(".json")) + 2);
  };
  json missing = planned;
  missing["parallelize_plan"].erase("decoder.final_layernorm");
  EXPECT_EQ(refusal(missing, "mpusim_torch_gpt_missing.json"),
            "parallelize_plan: has no style for \"decoder.final_layernorm\", but Megatron's layout "
            "with sequence parallelism gives it SequenceParallel\n");
  json swapped = planned;
  swapped["parallelize_plan"]["decoder.layers.*.mlp.linear_fc2"] = "ColwiseParallel";
  EXPECT_EQ(refusal(swapped, "mpusim_torch_gpt_swapped.json"),
            "parallelize_plan.decoder.layers.*.mlp.linear_fc2: styles "
            "\"decoder.layers.0.mlp.linear_fc2\" with ColwiseParallel, but Megatron's layout with "
            "sequence parallelism gives it RowwiseParallel(output_layouts=Shard(1))\n");
  json no_sp = planned;
  no_sp["parallel"]["sequence_parallel"] = false;
  EXPECT_NE(refusal(no_sp, "mpusim_torch_gpt_no_sp.json")
                .find("; set parallel.sequence_parallel true for Megatron's sequence-parallel "
                      "layout"),
            std::string::npos);
  // Learned absolute positions: Megatron adds them to the whole sum of the word embeddings
  // and only then scatters, so its plan hands on Replicate() from the word embeddings and
  // Shard(1) from the embedding module.
  json learned = planned;
  learned["model"]["position_embedding_type"] = "learned_absolute";
  learned["model"]["max_position_embeddings"] = 64;
  EXPECT_EQ(refusal(learned, "mpusim_torch_gpt_learned.json"),
            "parallelize_plan: has no style for \"embedding\", but Megatron's layout with sequence "
            "parallelism gives it PrepareModuleOutput(output_layouts=Replicate(), "
            "desired_output_layouts=Shard(1)) (it adds the learned absolute positions to the "
            "whole sum, then scatters the sequence)\n");
  learned["parallelize_plan"]["embedding.word_embeddings"]["output_layouts"] = "Replicate()";
  learned["parallelize_plan"]["embedding"] = {{"style", "PrepareModuleOutput"},
                                              {"output_layouts", "Replicate()"},
                                              {"desired_output_layouts", "Shard(1)"}};
  EXPECT_EQ(Mpusim({"explain", WriteTemp("mpusim_torch_gpt_learned_ok.json", learned.dump())}).code,
            0);
  json pairwise = planned;
  pairwise["parallelize_plan"] = "PairwiseParallel";
  EXPECT_NE(refusal(pairwise, "mpusim_torch_gpt_pairwise.json")
                .find("PairwiseParallel on the whole GPT is not Megatron's plan"),
            std::string::npos);
}

// Two training runs' curves, iteration by iteration: the loss and the gradient norm (float64:
// the two reductions sum the same terms in another order).
void ExpectSameCurve(const json& a, const json& b) {
  ASSERT_EQ(a["iterations"].size(), b["iterations"].size());
  ASSERT_FALSE(a["iterations"].empty());
  for (size_t i = 0; i < a["iterations"].size(); ++i) {
    for (const char* key : {"loss", "grad_norm"}) {
      const double x = a["iterations"][i][key].get<double>();
      const double y = b["iterations"][i][key].get<double>();
      EXPECT_NEAR(x, y, 1e-12 * std::abs(y)) << key << ", iteration " << i + 1;
    }
  }
}

// Three iterations of momentum SGD: its update is linear in the gradients, so the float64
// runs stay within the check's propagated bounds (Adam divides by sqrt(v), which turns a
// rounding difference in a near-zero gradient into a difference of the size of lr).
json Trained(json config, bool fsdp) {
  config["run"]["train_iters"] = 3;
  config["optimizer"] = {{"optimizer", "sgd"}, {"lr", 1e-2}, {"use_torch_fsdp2", fsdp}};
  return config;
}

// fully_shard on the dp dimension of the toy's mesh (FSDP2 over dp, the plan over tp): it
// trains the loss curve DDP trains, ends with the same parameters, gradients and optimizer
// state, and communicates on dp what FSDP2's hooks do, per micro-batch (every Linear and the
// Embedding one unit; the root, the chain, holds no parameter):
//   forward   each unit's all_gather before its forward: 4
//   backward  each unit's all_gather again (released after the forward): 4, and its
//             reduce_scatter of the gradients: 4
// reshard_after_forward false keeps them from the forward to the backward: no backward
// all_gather. DDP reduces after the step (finalize_model_grads), in neither phase.
TEST(TorchPlan, FullyShardOnTheDpDimTrainsTheLossCurveDdpTrains) {
  const std::filesystem::path ddp = Scratch("mpusim_torch_ddp");
  const std::filesystem::path fsdp = Scratch("mpusim_torch_fsdp");
  const json ddp_summary = RunDumped(Trained(Toy(), false), 4, ddp, "mpusim_torch_ddp");
  const json fsdp_summary = RunDumped(Trained(Toy(), true), 4, fsdp, "mpusim_torch_fsdp");
  ASSERT_TRUE(ddp_summary.is_object() && fsdp_summary.is_object());
  EXPECT_TRUE(ddp_summary["passed"].get<bool>());
  EXPECT_TRUE(fsdp_summary["passed"].get<bool>());
  ExpectSameCurve(fsdp_summary, ddp_summary);
  ExpectDiffClean(fsdp, ddp, "1e-12");
  EXPECT_EQ(fsdp_summary["comm_counts"], ddp_summary["comm_counts"]);
  EXPECT_EQ(ddp_summary["comm_counts_dp"],
            json::parse(R"json({"forward": {}, "backward": {}})json"));
  EXPECT_EQ(fsdp_summary["comm_counts_dp"], json::parse(R"json({
    "forward": {"all_gather_into_tensor": 4},
    "backward": {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}})json"));
  json kept = Trained(Toy(), true);
  kept["optimizer"]["torch_fsdp2_reshard_after_forward"] = false;
  const json kept_summary = RunDumped(kept, 4, fsdp, "mpusim_torch_fsdp_kept");
  EXPECT_TRUE(kept_summary["passed"].get<bool>());
  EXPECT_EQ(kept_summary["comm_counts_dp"], json::parse(R"json({
    "forward": {"all_gather_into_tensor": 4},
    "backward": {"reduce_scatter_tensor": 4}})json"));
  for (const auto& dir : {ddp, fsdp}) std::filesystem::remove_all(dir);
}

// Rows that do not divide: a Linear of 5 outputs and its LayerNorm on 8 dp ranks, where ranks
// 5-7 hold no row of them (torch.chunk's split, padded for the collectives), still train what
// DDP trains, and the check passes.
TEST(TorchPlan, FullyShardSplitsRowsAsTorchChunkDoes) {
  json config = Toy();
  config.erase("parallelize_plan");
  config["parallel"] = {{"world_size", 8}};
  config["run"]["micro_batch_size"] = 1;
  auto& layers = config["model"]["layers"];
  layers[1]["out_features"] = 5;
  layers[3]["in_features"] = 5;
  layers.insert(layers.begin() + 3,
                json{{"name", "norm"}, {"type", "LayerNorm"}, {"normalized_shape", 5}});
  const std::filesystem::path ddp = Scratch("mpusim_torch_ddp8");
  const std::filesystem::path fsdp = Scratch("mpusim_torch_fsdp8");
  const json ddp_summary = RunDumped(Trained(config, false), 8, ddp, "mpusim_torch_ddp8");
  const json fsdp_summary = RunDumped(Trained(config, true), 8, fsdp, "mpusim_torch_fsdp8");
  ASSERT_TRUE(ddp_summary.is_object() && fsdp_summary.is_object());
  EXPECT_TRUE(fsdp_summary["passed"].get<bool>());
  ExpectSameCurve(fsdp_summary, ddp_summary);
  ExpectDiffClean(fsdp, ddp, "1e-12");
  for (const auto& dir : {ddp, fsdp}) std::filesystem::remove_all(dir);
}

// Megatron's use_torch_fsdp2 on the GPT (untied, as Megatron requires) with Megatron's plan
// on tp: the loss curve of the Megatron layout (tensor_model_parallel_size 2, DDP), and on
// dp, per micro-batch, Megatron's units (the embedding, 2 layers, the output layer, and the
// root holding the final layernorm, which FSDP2 keeps from its forward to its backward):
//   forward all_gather 5; backward all_gather 4, reduce_scatter 5.
TEST(TorchPlan, FullyShardOnTheGptTrainsTheMegatronLayoutsCurve) {
  std::ifstream in(std::string(MPUSIM_SAMPLE_CONFIG_DIR) + "/gpt_torch_plan_t2_sp_dp2_n4.json");
  json planned = json::parse(in);
  planned["run"]["dtype"] = "float64";
  planned["model"]["share_embeddings_and_output_weights"] = false;
  json megatron = planned;
  megatron.erase("parallelize_plan");
  megatron["parallel"] = {
      {"world_size", 4}, {"tensor_model_parallel_size", 2}, {"sequence_parallel", true}};
  const std::filesystem::path a = Scratch("mpusim_torch_gpt_fsdp");
  const std::filesystem::path b = Scratch("mpusim_torch_gpt_ddp");
  const json fsdp = RunDumped(Trained(planned, true), 4, a, "mpusim_torch_gpt_fsdp");
  const json ddp = RunDumped(Trained(megatron, false), 4, b, "mpusim_torch_gpt_ddp");
  ASSERT_TRUE(fsdp.is_object() && ddp.is_object());
  EXPECT_TRUE(fsdp["passed"].get<bool>());
  EXPECT_TRUE(ddp["passed"].get<bool>());
  ExpectSameCurve(fsdp, ddp);
  ExpectDiffClean(a, b, "1e-12");
  EXPECT_EQ(fsdp["comm_counts_dp"], json::parse(R"json({
    "forward": {"all_gather_into_tensor": 5},
    "backward": {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 5}})json"));
  for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
  // What Megatron refuses with --use-torch-fsdp2, refused the same way: one line naming it.
  const auto refusal = [](json config, const std::string& name) {
    const Result r = Mpusim({"explain", WriteTemp(name, config.dump())});
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_EQ(r.out, "");
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    return r.err;
  };
  json tied = Trained(megatron, true);
  tied["model"]["share_embeddings_and_output_weights"] = true;
  EXPECT_NE(refusal(tied, "mpusim_fsdp_tied.json")
                .find("optimizer.use_torch_fsdp2: needs model.share_embeddings_and_output_weights "
                      "false"),
            std::string::npos);
  json piped = Trained(megatron, true);
  piped["parallel"]["pipeline_model_parallel_size"] = 2;
  EXPECT_NE(refusal(piped, "mpusim_fsdp_pp.json")
                .find("optimizer.use_torch_fsdp2: needs pipeline_model_parallel_size 1, got 2"),
            std::string::npos);
  json half = Trained(megatron, true);
  half["run"]["dtype"] = "float16";
  EXPECT_NE(refusal(half, "mpusim_fsdp_fp16.json")
                .find("optimizer.use_torch_fsdp2: cannot train in fp16"),
            std::string::npos);
  json fused = Trained(megatron, true);
  fused["parallel"]["gradient_accumulation_fusion"] = true;
  EXPECT_NE(refusal(fused, "mpusim_fsdp_fusion.json")
                .find("optimizer.use_torch_fsdp2: cannot be combined with "
                      "parallel.gradient_accumulation_fusion"),
            std::string::npos);
  json reshard = Trained(megatron, false);
  reshard["optimizer"]["torch_fsdp2_reshard_after_forward"] = false;
  EXPECT_NE(refusal(reshard, "mpusim_fsdp_reshard.json")
                .find("optimizer.torch_fsdp2_reshard_after_forward: is false, but "
                      "use_torch_fsdp2 is not true"),
            std::string::npos);
  json sharded = Trained(megatron, true);
  sharded["optimizer"]["use_distributed_optimizer"] = true;
  EXPECT_NE(refusal(sharded, "mpusim_fsdp_distopt.json")
                .find("optimizer.use_torch_fsdp2: cannot be combined with "
                      "use_distributed_optimizer"),
            std::string::npos);
}

}  // namespace
}  // namespace mpusim::cli
