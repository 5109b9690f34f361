// Asynchronous aggregation with grace-period batching (paper 002 Alg. 2 and 5), for a server
// that lives in real (or simulated) time:
//   - every pushed pseudo-gradient is applied on arrival, as its own outer step;
//   - the first arrival opens a window of tau_grace; later arrivals inside the window are
//     applied in arrival order and join it;
//   - the window closes when tau_grace has passed, or earlier when every known trainer has
//     pushed into it, so nobody else could still arrive (Alg. 2's "else" branch); all workers
//     of the window are then released together and start from one model version, the version
//     at the close;
//   - a worker never waits longer than tau_grace after its push; tau_grace = 0 is plain async.
// Workers that never pushed (new joiners) start at once from the current version.
// Time comes from the injected Clock. Not thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <vector>

#include "absl/time/time.h"
#include "common/clock.h"
#include "server/core/aggregation.h"

namespace aloe::server {

class GracePeriodAggregation final : public AggregationPolicy {
 public:
  // `clock` must outlive this. grace may be absl::InfiniteDuration().
  GracePeriodAggregation(const Clock& clock, absl::Duration grace) : clock_(clock), grace_(grace) {}

  std::optional<uint64_t> StartVersion(uint64_t worker, uint64_t current_version,
                                       const std::vector<uint64_t>& live_trainers) override;
  absl::StatusOr<ApplyBatch> Submit(PendingUpdate update, uint64_t current_version) override;
  ApplyBatch OnWorkerGone(uint64_t worker) override;
  bool CloseExpired(uint64_t current_version) override;
  bool InProgress() const override { return !started_.empty() || window_open_.has_value(); }
  size_t active_workers() const override { return started_.size() + window_members_.size(); }
  std::optional<absl::Time> Deadline() const override;
  std::optional<uint64_t> PendingStartVersion() const override;

  // Workers in the open window (pushed, waiting for its close).
  size_t window_size() const { return window_members_.size(); }

 private:
  void Close(uint64_t current_version);

  const Clock& clock_;
  const absl::Duration grace_;
  std::set<uint64_t> known_;           // trainers that asked for work and have not gone
  std::set<uint64_t> started_;         // have work in progress, will push
  std::set<uint64_t> window_members_;  // pushed in the open window, wait for its close
  std::optional<absl::Time> window_open_;
  std::set<uint64_t> released_;        // released by the last close, not yet restarted
  uint64_t release_version_ = 0;
};

}  // namespace aloe::server
