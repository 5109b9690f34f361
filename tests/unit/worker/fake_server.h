// A scripted aloe-server for the worker's unit tests (no network), and task builders.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/aloe.pb.h"
#include "worker/server_api.h"

namespace aloe::worker {

inline constexpr size_t kFakeElements = 4;  // the one layer's size

inline v1::Task TrainTask(uint64_t id, uint64_t base_version, uint32_t steps = 3) {
  v1::Task task;
  task.set_kind(v1::Task::TRAIN);
  task.set_task_id(id);
  task.set_base_version(base_version);
  task.set_local_steps(steps);
  task.set_shard_name("s0");
  task.set_shard_file("s0.tok");
  return task;
}

inline v1::Task Kind(v1::Task::Kind kind, bool draining = false) {
  v1::Task task;
  task.set_kind(kind);
  task.set_draining(draining);
  return task;
}

// RequestTask and Pull answers are taken from queues (an empty queue answers STOP, or a pull of
// the version asked); every call is recorded. The n-th join gets worker id n. Thread-safe.
class FakeServer final : public ServerApi {
 public:
  struct PushCall {
    v1::PushHeader header;
    std::vector<std::vector<float>> layers;
  };

  void set_lease_seconds(double seconds) {
    absl::MutexLock lock(&mu_);
    lease_seconds_ = seconds;
  }
  void AddTask(absl::StatusOr<v1::Task> task, bool ahead = false) {
    absl::MutexLock lock(&mu_);
    (ahead ? ahead_tasks_ : tasks_).push_back(std::move(task));
  }
  // The next pulls' outcomes, in order (OK: a normal pull); then every pull succeeds.
  void AddPullError(absl::Status error) {
    absl::MutexLock lock(&mu_);
    pull_errors_.push_back(std::move(error));
  }
  void AddPushError(absl::Status error) {
    absl::MutexLock lock(&mu_);
    push_errors_.push_back(std::move(error));
  }
  // Answers the requests (not ahead) instead of the queue, given the number of pushes so far;
  // runs under the server's lock.
  void set_task_source(std::function<absl::StatusOr<v1::Task>(size_t pushes)> source) {
    absl::MutexLock lock(&mu_);
    task_source_ = std::move(source);
  }
  // Pulls fail with `error` while `clock` reads before `until` (a shard process away).
  void SetPullOutage(const Clock* clock, absl::Time until, absl::Status error) {
    absl::MutexLock lock(&mu_);
    outage_clock_ = clock;
    outage_until_ = until;
    outage_error_ = std::move(error);
  }
  // AwaitServers answers with `await` (default: waits for nothing, returns the whole wait).
  void set_await_servers(std::function<absl::Duration(absl::Duration)> await) {
    absl::MutexLock lock(&mu_);
    await_servers_ = std::move(await);
  }
  absl::Duration AwaitServers(absl::Duration wait, const std::atomic<bool>* stop) override {
    std::function<absl::Duration(absl::Duration)> await;
    {
      absl::MutexLock lock(&mu_);
      await = await_servers_;
    }
    return await ? await(wait) : wait;
  }
  // Every heartbeat of `worker_id` from now on is answered `error`.
  void SetHeartbeatError(uint64_t worker_id, absl::Status error) {
    absl::MutexLock lock(&mu_);
    heartbeat_errors_[worker_id] = std::move(error);
  }
  // Runs in each Heartbeat call before it answers, outside the server's lock.
  void set_on_heartbeat(std::function<void(const v1::HeartbeatRequest&)> hook) {
    absl::MutexLock lock(&mu_);
    on_heartbeat_ = std::move(hook);
  }
  // Blocks until a push of `task_id` has arrived (a test guard, at most 30 s).
  bool AwaitPush(uint64_t task_id) {
    absl::MutexLock lock(&mu_);
    auto pushed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const PushCall& p : pushes_) {
        if (p.header.task_id() == task_id) return true;
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&pushed), absl::Seconds(30));
  }

  absl::StatusOr<v1::JoinReply> Join(const v1::JoinRequest& request) override {
    absl::MutexLock lock(&mu_);
    v1::JoinReply reply;
    reply.set_worker_id(++joins_);
    reply.set_lease_seconds(lease_seconds_);
    v1::LayerSpec* layer = reply.mutable_model_spec()->add_layers();
    layer->set_name("w");
    layer->set_num_elements(kFakeElements);
    reply.mutable_outer_optimizer()->set_lr(0.5);
    reply.set_heldout_file("heldout.tok");
    reply.mutable_model()->set_seq_len(3);
    return reply;
  }
  absl::StatusOr<v1::HeartbeatReply> Heartbeat(const v1::HeartbeatRequest& request) override {
    std::function<void(const v1::HeartbeatRequest&)> hook;
    {
      absl::MutexLock lock(&mu_);
      hook = on_heartbeat_;
    }
    if (hook) hook(request);
    absl::MutexLock lock(&mu_);
    if (request.pulled_task_id() == 0) heartbeats_.push_back(request);
    auto error = heartbeat_errors_.find(request.worker_id());
    if (error != heartbeat_errors_.end()) return error->second;
    return v1::HeartbeatReply();
  }
  absl::StatusOr<v1::Task> RequestTask(uint64_t worker_id, bool ahead,
                                       uint64_t dropped_task_id) override {
    absl::MutexLock lock(&mu_);
    std::deque<absl::StatusOr<v1::Task>>& queue = ahead ? ahead_tasks_ : tasks_;
    if (!ahead) {
      dropped_.push_back(dropped_task_id);
      requesters_.push_back(worker_id);
    }
    if (!ahead && task_source_) return task_source_(pushes_.size());
    if (queue.empty()) return Kind(v1::Task::STOP);
    absl::StatusOr<v1::Task> task = queue.front();
    queue.pop_front();
    return task;
  }
  absl::Status ReportEval(const v1::EvalReport& report) override {
    absl::MutexLock lock(&mu_);
    evals_.push_back(report);
    return absl::OkStatus();
  }
  absl::Status Leave(uint64_t worker_id) override {
    absl::MutexLock lock(&mu_);
    ++leaves_;
    return absl::OkStatus();
  }
  absl::Status SetShards(const std::vector<std::string>&, const std::vector<std::string>&,
                         const std::string&) override {
    return absl::OkStatus();
  }
  // Fills every element with 10 x the version.
  absl::StatusOr<uint64_t> Pull(uint64_t worker_id, uint64_t version, bool latest,
                                const v1::ModelSpec& spec, std::vector<std::vector<float>>* layers,
                                uint64_t* bytes, uint32_t slice, uint32_t slices) override {
    absl::MutexLock lock(&mu_);
    pulls_.push_back(version);
    if (outage_clock_ != nullptr && outage_clock_->Now() < outage_until_) return outage_error_;
    if (!pull_errors_.empty()) {
      absl::Status error = pull_errors_.front();
      pull_errors_.pop_front();
      if (!error.ok()) return error;
    }
    layers->assign(1, std::vector<float>(kFakeElements, 10.0f * version));
    return version;
  }
  absl::StatusOr<v1::PushReply> Push(const v1::PushHeader& header, const v1::ModelSpec& spec,
                                     const std::vector<std::vector<float>>& layers,
                                     const std::vector<v1::Codec>& codecs,
                                     const BlockSizes& block_sizes,
                                     std::vector<std::vector<float>>* residuals,
                                     uint64_t* bytes) override {
    absl::MutexLock lock(&mu_);
    pushes_.push_back({header, layers});
    if (!push_errors_.empty()) {
      absl::Status error = push_errors_.front();
      push_errors_.pop_front();
      return error;
    }
    v1::PushReply reply;
    reply.set_applied(true);
    reply.set_version(header.base_version() + 1);
    return reply;
  }

  // Layer groups are not scripted here (tests/unit/worker/streaming_round_test.cc has a
  // server that keeps them).
  absl::StatusOr<v1::Task> StartGroup(uint64_t, uint32_t) override {
    return absl::UnimplementedError("FakeServer has no layer groups");
  }
  absl::StatusOr<uint64_t> PullGroup(uint64_t, uint32_t, uint64_t, const v1::ModelSpec&,
                                     absl::Span<const uint32_t>, std::vector<std::vector<float>>*,
                                     uint64_t*) override {
    return absl::UnimplementedError("FakeServer has no layer groups");
  }
  absl::StatusOr<v1::PushReply> PushGroup(const v1::PushHeader&, const v1::ModelSpec&,
                                          absl::Span<const uint32_t>,
                                          const std::vector<std::vector<float>>&,
                                          const std::vector<v1::Codec>&, const BlockSizes&,
                                          std::vector<std::vector<float>>*, uint64_t*) override {
    return absl::UnimplementedError("FakeServer has no layer groups");
  }

  std::vector<PushCall> pushes() {
    absl::MutexLock lock(&mu_);
    return pushes_;
  }
  // The low-rank encoder the session handed over (it encodes pushes in a real client).
  void SetLowRankEncoder(std::shared_ptr<LowRankPushEncoder> encoder) override {
    absl::MutexLock lock(&mu_);
    low_rank_ = std::move(encoder);
  }
  std::shared_ptr<LowRankPushEncoder> low_rank_encoder() {
    absl::MutexLock lock(&mu_);
    return low_rank_;
  }
  // The dropped_task_id of each RequestTask (not the look-ahead ones).
  std::vector<uint64_t> dropped() {
    absl::MutexLock lock(&mu_);
    return dropped_;
  }
  // The worker id of each RequestTask (not the look-ahead ones).
  std::vector<uint64_t> requesters() {
    absl::MutexLock lock(&mu_);
    return requesters_;
  }
  std::vector<uint64_t> pulls() {
    absl::MutexLock lock(&mu_);
    return pulls_;
  }
  // The periodic heartbeats (not the reports of a pulled base).
  std::vector<v1::HeartbeatRequest> heartbeats() {
    absl::MutexLock lock(&mu_);
    return heartbeats_;
  }
  int joins() {
    absl::MutexLock lock(&mu_);
    return joins_;
  }
  int leaves() {
    absl::MutexLock lock(&mu_);
    return leaves_;
  }
  std::vector<v1::EvalReport> evals() {
    absl::MutexLock lock(&mu_);
    return evals_;
  }

 private:
  std::function<absl::Duration(absl::Duration)> await_servers_ ABSL_GUARDED_BY(mu_);
  absl::Mutex mu_;
  double lease_seconds_ ABSL_GUARDED_BY(mu_) = 3600;
  std::deque<absl::StatusOr<v1::Task>> tasks_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::StatusOr<v1::Task>> ahead_tasks_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Status> pull_errors_ ABSL_GUARDED_BY(mu_);
  std::function<absl::StatusOr<v1::Task>(size_t)> task_source_ ABSL_GUARDED_BY(mu_);
  const Clock* outage_clock_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Time outage_until_ ABSL_GUARDED_BY(mu_);
  absl::Status outage_error_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Status> push_errors_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, absl::Status> heartbeat_errors_ ABSL_GUARDED_BY(mu_);
  std::function<void(const v1::HeartbeatRequest&)> on_heartbeat_ ABSL_GUARDED_BY(mu_);
  std::vector<PushCall> pushes_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<LowRankPushEncoder> low_rank_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> dropped_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> requesters_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> pulls_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::HeartbeatRequest> heartbeats_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::EvalReport> evals_ ABSL_GUARDED_BY(mu_);
  int joins_ ABSL_GUARDED_BY(mu_) = 0;
  int leaves_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace aloe::worker
