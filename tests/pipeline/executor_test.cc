// The executor (core/pipeline/executor.h) on one pipeline rank: the order of a step's
// forward and backward steps over the rank's chunks, what it hands between them, the stashes
// it owns, the record flag and the timeline, with a model that only writes down its calls.
#include "core/pipeline/executor.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace mpusim {
namespace {

// A model of `chunks` chunks whose tensors are one number: a forward adds 1 to its input (0
// for the first chunk), a backward returns what its forward saw plus 100.
class CallLog final : public StagedModel {
 public:
  explicit CallLog(int64_t chunks) : chunks_(chunks) {}
  struct Saved final : StepStash {
    int64_t chunk = -1, microbatch = -1;
    double input = 0;
  };

  int64_t num_model_chunks() const override { return chunks_; }
  std::pair<Shape, DType> TransferShape(const RankContext&, const Transfer&) const override {
    return {{1}, DType::kFloat64};
  }
  std::unique_ptr<StepStash> NewStash(int64_t) const override {
    return std::make_unique<Saved>();
  }
  Tensor ForwardStep(const StepCall& call, const Tensor& input, StepStash& stash) override {
    auto& saved = static_cast<Saved&>(stash);
    saved = Saved();
    saved.chunk = call.chunk;
    saved.microbatch = call.microbatch;
    saved.input = input.defined() ? input.data_as<double>()[0] : 0.0;
    calls.push_back(fmt::format("F{}.{}{}", call.chunk, call.microbatch, call.record ? "r" : ""));
    return Number(saved.input + 1);
  }
  Tensor BackwardStep(const StepCall& call, const Tensor&, StepStash& stash) override {
    const auto& saved = static_cast<const Saved&>(stash);
    if (saved.chunk != call.chunk || saved.microbatch != call.microbatch) {
      throw std::logic_error("a backward step got another step's stash");
    }
    calls.push_back(fmt::format("B{}.{}{}", call.chunk, call.microbatch, call.record ? "r" : ""));
    backward_inputs.push_back(saved.input);
    return Number(saved.input + 100);
  }

  std::vector<std::string> calls;
  std::vector<double> backward_inputs;  // what each backward's forward received

 private:
  static Tensor Number(double value) {
    Tensor t = Tensor::HostZeros({1}, DType::kFloat64);
    t.data_as<double>()[0] = value;
    return t;
  }
  int64_t chunks_;
};

// Without a pipeline: each micro-batch forward through the chunks in order, the output handed
// on, then backward through them in reverse; the last micro-batch records; every stash is
// the one its forward filled, and every one is freed.
TEST(PipelineExecutor, WithoutAPipelineEachMicroBatchRunsThroughTheChunks) {
  CallLog model(2);
  PipelineExecutor executor(/*num_microbatches=*/3);
  RankContext ctx;
  executor.Run(ctx, model, /*record=*/true);
  const std::vector<std::string> expected = {"F0.0",  "F1.0",  "B1.0",  "B0.0",
                                             "F0.1",  "F1.1",  "B1.1",  "B0.1",
                                             "F0.2r", "F1.2r", "B1.2r", "B0.2r"};
  EXPECT_EQ(model.calls, expected);
  // Chunk 1's forward saw chunk 0's output (0 + 1).
  EXPECT_EQ(model.backward_inputs, (std::vector<double>{1, 0, 1, 0, 1, 0}));
  EXPECT_EQ(executor.live_stashes(), 0);
  EXPECT_EQ(executor.peak_live_stashes(), 2);
  ASSERT_EQ(executor.step_spans().size(), 12u);
  for (size_t i = 0; i < 12; ++i) {
    const StepSpan& span = executor.step_spans()[i];
    EXPECT_EQ(span.forward, model.calls[i][0] == 'F') << i;
    EXPECT_LE(span.begin, span.end) << i;
  }
  EXPECT_LE(executor.schedule_begin(), executor.schedule_end());

  // A step without records, and a second step that starts clean.
  model.calls.clear();
  executor.Run(ctx, model, /*record=*/false);
  EXPECT_EQ(model.calls.back(), "B0.2");
  EXPECT_EQ(executor.step_spans().size(), 12u);
}

// Steps out of order are executor bugs, stopped before they corrupt a stash.
TEST(PipelineExecutor, StepsOutOfOrderAreRefused) {
  CallLog model(1);
  PipelineExecutor executor(1);
  RankContext ctx;
  executor.Begin();
  EXPECT_THROW(executor.Backward(ctx, model, 0, 0, Tensor(), false), std::logic_error);
  executor.Forward(ctx, model, 0, 0, Tensor(), false);
  EXPECT_THROW(executor.Forward(ctx, model, 0, 0, Tensor(), false), std::logic_error);
  EXPECT_THROW(executor.Begin(), std::logic_error);  // micro-batch 0 still live
  executor.Backward(ctx, model, 0, 0, Tensor(), false);
  EXPECT_THROW(executor.Backward(ctx, model, 0, 0, Tensor(), false), std::logic_error);
  EXPECT_EQ(executor.live_stashes(), 0);
}

}  // namespace
}  // namespace mpusim
