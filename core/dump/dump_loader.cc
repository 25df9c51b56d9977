// The dump reader (see diff.h): LoadDump reads a `mpusim run --dump` directory, its
// manifest.json and every rank file the manifest lists, and turns them into a Dump of
// sharded tensors.
//
// What it is: host-only code on nlohmann/json and fmt for untrusted input; every field of a
// dump is checked before it is used to index anything, so a corrupt dump is a Status, never
// a crash. What it is not: a tolerant reader. A dump that does not describe a consistent
// tensor is refused rather than compared on a guess. Copies that disagree are found later,
// by Dump::Assemble (diff.cc).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "core/config/strict_json.h"
#include "core/dump/diff.h"
#include "core/dump/safetensors.h"
#include "core/dump/shard_key.h"
#include "core/sharding.h"

namespace mpusim {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
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
  std::optional<FlatConfig> config;         // "config": the run's effective config
  std::optional<std::string> command_line;  // "command_line"; absent before it was written
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

// One entry of the manifest's "tensors": {name, full_shape, dtype[, budget]}. `seen` holds
// the names of the entries before it (a name is listed once).
StatusOr<ManifestTensor> ParseManifestTensor(const Json& t, const std::string& where,
                                             std::set<std::string>& seen) {
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
  return mt;
}

// Required keys are checked strictly. "dtype" (the run's storage dtype) is optional and, when
// present, picks the tolerance (see diff.h). "config" (an object, or null when an old writer
// could not read the file), "config_file" and "command_line" (strings) are optional: dumps
// written before them stay readable; diff compares the configs before the tensors. Other
// top-level keys (anything a later writer adds to describe the run) are descriptive: no value
// read here depends on them, and schema_version guards changes of meaning.
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
  if (j.contains("config")) {
    if (!j["config"].is_object() && !j["config"].is_null()) {
      return Status::Error("config", fmt::format("must be an object (the run's config) or null, "
                                                 "got {}",
                                                 Brief(j["config"])));
    }
    if (j["config"].is_object()) m.config = FlattenConfig(j["config"]);
  }
  for (const char* key : {"config_file", "command_line"}) {
    if (j.contains(key) && !j[key].is_string()) {
      return Status::Error(key, fmt::format("must be a string, got {}", Brief(j[key])));
    }
  }
  if (j.contains("command_line")) m.command_line = j["command_line"].get<std::string>();
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
    StatusOr<ManifestTensor> mt =
        ParseManifestTensor(tensors[i], fmt::format("tensors[{}]", i), seen);
    if (!mt.ok()) return mt.status();
    m.tensors.push_back(std::move(*mt));
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

// {"full_shape": [...], "placements": [{"axis", "dim", "shards", "index", "stride"
// [, "load_balanced": true]}, ...] [, "partial_sum": true]}, placements outermost first (core/sharding.h). Unknown keys are
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
      if (kPlacementKeys.count(key) == 0 && key != "load_balanced") {
        return Status::Error("", fmt::format("{}: unknown key '{}'; allowed: {}, load_balanced",
                                             where, key, fmt::join(kPlacementKeys, ", ")));
      }
    }
    bool load_balanced = false;
    if (p.contains("load_balanced")) {
      if (!p["load_balanced"].is_boolean()) {
        return Status::Error("", fmt::format("{}.load_balanced must be true or false, got {}",
                                             where, Brief(p["load_balanced"])));
      }
      load_balanced = p["load_balanced"].get<bool>();
    }
    for (const std::string& key : kPlacementKeys) {
      if (!p.contains(key)) {
        return Status::Error("", fmt::format("{}: missing key '{}'", where, key));
      }
    }
    const std::optional<ShardAxis> axis =
        p["axis"].is_string() ? ParseShardAxis(p["axis"].get<std::string>()) : std::nullopt;
    if (!axis) {
      return Status::Error("", fmt::format("{}.axis must be one of tp, dp, cp, ep, etp, got {}", where,
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
        {*axis, static_cast<int>(values[0]), values[1], values[2], values[3], load_balanced});
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

// ---------------------------------------------------------------------------------------
// LoadDump's steps.

// DIR/manifest.json as JSON. Errors name the manifest's path.
StatusOr<Json> ReadManifestJson(const std::string& manifest_path) {
  std::error_code ec;
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
  return json;
}

// The model's real vocabulary (manifest "config.model.vocab_size"), for tensors whose padded
// vocabulary differs between layouts. The config is descriptive, so a missing or odd value
// is no error: the dump then has no vocab_size.
std::optional<int64_t> ConfigVocabSize(const Json& manifest) {
  if (manifest.contains("config") && manifest["config"].is_object() &&
      manifest["config"].contains("model") && manifest["config"]["model"].is_object()) {
    const Json& model = manifest["config"]["model"];
    if (model.contains("vocab_size") && model["vocab_size"].is_number_integer() &&
        model["vocab_size"].get<int64_t>() > 0) {
      return model["vocab_size"].get<int64_t>();
    }
  }
  return std::nullopt;
}

// The manifest's tensors, still without shards, in manifest order.
std::vector<DumpTensor> EmptyTensors(const Manifest& manifest) {
  std::vector<DumpTensor> tensors;
  for (const ManifestTensor& mt : manifest.tensors) {
    DumpTensor t;
    t.name = mt.name;
    t.full_shape = mt.full_shape;
    t.dtype = mt.dtype;
    t.budget = mt.budget;
    tensors.push_back(std::move(t));
  }
  return tensors;
}

// The "mpusim" metadata of files[r] (at `path`): present, well formed, rank r, and from the
// manifest's run.
StatusOr<RankInfo> ReadRankInfo(const std::string& path, const SafetensorsFile& file, size_t r,
                                const Manifest& manifest) {
  const auto info_it = file.metadata.find(std::string(kRankInfoKey));
  if (info_it == file.metadata.end()) {
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
  if (info->run_id != manifest.run_id) {
    const auto shown = [](const std::string& id) {
      return id.empty() ? std::string("none") : "'" + id + "'";
    };
    return Status::Error(
        path, fmt::format("__metadata__.mpusim: run_id {}, but the manifest's run_id is {}: "
                          "this file comes from another run than manifest.json; dump the run "
                          "again into an empty directory",
                          shown(info->run_id), shown(manifest.run_id)));
  }
  return info;
}

// Checks one tensor of rank file `path` (world rank r) against the manifest and its own
// sharding metadata, then appends it to its DumpTensor in `tensors` (found through `index`,
// name -> position) as a shard.
Status AddShard(const std::string& path, size_t r, const RankInfo& info,
                const std::map<std::string, std::string>& metadata, NamedTensor& named,
                const std::map<std::string, size_t>& index, std::vector<DumpTensor>& tensors) {
  const std::string where = fmt::format("tensor '{}'", named.name);
  const auto found = index.find(named.name);
  if (found == index.end()) {
    return Status::Error(path, where + ": is not in the manifest's tensor list");
  }
  DumpTensor& t = tensors[found->second];
  const auto meta = metadata.find(named.name);
  if (meta == metadata.end()) {
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
    return Status::Error(path, fmt::format("{}: dtype {} but the manifest says {}", where,
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
    return Status::Error(path,
                         fmt::format("{}: layout ({}) differs from rank {}'s ({})", where,
                                     LayoutString(m->spec, m->partial_sum), t.shards.front().rank,
                                     LayoutString(t.shards.front().spec, t.partial_sum)));
  }
  t.shards.push_back({static_cast<int64_t>(r), info.tp_rank, m->spec, std::move(named.tensor)});
  return Status();
}

// Reads files[r] of the manifest and adds its tensors to `tensors` as shards of world rank
// r; records the file's tp_rank in `tp_ranks`. Every metadata entry but the rank's must
// describe a tensor of the file.
Status LoadRankFile(const std::string& dir, const Manifest& manifest, size_t r,
                    const std::map<std::string, size_t>& index, std::vector<DumpTensor>& tensors,
                    std::set<int64_t>& tp_ranks) {
  const std::string path = (fs::path(dir) / manifest.files[r]).string();
  StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  if (!file.ok()) return Status::Error(path, file.status().Message());
  StatusOr<RankInfo> info = ReadRankInfo(path, *file, r, manifest);
  if (!info.ok()) return info.status();
  tp_ranks.insert(info->tp_rank);
  std::set<std::string> in_file;
  for (NamedTensor& named : file->tensors) {
    in_file.insert(named.name);
    MPUSIM_RETURN_IF_ERROR(AddShard(path, r, *info, file->metadata, named, index, tensors));
  }
  for (const auto& [key, unused] : file->metadata) {
    if (key != kRankInfoKey && in_file.count(key) == 0) {
      return Status::Error(path, fmt::format("__metadata__.{}: describes a tensor that is not "
                                             "in the file",
                                             key));
    }
  }
  return Status();
}

}  // namespace

StatusOr<Dump> LoadDump(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return Status::Error(dir, fs::exists(dir, ec) ? "is not a directory" : "no such directory");
  }
  const std::string manifest_path = (fs::path(dir) / "manifest.json").string();
  StatusOr<Json> json = ReadManifestJson(manifest_path);
  if (!json.ok()) return json.status();
  StatusOr<Manifest> manifest = ParseManifest(*json);
  if (!manifest.ok()) return Status::Error(manifest_path, manifest.status().Message());

  Dump dump;
  dump.dir_ = dir;
  dump.vocab_size_ = ConfigVocabSize(*json);
  dump.config_ = std::move(manifest->config);
  dump.command_line_ = std::move(manifest->command_line);
  dump.backend_ = manifest->backend;
  dump.storage_ = manifest->storage;
  dump.world_size_ = manifest->world_size;
  dump.tensors_ = EmptyTensors(*manifest);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < dump.tensors_.size(); ++i) index[dump.tensors_[i].name] = i;
  std::set<int64_t> tp_ranks;
  for (size_t r = 0; r < manifest->files.size(); ++r) {
    MPUSIM_RETURN_IF_ERROR(LoadRankFile(dir, *manifest, r, index, dump.tensors_, tp_ranks));
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

}  // namespace mpusim
