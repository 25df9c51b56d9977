// `mpusim sweep CONFIG --world-size N`: every valid layout of one GPT model on N ranks, each
// run with mpiexec and checked against the float64 reference, in one table.
//
// What it is: the layouts are every tp x cp x pp (x vp 2) x dp factorisation of N (cp > 1 for
// the GPT only, with the config's cp_comm_type; for an MoE GPT also every ep dividing dp x cp
// and the number of experts), with and
// without sequence parallelism, with and without the distributed optimizer (a training config
// with dp > 1), that the model can be split into (BuildModel: the model's own layout checks, the
// planner's layer assignment and schedule); each runs as `mpiexec -n N mpusim run` on a copy
// of the config with that parallel section, the config's num_microbatches M and its B =
// micro_batch_size * dp samples per micro-batch (micro_batch_size B / dp for the layout), so
// every layout trains on the same data (micro-batch m's samples 0..B-1 of its stream). The table
// gives each layout's final loss, the largest deviation of its loss curve from the reference's, the
// largest normalized error of a final parameter, the check's verdict, the median time per iteration,
// rank 0's peak of live stashes and the stored reference it was checked against: each distinct
// reference (the layouts whose values agree share one, run/stored_reference.h) is computed once,
// by `mpusim reference`, and every layout's run reads it (`mpusim run --reference`). Exit 0 when every layout passes, 1 when one fails or cannot
// run, 2 for bad input. What it is not: a benchmark (the layouts share this machine's cores).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "core/config/config.h"
#include "core/config/gpt_config.h"
#include "core/config/model_facts.h"
#include "core/dump/safetensors.h"
#include "core/layout_space.h"
#include "core/model/model.h"
#include "core/schedule.h"
#include "core/topology.h"
#include "run/stored_reference.h"

namespace mpusim::cli {
namespace {

using nlohmann::json;

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;

// Why `document` cannot run, or "".
std::string LayoutProblem(const json& document) {
  Config config;
  Status s = ParseConfig(document, &config);
  if (!s.ok()) return s.Message();
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  if (!topology.ok()) return topology.status().Message();
  const auto vp = config.parallel.virtual_pipeline_model_parallel_size;
  // Whatever the model refuses for this layout (shapes, states, stages, ties).
  StatusOr<std::unique_ptr<Model>> model = BuildModel(config, *topology, topology->Coordinates(0));
  if (!model.ok()) return model.status().Message();
  StatusOr<PipelineSchedule> schedule = BuildPipelineSchedule(
      config.parallel.pipeline_model_parallel_size, vp, config.run->num_microbatches,
      config.parallel.microbatch_group_size_per_vp_stage);
  if (!schedule.ok()) return schedule.status().Message();
  return "";
}

// Whether the model of `document` (a layout that runs) draws layout-dependent dropout masks.
bool MasksDependOnLayout(const json& document) {
  Config config;
  if (!ParseConfig(document, &config).ok()) return false;
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  if (!topology.ok()) return false;
  StatusOr<std::unique_ptr<Model>> model = BuildModel(config, *topology, topology->Coordinates(0));
  return model.ok() && (*model)->MasksDependOnLayout();
}

class SweepCommand final : public Command {
 public:
  explicit SweepCommand(CLI::App* parent) {
    app_ = parent->add_subcommand(
        "sweep",
        "Run every valid layout of a config (the GPT model or a layer chain) on N ranks and "
        "check each against the float64 reference");
    app_->footer(
        "Each layout runs as `mpiexec -n N --oversubscribe mpusim run`. Exit codes: 0 "
        "every layout passes, 1 one fails or cannot run, 2 bad input.");
    app_->add_option("CONFIG", config_path_, "a config with a model and a run section")->required();
    app_->add_option("--world-size,-n", world_size_, "ranks of every layout")
        ->required()
        ->check(CLI::Range(1, 64));
    app_->add_option("--train-iters", train_iters_,
                     "override run.train_iters (with an optimizer section)")
        ->check(CLI::Range(1, 100000));
    app_->add_option("--mpiexec", mpiexec_, "the MPI launcher; default " MPUSIM_MPIEXEC);
    app_->add_flag_callback("--no-check", [this] { check_ = false; },
                            "run every layout without the float64 check: how long the layouts "
                            "themselves take (bench/sweep_reference.sh compares the two)");
  }
  CLI::App* app() override { return app_; }

  int Run(std::ostream& out, std::ostream& err) override {
    StatusOr<json> read = ReadJsonFile(config_path_);
    if (!read.ok()) return ReportError(err, config_path_, read.status().Message());
    json base = std::move(read).value();
    Config config;
    if (const Status s = ParseConfig(base, &config); !s.ok()) {
      return ReportError(err, config_path_, s.Message());
    }
    if (!config.has_model() || !config.run) {
      return ReportError(err, config_path_,
                         !config.has_model()
                             ? "model: is required by mpusim sweep"
                             : "run: is required by mpusim sweep (its data and dtype)");
    }
    if (train_iters_) {
      if (!config.optimizer) {
        return ReportError(err, "--train-iters", "needs an \"optimizer\" section in the config");
      }
      base["run"]["train_iters"] = *train_iters_;
    }
    // The same samples for every layout: B per micro-batch, M micro-batches.
    StatusOr<Topology> topology = Topology::Create(config.parallel);
    if (!topology.ok()) return ReportError(err, config_path_, topology.status().Message());
    samples_ = config.run->micro_batch_size * topology->sizes().dp;
    base["run"]["num_microbatches"] = config.run->num_microbatches;
    base["run"].erase("global_batch_size");
    std::vector<Layout> layouts;
    std::vector<std::string> skipped;
    const ModelFacts facts = FactsOf(config);
    ListLayouts(base, config.optimizer.has_value(), facts.has_attention(),
                facts.moe.enabled() ? facts.moe.num_experts : 0, &layouts, &skipped);
    if (layouts.empty()) {
      return ReportError(err, config_path_,
                         fmt::format("no layout of {} ranks can run this model (e.g. {})",
                                     world_size_, skipped.empty() ? "-" : skipped.front()));
    }
    out << fmt::format(
        "mpusim sweep: {} on {} ranks: {} layouts ({} skipped), {} micro-batches "
        "of {} samples\n",
        config_path_, world_size_, layouts.size(), skipped.size(), config.run->num_microbatches,
        samples_);
    for (const std::string& s : skipped) out << "  skipped " << s << '\n';
    // The layout column: 31 wide, or the longest name's width (ep, sp and dist-opt together).
    for (const Layout& l : layouts) name_width_ = std::max(name_width_, l.Name().size());
    out << fmt::format("  {:<{}} {:>14} {:>16} {:>12} {:>8} {:>10} {:>7} {:>4}\n", "layout",
                       name_width_, "final loss", "max |loss-ref|", "param err", "check",
                       "s/iter", "stashes", "ref");
    out.flush();
    char self[4096] = {};
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    const std::string exe = n > 0 ? std::string(self, static_cast<size_t>(n)) : "mpusim";
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() / fmt::format("mpusim_sweep.{}", ::getpid());
    std::filesystem::create_directories(dir);
    int failures = 0;
    // Final losses agree between layouts that pad the vocabulary alike (the padded logits
    // take part in the softmax, so another padding is another model).
    std::map<int64_t, std::pair<double, double>> losses;  // padded vocab -> (min, max)
    // Progress: each layout's row as soon as it is done, and on a terminal a line on stderr
    // saying which layout runs and how long the sweep has taken (rewritten in place).
    const bool terminal = isatty(STDERR_FILENO) == 1;
    const auto started = std::chrono::steady_clock::now();
    for (size_t i = 0; i < layouts.size(); ++i) {
      if (terminal) {
        const double elapsed =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
        err << fmt::format("\r  running layout {} of {} ({}), {:.0f} s so far\x1b[K", i + 1,
                           layouts.size(), layouts[i].Name(), elapsed)
            << std::flush;
      }
      const std::optional<bool> passed =
          RunLayout(i, layouts[i], base, dir, exe, out, err, &losses);
      if (terminal) err << "\r\x1b[K" << std::flush;
      out << std::flush;
      if (!passed) return kExitUsage;
      if (!*passed) ++failures;
    }
    std::filesystem::remove_all(dir);
    std::vector<std::string> agreement;
    for (const auto& [padded, range] : losses) {
      agreement.push_back(losses.size() == 1
                              ? fmt::format("{:.3g}", range.second - range.first)
                              : fmt::format("{:.3g} among the layouts with padded_vocab_size {}",
                                            range.second - range.first, padded));
    }
    out << fmt::format(
        "{} of {} layouts {}; final losses agree to {}\n",
        layouts.size() - static_cast<size_t>(failures), layouts.size(), check_ ? "pass" : "ran",
        agreement.empty() ? std::string("-") : fmt::format("{}", fmt::join(agreement, ", ")));
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (check_) {
      out << fmt::format(
          "  references: {} computed and stored ({:.1f} s in all), each layout checked against "
          "the one of its model, data and values (column ref; mpusim reference, mpusim run "
          "--reference); the sweep took {:.1f} s\n",
          labels_.size(), reference_seconds_, took);
    } else {
      out << fmt::format("  (--no-check: no layout was checked; the sweep took {:.1f} s)\n", took);
    }
    if (MasksDependOnLayout(Document(base, layouts.front()))) {
      out << "  (the dropout masks come from each rank's RNG tracker, as Megatron's do, so the "
             "losses differ between layouts; each layout is checked against the reference "
             "drawing the same masks)\n";
    }
    if (facts.moe.enabled() && config.optimizer) {
      out << "  (the MoE router's load-balancing counts and capacity are per data-parallel "
             "rank, as in Megatron, so layouts with another dp x cp train a different model "
             "after the first iteration; each is checked against the reference with its "
             "split)\n";
    }
    if (losses.size() > 1) {
      out << "  (layouts that pad the vocabulary differently train different models: the "
             "padded logits take part in the softmax; make vocab_size a multiple of "
             "make_vocab_size_divisible_by * the largest tp to compare them all)\n";
    }
    return failures > 0 ? kExitFailed : kExitOk;
  }

 private:
  // `base` with layout `l` written in (its parallel section, the distributed optimizer, and
  // the micro-batch size that keeps B samples per micro-batch where dp divides B).
  json Document(const json& base, Layout l) const {
    json document = base;
    l.micro_batch_size = l.dp > 0 && samples_ % l.dp == 0 ? samples_ / l.dp : 0;
    WriteLayout(l, world_size_, &document);
    return document;
  }

  // The layout space (core/layout_space.h) of world_size_ ranks as the sweep searches it:
  // every tp x cp x pp (x vp 2) x dp (cp > 1 only for a model `has_attention`: a sequence for
  // context parallelism to split), with and without sequence
  // parallelism and the distributed optimizer (with `has_optimizer` and dp x cp > 1), and for
  // a model with `experts` every ep dividing dp x cp and the experts, each also with whole
  // experts (etp 1) where tp > 1: those the model accepts into `layouts`, the others into
  // `skipped` with the reason.
  void ListLayouts(const json& base, bool has_optimizer, bool has_attention, int64_t experts,
                   std::vector<Layout>* layouts_out, std::vector<std::string>* skipped_out) const {
    LayoutSpace space;
    space.world_size = world_size_;
    space.max_cp = has_attention ? 0 : 1;
    space.virtual_pipeline = LayoutSpace::VirtualPipeline::kTwo;
    space.has_optimizer = has_optimizer;
    space.distributed_optimizer_needs_sharding = true;
    space.num_experts = experts;
    space.whole_experts = true;
    for (const Layout& l : EnumerateLayouts(space)) {
      const std::string problem =
          samples_ % l.dp != 0
              ? fmt::format("{} samples per micro-batch do not split over dp {}", samples_, l.dp)
              : LayoutProblem(Document(base, l));
      if (problem.empty()) {
        layouts_out->push_back(l);
      } else {
        skipped_out->push_back(fmt::format("{}: {}", l.Name(), problem));
      }
    }
  }

  // Runs layout `i` (`l`) as `mpiexec -n N mpusim run` in `dir` and prints its row; adds its
  // final loss to `losses` (by padded vocabulary). Returns whether it passed, or nullopt
  // (reported on `err`) when its config cannot be written.
  std::optional<bool> RunLayout(size_t i, const Layout& l, const json& base,
                                const std::filesystem::path& dir, const std::string& exe,
                                std::ostream& out, std::ostream& err,
                                std::map<int64_t, std::pair<double, double>>* losses) {
    const std::string config_file = (dir / fmt::format("layout{}.json", i)).string();
    const std::string summary_file = (dir / fmt::format("layout{}.summary.json", i)).string();
    const std::string log_file = (dir / fmt::format("layout{}.log", i)).string();
    const json document = Document(base, l);
    if (const Status s = WriteFileAtomically(config_file, document.dump(1)); !s.ok()) {
      ReportError(err, config_file, s.Message());
      return std::nullopt;
    }
    const std::string reference =
        check_ ? StoredReference(document, config_file, dir, exe) : "";
    const std::string command = fmt::format(
        "{} -n {} --oversubscribe {} run {} --summary {}{} > {} 2>&1", ShellQuote(mpiexec_),
        world_size_, ShellQuote(exe), ShellQuote(config_file), ShellQuote(summary_file),
        !check_             ? std::string(" --no-check")
        : reference.empty() ? std::string()
                            : " --reference " + ShellQuote(reference),
        ShellQuote(log_file));
    const int status = std::system(command.c_str());
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream summary_in(summary_file);
    json summary;
    if (summary_in) summary = json::parse(summary_in, nullptr, false);
    if ((code != 0 && code != 1) || !summary.is_object()) {
      std::ifstream log_in(log_file);
      std::stringstream log;
      log << log_in.rdbuf();
      const std::string text = log.str();
      out << fmt::format("  {:<{}} FAIL: mpusim run exited {}: {}\n", l.Name(), name_width_,
                         code,
                         text.substr(text.size() > 400 ? text.size() - 400 : 0));
      return false;
    }
    double deviation = 0;
    for (const json& it : summary["iterations"]) {
      if (it.contains("reference_loss")) {
        deviation = std::max(
            deviation, std::fabs(it["loss"].get<double>() - it["reference_loss"].get<double>()));
      }
    }
    if (summary["iterations"].empty() && summary.contains("check")) {
      deviation = std::fabs(summary["loss"].get<double>() -
                            summary["check"]["reference_loss"].get<double>());
    }
    const double loss = summary["loss"].get<double>();
    const int64_t padded = summary.value("padded_vocab_size", int64_t{0});
    const auto range = losses->try_emplace(padded, loss, loss).first;
    range->second = {std::min(range->second.first, loss), std::max(range->second.second, loss)};
    const bool passed = code == 0 && summary["passed"].get<bool>();
    const double seconds = summary["seconds_median"].get<double>();
    const auto label = labels_.find(reference);
    const bool checked = summary.contains("check");
    out << fmt::format(
        "  {:<{}} {:>14.10g} {:>16} {:>12} {:>8} {:>10.3f} {:>7} {:>4}\n", l.Name(), name_width_,
        loss, checked ? fmt::format("{:.3g}", deviation) : "-",
        checked ? fmt::format("{:.3g}",
                              summary["check"]["max_parameter_normalized_error"].get<double>())
                : "-",
        !passed ? "FAIL" : checked ? "pass" : "ran", seconds,
        summary["peak_stashes_rank0"].get<int64_t>(),
        label != labels_.end() ? label->second : "-");
    if (!passed) PrintFailures(log_file, out);
    out.flush();
    return passed;
  }

  // The stored reference layout `document` (written to `config_file`) is checked against: the
  // one of the same identity (run/stored_reference.h) if an earlier layout made it, else a new
  // one computed now with `mpusim reference` into `dir`. "" when it cannot be made (the layout's
  // run then computes its own, and says why it cannot run if it cannot).
  std::string StoredReference(const json& document, const std::string& config_file,
                              const std::filesystem::path& dir, const std::string& exe) {
    Config config;
    if (!ParseConfig(document, &config).ok() || !config.run) return "";
    const StatusOr<json> identity =
        run::ReferenceIdentity(EffectiveConfigJson(document, config), config);
    if (!identity.ok()) return "";
    const std::string key = identity->dump();
    if (const auto it = references_.find(key); it != references_.end()) return it->second;
    const std::string label = fmt::format("r{}", references_.size() + 1);
    const std::string folder = (dir / ("reference." + label)).string();
    const auto start = std::chrono::steady_clock::now();
    const std::string command = fmt::format(
        "{} -n {} --oversubscribe {} reference {} --out {} > {} 2>&1", ShellQuote(mpiexec_),
        world_size_, ShellQuote(exe), ShellQuote(config_file), ShellQuote(folder),
        ShellQuote(folder + ".log"));
    const int status = std::system(command.c_str());
    reference_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const bool made = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    references_[key] = made ? folder : "";
    if (made) labels_[folder] = label;
    return references_[key];
  }

  // Below a failed layout's row: the lines of its run's output that say what failed (a check's
  // FAIL, an error), at most kShown of them, so that a sweep's FAIL carries its reason.
  static void PrintFailures(const std::string& log_file, std::ostream& out) {
    constexpr int kShown = 6;
    std::ifstream log(log_file);
    std::string line;
    int shown = 0, more = 0;
    while (std::getline(log, line)) {
      if (line.find("FAIL") == std::string::npos && line.find("error") == std::string::npos) {
        continue;
      }
      if (shown == kShown) {
        ++more;
        continue;
      }
      const size_t begin = line.find_first_not_of(' ');
      out << "      " << EscapeControl(line.substr(begin == std::string::npos ? 0 : begin))
          << '\n';
      ++shown;
    }
    if (more > 0) out << fmt::format("      ({} more such lines)\n", more);
  }

  CLI::App* app_ = nullptr;
  size_t name_width_ = 31;
  std::string config_path_;
  int64_t world_size_ = 1;
  std::optional<int64_t> train_iters_;
  int64_t samples_ = 1;  // B: samples per micro-batch over all dp ranks
  std::string mpiexec_ = MPUSIM_MPIEXEC;
  // The stored references: identity -> folder ("" when it could not be made), folder -> label.
  std::map<std::string, std::string> references_;
  std::map<std::string, std::string> labels_;
  double reference_seconds_ = 0;
  bool check_ = true;
};

}  // namespace

std::unique_ptr<Command> MakeSweepCommand(CLI::App* parent) {
  return std::make_unique<SweepCommand>(parent);
}

}  // namespace mpusim::cli
