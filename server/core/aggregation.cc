#include "server/core/aggregation.h"

#include "absl/strings/str_format.h"

namespace aloe::server {

std::optional<uint64_t> SyncRoundAggregation::StartVersion(
    uint64_t worker, uint64_t current_version, const std::vector<uint64_t>& live_trainers) {
  if (!open_) {
    if (first_round_ && live_trainers.size() < min_workers_) return std::nullopt;
    if (live_trainers.empty()) return std::nullopt;
    open_ = true;
    first_round_ = false;
    round_version_ = current_version;
    participants_ = std::set<uint64_t>(live_trainers.begin(), live_trainers.end());
    started_.clear();
    pushed_.clear();
    received_.clear();
  }
  if (round_version_ != current_version) return std::nullopt;
  if (participants_.count(worker) == 0 || started_.count(worker) > 0) return std::nullopt;
  started_.insert(worker);
  return round_version_;
}

absl::StatusOr<ApplyBatch> SyncRoundAggregation::Submit(PendingUpdate update,
                                                        uint64_t current_version) {
  if (!open_ || update.base_version != round_version_ || round_version_ != current_version) {
    return absl::FailedPreconditionError(
        absl::StrFormat("stale update: based on version %d but the open round is at version %d",
                        update.base_version, open_ ? round_version_ : current_version));
  }
  if (started_.count(update.worker_id) == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker %d did not start in the round of version %d", update.worker_id, round_version_));
  }
  if (pushed_.count(update.worker_id) > 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker %d already pushed in the round of version %d", update.worker_id, round_version_));
  }
  pushed_.insert(update.worker_id);
  received_.push_back(std::move(update));
  return CompleteIfDone();
}

ApplyBatch SyncRoundAggregation::OnWorkerGone(uint64_t worker) {
  if (!open_) return {};
  if (pushed_.count(worker) == 0) {
    participants_.erase(worker);
    started_.erase(worker);
  }
  return CompleteIfDone();
}

ApplyBatch SyncRoundAggregation::CompleteIfDone() {
  ApplyBatch batch;
  for (uint64_t w : participants_) {
    if (pushed_.count(w) == 0) return batch;  // still waiting for w
  }
  open_ = false;
  if (received_.empty()) return batch;  // everybody left without pushing
  const float w = 1.0f / static_cast<float>(received_.size());
  batch.weights.assign(received_.size(), w);
  batch.updates = std::move(received_);
  received_.clear();
  RecordReleasedGroup(batch.updates.size());
  return batch;
}

}  // namespace aloe::server
