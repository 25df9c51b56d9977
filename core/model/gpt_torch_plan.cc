// A PyTorch plan over the GPT's modules against Megatron's own (see gpt_torch_plan.h).
#include "core/model/gpt_torch_plan.h"

#include <fmt/format.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor_parallel/parallel_style.h"

namespace mpusim {
namespace {

struct GptModule {
  TorchModuleKind kind = TorchModuleKind::kOther;
  std::optional<ParallelStyle> megatron;  // the style Megatron's layout is; none: replicated
};

// "ColwiseParallel(input_layouts=Shard(1))".
std::string Spelled(const ParallelStyle& s) {
  std::vector<std::string> args;
  if (s.input_layouts) args.push_back("input_layouts=" + *s.input_layouts);
  if (s.output_layouts) args.push_back("output_layouts=" + *s.output_layouts);
  if (s.desired_output_layouts) {
    args.push_back("desired_output_layouts=" + *s.desired_output_layouts);
  }
  std::string out(ParallelStyleName(s.kind));
  if (!args.empty()) out += fmt::format("({})", fmt::join(args, ", "));
  return out;
}

// The GPT's modules in state-dict order, from its parameters, each with Megatron's style.
std::vector<std::pair<std::string, GptModule>> Modules(const GptConfig& gpt, bool sp) {
  std::vector<std::pair<std::string, GptModule>> modules;
  const bool learned = gpt.position_embedding_type == PositionEmbedding::kLearnedAbsolute;
  const auto add = [&](const std::string& name, TorchModuleKind kind, int tp_dim) {
    for (const auto& [known, module] : modules) {
      if (known == name) return;
    }
    GptModule m;
    m.kind = kind;
    ParallelStyle s;
    if (kind == TorchModuleKind::kEmbedding && tp_dim == 0) {
      s.kind = ParallelStyleKind::kRowwise;
      s.input_layouts = "Replicate()";
      s.output_layouts = sp && !learned ? "Shard(1)" : "Replicate()";
      m.megatron = s;
    } else if (kind == TorchModuleKind::kLinear && tp_dim == 0) {
      s.kind = ParallelStyleKind::kColwise;
      if (sp) s.input_layouts = "Shard(1)";
      m.megatron = s;
    } else if (kind == TorchModuleKind::kLinear && tp_dim == 1) {
      s.kind = ParallelStyleKind::kRowwise;
      if (sp) s.output_layouts = "Shard(1)";
      m.megatron = s;
    } else if ((kind == TorchModuleKind::kLayerNorm || kind == TorchModuleKind::kRMSNorm) && sp) {
      s.kind = ParallelStyleKind::kSequenceParallel;
      m.megatron = s;
    }
    modules.emplace_back(name, m);
  };
  // With learned absolute positions Megatron sums the word embeddings whole (all-reduce),
  // adds the positions and only then scatters the sequence (LanguageModelEmbedding's
  // reduce_scatter_embeddings is false): the embedding module hands on Shard(1) itself.
  if (learned && sp) {
    GptModule embedding;
    ParallelStyle s;
    s.kind = ParallelStyleKind::kPrepareModuleOutput;
    s.output_layouts = "Replicate()";
    s.desired_output_layouts = "Shard(1)";
    embedding.megatron = s;
    modules.emplace_back("embedding", embedding);
  }
  for (const GptParameter& p : GptParameters(gpt, gpt.vocab_size, sp)) {
    const size_t dot = p.name.rfind('.');
    if (p.name.substr(dot + 1) != "weight") continue;
    const std::string module = p.name.substr(0, dot);
    const std::string leaf = module.substr(module.rfind('.') + 1);
    TorchModuleKind kind = TorchModuleKind::kLinear;
    if (module.starts_with("embedding.")) {
      kind = TorchModuleKind::kEmbedding;
    } else if (leaf.find("norm") != std::string::npos) {
      kind = gpt.normalization == Normalization::kRMSNorm ? TorchModuleKind::kRMSNorm
                                                          : TorchModuleKind::kLayerNorm;
    }
    add(module, kind, p.tp_dim);
  }
  // A tied output layer multiplies by the word embedding (vocab rows split): a Colwise Linear.
  if (gpt.share_embeddings_and_output_weights) add("output_layer", TorchModuleKind::kLinear, 0);
  return modules;
}

// Whether two styles make the same placements of a module.
bool SamePlacements(const ParallelStyle& a, const ParallelStyle& b, TorchModuleKind kind) {
  const int64_t in_ndim = kind == TorchModuleKind::kEmbedding ? 2 : 3;
  StatusOr<StyledModule> x = ApplyParallelStyle(a, kind, in_ndim, 3, "");
  StatusOr<StyledModule> y = ApplyParallelStyle(b, kind, in_ndim, 3, "");
  if (!x.ok() || !y.ok()) return false;
  return a.kind == b.kind && x->parameters == y->parameters && x->input_given == y->input_given &&
         x->output_produced == y->output_produced && x->output_given == y->output_given;
}

}  // namespace

Status CheckMegatronPlan(const ParallelizePlan& plan, const GptConfig& gpt,
                         bool sequence_parallel) {
  if (gpt.moe.enabled() || gpt.mla.enabled) {
    return Status::Error("parallelize_plan",
                         fmt::format("plans over a GPT with {} are not built (their modules "
                                     "have no PyTorch style here); set tensor_model_parallel_size "
                                     "and sequence_parallel instead",
                                     gpt.moe.enabled() ? "MoE layers" : "multi-latent attention"));
  }
  if (plan.entries.size() == 1 && plan.entries.front().first.empty()) {
    return Status::Error(
        "parallelize_plan",
        fmt::format("{} on the whole GPT is not Megatron's plan (PyTorch 2.0's pairing leaves "
                    "the word embeddings and the output layer replicated; Megatron splits their "
                    "vocabulary); name the modules: {{\"embedding.word_embeddings\": ..., "
                    "\"decoder.layers.*.self_attention.linear_qkv\": \"ColwiseParallel\", ...}}",
                    ParallelStyleName(plan.entries.front().second.kind)));
  }
  const std::vector<std::pair<std::string, GptModule>> modules = Modules(gpt, sequence_parallel);
  std::map<std::string, std::pair<std::string, const ParallelStyle*>> given;
  for (const auto& [pattern, style] : plan.entries) {
    const std::string where = "parallelize_plan." + pattern;
    bool matched = false;
    for (const auto& [name, module] : modules) {
      if (!FqnMatches(pattern, name)) continue;
      matched = true;
      const auto [it, fresh] = given.try_emplace(name, where, &style);
      if (!fresh) {
        return Status::Error(where, fmt::format("styles module \"{}\", which {} styles too; give "
                                                "each module one style",
                                                name, it->second.first));
      }
    }
    if (!matched) {
      return Status::Error(where, fmt::format("matches no module of the GPT (its modules are "
                                              "state-dict names such as "
                                              "\"decoder.layers.0.mlp.linear_fc1\"; mpusim "
                                              "explain lists them)"));
    }
  }
  const std::string layout = fmt::format("Megatron's layout{} gives it",
                                         sequence_parallel ? " with sequence parallelism" : "");
  // A plan written for the sequence-parallel layout, given a config without it.
  const auto hint = [&](const ParallelStyle& s) {
    const bool sequence = s.kind == ParallelStyleKind::kSequenceParallel ||
                          s.input_layouts.value_or("").find("Shard(1)") != std::string::npos ||
                          s.output_layouts.value_or("").find("Shard(1)") != std::string::npos;
    return sequence && !sequence_parallel
               ? std::string(
                     "; set parallel.sequence_parallel true for Megatron's "
                     "sequence-parallel layout")
               : std::string();
  };
  for (const auto& [name, module] : modules) {
    const auto it = given.find(name);
    if (it == given.end()) {
      if (!module.megatron) continue;
      return Status::Error(
          "parallelize_plan",
          fmt::format("has no style for \"{}\", but {} {}{}", name, layout,
                      Spelled(*module.megatron),
                      name == "embedding" ? " (it adds the learned absolute positions to the "
                                            "whole sum, then scatters the sequence)"
                                          : ""));
    }
    const auto& [where, style] = it->second;
    if (!module.megatron) {
      return Status::Error(where, fmt::format("styles \"{}\" with {}, but Megatron's layout keeps "
                                              "it whole on every rank (no style){}",
                                              name, Spelled(*style), hint(*style)));
    }
    if (!SamePlacements(*style, *module.megatron, module.kind)) {
      return Status::Error(
          where, fmt::format("styles \"{}\" with {}, but {} {}{}", name, Spelled(*style), layout,
                             Spelled(*module.megatron), hint(*style)));
    }
  }
  return {};
}

}  // namespace mpusim
