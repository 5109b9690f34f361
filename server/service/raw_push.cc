#include "server/service/raw_push.h"

#include "absl/strings/str_cat.h"

namespace aloe::server {
namespace {

// Push's index in ParameterService (proto/aloe.proto: Pull, Push).
constexpr int kPushMethodIndex = 1;

}  // namespace

bool PushStreamReader::Read(PushChunkView* chunk) {
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
  status_ = ParsePushChunk(pieces_, chunk);
  return status_.ok();
}

RawPushParameterService::RawPushParameterService() {
  MarkMethodStreamed(kPushMethodIndex,
                     new grpc::internal::ClientStreamingHandler<RawPushParameterService,
                                                                grpc::ByteBuffer, v1::PushReply>(
                         [](RawPushParameterService* service, grpc::ServerContext* context,
                            grpc::ServerReader<grpc::ByteBuffer>* reader, v1::PushReply* reply) {
                           PushStreamReader stream(reader);
                           return service->ServePush(context, &stream, reply);
                         },
                         this));
}

grpc::Status RawPushParameterService::Push(grpc::ServerContext*, grpc::ServerReader<v1::PushChunk>*,
                                           v1::PushReply*) {
  return grpc::Status(grpc::StatusCode::INTERNAL, "the raw Push handler is not installed");
}

}  // namespace aloe::server
