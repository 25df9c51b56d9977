// Region mappings (see mappings.h).
#include "core/tensor_parallel/mappings.h"

#include <stdexcept>

namespace mpusim {
namespace {

Shape WithDim(Shape shape, size_t dim, int64_t size) {
  shape[dim] = size;
  return shape;
}

void RequireDivisible(int64_t size, int64_t parts, const char* what) {
  if (size % parts != 0) {
    throw std::invalid_argument(std::string(what) + ": size " + std::to_string(size) +
                                " is not divisible by the tensor-parallel size " +
                                std::to_string(parts));
  }
}

}  // namespace

Tensor AllReduceCopy(Kernels& k, Communicator& group, const Tensor& x) {
  Tensor out = k.Empty(x.shape(), x.dtype());
  k.Copy(x, out);
  group.AllReduce(out, ReduceOp::kSum);
  return out;
}

Tensor AllGatherFirstDim(Kernels& k, Communicator& group, const Tensor& x) {
  const int64_t t = group.Size();
  if (t == 1) return x;
  Tensor out = k.Empty(WithDim(x.shape(), 0, x.shape()[0] * t), x.dtype());
  group.AllGather(x, out);
  return out;
}

Tensor ReduceScatterFirstDim(Kernels& k, Communicator& group, const Tensor& x) {
  const int64_t t = group.Size();
  if (t == 1) return x;
  RequireDivisible(x.shape()[0], t, "reduce-scatter along the sequence");
  Tensor out = k.Empty(WithDim(x.shape(), 0, x.shape()[0] / t), x.dtype());
  group.ReduceScatter(x, out);
  return out;
}

Tensor AllGatherLastDim(Kernels& k, Communicator& group, const Tensor& x) {
  const int64_t t = group.Size();
  if (t == 1) return x;
  // NCCL/MPI gather flat buffers in rank order: [t, rows, c]; interleave into [rows, t*c].
  const int64_t rows = x.rows();
  const int64_t cols = x.cols();
  Tensor stacked = k.Empty(Shape{t * rows, cols}, x.dtype());
  group.AllGather(x, stacked);
  const size_t last = x.shape().size() - 1;
  Tensor out = k.Empty(WithDim(x.shape(), last, cols * t), x.dtype());
  for (int64_t r = 0; r < t; ++r) {
    k.CopyBlock(stacked, r * rows, 0, out, 0, r * cols, rows, cols);
  }
  return out;
}

Tensor SplitFirstDim(Kernels& k, Communicator& group, const Tensor& x) {
  const int64_t t = group.Size();
  if (t == 1) return x;
  RequireDivisible(x.shape()[0], t, "split along the sequence");
  const Shape shape = WithDim(x.shape(), 0, x.shape()[0] / t);
  Tensor out = k.Empty(shape, x.dtype());
  const int64_t rows = out.rows();
  k.CopyBlock(x, group.Rank() * rows, 0, out, 0, 0, rows, x.cols());
  return out;
}

Tensor SplitLastDim(Kernels& k, Communicator& group, const Tensor& x) {
  const int64_t t = group.Size();
  if (t == 1) return x;
  RequireDivisible(x.cols(), t, "split along the last dimension");
  const int64_t cols = x.cols() / t;
  Tensor out = k.Empty(WithDim(x.shape(), x.shape().size() - 1, cols), x.dtype());
  k.CopyBlock(x, 0, group.Rank() * cols, out, 0, 0, x.rows(), cols);
  return out;
}

Tensor MappingForward(Kernels& k, Communicator& group, Mapping mapping, const Tensor& x) {
  switch (mapping) {
    case Mapping::kCopyToTp: return x;
    case Mapping::kReduceFromTp: return group.Size() == 1 ? x : AllReduceCopy(k, group, x);
    case Mapping::kScatterToTp: return SplitLastDim(k, group, x);
    case Mapping::kGatherFromTp: return AllGatherLastDim(k, group, x);
    case Mapping::kScatterToSp: return SplitFirstDim(k, group, x);
    case Mapping::kGatherFromSp: return AllGatherFirstDim(k, group, x);
    case Mapping::kReduceScatterToSp: return ReduceScatterFirstDim(k, group, x);
  }
  return x;
}

Tensor MappingBackward(Kernels& k, Communicator& group, Mapping mapping, const Tensor& dy,
                       bool tensor_parallel_output_grad) {
  switch (mapping) {
    case Mapping::kCopyToTp: return group.Size() == 1 ? dy : AllReduceCopy(k, group, dy);
    case Mapping::kReduceFromTp: return dy;
    case Mapping::kScatterToTp: return AllGatherLastDim(k, group, dy);
    case Mapping::kGatherFromTp: return SplitLastDim(k, group, dy);
    case Mapping::kScatterToSp: return AllGatherFirstDim(k, group, dy);
    case Mapping::kGatherFromSp:
      return tensor_parallel_output_grad ? ReduceScatterFirstDim(k, group, dy)
                                         : SplitFirstDim(k, group, dy);
    case Mapping::kReduceScatterToSp: return AllGatherFirstDim(k, group, dy);
  }
  return dy;
}

}  // namespace mpusim
