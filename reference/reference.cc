// BuildReference: the layer chain's and the GPT's references behind one contract (see
// reference.h).
#include "reference/reference.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "core/config/field_table.h"
#include "reference/gpt_reference.h"
#include "reference/reference_model.h"

namespace mpusim {
namespace {

const std::map<std::string, Tensor>& OverridesOf(const ReferenceRequest& request) {
  static const std::map<std::string, Tensor> kNone;
  return request.parameter_overrides != nullptr ? *request.parameter_overrides : kNone;
}

// A 16-bit main_grad (an fp16 run's by default: core/config/optimizer_config.h PrecisionOf)
// is accumulated and reduced in the storage dtype: each of the M micro-batches' contributions
// is added to it, and the data-parallel all-reduce (and the tp one of a replicated
// parameter) adds the ranks' partial sums in it, each sum rounded once. At most M + W
// roundings, W the ranks of one pipeline stage (which hold every dp, cp, tp and ep rank of a
// reduction). A float32 main_grad's sums are float32 ones, which the budgets' terms count.
// The precision-aware optimizer then clips main_grad itself, in its dtype (Megatron hands
// FusedAdam the main_grad shard as decoupled_grad; clip_grad_by_total_norm_fp32 scales it in
// place): one rounding more when clipping is on.
double MainGradRoundings(const Config& config) {
  const OptimizerPrecision precision = PrecisionOf(config);
  if (DTypeSize(precision.main_grad) != 2) return 0;
  const int64_t pp = std::max<int64_t>(1, config.parallel.pipeline_model_parallel_size);
  const bool clipped_in_place =
      !precision.grads_copied_for_step && config.optimizer && config.optimizer->clip_grad > 0;
  return static_cast<double>(config.run->num_microbatches + config.parallel.world_size / pp +
                             (clipped_in_place ? 1 : 0));
}

// Every parameter gradient of `result` charged `roundings` more (MainGradRoundings).
StatusOr<ReferenceResult> ChargeMainGrad(StatusOr<ReferenceResult> result, double roundings) {
  if (!result.ok() || roundings == 0) return result;
  for (ReferenceTensor& t : result->tensors) {
    if (!t.gradient_of.empty()) t.budget.roundings += roundings;
  }
  return result;
}

// The layer chain: token rows, split evenly over every rank of the job.
class ChainReference final : public Reference {
 public:
  explicit ChainReference(const Config& config)
      : parallel_(config.parallel),
        model_(*config.model),
        run_(*config.run),
        main_grad_roundings_(MainGradRoundings(config)) {}

  int64_t Units() const override { return ReferenceRows(parallel_, run_); }
  std::string_view UnitName() const override { return "token rows"; }
  int64_t RowsPerUnit() const override { return 1; }
  ReferenceSplit SplitFor(const RankCoordinates&, int world_rank, int world_size) const override {
    const auto edge = [&](int k) {
      return static_cast<int64_t>(static_cast<__int128>(k) * Units() / world_size);
    };
    return {{edge(world_rank), edge(world_rank + 1)}, 0, world_rank, world_size};
  }
  StatusOr<std::vector<ReferenceParameter>> Parameters() const override {
    return ReferenceParameters(parallel_, model_, run_);
  }
  StatusOr<ReferenceResult> Run(const ReferenceRequest& request) const override {
    return ChargeMainGrad(RunReferenceWithOverrides(parallel_, model_, run_, OverridesOf(request),
                                                    request.slice, request.iteration),
                          main_grad_roundings_);
  }
  std::string SplitText(int world_size) const override {
    return fmt::format("computed once, split over {} ranks by token rows", world_size);
  }
  std::string_view BudgetText() const override {
    return "grows with the tensor's reduction lengths";
  }
  // The token rows, the padded vocabulary (tp) and the dropout masks, which the chain draws
  // per rank: conservatively, the whole layout.
  nlohmann::json LayoutIdentity() const override {
    return {{"token_rows", Units()}, {"parallel", EchoFields(ParallelFields(), parallel_)}};
  }

 private:
  ParallelConfig parallel_;
  ModelConfig model_;
  RunConfig run_;
  double main_grad_roundings_;  // MainGradRoundings
};

// The GPT: samples; the ranks of one tensor-, context- and pipeline-parallel coordinate split
// them by their data-parallel rank (each computes the b samples its own records hold).
class GptReference final : public Reference {
 public:
  GptReference(const Config& config, GptConfig gpt)
      : parallel_(config.parallel),
        run_(*config.run),
        gpt_(std::move(gpt)),
        main_grad_roundings_(MainGradRoundings(config)) {}

  int64_t Units() const override { return GptReferenceSamples(parallel_, run_); }
  std::string_view UnitName() const override { return "samples"; }
  int64_t RowsPerUnit() const override { return run_.seq_length; }
  ReferenceSplit SplitFor(const RankCoordinates& coords, int world_rank, int) const override {
    // "global_aux_loss" needs every dp rank's routing counts: each rank computes the whole
    // batch, a group of its own.
    if (gpt_.moe.enabled() && gpt_.moe.AuxLossCoeff(MoeLoadBalancing::kGlobalAuxLoss) > 0) {
      return {{0, Units()}, world_rank, 0, 1};
    }
    const int64_t b = run_.micro_batch_size;
    const int64_t tp = parallel_.tensor_model_parallel_size;
    const int64_t cp = parallel_.context_parallel_size;
    return {{coords.dp * b, coords.dp * b + b},
            static_cast<int>((coords.pp * cp + coords.cp) * tp + coords.tp),
            static_cast<int>(coords.dp),
            static_cast<int>(Units() / b)};
  }
  StatusOr<std::vector<ReferenceParameter>> Parameters() const override {
    std::vector<ReferenceParameter> out;
    for (const GptParameter& p :
         GptParameters(gpt_, gpt_.PaddedVocabSize(parallel_.tensor_model_parallel_size), false)) {
      out.push_back({p.name, p.shape, p.init});
    }
    return out;
  }
  StatusOr<ReferenceResult> Run(const ReferenceRequest& request) const override {
    GptReferenceOptions options;
    options.slice = request.slice;
    options.iteration = request.iteration;
    options.parameter_overrides = OverridesOf(request);
    return ChargeMainGrad(RunGptReference(gpt_, parallel_, run_, options), main_grad_roundings_);
  }
  std::string SplitText(int) const override {
    if (gpt_.moe.enabled() && gpt_.moe.AuxLossCoeff(MoeLoadBalancing::kGlobalAuxLoss) > 0) {
      return "each rank computes the whole batch (global_aux_loss counts over every "
             "data-parallel rank)";
    }
    return "each rank computes its data-parallel rank's samples";
  }
  void FinishIteration(ReferenceResult& result, bool trained,
                       std::map<std::string, Tensor>* state) const override {
    FinishGptReferenceIteration(gpt_, result, trained, state);
  }
  std::string_view BudgetText() const override { return "for the model's longest path"; }
  // The samples of a micro-batch and the padded vocabulary; an MoE model's routing groups
  // (each data-parallel rank's b samples, cut over tp and cp); with dropout_mode "rng_tracker"
  // the masks each rank draws: the whole layout.
  nlohmann::json LayoutIdentity() const override {
    const int64_t tp = parallel_.tensor_model_parallel_size;
    nlohmann::json id = {{"samples", Units()}, {"padded_vocab_size", gpt_.PaddedVocabSize(tp)}};
    if (gpt_.moe.enabled()) {
      const auto key = [](std::string_view k) { return std::string(k); };
      id["moe_routing"] = {
          {key(RunKey(&RunConfig::micro_batch_size)), run_.micro_batch_size},
          {key(ParallelKey(&ParallelConfig::tensor_model_parallel_size)), tp},
          {key(ParallelKey(&ParallelConfig::context_parallel_size)),
           parallel_.context_parallel_size},
          {key(ParallelKey(&ParallelConfig::sequence_parallel)),
           parallel_.sequence_parallel && tp > 1}};
    }
    if (gpt_.dropout_mode == DropoutMode::kRngTracker) {
      id["parallel"] = EchoFields(ParallelFields(), parallel_);
    }
    return id;
  }

 private:
  ParallelConfig parallel_;
  RunConfig run_;
  GptConfig gpt_;
  double main_grad_roundings_;  // MainGradRoundings
};

}  // namespace

const ReferenceTensor* ReferenceResult::Find(std::string_view name) const {
  for (const ReferenceTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

StatusOr<std::unique_ptr<Reference>> BuildReference(const Config& config) {
  if (!config.run) return Status::Error("run", "the reference needs a run section");
  if (config.gpt) {
    // The GPT as the executor resolves it for the layout (GptModel::Build does the same).
    GptConfig gpt = *config.gpt;
    MPUSIM_RETURN_IF_ERROR(CheckGptLayout(config.parallel, *config.run, &gpt));
    return std::unique_ptr<Reference>(std::make_unique<GptReference>(config, std::move(gpt)));
  }
  if (!config.model) return Status::Error("model", "the reference needs a model section");
  return std::unique_ptr<Reference>(std::make_unique<ChainReference>(config));
}

}  // namespace mpusim
