// Overlapped rounds of the worker agent (paper 004): a round's push and the pull of the next
// round's base run on a background thread while the next round trains.
#include <future>
#include <optional>
#include <utility>

#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cpu/outer_kernels.h"
#include "worker/agent.h"

namespace aloe::worker {

// What the background half of an overlapped round did: the previous round's push, the
// look-ahead task and the pull of its base.
struct Agent::Communicated {
  std::optional<absl::StatusOr<v1::PushReply>> push;
  uint64_t pushed = 0;
  absl::StatusOr<v1::Task> next = absl::UnknownError("not asked");
  std::vector<std::vector<float>> base;
  uint64_t pulled = 0;
};

// A trained round whose push is still to come: in the background while the next round trains,
// or at once when no round follows.
struct Agent::Pending {
  v1::Task task;
  v1::PushHeader header;
  std::vector<std::vector<float>> delta;
  TrainStats stats;
  uint64_t pulled = 0;
  double train = 0;    // its training time
  double seconds = 0;  // its training time plus the waits for the network
  double blocked = 0;  // of which waiting for the network
};

Agent::Communicated Agent::Communicate(const v1::PushHeader* header,
                                       std::vector<std::vector<float>>* delta) {
  Communicated c;
  if (header != nullptr) c.push = session_.Push(*header, *delta, &c.pushed);
  const bool pushed = !c.push.has_value() || c.push->ok();
  if (env_.control == nullptr) {
    if (!pushed) return c;
    c.next = session_.RequestTask(/*ahead=*/true, /*given_up_task_id=*/0);
  } else {
    c.next = AskAheadAsNode(pushed);
  }
  if (c.next.ok() && c.next->kind() == v1::Task::TRAIN) {
    absl::Status pulled = session_.Pull(c.next->base_version(), &c.base, &c.pulled).status();
    if (!pulled.ok()) {
      c.next = pulled;
    } else {
      session_.ReportPulled(*c.next);
    }
  }
  return c;
}

absl::StatusOr<v1::Task> Agent::AskAheadAsNode(bool pushed) {
  // Every rank's slice is in (or one failed) before the leader asks; then it tells the others.
  ALOE_ASSIGN_OR_RETURN(const double failed, env_.control->AllReduceSum(pushed ? 0 : 1));
  v1::NodeDirective d;
  std::string bytes;
  if (leader()) {
    absl::StatusOr<v1::Task> next =
        failed > 0 ? absl::UnavailableError("a rank's push failed")
                   : session_.RequestTask(/*ahead=*/true, /*given_up_task_id=*/0);
    if (next.ok()) {
      d.set_kind(v1::NodeDirective::TASK);
      *d.mutable_task() = *std::move(next);
    } else {
      d.set_kind(v1::NodeDirective::FAIL);
      d.set_error(next.status().ToString());
    }
    d.SerializeToString(&bytes);
  }
  ALOE_RETURN_IF_ERROR(env_.control->Broadcast(&bytes, /*root=*/0));
  if (!leader() && !d.ParseFromString(bytes)) {
    return absl::DataLossError("rank 0 sent a malformed look-ahead directive");
  }
  if (d.kind() != v1::NodeDirective::TASK) return absl::UnavailableError(d.error());
  return d.task();
}

void Agent::SettlePrevious(Pending* previous, const Communicated& c, double blocked) {
  // The previous round's push was answered while this round trained.
  previous->blocked += blocked;
  if (!c.push->ok()) {
    drops_.Note(previous->task, c.push->status(), "");
    reporter_.AddNetwork(previous->blocked);
    return;
  }
  ReportRound(previous->task, previous->stats, **c.push,
              RoundCosts{.pulled_bytes = previous->pulled,
                         .pushed_bytes = c.pushed,
                         .train_s = previous->train,
                         .round_s = previous->seconds + blocked,
                         .network_s = previous->blocked});
}

absl::StatusOr<bool> Agent::TrainAhead(const v1::Task& task, const Communicated& c) {
  bool next_train = c.next.ok() && c.next->kind() == v1::Task::TRAIN &&
                    c.next->task_id() != task.task_id() && !stopping();
  if (env_.node != nullptr) {
    // The ranks go on together or not at all (a rank's pull failed, a rank is stopping).
    ALOE_ASSIGN_OR_RETURN(const double against, env_.node->AllReduceSum(next_train ? 0 : 1));
    next_train = against == 0;
  }
  // A WAIT: the sync round or grace window of the last push is still open. This round is pushed
  // now, the caller asks for work as usual and the next round overlaps again.
  if (!next_train && c.next.ok() && c.next->kind() == v1::Task::WAIT && !c.next->draining() &&
      leader()) {
    ALOE_LOG_INFO("worker",
                  "no look-ahead task yet (the sync round or grace window of the last push is "
                  "still open): this round is pushed without overlap");
  }
  return next_train;
}

absl::Status Agent::PushNow(Pending& pending) {
  const absl::Time p0 = clock_.Now();
  uint64_t pushed = 0;
  absl::StatusOr<v1::PushReply> reply = session_.Push(pending.header, pending.delta, &pushed);
  const double push_s = SecondsSince(p0);
  if (!reply.ok()) return reply.status();
  ReportRound(pending.task, pending.stats, *reply,
              RoundCosts{.pulled_bytes = pending.pulled,
                         .pushed_bytes = pushed,
                         .train_s = pending.train,
                         .round_s = pending.seconds + push_s,
                         .network_s = pending.blocked + push_s});
  return absl::OkStatus();
}

absl::Status Agent::TrainOverlapped(v1::Task task) {
  const absl::Time pull0 = clock_.Now();
  uint64_t pulled = 0;
  ALOE_RETURN_IF_ERROR(PullBase(task, &pulled));
  double pull_s = SecondsSince(pull0);
  std::vector<std::vector<float>> start = base_;
  std::optional<Pending> pending;  // the previous round, pushed while this one trains
  while (true) {
    // The background thread owns `previous` (its delta and error-feedback residual) until get().
    std::optional<Pending> previous = std::move(pending);
    pending.reset();
    Pending* const push = previous.has_value() ? &*previous : nullptr;
    std::future<Communicated> background = std::async(std::launch::async, [this, push] {
      return push != nullptr ? Communicate(&push->header, &push->delta)
                             : Communicate(nullptr, nullptr);
    });
    const absl::Time t0 = clock_.Now();
    absl::StatusOr<TrainStats> stats = TrainRound(task, start);
    const absl::Time t1 = clock_.Now();
    Communicated c = background.get();
    const double blocked = SecondsSince(t1);
    const double train_s = absl::ToDoubleSeconds(t1 - t0);
    if (previous.has_value()) {
      SettlePrevious(&*previous, c, blocked);
    } else {
      reporter_.AddNetwork(blocked);
    }
    if (!stats.ok()) return stats.status();
    if (env_.node == nullptr && c.push.has_value() && !c.push->ok() &&
        c.push->status().code() == absl::StatusCode::kNotFound) {
      return c.push->status();  // the lease is gone: the caller joins again
    }
    if (stats->steps == 0) return absl::OkStatus();  // stopping before the first step (all ranks)
    pending = Pending{task,
                      session_.Header(task, *stats),
                      std::move(delta_),
                      *stats,
                      pulled,
                      train_s,
                      train_s + pull_s,
                      pull_s};
    pull_s = 0;
    ALOE_ASSIGN_OR_RETURN(const bool next_train, TrainAhead(task, c));
    // No task ahead (stopping, draining, a server without look-ahead, an error): this round is
    // pushed now and the caller asks for work as usual.
    if (!next_train) return PushNow(*pending);
    // The next round starts from the newest global model, which lacks this round's update
    // (one-step delay); eager applies it locally at once, scaled by the outer lr, and the global
    // model that includes it replaces this proxy one round later (paper 004). A rank does so on
    // its slices.
    task = *std::move(c.next);
    start = std::move(c.base);
    pulled = c.pulled;
    if (options_.overlap == AgentOptions::Overlap::kEager) {
      const float lr = session_.joined().outer_optimizer().lr();
      for (size_t l = 0; l < start.size(); ++l) {
        kernels::WeightedAccumulate(pending->delta[l].data(), -lr, start[l].data(),
                                    start[l].size());
      }
    }
  }
}

}  // namespace aloe::worker
