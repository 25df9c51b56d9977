// Layout-invariant initialisation and synthetic data.
//
// Element (i, j) of every master tensor (weights, the synthetic input, the synthetic output
// gradient) is a pure function of (seed, tensor name, flat index in the full tensor). A rank
// generates only its own shard, mapping local to global indices with the ShardSpec (and so
// with Megatron's `stride` rule); tp=1 and tp=8 start from bit-identical master weights
// without any rank materialising the whole matrix.
//
// Stream of a tensor: StreamId(name) = FNV-1a 64-bit hash of the name.
// Normal values: Box-Muller on UniformAt(seed, stream, 2e) and UniformAt(seed, stream, 2e+1).
// xavier_normal for an [out, in] weight: std = sqrt(2 / (in + out)) (torch's gain 1).
// Values are computed in float64 and rounded to the tensor's dtype (RoundTo in core/half.h:
// once for float32, via float32 for bfloat16/float16).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/philox.h"
#include "core/sharding.h"
#include "core/status.h"
#include "core/tensor.h"

namespace mpusim {

// kOnes: normalization weights (Megatron's norms start at weight 1); not a
// choice in chain configs.
enum class InitMethod : uint8_t { kXavierNormal, kNormal, kZeros, kOnes };

struct InitSpec {
  InitMethod method = InitMethod::kXavierNormal;
  double std = 0.02;  // kNormal only
};

// "xavier_normal", "normal", "zeros" -> InitMethod; errors name `where`.
StatusOr<InitMethod> ParseInitMethod(std::string_view text, std::string_view where);
std::string_view InitMethodName(InitMethod method);

uint64_t StreamId(std::string_view name);

// Standard normal, element `index` of stream (key, stream).
double NormalAt(uint64_t key, uint64_t stream, uint64_t index);

// Element `flat_index` (row-major in `full_shape`) of the master tensor `name`.
double MasterValue(uint64_t seed, std::string_view name, const InitSpec& spec,
                   const Shape& full_shape, int64_t flat_index);

// Fills `host_out` (a host tensor with the local shape of `full_shape` under `shard`, float32
// or float64) with the master values of its elements.
void FillShard(uint64_t seed, std::string_view name, const InitSpec& spec,
               const Shape& full_shape, const ShardSpec& shard, Tensor& host_out);

// Fills the host tensor `host_out` (any shape, float32 or float64) with the master values of
// the consecutive flat indices first_flat, first_flat + 1, ... of `full_shape`: a block of
// rows of a row-major tensor (the float64 reference's slice of the batch).
void FillFlatRange(uint64_t seed, std::string_view name, const InitSpec& spec,
                   const Shape& full_shape, int64_t first_flat, Tensor& host_out);

// Synthetic token ids in [0, vocab_size): element `index` of stream `name`.
int64_t TokenAt(uint64_t seed, std::string_view name, int64_t index, int64_t vocab_size);

// Reassembles a full host tensor from host shards (each with its ShardSpec): Megatron's
// master_weight. Every element of the full tensor must be covered (checked).
StatusOr<Tensor> AssembleFull(const std::vector<Tensor>& shards,
                              const std::vector<ShardSpec>& specs, const Shape& full_shape);

}  // namespace mpusim
