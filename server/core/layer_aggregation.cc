#include "server/core/layer_aggregation.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "kernels/cpu/outer_kernels.h"

namespace aloe::server {

void WeightedSum(absl::Span<const absl::Span<const float>> inputs, absl::Span<const float> weights,
                 absl::Span<float> out) {
  size_t nonzero = 0;
  size_t last = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (weights[i] != 0.0f) {
      ++nonzero;
      last = i;
    }
  }
  if (nonzero == 1 && weights[last] == 1.0f) {
    std::copy(inputs[last].begin(), inputs[last].end(), out.begin());
    return;
  }
  if (nonzero == 0) {
    std::fill(out.begin(), out.end(), 0.0f);
    return;
  }
  bool first = true;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (weights[i] == 0.0f) continue;  // e.g. an update the penalty flagged as anomalous
    if (first) {
      // = 0 + w * x without the zero-fill pass (the same value, but -0 for w * x = -0).
      kernels::ScaledCopy(inputs[i].data(), weights[i], out.data(), out.size());
      first = false;
    } else {
      kernels::WeightedAccumulate(inputs[i].data(), weights[i], out.data(), out.size());
    }
  }
}

absl::StatusOr<LayerStep> FixedWeightsAggregation::Aggregate(
    size_t layer, absl::Span<const PendingUpdate* const> updates, absl::Span<float> g) {
  if (updates.empty() || updates.size() != weights_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "fixed-weight aggregation: %d updates but %d weights", updates.size(), weights_.size()));
  }
  std::vector<absl::Span<const float>> inputs;
  inputs.reserve(updates.size());
  for (const PendingUpdate* u : updates) {
    if (layer >= u->layers.size() || u->layers[layer].size() != g.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "fixed-weight aggregation: update has no layer %d of %d elements", layer, g.size()));
    }
    inputs.push_back(u->layers[layer]);
  }
  WeightedSum(inputs, weights_, g);
  return LayerStep::kApply;
}

const std::vector<float>* FixedWeightsAggregation::Passthrough(
    size_t layer, absl::Span<const PendingUpdate* const> updates) {
  if (updates.size() != 1 || weights_.size() != 1 || weights_[0] != 1.0f ||
      layer >= updates[0]->layers.size()) {
    return nullptr;
  }
  return &updates[0]->layers[layer];
}

}  // namespace aloe::server
