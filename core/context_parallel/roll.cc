// Multi-token prediction's roll across the cp ranks (see roll.h).
#include "core/context_parallel/roll.h"

#include <cstring>
#include <stdexcept>
#include <vector>

namespace mpusim {

Tensor RollLeftAcrossCp(Kernels& k, Communicator* group, int64_t cp, int64_t me, const Tensor& x,
                        int tag) {
  if (x.shape().size() != 2) throw std::invalid_argument("RollLeftAcrossCp: x is not [s_cp, b]");
  const int64_t s_cp = x.shape()[0], b = x.shape()[1];
  const size_t row = static_cast<size_t>(b) * DTypeSize(x.dtype());
  const Tensor host = k.ToHost(x);
  Tensor out = Tensor::HostZeros(x.shape(), x.dtype());
  const auto* from = host.data_as<unsigned char>();
  auto* to = out.data_as<unsigned char>();
  const int64_t halves = cp == 1 ? 1 : 2, len = s_cp / halves;
  if (cp > 1 && s_cp % 2 != 0) throw std::invalid_argument("RollLeftAcrossCp: odd s_cp");
  // Each chunk rolled locally: position i takes i + 1; its last position is filled below.
  for (int64_t c = 0; c < halves; ++c) {
    const size_t first = static_cast<size_t>(c * len) * row;
    if (len > 1) std::memcpy(to + first, from + first + row, static_cast<size_t>(len - 1) * row);
  }
  const auto last = [&](int64_t c) { return to + static_cast<size_t>((c + 1) * len - 1) * row; };
  if (cp == 1) return k.ToDevice(out);  // the sequence's last position stays 0
  // The first position of each chunk, the one a neighbour needs.
  const auto first_of = [&](int64_t c) {
    Tensor t = Tensor::HostEmpty({b}, x.dtype());
    std::memcpy(t.data_as<unsigned char>(), from + static_cast<size_t>(c * len) * row, row);
    return k.ToDevice(t);
  };
  const Tensor send_first = first_of(0), send_second = first_of(1);
  Tensor recv_first = k.Empty({b}, x.dtype()), recv_second = k.Empty({b}, x.dtype());
  std::vector<P2POp> ops;
  const int prev = static_cast<int>(me - 1), next = static_cast<int>(me + 1);
  if (me != 0) {
    ops.push_back({P2POp::Kind::kSend, send_first, prev, tag});
    ops.push_back({P2POp::Kind::kRecv, recv_second, prev, tag});
  }
  if (me != cp - 1) {
    ops.push_back({P2POp::Kind::kRecv, recv_first, next, tag});
    ops.push_back({P2POp::Kind::kSend, send_second, next, tag});
  }
  group->BatchSendRecv(ops);
  // The first chunk's last position: the next rank's first chunk starts the next chunk, or
  // (the last rank) its own second chunk does; the second chunk's: the previous rank's second
  // chunk, or 0 at the sequence's end (rank 0).
  const Tensor first_tail = me != cp - 1 ? k.ToHost(recv_first) : k.ToHost(send_second);
  std::memcpy(last(0), first_tail.data_as<unsigned char>(), row);
  if (me != 0) std::memcpy(last(1), k.ToHost(recv_second).data_as<unsigned char>(), row);
  return k.ToDevice(out);
}

}  // namespace mpusim
