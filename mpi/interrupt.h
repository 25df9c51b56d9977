// Interrupts of a run (SIGINT, SIGTERM): noticed at once, acted on together at safe points.
//
// What it is: InterruptHandlers installs, for its lifetime, handlers for SIGINT and SIGTERM
// that only record the signal (in sig_atomic_t flags: nothing more is async-signal-safe), and
// AgreeOnInterrupt is the collective with which every rank learns, at a safe point of the run,
// whether any rank got one. The rank that got it keeps running until then, so no rank is left
// waiting for it in a collective; at the safe point every rank stops together, the job ends
// cleanly (MPI_Finalize) and each rank exits with 128 + the signal (130 SIGINT, 143 SIGTERM),
// which mpirun passes on when the signal reached the ranks (kill to their processes, a batch
// system's scancel). Each handler is one-shot (SA_RESETHAND): a second signal of the same kind
// takes its default action and ends the process at once.
// What it is not: a way to stop inside an iteration (between two safe points a rank only
// records the signal), or control over mpirun: Open MPI's mpirun, itself sent SIGINT or
// SIGTERM, sends SIGTERM to every rank, kills them 1 s later (odls_base_sigkill_timeout) and
// exits 1 whatever they return (docs/reliability.md, "Interrupts").
#pragma once

#include <string>

namespace mpusim {

// A signal some rank got: the highest signal number any rank got (0: none), the lowest world
// rank that got it, and whether that rank runs under Open MPI's mpirun and its sender was its
// parent process (mpirun, or Open MPI's daemon on another node).
struct Interrupt {
  int signal = 0;
  int world_rank = -1;
  bool from_launcher = false;
  explicit operator bool() const { return signal != 0; }
};

// For its lifetime, SIGINT and SIGTERM are recorded instead of ending the process; the previous
// handlers come back with its destruction. One at a time per process.
class InterruptHandlers {
 public:
  InterruptHandlers();
  ~InterruptHandlers();
  InterruptHandlers(const InterruptHandlers&) = delete;
  InterruptHandlers& operator=(const InterruptHandlers&) = delete;
};

// This process's recorded signal (local, no communication); 0 when none came.
Interrupt LocalInterrupt();

// Collective over MPI_COMM_WORLD (one watched all-reduce): the interrupt any rank recorded.
Interrupt AgreeOnInterrupt();

// 128 + the signal number, the shell's code for a process ended by that signal.
int InterruptExitCode(const Interrupt& interrupt);

// "SIGINT", "SIGTERM", else "signal N".
std::string SignalName(int signal);

// The one line a run prints when it stops for `interrupt` at `where` ("after iteration 3 of
// 10"), with what it did and did not write (`outputs`):
//   mpusim: interrupted: rank 2 got SIGINT; every rank stopped after iteration 3 of 10; OUTPUTS;
//   exit code 130
// When the sender was mpirun, the line says that mpirun itself exits 1.
std::string InterruptLine(const Interrupt& interrupt, const std::string& where,
                          const std::string& outputs);

}  // namespace mpusim
