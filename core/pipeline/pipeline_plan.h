// The transfers of a pipeline step: where each pipeline rank sends and receives activations
// and gradients between the compute steps of its schedule row (core/schedule.h).
//
// Dataflow. Virtual stage u = chunk * p + pp_rank holds the chunk's layers (AssignLayers);
// the forward of (chunk, microbatch) on virtual stage u > 0 needs the activation of virtual
// stage u - 1 (on pp rank (r - 1) mod p), and its backward on u < p*v - 1 needs the gradient
// from virtual stage u + 1 (on pp rank (r + 1) mod p). A forward's output is sent on, a
// backward's input gradient sent back.
//
// When transfers are waited for. Megatron pairs each send with the next receive in one
// blocking batch (send_forward_recv_backward, send_backward_recv_forward, and interleaved
// send_forward_recv_forward ...). Under rendezvous semantics (a large message completes
// only once both sides have posted it) that pairing deadlocks in the interleaved warmup:
// with p = 2, v = 2, M = 4 rank 1 blocks sending chunk 0's first output to rank 0's chunk
// 1, which rank 0 receives only after two more forwards, while rank 0 blocks sending those
// forwards' inputs (CheckPipelinePlan finds it; tests/pipeline). This plan therefore posts
// the sends of step i - 1 before step i without waiting for them, and waits only for the
// receive step i needs; all sends are waited for after the last step. A rank then only
// ever waits for a message whose sender has already computed it or is about to, so the
// step completes whenever the schedule's order respects the dataflow.
//
// Matching. Untagged (NCCL), the n-th message a rank sends to a peer is the n-th that peer
// receives from it, so both must list them in one order. Between two ranks of p = 2 both
// activations and gradients travel each way, and the interleaved schedule receives them in
// another order than the peer sends them; so messages carry a tag, their (kind, chunk)
// (TransferTag), and match by it (MPI tags); within one tag both sides list the
// micro-batches in one order. 1F1B needs no tags.
// CheckPipelinePlan simulates a plan with rendezvous semantics under either matching and
// proves, for a given schedule, that every step completes and that every message is
// received as what it was sent as.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/schedule.h"

namespace mpusim {

struct Transfer {
  enum class Kind : uint8_t { kActivation, kGradient };
  bool send = true;  // false: receive
  Kind kind = Kind::kActivation;
  int64_t model_chunk = 0;  // the chunk of the step that consumes it on the receiving side
  int64_t microbatch = 0;
  int64_t peer = 0;  // pp rank
  bool wait = true;  // waited for before the action's step (a send not waited for completes
                     // at the latest in the plan's final action)
};

// One action of a rank: post `batch`, wait for its transfers marked `wait`, then run `step`.
// The last action has no step: it waits for every send still in flight.
struct PlanAction {
  std::vector<Transfer> batch;
  std::optional<ScheduleStep> step;
};

// plan[pp_rank]: that rank's actions, one per schedule step plus the final batch.
using PipelinePlan = std::vector<std::vector<PlanAction>>;

PipelinePlan PlanPipelineTransfers(const PipelineSchedule& schedule);
// Megatron's pairing for comparison: the same batches, every transfer waited for.
PipelinePlan PlanBlockingPairs(const PipelineSchedule& schedule);

// The plan for point-to-point that completes each batch before the next (NCCL: a group's
// kernel ends before the stream goes on, so nothing stays in flight and every transfer is
// waited for). It replays the schedule in rounds: in round t every rank runs its next step
// if its input has arrived (else it idles), and each message a step produces travels in the
// next batch of both its sender and its receiver; the receiver keeps it until its step comes.
// So every batch's partner transfers sit in the same round's batch of the peer, and each
// rank's batches are in round order. Why that cannot deadlock: take the earliest round t
// with a batch not yet complete; every rank has completed its batches before t, so each rank
// with a round-t batch has posted it (its steps in between had their inputs), and so has
// each of its peers: they all complete. A sender sends at most one message per round, so no
// pair of ranks carries two messages in one direction in one batch and untagged in-order
// matching suffices. Rounds in which a rank neither steps nor transfers are left out; every
// rank still runs its own steps in its schedule order. Throws std::logic_error when the
// schedule's order does not respect the dataflow.
PipelinePlan PlanLockstepRounds(const PipelineSchedule& schedule);

// One pp rank's two plans of a step; the executor runs the one its pp communicator can
// (Communicator::LeavesSendsInFlight: MPI leaves sends in flight, NCCL completes batches).
struct RankPipelinePlans {
  std::vector<PlanAction> in_flight;  // PlanPipelineTransfers' row (tagged messages)
  std::vector<PlanAction> lockstep;   // PlanLockstepRounds' row (untagged, all waited)
};
std::vector<RankPipelinePlans> PlanPipelineRanks(const PipelineSchedule& schedule);

// "" when the plan completes and every message matches (see above); otherwise what goes
// wrong, e.g. "deadlock: rank 0 waits at action 3 (F1.0), rank 1 waits at action 2 (B0.0)".
enum class Matching : uint8_t { kInOrder, kTagged };
std::string CheckPipelinePlan(const PipelinePlan& plan, Matching matching);

// The message tag of a transfer: 2 * chunk + (1 for a gradient).
int TransferTag(const Transfer& transfer);

// "send activation c1.m0 to 1", "recv gradient c0.m2 from 0"; a send not waited for ends
// with " (async)".
std::string FormatTransfer(const Transfer& transfer);

}  // namespace mpusim
