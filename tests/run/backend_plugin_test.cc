// The backend plugin boundary, tried on the real binary: CPU runs and the planner commands
// map no CUDA library (seen through the dynamic loader's own log, LD_DEBUG=files, which also
// lists libraries opened with dlopen), `--backend cuda` loads the plugin only when asked for,
// and every way of not having a usable plugin is one error line with exit code 2.
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "run/backend_plugin.h"
#include "tests/error_lines.h"

namespace mpusim::run {
namespace {

namespace fs = std::filesystem;

struct Outcome {
  int code = -1;
  std::string output;  // stdout and stderr together
};

Outcome Shell(const std::string& command) {
  static int calls = 0;
  const fs::path log = fs::temp_directory_path() /
                       fmt::format("mpusim_plugin_test.{}.{}.log", ::getpid(), ++calls);
  const std::string env = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
  const int raw = std::system((env + command + " > " + log.string() + " 2>&1").c_str());
  Outcome outcome;
  outcome.code = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  std::ifstream in(log);
  outcome.output.assign(std::istreambuf_iterator<char>(in), {});
  fs::remove(log);
  return outcome;
}

std::string Sample(const std::string& name) {
  return std::string(MPUSIM_SAMPLE_CONFIG_DIR) + "/" + name;
}

std::string Mpiexec(int ranks) {
  return fmt::format("{} -n {} --oversubscribe ", MPUSIM_MPIEXEC, ranks);
}

// The libraries the dynamic loader mapped while `command` ran (every process it started),
// from LD_DEBUG=files lines such as "  123: file=libfoo.so.1 [0];  needed by ...".
std::set<std::string> LoadedLibraries(const std::string& command, int* code = nullptr) {
  const Outcome outcome = Shell("LD_DEBUG=files " + command);
  if (code != nullptr) *code = outcome.code;
  std::set<std::string> files;
  static const std::regex kFile(R"(file=(\S+) \[)");
  for (std::sregex_iterator it(outcome.output.begin(), outcome.output.end(), kFile), end;
       it != end; ++it) {
    files.insert(fs::path((*it)[1].str()).filename().string());
  }
  return files;
}

// The CUDA driver, runtime, cuBLAS(Lt) and NCCL.
std::set<std::string> CudaLibraries(const std::set<std::string>& files) {
  static const std::regex kCuda(R"(^lib(cuda|cudart|cublas|cublasLt|nccl)\.so.*)");
  std::set<std::string> cuda;
  for (const std::string& f : files) {
    if (std::regex_match(f, kCuda)) cuda.insert(f);
  }
  return cuda;
}


TEST(BackendPlugin, PlannerCommandsMapNoCudaLibrary) {
  const std::string mpusim = MPUSIM_BINARY;
  for (const std::string& args :
       {std::string("layout ") + Sample("gpt3_175b_t8_p16_n1024.json"),
        std::string("schedule ") + Sample("interleaved_schedule_p2_v2_n2.json") +
            " --microbatches 4",
        std::string("explain ") + Sample("lab_column_parallel_t16_n16.json"),
        std::string("--help")}) {
    int code = -1;
    const std::set<std::string> files = LoadedLibraries(mpusim + " " + args, &code);
    EXPECT_EQ(code, 0) << args;
    EXPECT_TRUE(files.count("libmpusim_core.so") == 1) << "the loader log was not read: " << args;
    EXPECT_EQ(CudaLibraries(files), std::set<std::string>()) << args;
  }
}

TEST(BackendPlugin, CpuRunMapsNoCudaLibrary) {
  int code = -1;
  const std::set<std::string> files = LoadedLibraries(
      Mpiexec(2) + MPUSIM_BINARY + " run " + Sample("lab_parallel_embedding_t2_n2.json"), &code);
  EXPECT_EQ(code, 0);
  EXPECT_TRUE(files.count("libmpusim_mpi.so") == 1);
  EXPECT_EQ(files.count(BackendPluginFileName("cuda")), 0u);
  EXPECT_EQ(CudaLibraries(files), std::set<std::string>());
}

#if defined(MPUSIM_HAVE_CUDA_PLUGIN)
// The positive control of the two tests above: asked for, the plugin and the CUDA libraries
// are mapped (so the loader log would show them). Without a GPU the run ends with one line.
TEST(BackendPlugin, CudaBackendLoadsThePluginWhenAskedFor) {
  const std::string command = Mpiexec(2) + MPUSIM_BINARY + " run " +
                              Sample("lab_parallel_embedding_t2_n2.json") +
                              " --backend cuda --comm mpi";
  const std::set<std::string> files = LoadedLibraries(command);
  EXPECT_EQ(files.count(BackendPluginFileName("cuda")), 1u);
  EXPECT_EQ(files.count("libcudart.so.13") + files.count("libcudart.so.12"), 1u);
  const Outcome run = Shell(command);
  if (run.code == 0) GTEST_SKIP() << "a CUDA device is visible: the run itself succeeded";
  EXPECT_EQ(run.code, 2) << run.output;
  EXPECT_EQ(ErrorLines(run.output), 1) << run.output;
  EXPECT_NE(run.output.find("error: --backend cuda: "), std::string::npos) << run.output;
}

// The GPT model on the GPU -- cuBLAS, every transformer kernel, and the host-staged MPI
// collectives, so that four ranks may share one GPU (NCCL refuses two ranks on one device) --
// passes the same float64 check as on the CPU, with dropout on, in float32 and bfloat16, with
// sequence parallelism and selective recomputation. Skipped where no GPU is visible.
TEST(BackendPlugin, GptOnTheGpuPassesTheCheck) {
  for (const char* sample : {"gpt_tiny_t2_sp_dp2_n4.json", "gpt_llama_style_gqa_t4_n4.json"}) {
    SCOPED_TRACE(sample);
    const Outcome run = Shell(Mpiexec(4) + MPUSIM_BINARY + " run " + Sample(sample) +
                              " --backend cuda --comm mpi");
    if (run.code == 2 && run.output.find("error: --backend cuda: ") != std::string::npos) {
      GTEST_SKIP() << "no CUDA device: " << run.output;
    }
    EXPECT_EQ(run.code, 0) << run.output;
    EXPECT_NE(run.output.find(" passed, 0 failed"), std::string::npos) << run.output;
  }
}
#endif

// A copy of the program in a tree of its own, laid out as the build tree is (cli/mpusim next
// to ../core and ../mpi, which the program's $ORIGIN run path names), with `plugin` (a file
// in the build tree) next to the program under the CUDA plugin's name, or nothing. Returns
// the program's directory.
fs::path ProgramCopy(const std::string& tag, const std::string& plugin = "") {
  const fs::path root = fs::temp_directory_path() / fmt::format("mpusim_plugin.{}.{}", ::getpid(), tag);
  const fs::path build = fs::path(MPUSIM_BINARY).parent_path().parent_path();
  fs::remove_all(root);
  for (const char* library : {"core/libmpusim_core.so", "mpi/libmpusim_mpi.so"}) {
    fs::create_directories((root / library).parent_path());
    fs::copy_file(build / library, root / library);
  }
  const fs::path dir = root / "cli";
  fs::create_directories(dir);
  fs::copy_file(MPUSIM_BINARY, dir / "mpusim");
  fs::permissions(dir / "mpusim", fs::perms::owner_all, fs::perm_options::add);
  if (!plugin.empty()) fs::copy_file(plugin, dir / BackendPluginFileName("cuda"));
  return dir;
}

// One error line, exit 2, nothing run (one rank, started without mpiexec).
void ExpectRefused(const fs::path& dir, const std::string& message) {
  const Outcome run = Shell((dir / "mpusim").string() + " run " +
                            Sample("../bench/configs/mlp_t1_n1.json") + " --backend cuda");
  EXPECT_EQ(run.code, 2) << run.output;
  EXPECT_EQ(ErrorLines(run.output), 1) << run.output;
  EXPECT_NE(run.output.find(message), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("check against"), std::string::npos) << run.output;
  fs::remove_all(dir.parent_path());
}

TEST(BackendPlugin, WithoutThePluginOneLineExitTwo) {
  ExpectRefused(ProgramCopy("none"),
                "error: --backend cuda: this mpusim has no cuda backend: "
                "libmpusim_backend_cuda.so is not next to the program");
}

TEST(BackendPlugin, APluginFromAnotherBuildIsRefused) {
  ExpectRefused(ProgramCopy("abi", MPUSIM_FAKE_PLUGIN),
                "was built for backend ABI -7, this mpusim needs");
}

TEST(BackendPlugin, ALibraryThatIsNotAPluginIsRefused) {
  ExpectRefused(ProgramCopy("empty", MPUSIM_EMPTY_PLUGIN),
                "is not an mpusim backend plugin (no mpusim_backend_abi or mpusim_make_backend)");
}

TEST(BackendPlugin, AFileThatIsNotALibraryIsRefused) {
  const fs::path dir = ProgramCopy("text");
  std::ofstream(dir / BackendPluginFileName("cuda")) << "not an ELF file\n";
  ExpectRefused(dir, "error: --backend cuda: cannot load ");
}

}  // namespace
}  // namespace mpusim::run
