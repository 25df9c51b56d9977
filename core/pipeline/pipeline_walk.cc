// Walking a pipeline plan (see pipeline_walk.h).
#include "core/pipeline/pipeline_walk.h"

#include <map>
#include <memory>
#include <stdexcept>
#include <tuple>

#include <fmt/format.h>

namespace mpusim {

void WalkPipelinePlan(const RankPipelinePlans& plans, Communicator& pp, Kernels& k,
                      CommTrace& trace, const PipelineStepFunctions& functions) {
  std::map<std::tuple<int, int64_t, int64_t>, Tensor> inbox;  // (kind, chunk, mb)
  std::vector<std::unique_ptr<PendingP2P>> in_flight;
  Tensor produced;  // the previous step's output or input gradient
  // Point-to-point that completes each batch runs the lockstep plan, one batch per action.
  const bool paired = !pp.LeavesSendsInFlight();
  const std::vector<PlanAction>& plan = paired ? plans.lockstep : plans.in_flight;
  for (const PlanAction& action : plan) {
    std::vector<P2POp> sends, receives;
    for (const Transfer& t : action.batch) {
      const int kind = t.kind == Transfer::Kind::kActivation ? 0 : 1;
      const auto [shape, dtype] = functions.shape(t);
      if (t.send) {
        if (!produced.defined() || produced.shape() != shape || produced.dtype() != dtype) {
          throw std::logic_error(fmt::format("pipeline: {} has no {} {} tensor to send",
                                             FormatTransfer(t), ShapeString(shape),
                                             DTypeName(dtype)));
        }
        sends.push_back({P2POp::Kind::kSend, produced, static_cast<int>(t.peer), TransferTag(t)});
      } else {
        Tensor buffer = k.Empty(shape, dtype);
        inbox[{kind, t.model_chunk, t.microbatch}] = buffer;
        receives.push_back({P2POp::Kind::kRecv, buffer, static_cast<int>(t.peer), TransferTag(t)});
      }
    }
    trace.SetPhase(Phase::kOther);
    trace.SetSite("pipeline");
    if (paired) {
      sends.insert(sends.end(), receives.begin(), receives.end());
      if (!sends.empty()) pp.BatchSendRecv(sends);
    } else {
      if (!sends.empty()) in_flight.push_back(pp.PostSendRecv(sends));
      if (!receives.empty()) pp.BatchSendRecv(receives);
    }
    produced = Tensor();
    if (!action.step) continue;
    const ScheduleStep& step = *action.step;
    Tensor input;
    const auto key = std::make_tuple(step.pass == Pass::kForward ? 0 : 1, step.model_chunk,
                                     step.microbatch);
    if (const auto it = inbox.find(key); it != inbox.end()) {
      input = it->second;
      inbox.erase(it);
    }
    produced = functions.step(step, input);
  }
  for (auto& pending : in_flight) pending->Wait();
  if (!inbox.empty()) {
    throw std::logic_error(
        fmt::format("pipeline: {} received tensors were never used", inbox.size()));
  }
}

}  // namespace mpusim
