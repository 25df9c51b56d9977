// The optimizer's own tensors on a rank (see optimizer_plan.h).
#include "core/model/optimizer_plan.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace mpusim {

int64_t OptimizerStateBytes(const OptimizerConfig& optimizer, const OptimizerPrecision& precision) {
  const size_t moments = optimizer.kind == OptimizerConfig::Kind::kAdam
                             ? DTypeSize(precision.exp_avg) + DTypeSize(precision.exp_avg_sq)
                             : DTypeSize(precision.exp_avg);
  return MasterBytes(precision) + static_cast<int64_t>(moments);
}

int64_t ScaledStates(const OptimizerConfig& optimizer, const OptimizerPrecision& precision) {
  const bool adam = optimizer.kind == OptimizerConfig::Kind::kAdam;
  return (precision.master == DType::kFloat16) + (precision.exp_avg == DType::kFloat16) +
         (adam && precision.exp_avg_sq == DType::kFloat16);
}

int64_t OwnedParameters(const std::vector<PlanBytes>& elements, int64_t shards, int64_t rank) {
  PlanBytes total = 0;
  for (const PlanBytes e : elements) total += e;
  const auto d = static_cast<PlanBytes>(std::max<int64_t>(1, shards));
  const PlanBytes piece = (total + d - 1) / d;
  const PlanBytes begin = piece * static_cast<PlanBytes>(rank), end = begin + piece;
  int64_t owned = 0;
  PlanBytes offset = 0;
  for (auto it = elements.rbegin(); it != elements.rend(); ++it) {
    if (*it > 0 && offset < end && offset + *it > begin) ++owned;
    offset += *it;
  }
  return owned;
}

// The step, once every stash is gone: each update makes a new parameter tensor; the
// distributed optimizer also gathers the main_grads of each buffer (the dense one, then the
// experts') into a flat buffer (main_grad dtype, padded to its D pieces), reduce-scatters it
// to this rank's piece, and after the update all-gathers each buffer's updated pieces in the
// storage dtype. A 16-bit main_grad is copied to float32 for the step (every trained element
// for the plain optimizer, each piece for the distributed one), the copies alive until the
// next iteration begins (core/train/optimizer.h). The precision-aware optimizer reads its
// float16 states into float32 tensors of the owned elements while the update runs (freed
// before the all-gather).
OptimizerStepBytes PlanOptimizerStep(const OptimizerConfig& optimizer, DType storage,
                                     const OptimizerPrecision& precision, int64_t train_iters,
                                     const OptimizerShards& mine) {
  const double e = static_cast<double>(DTypeSize(storage));
  const double c = static_cast<double>(DTypeSize(precision.main_grad));
  const double copy = precision.grads_copied_for_step ? 4.0 : 0.0;
  const double largest = static_cast<double>(mine.largest_parameter_elements) * e;
  OptimizerStepBytes out;
  out.step = largest + copy * static_cast<double>(mine.dense_elements + mine.expert_elements);
  if (!optimizer.use_distributed_optimizer) return out;
  struct Buffer {
    double padded, piece, d;
  };
  std::vector<Buffer> buffers;
  for (const auto& [elements, shards] : {std::pair{mine.dense_elements, mine.dense_shards},
                                         std::pair{mine.expert_elements, mine.expert_shards}}) {
    if (elements == 0 && !buffers.empty()) continue;
    const double d = static_cast<double>(shards);
    const double padded = std::ceil(static_cast<double>(elements) / d) * d;
    buffers.push_back({padded, padded / d, d});
  }
  // Each piece (all of the buffer when d is 1) stays until the next step replaces it: a
  // buffer's flat gradients and new piece are made beside the new pieces of the buffers
  // before it and the last step's of it and those after it.
  const bool carries = train_iters > 1;
  double last = 0, pieces = 0;
  for (const Buffer& buffer : buffers) {
    last += carries ? buffer.piece * c : 0;
    pieces += buffer.piece;
  }
  double scatter = 0, done = 0, all_gathered = 0;
  for (const Buffer& buffer : buffers) {
    const double piece = buffer.d > 1 ? buffer.piece * c : 0;  // a new one
    scatter = std::max(scatter, done + last + buffer.padded * c + piece);
    done += buffer.piece * c;
    last -= carries ? buffer.piece * c : 0;
    all_gathered = std::max(all_gathered, buffer.d > 1 ? buffer.padded * e : 0);
  }
  const double unscaled = 4.0 * static_cast<double>(ScaledStates(optimizer, precision));
  const double update = pieces * c + pieces * copy + pieces * e + pieces * unscaled;
  const double gather = pieces * c + pieces * copy + pieces * e + all_gathered + largest;
  out.step = std::max({scatter, update, gather});
  out.carried = carries ? done : 0;
  return out;
}

}  // namespace mpusim
