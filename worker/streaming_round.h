// Streaming rounds: the worker's side of partial synchronization (ServerConfig.partial_sync;
// paper 003 and Streaming DiLoCo; docs/algorithms.md, "Partial synchronization"). The model's
// layers form K layer groups (the server's split, JoinReply.layer_groups). Instead of pulling
// the whole model, training H steps and pushing the whole pseudo-gradient, the worker trains
// on and, after the local steps its schedule names (common/sync_schedule.h), pushes one group's
// pseudo-gradient in the background; merge_delay_steps (tau) steps later it merges the group's
// new global values into its own: local = alpha * local + (1 - alpha) * global.
//
// Per group the exchange is: take the group (RequestTask with start_group, asked again while
// the answer is WAIT: a sync round's barrier; then Pull by_group at least at the group version
// the answer granted, which shard processes may not all have applied yet) and keep its values
// as the group's global copy with its version; push g = global copy - local (the group's
// layers only) against that version; take it again and merge. The take after a push runs on
// the background thread as soon as the push is acknowledged, so the tau steps in between hide
// it; the merge waits for it when it is late. A push the server refuses (too stale, say) is
// followed by a take that replaces the group's local values; kNotFound (this worker is
// unknown) ends the task with that status, and the agent joins again.
//
// A task of H steps (Task.local_steps; with a time budget, the budget at the measured speed)
// ends with a push without task_continues, carrying the task's steps, tokens and loss; its
// schedule is rotated so that the last step has one. Merges still due carry over into the next
// task. One StreamingRounds lives for one membership: after a join the groups are taken anew.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/sync_schedule.h"
#include "common/token_source.h"
#include "common/trainer_interface.h"
#include "proto/aloe.pb.h"
#include "worker/round_report.h"
#include "worker/server_session.h"

namespace aloe::worker {

// What a streaming task did.
struct StreamingTask {
  TrainStats stats;  // the whole task's steps; steps == 0: nothing was trained
  // Whether the task's last push was sent and answered (reply then holds its answer).
  bool ended = false;
  v1::PushReply reply;
  // Run without awaiting the end: the task's last push was sent and is still on its way
  // (AwaitEnd answers it).
  bool end_in_flight = false;
  RoundCosts costs;
  // The server said STOP while a group was being taken: training is over.
  bool server_stopped = false;
};

// Bytes of one push of `layer` at the codec `transport` gives it (its layer_codecs entry, else
// transport.codec, FP32 when unset), counting values only (no headers or scales): FP32 4 bytes
// a value, BF16 2, INT8_BLOCKWISE 1, INT4_BLOCKWISE 1/2. A CODEC_LOWRANK layer counts, per tensor,
// (rows + cols) * rank factor values at the factor codec when the tensor is compressed
// (LowRankTensorRank), else its values at the fallback codec (LowRankFallbackCodec). What the
// DreamDDP schedule's transfer cost counts.
double EstimatedPushBytes(const v1::LayerSpec& layer, const v1::TransportConfig& transport);

class StreamingRounds {
 public:
  // The dependencies; all must outlive this.
  struct Env {
    ServerSession* session = nullptr;  // adopted the join reply with layer groups
    TrainerInterface* trainer = nullptr;
    const Clock* clock = nullptr;
    const std::atomic<bool>* stop = nullptr;  // a stop request: the task ends at a step end
    double slowdown = 1.0;                    // TrainRequest.slowdown
  };

  // kInvalidArgument unless the session's join reply has one layer group per spec layer and
  // more than one group.
  static absl::StatusOr<std::unique_ptr<StreamingRounds>> Create(Env env);
  // Stops the background thread (after the push under way, if any).
  ~StreamingRounds();
  StreamingRounds(const StreamingRounds&) = delete;
  StreamingRounds& operator=(const StreamingRounds&) = delete;

  // Runs the TRAIN task `task` on `data`. Errors: kNotFound when the server does not know this
  // worker; the status of a failed last push (the task is then dropped as a whole-model task
  // whose push failed); a trainer's error.
  // await_end false: Run returns once the task's last push is queued (end_in_flight), so that
  // the next task (taken ahead) trains while it travels: the agent's overlap. Such a last push
  // that the server refuses (but for kNotFound) leaves its task open there, in front of the
  // task taken ahead: the background thread then gives the task up (RequestTask with its id),
  // which makes the task ahead the open one before its own pushes go.
  absl::StatusOr<StreamingTask> Run(const v1::Task& task, const TokenSource* data,
                                    bool await_end = true);
  // Waits for the oldest last push that Run left in flight and returns its reply (its error
  // when refused); adds the wait and the push's bytes to *costs. kFailedPrecondition when none
  // is in flight.
  absl::StatusOr<v1::PushReply> AwaitEnd(RoundCosts* costs);

  // The schedule of a task of `steps` steps as Run would use it now (for tests and the log).
  absl::StatusOr<SyncSchedule> ScheduleFor(uint32_t steps) const;
  // Local steps of a task as Run would plan them now.
  uint32_t PlannedSteps(const v1::Task& task) const;

 private:
  // One push of a group and the take after it. Results are written by the background thread
  // under mu_.
  struct Job {
    uint32_t group = 0;
    v1::PushHeader header;
    std::vector<std::vector<float>> delta;  // the group's layers; the others empty
    uint64_t merge_at = 0;                  // merged once total_steps_ reaches this
    bool pushed = false;
    absl::StatusOr<v1::PushReply> reply = absl::UnknownError("not pushed");
    uint64_t pushed_bytes = 0;
    bool taken = false;
    absl::Status take_status;
    bool server_stopped = false;
    bool replace = false;  // the push failed: the take replaces the local values
    // A task's last push left in flight (Run without await_end): refused, the task is given up.
    // Set before the job is queued.
    bool give_up_if_refused = false;
    uint64_t version = 0;
    std::vector<std::vector<float>> global;  // the group's new global values
    uint64_t pulled_bytes = 0;
  };
  // A group as taken from the server.
  struct Taken {
    bool server_stopped = false;
    uint64_t version = 0;
    uint64_t bytes = 0;
  };

  StreamingRounds(Env env, std::vector<uint32_t> layer_groups, v1::PartialSyncConfig config);

  uint32_t groups() const { return static_cast<uint32_t>(layers_of_group_.size()); }
  // Takes group `group` into *layers (its layers): start_group until not WAIT, then the pull.
  // kCancelled once stopping or shut down.
  absl::StatusOr<Taken> Take(uint32_t group, std::vector<std::vector<float>>* layers);
  // Takes every group and starts the trainer from them (the first task of a membership).
  absl::Status ColdStart(RoundCosts& costs, bool* server_stopped);
  // The trainer's current parameters.
  absl::StatusOr<std::vector<std::vector<float>>> Local();
  // Queues the pushes of `groups` (all held) with the task's statistics so far; the last of
  // them ends the task when `ends_task`. Each is merged `tau` steps later. Returns the last.
  absl::StatusOr<std::shared_ptr<Job>> Push(const v1::Task& task,
                                            const std::vector<uint32_t>& groups,
                                            const TrainStats& stats, bool ends_task, uint32_t tau);
  // Merges the oldest pending push once it is taken (waiting for that). Sets *server_stopped
  // when the take found training over.
  absl::Status MergeOldest(RoundCosts& costs, bool* server_stopped);
  // Sets `group`'s layers to alpha * local + (1 - alpha) * global (moving `global`'s layers
  // of the group into the global copy) and holds the group at `version`.
  absl::Status Merge(uint32_t group, std::vector<std::vector<float>>& global, uint64_t version,
                     float alpha);
  // The task Run trains now ends with its last push in flight (Run's !await_end).
  bool end_ahead_ = false;
  // The last pushes of tasks Run left in flight, oldest first.
  std::deque<std::shared_ptr<Job>> ending_;
  // Waits for `last` (a task's last push) and returns its reply; adds the wait and its bytes to
  // *costs.
  absl::StatusOr<v1::PushReply> AwaitJob(const std::shared_ptr<Job>& last, RoundCosts* costs);
  // Merges, oldest first, every pending push due by total_steps_, and as many as it takes for
  // every group of `groups` to be held again (taking a group anew that is not even pending).
  absl::Status MergeDue(const std::vector<uint32_t>& groups, RoundCosts& costs,
                        bool* server_stopped);
  // Whether `status` is a take cancelled by a stop request (the task then ends as stopped).
  bool Stopping(const absl::Status& status) const;
  // Waits until `job`'s push is answered.
  void AwaitPushed(const Job& job);
  // The background thread: pushes the queued jobs in order, each followed by its take.
  void Communicate();
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shutdown_ || !queue_.empty(); }
  void NoteTransfer(uint64_t bytes, double seconds) ABSL_LOCKS_EXCLUDED(mu_);

  const Env env_;
  const std::vector<uint32_t> layer_groups_;
  const std::vector<std::vector<uint32_t>> layers_of_group_;
  const v1::PartialSyncConfig config_;
  std::vector<uint64_t> group_params_;    // parameters per group
  std::vector<double> group_push_bytes_;  // EstimatedPushBytes summed per group

  // Main thread only.
  bool cold_ = true;
  std::vector<std::vector<float>> global_;    // each group's layers as last taken
  std::vector<uint64_t> version_;             // each group's version as last taken
  std::vector<bool> held_;                    // taken and not pushed since
  uint64_t total_steps_ = 0;                  // local steps since the cold start
  std::deque<std::shared_ptr<Job>> pending_;  // pushed, not yet merged, in push order
  double step_seconds_ = 0;                   // measured wall time per step (0 = none yet)
  std::vector<std::vector<float>> zeros_;     // a zero model, for Local()
  std::string last_schedule_;                 // logged when it changes

  mutable absl::Mutex mu_;
  std::deque<std::shared_ptr<Job>> queue_ ABSL_GUARDED_BY(mu_);  // for the background thread
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // Recent transfers (pushes and pulls): bytes and seconds, for the link rate.
  std::deque<std::pair<uint64_t, double>> transfers_ ABSL_GUARDED_BY(mu_);
  // The quickest start_group answered at once: the link's round trip.
  double round_trip_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<double>::infinity();
  std::thread thread_;
};

}  // namespace aloe::worker
