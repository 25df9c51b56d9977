// Pipeline splits: which decoder layers each (pipeline rank, model chunk) holds, as
// Megatron-Core decides it. The single source of the layer assignment: the executor's chunks,
// the float64 reference, `mpusim layout`, the memory walk and the step-time estimate all
// derive theirs from AssignLayers.
//
// Notation: p = pipeline_model_parallel_size, v = virtual_pipeline_model_parallel_size
// (1 when not given), L = num_layers, S = p * v virtual stages; virtual stage
// u = chunk * p + pp_rank holds the layers after those of stages 0 .. u-1 (the activations
// leave rank p-1's chunk c for rank 0's chunk c+1), so a split is one count per stage.
//
// Megatron's four ways (megatron/core/transformer/transformer_block.py get_num_layers_to_build,
// transformer_layer.py get_transformer_layer_offset; checks from transformer_config.py):
//   even (no key set)        L / S per stage; L % S == 0.
//   pipeline_model_parallel_layout, e.g. "Et|(tt|)*2,L" (PipelineParallelLayerLayout): one
//       string of stages split by '|'; E the embedding, t a decoder layer, L the loss,
//       m an MTP layer (CheckMtpInLayout); "(...)*N" repeats a group (no
//       nesting), "x*N" one character, commas are cosmetic. Its stage count must be a
//       multiple of p and gives v; E opens the first stage, L closes the last, each once;
//       the t's count to L. A stage may be empty or hold only E or L.
//   decoder_first_pipeline_num_layers F / decoder_last_pipeline_num_layers Z (Megatron's
//       --decoder-first/last-pipeline-num-layers; TransformerConfig's
//       num_layers_in_first/last_pipeline_stage): pp rank 0 holds F, rank p-1 holds Z, the
//       others share the rest evenly; every rank's layers split evenly over its v chunks.
//       Example p = 4, L = 14, F = 2, Z = 6: ranks hold 2, 3, 3, 6.
//   account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split: the
//       embedding (loss) counts as one layer: L' = L + e + l is split evenly over the S
//       stages and the first (last) stage builds one decoder layer fewer.
//       Example p = 4, L = 6, both: 2 per stage, so stages hold 1, 2, 2, 1.
// Megatron refuses the layout with any of the other keys, and F or Z with e or l.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace mpusim {

// The parallel section's keys that decide a split (copied out of ParallelConfig, which
// core/config/parallel_config.h declares; this header knows nothing of config files).
struct PipelineSplit {
  int64_t pipeline_model_parallel_size = 1;
  std::optional<int64_t> virtual_pipeline_model_parallel_size;
  std::optional<std::string> pipeline_model_parallel_layout;
  std::optional<int64_t> decoder_first_pipeline_num_layers;
  std::optional<int64_t> decoder_last_pipeline_num_layers;
  bool account_for_embedding_in_pipeline_split = false;
  bool account_for_loss_in_pipeline_split = false;

  // None of the uneven keys is set: L / S layers per stage.
  bool Even() const {
    return !pipeline_model_parallel_layout && !decoder_first_pipeline_num_layers &&
           !decoder_last_pipeline_num_layers && !account_for_embedding_in_pipeline_split &&
           !account_for_loss_in_pipeline_split;
  }
};

// The assignment lists every layer; this bounds the layers (far beyond any real model) so
// that absurd sizes are refused instead of exhausting memory.
inline constexpr int64_t kMaxAssignedLayers = int64_t{1} << 20;

// A parsed layout string can hold at most this many characters once its repetitions are
// unrolled (a bound far above any real model, so that "t*99999999999" is refused instead of
// exhausting memory).
inline constexpr int64_t kMaxLayoutChars = int64_t{1} << 22;

// Megatron's PipelineParallelLayerLayout.parse_str_to_list: the stages of `layout`, each the
// string of its layer characters (E, t, L, m), e.g. "Ettt|(tt|)*2,L" -> {"Ettt", "tt", "tt",
// "L"}. Refuses (as parallel.pipeline_model_parallel_layout) a character other than E, t, L,
// m, '|', and what the repetitions leave behind, and an unrolled length over
// kMaxLayoutChars. 'm' is parsed here; CheckMtpInLayout checks it against the model.
StatusOr<std::vector<std::string>> ParsePipelineLayout(std::string_view layout);

// The checks that need only the keys (TransformerConfig.__post_init__ and arguments.py), in
// Megatron's order: the layout with any other key; F or Z with e or l; F, Z < 1; F, Z not
// divisible by v; the layout's grammar, a stage count that is not a multiple of
// p or disagrees with a given v; F and Z together with p = 1 (one stage is both). With a
// layout and no v, sets v to stages / p when that is above 1, as Megatron does. Errors name
// "parallel.<key>".
Status ResolvePipelineSplitKeys(PipelineSplit* split);

// The layout's MTP layers ('m') against the model's mtp_num_layers, as Megatron's
// PipelineParallelLayerLayout.validate_layer_layout checks them: as many m's as
// mtp_num_layers (none without it), no t after the first m, all of them in one virtual stage,
// that stage its pipeline rank's last model chunk. mpusim builds the depths on the
// last stage, with the loss; an m stage before it (Megatron's "standalone" MTP, whose stage
// sends the depths' hidden states with the decoder's to the loss stage) is refused, not
// built. Nothing to check without a layout. Errors name parallel.pipeline_model_parallel_layout.
Status CheckMtpInLayout(const PipelineSplit& split, int64_t mtp_num_layers);

// Decoder layers per virtual stage u = chunk * p + pp_rank (S entries, summing to L); refuses
// what Megatron refuses once L is known (a layout whose t's are not L, or whose E or L are
// misplaced; layers that do not divide as the keys ask). Assumes ResolvePipelineSplitKeys
// passed. Errors name "parallel.<key>" for the uneven keys, "num_layers" for an even split.
StatusOr<std::vector<int64_t>> LayersPerStage(const PipelineSplit& split, int64_t num_layers);

// result[pp_rank][chunk] = that chunk's layers, 1-based (Megatron's layer_number), a chunk
// holding LayersPerStage()[chunk * p + pp_rank] consecutive ones, possibly none.
// Megatron's even example, p = 4, v = 2, L = 16:
//   rank 0: [1, 2] [9, 10]    rank 1: [3, 4] [11, 12]
//   rank 2: [5, 6] [13, 14]   rank 3: [7, 8] [15, 16]
// The first chunk of rank 0 holds the embedding and the last chunk of rank p-1 the output
// layer and the loss, whatever the split. Refuses sizes below 1, v given with p == 1 (no
// interleaved schedule could run it), L above kMaxAssignedLayers and what LayersPerStage
// refuses.
using LayerAssignment = std::vector<std::vector<std::vector<int64_t>>>;
StatusOr<LayerAssignment> AssignLayers(const PipelineSplit& split, int64_t num_layers);
// The even split (no uneven key).
StatusOr<LayerAssignment> AssignLayers(int64_t pipeline_model_parallel_size,
                                       std::optional<int64_t> virtual_pipeline_model_parallel_size,
                                       int64_t num_layers);

// The uneven keys set, for a report: "pipeline_model_parallel_layout \"Et|tt|tL\"",
// "decoder_first_pipeline_num_layers 2, decoder_last_pipeline_num_layers 6", ...; "" when
// the split is even.
std::string DescribeSplit(const PipelineSplit& split);

// One virtual stage's decoder layers, 0-based: [first, first + count).
struct StageLayers {
  int64_t first = 0;
  int64_t count = 0;
};
// Per virtual stage u, from an assignment (for the estimates' per-stage walks).
std::vector<StageLayers> StagesOf(const LayerAssignment& assignment);
// The stages of a split its callers have already checked (CheckGptLayout, the model's
// build); throws std::invalid_argument with AssignLayers' message otherwise.
std::vector<StageLayers> CheckedStages(const PipelineSplit& split, int64_t num_layers);

}  // namespace mpusim
