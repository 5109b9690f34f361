#include "common/low_rank_push.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/low_rank.h"
#include "common/low_rank_wire.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"

namespace aloe {
namespace {

uint64_t TensorElements(const v1::TensorSpec& tensor) {
  uint64_t n = 1;
  for (int64_t d : tensor.shape()) n *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
  return n;
}

// The seed of a tensor's first power iteration: fixed per (layer, tensor), so that every
// worker starts from the same Q0.
uint64_t TensorSeed(uint32_t layer_id, int tensor) {
  return 0x9E3779B97F4A7C15ull * (layer_id + 1) + static_cast<uint64_t>(tensor);
}

}  // namespace

void LowRankPushEncoder::Configure(const v1::TransportConfig& transport,
                                   const v1::ModelSpec& spec) {
  absl::MutexLock lock(&mu_);
  block_sizes_ = TransportBlockSizes(transport);
  energy_fraction_ = 0;
  if (transport.adaptive_rank().enabled()) {
    energy_fraction_ = transport.adaptive_rank().energy_fraction() > 0
                           ? transport.adaptive_rank().energy_fraction()
                           : AdaptiveRankConfig{}.energy_fraction;
  }
  std::vector<Layer> layers(spec.layers_size());
  for (int l = 0; l < spec.layers_size(); ++l) {
    Layer& layer = layers[l];
    layer.spec = spec.layers(l);
    for (const v1::LayerCodec& o : transport.layer_codecs()) {
      if (o.layer() != layer.spec.name()) continue;
      layer.rank = o.codec() == v1::CODEC_LOWRANK ? o.rank() : 0;
      layer.factor_codec =
          o.factor_codec() == v1::CODEC_UNSPECIFIED ? v1::CODEC_FP32 : o.factor_codec();
    }
    layer.warm_q.resize(layer.spec.tensors_size());
    // The warm starts carry over while the layer's tensors and rank stay the same.
    if (static_cast<size_t>(l) < layers_.size() && layers_[l].rank == layer.rank &&
        layers_[l].spec.SerializeAsString() == layer.spec.SerializeAsString()) {
      layer.warm_q = std::move(layers_[l].warm_q);
    }
  }
  layers_ = std::move(layers);
}

bool LowRankPushEncoder::IsLowRank(uint32_t layer_id) const {
  absl::MutexLock lock(&mu_);
  return layer_id < layers_.size() && layers_[layer_id].rank > 0;
}

void LowRankPushEncoder::SetTaskRanks(uint64_t task_id, absl::Span<const v1::TensorRank> ranks) {
  absl::MutexLock lock(&mu_);
  if (!task_ranks_.contains(task_id)) task_order_.push_back(task_id);
  task_ranks_[task_id].assign(ranks.begin(), ranks.end());
  while (task_order_.size() > kRememberedTasks) {
    task_ranks_.erase(task_order_.front());
    task_order_.erase(task_order_.begin());
  }
}

uint32_t LowRankPushEncoder::RankOf(uint32_t layer_id, int tensor, uint64_t task_id) const {
  if (auto it = task_ranks_.find(task_id); it != task_ranks_.end()) {
    for (const v1::TensorRank& r : it->second) {
      if (r.layer() == layer_id && r.tensor() == static_cast<uint32_t>(tensor) && r.rank() > 0) {
        return r.rank();
      }
    }
  }
  return layers_[layer_id].rank;
}

absl::Status LowRankPushEncoder::EncodeLayer(uint32_t layer_id, uint64_t task_id,
                                             absl::Span<const float> values, float* residual,
                                             std::vector<EncodedChunk>* chunks,
                                             size_t max_chunk_bytes,
                                             std::vector<v1::TensorRank>* observed) {
  absl::MutexLock lock(&mu_);
  if (layer_id >= layers_.size() || layers_[layer_id].rank == 0) {
    return absl::InvalidArgumentError(absl::StrFormat("layer %d is not low-rank", layer_id));
  }
  Layer& layer = layers_[layer_id];
  if (values.size() != layer.spec.num_elements()) {
    return absl::InvalidArgumentError(absl::StrFormat("layer %d (%s): %d values, the layer has %d",
                                                      layer_id, layer.spec.name(), values.size(),
                                                      layer.spec.num_elements()));
  }
  const v1::Codec fallback = LowRankFallbackCodec(layer.factor_codec);
  const size_t fallback_elements =
      std::max<size_t>(1, max_chunk_bytes / (fallback == v1::CODEC_BF16 ? 2 : sizeof(float)));
  std::vector<EncodedChunk> out;
  std::vector<v1::TensorRank> seen;
  // Warm starts are taken only once the whole layer is encoded.
  std::vector<std::vector<float>> next_q(layer.spec.tensors_size());
  uint64_t offset = 0;
  for (int t = 0; t < layer.spec.tensors_size(); ++t) {
    const v1::TensorSpec& tensor = layer.spec.tensors(t);
    const uint64_t n = TensorElements(tensor);
    if (offset + n > values.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %d (%s): its tensors hold more than its %d elements", layer_id,
                          layer.spec.name(), values.size()));
    }
    const absl::Span<const float> m = values.subspan(offset, n);
    float* const r = residual != nullptr ? residual + offset : nullptr;
    const auto shape = LowRankMatrixShape(tensor);
    const uint32_t rank =
        shape ? std::min({RankOf(layer_id, t, task_id), shape->first, shape->second}) : 0;
    const bool compress =
        shape && static_cast<uint64_t>(shape->first + uint64_t{shape->second}) * rank < n;
    if (!compress) {
      for (auto [b, e] : ChunkRanges(n, fallback_elements)) {
        EncodedChunk& chunk = out.emplace_back();
        chunk.offset = offset + b;
        chunk.codec = fallback;
        absl::Status s = EncodeChunk(fallback, m.subspan(b, e - b), 0, &chunk.payload,
                                     r != nullptr ? r + b : nullptr);
        if (!s.ok()) {
          return absl::InvalidArgumentError(absl::StrFormat("layer %d (%s), tensor %s: %s",
                                                            layer_id, layer.spec.name(),
                                                            tensor.name(), s.message()));
        }
      }
      offset += n;
      continue;
    }
    // A rank changed by the task keeps the warm start's columns it shares with the old rank.
    std::vector<float> warm = layer.warm_q[t];
    if (!warm.empty() && warm.size() % shape->second == 0 &&
        warm.size() != static_cast<size_t>(shape->second) * rank) {
      absl::StatusOr<std::vector<float>> resized =
          ResizeWarmStart(warm, shape->second, static_cast<uint32_t>(warm.size() / shape->second),
                          rank, TensorSeed(layer_id, t));
      warm = resized.ok() ? *std::move(resized) : std::vector<float>();
    }
    const bool warm_fits = warm.size() == static_cast<size_t>(shape->second) * rank;
    absl::StatusOr<LowRankFactors> factors = CompressLowRank(
        m, shape->first, shape->second, rank,
        warm_fits ? absl::MakeConstSpan(warm) : absl::Span<const float>(), TensorSeed(layer_id, t));
    absl::StatusOr<LowRankEncoding> encoding =
        factors.ok() ? EncodeLowRankFactors(*factors, offset, layer.factor_codec,
                                            block_sizes_.Of(layer.factor_codec), max_chunk_bytes)
                     : factors.status();
    if (!encoding.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d (%s), tensor %s, rank %d: %s",
                                                        layer_id, layer.spec.name(), tensor.name(),
                                                        rank, encoding.status().message()));
    }
    if (observed != nullptr && energy_fraction_ > 0) {
      // Read before the residual, which may overwrite m (values and residual may alias).
      absl::StatusOr<uint32_t> effective =
          ObservedEffectiveRank(*factors, FrobeniusNormSquared(m), energy_fraction_);
      if (!effective.ok()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("layer %d (%s), tensor %s: effective rank: %s", layer_id,
                            layer.spec.name(), tensor.name(), effective.status().message()));
      }
      v1::TensorRank& e = seen.emplace_back();
      e.set_layer(layer_id);
      e.set_tensor(static_cast<uint32_t>(t));
      e.set_rank(*effective);
    }
    if (r != nullptr) {
      ALOE_RETURN_IF_ERROR(LowRankResidual(m, encoding->decoded, absl::MakeSpan(r, n)));
    }
    for (LowRankChunk& c : encoding->chunks) {
      EncodedChunk& chunk = out.emplace_back();
      chunk.offset = c.offset;
      chunk.codec = v1::CODEC_LOWRANK;
      chunk.payload = std::move(c.payload);
    }
    next_q[t] = std::move(factors->q);
    offset += n;
  }
  for (size_t t = 0; t < next_q.size(); ++t) {
    if (!next_q[t].empty()) layer.warm_q[t] = std::move(next_q[t]);
  }
  for (EncodedChunk& chunk : out) chunks->push_back(std::move(chunk));
  if (observed != nullptr) observed->insert(observed->end(), seen.begin(), seen.end());
  return absl::OkStatus();
}

}  // namespace aloe
