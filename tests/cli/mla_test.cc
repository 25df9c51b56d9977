// Multi-latent attention at the command line: what is not built yet is refused with one line
// (exit 2) rather than run without it: `mpusim run`, `explain` and `estimate` (which build the
// executor's model) and `advise` (which does not count MLA's latent activations yet).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "tests/cli/cli_test_util.h"

namespace mpusim::cli {
namespace {

using nlohmann::json;
using test_util::ExpectUsageError;
using test_util::Mpiexec;
using test_util::Mpusim;
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

TEST(MlaCli, RunRefusesUntilTheExecutorBuildsIt) {
  const std::string path = WriteTemp("mpusim_mla_run.json", MlaConfig().dump());
  std::string output;
  const int code = Shell(Mpiexec(2) + MPUSIM_BINARY + " run " + path, &output);
  EXPECT_EQ(code, 2) << output;
  const std::string line = "error: " + path +
                           ": model.multi_latent_attention: true is not built in the executor "
                           "yet (run, explain and estimate need it); only the float64 reference "
                           "computes it\n";
  EXPECT_NE(output.find(line), std::string::npos) << output;
  EXPECT_EQ(output.find("error:"), output.rfind("error:")) << output;  // one error line
}

TEST(MlaCli, ExplainEstimateAndAdviseRefuseUntilTheyCountIt) {
  const std::string path = WriteTemp("mpusim_mla_estimate.json", MlaConfig().dump());
  const std::string executor = "error: " + path +
                               ": model.multi_latent_attention: true is not built in the "
                               "executor yet (run, explain and estimate need it); only the "
                               "float64 reference computes it";
  ExpectUsageError(Mpusim({"explain", path}), executor);
  ExpectUsageError(Mpusim({"estimate", path}), executor);
  ExpectUsageError(Mpusim({"advise", path, "--global-batch-size", "8", "--gpu", "h100-80gb"}),
                   "error: " + path +
                       ": model.multi_latent_attention: true is not counted by advise yet "
                       "(MLA's latent activations); set false");
}

}  // namespace
}  // namespace mpusim::cli
