// The CPU backend: EigenKernels and MPI communicators (one process = one simulated GPU).
#pragma once

#include "core/backend.h"
#include "sim/eigen_kernels.h"

namespace mpusim {

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  std::string Describe() const override;
  Kernels& kernels() override { return kernels_; }
  std::map<std::string, std::unique_ptr<Communicator>> MakeGroups(
      const Topology& topology, int64_t world_rank,
      const std::vector<std::string>& kinds) override;

 private:
  EigenKernels kernels_;
};

}  // namespace mpusim
