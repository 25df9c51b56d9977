// Expert parallelism's grouping of the experts (see expert_placement.h).
#include "core/expert_parallel/expert_placement.h"

namespace mpusim {

std::optional<int64_t> ExpertOf(std::string_view name) {
  for (std::string_view key : {".mlp.experts.local_experts.", ".mlp.experts.linear_fc1.weight",
                               ".mlp.experts.linear_fc2.weight"}) {
    const size_t at = name.find(key);
    if (at == std::string_view::npos) continue;
    size_t i = at + key.size();
    if (i >= name.size() || name[i] < '0' || name[i] > '9') continue;
    int64_t e = 0;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) e = e * 10 + (name[i] - '0');
    return e;
  }
  return std::nullopt;
}

}  // namespace mpusim
