// The resource preflight (see preflight.h).
#include "run/preflight.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "run/check.h"

namespace mpusim::run {
namespace {

using Bytes = unsigned __int128;
// Far above any machine; products are capped here so that they never wrap 128 bits either
// (every factor is at most 2^31).
constexpr Bytes kCap = Bytes{1} << 100;

Bytes SaturatingMul(Bytes a, Bytes b) {
  if (a == 0 || b == 0) return 0;
  if (a >= kCap || b >= kCap || a > kCap / b) return kCap;
  return a * b;
}
Bytes SaturatingAdd(Bytes a, Bytes b) { return std::min(kCap, a + b); }

Bytes Elements(const Shape& shape) {
  Bytes n = 1;
  for (const int64_t d : shape) n = SaturatingMul(n, static_cast<Bytes>(std::max<int64_t>(d, 0)));
  return n;
}

class Planner {
 public:
  explicit Planner(MemoryPlan* plan) : plan_(plan) {}
  void Add(std::string name, Shape shape, DType dtype) {
    const Bytes bytes = SaturatingMul(Elements(shape), DTypeSize(dtype));
    plan_->items.push_back(MemoryItem{std::move(name), std::move(shape), dtype, bytes});
    plan_->total = SaturatingAdd(plan_->total, bytes);
  }
  void AddBytes(std::string name, Bytes elements, DType dtype, bool host = false) {
    const Bytes bytes = SaturatingMul(elements, DTypeSize(dtype));
    plan_->items.push_back(MemoryItem{std::move(name), {}, dtype, bytes, host});
    plan_->total = SaturatingAdd(plan_->total, bytes);
  }

 private:
  MemoryPlan* plan_;
};

}  // namespace

MemoryPlan PlanRankMemory(const Config& config, const Graph& graph, const RankCoordinates& coords,
                          int64_t world_size, bool check) {
  MemoryPlan plan;
  Planner add(&plan);
  const RunConfig& run = *config.run;
  const DType storage = run.dtype;
  const DType compute = ComputeDType(storage);
  const int64_t tp = config.parallel.tensor_model_parallel_size;
  const int64_t dp = std::max<int64_t>(1, world_size / std::max<int64_t>(1, tp));
  const int64_t rows = std::max<int64_t>(1, run.seq_length) * std::max<int64_t>(1, run.micro_batch_size);
  using Split = ActivationState::Split;
  const auto local_rows = [&](const ActivationState& s) {
    return s.split == Split::kSequence ? rows / std::max<int64_t>(1, tp) : rows;
  };
  const auto local_width = [&](const ActivationState& s, int64_t width) {
    return s.split == Split::kHidden ? width / std::max<int64_t>(1, tp) : width;
  };

  Bytes full_parameters = 0;    // elements of every full parameter (the reference's copy)
  Bytes reference_widths = 0;   // sum over layers of full input + output widths
  Bytes activation_elements = 0;  // this rank's row tensors, which the check exchanges
  for (const Graph::PlannedLayer& layer : graph.Plan(coords)) {
    for (const Graph::PlannedParameter& p : layer.parameters) {
      add.Add(p.name, p.local_shape, storage);
      add.Add(p.name + ".main_grad", p.local_shape, compute);
      full_parameters = SaturatingAdd(full_parameters, Elements(p.full_shape));
    }
    if (layer.output_width > 0) {
      const Shape out = {local_rows(layer.output), local_width(layer.output, layer.output_width)};
      add.Add(layer.name + ".output", out, storage);
      activation_elements = SaturatingAdd(activation_elements, Elements(out));
      add.Add(layer.name + ".output_grad", out, storage);
    } else {  // the loss: per-row softmax statistics
      add.Add(layer.name + ".softmax_statistics", {2, local_rows(layer.input)}, compute);
    }
    if (layer.input_width > 0) {
      const Shape in = {local_rows(layer.input), local_width(layer.input, layer.input_width)};
      add.Add(layer.name + ".input_grad", in, storage);
      activation_elements = SaturatingAdd(activation_elements, Elements(in));
      // What the layer saves for backward: the linear layers their (gathered) input, the
      // others a tensor of their output's size at most.
      const bool linear = layer.type == "ColumnParallelLinear" || layer.type == "RowParallelLinear";
      if (linear) {
        add.Add(layer.name + ".saved_input", {rows, local_width(layer.input, layer.input_width)},
                storage);
      } else if (layer.output_width > 0) {
        add.Add(layer.name + ".saved",
                {local_rows(layer.output), local_width(layer.output, layer.output_width)}, storage);
      }
    }
    reference_widths =
        SaturatingAdd(reference_widths, SaturatingAdd(static_cast<Bytes>(layer.input_width),
                                  static_cast<Bytes>(std::max<int64_t>(layer.output_width, 1))));
  }
  if (check) {
    // One float64 reference per job: full master weights shared by the rank's tensors, full
    // gradient shares, and the activations and their gradients for ceil(R / K) token rows.
    const Bytes all_rows = SaturatingMul(static_cast<Bytes>(rows), static_cast<Bytes>(dp));
    const Bytes slice = (all_rows + static_cast<Bytes>(world_size) - 1) /
                        static_cast<Bytes>(std::max<int64_t>(1, world_size));
    add.AddBytes("reference: master weights (float64, full)", full_parameters, DType::kFloat64,
                 true);
    add.AddBytes("reference: gradients (float64, full)", full_parameters, DType::kFloat64, true);
    add.AddBytes("reference: activations and their gradients (float64, this rank's rows)",
                 SaturatingMul(SaturatingMul(slice, reference_widths), 2), DType::kFloat64, true);
    // The exchange sends this rank's row tensors (as float64) in parts of at most
    // kExchangeBytes, and receives as much.
    const Bytes part = std::min(static_cast<Bytes>(kExchangeBytes) / DTypeSize(DType::kFloat64),
                                activation_elements);
    add.AddBytes("check: exchange buffers (send and receive)", SaturatingMul(part, 2),
                 DType::kFloat64, true);
  }
  return plan;
}

MemoryPlan PlanGptRankMemory(const Config& config, const GptConfig& gpt, int64_t tp, bool check) {
  MemoryPlan plan;
  Planner add(&plan);
  const RunConfig& run = *config.run;
  const DType storage = run.dtype;
  const DType compute = ComputeDType(storage);
  const int64_t t = std::max<int64_t>(1, tp);
  const int64_t s = run.seq_length, b = run.micro_batch_size;
  const int64_t rows = s * b;
  const int64_t stream_rows = config.parallel.sequence_parallel && t > 1 ? rows / t : rows;
  const int64_t h = gpt.hidden_size, heads_local = gpt.num_attention_heads / t;
  const int64_t qkv_local = gpt.QkvRows() / t, fc1_local = gpt.Fc1Rows() / t;
  const int64_t ffn_local = gpt.ffn_hidden_size / t;
  const int64_t attn_local = heads_local * gpt.kv_channels;
  const int64_t vp = gpt.PaddedVocabSize(t);
  Bytes full_parameters = 0;
  for (const GptParameter& p : GptParameters(gpt, vp, false)) {
    Shape local = p.shape;
    if (p.tp_dim >= 0) local[static_cast<size_t>(p.tp_dim)] /= t;
    add.Add(p.name, local, storage);
    add.Add(p.name + ".main_grad", local, compute);
    full_parameters = SaturatingAdd(full_parameters, Elements(p.shape));
  }
  // One micro-batch's stash per layer (forward to backward), and about as much again for
  // the gradients in flight: stream tensors, the gathered GEMM inputs, qkv and its per-head
  // copies, the attention probabilities before and after dropout, fc1 and the activation.
  const Bytes L = static_cast<Bytes>(gpt.num_layers);
  const Bytes stream = Elements({stream_rows, h});
  const Bytes per_layer = SaturatingAdd(
      SaturatingAdd(SaturatingMul(stream, 6), Elements({rows, 2 * qkv_local})),
      SaturatingAdd(Elements({2 * b * heads_local, s, s}),
                    Elements({rows, attn_local + fc1_local + ffn_local + 2 * h})));
  add.AddBytes("activations: every layer's stash of one micro-batch", SaturatingMul(per_layer, L),
               storage);
  add.AddBytes("activation gradients in flight (one layer)", SaturatingMul(per_layer, 2), storage);
  add.Add("logits and their gradient", {2 * rows, vp / t}, storage);
  if (check) {
    // Every rank runs the float64 reference on its dp rank's b samples (run/gpt_check.h).
    add.AddBytes("reference: parameters and gradients (float64, full)",
                 SaturatingMul(full_parameters, 2), DType::kFloat64, true);
    const int64_t attn = gpt.num_attention_heads * gpt.kv_channels;
    const Bytes ref_layer = SaturatingAdd(
        Elements({rows, 6 * h + gpt.QkvRows() + attn + gpt.Fc1Rows() + 2 * gpt.ffn_hidden_size}),
        Elements({2 * b * gpt.num_attention_heads, s, s}));
    add.AddBytes("reference: activations and their gradients (float64, this rank's samples)",
                 SaturatingMul(SaturatingAdd(SaturatingMul(ref_layer, L), Elements({rows, 2 * vp})),
                               2),
                 DType::kFloat64, true);
  }
  return plan;
}

std::string FormatBytes(unsigned __int128 bytes) {
  if (bytes >= kCap || bytes >= (Bytes{1} << 64)) return "more than 16 EiB";
  const double b = static_cast<double>(static_cast<uint64_t>(bytes));
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int unit = 0;
  double value = b;
  while (value >= 1024 && unit < 6) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", static_cast<uint64_t>(bytes))
                   : fmt::format("{:.1f} {}", value, kUnits[unit]);
}

MemoryPlan MemoryPlan::Items(bool host) const {
  MemoryPlan part;
  for (const MemoryItem& item : items) {
    if (item.host != host) continue;
    part.items.push_back(item);
    part.total = SaturatingAdd(part.total, item.bytes);
  }
  return part;
}

Status CheckDeviceMemory(const MemoryPlan& plan, const DeviceMemory& device) {
  const int64_t ranks = std::max<int64_t>(1, device.ranks);
  return CheckRankMemory(
      plan.DeviceItems(), device.free_bytes / static_cast<uint64_t>(ranks),
      fmt::format("{}'s free memory, {} of {}, shared by {} rank{}", device.device,
                  FormatBytes(device.free_bytes), FormatBytes(device.total_bytes), ranks,
                  ranks == 1 ? "" : "s"),
      "spread the model over more GPUs (tp, pp) or start fewer ranks per GPU");
}

Status CheckRankMemory(const MemoryPlan& plan, uint64_t limit_bytes,
                       const std::string& limit_source, const std::string& remedy) {
  if (plan.total <= limit_bytes) return {};
  std::vector<const MemoryItem*> biggest;
  for (const MemoryItem& item : plan.items) biggest.push_back(&item);
  std::stable_sort(biggest.begin(), biggest.end(),
                   [](const MemoryItem* a, const MemoryItem* b) { return a->bytes > b->bytes; });
  std::string list;
  for (size_t i = 0; i < std::min<size_t>(3, biggest.size()); ++i) {
    const MemoryItem& item = *biggest[i];
    if (!list.empty()) list += ", ";
    list += item.shape.empty()
                ? fmt::format("{} {}", item.name, FormatBytes(item.bytes))
                : fmt::format("{} {} {} {}", item.name, ShapeString(item.shape),
                              DTypeName(item.dtype), FormatBytes(item.bytes));
  }
  return Status::Error("run", fmt::format("one rank would hold {}, more than the {} allowed ({}); "
                                          "biggest: {}; shrink seq_length, micro_batch_size or "
                                          "the layers, or {}",
                                          FormatBytes(plan.total), FormatBytes(limit_bytes),
                                          limit_source, list, remedy));
}

std::optional<uint64_t> ParseByteSize(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || errno != 0 || !std::isfinite(value) || value <= 0) {
    return std::nullopt;
  }
  std::string unit(end);
  double scale = 1;
  if (unit.empty() || unit == "B") {
    scale = 1;
  } else if (unit == "K" || unit == "KiB" || unit == "k") {
    scale = 1024.0;
  } else if (unit == "M" || unit == "MiB") {
    scale = 1024.0 * 1024;
  } else if (unit == "G" || unit == "GiB") {
    scale = 1024.0 * 1024 * 1024;
  } else if (unit == "T" || unit == "TiB") {
    scale = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return std::nullopt;
  }
  const double bytes = value * scale;
  if (bytes < 1 || bytes >= 1.8e19) return std::nullopt;
  return static_cast<uint64_t>(bytes);
}

std::optional<uint64_t> AvailableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream fields(line.substr(13));
      uint64_t kib = 0;
      if (fields >> kib) return kib * 1024;
    }
  }
  return std::nullopt;
}

}  // namespace mpusim::run
