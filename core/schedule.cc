// Pipeline schedules and virtual-pipeline layer assignment; the formulas are in schedule.h.
//
// Pure functions of their arguments: no globals, no I/O. Validation returns a Status naming
// the offending field; nothing here asserts on user input.
#include "core/schedule.h"

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace mpusim {
namespace {

std::string Str(int64_t value) { return std::to_string(value); }

Status RequirePositive(const char* field, int64_t value) {
  if (value >= 1) {
    return Status();
  }
  return Status::Error(field, "must be at least 1, got " + Str(value));
}

// Both schedules share the 1F1B shape over a forward table; only the table, the warmup and the
// backward's chunk differ. Backward k undoes forward k of the mirrored chunk v-1-c: the last
// virtual stage's loss is the first gradient to exist.
std::vector<ScheduleStep> OneForwardOneBackward(
    const std::vector<std::pair<int64_t, int64_t>>& table, int64_t num_model_chunks,
    int64_t num_warmup) {
  const int64_t total = static_cast<int64_t>(table.size());
  auto forward = [&](int64_t k) {
    const auto& [microbatch, chunk] = table[static_cast<size_t>(k)];
    return ScheduleStep{Pass::kForward, chunk, microbatch};
  };
  auto backward = [&](int64_t k) {
    const auto& [microbatch, chunk] = table[static_cast<size_t>(k)];
    return ScheduleStep{Pass::kBackward, num_model_chunks - 1 - chunk, microbatch};
  };

  std::vector<ScheduleStep> steps;
  steps.reserve(static_cast<size_t>(2 * total));
  for (int64_t k = 0; k < num_warmup; ++k) {
    steps.push_back(forward(k));
  }
  const int64_t num_steady = total - num_warmup;
  for (int64_t k = 0; k < num_steady; ++k) {
    steps.push_back(forward(k + num_warmup));
    steps.push_back(backward(k));
  }
  for (int64_t k = num_steady; k < total; ++k) {
    steps.push_back(backward(k));
  }
  return steps;
}

// The interleaved checks, in the order Megatron applies them. `group_size_given` only picks
// which field to blame: with the default N = p, a too-small or ragged M is the user's M.
Status ValidateInterleaved(int64_t pp_size, int64_t num_microbatches, int64_t group_size,
                           bool group_size_given) {
  const std::string allowed_range =
      "[p, M] = [" + Str(pp_size) + ", " + Str(num_microbatches) + "]";
  if (group_size < pp_size || group_size > num_microbatches) {
    if (!group_size_given) {
      return Status::Error("num_microbatches",
                           "must be at least pipeline_model_parallel_size (" + Str(pp_size) +
                               ", the default microbatch_group_size_per_vp_stage) with the "
                               "interleaved schedule, got " +
                               Str(num_microbatches));
    }
    return Status::Error("microbatch_group_size_per_vp_stage",
                         "must be in " + allowed_range + ", got " + Str(group_size));
  }
  // A final group shorter than p cannot fill the pipeline before its chunks wait on each other.
  const int64_t final_group = num_microbatches % group_size;
  if (final_group > 0 && final_group < pp_size) {
    return Status::Error(
        "num_microbatches",
        "the final group M % N = " + Str(num_microbatches) + " % " + Str(group_size) + " = " +
            Str(final_group) + " must be 0 or at least pipeline_model_parallel_size (" +
            Str(pp_size) + ") (N = microbatch_group_size_per_vp_stage" +
            (group_size_given ? std::string() : std::string(", defaulted to p")) + ")");
  }
  return Status();
}

}  // namespace

std::string FormatStep(const ScheduleStep& step) {
  return fmt::format("{}{}.{}", step.pass == Pass::kForward ? 'F' : 'B', step.model_chunk,
                     step.microbatch);
}

int64_t PipelineSchedule::NumWarmup(int64_t pp_rank) const {
  if (pp_rank < 0 || pp_rank >= pipeline_model_parallel_size) {
    throw std::out_of_range("pp_rank " + Str(pp_rank) + " outside [0, " +
                            Str(pipeline_model_parallel_size) + ")");
  }
  const int64_t stages_after = pipeline_model_parallel_size - pp_rank - 1;
  // The combined 1F1B schedule runs one more forward first, so that the forward and the
  // backward of each steady pair belong to different micro-batches (schedules.py
  // get_pp_rank_microbatches; combined_1f1b.py without pipelining: F0, then B0 with F1, ...).
  const int64_t extra = combined_1f1b ? 1 : 0;
  if (!interleaved) {
    return std::min(stages_after + extra, num_microbatches);
  }
  // The first loss needs the first group pushed through all v chunks ((v-1)*N forwards here
  // before its last chunk starts), and its gradient then takes 2*(p-r-1) steps to travel
  // down to rank p-1 and back, during which this rank keeps running forwards.
  const int64_t warmup = stages_after * 2 +
                         (num_model_chunks - 1) * microbatch_group_size_per_vp_stage + extra;
  return std::min(warmup, num_microbatches * num_model_chunks);
}

bool PipelineSchedule::CombinedPairAt(int64_t pp_rank, size_t i) const {
  if (!combined_1f1b) return false;
  const auto warmup = static_cast<size_t>(NumWarmup(pp_rank));
  const auto total = static_cast<size_t>(num_microbatches * num_model_chunks);
  return i >= warmup && (i - warmup) % 2 == 0 && i + 1 < warmup + 2 * (total - warmup);
}

StatusOr<PipelineSchedule> BuildPipelineSchedule(
    int64_t pipeline_model_parallel_size,
    std::optional<int64_t> virtual_pipeline_model_parallel_size, int64_t num_microbatches,
    std::optional<int64_t> microbatch_group_size_per_vp_stage, bool combined_1f1b) {
  const int64_t pp_size = pipeline_model_parallel_size;
  MPUSIM_RETURN_IF_ERROR(RequirePositive("pipeline_model_parallel_size", pp_size));
  if (combined_1f1b && pp_size > 1 && !virtual_pipeline_model_parallel_size.has_value()) {
    return Status::Error("virtual_pipeline_model_parallel_size",
                         "is needed by the combined 1F1B schedule "
                         "(overlap_moe_expert_parallel_comm) with pipeline_model_parallel_size " +
                             Str(pp_size));
  }
  if (virtual_pipeline_model_parallel_size.has_value()) {
    MPUSIM_RETURN_IF_ERROR(RequirePositive("virtual_pipeline_model_parallel_size",
                                           *virtual_pipeline_model_parallel_size));
  }
  MPUSIM_RETURN_IF_ERROR(RequirePositive("num_microbatches", num_microbatches));
  {
    // Every step of every rank is listed: p * 2 * M * v of them, computed in 128 bits.
    const __int128 steps = static_cast<__int128>(pp_size) * 2 * num_microbatches *
                           virtual_pipeline_model_parallel_size.value_or(1);
    if (steps > kMaxScheduleSteps) {
      return Status::Error(
          "num_microbatches",
          fmt::format("the schedule would list pipeline_model_parallel_size * 2 * "
                      "num_microbatches * num_model_chunks = {} * 2 * {} * {} steps, more than "
                      "the {} this planner lists; use fewer microbatches",
                      pp_size, num_microbatches, virtual_pipeline_model_parallel_size.value_or(1),
                      kMaxScheduleSteps));
    }
  }

  PipelineSchedule schedule;
  schedule.interleaved = virtual_pipeline_model_parallel_size.has_value();
  schedule.pipeline_model_parallel_size = pp_size;
  schedule.num_model_chunks = virtual_pipeline_model_parallel_size.value_or(1);
  schedule.num_microbatches = num_microbatches;
  schedule.microbatch_group_size_per_vp_stage =
      microbatch_group_size_per_vp_stage.value_or(pp_size);
  schedule.combined_1f1b = combined_1f1b;

  if (!schedule.interleaved) {
    // Megatron would accept and ignore it; we refuse so a typo'd config cannot look tuned.
    if (microbatch_group_size_per_vp_stage.has_value()) {
      return Status::Error("microbatch_group_size_per_vp_stage",
                           "only applies to the interleaved schedule; set "
                           "virtual_pipeline_model_parallel_size or leave it unset");
    }
    for (int64_t mb = 0; mb < num_microbatches; ++mb) {
      schedule.forward_table.emplace_back(mb, 0);
    }
  } else {
    if (pp_size == 1) {
      return Status::Error("virtual_pipeline_model_parallel_size",
                           "pipeline-model-parallel size should be greater than 1 with "
                           "interleaved schedule (pipeline_model_parallel_size is 1); leave it "
                           "unset");
    }
    const int64_t group_size = schedule.microbatch_group_size_per_vp_stage;
    MPUSIM_RETURN_IF_ERROR(ValidateInterleaved(pp_size, num_microbatches, group_size,
                                               microbatch_group_size_per_vp_stage.has_value()));
    const int64_t num_chunks = schedule.num_model_chunks;
    schedule.forward_table.reserve(static_cast<size_t>(num_microbatches * num_chunks));
    for (int64_t group_start = 0; group_start < num_microbatches; group_start += group_size) {
      // The final group holds the M % N left over (or a full N); validation kept it >= p.
      const int64_t group_end = std::min(group_start + group_size, num_microbatches);
      for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
        for (int64_t mb = group_start; mb < group_end; ++mb) {
          schedule.forward_table.emplace_back(mb, chunk);
        }
      }
    }
  }

  schedule.per_rank.reserve(static_cast<size_t>(pp_size));
  for (int64_t pp_rank = 0; pp_rank < pp_size; ++pp_rank) {
    schedule.per_rank.push_back(OneForwardOneBackward(
        schedule.forward_table, schedule.num_model_chunks, schedule.NumWarmup(pp_rank)));
  }
  return schedule;
}

std::string FormatRank(const PipelineSchedule& schedule, int64_t pp_rank) {
  if (pp_rank < 0 || pp_rank >= schedule.pipeline_model_parallel_size) {
    throw std::out_of_range("pp_rank " + Str(pp_rank) + " outside [0, " +
                            Str(schedule.pipeline_model_parallel_size) + ")");
  }
  std::string out;
  for (const ScheduleStep& step : schedule.per_rank[static_cast<size_t>(pp_rank)]) {
    if (!out.empty()) {
      out += ' ';
    }
    out += FormatStep(step);
  }
  return out;
}

double ScheduleTiming::BubbleFraction() const {
  double busy = 0;
  for (size_t r = 0; r < start.size(); ++r) {
    for (size_t i = 0; i < start[r].size(); ++i) busy += end[r][i] - start[r][i];
  }
  const double total = makespan * static_cast<double>(start.size());
  return total > 0 ? 1.0 - busy / total : 0.0;
}

int64_t ScheduleTiming::PeakInFlight(const PipelineSchedule& schedule, int64_t pp_rank) {
  int64_t live = 0, peak = 0;
  for (const ScheduleStep& step : schedule.per_rank.at(static_cast<size_t>(pp_rank))) {
    live += step.pass == Pass::kForward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

ScheduleTiming TimeSchedule(const PipelineSchedule& schedule, double forward, double backward) {
  if (!(forward > 0) || !(backward > 0)) {
    throw std::invalid_argument("TimeSchedule: step costs must be positive");
  }
  const auto stages = static_cast<size_t>(schedule.pipeline_model_parallel_size *
                                          schedule.num_model_chunks);
  return TimeSchedule(schedule, StageCosts{std::vector<double>(stages, forward),
                                           std::vector<double>(stages, backward), 0.0});
}

ScheduleTiming TimeSchedule(const PipelineSchedule& schedule, const StageCosts& costs) {
  const int64_t p = schedule.pipeline_model_parallel_size;
  const int64_t stages = p * schedule.num_model_chunks;
  // A virtual stage may cost nothing: a layout's empty stage (pipeline_model_parallel_layout
  // "|" with no layer) only passes its input on.
  const auto non_negative = [](const std::vector<double>& v) {
    return std::all_of(v.begin(), v.end(), [](double x) { return x >= 0; });
  };
  if (!costs.combined_saving.empty() &&
      (!schedule.combined_1f1b ||
       costs.combined_saving.size() != static_cast<size_t>(stages * stages) ||
       !std::all_of(costs.combined_saving.begin(), costs.combined_saving.end(),
                    [](double x) { return x >= 0; }))) {
    throw std::invalid_argument(
        "TimeSchedule: combined_saving needs a combined 1F1B schedule and one value >= 0 per "
        "pair of virtual stages");
  }
  if (costs.forward.size() != static_cast<size_t>(stages) ||
      costs.backward.size() != static_cast<size_t>(stages) || !non_negative(costs.forward) ||
      !non_negative(costs.backward) || !(costs.transfer >= 0) ||
      !(costs.first_forward_wait.empty() ||
        (costs.first_forward_wait.size() == static_cast<size_t>(stages) &&
         std::all_of(costs.first_forward_wait.begin(), costs.first_forward_wait.end(),
                     [](double x) { return x >= 0; })))) {
    throw std::invalid_argument(
        "TimeSchedule: one forward and backward cost >= 0 per virtual stage, transfer >= 0, "
        "first_forward_wait empty or one value >= 0 per virtual stage");
  }
  // A dependency on another rank's step waits for its transfer as well.
  const double transfer = p > 1 ? costs.transfer : 0.0;
  ScheduleTiming t;
  t.start.resize(static_cast<size_t>(p));
  t.end.resize(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) {
    const size_t n = schedule.per_rank[static_cast<size_t>(r)].size();
    t.start[static_cast<size_t>(r)].reserve(n);
    t.end[static_cast<size_t>(r)].reserve(n);
  }
  // done[(pass * stages + virtual stage) * M + microbatch]: when that step ended (< 0: not
  // yet).
  const auto M = static_cast<size_t>(schedule.num_microbatches);
  const auto S = static_cast<size_t>(stages);
  std::vector<double> done(2 * S * M, -1);
  const auto at = [&](size_t pass, int64_t u, size_t m) -> double& {
    return done[(pass * S + static_cast<size_t>(u)) * M + m];
  };
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<double> clock(static_cast<size_t>(p), 0.0);
  size_t remaining = 0;
  for (const auto& steps : schedule.per_rank) remaining += steps.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int64_t r = 0; r < p; ++r) {
      const auto& steps = schedule.per_rank[static_cast<size_t>(r)];
      auto& i = next[static_cast<size_t>(r)];
      while (i < steps.size()) {
        // A step, or a steady pair of the combined schedule: a forward with the backward after
        // it.
        const bool pair = !costs.combined_saving.empty() && schedule.CombinedPairAt(r, i);
        double ready = clock[static_cast<size_t>(r)];
        double span = 0, sends = 0;
        bool waiting = false;
        for (size_t j = i; j < i + (pair ? 2 : 1); ++j) {
          const ScheduleStep& step = steps[j];
          const bool forward = step.pass == Pass::kForward;
          const int64_t u = step.model_chunk * p + r;
          const auto m = static_cast<size_t>(step.microbatch);
          if (forward && u > 0) {
            const double need = at(0, u - 1, m);
            if (need < 0) waiting = true;
            ready = std::max(ready, need + transfer);
          } else if (!forward && u + 1 < stages) {
            const double need = at(1, u + 1, m);
            if (need < 0) waiting = true;
            ready = std::max(ready, need + transfer);
          }
          if (forward && m == 0 && !costs.first_forward_wait.empty()) {
            ready += costs.first_forward_wait[static_cast<size_t>(u)];
          }
          span += (forward ? costs.forward : costs.backward)[static_cast<size_t>(u)];
          // A blocking send of the output (the activation onward, the gradient back) keeps
          // this rank until it has gone.
          if (forward ? u + 1 < stages : u > 0) sends += 1;
        }
        if (waiting) break;
        if (pair) {
          const int64_t f = steps[i].model_chunk * p + r, b = steps[i + 1].model_chunk * p + r;
          span -= costs.combined_saving[static_cast<size_t>(f * stages + b)];
        }
        const double finish = ready + span;
        const double free =
            finish + (costs.blocking_sends && transfer > 0 ? sends * transfer : 0.0);
        for (size_t j = i; j < i + (pair ? 2 : 1); ++j) {
          const ScheduleStep& step = steps[j];
          t.start[static_cast<size_t>(r)].push_back(ready);
          t.end[static_cast<size_t>(r)].push_back(finish);
          at(step.pass == Pass::kForward ? 0 : 1, step.model_chunk * p + r,
             static_cast<size_t>(step.microbatch)) = finish;
          --remaining;
        }
        clock[static_cast<size_t>(r)] = free;
        t.makespan = std::max(t.makespan, free);
        i += pair ? 2 : 1;
        progressed = true;
      }
    }
    if (!progressed)
      throw std::logic_error("TimeSchedule: the schedule's steps wait on each other");
  }
  return t;
}

}  // namespace mpusim
