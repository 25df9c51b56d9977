// RankContext: everything one rank needs to run the layer graph, passed explicitly (no
// globals): its place in the layout, its backend's Kernels, one Communicator per group kind,
// the comm trace and the random streams.
#pragma once

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

#include "core/communicator.h"
#include "core/kernels.h"
#include "core/rng.h"
#include "core/topology.h"

namespace mpusim {

struct RankContext {
  const Topology* topology = nullptr;
  int64_t rank = 0;
  RankCoordinates coords;
  Kernels* kernels = nullptr;
  CommTrace* trace = nullptr;
  RngTracker rng;
  std::map<std::string, std::unique_ptr<Communicator>, std::less<>> groups;

  Communicator& Group(std::string_view kind) const {
    const auto it = groups.find(kind);
    if (it == groups.end()) {
      throw std::logic_error("RankContext has no communicator for group kind '" +
                             std::string(kind) + "'");
    }
    return *it->second;
  }
  int64_t tp_size() const { return topology->sizes().tp; }
  int64_t tp_rank() const { return coords.tp; }
};

}  // namespace mpusim
