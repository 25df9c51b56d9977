// `mpusim run`: every MPI rank plays one GPU and runs the model (core/model/model.h: the GPT or
// the lab's layer chain) on a Backend; the job then checks every tensor against the float64
// reference (run/check.h) and may dump them (run/dump.h).
//
// What it is: the driver: MPI start-up, the config and the world size, the preflight
// (run/preflight.h), the backend (the CPU backend or a plugin, through a factory), the run
// (run/simulate.h), the report rank 0 prints (run/report.h) and the dump. Exit codes: 0 all
// checks passed, 1 a check failed, 2 bad input, 3 out of memory, 4 an internal error, 130 / 143
// interrupted by SIGINT / SIGTERM (mpi/interrupt.h: every rank stops at the next safe point,
// rank 0 prints one line, nothing is written).
// What it is not: the layer logic (core/model), the reference (reference/) or a backend.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/status.h"
#include "run/simulate.h"

namespace mpusim::run {

struct RunOptions {
  std::string config_path;
  // The command line as typed, shell-quoted (cli/cli.h ShellCommandLine); the dump and the
  // summary record it.
  std::string command_line;
  std::string dump_dir;  // empty: no dump
  std::string summary_path;  // empty: none; else rank 0 writes the run's results as JSON
  std::string trace_path;    // empty: none; else rank 0 writes the last step's Chrome trace
  // Config keys set on the command line over the file's: (flag, "section.key", JSON text,
  // the value as typed; empty for a bare flag such as --sp).
  struct Override {
    std::string flag, key, value, typed;
  };
  std::vector<Override> overrides;
  bool check = true;     // compare with the float64 reference
  // Check against the stored reference in this folder instead of computing it (--reference;
  // run/stored_reference.h).
  std::string reference_dir;
  // `mpusim reference --out DIR`: compute the reference alone and store it in this folder;
  // the model is not run.
  std::string store_reference_dir;
  int repeat = 1;        // run the step this many times and report timings (benchmarks)
  std::string backend = "cpu";  // "cpu" or a plugin's name ("cuda")
  std::string comm = "nccl";    // cuda backend: "nccl" or "mpi" (host-staged)
  // How long one collective or point-to-point call may wait before the job is aborted
  // (mpi/watchdog.h; also the NCCL timeout of the cuda backend); > 0. The default, 30
  // minutes, is torch.distributed's default process-group timeout.
  double timeout_s = 1800;
  // The preflight's per-rank memory limit in bytes (run/preflight.h); 0: the machine's
  // available memory divided by the ranks on this node.
  uint64_t max_memory_bytes = 0;
};

// Makes this rank's backend once MPI is running; errors are reported like bad input.
using BackendFactory = std::function<BackendOrStatus(const RunOptions&)>;

// Initialises MPI if needed (finalises it if it did), runs, and returns the exit code every
// rank agrees on: 0 all checks passed, 1 a check failed, 2 bad input, 128 + the signal when
// interrupted. Only rank 0 prints. SIGINT and SIGTERM are handled while it runs.
int RunSimulation(const RunOptions& options, std::ostream& out, std::ostream& err,
                  const BackendFactory& factory);

}  // namespace mpusim::run