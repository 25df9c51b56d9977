// fully_shard over the data-parallel ranks (see fully_shard.h).
#include "core/model/fully_shard.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace mpusim {

namespace {

// Copies `count` elements from src at `from` to dst at `to` (flat views; nothing for 0).
void CopyElements(Kernels& k, const Tensor& src, int64_t from, Tensor& dst, int64_t to,
                  int64_t count) {
  if (count == 0) return;
  Tensor place = dst.FlatSlice(to, count);
  k.Copy(src.FlatSlice(from, count), place);
}

// The trace's site for a unit's collectives, put back when it goes out of scope.
class UnitSite {
 public:
  UnitSite(CommTrace& trace, const std::string& unit) : trace_(trace), before_(trace.site()) {
    trace_.SetSite("fully_shard " + unit);
  }
  ~UnitSite() { trace_.SetSite(before_); }
  UnitSite(const UnitSite&) = delete;
  UnitSite& operator=(const UnitSite&) = delete;

 private:
  CommTrace& trace_;
  std::string before_;
};

std::string ShapeText(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace

void ExplainFullyShard(const std::vector<FullyShardUnitPlan>& units,
                       const std::map<std::string, Shape>& local_shapes, int64_t group_size,
                       bool reshard_after_forward, std::ostream& out) {
  const int64_t D = group_size;
  out << fmt::format(
      "fully_shard (optimizer.use_torch_fsdp2: PyTorch's FSDP2, as Megatron's "
      "TorchFullyShardedDataParallel wraps the model) over the {} ranks of dp x cp: each rank "
      "keeps rows of dim 0 of its tensor-parallel piece of every parameter, with their "
      "gradients and optimizer state (placement Shard(0) on the dp mesh dimension); a unit's "
      "parameters are all-gathered in one collective before its forward{}, and their gradients "
      "reduce-scattered (summed) after its backward, every micro-batch:\n",
      D,
      reshard_after_forward ? " and again before its backward (released after the forward; "
                              "the root keeps them)"
                            : " (kept until the backward: torch_fsdp2_reshard_after_forward "
                              "false)");
  for (const FullyShardUnitPlan& unit : units) {
    if (unit.params.empty()) continue;
    int64_t block = 0;  // elements per rank, padded
    std::string lines;
    for (const std::string& name : unit.params) {
      const auto it = local_shapes.find(name);
      if (it == local_shapes.end() || it->second.empty()) continue;
      const Shape& shape = it->second;
      const int64_t n = shape[0];
      const int64_t inner = n == 0 ? 0 : NumElements(shape) / n;
      block += (n + D - 1) / D * inner;
      std::string ranks;
      for (int64_t r = 0; r < D && r < 8; ++r) {
        const auto [first, end] = FullyShardRows(n, D, r);
        ranks += fmt::format("{}dp {}: {}", r == 0 ? "" : ", ", r,
                             end > first ? fmt::format("rows {}-{}", first, end - 1) : "none");
      }
      if (D > 8) ranks += fmt::format(", … ({} ranks in all)", D);
      lines += fmt::format("    {} {}: Shard(0) over dp, {}\n", name, ShapeText(shape), ranks);
    }
    out << fmt::format(
               "  {}{}: all_gather_into_tensor of {} x {} elements, reduce_scatter_tensor "
               "of the same\n",
               unit.name, unit.root ? " (the root)" : "", D, block)
        << lines;
  }
}

RowRange FullyShardRows(int64_t rows, int64_t group_size, int64_t r) {
  const int64_t c = (rows + group_size - 1) / group_size;
  return {std::min(rows, r * c), std::min(rows, (r + 1) * c)};
}

FullyShard::FullyShard(std::vector<Unit> units, Communicator& group, bool reshard_after_forward,
                       Kernels& k)
    : units_(std::move(units)), group_(group), reshard_after_forward_(reshard_after_forward) {
  const int64_t D = group_.Size(), r = group_.Rank();
  for (const Unit& unit : units_) {
    UnitState& state = state_.emplace_back();
    for (Parameter* p : unit.params) {
      if (!p->value.defined() || p->value.shape().empty()) {
        throw std::logic_error(fmt::format("FullyShard: {} has no value to shard", p->name));
      }
      Piece h;
      h.model = p;
      h.trainable = p->grad.defined();
      h.rows = p->value.shape()[0];
      h.inner = h.rows == 0 ? 0 : p->value.numel() / h.rows;
      h.chunk = FullyShardRows(h.rows, D, 0).count();
      h.offset = state.block;
      state.block += h.chunk * h.inner;
      // This rank's rows, copied out of the whole value.
      const int64_t mine = RowsOf(h, r);
      Shape shape = p->value.shape();
      shape[0] = mine;
      h.shard = std::make_unique<Parameter>(*p);
      h.shard->value = k.Empty(shape, p->value.dtype());
      CopyElements(k, p->value, r * h.chunk * h.inner, h.shard->value, 0, mine * h.inner);
      h.shard->grad = h.trainable ? k.Zeros(shape, p->grad.dtype()) : Tensor();
      p->value = Tensor();
      p->grad = Tensor();
      if (!state.held.empty() &&
          held_[state.held.front()].shard->value.dtype() != h.shard->value.dtype()) {
        throw std::logic_error(
            fmt::format("FullyShard: unit {} holds parameters of more than one dtype", unit.name));
      }
      state.held.push_back(held_.size());
      held_.push_back(std::move(h));
    }
  }
}

void FullyShard::Unshard(Kernels& k, size_t u, CommTrace& trace) {
  UnitState& state = state_.at(u);
  if (state.whole || state.held.empty()) {
    state.whole = true;
    return;
  }
  const int64_t D = group_.Size();
  const DType dtype = held_[state.held.front()].shard->value.dtype();
  Tensor block = k.Zeros({state.block}, dtype);
  for (size_t i : state.held) {
    const Piece& h = held_[i];
    CopyElements(k, h.shard->value, 0, block, h.offset, h.shard->value.numel());
  }
  Tensor all = block;
  if (D > 1) {
    const UnitSite site(trace, units_[u].name);
    all = k.Empty({D * state.block}, dtype);
    group_.AllGather(block, all);
  }
  for (size_t i : state.held) {
    const Piece& h = held_[i];
    Shape shape = h.shard->value.shape();
    shape[0] = h.rows;
    Tensor whole = k.Empty(shape, dtype);
    for (int64_t q = 0; q < D; ++q) {
      CopyElements(k, all, q * state.block + h.offset, whole, q * h.chunk * h.inner,
                   RowsOf(h, q) * h.inner);
    }
    h.model->value = whole;
  }
  state.whole = true;
}

void FullyShard::Release(size_t u) {
  UnitState& state = state_.at(u);
  for (size_t i : state.held) held_[i].model->value = Tensor();
  state.whole = false;
}

void FullyShard::PreForward(Kernels& k, size_t u, CommTrace& trace) { Unshard(k, u, trace); }

void FullyShard::PostForward(size_t u, bool recomputing) {
  if (recomputing || !reshard_after_forward_ || units_.at(u).root) return;
  Release(u);
}

void FullyShard::PreBackward(Kernels& k, size_t u, CommTrace& trace) {
  Unshard(k, u, trace);
  for (size_t i : state_.at(u).held) {
    Piece& h = held_[i];
    if (h.trainable && !h.model->grad.defined()) {
      h.model->grad = k.Zeros(h.model->value.shape(), h.shard->grad.dtype());
    }
  }
}

void FullyShard::PostBackward(Kernels& k, size_t u, CommTrace& trace) {
  UnitState& state = state_.at(u);
  const int64_t D = group_.Size(), r = group_.Rank();
  std::vector<size_t> reduced;
  for (size_t i : state.held) {
    if (held_[i].trainable && held_[i].model->grad.defined()) reduced.push_back(i);
  }
  if (!reduced.empty()) {
    const DType dtype = held_[reduced.front()].shard->grad.dtype();
    // The whole gradients laid out as D blocks (rank q's rows of each at its offset in block
    // q), reduce-scattered: block r summed over the group.
    Tensor all = k.Zeros({D * state.block}, dtype);
    for (size_t i : reduced) {
      const Piece& h = held_[i];
      for (int64_t q = 0; q < D; ++q) {
        CopyElements(k, h.model->grad, q * h.chunk * h.inner, all, q * state.block + h.offset,
                     RowsOf(h, q) * h.inner);
      }
    }
    Tensor mine = all;
    if (D > 1) {
      const UnitSite site(trace, units_[u].name);
      mine = k.Zeros({state.block}, dtype);
      group_.ReduceScatter(all, mine);
    }
    for (size_t i : reduced) {
      Piece& h = held_[i];
      const int64_t count = RowsOf(h, r) * h.inner;
      if (count > 0) {
        Tensor grad = h.shard->grad.FlatSlice(0, count);
        k.Axpy(1.0, mine.FlatSlice(h.offset, count), grad);
      }
      h.model->grad = Tensor();
    }
  }
  Release(u);
}

void FullyShard::ZeroGrads(Kernels& k) {
  for (Piece& h : held_) {
    if (h.trainable) k.SetZero(h.shard->grad);
    h.model->grad = Tensor();
  }
  for (size_t u = 0; u < units_.size(); ++u) Release(u);
}

Tensor FullyShard::GatherRows(Kernels& k, Communicator& group, const Tensor& piece,
                              const Shape& whole) {
  const int64_t D = group.Size();
  const int64_t rows = whole.at(0);
  const int64_t inner = rows == 0 ? 0 : NumElements(whole) / rows;
  const int64_t chunk = FullyShardRows(rows, D, 0).count();  // the padded rows of every rank
  Tensor block = k.Zeros({chunk * inner}, piece.dtype());
  CopyElements(k, piece, 0, block, 0, piece.numel());
  Tensor all = block;
  if (D > 1) {
    all = k.Empty({D * chunk * inner}, piece.dtype());
    group.AllGather(block, all);
  }
  Tensor out = k.Empty(whole, piece.dtype());
  CopyElements(k, all, 0, out, 0, rows * inner);
  return out;
}

void FullyShard::GatherForRecords(Kernels& k, CommTrace& trace) {
  for (size_t u = 0; u < units_.size(); ++u) {
    Unshard(k, u, trace);
    for (size_t i : state_[u].held) {
      Piece& h = held_[i];
      if (!h.trainable) continue;
      const UnitSite site(trace, units_[u].name);
      h.model->grad = GatherRows(k, group_, h.shard->grad, h.model->value.shape());
    }
  }
}

std::vector<Parameter*> FullyShard::Shards() const {
  std::vector<Parameter*> out;
  for (const Piece& h : held_) {
    if (h.trainable) out.push_back(h.shard.get());
  }
  return out;
}

std::vector<const Parameter*> FullyShard::Held() const {
  std::vector<const Parameter*> out;
  for (const Piece& h : held_) out.push_back(h.shard.get());
  return out;
}

}  // namespace mpusim
