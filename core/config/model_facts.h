// What code outside a model may know of the model a Config holds, answered in one place.
//
// DESIGN.md: "Nothing outside a model asks which model it holds". The run driver, the program
// and the estimate read these facts (FactsOf) instead of looking inside Config::gpt; only
// core/config, core/model and the reference do that (tests/rules/model_asks.py keeps it so).
// Every model answers every fact; the layer chain answers the neutral value of each: no
// attention (so no sequence for context parallelism to split), no experts, no fp8, no tied
// embeddings.
//
// What it is not: the model's shapes. The estimate counts GPT models only and takes the
// GptConfig itself, once, from core/estimate/estimable.h (EstimatedModel).
#pragma once

#include <optional>

#include "core/config/config.h"

namespace mpusim {

struct ModelFacts {
  // How attention under context parallelism reaches the other cp ranks' keys and values
  // (model.cp_comm_type); none: the model has no attention over a sequence, so context
  // parallelism has nothing to split.
  std::optional<CpCommType> cp_comm_type;
  // The mixture-of-experts layers (moe.enabled(): num_experts > 0); a dense model's is
  // MoeConfig{}.
  MoeConfig moe;
  // Transformer Engine's fp8 for the linear layers (model.fp8); none: the run's dtype.
  std::optional<Fp8Format> fp8;
  Fp8Recipe fp8_recipe = Fp8Recipe::kDelayed;  // read only with fp8
  // share_embeddings_and_output_weights: the first and last pipeline stages hold one word
  // embedding, its gradient all-reduced over the embd group.
  bool tied_embeddings = false;

  bool has_attention() const { return cp_comm_type.has_value(); }
};

// The facts of the model `config` holds (the neutral ones when it holds none).
ModelFacts FactsOf(const Config& config);

}  // namespace mpusim
