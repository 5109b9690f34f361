#include "server/service/grpc_services.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_format.h"
#include "common/model_spec.h"
#include "common/tensor_codec.h"
#include "server/core/server_metrics.h"
#include "server/core/update_assembler.h"

namespace aloe::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

namespace {

// Copies a successful StatusOr into *out, and converts the status either way.
template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* out) {
  if (result.ok()) *out = *std::move(result);
  return ToGrpcStatus(result.status());
}

// The caller's identity, and that it owns worker_id (when given).
absl::StatusOr<std::string> Authorize(const Authenticator& auth, const grpc::ServerContext& context,
                                      std::optional<uint64_t> worker_id) {
  absl::StatusOr<std::string> who = auth.Identify(context);
  if (who.ok() && worker_id) {
    absl::Status owner = auth.CheckOwner(*worker_id, *who);
    if (!owner.ok()) return owner;
  }
  return who;
}

}  // namespace

#define ALOE_AUTHORIZE(worker_id)                                               \
  absl::StatusOr<std::string> identity = Authorize(auth_, *context, worker_id); \
  if (!identity.ok()) return ToGrpcStatus(identity.status())

grpc::Status CoordinatorService::Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                                      v1::JoinReply* reply) {
  ALOE_AUTHORIZE(std::nullopt);
  if (auth_.enabled() && !shard_identity_.empty() && *identity == shard_identity_) {
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        absl::StrFormat("identity \"%s\" is the shard processes' (security.shard_identity): a "
                        "worker joins with a token of another identity",
                        shard_identity_));
  }
  absl::StatusOr<v1::JoinReply> joined =
      handle_.Run([&](ServerCore& core) { return core.Join(*request); });
  if (joined.ok()) auth_.Bind(joined->worker_id(), *identity);
  return Reply(std::move(joined), reply);
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext* context,
                                           const v1::HeartbeatRequest* request,
                                           v1::HeartbeatReply* reply) {
  ALOE_AUTHORIZE(request->worker_id());
  return Reply(handle_.Run([&](ServerCore& core) { return core.Heartbeat(*request); }), reply);
}

grpc::Status CoordinatorService::RequestTask(grpc::ServerContext* context,
                                             const v1::TaskRequest* request, v1::Task* reply) {
  ALOE_AUTHORIZE(request->worker_id());
  return Reply(handle_.RequestTask(*request, absl::Seconds(1)), reply);
}

grpc::Status CoordinatorService::ReportEval(grpc::ServerContext* context,
                                            const v1::EvalReport* request, v1::EvalAck*) {
  ALOE_AUTHORIZE(request->worker_id());
  return ToGrpcStatus(handle_.Run([&](ServerCore& core) { return core.ReportEval(*request); }));
}

grpc::Status CoordinatorService::Leave(grpc::ServerContext* context,
                                       const v1::LeaveRequest* request, v1::LeaveReply*) {
  ALOE_AUTHORIZE(request->worker_id());
  return ToGrpcStatus(handle_.Run([&](ServerCore& core) { return core.Leave(*request); }));
}

grpc::Status StreamSnapshot(grpc::ServerContext& context, const ModelSnapshot& snapshot,
                            uint32_t slice, uint32_t slices_requested, PullStreamWriter& writer,
                            MetricsSink& metrics) {
  uint64_t bytes = 0;
  // Whole layers, or one slice of each (validated by the caller).
  const uint32_t slices = std::max<uint32_t>(1, slices_requested);
  for (size_t layer = 0; layer < snapshot.layers.size(); ++layer) {
    if (snapshot.layers[layer] == nullptr) continue;  // another shard process's layer
    const std::vector<float>& params = *snapshot.layers[layer];
    const auto [first, last] = SliceRange(params.size(), slices, slice);
    for (auto [chunk_begin, chunk_end] : ChunkRanges(last - first)) {
      const size_t begin = first + chunk_begin;
      const size_t end = first + chunk_end;
      if (context.IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "pull cancelled");
      bytes += (end - begin) * sizeof(float);
      if (!writer.Write(ParamChunkMessage(snapshot.version, static_cast<uint32_t>(layer),
                                          snapshot.layers[layer], begin, end))) {
        return grpc::Status(grpc::StatusCode::CANCELLED, "client stopped reading the pull");
      }
    }
  }
  metrics.Add(kSentBytes, static_cast<double>(bytes), {CodecLabel(v1::CODEC_FP32)});
  return grpc::Status::OK;
}

void CountReceivedBytes(const UpdateAssembler& assembler, MetricsSink& metrics) {
  for (int codec = 0; codec < v1::Codec_ARRAYSIZE; ++codec) {
    if (const uint64_t bytes = assembler.bytes_by_codec()[codec]; bytes > 0) {
      metrics.Add(kReceivedBytes, static_cast<double>(bytes),
                  {CodecLabel(static_cast<v1::Codec>(codec))});
    }
  }
}

grpc::Status ParameterServiceImpl::ServePull(grpc::ServerContext* context,
                                             const v1::PullRequest* request,
                                             PullStreamWriter* writer) {
  ALOE_AUTHORIZE(request->worker_id());
  if (pull_delay_ > absl::ZeroDuration()) absl::SleepFor(pull_delay_);
  absl::StatusOr<ModelSnapshot> snapshot =
      handle_.Run([&](ServerCore& core) { return core.SnapshotFor(*request); });
  if (!snapshot.ok()) return ToGrpcStatus(snapshot.status());
  return StreamSnapshot(*context, *snapshot, request->slice(), request->slices(), *writer,
                        metrics_);
}

grpc::Status ParameterServiceImpl::ServePush(grpc::ServerContext* context, PushStreamReader* reader,
                                             v1::PushReply* reply) {
  const absl::Time start = absl::Now();
  auto reject = [&](const absl::Status& status) {
    handle_.Run([&](ServerCore& core) { core.CountRejected(status); });
    return ToGrpcStatus(status);
  };
  absl::StatusOr<std::string> identity = Authorize(auth_, *context, std::nullopt);
  if (!identity.ok()) return reject(identity.status());
  absl::StatusOr<v1::PushHeader> first = reader->ReadHeader();
  if (!first.ok()) return reject(first.status());
  const v1::PushHeader header = *std::move(first);
  if (absl::Status owner = auth_.CheckOwner(header.worker_id(), *identity); !owner.ok()) {
    return reject(owner);
  }
  std::shared_ptr<FloatBufferPool> buffers;
  absl::Status status = handle_.Run([&](ServerCore& core) {
    buffers = core.staging_buffers();
    return core.CheckPushHeader(header);
  });
  if (!status.ok()) return reject(status);

  UpdateAssembler assembler(handle_.spec(), header, std::nullopt, std::move(buffers));
  if (absl::Status read = reader->ReadChunks(assembler); !read.ok()) return reject(read);
  CountReceivedBytes(assembler, metrics_);

  absl::StatusOr<PendingUpdate> update = std::move(assembler).Finish();
  if (!update.ok()) return reject(update.status());
  absl::StatusOr<v1::PushReply> result =
      handle_.Run([&](ServerCore& core) { return core.SubmitUpdate(*std::move(update)); });
  metrics_.Observe(kPushLatency, absl::ToDoubleSeconds(absl::Now() - start));
  return Reply(std::move(result), reply);
}

}  // namespace aloe::server
