// The GPU backend's communicators (NcclCommunicator for --comm nccl, HostStagedCommunicator
// for --comm mpi) on the planner's tp and dp groups, run under mpiexec -n K.
//
// Every rank calls MakeCudaBackend (collective) and the outcome is all-reduced, so either all
// ranks run a case or all skip it: without a GPU everything is skipped; with fewer GPUs than
// ranks on a node, the nccl case is skipped (NCCL needs one GPU per rank) and the mpi case
// runs with ranks sharing GPUs. Every collective runs in float32, float64, bfloat16 and
// float16 (ncclBfloat16 / ncclFloat16, or MpiCommunicator's 16-bit support behind the
// host-staged copies). Data are small integers, so every check is exact. No rank
// returns early between collectives (only EXPECTs after the groups exist), so a failing
// check cannot hang the job.
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/backend.h"
#include "core/config/parallel_config.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/topology.h"
#include "cuda/cuda_backend.h"
#include "mpi/mpi_check.h"

namespace mpusim::cuda {
namespace {

// Host values -> a device tensor of `dtype` (each rounded once to it, core/half.h).
Tensor ToDevice(Kernels& kernels, DType dtype, const std::vector<double>& values) {
  Tensor host = Tensor::HostZeros({static_cast<int64_t>(values.size())}, dtype);
  for (size_t e = 0; e < values.size(); ++e) SetHostValue(host, static_cast<int64_t>(e), values[e]);
  return kernels.ToDevice(host);
}

std::vector<double> Values(Kernels& kernels, const Tensor& device) {
  const Tensor host = kernels.ToHost(device);
  std::vector<double> v(static_cast<size_t>(host.numel()));
  for (size_t e = 0; e < v.size(); ++e) v[e] = HostValue(host, static_cast<int64_t>(e));
  return v;
}

// Every collective once on `comm`, checked against values computed from the group size.
// All values and partial sums are integers below 256, exact in every dtype (bfloat16 has
// 8 significant bits), so NCCL's 16-bit reductions are exact too.
void CheckCollectives(Kernels& kernels, Communicator& comm, DType dtype) {
  SCOPED_TRACE(DTypeName(dtype));
  const int rank = comm.Rank();
  const int size = comm.Size();
  const int n = 5;
  const size_t count = 5;

  std::vector<double> mine(count), sum(count), max(count);
  for (int e = 0; e < n; ++e) {
    mine[static_cast<size_t>(e)] = rank + 3 * e;
    sum[static_cast<size_t>(e)] = size * (size - 1) / 2 + 3.0 * size * e;
  }
  Tensor buffer = ToDevice(kernels, dtype, mine);
  comm.AllReduce(buffer, ReduceOp::kSum);
  EXPECT_EQ(Values(kernels, buffer), sum) << "all-reduce sum";

  for (int e = 0; e < n; ++e) {
    mine[static_cast<size_t>(e)] = (rank * 7 + e) % 5 - 2;
    double m = -1e300;
    for (int r = 0; r < size; ++r) m = std::max(m, static_cast<double>((r * 7 + e) % 5 - 2));
    max[static_cast<size_t>(e)] = m;
  }
  buffer = ToDevice(kernels, dtype, mine);
  comm.AllReduce(buffer, ReduceOp::kMax);
  EXPECT_EQ(Values(kernels, buffer), max) << "all-reduce max";

  std::vector<double> in(count), gathered;
  for (int e = 0; e < n; ++e) in[static_cast<size_t>(e)] = 10 * rank + e;
  for (int r = 0; r < size; ++r) {
    for (int e = 0; e < n; ++e) gathered.push_back(10 * r + e);
  }
  Tensor out = kernels.Empty({size * n}, dtype);
  comm.AllGather(ToDevice(kernels, dtype, in), out);
  EXPECT_EQ(Values(kernels, out), gathered) << "all-gather";

  // Chunk c of rank r holds r + 10 c + e; this rank receives the sum over r of chunk Rank().
  std::vector<double> chunks, scattered(count);
  for (int c = 0; c < size; ++c) {
    for (int e = 0; e < n; ++e) chunks.push_back(rank + 10 * c + e);
  }
  for (int e = 0; e < n; ++e) {
    scattered[static_cast<size_t>(e)] =
        size * (size - 1) / 2 + size * (10 * rank + e);
  }
  Tensor part = kernels.Empty({n}, dtype);
  comm.ReduceScatter(ToDevice(kernels, dtype, chunks), part);
  EXPECT_EQ(Values(kernels, part), scattered) << "reduce-scatter";

  // Chunk j of rank r holds r + 10 j + e and goes to rank j: this rank's chunk j is rank j's
  // chunk Rank(), j + 10 rank + e.
  std::vector<double> swapped;
  for (int j = 0; j < size; ++j) {
    for (int e = 0; e < n; ++e) swapped.push_back(j + 10 * rank + e);
  }
  Tensor exchanged = kernels.Empty({size * n}, dtype);
  comm.AllToAll(ToDevice(kernels, dtype, chunks), exchanged);
  EXPECT_EQ(Values(kernels, exchanged), swapped) << "all-to-all";

  // Uneven parts: rank r sends rank j (r + j) % 3 elements r + 10 j + e (some parts empty).
  std::vector<double> parts, received;
  std::vector<int64_t> send_counts, recv_counts;
  for (int j = 0; j < size; ++j) {
    send_counts.push_back((rank + j) % 3);
    recv_counts.push_back((j + rank) % 3);
    for (int e = 0; e < (rank + j) % 3; ++e) parts.push_back(rank + 10 * j + e);
    for (int e = 0; e < (j + rank) % 3; ++e) received.push_back(j + 10 * rank + e);
  }
  Tensor uneven = kernels.Empty({static_cast<int64_t>(received.size())}, dtype);
  comm.AllToAllV(ToDevice(kernels, dtype, parts), send_counts, uneven, recv_counts);
  EXPECT_EQ(Values(kernels, uneven), received) << "uneven all-to-all";

  const int root = size - 1;
  std::vector<double> from_root(count);
  for (int e = 0; e < n; ++e) {
    mine[static_cast<size_t>(e)] = 10 * rank + e;
    from_root[static_cast<size_t>(e)] = 10 * root + e;
  }
  buffer = ToDevice(kernels, dtype, mine);
  comm.Broadcast(buffer, root);
  EXPECT_EQ(Values(kernels, buffer), from_root) << "broadcast from " << root;
}

class CudaCommunicatorTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaCommunicatorTest, CollectivesOnTpAndDpGroups) {
  int world_rank = 0;
  int world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));

  StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(GetParam());
  int ok = made.ok() ? 1 : 0;
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  if (ok == 0) {
    GTEST_SKIP() << (made.ok() ? std::string("another rank could not make the backend")
                               : made.status().Message());
  }
  Backend& backend = **made;

  ParallelConfig config;
  config.world_size = world_size;
  config.tensor_model_parallel_size = world_size % 2 == 0 ? 2 : 1;
  StatusOr<Topology> topology = Topology::Create(config);
  ASSERT_TRUE(topology.ok()) << topology.status().Message();  // the same on every rank
  std::map<std::string, std::unique_ptr<Communicator>> groups =
      backend.MakeGroups(*topology, world_rank, {"tp", "dp"});
  ASSERT_EQ(groups.size(), 2u);  // every rank is in one tp and one dp group

  for (const char* kind : {"tp", "dp"}) {
    SCOPED_TRACE(kind);
    Communicator& comm = *groups.at(kind);
    const std::optional<GroupSlot> slot = topology->Locate(*topology->FindKind(kind), world_rank);
    EXPECT_EQ(comm.Rank(), slot->rank_in_group);
    EXPECT_EQ(comm.Size(), topology->GroupSize(*topology->FindKind(kind)));
    for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16}) {
      CheckCollectives(backend.kernels(), comm, dtype);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Comm, CudaCommunicatorTest, ::testing::Values("nccl", "mpi"),
                         [](const ::testing::TestParamInfo<std::string>& param_info) {
                           return param_info.param;
                         });

}  // namespace
}  // namespace mpusim::cuda
