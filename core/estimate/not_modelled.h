// What the memory count and the time model leave out, as the outputs list it: `mpusim
// estimate` and `mpusim advise` print it under their tables and give it in JSON as
// `not_modelled` (a list of strings). One list, so the text, the JSON and the HTML cannot
// disagree; a feature that lands removes its line here.
#pragma once

#include <string>
#include <vector>

#include "core/config/config.h"

namespace mpusim {

// The items that apply to `config`'s model (MoE routing only for a mixture-of-experts one).
std::vector<std::string> NotModelled(const Config& config);

// The model's newer parts and what the estimate counts of each, one line a part (multi-latent
// attention, multi-token prediction, sliding windows, attention sinks, DeepSeek-style routing,
// a gated activation Megatron's FLOPs count as plain); empty for a model with none. `mpusim
// estimate` prints them as `Model parts:` and gives them in JSON as `model_parts`.
std::vector<std::string> ModelParts(const Config& config);

}  // namespace mpusim
