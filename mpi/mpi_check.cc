// MPI error reporting (see mpi_check.h).
#include "mpi/mpi_check.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

#include "core/status.h"

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

ProcessPlace WhereAmI() {
  ProcessPlace place;
  if (MpiRunning()) {
    MPI_Comm_rank(MPI_COMM_WORLD, &place.world_rank);
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    if (MPI_Get_processor_name(name, &length) == MPI_SUCCESS) {
      place.host.assign(name, name + length);
    }
  } else {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) == 0) place.host = name;
  }
  return place;
}

void AbortJob(const std::string& line, int exit_code) {
  std::fprintf(stderr, "%s\n", EscapeControl(line).c_str());
  std::fflush(stderr);
  if (MpiRunning()) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::abort();
}

std::string MpiErrorMessage(const char* statement, int error_code, const char* file, int line,
                            const char* function) {
  const ProcessPlace place = WhereAmI();
  std::string message = fmt::format("MPI error code {}", error_code);
  char text[MPI_MAX_ERROR_STRING] = {};
  int text_length = 0;
  if (MPI_Error_string(error_code, text, &text_length) == MPI_SUCCESS) {
    message.assign(text, text + text_length);
  }
  return fmt::format("mpusim: MPI error on rank {} (host {}): {} failed at {}:{} in {}: {}",
                     place.world_rank, place.host, statement, file, line, function, message);
}

void MpiFatal(const char* statement, int error_code, const char* file, int line,
              const char* function) {
  AbortJob(MpiErrorMessage(statement, error_code, file, line, function));
}

void SetErrorsReturn(MPI_Comm comm) {
  MPUSIM_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
}

}  // namespace mpusim
