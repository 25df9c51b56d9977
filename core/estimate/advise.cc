#include "core/estimate/advise.h"

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "core/config/gpt_config.h"
#include "core/estimate/activation_estimate.h"
#include "core/estimate/memory_estimate.h"
#include "core/topology.h"

namespace mpusim {
namespace {

std::vector<int64_t> Divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

}  // namespace

const char* RecomputeName(RunConfig::Recompute r) {
  switch (r) {
    case RunConfig::Recompute::kFull:
      return "full";
    case RunConfig::Recompute::kSelective:
      return "selective";
    default:
      return "none";
  }
}

StatusOr<Advice> Advise(const Config& config, const GpuSpec& gpu, const AdviseOptions& options) {
  if (!config.gpt) return Status::Error("model", "advise needs a GPT model (\"type\": \"gpt\")");
  if (config.gpt->moe.enabled()) {
    return Status::Error("model.num_moe_experts",
                         "advise does not search mixture-of-experts layouts yet");
  }
  const int64_t n = options.world_size, batch = options.global_batch_size;
  if (n < 1) return Status::Error("--world-size", "must be >= 1");
  if (batch < 1) return Status::Error("--global-batch-size", "must be >= 1");
  const GptConfig& model = *config.gpt;
  const int64_t max_tp = options.max_tp > 0 ? options.max_tp : config.parallel.gpus_per_node;
  RunConfig base_run = config.run.value_or(RunConfig{});
  if (!config.run) {
    base_run.dtype = MegatronStorageDType(config.parallel).value_or(DType::kFloat32);
    base_run.seq_length = model.max_position_embeddings;
  }
  if (base_run.seq_length < 1) {
    return Status::Error("--seq-length", "is needed: the config has no run section and the "
                                         "model no max_position_embeddings");
  }
  Advice advice;
  // Held memory depends on (tp, pp, vp, distributed optimizer) only: counted once each.
  std::map<std::tuple<int64_t, int64_t, int64_t, bool>, std::vector<StageHeldMemory>> held;
  for (int64_t tp : Divisors(n)) {
    // Within a node, tp divides the node (a group never straddles two).
    if (tp > max_tp || (tp <= config.parallel.gpus_per_node &&
                        config.parallel.gpus_per_node % tp != 0)) {
      continue;
    }
    for (int64_t pp : Divisors(n / tp)) {
      if (model.num_layers % pp != 0) continue;
      const int64_t dp = n / (tp * pp);
      std::vector<int64_t> vps = {0};
      if (options.virtual_pipeline && pp > 1) {
        for (int64_t v = 2; v <= model.num_layers / pp; ++v) {
          if (model.num_layers % (pp * v) == 0) vps.push_back(v);
        }
      }
      for (int64_t vp : vps) {
        for (bool sp : options.sequence_parallel) {
          if (sp && tp == 1) continue;
          for (bool distributed : options.distributed_optimizer) {
            if (distributed && !config.optimizer) continue;
            for (int64_t mbs : options.micro_batch_sizes) {
              if (batch % (mbs * dp) != 0) continue;
              const int64_t m = batch / (mbs * dp);
              if (vp > 0 && m % pp != 0) continue;  // Megatron's interleaved rule
              for (RunConfig::Recompute recompute : options.recompute) {
                Config c = config;
                ParallelConfig& par = c.parallel;
                par.world_size = n;
                par.tensor_model_parallel_size = tp;
                par.pipeline_model_parallel_size = pp;
                par.virtual_pipeline_model_parallel_size =
                    vp > 0 ? std::optional<int64_t>(vp) : std::nullopt;
                par.context_parallel_size = 1;
                par.hierarchical_context_parallel_sizes.clear();
                par.expert_model_parallel_size = 1;
                par.expert_tensor_parallel_size.reset();
                par.num_distributed_optimizer_instances = 1;
                par.microbatch_group_size_per_vp_stage.reset();
                par.num_layers = model.num_layers;
                par.sequence_parallel = sp;
                RunConfig run = base_run;
                run.micro_batch_size = mbs;
                run.num_microbatches = m;
                run.global_batch_size = batch;
                run.recompute = recompute;
                c.run = run;
                if (c.optimizer) c.optimizer->use_distributed_optimizer = distributed;
                if (!CheckGptLayout(par, run, &*c.gpt).ok()) continue;
                StatusOr<Topology> topology = Topology::Create(par);
                if (!topology.ok()) continue;
                const auto key = std::make_tuple(tp, pp, vp, distributed);
                auto it = held.find(key);
                if (it == held.end()) {
                  StatusOr<std::vector<StageHeldMemory>> h =
                      EstimateStageHeldMemory(c, *topology);
                  if (!h.ok()) continue;
                  it = held.emplace(key, *h).first;
                }
                StatusOr<std::vector<StageActivations>> acts =
                    EstimateStageActivations(c, *topology);
                StatusOr<TimeEstimate> time = EstimateStepTime(c, *topology, gpu, &it->second);
                if (!acts.ok() || !time.ok()) continue;
                AdvisedLayout layout{tp, pp, vp, dp, mbs, recompute, sp, distributed, *time};
                for (size_t s = 0; s < acts->size(); ++s) {
                  const StageActivations& a = (*acts)[s];
                  const PlanBytes peak = SaturatingAdd(
                      it->second[s].held.total(), SaturatingAdd(a.activations, a.buffers));
                  if (peak > layout.peak) {
                    layout.peak = peak;
                    layout.peak_stage = static_cast<int64_t>(s);
                    layout.activations = a.activations;
                  }
                }
                layout.fits = layout.peak <= static_cast<PlanBytes>(gpu.hbm_bytes);
                ++advice.candidates;
                (layout.fits ? advice.fit : advice.too_big).push_back(std::move(layout));
              }
            }
          }
        }
      }
    }
  }
  std::stable_sort(advice.fit.begin(), advice.fit.end(),
                   [](const AdvisedLayout& a, const AdvisedLayout& b) {
                     return a.time.step_time_s < b.time.step_time_s;
                   });
  std::stable_sort(advice.too_big.begin(), advice.too_big.end(),
                   [](const AdvisedLayout& a, const AdvisedLayout& b) { return a.peak < b.peak; });
  return advice;
}

}  // namespace mpusim
