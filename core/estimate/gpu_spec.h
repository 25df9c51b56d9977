// GpuSpec: one GPU and its links, the presets (A100, H100, H200, H800, B200) with where each
// figure comes from, a GPU description file, and the checks of fp8 against a GPU. The step-time
// model (time_estimate.h) and the memory reserve (memory_reserve.h) read it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/config/gpt_config.h"
#include "core/status.h"
#include "core/tensor.h"

namespace mpusim {

// One GPU and its links. Rates in FLOP/s and bytes/s (per GPU, per direction for links).
struct GpuSpec {
  std::string name;
  double peak_flops_16bit = 0;  // dense tensor-core bf16/fp16
  double peak_flops_32bit = 0;  // float32 (no TF32: mpusim's float32 is float32)
  double peak_flops_64bit = 0;
  double hbm_bytes = 0;
  double hbm_bandwidth = 0;
  double intra_node_bandwidth = 0;  // NVLink
  double inter_node_bandwidth = 0;  // the network, per GPU
  double intra_node_latency_s = 0;  // per ring step
  double inter_node_latency_s = 0;
  double peak_flops_8bit = 0;  // dense tensor-core fp8; 0: none (A100)
  int64_t sm_count = 132;      // streaming multiprocessors: the waves of the GEMM curve
  // The efficiency constants (docs/estimate.md, "The time model" says where each comes from); the
  // same for every model and layout. gemm_efficiency and gemm_efficiency_8bit are the GEMM curve's
  // ceilings: the MAMF measured for the GPU over its dense bf16 and fp8 peaks.
  double gemm_efficiency = 0.80;
  double gemm_efficiency_8bit = 0.70;
  double memory_efficiency = 0.80;
  double collective_efficiency = 0.80;
  // Major * 10 + minor (80: A100, 90: H100, H200 and H800, 100: B200): which attention
  // "auto" resolves to (attention_backend.h), which fp8 recipes run, and the cuBLAS
  // workspaces PyTorch and TransformerEngine allocate (core/estimate/memory_reserve.h).
  int compute_capability = 90;
  // Flash / fused attention's forward and backward FLOP/s on long sequences, as fractions of
  // the 16-bit peak (the backward's FLOPs counted as FlashAttention's benchmarks count them,
  // 2.5 x the forward's: the recomputed QK^T and four GEMMs). A kernel over L keys per query
  // tile runs at efficiency * L / (L + L_half) (docs/estimate.md, "The time model" cites both).
  double attention_efficiency_forward = 0.60;
  double attention_efficiency_backward = 0.53;
};

// "a100-80gb", "h100-80gb", "h200", "h800", "b200".
const std::vector<std::string>& GpuPresetNames();
std::optional<GpuSpec> FindGpuPreset(std::string_view name);
// The GPU the commands assume when none is named.
inline constexpr const char* kDefaultGpu = "h100-80gb";
// A GPU description file: {"name": ..., "peak_tflops_16bit": ..., ...} (README lists the
// keys; a missing key takes the value of the preset named by "base", default h100-80gb).
// Errors name "<where>.<key>" and what is allowed.
StatusOr<GpuSpec> ParseGpuSpec(const nlohmann::json& doc, std::string_view where);
// --gpu's argument: a preset's name, or a GPU description file ending in .json (read with
// ReadJsonFile, parsed with ParseGpuSpec). Errors name "--gpu".
StatusOr<GpuSpec> ResolveGpuSpec(const std::string& name_or_file);
// model.fp8 and model.fp8_recipe against the run's dtype and the GPU, as Transformer Engine
// checks them (transformer_engine/pytorch/quantization.py): a bf16 or fp16 run; delayed and
// tensorwise need compute capability 89 or above, blockwise 90, mxfp8 100 (Blackwell; not
// 120); and a GPU with an fp8 peak. Errors name the field.
Status CheckFp8OnGpu(const GptConfig& gpt, DType dtype, const GpuSpec& gpu);

}  // namespace mpusim
