// Philox4x32-10: the counter-based random generator used for initialisation, data and
// dropout (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
//
// A counter-based generator is a pure function (key, counter) -> 4 random 32-bit words, so
// element e of any stream can be computed on its own: every rank generates exactly its
// shard, in any order, on host or device, and gets the bits a single process would get.
// Usable from host and CUDA device code (MPUSIM_HD).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MPUSIM_HD __host__ __device__
#else
#define MPUSIM_HD
#endif

namespace mpusim {

struct PhiloxResult {
  uint32_t v[4];
};

MPUSIM_HD inline PhiloxResult Philox4x32(uint64_t counter_lo, uint64_t counter_hi, uint64_t key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return PhiloxResult{{c0, c1, c2, c3}};
}

// Uniform double in [0, 1) with 53 random bits, element `index` of stream (key, stream).
MPUSIM_HD inline double UniformAt(uint64_t key, uint64_t stream, uint64_t index) {
  const PhiloxResult r = Philox4x32(index, stream, key);
  const uint64_t bits = (static_cast<uint64_t>(r.v[0]) << 21) ^ (r.v[1] >> 11);
  return static_cast<double>(bits & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0);
}

}  // namespace mpusim
