// Names for the comm trace (see communicator.h).
#include "core/communicator.h"

namespace mpusim {

const char* CommOpName(CommOpKind op) {
  switch (op) {
    case CommOpKind::kAllReduce: return "all-reduce";
    case CommOpKind::kAllReduceMax: return "all-reduce(max)";
    case CommOpKind::kAllGather: return "all-gather";
    case CommOpKind::kReduceScatter: return "reduce-scatter";
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

}  // namespace mpusim
