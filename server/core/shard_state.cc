#include "server/core/shard_state.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "kernels/cpu/outer_kernels.h"

namespace aloe::server {

absl::StatusOr<std::unique_ptr<ShardState>> ShardState::Create(
    v1::ModelSpec spec, uint32_t shard_index, std::vector<std::vector<float>> initial,
    const v1::OuterOptimizerConfig& optimizer, uint32_t apply_groups, uint32_t max_staged,
    Executor& executor, std::vector<uint32_t> layer_groups) {
  const uint32_t processes = spec.num_shards();
  if (shard_index >= processes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard index %d is out of range: the model spec has %d shard processes",
                        shard_index, processes));
  }
  if (max_staged == 0) {
    return absl::InvalidArgumentError("max_staged_updates must be > 0");
  }
  if (initial.size() != static_cast<size_t>(spec.layers_size())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("initial parameters have %d layers, the model spec %d", initial.size(),
                        spec.layers_size()));
  }
  // The owned layers become a model of their own, ids 0..owned-1, so that ParameterStore (and
  // its per-layer optimizers, snapshots and checkpoint restore) serves them unchanged.
  v1::ModelSpec local_spec;
  std::vector<uint32_t> owned;
  std::vector<int> local_of_global(spec.layers_size(), -1);
  std::vector<std::vector<float>> local_initial;
  for (int i = 0; i < spec.layers_size(); ++i) {
    const v1::LayerSpec& layer = spec.layers(i);
    if (layer.id() != static_cast<uint32_t>(i)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("model spec layer %d has id %d", i, layer.id()));
    }
    if (layer.shard() >= processes) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d (%s) assigned to shard %d of %d",
                                                        i, layer.name(), layer.shard(), processes));
    }
    if (layer.shard() != shard_index) continue;
    if (initial[i].size() != layer.num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("initial parameters of layer %d (%s): %d elements, expected %d", i,
                          layer.name(), initial[i].size(), layer.num_elements()));
    }
    local_of_global[i] = static_cast<int>(owned.size());
    v1::LayerSpec* local = local_spec.add_layers();
    *local = layer;
    local->set_id(static_cast<uint32_t>(owned.size()));
    owned.push_back(static_cast<uint32_t>(i));
    local_initial.push_back(std::move(initial[i]));
  }
  if (owned.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard %d of %d owns no layer: more shard processes than layers (%d)",
                        shard_index, processes, spec.layers_size()));
  }
  uint32_t num_layer_groups = 1;
  std::vector<uint32_t> local_groups;
  if (!layer_groups.empty()) {
    if (layer_groups.size() != static_cast<size_t>(spec.layers_size())) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%d layer groups given for a model of %d layers", layer_groups.size(),
                          spec.layers_size()));
    }
    num_layer_groups = *std::max_element(layer_groups.begin(), layer_groups.end()) + 1;
    for (uint32_t g : owned) local_groups.push_back(layer_groups[g]);
  }
  // More groups than layers would only add idle work items to every step. In the local spec,
  // LayerSpec.shard names a layer's apply group, not a shard process.
  const uint32_t groups =
      std::clamp<uint32_t>(apply_groups, 1, static_cast<uint32_t>(owned.size()));
  AssignShards(groups, &local_spec);
  ALOE_ASSIGN_OR_RETURN(
      std::unique_ptr<ParameterStore> store,
      ParameterStore::Create(std::move(local_spec), std::move(local_initial), optimizer, executor,
                             std::move(local_groups), num_layer_groups));
  return std::unique_ptr<ShardState>(new ShardState(std::move(spec), shard_index, max_staged,
                                                    std::move(owned), std::move(local_of_global),
                                                    std::move(layer_groups), std::move(store)));
}

ShardState::ShardState(v1::ModelSpec spec, uint32_t shard_index, uint32_t max_staged,
                       std::vector<uint32_t> owned, std::vector<int> local_of_global,
                       std::vector<uint32_t> layer_groups, std::unique_ptr<ParameterStore> store)
    : spec_(std::move(spec)),
      shard_index_(shard_index),
      max_staged_(max_staged),
      owned_(std::move(owned)),
      local_of_global_(std::move(local_of_global)),
      layer_groups_(std::move(layer_groups)),
      store_(std::move(store)) {
  size_t bytes = 0;
  for (uint32_t g : owned_)
    bytes += spec_.layers(static_cast<int>(g)).num_elements() * sizeof(float);
  // Idle buffers for every staging slot: under load the slots empty and fill without end, and a
  // buffer freed at a commit is taken again by the next push (a fresh one would cost a zero-fill
  // of its bytes). No more memory at the peak than the slots themselves (Take reuses first).
  staging_buffers_ = FloatBufferPool::Create(std::max<size_t>(max_staged_, 2) * bytes);
}

absl::Status ShardState::CheckPart(const PendingUpdate& part) const {
  if (part.layers.size() != static_cast<size_t>(spec_.layers_size())) {
    return absl::InvalidArgumentError(absl::StrFormat("update has %d layers, the model has %d",
                                                      part.layers.size(), spec_.layers_size()));
  }
  if (part.slices == 0 || part.slices > kMaxSlices || part.slice >= part.slices) {
    return absl::InvalidArgumentError(absl::StrFormat("update %d has slice %d of %d slices",
                                                      part.update_id, part.slice, part.slices));
  }
  if (!layer_groups_.empty()) {
    if (part.group >= num_layer_groups() || !OwnsLayerOf(part.group)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "update %d of worker %d is of layer group %d, of which shard %d owns no layer (the "
          "model has %d groups)",
          part.update_id, part.worker_id, part.group, shard_index_, num_layer_groups()));
    }
    if (part.slices > 1) {
      return absl::InvalidArgumentError("sliced pushes of layer groups are not supported");
    }
  }
  for (size_t l = 0; l < part.layers.size(); ++l) {
    const v1::LayerSpec& layer = spec_.layers(static_cast<int>(l));
    if (!layer_groups_.empty() && layer_groups_[l] != part.group) {
      if (!part.layers[l].empty()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "layer %d (%s) is in layer group %d, not in group %d: %d elements pushed", l,
            layer.name(), layer_groups_[l], part.group, part.layers[l].size()));
      }
      continue;
    }
    if (local_of_global_[l] < 0) {
      if (!part.layers[l].empty()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "layer %d (%s) belongs to shard %d, not to shard %d: %d elements pushed here", l,
            layer.name(), layer.shard(), shard_index_, part.layers[l].size()));
      }
    } else if (part.layers[l].size() != layer.num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %d (%s): update has %d elements, expected %d", l, layer.name(),
                          part.layers[l].size(), layer.num_elements()));
    }
  }
  return absl::OkStatus();
}

bool ShardState::OwnsLayerOf(uint32_t group) const {
  if (layer_groups_.empty()) return group == 0;
  for (uint32_t g : owned_) {
    if (layer_groups_[g] == group) return true;
  }
  return false;
}

absl::StatusOr<StageResult> ShardState::Stage(PendingUpdate part) {
  // With layer groups every push carries one group (as on a single-process server).
  part.by_group = !layer_groups_.empty();
  ALOE_RETURN_IF_ERROR(CheckPart(part));
  const UpdateKey key(part.worker_id, part.update_id);
  auto it = staged_.find(key);
  if (it == staged_.end()) {
    if (!HasRoom(key.first, key.second)) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("staging full: %d of %d updates staged", staged_.size(), max_staged_));
    }
    // The first part's buffers become the merged update (later slices are copied into them).
    StagedUpdate staged;
    staged.received.assign(part.slices, false);
    staged.received[part.slice] = true;
    staged.count = 1;
    std::vector<std::vector<float>> local;
    local.reserve(owned_.size());
    for (uint32_t g : owned_) local.push_back(std::move(part.layers[g]));
    staged.merged = std::move(part);
    staged.merged.layers = std::move(local);
    it = staged_.emplace(key, std::move(staged)).first;
    return StageResult{it->second.complete(), it->second.count};
  }

  StagedUpdate& staged = it->second;
  const PendingUpdate& first = staged.merged;
  // One update id names one update: a part that disagrees with what is staged under it is a
  // protocol error, not a newer update (which would carry a new id).
  if (part.task_id != first.task_id || part.steps_done != first.steps_done ||
      part.tokens_learned != first.tokens_learned || part.slices != first.slices) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "part of update %d of worker %d (slice %d of %d: task %d, %d steps, %d tokens) disagrees "
        "with its staged parts (%d slices: task %d, %d steps, %d tokens)",
        part.update_id, part.worker_id, part.slice, part.slices, part.task_id, part.steps_done,
        part.tokens_learned, first.slices, first.task_id, first.steps_done, first.tokens_learned));
  }
  // Copy this slice in (again, for a retry: the newer copy wins, which changes nothing when the
  // retry carries the same bytes).
  for (size_t local = 0; local < owned_.size(); ++local) {
    std::vector<float>& src = part.layers[owned_[local]];
    std::vector<float>& dst = staged.merged.layers[local];
    if (part.slices == 1) {
      staging_buffers_->Give(std::exchange(dst, std::move(src)));
      continue;
    }
    const auto [begin, end] = SliceRange(src.size(), part.slices, part.slice);
    std::copy(src.begin() + begin, src.begin() + end, dst.begin() + begin);
  }
  if (!staged.received[part.slice]) {
    staged.received[part.slice] = true;
    ++staged.count;
  }
  return StageResult{staged.complete(), staged.count};
}

bool ShardState::HasRoom(uint64_t worker_id, uint64_t update_id) const {
  return staged_.count(UpdateKey(worker_id, update_id)) > 0 || staged_.size() < max_staged_;
}

bool ShardState::IsStaged(uint64_t worker_id, uint64_t update_id) const {
  auto it = staged_.find(UpdateKey(worker_id, update_id));
  return it != staged_.end() && it->second.complete();
}

void ShardState::Discard(uint64_t worker_id, uint64_t update_id) {
  auto it = staged_.find(UpdateKey(worker_id, update_id));
  if (it == staged_.end()) return;
  for (std::vector<float>& layer : it->second.merged.layers)
    staging_buffers_->Give(std::move(layer));
  staged_.erase(it);
}

uint64_t ShardState::staged_bytes() const {
  uint64_t bytes = 0;
  for (const auto& [key, staged] : staged_) {
    for (const std::vector<float>& layer : staged.merged.layers) {
      bytes += layer.size() * sizeof(float);
    }
  }
  return bytes;
}

absl::Status ShardState::Apply(const v1::ShardOrder& order) {
  switch (order.kind()) {
    case v1::ShardOrder::COMMIT:
      return Commit(order);
    case v1::ShardOrder::DISCARD:
      for (const v1::CommitEntry& e : order.entries()) Discard(e.worker_id(), e.update_id());
      return absl::OkStatus();
    case v1::ShardOrder::FORGET:
      if (penalty_ != nullptr) {
        for (const v1::CommitEntry& e : order.entries()) penalty_->ForgetStream(e.worker_id());
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrFormat("shard order %s is not applied here",
                                                        v1::ShardOrder::Kind_Name(order.kind())));
  }
}

absl::Status ShardState::Commit(const v1::ShardOrder& order) {
  const uint64_t old_version = version();
  if (order.version() != old_version + 1) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "commit of version %d on a shard at version %d", order.version(), old_version));
  }
  if (order.entries().empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("commit of version %d has no updates", order.version()));
  }
  if (order.by_group() != !layer_groups_.empty() ||
      (order.by_group() && order.layer_group() >= num_layer_groups())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "commit of version %d %s, but the model has %d layer groups", order.version(),
        order.by_group() ? absl::StrFormat("is of layer group %d", order.layer_group())
                         : std::string("names no layer group"),
        num_layer_groups()));
  }
  // A group's updates go only to the shards that own its layers: elsewhere the commit only
  // counts (nothing is staged for it).
  const bool counts_only = order.by_group() && !OwnsLayerOf(order.layer_group());
  std::vector<PendingUpdate*> updates;
  std::vector<float> weights;
  std::set<UpdateKey> seen;
  for (const v1::CommitEntry& e : order.entries()) {
    const UpdateKey key(e.worker_id(), e.update_id());
    if (!seen.insert(key).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("commit of version %d names update %d of worker %d twice",
                          order.version(), e.update_id(), e.worker_id()));
    }
    if (!std::isfinite(e.weight()) ||
        (penalty_ != nullptr && !(e.discount() > 0 && e.discount() <= 1))) {
      return absl::InvalidArgumentError(
          absl::StrFormat("commit of version %d: update %d of worker %d has weight %f, discount %f",
                          order.version(), e.update_id(), e.worker_id(), e.weight(), e.discount()));
    }
    if (counts_only) continue;
    auto it = staged_.find(key);
    if (it == staged_.end() || !it->second.complete()) {
      return absl::FailedPreconditionError(
          absl::StrFormat("commit of version %d: update %d of worker %d is %s on shard %d",
                          order.version(), e.update_id(), e.worker_id(),
                          it == staged_.end() ? "not staged" : "incomplete", shard_index_));
    }
    if (order.by_group() && it->second.merged.group != order.layer_group()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "commit of version %d is of layer group %d, but update %d of worker %d is of group %d",
          order.version(), order.layer_group(), e.update_id(), e.worker_id(),
          it->second.merged.group));
    }
    updates.push_back(&it->second.merged);
    weights.push_back(e.weight());
  }

  // Holding the old snapshot makes the step write fresh buffers (copy on write) instead of
  // updating in place: that copy is the whole cost of keeping a version for pulls.
  std::optional<ModelSnapshot> keep;
  const auto& keep_versions = order.keep_versions();
  if (std::find(keep_versions.begin(), keep_versions.end(), old_version) != keep_versions.end()) {
    keep = store_->Snapshot();
  }
  if (counts_only) {
    ALOE_RETURN_IF_ERROR(store_->CountEmptyGroupStep(order.layer_group()));
    RetainFor(order, std::move(keep));
    return absl::OkStatus();
  }
  // Staged updates were checked against the spec when staged, so a failure here is an invariant
  // violation.
  const std::vector<const PendingUpdate*> inputs(updates.begin(), updates.end());
  if (commit_observer_) commit_observer_(owned_, inputs);
  if (penalty_ != nullptr) {
    // As a single process: the discount scales the update (the staged copy, which this step
    // consumes), and the penalty's per-layer weights replace the entries' (paper 000 Alg. 2).
    for (int i = 0; i < order.entries_size(); ++i) {
      const float discount = order.entries(i).discount();
      if (discount == 1.0f) continue;
      for (std::vector<float>& layer : updates[i]->layers) {
        kernels::Scale(layer.data(), layer.size(), discount);
      }
    }
    PenaltyAggregation aggregation(*penalty_);
    ALOE_RETURN_IF_ERROR(store_->ApplyOuterStep(inputs, aggregation));
    penalty_reports_ = aggregation.reports();
  } else {
    ALOE_RETURN_IF_ERROR(store_->ApplyOuterStep(inputs, weights));
  }
  for (const v1::CommitEntry& e : order.entries()) Discard(e.worker_id(), e.update_id());
  RetainFor(order, std::move(keep));
  return absl::OkStatus();
}

void ShardState::RetainFor(const v1::ShardOrder& order, std::optional<ModelSnapshot> old) {
  if (old.has_value()) retained_[old->version] = *std::move(old);
  const auto& keep_versions = order.keep_versions();
  for (auto it = retained_.begin(); it != retained_.end();) {
    if (std::find(keep_versions.begin(), keep_versions.end(), it->first) == keep_versions.end()) {
      it = retained_.erase(it);
    } else {
      ++it;
    }
  }
}

ModelSnapshot ShardState::Globalize(const ModelSnapshot& local) const {
  ModelSnapshot global;
  global.version = local.version;
  global.group_versions = local.group_versions;
  global.layers.resize(spec_.layers_size());
  for (size_t i = 0; i < owned_.size(); ++i) global.layers[owned_[i]] = local.layers[i];
  return global;
}

absl::StatusOr<ModelSnapshot> ShardState::SnapshotAt(uint64_t v) const {
  if (v == version()) return Globalize(store_->Snapshot());
  if (v > version()) {
    return absl::UnavailableError(absl::StrFormat(
        "version %d is not committed yet on shard %d (at version %d)", v, shard_index_, version()));
  }
  auto it = retained_.find(v);
  if (it == retained_.end()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("version %d is no longer held by shard %d (at version %d; retained: [%s])",
                        v, shard_index_, version(), absl::StrJoin(retained_versions(), ", ")));
  }
  return Globalize(it->second);
}

std::vector<uint64_t> ShardState::retained_versions() const {
  std::vector<uint64_t> versions;
  versions.reserve(retained_.size());
  for (const auto& [v, snapshot] : retained_) versions.push_back(v);
  return versions;
}

v1::ShardCheckpoint ShardState::Capture(const std::string& fingerprint) const {
  v1::ShardCheckpoint c;
  c.set_format(1);
  c.set_fingerprint(fingerprint);
  c.set_shard_index(shard_index_);
  c.set_shard_processes(spec_.num_shards());
  c.set_version(version());
  const ModelSnapshot snapshot = store_->Snapshot();
  for (size_t i = 0; i < owned_.size(); ++i) {
    c.add_layer_ids(owned_[i]);
    AppendFloats(*snapshot.layers[i], c.add_layer_params());
    store_->SaveOptimizerState(i, c.add_optimizer_state());
  }
  if (penalty_ != nullptr) penalty_->SaveState(c.mutable_penalty_state());
  if (!layer_groups_.empty()) {
    for (uint64_t v : snapshot.group_versions) c.add_group_versions(v);
  }
  return c;
}

absl::Status ShardState::EnablePenalty(const v1::PenaltyConfig& config) {
  ALOE_ASSIGN_OR_RETURN(penalty_, PseudoGradientPenalty::Create(config, owned_.size()));
  return absl::OkStatus();
}

absl::Status ShardState::Restore(const v1::ShardCheckpoint& c, const std::string& fingerprint) {
  if (c.format() != 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard checkpoint format %d is unknown", c.format()));
  }
  if (c.fingerprint() != fingerprint) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "shard checkpoint is for another model or optimizer (%s) than this config (%s)",
        c.fingerprint(), fingerprint));
  }
  if (c.shard_index() != shard_index_ || c.shard_processes() != spec_.num_shards()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("shard checkpoint is of shard %d of %d processes, this is shard %d of %d",
                        c.shard_index(), c.shard_processes(), shard_index_, spec_.num_shards()));
  }
  if (!std::equal(c.layer_ids().begin(), c.layer_ids().end(), owned_.begin(), owned_.end())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard checkpoint holds layers [%s], shard %d owns [%s]",
        absl::StrJoin(c.layer_ids(), ", "), shard_index_, absl::StrJoin(owned_, ", ")));
  }
  if (c.layer_params_size() != c.layer_ids_size() ||
      c.optimizer_state_size() != c.layer_ids_size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard checkpoint has %d layers, %d parameter buffers and %d optimizer states",
        c.layer_ids_size(), c.layer_params_size(), c.optimizer_state_size()));
  }
  std::vector<std::vector<float>> params(owned_.size());
  for (size_t i = 0; i < owned_.size(); ++i) {
    const v1::LayerSpec& layer = spec_.layers(static_cast<int>(owned_[i]));
    const std::string& bytes = c.layer_params(static_cast<int>(i));
    if (bytes.size() != layer.num_elements() * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "shard checkpoint layer %d (%s): %d parameter bytes, expected %d", owned_[i],
          layer.name(), bytes.size(), layer.num_elements() * sizeof(float)));
    }
    params[i].resize(layer.num_elements());
    absl::Status s = DecodeFloats(bytes, absl::MakeSpan(params[i]));
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("shard checkpoint parameters of layer %d (%s): %s", owned_[i],
                          layer.name(), s.message()));
    }
  }
  std::vector<std::string> states(c.optimizer_state().begin(), c.optimizer_state().end());
  // All or nothing: the penalty first (LoadState changes nothing on error), put back when the
  // store refuses. A checkpoint without penalty state starts the statistics afresh.
  std::string old_penalty;
  if (penalty_ != nullptr) {
    penalty_->SaveState(&old_penalty);
    std::string blob = c.penalty_state();
    if (blob.empty()) {
      ALOE_ASSIGN_OR_RETURN(auto fresh,
                            PseudoGradientPenalty::Create(penalty_->config(), owned_.size()));
      fresh->SaveState(&blob);
    }
    if (absl::Status loaded = penalty_->LoadState(blob); !loaded.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "shard checkpoint penalty state of shard %d: %s", shard_index_, loaded.message()));
    }
  }
  // Its messages name the layer by its local index and its (global) name.
  const std::vector<uint64_t> group_versions(c.group_versions().begin(), c.group_versions().end());
  absl::Status restored = store_->Restore(c.version(), params, states, group_versions);
  if (!restored.ok()) {
    if (penalty_ != nullptr) (void)penalty_->LoadState(old_penalty);
    return absl::Status(restored.code(),
                        absl::StrFormat("shard %d: %s", shard_index_, restored.message()));
  }
  staged_.clear();
  retained_.clear();
  return absl::OkStatus();
}

}  // namespace aloe::server
