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
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <regex>
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

// Called with the output so far (after each read), the job's tag and mpiexec's pid: lets a test
// act on the job once a line shows where it is (send a signal).
using Watch = std::function<void(const std::string& output, const std::string& tag, pid_t)>;

// Runs `argv` with MPUSIM_FAULT=`fault` (unset when empty) and a tag of its own in the
// environment, collecting its output until it ends or kHardLimitS passes.
Job RunJob(const std::vector<std::string>& argv, const std::string& fault,
           const Watch& watch = {}) {
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
        if (watch) watch(job.output, tag, child);
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

// Interrupts (mpi/interrupt.h). A rank stops itself (MPUSIM_FAULT) inside the first training
// iteration, which proves the job is past its set-up; once the rank is seen stopped, the test
// sends the signal (to that rank, or to mpiexec) and lets the rank continue. Every run writes
// --dump, --trace and --summary into a directory of its own that must stay empty.

// The process of the job tagged `tag` that is world rank `rank` (Open MPI gives every rank
// OMPI_COMM_WORLD_RANK); -1 if there is none.
pid_t RankProcess(const std::string& tag, int rank) {
  const std::string mark = fmt::format("OMPI_COMM_WORLD_RANK={}", rank) + std::string(1, '\0');
  for (int pid : TaggedProcesses(tag)) {
    std::ifstream in(fmt::format("/proc/{}/environ", pid), std::ios::binary);
    const std::string environ((std::istreambuf_iterator<char>(in)), {});
    if (environ.find(std::string(1, '\0') + mark) != std::string::npos) return pid;
  }
  return -1;
}

// Whether `pid` is stopped (state T in /proc/PID/stat), waiting up to `seconds` for it: the
// fault line comes just before the rank's raise(SIGSTOP), and a SIGCONT sent before that
// would be lost.
bool WaitUntilStopped(pid_t pid, double seconds) {
  const Clock::time_point start = Clock::now();
  do {
    std::ifstream in(fmt::format("/proc/{}/stat", pid));
    const std::string stat((std::istreambuf_iterator<char>(in)), {});
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'T') {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } while (Since(start) < seconds);
  return false;
}

struct InterruptedJob {
  Job job;
  double after_signal_s = -1;  // from the signal to the end of the job; -1: never sent
  std::vector<std::string> left;  // what the job left in its output directory
};

// `ranks` ranks under mpiexec (0: one process without it) train for a million iterations;
// the faulty rank (2, or 0 alone) stops before its third all-reduce (inside iteration 1) and
// gets `signal`, or mpiexec gets it when `to_mpiexec`.
InterruptedJob RunInterrupted(int ranks, int signal, bool to_mpiexec) {
  const fs::path dir =
      fs::temp_directory_path() / fmt::format("mpusim-interrupt-test-{}", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::vector<std::string> argv = ranks > 0 ? Mpiexec(ranks) : std::vector<std::string>{};
  for (const std::string& a : std::vector<std::string>{
           MPUSIM_BINARY, "run", std::string(MPUSIM_SAMPLE_CONFIG_DIR) +
           "/lab_train_mlp_lm_t2_dp2_n4.json", "--train-iters", "1000000", "--timeout", "60",
           "--dump", (dir / "dump").string(), "--trace", (dir / "trace.json").string(),
           "--summary", (dir / "summary.json").string()}) {
    argv.push_back(a);
  }
  if (ranks == 0) {
    for (const char* a : {"--world-size", "1", "--tp", "1"}) argv.push_back(a);
  }
  const int faulty = ranks == 0 ? 0 : 2;
  InterruptedJob result;
  Clock::time_point signalled;
  bool acted = false;
  const Clock::time_point start = Clock::now();
  result.job = RunJob(
      argv, fmt::format("rank={},op=allreduce,call=3,action=stop", faulty),
      [&](const std::string& output, const std::string& tag, pid_t mpiexec) {
        if (acted || output.find("mpusim: MPUSIM_FAULT: rank") == std::string::npos) return;
        acted = true;  // once; without a signal the job runs on and the test fails
        const pid_t rank = ranks == 0 ? mpiexec : RankProcess(tag, faulty);
        if (rank < 0 || !WaitUntilStopped(rank, 10)) return;
        signalled = Clock::now();
        if (to_mpiexec) {
          ::kill(mpiexec, signal);
        } else {
          // To the rank's main thread, not the process: a process-directed signal to a stopped
          // process stays queued until SIGCONT, and then whichever of its threads wakes first
          // (Open MPI's and OpenBLAS's threads block nothing) runs the handler, possibly after
          // the main thread has passed the next safe point. A thread-directed one is handled by
          // the main thread as it resumes, before the safe point, so the verdict is the same on
          // every machine. (A user's kill still stops the run, one safe point later at worst.)
          ::syscall(SYS_tgkill, rank, rank, signal);
        }
        ::kill(rank, SIGCONT);
      });
  if (signalled != Clock::time_point()) {
    result.after_signal_s = result.job.total_s - std::chrono::duration<double>(
                                                     signalled - start).count();
    std::printf("[ timing   ] %.2f s from the signal to the end\n", result.after_signal_s);
  }
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    result.left.push_back(entry.path().filename().string());
  }
  fs::remove_all(dir);
  return result;
}

int Count(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// SIGINT or SIGTERM to one rank of four, or to one process without mpirun: every rank stops
// after the iteration it is in, one line says so, the job exits 128 + the signal (mpirun
// passes the ranks' code on), and nothing is written.
TEST(FaultTest, InterruptedRankStopsEveryRankWithTheSignalsExitCode) {
  for (const int ranks : {4, 0}) {
    for (const int signal : {SIGINT, SIGTERM}) {
      SCOPED_TRACE(fmt::format("{} to {}", signal == SIGINT ? "SIGINT" : "SIGTERM",
                               ranks == 0 ? "a run without mpirun" : "rank 2 of 4"));
      const InterruptedJob run = RunInterrupted(ranks, signal, /*to_mpiexec=*/false);
      const Job& job = run.job;
      ExpectEndedCleanly(job, "mpusim: MPUSIM_FAULT: rank ");
      EXPECT_EQ(job.exit_code, 128 + signal) << job.output;
      EXPECT_EQ(Count(job.output, "mpusim: interrupted:"), 1) << job.output;
      EXPECT_TRUE(Contains(
          job.output,
          fmt::format("mpusim: interrupted: rank {} got {}; every rank stopped {} of 1000000; no "
                      "dump, trace or summary written; exit code {}\n",
                      ranks == 0 ? 0 : 2, signal == SIGINT ? "SIGINT" : "SIGTERM",
                      // Alone, a rank has no tp or dp all-reduce: its third is the safe point's.
                      ranks == 0 ? "before iteration 2" : "after iteration 1", 128 + signal)))
          << job.output;
      EXPECT_GE(run.after_signal_s, 0) << "the test never sent the signal:\n" << job.output;
      EXPECT_LT(run.after_signal_s, kAbortSlackS) << job.output;
      EXPECT_EQ(run.left, std::vector<std::string>()) << "an interrupted run wrote these";
    }
  }
}

// Ctrl-C or kill to mpirun itself: Open MPI's mpirun sends SIGTERM to every rank and exits 1,
// whatever the ranks return (its code, not mpusim's). The ranks still stop at a safe point,
// say why in one line, and write nothing.
TEST(FaultTest, InterruptedMpirunExitsOneButTheRanksSayWhy) {
  for (const int signal : {SIGINT, SIGTERM}) {
    SCOPED_TRACE(signal == SIGINT ? "SIGINT to mpiexec" : "SIGTERM to mpiexec");
    const InterruptedJob run = RunInterrupted(4, signal, /*to_mpiexec=*/true);
    const Job& job = run.job;
    ExpectEndedCleanly(job, "mpusim: MPUSIM_FAULT: rank 2 ");
    EXPECT_EQ(job.exit_code, 1) << job.output;
    EXPECT_EQ(Count(job.output, "mpusim: interrupted:"), 1) << job.output;
    // mpirun's SIGTERMs reach the ranks one by one: which rank names itself, and whether the
    // safe point is before or after an iteration, depends on when they arrive.
    EXPECT_TRUE(std::regex_search(
        job.output,
        std::regex("mpusim: interrupted: rank [0-3] got SIGTERM from mpirun; every rank stopped "
                   "(before|after) iteration [0-9]+ of 1000000; no dump, trace or summary "
                   "written; exit code 143 \\(mpirun, itself interrupted, exits 1\\)\n")))
        << job.output;
    EXPECT_GE(run.after_signal_s, 0) << "the test never sent the signal:\n" << job.output;
    EXPECT_LT(run.after_signal_s, kAbortSlackS) << job.output;
    EXPECT_EQ(run.left, std::vector<std::string>()) << "an interrupted run wrote these";
  }
}

}  // namespace
