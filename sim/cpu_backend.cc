// The CPU backend (see cpu_backend.h).
#include "sim/cpu_backend.h"

#include <mpi.h>

#include <Eigen/Core>
#include <fmt/format.h>

#include "mpi/mpi_communicator.h"
#include "sim/blas_kernels.h"

#if defined(MPUSIM_HAVE_OPENBLAS)
extern "C" char* openblas_get_config(void);
extern "C" char* openblas_get_corename(void);
extern "C" int openblas_get_num_threads(void);
#endif

namespace mpusim {

std::string CpuBackend::Describe() const {
  const std::string eigen =
      fmt::format("Eigen {}.{}.{}", EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION);
#if defined(MPUSIM_HAVE_OPENBLAS)
  // openblas_get_config: "OpenBLAS 0.3.21 NO_AFFINITY Haswell MAX_THREADS=64"; the core name
  // is the kernel set chosen at run time (OPENBLAS_CORETYPE may pin it).
  std::string config = openblas_get_config();
  const size_t second_space = config.find(' ', config.find(' ') + 1);
  if (second_space != std::string::npos) config.resize(second_space);
  // The kernels, and how they were chosen when that was not OpenBLAS's own best guess
  // (sim/blas_kernels.h).
  const std::string note = BlasKernelsNote();
  return fmt::format("{}, GEMMs through {} ({} kernels{}), {} thread per rank", eigen, config,
                     openblas_get_corename(), note.empty() ? "" : ", " + note,
                     openblas_get_num_threads());
#else
  return eigen + " (its own GEMMs; OpenBLAS was not found at build time)";
#endif
}

std::map<std::string, std::unique_ptr<Communicator>> CpuBackend::MakeGroups(
    const Topology& topology, int64_t world_rank, const std::vector<std::string>& kinds) {
  return MakeGroupCommunicators(topology, world_rank, MPI_COMM_WORLD, kinds);
}

}  // namespace mpusim
