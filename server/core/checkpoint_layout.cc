#include "server/core/checkpoint_layout.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/core/pseudo_gradient_penalty.h"

namespace aloe::server {
namespace {

using ModuleStats = PseudoGradientPenalty::ModuleStats;

// The layer ids spec assigns to each of its spec.num_shards() processes, ascending.
absl::StatusOr<std::vector<std::vector<uint32_t>>> LayersOfShards(const v1::ModelSpec& spec) {
  if (spec.num_shards() == 0) {
    return absl::InvalidArgumentError("the model spec is not assigned to shard processes");
  }
  std::vector<std::vector<uint32_t>> layers(spec.num_shards());
  for (int l = 0; l < spec.layers_size(); ++l) {
    const v1::LayerSpec& layer = spec.layers(l);
    if (layer.id() != static_cast<uint32_t>(l) || layer.shard() >= spec.num_shards()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("model spec layer %d (%s) has id %d and shard %d of %d", l, layer.name(),
                          layer.id(), layer.shard(), spec.num_shards()));
    }
    layers[layer.shard()].push_back(static_cast<uint32_t>(l));
  }
  return layers;
}

absl::Status CheckParams(const v1::LayerSpec& layer, const std::string& bytes, const char* where) {
  if (bytes.size() != layer.num_elements() * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s layer %d (%s): %d parameter bytes, expected %d (%d float32 values)", where, layer.id(),
        layer.name(), bytes.size(), layer.num_elements() * sizeof(float), layer.num_elements()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ServerCheckpoint> JoinShardCheckpoints(const v1::ModelSpec& spec,
                                                          const ShardedCheckpoint& in) {
  ALOE_ASSIGN_OR_RETURN(const std::vector<std::vector<uint32_t>> layers_of, LayersOfShards(spec));
  const v1::ServerCheckpoint& coordinator = in.coordinator;
  if (coordinator.layer_params_size() > 0 || coordinator.optimizer_state_size() > 0 ||
      !coordinator.penalty_state().empty()) {
    return absl::InvalidArgumentError(
        "the coordinator's checkpoint holds layers: it was written by a one-process server");
  }
  if (in.shards.size() != layers_of.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d shard checkpoints for a model assigned to %d shard processes",
                        in.shards.size(), layers_of.size()));
  }
  const size_t num_layers = spec.layers_size();
  std::vector<const std::string*> params(num_layers);
  std::vector<const std::string*> states(num_layers);
  std::vector<ModuleStats> penalty(num_layers);
  bool any_penalty = false;
  for (size_t i = 0; i < in.shards.size(); ++i) {
    const v1::ShardCheckpoint& shard = in.shards[i];
    if (shard.shard_index() != i || shard.shard_processes() != layers_of.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "shard checkpoint %d says it is shard %d of %d processes, expected shard %d of %d", i,
          shard.shard_index(), shard.shard_processes(), i, layers_of.size()));
    }
    if (shard.version() != coordinator.version()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("shard %d's checkpoint is of version %d, the coordinator's of %d", i,
                          shard.version(), coordinator.version()));
    }
    if (!std::equal(shard.group_versions().begin(), shard.group_versions().end(),
                    coordinator.group_versions().begin(), coordinator.group_versions().end())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "shard %d's checkpoint has layer group versions [%s], the coordinator's [%s]", i,
          absl::StrJoin(shard.group_versions(), ", "),
          absl::StrJoin(coordinator.group_versions(), ", ")));
    }
    const std::vector<uint32_t>& owned = layers_of[i];
    if (!std::equal(shard.layer_ids().begin(), shard.layer_ids().end(), owned.begin(),
                    owned.end())) {
      return absl::InvalidArgumentError(
          absl::StrFormat("shard %d's checkpoint holds layers [%s], the model assigns it [%s]", i,
                          absl::StrJoin(shard.layer_ids(), ", "), absl::StrJoin(owned, ", ")));
    }
    if (shard.layer_params_size() != shard.layer_ids_size() ||
        shard.optimizer_state_size() != shard.layer_ids_size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "shard %d's checkpoint has %d layers, %d parameter buffers and %d optimizer states", i,
          shard.layer_ids_size(), shard.layer_params_size(), shard.optimizer_state_size()));
    }
    for (size_t k = 0; k < owned.size(); ++k) {
      const std::string& bytes = shard.layer_params(static_cast<int>(k));
      ALOE_RETURN_IF_ERROR(CheckParams(spec.layers(static_cast<int>(owned[k])), bytes,
                                       absl::StrFormat("shard %d's checkpoint", i).c_str()));
      params[owned[k]] = &bytes;
      states[owned[k]] = &shard.optimizer_state(static_cast<int>(k));
    }
    if (shard.penalty_state().empty()) continue;
    absl::StatusOr<std::vector<ModuleStats>> modules =
        PseudoGradientPenalty::ParseState(shard.penalty_state());
    if (!modules.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("shard %d's checkpoint: %s", i, modules.status().message()));
    }
    if (modules->size() != owned.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("shard %d's checkpoint has penalty statistics of %d layers, it owns %d",
                          i, modules->size(), owned.size()));
    }
    for (size_t k = 0; k < owned.size(); ++k) penalty[owned[k]] = std::move((*modules)[k]);
    any_penalty = true;
  }
  v1::ServerCheckpoint whole = coordinator;
  for (size_t l = 0; l < num_layers; ++l) {
    *whole.add_layer_params() = *params[l];
    *whole.add_optimizer_state() = *states[l];
  }
  if (any_penalty) PseudoGradientPenalty::WriteState(penalty, whole.mutable_penalty_state());
  return whole;
}

absl::StatusOr<ShardedCheckpoint> SplitCheckpoint(const v1::ModelSpec& spec,
                                                  const v1::ServerCheckpoint& whole) {
  ALOE_ASSIGN_OR_RETURN(const std::vector<std::vector<uint32_t>> layers_of, LayersOfShards(spec));
  if (whole.layer_params_size() != spec.layers_size() ||
      whole.optimizer_state_size() != spec.layers_size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the checkpoint has %d parameter buffers and %d optimizer states, the model %d layers%s",
        whole.layer_params_size(), whole.optimizer_state_size(), spec.layers_size(),
        whole.layer_params_size() == 0 ? " (a coordinator's checkpoint holds none)" : ""));
  }
  for (int l = 0; l < spec.layers_size(); ++l) {
    ALOE_RETURN_IF_ERROR(CheckParams(spec.layers(l), whole.layer_params(l), "the checkpoint's"));
  }
  std::vector<ModuleStats> penalty;
  if (!whole.penalty_state().empty()) {
    ALOE_ASSIGN_OR_RETURN(penalty, PseudoGradientPenalty::ParseState(whole.penalty_state()));
    if (penalty.size() != static_cast<size_t>(spec.layers_size())) {
      return absl::InvalidArgumentError(
          absl::StrFormat("the checkpoint has penalty statistics of %d layers, the model %d",
                          penalty.size(), spec.layers_size()));
    }
  }
  ShardedCheckpoint out;
  out.coordinator = whole;
  out.coordinator.clear_layer_params();
  out.coordinator.clear_optimizer_state();
  out.coordinator.clear_penalty_state();
  for (size_t i = 0; i < layers_of.size(); ++i) {
    v1::ShardCheckpoint& shard = out.shards.emplace_back();
    shard.set_format(1);
    shard.set_shard_index(static_cast<uint32_t>(i));
    shard.set_shard_processes(static_cast<uint32_t>(layers_of.size()));
    shard.set_version(whole.version());
    *shard.mutable_group_versions() = whole.group_versions();
    std::vector<ModuleStats> modules;
    for (uint32_t l : layers_of[i]) {
      shard.add_layer_ids(l);
      *shard.add_layer_params() = whole.layer_params(static_cast<int>(l));
      *shard.add_optimizer_state() = whole.optimizer_state(static_cast<int>(l));
      if (!penalty.empty()) modules.push_back(std::move(penalty[l]));
    }
    if (!penalty.empty()) PseudoGradientPenalty::WriteState(modules, shard.mutable_penalty_state());
  }
  return out;
}

}  // namespace aloe::server
