#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>
#include <limits>
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
#include "common/layer_groups.h"
#include "common/status_macros.h"
#include "common/step_times.h"
#include "common/sync_schedule.h"
#include "kernels/cpu/outer_kernels.h"
#include "server/core/server_core.h"
#include "sim/push_codec.h"

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

// How long the server's service holds a look-ahead request answered WAIT
// (server/service/grpc_services.cc): the simulated worker's request waits as long.
constexpr absl::Duration kAheadHold = absl::Seconds(10);

}  // namespace

// ---------------------------------------------------------------------------------------------
// Profiles and events.

absl::StatusOr<Overlap> ParseOverlap(const std::string& text) {
  if (text == "off") return Overlap::kOff;
  if (text == "delayed") return Overlap::kDelayed;
  if (text == "eager") return Overlap::kEager;
  return absl::InvalidArgumentError(
      absl::StrCat("overlap must be off, delayed or eager, got '", text, "'"));
}

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
  std::string out = absl::StrFormat(
      "aloe-sim: stop=%s final_eval_loss=%.6f virtual_seconds=%.3f versions=%d "
      "local_steps=%d updates_per_worker=%s rejected=%d pushed_bytes=%d",
      result.stop_reason, result.final_eval_loss, result.virtual_seconds, result.final_version,
      result.total_local_steps, absl::StrJoin(result.updates_per_worker, ","), rejected,
      result.pushed_bytes);
  const auto join = [&result](auto get) {
    return absl::StrJoin(result.workers, ",",
                         [&](std::string* o, const WorkerStats& w) { absl::StrAppend(o, get(w)); });
  };
  absl::StrAppend(&out, " utilization=",
                  join([](const WorkerStats& w) { return absl::StrFormat("%.4f", w.utilization); }),
                  " bytes_up=", join([](const WorkerStats& w) { return w.bytes_up; }),
                  " bytes_down=", join([](const WorkerStats& w) { return w.bytes_down; }),
                  " peak_up_Bps=", join([](const WorkerStats& w) {
                    return absl::StrFormat("%.0f", w.peak_up_bytes_per_second);
                  }),
                  " peak_down_Bps=", join([](const WorkerStats& w) {
                    return absl::StrFormat("%.0f", w.peak_down_bytes_per_second);
                  }));
  if (result.target_loss.has_value()) {
    absl::StrAppendFormat(&out, " target_loss=%g target_seconds=%s", *result.target_loss,
                          result.target_seconds.has_value()
                              ? absl::StrFormat("%.3f", *result.target_seconds)
                              : std::string("never"));
  }
  return out;
}

std::string FormatWorkersCsv(const SimResult& result) {
  std::string out =
      "worker,updates,rejected,compute_seconds,present_seconds,utilization,bytes_up,bytes_down,"
      "peak_up_bytes_per_second,peak_down_bytes_per_second\n";
  for (size_t i = 0; i < result.workers.size(); ++i) {
    const WorkerStats& w = result.workers[i];
    absl::StrAppendFormat(&out, "%d,%d,%d,%.6f,%.6f,%.6f,%d,%d,%.6f,%.6f\n", i,
                          i < result.updates_per_worker.size() ? result.updates_per_worker[i] : 0,
                          i < result.rejected_per_worker.size() ? result.rejected_per_worker[i] : 0,
                          w.compute_seconds, w.present_seconds, w.utilization, w.bytes_up,
                          w.bytes_down, w.peak_up_bytes_per_second, w.peak_down_bytes_per_second);
  }
  return out;
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
  // kPulled, kComputed, kUploaded and kAheadDeadline are a worker's round events: a pull or
  // an upload arrives, a compute ends, a held look-ahead request runs out.
  enum class EventKind {
    kJoin,
    kLeave,
    kCrash,
    kPulled,
    kComputed,
    kUploaded,
    kAheadDeadline,
    kSegmentDone,
    kGroupUploaded,
    kGroupPulled,
    kExpiry,
    kHeartbeat,
    kTick
  };
  struct Event {
    absl::Duration at;
    uint64_t seq = 0;
    EventKind kind = EventKind::kTick;
    int worker = -1;
    uint64_t epoch = 0;
    uint64_t token = 0;  // kAheadDeadline: the hold it ends
  };
  struct Later {
    bool operator()(const Event& a, const Event& b) const {
      return a.at != b.at ? a.at > b.at : a.seq > b.seq;
    }
  };
  enum class State { kAbsent, kWaiting, kTraining };
  // Partial synchronization (layer groups, K > 1): the streaming round of the daemon
  // (docs/algorithms.md). A group is taken (start_group) and pulled before it is pushed against
  // that copy; the push goes after the step the schedule names, in the background; the global
  // group comes back merge_delay_steps later and is mixed in.
  struct Merge {
    uint32_t group = 0;
    uint64_t due = 0;      // the worker's total step count at which it is merged
    bool pushed = true;    // its push was submitted (a retake has none)
    bool replace = false;  // take the global group as it is (cold start, a refused push)
  };
  // A computed round: its update (computed when its compute starts) and its task's shard; once
  // its push is encoded (Encode), the update the server decodes, the push's bytes and whether
  // the server takes it.
  struct Round {
    server::PendingUpdate update;
    std::string shard;
    uint64_t bytes = 0;
    absl::Status refused;
  };
  struct Stream {
    std::optional<v1::Task> task;
    uint32_t period = 0;                       // H of the task
    std::vector<std::vector<uint32_t>> syncs;  // groups pushed after each step of the task
    uint32_t step = 0;                         // steps of the task done
    uint32_t segment = 0;                      // steps of the running segment
    uint64_t total_steps = 0;                  // since the worker joined
    absl::Duration segment_seconds;
    std::vector<std::vector<float>> global;  // the global copy of every layer the worker holds
    std::vector<bool> held;                  // per group: its global copy is held
    std::vector<uint64_t> version;           // per group: the version taken
    std::deque<uint32_t> to_push;            // groups to push at the current step
    std::deque<Merge> merges;                // oldest first
    std::deque<Round> uploads;               // on the uplink, in order (their shard unset)
    std::optional<uint32_t> pulling;         // the group on the downlink
    std::vector<std::vector<float>> pulled;  // its layers (others empty)
    bool wants_grant = false;       // start_group answered WAIT: asked again when the core changes
    bool wants_upload = false;      // a merge waits for its push to be submitted
    bool ask_after_upload = false;  // the next task is asked for once the uploads are in
    absl::Duration last_step;       // the last step's compute time
    absl::Duration pushed_at;       // when the last group push became ready
    uint64_t tokens = 0;
    double loss_sum = 0;
    uint32_t segments = 0;
    double compute_seconds = 0;
  };
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
    double steps_per_second = 0;  // measured over the last task; 0 = unknown
    Link up = Link(std::numeric_limits<double>::infinity(), 0);
    Link down = Link(std::numeric_limits<double>::infinity(), 0);
    // Encodes this worker's pushes; its state (error feedback, warm starts) lives as long as
    // the worker's process: across rejoins, not across a leave or crash.
    std::unique_ptr<WorkerPushCodec> codec;
    // The round state while kTraining. next, next_base: the task whose base is being pulled
    // (or has arrived), and that base. computing: the round whose compute runs
    // (compute_running) or has ended, until its push starts or it becomes `trained`, a computed
    // round whose push goes in the background of the next round (overlap). uploading: the push
    // on the uplink, in the background half of a round (background_upload) or at its end.
    std::optional<v1::Task> next;
    std::vector<std::vector<float>> next_base;
    std::optional<Round> computing;
    bool compute_running = false;
    absl::Duration compute_start;
    std::optional<Round> trained;
    std::optional<Round> uploading;
    bool background_upload = false;
    bool communicating = false;  // overlap: the background half of the round is not done
    bool ahead_held = false;     // a look-ahead request answered WAIT is being held
    uint64_t ahead_token = 0;    // bumped when a hold ends: its deadline event is stale
    size_t pending = 0;          // live round events of this worker in the queue
    absl::Duration joined_at;
    absl::Duration compute_time;
    absl::Duration present_time;
    Stream stream;  // partial synchronization (K > 1) only
  };

  // Round events (each leads to a push), membership and lease-expiry events can change the
  // server state; heartbeats and ticks only let time-based state move.
  static bool IsProgress(EventKind kind) {
    return kind != EventKind::kHeartbeat && kind != EventKind::kTick;
  }

  absl::Duration Now() const { return clock_.Now() - start_; }
  std::string Where(const Worker& w) const {
    return absl::StrFormat("t=%.6fs worker %d", absl::ToDoubleSeconds(Now()), w.index);
  }
  void Schedule(absl::Duration at, EventKind kind, int worker, uint64_t epoch, uint64_t token = 0);
  // A round event of `w` at `at`: handled at once when `at` is now (an instant transfer), so
  // that a run without links has exactly the events of one without a network model.
  absl::Status After(Worker& w, absl::Duration at, EventKind kind);
  absl::Status Dispatch(Worker& w, EventKind kind);
  absl::Status Handle(const Event& event);
  absl::Status Join(Worker& w);
  absl::Status Ask(Worker& w, bool allow_rejoin = true);
  // The round of a task: pull its base, compute, push (sim/simulator.h, the worker loop and
  // overlap).
  absl::Status StartTraining(Worker& w, const v1::Task& task);
  absl::Status BeginPull(Worker& w, const v1::Task& task);
  absl::Status OnPulled(Worker& w);
  absl::Status StartRound(Worker& w);
  absl::Status Compute(Worker& w, const v1::Task& task, std::vector<std::vector<float>> base);
  // The steps of `task` from the worker's step times (H or the A-EDiT budget's) and their
  // duration; the cursor is not moved.
  uint32_t TaskSteps(const Worker& w, const v1::Task& task, absl::Duration* duration) const;
  // One Train call of `steps` on the task's data shard.
  absl::StatusOr<TrainStats> RunTrainer(Worker& w, const v1::Task& task, uint32_t steps,
                                        uint64_t lr_step, uint64_t seed);
  absl::Status OnComputed(Worker& w);
  absl::Status EndCommunication(Worker& w);
  absl::Status EndRound(Worker& w);
  absl::Status OnUploaded(Worker& w);
  absl::Status AskAhead(Worker& w);
  void EndHold(Worker& w);
  // SubmitUpdate of w.uploading, its row and the heartbeat after it; true when accepted.
  bool Submit(Worker& w);
  // Encodes the round's update as the worker pushes it and puts what the server decodes in its
  // place (WorkerPushCodec); returns the push's bytes.
  uint64_t Encode(Worker& w, Round& round);
  // SubmitUpdate of the round's update (or its refusal, when the server could not decode it)
  // and its CSV row; `before` is the version (the group's, for a group push) it would see. A
  // push that ends its task also counts the task's steps and heartbeats the measured speed, as
  // the daemon does after a round.
  absl::StatusOr<v1::PushReply> SubmitAndRecord(Worker& w, Round round, uint64_t before);
  // The round's end without overlap: submit, then ask for the next task.
  absl::Status Push(Worker& w);
  absl::Status Leave(Worker& w);
  void Crash(Worker& w);
  // Marks the worker's current membership over; its in-flight push becomes stale.
  void EndMembership(Worker& w);
  absl::Status WakeWaiters();
  void EnsureTick();
  bool AnyWaiting() const;
  bool AnyHeld() const;
  void FinishStats();
  absl::Status MaybeEvaluate();
  absl::Status EvaluateNow();
  // --- Partial synchronization (K > 1): the streaming round (see Stream).
  bool streaming() const { return core_->num_layer_groups() > 1; }
  absl::Status StreamTask(Worker& w, const v1::Task& task);
  // Runs the worker's next action: a merge that is due, a group push, a segment of steps, or
  // the next task.
  absl::Status Advance(Worker& w);
  absl::Status TrainSegment(Worker& w, uint32_t steps);
  absl::Status OnSegmentDone(Worker& w);
  absl::Status PushGroup(Worker& w, uint32_t group);
  absl::Status OnGroupUploaded(Worker& w);
  // start_group, then the pull of the group (or WAIT: wants_grant).
  absl::Status TakeGroup(Worker& w);
  absl::Status OnGroupPulled(Worker& w);
  absl::StatusOr<SyncSchedule> ScheduleFor(const Worker& w, uint32_t period) const;

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
  uint64_t pull_bytes_ = 0;
  uint64_t push_bytes_ = 0;
  // Per layer group: its layers, parameters and transfer bytes (K > 1).
  std::vector<std::vector<uint32_t>> group_layers_;
  std::vector<uint64_t> group_params_;
  std::vector<uint64_t> group_pull_bytes_;
  // The server link's directions (pushes in, pulls out), when there is one.
  std::optional<Link> server_up_;
  std::optional<Link> server_down_;

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
  if (!options_.links.empty() && options_.links.size() != 1 &&
      options_.links.size() != options_.workers.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d links for %d workers: give one link for every worker, or one per worker",
        options_.links.size(), options_.workers.size()));
  }
  const auto check_link = [](const LinkSpec& l, const std::string& what) {
    if (!(l.up_bytes_per_second > 0) || !(l.down_bytes_per_second > 0) ||
        !std::isfinite(l.latency_seconds) || l.latency_seconds < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: rates must be > 0 and the latency finite and >= 0 (got %g/%g bytes/s, %g s)", what,
          l.up_bytes_per_second, l.down_bytes_per_second, l.latency_seconds));
    }
    return absl::OkStatus();
  };
  for (size_t i = 0; i < options_.links.size(); ++i) {
    ALOE_RETURN_IF_ERROR(check_link(options_.links[i], absl::StrCat("link ", i)));
  }
  if (options_.server_link.has_value()) {
    const LinkSpec& l = *options_.server_link;
    ALOE_RETURN_IF_ERROR(check_link(l, "the server link"));
    server_up_.emplace(l.up_bytes_per_second, l.latency_seconds);
    server_down_.emplace(l.down_bytes_per_second, l.latency_seconds);
  }
  if (!std::isfinite(options_.peak_window_seconds) || !(options_.peak_window_seconds > 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "peak_window_seconds must be finite and > 0, got %g", options_.peak_window_seconds));
  }
  if (options_.target_loss.has_value() && !std::isfinite(*options_.target_loss)) {
    return absl::InvalidArgumentError("the target loss must be finite");
  }
  workers_.resize(options_.workers.size());
  for (size_t i = 0; i < workers_.size(); ++i) {
    workers_[i].index = static_cast<int>(i);
    workers_[i].trainer = trainers_[i].get();
    for (double s : options_.workers[i].cycle()) workers_[i].cycle.push_back(absl::Seconds(s));
    if (!options_.links.empty()) {
      const LinkSpec& l = options_.links[options_.links.size() == 1 ? 0 : i];
      workers_[i].up = Link(l.up_bytes_per_second, l.latency_seconds);
      workers_[i].down = Link(l.down_bytes_per_second, l.latency_seconds);
    }
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
  pull_bytes_ = PullBytes(core_->spec());
  for (Worker& w : workers_) {
    w.codec = std::make_unique<WorkerPushCodec>(core_->spec(), config_.transport());
  }
  push_bytes_ = PushBytes(core_->spec(), config_.transport());
  if (streaming()) {
    if (options_.overlap != Overlap::kOff) {
      return absl::InvalidArgumentError(
          "overlap is not used with layer groups (partial_sync.groups > 1): the group pushes "
          "overlap the training");
    }
    group_layers_ = LayersOfGroups(core_->layer_groups());
    for (const std::vector<uint32_t>& layers : group_layers_) {
      const std::vector<size_t> ids(layers.begin(), layers.end());
      uint64_t params = 0;
      for (uint32_t l : layers) params += core_->spec().layers(static_cast<int>(l)).num_elements();
      group_params_.push_back(params);
      group_pull_bytes_.push_back(PullBytes(core_->spec(), ids));
    }
  }
  return absl::OkStatus();
}

void Simulator::Engine::Schedule(absl::Duration at, EventKind kind, int worker, uint64_t epoch,
                                 uint64_t token) {
  queue_.push(Event{at, next_seq_++, kind, worker, epoch, token});
  if (IsProgress(kind)) ++pending_progress_;
}

absl::Status Simulator::Engine::After(Worker& w, absl::Duration at, EventKind kind) {
  if (at <= Now()) return Dispatch(w, kind);
  Schedule(at, kind, w.index, w.epoch);
  ++w.pending;
  return absl::OkStatus();
}

bool Simulator::Engine::AnyWaiting() const {
  for (const Worker& w : workers_) {
    if (w.stream.wants_grant && w.state == State::kTraining) return true;
    if (w.state == State::kWaiting) return true;
  }
  return false;
}

bool Simulator::Engine::AnyHeld() const {
  for (const Worker& w : workers_) {
    if (w.ahead_held) return true;
  }
  return false;
}

void Simulator::Engine::FinishStats() {
  const double window = options_.peak_window_seconds;
  result_.workers.clear();
  for (Worker& w : workers_) {
    if (w.state != State::kAbsent) {
      w.present_time += Now() - w.joined_at;
      if (w.compute_running) w.compute_time += Now() - w.compute_start;
    }
    WorkerStats stats;
    stats.compute_seconds = absl::ToDoubleSeconds(w.compute_time);
    stats.present_seconds = absl::ToDoubleSeconds(w.present_time);
    stats.utilization =
        stats.present_seconds > 0 ? stats.compute_seconds / stats.present_seconds : 0;
    stats.bytes_up = w.up.bytes();
    stats.bytes_down = w.down.bytes();
    stats.peak_up_bytes_per_second = w.up.PeakBytesPerSecond(absl::Seconds(window));
    stats.peak_down_bytes_per_second = w.down.PeakBytesPerSecond(absl::Seconds(window));
    result_.workers.push_back(stats);
  }
}

absl::StatusOr<SimResult> Simulator::Engine::Run() {
  if (ran_) return absl::FailedPreconditionError("Simulator::Run may be called only once");
  ran_ = true;
  result_.updates_per_worker.assign(workers_.size(), 0);
  result_.rejected_per_worker.assign(workers_.size(), 0);
  result_.target_loss = options_.target_loss;
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
  FinishStats();
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
    case EventKind::kPulled:
    case EventKind::kComputed:
    case EventKind::kUploaded:
    case EventKind::kAheadDeadline:
    case EventKind::kSegmentDone:
    case EventKind::kGroupUploaded:
    case EventKind::kGroupPulled:
      // A round event that went stale (leave, crash) was already uncounted by EndMembership, a
      // deadline of a hold that ended by EndHold.
      if (event.epoch != w.epoch || w.state != State::kTraining) return absl::OkStatus();
      if (event.kind == EventKind::kAheadDeadline &&
          (!w.ahead_held || event.token != w.ahead_token)) {
        return absl::OkStatus();
      }
      --pending_progress_;
      --w.pending;
      last_progress_ = Now();
      ALOE_RETURN_IF_ERROR(Dispatch(w, event.kind));
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

absl::Status Simulator::Engine::Dispatch(Worker& w, EventKind kind) {
  switch (kind) {
    case EventKind::kPulled:
      return OnPulled(w);
    case EventKind::kComputed:
      return OnComputed(w);
    case EventKind::kUploaded:
      return OnUploaded(w);
    case EventKind::kAheadDeadline:
      // The service answers the held request WAIT: this round is pushed without overlap.
      w.ahead_held = false;
      ++w.ahead_token;
      return EndCommunication(w);
    case EventKind::kSegmentDone:
      return OnSegmentDone(w);
    case EventKind::kGroupUploaded:
      return OnGroupUploaded(w);
    case EventKind::kGroupPulled:
      return OnGroupPulled(w);
    default:
      return absl::InternalError("not a round event");
  }
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
  w.joined_at = Now();
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
      if (streaming()) return StreamTask(w, *task);
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
  w.state = State::kTraining;
  return BeginPull(w, task);
}

absl::Status Simulator::Engine::BeginPull(Worker& w, const v1::Task& task) {
  // The pulled version is taken now: the core keeps it for the task until it is pulled.
  v1::PullRequest pull;
  pull.set_worker_id(w.id);
  pull.set_version(task.base_version());
  absl::StatusOr<server::ModelSnapshot> snapshot = core_->SnapshotFor(pull);
  if (!snapshot.ok()) {
    return absl::Status(snapshot.status().code(),
                        absl::StrCat(Where(w), ": pull failed: ", snapshot.status().message()));
  }
  w.next_base.clear();
  w.next_base.reserve(snapshot->layers.size());
  for (const auto& layer : snapshot->layers) w.next_base.push_back(*layer);
  w.next = task;
  w.codec->SetTaskRanks(task);
  return After(w, w.down.Enqueue(pull_bytes_, Now(), server_down_ ? &*server_down_ : nullptr),
               EventKind::kPulled);
}

absl::Status Simulator::Engine::OnPulled(Worker& w) {
  if (w.communicating) return EndCommunication(w);  // the look-ahead task's base is here
  return StartRound(w);
}

absl::Status Simulator::Engine::StartRound(Worker& w) {
  const v1::Task task = *std::move(w.next);
  w.next.reset();
  std::vector<std::vector<float>> base = std::move(w.next_base);
  w.next_base.clear();
  if (w.trained.has_value() && options_.overlap == Overlap::kEager) {
    // Paper 004: the base lacks the previous round's own update; add it, scaled by the outer lr.
    const float lr = config_.outer_optimizer().lr();
    const auto& delta = w.trained->update.layers;
    for (size_t l = 0; l < base.size() && l < delta.size(); ++l) {
      kernels::WeightedAccumulate(delta[l].data(), -lr, base[l].data(), base[l].size());
    }
  }
  ALOE_RETURN_IF_ERROR(Compute(w, task, std::move(base)));
  if (options_.overlap == Overlap::kOff) return absl::OkStatus();
  // The background half: push the previous round, then ask for the look-ahead task and pull it.
  w.communicating = true;
  if (!w.trained.has_value()) return AskAhead(w);
  w.uploading = std::move(w.trained);
  w.trained.reset();
  w.background_upload = true;
  const uint64_t bytes = Encode(w, *w.uploading);
  return After(w, w.up.Enqueue(bytes, Now(), server_up_ ? &*server_up_ : nullptr),
               EventKind::kUploaded);
}

uint32_t Simulator::Engine::TaskSteps(const Worker& w, const v1::Task& task,
                                      absl::Duration* duration) const {
  // H, or the A-EDiT budget's first step end at or after tau_time (paper 000 Sec. 3.3), capped
  // at local_steps; at least one step.
  const uint32_t cap = std::max<uint32_t>(1, task.local_steps());
  const absl::Duration budget = absl::Seconds(task.time_budget_seconds());
  const bool budgeted = task.time_budget_seconds() > 0;
  uint32_t steps = 0;
  size_t cursor = w.cursor;
  *duration = absl::ZeroDuration();
  while (steps < cap && (!budgeted || steps == 0 || *duration < budget)) {
    *duration += w.cycle[cursor];
    cursor = (cursor + 1) % w.cycle.size();
    ++steps;
  }
  return steps;
}

absl::StatusOr<TrainStats> Simulator::Engine::RunTrainer(Worker& w, const v1::Task& task,
                                                         uint32_t steps, uint64_t lr_step,
                                                         uint64_t seed) {
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
  train.lr_step = lr_step;
  train.seed = seed;
  absl::StatusOr<TrainStats> stats = w.trainer->Train(train);
  if (!stats.ok()) {
    return absl::Status(stats.status().code(),
                        absl::StrCat(Where(w), ": training failed: ", stats.status().message()));
  }
  return stats;
}

absl::Status Simulator::Engine::Compute(Worker& w, const v1::Task& task,
                                        std::vector<std::vector<float>> base) {
  absl::Duration duration;
  const uint32_t steps = TaskSteps(w, task, &duration);
  w.cursor = (w.cursor + steps) % w.cycle.size();

  ALOE_RETURN_IF_ERROR(w.trainer->SetParameters(base));
  ALOE_ASSIGN_OR_RETURN(const TrainStats stats,
                        RunTrainer(w, task, steps, task.lr_step(), task.seed()));
  w.computing = Round();
  server::PendingUpdate& u = w.computing->update;
  ALOE_RETURN_IF_ERROR(w.trainer->PseudoGradient(base, &u.layers));
  u.worker_id = w.id;
  u.task_id = task.task_id();
  u.update_id = w.next_update_id++;
  u.base_version = task.base_version();
  u.steps_done = steps;
  u.tokens_learned = stats.tokens;
  u.train_loss = stats.mean_loss;
  u.compute_seconds = absl::ToDoubleSeconds(duration);
  w.computing->shard = task.shard_name();
  w.compute_running = true;
  w.compute_start = Now();
  Schedule(Now() + duration, EventKind::kComputed, w.index, w.epoch);
  ++w.pending;
  return absl::OkStatus();
}

absl::Status Simulator::Engine::OnComputed(Worker& w) {
  w.compute_running = false;
  w.compute_time += Now() - w.compute_start;
  if (w.communicating) return absl::OkStatus();  // EndCommunication ends the round
  return EndRound(w);
}

absl::Status Simulator::Engine::EndCommunication(Worker& w) {
  w.communicating = false;
  if (w.compute_running) return absl::OkStatus();  // OnComputed ends the round
  return EndRound(w);
}

absl::Status Simulator::Engine::EndRound(Worker& w) {
  if (w.next.has_value()) {
    // A pulled look-ahead task: train it now and push this round in its background.
    w.trained = std::move(w.computing);
    w.computing.reset();
    return StartRound(w);
  }
  // No task ahead (no overlap, or none came): push this round now, then ask as usual.
  w.uploading = std::move(w.computing);
  w.computing.reset();
  w.background_upload = false;
  const uint64_t bytes = Encode(w, *w.uploading);
  return After(w, w.up.Enqueue(bytes, Now(), server_up_ ? &*server_up_ : nullptr),
               EventKind::kUploaded);
}

absl::Status Simulator::Engine::OnUploaded(Worker& w) {
  if (!w.background_upload) return Push(w);
  // As the daemon: no look-ahead request after a failed push.
  if (!Submit(w)) return EndCommunication(w);
  return AskAhead(w);
}

absl::Status Simulator::Engine::AskAhead(Worker& w) {
  v1::TaskRequest request;
  request.set_worker_id(w.id);
  request.set_ahead(true);
  absl::StatusOr<v1::Task> task = core_->RequestTask(request);
  if (task.ok() && task->kind() == v1::Task::WAIT && !task->draining()) {
    // Held by the service until the core changes (WakeWaiters asks again) or kAheadHold passes.
    if (!w.ahead_held) {
      w.ahead_held = true;
      Schedule(Now() + kAheadHold, EventKind::kAheadDeadline, w.index, w.epoch, w.ahead_token);
      ++w.pending;
      EnsureTick();
    }
    return absl::OkStatus();
  }
  EndHold(w);
  if (task.ok() && task->kind() == v1::Task::TRAIN && w.computing.has_value() &&
      task->task_id() != w.computing->update.task_id) {
    return BeginPull(w, *task);
  }
  // STOP, draining, an error (e.g. dropped): this round is pushed without overlap.
  return EndCommunication(w);
}

void Simulator::Engine::EndHold(Worker& w) {
  if (!w.ahead_held) return;
  // Its deadline event becomes stale; it no longer counts as pending.
  w.ahead_held = false;
  ++w.ahead_token;
  --w.pending;
  --pending_progress_;
}

bool Simulator::Engine::Submit(Worker& w) {
  Round round = *std::move(w.uploading);
  w.uploading.reset();
  return SubmitAndRecord(w, std::move(round), core_->version()).ok();
}

uint64_t Simulator::Engine::Encode(Worker& w, Round& round) {
  const EncodedPush push = w.codec->Encode(
      round.update, streaming() ? core_->layer_groups() : absl::Span<const uint32_t>());
  round.bytes = push.bytes;
  round.refused = push.status;
  return push.bytes;
}

absl::StatusOr<v1::PushReply> Simulator::Engine::SubmitAndRecord(Worker& w, Round round,
                                                                 uint64_t before) {
  server::PendingUpdate& update = round.update;
  const std::string& shard = round.shard;
  const uint64_t base = update.base_version;
  const bool ends_task = !update.task_continues;
  const uint32_t steps = update.steps_done;
  const double seconds = update.compute_seconds;
  SimRow row;
  row.virtual_seconds = absl::ToDoubleSeconds(Now());
  row.worker = w.index;
  row.shard = shard;
  row.steps = ends_task ? steps : 0;
  result_.pushed_bytes += round.bytes;
  absl::StatusOr<v1::PushReply> reply =
      round.refused.ok() ? core_->SubmitUpdate(std::move(update))
                         : absl::StatusOr<v1::PushReply>(absl::Status(
                               round.refused.code(), absl::StrCat("the server refused the push: ",
                                                                  round.refused.message())));
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
  if (!ends_task) return reply;
  result_.total_local_steps += steps;
  // What the daemon's heartbeat reports after a round (DyLU's speed estimate).
  w.steps_per_second = seconds > 0 ? steps / seconds : 0;
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_worker_id(w.id);
  heartbeat.set_steps_per_second(w.steps_per_second);
  (void)core_->Heartbeat(heartbeat);  // kNotFound is handled by Ask (rejoin)
  return reply;
}

absl::Status Simulator::Engine::Push(Worker& w) {
  Submit(w);
  w.state = State::kWaiting;
  return Ask(w);
}

absl::Status Simulator::Engine::Leave(Worker& w) {
  v1::LeaveRequest request;
  request.set_worker_id(w.id);
  absl::Status status = core_->Leave(request);
  EndMembership(w);
  w.codec->Reset();  // the worker's process ends
  if (!status.ok() && status.code() != absl::StatusCode::kNotFound) {
    return absl::Status(status.code(),
                        absl::StrCat(Where(w), ": Leave failed: ", status.message()));
  }
  return absl::OkStatus();
}

void Simulator::Engine::Crash(Worker& w) {
  EndMembership(w);
  w.codec->Reset();  // the worker's process ends
  // The core notices at the first Tick after the lease ran out (renewals were at or before now).
  Schedule(Now() + absl::Seconds(config_.lease_seconds()), EventKind::kExpiry, -1, 0);
}

void Simulator::Engine::EndMembership(Worker& w) {
  // Its round events are now stale.
  pending_progress_ -= w.pending;
  w.pending = 0;
  if (w.state != State::kAbsent) w.present_time += Now() - w.joined_at;
  if (w.compute_running) w.compute_time += Now() - w.compute_start;
  w.next.reset();
  w.next_base.clear();
  w.computing.reset();
  w.compute_running = false;
  w.trained.reset();
  w.uploading.reset();
  w.background_upload = false;
  w.communicating = false;
  w.ahead_held = false;
  ++w.ahead_token;
  w.stream = Stream();
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
      if (w.stream.wants_grant && w.state == State::kTraining) {
        w.stream.wants_grant = false;
        ALOE_RETURN_IF_ERROR(TakeGroup(w));
        if (!w.stream.wants_grant) changed = true;
        continue;
      }
      if (w.ahead_held) {
        ALOE_RETURN_IF_ERROR(AskAhead(w));
        if (!w.ahead_held) changed = true;
        continue;
      }
      if (w.state != State::kWaiting) continue;
      ALOE_RETURN_IF_ERROR(Ask(w));
      if (w.state != State::kWaiting) changed = true;
    }
  }
  EnsureTick();
  return absl::OkStatus();
}

void Simulator::Engine::EnsureTick() {
  if (tick_pending_ || !(AnyWaiting() || AnyHeld())) return;
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
  if (options_.target_loss.has_value() && !result_.target_seconds.has_value() &&
      *loss <= *options_.target_loss) {
    result_.target_seconds = absl::ToDoubleSeconds(Now());
  }
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

// --- Partial synchronization: the streaming round ------------------------------------------

absl::StatusOr<SyncSchedule> Simulator::Engine::ScheduleFor(const Worker& w,
                                                            uint32_t period) const {
  const v1::PartialSyncConfig& partial = config_.partial_sync();
  const uint32_t groups = core_->num_layer_groups();
  switch (partial.schedule()) {
    case v1::SYNC_SCHEDULE_EQUAL_NUMBER:
      return EqualNumberSchedule(groups, period);
    case v1::SYNC_SCHEDULE_DREAMDDP: {
      // The worker's profile: its mean step time and its link (a worker without a link model
      // hides everything: the search puts every group at the first step).
      double step = 0;
      for (absl::Duration d : w.cycle) step += absl::ToDoubleSeconds(d);
      step /= static_cast<double>(std::max<size_t>(1, w.cycle.size()));
      LinkProfile link{std::numeric_limits<double>::max(), 0};
      if (!options_.links.empty()) {
        const LinkSpec& l = options_.links[options_.links.size() == 1 ? 0 : w.index];
        link.bytes_per_second = std::min(l.up_bytes_per_second, l.down_bytes_per_second);
        if (!std::isfinite(link.bytes_per_second)) {
          link.bytes_per_second = std::numeric_limits<double>::max();
        }
        link.round_trip_seconds = 2 * l.latency_seconds;
      }
      const double bytes_per_value =
          static_cast<double>(push_bytes_ + pull_bytes_) / 2 /
          static_cast<double>(std::max<uint64_t>(1, pull_bytes_ / sizeof(float)));
      ALOE_ASSIGN_OR_RETURN(UnitCosts costs,
                            UnitCostsFromProfile(step, group_params_, bytes_per_value, link));
      return DreamDdpSchedule(costs, period, partial.fill_bubbles());
    }
    default:
      return StridedSchedule(groups, period);
  }
}

absl::Status Simulator::Engine::StreamTask(Worker& w, const v1::Task& task) {
  Stream& s = w.stream;
  w.state = State::kTraining;
  if (s.held.empty()) {
    // Cold start: every group is taken and pulled before the first step.
    const uint32_t groups = core_->num_layer_groups();
    s.held.assign(groups, false);
    s.version.assign(groups, 0);
    s.global.assign(core_->spec().layers_size(), {});
    for (uint32_t g = 0; g < groups; ++g) s.merges.push_back(Merge{g, 0, true, true});
  }
  absl::Duration duration;
  const uint32_t steps = TaskSteps(w, task, &duration);
  ALOE_ASSIGN_OR_RETURN(SyncSchedule schedule, ScheduleFor(w, steps));
  s.task = task;
  w.codec->SetTaskRanks(task);
  s.period = steps;
  // The period is cyclic: a schedule whose last steps push nothing is shifted so that its last
  // push follows the task's last step, which ends the task (its push without task_continues).
  s.syncs.assign(steps, {});
  int last = static_cast<int>(steps) - 1;
  while (last > 0 && schedule.syncs[last].empty()) --last;
  const uint32_t shift = steps - 1 - static_cast<uint32_t>(last);
  for (uint32_t h = 0; h + shift < steps; ++h) s.syncs[h + shift] = std::move(schedule.syncs[h]);
  s.step = 0;
  s.tokens = 0;
  s.loss_sum = 0;
  s.segments = 0;
  s.compute_seconds = 0;
  return Advance(w);
}

absl::Status Simulator::Engine::Advance(Worker& w) {
  Stream& s = w.stream;
  if (s.pulling.has_value() || s.wants_grant || s.segment > 0) return absl::OkStatus();
  s.wants_upload = false;
  // The groups of the step just done go out first, each as its backward ends (in backward
  // order, queued on the uplink); a group is pushed only against a copy taken after its last
  // push: an older merge of it comes first.
  while (!s.to_push.empty()) {
    const uint32_t g = s.to_push.front();
    bool merged = true;
    for (Merge& m : s.merges) {
      if (m.group == g) m.due = 0, merged = false;
    }
    if (!merged) break;
    s.to_push.pop_front();
    ALOE_RETURN_IF_ERROR(PushGroup(w, g));
  }
  std::stable_sort(s.merges.begin(), s.merges.end(),
                   [](const Merge& a, const Merge& b) { return a.due < b.due; });
  if (!s.merges.empty() && s.merges.front().due <= s.total_steps) {
    if (!s.merges.front().pushed) {
      s.wants_upload = true;  // OnGroupUploaded goes on
      return absl::OkStatus();
    }
    return TakeGroup(w);
  }
  if (s.step < s.period) {
    uint32_t stop = s.step + 1;
    while (stop < s.period && s.syncs[stop - 1].empty()) ++stop;
    if (!s.merges.empty()) {
      const uint64_t due = s.merges.front().due;
      stop = std::min<uint64_t>(stop, s.step + std::max<uint64_t>(1, due - s.total_steps));
    }
    return TrainSegment(w, stop - s.step);
  }
  // The task is done (its last push went with its last step): the next one. While that push
  // is on its way the open task is still this one: the next comes as a look-ahead task.
  const uint64_t done = s.task->task_id();
  s.task.reset();
  if (!s.uploads.empty()) {
    v1::TaskRequest request;
    request.set_worker_id(w.id);
    request.set_ahead(true);
    absl::StatusOr<v1::Task> next = core_->RequestTask(request);
    if (next.ok() && next->kind() == v1::Task::TRAIN && next->task_id() != done) {
      return StreamTask(w, *next);
    }
    // STOP, draining or an error: wait for the push, then ask as usual.
    s.wants_upload = true;
    s.ask_after_upload = true;
    return absl::OkStatus();
  }
  w.state = State::kWaiting;
  return Ask(w);
}

absl::Status Simulator::Engine::TrainSegment(Worker& w, uint32_t steps) {
  Stream& s = w.stream;
  const v1::Task& task = *s.task;
  absl::Duration duration;
  for (uint32_t i = 0; i < steps; ++i) {
    duration += w.cycle[w.cursor];
    s.last_step = w.cycle[w.cursor];
    w.cursor = (w.cursor + 1) % w.cycle.size();
  }
  ALOE_ASSIGN_OR_RETURN(const TrainStats stats,
                        RunTrainer(w, task, steps, task.lr_step() + s.step,
                                   task.seed() + 0x9E3779B97F4A7C15ull * s.step));
  s.tokens += stats.tokens;
  s.loss_sum += stats.mean_loss;
  ++s.segments;
  s.compute_seconds += absl::ToDoubleSeconds(duration);
  s.segment = steps;
  s.segment_seconds = duration;
  w.compute_running = true;
  w.compute_start = Now();
  Schedule(Now() + duration, EventKind::kSegmentDone, w.index, w.epoch);
  ++w.pending;
  return absl::OkStatus();
}

absl::Status Simulator::Engine::OnSegmentDone(Worker& w) {
  Stream& s = w.stream;
  w.compute_running = false;
  w.compute_time += Now() - w.compute_start;
  s.step += s.segment;
  s.total_steps += s.segment;
  s.segment = 0;
  for (uint32_t g : s.syncs[s.step - 1]) s.to_push.push_back(g);
  s.syncs[s.step - 1].clear();  // a segment that stopped for a merge comes back here
  return Advance(w);
}

absl::Status Simulator::Engine::PushGroup(Worker& w, uint32_t group) {
  Stream& s = w.stream;
  const v1::Task& task = *s.task;
  server::PendingUpdate u;
  ALOE_RETURN_IF_ERROR(w.trainer->PseudoGradient(s.global, &u.layers));
  std::vector<bool> in_group(u.layers.size(), false);
  for (uint32_t l : group_layers_[group]) in_group[l] = true;
  for (size_t l = 0; l < u.layers.size(); ++l) {
    if (!in_group[l]) u.layers[l].clear();
  }
  u.worker_id = w.id;
  u.task_id = task.task_id();
  u.update_id = w.next_update_id++;
  u.base_version = s.version[group];
  u.group = group;
  // The task's last push carries its steps, tokens, loss and compute time.
  u.task_continues = s.step < s.period || !s.to_push.empty();
  u.steps_done = s.step;
  u.tokens_learned = u.task_continues ? 0 : s.tokens;
  u.train_loss = s.loss_sum / std::max<uint32_t>(1, s.segments);
  u.compute_seconds = s.compute_seconds;
  Round round;
  round.update = std::move(u);
  const uint64_t bytes = Encode(w, round);
  s.uploads.push_back(std::move(round));
  s.merges.push_back(
      Merge{group, s.total_steps + config_.partial_sync().merge_delay_steps(), false, false});
  s.held[group] = false;
  // Backward runs from the last group to the first: group g's push can start once its own
  // backward is done, before the step's end by the backward time of the groups below it
  // (backward = 2/3 of a step, split by parameters, as common/sync_schedule.h models it).
  uint64_t below = 0, total = 0;
  for (size_t g = 0; g < group_params_.size(); ++g) {
    total += group_params_[g];
    if (g < group) below += group_params_[g];
  }
  const double share =
      static_cast<double>(below) / static_cast<double>(std::max<uint64_t>(1, total));
  const absl::Duration ready = std::max(s.pushed_at, Now() - s.last_step * (2.0 / 3.0 * share));
  s.pushed_at = ready;
  const absl::Duration arrival = w.up.Enqueue(bytes, ready, server_up_ ? &*server_up_ : nullptr);
  return After(w, std::max(Now(), arrival), EventKind::kGroupUploaded);
}

absl::Status Simulator::Engine::OnGroupUploaded(Worker& w) {
  Stream& s = w.stream;
  Round round = std::move(s.uploads.front());
  s.uploads.pop_front();
  const uint32_t group = round.update.group;
  round.shard = s.task.has_value() ? s.task->shard_name() : "";
  const absl::StatusOr<v1::PushReply> reply =
      SubmitAndRecord(w, std::move(round), core_->group_version(group));
  for (Merge& m : s.merges) {
    if (m.group == group && !m.pushed) {
      m.pushed = true;
      // A refused push: the group is taken again as it is, at once.
      if (!reply.ok()) m.replace = true, m.due = 0;
      break;
    }
  }
  if (s.ask_after_upload && s.uploads.empty()) {
    s.ask_after_upload = false;
    s.wants_upload = false;
    w.state = State::kWaiting;
    return Ask(w);
  }
  if (s.wants_upload && !s.ask_after_upload) return Advance(w);
  return absl::OkStatus();
}

absl::Status Simulator::Engine::TakeGroup(Worker& w) {
  Stream& s = w.stream;
  const uint32_t group = s.merges.front().group;
  v1::TaskRequest request;
  request.set_worker_id(w.id);
  request.set_start_group(true);
  request.set_group(group);
  absl::StatusOr<v1::Task> granted = core_->RequestTask(request);
  if (!granted.ok()) {
    if (granted.status().code() == absl::StatusCode::kNotFound) {
      EndMembership(w);
      return Join(w);
    }
    return absl::Status(
        granted.status().code(),
        absl::StrCat(Where(w), ": start_group failed: ", granted.status().message()));
  }
  if (granted->kind() == v1::Task::WAIT) {
    s.wants_grant = true;
    EnsureTick();
    return absl::OkStatus();
  }
  if (granted->kind() == v1::Task::STOP) {
    v1::LeaveRequest leave;
    leave.set_worker_id(w.id);
    (void)core_->Leave(leave);
    EndMembership(w);
    return absl::OkStatus();
  }
  // The pull streams the group's current layers (the core's by_group pull).
  const server::ModelSnapshot snapshot = core_->Snapshot();
  s.pulled.assign(snapshot.layers.size(), {});
  for (uint32_t l : group_layers_[group]) s.pulled[l] = *snapshot.layers[l];
  s.version[group] = snapshot.group_versions[group];
  s.pulling = group;
  return After(
      w, w.down.Enqueue(group_pull_bytes_[group], Now(), server_down_ ? &*server_down_ : nullptr),
      EventKind::kGroupPulled);
}

absl::Status Simulator::Engine::OnGroupPulled(Worker& w) {
  Stream& s = w.stream;
  const uint32_t group = *s.pulling;
  s.pulling.reset();
  const Merge merge = s.merges.front();
  s.merges.pop_front();
  const bool cold =
      std::find(s.global.begin(), s.global.end(), std::vector<float>()) != s.global.end();
  if (cold) {
    for (uint32_t l : group_layers_[group]) s.global[l] = std::move(s.pulled[l]);
    s.held[group] = true;
    if (std::find(s.global.begin(), s.global.end(), std::vector<float>()) == s.global.end()) {
      ALOE_RETURN_IF_ERROR(w.trainer->SetParameters(s.global));
    }
    return Advance(w);
  }
  // Streaming DiLoCo's merge: local = alpha * local + (1 - alpha) * global (alpha = 0 replaces).
  std::vector<std::vector<float>> local;
  ALOE_RETURN_IF_ERROR(w.trainer->PseudoGradient(s.global, &local));  // global - local
  for (size_t l = 0; l < local.size(); ++l) {
    for (size_t i = 0; i < local[l].size(); ++i) local[l][i] = s.global[l][i] - local[l][i];
  }
  const float alpha =
      merge.replace ? 0.0f : static_cast<float>(config_.partial_sync().mixing_alpha());
  for (uint32_t l : group_layers_[group]) {
    std::vector<float>& fresh = s.pulled[l];
    for (size_t i = 0; i < fresh.size(); ++i) {
      local[l][i] = alpha * local[l][i] + (1 - alpha) * fresh[i];
    }
    s.global[l] = std::move(fresh);
  }
  s.held[group] = true;
  ALOE_RETURN_IF_ERROR(w.trainer->SetParameters(local));
  return Advance(w);
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
