// The Push method of ParameterService read as raw messages and parsed in place
// (common/push_wire.h): a pushed chunk's payload goes from the received slices straight into
// the staging buffer, without the copy into a std::string that protobuf parsing makes. The
// wire format is unchanged.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/push_wire.h"
#include "proto/aloe.grpc.pb.h"

namespace aloe::server {

// A Push stream's messages, parsed as they are read.
class PushStreamReader {
 public:
  explicit PushStreamReader(grpc::ServerReaderInterface<grpc::ByteBuffer>* reader)
      : reader_(reader) {}

  // Reads the next message into *chunk, whose data views stay valid until the next Read: true.
  // False at the end of the stream, or for a message that does not parse, which status() then
  // names (kInvalidArgument).
  bool Read(PushChunkView* chunk);
  const absl::Status& status() const { return status_; }

 private:
  grpc::ServerReaderInterface<grpc::ByteBuffer>* reader_;
  grpc::ByteBuffer message_;
  std::vector<grpc::Slice> slices_;
  std::vector<std::string_view> pieces_;
  absl::Status status_;
};

// A ParameterService whose Push is served by ServePush(context, PushStreamReader*, reply) below.
class RawPushParameterService : public v1::ParameterService::Service {
 public:
  RawPushParameterService();

  virtual grpc::Status ServePush(grpc::ServerContext* context, PushStreamReader* reader,
                                 v1::PushReply* reply) = 0;

 private:
  // The generated handler is replaced in the constructor and never runs.
  grpc::Status Push(grpc::ServerContext*, grpc::ServerReader<v1::PushChunk>*, v1::PushReply*) final;
};

}  // namespace aloe::server
