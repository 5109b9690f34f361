// Aggregation policies decide when a worker may start local work and which received updates
// form one outer step. Sync DiLoCo (paper 002 Alg. 1) is a round barrier; the asynchronous
// grace-period batching of paper 002 Alg. 2/5 plugs in behind the same interface.
// Not thread-safe: the owner serialises calls.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/core/update.h"

namespace aloe::server {

// A set of updates to aggregate into one outer step, with their weights (summing to 1).
struct ApplyBatch {
  std::vector<PendingUpdate> updates;
  std::vector<float> weights;
};

class AggregationPolicy {
 public:
  virtual ~AggregationPolicy() = default;

  // The version trainer `worker` starts local work from now, or nullopt when it must wait.
  // live_trainers is every live trainer (including `worker`). An answer commits the worker to
  // push. The version is current_version, or an older one the policy released earlier (see
  // PendingStartVersion) which the caller must keep available.
  virtual std::optional<uint64_t> StartVersion(uint64_t worker, uint64_t current_version,
                                               const std::vector<uint64_t>& live_trainers) = 0;

  // Takes a received update whose worker and task the caller already checked. Returns the batch
  // to apply now (empty when the update waits for others), or kFailedPrecondition for an update
  // that does not belong to the current aggregation (stale version, second push), in which case
  // the policy's state is unchanged.
  virtual absl::StatusOr<ApplyBatch> Submit(PendingUpdate update, uint64_t current_version) = 0;

  // `worker` left or was dropped. Returns a batch when its absence completes one.
  virtual ApplyBatch OnWorkerGone(uint64_t worker) = 0;

  // One-step-delay overlap (docs/algorithms.md, "Overlapped communication"). Trainer `worker`
  // has work in progress and asks for the work after it, to train while its current work is
  // pushed. Returns the version that work starts from: the version its next task would start
  // from once the aggregation of its last push released it (the current version when there is
  // none to wait for). nullopt while that aggregation is still open. An answer commits the
  // worker to push that work after its current one.
  virtual std::optional<uint64_t> StartAhead(uint64_t worker, uint64_t current_version,
                                             const std::vector<uint64_t>& live_trainers) = 0;

  // The work `worker` started ahead became its work in progress, its previous work having been
  // submitted or ended (OnWorkEnded).
  virtual void PromoteAhead(uint64_t worker) = 0;

  // The work in progress of `worker` ended without an update (too stale, given up); the worker
  // stays. Returns a batch when its absence completes one.
  virtual ApplyBatch OnWorkEnded(uint64_t worker) = 0;

  // Begins what work started ahead waits for once the aggregation before it is complete (a sync
  // round over current_version). Returns a batch when everything it includes is in already.
  virtual ApplyBatch BeginAhead(uint64_t current_version,
                                const std::vector<uint64_t>& live_trainers) {
    return {};
  }

  // The version an update of `worker` from `base_version`, submitted now, will be applied to:
  // current_version, or a later one for work started ahead that joins the next sync round.
  virtual uint64_t TargetVersion(uint64_t worker, uint64_t base_version,
                                 uint64_t current_version) const {
    return current_version;
  }

  // True while some started work has not yet been aggregated.
  virtual bool InProgress() const = 0;

  // Workers whose pushes the current aggregation includes or still awaits (a sync round's
  // participants); 0 when none is in progress.
  virtual size_t active_workers() const = 0;

  // Time-driven policies: closes what is due at the clock's now (e.g. a grace window) and
  // returns true when workers were released to start from current_version.
  virtual bool CloseExpired(uint64_t current_version) { return false; }
  // When the next CloseExpired may fire; nullopt when nothing is pending.
  virtual std::optional<absl::Time> Deadline() const { return std::nullopt; }
  // A version released workers will start from that is not yet handed out in a task.
  virtual std::optional<uint64_t> PendingStartVersion() const { return std::nullopt; }

  // Sizes of the groups of workers released together since the last call, oldest first: each
  // completed sync round's pushers, each closed grace window's members (for metrics).
  std::vector<size_t> TakeReleasedGroups() { return std::exchange(released_groups_, {}); }

 protected:
  void RecordReleasedGroup(size_t workers) {
    if (workers > 0) released_groups_.push_back(workers);
  }

 private:
  std::vector<size_t> released_groups_;
};

// Sync DiLoCo: a round opens at version v over the live trainers (the first round waits for
// min_workers); each participant starts once from v and pushes once; when every remaining
// participant has pushed, their pseudo-gradients are averaged into one outer step. Trainers that
// join mid-round wait for the next round; a participant that leaves or expires is not waited for.
//
// One-step-delay overlap: a participant of round r may start its round-(r+1) work ahead, from
// v, before round r closes. Round r+1 then counts it as started (from v, one version staler than
// the others); its push joins round r+1 even when it arrives before round r closed (it is held
// until round r+1 opens), and it may start its round-(r+2) work from round r+1's version once it
// has pushed into round r+1. A round whose participants started ahead opens as soon as the round
// before it closes (BeginAhead). No work is started ahead for a round that would make a version
// past last_version (0 = no limit).
class SyncRoundAggregation final : public AggregationPolicy {
 public:
  explicit SyncRoundAggregation(uint32_t min_workers, uint64_t last_version = 0)
      : min_workers_(min_workers), last_version_(last_version) {}

  std::optional<uint64_t> StartVersion(uint64_t worker, uint64_t current_version,
                                       const std::vector<uint64_t>& live_trainers) override;
  std::optional<uint64_t> StartAhead(uint64_t worker, uint64_t current_version,
                                     const std::vector<uint64_t>& live_trainers) override;
  void PromoteAhead(uint64_t worker) override {}
  absl::StatusOr<ApplyBatch> Submit(PendingUpdate update, uint64_t current_version) override;
  ApplyBatch OnWorkerGone(uint64_t worker) override;
  ApplyBatch OnWorkEnded(uint64_t worker) override;
  ApplyBatch BeginAhead(uint64_t current_version,
                        const std::vector<uint64_t>& live_trainers) override;
  uint64_t TargetVersion(uint64_t worker, uint64_t base_version,
                         uint64_t current_version) const override;
  bool InProgress() const override { return open_ || !ahead_.empty() || !early_.empty(); }
  size_t active_workers() const override { return open_ ? participants_.size() : 0; }

 private:
  // Opens a round at current_version: the work started ahead and its early pushes join it.
  void Open(uint64_t current_version, const std::vector<uint64_t>& live_trainers);
  // Whether `worker` pushed into the open round work it had started ahead of it.
  bool PushedAheadWork(uint64_t worker) const;
  ApplyBatch CompleteIfDone();

  const uint32_t min_workers_;
  const uint64_t last_version_;
  bool open_ = false;
  bool first_round_ = true;
  uint64_t round_version_ = 0;
  std::set<uint64_t> participants_;
  std::map<uint64_t, uint64_t> started_;  // worker -> the version its work of the round began at
  std::set<uint64_t> pushed_;
  std::vector<PendingUpdate> received_;
  // The next round's: work started ahead from round_version_ (worker -> that version), and the
  // pushes of that work that arrived before the next round opened.
  std::map<uint64_t, uint64_t> ahead_;
  std::vector<PendingUpdate> early_;
};

}  // namespace aloe::server
