// MpiCommunicator: the simulator's Communicator, one MPI communicator per process group.
//
// What it is: the four collectives core/model/graph needs (all-reduce, all-gather, reduce-scatter,
// broadcast), batched point-to-point (BatchSendRecv, for pipeline stages) and blocking Send / Recv
// on host float32, float64, bfloat16 and float16 tensors, each a single watched MPI call
// (mpi/watchdog.h) on the group's own MPI_Comm, plus MakeGroupCommunicators, which builds this
// rank's communicator for each requested group kind of the planner (core/topology.h) with
// MPI_Comm_split.
//
// 16-bit tensors: all-gather, broadcast and point-to-point move their bits unchanged
// (MPI_UINT16_T). Sums (all-reduce, reduce-scatter) and maxima use user-defined commutative
// MPI_Ops that widen both operands to float32 (core/half.h ToFloat), add or compare, and round
// the result once to nearest even (FromFloat) -- as NCCL reduces bf16/fp16. A sum over k ranks
// therefore rounds k - 1 times, in an order MPI picks; it is exact when every partial sum fits
// the 16-bit mantissa (small integers). The ops are exactly commutative (a max with a NaN is a
// quiet NaN, max(-0, +0) = +0), so the order in which MPI hands a rank its operands cannot
// make ranks disagree: every rank of an all-reduce ends with the same bits. They are
// created on first use and freed inside MPI_Finalize.
// What it is not: a planner (group membership comes from Topology only) or a tracer (wrap it
// in TracedCommunicator).
//
// Rank order: MPI_Comm_split(world, color = group_index, key = rank_in_group) orders each new
// communicator by rank_in_group, so MPI rank k of a group is Megatron's k-th member
// (Topology::Group(kind, group_index)[k]) and AllGather concatenates in Megatron's order.
//
// Every communicator this file creates gets MPI_ERRORS_RETURN and a label (its group kind and
// the world ranks of its members), and every communication is watched: a failed call aborts
// the job with the rank and the call named, and a call that outlives the communication timeout
// (a stopped or hung peer) aborts it with the rank, the call, the group and the peer named,
// instead of hanging. Argument mistakes (sizes, dtypes, a root or peer outside the group)
// throw std::invalid_argument before any MPI call; since core/model/graph makes the same calls
// on every rank of a group, all ranks throw together.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "core/tensor.h"
#include "core/topology.h"
#include "mpi/watchdog.h"

namespace mpusim {

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (freed by the destructor) and sets MPI_ERRORS_RETURN on it;
  // MPI_COMM_NULL, MPI_COMM_WORLD and MPI_COMM_SELF are refused (std::invalid_argument).
  // `kind` names the group in the watchdog's line ("tp", "dp", ...); empty: "world" when
  // `comm` has the members of MPI_COMM_WORLD in world order, else "comm".
  static std::unique_ptr<MpiCommunicator> Adopt(MPI_Comm comm, std::string kind = {});
  // An owned duplicate of `comm` (a watched MPI_Comm_idup), e.g. of MPI_COMM_WORLD.
  static std::unique_ptr<MpiCommunicator> Duplicate(MPI_Comm comm, std::string kind = {});
  // Duplicate(MPI_COMM_WORLD): all ranks, in world order.
  static std::unique_ptr<MpiCommunicator> World() { return Duplicate(MPI_COMM_WORLD); }

  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;
  // Frees the communicator (collective over the group, like MPI_Comm_free); does nothing
  // once MPI is finalized.
  ~MpiCommunicator() override;

  int Rank() const override { return rank_; }
  int Size() const override { return size_; }
  MPI_Comm comm() const { return comm_; }
  // The group kind and the world rank of each member, in group-rank order.
  const CommLabel& label() const { return label_; }

  // Sum or max over the group, in place (MPI_IN_PLACE).
  void AllReduce(Tensor& buffer, ReduceOp op) override;
  // out = every rank's `in` concatenated in group-rank order; out.numel() == Size() *
  // in.numel(); `in` and `out` must not overlap.
  void AllGather(const Tensor& in, Tensor& out) override;
  // in.numel() == Size() * out.numel(); out = sum over ranks of chunk Rank() of `in`.
  void ReduceScatter(const Tensor& in, Tensor& out) override;
  // In place from group rank `root`.
  void AllToAll(const Tensor& in, Tensor& out) override;
  void AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                 const std::vector<int64_t>& recv_counts) override;
  void Broadcast(Tensor& buffer, int root) override;

  // Point-to-point with blocking semantics: Send returns once `buffer` may be reused, Recv
  // once `buffer` holds the message. `peer` is a group rank other than Rank(). Messages
  // between two ranks arrive in the order they were sent. The receiver's tensor must have the
  // sender's dtype and element count: a longer message is an MPI error and a shorter one is
  // reported the same way, both aborting the job (the two ranks disagree: a bug).
  void Send(const Tensor& buffer, int peer);
  void Recv(Tensor& buffer, int peer);
  // All messages posted (MPI_Isend / MPI_Irecv with the op's tag); Wait completes them under
  // the watchdog, and a receive of the wrong length aborts the job like Recv.
  std::unique_ptr<PendingP2P> PostSendRecv(const std::vector<P2POp>& ops) override;

 private:
  MpiCommunicator(MPI_Comm comm, std::string kind);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  CommLabel label_;
};

// This rank's communicator for each kind named in `kinds` (Megatron names: "tp", "dp",
// "dp_cp", "embd", ...), keyed by that name. A kind whose groups leave this rank out
// (embd, pos_embd on middle pipeline stages) gets no entry.
//
// Collective over `world`: every rank must call it with the same `kinds` in the same order.
// Requires topology.first_rank() == 0, `world` of size topology.world_size() and
// `world_rank` equal to this process's rank in `world`. If any rank finds one of these
// violated, or a kind name unknown to the topology, every rank throws
// std::invalid_argument (the check is all-reduced first, so no rank is left waiting in a
// split). Each split costs a watched barrier and one collective over `world`. Each
// communicator is labelled with its kind name and its members' world ranks.
std::map<std::string, std::unique_ptr<Communicator>> MakeGroupCommunicators(
    const Topology& topology, int64_t world_rank, MPI_Comm world,
    const std::vector<std::string>& kinds);

}  // namespace mpusim
