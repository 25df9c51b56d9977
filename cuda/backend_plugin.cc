// The GPU backend as a plugin (libmpusim_backend_cuda.so): the entry points that
// `mpusim run --backend cuda` looks up with dlsym (core/backend.h, run/backend_plugin.h).
#include "core/backend.h"
#include "cuda/cuda_backend.h"

extern "C" {

__attribute__((visibility("default"))) extern const int mpusim_backend_abi;
const int mpusim_backend_abi = mpusim::kBackendAbi;

__attribute__((visibility("default"))) void mpusim_make_backend(
    const mpusim::BackendOptions* options, mpusim::BackendOrStatus* out) {
  *out = mpusim::cuda::MakeCudaBackend(options->comm);
}

}  // extern "C"
