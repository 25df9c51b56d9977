// The GPU backend's activations: core/ops/activation.h's element functions, one thread per
// element of y (forward) or of dy (backward), the activation picked by ops::VisitActivation.
//
// One op per file (STYLE.md): its kernels, behind the launchers that device_kernels.h
// declares, instantiated for every storage type. What the kernel files share (the launch
// shape, loads and stores, BlockReduce, the instantiation lists) is cuda/device_common.cuh.
#include "cuda/device_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "core/ops/activation.h"
#include "cuda/cuda_check.h"
#include "cuda/device_common.cuh"

namespace mpusim::cuda {
namespace {

template <typename A, typename T>
__global__ void ActivationForwardKernel(const T* x, T* y, int64_t n, int64_t f, GluOptions glu) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    ops::ActivationForwardAt<A>(x, y, e, f, glu);
  }
}

// A gated A's thread alone reads and writes its pair (i, j), (i, f + j): dx may be x.
template <typename A, typename T>
__global__ void ActivationBackwardKernel(const T* x, const T* dy, T* dx, int64_t n, int64_t f,
                                         GluOptions glu) {
  for (int64_t e = FirstIndex(); e < n; e += GridStride()) {
    ops::ActivationBackwardAt<A>(x, dy, dx, e, f, glu);
  }
}

}  // namespace

// The kernels of the activation ops::VisitActivation picks (a visitor struct: C++17).
template <typename T>
struct ActivationForwardLaunch {
  const T* x;
  T* y;
  int64_t n, f;
  GluOptions glu;
  cudaStream_t stream;
  template <typename A>
  void operator()() const {
    ActivationForwardKernel<A, T><<<GridFor(n), kBlock, 0, stream>>>(x, y, n, f, glu);
  }
};
template <typename T>
struct ActivationBackwardLaunch {
  const T* x;
  const T* dy;
  T* dx;
  int64_t n, f;
  GluOptions glu;
  cudaStream_t stream;
  template <typename A>
  void operator()() const {
    ActivationBackwardKernel<A, T><<<GridFor(n), kBlock, 0, stream>>>(x, dy, dx, n, f, glu);
  }
};

template <typename T>
void LaunchActivationForward(Activation act, const T* x, T* y, int64_t n, int64_t f, GluOptions glu,
                             cudaStream_t stream) {
  if (n <= 0) return;
  ops::VisitActivation(act, ActivationForwardLaunch<T>{x, y, n, f, glu, stream});
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void LaunchActivationBackward(Activation act, const T* x, const T* dy, T* dx, int64_t n, int64_t f,
                              GluOptions glu, cudaStream_t stream) {
  if (n <= 0) return;
  ops::VisitActivation(act, ActivationBackwardLaunch<T>{x, dy, dx, n, f, glu, stream});
  MPUSIM_CUDA_CHECK(cudaGetLastError());
}

#define MPUSIM_INSTANTIATE_ACTIVATION(T, C)                                                        \
  template void LaunchActivationForward<T>(Activation, const T*, T*, int64_t, int64_t, GluOptions, \
                                           cudaStream_t);                                          \
  template void LaunchActivationBackward<T>(Activation, const T*, const T*, T*, int64_t, int64_t,  \
                                            GluOptions, cudaStream_t);
MPUSIM_FOR_EACH_STORAGE(MPUSIM_INSTANTIATE_ACTIVATION)
#undef MPUSIM_INSTANTIATE_ACTIVATION

}  // namespace mpusim::cuda
