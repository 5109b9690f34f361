// Paper 001 Alg. 3 on the server (TransportConfig.adaptive_rank): the rank of every low-rank
// tensor and the local steps H, chosen from the effective ranks the workers observe in their
// pushes (PushHeader.observed_ranks) and handed to them in every training task
// (Task.tensor_ranks). The rule is AdaptiveRank's (common/low_rank.h); docs/algorithms.md,
// "Low-rank compression (paper 001)".
//
// The tensors it covers: every 2-D tensor (LowRankMatrixShape) of a CODEC_LOWRANK layer whose
// factors at rank 1 are smaller than the tensor (and whose Q fits one chunk). r_0 of a tensor is
// its layer's LayerCodec.rank; every rank, r_0 included, is at most the greatest at which the
// factors stay smaller than the tensor: a tensor sent whole would show no spectrum, and its rank
// could never come down again. H_0 is the job's local_steps. Observations of one push are recorded
// only once the push is accepted, all or nothing. Not thread-safe (ServerCore's lock guards it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/low_rank.h"
#include "common/metrics.h"
#include "proto/aloe.pb.h"

namespace aloe::server {

// The AdaptiveRankConfig of a transport's adaptive_rank with defaults filled in, H_0 =
// local_steps and r_0 = 1 (AdaptiveCompression gives each tensor its own r_0).
AdaptiveRankConfig AdaptiveRankConfigOf(const v1::AdaptiveRankConfig& proto, uint32_t local_steps);

// kInvalidArgument naming the field when transport.adaptive_rank is enabled but malformed
// (ValidateAdaptiveRankConfig), or enabled without a CODEC_LOWRANK layer in
// transport.layer_codecs. OK when it is off.
absl::Status ValidateAdaptiveCompression(const v1::TransportConfig& transport,
                                         uint32_t local_steps);

class AdaptiveCompression {
 public:
  // nullptr when transport.adaptive_rank is off. kInvalidArgument as ValidateAdaptiveCompression,
  // and when no low-rank layer of `spec` has a 2-D tensor.
  static absl::StatusOr<std::unique_ptr<AdaptiveCompression>> Create(
      const v1::ModelSpec& spec, const v1::TransportConfig& transport, uint32_t local_steps);

  // OK when every observation names a covered tensor once, with an effective rank in [0, 2
  // min(rows, cols)]; else kInvalidArgument naming the first bad one.
  absl::Status Check(absl::Span<const v1::TensorRank> observed) const;
  // Records a push's observations. REQUIRES: Check(observed).ok().
  void Record(absl::Span<const v1::TensorRank> observed);

  // The rank of every covered tensor for the next task, appended to task->tensor_ranks.
  void FillTask(v1::Task* task) const;
  // H for the next tasks: AdaptiveRank::NextLocalSteps with adapt_local_steps, else H_0.
  uint32_t local_steps() const;
  // local_steps() / H_0: the factor an A-EDiT time budget is scaled by.
  double local_steps_scale() const;

  // aloe_lowrank_rank and aloe_lowrank_effective_rank (the window's mean) per tensor, and
  // aloe_adaptive_local_steps.
  void Publish(MetricsSink& metrics) const;

  // The per-tensor windows in a checkpoint, and back (all or nothing; kInvalidArgument naming
  // a tensor that this model does not have or a malformed window).
  void SaveTo(v1::ServerCheckpoint& checkpoint) const;
  absl::Status RestoreFrom(const v1::ServerCheckpoint& checkpoint);

 private:
  struct Tensor {
    uint32_t layer = 0;
    uint32_t tensor = 0;
    uint32_t rows = 0;
    uint32_t cols = 0;
    // The greatest rank at which the tensor's factors are smaller than the tensor (so that it is
    // compressed, and observed, at every rank it gets) and Q fits one chunk.
    uint32_t rank_cap = 0;
    uint32_t initial_rank = 0;  // r_0, within [min_rank, max_rank] and rank_cap
    std::string key;            // "layer/tensor" in AdaptiveRank
    LabelValues labels;         // {layer name, tensor name}
  };
  AdaptiveCompression(const AdaptiveRankConfig& config, bool adapt_local_steps,
                      std::vector<Tensor> tensors);
  // The covered tensor (layer, tensor), or nullptr.
  const Tensor* Find(uint32_t layer, uint32_t tensor) const;
  uint32_t NextRank(const Tensor& t) const;

  AdaptiveRankConfig config_;
  bool adapt_local_steps_ = false;
  std::vector<Tensor> tensors_;
  AdaptiveRank adaptive_;
};

}  // namespace aloe::server
