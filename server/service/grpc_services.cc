#include "server/service/grpc_services.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <functional>
#include <optional>

#include "absl/strings/str_format.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "server/core/server_metrics.h"
#include "server/core/update_assembler.h"

namespace aloe::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

namespace {

// How long a push waits for a receive slot (the shard processes wait as long for theirs).
constexpr absl::Duration kReceiveSlotWait = absl::Seconds(120);
// How long a task request is held while the answer is WAIT. A look-ahead request is held longer:
// its worker is training meanwhile, and the sync round or grace window it waits for closes when
// the other workers' pushes are in (a WAIT costs that worker one round without overlap). Both
// stay well below the worker's control deadline.
constexpr absl::Duration kTaskWait = absl::Seconds(1);
constexpr absl::Duration kAheadTaskWait = absl::Seconds(10);

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

// A handler for unary method `method` that parses the request itself and calls `serve`: a
// request that does not parse is INVALID_ARGUMENT naming the method and the message type.
// Registered with MarkMethodStreamed, which serves a unary call as a stream of one request and
// one reply; the client sees an ordinary unary call.
template <typename Request, typename Response>
grpc::internal::MethodHandler* ParsingUnaryHandler(
    const char* method,
    std::function<grpc::Status(grpc::ServerContext*, const Request*, Response*)> serve) {
  return new grpc::internal::StreamedUnaryHandler<grpc::ByteBuffer, Response>(
      [method, serve = std::move(serve)](
          grpc::ServerContext* context,
          grpc::ServerUnaryStreamer<grpc::ByteBuffer, Response>* stream) {
        grpc::ByteBuffer bytes;
        if (!stream->Read(&bytes)) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              absl::StrFormat("%s: no request", method));
        }
        Request request;
        grpc::ProtoBufferReader reader(&bytes);
        if (!request.ParseFromZeroCopyStream(&reader)) {
          return grpc::Status(
              grpc::StatusCode::INVALID_ARGUMENT,
              absl::StrFormat("%s: the request (%d bytes) does not parse as %s", method,
                              bytes.Length(), Request::descriptor()->full_name()));
        }
        Response response;
        grpc::Status status = serve(context, &request, &response);
        if (status.ok() && !stream->Write(response)) {
          return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
        }
        return status;
      });
}

}  // namespace

CoordinatorService::CoordinatorService(CoreHandle& handle, Authenticator& auth,
                                       std::string shard_identity)
    : handle_(handle), auth_(auth), shard_identity_(std::move(shard_identity)) {
  // The indices are the methods' order in coordinator_service.proto.
  MarkMethodStreamed(0, ParsingUnaryHandler<v1::JoinRequest, v1::JoinReply>(
                            "Join", [this](auto* c, auto* q, auto* r) { return Join(c, q, r); }));
  MarkMethodStreamed(
      1, ParsingUnaryHandler<v1::HeartbeatRequest, v1::HeartbeatReply>(
             "Heartbeat", [this](auto* c, auto* q, auto* r) { return Heartbeat(c, q, r); }));
  MarkMethodStreamed(
      2, ParsingUnaryHandler<v1::TaskRequest, v1::Task>(
             "RequestTask", [this](auto* c, auto* q, auto* r) { return RequestTask(c, q, r); }));
  MarkMethodStreamed(
      3, ParsingUnaryHandler<v1::EvalReport, v1::EvalAck>(
             "ReportEval", [this](auto* c, auto* q, auto* r) { return ReportEval(c, q, r); }));
  MarkMethodStreamed(4, ParsingUnaryHandler<v1::LeaveRequest, v1::LeaveReply>(
                            "Leave", [this](auto* c, auto* q, auto* r) { return Leave(c, q, r); }));
}

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
  return Reply(handle_.RequestTask(*request, request->ahead() ? kAheadTaskWait : kTaskWait), reply);
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
                            MetricsSink& metrics, const GroupPull* group) {
  uint64_t bytes = 0;
  // Whole layers, or one slice of each (validated by the caller).
  const uint32_t slices = std::max<uint32_t>(1, slices_requested);
  for (size_t layer = 0; layer < snapshot.layers.size(); ++layer) {
    if (snapshot.layers[layer] == nullptr) continue;  // another shard process's layer
    if (group != nullptr &&
        (layer >= group->layer_groups.size() || group->layer_groups[layer] != group->group)) {
      continue;
    }
    const std::vector<float>& params = *snapshot.layers[layer];
    const auto [first, last] = SliceRange(params.size(), slices, slice);
    for (auto [chunk_begin, chunk_end] : ChunkRanges(last - first)) {
      const size_t begin = first + chunk_begin;
      const size_t end = first + chunk_end;
      if (context.IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "pull cancelled");
      bytes += (end - begin) * sizeof(float);
      if (!writer.Write(ParamChunkMessage(snapshot.version, static_cast<uint32_t>(layer),
                                          snapshot.layers[layer], begin, end,
                                          group != nullptr ? group->version : 0))) {
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
  const std::vector<uint64_t>& by_layer = assembler.bytes_by_layer();
  for (size_t l = 0; l < by_layer.size(); ++l) {
    if (by_layer[l] > 0 && l < static_cast<size_t>(assembler.spec().layers_size())) {
      metrics.Add(kReceivedLayerBytes, static_cast<double>(by_layer[l]),
                  {assembler.spec().layers(static_cast<int>(l)).name()});
    }
  }
}

std::vector<uint32_t> LayerGroupsOf(CoreHandle& handle) {
  return handle.Run([](ServerCore& core) {
    return core.num_layer_groups() > 1 ? core.layer_groups() : std::vector<uint32_t>();
  });
}

absl::StatusOr<std::vector<RawPushRange>> CheckRawPush(const v1::ModelSpec& spec,
                                                       std::optional<uint32_t> shard,
                                                       const RawPushRequest& request,
                                                       absl::Span<const uint32_t> layer_groups) {
  const v1::PushHeader& header = request.header;
  if (layer_groups.empty() && (header.group() != 0 || header.task_continues())) {
    return absl::InvalidArgumentError(
        "raw push names a layer group, but this server synchronizes the whole model "
        "(partial_sync.groups is 1)");
  }
  if (!layer_groups.empty()) {
    const uint32_t groups = *std::max_element(layer_groups.begin(), layer_groups.end()) + 1;
    if (header.group() >= groups) {
      return absl::InvalidArgumentError(
          absl::StrFormat("raw push of layer group %d, the model has %d", header.group(), groups));
    }
  }
  if (header.codec() != v1::CODEC_FP32 && header.codec() != v1::CODEC_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "raw push: codec %s; raw pushes carry float32 only (push other codecs over gRPC)",
        v1::Codec_IsValid(header.codec()) ? v1::Codec_Name(header.codec())
                                          : std::to_string(header.codec())));
  }
  ALOE_RETURN_IF_ERROR(CheckSlice(header.slice(), header.slices()));
  std::vector<RawPushRange> ranges = RawPushRanges(spec, shard, header, layer_groups);
  const uint64_t expected = RawPushPayloadBytes(ranges);
  if (request.payload_bytes != expected) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "raw push: payload of %d bytes, but %s expects %d (float32 of its %d layers%s)",
        request.payload_bytes,
        shard ? absl::StrFormat("shard process %d", *shard) : std::string("the server"), expected,
        ranges.size(),
        header.slices() > 1 ? absl::StrFormat(", slice %d of %d", header.slice(), header.slices())
        : layer_groups.empty() ? ""
                               : absl::StrFormat(" in layer group %d", header.group())));
  }
  return ranges;
}

absl::Status ReadRawPayload(const std::vector<RawPushRange>& ranges, ByteReader& in,
                            UpdateAssembler& assembler) {
  constexpr size_t kBounceBytes = 256 << 10;
  // Uninitialized: every byte is received before it is read.
  const std::unique_ptr<char[]> bounce(new char[kBounceBytes]);
  for (const RawPushRange& range : ranges) {
    ALOE_RETURN_IF_ERROR(assembler.AddFp32Read(
        range.layer_id, range.first, range.count, absl::MakeSpan(bounce.get(), kBounceBytes),
        [&](char* to, size_t bytes) { return in.ReadExactly(to, bytes); }));
  }
  return absl::OkStatus();
}

grpc::Status ParameterServiceImpl::ServePull(grpc::ServerContext* context,
                                             const v1::PullRequest* request,
                                             PullStreamWriter* writer) {
  ALOE_AUTHORIZE(request->worker_id());
  if (request->by_group() && layer_groups().empty()) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrFormat("pull of layer group %d, but this server synchronizes the whole model "
                        "(partial_sync.groups is 1)",
                        request->group())));
  }
  if (pull_delay_ > absl::ZeroDuration()) absl::SleepFor(pull_delay_);
  absl::StatusOr<ModelSnapshot> snapshot =
      handle_.Run([&](ServerCore& core) { return core.SnapshotFor(*request); });
  if (!snapshot.ok()) return ToGrpcStatus(snapshot.status());
  if (!request->by_group()) {
    return StreamSnapshot(*context, *snapshot, request->slice(), request->slices(), *writer,
                          metrics_);
  }
  // SnapshotFor checked the group against the core's count.
  if (request->group() >= snapshot->group_versions.size()) {
    return ToGrpcStatus(absl::InternalError("the snapshot has no version of the layer group"));
  }
  const GroupPull group{layer_groups(), request->group(),
                        snapshot->group_versions[request->group()]};
  return StreamSnapshot(*context, *snapshot, request->slice(), request->slices(), *writer, metrics_,
                        &group);
}

absl::Status ParameterServiceImpl::Rejected(const absl::Status& status) {
  handle_.Run([&](ServerCore& core) { core.CountRejected(status); });
  return status;
}

absl::StatusOr<v1::PushReply> ParameterServiceImpl::AcceptPush(
    const v1::PushHeader& header, const std::string& identity,
    const std::function<bool()>& cancelled, absl::FunctionRef<absl::Status(UpdateAssembler&)> read,
    absl::Time start) {
  if (absl::Status owner = auth_.CheckOwner(header.worker_id(), identity); !owner.ok()) {
    return Rejected(owner);
  }
  std::shared_ptr<FloatBufferPool> buffers;
  bool squares = false;
  absl::Status status = handle_.Run([&](ServerCore& core) {
    buffers = core.staging_buffers();
    squares = core.wants_layer_squares();
    return core.CheckPushHeader(header);
  });
  if (!status.ok()) return Rejected(status);
  // Its staging buffers are taken only with a slot: memory stays bounded however many push.
  absl::StatusOr<ReceiveSlots::Slot> slot = receiving_.Acquire(cancelled, kReceiveSlotWait);
  if (!slot.ok()) return Rejected(slot.status());

  UpdateAssembler assembler(handle_.spec(), header, std::nullopt, std::move(buffers), squares,
                            layer_groups());
  if (absl::Status s = read(assembler); !s.ok()) return Rejected(s);
  CountReceivedBytes(assembler, metrics_);
  uint64_t received_bytes = 0;
  for (const uint64_t bytes : assembler.bytes_by_codec()) received_bytes += bytes;
  absl::StatusOr<PendingUpdate> update = std::move(assembler).Finish();
  if (!update.ok()) return Rejected(update.status());
  update->received_bytes = received_bytes;
  absl::StatusOr<v1::PushReply> result =
      handle_.Run([&](ServerCore& core) { return core.SubmitUpdate(*std::move(update)); });
  metrics_.Observe(kPushLatency, absl::ToDoubleSeconds(absl::Now() - start));
  return result;
}

}  // namespace aloe::server
