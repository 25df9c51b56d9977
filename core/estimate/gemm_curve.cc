// The GEMM curve of the step-time model (time_estimate.h's GemmSeconds and GemmEfficiency,
// whose header comment gives the formula): tile and wave quantization over the GPU's SMs at
// the measured matmul ceiling, or the HBM roofline. Not here: attention kernels (layer_cost.cc).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/estimate/gpu_spec.h"
#include "core/estimate/time_estimate.h"

namespace mpusim {

double GemmSeconds(const GpuSpec& gpu, const GemmShape& shape, double element_bytes, double peak) {
  if (shape.m <= 0 || shape.n <= 0 || shape.k <= 0 || shape.count <= 0) return 0;
  const double rate = shape.fp8 ? gpu.peak_flops_8bit * gpu.gemm_efficiency_8bit
                                : peak * gpu.gemm_efficiency;
  const auto sms = static_cast<double>(std::max<int64_t>(1, gpu.sm_count));
  // Tile and wave quantization: a wave computes one tile per SM; the partial last wave takes
  // as long as a full one. The tile with the least padded work is cuBLAS's pick.
  double padded = 0;
  for (const GemmTile& tile : kGemmTiles) {
    const auto tm = static_cast<double>(tile.rows), tn = static_cast<double>(tile.cols);
    const double tiles = shape.count * std::ceil(shape.m / tm) * std::ceil(shape.n / tn);
    const double work = std::ceil(tiles / sms) * sms * tm * tn;
    if (padded == 0 || work < padded) padded = work;
  }
  const double compute = 2 * padded * shape.k / rate;
  // The roofline: A and B read once, C written once, at the streaming kernels' HBM rate.
  const double in_bytes = shape.fp8 ? 1 : element_bytes, out_bytes = shape.fp8 ? 2 : element_bytes;
  const double bytes =
      shape.count * (in_bytes * (shape.m * shape.k + shape.k * shape.n) + out_bytes * shape.m * shape.n);
  const double memory = bytes / (gpu.hbm_bandwidth * gpu.memory_efficiency);
  return std::max(compute, memory);
}

double GemmEfficiency(const GpuSpec& gpu, const GemmShape& shape, double element_bytes,
                      double peak) {
  const double seconds = GemmSeconds(gpu, shape, element_bytes, peak);
  if (seconds <= 0) return 0;
  return shape.Flops() / seconds / (shape.fp8 ? gpu.peak_flops_8bit : peak);
}

}  // namespace mpusim
