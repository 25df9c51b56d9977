// Mixture-of-experts GPT models on K MPI ranks against the float64 reference: every tp
// (with sequence parallelism) x cp x pp layout the world allows, dp filling it, with every
// expert-parallel and expert tensor-parallel size that fits, for a dropless router with a
// shared expert, the load-balancing loss and the z-loss, and for one that drops tokens over
// capacity, under both token dispatchers; training with the plain and the distributed
// optimizer. The router groups are each rank's own tokens, so a layout is checked against the
// reference with its data-parallel split; a dropless router's forward does not depend on it,
// so those layouts' losses all agree.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "reference/gpt_reference.h"
#include "tests/model/gpt_mpi_helpers.h"
#include "tests/mpi/world.h"
#include "tests/sanitizers.h"

namespace mpusim {
namespace {

using nlohmann::json;
using namespace gpt_mpi;

// Four experts on both layers, top-2 after the softmax, no token dropped; the
// load-balancing loss, the z-loss and a shared expert (Llama-style otherwise).
json Dropless() {
  json model = Llama(8, 4);
  model["num_moe_experts"] = 4;
  model["moe_router_topk"] = 2;
  model["moe_ffn_hidden_size"] = 16;
  model["moe_aux_loss_coeff"] = 0.01;
  model["moe_z_loss_coeff"] = 0.001;
  model["moe_shared_expert_intermediate_size"] = 24;
  return model;
}

// Four experts on the second layer only, top-1 of the softmax, capacity factor 1 (tokens
// dropped by probability), moe_grouped_gemm (which changes no name or number), gelu.
json Dropping() {
  json model = Gpt(8, 8);
  model["add_bias_linear"] = false;
  model["num_moe_experts"] = 4;
  model["moe_router_topk"] = 1;
  model["moe_router_pre_softmax"] = true;
  model["moe_layer_freq"] = json::array({0, 1});
  model["moe_ffn_hidden_size"] = 24;
  model["moe_aux_loss_coeff"] = 0.02;
  model["moe_expert_capacity_factor"] = 1.0;
  model["moe_grouped_gemm"] = true;
  return model;
}

// gpt-oss's MoE MLP: add_bias_linear (the router's bias, each expert's linear_fc1 and
// linear_fc2 biases, fc2's weighted by the routing probability) with the clamped quick-GELU
// GLU (offset 1, clamp 0.1: fc1's outputs have a standard deviation of about 0.11 at
// initialisation); no shared expert (Megatron refuses biases there).
json GptOss() {
  json model = Llama(8, 4);
  model["add_bias_linear"] = true;
  model["activation"] = "quick_geglu";
  model["glu_linear_offset"] = 1.0;
  model["activation_func_clamp_value"] = 0.1;
  model["num_moe_experts"] = 4;
  model["moe_router_topk"] = 2;
  model["moe_ffn_hidden_size"] = 16;
  model["moe_aux_loss_coeff"] = 0.01;
  return model;
}

// The same with capacity 1 (top-1, tokens dropped by probability) and moe_grouped_gemm.
json GptOssDropping() {
  json model = GptOss();
  model["moe_router_topk"] = 1;
  model["moe_expert_capacity_factor"] = 1.0;
  model["moe_grouped_gemm"] = true;
  return model;
}

// Every iteration's gradient norm equals the reference trainer's (float64).
void ExpectReferenceNorms(const run::SimulationResult& result) {
  ASSERT_EQ(result.iterations.size(), result.check.reference_iterations.size());
  for (size_t i = 0; i < result.iterations.size(); ++i) {
    const double ref = result.check.reference_iterations[i].grad_norm;
    EXPECT_NEAR(result.iterations[i].grad_norm, ref, 1e-12 * ref) << "iteration " << i + 1;
  }
}

// `etp` 0: expert_tensor_parallel_size left to its default, tp.
json MoeDocument(const json& model, int64_t tp, int64_t cp, int64_t pp, const char* dtype,
                 int64_t ep = 1, int64_t etp = 0) {
  json document = Document(model, tp, tp > 1, dtype);
  document["parallel"]["context_parallel_size"] = cp;
  document["parallel"]["pipeline_model_parallel_size"] = pp;
  document["parallel"]["expert_model_parallel_size"] = ep;
  if (etp > 0) document["parallel"]["expert_tensor_parallel_size"] = etp;
  document["run"]["seq_length"] = 16;
  document["run"]["micro_batch_size"] = Samples() / (WorldSize() / (tp * cp * pp));
  return document;
}

struct Layout {
  int64_t tp, cp, pp, ep, etp;
  bool operator==(const Layout&) const = default;
  std::string Name() const {
    return fmt::format("tp {} cp {} pp {} ep {}{}", tp, cp, pp, ep,
                       etp != tp ? fmt::format(" etp {}", etp) : "");
  }
  json Document(const json& model, const char* dtype = "float64") const {
    return MoeDocument(model, tp, cp, pp, dtype, ep, etp);
  }
};

// Under the sanitizers (about 5 times slower) the suites keep a representative subset:
// every tp, cp and ep, but the pipeline, the dropping router and etp other than tp on fewer
// layouts.
constexpr bool kSanitized = mpusim::testing::kAddressSanitizer;

// Every tp x cp x pp a world of `world` ranks allows, in each every ep in {1, 2, 4} that
// divides dp x cp (expert parallelism is carved out of them), and for each the expert
// tensor-parallel sizes etp in {1, 2, 4} with etp x ep x pp dividing the world (tp's own
// first).
std::vector<Layout> Layouts(int64_t world = WorldSize()) {
  std::vector<Layout> layouts;
  for (int64_t tp : {1, 2, 4}) {
    for (int64_t cp : {1, 2}) {
      for (int64_t pp : {1, 2}) {
        const int64_t mp = tp * cp * pp;
        if (mp > world || world % mp != 0) continue;
        const int64_t dp_cp = world / (tp * pp);
        for (int64_t ep : {1, 2, 4}) {
          if (ep > dp_cp || dp_cp % ep != 0) continue;
          layouts.push_back({tp, cp, pp, ep, tp});
          for (int64_t etp : {1, 2, 4}) {
            if (etp != tp && world % (etp * ep * pp) == 0) {
              layouts.push_back({tp, cp, pp, ep, etp});
            }
          }
        }
      }
    }
  }
  return layouts;
}

// The layouts of Layouts() that a world of half as many ranks cannot form. The routers' and
// the MLPs' variants run each layout once, in the smallest world of the suite's (1, 2, 4 and
// 8 ranks) that forms it: the larger one only adds data-parallel ranks, which the variants'
// code meets in the same reductions over the same groups. EveryLayoutMatchesTheReference runs
// every layout in every world.
std::vector<Layout> NewLayouts() {
  const std::vector<Layout> smaller =
      WorldSize() > 1 ? Layouts(WorldSize() / 2) : std::vector<Layout>{};
  std::vector<Layout> layouts;
  for (const Layout& l : Layouts()) {
    if (std::find(smaller.begin(), smaller.end(), l) == smaller.end()) layouts.push_back(l);
  }
  return layouts;
}

TEST(GptMixtureOfExperts, EveryLayoutMatchesTheReference) {
  std::map<int64_t, double> first_loss;  // by tp (the Llama vocabulary pads per tp size)
  for (const Layout& l : Layouts()) {
    if (kSanitized && ((l.pp > 1 && l.ep > 1) || (l.etp != l.tp && (l.pp > 1 || l.cp > 1)))) {
      continue;
    }
    SCOPED_TRACE("dropless " + l.Name());
    if (WorldRank() == 0) fmt::print("  dropless {}:", l.Name());
    const double loss = RunChecked(l.Document(Dropless())).loss;
    first_loss.try_emplace(l.tp, loss);
    EXPECT_NEAR(loss, first_loss.at(l.tp), 1e-12 * loss);
  }
  for (const Layout& l : Layouts()) {
    if (kSanitized && (l.pp > 1 || l.cp > 1 || l.etp != l.tp)) continue;
    SCOPED_TRACE("capacity 1 " + l.Name());
    if (WorldRank() == 0) fmt::print("  capacity 1 {}:", l.Name());
    RunChecked(l.Document(Dropping()));
  }
}

// "seq_aux_loss", Megatron's per-sample load-balancing loss averaged over the micro-batch's
// samples (its counts per sample, summed over the sample's tp and cp pieces): every pp 1
// layout of NewLayouts (a dp rank holds 8 / dp samples, so the per-sample counts differ from the
// micro-batch's), and 3 Adam iterations with ep 2 and the alltoall dispatcher.
TEST(GptMixtureOfExperts, SequenceAuxLossMatchesTheReference) {
  json model = Dropless();
  model["moe_router_load_balancing_type"] = "seq_aux_loss";
  model["moe_aux_loss_coeff"] = 0.1;
  for (const Layout& l : NewLayouts()) {
    if (l.pp > 1 || (kSanitized && (l.cp > 1 || l.etp != l.tp || l.ep > 2 || l.tp > 2))) {
      continue;
    }
    SCOPED_TRACE("seq_aux_loss " + l.Name());
    if (WorldRank() == 0) fmt::print("  seq_aux_loss {}:", l.Name());
    RunChecked(l.Document(model));
  }
  if (WorldSize() < 2) return;
  if (WorldRank() == 0) fmt::print("  seq_aux_loss ep 2, Adam:");
  model["moe_token_dispatcher_type"] = "alltoall";
  json document = Training(MoeDocument(model, 1, 1, 1, "float64", 2), "adam");
  document["run"]["train_iters"] = 3;
  ExpectReferenceNorms(RunChecked(document));
}

json AllToAll(json model) {
  model["moe_token_dispatcher_type"] = "alltoall";
  return model;
}

// Biases with MoE on every layout of NewLayouts Megatron allows them on (etp 1): tp
// with sp, cp, pp, ep, both dispatchers, dropless and capacity 1, two SGD steps each (the
// second with nonzero expert biases); float32 on one; 3 Adam iterations with the distributed
// optimizer and ep 2, each iteration's norm the reference's.
TEST(GptMixtureOfExperts, BiasesAndClampedGluMatchTheReference) {
  for (const Layout& l : NewLayouts()) {
    if (l.etp != 1) continue;
    if (kSanitized && (l.pp > 1 || l.cp > 1)) continue;
    for (const bool alltoall : {false, true}) {
      for (const bool dropping : {false, true}) {
        if (dropping && l.pp > 1) continue;
        const json model = dropping ? GptOssDropping() : GptOss();
        const std::string name = fmt::format("gpt-oss {}{}{}", dropping ? "capacity 1 " : "",
                                             alltoall ? "alltoall " : "", l.Name());
        SCOPED_TRACE(name);
        if (WorldRank() == 0) fmt::print("  {}:", name);
        // Two SGD steps: Megatron initialises the experts' biases to zero, so the second
        // iteration's tensors are the ones that carry them.
        json document = Training(l.Document(alltoall ? AllToAll(model) : model), "sgd");
        document["run"]["train_iters"] = 2;
        RunChecked(document);
      }
    }
  }
  const int64_t tp = WorldSize() >= 2 ? 2 : 1;
  if (WorldRank() == 0) fmt::print("  gpt-oss float32 tp {} etp 1:", tp);
  RunChecked(MoeDocument(GptOss(), tp, 1, 1, "float32", 1, 1));
  if (WorldSize() < 2) return;
  for (const json& model : {GptOss(), AllToAll(GptOssDropping())}) {
    if (WorldRank() == 0) fmt::print("  gpt-oss ep 2, distributed optimizer:");
    json document = Training(MoeDocument(model, 1, 1, 1, "float64", 2), "adam");
    document["run"]["train_iters"] = 3;
    document["optimizer"]["use_distributed_optimizer"] = true;
    ExpectReferenceNorms(RunChecked(document));
  }
}

// The alltoall dispatcher (the uneven all-to-all over ep, then the exchange over tp) on every
// layout of NewLayouts, both routers: the same check, and the dropless losses of the allgather
// dispatcher.
TEST(GptMixtureOfExperts, AllToAllDispatcherMatchesTheReference) {
  std::map<int64_t, double> first_loss;
  for (const Layout& l : NewLayouts()) {
    // Sanitized: etp other than tp only where tp is 1 (an expt_tp exchange without tp's).
    if (kSanitized && (l.pp > 1 || l.cp > 1 || (l.etp != l.tp && l.tp > 1))) continue;
    SCOPED_TRACE("alltoall " + l.Name());
    if (WorldRank() == 0) fmt::print("  alltoall {}:", l.Name());
    const double loss = RunChecked(l.Document(AllToAll(Dropless()))).loss;
    const double allgather =
        first_loss
            .try_emplace(l.tp, Simulate(MoeDocument(Dropless(), l.tp, 1, 1, "float64"), false)
                                   .value()
                                   .loss)
            .first->second;
    EXPECT_NEAR(loss, allgather, 1e-12 * loss);
    if (l.pp > 1) continue;
    if (WorldRank() == 0) fmt::print("  alltoall capacity 1 {}:", l.Name());
    RunChecked(l.Document(AllToAll(Dropping())));
  }
}

// The two dispatchers route the same tokens: every expert receives the same tokens from the
// same ranks. The alltoall one also says what it sent each ep rank: per layer, the rows of
// all ranks add up to the routed tokens (2 s B), each (h + 1) float64 values.
TEST(GptMixtureOfExperts, AllToAllSendsWhatTheExpertsReceive) {
  const int64_t tp = WorldSize() >= 4 ? 2 : 1, ep = WorldSize() / tp;  // dp = ep
  const auto notes = [&](const json& model) {
    const StatusOr<run::SimulationResult> result =
        Simulate(MoeDocument(model, tp, 1, 1, "float64", ep), /*check=*/false);
    EXPECT_TRUE(result.ok()) << result.status().Message();
    std::vector<std::string> lines;  // every rank's note, one line per layer
    if (!result.ok()) return lines;
    for (const std::string& note : result->step_notes) {
      std::istringstream in(note);
      for (std::string line; std::getline(in, line);) lines.push_back(line);
    }
    return lines;
  };
  const std::vector<std::string> gathered = notes(Dropless());
  const std::vector<std::string> exchanged = notes(AllToAll(Dropless()));
  ASSERT_EQ(gathered.size(), exchanged.size());
  ASSERT_FALSE(gathered.empty());
  const std::regex sent(
      R"(layer (\d+): .*; all-to-all to ep ranks [\d ]+: ([\d ]+) rows, ([\d ]+) bytes)");
  std::map<int64_t, int64_t> rows_per_layer;
  for (size_t i = 0; i < gathered.size(); ++i) {
    EXPECT_EQ(exchanged[i].substr(0, exchanged[i].find("; all-to-all")), gathered[i]);
    if (ep == 1) continue;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(exchanged[i], m, sent)) << exchanged[i];
    std::istringstream rows(m[2].str()), bytes(m[3].str());
    int64_t n = 0, b = 0;
    while (rows >> n && bytes >> b) {
      rows_per_layer[std::stoll(m[1])] += n;
      EXPECT_EQ(b, n * (32 + 1) * 8) << exchanged[i];  // h = 32 and the probability
    }
  }
  if (ep == 1) return;
  // The notes come from tp rank 0 of each group, whose tokens are 1 / tp of them.
  ASSERT_EQ(rows_per_layer.size(), 2u);
  for (const auto& [layer, rows] : rows_per_layer) {
    EXPECT_EQ(rows * tp, 2 * 16 * Samples()) << layer;
  }
}

// Three Adam iterations with the distributed optimizer on a pipeline (with cp 2 where the
// world allows), and full recomputation, which reruns the router and the experts.
TEST(GptMixtureOfExperts, TrainsWithTheDistributedOptimizer) {
  if (WorldSize() < 2) GTEST_SKIP() << "needs pp 2";
  const int64_t cp = WorldSize() >= 4 ? 2 : 1;
  for (const json& model : {Dropless(), Dropping()}) {
    if (WorldRank() == 0) fmt::print("  pp 2 cp {}, distributed optimizer:", cp);
    json document = Training(MoeDocument(model, 1, cp, 2, "float64"), "adam");
    document["run"]["train_iters"] = 3;
    document["optimizer"]["use_distributed_optimizer"] = true;
    SetRecompute(document["run"], "full uniform 2");
    const run::SimulationResult result = RunChecked(document);
    EXPECT_EQ(result.iterations.size(), 3u);
    ExpectReferenceNorms(result);
  }
  // Expert parallelism with the plain optimizer: expert gradients reduce over expt_dp, and
  // the gradient norm sums the experts' squares over ep (each ep rank holds others).
  const int64_t ep = WorldSize() >= 4 ? 4 : 2;
  for (const json& model : {Dropless(), Dropping(), AllToAll(Dropless())}) {
    if (WorldRank() == 0) fmt::print("  ep {}, Adam:", ep);
    json document = Training(MoeDocument(model, 1, 1, 1, "float64", ep), "adam");
    document["run"]["train_iters"] = 3;
    const run::SimulationResult result = RunChecked(document);
    EXPECT_EQ(result.iterations.size(), 3u);
    ExpectReferenceNorms(result);
  }
  // The distributed optimizer with ep 2: the dense buffer shards over dp, the experts' over
  // expt_dp (dp / 2 ranks: 2 at world 4, with tp 2 at world 8), and the norm counts each
  // expert element once.
  const int64_t tp = WorldSize() >= 8 ? 2 : 1;
  for (const json& model : {Dropless(), Dropping(), AllToAll(Dropless())}) {
    if (WorldRank() == 0) fmt::print("  tp {} ep 2, distributed optimizer:", tp);
    json document = Training(MoeDocument(model, tp, 1, 1, "float64", 2), "adam");
    document["run"]["train_iters"] = 3;
    document["optimizer"]["use_distributed_optimizer"] = true;
    const run::SimulationResult result = RunChecked(document);
    EXPECT_EQ(result.iterations.size(), 3u);
    ExpectReferenceNorms(result);
    const int64_t edp = WorldSize() / tp / 2;
    EXPECT_EQ(result.optimizer.expert_end - result.optimizer.expert_begin,
              result.optimizer.expert_buffer / edp);
  }
  // expert_tensor_parallel_size other than tp: the experts' slices over etp ranks, their
  // gradients over expt_dp (world / (etp ep)), their squares over tp_ep in the plain
  // optimizer's norm. tp 2 with whole experts (etp 1) and tp 1 with experts split in 2.
  for (const auto& [tp_e, etp] : {std::pair<int64_t, int64_t>{2, 1}, {1, 2}}) {
    const int64_t ep_e = WorldSize() >= 4 ? 2 : 1;
    for (const bool distributed : {false, true}) {
      if (kSanitized && !distributed) continue;
      if (WorldRank() == 0) {
        fmt::print("  tp {} etp {} ep {}, {} optimizer:", tp_e, etp, ep_e,
                   distributed ? "distributed" : "plain");
      }
      json document = Training(MoeDocument(AllToAll(Dropless()), tp_e, 1, 1, "float64", ep_e, etp),
                               "adam");
      document["run"]["train_iters"] = 3;
      document["optimizer"]["use_distributed_optimizer"] = distributed;
      const run::SimulationResult result = RunChecked(document);
      ExpectReferenceNorms(result);
      if (distributed) {
        const int64_t edp = WorldSize() / (etp * ep_e);
        EXPECT_EQ(result.optimizer.expert_end - result.optimizer.expert_begin,
                  result.optimizer.expert_buffer / edp);
      }
    }
  }
  // Two distributed-optimizer instances with ep 2: each instance shards the experts over its
  // half of expt_dp (expt_dp_partial), and the owned shards are all-reduced over
  // inter_dist_opt with the other instance's, as the dense ones.
  if (WorldSize() < 4) return;  // 2 instances need an expert data-parallel size of 2
  for (const json& model : {Dropless(), AllToAll(Dropping())}) {
    if (kSanitized && model == Dropless()) continue;
    if (WorldRank() == 0) fmt::print("  ep 2, 2 distributed-optimizer instances:");
    json document = Training(MoeDocument(model, 1, 1, 1, "float64", 2), "adam");
    document["run"]["train_iters"] = 3;
    document["optimizer"]["use_distributed_optimizer"] = true;
    document["parallel"]["num_distributed_optimizer_instances"] = 2;
    const run::SimulationResult result = RunChecked(document);
    ExpectReferenceNorms(result);
    const int64_t intra_edp = WorldSize() / 2 / 2;
    EXPECT_EQ(result.optimizer.expert_end - result.optimizer.expert_begin,
              result.optimizer.expert_buffer / intra_edp);
  }
}

// float32: the router's softmax and top-k in the model's dtype. (A 16-bit router is not
// checked element by element: its rounding moves near-tied tokens to another expert than
// the float64 reference picks, which changes that expert's gradient by whole tokens.)
TEST(GptMixtureOfExperts, Float32) {
  const int64_t tp = WorldSize() >= 2 ? 2 : 1;
  for (const json& model : {Dropless(), Dropping()}) {
    if (WorldRank() == 0) fmt::print("  float32 tp {}:", tp);
    RunChecked(MoeDocument(model, tp, 1, 1, "float32"));
  }
}

// moe_router_dtype "fp64" on a float32 run: the router's GEMM, its probabilities and the
// experts' weighting in float64, the softmaxes in float32, cast between them
// (RouterDTypesOf): checked like float32, with both dispatchers and expert parallelism.
TEST(GptMixtureOfExperts, Float64RouterOnFloat32) {
  const int64_t tp = WorldSize() >= 2 ? 2 : 1;
  const int64_t ep = WorldSize() >= 4 ? 2 : 1;
  for (const char* dispatcher : {"allgather", "alltoall"}) {
    for (json model : {Dropless(), Dropping()}) {
      model["moe_router_dtype"] = "fp64";
      model["moe_token_dispatcher_type"] = dispatcher;
      if (WorldRank() == 0)
        fmt::print("  fp64 router, float32, {} tp {} ep {}:", dispatcher, tp, ep);
      RunChecked(MoeDocument(model, tp, 1, 1, "float32", ep));
    }
  }
}

// The run's notes say how many tokens each rank's experts received: a dropless top-2 router
// sends every token to two experts, so per layer the counts add up to 2 s B whatever the
// layout.
TEST(GptMixtureOfExperts, StepNotesCountEveryRoutedToken) {
  const int64_t ep = WorldSize() >= 4 ? 4 : WorldSize() >= 2 ? 2 : 1;
  const StatusOr<run::SimulationResult> result =
      Simulate(MoeDocument(Dropless(), 1, 1, 1, "float64", ep), /*check=*/false);
  ASSERT_TRUE(result.ok()) << result.status().Message();
  std::map<int64_t, int64_t> per_layer;
  const std::regex line(R"(layer (\d+): (.*))"), expert(R"(<- (\d+) tokens)");
  int64_t lines = 0;
  for (const std::string& text : result->step_notes) {
    for (auto it = std::sregex_iterator(text.begin(), text.end(), line);
         it != std::sregex_iterator(); ++it, ++lines) {
      const std::string rest = (*it)[2];
      for (auto e = std::sregex_iterator(rest.begin(), rest.end(), expert);
           e != std::sregex_iterator(); ++e) {
        per_layer[std::stoll((*it)[1])] += std::stoll((*e)[1]);
      }
    }
  }
  EXPECT_EQ(lines, 2 * WorldSize());  // one line per layer from every rank (tp 1)
  ASSERT_EQ(per_layer.size(), 2u);
  for (const auto& [layer, tokens] : per_layer) EXPECT_EQ(tokens, 2 * 16 * Samples()) << layer;
}

// DeepSeek-V3-style routing (WithDeepSeekRouting) on Dropless's model.
json DeepSeekRouting() { return WithDeepSeekRouting(Dropless()); }

// The softmax router with the same group limit and scaling, after the top-k (groups ranked
// by the logits) and before it (by the softmax), with a capacity.
json GroupLimitedSoftmax(bool pre_softmax) {
  json model = DeepSeekRouting();
  model["moe_router_score_function"] = "softmax";
  model["moe_router_pre_softmax"] = pre_softmax;
  if (pre_softmax) model["moe_expert_capacity_factor"] = 1.0;
  return model;
}

// Every layout of NewLayouts, both dispatchers: the sigmoid router dropless (whose losses agree
// across the layouts of a tp) and with a capacity; the group-limited softmax routers on the pp 1
// layouts.
TEST(GptMixtureOfExperts, DeepSeekRoutingMatchesTheReference) {
  std::map<int64_t, double> first_loss;
  for (const Layout& l : NewLayouts()) {
    if (kSanitized && (l.pp > 1 || l.cp > 1 || l.etp != l.tp)) continue;
    for (const char* dispatcher : {"allgather", "alltoall"}) {
      json model = DeepSeekRouting();
      model["moe_token_dispatcher_type"] = dispatcher;
      SCOPED_TRACE(fmt::format("sigmoid {} {}", dispatcher, l.Name()));
      if (WorldRank() == 0) fmt::print("  sigmoid {} {}:", dispatcher, l.Name());
      const double loss = RunChecked(l.Document(model)).loss;
      first_loss.try_emplace(l.tp, loss);
      EXPECT_NEAR(loss, first_loss.at(l.tp), 1e-12 * loss);
      if (l.pp > 1) continue;
      model["moe_expert_capacity_factor"] = 1.0;
      if (WorldRank() == 0) fmt::print("  sigmoid capacity 1 {} {}:", dispatcher, l.Name());
      RunChecked(l.Document(model));
    }
    if (l.pp > 1) continue;
    for (const bool pre : {false, true}) {
      SCOPED_TRACE(fmt::format("softmax groups pre {} {}", pre, l.Name()));
      if (WorldRank() == 0) fmt::print("  softmax groups{} {}:", pre ? " pre" : "", l.Name());
      RunChecked(l.Document(GroupLimitedSoftmax(pre)));
    }
  }
}

// Training: 3 Adam iterations with the distributed optimizer, seq_aux_loss, on pp 2 (cp 2
// where the world allows) with full recomputation, and with ep 2 and the alltoall dispatcher;
// float32 on tp 2.
TEST(GptMixtureOfExperts, DeepSeekRoutingTrainsAndRunsInFloat32) {
  json model = DeepSeekRouting();
  model["moe_router_load_balancing_type"] = "seq_aux_loss";
  if (WorldSize() >= 2) {
    const int64_t cp = WorldSize() >= 4 ? 2 : 1;
    if (WorldRank() == 0) fmt::print("  sigmoid pp 2 cp {}, distributed optimizer:", cp);
    json document = Training(MoeDocument(model, 1, cp, 2, "float64"), "adam");
    document["run"]["train_iters"] = 3;
    document["optimizer"]["use_distributed_optimizer"] = true;
    SetRecompute(document["run"], "full uniform 2");
    ExpectReferenceNorms(RunChecked(document));
    if (WorldRank() == 0) fmt::print("  sigmoid ep 2 alltoall, distributed optimizer:");
    document = Training(MoeDocument(AllToAll(model), 1, 1, 1, "float64", 2), "adam");
    document["run"]["train_iters"] = 3;
    document["optimizer"]["use_distributed_optimizer"] = true;
    ExpectReferenceNorms(RunChecked(document));
  }
  const int64_t tp = WorldSize() >= 2 ? 2 : 1;
  for (const json& m : {DeepSeekRouting(), GroupLimitedSoftmax(false), GroupLimitedSoftmax(true)}) {
    if (WorldRank() == 0) fmt::print("  float32 tp {}:", tp);
    RunChecked(MoeDocument(m, tp, 1, 1, "float32"));
  }
}

// What `mpusim run` reports per iteration of a run with the expert bias (SimulationResult's
// iterations' `experts`): per MoE layer the kept choices per expert, summed over the
// micro-batches and the world's ranks, and the bias after the update. Dropless, each layer's
// counts add up to the iteration's tokens times topk, and the first iteration's are the
// float64 reference's at the initial weights (its local_tokens_per_expert over the whole
// batch); with a capacity they add up to less. Each bias is the iteration before's moved by
// its counts as get_updated_expert_bias moves it (float32), from zeros, and the first update
// moved it.
void ExpectExpertLoadsMoveTheBias(const run::SimulationResult& result, const json& document,
                                  bool dropless) {
  const Config config = MakeConfig(document);
  const ParallelConfig& p = config.parallel;
  const int64_t dp = p.world_size / (p.tensor_model_parallel_size * p.context_parallel_size *
                                     p.pipeline_model_parallel_size);
  const int64_t E = config.gpt->moe.num_experts, K = config.gpt->moe.router_topk;
  const int64_t choices =
      config.run->seq_length * config.run->micro_batch_size * dp * config.run->num_microbatches * K;
  StatusOr<ReferenceResult> reference = RunGptReference(*config.gpt, p, *config.run);
  ASSERT_TRUE(reference.ok()) << reference.status().Message();
  const auto rate = static_cast<float>(config.gpt->moe.bias_update_rate);
  std::map<int64_t, std::vector<float>> bias;  // by layer: the last iteration's
  ASSERT_EQ(result.iterations.size(), static_cast<size_t>(config.run->train_iters));
  for (const run::SimulationResult::Iteration& it : result.iterations) {
    ASSERT_EQ(it.experts.size(), 2u) << "iteration " << it.iteration;
    for (const ExpertLoad& l : it.experts) {
      SCOPED_TRACE(fmt::format("iteration {} layer {}", it.iteration, l.layer));
      ASSERT_EQ(static_cast<int64_t>(l.tokens.size()), E);
      ASSERT_EQ(static_cast<int64_t>(l.bias.size()), E);
      int64_t total = 0;
      for (int64_t c : l.tokens) total += c;
      if (dropless) {
        EXPECT_EQ(total, choices);
      } else {
        EXPECT_LT(total, choices);
      }
      if (dropless && it.iteration == 1) {
        const ReferenceTensor* counts = reference->Find(
            fmt::format("decoder.layers.{}.mlp.router.local_tokens_per_expert", l.layer));
        ASSERT_NE(counts, nullptr);
        for (int64_t e = 0; e < E; ++e) {
          EXPECT_EQ(static_cast<double>(l.tokens[static_cast<size_t>(e)]),
                    counts->value.data_as<double>()[e])
              << "expert " << e;
        }
      }
      std::vector<float>& last =
          bias.try_emplace(l.layer, static_cast<size_t>(E), 0.0f).first->second;
      const float mean = static_cast<float>(total) / static_cast<float>(E);
      for (size_t e = 0; e < last.size(); ++e) {
        const float offset = mean - static_cast<float>(l.tokens[e]);
        last[e] += (offset > 0 ? 1.0f : offset < 0 ? -1.0f : 0.0f) * rate;
      }
      EXPECT_EQ(l.bias, last);
      if (it.iteration == 1) {  // the first update moves every expert off the mean
        EXPECT_TRUE(std::any_of(l.bias.begin(), l.bias.end(), [](float b) { return b != 0; }));
      }
    }
  }
}

// Aux-loss-free balancing: the sigmoid router with the expert bias (rate 0.01, larger than
// the small model's score differences, so that it moves the choices at once; an odd number
// of steps, as it swings back and forth), three Adam iterations: the dp layout with the
// plain and the distributed optimizer, tp 2 with ep 2 and the alltoall dispatcher, pp 2 with
// cp 2 and full recomputation, a capacity. Each layer's expert_bias is checked equal to the
// reference's after the last update (its counts summed over tp x dp x cp), and it moved.
TEST(GptMixtureOfExperts, ExpertBiasMatchesTheReferenceOverIterations) {
  json model = DeepSeekRouting();
  model["moe_router_enable_expert_bias"] = true;
  model["moe_router_bias_update_rate"] = 0.01;
  model["moe_aux_loss_coeff"] = 0.0;
  struct Case {
    const char* name;
    int64_t tp, cp, pp, ep;
    bool distributed, alltoall, capacity, recompute;
  };
  const int64_t w = WorldSize();
  for (const Case& c : {Case{"dp", 1, 1, 1, 1, false, false, false, false},
                        Case{"dp, distributed optimizer", 1, 1, 1, 1, true, false, false, false},
                        Case{"tp 2 ep 2 alltoall", 2, 1, 1, 2, true, true, false, false},
                        Case{"pp 2 cp 2 recompute", 1, 2, 2, 1, true, false, false, true},
                        Case{"capacity 1", 1, 1, 1, 1, false, false, true, false}}) {
    const int64_t mp = c.tp * c.cp * c.pp;
    if (mp > w || w % mp != 0 || (w / (c.tp * c.pp)) % c.ep != 0) continue;
    json m = c.alltoall ? AllToAll(model) : model;
    if (c.capacity) m["moe_expert_capacity_factor"] = 1.0;
    json document = Training(MoeDocument(m, c.tp, c.cp, c.pp, "float64", c.ep), "adam");
    document["run"]["train_iters"] = 3;
    document["optimizer"]["use_distributed_optimizer"] = c.distributed;
    if (c.recompute) SetRecompute(document["run"], "full uniform 2");
    if (WorldRank() == 0) fmt::print("  expert bias, {}:", c.name);
    const run::SimulationResult result = RunChecked(document);
    ExpectReferenceNorms(result);
    int biases = 0;
    for (const run::TensorCheck& t : result.check.tensors) {
      if (!t.name.ends_with(".mlp.router.expert_bias")) continue;
      ++biases;
      EXPECT_EQ(t.max_abs, 0.0) << t.name;  // float32 steps of the rate, exactly
      EXPECT_GT(t.scale, 0.0) << t.name;    // it moved
    }
    EXPECT_EQ(biases, 2) << c.name;
    ExpectExpertLoadsMoveTheBias(result, document, !c.capacity);
  }
}

// Qwen3's global-batch load-balancing loss ("global_aux_loss", coefficient 0.1 on Dropless's
// router): each micro-batch's top-k counts all-reduced over tp x dp x cp in the forward, their
// float32 mean over the step's micro-batches so far weighting each rank's softmax. The
// reference computes the whole batch on every rank, so the counts of every dp rank are its
// own; two micro-batches per step make the mean matter.
json GlobalAuxLoss(json model) {
  model["moe_router_load_balancing_type"] = "global_aux_loss";
  model["moe_aux_loss_coeff"] = 0.1;
  return model;
}

// The list form with sqrt(softplus) scores: DeepSeekRouting's group limit and scaling with
// moe_router_score_function "sqrtsoftplus", the micro-batch loss and the global one.
json SqrtSoftplusListed() {
  json model = DeepSeekRouting();
  model["moe_router_score_function"] = "sqrtsoftplus";
  model["moe_router_load_balancing_type"] = json::array({"aux_loss", "global_aux_loss"});
  model["moe_aux_loss_coeff"] = json::array({0.01, 0.1});
  return model;
}

// Every layout of NewLayouts (the alltoall dispatcher where ep > 1, else allgather), the
// sqrtsoftplus list on
// the pp 1 ones, float32 on tp 2; then 3 Adam iterations (the tracker restarts each step): ep 2
// with the alltoall dispatcher, and pp 2 (cp 2 where the world allows) with full recomputation
// and the distributed optimizer (a recomputed forward reuses its micro-batch's mean).
TEST(GptMixtureOfExperts, GlobalAuxLossMatchesTheReference) {
  for (const Layout& l : NewLayouts()) {
    if (kSanitized && (l.pp > 1 || l.cp > 1 || l.etp != l.tp || l.ep > 2)) continue;
    const bool alltoall = l.ep > 1;
    SCOPED_TRACE(fmt::format("global_aux_loss {}{}", alltoall ? "alltoall " : "", l.Name()));
    if (WorldRank() == 0) {
      fmt::print("  global_aux_loss {}{}:", alltoall ? "alltoall " : "", l.Name());
    }
    const json model = GlobalAuxLoss(Dropless());
    RunChecked(l.Document(alltoall ? AllToAll(model) : model));
    if (l.pp > 1 || (kSanitized && l.tp > 1)) continue;
    if (WorldRank() == 0) fmt::print("  sqrtsoftplus, aux_loss + global_aux_loss {}:", l.Name());
    RunChecked(l.Document(alltoall ? AllToAll(SqrtSoftplusListed()) : SqrtSoftplusListed()));
  }
  const int64_t tp = WorldSize() >= 2 ? 2 : 1;
  for (const json& model : {GlobalAuxLoss(Dropless()), SqrtSoftplusListed()}) {
    if (WorldRank() == 0) fmt::print("  global_aux_loss float32 tp {}:", tp);
    RunChecked(MoeDocument(model, tp, 1, 1, "float32"));
  }
  if (WorldSize() < 2) return;
  if (WorldRank() == 0) fmt::print("  global_aux_loss ep 2 alltoall, Adam:");
  json document =
      Training(MoeDocument(AllToAll(GlobalAuxLoss(Dropless())), 1, 1, 1, "float64", 2), "adam");
  document["run"]["train_iters"] = 3;
  ExpectReferenceNorms(RunChecked(document));
  const int64_t cp = WorldSize() >= 4 ? 2 : 1;
  if (WorldRank() == 0) fmt::print("  sqrtsoftplus global_aux_loss pp 2 cp {} recompute:", cp);
  document = Training(MoeDocument(SqrtSoftplusListed(), 1, cp, 2, "float64"), "adam");
  document["run"]["train_iters"] = 3;
  document["optimizer"]["use_distributed_optimizer"] = true;
  SetRecompute(document["run"], "full uniform 2");
  ExpectReferenceNorms(RunChecked(document));
}

// A document the run refuses with exactly `message` (one line naming the field).
void ExpectRefusal(const json& document, const std::string& message) {
  const StatusOr<run::SimulationResult> result = Simulate(document);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().Message(), message);
}

TEST(GptMixtureOfExperts, RefusalsNameTheField) {
  if (WorldSize() < 2) GTEST_SKIP() << "needs tp 2";
  json document = MoeDocument(Dropless(), 2, 1, 1, "float64");
  document["parallel"]["sequence_parallel"] = false;
  ExpectRefusal(document,
                "parallel.sequence_parallel: must be true for a mixture-of-experts model with "
                "tensor_model_parallel_size 2 (Megatron's rule: each tp rank's router sees its "
                "own sequence shard)");
  document = MoeDocument(Dropless(), 1, 1, 1, "float64", 2);
  document["model"]["num_moe_experts"] = 3;
  ExpectRefusal(document,
                "parallel.expert_model_parallel_size: num_moe_experts 3 is not divisible by "
                "expert_model_parallel_size 2 (each ep rank holds num_moe_experts / ep experts)");
  document = MoeDocument(Llama(8, 4), 1, 1, 1, "float64", 2);
  ExpectRefusal(document,
                "parallel.expert_model_parallel_size: 2 splits experts, but the model has none; "
                "set num_moe_experts or expert_model_parallel_size 1");
}

}  // namespace
}  // namespace mpusim
