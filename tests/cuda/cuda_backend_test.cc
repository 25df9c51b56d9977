// MakeCudaBackend in one process (no MPI: it acts as local rank 0 of 1).
//
// The error paths that need no GPU run everywhere, including CI machines without one: no
// device visible, an unknown --comm, a bad MPUSIM_NCCL_TIMEOUT_S. The success path runs only
// where a device is visible and is skipped elsewhere.
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "core/backend.h"
#include "core/status.h"
#include "core/tensor.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_kernels.h"

namespace mpusim::cuda {
namespace {

bool DeviceVisible() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

// Sets an environment variable for one scope and restores the previous value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name); old != nullptr) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(MakeCudaBackendTest, WithoutADeviceReturnsAStatus) {
  if (DeviceVisible()) GTEST_SKIP() << "a CUDA device is visible: this tests the opposite";
  for (const char* comm : {"nccl", "mpi"}) {
    SCOPED_TRACE(comm);
    StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(comm);
    ASSERT_FALSE(made.ok());
    EXPECT_EQ(made.status().where(), "--backend cuda");
    EXPECT_EQ(made.status().what().rfind("no CUDA device is visible (cudaGetDeviceCount: ", 0), 0u)
        << made.status().Message();
    EXPECT_EQ(made.status().what().back(), ')') << made.status().Message();
  }
}

TEST(MakeCudaBackendTest, RejectsAnUnknownComm) {
  StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend("gloo");
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().where(), "--comm");
  EXPECT_NE(made.status().what().find("'gloo' is not nccl or mpi"), std::string::npos)
      << made.status().Message();
}

TEST(MakeCudaBackendTest, RejectsABadNcclTimeout) {
  for (const char* value : {"abc", "0", "-5", "10s", "inf"}) {
    SCOPED_TRACE(value);
    ScopedEnv env("MPUSIM_NCCL_TIMEOUT_S", value);
    StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend("nccl");
    ASSERT_FALSE(made.ok());
    EXPECT_EQ(made.status().where(), "MPUSIM_NCCL_TIMEOUT_S");
    EXPECT_NE(made.status().what().find("is not a positive number of seconds"), std::string::npos)
        << made.status().Message();
  }
}

TEST(MakeCudaBackendTest, WithADeviceBuildsTheCudaBackend) {
  if (!DeviceVisible()) GTEST_SKIP() << "no CUDA device is visible";
  ScopedEnv env("MPUSIM_NCCL_TIMEOUT_S", "12.5");
  for (const char* comm : {"nccl", "mpi"}) {
    SCOPED_TRACE(comm);
    StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(comm);
    ASSERT_TRUE(made.ok()) << made.status().Message();
    Backend& backend = **made;
    EXPECT_EQ(backend.name(), "cuda");
    ASSERT_NE(dynamic_cast<CudaKernels*>(&backend.kernels()), nullptr);
    Tensor host = Tensor::HostZeros({3}, DType::kFloat64);
    host.data_as<double>()[1] = 2.5;
    const Tensor device = backend.kernels().ToDevice(host);
    EXPECT_EQ(device.device(), Device::kCuda);
    EXPECT_EQ(backend.kernels().ToHost(device).data_as<double>()[1], 2.5);
  }
}

}  // namespace
}  // namespace mpusim::cuda
