// Asynchronous aggregation with grace-period batching (paper 002 Alg. 2 and 5), for a server
// that lives in real (or simulated) time:
//   - every pushed pseudo-gradient is applied on arrival, as its own outer step;
//   - the first arrival opens a window of tau_grace; later arrivals inside the window are
//     applied in arrival order and join it;
//   - the window closes when tau_grace has passed, or earlier when every known trainer has
//     pushed into it, so nobody else could still arrive (Alg. 2's "else" branch); all workers
//     of the window are then released together and start from one model version, the version
//     at the close;
//   - a worker never waits longer than tau_grace after its push; tau_grace = 0 is plain async,
//     where a released worker starts from the newest version when it asks (no window's workers
//     share a version).
// Workers that never pushed (new joiners) start at once from the current version.
//
// One-step-delay overlap (StartAhead): a worker with work in progress may start the work after
// it from the version its next task would start from: while its last push is in the open window
// it waits for the close, like any other member, and starts from the version at the close; with
// no push waiting it starts at once. Its pushes join windows like any other. Work started ahead
// carries no round (Expect).
//
// Rounds (DyLU round alignment, LocalWorkPlanner): the caller may tag a started worker's task
// with the round it belongs to and its slack, how long before the round end the worker is
// expected to finish (Expect). A window opened by a tagged push belongs to that round:
//   - it closes at (open + slack + tau_grace): the opener finished early only because its
//     steps are whole, and the rest of its round is due by open + slack; tau_grace is the
//     tolerance after that (a worker never waits longer than its slack plus tau_grace, and the
//     slack is shorter than one of its steps);
//   - it also closes as soon as no started worker of that round (or an older one) is still out;
//   - an infinite slack (a round of unknown length: the first one, before any speed is known)
//     makes it wait for the whole round; workers that leave or expire are not waited for.
// Untagged pushes (round 0) open windows of plain tau_grace. Each release remembers the time
// and the round of its window, which the planner needs to begin the next round (StartedBy).
// Time comes from the injected Clock. Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
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
  std::optional<uint64_t> StartAhead(uint64_t worker, uint64_t current_version,
                                     const std::vector<uint64_t>& live_trainers) override;
  void PromoteAhead(uint64_t worker) override;
  absl::StatusOr<ApplyBatch> Submit(PendingUpdate update, uint64_t current_version) override;
  ApplyBatch OnWorkerGone(uint64_t worker) override;
  ApplyBatch OnWorkEnded(uint64_t worker) override { return OnWorkerGone(worker); }
  bool CloseExpired(uint64_t current_version) override;
  bool InProgress() const override { return !started_.empty() || window_open_.has_value(); }
  size_t active_workers() const override;
  std::optional<absl::Time> Deadline() const override;
  std::optional<uint64_t> PendingStartVersion() const override;

  // Workers in the open window (pushed, waiting for its close).
  size_t window_size() const { return window_members_.size(); }

  // Tags started `worker`'s task with its round (> 0) and slack (see the file comment). Ignored
  // for a worker without work in progress.
  void Expect(uint64_t worker, uint64_t round, absl::Duration slack);

  // The close that released a worker: when, and the round of its window (0 = untagged).
  struct Release {
    absl::Time at;
    uint64_t round = 0;
  };
  // The release the last StartVersion of `worker` started it from; nullopt when it started
  // without one (a first task, a joiner).
  std::optional<Release> StartedBy(uint64_t worker) const;

 private:
  struct Expectation {
    uint64_t round = 0;
    absl::Duration slack;
  };

  void Close(uint64_t current_version);
  // Starts `worker`'s next work: the version it starts from (its release's, or the current one)
  // and the release it starts by (StartedBy).
  uint64_t Restart(uint64_t worker, uint64_t current_version);
  // True when no started worker's task belongs to the open window's round or an older one.
  bool RoundComplete() const;

  const Clock& clock_;
  const absl::Duration grace_;
  std::set<uint64_t> known_;           // trainers that asked for work and have not gone
  std::set<uint64_t> started_;         // have work in progress, will push
  std::set<uint64_t> window_members_;  // pushed in the open window, wait for its close
  std::optional<absl::Time> window_open_;
  uint64_t window_round_ = 0;  // the opener's round; 0 = untagged
  absl::Time window_due_;      // open + the opener's slack
  // Started workers whose task belongs to a round (Expect).
  std::map<uint64_t, Expectation> expected_;
  std::set<uint64_t> released_;  // released by the last close, not yet restarted
  uint64_t release_version_ = 0;
  std::map<uint64_t, Release> release_of_;  // released, not yet restarted
  std::map<uint64_t, Release> started_by_;  // the release each worker last started from
};

}  // namespace aloe::server
