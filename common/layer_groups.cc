#include "common/layer_groups.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace aloe {

absl::StatusOr<std::vector<uint32_t>> AssignLayerGroups(const v1::ModelSpec& spec,
                                                        uint32_t groups) {
  const size_t layers = static_cast<size_t>(spec.layers_size());
  if (groups == 0 || groups > layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("partial_sync.groups must be in [1, %d] (the model's layer count), got %d",
                        layers, groups));
  }
  double total = 0;
  for (const v1::LayerSpec& layer : spec.layers())
    total += static_cast<double>(layer.num_elements());
  std::vector<uint32_t> group_of(layers, 0);
  uint32_t group = 0;
  size_t in_group = 0;
  double before = 0;  // elements of the layers before the current one
  for (size_t i = 0; i < layers; ++i) {
    const double size = static_cast<double>(spec.layers(static_cast<int>(i)).num_elements());
    const size_t layers_left = layers - i;
    const uint32_t groups_after = groups - 1 - group;
    const bool past_share = total > 0 && (before + size / 2) * groups > total * (group + 1);
    if (in_group > 0 && group + 1 < groups && (layers_left <= groups_after || past_share)) {
      ++group;
      in_group = 0;
    }
    group_of[i] = group;
    ++in_group;
    before += size;
  }
  return group_of;
}

std::vector<std::vector<uint32_t>> LayersOfGroups(const std::vector<uint32_t>& group_of_layer) {
  const uint32_t groups = group_of_layer.empty()
                              ? 0
                              : *std::max_element(group_of_layer.begin(), group_of_layer.end()) + 1;
  std::vector<std::vector<uint32_t>> layers(groups);
  for (size_t i = 0; i < group_of_layer.size(); ++i) {
    layers[group_of_layer[i]].push_back(static_cast<uint32_t>(i));
  }
  return layers;
}

}  // namespace aloe
