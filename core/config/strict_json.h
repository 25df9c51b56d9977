// ParseStrictJson: the one JSON reading path for every file mpusim loads (configs, dump
// manifests, safetensors headers).
//
// What it is: a parser that accepts exactly one RFC 8259 document and refuses, as a Status
// naming line, column and JSON path:
//   - nesting deeper than JsonLimits::max_depth (the default 64 is far beyond any file
//     mpusim writes or reads; the limit keeps every later recursive walk, such as dump(),
//     off the stack's edge);
//   - a key that appears twice in one object (nlohmann alone keeps the last one silently);
//   - anything but whitespace after the document, a NUL byte anywhere;
//   - numbers outside double's range (1e400), which nlohmann reports by throwing;
//   - input longer than JsonLimits::max_bytes.
// Integers beyond int64/uint64 arrive as floating-point numbers (nlohmann's rule), so
// integer readers refuse them as "not an integer". The parser builds the document itself
// through nlohmann's SAX interface: no exception leaves it, whatever the input.
// What it is not: a schema checker. Field types and ranges are the callers' business
// (json_fields.h, dump_loader.cc, safetensors.cc).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace mpusim {

struct JsonLimits {
  int max_depth = 64;                     // arrays and objects open at once
  size_t max_bytes = size_t{64} << 20;    // the whole text
};

// Parses `text`. On a syntax error the Status's where is "line L, column C" and its what
// "invalid JSON: <reason> (inside PATH)"; on a repeated key or too deep a nesting where is
// the JSON path ("parallel.world_size") and what "invalid JSON: <reason>".
// Json is nlohmann::json or nlohmann::ordered_json.
template <typename Json>
StatusOr<Json> ParseStrictJson(std::string_view text, const JsonLimits& limits = {});

// The contents of the file at `path`, refused before reading when it is larger than
// limits.max_bytes (a JSON file is read whole) or cannot be opened or read.
StatusOr<std::string> ReadJsonText(const std::string& path, const JsonLimits& limits = {});

extern template StatusOr<nlohmann::json> ParseStrictJson(std::string_view, const JsonLimits&);
extern template StatusOr<nlohmann::ordered_json> ParseStrictJson(std::string_view,
                                                                 const JsonLimits&);

}  // namespace mpusim
