// model.attention_backend (Megatron's AttnBackend) in `mpusim estimate` and `advise`: flash /
// fused against unfused attention differ by exactly the s x s terms counted here by hand
// (the activations' probabilities, the executed FLOPs of the core attention and its seconds),
// "auto" resolves per GPU and dtype as TransformerEngine does, the cp ring's sends hide only
// behind one ring step's small block, and bad values are refused naming the field.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "tests/cli/cli_test_util.h"

namespace mpusim::cli {
namespace {

using mpusim::cli::test_util::Result;
using mpusim::cli::test_util::Mpusim;
using mpusim::cli::test_util::ExpectUsageError;
using mpusim::cli::test_util::WriteTemp;

using nlohmann::json;

// A GPT of 4 layers (tp 2, pp 2: 2 layers a stage) on 2048 positions, dropout on, Adam.
json Gpt(const std::string& dtype, const std::string& backend) {
  json config = {
      {"parallel",
       {{"world_size", 4}, {"tensor_model_parallel_size", 2}, {"pipeline_model_parallel_size", 2}}},
      {"model",
       {{"type", "gpt"},
        {"num_layers", 4},
        {"hidden_size", 1024},
        {"num_attention_heads", 16},
        {"vocab_size", 32000},
        {"hidden_dropout", 0.1},
        {"attention_dropout", 0.1}}},
      {"run",
       {{"dtype", dtype}, {"seq_length", 2048}, {"micro_batch_size", 2}, {"global_batch_size", 8}}},
      {"optimizer", {{"optimizer", "adam"}, {"lr", 1e-4}}}};
  if (!backend.empty()) config["model"]["attention_backend"] = backend;
  return config;
}

json Estimate(const json& config, const std::string& name, const std::string& gpu) {
  const Result r = Mpusim(
      {"estimate", WriteTemp(name + ".json", config.dump()), "--gpu", gpu, "--format", "json"});
  EXPECT_EQ(r.code, 0) << r.err;
  return r.code == 0 ? json::parse(r.out) : json();
}

// The H100 preset's figures (core/estimate/gpu_spec.cc, docs/estimate.md, "The time model").
// kGemm: the GEMM curve's ceiling, the MAMF over the peak, at which materialised attention's
// scores and context run.
constexpr double kPeak = 989.4e12, kGemm = 794.5 / 989.4, kHbm = 3350e9 * 0.8;
constexpr double kForward = 0.605, kBackward = 0.534, kHalfForward = 105, kHalfBackward = 374;

// Flash against unfused on the same layout, bfloat16 on an H100: the activations differ by
// each stashed layer's probabilities (softmax output, dropout mask and output: b a s^2 (2 + 1
// + 2) / t) less its float32 log-sum-exp (4 b a s / t); the executed FLOPs by the core
// attention's (unfused: the full s x s, 3 x; flash: the 17 of 32 half-blocks a causal mask
// keeps of 16 x 16 tiles of 128, forward and a backward of 2.5 x, the recomputed QK^T
// included); Megatron's model FLOPs not at all; the compute time by those FLOPs at their
// efficiencies and the unfused softmax's and dropout's bytes.
TEST(AttentionBackend, FlashAndUnfusedDifferByTheScoresTerms) {
  const json flash = Estimate(Gpt("bfloat16", "flash"), "flash", "h100-80gb");
  const json unfused = Estimate(Gpt("bfloat16", "unfused"), "unfused", "h100-80gb");
  ASSERT_TRUE(flash.is_object() && unfused.is_object());
  EXPECT_EQ(flash.at("attention_backend"), "flash");
  EXPECT_EQ(flash.at("attention_backend_requested"), "flash");
  EXPECT_EQ(unfused.at("attention_backend"), "unfused");
  const double b = 2, s = 2048, a = 16, t = 2, d = 64, e = 2, M = 4, layers = 2;
  // Activations: every stage, as many stashes of 2 layers.
  for (size_t stage = 0; stage < 2; ++stage) {
    const json& f = flash.at("stages")[stage];
    const json& u = unfused.at("stages")[stage];
    const double stashes = f.at("peak_stashes");
    ASSERT_EQ(stashes, u.at("peak_stashes").get<double>());
    ASSERT_GT(stashes, 0);
    const double probabilities = b * a * s * s * (e + 1 + e) / t, lse = 4 * b * a * s / t;
    EXPECT_NEAR(u.at("memory").at("activations").get<double>() -
                    f.at("memory").at("activations").get<double>(),
                stashes * layers * (probabilities - lse), 1)
        << "stage " << stage;
    EXPECT_EQ(u.at("memory").at("buffers"), f.at("memory").at("buffers"));
  }
  // FLOPs: the busiest stage's rank (the last, with the logits), 4 micro-batches of 2 layers.
  const double full = 2 * 2 * b * (a / t) * s * s * d;  // QK^T and PV over every pair
  const double tiles = s / 128, causal = (tiles + 1) / (2 * tiles);
  EXPECT_NEAR(unfused.at("flops_per_rank").get<double>() - flash.at("flops_per_rank").get<double>(),
              M * layers * (3 * full - 3.5 * full * causal), 1e-6 * full);
  EXPECT_EQ(unfused.at("model_flops_per_iteration"), flash.at("model_flops_per_iteration"));
  // Seconds: unfused, the GEMMs at the ceiling and the scale-mask-softmax (read, write) and dropout
  // (read, write, mask) through memory, backward twice; flash, one kernel over an average of
  // s x 17/32 keys per query tile at the measured curve.
  const double scores = b * (a / t) * s * s;
  const double unfused_s =
      3 * (full / (kPeak * kGemm) + (2 * scores * e + scores * (2 * e + 1)) / kHbm);
  const double keys = s * causal;
  const double flash_s = full * causal / (kPeak * kForward * keys / (keys + kHalfForward)) +
                         2.5 * full * causal / (kPeak * kBackward * keys / (keys + kHalfBackward));
  EXPECT_NEAR(unfused.at("time").at("compute_s").get<double>() -
                  flash.at("time").at("compute_s").get<double>(),
              M * layers * (unfused_s - flash_s), 1e-9 * unfused_s);
}

// Under context parallelism 2, flash attention keeps the float32 log-sum-exp of each of a
// rank's s / 2 query rows with every cp_comm_type; materialised attention keeps the
// probabilities of those rows against every key under all_gather (and of every row of half
// the heads under a2a: as many), the log-sum-exp under the ring. all_gather's gathered keys
// and values are kept either way.
TEST(AttentionBackend, ContextParallelKeepsTheLogSumExpWithEveryCommType) {
  const double b = 2, s = 2048, a = 16, t = 2, e = 2, cp = 2, layers = 2;
  for (const std::string type : {"all_gather", "a2a", "p2p"}) {
    SCOPED_TRACE(type);
    const auto with = [&](const std::string& backend) {
      json config = Gpt("bfloat16", backend);
      config["parallel"]["world_size"] = 8;
      config["parallel"]["context_parallel_size"] = 2;
      config["model"]["cp_comm_type"] = type;
      return Estimate(config, "cp_" + type + "_" + backend, "h100-80gb");
    };
    const json flash = with("flash"), unfused = with("unfused");
    ASSERT_TRUE(flash.is_object() && unfused.is_object());
    const json& f = flash.at("stages")[0];
    const json& u = unfused.at("stages")[0];
    const double stashes = f.at("peak_stashes");
    const double lse = 4 * b * a * (s / cp) / t;
    const double probabilities = b * a * (s / cp) * s * (e + 1 + e) / t;
    EXPECT_NEAR(u.at("memory").at("activations").get<double>() -
                    f.at("memory").at("activations").get<double>(),
                type == "p2p" ? 0 : stashes * layers * (probabilities - lse), 1);
  }
}

// "auto" (Megatron's default) resolves as TransformerEngine's get_attention_backend: cuDNN's
// fused attention for 16-bit dtypes on compute capability 9.0 (H100, H200), FlashAttention on
// 8.x (A100), unfused for float32 or an older GPU (a GPU file's compute_capability).
TEST(AttentionBackend, AutoResolvesPerGpuAndDtype) {
  const std::string turing =
      WriteTemp("turing.json", R"({"base": "h100-80gb", "compute_capability": 75})");
  struct Case {
    const char* dtype;
    std::string gpu;
    const char* backend;
  };
  for (const Case& c : std::vector<Case>{{"bfloat16", "h100-80gb", "fused"},
                                         {"bfloat16", "h200", "fused"},
                                         {"float16", "a100-80gb", "flash"},
                                         {"bfloat16", "a100-80gb", "flash"},
                                         {"float32", "h100-80gb", "unfused"},
                                         {"float32", "a100-80gb", "unfused"},
                                         {"bfloat16", turing, "unfused"}}) {
    SCOPED_TRACE(fmt::format("{} on {}", c.dtype, c.gpu));
    const json doc = Estimate(Gpt(c.dtype, ""), "auto", c.gpu);
    ASSERT_TRUE(doc.is_object());
    EXPECT_EQ(doc.at("attention_backend"), c.backend);
    EXPECT_EQ(doc.at("attention_backend_requested"), "auto");
  }
  // The text names what it counts, and why.
  const Result text = Mpusim(
      {"estimate", WriteTemp("auto.json", Gpt("bfloat16", "").dump()), "--gpu", "h100-80gb"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("  with attention_backend \"fused\" (auto, bfloat16 on compute "
                          "capability 9.0: TransformerEngine prefers cuDNN's fused attention on "
                          "Hopper and newer): keeps each query row's float32 log-sum-exp, not "
                          "the s x s probabilities\n"),
            std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("its attention keeps the probabilities whatever attention_backend "
                          "says"),
            std::string::npos)
      << text.out;
  // So does the HTML page, and the JSON its script reads has the GPU's figures.
  const Result html = Mpusim({"estimate", WriteTemp("auto_html.json", Gpt("bfloat16", "").dump()),
                              "--gpu", "a100-80gb", "--format", "html"});
  ASSERT_EQ(html.code, 0) << html.err;
  EXPECT_NE(html.out.find("Counted with attention_backend &quot;flash&quot; (auto, bfloat16 on "
                          "compute capability 8.0"),
            std::string::npos)
      << html.out.substr(0, 3000);
  const json a100 = Estimate(Gpt("bfloat16", ""), "a100", "a100-80gb");
  EXPECT_EQ(a100.at("gpu").at("compute_capability"), 80);
  EXPECT_EQ(a100.at("gpu").at("attention_efficiency_forward"), 0.73);
  EXPECT_EQ(a100.at("gpu").at("attention_efficiency_backward"), 0.63);
  // advise counts the same.
  const Result advise =
      Mpusim({"advise", WriteTemp("advise.json", Gpt("bfloat16", "").dump()), "--global-batch-size",
              "8", "--gpu", "a100-80gb", "--format", "json"});
  ASSERT_EQ(advise.code, 0) << advise.err;
  EXPECT_EQ(json::parse(advise.out).at("attention_backend"), "flash");
}

// One line naming the field, exit 2: an unknown backend, flash or fused where
// TransformerEngine has neither (float32), and a GPU file's bad compute capability or
// attention efficiency.
TEST(AttentionBackend, BadValuesAreRefusedNamingTheField) {
  const std::string typo = WriteTemp("typo.json", Gpt("bfloat16", "flashy").dump());
  Result r = Mpusim({"estimate", typo});
  ExpectUsageError(r, "error: " + typo +
                          ": model.attention_backend: must be \"flash\", \"fused\", \"unfused\", "
                          "\"local\" or \"auto\", got string \"flashy\"");
  const std::string float32 = WriteTemp("flash32.json", Gpt("float32", "fused").dump());
  r = Mpusim({"estimate", float32});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "error: " + float32 +
                       ": model.attention_backend: \"fused\" needs bfloat16 or float16 on a GPU "
                       "of compute capability 8.0 or newer (TransformerEngine's "
                       "get_attention_backend); this run is float32 on compute capability 9.0: "
                       "use \"unfused\", \"local\" or \"auto\"\n");
  r = Mpusim({"advise", float32, "--global-batch-size", "8"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("model.attention_backend: \"fused\" needs bfloat16"), std::string::npos)
      << r.err;
  // --attention-backend sets it from the command line, and its errors name the flag.
  r = Mpusim({"estimate", WriteTemp("f32.json", Gpt("float32", "").dump()), "--attention-backend",
              "flash"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "error: command line: --attention-backend flash: \"flash\" needs bfloat16 or "
            "float16 on a GPU of compute capability 8.0 or newer (TransformerEngine's "
            "get_attention_backend); this run is float32 on compute capability 9.0: use "
            "\"unfused\", \"local\" or \"auto\"\n");
  const std::string ok = WriteTemp("ok.json", Gpt("bfloat16", "").dump());
  const Result flag =
      Mpusim({"estimate", ok, "--attention-backend", "unfused", "--format", "json"});
  ASSERT_EQ(flag.code, 0) << flag.err;
  const json by_flag = json::parse(flag.out);
  const json by_file = Estimate(Gpt("bfloat16", "unfused"), "by_file", "h100-80gb");
  EXPECT_EQ(by_flag.at("attention_backend"), "unfused");
  EXPECT_EQ(by_flag.at("stages"), by_file.at("stages"));
  const std::string cc = WriteTemp("cc.json", R"({"compute_capability": 8.5})");
  r = Mpusim({"estimate", ok, "--gpu", cc});
  ExpectUsageError(r, "error: command line: --gpu " + cc +
                          ".compute_capability: must be a whole number from 10 to 999 (major x 10 "
                          "+ minor: 80 A100, 90 H100, 100 B200), got number 8.5");
  const std::string eff = WriteTemp("eff.json", R"({"attention_efficiency_backward": 1.2})");
  r = Mpusim({"estimate", ok, "--gpu", eff});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "error: command line: --gpu " + eff +
                       ".attention_efficiency_backward: number 1.2 is above 1; an efficiency is "
                       "in (0, 1]\n");
}

// The cp ring under flash attention (Megatron's default cp_comm_type, bfloat16 on an H100):
// cp 8 on 4096 positions cuts a rank's attention into ring steps of half blocks of
// c = 256 keys by 2c queries, which run at the curve's efficiency for 256 keys, not the whole
// sequence's; each of the cp - 1 sends of a rank's keys and values (2 x 512 x 8 groups x 128
// x 2 bytes over NVLink) is exposed by what it takes beyond its step's block, forward, and
// the two sends (keys and values, their gradients) beyond the block's backward; the ring's
// kernels and its merges of partial results cost what all_gather's one kernel does not.
TEST(AttentionBackend, TheCpRingHidesItsSendsOnlyBehindOneBlock) {
  const json config = {{"parallel", {{"world_size", 8}, {"context_parallel_size", 8}}},
                       {"model",
                        {{"type", "gpt"},
                         {"num_layers", 2},
                         {"hidden_size", 4096},
                         {"num_attention_heads", 32},
                         {"num_query_groups", 8},
                         {"ffn_hidden_size", 14336},
                         {"activation", "swiglu"},
                         {"normalization", "RMSNorm"},
                         {"position_embedding_type", "rope"},
                         {"add_bias_linear", false},
                         {"hidden_dropout", 0.0},
                         {"attention_dropout", 0.0},
                         {"vocab_size", 32000}}},
                       {"run",
                        {{"dtype", "bfloat16"},
                         {"seq_length", 4096},
                         {"micro_batch_size", 1},
                         {"global_batch_size", 1}}}};
  const json doc = Estimate(config, "ring", "h100-80gb");
  ASSERT_TRUE(doc.is_object());
  EXPECT_EQ(doc.at("attention_backend"), "fused");
  const double cp = 8, s = 4096, heads = 32, groups = 8, d = 128, e = 2, layers = 2;
  const double c = s / (2 * cp);
  const double step = 2 * 2 * heads * d * 2 * c * c;  // QK^T and PV of a half block
  const double forward = step / (kPeak * kForward * c / (c + kHalfForward));
  const double backward = 2.5 * step / (kPeak * kBackward * c / (c + kHalfBackward));
  const double send = 2 * (s / cp) * groups * d * e / (450e9 * 0.8) + 5e-6;
  const double exposed =
      (cp - 1) * (std::max(0.0, send - forward) + std::max(0.0, 2 * send - backward));
  ASSERT_GT(exposed, 0);  // the case is one where the small blocks do not hide the sends
  EXPECT_NEAR(doc.at("time").at("cp_comm_s").get<double>(), layers * exposed, 1e-12);
  // The ring's kernels against all_gather's one kernel over the rank's 512 queries and every
  // key (the GEMMs are the same): the diagonal step, causal over 512 x 512 (5 of 8 half
  // tiles), and 7 half blocks at 256 keys, forward and backward; plus merging the steps'
  // partial results through memory: forward, 8 outputs read (2 bytes) into a float32 output
  // (read and write) and the cast back (4 + 2), backward, 8 times dq and dk, dv added (read,
  // read, write, 2 bytes each).
  json gather = config;
  gather["model"]["cp_comm_type"] = "all_gather";
  const json all_gather = Estimate(gather, "ring_vs_gather", "h100-80gb");
  ASSERT_TRUE(all_gather.is_object());
  const auto kernel = [&](double flops, double keys) {
    return flops / (kPeak * kForward * keys / (keys + kHalfForward)) +
           2.5 * flops / (kPeak * kBackward * keys / (keys + kHalfBackward));
  };
  const double per_score = 2 * 2 * heads * d, T = s / cp;
  const double diagonal = per_score * 4 * c * c * 5 / 8;
  const double merges = (cp * T * heads * d * (e + 8) + T * heads * d * (4 + e)) / kHbm +
                        cp * 3 * (T * heads * d + 2 * T * groups * d) * e / kHbm;
  const double ring = kernel(diagonal, 2 * c * 5 / 8) + (cp - 1) * kernel(step, c) + merges;
  const double gathered = kernel(per_score * T * s * 33 / 64, s * 33 / 64);
  EXPECT_NEAR(doc.at("time").at("compute_s").get<double>() -
                  all_gather.at("time").at("compute_s").get<double>(),
              layers * (ring - gathered), 1e-12);
  EXPECT_EQ(doc.at("flops_per_rank"), all_gather.at("flops_per_rank"));
  // Materialised attention is not what Megatron runs under cp; the estimate says so.
  json unfused = config;
  unfused["model"]["attention_backend"] = "unfused";
  const Result text = Mpusim({"estimate", WriteTemp("ring_unfused.json", unfused.dump())});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("Megatron-Core runs context parallelism with flash or fused attention "
                          "only, so this counts mpusim's own context-parallel attention"),
            std::string::npos)
      << text.out;
}

// The CPU executor computes the same attention whatever the backend: `mpusim run` takes the
// key and passes its check.
TEST(AttentionBackend, RunAcceptsTheKey) {
  json config = json::parse(
      std::ifstream(std::string(MPUSIM_SAMPLE_CONFIG_DIR) + "/gpt_tiny_t2_sp_dp2_n4.json"));
  config["model"]["attention_backend"] = "flash";
  const std::string path = WriteTemp("run.json", config.dump());
  const std::string log = WriteTemp("run.log", "");
  const int raw = std::system(fmt::format("OMPI_ALLOW_RUN_AS_ROOT=1 "
                                          "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 {} -n 4 "
                                          "--oversubscribe {} run {} > {} 2>&1",
                                          MPUSIM_MPIEXEC, MPUSIM_BINARY, path, log)
                                  .c_str());
  std::ifstream in(log);
  const std::string output(std::istreambuf_iterator<char>(in), {});
  EXPECT_TRUE(WIFEXITED(raw) && WEXITSTATUS(raw) == 0) << output;
  EXPECT_NE(output.find(" passed, 0 failed"), std::string::npos) << output;
}

}  // namespace
}  // namespace mpusim::cli
