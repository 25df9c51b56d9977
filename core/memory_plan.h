// A rank's memory plan: the tensors it will hold, in bytes, counted from the config before
// anything is allocated (`mpusim run`'s preflight, run/preflight.h; each model plans its own,
// core/model/model.h).
//
// Every count is formed in 128-bit arithmetic and saturates at 2^100 bytes, so shapes whose
// products wrap int64 or size_t are refused like any other oversized run, never allocated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mpusim {

using PlanBytes = unsigned __int128;
// Far above any machine; products are capped here so that they never wrap 128 bits either.
inline constexpr PlanBytes kPlanBytesCap = PlanBytes{1} << 100;

PlanBytes SaturatingMul(PlanBytes a, PlanBytes b);
PlanBytes SaturatingAdd(PlanBytes a, PlanBytes b);
// The elements of `shape` (negative dimensions count 0), saturated.
PlanBytes PlanElements(const Shape& shape);
// A byte count formed in doubles (a sum over tensors of fractional rows) as whole bytes,
// rounded up and saturated.
PlanBytes PlanByteCount(double bytes);

struct MemoryItem {
  std::string name;  // "fc1.weight", "fc1.output_grad", "reference: master weights"
  Shape shape;       // local shape on this rank ({} for aggregates)
  DType dtype;
  PlanBytes bytes;
  // In host memory whatever the backend (the float64 reference, the check's buffers); the
  // other items live where the backend's tensors do (a GPU's memory for --backend cuda).
  bool host = false;
};

struct MemoryPlan {
  std::vector<MemoryItem> items;
  PlanBytes total = 0;

  // A tensor of `shape` in `dtype` on the backend's device.
  void Add(std::string name, Shape shape, DType dtype);
  // An aggregate of `elements` elements of `dtype`; `host`: in host memory whatever the backend.
  void AddElements(std::string name, PlanBytes elements, DType dtype, bool host = false);
  // An aggregate of `bytes` bytes of tensors in `dtype` (a count summed over tensors of
  // different shapes: core/model/activation_plan.h).
  void AddBytes(std::string name, PlanBytes bytes, DType dtype, bool host = false);
  // The items with host set, or not: on a backend with device memory, the two sides of it.
  MemoryPlan HostItems() const { return Items(true); }
  MemoryPlan DeviceItems() const { return Items(false); }
  MemoryPlan Items(bool host) const;
};

}  // namespace mpusim
