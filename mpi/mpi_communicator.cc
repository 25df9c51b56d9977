// MpiCommunicator and MakeGroupCommunicators (see mpi_communicator.h).
#include "mpi/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/arg_checks.h"
#include "core/half.h"
#include "mpi/mpi_check.h"
#include "mpi/watchdog.h"

namespace mpusim {
namespace {

[[noreturn]] void Invalid(std::string_view function, const std::string& what) {
  throw std::invalid_argument(fmt::format("MpiCommunicator::{}: {}", function, what));
}

// 16-bit elements travel as MPI_UINT16_T: moving them needs only their bits, and sums and
// maxima use the user-defined operations below instead of MPI's integer ones. int64 (token
// ids) is MPI_INT64_T, with MPI's own exact integer sum and max.
MPI_Datatype MpiType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kBFloat16:
    case DType::kFloat16: return MPI_UINT16_T;
    case DType::kInt64: return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

// inout[e] = in[e] (op) inout[e] for 16-bit H: both widened exactly with ToFloat, combined
// in float32, rounded once with FromFloat<H> -- what NCCL does for bf16/fp16 sums. Max
// returns a quiet NaN if either side is NaN and +0 for max(-0, +0), so that it is exactly
// commutative: which operand MPI passes first cannot change the bits a rank ends with (a
// float32 sum is commutative already).
template <typename H, ReduceOp kOp>
void CombineHalf(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const H* a = static_cast<const H*>(in);
  H* b = static_cast<H*>(inout);
  for (int e = 0; e < *len; ++e) {
    const float x = ToFloat(a[e]);
    const float y = ToFloat(b[e]);
    float r;
    if constexpr (kOp == ReduceOp::kSum) {
      r = x + y;
    } else if (std::isnan(x) || std::isnan(y)) {
      r = std::numeric_limits<float>::quiet_NaN();
    } else if (x == y) {
      r = std::signbit(x) ? y : x;
    } else {
      r = x > y ? x : y;
    }
    b[e] = FromFloat<H>(r);
  }
}

// The four 16-bit operations, created on first use and freed when MPI_Finalize deletes the
// attributes of MPI_COMM_SELF (which it does first, while MPI still works), so MPI_Op_free
// always precedes MPI_Finalize.
struct HalfOps {
  MPI_Op bf16_sum = MPI_OP_NULL;
  MPI_Op bf16_max = MPI_OP_NULL;
  MPI_Op fp16_sum = MPI_OP_NULL;
  MPI_Op fp16_max = MPI_OP_NULL;
};

int FreeHalfOps(MPI_Comm /*comm*/, int /*keyval*/, void* attribute, void* /*extra*/) {
  auto* ops = static_cast<HalfOps*>(attribute);
  for (MPI_Op* op : {&ops->bf16_sum, &ops->bf16_max, &ops->fp16_sum, &ops->fp16_max}) {
    MPUSIM_MPI_CHECK(MPI_Op_free(op));
  }
  return MPI_SUCCESS;
}

HalfOps* CreateHalfOps() {
  auto* ops = new HalfOps;  // lives until MPI_Finalize; only its MPI_Ops are freed then
  MPUSIM_MPI_CHECK(MPI_Op_create(&CombineHalf<BFloat16, ReduceOp::kSum>, 1, &ops->bf16_sum));
  MPUSIM_MPI_CHECK(MPI_Op_create(&CombineHalf<BFloat16, ReduceOp::kMax>, 1, &ops->bf16_max));
  MPUSIM_MPI_CHECK(MPI_Op_create(&CombineHalf<Float16, ReduceOp::kSum>, 1, &ops->fp16_sum));
  MPUSIM_MPI_CHECK(MPI_Op_create(&CombineHalf<Float16, ReduceOp::kMax>, 1, &ops->fp16_max));
  int keyval = MPI_KEYVAL_INVALID;
  MPUSIM_MPI_CHECK(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &FreeHalfOps, &keyval, nullptr));
  MPUSIM_MPI_CHECK(MPI_Comm_set_attr(MPI_COMM_SELF, keyval, ops));
  MPUSIM_MPI_CHECK(MPI_Comm_free_keyval(&keyval));  // the attribute keeps it alive
  return ops;
}

// MPI's own operation for float32/float64/int64; the 16-bit ones above otherwise.
MPI_Op MpiOp(DType dtype, ReduceOp op) {
  if (!IsHalf(dtype)) return op == ReduceOp::kSum ? MPI_SUM : MPI_MAX;
  static HalfOps* const ops = CreateHalfOps();  // thread-safe, once per process
  if (dtype == DType::kBFloat16) return op == ReduceOp::kSum ? ops->bf16_sum : ops->bf16_max;
  return op == ReduceOp::kSum ? ops->fp16_sum : ops->fp16_max;
}

// Send and Recv match on this tag (and on the communicator, which is the group's own).
constexpr int kPointToPointTag = 0;

// MPI counts are int; larger buffers would need derived datatypes, which nothing needs yet.
int MpiCount(std::string_view function, int64_t numel) {
  if (numel > INT_MAX) Invalid(function, fmt::format("{} elements exceed MPI's int count", numel));
  return static_cast<int>(numel);
}

void CheckBuffer(std::string_view function, std::string_view name, const Tensor& tensor) {
  CollectiveArgs("MpiCommunicator", Device::kHost, function).Buffer(name, tensor);
}

void CheckPeer(std::string_view function, int peer, int rank, int size) {
  if (peer < 0 || peer >= size || peer == rank) {
    Invalid(function, fmt::format("peer {} is not another rank of this group (rank {} of {})",
                                  peer, rank, size));
  }
}

void CheckChunked(std::string_view function, const Tensor& in, const Tensor& out,
                  const Tensor& small, const Tensor& big, int size) {
  CollectiveArgs("MpiCommunicator", Device::kHost, function).Chunked(in, out, small, big, size);
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string kind) : comm_(comm) {
  SetErrorsReturn(comm_);
  MPUSIM_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  MPUSIM_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  if (kind.empty()) {
    int relation = MPI_UNEQUAL;
    MPUSIM_MPI_CHECK(MPI_Comm_compare(comm_, MPI_COMM_WORLD, &relation));
    kind = relation == MPI_CONGRUENT ? "world" : "comm";
  }
  label_ = LabelOf(comm_, std::move(kind));
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::Adopt(MPI_Comm comm, std::string kind) {
  if (comm == MPI_COMM_NULL) Invalid("Adopt", "MPI_COMM_NULL");
  if (comm == MPI_COMM_WORLD || comm == MPI_COMM_SELF) {
    Invalid("Adopt", "a predefined communicator cannot be owned (and freed); use Duplicate");
  }
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(comm, std::move(kind)));
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::Duplicate(MPI_Comm comm, std::string kind) {
  const CommLabel source =
      LabelOf(comm, !kind.empty() ? kind : comm == MPI_COMM_WORLD ? "world" : "comm");
  return Adopt(watched::CommDup(comm, source), std::move(kind));
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPUSIM_MPI_CHECK(MPI_Finalized(&finalized));
  if (finalized == 0) MPUSIM_MPI_CHECK(MPI_Comm_free(&comm_));
}

void MpiCommunicator::AllReduce(Tensor& buffer, ReduceOp op) {
  CheckBuffer("AllReduce", "buffer", buffer);
  const int count = MpiCount("AllReduce", buffer.numel());
  watched::Allreduce(MPI_IN_PLACE, buffer.data(), count, MpiType(buffer.dtype()),
                     MpiOp(buffer.dtype(), op), comm_, label_);
}

void MpiCommunicator::AllGather(const Tensor& in, Tensor& out) {
  CheckChunked("AllGather", in, out, in, out, size_);
  const int count = MpiCount("AllGather", out.numel()) / size_;
  const MPI_Datatype type = MpiType(in.dtype());
  watched::Allgather(in.data(), count, type, out.data(), count, type, comm_, label_);
}

void MpiCommunicator::ReduceScatter(const Tensor& in, Tensor& out) {
  CheckChunked("ReduceScatter", in, out, out, in, size_);
  const int count = MpiCount("ReduceScatter", in.numel()) / size_;
  watched::ReduceScatterBlock(in.data(), out.data(), count, MpiType(in.dtype()),
                              MpiOp(in.dtype(), ReduceOp::kSum), comm_, label_);
}

void MpiCommunicator::AllToAll(const Tensor& in, Tensor& out) {
  CollectiveArgs("MpiCommunicator", Device::kHost, "AllToAll").Exchanged(in, out, size_);
  const int count = MpiCount("AllToAll", in.numel()) / size_;
  const MPI_Datatype type = MpiType(in.dtype());
  watched::Alltoall(in.data(), count, type, out.data(), count, type, comm_, label_);
}

void MpiCommunicator::AllToAllV(const Tensor& in, const std::vector<int64_t>& send_counts,
                                Tensor& out, const std::vector<int64_t>& recv_counts) {
  CollectiveArgs("MpiCommunicator", Device::kHost, "AllToAllV")
      .SplitExchanged(in, send_counts, out, recv_counts, size_);
  MpiCount("AllToAllV", std::max(in.numel(), out.numel()));  // every count and offset fits
  std::vector<int> send(send_counts.begin(), send_counts.end());
  std::vector<int> recv(recv_counts.begin(), recv_counts.end());
  std::vector<int> send_at(send.size(), 0), recv_at(recv.size(), 0);
  for (size_t j = 1; j < send.size(); ++j) {
    send_at[j] = send_at[j - 1] + send[j - 1];
    recv_at[j] = recv_at[j - 1] + recv[j - 1];
  }
  const MPI_Datatype type = MpiType(in.dtype());
  watched::Alltoallv(in.data(), send.data(), send_at.data(), type, out.data(), recv.data(),
                     recv_at.data(), type, comm_, label_);
}

void MpiCommunicator::Broadcast(Tensor& buffer, int root) {
  CheckBuffer("Broadcast", "buffer", buffer);
  if (root < 0 || root >= size_) {
    Invalid("Broadcast", fmt::format("root {} is outside the group of size {}", root, size_));
  }
  const int count = MpiCount("Broadcast", buffer.numel());
  watched::Bcast(buffer.data(), count, MpiType(buffer.dtype()), root, comm_, label_);
}

void MpiCommunicator::Send(const Tensor& buffer, int peer) {
  CheckBuffer("Send", "buffer", buffer);
  CheckPeer("Send", peer, rank_, size_);
  const int count = MpiCount("Send", buffer.numel());
  watched::Send(buffer.data(), count, MpiType(buffer.dtype()), peer, kPointToPointTag, comm_,
                label_);
}

void MpiCommunicator::Recv(Tensor& buffer, int peer) {
  CheckBuffer("Recv", "buffer", buffer);
  CheckPeer("Recv", peer, rank_, size_);
  const int count = MpiCount("Recv", buffer.numel());
  const int received = watched::Recv(buffer.data(), count, MpiType(buffer.dtype()), peer,
                                     kPointToPointTag, comm_, label_);
  if (received != count) {
    const ProcessPlace place = WhereAmI();
    AbortJob(fmt::format("mpusim: rank {} (host {}): MpiCommunicator::Recv from group rank {} "
                         "of {}: expected {} elements of {}, received {}",
                         place.world_rank, place.host, peer, DescribeGroup(label_), count,
                         DTypeName(buffer.dtype()), received));
  }
}

namespace {

class MpiPendingP2P final : public PendingP2P {
 public:
  MpiPendingP2P(std::vector<P2POp> ops, std::vector<watched::Message> messages,
                watched::PendingMessages pending, const CommLabel& label)
      : ops_(std::move(ops)),
        messages_(std::move(messages)),
        pending_(std::move(pending)),
        label_(label) {}
  ~MpiPendingP2P() override { Wait(); }
  void Wait() override {
    if (waited_) return;
    waited_ = true;
    const std::vector<int> received = pending_.Wait();
    for (size_t i = 0; i < ops_.size(); ++i) {
      if (messages_[i].send || received[i] == messages_[i].count) continue;
      const ProcessPlace place = WhereAmI();
      AbortJob(fmt::format("mpusim: rank {} (host {}): MpiCommunicator::PostSendRecv receive "
                           "from group rank {} of {}: expected {} elements of {}, received {}",
                           place.world_rank, place.host, ops_[i].peer, DescribeGroup(label_),
                           messages_[i].count, DTypeName(ops_[i].buffer.dtype()),
                           received[i]));
    }
  }

 private:
  std::vector<P2POp> ops_;  // keeps the buffers alive until the messages complete
  std::vector<watched::Message> messages_;
  watched::PendingMessages pending_;
  const CommLabel& label_;
  bool waited_ = false;
};

}  // namespace

std::unique_ptr<PendingP2P> MpiCommunicator::PostSendRecv(const std::vector<P2POp>& ops) {
  std::vector<watched::Message> messages;
  messages.reserve(ops.size());
  for (const P2POp& op : ops) {
    const bool send = op.kind == P2POp::Kind::kSend;
    const char* function = send ? "PostSendRecv (send)" : "PostSendRecv (recv)";
    CheckBuffer(function, "buffer", op.buffer);
    CheckPeer(function, op.peer, rank_, size_);
    if (op.tag < 0 || op.tag > 32767) {
      Invalid(function, fmt::format("tag {} is outside [0, 32767]", op.tag));
    }
    // A copy of the handle shares the caller's storage: MPI writes a receive there.
    Tensor buffer = op.buffer;
    messages.push_back({send, buffer.data(), MpiCount(function, op.buffer.numel()),
                        MpiType(op.buffer.dtype()), op.peer, op.tag});
  }
  watched::PendingMessages pending = watched::PostMessages(messages, comm_, label_);
  return std::make_unique<MpiPendingP2P>(ops, std::move(messages), std::move(pending), label_);
}

std::map<std::string, std::unique_ptr<Communicator>> MakeGroupCommunicators(
    const Topology& topology, int64_t world_rank, MPI_Comm world,
    const std::vector<std::string>& kinds) {
  int mpi_rank = 0;
  int mpi_size = 0;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(world, &mpi_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(world, &mpi_size));

  // Validate locally, then agree, so that either every rank splits or every rank throws.
  std::string problem;
  std::vector<size_t> kind_indices;
  if (topology.first_rank() != 0) {
    problem = fmt::format("the topology starts at rank {}, not 0", topology.first_rank());
  } else if (mpi_size != topology.world_size()) {
    problem = fmt::format("the MPI communicator has {} ranks but the topology {}", mpi_size,
                          topology.world_size());
  } else if (world_rank != mpi_rank) {
    problem = fmt::format("world_rank {} is not this process's MPI rank {}", world_rank, mpi_rank);
  }
  for (const std::string& name : kinds) {
    const std::optional<size_t> index = topology.FindKind(name);
    if (!index.has_value()) {
      if (problem.empty()) problem = fmt::format("unknown group kind \"{}\"", name);
      continue;
    }
    if (topology.NumGroups(*index) > INT_MAX && problem.empty()) {
      problem = fmt::format("group kind \"{}\" has more groups than MPI colors", name);
    }
    kind_indices.push_back(*index);
  }
  const int local_ok = problem.empty() ? 1 : 0;
  int all_ok = 0;
  const CommLabel world_label = LabelOf(world, "world");
  watched::Allreduce(&local_ok, &all_ok, 1, MPI_INT, MPI_LAND, world, world_label);
  if (all_ok == 0) {
    Invalid("MakeGroupCommunicators",
            problem.empty() ? std::string("another rank refused its arguments") : problem);
  }

  std::map<std::string, std::unique_ptr<Communicator>> out;
  for (size_t k = 0; k < kinds.size(); ++k) {
    const std::optional<GroupSlot> slot = topology.Locate(kind_indices[k], world_rank);
    const int color = slot.has_value() ? static_cast<int>(slot->group_index) : MPI_UNDEFINED;
    const int key = slot.has_value() ? static_cast<int>(slot->rank_in_group) : 0;
    const MPI_Comm comm = watched::CommSplit(world, color, key, world_label);
    if (comm != MPI_COMM_NULL) out[kinds[k]] = MpiCommunicator::Adopt(comm, kinds[k]);
  }
  return out;
}

}  // namespace mpusim
