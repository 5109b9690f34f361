// The server's logic behind the gRPC services: membership, task assignment, validation and
// aggregation of pushed pseudo-gradients, outer steps, evaluation bookkeeping and the stop
// condition. Where the parameters live (this process, or the shard processes of a layer-sharded
// server) is the ParameterBackend's business: the algorithm is the same for both. No gRPC,
// threads or wall clock: time comes from the Clock, parallel work goes through the Executor,
// metrics to the MetricsSink.
//
// Not thread-safe: the service layer serialises calls (one mutex) and hands Pull streams a
// ModelSnapshot so that large transfers run outside the lock.
//
// Errors: kNotFound for an unknown worker (the worker should Join again); kInvalidArgument for
// malformed input; kFailedPrecondition for an update that is stale or does not match the
// worker's open task. A rejected request leaves the state unchanged.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/buffer_pool.h"
#include "common/clock.h"
#include "common/executor.h"
#include "common/metrics.h"
#include "proto/aloe.pb.h"
#include "server/core/adaptive_compression.h"
#include "server/core/aggregation.h"
#include "server/core/grace_period_aggregation.h"
#include "server/core/local_work.h"
#include "server/core/membership.h"
#include "server/core/outer_step_log.h"
#include "server/core/parameter_backend.h"
#include "server/core/parameter_store.h"
#include "server/core/pseudo_gradient_penalty.h"
#include "server/core/shard_commit_log.h"
#include "server/core/shard_sampler.h"
#include "server/core/update.h"

namespace aloe::server {

struct EvalPoint {
  uint64_t version = 0;
  double loss = 0;
};

// A live worker as the status page shows it.
struct LiveWorker {
  uint64_t id = 0;
  std::string name;
  v1::Role role = v1::ROLE_TRAINER;
  absl::Time joined;
  double steps_per_second = 0;          // measured speed; 0 = not measured yet
  uint32_t planned_steps = 0;           // local steps of its open training task; 0 = none
  uint64_t tokens_per_step = 0;         // inner batch size x sequence length
  std::optional<absl::Time> last_push;  // of its last accepted push; nullopt = none yet
  uint64_t last_staleness = 0;          // of that push
  uint64_t pushes = 0;                  // accepted pushes (slices and layer groups count each)
  // Payload bytes of those pushes as this process received them (0 where shard processes do).
  uint64_t received_bytes = 0;
  // "training" or "evaluating" (an open task), "waiting" (for a round, a grace window or its
  // next task), "draining" (no new work), "reading" (an observer).
  std::string state;
};

class ServerCore {
 public:
  // config must be validated (common/config.h). train_shards: the corpus' training shards (at
  // least one). clock, executor and metrics must outlive the core. The parameters live where
  // config says (CreateParameterBackend).
  static absl::StatusOr<std::unique_ptr<ServerCore>> Create(const v1::ServerConfig& config,
                                                            std::vector<DataShard> train_shards,
                                                            std::string heldout_file,
                                                            const Clock& clock, Executor& executor,
                                                            MetricsSink& metrics);
  // The same over `parameters` (which must be of `config`'s model).
  static absl::StatusOr<std::unique_ptr<ServerCore>> Create(const v1::ServerConfig& config,
                                                            DeployedParameters parameters,
                                                            std::vector<DataShard> train_shards,
                                                            std::string heldout_file,
                                                            const Clock& clock,
                                                            MetricsSink& metrics);

  absl::StatusOr<v1::JoinReply> Join(const v1::JoinRequest& request);
  absl::StatusOr<v1::HeartbeatReply> Heartbeat(const v1::HeartbeatRequest& request);
  // Returns WAIT when the worker cannot start now (sync round in progress, waiting for peers).
  // request.ahead: a look-ahead task while the open one is still to be pushed (aloe.proto).
  // request.start_group: partial synchronization's per-group start (StartGroup).
  absl::StatusOr<v1::Task> RequestTask(const v1::TaskRequest& request);
  // Cheap checks of a push header before its chunks are read (live worker, open task, version).
  absl::Status CheckPushHeader(const v1::PushHeader& header) const;
  // Whether the updates this server applies report their layers' norms from layer_squares when
  // they carry them (UpdateAssembler's sum_squares; ParameterBackend::wants_layer_squares).
  bool wants_layer_squares() const { return backend_->wants_layer_squares(); }
  // Takes a fully assembled update; aggregates and applies when it completes a batch. A slice of
  // a sliced update (update.slices > 1) is staged until every slice has arrived (reply staged);
  // the slice that completes it submits the merged update. With update.want_next_task (of the
  // push that completes it) the reply also carries the worker's next task, as RequestTask would
  // answer it now, unless that answer is WAIT.
  absl::StatusOr<v1::PushReply> SubmitUpdate(PendingUpdate update);
  absl::Status ReportEval(const v1::EvalReport& report);
  absl::Status Leave(const v1::LeaveRequest& request);

  // Expires leases and re-evaluates the stop condition. Call periodically.
  void Tick();
  // Records a rejected push under the reason its status names (the service calls it for pushes
  // that fail before SubmitUpdate).
  void CountRejected(const absl::Status& status);

  // The current version's parameters where this process holds them, else only its version.
  ModelSnapshot Snapshot() const { return backend_->Snapshot(); }
  // Where pushes take their layer buffers (null where updates carry no layers).
  std::shared_ptr<FloatBufferPool> staging_buffers() const { return backend_->staging_buffers(); }
  // The snapshot a Pull streams: the requested version — the current one, or an older one that
  // an open or released task starts from (kFailedPrecondition for any other) — or the latest.
  // kNotFound for an unknown worker; kInvalidArgument for a bad slice request.
  absl::StatusOr<ModelSnapshot> SnapshotFor(const v1::PullRequest& request) const;
  const v1::ModelSpec& spec() const { return spec_; }
  // The model version: outer steps of any layer group (with one group, of the model).
  uint64_t version() const { return backend_->version(); }
  // --- Partial synchronization (ServerConfig.partial_sync, docs/algorithms.md): the layers
  // form num_layer_groups() groups, each with its own version, aggregation (a sync round or
  // grace window per group), outer optimizer state and staleness. With more than one group a
  // TRAIN task names the data shard, local work and LR position only; the worker takes each
  // group with RequestTask(start_group) before it pulls it, pushes it by itself
  // (PushHeader.group) against the group version it took, and its push without
  // task_continues ends the task. Tasks are not gated by the aggregations: a worker waits at
  // start_group, where a group's sync round or grace window holds it. While the task's last push
  // is on its way the worker may take the next task with TaskRequest.ahead; it becomes the open
  // task when that push arrives.
  uint32_t num_layer_groups() const { return static_cast<uint32_t>(lanes_.size()); }
  uint64_t group_version(uint32_t group) const { return backend_->group_version(group); }
  const std::vector<uint32_t>& layer_groups() const { return layer_groups_; }
  uint64_t updates_applied() const { return updates_applied_; }
  const std::vector<EvalPoint>& eval_history() const { return eval_history_; }
  // Every live member, by id.
  std::vector<LiveWorker> LiveWorkers() const;
  // When a time-driven event (a grace window closing) is due; nullopt when none is pending.
  // The service wakes waiting task requests then; the simulator schedules a Tick.
  std::optional<absl::Time> NextDeadline() const;
  const LocalWorkPlanner& local_work() const { return planner_; }
  const DataShardSampler& sampler() const { return sampler_; }
  // --- Checkpoints (exact resume). The state right after the last outer step; tasks handed out
  // since then are not part of it.
  v1::ServerCheckpoint CaptureCheckpoint() const;
  // What the checkpoints say they are of (model layout, outer optimizer, penalty, corpus shard
  // count, process count); RestoreCheckpoint takes only a checkpoint that says the same.
  std::string Fingerprint() const;
  // The same for a server of `config` training `spec` on `data_shards` training shards (the
  // bring-your-own model's fingerprint or ""), without building one.
  static std::string FingerprintOf(const v1::ServerConfig& config, const v1::ModelSpec& spec,
                                   size_t data_shards, const std::string& model_fingerprint);
  // The checkpoints captured right after outer steps that reached a multiple of
  // checkpoint.every_versions, oldest first, each once (empty when none is waiting). A
  // single-process core keeps only the newest (each holds the whole model, and a slow disk must
  // not queue them up); a sharded coordinator keeps every one: they are small, and a restarted
  // shard can only go back to a version that the coordinator checkpointed too.
  std::vector<v1::ServerCheckpoint> TakeDueCheckpoints();
  // Replaces the model, optimizer, penalty, shard progress, counters and evaluation history.
  // Call before any worker joins. kFailedPrecondition when the checkpoint belongs to another
  // model or optimizer, kInvalidArgument when it is malformed; state unchanged on error.
  absl::Status RestoreCheckpoint(const v1::ServerCheckpoint& checkpoint);
  // Hands out worker and task ids only above those `previous` handed out, for a core that
  // replaces `previous` in the same process (a sharded coordinator going back to a checkpoint):
  // a worker of the old core must get NOT_FOUND, never act under an id given to a new joiner.
  void ContinueIdsOf(const ServerCore& previous);
  // After RestoreCheckpoint in a restarted process: the process that died may have handed out
  // worker ids after its last checkpoint, and its workers come back with them. New joiners get
  // ids from kWorkerIdGapAfterRestart above the checkpoint's on, so none of them collides (the
  // old workers get NOT_FOUND and join again). Task ids are left alone: task seeds derive from
  // them, and a restarted old worker's task ids are refused with its worker id anyway.
  void SkipWorkerIdsOfLostProcess();
  static constexpr uint64_t kWorkerIdGapAfterRestart = uint64_t{1} << 20;

  // --- Sharded across processes (config.shard_processes > 0): this core is the coordinator.
  // Its parameters are a ShardCommitLog: each outer step becomes a COMMIT order that every shard
  // process applies in log order, and an update counts as pushed only once every shard has
  // staged its part (SubmitShardPart).
  // The order log, admissions and shard addresses; null for one process.
  ShardCommitLog* shard_log() { return shard_log_; }
  const ShardCommitLog* shard_log() const { return shard_log_; }
  // The bring-your-own model's fingerprint (ServerConfig.model_file), "" for the built-in one.
  const std::string& model_fingerprint() const { return model_fingerprint_; }
  // Shard process `shard` follows the coordinator and serves workers at `address` ("" = gone)
  // and takes raw pushes at `push_address` ("" = none; JoinReply.shard_push_addresses).
  // Join answers kUnavailable until every shard has an address.
  void SetShardAddress(uint32_t shard, std::string address, std::string push_address = "") {
    backend_->SetAddress(shard, std::move(address), std::move(push_address));
  }
  // A single-process server takes raw pushes at `address` too (aloe-server --push_listen; ""
  // = none): Join tells workers (JoinReply.push_address).
  void SetPushAddress(std::string address) { backend_->SetAddress(0, "", std::move(address)); }
  // Admits the update `header` names to be pushed to the shards (AdmitRequest): at most
  // max_staged_updates updates are admitted at once, the same on every shard. true when admitted
  // now or before (a retry, another shard's part); false while max_staged_updates others are;
  // CheckPushHeader's errors. An update stays admitted until its COMMIT or DISCARD order, or
  // until its worker leaves; admitting a new update of a worker releases (and discards the parts
  // of) its update that did not reach every shard. kFailedPrecondition for one process.
  absl::StatusOr<bool> AdmitPush(const v1::PushHeader& header);
  // Shard `shard` staged its part of the update `header` describes (it must be admitted; the only
  // shard process of shard_processes 1 does not ask, and its report admits the update). Returns
  // staged = true until every shard has, then SubmitUpdate's reply for the whole update (whose
  // errors mean: drop the part; a DISCARD order tells the shards that staged it).
  absl::StatusOr<v1::PushReply> SubmitShardPart(uint32_t shard, const v1::PushHeader& header);
  // Versions older than the current one that tasks still start from (ShardOrder.keep_versions).
  std::vector<uint64_t> RetainedVersions() const;

  // Training is over (stop condition met) and every worker is gone.
  bool Finished() const;
  // Graceful shutdown (SIGTERM): from now on RequestTask answers WAIT with draining = true
  // (STOP once training is over), so no new work starts; pushes and evaluation reports of tasks
  // already handed out are still accepted. Irreversible.
  void BeginDrain() { draining_ = true; }
  bool draining() const { return draining_; }
  // Tasks handed out and not yet pushed, reported or dropped (what a drain waits for).
  size_t open_tasks() const { return open_tasks_.size() + ahead_tasks_.size(); }
  bool stopping() const { return stopping_; }
  // The EDiT pseudo-gradient penalty where this process applies it (config.penalty().enabled()
  // with one process); null otherwise.
  const PseudoGradientPenalty* penalty() const { return backend_->penalty(); }

 private:
  // The slices of one sliced update received so far (one per worker at a time).
  struct StagedUpdate {
    std::vector<bool> received;
    uint32_t count = 0;
    PendingUpdate merged;  // header fields of the first slice, layers merged slice by slice
  };

  struct OpenTask {
    v1::Task task;
    size_t shard = 0;
    uint64_t assigned_tokens = 0;  // counted in flight by the data-shard sampler
    // Slices of the base version the worker reported pulled (HeartbeatRequest.pulled_task_id);
    // once all are in, the base version is no longer kept for this task.
    std::vector<bool> pulled;
    bool base_pulled = false;
    // Aligned DyLU: the task's round (0 = none) and slack (LocalWorkPlanner::Plan); with layer
    // groups, the groups it has pushed so far.
    uint64_t round = 0;
    double slack_seconds = 0;
    std::set<uint32_t> groups_pushed;
  };

  ServerCore(const v1::ServerConfig& config, const Clock& clock, MetricsSink& metrics);
  absl::StatusOr<const Member*> LiveMember(uint64_t worker_id) const;
  // HeartbeatRequest.pulled_task_id: marks the slice of the worker's open (or look-ahead) task
  // as pulled and lets its base version go once every slice is. An id that names no open task of
  // the worker (answered, expired) is ignored; a bad slice is kInvalidArgument.
  absl::Status MarkBasePulled(uint64_t worker, const v1::HeartbeatRequest& request);
  // Stages one slice; returns the merged update once every slice is in, else nullopt.
  absl::StatusOr<std::optional<PendingUpdate>> StageSlice(PendingUpdate update);
  v1::Task NewTask(v1::Task::Kind kind);
  absl::StatusOr<v1::Task> TrainerTask(uint64_t worker);
  // A TRAIN task from `base` for `worker`: data shard, local work and LR position chosen and its
  // tokens counted in flight. `start` (null for a look-ahead task) is when and how the task
  // starts, for aligned DyLU.
  OpenTask NewTrainTask(uint64_t worker, uint64_t base,
                        const LocalWorkPlanner::Start* start = nullptr);
  // TaskRequest.ahead with an open TRAIN task: the look-ahead task, from the version the
  // aggregation policy says (StartAhead; docs/algorithms.md, overlap). WAIT while the round or
  // window of the worker's last push is open or while draining; STOP past max_versions.
  absl::StatusOr<v1::Task> AheadTask(uint64_t worker);
  // A group push's header against the worker's StartGroup grants (partial synchronization).
  absl::Status CheckGroupPush(uint64_t worker, const v1::PushHeader& header) const;
  // TaskRequest.start_group (see num_layer_groups()).
  absl::StatusOr<v1::Task> StartGroup(uint64_t worker, uint32_t group);
  // Aligned DyLU with layer groups: tags `worker`'s next push of `group` (just taken) with the
  // round it belongs to, so that the group's window waits for that round's other pushes.
  void ExpectGroupPush(uint64_t worker, uint32_t group);
  // A group push (partial synchronization) through its group's aggregation: checked, staleness
  // discounted, submitted; the task ends with the push without task_continues.
  absl::StatusOr<v1::PushReply> SubmitGroupUpdate(PendingUpdate update);
  // Applies `batch` (when it holds updates), logging a failure.
  void ApplyLogged(ApplyBatch batch);
  // Adaptive rank: kInvalidArgument for observations this server cannot take (none expected,
  // or malformed); the record of an accepted push's, and the local steps that follow.
  absl::Status CheckObservedRanks(absl::Span<const v1::TensorRank> observed) const;
  void RecordObservedRanks(absl::Span<const v1::TensorRank> observed);
  void ApplyAdaptiveLocalSteps();
  // PushHeader.want_next_task: puts the worker's next task into `reply` unless it is WAIT.
  void AttachNextTask(uint64_t worker, v1::PushReply& reply);
  // After the open task of `worker` was pushed (or ended without an update), its look-ahead
  // task, if any, becomes the open one (AggregationPolicy::PromoteAhead).
  void PromoteAhead(uint64_t worker);
  // Ends `worker`'s open task without an update (too stale, or given up by the worker): its
  // tokens go back to the sampler, the aggregation stops waiting for it (which may complete a
  // round), a look-ahead task takes its place, and its base version is no longer kept for it.
  absl::Status EndOpenTask(uint64_t worker);
  v1::Task EvaluatorTask(uint64_t worker);
  void WorkerGone(uint64_t worker);
  absl::Status Apply(ApplyBatch batch);
  void UpdateStopping();
  // Publishes the live members, and checks Delayed Nesterov's buffer against the live trainers.
  void PublishMembership();
  // Async Delayed Nesterov with more trainers than its buffer N is known to diverge
  // (docs/algorithms.md, outer optimizers): sets aloe_config_unstable{reason=
  // "dn_buffer_below_trainers"} while the live trainers or aggregation.min_workers exceed N, and
  // logs a warning each time the live trainers rise above N (once per crossing, not per join).
  void CheckDnBuffer();
  // Per data shard: learning progress, sampling probability and LR schedule position.
  void PublishShards();
  // The trainer's measured speed (after a report) into its labelled gauge.
  void PublishSpeed(uint64_t worker);
  // Observes the groups of workers the aggregation released since the last call.
  void ObserveReleases();
  // Lets the aggregation policy close what is due and keeps the released version available.
  void CloseDueWindows();
  // Drops retained snapshots that no open task or released worker will start from.
  void PruneRetained();
  // Called before an outer step that supersedes the current version: when that version is held
  // only for training tasks that have not pulled it yet and max_retained_versions older ones are
  // held already, stops holding it (ServerConfig.max_retained_versions).
  void CapRetained();
  double TrainedSeconds() const;

  const v1::ServerConfig config_;
  std::string model_fingerprint_;  // of an imported model (config_.model_file); "" = built-in
  const Clock& clock_;
  MetricsSink& metrics_;
  v1::ModelSpec spec_;
  std::unique_ptr<ParameterBackend> backend_;  // where the parameters live
  ShardCommitLog* shard_log_ = nullptr;        // backend_ when it is one
  Membership membership_;
  // One aggregation per layer group; aggregation_ is the first (the only one without groups).
  std::vector<std::unique_ptr<AggregationPolicy>> lanes_;
  AggregationPolicy* aggregation_ = nullptr;
  std::vector<uint32_t> layer_groups_;  // the layer group of each spec layer
  // Partial synchronization: worker -> group -> the group version its StartGroup granted, until
  // it pushes that group (a repeated StartGroup gets the same answer).
  std::map<uint64_t, std::map<uint32_t, uint64_t>> group_started_;
  // aggregation_ when it is a grace window behind aligned DyLU (LocalWorkPlanner); else null.
  GracePeriodAggregation* aligned_grace_ = nullptr;
  // Aligned DyLU with layer groups: every group's window (lanes_, in order); empty otherwise.
  std::vector<GracePeriodAggregation*> aligned_lanes_;
  DataShardSampler sampler_;
  LocalWorkPlanner planner_;
  // TransportConfig.adaptive_rank: ranks and H from the observed effective ranks; null when off.
  std::unique_ptr<AdaptiveCompression> adaptive_;
  std::string heldout_file_;
  // Older versions that open tasks (or released workers) start from, kept for their pulls.
  std::map<uint64_t, ModelSnapshot> retained_;

  uint64_t next_task_id_ = 1;
  std::map<uint64_t, OpenTask> open_tasks_;   // by worker
  std::map<uint64_t, OpenTask> ahead_tasks_;  // by worker: handed out while its open one runs
  std::map<uint64_t, OpenTask> submitted_;    // task id -> its task, until applied
  std::map<uint64_t, StagedUpdate> staged_;   // by worker: a sliced update being received
  // By live worker: its accepted pushes so far (LiveWorkers).
  struct PushActivity {
    absl::Time last;
    uint64_t staleness = 0;
    uint64_t pushes = 0;
    uint64_t bytes = 0;
  };
  std::map<uint64_t, PushActivity> activity_;
  void RecordPush(uint64_t worker, uint64_t staleness, uint64_t bytes);
  std::optional<uint64_t> last_eval_version_;  // latest version handed out for evaluation
  std::vector<EvalPoint> eval_history_;
  std::optional<absl::Time> started_;  // when the first round opened
  double restored_seconds_ = 0;        // training time before a resume
  std::vector<v1::ServerCheckpoint> due_checkpoints_;
  // Label values {worker id, name} of each live trainer's per-worker series.
  std::map<uint64_t, LabelValues> trainer_labels_;
  bool stopping_ = false;
  OuterStepLog step_log_;  // the outer-step lines of the log, at most about one a second
  bool draining_ = false;
  uint64_t updates_applied_ = 0;
  // Async Delayed Nesterov: its buffer size N, which the trainers must not exceed; 0 = no such
  // rule (sync rounds are one outer step each, whatever the number of trainers).
  uint32_t dn_trainer_limit_ = 0;
  bool dn_trainers_above_ =
      false;  // the live trainers exceeded dn_trainer_limit_ when last checked
};

}  // namespace aloe::server
