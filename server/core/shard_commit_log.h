// A layer-sharded coordinator's parameters: they live in the shard processes, which apply the
// coordinator's orders in log order. Each outer step becomes a COMMIT order (which updates, with
// which weights, formed the version); an update counts as pushed only once every shard process
// staged its part, and at most max_staged_updates updates are admitted to be staged at once, the
// same on every shard. The coordinator's ParameterBackend.
//
// Not thread-safe: the core serialises calls.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "server/core/parameter_backend.h"

namespace aloe::server {

class ShardCommitLog final : public ParameterBackend {
 public:
  // config.shard_processes > 0; `config` must be validated. spec: the model, each layer's shard
  // process in LayerSpec.shard. layer_groups: the layer group of each spec layer
  // (AssignLayerGroups of config.partial_sync.groups), empty without layer groups.
  ShardCommitLog(const v1::ServerConfig& config, const v1::ModelSpec& spec,
                 std::vector<uint32_t> layer_groups);

  uint64_t version() const override { return commit_version_; }
  // The versions alone: the layers are the shard processes'.
  ModelSnapshot Snapshot() const override;
  uint32_t num_layer_groups() const override {
    return static_cast<uint32_t>(group_versions_.size());
  }
  uint64_t group_version(uint32_t group) const override { return group_versions_[group]; }
  // Shard process `part` serves workers at `address` ("" = gone), raw pushes at `push_address`.
  void SetAddress(uint32_t part, std::string address, std::string push_address) override;
  // kUnavailable until every shard process has an address. In sync mode more than
  // max_staged_updates / K trainers (K layer groups, 1 without) is kResourceExhausted: every
  // update of a round stays staged until the round commits, and a trainer may have an update of
  // every group waiting in its round, so one more trainer could stop the rounds for good.
  absl::Status CheckJoin(v1::Role role, size_t live_trainers) const override;
  void DescribeTo(v1::JoinReply& reply) const override;
  bool wants_layer_squares() const override { return false; }
  std::shared_ptr<FloatBufferPool> staging_buffers() const override { return nullptr; }
  // The shards checked the shapes of their parts: the update carries no layers here.
  absl::Status CheckShapes(const PendingUpdate&) const override { return absl::OkStatus(); }
  // Appends the COMMIT order of the next version (naming the layer group of the batch's updates
  // where they carry one); its updates' admissions end.
  absl::Status ApplyOuterStep(ApplyBatch& batch) override;
  absl::StatusOr<bool> Admit(const v1::PushHeader& header) override;
  // The only shard process of shard_processes 1 does not ask Admit (its slots bound what it
  // stages): its report admits the update.
  absl::StatusOr<uint32_t> StagePart(uint32_t part, const v1::PushHeader& header) override;
  uint32_t PartsOf(uint32_t group) const override;
  // Appends a DISCARD order of the update (and ends its admission).
  void Discard(uint64_t worker, uint64_t update_id) override;
  void DropUnsubmitted(uint64_t worker) override;
  // With the penalty on, a FORGET order: the shard processes hold its statistics.
  void ForgetWorker(uint64_t worker) override;
  // The shard processes checkpoint their own layers (aloe.v1.ShardCheckpoint): only the layer
  // groups' versions (with groups) are added.
  void SaveTo(v1::ServerCheckpoint& checkpoint) const override;
  // A checkpoint that holds parameters (a single-process server's) is kFailedPrecondition, one
  // whose layer group versions do not fit the groups kInvalidArgument (state unchanged). The
  // log starts again at the checkpoint's version.
  absl::Status RestoreFrom(const v1::ServerCheckpoint& checkpoint) override;
  // They are small, and a restarted shard can only go back to a version that the coordinator
  // checkpointed too.
  bool keeps_every_checkpoint() const override { return true; }

  // Every shard process has an address.
  bool ready() const;
  size_t admitted_updates() const { return admitted_.size(); }
  // The order log since the version the coordinator started (or was restored) at, less what
  // TrimOrdersBefore dropped: orders()[i] is the order at absolute index first_order_index() + i
  // (absolute indices count from the start or restore and never shift).
  const std::vector<v1::ShardOrder>& orders() const { return orders_; }
  uint64_t first_order_index() const { return orders_first_index_; }
  // Where a shard at `shard_version` continues: the absolute index just after that version's
  // COMMIT. nullopt when the log cannot bring it to the current version (outside the log).
  std::optional<uint64_t> OrderIndexAfter(uint64_t shard_version) const;
  // Drops the orders before absolute index `index` (every shard process has received them), so
  // the log does not grow with the run. Drops only in batches of at least kOrderTrimBatch orders
  // (a vector erase is linear). A shard asking to follow from a version before the trimmed part
  // makes the processes reassemble.
  void TrimOrdersBefore(uint64_t index);
  static constexpr uint64_t kOrderTrimBatch = 1024;

 private:
  // The shards that staged their part of one worker's update so far.
  struct Parts {
    uint64_t update_id = 0;
    uint64_t task_id = 0;
    std::vector<bool> received;
    uint32_t count = 0;
  };

  // Tells the shards to drop the parts of `worker`'s update staged so far (if any).
  void DiscardParts(uint64_t worker);
  // Ends the admission of the updates of `worker` that did not reach every shard.
  void ReleaseUnsubmitted(uint64_t worker);

  const uint32_t shard_processes_;
  const uint32_t max_staged_;
  const bool sync_;
  const bool penalty_;
  const double lease_seconds_;
  uint64_t commit_version_ = 0;       // the version of the last COMMIT order
  uint64_t orders_base_version_ = 0;  // the version before orders_[0]
  uint64_t orders_first_index_ = 0;   // the absolute index of orders_[0]
  std::vector<v1::ShardOrder> orders_;
  // Layer groups: the shard processes that own a layer of each group (one entry, every shard
  // process, without groups), and each group's version.
  std::vector<std::vector<bool>> group_parts_;
  std::vector<uint64_t> group_versions_;
  std::vector<std::string> shard_addresses_;
  std::vector<std::string> shard_push_addresses_;  // parallel to shard_addresses_
  std::map<uint64_t, Parts> parts_;                // by worker
  // Admitted updates (worker_id, update_id) -> submitted (every shard staged its part).
  std::map<std::pair<uint64_t, uint64_t>, bool> admitted_;
};

}  // namespace aloe::server
