#include "core/estimate/attention_backend.h"

#include <fmt/format.h>

namespace mpusim {
namespace {

std::string Capability(int cc) { return fmt::format("{}.{}", cc / 10, cc % 10); }

}  // namespace

StatusOr<ResolvedAttention> ResolveAttentionBackend(const GptConfig& gpt, DType dtype,
                                                    int compute_capability, int64_t cp) {
  ResolvedAttention out;
  out.requested = gpt.attention_backend;
  const bool half = dtype == DType::kBFloat16 || dtype == DType::kFloat16;
  const bool capable = half && compute_capability >= 80;
  const std::string on =
      fmt::format("{} on compute capability {}", DTypeName(dtype), Capability(compute_capability));
  const std::string automatic = fmt::format("auto, {}: ", on);
  switch (gpt.attention_backend) {
    case AttentionBackend::kAuto:
      if (!capable) {
        out.backend = AttentionBackend::kUnfused;
        out.reason = automatic +
                     "TransformerEngine's flash and fused attention need bfloat16 "
                     "or float16 and compute capability 8.0+";
      } else if (compute_capability >= 90) {
        out.backend = AttentionBackend::kFused;
        out.reason = automatic +
                     "TransformerEngine prefers cuDNN's fused attention on Hopper "
                     "and newer";
      } else {
        out.backend = AttentionBackend::kFlash;
        out.reason = automatic + "TransformerEngine prefers FlashAttention below Hopper";
      }
      break;
    case AttentionBackend::kFlash:
    case AttentionBackend::kFused:
      if (!capable) {
        return Status::Error(
            "model.attention_backend",
            fmt::format("\"{}\" needs bfloat16 or float16 on a GPU of compute capability 8.0 "
                        "or newer (TransformerEngine's get_attention_backend); this run is {}: "
                        "use \"unfused\", \"local\" or \"auto\"",
                        AttentionBackendName(gpt.attention_backend), on));
      }
      out.backend = gpt.attention_backend;
      out.reason = "as asked";
      break;
    default:
      out.backend = gpt.attention_backend;
      out.reason = "as asked";
      break;
  }
  if (!out.fused() && cp > 1) {
    out.reason +=
        "; Megatron-Core runs context parallelism with flash or fused attention "
        "only, so this counts mpusim's own context-parallel attention";
  }
  return out;
}

}  // namespace mpusim
