// Multi-latent attention at the command line: `mpusim run` runs it (float64 dumps of tp 2
// with sequence parallelism and of cp 2 diff clean against one rank), `explain` shows its
// parameters, and `estimate` and `advise` count it (tests/cli/estimate_models_test.cc for
// the numbers).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/cli/cli_test_util.h"

namespace mpusim::cli {
namespace {

using nlohmann::json;
using test_util::ExpectUsageError;
using test_util::Mpiexec;
using test_util::Mpusim;
using test_util::Result;
using test_util::Shell;
using test_util::WriteTemp;

json MlaConfig() {
  return json{{"parallel", {{"world_size", 2}, {"tensor_model_parallel_size", 2}}},
              {"model",
               {{"type", "gpt"},
                {"num_layers", 2},
                {"hidden_size", 32},
                {"num_attention_heads", 4},
                {"vocab_size", 64},
                {"position_embedding_type", "rope"},
                {"multi_latent_attention", true},
                {"q_lora_rank", 16},
                {"kv_lora_rank", 12},
                {"qk_head_dim", 8},
                {"qk_pos_emb_head_dim", 4},
                {"v_head_dim", 8}}},
              {"run", {{"seq_length", 8}, {"micro_batch_size", 1}, {"num_microbatches", 1}}}};
}

// `path` run in float64 on `ranks` ranks and on one rank (`one_rank`: the flags that make
// it one), both dumped: the dumps diff clean.
void ExpectDumpDiffsCleanAgainstOneRank(const std::string& path, int ranks,
                                        const std::string& one_rank, const std::string& name) {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  const std::string tag = std::to_string(::getpid());
  const std::filesystem::path a = tmp / (name + "_a." + tag);
  const std::filesystem::path b = tmp / (name + "_b." + tag);
  for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
  std::string output;
  ASSERT_EQ(Shell(Mpiexec(ranks) + MPUSIM_BINARY + " run " + path + " --dtype float64 --dump " +
                      a.string(),
                  &output),
            0)
      << output;
  ASSERT_EQ(Shell(Mpiexec(1) + MPUSIM_BINARY + " run " + path + " --dtype float64 " + one_rank +
                      " --dump " + b.string(),
                  &output),
            0)
      << output;
  const Result same = Mpusim({"diff", a.string(), b.string(), "--atol", "1e-12", "--rtol", "0"});
  EXPECT_EQ(same.code, 0) << same.out << same.err;
  EXPECT_NE(same.out.find(" 0 failed"), std::string::npos) << same.out;
  for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
}

// `mpusim run` on tp 2 with sequence parallelism in float64, dumped, diffs clean against the
// one-rank layout with the same data-parallel split (dp 1 in both).
TEST(MlaCli, RunDumpDiffsCleanAgainstOneRank) {
  json config = MlaConfig();
  config["parallel"]["sequence_parallel"] = true;
  config["model"]["qk_layernorm"] = true;
  config["model"]["make_vocab_size_divisible_by"] = 32;  // 64 entries on either tp size
  const std::string path = WriteTemp("mpusim_mla_run.json", config.dump());
  ExpectDumpDiffsCleanAgainstOneRank(path, 2, "--world-size 1 --tp 1", "mpusim_mla_diff");
}

// explain names MLA's parameters with their tp split and says what the attention is.
TEST(MlaCli, ExplainShowsItsParametersAndAttention) {
  const std::string path = WriteTemp("mpusim_mla_explain.json", MlaConfig().dump());
  const Result r = Mpusim({"explain", path});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* name : {"decoder.layers.0.self_attention.linear_q_down_proj.weight",
                           "decoder.layers.0.self_attention.linear_q_up_proj.weight",
                           "decoder.layers.0.self_attention.linear_kv_down_proj.weight",
                           "decoder.layers.0.self_attention.linear_kv_up_proj.weight",
                           "decoder.layers.0.self_attention.linear_proj.weight",
                           "attention: multi-latent attention"}) {
    EXPECT_NE(r.out.find(name), std::string::npos) << name << "\n" << r.out;
  }
  EXPECT_EQ(r.out.find("linear_qkv"), std::string::npos) << r.out;
}

// `estimate` counts MLA, the CPU executor's activations included (the executor builds it
// now), and `advise` ranks layouts of it.
TEST(MlaCli, EstimateAndAdviseCountIt) {
  const std::string path = WriteTemp("mpusim_mla_estimate.json", MlaConfig().dump());
  const Result estimate = Mpusim({"estimate", path});
  EXPECT_EQ(estimate.code, 0) << estimate.out << estimate.err;
  EXPECT_EQ(estimate.out.find("not counted"), std::string::npos) << estimate.out;
  EXPECT_EQ(estimate.out.find("not estimated"), std::string::npos) << estimate.out;
  const Result advise = Mpusim({"advise", path, "--global-batch-size", "8", "--gpu", "h100-80gb"});
  EXPECT_EQ(advise.code, 0) << advise.err;
}

// Context parallelism with MLA (Transformer Engine's ring here): `mpusim run` on cp 2 in
// float64, dumped, diffs clean against one rank; `estimate` counts it with the CPU
// executor's activations, and cp splits no parameter, so each rank holds what it holds on
// cp 1.
TEST(MlaCli, ContextParallelRunsAndEstimateCountsIt) {
  json config = MlaConfig();
  config["parallel"]["tensor_model_parallel_size"] = 1;
  config["parallel"]["context_parallel_size"] = 2;
  config["model"]["cp_comm_type"] = "p2p";
  const std::string cp2 = WriteTemp("mpusim_mla_cp2.json", config.dump());
  ExpectDumpDiffsCleanAgainstOneRank(cp2, 2, "--world-size 1 --cp 1", "mpusim_mla_cp");

  const Result text = Mpusim({"estimate", cp2});
  ASSERT_EQ(text.code, 0) << text.out << text.err;
  EXPECT_EQ(text.out.find("not counted"), std::string::npos) << text.out;
  config["parallel"]["context_parallel_size"] = 1;
  config["parallel"]["world_size"] = 1;
  const std::string cp1 = WriteTemp("mpusim_mla_cp1.json", config.dump());
  const Result one = Mpusim({"estimate", cp1, "--format", "json"});
  const Result two = Mpusim({"estimate", cp2, "--format", "json"});
  ASSERT_EQ(one.code, 0) << one.err;
  ASSERT_EQ(two.code, 0) << two.err;
  const json x = json::parse(one.out), y = json::parse(two.out);
  ASSERT_EQ(x["stages"].size(), y["stages"].size());
  for (size_t i = 0; i < x["stages"].size(); ++i) {
    EXPECT_GT(x["stages"][i]["memory"]["parameters"].get<int64_t>(), 0);
    EXPECT_EQ(x["stages"][i]["memory"]["parameters"], y["stages"][i]["memory"]["parameters"]);
  }
}

}  // namespace
}  // namespace mpusim::cli
