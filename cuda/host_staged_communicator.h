// HostStagedCommunicator: one process group's collectives on CUDA device tensors, carried by
// MPI through host memory.
//
// What it is: the Communicator of `mpusim run --backend cuda --comm mpi`. Each collective
// copies the device buffer to a host buffer (after the kernels that produced it: the copy is
// on the CudaKernels stream and synchronised), runs the MPI collective of MpiCommunicator
// (mpi/mpi_communicator.h) on the group's own MPI communicator, and copies the result back.
// Several ranks may therefore share one GPU, which NCCL refuses ("Duplicate GPU detected"):
// all kernels still run on the GPU, only the collectives go through the host.
// What it is not: fast (two PCIe copies and a host collective per call) or CUDA-aware MPI
// (MPI never sees a device pointer, so any MPI build works).
#pragma once

#include <memory>
#include <utility>

#include "core/communicator.h"
#include "core/tensor.h"
#include "cuda/cuda_kernels.h"
#include "mpi/mpi_communicator.h"

namespace mpusim::cuda {

class HostStagedCommunicator final : public Communicator {
 public:
  // `kernels` provides the stream and the copies; it must outlive this object.
  HostStagedCommunicator(std::unique_ptr<MpiCommunicator> group, CudaKernels& kernels)
      : group_(std::move(group)), kernels_(kernels) {}

  int Rank() const override { return group_->Rank(); }
  int Size() const override { return group_->Size(); }

  // Same contracts as MpiCommunicator, on CUDA tensors.
  void AllReduce(Tensor& buffer, ReduceOp op) override;
  void AllGather(const Tensor& in, Tensor& out) override;
  void ReduceScatter(const Tensor& in, Tensor& out) override;
  void AllToAll(const Tensor& in, Tensor& out) override;
  void AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                 const std::vector<int64_t>& recv_counts) override;
  void Broadcast(Tensor& buffer, int root) override;
  // Sends are copied to the host first; receives land on the host and are copied back by
  // Wait.
  std::unique_ptr<PendingP2P> PostSendRecv(const std::vector<P2POp>& ops) override;

 private:
  std::unique_ptr<MpiCommunicator> group_;
  CudaKernels& kernels_;
};

}  // namespace mpusim::cuda
