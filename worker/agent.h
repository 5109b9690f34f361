// The worker agent: the life of one aloe-worker process against aloe-server. It joins, keeps
// its lease alive (Heartbeat), then loops: request a task, pull the global model of the task's
// version, run the trainer's local steps (paper 002 Alg. 1, inner part) and push the
// pseudo-gradient theta_base - theta_end; or, as an evaluator, report the held-out loss of new
// versions. Optionally it overlaps a round's push and the next pull with the next round's
// training (paper 004). On a stop request it ends the round at the next step end, pushes the
// steps done, leaves and returns.
//
// Everything it talks to is injected (AgentEnv, worker/agent_options.h): the server
// (ServerApi), the trainer (through a factory called once the join reply names the model), the
// clock and the ways it waits, so tests run it against fakes without network, LibTorch or wall
// clock. In a multi-rank node every rank runs an agent over the node's collectives; rank 0 (the
// leader) talks to the coordinator for the node and tells the other ranks what to do.
//
// Its parts: ServerSession (join, pulls, pushes), Heartbeat (the lease), TaskDrops (dropped
// tasks and their backoff), RoundReporter (metrics, log lines, summary). The agent's own code is
// the task loop (agent.cc), one round and an evaluation (agent_round.cc) and overlapped rounds
// (agent_overlap.cc). With layer groups (partial synchronization) a trainer's tasks run as
// streaming rounds instead (worker/streaming_round.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/token_shard.h"
#include "common/token_source.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"
#include "worker/agent_options.h"
#include "worker/fsdp.h"
#include "worker/heartbeat.h"
#include "worker/inner_state_store.h"
#include "worker/round_report.h"
#include "worker/server_api.h"
#include "worker/server_session.h"
#include "worker/sleeper.h"
#include "worker/streaming_round.h"
#include "worker/task_drops.h"

namespace aloe::worker {

class Agent {
 public:
  Agent(AgentOptions options, AgentEnv env);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Joins and works until the server says STOP or a stop is requested; then leaves (best
  // effort) and returns OK. Dropped tasks (kFailedPrecondition, kNotFound, kUnavailable) are
  // asked for again after a RetryBackoff; an expired lease (a task request or heartbeat answered
  // kNotFound) joins again. Other errors end the run: the agent leaves first, so that its task
  // goes to another worker at once.
  absl::Status Run();

 private:
  struct Communicated;
  struct Pending;

  bool leader() const { return env_.node == nullptr || env_.node->rank() == 0; }
  bool stopping() const { return env_.stop->load(); }
  uint32_t slice() const { return env_.node != nullptr ? env_.node->rank() : 0; }
  uint32_t slices() const { return env_.node != nullptr ? env_.node->size() : 1; }
  double SecondsSince(absl::Time start) const;

  // agent.cc: the task loop.
  // Sets up for a join reply: the session, the trainer (once), the heartbeat (leader).
  absl::Status Joined(const v1::JoinReply& joined);
  absl::Status JoinAgain(const std::string& why);
  // Whether the heartbeat found the lease lost: the leader joins again before asking for work.
  bool LeaseLost() const;
  // The one-process loop, and the multi-rank loop in which the leader asks the server and tells
  // every rank what to do.
  absl::Status RunAlone();
  absl::Status RunNode();
  v1::NodeDirective NextDirective();
  // The next task: the one the last push's reply carried, else RequestTask's answer, naming the
  // task given up since the last answer.
  absl::StatusOr<v1::Task> RequestNextTask();
  absl::StatusOr<v1::Task> RequestNextTaskWithRetries();
  // A WAIT task: notes when the server starts draining.
  void Waiting(const v1::Task& task);
  absl::Status TrainTask(const v1::Task& task);
  // A task that ended in `status`: OK to go on (done, or dropped and the backoff waited), else
  // the status that ends the run, after leaving.
  absl::Status AfterTask(const v1::Task& task, absl::Status status);
  absl::Status Finish();
  void Leave();
  // The inner optimizer state (AgentOptions::state_dir): restored once, when the trainer is
  // made (every rank of a node restores, or none does); saved after rounds and at the end.
  // Neither fails the run: a state that cannot be used or kept is logged and counted.
  absl::Status RestoreInnerState(const v1::JoinReply& joined);
  void SaveInnerState(bool now);

  // agent_round.cc: one round, an evaluation.
  // The token shard `file`. A missing or unreadable file is this node's setup, never the
  // server's: kInvalidArgument, so it ends the run instead of being retried as a dropped task.
  absl::StatusOr<const TokenSource*> Shard(const std::string& file);
  // Pulls the base version of `task` (this rank's slices) into base_, every rank together, and
  // reports it pulled.
  absl::Status PullBase(const v1::Task& task, uint64_t* pulled);
  absl::Status Train(const v1::Task& task);
  // Local work of one round from `start`; leaves start - end in delta_.
  absl::StatusOr<TrainStats> TrainRound(const v1::Task& task,
                                        const std::vector<std::vector<float>>& start,
                                        double* boundary_s);
  // Local work of one round: `begin` puts the round's start into the trainer, `end` takes its
  // pseudo-gradient (not called when no step was taken); then the inner state is saved when due.
  // *boundary_s: the time spent outside the trainer's steps (RoundCosts::boundary_s).
  absl::StatusOr<TrainStats> RunRound(const v1::Task& task, absl::FunctionRef<absl::Status()> begin,
                                      absl::FunctionRef<absl::Status()> end, double* boundary_s);
  // Totals, metrics, the log line and the heartbeat's speed for a round whose push was answered.
  void ReportRound(const v1::Task& task, const TrainStats& stats, const v1::PushReply& reply,
                   const RoundCosts& costs);
  absl::Status Evaluate(const v1::Task& task);
  // A task under partial synchronization (StreamingRounds): its groups pushed and merged while
  // it trains. With overlap the next task is taken ahead while the task's last push travels
  // (ending_ then waits to be reported).
  absl::Status TrainStreaming(const v1::Task& task);
  // Waits for the last push of the streaming task that ended in flight (if any) and reports its
  // round. A refused push leaves that task open on the server, with the task taken ahead behind
  // it: the task is given up, which makes the one ahead the open task (next_task_ keeps it).
  absl::Status FinishStreamingTask();
  // A multi-rank node acts on `status` only together: OK when every rank's was; else this
  // rank's error, or kUnavailable when only another rank failed. One process: `status`.
  absl::Status AgreeAcrossRanks(absl::Status status);

  // agent_overlap.cc: overlapped rounds.
  absl::Status TrainOverlapped(v1::Task task);
  // The boundary of overlapped rounds (AgentOptions::round_boundary), chosen once the trainer
  // is made.
  RoundBoundary& Boundary();
  // The background half of an overlapped round: takes the pseudo-gradient of `previous` (if
  // any) from the boundary (then sets *taken, also when there is none) and pushes it, asks for
  // the next task, pulls its base and stages it as the next round's start.
  Communicated Communicate(Pending* previous, std::promise<void>* taken);
  // The look-ahead task of a multi-rank node: the leader asks once every rank's push is in
  // (`pushed`: this rank's), and tells the others over the control group.
  absl::StatusOr<v1::Task> AskAheadAsNode(bool pushed);
  // Accounts for the previous round once the background half that pushed it is done.
  void SettlePrevious(Pending* previous, const Communicated& c, double blocked);
  // Whether the node trains the look-ahead task next: all ranks together, or none.
  absl::StatusOr<bool> TrainAhead(const v1::Task& task, const Communicated& c);
  // No task ahead: takes the pseudo-gradient of `pending`, pushes it now and reports its round.
  absl::Status PushNow(Pending& pending);

  const AgentOptions options_;
  const AgentEnv env_;
  const Clock& clock_;
  const std::string name_;  // options.name, or role-pid
  ServerSession session_;
  RoundReporter reporter_;
  TaskDrops drops_;
  std::unique_ptr<TokenShardCache> corpus_;  // when env.open_shard is null
  std::map<std::string, const TokenSource*> shards_;
  std::unique_ptr<TrainerInterface> trainer_;
  RoundBoundary* boundary_ = nullptr;  // Boundary(): the trainer's, or host_boundary_
  std::unique_ptr<RoundBoundary> host_boundary_;
  std::unique_ptr<InnerStateStore> inner_store_;
  uint32_t rounds_unsaved_ = 0;  // rounds trained since the inner state was last saved
  RealSleeper real_sleeper_;     // when env.sleeper is null
  std::unique_ptr<Heartbeat> heartbeat_;
  // A trainer's rounds when the server has layer groups (JoinReply.layer_groups); one per
  // membership.
  std::unique_ptr<StreamingRounds> streaming_;
  // The streaming task whose last push is still on its way (overlap), to be reported.
  struct EndingTask {
    v1::Task task;
    TrainStats stats;
    RoundCosts costs;
  };
  std::optional<EndingTask> ending_;
  bool server_draining_ = false;
  // The task the reply of the last push carried (PushHeader.want_next_task); cleared at joins.
  std::optional<v1::Task> next_task_;
  bool next_task_ahead_ = false;  // next_task_ was taken ahead (streaming overlap)
  std::vector<std::vector<float>> base_;
  std::vector<std::vector<float>> delta_;
};

}  // namespace aloe::worker
