// The activation op table (tests/ops/activation_ops.h) on the CPU backend.
#include "tests/ops/activation_ops.h"

#include <gtest/gtest.h>

#include "core/tensor.h"
#include "sim/eigen_kernels.h"

namespace mpusim {
namespace {

TEST(ActivationOps, EveryActivationHasARow) { activation_ops::CheckEveryActivationHasARow(); }

TEST(ActivationOps, EigenEveryDtype) {
  EigenKernels k;
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    activation_ops::CheckAll(k, dt);
  }
}

TEST(ActivationOps, EigenGluByHand) {
  EigenKernels k;
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    activation_ops::CheckGluByHand(k, dt);
  }
}

}  // namespace
}  // namespace mpusim
