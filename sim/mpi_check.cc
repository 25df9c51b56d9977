// MPI error reporting (see mpi_check.h).
#include "sim/mpi_check.h"

#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

namespace mpusim {
namespace {

bool MpiRunning() {
  int initialized = 0;
  int finalized = 0;
  // These two may be called at any time, even before MPI_Init; their results are not
  // checked because checking would recurse into MpiFatal.
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized != 0 && finalized == 0;
}

}  // namespace

std::string MpiErrorMessage(const char* statement, int error_code, const char* file, int line,
                            const char* function) {
  int world_rank = -1;
  std::string host = "?";
  if (MpiRunning()) {
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    if (MPI_Get_processor_name(name, &length) == MPI_SUCCESS) host.assign(name, name + length);
  }
  std::string message = fmt::format("MPI error code {}", error_code);
  char text[MPI_MAX_ERROR_STRING] = {};
  int text_length = 0;
  if (MPI_Error_string(error_code, text, &text_length) == MPI_SUCCESS) {
    message.assign(text, text + text_length);
  }
  return fmt::format("mpusim: MPI error on rank {} (host {}): {} failed at {}:{} in {}: {}",
                     world_rank, host, statement, file, line, function, message);
}

void MpiFatal(const char* statement, int error_code, const char* file, int line,
              const char* function) {
  const std::string message = MpiErrorMessage(statement, error_code, file, line, function);
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  if (MpiRunning()) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

void SetErrorsReturn(MPI_Comm comm) {
  MPUSIM_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
}

}  // namespace mpusim
