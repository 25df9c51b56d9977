// Uneven pipeline splits from the command line (core/pipeline_split.h): every refusal is one
// error line with exit 2; layout, explain and the estimate follow the split; and runs of one
// GPT under each split key pass their float64 checks and dump the same float64 tensors as
// the even split (mpusim diff at atol 1e-12, rtol 0).
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/config/config.h"
#include "core/estimate/gpu_spec.h"
#include "core/estimate/time_estimate.h"
#include "core/topology.h"
#include "tests/cli/cli_test_util.h"

namespace mpusim::cli {
namespace {

using nlohmann::json;
using namespace test_util;

std::string Tag() { return std::to_string(::getpid()); }

// The uneven sample with `keys` replacing its split keys (and pp, vp when given).
json UnevenSample() { return json::parse(std::ifstream(Sample("gpt_pipeline_uneven_p4_n4.json"))); }

json WithSplit(json config, int64_t pp, const json& keys) {
  json& parallel = config["parallel"];
  parallel.erase("pipeline_model_parallel_layout");
  parallel["pipeline_model_parallel_size"] = pp;
  parallel.update(keys);
  return config;
}

std::string Write(const std::string& name, const json& config) {
  return WriteTemp(fmt::format("mpusim_split_{}.{}.json", name, Tag()), config.dump());
}

TEST(PipelineSplitCli, RefusalsAreOneLineExitTwo) {
  struct Case {
    const char* name;
    int64_t pp;
    json keys;
    const char* line;  // after "error: <file>: "
  };
  const Case cases[] = {
      {"mtp",
       4,
       {{"pipeline_model_parallel_layout", "Et|ttt|ttt|tmL"}},
       "parallel.pipeline_model_parallel_layout: has 1 m (multi-token prediction layers), but "
       "mtp_num_layers is 0 (Megatron's rule: the m's must count to mtp_num_layers; put them on "
       "the last stage, before L, e.g. \"...|tmL\")"},
      {"count",
       4,
       {{"pipeline_model_parallel_layout", "Et|ttt|tt|tL"}},
       "parallel.pipeline_model_parallel_layout: has 7 decoder layers (t), but num_layers is 8; "
       "the t's must count to num_layers"},
      {"stages",
       4,
       {{"pipeline_model_parallel_layout", "Et|ttt|ttttL"}},
       "parallel.pipeline_model_parallel_layout: has 3 stages, not a multiple of "
       "pipeline_model_parallel_size 4 (each pipeline rank holds stages / pp model chunks)"},
      {"mixed",
       4,
       {{"pipeline_model_parallel_layout", "Et|ttt|ttt|tL"},
        {"decoder_first_pipeline_num_layers", 1}},
       "parallel.pipeline_model_parallel_layout: cannot be set with "
       "decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers, "
       "account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split "
       "(Megatron's rule: the layout places every layer itself)"},
      {"middle",
       4,
       {{"decoder_first_pipeline_num_layers", 1}},
       "parallel.decoder_first_pipeline_num_layers: leaves 7 layers, not divisible by the 3 "
       "middle pipeline stages"},
      {"accounted",
       4,
       {{"account_for_embedding_in_pipeline_split", true}},
       "parallel.account_for_embedding_in_pipeline_split: counts the embedding as layers: "
       "num_layers 8 + 1 = 9 is not divisible by pipeline_model_parallel_size 4"},
  };
  for (const Case& c : cases) {
    const std::string path = Write(c.name, WithSplit(UnevenSample(), c.pp, c.keys));
    for (const char* command : {"layout", "estimate", "explain", "schedule"}) {
      SCOPED_TRACE(std::string(c.name) + " " + command);
      const Result r = Mpusim({command, path});
      ExpectUsageError(r, fmt::format("error: {}: {}", path, c.line));
    }
  }
  // advise chooses pp itself: a split tied to one pp is refused, not dropped.
  const std::string sample = Sample("gpt_pipeline_uneven_p4_n4.json");
  ExpectUsageError(Mpusim({"advise", sample, "--global-batch-size", "16"}),
                   fmt::format("error: {}: parallel.pipeline_model_parallel_layout: advise "
                               "searches even pipeline splits only (it chooses "
                               "pipeline_model_parallel_size itself); remove the key, or check "
                               "this split with mpusim estimate",
                               sample));
  // The layer chain keeps its even split.
  const json chain = {{"parallel",
                       {{"world_size", 2},
                        {"pipeline_model_parallel_size", 2},
                        {"decoder_last_pipeline_num_layers", 1}}},
                      {"model",
                       {{"layers",
                         {{{"name", "fc1"},
                           {"type", "ColumnParallelLinear"},
                           {"input_size", 8},
                           {"output_size", 8}},
                          {{"name", "fc2"},
                           {"type", "ColumnParallelLinear"},
                           {"input_size", 8},
                           {"output_size", 8}}}}}},
                      {"run", {{"seq_length", 4}, {"micro_batch_size", 2}}}};
  const std::string path = Write("chain", chain);
  ExpectUsageError(Mpusim({"explain", path}),
                   fmt::format("error: {}: parallel.decoder_last_pipeline_num_layers: the layer "
                               "chain (a model with \"layers\") splits its layers evenly over the "
                               "pipeline stages; uneven splits are for the GPT model (\"type\": "
                               "\"gpt\")",
                               path));
}

// layout prints the split (with parallel.num_layers); explain lists each stage's chunks.
TEST(PipelineSplitCli, LayoutAndExplainShowTheSplit) {
  const Result layout = Mpusim({"layout", "--world-size", "4", "--pp", "4", "--num-layers", "14",
                                "--decoder-first-pipeline-num-layers", "2",
                                "--decoder-last-pipeline-num-layers", "6"});
  ASSERT_EQ(layout.code, 0) << layout.err;
  for (const char* line : {"  pp rank 0: [1, 2]\n", "  pp rank 1: [3, 4, 5]\n",
                           "  pp rank 2: [6, 7, 8]\n", "  pp rank 3: [9, 10, 11, 12, 13, 14]\n"}) {
    EXPECT_NE(layout.out.find(line), std::string::npos) << line << layout.out;
  }
  const Result explain = Mpusim({"explain", Sample("gpt_pipeline_uneven_p4_n4.json")});
  ASSERT_EQ(explain.code, 0) << explain.err;
  for (const char* text : {"pipeline stage 0 of 4: chunks [embedding, layer 0]\n",
                           "pipeline stage 1 of 4: chunks [layers 1-3]\n",
                           "pipeline stage 3 of 4: chunks [layer 7, final norm, "}) {
    EXPECT_NE(explain.out.find(text), std::string::npos) << text << "\n" << explain.out;
  }
  // Megatron's layer-number golden layout: pp rank 0 holds only the embedding and an empty
  // chunk.
  const Result golden = Mpusim({"explain", Sample("gpt_pipeline_uneven_p4_n4.json"),
                                "--pipeline-model-parallel-layout", "E|t|tt|t||t|t|ttL"});
  ASSERT_EQ(golden.code, 0) << golden.err;
  EXPECT_NE(golden.out.find("pipeline stage 0 of 4: chunks [embedding] [no layer: passes its "
                            "input on]\n"),
            std::string::npos)
      << golden.out;
}

// The step-time estimate prices each stage by its own layers: the uneven sample's stages
// (1, 3, 3, 1 layers) against the even split's (2 each) of the same model differ by one
// layer's cost, and the busiest stage (3 layers) makes the step longer.
TEST(PipelineSplitCli, TheTimeEstimatePricesEachStageByItsLayers) {
  const auto estimate = [](const json& document) {
    Config config;
    const Status parsed = ParseConfig(document, &config);
    EXPECT_TRUE(parsed.ok()) << parsed.Message();
    StatusOr<Topology> topology = Topology::Create(config.parallel);
    EXPECT_TRUE(topology.ok());
    StatusOr<TimeEstimate> time = EstimateStepTime(config, *topology, *FindGpuPreset("h100-80gb"));
    EXPECT_TRUE(time.ok()) << time.status().Message();
    return *time;
  };
  const TimeEstimate uneven = estimate(UnevenSample());
  const TimeEstimate even = estimate(WithSplit(UnevenSample(), 4, json::object()));
  ASSERT_EQ(uneven.stages.size(), 4u);
  ASSERT_EQ(even.stages.size(), 4u);
  const auto cost = [](const StageTime& st) { return st.forward_s + st.backward_s; };
  const double layer = cost(uneven.stages[1]) - cost(even.stages[1]);
  EXPECT_GT(layer, 0);
  EXPECT_NEAR(cost(uneven.stages[2]) - cost(even.stages[2]), layer, 1e-12);
  EXPECT_NEAR(cost(even.stages[0]) - cost(uneven.stages[0]), layer, 1e-12);
  EXPECT_NEAR(cost(even.stages[3]) - cost(uneven.stages[3]), layer, 1e-12);
  EXPECT_GT(uneven.step_time_s, even.step_time_s);
}

// Runs `config` on 4 ranks in float64 with its check, dumping to `dir`; its output.
std::string RunAndDump(const std::string& config, const std::filesystem::path& dir) {
  std::filesystem::remove_all(dir);
  std::string output;
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + config + " --dtype float64 --dump " +
                      dir.string(),
                  &output),
            0)
      << config << "\n"
      << output;
  EXPECT_NE(output.find(" passed, 0 failed"), std::string::npos) << config << "\n" << output;
  return output;
}

// Each split key on pp 2 and 4, with and without virtual stages (chunks holding only the
// embedding, only the loss, or nothing among them), against the even split of the same model.
TEST(PipelineSplitCli, EverySplitDiffsCleanAgainstTheEvenSplit) {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  const std::filesystem::path even_dir = tmp / ("mpusim_split_even." + Tag());
  RunAndDump(Write("even", WithSplit(UnevenSample(), 4, json::object())), even_dir);
  struct Case {
    const char* name;
    int64_t pp;
    json keys;
  };
  const Case cases[] = {
      {"layout_p4", 4, {{"pipeline_model_parallel_layout", "Et|ttt|ttt|tL"}}},
      {"layout_p4_v2", 4, {{"pipeline_model_parallel_layout", "E|t|tt|t||t|t|ttL"}}},
      {"first_last_p2_v2",
       2,
       {{"virtual_pipeline_model_parallel_size", 2},
        {"decoder_first_pipeline_num_layers", 2},
        {"decoder_last_pipeline_num_layers", 6}}},
      {"accounted_p2_v5",
       2,
       {{"virtual_pipeline_model_parallel_size", 5},
        {"account_for_embedding_in_pipeline_split", true},
        {"account_for_loss_in_pipeline_split", true}}},
      {"last_p4",
       4,
       {{"decoder_last_pipeline_num_layers", 3}, {"decoder_first_pipeline_num_layers", 3}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    json config = WithSplit(UnevenSample(), c.pp, c.keys);
    // pp 2 on 4 ranks: dp 2, the same global batch.
    config["parallel"]["world_size"] = 4;
    if (c.pp == 2) config["run"]["micro_batch_size"] = 1;
    const std::filesystem::path dir = tmp / fmt::format("mpusim_split_{}.{}", c.name, Tag());
    RunAndDump(Write(c.name, config), dir);
    const Result same =
        Mpusim({"diff", even_dir.string(), dir.string(), "--atol", "1e-12", "--rtol", "0"});
    EXPECT_EQ(same.code, 0) << same.out << same.err;
    EXPECT_NE(same.out.find(" 0 failed"), std::string::npos) << same.out;
    std::filesystem::remove_all(dir);
  }
  std::filesystem::remove_all(even_dir);
}

// With Megatron's RNG tracker a rank's dropout masks depend on the layers its chunks hold
// (each chunk's sites draw in forward order): the float64 reference numbers the draws from
// the same split, so the uneven runs pass their checks with dropout on.
TEST(PipelineSplitCli, RngTrackerDrawsFollowTheSplit) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("mpusim_split_tracker." + Tag());
  for (const auto& [name, pp, keys] :
       {std::tuple<const char*, int64_t, json>{
            "tracker_layout", 4, {{"pipeline_model_parallel_layout", "E|t|tt|t||t|t|ttL"}}},
        std::tuple<const char*, int64_t, json>{"tracker_accounted",
                                               2,
                                               {{"virtual_pipeline_model_parallel_size", 5},
                                                {"account_for_embedding_in_pipeline_split", true},
                                                {"account_for_loss_in_pipeline_split", true}}}}) {
    SCOPED_TRACE(name);
    json config = WithSplit(UnevenSample(), pp, keys);
    config["model"]["dropout_mode"] = "rng_tracker";
    config["model"]["hidden_dropout"] = 0.1;
    config["model"]["attention_dropout"] = 0.1;
    if (pp == 2) config["run"]["micro_batch_size"] = 1;
    RunAndDump(Write(name, config), dir);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mpusim::cli
