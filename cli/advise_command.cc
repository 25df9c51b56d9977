// `mpusim advise`: every layout of the config's model on --world-size GPUs that fits the GPU's
// memory, ranked by predicted throughput, with why the leaders win and why the closest
// misses do not fit (core/estimate/advise.h). The config's own layout is ignored; its model,
// dtype, optimizer, gpus_per_node and run section (sequence length) are read.
// Text, JSON (Megatron's names) or a self-contained HTML page of tables and bars.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/config_options.h"
#include "cli/estimate_report.h"
#include "core/config/config.h"
#include "core/config/json_fields.h"
#include "core/config/model_facts.h"
#include "core/estimate/advise.h"
#include "core/estimate/memory_reserve.h"
#include "core/estimate/not_modelled.h"
#include "core/estimate/time_estimate.h"
#include "core/html.h"
#include "run/preflight.h"

namespace mpusim::cli {
namespace {

// "1,2,4" -> {1, 2, 4}; errors name the flag.
StatusOr<std::vector<int64_t>> ParseIntList(const std::string& text, const std::string& flag) {
  std::vector<int64_t> out;
  for (const std::string& item : SplitCommaList(text)) {
    int64_t value = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (ec != std::errc() || ptr != item.data() + item.size() || value < 1 || value > 1 << 20) {
      return Status::Error(flag, fmt::format("'{}' is not a list of integers from 1 to {}", text,
                                             1 << 20));
    }
    out.push_back(value);
  }
  return out;
}

// "true,false" -> {true, false}.
StatusOr<std::vector<bool>> ParseBoolList(const std::string& text, const std::string& flag) {
  std::vector<bool> out;
  for (const std::string& item : SplitCommaList(text)) {
    if (item != "true" && item != "false") {
      return Status::Error(flag, fmt::format("'{}' is not a list of true and false", text));
    }
    out.push_back(item == "true");
  }
  return out;
}

std::string Seconds(double s) { return fmt::format("{:.3g} s", s); }

std::string LayoutName(const AdvisedLayout& l) {
  std::string out = fmt::format("tp {}", l.tp);
  if (l.cp > 1) out += fmt::format(" cp {}", l.cp);
  out += fmt::format(" pp {}", l.pp);
  if (l.vp > 0) out += fmt::format(" vp {}", l.vp);
  out += fmt::format(" dp {}", l.dp);
  if (l.ep > 1) out += fmt::format(" ep {}", l.ep);
  out += fmt::format(" mbs {}", l.micro_batch_size);
  return out;
}

std::string FeaturesText(const AdvisedLayout& l) {
  std::vector<std::string> parts;
  parts.push_back(fmt::format("recompute {}", RecomputeName(l.recompute)));
  if (l.sequence_parallel) parts.push_back("sp");
  if (l.distributed_optimizer) parts.push_back("dist-opt");
  if (l.tp_comm_overlap) parts.push_back("tp-overlap");
  if (l.overlap_moe_expert_parallel_comm) parts.push_back("ep-overlap");
  if (l.overlap_grad_reduce) parts.push_back("grad-overlap");
  if (l.overlap_param_gather) parts.push_back("param-overlap");
  return fmt::format("{}", fmt::join(parts, ", "));
}

// What the GPU keeps free of a layout's neediest stage: HBM - peak - reserve (negative: over).
double HeadroomBytes(const AdvisedLayout& l, const GpuSpec& gpu) {
  const auto hbm = static_cast<PlanBytes>(gpu.hbm_bytes);
  return l.needed() <= hbm ? static_cast<double>(hbm - l.needed())
                           : -static_cast<double>(l.needed() - hbm);
}

// One part of a step, as the JSON names it and the text says it.
struct StepPart {
  const char* key;
  const char* text;
  double seconds;
  double hidden = 0;  // what overlap hides beside it (not in the step)
};
// Every part of a layout's step; they add up to its step time.
std::vector<StepPart> StepParts(const TimeEstimate& t) {
  return {{"compute_s", "compute", t.compute_s},
          {"recompute_s", "recomputation", t.recompute_s},
          {"tp_comm_s", "tp collectives", t.tp_comm_s, t.tp_comm_hidden_s},
          {"cp_comm_s", "cp exchanges", t.cp_comm_s},
          {"ep_comm_s", "the experts' token exchanges", t.ep_comm_s, t.ep_comm_hidden_s},
          {"pp_comm_s", "pipeline sends", t.pp_comm_s},
          {"bubble_s", "the bubble", t.bubble_s},
          {"dp_comm_s", "the gradient reduction", t.dp_comm_s, t.dp_comm_hidden_s},
          {"optimizer_s", "the optimizer step", t.optimizer_s}};
}

// "2.5 s of its 3.1 s step is compute; ...": what the winner spends its step on, the memory
// it leaves and, when others tie with it, why it is first among them.
std::string WhyItWins(const Advice& a, const GpuSpec& gpu) {
  const AdvisedLayout& l = a.fit.front();
  const TimeEstimate& t = l.time;
  std::vector<std::string> rest;
  for (const StepPart& p : StepParts(t)) {
    // Parts that round to 0.0% say nothing; the JSON has them all.
    if (std::string_view(p.key) == "compute_s" || p.seconds < 0.0005 * t.step_time_s) continue;
    // With overlap: what the exposed share leaves out.
    rest.push_back(fmt::format("{} {:.1f}%{}", p.text, 100 * p.seconds / t.step_time_s,
                               p.hidden > 0 ? fmt::format(" (and {} hidden)", Seconds(p.hidden))
                                            : std::string()));
  }
  std::string out = fmt::format(
      "{} of its {} step is compute{}{}; its peak {} + reserve {} (stage {}) leaves {} free.",
      Seconds(t.compute_s), Seconds(t.step_time_s), rest.empty() ? "" : "; ",
      fmt::join(rest, ", "), run::FormatBytes(l.peak), run::FormatBytes(l.reserved),
      l.peak_stage, run::FormatBytes(static_cast<PlanBytes>(HeadroomBytes(l, gpu))));
  size_t ties = 1;
  while (ties < a.fit.size() && a.fit[ties].tie_run == l.tie_run) ++ties;
  if (ties > 1) {
    out += fmt::format(" #1 to #{} are within {:.1f}% of the fastest of them; of those it "
                       "leaves the most memory free.",
                       ties, 100 * kNearTie);
  }
  return out;
}

// Whether any of the first `n` fitting layouts uses context parallelism: the tables' cp column.
bool ShowsCp(const Advice& a, size_t n) {
  return std::any_of(a.fit.begin(), a.fit.begin() + static_cast<std::ptrdiff_t>(n),
                     [](const AdvisedLayout& l) { return l.cp > 1; });
}
// Whether any of them exchanges tokens for mixture-of-experts layers: the ep column.
bool ShowsEp(const Advice& a, size_t n) {
  return std::any_of(a.fit.begin(), a.fit.begin() + static_cast<std::ptrdiff_t>(n),
                     [](const AdvisedLayout& l) { return l.time.ep_comm_s > 0; });
}

// "peak 81 GiB + reserve 2.0 GiB on stage 0 (52 GiB of activations) is 3.0 GiB over".
std::string WhyItMisses(const AdvisedLayout& l, const GpuSpec& gpu) {
  return fmt::format("peak {} + reserve {} on stage {} ({} of activations) is {} over",
                     run::FormatBytes(l.peak), run::FormatBytes(l.reserved), l.peak_stage,
                     run::FormatBytes(l.activations),
                     run::FormatBytes(l.needed() - static_cast<PlanBytes>(gpu.hbm_bytes)));
}

class AdviseCommand : public Command {
 public:
  explicit AdviseCommand(CLI::App* parent) {
    app_ = parent->add_subcommand(
        "advise", "Rank every layout of a model on N GPUs that fits memory by predicted "
                  "throughput");
    app_->footer(
        "Examples:\n"
        "  mpusim advise sample_configs/gpt3_175b_t8_p16_n1024.json --global-batch-size 1536 \\\n"
        "      --gpu a100-80gb\n"
        "  mpusim advise CONFIG --world-size 64 --global-batch-size 512 --format json\n"
        "  mpusim advise CONFIG --global-batch-size 512 --format html > advise.html\n"
        "Searches tp (up to the GPUs of a node), cp, pp, vp, dp, the micro-batch size,\n"
        "recomputation, sequence parallelism and the distributed optimizer; the config gives\n"
        "the model, the dtype, the optimizer, gpus_per_node, cp_comm_type and\n"
        "attention_backend (its own layout is ignored); for a mixture-of-experts model also\n"
        "ep (etp is tp).");
    app_->add_option("CONFIG", path_, "config file with a GPT model")->required();
    app_->add_option("--world-size,-n", world_size_, "GPUs (default the config's world_size)");
    app_->add_option("--global-batch-size", global_batch_,
                     "samples per iteration (default the run section's global_batch_size)");
    app_->add_option("--seq-length", seq_length_,
                     "tokens per sample (default the run's, else max_position_embeddings)");
    app_->add_option("--gpu", gpu_,
                     "a100-80gb, h100-80gb (default), h200, h800, b200 or a JSON file");
    app_->add_option("--micro-batch-sizes", micro_batches_, "candidates (default 1,2,4,8)");
    app_->add_option("--recompute", recompute_,
                     "candidates among none,selective,full (default all three)");
    app_->add_option("--sequence-parallel", sequence_parallel_,
                     "candidates among true,false (default both)");
    app_->add_option("--distributed-optimizer", distributed_,
                     "candidates among true,false (default both)");
    app_->add_flag("--no-virtual-pipeline", no_vp_, "do not try the interleaved schedule");
    app_->add_option("--overlap-grad-reduce", overlap_grad_reduce_,
                     "true or false: optimizer.overlap_grad_reduce for every layout (default "
                     "the config's)")
        ->check(CLI::IsMember({"true", "false"}));
    app_->add_option("--overlap-param-gather", overlap_param_gather_,
                     "true or false: optimizer.overlap_param_gather for every layout with the "
                     "distributed optimizer (needs overlap_grad_reduce; default the config's)")
        ->check(CLI::IsMember({"true", "false"}));
    app_->add_option("--tp-comm-overlap", tp_comm_overlap_,
                     "true or false: parallel.tp_comm_overlap for every layout with sequence "
                     "parallelism (default the config's)")
        ->check(CLI::IsMember({"true", "false"}));
    app_->add_option("--overlap-moe-expert-parallel-comm", moe_overlap_,
                     "true or false: parallel.overlap_moe_expert_parallel_comm for every layout "
                     "Megatron allows it on (ep > 1, no pipelining or interleaved, no full "
                     "recomputation, alltoall dispatcher; default the config's)")
        ->check(CLI::IsMember({"true", "false"}));
    app_->add_option("--max-tp", max_tp_, "largest tensor-parallel size (default gpus_per_node)");
    app_->add_option("--max-cp", max_cp_,
                     "largest context-parallel size (default: any that splits the sequence; 1: "
                     "none)")
        ->check(CLI::Range(1, 1 << 20));
    app_->add_option("--reserve-gib", reserve_gib_,
                     "GiB each rank keeps beyond the count, in place of the computed reserve "
                     "(CUDA context, cuBLAS workspaces, NCCL buffers, fragmentation)");
    app_->add_option("--attention-backend", attention_backend_,
                     "override model.attention_backend: flash, fused, unfused, local or auto")
        ->check(CLI::IsMember(std::vector<std::string>(AttentionBackendNames().begin(),
                                                       AttentionBackendNames().end())));
    app_->add_option("--top", top_, "layouts to show (default 10)")->check(CLI::Range(1, 1000));
    app_->add_option("--format", format_,
                     "text, json or html (a self-contained page; default text)")
        ->check(CLI::IsMember({"text", "json", "html"}));
  }
  CLI::App* app() override { return app_; }

  int Run(std::ostream& out, std::ostream& err) override {
    StatusOr<nlohmann::json> read = ReadJsonFile(path_);
    if (!read.ok()) return ReportError(err, path_, read.status().Message());
    nlohmann::json doc = *read;
    std::optional<int64_t> file_batch;
    bool file_tp_overlap = false, file_moe_overlap = false, file_delay_wgrad = false;
    // The layout is what advise chooses: drop the file's, keep the rest.
    if (doc.is_object() && doc.contains("parallel") && doc["parallel"].is_object()) {
      nlohmann::json& par = doc["parallel"];
      // tp_comm_overlap needs sequence parallelism, overlap_moe_expert_parallel_comm (and
      // delay_wgrad_compute with it) expert parallelism, which advise chooses: applied per
      // layout.
      for (const auto& [key, flag] :
           {std::pair<const char*, bool*>{"tp_comm_overlap", &file_tp_overlap},
            {"overlap_moe_expert_parallel_comm", &file_moe_overlap},
            {"delay_wgrad_compute", &file_delay_wgrad}}) {
        if (!par.contains(key)) continue;
        if (!par[key].is_boolean()) {
          return ReportError(err, path_,
                             fmt::format("parallel.{}: must be true or false, got {}", key,
                                         DescribeJson(par[key])));
        }
        *flag = par[key].get<bool>();
        par.erase(key);
      }
      using P = ParallelConfig;
      // advise chooses pp (and vp) itself and splits the layers evenly; an uneven split is
      // tied to one pp, so it is refused rather than dropped.
      for (const std::string_view key :
           {std::string_view("pipeline_model_parallel_layout"),  // a Codec field: no member key
            ParallelKey(&P::decoder_first_pipeline_num_layers),
            ParallelKey(&P::decoder_last_pipeline_num_layers),
            ParallelKey(&P::account_for_embedding_in_pipeline_split),
            ParallelKey(&P::account_for_loss_in_pipeline_split)}) {
        const auto it = par.find(std::string(key));
        if (it == par.end() || it->is_null() || *it == false) continue;
        return ReportError(err, path_,
                           fmt::format("parallel.{}: advise searches even pipeline splits only "
                                       "(it chooses pipeline_model_parallel_size itself); "
                                       "remove the key, or check this split with mpusim "
                                       "estimate",
                                       key));
      }
      for (const std::string_view key :
           {ParallelKey(&P::tensor_model_parallel_size),
            ParallelKey(&P::pipeline_model_parallel_size),
            ParallelKey(&P::virtual_pipeline_model_parallel_size),
            ParallelKey(&P::context_parallel_size),
            ParallelKey(&P::hierarchical_context_parallel_sizes),
            ParallelKey(&P::expert_model_parallel_size),
            ParallelKey(&P::expert_tensor_parallel_size),
            ParallelKey(&P::num_distributed_optimizer_instances),
            ParallelKey(&P::microbatch_group_size_per_vp_stage),
            ParallelKey(&P::sequence_parallel), ParallelKey(&P::num_layers)}) {
        par.erase(std::string(key));
      }
      if (world_size_) par["world_size"] = *world_size_;
    }
    if (doc.is_object() && doc.contains("run") && doc["run"].is_object()) {
      nlohmann::json& run = doc["run"];
      if (run.contains("global_batch_size") && run["global_batch_size"].is_number_integer()) {
        file_batch = run["global_batch_size"].get<int64_t>();
      }
      for (const std::string_view key :
           {RunKey(&RunConfig::global_batch_size), RunKey(&RunConfig::num_microbatches),
            RunKey(&RunConfig::micro_batch_size)}) {
        run.erase(std::string(key));
      }
    }
    Config config;
    if (Status s = ParseConfig(doc, &config); !s.ok()) return ReportError(err, path_, s.Message());
    SetAttentionBackend(attention_backend_, &config);
    AdviseOptions options;
    options.world_size = config.parallel.world_size;
    if (!global_batch_ && !file_batch) {
      return ReportError(err, "command line",
                         "--global-batch-size: is needed (the config's run section has no "
                         "global_batch_size)");
    }
    options.global_batch_size = global_batch_ ? *global_batch_ : *file_batch;
    if (seq_length_) {
      if (!config.run) {
        config.run = RunConfig{};
        config.run->dtype = MegatronStorageDType(config.parallel).value_or(DType::kFloat32);
      }
      config.run->seq_length = *seq_length_;
    }
    options.max_tp = max_tp_;
    options.max_cp = max_cp_;
    options.virtual_pipeline = !no_vp_;
    // Overlap: the flags, else the config's keys; each applies where Megatron allows it.
    options.overlap_grad_reduce = overlap_grad_reduce_.empty()
                                      ? config.optimizer && config.optimizer->overlap_grad_reduce
                                      : overlap_grad_reduce_ == "true";
    options.overlap_param_gather =
        overlap_param_gather_.empty()
            ? config.optimizer && config.optimizer->overlap_param_gather
            : overlap_param_gather_ == "true";
    options.tp_comm_overlap =
        tp_comm_overlap_.empty() ? file_tp_overlap : tp_comm_overlap_ == "true";
    options.overlap_moe_expert_parallel_comm =
        moe_overlap_.empty() ? file_moe_overlap : moe_overlap_ == "true";
    options.delay_wgrad_compute = file_delay_wgrad;
    if (options.delay_wgrad_compute && !options.overlap_moe_expert_parallel_comm) {
      return ReportError(err, path_,
                         "parallel.delay_wgrad_compute: needs overlap_moe_expert_parallel_comm "
                         "true (Megatron's rule)");
    }
    if (options.overlap_param_gather && !options.overlap_grad_reduce) {
      return ReportError(err, "command line",
                         "--overlap-param-gather: needs overlap_grad_reduce true (Megatron: "
                         "\"Must use --overlap-param-gather with --overlap-grad-reduce\")");
    }
    if ((options.overlap_grad_reduce || options.overlap_param_gather) && !config.optimizer) {
      return ReportError(err, "command line",
                         fmt::format("--overlap-{}: needs an optimizer section in the config "
                                     "(the gradient reduction it overlaps is the training's)",
                                     options.overlap_grad_reduce ? "grad-reduce"
                                                                 : "param-gather"));
    }
    if (!micro_batches_.empty()) {
      StatusOr<std::vector<int64_t>> v = ParseIntList(micro_batches_, "--micro-batch-sizes");
      if (!v.ok()) return ReportError(err, "command line", v.status().Message());
      options.micro_batch_sizes = *v;
    }
    if (!recompute_.empty()) {
      options.recompute.clear();
      for (const std::string& item : SplitCommaList(recompute_)) {
        if (item == "none") {
          options.recompute.push_back(RunConfig::Recompute::kNone);
        } else if (item == "selective") {
          options.recompute.push_back(RunConfig::Recompute::kSelective);
        } else if (item == "full") {
          options.recompute.push_back(RunConfig::Recompute::kFull);
        } else {
          return ReportError(err, "command line",
                             fmt::format("--recompute: '{}' is not a list of none, selective "
                                         "and full",
                                         recompute_));
        }
      }
    }
    if (!sequence_parallel_.empty()) {
      StatusOr<std::vector<bool>> v = ParseBoolList(sequence_parallel_, "--sequence-parallel");
      if (!v.ok()) return ReportError(err, "command line", v.status().Message());
      options.sequence_parallel = *v;
    }
    if (!distributed_.empty()) {
      StatusOr<std::vector<bool>> v = ParseBoolList(distributed_, "--distributed-optimizer");
      if (!v.ok()) return ReportError(err, "command line", v.status().Message());
      options.distributed_optimizer = *v;
    }
    if (reserve_gib_) {
      StatusOr<PlanBytes> bytes = ReserveGibToBytes(*reserve_gib_);
      if (!bytes.ok()) return ReportError(err, "command line", bytes.status().Message());
      options.reserve_bytes = *bytes;
    }
    StatusOr<GpuSpec> gpu = ResolveGpuSpec(gpu_);
    if (!gpu.ok()) return ReportError(err, "command line", gpu.status().Message());
    // What the candidates ran with: the file's overlap keys were taken off its layout.
    Config modelled = config;
    modelled.parallel.overlap_moe_expert_parallel_comm = options.overlap_moe_expert_parallel_comm;
    not_modelled_ = NotModelled(modelled);
    moe_ = FactsOf(config).moe.enabled();
    StatusOr<Advice> advice = Advise(config, *gpu, options);
    if (FromAttentionFlag(attention_backend_, advice.status())) {
      return ReportError(
          err, "command line",
          "--attention-backend " + attention_backend_ + ": " + advice.status().what());
    }
    if (!advice.ok()) return ReportError(err, path_, advice.status().Message());
    if (format_ == "json") {
      out << Json(options, *gpu, *advice).dump(1) << '\n';
    } else if (format_ == "html") {
      PrintHtml(options, *gpu, *advice, out);
    } else {
      PrintText(options, *gpu, *advice, out);
    }
    return kExitOk;
  }

 private:
  void PrintText(const AdviseOptions& o, const GpuSpec& gpu, const Advice& a,
                 std::ostream& out) const {
    out << fmt::format(
        "Layouts for {} GPUs ({}, {} each), global batch {}: {} evaluated, {} fit, {} do not\n",
        o.world_size, gpu.name, run::FormatBytes(static_cast<PlanBytes>(gpu.hbm_bytes)),
        o.global_batch_size, a.candidates, a.fit.size(), a.too_big.size());
    out << "Counted with " << AttentionText(a.attention) << '\n';
    if (a.fit.empty()) {
      out << "No layout fits.\n";
    } else {
      const size_t n = std::min(a.fit.size(), static_cast<size_t>(top_));
      const bool cp = ShowsCp(a, n), ep = ShowsEp(a, n);
      size_t width = 28, features = 34;
      for (size_t i = 0; i < n; ++i) width = std::max(width, LayoutName(a.fit[i]).size());
      for (size_t i = 0; i < n; ++i) features = std::max(features, FeaturesText(a.fit[i]).size());
      out << fmt::format(
          "  {:>3}  {:<{}} {:<{}} {:>7} {:>7} {:>6} {:>7} {:>7}{}{} {:>7} {:>7} {:>10}\n", "#",
          "layout", width, "features", features, "step", "TFLOP/s", "MFU", "bubble", "tp",
          cp ? fmt::format(" {:>7}", "cp") : std::string(),
          ep ? fmt::format(" {:>7}", "ep") : std::string(), "pp", "dp", "headroom");
      for (size_t i = 0; i < n; ++i) {
        const AdvisedLayout& l = a.fit[i];
        const double step = l.time.step_time_s;
        out << fmt::format(
            "  {:>3}  {:<{}} {:<{}} {:>7} {:>7.1f} {:>5.1f}% {:>6.1f}% {:>6.1f}%{}{} {:>6.1f}% "
            "{:>6.1f}% {:>10}\n",
            i + 1, LayoutName(l), width, FeaturesText(l), features, Seconds(step),
            l.time.model_tflops_per_gpu, 100 * l.time.mfu, 100 * l.time.bubble_s / step,
            100 * l.time.tp_comm_s / step,
            cp ? fmt::format(" {:>6.1f}%", 100 * l.time.cp_comm_s / step) : std::string(),
            ep ? fmt::format(" {:>6.1f}%", 100 * l.time.ep_comm_s / step) : std::string(),
            100 * l.time.pp_comm_s / step, 100 * l.time.dp_comm_s / step,
            run::FormatBytes(static_cast<PlanBytes>(HeadroomBytes(l, gpu))));
      }
      out << "Why #1 wins: " << WhyItWins(a, gpu) << '\n';
    }
    if (!a.too_big.empty()) {
      out << "Closest that do not fit:\n";
      const size_t n = std::min<size_t>(a.too_big.size(), 3);
      for (size_t i = 0; i < n; ++i) {
        const AdvisedLayout& l = a.too_big[i];
        out << fmt::format("  {}, {}: {}\n", LayoutName(l), FeaturesText(l), WhyItMisses(l, gpu));
      }
    }
    out << ReserveText(o) << NotSearchedText()
        << "Time model and memory count: `mpusim estimate` (docs/estimate.md).\n";
    out << fmt::format("Not modelled: {}.\n", fmt::join(not_modelled_, "; "));
  }

  nlohmann::ordered_json Json(const AdviseOptions& o, const GpuSpec& gpu, const Advice& a) const {
    nlohmann::ordered_json doc;
    doc["world_size"] = o.world_size;
    doc["global_batch_size"] = o.global_batch_size;
    doc["gpu"] = gpu.name;
    doc["hbm_bytes"] = JsonBytes(static_cast<PlanBytes>(gpu.hbm_bytes));
    doc["reserve_gib"] = reserve_gib_ ? nlohmann::ordered_json(*reserve_gib_)
                                      : nlohmann::ordered_json(nullptr);
    doc["near_tie_fraction"] = kNearTie;
    doc["attention_backend"] = AttentionBackendName(a.attention.backend);
    doc["attention_backend_requested"] = AttentionBackendName(a.attention.requested);
    doc["candidates"] = a.candidates;
    doc["fitting"] = a.fit.size();
    const auto entry = [&](const AdvisedLayout& l) {
      using P = ParallelConfig;
      const auto key = [](std::string_view k) { return std::string(k); };
      nlohmann::ordered_json j;
      j[key(ParallelKey(&P::tensor_model_parallel_size))] = l.tp;
      j[key(ParallelKey(&P::pipeline_model_parallel_size))] = l.pp;
      j[key(ParallelKey(&P::virtual_pipeline_model_parallel_size))] =
          l.vp > 0 ? nlohmann::ordered_json(l.vp) : nlohmann::ordered_json(nullptr);
      j[key(ParallelKey(&P::context_parallel_size))] = l.cp;
      j[key(ParallelKey(&P::expert_model_parallel_size))] = l.ep;
      j["data_parallel_size"] = l.dp;
      j[key(RunKey(&RunConfig::micro_batch_size))] = l.micro_batch_size;
      j["recompute_granularity"] = l.recompute == RunConfig::Recompute::kNone
                                       ? nlohmann::ordered_json(nullptr)
                                       : nlohmann::ordered_json(RecomputeName(l.recompute));
      // "full" is every layer recomputed alone (AdviseOptions::recompute).
      const bool full = l.recompute == RunConfig::Recompute::kFull;
      j["recompute_method"] = full ? nlohmann::ordered_json("uniform") : nullptr;
      j["recompute_num_layers"] = full ? nlohmann::ordered_json(1) : nullptr;
      j[key(ParallelKey(&P::sequence_parallel))] = l.sequence_parallel;
      j["use_distributed_optimizer"] = l.distributed_optimizer;
      j["tp_comm_overlap"] = l.tp_comm_overlap;
      j["overlap_moe_expert_parallel_comm"] = l.overlap_moe_expert_parallel_comm;
      j["delay_wgrad_compute"] = l.delay_wgrad_compute;
      j["overlap_grad_reduce"] = l.overlap_grad_reduce;
      j["overlap_param_gather"] = l.overlap_param_gather;
      j["model_tflops_per_gpu"] = l.time.model_tflops_per_gpu;
      j["mfu"] = l.time.mfu;
      j["step_time_s"] = l.time.step_time_s;
      // The parts of the step, which add up to step_time_s.
      for (const StepPart& p : StepParts(l.time)) j[p.key] = p.seconds;
      j["tp_comm_hidden_s"] = l.time.tp_comm_hidden_s;
      j["dp_comm_hidden_s"] = l.time.dp_comm_hidden_s;
      j["ep_comm_hidden_s"] = l.time.ep_comm_hidden_s;
      j["peak_bytes"] = JsonBytes(l.peak);
      j["reserved_bytes"] = JsonBytes(l.reserved);
      // An exact integer: what is free, or minus the excess of a miss.
      const auto hbm = static_cast<PlanBytes>(gpu.hbm_bytes);
      const PlanBytes over = l.needed() > hbm ? l.needed() - hbm : 0;
      j["headroom_bytes"] = over == 0 ? JsonBytes(hbm - l.needed())
                            : over < (PlanBytes{1} << 62)
                                ? nlohmann::ordered_json(-static_cast<int64_t>(over))
                                : nlohmann::ordered_json(-static_cast<double>(over));
      j["peak_stage"] = l.peak_stage;
      if (l.fits) j["tie_run"] = l.tie_run;
      return j;
    };
    nlohmann::ordered_json layouts = nlohmann::ordered_json::array();
    const size_t n = std::min(a.fit.size(), static_cast<size_t>(top_));
    for (size_t i = 0; i < n; ++i) layouts.push_back(entry(a.fit[i]));
    doc["layouts"] = layouts;
    nlohmann::ordered_json misses = nlohmann::ordered_json::array();
    for (size_t i = 0; i < std::min<size_t>(a.too_big.size(), 3); ++i) {
      misses.push_back(entry(a.too_big[i]));
    }
    doc["closest_not_fitting"] = misses;
    doc["not_searched"] = moe_ ? nlohmann::ordered_json({"expert_tensor_parallel_size"})
                               : nlohmann::ordered_json::array();
    doc["not_modelled"] = not_modelled_;
    return doc;
  }

  // The page: the table of the text, a bar per layout of its step's parts and one of its
  // peak memory against the GPU's, the closest misses, and Json() for scripts.
  void PrintHtml(const AdviseOptions& o, const GpuSpec& gpu, const Advice& a,
                 std::ostream& out) const {
    const auto hbm = static_cast<PlanBytes>(gpu.hbm_bytes);
    const std::string title =
        fmt::format("mpusim advise: {} GPUs ({}, {} each), global batch {}", o.world_size,
                    gpu.name, run::FormatBytes(hbm), o.global_batch_size);
    PrintReportPageStart(title, out);
    out << fmt::format("<p>{} layouts evaluated of {}: {} fit, {} do not. Ranked by predicted "
                       "step time, the fastest first; near-ties (within 0.1%) by headroom.</p>\n",
                       a.candidates, HtmlEscape(path_), a.fit.size(), a.too_big.size());
    out << "<p class=\"note\">Counted with " << HtmlEscape(AttentionText(a.attention)) << ".</p>\n";
    const size_t n = std::min(a.fit.size(), static_cast<size_t>(top_));
    if (n == 0) out << "<p class=\"over\">No layout fits.</p>\n";
    const auto label = [&](size_t i, const AdvisedLayout& l) {
      return fmt::format("#{} {}", i + 1, LayoutName(l));
    };
    const bool cp = ShowsCp(a, n), ep = ShowsEp(a, n);
    if (n > 0) {
      out << "<table class=\"report\"><tr><th>#</th><th>layout</th><th>features</th>"
             "<th>step</th><th>TFLOP/s</th><th>MFU</th><th>bubble</th><th>tp</th>"
          << (cp ? "<th>cp</th>" : "") << (ep ? "<th>ep</th>" : "")
          << "<th>pp</th><th>dp</th><th>peak</th><th>headroom</th></tr>\n";
      for (size_t i = 0; i < n; ++i) {
        const AdvisedLayout& l = a.fit[i];
        const double step = l.time.step_time_s;
        out << fmt::format(
            "<tr><td>{}</td><td class=\"name\">{}</td><td class=\"name\">{}</td><td>{}</td>"
            "<td>{:.1f}</td><td>{:.1f}%</td><td>{:.1f}%</td><td>{:.1f}%</td>{}{}<td>{:.1f}%</td>"
            "<td>{:.1f}%</td><td>{}</td><td>{}</td></tr>\n",
            i + 1, HtmlEscape(LayoutName(l)), HtmlEscape(FeaturesText(l)), Seconds(step),
            l.time.model_tflops_per_gpu, 100 * l.time.mfu, 100 * l.time.bubble_s / step,
            100 * l.time.tp_comm_s / step,
            cp ? fmt::format("<td>{:.1f}%</td>", 100 * l.time.cp_comm_s / step) : std::string(),
            ep ? fmt::format("<td>{:.1f}%</td>", 100 * l.time.ep_comm_s / step) : std::string(),
            100 * l.time.pp_comm_s / step,
            100 * l.time.dp_comm_s / step,
            run::FormatBytes(l.peak), run::FormatBytes(hbm - l.needed()));
      }
      out << "</table>\n<p>Why #1 wins: " << HtmlEscape(WhyItWins(a, gpu))
          << "</p>\n<h2>where each step's time goes (the busiest stage's rank)</h2>\n";
      std::vector<Bar> time_bars;
      for (size_t i = 0; i < n; ++i) {
        time_bars.push_back(TimeBar(label(i, a.fit[i]), a.fit[i].time, cp, ep));
      }
      PrintBarsSvg(TimePartNames(cp, ep), time_bars, 0, "", out);
    }
    // Memory: the peak stage of every layout shown, and of the closest misses.
    std::vector<Bar> memory_bars;
    const auto memory_bar = [&](const std::string& name, const AdvisedLayout& l) {
      const PlanBytes rest = l.peak - l.activations;
      return Bar{name,
                 {{static_cast<double>(rest),
                   fmt::format("{}: {} held, buffers included (stage {})", name,
                               run::FormatBytes(rest), l.peak_stage)},
                  {static_cast<double>(l.activations),
                   fmt::format("{}: {} of activations", name, run::FormatBytes(l.activations))},
                  {static_cast<double>(l.reserved),
                   fmt::format("{}: {} of reserve", name, run::FormatBytes(l.reserved))}}};
    };
    for (size_t i = 0; i < n; ++i) memory_bars.push_back(memory_bar(label(i, a.fit[i]), a.fit[i]));
    const size_t misses = std::min<size_t>(a.too_big.size(), 3);
    for (size_t i = 0; i < misses; ++i) {
      memory_bars.push_back(memory_bar("miss: " + LayoutName(a.too_big[i]), a.too_big[i]));
    }
    if (!memory_bars.empty()) {
      out << "<h2>peak memory (each layout's fullest stage)</h2>\n";
      PrintBarsSvg({"held and buffers", "activations", "reserve"}, memory_bars,
                   static_cast<double>(hbm),
                   fmt::format("{} of HBM", run::FormatBytes(hbm)), out);
    }
    if (misses > 0) {
      out << "<h2>closest that do not fit</h2>\n<ul>\n";
      for (size_t i = 0; i < misses; ++i) {
        const AdvisedLayout& l = a.too_big[i];
        out << "<li>" << HtmlEscape(LayoutName(l) + ", " + FeaturesText(l) + ": " +
                                    WhyItMisses(l, gpu))
            << "</li>\n";
      }
      out << "</ul>\n";
    }
    out << "<p class=\"note\">" << HtmlEscape(ReserveText(o) + NotSearchedText())
        << "Time model and memory count: <code>mpusim estimate</code> (docs/estimate.md).</p>\n"
        << "<p class=\"note\">Not modelled: "
        << HtmlEscape(fmt::format("{}", fmt::join(not_modelled_, "; "))) << ".</p>\n"
        << "<script id=\"advice\" type=\"application/json\">"
        << JsonForScript(Json(o, gpu, a).dump()) << "</script>\n";
    PrintReportPageEnd(out);
  }

  // How the fit was judged, for the notes under the tables.
  std::string ReserveText(const AdviseOptions& o) const {
    if (o.reserve_bytes) {
      return fmt::format("Fits: peak + a reserve of {} per rank (--reserve-gib); step times "
                         "within 0.1% are ranked by headroom. ",
                         run::FormatBytes(*o.reserve_bytes));
    }
    return "Fits: peak + the reserve of each stage's busiest rank (CUDA context, cuBLAS "
           "workspaces, NCCL buffers, fragmentation: docs/estimate.md, \"The memory reserve\"); "
           "step "
           "times within 0.1% are ranked by headroom. ";
  }

  // What the search leaves out, for the notes under the tables.
  std::string NotSearchedText() const {
    return moe_ ? "Not searched: the experts' own tensor parallelism (etp is tp, Megatron's "
                  "default). "
                : "";
  }

  CLI::App* app_ = nullptr;
  bool moe_ = false;  // the model has mixture-of-experts layers
  std::vector<std::string> not_modelled_;
  std::optional<double> reserve_gib_;
  std::string path_;
  std::optional<int64_t> world_size_, global_batch_, seq_length_;
  int64_t max_tp_ = 0, max_cp_ = 0;
  std::string gpu_ = kDefaultGpu;
  std::string micro_batches_, recompute_, sequence_parallel_, distributed_;
  std::string overlap_grad_reduce_, overlap_param_gather_, tp_comm_overlap_, moe_overlap_;
  std::string attention_backend_;  // empty: the config's
  bool no_vp_ = false;
  int top_ = 10;
  std::string format_ = "text";
};

}  // namespace

std::unique_ptr<Command> MakeAdviseCommand(CLI::App* parent) {
  return std::make_unique<AdviseCommand>(parent);
}

}  // namespace mpusim::cli
