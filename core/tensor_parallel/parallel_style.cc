// PyTorch's tensor-parallel styles as placements (see parallel_style.h).
#include "core/tensor_parallel/parallel_style.h"

#include <fmt/format.h>

namespace mpusim {

StatusOr<StyledModule> ApplyParallelStyle(const ParallelStyle& style, TorchModuleKind module,
                                          int64_t input_ndim, int64_t output_ndim,
                                          std::string_view fqn) {
  const std::string where = fmt::format("parallelize_plan.{}", fqn);
  // A layout of the input (`input` true) or of the output: as given, else the default.
  const auto layout = [&](bool input, const std::optional<std::string>& given,
                          const char* fallback) -> StatusOr<DTensorPlacement> {
    return ParseDTensorPlacement(given ? *given : fallback, input ? input_ndim : output_ndim,
                                 where);
  };
  StyledModule out;
  const bool linear = module == TorchModuleKind::kLinear;
  const bool embedding = module == TorchModuleKind::kEmbedding;
  switch (style.kind) {
    case ParallelStyleKind::kColwise:
    case ParallelStyleKind::kRowwise: {
      const bool colwise = style.kind == ParallelStyleKind::kColwise;
      if (!linear && !embedding) {
        return Status::Error(
            where, fmt::format("{} applies to Linear and Embedding modules only "
                               "(\"{} currently only support nn.Linear and "
                               "nn.Embedding!\")",
                               ParallelStyleName(style.kind), ParallelStyleName(style.kind)));
      }
      if (colwise) {
        if (linear) {
          out.parameters = {{"weight", DTensorPlacement::Shard(0)},
                            {"bias", DTensorPlacement::Shard(0)}};
        } else {
          out.parameters = {{"weight", DTensorPlacement::Shard(1)}};
        }
      } else if (linear) {
        out.parameters = {{"weight", DTensorPlacement::Shard(1)},
                          {"bias", DTensorPlacement::Replicate()}};
      } else {
        out.parameters = {{"weight", DTensorPlacement::Shard(0)}};  // vocab-parallel
      }
      StatusOr<DTensorPlacement> in =
          layout(true, style.input_layouts, colwise ? "Replicate()" : "Shard(-1)");
      StatusOr<DTensorPlacement> desired =
          layout(true, std::nullopt, colwise || embedding ? "Replicate()" : "Shard(-1)");
      StatusOr<DTensorPlacement> produced =
          layout(false, std::nullopt, colwise ? "Shard(-1)" : "Partial()");
      StatusOr<DTensorPlacement> given =
          layout(false, style.output_layouts, colwise ? "Shard(-1)" : "Replicate()");
      for (const auto* s : {&in, &desired, &produced, &given}) {
        if (!s->ok()) return s->status();
      }
      out.input_given = *in;
      out.input_desired = *desired;
      out.output_produced = *produced;
      out.output_given = *given;
      out.use_local_output = style.use_local_output.value_or(true);
      return out;
    }
    case ParallelStyleKind::kSequenceParallel: {
      if (module != TorchModuleKind::kLayerNorm && module != TorchModuleKind::kRMSNorm &&
          module != TorchModuleKind::kDropout) {
        return Status::Error(where,
                             "SequenceParallel applies to LayerNorm, RMSNorm and Dropout "
                             "modules (their computation runs on the sequence shard)");
      }
      StatusOr<DTensorPlacement> shard = ParseDTensorPlacement(
          fmt::format("Shard({})", style.sequence_dim), input_ndim, where + ".sequence_dim");
      if (!shard.ok()) return shard.status();
      if (module != TorchModuleKind::kDropout) {
        out.parameters = {{"weight", DTensorPlacement::Replicate()},
                          {"bias", DTensorPlacement::Replicate()}};
      }
      out.input_given = out.input_desired = out.output_produced = out.output_given = *shard;
      out.use_local_output = style.use_local_output.value_or(false);
      return out;
    }
    case ParallelStyleKind::kPrepareModuleInput: {
      if (style.input_layouts) {
        StatusOr<DTensorPlacement> in = layout(true, style.input_layouts, "");
        if (!in.ok()) return in.status();
        StatusOr<DTensorPlacement> desired = layout(true, style.desired_input_layouts, "");
        if (!desired.ok()) return desired.status();
        out.input_given = *in;
        out.input_desired = *desired;
      }
      out.use_local_output = style.use_local_output.value_or(false);
      return out;
    }
    case ParallelStyleKind::kPrepareModuleOutput: {
      StatusOr<DTensorPlacement> produced = layout(false, style.output_layouts, "");
      if (!produced.ok()) return produced.status();
      StatusOr<DTensorPlacement> given = layout(false, style.desired_output_layouts, "");
      if (!given.ok()) return given.status();
      out.output_produced = *produced;
      out.output_given = *given;
      out.use_local_output = style.use_local_output.value_or(true);
      return out;
    }
    case ParallelStyleKind::kPairwise:
      break;
  }
  return Status::Error(where,
                       "PairwiseParallel is expanded over its Linear pairs by the plan, "
                       "not applied to one module");
}

}  // namespace mpusim
