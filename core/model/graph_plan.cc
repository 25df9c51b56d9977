// The layer chain's account of itself (see graph.h and model.h), read from Graph::Plan: the
// layer table of `mpusim run`, the sharding map and the lab's notation of `mpusim explain`,
// and the memory plan of the preflight.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include "core/model/graph.h"
#include "core/model/graph_impl.h"

namespace mpusim {

std::string Graph::Describe() const {
  std::string out;
  if (config_.model->vocab_size) {
    out += fmt::format("vocab_size {}, padded_vocab_size {}\n", *config_.model->vocab_size,
                       padded_vocab_size());
  }
  out += "layers (activation state on the tp group, full width):\n";
  const bool pipeline = topology_->sizes().pp > 1;
  for (const PlannedLayer& layer : Plan(RankCoordinates{})) {
    const std::string in = layer.input_width == 0
                               ? std::string("tokens")
                               : fmt::format("{} {}", SplitName(layer.input.split),
                                             layer.input_width);
    const std::string produced = layer.output_width == 0
                                     ? std::string("loss")
                                     : fmt::format("{} {}", SplitName(layer.output.split),
                                                   layer.output_width);
    const std::string flow = fmt::format("{} -> {}", in, produced);
    if (pipeline) {  // the stage holding it
      out += fmt::format("  {:<12} {:<44} {:<40} pp rank {}, chunk {}\n", layer.name, layer.type,
                         flow, layer.pp_rank, layer.chunk);
    } else {
      out += fmt::format("  {:<12} {:<44} {}\n", layer.name, layer.type, flow);
    }
  }
  return out;
}

std::vector<ParameterPlacement> Graph::ShardingMap() const {
  std::vector<ParameterPlacement> mapped;
  for (const PlannedLayer& layer : Plan(RankCoordinates{})) {
    for (const PlannedParameter& p : layer.parameters) {
      mapped.push_back(
          {p.name, p.full_shape, p.tp_dim, p.tp_stride, layer.pp_rank, layer.chunk, ""});
    }
    if (layer.tied_weight.empty()) continue;
    // weight_from: on its owner's pp rank the layer uses the owner's tensor; on another
    // (the last stage, with the owner on the first) that rank holds a copy.
    const auto owner =
        std::find_if(mapped.begin(), mapped.end(),
                     [&](const ParameterPlacement& m) { return m.name == layer.tied_weight; });
    if (owner == mapped.end()) continue;
    if (owner->pp_rank == layer.pp_rank) {
      owner->note += fmt::format("{}also the weight of {} (weight_from)",
                                 owner->note.empty() ? "" : "; ", layer.name);
    } else {
      ParameterPlacement copy = *owner;
      copy.pp_rank = layer.pp_rank;
      copy.chunk = layer.chunk;
      copy.note = fmt::format(
          "tied: the copy {} uses (weight_from), its gradient all-reduced over embd with pp "
          "rank {}'s",
          layer.name, owner->pp_rank);
      owner->note += fmt::format("{}tied: pp rank {} holds a copy for {} (weight_from)",
                                 owner->note.empty() ? "" : "; ", layer.pp_rank, layer.name);
      mapped.push_back(std::move(copy));
    }
  }
  return mapped;
}

// Each layer's weights in the lab's notation (Y = X A, A sliced by columns or rows), then the
// plan-time warnings.
void Graph::Explain(std::ostream& out) const {
  const int64_t t = topology_->sizes().tp;
  out << fmt::format("tensor_model_parallel_size {}: each weight below is cut into {} slices; "
                     "rank r of a tp group holds slice r\n",
                     t, t);
  // Shapes on every tp rank (equal, but listed as the lab does). Past kListed slices only the
  // first three and the last are planned and shown, so a tp of any size costs O(1) plans.
  constexpr int64_t kListed = 64;
  std::vector<int64_t> listed;
  for (int64_t r = 0; r < (t <= kListed ? t : 3); ++r) listed.push_back(r);
  if (t > kListed) listed.push_back(t - 1);
  std::vector<std::vector<PlannedLayer>> per_rank;
  for (int64_t r : listed) {
    RankCoordinates coords;
    coords.tp = r;
    per_rank.push_back(Plan(coords));
  }
  // "A0= [4, 1], A1= [4, 1], A2= [4, 1], ..., A99= [4, 1]": one entry per listed slice, "..."
  // where the list skips.
  const auto join_slices = [&](const auto& slice_text) {
    std::vector<std::string> slices;
    for (size_t k = 0; k < listed.size(); ++k) {
      if (k > 0 && listed[k] != listed[k - 1] + 1) slices.push_back("...");
      slices.push_back(slice_text(listed[k], per_rank[k]));
    }
    return fmt::format("{}", fmt::join(slices, ", "));
  };
  for (size_t i = 0; i < per_rank[0].size(); ++i) {
    const PlannedLayer& layer = per_rank[0][i];
    out << fmt::format(
        "\n{} {}: input {} -> output {}{}\n", layer.type, layer.name,
        layer.input_width == 0
            ? std::string("tokens")
            : fmt::format("{} ({})", layer.input_width, SplitName(layer.input.split)),
        layer.output_width == 0
            ? std::string("loss")
            : fmt::format("{} ({})", layer.output_width, SplitName(layer.output.split)),
        topology_->sizes().pp > 1
            ? fmt::format("; pipeline rank {}, chunk {}", layer.pp_rank, layer.chunk)
            : std::string());
    if (!layer.tied_weight.empty()) {
      out << fmt::format("  weight: {} (weight_from), sliced as there\n", layer.tied_weight);
    }
    const chain::LayerSlot& slot = impl_->layers[i];
    if (IsTorchModule(slot.config.type)) {
      for (const std::string& line : chain::ExplainTorchModule(slot, t)) {
        out << "  " << line << '\n';
      }
    }
    for (size_t p = 0; p < layer.parameters.size(); ++p) {
      const PlannedParameter& param = layer.parameters[p];
      const bool linear = layer.type == "ColumnParallelLinear" || layer.type == "RowParallelLinear";
      const bool matrix = param.full_shape.size() == 2;
      std::string how =
          param.tp_dim < 0
              ? "replicated on every rank"
              : fmt::format("split on dim {} into {} slices{}", param.tp_dim, t,
                            param.tp_stride > 1 ? fmt::format(" (stride {})", param.tp_stride)
                                                : "");
      out << fmt::format("  {} {} {}\n", param.name, ShapeString(param.full_shape), how);
      if (param.tp_dim < 0) continue;
      if (!(linear && matrix)) {
        out << fmt::format("    {}\n", join_slices([&](int64_t r, const auto& plan) {
                             return fmt::format("{}{}= {}",
                                                param.name.substr(param.name.find('.') + 1), r,
                                                ShapeString(plan[i].parameters[p].local_shape));
                           }));
        continue;
      }
      // The lab writes Y = X A with A = W^T ([in, out]); a column-parallel layer cuts A's
      // columns, a row-parallel layer A's rows.
      out << fmt::format("    Y = X A + b with A = weight^T {}, sliced {}:\n",
                         ShapeString({param.full_shape[1], param.full_shape[0]}),
                         param.tp_dim == 0 ? "column-wise" : "row-wise");
      out << fmt::format("    A = [\n    {}\n    ]\n",
                         join_slices([&](int64_t r, const auto& plan) {
                           const Shape& local = plan[i].parameters[p].local_shape;
                           return fmt::format("A{}= {}", r, ShapeString({local[1], local[0]}));
                         }));
    }
  }
  // Region mappings that give t-fold gradients as Megatron's code does (docs/simulator.md,
  // "Warnings"); the layout stays valid, so the exit code does too.
  const std::vector<std::string> warnings = Warnings();
  if (!warnings.empty()) out << '\n';
  for (const std::string& warning : warnings) {
    out << "warning: " << EscapeControl(warning) << '\n';
  }
}

bool Graph::MasksDependOnLayout() const {
  return std::any_of(config_.model->layers.begin(), config_.model->layers.end(),
                     [](const LayerConfig& c) { return c.type == LayerType::kDropout && c.p > 0; });
}

MemoryPlan Graph::PlanMemory(const MemoryPlanOptions& options) const {
  MemoryPlan plan;
  const RunConfig& run = *config_.run;
  const DType storage = run.dtype;
  const DType compute = ComputeDType(storage);
  const DType grad_dtype = PrecisionOf(config_).main_grad;
  const int64_t world_size = std::max<int64_t>(1, options.world_size);
  const int64_t tp = std::max<int64_t>(1, config_.parallel.tensor_model_parallel_size);
  const int64_t dp = std::max<int64_t>(1, world_size / tp);
  const int64_t rows =
      std::max<int64_t>(1, run.seq_length) * std::max<int64_t>(1, run.micro_batch_size);
  using Split = ActivationState::Split;
  const auto local_rows = [&](const ActivationState& s) {
    return s.split == Split::kSequence ? rows / tp : rows;
  };
  const auto local_width = [&](const ActivationState& s, int64_t width) {
    return s.split == Split::kHidden ? width / tp : width;
  };

  PlanBytes full_parameters = 0;      // elements of every full parameter (the reference's copy)
  PlanBytes reference_widths = 0;     // sum over layers of full input + output widths
  PlanBytes activation_elements = 0;  // this rank's row tensors, which the check exchanges
  for (const PlannedLayer& layer : Plan(coords_)) {
    for (const PlannedParameter& p : layer.parameters) {
      plan.Add(p.name, p.local_shape, storage);
      plan.Add(p.name + ".main_grad", p.local_shape, grad_dtype);
      full_parameters = SaturatingAdd(full_parameters, PlanElements(p.full_shape));
    }
    if (layer.output_width > 0) {
      const Shape out = {local_rows(layer.output), local_width(layer.output, layer.output_width)};
      plan.Add(layer.name + ".output", out, storage);
      activation_elements = SaturatingAdd(activation_elements, PlanElements(out));
      plan.Add(layer.name + ".output_grad", out, storage);
    } else {  // the loss: per-row softmax statistics
      plan.Add(layer.name + ".softmax_statistics", {2, local_rows(layer.input)}, compute);
    }
    if (layer.input_width > 0) {
      const Shape in = {local_rows(layer.input), local_width(layer.input, layer.input_width)};
      plan.Add(layer.name + ".input_grad", in, storage);
      activation_elements = SaturatingAdd(activation_elements, PlanElements(in));
      // What the layer saves for backward: the linear layers their input (a column-parallel
      // one its sequence shard under sequence parallelism, which its backward gathers again;
      // a row-parallel one at most its input's width), the others a tensor of their output's
      // size at most.
      const bool linear = layer.type == "ColumnParallelLinear" || layer.type == "RowParallelLinear";
      if (linear) {
        plan.Add(layer.name + ".saved_input",
                 {local_rows(layer.input), local_width(layer.input, layer.input_width)}, storage);
      } else if (layer.output_width > 0) {
        plan.Add(layer.name + ".saved",
                 {local_rows(layer.output), local_width(layer.output, layer.output_width)},
                 storage);
      }
    }
    reference_widths = SaturatingAdd(
        reference_widths, SaturatingAdd(static_cast<PlanBytes>(layer.input_width),
                                        static_cast<PlanBytes>(std::max<int64_t>(layer.output_width, 1))));
  }
  if (options.check) {
    // One float64 reference per job (run/check.h): full master weights shared by the rank's
    // tensors, full gradient shares, and the activations and their gradients for ceil(R / K)
    // token rows.
    const PlanBytes all_rows = SaturatingMul(static_cast<PlanBytes>(rows), static_cast<PlanBytes>(dp));
    const PlanBytes slice =
        (all_rows + static_cast<PlanBytes>(world_size) - 1) / static_cast<PlanBytes>(world_size);
    plan.AddElements("reference: master weights (float64, full)", full_parameters,
                     DType::kFloat64, true);
    plan.AddElements("reference: gradients (float64, full)", full_parameters, DType::kFloat64,
                     true);
    plan.AddElements("reference: activations and their gradients (float64, this rank's rows)",
                     SaturatingMul(SaturatingMul(slice, reference_widths), 2), DType::kFloat64,
                     true);
    // The exchange sends this rank's row tensors (as float64) in parts of at most
    // exchange_bytes, and receives as much.
    const PlanBytes part =
        std::min(static_cast<PlanBytes>(std::max<int64_t>(options.exchange_bytes, 0)) /
                     DTypeSize(DType::kFloat64),
                 activation_elements);
    plan.AddElements("check: exchange buffers (send and receive)", SaturatingMul(part, 2),
                     DType::kFloat64, true);
  }
  return plan;
}

}  // namespace mpusim
