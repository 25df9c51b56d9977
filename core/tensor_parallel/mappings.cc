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

Tensor AllReduceTp(RankContext& ctx, const Tensor& x) {
  Tensor out = ctx.kernels->Empty(x.shape(), x.dtype());
  ctx.kernels->Copy(x, out);
  ctx.Group("tp").AllReduce(out, ReduceOp::kSum);
  return out;
}

Tensor AllGatherFirstDimTp(RankContext& ctx, const Tensor& x) {
  const int64_t t = ctx.tp_size();
  if (t == 1) return x;
  Tensor out = ctx.kernels->Empty(WithDim(x.shape(), 0, x.shape()[0] * t), x.dtype());
  ctx.Group("tp").AllGather(x, out);
  return out;
}

Tensor ReduceScatterFirstDimTp(RankContext& ctx, const Tensor& x) {
  const int64_t t = ctx.tp_size();
  if (t == 1) return x;
  RequireDivisible(x.shape()[0], t, "reduce-scatter along the sequence");
  Tensor out = ctx.kernels->Empty(WithDim(x.shape(), 0, x.shape()[0] / t), x.dtype());
  ctx.Group("tp").ReduceScatter(x, out);
  return out;
}

Tensor AllGatherLastDimTp(RankContext& ctx, const Tensor& x) {
  const int64_t t = ctx.tp_size();
  if (t == 1) return x;
  // NCCL/MPI gather flat buffers in rank order: [t, rows, c]; interleave into [rows, t*c].
  const int64_t rows = x.rows();
  const int64_t cols = x.cols();
  Tensor stacked = ctx.kernels->Empty(Shape{t * rows, cols}, x.dtype());
  ctx.Group("tp").AllGather(x, stacked);
  const size_t last = x.shape().size() - 1;
  Tensor out = ctx.kernels->Empty(WithDim(x.shape(), last, cols * t), x.dtype());
  for (int64_t r = 0; r < t; ++r) {
    ctx.kernels->CopyBlock(stacked, r * rows, 0, out, 0, r * cols, rows, cols);
  }
  return out;
}

Tensor SplitFirstDimTp(RankContext& ctx, const Tensor& x) {
  const int64_t t = ctx.tp_size();
  if (t == 1) return x;
  RequireDivisible(x.shape()[0], t, "split along the sequence");
  const Shape shape = WithDim(x.shape(), 0, x.shape()[0] / t);
  Tensor out = ctx.kernels->Empty(shape, x.dtype());
  const int64_t rows = out.rows();
  ctx.kernels->CopyBlock(x, ctx.tp_rank() * rows, 0, out, 0, 0, rows, x.cols());
  return out;
}

Tensor SplitLastDimTp(RankContext& ctx, const Tensor& x) {
  const int64_t t = ctx.tp_size();
  if (t == 1) return x;
  RequireDivisible(x.cols(), t, "split along the last dimension");
  const int64_t cols = x.cols() / t;
  Tensor out = ctx.kernels->Empty(WithDim(x.shape(), x.shape().size() - 1, cols), x.dtype());
  ctx.kernels->CopyBlock(x, 0, ctx.tp_rank() * cols, out, 0, 0, x.rows(), cols);
  return out;
}

Tensor MappingForward(RankContext& ctx, Mapping mapping, const Tensor& x) {
  switch (mapping) {
    case Mapping::kCopyToTp: return x;
    case Mapping::kReduceFromTp: return ctx.tp_size() == 1 ? x : AllReduceTp(ctx, x);
    case Mapping::kScatterToTp: return SplitLastDimTp(ctx, x);
    case Mapping::kGatherFromTp: return AllGatherLastDimTp(ctx, x);
    case Mapping::kScatterToSp: return SplitFirstDimTp(ctx, x);
    case Mapping::kGatherFromSp: return AllGatherFirstDimTp(ctx, x);
    case Mapping::kReduceScatterToSp: return ReduceScatterFirstDimTp(ctx, x);
  }
  return x;
}

Tensor MappingBackward(RankContext& ctx, Mapping mapping, const Tensor& dy,
                       bool tensor_parallel_output_grad) {
  switch (mapping) {
    case Mapping::kCopyToTp: return ctx.tp_size() == 1 ? dy : AllReduceTp(ctx, dy);
    case Mapping::kReduceFromTp: return dy;
    case Mapping::kScatterToTp: return AllGatherLastDimTp(ctx, dy);
    case Mapping::kGatherFromTp: return SplitLastDimTp(ctx, dy);
    case Mapping::kScatterToSp: return AllGatherFirstDimTp(ctx, dy);
    case Mapping::kGatherFromSp:
      return tensor_parallel_output_grad ? ReduceScatterFirstDimTp(ctx, dy)
                                         : SplitFirstDimTp(ctx, dy);
    case Mapping::kReduceScatterToSp: return AllGatherFirstDimTp(ctx, dy);
  }
  return dy;
}

}  // namespace mpusim
