#include "server/core/adaptive_compression.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/low_rank_wire.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "server/core/server_metrics.h"

namespace aloe::server {

AdaptiveRankConfig AdaptiveRankConfigOf(const v1::AdaptiveRankConfig& proto, uint32_t local_steps) {
  AdaptiveRankConfig c;
  if (proto.window() > 0) c.window = proto.window();
  if (proto.energy_fraction() != 0) c.energy_fraction = proto.energy_fraction();
  if (proto.min_rank() > 0) c.min_rank = proto.min_rank();
  c.max_rank = proto.max_rank() > 0 ? proto.max_rank() : 4096;
  c.initial_rank = c.min_rank;
  c.min_local_steps = proto.min_local_steps() > 0 ? proto.min_local_steps() : 1;
  c.max_local_steps = proto.max_local_steps() > 0 ? proto.max_local_steps() : 1000000;
  c.initial_local_steps = local_steps;
  return c;
}

absl::Status ValidateAdaptiveCompression(const v1::TransportConfig& transport,
                                         uint32_t local_steps) {
  const v1::AdaptiveRankConfig& a = transport.adaptive_rank();
  if (!a.enabled()) return absl::OkStatus();
  const AdaptiveRankConfig config = AdaptiveRankConfigOf(a, local_steps);
  if (absl::Status s = ValidateAdaptiveRankConfig(config); !s.ok()) {
    // initial_local_steps is the job's local_steps: say so.
    return absl::InvalidArgumentError(
        absl::StrCat("transport.adaptive_rank: ", s.message(),
                     absl::StrContains(s.message(), "initial_local_steps")
                         ? " (initial_local_steps is the job's local_steps)"
                         : ""));
  }
  if (std::none_of(transport.layer_codecs().begin(), transport.layer_codecs().end(),
                   [](const v1::LayerCodec& c) { return c.codec() == v1::CODEC_LOWRANK; })) {
    return absl::InvalidArgumentError(
        "transport.adaptive_rank is enabled, but no layer is CODEC_LOWRANK "
        "(transport.layer_codecs)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<AdaptiveCompression>> AdaptiveCompression::Create(
    const v1::ModelSpec& spec, const v1::TransportConfig& transport, uint32_t local_steps) {
  if (!transport.adaptive_rank().enabled()) return nullptr;
  ALOE_RETURN_IF_ERROR(ValidateAdaptiveCompression(transport, local_steps));
  const AdaptiveRankConfig config = AdaptiveRankConfigOf(transport.adaptive_rank(), local_steps);
  std::vector<Tensor> tensors;
  for (int l = 0; l < spec.layers_size(); ++l) {
    const v1::LayerSpec& layer = spec.layers(l);
    uint32_t rank = 0;
    v1::Codec factor_codec = v1::CODEC_FP32;
    for (const v1::LayerCodec& c : transport.layer_codecs()) {
      if (c.layer() != layer.name()) continue;
      rank = c.codec() == v1::CODEC_LOWRANK ? c.rank() : 0;
      if (c.factor_codec() != v1::CODEC_UNSPECIFIED) factor_codec = c.factor_codec();
    }
    if (rank == 0) continue;
    for (int t = 0; t < layer.tensors_size(); ++t) {
      const auto shape = LowRankMatrixShape(layer.tensors(t));
      if (!shape) continue;
      const uint64_t m = shape->first, n = shape->second;
      // The greatest r with (m + n) r < m n.
      const uint64_t smaller = (m * n - 1) / (m + n);
      if (smaller == 0) continue;
      Tensor& x = tensors.emplace_back();
      x.layer = static_cast<uint32_t>(l);
      x.tensor = static_cast<uint32_t>(t);
      x.rows = shape->first;
      x.cols = shape->second;
      // Q must also fit one chunk with a row of P (the encoder refuses a rank beyond).
      const uint64_t fits = LowRankMaxChunkRank(
          x.cols, factor_codec, TransportBlockSizes(transport).Of(factor_codec), kMaxChunkBytes);
      x.rank_cap = static_cast<uint32_t>(std::min({smaller, std::min(m, n), fits}));
      if (x.rank_cap == 0) {
        tensors.pop_back();
        continue;
      }
      // Bounded as AdaptiveRank bounds every rank.
      x.initial_rank = std::max<uint32_t>(
          1, std::min({std::max(rank, config.min_rank), config.max_rank, x.rank_cap}));
      x.key = absl::StrCat(l, "/", t);
      x.labels = {layer.name(), layer.tensors(t).name()};
    }
  }
  if (tensors.empty()) {
    return absl::InvalidArgumentError(
        "transport.adaptive_rank is enabled, but no CODEC_LOWRANK layer has a 2-D tensor");
  }
  return std::unique_ptr<AdaptiveCompression>(new AdaptiveCompression(
      config, transport.adaptive_rank().adapt_local_steps(), std::move(tensors)));
}

AdaptiveCompression::AdaptiveCompression(const AdaptiveRankConfig& config, bool adapt_local_steps,
                                         std::vector<Tensor> tensors)
    : config_(config),
      adapt_local_steps_(adapt_local_steps),
      tensors_(std::move(tensors)),
      adaptive_(config) {}

const AdaptiveCompression::Tensor* AdaptiveCompression::Find(uint32_t layer,
                                                             uint32_t tensor) const {
  for (const Tensor& t : tensors_) {
    if (t.layer == layer && t.tensor == tensor) return &t;
  }
  return nullptr;
}

absl::Status AdaptiveCompression::Check(absl::Span<const v1::TensorRank> observed) const {
  absl::flat_hash_set<const Tensor*> seen;
  for (const v1::TensorRank& o : observed) {
    const Tensor* t = Find(o.layer(), o.tensor());
    if (t == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "observed rank of layer %d, tensor %d: not a 2-D tensor of a low-rank layer", o.layer(),
          o.tensor()));
    }
    if (!seen.insert(t).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("observed rank of layer %d (%s), tensor %d (%s) is given twice",
                          o.layer(), t->labels[0], o.tensor(), t->labels[1]));
    }
    if (absl::Status s = adaptive_.CheckRecord(t->key, t->rows, t->cols, t->initial_rank, o.rank());
        !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("observed rank of layer %d (%s), tensor %d (%s): %s", o.layer(),
                          t->labels[0], o.tensor(), t->labels[1], s.message()));
    }
  }
  return absl::OkStatus();
}

void AdaptiveCompression::Record(absl::Span<const v1::TensorRank> observed) {
  for (const v1::TensorRank& o : observed) {
    const Tensor* t = Find(o.layer(), o.tensor());
    if (t == nullptr) continue;  // excluded by Check
    adaptive_.Record(t->key, t->rows, t->cols, t->initial_rank, o.rank(), t->rank_cap)
        .IgnoreError();
  }
}

uint32_t AdaptiveCompression::NextRank(const Tensor& t) const {
  return adaptive_.Knows(t.key) ? adaptive_.NextRank(t.key) : t.initial_rank;
}

void AdaptiveCompression::FillTask(v1::Task* task) const {
  for (const Tensor& t : tensors_) {
    v1::TensorRank* r = task->add_tensor_ranks();
    r->set_layer(t.layer);
    r->set_tensor(t.tensor);
    r->set_rank(NextRank(t));
  }
}

uint32_t AdaptiveCompression::local_steps() const {
  return adapt_local_steps_ ? adaptive_.NextLocalSteps() : config_.initial_local_steps;
}

double AdaptiveCompression::local_steps_scale() const {
  return static_cast<double>(local_steps()) / config_.initial_local_steps;
}

void AdaptiveCompression::Publish(MetricsSink& metrics) const {
  const std::vector<AdaptiveRank::LayerState> states = adaptive_.Save();
  for (const Tensor& t : tensors_) {
    metrics.Set(kLowRankRank, NextRank(t), t.labels);
    for (const AdaptiveRank::LayerState& s : states) {
      if (s.name != t.key) continue;
      double sum = 0;
      for (uint32_t r : s.recent) sum += r;
      metrics.Set(kLowRankEffectiveRank, sum / static_cast<double>(s.recent.size()), t.labels);
    }
  }
  metrics.Set(kAdaptiveLocalSteps, local_steps());
}

void AdaptiveCompression::SaveTo(v1::ServerCheckpoint& checkpoint) const {
  const std::vector<AdaptiveRank::LayerState> states = adaptive_.Save();
  for (const Tensor& t : tensors_) {
    for (const AdaptiveRank::LayerState& s : states) {
      if (s.name != t.key) continue;
      v1::AdaptiveRankWindow* w = checkpoint.add_adaptive_ranks();
      w->set_layer(t.layer);
      w->set_tensor(t.tensor);
      w->mutable_effective_ranks()->Add(s.recent.begin(), s.recent.end());
    }
  }
}

absl::Status AdaptiveCompression::RestoreFrom(const v1::ServerCheckpoint& checkpoint) {
  std::vector<AdaptiveRank::LayerState> states;
  for (const v1::AdaptiveRankWindow& w : checkpoint.adaptive_ranks()) {
    const Tensor* t = Find(w.layer(), w.tensor());
    if (t == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "checkpoint: adaptive rank of layer %d, tensor %d, which is not a 2-D tensor of a "
          "low-rank layer of this config",
          w.layer(), w.tensor()));
    }
    AdaptiveRank::LayerState& s = states.emplace_back();
    s.name = t->key;
    s.rows = t->rows;
    s.cols = t->cols;
    s.initial_rank = t->initial_rank;
    s.rank_cap = t->rank_cap;
    // A window longer than this config's keeps its newest entries.
    const int skip = std::max(0, w.effective_ranks_size() - static_cast<int>(config_.window));
    s.recent.assign(w.effective_ranks().begin() + skip, w.effective_ranks().end());
  }
  absl::Status s = adaptive_.Restore(states);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("checkpoint: ", s.message()));
  return absl::OkStatus();
}

}  // namespace aloe::server
