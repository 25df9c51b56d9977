// Expert parallelism's grouping of the experts (see expert_placement.h).
#include "core/expert_parallel/expert_placement.h"

namespace mpusim {

std::optional<int64_t> ExpertOf(std::string_view name) {
  constexpr std::string_view kKey = ".mlp.experts.local_experts.";
  const size_t at = name.find(kKey);
  if (at == std::string_view::npos) return std::nullopt;
  size_t i = at + kKey.size();
  if (i >= name.size() || name[i] < '0' || name[i] > '9') return std::nullopt;
  int64_t e = 0;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) e = e * 10 + (name[i] - '0');
  return e;
}

}  // namespace mpusim
