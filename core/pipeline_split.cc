// Pipeline splits (see pipeline_split.h): Megatron-Core's rules, its checks in its order.
//
// Pure functions of their arguments; validation returns a Status naming the field.
#include "core/pipeline_split.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

namespace mpusim {
namespace {

constexpr std::string_view kLayoutKey = "parallel.pipeline_model_parallel_layout";
constexpr std::string_view kFirstKey = "parallel.decoder_first_pipeline_num_layers";
constexpr std::string_view kLastKey = "parallel.decoder_last_pipeline_num_layers";
constexpr std::string_view kEmbeddingKey = "parallel.account_for_embedding_in_pipeline_split";
constexpr std::string_view kLossKey = "parallel.account_for_loss_in_pipeline_split";

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// The repetition count of "*N" starting at text[at] (at the '*'), and where it ends; nullopt
// when text[at..] is not '*' followed by a digit. Counts above kMaxLayoutChars saturate there
// (the caller refuses the unrolled length anyway).
std::optional<std::pair<int64_t, size_t>> RepeatAt(std::string_view text, size_t at) {
  if (at + 1 >= text.size() || text[at] != '*' || !IsDigit(text[at + 1])) return std::nullopt;
  int64_t n = 0;
  size_t end = at + 1;
  for (; end < text.size() && IsDigit(text[end]); ++end) {
    n = std::min<int64_t>(n * 10 + (text[end] - '0'), kMaxLayoutChars + 1);
  }
  return std::pair{n, end};
}

// Appends `unit` n times, refusing an unrolled layout above kMaxLayoutChars.
Status Repeat(std::string_view unit, int64_t n, std::string* out) {
  const auto size = static_cast<int64_t>(unit.size());
  if (n > 0 && size > (kMaxLayoutChars - static_cast<int64_t>(out->size())) / n) {
    return Status::Error(kLayoutKey, fmt::format("unrolls to more than {} characters; write a "
                                                 "layout of a real model",
                                                 kMaxLayoutChars));
  }
  for (int64_t i = 0; i < n; ++i) out->append(unit);
  return {};
}

// One pass of Python's re.sub over `text` with Megatron's two patterns, scanning left to
// right for non-overlapping matches: `\(([^)]+)\)\*(\d+)` (a group up to the first ')',
// which may contain '(', repeated), then, over that result, `(.)\*(\d+)` (one character
// other than a newline, repeated).
StatusOr<std::string> UnrollGroups(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    if (text[i] == '(') {
      const size_t close = text.find(')', i + 1);
      if (close != std::string_view::npos && close > i + 1) {
        if (const auto repeat = RepeatAt(text, close + 1)) {
          MPUSIM_RETURN_IF_ERROR(Repeat(text.substr(i + 1, close - i - 1), repeat->first, &out));
          i = repeat->second;
          continue;
        }
      }
    }
    out += text[i++];
  }
  return out;
}

StatusOr<std::string> UnrollCharacters(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    if (text[i] != '\n') {
      if (const auto repeat = RepeatAt(text, i + 1)) {
        MPUSIM_RETURN_IF_ERROR(Repeat(text.substr(i, 1), repeat->first, &out));
        i = repeat->second;
        continue;
      }
    }
    out += text[i++];
  }
  return out;
}

std::string Quoted(char c) {
  return (c >= 0x20 && c < 0x7f) ? fmt::format("'{}'", c)
                                 : fmt::format("byte 0x{:02x}", static_cast<unsigned char>(c));
}

// The decoder layers each stage builds: Megatron's get_num_layers_to_build for every stage.
StatusOr<std::vector<int64_t>> FromLayout(const PipelineSplit& split, int64_t num_layers) {
  StatusOr<std::vector<std::string>> stages =
      ParsePipelineLayout(*split.pipeline_model_parallel_layout);
  if (!stages.ok()) return stages.status();
  const int64_t p = split.pipeline_model_parallel_size;
  const int64_t v = split.virtual_pipeline_model_parallel_size.value_or(1);
  if (static_cast<int64_t>(stages->size()) != p * v) {
    return Status::Error(kLayoutKey,
                         fmt::format("has {} stages, but pipeline_model_parallel_size * "
                                     "virtual_pipeline_model_parallel_size is {} * {}",
                                     stages->size(), p, v));
  }
  // Megatron checks the flattened layout: its first layer is E and its last L, each once.
  // mpusim builds the embedding on the first stage and the loss on the last (as Megatron's
  // pre_process and post_process do), so E must open stage 0 itself (Megatron would also
  // take an empty stage 0 and E on stage 1, then build the embedding where E is not).
  const std::string& first = stages->front();
  const std::string& last = stages->back();
  if (first.empty() || first.front() != 'E') {
    return Status::Error(kLayoutKey, fmt::format("the first stage must start with E (the "
                                                 "embedding), got \"{}\"",
                                                 first));
  }
  if (last.empty() || last.back() != 'L') {
    return Status::Error(kLayoutKey, fmt::format("the last stage must end with L (the loss), "
                                                 "got \"{}\"",
                                                 last));
  }
  int64_t embeddings = 0, losses = 0, decoders = 0;
  std::vector<int64_t> counts;
  for (const std::string& stage : *stages) {
    counts.push_back(std::count(stage.begin(), stage.end(), 't'));
    decoders += counts.back();
    embeddings += std::count(stage.begin(), stage.end(), 'E');
    losses += std::count(stage.begin(), stage.end(), 'L');
  }
  if (embeddings != 1) {
    return Status::Error(kLayoutKey, fmt::format("E (the embedding) must appear exactly once, "
                                                 "got {}",
                                                 embeddings));
  }
  if (losses != 1) {
    return Status::Error(kLayoutKey,
                         fmt::format("L (the loss) must appear exactly once, got {}", losses));
  }
  if (decoders != num_layers) {
    return Status::Error(kLayoutKey, fmt::format("has {} decoder layers (t), but num_layers is "
                                                 "{}; the t's must count to num_layers",
                                                 decoders, num_layers));
  }
  return counts;
}

// get_num_layers_to_build with decoder_first/last_pipeline_num_layers.
StatusOr<std::vector<int64_t>> FromFirstLast(const PipelineSplit& split, int64_t num_layers) {
  const int64_t p = split.pipeline_model_parallel_size;
  const int64_t v = split.virtual_pipeline_model_parallel_size.value_or(1);
  const auto& first = split.decoder_first_pipeline_num_layers;
  const auto& last = split.decoder_last_pipeline_num_layers;
  const int64_t middle_stages = p - (first ? 1 : 0) - (last ? 1 : 0);
  const int64_t fixed = first.value_or(0) + last.value_or(0);  // each <= 2^20 (checked)
  const int64_t middle_layers = num_layers - fixed;
  const std::string_view key = first ? kFirstKey : kLastKey;
  if (middle_layers < 0) {
    return Status::Error(key, fmt::format("{} layers on the first and last pipeline stages are "
                                          "more than num_layers {}",
                                          fixed, num_layers));
  }
  // Megatron: "Ensure you either have middle pp stages and layers or none of them".
  if ((middle_layers == 0) != (middle_stages == 0)) {
    return Status::Error(
        key, fmt::format("leaves {} layers for the {} middle pipeline stages; with middle "
                         "stages each needs layers, without them the first and last stages "
                         "must hold all num_layers {}",
                         middle_layers, middle_stages, num_layers));
  }
  int64_t per_middle_rank = 0;
  if (middle_stages > 0) {
    if (middle_layers % middle_stages != 0) {
      return Status::Error(key, fmt::format("leaves {} layers, not divisible by the {} middle "
                                            "pipeline stages",
                                            middle_layers, middle_stages));
    }
    per_middle_rank = middle_layers / middle_stages;
    if (per_middle_rank % v != 0) {
      return Status::Error(key, fmt::format("leaves {} layers on each middle pipeline rank, not "
                                            "divisible by virtual_pipeline_model_parallel_size {}",
                                            per_middle_rank, v));
    }
  }
  std::vector<int64_t> counts(static_cast<size_t>(p * v));
  for (int64_t r = 0; r < p; ++r) {
    int64_t on_rank = per_middle_rank;
    if (r == 0 && first) on_rank = *first;
    if (r == p - 1 && last) on_rank = *last;
    for (int64_t c = 0; c < v; ++c) counts[static_cast<size_t>(c * p + r)] = on_rank / v;
  }
  return counts;
}

// get_num_layers_to_build with account_for_embedding/loss_in_pipeline_split.
StatusOr<std::vector<int64_t>> FromAccounted(const PipelineSplit& split, int64_t num_layers) {
  const int64_t p = split.pipeline_model_parallel_size;
  const int64_t v = split.virtual_pipeline_model_parallel_size.value_or(1);
  const bool e = split.account_for_embedding_in_pipeline_split;
  const bool l = split.account_for_loss_in_pipeline_split;
  const int64_t counted = num_layers + (e ? 1 : 0) + (l ? 1 : 0);
  const std::string_view key = e ? kEmbeddingKey : kLossKey;
  const std::string what = e && l ? "the embedding and the loss" : e ? "the embedding" : "the loss";
  if (counted % p != 0) {
    return Status::Error(key, fmt::format("counts {} as layers: num_layers {} + {} = {} is not "
                                          "divisible by pipeline_model_parallel_size {}",
                                          what, num_layers, counted - num_layers, counted, p));
  }
  if ((counted / p) % v != 0) {
    return Status::Error(key, fmt::format("counts {} as layers: {} per pipeline rank is not "
                                          "divisible by virtual_pipeline_model_parallel_size {}",
                                          what, counted / p, v));
  }
  std::vector<int64_t> counts(static_cast<size_t>(p * v), counted / p / v);
  if (e) --counts.front();  // >= 0: each stage counts at least one
  if (l) --counts.back();
  return counts;
}

}  // namespace

StatusOr<std::vector<std::string>> ParsePipelineLayout(std::string_view layout) {
  std::string text(layout);
  std::erase(text, ',');  // purely cosmetic commas
  StatusOr<std::string> groups = UnrollGroups(text);
  if (!groups.ok()) return groups.status();
  StatusOr<std::string> unrolled = UnrollCharacters(*groups);
  if (!unrolled.ok()) return unrolled.status();
  std::vector<std::string> stages(1);
  for (const char c : *unrolled) {
    if (c == '|') {
      stages.emplace_back();
    } else if (c == 'E' || c == 't' || c == 'L' || c == 'm') {
      stages.back() += c;
    } else {
      return Status::Error(
          kLayoutKey,
          fmt::format("invalid layer character {} in stage {} (after unrolling \"{}\"); allowed: "
                      "E (embedding), t (transformer layer), L (loss), m (MTP layer), '|' "
                      "between stages, x*N and (...)*N repetition, commas",
                      Quoted(c), stages.size() - 1, layout));
    }
  }
  return stages;
}

Status ResolvePipelineSplitKeys(PipelineSplit* split) {
  const int64_t p = split->pipeline_model_parallel_size;
  const auto& vp = split->virtual_pipeline_model_parallel_size;
  const auto& first = split->decoder_first_pipeline_num_layers;
  const auto& last = split->decoder_last_pipeline_num_layers;
  const bool accounted =
      split->account_for_embedding_in_pipeline_split || split->account_for_loss_in_pipeline_split;
  if ((first || last) && accounted) {
    return Status::Error(first ? kFirstKey : kLastKey,
                         "cannot be set together with account_for_embedding_in_pipeline_split "
                         "or account_for_loss_in_pipeline_split (Megatron's rule); choose one");
  }
  if (split->pipeline_model_parallel_layout) {
    if (first || last || accounted) {
      return Status::Error(kLayoutKey,
                           "cannot be set with decoder_first_pipeline_num_layers, "
                           "decoder_last_pipeline_num_layers, "
                           "account_for_embedding_in_pipeline_split or "
                           "account_for_loss_in_pipeline_split (Megatron's rule: the layout "
                           "places every layer itself)");
    }
    StatusOr<std::vector<std::string>> stages =
        ParsePipelineLayout(*split->pipeline_model_parallel_layout);
    if (!stages.ok()) return stages.status();
    const auto n = static_cast<int64_t>(stages->size());
    if (n % p != 0) {
      return Status::Error(kLayoutKey,
                           fmt::format("has {} stages, not a multiple of "
                                       "pipeline_model_parallel_size {} (each pipeline rank "
                                       "holds stages / pp model chunks)",
                                       n, p));
    }
    if (vp && *vp != n / p) {
      return Status::Error(kLayoutKey,
                           fmt::format("has {} stages, {} per pipeline rank, but "
                                       "virtual_pipeline_model_parallel_size is {}; give {} or "
                                       "leave it unset",
                                       n, n / p, *vp, n / p));
    }
    if (!vp && n / p > 1) split->virtual_pipeline_model_parallel_size = n / p;
    return {};
  }
  for (const auto& [key, value] : {std::pair{kFirstKey, first}, std::pair{kLastKey, last}}) {
    if (!value) continue;
    if (*value < 1 || *value > kMaxAssignedLayers) {
      return Status::Error(key, fmt::format("must be between 1 and {} (layers on that pipeline "
                                            "stage), got {}",
                                            kMaxAssignedLayers, *value));
    }
    if (vp && *value % *vp != 0) {
      return Status::Error(key, fmt::format("{} is not divisible by "
                                            "virtual_pipeline_model_parallel_size {} (the stage's "
                                            "layers split evenly over its model chunks)",
                                            *value, *vp));
    }
  }
  if (first && last && p < 2) {
    return Status::Error(kLastKey,
                         "cannot be set together with "
                         "decoder_first_pipeline_num_layers at "
                         "pipeline_model_parallel_size 1 (the one stage is both)");
  }
  return {};
}

Status CheckMtpInLayout(const PipelineSplit& split, int64_t mtp_num_layers) {
  if (!split.pipeline_model_parallel_layout) return {};
  StatusOr<std::vector<std::string>> stages =
      ParsePipelineLayout(*split.pipeline_model_parallel_layout);
  if (!stages.ok()) return stages.status();
  const int64_t p = split.pipeline_model_parallel_size;
  const auto n = static_cast<int64_t>(stages->size());
  int64_t count = 0;
  std::optional<int64_t> stage;  // the stage of the first m
  for (int64_t u = 0; u < n; ++u) {
    const std::string& layers = (*stages)[static_cast<size_t>(u)];
    const auto here = static_cast<int64_t>(std::count(layers.begin(), layers.end(), 'm'));
    if (here > 0 && !stage) stage = u;
    count += here;
  }
  if (count != mtp_num_layers) {
    return Status::Error(kLayoutKey,
                         fmt::format("has {} m (multi-token prediction layers), but "
                                     "mtp_num_layers is {} (Megatron's rule: the m's must count "
                                     "to mtp_num_layers; put them on the last stage, before L, "
                                     "e.g. \"...|tmL\")",
                                     count, mtp_num_layers));
  }
  if (!stage) return {};
  // Flattened, no t after the first m; all m's in one stage.
  bool after_m = false;
  for (int64_t u = 0; u < n; ++u) {
    for (char c : (*stages)[static_cast<size_t>(u)]) {
      if (c == 'm') {
        if (u != *stage) {
          return Status::Error(kLayoutKey,
                               fmt::format("has m on stages {} and {}: all of the MTP layers "
                                           "must be in the same one virtual pipeline stage "
                                           "(Megatron's rule)",
                                           *stage, u));
        }
        after_m = true;
      } else if (c == 't' && after_m) {
        return Status::Error(kLayoutKey,
                             "has a t after an m: decoder layers must be placed "
                             "before MTP layers (Megatron's rule)");
      }
    }
  }
  const int64_t pp_rank = *stage % p, chunk = *stage / p, chunks = n / p;
  if (chunk != chunks - 1) {
    return Status::Error(kLayoutKey,
                         fmt::format("has the MTP layers on stage {} (pipeline rank {}, model "
                                     "chunk {}): Megatron keeps them in the last model chunk of "
                                     "a pipeline rank",
                                     *stage, pp_rank, chunk));
  }
  if (*stage != n - 1) {
    return Status::Error(kLayoutKey,
                         fmt::format("has the MTP layers on stage {} and the loss on stage {}: a "
                                     "standalone MTP stage (Megatron's mtp_standalone, which "
                                     "sends the depths' hidden states with the decoder's to the "
                                     "loss stage) is not built yet; put the m's on the last "
                                     "stage, before L",
                                     *stage, n - 1));
  }
  return {};
}

StatusOr<std::vector<int64_t>> LayersPerStage(const PipelineSplit& split, int64_t num_layers) {
  if (split.pipeline_model_parallel_layout) return FromLayout(split, num_layers);
  if (split.decoder_first_pipeline_num_layers || split.decoder_last_pipeline_num_layers) {
    return FromFirstLast(split, num_layers);
  }
  if (split.account_for_embedding_in_pipeline_split || split.account_for_loss_in_pipeline_split) {
    return FromAccounted(split, num_layers);
  }
  const int64_t pp_size = split.pipeline_model_parallel_size;
  const int64_t num_chunks = split.virtual_pipeline_model_parallel_size.value_or(1);
  // Written as divisions so that absurd sizes cannot overflow p*v.
  if (pp_size > num_layers || num_chunks > num_layers / pp_size ||
      num_layers % (pp_size * num_chunks) != 0) {
    const std::string divisor =
        split.virtual_pipeline_model_parallel_size.has_value()
            ? fmt::format(
                  "pipeline_model_parallel_size * virtual_pipeline_model_parallel_size "
                  "= {} * {}",
                  pp_size, num_chunks)
            : fmt::format("pipeline_model_parallel_size = {}", pp_size);
    return Status::Error("num_layers",
                         fmt::format("must be divisible by {}, got {}", divisor, num_layers));
  }
  return std::vector<int64_t>(static_cast<size_t>(pp_size * num_chunks),
                              num_layers / (pp_size * num_chunks));
}

StatusOr<LayerAssignment> AssignLayers(const PipelineSplit& split, int64_t num_layers) {
  const int64_t pp_size = split.pipeline_model_parallel_size;
  if (pp_size < 1) {
    return Status::Error("pipeline_model_parallel_size",
                         fmt::format("must be at least 1, got {}", pp_size));
  }
  if (const auto& vp = split.virtual_pipeline_model_parallel_size) {
    if (*vp < 1) {
      return Status::Error("virtual_pipeline_model_parallel_size",
                           fmt::format("must be at least 1, got {}", *vp));
    }
    if (pp_size == 1) {
      return Status::Error("virtual_pipeline_model_parallel_size",
                           "pipeline-model-parallel size should be greater than 1 with "
                           "interleaved schedule (pipeline_model_parallel_size is 1); leave it "
                           "unset");
    }
  }
  if (num_layers < 1) {
    return Status::Error("num_layers", fmt::format("must be at least 1, got {}", num_layers));
  }
  if (num_layers > kMaxAssignedLayers) {
    return Status::Error("num_layers",
                         fmt::format("the assignment lists every layer; at most {} layers, got {}",
                                     kMaxAssignedLayers, num_layers));
  }
  // Every split's checks bound its stages by the layers (or a layout's length), so the
  // lists below stay small.
  const int64_t num_chunks = split.virtual_pipeline_model_parallel_size.value_or(1);
  StatusOr<std::vector<int64_t>> counts = LayersPerStage(split, num_layers);
  if (!counts.ok()) return counts.status();
  LayerAssignment layers(static_cast<size_t>(pp_size),
                         std::vector<std::vector<int64_t>>(static_cast<size_t>(num_chunks)));
  int64_t next = 1;
  for (int64_t u = 0; u < pp_size * num_chunks; ++u) {
    auto& chunk = layers[static_cast<size_t>(u % pp_size)][static_cast<size_t>(u / pp_size)];
    for (int64_t i = 0; i < (*counts)[static_cast<size_t>(u)]; ++i) chunk.push_back(next++);
  }
  return layers;
}

StatusOr<LayerAssignment> AssignLayers(int64_t pipeline_model_parallel_size,
                                       std::optional<int64_t> virtual_pipeline_model_parallel_size,
                                       int64_t num_layers) {
  PipelineSplit split;
  split.pipeline_model_parallel_size = pipeline_model_parallel_size;
  split.virtual_pipeline_model_parallel_size = virtual_pipeline_model_parallel_size;
  return AssignLayers(split, num_layers);
}

std::vector<StageLayers> StagesOf(const LayerAssignment& assignment) {
  const auto p = static_cast<int64_t>(assignment.size());
  const auto v = p == 0 ? int64_t{0} : static_cast<int64_t>(assignment.front().size());
  std::vector<StageLayers> stages;
  int64_t first = 0;
  for (int64_t u = 0; u < p * v; ++u) {
    const auto& chunk = assignment[static_cast<size_t>(u % p)][static_cast<size_t>(u / p)];
    stages.push_back({first, static_cast<int64_t>(chunk.size())});
    first += stages.back().count;
  }
  return stages;
}

std::string DescribeSplit(const PipelineSplit& split) {
  std::vector<std::string> keys;
  if (split.pipeline_model_parallel_layout) {
    keys.push_back(fmt::format("pipeline_model_parallel_layout \"{}\"",
                               *split.pipeline_model_parallel_layout));
  }
  if (split.decoder_first_pipeline_num_layers) {
    keys.push_back(fmt::format("decoder_first_pipeline_num_layers {}",
                               *split.decoder_first_pipeline_num_layers));
  }
  if (split.decoder_last_pipeline_num_layers) {
    keys.push_back(fmt::format("decoder_last_pipeline_num_layers {}",
                               *split.decoder_last_pipeline_num_layers));
  }
  if (split.account_for_embedding_in_pipeline_split) {
    keys.push_back("account_for_embedding_in_pipeline_split");
  }
  if (split.account_for_loss_in_pipeline_split)
    keys.push_back("account_for_loss_in_pipeline_split");
  std::string out;
  for (const std::string& key : keys) out += (out.empty() ? "" : ", ") + key;
  return out;
}

std::vector<StageLayers> CheckedStages(const PipelineSplit& split, int64_t num_layers) {
  StatusOr<LayerAssignment> layers = AssignLayers(split, num_layers);
  if (!layers.ok()) throw std::invalid_argument(layers.status().Message());
  return StagesOf(*layers);
}

}  // namespace mpusim
