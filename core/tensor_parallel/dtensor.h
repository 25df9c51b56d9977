// PyTorch's DTensor placements on one mesh dimension and the redistribution between them
// (torch.distributed.tensor: placement_types.py, _redistribute.py): the layer PyTorch's
// tensor-parallel plans (parallelize_module's styles) stand on, as Megatron's regions
// (mappings.h) stand under ColumnParallelLinear and RowParallelLinear.
//
// A placement says what each rank of a mesh dimension (a Communicator of n ranks) holds of a
// global tensor:
//   Shard(d)     its torch.chunk piece along dimension d: pieces of ceil(D / n) elements,
//                the last ones shorter or empty when n does not divide D (ChunkOf)
//   Replicate()  the whole tensor
//   Partial()    a whole-shaped term; the global tensor is the sum over the ranks ("sum",
//                DTensor's default reduce_op; the others are refused)
// Redistribute moves a rank's local tensor from one placement to another as
// redistribute_local_tensor does on one mesh dimension:
//   Shard(d)   -> Replicate()  all_gather_into_tensor (pieces padded to ceil(D / n))
//   Partial()  -> Replicate()  all_reduce
//   Partial()  -> Shard(d)     reduce_scatter_tensor
//   Shard(a)   -> Shard(b)     all_to_all_single
//   Replicate() -> Shard(d)    the rank's piece, no communication
//   Replicate() -> Partial()   the tensor times 1 / n, no communication (DTensor divides by
//                              n: the same numbers when n is a power of two)
//   Shard(d)   -> Partial()    refused, as DTensor refuses it ("not supported yet"; on any
//                              mesh size, where DTensor lets one rank through untouched)
// The collectives carry CommDebugMode's functional-collective names (DTensorCollectiveName),
// the names PyTorch users count with. A redistribution's backward redistributes the gradient
// the other way, a Partial source becoming Replicate() (GradientPlacement, Redistribute's
// autograd backward).
//
// What it is not: a DTensor (no shape propagation through ops) nor a plan; the styles that
// decide placements are built on it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/communicator.h"
#include "core/kernels.h"
#include "core/status.h"
#include "core/tensor.h"

namespace mpusim {

enum class DTensorPlacementKind : uint8_t { kShard, kReplicate, kPartial };

struct DTensorPlacement {
  DTensorPlacementKind kind = DTensorPlacementKind::kReplicate;
  int64_t dim = 0;  // kShard: the tensor dimension, 0 <= dim < the tensor's rank

  static DTensorPlacement Shard(int64_t dim) { return {DTensorPlacementKind::kShard, dim}; }
  static DTensorPlacement Replicate() { return {DTensorPlacementKind::kReplicate, 0}; }
  static DTensorPlacement Partial() { return {DTensorPlacementKind::kPartial, 0}; }
  bool is_shard() const { return kind == DTensorPlacementKind::kShard; }
  bool is_replicate() const { return kind == DTensorPlacementKind::kReplicate; }
  bool is_partial() const { return kind == DTensorPlacementKind::kPartial; }
  bool operator==(const DTensorPlacement& o) const {
    return kind == o.kind && (kind != DTensorPlacementKind::kShard || dim == o.dim);
  }
};

// "Shard(1)", "Replicate()", "Partial()".
std::string DTensorPlacementName(const DTensorPlacement& p);
// torch's spellings: "Shard(1)", "Shard(-1)", "Shard(dim=1)", "Replicate()", "Partial()",
// "Partial(sum)" (also the str forms "S(1)", "R", "P"). A negative dim counts from the end of
// a tensor of `ndim` dimensions. `where` names the config field in the error.
StatusOr<DTensorPlacement> ParseDTensorPlacement(std::string_view text, int64_t ndim,
                                                 std::string_view where);

// Rank `rank`'s torch.chunk piece of `size` elements split `n` ways.
struct ChunkPiece {
  int64_t size = 0, offset = 0;
};
ChunkPiece ChunkOf(int64_t size, int64_t n, int64_t rank);
// The local shape of a tensor of `global` shape under `p` on rank `rank` of `n`.
Shape DTensorLocalShape(const Shape& global, const DTensorPlacement& p, int64_t n, int64_t rank);

enum class DTensorCollective : uint8_t { kNone, kAllGather, kAllReduce, kReduceScatter, kAllToAll };
// CommDebugMode's names: "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor",
// "all_to_all_single"; "" for none.
std::string_view DTensorCollectiveName(DTensorCollective c);

// The collective moving `from` to `to` on a mesh dimension of `n` ranks (none when they are
// equal, when n is 1, or for the local Replicate -> Shard and Replicate -> Partial), or the
// refusal of Shard -> Partial.
StatusOr<DTensorCollective> RedistributeCollective(const DTensorPlacement& from,
                                                   const DTensorPlacement& to, int64_t n);
// The placement a redistribution from `from` sends its gradient back to, the gradient being
// `grad` (the redistribution's target): Partial() becomes Replicate() when the gradient is
// sharded or replicated (Redistribute.backward's normalisation), else `from`.
DTensorPlacement GradientPlacement(const DTensorPlacement& from, const DTensorPlacement& grad);

// `local` (this rank's tensor of a `global`-shaped DTensor under `from`, its shape
// DTensorLocalShape's) redistributed to `to` over `group`; a new tensor, `local` unchanged.
// Refused (and nothing communicated) for Shard -> Partial, a local shape that does not match,
// or more than Kernels::kMaxCopyDims dimensions.
StatusOr<Tensor> Redistribute(Kernels& k, Communicator& group, const Tensor& local,
                              const Shape& global, const DTensorPlacement& from,
                              const DTensorPlacement& to);

}  // namespace mpusim
