// RankContext: everything one rank needs to run the layer graph, passed explicitly (no
// globals): its place in the layout, its backend's Kernels, its groups' Communicators,
// the comm trace and the random streams.
#pragma once

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "core/communicator.h"
#include "core/kernels.h"
#include "core/rng.h"
#include "core/topology.h"

namespace mpusim {

// This rank's communicator for each group kind the layers use, as typed fields (not looked
// up by name): the mappings and layers take the group they run on as an argument, as
// Megatron's take `group`. A field is null when the run did not build that group.
struct RankGroups {
  std::unique_ptr<Communicator> tp;     // tensor model-parallel
  std::unique_ptr<Communicator> dp;     // data-parallel (the loss average)
  std::unique_ptr<Communicator> dp_cp;  // data x context parallel (gradient reduction)
  std::unique_ptr<Communicator> pp;     // pipeline stages (point-to-point between them)
  std::unique_ptr<Communicator> embd;   // first and last stage (tied embeddings); null on
                                        // the stages between

  // The kinds above, in Megatron's names, for backends' MakeGroups.
  static std::vector<std::string> Kinds() { return {"tp", "dp", "dp_cp", "pp", "embd"}; }
  // Moves the communicators named by Kinds() out of `made` (a backend's MakeGroups result).
  static RankGroups Take(std::map<std::string, std::unique_ptr<Communicator>>& made) {
    RankGroups groups;
    const auto take = [&made](const char* kind) {
      const auto it = made.find(kind);
      return it == made.end() ? nullptr : std::move(it->second);
    };
    groups.tp = take("tp");
    groups.dp = take("dp");
    groups.dp_cp = take("dp_cp");
    groups.pp = take("pp");
    groups.embd = take("embd");
    return groups;
  }
};

struct RankContext {
  const Topology* topology = nullptr;
  int64_t rank = 0;
  RankCoordinates coords;
  Kernels* kernels = nullptr;
  CommTrace* trace = nullptr;
  RngTracker rng;
  RankGroups groups;

  Communicator& tp() const { return Required(groups.tp, "tp"); }
  Communicator& dp() const { return Required(groups.dp, "dp"); }
  Communicator& dp_cp() const { return Required(groups.dp_cp, "dp_cp"); }
  Communicator& pp() const { return Required(groups.pp, "pp"); }
  Communicator* embd() const { return groups.embd.get(); }
  int64_t tp_size() const { return topology->sizes().tp; }
  int64_t tp_rank() const { return coords.tp; }

 private:
  static Communicator& Required(const std::unique_ptr<Communicator>& group, const char* kind) {
    if (group == nullptr) {
      throw std::logic_error(std::string("RankContext has no communicator for group kind '") +
                             kind + "'");
    }
    return *group;
  }
};

}  // namespace mpusim
