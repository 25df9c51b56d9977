// The floor of every MPI job: MPI_Init, one barrier, MPI_Finalize and nothing else. The scale
// benchmark (bench/scale_bench.py) runs it beside `mpusim run` on the same number of ranks,
// so that the time Open MPI itself needs to start K processes is visible.
#include <mpi.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Finalize();
  return 0;
}
