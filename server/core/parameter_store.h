// The global model, held as one flat float32 buffer per layer, layers grouped into apply groups
// (LayerSpec.shard, ModelSpec.num_shards) whose outer steps run in parallel. Each layer has its
// own outer optimizer (and its state).
//
// Readers (Pull) take a ModelSnapshot: shared pointers to immutable layer buffers of one version,
// so a pull streams without locks while the next outer step writes fresh buffers (copy on write;
// a buffer nobody else holds is updated in place).
//
// Each outer step asks a LayerAggregation (server/core/layer_aggregation.h) for every layer's
// pseudo-gradient: fixed weights (the plain mean of sync DiLoCo) or the EDiT penalty, which may
// also skip a layer (rollback).
//
// Layer groups (partial synchronization, ServerConfig.partial_sync) are the unit of
// synchronization, distinct from apply groups: an outer step may cover one layer group only
// (its updates then carry only that group's layers). The store counts steps of any group as its
// version and each group's own steps as that group's version.
//
// Not thread-safe: the owner serialises calls. ApplyOuterStep itself fans out over the apply
// groups through the Executor.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/buffer_pool.h"
#include "common/executor.h"
#include "proto/aloe.pb.h"
#include "server/core/layer_aggregation.h"
#include "server/core/outer_optimizer.h"
#include "server/core/update.h"

namespace aloe::server {

struct ModelSnapshot {
  uint64_t version = 0;
  std::vector<std::shared_ptr<const std::vector<float>>> layers;
  // The version of each layer group (partial synchronization) within `version`; one entry,
  // equal to `version`, without groups. Empty where the parameters live elsewhere.
  std::vector<uint64_t> group_versions;
};

class ParameterStore {
 public:
  // initial: one buffer per spec layer with exactly its num_elements; each layer's `shard` names
  // its apply group, < max(spec.num_shards, 1). kInvalidArgument for a size mismatch, a layer
  // outside the apply groups or an invalid optimizer config. `executor` must outlive the store.
  // layer_groups: the layer group of each layer (empty = one group); with num_layer_groups 0,
  // groups numbered from 0 without gaps. num_layer_groups > 0 names the count, and a group may
  // then hold no layer here (a shard process's part of the model): its steps only count.
  // kInvalidArgument for a layer group list that does not fit.
  static absl::StatusOr<std::unique_ptr<ParameterStore>> Create(
      v1::ModelSpec spec, std::vector<std::vector<float>> initial,
      const v1::OuterOptimizerConfig& optimizer, Executor& executor,
      std::vector<uint32_t> layer_groups = {}, uint32_t num_layer_groups = 0);

  const v1::ModelSpec& spec() const { return spec_; }
  uint64_t version() const { return version_; }
  uint32_t num_layer_groups() const { return static_cast<uint32_t>(group_versions_.size()); }
  uint64_t group_version(uint32_t group) const { return group_versions_[group]; }
  ModelSnapshot Snapshot() const;

  // Checks that every update has one buffer per layer of the right size (for an update of one
  // layer group: the group's layers, every other layer empty). kInvalidArgument naming the layer
  // otherwise.
  absl::Status CheckShapes(const PendingUpdate& update) const;

  // One outer step: for every layer (in parallel over the apply groups) `aggregation` combines the
  // updates' pseudo-gradients of that layer into g, and the layer's optimizer applies g, unless
  // the aggregation answers LayerStep::kSkip, in which case the layer's parameters and optimizer
  // state stay as they are (EDiT rollback). Advances the version by one (also when every layer
  // is skipped: the step was taken, it changed nothing). kInvalidArgument for no updates or an
  // update of the wrong shape, checked before anything changes (all-or-nothing on bad input).
  // Updates of one layer group (PendingUpdate.group, all the same) step only that group's
  // layers and advance its version; whole-model updates advance every group's.
  absl::Status ApplyOuterStep(const std::vector<const PendingUpdate*>& updates,
                              LayerAggregation& aggregation);

  // An outer step of layer group `group` where it holds no layer (a shard process that owns none
  // of the group's layers): advances the version and the group's, nothing else changes.
  // kInvalidArgument for a group past num_layer_groups() or one that holds a layer here.
  absl::Status CountEmptyGroupStep(uint32_t group);

  // The same with g = sum_i weights[i] * g_i for every layer (FixedWeightsAggregation).
  // kInvalidArgument unless there is one weight per update.
  absl::Status ApplyOuterStep(const std::vector<const PendingUpdate*>& updates,
                              const std::vector<float>& weights);

  // Bytes of the per-layer buffers that aggregate several updates (or one of weight != 1) into
  // one g. A layer gets its buffer at its first such step: a server whose steps all apply a lone
  // update of weight 1 (plain async) from the update's own buffer never holds one, which leaves
  // a copy of the model's size for a retained version. Not synchronised with ApplyOuterStep.
  size_t scratch_bytes() const;

  // Layer updates of the outer steps so far (skipped layers not counted), and how many of them
  // wrote a fresh buffer because a snapshot (an older version held for tasks, or a pull under
  // way) still used the layer's buffer; the rest updated it in place. Not synchronised with
  // ApplyOuterStep.
  uint64_t layer_steps() const { return layer_steps_.load(); }
  uint64_t copied_layer_steps() const { return copied_layer_steps_.load(); }

  // Appends layer `layer`'s optimizer state blob to out (checkpoints).
  void SaveOptimizerState(size_t layer, std::string* out) const;

  // Replaces the parameters, optimizer states and versions (resume from a checkpoint);
  // group_versions empty = every group at `version` (one group). All or nothing:
  // kInvalidArgument naming the layer when a size or blob does not fit, state unchanged.
  absl::Status Restore(uint64_t version, const std::vector<std::vector<float>>& params,
                       const std::vector<std::string>& optimizer_states,
                       const std::vector<uint64_t>& group_versions = {});

 private:
  ParameterStore(v1::ModelSpec spec, Executor& executor)
      : spec_(std::move(spec)), executor_(executor) {}
  absl::Status ApplyLayer(size_t layer, const std::vector<const PendingUpdate*>& updates,
                          LayerAggregation& aggregation);

  v1::ModelSpec spec_;
  Executor& executor_;
  uint64_t version_ = 0;
  std::vector<uint32_t> layer_group_;     // layer group of each layer
  std::vector<uint64_t> group_versions_;  // steps of each layer group
  // Mutable here; handed out only as shared_ptr<const ...> in snapshots.
  std::vector<std::shared_ptr<std::vector<float>>> layers_;
  std::vector<std::unique_ptr<OuterOptimizer>> optimizers_;  // one per layer
  std::vector<std::vector<float>> scratch_;  // aggregated g per layer, reused; empty until used
  std::vector<std::vector<size_t>> group_layers_;  // layer ids of each apply group
  // Copy-on-write targets: the buffers of versions nobody reads any more, reused unzeroed (at
  // most one model's worth idle).
  std::shared_ptr<FloatBufferPool> buffers_;
  std::atomic<uint64_t> layer_steps_{0};  // updated from the executor's threads
  std::atomic<uint64_t> copied_layer_steps_{0};
};

}  // namespace aloe::server
