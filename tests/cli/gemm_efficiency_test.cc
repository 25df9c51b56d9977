// The GEMM curve of the time model (core/estimate/time_estimate.h, docs/estimate.md, "The time
// model"): its shape, the presets' figures, fp8, and the refusals. Expected values are computed
// here from the documented formula (tile and wave quantization with the 256 x 128 tile over the
// SMs, the HBM roofline, the MAMF ceiling), not copied from the program's output.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli.h"
#include "tests/cli/cli_test_util.h"
#include "core/estimate/time_estimate.h"

namespace mpusim {
namespace {

using mpusim::cli::test_util::Result;
using mpusim::cli::test_util::Mpusim;
using mpusim::cli::test_util::WriteTemp;
using mpusim::cli::test_util::ExpectUsageError;

using nlohmann::json;

// What the time model cannot price: the memory estimate stands, the step time names the field.
void ExpectNotTimed(const Result& r, const std::string& line) {
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("Step time: not estimated: " + line + "\n"), std::string::npos) << r.out;
}

GpuSpec Preset(const char* name) {
  std::optional<GpuSpec> g = FindGpuPreset(name);
  EXPECT_TRUE(g.has_value()) << name;
  return *g;
}

// The documented formula, written out again: seconds of a bf16 GEMM (2-byte elements).
double HandSeconds(const GpuSpec& g, double m, double n, double k, double count = 1) {
  const double sms = static_cast<double>(g.sm_count);
  const double rate = g.peak_flops_16bit * g.gemm_efficiency;
  const auto padded = [&](double tm, double tn) {
    const double tiles = count * std::ceil(m / tm) * std::ceil(n / tn);
    return std::ceil(tiles / sms) * sms * tm * tn;
  };
  const double compute = 2 * std::min(padded(256, 128), padded(128, 256)) * k / rate;
  const double memory = count * 2 * (m * k + k * n + m * n) / (g.hbm_bandwidth * g.memory_efficiency);
  return std::max(compute, memory);
}

TEST(GemmCurve, LargeGemmsReachTheCeilingAndSmallOnesPayTheirWaves) {
  for (const char* name : {"a100-80gb", "h100-80gb", "h200", "h800", "b200"}) {
    const GpuSpec g = Preset(name);
    const double sms = static_cast<double>(g.sm_count);
    // 10 full waves of 256 x 128 tiles, k large: compute-bound, no padding: the ceiling.
    const GemmShape full{256 * sms, 1280, 8192};
    EXPECT_NEAR(GemmEfficiency(g, full, 2, g.peak_flops_16bit), g.gemm_efficiency, 1e-12) << name;
    // One tile more: an 11th wave for one tile.
    const GemmShape spill{256 * sms + 1, 1280, 8192};
    EXPECT_NEAR(GemmSeconds(g, spill, 2, g.peak_flops_16bit) /
                    GemmSeconds(g, full, 2, g.peak_flops_16bit),
                11.0 / 10.0, 1e-12)
        << name;
  }
  // A 1.7B model's projection on 2048 tokens on an A100: 8 x 18 = 144 tiles on 108 SMs is two
  // waves, the second a third full: 2/3 of the ceiling.
  const GpuSpec a100 = Preset("a100-80gb");
  EXPECT_NEAR(GemmEfficiency(a100, {2048, 2304, 2304}, 2, a100.peak_flops_16bit),
              a100.gemm_efficiency * (2048.0 * 2304) / (2 * 108 * 256 * 128), 1e-12);
  EXPECT_NEAR(GemmSeconds(a100, {2048, 2304, 2304}, 2, a100.peak_flops_16bit),
              HandSeconds(a100, 2048, 2304, 2304), 1e-18);
  // Below the ridge point HBM decides: 64 rows of 4096 x 32768 (arithmetic intensity ~ 62
  // against H100's ~ 295 FLOP/byte) take the time of reading and writing the operands.
  const GpuSpec h100 = Preset("h100-80gb");
  const double narrow = HandSeconds(h100, 64, 32768, 4096);
  EXPECT_NEAR(narrow, 2 * (64.0 * 4096 + 4096.0 * 32768 + 64.0 * 32768) / (3350e9 * 0.8), 1e-15);
  EXPECT_NEAR(GemmSeconds(h100, {64, 32768, 4096}, 2, h100.peak_flops_16bit), narrow, 1e-15);
}

TEST(GemmCurve, MonotoneWhereItMustBe) {
  const GpuSpec g = Preset("h100-80gb");
  const double peak = g.peak_flops_16bit;
  // More reduction depth never lowers the efficiency (the same tiles, more intensity); more
  // rows or columns never take less time.
  for (double m : {64.0, 512.0, 2048.0, 8192.0}) {
    double last_eff = 0, last_m_s = 0, last_n_s = 0;
    for (double x = 64; x <= 32768; x *= 2) {
      const double eff = GemmEfficiency(g, {m, 4096, x}, 2, peak);
      EXPECT_GE(eff, last_eff - 1e-12) << m << " " << x;
      last_eff = eff;
      const double m_s = GemmSeconds(g, {x, m, 4096}, 2, peak);
      EXPECT_GE(m_s, last_m_s) << m << " " << x;
      last_m_s = m_s;
      const double n_s = GemmSeconds(g, {m, x, 4096}, 2, peak);
      EXPECT_GE(n_s, last_n_s) << m << " " << x;
      last_n_s = n_s;
      EXPECT_LE(eff, g.gemm_efficiency + 1e-12);
    }
  }
  // Grouped: 8 experts of 512 rows in one launch fill the waves at least as well as one
  // expert's GEMM launched 8 times.
  const GemmShape grouped{512, 1792, 4096, 8};
  EXPECT_LE(GemmSeconds(g, grouped, 2, peak), 8 * GemmSeconds(g, {512, 1792, 4096}, 2, peak));
}

TEST(GemmCurve, Fp8HalvesALargeGemmAtTheCeiling) {
  // A GPU whose fp8 peak is twice its bf16 one at the same ceiling: a compute-bound GEMM in
  // fp8 takes half the time.
  GpuSpec g = Preset("h100-80gb");
  g.gemm_efficiency_8bit = g.gemm_efficiency;
  g.peak_flops_8bit = 2 * g.peak_flops_16bit;
  GemmShape s{256 * 132, 1280, 8192};
  const double bf16 = GemmSeconds(g, s, 2, g.peak_flops_16bit);
  s.fp8 = true;
  EXPECT_NEAR(GemmSeconds(g, s, 2, g.peak_flops_16bit) / bf16, 0.5, 1e-12);
  EXPECT_NEAR(GemmEfficiency(g, s, 2, g.peak_flops_16bit), g.gemm_efficiency_8bit, 1e-12);
}

TEST(GemmCurve, PresetsCarryTheirDatasheetsAndMamf) {
  const GpuSpec a100 = Preset("a100-80gb"), h100 = Preset("h100-80gb"), h200 = Preset("h200");
  const GpuSpec h800 = Preset("h800"), b200 = Preset("b200");
  EXPECT_EQ(a100.peak_flops_8bit, 0);
  EXPECT_EQ(a100.compute_capability, 80);
  EXPECT_EQ(a100.sm_count, 108);
  EXPECT_NEAR(a100.gemm_efficiency, 271.2 / 312, 1e-12);
  EXPECT_EQ(h100.peak_flops_8bit, 1978.9e12);
  EXPECT_NEAR(h100.gemm_efficiency_8bit, 1402.6 / 1978.9, 1e-12);
  EXPECT_NEAR(h200.gemm_efficiency_8bit, 1453.4 / 1978.9, 1e-12);
  EXPECT_EQ(h200.hbm_bandwidth, 4800e9);
  // The H800: an H100 whose NVLink carries 400 GB/s both ways.
  EXPECT_EQ(h800.intra_node_bandwidth, 200e9);
  EXPECT_EQ(h800.peak_flops_16bit, h100.peak_flops_16bit);
  EXPECT_EQ(h800.compute_capability, 90);
  // DGX B200: 2.25 / 4.5 PFLOP/s dense, 180 GB at 8 TB/s, NVLink 5 1.8 TB/s both ways.
  EXPECT_EQ(b200.peak_flops_16bit, 2250e12);
  EXPECT_EQ(b200.peak_flops_8bit, 4500e12);
  EXPECT_EQ(b200.hbm_bytes, 180e9);
  EXPECT_EQ(b200.hbm_bandwidth, 8000e9);
  EXPECT_EQ(b200.intra_node_bandwidth, 900e9);
  EXPECT_EQ(b200.sm_count, 148);
  EXPECT_EQ(b200.compute_capability, 100);
  EXPECT_NEAR(b200.gemm_efficiency, 1745.0 / 2250, 1e-12);
}

// A 2B-like model (h 2048, 16 heads, ffn 8192, vocab 32768, 2048 tokens): at tp 8 its GEMMs are cut
// eight ways and fill fewer waves, so the layer's GEMMs cost more per FLOP than at tp 1; the
// estimate's achieved fraction equals the formula summed over the layer's shapes.
json SmallModel(int tp, const std::string& extra = "") {
  return json::parse(R"({"parallel": {"world_size": )" + std::to_string(tp) +
                     R"(, "tensor_model_parallel_size": )" + std::to_string(tp) +
                     R"(, "bf16": true},
    "model": {"type": "gpt", "num_layers": 4, "hidden_size": 2048, "num_attention_heads": 16,
              "ffn_hidden_size": 8192, "vocab_size": 32768, "max_position_embeddings": 2048)" +
                     extra + R"(},
    "run": {"seq_length": 2048, "micro_batch_size": 1, "num_microbatches": 1}})");
}

double HandAchieved(const GpuSpec& g, double t) {
  const double T = 2048, h = 2048, f = 8192, v = 32768 / t;  // 32768: a multiple of 128 t
  struct Mnk {
    double m, n, k, times;
  };
  const std::vector<Mnk> forward = {{T, 3 * h / t, h, 4}, {T, h, h / t, 4}, {T, f / t, h, 4},
                                    {T, h, f / t, 4},     {T, v, h, 1}};
  double flops = 0, seconds = 0;
  for (const Mnk& x : forward) {
    for (const Mnk& y : {x, Mnk{x.m, x.k, x.n, x.times}, Mnk{x.k, x.n, x.m, x.times}}) {
      flops += y.times * 2 * y.m * y.n * y.k;
      seconds += y.times * HandSeconds(g, y.m, y.n, y.k);
    }
  }
  return flops / (seconds * g.peak_flops_16bit);
}

TEST(GemmCurve, TensorParallelismOfASmallModelCostsMorePerFlop) {
  const GpuSpec h100 = Preset("h100-80gb");
  double achieved[2] = {};
  int i = 0;
  for (int tp : {1, 8}) {
    const std::string path =
        WriteTemp("mpusim_gemm_small_tp" + std::to_string(tp) + ".json", SmallModel(tp).dump());
    const Result r = Mpusim({"estimate", path, "--format", "json"});
    ASSERT_EQ(r.code, 0) << r.err;
    const json doc = json::parse(r.out);
    achieved[i] = doc.at("gpu").at("gemm_efficiency_achieved").get<double>();
    EXPECT_NEAR(achieved[i] / HandAchieved(h100, tp), 1, 1e-9) << "tp " << tp;
    ++i;
  }
  EXPECT_LT(achieved[1], 0.9 * achieved[0]);
  EXPECT_LE(achieved[0], h100.gemm_efficiency);
}

TEST(GemmCurve, Fp8RunsTheLinearGemmsFasterAndIsRefusedWhereTeRefusesIt) {
  const std::string bf16 = WriteTemp("mpusim_gemm_bf16.json", SmallModel(1).dump());
  const std::string fp8 =
      WriteTemp("mpusim_gemm_fp8.json", SmallModel(1, R"(, "fp8": "hybrid")").dump());
  const Result a = Mpusim({"estimate", bf16, "--format", "json"});
  const Result b = Mpusim({"estimate", fp8, "--format", "json"});
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.err;
  const json da = json::parse(a.out), db = json::parse(b.out);
  EXPECT_LT(db.at("time").at("compute_s").get<double>(), da.at("time").at("compute_s").get<double>());
  // MFU stays quoted against the bf16 peak: the same model FLOPs over a shorter step.
  EXPECT_NEAR(db.at("mfu").get<double>() * db.at("step_time_s").get<double>(),
              da.at("mfu").get<double>() * da.at("step_time_s").get<double>(), 1e-12);
  const Result text = Mpusim({"estimate", fp8});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("  fp8 (hybrid, recipe delayed): the linear layers' GEMMs at the fp8 "
                          "peak"),
            std::string::npos)
      << text.out;

  ExpectNotTimed(Mpusim({"estimate", fp8, "--gpu", "a100-80gb"}),
                   "model.fp8: \"hybrid\" needs fp8 tensor cores (compute capability 89 or "
                       "above and a peak_tflops_8bit); a100-80gb has compute capability 80");
  const std::string mx = WriteTemp(
      "mpusim_gemm_mxfp8.json",
      SmallModel(1, R"(, "fp8": "e4m3", "fp8_recipe": "mxfp8")").dump());
  ExpectNotTimed(Mpusim({"estimate", mx, "--gpu", "h100-80gb"}),
                   "model.fp8_recipe: \"mxfp8\" runs on compute capability 100 to 119 "
                       "(Blackwell) (Transformer Engine's check_recipe_support); h100-80gb has "
                       "90; \"delayed\" or \"tensorwise\" run from 89, \"blockwise\" from 90");
  EXPECT_EQ(Mpusim({"estimate", mx, "--gpu", "b200", "--format", "json"}).code, 0);
  const std::string bad =
      WriteTemp("mpusim_gemm_e5m2.json", SmallModel(1, R"(, "fp8": "e5m2")").dump());
  ExpectUsageError(Mpusim({"estimate", bad}),
                   "error: " + bad + ": model.fp8: must be \"e4m3\" or \"hybrid\", got string \"e5m2\"");
  json fp32 = SmallModel(1, R"(, "fp8": "e4m3")");
  fp32["parallel"].erase("bf16");
  const std::string f32 = WriteTemp("mpusim_gemm_fp8_fp32.json", fp32.dump());
  ExpectNotTimed(Mpusim({"estimate", f32}),
                   "model.fp8: needs bf16 or fp16 (Transformer Engine's fp8 runs inside "
                       "mixed precision); the run is float32");
  // An A100 file given an fp8 peak and compute capability but no fp8 ceiling.
  const std::string ada = WriteTemp(
      "mpusim_gemm_ada.json",
      R"({"name": "ada", "base": "a100-80gb", "peak_tflops_8bit": 600, "compute_capability": 89})");
  ExpectNotTimed(Mpusim({"estimate", fp8, "--gpu", ada}),
                 "model.fp8: ada has no fp8 GEMM ceiling: its GPU file needs gemm_efficiency_8bit "
                 "(the fp8 MAMF / peak)");
  const std::string gpu = WriteTemp("mpusim_gemm_cc.json", R"({"compute_capability": 9.5})");
  ExpectUsageError(Mpusim({"estimate", bf16, "--gpu", gpu}),
                   "error: command line: --gpu " + gpu +
                       ".compute_capability: must be a whole number from 10 to 999 (major x 10 + "
                       "minor: 80 A100, 90 H100, 100 B200), got number 9.5");
}

// fp8 keeps the inputs Transformer Engine's linears save in one byte: per layer the QKV and
// fc1 inputs (T h each), the projection's (T q) and fc2's (T f), at tp 1 without recomputation
// 7 T h bytes fewer than bf16's two (h = q, f = 4h); blockwise adds its float32 scale per 128.
TEST(GemmCurve, Fp8KeepsTheLinearsSavedInputsInOneByte) {
  const auto activations = [](const std::string& extra, const std::string& name) {
    const std::string path = WriteTemp(name, SmallModel(1, extra).dump());
    const Result r = Mpusim({"estimate", path, "--format", "json"});
    EXPECT_EQ(r.code, 0) << r.err;
    return json::parse(r.out).at("stages")[0].at("memory").at("activations").get<double>();
  };
  const double T = 2048, h = 2048, layers = 4;
  const double bf16 = activations("", "mpusim_gemm_act_bf16.json");
  const double fp8 = activations(R"(, "fp8": "hybrid")", "mpusim_gemm_act_fp8.json");
  const double block =
      activations(R"(, "fp8": "e4m3", "fp8_recipe": "blockwise")", "mpusim_gemm_act_block.json");
  ASSERT_GT(bf16, 0);
  EXPECT_EQ(bf16 - fp8, layers * 7 * T * h);
  EXPECT_EQ(block - fp8, layers * 7 * T * h * 4 / 128);
}

// Experts' GEMMs on rows per expert = the rank's kept rows / local experts: 4096 tokens top 2
// on ep 2 of 8 experts give 4 local experts of 2048 rows; moe_grouped_gemm launches them as
// one grouped GEMM (waves over all experts' tiles), SequentialMLP one GEMM per expert. The
// step's compute differs by exactly the two pricings of those shapes, summed here by hand.
TEST(GemmCurve, ExpertGemmsPricedPerExpertGroupedOrNot) {
  const auto compute = [](bool grouped) {
    const json config = {
        {"parallel",
         {{"world_size", 8}, {"expert_model_parallel_size", 2}, {"bf16", true}}},
        {"model",
         {{"type", "gpt"}, {"num_layers", 2}, {"hidden_size", 4096}, {"num_attention_heads", 32},
          {"num_query_groups", 8}, {"ffn_hidden_size", 14336}, {"activation", "swiglu"},
          {"vocab_size", 32768}, {"position_embedding_type", "rope"}, {"add_bias_linear", false},
          {"num_moe_experts", 8}, {"moe_router_topk", 2},
          {"moe_token_dispatcher_type", "alltoall"}, {"moe_grouped_gemm", grouped}}},
        {"run", {{"seq_length", 4096}, {"micro_batch_size", 1}, {"num_microbatches", 1}}}};
    const std::string path =
        WriteTemp(std::string("mpusim_gemm_moe_") + (grouped ? "g" : "s") + ".json", config.dump());
    const Result r = Mpusim({"estimate", path, "--format", "json"});
    EXPECT_EQ(r.code, 0) << r.err;
    return json::parse(r.out).at("time").at("compute_s").get<double>();
  };
  const GpuSpec g = Preset("h100-80gb");
  const double rows = 4096.0 * 2 / 4, h = 4096, f = 14336, layers = 2;
  double expected = 0;
  for (const auto& [m, n, k] : std::vector<std::tuple<double, double, double>>{
           {rows, 2 * f, h}, {rows, h, f}}) {
    // forward, dgrad [m, k] over n, wgrad [k, n] over m
    for (const auto& [a, b, c] : std::vector<std::tuple<double, double, double>>{
             {m, n, k}, {m, k, n}, {k, n, m}}) {
      expected += layers * (4 * HandSeconds(g, a, b, c) - HandSeconds(g, a, b, c, 4));
    }
  }
  ASSERT_GT(expected, 0);
  EXPECT_NEAR((compute(false) - compute(true)) / expected, 1, 1e-9);
}

TEST(GemmCurve, AdviseAndRunRefuseFp8WhereItCannotRun) {
  json config = SmallModel(1, R"(, "fp8": "e4m3")");
  const std::string path = WriteTemp("mpusim_gemm_fp8_run.json", config.dump());
  ExpectUsageError(Mpusim({"advise", path, "--global-batch-size", "8", "--gpu", "a100-80gb"}),
                   "error: " + path +
                       ": model.fp8: \"e4m3\" needs fp8 tensor cores (compute capability 89 or "
                       "above and a peak_tflops_8bit); a100-80gb has compute capability 80");
  // The executor computes in run.dtype: run refuses fp8 before any work, one line, exit 2.
  const std::string log =
      (std::filesystem::temp_directory_path() / "mpusim_gemm_fp8_run.log").string();
  const std::string command = std::string("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ") +
                              MPUSIM_MPIEXEC + " -n 1 --oversubscribe " + MPUSIM_BINARY + " run " +
                              path + " > " + log + " 2>&1";
  const int raw = std::system(command.c_str());
  EXPECT_EQ(WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, 2);
  std::ifstream in(log);
  const std::string output((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(output.find("error: " + path + ": model.fp8: \"e4m3\" is for mpusim estimate and "
                        "advise only; mpusim run computes in run.dtype (set fp8 to null)"),
            std::string::npos)
      << output;
}

}  // namespace
}  // namespace mpusim
