// The CPU backend's GEMM (EigenKernels::Gemm; Eigen, or OpenBLAS through EIGEN_USE_BLAS when
// it is installed) on the MLP benchmark's shapes, one thread: GFLOP/s per core.
//
// What it is: the number behind "CPU GEMM GFLOP/s per core" in the README.
// What it is not: a test. Run: build/bench/gemm_bench --benchmark_repetitions=5
//   --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include "sim/eigen_kernels.h"

namespace mpusim {
namespace {

// flops = 2 * m * n * k for c[m, n] = a[m, k] @ b^T (b is [n, k], like a weight).
template <DType kDType>
void BM_GemmNT(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  EigenKernels kernels;
  Tensor a = kernels.Zeros({m, k}, kDType);
  Tensor b = kernels.Zeros({n, k}, kDType);
  Tensor c = kernels.Zeros({m, n}, kDType);
  kernels.Scale(0.0, a);
  for (auto _ : state) {
    kernels.Gemm(false, true, 1.0, a, b, 0.0, c);
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(m * n * k) * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}

// The MLP's forward GEMMs at tp=1: [2048, 1024] x [4096, 1024]^T and [2048, 4096] x
// [1024, 4096]^T.
BENCHMARK(BM_GemmNT<DType::kFloat32>)
    ->Args({2048, 4096, 1024})
    ->Args({2048, 1024, 4096})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_GemmNT<DType::kFloat64>)
    ->Args({2048, 4096, 1024})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace mpusim

BENCHMARK_MAIN();
