// A helper program of the fault tests (fault_test.cc): pairs of ranks exchanging messages
// through MpiCommunicator::Send / Recv under the watchdog, so that MPUSIM_FAULT can stop a
// rank in the middle of point-to-point traffic.
//
// What it is: `mpiexec -n K fault_p2p_helper TIMEOUT_S ELEMENTS ROUNDS [batch]`: world ranks
// 2g and 2g + 1 exchange ROUNDS float32 messages of ELEMENTS elements (the even rank sends
// first; with "batch" each round is one BatchSendRecv of the send and the receive, as
// pipeline stages exchange), check every one, then end with FinalizeWatched. Exit codes: 0 every
// message arrived intact, 1 one did not, 2 bad arguments or a malformed MPUSIM_FAULT. A few
// elements travel eagerly (Send returns before the peer receives); 1 << 17 and more use the
// rendezvous protocol (Send waits for the peer's Recv). What it is not: a benchmark or a test by
// itself (it names no expected failure).
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string_view>

#include "core/status.h"
#include "core/tensor.h"
#include "mpi/mpi_check.h"
#include "mpi/mpi_communicator.h"
#include "mpi/watchdog.h"

namespace mpusim {
namespace {

// What rank q sends in round `round`: distinct small integers (exact in float32).
float ValueAt(int q, int round, int64_t e) {
  return static_cast<float>(100000 * q + 1000 * round + e % 1000);
}

int Exchange(int64_t elements, int rounds, bool batch) {
  std::unique_ptr<MpiCommunicator> world = MpiCommunicator::World();
  const int rank = world->Rank();
  const int partner = rank ^ 1;
  if (partner >= world->Size()) return 0;  // an odd last rank has no partner
  int wrong = 0;
  for (int round = 0; round < rounds; ++round) {
    Tensor mine = Tensor::HostEmpty({elements}, DType::kFloat32);
    for (int64_t e = 0; e < elements; ++e) mine.data_as<float>()[e] = ValueAt(rank, round, e);
    Tensor got = Tensor::HostZeros({elements}, DType::kFloat32);
    if (batch) {
      world->BatchSendRecv(
          {{P2POp::Kind::kSend, mine, partner}, {P2POp::Kind::kRecv, got, partner}});
    } else if (rank % 2 == 0) {
      world->Send(mine, partner);
      world->Recv(got, partner);
    } else {
      world->Recv(got, partner);
      world->Send(mine, partner);
    }
    for (int64_t e = 0; e < elements; ++e) {
      if (got.data_as<float>()[e] != ValueAt(partner, round, e)) ++wrong;
    }
  }
  if (wrong > 0)
    std::fprintf(stderr, "fault_p2p_helper: rank %d: %d wrong elements\n", rank, wrong);
  return wrong > 0 ? 1 : 0;
}

}  // namespace
}  // namespace mpusim

int main(int argc, char** argv) {
  MPUSIM_MPI_CHECK(MPI_Init(&argc, &argv));
  const bool batch = argc == 5 && std::string_view(argv[4]) == "batch";
  if ((argc != 4 && !batch) || std::atof(argv[1]) <= 0 || std::atoll(argv[2]) < 1 ||
      std::atoi(argv[3]) < 1) {
    std::fprintf(stderr, "usage: fault_p2p_helper TIMEOUT_S ELEMENTS ROUNDS [batch]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  mpusim::SetCommTimeout(std::atof(argv[1]));
  const mpusim::Status fault = mpusim::ArmFaultInjection();
  if (!fault.ok()) {
    std::fprintf(stderr, "error: %s\n", fault.Message().c_str());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const int code = mpusim::Exchange(std::atoll(argv[2]), std::atoi(argv[3]), batch);
  mpusim::FinalizeWatched();
  return code;
}
