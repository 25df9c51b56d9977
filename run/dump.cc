// The dump writer (see dump.h).
#include "run/dump.h"

#include <fmt/format.h>
#include <mpi.h>

#include <climits>
#include <filesystem>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <stdexcept>
#include <string_view>
#include <system_error>
#include <utility>

#include "core/dump/diff.h"
#include "core/dump/safetensors.h"
#include "mpi/agree.h"
#include "mpi/mpi_check.h"
#include "mpi/watchdog.h"

namespace mpusim::run {

std::string ShardMetadataJson(const TensorRecord& r) {
  nlohmann::ordered_json j;
  j["full_shape"] = r.full_shape;
  j["placements"] = nlohmann::ordered_json::array();
  for (const Placement& p : r.shard.placements) {
    nlohmann::ordered_json placement;
    placement["axis"] = std::string(ShardAxisName(p.axis));
    placement["dim"] = p.dim;
    placement["shards"] = p.shards;
    placement["index"] = p.index;
    placement["stride"] = p.stride;
    if (p.load_balanced) placement["load_balanced"] = true;
    j["placements"].push_back(std::move(placement));
  }
  if (r.partial_sum) j["partial_sum"] = true;
  return j.dump();
}

namespace {

namespace fs = std::filesystem;

// Rank 0's answer, the same on every rank: "" or the error.
std::string ShareFromRankZero(int world_rank, const std::string& message) {
  int length = world_rank == 0 ? static_cast<int>(message.size()) : 0;
  watched::Bcast(&length, 1, MPI_INT, 0, MPI_COMM_WORLD, WorldLabel());
  std::string shared = world_rank == 0 ? message : std::string(static_cast<size_t>(length), ' ');
  if (length > 0) watched::Bcast(shared.data(), length, MPI_CHAR, 0, MPI_COMM_WORLD, WorldLabel());
  return shared;
}

// Every rank's `text`, in rank order, on every rank.
int WorldRank() {
  int rank = 0;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}

// DIR's sibling ".<name>.mpusim-<what>-<run id>" (a prefix of it when run_id is empty), on
// DIR's file system so that renames are atomic.
fs::path Sibling(const std::string& dir, std::string_view what, const std::string& run_id) {
  fs::path path = fs::path(dir).lexically_normal();
  if (!path.has_filename()) path = path.parent_path();  // "out/" -> "out"
  const fs::path parent = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  return parent / fmt::format(".{}.mpusim-{}-{}", path.filename().string(), what, run_id);
}

// Removes what a dump to DIR that died left behind: ".<name>.mpusim-tmp-*" and "-old-*".
void RemoveStaleSiblings(const std::string& dir) {
  const fs::path tmp_prefix = Sibling(dir, "tmp", "");
  const std::string tmp = tmp_prefix.filename().string();
  const std::string old = Sibling(dir, "old", "").filename().string();
  std::error_code ec;
  for (fs::directory_iterator it(tmp_prefix.parent_path(), ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(tmp, 0) == 0 || name.rfind(old, 0) == 0) {
      std::error_code ignored;
      fs::remove_all(it->path(), ignored);
    }
  }
}

// "" when rank 0 may write a dump at DIR: it is absent, or a directory that is empty or
// holds a manifest.json (an earlier dump, replaced whole), and its parent can hold a new
// directory (checked by making and removing the temporary one).
std::string CheckDumpTarget(const std::string& dir, const std::string& run_id) {
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec)) return fmt::format("'{}' exists and is not a directory", dir);
    if (!fs::is_empty(dir, ec) && !fs::exists(fs::path(dir) / "manifest.json", ec)) {
      return fmt::format("'{}' exists and is not a mpusim dump (no manifest.json); choose a new "
                         "or empty directory",
                         dir);
    }
  }
  // The rule of every output flag (--summary, --trace): the directory it goes in must exist;
  // only the dump's own directory is made.
  fs::path target(dir);
  if (!target.has_filename()) target = target.parent_path();  // "out/" -> "out"
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  if (!fs::is_directory(parent, ec)) {
    return fmt::format("cannot write '{}': there is no directory '{}'", dir, parent.string());
  }
  const fs::path temp = Sibling(dir, "tmp", run_id);
  // create_directory, not create_directories: a missing parent is refused, not made.
  if (!fs::create_directory(temp, ec) || ec) {
    return fmt::format("cannot create a directory next to '{}' ({})", dir,
                       ec ? ec.message() : "it exists");
  }
  fs::remove_all(temp, ec);
  return "";
}

std::string NewRunId() {
  std::random_device device;
  std::string id;
  for (int i = 0; i < 4; ++i) id += fmt::format("{:08x}", device());
  return id;
}

}  // namespace

Status PrepareDump(DumpTarget* target) {
  const int world_rank = WorldRank();
  std::string run_id = world_rank == 0 ? NewRunId() : std::string(32, ' ');
  watched::Bcast(run_id.data(), 32, MPI_CHAR, 0, MPI_COMM_WORLD, WorldLabel());
  target->run_id = run_id;
  std::string problem;
  if (world_rank == 0) {
    RemoveStaleSiblings(target->dir);
    problem = CheckDumpTarget(target->dir, run_id);
  }
  problem = ShareFromRankZero(world_rank, problem);
  if (!problem.empty()) return Status::Error("--dump", problem);
  return {};
}

std::map<std::string, Tolerance> ErrorBudgets(const CheckResult& check) {
  std::map<std::string, Tolerance> budgets;
  for (const TensorCheck& c : check.tensors) {
    if (c.count > 0 && !c.missing && std::isfinite(c.budget_atol) && std::isfinite(c.allowed)) {
      budgets[c.name] = {c.budget_atol, c.allowed, 0};
    }
  }
  return budgets;
}

Status WriteDump(const DumpTarget& target, const RankCoordinates& coords,
                 const std::vector<TensorRecord>& records, const HostFetch& fetch,
                 const std::map<std::string, Tolerance>& budgets,
                 std::vector<std::string>* lines) {
  const int world_rank = WorldRank();
  int world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  // Everything goes to a temporary sibling first; it becomes DIR by one rename once the
  // manifest is in it, so DIR is either a complete dump or absent.
  const fs::path temp = Sibling(target.dir, "tmp", target.run_id);
  std::string made;
  if (world_rank == 0) {
    std::error_code ec;
    fs::create_directories(temp, ec);
    if (ec) made = fmt::format("cannot create directory '{}': {}", temp.string(), ec.message());
  }
  made = ShareFromRankZero(world_rank, made);
  if (!made.empty()) return Status::Error("--dump", made);
  const auto fail = [&](std::string_view what) {
    if (world_rank == 0) {
      std::error_code ignored;
      fs::remove_all(temp, ignored);
    }
    return Status::Error("--dump", fmt::format("{} '{}' failed", what, target.dir));
  };

  SafetensorsFile file;
  nlohmann::ordered_json rank_info;
  rank_info["rank"] = world_rank;
  rank_info["tp_rank"] = coords.tp;
  rank_info["dp_rank"] = coords.dp;
  rank_info["backend"] = target.backend;
  rank_info["run_id"] = target.run_id;
  file.metadata["mpusim"] = rank_info.dump();
  // One host copy per storage: aliases (a layer's input is the previous layer's output) share.
  std::map<std::pair<const void*, size_t>, Tensor> copies;
  for (const TensorRecord& r : records) {
    const std::pair<const void*, size_t> key{r.tensor.data(), r.tensor.bytes()};
    auto it = copies.find(key);
    if (it == copies.end()) it = copies.emplace(key, fetch(r)).first;
    file.tensors.push_back({r.name, it->second.Reshaped(r.tensor.shape())});
    file.metadata[r.name] = ShardMetadataJson(r);
  }
  const std::string path = (temp / fmt::format("rank{:05d}.safetensors", world_rank)).string();
  const Status written = WriteSafetensors(path, file);
  file.tensors.clear();
  copies.clear();
  if (GatherErrors(written.ok() ? std::string() : path + ": " + written.Message(), lines)) {
    return fail("writing");
  }
  // The manifest lists every rank's tensors (pipeline stages hold different ones), in rank
  // order, each once.
  nlohmann::ordered_json mine = nlohmann::ordered_json::array();
  for (const TensorRecord& r : records) {
    nlohmann::ordered_json entry = {
        {"name", r.name}, {"full_shape", r.full_shape}, {"dtype", DTypeName(r.tensor.dtype())}};
    const auto budget = budgets.find(r.name);
    if (budget != budgets.end()) {
      entry["budget"] = {{"atol", budget->second.atol}, {"rtol", budget->second.rtol}};
    }
    mine.push_back(std::move(entry));
  }
  const std::vector<std::string> lists = AllGatherStrings(mine.dump());
  std::string finished;
  if (world_rank == 0) {
    nlohmann::ordered_json manifest;
    manifest["schema_version"] = kDumpSchemaVersion;
    manifest["run_id"] = target.run_id;
    // What ran, not just the file: the config after the command line's overrides, and the
    // command line itself, so the dump says how it was made (mpusim diff compares them).
    manifest["config"] = target.config;
    manifest["config_file"] = target.config_path;
    manifest["command_line"] = target.command_line;
    manifest["world_size"] = world_size;
    manifest["backend"] = target.backend;
    manifest["dtype"] = DTypeName(target.dtype);
    nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
    std::set<std::string> listed;
    for (const std::string& list : lists) {
      for (const auto& entry : nlohmann::ordered_json::parse(list)) {
        if (listed.insert(entry["name"].get<std::string>()).second) tensors.push_back(entry);
      }
    }
    manifest["tensors"] = tensors;
    std::vector<std::string> files;
    for (int r = 0; r < world_size; ++r) files.push_back(fmt::format("rank{:05d}.safetensors", r));
    manifest["files"] = files;
    const Status status =
        WriteFileAtomically(
        (temp / "manifest.json").string(),
        // Arguments need not be UTF-8 (a directory's name); JSON text must be.
        manifest.dump(1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n");
    if (!status.ok()) finished = status.Message();
    // An earlier dump at DIR steps aside first (rename cannot replace a non-empty
    // directory), then the new one takes its name, then the old one is removed.
    std::error_code ec;
    const fs::path old = Sibling(target.dir, "old", target.run_id);
    const bool had_old = finished.empty() && fs::exists(target.dir, ec);
    if (had_old) {
      fs::rename(target.dir, old, ec);
      if (ec) finished = fmt::format("cannot move the earlier '{}' aside: {}", target.dir, ec.message());
    }
    if (finished.empty()) {
      fs::rename(temp, target.dir, ec);
      if (ec) finished = fmt::format("cannot rename '{}' to '{}': {}", temp.string(), target.dir, ec.message());
    }
    if (had_old) fs::remove_all(old, ec);
  }
  if (GatherErrors(finished, lines)) return fail("writing");
  return Status();
}

}  // namespace mpusim::run
