// Overlapped rounds of the worker agent (paper 004): a round's push and the pull of the next
// round's base run on a background thread while the next round trains.
#include <future>
#include <memory>
#include <optional>
#include <utility>

#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/agent.h"
#include "worker/round_boundary.h"
#include "worker/trainer.h"

namespace aloe::worker {

// What the background half of an overlapped round did: the previous round's push, the
// look-ahead task and the pull of its base.
struct Agent::Communicated {
  std::optional<absl::StatusOr<v1::PushReply>> push;
  uint64_t pushed = 0;
  absl::StatusOr<v1::Task> next = absl::UnknownError("not asked");
  uint64_t pulled = 0;  // the next round's base, staged in the boundary
};

// A trained round whose push is still to come: in the background while the next round trains,
// or at once when no round follows.
struct Agent::Pending {
  v1::Task task;
  v1::PushHeader header;
  std::vector<std::vector<float>> delta;  // taken from the boundary when it is pushed
  TrainStats stats;
  uint64_t pulled = 0;
  double train = 0;     // its training time
  double seconds = 0;   // its training time plus the waits for the network
  double blocked = 0;   // of which waiting for the network
  double boundary = 0;  // of its training time, outside the steps
};

RoundBoundary& Agent::Boundary() {
  if (boundary_ != nullptr) return *boundary_;
  const bool device =
      options_.round_boundary == AgentOptions::Boundary::kDevice ||
      (options_.round_boundary == AgentOptions::Boundary::kAuto && TrainerDevice() != "cpu");
  boundary_ = device ? trainer_->device_round_boundary() : nullptr;
  if (boundary_ == nullptr) {
    host_boundary_ = std::make_unique<HostRoundBoundary>(trainer_.get());
    boundary_ = host_boundary_.get();
  }
  if (leader()) {
    ALOE_LOG_INFO("worker", "overlapped rounds: the round boundary runs on the %s",
                  boundary_ == host_boundary_.get() ? "host" : "trainer's device");
  }
  return *boundary_;
}

Agent::Communicated Agent::Communicate(Pending* previous, std::promise<void>* taken) {
  Communicated c;
  if (previous != nullptr) {
    // The pseudo-gradient reaches the host (a GPU's copy ran beside the training kernels).
    absl::Status took = boundary_->TakePseudoGradient(&previous->delta);
    taken->set_value();
    c.push = took.ok() ? session_.Push(previous->header, previous->delta, &c.pushed)
                       : absl::StatusOr<v1::PushReply>(took);
  } else {
    taken->set_value();
  }
  const bool pushed = !c.push.has_value() || c.push->ok();
  if (env_.control == nullptr) {
    if (!pushed) return c;
    c.next = session_.RequestTask(/*ahead=*/true, /*given_up_task_id=*/0);
  } else {
    c.next = AskAheadAsNode(pushed);
  }
  if (c.next.ok() && c.next->kind() == v1::Task::TRAIN) {
    std::vector<std::vector<float>> base;
    absl::Status pulled = session_.Pull(c.next->base_version(), &base, &c.pulled).status();
    // Staged here, beside training: on a GPU the copy to the device runs on its own stream.
    if (pulled.ok()) pulled = boundary_->StageStart(std::move(base));
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
                         .network_s = previous->blocked,
                         .boundary_s = previous->boundary});
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
  ALOE_RETURN_IF_ERROR(boundary_->TakePseudoGradient(&pending.delta));
  absl::StatusOr<v1::PushReply> reply = session_.Push(pending.header, pending.delta, &pushed);
  const double push_s = SecondsSince(p0);
  if (!reply.ok()) return reply.status();
  ReportRound(pending.task, pending.stats, *reply,
              RoundCosts{.pulled_bytes = pending.pulled,
                         .pushed_bytes = pushed,
                         .train_s = pending.train,
                         .round_s = pending.seconds + push_s,
                         .network_s = pending.blocked + push_s,
                         .boundary_s = pending.boundary});
  return absl::OkStatus();
}

absl::Status Agent::TrainOverlapped(v1::Task task) {
  RoundBoundary& boundary = Boundary();
  const absl::Time pull0 = clock_.Now();
  uint64_t pulled = 0;
  ALOE_RETURN_IF_ERROR(PullBase(task, &pulled));
  ALOE_RETURN_IF_ERROR(boundary.StageStart(std::move(base_)));
  base_.clear();
  double pull_s = SecondsSince(pull0);
  float delta_scale = 0;           // the first round starts from the pulled model as it is
  std::optional<Pending> pending;  // the previous round, pushed while this one trains
  while (true) {
    // The background thread owns `previous` (its delta and error-feedback residual) until get().
    std::optional<Pending> previous = std::move(pending);
    pending.reset();
    Pending* const push = previous.has_value() ? &*previous : nullptr;
    const absl::Time t0 = clock_.Now();
    // Before the background half takes the last round's pseudo-gradient away: the eager start
    // reads it.
    ALOE_RETURN_IF_ERROR(boundary.StartStaged(delta_scale));
    const double start_s = SecondsSince(t0);
    std::promise<void> taken;  // the previous round's pseudo-gradient is out of the boundary
    std::future<void> taken_out = taken.get_future();
    std::future<Communicated> background =
        std::async(std::launch::async, [this, push, &taken] { return Communicate(push, &taken); });
    double end_s = 0;
    absl::StatusOr<TrainStats> stats = RunRound(
        task, [] { return absl::OkStatus(); },
        [&] {
          taken_out.wait();  // this round's pseudo-gradient takes its place
          return boundary.EndRound();
        },
        &end_s);
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
    pending = Pending{.task = task,
                      .header = session_.Header(task, *stats),
                      .stats = *stats,
                      .pulled = pulled,
                      .train = train_s,
                      .seconds = train_s + pull_s,
                      .blocked = pull_s,
                      .boundary = start_s + end_s};
    pull_s = 0;
    ALOE_ASSIGN_OR_RETURN(const bool next_train, TrainAhead(task, c));
    // No task ahead (stopping, draining, a server without look-ahead, an error): this round is
    // pushed now and the caller asks for work as usual.
    if (!next_train) return PushNow(*pending);
    // The next round starts from the newest global model, staged by the background half, which
    // lacks this round's update (one-step delay); eager applies it locally at once, scaled by the
    // outer lr, and the global model that includes it replaces this proxy one round later
    // (paper 004). A rank does so on its slices.
    task = *std::move(c.next);
    pulled = c.pulled;
    delta_scale = options_.overlap == AgentOptions::Overlap::kEager
                      ? -session_.joined().outer_optimizer().lr()
                      : 0.0f;
  }
}

}  // namespace aloe::worker
