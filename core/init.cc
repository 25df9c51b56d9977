// Layout-invariant initialisation (see init.h): master values, shard fills, reassembly.
//
// What it is: the host-side definition of every master tensor (weights, synthetic data) that
// both the parallel executor and the float64 reference model start from, and the inverse
// placement that rebuilds a full tensor from rank shards for checking.
// What it is not: op math, or device code. A backend that fills on the device must reproduce
// these values; the reference only ever calls the functions here.
#include "core/init.h"

#include "core/arg_checks.h"  // DispatchStorage
#include "core/half.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <stdexcept>

namespace mpusim {
namespace {

// torch.nn.init._calculate_fan_in_and_fan_out for [out, in, *receptive] shapes. torch refuses
// fewer than 2 dimensions; we give a 1-D [n] tensor fan_in = fan_out = n, and a scalar 1.
double XavierStd(const Shape& shape) {
  int64_t fan_in = 1;
  int64_t fan_out = 1;
  if (shape.size() == 1) {
    fan_in = fan_out = shape[0];
  } else if (shape.size() >= 2) {
    int64_t receptive = 1;
    for (size_t d = 2; d < shape.size(); ++d) receptive *= shape[d];
    fan_in = shape[1] * receptive;
    fan_out = shape[0] * receptive;
  }
  // A zero fan means the tensor has no elements, so no value is ever asked for.
  if (fan_in + fan_out <= 0) return 0.0;
  return std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
}

// Scale applied to a standard normal; kZeros never gets here (0 * -x would give -0.0).
double NormalScale(const InitSpec& spec, const Shape& full_shape) {
  return spec.method == InitMethod::kXavierNormal ? XavierStd(full_shape) : spec.std;
}


// Calls fn(local_flat, global_flat) for every element of the local tensor, in local row-major
// order: an odometer over the outer dimensions, a plain loop over the last.
template <typename Fn>
void ForEachElement(const std::vector<std::vector<int64_t>>& offsets, const Shape& local, Fn&& fn) {
  if (NumElements(local) == 0) return;
  if (local.empty()) {
    fn(int64_t{0}, int64_t{0});
    return;
  }
  const size_t last = local.size() - 1;
  const std::vector<int64_t>& inner = offsets[last];
  const int64_t rows = NumElements(local) / local[last];
  std::vector<size_t> index(last, 0);
  int64_t local_flat = 0;
  for (int64_t row = 0; row < rows; ++row) {
    int64_t base = 0;
    for (size_t d = 0; d < last; ++d) base += offsets[d][index[d]];
    for (int64_t g : inner) fn(local_flat++, base + g);
    for (size_t d = last; d-- > 0;) {
      if (++index[d] < static_cast<size_t>(local[d])) break;
      index[d] = 0;
    }
  }
}

// Fills host_out with master values of `name`: visit(fn) calls fn(local_flat, global_flat)
// for every element of host_out. Zeros for kZeros (an explicit fill: the caller's buffer need
// not be zeroed), else the same expression as MasterValue, so that both give the same bits.
template <typename Visit>
void FillMaster(uint64_t seed, std::string_view name, const InitSpec& spec,
                const Shape& full_shape, Tensor& host_out, Visit&& visit) {
  if (spec.method == InitMethod::kZeros) {
    std::memset(host_out.data(), 0, host_out.bytes());
    return;
  }
  if (spec.method == InitMethod::kOnes) {
    DispatchStorage(host_out.dtype(), [&]<typename T>() {
      T* out = host_out.data_as<T>();
      visit([&](int64_t local_flat, int64_t) { out[local_flat] = RoundTo<T>(1.0); });
    });
    return;
  }
  const uint64_t stream = StreamId(name);
  const double scale = NormalScale(spec, full_shape);
  DispatchStorage(host_out.dtype(), [&]<typename T>() {
    T* out = host_out.data_as<T>();
    visit([&](int64_t local_flat, int64_t global_flat) {
      out[local_flat] = RoundTo<T>(scale * NormalAt(seed, stream, static_cast<uint64_t>(global_flat)));
    });
  });
}

// "[i, j]": the multi-index of `flat` in `shape`, for error messages.
std::string Coordinates(const Shape& shape, int64_t flat) {
  Shape index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return ShapeString(index);
}

// Copies every shard to its global positions in `full`. An element placed twice must carry
// the same bits both times: shards gathered from every rank hold replicated copies (a
// weight replicated across data-parallel ranks), and a disagreement between copies is a bug
// that must not be hidden by whichever copy happened to be written last.
template <typename T>
Status PlaceShards(const std::vector<Tensor>& shards, const std::vector<ShardSpec>& specs,
                   Tensor& full) {
  const Shape& full_shape = full.shape();
  T* out = full.data_as<T>();
  std::vector<uint8_t> covered(static_cast<size_t>(full.numel()), 0);
  for (size_t i = 0; i < shards.size(); ++i) {
    const T* in = shards[i].data_as<T>();
    int64_t conflict_local = -1;
    int64_t conflict_global = -1;
    ForEachElement(FlatOffsets(specs[i], full_shape, shards[i].shape()), shards[i].shape(),
                   [&](int64_t local_flat, int64_t global_flat) {
                     const size_t g = static_cast<size_t>(global_flat);
                     const T value = in[local_flat];
                     if (covered[g] != 0 && std::memcmp(&out[g], &value, sizeof(T)) != 0) {
                       if (conflict_global < 0) {
                         conflict_local = local_flat;
                         conflict_global = global_flat;
                       }
                       return;
                     }
                     out[g] = value;
                     covered[g] = 1;
                   });
    if (conflict_global >= 0) {
      return Status::Error(
          fmt::format("shards[{}]", i),
          fmt::format("element {} of {} is {} here but {} in an earlier shard",
                      Coordinates(full_shape, conflict_global), ShapeString(full_shape),
                      Widen(in[conflict_local]), Widen(out[conflict_global])));
    }
  }
  const auto missing = std::find(covered.begin(), covered.end(), uint8_t{0});
  if (missing != covered.end()) {
    const int64_t first = missing - covered.begin();
    const auto count = std::count(covered.begin(), covered.end(), uint8_t{0});
    return Status::Error(
        "",
        fmt::format("element {} of {} is covered by no shard ({} of {} elements missing)",
                    Coordinates(full_shape, first), ShapeString(full_shape), count, full.numel()));
  }
  return {};
}

}  // namespace

StatusOr<InitMethod> ParseInitMethod(std::string_view text, std::string_view where) {
  for (InitMethod method : {InitMethod::kXavierNormal, InitMethod::kNormal, InitMethod::kZeros}) {
    if (text == InitMethodName(method)) return method;
  }
  return Status::Error(std::string(where),
                       fmt::format("must be one of xavier_normal, normal, zeros, got '{}'", text));
}

std::string_view InitMethodName(InitMethod method) {
  switch (method) {
    case InitMethod::kXavierNormal:
      return "xavier_normal";
    case InitMethod::kNormal:
      return "normal";
    case InitMethod::kZeros:
      return "zeros";
    case InitMethod::kOnes:
      return "ones";
  }
  return "unknown";  // only for a value cast from outside the enum
}

// FNV-1a, 64-bit: offset basis 14695981039346656037, prime 1099511628211.
uint64_t StreamId(std::string_view name) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (char c : name) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

// Box-Muller: r = sqrt(-2 ln(1 - u1)), theta = 2 pi u2, value r cos(theta). u1 is a multiple
// of 2^-53 in [0, 1), so 1 - u1 is exact and in (0, 1] and the log is finite.
double NormalAt(uint64_t key, uint64_t stream, uint64_t index) {
  const double u1 = UniformAt(key, stream, 2 * index);
  const double u2 = UniformAt(key, stream, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

double MasterValue(uint64_t seed, std::string_view name, const InitSpec& spec,
                   const Shape& full_shape, int64_t flat_index) {
  if (flat_index < 0 || flat_index >= NumElements(full_shape)) {
    throw std::out_of_range(fmt::format("MasterValue('{}'): flat index {} outside {}", name,
                                        flat_index, ShapeString(full_shape)));
  }
  if (spec.method == InitMethod::kZeros) return 0.0;
  if (spec.method == InitMethod::kOnes) return 1.0;
  return NormalScale(spec, full_shape) *
         NormalAt(seed, StreamId(name), static_cast<uint64_t>(flat_index));
}

void FillFlatRange(uint64_t seed, std::string_view name, const InitSpec& spec,
                   const Shape& full_shape, int64_t first_flat, Tensor& host_out) {
  const int64_t n = host_out.numel();
  if (first_flat < 0 || first_flat > NumElements(full_shape) - n) {
    throw std::out_of_range(fmt::format("FillFlatRange('{}'): elements [{}, {}) outside {}", name,
                                        first_flat, first_flat + n, ShapeString(full_shape)));
  }
  FillMaster(seed, name, spec, full_shape, host_out, [&](auto&& fn) {
    for (int64_t e = 0; e < n; ++e) fn(e, first_flat + e);
  });
}

// A bad layout or output tensor here is a caller bug (layouts are validated when the config
// is planned), so it throws rather than returning a Status.
void FillShard(uint64_t seed, std::string_view name, const InitSpec& spec, const Shape& full_shape,
               const ShardSpec& shard, Tensor& host_out) {
  const std::string error = ShardSpecError(shard, full_shape);
  if (!error.empty()) throw std::invalid_argument(fmt::format("FillShard('{}'): {}", name, error));
  const Shape local = LocalShape(shard, full_shape);
  if (!host_out.defined() || host_out.device() != Device::kHost || host_out.shape() != local) {
    throw std::invalid_argument(
        fmt::format("FillShard('{}'): output must be a host tensor of shape {}, got {}{}", name,
                    ShapeString(local), ShapeString(host_out.shape()),
                    host_out.device() == Device::kHost ? "" : " on the device"));
  }
  FillMaster(seed, name, spec, full_shape, host_out, [&](auto&& fn) {
    ForEachElement(FlatOffsets(shard, full_shape, local), local, fn);
  });
}

int64_t TokenAt(uint64_t seed, std::string_view name, int64_t index, int64_t vocab_size) {
  if (vocab_size < 1 || index < 0) {
    throw std::invalid_argument(
        fmt::format("TokenAt('{}'): index {} and vocab_size {}", name, index, vocab_size));
  }
  const double u = UniformAt(seed, StreamId(name), static_cast<uint64_t>(index));
  // u < 1, but u * vocab_size can round up to vocab_size for a large vocabulary.
  const auto token = static_cast<int64_t>(u * static_cast<double>(vocab_size));
  return std::min(token, vocab_size - 1);
}

StatusOr<Tensor> AssembleFull(const std::vector<Tensor>& shards,
                              const std::vector<ShardSpec>& specs, const Shape& full_shape) {
  if (shards.size() != specs.size()) {
    return Status::Error("", fmt::format("{} shards but {} specs", shards.size(), specs.size()));
  }
  if (shards.empty()) return Status::Error("", "no shards to assemble");
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string where = fmt::format("shards[{}]", i);
    const std::string error = ShardSpecError(specs[i], full_shape);
    if (!error.empty()) return Status::Error(where, error);
    // Shards of one tensor share a layout; mixing them means specs from different tensors.
    if (!SameLayout(specs[i], specs[0])) {
      return Status::Error(where, fmt::format("layout ({}) differs from shards[0] ({})",
                                              LayoutString(specs[i]), LayoutString(specs[0])));
    }
    const Tensor& shard = shards[i];
    if (!shard.defined() || shard.device() != Device::kHost) {
      return Status::Error(where, "must be a defined host tensor");
    }
    if (shard.dtype() != shards[0].dtype()) {
      return Status::Error(
          where, fmt::format("dtype {} differs from shards[0] ({})", DTypeName(shard.dtype()),
                             DTypeName(shards[0].dtype())));
    }
    const Shape local = LocalShape(specs[i], full_shape);
    if (shard.shape() != local) {
      return Status::Error(
          where,
          fmt::format("shape {} must be {}, the local shape of {} under its spec",
                      ShapeString(shard.shape()), ShapeString(local), ShapeString(full_shape)));
    }
  }
  Tensor full = Tensor::HostZeros(full_shape, shards[0].dtype());
  Status status;
  DispatchStorage(full.dtype(), [&]<typename T>() { status = PlaceShards<T>(shards, specs, full); });
  if (!status.ok()) return status;
  return full;
}

}  // namespace mpusim
