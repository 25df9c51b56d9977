// The config sections' field tables (core/config/field_table.h): each key declared once, read
// and echoed by the same declaration, and named through it.
#include <set>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/config/gpt_config.h"
#include "core/config/model_config.h"
#include "core/config/optimizer_config.h"
#include "core/config/parallel_config.h"

namespace mpusim {
namespace {

using nlohmann::json;

// Every field of `fields` echoed from `config`, parsed back into a fresh section, echoes the
// same: the reader and the writer of each key agree.
template <typename Section>
void ExpectEchoParsesBack(std::span<const Field<Section>> fields, const Section& config) {
  for (const Field<Section>& f : fields) {
    SCOPED_TRACE(std::string(f.key));
    const json echoed = f.Echo(config);
    Section back;
    ASSERT_TRUE(f.Parse(echoed, "x", &back).ok()) << echoed.dump();
    EXPECT_EQ(f.Echo(back), echoed);
  }
}

TEST(FieldTableTest, EveryFieldParsesItsOwnEcho) {
  ParallelConfig parallel;
  ASSERT_TRUE(ParseParallelSection(json::parse(R"({"world_size": 16,
      "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
      "virtual_pipeline_model_parallel_size": 2, "context_parallel_size": 4,
      "hierarchical_context_parallel_sizes": [2, 2], "expert_tensor_parallel_size": 1,
      "order": "tp-cp-ep-pp-dp", "rank_offset": 3, "sequence_parallel": true,
      "bf16": true, "params_dtype": "torch.bfloat16"})"),
                                   "parallel", &parallel)
                  .ok());
  ExpectEchoParsesBack(ParallelFields(), parallel);
  OptimizerConfig optimizer;
  ASSERT_TRUE(ParseOptimizerSection(json::parse(R"({"optimizer": "sgd", "lr": 0.5,
      "min_lr": 0.25, "lr_decay_style": "cosine", "lr_decay_iters": 9, "adam_beta1": 0.5,
      "use_distributed_optimizer": true, "bucket_size": 1000})"),
                                    &optimizer)
                  .ok());
  ExpectEchoParsesBack(OptimizerFields(), optimizer);
  RunConfig run;
  ASSERT_TRUE(ParseRunSection(json::parse(R"({"seed": 18446744073709551615, "dtype": "float16",
      "seq_length": 8, "micro_batch_size": 2, "num_microbatches": 3,
      "recompute_granularity": "selective", "train_iters": 4, "global_batch_size": 12})"),
                              &run)
                  .ok());
  ExpectEchoParsesBack(RunFields(), run);
  // The GPT section, every nested and nullable kind set (the moe_* keys live in
  // GptConfig::moe, the resolved sizes echo as what they resolved to).
  GptConfig gpt;
  ASSERT_TRUE(ParseGptSection(json::parse(R"({"type": "gpt", "num_layers": 3,
      "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 4, "vocab_size": 100,
      "normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": false,
      "position_embedding_type": "rope", "rotary_percent": 0.5, "max_position_embeddings": 32,
      "dropout_mode": "rng_tracker", "cp_comm_type": "a2a", "attention_backend": "flash",
      "fp8": "hybrid", "fp8_recipe": "mxfp8", "num_moe_experts": 4, "moe_router_topk": 1,
      "moe_layer_freq": [1, 0, 1], "moe_router_load_balancing_type": "seq_aux_loss",
      "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001, "moe_expert_capacity_factor": 1.5,
      "moe_token_dispatcher_type": "alltoall", "moe_token_drop_policy": "position",
      "moe_pad_expert_input_to_capacity": true, "moe_shared_expert_intermediate_size": 32,
      "moe_grouped_gemm": true})"),
                              &gpt)
                  .ok());
  ExpectEchoParsesBack(GptFields(), gpt);
}

// A key, and a flag, is declared by one field of one table.
TEST(FieldTableTest, KeysAndFlagsAreDeclaredOnce) {
  std::set<std::string> flags;
  const auto check = [&flags](auto fields) {
    std::set<std::string> keys;
    for (const auto& f : fields) {
      EXPECT_TRUE(keys.insert(std::string(f.key)).second) << f.key << " declared twice";
      EXPECT_FALSE(f.help.empty()) << f.key << " has no help line";
      if (f.flag.empty()) continue;
      std::string names(f.flag);
      for (size_t start = 0; start <= names.size();) {
        const size_t comma = std::min(names.find(',', start), names.size());
        EXPECT_TRUE(flags.insert(names.substr(start, comma - start)).second)
            << names << " is the flag of two keys";
        start = comma + 1;
      }
    }
  };
  check(ParallelFields());
  check(OptimizerFields());
  check(RunFields());
  check(GptFields());
  EXPECT_TRUE(flags.count("--tp") && flags.count("-n") && flags.count("--micro-batch-size"));
}

// Code outside a table names a key through the member that holds it.
TEST(FieldTableTest, KeyOfNamesTheMembersKey) {
  EXPECT_EQ(ParallelKey(&ParallelConfig::context_parallel_size), "context_parallel_size");
  EXPECT_EQ(ParallelKey(&ParallelConfig::virtual_pipeline_model_parallel_size),
            "virtual_pipeline_model_parallel_size");
  EXPECT_EQ(RunKey(&RunConfig::num_microbatches), "num_microbatches");
  EXPECT_EQ(OptimizerKey(&OptimizerConfig::use_distributed_optimizer),
            "use_distributed_optimizer");
  // A member no field stores (derived, not a key) is a programming error, not a silent "".
  EXPECT_THROW(RunKey(&RunConfig::num_microbatches_given), std::logic_error);
}

// `given` records that a key was in the section, not defaulted.
TEST(FieldTableTest, GivenMarksAKeyTheSectionSets) {
  RunConfig run;
  ASSERT_TRUE(ParseRunSection(json::parse(R"({"seq_length": 8})"), &run).ok());
  EXPECT_FALSE(run.num_microbatches_given);
  ASSERT_TRUE(ParseRunSection(json::parse(R"({"seq_length": 8, "num_microbatches": 1})"), &run)
                  .ok());
  EXPECT_TRUE(run.num_microbatches_given);
}

}  // namespace
}  // namespace mpusim
