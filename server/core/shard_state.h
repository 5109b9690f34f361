// The state of one shard process of a layer-sharded server (ServerConfig.shard_processes > 0):
// the parameters and outer optimizer state of the layers this process owns
// (ModelSpec.layers[l].shard == shard_index), the pushed updates it has staged but not yet
// committed, and the older versions it keeps for pulls of open tasks.
//
// The coordinator decides which updates form an outer step and in which order; a shard only
// stages what workers push to it and applies the coordinator's ShardOrders (proto/aloe.proto,
// "Between the coordinator and the shard processes"). Every shard applies the same commits in
// the same order, so an update reaches an outer step on every shard or on none: a COMMIT naming
// an update this shard does not hold completely is refused and changes nothing.
//
// Pure logic (docs/architecture.md, "Dependency rule"): no gRPC, no threads of its own, no clock.
// Not thread-safe: the shard service serialises calls. Outer steps fan out over `apply_groups`
// groups of owned layers through the Executor.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/buffer_pool.h"
#include "common/executor.h"
#include "proto/aloe.pb.h"
#include "server/core/parameter_store.h"
#include "server/core/pseudo_gradient_penalty.h"
#include "server/core/update.h"

namespace aloe::server {

// What Stage did with a pushed part.
struct StageResult {
  bool complete = false;         // every slice of the update is staged: it may be committed
  uint32_t slices_received = 0;  // distinct slices staged so far (1 for a whole update)
};

class ShardState {
 public:
  // spec: the FULL model spec; spec.num_shards() is the number of shard processes and
  // layers[l].shard() the process owning layer l (layer ids must be 0, 1, ... in order).
  // initial: one entry per spec layer, exactly num_elements values for every owned layer (the
  // entries of foreign layers are ignored and may be empty). The owned layers are stepped in
  // min(apply_groups, owned) groups in parallel (0 is treated as 1), balanced by bytes. At most
  // max_staged distinct updates are staged at once. `executor` must outlive this object.
  // kInvalidArgument for shard_index >= num_shards, a malformed spec, a size mismatch of an
  // owned layer, a shard owning no layer (more shard processes than layers), max_staged == 0 or
  // a bad optimizer config.
  // layer_groups (partial synchronization): the layer group of every GLOBAL spec layer,
  // numbered from 0 without gaps (common/layer_groups.h AssignLayerGroups); empty = the whole
  // model is one group. A group may hold no owned layer. kInvalidArgument when it does not fit.
  static absl::StatusOr<std::unique_ptr<ShardState>> Create(
      v1::ModelSpec spec, uint32_t shard_index, std::vector<std::vector<float>> initial,
      const v1::OuterOptimizerConfig& optimizer, uint32_t apply_groups, uint32_t max_staged,
      Executor& executor, std::vector<uint32_t> layer_groups = {});

  ShardState(const ShardState&) = delete;
  ShardState& operator=(const ShardState&) = delete;

  // Turns on the EDiT pseudo-gradient penalty (paper 000 Alg. 2) for the owned layers: a COMMIT
  // then scales each update by its entry's discount and weighs the updates per layer by their
  // norms (PenaltyAggregation) instead of using the entries' weights, exactly as a
  // single-process server does. The statistics are kept per (worker, owned layer). Call before
  // the first Apply or Restore. kInvalidArgument for a bad config (PseudoGradientPenalty::Create).
  absl::Status EnablePenalty(const v1::PenaltyConfig& config);
  // The penalty's report per owned layer (local order) of the last COMMIT; empty without the
  // penalty.
  const std::vector<PenaltyModuleReport>& last_penalty_reports() const { return penalty_reports_; }

  // Testing (aloe-server --record_commits): called by every COMMIT that passed its checks, before
  // it is applied, with the owned layers' global ids and the updates it commits (owned layers in
  // local order, as staged: before any discount). Not called for a commit of a layer group with
  // no layer owned here.
  using CommitObserver = std::function<void(const std::vector<uint32_t>& owned,
                                            const std::vector<const PendingUpdate*>& updates)>;
  void SetCommitObserver(CommitObserver observer) { commit_observer_ = std::move(observer); }

  uint32_t shard_index() const { return shard_index_; }
  // Global layer ids owned by this shard, ascending.
  const std::vector<uint32_t>& owned_layers() const { return owned_; }
  // The version of the owned parameters: 0 at start, then the version of the last COMMIT
  // applied or of the checkpoint restored.
  uint64_t version() const { return store_->version(); }
  // Layer groups: how many (1 without), the version of each (its commits, counted also where no
  // layer of it is owned here), and whether one owns a layer here.
  uint32_t num_layer_groups() const { return store_->num_layer_groups(); }
  uint64_t group_version(uint32_t group) const { return store_->group_version(group); }
  bool OwnsLayerOf(uint32_t group) const;
  // The layer group of each GLOBAL spec layer; empty without groups.
  const std::vector<uint32_t>& layer_groups() const { return layer_groups_; }
  // ParameterStore::layer_steps / copied_layer_steps of the owned layers (since this state was
  // created or restored from version 0).
  uint64_t layer_steps() const { return store_->layer_steps(); }
  uint64_t copied_layer_steps() const { return store_->copied_layer_steps(); }

  // --- Staging: what a Push to this shard delivers.

  // Stages this shard's part of an update. part.layers has one entry per GLOBAL spec layer:
  // owned layers with exactly num_elements values, foreign layers empty. For a sliced push
  // (part.slices > 1) each owned buffer is full-size with slice SliceRange(n, slices, slice)
  // filled (UpdateAssembler's output); the slices of one (worker_id, update_id) are merged until
  // all `slices` arrived. Pushing a slice (or a whole update) again replaces the staged copy of
  // it, so retries are idempotent and a complete update stays complete. Different update_ids of
  // one worker are staged side by side. part.weight_scale is not applied: the coordinator folds
  // the staleness discount into the COMMIT weight.
  // Errors, each leaving the staging unchanged:
  //   kInvalidArgument naming the layer for data in a foreign layer or an owned layer of the
  //     wrong size; for a bad slice/slices pair; for a part of an already staged
  //     (worker_id, update_id) that disagrees with it on task_id, steps_done, tokens_learned or
  //     slices (one update id names one update);
  //   with layer groups: kInvalidArgument for a part of a group past the groups, of a group
  //     with no layer owned here (it goes only to the shards that own its layers), with data
  //     in an owned layer of another group, or sliced (group pushes are whole);
  //   kResourceExhausted "staging full: S of S updates staged" for a new update when !HasRoom
  //     (the service waits for room before reading a push, so this is a safety net).
  absl::StatusOr<StageResult> Stage(PendingUpdate part);

  // True when (worker_id, update_id) is already staged (partly or fully) or fewer than
  // max_staged distinct updates are staged.
  bool HasRoom(uint64_t worker_id, uint64_t update_id) const;
  // True when every slice of (worker_id, update_id) is staged.
  bool IsStaged(uint64_t worker_id, uint64_t update_id) const;
  // Drops (worker_id, update_id) from staging; no-op when absent.
  void Discard(uint64_t worker_id, uint64_t update_id);
  // Distinct updates staged (complete or not).
  size_t staged_count() const { return staged_.size(); }
  // Float bytes held by staged updates.
  uint64_t staged_bytes() const;

  // --- Orders from the coordinator.

  // COMMIT: one outer step producing order.version() with g = sum_i weight_i * g_i over the
  // entries (ParameterStore::ApplyOuterStep: the weights are used as given, not renormalised).
  //   kFailedPrecondition "commit of version X on a shard at version Y" unless
  //     order.version() == version() + 1; kFailedPrecondition naming the worker and update when
  //     an entry is not staged completely;
  //   kInvalidArgument for no entries, a repeated entry or a non-finite weight;
  //   with layer groups: kInvalidArgument unless the order names a group (by_group) of the
  //     model; kFailedPrecondition when a staged entry is of another group. A commit of a group
  //     with no layer owned here needs nothing staged: it advances the version and the group's.
  //   All checked before anything changes. On success the committed updates leave staging, the
  //   old version is retained when it is in order.keep_versions(), and every retained version
  //   not in keep_versions is dropped.
  // DISCARD: drops each entry from staging (absent ones are ignored); the version is unchanged.
  // FORGET: drops the penalty statistics of each entry's worker (no-op without the penalty).
  // RESTORE and unknown kinds: kInvalidArgument (the service restores through Restore below).
  absl::Status Apply(const v1::ShardOrder& order);

  // --- Pulls.

  // The owned layers at `version`, one entry per GLOBAL layer (nullptr for foreign layers): the
  // current version or a retained older one. The buffers are immutable and stay valid while the
  // caller holds the snapshot. kUnavailable for a version newer than version() (the service
  // waits for the commit and asks again); kFailedPrecondition for an older version that is not
  // retained.
  absl::StatusOr<ModelSnapshot> SnapshotAt(uint64_t version) const;
  // Older versions kept for pulls, ascending.
  std::vector<uint64_t> retained_versions() const;

  // --- Checkpoints.

  // Parameters (float32 little-endian), outer optimizer state and penalty statistics of the
  // owned layers at version(), format 1, tagged with `fingerprint` (model spec + outer optimizer).
  v1::ShardCheckpoint Capture(const std::string& fingerprint) const;
  // Replaces parameters, optimizer states and version with the checkpoint's and drops all staged
  // updates and retained versions. All or nothing:
  //   kFailedPrecondition when the fingerprint, shard_index or shard_processes differ from this
  //     shard's (the message names both values);
  //   kInvalidArgument for an unknown format, layer ids other than owned_layers(), or a
  //     parameter size, optimizer state blob or penalty state that does not fit (a checkpoint
  //     without penalty state starts the statistics afresh).
  absl::Status Restore(const v1::ShardCheckpoint& c, const std::string& fingerprint);

  // Where pushes to this shard take their layer buffers (UpdateAssembler): committed and
  // discarded updates give theirs back here, so staging rarely allocates or zero-fills.
  std::shared_ptr<FloatBufferPool> staging_buffers() const { return staging_buffers_; }

 private:
  using UpdateKey = std::pair<uint64_t, uint64_t>;  // (worker_id, update_id)

  // One update being staged: the header of its first part, and its owned layers (local order),
  // merged over the slices received so far.
  struct StagedUpdate {
    PendingUpdate merged;
    std::vector<bool> received;  // per slice
    uint32_t count = 0;          // slices received
    bool complete() const { return count == received.size(); }
  };

  ShardState(v1::ModelSpec spec, uint32_t shard_index, uint32_t max_staged,
             std::vector<uint32_t> owned, std::vector<int> local_of_global,
             std::vector<uint32_t> layer_groups, std::unique_ptr<ParameterStore> store);

  absl::Status CheckPart(const PendingUpdate& part) const;
  absl::Status Commit(const v1::ShardOrder& order);
  // After a commit: `old` (the version before it, when the order keeps it) is retained, and
  // every retained version the order does not keep is dropped.
  void RetainFor(const v1::ShardOrder& order, std::optional<ModelSnapshot> old);
  // Expands a snapshot of the owned layers (local order) to one entry per global layer.
  ModelSnapshot Globalize(const ModelSnapshot& local) const;

  const v1::ModelSpec spec_;  // the full spec
  const uint32_t shard_index_;
  const uint32_t max_staged_;
  const std::vector<uint32_t> owned_;         // global ids of the owned layers, ascending
  const std::vector<int> local_of_global_;    // local index of each global layer, -1 if foreign
  const std::vector<uint32_t> layer_groups_;  // layer group of each global layer; empty = none
  std::unique_ptr<ParameterStore> store_;     // the owned layers only, re-indexed 0..owned-1
  std::map<UpdateKey, StagedUpdate> staged_;
  std::map<uint64_t, ModelSnapshot> retained_;      // older versions (local order) kept for pulls
  std::unique_ptr<PseudoGradientPenalty> penalty_;  // null = off; modules = owned layers
  std::vector<PenaltyModuleReport> penalty_reports_;
  CommitObserver commit_observer_;  // may be empty
  // Idle: at most max_staged updates' owned layers.
  std::shared_ptr<FloatBufferPool> staging_buffers_;
};

}  // namespace aloe::server
