// The communication watchdog: every MPI communication of mpusim, with a deadline.
//
// What it is: the watched forms (namespace `watched`) of the MPI calls mpusim makes after
// MPI_Init. Each blocking collective is started as its non-blocking form (MPI_Iallreduce for
// MPI_Allreduce, MPI_Ibcast for MPI_Bcast, ...) and point-to-point as MPI_Isend / MPI_Irecv;
// the call then waits by polling MPI_Test. If the operation has not completed after the
// communication timeout (SetCommTimeout: `mpusim run --timeout SECONDS`, default 1800 s,
// torch.distributed's default process-group timeout), this rank prints one line to stderr
//   mpusim: watchdog: rank 2 (host h) waited 3.0 s for MPI_Iallreduce (allreduce call 3 on
//   this rank) on tp group [0, 1, 2, 3]; a rank of the group is stopped, hung or far behind.
//   Timeout 3 s (change it with mpusim run --timeout SECONDS); aborting the job
// (for point-to-point also the peer it waited for) and aborts the job with MPI_Abort. A
// stopped or hung peer therefore ends the job instead of leaving every other rank waiting in
// MPI forever. A peer that dies is noticed by Open MPI itself, which ends the job at once.
// MPI_Comm_split has no non-blocking form (MPI 3): a watched MPI_Ibarrier runs first, so a
// rank that never arrives is caught there. FinalizeWatched guards MPI_Finalize (which
// synchronises with every rank) the same way.
// What it is not: fault tolerance (the job ends; nothing is retried or shrunk), a per-call or
// per-group timeout (one per process; the NCCL communicators of cuda/ take the same value),
// or a timeout for work between calls (a rank that computes forever is caught by its peers).
//
// Polling (mpi/watchdog.cc): MPI_Test back to back for the first 200 us (a collective of the
// layer graph usually completes within that), then with sched_yield between tests up to 2 ms,
// then with sleeps in between of a hundredth of the time waited so far (200 us to 10 ms).
// Ranks that share cores (mpirun --oversubscribe) thus leave the CPU to the ranks they wait
// for during long waits (the reference check, a stopped peer), polling delays a long
// collective by about 1% per round, and a rank waiting for a stopped peer uses almost no CPU.
//
// Fault injection, a test hook (tests/fault/, docs/reliability.md): the environment variable
//   MPUSIM_FAULT="rank=R,op=OP,call=N,action=A"
// makes world rank R, just before its N-th (from 1) watched call of operation OP,
//   stop  raise(SIGSTOP) on itself: a hung peer (the others' watchdogs fire);
//   kill  raise(SIGKILL): a dead peer (Open MPI ends the job);
//   exit  _exit(0) without MPI_Finalize;
//   throw throw std::runtime_error: an unexpected error (mpusim run ends the job, exit 4);
//   oom   throw std::bad_alloc: memory ran out (mpusim run ends the job, exit 3).
// OP: allreduce, allgather (also MPI_Allgatherv), reducescatter, broadcast, alltoall (also
// MPI_Alltoallv), reduce, barrier, split (communicator creation: MPI_Comm_split, MPI_Comm_dup),
// send, recv, or any (N then counts every watched call). The rank prints one line saying
// what it does before it does it. Programs read the variable once with ArmFaultInjection
// right after MPI_Init; without that call nothing is injected.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace mpusim {

// torch.distributed's default process-group timeout (30 minutes).
constexpr double kDefaultCommTimeoutS = 1800;

// How long one watched call may wait before the job is aborted, for every later call of
// this process. Throws std::invalid_argument unless `seconds` is finite and > 0.
void SetCommTimeout(double seconds);
double CommTimeout();

// Names a communicator in the watchdog's line: its group kind ("tp", "dp", "world", ...) and
// the world rank of each member, in group-rank order.
struct CommLabel {
  std::string kind;
  std::vector<int> world_ranks;
};

// `kind` and the world ranks of `comm`'s members (MPI_Group_translate_ranks: local, no
// communication).
CommLabel LabelOf(MPI_Comm comm, std::string kind);
// {"world", 0 .. N-1}, for calls on MPI_COMM_WORLD (made on first use, after MPI_Init).
const CommLabel& WorldLabel();
// "tp group [0, 1, 2, 3]"; past 8 members "world group [0, 1, 2, 3, ..., 62, 63] (64 ranks)".
std::string DescribeGroup(const CommLabel& label);

// The operations fault injection counts (see MPUSIM_FAULT above).
enum class WatchedOp : uint8_t {
  kAllReduce,
  kAllGather,
  kReduceScatter,
  kBroadcast,
  kAllToAll,
  kReduce,
  kBarrier,
  kSplit,
  kSend,
  kRecv,
  kAny,
};
const char* WatchedOpName(WatchedOp op);  // the MPUSIM_FAULT spelling: "allreduce", ...

enum class FaultAction : uint8_t { kStop, kKill, kExit, kThrow, kOutOfMemory };

struct FaultSpec {
  int world_rank = 0;
  WatchedOp op = WatchedOp::kAny;
  int64_t call = 1;  // from 1
  FaultAction action = FaultAction::kStop;
};

// Parses an MPUSIM_FAULT value: exactly the four keys rank, op, call, action, each once, in
// any order. The Status names MPUSIM_FAULT and what is wrong.
StatusOr<FaultSpec> ParseFaultSpec(std::string_view text);

// Reads MPUSIM_FAULT (unset or empty: no fault) and arms it for this process's later watched
// calls; call once, after MPI_Init. A malformed value arms nothing and returns the Status,
// for the program to report as bad input.
Status ArmFaultInjection();

// The watched MPI calls: the arguments of the MPI function of the same name, then the
// communicator's label for the watchdog's line. An MPI error aborts the job like
// MPUSIM_MPI_CHECK (mpi/mpi_check.h).
namespace watched {

void Allreduce(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
               const CommLabel& label);
void Allgather(const void* send, int send_count, MPI_Datatype send_type, void* recv, int recv_count,
               MPI_Datatype recv_type, MPI_Comm comm, const CommLabel& label);
void Allgatherv(const void* send, int send_count, MPI_Datatype send_type, void* recv,
                const int recv_counts[], const int displacements[], MPI_Datatype recv_type,
                MPI_Comm comm, const CommLabel& label);
void Alltoall(const void* send, int send_count, MPI_Datatype send_type, void* recv, int recv_count,
              MPI_Datatype recv_type, MPI_Comm comm, const CommLabel& label);
void Alltoallv(const void* send, const int send_counts[], const int send_displacements[],
               MPI_Datatype send_type, void* recv, const int recv_counts[],
               const int recv_displacements[], MPI_Datatype recv_type, MPI_Comm comm,
               const CommLabel& label);
void Bcast(void* buffer, int count, MPI_Datatype type, int root, MPI_Comm comm,
           const CommLabel& label);
void Reduce(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op, int root,
            MPI_Comm comm, const CommLabel& label);
void ReduceScatterBlock(const void* send, void* recv, int recv_count, MPI_Datatype type, MPI_Op op,
                        MPI_Comm comm, const CommLabel& label);
void Barrier(MPI_Comm comm, const CommLabel& label);
// MPI_Comm_split, after a watched MPI_Ibarrier on `comm`; returns the new communicator.
MPI_Comm CommSplit(MPI_Comm comm, int color, int key, const CommLabel& label);
// MPI_Comm_idup; returns the new communicator.
MPI_Comm CommDup(MPI_Comm comm, const CommLabel& label);
// Blocking semantics: returns once `buffer` may be reused (MPI_Isend completed).
void Send(const void* buffer, int count, MPI_Datatype type, int peer, int tag, MPI_Comm comm,
          const CommLabel& label);
// Returns the number of elements received (at most `count`; a longer message is an MPI error).
int Recv(void* buffer, int count, MPI_Datatype type, int peer, int tag, MPI_Comm comm,
         const CommLabel& label);

// One message of SendRecvBatch.
struct Message {
  bool send = true;  // false: receive into `buffer`
  void* buffer = nullptr;
  int count = 0;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int peer = 0;
  int tag = 0;
};

// Messages posted by PostMessages and not yet waited for. Wait completes them under one
// deadline (the timeout counts from Wait); past the timeout the watchdog's line names the
// first message still incomplete and its peer. Wait returns, per message, the number of
// elements received (0 for a send). Destroying pending messages waits for them (their
// buffers must outlive that).
class PendingMessages {
 public:
  PendingMessages();
  PendingMessages(PendingMessages&&) noexcept;
  PendingMessages& operator=(PendingMessages&&) noexcept;
  ~PendingMessages();
  std::vector<int> Wait();

 private:
  friend PendingMessages PostMessages(const std::vector<Message>&, MPI_Comm, const CommLabel&);
  struct Impl;
  std::unique_ptr<Impl> state_;
};

// Posts every message (MPI_Isend / MPI_Irecv, each counted as a send or recv call for
// MPUSIM_FAULT) on `comm`; `label` must outlive the result.
PendingMessages PostMessages(const std::vector<Message>& messages, MPI_Comm comm,
                             const CommLabel& label);
// PostMessages, then Wait.
std::vector<int> SendRecvBatch(const std::vector<Message>& messages, MPI_Comm comm,
                               const CommLabel& label);

}  // namespace watched

// A watched barrier on MPI_COMM_WORLD, then MPI_Finalize: a rank stopped before the end is
// caught by the barrier instead of hanging every other rank inside MPI_Finalize.
void FinalizeWatched();

}  // namespace mpusim
