// PyTorch's tensor-parallel styles as placements (core/tensor_parallel/parallel_style.h): each
// style on each module it takes gives the parameters, input and output placements written by
// hand from torch/distributed/tensor/parallel/style.py (its partition functions and the
// defaults of input_layouts, desired_input_layouts and output_layouts); PyTorch 2.0's
// spellings mean what they meant; plans parse, FQN patterns match one path component per '*',
// and every refusal names the plan entry.
#include "core/tensor_parallel/parallel_style.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace mpusim {
namespace {

using nlohmann::json;

// "weight Shard(0), bias Shard(0) | Replicate() -> Replicate() | Shard(2) -> Shard(2) local".
std::string Describe(const json& style_json, TorchModuleKind module, int64_t input_ndim = 3,
                     int64_t output_ndim = 3) {
  StatusOr<ParallelStyle> style = ParseParallelStyle(style_json, "parallelize_plan.m");
  if (!style.ok()) return style.status().Message();
  StatusOr<StyledModule> m = ApplyParallelStyle(*style, module, input_ndim, output_ndim, "m");
  if (!m.ok()) return m.status().Message();
  const auto name = [](const std::optional<DTensorPlacement>& p) {
    return p ? DTensorPlacementName(*p) : std::string("-");
  };
  std::string out;
  for (const auto& [param, p] : m->parameters) {
    out += (out.empty() ? "" : ", ") + param + " " + DTensorPlacementName(p);
  }
  return out + " | " + name(m->input_given) + " -> " + name(m->input_desired) + " | " +
         name(m->output_produced) + " -> " + name(m->output_given) +
         (m->use_local_output ? " local" : " dtensor");
}

TEST(ParallelStyle, EachStyleOnEachModuleIsTorchs) {
  EXPECT_EQ(Describe("ColwiseParallel", TorchModuleKind::kLinear),
            "weight Shard(0), bias Shard(0) | Replicate() -> Replicate() | Shard(2) -> Shard(2) "
            "local");
  EXPECT_EQ(Describe("RowwiseParallel", TorchModuleKind::kLinear),
            "weight Shard(1), bias Replicate() | Shard(2) -> Shard(2) | Partial() -> "
            "Replicate() local");
  // Embeddings take [b, s] token ids: Colwise splits the embedding dim, Rowwise the vocabulary
  // (its input redistributed to Replicate(), its output a partial sum).
  EXPECT_EQ(Describe("ColwiseParallel", TorchModuleKind::kEmbedding, 2),
            "weight Shard(1) | Replicate() -> Replicate() | Shard(2) -> Shard(2) local");
  EXPECT_EQ(Describe({{"style", "RowwiseParallel"}, {"input_layouts", "Replicate()"}},
                     TorchModuleKind::kEmbedding, 2),
            "weight Shard(0) | Replicate() -> Replicate() | Partial() -> Replicate() local");
  EXPECT_EQ(Describe("RowwiseParallel", TorchModuleKind::kEmbedding, 2),
            "weight Shard(0) | Shard(1) -> Replicate() | Partial() -> Replicate() local");
  // torchtitan's sequence-parallel pair: the colwise input gathered from the sequence shard,
  // the rowwise output reduce-scattered back to it.
  EXPECT_EQ(Describe({{"style", "ColwiseParallel"}, {"input_layouts", "Shard(1)"}},
                     TorchModuleKind::kLinear),
            "weight Shard(0), bias Shard(0) | Shard(1) -> Replicate() | Shard(2) -> Shard(2) "
            "local");
  EXPECT_EQ(Describe({{"style", "RowwiseParallel"}, {"output_layouts", "Shard(1)"}},
                     TorchModuleKind::kLinear),
            "weight Shard(1), bias Replicate() | Shard(2) -> Shard(2) | Partial() -> Shard(1) "
            "local");
  EXPECT_EQ(Describe("SequenceParallel", TorchModuleKind::kLayerNorm),
            "weight Replicate(), bias Replicate() | Shard(1) -> Shard(1) | Shard(1) -> Shard(1) "
            "dtensor");
  EXPECT_EQ(
      Describe({{"style", "SequenceParallel"}, {"sequence_dim", 0}}, TorchModuleKind::kDropout),
      " | Shard(0) -> Shard(0) | Shard(0) -> Shard(0) dtensor");
  EXPECT_EQ(Describe({{"style", "PrepareModuleInput"},
                      {"input_layouts", "Shard(1)"},
                      {"desired_input_layouts", "Replicate()"}},
                     TorchModuleKind::kOther),
            " | Shard(1) -> Replicate() | - -> - dtensor");
  EXPECT_EQ(Describe({{"style", "PrepareModuleOutput"},
                      {"output_layouts", "Replicate()"},
                      {"desired_output_layouts", "Shard(1)"}},
                     TorchModuleKind::kOther),
            " | - -> - | Replicate() -> Shard(1) local");
}

// PyTorch 2.0's prepare functions: Colwise's default pair (replicate in, sharded tensor out)
// and Rowwise's (last-dim shard in, replicated tensor out), and the DTensor-returning ones.
TEST(ParallelStyle, PyTorch2SpellingsMeanWhatTheyMeant) {
  EXPECT_EQ(Describe({{"style", "ColwiseParallel"},
                      {"_prepare_input", "make_input_replicate_1d"},
                      {"_prepare_output", "make_sharded_output_tensor"}},
                     TorchModuleKind::kLinear),
            Describe("ColwiseParallel", TorchModuleKind::kLinear));
  EXPECT_EQ(Describe({{"style", "RowwiseParallel"},
                      {"_prepare_input", "make_input_shard_1d_last_dim"},
                      {"_prepare_output", "make_output_tensor"}},
                     TorchModuleKind::kLinear),
            Describe("RowwiseParallel", TorchModuleKind::kLinear));
  EXPECT_EQ(Describe({{"style", "RowwiseParallel"}, {"_prepare_output", "make_output_shard_1d"}},
                     TorchModuleKind::kLinear),
            "weight Shard(1), bias Replicate() | Shard(2) -> Shard(2) | Partial() -> Shard(0) "
            "dtensor");
  EXPECT_EQ(Describe({{"style", "ColwiseParallel"},
                      {"_prepare_input", "make_input_reshard_replicate"},
                      {"_prepare_output", "make_output_replicate_1d"}},
                     TorchModuleKind::kLinear),
            "weight Shard(0), bias Shard(0) | Shard(0) -> Replicate() | Shard(2) -> Replicate() "
            "dtensor");
}

TEST(ParallelStyle, RefusalsNameThePlanEntry) {
  EXPECT_EQ(Describe("ColwiseParallel", TorchModuleKind::kLayerNorm),
            "parallelize_plan.m: ColwiseParallel applies to Linear and Embedding modules only "
            "(\"ColwiseParallel currently only support nn.Linear and nn.Embedding!\")");
  EXPECT_EQ(Describe("SequenceParallel", TorchModuleKind::kLinear),
            "parallelize_plan.m: SequenceParallel applies to LayerNorm, RMSNorm and Dropout "
            "modules (their computation runs on the sequence shard)");
  EXPECT_EQ(Describe("ColWiseParallel", TorchModuleKind::kLinear),
            "parallelize_plan.m: \"ColWiseParallel\" is not a parallel style; use one of "
            "\"ColwiseParallel\", \"RowwiseParallel\", \"PairwiseParallel\", "
            "\"SequenceParallel\", \"PrepareModuleInput\", \"PrepareModuleOutput\"");
  EXPECT_EQ(Describe({{"style", "RowwiseParallel"}, {"output_layout", "Shard(1)"}},
                     TorchModuleKind::kLinear),
            "parallelize_plan.m.output_layout: is not a keyword of RowwiseParallel; allowed: "
            "input_layouts, desired_input_layouts, output_layouts, desired_output_layouts, "
            "use_local_output, sequence_dim, _prepare_input, _prepare_output");
  EXPECT_EQ(Describe({{"style", "RowwiseParallel"}, {"output_layouts", "Shard(3)"}},
                     TorchModuleKind::kLinear),
            "parallelize_plan.m: \"Shard(3)\": dim 3 is out of range for a tensor of 3 "
            "dimensions (allowed [-3, 2])");
  EXPECT_EQ(Describe({{"style", "ColwiseParallel"}, {"_prepare_output", "make_output"}},
                     TorchModuleKind::kLinear),
            "parallelize_plan.m._prepare_output: \"make_output\" is not one of PyTorch 2.0's "
            "output functions: \"make_output_replicate_1d\", \"make_output_shard_1d\", "
            "\"make_output_tensor\", \"make_output_reshard_tensor\", "
            "\"make_sharded_output_tensor\"");
  EXPECT_EQ(Describe({{"style", "PrepareModuleInput"}, {"input_layouts", "Shard(1)"}},
                     TorchModuleKind::kOther),
            "parallelize_plan.m: PrepareModuleInput needs input_layouts and "
            "desired_input_layouts together (\"desired module inputs should not be None!\")");
}

TEST(ParallelStyle, PlansParseAndPatternsMatchOneComponentPerStar) {
  StatusOr<ParallelizePlan> whole = ParseParallelizePlan("PairwiseParallel", "parallelize_plan");
  ASSERT_TRUE(whole.ok()) << whole.status().Message();
  ASSERT_EQ(whole->entries.size(), 1u);
  EXPECT_EQ(whole->entries[0].first, "");
  EXPECT_EQ(whole->entries[0].second.kind, ParallelStyleKind::kPairwise);
  StatusOr<ParallelizePlan> plan = ParseParallelizePlan(
      json{{"decoder.layers.*.mlp.linear_fc1", "ColwiseParallel"},
           {"decoder.layers.*.mlp.linear_fc2", {{"style", "RowwiseParallel"}}}},
      "parallelize_plan");
  ASSERT_TRUE(plan.ok()) << plan.status().Message();
  EXPECT_EQ(plan->entries.size(), 2u);
  EXPECT_TRUE(FqnMatches("decoder.layers.*.mlp.linear_fc1", "decoder.layers.3.mlp.linear_fc1"));
  EXPECT_FALSE(FqnMatches("decoder.layers.*.mlp.linear_fc1", "decoder.layers.3.mlp.linear_fc2"));
  EXPECT_FALSE(FqnMatches("decoder.layers.*", "decoder.layers.3.mlp"));
  EXPECT_FALSE(FqnMatches("decoder.*.mlp", "decoder.layers.3.mlp"));
  EXPECT_TRUE(FqnMatches("*", "fc1"));
  EXPECT_TRUE(FqnMatches("fc1", "fc1"));
  EXPECT_FALSE(FqnMatches("fc1", "fc10"));
  // fnmatch within a component, as parallelize_module matches each one.
  EXPECT_TRUE(FqnMatches("norm*", "norm"));
  EXPECT_TRUE(FqnMatches("norm*", "norm2"));
  EXPECT_TRUE(FqnMatches("*_proj", "in_proj"));
  EXPECT_TRUE(FqnMatches("fc?", "fc2"));
  EXPECT_FALSE(FqnMatches("fc?", "fc10"));
  EXPECT_FALSE(FqnMatches("norm*", "a.norm"));
  EXPECT_FALSE(FqnMatches("*_proj", "in_proj.weight"));
  EXPECT_TRUE(FqnMatches("a*b*c", "aXbYbZc"));
  EXPECT_FALSE(FqnMatches("a*b*c", "aXbYbZ"));
  StatusOr<ParallelizePlan> bad =
      ParseParallelizePlan(json{{"fc1..w", "ColwiseParallel"}}, "parallelize_plan");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().Message(),
            "parallelize_plan: \"fc1..w\" is not a module FQN (dot-separated names, '*' for "
            "one of them)");
  StatusOr<ParallelizePlan> empty = ParseParallelizePlan(json::object(), "parallelize_plan");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().Message(),
            "parallelize_plan: must be a style (\"PairwiseParallel\") or an object from module "
            "FQN to style ({\"fc1\": \"ColwiseParallel\"})");
}

}  // namespace
}  // namespace mpusim
