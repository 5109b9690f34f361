// The worker's membership at the server as the agent sees it: joining (with retries while the
// server is away or full), the join reply and what follows from it (where pulls and pushes go,
// the push codecs), pulls and pushes of this rank's slices with error feedback, and the ids of
// its updates.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/low_rank_push.h"
#include "common/metrics.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"
#include "worker/agent_options.h"
#include "worker/backoff.h"
#include "worker/server_api.h"

namespace aloe::worker {

// Not thread-safe, except that one background thread may Push, RequestTask, Pull and
// ReportPulled while the caller's thread makes none of these calls, or (streaming rounds) only
// RequestTask: the ServerApi behind it is thread-safe.
class ServerSession {
 public:
  // `options` and env's pointers must outlive this. `name` is the JoinRequest's; this process
  // pulls and pushes slice `slice` of `slices` of every layer.
  ServerSession(const AgentOptions& options, const AgentEnv& env, std::string name, uint32_t slice,
                uint32_t slices);

  // Repeats `call` while it fails with kUnavailable, up to connect_timeout or a stop request;
  // returns its last result. The waits follow a RetryBackoff from retry_interval to retry_max;
  // each retry counts in aloe_worker_retries_total{kind}.
  template <typename T>
  absl::StatusOr<T> Retry(const char* kind, const std::function<absl::StatusOr<T>()>& call);

  // Asks to join. A server without room for one more worker (kResourceExhausted) is asked again
  // every join_wait_step up to join_wait, as one that is away is retried.
  absl::StatusOr<v1::JoinReply> Join();
  // Takes `joined` as the current membership (of this process's rank): where pulls and pushes
  // go, the push codecs. kFailedPrecondition when the server trains another model than
  // options.model_fingerprint; the shard addresses' errors from ServerApi::SetShards.
  absl::Status Adopt(const v1::JoinReply& joined);
  // Whether a join reply was adopted; and the last one adopted.
  bool member() const { return member_; }
  const v1::JoinReply& joined() const { return joined_; }
  uint64_t worker_id() const { return joined_.worker_id(); }

  absl::StatusOr<v1::Task> RequestTask(bool ahead, uint64_t given_up_task_id);
  // Pulls this rank's slices of `version` into *layers. Returns the version pulled.
  absl::StatusOr<uint64_t> Pull(uint64_t version, std::vector<std::vector<float>>* layers,
                                uint64_t* bytes);
  // Tells the server this rank holds the base version of `task`. Best effort: logs a failure.
  void ReportPulled(const v1::Task& task);
  // The header of this rank's push of a round of `task`, under a new update id. Hands the
  // task's low-rank ranks (Task.tensor_ranks) to the encoder.
  v1::PushHeader Header(const v1::Task& task, const TrainStats& stats);
  // Pushes `delta` under `header`. With error feedback, first adds what earlier pushes' codecs
  // lost to `delta`, then keeps what this push's loses. A rank of a multi-rank node with
  // low-rank layers first computes their factors with the other ranks (a collective on the
  // control group when there is one, else on the node's).
  absl::StatusOr<v1::PushReply> Push(const v1::PushHeader& header,
                                     std::vector<std::vector<float>>& delta, uint64_t* pushed);
  absl::Status ReportEval(const v1::EvalReport& report) { return server_.ReportEval(report); }
  // ServerApi::AwaitServers.
  absl::Duration AwaitServers(absl::Duration wait) { return server_.AwaitServers(wait, &stop_); }

  // Partial synchronization. The layer group of each spec layer (JoinReply.layer_groups; empty
  // when the server synchronizes the whole model).
  const std::vector<uint32_t>& layer_groups() const { return layer_groups_; }
  // TaskRequest.start_group for `group`.
  absl::StatusOr<v1::Task> StartGroup(uint32_t group);
  // Pulls layer group `group` at version min_group_version or later (the version StartGroup
  // granted) into its layers of *layers; returns the group's version.
  absl::StatusOr<uint64_t> PullGroup(uint32_t group, uint64_t min_group_version,
                                     std::vector<std::vector<float>>* layers, uint64_t* bytes);
  // Pushes the layers of group header.group() of `delta` (the others may be empty), with error
  // feedback on those layers as Push has on all.
  absl::StatusOr<v1::PushReply> PushGroup(const v1::PushHeader& header,
                                          std::vector<std::vector<float>>& delta, uint64_t* pushed);
  // Leaves the server, if a member. Best effort: logs a failure.
  void Leave();

  // Counts one retry of `kind` in aloe_worker_retries_total. Thread-safe.
  void CountRetry(const char* kind);

 private:
  // The waits of one Retry; each call draws its own jitter. Thread-safe.
  RetryBackoff::Options RetryBackoffOptions();

  const AgentOptions& options_;
  ServerApi& server_;
  const Clock& clock_;
  const std::function<void(absl::Duration)> sleep_;
  const std::atomic<bool>& stop_;
  MetricsSink* const metrics_;  // may be null
  std::atomic<uint64_t> retries_begun_{0};
  const std::string name_;
  const uint32_t slice_;
  const uint32_t slices_;
  // A rank of a multi-rank node: its process groups (AgentEnv::node, AgentEnv::control).
  Collectives* const node_;
  Collectives* const control_;
  bool member_ = false;
  v1::JoinReply joined_;
  std::vector<v1::Codec> codecs_;             // per layer, from the server's transport
  std::vector<std::vector<float>> residual_;  // error feedback, per layer
  // The CODEC_LOWRANK layers' warm starts, shared with the server client that encodes pushes.
  std::shared_ptr<LowRankPushEncoder> low_rank_ = std::make_shared<LowRankPushEncoder>();
  std::vector<uint32_t> layer_groups_;
  uint64_t update_id_ = 0;
};

template <typename T>
absl::StatusOr<T> ServerSession::Retry(const char* kind,
                                       const std::function<absl::StatusOr<T>()>& call) {
  const absl::Time give_up = clock_.Now() + options_.connect_timeout;
  RetryBackoff backoff(RetryBackoffOptions());
  while (true) {
    absl::StatusOr<T> result = call();
    if (result.ok() || result.status().code() != absl::StatusCode::kUnavailable ||
        clock_.Now() > give_up || stop_.load()) {
      return result;
    }
    CountRetry(kind);
    const absl::Duration rest = server_.AwaitServers(backoff.Failure(), &stop_);
    if (rest > absl::ZeroDuration()) sleep_(rest);
  }
}

}  // namespace aloe::worker
