// Dump comparison (see diff.h): the strict dump reader, the reassembly of full tensors, and
// the element-wise comparison with its text and JSON renderings.
//
// What it is: host-only code on nlohmann/json and fmt; every field of a dump is checked
// before it is used to index anything, so a corrupt dump is a Status, never a crash.
// What it is not: a tolerant reader. A dump that does not describe a consistent tensor is
// refused rather than compared on a guess.
#include "core/dump/diff.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <utility>

#include "core/init.h"
#include "core/dump/safetensors.h"
#include "core/sharding.h"
#include "core/config/strict_json.h"

namespace mpusim {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;  // keeps key order in the JSON output
constexpr std::string_view kRankInfoKey = "mpusim";

// ---------------------------------------------------------------------------------------
// JSON field readers. Each accepts exactly one JSON type: 2.0 is not an integer, "2" is not
// a number, and an integer beyond int64 is refused rather than wrapped.

bool AsInt(const Json& value, int64_t* out) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (value.is_number_integer()) {
    *out = value.get<int64_t>();
    return true;
  }
  return false;
}

// A list of non-negative integers whose product fits in int64.
bool AsShape(const Json& value, Shape* out) {
  if (!value.is_array()) return false;
  Shape shape;
  int64_t product = 1;
  for (const Json& d : value) {
    int64_t n = 0;
    if (!AsInt(d, &n) || n < 0) return false;
    if (__builtin_mul_overflow(product, n, &product)) return false;
    shape.push_back(n);
  }
  *out = std::move(shape);
  return true;
}

std::string Brief(const Json& value) {
  std::string text = value.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

StatusOr<Json> ParseJson(const std::string& text) { return ParseStrictJson<Json>(text); }

// "[i, j]" for a flat index into `shape`.
Shape MultiIndex(const Shape& shape, int64_t flat) {
  Shape index(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 0) continue;
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return index;
}

// ---------------------------------------------------------------------------------------
// The manifest.

struct ManifestTensor {
  std::string name;
  Shape full_shape;
  DType dtype = DType::kFloat32;
  std::optional<Tolerance> budget;  // "budget": {"atol", "rtol"} (a checked run's dump)
};

struct Manifest {
  int64_t world_size = 0;
  std::string backend;
  std::optional<DType> storage;  // "dtype": the run's storage dtype
  std::string run_id;            // "" for dumps written before run ids
  std::vector<ManifestTensor> tensors;
  std::vector<std::string> files;
};

StatusOr<DType> ParseDTypeName(const Json& value) {
  if (value.is_string()) {
    // Dumps hold float tensors only (tokens and labels are recorded as float64).
    const std::optional<DType> d = DTypeFromName(value.get<std::string>());
    if (d && IsFloat(*d)) return *d;
  }
  return Status::Error("", fmt::format("must be \"float32\", \"float64\", \"bfloat16\" or "
                                       "\"float16\", got {}",
                                       Brief(value)));
}

// Required keys are checked strictly. "dtype" (the run's storage dtype) is optional and, when
// present, picks the tolerance (see diff.h). Other top-level keys (config, anything a later
// writer adds to describe the run) are descriptive: no value read here depends on them, and
// schema_version guards changes of meaning.
StatusOr<Manifest> ParseManifest(const Json& j) {
  if (!j.is_object()) return Status::Error("", "must be a JSON object");
  for (const char* key : {"schema_version", "world_size", "tensors", "files"}) {
    if (!j.contains(key)) return Status::Error(key, "is missing");
  }
  int64_t version = 0;
  if (AsInt(j["schema_version"], &version) && version == 1) {
    return Status::Error("schema_version",
                         "1 is the dump format before shard placements, which this reader no "
                         "longer reads; write the dump again with `mpusim run --dump`");
  }
  if (!AsInt(j["schema_version"], &version) || version != kDumpSchemaVersion) {
    return Status::Error("schema_version",
                         fmt::format("must be {} (the only version this reader knows), got {}",
                                     kDumpSchemaVersion, Brief(j["schema_version"])));
  }
  Manifest m;
  if (!AsInt(j["world_size"], &m.world_size) || m.world_size < 1) {
    return Status::Error("world_size",
                         fmt::format("must be an integer >= 1, got {}", Brief(j["world_size"])));
  }
  if (j.contains("backend")) {
    if (!j["backend"].is_string()) return Status::Error("backend", "must be a string");
    m.backend = j["backend"].get<std::string>();
  }
  if (j.contains("run_id")) {
    if (!j["run_id"].is_string() || j["run_id"].get<std::string>().empty()) {
      return Status::Error("run_id", fmt::format("must be a non-empty string, got {}",
                                                 Brief(j["run_id"])));
    }
    m.run_id = j["run_id"].get<std::string>();
  }
  if (j.contains("dtype")) {
    StatusOr<DType> storage = ParseDTypeName(j["dtype"]);
    if (!storage.ok()) return Status::Error("dtype", storage.status().what());
    m.storage = *storage;
  }
  const Json& files = j["files"];
  if (!files.is_array() || static_cast<int64_t>(files.size()) != m.world_size) {
    return Status::Error("files",
                         fmt::format("must be a list of world_size ({}) file names", m.world_size));
  }
  std::set<std::string> seen_files;
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string where = fmt::format("files[{}]", i);
    if (!files[i].is_string()) return Status::Error(where, "must be a string");
    const std::string name = files[i].get<std::string>();
    // A plain name inside the dump directory: nothing may point outside it.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      return Status::Error(where, fmt::format("'{}' must be a file name without '/'", name));
    }
    if (!seen_files.insert(name).second) {
      return Status::Error(where, fmt::format("'{}' is listed twice", name));
    }
    m.files.push_back(name);
  }
  const Json& tensors = j["tensors"];
  if (!tensors.is_array()) return Status::Error("tensors", "must be a list");
  std::set<std::string> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string where = fmt::format("tensors[{}]", i);
    const Json& t = tensors[i];
    if (!t.is_object()) return Status::Error(where, "must be an object {name, full_shape, dtype}");
    for (const auto& [key, unused] : t.items()) {
      if (key != "name" && key != "full_shape" && key != "dtype" && key != "budget") {
        return Status::Error(where, fmt::format("unknown key '{}'; allowed: name, full_shape, "
                                                "dtype, budget",
                                                key));
      }
    }
    for (const char* key : {"name", "full_shape", "dtype"}) {
      if (!t.contains(key)) return Status::Error(where, fmt::format("missing key '{}'", key));
    }
    ManifestTensor mt;
    if (!t["name"].is_string() || t["name"].get<std::string>().empty()) {
      return Status::Error(where + ".name", "must be a non-empty string");
    }
    mt.name = t["name"].get<std::string>();
    if (mt.name == kRankInfoKey) {
      return Status::Error(where + ".name", "'mpusim' is reserved for the rank metadata");
    }
    if (!seen.insert(mt.name).second) {
      return Status::Error(where + ".name", fmt::format("'{}' is listed twice", mt.name));
    }
    if (!AsShape(t["full_shape"], &mt.full_shape)) {
      return Status::Error(where + ".full_shape",
                           fmt::format("must be a list of non-negative integers with fewer than "
                                       "2^63 elements, got {}",
                                       Brief(t["full_shape"])));
    }
    StatusOr<DType> dtype = ParseDTypeName(t["dtype"]);
    if (!dtype.ok()) return Status::Error(where + ".dtype", dtype.status().what());
    mt.dtype = *dtype;
    if (t.contains("budget")) {
      const Json& b = t["budget"];
      const auto number = [&](const char* key, double* out) {
        if (!b.is_object() || !b.contains(key) || !b[key].is_number()) return false;
        *out = b[key].get<double>();
        return std::isfinite(*out) && *out >= 0;
      };
      Tolerance budget{0, 0, 0};
      if (!b.is_object() || b.size() != 2 || !number("atol", &budget.atol) ||
          !number("rtol", &budget.rtol)) {
        return Status::Error(where + ".budget",
                             fmt::format("must be {{\"atol\": A, \"rtol\": R}} with finite "
                                         "A, R >= 0, got {}",
                                         Brief(b)));
      }
      mt.budget = budget;
    }
    m.tensors.push_back(std::move(mt));
  }
  return m;
}

// ---------------------------------------------------------------------------------------
// A rank file's metadata.

struct RankInfo {
  int64_t rank = 0;
  int64_t tp_rank = 0;
  int64_t dp_rank = 0;
  std::string run_id;  // "" when the writer gave none
};

// {"rank", "tp_rank", "dp_rank", ...}; other keys (backend, device) only describe the rank.
StatusOr<RankInfo> ParseRankInfo(const std::string& text) {
  StatusOr<Json> parsed = ParseJson(text);
  if (!parsed.ok()) return parsed.status();
  const Json& j = *parsed;
  if (!j.is_object()) return Status::Error("", "must be a JSON object {rank, tp_rank, dp_rank}");
  RankInfo info;
  for (auto [key, out] : {std::pair{"rank", &info.rank}, std::pair{"tp_rank", &info.tp_rank},
                          std::pair{"dp_rank", &info.dp_rank}}) {
    if (!j.contains(key)) return Status::Error("", fmt::format("missing key '{}'", key));
    if (!AsInt(j[key], out) || *out < 0) {
      return Status::Error("",
                           fmt::format("{} must be an integer >= 0, got {}", key, Brief(j[key])));
    }
  }
  if (j.contains("run_id")) {
    if (!j["run_id"].is_string()) {
      return Status::Error("", fmt::format("run_id must be a string, got {}", Brief(j["run_id"])));
    }
    info.run_id = j["run_id"].get<std::string>();
  }
  return info;
}

struct ShardMetadata {
  Shape full_shape;
  ShardSpec spec;
  bool partial_sum = false;
};

// {"full_shape": [...], "placements": [{"axis", "dim", "shards", "index", "stride"}, ...]
// [, "partial_sum": true]}, placements outermost first (core/sharding.h). Unknown keys are
// refused: a key this reader does not know could change where the values belong.
StatusOr<ShardMetadata> ParseShardMetadata(const std::string& text) {
  StatusOr<Json> parsed = ParseJson(text);
  if (!parsed.ok()) return parsed.status();
  const Json& j = *parsed;
  if (!j.is_object()) return Status::Error("", "must be a JSON object");
  static const std::set<std::string> kAllowed = {"full_shape", "placements", "partial_sum"};
  for (const auto& [key, unused] : j.items()) {
    if (kAllowed.count(key) == 0) {
      return Status::Error(
          "", fmt::format("unknown key '{}'; allowed: {}", key, fmt::join(kAllowed, ", ")));
    }
  }
  ShardMetadata m;
  if (!j.contains("full_shape")) return Status::Error("", "missing key 'full_shape'");
  if (!AsShape(j["full_shape"], &m.full_shape)) {
    return Status::Error("", fmt::format("full_shape must be a list of non-negative integers, "
                                         "got {}",
                                         Brief(j["full_shape"])));
  }
  if (!j.contains("placements")) return Status::Error("", "missing key 'placements'");
  const Json& list = j["placements"];
  // Each axis appears at most once, so a longer list is invalid whatever it holds.
  constexpr size_t kMaxPlacements = 4;
  if (!list.is_array() || list.size() > kMaxPlacements) {
    return Status::Error("", fmt::format("placements must be a list of at most {} objects, got {}",
                                         kMaxPlacements, Brief(list)));
  }
  static const std::set<std::string> kPlacementKeys = {"axis", "dim", "shards", "index", "stride"};
  const int64_t ndim = static_cast<int64_t>(m.full_shape.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const Json& p = list[i];
    const std::string where = fmt::format("placements[{}]", i);
    if (!p.is_object()) {
      return Status::Error("", fmt::format("{} must be an object, got {}", where, Brief(p)));
    }
    for (const auto& [key, unused] : p.items()) {
      if (kPlacementKeys.count(key) == 0) {
        return Status::Error("", fmt::format("{}: unknown key '{}'; allowed: {}", where, key,
                                             fmt::join(kPlacementKeys, ", ")));
      }
    }
    for (const std::string& key : kPlacementKeys) {
      if (!p.contains(key)) {
        return Status::Error("", fmt::format("{}: missing key '{}'", where, key));
      }
    }
    const std::optional<ShardAxis> axis =
        p["axis"].is_string() ? ParseShardAxis(p["axis"].get<std::string>()) : std::nullopt;
    if (!axis) {
      return Status::Error("", fmt::format("{}.axis must be one of tp, dp, cp, ep, got {}", where,
                                           Brief(p["axis"])));
    }
    int64_t values[4] = {0, 0, 0, 0};
    const char* keys[4] = {"dim", "shards", "index", "stride"};
    for (int k = 0; k < 4; ++k) {
      if (!AsInt(p[keys[k]], &values[k])) {
        return Status::Error(
            "", fmt::format("{}.{} must be an integer, got {}", where, keys[k], Brief(p[keys[k]])));
      }
    }
    // Range-check before narrowing to int; ShardSpecError checks the rest.
    if (values[0] < 0 || values[0] >= ndim) {
      return Status::Error("", fmt::format("{}.dim {} is outside [0, {})", where, values[0], ndim));
    }
    m.spec.placements.push_back(
        {*axis, static_cast<int>(values[0]), values[1], values[2], values[3]});
  }
  if (j.contains("partial_sum")) {
    if (!j["partial_sum"].is_boolean()) {
      return Status::Error(
          "", fmt::format("partial_sum must be true or false, got {}", Brief(j["partial_sum"])));
    }
    m.partial_sum = j["partial_sum"].get<bool>();
  }
  const std::string error = ShardSpecError(m.spec, m.full_shape);
  if (!error.empty()) return Status::Error("", error);
  // One spelling per layout (as ShardSpec::Split writes it): a 1-shard split is no split.
  std::erase_if(m.spec.placements, [](const Placement& p) { return p.shards == 1; });
  if (m.partial_sum && m.spec.Find(ShardAxis::kTp) != nullptr) {
    return Status::Error("",
                         "partial_sum with a tp placement: a partial sum is summed over the "
                         "tp ranks, so it cannot also be split over them");
  }
  return m;
}

bool SameLayout(const DumpTensor& t, const ShardSpec& s, bool partial_sum) {
  return SameLayout(t.shards.front().spec, s) && t.partial_sum == partial_sum;
}

std::string LayoutString(const ShardSpec& s, bool partial_sum) {
  return LayoutString(s) + (partial_sum ? ", partial_sum" : "");
}

// The coordinates that tell copies (equal keys) from distinct pieces (see diff.h): each
// placement's index, after the tp rank for a partial sum.
using ShardKey = std::vector<int64_t>;
ShardKey KeyOf(const DumpTensor& t, const DumpShard& s) {
  ShardKey key;
  if (t.partial_sum) key.push_back(s.tp_rank);
  for (const Placement& p : s.spec.placements) key.push_back(p.index);
  return key;
}

// Every element covered: all distinct keys present. Counting distinct keys (rather than
// enumerating every combination of indices) keeps a hostile shard count cheap.
Status CheckCoverage(const DumpTensor& t, const std::set<int64_t>& tp_ranks) {
  const ShardSpec& spec = t.shards.front().spec;
  std::set<ShardKey> keys;
  for (const DumpShard& s : t.shards) keys.insert(KeyOf(t, s));
  // Per key position: how many values it takes.
  std::vector<int64_t> radix;
  if (t.partial_sum) radix.push_back(static_cast<int64_t>(tp_ranks.size()));
  for (const Placement& p : spec.placements) radix.push_back(p.shards);
  int64_t needed = 1;
  bool overflow = false;
  for (int64_t r : radix) overflow = overflow || __builtin_mul_overflow(needed, r, &needed);
  if (!overflow && needed == static_cast<int64_t>(keys.size())) return Status();
  // Name the first missing piece; it is among the first keys.size() + 1 candidates in
  // odometer order (the last position fastest).
  const std::vector<int64_t> summand_ranks(tp_ranks.begin(), tp_ranks.end());
  std::vector<int64_t> digits(radix.size(), 0);
  for (size_t n = 0; n <= keys.size(); ++n) {
    ShardKey candidate(digits.size());
    for (size_t i = 0; i < digits.size(); ++i) {
      candidate[i] =
          t.partial_sum && i == 0 ? summand_ranks[static_cast<size_t>(digits[0])] : digits[i];
    }
    if (keys.count(candidate) == 0) {
      ShardSpec piece = spec;
      const size_t first = t.partial_sum ? 1 : 0;
      for (size_t i = 0; i < piece.placements.size(); ++i) {
        piece.placements[i].index = candidate[first + i];
      }
      std::string what =
          t.partial_sum ? fmt::format("the summand of tp_rank {}{}", candidate[0],
                                      piece.replicated() ? std::string()
                                                         : fmt::format(" ({})", PieceString(piece)))
                        : fmt::format("the piece {}", PieceString(piece));
      return Status::Error(fmt::format("tensor '{}'", t.name),
                           fmt::format("{} is in no rank file, so part of the full tensor {} is "
                                       "not covered",
                                       what, ShapeString(t.full_shape)));
    }
    for (size_t i = digits.size(); i-- > 0;) {
      if (++digits[i] < radix[i]) break;
      digits[i] = 0;
    }
  }
  return Status::Error(fmt::format("tensor '{}'", t.name), "is not fully covered by its shards");
}

// A value as its side stored it: float32 and 16-bit values print as the shortest float
// that round-trips.
std::string FormatValue(double v, std::optional<DType> dtype) {
  if (dtype && *dtype != DType::kFloat64) return fmt::format("{}", static_cast<float>(v));
  return fmt::format("{}", v);
}

// Global multi-index of local flat index `local` of a shard.
Shape GlobalCoordinates(const ShardSpec& spec, const Shape& full, const Shape& local_shape,
                        int64_t local) {
  Shape index = MultiIndex(local_shape, local);
  for (size_t d = 0; d < index.size(); ++d) {
    index[d] = GlobalIndex(spec, static_cast<int>(d), full[d], index[d]);
  }
  return index;
}

// Copies must carry the same bits; the first difference names both ranks.
Status CheckCopies(const DumpTensor& t, const DumpShard& first, const DumpShard& copy) {
  if (std::memcmp(first.tensor.data(), copy.tensor.data(), first.tensor.bytes()) == 0) {
    return Status();
  }
  const size_t size = DTypeSize(t.dtype);
  const auto* x = static_cast<const unsigned char*>(first.tensor.data());
  const auto* y = static_cast<const unsigned char*>(copy.tensor.data());
  int64_t differing = 0;
  int64_t first_diff = -1;
  for (int64_t e = 0; e < first.tensor.numel(); ++e) {
    const size_t offset = static_cast<size_t>(e) * size;
    if (std::memcmp(x + offset, y + offset, size) != 0) {
      if (first_diff < 0) first_diff = e;
      ++differing;
    }
  }
  const std::string piece =
      t.partial_sum
          ? fmt::format("the tp_rank {} summand{}", first.tp_rank,
                        first.spec.replicated() ? std::string()
                                                : fmt::format(" ({})", PieceString(first.spec)))
          : (first.spec.replicated() ? PieceString(first.spec)
                                     : fmt::format("the piece {}", PieceString(first.spec)));
  return Status::Error(
      std::string(t.name),
      fmt::format("ranks {} and {} hold copies of {} that differ in {} of {} elements; first "
                  "at {}: {} vs {}",
                  first.rank, copy.rank, piece, differing, first.tensor.numel(),
                  ShapeString(GlobalCoordinates(first.spec, t.full_shape, first.tensor.shape(),
                                                first_diff)),
                  FormatValue(HostValue(first.tensor, first_diff), t.dtype),
                  FormatValue(HostValue(copy.tensor, first_diff), t.dtype)));
}

// ---------------------------------------------------------------------------------------
// Comparison.

std::string DTypeShort(const std::optional<DType>& d) {
  if (!d) return "-";
  switch (*d) {
    case DType::kFloat32: return "f32";
    case DType::kFloat64: return "f64";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "f16";
    case DType::kInt64: return "i64";  // not in a dump (ParseDTypeName refuses it)
  }
  return "?";
}

void CompareValues(const Tensor& a, const Tensor& b, TensorDiff& d) {
  const double* x = a.data_as<double>();
  const double* y = b.data_as<double>();
  double scale_b = 0;  // max |b| over finite b: the scale of ntol
  for (int64_t i = 0; i < b.numel(); ++i) {
    if (std::isfinite(y[i])) scale_b = std::fmax(scale_b, std::fabs(y[i]));
  }
  const Tolerance tol = d.tolerance.ForScale(scale_b);
  double max_a = 0, max_b = 0;
  double worst_excess = -std::numeric_limits<double>::infinity();
  d.elements = a.numel();
  for (int64_t i = 0; i < d.elements; ++i) {
    const double av = x[i];
    const double bv = y[i];
    d.nan_a += std::isnan(av) ? 1 : 0;
    d.inf_a += std::isinf(av) ? 1 : 0;
    d.nan_b += std::isnan(bv) ? 1 : 0;
    d.inf_b += std::isinf(bv) ? 1 : 0;
    double excess = std::numeric_limits<double>::infinity();
    if (std::isfinite(av) && std::isfinite(bv)) {
      const double diff = std::fabs(av - bv);
      const double allowed = tol.atol + tol.rtol * std::fabs(bv);
      d.max_abs = std::fmax(d.max_abs, diff);
      max_a = std::fmax(max_a, std::fabs(av));
      max_b = std::fmax(max_b, std::fabs(bv));
      if (std::fabs(bv) > tol.atol) d.max_rel = std::fmax(d.max_rel, diff / std::fabs(bv));
      if (diff > allowed) ++d.mismatches;
      excess = diff - allowed;
    } else {
      ++d.mismatches;
    }
    if (excess > worst_excess) {
      worst_excess = excess;
      d.worst_flat = i;
      d.worst_a = av;
      d.worst_b = bv;
    }
  }
  const double scale = std::fmax(max_a, max_b);
  d.normalized = scale > 0 ? d.max_abs / scale : 0.0;
  if (d.worst_flat >= 0) d.worst_index = MultiIndex(d.shape, d.worst_flat);
  if (d.mismatches > 0) {
    std::vector<std::string> notes;
    for (auto [count, what] : {std::pair{d.nan_a, "NaN in A"}, std::pair{d.inf_a, "Inf in A"},
                               std::pair{d.nan_b, "NaN in B"}, std::pair{d.inf_b, "Inf in B"}}) {
      if (count > 0) notes.push_back(fmt::format("{} {}", count, what));
    }
    d.problem = fmt::format("{} of {} elements out of tolerance{}{}; worst {}: {} vs {}",
                            d.mismatches, d.elements, notes.empty() ? "" : ", ",
                            fmt::join(notes, ", "), ShapeString(d.worst_index),
                            FormatValue(d.worst_a, d.dtype_a), FormatValue(d.worst_b, d.dtype_b));
  }
}

// The dimension along which two tensors differ only by vocabulary padding: the same rank,
// exactly one dimension different, both dumps of a model with the same vocab_size V and both
// sizes >= V there (Megatron pads the vocabulary to a multiple of
// make_vocab_size_divisible_by * t, so two layouts may pad it differently).
std::optional<int> PaddedVocabDim(const DumpTensor& a, const DumpTensor& b,
                                  const std::optional<int64_t>& vocab_a,
                                  const std::optional<int64_t>& vocab_b) {
  if (!vocab_a || vocab_a != vocab_b || a.full_shape.size() != b.full_shape.size()) {
    return std::nullopt;
  }
  std::optional<int> dim;
  for (size_t k = 0; k < a.full_shape.size(); ++k) {
    if (a.full_shape[k] == b.full_shape[k]) continue;
    if (dim || a.full_shape[k] < *vocab_a || b.full_shape[k] < *vocab_a) return std::nullopt;
    dim = static_cast<int>(k);
  }
  return dim;
}

// The first `keep` entries along dim k of a float64 tensor of `shape`.
Tensor LeadingAlong(const Tensor& full, const Shape& shape, size_t k, int64_t keep) {
  Shape out_shape = shape;
  out_shape[k] = keep;
  int64_t outer = 1, inner = 1;
  for (size_t i = 0; i < k; ++i) outer *= shape[i];
  for (size_t i = k + 1; i < shape.size(); ++i) inner *= shape[i];
  Tensor out = Tensor::HostEmpty(out_shape, DType::kFloat64);
  const double* in = full.data_as<double>();
  double* o = out.data_as<double>();
  for (int64_t p = 0; p < outer; ++p) {
    std::copy(in + p * shape[k] * inner, in + (p * shape[k] + keep) * inner, o + p * keep * inner);
  }
  return out;
}

// The world ranks whose shard of `t` holds the element at multi-index `index` of the full
// tensor (every rank of a dimension's copies; a partial sum's summands all hold it).
std::vector<int64_t> HoldersOf(const DumpTensor& t, const Shape& index) {
  std::vector<int64_t> ranks;
  for (const DumpShard& shard : t.shards) {
    bool holds = true;
    for (size_t d = 0; holds && d < index.size(); ++d) {
      const int dim = static_cast<int>(d);
      bool split = false;
      for (const Placement& p : shard.spec.placements) split = split || p.dim == dim;
      if (!split) continue;
      const int64_t local = LocalShape(shard.spec, t.full_shape)[d];
      holds = false;
      for (int64_t l = 0; l < local && !holds; ++l) {
        holds = GlobalIndex(shard.spec, dim, t.full_shape[d], l) == index[d];
      }
    }
    if (holds) ranks.push_back(shard.rank);
  }
  return ranks;
}

TensorDiff DiffTensor(const Dump& a, const Dump& b, const std::string& name,
                      const DiffOptions& options) {
  TensorDiff d;
  d.name = name;
  const DumpTensor* ta = a.Find(name);
  const DumpTensor* tb = b.Find(name);
  if (ta != nullptr) d.dtype_a = ta->dtype;
  if (tb != nullptr) d.dtype_b = tb->dtype;
  d.shape = ta != nullptr ? ta->full_shape : tb->full_shape;
  d.precision = LessPrecise(a.Precision(ta != nullptr ? ta->dtype : DType::kFloat64),
                            b.Precision(tb != nullptr ? tb->dtype : DType::kFloat64));
  d.tolerance = DiffTolerance(d.precision, d.precision, options);
  if (ta != nullptr && tb != nullptr && ta->budget && tb->budget && !options.atol &&
      !options.ntol && !options.rtol) {
    // Each side is within its budget of the exact value, so the two are within the sum.
    d.tolerance = {ta->budget->atol + tb->budget->atol, ta->budget->rtol + tb->budget->rtol, 0};
    d.budgeted = true;
  }
  if (ta == nullptr || tb == nullptr) {
    d.problem = ta == nullptr ? "only in B" : "only in A";
    return d;
  }
  const std::optional<int> vocab_dim = PaddedVocabDim(*ta, *tb, a.vocab_size(), b.vocab_size());
  if (ta->full_shape != tb->full_shape && !vocab_dim) {
    d.problem = fmt::format("shape {} in A but {} in B", ShapeString(ta->full_shape),
                            ShapeString(tb->full_shape));
    return d;
  }
  StatusOr<Tensor> full_a = a.Assemble(name);
  StatusOr<Tensor> full_b = b.Assemble(name);
  if (vocab_dim && full_a.ok() && full_b.ok()) {
    const size_t k = static_cast<size_t>(*vocab_dim);
    const int64_t vocab = *a.vocab_size();
    d.note = fmt::format("compared the {} real vocabulary entries of dim {} (padded to {} in A, "
                         "{} in B)",
                         vocab, k, ta->full_shape[k], tb->full_shape[k]);
    full_a = LeadingAlong(*full_a, ta->full_shape, k, vocab);
    full_b = LeadingAlong(*full_b, tb->full_shape, k, vocab);
    d.shape[k] = vocab;
  }
  if (!full_a.ok() || !full_b.ok()) {
    std::vector<std::string> problems;
    if (!full_a.ok()) problems.push_back("A: " + full_a.status().what());
    if (!full_b.ok()) problems.push_back("B: " + full_b.status().what());
    d.problem = fmt::format("{}", fmt::join(problems, "; "));
    return d;
  }
  d.compared = true;
  CompareValues(*full_a, *full_b, d);
  d.pass = d.problem.empty();
  if (!d.pass && d.worst_flat >= 0) {
    d.worst_ranks_a = HoldersOf(*ta, d.worst_index);
    d.worst_ranks_b = HoldersOf(*tb, d.worst_index);
  }
  return d;
}

Status CheckOverride(const std::optional<double>& value, const char* name) {
  if (value && !(std::isfinite(*value) && *value >= 0)) {
    return Status::Error(name, fmt::format("must be a finite number >= 0, got {}", *value));
  }
  return Status();
}

Json Number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

Json ToleranceJson(const Tolerance& t) {
  return Json{{"atol", t.atol}, {"ntol", t.ntol}, {"rtol", t.rtol}};
}

std::string ToleranceText(const Tolerance& t) {
  if (t.ntol > 0) return fmt::format("atol {:g} ntol {:g} rtol {:g}", t.atol, t.ntol, t.rtol);
  return fmt::format("atol {:g} rtol {:g}", t.atol, t.rtol);
}

constexpr DType kAllDTypes[] = {DType::kFloat64, DType::kFloat32, DType::kFloat16,
                                DType::kBFloat16};

}  // namespace

// ---------------------------------------------------------------------------------------
// Dump

const DumpTensor* Dump::Find(std::string_view name) const {
  for (const DumpTensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

StatusOr<Tensor> Dump::Assemble(std::string_view name) const {
  const DumpTensor* t = Find(name);
  if (t == nullptr) return Status::Error(std::string(name), "is not in the dump");
  // One representative per key; every other copy must equal it.
  std::map<ShardKey, const DumpShard*> pieces;
  for (const DumpShard& s : t->shards) {
    auto [it, inserted] = pieces.emplace(KeyOf(*t, s), &s);
    if (!inserted) MPUSIM_RETURN_IF_ERROR(CheckCopies(*t, *it->second, s));
  }
  // Nothing to place (and AssembleFull would size index tables by the local dimensions,
  // which a zero-size dimension elsewhere leaves unbounded).
  if (NumElements(t->full_shape) == 0) return Tensor::HostZeros(t->full_shape, DType::kFloat64);
  // Keys sort by tp_rank first for a partial sum: one AssembleFull per tp_rank for a
  // partial sum, whose results are added in tp_rank order.
  Tensor full;
  auto it = pieces.begin();
  while (it != pieces.end()) {
    std::vector<Tensor> shards;
    std::vector<ShardSpec> specs;
    const int64_t first = t->partial_sum ? it->first.front() : 0;
    for (; it != pieces.end() && (!t->partial_sum || it->first.front() == first); ++it) {
      shards.push_back(it->second->tensor);
      specs.push_back(it->second->spec);
    }
    StatusOr<Tensor> placed = AssembleFull(shards, specs, t->full_shape);
    // LoadDump checked layouts and coverage, so this is a reader bug if it ever happens.
    if (!placed.ok()) return Status::Error(std::string(name), placed.status().Message());
    Tensor wide = placed->dtype() == DType::kFloat64 ? *placed : HostToFloat64(*placed);
    if (!full.defined()) {
      full = std::move(wide);
      continue;
    }
    double* out = full.data_as<double>();
    const double* in = wide.data_as<double>();
    for (int64_t i = 0; i < full.numel(); ++i) out[i] += in[i];
  }
  return full;
}

StatusOr<Dump> LoadDump(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return Status::Error(dir, fs::exists(dir, ec) ? "is not a directory" : "no such directory");
  }
  const std::string manifest_path = (fs::path(dir) / "manifest.json").string();
  if (fs::is_directory(manifest_path, ec)) {
    return Status::Error(manifest_path, "is a directory, not a file");
  }
  StatusOr<std::string> text = ReadJsonText(manifest_path);
  if (!text.ok()) {
    return Status::Error(manifest_path,
                         fmt::format("cannot be read: {} (is this a `mpusim run --dump` "
                                     "directory?)",
                                     text.status().Message()));
  }
  StatusOr<Json> json = ParseJson(*text);
  if (!json.ok()) return Status::Error(manifest_path, json.status().Message());
  StatusOr<Manifest> manifest = ParseManifest(*json);
  if (!manifest.ok()) return Status::Error(manifest_path, manifest.status().Message());

  Dump dump;
  dump.dir_ = dir;
  // The model's real vocabulary, for tensors whose padded vocabulary differs between layouts.
  if (json->contains("config") && (*json)["config"].is_object() &&
      (*json)["config"].contains("model") && (*json)["config"]["model"].is_object()) {
    const Json& model = (*json)["config"]["model"];
    if (model.contains("vocab_size") && model["vocab_size"].is_number_integer() &&
        model["vocab_size"].get<int64_t>() > 0) {
      dump.vocab_size_ = model["vocab_size"].get<int64_t>();
    }
  }
  dump.backend_ = manifest->backend;
  dump.storage_ = manifest->storage;
  dump.world_size_ = manifest->world_size;
  std::map<std::string, size_t> index;
  for (const ManifestTensor& mt : manifest->tensors) {
    index[mt.name] = dump.tensors_.size();
    DumpTensor t;
    t.name = mt.name;
    t.full_shape = mt.full_shape;
    t.dtype = mt.dtype;
    t.budget = mt.budget;
    dump.tensors_.push_back(std::move(t));
  }
  std::set<int64_t> tp_ranks;
  for (size_t r = 0; r < manifest->files.size(); ++r) {
    const std::string path = (fs::path(dir) / manifest->files[r]).string();
    StatusOr<SafetensorsFile> file = ReadSafetensors(path);
    if (!file.ok()) return Status::Error(path, file.status().Message());
    const auto info_it = file->metadata.find(std::string(kRankInfoKey));
    if (info_it == file->metadata.end()) {
      return Status::Error(path, "__metadata__: missing key 'mpusim' (the rank's coordinates)");
    }
    StatusOr<RankInfo> info = ParseRankInfo(info_it->second);
    if (!info.ok()) {
      return Status::Error(path, fmt::format("__metadata__.mpusim: {}", info.status().Message()));
    }
    if (info->rank != static_cast<int64_t>(r)) {
      return Status::Error(path, fmt::format("__metadata__.mpusim: rank {}, but the manifest "
                                             "lists this file as files[{}]",
                                             info->rank, r));
    }
    if (info->run_id != manifest->run_id) {
      const auto shown = [](const std::string& id) {
        return id.empty() ? std::string("none") : "'" + id + "'";
      };
      return Status::Error(
          path, fmt::format("__metadata__.mpusim: run_id {}, but the manifest's run_id is {}: "
                            "this file comes from another run than manifest.json; dump the run "
                            "again into an empty directory",
                            shown(info->run_id), shown(manifest->run_id)));
    }
    tp_ranks.insert(info->tp_rank);
    std::set<std::string> in_file;
    for (NamedTensor& named : file->tensors) {
      const std::string where = fmt::format("tensor '{}'", named.name);
      in_file.insert(named.name);
      const auto found = index.find(named.name);
      if (found == index.end()) {
        return Status::Error(path, where + ": is not in the manifest's tensor list");
      }
      DumpTensor& t = dump.tensors_[found->second];
      const auto meta = file->metadata.find(named.name);
      if (meta == file->metadata.end()) {
        return Status::Error(path, where + ": has no sharding metadata in __metadata__");
      }
      StatusOr<ShardMetadata> m = ParseShardMetadata(meta->second);
      if (!m.ok()) {
        return Status::Error(path,
                             fmt::format("__metadata__.{}: {}", named.name, m.status().Message()));
      }
      if (m->full_shape != t.full_shape) {
        return Status::Error(
            path, fmt::format("__metadata__.{}: full_shape {} but the manifest "
                              "says {}",
                              named.name, ShapeString(m->full_shape), ShapeString(t.full_shape)));
      }
      if (named.tensor.dtype() != t.dtype) {
        return Status::Error(path,
                             fmt::format("{}: dtype {} but the manifest says {}", where,
                                         DTypeName(named.tensor.dtype()), DTypeName(t.dtype)));
      }
      const Shape local = LocalShape(m->spec, t.full_shape);
      if (named.tensor.shape() != local) {
        return Status::Error(
            path, fmt::format("{}: shape {}, but a shard of {} under its "
                              "metadata ({}) has shape {}",
                              where, ShapeString(named.tensor.shape()), ShapeString(t.full_shape),
                              LayoutString(m->spec, m->partial_sum), ShapeString(local)));
      }
      if (t.shards.empty()) {
        t.partial_sum = m->partial_sum;
      } else if (!SameLayout(t, m->spec, m->partial_sum)) {
        return Status::Error(
            path, fmt::format("{}: layout ({}) differs from rank {}'s ({})", where,
                              LayoutString(m->spec, m->partial_sum), t.shards.front().rank,
                              LayoutString(t.shards.front().spec, t.partial_sum)));
      }
      t.shards.push_back(
          {static_cast<int64_t>(r), info->tp_rank, m->spec, std::move(named.tensor)});
    }
    for (const auto& [key, unused] : file->metadata) {
      if (key != kRankInfoKey && in_file.count(key) == 0) {
        return Status::Error(path, fmt::format("__metadata__.{}: describes a tensor that is not "
                                               "in the file",
                                               key));
      }
    }
  }
  dump.tp_size_ = static_cast<int64_t>(tp_ranks.size());
  for (const DumpTensor& t : dump.tensors_) {
    if (t.shards.empty()) {
      return Status::Error(
          dir, fmt::format("tensor '{}': is in the manifest but in no rank file", t.name));
    }
    const Status covered = CheckCoverage(t, tp_ranks);
    if (!covered.ok()) return Status::Error(dir, covered.Message());
  }
  return dump;
}

// ---------------------------------------------------------------------------------------
// DiffDumps and its renderings

DType Dump::Precision(DType tensor_dtype) const {
  return storage_ ? LessPrecise(tensor_dtype, *storage_) : tensor_dtype;
}

Tolerance DiffTolerance(DType a, DType b, const DiffOptions& options) {
  Tolerance tol = DefaultTolerance(LessPrecise(a, b));
  if (options.atol) tol.atol = *options.atol;
  if (options.ntol) tol.ntol = *options.ntol;
  if (options.rtol) tol.rtol = *options.rtol;
  return tol;
}

StatusOr<DiffResult> DiffDumps(const Dump& a, const Dump& b, const DiffOptions& options) {
  MPUSIM_RETURN_IF_ERROR(CheckOverride(options.atol, "atol"));
  MPUSIM_RETURN_IF_ERROR(CheckOverride(options.ntol, "ntol"));
  MPUSIM_RETURN_IF_ERROR(CheckOverride(options.rtol, "rtol"));
  std::vector<std::string> available;
  for (const DumpTensor& t : a.tensors()) available.push_back(t.name);
  for (const DumpTensor& t : b.tensors()) {
    if (a.Find(t.name) == nullptr) available.push_back(t.name);
  }
  std::vector<std::string> names;
  if (options.tensors.empty()) {
    names = available;
  } else {
    for (const std::string& name : options.tensors) {
      if (a.Find(name) == nullptr && b.Find(name) == nullptr) {
        return Status::Error("tensors", fmt::format("'{}' is in neither dump; available: {}", name,
                                                    fmt::join(available, ", ")));
      }
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
  }
  DiffResult result;
  auto summary = [](const Dump& dump) {
    return DumpSummary{dump.dir(), dump.backend(), dump.world_size(), dump.tp_size(),
                       static_cast<int64_t>(dump.tensors().size())};
  };
  result.a = summary(a);
  result.b = summary(b);
  for (DType d : kAllDTypes) result.policy.emplace_back(d, DiffTolerance(d, d, options));
  for (const std::string& name : names) {
    result.tensors.push_back(DiffTensor(a, b, name, options));
    ++(result.tensors.back().pass ? result.passed : result.failed);
  }
  return result;
}

std::string DiffText(const DiffResult& r) {
  auto side = [](const char* label, const DumpSummary& d) {
    return fmt::format("{}: {} ({}{} rank{}, tp {}, {} tensors)\n", label, d.dir,
                       d.backend.empty() ? "" : d.backend + ", ", d.world_size,
                       d.world_size == 1 ? "" : "s", d.tp_size, d.tensors);
  };
  std::string out = side("A", r.a) + side("B (expected)", r.b);
  std::vector<std::string> policies;
  for (const auto& [dtype, tol] : r.policy) {
    policies.push_back(fmt::format("{} {}", DTypeName(dtype), ToleranceText(tol)));
  }
  out += fmt::format(
      "pass when |a - b| <= atol + ntol * max|b| + rtol * |b| and both are finite; the least "
      "precise dtype of the tensor on either side and of the runs' storage picks the "
      "tolerance: {}\n",
      fmt::join(policies, ", "));
  const auto budgeted = std::count_if(r.tensors.begin(), r.tensors.end(),
                                      [](const TensorDiff& d) { return d.budgeted; });
  if (budgeted > 0) {
    out += fmt::format(
        "{} of {} tensors carry error budgets in both dumps (their runs' checks against the "
        "float64 reference): those are allowed the sum of the two budgets instead\n",
        budgeted, r.tensors.size());
  }
  size_t width = 26;
  for (const TensorDiff& d : r.tensors) width = std::max(width, d.name.size());
  out += fmt::format("  {:<{}} {:<16} {:<7} {:>12} {:>12} {:>12}  {}\n", "tensor", width, "shape",
                     "dtypes", "max abs err", "max rel err", "normalized", "result");
  for (const TensorDiff& d : r.tensors) {
    const std::string dtypes = DTypeShort(d.dtype_a) + "/" + DTypeShort(d.dtype_b);
    std::string verdict = d.pass ? "pass" : "FAIL (" + d.problem + ")";
    if (!d.note.empty()) verdict = fmt::format("{} ({})", verdict, d.note);
    if (d.compared) {
      out += fmt::format("  {:<{}} {:<16} {:<7} {:>12.3g} {:>12.3g} {:>12.3g}  {}\n", d.name, width,
                         ShapeString(d.shape), dtypes, d.max_abs, d.max_rel, d.normalized, verdict);
    } else {
      out += fmt::format("  {:<{}} {:<16} {:<7} {:>12} {:>12} {:>12}  {}\n", d.name, width,
                         ShapeString(d.shape), dtypes, "-", "-", "-", verdict);
    }
  }
  out += fmt::format("{} passed, {} failed\n", r.passed, r.failed);
  // Where to start looking: A's manifest lists a run's tensors in the order it produced them.
  for (const TensorDiff& d : r.tensors) {
    if (d.pass) continue;
    out += fmt::format("first to differ, in the order A's run produced its tensors: {}", d.name);
    if (d.compared && d.worst_flat >= 0) {
      out += fmt::format(", worst element {} on rank{} {} of A (rank{} {} of B)",
                         ShapeString(d.worst_index), d.worst_ranks_a.size() == 1 ? "" : "s",
                         fmt::join(d.worst_ranks_a, ", "), d.worst_ranks_b.size() == 1 ? "" : "s",
                         fmt::join(d.worst_ranks_b, ", "));
    } else {
      out += fmt::format(": {}", d.problem);
    }
    out += '\n';
    break;
  }
  return out;
}

std::string DiffJson(const DiffResult& r) {
  Json j;
  j["schema_version"] = 1;
  j["a"] = r.a.dir;
  j["b"] = r.b.dir;
  j["tolerance"] = {{"rule", "|a - b| <= atol + ntol * max|b| + rtol * |b|, both finite"}};
  for (const auto& [dtype, tol] : r.policy) {
    j["tolerance"][std::string(DTypeName(dtype))] = ToleranceJson(tol);
  }
  Json tensors = Json::array();
  for (const TensorDiff& d : r.tensors) {
    Json t;
    const Json null;
    auto dtype = [](const std::optional<DType>& x) {
      return x ? Json(std::string(DTypeName(*x))) : Json();
    };
    t["name"] = d.name;
    t["shape"] = d.shape;
    t["dtype_a"] = dtype(d.dtype_a);
    t["dtype_b"] = dtype(d.dtype_b);
    t["precision"] = std::string(DTypeName(d.precision));
    t["budgeted"] = d.budgeted;
    t["atol"] = d.tolerance.atol;
    t["ntol"] = d.tolerance.ntol;
    t["rtol"] = d.tolerance.rtol;
    t["elements"] = d.compared ? Json(d.elements) : null;
    t["mismatches"] = d.compared ? Json(d.mismatches) : null;
    t["max_abs"] = d.compared ? Number(d.max_abs) : null;
    t["max_rel"] = d.compared ? Number(d.max_rel) : null;
    t["normalized"] = d.compared ? Number(d.normalized) : null;
    if (d.compared && d.worst_flat >= 0) {
      t["worst"] = {{"index", d.worst_index},     {"flat_index", d.worst_flat},
                    {"a", Number(d.worst_a)},     {"b", Number(d.worst_b)},
                    {"ranks_a", d.worst_ranks_a}, {"ranks_b", d.worst_ranks_b}};
    } else {
      t["worst"] = null;
    }
    t["nan_a"] = d.compared ? Json(d.nan_a) : null;
    t["inf_a"] = d.compared ? Json(d.inf_a) : null;
    t["nan_b"] = d.compared ? Json(d.nan_b) : null;
    t["inf_b"] = d.compared ? Json(d.inf_b) : null;
    t["pass"] = d.pass;
    t["problem"] = d.pass ? null : Json(d.problem);
    t["note"] = d.note.empty() ? null : Json(d.note);
    tensors.push_back(std::move(t));
  }
  j["tensors"] = std::move(tensors);
  j["passed"] = r.passed;
  j["failed"] = r.failed;
  // Directory names come from the command line and need not be UTF-8.
  return j.dump(1, ' ', false, Json::error_handler_t::replace) + "\n";
}

}  // namespace mpusim
