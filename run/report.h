// What rank 0 prints of a run of `mpusim run` (the layout, the model, the training table, the
// check's table, the collectives, parameter and process memory) and the files it writes on
// request: --summary (the results as JSON) and --trace (the last step as Chrome trace events,
// or a page that draws them). Every other rank prints into a stream nobody reads, so all
// ranks take part in the collective parts (PrintMemory).
#pragma once

#include <ostream>
#include <string>
#include <utility>

#include "core/communicator.h"
#include "core/config/config.h"
#include "core/memory_plan.h"
#include "core/schedule.h"
#include "core/status.h"
#include "core/topology.h"
#include "run/check.h"
#include "run/runner.h"
#include "run/simulate.h"

namespace mpusim::run {

class RunReport {
 public:
  // `effective_config`: `config` as JSON (EffectiveConfigJson), for the summary.
  RunReport(std::ostream& out, const RunOptions& options, const Config& config,
            const nlohmann::json& effective_config, int world_rank, int world_size,
            std::string backend_name, std::string backend_description)
      : out_(out),
        options_(options),
        config_(config),
        effective_config_(effective_config),
        world_rank_(world_rank),
        world_size_(world_size),
        backend_name_(std::move(backend_name)),
        backend_description_(std::move(backend_description)) {}

  // The run's header: config, backend, layout and groups, data, the pipeline's stages, the
  // model (Model::Describe).
  void PrintLayout(const Topology& topology, const SimulationResult& result);
  // The loss, and with --repeat the step times.
  void PrintLoss(const SimulationResult& result);
  // The per-iteration table of a training run, with the reference's losses when checked;
  // returns how many iterations fail the loss tensor's tolerance.
  int PrintTraining(const SimulationResult& result);
  // The check's table; returns how many tensors fail.
  int PrintChecks(const CheckResult& check, const SimulationResult& result);
  // The collectives of rank 0, summed by phase, site, op and group.
  void PrintCommTrace(const CommTrace& trace);
  // This rank's parameters against the whole model's (when the model says how they split).
  void PrintParameterMemory(const SimulationResult& result);
  // Collective over MPI_COMM_WORLD: peak RSS and PSS of the job next to the preflight's
  // per-rank estimate.
  void PrintTensorBytes(const SimulationResult& result);
  // The models' step notes (SimulationResult::step_notes), when there are any.
  void PrintStepNotes(const SimulationResult& result);
  void PrintMemory(PlanBytes preflight_bytes);
  // --summary FILE: the results as JSON (`code`: the run's exit code, 0 passed); --trace
  // FILE: the last step's trace (rank 0).
  Status WriteSummary(const SimulationResult& result, int code);
  Status WriteTrace(const Topology& topology, const SimulationResult& result);

 private:
  void PrintStages(const SimulationResult& result, const PipelineSchedule& schedule);

  std::ostream& out_;
  const RunOptions& options_;
  const Config& config_;
  const nlohmann::json& effective_config_;
  int world_rank_;
  int world_size_;
  std::string backend_name_;
  std::string backend_description_;
};

}  // namespace mpusim::run
