// The stored reference (see stored_reference.h).
#include "run/stored_reference.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <system_error>
#include <vector>

#include "core/config/field_table.h"
#include "core/dump/safetensors.h"
#include "mpi/agree.h"
#include "mpi/watchdog.h"

namespace mpusim::run {
namespace {

namespace fs = std::filesystem;
using Layout = ReferenceTensor::Layout;
using nlohmann::json;

constexpr const char* kFormat = "mpusim-reference";
constexpr int kVersion = 1;

const char* LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kWhole:
      return "whole";
    case Layout::kRows:
      return "rows";
    case Layout::kSamples:
      return "samples";
  }
  return "whole";
}

std::string IterationFile(int64_t k) { return fmt::format("iteration{}.safetensors", k); }
std::string SliceFile(int64_t j) { return fmt::format("slice{:05}.safetensors", j); }

// The first place where `a` (stored) and `b` (this run) differ: "model.hidden_size: 64 in the
// stored reference, 32 here".
std::string FirstDifference(const json& a, const json& b, const std::string& path) {
  if (a.is_object() && b.is_object()) {
    std::set<std::string> keys;
    for (const auto& [k, v] : a.items()) keys.insert(k);
    for (const auto& [k, v] : b.items()) keys.insert(k);
    for (const std::string& k : keys) {
      const std::string at = path.empty() ? k : path + "." + k;
      if (!a.contains(k))
        return fmt::format("{}: not in the stored reference, {} here", at, b[k].dump());
      if (!b.contains(k))
        return fmt::format("{}: {} in the stored reference, not here", at, a[k].dump());
      std::string d = FirstDifference(a[k], b[k], at);
      if (!d.empty()) return d;
    }
    return "";
  }
  if (a == b) return "";
  return fmt::format("{}: {} in the stored reference, {} here", path.empty() ? "identity" : path,
                     a.dump(), b.dump());
}

StatusOr<std::map<std::string, Tensor>> ReadTensors(const std::string& path) {
  StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  if (!file.ok()) return Status::Error(path, file.status().Message());
  std::map<std::string, Tensor> out;
  for (NamedTensor& t : file->tensors) {
    if (t.tensor.dtype() != DType::kFloat64) {
      return Status::Error(path, fmt::format("tensor '{}' is not float64", t.name));
    }
    out.emplace(t.name, std::move(t.tensor));
  }
  return out;
}

// `name` from `tensors` with `shape`, or a Status naming the file.
StatusOr<Tensor> Take(const std::map<std::string, Tensor>& tensors, const std::string& name,
                      const Shape& shape, const std::string& file) {
  const auto it = tensors.find(name);
  if (it == tensors.end()) return Status::Error(file, fmt::format("has no tensor '{}'", name));
  if (it->second.shape() != shape) {
    return Status::Error(file, fmt::format("tensor '{}' is {}, not {}", name,
                                           ShapeString(it->second.shape()), ShapeString(shape)));
  }
  return it->second;
}

// Copies the units [from, to) that `stored` (the units [stored_begin, ...) of a sliced tensor)
// and `value` (the units [begin, ...)) share, for a tensor of `full_shape` sliced on `dim`
// (rows: the [units, width] view, dim 0).
void CopyUnits(const Tensor& stored, int64_t stored_begin, Tensor& value, int64_t begin,
               int64_t from, int64_t to, const Shape& shape, int dim) {
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= shape[static_cast<size_t>(d)];
  for (size_t d = static_cast<size_t>(dim) + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t stored_units = stored.numel() / std::max<int64_t>(outer * inner, 1);
  const int64_t value_units = value.numel() / std::max<int64_t>(outer * inner, 1);
  const double* src = stored.data_as<double>();
  double* dst = value.data_as<double>();
  for (int64_t o = 0; o < outer; ++o) {
    std::memcpy(dst + (o * value_units + (from - begin)) * inner,
                src + (o * stored_units + (from - stored_begin)) * inner,
                static_cast<size_t>((to - from) * inner) * sizeof(double));
  }
}

}  // namespace

StatusOr<json> ReferenceIdentity(const json& effective_config, const Config& config) {
  StatusOr<std::unique_ptr<Reference>> reference = BuildReference(config);
  if (!reference.ok()) return reference.status();
  const RunConfig& run = *config.run;
  // The optimizer's keys that only lay out or schedule the same update (the distributed
  // optimizer, overlaps, buckets) do not change a value.
  json optimizer = effective_config.value("optimizer", json());
  if (optimizer.is_object()) {
    for (const auto& field : OptimizerFields()) {
      if (field.effect == FieldEffect::kLayout) optimizer.erase(std::string(field.key));
    }
  }
  json identity = {{"model", effective_config.value("model", json())},
                   {"optimizer", optimizer},
                   {"run",
                    {{"seed", run.seed},
                     {"seq_length", run.seq_length},
                     {"num_microbatches", run.num_microbatches},
                     {"iterations", config.optimizer ? run.train_iters : 1}}},
                   {"layout", (*reference)->LayoutIdentity()}};
  return identity;
}

StatusOr<int64_t> StoreJobReference(const Config& config, const RankCoordinates& coords,
                                    const json& identity, const std::string& dir) {
  int world_rank = 0, world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  std::string problem;
  if (world_rank == 0) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      problem = fmt::format("{}: cannot make the folder: {}", dir, ec.message());
    } else if (!fs::is_empty(dir, ec)) {
      problem = fmt::format("{}: is not empty (a stored reference goes into a new folder)", dir);
    }
  }
  std::vector<std::string> lines;
  if (GatherErrors(problem, &lines))
    return Status::Error("--out", problem.empty() ? "failed on rank 0" : problem);

  int64_t bytes = 0;
  const auto write = [&](const std::string& name, const SafetensorsFile& file) -> Status {
    const Status s = WriteSafetensors((fs::path(dir) / name).string(), file);
    if (s.ok()) {
      for (const NamedTensor& t : file.tensors) bytes += static_cast<int64_t>(t.tensor.bytes());
    }
    return s;
  };
  // Rank 0 holds every whole tensor (shares summed): it keeps the master parameters and each
  // iteration's shares.
  const BeforeStep keep = [&](int64_t k, const ReferenceResult& result) -> Status {
    if (world_rank != 0) return {};
    SafetensorsFile shares, initial;
    for (const ReferenceTensor& t : result.tensors) {
      if (t.layout != Layout::kWhole) continue;
      // The shares, and the state a step leaves besides the parameters (an MoE router's
      // expert bias: whole, neither a share nor a parameter).
      if (t.partial || !t.parameter) shares.tensors.push_back({t.name, t.value});
      if (k == 0 && t.parameter) initial.tensors.push_back({t.name, t.value});
    }
    if (k == 0) MPUSIM_RETURN_IF_ERROR(write("initial.safetensors", initial));
    return write(IterationFile(k), shares);
  };
  StatusOr<JobReference> job = ComputeJobReference(config, coords, keep);
  if (!job.ok()) return job.status();

  // The sliced tensors of the last iteration: one group's ranks write their slices; a tensor
  // that is an earlier one under another name is written once.
  const std::vector<ReferenceTensor>& tensors = job->result.tensors;
  std::vector<std::string> alias_of(tensors.size());
  for (size_t j = 0; j < tensors.size(); ++j) {
    if (tensors[j].layout == Layout::kWhole) continue;
    for (size_t i = 0; i < j; ++i) {
      if (tensors[i].layout == tensors[j].layout &&
          tensors[i].value.data() == tensors[j].value.data() &&
          tensors[i].full_shape == tensors[j].full_shape && tensors[i].value.numel() > 0) {
        alias_of[j] = tensors[i].name;
        break;
      }
    }
  }
  const ReferenceSplit& split = job->split;
  const bool writes_slice = split.group == 0 && split.slice.end > split.slice.begin;
  Status wrote;
  if (writes_slice) {
    SafetensorsFile slice;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].layout != Layout::kWhole && alias_of[i].empty()) {
        slice.tensors.push_back({tensors[i].name, tensors[i].value});
      }
    }
    wrote = write(SliceFile(split.index), slice);
  }
  if (GatherErrors(wrote.ok() ? "" : wrote.Message(), &lines)) {
    return Status::Error("--out", wrote.ok() ? (lines.empty() ? "failed on another rank" : lines[0])
                                             : wrote.Message());
  }
  const std::vector<std::string> slices = AllGatherStrings(
      writes_slice ? json{split.index, split.slice.begin, split.slice.end}.dump() : "");
  long long total = bytes;
  watched::Allreduce(MPI_IN_PLACE, &total, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD, WorldLabel());
  if (world_rank == 0) {
    json manifest = {{"format", kFormat},
                     {"version", kVersion},
                     {"identity", identity},
                     {"units", job->result.units},
                     {"unit", job->reference->UnitName()},
                     {"iterations", config.optimizer ? config.run->train_iters : 1}};
    json list = json::array();
    for (const std::string& s : slices) {
      if (s.empty()) continue;
      const json e = json::parse(s);
      list.push_back({{"file", SliceFile(e[0].get<int64_t>())}, {"begin", e[1]}, {"end", e[2]}});
    }
    manifest["slices"] = list;
    json described = json::array();
    for (size_t i = 0; i < tensors.size(); ++i) {
      const ReferenceTensor& t = tensors[i];
      described.push_back({{"name", t.name},
                           {"full_shape", t.full_shape},
                           {"layout", LayoutName(t.layout)},
                           {"batch_dim", t.batch_dim},
                           {"alias_of", alias_of[i]}});
    }
    manifest["tensors"] = described;
    wrote =
        WriteFileAtomically((fs::path(dir) / "reference.json").string(), manifest.dump(1) + "\n");
  }
  if (GatherErrors(wrote.ok() ? "" : wrote.Message(), &lines)) {
    return Status::Error("--out", wrote.ok() ? "failed on rank 0" : wrote.Message());
  }
  return static_cast<int64_t>(total);
}

StatusOr<JobReference> LoadJobReference(const Config& config, const RankCoordinates& coords,
                                        const json& identity, const std::string& dir) {
  int world_rank = 0, world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  const std::string manifest_path = (fs::path(dir) / "reference.json").string();
  StatusOr<json> manifest = ReadJsonFile(manifest_path);
  if (!manifest.ok())
    return Status::Error("--reference",
                         fmt::format("{}: {}", manifest_path, manifest.status().Message()));
  const json& m = *manifest;
  const auto bad = [&](const std::string& what) {
    return Status::Error("--reference", fmt::format("{}: {}", manifest_path, what));
  };
  if (!m.is_object() || m.value("format", "") != kFormat || m.value("version", 0) != kVersion ||
      !m.contains("identity") || !m["tensors"].is_array() || !m["slices"].is_array() ||
      !m["units"].is_number_integer() || !m["iterations"].is_number_integer()) {
    return bad(
        fmt::format("is not a stored reference of version {} (format, version, identity, "
                    "units, iterations, slices, tensors)",
                    kVersion));
  }
  if (const std::string d = FirstDifference(m["identity"], identity, ""); !d.empty()) {
    return Status::Error("--reference",
                         fmt::format("{}: the stored reference is of another run: {}", dir, d));
  }
  JobReference job;
  StatusOr<std::unique_ptr<Reference>> built = BuildReference(config);
  if (!built.ok()) return built.status();
  job.reference = std::move(built).value();
  job.split = job.reference->SplitFor(coords, world_rank, world_size);
  job.stored_dir = dir;
  const int64_t units = job.reference->Units();
  const int64_t iterations = config.optimizer ? config.run->train_iters : 1;
  if (m["units"].get<int64_t>() != units || m["iterations"].get<int64_t>() != iterations) {
    return bad(fmt::format("holds {} units and {} iterations, the run {} and {}", m["units"].dump(),
                           m["iterations"].dump(), units, iterations));
  }

  const std::string initial_path = (fs::path(dir) / "initial.safetensors").string();
  StatusOr<std::map<std::string, Tensor>> initial = ReadTensors(initial_path);
  if (!initial.ok()) return Status::Error("--reference", initial.status().Message());
  // The run's own reference on an empty slice: its tensors, shapes and error budgets.
  const ReferenceSlice empty{job.split.slice.begin, job.split.slice.begin};
  StatusOr<ReferenceResult> listed = job.reference->Run({empty, 0, &*initial});
  if (!listed.ok()) return Status::Error("--reference", listed.status().Message());
  ReferenceResult& result = *listed;
  // Stored as the step leaves it: the step's helper tensors (an MoE router's token counts)
  // removed, as RunJobReference's FinishIteration removes them before storing.
  std::map<std::string, Tensor> unused_state;
  job.reference->FinishIteration(result, false, &unused_state);
  const json& stored = m["tensors"];
  if (stored.size() != result.tensors.size()) {
    return bad(fmt::format("lists {} tensors, the run's reference {}", stored.size(),
                           result.tensors.size()));
  }
  result.slice_begin = job.split.slice.begin;
  result.slice_end = job.split.slice.end;
  const int64_t n = result.slice_end - result.slice_begin;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < result.tensors.size(); ++i) {
    ReferenceTensor& t = result.tensors[i];
    const json& s = stored[i];
    if (!s.is_object() || s.value("name", "") != t.name ||
        s.value("layout", "") != LayoutName(t.layout) || !s["full_shape"].is_array() ||
        s["full_shape"].get<Shape>() != t.full_shape || !s["alias_of"].is_string()) {
      return bad(fmt::format("tensor {} is not the run's {} ({}, {})", i, t.name,
                             LayoutName(t.layout), ShapeString(t.full_shape)));
    }
    index[t.name] = i;
    if (t.layout == Layout::kWhole) {
      if (t.parameter) {
        StatusOr<Tensor> v = Take(*initial, t.name, t.full_shape, initial_path);
        if (!v.ok()) return Status::Error("--reference", v.status().Message());
        t.value = *v;
      }
      continue;
    }
    const std::string alias = s["alias_of"].get<std::string>();
    if (!alias.empty()) {
      const auto it = index.find(alias);
      if (it == index.end() || it->second >= i)
        return bad(fmt::format("tensor {}: bad alias_of", t.name));
      t.value = result.tensors[it->second].value;
      continue;
    }
    Shape shape = t.full_shape;
    if (t.layout == Layout::kRows) {
      shape = {n, t.width()};
    } else {
      shape[static_cast<size_t>(t.batch_dim)] = n;
    }
    t.value = Tensor::HostEmpty(shape, DType::kFloat64);
  }
  // This rank's units from the slices that overlap them, one file at a time.
  int64_t covered = 0;
  for (const json& e : m["slices"]) {
    if (!e.is_object() || !e["file"].is_string() || !e["begin"].is_number_integer() ||
        !e["end"].is_number_integer()) {
      return bad("a slice entry is not {file, begin, end}");
    }
    const int64_t begin = e["begin"].get<int64_t>(), end = e["end"].get<int64_t>();
    const std::string file = e["file"].get<std::string>();
    if (begin < 0 || end > units || begin >= end || file.find('/') != std::string::npos) {
      return bad(
          fmt::format("slice {}: units [{}, {}) are not inside [0, {})", file, begin, end, units));
    }
    const int64_t from = std::max(begin, result.slice_begin), to = std::min(end, result.slice_end);
    if (from >= to) continue;
    const std::string path = (fs::path(dir) / file).string();
    StatusOr<std::map<std::string, Tensor>> tensors = ReadTensors(path);
    if (!tensors.ok()) return Status::Error("--reference", tensors.status().Message());
    for (size_t i = 0; i < result.tensors.size(); ++i) {
      ReferenceTensor& t = result.tensors[i];
      if (t.layout == Layout::kWhole || !stored[i]["alias_of"].get<std::string>().empty()) continue;
      Shape shape = t.full_shape;
      int dim = t.batch_dim;
      if (t.layout == Layout::kRows) {
        shape = {units, t.width()};
        dim = 0;
      }
      Shape stored_shape = shape;
      stored_shape[static_cast<size_t>(dim)] = end - begin;
      StatusOr<Tensor> part = Take(*tensors, t.name, stored_shape, path);
      if (!part.ok()) return Status::Error("--reference", part.status().Message());
      CopyUnits(*part, begin, t.value, result.slice_begin, from, to, shape, dim);
    }
    covered += to - from;
  }
  if (covered != n)
    return bad(fmt::format("its slices do not cover units [{}, {})", result.slice_begin,
                           result.slice_end));

  // The iterations: each one's summed shares; after training, the trainer replayed on them.
  if (config.optimizer) {
    job.trainer.emplace(*config.optimizer, config.run->train_iters);
    job.trainer->SetPrecision(PrecisionOf(config));
  }
  for (int64_t k = 0; k < iterations; ++k) {
    const std::string path = (fs::path(dir) / IterationFile(k)).string();
    StatusOr<std::map<std::string, Tensor>> shares = ReadTensors(path);
    if (!shares.ok()) return Status::Error("--reference", shares.status().Message());
    const bool last = k + 1 == iterations;
    // An earlier iteration: its shares, and the parameters whose gradients TrainReference
    // looks up (their values only matter at the first step).
    ReferenceResult step;
    ReferenceResult& target = last ? result : step;
    for (const ReferenceTensor& t : result.tensors) {
      if (t.layout != Layout::kWhole) continue;
      const bool state = !t.partial && !t.parameter;  // read at the last iteration only
      if (!t.partial && !(t.parameter && !last) && !(state && last)) continue;
      if (!last) step.tensors.push_back(t);
      ReferenceTensor& into = last ? result.tensors[index.at(t.name)] : step.tensors.back();
      if (t.partial || state) {
        StatusOr<Tensor> v = Take(*shares, t.name, t.full_shape, path);
        if (!v.ok()) return Status::Error("--reference", v.status().Message());
        into.value = Tensor::HostEmpty(t.full_shape, DType::kFloat64);  // clipped in place
        std::memcpy(into.value.data(), v->data(), v->bytes());
      }
    }
    if (job.trainer) TrainReference(target, k, config.run->dtype, *job.trainer, &job.iterations);
  }
  if (const ReferenceTensor* loss = result.Find("loss")) {
    result.has_loss = true;
    result.loss = loss->value.data_as<double>()[0];
  }
  job.result = std::move(result);
  return job;
}

}  // namespace mpusim::run
