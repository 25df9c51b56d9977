// Pipeline splits (core/pipeline_split.h) against Megatron-Core's own examples: the layout
// grammar of PipelineParallelLayerLayout (its docstrings), the parametrised cases of
// tests/unit_tests/transformer/test_transformer_block.py (TestPipelineParallelTransformerBlock
// and TestPipelineParallelLayoutTransformerBlock, layer counts and layer numbers), and every
// refusal of TransformerConfig.__post_init__ for these keys.
#include "core/pipeline_split.h"

#include <gtest/gtest.h>

#include <numeric>

#include "core/config/config.h"

namespace mpusim {
namespace {

using Stages = std::vector<std::string>;

Stages Parsed(std::string_view layout) {
  StatusOr<Stages> stages = ParsePipelineLayout(layout);
  EXPECT_TRUE(stages.ok()) << stages.status().Message();
  return stages.ok() ? *stages : Stages{};
}

TEST(PipelineLayoutParse, MegatronsDocstringExamples) {
  // parse_str_to_list: "Ettt|(tt|)*29,m|L" is [E t t t] + [t t] * 29 + [m] + [L].
  Stages expected = {"Ettt"};
  for (int i = 0; i < 29; ++i) expected.push_back("tt");
  expected.push_back("m");
  expected.push_back("L");
  EXPECT_EQ(Parsed("Ettt|(tt|)*29,m|L"), expected);
  // TransformerConfig's docstring: 'E|(tt|)*2,(t|)*4,mL' is 8 stages.
  EXPECT_EQ(Parsed("E|(tt|)*2,(t|)*4,mL"), Stages({"E", "tt", "tt", "t", "t", "t", "t", "mL"}));
}

// The comments of parse_str_to_list's patterns, with its letters mapped onto layer letters:
// xy(ab|cd|ef)*2,pq -> xyab|cd|efab|cd|efpq;  (ab)*3 -> ababab;  ab,(cd|)*2 -> abcd|cd|;
// (|ab)*2,cd -> |ab|abcd.
TEST(PipelineLayoutParse, RepetitionAsPythonsReSubUnrollsIt) {
  EXPECT_EQ(Parsed("Et(tt|Lt|tE)*2,tL"), Stages({"Ettt", "Lt", "tEtt", "Lt", "tEtL"}));
  EXPECT_EQ(Parsed("(tL)*3"), Stages({"tLtLtL"}));
  EXPECT_EQ(Parsed("tL,(Et|)*2"), Stages({"tLEt", "Et", ""}));
  EXPECT_EQ(Parsed("(|tL)*2,Et"), Stages({"", "tL", "tLEt"}));
  EXPECT_EQ(Parsed("Et*3|t*2L"), Stages({"Ettt", "ttL"}));
  EXPECT_EQ(Parsed("E|t*10|L"), Stages({"E", "tttttttttt", "L"}));  // two-digit count
  EXPECT_EQ(Parsed("E|t*0|L"), Stages({"E", "", "L"}));
  EXPECT_EQ(Parsed("E||L"), Stages({"E", "", "L"}));
  EXPECT_EQ(Parsed("E,t,|,t,L"), Stages({"Et", "tL"}));  // commas are cosmetic anywhere
  // The group pass leaves "t|t|*2"; the character pass then repeats the '|'.
  EXPECT_EQ(Parsed("(t|)*2*2"), Stages({"t", "t", "", ""}));
}

TEST(PipelineLayoutParse, RefusesWhatMegatronRefuses) {
  for (const char* bad : {"E|x|L", "E|(tt)|L", "E|((tt|)*2)|L", "E| t|L", "E|T|L", "E|t*|L"}) {
    StatusOr<Stages> stages = ParsePipelineLayout(bad);
    ASSERT_FALSE(stages.ok()) << bad;
    EXPECT_EQ(stages.status().where(), "parallel.pipeline_model_parallel_layout");
    EXPECT_NE(stages.status().what().find("invalid layer character"), std::string::npos)
        << stages.status().Message();
  }
  StatusOr<Stages> huge = ParsePipelineLayout("E|t*99999999999999999999|L");
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().what().find("unrolls to more than"), std::string::npos);
  StatusOr<Stages> nested = ParsePipelineLayout("E|((t*4096|)*4096|)*4096L");
  ASSERT_FALSE(nested.ok());
}

PipelineSplit Split(int64_t p, std::optional<int64_t> v) {
  PipelineSplit split;
  split.pipeline_model_parallel_size = p;
  split.virtual_pipeline_model_parallel_size = v;
  return split;
}

PipelineSplit WithLayout(int64_t p, std::string layout) {
  PipelineSplit split = Split(p, std::nullopt);
  split.pipeline_model_parallel_layout = std::move(layout);
  return split;
}

// Resolves the keys, then assigns: the whole path a config takes.
StatusOr<LayerAssignment> Assign(PipelineSplit split, int64_t num_layers) {
  MPUSIM_RETURN_IF_ERROR(ResolvePipelineSplitKeys(&split));
  return AssignLayers(split, num_layers);
}

int64_t Total(const LayerAssignment& layers) {
  int64_t n = 0;
  for (const auto& rank : layers) {
    for (const auto& chunk : rank) n += static_cast<int64_t>(chunk.size());
  }
  return n;
}

// test_layout_layer_number: layout [E], [t], [tt], [t], [], [t], [t], [ttL] on pp 4, vpp 2
// gives these layer numbers per (pp rank, vpp rank).
TEST(PipelineSplitLayout, MegatronsLayerNumberGolden) {
  StatusOr<LayerAssignment> layers = Assign(WithLayout(4, "E|t|tt|t||t|t|ttL"), 8);
  ASSERT_TRUE(layers.ok()) << layers.status().Message();
  const LayerAssignment expected = {{{}, {}}, {{1}, {5}}, {{2, 3}, {6}}, {{4}, {7, 8}}};
  EXPECT_EQ(*layers, expected);
  // The virtual pipeline size comes from the layout.
  PipelineSplit split = WithLayout(4, "E|t|tt|t||t|t|ttL");
  ASSERT_TRUE(ResolvePipelineSplitKeys(&split).ok());
  EXPECT_EQ(split.virtual_pipeline_model_parallel_size, 2);
  const std::vector<StageLayers> stages = StagesOf(*layers);
  ASSERT_EQ(stages.size(), 8u);
  EXPECT_EQ(stages[2].first, 1);
  EXPECT_EQ(stages[2].count, 2);
  EXPECT_EQ(stages[4].count, 0);
}

// TestPipelineParallelLayoutTransformerBlock.test_layer_builder's cases, as strings (7
// layers, pp 2).
TEST(PipelineSplitLayout, MegatronsLayerBuilderCases) {
  struct Case {
    const char* layout;
    bool refused;
  };
  for (const Case& c : {Case{"tttttt|tL", true},         // no embedding
                        Case{"Etttttt|t", true},         // no loss
                        Case{"E|ttttttt|L", true},       // 3 stages on pp 2
                        Case{"Et|tttt|t|tL", false},     // usual vpp case
                        Case{"E|ttttttt||L", false},     // an empty stage
                        Case{"E|tttttt|t|L", false}}) {  // standalone embedding and loss
    StatusOr<LayerAssignment> layers = Assign(WithLayout(2, c.layout), 7);
    EXPECT_EQ(layers.ok(), !c.refused) << c.layout << ": " << layers.status().Message();
    if (layers.ok()) {
      EXPECT_EQ(Total(*layers), 7) << c.layout;
    }
  }
}

void ExpectRefused(const Status& got, std::string_view where, std::string_view what) {
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.where(), where);
  EXPECT_NE(got.what().find(what), std::string::npos) << got.Message();
}

void ExpectRefused(const StatusOr<LayerAssignment>& got, std::string_view where,
                   std::string_view what) {
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().where(), where);
  EXPECT_NE(got.status().what().find(what), std::string::npos) << got.status().Message();
}

// Megatron's validate_layer_layout for the MTP layers: as many m's as mtp_num_layers, no t
// after them, one stage, the last chunk of a pipeline rank; mpusim builds them with the loss
// and refuses a standalone m stage.
TEST(PipelineSplitLayout, MtpLayers) {
  constexpr std::string_view kKey = "parallel.pipeline_model_parallel_layout";
  EXPECT_TRUE(CheckMtpInLayout(WithLayout(2, "Et|tmL"), 1).ok());
  EXPECT_TRUE(CheckMtpInLayout(WithLayout(2, "Et|tmmL"), 2).ok());
  EXPECT_TRUE(CheckMtpInLayout(WithLayout(2, "Et|tL"), 0).ok());
  EXPECT_TRUE(CheckMtpInLayout(Split(2, std::nullopt), 1).ok());  // no layout: nothing to check
  ExpectRefused(CheckMtpInLayout(WithLayout(2, "Et|tL"), 1), kKey,
                "has 0 m (multi-token prediction layers), but mtp_num_layers is 1");
  ExpectRefused(CheckMtpInLayout(WithLayout(2, "Et|tmL"), 0), kKey, "mtp_num_layers is 0");
  ExpectRefused(CheckMtpInLayout(WithLayout(2, "Etm|mtL"), 2), kKey,
                "all of the MTP layers must be in the same one virtual pipeline stage");
  ExpectRefused(CheckMtpInLayout(WithLayout(2, "Et|mtL"), 1), kKey,
                "decoder layers must be placed before MTP layers");
  ExpectRefused(CheckMtpInLayout(WithLayout(2, "Et|tm||L"), 1), kKey,
                "has the MTP layers on stage 1 (pipeline rank 1, model chunk 0): Megatron keeps "
                "them in the last model chunk of a pipeline rank");
  // DeepSeek-V3's documented layout: the m stage before the loss's.
  ExpectRefused(CheckMtpInLayout(WithLayout(2, "Et|tt|m|L"), 1), kKey,
                "has the MTP layers on stage 2 and the loss on stage 3: a standalone MTP stage");
}

TEST(PipelineSplitLayout, Refusals) {
  constexpr std::string_view kKey = "parallel.pipeline_model_parallel_layout";
  ExpectRefused(Assign(WithLayout(2, "Et|tL|t"), 3), kKey, "not a multiple of");
  PipelineSplit vp_disagrees = WithLayout(2, "Et|t|t|tL");
  vp_disagrees.virtual_pipeline_model_parallel_size = 3;
  ExpectRefused(Assign(vp_disagrees, 4), kKey, "but virtual_pipeline_model_parallel_size is 3");
  ExpectRefused(Assign(WithLayout(2, "|EttL"), 2), kKey, "the first stage must start with E");
  ExpectRefused(Assign(WithLayout(2, "tE|tL"), 2), kKey, "the first stage must start with E");
  ExpectRefused(Assign(WithLayout(2, "Et|Lt"), 2), kKey, "the last stage must end with L");
  ExpectRefused(Assign(WithLayout(2, "EEt|tL"), 2), kKey,
                "E (the embedding) must appear exactly once");
  ExpectRefused(Assign(WithLayout(2, "EtL|tL"), 2), kKey, "L (the loss) must appear exactly once");
  ExpectRefused(Assign(WithLayout(2, "Ett|tL"), 4), kKey,
                "has 3 decoder layers (t), but num_layers is 4");
  PipelineSplit with_first = WithLayout(2, "Et|tL");
  with_first.decoder_first_pipeline_num_layers = 1;
  ExpectRefused(Assign(with_first, 2), kKey, "cannot be set with");
  PipelineSplit with_loss = WithLayout(2, "Et|tL");
  with_loss.account_for_loss_in_pipeline_split = true;
  ExpectRefused(Assign(with_loss, 2), kKey, "cannot be set with");
}

std::vector<int64_t> Counts(PipelineSplit split, int64_t num_layers) {
  EXPECT_TRUE(ResolvePipelineSplitKeys(&split).ok());
  StatusOr<std::vector<int64_t>> counts = LayersPerStage(split, num_layers);
  EXPECT_TRUE(counts.ok()) << counts.status().Message();
  return counts.ok() ? *counts : std::vector<int64_t>{};
}

// TestPipelineParallelTransformerBlock.test_layer_builder's cases: (num_layers, pp, vpp,
// embedding, loss, first, last, refused); every accepted one builds num_layers layers.
TEST(PipelineSplitKeys, MegatronsLayerBuilderCases) {
  struct Case {
    int64_t L, p;
    std::optional<int64_t> v;
    bool e, l;
    std::optional<int64_t> first, last;
    bool refused;
  };
  const std::optional<int64_t> none;
  const Case cases[] = {
      {60, 5, none, false, false, none, 4, false},    {60, 8, none, false, false, 6, 6, false},
      {64, 4, none, false, false, none, none, false}, {64, 4, 8, false, false, none, none, false},
      {60, 6, none, false, false, 5, none, false},    {101, 8, none, false, false, 13, 13, true},
      {63, 4, none, true, false, none, none, false},  {63, 4, none, false, true, none, none, false},
      {62, 4, none, true, true, none, none, false},   {62, 4, 2, true, true, none, none, false},
      {65, 4, none, false, false, none, none, true},  {65, 4, none, true, true, none, none, true},
      {61, 4, none, false, false, 12, none, true},    {2, 4, none, false, false, none, none, true},
      {60, 6, none, true, false, 5, 5, true},         {50, 2, 7, false, false, none, none, true},
      {4, 4, 4, false, false, none, none, true},
  };
  for (const Case& c : cases) {
    PipelineSplit split = Split(c.p, c.v);
    split.account_for_embedding_in_pipeline_split = c.e;
    split.account_for_loss_in_pipeline_split = c.l;
    split.decoder_first_pipeline_num_layers = c.first;
    split.decoder_last_pipeline_num_layers = c.last;
    StatusOr<LayerAssignment> layers = Assign(split, c.L);
    EXPECT_EQ(layers.ok(), !c.refused)
        << "L " << c.L << " p " << c.p << ": " << layers.status().Message();
    if (layers.ok()) {
      EXPECT_EQ(Total(*layers), c.L);
    }
  }
}

TEST(PipelineSplitKeys, FirstAndLastStages) {
  PipelineSplit split = Split(4, std::nullopt);
  split.decoder_first_pipeline_num_layers = 2;
  split.decoder_last_pipeline_num_layers = 6;
  EXPECT_EQ(Counts(split, 14), std::vector<int64_t>({2, 3, 3, 6}));  // the header's example
  // Megatron's (60, 5, last 4): 14 on each of the four others.
  PipelineSplit last = Split(5, std::nullopt);
  last.decoder_last_pipeline_num_layers = 4;
  EXPECT_EQ(Counts(last, 60), std::vector<int64_t>({14, 14, 14, 14, 4}));
  // With virtual stages each rank's layers split evenly over its chunks, in dataflow order
  // (stage u = chunk * p + rank): p 2, v 2, first 2, last 4.
  PipelineSplit interleaved = Split(2, 2);
  interleaved.decoder_first_pipeline_num_layers = 2;
  interleaved.decoder_last_pipeline_num_layers = 4;
  EXPECT_EQ(Counts(interleaved, 6), std::vector<int64_t>({1, 2, 1, 2}));
  StatusOr<LayerAssignment> layers = Assign(interleaved, 6);
  ASSERT_TRUE(layers.ok());
  EXPECT_EQ(*layers, LayerAssignment({{{1}, {4}}, {{2, 3}, {5, 6}}}));
  // Megatron's offset formula for p 4, v 2, first 2, last 2, L 10: middle ranks 3 each is
  // not divisible by v 2 -> refused; with L 12, middle 4 each, 2 per chunk: rank 1's chunk 1
  // starts at 1 * (1 + 2 + 2 + 1) + 1 + 0 * 2 = 7 (0-based), layer 8.
  PipelineSplit offset = Split(4, 2);
  offset.decoder_first_pipeline_num_layers = 2;
  offset.decoder_last_pipeline_num_layers = 2;
  EXPECT_FALSE(Assign(offset, 10).ok());
  StatusOr<LayerAssignment> twelve = Assign(offset, 12);
  ASSERT_TRUE(twelve.ok());
  EXPECT_EQ((*twelve)[1][1], std::vector<int64_t>({8, 9}));
}

TEST(PipelineSplitKeys, EmbeddingAndLossCounted) {
  PipelineSplit both = Split(4, std::nullopt);
  both.account_for_embedding_in_pipeline_split = true;
  both.account_for_loss_in_pipeline_split = true;
  EXPECT_EQ(Counts(both, 6), std::vector<int64_t>({1, 2, 2, 1}));  // the header's example
  // With v 2 and one layer per stage counted, the first chunk holds only the embedding and
  // the last only the loss.
  PipelineSplit interleaved = Split(2, 2);
  interleaved.account_for_embedding_in_pipeline_split = true;
  interleaved.account_for_loss_in_pipeline_split = true;
  EXPECT_EQ(Counts(interleaved, 2), std::vector<int64_t>({0, 1, 1, 0}));
  PipelineSplit embedding = Split(4, std::nullopt);
  embedding.account_for_embedding_in_pipeline_split = true;
  EXPECT_EQ(Counts(embedding, 63), std::vector<int64_t>({15, 16, 16, 16}));
}

TEST(PipelineSplitKeys, Refusals) {
  constexpr std::string_view kFirst = "parallel.decoder_first_pipeline_num_layers";
  constexpr std::string_view kLast = "parallel.decoder_last_pipeline_num_layers";
  constexpr std::string_view kEmbedding = "parallel.account_for_embedding_in_pipeline_split";
  constexpr std::string_view kLoss = "parallel.account_for_loss_in_pipeline_split";
  PipelineSplit mixed = Split(4, std::nullopt);
  mixed.decoder_first_pipeline_num_layers = 2;
  mixed.account_for_embedding_in_pipeline_split = true;
  ExpectRefused(Assign(mixed, 8), kFirst, "cannot be set together with");
  PipelineSplit zero = Split(4, std::nullopt);
  zero.decoder_last_pipeline_num_layers = 0;
  ExpectRefused(Assign(zero, 8), kLast, "must be between 1 and");
  PipelineSplit first_v = Split(4, 2);
  first_v.decoder_first_pipeline_num_layers = 3;
  ExpectRefused(Assign(first_v, 11), kFirst,
                "3 is not divisible by "
                "virtual_pipeline_model_parallel_size 2");
  PipelineSplit too_many = Split(4, std::nullopt);
  too_many.decoder_first_pipeline_num_layers = 6;
  too_many.decoder_last_pipeline_num_layers = 6;
  ExpectRefused(Assign(too_many, 10), kFirst, "more than num_layers 10");
  ExpectRefused(Assign(too_many, 12), kFirst, "leaves 0 layers for the 2 middle");
  PipelineSplit no_middle = Split(2, std::nullopt);
  no_middle.decoder_first_pipeline_num_layers = 2;
  no_middle.decoder_last_pipeline_num_layers = 2;
  ExpectRefused(Assign(no_middle, 5), kFirst, "leaves 1 layers for the 0 middle");
  PipelineSplit uneven_middle = Split(4, std::nullopt);
  uneven_middle.decoder_first_pipeline_num_layers = 12;
  ExpectRefused(Assign(uneven_middle, 61), kFirst, "leaves 49 layers, not divisible by the 3");
  PipelineSplit middle_v = Split(4, 2);
  middle_v.decoder_last_pipeline_num_layers = 2;
  ExpectRefused(Assign(middle_v, 11), kLast, "leaves 3 layers on each middle pipeline rank");
  PipelineSplit one_stage = Split(1, std::nullopt);
  one_stage.decoder_first_pipeline_num_layers = 2;
  one_stage.decoder_last_pipeline_num_layers = 2;
  ExpectRefused(Assign(one_stage, 4), kLast, "at pipeline_model_parallel_size 1");
  PipelineSplit embedding = Split(4, std::nullopt);
  embedding.account_for_embedding_in_pipeline_split = true;
  ExpectRefused(Assign(embedding, 8), kEmbedding,
                "9 is not divisible by "
                "pipeline_model_parallel_size 4");
  PipelineSplit loss_v = Split(2, 3);
  loss_v.account_for_loss_in_pipeline_split = true;
  ExpectRefused(Assign(loss_v, 3), kLoss,
                "2 per pipeline rank is not divisible by "
                "virtual_pipeline_model_parallel_size 3");
}

// The even split through the new entry point is the old one.
TEST(PipelineSplitKeys, EvenSplitUnchanged) {
  StatusOr<LayerAssignment> layers = Assign(Split(4, 2), 16);
  ASSERT_TRUE(layers.ok());
  EXPECT_EQ(*layers,
            LayerAssignment(
                {{{1, 2}, {9, 10}}, {{3, 4}, {11, 12}}, {{5, 6}, {13, 14}}, {{7, 8}, {15, 16}}}));
  ExpectRefused(Assign(Split(4, std::nullopt), 6), "num_layers",
                "must be divisible by pipeline_model_parallel_size = 4, got 6");
}

// A config file: the keys parse, refusals name the key, and a layout sets vp.
TEST(PipelineSplitConfig, ParsedFromTheParallelSection) {
  Config config;
  const Status ok = ParseConfig(nlohmann::json::parse(R"({"parallel": {
      "world_size": 4, "pipeline_model_parallel_size": 2,
      "pipeline_model_parallel_layout": "Et|t|t|tL", "num_layers": 4}})"),
                                &config);
  ASSERT_TRUE(ok.ok()) << ok.Message();
  EXPECT_EQ(config.parallel.virtual_pipeline_model_parallel_size, 2);
  const Status bad = ParseConfig(nlohmann::json::parse(R"({"parallel": {
      "world_size": 4, "pipeline_model_parallel_size": 2,
      "pipeline_model_parallel_layout": 3}})"),
                                 &config);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.where(), "parallel.pipeline_model_parallel_layout");
  const Status mixed = ParseConfig(nlohmann::json::parse(R"({"parallel": {
      "world_size": 4, "pipeline_model_parallel_size": 2,
      "decoder_last_pipeline_num_layers": 2, "account_for_loss_in_pipeline_split": true}})"),
                                   &config);
  ASSERT_FALSE(mixed.ok());
  EXPECT_EQ(mixed.where(), "parallel.decoder_last_pipeline_num_layers");
}

}  // namespace
}  // namespace mpusim
