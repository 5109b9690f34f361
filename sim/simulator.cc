#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <queue>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/executor.h"
#include "common/status_macros.h"
#include "common/step_times.h"
#include "server/core/server_core.h"

namespace aloe::sim {
namespace {

const char* KindName(MembershipEvent::Kind kind) {
  switch (kind) {
    case MembershipEvent::Kind::kJoin:
      return "join";
    case MembershipEvent::Kind::kLeave:
      return "leave";
    case MembershipEvent::Kind::kCrash:
      return "crash";
  }
  return "?";
}

std::string EventName(const MembershipEvent& e) {
  return absl::StrFormat("%s@%g:%d", KindName(e.kind), e.at_seconds, e.worker);
}

const char* OutcomeName(SimRow::Outcome outcome) {
  switch (outcome) {
    case SimRow::Outcome::kApplied:
      return "applied";
    case SimRow::Outcome::kAccepted:
      return "accepted";
    case SimRow::Outcome::kRejected:
      return "rejected";
    case SimRow::Outcome::kEval:
      return "eval";
  }
  return "?";
}

// RFC 4180 quoting, only when needed (shard names normally need none).
std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  out += '"';
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Profiles and events.

absl::StatusOr<std::vector<MembershipEvent>> ParseEvents(const std::string& text) {
  std::vector<MembershipEvent> events;
  if (absl::StripAsciiWhitespace(text).empty()) return events;
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    const absl::string_view item = absl::StripAsciiWhitespace(raw);
    const std::string what = absl::StrCat("event '", item, "'");
    const size_t at = item.find('@');
    const size_t colon = item.rfind(':');
    if (at == absl::string_view::npos || colon == absl::string_view::npos || colon < at) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": expected join@T:i, leave@T:i or crash@T:i"));
    }
    MembershipEvent event;
    const absl::string_view kind = item.substr(0, at);
    if (kind == "join") {
      event.kind = MembershipEvent::Kind::kJoin;
    } else if (kind == "leave") {
      event.kind = MembershipEvent::Kind::kLeave;
    } else if (kind == "crash") {
      event.kind = MembershipEvent::Kind::kCrash;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unknown kind '", kind, "' (join, leave or crash)"));
    }
    const absl::string_view time = item.substr(at + 1, colon - at - 1);
    if (!absl::SimpleAtod(time, &event.at_seconds) || !std::isfinite(event.at_seconds) ||
        event.at_seconds < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the time must be finite seconds >= 0, got '", time, "'"));
    }
    ALOE_ASSIGN_OR_RETURN(event.worker, ParseWorkerIndex(item.substr(colon + 1), what));
    events.push_back(event);
  }
  return events;
}

// ---------------------------------------------------------------------------------------------
// Output.

std::string FormatCsv(const SimResult& result) {
  std::string out = "virtual_time,version,worker,staleness,shard,steps,eval_loss,outcome\n";
  for (const SimRow& row : result.rows) {
    absl::StrAppendFormat(&out, "%.6f,%d,", row.virtual_seconds, row.version);
    if (row.outcome == SimRow::Outcome::kEval) {
      out += ",,,,";
    } else {
      absl::StrAppendFormat(&out, "%d,%d,%s,%d,", row.worker, row.staleness, CsvField(row.shard),
                            row.steps);
    }
    if (row.eval_loss.has_value()) absl::StrAppendFormat(&out, "%.6f", *row.eval_loss);
    absl::StrAppend(&out, ",", OutcomeName(row.outcome), "\n");
  }
  return out;
}

std::string FormatSummary(const SimResult& result) {
  uint64_t rejected = 0;
  for (uint64_t r : result.rejected_per_worker) rejected += r;
  return absl::StrFormat(
      "aloe-sim: stop=%s final_eval_loss=%.6f virtual_seconds=%.3f versions=%d "
      "local_steps=%d updates_per_worker=%s rejected=%d",
      result.stop_reason, result.final_eval_loss, result.virtual_seconds, result.final_version,
      result.total_local_steps, absl::StrJoin(result.updates_per_worker, ","), rejected);
}

// ---------------------------------------------------------------------------------------------
// The engine.

class Simulator::Engine {
 public:
  Engine(v1::ServerConfig config, SimulatorOptions options,
         std::vector<std::unique_ptr<TrainerInterface>> trainers,
         std::unique_ptr<TrainerInterface> eval_trainer)
      : config_(std::move(config)),
        options_(std::move(options)),
        trainers_(std::move(trainers)),
        eval_trainer_(std::move(eval_trainer)),
        start_(clock_.Now()) {}

  absl::Status Init(std::vector<server::DataShard> train_shards, std::string heldout_file);
  absl::StatusOr<SimResult> Run();

 private:
  enum class EventKind { kJoin, kLeave, kCrash, kPush, kExpiry, kHeartbeat, kTick };
  struct Event {
    absl::Duration at;
    uint64_t seq = 0;
    EventKind kind = EventKind::kTick;
    int worker = -1;
    uint64_t epoch = 0;
  };
  struct Later {
    bool operator()(const Event& a, const Event& b) const {
      return a.at != b.at ? a.at > b.at : a.seq > b.seq;
    }
  };
  enum class State { kAbsent, kWaiting, kTraining };
  struct Worker {
    int index = 0;
    std::vector<absl::Duration> cycle;
    size_t cursor = 0;  // next step time in `cycle`
    TrainerInterface* trainer = nullptr;
    bool present_at_start = true;
    State state = State::kAbsent;
    uint64_t id = 0;     // server worker id while a member
    uint64_t epoch = 0;  // bumped on every join, leave, crash and stop: stale events are dropped
    uint64_t next_update_id = 1;
    server::PendingUpdate in_flight;
    std::string in_flight_shard;
    double steps_per_second = 0;  // measured over the last task; 0 = unknown
  };

  // Push, membership and lease-expiry events can change the server state; heartbeats and ticks
  // only let time-based state move.
  static bool IsProgress(EventKind kind) {
    return kind != EventKind::kHeartbeat && kind != EventKind::kTick;
  }

  absl::Duration Now() const { return clock_.Now() - start_; }
  std::string Where(const Worker& w) const {
    return absl::StrFormat("t=%.6fs worker %d", absl::ToDoubleSeconds(Now()), w.index);
  }
  void Schedule(absl::Duration at, EventKind kind, int worker, uint64_t epoch);
  absl::Status Handle(const Event& event);
  absl::Status Join(Worker& w);
  absl::Status Ask(Worker& w, bool allow_rejoin = true);
  absl::Status StartTraining(Worker& w, const v1::Task& task);
  absl::Status Push(Worker& w);
  absl::Status Leave(Worker& w);
  void Crash(Worker& w);
  // Marks the worker's current membership over; its in-flight push becomes stale.
  void EndMembership(Worker& w);
  absl::Status WakeWaiters();
  void EnsureTick();
  bool AnyWaiting() const;
  absl::Status MaybeEvaluate();
  absl::Status EvaluateNow();

  const v1::ServerConfig config_;
  const SimulatorOptions options_;
  std::vector<std::unique_ptr<TrainerInterface>> trainers_;
  std::unique_ptr<TrainerInterface> eval_trainer_;
  std::string heldout_file_;  // the held-out shard's file, for EvalRequest.heldout
  FakeClock clock_;
  const absl::Time start_;
  InlineExecutor executor_;
  NullMetrics null_metrics_;
  std::unique_ptr<server::ServerCore> core_;
  std::vector<Worker> workers_;
  absl::Duration heartbeat_period_;

  std::priority_queue<Event, std::vector<Event>, Later> queue_;
  uint64_t next_seq_ = 0;
  size_t pending_progress_ = 0;  // live progress events in the queue
  bool tick_pending_ = false;
  absl::Duration last_progress_;
  std::optional<uint64_t> last_eval_version_;
  std::map<uint64_t, double> eval_loss_;    // version -> loss
  std::map<uint64_t, size_t> applied_row_;  // version -> the push row that produced it
  SimResult result_;
  bool ran_ = false;
};

absl::Status Simulator::Engine::Init(std::vector<server::DataShard> train_shards,
                                     std::string heldout_file) {
  ALOE_RETURN_IF_ERROR(ValidateServerConfig(config_));
  heldout_file_ = heldout_file;
  if (options_.workers.empty()) {
    return absl::InvalidArgumentError("the simulation needs at least one worker profile");
  }
  if (trainers_.size() != options_.workers.size()) {
    return absl::InvalidArgumentError(absl::StrFormat("%d worker profiles but %d trainers",
                                                      options_.workers.size(), trainers_.size()));
  }
  for (const auto& t : trainers_) {
    if (t == nullptr) return absl::InvalidArgumentError("a worker trainer is null");
  }
  if (eval_trainer_ == nullptr) return absl::InvalidArgumentError("the eval trainer is null");
  if (!std::isfinite(options_.tick_seconds) || !(options_.tick_seconds > 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tick_seconds must be finite and > 0, got %g", options_.tick_seconds));
  }
  if (!(options_.max_virtual_seconds >= 0) || !(options_.stall_seconds >= 0)) {
    return absl::InvalidArgumentError("max_virtual_seconds and stall_seconds must be >= 0");
  }
  workers_.resize(options_.workers.size());
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i].index = static_cast<int>(i);
    workers_[i].trainer = trainers_[i].get();
    for (double s : options_.workers[i].cycle()) workers_[i].cycle.push_back(absl::Seconds(s));
  }
  // Presence check, per worker in time order (ties: the order given).
  std::vector<std::vector<const MembershipEvent*>> per_worker(workers_.size());
  for (const MembershipEvent& e : options_.events) {
    if (e.worker < 0 || static_cast<size_t>(e.worker) >= workers_.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("event %s names worker %d, but there are %d workers (0..%d)",
                          EventName(e), e.worker, workers_.size(), workers_.size() - 1));
    }
    if (!std::isfinite(e.at_seconds) || e.at_seconds < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("event %s: the time must be finite and >= 0", EventName(e)));
    }
    per_worker[e.worker].push_back(&e);
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    auto& list = per_worker[i];
    std::stable_sort(list.begin(), list.end(),
                     [](const auto* a, const auto* b) { return a->at_seconds < b->at_seconds; });
    bool present = list.empty() || list.front()->kind != MembershipEvent::Kind::kJoin;
    workers_[i].present_at_start = present;
    for (const MembershipEvent* e : list) {
      const bool join = e->kind == MembershipEvent::Kind::kJoin;
      if (join == present) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "event %s: worker %d is %s then (a worker without a join event starts at t = 0; "
            "one whose first event is a join starts absent)",
            EventName(*e), e->worker, present ? "already present" : "not present"));
      }
      present = join;
    }
  }
  heartbeat_period_ = absl::Seconds(std::max(0.05, config_.lease_seconds() / 3));
  MetricsSink& metrics = options_.metrics != nullptr ? *options_.metrics : null_metrics_;
  ALOE_ASSIGN_OR_RETURN(
      core_, server::ServerCore::Create(config_, std::move(train_shards), std::move(heldout_file),
                                        clock_, executor_, metrics));
  return absl::OkStatus();
}

void Simulator::Engine::Schedule(absl::Duration at, EventKind kind, int worker, uint64_t epoch) {
  queue_.push(Event{at, next_seq_++, kind, worker, epoch});
  if (IsProgress(kind)) ++pending_progress_;
}

bool Simulator::Engine::AnyWaiting() const {
  for (const Worker& w : workers_) {
    if (w.state == State::kWaiting) return true;
  }
  return false;
}

absl::StatusOr<SimResult> Simulator::Engine::Run() {
  if (ran_) return absl::FailedPreconditionError("Simulator::Run may be called only once");
  ran_ = true;
  result_.updates_per_worker.assign(workers_.size(), 0);
  result_.rejected_per_worker.assign(workers_.size(), 0);
  ALOE_RETURN_IF_ERROR(MaybeEvaluate());  // version 0

  for (const Worker& w : workers_) {
    if (w.present_at_start) Schedule(absl::ZeroDuration(), EventKind::kJoin, w.index, 0);
  }
  std::vector<const MembershipEvent*> events;
  for (const MembershipEvent& e : options_.events) events.push_back(&e);
  std::stable_sort(events.begin(), events.end(),
                   [](const auto* a, const auto* b) { return a->at_seconds < b->at_seconds; });
  for (const MembershipEvent* e : events) {
    const EventKind kind = e->kind == MembershipEvent::Kind::kJoin    ? EventKind::kJoin
                           : e->kind == MembershipEvent::Kind::kLeave ? EventKind::kLeave
                                                                      : EventKind::kCrash;
    Schedule(absl::Seconds(e->at_seconds), kind, e->worker, 0);
  }

  double grace = config_.aggregation().grace_seconds();
  if (!std::isfinite(grace)) grace = 0;
  const absl::Duration stall = absl::Seconds(
      options_.stall_seconds > 0 ? options_.stall_seconds
                                 : std::max(10.0, 3 * config_.lease_seconds() + grace));

  while (true) {
    if (core_->Finished()) {
      result_.stop_reason = "finished";
      break;
    }
    if (options_.max_versions > 0 && core_->version() >= options_.max_versions) {
      result_.stop_reason = "max_versions";
      break;
    }
    if (options_.max_local_steps > 0 && result_.total_local_steps >= options_.max_local_steps) {
      result_.stop_reason = "max_local_steps";
      break;
    }
    if (pending_progress_ == 0) {
      if (!AnyWaiting()) {
        result_.stop_reason = "idle";  // nobody trains or waits and no event is pending
        break;
      }
      if (Now() - last_progress_ >= stall) {
        result_.stop_reason = "stalled";  // workers wait for something that never comes
        break;
      }
    }
    if (queue_.empty()) {
      result_.stop_reason = "idle";
      break;
    }
    const Event event = queue_.top();
    if (options_.max_virtual_seconds > 0 &&
        event.at > absl::Seconds(options_.max_virtual_seconds)) {
      clock_.Advance(absl::Seconds(options_.max_virtual_seconds) - Now());
      result_.stop_reason = "max_virtual_seconds";
      break;
    }
    queue_.pop();
    if (event.at > Now()) clock_.Advance(event.at - Now());
    ALOE_RETURN_IF_ERROR(Handle(event));
    ALOE_RETURN_IF_ERROR(MaybeEvaluate());
  }

  if (last_eval_version_ != core_->version()) ALOE_RETURN_IF_ERROR(EvaluateNow());
  result_.final_version = core_->version();
  result_.final_eval_loss = eval_loss_[core_->version()];
  result_.virtual_seconds = absl::ToDoubleSeconds(Now());
  return std::move(result_);
}

absl::Status Simulator::Engine::Handle(const Event& event) {
  if (event.kind == EventKind::kTick) {
    tick_pending_ = false;
    core_->Tick();
    return WakeWaiters();
  }
  if (event.kind == EventKind::kExpiry) {
    --pending_progress_;
    last_progress_ = Now();
    core_->Tick();
    return WakeWaiters();
  }
  Worker& w = workers_[event.worker];
  switch (event.kind) {
    case EventKind::kJoin:
      --pending_progress_;
      last_progress_ = Now();
      if (w.state != State::kAbsent) return absl::OkStatus();
      ALOE_RETURN_IF_ERROR(Join(w));
      return WakeWaiters();
    case EventKind::kLeave:
      --pending_progress_;
      last_progress_ = Now();
      if (w.state == State::kAbsent) return absl::OkStatus();  // stopped already
      ALOE_RETURN_IF_ERROR(Leave(w));
      return WakeWaiters();
    case EventKind::kCrash:
      --pending_progress_;
      last_progress_ = Now();
      if (w.state != State::kAbsent) Crash(w);
      return absl::OkStatus();
    case EventKind::kPush:
      // A push that went stale (leave, crash) was already uncounted by EndMembership.
      if (event.epoch != w.epoch || w.state != State::kTraining) return absl::OkStatus();
      --pending_progress_;
      last_progress_ = Now();
      ALOE_RETURN_IF_ERROR(Push(w));
      return WakeWaiters();
    case EventKind::kHeartbeat: {
      if (event.epoch != w.epoch || w.state == State::kAbsent) return absl::OkStatus();
      v1::HeartbeatRequest request;
      request.set_worker_id(w.id);
      request.set_steps_per_second(w.steps_per_second);
      // kNotFound (dropped) is handled at the worker's next RequestTask, as the daemon does.
      (void)core_->Heartbeat(request);
      Schedule(Now() + heartbeat_period_, EventKind::kHeartbeat, w.index, w.epoch);
      return absl::OkStatus();
    }
    case EventKind::kTick:
    case EventKind::kExpiry:
      break;
  }
  return absl::OkStatus();
}

absl::Status Simulator::Engine::Join(Worker& w) {
  v1::JoinRequest request;
  request.set_name(absl::StrFormat("sim-worker-%d", w.index));
  request.set_role(v1::ROLE_TRAINER);
  request.set_num_threads(1);
  request.set_model_fingerprint(options_.model_fingerprint);
  absl::StatusOr<v1::JoinReply> reply = core_->Join(request);
  if (!reply.ok()) {
    return absl::Status(reply.status().code(),
                        absl::StrCat(Where(w), ": Join failed: ", reply.status().message()));
  }
  w.id = reply->worker_id();
  ++w.epoch;
  w.state = State::kWaiting;
  Schedule(Now() + heartbeat_period_, EventKind::kHeartbeat, w.index, w.epoch);
  return Ask(w);
}

absl::Status Simulator::Engine::Ask(Worker& w, bool allow_rejoin) {
  v1::TaskRequest request;
  request.set_worker_id(w.id);
  absl::StatusOr<v1::Task> task = core_->RequestTask(request);
  if (!task.ok()) {
    if (task.status().code() == absl::StatusCode::kNotFound && allow_rejoin) {
      // Dropped by the core (lease expired): join again, as the daemon does.
      EndMembership(w);
      return Join(w);
    }
    return absl::Status(task.status().code(),
                        absl::StrCat(Where(w), ": RequestTask failed: ", task.status().message()));
  }
  switch (task->kind()) {
    case v1::Task::WAIT:
      w.state = State::kWaiting;
      EnsureTick();
      return absl::OkStatus();
    case v1::Task::TRAIN:
      return StartTraining(w, *task);
    case v1::Task::STOP: {
      v1::LeaveRequest leave;
      leave.set_worker_id(w.id);
      (void)core_->Leave(leave);  // kNotFound: already gone, nothing to do
      EndMembership(w);
      return absl::OkStatus();
    }
    default:
      return absl::InternalError(absl::StrFormat("%s: unexpected task kind %s for a trainer",
                                                 Where(w), v1::Task::Kind_Name(task->kind())));
  }
}

absl::Status Simulator::Engine::StartTraining(Worker& w, const v1::Task& task) {
  v1::PullRequest pull;
  pull.set_worker_id(w.id);
  pull.set_version(task.base_version());
  absl::StatusOr<server::ModelSnapshot> snapshot = core_->SnapshotFor(pull);
  if (!snapshot.ok()) {
    return absl::Status(snapshot.status().code(),
                        absl::StrCat(Where(w), ": pull failed: ", snapshot.status().message()));
  }
  std::vector<std::vector<float>> base;
  base.reserve(snapshot->layers.size());
  for (const auto& layer : snapshot->layers) base.push_back(*layer);

  // The step count: H, or the A-EDiT budget's first step end at or after tau_time (paper 000
  // Sec. 3.3), capped at local_steps; at least one step.
  const uint32_t cap = std::max<uint32_t>(1, task.local_steps());
  const absl::Duration budget = absl::Seconds(task.time_budget_seconds());
  const bool budgeted = task.time_budget_seconds() > 0;
  uint32_t steps = 0;
  absl::Duration duration;
  while (steps < cap && (!budgeted || steps == 0 || duration < budget)) {
    duration += w.cycle[w.cursor];
    w.cursor = (w.cursor + 1) % w.cycle.size();
    ++steps;
  }

  ALOE_RETURN_IF_ERROR(w.trainer->SetParameters(base));
  TrainRequest train;
  train.shard_name = task.shard_name();
  if (options_.open_shard) {
    absl::StatusOr<const TokenSource*> data = options_.open_shard(task.shard_file());
    if (!data.ok()) {
      return absl::Status(data.status().code(),
                          absl::StrCat(Where(w), ": training data: ", data.status().message()));
    }
    train.data = *data;
  }
  train.steps = steps;
  train.lr_step = task.lr_step();
  train.seed = task.seed();
  absl::StatusOr<TrainStats> stats = w.trainer->Train(train);
  if (!stats.ok()) {
    return absl::Status(stats.status().code(),
                        absl::StrCat(Where(w), ": training failed: ", stats.status().message()));
  }
  server::PendingUpdate& u = w.in_flight;
  u = server::PendingUpdate();
  ALOE_RETURN_IF_ERROR(w.trainer->PseudoGradient(base, &u.layers));
  u.worker_id = w.id;
  u.task_id = task.task_id();
  u.update_id = w.next_update_id++;
  u.base_version = task.base_version();
  u.steps_done = steps;
  u.tokens_learned = stats->tokens;
  u.train_loss = stats->mean_loss;
  u.compute_seconds = absl::ToDoubleSeconds(duration);
  w.in_flight_shard = task.shard_name();
  w.state = State::kTraining;
  Schedule(Now() + duration, EventKind::kPush, w.index, w.epoch);
  return absl::OkStatus();
}

absl::Status Simulator::Engine::Push(Worker& w) {
  server::PendingUpdate update = std::move(w.in_flight);
  w.in_flight = server::PendingUpdate();
  const uint64_t base = update.base_version;
  const uint32_t steps = update.steps_done;
  const double seconds = update.compute_seconds;
  const uint64_t before = core_->version();

  SimRow row;
  row.virtual_seconds = absl::ToDoubleSeconds(Now());
  row.worker = w.index;
  row.shard = w.in_flight_shard;
  row.steps = steps;
  absl::StatusOr<v1::PushReply> reply = core_->SubmitUpdate(std::move(update));
  if (reply.ok()) {
    row.version = reply->version();
    row.outcome = reply->applied() ? SimRow::Outcome::kApplied : SimRow::Outcome::kAccepted;
    row.staleness = reply->applied() ? reply->staleness() : before - std::min(before, base);
    ++result_.updates_per_worker[w.index];
  } else {
    row.version = core_->version();
    row.outcome = SimRow::Outcome::kRejected;
    row.staleness = before - std::min(before, base);
    ++result_.rejected_per_worker[w.index];
    result_.rejections.push_back(absl::StrCat(Where(w), ": ", reply.status().ToString()));
  }
  result_.rows.push_back(std::move(row));
  if (result_.rows.back().outcome == SimRow::Outcome::kApplied) {
    applied_row_[result_.rows.back().version] = result_.rows.size() - 1;
  }
  result_.total_local_steps += steps;

  // What the daemon's heartbeat reports after a round (DyLU's speed estimate).
  w.steps_per_second = seconds > 0 ? steps / seconds : 0;
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_worker_id(w.id);
  heartbeat.set_steps_per_second(w.steps_per_second);
  (void)core_->Heartbeat(heartbeat);  // kNotFound is handled by Ask (rejoin)
  w.state = State::kWaiting;
  return Ask(w);
}

absl::Status Simulator::Engine::Leave(Worker& w) {
  v1::LeaveRequest request;
  request.set_worker_id(w.id);
  absl::Status status = core_->Leave(request);
  EndMembership(w);
  if (!status.ok() && status.code() != absl::StatusCode::kNotFound) {
    return absl::Status(status.code(),
                        absl::StrCat(Where(w), ": Leave failed: ", status.message()));
  }
  return absl::OkStatus();
}

void Simulator::Engine::Crash(Worker& w) {
  EndMembership(w);
  // The core notices at the first Tick after the lease ran out (renewals were at or before now).
  Schedule(Now() + absl::Seconds(config_.lease_seconds()), EventKind::kExpiry, -1, 0);
}

void Simulator::Engine::EndMembership(Worker& w) {
  if (w.state == State::kTraining) {
    --pending_progress_;  // its push event is now stale
    w.in_flight = server::PendingUpdate();
  }
  w.state = State::kAbsent;
  w.id = 0;
  ++w.epoch;
}

absl::Status Simulator::Engine::WakeWaiters() {
  // Index order; again while someone's state changed, since a start or a leave may unblock others.
  bool changed = true;
  while (changed) {
    changed = false;
    for (Worker& w : workers_) {
      if (w.state != State::kWaiting) continue;
      ALOE_RETURN_IF_ERROR(Ask(w));
      if (w.state != State::kWaiting) changed = true;
    }
  }
  EnsureTick();
  return absl::OkStatus();
}

void Simulator::Engine::EnsureTick() {
  if (tick_pending_ || !AnyWaiting()) return;
  tick_pending_ = true;
  Schedule(Now() + absl::Seconds(options_.tick_seconds), EventKind::kTick, -1, 0);
}

absl::Status Simulator::Engine::MaybeEvaluate() {
  const uint64_t version = core_->version();
  if (last_eval_version_.has_value() &&
      (options_.eval_every == 0 || version < *last_eval_version_ + options_.eval_every)) {
    return absl::OkStatus();
  }
  return EvaluateNow();
}

absl::Status Simulator::Engine::EvaluateNow() {
  const server::ModelSnapshot snapshot = core_->Snapshot();
  std::vector<std::vector<float>> params;
  params.reserve(snapshot.layers.size());
  for (const auto& layer : snapshot.layers) params.push_back(*layer);
  ALOE_RETURN_IF_ERROR(eval_trainer_->SetParameters(params));
  EvalRequest request;
  request.max_sequences = options_.eval_sequences;
  absl::StatusOr<double> loss = absl::UnknownError("not evaluated");
  absl::StatusOr<const TokenSource*> heldout =
      options_.open_shard ? options_.open_shard(heldout_file_) : nullptr;
  if (!heldout.ok()) {
    loss = heldout.status();
  } else {
    request.heldout = *heldout;
    loss = eval_trainer_->Evaluate(request);
  }
  if (!loss.ok()) {
    return absl::Status(
        loss.status().code(),
        absl::StrFormat("t=%.6fs: evaluating version %d failed: %s", absl::ToDoubleSeconds(Now()),
                        snapshot.version, loss.status().message()));
  }
  last_eval_version_ = snapshot.version;
  eval_loss_[snapshot.version] = *loss;
  auto row = applied_row_.find(snapshot.version);
  if (row != applied_row_.end()) {
    result_.rows[row->second].eval_loss = *loss;
  } else {
    SimRow eval;
    eval.virtual_seconds = absl::ToDoubleSeconds(Now());
    eval.version = snapshot.version;
    eval.eval_loss = *loss;
    eval.outcome = SimRow::Outcome::kEval;
    result_.rows.push_back(std::move(eval));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------

Simulator::Simulator(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {}
Simulator::~Simulator() = default;

absl::StatusOr<std::unique_ptr<Simulator>> Simulator::Create(
    v1::ServerConfig config, std::vector<server::DataShard> train_shards, std::string heldout_file,
    SimulatorOptions options, std::vector<std::unique_ptr<TrainerInterface>> worker_trainers,
    std::unique_ptr<TrainerInterface> eval_trainer) {
  auto engine = std::make_unique<Engine>(std::move(config), std::move(options),
                                         std::move(worker_trainers), std::move(eval_trainer));
  ALOE_RETURN_IF_ERROR(engine->Init(std::move(train_shards), std::move(heldout_file)));
  return std::unique_ptr<Simulator>(new Simulator(std::move(engine)));
}

absl::StatusOr<SimResult> Simulator::Run() { return engine_->Run(); }

}  // namespace aloe::sim
