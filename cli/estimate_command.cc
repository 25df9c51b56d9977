// `mpusim estimate`: what each pipeline stage's busiest rank holds before its first step,
// from the config alone (core/estimate/memory_estimate.h): its parameters, main_grad and
// optimizer state, the last both with the plain and with the distributed optimizer. Nothing
// is allocated, so a model of any size on any layout answers at once; `mpusim run --summary`
// measures the same bytes, and the MemoryEstimate tests require them equal on every rank.
// `--format json` gives the numbers in bytes for scripts.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/config_options.h"
#include "core/estimate/memory_estimate.h"
#include "core/topology.h"
#include "run/preflight.h"

namespace mpusim::cli {
namespace {

// A byte count for JSON: exact below 2^64 (every count here is far below; the counts saturate
// at 2^100, core/memory_plan.h).
nlohmann::ordered_json Bytes(PlanBytes bytes) {
  if (bytes < (PlanBytes{1} << 64)) return static_cast<uint64_t>(bytes);
  return static_cast<double>(bytes);
}

// "tp 2 · pp 2 · dp 2": the axes of the layout larger than 1 (all 1: "one rank").
std::string LayoutText(const DerivedSizes& s) {
  std::vector<std::string> parts;
  const auto add = [&](const char* name, int64_t size) {
    if (size > 1) parts.push_back(fmt::format("{} {}", name, size));
  };
  add("tp", s.tp);
  add("pp", s.pp);
  if (s.vp) add("vp", *s.vp);
  add("cp", s.cp);
  add("dp", s.dp);
  add("ep", s.ep);
  if (s.etp != s.tp) parts.push_back(fmt::format("etp {}", s.etp));
  return parts.empty() ? "one rank" : fmt::format("{}", fmt::join(parts, " · "));
}

// The estimate with the optimizer the other way (plain <-> distributed), for the comparison.
Config WithDistributedOptimizer(Config config, bool distributed) {
  config.optimizer->use_distributed_optimizer = distributed;
  return config;
}

class EstimateCommand : public Command {
 public:
  explicit EstimateCommand(CLI::App* parent) {
    app_ = parent->add_subcommand(
        "estimate", "Estimate the memory each pipeline stage's busiest rank holds, from the "
                    "config alone");
    app_->footer(
        "Examples:\n"
        "  mpusim estimate sample_configs/gpt_train_adam_p2_t2_n4.json\n"
        "  mpusim estimate sample_configs/gpt3_175b_t8_p16_n1024.json --tp 4 --pp 32\n"
        "  mpusim estimate CONFIG --format json\n"
        "Counts parameters (storage dtype), main_grad and optimizer state (compute dtype) per\n"
        "rank, exactly as `mpusim run` allocates them; activations, communication buffers and\n"
        "step time are not estimated yet.");
    config_.Register(app_);
    app_->add_option("--format", format_, "text or json (default text)")
        ->check(CLI::IsMember({"text", "json"}));
  }
  CLI::App* app() override { return app_; }

  int Run(std::ostream& out, std::ostream& err) override {
    std::optional<ConfigOptions::Layout> layout =
        config_.ResolveModelLayout(err, "estimate", "it counts the model's parameters");
    if (!layout) return kExitUsage;
    std::string source;
    Config config = layout->config;
    const Topology& topology = layout->topology;
    // What a rank holds before its first step does not depend on the data.
    const bool run_given = FillMissingRun(&config, topology);
    StatusOr<std::vector<StageHeldMemory>> stages = EstimateStageHeldMemory(config, topology);
    if (!stages.ok()) {
      return ReportError(err, source, config_.Attribute(stages.status(), &source).Message());
    }
    // The optimizer state the other way, stage by stage.
    std::vector<PlanBytes> other_optimizer;
    if (config.optimizer) {
      StatusOr<std::vector<StageHeldMemory>> other = EstimateStageHeldMemory(
          WithDistributedOptimizer(config, !config.optimizer->use_distributed_optimizer),
          topology);
      if (!other.ok()) {
        return ReportError(err, source, config_.Attribute(other.status(), &source).Message());
      }
      for (const StageHeldMemory& s : *other) other_optimizer.push_back(s.held.optimizer);
    }
    if (format_ == "json") {
      PrintJson(config, topology, *stages, other_optimizer, out);
    } else {
      PrintText(config, topology, run_given, *stages, other_optimizer, out);
    }
    return kExitOk;
  }

 private:
  void PrintText(const Config& config, const Topology& topology, bool run_given,
                 const std::vector<StageHeldMemory>& stages,
                 const std::vector<PlanBytes>& other_optimizer, std::ostream& out) const {
    const DType storage = config.run->dtype;
    const DType compute = ComputeDType(storage);
    out << fmt::format("Memory estimate: {} ranks ({}), parameters in {}{}\n",
                       topology.world_size(), LayoutText(topology.sizes()), DTypeName(storage),
                       run_given ? "" : " (no run section)");
    std::string optimizer_text = "no optimizer section: main_grad only, no optimizer state";
    if (config.optimizer) {
      const bool adam = config.optimizer->kind == OptimizerConfig::Kind::kAdam;
      optimizer_text = fmt::format(
          "main_grad and {} ({}) in {}, {}", adam ? "Adam" : "SGD",
          adam ? "master weights, exp_avg, exp_avg_sq" : "master weights, momentum",
          DTypeName(compute),
          config.optimizer->use_distributed_optimizer
              ? fmt::format("distributed optimizer ({} instance{})",
                            topology.sizes().num_distributed_optimizer_instances,
                            topology.sizes().num_distributed_optimizer_instances == 1 ? ""
                                                                                      : "s")
              : std::string("plain optimizer (every dp rank keeps all of it)"));
    }
    out << optimizer_text << '\n';
    out << "Held before the first step, by each pipeline stage's busiest rank:\n";
    const bool compare = !other_optimizer.empty();
    const std::string other_name = config.optimizer && config.optimizer->use_distributed_optimizer
                                       ? "plain optimizer"
                                       : "distributed optimizer";
    out << fmt::format("  {:>5}  {:>5}  {:>12}  {:>12}  {:>12}  {:>12}", "stage", "rank",
                       "parameters", "gradients", "optimizer", "held");
    if (compare) out << fmt::format("  | {} held", other_name);
    out << '\n';
    for (size_t i = 0; i < stages.size(); ++i) {
      const StageHeldMemory& s = stages[i];
      out << fmt::format("  {:>5}  {:>5}  {:>12}  {:>12}  {:>12}  {:>12}", s.stage, s.rank,
                         run::FormatBytes(s.held.parameters), run::FormatBytes(s.held.gradients),
                         run::FormatBytes(s.held.optimizer), run::FormatBytes(s.held.total()));
      if (compare) {
        const PlanBytes other_total =
            SaturatingAdd(SaturatingAdd(s.held.parameters, s.held.gradients), other_optimizer[i]);
        out << fmt::format("  | {} (optimizer {})", run::FormatBytes(other_total),
                           run::FormatBytes(other_optimizer[i]));
      }
      out << '\n';
    }
    out << "Not estimated yet: activations at the schedule's peak, communication buffers, "
           "what a GPU adds (cuBLAS workspaces, NCCL buffers, allocator slack), step time.\n";
  }

  static void PrintJson(const Config& config, const Topology& topology,
                        const std::vector<StageHeldMemory>& stages,
                        const std::vector<PlanBytes>& other_optimizer, std::ostream& out) {
    nlohmann::ordered_json doc;
    doc["world_size"] = topology.world_size();
    doc["dtype"] = std::string(DTypeName(config.run->dtype));
    doc["main_grad_dtype"] = std::string(DTypeName(ComputeDType(config.run->dtype)));
    const bool distributed = config.optimizer && config.optimizer->use_distributed_optimizer;
    doc["optimizer"] = !config.optimizer ? nlohmann::ordered_json(nullptr)
                       : config.optimizer->kind == OptimizerConfig::Kind::kAdam
                           ? nlohmann::ordered_json("adam")
                           : nlohmann::ordered_json("sgd");
    doc["use_distributed_optimizer"] = distributed;
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (size_t i = 0; i < stages.size(); ++i) {
      const StageHeldMemory& s = stages[i];
      nlohmann::ordered_json stage;
      stage["stage"] = s.stage;
      stage["rank"] = s.rank;
      stage["memory"] = {{"parameters", Bytes(s.held.parameters)},
                         {"gradients", Bytes(s.held.gradients)},
                         {"optimizer", Bytes(s.held.optimizer)},
                         {"held", Bytes(s.held.total())}};
      stage["parameter_elements"] = Bytes(s.held.parameter_elements);
      if (!other_optimizer.empty()) {
        stage[distributed ? "optimizer_if_plain" : "optimizer_if_distributed"] =
            Bytes(other_optimizer[i]);
      }
      list.push_back(stage);
    }
    doc["stages"] = list;
    doc["not_estimated"] = {"activations", "buffers", "peak", "step_time_s"};
    out << doc.dump(1) << '\n';
  }

  CLI::App* app_ = nullptr;
  ConfigOptions config_;
  std::string format_ = "text";
};

}  // namespace

std::unique_ptr<Command> MakeEstimateCommand(CLI::App* parent) {
  return std::make_unique<EstimateCommand>(parent);
}

}  // namespace mpusim::cli
