// The mpusim command line: golden lines from the MPU lab and Megatron's docs, JSON schema,
// every sample config, and the error contract (one line, exit 2, nothing on stdout).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <sstream>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli.h"
#include "tests/cli/cli_test_util.h"
#include "sim/blas_kernels.h"
#include "tests/sanitizers.h"
#include "core/init.h"
#include "core/dump/safetensors.h"

namespace mpusim::cli {
namespace {

using mpusim::cli::test_util::Result;
using mpusim::cli::test_util::Mpusim;
using mpusim::cli::test_util::Sample;
using mpusim::cli::test_util::WriteTemp;
using mpusim::cli::test_util::ExpectUsageError;

using nlohmann::json;

std::string Golden(const std::string& relative) {
  return std::string(MPUSIM_TEST_DATA_DIR) + "/golden/" + relative;
}

// The command line forgives a newcomer's slips: a misspelt subcommand, flag or GPU name is
// named with the closest one, errors point to the subcommand's own --help, and -V, version
// and --version print the version with the commit and the backends built.
TEST(CommandLine, NamesTheClosestSpellingAndTheSubcommandsHelp) {
  ExpectUsageError(Mpusim({"estmate", "x.json"}),
                   "error: command line: unknown subcommand 'estmate' (did you mean "
                   "'estimate'?); subcommands: layout, schedule, explain, run, reference, diff, "
                   "sweep, estimate, advise, completion, version (run 'mpusim --help' for usage)");
  EXPECT_NE(Mpusim({"layuot"}).err.find("(did you mean 'layout'?)"), std::string::npos);
  ExpectUsageError(Mpusim({"estimate", Sample("gpt_tiny_t2_sp_dp2_n4.json"), "--frmat", "json"}),
                   "error: command line: unexpected arguments '--frmat json'; did you mean "
                   "'--format'? (run 'mpusim estimate --help' for usage)");
  ExpectUsageError(Mpusim({"layout", "--tp"}),
                   "error: command line: --tp: 1 required INT missing (run 'mpusim layout --help' "
                   "for usage)");
  ExpectUsageError(Mpusim({}),
                   "error: command line: no subcommand given; one of: layout, "
                   "schedule, explain, run, reference, diff, sweep, estimate, advise, "
                   "completion, version (run 'mpusim --help' for usage)");
  const Result gpu = Mpusim({"estimate", Sample("gpt_tiny_t2_sp_dp2_n4.json"), "--gpu", "h100"});
  EXPECT_EQ(gpu.code, 2);
  EXPECT_NE(gpu.err.find("; did you mean h100-80gb?"), std::string::npos) << gpu.err;
  for (const char* spelling : {"-V", "--version", "version"}) {
    const Result v = Mpusim({spelling});
    EXPECT_EQ(v.code, 0) << spelling;
    EXPECT_TRUE(v.out.starts_with("mpusim 0.1.0 (git ")) << v.out;
    EXPECT_NE(v.out.find("\nbackends: cpu (Eigen, OpenBLAS, MPI)"), std::string::npos) << v.out;
  }
}

// `mpusim completion bash` is generated from the same definitions the parser reads: bash
// completes subcommands and each one's flags with it.
TEST(CommandLine, BashCompletionCompletesSubcommandsAndFlags) {
  const Result script = Mpusim({"completion", "bash"});
  ASSERT_EQ(script.code, 0) << script.err;
  const std::string path = WriteTemp("mpusim_completion.bash", script.out);
  const auto complete = [&](const std::string& words, int cword) {
    std::string output;
    EXPECT_EQ(test_util::Shell("bash -c 'source " + path + "; COMP_WORDS=(" + words +
                                   "); COMP_CWORD=" + std::to_string(cword) +
                                   "; _mpusim; echo \"${COMPREPLY[*]}\"'",
                               &output),
              0)
        << output;
    return output;
  };
  EXPECT_EQ(complete("mpusim est", 1), "estimate\n");
  EXPECT_EQ(complete("mpusim estimate --for", 2), "--format\n");
  EXPECT_EQ(complete("mpusim run --use-torch", 2), "--use-torch-fsdp2\n");
  EXPECT_EQ(Mpusim({"completion", "zsh"}).code, 2);
}

TEST(LayoutCommand, MpuLabOutput) {
  const Result r = Mpusim({"layout", Sample("lab_t2_p4_n16.json")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  // The derived sizes come first.
  EXPECT_LT(r.out.find("data_parallel_size"), r.out.find("groups:"));
  for (const char* line : {
           "8 data_parallel groups:\n"
           "    [g0, g2], [g1, g3], [g4, g6], [g5, g7], [g8, g10], [g9, g11], [g12, g14], [g13, g15]\n",
           "8 tensor model-parallel groups:\n"
           "    [g0, g1], [g2, g3], [g4, g5], [g6, g7], [g8, g9], [g10, g11], [g12, g13], [g14, g15]\n",
           "4 pipeline model-parallel groups:\n"
           "    [g0, g4, g8, g12], [g1, g5, g9, g13], [g2, g6, g10, g14], [g3, g7, g11, g15]\n",
           "Total :2 full models being partitioned into :16 GPUs",
           "model 0 : is partitioned into gpus :0,1,4,5,8,9,12,13\n",
           "model 1 : is partitioned into gpus :2,3,6,7,10,11,14,15\n",
           "4 embd groups (embedding: first and last pipeline stage):\n"
           "    [g0, g12], [g1, g13], [g2, g14], [g3, g15]\n",
           "  data_parallel_size                         2   derived: 16 / (tp 2 * pp 4 * cp 1)\n",
       }) {
    EXPECT_NE(r.out.find(line), std::string::npos) << "missing:\n" << line << "\nin:\n" << r.out;
  }
  // dp, tp, pp first, in the lab's order.
  EXPECT_LT(r.out.find("data_parallel groups"), r.out.find("tensor model-parallel groups"));
  EXPECT_LT(r.out.find("tensor model-parallel groups"), r.out.find("pipeline model-parallel"));
}

TEST(LayoutCommand, QuickFlagsEqualTheConfigFile) {
  const Result file = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--format", "json"});
  const Result flags = Mpusim({"layout", "--world-size", "16", "--tp", "2", "--pp", "4", "--format",
                            "json"});
  ASSERT_EQ(file.code, 0) << file.err;
  ASSERT_EQ(flags.code, 0) << flags.err;
  json a = json::parse(file.out), b = json::parse(flags.out);
  a.erase("source");
  b.erase("source");
  EXPECT_EQ(a, b);
}

TEST(LayoutCommand, FlagsOverrideTheFile) {
  const Result r = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--tp", "4", "--pp", "2",
                        "--format", "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["sizes"]["tp"], 4);
  EXPECT_EQ(j["sizes"]["pp"], 2);
  EXPECT_EQ(j["groups"]["tp"][0], json({0, 1, 2, 3}));
}

// --format json carries Megatron's groups exactly: compare with the recorded golden files.
TEST(LayoutCommand, JsonMatchesMegatronGolden) {
  for (const char* name : {"classic_tp2_pp4_ws16.json", "cp_tp2_pp2_cp2_dp2_ws16.json",
                           "ep_tp2_pp2_cp1_dp4_ep2_etp1_ws16.json"}) {
    std::ifstream in(Golden(std::string("layouts/") + name));
    const json golden = json::parse(in);
    json parallel = golden["args"];
    parallel["world_size"] = golden["world_size"];
    const std::string path = WriteTemp(name, json{{"parallel", parallel}}.dump());
    const Result r = Mpusim({"layout", path, "--format", "json"});
    ASSERT_EQ(r.code, 0) << r.err;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["schema_version"], 1);
    EXPECT_EQ(j["world_size"], golden["world_size"]);
    EXPECT_EQ(j["groups"], golden["groups"]) << name;
    for (const char* key : {"tp", "pp", "cp", "dp", "ep", "etp", "edp"}) {
      EXPECT_TRUE(j["sizes"].contains(key)) << key;
    }
    // Kinds appear in Megatron's order (the golden file's order).
    std::vector<std::string> ours, theirs;
    const nlohmann::ordered_json ours_ordered = nlohmann::ordered_json::parse(r.out);
    for (const auto& [k, v] : ours_ordered["groups"].items()) ours.push_back(k);
    std::ifstream again(Golden(std::string("layouts/") + name));
    const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(again);
    for (const auto& [k, v] : ordered["groups"].items()) theirs.push_back(k);
    EXPECT_EQ(ours, theirs);
  }
}

TEST(LayoutCommand, OneRank) {
  const Result r = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--rank", "5"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("rank 5: node 0, local GPU 5"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tp 1/2  cp 0/1  dp 0/2  pp 1/4"), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(\n    tp +group 2 of 8, position 1 of 2: \[4, 5\]\n)")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(\n    embd +-  \(this rank has no embd group\))")))
      << r.out;

  const Result j = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--rank", "12", "--format",
                        "json", "--kinds", "pp,embd"});
  ASSERT_EQ(j.code, 0) << j.err;
  const json rank = json::parse(j.out);
  EXPECT_EQ(rank["coordinates"]["pp"], 3);
  EXPECT_EQ(rank["groups"]["pp"]["ranks"], json({0, 4, 8, 12}));
  EXPECT_EQ(rank["groups"]["pp"]["rank_in_group"], 3);
  EXPECT_EQ(rank["groups"]["embd"]["ranks"], json({0, 12}));
  EXPECT_EQ(rank["groups"].size(), 2u);
}

TEST(LayoutCommand, KindsFilterAndPicture) {
  const Result r = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--kinds", "tp,pp"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("8 tensor model-parallel groups"), std::string::npos);
  EXPECT_EQ(r.out.find("data_parallel groups"), std::string::npos);

  const Result p = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--format", "picture"});
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_NE(p.out.find("node   0 | g0 tp0 dp0 pp0  | g1 tp1 dp0 pp0  | g2 tp0 dp1 pp0  |"),
            std::string::npos)
      << p.out;
  EXPECT_NE(p.out.find("node   1 | g8 tp0 dp0 pp2  | g9 tp1 dp0 pp2  | g10 tp0 dp1 pp2 |"),
            std::string::npos)
      << p.out;
}

TEST(LayoutCommand, MaxGroupsTruncatesText) {
  const Result r = Mpusim({"layout", Sample("gpt3_175b_t8_p16_n1024.json"), "--kinds", "tp",
                        "--max-groups", "3"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("128 tensor model-parallel groups:\n"
                       "    [g0, g1, g2, g3, g4, g5, g6, g7], [g8, g9, g10, g11, g12, g13, g14, g15],"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("... 125 more (--max-groups 0 shows all)"), std::string::npos) << r.out;
}

TEST(LayoutCommand, WarnsWhenTensorGroupsLeaveANode) {
  const Result r = Mpusim({"layout", Sample("multinode_tp16_gpn8_n32.json"), "--kinds", "tp"});
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.err.find("warning: 2 of 2 tp groups (size 16) span nodes with gpus_per_node 8"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("groups that span nodes:   tp 2/2"), std::string::npos) << r.out;
  // The dense expert layout (ep 1, etp = tp) has tp's groups as expt_tp: one warning, not two.
  EXPECT_EQ(r.err.find("expt_tp"), std::string::npos) << r.err;
  const Result lab = Mpusim({"layout", Sample("lab_t2_p4_n16.json")});
  EXPECT_EQ(lab.err, "");
}

// --sweep: every tp x pp x cp x dp of 16 ranks: the ordered factorisations of 2^4 into four
// factors, C(4 + 3, 3) = 35; MoE's expert sizes refuse some of them.
TEST(LayoutCommand, SweepListsEveryFactorisation) {
  const Result r = Mpusim({"layout", "--sweep", "--world-size", "16", "--gpus-per-node", "8"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("layouts of 16 ranks (order tp-cp-ep-dp-pp, gpus_per_node 8): 35 valid\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\n     2    4    1    2          8         4         8  -\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("    16    1    1    1          1        16        16  1 of 1\n"),
            std::string::npos)
      << r.out;
  const Result json_out = Mpusim({"layout", "--sweep", "--world-size", "16", "--format", "json"});
  ASSERT_EQ(json_out.code, 0) << json_out.err;
  EXPECT_EQ(json::parse(json_out.out)["layouts"].size(), 35u);
  const Result moe = Mpusim({"layout", Sample("moe_t2_p2_ep4_etp1_n16.json"), "--sweep"});
  EXPECT_NE(moe.out.find("22 valid, 13 refused by the config's other keys"), std::string::npos)
      << moe.out;
  ExpectUsageError(Mpusim({"layout", "--sweep", "--world-size", "16", "--rank", "3"}),
                   "error: command line: --sweep: lists layouts; it takes --format text or json, "
                   "not --rank, --kinds or --format picture or html");
}

TEST(LayoutCommand, VirtualPipelineLayerAssignment) {
  const Result r = Mpusim({"layout", Sample("virtual_pipeline_t1_p4_v2_n4.json"), "--kinds", "pp"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("  pp rank 0: [1, 2] [9, 10]\n"
                       "  pp rank 1: [3, 4] [11, 12]\n"
                       "  pp rank 2: [5, 6] [13, 14]\n"
                       "  pp rank 3: [7, 8] [15, 16]\n"),
            std::string::npos)
      << r.out;
}

TEST(LayoutCommand, BadInputIsOneLineAndExitTwo) {
  ExpectUsageError(Mpusim({"layout", "/nonexistent/x.json"}),
                   "error: /nonexistent/x.json: cannot open the file (does it exist and is it "
                   "readable?)");
  const std::string typo = WriteTemp(
      "mpusim_typo.json", R"({"parallel": {"world_size": 16, "tensor_parallel_size": 2}})");
  ExpectUsageError(Mpusim({"layout", typo}),
                   "error: " + typo + ": parallel.tensor_parallel_size: unknown key; did you mean "
                   "'tensor_model_parallel_size'?");
  const std::string broken = WriteTemp("mpusim_broken.json", "{\"parallel\": {\"world_size\": 16,}}");
  const Result b = Mpusim({"layout", broken});
  EXPECT_EQ(b.code, 2);
  EXPECT_EQ(b.out, "");
  EXPECT_EQ(b.err.rfind("error: " + broken + ": line 1, column 32: invalid JSON: ", 0), 0u)
      << b.err;
  ExpectUsageError(Mpusim({"layout", "--world-size", "16", "--tp", "3"}),
                   "error: command line: --world-size: 16 is not divisible by "
                   "tensor_model_parallel_size * pipeline_model_parallel_size * "
                   "context_parallel_size = 3 * 1 * 1");
  ExpectUsageError(Mpusim({"layout", "--world-size", "16", "--tp", "two"}),
                   "error: command line: --tp: must be an integer, got 'two'");
  ExpectUsageError(Mpusim({"layout", "--world-size", "16", "--tp", "0"}),
                   "error: command line: --tp: must be an integer >= 1, got 0");
  ExpectUsageError(Mpusim({"layout", "--world-size", "8", "--order", "tp-dp-xx"}),
                   "error: command line: --order: 'tp-dp-xx' has unknown axis 'xx'; use tp, cp, "
                   "ep, dp and pp joined by '-', e.g. \"tp-cp-ep-dp-pp\"");
  ExpectUsageError(Mpusim({"layout", "--tp", "2"}),
                   "error: command line: CONFIG: give a config file (e.g. mpusim layout "
                   "sample_configs/gpt_tiny_t2_sp_dp2_n4.json), or --world-size with quick flags "
                   "(e.g. mpusim layout --world-size 16 --tp 2 --pp 4)");
  ExpectUsageError(Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--rank", "16"}),
                   "error: command line: --rank: 16 is not in this layout; ranks are 0..15");
  ExpectUsageError(Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--kinds", "tp,dp_cpp"}),
                   "error: command line: --kinds: unknown kind 'dp_cpp' (did you mean 'dp_cp'?); kinds "
                   "of this layout: tp, pp, dp, dp_cp, dp_cp_partial, cp, mp, embd, pos_embd, "
                   "tp_dp, tp_dp_cp, tp_cp, ep, expt_tp, tp_ep, tp_ep_pp, expt_dp, "
                   "expt_dp_partial, intra_dist_opt");
  ExpectUsageError(Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--kinds", "inter_dist_opt"}),
                   "error: command line: --kinds: 'inter_dist_opt' is not built for this layout: "
                   "it needs num_distributed_optimizer_instances > 1");
  const Result format = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--format", "yaml"});
  EXPECT_EQ(format.code, 2);
  EXPECT_EQ(format.out, "");
  EXPECT_EQ(format.err.rfind("error: command line: --format: ", 0), 0u) << format.err;
  EXPECT_EQ(std::count(format.err.begin(), format.err.end(), '\n'), 1);
  const Result unknown = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--bogus"});
  EXPECT_EQ(unknown.code, 2);
  EXPECT_EQ(std::count(unknown.err.begin(), unknown.err.end(), '\n'), 1) << unknown.err;
}

TEST(ScheduleCommand, DocumentationExamples) {
  // ModelParallelConfig.microbatch_group_size_per_vp_stage: PP=2, VP=2.
  const Result a = Mpusim({"schedule", Sample("interleaved_schedule_p2_v2_n2.json"),
                        "--microbatches", "4"});
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_NE(a.out.find("rank 0 | 0 1 0 1 2 3 2 3\nrank 1 | 0 1 0 1 2 3 2 3\n"),
            std::string::npos)
      << a.out;
  const Result b = Mpusim({"schedule", Sample("interleaved_schedule_p2_v2_n2.json"),
                        "--microbatches", "5", "--microbatch-group-size", "3"});
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_NE(b.out.find("rank 0 | 0 1 2 0 1 2 3 4 3 4\nrank 1 | 0 1 2 0 1 2 3 4 3 4\n"),
            std::string::npos)
      << b.out;
}

TEST(ScheduleCommand, JsonMatchesMegatronGolden) {
  std::ifstream in(Golden("schedules/docs_examples.json"));
  const json golden = json::parse(in);
  for (const json& c : golden["cases"]) {
    const Result r = Mpusim({"schedule", "--world-size", std::to_string(c["pp"].get<int>()), "--pp",
                          std::to_string(c["pp"].get<int>()), "--vp",
                          std::to_string(c["vp"].get<int>()), "--microbatch-group-size",
                          std::to_string(c["microbatch_group_size_per_vp_stage"].get<int>()),
                          "--microbatches", std::to_string(c["num_microbatches"].get<int>()),
                          "--format", "json"});
    ASSERT_EQ(r.code, 0) << r.err;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["schema_version"], 1);
    EXPECT_EQ(j["ranks"], c["per_rank_compute"]);
    EXPECT_EQ(j["microbatch_id_sequence"], c["microbatch_id_sequence"]);
    EXPECT_EQ(j["model_chunk_id_sequence"], c["model_chunk_id_sequence"]);
  }
}

TEST(ScheduleCommand, BadInput) {
  ExpectUsageError(Mpusim({"schedule", Sample("interleaved_schedule_p2_v2_n2.json"), "--microbatches",
                        "3", "--microbatch-group-size", "4"}),
                   "error: command line: --microbatch-group-size: must be in [p, M] = [2, 3], "
                   "got 4");
  const Result missing = Mpusim({"schedule", Sample("lab_t2_p4_n16.json")});
  EXPECT_EQ(missing.code, 2);
  EXPECT_EQ(missing.err,
            "error: command line: --microbatches: is required (or a config with a run "
            "section's num_microbatches)\n");
  // A config with a run section gives the default.
  const Result from_run = Mpusim({"schedule", Sample("gpt_pipeline_p4_v2_n4.json")});
  EXPECT_EQ(from_run.code, 0) << from_run.err;
  EXPECT_NE(from_run.out.find("num_microbatches 8,"), std::string::npos) << from_run.out;
  // The idealised timing: the bubble of Megatron's formula, the stashes per rank.
  EXPECT_NE(
      from_run.out.find("most micro-batches in flight per rank (activation stashes): 11 9 7 5\n"
                        "with forward 1 and backward 2 time units and free communication: "
                        "57 units, bubble 0.158 of the ranks' time ((p - 1) / (v M + p - 1) "
                        "= 0.158;"),
      std::string::npos)
      << from_run.out;
  // --format svg: a box per step (4 ranks x 2 M v).
  const Result svg = Mpusim({"schedule", Sample("gpt_pipeline_p4_v2_n4.json"), "--format", "svg"});
  ASSERT_EQ(svg.code, 0) << svg.err;
  EXPECT_EQ(svg.out.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_TRUE(svg.out.ends_with("</svg>\n"));
  size_t boxes = 0;
  for (size_t at = svg.out.find("<g><title>"); at != std::string::npos;
       at = svg.out.find("<g><title>", at + 1)) {
    ++boxes;
  }
  EXPECT_EQ(boxes, 4u * 2 * 8 * 2);
  EXPECT_NE(svg.out.find("<title>rank 3 backward chunk 1 micro-batch 7: "), std::string::npos);
  // A step's tooltip names its receive and send; a line per message (each of M micro-batches
  // crosses p v - 1 stage boundaries forward and back), never running back in time.
  const size_t title = svg.out.find("<title>rank 1 forward chunk 0 micro-batch 1: ");
  ASSERT_NE(title, std::string::npos);
  EXPECT_NE(svg.out.substr(title, svg.out.find("</title>", title) - title)
                .find("; recv activation c0.m1 from 0; send activation c0.m1 to 2 (async)"),
            std::string::npos)
      << svg.out.substr(title, 200);
  const std::regex line_re("<line class=\"message\" x1=\"([0-9.]+)\" y1=\"[0-9.]+\" x2=\"([0-9.]+)\"");
  size_t lines = 0;
  for (auto it = std::sregex_iterator(svg.out.begin(), svg.out.end(), line_re);
       it != std::sregex_iterator(); ++it, ++lines) {
    EXPECT_LE(std::stod((*it)[1]), std::stod((*it)[2]) + 1e-9) << (*it)[0];
  }
  EXPECT_EQ(lines, 2u * 8 * (4 * 2 - 1));
  // Each row's peak of micro-batches in flight, as the text gives them (11 9 7 5).
  const std::regex peak_re(">peak ([0-9]+)</text>");
  std::vector<std::string> peaks;
  for (auto it = std::sregex_iterator(svg.out.begin(), svg.out.end(), peak_re);
       it != std::sregex_iterator(); ++it) {
    peaks.push_back((*it)[1]);
  }
  EXPECT_EQ(peaks, (std::vector<std::string>{"11", "9", "7", "5"}));
  // --transfers: each step's batch as the executor posts it.
  const Result moves = Mpusim({"schedule", Sample("interleaved_schedule_p2_v2_n2.json"),
                               "--microbatches", "4", "--transfers"});
  ASSERT_EQ(moves.code, 0) << moves.err;
  for (const char* expected :
       {"rank 1\n  F0.0  recv activation c0.m0 from 0\n  F0.1  send activation c1.m0 to 0 "
        "(async); recv activation c0.m1 from 0\n",
        "  B0.3  send gradient c0.m2 to 0 (async); recv gradient c0.m3 from 0\n  end   send "
        "gradient c0.m3 to 0 (async)\n"}) {
    EXPECT_NE(moves.out.find(expected), std::string::npos) << expected << "\n" << moves.out;
  }
  // The same plan in JSON: per rank one action per step, then the final wait.
  const Result moves_json = Mpusim({"schedule", Sample("interleaved_schedule_p2_v2_n2.json"),
                                    "--microbatches", "4", "--transfers", "--format", "json"});
  ASSERT_EQ(moves_json.code, 0) << moves_json.err;
  const json plan = json::parse(moves_json.out)["transfers"]["1"];
  ASSERT_EQ(plan.size(), 2u * 4 * 2 + 1);
  EXPECT_EQ(plan[1]["step"], "F0.1");
  EXPECT_EQ(plan[1]["transfers"],
            json::array({"send activation c1.m0 to 0 (async)", "recv activation c0.m1 from 0"}));
  EXPECT_EQ(plan.back()["step"], "end");
  EXPECT_EQ(plan.back()["transfers"], json::array({"send gradient c0.m3 to 0 (async)"}));
  const Result zero = Mpusim({"schedule", Sample("lab_t2_p4_n16.json"), "--microbatches", "0"});
  EXPECT_EQ(zero.code, 2);
  EXPECT_EQ(zero.err.rfind("error: command line: --microbatches: ", 0), 0u) << zero.err;
}

// Every shipped sample config loads, plans, and prints in every format.
TEST(SampleConfigs, EveryOneLoadsAndPlans) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(MPUSIM_SAMPLE_CONFIG_DIR)) {
    if (entry.path().extension() != ".json") continue;
    ++count;
    for (const char* format : {"text", "json", "picture", "html"}) {
      const Result r = Mpusim({"layout", entry.path().string(), "--format", format});
      EXPECT_EQ(r.code, 0) << entry.path() << ": " << r.err;
      EXPECT_FALSE(r.out.empty());
      if (std::string(format) == "json") {
        EXPECT_EQ(json::parse(r.out)["schema_version"], 1);
      }
    }
  }
  EXPECT_GE(count, 5);
}

// The layout page: one self-contained HTML file (nothing fetched: no URL, no src or href
// attribute) whose embedded data is the JSON report's groups plus every rank's coordinates;
// the GPT-3 layout of 1024 ranks stays small.
// The JSON a page embeds in <script id="ID" type="application/json">; null when absent.
json EmbeddedJson(const std::string& page, const std::string& id) {
  const std::string open = "<script id=\"" + id + "\" type=\"application/json\">";
  const size_t begin = page.find(open);
  if (begin == std::string::npos) return nullptr;
  const size_t end = page.find("</script>", begin);
  return json::parse(page.substr(begin + open.size(), end - begin - open.size()));
}

// A page fetches nothing: no links, sources or imports.
void ExpectSelfContained(const std::string& page) {
  EXPECT_EQ(page.rfind("<!DOCTYPE html>", 0), 0u);
  for (const char* outside : {"http:", "https:", "src=", "href=", "@import", "url("}) {
    EXPECT_EQ(page.find(outside), std::string::npos) << outside;
  }
}

// Runs `args` with --format html and with --format json; the page must be self-contained and
// embed exactly the JSON report as <script id="ID">. Returns the report (null on a failure)
// and the page in `page`.
json PageEmbedsItsJson(const std::vector<std::string>& args, const std::string& id,
                       Result* page) {
  std::vector<std::string> html_args = args, json_args = args;
  html_args.insert(html_args.end(), {"--format", "html"});
  json_args.insert(json_args.end(), {"--format", "json"});
  *page = Mpusim(html_args);
  const Result report = Mpusim(json_args);
  EXPECT_EQ(page->code, 0) << page->err;
  EXPECT_EQ(report.code, 0) << report.err;
  if (page->code != 0 || report.code != 0) return nullptr;
  ExpectSelfContained(page->out);
  const json expected = json::parse(report.out);
  EXPECT_EQ(EmbeddedJson(page->out, id), expected);
  return expected;
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(LayoutPage, SelfContainedWithTheReportsGroups) {
  const Result page = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--format", "html"});
  ASSERT_EQ(page.code, 0) << page.err;
  ExpectSelfContained(page.out);
  const json data = EmbeddedJson(page.out, "layout");
  ASSERT_TRUE(data.is_object());
  const Result report = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--format", "json"});
  ASSERT_EQ(report.code, 0);
  EXPECT_EQ(data["groups"], json::parse(report.out)["groups"]);
  ASSERT_EQ(data["coordinates"].size(), 16u);
  // Rank 5: node 0, GPU 5, tp 1, cp 0, dp 0, pp 1 (the lab's t = 2, p = 4 layout).
  EXPECT_EQ(data["coordinates"][5], json::parse("[0, 5, 1, 0, 0, 1, 1, 0, 0]"));
  EXPECT_EQ(page.out.find("<p class=\"warning\">"), std::string::npos);
  // pp 4: the schedule's picture below the GPUs (8 micro-batches, 2 per stage, without a run
  // section), as `mpusim schedule --format svg` draws it but without the SVG namespace URL.
  EXPECT_NE(page.out.find("<h2>pipeline schedule, 8 micro-batches"), std::string::npos);
  EXPECT_NE(page.out.find("<svg viewBox="), std::string::npos);
  const Result flat = Mpusim({"layout", "--world-size", "4", "--tp", "2", "--format", "html"});
  ASSERT_EQ(flat.code, 0) << flat.err;
  EXPECT_EQ(flat.out.find("<svg"), std::string::npos);
  const Result big = Mpusim({"layout", Sample("gpt3_175b_t8_p16_n1024.json"), "--format", "html"});
  ASSERT_EQ(big.code, 0) << big.err;
  EXPECT_LT(big.out.size(), 1u << 20);
  const Result warned =
      Mpusim({"layout", Sample("multinode_tp16_gpn8_n32.json"), "--format", "html"});
  ASSERT_EQ(warned.code, 0) << warned.err;
  EXPECT_NE(warned.out.find("<p class=\"warning\">warning: "), std::string::npos);
  const Result one =
      Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--format", "html", "--rank", "3"});
  EXPECT_EQ(one.code, 2);
  EXPECT_EQ(one.out, "");
}

TEST(Binary, HelpAndExitCodes) {
  const std::string binary = MPUSIM_BINARY;
  auto status = [](const std::string& command) {
    const int raw = std::system((command + " > /dev/null 2>&1").c_str());
    return WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  };
  EXPECT_EQ(status(binary + " --help"), 0);
  EXPECT_EQ(status(binary + " layout --help"), 0);
  EXPECT_EQ(status(binary + " layout " + Sample("lab_t2_p4_n16.json")), 0);
  EXPECT_EQ(status(binary + " layout /nonexistent.json"), 2);
  EXPECT_EQ(status(binary), 2);
  const Result help = Mpusim({"layout", "--help"});
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("--tp"), std::string::npos);
  EXPECT_NE(help.out.find("--format"), std::string::npos);
}

// ---------------------------------------------------------------------------------------
// mpusim run and mpusim explain (the run tests launch the real binary under mpiexec).

namespace run_tests {

using test_util::Mpiexec;
using test_util::Shell;

// The complete ("X") events of one trace thread must nest (each inside the open one or after
// it ends): Perfetto and chrome://tracing draw overlapping ones wrongly or drop them. Returns
// the first violation, "" when none; async spans ("b"/"e") must pair up.
std::string TraceNestingError(const nlohmann::json& trace) {
  std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<double, double>>> threads;
  std::map<std::string, int> open;
  for (const nlohmann::json& e : trace.at("traceEvents")) {
    const std::string ph = e.at("ph");
    if (ph == "X") {
      const double ts = e.at("ts"), dur = e.at("dur");
      if (dur < 0) return fmt::format("{}: negative duration", e.dump());
      threads[{e.at("pid"), e.at("tid")}].push_back({ts, ts + dur});
    } else if (ph == "b") {
      ++open[e.at("id").get<std::string>()];
    } else if (ph == "e" && --open[e.at("id").get<std::string>()] < 0) {
      return fmt::format("{}: ends a span that never began", e.dump());
    }
  }
  for (const auto& [id, count] : open) {
    if (count != 0) return fmt::format("async span {} begins {} more times than it ends", id, count);
  }
  constexpr double kSlack = 1e-3;  // microseconds: the JSON's rounding
  for (auto& [thread, spans] : threads) {
    std::sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first < b.first : a.second > b.second;
    });
    std::vector<double> ends;  // the open spans' ends, innermost last
    for (const auto& [begin, end] : spans) {
      while (!ends.empty() && ends.back() <= begin + kSlack) ends.pop_back();
      if (!ends.empty() && end > ends.back() + kSlack) {
        return fmt::format("pid {} tid {}: [{}, {}] overlaps the span ending at {} partly",
                           thread.first, thread.second, begin, end, ends.back());
      }
      ends.push_back(end);
    }
  }
  return "";
}

// A training run says each iteration as it ends, before the report (which waits for the
// reference check), names every file it writes, and a --no-check summary says it checked
// nothing ("checked" false, "passed" null).
TEST(RunCommand, TrainingStreamsItsIterationsAndNamesItsFiles) {
  namespace fs = std::filesystem;
  const fs::path tmp = fs::temp_directory_path() / fmt::format("mpusim_stream.{}", ::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  const std::string summary = (tmp / "s.json").string(), trace = (tmp / "t.json").string();
  std::string output;
  ASSERT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + Sample("lab_train_mlp_lm_t2_dp2_n4.json") +
                      " --train-iters 3 --summary " + summary + " --trace " + trace,
                  &output),
            0)
      << output;
  const size_t first = output.find("iteration 1 of 3: loss ");
  const size_t third = output.find("iteration 3 of 3: loss ");
  const size_t header = output.find("mpusim run: ");
  ASSERT_NE(first, std::string::npos) << output;
  ASSERT_NE(third, std::string::npos) << output;
  EXPECT_LT(first, third);
  EXPECT_LT(third, header) << output;
  EXPECT_NE(output.find("\nsummary: " + summary + "\n"), std::string::npos) << output;
  EXPECT_NE(output.find("\ntrace: " + trace +
                        " (Chrome trace events: open it in "
                        "ui.perfetto.dev)\n"),
            std::string::npos)
      << output;
  std::ifstream in(summary);
  const json checked = json::parse(in);
  EXPECT_EQ(checked["checked"], true);
  EXPECT_EQ(checked["passed"], true);
  ASSERT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + Sample("lab_train_mlp_lm_t2_dp2_n4.json") +
                      " --train-iters 1 --no-check --summary " + summary,
                  &output),
            0)
      << output;
  EXPECT_EQ(output.find("iteration 1 of 1"), std::string::npos) << output;  // one: no stream
  std::ifstream again(summary);
  const json unchecked = json::parse(again);
  EXPECT_EQ(unchecked["checked"], false);
  EXPECT_TRUE(unchecked["passed"].is_null());
  fs::remove_all(tmp);
}

TEST(RunCommand, TraceEventsNestOnEverySample) {
  namespace fs = std::filesystem;
  const fs::path trace = fs::temp_directory_path() / fmt::format("mpusim_nest.{}.json", ::getpid());
  int traced = 0;
  for (const auto& entry : fs::directory_iterator(MPUSIM_SAMPLE_CONFIG_DIR)) {
    if (entry.path().extension() != ".json") continue;
    std::ifstream in(entry.path());
    const nlohmann::json config = nlohmann::json::parse(in);
    if (!config.contains("model") || !config.contains("run")) continue;
    const int ranks = config.at("parallel").at("world_size");
    if (ranks > 8) continue;
    std::string output;
    ASSERT_EQ(Shell(Mpiexec(ranks) + MPUSIM_BINARY + " run " + entry.path().string() +
                        " --no-check --trace " + trace.string(),
                    &output),
              0)
        << entry.path() << output;
    std::ifstream written(trace);
    const nlohmann::json events = nlohmann::json::parse(written);
    EXPECT_EQ(TraceNestingError(events), "") << entry.path();
    EXPECT_EQ(events.at("otherData").at("ranks"), ranks) << entry.path();
    // Rank 0's row names every coordinate its layout has: cp and ep where they split.
    const nlohmann::json& parallel = config.at("parallel");
    const auto size = [&](const char* key) { return parallel.value(key, int64_t{1}); };
    for (const nlohmann::json& e : events.at("traceEvents")) {
      if (e.value("name", "") != "thread_name" || e.at("tid") != 0) continue;
      const std::string name = e.at("args").at("name");
      EXPECT_TRUE(name.starts_with("rank 0 (tp 0, ")) << name;
      EXPECT_EQ(name.find(", cp 0") != std::string::npos, size("context_parallel_size") > 1)
          << entry.path() << ": " << name;
      EXPECT_EQ(name.find(", ep 0") != std::string::npos, size("expert_model_parallel_size") > 1)
          << entry.path() << ": " << name;
    }
    ++traced;
  }
  EXPECT_GE(traced, 10);
  fs::remove(trace);
  // The checker itself: a partial overlap on one thread is caught, nesting and equal spans pass.
  const auto thread = [](std::vector<std::pair<double, double>> spans) {
    nlohmann::json events = nlohmann::json::array();
    for (const auto& [ts, dur] : spans) {
      events.push_back({{"ph", "X"}, {"ts", ts}, {"dur", dur}, {"pid", 0}, {"tid", 0}});
    }
    return nlohmann::json{{"traceEvents", events}};
  };
  EXPECT_EQ(TraceNestingError(thread({{0, 10}, {2, 3}, {5, 5}, {5, 5}, {12, 1}})), "");
  EXPECT_NE(TraceNestingError(thread({{0, 10}, {5, 10}})), "");
}

TEST(RunCommand, LabRunPassesAndDumpsReassemblableTensors) {
  const std::filesystem::path dump =
      std::filesystem::temp_directory_path() / fmt::format("mpusim_cli_dump.{}", ::getpid());
  std::filesystem::remove_all(dump);
  std::string output;
  const int code = Shell(Mpiexec(2) + MPUSIM_BINARY + " run " +
                             Sample("lab_parallel_embedding_t2_n2.json") + " --dump " +
                             dump.string(),
                         &output);
  ASSERT_EQ(code, 0) << output;
  for (const char* line : {"check against the float64 reference", " passed, 0 failed",
                           "collectives on rank 0", "forward   fc2", "all-reduce",
                           "backward  fc1"}) {
    EXPECT_NE(output.find(line), std::string::npos) << line << "\n" << output;
  }
  // manifest + one safetensors file per rank; the weight shards reassemble into the master
  // weight that any layout starts from.
  std::ifstream manifest_in(dump / "manifest.json");
  ASSERT_TRUE(manifest_in);
  const json manifest = json::parse(manifest_in);
  EXPECT_EQ(manifest["schema_version"], 2);
  EXPECT_EQ(manifest["world_size"], 2);
  EXPECT_EQ(manifest["files"], json({"rank00000.safetensors", "rank00001.safetensors"}));
  std::vector<Tensor> shards;
  std::vector<ShardSpec> specs;
  for (int rank = 0; rank < 2; ++rank) {
    StatusOr<SafetensorsFile> file =
        ReadSafetensors((dump / fmt::format("rank{:05d}.safetensors", rank)).string());
    ASSERT_TRUE(file.ok()) << file.status().Message();
    const json meta = json::parse(file->metadata.at("fc1.weight"));
    EXPECT_EQ(meta["full_shape"], json({256, 64}));
    EXPECT_EQ(meta["placements"],
              json::parse(fmt::format(
                  R"([{{"axis":"tp","dim":0,"shards":2,"index":{},"stride":1}}])", rank)));
    ShardSpec spec;
    spec.Split(ShardAxis::kTp, meta["placements"][0]["dim"], meta["placements"][0]["shards"],
               meta["placements"][0]["index"], meta["placements"][0]["stride"]);
    for (const NamedTensor& t : file->tensors) {
      if (t.name == "fc1.weight") shards.push_back(t.tensor);
    }
    specs.push_back(spec);
  }
  ASSERT_EQ(shards.size(), 2u);
  StatusOr<Tensor> full = AssembleFull(shards, specs, {256, 64});
  ASSERT_TRUE(full.ok()) << full.status().Message();
  for (int64_t i : {0L, 64L * 130 + 7, 256L * 64 - 1}) {
    EXPECT_EQ(full->data_as<float>()[i],
              static_cast<float>(MasterValue(7, "fc1.weight", InitSpec{}, {256, 64}, i)));
  }
}

TEST(RunCommand, WorldSizeMismatchAndBadInput) {
  std::string output;
  EXPECT_EQ(Shell(Mpiexec(1) + MPUSIM_BINARY + " run " +
                      Sample("lab_parallel_embedding_t2_n2.json"),
                  &output),
            2);
  // The hint adds --oversubscribe when this machine has fewer cores than the ranks.
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  EXPECT_NE(output.find(fmt::format("parallel.world_size: the config needs 2 ranks but mpirun "
                                    "started 1; run: mpirun -n 2{} mpusim run",
                                    cores < 2 ? " --oversubscribe" : "")),
            std::string::npos)
      << output;
  EXPECT_EQ(
      Shell(Mpiexec(1) + MPUSIM_BINARY + " run " + Sample("lab_mlp_lm_t4_dp2_n8.json"), &output),
      2);
  EXPECT_NE(output.find(
                fmt::format("run: mpirun -n 8{} mpusim run", cores < 8 ? " --oversubscribe" : "")),
            std::string::npos)
      << output;
  // A layout config without a model is refused by run, with exit 2 and one error line.
  EXPECT_EQ(Shell(Mpiexec(1) + MPUSIM_BINARY + " run " + Sample("lab_t2_p4_n16.json"), &output),
            2);
  EXPECT_NE(output.find("model: is required by mpusim run"), std::string::npos) << output;
  // --cp-comm-type takes Megatron's four names; a layout "a2a" cannot split is refused with
  // the reason, before any rank starts.
  const std::string cp = Sample("gpt_context_parallel_cp2_t2_n4.json");
  Result flag = Mpusim({"run", cp, "--cp-comm-type", "bogus"});
  EXPECT_EQ(flag.code, 2);
  EXPECT_EQ(flag.out, "");
  EXPECT_EQ(flag.err,
            "error: command line: --cp-comm-type: bogus not in "
            "{p2p,all_gather,a2a,a2a+p2p} (run 'mpusim run --help' for usage)\n");
  flag = Mpusim({"run", cp, "--cp-comm-type", "a2a", "--tp", "4", "--world-size", "8"});
  EXPECT_EQ(flag.code, 2);
  EXPECT_EQ(flag.out, "");
  EXPECT_NE(flag.err.find("num_query_groups 4 must be divisible by tensor_model_parallel_size * "
                          "context_parallel_size = 8"),
            std::string::npos)
      << flag.err;
  // explain names itself, from a file or from flags alone, with one line and nothing on stdout.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"explain", Sample("lab_t2_p4_n16.json")},
        std::vector<std::string>{"explain", "--tp", "2", "--world-size", "2"}}) {
    const Result explain = Mpusim(args);
    EXPECT_EQ(explain.code, 2);
    EXPECT_EQ(explain.out, "");
    EXPECT_NE(explain.err.find(": model: is required by mpusim explain"), std::string::npos)
        << explain.err;
    EXPECT_EQ(std::count(explain.err.begin(), explain.err.end(), '\n'), 1) << explain.err;
  }
}

// GPT-3 175B on 1024 GPUs (tp 8, pp 16, dp 8; fp16, Adam): each stage's busiest rank holds
// what Megatron's parameter shapes give in closed form, in the 16 bytes per parameter of
// mixed-precision Adam (ZeRO's 2 + 2 + 12: Megatron keeps an fp16 run's main_grad in fp16). Per
// layer and tp rank: the qkv, proj, fc1 and fc2 weights (12 h^2 / t), their split biases (3h + 4h)
// / t, and the replicated proj and fc2 biases and two layer norms (6h); the first stage adds the
// word embeddings' shard (V / t) and the learned positions (2048 x h), the last the final norm and
// the tied copy of the word embeddings.
TEST(EstimateCommand, Gpt3On1024GpusMatchesTheClosedForm) {
  const Result r = Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"), "--format", "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json doc = json::parse(r.out);
  const uint64_t h = 12288, t = 8, layers = 6, vocab = 51200, positions = 2048, dp = 8;
  const uint64_t layer = (12 * h * h + 7 * h) / t + 6 * h;
  ASSERT_EQ(doc.at("stages").size(), 16u);
  EXPECT_EQ(doc.at("dtype"), "float16");
  EXPECT_EQ(doc.at("use_distributed_optimizer"), false);
  for (const json& stage : doc.at("stages")) {
    const uint64_t s = stage.at("stage");
    uint64_t elements = layers * layer;
    if (s == 0) elements += vocab * h / t + positions * h;
    if (s == 15) elements += 2 * h + vocab * h / t;
    EXPECT_EQ(stage.at("parameter_elements"), elements) << "stage " << s;
    EXPECT_EQ(stage.at("rank"), s * 64) << "stage " << s;
    const json& memory = stage.at("memory");
    EXPECT_EQ(memory.at("parameters"), 2 * elements);
    EXPECT_EQ(memory.at("gradients"), 2 * elements);   // fp16 main_grad
    EXPECT_EQ(memory.at("optimizer"), 12 * elements);  // fp32 master, exp_avg, exp_avg_sq
    EXPECT_EQ(memory.at("held"), 16 * elements);
    // The distributed optimizer keeps the first of 8 equal pieces of the padded buffer.
    EXPECT_EQ(stage.at("optimizer_if_distributed"), 12 * ((elements + dp - 1) / dp));
  }
  // The middle stages hold 6 layers of 1.36 billion parameters' shards: 21.7 GB.
  EXPECT_EQ(doc.at("stages")[7].at("memory").at("held"), 16 * layers * layer);
  EXPECT_EQ(doc.at("main_grad_dtype"), "float16");
  // accumulate_allreduce_grads_in_fp32: a float32 main_grad, 18 bytes per parameter.
  const Result fp32 = Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"),
                              "--accumulate-allreduce-grads-in-fp32", "true", "--format", "json"});
  ASSERT_EQ(fp32.code, 0) << fp32.err;
  const json fp32_doc = json::parse(fp32.out);
  EXPECT_EQ(fp32_doc.at("main_grad_dtype"), "float32");
  EXPECT_EQ(fp32_doc.at("stages")[7].at("memory").at("gradients"), 4 * layers * layer);
  EXPECT_EQ(fp32_doc.at("stages")[7].at("memory").at("held"), 18 * layers * layer);
  // The precision-aware optimizer's bf16 moments: 4 + 2 + 2 bytes of state per owned element
  // (the first of 8 pieces), and main_grad read as it is (no float32 copies at the step).
  json config;
  std::ifstream(Sample("gpt3_175b_t8_p16_n1024.json")) >> config;
  config["optimizer"]["use_distributed_optimizer"] = true;
  config["optimizer"]["use_precision_aware_optimizer"] = true;
  config["optimizer"]["exp_avg_dtype"] = "bf16";
  config["optimizer"]["exp_avg_sq_dtype"] = "bf16";
  const Result aware = Mpusim(
      {"estimate", WriteTemp("mpusim_precision_aware.json", config.dump()), "--format", "json"});
  ASSERT_EQ(aware.code, 0) << aware.err;
  const json aware_doc = json::parse(aware.out);
  EXPECT_EQ(aware_doc.at("optimizer_dtypes").at("exp_avg"), "bfloat16");
  EXPECT_EQ(aware_doc.at("optimizer_dtypes").at("master"), "float32");
  EXPECT_EQ(aware_doc.at("stages")[7].at("memory").at("optimizer"),
            8 * ((layers * layer + dp - 1) / dp));
  // A bf16 run keeps the float32 master as the parameter and a 2-byte remainder (Megatron's
  // default store_param_remainders): 2 + 2 + 2 bytes; 4 + 2 + 2 with the key false.
  config["parallel"].erase("fp16");
  config["parallel"]["bf16"] = true;
  for (const bool remainders : {true, false}) {
    config["optimizer"]["store_param_remainders"] = remainders;
    const Result bf16 = Mpusim(
        {"estimate", WriteTemp("mpusim_remainders.json", config.dump()), "--format", "json"});
    ASSERT_EQ(bf16.code, 0) << bf16.err;
    const json bf16_doc = json::parse(bf16.out);
    EXPECT_EQ(bf16_doc.at("optimizer_dtypes").at("master"),
              remainders ? "bfloat16 parameter + int16 remainder" : "float32");
    EXPECT_EQ(bf16_doc.at("stages")[7].at("memory").at("optimizer"),
              (remainders ? 6 : 8) * ((layers * layer + dp - 1) / dp));
  }
  // mpusim run runs it: the fp16 run's float16 main_grad read as it is, float16 moments and
  // master weights stored scaled, every tensor checked; a float64 run, which has no lower
  // precision to keep, is one line naming the key, exit 2.
  json small;
  std::ifstream(Sample("gpt_fp16_dp2_n2.json")) >> small;
  small["optimizer"]["use_distributed_optimizer"] = true;
  small["optimizer"]["use_precision_aware_optimizer"] = true;
  small["optimizer"]["main_params_dtype"] = "fp16";
  small["optimizer"]["exp_avg_dtype"] = "fp16";
  small["optimizer"]["exp_avg_sq_dtype"] = "fp16";
  const std::string small_path = WriteTemp("mpusim_precision_aware_run.json", small.dump());
  std::string run_out;
  EXPECT_EQ(
      test_util::Shell(test_util::Mpiexec(2) + MPUSIM_BINARY + " run " + small_path, &run_out), 0)
      << run_out;
  EXPECT_NE(run_out.find(" passed, 0 failed"), std::string::npos) << run_out;
  small["parallel"].erase("fp16");
  small["run"]["dtype"] = "float64";
  const std::string float64_path = WriteTemp("mpusim_precision_aware_f64.json", small.dump());
  ExpectUsageError(Mpusim({"run", float64_path}),
                   "error: " + float64_path +
                       ": optimizer.use_precision_aware_optimizer: a float64 run keeps every "
                       "optimizer tensor in float64; the precision-aware optimizer needs "
                       "run.dtype float32, bfloat16 or float16");
  // The text names the layout and the optimizer, and shows the other optimizer's total.
  const Result text = Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"), "--pp", "8"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("Memory estimate: 1024 ranks (tp 8 · pp 8 · dp 16), parameters in "
                          "float16 (no run section)\n"),
            std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("plain optimizer (every dp rank keeps all of it)"), std::string::npos);
  EXPECT_NE(text.out.find("| distributed optimizer held"), std::string::npos) << text.out;
}

// The distributed optimizer's column and the refusals: a layout without a model, and bad
// flags, are one error line.
TEST(EstimateCommand, DistributedOptimizerAndRefusals) {
  const Result r = Mpusim({"estimate", Sample("gpt_sweep_l4_n8.json"), "--format", "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json doc = json::parse(r.out);
  ASSERT_EQ(doc.at("stages").size(), 2u);
  EXPECT_EQ(doc.at("use_distributed_optimizer"), true);
  for (const json& stage : doc.at("stages")) {  // dp 2: half the state, give or take padding
    const uint64_t plain = stage.at("optimizer_if_plain");
    EXPECT_EQ(stage.at("memory").at("optimizer"), 12 * ((plain / 12 + 1) / 2)) << stage;
  }
  ExpectUsageError(Mpusim({"estimate", Sample("lab_t2_p4_n16.json")}),
                   "error: " + Sample("lab_t2_p4_n16.json") +
                       ": model: is required by mpusim estimate (it counts the model's "
                       "parameters; `mpusim layout` shows a layout's groups)");
  ExpectUsageError(Mpusim({"estimate", Sample("gpt_sweep_l4_n8.json"), "--tp", "3"}),
                   "error: command line: --tp 3: parallel.world_size: 8 is not divisible by "
                   "tensor_model_parallel_size * pipeline_model_parallel_size * "
                   "context_parallel_size = 3 * 2 * 1");
}

// The step time of GPT-3 175B on 1024 A100s, against what can be counted by hand: Megatron's
// closed form of the model FLOPs (its count since 2025 halves the core attention for the
// causal mask), the busiest stage's executed FLOPs (6 layers, each GEMM 4 x its forward with
// full recomputation; fp16 on the A100 runs flash attention, whose kernel computes the 17 of
// 32 half-blocks a causal mask keeps of 16 x 16 tiles of 128, forward, recomputed forward and
// a backward of 2.5 x; plus the logits 3 x), its tp collectives, the gradient all-reduce's
// bytes and time, and the step's parts adding up.
// The step time counts the forward of exactly what recomputation reruns (GPT-3 175B, 6 layers
// per stage): uniform groups of any size recompute every layer once, so their recompute_s and
// tp collectives are uniform 1's; block n recomputes n of a stage's 6 layers (n / 6 of them;
// all 6 past 6); the selective modules' parts add up to all three together. Compute, the
// forward and backward without the reruns, is the same under every option.
TEST(EstimateCommand, RecomputationCountsWhatIsRecomputed) {
  json config = json::parse(std::ifstream(Sample("gpt3_175b_t8_p16_n1024.json")));
  config["run"] = {{"seq_length", 2048}, {"micro_batch_size", 1}, {"global_batch_size", 1536}};
  struct Measured {
    double recompute_s, compute_s, tp_count;
  };
  int written = 0;
  const auto estimate = [&](const json& keys) {
    json c = config;
    c["run"].update(keys);
    const Result r = Mpusim(
        {"estimate", WriteTemp(fmt::format("mpusim_recompute_time.{}.json", written++), c.dump()),
         "--gpu", "a100-80gb", "--format", "json"});
    EXPECT_EQ(r.code, 0) << keys.dump() << ": " << r.err;
    if (r.code != 0) return Measured{0, 0, 0};
    const json doc = json::parse(r.out);
    EXPECT_EQ(doc.at("recompute").at("recompute_granularity"),
              keys.value("recompute_granularity", json(nullptr)));
    return Measured{doc.at("time").at("recompute_s").get<double>(),
                    doc.at("time").at("compute_s").get<double>(),
                    doc.at("communication")[0].at("count").get<double>()};
  };
  const auto full = [](const char* method, int64_t n) {
    return json{{"recompute_granularity", "full"},
                {"recompute_method", method},
                {"recompute_num_layers", n}};
  };
  const Measured none = estimate(json::object());
  const Measured every = estimate(full("uniform", 1));
  ASSERT_GT(every.recompute_s, 0);
  EXPECT_EQ(none.recompute_s, 0);
  const double extra_tp = every.tp_count - none.tp_count;
  ASSERT_GT(extra_tp, 0);
  for (const int64_t n : {2, 4, 6, 96}) {
    const Measured m = estimate(full("uniform", n));
    EXPECT_NEAR(m.recompute_s, every.recompute_s, 1e-12 * every.recompute_s) << "uniform " << n;
    EXPECT_EQ(m.tp_count, every.tp_count) << "uniform " << n;
  }
  for (const int64_t n : {1, 2, 3, 5, 6, 7}) {
    const Measured m = estimate(full("block", n));
    const double share = static_cast<double>(std::min<int64_t>(n, 6)) / 6;
    EXPECT_NEAR(m.recompute_s, share * every.recompute_s, 1e-12 * every.recompute_s)
        << "block " << n;
    EXPECT_NEAR(m.tp_count, none.tp_count + share * extra_tp, 1e-9) << "block " << n;
    EXPECT_NEAR(m.compute_s, none.compute_s, 1e-12 * none.compute_s) << "block " << n;
  }
  const auto selective = [](json modules) {
    return json{{"recompute_granularity", "selective"}, {"recompute_modules", modules}};
  };
  const Measured core = estimate(selective({"core_attn"}));
  const Measured norms = estimate(selective({"layernorm"}));
  const Measured mlp = estimate(selective({"mlp"}));
  const Measured all = estimate(selective({"mlp", "core_attn", "layernorm"}));
  EXPECT_EQ(estimate(selective(json::array())).recompute_s, 0);
  EXPECT_GT(core.recompute_s, 0);
  EXPECT_GT(norms.recompute_s, 0);
  // The MLP's forward GEMMs are more than its norms' memory passes and less than the layer's.
  EXPECT_GT(mlp.recompute_s, norms.recompute_s);
  EXPECT_LT(mlp.recompute_s, every.recompute_s);
  EXPECT_NEAR(all.recompute_s, core.recompute_s + norms.recompute_s + mlp.recompute_s,
              1e-12 * all.recompute_s);
  // The MLP's rerun repeats its tp collective (one per layer and micro-batch of the stage).
  EXPECT_EQ(mlp.tp_count - none.tp_count, 6 * 1536 / 8);
  EXPECT_NEAR(all.compute_s, none.compute_s, 1e-12 * none.compute_s);
}

TEST(EstimateCommand, StepTimeOfGpt3MatchesCountsByHand) {
  const Result r = Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"),
                           "--global-batch-size", "1536", "--recompute", "full", "--gpu",
                           "a100-80gb", "--format", "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json doc = json::parse(r.out);
  const double B = 1536, s = 2048, l = 96, h = 12288, V = 51200, t = 8, layers = 6, M = 192;
  EXPECT_EQ(doc.at("num_microbatches"), 192);
  const double model_flops =
      72 * B * s * l * h * h * (1 + s / (12 * h) + V / (12 * l * h));  // Megatron's count
  EXPECT_NEAR(doc.at("model_flops_per_iteration").get<double>() / model_flops, 1, 1e-12);
  const double step = doc.at("step_time_s");
  EXPECT_NEAR(doc.at("mfu").get<double>(), model_flops / (step * 1024 * 312e12), 1e-12);
  EXPECT_NEAR(doc.at("model_tflops_per_gpu").get<double>(), model_flops / (step * 1024 * 1e12),
              1e-9);
  const json& time = doc.at("time");
  double parts = 0;
  for (const char* part : {"compute_s", "recompute_s", "tp_comm_s", "pp_comm_s", "bubble_s",
                           "dp_comm_s", "optimizer_s"}) {
    EXPECT_GT(time.at(part).get<double>(), 0) << part;
    parts += time.at(part).get<double>();
  }
  EXPECT_NEAR(parts / step, 1, 1e-12);
  // The last stage is the busiest (the logits); per micro-batch and tp rank it executes
  // (4 x 24 s h^2 + 4.5 x 4 s^2 h x 17/32) / t per layer and 3 x 2 s h V / t for the output
  // layer.
  const double tiles = s / 128, causal = (tiles + 1) / (2 * tiles);
  const double layer = (4 * 24 * s * h * h + 4.5 * 4 * s * s * h * causal) / t,
               logits = 3 * 2 * s * h * V / t;
  EXPECT_NEAR(doc.at("flops_per_rank").get<double>() / (M * (layers * layer + logits)), 1,
              1e-12);
  const json& last = doc.at("stages")[15];
  EXPECT_NEAR(last.at("time").at("flops").get<double>() / (layers * layer + logits), 1, 1e-12);
  // The last stage's blocking sends (Megatron waits for each): one gradient back per
  // micro-batch, [s, b, h] in fp16 over one network adapter.
  EXPECT_NEAR(time.at("pp_comm_s").get<double>(), M * (s * h * 2 / (25e9 * 0.8) + 10e-6),
              1e-9);
  // The bubble: about (p - 1) of the stages' steps, plus the waits for receives.
  const json& first = doc.at("stages")[1].at("time");
  const double one = first.at("forward_s").get<double>() + first.at("backward_s").get<double>();
  EXPECT_GT(time.at("bubble_s").get<double>(), 15 * one * 0.9);
  EXPECT_LT(time.at("bubble_s").get<double>(), 15 * one * 1.5);
  // Communication: 6 all-reduces per layer per micro-batch (forward, backward, recomputed
  // forward) inside a node; the fp16 gradients' ring all-reduce over 8 dp ranks across nodes.
  ASSERT_EQ(doc.at("communication").size(), 3u);
  const json& tp = doc.at("communication")[0];
  EXPECT_EQ(tp.at("kind"), "tp");
  EXPECT_EQ(tp.at("count"), 192 * 6 * 6);
  EXPECT_EQ(tp.at("inter_node"), false);
  const json& dp = doc.at("communication")[2];
  EXPECT_EQ(dp.at("kind"), "dp");
  EXPECT_EQ(dp.at("inter_node"), true);
  const double grads = 2 * last.at("parameter_elements").get<double>();
  EXPECT_NEAR(dp.at("bytes").get<double>() / (2 * grads * 7 / 8), 1, 1e-12);
  EXPECT_NEAR(dp.at("seconds").get<double>(), 2 * grads * 7 / 8 / (25e9 * 0.8) + 14 * 10e-6,
              1e-9);
  // At tp 2 each dp group of 32 has 4 ranks on each of its 8 nodes: the node's 8 adapters
  // are shared by its two groups, 4 each, up to the NVLink rate (a GPU file's 50 GB/s).
  const std::string narrow_nvlink = WriteTemp("mpusim_estimate_narrow_nvlink.json",
                                              R"({"base": "a100-80gb", "intra_node_gbps": 50})");
  for (const auto& [gpu, bandwidth] :
       std::vector<std::pair<std::string, double>>{{"a100-80gb", 4 * 25e9}, {narrow_nvlink, 50e9}}) {
    const Result tp2 = Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"), "--tp", "2",
                               "--global-batch-size", "1536", "--recompute", "full", "--gpu", gpu,
                               "--format", "json"});
    ASSERT_EQ(tp2.code, 0) << tp2.err;
    const json tp2_doc = json::parse(tp2.out);
    const json& dp32 = tp2_doc.at("communication").back();
    ASSERT_EQ(dp32.at("kind"), "dp");
    const double grads32 = 2 * tp2_doc.at("stages").back().at("parameter_elements").get<double>();
    EXPECT_NEAR(dp32.at("seconds").get<double>(),
                2 * grads32 * 31 / 32 / (bandwidth * 0.8) + 62 * 10e-6, 1e-9)
        << gpu;
  }
  // Text: the batch, the parts and the throughput.
  const Result text = Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"),
                              "--global-batch-size", "1536", "--recompute", "full", "--gpu",
                              "a100-80gb"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("Step time on a100-80gb: global batch 1536 (192 micro-batches of 1 x "
                          "dp 8), sequence 2048, recompute full (uniform, 1 layer per group)\n"),
            std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("model TFLOP/s per GPU, MFU"), std::string::npos) << text.out;
  // A slower GPU file (half the GEMM efficiency) takes longer; an H200 is faster.
  const std::string slow = WriteTemp("mpusim_estimate_slow_gpu.json",
                                     R"({"base": "a100-80gb", "gemm_efficiency": 0.4})");
  const Result half = Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"),
                              "--global-batch-size", "1536", "--gpu", slow, "--format", "json"});
  ASSERT_EQ(half.code, 0) << half.err;
  const Result h200 = Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"),
                              "--global-batch-size", "1536", "--gpu", "h200", "--format", "json"});
  ASSERT_EQ(h200.code, 0) << h200.err;
  const Result a100 = Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"),
                              "--global-batch-size", "1536", "--gpu", "a100-80gb", "--format",
                              "json"});
  ASSERT_EQ(a100.code, 0) << a100.err;
  const double a100_step = json::parse(a100.out).at("step_time_s");
  EXPECT_GT(json::parse(half.out).at("step_time_s").get<double>(), 1.5 * a100_step);
  EXPECT_LT(json::parse(h200.out).at("step_time_s").get<double>(), a100_step);
  EXPECT_EQ(json::parse(half.out).at("gpu").at("name"), "custom");
}

// Mixture-of-experts layers in the step time, against counts by hand: a Mixtral-like model
// (8 layers of 8 experts of 14336, top 2, SwiGLU, grouped queries) on 64 H100s, tp 2 with
// sequence parallelism, ep 4 of whole experts (etp 1), dp 32, 8 micro-batches of 4096 tokens,
// the alltoall dispatcher, the distributed optimizer. Per micro-batch a rank routes its 2048
// tokens to 2 experts each (balanced: 4096 rows of whole-expert work); the model FLOPs count
// the top-2 experts per token as Megatron does; each MoE layer makes two all-to-alls per pass
// over ep 4 (ranks 4n..4n+3, one node); the dense gradients reduce over dp 32 and the experts'
// over expt_dp 16 apart. Then the allgather dispatcher gathers over tp_ep instead.
TEST(EstimateCommand, StepTimeOfMoeLayersMatchesCountsByHand) {
  const json config = {
      {"parallel",
       {{"world_size", 64}, {"tensor_model_parallel_size", 2}, {"sequence_parallel", true},
        {"expert_model_parallel_size", 4}, {"expert_tensor_parallel_size", 1}}},
      {"model",
       {{"type", "gpt"}, {"num_layers", 8}, {"hidden_size", 4096}, {"num_attention_heads", 32},
        {"num_query_groups", 8}, {"ffn_hidden_size", 14336}, {"normalization", "RMSNorm"},
        {"activation", "swiglu"}, {"position_embedding_type", "rope"},
        {"add_bias_linear", false}, {"hidden_dropout", 0.0}, {"attention_dropout", 0.0},
        {"vocab_size", 32000}, {"num_moe_experts", 8}, {"moe_router_topk", 2},
        {"moe_token_dispatcher_type", "alltoall"}}},
      {"run",
       {{"dtype", "bfloat16"}, {"seq_length", 4096}, {"micro_batch_size", 1},
        {"global_batch_size", 256}}},
      {"optimizer", {{"optimizer", "adam"}, {"lr", 1e-4}, {"use_distributed_optimizer", true}}}};
  const auto estimate = [&](const json& c, const std::string& name) {
    const std::string path = WriteTemp("mpusim_time_moe_" + name + ".json", c.dump());
    const Result r = Mpusim({"estimate", path, "--gpu", "h100-80gb", "--format", "json"});
    EXPECT_EQ(r.code, 0) << r.err;
    return r.code == 0 ? json::parse(r.out) : json();
  };
  const json doc = estimate(config, "a2a");
  ASSERT_TRUE(doc.is_object());
  const double B = 256, s = 4096, L = 8, h = 4096, d = 128, heads = 32, groups = 8, f = 14336,
               V = 32000, E = 8, k = 2, M = 8, t = 2, Tn = s / t, e = 2;
  EXPECT_EQ(doc.at("num_microbatches"), 8);
  // Megatron's model FLOPs: attention (its core half of s x s: the causal mask), the top-2
  // experts' SwiGLU MLPs, the logits.
  const double attention = 2 * h * (heads + 2 * groups) * d + 2 * heads * d * h +
                           2 * 2 * s * heads * d / 2;
  const double model_flops = 3 * B * s * (L * (attention + k * 6 * h * f) + 2 * h * V);
  EXPECT_NEAR(doc.at("model_flops_per_iteration").get<double>() / model_flops, 1, 1e-12);
  // A rank's executed FLOPs: its tp half of the attention's GEMMs, the router on its 2048
  // tokens, the experts on 4096 rows, the logits' half, each 3 x (no recomputation); bf16 on
  // the H100 runs cuDNN's fused attention: the 33 of 64 half-blocks a causal mask keeps of
  // 32 x 32 tiles of 128, forward and a backward of 2.5 x.
  const double rank_layer = (2 * s * h * (heads + 2 * groups) * d + 2 * s * heads * d * h) / t +
                            2 * Tn * h * E + 2 * Tn * k * h * 3 * f;
  const double core = 2 * 2 * s * s * heads * d / t * 33 / 64;
  const double rank_flops = M * (3 * (L * rank_layer + 2 * s * h * V / t) + 3.5 * L * core);
  EXPECT_NEAR(doc.at("flops_per_rank").get<double>() / rank_flops, 1, 1e-12);
  // The all-to-alls: per layer, micro-batch and pass, two of the 3/4 of the rows that leave
  // the rank, over NVLink (450 GB/s at 80%, 5 us).
  const json& time = doc.at("time");
  const double sent = Tn * k * h * e * 3 / 4;
  const double a2a = sent / (450e9 * 0.8) + 5e-6;
  EXPECT_NEAR(time.at("ep_comm_s").get<double>() / (M * L * 2 * 2 * a2a), 1, 1e-12);
  // ep 16 (16 experts) spans two nodes, 8 of its ranks on each (the experts' grid has etp 1,
  // so an ep group is 16 consecutive ranks): of the 15/16 of the rows that leave a rank, the
  // 7/16 for its own node's ranks go over NVLink and the 8/16 for the other node's over its
  // network adapter (50 GB/s at 80%, 10 us), at once; the slower sets the time.
  {
    json wide = config;
    wide["parallel"]["expert_model_parallel_size"] = 16;
    wide["model"]["num_moe_experts"] = 16;
    const json w = estimate(wide, "a2a_wide");
    ASSERT_TRUE(w.is_object());
    const double rows = Tn * k * h * e;
    const double wide_a2a =
        std::max(rows * 7 / 16 / (450e9 * 0.8), rows * 8 / 16 / (50e9 * 0.8)) + 10e-6;
    EXPECT_NEAR(w.at("time").at("ep_comm_s").get<double>() / (M * L * 2 * 2 * wide_a2a), 1,
                1e-12);
  }
  const json* ep = nullptr;
  const json* dp = nullptr;
  const json* expt_dp = nullptr;
  for (const json& c : doc.at("communication")) {
    if (c.at("kind") == "ep") ep = &c;
    if (c.at("kind") == "dp") dp = &c;
    if (c.at("kind") == "expt_dp") expt_dp = &c;
  }
  ASSERT_NE(ep, nullptr);
  EXPECT_EQ(ep->at("operation"), "all-to-all");
  EXPECT_EQ(ep->at("count"), 8 * 8 * 2 * 2);
  EXPECT_NEAR(ep->at("bytes").get<double>() / (M * L * 2 * 2 * sent), 1, 1e-12);
  EXPECT_EQ(ep->at("inter_node"), false);
  // The gradients: the dense ones over dp 32 (4 ranks of a group on each of its 8 nodes: 4
  // adapters of 50 GB/s), the experts' over expt_dp 16 (2 on each node: 2 adapters); each a
  // reduce-scatter of float32 gradients and an all-gather of bfloat16 parameters.
  ASSERT_NE(dp, nullptr);
  ASSERT_NE(expt_dp, nullptr);
  const json& stage = doc.at("stages")[0];
  const double experts = stage.at("expert_elements");
  EXPECT_EQ(experts, L * (E / 4) * 3 * f * h);  // 2 whole experts per layer
  const double dense = stage.at("parameter_elements").get<double>() - experts;
  const auto ring = [](double bytes, double n, double bandwidth, double latency) {
    return (n - 1) / n * bytes / bandwidth + (n - 1) * latency;
  };
  EXPECT_NEAR(dp->at("seconds").get<double>(),
              ring(4 * dense, 32, 4 * 50e9 * 0.8, 10e-6) +
                  ring(2 * dense, 32, 4 * 50e9 * 0.8, 10e-6),
              1e-9);
  EXPECT_NEAR(expt_dp->at("seconds").get<double>(),
              ring(4 * experts, 16, 2 * 50e9 * 0.8, 10e-6) +
                  ring(2 * experts, 16, 2 * 50e9 * 0.8, 10e-6),
              1e-9);
  EXPECT_NEAR(time.at("dp_comm_s").get<double>(),
              dp->at("seconds").get<double>() + expt_dp->at("seconds").get<double>(), 1e-12);
  double parts = 0;
  for (const char* part : {"compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s",
                           "bubble_s", "dp_comm_s", "optimizer_s"}) {
    parts += time.at(part).get<double>();
  }
  EXPECT_NEAR(parts / doc.at("step_time_s").get<double>(), 1, 1e-12);
  // The allgather dispatcher: per layer and pass an all-gather of the 2048 tokens of each of
  // the 4 ranks of tp_ep (etp 1 x ep 4) and a reduce-scatter back, the same compute.
  json gather = config;
  gather["model"]["moe_token_dispatcher_type"] = "allgather";
  const json g = estimate(gather, "allgather");
  ASSERT_TRUE(g.is_object());
  const double collective = ring(Tn * h * e * 4, 4, 450e9 * 0.8, 5e-6);
  EXPECT_NEAR(g.at("time").at("ep_comm_s").get<double>() / (M * L * 2 * 2 * collective), 1,
              1e-12);
  EXPECT_NEAR(g.at("flops_per_rank").get<double>() / rank_flops, 1, 1e-12);
  // The alltoall dispatcher's compute is the allgather one's plus its second permutation: with
  // 2 local experts the 4096 rows received are sorted by expert and back (read and write
  // each), forward and twice in the backward, at 80% of the H100's 3.35 TB/s.
  const double sort_s = M * L * 3 * (2 * 2 * Tn * k * h * e) / (3350e9 * 0.8);
  EXPECT_NEAR((time.at("compute_s").get<double>() - g.at("time").at("compute_s").get<double>()) /
                  sort_s,
              1, 1e-9);
  // Full recomputation repeats the forward's exchanges in the backward.
  json recompute = config;
  recompute["run"]["recompute_granularity"] = "full";
  recompute["run"]["recompute_method"] = "uniform";
  recompute["run"]["recompute_num_layers"] = 1;
  const json full = estimate(recompute, "full");
  ASSERT_TRUE(full.is_object());
  EXPECT_NEAR(full.at("time").at("ep_comm_s").get<double>() / (M * L * 3 * 2 * a2a), 1, 1e-12);
  // Selective "moe" reruns every MoE layer (here all of them) whole: the same exchanges and
  // recomputation as full recomputation of the layers' MoE part; "moe_act" reruns only the
  // experts' SwiGLU, a memory pass over each rank's 4096 rows (reads fc1's 2f, writes f).
  json selective = config;
  selective["run"]["recompute_granularity"] = "selective";
  selective["run"]["recompute_modules"] = {"moe"};
  const json moe_layer = estimate(selective, "selective_moe");
  ASSERT_TRUE(moe_layer.is_object());
  EXPECT_NEAR(moe_layer.at("time").at("ep_comm_s").get<double>() / (M * L * 3 * 2 * a2a), 1, 1e-12);
  EXPECT_GT(moe_layer.at("time").at("recompute_s").get<double>(), 0);
  EXPECT_LT(moe_layer.at("time").at("recompute_s").get<double>(),
            full.at("time").at("recompute_s").get<double>());
  selective["model"]["moe_grouped_gemm"] = true;
  selective["run"]["recompute_modules"] = {"moe_act"};
  const json act = estimate(selective, "selective_moe_act");
  ASSERT_TRUE(act.is_object());
  EXPECT_NEAR(act.at("time").at("recompute_s").get<double>() /
                  (M * L * Tn * k * (2 * f + f) * e / (3350e9 * 0.8)),
              1, 1e-9);
  EXPECT_NEAR(act.at("time").at("ep_comm_s").get<double>() / (M * L * 2 * 2 * a2a), 1, 1e-12);
  // The text shows the exchange as a part of the pipeline.
  const Result text = Mpusim({"estimate", WriteTemp("mpusim_time_moe_text.json", config.dump()),
                              "--gpu", "h100-80gb"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find(" + ep "), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("    ep      all-to-all "), std::string::npos) << text.out;
}

// Megatron's activation count of mixture-of-experts layers, against the dense count: a GPT
// whose MoE layers have 2 experts of the dense ffn size and top-1 routing keeps, per MoE layer,
// what the dense layer keeps plus the router's (float32 scores and routing map per expert,
// float32 chosen probabilities), the experts' permuted input rows and the combine's (int64
// ids, the returned rows, the probabilities in the router's dtype: the run's bfloat16, or
// moe_router_dtype's float32 or float64); full recomputation keeps the layer inputs alike.
// moe_layer_freq [1, 0] makes one of the two layers MoE: half the difference.
TEST(EstimateCommand, MegatronActivationsOfMoeLayers) {
  const json dense = {
      {"parallel", {{"world_size", 1}}},
      {"model",
       {{"type", "gpt"}, {"num_layers", 2}, {"hidden_size", 64}, {"num_attention_heads", 4},
        {"ffn_hidden_size", 128}, {"add_bias_linear", false}, {"vocab_size", 256}}},
      {"run",
       {{"dtype", "bfloat16"}, {"seq_length", 32}, {"micro_batch_size", 2},
        {"num_microbatches", 1}}}};
  const auto activations = [](const json& config, const std::string& name) {
    const std::string path = WriteTemp("mpusim_moe_acts_" + name + ".json", config.dump());
    const Result r = Mpusim({"estimate", path, "--format", "json"});
    EXPECT_EQ(r.code, 0) << r.err;
    if (r.code != 0) return -1.0;
    const json doc = json::parse(r.out);
    EXPECT_TRUE(doc.at("stages")[0].at("memory").at("activations").is_number()) << doc;
    return doc.at("stages")[0].at("memory").at("activations").get<double>();
  };
  json moe = dense;
  moe["model"]["num_moe_experts"] = 2;
  moe["model"]["moe_router_topk"] = 1;
  const double T = 64, h = 64, e = 2, E = 2, k = 1, rows = T * k;
  const auto layer_with = [&](double p) {
    return T * E * (4 + 1) + T * k * 4 + rows * h * e + rows * (8 + h * e + p);
  };
  const double per_layer = layer_with(e);
  const double base = activations(dense, "dense");
  EXPECT_EQ(activations(moe, "moe") - base, 2 * per_layer);
  for (const auto& [router_dtype, p] : {std::pair{"fp32", 4.0}, {"fp64", 8.0}}) {
    json wide = moe;
    wide["model"]["moe_router_dtype"] = router_dtype;
    EXPECT_EQ(activations(wide, router_dtype) - base, 2 * layer_with(p)) << router_dtype;
  }
  json half = moe;
  half["model"]["moe_layer_freq"] = {1, 0};
  EXPECT_EQ(activations(half, "half") - base, per_layer);
  json full_dense = dense, full_moe = moe;
  for (json* full : {&full_dense, &full_moe}) {
    (*full)["run"]["recompute_granularity"] = "full";
    (*full)["run"]["recompute_method"] = "uniform";
    (*full)["run"]["recompute_num_layers"] = 1;
  }
  EXPECT_EQ(activations(full_moe, "full_moe"), activations(full_dense, "full_dense"));
}

// Context parallelism 2 on GPT-3 175B (tp 8, pp 16, dp 4: 384 micro-batches of 1024 tokens
// per rank, full recomputation): the same FLOPs per rank per iteration as cp 1 (half the
// tokens, twice the micro-batches), and per layer and micro-batch the exchange of each
// cp_comm_type forward, backward and in the recomputed forward, over the cp pairs (ranks r
// and r + 8: across nodes, one GPU of each pair per node, 25 GB/s at 80%, 10 us a step).
TEST(EstimateCommand, StepTimeUnderContextParallelism) {
  const json gpt3 = json::parse(std::ifstream(Sample("gpt3_175b_t8_p16_n1024.json")));
  const auto estimate = [&](const std::string& type, const char* cp) {
    json config = gpt3;
    config["model"]["cp_comm_type"] = type;
    const std::string path = WriteTemp("mpusim_time_cp_" + type + ".json", config.dump());
    const Result r = Mpusim({"estimate", path, "--cp", cp, "--global-batch-size", "1536",
                             "--recompute", "full", "--gpu", "a100-80gb", "--format", "json"});
    EXPECT_EQ(r.code, 0) << r.err;
    return r.code == 0 ? json::parse(r.out) : json();
  };
  const json cp1 = estimate("p2p", "1");
  const double kv = 2 * 1024 * (96 / 8) * 128 * 2;  // a rank's keys and values of a layer
  const double bw = 25e9 * 0.8, latency = 10e-6;
  const int64_t layer_steps = 384 * 6;  // micro-batches x the busiest stage's layers
  for (const std::string type : {"all_gather", "a2a", "p2p"}) {
    SCOPED_TRACE(type);
    const json doc = estimate(type, "2");
    ASSERT_TRUE(doc.is_object());
    EXPECT_NEAR(doc.at("flops_per_rank").get<double>() / cp1.at("flops_per_rank").get<double>(),
                1, 1e-12);
    const json& comm = doc.at("communication");
    const auto it = std::find_if(comm.begin(), comm.end(),
                                 [](const json& c) { return c.at("kind") == "cp"; });
    ASSERT_NE(it, comm.end());
    EXPECT_EQ(it->at("inter_node"), true);
    const double seconds = it->at("seconds").get<double>();
    EXPECT_EQ(seconds, doc.at("time").at("cp_comm_s").get<double>());
    if (type == "all_gather") {
      // An all-gather forward (twice, with the recomputation) and a reduce-scatter backward.
      EXPECT_EQ(it->at("count"), layer_steps * 3);
      EXPECT_NEAR(it->at("bytes").get<double>(), layer_steps * 3 * kv, 1);
      EXPECT_NEAR(seconds, layer_steps * 3 * (kv / bw + latency), 1e-9);
    } else if (type == "a2a") {
      // Four all-to-alls (q, k, v, context: 2 x 12 heads and 2 x 12 groups of 128) each pass.
      const double local = 1024 * 128 * 2 * (2 * 12 + 2 * 12);
      EXPECT_EQ(it->at("count"), layer_steps * 12);
      EXPECT_NEAR(it->at("bytes").get<double>(), layer_steps * 3 * local / 2, 1);
      EXPECT_NEAR(seconds, layer_steps * 3 * (local / 2 / bw + 4 * latency), 1e-9);
    } else {
      // One send forward (twice), two backward, each partly hidden behind the attention.
      EXPECT_EQ(it->at("count"), layer_steps * 4);
      EXPECT_NEAR(it->at("bytes").get<double>(), layer_steps * 4 * kv, 1);
      EXPECT_GT(seconds, 0);
      EXPECT_LT(seconds, layer_steps * 4 * (kv / bw + latency));
    }
    const json& t = doc.at("time");
    EXPECT_NEAR(t.at("compute_s").get<double>() + t.at("recompute_s").get<double>() +
                    t.at("tp_comm_s").get<double>() +
                    t.at("cp_comm_s").get<double>() + t.at("pp_comm_s").get<double>() +
                    t.at("bubble_s").get<double>() +
                    t.at("dp_comm_s").get<double>() + t.at("optimizer_s").get<double>(),
                doc.at("step_time_s").get<double>(), 1e-9);
  }
}

// The activations at the schedule's peak against Korthikanti et al. 2022's closed forms for
// GPT-3 175B (t 8, p 16, 192 micro-batches: stage 0 keeps 16 stashes of 6 layers, plus the
// embedding dropout's one-byte mask each): sbh (10 + 24/t + 5as/(ht)) per layer without
// sequence parallelism, sbh (34 + 5as/h) / t with it, 34 sbh / t with selective
// recomputation, 2 sbh (/ t with sp) with full recomputation. Korthikanti's attention keeps
// the s x s probabilities: attention_backend "unfused" (tests/cli/attention_backend_test.cc
// counts flash).
TEST(EstimateCommand, ActivationsMatchKorthikantiClosedForms) {
  const double s = 2048, b = 1, h = 12288, a = 96, t = 8, sbh = s * b * h;
  json gpt3 = json::parse(std::ifstream(Sample("gpt3_175b_t8_p16_n1024.json")));
  gpt3["model"]["attention_backend"] = "unfused";
  const std::string unfused = WriteTemp("mpusim_estimate_unfused.json", gpt3.dump());
  const auto stage0 = [&](std::vector<std::string> flags) {
    std::vector<std::string> args = {"estimate", unfused, "--global-batch-size", "1536",
                                     "--format", "json"};
    args.insert(args.end(), flags.begin(), flags.end());
    const Result r = Mpusim(args);
    EXPECT_EQ(r.code, 0) << r.err;
    return json::parse(r.out).at("stages")[0];
  };
  const auto expect = [&](const json& stage, double per_layer, double mask, const char* what) {
    EXPECT_EQ(stage.at("peak_stashes"), 16) << what;
    EXPECT_NEAR(stage.at("memory").at("activations").get<double>(), 16 * (6 * per_layer + mask),
                0.5)
        << what;
    // The peak: the schedule's (activations and buffers) or the step's (the fp16 main_grad's
    // float32 copies), whichever is larger, on top of what is held.
    const json& m = stage.at("memory");
    EXPECT_EQ(m.at("peak").get<double>(),
              m.at("held").get<double>() +
                  std::max(m.at("activations").get<double>() + m.at("buffers").get<double>(),
                           m.at("step_gradient_copies").get<double>()))
        << what;
  };
  expect(stage0({}), sbh * (10 + 24 / t + 5 * a * s / (h * t)), sbh, "tp");
  expect(stage0({"--sequence-parallel", "true"}), sbh * (34 + 5 * a * s / h) / t, sbh / t,
         "tp + sp");
  expect(stage0({"--sequence-parallel", "true", "--recompute", "selective"}), 34 * sbh / t,
         sbh / t, "selective");
  expect(stage0({"--recompute", "full"}), 2 * sbh, sbh, "full");
  // Buffers: the p2p send and receive of one activation each way, and with sp the gathered
  // layer input.
  EXPECT_EQ(stage0({}).at("memory").at("buffers").get<double>(), 4 * sbh * 2);
  EXPECT_EQ(stage0({"--sequence-parallel", "true"}).at("memory").at("buffers").get<double>(),
            4 * sbh * 2 / t + sbh * 2);
  // The interleaved schedule keeps more micro-batches' stashes of smaller chunks on stage 0.
  const json interleaved = stage0({"--vp", "2", "--recompute", "full"});
  EXPECT_GT(interleaved.at("peak_stashes").get<int>(), 16);
  EXPECT_GT(interleaved.at("memory").at("activations").get<double>(), 16 * 6 * 2 * sbh);
  // Context parallelism 2 halves each rank's tokens. all_gather also keeps the keys and
  // values of every position (2 sbh e / t); a2a keeps the same probabilities (every query of
  // half the heads); the ring (p2p, Megatron's default) keeps none, but a float32
  // log-sum-exp per query row and head.
  const double per_layer = sbh * (10 + 24 / t + 5 * a * s / (h * t));
  const double probabilities = sbh * 5 * a * s / (h * t);
  for (const auto& [type, layer] : std::vector<std::pair<std::string, double>>{
           {"all_gather", per_layer / 2 + 2 * sbh * 2 / t},
           {"a2a", per_layer / 2},
           {"p2p", (per_layer - probabilities) / 2 + 4 * b * a * (s / 2) / t}}) {
    json cp = gpt3;
    cp["model"]["cp_comm_type"] = type;
    const std::string path = WriteTemp("mpusim_estimate_cp_" + type + ".json", cp.dump());
    const Result r = Mpusim({"estimate", path, "--cp", "2", "--global-batch-size", "1536",
                             "--format", "json"});
    ASSERT_EQ(r.code, 0) << r.err;
    expect(json::parse(r.out).at("stages")[0], layer, sbh / 2, type.c_str());
  }
  // Without recomputation, micro-batches of 2 do not fit an 80 GiB GPU on this layout.
  const Result text =
      Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"), "--global-batch-size", "1536",
              "--micro-batch-size", "2", "--gpu", "a100-80gb"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("  | no, "), std::string::npos) << text.out;
  const Result full =
      Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"), "--global-batch-size", "1536",
              "--micro-batch-size", "2", "--gpu", "a100-80gb", "--recompute", "full"});
  ASSERT_EQ(full.code, 0) << full.err;
  EXPECT_EQ(full.out.find("  | no, "), std::string::npos) << full.out;
}

// Without a run section the step time is not estimated (and says why); what it does not
// model is named; bad GPU files and batch flags are one error line.
// The executor's count in the JSON: its parts add up to its activations (the schedule's
// peak, or the optimizer step when larger), the distributed optimizer's gradient piece is
// carried only from a second iteration on, and the text shows the same bytes. That the count
// equals what `mpusim run` measures is MemoryEstimate.* (mpi_tests).
TEST(EstimateCommand, ExecutorCountAddsUpAndCarriesTheGradientPiece) {
  const std::string sweep = Sample("gpt_sweep_l4_n8.json");  // distributed optimizer, dp 2
  const auto executor = [&](const char* iterations) {
    const Result r = Mpusim({"estimate", sweep, "--format", "json", "--train-iters", iterations});
    EXPECT_EQ(r.code, 0) << r.err;
    return json::parse(r.out).at("stages");
  };
  const json one = executor("1"), two = executor("2");
  ASSERT_EQ(one.size(), 2u);
  for (size_t i = 0; i < one.size(); ++i) {
    SCOPED_TRACE(i);
    const json& a = one[i].at("executor");
    const json& b = two[i].at("executor");
    const auto schedule = [](const json& x) {
      return x.at("stashes").get<uint64_t>() + x.at("working").get<uint64_t>() +
             x.at("transfers").get<uint64_t>() + x.at("carried").get<uint64_t>();
    };
    EXPECT_EQ(a.at("activations").get<uint64_t>(),
              std::max(schedule(a), a.at("optimizer_step").get<uint64_t>()));
    EXPECT_EQ(a.at("carried"), 0);
    EXPECT_GT(b.at("carried").get<uint64_t>(), 0u);
    // The piece: the rank's half (dp 2) of the main_grads' elements, padded, in float32.
    const uint64_t elements = one[i].at("memory").at("gradients").get<uint64_t>() / 4;
    EXPECT_EQ(b.at("carried").get<uint64_t>(), (elements + 1) / 2 * 4);
    EXPECT_EQ(b.at("activations").get<uint64_t>(),
              a.at("activations").get<uint64_t>() + b.at("carried").get<uint64_t>());
    EXPECT_EQ(b.at("stashes"), a.at("stashes"));
  }
  const Result text = Mpusim({"estimate", sweep});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("What `mpusim run --no-check` keeps on the CPU executor, in float32"),
            std::string::npos)
      << text.out;
  // Mixture of experts: the executor count and Megatron's, both for balanced routing, which the
  // text says; a lab chain has neither.
  const Result moe =
      Mpusim({"estimate", Sample("gpt_moe_ep2_t2_sp_dp2_n4.json"), "--format", "json"});
  ASSERT_EQ(moe.code, 0) << moe.err;
  const json moe_doc = json::parse(moe.out);
  EXPECT_GT(moe_doc.at("stages").at(0).at("executor").at("stashes").get<uint64_t>(), 0u);
  EXPECT_GT(moe_doc.at("stages").at(0).at("memory").at("activations").get<uint64_t>(), 0u);
  EXPECT_FALSE(moe_doc.contains("activations_not_estimated"));
  const Result moe_text = Mpusim({"estimate", Sample("gpt_moe_ep2_t2_sp_dp2_n4.json")});
  ASSERT_EQ(moe_text.code, 0) << moe_text.err;
  EXPECT_NE(moe_text.out.find("MoE layers are counted for balanced routing"), std::string::npos)
      << moe_text.out;
  const Result chain =
      Mpusim({"estimate", Sample("lab_mlp_lm_t4_dp2_n8.json"), "--format", "json"});
  ASSERT_EQ(chain.code, 0) << chain.err;
  EXPECT_TRUE(json::parse(chain.out).at("stages").at(0).at("executor").is_null());
}

TEST(EstimateCommand, StepTimeNotesAndRefusals) {
  const Result none = Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json")});
  ASSERT_EQ(none.code, 0) << none.err;
  EXPECT_NE(none.out.find("Step time: not estimated: the config has no run section: give "
                          "--global-batch-size"),
            std::string::npos)
      << none.out;
  const Result none_json =
      Mpusim({"estimate", Sample("gpt3_175b_t8_p16_n1024.json"), "--format", "json"});
  ASSERT_EQ(none_json.code, 0);
  EXPECT_TRUE(json::parse(none_json.out).at("step_time_s").is_null());
  json hierarchical = json::parse(std::ifstream(Sample("gpt3_175b_t8_p16_n1024.json")));
  hierarchical["model"]["cp_comm_type"] = "a2a+p2p";
  const Result cp = Mpusim({"estimate",
                            WriteTemp("mpusim_estimate_hcp.json", hierarchical.dump()), "--cp",
                            "4", "--hcp", "2,2", "--global-batch-size", "1536"});
  ASSERT_EQ(cp.code, 0) << cp.err;
  EXPECT_NE(cp.out.find("Step time: not estimated: model.cp_comm_type: the step-time estimate "
                        "does not model \"a2a+p2p\" (hierarchical context parallelism) yet; "
                        "p2p, all_gather and a2a it does\n"),
            std::string::npos)
      << cp.out;
  const std::string gpt3 = Sample("gpt3_175b_t8_p16_n1024.json");
  ExpectUsageError(Mpusim({"estimate", gpt3, "--gpu", "tpu"}),
                   "error: command line: --gpu: \"tpu\" is neither one of a100-80gb, h100-80gb, "
                   "h200, h800, b200 nor a .json file");
  ExpectUsageError(Mpusim({"estimate", gpt3, "--global-batch-size", "1001"}),
                   "error: command line: --global-batch-size: 1001 is not a positive multiple "
                   "of micro_batch_size 1 x data_parallel_size 8 = 8");
  ExpectUsageError(Mpusim({"estimate", gpt3, "--recompute", "full"}),
                   "error: command line: --global-batch-size: is needed with "
                   "--micro-batch-size, --seq-length, --recompute or --train-iters when the "
                   "config has no run section");
  ExpectUsageError(Mpusim({"estimate", Sample("gpt_sweep_l4_n8.json"), "--train-iters", "0"}),
                   "error: command line: --train-iters: must be >= 1");
  const std::string typo =
      WriteTemp("mpusim_estimate_typo_gpu.json", R"({"peak_tflops_16bt": 100})");
  ExpectUsageError(Mpusim({"estimate", gpt3, "--gpu", typo}),
                   "error: command line: --gpu " + typo +
                       ".peak_tflops_16bt: unknown key (did you mean peak_tflops_16bit?); "
                       "allowed: name, base, compute_capability, peak_tflops_16bit, "
                       "peak_tflops_32bit, peak_tflops_64bit, peak_tflops_8bit, hbm_gib, "
                       "hbm_gbps, intra_node_gbps, inter_node_gbps, intra_node_latency_us, "
                       "inter_node_latency_us, gemm_efficiency, gemm_efficiency_8bit, "
                       "memory_efficiency, collective_efficiency, attention_efficiency_forward, "
                       "attention_efficiency_backward, sm_count");
  // A GPU file that is not there, or not JSON: one line naming it (advise reads it alike).
  const std::string garbled = WriteTemp("mpusim_estimate_garbled_gpu.json", "not json");
  ExpectUsageError(Mpusim({"estimate", gpt3, "--gpu", garbled}),
                   "error: command line: --gpu " + garbled +
                       ": line 1, column 2: invalid JSON: syntax error while parsing value - "
                       "invalid literal; last read: 'no'");
  ExpectUsageError(Mpusim({"advise", gpt3, "--global-batch-size", "1536", "--gpu",
                           "/nonexistent/gpu.json"}),
                   "error: command line: --gpu /nonexistent/gpu.json: cannot open the file "
                   "(does it exist and is it readable?)");
  const std::string over =
      WriteTemp("mpusim_estimate_over_gpu.json", R"({"gemm_efficiency": 1.5})");
  ExpectUsageError(Mpusim({"estimate", gpt3, "--gpu", over}),
                   "error: command line: --gpu " + over +
                       ".gemm_efficiency: number 1.5 is above 1; an efficiency is in (0, 1]");
}

// advise's layout `l` (its #`i`) against `mpusim estimate --format json` of the same layout:
// the step time and each of its parts to the last bit, and the fullest stage's peak.
void ExpectAdvisedAsEstimated(const json& l, const json& est, size_t i) {
  EXPECT_DOUBLE_EQ(est.at("step_time_s").get<double>(), l.at("step_time_s").get<double>()) << i;
  for (const char* part : {"compute_s", "recompute_s", "bubble_s", "tp_comm_s", "cp_comm_s",
                           "ep_comm_s", "pp_comm_s", "dp_comm_s", "optimizer_s"}) {
    EXPECT_DOUBLE_EQ(est.at("time").at(part).get<double>(), l.at(part).get<double>())
        << part << " of #" << i;
  }
  // advise reports the stage that needs the most: peak + reserve.
  double needed = 0, peak = 0, reserved = 0;
  for (const json& stage : est.at("stages")) {
    const double p = stage.at("memory").at("peak"), r = stage.at("reserved_bytes");
    if (p + r > needed) needed = p + r, peak = p, reserved = r;
  }
  EXPECT_EQ(peak, l.at("peak_bytes").get<double>()) << i;
  EXPECT_EQ(reserved, l.at("reserved_bytes").get<double>()) << i;
}

// advise on GPT-3 175B, 1024 A100s, a narrow search (micro-batches of 1, full recomputation,
// no sp, no distributed optimizer, no interleaving), without and with context parallelism: it
// evaluates exactly the (tp, cp, pp) that divide the node, the heads, the GPUs and the layers
// and leave dp dividing the batch; lists the fitting ones fastest first, each agreeing with
// `mpusim estimate` of that layout; and the closest misses are over the GPU's memory.
TEST(AdviseCommand, RanksFittingLayoutsAsEstimateJudgesThem) {
  std::vector<std::string> narrow = {
      "advise", Sample("gpt3_175b_t8_p16_n1024.json"), "--global-batch-size", "1536", "--gpu",
      "a100-80gb", "--micro-batch-sizes", "1", "--recompute", "full", "--sequence-parallel",
      "false", "--distributed-optimizer", "false", "--no-virtual-pipeline", "--top", "1000",
      "--format", "json"};
  for (const int64_t max_cp : {1, 8}) {
    std::vector<std::string> args = narrow;
    args.insert(args.end(), {"--max-cp", std::to_string(max_cp)});
    const Result r = Mpusim(args);
    ASSERT_EQ(r.code, 0) << r.err;
    const json doc = json::parse(r.out);
    int64_t expected = 0;
    for (int64_t tp : {1, 2, 4, 8}) {
      for (int64_t cp = 1; cp <= max_cp; cp *= 2) {  // 2 cp divides the sequence, 2048
        for (int64_t pp = 1; pp <= 1024 / (tp * cp); ++pp) {
          const int64_t dp = 1024 / (tp * cp * pp);
          if ((1024 / (tp * cp)) % pp == 0 && 96 % pp == 0 && 1536 % dp == 0) ++expected;
        }
      }
    }
    EXPECT_EQ(doc.at("candidates"), expected) << max_cp;
    const json& layouts = doc.at("layouts");
    ASSERT_GE(layouts.size(), 3u);
    EXPECT_EQ(doc.at("fitting"), layouts.size());
    const double hbm = doc.at("hbm_bytes");
    int64_t with_cp = 0;
    for (size_t i = 0; i < layouts.size(); ++i) {
      const json& l = layouts[i];
      EXPECT_LE(l.at("peak_bytes").get<double>() + l.at("reserved_bytes").get<double>(), hbm);
      // Fastest first, but near-ties (one tie_run) by headroom.
      if (i > 0 && l.at("tie_run") != layouts[i - 1].at("tie_run")) {
        EXPECT_GT(l.at("step_time_s").get<double>(), layouts[i - 1].at("step_time_s"));
      } else if (i > 0) {
        EXPECT_LE(l.at("headroom_bytes").get<double>(), layouts[i - 1].at("headroom_bytes"));
      }
      EXPECT_EQ(l.at("recompute_granularity"), "full");
      EXPECT_EQ(l.at("recompute_method"), "uniform");
      EXPECT_EQ(l.at("recompute_num_layers"), 1);
      const int64_t cp = l.at("context_parallel_size").get<int64_t>();
      EXPECT_LE(cp, max_cp);
      with_cp += cp > 1 ? 1 : 0;
      EXPECT_EQ(l.at("data_parallel_size").get<int64_t>() *
                    l.at("tensor_model_parallel_size").get<int64_t>() * cp *
                    l.at("pipeline_model_parallel_size").get<int64_t>(),
                1024);
      // The ring's exchanges may hide behind the attention entirely; without cp there are none.
      if (cp == 1) {
        EXPECT_EQ(l.at("cp_comm_s").get<double>(), 0) << i;
      }
    }
    if (max_cp > 1) {
      EXPECT_GT(with_cp, 0);
    }
    for (const json& miss : doc.at("closest_not_fitting")) {
      EXPECT_GT(miss.at("peak_bytes").get<double>() + miss.at("reserved_bytes").get<double>(),
                hbm);
      EXPECT_GT(miss.at("step_time_s").get<double>(), 0);  // the closest misses are timed
    }
    // The first three, and the first with cp > 1, estimated one by one.
    std::vector<size_t> checked = {0, 1, 2};
    for (size_t i = 3; i < layouts.size() && max_cp > 1; ++i) {
      if (layouts[i].at("context_parallel_size").get<int64_t>() > 1) {
        checked.push_back(i);
        break;
      }
    }
    for (const size_t i : checked) {
      const json& l = layouts[i];
      const Result e = Mpusim(
          {"estimate", Sample("gpt3_175b_t8_p16_n1024.json"), "--tp",
           std::to_string(l.at("tensor_model_parallel_size").get<int64_t>()), "--cp",
           std::to_string(l.at("context_parallel_size").get<int64_t>()), "--pp",
           std::to_string(l.at("pipeline_model_parallel_size").get<int64_t>()),
           "--global-batch-size", "1536", "--recompute", "full", "--gpu", "a100-80gb",
           "--format", "json"});
      ASSERT_EQ(e.code, 0) << e.err;
      ExpectAdvisedAsEstimated(l, json::parse(e.out), i);
    }
  }
  // The text names the winner's reasons and the misses' excess.
  std::vector<std::string> text_args(narrow.begin(), narrow.end() - 4);
  const Result text = Mpusim(text_args);
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("Why #1 wins: "), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("Closest that do not fit:\n"), std::string::npos) << text.out;
}

// The estimate's page: what --format json says, embedded for scripts, drawn as a bar and a
// table row per stage against the GPU's memory, with the step time's parts and the
// communication table; the layout page of a config with a model holds the same section.
TEST(EstimateCommand, HtmlPageDrawsTheJsonReport) {
  const std::vector<std::string> args = {"estimate", Sample("gpt3_175b_t8_p16_n1024.json"),
                                         "--global-batch-size", "1536", "--gpu", "a100-80gb"};
  Result page;
  const json expected = PageEmbedsItsJson(args, "estimate", &page);
  ASSERT_TRUE(expected.is_object());
  // A labelled bar and a table row per stage, each row ending in whether its peak fits.
  for (int64_t stage = 0; stage < 16; ++stage) {
    EXPECT_NE(page.out.find(fmt::format(">stage {} (rank {})</text>", stage, 64 * stage)),
              std::string::npos)
        << stage;
  }
  // Each row ends in whether its peak and reserve fit, as the JSON says.
  size_t fitting = 0;
  for (const json& stage : expected.at("stages")) {
    if (stage.at("fits").get<bool>()) ++fitting;
  }
  EXPECT_EQ(Count(page.out, "free</td></tr>"), fitting);
  EXPECT_EQ(Count(page.out, "over</td></tr>"), 16 - fitting);
  EXPECT_NE(page.out.find("<title>80.0 GiB of HBM</title>"), std::string::npos);
  EXPECT_NE(page.out.find(fmt::format("MFU {:.1f}%</h3>", 100 * expected.at("mfu").get<double>())),
            std::string::npos);
  EXPECT_EQ(Count(page.out, "<td class=\"name\">"), expected.at("communication").size());
  // Micro-batches of 2 without recomputation do not fit: the rows say by how much, in red.
  std::vector<std::string> over_args = args;
  over_args.insert(over_args.end(), {"--micro-batch-size", "2", "--format", "html"});
  const Result over = Mpusim(over_args);
  ASSERT_EQ(over.code, 0) << over.err;
  EXPECT_NE(over.out.find("<td class=\"over\">no, "), std::string::npos);
  // A model far smaller than the GPU: the memory is named, not drawn, with the bars' share.
  const Result layout =
      Mpusim({"layout", Sample("gpt_train_adam_p2_t2_n4.json"), "--format", "html"});
  ASSERT_EQ(layout.code, 0) << layout.err;
  ExpectSelfContained(layout.out);
  const Result small =
      Mpusim({"estimate", Sample("gpt_train_adam_p2_t2_n4.json"), "--format", "json"});
  ASSERT_EQ(small.code, 0) << small.err;
  EXPECT_EQ(EmbeddedJson(layout.out, "estimate"), json::parse(small.out));
  EXPECT_NE(layout.out.find("80.0 GiB of HBM (off the scale: the largest bar is "),
            std::string::npos);
  // An MoE model's page: its step time has the experts' exchanges as a part; a config without
  // a model has no estimate section.
  const Result moe =
      Mpusim({"layout", Sample("gpt_moe_ep2_t2_sp_dp2_n4.json"), "--format", "html"});
  ASSERT_EQ(moe.code, 0) << moe.err;
  EXPECT_EQ(moe.out.find("not estimated"), std::string::npos);
  EXPECT_NE(moe.out.find("ep token exchanges"), std::string::npos);
  // A layout the model cannot take (8 heads over tp 3) still draws its groups, and says why
  // there is no estimate.
  const Result odd = Mpusim({"layout", Sample("gpt_tiny_t2_sp_dp2_n4.json"), "--tp", "3",
                             "--world-size", "6", "--format", "html"});
  ASSERT_EQ(odd.code, 0) << odd.err;
  EXPECT_TRUE(EmbeddedJson(odd.out, "layout").is_object());
  EXPECT_NE(odd.out.find("<p class=\"note\">not estimated: model.num_attention_heads: 8 is not "
                         "divisible by tensor_model_parallel_size 3</p>"),
            std::string::npos);
  const Result groups = Mpusim({"layout", Sample("lab_t2_p4_n16.json"), "--format", "html"});
  ASSERT_EQ(groups.code, 0) << groups.err;
  EXPECT_TRUE(EmbeddedJson(groups.out, "estimate").is_null());
}

// advise on a mixture-of-experts model (8 layers of 8 experts, top 2, on 64 H100s; a narrow
// search: micro-batches of 1, full recomputation, the distributed optimizer, no cp, no
// interleaving) adds every ep that divides dp and the experts: it evaluates exactly the
// layouts an independent count expects (tp > 1 only with sequence parallelism, as Megatron
// requires for MoE), and its first three and its first with ep > 1 agree with `mpusim
// estimate` of that layout, the experts' exchanges included.
TEST(AdviseCommand, SearchesExpertParallelismOfAnMoeModel) {
  const json config = {
      {"parallel", {{"world_size", 64}}},
      {"model",
       {{"type", "gpt"}, {"num_layers", 8}, {"hidden_size", 4096}, {"num_attention_heads", 32},
        {"num_query_groups", 8}, {"ffn_hidden_size", 14336}, {"normalization", "RMSNorm"},
        {"activation", "swiglu"}, {"position_embedding_type", "rope"},
        {"add_bias_linear", false}, {"vocab_size", 32000}, {"num_moe_experts", 8},
        {"moe_router_topk", 2}, {"moe_token_dispatcher_type", "alltoall"}}},
      {"run", {{"dtype", "bfloat16"}, {"seq_length", 4096}, {"micro_batch_size", 1}}},
      {"optimizer", {{"optimizer", "adam"}, {"lr", 1e-4}, {"use_distributed_optimizer", true}}}};
  const std::string path = WriteTemp("mpusim_advise_moe.json", config.dump());
  const Result r = Mpusim({"advise", path, "--global-batch-size", "256", "--gpu", "h100-80gb",
                           "--micro-batch-sizes", "1", "--recompute", "full",
                           "--distributed-optimizer", "true", "--no-virtual-pipeline",
                           "--max-cp", "1", "--top", "1000", "--format", "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json doc = json::parse(r.out);
  int64_t expected = 0;
  for (int64_t tp : {1, 2, 4, 8}) {
    for (int64_t pp = 1; pp <= 64 / tp; ++pp) {
      const int64_t dp = 64 / (tp * pp);
      if ((64 / tp) % pp != 0 || 8 % pp != 0 || 256 % dp != 0) continue;
      for (int64_t ep = 1; ep <= dp; ++ep) expected += dp % ep == 0 && 8 % ep == 0 ? 1 : 0;
    }
  }
  EXPECT_EQ(doc.at("candidates"), expected);
  EXPECT_EQ(doc.at("not_searched"), json({"expert_tensor_parallel_size"}));
  const json& layouts = doc.at("layouts");
  ASSERT_GE(layouts.size(), 3u);
  std::vector<size_t> checked = {0, 1, 2};
  for (size_t i = 0; i < layouts.size(); ++i) {
    const json& l = layouts[i];
    const int64_t ep = l.at("expert_model_parallel_size"), dp = l.at("data_parallel_size");
    EXPECT_EQ(dp % ep, 0);
    EXPECT_EQ(8 % ep, 0);
    EXPECT_EQ(l.at("sequence_parallel"), l.at("tensor_model_parallel_size").get<int64_t>() > 1);
    if (ep > 1 && checked.size() == 3 && i >= 3) checked.push_back(i);
  }
  ASSERT_EQ(checked.size(), 4u) << "no layout with ep > 1 among those that fit";
  for (const size_t i : checked) {
    const json& l = layouts[i];
    const Result e = Mpusim(
        {"estimate", path, "--tp",
         std::to_string(l.at("tensor_model_parallel_size").get<int64_t>()), "--pp",
         std::to_string(l.at("pipeline_model_parallel_size").get<int64_t>()), "--ep",
         std::to_string(l.at("expert_model_parallel_size").get<int64_t>()),
         "--sequence-parallel", l.at("sequence_parallel").get<bool>() ? "true" : "false",
         "--global-batch-size", "256", "--recompute", "full", "--gpu", "h100-80gb", "--format",
         "json"});
    ASSERT_EQ(e.code, 0) << e.err;
    ExpectAdvisedAsEstimated(l, json::parse(e.out), i);
  }
  EXPECT_GT(layouts[checked[3]].at("ep_comm_s").get<double>(), 0);
}

// The advice page: the JSON report embedded, a table row, a time bar and a memory bar per
// layout shown, and the closest misses with their excess.
TEST(AdviseCommand, HtmlPageDrawsTheJsonReport) {
  // A narrowed search (1881 layouts, not 31800: the page is under test, not the search; 2
  // minutes of the ASan suite otherwise) whose #1 still has cp and which still has 3 misses.
  const std::vector<std::string> args = {
      "advise", Sample("gpt3_175b_t8_p16_n1024.json"), "--global-batch-size", "1536", "--gpu",
      "a100-80gb", "--top", "4", "--micro-batch-sizes", "1", "--distributed-optimizer", "true",
      "--sequence-parallel", "true"};
  Result page;
  const json expected = PageEmbedsItsJson(args, "advice", &page);
  ASSERT_TRUE(expected.is_object());
  ASSERT_EQ(expected.at("layouts").size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const json& l = expected.at("layouts")[i];
    std::string name = fmt::format("tp {}", l.at("tensor_model_parallel_size").get<int64_t>());
    if (l.at("context_parallel_size").get<int64_t>() > 1) {
      name += fmt::format(" cp {}", l.at("context_parallel_size").get<int64_t>());
    }
    name += fmt::format(" pp {}", l.at("pipeline_model_parallel_size").get<int64_t>());
    if (!l.at("virtual_pipeline_model_parallel_size").is_null()) {
      name += fmt::format(" vp {}", l.at("virtual_pipeline_model_parallel_size").get<int64_t>());
    }
    name += fmt::format(" dp {} mbs {}", l.at("data_parallel_size").get<int64_t>(),
                        l.at("micro_batch_size").get<int64_t>());
    EXPECT_NE(page.out.find(fmt::format("<tr><td>{}</td><td class=\"name\">{}</td>", i + 1, name)),
              std::string::npos)
        << name;
    // Its time bar and its memory bar.
    EXPECT_EQ(Count(page.out, fmt::format(">#{} {}</text>", i + 1, name)), 2u) << name;
  }
  // Context parallelism among the layouts shown: its column and its part of each time bar.
  EXPECT_GT(expected.at("layouts")[0].at("context_parallel_size").get<int64_t>(), 1);
  EXPECT_NE(page.out.find("<th>tp</th><th>cp</th><th>pp</th>"), std::string::npos);
  const size_t misses = expected.at("closest_not_fitting").size();
  EXPECT_EQ(misses, 3u);
  EXPECT_EQ(Count(page.out, "<li>"), misses);
  EXPECT_EQ(Count(page.out, " over</li>"), misses);
  EXPECT_NE(page.out.find("<p>Why #1 wins: "), std::string::npos);
}

TEST(AdviseCommand, Refusals) {
  const std::string gpt3 = Sample("gpt3_175b_t8_p16_n1024.json");
  ExpectUsageError(Mpusim({"advise", gpt3}),
                   "error: command line: --global-batch-size: is needed (the config's run "
                   "section has no global_batch_size)");
  ExpectUsageError(Mpusim({"advise", gpt3, "--global-batch-size", "8", "--micro-batch-sizes",
                           "1,x"}),
                   "error: command line: --micro-batch-sizes: '1,x' is not a list of integers "
                   "from 1 to 1048576");
  ExpectUsageError(Mpusim({"advise", gpt3, "--global-batch-size", "8",
                           "--distributed-optimizer", "true,"}),
                   "error: command line: --distributed-optimizer: 'true,' is not a list of true "
                   "and false");
  ExpectUsageError(Mpusim({"advise", gpt3, "--global-batch-size", "8", "--recompute", "some"}),
                   "error: command line: --recompute: 'some' is not a list of none, selective "
                   "and full");
  // A layer chain has no GPT to lay out.
  ExpectUsageError(Mpusim({"advise", Sample("lab_mlp_lm_t4_dp2_n8.json"), "--global-batch-size",
                           "8"}),
                   "error: " + Sample("lab_mlp_lm_t4_dp2_n8.json") +
                       ": model: advise needs a GPT model (\"type\": \"gpt\")");
  ExpectUsageError(Mpusim({"advise", gpt3, "--global-batch-size", "8", "--max-cp", "0"}),
                   "error: command line: --max-cp: Value 0 not in range 1 to 1048576 (run "
                   "'mpusim advise --help' for usage)");
}

TEST(ExplainCommand, LabSlices) {
  const Result column = Mpusim({"explain", Sample("lab_column_parallel_t16_n16.json")});
  ASSERT_EQ(column.code, 0) << column.err;
  EXPECT_NE(column.out.find("A0= [1024, 32], A1= [1024, 32],"), std::string::npos)
      << column.out;
  EXPECT_NE(column.out.find("A15= [1024, 32]\n"), std::string::npos) << column.out;
  const Result row = Mpusim({"explain", Sample("lab_row_parallel_t16_n16.json")});
  ASSERT_EQ(row.code, 0) << row.err;
  EXPECT_NE(row.out.find("A0= [64, 512], A1= [64, 512],"), std::string::npos) << row.out;
  EXPECT_NE(row.out.find("sliced row-wise"), std::string::npos) << row.out;
  const Result bad = Mpusim({"explain", Sample("lab_t2_p4_n16.json")});
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(bad.out, "");
  // A chain's pipeline stages: 7 layers in 4 virtual stages (1, 2, 2, 2 layers).
  const Result staged =
      Mpusim({"explain", Sample("lab_train_mlp_lm_t2_dp2_n4.json"), "--pp", "2", "--vp", "2"});
  ASSERT_EQ(staged.code, 0) << staged.err;
  for (const char* line :
       {"VocabParallelEmbedding embedding: input tokens -> output 32 (sequence split); pipeline "
        "rank 0, chunk 0\n",
        "GeLU gelu: input 128 (hidden split) -> output 128 (hidden split); pipeline rank 1, "
        "chunk 0\n",
        "Dropout dropout: input 128 (hidden split) -> output 128 (hidden split); pipeline rank 0, "
        "chunk 1\n",
        "-> output loss; pipeline rank 1, chunk 1\n",
        // The head's weight_from tie: pp rank 1 holds a copy of the embedding's weight.
        "  embedding.weight [128, 32] rows split over tp, pp rank 0 chunk 0; tied: pp rank 1 "
        "holds a copy for head (weight_from)\n",
        "  embedding.weight [128, 32] rows split over tp, pp rank 1 chunk 1; tied: the copy head "
        "uses (weight_from), its gradient all-reduced over embd with pp rank 0's\n"}) {
    EXPECT_NE(staged.out.find(line), std::string::npos) << line << "\n" << staged.out;
  }
  // Without stages the head uses the embedding's own tensor.
  const Result tied = Mpusim({"explain", Sample("lab_train_mlp_lm_t2_dp2_n4.json")});
  ASSERT_EQ(tied.code, 0) << tied.err;
  EXPECT_NE(tied.out.find("ColumnParallelLinear head: input 32 (sequence split) -> output 128 "
                          "(hidden split)\n  weight: embedding.weight (weight_from), sliced as "
                          "there\n"),
            std::string::npos)
      << tied.out;
  EXPECT_NE(tied.out.find("  embedding.weight [128, 32] rows split over tp; also the weight of "
                          "head (weight_from)\n"),
            std::string::npos)
      << tied.out;
}

// The sharding map: the index ranges of the master tensor each tp rank holds, stride-aware,
// with the global ranks holding them; one rank's share with --rank; JSON with --format json.
TEST(ExplainCommand, ShardingMapWithStridesRanksAndJson) {
  const json config = {{"parallel", {{"world_size", 4}, {"tensor_model_parallel_size", 2}}},
                       {"model",
                        {{"layers",
                          {{{"name", "qkv"},
                            {"type", "ColumnParallelLinear"},
                            {"input_size", 8},
                            {"output_size", 12},
                            {"gather_output", false},
                            {"stride", 3}},
                           {{"name", "proj"},
                            {"type", "RowParallelLinear"},
                            {"input_size", 12},
                            {"output_size", 8},
                            {"input_is_parallel", true},
                            {"stride", 3}}}}}}};
  const std::string path =
      WriteTemp(fmt::format("mpusim_explain_map.{}.json", ::getpid()), config.dump());
  const Result text = Mpusim({"explain", path});
  ASSERT_EQ(text.code, 0) << text.err;
  for (const char* line : {"  qkv.weight [12, 8] rows split over tp with stride 3\n",
                           "    tp 0: rows [0, 2) [4, 6) [8, 10)  ranks 0, 2\n",
                           "    tp 1: rows [2, 4) [6, 8) [10, 12)  ranks 1, 3\n",
                           "    tp 1: elements [2, 4) [6, 8) [10, 12)  ranks 1, 3\n",
                           "  proj.weight [8, 12] columns split over tp with stride 3\n",
                           "    tp 0: columns [0, 2) [4, 6) [8, 10)  ranks 0, 2\n",
                           "  proj.bias [8] replicated\n    whole on ranks 0-3\n"}) {
    EXPECT_NE(text.out.find(line), std::string::npos) << line << "\n" << text.out;
  }
  const Result one = Mpusim({"explain", path, "--rank", "3"});
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_NE(one.out.find("sharding map of rank 3 (tp rank 1, pp rank 0, dp rank 1)"),
            std::string::npos)
      << one.out;
  EXPECT_NE(one.out.find("    tp 1: rows [2, 4) [6, 8) [10, 12)\n"), std::string::npos) << one.out;
  EXPECT_EQ(one.out.find("    tp 0:"), std::string::npos) << one.out;
  const Result as_json = Mpusim({"explain", path, "--format", "json"});
  ASSERT_EQ(as_json.code, 0) << as_json.err;
  const json map = json::parse(as_json.out);
  EXPECT_EQ(map["schema_version"], 1);
  const json& qkv = map["parameters"][0];
  EXPECT_EQ(qkv["name"], "qkv.weight");
  EXPECT_EQ(qkv["split"]["stride"], 3);
  EXPECT_EQ(qkv["shards"][1]["ranges"], json::parse("[[2, 4], [6, 8], [10, 12]]"));
  EXPECT_EQ(qkv["shards"][1]["ranks"], json::parse("[1, 3]"));
  const Result bad = Mpusim({"explain", path, "--rank", "4"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(bad.err, "error: command line: --rank: 4 is not in this layout; ranks are 0..3\n");
  EXPECT_EQ(bad.out, "");
}

// The experts in the sharding map: every ep rank's experts, each on its ep rank's ranks, and
// with expert_tensor_parallel_size other than tp split over expt_tp by the etp coordinate.
// tp 1, etp 2, ep 2 on 4 ranks: rank = etp + 2 ep, so ep rank 1 is ranks 2 (etp 0) and 3.
TEST(ExplainCommand, ExpertsMapToTheirEpRankAndEtpSlices) {
  const std::string config = Sample("gpt_moe_ep2_t2_sp_dp2_n4.json");
  const Result as_json =
      Mpusim({"explain", config, "--tp", "1", "--etp", "2", "--format", "json"});
  ASSERT_EQ(as_json.code, 0) << as_json.err;
  const json map = json::parse(as_json.out);
  EXPECT_EQ(map["expert_model_parallel_size"], 2);
  EXPECT_EQ(map["expert_tensor_parallel_size"], 2);
  std::map<std::string, json> by_name;
  for (const json& p : map["parameters"]) by_name[p["name"].get<std::string>()] = p;
  const json& fc1 = by_name["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"];
  EXPECT_EQ(fc1["ep_rank"], 1);
  EXPECT_EQ(fc1["split"], json::parse(R"({"dim": 0, "stride": 2, "group": "expt_tp"})"));
  ASSERT_EQ(fc1["shards"].size(), 2u);
  EXPECT_EQ(fc1["shards"][0]["etp_rank"], 0);
  EXPECT_EQ(fc1["shards"][0]["ranges"], json::parse("[[0, 32], [64, 96]]"));
  EXPECT_EQ(fc1["shards"][0]["ranks"], json::parse("[2]"));
  EXPECT_EQ(fc1["shards"][1]["ranks"], json::parse("[3]"));
  EXPECT_EQ(by_name["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"]["ep_rank"],
            0);
  // A dense weight stays on tp: one shard (tp 1), every rank.
  const json& router = by_name["decoder.layers.0.mlp.router.weight"];
  EXPECT_FALSE(router.contains("ep_rank"));
  EXPECT_EQ(router["shards"][0]["ranks"], json::parse("[0, 1, 2, 3]"));
  // Whole experts (etp 1) beside tp 2: expert 0 on the ranks of ep rank 0 only.
  const Result whole = Mpusim({"explain", config, "--etp", "1"});
  ASSERT_EQ(whole.code, 0) << whole.err;
  EXPECT_NE(whole.out.find("  decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight "
                           "[128, 64] whole, ep rank 0\n    whole on ranks 0, 2\n"),
            std::string::npos)
      << whole.out;
  const Result one = Mpusim({"explain", config, "--tp", "1", "--etp", "2", "--rank", "3"});
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_NE(one.out.find("sharding map of rank 3 (tp rank 0, pp rank 0, dp rank 3, ep rank 1, "
                         "etp rank 1)"),
            std::string::npos)
      << one.out;
  EXPECT_NE(one.out.find("local_experts.2.linear_fc1.weight [128, 64] rows split over expt_tp "
                         "with stride 2, ep rank 1\n    etp 1: rows [32, 64) [96, 128)\n"),
            std::string::npos)
      << one.out;
  const std::string map_of_3 = one.out.substr(one.out.find("sharding map of rank 3"));
  EXPECT_EQ(map_of_3.find("local_experts.0.linear_fc1"), std::string::npos) << map_of_3;
}

// The dtypes of the gradient buffer and the optimizer state, with Megatron's reason.
TEST(ExplainCommand, NamesTheGradientAndOptimizerDtypes) {
  Result r = Mpusim({"explain", Sample("gpt_fp16_dp2_n2.json")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("precision: parameters in float16; main_grad in float16 (fp16 without "
                       "accumulate_allreduce_grads_in_fp32, as Megatron), accumulated over the "
                       "micro-batches and reduced over data parallelism in it, copied to float32 "
                       "for the step; master weights in float32, optimizer state in float32\n"),
            std::string::npos)
      << r.out;
  r = Mpusim({"explain", Sample("gpt_fp16_dp2_n2.json"), "--accumulate-allreduce-grads-in-fp32",
              "true"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("main_grad in float32 (accumulate_allreduce_grads_in_fp32), accumulated"),
            std::string::npos)
      << r.out;
}

// An MoE model's router dtypes: moe_router_dtype's logits and probabilities, float32
// softmaxes (RouterDTypesOf); a float64 run keeps its router in float64.
TEST(ExplainCommand, NamesTheRouterDtypes) {
  json config = json::parse(std::ifstream(Sample("gpt_moe_ep2_t2_sp_dp2_n4.json")));
  config["model"]["moe_router_dtype"] = "fp64";
  config["run"]["dtype"] = "bfloat16";
  Result r = Mpusim({"explain", WriteTemp("mpusim_router_dtype.json", config.dump())});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("; the MoE router's logits and probabilities in float64 "
                       "(moe_router_dtype), its softmaxes in float32\n"),
            std::string::npos)
      << r.out;
  config["model"]["moe_router_dtype"] = "fp32";
  config["run"]["dtype"] = "float64";
  r = Mpusim({"explain", WriteTemp("mpusim_router_dtype64.json", config.dump())});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("; the MoE router's logits and probabilities in float64 "
                       "(moe_router_dtype), its softmaxes in float64\n"),
            std::string::npos)
      << r.out;
  config["model"]["moe_router_dtype"] = "fp16";
  r = Mpusim({"explain", WriteTemp("mpusim_router_dtype16.json", config.dump())});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("model.moe_router_dtype"), std::string::npos) << r.err;
}

// DeepSeek-style routing: one line under the MoE layer's names each of the router's choices
// (none for Megatron's default router).
TEST(ExplainCommand, NamesTheRouterChoices) {
  json config = json::parse(std::ifstream(Sample("gpt_moe_ep2_t2_sp_dp2_n4.json")));
  Result r = Mpusim({"explain", WriteTemp("mpusim_router_default.json", config.dump())});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("  the router: "), std::string::npos) << r.out;
  config["model"]["num_moe_experts"] = 8;
  config["model"]["moe_router_topk"] = 4;
  config["model"]["moe_router_score_function"] = "sigmoid";
  config["model"]["moe_router_num_groups"] = 4;
  config["model"]["moe_router_group_topk"] = 2;
  config["model"]["moe_router_topk_scaling_factor"] = 2.5;
  config["model"]["moe_router_enable_expert_bias"] = true;
  r = Mpusim({"explain", WriteTemp("mpusim_router_deepseek.json", config.dump())});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("  the router: sigmoid scores (moe_router_score_function), the chosen "
                       "ones normalised to sum 1; each token's top 4 from 2 of 4 expert groups "
                       "(moe_router_group_topk, moe_router_num_groups); probabilities times 2.5 "
                       "(moe_router_topk_scaling_factor); a float32 expert bias added to the "
                       "scores for choosing only, moved by 0.001 after each optimizer step "
                       "against the token counts summed over tp x dp x cp "
                       "(moe_router_enable_expert_bias)\n"),
            std::string::npos)
      << r.out;
  // Qwen3's global load-balancing loss, in Megatron's list form, with sqrt(softplus) scores.
  config["model"]["moe_router_score_function"] = "sqrtsoftplus";
  config["model"].erase("moe_router_group_topk");
  config["model"].erase("moe_router_num_groups");
  config["model"].erase("moe_router_topk_scaling_factor");
  config["model"].erase("moe_router_enable_expert_bias");
  config["model"]["moe_router_load_balancing_type"] = json::array({"aux_loss", "global_aux_loss"});
  config["model"]["moe_aux_loss_coeff"] = json::array({0.001, 0.01});
  r = Mpusim({"explain", WriteTemp("mpusim_router_qwen3.json", config.dump())});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("  the router: sqrt(softplus) scores (moe_router_score_function "
                       "\"sqrtsoftplus\"), the chosen ones normalised to sum 1; the global "
                       "load-balancing loss (coeff 0.01; \"global_aux_loss\"): each "
                       "micro-batch's top-k counts all-reduced over tp x dp x cp in its forward "
                       "and averaged over the step's micro-batches so far\n"),
            std::string::npos)
      << r.out;
}

// gpt-oss's parts: one line names the sliding window, the layers it slides on and the
// sinks, one the clamped, offset glu (none for a plain model).
TEST(ExplainCommand, NamesGptOssAttentionAndGlu) {
  json config = json::parse(std::ifstream(Sample("gpt_tiny_t2_sp_dp2_n4.json")));
  Result r = Mpusim({"explain", WriteTemp("mpusim_oss_plain.json", config.dump())});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("attention: "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("activation: "), std::string::npos) << r.out;
  config["model"]["window_size"] = json::array({2, 0});
  config["model"]["window_attn_skip_freq"] = 2;
  config["model"]["softmax_type"] = "off-by-one";
  config["model"]["activation"] = "quick_geglu";
  config["model"]["glu_linear_offset"] = 1.0;
  config["model"]["activation_func_clamp_value"] = 7.0;
  r = Mpusim({"explain", WriteTemp("mpusim_oss.json", config.dump())});
  ASSERT_EQ(r.code, 0) << r.err;
  const int64_t layers = config["model"]["num_layers"];
  std::vector<std::string> sliding;  // layer numbers 1, 3, ...: indices 0, 2, ...
  for (int64_t i = 0; i < layers; i += 2) sliding.push_back(std::to_string(i));
  EXPECT_NE(r.out.find(fmt::format(
                "attention: a sliding window (window_size [2, 0]): each query sees itself and "
                "the 2 keys before it, on {} of {} layers ({}; window_attn_skip_freq); the "
                "others attend causally to every key before them; an attention sink "
                "(softmax_type \"off-by-one\"): a logit 0 in each softmax's denominator\n",
                sliding.size(), layers, fmt::join(sliding, ", "))),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("activation: quick_geglu of fc1's gate half g and linear half l: "
                       "act(min(g, 7)) * (clamp(l, -7, 7) + 1) (activation_func_clamp_value, "
                       "glu_linear_offset)\n"),
            std::string::npos)
      << r.out;
}

TEST(ExplainCommand, GptParametersInStateDictNames) {
  const Result gpt = Mpusim({"explain", Sample("gpt_llama_style_gqa_t4_n4.json")});
  ASSERT_EQ(gpt.code, 0) << gpt.err;
  for (const char* line :
       {"  decoder.layers.0.self_attention.linear_qkv.weight [128, 64] split on dim 0: [32, 64] per "
        "rank; per rank 1 query group of (2 query heads, 1 key, 1 value) x 8 channels\n",
        "  decoder.layers.1.mlp.linear_fc1.weight [256, 64] split on dim 0 with stride 2: [64, 64] "
        "per rank; per rank its gate rows, then the same up rows (SwiGLU)\n",
        "  decoder.final_layernorm.weight [64] replicated; gradient all-reduced over tp (sequence "
        "parallel)\n",
        "  output_layer.weight [256, 64] split on dim 0: [64, 64] per rank\n"}) {
    EXPECT_NE(gpt.out.find(line), std::string::npos) << line << gpt.out;
  }
  // The same config at tp 8 cannot split 4 query groups: one line naming the flags that
  // broke a valid file, exit 2.
  const Result bad = Mpusim({"explain", Sample("gpt_llama_style_gqa_t4_n4.json"), "--tp", "8",
                             "--world-size", "8"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(bad.err, "error: command line: --world-size 8 --tp 8: model.num_query_groups: 4 is "
                     "not divisible by tensor_model_parallel_size 8\n");
  EXPECT_EQ(bad.out, "");
  // Only parallel and model are needed; a pipeline lists each stage's chunks.
  json config = json::parse(std::ifstream(Sample("gpt_pipeline_p4_v2_n4.json")));
  config.erase("run");
  const Result no_run =
      Mpusim({"explain",
              WriteTemp(fmt::format("mpusim_explain_norun.{}.json", ::getpid()), config.dump())});
  EXPECT_EQ(no_run.code, 0) << no_run.err;
  EXPECT_NE(no_run.out.find("pipeline stage 3 of 4: chunks [layer 3] [layer 7, final norm, "),
            std::string::npos)
      << no_run.out;
}

// The GPT samples run on 4 ranks and every tensor passes the check against the float64 GPT
// reference; a GPT config the layout cannot split is one error line with exit 2.
TEST(RunCommand, GptSamplesPassTheCheck) {
  for (const char* sample : {"gpt_tiny_t2_sp_dp2_n4.json", "gpt_llama_style_gqa_t4_n4.json",
                             "gpt_pipeline_p2_v2_t2_n4.json", "gpt_pipeline_p4_v2_n4.json"}) {
    std::string output;
    EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + Sample(sample), &output), 0) << output;
    if (std::string(sample).find("pipeline") != std::string::npos) {
      for (const char* line :
           {" pipeline                 send             pp ",
            " finalize_model_grads     all-reduce       embd ", " splits the layers"}) {
        EXPECT_NE(output.find(line), std::string::npos) << line << "\n" << output;
      }
    }
    for (const char* line : {"model: GPT (Megatron-Core GPTModel, local layer spec)",
                             "check against the float64 reference", "its data-parallel rank's samples",
                             " passed, 0 failed",
                             "finalize_model_grads"}) {
      EXPECT_NE(output.find(line), std::string::npos) << sample << ": " << line << "\n" << output;
    }
  }
  json config = json::parse(std::ifstream(Sample("gpt_llama_style_gqa_t4_n4.json")));
  config["model"]["num_query_groups"] = 2;
  const std::string bad =
      WriteTemp(fmt::format("mpusim_gpt_bad.{}.json", ::getpid()), config.dump());
  std::string output;
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + bad, &output), 2) << output;
  EXPECT_NE(output.find(": model.num_query_groups: 2 is not divisible by "
                        "tensor_model_parallel_size 4\n"),
            std::string::npos)
      << output;
}

// The 4-rank pipeline sample run with --trace PATH; its output.
std::string RunTraced(const std::string& path) {
  std::string output;
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + Sample("gpt_pipeline_p2_v2_t2_n4.json") +
                      " --no-check --trace " + path,
                  &output),
            0)
      << output;
  return output;
}

std::string TracePath(const std::string& extension) {
  return (std::filesystem::temp_directory_path() /
          fmt::format("mpusim_trace.{}.{}", ::getpid(), extension))
      .string();
}

// --trace FILE: Chrome trace events for the last step. Every rank is a thread named by its
// coordinates; it has a complete event per forward and backward step (2 M v) and per
// collective or send/receive, as many as the run's comm trace lists for rank 0; each
// rank's steps follow one another.
TEST(RunCommand, TraceIsChromeTraceEventsMatchingTheCommTrace) {
  const std::string path = TracePath("json");
  const std::string output = RunTraced(path);
  const std::string marker = "collectives on rank 0 (";
  const size_t at = output.find(marker);
  ASSERT_NE(at, std::string::npos) << output;
  const int64_t rank0_comms = std::stoll(output.substr(at + marker.size()));
  const json trace = json::parse(std::ifstream(path));
  ASSERT_TRUE(trace["traceEvents"].is_array());
  // Per rank r of W: its steps on tid r, its collectives on W + r, its send/receive waits on
  // 2W + r with an async span ("b", "e") per message.
  const int64_t world = trace["otherData"]["ranks"].get<int64_t>();
  ASSERT_EQ(world, 4);
  std::map<int64_t, int64_t> steps, comms, flights;
  std::map<int64_t, std::string> names;
  std::map<int64_t, double> last_end;
  for (const json& e : trace["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("tid") && e.contains("name"))
        << e.dump();
    const int64_t tid = e["tid"].get<int64_t>();
    const int64_t rank = tid % world, track = tid / world;
    if (e["ph"] == "M") {
      if (e["name"] == "thread_name") names[tid] = e["args"]["name"].get<std::string>();
      continue;
    }
    if (e["ph"] == "b" || e["ph"] == "e") {
      EXPECT_EQ(track, 2) << e.dump();
      EXPECT_EQ(e["cat"], "p2p") << e.dump();
      flights[rank] += e["ph"] == "b" ? 1 : 0;
      continue;
    }
    ASSERT_EQ(e["ph"], "X") << e.dump();
    ASSERT_TRUE(e["ts"].is_number() && e["dur"].is_number()) << e.dump();
    EXPECT_GE(e["dur"].get<double>(), 0.0) << e.dump();
    if (e["cat"] == "comm" || e["cat"] == "p2p wait") {
      EXPECT_EQ(track, e["cat"] == "comm" ? 1 : 2) << e.dump();
      ++comms[rank];
      EXPECT_TRUE(e["args"].contains("bytes") && e["args"].contains("group")) << e.dump();
    } else {
      EXPECT_EQ(track, 0) << e.dump();
      ++steps[rank];
      EXPECT_GE(e["ts"].get<double>(), last_end[rank]) << e.dump();
      last_end[rank] = e["ts"].get<double>() + e["dur"].get<double>();
    }
  }
  EXPECT_EQ(names[6], "rank 2 collectives");
  EXPECT_EQ(names[10], "rank 2 send/recv waits");
  EXPECT_GT(flights[0], 0);
  EXPECT_EQ(names[2], "rank 2 (tp 0, pp 1, dp 0)");
  EXPECT_EQ(comms[0], rank0_comms);
  for (int64_t rank = 0; rank < 4; ++rank) EXPECT_EQ(steps[rank], 2 * 4 * 2) << rank;
  std::filesystem::remove(path);
}

// --trace FILE.html: one self-contained page (no external script, style or link) embedding
// the same trace events, which its script draws (the browser test checks the drawing).
TEST(RunCommand, TracePageEmbedsTheTraceEvents) {
  const std::string path = TracePath("html");
  RunTraced(path);
  std::ifstream in(path);
  const std::string page((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(page.rfind("<!DOCTYPE html>", 0), 0u);
  for (const char* external : {"<script src", "<link", "src=\"http", "href=\"http", "@import"}) {
    EXPECT_EQ(page.find(external), std::string::npos) << external;
  }
  const std::string open = "<script id=\"trace\" type=\"application/json\">";
  const size_t begin = page.find(open);
  ASSERT_NE(begin, std::string::npos);
  const size_t end = page.find("</script>", begin);
  const json trace = json::parse(page.substr(begin + open.size(), end - begin - open.size()));
  std::map<int64_t, int64_t> steps;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "X" && e["cat"] != "comm") ++steps[e["tid"].get<int64_t>()];
  }
  for (int64_t rank = 0; rank < 4; ++rank) EXPECT_EQ(steps[rank], 2 * 4 * 2) << rank;
  std::filesystem::remove(path);
}

// With activation recomputation every recomputation is a "recompute" slice ("R<chunk>.<mb>")
// nested in the backward step of the same chunk and micro-batch on the same rank: one per
// recomputed group (each GPT layer under uniform 1, each chunk of a layer chain under one
// group as long as it) or per core attention (selective).
TEST(RunCommand, TraceNestsRecomputationsInTheirBackwardSteps) {
  struct Case {
    const char* sample;
    const char* granularity;
    std::string flags;
    int64_t per_rank;  // recomputations per rank
  };
  const std::vector<Case> cases = {
      {"gpt_pipeline_p2_v2_t2_n4.json", "full", "", 8},  // one layer per chunk, 8 backward steps
      {"gpt_pipeline_p2_v2_t2_n4.json", "selective", "", 8},
      {"lab_train_mlp_lm_t2_dp2_n4.json", "full", " --tp 1 --pp 2 --train-iters 1", 2}};
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{} {}", c.sample, c.granularity));
    json config = json::parse(std::ifstream(Sample(c.sample)));
    config["run"]["recompute_granularity"] = c.granularity;
    if (std::string(c.granularity) == "full") {
      // Every GPT layer recomputed alone; the chain recomputes each chunk whole (one group as
      // long as its layers).
      config["run"]["recompute_method"] = "uniform";
      config["run"]["recompute_num_layers"] =
          config["model"].contains("layers") ? config["model"]["layers"].size() : 1;
    }
    const std::string config_path =
        WriteTemp(fmt::format("mpusim_recompute.{}.json", ::getpid()), config.dump());
    const std::string path =
        (std::filesystem::temp_directory_path() / fmt::format("mpusim_rtrace.{}.json", ::getpid()))
            .string();
    std::string output;
    ASSERT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + config_path + c.flags +
                        " --no-check --trace " + path,
                    &output),
              0)
        << output;
    const json trace = json::parse(std::ifstream(path));
    std::vector<json> backward, recompute;
    for (const json& e : trace["traceEvents"]) {
      if (e["ph"] != "X") continue;
      if (e["cat"] == "backward") backward.push_back(e);
      if (e["cat"] == "recompute") recompute.push_back(e);
    }
    std::map<int64_t, int64_t> per_rank;
    for (const json& r : recompute) {
      ++per_rank[r["tid"].get<int64_t>()];
      const std::string step = r["name"].get<std::string>().substr(1);
      const bool nested = std::any_of(backward.begin(), backward.end(), [&](const json& b) {
        return b["tid"] == r["tid"] && b["name"].get<std::string>().substr(1) == step &&
               b["ts"].get<double>() <= r["ts"].get<double>() &&
               r["ts"].get<double>() + r["dur"].get<double>() <=
                   b["ts"].get<double>() + b["dur"].get<double>() + 1e-3;
      });
      EXPECT_TRUE(nested) << r.dump();
    }
    for (int64_t rank = 0; rank < 4; ++rank) EXPECT_EQ(per_rank[rank], c.per_rank) << rank;
    std::filesystem::remove(path);
  }
}

// Training: the per-iteration table against the reference, and what a training config
// may not ask for.
TEST(RunCommand, TrainingSamplePrintsEveryIterationAgainstTheReference) {
  std::string output;
  EXPECT_EQ(
      Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + Sample("gpt_train_adam_p2_t2_n4.json"), &output),
      0)
      << output;
  for (const char* line :
       {"training: adam (betas 0.9 0.999, eps 1e-08), lr 0.001 (cosine decay to 0.0001, 2 "
        "warmup iterations), weight_decay 0.01, clip_grad 1; 10 iterations",
        "the loss of every iteration against the reference training the same model in "
        "float64: 10 of 10 pass",
        "163 passed, 0 failed", "optimizer (grad norm)",
        "optimizer state on rank 0: master weights and m, v for its 37472 parameter elements"}) {
    EXPECT_NE(output.find(line), std::string::npos) << line << "\n" << output;
  }
  json config = json::parse(std::ifstream(Sample("gpt_train_adam_p2_t2_n4.json")));
  config.erase("optimizer");
  const std::string no_optimizer =
      WriteTemp(fmt::format("mpusim_train_bad.{}.json", ::getpid()), config.dump());
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + no_optimizer, &output), 2) << output;
  EXPECT_NE(output.find(": run.train_iters: is 10, but there is no \"optimizer\" section to "
                        "train with\n"),
            std::string::npos)
      << output;
  // A layer chain trains too, checked the same way.
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + Sample("lab_train_mlp_lm_t2_dp2_n4.json"),
                  &output),
            0)
      << output;
  for (const char* line :
       {"; 8 iterations\n", "  distributed optimizer: rank 0 keeps master weights and state",
        "the loss of every iteration against the reference training the same model in float64: "
        "8 of 8 pass",
        "  fc1.weight.exp_avg_sq ", "49 passed, 0 failed"}) {
    EXPECT_NE(output.find(line), std::string::npos) << line << "\n" << output;
  }
  // Overrides of the file's keys on the command line.
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + Sample("gpt_train_adam_p2_t2_n4.json") +
                      " --tp 1 --micro-batch-size 1 --train-iters 2 --dtype float64",
                  &output),
            0)
      << output;
  for (const char* line : {"tensor_model_parallel_size 1, data_parallel_size 2,",
                           "(cpu backend, float64, seed 1234)", "clip_grad 1; 2 iterations"}) {
    EXPECT_NE(output.find(line), std::string::npos) << line << "\n" << output;
  }
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + Sample("gpt_train_adam_p2_t2_n4.json") +
                      " --train-iters 0",
                  &output),
            2)
      << output;
  EXPECT_NE(output.find("error: command line: --train-iters: run.train_iters: must be"),
            std::string::npos)
      << output;
  // Distributed-optimizer instances need the distributed optimizer.
  config = json::parse(std::ifstream(Sample("gpt_train_adam_p2_t2_n4.json")));
  config["parallel"] = {{"world_size", 4}, {"num_distributed_optimizer_instances", 2}};
  config["run"]["micro_batch_size"] = 1;
  const std::string instances_path =
      WriteTemp(fmt::format("mpusim_train_instances.{}.json", ::getpid()), config.dump());
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + instances_path, &output), 2) << output;
  EXPECT_NE(output.find(": parallel.num_distributed_optimizer_instances: is 2, which shards the "
                        "distributed optimizer's state; set optimizer.use_distributed_optimizer "
                        "to true, or use 1\n"),
            std::string::npos)
      << output;
}

// mpusim sweep: every layout of 2 ranks, each checked, one table; a launcher that cannot run
// them fails every layout (exit 1); a chain config is bad input (exit 2).
TEST(SweepCommand, EveryLayoutOfTwoRanksPasses) {
  // The real program (sweep launches itself under mpiexec).
  const std::string sweep = std::string(MPUSIM_BINARY) + " sweep " +
                            Sample("gpt_train_adam_p2_t2_n4.json") + " --world-size 2";
  std::string out;
  EXPECT_EQ(Shell(sweep + " --train-iters 2", &out), 0) << out;
  for (const char* line : {"on 2 ranks: 7 layouts (1 skipped), 4 micro-batches of 2 samples",
                           "skipped tp 1 pp 2 vp 2 dp 1: num_layers: must be divisible by",
                           "  tp 1 pp 1 dp 2 ", "  tp 1 pp 1 dp 2 dist-opt ", "  tp 1 pp 2 dp 1 ",
                           "  tp 1 cp 2 pp 1 dp 1 ", "  tp 1 cp 2 pp 1 dp 1 dist-opt ",
                           "  tp 2 pp 1 dp 1 sp ", "7 of 7 layouts pass; final losses agree to"}) {
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << out;
  }
  EXPECT_EQ(Shell(sweep + " --mpiexec /bin/false", &out), 1) << out;
  EXPECT_NE(out.find("FAIL: mpusim run exited 1"), std::string::npos) << out;
  EXPECT_NE(out.find("0 of 7 layouts pass"), std::string::npos) << out;
  // A layer chain: its layouts too, pipelines included (the 7 layers fill 2 stages), each
  // trained and checked; its dropout masks follow the layout, which the table says.
  std::string chain;
  EXPECT_EQ(Shell(std::string(MPUSIM_BINARY) + " sweep " +
                      Sample("lab_train_mlp_lm_t2_dp2_n4.json") + " --world-size 2 --train-iters 2",
                  &chain),
            0)
      << chain;
  for (const char* line :
       {"on 2 ranks: 6 layouts (0 skipped)", "  tp 1 pp 2 dp 1 ", "  tp 1 pp 2 vp 2 dp 1 ",
        "  tp 2 pp 1 dp 1 sp ", "  tp 1 pp 1 dp 2 dist-opt ", "6 of 6 layouts pass",
        "the dropout masks come from each rank's RNG tracker"}) {
    EXPECT_NE(chain.find(line), std::string::npos) << line << "\n" << chain;
  }
  const Result no_run = Mpusim({"sweep", Sample("lab_t2_p4_n16.json"), "--world-size", "2"});
  EXPECT_EQ(no_run.code, 2);
  EXPECT_NE(no_run.err.find(": model: is required by mpusim sweep"), std::string::npos)
      << no_run.err;
}

// An MoE GPT: the sweep adds every ep that divides dp x cp (and the experts) to each layout,
// and where tp > 1 the same with whole experts (etp 1).
TEST(SweepCommand, MoeLayoutsAddExpertParallelism) {
  std::string out;
  EXPECT_EQ(Shell(std::string(MPUSIM_BINARY) + " sweep " + Sample("gpt_moe_ep2_t2_sp_dp2_n4.json") +
                      " --world-size 2",
                  &out),
            0)
      << out;
  for (const char* line : {"on 2 ranks: 7 layouts (3 skipped)", "  tp 1 pp 1 dp 2 ",
                           "  tp 1 pp 1 dp 2 ep 2 ", "  tp 1 cp 2 pp 1 dp 1 ep 2 ",
                           "skipped tp 2 pp 1 dp 1: parallel.sequence_parallel: must be true",
                           "  tp 2 pp 1 dp 1 sp ", "  tp 2 pp 1 dp 1 etp 1 sp ",
                           "7 of 7 layouts pass"}) {
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << out;
  }
  EXPECT_EQ(out.find("pp 2 dp 1 ep 2"), std::string::npos) << out;  // dp x cp 1: no ep
}

// A chain with an explicit copy_to_tensor_model_parallel_region before a ColumnParallelLinear
// (which runs its own copy_to): at tp 2 its backward all-reduce doubles the gradients before
// it, as Megatron's code would.
std::string CopyToChainConfig(int64_t tp) {
  const json layers = {
      {{"name", "fc0"}, {"type", "RowParallelLinear"}, {"input_size", 16}, {"output_size", 16},
       {"input_is_parallel", true}},
      {{"name", "copy"}, {"type", "copy_to_tensor_model_parallel_region"}},
      {{"name", "fc1"}, {"type", "ColumnParallelLinear"}, {"input_size", 16}, {"output_size", 32},
       {"gather_output", false}},
      {{"name", "gelu"}, {"type", "GeLU"}},
      {{"name", "fc2"}, {"type", "RowParallelLinear"}, {"input_size", 32}, {"output_size", 16},
       {"input_is_parallel", true}}};
  const json config = {
      {"parallel", {{"world_size", tp}, {"tensor_model_parallel_size", tp}}},
      {"model", {{"layers", layers}}},
      {"run", {{"seed", 3}, {"dtype", "float32"}, {"seq_length", 8}, {"micro_batch_size", 2}}}};
  return WriteTemp(fmt::format("mpusim_copy_to_t{}.{}.json", tp, ::getpid()), config.dump());
}

constexpr const char* kCopyToWarning =
    "warning: model.layers[1] (copy_to_tensor_model_parallel_region copy): its backward "
    "all-reduce sums t = 2 copies of a gradient every rank already holds in full (the layers "
    "after it leave the full gradient on every rank), so the gradient reaching fc0 is 2x the "
    "full-model gradient; Megatron's code computes the same; the check against the reference "
    "will fail for copy.input_grad and the gradients of every layer before it (fc0)\n";

TEST(ExplainCommand, WarnsAboutTFoldGradients) {
  const std::string path = CopyToChainConfig(2);
  const Result r = Mpusim({"explain", path});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find(kCopyToWarning), std::string::npos) << r.out;
  // One rank computes the full-model gradient: no warning.
  const Result one = Mpusim({"explain", path, "--tp", "1", "--world-size", "1"});
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_EQ(one.out.find("warning:"), std::string::npos) << one.out;
}

// mpusim run prints the warning before the check table, and the check decides the exit code.
TEST(RunCommand, WarnsBeforeTheCheckFails) {
  std::string output;
  EXPECT_EQ(Shell(Mpiexec(2) + MPUSIM_BINARY + " run " + CopyToChainConfig(2), &output), 1)
      << output;
  const size_t warning = output.find(kCopyToWarning);
  ASSERT_NE(warning, std::string::npos) << output;
  EXPECT_LT(warning, output.find("check against the float64 reference")) << output;
  EXPECT_NE(output.find("27 passed, 5 failed"), std::string::npos) << output;
  EXPECT_EQ(Shell(Mpiexec(1) + MPUSIM_BINARY + " run " + CopyToChainConfig(1), &output), 0)
      << output;
  EXPECT_EQ(output.find("warning:"), std::string::npos) << output;
}

// A layout whose check fails: the sweep's row says FAIL and, under it, the run's failing check
// lines say which tensors and by how much; the exit code is 1.
TEST(SweepCommand, AFailedLayoutShowsItsFailingChecks) {
  std::string out;
  EXPECT_EQ(Shell(std::string(MPUSIM_BINARY) + " sweep " + CopyToChainConfig(2) +
                      " --world-size 2",
                  &out),
            1)
      << out;
  const size_t row = out.find("  tp 2 pp 1 dp 1 ");
  ASSERT_NE(row, std::string::npos) << out;
  const size_t next = out.find('\n', row);
  EXPECT_NE(out.substr(row, next - row).find(" FAIL "), std::string::npos) << out;
  // The five failing tensors of WarnsBeforeTheCheckFails, each on its own indented line.
  for (const char* name : {"fc0.input_grad", "fc0.output_grad", "fc0.weight_grad",
                           "fc0.bias_grad", "copy.input_grad"}) {
    const size_t line = out.find(std::string("\n      ") + name, next - 1);
    EXPECT_NE(line, std::string::npos) << name << "\n" << out;
    EXPECT_NE(out.find("FAIL (", line), std::string::npos) << out;
  }
  EXPECT_NE(out.find("2 of 3 layouts pass"), std::string::npos) << out;
}

// A chain that starts from a partial sum (every rank holds input / t): the input gradient is
// the full gradient on every rank, so the tp 2 dump reassembles into the tp 1 run's tensors.
TEST(RunCommand, PartialSumChainDumpDiffsEqualToOneRank) {
  const std::string tag = std::to_string(::getpid());
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  const std::filesystem::path a = tmp / ("mpusim_partial_t2." + tag);
  const std::filesystem::path b = tmp / ("mpusim_partial_t1." + tag);
  for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
  std::string paths[2];
  for (const int64_t tp : {1, 2}) {
    const json config = {
        {"parallel", {{"world_size", tp}, {"tensor_model_parallel_size", tp}}},
        {"model",
         {{"layers",
           {{{"name", "reduce"}, {"type", "reduce_from_tensor_model_parallel_region"}},
            {{"name", "fc1"}, {"type", "ColumnParallelLinear"}, {"input_size", 16},
             {"output_size", 32}, {"gather_output", false}}}}}},
        {"run", {{"seed", 5}, {"dtype", "float64"}, {"seq_length", 8}, {"micro_batch_size", 2}}}};
    paths[tp - 1] = WriteTemp(fmt::format("mpusim_partial_t{}.{}.json", tp, tag), config.dump());
  }
  std::string output;
  ASSERT_EQ(Shell(Mpiexec(2) + MPUSIM_BINARY + " run " + paths[1] + " --dump " + a.string(),
                  &output),
            0)
      << output;
  ASSERT_EQ(Shell(Mpiexec(1) + MPUSIM_BINARY + " run " + paths[0] + " --dump " + b.string(),
                  &output),
            0)
      << output;
  EXPECT_EQ(Shell(std::string(MPUSIM_BINARY) + " diff " + a.string() + " " + b.string(), &output),
            0)
      << output;
  EXPECT_NE(output.find("reduce.input_grad"), std::string::npos) << output;
  for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
}

}  // namespace run_tests

namespace diff_tests {

// Two layouts of one GPT with dropout on (the masks are drawn per global element, so every
// layout draws the same ones): tp 2 with sequence parallelism and dp 2 on 4 ranks against one
// rank holding the whole global batch. Then a layout that pads the vocabulary differently:
// diff compares the real vocabulary rows and says so.
TEST(DiffCommand, TwoGptLayoutsCompareEqualWithDropoutOn) {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  const std::string tag = std::to_string(::getpid());
  const std::filesystem::path a = tmp / ("mpusim_gpt_diff_a." + tag);
  const std::filesystem::path b = tmp / ("mpusim_gpt_diff_b." + tag);
  const std::filesystem::path c = tmp / ("mpusim_gpt_diff_c." + tag);
  for (const auto& dir : {a, b, c}) std::filesystem::remove_all(dir);
  json config = json::parse(std::ifstream(Sample("gpt_tiny_t2_sp_dp2_n4.json")));
  ASSERT_GT(config["model"].value("hidden_dropout", 0.1), 0.0);
  config["parallel"] = {{"world_size", 1}};
  config["run"]["micro_batch_size"] = 4;  // the sample's global batch: 2 per dp rank, dp 2
  const std::string one = WriteTemp("mpusim_gpt_t1." + tag + ".json", config.dump());
  config["model"]["make_vocab_size_divisible_by"] = 8;  // 200 rows, not 256
  const std::string unpadded = WriteTemp("mpusim_gpt_v200." + tag + ".json", config.dump());
  std::string output;
  ASSERT_EQ(run_tests::Shell(run_tests::Mpiexec(4) + MPUSIM_BINARY + " run " +
                                 Sample("gpt_tiny_t2_sp_dp2_n4.json") + " --dump " + a.string(),
                             &output),
            0)
      << output;
  ASSERT_EQ(run_tests::Shell(run_tests::Mpiexec(1) + MPUSIM_BINARY + " run " + one + " --dump " +
                                 b.string(),
                             &output),
            0)
      << output;
  const Result same = Mpusim({"diff", a.string(), b.string()});
  EXPECT_EQ(same.code, 0) << same.out << same.err;
  EXPECT_NE(same.out.find("107 passed, 0 failed"), std::string::npos) << same.out;

  ASSERT_EQ(run_tests::Shell(run_tests::Mpiexec(1) + MPUSIM_BINARY + " run " + unpadded +
                                 " --dump " + c.string(),
                             &output),
            0)
      << output;
  const Result padded = Mpusim({"diff", a.string(), c.string(), "--format", "json"});
  const json report = json::parse(padded.out);
  bool saw_weight = false;
  for (const json& t : report["tensors"]) {
    if (t["name"] != "embedding.word_embeddings.weight") continue;
    saw_weight = true;
    EXPECT_EQ(t["pass"], true) << t.dump();
    EXPECT_EQ(t["shape"], json({200, 64})) << t.dump();
    EXPECT_EQ(t["note"],
              "compared the 200 real vocabulary entries of dim 0 (padded to 256 in A, 200 in B)");
  }
  EXPECT_TRUE(saw_weight) << padded.out;
  // The padded logits take part in the softmax, so the losses differ: the diff says so.
  EXPECT_EQ(padded.code, 1) << padded.out;
}

// explain's JSON says which positions each cp rank holds (Megatron's load-balanced split).
TEST(ExplainCommand, ContextParallelPositionsInTheJson) {
  const Result r = Mpusim({"explain", Sample("gpt_context_parallel_cp2_t2_n4.json"), "--format",
                           "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json doc = json::parse(r.out);
  EXPECT_EQ(doc["context_parallel_size"], 2);
  EXPECT_EQ(doc["seq_length"], 32);
  EXPECT_EQ(doc["sequence_positions"],
            json::parse(R"([{"cp_rank": 0, "ranges": [[0, 8], [24, 32]]},
                            {"cp_rank": 1, "ranges": [[8, 16], [16, 24]]}])"));
  const Result four = Mpusim({"explain", Sample("gpt_context_parallel_cp2_t2_n4.json"), "--cp",
                              "4", "--tp", "1", "--format", "json"});
  ASSERT_EQ(four.code, 0) << four.err;
  EXPECT_EQ(json::parse(four.out)["sequence_positions"][1]["ranges"],
            json::parse("[[4, 8], [24, 28]]"));
}

// Context parallelism: a cp 2 x tp 2 dump (each rank's sequence positions in two chunks, a
// load-balanced placement, the tp split of sequence parallelism inside it) and a one-rank
// dump of the same model in float64 reassemble to the same tensors.
TEST(DiffCommand, ContextParallelDumpDiffsCleanAgainstOneRank) {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  const std::string tag = std::to_string(::getpid());
  const std::filesystem::path a = tmp / ("mpusim_cp_diff_a." + tag);
  const std::filesystem::path b = tmp / ("mpusim_cp_diff_b." + tag);
  for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
  const std::string sample = Sample("gpt_context_parallel_cp2_t2_n4.json");
  std::string output;
  ASSERT_EQ(run_tests::Shell(run_tests::Mpiexec(4) + MPUSIM_BINARY + " run " + sample +
                                 " --dtype float64 --dump " + a.string(),
                             &output),
            0)
      << output;
  ASSERT_EQ(run_tests::Shell(run_tests::Mpiexec(1) + MPUSIM_BINARY + " run " + sample +
                                 " --dtype float64 --world-size 1 --tp 1 --cp 1 --dump " +
                                 b.string(),
                             &output),
            0)
      << output;
  const Result same = Mpusim({"diff", a.string(), b.string(), "--atol", "1e-12", "--rtol", "0"});
  EXPECT_EQ(same.code, 0) << same.out << same.err;
  EXPECT_NE(same.out.find("79 passed, 0 failed"), std::string::npos) << same.out;
  for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
}

// moe_grouped_gemm changes no number: Megatron's local spec builds SequentialMLP whatever the
// flag, so the experts keep their names (local_experts.<e>) and their initial values, and the
// two runs' dumps are equal to the bit (atol 0, rtol 0).
TEST(DiffCommand, GroupedGemmFlagChangesNoNumber) {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  const std::string tag = std::to_string(::getpid());
  std::ifstream in(Sample("gpt_moe_ep2_t2_sp_dp2_n4.json"));
  json config = json::parse(in);
  std::vector<std::filesystem::path> dumps;
  for (const bool grouped : {false, true}) {
    config["model"]["moe_grouped_gemm"] = grouped;
    const std::string name = std::string("mpusim_gg_") + (grouped ? "on." : "off.") + tag;
    const std::string path = WriteTemp(name + ".json", config.dump());
    dumps.push_back(tmp / name);
    std::filesystem::remove_all(dumps.back());
    std::string output;
    ASSERT_EQ(run_tests::Shell(run_tests::Mpiexec(4) + MPUSIM_BINARY + " run " + path + " --dump " +
                                   dumps.back().string(),
                               &output),
              0)
        << output;
  }
  const Result same =
      Mpusim({"diff", dumps[0].string(), dumps[1].string(), "--atol", "0", "--rtol", "0"});
  EXPECT_EQ(same.code, 0) << same.out << same.err;
  EXPECT_NE(same.out.find(" 0 failed"), std::string::npos) << same.out;
  EXPECT_NE(same.out.find("local_experts.3.linear_fc1.weight"), std::string::npos) << same.out;
  for (const auto& dir : dumps) std::filesystem::remove_all(dir);
}

// OpenBLAS's x86-64 kernel sets this CPU runs, from SSE3 up to its best (sim/blas_kernels.h):
// each sums a GEMM in another order, so a check whose verdict depends on the machine shows
// here. The ASan build runs the best set only: its numerics are the release build's.
std::vector<std::string> KernelSetsOfThisCpu() {
  const std::string best = mpusim::BestBlasKernelsForCpu();
  if (best.empty()) return {""};  // not x86-64: OpenBLAS's own choice
  if (mpusim::testing::kAddressSanitizer) return {best};
  std::vector<std::string> sets;
  for (const char* set : {"Prescott", "Haswell", "SkylakeX", "Cooperlake"}) {
    sets.push_back(set);
    if (best == set) return sets;
  }
  if (best == "Prescott") return {"Prescott"};
  return {"Prescott", best};  // Sandybridge, Nehalem or Core2
}

// On a CPU that OpenBLAS does not know it falls back to its SSE3 kernels; mpusim then pins
// the best set the CPU supports (sim/blas_kernels.h) and its run header says so. This CPU is
// known, so the test hook makes OPENBLAS_CORETYPE=Prescott stand for that fallback; a pinned
// set that fails the start-up GEMM check goes back to OpenBLAS's choice; a user's own
// OPENBLAS_CORETYPE is kept.
TEST(RunCommand, PinsTheBestBlasKernelsOverOpenBlasFallback) {
  const std::string best = mpusim::BestBlasKernelsForCpu();
  if (best.empty() || best == "Prescott") GTEST_SKIP() << "no kernel set above SSE3 here";
  const std::string run = run_tests::Mpiexec(2) + MPUSIM_BINARY + " run " +
                          Sample("lab_parallel_embedding_t2_n2.json") + " --no-check";
  const std::string fallback = "MPUSIM_OPENBLAS_PRETEND_CHOICE=1 OPENBLAS_CORETYPE=Prescott ";
  std::string output;
  ASSERT_EQ(run_tests::Shell(fallback + run, &output), 0) << output;
  EXPECT_NE(output.find("(" + best + " kernels, pinned by mpusim: OpenBLAS chose Prescott for "
                        "this CPU)"),
            std::string::npos)
      << output;
  ASSERT_EQ(run_tests::Shell(fallback + "MPUSIM_OPENBLAS_PRETEND_WRONG=1 " + run, &output), 0)
      << output;
  EXPECT_NE(output.find("(Prescott kernels, OpenBLAS's choice: the " + best +
                        " kernels failed the start-up GEMM check)"),
            std::string::npos)
      << output;
  ASSERT_EQ(run_tests::Shell("OPENBLAS_CORETYPE=Prescott " + run, &output), 0) << output;
  EXPECT_NE(output.find("(Prescott kernels, set by OPENBLAS_CORETYPE)"), std::string::npos)
      << output;
}

// Training spreads two correct float32 runs of different layouts apart by more than the fixed
// float32 tolerance (Adam divides by the root of tiny second moments): a 4-layer GPT trained
// 3 iterations on 1 rank and on tp 2 x pp 2 with sequence parallelism. Under every kernel set
// of this CPU both pass their checks (the optimizer state's allowance grows with the drift of
// the parameters its gradients came from: reference/trainer.h) and dump their error budgets,
// and diff allows each pair the sum of the two. Each run's worst margin is printed.
TEST(DiffCommand, TrainedFloat32LayoutsDiffCleanUnderEveryKernelSet) {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  const std::string tag = std::to_string(::getpid());
  json config = json::parse(std::ifstream(Sample("gpt_train_adam_p2_t2_n4.json")));
  config["model"]["num_layers"] = 4;
  config["run"]["train_iters"] = 3;
  config["run"]["seed"] = 1;
  config["optimizer"]["lr"] = 1.2e-3;
  config["optimizer"]["lr_warmup_iters"] = 0;
  const std::string layout = WriteTemp("mpusim_trained_t2p2." + tag + ".json", config.dump());
  config["parallel"] = {{"world_size", 1}};
  const std::string one = WriteTemp("mpusim_trained_n1." + tag + ".json", config.dump());
  // The summary's worst margin: the largest share of its allowance an element used.
  auto margin = [](const std::filesystem::path& summary) {
    const json s = json::parse(std::ifstream(summary));
    return fmt::format("{:.3f} ({})", s["check"]["max_used"].get<double>(),
                       s["check"]["max_used_tensor"].get<std::string>());
  };
  for (const std::string& kernels : KernelSetsOfThisCpu()) {
    SCOPED_TRACE("OPENBLAS_CORETYPE=" + kernels);
    const std::string env = kernels.empty() ? "" : "OPENBLAS_CORETYPE=" + kernels + " ";
    const std::filesystem::path a = tmp / ("mpusim_trained_a." + tag + kernels);
    const std::filesystem::path b = tmp / ("mpusim_trained_b." + tag + kernels);
    const std::filesystem::path sa = tmp / ("mpusim_trained_a." + tag + kernels + ".json");
    const std::filesystem::path sb = tmp / ("mpusim_trained_b." + tag + kernels + ".json");
    for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
    std::string output;
    ASSERT_EQ(run_tests::Shell(env + run_tests::Mpiexec(4) + MPUSIM_BINARY + " run " + layout +
                                   " --dump " + a.string() + " --summary " + sa.string(),
                               &output),
              0)
        << output;
    if (!kernels.empty()) {  // the header says which kernels ran, and why
      EXPECT_NE(output.find("(" + kernels + " kernels, set by OPENBLAS_CORETYPE)"),
                std::string::npos)
          << output;
    }
    ASSERT_EQ(run_tests::Shell(env + run_tests::Mpiexec(1) + MPUSIM_BINARY + " run " + one +
                                   " --dump " + b.string() + " --summary " + sb.string(),
                               &output),
              0)
        << output;
    const Result within = Mpusim({"diff", a.string(), b.string()});
    EXPECT_EQ(within.code, 0) << within.out << within.err;
    EXPECT_NE(within.out.find("299 of 299 tensors carry error budgets in both dumps"),
              std::string::npos)
        << within.out;
    EXPECT_NE(within.out.find("299 passed, 0 failed"), std::string::npos) << within.out;
    // The fixed float32 policy, given explicitly, fails some of them: what diff did before.
    const Result fixed =
        Mpusim({"diff", a.string(), b.string(), "--atol", "1e-5", "--rtol", "1e-4"});
    EXPECT_EQ(fixed.code, 1) << fixed.out;
    std::cout << fmt::format("[ kernels  ] {:<10} worst margin: tp 2 pp 2 sp {}, 1 rank {}\n",
                             kernels.empty() ? "default" : kernels, margin(sa), margin(sb));
    for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
    for (const auto& file : {sa, sb}) std::filesystem::remove(file);
  }
}

// Two layouts of the lab model (tp 2 on 2 ranks, tp 1 on 1 rank) dumped by the real binary
// compare equal tensor by tensor; a missing directory and an unknown tensor are bad input.
TEST(DiffCommand, TwoLayoutsOfOneModelCompareEqual) {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  const std::string tag = std::to_string(::getpid());
  const std::filesystem::path a = tmp / ("mpusim_diff_a." + tag);
  const std::filesystem::path b = tmp / ("mpusim_diff_b." + tag);
  std::filesystem::remove_all(a);
  std::filesystem::remove_all(b);
  std::ifstream in(Sample("lab_parallel_embedding_t2_n2.json"));
  json config = json::parse(in);
  config["parallel"]["world_size"] = 1;
  config["parallel"]["tensor_model_parallel_size"] = 1;
  config["run"]["dtype"] = "float64";
  const std::string t1 = WriteTemp("mpusim_diff_t1." + tag + ".json", config.dump());
  std::string output;
  ASSERT_EQ(run_tests::Shell(run_tests::Mpiexec(2) + MPUSIM_BINARY + " run " +
                                 Sample("lab_parallel_embedding_t2_n2.json") + " --dump " +
                                 a.string(),
                             &output),
            0)
      << output;
  ASSERT_EQ(run_tests::Shell(run_tests::Mpiexec(1) + MPUSIM_BINARY + " run " + t1 + " --dump " +
                                 b.string(),
                             &output),
            0)
      << output;
  // float32 tp 2 against float64 tp 1: the float32 tolerance applies.
  const Result same = Mpusim({"diff", a.string(), b.string()});
  EXPECT_EQ(same.code, 0) << same.out << same.err;
  EXPECT_NE(same.out.find("21 passed, 0 failed"), std::string::npos) << same.out;
  const Result js = Mpusim({"diff", a.string(), b.string(), "--format", "json"});
  ASSERT_EQ(js.code, 0) << js.err;
  EXPECT_EQ(json::parse(js.out)["failed"], 0);
  // An impossible tolerance makes the float32-vs-float64 rounding count as a failure.
  const Result strict = Mpusim({"diff", a.string(), b.string(), "--atol", "0", "--rtol", "0"});
  EXPECT_EQ(strict.code, 1) << strict.out;

  // The same model in bf16 mixed precision at tp 2: the manifest's storage dtype picks the
  // bfloat16 policy, also for the float32 main_grads; the float32 policy rejects it.
  const std::filesystem::path c = tmp / ("mpusim_diff_c." + tag);
  std::filesystem::remove_all(c);
  json mixed = json::parse(std::ifstream(Sample("lab_parallel_embedding_t2_n2.json")));
  mixed["parallel"]["bf16"] = true;
  mixed["run"].erase("dtype");
  const std::string bf16 = WriteTemp("mpusim_diff_bf16." + tag + ".json", mixed.dump());
  ASSERT_EQ(run_tests::Shell(run_tests::Mpiexec(2) + MPUSIM_BINARY + " run " + bf16 +
                                 " --dump " + c.string(),
                             &output),
            0)
      << output;
  EXPECT_NE(output.find("(cpu backend, bfloat16, seed 7)"), std::string::npos) << output;
  const Result mixed_diff = Mpusim({"diff", c.string(), b.string(), "--format", "json"});
  EXPECT_EQ(mixed_diff.code, 0) << mixed_diff.out;
  const json mixed_json = json::parse(mixed_diff.out);
  for (const json& t : mixed_json["tensors"]) {
    EXPECT_EQ(t["precision"], "bfloat16") << t["name"];
    if (t["name"] == "fc1.weight_grad") {
      EXPECT_EQ(t["dtype_a"], "float32");
    }
    if (t["name"] == "fc1.weight") {
      EXPECT_EQ(t["dtype_a"], "bfloat16");
    }
  }
  const Result as_float32 = Mpusim({"diff", c.string(), b.string(), "--atol", "1e-5", "--ntol",
                                    "0", "--rtol", "1e-4"});
  EXPECT_EQ(as_float32.code, 1) << as_float32.out;

  const Result missing = Mpusim({"diff", a.string(), (tmp / "no_such_dump_dir").string()});
  EXPECT_EQ(missing.code, 2);
  EXPECT_EQ(missing.out, "");
  EXPECT_EQ(std::count(missing.err.begin(), missing.err.end(), '\n'), 1) << missing.err;
  const Result bogus = Mpusim({"diff", a.string(), b.string(), "--tensors", "bogus"});
  EXPECT_EQ(bogus.code, 2);
  EXPECT_NE(bogus.err.find("'bogus'"), std::string::npos) << bogus.err;
}

// A dump says how it was made: the manifest and the summary record the effective config
// (after the command line's overrides) and the command line. diff of two runs that differ by
// seed says so in its first lines; dumps of different models are refused in one line.
TEST(DiffCommand, DumpsRecordHowTheyWereMadeAndDiffSaysWhatDiffers) {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  const std::string tag = std::to_string(::getpid());
  const std::filesystem::path a = tmp / ("mpusim_made_a." + tag);
  const std::filesystem::path b = tmp / ("mpusim_made_b." + tag);
  const std::filesystem::path c = tmp / ("mpusim_made_c." + tag);
  const std::filesystem::path summary = tmp / ("mpusim_made_b." + tag + ".summary.json");
  for (const auto& dir : {a, b, c}) std::filesystem::remove_all(dir);
  const std::string sample = Sample("lab_parallel_embedding_t2_n2.json");
  json narrow = json::parse(std::ifstream(sample));  // another model: 32 wide, not 64
  narrow["model"]["layers"][0]["embedding_dim"] = 32;
  narrow["model"]["layers"][1]["input_size"] = 32;
  narrow["model"]["layers"][2]["output_size"] = 32;
  const std::string narrow_file = WriteTemp("mpusim_made_narrow." + tag + ".json", narrow.dump());
  const std::string one_rank = " --world-size 1 --tp 1";
  std::string output;
  for (const auto& [dir, extra, config] :
       {std::tuple{a, std::string(), sample},
        std::tuple{b, " --seed 99 --summary " + summary.string(), sample},
        std::tuple{c, std::string(), narrow_file}}) {
    ASSERT_EQ(run_tests::Shell(run_tests::Mpiexec(1) + MPUSIM_BINARY + " run " + config +
                                   one_rank + extra + " --dump " + dir.string(),
                               &output),
              0)
        << output;
  }
  // The file says seed 7 and tp 2; the run had seed 99 and tp 1, and the dump says so.
  const json manifest = json::parse(std::ifstream(b / "manifest.json"));
  EXPECT_EQ(manifest["config"]["run"]["seed"], 99);
  EXPECT_EQ(manifest["config"]["parallel"]["tensor_model_parallel_size"], 1);
  EXPECT_EQ(manifest["config"]["parallel"]["world_size"], 1);
  EXPECT_EQ(manifest["config"]["description"], json::parse(std::ifstream(sample))["description"]);
  EXPECT_EQ(manifest["config_file"], sample);
  const std::string command = manifest["command_line"].get<std::string>();
  EXPECT_NE(command.find(" run " + sample + " --world-size 1 --tp 1 --seed 99 --summary "),
            std::string::npos)
      << command;
  const json summary_json = json::parse(std::ifstream(summary));
  EXPECT_EQ(summary_json["effective_config"], manifest["config"]);
  EXPECT_EQ(summary_json["command_line"], command);

  const Result seeds = Mpusim({"diff", a.string(), b.string()});
  EXPECT_EQ(seeds.code, 1) << seeds.out << seeds.err;  // other weights: the values differ
  std::istringstream lines(seeds.out);
  std::vector<std::string> head(4);
  for (std::string& line : head) std::getline(lines, line);
  EXPECT_EQ(head[2], "config: run.seed: 7 vs 99 (seed)") << seeds.out;
  EXPECT_EQ(head[3], "the runs differ in seed, expect differences") << seeds.out;
  for (const std::string& line : head) EXPECT_LE(line.size(), 100u) << line;
  const Result seeds_json = Mpusim({"diff", a.string(), b.string(), "--format", "json"});
  const json report = json::parse(seeds_json.out);
  EXPECT_EQ(report["config"]["differences"],
            json::parse(R"([{"key": "run.seed", "a": 7, "b": 99, "in_a": true, "in_b": true,
                             "change": "seed"}])"));
  EXPECT_EQ(report["config"]["command_line_b"], command);

  const Result models = Mpusim({"diff", a.string(), c.string()});
  ExpectUsageError(models,
                   "error: " + a.string() + " vs " + c.string() +
                       ": model.layers[0].embedding_dim: 64 vs 32: the dumps hold different "
                       "models (their tensors differ in name or shape; 2 more model keys "
                       "differ); diff compares runs of one model");
  for (const auto& dir : {a, b, c}) std::filesystem::remove_all(dir);
  std::filesystem::remove(summary);
}

}  // namespace diff_tests

// ---------------------------------------------------------------------------------------
// Hostile input: every case ends with one error line and exit 2, nothing on stdout.

namespace hostile_tests {

using run_tests::Mpiexec;
using run_tests::Shell;

void ExpectOneLineRefusal(const Result& r, const std::string& part) {
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(part), std::string::npos) << "wanted: " << part << "\ngot: " << r.err;
}

std::string Nested(size_t levels) { return std::string(levels, '[') + std::string(levels, ']'); }

TEST(HostileInput, ConfigsThatOnceCrashedOrWereAcceptedSilently) {
  struct Case {
    std::string text;
    std::string part;
  };
  const std::vector<Case> cases = {
      {R"({"parallel": {"world_size": 1e400}})", "number overflow parsing '1e400'"},
      {R"({"parallel": {"world_size": 8}, "zzz": -1e400})", "number overflow"},
      {R"({"parallel": {"world_size": 8}, "description": 1e400})", "number overflow"},
      {R"({"parallel": {"world_size": 8}, "description": )" + Nested(100'000) + "}",
       "nested deeper than 64 levels"},
      {R"({"parallel": {"world_size": 8, "world_size": 4}})",
       "parallel.world_size: invalid JSON: this key appears twice"},
      {R"({"parallel": {"world_size": 8}, "parallel": {"world_size": 4}})",
       "parallel: invalid JSON: this key appears twice"},
      {R"({"parallel": {"world_size": 8}} trailing)", "expected end of input"},
      {R"({"parallel": {"world_size": 8, "bad\nkey": 1}})", "parallel.bad\\nkey: unknown key"},
      {R"({"parallel": {"world_size": 8}, "description": "\u0000"})", ""},  // accepted: below
  };
  for (size_t i = 0; i + 1 < cases.size(); ++i) {
    const std::string path = WriteTemp(fmt::format("mpusim_hostile_{}.json", i), cases[i].text);
    for (const char* command : {"layout", "explain"}) {
      SCOPED_TRACE(fmt::format("{} case {}", command, i));
      ExpectOneLineRefusal(Mpusim({command, path}), cases[i].part);
    }
    SCOPED_TRACE(fmt::format("schedule case {}", i));
    ExpectOneLineRefusal(Mpusim({"schedule", path, "-m", "4"}), cases[i].part);
  }
  // An escaped NUL inside a string is valid JSON; the config is accepted.
  const std::string nul = WriteTemp("mpusim_hostile_nul.json", cases.back().text);
  EXPECT_EQ(Mpusim({"layout", nul}).code, 0);
  // A file name with a newline is named on one line.
  const std::string odd = WriteTemp("mpusim_hostile\nname.json", "{");
  ExpectOneLineRefusal(Mpusim({"layout", odd}), "mpusim_hostile\\nname.json: line 1, column 2");
}

TEST(HostileInput, HugeSizesAreRefusedUpFront) {
  // Whole-layout listings stop at 2^20 ranks; one rank's query works at any size.
  const std::string huge = WriteTemp("mpusim_hostile_world.json",
                                     R"({"parallel": {"world_size": 2147483647}})");
  ExpectOneLineRefusal(Mpusim({"layout", huge}), "2147483647 ranks is more than the 1048576");
  ExpectOneLineRefusal(Mpusim({"layout", huge, "--format", "json"}), "query one rank with --rank");
  const Result one = Mpusim({"layout", huge, "--rank", "2147483646", "--format", "json"});
  ASSERT_EQ(one.code, 0) << one.err;
  const json rank = json::parse(one.out);
  EXPECT_EQ(rank["groups"]["dp"]["group_size"], 2147483647);
  EXPECT_TRUE(rank["groups"]["dp"]["ranks"].is_null());
  EXPECT_EQ(rank["groups"]["tp"]["ranks"], json({2147483646}));
  // Past 2^20 ranks the node warnings look at the queried rank's groups only.
  const Result spans = Mpusim({"layout", "--world-size", "1073741824", "--tp", "16",
                               "--gpus-per-node", "8", "--rank", "5"});
  EXPECT_EQ(spans.code, 0) << spans.err;
  // expt_tp defaults to tp's size and groups: one warning for both.
  EXPECT_EQ(spans.err,
            "warning: rank 5's tp group (size 16) spans nodes with gpus_per_node 8: "
            "its collectives would cross the inter-node network; keep tp groups "
            "inside a node\n");
  const Result inside = Mpusim({"layout", "--world-size", "1073741824", "--tp", "8",
                                "--gpus-per-node", "8", "--rank", "5"});
  EXPECT_EQ(inside.err, "");
  ExpectOneLineRefusal(Mpusim({"schedule", "--world-size", "8", "--pp", "8", "-m", "2147483647"}),
                       "more than the 16777216 this planner lists");
  const Result layers = Mpusim({"layout", "--world-size", "8", "--pp", "2", "--num-layers",
                                "2147483646"});
  if (layers.code == 0) {  // the assignment is reported as impossible, not listed
    EXPECT_NE(layers.out.find("at most 1048576 layers"), std::string::npos) << layers.out;
  }
}

// ASan reserves terabytes of address space for its shadow memory up front, so an address-space
// cap would kill every sanitized run at its start; there only the deadline applies.
using mpusim::testing::kAddressSanitizer;

// The real binary on `args` in a child with at most 2 GiB of address space and 10 s of wall
// time (SIGKILL after: exit 137); stdout and stderr apart.
Result Bounded(const std::vector<std::string>& args) {
  static int calls = 0;
  const std::string base = (std::filesystem::temp_directory_path() /
                            fmt::format("mpusim_bounded.{}.{}", ::getpid(), ++calls))
                               .string();
  std::string command = fmt::format("{}exec timeout -s KILL 10 {}",
                                    kAddressSanitizer ? "" : "ulimit -v 2097152 && ",
                                    MPUSIM_BINARY);
  for (const std::string& arg : args) command += " '" + arg + "'";
  const int raw = std::system(
      ("(" + command + ") > " + base + ".out 2> " + base + ".err").c_str());
  const auto slurp = [](const std::string& path) {
    std::ifstream in(path);
    std::string text(std::istreambuf_iterator<char>(in), {});
    std::filesystem::remove(path);
    return text;
  };
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, slurp(base + ".out"), slurp(base + ".err")};
}

// Configs that are valid but absurdly large: every command ends within 10 s under 2 GiB,
// with its answer (exit 0) or one line naming the size and the limit (exit 2). Before the
// fix, explain on the tp 2^30 chain planned every tp rank and grew to 24 GB.
TEST(HostileInput, EveryCommandIsBoundedOnAbsurdSizes) {
  const std::string tp30 = WriteTemp(
      "mpusim_hostile_tp30.json",
      R"({"parallel": {"world_size": 1073741824, "tensor_model_parallel_size": 1073741824},)"
      R"( "model": {"layers": [{"name": "fc", "type": "ColumnParallelLinear",)"
      R"( "input_size": 1073741824, "output_size": 1073741824}]}})");
  // GPT layouts whose step-time link model once listed a group of 2^30 ranks (estimate out
  // of memory) or visited each of 2^29 groups (past 10 s), and whose advise tried every
  // number up to 2^30 as a divisor; a tp 2^20 world whose JSON sharding map (2^21 shards
  // and more) outgrew 2 GiB.
  const std::string gpt_tp30 = WriteTemp(
      "mpusim_hostile_gpt_tp30.json",
      R"({"parallel": {"world_size": 1073741824, "tensor_model_parallel_size": 1073741824},)"
      R"( "model": {"type": "gpt", "num_layers": 1, "hidden_size": 1073741824,)"
      R"( "num_attention_heads": 1073741824, "ffn_hidden_size": 1073741824,)"
      R"( "max_position_embeddings": 8, "vocab_size": 1073741824}})");
  const std::string gpt_cp29 = WriteTemp(
      "mpusim_hostile_gpt_cp29.json",
      R"({"parallel": {"world_size": 536870912, "context_parallel_size": 536870912},)"
      R"( "model": {"type": "gpt", "num_layers": 1, "hidden_size": 64, "num_attention_heads": 8,)"
      R"( "ffn_hidden_size": 128, "position_embedding_type": "rope", "vocab_size": 256}})");
  const std::string gpt_tp20 = WriteTemp(
      "mpusim_hostile_gpt_tp20.json",
      R"({"parallel": {"world_size": 1048576, "tensor_model_parallel_size": 1048576},)"
      R"( "model": {"type": "gpt", "num_layers": 1, "hidden_size": 1048576,)"
      R"( "num_attention_heads": 1048576, "ffn_hidden_size": 1048576, "vocab_size": 1048576}})");
  const std::vector<std::string> tp30_batch = {"--global-batch-size", "4", "--seq-length", "8"};
  const std::vector<std::string> cp29_batch = {"--global-batch-size", "4", "--seq-length",
                                               "1073741824"};
  const auto with = [](std::vector<std::string> head, const std::vector<std::string>& tail) {
    head.insert(head.end(), tail.begin(), tail.end());
    return head;
  };
  struct Case {
    std::vector<std::string> args;
    std::string refusal;  // "" : exit 0
  };
  const std::string listing = "1073741824 ranks is more than the 1048576";
  const std::vector<Case> cases = {
      {{"layout", tp30}, listing},
      {{"layout", tp30, "--format", "json"}, listing},
      {{"layout", tp30, "--format", "picture"}, listing},
      {{"layout", tp30, "--format", "html"}, listing},
      {{"layout", tp30, "--sweep"}, "is more than the 1048576 --sweep covers"},
      {{"layout", tp30, "--sweep", "--format", "json"}, "is more than the 1048576 --sweep covers"},
      {{"layout", tp30, "--rank", "1073741823"}, ""},
      {{"layout", tp30, "--rank", "5", "--format", "json"}, ""},
      {{"explain", tp30}, "sharding map covers; query one rank with --rank R"},
      {{"explain", tp30, "--format", "json"}, "sharding map covers; query one rank with --rank"},
      {{"explain", tp30, "--rank", "1073741823"}, ""},
      {{"explain", tp30, "--rank", "5", "--format", "json"}, ""},
      {{"schedule", tp30, "-m", "4"}, ""},
      {{"schedule", tp30, "-m", "4", "--format", "svg"}, ""},
      {{"estimate", tp30}, ""},
      {{"estimate", tp30, "--format", "json"}, ""},
      {{"estimate", tp30, "--format", "html"}, ""},
      {{"advise", tp30, "--global-batch-size", "1"}, "advise needs a GPT model"},
      {{"sweep", tp30, "--world-size", "2"}, "run: is required by mpusim sweep"},
      {{"run", tp30}, "run: is required by mpusim run"},
      {with({"estimate", gpt_tp30}, tp30_batch), ""},
      {with({"estimate", gpt_tp30, "--format", "json"}, tp30_batch), ""},
      {with({"advise", gpt_tp30}, tp30_batch), ""},
      {with({"estimate", gpt_cp29}, cp29_batch), ""},
      {with({"estimate", gpt_cp29, "--format", "json"}, cp29_batch), ""},
      {with({"advise", gpt_cp29}, cp29_batch), ""},
      {{"explain", gpt_tp20, "--format", "json"}, "shards, more than the 65536 its JSON lists"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{}", fmt::join(c.args, " ")));
    const Result r = Bounded(c.args);
    if (c.refusal.empty()) {
      EXPECT_EQ(r.code, 0) << r.err;
      EXPECT_NE(r.out, "");
    } else {
      ExpectOneLineRefusal(r, c.refusal);
    }
  }
  // One rank's sharding map: its slice by the formula, no list of other ranks.
  const Result one = Bounded({"explain", tp30, "--rank", "1073741823"});
  EXPECT_NE(one.out.find("A0= [1073741824, 1], A1= [1073741824, 1], A2= [1073741824, 1], ..., "
                         "A1073741823= [1073741824, 1]"),
            std::string::npos)
      << one.out;
  EXPECT_NE(one.out.find("    tp 1073741823: rows [1073741823, 1073741824)\n"), std::string::npos)
      << one.out;
  const Result as_json = Bounded({"explain", tp30, "--rank", "5", "--format", "json"});
  ASSERT_EQ(as_json.code, 0) << as_json.err;
  EXPECT_EQ(json::parse(as_json.out)["parameters"][0]["shards"],
            json::parse(R"([{"tp_rank": 5, "ranges": [[5, 6]]}])"));
}

TEST(HostileInput, RunPreflightRefusesWhatCannotFit) {
  // 2^21 x 1 weights and 2^41 token rows: the element count times 4 bytes wraps 64 bits.
  const std::string wrap = WriteTemp(
      "mpusim_hostile_wrap.json",
      R"({"parallel": {"world_size": 1}, "model": {"layers": [{"name": "fc", "type": )"
      R"("ColumnParallelLinear", "input_size": 2097152, "output_size": 1}]}, "run": )"
      R"({"seq_length": 1048576, "micro_batch_size": 2097152}})");
  std::string output;
  EXPECT_EQ(Shell(Mpiexec(1) + MPUSIM_BINARY + " run " + wrap, &output), 2) << output;
  EXPECT_NE(output.find("run: one rank would hold more than 16 EiB"), std::string::npos) << output;
  EXPECT_NE(output.find("fc.saved_input [2199023255552, 2097152] float32"), std::string::npos)
      << output;
  // A sample that fits the machine does not fit --max-memory 1M; --no-check drops the
  // reference's share from the estimate.
  const std::string lab = Sample("lab_parallel_embedding_t2_n2.json");
  EXPECT_EQ(Shell(Mpiexec(2) + MPUSIM_BINARY + " run " + lab + " --max-memory 1M", &output), 2);
  EXPECT_NE(output.find("more than the 1.0 MiB allowed (--max-memory)"), std::string::npos)
      << output;
  EXPECT_EQ(output.find("check against"), std::string::npos) << output;  // nothing ran
  EXPECT_EQ(Shell(Mpiexec(2) + MPUSIM_BINARY + " run " + lab + " --max-memory 64M", &output), 0)
      << output;
  EXPECT_EQ(Shell(Mpiexec(1) + MPUSIM_BINARY + " run " + lab + " --max-memory 12Q", &output), 2);
  EXPECT_NE(output.find("--max-memory"), std::string::npos) << output;
  // The most micro-batches a run takes, without a pipeline: the preflight walks one
  // micro-batch, not 2^31 of them (no internal error, no memory in proportion).
  EXPECT_EQ(Shell(Mpiexec(1) + MPUSIM_BINARY + " run " +
                      Sample("gpt_qk_norm_partial_rope_t2_n2.json") +
                      " --tp 1 --world-size 1 --num-microbatches 2147483647 --max-memory 1M",
                  &output),
            2)
      << output;
  EXPECT_NE(output.find("more than the 1.0 MiB allowed (--max-memory)"), std::string::npos)
      << output;
}

TEST(HostileInput, DumpsAreWholeOrAbsentAndNeverMixed) {
  namespace fs = std::filesystem;
  const fs::path tmp = fs::temp_directory_path() / fmt::format("mpusim_hostile_dump.{}", ::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  const std::string lab = Sample("lab_parallel_embedding_t2_n2.json");
  const std::string run = Mpiexec(2) + MPUSIM_BINARY + " run " + lab + " --dump ";
  std::string output;
  ASSERT_EQ(Shell(run + (tmp / "a").string(), &output), 0) << output;
  ASSERT_EQ(Shell(run + (tmp / "b").string(), &output), 0) << output;
  // Dumping again replaces the earlier dump whole and leaves no temporary siblings.
  ASSERT_EQ(Shell(run + (tmp / "a").string(), &output), 0) << output;
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(tmp)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(Mpusim({"diff", (tmp / "a").string(), (tmp / "b").string()}).code, 0);
  // One rank file from the other run: refused, not diffed.
  fs::copy_file(tmp / "b" / "rank00001.safetensors", tmp / "a" / "rank00001.safetensors",
                fs::copy_options::overwrite_existing);
  ExpectOneLineRefusal(Mpusim({"diff", (tmp / "a").string(), (tmp / "b").string()}),
                       "this file comes from another run than manifest.json");
  // A --dump that cannot be written fails before anything is printed.
  fs::create_directories(tmp / "not_a_dump");
  std::ofstream(tmp / "not_a_dump" / "notes.txt") << "keep me";
  EXPECT_EQ(Shell(run + (tmp / "not_a_dump").string(), &output), 2);
  EXPECT_EQ(output.rfind("error: command line: --dump: '", 0), 0u) << output;
  EXPECT_NE(output.find("is not a mpusim dump"), std::string::npos) << output;
  EXPECT_TRUE(fs::exists(tmp / "not_a_dump" / "notes.txt"));
  EXPECT_EQ(Shell(run + "/proc/mpusim_cannot_be_here", &output), 2);
  EXPECT_EQ(output.rfind("error: command line: --dump: cannot create a directory", 0), 0u)
      << output;
  fs::remove_all(tmp);
}

// An error that the command line's overrides cause names them: the field's own flag, or the
// overrides as typed when the file alone is valid; the model is judged before the rank count;
// the wrong-world-size hint keeps the overrides. A file that is wrong by itself is still
// named as the source.
TEST(HostileInput, OverrideErrorsNameTheirFlags) {
  const std::string gpt = Sample("gpt_tiny_t2_sp_dp2_n4.json");
  const std::string run = Mpiexec(4) + MPUSIM_BINARY + " run " + gpt;
  std::string output;
  const auto first_line = [&] { return output.substr(0, output.find('\n')); };
  EXPECT_EQ(Shell(run + " --tp 3", &output), 2);
  EXPECT_EQ(first_line(),
            "error: command line: --tp 3: parallel.world_size: 4 is not divisible by "
            "tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size "
            "= 3 * 1 * 1");
  // 16 ranks are not needed to hear that the heads do not split 16 ways.
  EXPECT_EQ(Shell(run + " --world-size 16 --tp 16", &output), 2);
  EXPECT_EQ(first_line(),
            "error: command line: --world-size 16 --tp 16: model.num_attention_heads: 8 is not "
            "divisible by tensor_model_parallel_size 16");
  EXPECT_EQ(Shell(Mpiexec(2) + MPUSIM_BINARY + " run " + gpt + " --dtype float32 --no-sp", &output),
            2);
  EXPECT_NE(first_line().find("; run: mpirun -n 4 "), std::string::npos) << output;
  EXPECT_NE(first_line().find(gpt + " --dtype float32 --no-sp"), std::string::npos) << output;
  ExpectOneLineRefusal(Mpusim({"explain", gpt, "--tp", "3"}),
                       "error: command line: --tp 3: parallel.world_size: 4 is not divisible");
  // The file itself asks for tp 3 of 4 ranks: the file is the source, not --pp.
  const std::string bad = WriteTemp(
      "bad_tp.json",
      R"({"parallel": {"world_size": 4, "tensor_model_parallel_size": 3}})");
  const Result r = Mpusim({"layout", bad, "--pp", "1"});
  ExpectOneLineRefusal(r, "error: " + bad + ": parallel.world_size: 4 is not divisible");
}

// --trace, --summary and --dump are written by rank 0 after the run; a path that cannot be
// written is refused before anything runs, naming the flag (it used to crash the job after the
// run, and --dump made a missing parent).
TEST(HostileInput, OutputFilesAreCheckedBeforeTheRun) {
  namespace fs = std::filesystem;
  const fs::path tmp = fs::temp_directory_path() / fmt::format("mpusim_outputs.{}", ::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  const std::string run =
      Mpiexec(2) + MPUSIM_BINARY + " run " + Sample("lab_parallel_embedding_t2_n2.json");
  std::string output;
  const std::string missing = (tmp / "no" / "such" / "t.json").string();
  EXPECT_EQ(Shell(run + " --trace " + missing, &output), 2) << output;
  EXPECT_EQ(output.substr(0, output.find('\n') + 1),
            fmt::format("error: command line: --trace: cannot write '{}': there is no "
                        "directory '{}'\n",
                        missing, (tmp / "no" / "such").string()));
  EXPECT_EQ(output.find("check"), std::string::npos) << output;  // nothing ran
  // --dump follows the same rule: its directory is made, its parent is not.
  const std::string dump = (tmp / "no" / "such" / "dump").string();
  EXPECT_EQ(Shell(run + " --dump " + dump, &output), 2) << output;
  EXPECT_EQ(output.substr(0, output.find('\n') + 1),
            fmt::format("error: command line: --dump: cannot write '{}': there is no "
                        "directory '{}'\n",
                        dump, (tmp / "no" / "such").string()));
  EXPECT_FALSE(fs::exists(tmp / "no"));
  EXPECT_EQ(Shell(run + " --summary " + tmp.string(), &output), 2) << output;
  EXPECT_EQ(output.substr(0, output.find('\n') + 1),
            fmt::format("error: command line: --summary: '{}' is a directory; give a "
                        "file name\n",
                        tmp.string()));
  EXPECT_EQ(Shell(run + " --trace /proc/mpusim_trace.json", &output), 2) << output;
  EXPECT_EQ(output.rfind("error: command line: --trace: cannot write '/proc/mpusim_trace.json': "
                         "the directory '/proc' takes no new file",
                         0),
            0u)
      << output;
  // Both good: both written, and the directory holds nothing else (the probe is gone).
  EXPECT_EQ(Shell(run + " --summary " + (tmp / "s.json").string() + " --trace " +
                      (tmp / "t.json").string(),
                  &output),
            0)
      << output;
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(tmp)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"s.json", "t.json"}));
  fs::remove_all(tmp);
}

}  // namespace hostile_tests

// Multi-token prediction: a float64 dump of two depths on tp 2 with sequence parallelism and
// pp 2 (the depths and the last stage's copy of the untied word embeddings on pp rank 1) diffs
// clean against one rank with the same data-parallel split (one dp rank of 2 samples).
TEST(DiffCommand, MultiTokenPredictionDumpDiffsCleanAgainstOneRank) {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  const std::string tag = std::to_string(::getpid());
  const std::filesystem::path a = tmp / ("mpusim_mtp_diff_a." + tag);
  const std::filesystem::path b = tmp / ("mpusim_mtp_diff_b." + tag);
  for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
  json config = json::parse(std::ifstream(Sample("gpt_qk_norm_partial_rope_t2_n2.json")));
  config["model"]["mtp_num_layers"] = 2;
  config["model"]["share_embeddings_and_output_weights"] = false;
  config["run"]["dtype"] = "float64";
  config["run"]["seq_length"] = 16;
  config["parallel"]["world_size"] = 4;
  config["parallel"]["pipeline_model_parallel_size"] = 2;
  const std::string four = WriteTemp("mpusim_mtp_n4." + tag + ".json", config.dump());
  config["parallel"] = {{"world_size", 1}};
  const std::string one = WriteTemp("mpusim_mtp_n1." + tag + ".json", config.dump());
  std::string output;
  ASSERT_EQ(run_tests::Shell(
                run_tests::Mpiexec(4) + MPUSIM_BINARY + " run " + four + " --dump " + a.string(),
                &output),
            0)
      << output;
  ASSERT_EQ(
      run_tests::Shell(
          run_tests::Mpiexec(1) + MPUSIM_BINARY + " run " + one + " --dump " + b.string(), &output),
      0)
      << output;
  const Result same = Mpusim(
      {"diff", a.string(), b.string(), "--atol", "1e-12", "--rtol", "0", "--format", "json"});
  EXPECT_EQ(same.code, 0) << same.out << same.err;
  int64_t mtp_tensors = 0;
  const json report = json::parse(same.out);
  for (const json& t : report["tensors"]) {
    if (!t["name"].get<std::string>().starts_with("mtp.layers.")) continue;
    ++mtp_tensors;
    EXPECT_EQ(t["pass"], true) << t.dump();
  }
  // Both depths' parameters, activations and their gradients.
  EXPECT_GT(mtp_tensors, 100) << same.out;
  const Result explained = Mpusim({"explain", four});
  ASSERT_EQ(explained.code, 0) << explained.err;
  EXPECT_NE(explained.out.find("embedding.word_embeddings.weight"), std::string::npos);
  EXPECT_NE(explained.out.find("the multi-token prediction depths embed with it"),
            std::string::npos)
      << explained.out;
  EXPECT_NE(explained.out.find("final norm, 2 MTP depths, output layer, loss"), std::string::npos)
      << explained.out;
  for (const auto& dir : {a, b}) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mpusim::cli
