// A rank's memory plan (see memory_plan.h).
#include "core/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace mpusim {

PlanBytes SaturatingMul(PlanBytes a, PlanBytes b) {
  if (a == 0 || b == 0) return 0;
  if (a >= kPlanBytesCap || b >= kPlanBytesCap || a > kPlanBytesCap / b) return kPlanBytesCap;
  return a * b;
}

PlanBytes SaturatingAdd(PlanBytes a, PlanBytes b) { return std::min(kPlanBytesCap, a + b); }

PlanBytes PlanElements(const Shape& shape) {
  PlanBytes n = 1;
  for (const int64_t d : shape) {
    n = SaturatingMul(n, static_cast<PlanBytes>(std::max<int64_t>(d, 0)));
  }
  return n;
}

PlanBytes PlanByteCount(double bytes) {
  if (!(bytes > 0)) return 0;
  if (bytes >= std::ldexp(1.0, 100)) return kPlanBytesCap;
  return static_cast<PlanBytes>(std::ceil(bytes));
}

void MemoryPlan::Add(std::string name, Shape shape, DType dtype) {
  const PlanBytes bytes = SaturatingMul(PlanElements(shape), DTypeSize(dtype));
  items.push_back(MemoryItem{std::move(name), std::move(shape), dtype, bytes});
  total = SaturatingAdd(total, bytes);
}

void MemoryPlan::AddElements(std::string name, PlanBytes elements, DType dtype, bool host) {
  const PlanBytes bytes = SaturatingMul(elements, DTypeSize(dtype));
  items.push_back(MemoryItem{std::move(name), {}, dtype, bytes, host});
  total = SaturatingAdd(total, bytes);
}

void MemoryPlan::AddBytes(std::string name, PlanBytes bytes, DType dtype, bool host) {
  bytes = std::min(bytes, kPlanBytesCap);
  items.push_back(MemoryItem{std::move(name), {}, dtype, bytes, host});
  total = SaturatingAdd(total, bytes);
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

}  // namespace mpusim
