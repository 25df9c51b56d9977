// Tensor-parallel utilities (see tp_utils.h).
#include "core/tensor_parallel/tp_utils.h"

#include <stdexcept>
#include <string>

namespace mpusim {

std::pair<int64_t, int64_t> VocabRangeFromPerPartitionVocabSize(int64_t per_partition,
                                                                int64_t rank) {
  const int64_t first = rank * per_partition;
  return {first, first + per_partition};
}

std::pair<int64_t, int64_t> VocabRangeFromGlobalVocabSize(int64_t global, int64_t rank,
                                                          int64_t world_size) {
  if (world_size <= 0 || global % world_size != 0) {
    throw std::invalid_argument("vocabulary of " + std::to_string(global) +
                                " rows is not divisible by " + std::to_string(world_size));
  }
  return VocabRangeFromPerPartitionVocabSize(global / world_size, rank);
}

std::vector<Tensor> SplitTensorAlongLastDim(Kernels& kernels, const Tensor& tensor,
                                            int64_t num_partitions) {
  if (num_partitions <= 0 || tensor.cols() % num_partitions != 0) {
    throw std::invalid_argument("last dimension " + std::to_string(tensor.cols()) +
                                " is not divisible by " + std::to_string(num_partitions));
  }
  const int64_t cols = tensor.cols() / num_partitions;
  Shape shape = tensor.shape();
  shape.back() = cols;
  std::vector<Tensor> parts;
  for (int64_t p = 0; p < num_partitions; ++p) {
    Tensor part = kernels.Zeros(shape, tensor.dtype());
    kernels.CopyBlock(tensor, 0, p * cols, part, 0, 0, tensor.rows(), cols);
    parts.push_back(std::move(part));
  }
  return parts;
}

Tensor SplitTensorInto1dEqualChunks(Kernels& k, Communicator& group, const Tensor& tensor) {
  const int64_t t = group.Size();
  if (tensor.numel() % t != 0) {
    throw std::invalid_argument("tensor of " + std::to_string(tensor.numel()) +
                                " elements is not divisible into " + std::to_string(t) +
                                " equal chunks");
  }
  const int64_t chunk = tensor.numel() / t;
  const Tensor flat = tensor.Reshaped({t, chunk});
  Tensor out = k.Zeros({chunk}, tensor.dtype());
  Tensor out_row = out.Reshaped({1, chunk});
  k.CopyBlock(flat, group.Rank(), 0, out_row, 0, 0, 1, chunk);
  return out;
}

Tensor GatherSplit1dTensor(Kernels& k, Communicator& group, const Tensor& chunk) {
  Tensor out = k.Zeros({chunk.numel() * group.Size()}, chunk.dtype());
  group.AllGather(chunk, out);
  return out;
}

void BroadcastData(Communicator& group, std::vector<Tensor*> tensors) {
  if (group.Size() == 1) return;
  for (Tensor* tensor : tensors) group.Broadcast(*tensor, 0);
}

}  // namespace mpusim
