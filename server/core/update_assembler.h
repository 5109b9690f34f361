// Assembles the chunks of one Push stream into a PendingUpdate, validating every chunk as it
// arrives so that a bad stream fails fast and nothing half-received reaches the model:
// unknown layer ids, chunks out of order or past the layer's end, non-finite values, a
// payload that is not float32, and layers left incomplete are all kInvalidArgument naming the
// layer. Pure logic, no I/O. Not thread-safe (one assembler per stream).
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/aloe.pb.h"
#include "server/core/update.h"

namespace aloe::server {

class UpdateAssembler {
 public:
  // `spec` must outlive the assembler.
  UpdateAssembler(const v1::ModelSpec& spec, const v1::PushHeader& header);

  // Adds the elements [offset, offset + count) of layer `layer_id` that `payload` encodes with
  // `codec` (CODEC_UNSPECIFIED = the header's codec, or FP32). Chunks of a layer must arrive in
  // offset order without gaps or overlap.
  absl::Status AddChunk(uint32_t layer_id, uint64_t offset, std::string_view payload,
                        v1::Codec codec = v1::CODEC_UNSPECIFIED);

  // Returns the update when every layer is complete; kInvalidArgument otherwise.
  absl::StatusOr<PendingUpdate> Finish() &&;

  uint64_t bytes_received() const { return bytes_received_; }

 private:
  const v1::ModelSpec& spec_;
  PendingUpdate update_;
  std::vector<uint64_t> filled_;  // elements received per layer
  uint64_t bytes_received_ = 0;
  v1::Codec default_codec_ = v1::CODEC_FP32;
};

}  // namespace aloe::server
