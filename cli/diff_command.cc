// `mpusim diff A B`: compares two `mpusim run --dump` directories tensor by tensor, whatever
// their layouts and dtypes (core/dump/diff.h reads, reassembles and compares; this file only
// parses the options and picks the rendering).
#include <ostream>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/commands.h"
#include "core/dump/diff.h"

namespace mpusim::cli {
namespace {

class DiffCommand : public Command {
 public:
  explicit DiffCommand(CLI::App* parent) {
    app_ = parent->add_subcommand(
        "diff",
        "Compare two --dump directories tensor by tensor (full tensors rebuilt from the "
        "shards, so layouts and dtypes may differ)");
    app_->footer(
        "B is the expected side: an element passes when both values are finite and\n"
        "|a - b| <= atol + ntol * max|b| + rtol * |b|. The least precise dtype of the tensor\n"
        "on either side and of either run's storage dtype picks the defaults:\n"
        "float64 atol 1e-12 rtol 1e-9; float32 atol 1e-5 rtol 1e-4;\n"
        "float16 ntol 2^-8 rtol 2^-8; bfloat16 ntol 2^-5 rtol 2^-5 (atol 0 for both).\n"
        "The two runs' configs are compared first, key by key: the differences are listed\n"
        "before the tensors; dumps of different models (model keys that change the tensors'\n"
        "names or shapes, such as model.hidden_size) are refused.\n"
        "Exit codes: 0 every tensor passes, 1 a tensor fails (values, shape, only in one\n"
        "side, replicated copies that disagree), 2 unreadable input, bad options or dumps of\n"
        "different models.\n"
        "Examples:\n"
        "  mpusim diff /tmp/t4 /tmp/t1\n"
        "  mpusim diff /tmp/t4 /tmp/t1 --tensors fc1.weight_grad,fc2.output --format json");
    app_->add_option("A", dir_a_, "dump directory (actual)")->required();
    app_->add_option("B", dir_b_, "dump directory (expected)")->required();
    atol_option_ =
        app_->add_option("--atol", atol_, "absolute tolerance for every tensor (default by dtype)");
    ntol_option_ = app_->add_option(
        "--ntol", ntol_, "tolerance relative to each tensor's max|b|, for every tensor (default by dtype)");
    rtol_option_ =
        app_->add_option("--rtol", rtol_, "relative tolerance for every tensor (default by dtype)");
    app_->add_option("--format", format_, "text or json (default text)")
        ->check(CLI::IsMember({"text", "json"}));
    app_->add_option("--tensors", tensors_, "compare only these tensors (NAME,NAME,...)")
        ->delimiter(',');
  }

  CLI::App* app() override { return app_; }

  int Run(std::ostream& out, std::ostream& err) override {
    StatusOr<Dump> a = LoadDump(dir_a_);
    if (!a.ok()) return ReportError(err, a.status().where(), a.status().what());
    StatusOr<Dump> b = LoadDump(dir_b_);
    if (!b.ok()) return ReportError(err, b.status().where(), b.status().what());
    DiffOptions options;
    if (atol_option_->count() > 0) options.atol = atol_;
    if (ntol_option_->count() > 0) options.ntol = ntol_;
    if (rtol_option_->count() > 0) options.rtol = rtol_;
    options.tensors = tensors_;
    StatusOr<DiffResult> result = DiffDumps(*a, *b, options);
    if (!result.ok() && result.status().where() == "config") {
      // Dumps of different models: one line naming the first model key that differs.
      return ReportError(err, dir_a_ + " vs " + dir_b_, result.status().what());
    }
    if (!result.ok()) {
      // DiffDumps names the option's field: "tensors", "atol", "ntol" or "rtol".
      return ReportError(err, "command line",
                         "--" + result.status().where() + ": " + result.status().what());
    }
    out << (format_ == "json" ? DiffJson(*result) : DiffText(*result));
    return result->failed > 0 ? kExitCheckFailed : kExitOk;
  }

 private:
  CLI::App* app_ = nullptr;
  std::string dir_a_;
  std::string dir_b_;
  double atol_ = 0;
  double ntol_ = 0;
  double rtol_ = 0;
  CLI::Option* atol_option_ = nullptr;
  CLI::Option* ntol_option_ = nullptr;
  CLI::Option* rtol_option_ = nullptr;
  std::string format_ = "text";
  std::vector<std::string> tensors_;
};

}  // namespace

std::unique_ptr<Command> MakeDiffCommand(CLI::App* parent) {
  return std::make_unique<DiffCommand>(parent);
}

}  // namespace mpusim::cli
