// `mpusim run` on MPI ranks (see runner.h).
#include "run/runner.h"

#include <fmt/format.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <sstream>

#include "core/config/config.h"
#include "core/config/model_facts.h"
#include "core/model/model.h"
#include "core/topology.h"
#include "mpi/agree.h"
#include "mpi/interrupt.h"
#include "mpi/mpi_check.h"
#include "mpi/watchdog.h"
#include "run/dump.h"
#include "run/preflight.h"
#include "run/report.h"
#include "run/stored_reference.h"

namespace mpusim::run {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitOutOfMemory = 3;
constexpr int kExitInternalError = 4;
constexpr int kExitInterrupted = 128;  // and up: 128 + the signal (mpi/interrupt.h)

// "" when `path` (a --trace or --summary FILE, written by rank 0 after the run) can be
// written: it is not a directory, and its directory exists and takes a new file (the file is
// written to a sibling and renamed); else why not.
std::string OutputFileError(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path file(path);
  if (fs::is_directory(file, ec)) return fmt::format("'{}' is a directory; give a file name", path);
  const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) {
    return fmt::format("cannot write '{}': there is no directory '{}'", path, dir.string());
  }
  const fs::path probe =
      dir / fmt::format(".{}.mpusim-probe-{}", file.filename().string(), ::getpid());
  std::ofstream out(probe);
  if (!out) {
    return fmt::format("cannot write '{}': the directory '{}' takes no new file ({})", path,
                       dir.string(), std::strerror(errno));
  }
  out.close();
  fs::remove(probe, ec);
  return "";
}

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
  int Usage(const std::string& source, const std::string& message) const {
    err_ << "error: " << EscapeControl(source) << ": " << EscapeControl(message) << '\n';
    return kExitUsage;
  }
  // Every rank's refusal (GatherErrors' lines), one Usage line each.
  int Refused(const std::string& source, const std::vector<std::string>& lines) const {
    for (const std::string& line : lines) Usage(source, line);
    return kExitUsage;
  }
  // The phases of Run; each returns an exit code, or kContinue.
  static constexpr int kContinue = -1;
  int LoadConfig();       // config_: the file with the command line's overrides, checked
  int CheckWorldSize() const;
  int CheckOutputFiles() const;  // --summary and --trace, before anything runs
  // An error about the resolved config: the override's flag when the field is one it set;
  // the overrides as typed when the file alone is a valid layout and model (they broke it);
  // else the file.
  int ConfigError(const Status& status) const;
  std::string OverridesText() const;  // " --tp 3 --dtype bfloat16", as typed
  int Preflight(const Topology& topology);  // plan_, warnings_: refuse what would not fit
  int MakeBackend();      // backend_, and its device memory against plan_
  int Report(const Topology& topology, SimulationResult& result, const DumpTarget& dump);
  int StoreReference(const Topology& topology);  // `mpusim reference`
  std::string PreflightError(const MemoryPlan& plan) const;

  const RunOptions& options_;
  const BackendFactory& factory_;
  std::ostringstream null_;
  std::ostream& out_;
  std::ostream& err_;
  int world_rank_;
  int world_size_;
  Config config_;
  nlohmann::json effective_config_;    // config_ as JSON, for the dump and the summary
  MemoryPlan plan_;                    // this rank's preflight plan
  std::vector<std::string> warnings_;  // the model's plan-time warnings (Model::Warnings)
  std::unique_ptr<Backend> backend_;
};

// "" when `plan` fits this rank's limit: --max-memory, else the machine's available memory
// shared by the ranks on this node; the refusal otherwise.
std::string RankRun::PreflightError(const MemoryPlan& plan) const {
  uint64_t limit = options_.max_memory_bytes;
  std::string source = "--max-memory";
  if (limit == 0) {
    const std::optional<uint64_t> available = AvailableMemoryBytes();
    if (!available) return "";  // no /proc/meminfo: nothing to judge against
    int64_t local_ranks = world_size_;
    for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
      if (const char* value = std::getenv(name)) local_ranks = std::max(1L, std::atol(value));
    }
    limit = *available / static_cast<uint64_t>(local_ranks);
    source = fmt::format("this machine's available memory, {}, shared by {} rank{}",
                         FormatBytes(*available), local_ranks, local_ranks == 1 ? "" : "s");
  }
  const Status status = CheckRankMemory(plan, limit, source);
  return status.ok() ? "" : status.Message();
}

int RankRun::Run() {
  if (const int code = LoadConfig(); code != kContinue) return code;
  // The layout and the model are judged before the rank count, so that a config mpirun would
  // start with other ranks hears what else is wrong with it first.
  StatusOr<Topology> topology = Topology::Create(config_.parallel);
  if (!topology.ok()) return ConfigError(topology.status());
  if (StatusOr<std::unique_ptr<Model>> model =
          BuildModel(config_, *topology, topology->Coordinates(topology->first_rank()));
      !model.ok()) {
    return ConfigError(model.status());
  }
  if (const int code = CheckWorldSize(); code != kContinue) return code;
  if (!options_.store_reference_dir.empty()) return StoreReference(*topology);
  if (const int code = Preflight(*topology); code != kContinue) return code;
  DumpTarget dump{options_.dump_dir, options_.config_path, effective_config_,
                  options_.command_line, "", config_.run->dtype, ""};
  if (!options_.dump_dir.empty()) {
    const Status ready = PrepareDump(&dump);
    if (!ready.ok()) return Usage("command line", ready.Message());
  }
  if (const int code = CheckOutputFiles(); code != kContinue) return code;
  if (const int code = MakeBackend(); code != kContinue) return code;
  ReferenceSource reference;
  if (!options_.reference_dir.empty()) {
    if (!options_.check) return Usage("command line", "--reference: is what the check reads (drop --no-check)");
    StatusOr<nlohmann::json> identity = ReferenceIdentity(effective_config_, config_);
    if (!identity.ok()) return ConfigError(identity.status());
    reference = {options_.reference_dir, *identity};
  }
  SimulateOptions simulate{options_.check, options_.repeat, !options_.dump_dir.empty(),
                           !options_.trace_path.empty(), reference};
  // A training run of several iterations says how it goes as it goes (rank 0), before the
  // report and its checked table: its first iteration, then at most one a second, and its
  // last. (Not every one: a long run's lines would flood mpirun's forwarding, which stops
  // reading when mpirun is interrupted, and a rank blocked writing never reaches its safe
  // point.)
  const int64_t iterations = config_.optimizer && config_.run ? config_.run->train_iters : 0;
  double last_said = -1;
  if (world_rank_ == 0 && iterations > 1) {
    simulate.on_iteration = [&, iterations](const TrainedIteration& row) {
      const double now =
          std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
              .count();
      if (row.iteration != 1 && row.iteration != iterations && now - last_said < 1.0) return;
      last_said = now;
      out_ << fmt::format(
                  "iteration {} of {}: loss {:.10g}, grad norm {:.4g}, lr {:.4g} ({:.3f} s)",
                  row.iteration, iterations, row.loss, row.grad_norm, row.lr, row.seconds)
           << std::endl;
    };
  }
  StatusOr<SimulationResult> result = Simulate(config_, simulate, *backend_);
  if (!result.ok()) return Usage(options_.config_path, result.status().Message());
  // The last safe point before anything is written: the reference check may have run long.
  if (!result->interrupt) {
    if (const Interrupt late = AgreeOnInterrupt()) {
      result->interrupt = late;
      result->interrupted_where = options_.check ? "after the reference check" : "after the run";
    }
  }
  if (result->interrupt) {
    err_ << InterruptLine(result->interrupt, result->interrupted_where,
                          "no dump, trace or summary written")
         << '\n';
    return InterruptExitCode(result->interrupt);
  }
  return Report(*topology, *result, dump);
}

int RankRun::StoreReference(const Topology& topology) {
  StatusOr<nlohmann::json> identity = ReferenceIdentity(effective_config_, config_);
  if (!identity.ok()) return ConfigError(identity.status());
  const auto start = std::chrono::steady_clock::now();
  StatusOr<int64_t> bytes = StoreJobReference(config_, topology.Coordinates(world_rank_),
                                              *identity, options_.store_reference_dir);
  if (!bytes.ok()) return Usage(options_.config_path, bytes.status().Message());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out_ << fmt::format(
      "mpusim reference: {} on {} rank{}: the float64 reference ({} iteration{}) computed in "
      "{:.1f} s and stored in {} ({}); check a run against it with mpusim run {} --reference "
      "{}\n",
      options_.config_path, world_size_, world_size_ == 1 ? "" : "s",
      config_.optimizer ? config_.run->train_iters : 1,
      config_.optimizer && config_.run->train_iters != 1 ? "s" : "", seconds,
      options_.store_reference_dir, FormatBytes(static_cast<unsigned __int128>(*bytes)),
      options_.config_path, options_.store_reference_dir);
  return 0;
}

int RankRun::LoadConfig() {
  const std::string& source = options_.config_path;
  // Every rank parses the same file; only rank 0 reports, and everyone exits 2 together.
  StatusOr<nlohmann::json> document = ReadJsonFile(source);
  if (!document.ok()) return Usage(source, document.status().Message());
  for (const RunOptions::Override& o : options_.overrides) {
    const size_t dot = o.key.find('.');
    const std::string name = o.key.substr(0, dot);
    // The optimizer's keys need the file's optimizer (what the other commands say too).
    if (name == "optimizer" && !(document->contains(name) && (*document)[name].is_object())) {
      return Usage("command line",
                   fmt::format("{}: needs a config with an \"optimizer\" section (it sets {})",
                               o.flag, o.key));
    }
    nlohmann::json& section = (*document)[name];
    if (!section.is_object()) section = nlohmann::json::object();
    section[o.key.substr(dot + 1)] = nlohmann::json::parse(o.value, nullptr, false);
  }
  if (const Status parsed = ParseConfig(*document, &config_); !parsed.ok()) {
    return ConfigError(parsed);
  }
  effective_config_ = EffectiveConfigJson(*document, config_);
  if (world_rank_ == 0) {
    for (const std::string& line : config_.notes()) err_ << "note: " << line << '\n';
  }
  const bool has_model = config_.has_model();
  if (!has_model || !config_.run) {
    return Usage(source, fmt::format("{}: is required by mpusim run (see docs/simulator.md)",
                                     has_model ? "run" : "model"));
  }
  // The executor computes in the run's dtype: fp8 is for the estimate and advise alone.
  if (const std::optional<Fp8Format> fp8 = FactsOf(config_).fp8) {
    return Usage(source, fmt::format("model.fp8: \"{}\" is for mpusim estimate and advise only; "
                                     "mpusim run computes in run.dtype (set fp8 to null)",
                                     Fp8FormatName(*fp8)));
  }
  // The executor runs Megatron's plain 1F1B order; the combined one only changes timing and
  // how many micro-batches are in flight, which estimate and advise price.
  if (config_.parallel.overlap_moe_expert_parallel_comm) {
    return Usage(source, "parallel.overlap_moe_expert_parallel_comm: true is for mpusim estimate "
                         "and advise only; mpusim run runs the plain 1F1B schedule, with the "
                         "same values (set it false)");
  }
  return kContinue;
}

int RankRun::ConfigError(const Status& status) const {
  for (const RunOptions::Override& o : options_.overrides) {
    if (status.where() == o.key) return Usage("command line", o.flag + ": " + status.Message());
  }
  if (!options_.overrides.empty() && ConfigFileIsValid(options_.config_path)) {
    return Usage("command line", OverridesText().substr(1) + ": " + status.Message());
  }
  return Usage(options_.config_path, status.Message());
}

std::string RankRun::OverridesText() const {
  std::string text;
  for (const RunOptions::Override& o : options_.overrides) {
    text += o.typed.empty() ? " " + o.flag : fmt::format(" {} {}", o.flag, o.typed);
  }
  return text;
}

int RankRun::CheckWorldSize() const {
  const std::string& source = options_.config_path;
  const int64_t want = config_.parallel.world_size;
  if (want == world_size_) return kContinue;
  const bool under_mpirun =
      std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
  // Open MPI refuses more ranks than this machine's cores without --oversubscribe.
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const std::string launch = fmt::format("mpirun -n {}{} mpusim run {}{}", want,
                                         cores > 0 && want > cores ? " --oversubscribe" : "",
                                         source, OverridesText());
  return Usage(source,
               under_mpirun
                   ? fmt::format("parallel.world_size: the config needs {} ranks but mpirun "
                                 "started {}; run: {}",
                                 want, world_size_, launch)
                   : fmt::format("parallel.world_size: the config needs {} ranks but mpusim run "
                                 "was started without mpirun; run: {}",
                                 want, launch));
}

// Refuses a run that would not fit before anything is allocated. Every rank judges its own
// share against its own limit; one refusal stops them all. A GPU backend's tensors are
// judged against the GPU's memory once the backend exists (MakeBackend), so here only the
// host's part of its plan is.
int RankRun::Preflight(const Topology& topology) {
  StatusOr<std::unique_ptr<Model>> built =
      BuildModel(config_, topology, topology.Coordinates(world_rank_));
  if (!built.ok()) return ConfigError(built.status());
  warnings_ = (*built)->Warnings();
  plan_ = PlanRankMemory(**built, world_size_, options_.check);
  const bool own_memory = options_.backend != "cpu";
  std::vector<std::string> lines;
  if (GatherErrors(PreflightError(own_memory ? plan_.HostItems() : plan_), &lines)) {
    return Refused(options_.config_path, lines);
  }
  return kContinue;
}

int RankRun::CheckOutputFiles() const {
  std::string error;
  if (world_rank_ == 0) {
    for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{
                                         "--summary", options_.summary_path},
                                     {"--trace", options_.trace_path}}) {
      if (path.empty()) continue;
      if (const std::string why = OutputFileError(path); !why.empty()) {
        error = fmt::format("{}: {}", flag, why);
        break;
      }
    }
  }
  std::vector<std::string> lines;  // rank 0's alone: its error line says it without a rank
  if (GatherErrors(error, &lines)) return Usage("command line", error);
  return kContinue;
}

int RankRun::MakeBackend() {
  BackendOrStatus made = factory_(options_);
  std::vector<std::string> lines;
  if (GatherErrors(made.ok() ? std::string() : made.status().Message(), &lines)) {
    for (const std::string& line : lines) err_ << "error: " << EscapeControl(line) << '\n';
    return kExitUsage;
  }
  backend_ = std::move(made).value();
  if (options_.backend == "cpu") return kContinue;
  const std::optional<DeviceMemory> memory = backend_->Memory();
  std::string error;
  if (memory) {
    const Status fits = CheckDeviceMemory(plan_, *memory);
    if (!fits.ok()) error = fits.Message();
  } else {
    error = PreflightError(plan_);  // a plugin whose tensors live in host memory
  }
  if (GatherErrors(error, &lines)) return Refused(options_.config_path, lines);
  return kContinue;
}

int RankRun::Report(const Topology& topology, SimulationResult& result, const DumpTarget& dump) {
  RunReport report(out_, options_, config_, effective_config_, world_rank_, world_size_,
                   backend_->name(), backend_->Describe());
  report.PrintLayout(topology, result);
  // Megatron's own t-fold gradients (docs/simulator.md, "Warnings"): the run computes them as
  // Megatron does, and says here, before the check fails on them, why.
  for (const std::string& warning : warnings_) {
    out_ << "warning: " << EscapeControl(warning) << '\n';
  }
  report.PrintLoss(result);
  int code = kExitOk;
  const int iteration_failures = report.PrintTraining(result);
  if (options_.check && report.PrintChecks(result.check, result) > 0) code = kExitCheckFailed;
  if (iteration_failures > 0) code = kExitCheckFailed;
  // The paths were checked before the run; should a write fail all the same (a full disk),
  // rank 0 says so and exits 2 after the collective steps below, which every rank takes.
  int output_code = kContinue;
  // Every file the run writes is named as it is written.
  if (!options_.summary_path.empty() && world_rank_ == 0) {
    const Status written = report.WriteSummary(result, code);
    if (!written.ok()) {
      output_code = Usage("command line", "--summary: " + written.Message());
    } else {
      out_ << fmt::format("\nsummary: {}\n", options_.summary_path);
    }
  }
  if (!options_.trace_path.empty() && world_rank_ == 0) {
    const Status written = report.WriteTrace(topology, result);
    if (!written.ok()) {
      output_code = Usage("command line", "--trace: " + written.Message());
    } else {
      out_ << fmt::format("\ntrace: {} ({})\n", options_.trace_path,
                          options_.trace_path.ends_with(".html")
                              ? "a page of its own: open it in a browser"
                              : "Chrome trace events: open it in ui.perfetto.dev");
    }
  }
  report.PrintCommTrace(result.trace);
  if (!options_.dump_dir.empty()) {
    DumpTarget target = dump;
    target.backend = backend_->name();
    std::vector<std::string> lines;
    const Status written =
        WriteDump(target, result.coords, result.records,
                  [&](const TensorRecord& r) {
                    return r.tensor.device() == Device::kHost ? r.tensor
                                                              : backend_->kernels().ToHost(r.tensor);
                  },
                  ErrorBudgets(result.check), &lines);
    result.records.clear();
    if (!written.ok()) {
      if (lines.empty()) return Usage("command line", written.Message());
      for (const std::string& line : lines) err_ << "error: " << EscapeControl(line) << '\n';
      return kExitUsage;
    }
    out_ << fmt::format("\ndump: {} ({} files + manifest.json)\n", options_.dump_dir,
                        world_size_);
  }
  if (!result.parameter_split.empty()) report.PrintParameterMemory(result);
  report.PrintStepNotes(result);
  report.PrintTensorBytes(result);
  report.PrintMemory(plan_.total);
  return output_code != kContinue ? output_code : code;
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
  // SIGINT and SIGTERM are recorded from here on and acted on at the run's safe points.
  std::optional<InterruptHandlers> interrupt_handlers;
  interrupt_handlers.emplace();
  try {
    // Before the first communication: the watchdog's timeout and its test hook (MPUSIM_FAULT,
    // mpi/watchdog.h); a malformed hook is bad input, reported once.
    SetCommTimeout(options.timeout_s);
    const Status fault = ArmFaultInjection();
    std::vector<std::string> lines;
    if (GatherErrors(fault.ok() ? std::string() : fault.Message(), &lines)) {
      for (const std::string& line : lines) err << "error: " << line << '\n';
      code = kExitUsage;
    } else {
      RankRun run(options, out, err, world_rank, world_size, factory);
      code = run.Run();
    }
  } catch (const std::bad_alloc&) {
    // Past the preflight (run/preflight.h), memory ran out anyway: other processes, or an
    // estimate too low. End the whole job with the out-of-memory exit code.
    AbortJob(fmt::format("error: rank {}: out of memory: an allocation failed after the "
                         "preflight accepted the run; free memory or shrink the run",
                         world_rank),
             kExitOutOfMemory);
  } catch (const std::exception& e) {
    // A bug or an unexpected failure on one rank: end the whole job rather than leave the
    // other ranks waiting in a collective.
    AbortJob(fmt::format("error: rank {}: internal error: {}", world_rank, e.what()),
             kExitInternalError);
  }
  code = AgreeOnWorst(code);
  // A signal after the last safe point (while the report and the outputs were written, each
  // of them whole) still ends the run with its exit code, never 0 or 1.
  if (code < kExitInterrupted) {
    if (const Interrupt late = AgreeOnInterrupt()) {
      if (world_rank == 0) {
        err << InterruptLine(late, "at the end of the run", "what it wrote is whole") << '\n';
      }
      code = InterruptExitCode(late);
    }
  }
  // Once every rank has its code, a signal ends the process: when the first rank exits
  // non-zero mpirun sends SIGTERM to the rest, and one still finalising would otherwise ignore
  // it until mpirun kills it 1 s later.
  interrupt_handlers.reset();
  if (initialized == 0) FinalizeWatched();
  return code;
}

}  // namespace mpusim::run