// The model facts (see model_facts.h): the one place outside a model that reads which model a
// config holds.
#include "core/config/model_facts.h"

namespace mpusim {

ModelFacts FactsOf(const Config& config) {
  ModelFacts facts;
  if (!config.gpt) return facts;  // the layer chain: every fact neutral
  const GptConfig& gpt = *config.gpt;
  facts.cp_comm_type = gpt.cp_comm_type;
  facts.moe = gpt.moe;
  facts.fp8 = gpt.fp8;
  facts.fp8_recipe = gpt.fp8_recipe;
  facts.tied_embeddings = gpt.share_embeddings_and_output_weights;
  return facts;
}

}  // namespace mpusim
