// Backend: what a device brings to the layer graph: its Kernels and, for each group kind of
// the planner, this rank's Communicator. sim/ provides the CPU backend (Eigen + MPI), cuda/
// the GPU backend (CUDA/cuBLAS + NCCL, or host-staged MPI).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "core/kernels.h"
#include "core/topology.h"

namespace mpusim {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cpu", "cuda" (recorded in dumps)
  virtual Kernels& kernels() = 0;
  // This rank's communicator for each kind in `kinds` (kinds whose groups leave this rank
  // out get no entry). Collective: every rank of the run calls it with the same kinds.
  virtual std::map<std::string, std::unique_ptr<Communicator>> MakeGroups(
      const Topology& topology, int64_t world_rank, const std::vector<std::string>& kinds) = 0;
};

}  // namespace mpusim
