#include "server/core/shard_follower.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/core/shard_assembly.h"

namespace aloe::server {

absl::Duration ReconnectBackoff::After(bool reached) {
  if (reached) {
    unreached_ = 0;
    return initial_;
  }
  ++unreached_;
  absl::Duration delay = initial_;
  for (uint32_t i = 1; i < unreached_ && delay < max_; ++i) delay *= 2;
  return std::min(delay, max_);
}

ShardFollower::ShardFollower(Options options, FollowTransport& transport, FollowedState& state,
                             ReconnectWait& wait)
    : options_(std::move(options)),
      transport_(transport),
      state_(state),
      wait_(wait),
      backoff_(options_.retry_initial, options_.retry_max) {}

void ShardFollower::Stop() {
  stopped_.store(true);
  {
    absl::MutexLock lock(&mu_);
    if (open_ != nullptr) open_->Cancel();
  }
  wait_.Interrupt();
}

v1::FollowRequest ShardFollower::Request() {
  v1::FollowRequest request;
  request.set_shard_index(options_.shard_index);
  request.set_address(options_.address);
  request.set_push_address(options_.push_address);
  request.set_fingerprint(options_.fingerprint);
  state_.Describe(&request);
  return request;
}

absl::Status ShardFollower::Run() {
  while (!stopped_.load()) {
    const Attempt attempt = FollowOnce();
    if (attempt.over) return attempt.status;
    if (stopped_.load()) break;
    wait_.Wait(backoff_.After(attempt.reached));
  }
  return absl::OkStatus();
}

ShardFollower::Attempt ShardFollower::FollowOnce() {
  std::unique_ptr<OrderStream> stream = transport_.Open(Request());
  {
    // Stop may have run before the stream was registered: checked under the lock.
    absl::MutexLock lock(&mu_);
    if (stopped_.load()) return Attempt{};
    open_ = stream.get();
  }
  ++streams_;
  Attempt attempt = ReadOrders(*stream);
  {
    absl::MutexLock lock(&mu_);
    open_ = nullptr;
  }
  return attempt;
}

ShardFollower::Attempt ShardFollower::ReadOrders(OrderStream& stream) {
  Attempt attempt;
  bool failed = false;
  v1::ShardOrder order;
  while (!stopped_.load() && stream.Read(&order)) {
    attempt.reached = true;
    if (!announced_) {
      ALOE_LOG_INFO("shard", "shard %d follows the coordinator", options_.shard_index);
      announced_ = true;
    }
    if (order.kind() == v1::ShardOrder::FINISH) {
      if (!JobOver(order.version())) continue;
      stream.Cancel();
      stream.Finish().IgnoreError();
      attempt.over = true;
      return attempt;
    }
    if (!Applied(order)) {
      failed = true;
      break;
    }
  }
  if (stopped_.load() || failed) stream.Cancel();
  const absl::Status status = stream.Finish();
  if (stopped_.load() || failed) return attempt;
  return Ended(status, attempt.reached);
}

bool ShardFollower::JobOver(uint64_t version) {
  // Every order before FINISH was applied, in stream order.
  const uint64_t at = state_.version();
  if (at == version) {
    ALOE_LOG_INFO("shard", "shard %d: the job is over at version %d", options_.shard_index, at);
    return true;
  }
  ALOE_LOG_ERROR("shard", "shard %d: the job is over at version %d, but this shard is at %d",
                 options_.shard_index, version, at);
  return false;
}

bool ShardFollower::Applied(const v1::ShardOrder& order) {
  const absl::Status s = state_.Apply(order);
  if (s.ok()) return true;
  // This state cannot follow the log on: ask for a reassembly from a checkpoint.
  ALOE_LOG_ERROR("shard", "shard %d: %s order for version %d failed: %s", options_.shard_index,
                 v1::ShardOrder::Kind_Name(order.kind()), order.version(), s.message());
  state_.MarkFresh();
  return false;
}

ShardFollower::Attempt ShardFollower::Ended(const absl::Status& status, bool reached) {
  Attempt attempt;
  attempt.reached = reached;
  if (RefusedForGood(status.code())) {
    attempt.over = true;
    attempt.status =
        absl::Status(status.code(), absl::StrCat("the coordinator refuses shard ",
                                                 options_.shard_index, ": ", status.message()));
  } else if (status.code() == absl::StatusCode::kAborted) {
    attempt.reached = true;  // the coordinator (re)assembles: follow again
  } else {
    ALOE_LOG_WARNING("shard", "shard %d: follow stream ended: %s; reconnecting",
                     options_.shard_index, status.message());
  }
  return attempt;
}

}  // namespace aloe::server
