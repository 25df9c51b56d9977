// The communication watchdog (see watchdog.h).
#include "mpi/watchdog.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <new>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "mpi/mpi_check.h"

namespace mpusim {
namespace {

// Polling (see watchdog.h): back-to-back tests for kSpinSeconds, then tests with sched_yield
// between them until kYieldSeconds, then tests with sleeps of a hundredth of the time waited so
// far in between, within [kMinSleepSeconds, kMaxSleepSeconds]. Spinning 200 us before
// yielding kept the 8-rank step of lab_mlp_lm_t4_dp2_n8 (27 small collectives) as fast as
// blocking MPI; yielding after 50 us made it about 1.5 times slower, and sleeping 20 us from
// the start 3 times slower. The sleeps stay short while a wait is short because a
// non-blocking collective advances only inside MPI_Test: each of its rounds may wait one sleep.
constexpr double kSpinSeconds = 200e-6;
constexpr double kYieldSeconds = 2e-3;
constexpr double kMinSleepSeconds = 200e-6;
constexpr double kMaxSleepSeconds = 10e-3;

constexpr size_t kNumOps = static_cast<size_t>(WatchedOp::kAny) + 1;

constexpr std::array<const char*, kNumOps> kOpNames = {
    "allreduce", "allgather", "reducescatter", "broadcast", "alltoall", "reduce",
    "barrier",   "split",     "send",          "recv",      "any"};

// Per process, like MPI_COMM_WORLD itself: the timeout, the armed fault and the number of
// watched calls so far (per operation; the kAny slot counts all of them).
struct WatchdogState {
  double timeout_s = kDefaultCommTimeoutS;
  std::optional<FaultSpec> fault;
  int world_rank = -1;  // this process's, once a fault is armed
  std::array<int64_t, kNumOps> calls{};
};

WatchdogState& State() {
  static WatchdogState state;
  return state;
}

// One watched call, as the watchdog's line names it.
struct Watched {
  WatchedOp op;
  const char* mpi_name;  // the non-blocking call waited for, e.g. "MPI_Iallreduce"
  const CommLabel& label;
  int peer = -1;  // group rank of the other side (point-to-point only)
};

std::string PeerText(const Watched& w) {
  if (w.peer < 0) return "";
  const size_t index = static_cast<size_t>(w.peer);
  const std::string world =
      index < w.label.world_ranks.size() ? std::to_string(w.label.world_ranks[index]) : "?";
  return fmt::format(" {} rank {} (group rank {})", w.op == WatchedOp::kSend ? "to" : "from", world,
                     w.peer);
}

[[noreturn]] void Expire(const Watched& w, int64_t call, double waited_s) {
  const ProcessPlace place = WhereAmI();
  AbortJob(fmt::format(
      "mpusim: watchdog: rank {} (host {}) waited {:.1f} s for {} ({} call {} on this rank){} "
      "on {}; a rank of the group is stopped, hung or far behind. Timeout {:g} s (change it "
      "with mpusim run --timeout SECONDS); aborting the job",
      place.world_rank, place.host, waited_s, w.mpi_name, kOpNames[static_cast<size_t>(w.op)], call,
      PeerText(w), DescribeGroup(w.label), State().timeout_s));
}

void CheckCode(int code, const Watched& w, int line) {
  if (code == MPI_SUCCESS) return;
  const std::string statement =
      fmt::format("{}{} on {}", w.mpi_name, PeerText(w), DescribeGroup(w.label));
  MpiFatal(statement.c_str(), code, __FILE__, line, "watched call");
}

void InjectFault(const FaultSpec& fault, WatchedOp op, int64_t call) {
  const ProcessPlace place = WhereAmI();
  static constexpr const char* kWhat[] = {"stops itself (SIGSTOP)", "kills itself (SIGKILL)",
                                          "exits without MPI_Finalize",
                                          "throws std::runtime_error",
                                          "throws std::bad_alloc"};
  std::fprintf(stderr, "mpusim: MPUSIM_FAULT: rank %d (host %s) %s before %s call %lld\n",
               place.world_rank, place.host.c_str(), kWhat[static_cast<size_t>(fault.action)],
               kOpNames[static_cast<size_t>(op)], static_cast<long long>(call));
  std::fflush(stderr);
  switch (fault.action) {
    case FaultAction::kStop:
      raise(SIGSTOP);
      break;
    case FaultAction::kKill:
      raise(SIGKILL);
      break;
    case FaultAction::kExit:
      _exit(0);
    case FaultAction::kThrow:
      throw std::runtime_error(fmt::format("MPUSIM_FAULT: injected failure before {} call {}",
                                           kOpNames[static_cast<size_t>(op)], call));
    case FaultAction::kOutOfMemory:
      throw std::bad_alloc();
  }
}

// Counts the call and fires the armed fault if this is its call; returns the call's number
// among this process's calls of `op`.
int64_t CountCall(WatchedOp op) {
  WatchdogState& state = State();
  const int64_t call = ++state.calls[static_cast<size_t>(op)];
  const int64_t any_call = ++state.calls[static_cast<size_t>(WatchedOp::kAny)];
  if (state.fault.has_value() && state.fault->world_rank == state.world_rank) {
    const FaultSpec& fault = *state.fault;
    if ((fault.op == WatchedOp::kAny && any_call == fault.call) ||
        (fault.op == op && call == fault.call)) {
      InjectFault(fault, op, call);
    }
  }
  return call;
}

// Between two polls of a call that has waited `waited_s`: nothing, a yield, or a sleep.
void Pause(double waited_s) {
  if (waited_s >= kYieldSeconds) {
    std::this_thread::sleep_for(std::chrono::duration<double>(
        std::clamp(waited_s / 100, kMinSleepSeconds, kMaxSleepSeconds)));
  } else if (waited_s >= kSpinSeconds) {
    sched_yield();
  }
}

// Polls `request` until it completes; past the timeout, Expire.
void Wait(MPI_Request* request, const Watched& w, int64_t call, MPI_Status* status) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  const double timeout_s = State().timeout_s;
  while (true) {
    int done = 0;
    CheckCode(MPI_Test(request, &done, status), w, __LINE__);
    if (done != 0) return;
    const double waited_s = std::chrono::duration<double>(Clock::now() - start).count();
    if (waited_s >= timeout_s) Expire(w, call, waited_s);
    Pause(waited_s);
  }
}

// Counts the call, starts it (`start` posts the non-blocking operation into its request) and
// waits for it.
template <typename Start>
void Run(const Watched& w, Start&& start, MPI_Status* status = MPI_STATUS_IGNORE) {
  const int64_t call = CountCall(w.op);
  MPI_Request request = MPI_REQUEST_NULL;
  CheckCode(start(&request), w, __LINE__);
  Wait(&request, w, call, status);
}

Status FaultError(std::string_view text, const std::string& what) {
  return Status::Error("MPUSIM_FAULT",
                       fmt::format("'{}': {}; expected rank=R,op=OP,call=N,action=stop|kill|exit|throw|oom "
                                   "with OP one of {}",
                                   text, what, fmt::join(kOpNames, "|")));
}

std::optional<int64_t> ParseInteger(std::string_view text) {
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

}  // namespace

void SetCommTimeout(double seconds) {
  if (!std::isfinite(seconds) || seconds <= 0) {
    throw std::invalid_argument(
        fmt::format("SetCommTimeout: {} is not a positive number of seconds", seconds));
  }
  State().timeout_s = seconds;
}

double CommTimeout() { return State().timeout_s; }

CommLabel LabelOf(MPI_Comm comm, std::string kind) {
  MPI_Group group = MPI_GROUP_NULL;
  MPI_Group world_group = MPI_GROUP_NULL;
  MPUSIM_MPI_CHECK(MPI_Comm_group(comm, &group));
  MPUSIM_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  int size = 0;
  MPUSIM_MPI_CHECK(MPI_Group_size(group, &size));
  std::vector<int> group_ranks(static_cast<size_t>(size));
  std::iota(group_ranks.begin(), group_ranks.end(), 0);
  CommLabel label{std::move(kind), std::vector<int>(group_ranks.size())};
  MPUSIM_MPI_CHECK(MPI_Group_translate_ranks(group, size, group_ranks.data(), world_group,
                                             label.world_ranks.data()));
  MPUSIM_MPI_CHECK(MPI_Group_free(&group));
  MPUSIM_MPI_CHECK(MPI_Group_free(&world_group));
  return label;
}

const CommLabel& WorldLabel() {
  static const CommLabel label = LabelOf(MPI_COMM_WORLD, "world");
  return label;
}

std::string DescribeGroup(const CommLabel& label) {
  const std::vector<int>& ranks = label.world_ranks;
  if (ranks.size() <= 8) return fmt::format("{} group [{}]", label.kind, fmt::join(ranks, ", "));
  return fmt::format("{} group [{}, ..., {}] ({} ranks)", label.kind,
                     fmt::join(ranks.begin(), ranks.begin() + 4, ", "),
                     fmt::join(ranks.end() - 2, ranks.end(), ", "), ranks.size());
}

const char* WatchedOpName(WatchedOp op) { return kOpNames[static_cast<size_t>(op)]; }

StatusOr<FaultSpec> ParseFaultSpec(std::string_view text) {
  std::map<std::string, std::string, std::less<>> fields;
  for (size_t start = 0; start <= text.size();) {
    size_t end = text.find(',', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view field = text.substr(start, end - start);
    const size_t equals = field.find('=');
    if (equals == std::string_view::npos) {
      return FaultError(text, fmt::format("'{}' is not key=value", field));
    }
    const std::string key(field.substr(0, equals));
    if (key != "rank" && key != "op" && key != "call" && key != "action") {
      return FaultError(text, fmt::format("unknown key '{}'", key));
    }
    if (!fields.emplace(key, field.substr(equals + 1)).second) {
      return FaultError(text, fmt::format("'{}' is given twice", key));
    }
    start = end + 1;
  }
  for (const char* key : {"rank", "op", "call", "action"}) {
    if (fields.count(key) == 0) return FaultError(text, fmt::format("'{}' is missing", key));
  }
  FaultSpec spec;
  const std::optional<int64_t> rank = ParseInteger(fields["rank"]);
  if (!rank.has_value() || *rank < 0 || *rank > INT32_MAX) {
    return FaultError(text, fmt::format("rank '{}' is not a world rank", fields["rank"]));
  }
  spec.world_rank = static_cast<int>(*rank);
  const auto op = std::find(kOpNames.begin(), kOpNames.end(), fields["op"]);
  if (op == kOpNames.end()) {
    return FaultError(text, fmt::format("unknown op '{}'", fields["op"]));
  }
  spec.op = static_cast<WatchedOp>(op - kOpNames.begin());
  const std::optional<int64_t> call = ParseInteger(fields["call"]);
  if (!call.has_value() || *call < 1) {
    return FaultError(text, fmt::format("call '{}' is not a number from 1", fields["call"]));
  }
  spec.call = *call;
  const std::string& action = fields["action"];
  if (action == "stop") {
    spec.action = FaultAction::kStop;
  } else if (action == "kill") {
    spec.action = FaultAction::kKill;
  } else if (action == "exit") {
    spec.action = FaultAction::kExit;
  } else if (action == "throw") {
    spec.action = FaultAction::kThrow;
  } else if (action == "oom") {
    spec.action = FaultAction::kOutOfMemory;
  } else {
    return FaultError(text, fmt::format("unknown action '{}'", action));
  }
  return spec;
}

Status ArmFaultInjection() {
  WatchdogState& state = State();
  state.fault.reset();
  const char* text = std::getenv("MPUSIM_FAULT");
  if (text == nullptr || text[0] == '\0') return Status();
  StatusOr<FaultSpec> spec = ParseFaultSpec(text);
  if (!spec.ok()) return spec.status();
  int world_size = 0;
  MPUSIM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &state.world_rank));
  MPUSIM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  if (spec->world_rank >= world_size) {
    return FaultError(text, fmt::format("rank {} is not a rank of this job ({} ranks)",
                                        spec->world_rank, world_size));
  }
  state.fault = *spec;
  return Status();
}

namespace watched {

void Allreduce(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
               const CommLabel& label) {
  Run({WatchedOp::kAllReduce, "MPI_Iallreduce", label}, [&](MPI_Request* request) {
    return MPI_Iallreduce(send, recv, count, type, op, comm, request);
  });
}

void Allgather(const void* send, int send_count, MPI_Datatype send_type, void* recv, int recv_count,
               MPI_Datatype recv_type, MPI_Comm comm, const CommLabel& label) {
  Run({WatchedOp::kAllGather, "MPI_Iallgather", label}, [&](MPI_Request* request) {
    return MPI_Iallgather(send, send_count, send_type, recv, recv_count, recv_type, comm, request);
  });
}

void Allgatherv(const void* send, int send_count, MPI_Datatype send_type, void* recv,
                const int recv_counts[], const int displacements[], MPI_Datatype recv_type,
                MPI_Comm comm, const CommLabel& label) {
  Run({WatchedOp::kAllGather, "MPI_Iallgatherv", label}, [&](MPI_Request* request) {
    return MPI_Iallgatherv(send, send_count, send_type, recv, recv_counts, displacements, recv_type,
                           comm, request);
  });
}

void Alltoall(const void* send, int send_count, MPI_Datatype send_type, void* recv, int recv_count,
              MPI_Datatype recv_type, MPI_Comm comm, const CommLabel& label) {
  Run({WatchedOp::kAllToAll, "MPI_Ialltoall", label}, [&](MPI_Request* request) {
    return MPI_Ialltoall(send, send_count, send_type, recv, recv_count, recv_type, comm, request);
  });
}

void Alltoallv(const void* send, const int send_counts[], const int send_displacements[],
               MPI_Datatype send_type, void* recv, const int recv_counts[],
               const int recv_displacements[], MPI_Datatype recv_type, MPI_Comm comm,
               const CommLabel& label) {
  Run({WatchedOp::kAllToAll, "MPI_Ialltoallv", label}, [&](MPI_Request* request) {
    return MPI_Ialltoallv(send, send_counts, send_displacements, send_type, recv, recv_counts,
                          recv_displacements, recv_type, comm, request);
  });
}

void Bcast(void* buffer, int count, MPI_Datatype type, int root, MPI_Comm comm,
           const CommLabel& label) {
  Run({WatchedOp::kBroadcast, "MPI_Ibcast", label},
      [&](MPI_Request* request) { return MPI_Ibcast(buffer, count, type, root, comm, request); });
}

void Reduce(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op, int root,
            MPI_Comm comm, const CommLabel& label) {
  Run({WatchedOp::kReduce, "MPI_Ireduce", label}, [&](MPI_Request* request) {
    return MPI_Ireduce(send, recv, count, type, op, root, comm, request);
  });
}

void ReduceScatterBlock(const void* send, void* recv, int recv_count, MPI_Datatype type, MPI_Op op,
                        MPI_Comm comm, const CommLabel& label) {
  Run({WatchedOp::kReduceScatter, "MPI_Ireduce_scatter_block", label}, [&](MPI_Request* request) {
    return MPI_Ireduce_scatter_block(send, recv, recv_count, type, op, comm, request);
  });
}

void Barrier(MPI_Comm comm, const CommLabel& label) {
  Run({WatchedOp::kBarrier, "MPI_Ibarrier", label},
      [&](MPI_Request* request) { return MPI_Ibarrier(comm, request); });
}

MPI_Comm CommSplit(MPI_Comm comm, int color, int key, const CommLabel& label) {
  Run({WatchedOp::kSplit, "MPI_Ibarrier (before MPI_Comm_split)", label},
      [&](MPI_Request* request) { return MPI_Ibarrier(comm, request); });
  MPI_Comm out = MPI_COMM_NULL;
  MPUSIM_MPI_CHECK(MPI_Comm_split(comm, color, key, &out));
  return out;
}

MPI_Comm CommDup(MPI_Comm comm, const CommLabel& label) {
  MPI_Comm out = MPI_COMM_NULL;
  Run({WatchedOp::kSplit, "MPI_Comm_idup", label},
      [&](MPI_Request* request) { return MPI_Comm_idup(comm, &out, request); });
  return out;
}

void Send(const void* buffer, int count, MPI_Datatype type, int peer, int tag, MPI_Comm comm,
          const CommLabel& label) {
  Run({WatchedOp::kSend, "MPI_Isend", label, peer}, [&](MPI_Request* request) {
    return MPI_Isend(buffer, count, type, peer, tag, comm, request);
  });
}

int Recv(void* buffer, int count, MPI_Datatype type, int peer, int tag, MPI_Comm comm,
         const CommLabel& label) {
  MPI_Status status;
  const Watched w{WatchedOp::kRecv, "MPI_Irecv", label, peer};
  Run(
      w,
      [&](MPI_Request* request) {
        return MPI_Irecv(buffer, count, type, peer, tag, comm, request);
      },
      &status);
  int received = 0;
  CheckCode(MPI_Get_count(&status, type, &received), w, __LINE__);
  return received;
}

struct PendingMessages::Impl {
  std::vector<Message> messages;
  std::vector<Watched> watches;
  std::vector<int64_t> calls;
  std::vector<MPI_Request> requests;
  bool waited = false;
};

PendingMessages::PendingMessages() = default;
PendingMessages::PendingMessages(PendingMessages&&) noexcept = default;
PendingMessages& PendingMessages::operator=(PendingMessages&& other) noexcept {
  if (this != &other) {
    if (state_ != nullptr && !state_->waited) Wait();
    state_ = std::move(other.state_);
  }
  return *this;
}
PendingMessages::~PendingMessages() {
  if (state_ != nullptr && !state_->waited) Wait();
}

PendingMessages PostMessages(const std::vector<Message>& messages, MPI_Comm comm,
                             const CommLabel& label) {
  PendingMessages pending;
  pending.state_ = std::make_unique<PendingMessages::Impl>();
  PendingMessages::Impl& s = *pending.state_;
  const size_t n = messages.size();
  s.messages = messages;
  s.watches.reserve(n);
  s.calls.resize(n);
  s.requests.assign(n, MPI_REQUEST_NULL);
  for (size_t i = 0; i < n; ++i) {
    const Message& m = messages[i];
    s.watches.push_back(Watched{m.send ? WatchedOp::kSend : WatchedOp::kRecv,
                                m.send ? "MPI_Isend" : "MPI_Irecv", label, m.peer});
    s.calls[i] = CountCall(s.watches[i].op);
    CheckCode(m.send ? MPI_Isend(m.buffer, m.count, m.type, m.peer, m.tag, comm, &s.requests[i])
                     : MPI_Irecv(m.buffer, m.count, m.type, m.peer, m.tag, comm, &s.requests[i]),
              s.watches[i], __LINE__);
  }
  return pending;
}

std::vector<int> PendingMessages::Wait() {
  if (state_ == nullptr || state_->waited) return {};
  Impl& s = *state_;
  s.waited = true;
  const size_t n = s.messages.size();
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  const double timeout_s = State().timeout_s;
  std::vector<MPI_Status> statuses(n);
  std::vector<bool> done(n, false);
  size_t remaining = n;
  while (remaining > 0) {
    size_t first_pending = n;
    for (size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      int complete = 0;
      CheckCode(MPI_Test(&s.requests[i], &complete, &statuses[i]), s.watches[i], __LINE__);
      if (complete != 0) {
        done[i] = true;
        --remaining;
      } else if (first_pending == n) {
        first_pending = i;
      }
    }
    if (remaining == 0) break;
    const double waited_s = std::chrono::duration<double>(Clock::now() - start).count();
    if (waited_s >= timeout_s) Expire(s.watches[first_pending], s.calls[first_pending], waited_s);
    Pause(waited_s);
  }
  std::vector<int> received(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (s.messages[i].send) continue;
    CheckCode(MPI_Get_count(&statuses[i], s.messages[i].type, &received[i]), s.watches[i],
              __LINE__);
  }
  return received;
}

std::vector<int> SendRecvBatch(const std::vector<Message>& messages, MPI_Comm comm,
                               const CommLabel& label) {
  return PostMessages(messages, comm, label).Wait();
}

}  // namespace watched

void FinalizeWatched() {
  watched::Barrier(MPI_COMM_WORLD, WorldLabel());
  MPUSIM_MPI_CHECK(MPI_Finalize());
}

}  // namespace mpusim
