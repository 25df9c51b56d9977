// The CPU backend (see cpu_backend.h).
#include "sim/cpu_backend.h"

#include <mpi.h>

#include "mpi/mpi_communicator.h"

namespace mpusim {

std::map<std::string, std::unique_ptr<Communicator>> CpuBackend::MakeGroups(
    const Topology& topology, int64_t world_rank, const std::vector<std::string>& kinds) {
  return MakeGroupCommunicators(topology, world_rank, MPI_COMM_WORLD, kinds);
}

}  // namespace mpusim
