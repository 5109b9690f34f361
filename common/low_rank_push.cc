#include "common/low_rank_push.h"

#include <algorithm>
#include <deque>

#include "absl/strings/str_format.h"
#include "common/low_rank.h"
#include "common/low_rank_wire.h"
#include "common/model_spec.h"
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

// The warm start for `rank` of a cols-column tensor from `warm` (any earlier rank): kept when the
// rank is the same, resized (ResizeWarmStart) when it changed, empty (seeded) when there is none.
std::vector<float> WarmStartFor(const std::vector<float>& warm, uint32_t cols, uint32_t rank,
                                uint64_t seed) {
  if (warm.empty() || cols == 0 || warm.size() % cols != 0) return {};
  if (warm.size() == static_cast<size_t>(cols) * rank) return warm;
  absl::StatusOr<std::vector<float>> resized =
      ResizeWarmStart(warm, cols, static_cast<uint32_t>(warm.size() / cols), rank, seed);
  return resized.ok() ? *std::move(resized) : std::vector<float>();
}

// Appends the chunks of `values`, the layer's elements from `offset`, in `codec` (a low-rank
// layer's fallback), at most max_chunk_bytes each; residual (optional) as EncodeChunk's.
absl::Status EncodeFallback(v1::Codec codec, absl::Span<const float> values, uint64_t offset,
                            size_t max_chunk_bytes, float* residual,
                            std::vector<EncodedChunk>* out) {
  const size_t max_elements =
      std::max<size_t>(1, max_chunk_bytes / (codec == v1::CODEC_BF16 ? 2 : sizeof(float)));
  for (auto [b, e] : ChunkRanges(values.size(), max_elements)) {
    EncodedChunk& chunk = out->emplace_back();
    chunk.offset = offset + b;
    chunk.codec = codec;
    ALOE_RETURN_IF_ERROR(EncodeChunk(codec, values.subspan(b, e - b), 0, &chunk.payload,
                                     residual != nullptr ? residual + b : nullptr));
  }
  return absl::OkStatus();
}

}  // namespace

void LowRankPushEncoder::Configure(const v1::TransportConfig& transport, const v1::ModelSpec& spec,
                                   uint32_t slice, uint32_t slices) {
  absl::MutexLock lock(&mu_);
  block_sizes_ = TransportBlockSizes(transport);
  slice_ = slice;
  slices_ = std::max<uint32_t>(slices, 1);
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
  if (slices_ > 1) {
    return EncodeSliceLocked(layer_id, values, residual, chunks, max_chunk_bytes, observed);
  }
  Layer& layer = layers_[layer_id];
  if (values.size() != layer.spec.num_elements()) {
    return absl::InvalidArgumentError(absl::StrFormat("layer %d (%s): %d values, the layer has %d",
                                                      layer_id, layer.spec.name(), values.size(),
                                                      layer.spec.num_elements()));
  }
  const v1::Codec fallback = LowRankFallbackCodec(layer.factor_codec);
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
    const uint32_t rank = LowRankTensorRank(tensor, RankOf(layer_id, t, task_id));
    const bool compress = rank > 0;
    if (!compress) {
      if (absl::Status s = EncodeFallback(fallback, m, offset, max_chunk_bytes, r, &out); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrFormat("layer %d (%s), tensor %s: %s", layer_id,
                                                          layer.spec.name(), tensor.name(),
                                                          s.message()));
      }
      offset += n;
      continue;
    }
    // A rank changed by the task keeps the warm start's columns it shares with the old rank.
    const std::vector<float> warm =
        WarmStartFor(layer.warm_q[t], shape->second, rank, TensorSeed(layer_id, t));
    absl::StatusOr<LowRankFactors> factors =
        CompressLowRank(m, shape->first, shape->second, rank, warm, TensorSeed(layer_id, t));
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

absl::Status LowRankPushEncoder::CompressSlices(uint64_t task_id,
                                                const std::vector<std::vector<float>>& slices,
                                                AllReduceFloats all_reduce) {
  absl::MutexLock lock(&mu_);
  if (slices_ <= 1) {
    return absl::FailedPreconditionError(
        "CompressSlices is for a rank of a multi-rank node (Configure with slices > 1)");
  }
  // Every rank lists the same tensors (the spec and transport are the node's), each with the
  // elements its slice holds.
  std::vector<LowRankSlicePiece> pieces;
  std::vector<std::pair<uint32_t, int>> tensors;  // (layer, tensor) of each piece
  // The pieces' warm starts: a deque keeps each one where its piece's span points.
  std::deque<std::vector<float>> warm_starts;
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    if (layer.rank == 0) continue;
    const auto [sb, se] = SliceRange(layer.spec.num_elements(), slices_, slice_);
    const bool fits = l < slices.size() && slices[l].size() == se - sb;
    uint64_t offset = 0;
    for (int t = 0; t < layer.spec.tensors_size(); ++t) {
      const v1::TensorSpec& tensor = layer.spec.tensors(t);
      const uint64_t n = TensorElements(tensor);
      const uint32_t rank = LowRankTensorRank(tensor, RankOf(l, t, task_id));
      if (rank > 0) {
        const auto shape = LowRankMatrixShape(tensor);
        LowRankSlicePiece& piece = pieces.emplace_back();
        piece.rows = shape->first;
        piece.cols = shape->second;
        piece.rank = rank;
        piece.seed = TensorSeed(l, t);
        piece.warm_q =
            warm_starts.emplace_back(WarmStartFor(layer.warm_q[t], piece.cols, rank, piece.seed));
        const uint64_t first = std::max(offset, sb);
        const uint64_t last = std::min(offset + n, se);
        if (!fits) {
          piece.begin = n + 1;  // unusable: every rank refuses
        } else if (first < last) {
          piece.begin = first - offset;
          piece.m = absl::MakeConstSpan(slices[l]).subspan(first - sb, last - first);
        }
        tensors.emplace_back(l, t);
      }
      offset += n;
    }
  }
  for (Layer& layer : layers_) {
    layer.node_factors.assign(layer.spec.tensors_size(), {});
    layer.node_observed.assign(layer.spec.tensors_size(), std::nullopt);
  }
  ALOE_ASSIGN_OR_RETURN(std::vector<LowRankSliceFactors> factors,
                        CompressLowRankSlices(pieces, all_reduce));
  for (size_t i = 0; i < factors.size(); ++i) {
    Layer& layer = layers_[tensors[i].first];
    const int t = tensors[i].second;
    layer.warm_q[t] = factors[i].factors.q;
    if (energy_fraction_ > 0) {
      // Every rank finds the same effective rank: the factors and the norm are the node's.
      ALOE_ASSIGN_OR_RETURN(
          layer.node_observed[t],
          ObservedEffectiveRank(factors[i].factors, factors[i].squared_norm, energy_fraction_));
    }
    layer.node_factors[t] = std::move(factors[i].factors);
  }
  return absl::OkStatus();
}

absl::Status LowRankPushEncoder::EncodeSliceLocked(uint32_t layer_id,
                                                   absl::Span<const float> values, float* residual,
                                                   std::vector<EncodedChunk>* chunks,
                                                   size_t max_chunk_bytes,
                                                   std::vector<v1::TensorRank>* observed) {
  Layer& layer = layers_[layer_id];
  const auto [sb, se] = SliceRange(layer.spec.num_elements(), slices_, slice_);
  if (values.size() != se - sb) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d (%s): %d values, slice %d of %d holds %d", layer_id,
                        layer.spec.name(), values.size(), slice_, slices_, se - sb));
  }
  if (layer.node_factors.size() != static_cast<size_t>(layer.spec.tensors_size())) {
    return absl::FailedPreconditionError(
        absl::StrFormat("layer %d (%s): no factors of this node's slices (CompressSlices)",
                        layer_id, layer.spec.name()));
  }
  std::vector<EncodedChunk> out;
  std::vector<v1::TensorRank> seen;
  uint64_t offset = 0;
  for (int t = 0; t < layer.spec.tensors_size() && offset < se; ++t) {
    const v1::TensorSpec& tensor = layer.spec.tensors(t);
    const uint64_t n = TensorElements(tensor);
    const uint64_t first = std::max(offset, sb);
    const uint64_t last = std::min(offset + n, se);
    if (first >= last) {
      offset += n;
      continue;
    }
    const absl::Span<const float> m = values.subspan(first - sb, last - first);
    float* const r = residual != nullptr ? residual + (first - sb) : nullptr;
    absl::Status s;
    // CompressSlices compressed the tensor at the task's rank, or found it not worth it.
    if (layer.node_factors[t].rank > 0) {
      if (layer.node_observed[t].has_value()) {
        v1::TensorRank& e = seen.emplace_back();
        e.set_layer(layer_id);
        e.set_tensor(static_cast<uint32_t>(t));
        e.set_rank(*layer.node_observed[t]);
      }
      s = EncodeLowRankSlicePiece(layer.node_factors[t], offset, first - offset, m,
                                  layer.factor_codec, block_sizes_.Of(layer.factor_codec),
                                  max_chunk_bytes, r, &out);
    } else {
      s = EncodeFallback(LowRankFallbackCodec(layer.factor_codec), m, first, max_chunk_bytes, r,
                         &out);
    }
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer %d (%s), tensor %s: %s", layer_id, layer.spec.name(), tensor.name(), s.message()));
    }
    offset += n;
  }
  for (EncodedChunk& chunk : out) chunks->push_back(std::move(chunk));
  if (observed != nullptr) observed->insert(observed->end(), seen.begin(), seen.end());
  return absl::OkStatus();
}

}  // namespace aloe
