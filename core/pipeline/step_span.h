// Where a step's time went, for the timeline (`mpusim run --summary`, `--trace`): the
// wall-clock span of every forward and backward step a model ran, in seconds of
// std::chrono::steady_clock (CLOCK_MONOTONIC, one clock for every process of a machine, so the
// ranks' spans line up). Host time: a device backend's kernels may still run after a span
// ends. The GPT model and the layer chain both record them.
#pragma once

#include <cstdint>
#include <vector>

#include "core/communicator.h"

namespace mpusim {

// A recomputation (activation checkpointing's forward again, inside a backward step) is a
// span of its own, nested in its backward step's: recompute true, forward true.
struct StepSpan {
  int64_t chunk = 0, microbatch = 0;
  bool forward = true;
  double begin = 0, end = 0;
  bool recompute = false;
};

// Appends the span of one step when it ends (returns or throws).
class SpanRecorder {
 public:
  SpanRecorder(std::vector<StepSpan>& spans, int64_t chunk, int64_t microbatch, bool forward,
               bool recompute = false)
      : spans_(spans), span_{chunk, microbatch, forward, MonotonicSeconds(), 0, recompute} {}
  ~SpanRecorder() {
    span_.end = MonotonicSeconds();
    spans_.push_back(span_);
  }
  SpanRecorder(const SpanRecorder&) = delete;
  SpanRecorder& operator=(const SpanRecorder&) = delete;

 private:
  std::vector<StepSpan>& spans_;
  StepSpan span_;
};

}  // namespace mpusim
