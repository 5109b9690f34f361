#include "server/core/parameter_store.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace aloe::server {

absl::StatusOr<std::unique_ptr<ParameterStore>> ParameterStore::Create(
    v1::ModelSpec spec, std::vector<std::vector<float>> initial,
    const v1::OuterOptimizerConfig& optimizer, Executor& executor,
    std::vector<uint32_t> layer_groups, uint32_t num_layer_groups) {
  if (initial.size() != static_cast<size_t>(spec.layers_size())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("initial parameters have %d layers, the model spec %d", initial.size(),
                        spec.layers_size()));
  }
  // The spec's shard field names each layer's apply group here.
  const uint32_t num_groups = std::max<uint32_t>(1, spec.num_shards());
  std::unique_ptr<ParameterStore> store(new ParameterStore(std::move(spec), executor));
  store->group_layers_.resize(num_groups);
  for (int i = 0; i < store->spec_.layers_size(); ++i) {
    const v1::LayerSpec& layer = store->spec_.layers(i);
    if (layer.id() != static_cast<uint32_t>(i)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("model spec layer %d has id %d", i, layer.id()));
    }
    if (initial[i].size() != layer.num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("initial parameters of layer %d (%s): %d elements, expected %d", i,
                          layer.name(), initial[i].size(), layer.num_elements()));
    }
    if (layer.shard() >= num_groups) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d assigned to apply group %d of %d",
                                                        i, layer.shard(), num_groups));
    }
    store->group_layers_[layer.shard()].push_back(i);
    ALOE_ASSIGN_OR_RETURN(auto opt, MakeOuterOptimizer(optimizer, layer.num_elements()));
    store->optimizers_.push_back(std::move(opt));
    store->layers_.push_back(std::make_shared<std::vector<float>>(std::move(initial[i])));
    store->scratch_.emplace_back();  // allocated at the layer's first aggregated step
  }
  if (layer_groups.empty()) layer_groups.assign(store->layers_.size(), 0);
  if (layer_groups.size() != store->layers_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat("%d layer groups given for %d layers",
                                                      layer_groups.size(), store->layers_.size()));
  }
  if (num_layer_groups == 0) {
    num_layer_groups = store->layers_.empty()
                           ? 1
                           : *std::max_element(layer_groups.begin(), layer_groups.end()) + 1;
    std::vector<bool> used(num_layer_groups, false);
    for (uint32_t g : layer_groups) used[g] = true;
    if (std::find(used.begin(), used.end(), false) != used.end()) {
      return absl::InvalidArgumentError("layer groups must be numbered from 0 without gaps");
    }
  } else if (std::any_of(layer_groups.begin(), layer_groups.end(),
                         [&](uint32_t g) { return g >= num_layer_groups; })) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a layer is in a layer group past the %d groups", num_layer_groups));
  }
  store->layer_group_ = std::move(layer_groups);
  store->group_versions_.assign(num_layer_groups, 0);
  size_t bytes = 0;
  for (const auto& layer : store->layers_) bytes += layer->size() * sizeof(float);
  store->buffers_ = FloatBufferPool::Create(bytes);
  return store;
}

ModelSnapshot ParameterStore::Snapshot() const {
  ModelSnapshot snapshot;
  snapshot.version = version_;
  snapshot.layers.assign(layers_.begin(), layers_.end());
  snapshot.group_versions = group_versions_;
  return snapshot;
}

absl::Status ParameterStore::CheckShapes(const PendingUpdate& update) const {
  if (update.layers.size() != layers_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat("update has %d layers, the model has %d",
                                                      update.layers.size(), layers_.size()));
  }
  if (update.by_group && update.group >= num_layer_groups()) {
    return absl::InvalidArgumentError(absl::StrFormat("update of layer group %d, the model has %d",
                                                      update.group, num_layer_groups()));
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    const size_t expected =
        !update.by_group || layer_group_[i] == update.group ? layers_[i]->size() : 0;
    if (update.layers[i].size() != expected) {
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %d (%s): update has %d elements, expected %d", i,
                          spec_.layers(i).name(), update.layers[i].size(), expected));
    }
  }
  return absl::OkStatus();
}

absl::Status ParameterStore::ApplyOuterStep(const std::vector<const PendingUpdate*>& updates,
                                            const std::vector<float>& weights) {
  if (updates.size() != weights.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outer step needs one weight per update (got %d updates, %d weights)",
                        updates.size(), weights.size()));
  }
  FixedWeightsAggregation aggregation(weights);
  return ApplyOuterStep(updates, aggregation);
}

absl::Status ParameterStore::ApplyOuterStep(const std::vector<const PendingUpdate*>& updates,
                                            LayerAggregation& aggregation) {
  if (updates.empty()) {
    return absl::InvalidArgumentError("outer step needs >= 1 update");
  }
  for (const PendingUpdate* u : updates) ALOE_RETURN_IF_ERROR(CheckShapes(*u));
  const std::optional<uint32_t> layer_group =
      updates[0]->by_group ? std::optional<uint32_t>(updates[0]->group) : std::nullopt;
  for (const PendingUpdate* u : updates) {
    if ((u->by_group ? std::optional<uint32_t>(u->group) : std::nullopt) != layer_group) {
      return absl::InvalidArgumentError("an outer step's updates must be of one layer group");
    }
  }

  std::vector<absl::Status> group_status(group_layers_.size());
  executor_.ParallelFor(static_cast<int>(group_layers_.size()), [&](int group) {
    for (size_t layer : group_layers_[group]) {
      if (layer_group && layer_group_[layer] != *layer_group) continue;
      absl::Status s = ApplyLayer(layer, updates, aggregation);
      if (!s.ok()) {
        group_status[group] = s;
        return;
      }
    }
  });
  // Shapes were checked above, so an aggregation or optimizer error here is an invariant
  // violation.
  for (const absl::Status& s : group_status) ALOE_RETURN_IF_ERROR(s);
  ++version_;
  if (layer_group) {
    ++group_versions_[*layer_group];
  } else {
    for (uint64_t& v : group_versions_) ++v;
  }
  return absl::OkStatus();
}

absl::Status ParameterStore::CountEmptyGroupStep(uint32_t group) {
  if (group >= num_layer_groups()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("step of layer group %d, the model has %d", group, num_layer_groups()));
  }
  if (std::find(layer_group_.begin(), layer_group_.end(), group) != layer_group_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer group %d holds layers here: its step needs updates", group));
  }
  ++version_;
  ++group_versions_[group];
  return absl::OkStatus();
}

absl::Status ParameterStore::ApplyLayer(size_t layer,
                                        const std::vector<const PendingUpdate*>& updates,
                                        LayerAggregation& aggregation) {
  // A lone update of weight 1 is applied from its own buffer, without the copy into scratch.
  const std::vector<float>* passthrough = aggregation.Passthrough(layer, updates);
  std::vector<float>& scratch = scratch_[layer];
  if (passthrough == nullptr && scratch.size() != layers_[layer]->size()) {
    scratch.assign(layers_[layer]->size(), 0.0f);
  }
  const std::vector<float>& g = passthrough != nullptr ? *passthrough : scratch;
  if (passthrough == nullptr) {
    ALOE_ASSIGN_OR_RETURN(const LayerStep step,
                          aggregation.Aggregate(layer, updates, absl::MakeSpan(scratch)));
    if (step == LayerStep::kSkip) return absl::OkStatus();  // rollback: theta_{t+1} = theta_t
  }
  std::shared_ptr<std::vector<float>>& current = layers_[layer];
  ++layer_steps_;
  if (current.use_count() == 1) {
    // Nobody is streaming this buffer: update in place.
    return optimizers_[layer]->Apply(g, *current, absl::MakeSpan(*current));
  }
  // Every element is written by the optimizer: a recycled buffer needs no zero-fill.
  ++copied_layer_steps_;
  std::shared_ptr<std::vector<float>> next = buffers_->MakeShared(g.size());
  ALOE_RETURN_IF_ERROR(optimizers_[layer]->Apply(g, *current, absl::MakeSpan(*next)));
  current = std::move(next);
  return absl::OkStatus();
}

size_t ParameterStore::scratch_bytes() const {
  size_t bytes = 0;
  for (const std::vector<float>& scratch : scratch_) bytes += scratch.size() * sizeof(float);
  return bytes;
}

void ParameterStore::SaveOptimizerState(size_t layer, std::string* out) const {
  optimizers_[layer]->SaveState(out);
}

absl::Status ParameterStore::Restore(uint64_t version,
                                     const std::vector<std::vector<float>>& params,
                                     const std::vector<std::string>& optimizer_states,
                                     const std::vector<uint64_t>& group_versions) {
  if (params.size() != layers_.size() || optimizer_states.size() != layers_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "checkpoint has %d layers of parameters and %d optimizer states, the model %d layers",
        params.size(), optimizer_states.size(), layers_.size()));
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (params[i].size() != layers_[i]->size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("checkpoint layer %d (%s): %d parameters, expected %d", i,
                          spec_.layers(i).name(), params[i].size(), layers_[i]->size()));
    }
  }
  if (!group_versions.empty() && group_versions.size() != group_versions_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("checkpoint has %d layer group versions, the model %d layer groups",
                        group_versions.size(), group_versions_.size()));
  }
  // Optimizer states are restored into fresh instances first, so a bad blob changes nothing.
  std::vector<std::string> old_states(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) optimizers_[i]->SaveState(&old_states[i]);
  for (size_t i = 0; i < layers_.size(); ++i) {
    absl::Status s = optimizers_[i]->LoadState(optimizer_states[i]);
    if (!s.ok()) {
      for (size_t j = 0; j < i; ++j) (void)optimizers_[j]->LoadState(old_states[j]);
      return absl::InvalidArgumentError(
          absl::StrFormat("checkpoint optimizer state of layer %d (%s): %s", i,
                          spec_.layers(i).name(), s.message()));
    }
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    layers_[i] = std::make_shared<std::vector<float>>(params[i]);
  }
  version_ = version;
  if (group_versions.empty()) {
    group_versions_.assign(group_versions_.size(), version);
  } else {
    group_versions_ = group_versions;
  }
  return absl::OkStatus();
}

}  // namespace aloe::server
