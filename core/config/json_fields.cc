// Strict JSON value readers (see json_fields.h).
#include "core/config/json_fields.h"
#include "core/config/field_table.h"

#include "core/config/parallel_config.h"

#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

namespace mpusim {

std::string DescribeJson(const nlohmann::json& value) {
  std::string text = value.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return fmt::format("{} {}", value.type_name(), text);
}

Status ParseInt(const nlohmann::json& value, const std::string& where, int64_t min_value,
                int64_t* out) {
  if (!value.is_number_integer()) {
    return Status::Error(where, fmt::format("must be an integer >= {}, got {}", min_value,
                                            DescribeJson(value)));
  }
  if (value.is_number_unsigned() &&
      value.get<uint64_t>() > static_cast<uint64_t>(kMaxConfigInt)) {
    return Status::Error(where, fmt::format("must be at most {}, got {}", kMaxConfigInt,
                                            value.get<uint64_t>()));
  }
  const int64_t v = value.get<int64_t>();
  if (v < min_value) {
    return Status::Error(where, fmt::format("must be an integer >= {}, got {}", min_value, v));
  }
  if (v > kMaxConfigInt) {
    return Status::Error(where, fmt::format("must be at most {}, got {}", kMaxConfigInt, v));
  }
  *out = v;
  return {};
}

Status ParseOptionalInt(const nlohmann::json& value, const std::string& where, int64_t min_value,
                        std::optional<int64_t>* out) {
  if (value.is_null()) {
    out->reset();
    return {};
  }
  int64_t v = 0;
  MPUSIM_RETURN_IF_ERROR(ParseInt(value, where, min_value, &v));
  *out = v;
  return {};
}

Status ParseBool(const nlohmann::json& value, const std::string& where, bool* out) {
  if (!value.is_boolean()) {
    return Status::Error(where, fmt::format("must be true or false, got {}", DescribeJson(value)));
  }
  *out = value.get<bool>();
  return {};
}

Status ParseFraction(const nlohmann::json& value, const std::string& where, double* out) {
  const bool in_range = value.is_number() && std::isfinite(value.get<double>()) &&
                        value.get<double>() >= 0.0 && value.get<double>() < 1.0;
  if (!in_range) {
    return Status::Error(where,
                         fmt::format("must be a number in [0, 1), got {}", DescribeJson(value)));
  }
  *out = value.get<double>();
  return {};
}

Status ParsePositive(const nlohmann::json& value, const std::string& where, double* out) {
  const bool ok = value.is_number() && std::isfinite(value.get<double>()) && value.get<double>() > 0.0;
  if (!ok) {
    return Status::Error(where, fmt::format("must be a number > 0, got {}", DescribeJson(value)));
  }
  *out = value.get<double>();
  return {};
}

Status ParseNonNegative(const nlohmann::json& value, const std::string& where, double* out) {
  if (!value.is_number() || value.is_boolean() || !std::isfinite(value.get<double>()) ||
      value.get<double>() < 0) {
    return Status::Error(where,
                         fmt::format("must be a finite number >= 0, got {}", DescribeJson(value)));
  }
  *out = value.get<double>();
  return {};
}

Status ParseIntList(const nlohmann::json& value, const std::string& where, int64_t min_value,
                    std::vector<int64_t>* out) {
  out->clear();
  if (value.is_null()) return {};
  if (!value.is_array() || value.empty()) {
    return Status::Error(where, fmt::format("must be null or a non-empty list of integers >= {} "
                                            "(e.g. [2, 4]), got {}",
                                            min_value, DescribeJson(value)));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    int64_t item = 0;
    MPUSIM_RETURN_IF_ERROR(ParseInt(value[i], fmt::format("{}[{}]", where, i), min_value, &item));
    out->push_back(item);
  }
  return {};
}

const AcceptedField* FindAcceptedField(std::span<const AcceptedField> fields,
                                       std::string_view key) {
  for (const AcceptedField& f : fields) {
    if (f.name == key) return &f;
  }
  return nullptr;
}

Status JudgeAcceptedField(const AcceptedField& field, const nlohmann::json& value,
                          const std::string& where, std::vector<std::string>* notes) {
  if (field.refused_unless.empty()) {
    notes->push_back(fmt::format("{}: ignored: {}", where, field.why));
    return {};
  }
  if (value != nlohmann::json::parse(field.refused_unless, nullptr, false)) {
    return Status::Error(where, fmt::format("{}: {}; only {} is accepted", DescribeJson(value),
                                            field.why, field.refused_unless));
  }
  notes->push_back(fmt::format("{}: {} is what mpusim computes: {}", where, value.dump(), field.why));
  return {};
}

Status UnknownKey(const std::string& where, std::string_view key,
                  const std::vector<std::string_view>& keys) {
  const std::string suggestion = SuggestKey(key, keys);
  return Status::Error(where, suggestion.empty()
                                  ? fmt::format("unknown key; allowed: {}", fmt::join(keys, ", "))
                                  : fmt::format("unknown key; did you mean '{}'?", suggestion));
}

}  // namespace mpusim
