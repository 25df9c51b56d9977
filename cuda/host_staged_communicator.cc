// HostStagedCommunicator (see host_staged_communicator.h).
#include "cuda/host_staged_communicator.h"

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace mpusim::cuda {
namespace {

void CheckDevice(std::string_view function, std::string_view name, const Tensor& tensor) {
  if (!tensor.defined()) {
    throw std::invalid_argument(
        fmt::format("HostStagedCommunicator::{}: {} is not allocated", function, name));
  }
  if (tensor.device() != Device::kCuda) {
    throw std::invalid_argument(
        fmt::format("HostStagedCommunicator::{}: {} must be a CUDA tensor", function, name));
  }
}

// The device buffers of a gather or scatter must be disjoint, as for NcclCommunicator.
void CheckDisjoint(std::string_view function, const Tensor& in, const Tensor& out) {
  const auto* a0 = static_cast<const std::byte*>(in.data());
  const auto* b0 = static_cast<const std::byte*>(out.data());
  if (in.bytes() > 0 && out.bytes() > 0 && a0 < b0 + out.bytes() && b0 < a0 + in.bytes()) {
    throw std::invalid_argument(
        fmt::format("HostStagedCommunicator::{}: in and out overlap", function));
  }
}

}  // namespace

void HostStagedCommunicator::AllReduce(Tensor& buffer, ReduceOp op) {
  CheckDevice("AllReduce", "buffer", buffer);
  Tensor host = kernels_.ToHost(buffer);
  group_->AllReduce(host, op);
  kernels_.CopyFromHost(host, buffer);
}

void HostStagedCommunicator::AllGather(const Tensor& in, Tensor& out) {
  CheckDevice("AllGather", "in", in);
  CheckDevice("AllGather", "out", out);
  CheckDisjoint("AllGather", in, out);
  const Tensor host_in = kernels_.ToHost(in);
  Tensor host_out = Tensor::HostEmpty(out.shape(), out.dtype());
  group_->AllGather(host_in, host_out);  // checks the sizes and dtypes
  kernels_.CopyFromHost(host_out, out);
}

void HostStagedCommunicator::ReduceScatter(const Tensor& in, Tensor& out) {
  CheckDevice("ReduceScatter", "in", in);
  CheckDevice("ReduceScatter", "out", out);
  CheckDisjoint("ReduceScatter", in, out);
  const Tensor host_in = kernels_.ToHost(in);
  Tensor host_out = Tensor::HostEmpty(out.shape(), out.dtype());
  group_->ReduceScatter(host_in, host_out);  // checks the sizes and dtypes
  kernels_.CopyFromHost(host_out, out);
}

void HostStagedCommunicator::AllToAll(const Tensor& in, Tensor& out) {
  CheckDevice("AllToAll", "in", in);
  CheckDevice("AllToAll", "out", out);
  CheckDisjoint("AllToAll", in, out);
  const Tensor host_in = kernels_.ToHost(in);
  Tensor host_out = Tensor::HostEmpty(out.shape(), out.dtype());
  group_->AllToAll(host_in, host_out);  // checks the sizes and dtypes
  kernels_.CopyFromHost(host_out, out);
}

void HostStagedCommunicator::AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts,
                                       Tensor& out, const std::vector<int64_t>& recv_counts) {
  CheckDevice("AllToAllV", "in", in);
  CheckDevice("AllToAllV", "out", out);
  CheckDisjoint("AllToAllV", in, out);
  const Tensor host_in = kernels_.ToHost(in);
  Tensor host_out = Tensor::HostEmpty(out.shape(), out.dtype());
  group_->AllToAllV(host_in, send_counts, host_out, recv_counts);  // checks the counts
  kernels_.CopyFromHost(host_out, out);
}

void HostStagedCommunicator::Broadcast(Tensor& buffer, int root) {
  CheckDevice("Broadcast", "buffer", buffer);
  Tensor host = kernels_.ToHost(buffer);
  group_->Broadcast(host, root);
  kernels_.CopyFromHost(host, buffer);
}

namespace {

class StagedP2P final : public PendingP2P {
 public:
  StagedP2P(std::vector<P2POp> ops, std::vector<P2POp> staged,
            std::unique_ptr<PendingP2P> inner, CudaKernels& kernels)
      : ops_(std::move(ops)),
        staged_(std::move(staged)),
        inner_(std::move(inner)),
        kernels_(kernels) {}
  ~StagedP2P() override { Wait(); }
  void Wait() override {
    if (waited_) return;
    waited_ = true;
    inner_->Wait();
    for (size_t i = 0; i < ops_.size(); ++i) {
      if (ops_[i].kind != P2POp::Kind::kRecv) continue;
      Tensor target = ops_[i].buffer;  // shares the caller's storage
      kernels_.CopyFromHost(staged_[i].buffer, target);
    }
  }

 private:
  std::vector<P2POp> ops_;
  std::vector<P2POp> staged_;
  std::unique_ptr<PendingP2P> inner_;
  CudaKernels& kernels_;
  bool waited_ = false;
};

}  // namespace

std::unique_ptr<PendingP2P> HostStagedCommunicator::PostSendRecv(const std::vector<P2POp>& ops) {
  std::vector<P2POp> staged;
  staged.reserve(ops.size());
  for (const P2POp& op : ops) {
    CheckDevice("PostSendRecv", "buffer", op.buffer);
    staged.push_back({op.kind,
                      op.kind == P2POp::Kind::kSend
                          ? kernels_.ToHost(op.buffer)
                          : Tensor::HostEmpty(op.buffer.shape(), op.buffer.dtype()),
                      op.peer, op.tag});
  }
  std::unique_ptr<PendingP2P> inner = group_->PostSendRecv(staged);
  return std::make_unique<StagedP2P>(ops, std::move(staged), std::move(inner), kernels_);
}

}  // namespace mpusim::cuda
