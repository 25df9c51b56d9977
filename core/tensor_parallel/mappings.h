// Megatron's tensor-parallel region mappings (tensor_parallel/mappings.py), forward and
// backward, on local activations.
//
// Shape legend: an activation is [s, b, h] stored as a 2-D [s*b, h] view, so the sequence
// dimension is the leading block of rows and "split dim 0 into t parts" means t contiguous
// row blocks of (s/t)*b rows; "split the last dim" means t column blocks of h/t columns.
//
//   mapping                                  forward                 backward
//   copy_to_tensor_model_parallel_region     identity                all-reduce
//   reduce_from_tensor_model_parallel_region all-reduce              identity
//   scatter_to_tensor_model_parallel_region  split last dim          all-gather last dim
//   gather_from_tensor_model_parallel_region all-gather last dim     split last dim
//   scatter_to_sequence_parallel_region      split dim 0             all-gather dim 0
//   gather_from_sequence_parallel_region     all-gather dim 0        reduce-scatter dim 0
//                                                                    (split if not
//                                                                    tensor_parallel_output_grad)
//   reduce_scatter_to_sequence_parallel_region reduce-scatter dim 0  all-gather dim 0
//
// Every function returns a new tensor (or the input itself for identity) and runs its
// collective on `group`, the tensor-parallel group it is given (Megatron passes `group` the
// same way); its Size() and Rank() say how to split.
#pragma once

#include "core/communicator.h"
#include "core/kernels.h"

namespace mpusim {

// Building blocks.
Tensor AllReduceCopy(Kernels& k, Communicator& group, const Tensor& x);
Tensor AllGatherFirstDim(Kernels& k, Communicator& group, const Tensor& x);
Tensor ReduceScatterFirstDim(Kernels& k, Communicator& group, const Tensor& x);
Tensor AllGatherLastDim(Kernels& k, Communicator& group, const Tensor& x);
Tensor SplitFirstDim(Kernels& k, Communicator& group, const Tensor& x);
Tensor SplitLastDim(Kernels& k, Communicator& group, const Tensor& x);

enum class Mapping : uint8_t {
  kCopyToTp,
  kReduceFromTp,
  kScatterToTp,
  kGatherFromTp,
  kScatterToSp,
  kGatherFromSp,
  kReduceScatterToSp,
};

Tensor MappingForward(Kernels& k, Communicator& group, Mapping mapping, const Tensor& x);
Tensor MappingBackward(Kernels& k, Communicator& group, Mapping mapping, const Tensor& dy,
                       bool tensor_parallel_output_grad = true);

}  // namespace mpusim
