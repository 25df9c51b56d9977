// PyTorch's FSDP2 (`fully_shard`) over the data-parallel ranks, as Megatron-Core wraps a model
// with it (optimizer.use_torch_fsdp2: megatron/core/distributed/
// torch_fully_sharded_data_parallel.py, on the data-parallel group with context parallelism).
//
// What it is: the model's parameters split into units, each the parameters of one module
// `fully_shard` wraps (the root holding the rest). Between uses every rank keeps of each
// parameter only its rows of dim 0 of its tensor-parallel piece, as FSDP2 chunks the local
// tensor: with n rows over D ranks, rank r holds rows [r c, min((r + 1) c, n)), c = ceil(n / D)
// (torch.chunk; the last ranks may hold fewer rows, or none). A unit's parameters travel
// together, as FSDP2's flat copy-in and copy-out make one collective of them: each rank's
// rows padded to c rows per parameter, laid end to end (the unit's block of S elements).
//   before a unit's forward     one all_gather_into_tensor of the blocks ([D S]); every
//                               parameter rebuilt whole from its D pieces
//   after it                    the whole tensors released (reshard_after_forward), except
//                               the root's (FSDP2 keeps the root's for the backward) and
//                               all of them with reshard_after_forward false
//   before its backward         gathered again if they were released; zero whole gradients
//   after its backward          one reduce_scatter_tensor (a sum) of the whole gradients laid
//                               out as the blocks; this rank's rows added to its sharded
//                               gradient; the whole gradients and parameters released
// A forward inside the backward (recomputation) neither gathers what is whole nor releases
// it. Every micro-batch's backward reduce-scatters (Megatron's no_sync is a no-op for FSDP2),
// so the sharded gradient is the sum over micro-batches of the sums over ranks: the same sum
// as DDP's all-reduce of accumulated gradients, in another order. The loss gradient carries
// the 1/(global batch) scale, so the sum is FSDP2's average.
// The sharded parameters (Shards) are what the optimizer updates: each is its model
// parameter's name, shape, split and flags with this rank's rows as value and gradient.
// What it is not: the placement's global view (_StridedShard), prefetching, mixed-precision
// policies (the reduce runs in main_grad's dtype), or memory the preflight plans.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "core/kernels.h"
#include "core/model/parameter.h"

namespace mpusim {

// The rows of dim 0 that rank r of `group_size` keeps of a tensor of `rows` rows, as
// torch.chunk splits them: [r c, min((r + 1) c, rows)) with c = ceil(rows / group_size), none
// past the end. The one definition the executor, explain and the estimate use.
struct RowRange {
  int64_t first = 0, end = 0;
  int64_t count() const { return end - first; }
};
RowRange FullyShardRows(int64_t rows, int64_t group_size, int64_t r);

// A unit as a model declares it (Model::FullyShardUnits), before anything is allocated: the
// module fully_shard wraps, whether it is the root, and the parameters it holds (state-dict
// names; every parameter the rank holds is in exactly one unit).
struct FullyShardUnitPlan {
  std::string name;
  bool root = false;
  std::vector<std::string> params;
};

// `mpusim explain`'s account of fully_shard over `group_size` ranks: per unit, each
// parameter's piece (`local_shapes`: this rank's tensor-parallel piece by name), its
// placement on the data-parallel ranks (Shard(0) of that piece) and the rows each rank keeps,
// then the unit's collectives per micro-batch.
void ExplainFullyShard(const std::vector<FullyShardUnitPlan>& units,
                       const std::map<std::string, Shape>& local_shapes, int64_t group_size,
                       bool reshard_after_forward, std::ostream& out);

class FullyShard {
 public:
  struct Unit {
    std::string name;                // the module fully_shard wraps
    std::vector<Parameter*> params;  // its parameters (held by this rank), each in one unit
    bool root = false;               // the model itself: kept whole after its forward
  };

  // `group`: the ranks the parameters shard over (dp x cp); it must outlive this. The
  // parameters must be filled (InitializeParameters) and are sharded here: their values and
  // gradients released, each rank keeping its rows.
  FullyShard(std::vector<Unit> units, Communicator& group, bool reshard_after_forward, Kernels& k);

  // The hooks a model calls around unit `u` (index into units()); `trace` names the
  // collectives "fully_shard <unit>" in the caller's phase.
  void PreForward(Kernels& k, size_t u, CommTrace& trace);
  // `recomputing`: a forward inside the backward, which releases nothing.
  void PostForward(size_t u, bool recomputing);
  void PreBackward(Kernels& k, size_t u, CommTrace& trace);
  void PostBackward(Kernels& k, size_t u, CommTrace& trace);

  // The start of a step: the sharded gradients zeroed, every unit released.
  void ZeroGrads(Kernels& k);
  // Every parameter and its reduced gradient gathered whole into the model's parameters (for
  // the records and dumps after a step), as the sharded ones are now.
  void GatherForRecords(Kernels& k, CommTrace& trace);

  // The sharded parameters of the trainable ones, in the units' order: the optimizer's.
  std::vector<Parameter*> Shards() const;
  // This rank's sharded parameters, frozen ones included (what it holds between uses).
  std::vector<const Parameter*> Held() const;
  const std::vector<Unit>& units() const { return units_; }
  int64_t group_size() const { return group_.Size(); }

  // `piece` (this rank's rows of dim 0 of a tensor shaped `whole`, as Shard keeps them)
  // gathered over `group` into the whole tensor: what a record of optimizer state needs.
  static Tensor GatherRows(Kernels& k, Communicator& group, const Tensor& piece,
                           const Shape& whole);

 private:
  struct Piece {
    Parameter* model = nullptr;
    std::unique_ptr<Parameter> shard;  // value and grad: this rank's rows
    bool trainable = false;
    int64_t rows = 0, chunk = 0, inner = 0;  // n, c and the elements per row
    int64_t offset = 0;                      // in the unit's block
  };
  struct UnitState {
    std::vector<size_t> held;  // indices into held_
    int64_t block = 0;         // S
    bool whole = false;        // the model's parameters hold the gathered values
  };
  // Rows of rank q of the group for piece h.
  int64_t RowsOf(const Piece& h, int64_t q) const {
    return FullyShardRows(h.rows, group_.Size(), q).count();
  }
  void Unshard(Kernels& k, size_t u, CommTrace& trace);
  void Release(size_t u);

  std::vector<Unit> units_;
  Communicator& group_;
  bool reshard_after_forward_;
  std::vector<Piece> held_;
  std::vector<UnitState> state_;
};

}  // namespace mpusim
