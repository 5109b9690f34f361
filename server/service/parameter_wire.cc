#include "server/service/parameter_wire.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace aloe::server {
namespace {

// The methods' indices in ParameterService (proto/aloe.proto: Pull, Push).
constexpr int kPullMethodIndex = 0;
constexpr int kPushMethodIndex = 1;

using LayerBuffer = std::shared_ptr<const std::vector<float>>;

void ReleaseLayer(void* owner) { delete static_cast<LayerBuffer*>(owner); }

}  // namespace

bool PushStreamReader::Read() {
  if (!reader_->Read(&message_)) return false;
  slices_.clear();
  pieces_.clear();
  if (grpc::Status dumped = message_.Dump(&slices_); !dumped.ok()) {
    status_ = absl::InvalidArgumentError(
        absl::StrCat("unreadable push message: ", dumped.error_message()));
    return false;
  }
  for (const grpc::Slice& s : slices_) {
    pieces_.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  status_ = ParsePushChunk(pieces_, &chunk_);
  return status_.ok();
}

absl::StatusOr<v1::PushHeader> PushStreamReader::ReadHeader() {
  if (!Read()) {
    return status_.ok() ? absl::InvalidArgumentError("empty push stream") : status_;
  }
  if (!chunk_.has_header) {
    return absl::InvalidArgumentError("the first push message must carry the header");
  }
  return chunk_.header;
}

absl::Status PushStreamReader::ReadChunks(UpdateAssembler& assembler) {
  bool first = true;
  do {
    if (!first && chunk_.has_header) {
      return absl::InvalidArgumentError("push header repeated after the first message");
    }
    first = false;
    if (chunk_.has_header && chunk_.data_size == 0) continue;  // the header alone: no chunk
    ALOE_RETURN_IF_ERROR(assembler.AddChunk(chunk_.layer_id, chunk_.offset, chunk_.data,
                                            static_cast<v1::Codec>(chunk_.codec)));
  } while (Read());
  return status_;
}

grpc::ByteBuffer ParamChunkMessage(uint64_t version, uint32_t layer_id, LayerBuffer layer,
                                   size_t begin, size_t end, uint64_t group_version) {
  const size_t bytes = (end - begin) * sizeof(float);
  grpc::Slice parts[2] = {
      grpc::Slice(ParamChunkPrefix(version, layer_id, begin, layer->size(), bytes, group_version)),
      grpc::Slice()};
  if (bytes > 0) {
    float* data = const_cast<float*>(layer->data() + begin);  // read only: gRPC sends it
    parts[1] = grpc::Slice(data, bytes, &ReleaseLayer, new LayerBuffer(std::move(layer)));
  }
  return grpc::ByteBuffer(parts, bytes > 0 ? 2 : 1);
}

WireParameterService::WireParameterService() {
  MarkMethodStreamed(kPushMethodIndex,
                     new grpc::internal::ClientStreamingHandler<WireParameterService,
                                                                grpc::ByteBuffer, v1::PushReply>(
                         [](WireParameterService* service, grpc::ServerContext* context,
                            grpc::ServerReader<grpc::ByteBuffer>* reader, v1::PushReply* reply) {
                           PushStreamReader stream(reader);
                           return service->ServePush(context, &stream, reply);
                         },
                         this));
  // A server-streaming method whose handler reads its one request itself.
  MarkMethodStreamed(
      kPullMethodIndex,
      new grpc::internal::SplitServerStreamingHandler<v1::PullRequest, grpc::ByteBuffer>(
          [this](grpc::ServerContext* context,
                 grpc::ServerSplitStreamer<v1::PullRequest, grpc::ByteBuffer>* stream) {
            v1::PullRequest request;
            if (!stream->Read(&request)) {
              return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                  "pull: no request, or one that does not parse");
            }
            return ServePull(context, &request, stream);
          }));
}

grpc::Status WireParameterService::Push(grpc::ServerContext*, grpc::ServerReader<v1::PushChunk>*,
                                        v1::PushReply*) {
  return grpc::Status(grpc::StatusCode::INTERNAL, "the raw Push handler is not installed");
}

grpc::Status WireParameterService::Pull(grpc::ServerContext*, const v1::PullRequest*,
                                        grpc::ServerWriter<v1::ParamChunk>*) {
  return grpc::Status(grpc::StatusCode::INTERNAL, "the raw Pull handler is not installed");
}

}  // namespace aloe::server
