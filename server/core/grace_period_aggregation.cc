#include "server/core/grace_period_aggregation.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace aloe::server {

std::optional<absl::Time> GracePeriodAggregation::Deadline() const {
  if (!window_open_ || grace_ == absl::InfiniteDuration()) return std::nullopt;
  if (window_due_ == absl::InfiniteFuture()) return std::nullopt;  // waits for its round
  return window_due_ + grace_;
}

size_t GracePeriodAggregation::active_workers() const {
  // An overlapping worker can be a window member with work in progress: counted once.
  size_t members = started_.size();
  for (uint64_t worker : window_members_) members += started_.count(worker) == 0;
  return members;
}

void GracePeriodAggregation::Expect(uint64_t worker, uint64_t round, absl::Duration slack) {
  if (started_.count(worker) == 0) return;
  if (round == 0) {
    expected_.erase(worker);
  } else {
    expected_[worker] = Expectation{round, std::max(slack, absl::ZeroDuration())};
  }
}

std::optional<GracePeriodAggregation::Release> GracePeriodAggregation::StartedBy(
    uint64_t worker) const {
  auto it = started_by_.find(worker);
  if (it == started_by_.end()) return std::nullopt;
  return it->second;
}

bool GracePeriodAggregation::RoundComplete() const {
  if (window_round_ == 0) return false;
  for (const auto& [worker, expectation] : expected_) {
    if (expectation.round <= window_round_) return false;
  }
  return true;
}

std::optional<uint64_t> GracePeriodAggregation::PendingStartVersion() const {
  if (released_.empty() || grace_ == absl::ZeroDuration()) return std::nullopt;
  return release_version_;
}

bool GracePeriodAggregation::CloseExpired(uint64_t current_version) {
  if (!window_open_) return false;
  const bool timed_out = grace_ != absl::InfiniteDuration() && clock_.Now() >= window_due_ + grace_;
  const bool everyone_in =
      std::includes(window_members_.begin(), window_members_.end(), known_.begin(), known_.end());
  if (!timed_out && !everyone_in && !RoundComplete()) return false;
  Close(current_version);
  return true;
}

void GracePeriodAggregation::Close(uint64_t current_version) {
  RecordReleasedGroup(window_members_.size());
  released_.insert(window_members_.begin(), window_members_.end());
  for (uint64_t worker : window_members_) {
    release_of_[worker] = Release{clock_.Now(), window_round_};
  }
  window_members_.clear();
  window_open_.reset();
  window_round_ = 0;
  release_version_ = current_version;
}

std::optional<uint64_t> GracePeriodAggregation::StartVersion(
    uint64_t worker, uint64_t current_version, const std::vector<uint64_t>& live_trainers) {
  known_.insert(worker);
  CloseExpired(current_version);
  if (window_members_.count(worker) > 0 || started_.count(worker) > 0) return std::nullopt;
  started_.insert(worker);
  expected_.erase(worker);
  return Restart(worker, current_version);
}

std::optional<uint64_t> GracePeriodAggregation::StartAhead(
    uint64_t worker, uint64_t current_version, const std::vector<uint64_t>& live_trainers) {
  known_.insert(worker);
  if (started_.count(worker) == 0 || window_members_.count(worker) > 0) return std::nullopt;
  return Restart(worker, current_version);
}

void GracePeriodAggregation::PromoteAhead(uint64_t worker) {
  known_.insert(worker);
  started_.insert(worker);
}

uint64_t GracePeriodAggregation::Restart(uint64_t worker, uint64_t current_version) {
  started_by_.erase(worker);
  if (auto release = release_of_.find(worker); release != release_of_.end()) {
    if (released_.count(worker) > 0) started_by_[worker] = release->second;
    release_of_.erase(release);
  }
  // tau_grace = 0 (plain async): no window is shared, so a released worker starts from the
  // newest version when it asks, as in Alg. 2 (its task starts from the current theta at once)
  // and without holding the version of its release for it meanwhile.
  if (released_.erase(worker) > 0 && grace_ > absl::ZeroDuration()) return release_version_;
  return current_version;
}

absl::StatusOr<ApplyBatch> GracePeriodAggregation::Submit(PendingUpdate update,
                                                          uint64_t current_version) {
  // A window whose time ran out closes before this arrival opens the next one.
  if (window_open_ && grace_ != absl::InfiniteDuration() && clock_.Now() >= window_due_ + grace_) {
    Close(current_version);
  }
  if (started_.count(update.worker_id) == 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("worker %d has no work in progress (already pushed?)", update.worker_id));
  }
  started_.erase(update.worker_id);
  auto expectation = expected_.find(update.worker_id);
  if (!window_open_) {
    window_open_ = clock_.Now();
    window_due_ = *window_open_;
    if (expectation != expected_.end()) {
      window_round_ = expectation->second.round;
      window_due_ += expectation->second.slack;
    }
  }
  if (expectation != expected_.end()) expected_.erase(expectation);
  window_members_.insert(update.worker_id);
  ApplyBatch batch;
  batch.weights.push_back(1.0f);
  batch.updates.push_back(std::move(update));
  return batch;
}

ApplyBatch GracePeriodAggregation::OnWorkerGone(uint64_t worker) {
  known_.erase(worker);
  started_.erase(worker);
  window_members_.erase(worker);
  released_.erase(worker);
  expected_.erase(worker);
  release_of_.erase(worker);
  started_by_.erase(worker);
  return {};
}

}  // namespace aloe::server
