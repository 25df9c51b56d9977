// NcclCommunicator: one process group's collectives on CUDA device tensors, with NCCL.
//
// What it is: the Communicator of `mpusim run --backend cuda --comm nccl`. Each collective
// is one NCCL call on the CudaKernels stream (so it runs after the kernels that produced its
// input), followed by a wait that polls cudaStreamQuery and ncclCommGetAsyncError, as
// nccl-tests' testStreamSynchronize does. An asynchronous NCCL error, a CUDA error or no
// completion within the timeout aborts the communicator (ncclCommAbort) and then the whole
// job (cuda_check.h Fatal), naming the operation and the group: a dead peer never becomes
// a silent hang.
// What it is not: the bootstrap transport. MPI only builds the groups (MPI_Comm_split in
// MakeGroupCommunicators, mpi/mpi_communicator.h) and broadcasts each group's ncclUniqueId;
// NCCL carries all data. NCCL needs one GPU per rank ("Duplicate GPU detected" otherwise);
// with several ranks per GPU use HostStagedCommunicator (--comm mpi).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <string>

#include "core/communicator.h"
#include "core/tensor.h"
#include "mpi/mpi_communicator.h"

namespace mpusim::cuda {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `group`: rank 0 of the group creates an ncclUniqueId, MPI_Bcast's it over
  // group.comm(), and every member calls ncclCommInitRank(group size, id, group rank) on the
  // current CUDA device. `group_name` (e.g. "tp") names the group in error messages;
  // collectives are enqueued on `stream`, which must outlive this object, and each waits at
  // most `timeout_s` seconds.
  static std::unique_ptr<NcclCommunicator> Create(const MpiCommunicator& group,
                                                   std::string group_name, cudaStream_t stream,
                                                   double timeout_s);

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  // ncclCommDestroy. Every member of the group must destroy its communicator (NCCL may
  // synchronise the ranks of a node here), as the graph's owners all do at the same point.
  ~NcclCommunicator() override;

  int Rank() const override { return rank_; }
  int Size() const override { return size_; }
  ncclComm_t comm() const { return comm_; }

  // In place (ncclAllReduce with sendbuff == recvbuff).
  void AllReduce(Tensor& buffer, ReduceOp op) override;
  // out.numel() == Size() * in.numel(); `in` and `out` must not overlap.
  void AllGather(const Tensor& in, Tensor& out) override;
  // in.numel() == Size() * out.numel(); `in` and `out` must not overlap.
  void ReduceScatter(const Tensor& in, Tensor& out) override;
  // In place from group rank `root`.
  void AllToAll(const Tensor& in, Tensor& out) override;
  void AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                 const std::vector<int64_t>& recv_counts) override;
  void Broadcast(Tensor& buffer, int root) override;
  // One NCCL group (ncclGroupStart, an ncclSend or ncclRecv per message, ncclGroupEnd), then
  // the wait. NCCL does not report a receive of the wrong length; the model's steps make
  // the same calls on both sides, and the CPU backend checks them.
  // Completes the messages before returning (the sends are not left in flight: on one stream
  // a pending send would hold back the kernels after it), so pipelines run the lockstep plan
  // (core/pipeline/pipeline_plan.h). Tags are not used: NCCL matches the messages of a peer
  // pair in order.
  std::unique_ptr<PendingP2P> PostSendRecv(const std::vector<P2POp>& ops) override;
  bool LeavesSendsInFlight() const override { return false; }

 private:
  NcclCommunicator(ncclComm_t comm, int rank, int size, std::string group_name,
                   cudaStream_t stream, double timeout_s);
  // Waits for the stream (and so for the collective just enqueued); aborts the communicator
  // and the job on an error or after timeout_s_ seconds. `what` names the operation.
  void Wait(const char* what);

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 0;
  std::string group_name_;
  cudaStream_t stream_ = nullptr;
  double timeout_s_ = 300;
};

}  // namespace mpusim::cuda
