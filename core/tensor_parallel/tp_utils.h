// Megatron's tensor-parallel utilities (tensor_parallel/utils.py and data.py) on our
// Tensors: vocabulary ranges, splitting along the last dimension, 1-D equal chunks, and
// broadcast_data.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/communicator.h"
#include "core/kernels.h"

namespace mpusim {

// VocabUtility: the [first, last) vocabulary rows of `rank` when each of `world_size` ranks
// holds `per_partition` rows, or when a vocabulary of `global` rows is split evenly.
std::pair<int64_t, int64_t> VocabRangeFromPerPartitionVocabSize(int64_t per_partition,
                                                                int64_t rank);
std::pair<int64_t, int64_t> VocabRangeFromGlobalVocabSize(int64_t global, int64_t rank,
                                                          int64_t world_size);

// split_tensor_along_last_dim: `num_partitions` contiguous copies, each [..., cols / n].
std::vector<Tensor> SplitTensorAlongLastDim(Kernels& kernels, const Tensor& tensor,
                                            int64_t num_partitions);

// split_tensor_into_1d_equal_chunks: this rank's flat chunk of numel / group size elements;
// gather_split_1d_tensor: all-gather of those chunks over `group`, back to the flat tensor.
Tensor SplitTensorInto1dEqualChunks(Kernels& k, Communicator& group, const Tensor& tensor);
Tensor GatherSplit1dTensor(Kernels& k, Communicator& group, const Tensor& chunk);

// broadcast_data: the tensors of `group`'s first rank (a tp group) are copied to the whole
// group (in place; every rank passes tensors of the same shapes).
void BroadcastData(Communicator& group, std::vector<Tensor*> tensors);

}  // namespace mpusim
