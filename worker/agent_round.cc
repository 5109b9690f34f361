// One round of the worker agent (pull, train, push) and an evaluation.
#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/agent.h"

namespace aloe::worker {

absl::StatusOr<const TokenSource*> Agent::Shard(const std::string& file) {
  auto it = shards_.find(file);
  if (it != shards_.end()) return it->second;
  absl::StatusOr<const TokenSource*> shard =
      env_.open_shard ? env_.open_shard(file)
                      : absl::StatusOr<const TokenSource*>(corpus_->Get(file));
  if (!shard.ok()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "training data: %s (--corpus_dir %s must hold the corpus the server was configured with, "
        "prepared by aloe-corpus or scripts/prepare-corpus.sh)",
        shard.status().message(), options_.corpus_dir));
  }
  shards_[file] = *shard;
  return *shard;
}

absl::Status Agent::PullBase(const v1::Task& task, uint64_t* pulled) {
  reporter_.RoundStarted();
  // A rank of a multi-rank node pulls, trains and pushes only its slice of every layer.
  ALOE_RETURN_IF_ERROR(
      AgreeAcrossRanks(session_.Pull(task.base_version(), &base_, pulled).status()));
  session_.ReportPulled(task);
  return absl::OkStatus();
}

absl::Status Agent::Train(const v1::Task& task) {
  const absl::Time t0 = clock_.Now();
  uint64_t pulled = 0;
  ALOE_RETURN_IF_ERROR(PullBase(task, &pulled));
  const absl::Time t1 = clock_.Now();
  double boundary_s = 0;
  ALOE_ASSIGN_OR_RETURN(TrainStats stats, TrainRound(task, base_, &boundary_s));
  const absl::Time t2 = clock_.Now();
  if (stats.steps == 0) return absl::OkStatus();
  uint64_t pushed = 0;
  v1::PushHeader header = session_.Header(task, stats);
  // The node's leader asks for its next task: it comes with the reply when this rank's push is
  // the one that completes the update (always for one rank), saving a RequestTask round trip.
  header.set_want_next_task(leader());
  absl::StatusOr<v1::PushReply> reply = session_.Push(header, delta_, &pushed);
  const absl::Time t3 = clock_.Now();
  if (!reply.ok()) return reply.status();
  if (leader() && reply->has_next_task()) next_task_ = reply->next_task();
  ReportRound(task, stats, *reply,
              RoundCosts{.pulled_bytes = pulled,
                         .pushed_bytes = pushed,
                         .train_s = absl::ToDoubleSeconds(t2 - t1),
                         .round_s = absl::ToDoubleSeconds(t3 - t0),
                         .network_s = absl::ToDoubleSeconds((t1 - t0) + (t3 - t2)),
                         .boundary_s = boundary_s});
  return absl::OkStatus();
}

absl::StatusOr<TrainStats> Agent::TrainRound(const v1::Task& task,
                                             const std::vector<std::vector<float>>& start,
                                             double* boundary_s) {
  return RunRound(
      task, [&] { return trainer_->SetParameters(start); },
      [&] { return trainer_->PseudoGradient(start, &delta_); }, boundary_s);
}

absl::StatusOr<TrainStats> Agent::RunRound(const v1::Task& task,
                                           absl::FunctionRef<absl::Status()> begin,
                                           absl::FunctionRef<absl::Status()> end,
                                           double* boundary_s) {
  *boundary_s = 0;
  ALOE_ASSIGN_OR_RETURN(const TokenSource* data, Shard(task.shard_file()));
  TrainRequest request;
  request.data = data;
  request.shard_name = task.shard_name();
  request.steps = task.local_steps();
  request.lr_step = task.lr_step();
  request.seed = task.seed();
  request.slowdown = options_.slowdown;
  request.time_budget_seconds = task.time_budget_seconds();
  request.interrupt = env_.stop;
  const absl::Time b0 = clock_.Now();
  ALOE_RETURN_IF_ERROR(begin());
  *boundary_s += SecondsSince(b0);
  ALOE_ASSIGN_OR_RETURN(TrainStats stats, trainer_->Train(request));
  if (stats.steps == 0) {
    // Stopped before the first step: nothing to push; leaving hands the task back.
    if (leader()) {
      ALOE_LOG_INFO("worker", "task %d abandoned before its first step (stopping)", task.task_id());
    }
    return stats;
  }
  if (stats.steps < task.local_steps() && task.time_budget_seconds() == 0 && leader()) {
    ALOE_LOG_INFO("worker", "stopping: pushing the %d of %d steps done", stats.steps,
                  task.local_steps());
  }
  const absl::Time e0 = clock_.Now();
  ALOE_RETURN_IF_ERROR(end());
  SaveInnerState(/*now=*/false);
  *boundary_s += SecondsSince(e0);
  return stats;
}

void Agent::ReportRound(const v1::Task& task, const TrainStats& stats, const v1::PushReply& reply,
                        const RoundCosts& costs) {
  reporter_.Round(task, stats, reply, costs, slices(), /*publish=*/leader());
  // Wall time of the steps (an emulated slowdown included): what DyLU should plan with.
  if (leader()) heartbeat_->SetSpeed(costs.train_s > 0 ? stats.steps / costs.train_s : 0);
}

absl::Status Agent::FinishStreamingTask() {
  if (!ending_.has_value()) return absl::OkStatus();
  EndingTask ending = *std::move(ending_);
  ending_.reset();
  absl::StatusOr<v1::PushReply> reply = streaming_->AwaitEnd(&ending.costs);
  if (reply.ok()) {
    ReportRound(ending.task, ending.stats, *reply, ending.costs);
    return absl::OkStatus();
  }
  // kNotFound: the server does not know this worker (the agent joins again). Any other
  // refusal: the background thread gave the task up, and the task ahead goes on.
  if (reply.status().code() == absl::StatusCode::kNotFound) return reply.status();
  ALOE_LOG_WARNING("worker", "the last push of task %d was refused (%s); the task was given up",
                   ending.task.task_id(), reply.status().message());
  return absl::OkStatus();
}

absl::Status Agent::TrainStreaming(const v1::Task& task) {
  ALOE_ASSIGN_OR_RETURN(const TokenSource* data, Shard(task.shard_file()));
  reporter_.RoundStarted();
  // With overlap the next task trains while this one's last push travels.
  const bool ahead = options_.overlap != AgentOptions::Overlap::kOff;
  absl::StatusOr<StreamingTask> run = streaming_->Run(task, data, /*await_end=*/!ahead);
  // The previous task's last push went before this task's pushes: it is answered by now, or
  // soon.
  ALOE_RETURN_IF_ERROR(FinishStreamingTask());
  ALOE_ASSIGN_OR_RETURN(StreamingTask done, std::move(run));
  if (done.stats.steps > 0) SaveInnerState(/*now=*/false);
  if (done.end_in_flight) {
    absl::StatusOr<v1::Task> next = session_.RequestTask(/*ahead=*/true, /*given_up_task_id=*/0);
    ending_ = EndingTask{task, done.stats, done.costs};
    if (next.ok() && next->kind() == v1::Task::TRAIN) {
      next_task_ = *std::move(next);
      next_task_ahead_ = true;
      reporter_.TaskTakenAhead();
      return absl::OkStatus();
    }
    // No task ahead (stopping, draining, an error): the task ends as without overlap.
    return FinishStreamingTask();
  }
  if (done.server_stopped && !done.ended) {
    // Training is over while the task was open: give it up; the answer (STOP) comes next.
    absl::StatusOr<v1::Task> next = session_.RequestTask(/*ahead=*/false, task.task_id());
    if (next.ok()) next_task_ = *std::move(next);
    return absl::OkStatus();
  }
  if (!done.ended) {
    if (done.stats.steps == 0 && !done.server_stopped) {
      ALOE_LOG_INFO("worker", "task %d abandoned before its first step (stopping)", task.task_id());
    }
    return absl::OkStatus();
  }
  if (done.reply.has_next_task()) next_task_ = done.reply.next_task();
  ReportRound(task, done.stats, done.reply, done.costs);
  return absl::OkStatus();
}

absl::Status Agent::Evaluate(const v1::Task& task) {
  uint64_t pulled = 0;
  ALOE_ASSIGN_OR_RETURN(uint64_t version, session_.Pull(task.base_version(), &base_, &pulled));
  ALOE_RETURN_IF_ERROR(trainer_->SetParameters(base_));
  ALOE_ASSIGN_OR_RETURN(const TokenSource* heldout, Shard(session_.joined().heldout_file()));
  EvalRequest eval;
  eval.heldout = heldout;
  eval.max_sequences = options_.eval_sequences;
  ALOE_ASSIGN_OR_RETURN(double loss, trainer_->Evaluate(eval));
  const uint64_t seq = session_.joined().model().seq_len();
  const uint64_t windows =
      std::min<uint64_t>(options_.eval_sequences, heldout->num_tokens() / (seq + 1));
  v1::EvalReport report;
  report.set_worker_id(session_.worker_id());
  report.set_task_id(task.task_id());
  report.set_version(version);
  report.set_loss(loss);
  report.set_tokens(std::max<uint64_t>(1, windows * seq));
  ALOE_RETURN_IF_ERROR(session_.ReportEval(report));
  reporter_.Evaluated(version, loss, pulled);
  return absl::OkStatus();
}

absl::Status Agent::AgreeAcrossRanks(absl::Status status) {
  if (env_.node == nullptr) return status;
  ALOE_ASSIGN_OR_RETURN(const double failed, env_.node->AllReduceSum(status.ok() ? 0 : 1));
  if (!status.ok() || failed == 0) return status;
  return absl::UnavailableError(
      absl::StrFormat("%d other rank(s) of this node failed; the node drops the round together",
                      static_cast<int>(failed)));
}

}  // namespace aloe::worker
