// The mpusim program: forwards to RunCli (cli.h), and turns anything nothing below expected
// into one line and a distinct exit code instead of an uncaught abort.
#include <exception>
#include <iostream>
#include <new>

#include "cli/cli.h"
#include "core/status.h"
#include "sim/blas_kernels.h"

int main(int argc, char** argv) {
  // Before anything else: it may re-execute the program with the best BLAS kernels.
  mpusim::PinBestBlasKernels(argv);
  try {
    std::vector<std::string> args(argv, argv + argc);
    return mpusim::cli::RunCli(args, std::cout, std::cerr);
  } catch (const std::bad_alloc&) {
    std::cout.flush();
    std::cerr << "error: out of memory (an allocation failed); use smaller sizes, or see "
                 "mpusim run --max-memory\n";
    return mpusim::cli::kExitOutOfMemory;
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "error: internal error: " << mpusim::EscapeControl(e.what())
              << " (please report it with the command line and config)\n";
    return mpusim::cli::kExitInternalError;
  } catch (...) {
    std::cerr << "error: internal error: an unknown exception (please report it with the "
                 "command line and config)\n";
    return mpusim::cli::kExitInternalError;
  }
}
