// The Model interface: what the run driver, the check, the preflight, `mpusim explain`,
// `mpusim sweep`, the trace and the dump see of a model. The GPT model (gpt_model.h) and the
// lab's layer chain (graph.h) implement it, and BuildModel is the one place that reads which
// of the two a config describes; nothing outside the models asks which one it holds.
//
// A Model is one rank's share of the model (its chunks, parameters and stashes), built for
// the rank at `coords` of a layout. One step is Run: every micro-batch forward and backward,
// the pipeline schedule when pp > 1, and the gradient finalisation (tp, embd, and dp unless
// the distributed optimizer reduce-scatters the gradients itself); the training loop and the
// optimizer (core/train) then update TrainableParameters.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/memory_plan.h"
#include "core/model/parameter.h"
#include "core/model/record.h"
#include "core/model/step_span.h"
#include "core/rank_context.h"
#include "core/status.h"
#include "core/topology.h"

namespace mpusim {

// One row of a model's sharding map (`mpusim explain`): a parameter the pipeline stage
// `pp_rank` holds in its chunk `chunk`, and how the tp group splits it.
struct ParameterPlacement {
  std::string name;
  Shape full_shape;
  int tp_dim = -1;  // -1: replicated on every tp rank
  int64_t tp_stride = 1;
  int64_t pp_rank = 0;
  int64_t chunk = 0;
  std::string note;  // e.g. "tied: ..." for a copy of a weight another stage owns
};

// What the preflight counts (run/preflight.h).
struct MemoryPlanOptions {
  int64_t world_size = 1;  // the ranks of the job (they share the reference's work)
  bool check = true;       // add what checking the run against its float64 reference holds
  int64_t exchange_bytes = 0;  // the check's exchange buffer per rank and direction
};

class Model {
 public:
  virtual ~Model() = default;

  // Allocates this rank's parameter shards and fills them from the master values.
  virtual void InitializeParameters(RankContext& ctx) = 0;
  // One step (a training iteration): `iteration` picks the data and the random streams
  // (iteration k reads micro-batches k*M .. k*M + M - 1), so a repeated call computes the
  // same step. `record`: keep the last micro-batch's tensors for Records.
  virtual void Step(RankContext& ctx, int64_t iteration, bool record) = 0;
  // After a Step with `record`: the tensors the check and the dump compare (the last
  // micro-batch's activations and their gradients, the loss, the parameters and their
  // gradients as they are now), appended to `records`. The tensors are the model's own (no
  // copies); they stay valid until the next Step.
  virtual void Records(RankContext& ctx, std::vector<TensorRecord>* records) const = 0;
  // The parameters with a gradient (not frozen), in registration order: what the optimizer
  // updates.
  virtual std::vector<Parameter*> TrainableParameters() const = 0;

  // Whether the model ends in a loss (a chain may end in a hidden layer), and the last Step's
  // loss: the mean over all tokens of all micro-batches and dp ranks.
  virtual bool has_loss() const = 0;
  virtual double loss() const = 0;
  // The most (chunk, micro-batch) stashes live at once in the last Step.
  virtual int64_t peak_live_stashes() const = 0;
  // The last Step's forward and backward steps and when its schedule ended (before the
  // gradient finalisation).
  virtual const std::vector<StepSpan>& step_spans() const = 0;
  virtual double schedule_end() const = 0;
  // The vocabulary padded for this layout (0 when the model has none).
  virtual int64_t padded_vocab_size() const = 0;

  // The model as `mpusim run` describes it under the layout: lines ending in '\n'.
  virtual std::string Describe() const = 0;
  // The whole model's parameters (every stage's, each once), in the model's order.
  virtual std::vector<ParameterPlacement> ShardingMap() const = 0;
  // How the layout splits the parameters, for the run's parameter-memory line ("" : the
  // model prints none).
  virtual std::string ParameterSplitNote() const = 0;
  // `mpusim explain`'s account of the model: every parameter, its split and this layout's
  // pieces, in the model's own notation.
  virtual void Explain(std::ostream& out) const = 0;
  // Plan-time warnings, one line each (empty when there are none).
  virtual std::vector<std::string> Warnings() const = 0;
  // Whether dropout masks depend on the layout (drawn from each rank's RNG tracker, as
  // Megatron draws them), so that the same config's losses differ between layouts.
  virtual bool MasksDependOnLayout() const = 0;
  // The tensors this rank will hold, counted before anything is allocated.
  virtual MemoryPlan PlanMemory(const MemoryPlanOptions& options) const = 0;
};

// Builds the model `config` describes ("model": a GPT or a layer chain) for the rank at
// `coords` of `topology`, checking it against the layout; errors name the field and say what
// is allowed. `config.run` must be set. `topology` must outlive the model.
StatusOr<std::unique_ptr<Model>> BuildModel(const Config& config, const Topology& topology,
                                            const RankCoordinates& coords);

}  // namespace mpusim
