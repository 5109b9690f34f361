// gRPC adapters over the ServerCore: proto in, core call, proto out. No logic of their own
// beyond streaming: Pull streams a snapshot in <= 1 MiB chunks outside the core lock; Push
// assembles and validates chunks outside the lock, then submits the whole update at once.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/raw_push.h"
#include "common/receive_slots.h"
#include "proto/aloe.grpc.pb.h"
#include "server/core/update_assembler.h"
#include "server/service/auth.h"
#include "server/service/core_handle.h"
#include "server/service/parameter_wire.h"
#include "server/service/push_ingest.h"

namespace aloe::server {

// The one place where absl::Status becomes grpc::Status (the codes are numerically equal).
grpc::Status ToGrpcStatus(const absl::Status& status);

// A pull of one layer group (PullRequest.by_group): the layer group of each spec layer, the
// group pulled, and its version, which every chunk carries (ParamChunk.group_version).
struct GroupPull {
  absl::Span<const uint32_t> layer_groups;
  uint32_t group = 0;
  uint64_t version = 0;
};

// Streams the layers of `snapshot` (skipping null ones: another shard process's, and with
// `group` those of other layer groups) in <= 1 MiB chunks, whole or slice `slice` of `slices` of
// each (already validated), and counts the bytes. The payloads are sent from the snapshot's
// buffers (ParamChunkMessage).
grpc::Status StreamSnapshot(grpc::ServerContext& context, const ModelSnapshot& snapshot,
                            uint32_t slice, uint32_t slices, PullStreamWriter& writer,
                            MetricsSink& metrics, const GroupPull* group = nullptr);

// The core's layer groups when it has more than one (partial synchronization), else empty.
std::vector<uint32_t> LayerGroupsOf(CoreHandle& handle);

// Adds the payload bytes an assembler accepted to the received-bytes metric, per codec.
void CountReceivedBytes(const UpdateAssembler& assembler, MetricsSink& metrics);

// What a raw push to shard process `shard` (nullopt: a single-process server, every layer) must
// carry, after checking its prelude: float32 (kInvalidArgument naming another codec), valid slice
// fields, and payload_bytes equal to the float32 bytes of those layers (kInvalidArgument naming
// both sizes). With layer_groups (RawPushRanges) the layers of the header's group, and
// kInvalidArgument for a group the model does not have; without, kInvalidArgument for a push
// that names a layer group. The payload layout (RawPushRanges).
absl::StatusOr<std::vector<RawPushRange>> CheckRawPush(
    const v1::ModelSpec& spec, std::optional<uint32_t> shard, const RawPushRequest& request,
    absl::Span<const uint32_t> layer_groups = {});

// Reads a raw push's payload, laid out as `ranges`, from `in` into `assembler`: each piece lands
// in a 256 KiB bounce buffer (small enough to stay in cache) and is screened while it is copied
// on into the update's staging buffers (UpdateAssembler::AddFp32Read). The bounce buffer lives
// only during the call, which callers make holding a staging or receive slot: at most as many
// exist as slots, however many connections are open.
absl::Status ReadRawPayload(const std::vector<RawPushRange>& ranges, ByteReader& in,
                            UpdateAssembler& assembler);

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  // handle and auth must outlive the service. shard_identity: a layer-sharded coordinator's
  // security.shard_identity, whose tokens may not join as workers ("" = any identity may).
  // Every method reads its request's bytes itself: one that does not parse is INVALID_ARGUMENT
  // naming the method and the message type (gRPC's generated handlers answer INTERNAL with no
  // message).
  CoordinatorService(CoreHandle& handle, Authenticator& auth, std::string shard_identity = "");

  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest*, v1::JoinReply*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatReply*) override;
  grpc::Status RequestTask(grpc::ServerContext*, const v1::TaskRequest*, v1::Task*) override;
  grpc::Status ReportEval(grpc::ServerContext*, const v1::EvalReport*, v1::EvalAck*) override;
  grpc::Status Leave(grpc::ServerContext*, const v1::LeaveRequest*, v1::LeaveReply*) override;

 private:
  CoreHandle& handle_;
  Authenticator& auth_;
  const std::string shard_identity_;
};

class ParameterServiceImpl final : public PushIngestService {
 public:
  // handle, auth, metrics and clock must outlive the service. max_receiving: at most this many
  // pushes are received at once (ServerConfig.max_staged_updates); a push beyond them waits
  // unread, up to 120 s on `clock`, then fails RESOURCE_EXHAUSTED. pull_delay: every Pull waits
  // this long before it streams (a slow link, for tests of overlapped communication).
  ParameterServiceImpl(CoreHandle& handle, Authenticator& auth, MetricsSink& metrics,
                       const Clock& clock, uint32_t max_receiving,
                       absl::Duration pull_delay = absl::ZeroDuration())
      : PushIngestService(auth, metrics, handle.spec(), std::nullopt, LayerGroupsOf(handle)),
        handle_(handle),
        auth_(auth),
        metrics_(metrics),
        receiving_(max_receiving, clock),
        pull_delay_(pull_delay) {}

  grpc::Status ServePull(grpc::ServerContext*, const v1::PullRequest*, PullStreamWriter*) override;

 private:
  // Counts a refused push in the core (aloe_updates_rejected_total) and returns its status.
  absl::Status Rejected(const absl::Status& status) override;
  // The owner and header checks, a receive slot, `read`, then the whole update submitted.
  absl::StatusOr<v1::PushReply> AcceptPush(const v1::PushHeader& header,
                                           const std::string& identity,
                                           const std::function<bool()>& cancelled,
                                           absl::FunctionRef<absl::Status(UpdateAssembler&)> read,
                                           absl::Time start) override;

  CoreHandle& handle_;
  Authenticator& auth_;
  MetricsSink& metrics_;
  ReceiveSlots receiving_;
  const absl::Duration pull_delay_;
};

}  // namespace aloe::server
