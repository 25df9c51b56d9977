// Fault tests: whole mpirun jobs in which one rank stops, dies or exits early (MPUSIM_FAULT,
// mpi/watchdog.h), and which must end, non-zero, with a line saying what happened.
//
// What it is: each test starts `mpiexec -n 4 --oversubscribe ...` itself (fork + exec, in a
// process group of its own), reads its output as it comes, and measures from the faulty
// rank's "mpusim: MPUSIM_FAULT: ..." line to the end of mpiexec: the time to a clean abort.
// A job still running after kHardLimitS is killed (its process group, then every process
// that carries this job's tag in its environment) and the test fails, so no test can hang.
// Every test then checks that no process of the job survives: a stopped rank must be killed
// with the rest.
// What it is not: a test of the numbers (tests/cli, tests/mpi) or of a real hardware fault.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tests/error_lines.h"

namespace {

using mpusim::ErrorLines;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr double kHardLimitS = 40;
// The watchdog timeout the stop scenarios run with, and how much later than it the job must
// be gone (the abort itself, Open MPI tearing the job down, and 4 ranks on 2 cores).
constexpr double kTimeoutS = 3;
constexpr double kAbortSlackS = 5;

struct Job {
  int exit_code = -1;          // mpiexec's exit status; -1 if it died of a signal
  bool hard_killed = false;    // still running after kHardLimitS
  double total_s = 0;          // start to the end of mpiexec
  double after_fault_s = -1;   // the MPUSIM_FAULT line to the end of mpiexec; -1: no such line
  std::string output;          // stdout and stderr of every rank, together
  std::vector<int> survivors;  // processes of the job alive after it ended (killed by the test)
};

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The live processes whose environment holds `tag` (a zombie's environ reads empty).
std::vector<int> TaggedProcesses(const std::string& tag) {
  std::vector<int> pids;
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator("/proc", error)) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "environ", std::ios::binary);
    const std::string environ((std::istreambuf_iterator<char>(in)), {});
    if (environ.find(tag) != std::string::npos) pids.push_back(std::stoi(name));
  }
  return pids;
}

// Runs `argv` with MPUSIM_FAULT=`fault` (unset when empty) and a tag of its own in the
// environment, collecting its output until it ends or kHardLimitS passes.
Job RunJob(const std::vector<std::string>& argv, const std::string& fault) {
  static int jobs = 0;
  const std::string tag_value = fmt::format("{}.{}", ::getpid(), ++jobs);
  // As it appears in /proc/PID/environ, NUL-terminated so that job 1 does not match job 10.
  const std::string tag = "MPUSIM_FAULT_TEST_JOB=" + tag_value + std::string(1, '\0');
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) throw std::runtime_error("pipe failed");
  const Clock::time_point start = Clock::now();
  const pid_t child = ::fork();
  if (child < 0) throw std::runtime_error("fork failed");
  if (child == 0) {
    ::setpgid(0, 0);
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    ::dup2(pipe_fds[1], STDERR_FILENO);
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    ::setenv("MPUSIM_FAULT_TEST_JOB", tag_value.c_str(), 1);
    if (fault.empty()) {
      ::unsetenv("MPUSIM_FAULT");
    } else {
      ::setenv("MPUSIM_FAULT", fault.c_str(), 1);
    }
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::fprintf(stderr, "exec %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::setpgid(child, child);  // also here, so that the kill below cannot miss it
  ::close(pipe_fds[1]);

  Job job;
  bool pipe_open = true;
  bool exited = false;
  int status = 0;
  Clock::time_point exited_at;
  // Output that is waiting is read before mpiexec's exit is looked for, so the fault line is
  // timed when it arrives. After the exit, the rest is drained (EOF, or 2 s more if a
  // surviving process still holds the pipe open).
  while (!exited || (pipe_open && Since(exited_at) < 2)) {
    bool readable = false;
    if (pipe_open) {
      pollfd fd{pipe_fds[0], POLLIN, 0};
      readable = ::poll(&fd, 1, 20) > 0;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (readable) {
      char buffer[4096];
      const ssize_t n = ::read(pipe_fds[0], buffer, sizeof(buffer));
      if (n <= 0) {
        pipe_open = false;
      } else {
        const size_t before = job.output.size();
        job.output.append(buffer, static_cast<size_t>(n));
        if (job.after_fault_s < 0 &&
            job.output.find("mpusim: MPUSIM_FAULT:", before > 30 ? before - 30 : 0) !=
                std::string::npos) {
          job.after_fault_s = Since(start);  // the fault's time, for now
        }
      }
    } else if (!exited && ::waitpid(child, &status, WNOHANG) == child) {
      exited = true;
      exited_at = Clock::now();
      job.total_s = Since(start);
    }
    if (!exited && Since(start) > kHardLimitS) {
      job.hard_killed = true;
      ::kill(-child, SIGKILL);
      for (int pid : TaggedProcesses(tag)) ::kill(pid, SIGKILL);
      ::waitpid(child, &status, 0);
      exited = true;
      exited_at = Clock::now();
      job.total_s = Since(start);
    }
  }
  ::close(pipe_fds[0]);
  job.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (job.after_fault_s >= 0) job.after_fault_s = job.total_s - job.after_fault_s;

  // Open MPI reaps its ranks before mpiexec exits; allow a moment for the kernel all the same.
  const Clock::time_point check = Clock::now();
  std::vector<int> alive = TaggedProcesses(tag);
  while (!alive.empty() && Since(check) < 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    alive = TaggedProcesses(tag);
  }
  for (int pid : alive) ::kill(pid, SIGKILL);
  job.survivors = alive;
  std::printf("[ timing   ] exit %d after %.2f s; %.2f s from the fault line to the end%s\n",
              job.exit_code, job.total_s, job.after_fault_s,
              job.hard_killed ? " (HARD-KILLED)" : "");
  return job;
}

std::vector<std::string> Mpiexec(int ranks) {
  return {MPUSIM_MPIEXEC, "-n", std::to_string(ranks), "--oversubscribe"};
}

std::vector<std::string> MpusimRun(int ranks, const std::string& config, double timeout_s) {
  std::vector<std::string> argv = Mpiexec(ranks);
  for (const std::string& a : {std::string(MPUSIM_BINARY), std::string("run"),
                               std::string(MPUSIM_SAMPLE_CONFIG_DIR) + "/" + config,
                               std::string("--timeout"), fmt::format("{:g}", timeout_s)}) {
    argv.push_back(a);
  }
  return argv;
}

std::vector<std::string> P2pHelper(int ranks, int64_t elements, int rounds, bool batch = false) {
  std::vector<std::string> argv = Mpiexec(ranks);
  for (const std::string& a : {std::string(MPUSIM_P2P_HELPER), fmt::format("{:g}", kTimeoutS),
                               std::to_string(elements), std::to_string(rounds)}) {
    argv.push_back(a);
  }
  if (batch) argv.push_back("batch");
  return argv;
}

// A 4-rank config whose step runs collectives on the tp group [0, 1, 2, 3].
constexpr const char* kConfig = "lab_sequence_parallel_t4_n4.json";

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// What every faulty job must show: it ended by itself, non-zero, left nothing behind, and the
// faulty rank said what it did.
void ExpectEndedCleanly(const Job& job, const std::string& fault_line) {
  EXPECT_FALSE(job.hard_killed) << "the job hung until the test killed it:\n" << job.output;
  EXPECT_NE(job.exit_code, 0) << job.output;
  EXPECT_EQ(job.survivors, std::vector<int>()) << "processes of the job outlived it";
  EXPECT_TRUE(Contains(job.output, fault_line)) << job.output;
  EXPECT_GE(job.after_fault_s, 0) << job.output;
}


// The watchdog's line of world rank `rank`, or "" if it printed none.
std::string WatchdogLine(const std::string& output, int rank) {
  const std::string start = fmt::format("mpusim: watchdog: rank {} (host ", rank);
  const size_t at = output.find(start);
  if (at == std::string::npos) return "";
  return output.substr(at, output.find('\n', at) - at);
}

TEST(FaultTest, TheCleanRunPasses) {
  const Job job = RunJob(MpusimRun(4, kConfig, kTimeoutS), "");
  EXPECT_FALSE(job.hard_killed) << job.output;
  EXPECT_EQ(job.exit_code, 0) << job.output;
  EXPECT_FALSE(Contains(job.output, "mpusim: watchdog")) << job.output;
  EXPECT_EQ(job.survivors, std::vector<int>());
}

// (a) A rank stopped before its third all-reduce: the other ranks of its tp group wait in
// MPI_Iallreduce until the timeout, name themselves, the call and the group, and abort.
TEST(FaultTest, RankStoppedInACollectiveAbortsAfterTheTimeout) {
  const Job job =
      RunJob(MpusimRun(4, kConfig, kTimeoutS), "rank=1,op=allreduce,call=3,action=stop");
  ExpectEndedCleanly(job, "mpusim: MPUSIM_FAULT: rank 1 (host ");
  EXPECT_LT(job.after_fault_s, kTimeoutS + kAbortSlackS) << job.output;
  EXPECT_GE(job.after_fault_s, kTimeoutS * 0.9) << "aborted before the timeout:\n" << job.output;
  int lines = 0;
  for (int rank : {0, 2, 3}) {
    const std::string line = WatchdogLine(job.output, rank);
    if (line.empty()) continue;  // the first line's MPI_Abort may end a rank before its own
    ++lines;
    EXPECT_TRUE(Contains(line, "MPI_Iallreduce (allreduce call 3 on this rank)")) << line;
    EXPECT_TRUE(Contains(line, "on tp group [0, 1, 2, 3]")) << line;
    EXPECT_TRUE(Contains(line, "Timeout 3 s (change it with mpusim run --timeout SECONDS)"))
        << line;
  }
  EXPECT_GE(lines, 1) << job.output;
  EXPECT_EQ(WatchdogLine(job.output, 1), "") << "the stopped rank cannot speak";
}

// (b) Point-to-point: rank 1 stops before its third receive. With small messages rank 0's
// third send completes (eagerly) and rank 0 waits in the receive of rank 1's reply; with
// large ones (rendezvous) rank 0 already waits in the send. Either way the line names the
// peer. Ranks 2 and 3 finish and wait in the final barrier. The same holds for batched
// exchanges (BatchSendRecv, as pipeline stages make them): the line names the first message
// of the batch still incomplete.
TEST(FaultTest, RankStoppedInPointToPointNamesThePeer) {
  struct Case {
    int64_t elements;
    bool batch;
    std::string waiting;
  };
  for (const Case& c :
       {Case{16, false, "MPI_Irecv (recv call 3 on this rank) from rank 1 (group rank 1)"},
        Case{1 << 18, false, "MPI_Isend (send call 3 on this rank) to rank 1 (group rank 1)"},
        // Batched, rank 1 posts its third send before it stops at the receive: the small
        // message may still arrive, and rank 0 then waits in round 4.
        Case{16, true, "MPI_Irecv (recv call "},
        Case{1 << 18, true, "MPI_Isend (send call 3 on this rank) to rank 1 (group rank 1)"}}) {
    SCOPED_TRACE(fmt::format("{} elements{}", c.elements, c.batch ? ", batched" : ""));
    const Job job =
        RunJob(P2pHelper(4, c.elements, 5, c.batch), "rank=1,op=recv,call=3,action=stop");
    ExpectEndedCleanly(job, "mpusim: MPUSIM_FAULT: rank 1 (host ");
    EXPECT_LT(job.after_fault_s, kTimeoutS + kAbortSlackS) << job.output;
    const std::string line = WatchdogLine(job.output, 0);
    if (!line.empty()) {
      EXPECT_TRUE(Contains(line, c.waiting)) << line;
      EXPECT_TRUE(Contains(line, "rank 1 (group rank 1)")) << line;
      EXPECT_TRUE(Contains(line, "on world group [0, 1, 2, 3]")) << line;
    } else {  // a rank of the other pair aborted first, from the final barrier
      EXPECT_TRUE(Contains(job.output,
                           "MPI_Ibarrier (barrier call 1 on this rank) on world "
                           "group [0, 1, 2, 3]"))
          << job.output;
    }
  }
}

// (c) A rank killed in the middle of the step: Open MPI notices at once and ends the job.
TEST(FaultTest, RankKilledMidStepEndsTheJobAtOnce) {
  const Job job = RunJob(MpusimRun(4, kConfig, 60), "rank=2,op=reducescatter,call=2,action=kill");
  ExpectEndedCleanly(job, "mpusim: MPUSIM_FAULT: rank 2 (host ");
  EXPECT_LT(job.after_fault_s, kAbortSlackS) << job.output;
  EXPECT_TRUE(Contains(job.output, "signal 9")) << job.output;
}

// (d) A rank that exits (status 0) without MPI_Finalize: Open MPI ends the job, non-zero.
TEST(FaultTest, RankExitingWithoutFinalizeEndsTheJob) {
  const Job job = RunJob(MpusimRun(4, kConfig, 60), "rank=3,op=allgather,call=4,action=exit");
  ExpectEndedCleanly(job, "mpusim: MPUSIM_FAULT: rank 3 (host ");
  EXPECT_LT(job.after_fault_s, kAbortSlackS) << job.output;
}

// (e) An unexpected exception or an allocation failure on one rank: that rank ends the job
// with MPI_Abort and the distinct exit codes 4 and 3, one line each, no hang.
TEST(FaultTest, RankThrowingEndsTheJobWithTheInternalOrOutOfMemoryCode) {
  Job job = RunJob(MpusimRun(4, kConfig, 60), "rank=2,op=allreduce,call=2,action=throw");
  ExpectEndedCleanly(job, "mpusim: MPUSIM_FAULT: rank 2 (host ");
  EXPECT_EQ(job.exit_code, 4) << job.output;
  EXPECT_TRUE(Contains(job.output, "error: rank 2: internal error: MPUSIM_FAULT: injected "
                                   "failure before allreduce call 2"))
      << job.output;
  EXPECT_LT(job.after_fault_s, kAbortSlackS) << job.output;
  job = RunJob(MpusimRun(4, kConfig, 60), "rank=1,op=allgather,call=1,action=oom");
  ExpectEndedCleanly(job, "mpusim: MPUSIM_FAULT: rank 1 (host ");
  EXPECT_EQ(job.exit_code, 3) << job.output;
  EXPECT_TRUE(Contains(job.output, "error: rank 1: out of memory")) << job.output;
  EXPECT_LT(job.after_fault_s, kAbortSlackS) << job.output;
}

TEST(FaultTest, MalformedFaultAndTimeoutAreBadInput) {
  Job job = RunJob(MpusimRun(4, kConfig, kTimeoutS), "rank=1,op=allreduce,call=three,action=stop");
  EXPECT_EQ(job.exit_code, 2) << job.output;
  EXPECT_TRUE(Contains(job.output,
                       "error: MPUSIM_FAULT: 'rank=1,op=allreduce,call=three,"
                       "action=stop': call 'three' is not a number from 1"))
      << job.output;
  EXPECT_EQ(ErrorLines(job.output), 1) << job.output;

  for (const char* bad : {"0", "-1", "abc"}) {
    job = RunJob({MPUSIM_BINARY, "run", std::string(MPUSIM_SAMPLE_CONFIG_DIR) + "/" + kConfig,
                  "--timeout", bad},
                 "");
    EXPECT_EQ(job.exit_code, 2) << bad << ": " << job.output;
    EXPECT_TRUE(Contains(job.output, "--timeout")) << job.output;
  }
}

}  // namespace
