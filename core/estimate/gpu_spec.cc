#include "core/estimate/gpu_spec.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/config/json_fields.h"
#include "core/config/suggest.h"

namespace mpusim {
namespace {

constexpr double kTera = 1e12;
constexpr double kGiga = 1e9;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Datasheet figures (dense, no sparsity) of the SXM parts; links per GPU and direction:
// NVLink 3 (A100) 600 GB/s, NVLink 4 (H100, H200) 900 GB/s, the H800's export NVLink 400
// GB/s and NVLink 5 (B200) 1.8 TB/s, all both ways; one 200 Gb/s (HDR, DGX A100) or 400
// Gb/s (NDR, DGX H100/H200/B200) network adapter per GPU. The GEMM ceilings are the MAMF
// table's (ml-engineering compute/accelerator/README.md) over the dense peak: A100 271.2 /
// 312, H100 794.5 / 989 (H200 "the same"; the H800 is H100 silicon), B200 1745 / 2250 bf16;
// fp8 H100 1402.6 / 1979, H200 1453.4 / 1979, B200 3432.5 / 4500. docs/estimate.md, "The time
// model" cites each figure. Attention efficiencies (docs/estimate.md, "The time model"): the A100
// runs FlashAttention 2 ("auto" there), whose paper (Dao 2023, arXiv 2307.08691) reaches 50-73% of
// the peak (its abstract), the upper end on long sequences forward; its backward at 16k positions
// runs at 322 / 370 of its forward in FlashAttention-3's Figures 5 and 6 (Shah et al. 2024, arXiv
// 2407.08608, head dim 128, H100), so 0.73 x 0.87 = 0.63. H100 and H200 run cuDNN's fused attention
// ("auto" there), measured in the same figures at 497 (512 positions) to 595 (16k) TFLOP/s forward
// and 305 to 516 backward: the curve e L / (L + L_half) through both ends has e = 599 / 989.4 =
// 0.605 forward, 528 / 989.4 = 0.534 backward. The H200 and H800 are H100 silicon; the B200 keeps
// the H100's fractions of its own peak (no published measurement of its fused attention is
// used yet).
std::vector<GpuSpec> Presets() {
  GpuSpec a100{"a100-80gb", 312 * kTera, 19.5 * kTera, 19.5 * kTera, 80 * kGiB,
               2039 * kGiga, 300 * kGiga, 25 * kGiga, 5e-6, 10e-6};
  a100.peak_flops_8bit = 0;  // no fp8 tensor cores
  a100.sm_count = 108;
  a100.compute_capability = 80;
  a100.attention_efficiency_forward = 0.73;
  a100.attention_efficiency_backward = 0.63;
  a100.gemm_efficiency = 271.2 / 312;
  a100.gemm_efficiency_8bit = 0;
  GpuSpec h100{"h100-80gb", 989.4 * kTera, 66.9 * kTera, 66.9 * kTera, 80 * kGiB,
               3350 * kGiga, 450 * kGiga, 50 * kGiga, 5e-6, 10e-6};
  h100.peak_flops_8bit = 1978.9 * kTera;
  h100.sm_count = 132;
  h100.compute_capability = 90;
  h100.attention_efficiency_forward = 0.605;
  h100.attention_efficiency_backward = 0.534;
  h100.gemm_efficiency = 794.5 / 989.4;
  h100.gemm_efficiency_8bit = 1402.6 / 1978.9;
  GpuSpec h200 = h100;
  h200.name = "h200";
  h200.hbm_bytes = 141 * kGiga;
  h200.hbm_bandwidth = 4800 * kGiga;
  h200.gemm_efficiency_8bit = 1453.4 / 1978.9;
  GpuSpec h800 = h100;
  h800.name = "h800";
  h800.intra_node_bandwidth = 200 * kGiga;
  GpuSpec b200{"b200", 2250 * kTera, 80 * kTera, 40 * kTera, 180 * kGiga,
               8000 * kGiga, 900 * kGiga, 50 * kGiga, 5e-6, 10e-6};
  b200.peak_flops_8bit = 4500 * kTera;
  b200.sm_count = 148;
  b200.compute_capability = 100;
  b200.gemm_efficiency = 1745.0 / 2250;
  b200.gemm_efficiency_8bit = 3432.5 / 4500;
  b200.attention_efficiency_forward = h100.attention_efficiency_forward;
  b200.attention_efficiency_backward = h100.attention_efficiency_backward;
  return {a100, h100, h200, h800, b200};
}

}  // namespace

Status CheckFp8OnGpu(const GptConfig& gpt, DType dtype, const GpuSpec& gpu) {
  if (!gpt.fp8) return {};
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    return Status::Error("model.fp8", fmt::format("needs bf16 or fp16 (Transformer Engine's fp8 "
                                                  "runs inside mixed precision); the run is {}",
                                                  DTypeName(dtype)));
  }
  const char* recipe = Fp8RecipeName(gpt.fp8_recipe);
  if (gpu.peak_flops_8bit <= 0 || gpu.compute_capability < 89) {
    return Status::Error("model.fp8",
                         fmt::format("\"{}\" needs fp8 tensor cores (compute capability 89 or "
                                     "above and a peak_tflops_8bit); {} has compute capability {}",
                                     Fp8FormatName(*gpt.fp8), gpu.name, gpu.compute_capability));
  }
  if (gpu.gemm_efficiency_8bit <= 0) {
    return Status::Error("model.fp8", fmt::format("{} has no fp8 GEMM ceiling: its GPU file needs "
                                                  "gemm_efficiency_8bit (the fp8 MAMF / peak)",
                                                  gpu.name));
  }
  int needs = 89;
  if (gpt.fp8_recipe == Fp8Recipe::kBlockwise) needs = 90;
  if (gpt.fp8_recipe == Fp8Recipe::kMxfp8) needs = 100;
  if (gpu.compute_capability < needs ||
      (gpt.fp8_recipe == Fp8Recipe::kMxfp8 && gpu.compute_capability >= 120)) {
    return Status::Error(
        "model.fp8_recipe",
        fmt::format("\"{}\" runs on compute capability {}{} (Transformer Engine's "
                    "check_recipe_support); {} has {}; \"delayed\" or \"tensorwise\" run from 89, "
                    "\"blockwise\" from 90",
                    recipe, needs, gpt.fp8_recipe == Fp8Recipe::kMxfp8 ? " to 119 (Blackwell)" : " or above",
                    gpu.name, gpu.compute_capability));
  }
  return {};
}

const std::vector<std::string>& GpuPresetNames() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const GpuSpec& g : Presets()) out.push_back(g.name);
    return out;
  }();
  return names;
}

std::optional<GpuSpec> FindGpuPreset(std::string_view name) {
  for (GpuSpec& g : Presets()) {
    if (g.name == name) return g;
  }
  return std::nullopt;
}

StatusOr<GpuSpec> ParseGpuSpec(const nlohmann::json& doc, std::string_view where) {
  const std::string at(where);
  if (!doc.is_object()) return Status::Error(at, "must be a JSON object of GPU fields");
  GpuSpec spec = *FindGpuPreset("h100-80gb");
  if (doc.contains("base")) {
    const nlohmann::json& base = doc["base"];
    std::optional<GpuSpec> preset;
    if (base.is_string()) preset = FindGpuPreset(base.get<std::string>());
    if (!preset) {
      return Status::Error(at + ".base", fmt::format("{} is not one of {}", DescribeJson(base),
                                                     fmt::join(GpuPresetNames(), ", ")));
    }
    spec = *preset;
  }
  spec.name = "custom";
  // key, field, unit the file gives it in.
  struct Field {
    std::string_view key;
    double* field;
    double unit;
    bool fraction;  // an efficiency: (0, 1]
  };
  const std::vector<Field> fields = {
      {"peak_tflops_16bit", &spec.peak_flops_16bit, kTera, false},
      {"peak_tflops_32bit", &spec.peak_flops_32bit, kTera, false},
      {"peak_tflops_64bit", &spec.peak_flops_64bit, kTera, false},
      {"peak_tflops_8bit", &spec.peak_flops_8bit, kTera, false},
      {"hbm_gib", &spec.hbm_bytes, kGiB, false},
      {"hbm_gbps", &spec.hbm_bandwidth, kGiga, false},
      {"intra_node_gbps", &spec.intra_node_bandwidth, kGiga, false},
      {"inter_node_gbps", &spec.inter_node_bandwidth, kGiga, false},
      {"intra_node_latency_us", &spec.intra_node_latency_s, 1e-6, false},
      {"inter_node_latency_us", &spec.inter_node_latency_s, 1e-6, false},
      {"gemm_efficiency", &spec.gemm_efficiency, 1, true},
      {"gemm_efficiency_8bit", &spec.gemm_efficiency_8bit, 1, true},
      {"memory_efficiency", &spec.memory_efficiency, 1, true},
      {"collective_efficiency", &spec.collective_efficiency, 1, true},
      {"attention_efficiency_forward", &spec.attention_efficiency_forward, 1, true},
      {"attention_efficiency_backward", &spec.attention_efficiency_backward, 1, true},
  };
  std::vector<std::string_view> keys = {"name", "base", "compute_capability"};
  for (const Field& f : fields) keys.push_back(f.key);
  keys.push_back("sm_count");
  for (auto item = doc.begin(); item != doc.end(); ++item) {
    const std::string& key = item.key();
    const nlohmann::json& value = item.value();
    const std::string field_at = at + "." + key;
    if (key == "base") continue;
    if (key == "name") {
      if (!value.is_string() || value.get<std::string>().empty() ||
          value.get<std::string>().size() > 64) {
        return Status::Error(field_at, "must be a string of 1 to 64 characters");
      }
      spec.name = value.get<std::string>();
      continue;
    }
    // Whole numbers: the SMs the GEMM curve's waves fill, and major x 10 + minor.
    if (key == "sm_count" || key == "compute_capability") {
      const bool sms = key == "sm_count";
      const int64_t low = sms ? 1 : 10, high = sms ? 100000 : 999;
      if (!value.is_number_integer() || value.get<int64_t>() < low || value.get<int64_t>() > high) {
        return Status::Error(field_at,
                             fmt::format("must be a whole number from {} to {}{}, got {}", low, high,
                                         sms ? "" : " (major x 10 + minor: 80 A100, 90 H100, 100 B200)",
                                         DescribeJson(value)));
      }
      if (sms) {
        spec.sm_count = value.get<int64_t>();
      } else {
        spec.compute_capability = static_cast<int>(value.get<int64_t>());
      }
      continue;
    }
    const auto f = std::find_if(fields.begin(), fields.end(),
                                [&](const Field& x) { return x.key == key; });
    if (f == fields.end()) {
      const std::string hint = SuggestKey(key, keys);
      return Status::Error(field_at, fmt::format("unknown key{}; allowed: {}",
                                                 hint.empty() ? "" : " (did you mean " + hint + "?)",
                                                 fmt::join(keys, ", ")));
    }
    double v = 0;
    if (Status s = ParsePositive(value, field_at, &v); !s.ok()) return s;
    if (f->fraction && v > 1) {
      return Status::Error(field_at, fmt::format("{} is above 1; an efficiency is in (0, 1]",
                                                 DescribeJson(value)));
    }
    if (!f->fraction && v > 1e9) {
      return Status::Error(field_at, fmt::format("{} is not a plausible figure (at most 1e9)",
                                                 DescribeJson(value)));
    }
    *f->field = v * f->unit;
  }
  return spec;
}

StatusOr<GpuSpec> ResolveGpuSpec(const std::string& name_or_file) {
  if (std::optional<GpuSpec> preset = FindGpuPreset(name_or_file)) return *preset;
  if (!name_or_file.ends_with(".json")) {
    const std::vector<std::string>& names = GpuPresetNames();
    const std::string closest =
        ClosestName(name_or_file, std::vector<std::string_view>(names.begin(), names.end()));
    return Status::Error(
        "--gpu", fmt::format("\"{}\" is neither one of {} nor a .json file{}", name_or_file,
                             fmt::join(names, ", "),
                             closest.empty() ? "" : fmt::format("; did you mean {}?", closest)));
  }
  StatusOr<nlohmann::json> doc = ReadJsonFile(name_or_file);
  if (!doc.ok()) return Status::Error("--gpu " + name_or_file, doc.status().Message());
  return ParseGpuSpec(*doc, "--gpu " + name_or_file);
}

}  // namespace mpusim
