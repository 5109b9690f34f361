#include "worker/streaming_round.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/layer_groups.h"
#include "common/logging.h"
#include "common/low_rank.h"
#include "common/low_rank_wire.h"
#include "common/status_macros.h"

namespace aloe::worker {
namespace {

// Transfers kept for the link rate.
constexpr size_t kTransfersKept = 16;

// Bytes per value of a push with `codec`.
double BytesPerValue(v1::Codec codec) {
  switch (codec) {
    case v1::CODEC_BF16:
      return 2;
    case v1::CODEC_INT8_BLOCKWISE:
      return 1;
    case v1::CODEC_INT4_BLOCKWISE:
      return 0.5;
    default:
      return 4;
  }
}

// `schedule` rotated so that its last step has a push: the task's last push then comes after
// its last step and carries all of its steps. Strided schedules end so already; ENP and
// DreamDDP may leave the last steps without one. Each group keeps one sync per H steps.
SyncSchedule EndingWithAPush(SyncSchedule schedule) {
  const uint32_t period = schedule.period;
  int last = -1;
  for (uint32_t h = 0; h < period; ++h) {
    if (!schedule.syncs[h].empty()) last = static_cast<int>(h);
  }
  if (last < 0 || last == static_cast<int>(period) - 1) return schedule;
  const uint32_t shift = period - 1 - static_cast<uint32_t>(last);
  std::vector<std::vector<uint32_t>> rotated(period);
  for (uint32_t h = 0; h < period; ++h) {
    rotated[(h + shift) % period] = std::move(schedule.syncs[h]);
  }
  schedule.syncs = std::move(rotated);
  return schedule;
}

// The seed of segment `segment` of a task (splitmix64 of the pair): deterministic, and distinct
// per segment so that the segments sample different data.
uint64_t SegmentSeed(uint64_t task_seed, uint32_t segment) {
  uint64_t z = task_seed + 0x9E3779B97F4A7C15ull * (uint64_t{segment} + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

double EstimatedPushBytes(const v1::LayerSpec& layer, const v1::TransportConfig& transport) {
  const v1::LayerCodec* entry = nullptr;
  for (const v1::LayerCodec& o : transport.layer_codecs()) {
    if (o.layer() == layer.name()) entry = &o;
  }
  const v1::Codec codec = entry != nullptr ? entry->codec() : transport.codec();
  if (codec != v1::CODEC_LOWRANK) {
    return static_cast<double>(layer.num_elements()) * BytesPerValue(codec);
  }
  const v1::Codec factor =
      entry->factor_codec() == v1::CODEC_UNSPECIFIED ? v1::CODEC_FP32 : entry->factor_codec();
  double bytes = 0;
  for (const v1::TensorSpec& tensor : layer.tensors()) {
    const uint32_t rank = LowRankTensorRank(tensor, entry->rank());
    if (rank > 0) {
      const auto [rows, cols] = *LowRankMatrixShape(tensor);
      bytes += static_cast<double>(LowRankFactorFloats(rows, cols, rank)) * BytesPerValue(factor);
    } else {
      uint64_t n = 1;
      for (int64_t d : tensor.shape()) n *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
      bytes += static_cast<double>(n) * BytesPerValue(LowRankFallbackCodec(factor));
    }
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<StreamingRounds>> StreamingRounds::Create(Env env) {
  const v1::JoinReply& joined = env.session->joined();
  std::vector<uint32_t> layer_groups(joined.layer_groups().begin(), joined.layer_groups().end());
  if (layer_groups.size() != static_cast<size_t>(joined.model_spec().layers_size())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the join reply names the layer group of %d layers, the model has %d",
                        layer_groups.size(), joined.model_spec().layers_size()));
  }
  for (const std::vector<uint32_t>& layers : LayersOfGroups(layer_groups)) {
    if (layers.empty()) {
      return absl::InvalidArgumentError("the join reply's layer groups leave a group empty");
    }
  }
  if (LayersOfGroups(layer_groups).size() < 2) {
    return absl::InvalidArgumentError("partial synchronization needs more than one layer group");
  }
  return std::unique_ptr<StreamingRounds>(
      new StreamingRounds(env, std::move(layer_groups), joined.partial_sync()));
}

StreamingRounds::StreamingRounds(Env env, std::vector<uint32_t> layer_groups,
                                 v1::PartialSyncConfig config)
    : env_(env),
      layer_groups_(std::move(layer_groups)),
      layers_of_group_(LayersOfGroups(layer_groups_)),
      config_(std::move(config)) {
  const v1::ModelSpec& spec = env_.session->joined().model_spec();
  const v1::TransportConfig& transport = env_.session->joined().transport();
  group_params_.assign(groups(), 0);
  group_push_bytes_.assign(groups(), 0);
  for (int l = 0; l < spec.layers_size(); ++l) {
    group_params_[layer_groups_[l]] += spec.layers(l).num_elements();
    group_push_bytes_[layer_groups_[l]] += EstimatedPushBytes(spec.layers(l), transport);
  }
  global_.resize(spec.layers_size());
  version_.assign(groups(), 0);
  held_.assign(groups(), false);
  thread_ = std::thread([this] { Communicate(); });
}

StreamingRounds::~StreamingRounds() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }
  thread_.join();
}

uint32_t StreamingRounds::PlannedSteps(const v1::Task& task) const {
  const uint32_t cap = std::max<uint32_t>(1, task.local_steps());
  if (task.time_budget_seconds() <= 0) return cap;
  // A time budget (A-EDiT): as many steps as fit at the measured speed; before a measurement a
  // short task that gives one.
  if (step_seconds_ <= 0) return std::min(cap, groups());
  const double fit = std::floor(task.time_budget_seconds() / step_seconds_);
  return static_cast<uint32_t>(std::clamp(fit, 1.0, static_cast<double>(cap)));
}

absl::StatusOr<SyncSchedule> StreamingRounds::ScheduleFor(uint32_t steps) const {
  absl::StatusOr<SyncSchedule> schedule;
  switch (config_.schedule()) {
    case v1::SYNC_SCHEDULE_EQUAL_NUMBER:
      schedule = EqualNumberSchedule(groups(), steps);
      break;
    case v1::SYNC_SCHEDULE_DREAMDDP: {
      LinkProfile link;
      {
        absl::MutexLock lock(&mu_);
        uint64_t bytes = 0;
        double seconds = 0;
        for (const auto& [b, s] : transfers_) {
          bytes += b;
          seconds += s;
        }
        if (bytes > 0 && seconds > 0) link.bytes_per_second = static_cast<double>(bytes) / seconds;
        link.round_trip_seconds = std::isfinite(round_trip_) ? round_trip_ : 0;
      }
      if (step_seconds_ > 0 && link.bytes_per_second > 0) {
        // Measured: the pruned search over the units' profiled costs (paper 003 Sec. 3.3).
        ALOE_ASSIGN_OR_RETURN(UnitCosts costs,
                              UnitCostsFromProfile(step_seconds_, group_params_, 1.0, link));
        // Each group's transfer at its layers' codecs (a push and a pull of its bytes), where
        // UnitCostsFromProfile counts one size per value for every group.
        for (size_t g = 0; g < costs.transfer.size(); ++g) {
          costs.transfer[g] =
              link.round_trip_seconds + 2 * group_push_bytes_[g] / link.bytes_per_second;
        }
        schedule = DreamDdpSchedule(costs, steps, config_.fill_bubbles());
        break;
      }
      // Nothing measured yet (the first task): strided.
      schedule = StridedSchedule(groups(), steps);
      break;
    }
    default:
      schedule = StridedSchedule(groups(), steps);
      break;
  }
  if (!schedule.ok()) return schedule.status();
  return EndingWithAPush(*std::move(schedule));
}

void StreamingRounds::NoteTransfer(uint64_t bytes, double seconds) {
  if (bytes == 0 || seconds <= 0) return;
  absl::MutexLock lock(&mu_);
  transfers_.emplace_back(bytes, seconds);
  if (transfers_.size() > kTransfersKept) transfers_.pop_front();
}

absl::StatusOr<StreamingRounds::Taken> StreamingRounds::Take(
    uint32_t group, std::vector<std::vector<float>>* layers) {
  ServerSession& session = *env_.session;
  Taken taken;
  // The group version StartGroup granted: the pull waits for a shard process that has not yet
  // applied that commit of the group.
  uint64_t granted = 0;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) return absl::CancelledError("the worker's membership ended");
    }
    if (env_.stop->load()) return absl::CancelledError("stopping");
    const absl::Time asked = env_.clock->Now();
    ALOE_ASSIGN_OR_RETURN(v1::Task answer,
                          session.Retry<v1::Task>("start_group", [&]() -> absl::StatusOr<v1::Task> {
                            return session.StartGroup(group);
                          }));
    if (answer.kind() == v1::Task::STOP) {
      taken.server_stopped = true;
      return taken;
    }
    if (answer.kind() == v1::Task::TRAIN) {
      // An answer at once is a round trip (a WAIT is held by the server first).
      const double seconds = absl::ToDoubleSeconds(env_.clock->Now() - asked);
      if (answer.group_versions_size() > 0) granted = answer.group_versions(0);
      absl::MutexLock lock(&mu_);
      round_trip_ = std::min(round_trip_, seconds);
      break;
    }
    // WAIT: the group's sync round or grace window holds this worker. The server holds the
    // request a while before it answers WAIT, so asking again at once does not spin.
  }
  const absl::Time start = env_.clock->Now();
  ALOE_ASSIGN_OR_RETURN(taken.version,
                        session.Retry<uint64_t>("pull_group", [&]() -> absl::StatusOr<uint64_t> {
                          taken.bytes = 0;
                          return session.PullGroup(group, granted, layers, &taken.bytes);
                        }));
  NoteTransfer(taken.bytes, absl::ToDoubleSeconds(env_.clock->Now() - start));
  return taken;
}

absl::Status StreamingRounds::ColdStart(RoundCosts& costs, bool* server_stopped) {
  for (uint32_t g = 0; g < groups(); ++g) {
    ALOE_ASSIGN_OR_RETURN(Taken taken, Take(g, &global_));
    if (taken.server_stopped) {
      *server_stopped = true;
      return absl::OkStatus();
    }
    version_[g] = taken.version;
    held_[g] = true;
    costs.pulled_bytes += taken.bytes;
  }
  ALOE_RETURN_IF_ERROR(env_.trainer->SetParameters(global_));
  cold_ = false;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<float>>> StreamingRounds::Local() {
  // 0 - theta is exact: negated again, it is theta bit for bit.
  if (zeros_.empty()) {
    const v1::ModelSpec& spec = env_.session->joined().model_spec();
    for (const v1::LayerSpec& layer : spec.layers()) zeros_.emplace_back(layer.num_elements());
  }
  std::vector<std::vector<float>> local;
  ALOE_RETURN_IF_ERROR(env_.trainer->PseudoGradient(zeros_, &local));
  for (std::vector<float>& layer : local) {
    for (float& x : layer) x = -x;
  }
  return local;
}

absl::StatusOr<std::shared_ptr<StreamingRounds::Job>> StreamingRounds::Push(
    const v1::Task& task, const std::vector<uint32_t>& groups, const TrainStats& stats,
    bool ends_task, uint32_t tau) {
  // The groups' layers alone where the trainer reads them layer-wise, else the whole model.
  std::vector<uint32_t> ids;
  for (uint32_t g : groups)
    ids.insert(ids.end(), layers_of_group_[g].begin(), layers_of_group_[g].end());
  std::vector<std::vector<float>> delta(global_.size());
  const absl::Status got = env_.trainer->GetLayers(ids, &delta);
  if (got.ok()) {
    for (uint32_t l : ids) {
      std::vector<float>& d = delta[l];
      const std::vector<float>& base = global_[l];
      for (size_t i = 0; i < d.size(); ++i) d[i] = base[i] - d[i];
    }
  } else if (absl::IsUnimplemented(got)) {
    ALOE_RETURN_IF_ERROR(env_.trainer->PseudoGradient(global_, &delta));
  } else {
    return got;
  }
  std::shared_ptr<Job> job;
  for (size_t i = 0; i < groups.size(); ++i) {
    const uint32_t g = groups[i];
    job = std::make_shared<Job>();
    job->group = g;
    job->delta.resize(delta.size());
    for (uint32_t l : layers_of_group_[g]) job->delta[l] = std::move(delta[l]);
    const bool last = ends_task && i + 1 == groups.size();
    job->header = env_.session->Header(task, stats);
    job->header.set_base_version(version_[g]);
    job->header.set_group(g);
    job->header.set_task_continues(!last);
    // The reply that ends the task carries the next one (unless that one is taken ahead).
    job->header.set_want_next_task(last && !end_ahead_);
    job->give_up_if_refused = last && end_ahead_;
    job->merge_at = total_steps_ + tau;
    held_[g] = false;
    pending_.push_back(job);
    absl::MutexLock lock(&mu_);
    queue_.push_back(job);
  }
  return job;
}

absl::Status StreamingRounds::MergeOldest(RoundCosts& costs, bool* server_stopped) {
  std::shared_ptr<Job> job = pending_.front();
  pending_.pop_front();
  const absl::Time start = env_.clock->Now();
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](Job* j) { return j->taken; }, job.get()));
  }
  costs.network_s += absl::ToDoubleSeconds(env_.clock->Now() - start);
  costs.pushed_bytes += job->pushed_bytes;
  costs.pulled_bytes += job->pulled_bytes;
  job->pushed_bytes = 0;  // counted once
  if (!job->take_status.ok()) return job->take_status;
  if (job->server_stopped) {
    *server_stopped = true;
    return absl::OkStatus();
  }
  // Streaming DiLoCo's merge; a refused push's group is replaced.
  return Merge(job->group, job->global, job->version,
               job->replace ? 0.0f : static_cast<float>(config_.mixing_alpha()));
}

absl::Status StreamingRounds::Merge(uint32_t group, std::vector<std::vector<float>>& global,
                                    uint64_t version, float alpha) {
  // The group's layers alone where the trainer takes them layer-wise, else the whole model.
  const std::vector<uint32_t>& ids = layers_of_group_[group];
  std::vector<std::vector<float>> local(global_.size());
  absl::Status got = env_.trainer->GetLayers(ids, &local);
  const bool layerwise = got.ok();
  if (absl::IsUnimplemented(got)) {
    ALOE_ASSIGN_OR_RETURN(local, Local());
  } else if (!got.ok()) {
    return got;
  }
  for (uint32_t l : ids) {
    std::vector<float>& mine = local[l];
    const std::vector<float>& theirs = global[l];
    if (alpha == 0.0f) {
      mine = theirs;
    } else {
      for (size_t i = 0; i < mine.size(); ++i) {
        mine[i] = alpha * mine[i] + (1.0f - alpha) * theirs[i];
      }
    }
    global_[l] = std::move(global[l]);
  }
  version_[group] = version;
  held_[group] = true;
  return layerwise ? env_.trainer->SetLayers(ids, local) : env_.trainer->SetParameters(local);
}

absl::Status StreamingRounds::MergeDue(const std::vector<uint32_t>& groups, RoundCosts& costs,
                                       bool* server_stopped) {
  auto needed = [&] {
    for (uint32_t g : groups) {
      if (!held_[g]) return true;
    }
    return false;
  };
  while (!pending_.empty() && !*server_stopped &&
         (pending_.front()->merge_at <= total_steps_ || needed())) {
    ALOE_RETURN_IF_ERROR(MergeOldest(costs, server_stopped));
  }
  // A group neither held nor pending (its take found training over once) is taken anew.
  for (uint32_t g : groups) {
    if (held_[g] || *server_stopped) continue;
    std::vector<std::vector<float>> layers(layer_groups_.size());
    const absl::Time start = env_.clock->Now();
    ALOE_ASSIGN_OR_RETURN(Taken taken, Take(g, &layers));
    costs.network_s += absl::ToDoubleSeconds(env_.clock->Now() - start);
    costs.pulled_bytes += taken.bytes;
    if (taken.server_stopped) {
      *server_stopped = true;
      break;
    }
    ALOE_RETURN_IF_ERROR(Merge(g, layers, taken.version, /*alpha=*/0.0f));
  }
  return absl::OkStatus();
}

void StreamingRounds::AwaitPushed(const Job& job) {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](const Job* j) { return j->pushed; }, &job));
}

void StreamingRounds::Communicate() {
  ServerSession& session = *env_.session;
  while (true) {
    std::shared_ptr<Job> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &StreamingRounds::HasWork));
      if (shutdown_) return;  // the membership ended: what is queued is not sent
      job = queue_.front();
      queue_.pop_front();
    }
    const absl::Time start = env_.clock->Now();
    uint64_t bytes = 0;
    absl::StatusOr<v1::PushReply> reply = session.PushGroup(job->header, job->delta, &bytes);
    NoteTransfer(bytes, absl::ToDoubleSeconds(env_.clock->Now() - start));
    job->delta.clear();
    const bool refused = !reply.ok() && reply.status().code() != absl::StatusCode::kNotFound;
    if (refused) {
      ALOE_LOG_WARNING("worker", "push of layer group %d refused (%s); taking the group again",
                       job->group, reply.status().message());
    }
    // A task's last push left in flight: refused, the task stays open on the server in front of
    // the one taken ahead. Given up (before its reply is read), that one becomes the open task
    // before its pushes go.
    if (refused && job->give_up_if_refused &&
        !session.RequestTask(/*ahead=*/false, job->header.task_id()).ok()) {
      ALOE_LOG_WARNING("worker", "could not give task %d up", job->header.task_id());
    }
    {
      absl::MutexLock lock(&mu_);
      job->reply = reply;
      job->pushed_bytes = bytes;
      job->pushed = true;
      if (!reply.ok() && reply.status().code() == absl::StatusCode::kNotFound) {
        job->take_status = reply.status();  // unknown to the server: the agent joins again
        job->taken = true;
        continue;
      }
    }
    std::vector<std::vector<float>> layers(layer_groups_.size());
    absl::StatusOr<Taken> taken = Take(job->group, &layers);
    absl::MutexLock lock(&mu_);
    job->replace = !reply.ok();
    if (taken.ok()) {
      job->server_stopped = taken->server_stopped;
      job->version = taken->version;
      job->pulled_bytes = taken->bytes;
      job->global = std::move(layers);
    } else {
      job->take_status = taken.status();
    }
    job->taken = true;
  }
}

bool StreamingRounds::Stopping(const absl::Status& status) const {
  return status.code() == absl::StatusCode::kCancelled && env_.stop->load();
}

absl::StatusOr<v1::PushReply> StreamingRounds::AwaitEnd(RoundCosts* costs) {
  if (ending_.empty()) return absl::FailedPreconditionError("no task's last push is in flight");
  const std::shared_ptr<Job> last = std::move(ending_.front());
  ending_.pop_front();
  return AwaitJob(last, costs);
}

absl::StatusOr<v1::PushReply> StreamingRounds::AwaitJob(const std::shared_ptr<Job>& last,
                                                        RoundCosts* costs) {
  const absl::Time t0 = env_.clock->Now();
  AwaitPushed(*last);
  costs->network_s += absl::ToDoubleSeconds(env_.clock->Now() - t0);
  absl::MutexLock lock(&mu_);
  costs->pushed_bytes += last->pushed_bytes;
  last->pushed_bytes = 0;  // counted here, not again at its merge
  return last->reply;
}

absl::StatusOr<StreamingTask> StreamingRounds::Run(const v1::Task& task, const TokenSource* data,
                                                   bool await_end) {
  StreamingTask result;
  RoundCosts& costs = result.costs;
  end_ahead_ = !await_end;
  const absl::Time start = env_.clock->Now();
  if (cold_) {
    const absl::Time t0 = env_.clock->Now();
    ALOE_RETURN_IF_ERROR(ColdStart(costs, &result.server_stopped));
    costs.network_s += absl::ToDoubleSeconds(env_.clock->Now() - t0);
    if (result.server_stopped) return result;
  }
  const uint32_t steps = PlannedSteps(task);
  const uint32_t tau = std::min(config_.merge_delay_steps(), steps - 1);
  ALOE_ASSIGN_OR_RETURN(const SyncSchedule schedule, ScheduleFor(steps));
  if (schedule.ToString() != last_schedule_) {
    last_schedule_ = schedule.ToString();
    ALOE_LOG_INFO("worker", "%d layer groups, %d steps a task, pushed after each step: %s",
                  groups(), steps, last_schedule_);
  }

  TrainStats& total = result.stats;
  double loss_sum = 0;
  double train_s = 0;
  uint32_t done = 0;
  uint32_t segment = 0;
  bool stopped = false;
  std::shared_ptr<Job> last;  // the push that ends the task
  while (done < steps) {
    // Train up to the next step with pushes, or to the next merge due.
    uint32_t next = done;
    while (next + 1 < steps && schedule.syncs[next].empty()) ++next;
    uint64_t n = next + 1 - done;
    for (const std::shared_ptr<Job>& job : pending_) {
      if (job->merge_at > total_steps_) n = std::min<uint64_t>(n, job->merge_at - total_steps_);
    }
    TrainRequest request;
    request.data = data;
    request.shard_name = task.shard_name();
    request.steps = static_cast<uint32_t>(n);
    request.lr_step = task.lr_step() + done;
    request.seed = SegmentSeed(task.seed(), segment++);
    request.slowdown = env_.slowdown;
    request.interrupt = env_.stop;
    const absl::Time t0 = env_.clock->Now();
    ALOE_ASSIGN_OR_RETURN(TrainStats stats, env_.trainer->Train(request));
    train_s += absl::ToDoubleSeconds(env_.clock->Now() - t0);
    total.steps += stats.steps;
    total.tokens += stats.tokens;
    total.compute_seconds += stats.compute_seconds;
    loss_sum += stats.mean_loss * stats.steps;
    total.mean_loss = total.steps > 0 ? loss_sum / total.steps : 0;
    done += stats.steps;
    total_steps_ += stats.steps;
    if (stats.steps < n) {
      stopped = true;  // interrupted: a stop request
      break;
    }
    const bool push_point = done == next + 1;
    static const std::vector<uint32_t> kNone;
    const std::vector<uint32_t>& groups_now = push_point ? schedule.syncs[next] : kNone;
    if (absl::Status merged = MergeDue(groups_now, costs, &result.server_stopped); !merged.ok()) {
      if (!Stopping(merged)) return merged;
      stopped = true;
      break;
    }
    if (result.server_stopped) break;
    if (groups_now.empty()) continue;
    ALOE_ASSIGN_OR_RETURN(std::shared_ptr<Job> pushed,
                          Push(task, groups_now, total, done == steps, tau));
    if (done == steps) last = pushed;
    // tau = 0: merged as soon as taken.
    if (absl::Status merged = MergeDue({}, costs, &result.server_stopped); !merged.ok()) {
      if (!Stopping(merged)) return merged;
      stopped = true;
      break;
    }
    if (result.server_stopped) break;
  }
  if (train_s > 0 && total.steps > 0) step_seconds_ = train_s / total.steps;
  costs.train_s = train_s;
  if (stopped && last == nullptr && total.steps > 0 && !result.server_stopped) {
    // The steps done are pushed: every group held, the last one ending the task.
    std::vector<uint32_t> held;
    for (uint32_t g = 0; g < groups(); ++g) {
      if (held_[g]) held.push_back(g);
    }
    if (!held.empty()) {
      end_ahead_ = false;  // stopping: no task follows
      ALOE_ASSIGN_OR_RETURN(last, Push(task, held, total, /*ends_task=*/true, 0));
    }
  }
  if (last != nullptr && last->give_up_if_refused) {
    ending_.push_back(std::move(last));
    result.end_in_flight = true;
  } else if (last != nullptr) {
    ALOE_ASSIGN_OR_RETURN(result.reply, AwaitJob(last, &costs));
    result.ended = true;
  }
  if (result.server_stopped) {
    // Training is over: whatever is pending is not merged; a later task starts cold.
    pending_.clear();
    cold_ = true;
  }
  costs.round_s = absl::ToDoubleSeconds(env_.clock->Now() - start);
  return result;
}

}  // namespace aloe::worker
