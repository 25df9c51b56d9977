// Numbering the dropout draws of each pipeline rank's tracker (see tracker_draws.h).
#include "reference/tracker_draws.h"

#include "core/schedule.h"

namespace mpusim {

StatusOr<DrawPositions> NumberTrackerDraws(
    const ParallelConfig& parallel, int64_t num_microbatches,
    const std::vector<std::vector<std::array<int64_t, 2>>>& draws) {
  const int64_t p = parallel.pipeline_model_parallel_size;
  std::vector<std::pair<int64_t, int64_t>> forward_order;  // (micro-batch, chunk)
  if (p > 1) {
    StatusOr<PipelineSchedule> schedule =
        BuildPipelineSchedule(p, parallel.virtual_pipeline_model_parallel_size, num_microbatches,
                              parallel.microbatch_group_size_per_vp_stage);
    if (!schedule.ok()) return schedule.status();
    forward_order = schedule->forward_table;
  } else {
    for (int64_t m = 0; m < num_microbatches; ++m) forward_order.emplace_back(m, 0);
  }
  DrawPositions out;
  out.first.resize(draws.size());
  out.per_iteration.assign(draws.size(), {0, 0});
  for (size_t r = 0; r < draws.size(); ++r) {
    std::array<int64_t, 2>& total = out.per_iteration[r];
    for (const auto& [m, c] : forward_order) {
      out.first[r][{c, m}] = total;
      for (size_t stream = 0; stream < 2; ++stream) {
        total[stream] += draws[r].at(static_cast<size_t>(c))[stream];
      }
    }
  }
  return out;
}

}  // namespace mpusim
