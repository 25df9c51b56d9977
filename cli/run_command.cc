// `mpusim run`: the run driver (run/runner.h) behind the command line, on the CPU backend
// (linked in) or a backend plugin (loaded only when asked for, run/backend_plugin.h).
#include <cmath>
#include <cstdlib>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/config_options.h"
#include "run/backend_plugin.h"
#include "run/preflight.h"
#include "run/runner.h"
#include "sim/cpu_backend.h"

namespace mpusim::cli {
namespace {

BackendOrStatus MakeBackend(const run::RunOptions& options) {
  if (options.backend == "cpu") return std::unique_ptr<Backend>(new CpuBackend());
  return run::LoadBackendPlugin(options.backend, BackendOptions{options.comm});
}

struct OverrideFlag {
  const char* flag;
  const char* key;
  const char* help;
  std::vector<std::string> choices = {};  // a string value, one of these; empty: an integer
  bool boolean = false;  // the choices are true and false, a JSON boolean (not a string)
};
// The model's keys `run` overrides; the layout's, the optimizer's and the run's are their
// tables' flags (cli/config_options.h ConfigFlags, RunFlags).
const OverrideFlag kOverrides[] = {
    {"--cp-comm-type",
     "model.cp_comm_type",
     "override model.cp_comm_type (context parallelism): p2p, all_gather, a2a or a2a+p2p",
     {"p2p", "all_gather", "a2a", "a2a+p2p"}},
    {"--moe-token-dispatcher",
     "model.moe_token_dispatcher_type",
     "override model.moe_token_dispatcher_type (mixture of experts): allgather or alltoall",
     {"allgather", "alltoall"}},
    {"--moe-router-enable-expert-bias",
     "model.moe_router_enable_expert_bias",
     "override model.moe_router_enable_expert_bias (aux-loss-free balancing, with the sigmoid "
     "router): true or false",
     {"true", "false"},
     true},
};

class RunCommand : public Command {
 public:
  // `store`: the `reference` command (compute and store the float64 reference alone).
  RunCommand(CLI::App* parent, std::string command_line, bool store) {
    options_.command_line = std::move(command_line);
    if (store) {
      app_ = parent->add_subcommand(
          "reference", "Compute the float64 reference of a config's model once, on MPI ranks "
                       "(split as mpusim run splits it), and store it in a folder: mpusim run "
                       "--reference and mpusim sweep then check against it instead of computing "
                       "it again");
      app_->footer(
          "Launch like mpusim run, e.g.\n"
          "  mpirun -n 8 --oversubscribe mpusim reference sample_configs/gpt_sweep_l4_n8.json "
          "--out ref/\n"
          "  mpirun -n 8 --oversubscribe mpusim run sample_configs/gpt_sweep_l4_n8.json "
          "--reference ref/\n"
          "A stored reference serves every run of the same model, data and iterations whose "
          "layout gives the same values (the padded vocabulary, an MoE model's routing groups, "
          "per-rank dropout masks); another is refused in one line naming the first difference.");
      app_->add_option("CONFIG", options_.config_path, "config file with parallel, model, run")
          ->required();
      app_->add_option("--out", options_.store_reference_dir,
                       "the folder to store it in (made if missing; must be empty)")
          ->type_name("DIR")
          ->required();
      AddOverrideFlags();
      AddLimits();
      return;
    }
    app_ = parent->add_subcommand(
        "run", "Run a config's model (a layer chain or a GPT; tp, sp, cp, pp, vp, dp, the "
               "distributed optimizer, training) on MPI ranks (one rank = one GPU) and check "
               "every tensor against the float64 reference");
    app_->footer(
        "Launch with one MPI rank per GPU of the config's world_size, e.g.\n"
        "  mpirun -n 8 --oversubscribe mpusim run sample_configs/lab_mlp_lm_t4_dp2_n8.json\n"
        "Exit codes: 0 every tensor matches the reference, 1 a mismatch, 2 bad input, 3 out of "
        "memory, 4 an internal error,\n130 / 143 interrupted by SIGINT / SIGTERM (every rank "
        "stops at the next safe point and nothing is written;\nOpen MPI's mpirun exits 1 when "
        "it is itself interrupted).");
    app_->add_option("CONFIG", options_.config_path, "config file with parallel, model, run")
        ->required();
    app_->add_option("--dump", options_.dump_dir,
                     "write every rank's tensors to DIR/rankNNNNN.safetensors + manifest.json")
        ->type_name("DIR");
    app_->add_flag_callback("--no-check", [this] { options_.check = false; },
                            "skip the float64 reference check");
    app_->add_option("--reference", options_.reference_dir,
                     "check against the float64 reference stored in DIR by mpusim reference "
                     "instead of computing it (same verdict and numbers; a reference of another "
                     "model, data or layout is refused)")
        ->type_name("DIR");
    app_->add_option("--summary", options_.summary_path,
                     "write the results to FILE as JSON (loss, iterations, the check's counts "
                     "and largest parameter error, time, peak stashes, the last step's timeline): "
                     "what mpusim sweep reads")
        ->type_name("FILE");
    app_->add_option("--trace", options_.trace_path,
                     "write the last step to FILE as Chrome trace events (open in "
                     "ui.perfetto.dev or chrome://tracing): a track per rank, a slice per "
                     "forward/backward step and per collective or send/receive; a FILE "
                     "ending in .html is a self-contained page drawing them, for offline use")
        ->type_name("FILE");
    AddOverrideFlags();
    app_->add_option("--backend", options_.backend,
                     "cpu (Eigen/OpenBLAS + MPI) or cuda (CUDA/cuBLAS + NCCL, loaded from the "
                     "plugin libmpusim_backend_cuda.so next to the program); default cpu")
        ->check(CLI::IsMember({"cpu", "cuda"}));
    app_->add_option("--comm", options_.comm,
                     "cuda backend collectives: nccl (one GPU per rank) or mpi (host-staged, "
                     "several ranks may share a GPU); default nccl")
        ->check(CLI::IsMember({"nccl", "mpi"}));
    app_->add_option("--repeat", options_.repeat,
                     "run the step N times, each from zero gradients, and print the median time "
                     "(benchmarks)")
        ->check(CLI::Range(1, 1000));
    AddLimits();
  }
  CLI::App* app() override { return app_; }
  int Run(std::ostream& out, std::ostream& err) override {
    if (!max_memory_.empty()) options_.max_memory_bytes = *run::ParseByteSize(max_memory_);
    return run::RunSimulation(options_, out, err, MakeBackend);
  }

 private:
  // Overrides of the file's keys, for trying a layout or a precision without editing it.
  void AddOverrideFlags() {
    for (const OverrideFlag& o : kOverrides) {
      const bool is_text = !o.choices.empty();
      app_->add_option_function<std::string>(
              o.flag,
              [this, o, is_text](const std::string& value) {
                options_.overrides.push_back(
                    {o.flag, o.key, is_text && !o.boolean ? "\"" + value + "\"" : value, value});
              },
              o.help)
          ->type_name(o.boolean ? "BOOL"
                      : is_text ? "TEXT"
                                : "INT")
          ->check(is_text
                      ? CLI::Validator(CLI::IsMember(o.choices))
                      : CLI::Validator(
                            [](const std::string& text) {
                              const bool digits =
                                  !text.empty() && text.size() < 19 &&
                                  text.find_first_not_of("0123456789") == std::string::npos;
                              return digits ? std::string()
                                            : "'" + text + "' is not a whole number >= 0";
                            },
                            ""));
    }
    std::vector<ConfigFlag> flags(ConfigFlags().begin(), ConfigFlags().end());
    flags.insert(flags.end(), RunFlags().begin(), RunFlags().end());
    for (const ConfigFlag& f : flags) {
      const std::string flag = LongName(f.flag);
      const std::string key = std::string(f.section) + "." + f.key;
      app_->add_option_function<std::string>(
              f.flag,
              [this, f, flag, key](const std::string& value) {
                options_.overrides.push_back({flag, key, FlagValue(f, value)->dump(), value});
              },
              f.help)
          ->group(FlagGroup(f))
          ->type_name(FlagTypeName(f))
          ->check(CLI::Validator(
              [f](const std::string& text) {
                const StatusOr<nlohmann::json> value = FlagValue(f, text);
                return value.ok() ? std::string() : value.status().what();
              },
              ""));
    }
    // Short spellings of --sequence-parallel true / false.
    app_->add_flag_callback(
        "--sp",
        [this] {
          options_.overrides.push_back({"--sp", "parallel.sequence_parallel", "true", ""});
        },
        "--sequence-parallel true");
    app_->add_flag_callback(
        "--no-sp",
        [this] {
          options_.overrides.push_back({"--no-sp", "parallel.sequence_parallel", "false", ""});
        },
        "--sequence-parallel false");
  }
  // --timeout and --max-memory.
  void AddLimits() {
    app_->add_option("--timeout", options_.timeout_s,
                     "seconds one collective or send/receive may wait for the other ranks before "
                     "the job is aborted with a line naming the rank, the call and the group (a "
                     "stopped or hung rank); also the NCCL timeout of --backend cuda; default "
                     "1800 (torch.distributed's default)")
        ->check(CLI::Validator(
            [](const std::string& text) {
              char* end = nullptr;
              const double seconds = std::strtod(text.c_str(), &end);
              return end != text.c_str() && *end == '\0' && std::isfinite(seconds) && seconds > 0
                         ? std::string()
                         : "'" + text + "' is not a positive number of seconds";
            },
            "SECONDS > 0"));
    app_->add_option("--max-memory", max_memory_,
                     "bytes one rank may hold (512M, 4G, 1.5G, ...); a run the preflight finds "
                     "bigger is refused before anything is allocated, naming its biggest "
                     "tensors; default: this machine's available memory divided by the ranks on "
                     "this node")
        ->check(CLI::Validator(
            [](const std::string& text) {
              return run::ParseByteSize(text)
                         ? std::string()
                         : "'" + text + "' is not a size such as 512M, 4G or 1000000 (bytes)";
            },
            "SIZE"));
  }

  CLI::App* app_ = nullptr;
  run::RunOptions options_;
  std::string max_memory_;
};

}  // namespace

std::unique_ptr<Command> MakeRunCommand(CLI::App* parent, std::string command_line) {
  return std::make_unique<RunCommand>(parent, std::move(command_line), false);
}

std::unique_ptr<Command> MakeReferenceCommand(CLI::App* parent, std::string command_line) {
  return std::make_unique<RunCommand>(parent, std::move(command_line), true);
}

}  // namespace mpusim::cli
