#include "worker/server_session.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cpu/outer_kernels.h"
#include "worker/fsdp.h"
#include "worker/worker_metrics.h"

namespace aloe::worker {

ServerSession::ServerSession(const AgentOptions& options, const AgentEnv& env, std::string name,
                             uint32_t slice, uint32_t slices)
    : options_(options),
      server_(*env.server),
      clock_(*env.clock),
      sleep_(env.sleep),
      stop_(*env.stop),
      metrics_(env.metrics),
      name_(std::move(name)),
      slice_(slice),
      slices_(slices),
      node_(env.node),
      control_(env.control) {}

absl::StatusOr<v1::JoinReply> ServerSession::Join() {
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
        Retry<v1::JoinReply>("join", [&] { return server_.Join(request); });
    if (joined.ok() || joined.status().code() != absl::StatusCode::kResourceExhausted ||
        clock_.Now() >= give_up || stop_.load()) {
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
    sleep_(options_.join_wait_step);
  }
}

absl::Status ServerSession::Adopt(const v1::JoinReply& joined) {
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
  member_ = true;
  if (!options_.model_fingerprint.empty() &&
      joined_.model_fingerprint() != options_.model_fingerprint) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the server trains model \"%s\", --torchscript %s is \"%s\"", joined_.model_fingerprint(),
        options_.model_source, options_.model_fingerprint));
  }
  layer_groups_.assign(joined_.layer_groups().begin(), joined_.layer_groups().end());
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
  low_rank_->Configure(transport, joined_.model_spec(), slice_, slices_);
  server_.SetLowRankEncoder(low_rank_);
  return absl::OkStatus();
}

absl::StatusOr<v1::Task> ServerSession::RequestTask(bool ahead, uint64_t given_up_task_id) {
  return server_.RequestTask(joined_.worker_id(), ahead, given_up_task_id);
}

absl::StatusOr<uint64_t> ServerSession::Pull(uint64_t version,
                                             std::vector<std::vector<float>>* layers,
                                             uint64_t* bytes) {
  return server_.Pull(joined_.worker_id(), version, /*latest=*/false, joined_.model_spec(), layers,
                      bytes, slice_, slices_);
}

void ServerSession::ReportPulled(const v1::Task& task) {
  v1::HeartbeatRequest request;
  request.set_worker_id(joined_.worker_id());
  request.set_pulled_task_id(task.task_id());
  if (slices_ > 1) {
    request.set_pulled_slice(slice_);
    request.set_pulled_slices(slices_);
  }
  if (absl::StatusOr<v1::HeartbeatReply> reply = server_.Heartbeat(request); !reply.ok()) {
    ALOE_LOG_WARNING("worker", "could not report task %d's base version as pulled: %s",
                     task.task_id(), reply.status().message());
  }
}

v1::PushHeader ServerSession::Header(const v1::Task& task, const TrainStats& stats) {
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
  // The encoder compresses this task's pushes at the ranks the task names (adaptive rank).
  if (task.tensor_ranks_size() > 0) {
    low_rank_->SetTaskRanks(task.task_id(), std::vector<v1::TensorRank>(task.tensor_ranks().begin(),
                                                                        task.tensor_ranks().end()));
  }
  if (slices_ > 1) {
    header.set_slice(slice_);
    header.set_slices(slices_);
  }
  return header;
}

absl::StatusOr<v1::PushReply> ServerSession::Push(const v1::PushHeader& header,
                                                  std::vector<std::vector<float>>& delta,
                                                  uint64_t* pushed) {
  const v1::TransportConfig& transport = joined_.transport();
  if (transport.error_feedback() && !residual_.empty()) {
    for (size_t l = 0; l < delta.size(); ++l) {
      kernels::WeightedAccumulate(residual_[l].data(), 1.0f, delta[l].data(), delta[l].size());
    }
  }
  if (slices_ > 1 &&
      std::find(codecs_.begin(), codecs_.end(), v1::CODEC_LOWRANK) != codecs_.end()) {
    // No rank holds a whole tensor: the factors come from every rank's slices
    // (common/low_rank_fsdp.h). The collective runs on the thread that pushes, which is the
    // control group's when there is one (overlapped rounds push beside training).
    Collectives* const group = control_ != nullptr ? control_ : node_;
    if (group == nullptr) {
      return absl::FailedPreconditionError(
          "a sliced push of low-rank layers needs the node's process group");
    }
    ALOE_RETURN_IF_ERROR(
        low_rank_->CompressSlices(header.task_id(), delta, [group](absl::Span<float> values) {
          return group->AllReduceSumFloats(values.data(), values.size());
        }));
  }
  return server_.Push(header, joined_.model_spec(), delta, codecs_, TransportBlockSizes(transport),
                      transport.error_feedback() ? &residual_ : nullptr, pushed);
}

absl::StatusOr<v1::Task> ServerSession::StartGroup(uint32_t group) {
  return server_.StartGroup(joined_.worker_id(), group);
}

absl::StatusOr<uint64_t> ServerSession::PullGroup(uint32_t group, uint64_t min_group_version,
                                                  std::vector<std::vector<float>>* layers,
                                                  uint64_t* bytes) {
  return server_.PullGroup(joined_.worker_id(), group, min_group_version, joined_.model_spec(),
                           layer_groups_, layers, bytes);
}

absl::StatusOr<v1::PushReply> ServerSession::PushGroup(const v1::PushHeader& header,
                                                       std::vector<std::vector<float>>& delta,
                                                       uint64_t* pushed) {
  const v1::TransportConfig& transport = joined_.transport();
  if (transport.error_feedback()) {
    // Only the group's layers: the others have no residual yet, or keep theirs for their push.
    for (size_t l = 0; l < delta.size() && l < residual_.size(); ++l) {
      if (layer_groups_[l] != header.group() || residual_[l].size() != delta[l].size()) continue;
      kernels::WeightedAccumulate(residual_[l].data(), 1.0f, delta[l].data(), delta[l].size());
    }
  }
  return server_.PushGroup(header, joined_.model_spec(), layer_groups_, delta, codecs_,
                           TransportBlockSizes(transport),
                           transport.error_feedback() ? &residual_ : nullptr, pushed);
}

RetryBackoff::Options ServerSession::RetryBackoffOptions() {
  return {.initial = options_.retry_interval,
          .max = options_.retry_max,
          .jitter = options_.retry_jitter,
          .seed = options_.retry_seed + retries_begun_.fetch_add(1)};
}

void ServerSession::CountRetry(const char* kind) {
  if (metrics_ != nullptr) metrics_->Add(kRetries, 1, {kind});
}

void ServerSession::Leave() {
  if (!member_) return;
  absl::Status left = server_.Leave(joined_.worker_id());
  if (!left.ok()) ALOE_LOG_WARNING("worker", "leave: %s", left.ToString());
}

}  // namespace aloe::worker
