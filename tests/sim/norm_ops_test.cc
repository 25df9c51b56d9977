// The norm op table (tests/ops/norm_ops.h) on the CPU backend.
#include "tests/ops/norm_ops.h"

#include <gtest/gtest.h>

#include "core/tensor.h"
#include "sim/eigen_kernels.h"

namespace mpusim {
namespace {

TEST(NormOps, EveryNormHasARow) { norm_ops::CheckEveryNormHasARow(); }

TEST(NormOps, EigenEveryDtype) {
  EigenKernels k;
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    norm_ops::CheckAll(k, dt);
  }
}

}  // namespace
}  // namespace mpusim
