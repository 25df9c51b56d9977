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
MemoryPlan PlanRankMemory(const Model& model, int64_t world_size, bool check) {
  return model.PlanMemory({world_size, check, kExchangeBytes});
}

std::string FormatBytes(unsigned __int128 bytes) {
  if (bytes >= kPlanBytesCap || bytes >= (PlanBytes{1} << 64)) return "more than 16 EiB";
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
