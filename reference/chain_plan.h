// The layer chain's plan for the float64 reference (reference_model.h): each layer's widths,
// weights, bias and dropout stream, checked against the config and the layout, written from
// docs/simulator.md only. Shared by reference_model.cc (which runs the plan) and
// chain_plan.cc (which builds it); not an interface of its own.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/status.h"
#include "reference/tracker_draws.h"

namespace mpusim::chain_reference {

// The parallel state of an activation (docs/simulator.md, "Parallel states of an
// activation"). The full-model values never depend on it; only the dropout masks do,
// because each mask element is drawn by the rank that holds it.
enum class StateKind : uint8_t {
  kTokens,
  kReplicated,
  kHiddenSplit,
  kSequenceSplit,
  kPartialSum,
  kLoss,
};

struct ActState {
  StateKind kind = StateKind::kReplicated;
  int64_t stride = 1;  // kHiddenSplit: the stride of the layer that produced it
};

struct Sizes {
  uint64_t seed = 0;
  int64_t tp_size = 1;                  // t
  int64_t pp_size = 1;                  // p: pipeline stages (only dropout masks see them)
  int64_t dp_size = 1;                  // d
  int64_t seq = 0;                      // s
  int64_t micro = 0;                    // b
  int64_t batch = 0;                    // B = b*d
  int64_t num_micro = 0;                // M
  int64_t vocab = 0;                    // vocab_size (0: not given)
  std::optional<int64_t> padded_vocab;  // Vp, when vocab_size is given
};

struct LayerPlan {
  const LayerConfig* config = nullptr;
  std::string where;      // "model.layers[i]"
  int64_t in_width = 0;   // 0 for embeddings (they read tokens)
  int64_t out_width = 0;  // 0 for the loss (it writes one value per token)
  // Weight: the layer whose weight this one multiplies by (itself for an owner, the
  // weight_from layer for a borrower, -1 without a weight).
  int weight_layer = -1;
  int64_t weight_rows = 0;  // owners: [out, in] or [num_embeddings, embedding_dim]
  int64_t weight_cols = 0;  // 0: a vector [weight_rows] (LayerNorm's)
  bool adds_bias = false;  // linear: bias && !skip_bias_add
  int bias_layer = -1;     // GeLU: the bias_from layer
  // Dropout
  ActState in_state;
  bool model_parallel_stream = false;
  // Who draws its mask: the pipeline rank and model chunk holding it, and its position among
  // that chunk's dropout layers on the same stream.
  int64_t pp_rank = 0;
  int64_t chunk = 0;
  int64_t stream_position = 0;
};

struct Plan {
  Sizes sizes;
  std::vector<LayerPlan> layers;
  int64_t input_width = 0;  // synthetic input width; 0 when the chain starts with an embedding
  // Where each pipeline rank's forwards start drawing (reference/tracker_draws.h;
  // docs/simulator.md, "Pipeline stages of a chain").
  DrawPositions draws;
  bool has_embedding = false;
  bool has_loss = false;
};

bool IsEmbedding(LayerType type);
bool IsLinear(LayerType type);
bool IsLoss(LayerType type);

// Checks `model` against the layout and the run and plans it; errors name the field.
Status BuildPlan(const ParallelConfig& parallel, const ModelConfig& model, const RunConfig& run,
                 Plan* plan);

}  // namespace mpusim::chain_reference
