// main() for GoogleTest binaries that run under mpiexec (one process per simulated GPU).
//
// What it is: MPI_Init, the tests, MPI_Finalize. Only world rank 0 prints the usual
// GoogleTest report; the other ranks print nothing except their own failed assertions,
// prefixed with their rank, so a failure on one rank is never hidden. Pass/fail is
// all-reduced (MPI_LAND), so every rank exits with the same code: 0 if all ranks passed,
// 1 otherwise, and rank 0 names how many ranks failed.
// What it is not: a test fixture. Tests call collectives themselves, so every rank must run
// the same tests in the same order (do not pass rank-dependent --gtest_filter flags).
#include <mpi.h>

#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "mpi/mpi_check.h"

namespace {

// Prints failed assertions on ranks other than 0 (whose default printer already does).
// The test name is remembered in OnTestStart: UnitTest::current_test_info() would take the
// lock that GoogleTest holds while it calls OnTestPartResult.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int world_rank) : world_rank_(world_rank) {}
  void OnTestStart(const ::testing::TestInfo& test) override {
    test_name_ = std::string(test.test_suite_name()) + "." + test.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s %s:%d: Failure\n%s\n", world_rank_, test_name_.c_str(),
                 result.file_name() != nullptr ? result.file_name() : "?", result.line_number(),
                 result.message());
    std::fflush(stderr);
  }

 private:
  int world_rank_;
  std::string test_name_ = "(no test)";
};

}  // namespace

int main(int argc, char** argv) {
  MPUSIM_MPI_CHECK(MPI_Init(&argc, &argv));
  ::testing::InitGoogleTest(&argc, argv);
  int world_rank = 0;
  int world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  if (world_rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(world_rank));  // GoogleTest takes ownership
  }

  const int passed = RUN_ALL_TESTS() == 0 ? 1 : 0;
  int all_passed = 0;
  int num_passed = 0;
  MPUSIM_MPI_CHECK(MPI_Allreduce(&passed, &all_passed, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD));
  MPUSIM_MPI_CHECK(MPI_Reduce(&passed, &num_passed, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD));
  if (world_rank == 0 && all_passed == 0) {
    std::fprintf(stderr, "mpusim: tests failed on %d of %d ranks\n", world_size - num_passed,
                 world_size);
  }
  MPUSIM_MPI_CHECK(MPI_Finalize());
  return all_passed != 0 ? 0 : 1;
}
