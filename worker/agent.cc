#include "worker/agent.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/worker_metrics.h"

namespace aloe::worker {
namespace {

std::string AgentName(const AgentOptions& options) {
  if (!options.name.empty()) return options.name;
  return absl::StrFormat("%s-%d", options.evaluator ? "evaluator" : "trainer", getpid());
}

v1::NodeDirective Directive(v1::NodeDirective::Kind kind, const absl::Status& error) {
  v1::NodeDirective d;
  d.set_kind(kind);
  if (!error.ok()) d.set_error(error.ToString());
  return d;
}

// Why the agent joins again when the heartbeat found the lease lost.
constexpr char kLeaseLost[] = "a heartbeat found this worker's lease lost";

}  // namespace

Agent::Agent(AgentOptions options, AgentEnv env)
    : options_(std::move(options)),
      env_(std::move(env)),
      clock_(*env_.clock),
      name_(AgentName(options_)),
      session_(options_, env_, name_, slice(), slices()),
      reporter_(*env_.metrics, clock_),
      drops_({.initial = options_.drop_backoff_initial,
              .max = options_.drop_backoff_max,
              .jitter = options_.retry_jitter,
              .first_at_once = true,
              .seed = options_.retry_seed},
             options_.drop_log_interval, clock_) {
  if (!env_.open_shard) corpus_ = std::make_unique<TokenShardCache>(options_.corpus_dir);
}

Agent::~Agent() = default;

double Agent::SecondsSince(absl::Time start) const {
  return absl::ToDoubleSeconds(clock_.Now() - start);
}

absl::Status Agent::Joined(const v1::JoinReply& joined) {
  next_task_.reset();  // a task of the previous membership
  next_task_ahead_ = false;
  ALOE_RETURN_IF_ERROR(session_.Adopt(joined));
  if (trainer_ == nullptr) {
    ALOE_ASSIGN_OR_RETURN(trainer_, env_.make_trainer(joined));
    ALOE_RETURN_IF_ERROR(RestoreInnerState(joined));
  }
  ending_.reset();     // of the previous membership: never reported
  streaming_.reset();  // a new membership takes its layer groups anew
  if (!joined.layer_groups().empty() && !options_.evaluator) {
    if (env_.node != nullptr) {
      return absl::FailedPreconditionError(
          "the server synchronizes layer groups (partial_sync.groups > 1), which a multi-rank "
          "worker does not support: run it with one rank");
    }
    ALOE_ASSIGN_OR_RETURN(streaming_, StreamingRounds::Create({.session = &session_,
                                                               .trainer = trainer_.get(),
                                                               .clock = &clock_,
                                                               .stop = env_.stop,
                                                               .slowdown = options_.slowdown}));
  }
  if (leader()) {
    if (heartbeat_ == nullptr) {
      Sleeper& sleeper = env_.sleeper != nullptr ? *env_.sleeper : real_sleeper_;
      heartbeat_ =
          std::make_unique<Heartbeat>(*env_.server, sleeper, absl::Seconds(joined.lease_seconds()));
    }
    heartbeat_->SetWorker(joined.worker_id());
  }
  reporter_.SetModel(joined);
  if (leader()) {
    ALOE_LOG_INFO("worker", "%s joined as worker %d at version %d%s%s", name_, joined.worker_id(),
                  joined.version(),
                  env_.node != nullptr ? absl::StrFormat(" (%d ranks)", env_.node->size()) : "",
                  joined.shard_addresses().empty()
                      ? ""
                      : absl::StrFormat(" (%d shard processes)", joined.shard_addresses_size()));
  }
  return absl::OkStatus();
}

absl::Status Agent::JoinAgain(const std::string& why) {
  ALOE_LOG_WARNING("worker", "%s; joining again", why);
  ALOE_ASSIGN_OR_RETURN(v1::JoinReply joined, session_.Join());
  return Joined(joined);
}

bool Agent::LeaseLost() const { return heartbeat_ != nullptr && heartbeat_->lease_lost(); }

absl::Status Agent::Run() {
  if (env_.node != nullptr) return RunNode();
  return RunAlone();
}

absl::Status Agent::RunAlone() {
  ALOE_ASSIGN_OR_RETURN(v1::JoinReply joined, session_.Join());
  ALOE_RETURN_IF_ERROR(Joined(joined));
  while (!stopping()) {
    if (LeaseLost()) {
      ALOE_RETURN_IF_ERROR(JoinAgain(kLeaseLost));
      continue;
    }
    absl::StatusOr<v1::Task> task = RequestNextTaskWithRetries();
    if (!task.ok() && task.status().code() == absl::StatusCode::kNotFound) {
      ALOE_RETURN_IF_ERROR(JoinAgain(std::string(task.status().message())));
      continue;
    }
    if (!task.ok() && stopping()) break;  // stopping while the server is away
    if (!task.ok()) return task.status();
    absl::Status status;
    switch (task->kind()) {
      case v1::Task::WAIT:
        Waiting(*task);
        continue;
      case v1::Task::STOP:
        ALOE_LOG_INFO("worker", "server says training is over");
        return Finish();
      case v1::Task::TRAIN:
        status = TrainTask(*task);
        break;
      case v1::Task::EVAL:
        status = Evaluate(*task);
        break;
      default:
        return absl::InvalidArgumentError(absl::StrFormat("unknown task kind %d", task->kind()));
    }
    ALOE_RETURN_IF_ERROR(AfterTask(*task, status));
  }
  return Finish();
}

absl::Status Agent::RunNode() {
  Collectives& node = *env_.node;
  while (true) {
    v1::NodeDirective d;
    std::string bytes;
    if (leader()) {
      d = NextDirective();
      d.SerializeToString(&bytes);
    }
    // Every rank learns the leader's decision (the same bytes), so they act in lockstep.
    ALOE_RETURN_IF_ERROR(node.Broadcast(&bytes, /*root=*/0));
    if (!leader() && !d.ParseFromString(bytes)) {
      return absl::DataLossError("rank 0 sent a malformed node directive");
    }
    if (d.kind() == v1::NodeDirective::STOP) break;
    if (d.kind() == v1::NodeDirective::FAIL) {
      return absl::UnavailableError(absl::StrCat("the node's leader failed: ", d.error()));
    }
    if (d.kind() == v1::NodeDirective::REJOIN) {
      ALOE_RETURN_IF_ERROR(Joined(d.joined()));
      continue;
    }
    const v1::Task& task = d.task();
    if (task.kind() == v1::Task::WAIT) {
      Waiting(task);
      continue;
    }
    if (task.kind() != v1::Task::TRAIN) {
      return absl::InvalidArgumentError(
          absl::StrFormat("a multi-rank node cannot run task kind %d", task.kind()));
    }
    absl::Status status = TrainTask(task);
    // Barrier: every rank's slice has been answered before the leader asks for the next task
    // (else the server, still missing a slice, would hand out this task again).
    ALOE_RETURN_IF_ERROR(node.AllReduceSum(0).status());
    ALOE_RETURN_IF_ERROR(AfterTask(task, status));
  }
  return Finish();
}

v1::NodeDirective Agent::NextDirective() {
  if (stopping()) return Directive(v1::NodeDirective::STOP, absl::OkStatus());
  if (LeaseLost()) {
    ALOE_LOG_WARNING("worker", "%s; joining again", kLeaseLost);
  } else if (session_.member()) {
    absl::StatusOr<v1::Task> task = RequestNextTaskWithRetries();
    if (task.ok()) {
      const bool stop = task->kind() == v1::Task::STOP;
      if (stop) ALOE_LOG_INFO("worker", "server says training is over");
      v1::NodeDirective d =
          Directive(stop ? v1::NodeDirective::STOP : v1::NodeDirective::TASK, absl::OkStatus());
      *d.mutable_task() = *std::move(task);
      return d;
    }
    if (stopping()) return Directive(v1::NodeDirective::STOP, absl::OkStatus());
    if (task.status().code() != absl::StatusCode::kNotFound) {
      return Directive(v1::NodeDirective::FAIL, task.status());
    }
    ALOE_LOG_WARNING("worker", "%s; joining again", task.status().message());
  }
  absl::StatusOr<v1::JoinReply> joined = session_.Join();
  if (!joined.ok()) {
    return Directive(stopping() ? v1::NodeDirective::STOP : v1::NodeDirective::FAIL,
                     joined.status());
  }
  v1::NodeDirective d = Directive(v1::NodeDirective::REJOIN, absl::OkStatus());
  *d.mutable_joined() = *std::move(joined);
  return d;
}

absl::StatusOr<v1::Task> Agent::RequestNextTask() {
  if (next_task_.has_value() && drops_.given_up() == 0) {
    v1::Task task = *std::move(next_task_);
    next_task_.reset();
    if (!next_task_ahead_) reporter_.TaskFromPushReply();
    next_task_ahead_ = false;
    return task;
  }
  next_task_ahead_ = false;
  next_task_.reset();
  absl::StatusOr<v1::Task> task = session_.RequestTask(/*ahead=*/false, drops_.given_up());
  if (task.ok()) drops_.ClearGivenUp();
  return task;
}

absl::StatusOr<v1::Task> Agent::RequestNextTaskWithRetries() {
  const absl::Time t0 = clock_.Now();
  absl::StatusOr<v1::Task> task =
      session_.Retry<v1::Task>("request", [&] { return RequestNextTask(); });
  reporter_.AddNetwork(SecondsSince(t0));
  return task;
}

void Agent::Waiting(const v1::Task& task) {
  if (leader() && task.draining() && !server_draining_) {
    ALOE_LOG_INFO("worker", "server is draining (shutdown or restart): waiting for it");
  }
  server_draining_ = task.draining();
}

absl::Status Agent::TrainTask(const v1::Task& task) {
  if (streaming_ != nullptr) return TrainStreaming(task);
  return options_.overlap != AgentOptions::Overlap::kOff ? TrainOverlapped(task) : Train(task);
}

absl::Status Agent::AfterTask(const v1::Task& task, absl::Status status) {
  if (status.ok()) {
    if (drops_.backoff() > absl::ZeroDuration()) env_.metrics->Set(kRetryBackoff, 0);
    drops_.Done();
    return absl::OkStatus();
  }
  const std::string prefix =
      env_.node != nullptr ? absl::StrFormat("rank %d: ", env_.node->rank()) : "";
  const std::optional<absl::Duration> delay = drops_.Drop(task, status, prefix);
  if (!delay.has_value()) {
    Leave();  // the task goes to another worker at once
    return status;
  }
  env_.metrics->Add(kRetries, 1, {"task"});
  env_.metrics->Set(kRetryBackoff, absl::ToDoubleSeconds(*delay));
  if (*delay > absl::ZeroDuration()) {
    // A shard process that went away is asked again as soon as it is back.
    const absl::Duration rest = session_.AwaitServers(*delay);
    if (rest > absl::ZeroDuration()) env_.sleep(rest);
  }
  return absl::OkStatus();
}

absl::Status Agent::RestoreInnerState(const v1::JoinReply& joined) {
  if (options_.state_dir.empty()) return absl::OkStatus();
  inner_store_ = std::make_unique<InnerStateStore>(
      options_.state_dir, InnerStateOwner{ModelSpecDigest(joined.model_spec()), slice(), slices()});
  absl::StatusOr<InnerState> loaded = inner_store_->Load();
  absl::Status restored = loaded.status();
  if (loaded.ok()) restored = trainer_->RestoreInnerState(*loaded);
  // A node restores on every rank or on none: one rank's moments alone would leave the ranks
  // with different bias corrections.
  absl::Status agreed = restored;
  if (env_.node != nullptr) {
    ALOE_ASSIGN_OR_RETURN(const double failed, env_.node->AllReduceSum(restored.ok() ? 0.0 : 1.0));
    if (restored.ok() && failed > 0) {
      agreed = absl::FailedPreconditionError(absl::StrFormat(
          "%d other rank(s) of this node have no usable state", static_cast<int>(failed)));
    }
  }
  if (agreed.ok()) {
    env_.metrics->Add(kInnerStateRestores, 1, {"restored"});
    ALOE_LOG_INFO("worker", "inner optimizer state restored from %s (%d AdamW steps)",
                  inner_store_->path(), loaded->steps);
    return absl::OkStatus();
  }
  if (restored.ok()) {
    // This rank restored; the node starts fresh together. Zero moments at step 0 are the state
    // of an AdamW that has not stepped.
    InnerState fresh = *std::move(loaded);
    fresh.steps = 0;
    for (auto* moments : {&fresh.first, &fresh.second}) {
      for (std::vector<float>& layer : *moments) std::fill(layer.begin(), layer.end(), 0.0f);
    }
    ALOE_RETURN_IF_ERROR(trainer_->RestoreInnerState(fresh));
  }
  const bool none = agreed.code() == absl::StatusCode::kNotFound;
  env_.metrics->Add(kInnerStateRestores, 1, {none ? "none" : "refused"});
  if (none) {
    ALOE_LOG_INFO("worker", "no inner optimizer state at %s: starting from fresh moments",
                  inner_store_->path());
  } else {
    ALOE_LOG_WARNING("worker", "inner optimizer state not used (%s): starting from fresh moments",
                     agreed.message());
  }
  return absl::OkStatus();
}

void Agent::SaveInnerState(bool now) {
  if (inner_store_ == nullptr) return;
  if (!now && ++rounds_unsaved_ < options_.state_every_rounds) return;
  if (rounds_unsaved_ == 0) return;  // nothing trained since the last save
  absl::StatusOr<InnerState> state = trainer_->SaveInnerState();
  absl::Status saved = state.status();
  if (state.ok()) saved = inner_store_->Save(*state);
  if (!saved.ok()) {
    env_.metrics->Add(kInnerStateSaves, 1, {"failed"});
    ALOE_LOG_WARNING("worker", "inner optimizer state not saved: %s", saved.message());
    return;  // rounds_unsaved_ stays: the next round tries again
  }
  env_.metrics->Add(kInnerStateSaves, 1, {"saved"});
  rounds_unsaved_ = 0;
}

void Agent::Leave() {
  heartbeat_.reset();
  if (leader()) session_.Leave();
}

absl::Status Agent::Finish() {
  if (streaming_ != nullptr) {
    // The last task's push is answered (and reported) before this worker leaves.
    if (absl::Status s = FinishStreamingTask(); !s.ok()) {
      ALOE_LOG_WARNING("worker", "the last task's push: %s", s.message());
    }
  }
  SaveInnerState(/*now=*/true);
  Leave();
  reporter_.Summary();
  return absl::OkStatus();
}

}  // namespace aloe::worker
