// The `model` and `run` sections of a config: the layer graph and how to run it.
//
// {
//   "parallel": {...},                          parallel_config.h
//   "model": {
//     "vocab_size": 64,                         tokens and labels are drawn from [0, vocab_size)
//     "make_vocab_size_divisible_by": 128,      Megatron's padding: padded_vocab_size is
//                                               vocab_size rounded up to a multiple of
//                                               make_vocab_size_divisible_by * tp
//     "layers": [                               a chain: each layer consumes the previous output
//       {"name": "embedding", "type": "VocabParallelEmbedding", "embedding_dim": 32},
//       {"name": "fc1", "type": "ColumnParallelLinear", "input_size": 32, "output_size": 128,
//        "gather_output": false},
//       {"name": "gelu", "type": "GeLU"},
//       {"name": "fc2", "type": "RowParallelLinear", "input_size": 128, "output_size": 32,
//        "input_is_parallel": true},
//       {"name": "head", "type": "ColumnParallelLinear", "input_size": 32,
//        "output_size": "padded_vocab_size", "gather_output": false, "bias": false},
//       {"name": "loss", "type": "VocabParallelCrossEntropy", "label_smoothing": 0.1}
//     ]
//   },
//   "run": {...}                                RunFields() below: seed, dtype, the sequence,
//                                               the batch, recomputation, iterations
// }
//
// Layer types are Megatron's class or function names. Options are Megatron's names; sizes
// may be the string "padded_vocab_size". A chain that starts without an embedding gets a
// synthetic input [seq_length, micro_batch_size, input_size]; one that ends without a loss
// gets a synthetic output gradient. This file parses and checks each section on its own;
// core/model/graph checks that the layers fit together (shapes and parallel states).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/config/field_table.h"
#include "core/init.h"
#include "core/status.h"
#include "core/tensor.h"

namespace mpusim {

enum class LayerType : uint8_t {
  kVocabParallelEmbedding,
  kParallelEmbedding,
  kColumnParallelLinear,
  kRowParallelLinear,
  kGeLU,
  kDropout,
  kVocabParallelCrossEntropy,
  kCopyToTensorModelParallelRegion,        // copy_to_tensor_model_parallel_region
  kReduceFromTensorModelParallelRegion,    // reduce_from_tensor_model_parallel_region
  kScatterToTensorModelParallelRegion,     // scatter_to_tensor_model_parallel_region
  kGatherFromTensorModelParallelRegion,    // gather_from_tensor_model_parallel_region
  kScatterToSequenceParallelRegion,        // scatter_to_sequence_parallel_region
  kGatherFromSequenceParallelRegion,       // gather_from_sequence_parallel_region
  kReduceScatterToSequenceParallelRegion,  // reduce_scatter_to_sequence_parallel_region
  // torch.nn modules, for PyTorch's tensor-parallel plans (a top-level "parallelize_plan"
  // styles them; core/model/graph_torch.cc). GeLU ("GELU") and Dropout belong to both families.
  kEmbedding,         // nn.Embedding(num_embeddings, embedding_dim)
  kLinear,            // nn.Linear(in_features, out_features, bias)
  kReLU,              // nn.ReLU
  kCrossEntropyLoss,  // nn.CrossEntropyLoss (mean over the tokens, as the chain's loss)
  kLayerNorm,         // nn.LayerNorm(normalized_shape, eps): weight 1 and bias 0 at the start
};
// Whether a layer type is one of torch.nn's modules above, and whether it is one of Megatron's
// layers or mappings (neither: GeLU and Dropout, which both families have). A chain is written
// in one family.
bool IsTorchModule(LayerType type);
bool IsMegatronLayer(LayerType type);

// The spelling used in configs ("ColumnParallelLinear", "copy_to_tensor_model_parallel_region").
// The keys of a layer-chain `model` section.
const std::vector<std::string_view>& ModelConfigKeys();

const char* LayerTypeName(LayerType type);

// A size given as a number or as "padded_vocab_size".
struct SizeValue {
  int64_t value = 0;
  bool padded_vocab = false;
  int64_t Resolve(int64_t padded_vocab_size) const {
    return padded_vocab ? padded_vocab_size : value;
  }
};

struct LayerConfig {
  std::string name;
  LayerType type = LayerType::kGeLU;
  // VocabParallelEmbedding / ParallelEmbedding
  SizeValue num_embeddings{0, true};  // default: padded_vocab_size
  int64_t embedding_dim = 0;
  // ColumnParallelLinear / RowParallelLinear
  int64_t input_size = 0;
  SizeValue output_size;
  bool bias = true;
  bool gather_output = true;                  // ColumnParallelLinear
  bool input_is_parallel = false;             // RowParallelLinear
  bool skip_bias_add = false;
  bool skip_weight_param_allocation = false;  // ColumnParallelLinear: weight from weight_from
  std::string weight_from;                    // the layer whose weight is passed at forward
  bool frozen = false;                        // weight.requires_grad = False
  int64_t stride = 1;
  InitSpec init;  // "init_method", "init_method_std"; the bias is always zero
  // GeLU: add the bias that layer `bias_from` (skip_bias_add) returned, then GeLU
  // (Megatron's bias_gelu fusion).
  std::string bias_from;
  // Dropout
  double p = 0.0;
  // VocabParallelCrossEntropy
  double label_smoothing = 0.0;
  // LayerNorm (torch.nn): the width it normalises and its epsilon
  int64_t normalized_shape = 0;
  double eps = 1e-5;
  // gather_from_sequence_parallel_region
  bool tensor_parallel_output_grad = true;
};

struct ModelConfig {
  std::optional<int64_t> vocab_size;  // required when the chain has an embedding or a loss
  int64_t make_vocab_size_divisible_by = 128;
  std::vector<LayerConfig> layers;

  // Whether the chain is made of torch.nn modules (IsTorchModule), so that a parallelize_plan
  // can style it.
  bool IsTorchChain() const;
  // Megatron's _vocab_size_with_padding.
  int64_t PaddedVocabSize(int64_t tensor_model_parallel_size) const;
};

struct RunConfig {
  uint64_t seed = 1234;
  // Storage dtype of parameters, activations and activation gradients: "float32",
  // "float64", "bfloat16" or "float16". main_grad, the loss and the softmax statistics are
  // in ComputeDType(dtype). ParseConfig fills it from parallel.bf16 / fp16 / params_dtype
  // when the run section does not set it.
  DType dtype = DType::kFloat32;
  bool dtype_given = false;  // "dtype" was in the run section
  int64_t seq_length = 0;  // required
  int64_t micro_batch_size = 1;
  int64_t num_microbatches = 1;  // > 1 accumulates gradients across microbatches
  // Optimizer steps (with an "optimizer" section; without one, one step and no update).
  // Iteration k reads micro-batches k*M .. k*M + M - 1 of the data stream.
  int64_t train_iters = 1;
  // Megatron's global batch: samples per iteration over all dp ranks. When given,
  // num_microbatches = global_batch_size / (micro_batch_size * data_parallel_size)
  // (ParseConfig resolves it for the layout), so every layout trains on the same batches.
  std::optional<int64_t> global_batch_size;
  bool num_microbatches_given = false;
  // PyTorch's loss_parallel() context: a chain of torch.nn modules computes its
  // CrossEntropyLoss on Shard(-1) logits (a DTensor), each rank over its classes, the row
  // max, the label's logit and the sum of exponentials all-reduced (Megatron's
  // vocab_parallel_cross_entropy). The same loss; only where the classes live changes.
  bool loss_parallel = false;
  // Megatron's activation recomputation (TransformerConfig recompute_*; what each keeps:
  // transformer_layer.h). "recompute_granularity": null, "full" (whole layers' forwards again
  // in the backward, chosen by recompute_method and recompute_num_layers) or "selective" (the
  // submodules of recompute_modules; GPT models).
  enum class Recompute : uint8_t { kNone, kFull, kSelective };
  Recompute recompute = Recompute::kNone;
  // "recompute_method" (full only): "uniform" groups each model chunk's layers by
  // recompute_num_layers and keeps only each group's input; "block" recomputes the first
  // recompute_num_layers layers of each chunk and keeps everything of the rest.
  enum class RecomputeMethod : uint8_t { kNone, kUniform, kBlock };
  RecomputeMethod recompute_method = RecomputeMethod::kNone;
  std::optional<int64_t> recompute_num_layers;  // full only
  // "recompute_modules" (selective only; null: Megatron's default ["core_attn"]).
  enum class RecomputeModule : uint8_t {
    kCoreAttn,       // core attention: scores, probabilities, dropout mask
    kLayernorm,      // input_layernorm and pre_mlp_layernorm: their outputs and statistics
    kMlp,            // the dense MLP (not an MoE layer's), from its input
    kMoeAct,         // the MoE experts' activation output (moe_grouped_gemm only)
    kMoe,            // the whole MoE layer, from its input
    kSharedExperts,  // the MoE layer's shared expert, from its input
  };
  std::optional<std::vector<RecomputeModule>> recompute_modules;
  // Whether selective recomputation recomputes `module` (with the default list when unset).
  bool Recomputes(RecomputeModule module) const;
  // Whether layer `index` (0-based) of a model chunk of `chunk_layers` layers is inside a
  // fully recomputed group, and the group's first layer: Megatron's _checkpointed_forward
  // (megatron/core/recompute.py checkpointed_forward), per model chunk. uniform: groups
  // [0, n), [n, 2n), ..., the last one cut at the chunk's end; block: the first n layers,
  // each a group of its own.
  struct RecomputeGroup {
    bool recomputed = false;
    int64_t first = 0;  // the group's first layer (index in the chunk)
  };
  RecomputeGroup GroupOf(int64_t index, int64_t chunk_layers) const;
  // Whether full recomputation reruns the multi-token prediction depths: "uniform"
  // checkpoints each depth's projection, layer and final norm
  // (MultiTokenPredictionLayer._checkpointed_forward); "block" skips them.
  bool CheckpointsMtpDepths() const {
    return recompute == Recompute::kFull && recompute_method == RecomputeMethod::kUniform;
  }
};

// Megatron's names: "uniform", "block"; "core_attn", "layernorm", "mlp", "moe_act", "moe",
// "shared_experts".
const char* RecomputeMethodName(RunConfig::RecomputeMethod method);
const char* RecomputeModuleName(RunConfig::RecomputeModule module);
// One line for reports: "none", "selective (core_attn, mlp)", "full (uniform, 2 layers)".
std::string RecomputeSummary(const RunConfig& run);

// The keys of the `run` section, each declared once (core/config/field_table.h); RunKey names
// the key a member holds (RunKey(&RunConfig::micro_batch_size)).
std::span<const Field<RunConfig>> RunFields();
const std::vector<std::string_view>& RunConfigKeys();
template <typename T>
std::string_view RunKey(T RunConfig::*member) {
  return KeyOf(RunFields(), member);
}

// Parse one section each; errors name the JSON path ("model.layers[2].input_size").
Status ParseModelSection(const nlohmann::json& section, ModelConfig* out);
Status ParseRunSection(const nlohmann::json& section, RunConfig* out);

// Writes the run section back with every key resolved (defaults included), so a dump says
// which seed and dtype it ran with even when the file left them out. A given
// global_batch_size is written instead of num_microbatches (which ParseConfig derives from it
// for the layout), so the echo parses again under another layout.
void ToJson(const RunConfig& run, nlohmann::json* out);

}  // namespace mpusim
