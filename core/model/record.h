// TensorRecord: a rank's local piece of a named tensor and where it sits in the full tensor.
//
// What every model (the layer chain, the GPT model) hands to the run driver after a step: the
// driver dumps the records (run/dump.h) and checks them against the float64 reference
// (run/check.h); `mpusim diff` reassembles full tensors from their shard specs.
#pragma once

#include <string>

#include "core/sharding.h"
#include "core/tensor.h"

namespace mpusim {

struct TensorRecord {
  std::string name;  // "<layer>.<role>", "tokens", "labels", "loss"
  Tensor tensor;     // local, on the backend's device
  Shape full_shape;
  ShardSpec shard;
  bool partial_sum = false;  // the full tensor is the sum of all tp ranks' tensors
};

}  // namespace mpusim
