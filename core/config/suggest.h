// "Did you mean …?": the closest accepted name to one that is not, for config keys
// (SuggestKey, parallel_config.h), subcommands, flags and GPU names alike.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace mpusim {

// Edits (insert, delete, substitute, swap two neighbours: "modle" is one from "model")
// between a and b: the optimal string alignment distance.
size_t EditDistance(std::string_view a, std::string_view b);

// The candidate `unknown` most likely misspells, or "" when none is close: the one candidate
// it begins (a shortened name, "h100" for "h100-80gb"; at least two characters), else the
// smallest edit distance when the edits are at most a third of the longer name.
std::string ClosestName(std::string_view unknown, const std::vector<std::string_view>& candidates);

}  // namespace mpusim
