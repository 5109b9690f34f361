// The worker's side of CODEC_LOWRANK: encodes the pseudo-gradient of a low-rank layer
// (transport.layer_codecs with codec CODEC_LOWRANK) into chunks for the wire
// (common/low_rank_wire.h), keeping per (layer, tensor) the warm start of the next round's
// power iteration and giving the error-feedback residual. docs/algorithms.md, "Low-rank
// compression (paper 001)".
//
// Per tensor of the layer, in spec order (so the chunks are in offset order):
//   - a tensor of two or more dimensions, seen as the matrix (shape[0], rest) of rows x cols,
//     with r = min(rank, rows, cols) and (rows + cols) r < rows cols: P, Q = CompressLowRank(M,
//     r, warm Q), both encoded with the factor codec; residual = M - P' Q'^T where P', Q' are
//     the factors as the server decodes them; the unquantised Q is the next warm start.
//   - any other tensor (1-D: biases, norms; or a matrix whose factors would not be smaller):
//     the fallback codec (LowRankFallbackCodec), residual = M - decode(encode(M)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/tensor_codec.h"
#include "proto/aloe.pb.h"

namespace aloe {

// A chunk of a pushed layer: its first element in the layer, its codec and its payload.
struct EncodedChunk {
  uint64_t offset = 0;
  v1::Codec codec = v1::CODEC_FP32;
  std::string payload;
};

// Thread-safe. One per worker process: its state spans rounds.
class LowRankPushEncoder {
 public:
  // Takes the low-rank layers of `transport` for the layers of `spec` (by name); the others are
  // not low-rank. Keeps the warm starts of layers whose settings did not change.
  void Configure(const v1::TransportConfig& transport, const v1::ModelSpec& spec)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Whether layer `layer_id` of the configured spec is low-rank.
  bool IsLowRank(uint32_t layer_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // The ranks task `task_id` asks for (Task.tensor_ranks, adaptive rank): its pushes compress
  // those tensors at those ranks, the others at their layer's configured rank. The ranks of the
  // newest kRememberedTasks tasks are kept (a push of a task may be encoded after the next task
  // arrived).
  void SetTaskRanks(uint64_t task_id, absl::Span<const v1::TensorRank> ranks)
      ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr size_t kRememberedTasks = 8;

  // Encodes the whole layer `layer_id` (values: its elements, error feedback already added) of a
  // push of task `task_id` into *chunks (appended, in offset order, each payload <=
  // max_chunk_bytes). When residual is not null it receives values.size() floats: values minus
  // what the chunks decode to. When the transport's adaptive rank is on and observed is not
  // null, every compressed tensor's effective rank (ObservedEffectiveRank) is appended to
  // *observed. kInvalidArgument, with nothing appended, when the layer is not low-rank, values
  // does not match the spec, a value is NaN or Inf, or a tensor's Q does not fit in one chunk
  // (naming the layer, tensor, rank and limit).
  absl::Status EncodeLayer(uint32_t layer_id, uint64_t task_id, absl::Span<const float> values,
                           float* residual, std::vector<EncodedChunk>* chunks,
                           size_t max_chunk_bytes, std::vector<v1::TensorRank>* observed = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Layer {
    v1::LayerSpec spec;
    uint32_t rank = 0;  // 0: not low-rank
    v1::Codec factor_codec = v1::CODEC_FP32;
    std::vector<std::vector<float>> warm_q;  // per tensor; empty: seeded
  };
  // The rank of tensor `tensor` of layer `layer_id` in a push of task `task_id`.
  uint32_t RankOf(uint32_t layer_id, int tensor, uint64_t task_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<Layer> layers_ ABSL_GUARDED_BY(mu_);
  BlockSizes block_sizes_ ABSL_GUARDED_BY(mu_);
  // adaptive_rank.energy_fraction when adaptive rank is on, else 0.
  double energy_fraction_ ABSL_GUARDED_BY(mu_) = 0;
  // Task id -> its ranks, the newest kRememberedTasks tasks (ids in arrival order).
  absl::flat_hash_map<uint64_t, std::vector<v1::TensorRank>> task_ranks_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> task_order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aloe
