// The float64 reference model: the whole (unpartitioned) layer chain, one slice of the batch
// per call.
//
// What it is: a plain Eigen implementation of the full-model math in docs/simulator.md. It
// runs every micro-batch m = 0..M-1 on the global micro-batch [s, B = b*d] of tokens, forward
// then backward, and sums the parameter gradients over micro-batches. Every op of the chain
// treats the s*B token rows independently, so the work splits by rows: a call computes the
// rows [row_begin, row_end) of every micro-batch (row r = i*B + g: sequence position i of
// global sample g). `mpusim run` gives each of its K ranks one slice, so the job computes one
// reference in all, not one per rank (run/check.h); a call with the default slice is the
// whole reference.
// What it is not: a second executor. It shares no op code with core/model or
// core/tensor_parallel (its CMake target cannot link them); only the initialisation and
// random streams (core/init.h, core/philox.h, core/rng.h) are shared, because they define the
// inputs. It knows the parallel layout only where the contract makes the full-model values
// depend on it: the data-parallel size d (B = b*d), the padded vocabulary Vp (a function of
// t), and the dropout masks (drawn per rank); and where the error budgets count the sums a
// layout makes (an all-reduce over t ranks).
//
// Tensors in the result, in the order the executor records them (float64, host):
//   rows of the last micro-batch (Layout::kRows, value [slice rows, width]):
//     tokens, labels            full [s, B]          token ids as doubles
//     <layer>.input             full [s, B, h_in]    not for embeddings
//     <layer>.input_grad        like .input
//     <layer>.output            full [s, B, h_out]   the loss layer: per-token loss [s, B]
//     <layer>.output_grad       like .output         the loss layer: 1/(M*s*B) per token
//   whole tensors (Layout::kWhole):
//     <layer>.weight            [out, in] or [num_embeddings, embedding_dim]  weight owners
//     <layer>.weight_grad       same            this slice's share; not when frozen
//     <layer>.bias, .bias_grad  [out]           linear layers with `bias` (skip_bias_add too)
//     loss                      [1]             this slice's share of the mean token loss
// Shares (`partial`) add up over the slices of a partition of the rows to the full value.
// Tensors that are one value under two names (fc1.output and gelu.input) share storage.
//
// Each tensor carries its ErrorBudget (core/dump/compare.h): the roundings and summands a correct
// implementation goes through to produce it, counted op by op as docs/simulator.md
// ("Tolerances") lists them; the check turns it into the tensor's tolerance.
//
// Conventions this file settles where the contract leaves room (see the .cc for details):
//   - A layer with `weight_from` uses the named layer's weight (shape [out, in] must match);
//     its gradient goes to "<owner>.weight_grad", and the owner's `frozen` decides whether
//     there is one.
//   - A chain that does not start with an embedding gets the synthetic input "input.mb<m>";
//     its width is the first layer's input_size (linear), Vp (loss), or, for a width-keeping
//     first layer (GeLU, Dropout, region mapping), its input_size when set, else the width
//     the next width-fixing layer expects.
//   - The synthetic input's parallel state (which only dropout masks see) is what the first
//     layer accepts: see InitialState in the .cc.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/config/model_config.h"
#include "core/config/parallel_config.h"
#include "core/status.h"
#include "core/tensor.h"
#include "reference/reference.h"

namespace mpusim {

// Runs the whole model on `slice` of the global batch. The config is expected to be validated
// by the executor; anything the reference cannot give a meaning to is a Status error naming
// the layer ("model.layers[3]: ..."), never a crash. GEMMs run on one BLAS thread (each MPI
// rank is one core).
StatusOr<ReferenceResult> RunReference(const ParallelConfig& parallel, const ModelConfig& model,
                                       const RunConfig& run, ReferenceSlice slice = {});

// s*B, the token rows of one micro-batch, once the config is known to be valid (for
// partitioning the rows before any reference runs).
int64_t ReferenceRows(const ParallelConfig& parallel, const RunConfig& run);

// The master weights the reference starts from (every owner's "<layer>.weight"; biases start
// at zero and are not listed).
StatusOr<std::vector<ReferenceParameter>> ReferenceParameters(const ParallelConfig& parallel,
                                                              const ModelConfig& model,
                                                              const RunConfig& run);

// The same run, but a parameter named in `parameter_overrides` ("fc1.weight", "fc1.bias", ...)
// takes the given full host float64 tensor instead of its master values: the master values
// generated elsewhere (the check), or perturbed ones (finite differences, hand-built tests).
// The tensor is used as it is, not copied (the reference never writes a parameter). An
// unknown name or a wrong shape is an error. `iteration` k > 0 is training iteration k: its
// micro-batch m is global micro-batch k*M + m ("tokens.mb<k*M + m>", "input.mb<...>", ...),
// and its dropout draws continue the streams after k iterations' draws.
StatusOr<ReferenceResult> RunReferenceWithOverrides(
    const ParallelConfig& parallel, const ModelConfig& model, const RunConfig& run,
    const std::map<std::string, Tensor>& parameter_overrides, ReferenceSlice slice = {},
    int64_t iteration = 0);

}  // namespace mpusim
