// The float64 reference of a model, one contract for every model: what `mpusim run`'s check
// (run/check.h) computes and compares with, whichever model the config holds.
//
// What it is: the whole (unpartitioned) model, forward and backward in float64, computed on
// one slice of the global batch per call, with each tensor saying how its value covers the
// full tensor (the slicing rule below) and what error a correct run may make in it (its
// ErrorBudget, core/dump/compare.h). BuildReference(config) gives the reference of the
// model a config describes, as BuildModel(config) gives the executor's model
// (core/model/model.h); the layer chain's reference is reference/reference_model.h, the
// GPT's reference/gpt_reference.h.
// What it is not: a second executor. It shares no op code with core/model (its CMake
// target cannot link it); only the definitions of the inputs are shared.
//
// The slicing rule. A reference splits the work of one micro-batch into `units`, and a slice
// [begin, end) of them is what one call computes for every micro-batch:
//   the layer chain: token rows (row r = i*B + g: position i of global sample g; every op of
//     the chain treats rows independently);
//   the GPT: samples (attention mixes the positions of a sample).
// A tensor's value is then the whole tensor (Layout::kWhole: parameters, their gradients,
// the loss), the slice's rows of its [s*B, width] view (kRows), or the slice's samples along
// dimension `batch_dim` (kSamples). Shares (`partial`) add up over the slices of a partition
// of the units to the full value.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/dump/compare.h"
#include "core/init.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/topology.h"

namespace mpusim {

// Units [begin, end) of each micro-batch; end -1: to the last.
struct ReferenceSlice {
  int64_t begin = 0;
  int64_t end = -1;
};

struct ReferenceTensor {
  enum class Layout : uint8_t {
    kWhole,    // value: the whole tensor, of full_shape
    kRows,     // value: the slice's rows of the [s*B, width] view of full_shape
    kSamples,  // value: full_shape with dimension batch_dim cut to the slice's samples
  };
  std::string name;
  Shape full_shape;
  Layout layout = Layout::kWhole;
  int batch_dim = -1;    // kSamples: the dimension that holds the samples
  bool partial = false;  // kWhole: this slice's share of a sum over all units
  Tensor value;          // host float64
  ErrorBudget budget;    // zero for exact data (token ids): compared for equality
  // For training: a trained parameter's master value, or the gradient of the parameter
  // named `gradient_of` (a partial whole tensor).
  bool parameter = false;
  std::string gradient_of;
  // Elements per row of the [s*B, width] view (kRows).
  int64_t width() const { return full_shape.size() > 2 ? full_shape[2] : 1; }
};

struct ReferenceResult {
  std::vector<ReferenceTensor> tensors;  // in the executor's record order
  int64_t units = 0;                     // units of one micro-batch
  int64_t slice_begin = 0;               // this slice
  int64_t slice_end = 0;
  bool has_loss = false;
  double loss = 0.0;  // this slice's share of the mean token loss (the loss for a whole run)
  // Mixture of experts: the slice's share of the auxiliary objective (load-balancing and z
  // losses, scaled as their gradients are; reference/moe_reference.h), all micro-batches.
  double moe_aux_objective = 0.0;

  // The tensor named `name`, or nullptr.
  const ReferenceTensor* Find(std::string_view name) const;
};

// A master parameter the reference starts from: name, full shape and init, so that a caller
// can generate the values once for several slices (the check splits the generation over the
// ranks) and pass them as overrides.
struct ReferenceParameter {
  std::string name;
  Shape shape;
  InitSpec init;
};

// What one call computes.
struct ReferenceRequest {
  ReferenceSlice slice;
  // Training iteration k: its micro-batch m is global micro-batch k*M + m (data and dropout
  // streams continue after k iterations' draws).
  int64_t iteration = 0;
  // Full host float64 tensors that replace parameters' master values, used as they are (not
  // copied; the reference never writes a parameter). An unknown name or a wrong shape is an
  // error.
  const std::map<std::string, Tensor>* parameter_overrides = nullptr;
};

// How the ranks of a job share the reference: the ranks of one group together compute every
// unit once (their slices, in `index` order, partition the units), so the slices' shares are
// summed over a group; every group computes the same.
struct ReferenceSplit {
  ReferenceSlice slice;  // this rank's
  int group = 0;
  int index = 0;  // this rank's place in its group
  int group_size = 1;
};

class Reference {
 public:
  virtual ~Reference() = default;

  // Units of one micro-batch, and what one is ("token rows", "samples").
  virtual int64_t Units() const = 0;
  virtual std::string_view UnitName() const = 0;
  // Token rows in one unit (1 for rows, seq_length for samples): for the memory report.
  virtual int64_t RowsPerUnit() const = 0;
  // The share of the rank at `coords` (world rank `world_rank` of `world_size`).
  virtual ReferenceSplit SplitFor(const RankCoordinates& coords, int world_rank,
                                  int world_size) const = 0;
  // The master parameters, for generating them once (ReferenceParameter).
  virtual StatusOr<std::vector<ReferenceParameter>> Parameters() const = 0;
  // The reference on one slice. Anything it cannot give a meaning to is a Status error,
  // never a crash. GEMMs run on one BLAS thread (each MPI rank is one core).
  virtual StatusOr<ReferenceResult> Run(const ReferenceRequest& request) const = 0;
  // What the check's header says of the split ("split over 4 ranks by token rows") and of
  // the budgets ("grows with the tensor's reduction lengths").
  virtual std::string SplitText(int world_size) const = 0;
  virtual std::string_view BudgetText() const = 0;
  // What of the layout the reference's values depend on (the data per micro-batch, the padded
  // vocabulary, a layout's dropout masks or routing groups): two runs whose model, data and
  // training agree and whose LayoutIdentity is equal have the same reference values, so one
  // stored reference serves both (run/stored_reference.h). Tolerances are not values: they
  // are each run's own.
  virtual nlohmann::json LayoutIdentity() const = 0;
  // State that moves with training but is no parameter (an MoE router's expert bias), once
  // iteration k's shares are summed: `result` brought to what the step leaves (`trained`: an
  // optimizer step ran) with the step's helper tensors removed, and `state` the values the
  // next iteration reads (with the parameters, as overrides). Nothing by default.
  virtual void FinishIteration(ReferenceResult& /*result*/, bool /*trained*/,
                               std::map<std::string, Tensor>* /*state*/) const {}
};

// The reference of the model `config` describes (its model section resolved for the layout,
// as the executor resolves it), or the Status of a config it cannot run.
StatusOr<std::unique_ptr<Reference>> BuildReference(const Config& config);

}  // namespace mpusim
