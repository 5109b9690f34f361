// gRPC adapters over the ServerCore: proto in, core call, proto out. No logic of their own
// beyond streaming: Pull streams a snapshot in <= 1 MiB chunks outside the core lock; Push
// assembles and validates chunks outside the lock, then submits the whole update at once.
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "proto/aloe.grpc.pb.h"
#include "server/core/update_assembler.h"
#include "server/service/auth.h"
#include "server/service/core_handle.h"
#include "server/service/parameter_wire.h"

namespace aloe::server {

// The one place where absl::Status becomes grpc::Status (the codes are numerically equal).
grpc::Status ToGrpcStatus(const absl::Status& status);

// Streams the layers of `snapshot` (skipping null ones: another shard process's) in <= 1 MiB
// chunks, whole or slice `slice` of `slices` of each (already validated), and counts the bytes.
// The payloads are sent from the snapshot's buffers (ParamChunkMessage).
grpc::Status StreamSnapshot(grpc::ServerContext& context, const ModelSnapshot& snapshot,
                            uint32_t slice, uint32_t slices, PullStreamWriter& writer,
                            MetricsSink& metrics);

// Adds the payload bytes an assembler accepted to the received-bytes metric, per codec.
void CountReceivedBytes(const UpdateAssembler& assembler, MetricsSink& metrics);

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  // handle and auth must outlive the service. shard_identity: a layer-sharded coordinator's
  // security.shard_identity, whose tokens may not join as workers ("" = any identity may).
  CoordinatorService(CoreHandle& handle, Authenticator& auth, std::string shard_identity = "")
      : handle_(handle), auth_(auth), shard_identity_(std::move(shard_identity)) {}

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

class ParameterServiceImpl final : public WireParameterService {
 public:
  // handle, auth and metrics must outlive the service. pull_delay: every Pull waits this long
  // before it streams (a slow link, for tests of overlapped communication).
  ParameterServiceImpl(CoreHandle& handle, Authenticator& auth, MetricsSink& metrics,
                       absl::Duration pull_delay = absl::ZeroDuration())
      : handle_(handle), auth_(auth), metrics_(metrics), pull_delay_(pull_delay) {}

  grpc::Status ServePull(grpc::ServerContext*, const v1::PullRequest*, PullStreamWriter*) override;
  grpc::Status ServePush(grpc::ServerContext*, PushStreamReader*, v1::PushReply*) override;

 private:
  CoreHandle& handle_;
  Authenticator& auth_;
  MetricsSink& metrics_;
  const absl::Duration pull_delay_;
};

}  // namespace aloe::server
