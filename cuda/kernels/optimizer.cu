// The GPU backend's optimizer: core/optimizer_update.h's element update (the CPU's too), one
// thread per element, and the gradient norm's sum of squares in a fixed order.
//
// One op per file (STYLE.md): its kernels, behind the launchers that device_kernels.h
// declares, instantiated for every storage type. What the kernel files share (the launch
// shape, loads and stores, BlockReduce, the instantiation lists) is cuda/device_common.cuh.
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "core/optimizer_update.h"
#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

template <typename G, typename M, typename P>
__global__ void OptimizerStepKernel(OptimizerUpdate update, const G* grad, M* master,
                                    OptimizerUpdate::Moment<M> state1,
                                    OptimizerUpdate::Moment<M> state2, P* param, int64_t n) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    update.Apply(grad, master, state1, state2, param, e);
  }
}

template <typename G>
__global__ void OptimizerStepWithRemainderKernel(OptimizerUpdate update, const G* grad,
                                                 BFloat16* remainder,
                                                 OptimizerUpdate::Moment<float> state1,
                                                 OptimizerUpdate::Moment<float> state2,
                                                 BFloat16* param, int64_t n) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    update.ApplyWithRemainder(grad, remainder, state1, state2, param, e);
  }
}

__global__ void UnscaleStateKernel(const Float16* q, const float* scale, float* out, int64_t n) {
  const float s = scale[0];
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    out[e] = ScaledFloat16::Unscale(q[e], s);
  }
}

// One block: the absolute maximum (exact in any order), then the scale.
__global__ void StateScaleKernel(const float* x, int64_t n, float* scale) {
  __shared__ float buf[kBlock];
  float absmax = 0;
  for (int64_t e = threadIdx.x; e < n; e += kBlock) absmax = fmaxf(absmax, fabsf(x[e]));
  const float total = BlockReduce(absmax, buf, [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) scale[0] = ScaledFloat16::ScaleOf(total);
}

__global__ void QuantizeStateKernel(const float* x, const float* scale, Float16* q, int64_t n) {
  const float r = ScaledFloat16::ReciprocalOf(scale[0]);
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    q[e] = ScaledFloat16::Quantize(x[e], r);
  }
}

template <typename T>
__global__ void SumOfSquaresKernel(const T* x, int64_t n, double* out) {
  __shared__ double buf[kBlock];
  double sum = 0;
  for (int64_t e = threadIdx.x; e < n; e += kBlock) {
    const double value = Widen(x[e]);
    sum += value * value;
  }
  const double total = BlockReduce(sum, buf, [](double a, double b) { return a + b; });
  if (threadIdx.x == 0) out[0] += total;
}

}  // namespace

template <typename G, typename M, typename P>
void LaunchOptimizerStep(const OptimizerUpdate& update, const G* grad, M* master,
                         OptimizerUpdate::Moment<M> state1, OptimizerUpdate::Moment<M> state2,
                         P* param, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  OptimizerStepKernel<G, M, P><<<GridFor(n), kBlock, 0, stream>>>(update, grad, master, state1,
                                                                   state2, param, n);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename G>
void LaunchOptimizerStepWithRemainder(const OptimizerUpdate& update, const G* grad,
                                      BFloat16* remainder, OptimizerUpdate::Moment<float> state1,
                                      OptimizerUpdate::Moment<float> state2, BFloat16* param,
                                      int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  OptimizerStepWithRemainderKernel<G>
      <<<GridFor(n), kBlock, 0, stream>>>(update, grad, remainder, state1, state2, param, n);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

void LaunchUnscaleState(const Float16* q, const float* scale, float* out, int64_t n,
                        cudaStream_t stream) {
  if (n <= 0) return;
  UnscaleStateKernel<<<GridFor(n), kBlock, 0, stream>>>(q, scale, out, n);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

void LaunchScaleState(const float* x, float* scale, Float16* q, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  StateScaleKernel<<<1, kBlock, 0, stream>>>(x, n, scale);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
  QuantizeStateKernel<<<GridFor(n), kBlock, 0, stream>>>(x, scale, q, n);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchSumOfSquares(const T* x, int64_t n, double* out, cudaStream_t stream) {
  if (n <= 0) return;
  SumOfSquaresKernel<T><<<1, kBlock, 0, stream>>>(x, n, out);
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

// The optimizer: gradient type G (main_grad), master type M (float or double), parameter
// type P.
#define MPUSIM_INSTANTIATE_OPTIMIZER(G, M, P)                           \
  template void LaunchOptimizerStep<G, M, P>(                           \
      const OptimizerUpdate&, const G*, M*, OptimizerUpdate::Moment<M>, \
      OptimizerUpdate::Moment<M>, P*, int64_t, cudaStream_t);
#define MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(G, M)  \
  MPUSIM_INSTANTIATE_OPTIMIZER(G, M, double)       \
  MPUSIM_INSTANTIATE_OPTIMIZER(G, M, float)        \
  MPUSIM_INSTANTIATE_OPTIMIZER(G, M, BFloat16)     \
  MPUSIM_INSTANTIATE_OPTIMIZER(G, M, Float16)
MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(float, float)
MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(float, double)
MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(double, float)
MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(double, double)
// The precision-aware optimizer reads a 16-bit main_grad as it is (float32 master).
MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(BFloat16, float)
MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS(Float16, float)
// store_param_remainders: a bf16 run's main_grad (float32 or bfloat16; every storage type
// for the dispatch).
#define MPUSIM_INSTANTIATE_REMAINDER(G)                                            \
  template void LaunchOptimizerStepWithRemainder<G>(                               \
      const OptimizerUpdate&, const G*, BFloat16*, OptimizerUpdate::Moment<float>, \
      OptimizerUpdate::Moment<float>, BFloat16*, int64_t, cudaStream_t);
MPUSIM_INSTANTIATE_REMAINDER(float)
MPUSIM_INSTANTIATE_REMAINDER(double)
MPUSIM_INSTANTIATE_REMAINDER(BFloat16)
MPUSIM_INSTANTIATE_REMAINDER(Float16)
#undef MPUSIM_INSTANTIATE_REMAINDER
template void LaunchSumOfSquares<float>(const float*, int64_t, double*, cudaStream_t);
template void LaunchSumOfSquares<double>(const double*, int64_t, double*, cudaStream_t);
template void LaunchSumOfSquares<BFloat16>(const BFloat16*, int64_t, double*, cudaStream_t);
template void LaunchSumOfSquares<Float16>(const Float16*, int64_t, double*, cudaStream_t);
#undef MPUSIM_INSTANTIATE_OPTIMIZER_PARAMS
#undef MPUSIM_INSTANTIATE_OPTIMIZER

}  // namespace mpusim::cuda
