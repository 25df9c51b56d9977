// Dump comparison (see diff.h): the reassembly of full tensors from a Dump's shards, and the
// element-wise comparison with its text and JSON renderings.
//
// What it is: host-only code on nlohmann/json and fmt, over dumps that LoadDump
// (dump_loader.cc) has already checked: layouts, shapes and coverage are trusted here; only
// whether copies agree is checked, by Assemble.
// What it is not: the dump reader; a dump that does not describe a consistent tensor never
// gets this far.
#include "core/dump/diff.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/dump/shard_key.h"
#include "core/init.h"
#include "core/sharding.h"

namespace mpusim {
namespace {

using Json = nlohmann::ordered_json;  // keeps key order in the JSON output

// "[i, j]" for a flat index into `shape`.
Shape MultiIndex(const Shape& shape, int64_t flat) {
  Shape index(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 0) continue;
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return index;
}

// A value as its side stored it: float32 and 16-bit values print as the shortest float
// that round-trips.
std::string FormatValue(double v, std::optional<DType> dtype) {
  if (dtype && *dtype != DType::kFloat64) return fmt::format("{}", static_cast<float>(v));
  return fmt::format("{}", v);
}

// Global multi-index of local flat index `local` of a shard.
Shape GlobalCoordinates(const ShardSpec& spec, const Shape& full, const Shape& local_shape,
                        int64_t local) {
  Shape index = MultiIndex(local_shape, local);
  for (size_t d = 0; d < index.size(); ++d) {
    index[d] = GlobalIndex(spec, static_cast<int>(d), full[d], index[d]);
  }
  return index;
}

// Copies must carry the same bits; the first difference names both ranks.
Status CheckCopies(const DumpTensor& t, const DumpShard& first, const DumpShard& copy) {
  if (std::memcmp(first.tensor.data(), copy.tensor.data(), first.tensor.bytes()) == 0) {
    return Status();
  }
  const size_t size = DTypeSize(t.dtype);
  const auto* x = static_cast<const unsigned char*>(first.tensor.data());
  const auto* y = static_cast<const unsigned char*>(copy.tensor.data());
  int64_t differing = 0;
  int64_t first_diff = -1;
  for (int64_t e = 0; e < first.tensor.numel(); ++e) {
    const size_t offset = static_cast<size_t>(e) * size;
    if (std::memcmp(x + offset, y + offset, size) != 0) {
      if (first_diff < 0) first_diff = e;
      ++differing;
    }
  }
  const std::string piece =
      t.partial_sum
          ? fmt::format("the tp_rank {} summand{}", first.tp_rank,
                        first.spec.replicated() ? std::string()
                                                : fmt::format(" ({})", PieceString(first.spec)))
          : (first.spec.replicated() ? PieceString(first.spec)
                                     : fmt::format("the piece {}", PieceString(first.spec)));
  return Status::Error(
      std::string(t.name),
      fmt::format("ranks {} and {} hold copies of {} that differ in {} of {} elements; first "
                  "at {}: {} vs {}",
                  first.rank, copy.rank, piece, differing, first.tensor.numel(),
                  ShapeString(GlobalCoordinates(first.spec, t.full_shape, first.tensor.shape(),
                                                first_diff)),
                  FormatValue(HostValue(first.tensor, first_diff), t.dtype),
                  FormatValue(HostValue(copy.tensor, first_diff), t.dtype)));
}

// ---------------------------------------------------------------------------------------
// Comparison.

std::string DTypeShort(const std::optional<DType>& d) {
  if (!d) return "-";
  switch (*d) {
    case DType::kFloat32: return "f32";
    case DType::kFloat64: return "f64";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "f16";
    case DType::kInt64: return "i64";  // not in a dump (ParseDTypeName refuses it)
  }
  return "?";
}

void CompareValues(const Tensor& a, const Tensor& b, TensorDiff& d) {
  const double* x = a.data_as<double>();
  const double* y = b.data_as<double>();
  double scale_b = 0;  // max |b| over finite b: the scale of ntol
  for (int64_t i = 0; i < b.numel(); ++i) {
    if (std::isfinite(y[i])) scale_b = std::fmax(scale_b, std::fabs(y[i]));
  }
  const Tolerance tol = d.tolerance.ForScale(scale_b);
  double max_a = 0, max_b = 0;
  double worst_excess = -std::numeric_limits<double>::infinity();
  d.elements = a.numel();
  for (int64_t i = 0; i < d.elements; ++i) {
    const double av = x[i];
    const double bv = y[i];
    d.nan_a += std::isnan(av) ? 1 : 0;
    d.inf_a += std::isinf(av) ? 1 : 0;
    d.nan_b += std::isnan(bv) ? 1 : 0;
    d.inf_b += std::isinf(bv) ? 1 : 0;
    double excess = std::numeric_limits<double>::infinity();
    if (std::isfinite(av) && std::isfinite(bv)) {
      const double diff = std::fabs(av - bv);
      const double allowed = tol.atol + tol.rtol * std::fabs(bv);
      d.max_abs = std::fmax(d.max_abs, diff);
      max_a = std::fmax(max_a, std::fabs(av));
      max_b = std::fmax(max_b, std::fabs(bv));
      if (std::fabs(bv) > tol.atol) d.max_rel = std::fmax(d.max_rel, diff / std::fabs(bv));
      if (diff > allowed) ++d.mismatches;
      excess = diff - allowed;
    } else {
      ++d.mismatches;
    }
    if (excess > worst_excess) {
      worst_excess = excess;
      d.worst_flat = i;
      d.worst_a = av;
      d.worst_b = bv;
    }
  }
  const double scale = std::fmax(max_a, max_b);
  d.normalized = scale > 0 ? d.max_abs / scale : 0.0;
  if (d.worst_flat >= 0) d.worst_index = MultiIndex(d.shape, d.worst_flat);
  if (d.mismatches > 0) {
    std::vector<std::string> notes;
    for (auto [count, what] : {std::pair{d.nan_a, "NaN in A"}, std::pair{d.inf_a, "Inf in A"},
                               std::pair{d.nan_b, "NaN in B"}, std::pair{d.inf_b, "Inf in B"}}) {
      if (count > 0) notes.push_back(fmt::format("{} {}", count, what));
    }
    d.problem = fmt::format("{} of {} elements out of tolerance{}{}; worst {}: {} vs {}",
                            d.mismatches, d.elements, notes.empty() ? "" : ", ",
                            fmt::join(notes, ", "), ShapeString(d.worst_index),
                            FormatValue(d.worst_a, d.dtype_a), FormatValue(d.worst_b, d.dtype_b));
  }
}

// The dimension along which two tensors differ only by vocabulary padding: the same rank,
// exactly one dimension different, both dumps of a model with the same vocab_size V and both
// sizes >= V there (Megatron pads the vocabulary to a multiple of
// make_vocab_size_divisible_by * t, so two layouts may pad it differently).
std::optional<int> PaddedVocabDim(const DumpTensor& a, const DumpTensor& b,
                                  const std::optional<int64_t>& vocab_a,
                                  const std::optional<int64_t>& vocab_b) {
  if (!vocab_a || vocab_a != vocab_b || a.full_shape.size() != b.full_shape.size()) {
    return std::nullopt;
  }
  std::optional<int> dim;
  for (size_t k = 0; k < a.full_shape.size(); ++k) {
    if (a.full_shape[k] == b.full_shape[k]) continue;
    if (dim || a.full_shape[k] < *vocab_a || b.full_shape[k] < *vocab_a) return std::nullopt;
    dim = static_cast<int>(k);
  }
  return dim;
}

// The first `keep` entries along dim k of a float64 tensor of `shape`.
Tensor LeadingAlong(const Tensor& full, const Shape& shape, size_t k, int64_t keep) {
  Shape out_shape = shape;
  out_shape[k] = keep;
  int64_t outer = 1, inner = 1;
  for (size_t i = 0; i < k; ++i) outer *= shape[i];
  for (size_t i = k + 1; i < shape.size(); ++i) inner *= shape[i];
  Tensor out = Tensor::HostEmpty(out_shape, DType::kFloat64);
  const double* in = full.data_as<double>();
  double* o = out.data_as<double>();
  for (int64_t p = 0; p < outer; ++p) {
    std::copy(in + p * shape[k] * inner, in + (p * shape[k] + keep) * inner, o + p * keep * inner);
  }
  return out;
}

// The world ranks whose shard of `t` holds the element at multi-index `index` of the full
// tensor (every rank of a dimension's copies; a partial sum's summands all hold it).
std::vector<int64_t> HoldersOf(const DumpTensor& t, const Shape& index) {
  std::vector<int64_t> ranks;
  for (const DumpShard& shard : t.shards) {
    bool holds = true;
    for (size_t d = 0; holds && d < index.size(); ++d) {
      const int dim = static_cast<int>(d);
      bool split = false;
      for (const Placement& p : shard.spec.placements) split = split || p.dim == dim;
      if (!split) continue;
      const int64_t local = LocalShape(shard.spec, t.full_shape)[d];
      holds = false;
      for (int64_t l = 0; l < local && !holds; ++l) {
        holds = GlobalIndex(shard.spec, dim, t.full_shape[d], l) == index[d];
      }
    }
    if (holds) ranks.push_back(shard.rank);
  }
  return ranks;
}

TensorDiff DiffTensor(const Dump& a, const Dump& b, const std::string& name,
                      const DiffOptions& options) {
  TensorDiff d;
  d.name = name;
  const DumpTensor* ta = a.Find(name);
  const DumpTensor* tb = b.Find(name);
  if (ta != nullptr) d.dtype_a = ta->dtype;
  if (tb != nullptr) d.dtype_b = tb->dtype;
  d.shape = ta != nullptr ? ta->full_shape : tb->full_shape;
  d.precision = LessPrecise(a.Precision(ta != nullptr ? ta->dtype : DType::kFloat64),
                            b.Precision(tb != nullptr ? tb->dtype : DType::kFloat64));
  d.tolerance = DiffTolerance(d.precision, d.precision, options);
  if (ta != nullptr && tb != nullptr && ta->budget && tb->budget && !options.atol &&
      !options.ntol && !options.rtol) {
    // Each side is within its budget of the exact value, so the two are within the sum.
    d.tolerance = {ta->budget->atol + tb->budget->atol, ta->budget->rtol + tb->budget->rtol, 0};
    d.budgeted = true;
  }
  if (ta == nullptr || tb == nullptr) {
    d.problem = ta == nullptr ? "only in B" : "only in A";
    return d;
  }
  const std::optional<int> vocab_dim = PaddedVocabDim(*ta, *tb, a.vocab_size(), b.vocab_size());
  if (ta->full_shape != tb->full_shape && !vocab_dim) {
    d.problem = fmt::format("shape {} in A but {} in B", ShapeString(ta->full_shape),
                            ShapeString(tb->full_shape));
    return d;
  }
  StatusOr<Tensor> full_a = a.Assemble(name);
  StatusOr<Tensor> full_b = b.Assemble(name);
  if (vocab_dim && full_a.ok() && full_b.ok()) {
    const size_t k = static_cast<size_t>(*vocab_dim);
    const int64_t vocab = *a.vocab_size();
    d.note = fmt::format("compared the {} real vocabulary entries of dim {} (padded to {} in A, "
                         "{} in B)",
                         vocab, k, ta->full_shape[k], tb->full_shape[k]);
    full_a = LeadingAlong(*full_a, ta->full_shape, k, vocab);
    full_b = LeadingAlong(*full_b, tb->full_shape, k, vocab);
    d.shape[k] = vocab;
  }
  if (!full_a.ok() || !full_b.ok()) {
    std::vector<std::string> problems;
    if (!full_a.ok()) problems.push_back("A: " + full_a.status().what());
    if (!full_b.ok()) problems.push_back("B: " + full_b.status().what());
    d.problem = fmt::format("{}", fmt::join(problems, "; "));
    return d;
  }
  d.compared = true;
  CompareValues(*full_a, *full_b, d);
  d.pass = d.problem.empty();
  if (!d.pass && d.worst_flat >= 0) {
    d.worst_ranks_a = HoldersOf(*ta, d.worst_index);
    d.worst_ranks_b = HoldersOf(*tb, d.worst_index);
  }
  return d;
}

Status CheckOverride(const std::optional<double>& value, const char* name) {
  if (value && !(std::isfinite(*value) && *value >= 0)) {
    return Status::Error(name, fmt::format("must be a finite number >= 0, got {}", *value));
  }
  return Status();
}

Json Number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

Json ToleranceJson(const Tolerance& t) {
  return Json{{"atol", t.atol}, {"ntol", t.ntol}, {"rtol", t.rtol}};
}

std::string ToleranceText(const Tolerance& t) {
  if (t.ntol > 0) return fmt::format("atol {:g} ntol {:g} rtol {:g}", t.atol, t.ntol, t.rtol);
  return fmt::format("atol {:g} rtol {:g}", t.atol, t.rtol);
}

// A config value for a one-line report: control characters escaped, at most `width`
// characters.
std::string Fit(std::string text, size_t width) {
  text = EscapeControl(text);
  if (text.size() <= width) return text;
  return width < 4 ? text.substr(0, width) : text.substr(0, width - 3) + "...";
}

std::string ShortValue(const ConfigDifference& d, bool a_side) {
  return Fit(a_side ? ConfigValueText(d.a, d.in_a) : ConfigValueText(d.b, d.in_b), 24);
}

// The text report's config lines, after the A and B lines: what the runs differ in, before
// any tensor is compared. Each line fits in 100 columns.
std::string ConfigText(const DiffResult& r) {
  if (!r.a.has_config || !r.b.has_config) {
    return fmt::format("config: not compared: {} manifest records none\n",
                       !r.a.has_config && !r.b.has_config ? "neither"
                       : !r.a.has_config                  ? "A's"
                                                          : "B's");
  }
  std::string out;
  for (const auto& [label, side] : {std::pair{"A", &r.a}, std::pair{"B", &r.b}}) {
    if (!side->command_line) {
      out += fmt::format("config: {}'s dump predates recorded command lines: its config may miss "
                         "their overrides\n",
                         label);
    }
  }
  if (r.config.empty()) return out + "config: the same in both runs\n";
  constexpr size_t kShown = 12;
  std::vector<std::string> expected;  // the classes after which tensors differ, in order
  for (size_t i = 0; i < r.config.size(); ++i) {
    const ConfigDifference& d = r.config[i];
    const std::string change = ConfigChangeName(d.change);
    if (ExpectsDifferences(d.change) &&
        std::find(expected.begin(), expected.end(), change) == expected.end()) {
      expected.push_back(change);
    }
    if (i >= kShown) continue;
    // The key first (Megatron's longest is 45 characters), then the values share the rest.
    const std::string key = Fit(d.key, 48);
    // 100 columns less "config: ", ": ", " vs ", " (", ")" and the key and class.
    const size_t room = 100 - 17 - key.size() - change.size();
    std::string va = EscapeControl(ConfigValueText(d.a, d.in_a));
    std::string vb = EscapeControl(ConfigValueText(d.b, d.in_b));
    const size_t half = room / 2;
    va = Fit(va, std::max(half, room - std::min(vb.size(), room - half)));
    vb = Fit(vb, room - va.size());
    out += fmt::format("config: {}: {} vs {} ({})\n", key, va, vb, change);
  }
  if (r.config.size() > kShown) {
    out += fmt::format("config: and {} more differences (--format json lists every one)\n",
                       r.config.size() - kShown);
  }
  if (!expected.empty()) {
    out += fmt::format("the runs differ in {}, expect differences\n", fmt::join(expected, ", "));
  }
  return out;
}

constexpr DType kAllDTypes[] = {DType::kFloat64, DType::kFloat32, DType::kFloat16,
                                DType::kBFloat16};

}  // namespace

// ---------------------------------------------------------------------------------------
// Dump

const DumpTensor* Dump::Find(std::string_view name) const {
  for (const DumpTensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

StatusOr<Tensor> Dump::Assemble(std::string_view name) const {
  const DumpTensor* t = Find(name);
  if (t == nullptr) return Status::Error(std::string(name), "is not in the dump");
  // One representative per key; every other copy must equal it.
  std::map<ShardKey, const DumpShard*> pieces;
  for (const DumpShard& s : t->shards) {
    auto [it, inserted] = pieces.emplace(KeyOf(*t, s), &s);
    if (!inserted) MPUSIM_RETURN_IF_ERROR(CheckCopies(*t, *it->second, s));
  }
  // Nothing to place (and AssembleFull would size index tables by the local dimensions,
  // which a zero-size dimension elsewhere leaves unbounded).
  if (NumElements(t->full_shape) == 0) return Tensor::HostZeros(t->full_shape, DType::kFloat64);
  // Keys sort by tp_rank first for a partial sum: one AssembleFull per tp_rank for a
  // partial sum, whose results are added in tp_rank order.
  Tensor full;
  auto it = pieces.begin();
  while (it != pieces.end()) {
    std::vector<Tensor> shards;
    std::vector<ShardSpec> specs;
    const int64_t first = t->partial_sum ? it->first.front() : 0;
    for (; it != pieces.end() && (!t->partial_sum || it->first.front() == first); ++it) {
      shards.push_back(it->second->tensor);
      specs.push_back(it->second->spec);
    }
    StatusOr<Tensor> placed = AssembleFull(shards, specs, t->full_shape);
    // LoadDump checked layouts and coverage, so this is a reader bug if it ever happens.
    if (!placed.ok()) return Status::Error(std::string(name), placed.status().Message());
    Tensor wide = placed->dtype() == DType::kFloat64 ? *placed : HostToFloat64(*placed);
    if (!full.defined()) {
      full = std::move(wide);
      continue;
    }
    double* out = full.data_as<double>();
    const double* in = wide.data_as<double>();
    for (int64_t i = 0; i < full.numel(); ++i) out[i] += in[i];
  }
  return full;
}

// ---------------------------------------------------------------------------------------
// DiffDumps and its renderings

DType Dump::Precision(DType tensor_dtype) const {
  return storage_ ? LessPrecise(tensor_dtype, *storage_) : tensor_dtype;
}

Tolerance DiffTolerance(DType a, DType b, const DiffOptions& options) {
  Tolerance tol = DefaultTolerance(LessPrecise(a, b));
  if (options.atol) tol.atol = *options.atol;
  if (options.ntol) tol.ntol = *options.ntol;
  if (options.rtol) tol.rtol = *options.rtol;
  return tol;
}

StatusOr<DiffResult> DiffDumps(const Dump& a, const Dump& b, const DiffOptions& options) {
  MPUSIM_RETURN_IF_ERROR(CheckOverride(options.atol, "atol"));
  MPUSIM_RETURN_IF_ERROR(CheckOverride(options.ntol, "ntol"));
  MPUSIM_RETURN_IF_ERROR(CheckOverride(options.rtol, "rtol"));
  std::vector<std::string> available;
  for (const DumpTensor& t : a.tensors()) available.push_back(t.name);
  for (const DumpTensor& t : b.tensors()) {
    if (a.Find(t.name) == nullptr) available.push_back(t.name);
  }
  std::vector<std::string> names;
  if (options.tensors.empty()) {
    names = available;
  } else {
    for (const std::string& name : options.tensors) {
      if (a.Find(name) == nullptr && b.Find(name) == nullptr) {
        return Status::Error("tensors", fmt::format("'{}' is in neither dump; available: {}", name,
                                                    fmt::join(available, ", ")));
      }
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
  }
  DiffResult result;
  // The configs first: tensors of different models are refused, not compared.
  if (a.config() && b.config()) {
    result.config = CompareConfigs(*a.config(), *b.config());
    const auto model = std::find_if(result.config.begin(), result.config.end(),
                                    [](const ConfigDifference& d) {
                                      return d.change == ConfigChange::kModel;
                                    });
    if (model != result.config.end()) {
      const auto more =
          std::count_if(model + 1, result.config.end(),
                        [](const ConfigDifference& d) { return d.change == ConfigChange::kModel; });
      return Status::Error(
          "config", fmt::format("{}: {} vs {}: the dumps hold different models (their tensors "
                                "differ in name or shape{}); diff compares runs of one model",
                                model->key, ShortValue(*model, true), ShortValue(*model, false),
                                more > 0 ? fmt::format("; {} more model key{} differ{}", more,
                                                       more == 1 ? "" : "s",
                                                       more == 1 ? "s" : "")
                                         : ""));
    }
  }
  auto summary = [](const Dump& dump) {
    return DumpSummary{dump.dir(),        dump.backend(),   dump.config().has_value(),
                       dump.command_line(), dump.world_size(), dump.tp_size(),
                       static_cast<int64_t>(dump.tensors().size())};
  };
  result.a = summary(a);
  result.b = summary(b);
  for (DType d : kAllDTypes) result.policy.emplace_back(d, DiffTolerance(d, d, options));
  for (const std::string& name : names) {
    result.tensors.push_back(DiffTensor(a, b, name, options));
    ++(result.tensors.back().pass ? result.passed : result.failed);
  }
  return result;
}

std::string DiffText(const DiffResult& r) {
  auto side = [](const char* label, const DumpSummary& d) {
    return fmt::format("{}: {} ({}{} rank{}, tp {}, {} tensors)\n", label, d.dir,
                       d.backend.empty() ? "" : d.backend + ", ", d.world_size,
                       d.world_size == 1 ? "" : "s", d.tp_size, d.tensors);
  };
  std::string out = side("A", r.a) + side("B (expected)", r.b) + ConfigText(r);
  std::vector<std::string> policies;
  for (const auto& [dtype, tol] : r.policy) {
    policies.push_back(fmt::format("{} {}", DTypeName(dtype), ToleranceText(tol)));
  }
  out += fmt::format(
      "pass when |a - b| <= atol + ntol * max|b| + rtol * |b| and both are finite; the least "
      "precise dtype of the tensor on either side and of the runs' storage picks the "
      "tolerance: {}\n",
      fmt::join(policies, ", "));
  const auto budgeted = std::count_if(r.tensors.begin(), r.tensors.end(),
                                      [](const TensorDiff& d) { return d.budgeted; });
  if (budgeted > 0) {
    out += fmt::format(
        "{} of {} tensors carry error budgets in both dumps (their runs' checks against the "
        "float64 reference): those are allowed the sum of the two budgets instead\n",
        budgeted, r.tensors.size());
  }
  size_t width = 26;
  for (const TensorDiff& d : r.tensors) width = std::max(width, d.name.size());
  out += fmt::format("  {:<{}} {:<16} {:<7} {:>12} {:>12} {:>12}  {}\n", "tensor", width, "shape",
                     "dtypes", "max abs err", "max rel err", "normalized", "result");
  for (const TensorDiff& d : r.tensors) {
    const std::string dtypes = DTypeShort(d.dtype_a) + "/" + DTypeShort(d.dtype_b);
    std::string verdict = d.pass ? "pass" : "FAIL (" + d.problem + ")";
    if (!d.note.empty()) verdict = fmt::format("{} ({})", verdict, d.note);
    if (d.compared) {
      out += fmt::format("  {:<{}} {:<16} {:<7} {:>12.3g} {:>12.3g} {:>12.3g}  {}\n", d.name, width,
                         ShapeString(d.shape), dtypes, d.max_abs, d.max_rel, d.normalized, verdict);
    } else {
      out += fmt::format("  {:<{}} {:<16} {:<7} {:>12} {:>12} {:>12}  {}\n", d.name, width,
                         ShapeString(d.shape), dtypes, "-", "-", "-", verdict);
    }
  }
  out += fmt::format("{} passed, {} failed\n", r.passed, r.failed);
  // Shapes that differ are not rounding: the two runs computed other tensors.
  const auto reshaped = std::count_if(r.tensors.begin(), r.tensors.end(), [](const TensorDiff& d) {
    return d.problem.starts_with("shape ");
  });
  if (reshaped > 0) {
    out += fmt::format(
        "{} tensor{} in shape, so the two runs did not compute the same tensors: "
        "activations are [seq_length, samples per micro-batch (micro_batch_size x data-parallel "
        "size), width] and parameters follow the model; diff runs of one model with the same "
        "seq_length and samples per micro-batch (dp 2 with micro_batch_size 1 against dp 1 "
        "with micro_batch_size 2)\n",
        reshaped, reshaped == 1 ? " differs" : "s differ");
  }
  // Where to start looking: A's manifest lists a run's tensors in the order it produced them.
  for (const TensorDiff& d : r.tensors) {
    if (d.pass) continue;
    out += fmt::format("first to differ, in the order A's run produced its tensors: {}", d.name);
    if (d.compared && d.worst_flat >= 0) {
      out += fmt::format(", worst element {} on rank{} {} of A (rank{} {} of B)",
                         ShapeString(d.worst_index), d.worst_ranks_a.size() == 1 ? "" : "s",
                         fmt::join(d.worst_ranks_a, ", "), d.worst_ranks_b.size() == 1 ? "" : "s",
                         fmt::join(d.worst_ranks_b, ", "));
    } else {
      out += fmt::format(": {}", d.problem);
    }
    out += '\n';
    break;
  }
  return out;
}

std::string DiffJson(const DiffResult& r) {
  Json j;
  j["schema_version"] = 1;
  j["a"] = r.a.dir;
  j["b"] = r.b.dir;
  Json differences = Json::array();
  for (const ConfigDifference& d : r.config) {
    differences.push_back({{"key", d.key},
                           {"a", d.a},
                           {"b", d.b},
                           {"in_a", d.in_a},
                           {"in_b", d.in_b},
                           {"change", ConfigChangeName(d.change)}});
  }
  const auto command_line = [](const DumpSummary& s) {
    return s.command_line ? Json(*s.command_line) : Json();
  };
  j["config"] = {{"compared", r.a.has_config && r.b.has_config},
                 {"command_line_a", command_line(r.a)},
                 {"command_line_b", command_line(r.b)},
                 {"differences", std::move(differences)}};
  j["tolerance"] = {{"rule", "|a - b| <= atol + ntol * max|b| + rtol * |b|, both finite"}};
  for (const auto& [dtype, tol] : r.policy) {
    j["tolerance"][std::string(DTypeName(dtype))] = ToleranceJson(tol);
  }
  Json tensors = Json::array();
  for (const TensorDiff& d : r.tensors) {
    Json t;
    const Json null;
    auto dtype = [](const std::optional<DType>& x) {
      return x ? Json(std::string(DTypeName(*x))) : Json();
    };
    t["name"] = d.name;
    t["shape"] = d.shape;
    t["dtype_a"] = dtype(d.dtype_a);
    t["dtype_b"] = dtype(d.dtype_b);
    t["precision"] = std::string(DTypeName(d.precision));
    t["budgeted"] = d.budgeted;
    t["atol"] = d.tolerance.atol;
    t["ntol"] = d.tolerance.ntol;
    t["rtol"] = d.tolerance.rtol;
    t["elements"] = d.compared ? Json(d.elements) : null;
    t["mismatches"] = d.compared ? Json(d.mismatches) : null;
    t["max_abs"] = d.compared ? Number(d.max_abs) : null;
    t["max_rel"] = d.compared ? Number(d.max_rel) : null;
    t["normalized"] = d.compared ? Number(d.normalized) : null;
    if (d.compared && d.worst_flat >= 0) {
      t["worst"] = {{"index", d.worst_index},     {"flat_index", d.worst_flat},
                    {"a", Number(d.worst_a)},     {"b", Number(d.worst_b)},
                    {"ranks_a", d.worst_ranks_a}, {"ranks_b", d.worst_ranks_b}};
    } else {
      t["worst"] = null;
    }
    t["nan_a"] = d.compared ? Json(d.nan_a) : null;
    t["inf_a"] = d.compared ? Json(d.inf_a) : null;
    t["nan_b"] = d.compared ? Json(d.nan_b) : null;
    t["inf_b"] = d.compared ? Json(d.inf_b) : null;
    t["pass"] = d.pass;
    t["problem"] = d.pass ? null : Json(d.problem);
    t["note"] = d.note.empty() ? null : Json(d.note);
    tensors.push_back(std::move(t));
  }
  j["tensors"] = std::move(tensors);
  j["passed"] = r.passed;
  j["failed"] = r.failed;
  // Directory names come from the command line and need not be UTF-8.
  return j.dump(1, ' ', false, Json::error_handler_t::replace) + "\n";
}

}  // namespace mpusim