// NcclCommunicator (see nccl_communicator.h).
#include "cuda/nccl_communicator.h"

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/arg_checks.h"
#include "cuda/cuda_check.h"
#include "mpi/mpi_check.h"
#include "mpi/watchdog.h"

namespace mpusim::cuda {
namespace {

[[noreturn]] void Invalid(std::string_view function, const std::string& what) {
  throw std::invalid_argument(fmt::format("NcclCommunicator::{}: {}", function, what));
}

// NCCL's name of a dtype (ncclBfloat16 is declared unconditionally by NCCL 2.28's nccl.h;
// older ones need cuda_bf16.h, which nccl.h includes itself for CUDA >= 11). NCCL sums
// 16-bit buffers in 16-bit steps: each partial sum of its ring or tree is rounded to the
// dtype, so a sum over more than two ranks may differ from the CPU's reduction in the last
// bit (exact whenever the partial sums are representable).
ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
    case DType::kInt64: return ncclInt64;  // token ids: moved, or summed exactly
  }
  throw std::invalid_argument("NcclCommunicator: unknown dtype");
}

void CheckBuffer(std::string_view function, std::string_view name, const Tensor& tensor) {
  CollectiveArgs("NcclCommunicator", Device::kCuda, function).Buffer(name, tensor);
}

void CheckChunked(std::string_view function, const Tensor& in, const Tensor& out,
                  const Tensor& small, const Tensor& big, int size) {
  CollectiveArgs("NcclCommunicator", Device::kCuda, function).Chunked(in, out, small, big, size);
}

}  // namespace

std::unique_ptr<NcclCommunicator> NcclCommunicator::Create(const MpiCommunicator& group,
                                                           std::string group_name,
                                                           cudaStream_t stream, double timeout_s) {
  ncclUniqueId id{};
  if (group.Rank() == 0) MPUSIM_NCCL_CHECK(ncclGetUniqueId(&id));
  watched::Bcast(&id, static_cast<int>(sizeof(id)), MPI_BYTE, 0, group.comm(), group.label());
  ncclComm_t comm = nullptr;
  MPUSIM_NCCL_CHECK(ncclCommInitRank(&comm, group.Size(), id, group.Rank()));
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(
      comm, group.Rank(), group.Size(), std::move(group_name), stream, timeout_s));
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int rank, int size, std::string group_name,
                                   cudaStream_t stream, double timeout_s)
    : comm_(comm),
      rank_(rank),
      size_(size),
      group_name_(std::move(group_name)),
      stream_(stream),
      timeout_s_(timeout_s) {}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) MPUSIM_NCCL_CHECK(ncclCommDestroy(comm_));
}

void NcclCommunicator::Wait(const char* what) {
  const auto start = std::chrono::steady_clock::now();
  std::string failure;
  while (true) {
    const cudaError_t state = cudaStreamQuery(stream_);
    if (state == cudaSuccess) return;
    if (state != cudaErrorNotReady) {
      failure = CudaErrorText(state);
      break;
    }
    // "Not ready" is reported like an error and may linger as the runtime's last error;
    // clear it, or the next launch check (cudaGetLastError) would see it (PyTorch's
    // CUDAStream::query does the same). Launch errors are checked at each launch, and
    // sticky errors come back from every later call, so nothing is lost here.
    static_cast<void>(cudaGetLastError());
    ncclResult_t async_error = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm_, &async_error);
    if (queried != ncclSuccess) {
      failure = NcclErrorText(queried);
      break;
    }
    if (async_error != ncclSuccess && async_error != ncclInProgress) {
      failure = NcclErrorText(async_error);
      break;
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s_) {
      failure = fmt::format(
          "not complete after {} s (a peer may have died or not joined; the limit is "
          "MPUSIM_NCCL_TIMEOUT_S)",
          timeout_s_);
      break;
    }
    std::this_thread::yield();
  }
  // Abort first, so the NCCL kernels stop and the peers see the error too.
  ncclCommAbort(comm_);
  comm_ = nullptr;
  const std::string statement = fmt::format("NCCL {} on group {} (rank {} of {})", what,
                                            group_name_, rank_, size_);
  Fatal(statement.c_str(), failure, __FILE__, __LINE__, __func__);
}

void NcclCommunicator::AllReduce(Tensor& buffer, ReduceOp op) {
  CheckBuffer("AllReduce", "buffer", buffer);
  if (buffer.numel() == 0) return;
  MPUSIM_NCCL_CHECK(ncclAllReduce(buffer.data(), buffer.data(),
                                  static_cast<size_t>(buffer.numel()), NcclType(buffer.dtype()),
                                  op == ReduceOp::kSum ? ncclSum : ncclMax, comm_, stream_));
  Wait(op == ReduceOp::kSum ? "AllReduce(sum)" : "AllReduce(max)");
}

void NcclCommunicator::AllGather(const Tensor& in, Tensor& out) {
  CheckChunked("AllGather", in, out, in, out, size_);
  if (in.numel() == 0) return;
  MPUSIM_NCCL_CHECK(ncclAllGather(in.data(), out.data(), static_cast<size_t>(in.numel()),
                                  NcclType(in.dtype()), comm_, stream_));
  Wait("AllGather");
}

void NcclCommunicator::ReduceScatter(const Tensor& in, Tensor& out) {
  CheckChunked("ReduceScatter", in, out, out, in, size_);
  if (out.numel() == 0) return;
  MPUSIM_NCCL_CHECK(ncclReduceScatter(in.data(), out.data(), static_cast<size_t>(out.numel()),
                                      NcclType(in.dtype()), ncclSum, comm_, stream_));
  Wait("ReduceScatter");
}

// NCCL has no equal-split all-to-all before 2.28: one send and one receive per peer (this
// rank included) in one group, as torch.distributed.all_to_all_single does.
void NcclCommunicator::AllToAll(const Tensor& in, Tensor& out) {
  CollectiveArgs("NcclCommunicator", Device::kCuda, "AllToAll").Exchanged(in, out, size_);
  if (in.numel() == 0) return;
  const auto count = static_cast<size_t>(in.numel() / size_);
  const size_t chunk_bytes = count * DTypeSize(in.dtype());
  const ncclDataType_t type = NcclType(in.dtype());
  const auto* send = static_cast<const std::byte*>(in.data());
  auto* recv = static_cast<std::byte*>(out.data());
  MPUSIM_NCCL_CHECK(ncclGroupStart());
  for (int peer = 0; peer < size_; ++peer) {
    const auto at = static_cast<size_t>(peer) * chunk_bytes;
    MPUSIM_NCCL_CHECK(ncclSend(send + at, count, type, peer, comm_, stream_));
    MPUSIM_NCCL_CHECK(ncclRecv(recv + at, count, type, peer, comm_, stream_));
  }
  MPUSIM_NCCL_CHECK(ncclGroupEnd());
  Wait("AllToAll");
}

// One send and one receive per peer with a non-empty part, in one group (both sides skip an
// empty part: the counts agree).
void NcclCommunicator::AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts,
                                 Tensor& out, const std::vector<int64_t>& recv_counts) {
  CollectiveArgs("NcclCommunicator", Device::kCuda, "AllToAllV")
      .SplitExchanged(in, send_counts, out, recv_counts, size_);
  const size_t element = DTypeSize(in.dtype());
  const ncclDataType_t type = NcclType(in.dtype());
  const auto* send = static_cast<const std::byte*>(in.data());
  auto* recv = static_cast<std::byte*>(out.data());
  size_t send_at = 0, recv_at = 0;
  MPUSIM_NCCL_CHECK(ncclGroupStart());
  for (int peer = 0; peer < size_; ++peer) {
    const auto s = static_cast<size_t>(send_counts[static_cast<size_t>(peer)]);
    const auto r = static_cast<size_t>(recv_counts[static_cast<size_t>(peer)]);
    if (s > 0) MPUSIM_NCCL_CHECK(ncclSend(send + send_at * element, s, type, peer, comm_, stream_));
    if (r > 0) MPUSIM_NCCL_CHECK(ncclRecv(recv + recv_at * element, r, type, peer, comm_, stream_));
    send_at += s;
    recv_at += r;
  }
  MPUSIM_NCCL_CHECK(ncclGroupEnd());
  Wait("AllToAllV");
}

void NcclCommunicator::Broadcast(Tensor& buffer, int root) {
  CheckBuffer("Broadcast", "buffer", buffer);
  if (root < 0 || root >= size_) {
    Invalid("Broadcast", fmt::format("root {} is outside the group of size {}", root, size_));
  }
  if (buffer.numel() == 0) return;
  MPUSIM_NCCL_CHECK(ncclBroadcast(buffer.data(), buffer.data(),
                                  static_cast<size_t>(buffer.numel()), NcclType(buffer.dtype()),
                                  root, comm_, stream_));
  Wait("Broadcast");
}

namespace {
class CompletedP2P final : public PendingP2P {
 public:
  void Wait() override {}
};
}  // namespace

std::unique_ptr<PendingP2P> NcclCommunicator::PostSendRecv(const std::vector<P2POp>& ops) {
  for (const P2POp& op : ops) {
    CheckBuffer("PostSendRecv", "buffer", op.buffer);
    if (op.peer < 0 || op.peer >= size_ || op.peer == rank_) {
      Invalid("PostSendRecv", fmt::format("peer {} is not another rank of this group (rank {} "
                                           "of {})",
                                           op.peer, rank_, size_));
    }
  }
  MPUSIM_NCCL_CHECK(ncclGroupStart());
  for (const P2POp& op : ops) {
    if (op.buffer.numel() == 0) continue;
    Tensor buffer = op.buffer;  // shares the caller's storage
    const auto count = static_cast<size_t>(buffer.numel());
    if (op.kind == P2POp::Kind::kSend) {
      MPUSIM_NCCL_CHECK(
          ncclSend(buffer.data(), count, NcclType(buffer.dtype()), op.peer, comm_, stream_));
    } else {
      MPUSIM_NCCL_CHECK(
          ncclRecv(buffer.data(), count, NcclType(buffer.dtype()), op.peer, comm_, stream_));
    }
  }
  MPUSIM_NCCL_CHECK(ncclGroupEnd());
  Wait("PostSendRecv");
  return std::make_unique<CompletedP2P>();
}

}  // namespace mpusim::cuda
