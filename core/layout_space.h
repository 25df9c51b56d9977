// The layouts of a model on N ranks, declared once: the axes, the rules every layout obeys, one
// enumerator, and the one function that writes a layout into a config document. `mpusim
// sweep` runs what it yields, `mpusim advise` ranks it (DESIGN.md: core/layout_space).
//
// What it is not: a judge of the model. The rules here are the layout's own (divisibility,
// what an axis needs); whether a model splits over a layout (heads, shapes, stages, the
// schedule) is the caller's question, asked of the config (BuildModel, CheckGptLayout).
//
// The axes, in the order the enumerator nests them (the first outermost):
//   tp   every divisor of N; at most max_tp; within a node (tp <= gpus_per_node) it divides
//        the node, so a tp group never straddles two
//   cp   every divisor of N / tp, at most max_cp
//   pp   every divisor of N / (tp cp), dividing num_layers when given
//   vp   none (0), then by virtual_pipeline: 2, or every v >= 2 dividing num_layers / pp;
//        only with pp > 1
//   sp   each of sequence_parallel; sequence parallelism needs tp > 1
//   dist each of distributed_optimizer; the distributed optimizer needs an optimizer, and with
//        distributed_optimizer_needs_sharding a dp x cp > 1 to shard over
//   mbs  with global_batch_size > 0, each of micro_batch_sizes dividing global batch / dp, and
//        under the interleaved schedule (vp > 0) giving a number of micro-batches that pp
//        divides (Megatron's rule); else not searched (0)
//   ep   every divisor of gcd(dp x cp, num_experts) (expert parallelism is carved out of
//        dp x cp); 1 without experts
//   recompute  each of recompute (not searched when empty)
//   etp  Megatron's default (tp's, written 0), then with whole_experts 1 (each expert whole on
//        one rank) where there are experts and tp > 1
// and dp = N / (tp cp pp) follows from them.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config/model_config.h"

namespace mpusim {

struct Layout {
  int64_t tp = 1, cp = 1, pp = 1;
  int64_t vp = 0;  // virtual_pipeline_model_parallel_size; 0: not interleaved
  int64_t dp = 1;  // N / (tp cp pp)
  bool sequence_parallel = false;
  bool distributed_optimizer = false;  // optimizer.use_distributed_optimizer
  int64_t micro_batch_size = 0;        // 0: not searched (the caller's)
  int64_t ep = 1;                      // expert_model_parallel_size, carved out of dp x cp
  std::optional<RunConfig::Recompute> recompute;  // nullopt: not searched
  int64_t etp = 0;  // expert_tensor_parallel_size; 0: tp's (Megatron's default)

  // "tp 2 cp 2 pp 2 vp 2 dp 1 ep 2 etp 1 sp dist-opt": the axes that are not at their default.
  std::string Name() const;
};

// What a caller searches: the space's size N and, per axis, its candidates and caps.
struct LayoutSpace {
  enum class VirtualPipeline { kNone, kTwo, kDividingStageLayers };

  int64_t world_size = 1;
  int64_t max_tp = 0;         // 0: no limit
  int64_t gpus_per_node = 0;  // > 0: a tp within a node divides the node
  int64_t max_cp = 0;         // 0: no limit; 1: no context parallelism
  int64_t num_layers = 0;     // > 0: pp divides the layers
  VirtualPipeline virtual_pipeline = VirtualPipeline::kNone;
  std::vector<bool> sequence_parallel = {false, true};
  std::vector<bool> distributed_optimizer = {false, true};
  bool has_optimizer = false;
  // The distributed optimizer only where it shards something (dp x cp > 1): the sweep's rule,
  // which advise does not apply (it ranks the dp x cp = 1 twin as its own candidate).
  bool distributed_optimizer_needs_sharding = false;
  int64_t global_batch_size = 0;  // > 0: the micro-batch axis, from micro_batch_sizes
  std::vector<int64_t> micro_batch_sizes;
  int64_t num_experts = 0;     // > 0: the ep axis
  std::vector<RunConfig::Recompute> recompute;  // empty: not searched
  bool whole_experts = false;  // also etp 1 (with experts and tp > 1)
};

// Every layout of `space`, in the axes' order above; each satisfies SatisfiesRules.
std::vector<Layout> EnumerateLayouts(const LayoutSpace& space);

// Whether `layout` obeys every rule of `space` (the enumerator's rules, checked one layout at
// a time: for tests and for callers holding a layout from elsewhere).
bool SatisfiesRules(const LayoutSpace& space, const Layout& layout);

// `document` (a config) with the layout of `layout` on `world_size` ranks: its parallel section
// becomes exactly the layout's keys (world size, tp, pp, sequence parallelism, and cp, ep, etp
// and vp where not at their defaults), optimizer.use_distributed_optimizer is set where there
// is an optimizer section, and run.micro_batch_size where the layout has one. Recomputation is
// not written.
void WriteLayout(const Layout& layout, int64_t world_size, nlohmann::json* document);

}  // namespace mpusim
