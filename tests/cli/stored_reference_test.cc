// The stored reference (run/stored_reference.h): `mpusim reference CONFIG --out DIR` then
// `mpusim run CONFIG --reference DIR` gives the verdict and every number of the inline check,
// on the GPT, the layer chain, an MoE model and training runs; a reference of another run, or a
// damaged one, is refused in one line.
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <gtest/gtest.h>

#include "tests/cli/cli_test_util.h"

namespace mpusim::cli {
namespace {

using test_util::Mpiexec;
using test_util::Sample;
using test_util::Shell;
namespace fs = std::filesystem;

// A fresh folder for one test's references.
std::string ScratchDir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("mpusim_sref.{}.{}", ::getpid(), name);
  fs::remove_all(dir);
  return dir.string();
}

// What the check printed: the reference loss, the per-iteration rows (iteration, then a loss
// with a decimal point) without their time column, and the table of tensors with its verdicts (not the header, which says where the
// reference came from, nor the memory line).
std::string CheckLines(const std::string& output) {
  std::istringstream in(output);
  std::string line, kept;
  bool table = false;
  static const std::regex seconds(R"( [0-9.]+ (s|ms) )");
  while (std::getline(in, line)) {
    if (line.rfind("  tensor ", 0) == 0) table = true;
    const bool iteration = std::regex_search(line, std::regex(R"(^ +[0-9]+ +[0-9]+\.[0-9]+ )"));
    if (table || iteration || line.rfind("reference loss", 0) == 0) {
      kept += std::regex_replace(line, seconds, " T ") + "\n";
    }
    if (table && line.find(" passed, ") != std::string::npos) table = false;
  }
  return kept;
}

void ExpectSameCheck(const std::string& sample, int ranks, const std::string& flags = "") {
  const std::string dir = ScratchDir(sample);
  const std::string config = Sample(sample) + flags;
  std::string stored, inline_run, from_store;
  ASSERT_EQ(Shell(Mpiexec(ranks) + MPUSIM_BINARY + " reference " + config + " --out " + dir,
                  &stored),
            0)
      << stored;
  EXPECT_NE(stored.find("stored in " + dir), std::string::npos) << stored;
  const int inline_code = Shell(Mpiexec(ranks) + MPUSIM_BINARY + " run " + config, &inline_run);
  const int stored_code =
      Shell(Mpiexec(ranks) + MPUSIM_BINARY + " run " + config + " --reference " + dir, &from_store);
  EXPECT_EQ(inline_code, 0) << inline_run;
  EXPECT_EQ(stored_code, inline_code) << from_store;
  EXPECT_NE(from_store.find("read from the stored reference " + dir), std::string::npos)
      << from_store;
  const std::string expected = CheckLines(inline_run);
  EXPECT_GT(expected.size(), 200u) << inline_run;
  EXPECT_EQ(CheckLines(from_store), expected);
  fs::remove_all(dir);
}

TEST(StoredReference, GptCheckIsTheInlineCheck) { ExpectSameCheck("gpt_tiny_t2_sp_dp2_n4.json", 4); }

TEST(StoredReference, ChainTrainingCheckIsTheInlineCheck) {
  ExpectSameCheck("lab_train_mlp_lm_t2_dp2_n4.json", 4);
}

TEST(StoredReference, MoeCheckIsTheInlineCheck) {
  ExpectSameCheck("gpt_moe_ep2_t2_sp_dp2_n4.json", 4);
}

// The expert bias: state that moves with training, its token counts a helper the stored
// reference leaves out (as the step does) and the run's listing too.
TEST(StoredReference, ExpertBiasCheckIsTheInlineCheck) {
  ExpectSameCheck("gpt_deepseek_routing_t2_sp_dp2_n4.json", 4);
}

TEST(StoredReference, GptTrainingCheckIsTheInlineCheck) {
  ExpectSameCheck("gpt_train_adam_p2_t2_n4.json", 4);
}

// One stored reference serves another layout with the same values: tp 2 x dp 2 stored, tp 1 x
// dp 4 with the same samples per micro-batch (and the same padded vocabulary) checked.
TEST(StoredReference, ServesAnotherLayoutOfTheSameValues) {
  const std::string dir = ScratchDir("layouts");
  const std::string config = Sample("gpt_tiny_t2_sp_dp2_n4.json");
  std::string output;
  ASSERT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " reference " + config + " --out " + dir, &output),
            0)
      << output;
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + config +
                      " --tp 1 --no-sp --micro-batch-size 1 --reference " + dir,
                  &output),
            0)
      << output;
  EXPECT_NE(output.find(" passed, 0 failed"), std::string::npos) << output;
  fs::remove_all(dir);
}

// Another seed, another model: one line naming the first difference, exit 2. A damaged slice
// file: one line naming the file.
TEST(StoredReference, AnotherRunOrADamagedFileIsRefused) {
  const std::string dir = ScratchDir("refused");
  const std::string config = Sample("gpt_tiny_t2_sp_dp2_n4.json");
  std::string output;
  ASSERT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " reference " + config + " --out " + dir, &output),
            0)
      << output;
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + config + " --seed 7 --reference " + dir,
                  &output),
            2)
      << output;
  EXPECT_NE(output.find("the stored reference is of another run: run.seed: 1234 in the stored "
                        "reference, 7 here"),
            std::string::npos)
      << output;
  EXPECT_EQ(output.find("passed"), std::string::npos) << output;
  // Storing into a folder that is not empty is refused too.
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " reference " + config + " --out " + dir, &output),
            2)
      << output;
  EXPECT_NE(output.find("is not empty"), std::string::npos) << output;
  // A truncated slice file.
  const fs::path slice = fs::path(dir) / "slice00001.safetensors";
  ASSERT_TRUE(fs::exists(slice));
  fs::resize_file(slice, fs::file_size(slice) / 2);
  EXPECT_EQ(Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + config + " --reference " + dir, &output),
            2)
      << output;
  EXPECT_NE(output.find("slice00001.safetensors"), std::string::npos) << output;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mpusim::cli
