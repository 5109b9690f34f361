// Assembles the chunks of one Push stream into a PendingUpdate, validating every chunk as it
// arrives so that a bad stream fails fast and nothing half-received reaches the model:
// unknown layer ids, unknown codecs, chunks out of order or past the layer's end, malformed
// encodings, non-finite values or values beyond kMaxPushMagnitude, and layers left incomplete
// are all kInvalidArgument naming the layer. With layer groups (partial synchronization) a push
// carries every layer of its group exactly once and no other layer. Pure logic, no I/O. Not
// thread-safe (one assembler per stream).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/buffer_pool.h"
#include "proto/aloe.pb.h"
#include "server/core/update.h"

namespace aloe::server {

// The largest |element| a pushed pseudo-gradient may hold. g = theta_base - theta_end is the
// parameter change of H inner steps (AdamW moves a weight by about lr per step: |g| ~ lr * H,
// about 0.15 with the defaults), so 1e6 is far above anything training produces, and far below
// where the outer step's float32 arithmetic overflows (momentum accumulates g / (1 - beta), an
// aggregate sums thousands of workers). Without it a finite value near FLT_MAX (also what bf16
// saturates to, or an int8 block at its largest valid scale) passes the finiteness checks and
// turns the model and its momentum into Inf in one outer step.
inline constexpr float kMaxPushMagnitude = 1e6f;

// The header fields of a push as an update without data (slice fields left whole).
PendingUpdate UpdateOfHeader(const v1::PushHeader& header);

class UpdateAssembler {
 public:
  // `spec` must outlive the assembler. only_shard: a shard process of a layer-sharded server
  // assembles only the layers it owns (spec.layers[l].shard == *only_shard); a chunk of any other
  // layer is kInvalidArgument, and the other layers stay empty in the finished update.
  // buffers: where whole-layer buffers of an unsliced push come from (recycled, not zeroed: the
  // chunks must cover every element before Finish succeeds); nullptr = fresh zeroed buffers.
  // sum_squares: the finished update's layer_squares are measured from each chunk while it is in
  // cache (the single-process server's norm metric would otherwise read the whole update back
  // from memory: 31% of its CPU time under full-speed ingest).
  // layer_groups: the server's layer group of each spec layer when it has more than one
  // (ServerCore::layer_groups); the push then carries group header.group() only: a chunk of
  // another group's layer is kInvalidArgument naming both groups, and the other layers stay
  // empty in the finished update. Empty = whole-model pushes.
  UpdateAssembler(const v1::ModelSpec& spec, const v1::PushHeader& header,
                  std::optional<uint32_t> only_shard = std::nullopt,
                  std::shared_ptr<FloatBufferPool> buffers = nullptr, bool sum_squares = false,
                  absl::Span<const uint32_t> layer_groups = {});

  // Adds the elements [offset, offset + count) of layer `layer_id` that `payload` encodes with
  // `codec` (CODEC_UNSPECIFIED = the header's codec, or FP32). Chunks of a layer must arrive in
  // offset order without gaps or overlap. A sliced push (header.slices() > 1; the caller has
  // checked slice < slices <= kMaxSlices) covers exactly SliceRange(n, slices, slice) of each
  // layer, starting at its first element. kInvalidArgument (naming the layer) for anything
  // malformed; a rejected chunk changes nothing the caller can observe, and the stream may go on
  // with a corrected chunk at the same offset.
  absl::Status AddChunk(uint32_t layer_id, uint64_t offset, std::string_view payload,
                        v1::Codec codec = v1::CODEC_UNSPECIFIED);
  // The same for a payload that arrives in pieces (the slices of a received message, see
  // common/push_wire.h): float32 is decoded straight from the pieces, other codecs are joined
  // first (they are the compact ones).
  absl::Status AddChunk(uint32_t layer_id, uint64_t offset,
                        absl::Span<const std::string_view> payload,
                        v1::Codec codec = v1::CODEC_UNSPECIFIED);

  // Adds the float32 elements [offset, offset + count) of layer `layer_id` that `read` delivers
  // (a raw push reads them from its socket, common/raw_push.h): piece by piece, `read(to, bytes)`
  // fills `bounce` (the caller's; a few hundred KiB, so it stays in cache) and each piece is
  // screened as AddChunk screens (NaN/Inf and kMaxPushMagnitude, kInvalidArgument naming the
  // element) while it is copied into the update's own buffer with streaming stores
  // (kernels::StreamWithinMagnitude: the staged update is not read again before its commit).
  // The same layer, order and size rules as AddChunk, checked before the first read; a failure
  // of `read` is returned as it is. On any error nothing counts as received (the elements may
  // have been written over).
  absl::Status AddFp32Read(uint32_t layer_id, uint64_t offset, uint64_t count,
                           absl::Span<char> bounce,
                           absl::FunctionRef<absl::Status(char* to, size_t bytes)> read);

  // Returns the update when every layer (or its slice) is complete; kInvalidArgument otherwise.
  absl::StatusOr<PendingUpdate> Finish() &&;

  uint64_t bytes_received() const { return bytes_received_; }
  // Accepted payload bytes per wire codec, indexed by v1::Codec (the resolved codec: never
  // CODEC_UNSPECIFIED).
  const std::array<uint64_t, v1::Codec_ARRAYSIZE>& bytes_by_codec() const {
    return bytes_by_codec_;
  }
  // Accepted payload bytes per spec layer.
  const std::vector<uint64_t>& bytes_by_layer() const { return bytes_by_layer_; }
  const v1::ModelSpec& spec() const { return spec_; }

 private:
  // kInvalidArgument for an unknown layer or, on a shard process, another one's layer, or with
  // layer groups a layer of another group.
  absl::Status CheckLayer(uint32_t layer_id) const;
  // Whether this push carries layer `layer`: not another shard process's, not another group's.
  bool Expected(int layer) const;
  // kInvalidArgument unless [offset, offset + count) continues layer_id where it stands and
  // ends within it (or within its slice).
  absl::Status CheckRange(uint32_t layer_id, uint64_t offset, uint64_t count) const;
  // The layer's buffer, taken from the pool (or zero-filled, sliced) on first use.
  std::vector<float>& Buffer(uint32_t layer_id);

  const v1::ModelSpec& spec_;
  PendingUpdate update_;
  std::vector<uint64_t> filled_;  // next expected element per layer
  std::vector<uint64_t> end_;     // one past the last element expected per layer
  uint64_t bytes_received_ = 0;
  std::array<uint64_t, v1::Codec_ARRAYSIZE> bytes_by_codec_{};
  std::vector<uint64_t> bytes_by_layer_;
  v1::Codec default_codec_ = v1::CODEC_FP32;
  std::optional<uint32_t> only_shard_;
  // With layer groups: each layer's group, and the group this push carries.
  std::vector<uint32_t> layer_groups_;
  uint32_t group_ = 0;
  std::shared_ptr<FloatBufferPool> buffers_;
  std::vector<double> squares_;  // per layer, with sum_squares; else empty
};

}  // namespace aloe::server
