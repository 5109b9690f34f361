#include "server/core/aggregation.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace aloe::server {

void SyncRoundAggregation::Open(uint64_t current_version,
                                const std::vector<uint64_t>& live_trainers) {
  open_ = true;
  first_round_ = false;
  round_version_ = current_version;
  participants_ = std::set<uint64_t>(live_trainers.begin(), live_trainers.end());
  started_ = std::exchange(ahead_, {});
  pushed_.clear();
  for (const PendingUpdate& update : early_) pushed_.insert(update.worker_id);
  received_ = std::exchange(early_, {});
}

bool SyncRoundAggregation::PushedAheadWork(uint64_t worker) const {
  auto started = started_.find(worker);
  return open_ && started != started_.end() && started->second != round_version_ &&
         pushed_.count(worker) > 0;
}

std::optional<uint64_t> SyncRoundAggregation::StartVersion(
    uint64_t worker, uint64_t current_version, const std::vector<uint64_t>& live_trainers) {
  if (!open_) {
    // Work started ahead waits for its round: BeginAhead opens it.
    if (!ahead_.empty() || !early_.empty()) return std::nullopt;
    if (first_round_ && live_trainers.size() < min_workers_) return std::nullopt;
    if (live_trainers.empty()) return std::nullopt;
    Open(current_version, live_trainers);
  }
  if (round_version_ != current_version) return std::nullopt;
  // A worker one step behind (it pushed into this round work started ahead of it) stays so: its
  // next work starts ahead, from this round's version.
  if (PushedAheadWork(worker)) return StartAhead(worker, current_version, live_trainers);
  if (participants_.count(worker) == 0 || started_.count(worker) > 0) return std::nullopt;
  started_[worker] = round_version_;
  return round_version_;
}

std::optional<uint64_t> SyncRoundAggregation::StartAhead(
    uint64_t worker, uint64_t current_version, const std::vector<uint64_t>& live_trainers) {
  if (!open_ || round_version_ != current_version) return std::nullopt;
  if (started_.count(worker) == 0 || ahead_.count(worker) > 0) return std::nullopt;
  // The next round makes version round_version_ + 2.
  if (last_version_ > 0 && round_version_ + 2 > last_version_) return std::nullopt;
  ahead_[worker] = round_version_;
  return round_version_;
}

absl::StatusOr<ApplyBatch> SyncRoundAggregation::Submit(PendingUpdate update,
                                                        uint64_t current_version) {
  const uint64_t worker = update.worker_id;
  auto ahead = ahead_.find(worker);
  // Work started ahead is pushed after the worker's push into the open round (or once the round
  // it was started in has closed): it joins the next round.
  if (ahead != ahead_.end() && ahead->second == update.base_version &&
      (!open_ || pushed_.count(worker) > 0)) {
    if (std::any_of(early_.begin(), early_.end(),
                    [&](const PendingUpdate& u) { return u.worker_id == worker; })) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "worker %d already pushed in the round after version %d", worker, ahead->second));
    }
    early_.push_back(std::move(update));
    return ApplyBatch{};
  }
  auto started = started_.find(worker);
  const uint64_t expected = started != started_.end() ? started->second : round_version_;
  if (!open_ || update.base_version != expected || round_version_ != current_version) {
    return absl::FailedPreconditionError(
        absl::StrFormat("stale update: based on version %d but the open round is at version %d",
                        update.base_version, open_ ? round_version_ : current_version));
  }
  if (started == started_.end()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker %d did not start in the round of version %d", worker, round_version_));
  }
  if (pushed_.count(worker) > 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker %d already pushed in the round of version %d", worker, round_version_));
  }
  pushed_.insert(worker);
  received_.push_back(std::move(update));
  return CompleteIfDone();
}

uint64_t SyncRoundAggregation::TargetVersion(uint64_t worker, uint64_t base_version,
                                             uint64_t current_version) const {
  auto ahead = ahead_.find(worker);
  if (open_ && ahead != ahead_.end() && ahead->second == base_version &&
      pushed_.count(worker) > 0) {
    // Held for the next round, which opens at the version this round's step makes: the round
    // holds the worker's own push, so it does step.
    return round_version_ + 1;
  }
  return current_version;
}

ApplyBatch SyncRoundAggregation::OnWorkerGone(uint64_t worker) {
  // Its early push, if any, stays: pushed work is aggregated, as in the open round.
  ahead_.erase(worker);
  if (!open_) return {};
  if (pushed_.count(worker) == 0) {
    participants_.erase(worker);
    started_.erase(worker);
  }
  return CompleteIfDone();
}

ApplyBatch SyncRoundAggregation::OnWorkEnded(uint64_t worker) {
  if (open_ && started_.count(worker) > 0 && pushed_.count(worker) == 0) {
    // Its work of the open round ended. Work it started ahead began at this round's version:
    // it takes the ended work's place in this round.
    if (auto ahead = ahead_.find(worker); ahead != ahead_.end()) {
      started_[worker] = ahead->second;
      ahead_.erase(ahead);
      return {};
    }
    participants_.erase(worker);
    started_.erase(worker);
    return CompleteIfDone();
  }
  // Its work of the next round ended.
  ahead_.erase(worker);
  return {};
}

ApplyBatch SyncRoundAggregation::BeginAhead(uint64_t current_version,
                                            const std::vector<uint64_t>& live_trainers) {
  if (open_ || (ahead_.empty() && early_.empty())) return {};
  Open(current_version, live_trainers);
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
