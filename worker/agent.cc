#include "worker/agent.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "kernels/cpu/outer_kernels.h"
#include "worker/worker_metrics.h"

namespace aloe::worker {

absl::Duration Backoff::Failure() {
  ++failures_;
  if (failures_ == 1) return absl::ZeroDuration();
  absl::Duration delay = initial_;
  for (uint64_t i = 2; i < failures_ && delay < max_; ++i) delay *= 2;
  return std::min(delay, max_);
}

absl::Status ValidateAgentOptions(const AgentOptions& o) {
  if (!(o.slowdown >= 1.0) || !std::isfinite(o.slowdown)) {
    return absl::InvalidArgumentError("--slowdown must be a finite number >= 1");
  }
  if (o.threads < 1) return absl::InvalidArgumentError("--threads must be >= 1");
  if (o.eval_sequences < 1) return absl::InvalidArgumentError("--eval_sequences must be >= 1");
  if (o.overlap != AgentOptions::Overlap::kOff && o.evaluator) {
    return absl::InvalidArgumentError("--overlap is for trainers (not evaluators)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsSink>> StartWorkerMetrics(const std::string& address) {
  if (address == "off") return std::make_unique<NullMetrics>();
  ALOE_ASSIGN_OR_RETURN(auto prometheus,
                        PrometheusMetrics::Start(address, WorkerMetricCatalogue()));
  ALOE_LOG_INFO("worker", "metrics on port %d", prometheus->port());
  return prometheus;
}

void SleepUnlessStopped(absl::Duration d, const std::atomic<bool>& stop) {
  const absl::Time until = absl::Now() + d;
  for (absl::Time now = absl::Now(); now < until && !stop.load(); now = absl::Now()) {
    absl::SleepFor(std::min(until - now, absl::Milliseconds(50)));
  }
}

// Keeps the lease alive from a background thread. Stops and joins in the destructor.
class Agent::Heartbeater {
 public:
  Heartbeater(ServerApi& server, double lease_seconds)
      : server_(server), period_(absl::Seconds(std::max(0.05, lease_seconds / 3))) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~Heartbeater() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Set(uint64_t worker_id, double steps_per_second) {
    absl::MutexLock lock(&mu_);
    worker_id_ = worker_id;
    steps_per_second_ = steps_per_second;
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), period_);
      if (stop_) break;
      v1::HeartbeatRequest request;
      request.set_worker_id(worker_id_);
      request.set_steps_per_second(steps_per_second_);
      mu_.Unlock();
      absl::StatusOr<v1::HeartbeatReply> reply = server_.Heartbeat(request);
      if (!reply.ok() && reply.status().code() != absl::StatusCode::kUnavailable) {
        ALOE_LOG_WARNING("worker", "heartbeat: %s", reply.status().ToString());
      }
      mu_.Lock();
    }
  }

  ServerApi& server_;
  const absl::Duration period_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t worker_id_ ABSL_GUARDED_BY(mu_) = 0;
  double steps_per_second_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

// What the background half of an overlapped round did: the previous round's push, the
// look-ahead task and the pull of its base.
struct Agent::Communicated {
  std::optional<absl::StatusOr<v1::PushReply>> push;
  uint64_t pushed = 0;
  absl::StatusOr<v1::Task> next = absl::UnknownError("not asked");
  std::vector<std::vector<float>> base;
  uint64_t pulled = 0;
};

Agent::Agent(AgentOptions options, AgentEnv env)
    : options_(std::move(options)),
      env_(std::move(env)),
      server_(*env_.server),
      metrics_(*env_.metrics),
      clock_(*env_.clock),
      name_(options_.name),
      drop_backoff_(options_.drop_backoff_initial, options_.drop_backoff_max) {
  if (!env_.open_shard) corpus_ = std::make_unique<TokenShardCache>(options_.corpus_dir);
  if (name_.empty()) {
    name_ = absl::StrFormat("%s-%d", options_.evaluator ? "evaluator" : "trainer", getpid());
  }
}

Agent::~Agent() = default;

double Agent::SecondsSince(absl::Time start) const {
  return absl::ToDoubleSeconds(clock_.Now() - start);
}

template <typename T>
absl::StatusOr<T> Agent::Retry(const std::function<absl::StatusOr<T>()>& call) {
  const absl::Time give_up = clock_.Now() + options_.connect_timeout;
  while (true) {
    absl::StatusOr<T> result = call();
    if (result.ok() || result.status().code() != absl::StatusCode::kUnavailable ||
        clock_.Now() > give_up || stopping()) {
      return result;
    }
    env_.sleep(options_.retry_interval);
  }
}

absl::StatusOr<v1::JoinReply> Agent::JoinRpc() {
  v1::JoinRequest request;
  request.set_name(name_);
  request.set_role(options_.evaluator ? v1::ROLE_EVALUATOR : v1::ROLE_TRAINER);
  request.set_num_threads(options_.threads);
  request.set_model_fingerprint(options_.model_fingerprint);
  // A server without room for one more trainer takes one once another leaves: wait for that
  // (saying so now and then) instead of exiting, up to join_wait.
  const absl::Time give_up = clock_.Now() + options_.join_wait;
  absl::Time next_note = absl::InfinitePast();
  while (true) {
    absl::StatusOr<v1::JoinReply> joined =
        Retry<v1::JoinReply>([&] { return server_.Join(request); });
    if (joined.ok() || joined.status().code() != absl::StatusCode::kResourceExhausted ||
        clock_.Now() >= give_up || stopping()) {
      return joined;
    }
    if (clock_.Now() >= next_note) {
      ALOE_LOG_WARNING("worker",
                       "the server has no room for this worker yet (%s); asking again "
                       "every %.0f s for up to %.0f s more (--join_wait)",
                       joined.status().message(), absl::ToDoubleSeconds(options_.join_wait_step),
                       absl::ToDoubleSeconds(give_up - clock_.Now()));
      next_note = clock_.Now() + absl::Minutes(1);
    }
    env_.sleep(options_.join_wait_step);
  }
}

absl::Status Agent::Joined(const v1::JoinReply& joined) {
  next_task_.reset();  // a task of the previous membership
  // A layer-sharded server: pulls and pushes go to its shard processes (a single-process server
  // may take raw pushes itself). Every rank of a node comes through here, as each pulls and
  // pushes its own slices.
  absl::Status shards = server_.SetShards(
      {joined.shard_addresses().begin(), joined.shard_addresses().end()},
      {joined.shard_push_addresses().begin(), joined.shard_push_addresses().end()},
      joined.push_address());
  if (!shards.ok()) {
    return absl::Status(shards.code(),
                        absl::StrCat("the server's shard addresses: ", shards.message()));
  }
  joined_ = joined;
  need_join_ = false;
  if (!options_.model_fingerprint.empty() &&
      joined_.model_fingerprint() != options_.model_fingerprint) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the server trains model \"%s\", --torchscript %s is \"%s\"", joined_.model_fingerprint(),
        options_.model_source, options_.model_fingerprint));
  }
  if (trainer_ == nullptr) {
    ALOE_ASSIGN_OR_RETURN(trainer_, env_.make_trainer(joined_));
  }
  if (leader()) {
    if (heartbeat_ == nullptr) {
      heartbeat_ = std::make_unique<Heartbeater>(server_, joined_.lease_seconds());
    }
    heartbeat_->Set(joined_.worker_id(), 0);
  }
  const v1::TransportConfig& transport = joined_.transport();
  codecs_.clear();
  for (const v1::LayerSpec& layer : joined_.model_spec().layers()) {
    v1::Codec codec =
        transport.codec() == v1::CODEC_UNSPECIFIED ? v1::CODEC_FP32 : transport.codec();
    for (const v1::LayerCodec& o : transport.layer_codecs()) {
      if (o.layer() == layer.name()) codec = o.codec();
    }
    codecs_.push_back(codec);
  }
  flops_per_token_ = TrainingFlopsPerToken(joined_.model_spec(), joined_.model());
  if (leader()) {
    ALOE_LOG_INFO("worker", "%s joined as worker %d at version %d%s%s", name_, joined_.worker_id(),
                  joined_.version(),
                  env_.node != nullptr ? absl::StrFormat(" (%d ranks)", env_.node->size()) : "",
                  joined_.shard_addresses().empty()
                      ? ""
                      : absl::StrFormat(" (%d shard processes)", joined_.shard_addresses_size()));
  }
  return absl::OkStatus();
}

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

absl::Status Agent::Run() {
  if (env_.node != nullptr) return RunNode();
  return RunAlone();
}

absl::Status Agent::RunAlone() {
  ALOE_ASSIGN_OR_RETURN(v1::JoinReply joined, JoinRpc());
  ALOE_RETURN_IF_ERROR(Joined(joined));
  while (!stopping()) {
    const absl::Time t0 = clock_.Now();
    absl::StatusOr<v1::Task> task = Retry<v1::Task>([&] { return RequestNextTask(); });
    network_s_ += SecondsSince(t0);
    if (!task.ok() && task.status().code() == absl::StatusCode::kNotFound) {
      ALOE_LOG_WARNING("worker", "%s; joining again", task.status().message());
      ALOE_ASSIGN_OR_RETURN(joined, JoinRpc());
      ALOE_RETURN_IF_ERROR(Joined(joined));
      continue;
    }
    if (!task.ok() && stopping()) break;  // stopping while the server is away
    if (!task.ok()) return task.status();
    absl::Status status;
    switch (task->kind()) {
      case v1::Task::WAIT:
        if (task->draining() && !server_draining_) {
          ALOE_LOG_INFO("worker", "server is draining (shutdown or restart): waiting for it");
        }
        server_draining_ = task->draining();
        continue;
      case v1::Task::STOP:
        ALOE_LOG_INFO("worker", "server says training is over");
        return Finish();
      case v1::Task::TRAIN:
        status = options_.overlap != AgentOptions::Overlap::kOff && !overlap_refused_
                     ? TrainOverlapped(*task)
                     : Train(*task);
        break;
      case v1::Task::EVAL:
        status = Evaluate(*task);
        break;
      default:
        return absl::InvalidArgumentError(absl::StrFormat("unknown task kind %d", task->kind()));
    }
    if (status.ok()) {
      drop_backoff_.Reset();
    } else if (!Dropped(*task, status)) {
      return LeaveAfter(status);
    }
  }
  return Finish();
}

bool Agent::Dropped(const v1::Task& task, const absl::Status& status) {
  if (status.code() != absl::StatusCode::kFailedPrecondition &&
      status.code() != absl::StatusCode::kNotFound &&
      status.code() != absl::StatusCode::kUnavailable) {
    return false;
  }
  // The server dropped this round (stale version, expired lease) or went away meanwhile
  // (restart, a shard process down): ask again, waiting longer after each drop in a row.
  // A TRAIN task dropped on FAILED_PRECONDITION (its base version is no longer held, say)
  // cannot succeed when asked for again, so the next request gives it up.
  if (task.kind() == v1::Task::TRAIN && status.code() == absl::StatusCode::kFailedPrecondition) {
    dropped_task_id_ = task.task_id();
  }
  const absl::Duration delay = drop_backoff_.Failure();
  // Each drop the server decided is logged; a server or shard process away (kUnavailable)
  // fails every try alike, so those are logged at a bounded rate with a count.
  const bool unavailable = status.code() == absl::StatusCode::kUnavailable;
  if (!unavailable || clock_.Now() >= next_drop_log_) {
    ALOE_LOG_WARNING("worker", "%stask %d dropped: %s%s",
                     env_.node != nullptr ? absl::StrFormat("rank %d: ", env_.node->rank()) : "",
                     task.task_id(), status.message(),
                     drops_not_logged_ == 0
                         ? std::string()
                         : absl::StrFormat(" (%d more dropped since the last note; asking again "
                                           "in %.2f s)",
                                           drops_not_logged_, absl::ToDoubleSeconds(delay)));
    drops_not_logged_ = 0;
    if (unavailable) next_drop_log_ = clock_.Now() + options_.drop_log_interval;
  } else {
    ++drops_not_logged_;
  }
  if (delay > absl::ZeroDuration()) env_.sleep(delay);
  return true;
}

absl::StatusOr<v1::Task> Agent::RequestNextTask() {
  if (next_task_.has_value() && dropped_task_id_ == 0) {
    v1::Task task = *std::move(next_task_);
    next_task_.reset();
    ++tasks_from_push_replies_;
    return task;
  }
  next_task_.reset();
  absl::StatusOr<v1::Task> task =
      server_.RequestTask(joined_.worker_id(), /*ahead=*/false, dropped_task_id_);
  if (task.ok()) dropped_task_id_ = 0;
  return task;
}

v1::NodeDirective Agent::NextDirective() {
  v1::NodeDirective d;
  if (stopping()) {
    d.set_kind(v1::NodeDirective::STOP);
    return d;
  }
  if (!need_join_) {
    const absl::Time t0 = clock_.Now();
    absl::StatusOr<v1::Task> task = Retry<v1::Task>([&] { return RequestNextTask(); });
    network_s_ += SecondsSince(t0);
    if (task.ok()) {
      d.set_kind(task->kind() == v1::Task::STOP ? v1::NodeDirective::STOP
                                                : v1::NodeDirective::TASK);
      if (task->kind() == v1::Task::STOP) ALOE_LOG_INFO("worker", "server says training is over");
      *d.mutable_task() = *std::move(task);
      return d;
    }
    if (stopping()) {
      d.set_kind(v1::NodeDirective::STOP);
      return d;
    }
    if (task.status().code() != absl::StatusCode::kNotFound) {
      d.set_kind(v1::NodeDirective::FAIL);
      d.set_error(task.status().ToString());
      return d;
    }
    ALOE_LOG_WARNING("worker", "%s; joining again", task.status().message());
  }
  absl::StatusOr<v1::JoinReply> joined = JoinRpc();
  if (!joined.ok()) {
    d.set_kind(stopping() ? v1::NodeDirective::STOP : v1::NodeDirective::FAIL);
    d.set_error(joined.status().ToString());
    return d;
  }
  d.set_kind(v1::NodeDirective::REJOIN);
  *d.mutable_joined() = *std::move(joined);
  return d;
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
      if (leader() && task.draining() && !server_draining_) {
        ALOE_LOG_INFO("worker", "server is draining (shutdown or restart): waiting for it");
      }
      server_draining_ = task.draining();
      continue;
    }
    if (task.kind() != v1::Task::TRAIN) {
      return absl::InvalidArgumentError(
          absl::StrFormat("a multi-rank node cannot run task kind %d", task.kind()));
    }
    absl::Status status = options_.overlap != AgentOptions::Overlap::kOff && !overlap_refused_
                              ? TrainOverlapped(task)
                              : Train(task);
    // Barrier: every rank's slice has been answered before the leader asks for the next task
    // (else the server, still missing a slice, would hand out this task again).
    ALOE_RETURN_IF_ERROR(node.AllReduceSum(0).status());
    if (status.ok()) {
      drop_backoff_.Reset();
    } else if (!Dropped(task, status)) {
      return LeaveAfter(status);
    }
  }
  return Finish();
}

void Agent::Leave() {
  heartbeat_.reset();
  if (leader() && !need_join_) {
    absl::Status left = server_.Leave(joined_.worker_id());
    if (!left.ok()) ALOE_LOG_WARNING("worker", "leave: %s", left.ToString());
  }
}

absl::Status Agent::LeaveAfter(absl::Status error) {
  Leave();
  return error;
}

absl::Status Agent::Finish() {
  Leave();
  const double wall = rounds_ > 0 && first_task_.has_value() ? SecondsSince(*first_task_) : 0;
  ALOE_LOG_INFO("worker",
                "summary: rounds=%d steps=%d tokens=%d wall_seconds=%.2f compute_seconds=%.2f "
                "network_seconds=%.2f tokens_per_second=%.1f pushed_bytes=%d "
                "blocked_on_network=%.4f tasks_from_push_replies=%d",
                rounds_, steps_, tokens_, wall, compute_s_, network_s_,
                wall > 0 ? static_cast<double>(tokens_) / wall : 0.0, pushed_bytes_,
                wall > 0 ? network_s_ / wall : 0.0, tasks_from_push_replies_);
  return absl::OkStatus();
}

absl::Status Agent::PullBase(const v1::Task& task, uint64_t* pulled) {
  if (!first_task_.has_value()) first_task_ = clock_.Now();
  // A rank of a multi-rank node pulls, trains and pushes only its slice of every layer.
  ALOE_RETURN_IF_ERROR(
      AgreeAcrossRanks(server_
                           .Pull(joined_.worker_id(), task.base_version(), /*latest=*/false,
                                 joined_.model_spec(), &base_, pulled, slice(), slices())
                           .status()));
  ReportPulled(task);
  return absl::OkStatus();
}

absl::Status Agent::Train(const v1::Task& task) {
  const absl::Time t0 = clock_.Now();
  uint64_t pulled = 0;
  ALOE_RETURN_IF_ERROR(PullBase(task, &pulled));
  const absl::Time t1 = clock_.Now();
  ALOE_ASSIGN_OR_RETURN(TrainStats stats, TrainRound(task, base_));
  const absl::Time t2 = clock_.Now();
  if (stats.steps == 0) return absl::OkStatus();
  uint64_t pushed = 0;
  v1::PushHeader header = HeaderFor(task, stats);
  // The node's leader asks for its next task: it comes with the reply when this rank's push is
  // the one that completes the update (always for one rank), saving a RequestTask round trip.
  header.set_want_next_task(leader());
  absl::StatusOr<v1::PushReply> reply = PushDelta(header, delta_, &pushed);
  const absl::Time t3 = clock_.Now();
  if (!reply.ok()) return reply.status();
  if (leader() && reply->has_next_task()) next_task_ = reply->next_task();
  ReportRound(task, stats, *reply, pulled, pushed, absl::ToDoubleSeconds(t2 - t1),
              absl::ToDoubleSeconds(t3 - t0), absl::ToDoubleSeconds((t1 - t0) + (t3 - t2)));
  return absl::OkStatus();
}

void Agent::ReportPulled(const v1::Task& task) {
  v1::HeartbeatRequest request;
  request.set_worker_id(joined_.worker_id());
  request.set_pulled_task_id(task.task_id());
  if (slices() > 1) {
    request.set_pulled_slice(slice());
    request.set_pulled_slices(slices());
  }
  if (absl::StatusOr<v1::HeartbeatReply> reply = server_.Heartbeat(request); !reply.ok()) {
    ALOE_LOG_WARNING("worker", "could not report task %d's base version as pulled: %s",
                     task.task_id(), reply.status().message());
  }
}

absl::StatusOr<TrainStats> Agent::TrainRound(const v1::Task& task,
                                             const std::vector<std::vector<float>>& start) {
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
  ALOE_RETURN_IF_ERROR(trainer_->SetParameters(start));
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
  ALOE_RETURN_IF_ERROR(trainer_->PseudoGradient(start, &delta_));
  return stats;
}

v1::PushHeader Agent::HeaderFor(const v1::Task& task, const TrainStats& stats) {
  v1::PushHeader header;
  header.set_worker_id(joined_.worker_id());
  header.set_task_id(task.task_id());
  header.set_update_id(++update_id_);
  header.set_base_version(task.base_version());
  header.set_steps_done(stats.steps);
  header.set_tokens_learned(stats.tokens);
  header.set_train_loss(stats.mean_loss);
  header.set_compute_seconds(stats.compute_seconds);
  header.set_codec(v1::CODEC_FP32);
  if (slices() > 1) {
    header.set_slice(slice());
    header.set_slices(slices());
  }
  return header;
}

absl::StatusOr<v1::PushReply> Agent::PushDelta(const v1::PushHeader& header,
                                               std::vector<std::vector<float>>& delta,
                                               uint64_t* pushed) {
  const v1::TransportConfig& transport = joined_.transport();
  if (transport.error_feedback() && !residual_.empty()) {
    // Error feedback: what earlier rounds' quantisation lost is sent now.
    for (size_t l = 0; l < delta.size(); ++l) {
      kernels::WeightedAccumulate(residual_[l].data(), 1.0f, delta[l].data(), delta[l].size());
    }
  }
  return server_.Push(header, joined_.model_spec(), delta, codecs_,
                      std::max<uint32_t>(1, transport.int8_block_size()),
                      transport.error_feedback() ? &residual_ : nullptr, pushed);
}

void Agent::ReportRound(const v1::Task& task, const TrainStats& stats, const v1::PushReply& reply,
                        uint64_t pulled, uint64_t pushed, double train_s, double round_s,
                        double network_s) {
  ++rounds_;
  steps_ += stats.steps;
  tokens_ += stats.tokens;
  compute_s_ += stats.compute_seconds;
  network_s_ += network_s;
  pushed_bytes_ += pushed;
  if (!leader()) return;  // rank 0 reports for the node
  // Wall time of the steps (an emulated slowdown included): what DyLU should plan with.
  heartbeat_->Set(joined_.worker_id(), train_s > 0 ? stats.steps / train_s : 0);
  const double tokens_per_second = round_s > 0 ? stats.tokens / round_s : 0;
  metrics_.Set(kLoss, stats.mean_loss);
  metrics_.Set(kTokensPerSecond, tokens_per_second);
  if (stats.compute_seconds > 0) {
    metrics_.Set(kModelFlops, stats.tokens / stats.compute_seconds * flops_per_token_);
  }
  metrics_.Set(kStepsPerRound, stats.steps);
  metrics_.Set(kModelVersion, static_cast<double>(task.base_version()));
  metrics_.Add(kSteps, stats.steps);
  metrics_.Add(kTokens, static_cast<double>(stats.tokens));
  metrics_.Add(kRounds, 1);
  metrics_.Add(kPulledBytes, static_cast<double>(pulled));
  metrics_.Add(kPushedBytes, static_cast<double>(pushed));
  metrics_.Add(kComputeSeconds, stats.compute_seconds);
  metrics_.Add(kNetworkSeconds, network_s);
  std::string outcome;
  if (reply.applied()) {
    outcome = absl::StrFormat(" -> version %d", reply.version());
  } else if (reply.staged()) {
    outcome = absl::StrFormat(" (%d of %d slices in)", reply.slices_received(), slices());
  }
  ALOE_LOG_INFO("worker",
                "round %d: version %d shard %s steps %d loss %.4f tokens/s %.0f "
                "(compute %.2fs, network %.3fs)%s",
                rounds_, task.base_version(), task.shard_name(), stats.steps, stats.mean_loss,
                tokens_per_second, stats.compute_seconds, network_s, outcome);
}

absl::Status Agent::AgreeAcrossRanks(absl::Status status) {
  if (env_.node == nullptr) return status;
  ALOE_ASSIGN_OR_RETURN(const double failed, env_.node->AllReduceSum(status.ok() ? 0 : 1));
  if (!status.ok() || failed == 0) return status;
  return absl::UnavailableError(
      absl::StrFormat("%d other rank(s) of this node failed; the node drops the round together",
                      static_cast<int>(failed)));
}

Agent::Communicated Agent::Communicate(const v1::PushHeader* header,
                                       std::vector<std::vector<float>>* delta) {
  Communicated c;
  if (header != nullptr) c.push = PushDelta(*header, *delta, &c.pushed);
  const bool pushed = !c.push.has_value() || c.push->ok();
  if (env_.control == nullptr) {
    if (!pushed) return c;
    c.next = server_.RequestTask(joined_.worker_id(), /*ahead=*/true, /*dropped_task_id=*/0);
  } else {
    // Every rank's slice is in (or one failed) before the leader asks; then it tells the others.
    absl::StatusOr<double> failed = env_.control->AllReduceSum(pushed ? 0 : 1);
    if (!failed.ok()) {
      c.next = failed.status();
      return c;
    }
    v1::NodeDirective d;
    std::string bytes;
    if (leader()) {
      absl::StatusOr<v1::Task> next = *failed > 0
                                          ? absl::UnavailableError("a rank's push failed")
                                          : server_.RequestTask(joined_.worker_id(), /*ahead=*/true,
                                                                /*dropped_task_id=*/0);
      if (next.ok()) {
        d.set_kind(v1::NodeDirective::TASK);
        *d.mutable_task() = *std::move(next);
      } else {
        d.set_kind(v1::NodeDirective::FAIL);
        d.set_error(next.status().ToString());
      }
      d.SerializeToString(&bytes);
    }
    if (absl::Status told = env_.control->Broadcast(&bytes, /*root=*/0); !told.ok()) {
      c.next = told;
      return c;
    }
    if (!leader() && !d.ParseFromString(bytes)) {
      c.next = absl::DataLossError("rank 0 sent a malformed look-ahead directive");
      return c;
    }
    c.next = d.kind() == v1::NodeDirective::TASK
                 ? absl::StatusOr<v1::Task>(d.task())
                 : absl::StatusOr<v1::Task>(absl::UnavailableError(d.error()));
  }
  if (c.next.ok() && c.next->kind() == v1::Task::TRAIN) {
    absl::Status pulled =
        server_
            .Pull(joined_.worker_id(), c.next->base_version(),
                  /*latest=*/false, joined_.model_spec(), &c.base, &c.pulled, slice(), slices())
            .status();
    if (!pulled.ok()) {
      c.next = pulled;
    } else {
      ReportPulled(*c.next);
    }
  }
  return c;
}

absl::Status Agent::TrainOverlapped(v1::Task task) {
  const absl::Time pull0 = clock_.Now();
  uint64_t pulled = 0;
  ALOE_RETURN_IF_ERROR(PullBase(task, &pulled));
  double pull_s = SecondsSince(pull0);
  std::vector<std::vector<float>> start = base_;
  // The previous round, pushed in the background while this one trains.
  struct Pending {
    v1::Task task;
    v1::PushHeader header;
    std::vector<std::vector<float>> delta;
    TrainStats stats;
    uint64_t pulled = 0;
    double train = 0;    // its training time
    double seconds = 0;  // its training time plus the waits for the network
    double blocked = 0;  // of which waiting for the network
  };
  std::optional<Pending> pending;
  while (true) {
    // The background thread owns `previous` (its delta and error-feedback residual) until get().
    std::optional<Pending> previous = std::move(pending);
    pending.reset();
    Pending* const push = previous.has_value() ? &*previous : nullptr;
    std::future<Communicated> background = std::async(std::launch::async, [this, push] {
      return push != nullptr ? Communicate(&push->header, &push->delta)
                             : Communicate(nullptr, nullptr);
    });
    const absl::Time t0 = clock_.Now();
    absl::StatusOr<TrainStats> stats = TrainRound(task, start);
    const absl::Time t1 = clock_.Now();
    Communicated c = background.get();
    const double blocked = SecondsSince(t1);
    const double train_s = absl::ToDoubleSeconds(t1 - t0);
    if (previous.has_value()) {
      // The previous round's push was answered while this round trained.
      previous->blocked += blocked;
      if (!c.push->ok()) {
        ALOE_LOG_WARNING("worker", "task %d dropped: %s", previous->task.task_id(),
                         c.push->status().message());
        network_s_ += previous->blocked;
      } else {
        ReportRound(previous->task, previous->stats, **c.push, previous->pulled, c.pushed,
                    previous->train, previous->seconds + blocked, previous->blocked);
      }
    } else {
      network_s_ += blocked;
    }
    if (!stats.ok()) return stats.status();
    if (env_.node == nullptr && c.push.has_value() && !c.push->ok() &&
        c.push->status().code() == absl::StatusCode::kNotFound) {
      return c.push->status();  // the lease is gone: the caller joins again
    }
    if (stats->steps == 0) return absl::OkStatus();  // stopping before the first step (all ranks)
    pending = Pending{task,
                      HeaderFor(task, *stats),
                      std::move(delta_),
                      *stats,
                      pulled,
                      train_s,
                      train_s + pull_s,
                      pull_s};
    pull_s = 0;
    bool next_train = c.next.ok() && c.next->kind() == v1::Task::TRAIN &&
                      c.next->task_id() != task.task_id() && !stopping();
    if (env_.node != nullptr) {
      // The ranks go on together or not at all (a rank's pull failed, a rank is stopping).
      ALOE_ASSIGN_OR_RETURN(const double against, env_.node->AllReduceSum(next_train ? 0 : 1));
      next_train = against == 0;
    }
    if (!next_train) {
      // No task ahead (stopping, draining, a server without look-ahead, an error): this round
      // is pushed now and the caller asks for work as usual.
      if (c.next.ok() && c.next->kind() == v1::Task::WAIT && !c.next->draining() &&
          !overlap_refused_) {
        overlap_refused_ = true;
        if (leader()) {
          ALOE_LOG_WARNING("worker",
                           "the server hands out no look-ahead tasks (sync rounds or a grace "
                           "window): --overlap is off from now on");
        }
      }
      const absl::Time p0 = clock_.Now();
      uint64_t pushed = 0;
      absl::StatusOr<v1::PushReply> reply = PushDelta(pending->header, pending->delta, &pushed);
      const double push_s = SecondsSince(p0);
      if (!reply.ok()) return reply.status();
      ReportRound(pending->task, pending->stats, *reply, pending->pulled, pushed, pending->train,
                  pending->seconds + push_s, pending->blocked + push_s);
      return absl::OkStatus();
    }
    // The next round starts from the newest global model, which lacks this round's update
    // (one-step delay); eager applies it locally at once, scaled by the outer lr, and the global
    // model that includes it replaces this proxy one round later (paper 004). A rank does so on
    // its slices.
    task = *std::move(c.next);
    start = std::move(c.base);
    pulled = c.pulled;
    if (options_.overlap == AgentOptions::Overlap::kEager) {
      const float lr = joined_.outer_optimizer().lr();
      for (size_t l = 0; l < start.size(); ++l) {
        kernels::WeightedAccumulate(pending->delta[l].data(), -lr, start[l].data(),
                                    start[l].size());
      }
    }
  }
}

absl::Status Agent::Evaluate(const v1::Task& task) {
  uint64_t pulled = 0;
  ALOE_ASSIGN_OR_RETURN(uint64_t version,
                        server_.Pull(joined_.worker_id(), task.base_version(), /*latest=*/false,
                                     joined_.model_spec(), &base_, &pulled, /*slice=*/0,
                                     /*slices=*/1));
  ALOE_RETURN_IF_ERROR(trainer_->SetParameters(base_));
  ALOE_ASSIGN_OR_RETURN(const TokenSource* heldout, Shard(joined_.heldout_file()));
  EvalRequest eval;
  eval.heldout = heldout;
  eval.max_sequences = options_.eval_sequences;
  ALOE_ASSIGN_OR_RETURN(double loss, trainer_->Evaluate(eval));
  const uint64_t seq = joined_.model().seq_len();
  const uint64_t windows =
      std::min<uint64_t>(options_.eval_sequences, heldout->num_tokens() / (seq + 1));
  v1::EvalReport report;
  report.set_worker_id(joined_.worker_id());
  report.set_task_id(task.task_id());
  report.set_version(version);
  report.set_loss(loss);
  report.set_tokens(std::max<uint64_t>(1, windows * seq));
  ALOE_RETURN_IF_ERROR(server_.ReportEval(report));
  metrics_.Set(kEvalLoss, loss);
  metrics_.Set(kModelVersion, static_cast<double>(version));
  metrics_.Add(kPulledBytes, static_cast<double>(pulled));
  ALOE_LOG_INFO("worker", "eval version %d: loss %.4f perplexity %.2f", version, loss,
                std::exp(loss));
  return absl::OkStatus();
}

}  // namespace aloe::worker
