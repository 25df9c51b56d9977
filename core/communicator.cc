// Names for the comm trace (see communicator.h).
#include "core/communicator.h"

#include <chrono>
#include <optional>
#include <utility>

namespace mpusim {

const char* FunctionalCollectiveName(CommOpKind op) {
  switch (op) {
    case CommOpKind::kAllReduce:
    case CommOpKind::kAllReduceMax:
      return "all_reduce";
    case CommOpKind::kAllGather:
      return "all_gather_into_tensor";
    case CommOpKind::kReduceScatter:
      return "reduce_scatter_tensor";
    case CommOpKind::kAllToAll:
      return "all_to_all_single";
    case CommOpKind::kBroadcast:
      return "broadcast";
    case CommOpKind::kSend:
      return "send";
    case CommOpKind::kRecv:
      return "recv";
  }
  return "?";
}

const char* CommOpName(CommOpKind op) {
  switch (op) {
    case CommOpKind::kAllReduce: return "all-reduce";
    case CommOpKind::kAllReduceMax: return "all-reduce(max)";
    case CommOpKind::kAllGather: return "all-gather";
    case CommOpKind::kReduceScatter: return "reduce-scatter";
    case CommOpKind::kAllToAll: return "all-to-all";
    case CommOpKind::kBroadcast: return "broadcast";
    case CommOpKind::kSend:
      return "send";
    case CommOpKind::kRecv:
      return "recv";
  }
  return "?";
}

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kOther: return "other";
  }
  return "?";
}

double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

namespace {

// Ends the records of a batch's messages when the wait for them returns.
class TracedPending final : public PendingP2P {
 public:
  TracedPending(std::unique_ptr<PendingP2P> inner, CommTrace* trace, std::vector<size_t> handles)
      : inner_(std::move(inner)), trace_(trace), handles_(std::move(handles)) {}
  void Wait() override {
    if (trace_ != nullptr) {
      for (size_t handle : handles_) trace_->BeginWait(handle);
    }
    inner_->Wait();
    if (trace_ == nullptr) return;
    for (size_t handle : handles_) trace_->End(handle);
    handles_.clear();
  }

 private:
  std::unique_ptr<PendingP2P> inner_;
  CommTrace* trace_;
  std::vector<size_t> handles_;
};

}  // namespace

std::unique_ptr<PendingP2P> TracedCommunicator::PostSendRecv(const std::vector<P2POp>& ops) {
  std::vector<size_t> handles;
  for (const P2POp& op : ops) {
    const std::optional<size_t> handle =
        Note(op.kind == P2POp::Kind::kSend ? CommOpKind::kSend : CommOpKind::kRecv,
             op.buffer.bytes(), op.peer);
    if (handle) handles.push_back(*handle);
  }
  return std::make_unique<TracedPending>(inner_->PostSendRecv(ops), trace_, std::move(handles));
}

}  // namespace mpusim
