// `mpusim run` on MPI ranks (see runner.h).
#include "run/runner.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <ostream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/compare.h"
#include "core/config.h"
#include "core/model/graph.h"
#include "core/safetensors.h"
#include "core/topology.h"
#include "mpi/mpi_check.h"
#include "mpi/mpi_communicator.h"
#include "reference/reference_model.h"

namespace mpusim::run {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;
constexpr int kExitUsage = 2;

// Every rank must reach the same verdict; the worst code wins.
int AgreeOnExitCode(int code) {
  int worst = code;
  MPUSIM_MPI_CHECK(MPI_Allreduce(&code, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  return worst;
}

// Collective over MPI_COMM_WORLD: every rank passes its error message ("" for none); rank 0
// gets one line per distinct message, naming the ranks that reported it unless all did (a
// missing plugin or GPU is one line, not one per rank). Returns whether any rank failed.
bool GatherErrors(const std::string& message, int world_rank, int world_size,
                  std::vector<std::string>* lines) {
  int length = static_cast<int>(message.size());
  std::vector<int> lengths(static_cast<size_t>(world_size), 0);
  MPUSIM_MPI_CHECK(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, MPI_COMM_WORLD));
  std::vector<int> offsets(static_cast<size_t>(world_size), 0);
  int total = 0;
  for (int r = 0; r < world_size; ++r) {
    offsets[static_cast<size_t>(r)] = total;
    total += lengths[static_cast<size_t>(r)];
  }
  std::string all(static_cast<size_t>(total), '\0');
  MPUSIM_MPI_CHECK(MPI_Gatherv(message.data(), length, MPI_CHAR, all.data(), lengths.data(),
                               offsets.data(), MPI_CHAR, 0, MPI_COMM_WORLD));
  int failed = message.empty() ? 0 : 1;
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  if (world_rank == 0) {
    std::map<std::string, std::vector<int>> ranks_of;  // message -> ranks
    for (int r = 0; r < world_size; ++r) {
      const auto i = static_cast<size_t>(r);
      if (lengths[i] > 0) ranks_of[all.substr(static_cast<size_t>(offsets[i]), static_cast<size_t>(lengths[i]))].push_back(r);
    }
    for (const auto& [text, ranks] : ranks_of) {
      lines->push_back(static_cast<int>(ranks.size()) == world_size
                           ? text
                           : fmt::format("rank{} {}: {}", ranks.size() > 1 ? "s" : "",
                                         fmt::join(ranks, ","), text));
    }
  }
  return failed != 0;
}

double MaxAbs(const Tensor& host64) {
  double scale = 0;
  for (int64_t i = 0; i < host64.numel(); ++i) {
    scale = std::max(scale, std::fabs(host64.data_as<double>()[i]));
  }
  return scale;
}

// Compares a local record with the full reference tensor, element by element, under the
// run's tolerance scaled to the full tensor's largest |expected| (`scale`).
ErrorStats CompareRecord(const TensorRecord& record, const Tensor& local_host,
                         const Tensor& expected, double scale, int64_t tp_size,
                         const Tolerance& run_tol) {
  ErrorStats stats;
  const Tolerance tol = run_tol.ForScale(scale);
  const Shape& local_shape = local_host.shape();
  const Shape& full = record.full_shape;
  const size_t dims = full.size();
  std::vector<int64_t> index(dims, 0);
  const double summands = record.partial_sum ? static_cast<double>(tp_size) : 1.0;
  const double* want = expected.data_as<double>();
  for (int64_t e = 0; e < local_host.numel(); ++e) {
    int64_t flat = 0;
    for (size_t k = 0; k < dims; ++k) {
      const int64_t g = GlobalIndex(record.shard, static_cast<int>(k), full[k], index[k]);
      flat = flat * full[k] + g;
    }
    stats.Add(flat, HostValue(local_host, e) * summands, want[flat], tol);
    for (size_t k = dims; k-- > 0;) {
      if (++index[k] < local_shape[k]) break;
      index[k] = 0;
    }
  }
  return stats;
}

std::string MetadataJson(const TensorRecord& r) {
  nlohmann::ordered_json j;
  j["full_shape"] = r.full_shape;
  j["shard_dim"] = r.shard.shard_dim;
  j["num_shards"] = r.shard.num_shards;
  j["shard_index"] = r.shard.shard_index;
  j["stride"] = r.shard.stride;
  if (r.shard.batch_dim >= 0) {
    j["batch_dim"] = r.shard.batch_dim;
    j["batch_shards"] = r.shard.batch_shards;
    j["batch_index"] = r.shard.batch_index;
  }
  if (r.partial_sum) j["partial_sum"] = true;
  return j.dump();
}

struct CommSummaryKey {
  Phase phase;
  std::string site;
  CommOpKind op;
  std::string group;
  bool operator<(const CommSummaryKey& o) const {
    return std::tie(phase, site, op, group) < std::tie(o.phase, o.site, o.op, o.group);
  }
};

}  // namespace

StatusOr<SimulationResult> Simulate(const Config& config, bool check, int repeat,
                                    Backend& backend) {
  int world_rank = 0, world_size = 1;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  if (!config.model || !config.run) {
    return Status::Error(config.model ? "run" : "model",
                         "is required by mpusim run (see docs/simulator.md)");
  }
  if (config.parallel.world_size != world_size) {
    return Status::Error("parallel.world_size",
                         fmt::format("the config needs {} ranks but MPI started {}",
                                     config.parallel.world_size, world_size));
  }
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  if (!topology.ok()) return topology.status();
  StatusOr<std::unique_ptr<Graph>> built = Graph::Build(config, *topology);
  if (!built.ok()) return built.status();
  Graph& graph = **built;

  SimulationResult result;
  Kernels& kernels = backend.kernels();
  RankContext ctx;
  ctx.topology = &*topology;
  ctx.rank = world_rank;
  ctx.coords = topology->Coordinates(world_rank);
  ctx.kernels = &kernels;
  ctx.trace = &result.trace;
  ctx.rng = RngTracker::ForRank(config.run->seed, ctx.coords.tp, ctx.coords.pp, ctx.coords.dp);
  auto groups = backend.MakeGroups(*topology, world_rank, {"tp", "dp", "dp_cp"});
  for (auto& [kind, comm] : groups) {
    ctx.groups.emplace(kind,
                       std::make_unique<TracedCommunicator>(std::move(comm), kind, &result.trace));
  }
  result.coords = ctx.coords;
  result.padded_vocab_size = graph.padded_vocab_size();
  result.plan = graph.Plan(topology->Coordinates(0));

  graph.InitializeParameters(ctx);
  for (int i = 0; i < repeat; ++i) {
    result.trace.Clear();
    MPUSIM_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
    const auto start = std::chrono::steady_clock::now();
    graph.Run(ctx);
    MPUSIM_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
    result.seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  result.records = graph.Records(ctx);
  for (TensorRecord& r : result.records) r.tensor = kernels.ToHost(r.tensor);
  result.has_loss = graph.has_loss();
  result.loss = result.has_loss ? graph.loss() : 0.0;
  if (!check) return result;

  // Every rank runs the (small) reference itself and checks its own shards; the statistics
  // are then reduced over ranks, so no tensor is ever gathered.
  StatusOr<ReferenceResult> reference = RunReference(config.parallel, *config.model, *config.run);
  if (!reference.ok()) {
    return Status::Error("reference model", reference.status().Message());
  }
  result.reference_loss = reference->loss;
  const Tolerance tol = DefaultTolerance(config.run->dtype);
  const size_t n = result.records.size();
  std::vector<double> maxima(2 * n, 0.0);
  std::vector<long long> counts(3 * n, 0);
  std::vector<int> missing(n, 0);
  std::vector<double> scales(n, 0.0);  // the same on every rank: the full reference tensor
  for (size_t i = 0; i < n; ++i) {
    const TensorRecord& r = result.records[i];
    const auto it = reference->tensors.find(r.name);
    if (it == reference->tensors.end() || it->second.shape() != r.full_shape) {
      missing[i] = 1;
      continue;
    }
    scales[i] = MaxAbs(it->second);
    const ErrorStats stats = CompareRecord(r, r.tensor, it->second, scales[i], ctx.tp_size(), tol);
    maxima[2 * i] = stats.max_abs;
    maxima[2 * i + 1] = stats.max_rel;
    counts[3 * i] = stats.count;
    counts[3 * i + 1] = stats.mismatches;
    counts[3 * i + 2] = stats.non_finite;
  }
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, maxima.data(), static_cast<int>(maxima.size()),
                                 MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, counts.data(), static_cast<int>(counts.size()),
                                 MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, missing.data(), static_cast<int>(missing.size()),
                                 MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  for (size_t i = 0; i < n; ++i) {
    TensorCheck c;
    c.name = result.records[i].name;
    c.full_shape = result.records[i].full_shape;
    c.max_abs = maxima[2 * i];
    c.max_rel = maxima[2 * i + 1];
    c.scale = scales[i];
    c.normalized = c.scale > 0 ? c.max_abs / c.scale : 0.0;
    c.count = counts[3 * i];
    c.mismatches = counts[3 * i + 1];
    c.non_finite = counts[3 * i + 2];
    c.missing = missing[i] != 0;
    result.checks.push_back(std::move(c));
  }
  return result;
}

namespace {

class RankRun {
 public:
  RankRun(const RunOptions& options, std::ostream& out, std::ostream& err, int world_rank,
          int world_size, const BackendFactory& factory)
      : options_(options),
        factory_(factory),
        out_(world_rank == 0 ? out : null_),
        err_(world_rank == 0 ? err : null_),
        world_rank_(world_rank),
        world_size_(world_size) {}

  int Run();

 private:
  int Usage(const std::string& source, const std::string& message) {
    err_ << "error: " << source << ": " << message << '\n';
    return kExitUsage;
  }
  void PrintLayout(const Topology& topology, const SimulationResult& result);
  int PrintChecks(const SimulationResult& result);
  void PrintCommTrace(const CommTrace& trace);
  int Dump(const SimulationResult& result);

  const RunOptions& options_;
  const BackendFactory& factory_;
  std::string backend_name_ = "cpu";
  std::ostringstream null_;
  std::ostream& out_;
  std::ostream& err_;
  int world_rank_;
  int world_size_;
  Config config_;
};

int RankRun::Run() {
  const std::string& source = options_.config_path;
  // Every rank parses the same file; only rank 0 reports, and everyone exits 2 together.
  StatusOr<Config> loaded = LoadConfigFile(source);
  if (!loaded.ok()) return Usage(source, loaded.status().Message());
  config_ = *loaded;
  if (!config_.model || !config_.run) {
    return Usage(source, fmt::format("{}: is required by mpusim run (see docs/simulator.md)",
                                     config_.model ? "run" : "model"));
  }
  const int64_t want = config_.parallel.world_size;
  if (want != world_size_) {
    const bool under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr ||
                              std::getenv("PMI_SIZE") != nullptr;
    if (!under_mpirun) {
      return Usage(source, fmt::format("parallel.world_size: the config needs {} ranks but mpusim "
                                       "run was started without mpirun; run: mpirun -n {} "
                                       "mpusim run {}",
                                       want, want, source));
    }
    return Usage(source, fmt::format("parallel.world_size: the config needs {} ranks but mpirun "
                                     "started {}; run: mpirun -n {} mpusim run {}",
                                     want, world_size_, want, source));
  }
  StatusOr<Topology> topology = Topology::Create(config_.parallel);
  if (!topology.ok()) return Usage(source, topology.status().Message());
  {
    StatusOr<std::unique_ptr<Graph>> built = Graph::Build(config_, *topology);
    if (!built.ok()) return Usage(source, built.status().Message());
  }
  if (!options_.dump_dir.empty() && std::filesystem::exists(options_.dump_dir) &&
      !std::filesystem::is_directory(options_.dump_dir)) {
    return Usage("command line", fmt::format("--dump: '{}' exists and is not a directory",
                                             options_.dump_dir));
  }
  std::unique_ptr<Backend> backend;
  {
    BackendOrStatus made = factory_(options_);
    std::vector<std::string> lines;
    if (GatherErrors(made.ok() ? std::string() : made.status().Message(), world_rank_,
                     world_size_, &lines)) {
      for (const std::string& line : lines) err_ << "error: " << line << '\n';
      return kExitUsage;
    }
    backend = std::move(made).value();
  }
  backend_name_ = backend->name();
  StatusOr<SimulationResult> result =
      Simulate(config_, options_.check, options_.repeat, *backend);
  if (!result.ok()) return Usage(source, result.status().Message());
  PrintLayout(*topology, *result);
  if (result->has_loss) out_ << fmt::format("\nloss {:.9g}\n", result->loss);
  if (options_.repeat > 1) {
    std::vector<double> sorted = result->seconds;
    std::sort(sorted.begin(), sorted.end());
    out_ << fmt::format("time per step (forward + backward, all micro-batches): median {:.4f} s "
                        "over {} runs, min {:.4f} s, max {:.4f} s\n",
                        sorted[sorted.size() / 2], sorted.size(), sorted.front(), sorted.back());
  }
  int code = kExitOk;
  if (options_.check) code = PrintChecks(*result);
  PrintCommTrace(result->trace);
  if (!options_.dump_dir.empty()) code = std::max(code, Dump(*result));
  return code;
}

void RankRun::PrintLayout(const Topology& topology, const SimulationResult& result) {
  const DerivedSizes& s = topology.sizes();
  const RunConfig& run = *config_.run;
  out_ << fmt::format("mpusim run: {} on {} ranks ({} backend, {}, seed {})\n",
                      options_.config_path, world_size_, backend_name_, DTypeName(run.dtype),
                      run.seed);
  out_ << fmt::format("layout: tensor_model_parallel_size {}, data_parallel_size {}, "
                      "sequence_parallel {}\n",
                      s.tp, s.dp, config_.parallel.sequence_parallel);
  for (const char* kind : {"tp", "dp"}) {
    const size_t k = *topology.FindKind(kind);
    std::vector<std::string> groups;
    for (int64_t g = 0; g < std::min<int64_t>(topology.NumGroups(k), 8); ++g) {
      groups.push_back(fmt::format("[{}]", fmt::join(topology.Group(k, g), ", ")));
    }
    out_ << fmt::format("  {} groups: {}{}\n", kind, fmt::join(groups, " "),
                        topology.NumGroups(k) > 8 ? " ..." : "");
  }
  out_ << fmt::format("data: seq_length {}, micro_batch_size {} per dp rank ({} in all), "
                      "num_microbatches {}{}\n",
                      run.seq_length, run.micro_batch_size, run.micro_batch_size * s.dp,
                      run.num_microbatches, run.recompute ? ", recompute_granularity full" : "");
  if (config_.model->vocab_size) {
    out_ << fmt::format("vocab_size {}, padded_vocab_size {}\n", *config_.model->vocab_size,
                        result.padded_vocab_size);
  }
  out_ << "layers (activation state on the tp group, full width):\n";
  for (const Graph::PlannedLayer& layer : result.plan) {
    const std::string in = layer.input_width == 0
                               ? std::string("tokens")
                               : fmt::format("{} {}", SplitName(layer.input.split),
                                             layer.input_width);
    const std::string produced = layer.output_width == 0
                                   ? std::string("loss")
                                   : fmt::format("{} {}", SplitName(layer.output.split),
                                                 layer.output_width);
    out_ << fmt::format("  {:<12} {:<44} {} -> {}\n", layer.name, layer.type, in, produced);
  }
}

int RankRun::PrintChecks(const SimulationResult& result) {
  const Tolerance tol = DefaultTolerance(config_.run->dtype);
  if (result.has_loss) {
    out_ << fmt::format("reference loss {:.9g} (float64, single process), |difference| {:.3g}\n",
                        result.reference_loss, std::fabs(result.loss - result.reference_loss));
  }
  const std::string scaled =
      tol.ntol > 0 ? fmt::format(" + {:g} * max|e|", tol.ntol) : std::string();
  out_ << fmt::format("\ncheck against the float64 reference ({} storage: pass when |a - e| <= "
                      "{:g}{} + {:g} * |e|):\n",
                      DTypeName(config_.run->dtype), tol.atol, scaled, tol.rtol);
  out_ << fmt::format("  {:<26} {:<16} {:>12} {:>12} {:>12}  {}\n", "tensor", "shape",
                      "max abs err", "max rel err", "normalized", "result");
  int failed = 0;
  for (const TensorCheck& c : result.checks) {
    std::string verdict = "pass";
    if (c.missing) {
      verdict = "FAIL (not produced by the reference)";
    } else if (c.mismatches > 0) {
      verdict = fmt::format("FAIL ({} of {} elements{})", c.mismatches, c.count,
                            c.non_finite > 0 ? fmt::format(", {} not finite", c.non_finite)
                                             : std::string());
    }
    if (!c.ok()) ++failed;
    out_ << fmt::format("  {:<26} {:<16} {:>12.3g} {:>12.3g} {:>12.3g}  {}\n", c.name,
                        ShapeString(c.full_shape), c.max_abs, c.max_rel, c.normalized, verdict);
  }
  out_ << fmt::format("{} passed, {} failed\n", result.checks.size() - static_cast<size_t>(failed),
                      failed);
  return failed > 0 ? kExitCheckFailed : kExitOk;
}

void RankRun::PrintCommTrace(const CommTrace& trace) {
  std::map<CommSummaryKey, std::pair<int64_t, int64_t>> summary;  // count, bytes
  for (const CommRecord& r : trace.records()) {
    auto& entry = summary[{r.phase, r.site, r.op, r.group}];
    entry.first += 1;
    entry.second += r.bytes;
  }
  out_ << fmt::format("\ncollectives on rank 0 ({} in all; groups of one rank move no data and "
                      "are not listed):\n",
                      trace.records().size());
  out_ << fmt::format("  {:<9} {:<24} {:<16} {:<6} {:>6} {:>14}\n", "phase", "issued by", "op",
                      "group", "count", "bytes");
  for (const auto& [key, value] : summary) {
    out_ << fmt::format("  {:<9} {:<24} {:<16} {:<6} {:>6} {:>14}\n", PhaseName(key.phase),
                        key.site, CommOpName(key.op), key.group, value.first, value.second);
  }
}

int RankRun::Dump(const SimulationResult& result) {
  const std::vector<TensorRecord>& records = result.records;
  const RankCoordinates& coords = result.coords;
  namespace fs = std::filesystem;
  int ok = 1;
  if (world_rank_ == 0) {
    std::error_code ec;
    fs::create_directories(options_.dump_dir, ec);
    if (ec) ok = 0;
  }
  MPUSIM_MPI_CHECK(MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD));
  if (ok == 0) {
    return Usage("command line",
                 fmt::format("--dump: cannot create directory '{}'", options_.dump_dir));
  }
  SafetensorsFile file;
  nlohmann::ordered_json rank_info;
  rank_info["rank"] = world_rank_;
  rank_info["tp_rank"] = coords.tp;
  rank_info["dp_rank"] = coords.dp;
  rank_info["backend"] = backend_name_;
  file.metadata["mpusim"] = rank_info.dump();
  for (const TensorRecord& r : records) {
    file.tensors.push_back({r.name, r.tensor});
    file.metadata[r.name] = MetadataJson(r);
  }
  const std::string path =
      (fs::path(options_.dump_dir) / fmt::format("rank{:05d}.safetensors", world_rank_)).string();
  const Status written = WriteSafetensors(path, file);
  int failed = written.ok() ? 0 : 1;
  MPUSIM_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  if (!written.ok()) {
    std::cerr << fmt::format("error: rank {}: {}: {}\n", world_rank_, path, written.Message());
  }
  if (failed != 0) return kExitUsage;
  if (world_rank_ == 0) {
    nlohmann::ordered_json manifest;
    manifest["schema_version"] = 1;
    StatusOr<nlohmann::json> raw = ReadJsonFile(options_.config_path);
    manifest["config"] = raw.ok() ? *raw : nlohmann::json(nullptr);
    manifest["world_size"] = world_size_;
    manifest["backend"] = backend_name_;
    manifest["dtype"] = DTypeName(config_.run->dtype);
    nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
    for (const TensorRecord& r : records) {
      tensors.push_back({{"name", r.name},
                         {"full_shape", r.full_shape},
                         {"dtype", DTypeName(r.tensor.dtype())}});
    }
    manifest["tensors"] = tensors;
    std::vector<std::string> files;
    for (int r = 0; r < world_size_; ++r) files.push_back(fmt::format("rank{:05d}.safetensors", r));
    manifest["files"] = files;
    const Status status = WriteFileAtomically(
        (fs::path(options_.dump_dir) / "manifest.json").string(), manifest.dump(1) + "\n");
    if (!status.ok()) return Usage(options_.dump_dir, status.Message());
    out_ << fmt::format("\ndump: {} ({} files + manifest.json)\n", options_.dump_dir,
                        world_size_);
  }
  return kExitOk;
}

}  // namespace

int RunSimulation(const RunOptions& options, std::ostream& out, std::ostream& err,
                  const BackendFactory& factory) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized == 0) MPI_Init(nullptr, nullptr);
  int world_rank = 0, world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  int code = kExitOk;
  try {
    RankRun run(options, out, err, world_rank, world_size, factory);
    code = run.Run();
  } catch (const std::exception& e) {
    // A bug or an unexpected failure on one rank: end the whole job rather than leave the
    // other ranks waiting in a collective.
    std::cerr << fmt::format("error: rank {}: {}\n", world_rank, e.what()) << std::flush;
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  code = AgreeOnExitCode(code);
  if (initialized == 0) MPI_Finalize();
  return code;
}

}  // namespace mpusim::run
