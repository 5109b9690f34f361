// The worker agent: the life of one aloe-worker process against aloe-server. It joins, keeps
// its lease alive (a heartbeat thread), then loops: request a task, pull the global model of the
// task's version, run the trainer's local steps (paper 002 Alg. 1, inner part) and push the
// pseudo-gradient theta_base - theta_end; or, as an evaluator, report the held-out loss of new
// versions. Optionally it overlaps a round's push and the next pull with the next round's
// training (paper 004). On a stop request it ends the round at the next step end, pushes the
// steps done, leaves and returns.
//
// Everything it talks to is injected (AgentEnv): the server (ServerApi), the trainer (through a
// factory called once the join reply names the model), the clock and the way it waits, so tests
// run it against fakes without network, LibTorch or wall clock. In a multi-rank node every rank
// runs an agent over the node's collectives; rank 0 (the leader) talks to the coordinator for
// the node and tells the other ranks what to do.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/token_shard.h"
#include "common/token_source.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"
#include "worker/fsdp.h"
#include "worker/server_api.h"

namespace aloe::worker {

// Capped exponential backoff over consecutive failures: no wait after the first, then `initial`,
// doubling up to `max`. Not thread-safe.
class Backoff {
 public:
  Backoff(absl::Duration initial, absl::Duration max) : initial_(initial), max_(max) {}
  // Counts one more failure and returns how long to wait before the next try.
  absl::Duration Failure();
  // A success: the next failure waits nothing again.
  void Reset() { failures_ = 0; }
  uint64_t failures() const { return failures_; }

 private:
  const absl::Duration initial_;
  const absl::Duration max_;
  uint64_t failures_ = 0;
};

struct AgentOptions {
  std::string name;        // shown by the server (JoinRequest.name)
  bool evaluator = false;  // evaluator instead of trainer
  int32_t threads = 1;     // JoinRequest.num_threads
  // TrainRequest.slowdown: >= 1 emulates slower hardware (single-process trainers only).
  double slowdown = 1.0;
  uint32_t eval_sequences = 64;  // held-out windows per evaluation
  // Where a task's data shard file lives (Task.shard_file is relative to it); named in the
  // error when one is missing.
  std::string corpus_dir = "data/sotu";
  // How long calls that fail with kUnavailable (server restarting, not yet up) are retried,
  // and how often.
  absl::Duration connect_timeout = absl::Seconds(60);
  absl::Duration retry_interval = absl::Milliseconds(250);
  // How long to keep asking to join while the server has no room (kResourceExhausted), and how
  // often; zero = give up at once.
  absl::Duration join_wait = absl::Seconds(600);
  absl::Duration join_wait_step = absl::Seconds(5);
  // Waits between consecutive dropped tasks (Backoff); a round that completes resets it.
  absl::Duration drop_backoff_initial = absl::Milliseconds(100);
  absl::Duration drop_backoff_max = absl::Seconds(5);
  // At most one log line per this interval about tasks dropped for want of the server
  // (kUnavailable); the others are logged each.
  absl::Duration drop_log_interval = absl::Seconds(10);
  // Overlapped rounds (paper 004): a round's push and the next pull run while the next round
  // trains; eager also applies the round's pseudo-gradient locally at once.
  enum class Overlap { kOff, kDelayed, kEager };
  Overlap overlap = Overlap::kOff;
  // JoinRequest.model_fingerprint: a bring-your-own model's architecture fingerprint, "" for the
  // built-in transformer; the join reply must name the same. model_source names the model in
  // the error when it does not (e.g. the TorchScript file).
  std::string model_fingerprint;
  std::string model_source;
};

// kInvalidArgument, naming the aloe-worker flag, for a slowdown that is not finite and >= 1,
// threads or eval_sequences < 1, or an evaluator with overlap.
absl::Status ValidateAgentOptions(const AgentOptions& options);

// The worker's Prometheus endpoint at `address` (host:port, port 0 = any), or a sink that
// discards everything for "off". Errors as PrometheusMetrics::Start.
absl::StatusOr<std::unique_ptr<MetricsSink>> StartWorkerMetrics(const std::string& address);

// Makes the trainer once the join reply says what to train (model, inner optimizer, spec,
// seed). Called once per agent.
using TrainerFactory =
    std::function<absl::StatusOr<std::unique_ptr<TrainerInterface>>(const v1::JoinReply& joined)>;

// The agent's dependencies. Every pointer must outlive the agent. Only the heartbeat thread,
// which keeps the server's lease alive, waits on real time instead of `clock`.
struct AgentEnv {
  ServerApi* server = nullptr;
  MetricsSink* metrics = nullptr;
  const Clock* clock = nullptr;
  // Waits `d`, or less once *stop is set.
  std::function<void(absl::Duration d)> sleep;
  // A stop request (SIGINT/SIGTERM): the round ends at the next step end, is pushed, and the
  // agent leaves. Also the trainer's TrainRequest.interrupt.
  const std::atomic<bool>* stop = nullptr;
  TrainerFactory make_trainer;
  // Opens a token shard by its file under the corpus directory; null: TokenShard files under
  // AgentOptions::corpus_dir. What it returns must live as long as the agent.
  std::function<absl::StatusOr<const TokenSource*>(const std::string& file)> open_shard;
  // Null for a one-process worker; else this process is rank node->rank() of a multi-rank node
  // (FSDP). control: with overlap in a multi-rank node, a second process group over the same
  // ranks for the background half of overlapped rounds.
  Collectives* node = nullptr;
  Collectives* control = nullptr;
};

// Sleeps `d` of wall time, or until `stop` is set (checked every 50 ms): AgentEnv::sleep for a
// real process.
void SleepUnlessStopped(absl::Duration d, const std::atomic<bool>& stop);

class Agent {
 public:
  Agent(AgentOptions options, AgentEnv env);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Joins and works until the server says STOP or a stop is requested; then leaves (best
  // effort) and returns OK. Dropped tasks (kFailedPrecondition, kNotFound, kUnavailable) are
  // asked for again after the Backoff; an expired lease joins again. Other errors end the run:
  // the agent leaves first, so that its task goes to another worker at once.
  absl::Status Run();

 private:
  class Heartbeater;
  struct Communicated;

  bool leader() const { return env_.node == nullptr || env_.node->rank() == 0; }
  bool stopping() const { return env_.stop->load(); }
  uint32_t slice() const { return env_.node != nullptr ? env_.node->rank() : 0; }
  uint32_t slices() const { return env_.node != nullptr ? env_.node->size() : 1; }
  double SecondsSince(absl::Time start) const;
  template <typename T>
  absl::StatusOr<T> Retry(const std::function<absl::StatusOr<T>()>& call);

  absl::StatusOr<v1::JoinReply> JoinRpc();
  // Sets up for a join reply: the trainer (once), the heartbeat (leader), the push codecs.
  absl::Status Joined(const v1::JoinReply& joined);
  // The one-process loop, and the multi-rank loop in which the leader asks the server and tells
  // every rank what to do.
  absl::Status RunAlone();
  absl::Status RunNode();
  v1::NodeDirective NextDirective();
  // A task that ended in `status`: true (after the backoff) when it was dropped and the agent
  // asks again; false when the status ends the run.
  bool Dropped(const v1::Task& task, const absl::Status& status);
  absl::Status Finish();
  void Leave();
  absl::Status LeaveAfter(absl::Status error);
  // The token shard `file`. A missing or unreadable file is this node's setup, never the
  // server's: kInvalidArgument, so it ends the run instead of being retried as a dropped task.
  absl::StatusOr<const TokenSource*> Shard(const std::string& file);
  // The next task: the one the last push's reply carried, else RequestTask's answer, naming the
  // task given up since the last answer.
  absl::StatusOr<v1::Task> RequestNextTask();
  // Pulls the base version of `task` (this rank's slices) into base_, every rank together, and
  // reports it pulled.
  absl::Status PullBase(const v1::Task& task, uint64_t* pulled);
  absl::Status Train(const v1::Task& task);
  // Tells the server this rank holds the base version of `task`. Best effort.
  void ReportPulled(const v1::Task& task);
  absl::Status TrainOverlapped(v1::Task task);
  // Local work of one round from `start`; leaves start - end in delta_.
  absl::StatusOr<TrainStats> TrainRound(const v1::Task& task,
                                        const std::vector<std::vector<float>>& start);
  v1::PushHeader HeaderFor(const v1::Task& task, const TrainStats& stats);
  // Pushes `delta` under `header` (error feedback: adds and refreshes residual_).
  absl::StatusOr<v1::PushReply> PushDelta(const v1::PushHeader& header,
                                          std::vector<std::vector<float>>& delta, uint64_t* pushed);
  // Totals, metrics and the log line of a round whose push was answered.
  void ReportRound(const v1::Task& task, const TrainStats& stats, const v1::PushReply& reply,
                   uint64_t pulled, uint64_t pushed, double train_s, double round_s,
                   double network_s);
  absl::Status Evaluate(const v1::Task& task);
  // A multi-rank node acts on `status` only together: OK when every rank's was; else this
  // rank's error, or kUnavailable when only another rank failed. One process: `status`.
  absl::Status AgreeAcrossRanks(absl::Status status);
  // The background half of an overlapped round: pushes `delta` under `header` (if any), asks
  // for the next task and pulls its base.
  Communicated Communicate(const v1::PushHeader* header, std::vector<std::vector<float>>* delta);

  const AgentOptions options_;
  const AgentEnv env_;
  ServerApi& server_;
  MetricsSink& metrics_;
  const Clock& clock_;
  std::string name_;                         // options.name, or role-pid
  std::unique_ptr<TokenShardCache> corpus_;  // when env.open_shard is null
  std::map<std::string, const TokenSource*> shards_;
  std::unique_ptr<TrainerInterface> trainer_;
  std::unique_ptr<Heartbeater> heartbeat_;
  double flops_per_token_ = 0;  // the joined model's training FLOPs per token
  bool need_join_ = true;
  bool server_draining_ = false;
  // A TRAIN task given up on FAILED_PRECONDITION (e.g. its base version is gone): the next
  // RequestTask names it, so the server ends it instead of handing it out again.
  uint64_t dropped_task_id_ = 0;
  // The task the reply of the last push carried (PushHeader.want_next_task); cleared at joins.
  std::optional<v1::Task> next_task_;
  v1::JoinReply joined_;
  std::vector<std::vector<float>> base_;
  std::vector<std::vector<float>> delta_;
  std::vector<v1::Codec> codecs_;             // per layer, from the server's transport
  std::vector<std::vector<float>> residual_;  // error feedback, per layer
  uint64_t update_id_ = 0;
  bool overlap_refused_ = false;  // the server granted no look-ahead task
  Backoff drop_backoff_;
  absl::Time next_drop_log_ = absl::InfinitePast();
  uint64_t drops_not_logged_ = 0;
  // Totals for the closing summary.
  uint64_t rounds_ = 0, steps_ = 0, tokens_ = 0, pushed_bytes_ = 0;
  uint64_t tasks_from_push_replies_ = 0;  // tasks that came with a push reply, not RequestTask
  double compute_s_ = 0, network_s_ = 0;
  std::optional<absl::Time> first_task_;
};

}  // namespace aloe::worker
