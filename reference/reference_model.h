// The float64 reference model: the whole (unpartitioned) layer chain in one process.
//
// What it is: a plain Eigen implementation of the full-model math in docs/simulator.md. It
// runs every micro-batch m = 0..M-1 on the global micro-batch [s, B = b*d] of tokens, forward
// then backward, and sums the parameter gradients over micro-batches. `mpusim verify` checks
// each reassembled parallel tensor against it.
// What it is not: a second executor. It shares no op code with core/model/graph; only the
// initialisation and random streams (core/init.h, core/philox.h, core/rng.h) are shared,
// because they define the inputs. It knows the parallel layout only where the contract makes
// the full-model values depend on it: the data-parallel size d (B = b*d), the padded
// vocabulary Vp (a function of t), and the dropout masks (drawn per rank).
//
// Tensors in the result (full shapes, float64, host; activations of the last micro-batch):
//   tokens, labels            [s, B]         token ids as doubles (with an embedding / a loss)
//   <layer>.input             [s, B, h_in]   not for embeddings
//   <layer>.output            [s, B, h_out]  the loss layer: per-token loss [s, B]
//   <layer>.output_grad       like .output   the loss layer: 1/(M*s*B) per token
//   <layer>.input_grad        like .input    not for embeddings
//   <layer>.weight            [out, in] or [num_embeddings, embedding_dim]  weight owners only
//   <layer>.weight_grad       same           summed over micro-batches; not when frozen
//   <layer>.bias, .bias_grad  [out]          linear layers with `bias` (skip_bias_add too)
//   loss                      [1]            mean per-token loss over all micro-batches
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

#include <map>
#include <string>

#include "core/model_config.h"
#include "core/parallel_config.h"
#include "core/status.h"
#include "core/tensor.h"

namespace mpusim {

struct ReferenceResult {
  std::map<std::string, Tensor> tensors;  // full-shape float64 host tensors (names above)
  bool has_loss = false;
  double loss = 0.0;
};

// Runs the whole model on the full global batch. The config is expected to be validated by
// the executor; anything the reference cannot give a meaning to is a Status error naming the
// layer ("model.layers[3]: ..."), never a crash.
StatusOr<ReferenceResult> RunReference(const ParallelConfig& parallel, const ModelConfig& model,
                                       const RunConfig& run);

// Testing hook (finite differences, hand-built examples): the same run, but a parameter named
// in `parameter_overrides` ("fc1.weight", "fc1.bias", ...) takes the given full host float64
// tensor instead of its master values. An unknown name or a wrong shape is an error.
StatusOr<ReferenceResult> RunReferenceWithOverrides(
    const ParallelConfig& parallel, const ModelConfig& model, const RunConfig& run,
    const std::map<std::string, Tensor>& parameter_overrides);

}  // namespace mpusim
