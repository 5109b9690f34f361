// How one outer step turns the pseudo-gradients of its updates into the g that each layer's outer
// optimizer applies. ParameterStore::ApplyOuterStep asks a LayerAggregation once per layer:
//   - FixedWeightsAggregation: g = sum_i w_i g_i with weights fixed by the aggregation policy
//     (sync DiLoCo's plain mean, paper 002 Alg. 1);
//   - PenaltyAggregation (server/core/pseudo_gradient_penalty.h): the EDiT pseudo-gradient
//     penalty (paper 000 Alg. 2): per-layer weights from the updates' norms, clipping, and
//     rollback (the layer is not stepped at all).
#pragma once

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/core/update.h"

namespace aloe::server {

// What the store does with a layer after its aggregation.
enum class LayerStep {
  kApply,  // the layer's optimizer applies the aggregated g
  kSkip,   // leave the layer's parameters and optimizer state untouched (EDiT rollback)
};

// Thread-safety: ApplyOuterStep calls Aggregate from the thread of each layer's apply group, so
// calls for different layers may run concurrently; calls for the same layer never overlap.
// An implementation must keep whatever it mutates per layer.
class LayerAggregation {
 public:
  virtual ~LayerAggregation() = default;

  // Combines updates[i]->layers[layer] (i over the step's updates, at least one) into g (the
  // layer's size) and says whether to apply it. The caller has checked that every update has
  // this layer with exactly g.size() elements, so an error is an invariant violation
  // (kInvalidArgument or kInternal), not bad input. g's prior content is unspecified; on kSkip
  // g may be left in any state.
  virtual absl::StatusOr<LayerStep> Aggregate(size_t layer,
                                              absl::Span<const PendingUpdate* const> updates,
                                              absl::Span<float> g) = 0;

  // When the layer's g is exactly one update's own buffer (a lone update of weight 1), that
  // buffer: the store applies it as it is instead of copying it through Aggregate. nullptr (the
  // default) when g must be computed.
  virtual const std::vector<float>* Passthrough(size_t layer,
                                                absl::Span<const PendingUpdate* const> updates) {
    return nullptr;
  }
};

// g = sum_i weights[i] * g_i with the same weights for every layer (the pre-penalty behaviour).
// Stateless, so thread-safe. Never skips a layer.
class FixedWeightsAggregation final : public LayerAggregation {
 public:
  // `weights` must outlive this object and have one entry per update passed to Aggregate
  // (kInvalidArgument from Aggregate otherwise).
  explicit FixedWeightsAggregation(absl::Span<const float> weights) : weights_(weights) {}

  absl::StatusOr<LayerStep> Aggregate(size_t layer, absl::Span<const PendingUpdate* const> updates,
                                      absl::Span<float> g) override;
  const std::vector<float>* Passthrough(size_t layer,
                                        absl::Span<const PendingUpdate* const> updates) override;

 private:
  absl::Span<const float> weights_;
};

// out = sum_i weights[i] * inputs[i]: the first input with a non-zero weight is scaled into out,
// each further one is added in a fused pass (kernels::WeightedAccumulate); a lone input of
// weight exactly 1 is copied, so the result is bit-exact. Preconditions: inputs.size() ==
// weights.size(), every input has out.size() elements.
void WeightedSum(absl::Span<const absl::Span<const float>> inputs, absl::Span<const float> weights,
                 absl::Span<float> out);

}  // namespace aloe::server
