// The float64 reference of the GPT model (Megatron-Core GPTModel, local layer spec): the
// whole (unpartitioned) model, forward and backward, on one slice of the global batch.
//
// What it is: a plain Eigen implementation of the math that the GPT model section
// (core/config/gpt_config.h) defines, one function per op, written from that math alone. It runs
// every micro-batch m = 0..M-1 of the global micro-batch [s, B = b*d], forward then backward
// with hand-written gradients, and sums the parameter gradients over micro-batches. Attention
// mixes the positions of a sample, so the work splits by samples, not token rows: a call
// computes the global samples [slice.begin, slice.end) of every micro-batch; a call with the
// default slice is the whole reference.
// What it is not: a second executor. It shares no op code with core/model or
// core/tensor_parallel (its CMake target cannot link them); only the definitions of the
// inputs are shared: the parameter list and master values (core/config/gpt_config.h, core/init.h),
// the synthetic tokens (TokenAt) and the dropout masks (core/dropout.h, core/philox.h). It
// knows the layout only where the full-model values depend on it: the data-parallel size d
// (B = b*d), the padded vocabulary Vp (a function of the tensor-parallel size), and, with
// dropout_mode "rng_tracker" only, which rank draws each mask element and in which order
// (Megatron's per-rank streams, core/dropout.h: the planner's layer assignment and forward
// table, core/schedule.h).
//
// Inputs. Micro-batch m's text stream is "text.mb<m>"; sample gs reads s + 1 consecutive
// tokens of it, tokens[i, gs] = TokenAt(seed, "text.mb<m>", gs*(s+1) + i, V) and labels[i, gs]
// the next one (index + 1), as Megatron's GPT dataset does. Dropout ("global" mode): element e
// (row-major in the site's full tensor) of micro-batch m is kept iff
// UniformAt(seed, DropoutStream(site, 0, m), e) >= p, and kept elements scale by 1/(1-p);
// "rng_tracker" mode draws each element as the rank holding it does (core/dropout.h).
// The loss is the mean token loss over all M*s*B tokens.
//
// Tensors in the result (float64, host), s = seq_length, B = global batch, n = slice samples:
//   activations of the LAST micro-batch, this slice's samples (Layout::kSamples):
//     tokens, labels                                    [s, B]      ids as doubles
//     embedding.output                                  [s, B, h]   after embedding dropout
//     decoder.layers.<i>.input_layernorm.output          [s, B, h]
//       .self_attention.linear_qkv.output                [s, B, (a+2g)*dk]   with bias
//       .self_attention.core_attention.probs             [B, a, s, s]  softmax, before dropout
//       .self_attention.core_attention.output            [s, B, a*dk]  context
//       .self_attention.linear_proj.output               [s, B, h]   without bias
//       .self_attn_bda.output                            [s, B, h]   residual stream
//       .pre_mlp_layernorm.output                        [s, B, h]
//       .mlp.linear_fc1.output                           [s, B, fc1 rows]    with bias
//       .mlp.linear_fc2.output                           [s, B, h]   without bias
//       .mlp_bda.output                                  [s, B, h]   residual stream
//     decoder.final_layernorm.output                    [s, B, h]
//     mtp.layers.<k>.embedding.output                   [s, B, h]   multi-token prediction
//       .enorm.output, .hnorm.output, .eh_proj.output   [s, B, h]   depth k (mtp_num_layers):
//       .transformer_layer.<as a decoder layer's>                    the ids rolled k + 1
//       .final_layernorm.output                         [s, B, h]   times, the shared output
//       .output_layer.output                            [s, B, Vp]  layer, the loss masked
//       .loss.per_token                                 [s, B]      where no label is left
//     output_layer.output                               [s, B, Vp]  logits
//     loss.per_token                                    [s, B]
//   and after each of these but tokens/labels, "<name>_grad": d loss / d that tensor. These
//   are Layout::kSamples tensors: the value is full_shape with dimension batch_dim cut to n.
//   probs_grad is the derivative with respect to every element of probs, above the diagonal
//   too (there probs are the constant 0, so the softmax's backward drops it).
//   whole tensors (Layout::kWhole), in GptParameters order:
//     <parameter>        the parameter (master values, or the override)
//     <parameter>.grad   partial: this slice's share of its gradient, summed over micro-batches
//                        (a tied word embedding gets its lookup's and the output layer's)
//     loss               [1] partial: this slice's share of the loss
// Shares (`partial`) add up over the slices of a partition of the samples to the full value.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/config/gpt_config.h"
#include "core/config/model_config.h"
#include "core/config/parallel_config.h"
#include "core/status.h"
#include "core/tensor.h"
#include "reference/reference.h"

namespace mpusim {

struct GptReferenceOptions {
  // Global samples [slice.begin, slice.end) of each micro-batch; end -1: to B.
  ReferenceSlice slice;
  // Training iteration k: its micro-batch m reads the data stream "text.mb<k*M + m>" and
  // draws dropout from DropoutStream(site, k, m) (rng_tracker: after k iterations' draws).
  int64_t iteration = 0;
  // Full host float64 tensors that replace parameters' master values, used as they are (not
  // copied; the reference never writes a parameter). An unknown name or a wrong shape is an
  // error.
  std::map<std::string, Tensor> parameter_overrides;
  // Explicit token ids instead of the drawn ones: empty, or [M][s*B] with element i*B + gs
  // (position i of global sample gs), each id in [0, vocab_size). Each of the two on its own.
  std::vector<std::vector<int64_t>> tokens;
  std::vector<std::vector<int64_t>> labels;
};

// The error budget every tensor of a GPT run is charged but the token ids (core/dump/compare.h):
// the stored values and sums on the longest path through the model, forward and backward (a
// conservative bound for the tensors nearer the input or the loss). t: the tensor-parallel
// size, d: the data-parallel size.
ErrorBudget GptErrorBudget(const GptConfig& gpt, const RunConfig& run, int64_t t, int64_t d,
                           int64_t padded_vocab);

// B = micro_batch_size * d, d = world_size / (tp * pp * cp): the global samples of one
// micro-batch.
int64_t GptReferenceSamples(const ParallelConfig& parallel, const RunConfig& run);

// The drawn token ids of micro-batch `microbatch`, [s*B] with element i*B + gs: what
// RunGptReference uses when GptReferenceOptions gives none.
struct GptReferenceTokens {
  std::vector<int64_t> tokens;
  std::vector<int64_t> labels;
};
GptReferenceTokens DrawGptReferenceTokens(const GptConfig& gpt, const ParallelConfig& parallel,
                                          const RunConfig& run, int64_t microbatch);

// With moe_router_enable_expert_bias: each MoE layer's "<prefix>.mlp.router.expert_bias"
// (float32 values as float64 [E]; the bias the iteration chose with, an override or zeros) and
// "<prefix>.mlp.router.local_tokens_per_expert" (partial: the slice's kept choices per
// expert, all micro-batches) are in the result. Once the shares are summed, this takes the
// counts out and, when `trained`, moves each bias as Megatron's get_updated_expert_bias does
// (float32: bias + sign(mean - count) * rate); `state` gets the biases the next iteration
// reads.
void FinishGptReferenceIteration(const GptConfig& gpt, ReferenceResult& result, bool trained,
                                 std::map<std::string, Tensor>* state);

// Runs the whole model on a slice of the global batch. `gpt` is the parsed model section
// (max_position_embeddings 0 means seq_length). Anything the reference cannot give a meaning
// to (a bad slice, a bad override or token list, a layout that does not divide world_size)
// is a Status error, never a crash. GEMMs run on one BLAS thread (each MPI rank is one core).
StatusOr<ReferenceResult> RunGptReference(const GptConfig& gpt, const ParallelConfig& parallel,
                                          const RunConfig& run,
                                          const GptReferenceOptions& options = {});

}  // namespace mpusim
