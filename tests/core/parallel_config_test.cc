// Config parsing and every validation the planner performs: each refused input names its
// field and says what is allowed.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/topology.h"

namespace mpusim {
namespace {

using nlohmann::json;

// Parses {"parallel": parallel} and plans it; returns the error ("" when accepted).
std::string Refusal(const json& parallel) {
  Config config;
  Status status = ParseConfig(json{{"parallel", parallel}}, &config);
  if (!status.ok()) return status.Message();
  StatusOr<Topology> topology = Topology::Create(config.parallel);
  return topology.ok() ? "" : topology.status().Message();
}

TEST(ParallelConfig, DefaultsFollowMegatron) {
  Config config;
  ASSERT_TRUE(ParseConfig(json{{"parallel", {{"world_size", 8}}}}, &config).ok());
  const ParallelConfig& p = config.parallel;
  EXPECT_EQ(p.gpus_per_node, 8);
  EXPECT_EQ(p.tensor_model_parallel_size, 1);
  EXPECT_EQ(p.pipeline_model_parallel_size, 1);
  EXPECT_FALSE(p.virtual_pipeline_model_parallel_size.has_value());
  EXPECT_EQ(p.order, "tp-cp-ep-dp-pp");
  EXPECT_EQ(p.EffectiveExpertTensorParallelSize(), 1);
  EXPECT_EQ(p.num_distributed_optimizer_instances, 1);
}

TEST(ParallelConfig, RoundTripsThroughJson) {
  const json parallel = {{"world_size", 16},
                         {"tensor_model_parallel_size", 2},
                         {"pipeline_model_parallel_size", 2},
                         {"virtual_pipeline_model_parallel_size", 2},
                         {"context_parallel_size", 2},
                         {"hierarchical_context_parallel_sizes", {2}},
                         {"expert_tensor_parallel_size", 1},
                         {"order", "tp-cp-ep-dp-pp"},
                         {"num_layers", 8},
                         {"bf16", true},
                         {"params_dtype", "bfloat16"}};
  ParallelConfig a;
  ASSERT_TRUE(ParseParallelSection(parallel, "parallel", &a).ok());
  json written;
  ToJson(a, &written);
  ParallelConfig b;
  ASSERT_TRUE(ParseParallelSection(written, "parallel", &b).ok());
  json rewritten;
  ToJson(b, &rewritten);
  EXPECT_EQ(written, rewritten);
  EXPECT_EQ(written["virtual_pipeline_model_parallel_size"], 2);
  EXPECT_EQ(written["hierarchical_context_parallel_sizes"], json({2}));
}

// PyTorch's init_device_mesh: row-major ranks over the mesh (the last dimension fastest), so
// "tp" last is Megatron's default order (tp fastest) and "tp" first puts dp fastest.
TEST(ParallelConfig, DeviceMeshLaysOutRanksAsInitDeviceMesh) {
  for (const bool tp_last : {true, false}) {
    SCOPED_TRACE(tp_last ? "[dp, tp]" : "[tp, dp]");
    const json mesh = tp_last ? json{{"mesh_shape", {2, 4}}, {"mesh_dim_names", {"dp", "tp"}}}
                              : json{{"mesh_shape", {4, 2}}, {"mesh_dim_names", {"tp", "dp"}}};
    Config config;
    ASSERT_TRUE(ParseConfig(json{{"parallel", {{"device_mesh", mesh}}}}, &config).ok());
    EXPECT_EQ(config.parallel.world_size, 8);
    EXPECT_EQ(config.parallel.tensor_model_parallel_size, 4);
    StatusOr<Topology> topology = Topology::Create(config.parallel);
    ASSERT_TRUE(topology.ok()) << topology.status().Message();
    for (int64_t rank = 0; rank < 8; ++rank) {
      // init_device_mesh: mesh[i][j] = i * cols + j.
      const int64_t tp = tp_last ? rank % 4 : rank / 2;
      const int64_t dp = tp_last ? rank / 4 : rank % 2;
      const RankCoordinates c = topology->Coordinates(rank);
      EXPECT_EQ(c.tp, tp) << "rank " << rank;
      EXPECT_EQ(c.dp, dp) << "rank " << rank;
    }
    // The effective config (every key written back) reads the same.
    json written;
    ToJson(config.parallel, &written);
    ParallelConfig again;
    ASSERT_TRUE(ParseParallelSection(written, "parallel", &again).ok());
    EXPECT_EQ(again.order, config.parallel.order);
  }
  const json mesh = {{"mesh_shape", {2, 2}}, {"mesh_dim_names", {"dp", "tp"}}};
  EXPECT_EQ(Refusal({{"device_mesh", mesh}, {"tensor_model_parallel_size", 4}}),
            "parallel.tensor_model_parallel_size: is 4 but device_mesh's \"tp\" dimension is 2; "
            "set one of them");
  EXPECT_EQ(Refusal({{"device_mesh", mesh}, {"world_size", 8}}),
            "parallel.world_size: is 8 but device_mesh covers 4 ranks; set one of them");
  EXPECT_NE(Refusal({{"device_mesh", mesh}, {"pipeline_model_parallel_size", 2}})
                .find("parallel.pipeline_model_parallel_size: cannot be set with device_mesh"),
            std::string::npos);
  EXPECT_EQ(Refusal({{"device_mesh", {{"mesh_shape", {2, 2}}, {"mesh_dim_names", {"dp", "ep"}}}}}),
            "parallel.device_mesh.mesh_dim_names: names \"dp\" and \"tp\" only (the dimensions "
            "mpusim's layouts have), got string \"ep\"");
  EXPECT_NE(Refusal({{"device_mesh", {{"mesh_shape", {2, 2}}, {"mesh_dim_names", {"tp"}}}}})
                .find("mesh_shape has 2 sizes and mesh_dim_names 1 names"),
            std::string::npos);
  EXPECT_EQ(Refusal({{"device_mesh", {{"mesh_shape", {4}}, {"mesh_dim_names", {"tp"}}}}}), "");
}

// ModelParallelConfig's other fields (seed 003): accepted with a note saying why they change
// nothing mpusim computes, or refused when their value would change what it models.
TEST(ParallelConfig, ModelParallelConfigFieldsAreAcceptedOrRefusedWithAReason) {
  Config config;
  ASSERT_TRUE(ParseConfig(json{{"parallel",
                                {{"world_size", 8},
                                 {"tp_comm_overlap_ag", true},
                                 {"deallocate_pipeline_outputs", true},
                                 {"timers", nullptr},
                                 {"variable_seq_lengths", false}}}},
                          &config)
                  .ok());
  ASSERT_EQ(config.parallel.ignored.size(), 4u);
  EXPECT_EQ(config.parallel.ignored[0],
            "parallel.deallocate_pipeline_outputs: ignored: frees pipeline outputs early: memory, "
            "not values");
  EXPECT_EQ(config.parallel.ignored[2],
            "parallel.tp_comm_overlap_ag: ignored: overlaps communication with computation, which "
            "changes timing, not results");
  EXPECT_EQ(Refusal({{"world_size", 8}, {"moe_extended_tp", true}}),
            "parallel.moe_extended_tp: boolean true: the extended expert tensor parallelism is not "
            "modelled; only false is accepted");
  EXPECT_EQ(Refusal({{"world_size", 8}, {"variable_seq_lengths", true}}),
            "parallel.variable_seq_lengths: boolean true: every micro-batch has run.seq_length "
            "tokens; only false is accepted");
  EXPECT_EQ(Refusal({{"world_size", 8}, {"timers", "wall"}}).rfind("parallel.timers: string", 0),
            0u);
}

TEST(ParallelConfig, SchemaErrorsNameTheField) {
  EXPECT_EQ(Refusal({{"tensor_model_parallel_size", 2}}),
            "parallel.world_size: is required (the number of ranks, e.g. \"world_size\": 16)");
  EXPECT_EQ(Refusal({{"world_size", 16}, {"tensor_parallel_size", 2}}),
            "parallel.tensor_parallel_size: unknown key; did you mean "
            "'tensor_model_parallel_size'?");
  EXPECT_EQ(Refusal({{"world_size", 16}, {"pipeline_model_paralel_size", 2}}),
            "parallel.pipeline_model_paralel_size: unknown key; did you mean "
            "'pipeline_model_parallel_size'?");
  EXPECT_EQ(Refusal({{"world_size", 16}, {"data_parallel_size", 2}}).rfind(
                "parallel.data_parallel_size: is derived, not set", 0),
            0u);
  EXPECT_EQ(Refusal({{"world_size", "16"}}),
            "parallel.world_size: must be an integer >= 1, got string \"16\"");
  EXPECT_EQ(Refusal({{"world_size", 16.0}}),
            "parallel.world_size: must be an integer >= 1, got number 16.0");
  EXPECT_EQ(Refusal({{"world_size", true}}),
            "parallel.world_size: must be an integer >= 1, got boolean true");
  EXPECT_EQ(Refusal({{"world_size", 0}}), "parallel.world_size: must be an integer >= 1, got 0");
  EXPECT_EQ(Refusal({{"world_size", 16}, {"tensor_model_parallel_size", -2}}),
            "parallel.tensor_model_parallel_size: must be an integer >= 1, got -2");
  EXPECT_EQ(Refusal({{"world_size", 4294967296LL}}),
            "parallel.world_size: must be at most 2147483647, got 4294967296");
  EXPECT_EQ(Refusal({{"world_size", 16}, {"rank_offset", -1}}),
            "parallel.rank_offset: must be an integer >= 0, got -1");
  EXPECT_EQ(Refusal({{"world_size", 16}, {"order", 5}}),
            "parallel.order: must be a string such as \"tp-cp-ep-dp-pp\", got number 5");
  EXPECT_EQ(Refusal({{"world_size", 16}, {"hierarchical_context_parallel_sizes", json::array()}})
                .rfind("parallel.hierarchical_context_parallel_sizes: must be null or a non-empty",
                       0),
            0u);
  EXPECT_EQ(Refusal({{"world_size", 16}, {"hierarchical_context_parallel_sizes", {2, 0}}}),
            "parallel.hierarchical_context_parallel_sizes[1]: must be an integer >= 1, got 0");
  EXPECT_EQ(Refusal(json::array()), "parallel: must be a JSON object, got array []");
}

TEST(ParallelConfig, TopLevelErrors) {
  Config config;
  Status status = ParseConfig(json{{"paralel", {{"world_size", 2}}}}, &config);
  EXPECT_EQ(status.Message(), "paralel: unknown top-level key; did you mean 'parallel'?");
  status = ParseConfig(json{{"description", "x"}}, &config);
  EXPECT_EQ(status.where(), "parallel");
  status = ParseConfig(json::array(), &config);
  EXPECT_FALSE(status.ok());
  status = ParseConfig(json{{"description", 3}, {"parallel", {{"world_size", 1}}}}, &config);
  EXPECT_EQ(status.Message(), "description: must be a string, got number");
}

// One storage dtype from Megatron's bf16 / fp16 / params_dtype and run.dtype.
TEST(ParallelConfig, MixedPrecisionFields) {
  auto parse = [](const json& parallel, const json& run, Config* config) {
    json document = {{"parallel", parallel}};
    if (!run.is_null()) document["run"] = run;
    return ParseConfig(document, config);
  };
  const json run = {{"seq_length", 4}};
  Config c;
  ASSERT_TRUE(parse({{"world_size", 2}, {"bf16", true}}, run, &c).ok());
  EXPECT_EQ(c.run->dtype, DType::kBFloat16);
  ASSERT_TRUE(parse({{"world_size", 2}, {"fp16", true}, {"params_dtype", "torch.float16"}}, run, &c)
                  .ok());
  EXPECT_EQ(c.run->dtype, DType::kFloat16);
  ASSERT_TRUE(parse({{"world_size", 2}, {"params_dtype", "bfloat16"}}, run, &c).ok());
  EXPECT_EQ(c.run->dtype, DType::kBFloat16);
  ASSERT_TRUE(parse({{"world_size", 2}}, {{"seq_length", 4}, {"dtype", "float16"}}, &c).ok());
  EXPECT_EQ(c.run->dtype, DType::kFloat16);
  ASSERT_TRUE(
      parse({{"world_size", 2}, {"bf16", true}}, {{"seq_length", 4}, {"dtype", "bfloat16"}}, &c)
          .ok());
  EXPECT_EQ(c.run->dtype, DType::kBFloat16);
  ASSERT_TRUE(parse({{"world_size", 2}}, run, &c).ok());
  EXPECT_EQ(c.run->dtype, DType::kFloat32);
  // Layout-only configs accept the fields too.
  EXPECT_EQ(Refusal({{"world_size", 2}, {"bf16", true}}), "");

  EXPECT_EQ(Refusal({{"world_size", 2}, {"bf16", true}, {"fp16", true}}),
            "parallel.bf16: cannot be true together with fp16 (Megatron refuses it too); choose "
            "one 16-bit format");
  EXPECT_EQ(Refusal({{"world_size", 2}, {"bf16", true}, {"params_dtype", "float32"}}),
            "parallel.params_dtype: must be \"bfloat16\" when bf16 is true (parameters, "
            "activations and gradients share one storage dtype), got \"float32\"");
  EXPECT_EQ(Refusal({{"world_size", 2}, {"params_dtype", "float64"}}),
            "parallel.params_dtype: must be \"float32\", \"bfloat16\", \"float16\" or null, got "
            "string \"float64\"");
  EXPECT_EQ(Refusal({{"world_size", 2}, {"params_dtype", "torch.int64"}}),
            "parallel.params_dtype: must be \"float32\", \"bfloat16\", \"float16\" or null, got "
            "string \"torch.int64\"");
  EXPECT_EQ(Refusal({{"world_size", 2}, {"bf16", 1}}),
            "parallel.bf16: must be true or false, got number 1");
  EXPECT_EQ(parse({{"world_size", 2}, {"fp16", true}}, {{"seq_length", 4}, {"dtype", "float64"}},
                  &c)
                .Message(),
            "run.dtype: is \"float64\" but parallel.fp16 asks for float16 storage; drop one of "
            "them or make them agree");
}

TEST(ParallelConfig, JsonSyntaxErrorsGiveLineAndColumn) {
  StatusOr<json> parsed = ParseJsonText("{\n  \"parallel\": {\n    \"world_size\": 16,\n  }\n}");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().where(), "line 4, column 3");
  EXPECT_EQ(parsed.status().what().rfind("invalid JSON: ", 0), 0u);
  EXPECT_FALSE(LoadConfigFile("/nonexistent/mpusim.json").ok());
}

// Every condition under which Megatron's initialize_model_parallel refuses a layout.
TEST(TopologyValidation, MegatronRefusals) {
  EXPECT_EQ(Refusal({{"world_size", 16}, {"tensor_model_parallel_size", 3}}),
            "parallel.world_size: 16 is not divisible by tensor_model_parallel_size * "
            "pipeline_model_parallel_size * context_parallel_size = 3 * 1 * 1");
  EXPECT_EQ(Refusal({{"world_size", 16},
                     {"tensor_model_parallel_size", 4},
                     {"pipeline_model_parallel_size", 4},
                     {"context_parallel_size", 2}}),
            "parallel.world_size: 16 is not divisible by tensor_model_parallel_size * "
            "pipeline_model_parallel_size * context_parallel_size = 4 * 4 * 2");
  // Sizes near the int64 limit must not overflow into a false "divisible".
  EXPECT_NE(Refusal({{"world_size", 16},
                     {"tensor_model_parallel_size", 2147483647},
                     {"pipeline_model_parallel_size", 2147483647},
                     {"context_parallel_size", 2147483647}}),
            "");
  EXPECT_EQ(Refusal({{"world_size", 4}, {"virtual_pipeline_model_parallel_size", 2}})
                .rfind("parallel.virtual_pipeline_model_parallel_size: needs "
                       "pipeline_model_parallel_size > 1",
                       0),
            0u);
  EXPECT_EQ(Refusal({{"world_size", 8}, {"tensor_model_parallel_size", 2}, {"order", "tp-xp-pp"}}),
            "parallel.order: 'tp-xp-pp' has unknown axis 'xp'; use tp, cp, ep, dp and pp joined "
            "by '-', e.g. \"tp-cp-ep-dp-pp\"");
  EXPECT_EQ(Refusal({{"world_size", 8}, {"order", "tp-dp-tp"}}),
            "parallel.order: 'tp-dp-tp' names axis 'tp' twice; each axis may appear once");
  EXPECT_EQ(Refusal({{"world_size", 8}, {"order", ""}}).rfind("parallel.order: '' has unknown", 0),
            0u);
  EXPECT_EQ(Refusal({{"world_size", 8}, {"context_parallel_size", 2}, {"order", "tp-dp-pp"}}),
            "parallel.order: 'tp-dp-pp' leaves out axis 'cp' of the dense rank generator, whose "
            "size (context_parallel_size) is 2; every axis of size > 1 must appear in the order");
  EXPECT_EQ(Refusal({{"world_size", 8}, {"expert_model_parallel_size", 2}, {"order", "tp-dp-pp"}}),
            "parallel.order: 'tp-dp-pp' leaves out axis 'ep' of the expert rank generator, whose "
            "size (expert_model_parallel_size) is 2; every axis of size > 1 must appear in the "
            "order");
  EXPECT_EQ(Refusal({{"world_size", 12},
                     {"tensor_model_parallel_size", 2},
                     {"expert_model_parallel_size", 4}}),
            "parallel.world_size: 12 is not divisible by expert_tensor_parallel_size * "
            "expert_model_parallel_size * pipeline_model_parallel_size = 2 * 4 * 1");
  // Order not ending in pp: expert and dense data-parallel sizes must match.
  EXPECT_EQ(Refusal({{"world_size", 16},
                     {"tensor_model_parallel_size", 2},
                     {"pipeline_model_parallel_size", 2},
                     {"expert_model_parallel_size", 2},
                     {"order", "tp-cp-ep-pp-dp"}}),
            "parallel.order: 'tp-cp-ep-pp-dp' does not end with pp, which needs the expert "
            "data-parallel size (2) to equal the data-parallel size (4); end the order with pp "
            "or change the expert sizes");
  // An order not ending in pp is fine when dp matches and the pp strides agree
  // (tp * ep = 2 * 1 on the dense side, etp * ep = 1 * 2 on the expert side).
  EXPECT_EQ(Refusal({{"world_size", 16},
                     {"tensor_model_parallel_size", 2},
                     {"pipeline_model_parallel_size", 2},
                     {"expert_model_parallel_size", 2},
                     {"expert_tensor_parallel_size", 1},
                     {"order", "tp-ep-pp-dp"}}),
            "");
  EXPECT_EQ(Refusal({{"world_size", 12}, {"num_distributed_optimizer_instances", 5}}),
            "parallel.num_distributed_optimizer_instances: 5 must divide data_parallel_size * "
            "context_parallel_size = 12 * 1 = 12");
  // d*c = 8 is divisible by 4, but expert dp (16 / (4 * 2)) = 2 is not.
  EXPECT_EQ(Refusal({{"world_size", 16},
                     {"context_parallel_size", 2},
                     {"expert_tensor_parallel_size", 4},
                     {"expert_model_parallel_size", 2},
                     {"num_distributed_optimizer_instances", 4}})
                .rfind("parallel.num_distributed_optimizer_instances: 4 must divide the expert "
                       "data-parallel size 2",
                       0),
            0u);
  EXPECT_EQ(Refusal({{"world_size", 8},
                     {"context_parallel_size", 4},
                     {"hierarchical_context_parallel_sizes", {2, 3}}}),
            "parallel.hierarchical_context_parallel_sizes: [2, 3] must multiply to "
            "context_parallel_size (4)");
  EXPECT_EQ(Refusal({{"world_size", 4},
                     {"pipeline_model_parallel_size", 4},
                     {"virtual_pipeline_model_parallel_size", 2},
                     {"num_layers", 12}}),
            "parallel.num_layers: 12 is not divisible by pipeline_model_parallel_size * "
            "virtual_pipeline_model_parallel_size = 4 * 2");
  EXPECT_EQ(Refusal({{"world_size", 4},
                     {"pipeline_model_parallel_size", 4},
                     {"microbatch_group_size_per_vp_stage", 4}}),
            "parallel.microbatch_group_size_per_vp_stage: only shapes the interleaved schedule; "
            "set virtual_pipeline_model_parallel_size or remove it");
  EXPECT_EQ(Refusal({{"world_size", 4},
                     {"pipeline_model_parallel_size", 4},
                     {"virtual_pipeline_model_parallel_size", 2},
                     {"microbatch_group_size_per_vp_stage", 3}}),
            "parallel.microbatch_group_size_per_vp_stage: must be at least "
            "pipeline_model_parallel_size (4), got 3");
  EXPECT_EQ(Refusal({{"world_size", 16}, {"rank_offset", 2147483640}}),
            "parallel.rank_offset: rank_offset + world_size - 1 must be at most 2147483647");
}

TEST(TopologyValidation, PipelineGroupMismatchIsRefused) {
  // With order tp-pp-ep-dp the pp stride is tp (2) on the dense side and etp (1) on the
  // expert side, while both data-parallel sizes are 2.
  const std::string error = Refusal({{"world_size", 8},
                                     {"tensor_model_parallel_size", 2},
                                     {"pipeline_model_parallel_size", 2},
                                     {"expert_tensor_parallel_size", 1},
                                     {"expert_model_parallel_size", 2},
                                     {"order", "tp-pp-ep-dp"}});
  EXPECT_EQ(error.rfind("parallel.order: 'tp-pp-ep-dp' gives the dense and expert rank generators "
                        "different pipeline groups (pp stride 2 vs 1)",
                        0),
            0u)
      << error;
}

TEST(TopologyValidation, AcceptsUppercaseOrderAndMissingSizeOneAxes) {
  EXPECT_EQ(Refusal({{"world_size", 8}, {"tensor_model_parallel_size", 2}, {"order", "TP-DP"}}),
            "");
  EXPECT_EQ(Refusal({{"world_size", 8}, {"pipeline_model_parallel_size", 8}, {"order", "pp"}}),
            "");
}

}  // namespace
}  // namespace mpusim
