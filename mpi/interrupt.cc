// Interrupts of a run (see interrupt.h).
#include "mpi/interrupt.h"

#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include <fmt/format.h>

#include "mpi/mpi_check.h"
#include "mpi/watchdog.h"

namespace mpusim {
namespace {

// A signal handler can reach only process-wide state, and may write only lock-free atomics of
// this kind: the first signal recorded, and whether its sender was this process's parent.
volatile sig_atomic_t recorded_signal = 0;
volatile sig_atomic_t recorded_from_parent = 0;
// Whether this process runs under mpirun (read once: getenv is not async-signal-safe). A
// process started alone has a shell or a script for its parent, not a launcher.
bool under_mpirun = false;

constexpr int kSignals[] = {SIGINT, SIGTERM};
struct sigaction previous[2];
std::atomic<bool> installed{false};

void Record(int signal, siginfo_t* info, void* /*context*/) {
  if (recorded_signal != 0) return;  // the first one says why the run stops
  // getppid is async-signal-safe; under mpirun the parent is mpirun (or Open MPI's daemon).
  recorded_from_parent =
      under_mpirun && info != nullptr && info->si_code == SI_USER && info->si_pid == getppid();
  recorded_signal = signal;
}

}  // namespace

InterruptHandlers::InterruptHandlers() {
  if (installed.exchange(true)) {
    throw std::logic_error("InterruptHandlers: already installed in this process");
  }
  recorded_signal = 0;
  recorded_from_parent = 0;
  under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  struct sigaction action = {};
  action.sa_sigaction = Record;
  sigemptyset(&action.sa_mask);
  // SA_RESTART: a system call the signal lands in (a file write, MPI's own polling) resumes
  // instead of failing with EINTR. SA_RESETHAND: a second signal of the kind ends the process.
  action.sa_flags = static_cast<int>(SA_SIGINFO | SA_RESTART | SA_RESETHAND);  // 0x80000000
  for (size_t i = 0; i < 2; ++i) sigaction(kSignals[i], &action, &previous[i]);
}

InterruptHandlers::~InterruptHandlers() {
  for (size_t i = 0; i < 2; ++i) sigaction(kSignals[i], &previous[i], nullptr);
  installed = false;
}

Interrupt LocalInterrupt() {
  Interrupt interrupt;
  interrupt.signal = recorded_signal;
  interrupt.from_launcher = recorded_signal != 0 && recorded_from_parent != 0;
  if (interrupt.signal != 0) {
    MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &interrupt.world_rank));
  }
  return interrupt;
}

Interrupt AgreeOnInterrupt() {
  // MPI_MAXLOC over (signal, from launcher) packed in one int, located at the world rank: the
  // highest wins, ties go to the lowest rank, in one all-reduce of two ints.
  struct {
    int value;
    int rank;
  } mine{0, 0}, agreed{0, 0};
  const Interrupt local = LocalInterrupt();
  mine.value = local.signal * 2 + (local.from_launcher ? 1 : 0);
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &mine.rank));
  watched::Allreduce(&mine, &agreed, 1, MPI_2INT, MPI_MAXLOC, MPI_COMM_WORLD, WorldLabel());
  Interrupt interrupt;
  if (agreed.value == 0) return interrupt;
  interrupt.signal = agreed.value / 2;
  interrupt.from_launcher = agreed.value % 2 == 1;
  interrupt.world_rank = agreed.rank;
  return interrupt;
}

int InterruptExitCode(const Interrupt& interrupt) { return 128 + interrupt.signal; }

std::string SignalName(int signal) {
  switch (signal) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    default:
      return fmt::format("signal {}", signal);
  }
}

std::string InterruptLine(const Interrupt& interrupt, const std::string& where,
                          const std::string& outputs) {
  return fmt::format("mpusim: interrupted: rank {} got {}{}; every rank stopped {}; {}; exit code "
                     "{}{}",
                     interrupt.world_rank, SignalName(interrupt.signal),
                     interrupt.from_launcher ? " from mpirun" : "", where, outputs,
                     InterruptExitCode(interrupt),
                     interrupt.from_launcher ? " (mpirun, itself interrupted, exits 1)" : "");
}

}  // namespace mpusim
