// One table of quick flags (cli/config_options.h ConfigFlags) for every command that reads a
// layout and for `mpusim run`: the same names everywhere, the same values, the same errors.
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cli/config_options.h"
#include "tests/cli/cli_test_util.h"

namespace mpusim::cli {
namespace {

using test_util::ExpectUsageError;
using test_util::Mpiexec;
using test_util::Mpusim;
using test_util::Result;
using test_util::Sample;
using test_util::Shell;

// Every flag of the table is in the help of every command that takes a layout, `run`
// included, under one name.
TEST(ConfigFlagsTest, EveryLayoutCommandTakesEveryFlag) {
  for (const char* command : {"layout", "estimate", "explain", "schedule", "run"}) {
    const Result help = Mpusim({command, "--help"});
    EXPECT_EQ(help.code, 0) << command;
    for (const ConfigFlag& f : ConfigFlags()) {
      EXPECT_NE(help.out.find(LongName(f.flag) + " "), std::string::npos)
          << command << " lacks " << LongName(f.flag);
    }
    EXPECT_NE(help.out.find("-n,--world-size"), std::string::npos) << command;
  }
  // run also takes the run section's flags, from the same declarations.
  const Result run_help = Mpusim({"run", "--help"});
  for (const ConfigFlag& f : RunFlags()) {
    EXPECT_NE(run_help.out.find(LongName(f.flag) + " "), std::string::npos)
        << "run lacks " << LongName(f.flag);
  }
  EXPECT_GE(RunFlags().size(), 8u);
  EXPECT_NE(Mpusim({"sweep", "--help"}).out.find("-n,--world-size"), std::string::npos);
  EXPECT_NE(Mpusim({"advise", "--help"}).out.find("-n,--world-size"), std::string::npos);
}

// A flag's text is read as its key's kind; a number key's flag gives a JSON number (none has
// a flag yet: this keeps one from arriving as a string).
TEST(ConfigFlagsTest, FlagTextIsReadAsTheKeysKind) {
  ConfigFlag number;
  number.flag = "--lr";
  number.type = FieldKind::kNumber;
  ASSERT_TRUE(FlagValue(number, "1.5e-3").ok());
  EXPECT_EQ(*FlagValue(number, "1.5e-3"), nlohmann::json(1.5e-3));
  EXPECT_EQ(FlagValue(number, "x").status().Message(), "--lr: must be a number, got 'x'");
  ConfigFlag text;
  text.flag = "--recompute";
  text.type = FieldKind::kText;
  EXPECT_EQ(*FlagValue(text, "none"), nlohmann::json(nullptr));
  EXPECT_EQ(*FlagValue(text, "full"), nlohmann::json("full"));
}

// estimate takes --distributed-optimizer (advise searches it; estimate sets it).
TEST(ConfigFlagsTest, EstimateTakesTheDistributedOptimizer) {
  const std::string config = Sample("gpt3_175b_t8_p16_n1024.json");
  const Result plain = Mpusim({"estimate", config, "--distributed-optimizer", "false"});
  const Result sharded = Mpusim({"estimate", config, "--distributed-optimizer", "true"});
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_EQ(sharded.code, 0) << sharded.err;
  EXPECT_NE(plain.out.find("plain optimizer"), std::string::npos);
  EXPECT_NE(sharded.out.find("distributed optimizer"), std::string::npos);
  ExpectUsageError(Mpusim({"estimate", config, "--distributed-optimizer", "yes"}),
                   "error: command line: --distributed-optimizer: must be true or false, got "
                   "'yes'");
}

// run takes the table's flags as overrides: --sequence-parallel false is --no-sp, -n is
// --world-size, an optimizer flag needs the file's optimizer section, a bad value names the
// flag.
TEST(ConfigFlagsTest, RunTakesTheSameFlags) {
  const std::string run = Mpiexec(4) + MPUSIM_BINARY + " run ";
  const std::string lab = Sample("lab_sequence_parallel_t4_n4.json");
  const auto activations = [](const std::string& output) {
    const size_t at = output.find("activations   ");
    return at == std::string::npos ? std::string() : output.substr(at, 30);
  };
  std::string no_sp, flag;
  ASSERT_EQ(Shell(run + lab + " --no-sp", &no_sp), 0) << no_sp;
  ASSERT_EQ(Shell(run + lab + " --sequence-parallel false -n 4", &flag), 0) << flag;
  EXPECT_NE(activations(no_sp), "");
  EXPECT_EQ(activations(flag), activations(no_sp));
  std::string with_sp;
  ASSERT_EQ(Shell(run + lab + " --sequence-parallel true", &with_sp), 0) << with_sp;
  EXPECT_NE(activations(with_sp), activations(no_sp));

  std::string output;
  EXPECT_EQ(Shell(run + lab + " --overlap-grad-reduce true", &output), 2);
  EXPECT_EQ(output.rfind("error: command line: --overlap-grad-reduce: needs a config with an "
                         "\"optimizer\" section (it sets optimizer.overlap_grad_reduce)\n",
                         0),
            0u)
      << output;
  EXPECT_EQ(Shell(run + lab + " --hcp 2,x", &output), 2);
  EXPECT_NE(output.find("--hcp: must be an integer, got 'x'"), std::string::npos) << output;
  // The run section's flags: the key's own rule, named by the flag.
  EXPECT_EQ(Shell(run + lab + " --seq-length 0", &output), 2);
  EXPECT_NE(output.find("error: command line: --seq-length: run.seq_length: must be an integer "
                        ">= 1, got 0"),
            std::string::npos)
      << output;
  EXPECT_EQ(Shell(run + lab + " --dtype float8", &output), 2);
  EXPECT_NE(output.find("error: command line: --dtype: run.dtype: must be \"float32\", "
                        "\"float64\", \"bfloat16\" or \"float16\", got string \"float8\""),
            std::string::npos)
      << output;
  // --recompute none is the key's null; a chain takes it (it recomputes nothing anyway).
  std::string none;
  ASSERT_EQ(Shell(run + lab + " --recompute none --seed 7", &none), 0) << none;
}

}  // namespace
}  // namespace mpusim::cli
