// The one way a push comes in, for every role (a single-process server, a shard process) and
// both transports (gRPC streams, raw TCP pushes): the sender is identified once, from the call's
// token or the raw prelude's, before anything else is read; a raw push's prelude is checked
// against the layers this process takes; then the role accepts the push (AcceptPush: its checks,
// admission, a receive slot, the transport's payload read into an UpdateAssembler, submission).
// Every refusal is counted once (Rejected).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "common/raw_push.h"
#include "proto/aloe.pb.h"
#include "server/core/update_assembler.h"
#include "server/service/auth.h"
#include "server/service/parameter_wire.h"

namespace aloe::server {

class PushIngestService : public WireParameterService {
 public:
  grpc::Status ServePush(grpc::ServerContext* context, PushStreamReader* reader,
                         v1::PushReply* reply) final;
  // A raw push (common/raw_push.h: the float32 values of this process's layers, or of one slice
  // of each, over a plain TCP connection; RawPushListener's handler). kInvalidArgument for another
  // codec or a payload size that is not the layers'; otherwise as a gRPC push. `cancelled` as
  // RawPushListener::Handler's.
  absl::StatusOr<v1::PushReply> ServeRawPush(const RawPushRequest& request, ByteReader& in,
                                             const std::function<bool()>& cancelled);
  // Payload bytes of the raw pushes received whole so far.
  uint64_t raw_push_bytes() const { return raw_push_bytes_.load(); }

 protected:
  // auth and metrics must outlive the service. `spec`: the model; `shard`: the shard process
  // whose layers a push carries (nullopt: every layer); layer_groups: the layer group of each
  // spec layer when the server has more than one (a push then carries one group), else empty.
  PushIngestService(Authenticator& auth, MetricsSink& metrics, v1::ModelSpec spec,
                    std::optional<uint32_t> shard, std::vector<uint32_t> layer_groups = {})
      : auth_(auth),
        metrics_(metrics),
        spec_(std::move(spec)),
        shard_(shard),
        layer_groups_(std::move(layer_groups)) {}

  const std::vector<uint32_t>& layer_groups() const { return layer_groups_; }

  // The role's part of a push from `identity` with `header`: `read` reads the transport's
  // payload into the assembler (call it once a receive slot is held); `cancelled` tells whether
  // the pusher gave up while it waits; `start` is when the push came in.
  virtual absl::StatusOr<v1::PushReply> AcceptPush(
      const v1::PushHeader& header, const std::string& identity,
      const std::function<bool()>& cancelled,
      absl::FunctionRef<absl::Status(UpdateAssembler&)> read, absl::Time start) = 0;
  // Counts a refused push (aloe_updates_rejected_total) and returns its status.
  virtual absl::Status Rejected(const absl::Status& status) = 0;

 private:
  Authenticator& auth_;
  MetricsSink& metrics_;
  const v1::ModelSpec spec_;
  const std::optional<uint32_t> shard_;
  const std::vector<uint32_t> layer_groups_;
  std::atomic<uint64_t> raw_push_bytes_{0};
};

}  // namespace aloe::server
