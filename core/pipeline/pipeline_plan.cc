// The transfers of a pipeline step and their check (see pipeline_plan.h).
#include "core/pipeline/pipeline_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>

namespace mpusim {

namespace {

// The transfers a step needs before it runs (recv) and produces after it (send).
struct StepTransfers {
  std::optional<Transfer> recv;
  std::optional<Transfer> send;
};

StepTransfers TransfersOf(const ScheduleStep& step, int64_t pp_rank, int64_t p, int64_t v) {
  const int64_t stage = step.model_chunk * p + pp_rank;
  const int64_t last = p * v - 1;
  const int64_t next_rank = (pp_rank + 1) % p;
  const int64_t prev_rank = (pp_rank + p - 1) % p;
  // The chunk of the neighbouring virtual stage: stage +- 1 on the next or previous rank.
  const int64_t next_chunk = (stage + 1) / p;
  const int64_t prev_chunk = (stage - 1 + p) / p - 1;  // (stage - 1) / p, for stage >= 1
  StepTransfers t;
  if (step.pass == Pass::kForward) {
    if (stage > 0) {
      t.recv = Transfer{false, Transfer::Kind::kActivation, step.model_chunk, step.microbatch,
                        prev_rank};
    }
    if (stage < last) {
      t.send = Transfer{true, Transfer::Kind::kActivation, next_chunk, step.microbatch, next_rank};
    }
  } else {
    if (stage < last) {
      t.recv =
          Transfer{false, Transfer::Kind::kGradient, step.model_chunk, step.microbatch, next_rank};
    }
    if (stage > 0) {
      t.send = Transfer{true, Transfer::Kind::kGradient, prev_chunk, step.microbatch, prev_rank};
    }
  }
  return t;
}

// What a message carries, to match a send with its receive.
struct Payload {
  Transfer::Kind kind;
  int64_t model_chunk;
  int64_t microbatch;
  bool operator==(const Payload&) const = default;
};

}  // namespace

std::string FormatTransfer(const Transfer& t) {
  return fmt::format("{} {} c{}.m{} {} {}{}", t.send ? "send" : "recv",
                     t.kind == Transfer::Kind::kActivation ? "activation" : "gradient",
                     t.model_chunk, t.microbatch, t.send ? "to" : "from", t.peer,
                     t.wait ? "" : " (async)");
}

namespace {

PipelinePlan Plan(const PipelineSchedule& schedule, bool wait_for_sends) {
  const int64_t p = schedule.pipeline_model_parallel_size;
  const int64_t v = schedule.num_model_chunks;
  PipelinePlan plan(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) {
    std::vector<PlanAction>& actions = plan[static_cast<size_t>(r)];
    std::vector<Transfer> pending;  // the sends of the previous step
    for (const ScheduleStep& step : schedule.per_rank[static_cast<size_t>(r)]) {
      const StepTransfers t = TransfersOf(step, r, p, v);
      PlanAction action;
      action.batch = std::move(pending);
      pending.clear();
      if (t.recv) action.batch.push_back(*t.recv);
      action.step = step;
      actions.push_back(std::move(action));
      if (t.send) {
        pending.push_back(*t.send);
        pending.back().wait = wait_for_sends;
      }
    }
    actions.push_back(PlanAction{std::move(pending), std::nullopt});
  }
  return plan;
}

}  // namespace

PipelinePlan PlanPipelineTransfers(const PipelineSchedule& schedule) {
  return Plan(schedule, false);
}

PipelinePlan PlanBlockingPairs(const PipelineSchedule& schedule) { return Plan(schedule, true); }

PipelinePlan PlanLockstepRounds(const PipelineSchedule& schedule) {
  const int64_t p = schedule.pipeline_model_parallel_size;
  const int64_t v = schedule.num_model_chunks;
  const auto ranks = static_cast<size_t>(p);
  PipelinePlan plan(ranks);
  std::vector<size_t> next(ranks, 0);                     // each rank's next schedule step
  std::vector<std::set<std::tuple<int, int64_t, int64_t>>> arrived(ranks);  // (kind, chunk, mb)
  std::vector<std::vector<Transfer>> batch(ranks);       // the current round's transfers
  size_t left = 0;
  for (const auto& row : schedule.per_rank) left += row.size();
  // Every round runs at least one step of a schedule whose order respects the dataflow;
  // the bound only turns a schedule that does not into an error instead of a hang.
  const size_t max_rounds = 2 * left + 2;
  for (size_t round = 0; left > 0; ++round) {
    if (round == max_rounds) {
      throw std::logic_error("PlanLockstepRounds: the schedule's order does not respect the "
                             "dataflow (no step can run)");
    }
    std::vector<std::pair<size_t, Transfer>> sends;  // (sender, the send to its receiver)
    for (size_t r = 0; r < ranks; ++r) {
      PlanAction action;
      action.batch = std::move(batch[r]);
      batch[r].clear();
      const std::vector<ScheduleStep>& row = schedule.per_rank[r];
      if (next[r] < row.size()) {
        const ScheduleStep& step = row[next[r]];
        const StepTransfers t = TransfersOf(step, static_cast<int64_t>(r), p, v);
        const bool ready =
            !t.recv || arrived[r].erase({static_cast<int>(t.recv->kind), t.recv->model_chunk,
                                         t.recv->microbatch}) == 1;
        if (ready) {
          action.step = step;
          ++next[r];
          --left;
          if (t.send) sends.emplace_back(r, *t.send);
        }
      }
      // A round with neither transfers nor a step is no action at all.
      if (!action.batch.empty() || action.step) plan[r].push_back(std::move(action));
    }
    // This round's messages travel in the next batch of both sides: one message per sender
    // at most, so no pair of ranks exchanges two in one direction within a batch.
    for (const auto& [from, send] : sends) {
      const auto to = static_cast<size_t>(send.peer);
      Transfer recv = send;
      recv.send = false;
      recv.peer = static_cast<int64_t>(from);
      batch[from].push_back(send);
      batch[to].push_back(recv);
      arrived[to].insert({static_cast<int>(send.kind), send.model_chunk, send.microbatch});
    }
    for (std::vector<Transfer>& transfers : batch) {  // sends first, as in the other plans
      std::stable_partition(transfers.begin(), transfers.end(),
                            [](const Transfer& t) { return t.send; });
    }
  }
  for (size_t r = 0; r < ranks; ++r) {
    plan[r].push_back(PlanAction{std::move(batch[r]), std::nullopt});
  }
  return plan;
}

std::string CheckPipelinePlan(const PipelinePlan& plan, Matching matching) {
  const size_t p = plan.size();
  // (sender, receiver, tag): the tag is (kind, chunk) when matching by tag, else empty.
  using Pair = std::tuple<size_t, size_t, int, int64_t>;
  // Per pair: the payloads posted so far as sends and as receives, in order.
  std::map<Pair, std::vector<Payload>> sent, received;
  std::vector<size_t> at(p, 0);  // each rank's current action
  // Per rank: for each message of its current batch, its pair and its index in the pair.
  std::vector<std::vector<std::pair<Pair, size_t>>> positions(p);
  auto post_indexed = [&](size_t r) {
    positions[r].clear();
    for (const Transfer& t : plan[r][at[r]].batch) {
      const auto peer = static_cast<size_t>(t.peer);
      const Payload payload{t.kind, t.model_chunk, t.microbatch};
      const bool tagged = matching == Matching::kTagged;
      const int kind = tagged ? static_cast<int>(t.kind) : -1;
      const int64_t chunk = tagged ? t.model_chunk : -1;
      // Within one (kind, chunk) both sides list the micro-batches in one order; the
      // payload check below would catch it if they did not.
      const Pair pair =
          t.send ? Pair{r, peer, kind, chunk} : Pair{peer, r, kind, chunk};
      std::vector<Payload>& list = t.send ? sent[pair] : received[pair];
      positions[r].push_back({pair, list.size()});
      list.push_back(payload);
    }
  };
  for (size_t r = 0; r < p; ++r) {
    if (!plan[r].empty()) post_indexed(r);
  }
  size_t finished = 0;
  for (size_t r = 0; r < p; ++r) finished += plan[r].empty() ? 1u : 0u;
  while (finished < p) {
    bool progressed = false;
    for (size_t r = 0; r < p; ++r) {
      if (at[r] >= plan[r].size()) continue;
      const bool final_action = at[r] + 1 == plan[r].size();
      // What must be complete now: the waited transfers of this batch; at the end, every
      // send this rank has posted.
      std::vector<std::pair<std::pair<Pair, size_t>, bool>> needed;  // (position, is send)
      const std::vector<Transfer>& batch = plan[r][at[r]].batch;
      for (size_t k = 0; k < batch.size(); ++k) {
        if (batch[k].wait) needed.push_back({positions[r][k], batch[k].send});
      }
      if (final_action) {
        for (const auto& [pair, list] : sent) {
          if (std::get<0>(pair) != r) continue;
          for (size_t index = 0; index < list.size(); ++index)
            needed.push_back({{pair, index}, true});
        }
      }
      bool ready = true;
      for (size_t k = 0; k < needed.size() && ready; ++k) {
        const auto& [position, is_send] = needed[k];
        const auto& [pair, index] = position;
        // The other side must have posted its index-th message of this pair.
        ready = is_send ? received[pair].size() > index : sent[pair].size() > index;
        if (ready) {
          const Payload& a = sent[pair][index];
          const Payload& b = received[pair][index];
          if (!(a == b)) {
            return fmt::format(
                "mismatch: message {} from rank {} to rank {} is sent as {} c{}.m{} "
                "but received as {} c{}.m{}",
                index, std::get<0>(pair), std::get<1>(pair),
                a.kind == Transfer::Kind::kActivation ? "activation" : "gradient", a.model_chunk,
                a.microbatch, b.kind == Transfer::Kind::kActivation ? "activation" : "gradient",
                b.model_chunk, b.microbatch);
          }
        }
      }
      if (!ready) continue;
      progressed = true;
      ++at[r];
      if (at[r] < plan[r].size()) {
        post_indexed(r);
      } else {
        ++finished;
      }
    }
    if (!progressed) {
      std::string waits;
      for (size_t r = 0; r < p; ++r) {
        if (at[r] >= plan[r].size()) continue;
        const PlanAction& action = plan[r][at[r]];
        waits += fmt::format("{}rank {} waits at action {} ({})", waits.empty() ? "" : ", ", r,
                             at[r], action.step ? FormatStep(*action.step) : "final sends");
      }
      return "deadlock: " + waits;
    }
  }
  for (const auto& [pair, list] : sent) {
    if (received[pair].size() != list.size()) {
      return fmt::format("rank {} sends {} messages to rank {}, which receives {}",
                         std::get<0>(pair), list.size(), std::get<1>(pair), received[pair].size());
    }
  }
  for (const auto& [pair, list] : received) {
    if (sent[pair].size() != list.size()) {
      return fmt::format("rank {} receives {} messages from rank {}, which sends {}",
                         std::get<1>(pair), list.size(), std::get<0>(pair), sent[pair].size());
    }
  }
  return "";
}

std::vector<RankPipelinePlans> PlanPipelineRanks(const PipelineSchedule& schedule) {
  PipelinePlan in_flight = PlanPipelineTransfers(schedule);
  PipelinePlan lockstep = PlanLockstepRounds(schedule);
  std::vector<RankPipelinePlans> ranks(in_flight.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    ranks[r] = {std::move(in_flight[r]), std::move(lockstep[r])};
  }
  return ranks;
}

int TransferTag(const Transfer& transfer) {
  return static_cast<int>(transfer.model_chunk * 2 +
                          (transfer.kind == Transfer::Kind::kGradient ? 1 : 0));
}

}  // namespace mpusim
