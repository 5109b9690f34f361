// A simulated worker's pushes as they travel: encoded with the config's transport as aloe-worker
// encodes them (worker/client.cc, worker/server_session.cc), then decoded as the server decodes
// them (server::UpdateAssembler). The update the core receives is the decoded one, and the bytes
// the link model moves are the encoded payload's.
//
// Per layer, with its codec (transport.layer_codecs override transport.codec; UNSPECIFIED =
// FP32): FP32, BF16, INT8_BLOCKWISE and INT4_BLOCKWISE in the chunks common/tensor_codec.h
// defines (EncodeChunk), CODEC_LOWRANK through the worker's LowRankPushEncoder
// (common/low_rank_push.h), whose warm starts persist across this worker's pushes. With
// transport.error_feedback the residual of each layer (what its encoding lost) stays here and
// is added to the layer's next pushed pseudo-gradient, as the worker does. With
// transport.adaptive_rank a push is compressed at the ranks its task names (SetTaskRanks) and
// carries the effective ranks the encoder observed (PendingUpdate.observed_ranks), as the
// worker's push header does.
//
// The byte count is the sum of the chunks' payloads (what UpdateAssembler::bytes_received
// counts): the codecs' own headers, scales and low-rank factors are in it; the framing of the
// messages that carry the chunks (layer id, offset, codec fields, gRPC and HTTP/2) is not.
//
// Not thread-safe; one per simulated worker.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/low_rank_push.h"
#include "common/tensor_codec.h"
#include "proto/aloe.pb.h"
#include "server/core/update.h"

namespace aloe::sim {

// What one push put on the wire and what became of it at the server.
struct EncodedPush {
  uint64_t bytes = 0;  // payload bytes of its chunks
  // Not ok when the worker could not encode the pseudo-gradient or the server would refuse
  // the chunks (a non-finite value, a value beyond the pseudo-gradient magnitude limit): the
  // push is then refused, with nothing applied.
  absl::Status status;
};

class WorkerPushCodec {
 public:
  // `spec` is the model the server trains (ServerCore::spec); it is copied.
  WorkerPushCodec(const v1::ModelSpec& spec, const v1::TransportConfig& transport);

  // Whether every layer is pushed as float32: the server then decodes exactly the pushed
  // pseudo-gradient, and Encode leaves it as it is.
  bool exact() const { return exact_; }

  // Makes the pushes of `task` compress at the ranks it names (Task.tensor_ranks), as the
  // worker does when the task arrives; a task without ranks keeps the configured ones.
  void SetTaskRanks(const v1::Task& task);

  // Encodes the pushed layers of `update` (the non-empty ones: every layer, or a layer group's
  // for a group push; `layer_groups` is the server's layer group of each layer when it has more
  // than one, else empty) with error feedback when configured, and replaces them with what the
  // server decodes; its observed_ranks become the encoder's observations. On a refusal
  // (EncodedPush::status) `update`'s layers are unspecified and `bytes` is the planning estimate
  // (PushBytes) of the layers.
  EncodedPush Encode(server::PendingUpdate& update, absl::Span<const uint32_t> layer_groups);

  // Forgets the residuals and warm starts: a worker process that ended (leave, crash).
  void Reset();

 private:
  v1::ModelSpec spec_;
  v1::TransportConfig transport_;
  std::vector<v1::Codec> codecs_;  // per layer
  BlockSizes blocks_;
  bool exact_ = true;
  std::vector<std::vector<float>> residual_;  // per layer; empty until its first push
  std::unique_ptr<LowRankPushEncoder> low_rank_;
};

}  // namespace aloe::sim
