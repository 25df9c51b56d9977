// Strict readers for single JSON config values, shared by every config section so that all
// errors read alike: "<path>: must be an integer >= 1, got string \"16\"".
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"

namespace mpusim {

// Sizes and ranks stay below 2^31: enumerated layouts store ranks as int32, and products of
// a few sizes cannot overflow int64.
inline constexpr int64_t kMaxConfigInt = std::numeric_limits<int32_t>::max();

// "<json type> <value>", shortened to 40 characters, for error messages.
std::string DescribeJson(const nlohmann::json& value);

// An integer in [min_value, kMaxConfigInt]; booleans, floats and strings are refused.
Status ParseInt(const nlohmann::json& value, const std::string& where, int64_t min_value,
                int64_t* out);
// null or such an integer.
Status ParseOptionalInt(const nlohmann::json& value, const std::string& where, int64_t min_value,
                        std::optional<int64_t>* out);

// true or false.
Status ParseBool(const nlohmann::json& value, const std::string& where, bool* out);
// A finite number (integer or float) in [0, 1): dropout probabilities, label smoothing.
Status ParseFraction(const nlohmann::json& value, const std::string& where, double* out);
// A finite number > 0 (epsilons, standard deviations, bases).
Status ParsePositive(const nlohmann::json& value, const std::string& where, double* out);
// A Megatron field a section accepts although it changes nothing mpusim computes (a fusion,
// an overlap), with why; `refused_unless` the JSON text of the only value mpusim computes
// ("" = any value is accepted).
struct AcceptedField {
  std::string_view name;
  std::string_view refused_unless;
  std::string_view why;
};
// The field of `fields` called `key`, or null.
const AcceptedField* FindAcceptedField(std::span<const AcceptedField> fields,
                                       std::string_view key);
// `value` of `field` at `where`: refused, naming the value mpusim computes, or accepted with
// one line for *notes ("<where>: ignored: why", or "<where>: false is what mpusim computes:
// why" for a field with only one value accepted).
Status JudgeAcceptedField(const AcceptedField& field, const nlohmann::json& value,
                          const std::string& where, std::vector<std::string>* notes);

// The error for a key not in `keys`: a suggestion when one is close, else the list.
Status UnknownKey(const std::string& where, std::string_view key,
                  const std::vector<std::string_view>& keys);

}  // namespace mpusim
