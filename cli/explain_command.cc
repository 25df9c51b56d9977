// `mpusim explain`: how every weight of the model is sliced across the tensor-parallel ranks:
// a layer chain in the MPU lab's notation (Y = X A + b, A = W^T), a GPT model parameter by
// parameter in Megatron's state-dict names.
#include <ostream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/config_options.h"
#include "core/model/gpt_model.h"
#include "core/model/graph.h"
#include "core/topology.h"

namespace mpusim::cli {
namespace {

class ExplainCommand : public Command {
 public:
  explicit ExplainCommand(CLI::App* parent) {
    app_ = parent->add_subcommand(
        "explain", "Show how each weight of the model is sliced across tensor-parallel ranks");
    app_->footer("Example:\n  mpusim explain sample_configs/lab_column_parallel_t16_n16.json");
    config_.Register(app_);
  }
  CLI::App* app() override { return app_; }

  int Run(std::ostream& out, std::ostream& err) override {
    std::optional<ConfigOptions::Layout> layout = config_.ResolveLayout(err);
    if (!layout) return kExitUsage;
    const Topology* topology = &layout->topology;
    // How weights are sliced does not depend on the data: without a run section, explain
    // uses the shortest sequence and the fewest micro-batches every split and schedule accept.
    Config with_run = layout->config;
    if (!with_run.run) {
      RunConfig run;
      run.seq_length = topology->sizes().tp * topology->sizes().cp;
      run.num_microbatches =
          with_run.parallel.microbatch_group_size_per_vp_stage.value_or(topology->sizes().pp);
      with_run.run = run;
    }
    const Config* config = &with_run;
    std::string source;
    if (config->gpt) return ExplainGpt(*config, *topology, out, err);
    StatusOr<std::unique_ptr<Graph>> graph = Graph::Build(*config, *topology);
    if (!graph.ok()) {
      return ReportError(err, source, config_.Attribute(graph.status(), &source).Message());
    }
    const int64_t t = topology->sizes().tp;
    out << fmt::format("tensor_model_parallel_size {}: each weight below is cut into {} slices; "
                       "rank r of a tp group holds slice r\n",
                       t, t);
    // Shapes on every tp rank (equal, but listed as the lab does).
    std::vector<std::vector<Graph::PlannedLayer>> per_rank;
    for (int64_t r = 0; r < t; ++r) {
      RankCoordinates coords;
      coords.tp = r;
      per_rank.push_back((*graph)->Plan(coords));
    }
    for (size_t i = 0; i < per_rank[0].size(); ++i) {
      const Graph::PlannedLayer& layer = per_rank[0][i];
      out << fmt::format(
          "\n{} {}: input {} -> output {}{}\n", layer.type, layer.name,
          layer.input_width == 0
              ? std::string("tokens")
              : fmt::format("{} ({})", layer.input_width, SplitName(layer.input.split)),
          layer.output_width == 0
              ? std::string("loss")
              : fmt::format("{} ({})", layer.output_width, SplitName(layer.output.split)),
          topology->sizes().pp > 1
              ? fmt::format("; pipeline rank {}, chunk {}", layer.pp_rank, layer.chunk)
              : std::string());
      for (size_t p = 0; p < layer.parameters.size(); ++p) {
        const Graph::PlannedParameter& param = layer.parameters[p];
        const bool linear = layer.type == "ColumnParallelLinear" ||
                            layer.type == "RowParallelLinear";
        const bool matrix = param.full_shape.size() == 2;
        std::string how =
            param.tp_dim < 0
                ? "replicated on every rank"
                : fmt::format(
                      "split on dim {} into {} slices{}", param.tp_dim, t,
                      param.tp_stride > 1 ? fmt::format(" (stride {})", param.tp_stride) : "");
        out << fmt::format("  {} {} {}\n", param.name, ShapeString(param.full_shape), how);
        if (param.tp_dim < 0) continue;
        if (!(linear && matrix)) {
          std::vector<std::string> slices;
          for (int64_t r = 0; r < t; ++r) {
            slices.push_back(fmt::format("{}{}= {}", param.name.substr(param.name.find('.') + 1),
                                         r, ShapeString(per_rank[static_cast<size_t>(r)][i]
                                                            .parameters[p]
                                                            .local_shape)));
          }
          out << fmt::format("    {}\n", fmt::join(slices, ", "));
          continue;
        }
        // The lab writes Y = X A with A = W^T ([in, out]); a column-parallel layer cuts A's
        // columns, a row-parallel layer A's rows.
        out << fmt::format("    Y = X A + b with A = weight^T {}, sliced {}:\n",
                           ShapeString({param.full_shape[1], param.full_shape[0]}),
                           param.tp_dim == 0 ? "column-wise" : "row-wise");
        std::vector<std::string> slices;
        for (int64_t r = 0; r < t; ++r) {
          const Shape& local = per_rank[static_cast<size_t>(r)][i].parameters[p].local_shape;
          slices.push_back(fmt::format("A{}= {}", r, ShapeString({local[1], local[0]})));
        }
        out << fmt::format("    A = [\n    {}\n    ]\n", fmt::join(slices, ", "));
      }
    }
    // Region mappings that give t-fold gradients as Megatron's code does (docs/simulator.md,
    // "Warnings"); the layout stays valid, so the exit code does too.
    if (!(*graph)->warnings().empty()) out << '\n';
    for (const std::string& warning : (*graph)->warnings()) {
      out << "warning: " << EscapeControl(warning) << '\n';
    }
    return kExitOk;
  }


 private:
  // The GPT model: every parameter, its split and this rank's piece, in state-dict order.
  int ExplainGpt(const Config& config, const Topology& topology, std::ostream& out,
                 std::ostream& err) {
    const int64_t pp = topology.sizes().pp;
    for (int64_t stage = 0; stage < pp; ++stage) {
      RankCoordinates coords;
      coords.pp = stage;
      std::string source;
      StatusOr<std::unique_ptr<GptModel>> model = GptModel::Build(config, topology, coords);
      if (!model.ok()) {
        return ReportError(err, source, config_.Attribute(model.status(), &source).Message());
      }
      ExplainGptStage(config, topology, **model, stage, out);
    }
    return kExitOk;
  }

  // One pipeline stage's parameters (the whole model when pp = 1).
  void ExplainGptStage(const Config& config, const Topology& topology, GptModel& model,
                       int64_t stage, std::ostream& out) {
    const GptConfig& gpt = model.gpt();
    const int64_t t = topology.sizes().tp;
    const int64_t pp = topology.sizes().pp;
    const bool sp = config.parallel.sequence_parallel && t > 1;
    if (stage == 0) {
      out << fmt::format(
          "GPT model (Megatron-Core GPTModel, local layer spec), "
          "tensor_model_parallel_size {}, sequence_parallel {}: a split parameter "
          "is cut into {} slices and rank r of a tp group holds slice r\n",
          t, sp, t);
    }
    if (pp > 1) {
      std::vector<std::string> chunks;
      for (const GptChunk& chunk : model.chunks()) {
        std::vector<std::string> parts;
        if (chunk.pre_process) parts.push_back("embedding");
        if (!chunk.layers.empty()) {
          parts.push_back(
              chunk.layers.size() == 1
                  ? fmt::format("layer {}", chunk.layers.front())
                  : fmt::format("layers {}-{}", chunk.layers.front(), chunk.layers.back()));
        }
        if (chunk.post_process) parts.push_back("final norm, output layer, loss");
        chunks.push_back(fmt::format("[{}]", fmt::join(parts, ", ")));
      }
      out << fmt::format("pipeline stage {} of {}: chunks {}\n", stage, pp, fmt::join(chunks, " "));
    }
    const int64_t groups_local = gpt.num_query_groups / t;
    const int64_t per_group = gpt.num_attention_heads / gpt.num_query_groups;
    for (const auto& p : model.parameters().all()) {
      const Shape local = LocalShape(p->shard, p->full_shape);
      std::string how = "replicated";
      const Placement* split = p->shard.Find(ShardAxis::kTp);
      if (split != nullptr) {
        how = fmt::format("split on dim {}{}: {} per rank", split->dim,
                          split->stride > 1 ? fmt::format(" with stride {}", split->stride) : "",
                          ShapeString(local));
      }
      std::string note;
      if (p->name.find("linear_qkv") != std::string::npos) {
        note = fmt::format("; per rank {} query group{} of ({} query head{}, 1 key, 1 value) x {} "
                           "channels",
                           groups_local, groups_local == 1 ? "" : "s", per_group,
                           per_group == 1 ? "" : "s", gpt.kv_channels);
      } else if (split != nullptr && split->stride == 2) {
        note = "; per rank its gate rows, then the same up rows (SwiGLU)";
      } else if (p->name == "embedding.word_embeddings.weight" && t > 1) {
        note = fmt::format("; rank r holds vocabulary rows [{} r, {} (r + 1))", local[0], local[0]);
      }
      if (p->sequence_parallel) note += "; gradient all-reduced over tp (sequence parallel)";
      if (p->embedding_group) {
        note +=
            "; tied: the first and the last stage each hold it, gradient all-reduced over "
            "embd";
      }
      out << fmt::format("  {} {} {}{}\n", p->name, ShapeString(p->full_shape), how, note);
    }
    if (gpt.share_embeddings_and_output_weights && stage == pp - 1) {
      out << "  output_layer uses embedding.word_embeddings.weight (shared)\n";
    }
  }

  CLI::App* app_ = nullptr;
  ConfigOptions config_;
};

}  // namespace

std::unique_ptr<Command> MakeExplainCommand(CLI::App* parent) {
  return std::make_unique<ExplainCommand>(parent);
}

}  // namespace mpusim::cli
