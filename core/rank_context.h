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
  std::unique_ptr<Communicator> cp;     // context parallel (attention's keys and values)
  // hierarchical_context_parallel_sizes' two levels (cp_comm_type "a2a+p2p"; built only
  // then): the heads' all-to-all and the ring.
  std::unique_ptr<Communicator> hcp_L0;
  std::unique_ptr<Communicator> hcp_L1;
  std::unique_ptr<Communicator> pp;     // pipeline stages (point-to-point between them)
  std::unique_ptr<Communicator> embd;   // first and last stage (tied embeddings); null on
                                        // the stages between
  // The expert groups (built only when the experts are laid out apart:
  // DerivedSizes::experts_apart): the expert model-parallel group, the expert tensor-parallel
  // group an expert's slices are split over, the expert tensor x expert group the MoE
  // dispatcher exchanges tokens over, and the expert data-parallel group expert gradients
  // reduce over.
  std::unique_ptr<Communicator> ep;
  std::unique_ptr<Communicator> expt_tp;
  std::unique_ptr<Communicator> tp_ep;
  std::unique_ptr<Communicator> expt_dp;
  // The distributed optimizer's (core/train/optimizer.h); built only for it, and
  // inter_dist_opt only with num_distributed_optimizer_instances > 1.
  std::unique_ptr<Communicator> dp_cp_partial;   // dp within one instance
  std::unique_ptr<Communicator> expt_dp_partial;  // expt_dp within one instance (the
                                                  // experts laid out apart only)
  std::unique_ptr<Communicator> intra_dist_opt;  // every rank of one instance
  std::unique_ptr<Communicator> inter_dist_opt;  // the same position in every instance

  // The kinds above, in Megatron's names, for backends' MakeGroups: those of the
  // distributed optimizer with `distributed_optimizer` (and `instances` of it).
  // `experts`: the expert groups too; `hierarchical_cp`: hcp_L0 and hcp_L1.
  static std::vector<std::string> Kinds(bool distributed_optimizer = false, int64_t instances = 1,
                                        bool experts = false, bool hierarchical_cp = false) {
    std::vector<std::string> kinds = {"tp", "dp", "dp_cp", "cp", "pp", "embd"};
    if (hierarchical_cp) kinds.insert(kinds.end(), {"hcp_L0", "hcp_L1"});
    if (experts) kinds.insert(kinds.end(), {"ep", "expt_tp", "tp_ep", "expt_dp"});
    if (distributed_optimizer) {
      kinds.insert(kinds.end(), {"dp_cp_partial", "intra_dist_opt"});
      if (experts) kinds.emplace_back("expt_dp_partial");
      if (instances > 1) kinds.emplace_back("inter_dist_opt");
    }
    return kinds;
  }
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
    groups.cp = take("cp");
    groups.hcp_L0 = take("hcp_L0");
    groups.hcp_L1 = take("hcp_L1");
    groups.pp = take("pp");
    groups.embd = take("embd");
    groups.ep = take("ep");
    groups.expt_tp = take("expt_tp");
    groups.tp_ep = take("tp_ep");
    groups.expt_dp = take("expt_dp");
    groups.dp_cp_partial = take("dp_cp_partial");
    groups.expt_dp_partial = take("expt_dp_partial");
    groups.intra_dist_opt = take("intra_dist_opt");
    groups.inter_dist_opt = take("inter_dist_opt");
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
  Communicator& cp() const { return Required(groups.cp, "cp"); }
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
