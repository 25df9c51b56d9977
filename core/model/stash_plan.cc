// The declared stash (see stash_plan.h).
#include "core/model/stash_plan.h"

namespace mpusim {

double StashTensor::bytes() const {
  double product = 1;
  for (const double extent : shape) product *= extent;
  return product * static_cast<double>(DTypeSize(dtype));
}

void StashPlan::Add(const std::string& prefix, const StashPlan& inner) {
  for (const StashTensor& tensor : inner.tensors_) {
    tensors_.push_back({prefix + "." + tensor.name, tensor.shape, tensor.dtype});
  }
}

double StashPlan::bytes() const {
  double sum = 0;
  for (const StashTensor& tensor : tensors_) sum += tensor.bytes();
  return sum;
}

}  // namespace mpusim
