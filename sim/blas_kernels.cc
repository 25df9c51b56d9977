// The OpenBLAS kernel pin (see blas_kernels.h).
#include "sim/blas_kernels.h"

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#if defined(MPUSIM_HAVE_OPENBLAS)
extern "C" char* openblas_get_corename(void);
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);
extern "C" void dgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const double* alpha, const double* a, const int* lda,
                       const double* b, const int* ldb, const double* beta, double* c,
                       const int* ldc);
#endif

namespace mpusim {
namespace {

// The environment that carries the pin across the re-execution.
constexpr const char* kCoreType = "OPENBLAS_CORETYPE";
constexpr const char* kChose = "MPUSIM_OPENBLAS_CHOSE";          // OpenBLAS's own choice
constexpr const char* kPinFailed = "MPUSIM_OPENBLAS_PIN_FAILED";  // the set that failed
constexpr const char* kPretendChoice = "MPUSIM_OPENBLAS_PRETEND_CHOICE";  // test hooks
constexpr const char* kPretendWrong = "MPUSIM_OPENBLAS_PRETEND_WRONG";

// OpenBLAS's core names compare without case (OPENBLAS_CORETYPE=haswell names Haswell).
std::string Lower(std::string_view name) {
  std::string out(name);
  for (char& c : out) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return out;
}

// OpenBLAS's x86-64 kernel sets (its core names) ranked by the instructions they use, so that
// "below the best one the CPU runs" is a comparison: 6 AVX-512 with bf16, 5 AVX-512, 4 AVX2
// with FMA (Zen runs the Haswell kernels), 3 AVX (and AMD's FMA4 families), 2 SSE4, 1 SSSE3,
// 0 SSE3 and older. -1: a name this table does not know (nothing is pinned then).
int KernelLevel(std::string_view name) {
  struct Entry {
    std::string_view name;
    int level;
  };
  static constexpr std::array<Entry, 24> kLevels = {{
      {"sapphirerapids", 6}, {"cooperlake", 6}, {"skylakex", 5},    {"haswell", 4},
      {"zen", 4},            {"sandybridge", 3}, {"bulldozer", 3},  {"piledriver", 3},
      {"steamroller", 3},    {"excavator", 3},   {"nehalem", 2},    {"barcelona", 2},
      {"core2", 1},          {"penryn", 1},      {"dunnington", 1}, {"atom", 1},
      {"bobcat", 1},         {"prescott", 0},    {"katmai", 0},     {"coppermine", 0},
      {"northwood", 0},      {"banias", 0},      {"opteron", 0},    {"opteron(sse3)", 0},
  }};
  const std::string lower = Lower(name);
  for (const Entry& e : kLevels) {
    if (e.name == lower) return e.level;
  }
  return -1;
}


std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

#if defined(MPUSIM_HAVE_OPENBLAS)
// Integer-valued A (m x k) and B (k x n), products up to 64, sums of k = 96 terms: every
// partial sum is an integer below 2^13, exact in float and double, so the kernels' product
// must equal the plain loop's bit for bit, whatever their blocking or summation order. Odd m
// and n reach the kernels' edge cases; each transpose is a different packing path.
template <typename T, typename Gemm>
bool GemmIsExact(Gemm gemm) {
  constexpr int m = 67, n = 53, k = 96;
  const T one = 1, zero = 0;
  for (const char ta : {'N', 'T'}) {
    for (const char tb : {'N', 'T'}) {
      // Column-major, stored as the transpose flag says.
      const int lda = ta == 'N' ? m : k, ldb = tb == 'N' ? k : n;
      std::vector<T> a(static_cast<size_t>(m) * k), b(static_cast<size_t>(k) * n);
      auto a_at = [&](int i, int p) -> T& {
        return a[static_cast<size_t>(ta == 'N' ? i + p * lda : p + i * lda)];
      };
      auto b_at = [&](int p, int j) -> T& {
        return b[static_cast<size_t>(tb == 'N' ? p + j * ldb : j + p * ldb)];
      };
      for (int i = 0; i < m; ++i) {
        for (int p = 0; p < k; ++p) a_at(i, p) = static_cast<T>((i * 7 + p * 3) % 17 - 8);
      }
      for (int p = 0; p < k; ++p) {
        for (int j = 0; j < n; ++j) b_at(p, j) = static_cast<T>((p * 5 + j * 11) % 13 - 6);
      }
      std::vector<T> c(static_cast<size_t>(m) * n, static_cast<T>(-1));
      gemm(&ta, &tb, &m, &n, &k, &one, a.data(), &lda, b.data(), &ldb, &zero, c.data(), &m);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          T expected = 0;
          for (int p = 0; p < k; ++p) expected += a_at(i, p) * b_at(p, j);
          if (c[static_cast<size_t>(i + j * m)] != expected) return false;
        }
      }
    }
  }
  return true;
}
#endif

// Replaces this process with the same program and arguments; returns only when that fails.
void ReExecute(char** argv) { execv("/proc/self/exe", argv); }

}  // namespace

std::string BestBlasKernelsForCpu() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // __builtin_cpu_supports also asks the OS: AVX and AVX-512 count only when it saves their
  // registers (XCR0), as OpenBLAS's own support_avx512 does.
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return "Cooperlake";
  if (avx512) return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  if (__builtin_cpu_supports("avx")) return "Sandybridge";
  if (__builtin_cpu_supports("sse4.2")) return "Nehalem";
  if (__builtin_cpu_supports("ssse3")) return "Core2";
  return "Prescott";
#else
  return "";
#endif
}

void PinBestBlasKernels(char** argv) {
#if defined(MPUSIM_HAVE_OPENBLAS)
  const std::string chose = Env(kChose);
  if (!chose.empty()) {
    // The pinned process: prove the kernels before anything uses them.
    const bool exact = GemmIsExact<float>(sgemm_) && GemmIsExact<double>(dgemm_);
    if (exact && Env(kPretendWrong).empty()) return;
    const std::string failed = openblas_get_corename();
    setenv(kCoreType, chose.c_str(), 1);
    setenv(kPinFailed, failed.c_str(), 1);
    unsetenv(kChose);
    ReExecute(argv);
    unsetenv(kPinFailed);  // could not re-execute: the note must not claim a fallback
    return;
  }
  if (!Env(kPinFailed).empty()) return;  // the fallback above: OpenBLAS's own choice
  // The user's own choice, unless a test pretends it is OpenBLAS's (an unknown CPU).
  if (!Env(kCoreType).empty() && Env(kPretendChoice).empty()) return;
  const std::string current = openblas_get_corename();
  const std::string best = BestBlasKernelsForCpu();
  const int current_level = KernelLevel(current), best_level = KernelLevel(best);
  if (current_level < 0 || best_level <= current_level) return;
  setenv(kCoreType, best.c_str(), 1);
  setenv(kChose, current.c_str(), 1);
  ReExecute(argv);
  unsetenv(kCoreType);  // could not re-execute: this process keeps OpenBLAS's choice
  unsetenv(kChose);
#else
  (void)argv;
#endif
}

std::string BlasKernelsNote() {
#if defined(MPUSIM_HAVE_OPENBLAS)
  const std::string current = openblas_get_corename();
  const std::string chose = Env(kChose), failed = Env(kPinFailed), pinned = Env(kCoreType);
  if (!chose.empty() && Lower(pinned) == Lower(current)) {
    return fmt::format("pinned by mpusim: OpenBLAS chose {} for this CPU", chose);
  }
  if (!failed.empty()) {
    return fmt::format("OpenBLAS's choice: the {} kernels failed the start-up GEMM check",
                       failed);
  }
  if (!pinned.empty() && Env(kPretendChoice).empty()) return "set by OPENBLAS_CORETYPE";
  const std::string best = BestBlasKernelsForCpu();
  if (KernelLevel(current) >= 0 && KernelLevel(best) > KernelLevel(current)) {
    return fmt::format("OpenBLAS's choice; this CPU runs {}", best);  // the pin did not happen
  }
#endif
  return "";
}

}  // namespace mpusim
