// HostBlockCache: the CPU backend's caching allocator for tensor storage.
//
// What it is: every step of the layer graph frees its activations and the next step asks for
// the same sizes again. The C heap either hands such blocks (tens of MiB) back to the kernel
// and pays page faults to get them again every step, or keeps them and fragments, so that
// its footprint grows over repeated steps. This cache hands a freed block back to the next
// request of the same rounded size, as a GPU framework's caching allocator does: after the
// first step there are no page faults, and the memory stays at one step's high-water mark.
// What it is not: a general allocator. Blocks are never split or merged, and nothing is
// returned to the system until the cache is gone (the kernels and every tensor they made).
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"

namespace mpusim {

class HostBlockCache : public std::enable_shared_from_this<HostBlockCache> {
 public:
  static std::shared_ptr<HostBlockCache> Create();
  ~HostBlockCache();
  HostBlockCache(const HostBlockCache&) = delete;
  HostBlockCache& operator=(const HostBlockCache&) = delete;

  // An uninitialised, 64-byte aligned host tensor. Its storage keeps the cache alive and
  // returns to it when the last handle goes.
  Tensor Empty(Shape shape, DType dtype);

  size_t cached_bytes() const;  // held for reuse, not in any tensor

 private:
  HostBlockCache() = default;
  void Release(void* block, size_t size);

  mutable std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // by block size
  size_t cached_bytes_ = 0;
};

}  // namespace mpusim
