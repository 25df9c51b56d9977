// README transcripts cannot go stale: every `$ command` in a README code block runs here and
// its output (stdout and stderr together) is compared with the lines that follow it in the
// block.
//
// Rules (docs/testing.md, "Tests" repeats them for authors):
//   - `mpusim` and `build/cli/mpusim` run the binary this build made; `mpirun -n N` runs it on
//     N ranks (with --oversubscribe); commands run from the repository root.
//   - A line `...` (indented or not) in the README stands for any number of output lines.
//   - The planner's commands (layout, schedule, explain, estimate, advise) must match exactly. The
//     others (run, sweep, diff) print timings, memory and rounding-level errors that change
//     from machine to machine: there every decimal number (with a point or an exponent) is
//     masked and runs of spaces count as one, so the words, the names, the counts, the table
//     layout and which tensors pass must still match.
//   - A block that cannot run here (a GPU, a benchmark, dumps made elsewhere, minutes of
//     work) is preceded by `<!-- transcript: skip, <why> -->`, which the rendered README hides.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/config/gpt_config.h"
#include "core/config/parallel_config.h"
#include "tests/sanitizers.h"

namespace {

// The sanitizer build (about 5 to 10 times slower) leaves out the commands that search many
// layouts, `mpusim sweep` and `mpusim advise` (minutes there; SweepCommand.* and AdviseCommand.*
// run them under the sanitizers): the release build runs every command.
bool SanitizerSkips(const std::string& command) {
  static const std::regex searches(R"(mpusim (sweep|advise)\b)");
  return mpusim::testing::kAddressSanitizer && std::regex_search(command, searches);
}

struct Transcript {
  int line = 0;  // of the `$` line in README.md
  std::string command;
  std::vector<std::string> expected;
};

std::vector<std::string> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Every `$` command in the README's code blocks, except in blocks marked skip.
std::vector<Transcript> Transcripts(const std::vector<std::string>& lines, int* skipped) {
  std::vector<Transcript> out;
  bool in_block = false, skip = false, in_transcript = false;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    if (line.rfind("```", 0) == 0) {
      if (!in_block) {
        skip = i > 0 && lines[i - 1].rfind("<!-- transcript: skip", 0) == 0;
        if (skip) ++*skipped;
      }
      in_block = !in_block;
      in_transcript = false;  // a block's text belongs to its own `$` lines only
      continue;
    }
    if (!in_block || skip) continue;
    if (line.rfind("$ ", 0) == 0) {
      out.push_back({static_cast<int>(i) + 1, line.substr(2), {}});
      in_transcript = true;
    } else if (in_transcript) {
      out.back().expected.push_back(line);
    }
  }
  return out;
}

// The command as this build runs it.
std::string ShellCommand(const std::string& command) {
  static const std::regex mpirun(R"(^mpirun -n (\d+)( --oversubscribe)? )");
  static const std::regex binary(R"((^|\s)(build/cli/)?mpusim(\s|$))");
  std::string c = std::regex_replace(command, mpirun,
                                     fmt::format("{} -n $1 --oversubscribe ", MPUSIM_MPIEXEC));
  c = std::regex_replace(c, binary, fmt::format("$1{}$3", MPUSIM_BINARY));
  return c;
}

std::string RunShell(const std::string& command) {
  static int calls = 0;
  const std::string log = (std::filesystem::temp_directory_path() /
                           fmt::format("mpusim_readme.{}.{}.log", ::getpid(), ++calls))
                              .string();
  const std::string line = fmt::format(
      "cd {} && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 {} > {} 2>&1",
      MPUSIM_SOURCE_DIR, command, log);
  (void)std::system(line.c_str());
  std::ifstream in(log);
  std::string text(std::istreambuf_iterator<char>(in), {});
  std::filesystem::remove(log);
  return text;
}

// Decimal numbers (those with a point or an exponent: times, sizes in MiB, errors, losses)
// and the kernels OpenBLAS runs with, and why ("(Haswell kernels)", "(SkylakeX kernels,
// pinned by mpusim: ...)": sim/blas_kernels.h), masked, and runs of spaces
// made one, for the commands with machine-dependent output; counts (tensors passed and
// failed, bytes, elements, ranks) stay exact.
std::string Masked(const std::string& line) {
  static const std::regex number(R"([-+]?(\d+\.\d*|\.\d+|\d+(?=[eE]))([eE][-+]?\d+)?)");
  static const std::regex kernels(R"(\(\w+ kernels[^)]*\))");
  static const std::regex spaces(R"( +)");
  return std::regex_replace(
      std::regex_replace(std::regex_replace(line, number, "#"), kernels, "(# kernels)"), spaces,
      " ");
}

// Whether `actual` matches `expected`, where an expected "..." matches any run of lines;
// on a mismatch, `why` says where.
bool Matches(const std::vector<std::string>& expected, const std::vector<std::string>& actual,
             bool masked, size_t e, size_t a, std::string* why) {
  for (; e < expected.size(); ++e, ++a) {
    if (expected[e].find_first_not_of(' ') != std::string::npos &&
        expected[e].substr(expected[e].find_first_not_of(' ')) == "...") {
      for (size_t skip = a; skip <= actual.size(); ++skip) {
        if (Matches(expected, actual, masked, e + 1, skip, nullptr)) return true;
      }
      if (why != nullptr) *why = fmt::format("nothing after README line {} matches", e + 1);
      return false;
    }
    const bool same = a < actual.size() && (masked ? Masked(expected[e]) == Masked(actual[a])
                                                   : expected[e] == actual[a]);
    if (!same) {
      if (why != nullptr) {
        *why = fmt::format("output line {}:\n  README: {}\n  actual: {}", a + 1, expected[e],
                           a < actual.size() ? actual[a] : std::string("(no more output)"));
      }
      return false;
    }
  }
  if (a < actual.size() && why != nullptr) {
    *why = fmt::format("output goes on after the README's last line: {}", actual[a]);
  }
  return a >= actual.size();
}

// README.md and every docs/*.md, in that order (the text moved from the README into docs/ is
// tested where it went).
std::vector<std::filesystem::path> DocFiles() {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(fs::path(MPUSIM_SOURCE_DIR) / "docs")) {
    if (entry.path().extension() == ".md") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  files.insert(files.begin(), fs::path(MPUSIM_SOURCE_DIR) / "README.md");
  return files;
}

TEST(ReadmeTranscripts, EveryCommandPrintsWhatTheReadmeShows) {
  struct Located {
    std::string file;
    Transcript t;
  };
  std::vector<Located> transcripts;
  int skipped = 0;
  for (const std::filesystem::path& file : DocFiles()) {
    const std::vector<std::string> lines = ReadLines(file.string());
    ASSERT_FALSE(lines.empty()) << file;
    for (Transcript& t : Transcripts(lines, &skipped)) {
      transcripts.push_back({file.lexically_relative(MPUSIM_SOURCE_DIR).string(), std::move(t)});
    }
  }
  EXPECT_GE(transcripts.size(), 30u);
  static const std::regex planner(R"(mpusim (layout|schedule|explain|estimate|advise)\b)");
  int sanitizer_skipped = 0;
  for (const auto& [file, t] : transcripts) {
    if (SanitizerSkips(t.command)) {
      ++sanitizer_skipped;
      continue;
    }
    SCOPED_TRACE(fmt::format("{}:{}: $ {}", file, t.line, t.command));
    std::vector<std::string> actual;
    std::istringstream text(RunShell(ShellCommand(t.command)));
    for (std::string line; std::getline(text, line);) actual.push_back(line);
    std::string why;
    const bool masked = !std::regex_search(t.command, planner);
    EXPECT_TRUE(Matches(t.expected, actual, masked, 0, 0, &why))
        << why << "\n(the whole output: " << actual.size() << " lines)";
  }
  std::cout << fmt::format(
      "{} commands of the README and docs/ run and compared, {} blocks marked skip, {} left to "
      "the release build\n",
      transcripts.size() - static_cast<size_t>(sanitizer_skipped), skipped, sanitizer_skipped);
}

// The lines of the README or docs/ file holding the table whose header starts with `header`,
// and the header's index in them (lines.size() when no file has it).
std::pair<std::vector<std::string>, size_t> FindTable(const std::string& header) {
  for (const std::filesystem::path& file : DocFiles()) {
    std::vector<std::string> lines = ReadLines(file.string());
    for (size_t at = 0; at < lines.size(); ++at) {
      if (lines[at].rfind(header, 0) == 0) return {std::move(lines), at};
    }
  }
  return {{}, 0};
}

// The README's `parallel` key table is the section's field table: every key, in the table's
// order, with its default (the echo of a default section; "required" for a key without
// one). A key added to the table without a row, or a default changed in one place only,
// fails here.
TEST(ReadmeKeyTables, TheParallelTableIsTheFieldTable) {
  const auto [lines, at] = FindTable("| `parallel` key | default |");
  ASSERT_LT(at, lines.size()) << "neither README.md nor docs/ has the `parallel` key table";
  std::vector<std::pair<std::string, std::string>> rows;  // key, default's first word
  for (size_t i = at + 2; i < lines.size() && lines[i].rfind("| `", 0) == 0; ++i) {
    static const std::regex row(R"(^\| `([a-z0-9_]+)` \| `?([^ |`]+))");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(lines[i], m, row)) << "README.md:" << i + 1 << ": " << lines[i];
    rows.emplace_back(m[1], m[2]);
  }
  const mpusim::ParallelConfig defaults;
  std::vector<std::pair<std::string, std::string>> expected;
  for (const auto& f : mpusim::ParallelFields()) {
    expected.emplace_back(std::string(f.key),
                          f.required.empty() ? f.Echo(defaults).dump() : "required");
  }
  EXPECT_EQ(rows, expected);
}

// The README's GPT `model` key table is the GPT section's field table (core/config/
// gpt_fields.cc): every key, in the table's order, with its default: the echo of a default
// section, what an absent key resolves to (the field's `absent`, "4 * hidden_size") or
// "required". A default cell may go on after it in words ("null (dropless)").
TEST(ReadmeKeyTables, TheGptTableIsTheFieldTable) {
  const auto [lines, at] = FindTable("| `model` key (GPT) | default |");
  ASSERT_LT(at, lines.size()) << "neither README.md nor docs/ has the `model` key (GPT) table";
  std::vector<std::string> keys;
  std::vector<std::string> defaults;  // the default cell, without backticks
  for (size_t i = at + 2; i < lines.size() && lines[i].rfind("| `", 0) == 0; ++i) {
    static const std::regex row(R"(^\| `([a-z0-9_]+)` \| ([^|]*[^| ]) \|)");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(lines[i], m, row)) << "README.md:" << i + 1 << ": " << lines[i];
    keys.push_back(m[1]);
    defaults.push_back(std::regex_replace(m[2].str(), std::regex("`"), ""));
  }
  const mpusim::GptConfig section;
  std::vector<std::string> expected_keys;
  std::vector<std::string> expected_defaults;
  for (const auto& f : mpusim::GptFields()) {
    expected_keys.emplace_back(f.key);
    expected_defaults.push_back(!f.required.empty() ? "required"
                                : !f.absent.empty() ? std::string(f.absent)
                                                    : f.Echo(section).dump());
  }
  for (size_t i = 0; i < std::max(keys.size(), expected_keys.size()); ++i) {
    ASSERT_EQ(i < keys.size() ? keys[i] : "(no row)",
              i < expected_keys.size() ? expected_keys[i] : "(no field)")
        << "row " << i + 1 << " of README.md's `model` key (GPT) table";
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string& shown = defaults[i];
    const std::string& expected = expected_defaults[i];
    EXPECT_TRUE(shown == expected || shown.rfind(expected + " ", 0) == 0)
        << "README.md's `model` key (GPT) table: " << keys[i] << " defaults to '" << shown
        << "', the field table to '" << expected << "'";
  }
}

// docs/labs.md's commands run as written: every code span that is a command (`build/cli/mpusim
// ...`, or under `mpirun -n N --oversubscribe`) exits 0 when run from a scratch directory with
// the repository's sample configs and the labs' lab-output/ folder, into which every file a lab
// writes must go (git ignores it, so a lab leaves `git status` clean). A bare `mpusim ...` is
// refused: the labs say build/cli/mpusim, which needs no PATH. A span on a line with `<!-- labs
// test: skip, why -->` is not run (minutes of work); one on a line with `<!-- labs test: exits N
// -->` must exit N (a refusal the lab shows); one on a line with `<!-- labs test: prints "TEXT"
// -->` must print TEXT (a number the lab quotes from the output).
TEST(LabCommands, EveryCommandRunsAsWritten) {
  namespace fs = std::filesystem;
  const std::vector<std::string> lines =
      ReadLines(std::string(MPUSIM_SOURCE_DIR) + "/docs/labs.md");
  ASSERT_FALSE(lines.empty());
  static const std::regex span(R"(`((mpirun -n \d+ --oversubscribe )?(build/cli/)?mpusim [^`]+)`)");
  const fs::path scratch = fs::temp_directory_path() / fmt::format("mpusim_labs.{}", ::getpid());
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  fs::create_directory_symlink(fs::path(MPUSIM_SOURCE_DIR) / "sample_configs",
                               scratch / "sample_configs");
  fs::create_directories(scratch / "lab-output");  // the labs' `mkdir -p lab-output`
  int run = 0, skipped = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    for (auto it = std::sregex_iterator(lines[i].begin(), lines[i].end(), span);
         it != std::sregex_iterator(); ++it) {
      const std::string command = (*it)[1];
      SCOPED_TRACE(fmt::format("docs/labs.md:{}: {}", i + 1, command));
      EXPECT_TRUE((*it)[3].matched) << "write build/cli/mpusim: mpusim is not on PATH";
      // What a lab writes goes into lab-output/, which git ignores: a lab leaves `git status`
      // clean.
      static const std::regex output(R"((?:>|--dump|--trace|--summary|--out)\s+(\S+))");
      for (auto o = std::sregex_iterator(command.begin(), command.end(), output);
           o != std::sregex_iterator(); ++o) {
        EXPECT_TRUE((*o)[1].str().starts_with("lab-output/"))
            << (*o)[0] << ": write it into lab-output/ (git ignores it)";
      }
      if (lines[i].find("<!-- labs test: skip") != std::string::npos || SanitizerSkips(command)) {
        ++skipped;
        continue;
      }
      const std::string line = fmt::format(
          "cd {} && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 {} > log.txt 2>&1",
          scratch.string(), ShellCommand(command));
      // A command the lab shows failing says so: `<!-- labs test: exits N -->`.
      static const std::regex exits(R"(<!-- labs test: exits (\d+) -->)");
      std::smatch expected;
      const int want = std::regex_search(lines[i], expected, exits) ? std::stoi(expected[1]) : 0;
      const int status = std::system(line.c_str());
      std::ifstream log(scratch / "log.txt");
      const std::string text(std::istreambuf_iterator<char>(log), {});
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == want) << text.substr(0, 2000);
      static const std::regex prints(R"re(<!-- labs test: prints "([^"]+)" -->)re");
      if (std::regex_search(lines[i], expected, prints)) {
        EXPECT_NE(text.find(expected[1].str()), std::string::npos)
            << "the lab quotes \"" << expected[1] << "\" from this output:\n" << text;
      }
      ++run;
    }
  }
  EXPECT_GE(run, 15);
  fs::remove_all(scratch);
  std::cout << fmt::format("{} lab commands run, {} marked skip\n", run, skipped);
}

// What the docs say is not built stays refused, or the claim goes: every line of README.md and
// docs/*.md that says "not built" (or "until built") carries a marker the test runs,
// `<!-- refused: SUBCOMMAND SAMPLE.json PATCH -->` (the sample config with the JSON merge patch
// applied must be refused: exit 2, one "error: " line saying "not built"), or says why it is no
// refusal, `<!-- not refused: why -->`. A feature that lands then fails here until its "not
// built" sentence is gone.
TEST(DocsClaims, EveryNotBuiltClaimIsStillRefused) {
  namespace fs = std::filesystem;
  static const std::regex claim(R"((not|until) built)", std::regex::icase);
  static const std::regex refused(R"re(<!-- refused: (\w+) (\S+\.json) (\{.*?\}) -->)re");
  static const std::regex not_refused(R"(<!-- not refused: [^>]+ -->)");
  std::vector<fs::path> files = {fs::path(MPUSIM_SOURCE_DIR) / "README.md"};
  for (const auto& entry : fs::directory_iterator(fs::path(MPUSIM_SOURCE_DIR) / "docs")) {
    if (entry.path().extension() == ".md") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  int claims = 0, runs = 0;
  for (const fs::path& file : files) {
    const std::vector<std::string> lines = ReadLines(file.string());
    for (size_t i = 0; i < lines.size(); ++i) {
      if (!std::regex_search(lines[i], claim)) continue;
      ++claims;
      SCOPED_TRACE(fmt::format("{}:{}", file.filename().string(), i + 1));
      int markers = 0;
      for (auto it = std::sregex_iterator(lines[i].begin(), lines[i].end(), refused);
           it != std::sregex_iterator(); ++it, ++markers, ++runs) {
        const std::string command = (*it)[1], sample = (*it)[2];
        std::ifstream in(fs::path(MPUSIM_SOURCE_DIR) / "sample_configs" / sample);
        nlohmann::json config = nlohmann::json::parse(in, nullptr, false);
        const nlohmann::json patch = nlohmann::json::parse((*it)[3].str(), nullptr, false);
        ASSERT_FALSE(config.is_discarded()) << sample;
        ASSERT_FALSE(patch.is_discarded()) << (*it)[3];
        config.merge_patch(patch);
        const fs::path path =
            fs::temp_directory_path() / fmt::format("mpusim_claim.{}.{}.json", ::getpid(), runs);
        std::ofstream(path) << config.dump();
        const std::string output = RunShell(fmt::format("sh -c '{} {} {}; echo \"exit $?\"'",
                                                        MPUSIM_BINARY, command, path.string()));
        fs::remove(path);
        EXPECT_NE(output.find("\nexit 2\n"), std::string::npos) << output;
        EXPECT_EQ(output.rfind("error: ", 0), 0u) << output;
        EXPECT_NE(output.find("not built"), std::string::npos) << output;
      }
      if (std::regex_search(lines[i], not_refused)) ++markers;
      EXPECT_GT(markers, 0) << "a \"not built\" claim without a marker: add "
                               "<!-- refused: SUBCOMMAND SAMPLE.json PATCH --> (or <!-- not "
                               "refused: why -->)";
    }
  }
  EXPECT_GE(claims, 8);
  std::cout << fmt::format("{} \"not built\" claims, {} refusals run\n", claims, runs);
}

// GitHub's anchor for a heading: lower case, every character but letters, digits, '_', '-'
// and spaces dropped, spaces made '-'.
std::string HeadingAnchor(const std::string& heading) {
  std::string out;
  for (const char c : heading) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalnum(u) != 0 || c == '_' || c == '-') out += static_cast<char>(std::tolower(u));
    if (c == ' ') out += '-';
  }
  return out;
}

// The anchors of a markdown file's headings (outside code blocks), a repeated one numbered as
// GitHub numbers it ("x", "x-1", ...).
std::set<std::string> Anchors(const std::vector<std::string>& lines) {
  std::set<std::string> out;
  std::map<std::string, int> seen;
  bool fence = false;
  static const std::regex heading(R"(^#{1,6} (.*)$)");
  for (const std::string& line : lines) {
    if (line.rfind("```", 0) == 0) fence = !fence;
    std::smatch m;
    if (fence || !std::regex_match(line, m, heading)) continue;
    const std::string anchor = HeadingAnchor(m[1]);
    const int n = seen[anchor]++;
    out.insert(n == 0 ? anchor : fmt::format("{}-{}", anchor, n));
  }
  return out;
}

// The README and docs/ point into each other: every relative link names a file that exists,
// and a link into a markdown file's #anchor names one of its headings (a section that moved
// or was renamed fails here, not in a reader's browser).
TEST(DocsLinks, EveryRelativeLinkResolves) {
  namespace fs = std::filesystem;
  static const std::regex link(R"(\]\(([^)\s]+)\))");
  std::map<fs::path, std::set<std::string>> anchors;
  const auto anchors_of = [&](const fs::path& file) -> const std::set<std::string>& {
    auto it = anchors.find(file);
    if (it == anchors.end()) it = anchors.emplace(file, Anchors(ReadLines(file.string()))).first;
    return it->second;
  };
  int links = 0;
  for (const fs::path& file : DocFiles()) {
    const std::vector<std::string> lines = ReadLines(file.string());
    bool fence = false;
    for (size_t i = 0; i < lines.size(); ++i) {
      if (lines[i].rfind("```", 0) == 0) fence = !fence;
      if (fence) continue;
      for (auto it = std::sregex_iterator(lines[i].begin(), lines[i].end(), link);
           it != std::sregex_iterator(); ++it) {
        const std::string target = (*it)[1];
        if (std::regex_search(target, std::regex("^[a-z]+:"))) continue;  // https:, mailto:
        ++links;
        SCOPED_TRACE(fmt::format("{}:{}: ({})", file.filename().string(), i + 1, target));
        const size_t hash = target.find('#');
        const std::string path = target.substr(0, hash);
        const fs::path resolved =
            path.empty() ? file : (file.parent_path() / path).lexically_normal();
        ASSERT_TRUE(fs::exists(resolved)) << resolved;
        if (hash != std::string::npos && resolved.extension() == ".md") {
          EXPECT_EQ(anchors_of(resolved).count(target.substr(hash + 1)), 1u)
              << "no heading of " << resolved.filename() << " has that anchor";
        }
      }
    }
  }
  EXPECT_GE(links, 40);
  std::cout << fmt::format("{} relative links resolved\n", links);
}

// The README's picture is what `mpusim schedule` draws today: regenerate it with the command
// under it when the drawing changes.
TEST(DocsLinks, TheReadmePictureIsTheScheduleDrawnToday) {
  const std::string drawn = RunShell(fmt::format(
      "{} schedule sample_configs/gpt_pipeline_p4_v2_n4.json --format svg", MPUSIM_BINARY));
  std::ifstream in(std::string(MPUSIM_SOURCE_DIR) + "/docs/images/schedule_p4_v2.svg");
  const std::string committed(std::istreambuf_iterator<char>(in), {});
  EXPECT_FALSE(committed.empty());
  EXPECT_TRUE(drawn == committed)
      << "docs/images/schedule_p4_v2.svg is stale: build/cli/mpusim schedule "
         "sample_configs/gpt_pipeline_p4_v2_n4.json --format svg > docs/images/schedule_p4_v2.svg";
}

}  // namespace
