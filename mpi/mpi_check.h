// MPUSIM_MPI_CHECK: every MPI call of the simulator goes through it.
//
// What it is: a check that turns a failed MPI call into one line naming the rank, the host,
// the statement, file:line and MPI's own error string, and then aborts the whole job with
// MPI_Abort, so a failed collective never leaves the other ranks hanging.
// What it is not: useful on a communicator whose error handler is MPI_ERRORS_ARE_FATAL (the
// default), because MPI aborts before returning an error code. Every communicator mpusim
// creates therefore gets MPI_ERRORS_RETURN (see SetErrorsReturn).
#pragma once

#include <mpi.h>

#include <string>

namespace mpusim {

// The line MpiFatal prints, without the trailing newline:
//   mpusim: MPI error on rank R (host H): STATEMENT failed at FILE:LINE in FUNCTION: MESSAGE
// R is the rank in MPI_COMM_WORLD (-1 before MPI_Init or after MPI_Finalize) and MESSAGE is
// MPI_Error_string(error_code).
std::string MpiErrorMessage(const char* statement, int error_code, const char* file, int line,
                            const char* function);

// Prints MpiErrorMessage to stderr, then calls MPI_Abort(MPI_COMM_WORLD, 1); std::abort()
// if MPI is not running.
[[noreturn]] void MpiFatal(const char* statement, int error_code, const char* file, int line,
                           const char* function);

// Where this process runs, for fatal-error lines: its rank in MPI_COMM_WORLD (-1 when MPI is
// not running) and its host name.
struct ProcessPlace {
  int world_rank = -1;
  std::string host = "?";
};
ProcessPlace WhereAmI();

// Prints `line` to stderr (control characters escaped), then ends the whole job:
// MPI_Abort(MPI_COMM_WORLD, exit_code) when MPI is running (so no rank is left waiting in a
// collective; mpirun exits with that code), std::abort otherwise.
[[noreturn]] void AbortJob(const std::string& line, int exit_code = 1);

// Makes MPI return error codes on `comm` instead of aborting inside the library, so that
// MPUSIM_MPI_CHECK sees them.
void SetErrorsReturn(MPI_Comm comm);

}  // namespace mpusim

#define MPUSIM_MPI_CHECK(expr)                                                   \
  do {                                                                           \
    const int mpusim_mpi_code_ = (expr);                                         \
    if (mpusim_mpi_code_ != MPI_SUCCESS) {                                       \
      ::mpusim::MpiFatal(#expr, mpusim_mpi_code_, __FILE__, __LINE__, __func__); \
    }                                                                            \
  } while (0)
