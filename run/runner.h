// `mpusim run`: every MPI rank plays one GPU, runs the layer graph (core/model/graph) with Eigen
// kernels and MPI collectives, and checks its tensors against the float64 reference model.
//
// What it is: the simulator's driver: MPI start-up, world-size check, groups from the
// planner, the run, the per-tensor check (errors reduced over ranks, printed by rank 0), the
// comm trace summary and the optional dump.
// What it is not: the layer logic (core/model/graph) or the reference (reference/reference_model).
#pragma once

#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/communicator.h"
#include "core/config.h"
#include "core/model/graph.h"
#include "core/status.h"

namespace mpusim::run {

// One tensor's comparison with the reference, reduced over all ranks.
struct TensorCheck {
  std::string name;
  Shape full_shape;
  double max_abs = 0;
  double max_rel = 0;
  double scale = 0;       // max |expected| over the full tensor
  double normalized = 0;  // max_abs / scale (0 when the tensor is all zeros)
  int64_t count = 0;
  int64_t mismatches = 0;
  int64_t non_finite = 0;
  bool missing = false;  // the reference has no tensor of this name and shape
  bool ok() const { return !missing && mismatches == 0; }
};

struct SimulationResult {
  RankCoordinates coords;             // this rank's place in the layout
  std::vector<TensorRecord> records;  // this rank's tensors, host copies
  std::vector<TensorCheck> checks;    // empty without the check
  bool has_loss = false;
  double loss = 0;
  double reference_loss = 0;
  CommTrace trace;                    // this rank's collectives (the last repetition)
  std::vector<double> seconds;        // wall time of each repetition
  int64_t padded_vocab_size = 0;
  std::vector<Graph::PlannedLayer> plan;  // as seen by rank 0's coordinates
};

// Runs `config` on MPI_COMM_WORLD (collective: every rank calls it with the same config;
// the world size must equal parallel.world_size). Bad configs give a Status on every rank.
StatusOr<SimulationResult> Simulate(const Config& config, bool check, int repeat,
                                    Backend& backend);

struct RunOptions {
  std::string config_path;
  std::string dump_dir;  // empty: no dump
  bool check = true;     // compare with the float64 reference
  int repeat = 1;        // run the step this many times and report timings (benchmarks)
  std::string backend = "cpu";  // "cpu" or "cuda"
  std::string comm = "nccl";    // cuda backend: "nccl" or "mpi" (host-staged)
};

// Makes this rank's backend once MPI is running; errors are reported like bad input.
using BackendFactory = std::function<StatusOr<std::unique_ptr<Backend>>(const RunOptions&)>;

// Initialises MPI if needed (finalises it if it did), runs, and returns the exit code every
// rank agrees on: 0 all checks passed, 1 a check failed, 2 bad input. Only rank 0 prints.
int RunSimulation(const RunOptions& options, std::ostream& out, std::ostream& err,
                  const BackendFactory& factory);

}  // namespace mpusim::run
