// Communicator: one process group's collectives, as the layer graph needs them; CommTrace
// records every collective (op, group kind, bytes, forward/backward).
//
// What it is: the narrow interface core/model/graph calls. sim/ implements it on MPI
// communicators, cuda/ on NCCL. Buffers are Tensors on the backend's device; element type
// and count come from the tensor. bfloat16/float16 sums and maxima are formed in float32 and
// rounded to the buffer's dtype after each combining step, as NCCL does; int64 buffers (token
// ids, broadcast by broadcast_data) are moved bit for bit and summed exactly.
// What it is not: point-to-point messaging or process-group creation (backends build one
// Communicator per group kind from the planner's groups).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mpusim {

enum class ReduceOp : uint8_t { kSum, kMax };

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
  // In place; `root` is a rank inside this group.
  virtual void Broadcast(Tensor& buffer, int root) = 0;
};

enum class CommOpKind : uint8_t { kAllReduce, kAllReduceMax, kAllGather, kReduceScatter, kBroadcast };
enum class Phase : uint8_t { kForward, kBackward, kOther };
const char* CommOpName(CommOpKind op);
const char* PhaseName(Phase phase);

struct CommRecord {
  CommOpKind op;
  std::string group;  // group kind, e.g. "tp"
  std::string site;   // which op issued it, e.g. "fc1"
  int64_t bytes;      // bytes this rank contributes (the input buffer)
  Phase phase;
};

class CommTrace {
 public:
  void SetPhase(Phase phase) { phase_ = phase; }
  Phase phase() const { return phase_; }
  void SetSite(std::string site) { site_ = std::move(site); }
  void Record(CommOpKind op, const std::string& group, int64_t bytes) {
    records_.push_back(CommRecord{op, group, site_, bytes, phase_});
  }
  const std::vector<CommRecord>& records() const { return records_; }
  void Clear() { records_.clear(); }

 private:
  Phase phase_ = Phase::kOther;
  std::string site_;
  std::vector<CommRecord> records_;
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
    Note(op == ReduceOp::kSum ? CommOpKind::kAllReduce : CommOpKind::kAllReduceMax,
         buffer.bytes());
    inner_->AllReduce(buffer, op);
  }
  void AllGather(const Tensor& in, Tensor& out) override {
    Note(CommOpKind::kAllGather, in.bytes());
    inner_->AllGather(in, out);
  }
  void ReduceScatter(const Tensor& in, Tensor& out) override {
    Note(CommOpKind::kReduceScatter, in.bytes());
    inner_->ReduceScatter(in, out);
  }
  void Broadcast(Tensor& buffer, int root) override {
    Note(CommOpKind::kBroadcast, buffer.bytes());
    inner_->Broadcast(buffer, root);
  }
  const std::string& group() const { return group_; }

 private:
  void Note(CommOpKind op, size_t bytes) {
    if (trace_ != nullptr && inner_->Size() > 1) {
      trace_->Record(op, group_, static_cast<int64_t>(bytes));
    }
  }
  std::unique_ptr<Communicator> inner_;
  std::string group_;
  CommTrace* trace_;
};

}  // namespace mpusim
