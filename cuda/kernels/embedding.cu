// The GPU backend's embedding: the masked lookup of a vocabulary shard, and its backward by
// a stable radix sort of the tokens by row (CUB), then one thread per (run, column) adding the
// run's gradients in token order: no atomics, the CPU's additions in the CPU's order.
//
// One op per file (STYLE.md): its kernels, behind the launchers that device_kernels.h
// declares, instantiated for every storage type. What the kernel files share (the launch
// shape, loads and stores, BlockReduce, the instantiation lists) is cuda/device_common.cuh.
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>

#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

template <typename T>
__global__ void EmbeddingForwardKernel(const T* weight, const int64_t* ids, int64_t n,
                                       int64_t cols, int64_t vocab_start, int64_t vocab_end,
                                       T* out) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    const int64_t id = ids[e / cols];
    // T{} is +0 for every storage type (all-zero bits).
    out[e] = id >= vocab_start && id < vocab_end ? weight[(id - vocab_start) * cols + e % cols]
                                                 : T{};
  }
}

// The sort's input: key = the local row of token e's id, or `outside` (the shard's row
// count, past every row) when another shard owns it; value = e.
__global__ void EmbeddingKeysKernel(const int64_t* ids, int64_t num_ids, int64_t vocab_start,
                                    int64_t vocab_end, uint64_t* rows, int64_t* tokens) {
  for (int64_t e = FirstIndex(); e < num_ids; e += GridStride()) {
    const int64_t id = ids[e];
    rows[e] = static_cast<uint64_t>(id >= vocab_start && id < vocab_end ? id - vocab_start
                                                                        : vocab_end - vocab_start);
    tokens[e] = e;
  }
}

// rows/tokens sorted by row (stably: tokens increase within a row). The thread of sorted
// position p and column j works only if p starts a run of one in-shard row; it then adds
// the run's gradients in token order.
template <typename T, typename A>
__global__ void EmbeddingBackwardKernel(const T* dy, const uint64_t* rows, const int64_t* tokens,
                                        int64_t num_ids, int64_t cols, uint64_t outside,
                                        A* dweight) {
  const int64_t n = num_ids * cols;
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    const int64_t p = e / cols;
    const int64_t j = e % cols;
    const uint64_t r = rows[p];
    if (r == outside || (p > 0 && rows[p - 1] == r)) continue;
    A* target = dweight + static_cast<int64_t>(r) * cols + j;
    // Each token's addition is rounded to A, as the CPU's loop stores after every token
    // (only a 16-bit A actually rounds).
    A acc = *target;
    for (int64_t q = p; q < num_ids && rows[q] == r; ++q) {
      acc = Store<A>(Load(acc) + Load(dy[tokens[q] * cols + j]));
    }
    *target = acc;
  }
}

// The pieces of EmbeddingBackward's scratch, each at a 256-byte boundary: the keys and
// values before and after the sort, then CUB's own temporary storage.
struct EmbeddingScratch {
  uint64_t* rows_in;
  uint64_t* rows_out;
  int64_t* tokens_in;
  int64_t* tokens_out;
  void* sort_temp;
  size_t sort_bytes;
  size_t total_bytes;
};

constexpr size_t kScratchAlign = 256;

size_t AlignUp(size_t bytes) { return (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

// Bits of the sort keys: enough for every value in [0, vocab_rows] (outside included).
int KeyBits(int64_t vocab_rows) {
  int bits = 1;
  while (bits < 63 && (int64_t{1} << bits) <= vocab_rows) ++bits;
  return bits;
}

// The layout over `base` (nullptr: only the sizes, for EmbeddingBackwardScratchBytes).
EmbeddingScratch LayOutEmbeddingScratch(void* base, int64_t num_ids, int64_t vocab_rows) {
  EmbeddingScratch s{};
  const size_t keys = AlignUp(static_cast<size_t>(num_ids) * sizeof(uint64_t));
  const size_t values = AlignUp(static_cast<size_t>(num_ids) * sizeof(int64_t));
  // CUB reports its temporary storage for these sizes without touching the pointers.
  MPUSIM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, s.sort_bytes, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
      static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr), num_ids, 0,
      KeyBits(vocab_rows)));
  s.total_bytes = 2 * keys + 2 * values + AlignUp(s.sort_bytes);
  if (base != nullptr) {
    auto* at = static_cast<unsigned char*>(base);
    s.rows_in = reinterpret_cast<uint64_t*>(at);
    s.rows_out = reinterpret_cast<uint64_t*>(at + keys);
    s.tokens_in = reinterpret_cast<int64_t*>(at + 2 * keys);
    s.tokens_out = reinterpret_cast<int64_t*>(at + 2 * keys + values);
    s.sort_temp = at + 2 * keys + 2 * values;
  }
  return s;
}

}  // namespace

template <typename T>
void LaunchEmbeddingForward(const T* weight, const int64_t* ids, int64_t num_ids, int64_t cols,
                            int64_t vocab_start, int64_t vocab_end, T* out, cudaStream_t stream) {
  const int64_t n = num_ids * cols;
  if (n <= 0) return;
  EmbeddingForwardKernel<T><<<GridFor(n), kBlock, 0, stream>>>(weight, ids, n, cols,
                                                               vocab_start, vocab_end, out);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}
size_t EmbeddingBackwardScratchBytes(int64_t num_ids, int64_t vocab_rows) {
  if (num_ids <= 0 || vocab_rows <= 0) return 0;
  return LayOutEmbeddingScratch(nullptr, num_ids, vocab_rows).total_bytes;
}

template <typename T, typename A>
void LaunchEmbeddingBackward(const T* dy, const int64_t* ids, int64_t num_ids, int64_t cols,
                             int64_t vocab_start, int64_t vocab_end, A* dweight, void* scratch,
                             cudaStream_t stream) {
  const int64_t vocab_rows = vocab_end - vocab_start;
  if (num_ids <= 0 || cols <= 0 || vocab_rows <= 0) return;
  EmbeddingScratch s = LayOutEmbeddingScratch(scratch, num_ids, vocab_rows);
  EmbeddingKeysKernel<<<GridFor(num_ids), kBlock, 0, stream>>>(ids, num_ids, vocab_start, vocab_end,
                                                               s.rows_in, s.tokens_in);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
  MPUSIM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(s.sort_temp, s.sort_bytes, s.rows_in,
                                                    s.rows_out, s.tokens_in, s.tokens_out, num_ids,
                                                    0, KeyBits(vocab_rows), stream));
  const int64_t n = num_ids * cols;
  EmbeddingBackwardKernel<T, A><<<GridFor(n), kBlock, 0, stream>>>(
      dy, s.rows_out, s.tokens_out, num_ids, cols, static_cast<uint64_t>(vocab_rows), dweight);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

#define MPUSIM_INSTANTIATE_EMBEDDING(T, C)                                                   \
  template void LaunchEmbeddingForward<T>(const T*, const int64_t*, int64_t, int64_t, int64_t, \
                                          int64_t, T*, cudaStream_t);
#define MPUSIM_INSTANTIATE_EMBEDDING_BACKWARD(T, A, C)                                    \
  template void LaunchEmbeddingBackward<T, A>(const T*, const int64_t*, int64_t, int64_t, \
                                              int64_t, int64_t, A*, void*, cudaStream_t);
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_EMBEDDING)
MPUSIM_FOR_EACH_ACCUMULATOR(MPUSIM_INSTANTIATE_EMBEDDING_BACKWARD)
#undef MPUSIM_INSTANTIATE_EMBEDDING_BACKWARD
#undef MPUSIM_INSTANTIATE_EMBEDDING

}  // namespace mpusim::cuda
