// This process's rank and the number of ranks in MPI_COMM_WORLD, for the tests that run
// under mpiexec (mpi_tests).
#pragma once

#include <mpi.h>

#include "mpi/mpi_check.h"

namespace mpusim {

inline int WorldRank() {
  int rank = 0;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}

inline int WorldSize() {
  int size = 0;
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  return size;
}

}  // namespace mpusim
