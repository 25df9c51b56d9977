// The CPU backend's caching allocator: a freed block goes to the next request of its size,
// storage outlives the cache handle, and what it holds is counted.
#include "sim/host_block_cache.h"

#include <cstdint>
#include <cstring>

#include <gtest/gtest.h>

#include "sim/eigen_kernels.h"

namespace mpusim {
namespace {

TEST(HostBlockCache, ReusesAFreedBlockOfTheSameSize) {
  std::shared_ptr<HostBlockCache> cache = HostBlockCache::Create();
  const void* first = nullptr;
  {
    Tensor a = cache->Empty({256, 4}, DType::kFloat32);
    first = a.data();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    EXPECT_EQ(cache->cached_bytes(), 0u);
  }
  EXPECT_GT(cache->cached_bytes(), 4096u);
  // Same byte size, other shape and dtype: the same block. Another size: a new one.
  Tensor b = cache->Empty({512}, DType::kFloat64);
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(cache->cached_bytes(), 0u);
  Tensor c = cache->Empty({100}, DType::kFloat32);
  EXPECT_NE(c.data(), first);
  Tensor d = cache->Empty({512}, DType::kFloat64);  // b still holds the cached block
  EXPECT_NE(d.data(), b.data());
}

TEST(HostBlockCache, StorageOutlivesTheKernels) {
  Tensor kept;
  {
    EigenKernels kernels;
    kept = kernels.Zeros({3, 5}, DType::kFloat64);
    Tensor freed = kernels.Empty({1000}, DType::kFloat32);
    static_cast<void>(freed);
  }
  // The kernels (and their cache handle) are gone; the tensor is still valid and zero.
  for (int64_t i = 0; i < kept.numel(); ++i) EXPECT_EQ(kept.data_as<double>()[i], 0.0);
}

TEST(HostBlockCache, ZerosFromAReusedBlockAreZero) {
  EigenKernels kernels;
  const void* block = nullptr;
  {
    Tensor dirty = kernels.Empty({64}, DType::kFloat32);
    std::memset(dirty.data(), 0xff, dirty.bytes());
    block = dirty.data();
  }
  EXPECT_GT(kernels.cached_bytes(), 0u);
  Tensor zeros = kernels.Zeros({64}, DType::kFloat32);
  EXPECT_EQ(zeros.data(), block);
  for (int64_t i = 0; i < zeros.numel(); ++i) EXPECT_EQ(zeros.data_as<float>()[i], 0.0f);
}

}  // namespace
}  // namespace mpusim
