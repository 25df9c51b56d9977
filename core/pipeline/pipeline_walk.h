// Walking one pipeline rank's plan (pipeline_plan.h): before each compute step, post the
// previous step's output to its peers without waiting and receive what this step needs; run
// the step; at the end wait for every send. The model is a pair of callbacks, so the GPT
// model and the layer chain share one walker.
//
// A backend that completes each batch before returning (NCCL: Communicator::
// LeavesSendsInFlight is false) runs the lockstep plan instead (PlanLockstepRounds), each
// batch's sends and receives in one group, every one waited for: deadlock-free for 1F1B and
// the interleaved schedule alike, with untagged messages.
#pragma once

#include <functional>
#include <vector>

#include "core/communicator.h"
#include "core/kernels.h"
#include "core/pipeline/pipeline_plan.h"

namespace mpusim {

struct PipelineStepFunctions {
  // The tensor a transfer carries: its local shape and dtype (the receive buffer, and what
  // a send must hold).
  std::function<std::pair<Shape, DType>(const Transfer&)> shape;
  // Runs one step with its received input (undefined where nothing was received: the first
  // virtual stage's forward, the last's backward); returns what the step sends on (a
  // forward's output, a backward's input gradient; undefined when nothing follows).
  std::function<Tensor(const ScheduleStep&, const Tensor&)> step;
};

// Runs this rank's plan over `pp`: `plans.in_flight` when pp leaves sends in flight, else
// `plans.lockstep`. Throws std::logic_error when a send has no matching tensor or a
// received tensor is never used (executor bugs).
void WalkPipelinePlan(const RankPipelinePlans& plans, Communicator& pp, Kernels& k,
                      CommTrace& trace, const PipelineStepFunctions& functions);

}  // namespace mpusim
