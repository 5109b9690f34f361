#include "server/core/server_core.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/config.h"
#include "common/imported_model.h"
#include "common/layer_groups.h"
#include "common/logging.h"
#include "common/lr_schedule.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "kernels/cpu/outer_kernels.h"
#include "server/core/grace_period_aggregation.h"
#include "server/core/server_metrics.h"
#include "server/core/update_assembler.h"

namespace aloe::server {
namespace {

// splitmix64: decorrelates per-task seeds derived from (job seed, task id).
uint64_t MixSeed(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull + b + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The staleness discount: the update's weight, its values and their measured squares.
void ScaleUpdate(PendingUpdate& update, float scale) {
  update.weight_scale = scale;
  for (std::vector<float>& layer : update.layers) {
    kernels::Scale(layer.data(), layer.size(), scale);
  }
  for (double& squares : update.layer_squares) squares *= static_cast<double>(scale) * scale;
}

}  // namespace

ServerCore::ServerCore(const v1::ServerConfig& config, const Clock& clock, MetricsSink& metrics)
    : config_(config),
      clock_(clock),
      metrics_(metrics),
      membership_(clock, absl::Seconds(config.lease_seconds())),
      sampler_({}, config.seed()),
      planner_(LocalWorkPlanner::Options{}) {}

namespace {

LocalWorkPlanner::Options PlannerOptions(const v1::ServerConfig& config) {
  LocalWorkPlanner::Options o;
  switch (config.local_work().mode()) {
    case v1::LOCAL_WORK_DYLU:
      o.mode = LocalWorkPlanner::Mode::kDyLU;
      break;
    case v1::LOCAL_WORK_TIME_BUDGET:
      o.mode = LocalWorkPlanner::Mode::kTimeBudget;
      break;
    default:
      o.mode = LocalWorkPlanner::Mode::kFixed;
  }
  o.local_steps = config.local_steps();
  o.time_budget_seconds = config.local_work().time_budget_seconds();
  o.max_steps = config.local_work().max_steps();
  // DyLU's rounds must be kept aligned explicitly behind a finite grace window (LocalWorkPlanner);
  // an infinite one waits for everybody anyway and zero grace is plain async (no waiting).
  const double grace = config.aggregation().grace_seconds();
  // With layer groups no window releases a task: rounds follow a time grid, and each group's
  // window waits for that group's pushes of the round (StartGroup).
  o.align_rounds = o.mode == LocalWorkPlanner::Mode::kDyLU &&
                   config.aggregation().mode() == v1::AGGREGATION_ASYNC && grace > 0 &&
                   std::isfinite(grace);
  return o;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerCore>> ServerCore::Create(
    const v1::ServerConfig& config, std::vector<DataShard> train_shards, std::string heldout_file,
    const Clock& clock, Executor& executor, MetricsSink& metrics) {
  if (train_shards.empty()) {
    return absl::InvalidArgumentError("the corpus has no training shards");
  }
  ALOE_ASSIGN_OR_RETURN(DeployedParameters parameters,
                        CreateParameterBackend(config, executor, clock, metrics));
  return Create(config, std::move(parameters), std::move(train_shards), std::move(heldout_file),
                clock, metrics);
}

absl::StatusOr<std::unique_ptr<ServerCore>> ServerCore::Create(const v1::ServerConfig& config,
                                                               DeployedParameters parameters,
                                                               std::vector<DataShard> train_shards,
                                                               std::string heldout_file,
                                                               const Clock& clock,
                                                               MetricsSink& metrics) {
  if (train_shards.empty()) {
    return absl::InvalidArgumentError("the corpus has no training shards");
  }
  const ServerModel& model = parameters.model;
  v1::ServerConfig effective = config;
  if (!model.fingerprint.empty()) {
    // An imported model: what workers need to read data comes from the file.
    effective.mutable_model()->set_vocab_size(model.vocab_size);
    effective.mutable_model()->set_seq_len(model.seq_len);
  }
  std::unique_ptr<ServerCore> core(new ServerCore(effective, clock, metrics));
  core->model_fingerprint_ = model.fingerprint;
  core->spec_ = model.spec;
  core->backend_ = std::move(parameters.backend);
  core->shard_log_ = parameters.shard_log;
  for (const v1::LayerCodec& layer_codec : config.transport().layer_codecs()) {
    const auto& layers = core->spec().layers();
    if (std::none_of(layers.begin(), layers.end(),
                     [&](const v1::LayerSpec& l) { return l.name() == layer_codec.layer(); })) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "transport.layer_codecs: the model has no layer \"%s\"", layer_codec.layer()));
    }
  }
  // An imported model's tensors are known only now (ValidateServerConfig checks the built-in's).
  ALOE_RETURN_IF_ERROR(ValidateLowRankLayers(config.transport(), core->spec(), kMaxChunkBytes));
  const uint32_t groups = core->backend_->num_layer_groups();
  if (groups > 1) {
    ALOE_ASSIGN_OR_RETURN(core->layer_groups_, AssignLayerGroups(core->spec_, groups));
  } else {
    core->layer_groups_.assign(core->spec_.layers_size(), 0);
  }
  for (uint32_t g = 0; g < groups; ++g) {
    if (config.aggregation().mode() == v1::AGGREGATION_ASYNC) {
      const double grace = config.aggregation().grace_seconds();
      auto grace_aggregation = std::make_unique<GracePeriodAggregation>(
          clock, std::isinf(grace) ? absl::InfiniteDuration() : absl::Seconds(grace));
      if (PlannerOptions(config).align_rounds) {
        if (groups == 1) core->aligned_grace_ = grace_aggregation.get();
        core->aligned_lanes_.push_back(grace_aggregation.get());
      }
      core->lanes_.push_back(std::move(grace_aggregation));
    } else {
      // Look-ahead work (which needs last_version) is not used with layer groups.
      core->lanes_.push_back(std::make_unique<SyncRoundAggregation>(
          config.aggregation().min_workers(), groups > 1 ? 0 : config.max_versions()));
    }
  }
  core->aggregation_ = core->lanes_[0].get();
  core->sampler_ = DataShardSampler(std::move(train_shards), config.seed(),
                                    config.shard_sampling() == v1::SHARD_SAMPLING_PROPORTIONAL
                                        ? DataShardSampler::Mode::kProportional
                                        : DataShardSampler::Mode::kLearningProgress);
  core->planner_ = LocalWorkPlanner(PlannerOptions(config));
  ALOE_ASSIGN_OR_RETURN(
      core->adaptive_,
      AdaptiveCompression::Create(core->spec_, config.transport(), config.local_steps()));
  if (core->adaptive_ != nullptr) core->adaptive_->Publish(metrics);
  core->heldout_file_ = std::move(heldout_file);
  metrics.Set(kModelVersion, 0);
  for (uint32_t g = 0; g < groups; ++g) metrics.Set(kLayerGroupVersion, 0, {absl::StrCat(g)});
  // Every reason's series exists from the start, so rates and alerts see zeros, not gaps.
  for (const char* reason : kRejectReasons) metrics.Add(kUpdatesRejected, 0, {reason});
  if (config.outer_optimizer().type() == v1::OUTER_DELAYED_NESTEROV &&
      config.aggregation().mode() == v1::AGGREGATION_ASYNC) {
    core->dn_trainer_limit_ = config.outer_optimizer().dn_buffer_size();
    if (config.aggregation().min_workers() > core->dn_trainer_limit_) {
      ALOE_LOG_WARNING("server",
                       "aggregation.min_workers %d exceeds outer_optimizer.dn_buffer_size %d: "
                       "async Delayed Nesterov with more trainers than its buffer is known to "
                       "diverge; set dn_buffer_size to the number of trainers "
                       "(docs/algorithms.md)",
                       config.aggregation().min_workers(), core->dn_trainer_limit_);
    }
  }
  core->CheckDnBuffer();  // the series exists from the start
  core->PublishShards();
  return core;
}

void ServerCore::CountRejected(const absl::Status& status) {
  metrics_.Add(kUpdatesRejected, 1, {RejectReason(status)});
}

absl::StatusOr<const Member*> ServerCore::LiveMember(uint64_t worker_id) const {
  const Member* m = membership_.Find(worker_id);
  if (m == nullptr) {
    return absl::NotFoundError(absl::StrFormat(
        "worker %d is not a live member (never joined, left, or its lease expired); join again",
        worker_id));
  }
  return m;
}

absl::StatusOr<v1::JoinReply> ServerCore::Join(const v1::JoinRequest& request) {
  if (!v1::Role_IsValid(request.role())) {
    return absl::InvalidArgumentError(absl::StrFormat("unknown role %d", request.role()));
  }
  if (request.name().size() > 256) {
    return absl::InvalidArgumentError("worker name longer than 256 bytes");
  }
  // An observer trains nothing, so it may read whatever model the server trains.
  if (request.role() != v1::ROLE_OBSERVER && request.model_fingerprint() != model_fingerprint_) {
    if (model_fingerprint_.empty()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "this server trains the built-in transformer, but the worker brings its own model "
          "(fingerprint %s): start it without --torchscript",
          request.model_fingerprint()));
    }
    return absl::FailedPreconditionError(absl::StrFormat(
        "this server trains the imported model %s (model_file %s), but the worker %s: start it "
        "with --torchscript and the TorchScript file that model was imported from",
        model_fingerprint_, config_.model_file(),
        request.model_fingerprint().empty() ? "has the built-in transformer"
                                            : absl::StrCat("brings another model (fingerprint ",
                                                           request.model_fingerprint(), ")")));
  }
  ALOE_RETURN_IF_ERROR(
      backend_->CheckJoin(request.role(), membership_.LiveIds(v1::ROLE_TRAINER).size()));
  const uint64_t id = membership_.Join(request.name(), request.role());
  metrics_.Add(kWorkersJoined, 1);
  if (IsTrainerRole(request.role())) {
    trainer_labels_[id] = {absl::StrCat(id), request.name()};
  }
  v1::JoinReply reply;
  reply.set_worker_id(id);
  reply.set_lease_seconds(config_.lease_seconds());
  *reply.mutable_model() = config_.model();
  *reply.mutable_model_spec() = spec();
  *reply.mutable_inner_optimizer() = config_.inner_optimizer();
  reply.set_version(version());
  reply.set_seed(config_.seed());
  reply.set_heldout_file(heldout_file_);
  *reply.mutable_transport() = config_.transport();
  *reply.mutable_outer_optimizer() = config_.outer_optimizer();
  reply.set_model_fingerprint(model_fingerprint_);
  if (lanes_.size() > 1) {
    for (uint32_t g : layer_groups_) reply.add_layer_groups(g);
    *reply.mutable_partial_sync() = config_.partial_sync();
  }
  backend_->DescribeTo(reply);
  PublishMembership();
  return reply;
}

absl::StatusOr<v1::HeartbeatReply> ServerCore::Heartbeat(const v1::HeartbeatRequest& request) {
  if (!(request.steps_per_second() >= 0) || !std::isfinite(request.steps_per_second())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "steps_per_second must be finite and >= 0, got %g", request.steps_per_second()));
  }
  if (request.pulled_task_id() != 0) {
    // Checked before anything changes: a refused heartbeat renews nothing.
    ALOE_RETURN_IF_ERROR(LiveMember(request.worker_id()).status());
    ALOE_RETURN_IF_ERROR(CheckSlice(request.pulled_slice(), request.pulled_slices()));
  }
  ALOE_RETURN_IF_ERROR(membership_.Renew(request.worker_id(), request.steps_per_second()));
  ALOE_RETURN_IF_ERROR(MarkBasePulled(request.worker_id(), request));
  planner_.ReportSpeed(request.worker_id(), request.steps_per_second());
  PublishSpeed(request.worker_id());
  v1::HeartbeatReply reply;
  reply.set_version(version());
  return reply;
}

v1::Task ServerCore::NewTask(v1::Task::Kind kind) {
  v1::Task task;
  task.set_kind(kind);
  if (kind == v1::Task::TRAIN || kind == v1::Task::EVAL) {
    task.set_task_id(next_task_id_++);
    task.set_base_version(version());
    task.set_seed(MixSeed(config_.seed(), task.task_id()));
  }
  return task;
}

absl::StatusOr<v1::Task> ServerCore::RequestTask(const v1::TaskRequest& request) {
  ALOE_ASSIGN_OR_RETURN(const Member* member, LiveMember(request.worker_id()));
  if (member->role == v1::ROLE_OBSERVER) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker %d joined as an observer: it reads the model and takes no tasks", member->id));
  }
  ALOE_RETURN_IF_ERROR(membership_.Renew(member->id, 0));
  if (request.start_group()) return StartGroup(member->id, request.group());
  auto open = open_tasks_.find(member->id);
  if (request.dropped_task_id() != 0 && open != open_tasks_.end() &&
      open->second.task.kind() == v1::Task::TRAIN &&
      open->second.task.task_id() == request.dropped_task_id()) {
    ALOE_LOG_WARNING("server", "worker %d gave up task %d; handing out another", member->id,
                     request.dropped_task_id());
    metrics_.Add(kTasksGivenUp, 1);
    ALOE_RETURN_IF_ERROR(EndOpenTask(member->id));
    open = open_tasks_.find(member->id);  // a look-ahead task may have taken its place
  }
  if (request.ahead() && open != open_tasks_.end() && open->second.task.kind() == v1::Task::TRAIN) {
    return AheadTask(member->id);
  }
  // A repeated request (e.g. a lost reply) gets the same open task back.
  if (open != open_tasks_.end()) return open->second.task;
  CloseDueWindows();
  UpdateStopping();
  if (draining_ && !stopping_) {
    v1::Task wait = NewTask(v1::Task::WAIT);
    wait.set_draining(true);
    return wait;
  }
  if (member->role == v1::ROLE_EVALUATOR) return EvaluatorTask(member->id);
  return TrainerTask(member->id);
}

absl::StatusOr<v1::Task> ServerCore::TrainerTask(uint64_t worker) {
  if (stopping_) return NewTask(v1::Task::STOP);
  const uint64_t current = version();
  if (lanes_.size() > 1) {
    // Layer groups: the aggregations hold the worker at StartGroup, not here.
    if (!started_) started_ = clock_.Now();
    const LocalWorkPlanner::Start start{clock_.Now(), 0, /*ungated=*/true};
    OpenTask open = NewTrainTask(worker, current, &start);
    open.base_pulled = true;  // its groups are pulled at the versions StartGroup grants
    for (uint32_t g = 0; g < lanes_.size(); ++g) open.task.add_group_versions(group_version(g));
    open_tasks_[worker] = open;
    PublishShards();
    return open.task;
  }
  const std::vector<uint64_t> live = membership_.LiveIds(v1::ROLE_TRAINER);
  std::optional<uint64_t> base = aggregation_->StartVersion(worker, current, live);
  if (!base) return NewTask(v1::Task::WAIT);
  if (*base != current && retained_.count(*base) == 0) {
    // Cannot happen: released versions are retained when the release happens.
    ALOE_LOG_ERROR("server", "version %d to start worker %d from is gone; using %d", *base, worker,
                   current);
    base = current;
  }
  if (*base == current && retained_.count(current) == 0) retained_[current] = Snapshot();
  if (!started_) started_ = clock_.Now();
  metrics_.Set(kRoundParticipants, static_cast<double>(aggregation_->active_workers()));
  // Aligned DyLU plans a released worker from its release (see LocalWorkPlanner), unless it
  // asked so much later (more than the grace) that it cannot finish with the others any more.
  LocalWorkPlanner::Start start{clock_.Now(), 0};
  if (aligned_grace_ != nullptr) {
    if (auto release = aligned_grace_->StartedBy(worker)) {
      start.released_round = release->round;
      if (start.at - release->at <= absl::Seconds(config_.aggregation().grace_seconds())) {
        start.at = release->at;
      }
    }
  }
  OpenTask open = NewTrainTask(worker, *base, &start);
  open_tasks_[worker] = open;
  PublishShards();
  ObserveReleases();
  return open.task;
}

ServerCore::OpenTask ServerCore::NewTrainTask(uint64_t worker, uint64_t base,
                                              const LocalWorkPlanner::Start* start) {
  v1::Task task = NewTask(v1::Task::TRAIN);
  task.set_base_version(base);
  const size_t shard = sampler_.Next();
  const LocalWorkPlanner::Plan plan =
      start != nullptr ? planner_.PlanFor(worker, *start) : planner_.PlanFor(worker);
  if (aligned_grace_ != nullptr && start != nullptr) {
    aligned_grace_->Expect(worker, plan.round, absl::Seconds(plan.slack_seconds));
  }
  task.set_shard_name(sampler_.shard(shard).name);
  task.set_shard_file(sampler_.shard(shard).file);
  task.set_local_steps(plan.steps);
  task.set_time_budget_seconds(plan.time_budget_seconds);
  task.set_lr_step(sampler_.lr_step(shard));
  if (adaptive_ != nullptr) adaptive_->FillTask(&task);
  // Tokens this task is expected to learn, counted in flight (paper 002 Eq. 2 + in-flight).
  double expected_steps = plan.steps;
  if (plan.time_budget_seconds > 0) {
    const double speed = planner_.speed(worker);
    expected_steps = speed > 0 ? std::min<double>(plan.steps, speed * plan.time_budget_seconds)
                               : config_.local_steps();
  }
  const uint64_t assigned = static_cast<uint64_t>(expected_steps) *
                            config_.inner_optimizer().batch_size() * config_.model().seq_len();
  sampler_.Assign(shard, assigned);
  if (auto labels = trainer_labels_.find(worker); labels != trainer_labels_.end()) {
    metrics_.Set(kTrainerPlannedSteps, plan.steps, labels->second);
  }
  OpenTask open{task, shard, assigned};
  open.round = plan.round;
  open.slack_seconds = plan.slack_seconds;
  return open;
}

absl::StatusOr<v1::Task> ServerCore::StartGroup(uint64_t worker, uint32_t group) {
  if (lanes_.size() <= 1) {
    return absl::FailedPreconditionError(
        "start_group: this server synchronizes the whole model (partial_sync.groups is 1)");
  }
  if (group >= lanes_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("start_group: layer group %d, the model has %d", group, lanes_.size()));
  }
  const Member* member = membership_.Find(worker);
  if (member == nullptr || member->role != v1::ROLE_TRAINER) {
    return absl::FailedPreconditionError(
        absl::StrFormat("start_group: worker %d is not a trainer", worker));
  }
  auto granted = [&](uint64_t group_base) {
    v1::Task task;
    task.set_kind(v1::Task::TRAIN);
    task.set_base_version(version());
    task.add_group_versions(group_base);
    if (auto open = open_tasks_.find(worker); open != open_tasks_.end()) {
      task.set_task_id(open->second.task.task_id());
    }
    return task;
  };
  std::map<uint32_t, uint64_t>& started = group_started_[worker];
  if (auto it = started.find(group); it != started.end()) return granted(it->second);
  CloseDueWindows();
  UpdateStopping();
  if (stopping_) {
    // The worker cannot finish its task without the group: the task ends here, so that its
    // next RequestTask answers STOP too, not the task again.
    if (auto open = open_tasks_.find(worker);
        open != open_tasks_.end() && open->second.task.kind() == v1::Task::TRAIN) {
      ALOE_RETURN_IF_ERROR(EndOpenTask(worker));
    }
    return NewTask(v1::Task::STOP);
  }
  if (draining_) {
    v1::Task wait = NewTask(v1::Task::WAIT);
    wait.set_draining(true);
    return wait;
  }
  std::optional<uint64_t> base = lanes_[group]->StartVersion(worker, group_version(group),
                                                             membership_.LiveIds(v1::ROLE_TRAINER));
  ObserveReleases();
  if (!base) return NewTask(v1::Task::WAIT);
  started[group] = *base;
  if (!started_) started_ = clock_.Now();
  ExpectGroupPush(worker, group);
  return granted(*base);
}

void ServerCore::ExpectGroupPush(uint64_t worker, uint32_t group) {
  if (aligned_lanes_.size() != lanes_.size() || lanes_.size() <= 1) return;
  auto open = open_tasks_.find(worker);
  if (open == open_tasks_.end() || open->second.round == 0) return;
  // The group's next push belongs to the open task unless that task pushed the group already:
  // then to the next task, of the next round (its slack is not known yet).
  const bool pushed = open->second.groups_pushed.count(group) > 0;
  aligned_lanes_[group]->Expect(
      worker, open->second.round + (pushed ? 1 : 0),
      absl::Seconds(pushed ? 0.0 : std::min(open->second.slack_seconds, 1e9)));
}

absl::StatusOr<v1::Task> ServerCore::AheadTask(uint64_t worker) {
  if (auto ahead = ahead_tasks_.find(worker); ahead != ahead_tasks_.end()) {
    return ahead->second.task;  // a repeated request
  }
  CloseDueWindows();
  UpdateStopping();
  if (stopping_) return NewTask(v1::Task::STOP);
  if (config_.max_versions() > 0) {
    // The tasks already out reach the last version: no work beyond them (else every
    // overlapping worker would add one update past the stop). Each of them is an outer step of
    // its own, except in sync rounds: there the open round is one, and the look-ahead task joins
    // the next.
    uint64_t in_flight = ahead_tasks_.size();
    for (const auto& [id, open] : open_tasks_) in_flight += open.task.kind() == v1::Task::TRAIN;
    if (config_.aggregation().mode() != v1::AGGREGATION_ASYNC) in_flight = 1;
    in_flight *= lanes_.size();  // with layer groups a task makes a step of every group
    if (version() + in_flight >= config_.max_versions()) return NewTask(v1::Task::STOP);
  }
  if (draining_) {
    v1::Task wait = NewTask(v1::Task::WAIT);
    wait.set_draining(true);
    return wait;
  }
  // The version the worker's next task would start from once its last push is released (one
  // step behind: the task's own predecessor is still to be pushed). WAIT while that push's sync
  // round or grace window is open.
  const uint64_t current = version();
  if (lanes_.size() > 1) {
    // Layer groups: the next task while the open one's last push is on its way; the groups'
    // aggregations hold the worker at StartGroup, not here. Aligned DyLU plans it from now: the
    // open task is ending.
    const LocalWorkPlanner::Start start{clock_.Now(), 0, /*ungated=*/true};
    OpenTask ahead = NewTrainTask(worker, current, &start);
    ahead.base_pulled = true;
    for (uint32_t g = 0; g < lanes_.size(); ++g) ahead.task.add_group_versions(group_version(g));
    ahead_tasks_[worker] = ahead;
    metrics_.Add(kTasksAhead, 1);
    PublishShards();
    return ahead.task;
  }
  std::optional<uint64_t> base =
      aggregation_->StartAhead(worker, current, membership_.LiveIds(v1::ROLE_TRAINER));
  if (!base) return NewTask(v1::Task::WAIT);
  if (*base != current && retained_.count(*base) == 0) {
    // Cannot happen: released versions are retained when the release happens.
    ALOE_LOG_ERROR("server", "version %d to start worker %d ahead from is gone; using %d", *base,
                   worker, current);
    base = current;
  }
  if (*base == current && retained_.count(current) == 0) retained_[current] = Snapshot();
  OpenTask ahead = NewTrainTask(worker, *base);
  ahead_tasks_[worker] = ahead;
  metrics_.Add(kTasksAhead, 1);
  PublishShards();
  return ahead.task;
}

absl::Status ServerCore::EndOpenTask(uint64_t worker) {
  const OpenTask& open = open_tasks_[worker];
  sampler_.Release(open.shard, open.assigned_tokens);
  open_tasks_.erase(worker);
  staged_.erase(worker);
  // With layer groups the aggregations track group work, not tasks.
  ApplyBatch completed = lanes_.size() > 1 ? ApplyBatch{} : aggregation_->OnWorkEnded(worker);
  if (!completed.updates.empty()) ALOE_RETURN_IF_ERROR(Apply(std::move(completed)));
  PromoteAhead(worker);
  PruneRetained();
  PublishShards();
  return absl::OkStatus();
}

void ServerCore::PromoteAhead(uint64_t worker) {
  auto ahead = ahead_tasks_.find(worker);
  if (ahead == ahead_tasks_.end()) return;
  open_tasks_[worker] = std::move(ahead->second);
  ahead_tasks_.erase(ahead);
  if (lanes_.size() == 1) aggregation_->PromoteAhead(worker);
}

v1::Task ServerCore::EvaluatorTask(uint64_t worker) {
  const uint64_t version = this->version();
  const bool final_state =
      stopping_ && std::none_of(lanes_.begin(), lanes_.end(),
                                [](const auto& lane) { return lane->InProgress(); });
  const bool due = !last_eval_version_.has_value() ||
                   version >= *last_eval_version_ + config_.eval_every() ||
                   (final_state && *last_eval_version_ != version);
  if (!due) return NewTask(final_state ? v1::Task::STOP : v1::Task::WAIT);
  v1::Task task = NewTask(v1::Task::EVAL);
  last_eval_version_ = version;
  // Kept until evaluated, so the evaluation measures exactly this version.
  if (retained_.count(version) == 0) retained_[version] = Snapshot();
  open_tasks_[worker] = OpenTask{task, 0};
  return task;
}

absl::StatusOr<ModelSnapshot> ServerCore::SnapshotFor(const v1::PullRequest& request) const {
  ALOE_RETURN_IF_ERROR(LiveMember(request.worker_id()).status());
  ALOE_RETURN_IF_ERROR(CheckSlice(request.slice(), request.slices()));
  if (request.by_group()) {
    if (request.group() >= lanes_.size()) {
      return absl::InvalidArgumentError(absl::StrFormat("pull of layer group %d, the model has %d",
                                                        request.group(), lanes_.size()));
    }
    return Snapshot();  // the service streams the group's layers of the current version
  }
  if (request.latest() || request.version() == version()) return Snapshot();
  auto it = retained_.find(request.version());
  if (it == retained_.end()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("version %d is not available (at version %d; retained: [%s])",
                        request.version(), version(), absl::StrJoin(RetainedVersions(), ", ")));
  }
  return it->second;
}

absl::Status ServerCore::CheckPushHeader(const v1::PushHeader& header) const {
  ALOE_ASSIGN_OR_RETURN(const Member* member, LiveMember(header.worker_id()));
  auto open = open_tasks_.find(member->id);
  if (open == open_tasks_.end() || open->second.task.kind() != v1::Task::TRAIN ||
      open->second.task.task_id() != header.task_id()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker %d has no open training task %d (already pushed, or never assigned)", member->id,
        header.task_id()));
  }
  if (lanes_.size() > 1) {
    ALOE_RETURN_IF_ERROR(CheckGroupPush(member->id, header));
  } else if (header.group() != 0 || header.task_continues()) {
    return absl::InvalidArgumentError(
        "push names a layer group, but this server synchronizes the whole model "
        "(partial_sync.groups is 1)");
  } else if (header.base_version() != open->second.task.base_version()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "stale version: push is based on version %d but task %d started from version %d",
        header.base_version(), header.task_id(), open->second.task.base_version()));
  }
  if (!v1::Codec_IsValid(header.codec())) {
    return absl::InvalidArgumentError(absl::StrFormat("unsupported codec %d", header.codec()));
  }
  ALOE_RETURN_IF_ERROR(CheckSlice(header.slice(), header.slices()));
  const uint32_t limit = 1000 * std::max<uint32_t>(1, open->second.task.local_steps());
  if (header.steps_done() == 0 || header.steps_done() > limit) {
    return absl::InvalidArgumentError(
        absl::StrFormat("steps_done must be in [1, %d], got %d", limit, header.steps_done()));
  }
  if (!std::isfinite(header.train_loss()) || !std::isfinite(header.compute_seconds()) ||
      header.compute_seconds() < 0) {
    return absl::InvalidArgumentError("train_loss and compute_seconds must be finite");
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PushReply> ServerCore::SubmitUpdate(PendingUpdate update) {
  const bool want_next_task = update.want_next_task;      // of this push, not the merged slices
  const uint64_t received_bytes = update.received_bytes;  // likewise
  v1::PushHeader header;
  header.set_worker_id(update.worker_id);
  header.set_task_id(update.task_id);
  header.set_base_version(update.base_version);
  header.set_steps_done(update.steps_done);
  header.set_train_loss(update.train_loss);
  header.set_compute_seconds(update.compute_seconds);
  header.set_slice(update.slice);
  header.set_slices(update.slices);
  header.set_group(update.group);
  header.set_task_continues(update.task_continues);
  update.by_group = lanes_.size() > 1;  // with layer groups every push carries one group
  absl::Status status = CheckPushHeader(header);
  if (status.ok()) status = backend_->CheckShapes(update);
  if (status.ok()) status = CheckObservedRanks(update.observed_ranks);
  if (!status.ok()) {
    CountRejected(status);
    return status;
  }
  if (update.by_group) return SubmitGroupUpdate(std::move(update));
  if (update.slices > 1) {
    absl::StatusOr<std::optional<PendingUpdate>> whole = StageSlice(std::move(update));
    if (!whole.ok()) {
      CountRejected(whole.status());
      return whole.status();
    }
    if (!whole->has_value()) {
      RecordPush(header.worker_id(), 0, received_bytes);
      v1::PushReply reply;
      reply.set_staged(true);
      reply.set_slices_received(staged_[header.worker_id()].count);
      reply.set_version(version());
      return reply;
    }
    update = **std::move(whole);
  }
  const uint64_t worker = update.worker_id;
  const uint64_t task_id = update.task_id;
  const std::vector<v1::TensorRank> observed = std::move(update.observed_ranks);
  // A window whose grace ran out closes before this arrival.
  CloseDueWindows();
  // Staleness = the version it is applied to - the version it started from. A sync round's
  // look-ahead work pushed before its round opened is applied to the version that round opens at.
  const uint64_t staleness =
      std::max(version(), aggregation_->TargetVersion(worker, update.base_version, version())) -
      update.base_version;
  absl::StatusOr<float> scale = StalenessScale(config_.outer_optimizer(), staleness);
  if (!scale.ok()) {
    // Too stale: dropped like the work of a departed worker; the worker starts afresh.
    metrics_.Add(kUpdatesRejected, 1, {"too_stale"});
    metrics_.Observe(kUpdateStaleness, static_cast<double>(staleness));
    ALOE_RETURN_IF_ERROR(EndOpenTask(worker));
    return scale.status();
  }
  // Where the update carries no layers, the discount goes with it as part of its weight.
  if (*scale != 1.0f) ScaleUpdate(update, *scale);
  absl::StatusOr<ApplyBatch> batch = aggregation_->Submit(std::move(update), version());
  if (!batch.ok()) {
    CountRejected(batch.status());
    return batch.status();
  }
  // Only an accepted update's speed and ranks count (a rejected push must leave the state
  // unchanged).
  planner_.ReportSpeed(
      worker, header.compute_seconds() > 0 ? header.steps_done() / header.compute_seconds() : 0.0);
  PublishSpeed(worker);
  RecordObservedRanks(observed);
  RecordPush(worker, staleness, received_bytes);
  metrics_.Observe(kUpdateStaleness, static_cast<double>(staleness));
  metrics_.Observe(kLayerGroupStaleness, static_cast<double>(staleness), {"0"});
  submitted_[task_id] = open_tasks_[worker];
  open_tasks_.erase(worker);
  PruneRetained();
  v1::PushReply reply;
  reply.set_applied(!batch->updates.empty());
  if (reply.applied()) ALOE_RETURN_IF_ERROR(Apply(*std::move(batch)));
  // With nobody else left to arrive a window closes at once (paper 002 Alg. 2, else branch).
  CloseDueWindows();
  PromoteAhead(worker);
  reply.set_version(version());
  reply.set_staleness(staleness);
  if (want_next_task) AttachNextTask(worker, reply);
  return reply;
}

void ServerCore::AttachNextTask(uint64_t worker, v1::PushReply& reply) {
  // What the worker's RequestTask right after this reply would get, minus its round trip.
  v1::TaskRequest next;
  next.set_worker_id(worker);
  absl::StatusOr<v1::Task> task = RequestTask(next);
  if (task.ok() && task->kind() != v1::Task::WAIT) {
    *reply.mutable_next_task() = *std::move(task);
    metrics_.Add(kTasksInPushReplies, 1);
  }
}

absl::Status ServerCore::CheckGroupPush(uint64_t worker, const v1::PushHeader& header) const {
  const uint32_t group = header.group();
  if (group >= lanes_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("push of layer group %d, the model has %d", group, lanes_.size()));
  }
  if (header.slices() > 1) {
    return absl::InvalidArgumentError("sliced pushes of layer groups are not supported");
  }
  auto started = group_started_.find(worker);
  if (started == group_started_.end() || started->second.count(group) == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker %d pushes layer group %d without having taken it (TaskRequest.start_group), or "
        "pushes it twice",
        worker, group));
  }
  if (header.base_version() > group_version(group) ||
      header.base_version() < started->second.at(group)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "push of layer group %d is based on version %d, but the worker took version %d and the "
        "group is at %d",
        group, header.base_version(), started->second.at(group), group_version(group)));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PushReply> ServerCore::SubmitGroupUpdate(PendingUpdate update) {
  const uint64_t worker = update.worker_id;
  const uint32_t group = update.group;
  const bool ends_task = !update.task_continues;
  const bool want_next_task = update.want_next_task && ends_task;
  const double speed =
      update.compute_seconds > 0 ? update.steps_done / update.compute_seconds : 0.0;
  const uint64_t received_bytes = update.received_bytes;
  CloseDueWindows();
  const uint64_t staleness = group_version(group) - update.base_version;
  const LabelValues group_label = {absl::StrCat(group)};
  absl::StatusOr<float> scale = StalenessScale(config_.outer_optimizer(), staleness);
  if (!scale.ok()) {
    // Too stale: the group's work is dropped; the worker takes the group again.
    metrics_.Add(kUpdatesRejected, 1, {"too_stale"});
    metrics_.Observe(kLayerGroupStaleness, static_cast<double>(staleness), group_label);
    group_started_[worker].erase(group);
    ApplyLogged(lanes_[group]->OnWorkEnded(worker));
    return scale.status();
  }
  if (*scale != 1.0f) ScaleUpdate(update, *scale);
  const uint64_t task_id = update.task_id;
  const std::vector<v1::TensorRank> observed = std::move(update.observed_ranks);
  absl::StatusOr<ApplyBatch> batch = lanes_[group]->Submit(std::move(update), group_version(group));
  if (!batch.ok()) {
    CountRejected(batch.status());
    return batch.status();
  }
  RecordObservedRanks(observed);
  RecordPush(worker, staleness, received_bytes);
  group_started_[worker].erase(group);
  metrics_.Observe(kUpdateStaleness, static_cast<double>(staleness));
  metrics_.Observe(kLayerGroupStaleness, static_cast<double>(staleness), group_label);
  open_tasks_[worker].groups_pushed.insert(group);
  if (ends_task) {
    planner_.ReportSpeed(worker, speed);
    PublishSpeed(worker);
    submitted_[task_id] = open_tasks_[worker];
    open_tasks_.erase(worker);
    PromoteAhead(worker);
  }
  v1::PushReply reply;
  reply.set_applied(!batch->updates.empty());
  if (reply.applied()) ALOE_RETURN_IF_ERROR(Apply(*std::move(batch)));
  CloseDueWindows();
  reply.set_version(version());
  reply.set_group_version(group_version(group));
  reply.set_staleness(staleness);
  if (want_next_task) AttachNextTask(worker, reply);
  return reply;
}

absl::Status ServerCore::CheckObservedRanks(absl::Span<const v1::TensorRank> observed) const {
  if (observed.empty()) return absl::OkStatus();
  if (adaptive_ == nullptr) {
    return absl::InvalidArgumentError(
        "push carries observed ranks, but this server does not adapt ranks "
        "(transport.adaptive_rank is off)");
  }
  return adaptive_->Check(observed);
}

void ServerCore::RecordObservedRanks(absl::Span<const v1::TensorRank> observed) {
  if (adaptive_ == nullptr || observed.empty()) return;
  adaptive_->Record(observed);
  ApplyAdaptiveLocalSteps();
}

void ServerCore::ApplyAdaptiveLocalSteps() {
  const LocalWorkPlanner::Options base = PlannerOptions(config_);
  planner_.SetLocalSteps(adaptive_->local_steps(),
                         base.time_budget_seconds * adaptive_->local_steps_scale());
  adaptive_->Publish(metrics_);
}

void ServerCore::ApplyLogged(ApplyBatch batch) {
  if (batch.updates.empty()) return;
  absl::Status s = Apply(std::move(batch));
  if (!s.ok()) ALOE_LOG_ERROR("server", "%s", s.ToString());
}

absl::StatusOr<std::optional<PendingUpdate>> ServerCore::StageSlice(PendingUpdate update) {
  auto it = staged_.find(update.worker_id);
  if (it != staged_.end() && (it->second.merged.task_id != update.task_id ||
                              it->second.merged.update_id != update.update_id ||
                              it->second.received.size() != update.slices)) {
    staged_.erase(it);  // a new update (or task) supersedes the slices staged so far
    it = staged_.end();
  }
  if (it != staged_.end()) {
    const PendingUpdate& first = it->second.merged;
    if (update.steps_done != first.steps_done || update.tokens_learned != first.tokens_learned) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "slice %d of update %d reports %d steps and %d tokens; its other slices reported %d "
          "and %d",
          update.slice, update.update_id, update.steps_done, update.tokens_learned,
          first.steps_done, first.tokens_learned));
    }
  }
  if (it == staged_.end()) {
    StagedUpdate staged;
    staged.received.assign(update.slices, false);
    staged.received[update.slice] = true;
    staged.count = 1;
    staged.merged = std::move(update);
    it = staged_.emplace(staged.merged.worker_id, std::move(staged)).first;
  } else {
    // Copy this slice in (again, for a retried slice: the newer copy wins).
    StagedUpdate& staged = it->second;
    for (size_t l = 0; l < update.layers.size(); ++l) {
      const auto [first, last] = SliceRange(update.layers[l].size(), update.slices, update.slice);
      std::copy(update.layers[l].begin() + first, update.layers[l].begin() + last,
                staged.merged.layers[l].begin() + first);
    }
    if (!update.observed_ranks.empty()) {
      staged.merged.observed_ranks = std::move(update.observed_ranks);
    }
    // The slices' sums of squares add up; a retried slice's would count twice: unmeasured.
    std::vector<double>& squares = staged.merged.layer_squares;
    if (staged.received[update.slice] || update.layer_squares.size() != squares.size()) {
      squares.clear();
    } else {
      for (size_t l = 0; l < squares.size(); ++l) squares[l] += update.layer_squares[l];
    }
    if (!staged.received[update.slice]) {
      staged.received[update.slice] = true;
      ++staged.count;
    }
  }
  if (it->second.count < it->second.received.size()) return std::optional<PendingUpdate>();
  PendingUpdate whole = std::move(it->second.merged);
  staged_.erase(it);
  whole.slice = 0;
  whole.slices = 1;
  return std::optional<PendingUpdate>(std::move(whole));
}

absl::Status ServerCore::Apply(ApplyBatch batch) {
  CapRetained();  // before the step: a version not held is stepped in place, not copied
  ObserveReleases();
  ALOE_RETURN_IF_ERROR(backend_->ApplyOuterStep(batch));
  double loss_sum = 0;
  const std::optional<uint32_t> group =
      batch.updates[0].by_group ? std::optional<uint32_t>(batch.updates[0].group) : std::nullopt;
  for (const PendingUpdate& u : batch.updates) {
    // A task's steps and tokens count once: with its push that ends it.
    if (u.task_continues) {
      loss_sum += u.train_loss;
      continue;
    }
    auto it = submitted_.find(u.task_id);
    if (it != submitted_.end()) {
      sampler_.RecordLearned(it->second.shard, it->second.assigned_tokens, u.steps_done,
                             u.tokens_learned);
      submitted_.erase(it);
    }
    metrics_.Add(kTokensLearned, static_cast<double>(u.tokens_learned));
    loss_sum += u.train_loss;
  }
  updates_applied_ += batch.updates.size();
  metrics_.Add(kUpdatesApplied, static_cast<double>(batch.updates.size()));
  metrics_.Add(kOuterSteps, 1);
  metrics_.Set(kModelVersion, static_cast<double>(version()));
  // Without groups the model is group 0.
  metrics_.Set(kLayerGroupVersion, static_cast<double>(group_version(group.value_or(0))),
               {absl::StrCat(group.value_or(0))});
  metrics_.Set(kRoundParticipants, static_cast<double>(aggregation_->active_workers()));
  metrics_.Set(kTrainLoss, loss_sum / static_cast<double>(batch.updates.size()));
  PublishShards();
  const uint32_t every = config_.checkpoint().every_versions();
  if (!config_.checkpoint().dir().empty() && every > 0 && version() % every == 0) {
    if (!backend_->keeps_every_checkpoint()) due_checkpoints_.clear();
    due_checkpoints_.push_back(CaptureCheckpoint());
  }
  if (std::optional<std::string> line =
          step_log_.Step(clock_.Now(), version(), batch.updates.size(),
                         loss_sum / static_cast<double>(batch.updates.size()))) {
    ALOE_LOG_INFO("server", "%s", *line);
  }
  UpdateStopping();
  return absl::OkStatus();
}

absl::Status ServerCore::ReportEval(const v1::EvalReport& report) {
  ALOE_ASSIGN_OR_RETURN(const Member* member, LiveMember(report.worker_id()));
  auto open = open_tasks_.find(member->id);
  if (open == open_tasks_.end() || open->second.task.kind() != v1::Task::EVAL ||
      open->second.task.task_id() != report.task_id()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("worker %d has no open evaluation task %d", member->id, report.task_id()));
  }
  // The evaluator pulls the task's version (retained until reported).
  if (report.version() < open->second.task.base_version() || report.version() > version()) {
    return absl::InvalidArgumentError(absl::StrFormat("evaluated version %d is outside [%d, %d]",
                                                      report.version(),
                                                      open->second.task.base_version(), version()));
  }
  if (!std::isfinite(report.loss()) || report.loss() < 0 || report.tokens() == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("evaluation loss must be finite and >= 0 over > 0 tokens, got %g over %d",
                        report.loss(), report.tokens()));
  }
  open_tasks_.erase(open);
  PruneRetained();
  eval_history_.push_back(EvalPoint{report.version(), report.loss()});
  if (!last_eval_version_ || report.version() > *last_eval_version_) {
    last_eval_version_ = report.version();
  }
  ALOE_LOG_INFO("server", "eval version %d: loss %.4f perplexity %.2f (%d tokens)",
                report.version(), report.loss(), std::exp(report.loss()), report.tokens());
  metrics_.Set(kEvalLoss, report.loss());
  metrics_.Set(kEvalPerplexity, std::exp(report.loss()));
  metrics_.Set(kEvalVersion, static_cast<double>(report.version()));
  return absl::OkStatus();
}

absl::Status ServerCore::Leave(const v1::LeaveRequest& request) {
  ALOE_RETURN_IF_ERROR(membership_.Leave(request.worker_id()));
  metrics_.Add(kWorkersLeft, 1);
  WorkerGone(request.worker_id());
  return absl::OkStatus();
}

void ServerCore::WorkerGone(uint64_t worker) {
  auto open = open_tasks_.find(worker);
  if (open != open_tasks_.end()) {
    // An evaluation that will never be reported is handed out again.
    if (open->second.task.kind() == v1::Task::EVAL && last_eval_version_ &&
        *last_eval_version_ == open->second.task.base_version()) {
      last_eval_version_.reset();
      if (!eval_history_.empty()) last_eval_version_ = eval_history_.back().version;
    }
    if (open->second.task.kind() == v1::Task::TRAIN) {
      // Its tokens were never learned: back to the shard's budget.
      sampler_.Release(open->second.shard, open->second.assigned_tokens);
    }
    open_tasks_.erase(open);
  }
  if (auto ahead = ahead_tasks_.find(worker); ahead != ahead_tasks_.end()) {
    sampler_.Release(ahead->second.shard, ahead->second.assigned_tokens);
    ahead_tasks_.erase(ahead);
  }
  planner_.Forget(worker);
  staged_.erase(worker);
  activity_.erase(worker);
  backend_->DropUnsubmitted(worker);
  if (auto labels = trainer_labels_.find(worker); labels != trainer_labels_.end()) {
    metrics_.Remove(kTrainerStepsPerSecond, labels->second);
    metrics_.Remove(kTrainerPlannedSteps, labels->second);
    trainer_labels_.erase(labels);
  }
  group_started_.erase(worker);
  for (auto& lane : lanes_) ApplyLogged(lane->OnWorkerGone(worker));
  // Worker ids are never reused: what is kept per worker can go.
  backend_->ForgetWorker(worker);
  PruneRetained();
  PublishMembership();
  PublishShards();
}

void ServerCore::CloseDueWindows() {
  if (lanes_.size() > 1) {
    // Workers take their groups at the groups' current versions: nothing to retain.
    for (uint32_t g = 0; g < lanes_.size(); ++g) lanes_[g]->CloseExpired(group_version(g));
    ObserveReleases();
    return;
  }
  if (aggregation_->CloseExpired(version())) {
    // The released workers all start from this version, whatever is applied meanwhile.
    retained_[version()] = Snapshot();
    PruneRetained();
  }
  // A sync round whose participants started ahead opens as soon as the one before it closed;
  // it is complete at once when all of them pushed already and everybody else left.
  ApplyLogged(aggregation_->BeginAhead(version(), membership_.LiveIds(v1::ROLE_TRAINER)));
  ObserveReleases();
}

void ServerCore::ObserveReleases() {
  for (auto& lane : lanes_) {
    for (size_t workers : lane->TakeReleasedGroups()) {
      metrics_.Observe(kGraceWindowWorkers, static_cast<double>(workers));
    }
  }
}

void ServerCore::RecordPush(uint64_t worker, uint64_t staleness, uint64_t bytes) {
  PushActivity& a = activity_[worker];
  a.last = clock_.Now();
  a.staleness = staleness;
  ++a.pushes;
  a.bytes += bytes;
}

std::vector<LiveWorker> ServerCore::LiveWorkers() const {
  std::vector<LiveWorker> workers;
  for (const v1::Role role : {v1::ROLE_TRAINER, v1::ROLE_EVALUATOR, v1::ROLE_OBSERVER}) {
    for (const uint64_t id : membership_.LiveIds(role)) {
      const Member* m = membership_.Find(id);
      LiveWorker w;
      w.id = id;
      w.name = m->name;
      w.role = m->role;
      w.joined = m->joined;
      w.tokens_per_step =
          static_cast<uint64_t>(config_.inner_optimizer().batch_size()) * config_.model().seq_len();
      if (role == v1::ROLE_TRAINER) {
        w.steps_per_second = planner_.speed(id);
        if (w.steps_per_second <= 0) w.steps_per_second = m->steps_per_second;
      }
      if (auto a = activity_.find(id); a != activity_.end()) {
        w.last_push = a->second.last;
        w.last_staleness = a->second.staleness;
        w.pushes = a->second.pushes;
        w.received_bytes = a->second.bytes;
      }
      w.state = role == v1::ROLE_OBSERVER ? "reading" : draining_ ? "draining" : "waiting";
      if (auto open = open_tasks_.find(id); open != open_tasks_.end()) {
        const bool eval = open->second.task.kind() == v1::Task::EVAL;
        w.state = eval ? "evaluating" : "training";
        if (!eval) w.planned_steps = open->second.task.local_steps();
      }
      workers.push_back(std::move(w));
    }
  }
  return workers;
}

void ServerCore::PublishSpeed(uint64_t worker) {
  auto labels = trainer_labels_.find(worker);
  if (labels == trainer_labels_.end()) return;
  metrics_.Set(kTrainerStepsPerSecond, planner_.speed(worker), labels->second);
}

void ServerCore::PublishShards() {
  const std::vector<double> p = sampler_.Probabilities();
  for (size_t i = 0; i < sampler_.size(); ++i) {
    const LabelValues shard = {sampler_.shard(i).name};
    metrics_.Set(kDataShardTokensLearned, static_cast<double>(sampler_.tokens_learned(i)), shard);
    metrics_.Set(kDataShardTokensInFlight, static_cast<double>(sampler_.tokens_in_flight(i)),
                 shard);
    metrics_.Set(kDataShardSamplingProbability, p[i], shard);
    metrics_.Set(kDataShardLrStep, static_cast<double>(sampler_.lr_step(i)), shard);
    metrics_.Set(kDataShardLearningRate,
                 InnerLearningRate(config_.inner_optimizer(), sampler_.lr_step(i)), shard);
  }
}

absl::Status ServerCore::MarkBasePulled(uint64_t worker, const v1::HeartbeatRequest& request) {
  if (request.pulled_task_id() == 0) return absl::OkStatus();
  const uint32_t slices = std::max<uint32_t>(1, request.pulled_slices());
  OpenTask* task = nullptr;
  for (auto* tasks : {&open_tasks_, &ahead_tasks_}) {
    auto it = tasks->find(worker);
    if (it != tasks->end() && it->second.task.task_id() == request.pulled_task_id() &&
        it->second.task.kind() == v1::Task::TRAIN) {
      task = &it->second;
    }
  }
  if (task == nullptr || task->base_pulled) return absl::OkStatus();
  if (task->pulled.size() != slices) task->pulled.assign(slices, false);
  task->pulled[request.pulled_slice()] = true;
  if (std::find(task->pulled.begin(), task->pulled.end(), false) != task->pulled.end()) {
    return absl::OkStatus();
  }
  task->base_pulled = true;
  PruneRetained();
  return absl::OkStatus();
}

void ServerCore::PruneRetained() {
  // A task's base version is kept until its worker has pulled it (or the task ends).
  std::set<uint64_t> needed;
  for (const auto& [worker, open] : open_tasks_) {
    if (!open.base_pulled) needed.insert(open.task.base_version());
  }
  for (const auto& [worker, ahead] : ahead_tasks_) {
    if (!ahead.base_pulled) needed.insert(ahead.task.base_version());
  }
  if (auto pending = aggregation_->PendingStartVersion()) needed.insert(*pending);
  for (auto it = retained_.begin(); it != retained_.end();) {
    it = needed.count(it->first) ? std::next(it) : retained_.erase(it);
  }
}

void ServerCore::CapRetained() {
  PruneRetained();
  const uint64_t current = version();
  auto held = retained_.find(current);
  if (held == retained_.end()) return;
  const size_t older = std::distance(retained_.begin(), held);
  if (older < config_.max_retained_versions()) return;
  // Held for an evaluation (which measures exactly this version) or a grace window's released
  // workers (who all start from it): kept whatever the cap says.
  if (aggregation_->PendingStartVersion() == current) return;
  for (const auto& [worker, open] : open_tasks_) {
    if (open.task.kind() == v1::Task::EVAL && open.task.base_version() == current) return;
  }
  // Only training tasks that have not reported their pull start from it. Dropping it costs
  // those whose pull has not begun a new task (a pull under way holds its version until it
  // ends; one that begins later finds the version gone and its worker gives the task up), while
  // holding it would cost a copy of the parameters. The versions held already stay, so a slow
  // pull is never cut off by newer ones.
  retained_.erase(held);
  metrics_.Add(kRetainedVersionsDropped, 1);
}

void ServerCore::Tick() {
  CloseDueWindows();
  for (uint64_t worker : membership_.ExpireLeases()) {
    ALOE_LOG_WARNING("server", "worker %d: lease expired, dropped", worker);
    metrics_.Add(kWorkersExpired, 1);
    WorkerGone(worker);
  }
  UpdateStopping();
  PublishMembership();
}

void ServerCore::UpdateStopping() {
  if (!stopping_) {
    if (config_.max_versions() > 0 && version() >= config_.max_versions()) stopping_ = true;
    if (config_.max_seconds() > 0 && (started_ || restored_seconds_ > 0) &&
        TrainedSeconds() >= config_.max_seconds()) {
      stopping_ = true;
    }
  }
  // The job's last versions appear in the log even when they came faster than one line a second
  // (also the steps of updates still pushed after the stop: Apply calls this after every step).
  if (stopping_) {
    if (std::optional<std::string> line = step_log_.Flush()) ALOE_LOG_INFO("server", "%s", *line);
  }
}

void ServerCore::PublishMembership() {
  metrics_.Set(kLiveWorkers, static_cast<double>(membership_.size()));
  CheckDnBuffer();
}

void ServerCore::CheckDnBuffer() {
  const uint32_t n = dn_trainer_limit_;
  bool above = false;
  if (n > 0) {
    const size_t trainers = membership_.LiveIds(v1::ROLE_TRAINER).size();
    above = trainers > n;
    if (above && !dn_trainers_above_) {
      ALOE_LOG_WARNING("server",
                       "%d live trainers exceed outer_optimizer.dn_buffer_size %d: async Delayed "
                       "Nesterov with more trainers than its buffer is known to diverge; set "
                       "dn_buffer_size to the number of trainers (docs/algorithms.md)",
                       trainers, n);
    } else if (!above && dn_trainers_above_) {
      ALOE_LOG_INFO("server", "%d live trainers within outer_optimizer.dn_buffer_size %d again",
                    trainers, n);
    }
  }
  dn_trainers_above_ = above;
  const bool unstable = above || (n > 0 && config_.aggregation().min_workers() > n);
  metrics_.Set(kConfigUnstable, unstable ? 1.0 : 0.0, {kDnBufferBelowTrainers});
}

bool ServerCore::Finished() const {
  return stopping_ && membership_.size() == 0 &&
         std::none_of(lanes_.begin(), lanes_.end(),
                      [](const auto& lane) { return lane->InProgress(); });
}

std::optional<absl::Time> ServerCore::NextDeadline() const {
  std::optional<absl::Time> next;
  for (const auto& lane : lanes_) {
    std::optional<absl::Time> due = lane->Deadline();
    if (due && (!next || *due < *next)) next = due;
  }
  return next;
}

double ServerCore::TrainedSeconds() const {
  return restored_seconds_ + (started_ ? absl::ToDoubleSeconds(clock_.Now() - *started_) : 0.0);
}

std::string ServerCore::Fingerprint() const {
  return FingerprintOf(config_, spec(), sampler_.size(), model_fingerprint_);
}

std::string ServerCore::FingerprintOf(const v1::ServerConfig& config, const v1::ModelSpec& spec,
                                      size_t data_shards, const std::string& model_fingerprint) {
  std::string f = absl::StrFormat("outer=%s/N=%d;",
                                  v1::OuterOptimizerType_Name(config.outer_optimizer().type()),
                                  config.outer_optimizer().dn_buffer_size());
  for (const v1::LayerSpec& layer : spec.layers()) {
    absl::StrAppendFormat(&f, "%s:%d;", layer.name(), layer.num_elements());
  }
  absl::StrAppendFormat(&f, "penalty=%d;shards=%d", config.penalty().enabled(), data_shards);
  if (!model_fingerprint.empty()) absl::StrAppend(&f, ";model=", model_fingerprint);
  if (config.shard_processes() > 0) {
    absl::StrAppend(&f, ";processes=", config.shard_processes());
  }
  if (config.partial_sync().groups() > 1) {
    absl::StrAppend(&f, ";layer_groups=", config.partial_sync().groups());
  }
  return f;
}

std::vector<uint64_t> ServerCore::RetainedVersions() const {
  std::vector<uint64_t> versions;
  for (const auto& [version, snapshot] : retained_) versions.push_back(version);
  return versions;
}

absl::StatusOr<v1::PushReply> ServerCore::SubmitShardPart(uint32_t shard,
                                                          const v1::PushHeader& header) {
  // The shard merged the slices of a sliced push: the coordinator sees whole updates.
  v1::PushHeader whole = header;
  whole.set_slice(0);
  whole.set_slices(1);
  absl::Status status = CheckPushHeader(whole);
  if (!status.ok()) {
    // A retry of a push whose update was already submitted finds no open task: the parts
    // staged for it are gone or committed, nothing to discard.
    CountRejected(status);
    return status;
  }
  ALOE_ASSIGN_OR_RETURN(const uint32_t staged, backend_->StagePart(shard, header));
  if (staged < backend_->PartsOf(header.group())) {
    v1::PushReply reply;
    reply.set_staged(true);
    reply.set_slices_received(staged);
    reply.set_version(version());
    return reply;
  }
  absl::StatusOr<v1::PushReply> reply = SubmitUpdate(UpdateOfHeader(whole));
  // Rejected (e.g. too stale): the shards drop what they staged.
  if (!reply.ok()) backend_->Discard(whole.worker_id(), whole.update_id());
  return reply;
}

absl::StatusOr<bool> ServerCore::AdmitPush(const v1::PushHeader& header) {
  v1::PushHeader whole = header;
  whole.set_slice(0);
  whole.set_slices(1);
  if (absl::Status status = CheckPushHeader(whole); !status.ok()) {
    CountRejected(status);
    return status;
  }
  return backend_->Admit(header);
}

v1::ServerCheckpoint ServerCore::CaptureCheckpoint() const {
  v1::ServerCheckpoint c;
  c.set_format(1);
  c.set_fingerprint(Fingerprint());
  c.set_version(version());
  c.set_updates_applied(updates_applied_);
  c.set_next_task_id(next_task_id_);
  c.set_next_worker_id(membership_.next_id());
  backend_->SaveTo(c);
  for (size_t i = 0; i < sampler_.size(); ++i) {
    c.add_shard_steps(sampler_.lr_step(i));
    c.add_shard_tokens(sampler_.tokens_learned(i));
  }
  c.set_sampler_rng(sampler_.RngState());
  for (const EvalPoint& e : eval_history_) {
    c.add_eval_versions(e.version);
    c.add_eval_losses(e.loss);
  }
  c.set_trained_seconds(TrainedSeconds());
  c.set_stopping(stopping_);
  if (adaptive_ != nullptr) adaptive_->SaveTo(c);
  return c;
}

void ServerCore::ContinueIdsOf(const ServerCore& previous) {
  next_task_id_ = std::max(next_task_id_, previous.next_task_id_);
  membership_.set_next_id(previous.membership_.next_id());
}

void ServerCore::SkipWorkerIdsOfLostProcess() {
  membership_.set_next_id(membership_.next_id() + kWorkerIdGapAfterRestart);
}

std::vector<v1::ServerCheckpoint> ServerCore::TakeDueCheckpoints() {
  return std::exchange(due_checkpoints_, {});
}

absl::Status ServerCore::RestoreCheckpoint(const v1::ServerCheckpoint& c) {
  if (c.format() != 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("checkpoint format %d is unknown", c.format()));
  }
  if (c.fingerprint() != Fingerprint()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("checkpoint is for another model or optimizer (%s) than this config (%s)",
                        c.fingerprint(), Fingerprint()));
  }
  if (c.eval_versions_size() != c.eval_losses_size()) {
    return absl::InvalidArgumentError("checkpoint evaluation history is malformed");
  }
  std::vector<uint64_t> steps(c.shard_steps().begin(), c.shard_steps().end());
  std::vector<uint64_t> tokens(c.shard_tokens().begin(), c.shard_tokens().end());
  // Validate everything that can fail before changing anything (the backend restores all or
  // nothing, last).
  DataShardSampler sampler = sampler_;
  ALOE_RETURN_IF_ERROR(sampler.Restore(steps, tokens, c.sampler_rng()));
  std::optional<AdaptiveCompression> adaptive;
  if (adaptive_ != nullptr) {
    adaptive.emplace(*adaptive_);
    ALOE_RETURN_IF_ERROR(adaptive->RestoreFrom(c));
  }
  ALOE_RETURN_IF_ERROR(backend_->RestoreFrom(c));
  sampler_ = std::move(sampler);
  if (adaptive) {
    *adaptive_ = *std::move(adaptive);
    ApplyAdaptiveLocalSteps();
  }
  updates_applied_ = c.updates_applied();
  next_task_id_ = std::max<uint64_t>(1, c.next_task_id());
  membership_.set_next_id(c.next_worker_id());
  eval_history_.clear();
  for (int i = 0; i < c.eval_versions_size(); ++i) {
    eval_history_.push_back(EvalPoint{c.eval_versions(i), c.eval_losses(i)});
  }
  last_eval_version_.reset();
  if (!eval_history_.empty()) last_eval_version_ = eval_history_.back().version;
  restored_seconds_ = c.trained_seconds();
  started_.reset();
  // Whether the job is over follows from the restored progress and THIS config's limits, so a
  // finished job resumed with a larger max_versions or max_seconds trains on (c.stopping() is
  // what the writer's limits said).
  stopping_ = false;
  UpdateStopping();
  retained_.clear();
  group_started_.clear();
  metrics_.Set(kModelVersion, static_cast<double>(version()));
  PublishShards();
  return absl::OkStatus();
}

}  // namespace aloe::server
