// Communicator: one process group's collectives, as the layer graph needs them; CommTrace
// records every collective (op, group kind, bytes, forward/backward).
//
// What it is: the narrow interface core/model/graph calls. sim/ implements it on MPI
// communicators, cuda/ on NCCL. Buffers are Tensors on the backend's device; element type
// and count come from the tensor. bfloat16/float16 sums and maxima are formed in float32 and
// rounded to the buffer's dtype after each combining step, as NCCL does; int64 buffers (token
// ids, broadcast by broadcast_data) are moved bit for bit and summed exactly.
// Point-to-point (pipeline stages) is one call, BatchSendRecv, as Megatron's
// batch_isend_irecv: every message of a batch is posted together and waited for together,
// so two neighbours that send to each other never wait on each other's first message.
// What it is not: process-group creation (backends build one Communicator per group kind
// from the planner's groups).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mpusim {

enum class ReduceOp : uint8_t { kSum, kMax };

// One message of a BatchSendRecv (Megatron's torch.distributed.P2POp).
struct P2POp {
  enum class Kind : uint8_t { kSend, kRecv };
  Kind kind = Kind::kSend;
  Tensor buffer;  // a handle: a receive writes into the storage the caller holds too
  int peer = 0;   // a group rank other than this rank
  int tag = 0;    // in [0, 32767]; a send matches a receive of the same peer pair and tag
};

// Messages posted by Communicator::PostSendRecv. Wait returns once all have completed; the
// destructor waits too (the buffers are kept alive until then).
class PendingP2P {
 public:
  virtual ~PendingP2P() = default;
  virtual void Wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int Rank() const = 0;  // rank inside this group
  virtual int Size() const = 0;
  // In place over the whole buffer.
  virtual void AllReduce(Tensor& buffer, ReduceOp op) = 0;
  // out = concatenation of every rank's `in` in group-rank order (flat, like NCCL);
  // out.numel() == Size() * in.numel().
  virtual void AllGather(const Tensor& in, Tensor& out) = 0;
  // `in` holds Size() equal flat chunks; out = the sum over ranks of chunk Rank().
  virtual void ReduceScatter(const Tensor& in, Tensor& out) = 0;
  // `in` and `out` hold Size() equal flat chunks: chunk j of `in` goes to rank j, and chunk j
  // of `out` is what rank j sent this rank (MPI_Alltoall; Megatron's all_to_all with equal
  // splits).
  virtual void AllToAll(const Tensor& in, Tensor& out) = 0;
  // The uneven all-to-all (MPI_Alltoallv; torch's all_to_all_single with split sizes): `in`
  // holds Size() consecutive flat parts, part j (send_counts[j] elements) going to rank j;
  // `out` holds Size() parts, part j (recv_counts[j] elements) what rank j sent this rank.
  // recv_counts[j] must equal rank j's send_counts[Rank()]: the ranks agree on the counts
  // beforehand (the MoE dispatcher all-gathers them), since no backend can check it cheaply.
  virtual void AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                         const std::vector<int64_t>& recv_counts) = 0;
  // In place; `root` is a rank inside this group.
  virtual void Broadcast(Tensor& buffer, int root) = 0;
  // Posts every message of `ops`; the returned handle completes them (sends: the buffer may
  // be reused; receives: the buffer holds the message). Messages between two ranks with the
  // same tag match in the order each side posts them, across batches too. A receive's
  // buffer must have the sender's dtype and element count (otherwise the job is aborted:
  // the ranks disagree). A backend may complete the messages before returning (NCCL).
  virtual std::unique_ptr<PendingP2P> PostSendRecv(const std::vector<P2POp>& ops) = 0;
  // Posts every message and waits for all of them (Megatron's batch_isend_irecv + wait).
  void BatchSendRecv(const std::vector<P2POp>& ops) { PostSendRecv(ops)->Wait(); }
  // Whether PostSendRecv returns with its sends still in flight (MPI) or completes them
  // first (NCCL). A pipeline that cannot leave sends in flight pairs each step's sends with
  // its receive in one batch, as Megatron does (core/pipeline/pipeline_plan.h).
  virtual bool LeavesSendsInFlight() const { return true; }
};

enum class CommOpKind : uint8_t {
  kAllReduce,
  kAllReduceMax,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kBroadcast,
  kSend,
  kRecv
};
enum class Phase : uint8_t { kForward, kBackward, kOther };
const char* CommOpName(CommOpKind op);
// The name PyTorch's CommDebugMode counts a collective under (its functional collectives:
// "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
// "broadcast", "send", "recv").
const char* FunctionalCollectiveName(CommOpKind op);
const char* PhaseName(Phase phase);

struct CommRecord {
  CommOpKind op;
  std::string group;  // group kind, e.g. "tp"
  std::string site;   // which op issued it, e.g. "fc1"
  int64_t bytes;      // bytes this rank contributes (the input buffer; a receive's message)
  Phase phase;
  int peer = -1;  // send and receive: the group rank of the other side
  // When the call began and returned (a send or receive: when it was posted and when the wait
  // for it returned), in seconds of std::chrono::steady_clock; end 0 while in flight. A send
  // or receive also has when its wait began: the rank was blocked from `wait` to `end`.
  double begin = 0, end = 0;
  double wait = 0;
};

// Seconds of std::chrono::steady_clock (the machine's monotonic clock, shared by its
// processes), the clock of CommRecord's and the model's spans.
double MonotonicSeconds();

class CommTrace {
 public:
  void SetPhase(Phase phase) { phase_ = phase; }
  Phase phase() const { return phase_; }
  void SetSite(std::string site) { site_ = std::move(site); }
  const std::string& site() const { return site_; }
  // Appends a record that begins now; returns its handle for End.
  size_t Record(CommOpKind op, const std::string& group, int64_t bytes, int peer = -1) {
    records_.push_back(CommRecord{op, group, site_, bytes, phase_, peer, MonotonicSeconds(), 0.0});
    return (generation_ << 32) | (records_.size() - 1);
  }
  // Marks the record `handle` as ended now (nothing when the trace was cleared since).
  void End(size_t handle) {
    if (CommRecord* r = Find(handle)) r->end = MonotonicSeconds();
  }
  // Marks that the wait for the send or receive `handle` begins now.
  void BeginWait(size_t handle) {
    if (CommRecord* r = Find(handle)) r->wait = MonotonicSeconds();
  }
  const std::vector<CommRecord>& records() const { return records_; }
  void Clear() {
    records_.clear();
    ++generation_;
  }

 private:
  CommRecord* Find(size_t handle) {
    const size_t index = handle & 0xffffffffu;
    if ((handle >> 32) != generation_ || index >= records_.size()) return nullptr;
    return &records_[index];
  }

  Phase phase_ = Phase::kOther;
  std::string site_;
  std::vector<CommRecord> records_;
  size_t generation_ = 0;
};

// Decorator that records every call into a CommTrace, then forwards it. Groups of size 1
// are not recorded (no data moves; Megatron's mappings skip them too).
class TracedCommunicator : public Communicator {
 public:
  TracedCommunicator(std::unique_ptr<Communicator> inner, std::string group, CommTrace* trace)
      : inner_(std::move(inner)), group_(std::move(group)), trace_(trace) {}
  int Rank() const override { return inner_->Rank(); }
  int Size() const override { return inner_->Size(); }
  void AllReduce(Tensor& buffer, ReduceOp op) override {
    const auto handle = Note(
        op == ReduceOp::kSum ? CommOpKind::kAllReduce : CommOpKind::kAllReduceMax, buffer.bytes());
    inner_->AllReduce(buffer, op);
    End(handle);
  }
  void AllGather(const Tensor& in, Tensor& out) override {
    const auto handle = Note(CommOpKind::kAllGather, in.bytes());
    inner_->AllGather(in, out);
    End(handle);
  }
  void ReduceScatter(const Tensor& in, Tensor& out) override {
    const auto handle = Note(CommOpKind::kReduceScatter, in.bytes());
    inner_->ReduceScatter(in, out);
    End(handle);
  }
  void AllToAll(const Tensor& in, Tensor& out) override {
    const auto handle = Note(CommOpKind::kAllToAll, in.bytes());
    inner_->AllToAll(in, out);
    End(handle);
  }
  void AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                 const std::vector<int64_t>& recv_counts) override {
    const auto handle = Note(CommOpKind::kAllToAll, in.bytes());
    inner_->AllToAllV(in, send_counts, out, recv_counts);
    End(handle);
  }
  void Broadcast(Tensor& buffer, int root) override {
    const auto handle = Note(CommOpKind::kBroadcast, buffer.bytes());
    inner_->Broadcast(buffer, root);
    End(handle);
  }
  bool LeavesSendsInFlight() const override { return inner_->LeavesSendsInFlight(); }
  std::unique_ptr<PendingP2P> PostSendRecv(const std::vector<P2POp>& ops) override;
  const std::string& group() const { return group_; }

 private:
  std::optional<size_t> Note(CommOpKind op, size_t bytes, int peer = -1) {
    if (trace_ == nullptr || inner_->Size() <= 1) return std::nullopt;
    return trace_->Record(op, group_, static_cast<int64_t>(bytes), peer);
  }
  void End(const std::optional<size_t>& handle) {
    if (handle) trace_->End(*handle);
  }
  std::unique_ptr<Communicator> inner_;
  std::string group_;
  CommTrace* trace_;
};

}  // namespace mpusim
