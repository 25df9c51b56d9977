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
  // Attention sinks (softmax_type "off-by-one" / "learnable"): TransformerEngine's
  // get_attention_backend disables FlashAttention for them ("Disabling FlashAttention for
  // softmax_type"); FusedAttention and UnfusedDotProductAttention run them (Megatron's local
  // DotProductAttention too), and only FusedAttention under context parallelism.
  const bool sinks = gpt.softmax_type != SoftmaxType::kVanilla;
  // Multi-latent attention's query/key heads (qk + pe) differ from its value heads (v):
  // FlashAttention 2 refuses that ("Disabling FlashAttention 2 as it does not support MLA");
  // FlashAttention 3 (compute capability 9.0 only) and FusedAttention run it.
  const bool mla_dims =
      gpt.mla.enabled && gpt.mla.QHeadDim() != gpt.mla.v_head_dim && compute_capability != 90;
  const char* sink_name = SoftmaxTypeName(gpt.softmax_type);
  switch (gpt.attention_backend) {
    case AttentionBackend::kAuto:
      if (capable && (sinks || mla_dims)) {
        out.backend = AttentionBackend::kFused;
        out.reason = automatic + (sinks ? fmt::format("TransformerEngine runs softmax_type \"{}\" "
                                                      "with cuDNN's fused attention, not "
                                                      "FlashAttention",
                                                      sink_name)
                                        : std::string("FlashAttention 2 does not run MLA's "
                                                      "different query/key and value head "
                                                      "dims; cuDNN's fused attention does"));
      } else if (!capable) {
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
      if (gpt.attention_backend == AttentionBackend::kFlash && (sinks || mla_dims)) {
        return Status::Error(
            "model.attention_backend",
            sinks ? fmt::format("\"flash\" does not run softmax_type \"{}\" (TransformerEngine's "
                                "get_attention_backend disables FlashAttention for sinks): use "
                                "\"fused\", \"unfused\", \"local\" or \"auto\"",
                                sink_name)
                  : fmt::format("\"flash\" does not run multi-latent attention's query/key head "
                                "dim {} with value head dim {} on compute capability {} "
                                "(FlashAttention 2 needs them equal; FlashAttention 3 runs on "
                                "9.0 only): use \"fused\", \"unfused\", \"local\" or \"auto\"",
                                gpt.mla.QHeadDim(), gpt.mla.v_head_dim,
                                Capability(compute_capability)));
      }
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
  if (sinks && cp > 1 && out.backend == AttentionBackend::kUnfused) {
    out.reason += fmt::format(
        "; TransformerEngine runs softmax_type \"{}\" under context "
        "parallelism with cuDNN's fused attention only",
        sink_name);
  }
  if (!out.fused() && cp > 1) {
    out.reason +=
        "; Megatron-Core runs context parallelism with flash or fused attention "
        "only, so this counts mpusim's own context-parallel attention";
  }
  return out;
}

}  // namespace mpusim
