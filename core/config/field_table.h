// A config section's keys, each declared once: its JSON name, where its value lives in the
// section's struct, how it is read (type and range), its one-line meaning, and the command-line
// flag that sets it, if any. Parsing, the key list (unknown-key errors and their suggestions),
// the JSON echo, every subcommand's flags and their --help are derived from the table, so a
// key is spelled in one place and cannot be read one way and echoed or flagged another.
//
// A field is a plain member (an integer with its minimum, an optional integer, a bool, a
// string, a list of integers, a number with its rule) or, where Megatron's value is richer (an
// enum spelled as strings, a dtype, a seed over the whole uint64 range), a Codec: a pair of
// functions that read and echo it. Cross-field rules stay with the section's parser: they are
// Megatron's checks, not properties of one key.
//
//   constexpr Field<ParallelConfig> kFields[] = {
//       {"tensor_model_parallel_size", &ParallelConfig::tensor_model_parallel_size,
//        "tensor-parallel size", "--tp"},
//       ...};
//   KeyOf(kFields, &ParallelConfig::tensor_model_parallel_size)  // "tensor_model_parallel_size"
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config/json_fields.h"
#include "core/status.h"

namespace mpusim {

// What a flag's text is read as (the --help value name: INT, BOOL, TEXT, INT,INT,..., NUMBER).
enum class FieldKind : uint8_t { kInt, kBool, kText, kIntList, kNumber };

// The rule of a number field (json_fields.h: ParsePositive, ParseFraction, or >= 0).
enum class NumberRule : uint8_t { kPositive, kFraction, kNonNegative };

// What changing the key's value changes, for `mpusim diff`'s account of two configs
// (core/dump/config_diff.h): kSection is the section's own default (a parallel key lays out
// the same math; a run key changes the data; an optimizer key the training).
enum class FieldEffect : uint8_t {
  kSection,
  kLayout,      // the same math, laid out or run differently
  kPrecision,   // the storage dtype
  kSeed,        // the initial values, the data and the masks
  kIterations,  // how many steps
  kBatch,       // samples per micro-batch or iteration: a layout change when each iteration
                // still sees the same samples, else other data
  kShape,       // the tensors' names or shapes: another model
};

// A field that is not a plain member: how it is read and echoed.
template <typename Section>
struct Codec {
  FieldKind kind;
  Status (*parse)(const nlohmann::json& value, const std::string& where, Section* section);
  nlohmann::json (*echo)(const Section& section);
};

template <typename Section>
struct Field {
  using Target =
      std::variant<int64_t Section::*, std::optional<int64_t> Section::*, bool Section::*,
                   std::string Section::*, std::vector<int64_t> Section::*, double Section::*,
                   Codec<Section>>;

  std::string_view key;
  Target target;
  std::string_view help;       // what it is, in one line (Megatron's meaning)
  std::string_view flag = {};  // "--tp" or "--world-size,-n": the flag every subcommand takes
  int64_t min_value = 1;       // integers (and each item of a list)
  NumberRule number_rule = NumberRule::kPositive;  // numbers
  bool Section::*given = nullptr;  // set when the key is in the section (not defaulted)
  FieldEffect effect = FieldEffect::kSection;
  // Non-empty: the key has no default, and this says what to give ("the number of ranks, e.g.
  // \"world_size\": 16"); CheckRequired refuses a section without it.
  std::string_view required = {};
  // Non-empty: the default of an absent key is no value of its own but resolved from other
  // keys once the section is read ("4 * hidden_size"); the documentation shows this instead
  // of the echo of a default section.
  std::string_view absent = {};

  constexpr FieldKind kind() const {
    switch (target.index()) {
      case 0:
      case 1:
        return FieldKind::kInt;
      case 2:
        return FieldKind::kBool;
      case 3:
        return FieldKind::kText;
      case 4:
        return FieldKind::kIntList;
      case 5:
        return FieldKind::kNumber;
      default:
        return std::get<Codec<Section>>(target).kind;
    }
  }

  // Reads `value` (at `where`, for errors) into `section`.
  Status Parse(const nlohmann::json& value, const std::string& where, Section* section) const;
  // The value as the section's JSON echo writes it (null for an unset optional).
  nlohmann::json Echo(const Section& section) const;
};

// Megatron's error for a list of sizes: null or a non-empty list of integers >= `min_value`.
Status ParseIntList(const nlohmann::json& value, const std::string& where, int64_t min_value,
                    std::vector<int64_t>* out);
// A finite number >= 0.
Status ParseNonNegative(const nlohmann::json& value, const std::string& where, double* out);

template <typename Section>
Status Field<Section>::Parse(const nlohmann::json& value, const std::string& where,
                             Section* section) const {
  struct Visitor {
    const Field& field;
    const nlohmann::json& value;
    const std::string& where;
    Section* section;
    Status operator()(int64_t Section::*m) const {
      return ParseInt(value, where, field.min_value, &(section->*m));
    }
    Status operator()(std::optional<int64_t> Section::*m) const {
      return ParseOptionalInt(value, where, field.min_value, &(section->*m));
    }
    Status operator()(bool Section::*m) const { return ParseBool(value, where, &(section->*m)); }
    Status operator()(std::string Section::*m) const {
      if (!value.is_string()) {
        return Status::Error(where, "must be a string, got " + DescribeJson(value));
      }
      section->*m = value.template get<std::string>();
      return {};
    }
    Status operator()(std::vector<int64_t> Section::*m) const {
      return ParseIntList(value, where, field.min_value, &(section->*m));
    }
    Status operator()(double Section::*m) const {
      switch (field.number_rule) {
        case NumberRule::kPositive:
          return ParsePositive(value, where, &(section->*m));
        case NumberRule::kFraction:
          return ParseFraction(value, where, &(section->*m));
        case NumberRule::kNonNegative:
          return ParseNonNegative(value, where, &(section->*m));
      }
      return Status::Error(where, "unknown number rule");
    }
    Status operator()(const Codec<Section>& codec) const {
      return codec.parse(value, where, section);
    }
  };
  MPUSIM_RETURN_IF_ERROR(std::visit(Visitor{*this, value, where, section}, target));
  if (given != nullptr) section->*given = true;
  return {};
}

template <typename Section>
nlohmann::json Field<Section>::Echo(const Section& section) const {
  struct Visitor {
    const Section& section;
    nlohmann::json operator()(std::optional<int64_t> Section::*m) const {
      const std::optional<int64_t>& v = section.*m;
      return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
    }
    nlohmann::json operator()(std::vector<int64_t> Section::*m) const {
      const std::vector<int64_t>& v = section.*m;
      return v.empty() ? nlohmann::json(nullptr) : nlohmann::json(v);
    }
    nlohmann::json operator()(const Codec<Section>& codec) const { return codec.echo(section); }
    nlohmann::json operator()(int64_t Section::*m) const { return section.*m; }
    nlohmann::json operator()(bool Section::*m) const { return section.*m; }
    nlohmann::json operator()(std::string Section::*m) const { return section.*m; }
    nlohmann::json operator()(double Section::*m) const { return section.*m; }
  };
  return std::visit(Visitor{section}, target);
}

// The first required key of `fields` that `section` lacks: "<prefix>.<key>: is required
// (<what to give>)", or "is required<context> (<what to give>)" (context: ` for "type": "gpt"`).
template <typename Section>
Status CheckRequired(std::span<const Field<Section>> fields, const nlohmann::json& section,
                     std::string_view prefix, std::string_view context = {}) {
  for (const Field<Section>& f : fields) {
    if (f.required.empty() || section.contains(f.key)) continue;
    return Status::Error(std::string(prefix) + "." + std::string(f.key),
                         "is required" + std::string(context) + " (" + std::string(f.required) +
                             ")");
  }
  return {};
}

// The member at the end of a path of member pointers: MemberAt<&GptConfig::moe,
// &MoeConfig::router_topk>(gpt) is gpt.moe.router_topk.
template <auto kFirst, auto... kRest, typename Object>
constexpr auto& MemberAt(Object& object) {
  if constexpr (sizeof...(kRest) == 0) {
    return object.*kFirst;
  } else {
    return MemberAt<kRest...>(object.*kFirst);
  }
}

template <typename MemberPointer>
struct MemberPointerTraits;
template <typename Class, typename Member>
struct MemberPointerTraits<Member Class::*> {
  using ClassType = Class;
  using MemberType = Member;
};

// A plain member `kInner` of the struct `kOuter` a section holds, read and echoed as a field of
// the section itself, with the reader of a plain field (its minimum or number rule): the
// model section's "moe_router_topk" is GptConfig::moe's router_topk.
template <auto kOuter, auto kInner, int64_t kMinValue = 1,
          NumberRule kRule = NumberRule::kPositive>
constexpr auto InnerMember() {
  using Section = typename MemberPointerTraits<decltype(kOuter)>::ClassType;
  using Inner = typename MemberPointerTraits<decltype(kOuter)>::MemberType;
  using InnerField = Field<Inner>;
  return Codec<Section>{
      InnerField{.key = {}, .target = kInner, .help = {}}.kind(),
      [](const nlohmann::json& value, const std::string& where, Section* section) {
        const InnerField field{
            .key = {}, .target = kInner, .help = {}, .min_value = kMinValue, .number_rule = kRule};
        return field.Parse(value, where, &(section->*kOuter));
      },
      [](const Section& section) {
        return InnerField{.key = {}, .target = kInner, .help = {}}.Echo(section.*kOuter);
      }};
}

// The table's keys, in its (documentation) order.
template <typename Section>
std::vector<std::string_view> KeysOf(std::span<const Field<Section>> fields) {
  std::vector<std::string_view> keys;
  keys.reserve(fields.size());
  for (const Field<Section>& f : fields) keys.push_back(f.key);
  return keys;
}

// The field called `key`, or null.
template <typename Section>
const Field<Section>* FindField(std::span<const Field<Section>> fields, std::string_view key) {
  for (const Field<Section>& f : fields) {
    if (f.key == key) return &f;
  }
  return nullptr;
}

// The key of the field stored in `member`: how code outside the table names a key (in a
// message, a report row, a document it writes) without spelling it again. A member no field
// stores is a programming error.
template <typename Section, typename T>
std::string_view KeyOf(std::span<const Field<Section>> fields, T Section::*member) {
  for (const Field<Section>& f : fields) {
    if (const auto* m = std::get_if<T Section::*>(&f.target); m != nullptr && *m == member) {
      return f.key;
    }
  }
  throw std::logic_error("KeyOf: the member is no field of the table");
}

// Every field of `section`, as the section's JSON echo.
template <typename Section>
nlohmann::json EchoFields(std::span<const Field<Section>> fields, const Section& section) {
  nlohmann::json j = nlohmann::json::object();
  for (const Field<Section>& f : fields) j[std::string(f.key)] = f.Echo(section);
  return j;
}

}  // namespace mpusim
