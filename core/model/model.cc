// BuildModel (see model.h): the one place that reads which model a config describes.
#include "core/model/model.h"

#include "core/model/gpt_model.h"
#include "core/model/graph.h"

namespace mpusim {

StatusOr<std::unique_ptr<Model>> BuildModel(const Config& config, const Topology& topology,
                                            const RankCoordinates& coords) {
  if (config.gpt) {
    StatusOr<std::unique_ptr<GptModel>> gpt = GptModel::Build(config, topology, coords);
    if (!gpt.ok()) return gpt.status();
    return std::unique_ptr<Model>(std::move(gpt).value());
  }
  if (!config.model) return Status::Error("model", "is required (see docs/simulator.md)");
  StatusOr<std::unique_ptr<Graph>> chain = Graph::Build(config, topology, coords);
  if (!chain.ok()) return chain.status();
  return std::unique_ptr<Model>(std::move(chain).value());
}

bool ConfigFileIsValid(const std::string& path) {
  StatusOr<nlohmann::json> document = ReadJsonFile(path);
  Config config;
  if (!document.ok() || !ParseConfig(*document, &config).ok()) return false;
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  if (!topology.ok()) return false;
  if (!config.has_model() || !config.run) return true;
  return BuildModel(config, *topology, topology->Coordinates(topology->first_rank())).ok();
}

}  // namespace mpusim
