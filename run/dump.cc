// The dump writer (see dump.h).
#include "run/dump.h"

#include <mpi.h>

#include <filesystem>
#include <map>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "mpi/agree.h"
#include "mpi/mpi_check.h"

namespace mpusim::run {

std::string ShardMetadataJson(const TensorRecord& r) {
  nlohmann::ordered_json j;
  j["full_shape"] = r.full_shape;
  j["shard_dim"] = r.shard.shard_dim;
  j["num_shards"] = r.shard.num_shards;
  j["shard_index"] = r.shard.shard_index;
  j["stride"] = r.shard.stride;
  if (r.shard.batch_dim >= 0) {
    j["batch_dim"] = r.shard.batch_dim;
    j["batch_shards"] = r.shard.batch_shards;
    j["batch_index"] = r.shard.batch_index;
  }
  if (r.partial_sum) j["partial_sum"] = true;
  return j.dump();
}

Status WriteDump(const DumpTarget& target, const RankCoordinates& coords,
                 const std::vector<TensorRecord>& records, const HostFetch& fetch,
                 std::vector<std::string>* lines) {
  namespace fs = std::filesystem;
  int world_rank = 0, world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  int made = 1;
  if (world_rank == 0) {
    std::error_code ec;
    fs::create_directories(target.dir, ec);
    if (ec) made = 0;
  }
  MPUSIM_MPI_CHECK(MPI_Bcast(&made, 1, MPI_INT, 0, MPI_COMM_WORLD));
  if (made == 0) {
    return Status::Error("--dump", fmt::format("cannot create directory '{}'", target.dir));
  }

  SafetensorsFile file;
  nlohmann::ordered_json rank_info;
  rank_info["rank"] = world_rank;
  rank_info["tp_rank"] = coords.tp;
  rank_info["dp_rank"] = coords.dp;
  rank_info["backend"] = target.backend;
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
  const std::string path =
      (fs::path(target.dir) / fmt::format("rank{:05d}.safetensors", world_rank)).string();
  const Status written = WriteSafetensors(path, file);
  file.tensors.clear();
  copies.clear();
  if (GatherErrors(written.ok() ? std::string() : path + ": " + written.Message(), lines)) {
    return Status::Error("--dump", fmt::format("writing '{}' failed", target.dir));
  }
  Status manifest_status;
  if (world_rank == 0) {
    nlohmann::ordered_json manifest;
    manifest["schema_version"] = 1;
    StatusOr<nlohmann::json> raw = ReadJsonFile(target.config_path);
    manifest["config"] = raw.ok() ? *raw : nlohmann::json(nullptr);
    manifest["world_size"] = world_size;
    manifest["backend"] = target.backend;
    manifest["dtype"] = DTypeName(target.dtype);
    nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
    for (const TensorRecord& r : records) {
      tensors.push_back({{"name", r.name},
                         {"full_shape", r.full_shape},
                         {"dtype", DTypeName(r.tensor.dtype())}});
    }
    manifest["tensors"] = tensors;
    std::vector<std::string> files;
    for (int r = 0; r < world_size; ++r) files.push_back(fmt::format("rank{:05d}.safetensors", r));
    manifest["files"] = files;
    manifest_status = WriteFileAtomically((fs::path(target.dir) / "manifest.json").string(),
                                          manifest.dump(1) + "\n");
  }
  if (GatherErrors(manifest_status.ok() ? std::string() : manifest_status.Message(), lines)) {
    return Status::Error("--dump", fmt::format("writing '{}' failed", target.dir));
  }
  return Status();
}

}  // namespace mpusim::run
