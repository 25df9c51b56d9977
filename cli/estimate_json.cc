// The estimate as JSON (`mpusim estimate --format json`; the schema is in the README), which
// the HTML pages also embed for scripts. Not the text (estimate_text.cc) nor the HTML
// (estimate_html.cc).
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli/estimate_parts.h"
#include "cli/estimate_report.h"
#include "core/estimate/not_modelled.h"

namespace mpusim::cli {

nlohmann::ordered_json EstimateJson(const EstimateReport& r, const Topology& topology) {
  const Config& config = r.config;
  const std::optional<TimeEstimate>& time = r.time;
  nlohmann::ordered_json doc;
  doc["world_size"] = topology.world_size();
  doc["dtype"] = std::string(DTypeName(config.run->dtype));
  const OptimizerPrecision precision = PrecisionOf(config);
  doc["main_grad_dtype"] = std::string(DTypeName(precision.main_grad));
  doc["optimizer_dtypes"] = {{"master", MasterStorageName(precision)},
                             {"exp_avg", std::string(DTypeName(precision.exp_avg))},
                             {"exp_avg_sq", std::string(DTypeName(precision.exp_avg_sq))}};
  const bool distributed = config.optimizer && config.optimizer->use_distributed_optimizer;
  doc["optimizer"] = !config.optimizer ? nlohmann::ordered_json(nullptr)
                     : config.optimizer->kind == OptimizerConfig::Kind::kAdam
                         ? nlohmann::ordered_json("adam")
                         : nlohmann::ordered_json("sgd");
  doc["use_distributed_optimizer"] = distributed;
  const auto number = [&](double v) {
    return time ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
  };
  doc["step_time_s"] = number(time ? time->step_time_s : 0);
  doc["model_tflops_per_gpu"] = number(time ? time->model_tflops_per_gpu : 0);
  doc["mfu"] = number(time ? time->mfu : 0);
  if (time) {
    const TimeEstimate& t = *time;
    doc["gpu"] = {{"name", t.gpu.name},
                  {"peak_tflops_16bit", t.gpu.peak_flops_16bit / 1e12},
                  {"peak_tflops_8bit", t.gpu.peak_flops_8bit / 1e12},
                  {"sm_count", t.gpu.sm_count},
                  {"compute_capability", t.gpu.compute_capability},
                  {"gemm_efficiency", t.gpu.gemm_efficiency},
                  {"gemm_efficiency_8bit", t.gpu.gemm_efficiency_8bit},
                  {"gemm_efficiency_achieved", t.gemm_efficiency_achieved},
                  {"memory_efficiency", t.gpu.memory_efficiency},
                  {"collective_efficiency", t.gpu.collective_efficiency},
                  {"attention_efficiency_forward", t.gpu.attention_efficiency_forward},
                  {"attention_efficiency_backward", t.gpu.attention_efficiency_backward}};
    doc["global_batch_size"] = t.global_batch_size;
    doc["num_microbatches"] = t.num_microbatches;
    // The run's recompute keys as its config echo writes them (null: unset).
    nlohmann::json run_echo;
    ToJson(*config.run, &run_echo);
    doc["recompute"] = {{"recompute_granularity", run_echo["recompute_granularity"]},
                        {"recompute_method", run_echo["recompute_method"]},
                        {"recompute_num_layers", run_echo["recompute_num_layers"]},
                        {"recompute_modules", run_echo["recompute_modules"]},
                        {"summary", RecomputeSummary(*config.run)}};
    doc["time"] = {{"compute_s", t.compute_s},
                   {"recompute_s", t.recompute_s},
                   {"tp_comm_s", t.tp_comm_s},
                   {"tp_comm_hidden_s", t.tp_comm_hidden_s},
                   {"cp_comm_s", t.cp_comm_s},
                   {"ep_comm_s", t.ep_comm_s},
                   {"ep_comm_hidden_s", t.ep_comm_hidden_s},
                   {"pp_comm_s", t.pp_comm_s},
                   {"bubble_s", t.bubble_s},
                   {"dp_comm_s", t.dp_comm_s},
                   {"dp_comm_hidden_s", t.dp_comm_hidden_s},
                   {"optimizer_s", t.optimizer_s}};
    doc["overlap"] = {{"tp_comm_overlap", TpOverlap(config)},
                      {"overlap_grad_reduce", GradOverlap(config)},
                      {"overlap_param_gather",
                       config.optimizer && config.optimizer->overlap_param_gather},
                      {"overlap_moe_expert_parallel_comm", EpOverlap(config)},
                      {"delay_wgrad_compute", config.parallel.delay_wgrad_compute},
                      {"grad_buckets", t.dp_buckets}};
    doc["model_flops_per_iteration"] = t.model_flops;
    doc["flops_per_rank"] = t.flops_per_rank;
    nlohmann::ordered_json comm = nlohmann::ordered_json::array();
    for (const CommTime& c : t.communication) {
      comm.push_back({{"kind", c.kind},
                      {"operation", c.operation},
                      {"count", c.count},
                      {"bytes", c.bytes},
                      {"seconds", c.seconds},
                      {"hidden_seconds", c.hidden_s},
                      {"inter_node", c.inter_node}});
    }
    doc["communication"] = comm;
  } else {
    doc["step_time_not_estimated"] = r.time_missing;
  }
  doc["hbm_bytes"] = JsonBytes(static_cast<PlanBytes>(r.gpu.hbm_bytes));
  if (r.attention) {
    doc["attention_backend"] = AttentionBackendName(r.attention->backend);
    doc["attention_backend_requested"] = AttentionBackendName(r.attention->requested);
    doc["attention_backend_reason"] = r.attention->reason;
  }
  if (!r.activations) doc["activations_not_estimated"] = r.activations_missing;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (size_t i = 0; i < r.stages.size(); ++i) {
    const StageHeldMemory& s = r.stages[i];
    nlohmann::ordered_json stage;
    stage["stage"] = s.stage;
    stage["rank"] = s.rank;
    stage["memory"] = {{"parameters", JsonBytes(s.held.parameters)},
                       {"gradients", JsonBytes(s.held.gradients)},
                       {"optimizer", JsonBytes(s.held.optimizer)},
                       {"held", JsonBytes(s.held.total())},
                       {"step_gradient_copies", JsonBytes(s.held.step_gradient_copies)}};
    if (r.activations) {
      const StageActivations& a = (*r.activations)[i];
      stage["memory"]["activations"] = JsonBytes(a.activations);
      stage["memory"]["buffers"] = JsonBytes(a.buffers);
      stage["memory"]["peak"] = JsonBytes(StagePeak(r, i));
      stage["peak_stashes"] = a.peak_stashes;
      const MemoryReserve& m = r.reserves[i];
      stage["reserved_bytes"] = JsonBytes(m.total);
      if (m.given) {
        stage["reserve"] = {{"given", true}};
      } else {
        stage["reserve"] = {{"given", false},
                            {"cuda_context_bytes", JsonBytes(m.cuda_context)},
                            {"cublas_workspaces_bytes", JsonBytes(m.cublas_workspaces)},
                            {"nccl_buffers_bytes", JsonBytes(m.nccl_buffers)},
                            {"nccl_communicators", m.communicators},
                            {"fragmentation_bytes", JsonBytes(m.fragmentation)}};
      }
      stage["fits"] = StageNeeds(r, i) <= static_cast<PlanBytes>(r.gpu.hbm_bytes);
    } else {
      stage["memory"]["activations"] = nullptr;
      stage["memory"]["buffers"] = nullptr;
      stage["memory"]["peak"] = nullptr;
      stage["reserved_bytes"] = nullptr;
    }
    if (r.executor) {
      const ExecutorActivations& a = (*r.executor)[i];
      stage["executor"] = {{"peak_stashes", a.peak_stashes},
                           {"stashes", JsonBytes(a.stashes)},
                           {"working", JsonBytes(a.working)},
                           {"transfers", JsonBytes(a.transfers)},
                           {"carried", JsonBytes(a.carried)},
                           {"optimizer_step", JsonBytes(a.optimizer_step)},
                           {"activations", JsonBytes(a.peak())}};
    } else {
      stage["executor"] = nullptr;
    }
    stage["parameter_elements"] = JsonBytes(s.held.parameter_elements);
    stage["expert_elements"] = JsonBytes(s.held.expert_elements);
    if (time) {
      const StageTime& st = time->stages[i];
      stage["time"] = {
          {"forward_s", st.forward_s}, {"backward_s", st.backward_s}, {"flops", st.flops}};
    }
    if (!r.other_optimizer.empty()) {
      stage[distributed ? "optimizer_if_plain" : "optimizer_if_distributed"] =
          JsonBytes(r.other_optimizer[i]);
    }
    list.push_back(stage);
  }
  doc["stages"] = list;
  doc["model_parts"] = ModelParts(config);
  if (!r.executor_missing.empty()) doc["executor_missing"] = r.executor_missing;
  doc["not_modelled"] = NotModelled(config);
  return doc;
}

}  // namespace mpusim::cli
