// DTensor placements and redistribution (see dtensor.h).
#include "core/tensor_parallel/dtensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>

namespace mpusim {
namespace {

std::string Trimmed(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (std::isspace(static_cast<unsigned char>(c)) == 0) out.push_back(c);
  }
  return out;
}

// Strides of a contiguous tensor of `shape`.
Shape Strides(const Shape& shape) {
  Shape strides(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * shape[i];
  return strides;
}

int64_t Offset(const Shape& start, const Shape& strides) {
  int64_t at = 0;
  for (size_t i = 0; i < start.size(); ++i) at += start[i] * strides[i];
  return at;
}

// Copies the box `box` at `src_start` of `src` (contiguous, `src_shape`, from flat element
// `src_base`) to `dst_start` of `dst` (contiguous, `dst_shape`, from `dst_base`).
void CopyBox(Kernels& k, const Tensor& src, int64_t src_base, const Shape& src_shape,
             const Shape& src_start, const Shape& box, Tensor& dst, int64_t dst_base,
             const Shape& dst_shape, const Shape& dst_start) {
  if (NumElements(box) == 0) return;
  const Shape src_strides = Strides(src_shape), dst_strides = Strides(dst_shape);
  k.StridedCopy(src, src_base + Offset(src_start, src_strides), box, src_strides, dst,
                dst_base + Offset(dst_start, dst_strides), dst_strides);
}

Shape With(Shape shape, int64_t dim, int64_t size) {
  shape[static_cast<size_t>(dim)] = size;
  return shape;
}

}  // namespace

std::string DTensorPlacementName(const DTensorPlacement& p) {
  switch (p.kind) {
    case DTensorPlacementKind::kShard:
      return fmt::format("Shard({})", p.dim);
    case DTensorPlacementKind::kReplicate:
      return "Replicate()";
    case DTensorPlacementKind::kPartial:
      return "Partial()";
  }
  return "";
}

StatusOr<DTensorPlacement> ParseDTensorPlacement(std::string_view text, int64_t ndim,
                                                 std::string_view where) {
  const std::string s = Trimmed(text);
  const auto refuse = [&] {
    return Status::Error(where, fmt::format("\"{}\" is not a placement; use \"Shard(d)\" (d in "
                                            "[-{}, {}]), \"Replicate()\" or \"Partial()\"",
                                            text, ndim, ndim - 1));
  };
  if (s == "Replicate()" || s == "R") return DTensorPlacement::Replicate();
  if (s == "Partial()" || s == "Partial(sum)" || s == "Partial(\"sum\")" || s == "Partial('sum')" ||
      s == "P") {
    return DTensorPlacement::Partial();
  }
  if (s.starts_with("Partial(")) {
    return Status::Error(where, fmt::format("\"{}\": only Partial()'s sum reduction is built "
                                            "(DTensor's default)",
                                            text));
  }
  std::string_view arg;
  if (s.starts_with("Shard(") && s.ends_with(")")) {
    arg = std::string_view(s).substr(6, s.size() - 7);
    if (arg.starts_with("dim=")) arg.remove_prefix(4);
  } else if (s.starts_with("S(") && s.ends_with(")")) {
    arg = std::string_view(s).substr(2, s.size() - 3);
  } else {
    return refuse();
  }
  int64_t dim = 0;
  const auto [end, ec] = std::from_chars(arg.data(), arg.data() + arg.size(), dim);
  if (ec != std::errc() || end != arg.data() + arg.size() || arg.empty()) return refuse();
  if (dim < -ndim || dim >= ndim) {
    return Status::Error(where, fmt::format("\"{}\": dim {} is out of range for a tensor of {} "
                                            "dimension{} (allowed [-{}, {}])",
                                            text, dim, ndim, ndim == 1 ? "" : "s", ndim, ndim - 1));
  }
  return DTensorPlacement::Shard(dim < 0 ? dim + ndim : dim);
}

ChunkPiece ChunkOf(int64_t size, int64_t n, int64_t rank) {
  const int64_t full = (size + n - 1) / n;  // torch.chunk's piece
  const int64_t start = std::min(size, full * rank);
  return {std::min(size, start + full) - start, start};
}

Shape DTensorLocalShape(const Shape& global, const DTensorPlacement& p, int64_t n, int64_t rank) {
  if (!p.is_shard()) return global;
  return With(global, p.dim, ChunkOf(global[static_cast<size_t>(p.dim)], n, rank).size);
}

std::string_view DTensorCollectiveName(DTensorCollective c) {
  switch (c) {
    case DTensorCollective::kNone:
      return "";
    case DTensorCollective::kAllGather:
      return "all_gather_into_tensor";
    case DTensorCollective::kAllReduce:
      return "all_reduce";
    case DTensorCollective::kReduceScatter:
      return "reduce_scatter_tensor";
    case DTensorCollective::kAllToAll:
      return "all_to_all_single";
  }
  return "";
}

StatusOr<DTensorCollective> RedistributeCollective(const DTensorPlacement& from,
                                                   const DTensorPlacement& to, int64_t n) {
  if (from.is_shard() && to.is_partial()) {
    return Status::Error("placements", fmt::format("{} -> Partial(): DTensor does not "
                                                   "redistribute a shard to a partial "
                                                   "(\"not supported yet\"); go through "
                                                   "Replicate()",
                                                   DTensorPlacementName(from)));
  }
  if (from == to || n == 1) return DTensorCollective::kNone;
  if (to.is_replicate()) {
    return from.is_partial() ? DTensorCollective::kAllReduce : DTensorCollective::kAllGather;
  }
  if (to.is_shard()) {
    if (from.is_partial()) return DTensorCollective::kReduceScatter;
    if (from.is_shard()) return DTensorCollective::kAllToAll;
  }
  return DTensorCollective::kNone;  // Replicate -> Shard, Replicate -> Partial: local
}

DTensorPlacement GradientPlacement(const DTensorPlacement& from, const DTensorPlacement& grad) {
  if (from.is_partial() && (grad.is_shard() || grad.is_replicate())) {
    return DTensorPlacement::Replicate();
  }
  return from;
}

StatusOr<Tensor> Redistribute(Kernels& k, Communicator& group, const Tensor& local,
                              const Shape& global, const DTensorPlacement& from,
                              const DTensorPlacement& to) {
  const int64_t n = group.Size(), r = group.Rank();
  StatusOr<DTensorCollective> collective = RedistributeCollective(from, to, n);
  if (!collective.ok()) return collective.status();
  const auto rank_of = static_cast<int64_t>(global.size());
  if (rank_of > Kernels::kMaxCopyDims) {
    return Status::Error("placements", fmt::format("a tensor of {} dimensions (at most {})",
                                                   rank_of, Kernels::kMaxCopyDims));
  }
  for (const DTensorPlacement& p : {from, to}) {
    if (p.is_shard() && (p.dim < 0 || p.dim >= rank_of)) {
      return Status::Error("placements", fmt::format("{} on a tensor of {} dimensions",
                                                     DTensorPlacementName(p), rank_of));
    }
  }
  const Shape have = DTensorLocalShape(global, from, n, r);
  if (local.shape() != have) {
    return Status::Error("placements",
                         fmt::format("the local tensor is [{}], but {} of [{}] on rank {} of {} "
                                     "is [{}]",
                                     fmt::join(local.shape(), ", "), DTensorPlacementName(from),
                                     fmt::join(global, ", "), r, n, fmt::join(have, ", ")));
  }
  const DType dtype = local.dtype();
  const Shape want = DTensorLocalShape(global, to, n, r);
  const Shape zero(global.size(), 0);
  if (from == to || n == 1) {
    Tensor out = k.Empty(want, dtype);
    k.Copy(local, out);
    return out;
  }
  Tensor out = k.Empty(want, dtype);
  const auto piece_of = [&](const DTensorPlacement& p, int64_t rank) {
    return ChunkOf(global[static_cast<size_t>(p.dim)], n, rank);
  };
  // A rank's piece padded to torch.chunk's full size, as the collectives need equal parts.
  const auto padded = [&](const DTensorPlacement& p) {
    const int64_t d = global[static_cast<size_t>(p.dim)];
    return With(global, p.dim, (d + n - 1) / n);
  };
  // The local tensor cut along `to` into n parts of shape `part` (rank j's piece at part j,
  // zero-padded), for a reduce-scatter or an all-to-all.
  const auto pack = [&](const Shape& part) {
    const int64_t part_n = NumElements(part);
    Tensor send = k.Zeros({n * part_n}, dtype);
    for (int64_t j = 0; j < n; ++j) {
      const ChunkPiece c = piece_of(to, j);
      CopyBox(k, local, 0, have, With(zero, to.dim, c.offset), With(have, to.dim, c.size), send,
              j * part_n, part, zero);
    }
    return send;
  };
  // The n received parts of shape `part` (rank j's piece along `from` at part j, padded) put
  // together along `from` into `out`.
  const auto unpack = [&](const Tensor& received, const Shape& part) {
    const int64_t part_n = NumElements(part);
    for (int64_t j = 0; j < n; ++j) {
      const ChunkPiece c = piece_of(from, j);
      CopyBox(k, received, j * part_n, part, zero, With(want, from.dim, c.size), out, 0, want,
              With(zero, from.dim, c.offset));
    }
  };
  switch (*collective) {
    case DTensorCollective::kAllReduce:
      k.Copy(local, out);
      group.AllReduce(out, ReduceOp::kSum);
      break;
    case DTensorCollective::kAllGather: {  // Shard(d) -> Replicate()
      const Shape part = padded(from);
      const int64_t part_n = NumElements(part);
      Tensor send = k.Zeros({part_n}, dtype);
      CopyBox(k, local, 0, have, zero, have, send, 0, part, zero);
      Tensor gathered = k.Empty({n * part_n}, dtype);
      group.AllGather(send, gathered);
      unpack(gathered, part);
      break;
    }
    case DTensorCollective::kReduceScatter: {  // Partial() -> Shard(d)
      const Shape part = padded(to);
      const Tensor send = pack(part);
      Tensor mine = k.Empty({NumElements(part)}, dtype);
      group.ReduceScatter(send, mine);
      CopyBox(k, mine, 0, part, zero, want, out, 0, want, zero);
      break;
    }
    case DTensorCollective::kAllToAll: {  // Shard(a) -> Shard(b)
      // Part j: this rank's piece along a of rank j's piece along b, both padded.
      const Shape part = With(padded(to), from.dim, padded(from)[static_cast<size_t>(from.dim)]);
      const Tensor send = pack(part);
      Tensor received = k.Empty(send.shape(), dtype);
      group.AllToAll(send, received);
      unpack(received, part);
      break;
    }
    case DTensorCollective::kNone:
      if (to.is_shard()) {  // Replicate() -> Shard(d): the rank's piece
        CopyBox(k, local, 0, have, With(zero, to.dim, piece_of(to, r).offset), want, out, 0, want,
                zero);
      } else {  // Replicate() -> Partial(): DTensor's tensor / n
        k.Copy(local, out);
        k.Scale(1.0 / static_cast<double>(n), out);
      }
      break;
  }
  return out;
}

}  // namespace mpusim
