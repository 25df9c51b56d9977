#include "core/layout_space.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <string_view>

#include "core/config/optimizer_config.h"
#include "core/config/parallel_config.h"
#include "core/topology.h"

namespace mpusim {
namespace {

// The candidates of each axis that depends on the ones outside it (layout_space.h).
std::vector<int64_t> VirtualSizes(const LayoutSpace& space, int64_t pp) {
  std::vector<int64_t> vps = {0};
  if (pp == 1) return vps;
  switch (space.virtual_pipeline) {
    case LayoutSpace::VirtualPipeline::kNone:
      break;
    case LayoutSpace::VirtualPipeline::kTwo:
      vps.push_back(2);
      break;
    case LayoutSpace::VirtualPipeline::kDividingStageLayers:
      if (space.num_layers > 0) {
        for (int64_t v : DivisorsOf(space.num_layers / pp)) {
          if (v >= 2) vps.push_back(v);
        }
      }
      break;
  }
  return vps;
}

std::vector<int64_t> ExpertSizes(const LayoutSpace& space, int64_t dp_cp) {
  return space.num_experts > 0 ? DivisorsOf(std::gcd(dp_cp, space.num_experts))
                               : std::vector<int64_t>{1};
}

bool TpAllowed(const LayoutSpace& space, int64_t tp) {
  if (space.max_tp > 0 && tp > space.max_tp) return false;
  // Within a node, tp divides the node (a group never straddles two).
  return !(space.gpus_per_node > 0 && tp <= space.gpus_per_node && space.gpus_per_node % tp != 0);
}

bool DistributedOptimizerAllowed(const LayoutSpace& space, const Layout& l) {
  return space.has_optimizer &&
         (!space.distributed_optimizer_needs_sharding || l.dp * l.cp > 1);
}

// With the micro-batch axis: mbs divides global batch / dp, and the interleaved schedule needs
// a number of micro-batches that pp divides (Megatron's rule).
bool MicroBatchAllowed(const LayoutSpace& space, const Layout& l) {
  if (l.micro_batch_size < 1) return false;
  if (space.global_batch_size % (l.micro_batch_size * l.dp) != 0) return false;
  const int64_t m = space.global_batch_size / (l.micro_batch_size * l.dp);
  return l.vp == 0 || m % l.pp == 0;
}

template <typename T>
bool Contains(const std::vector<T>& list, const T& value) {
  return std::find(list.begin(), list.end(), value) != list.end();
}

}  // namespace

std::string Layout::Name() const {
  return fmt::format("tp {}{} pp {}{} dp {}{}{}{}{}", tp, cp > 1 ? fmt::format(" cp {}", cp) : "",
                     pp, vp > 0 ? fmt::format(" vp {}", vp) : "", dp,
                     ep > 1 ? fmt::format(" ep {}", ep) : "",
                     etp > 0 ? fmt::format(" etp {}", etp) : "", sequence_parallel ? " sp" : "",
                     distributed_optimizer ? " dist-opt" : "");
}

std::vector<Layout> EnumerateLayouts(const LayoutSpace& space) {
  const int64_t n = space.world_size;
  const std::vector<int64_t> no_mbs = {0};
  const std::vector<int64_t>& mbs_list =
      space.global_batch_size > 0 ? space.micro_batch_sizes : no_mbs;
  std::vector<std::optional<RunConfig::Recompute>> recomputes;
  for (RunConfig::Recompute r : space.recompute) recomputes.emplace_back(r);
  if (space.recompute.empty()) recomputes.emplace_back(std::nullopt);
  std::vector<Layout> layouts;
  for (int64_t tp : DivisorsOf(n)) {
    if (!TpAllowed(space, tp)) continue;
    for (int64_t cp : DivisorsOf(n / tp)) {
      if (space.max_cp > 0 && cp > space.max_cp) continue;
      for (int64_t pp : DivisorsOf(n / (tp * cp))) {
        if (space.num_layers > 0 && space.num_layers % pp != 0) continue;
        Layout l;
        l.tp = tp;
        l.cp = cp;
        l.pp = pp;
        l.dp = n / (tp * cp * pp);
        const std::vector<int64_t> eps = ExpertSizes(space, l.dp * cp);
        for (int64_t vp : VirtualSizes(space, pp)) {
          l.vp = vp;
          for (bool sp : space.sequence_parallel) {
            if (sp && tp == 1) continue;
            l.sequence_parallel = sp;
            for (bool distributed : space.distributed_optimizer) {
              l.distributed_optimizer = distributed;
              if (distributed && !DistributedOptimizerAllowed(space, l)) continue;
              for (int64_t mbs : mbs_list) {
                l.micro_batch_size = mbs;
                if (space.global_batch_size > 0 && !MicroBatchAllowed(space, l)) continue;
                for (int64_t ep : eps) {
                  l.ep = ep;
                  for (const std::optional<RunConfig::Recompute>& recompute : recomputes) {
                    l.recompute = recompute;
                    for (int64_t etp : {int64_t{0}, int64_t{1}}) {
                      if (etp == 1 && !(space.whole_experts && space.num_experts > 0 && tp > 1)) {
                        continue;
                      }
                      l.etp = etp;
                      layouts.push_back(l);
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return layouts;
}

bool SatisfiesRules(const LayoutSpace& space, const Layout& l) {
  const int64_t n = space.world_size;
  if (l.tp < 1 || l.cp < 1 || l.pp < 1 || l.dp < 1 || l.ep < 1) return false;
  if (l.tp * l.cp * l.pp * l.dp != n || !TpAllowed(space, l.tp)) return false;
  if (space.max_cp > 0 && l.cp > space.max_cp) return false;
  if (space.num_layers > 0 && space.num_layers % l.pp != 0) return false;
  if (!Contains(VirtualSizes(space, l.pp), l.vp)) return false;
  if (!Contains(space.sequence_parallel, l.sequence_parallel) ||
      (l.sequence_parallel && l.tp == 1)) {
    return false;
  }
  if (!Contains(space.distributed_optimizer, l.distributed_optimizer) ||
      (l.distributed_optimizer && !DistributedOptimizerAllowed(space, l))) {
    return false;
  }
  if (space.global_batch_size > 0
          ? !Contains(space.micro_batch_sizes, l.micro_batch_size) || !MicroBatchAllowed(space, l)
          : l.micro_batch_size != 0) {
    return false;
  }
  if (!Contains(ExpertSizes(space, l.dp * l.cp), l.ep)) return false;
  if (space.recompute.empty() ? l.recompute.has_value()
                              : !l.recompute || !Contains(space.recompute, *l.recompute)) {
    return false;
  }
  return l.etp == 0 || (l.etp == 1 && space.whole_experts && space.num_experts > 0 && l.tp > 1);
}

void WriteLayout(const Layout& l, int64_t world_size, nlohmann::json* document) {
  using P = ParallelConfig;
  const auto key = [](std::string_view k) { return std::string(k); };
  nlohmann::json& doc = *document;
  doc["parallel"] = {{key(ParallelKey(&P::world_size)), world_size},
                     {key(ParallelKey(&P::tensor_model_parallel_size)), l.tp},
                     {key(ParallelKey(&P::pipeline_model_parallel_size)), l.pp},
                     {key(ParallelKey(&P::sequence_parallel)), l.sequence_parallel}};
  nlohmann::json& par = doc["parallel"];
  if (l.cp > 1) par[key(ParallelKey(&P::context_parallel_size))] = l.cp;
  if (l.ep > 1) par[key(ParallelKey(&P::expert_model_parallel_size))] = l.ep;
  if (l.etp > 0) par[key(ParallelKey(&P::expert_tensor_parallel_size))] = l.etp;
  if (l.vp > 0) par[key(ParallelKey(&P::virtual_pipeline_model_parallel_size))] = l.vp;
  if (doc.contains("optimizer")) {
    doc["optimizer"][key(OptimizerKey(&OptimizerConfig::use_distributed_optimizer))] =
        l.distributed_optimizer;
  }
  if (l.micro_batch_size > 0) {
    doc["run"][key(RunKey(&RunConfig::micro_batch_size))] = l.micro_batch_size;
  }
}

}  // namespace mpusim
