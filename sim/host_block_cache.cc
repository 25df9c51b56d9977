// The CPU backend's caching allocator (see host_block_cache.h).
#include "sim/host_block_cache.h"

#include <cstdlib>
#include <new>

namespace mpusim {

std::shared_ptr<HostBlockCache> HostBlockCache::Create() {
  return std::shared_ptr<HostBlockCache>(new HostBlockCache());
}

HostBlockCache::~HostBlockCache() {
  for (auto& [size, blocks] : free_) {
    for (void* block : blocks) std::free(block);
  }
}

Tensor HostBlockCache::Empty(Shape shape, DType dtype) {
  const size_t bytes = CheckedTensorBytes(shape, dtype, 128) - 128;  // room for the padding
  // 64-byte alignment suits every SIMD width of the CPU kernels; the spare line lets a
  // vectorised loop read past the last element, as Tensor::HostEmpty allows.
  const size_t size = (bytes + 63) / 64 * 64 + 64;
  void* block = nullptr;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      block = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= size;
    }
  }
  if (block == nullptr) {
    block = std::aligned_alloc(64, size);
    if (block == nullptr) throw std::bad_alloc();
  }
  std::shared_ptr<HostBlockCache> self = shared_from_this();
  return Tensor(std::move(shape), dtype, Device::kHost,
                std::shared_ptr<void>(block, [self, size](void* p) { self->Release(p, size); }));
}

size_t HostBlockCache::cached_bytes() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return cached_bytes_;
}

void HostBlockCache::Release(void* block, size_t size) {
  const std::lock_guard<std::mutex> lock(mutex_);
  free_[size].push_back(block);
  cached_bytes_ += size;
}

}  // namespace mpusim
