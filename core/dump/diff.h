// Dump comparison: `mpusim diff A B` reads two `--dump` directories, rebuilds every full
// tensor from its rank shards, and compares the two sides element by element.
//
// What it is: a strict dump reader (manifest + every rank file, validated before any value is
// trusted), the reassembly of full tensors from shards by their sharding metadata, and the
// comparison under a per-dtype tolerance. A and B may come from different layouts (t=4 vs
// t=1, with or without data parallelism) and different dtypes (float64, float32, bfloat16,
// float16): both are reduced to full float64 tensors first.
// What it is not: the check of `mpusim run` against its float64 reference (run/runner.cc),
// or a reader for other people's safetensors (that is core/dump/safetensors.h).
//
// Reassembly of tensor T (see core/sharding.h for ShardSpec):
//   - Shards with the same coordinates are copies (a weight's tp shard on every dp rank, a
//     replicated tensor on every rank). Copies must agree bit for bit; otherwise Assemble
//     fails and names the two ranks and the first element that differs.
//     Coordinates: the index of each placement; for a partial sum, the tp_rank first.
//   - "partial_sum": true shards hold summands: the full tensor is the sum over the dump's tp
//     ranks, added in tp_rank order in float64.
//   - Every element must be covered: every combination of placement indices is present (for
//     a partial sum, with every tp rank of the dump).
//
// Comparison of tensor T, B being the expected side, over full float64 values a_i and b_i:
//   element passes     iff a_i and b_i are finite and
//                      |a_i - b_i| <= atol + ntol * max_j |b_j| + rtol * |b_i|
//   max_abs            = max |a_i - b_i|                      (finite pairs)
//   max_rel            = max |a_i - b_i| / |b_i|, over |b_i| > atol (finite pairs)
//   normalized         = max_abs / max(max |a_i|, max |b_i|)  (finite pairs; 0 when all zero)
//                        in [0, 2]: ~1e-7 is float32 rounding, ~1 is unrelated data
//   worst element      = the largest excess over the allowance; the first NaN or Inf when
//                        there is one
//   precision          = the least precise of: T's dtype in A and in B, and each dump's run
//                        storage dtype (manifest "dtype"; a bfloat16 run's float32 main_grad
//                        carries bfloat16-sized errors)
//   (atol, ntol, rtol) = when both dumps record T's error budget (a checked run's manifest
//                        "budget": every element within atol + rtol * |exact| of the exact
//                        value, the check's allowance): the sums of both sides' atol and
//                        rtol, ntol 0. Otherwise DefaultTolerance(precision) (core/dump/compare.h:
//                        float64 1e-12, 0, 1e-9; float32 1e-5, 0, 1e-4; float16 0, 2^-8,
//                        2^-8; bfloat16 0, 2^-5, 2^-5). --atol, --ntol or --rtol replace
//                        both: the per-dtype policy with those values overridden.
// A tensor fails when an element fails, when the shapes differ, when it is in one side only,
// or when a side's copies disagree. One difference of shapes is allowed: two layouts of one
// model may pad the vocabulary differently (Megatron pads vocab_size to a multiple of
// make_vocab_size_divisible_by * t), so when both manifests' configs have the same
// model.vocab_size V and the shapes differ in one dimension only, both at least V there, the
// first V entries of that dimension (the real vocabulary) are compared and the report says so.
// The padded logits take part in the softmax, so such layouts' losses and gradients differ
// slightly anyway; equal padding (a make_vocab_size_divisible_by that covers both t) makes
// them comparable to rounding.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dump/compare.h"
#include "core/dump/config_diff.h"
#include "core/sharding.h"
#include "core/status.h"
#include "core/tensor.h"

namespace mpusim {

// The dump format (manifest "schema_version") that `mpusim run --dump` writes and LoadDump
// reads. 2: shard metadata is a list of placements (core/sharding.h); 1 was one model split
// plus one batch split.
inline constexpr int64_t kDumpSchemaVersion = 2;

// One rank file's piece of a tensor.
struct DumpShard {
  int64_t rank = 0;     // world rank: the file's position in the manifest's "files"
  int64_t tp_rank = 0;  // from the file's "mpusim" metadata (orders partial-sum summands)
  ShardSpec spec;
  Tensor tensor;  // host, local shape LocalShape(spec, full_shape)
};

struct DumpTensor {
  std::string name;
  Shape full_shape;
  DType dtype = DType::kFloat32;
  bool partial_sum = false;
  std::vector<DumpShard> shards;  // in rank order; all with the same layout
  // The run's check allowed every element |value - exact| <= atol + rtol * |exact| (manifest
  // "budget"; absent when the run was not checked).
  std::optional<Tolerance> budget;
};

class Dump {
 public:
  const std::string& dir() const { return dir_; }
  const std::string& backend() const { return backend_; }  // manifest "backend", or ""
  // The run's storage dtype (manifest "dtype"), when the manifest says.
  const std::optional<DType>& storage() const { return storage_; }
  // The dtype whose rounding a tensor stored as `tensor_dtype` in this dump carries: the less
  // precise of it and the run's storage dtype.
  DType Precision(DType tensor_dtype) const;
  int64_t world_size() const { return world_size_; }
  int64_t tp_size() const { return tp_size_; }  // distinct tp_rank values of the rank files
  // The model's vocab_size (manifest "config"), when the dump's config has one.
  const std::optional<int64_t>& vocab_size() const { return vocab_size_; }
  // The run's effective config (manifest "config", flattened), when the manifest has one.
  const std::optional<FlatConfig>& config() const { return config_; }
  // The command line that made the dump (manifest "command_line"), when the manifest says.
  // A manifest without one predates it, and its "config" is the config file as read,
  // without the command line's overrides.
  const std::optional<std::string>& command_line() const { return command_line_; }
  const std::vector<DumpTensor>& tensors() const { return tensors_; }  // manifest order
  const DumpTensor* Find(std::string_view name) const;

  // The full tensor `name` as float64 (see the reassembly rules above). Errors (where = the
  // name): an unknown name, copies that disagree.
  StatusOr<Tensor> Assemble(std::string_view name) const;

 private:
  friend StatusOr<Dump> LoadDump(const std::string& dir);
  std::string dir_;
  std::string backend_;
  std::optional<DType> storage_;
  int64_t world_size_ = 0;
  int64_t tp_size_ = 0;
  std::optional<int64_t> vocab_size_;
  std::optional<FlatConfig> config_;
  std::optional<std::string> command_line_;
  std::vector<DumpTensor> tensors_;
};

// Reads DIR/manifest.json and every rank file it lists, and checks that they describe
// consistent tensors: manifest fields and types, each file readable (ReadSafetensors), its
// "mpusim" rank metadata, each tensor's sharding metadata (keys, ranges, divisibility, full
// shape and dtype as in the manifest, local shape as the spec implies), one layout per
// tensor, every element covered. Errors: where = the file at fault, what = the part and the
// problem. Copies that disagree are found later, by Assemble.
StatusOr<Dump> LoadDump(const std::string& dir);

struct DiffOptions {
  std::optional<double> atol;  // override the per-dtype policy
  std::optional<double> ntol;
  std::optional<double> rtol;
  std::vector<std::string> tensors;  // compare only these; empty: all of A and B
};

// The tolerance for a tensor stored as `a` in A and `b` in B.
Tolerance DiffTolerance(DType a, DType b, const DiffOptions& options);

struct TensorDiff {
  std::string name;
  Shape shape;                   // A's full shape (B's when the tensor is only in B)
  std::optional<DType> dtype_a;  // nullopt: not in A
  std::optional<DType> dtype_b;
  DType precision = DType::kFloat64;  // picks the tolerance (see above)
  Tolerance tolerance{0, 0};
  bool budgeted = false;  // tolerance is the sum of both dumps' error budgets
  bool compared = false;  // values were compared (statistics below are meaningful)
  int64_t elements = 0;
  int64_t mismatches = 0;  // failing elements, NaN and Inf included
  int64_t nan_a = 0, inf_a = 0, nan_b = 0, inf_b = 0;
  double max_abs = 0, max_rel = 0, normalized = 0;
  int64_t worst_flat = -1;  // -1: no element (not compared, or empty)
  Shape worst_index;        // multi-index of worst_flat in `shape`
  double worst_a = 0, worst_b = 0;
  // The world ranks whose files hold the worst element, in A and in B (a failing tensor).
  std::vector<int64_t> worst_ranks_a, worst_ranks_b;
  bool pass = false;
  std::string problem;  // "" exactly when pass
  // Set when the two layouts pad the vocabulary differently: only the real vocabulary
  // entries were compared (`shape` is then the unpadded shape).
  std::string note;
};

// What the text report says about each side before the table.
struct DumpSummary {
  std::string dir;
  std::string backend;  // "" when the manifest does not say
  bool has_config = false;                  // the manifest records a config
  std::optional<std::string> command_line;  // the run's, when the manifest says
  int64_t world_size = 0;
  int64_t tp_size = 0;
  int64_t tensors = 0;
};

struct DiffResult {
  DumpSummary a, b;
  // Where both dumps record a config: how they differ (config_diff.h), in key order. Never a
  // model difference: DiffDumps refuses those.
  std::vector<ConfigDifference> config;
  // The effective policy per precision, most precise first.
  std::vector<std::pair<DType, Tolerance>> policy;
  std::vector<TensorDiff> tensors;         // A's manifest order, then tensors only in B
  int64_t passed = 0;
  int64_t failed = 0;
};

// Compares the two configs first (config_diff.h). Errors (the dumps themselves are already
// valid): where "config" when the configs differ in the model (the message names the first
// such key and both values: the tensors of different models are not compared); "tensors"
// for a requested name in neither dump (the message lists the available names);
// "atol"/"rtol" for a negative or non-finite override.
StatusOr<DiffResult> DiffDumps(const Dump& a, const Dump& b, const DiffOptions& options);

// Renderings for `mpusim diff --format text|json`.
std::string DiffText(const DiffResult& result);
// {"schema_version": 1, "a", "b",
//  "config": {"compared": both dumps record a config, "command_line_a", "command_line_b"
//   (null when a manifest does not say), "differences": [{"key", "a", "b", "in_a", "in_b",
//   "change"}]},
//  "tolerance": {"rule", "float64": {"atol", "ntol", "rtol"},
//  "float32": ..., "float16": ..., "bfloat16": ...},
//  "tensors": [...], "passed", "failed"}; non-finite values are the strings "nan", "inf",
// "-inf" (JSON has no such numbers); statistics are null for a tensor not compared.
std::string DiffJson(const DiffResult& result);

}  // namespace mpusim
