// The Model interface: what the run driver, the check, the preflight, `mpusim explain`,
// `mpusim sweep`, the trace and the dump see of a model. The GPT model (gpt_model.h) and the
// lab's layer chain (graph.h) implement it, and BuildModel is the one place that reads which
// of the two a config describes; nothing outside the models asks which one it holds.
//
// A Model is one rank's share of the model (its chunks and parameters), built for the rank at
// `coords` of a layout. It is a StagedModel (core/pipeline/executor.h): the forward and the
// backward of one (chunk, micro-batch) over a stash the executor owns. The executor walks the
// schedule; core/train runs a step (RunStep: the gradient finalisation too) and the training
// loop with the optimizer over TrainableParameters.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/memory_plan.h"
#include "core/model/fully_shard.h"
#include "core/model/parameter.h"
#include "core/model/record.h"
#include "core/pipeline/executor.h"
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
  bool over_etp = false;  // split over expt_tp (etp ranks, by their etp coordinate), not tp
  int64_t ep_rank = -1;   // an expert's weight: the ep rank holding it (-1: every ep rank)
};

// A parameter this rank will hold, as the model is built (before InitializeParameters
// allocates anything): what core/estimate counts.
struct HeldParameterShape {
  std::string name;
  Shape local_shape;       // this rank's piece (its tp or etp split)
  bool trainable = true;   // has a main_grad and optimizer state (not frozen)
  bool expert = false;     // an expert's, laid out apart (Parameter::expert): the distributed
                           // optimizer keeps it in the experts' buffer
};

// One MoE layer's routing over a training step (Model::ExpertLoads): this rank's kept
// choices per expert, summed over the step's micro-batches (Megatron's router's
// local_tokens_per_expert, which finalize_model_grads sums over tp x dp x cp for the expert
// bias's update), and with moe_router_enable_expert_bias the bias after the step's update.
struct ExpertLoad {
  int64_t layer = 0;  // the decoder layer, from 0; multi-token prediction depth k: num_layers + k
  std::vector<int64_t> tokens;  // [E]
  std::vector<float> bias;      // [E]; empty without the expert bias
};

// What the preflight counts (run/preflight.h).
struct MemoryPlanOptions {
  int64_t world_size = 1;  // the ranks of the job (they share the reference's work)
  bool check = true;       // add what checking the run against its float64 reference holds
  int64_t exchange_bytes = 0;  // the check's exchange buffer per rank and direction
};

class Model : public StagedModel {
 public:
  // Allocates this rank's parameter shards and fills them from the master values.
  virtual void InitializeParameters(RankContext& ctx) = 0;
  // The ends of one step (core/train RunStep runs it: BeginStep, the executor's walk of the
  // schedule over the StagedModel steps, the gradient finalisation, EndStep). `iteration`
  // picks the data and the random streams (iteration k reads micro-batches k*M .. k*M + M -
  // 1), so a repeated step computes the same; BeginStep zeroes the gradients and the loss.
  // `record`: keep the last micro-batch's tensors for Records. EndStep reduces the loss
  // over the stages and the data-parallel ranks.
  virtual void BeginStep(RankContext& ctx, int64_t iteration, bool record) = 0;
  virtual void EndStep(RankContext& ctx) = 0;
  // After a step with `record`: the tensors the check and the dump compare (the last
  // micro-batch's activations and their gradients, the loss, the parameters and their
  // gradients as they are now), appended to `records`. The tensors are the model's own (no
  // copies); they stay valid until the next step.
  virtual void Records(RankContext& ctx, std::vector<TensorRecord>* records) const = 0;
  // The parameters with a gradient (not frozen), in registration order: what the gradient
  // finalisation reduces and the optimizer updates.
  virtual std::vector<Parameter*> TrainableParameters() const = 0;
  // Every parameter this rank holds once InitializeParameters has run, frozen ones and a
  // tied copy included, each once (empty before it runs): what `mpusim run` measures.
  virtual std::vector<const Parameter*> HeldParameters() const = 0;
  // The same parameters as the built model plans them, before anything is allocated.
  virtual std::vector<HeldParameterShape> HeldParameterShapes() const = 0;

  // Whether the model ends in a loss (a chain may end in a hidden layer), and the last step's
  // loss: the mean over all tokens of all micro-batches and dp ranks.
  virtual bool has_loss() const = 0;
  virtual double loss() const = 0;
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
  // Lines this rank adds to the run's report after its steps (an MoE model: the tokens its
  // experts received in the last forward); none by default.
  virtual std::vector<std::string> StepNotes() const { return {}; }
  // After each training iteration's optimizer step (core/train Train): state that is not a
  // parameter but moves with training (an MoE router's expert bias); none by default.
  virtual void AfterOptimizerStep(RankContext& /*ctx*/) {}
  // With optimizer.use_torch_fsdp2, once InitializeParameters has run: the model's fully_shard
  // units (core/model/fully_shard.h), whose sharded parameters are what the gradient
  // finalisation and the optimizer see; null otherwise.
  virtual FullyShard* fully_shard() const { return nullptr; }
  // With optimizer.use_torch_fsdp2: the modules fully_shard wraps, as the model is built for
  // this rank (before anything is allocated): what InitializeParameters shards and `mpusim
  // explain` prints. Empty otherwise.
  virtual std::vector<FullyShardUnitPlan> FullyShardUnits() const { return {}; }
  // After a step (and AfterOptimizerStep): the MoE layers this rank holds, each once, in
  // layer order; none by default.
  virtual std::vector<ExpertLoad> ExpertLoads() const { return {}; }
};

// Builds the model `config` describes ("model": a GPT or a layer chain) for the rank at
// `coords` of `topology`, checking it against the layout; errors name the field and say what
// is allowed. `config.run` must be set. `topology` must outlive the model.
StatusOr<std::unique_ptr<Model>> BuildModel(const Config& config, const Topology& topology,
                                            const RankCoordinates& coords);

// Whether the config file at `path` by itself parses, lays out (Topology::Create) and, when it
// has a model and a run section, builds its model on its first rank: what the command line's
// overrides are blamed for when the file alone is valid and the file with them is not.
bool ConfigFileIsValid(const std::string& path);

}  // namespace mpusim
